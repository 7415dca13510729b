//! The whole model's gradient, through the tape, against central differences of its
//! loss: tiny models of each feature family the ops support (LLaMA with grouped-query
//! attention; Gemma 2's softcaps, sliding window, post-norms, GeGLU and scaled
//! embeddings; GPT-2's LayerNorm, biases, fused QKV, learned positions and GELU; Phi-3's
//! fused QKV and gate+up), over two sequences whose gradients accumulate, or that run
//! as one batch through a paged KV cache (as training's micro-batches do) whose block
//! tables are out of order.
//!
//! The forward pass is f32, so differences are taken along one direction per parameter
//! tensor (a change of the loss far above its rounding) and compared with the gradient's
//! projection on it. Each check also shows that a gradient 1% off would fail.

use kiln_core::{quant, Backend, DType, RopeLayout};
use kiln_cpu::CpuBackend;
use kiln_models::{Arch, BatchItem, Ffn, Model, ModelConfig, Norm, Rope, StepWant};
use kiln_train::init::{fresh_tensors, gguf_of};
use kiln_train::rng::Rng;
use kiln_train::Tape;
use std::sync::Arc;

fn config(arch: Arch) -> ModelConfig {
    let layers = 2;
    let mut c = ModelConfig {
        arch,
        vocab_size: 29,
        dim: 16,
        n_layers: layers,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 4,
        ffn_dim: 24,
        max_positions: 16,
        norm: Norm::Rms { eps: 1e-5 },
        ffn: Ffn::SwiGlu,
        rope: Some(Rope {
            theta: 10000.0,
            dims: 4,
            layout: RopeLayout::Interleaved,
            llama3: None,
            freq_factors: None,
        }),
        attn_scale: 0.5,
        attn_softcap: None,
        final_softcap: None,
        sliding_window: None,
        sliding_layers: vec![false; layers],
        embed_scale: None,
        post_norms: false,
    };
    match arch {
        Arch::Gemma2 => {
            c.ffn = Ffn::GeGlu;
            c.rope.as_mut().unwrap().layout = RopeLayout::Neox;
            c.attn_softcap = Some(1.5);
            c.final_softcap = Some(2.0);
            c.sliding_window = Some(3);
            c.sliding_layers = vec![true, false];
            c.embed_scale = Some(4.0);
            c.post_norms = true;
        }
        Arch::Gpt2 => {
            c.norm = Norm::Layer { eps: 1e-5 };
            c.ffn = Ffn::Gelu;
            c.rope = None;
        }
        Arch::Phi3 => c.rope.as_mut().unwrap().layout = RopeLayout::Neox,
        _ => {}
    }
    c
}

struct Setup {
    tape: Arc<Tape>,
    model: Model,
    seqs: Vec<(Vec<u32>, Vec<u32>)>,
    scale: f32,
    /// One forward pass over a paged cache for all sequences, instead of one each.
    batched: bool,
}

fn setup(arch: Arch, tied: bool, batched: bool) -> Setup {
    let c = config(arch);
    let mut rng = Rng::new(arch as u64 + 11);
    let mut tensors = fresh_tensors(&c, tied, 0.3, &mut rng);
    // Norms and biases off their starting values, so that their gradients are general.
    for t in tensors.iter_mut().filter(|t| t.dims.len() == 1) {
        let base = if t.name.ends_with(".bias") { 0.0 } else { 1.0 };
        t.values
            .iter_mut()
            .for_each(|v| *v = base + 0.3 * rng.normal() as f32);
    }
    let file = gguf_of(&c, &tensors, "gradient test", vec![]).unwrap();
    let cpu: Arc<dyn Backend> = Arc::new(CpuBackend::new(Some(2)).unwrap());
    let tape = Arc::new(Tape::new(cpu).unwrap());
    let model = Model::from_gguf(&file, tape.clone(), None).unwrap();
    let params: Vec<_> = model.parameters().into_iter().map(|(_, t)| t).collect();
    tape.set_parameters(&params, &vec![true; params.len()])
        .unwrap();
    let seq = |rng: &mut Rng| -> (Vec<u32>, Vec<u32>) {
        let ids: Vec<u32> = (0..8).map(|_| rng.below(29) as u32).collect();
        (ids[..7].to_vec(), ids[1..].to_vec())
    };
    let seqs = vec![seq(&mut rng), seq(&mut rng)];
    Setup {
        tape,
        model,
        seqs,
        scale: 1.0 / 14.0,
        batched,
    }
}

/// The mean loss over the sequences; with `record`, also their accumulated gradient.
fn loss(s: &mut Setup, record: bool) -> f64 {
    if s.batched {
        return batch_loss(s, record);
    }
    let softcap = s.model.config.final_softcap;
    let mut cache = s.model.new_cache(7, DType::F32).unwrap();
    let mut total = 0f64;
    for (ids, targets) in &s.seqs {
        if record {
            s.tape.begin();
        } else {
            s.tape.stop();
        }
        let tape = s.tape.clone();
        let losses = s
            .model
            .forward_hidden(ids, 0, &mut cache, |h, head| {
                tape.cross_entropy(h, head, targets, softcap, s.scale)
            })
            .unwrap();
        total += losses.iter().map(|&l| l as f64).sum::<f64>() * s.scale as f64;
        if record {
            let params: Vec<_> = s.model.parameters().into_iter().map(|(_, t)| t).collect();
            s.tape.backward(&params).unwrap();
        }
    }
    total
}

/// [`loss`] with the sequences in one pass: blocks of 3 positions, the 7 tokens of each
/// sequence in three blocks of a pool of 6, given out of order.
fn batch_loss(s: &mut Setup, record: bool) -> f64 {
    let softcap = s.model.config.final_softcap;
    let mut cache = s.model.new_paged_cache(6, 3, DType::F32).unwrap();
    let tables = [[4u32, 1, 2], [0, 5, 3]];
    let items: Vec<BatchItem> = s
        .seqs
        .iter()
        .zip(&tables)
        .map(|((ids, _), blocks)| BatchItem {
            tokens: ids,
            pos0: 0,
            blocks,
            want: StepWant::Nothing,
        })
        .collect();
    let targets: Vec<u32> = s.seqs.iter().flat_map(|(_, t)| t.iter().copied()).collect();
    if record {
        s.tape.begin();
    } else {
        s.tape.stop();
    }
    let tape = s.tape.clone();
    let losses = s
        .model
        .forward_hidden_batch(&items, &mut cache, |h, head| {
            tape.cross_entropy(h, head, &targets, softcap, s.scale)
        })
        .unwrap();
    if record {
        let params: Vec<_> = s.model.parameters().into_iter().map(|(_, t)| t).collect();
        s.tape.backward(&params).unwrap();
    }
    losses.iter().map(|&l| l as f64).sum::<f64>() * s.scale as f64
}

fn read(b: &dyn Backend, t: &kiln_core::Tensor) -> Vec<f32> {
    quant::dequantize_to_vec(DType::F32, &b.download(t).unwrap(), t.shape().numel()).unwrap()
}

fn set(s: &mut Setup, index: usize, values: &[f32]) {
    let inner = s.tape.inner().clone();
    let mut params = s.model.parameters_mut();
    inner
        .write(
            params[index].1,
            &quant::quantize(DType::F32, values).unwrap(),
        )
        .unwrap();
}

fn check_model(arch: Arch, tied: bool) {
    check(setup(arch, tied, false));
}

fn check(mut s: Setup) {
    let arch = s.model.config.arch;
    s.tape.zero_grads().unwrap();
    let base = loss(&mut s, true);
    let sizes: Vec<(String, usize)> = s
        .model
        .parameters()
        .into_iter()
        .map(|(n, t)| (n, t.shape().numel()))
        .collect();
    let mut grads = vec![0f32; sizes.iter().map(|(_, n)| n).sum()];
    s.tape.read_grads(&mut grads).unwrap();
    assert!(
        (loss(&mut s, false) - base).abs() < 1e-6,
        "{arch:?}: recording changed the loss"
    );
    let mut rng = Rng::new(5);
    let mut at = 0;
    for (index, (name, n)) in sizes.iter().enumerate() {
        let g = &grads[at..at + n];
        at += n;
        let theta = read(s.tape.inner().as_ref(), s.model.parameters()[index].1);
        // Half along the gradient, half random: a direction on which the loss surely
        // moves (a random one alone may be nearly orthogonal to the gradient), and on
        // which a gradient with the right size but wrong entries still shows.
        let unit = |v: Vec<f64>| {
            let norm = v.iter().map(|d| d * d).sum::<f64>().sqrt();
            v.into_iter().map(|d| d / norm).collect::<Vec<f64>>()
        };
        let towards = unit(g.iter().map(|&g| g as f64).collect());
        let random = unit((0..*n).map(|_| rng.normal()).collect());
        let dir = unit(towards.iter().zip(&random).map(|(a, b)| a + b).collect());
        let along: f64 = g.iter().zip(&dir).map(|(&g, d)| g as f64 * d).sum();
        // A step that moves the loss by about 2e-3: far above its f32 rounding, small
        // enough that the loss's curvature stays out of the differences.
        let eps = (2e-3 / along.abs()).min(1e-2);
        let moved = |sign: f64| -> Vec<f32> {
            theta
                .iter()
                .zip(&dir)
                .map(|(&t, d)| (t as f64 + sign * eps * d) as f32)
                .collect()
        };
        set(&mut s, index, &moved(1.0));
        let up = loss(&mut s, false);
        set(&mut s, index, &moved(-1.0));
        let down = loss(&mut s, false);
        set(&mut s, index, &theta);
        let fd = (up - down) / (2.0 * eps);
        // f32 rounding moves the loss by ~1e-7, the differences by ~1e-5 at most; the
        // gradients measured here agree to 5e-4.
        let tol = 2e-3 * fd.abs() + 1e-5;
        eprintln!("{arch:?} {name}: gradient·d {along:.6e}, differences {fd:.6e}");
        assert!(
            (along - fd).abs() <= tol,
            "{arch:?} {name}: the gradient along a random direction is {along:e}, central differences give {fd:e}"
        );
        assert!(
            (1.01 * along - fd).abs() > tol,
            "{arch:?} {name}: a gradient 1% off would pass (the directional change {fd:e} is too small to check)"
        );
    }
}

#[test]
fn llama_gradients_match_differences() {
    check_model(Arch::Llama, false);
}

#[test]
fn gemma2_gradients_match_differences() {
    check_model(Arch::Gemma2, true);
}

#[test]
fn gpt2_gradients_match_differences() {
    check_model(Arch::Gpt2, true);
}

#[test]
fn phi3_gradients_match_differences() {
    check_model(Arch::Phi3, false);
}

#[test]
fn batched_llama_gradients_match_differences() {
    check(setup(Arch::Llama, false, true));
}

#[test]
fn batched_gemma2_gradients_match_differences() {
    check(setup(Arch::Gemma2, true, true));
}

#[test]
fn batched_gpt2_gradients_match_differences() {
    check(setup(Arch::Gpt2, true, true));
}

/// One pass over the batch gives the gradient the sequences give one after another.
#[test]
fn a_batch_has_the_gradient_of_its_sequences() {
    let grads = |batched: bool| {
        let mut s = setup(Arch::Llama, false, batched);
        s.tape.zero_grads().unwrap();
        let l = loss(&mut s, true);
        let n = s
            .model
            .parameters()
            .iter()
            .map(|(_, t)| t.shape().numel())
            .sum();
        let mut g = vec![0f32; n];
        s.tape.read_grads(&mut g).unwrap();
        (l, g)
    };
    let ((l1, g1), (l2, g2)) = (grads(false), grads(true));
    assert!((l1 - l2).abs() < 1e-6, "losses {l1} and {l2}");
    let norm = g1.iter().map(|g| g * g).sum::<f32>().sqrt();
    let diff = g1
        .iter()
        .zip(&g2)
        .map(|(a, b)| (a - b) * (a - b))
        .sum::<f32>()
        .sqrt();
    assert!(
        diff <= 1e-5 * norm,
        "the gradients differ by {diff} (norm {norm})"
    );
}
