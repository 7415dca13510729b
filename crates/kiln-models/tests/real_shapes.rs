//! The CUDA backend at real model shapes, against the CPU backend on the same weights.
//!
//! Launch sizes depend on a model's widths, its heads per KV head and the number of
//! tokens in a step, and the small fixtures of the other tests reach few of them. Here
//! random-weight models (built in memory, no files) of the tinyllama-1.1b and llama3-8b
//! shapes, and one with an odd head count (25 query heads sharing one KV head of 256
//! dimensions), keep [`LAYERS`] of their layers; for every weight type each runs prompts
//! of every length in [`PROMPT_LENGTHS`], each from position 0 and followed by
//! [`DECODE_STEPS`] one-token steps (the CPU's greedy pick fed to both). Every step's
//! last logits row is compared with the CPU's. One launch failure fails the test.
//!
//! # Error bounds
//!
//! The error of a step is `max |gpu - cpu|` over the vocabulary, divided by the RMS of
//! the CPU's logits (about 1.3 here: unit-RMS hidden states through N(0, 0.02) output
//! rows of 2048-4096 values). The bounds below hold each weight type with ~3x room over
//! the largest error measured on an H100 (session of 2026-11-23, see BENCHMARKS.md);
//! a wrong kernel (a skipped block, a misread scale, a race) gives errors of order 1.
//! Where the two backends' errors come from:
//! - F32: SGEMM (prompts) and the f32 matvec kernels (decode) sum in f32 in another
//!   order than the CPU: ~1e-5.
//! - F16, BF16: prompts go to cuBLAS with the activations rounded to the weights' type
//!   (f16: 2^-11 relative, bf16: 2^-8), which the CPU's f32 activations are not; decode
//!   reads f32 activations.
//! - Q8_0, Q4_0, Q4_K, Q6_K: the GPU's decode rounds activations to int8 per 32 values
//!   and its prompts round them to f16 against weights decoded to f16; the CPU rounds
//!   activations its own way. The weights' own quantization error is the same on both
//!   sides (same bytes), so it does not count here.

use kiln_core::{Backend, DType};
use kiln_cpu::CpuBackend;
use kiln_models::sampler::argmax;
use kiln_models::{Logits, Model, ModelConfig, SyntheticShape, SyntheticType};
use std::sync::Arc;

/// Layers kept of each shape: two, so that Q4_K_M's mix has a Q4_K layer and a layer
/// with Q6_K `attn_v` / `ffn_down` (llama.cpp's `use_more_bits` picks the last).
const LAYERS: usize = 2;

/// Around every power of two up to 512 (where kernels change tile counts, split counts
/// and the matvec/GEMM boundary), and every length up to 20 (the matvec batch kernels of
/// 1, 2, 4 and 8 rows, and just past them).
const PROMPT_LENGTHS: [std::ops::RangeInclusive<usize>; 6] =
    [1..=20, 31..=33, 63..=65, 127..=129, 255..=257, 511..=513];

const DECODE_STEPS: usize = 3;

/// Positions of the KV cache: room for the longest prompt and its steps.
const CONTEXT: usize = 1024;

/// The bound on a step's error (see the module's comment) for each weight type.
fn bound(ty: SyntheticType) -> f32 {
    match ty {
        SyntheticType::Uniform(DType::F32) => 1e-4,
        SyntheticType::Uniform(DType::F16) => 1e-2,
        SyntheticType::Uniform(DType::BF16) => 5e-2,
        _ => 5e-2,
    }
}

fn shapes() -> Vec<(&'static str, ModelConfig)> {
    let few_layers = |mut c: ModelConfig| {
        c.n_layers = LAYERS;
        c.sliding_layers.truncate(LAYERS);
        c
    };
    let tiny = few_layers(SyntheticShape::TinyLlama.config());
    let llama3 = few_layers(SyntheticShape::Llama3_8b.config());
    // 25 query heads on one KV head: an odd count and more heads per KV head than the
    // attention kernels' 16-warp tiles hold. 25 x 256 and 2304 are whole K-quant blocks.
    let mut odd = tiny.clone();
    odd.dim = 2304;
    odd.n_heads = 25;
    odd.n_kv_heads = 1;
    odd.head_dim = 256;
    odd.ffn_dim = 9216;
    odd.attn_scale = 1.0 / 16.0;
    if let Some(rope) = odd.rope.as_mut() {
        rope.dims = 256;
    }
    vec![
        ("tinyllama-1.1b", tiny),
        ("llama3-8b", llama3),
        ("25 heads / 1 kv", odd),
    ]
}

const TYPES: [SyntheticType; 7] = [
    SyntheticType::Uniform(DType::F32),
    SyntheticType::Uniform(DType::F16),
    SyntheticType::Uniform(DType::BF16),
    SyntheticType::Uniform(DType::Q8_0),
    SyntheticType::Uniform(DType::Q4_0),
    SyntheticType::Q4KM,
    SyntheticType::Uniform(DType::Q6_K),
];

/// Token ids spread over the vocabulary (a fixed xorshift draw).
fn token_ids(vocab: usize, n: usize) -> Vec<u32> {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % vocab as u64) as u32
        })
        .collect()
}

/// `max |gpu - cpu| / rms(cpu)`; infinite where the GPU's logits are not finite.
fn relative_error(gpu: &[f32], cpu: &[f32]) -> f32 {
    assert_eq!(gpu.len(), cpu.len());
    let rms = (cpu.iter().map(|v| v * v).sum::<f32>() / cpu.len() as f32).sqrt();
    let mut worst = 0.0f32;
    for (g, c) in gpu.iter().zip(cpu) {
        if !g.is_finite() {
            return f32::INFINITY;
        }
        worst = worst.max((g - c).abs());
    }
    worst / rms
}

/// The largest errors of one model's prompts and of its decode steps, and the first
/// step past the bound (or the error that stopped the run).
#[derive(Default)]
struct Sweep {
    prompt: f32,
    decode: f32,
    failure: Option<String>,
}

fn sweep(cpu: &mut Model, gpu: &mut Model, ids: &[u32], bound: f32) -> Sweep {
    let mut s = Sweep::default();
    let (mut cpu_cache, mut gpu_cache) = (
        cpu.new_cache(CONTEXT).unwrap(),
        gpu.new_cache(CONTEXT).unwrap(),
    );
    for len in PROMPT_LENGTHS.into_iter().flatten() {
        let mut step = ids[..len].to_vec();
        let mut pos = 0;
        for i in 0..=DECODE_STEPS {
            let want = cpu
                .forward(&step, pos, &mut cpu_cache, Logits::Last)
                .unwrap();
            let what = if i == 0 {
                format!("prompt of {len}")
            } else {
                format!("decode step {i} after a prompt of {len}")
            };
            let got = match gpu.forward(&step, pos, &mut gpu_cache, Logits::Last) {
                Ok(got) => got,
                Err(e) => {
                    s.failure = Some(format!("{what}: {e}"));
                    return s;
                }
            };
            let err = relative_error(&got, &want);
            let worst = if i == 0 { &mut s.prompt } else { &mut s.decode };
            *worst = worst.max(err);
            if err > bound && s.failure.is_none() {
                s.failure = Some(format!(
                    "{what}: error {err:.2e} over the bound {bound:.0e}"
                ));
            }
            pos += step.len();
            step = vec![argmax(&want)];
        }
    }
    s
}

#[test]
#[ignore = "needs a CUDA device"]
fn every_shape_type_and_prompt_length_matches_the_cpu() {
    let cpu_backend: Arc<dyn Backend> = Arc::new(CpuBackend::new(None).unwrap());
    let gpu_backend: Arc<dyn Backend> = Arc::new(kiln_cuda::CudaBackend::new(0).unwrap());
    let longest = PROMPT_LENGTHS.iter().map(|r| *r.end()).max().unwrap();
    let mut failures = Vec::new();
    println!("shape | type | largest error: prompts, decode steps | result");
    for (shape, config) in shapes() {
        let ids = token_ids(config.vocab_size, longest);
        for ty in TYPES {
            let model = |b: &Arc<dyn Backend>| {
                Model::synthetic_from_config(config.clone(), ty, b.clone()).unwrap()
            };
            let (mut cpu, mut gpu) = (model(&cpu_backend), model(&gpu_backend));
            let s = sweep(&mut cpu, &mut gpu, &ids, bound(ty));
            let result = match &s.failure {
                None => "pass".to_string(),
                Some(f) => {
                    failures.push(format!("{shape}, {}: {f}", ty.name()));
                    format!("FAIL: {f}")
                }
            };
            println!(
                "{shape} | {} | {:.1e}, {:.1e} | {result}",
                ty.name(),
                s.prompt,
                s.decode
            );
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
