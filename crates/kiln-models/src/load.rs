//! Reading a model's configuration and weights from GGUF or a Hugging Face directory, and
//! putting the weights on a backend in their stored dtype.
//!
//! The two formats differ in more than names, and those differences are settled here so
//! that the forward pass never sees them:
//! - llama.cpp's converter permutes the Q and K rows of LLaMA and Mistral so that rope
//!   rotates adjacent pairs; Hugging Face checkpoints rotate halves (`rotate_half`).
//! - Gemma's norms multiply by `1 + w`; the converter stores `1 + w`, Hugging Face `w`.
//! - GPT-2's Hugging Face weights are Conv1D, `[in, out]`; GGUF stores `[out, in]`.
//! - Llama 3 rope scaling is a formula in config.json, a `rope_freqs` tensor in GGUF.

use crate::config::{Arch, Ffn, Llama3Scaling, ModelConfig, Norm, Rope};
use crate::source::{RawTensor, Role, Source};
use crate::weights::{FfnWeights, GateUp, LayerWeights, Linear, ModelWeights, NormWeights, Qkv};
use kiln_core::{quant, Backend, DType, Error, HostBytes, Result, RopeLayout, Shape, Tensor};
use kiln_io::gguf::GgufFile;
use kiln_io::hf_config::HfConfig;
use serde_json::Value as Json;

fn unknown_arch(name: &str, file: &str) -> Error {
    Error::unsupported(format!(
        "{file}: architecture '{name}' is not supported (kiln runs {})",
        Arch::SUPPORTED
    ))
}

pub(crate) fn config_from_gguf(f: &GgufFile) -> Result<ModelConfig> {
    let file = f.path.display().to_string();
    let arch_name = f
        .architecture()
        .ok_or_else(|| Error::format(format!("{file}: no general.architecture")))?;
    let arch = Arch::from_name(arch_name).ok_or_else(|| unknown_arch(arch_name, &file))?;
    let key = |k: &str| format!("{arch_name}.{k}");
    let int = |k: &str| f.get(&key(k)).and_then(|v| v.as_u64()).map(|v| v as usize);
    let float = |k: &str| f.get(&key(k)).and_then(|v| v.as_f64()).map(|v| v as f32);
    let need = |k: &str| {
        int(k).ok_or_else(|| Error::format(format!("{file}: metadata {} is missing", key(k))))
    };
    let dim = need("embedding_length")?;
    let n_layers = need("block_count")?;
    // Every layer needs tensors of its own: more layers than tensors is a broken file.
    if n_layers > f.tensors.len() {
        return Err(Error::format(format!(
            "{file}: block_count {n_layers} but only {} tensors",
            f.tensors.len()
        )));
    }
    let n_heads = need("attention.head_count")?;
    if n_heads == 0 || dim == 0 {
        return Err(Error::format(format!(
            "{file}: zero heads or embedding length"
        )));
    }
    let n_kv_heads = int("attention.head_count_kv").unwrap_or(n_heads);
    let head_dim = int("attention.key_length").unwrap_or(dim / n_heads);
    let vocab_size = match f.tensor("token_embd.weight") {
        Some(t) => t.ne.get(1).copied().unwrap_or(0) as usize,
        None => return Err(Error::format(format!("{file}: no token_embd.weight"))),
    };
    let norm = if arch == Arch::Gpt2 {
        Norm::Layer {
            eps: float("attention.layer_norm_epsilon").unwrap_or(1e-5),
        }
    } else {
        Norm::Rms {
            eps: float("attention.layer_norm_rms_epsilon").unwrap_or(1e-5),
        }
    };
    let rope = (arch != Arch::Gpt2).then(|| -> Result<Rope> {
        let freq_factors =
            match f.tensor("rope_freqs.weight") {
                Some(t) if t.ggml_type.dtype() == Some(DType::F32) => Some(
                    quant::dequantize_to_vec(DType::F32, f.tensor_data(t), t.numel() as usize)?,
                ),
                Some(t) => {
                    return Err(Error::format(format!(
                        "{file}: rope_freqs.weight is {}, expected f32",
                        t.ggml_type
                    )))
                }
                None => None,
            };
        Ok(Rope {
            theta: float("rope.freq_base").unwrap_or(10000.0),
            dims: int("rope.dimension_count").unwrap_or(head_dim),
            // llama.cpp rotates adjacent pairs for the models whose Q/K its converter permutes.
            layout: match arch {
                Arch::Llama | Arch::Mistral => RopeLayout::Interleaved,
                _ => RopeLayout::Neox,
            },
            llama3: None,
            freq_factors,
        })
    });
    let rope = rope.transpose()?;
    // llama.cpp's Gemma 2 scale: 1/sqrt(head_dim), except the 27B (46 layers) which uses
    // dim / heads (its query_pre_attn_scalar); GGUF does not store the scalar.
    let attn_scale = if arch == Arch::Gemma2 && n_layers == 46 {
        1.0 / ((dim / n_heads) as f32).sqrt()
    } else {
        1.0 / (head_dim as f32).sqrt()
    };
    let sliding_window = int("attention.sliding_window").filter(|&w| w > 0);
    let sliding_layers = (0..n_layers)
        .map(|l| match arch {
            Arch::Gemma2 => l % 2 == 0,
            _ => sliding_window.is_some(),
        })
        .collect();
    Ok(ModelConfig {
        arch,
        vocab_size,
        dim,
        n_layers,
        n_heads,
        n_kv_heads,
        head_dim,
        ffn_dim: need("feed_forward_length")?,
        max_positions: int("context_length").unwrap_or(2048),
        norm,
        ffn: ffn_kind(arch),
        rope,
        attn_scale,
        attn_softcap: float("attn_logit_softcapping").filter(|&c| c > 0.0),
        final_softcap: float("final_logit_softcapping").filter(|&c| c > 0.0),
        sliding_window,
        sliding_layers,
        embed_scale: matches!(arch, Arch::Gemma | Arch::Gemma2).then(|| (dim as f32).sqrt()),
        post_norms: arch == Arch::Gemma2,
    })
}

fn ffn_kind(arch: Arch) -> Ffn {
    match arch {
        Arch::Gemma | Arch::Gemma2 => Ffn::GeGlu,
        Arch::Gpt2 => Ffn::Gelu,
        _ => Ffn::SwiGlu,
    }
}

pub(crate) fn config_from_hf(c: &HfConfig, dir: &str) -> Result<ModelConfig> {
    let arch_name = c
        .architecture()
        .ok_or_else(|| Error::format(format!("{dir}: config.json names no architecture")))?;
    let arch = Arch::from_name(arch_name)
        .or_else(|| c.model_type.as_deref().and_then(Arch::from_name))
        .ok_or_else(|| unknown_arch(arch_name, dir))?;
    let raw = &c.raw;
    let need = |v: Option<u64>, what: &str| {
        v.map(|v| v as usize)
            .ok_or_else(|| Error::format(format!("{dir}: config.json has no {what}")))
    };
    let dim = need(c.hidden_size, "hidden_size")?;
    let n_heads = need(c.num_attention_heads, "num_attention_heads")?;
    if n_heads == 0 || dim == 0 {
        return Err(Error::format(format!("{dir}: zero heads or hidden size")));
    }
    let n_layers = need(c.num_hidden_layers, "num_hidden_layers")?;
    if n_layers > 1 << 16 {
        return Err(Error::format(format!(
            "{dir}: num_hidden_layers {n_layers} is not plausible"
        )));
    }
    let head_dim = c.head_dim.map(|v| v as usize).unwrap_or(dim / n_heads);
    let f = |k: &str| raw.get(k).and_then(Json::as_f64);
    // transformers 5 keeps rope settings in `rope_parameters`, older versions at top level
    // and in `rope_scaling`.
    let rope_params = raw.get("rope_parameters").filter(|v| v.is_object());
    let rp = |k: &str| rope_params.and_then(|p| p.get(k)).and_then(Json::as_f64);
    let scaling = raw
        .get("rope_scaling")
        .filter(|v| v.is_object())
        .or(rope_params);
    let rope_type = scaling
        .and_then(|s| s.get("rope_type").or_else(|| s.get("type")))
        .and_then(Json::as_str);
    let llama3 = match rope_type {
        Some("llama3") => {
            let s = scaling.expect("rope_type came from it");
            let g = |k: &str| s.get(k).and_then(Json::as_f64).map(|v| v as f32);
            Some(Llama3Scaling {
                factor: g("factor").unwrap_or(8.0),
                low_freq_factor: g("low_freq_factor").unwrap_or(1.0),
                high_freq_factor: g("high_freq_factor").unwrap_or(4.0),
                original_max_positions: g("original_max_position_embeddings").unwrap_or(8192.0),
            })
        }
        None | Some("default") => None,
        Some(other) => {
            return Err(Error::unsupported(format!(
                "{dir}: rope scaling '{other}' is not supported"
            )))
        }
    };
    let theta = c.rope_theta.or_else(|| rp("rope_theta")).unwrap_or(10000.0) as f32;
    let partial = f("partial_rotary_factor").unwrap_or(1.0);
    let rope = (arch != Arch::Gpt2).then_some(Rope {
        theta,
        dims: ((head_dim as f64 * partial) as usize) & !1,
        layout: RopeLayout::Neox,
        llama3,
        freq_factors: None,
    });
    let eps = c
        .rms_norm_eps
        .or(c.layer_norm_eps)
        .unwrap_or(if arch == Arch::Gpt2 { 1e-5 } else { 1e-6 }) as f32;
    let norm = if arch == Arch::Gpt2 {
        Norm::Layer { eps }
    } else {
        Norm::Rms { eps }
    };
    let attn_scale = match f("query_pre_attn_scalar") {
        Some(s) if arch == Arch::Gemma2 => 1.0 / (s as f32).sqrt(),
        _ => 1.0 / (head_dim as f32).sqrt(),
    };
    let use_window = raw
        .get("use_sliding_window")
        .and_then(Json::as_bool)
        .unwrap_or(true);
    let sliding_window = c.sliding_window.map(|w| w as usize).filter(|&w| {
        w > 0
            && use_window
            && matches!(
                arch,
                Arch::Mistral | Arch::Gemma2 | Arch::Qwen2 | Arch::Phi3
            )
    });
    let layer_types = raw.get("layer_types").and_then(Json::as_array);
    let sliding_layers = (0..n_layers)
        .map(|l| match (layer_types, arch) {
            (Some(types), _) => types.get(l).and_then(Json::as_str) == Some("sliding_attention"),
            (None, Arch::Gemma2) => l % 2 == 0,
            (None, _) => sliding_window.is_some(),
        })
        .collect();
    let ffn_dim = match arch {
        Arch::Gpt2 => c.intermediate_size.map(|v| v as usize).unwrap_or(4 * dim),
        _ => need(c.intermediate_size, "intermediate_size")?,
    };
    let softcap = |k: &str| f(k).map(|v| v as f32).filter(|&v| v > 0.0);
    Ok(ModelConfig {
        arch,
        vocab_size: need(c.vocab_size, "vocab_size")?,
        dim,
        n_layers,
        n_heads,
        n_kv_heads: c.num_key_value_heads.map(|v| v as usize).unwrap_or(n_heads),
        head_dim,
        ffn_dim,
        max_positions: c
            .max_position_embeddings
            .map(|v| v as usize)
            .unwrap_or(2048),
        norm,
        ffn: ffn_kind(arch),
        rope,
        attn_scale,
        attn_softcap: if arch == Arch::Gemma2 {
            softcap("attn_logit_softcapping")
        } else {
            None
        },
        final_softcap: if arch == Arch::Gemma2 {
            softcap("final_logit_softcapping")
        } else {
            None
        },
        sliding_window,
        sliding_layers,
        embed_scale: matches!(arch, Arch::Gemma | Arch::Gemma2).then(|| (dim as f32).sqrt()),
        post_norms: arch == Arch::Gemma2,
    })
}

/// Reads the tensors of one model from a source and uploads them.
pub(crate) struct WeightLoader<'a> {
    pub src: &'a dyn Source,
    pub backend: &'a dyn Backend,
    pub cfg: &'a ModelConfig,
    /// Hugging Face Gemma norms: add 1 at load.
    pub norm_plus_one: bool,
    /// Hugging Face GPT-2 Conv1D weights: transpose at load.
    pub transpose_linear: bool,
    /// Told the bytes of each tensor as it is uploaded.
    pub progress: Option<&'a dyn Fn(u64)>,
}

impl WeightLoader<'_> {
    /// Refuse, before uploading anything, a model the device has no room for.
    fn check_room(&self) -> Result<()> {
        let (Some(free), Some(need)) = (self.backend.free_memory()?, self.src.stored_bytes())
        else {
            return Ok(());
        };
        // Room for the weights plus a working margin (activations, KV cache, cuBLAS).
        let margin = 256u64 << 20;
        if need + margin > free as u64 {
            const GIB: f64 = (1u64 << 30) as f64;
            return Err(Error::Device(format!(
                "{}: the weights need {:.2} GiB (+{:.2} GiB working margin) of {} memory; {:.2} GiB is free",
                self.src.name(),
                need as f64 / GIB,
                margin as f64 / GIB,
                self.backend.device(),
                free as f64 / GIB
            )));
        }
        Ok(())
    }

    fn upload(&self, t: RawTensor) -> Result<Tensor> {
        if let Some(p) = self.progress {
            p(t.bytes.len() as u64);
        }
        self.backend.upload(t.dtype, t.shape, t.bytes)
    }

    fn name(&self, role: Role, layer: usize, suffix: &str) -> Option<String> {
        self.src
            .role_name(self.cfg.arch, role, layer)
            .map(|n| format!("{n}.{suffix}"))
    }

    fn get(&self, role: Role, layer: usize, suffix: &str) -> Result<Option<(String, RawTensor)>> {
        let Some(name) = self.name(role, layer, suffix) else {
            return Ok(None);
        };
        Ok(self.src.get(&name)?.map(|t| (name, t)))
    }

    fn require(&self, role: Role, layer: usize, suffix: &str) -> Result<(String, RawTensor)> {
        self.get(role, layer, suffix)?.ok_or_else(|| {
            Error::format(format!(
                "{}: tensor {} is missing",
                self.src.name(),
                self.name(role, layer, suffix)
                    .unwrap_or_else(|| format!("{role:?}"))
            ))
        })
    }

    fn check_shape(&self, name: &str, t: &RawTensor, want: &[usize]) -> Result<()> {
        if t.shape.dims() != want {
            return Err(Error::shape(format!(
                "{}: tensor {name} is {}, the config implies {want:?}",
                self.src.name(),
                t.shape
            )));
        }
        Ok(())
    }

    /// A weight matrix of `rows × cols` in its stored dtype.
    fn matrix(&self, name: &str, t: RawTensor, rows: usize, cols: usize) -> Result<Tensor> {
        let t = if self.transpose_linear {
            transpose(t)?
        } else {
            t
        };
        self.check_shape(name, &t, &[rows, cols])?;
        self.upload(t)
    }

    /// A 1-D parameter as F32 (norm weights and biases), `plus_one` for Gemma norms.
    fn vector(&self, name: &str, t: RawTensor, len: usize, plus_one: bool) -> Result<Tensor> {
        self.check_shape(name, &t, &[len])?;
        let mut v = quant::dequantize_to_vec(t.dtype, t.bytes.as_slice(), len)?;
        if plus_one {
            v.iter_mut().for_each(|x| *x += 1.0);
        }
        let bytes = quant::quantize(DType::F32, &v)?;
        self.backend.upload(
            DType::F32,
            Shape::new(vec![len])?,
            HostBytes::from_vec(bytes),
        )
    }

    fn linear(&self, role: Role, layer: usize, rows: usize, cols: usize) -> Result<Linear> {
        let (name, w) = self.require(role, layer, "weight")?;
        let w = self.matrix(&name, w, rows, cols)?;
        let b = match self.get(role, layer, "bias")? {
            Some((name, b)) => Some(self.vector(&name, b, rows, false)?),
            None => None,
        };
        Ok(Linear { w, b })
    }

    fn norm(&self, role: Role, layer: usize) -> Result<NormWeights> {
        let dim = self.cfg.dim;
        let (name, w) = self.require(role, layer, "weight")?;
        let w = self.vector(&name, w, dim, self.norm_plus_one)?;
        let b = match self.get(role, layer, "bias")? {
            Some((name, b)) => Some(self.vector(&name, b, dim, false)?),
            None => None,
        };
        Ok(NormWeights { w, b })
    }

    fn has(&self, role: Role, layer: usize) -> Result<bool> {
        Ok(self.get(role, layer, "weight")?.is_some())
    }

    pub fn load(&self) -> Result<ModelWeights> {
        let c = self.cfg;
        self.check_room()?;
        let (name, embed) = self.require(Role::Embed, 0, "weight")?;
        self.check_shape(&name, &embed, &[c.vocab_size, c.dim])?;
        let embed = self.upload(embed)?;
        let pos_embed = match self.get(Role::PosEmbed, 0, "weight")? {
            Some((name, t)) => {
                let rows = t.shape.dims().first().copied().unwrap_or(0);
                self.check_shape(&name, &t, &[rows, c.dim])?;
                Some(self.upload(t)?)
            }
            None if c.arch == Arch::Gpt2 => {
                return Err(Error::format(format!(
                    "{}: GPT-2 position embeddings are missing",
                    self.src.name()
                )))
            }
            None => None,
        };
        let mut layers = Vec::with_capacity(c.n_layers);
        for l in 0..c.n_layers {
            layers.push(self.layer(l)?);
        }
        let out_norm = self.norm(Role::OutNorm, 0)?;
        let output = match self.get(Role::Output, 0, "weight")? {
            Some((name, t)) => {
                // Never transposed: lm_head is a plain Linear even in GPT-2.
                self.check_shape(&name, &t, &[c.vocab_size, c.dim])?;
                Some(self.upload(t)?)
            }
            None => None,
        };
        let inv_freq = match &c.rope {
            Some(rope) => {
                let f = rope.inv_freq();
                let shape = Shape::new(vec![f.len()])?;
                Some(self.backend.upload(
                    DType::F32,
                    shape,
                    HostBytes::from_vec(quant::quantize(DType::F32, &f)?),
                )?)
            }
            None => None,
        };
        Ok(ModelWeights {
            embed,
            pos_embed,
            layers,
            out_norm,
            output,
            inv_freq,
        })
    }

    fn layer(&self, l: usize) -> Result<LayerWeights> {
        let c = self.cfg;
        let (qd, kvd, dim, ffn) = (c.q_dim(), c.kv_dim(), c.dim, c.ffn_dim);
        let qkv = if self.has(Role::Qkv, l)? {
            Qkv::Fused(self.linear(Role::Qkv, l, qd + 2 * kvd, dim)?)
        } else {
            Qkv::Split {
                q: self.linear(Role::Q, l, qd, dim)?,
                k: self.linear(Role::K, l, kvd, dim)?,
                v: self.linear(Role::V, l, kvd, dim)?,
            }
        };
        let ffn_weights = match c.ffn {
            Ffn::Gelu => FfnWeights::Plain {
                up: self.linear(Role::Up, l, ffn, dim)?,
                down: self.linear(Role::Down, l, dim, ffn)?,
            },
            Ffn::SwiGlu | Ffn::GeGlu => {
                let gate_up = if c.arch == Arch::Phi3 {
                    GateUp::Fused(self.linear(Role::GateUp, l, 2 * ffn, dim)?)
                } else {
                    GateUp::Split {
                        gate: self.linear(Role::Gate, l, ffn, dim)?,
                        up: self.linear(Role::Up, l, ffn, dim)?,
                    }
                };
                FfnWeights::Gated {
                    gate_up,
                    down: self.linear(Role::Down, l, dim, ffn)?,
                }
            }
        };
        Ok(LayerWeights {
            attn_norm: self.norm(Role::AttnNorm, l)?,
            qkv,
            o: self.linear(Role::O, l, dim, qd)?,
            post_attn_norm: if c.post_norms {
                Some(self.norm(Role::PostAttnNorm, l)?)
            } else {
                None
            },
            ffn_norm: self.norm(Role::FfnNorm, l)?,
            ffn: ffn_weights,
            post_ffn_norm: if c.post_norms {
                Some(self.norm(Role::PostFfnNorm, l)?)
            } else {
                None
            },
        })
    }
}

/// Transpose a 2-D tensor of plain floats on the host (GPT-2's Conv1D weights).
fn transpose(t: RawTensor) -> Result<RawTensor> {
    let &[rows, cols] = t.shape.dims() else {
        return Ok(t); // biases and vectors pass through
    };
    let size = t.dtype.block_bytes();
    if t.dtype.is_quantized() {
        return Err(Error::unsupported("transposing a quantized tensor"));
    }
    let src = t.bytes.as_slice();
    let mut out = vec![0u8; src.len()];
    for r in 0..rows {
        for c in 0..cols {
            let from = (r * cols + c) * size;
            let to = (c * rows + r) * size;
            out[to..to + size].copy_from_slice(&src[from..from + size]);
        }
    }
    Ok(RawTensor {
        dtype: t.dtype,
        shape: Shape::new(vec![cols, rows])?,
        bytes: HostBytes::from_vec(out),
    })
}
