//! Fresh weights for a configuration, under GGUF's names and conventions: matrices drawn
//! from N(0, std) (transformers' default std is 0.02), norms 1 (Gemma's `1 + w` with
//! `w = 0`), biases 0, as transformers initialises these models.

use crate::rng::Rng;
use kiln_core::{quant, DType, Error, Result};
use kiln_io::gguf::{GgufFile, GgufWriter, Value};
use kiln_models::{gguf_writer, Arch, Ffn, Model, ModelConfig, Norm};

/// One tensor: its GGUF name, shape (outermost first) and values.
pub struct NamedTensor {
    pub name: String,
    pub dims: Vec<usize>,
    pub values: Vec<f32>,
}

/// Every tensor a model of `config` has, freshly drawn. `tied`: no output projection
/// (the embeddings serve).
pub fn fresh_tensors(
    config: &ModelConfig,
    tied: bool,
    std: f32,
    rng: &mut Rng,
) -> Vec<NamedTensor> {
    let c = config;
    let mut matrix = |name: String, rows: usize, cols: usize| {
        let values = (0..rows * cols)
            .map(|_| (rng.normal() * std as f64) as f32)
            .collect();
        NamedTensor {
            name,
            dims: vec![rows, cols],
            values,
        }
    };
    let vector = |name: String, len: usize, value: f32| NamedTensor {
        name,
        dims: vec![len],
        values: vec![value; len],
    };
    let layer_norm = matches!(c.norm, Norm::Layer { .. });
    // GPT-2's linears all have biases; Qwen 2's Q, K and V.
    let bias_all = c.arch == Arch::Gpt2;
    let bias_qkv = bias_all || c.arch == Arch::Qwen2;
    let mut tensors = vec![matrix("token_embd.weight".into(), c.vocab_size, c.dim)];
    if c.rope.is_none() {
        tensors.push(matrix(
            "position_embd.weight".into(),
            c.max_positions,
            c.dim,
        ));
    }
    let norm = |tensors: &mut Vec<NamedTensor>, name: String| {
        tensors.push(vector(format!("{name}.weight"), c.dim, 1.0));
        if layer_norm {
            tensors.push(vector(format!("{name}.bias"), c.dim, 0.0));
        }
    };
    let (q, kv, dim, ffn) = (c.q_dim(), c.kv_dim(), c.dim, c.ffn_dim);
    for l in 0..c.n_layers {
        let blk = |n: &str| format!("blk.{l}.{n}");
        let mut linear = |tensors: &mut Vec<NamedTensor>, name: &str, rows, cols, bias: bool| {
            tensors.push(matrix(blk(&format!("{name}.weight")), rows, cols));
            if bias {
                tensors.push(vector(blk(&format!("{name}.bias")), rows, 0.0));
            }
        };
        norm(&mut tensors, blk("attn_norm"));
        if matches!(c.arch, Arch::Gpt2 | Arch::Phi3) {
            linear(&mut tensors, "attn_qkv", q + 2 * kv, dim, bias_qkv);
        } else {
            linear(&mut tensors, "attn_q", q, dim, bias_qkv);
            linear(&mut tensors, "attn_k", kv, dim, bias_qkv);
            linear(&mut tensors, "attn_v", kv, dim, bias_qkv);
        }
        linear(&mut tensors, "attn_output", dim, q, bias_all);
        if c.post_norms {
            norm(&mut tensors, blk("post_attention_norm"));
        }
        norm(&mut tensors, blk("ffn_norm"));
        match c.ffn {
            Ffn::Gelu => linear(&mut tensors, "ffn_up", ffn, dim, bias_all),
            // Phi-3's gate and up are one matrix, stored as ffn_up.
            _ if c.arch == Arch::Phi3 => linear(&mut tensors, "ffn_up", 2 * ffn, dim, false),
            _ => {
                linear(&mut tensors, "ffn_gate", ffn, dim, false);
                linear(&mut tensors, "ffn_up", ffn, dim, false);
            }
        }
        linear(&mut tensors, "ffn_down", dim, ffn, bias_all);
        if c.post_norms {
            norm(&mut tensors, blk("post_ffw_norm"));
        }
    }
    norm(&mut tensors, "output_norm".into());
    if !tied {
        tensors.push(matrix("output.weight".into(), c.vocab_size, c.dim));
    }
    tensors
}

/// A fresh model of `config` to start a run from (see [`fresh_tensors`]), as an F32 GGUF
/// file in memory with `extra` metadata (the tokenizer's).
pub fn scratch_start(
    config: &ModelConfig,
    tied: bool,
    std: f32,
    seed: u64,
    name: &str,
    extra: Vec<(String, Value)>,
) -> Result<GgufFile> {
    let tensors = fresh_tensors(config, tied, std, &mut Rng::new(seed));
    gguf_of(config, &tensors, name, extra)
}

/// `model` (any weight types, any file it came from) as an F32 GGUF file in memory with
/// `extra` metadata, to start a run from: a full fine-tune, or LoRA on a backend whose
/// backward reads F32 weights alone.
pub fn model_start(model: &Model, name: &str, extra: Vec<(String, Value)>) -> Result<GgufFile> {
    let mut export = model.to_gguf(name, DType::F32)?;
    set_all(&mut export.writer, extra)?;
    in_memory(name, |b| export.write_to(b))
}

/// `model` with `extra` metadata as a GGUF file written to `path` (atomically, a tensor
/// at a time) and mapped, every weight in the type it has (a quantized model stays
/// quantized, at a quarter of F32's memory or less; F16 and BF16 at half): the start of
/// a LoRA run, whose model is frozen, on a backend whose backward reads those types
/// ([`kiln_core::GradOps::frozen_as_stored`]), from a model that is not such a file
/// already (a Hugging Face directory).
pub fn frozen_start(
    model: &Model,
    name: &str,
    extra: Vec<(String, Value)>,
    path: &std::path::Path,
) -> Result<GgufFile> {
    let mut export = model.to_gguf_as_stored_later(name)?;
    set_all(&mut export.writer, extra)?;
    kiln_io::file::write_replacing(path, |b| export.write_to(b))?;
    GgufFile::open(path)
}

fn set_all(w: &mut GgufWriter, extra: Vec<(String, Value)>) -> Result<()> {
    extra.into_iter().try_for_each(|(k, v)| w.set(&k, v))
}

/// The GGUF file `write` writes, held in memory.
fn in_memory(
    name: &str,
    write: impl FnOnce(&mut Vec<u8>) -> std::io::Result<()>,
) -> Result<GgufFile> {
    let mut bytes = Vec::new();
    write(&mut bytes).map_err(|e| Error::Device(format!("writing a model to memory: {e}")))?;
    GgufFile::from_bytes(format!("<{name}>"), bytes)
}

/// A GGUF file (in memory) of `config` holding `tensors` as F32, named `name`, with
/// `extra` metadata (a tokenizer's): what a fresh model is loaded from.
pub fn gguf_of(
    config: &ModelConfig,
    tensors: &[NamedTensor],
    name: &str,
    extra: Vec<(String, Value)>,
) -> Result<GgufFile> {
    let mut w = gguf_writer(config, name)?;
    for (k, v) in extra {
        w.set(&k, v)?;
    }
    for t in tensors {
        w.add_tensor(
            &t.name,
            DType::F32,
            &t.dims,
            quant::quantize(DType::F32, &t.values)?,
        )?;
    }
    let mut bytes = Vec::new();
    w.write_to(&mut bytes)
        .map_err(|e| Error::Device(format!("writing a model to memory: {e}")))?;
    GgufFile::from_bytes(format!("<{name}>"), bytes)
}
