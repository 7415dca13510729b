//! A model split over several ranks (`kiln_models::tp`) computes what the whole model
//! does: the transformers-made fixtures of the LLaMA family, at 2 and 4 ranks, each rank a
//! CPU backend on a thread of its own, summing through host memory (kiln-dist's group,
//! standing in for NCCL with the same contract). Prompt logits at every position and a
//! few greedy decode steps, against the unsplit model's; the ranks' all-reduce adds the
//! partial sums in another order, so the bound is f32 rounding, not equality.

use kiln_core::{Backend, Collective, DType};
use kiln_cpu::CpuBackend;
use kiln_io::gguf::GgufFile;
use kiln_models::{Logits, Model};
use std::path::Path;
use std::sync::Arc;

fn fixture(name: &str) -> GgufFile {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name);
    GgufFile::open(path).unwrap()
}

const PROMPT: [u32; 9] = [1, 17, 250, 3, 99, 311, 42, 7, 120];
const STEPS: usize = 4;

/// The prompt's logits (every position), then those of `STEPS` greedy steps.
fn run(model: &mut Model) -> Vec<Vec<f32>> {
    let mut cache = model.new_cache(32, DType::F32).unwrap();
    let mut out = vec![model.forward(&PROMPT, 0, &mut cache, Logits::All).unwrap()];
    let vocab = model.config.vocab_size;
    for step in 0..STEPS {
        let last = &out[out.len() - 1];
        let row = &last[last.len() - vocab..];
        let next = (0..vocab)
            .max_by(|&a, &b| row[a].total_cmp(&row[b]))
            .unwrap() as u32;
        out.push(
            model
                .forward(&[next], PROMPT.len() + step, &mut cache, Logits::Last)
                .unwrap(),
        );
    }
    out
}

fn cpu() -> Arc<dyn Backend> {
    Arc::new(CpuBackend::new(Some(1)).unwrap())
}

/// Every rank's outputs, from `world` threads.
fn split_run(file: &str, world: usize) -> Vec<Vec<Vec<f32>>> {
    let backends: Vec<Arc<dyn Backend>> = (0..world).map(|_| cpu()).collect();
    let group = kiln_dist::host::group(backends.clone());
    let threads: Vec<_> = group
        .into_iter()
        .zip(backends)
        .map(|(c, b)| {
            let file = file.to_string();
            std::thread::spawn(move || {
                let collective: Arc<dyn Collective> = Arc::new(c);
                let mut m = Model::from_gguf_rank(&fixture(&file), b, collective).unwrap();
                run(&mut m)
            })
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}

fn check(file: &str, worlds: &[usize], bound: f32) {
    let mut whole = Model::from_gguf(&fixture(file), cpu(), None).unwrap();
    let want = run(&mut whole);
    for &world in worlds {
        let ranks = split_run(file, world);
        for (rank, got) in ranks.iter().enumerate() {
            // Every rank holds the same hidden state, so the same logits, to the bit.
            assert_eq!(
                got, &ranks[0],
                "{file} --tp {world}: rank {rank} differs from rank 0"
            );
        }
        for (step, (g, w)) in ranks[0].iter().zip(&want).enumerate() {
            let scale = w.iter().map(|v| v.abs()).fold(0f32, f32::max);
            let err = g
                .iter()
                .zip(w)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(
                err <= bound * scale,
                "{file} --tp {world}, output {step}: {err:e} off (largest logit {scale})"
            );
        }
    }
}

#[test]
fn llama_split_over_2_and_4_ranks_computes_the_whole_model() {
    // 4 heads over 2 K/V heads: at 4 ranks each K/V head is on two of them.
    check("llama/llama-f32.gguf", &[2, 4], 1e-5);
}

#[test]
fn llama3_and_mistral_split_over_2_ranks() {
    check("llama3/llama3-f32.gguf", &[2], 1e-5);
    check("mistral/mistral-f32.gguf", &[2], 1e-5);
}

#[test]
fn quantized_weights_split_on_their_blocks() {
    // Q8_0 at 2 ranks: every column range falls on a block of 32.
    check("llama/llama-q8_0.gguf", &[2], 1e-4);
    // At 4 ranks the output projection's 16 columns a rank would cut its blocks.
    let backends: Vec<Arc<dyn Backend>> = (0..4).map(|_| cpu()).collect();
    let c: Arc<dyn Collective> = Arc::new(kiln_dist::host::group(backends).remove(1));
    let err = Model::from_gguf_rank(&fixture("llama/llama-q8_0.gguf"), cpu(), c)
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains("cut its q8_0 blocks"), "{err}");
}

#[test]
fn models_outside_the_llama_family_are_refused() {
    let backends: Vec<Arc<dyn Backend>> = (0..2).map(|_| cpu()).collect();
    let c: Arc<dyn Collective> = Arc::new(kiln_dist::host::group(backends).remove(0));
    let err = Model::from_gguf_rank(&fixture("gpt2/gpt2-f32.gguf"), cpu(), c)
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains("LLaMA family"), "{err}");
}

/// The same on the GPUs of this machine, a rank on each of two, summing through NCCL and
/// then through the one-shot kernel over peer memory, against the unsplit model on the
/// first GPU (CUDA's own rounding: products in another order on each side).
#[test]
#[ignore = "needs a CUDA device"]
fn split_over_two_gpus_through_nccl_and_one_shot() {
    use kiln_cuda::{CudaBackend, NcclId, PeerBoard};
    let gpus = kiln_cuda::devices().unwrap().len();
    if gpus < 2 {
        eprintln!("SKIPPED: one GPU here; the split over GPUs needs two");
        return;
    }
    for file in ["llama/llama-f32.gguf", "llama3/llama3-f32.gguf"] {
        let gpu0: Arc<dyn Backend> = Arc::new(CudaBackend::new(0).unwrap());
        let want = run(&mut Model::from_gguf(&fixture(file), gpu0, None).unwrap());
        // NCCL for every sum, then the one-shot kernel for every sum it can take.
        for one_shot in [0, 1 << 20] {
            let id = NcclId::new().unwrap();
            let board = PeerBoard::with_max_bytes(2, Some(one_shot));
            let ranks: Vec<Vec<Vec<f32>>> = std::thread::scope(|s| {
                let handles: Vec<_> = (0..2)
                    .map(|rank| {
                        let (id, board) = (&id, &board);
                        s.spawn(move || {
                            let cuda = Arc::new(CudaBackend::new(rank).unwrap());
                            let c: Arc<dyn Collective> =
                                Arc::new(cuda.communicator_in_process(id, board, rank, 2).unwrap());
                            let mut m = Model::from_gguf_rank(&fixture(file), cuda, c).unwrap();
                            run(&mut m)
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            let how = if one_shot > 0 { "one-shot" } else { "NCCL" };
            assert_eq!(
                ranks[0], ranks[1],
                "{file}, {how}: the two ranks' logits differ"
            );
            for (step, (g, w)) in ranks[0].iter().zip(&want).enumerate() {
                let scale = w.iter().map(|v| v.abs()).fold(0f32, f32::max);
                let err = g
                    .iter()
                    .zip(w)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                println!("{file}, {how}, output {step}: {err:e} off (largest logit {scale})");
                assert!(
                    err <= 1e-4 * scale,
                    "{file}, {how}, output {step}: {err:e} off"
                );
            }
        }
    }
}
