//! Putting a model's weights on a backend in their stored dtype, from GGUF or a Hugging Face
//! directory (the configuration is read by `config_gguf` and `config_hf`).
//!
//! The two formats differ in more than names, and those differences are settled here so
//! that the forward pass never sees them:
//! - llama.cpp's converter permutes the Q and K rows of LLaMA and Mistral so that rope
//!   rotates adjacent pairs; Hugging Face checkpoints rotate halves (`rotate_half`).
//! - Gemma's norms multiply by `1 + w`; the converter stores `1 + w`, Hugging Face `w`.
//! - GPT-2's Hugging Face weights are Conv1D, `[in, out]`; GGUF stores `[out, in]`.
//! - Llama 3 rope scaling is a formula in config.json, a `rope_freqs` tensor in GGUF.

use crate::config::{Arch, Ffn, ModelConfig};
use crate::source::{RawTensor, Role, Source};
use crate::weights::{FfnWeights, GateUp, LayerWeights, Linear, ModelWeights, NormWeights, Qkv};
use kiln_core::{quant, Backend, DType, Error, HostBytes, Result, Shape, Tensor};

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
            return Err(Error::format(format!(
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

    /// Linear layers that read one input (Q, K and V): their weights go up together, so
    /// that a backend may lay them end to end and read them as one matrix.
    fn linears_together(
        &self,
        layer: usize,
        parts: &[(Role, usize)],
        cols: usize,
    ) -> Result<Vec<Linear>> {
        let mut weights = Vec::with_capacity(parts.len());
        for &(role, rows) in parts {
            let (name, w) = self.require(role, layer, "weight")?;
            let w = if self.transpose_linear {
                transpose(w)?
            } else {
                w
            };
            self.check_shape(&name, &w, &[rows, cols])?;
            if let Some(p) = self.progress {
                p(w.bytes.len() as u64);
            }
            weights.push((w.dtype, w.shape, w.bytes));
        }
        let weights = self.backend.upload_together(weights)?;
        parts
            .iter()
            .zip(weights)
            .map(|(&(role, rows), w)| {
                let b = match self.get(role, layer, "bias")? {
                    Some((name, b)) => Some(self.vector(&name, b, rows, false)?),
                    None => None,
                };
                Ok(Linear { w, b })
            })
            .collect()
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
        self.check_shape(&name, &embed, &[self.src.embed_rows(c.vocab_size), c.dim])?;
        let embed = self.upload(embed)?;
        let pos_embed = match self.get(Role::PosEmbed, 0, "weight")? {
            // One row per position, as transformers and llama.cpp size the table: a
            // config that promises more positions than rows would index past it.
            Some((name, t)) => {
                self.check_shape(&name, &t, &[c.max_positions, c.dim])?;
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
                self.check_shape(&name, &t, &[self.src.output_rows(c.vocab_size), c.dim])?;
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
            let parts = [(Role::Q, qd), (Role::K, kvd), (Role::V, kvd)];
            let [q, k, v]: [Linear; 3] = self
                .linears_together(l, &parts, dim)?
                .try_into()
                .map_err(|_| Error::format("three projections asked, another count made"))?;
            Qkv::Split { q, k, v }
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
