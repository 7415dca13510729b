//! Whole models on the CPU backend with quantized weights in its interleaved layout
//! (Q4_0 and Q4_K in panels of 16 rows, chosen at upload on AVX2 and AVX-512 CPUs) against
//! the same weights kept in the file's layout (`CpuBackend::file_layout`): the same
//! integer sums in another order, so logits agree to float rounding and greedy picks are
//! the same. On CPUs without AVX2 both sides run the file's layout and the test says so.

use kiln_core::{quant, DType};
use kiln_cpu::CpuBackend;
use kiln_io::gguf::{GgufFile, GgufWriter};
use kiln_models::sampler::argmax;
use kiln_models::{Logits, Model, SyntheticShape, SyntheticType};
use std::path::Path;
use std::sync::Arc;

const PROMPT: &[u32] = &[1, 5, 17, 42, 100, 383, 7, 7, 250, 3, 64];
const DECODE_STEPS: usize = 4;

/// Every position's logits of `PROMPT`, then the last logits of each greedy decode step
/// (the picks returned beside them).
fn run(mut model: Model) -> (Vec<Vec<f32>>, Vec<u32>) {
    let mut cache = model.new_cache(64, DType::F32).unwrap();
    let mut out = vec![model.forward(PROMPT, 0, &mut cache, Logits::All).unwrap()];
    let vocab = model.config.vocab_size;
    let mut picks = Vec::new();
    for step in 0..DECODE_STEPS {
        let last = out.last().unwrap();
        let id = argmax(&last[last.len() - vocab..]);
        picks.push(id);
        let pos = PROMPT.len() + step;
        out.push(model.forward(&[id], pos, &mut cache, Logits::Last).unwrap());
    }
    (out, picks)
}

fn assert_same_model(name: &str, panels: Model, file: Model) {
    if !matches!(
        kiln_cpu::dot::isa(),
        kiln_cpu::dot::Isa::Avx2 | kiln_cpu::dot::Isa::Avx512Vnni
    ) {
        eprintln!("{name}: no AVX2 here, so no interleaved layout to compare");
    }
    let (a, pa) = run(panels);
    let (b, pb) = run(file);
    assert_eq!(pa, pb, "{name}: greedy picks");
    for (step, (a, b)) in a.iter().zip(&b).enumerate() {
        let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert!(scale > 0.0, "{name}: logits are all zero");
        let diff = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(
            diff <= 1e-4 * scale,
            "{name} step {step}: max |Δlogit| {diff} (largest logit {scale})"
        );
    }
}

/// The llama3 fixture (tied embeddings) quantized to Q4_0, its embedding too (llama.cpp
/// keeps a tied embedding at Q8_0): one Q4_0 weight is the embedding lookup's table and
/// the output head, in panels.
#[test]
fn tied_q4_0_embedding_in_panels_matches_the_files_layout() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/llama3");
    let src = GgufFile::open(dir.join("llama3-q4_0.gguf")).unwrap();
    assert!(
        src.tensor("output.weight").is_none(),
        "the fixture's embedding is tied"
    );
    let mut w = GgufWriter::new();
    for (k, v) in &src.metadata {
        w.set(k, v.clone()).unwrap();
    }
    for t in &src.tensors {
        let data = src.tensor_data(t).to_vec();
        if t.name == "token_embd.weight" {
            let shape = t.shape().unwrap();
            let values =
                quant::dequantize_to_vec(t.ggml_type.dtype().unwrap(), &data, shape.numel())
                    .unwrap();
            let q4 = quant::quantize(DType::Q4_0, &values).unwrap();
            w.add_tensor(&t.name, DType::Q4_0, shape.dims(), q4)
                .unwrap();
        } else {
            w.add_raw_tensor(&t.name, t.ggml_type, t.ne.clone(), data)
                .unwrap();
        }
    }
    let path = std::env::temp_dir().join(format!("kiln-cpu-layouts-{}.gguf", std::process::id()));
    w.write_file(&path).unwrap();
    let file = GgufFile::open(&path).unwrap();
    let backend = |b: CpuBackend| Arc::new(b);
    let panels = Model::from_gguf(&file, backend(CpuBackend::new(Some(2)).unwrap()), None);
    let plain = Model::from_gguf(
        &file,
        backend(CpuBackend::new(Some(2)).unwrap().file_layout()),
        None,
    );
    std::fs::remove_file(&path).unwrap();
    assert_same_model("llama3 tied Q4_0", panels.unwrap(), plain.unwrap());
}

/// A small random model in llama.cpp's Q4_K_M mix (Q4_K, with Q6_K for the output and
/// some `attn_v` / `ffn_down`), 390 tokens: a vocabulary that ends in a partial panel.
#[test]
fn q4_k_m_in_panels_matches_the_files_layout() {
    let mut config = SyntheticShape::TinyLlama.config();
    config.vocab_size = 390;
    config.dim = 256;
    config.n_heads = 4;
    config.n_kv_heads = 2;
    config.head_dim = 64;
    config.ffn_dim = 768;
    config.n_layers = 3;
    config.sliding_layers.truncate(3);
    config.attn_scale = 1.0 / 8.0;
    if let Some(rope) = config.rope.as_mut() {
        rope.dims = 64;
    }
    let model = |b: CpuBackend| {
        Model::synthetic_from_config(config.clone(), SyntheticType::Q4KM, Arc::new(b)).unwrap()
    };
    assert_same_model(
        "synthetic Q4_K_M",
        model(CpuBackend::new(Some(2)).unwrap()),
        model(CpuBackend::new(Some(2)).unwrap().file_layout()),
    );
}
