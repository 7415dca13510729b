//! A model's configuration from GGUF metadata, under llama.cpp's keys.

use crate::config::{Arch, ConfigKeys, Ffn, KeyFormat, ModelConfig, Norm, Rope};
use kiln_core::{quant, DType, Error, Result, RopeLayout};
use kiln_io::gguf::{GgufFile, Value};

pub(crate) fn unknown_arch(name: &str, file: &str) -> Error {
    Error::unsupported(format!(
        "{file}: architecture '{name}' is not supported (kiln runs {})",
        Arch::SUPPORTED
    ))
}

pub(crate) fn ffn_kind(arch: Arch) -> Ffn {
    match arch {
        Arch::Gemma | Arch::Gemma2 => Ffn::GeGlu,
        Arch::Gpt2 => Ffn::Gelu,
        _ => Ffn::SwiGlu,
    }
}

/// The metadata of one file, read by key: absent is `None`, present with the wrong type
/// or sign an error that quotes it.
struct Metadata<'a> {
    f: &'a GgufFile,
    file: &'a str,
    arch: &'a str,
}

impl Metadata<'_> {
    fn key(&self, k: &str) -> String {
        format!("{}.{k}", self.arch)
    }

    fn wrong(&self, key: &str, v: &Value, expected: &str) -> Error {
        Error::format(format!(
            "{}: metadata {key} is {v} ({}), expected {expected}",
            self.file,
            v.value_type().name()
        ))
    }

    fn uint(&self, k: &str) -> Result<Option<usize>> {
        let key = self.key(k);
        match self.f.get(&key) {
            None => Ok(None),
            Some(v) => match v.as_u64() {
                Some(n) => Ok(Some(usize::try_from(n).unwrap_or(usize::MAX))),
                None => Err(self.wrong(&key, v, "a non-negative integer")),
            },
        }
    }

    fn need(&self, k: &str) -> Result<usize> {
        self.uint(k)?.ok_or_else(|| {
            Error::format(format!(
                "{}: metadata {} is missing",
                self.file,
                self.key(k)
            ))
        })
    }

    fn float(&self, k: &str) -> Result<Option<f32>> {
        let key = self.key(k);
        match self.f.get(&key) {
            None => Ok(None),
            Some(v) => match v.as_f64() {
                Some(x) => Ok(Some(x as f32)),
                None => Err(self.wrong(&key, v, "a number")),
            },
        }
    }
}

pub(crate) fn config_from_gguf(f: &GgufFile) -> Result<ModelConfig> {
    let file = f.path.display().to_string();
    let arch_name = match f.get("general.architecture") {
        None => {
            return Err(Error::format(format!(
                "{file}: metadata general.architecture is missing"
            )))
        }
        Some(Value::String(s)) => s.as_str(),
        Some(v) => {
            return Err(Error::format(format!(
                "{file}: metadata general.architecture is {v} ({}), expected a string",
                v.value_type().name()
            )))
        }
    };
    let arch = Arch::from_name(arch_name).ok_or_else(|| unknown_arch(arch_name, &file))?;
    let m = Metadata {
        f,
        file: &file,
        arch: arch_name,
    };
    let dim = m.need("embedding_length")?;
    let n_layers = m.need("block_count")?;
    // Every layer needs tensors of its own: more layers than tensors is a broken file.
    if n_layers > f.tensors.len() {
        return Err(Error::format(format!(
            "{file}: metadata {} is {n_layers}, but the file holds only {} tensors",
            m.key("block_count"),
            f.tensors.len()
        )));
    }
    let n_heads = m.need("attention.head_count")?;
    let n_kv_heads = m.uint("attention.head_count_kv")?.unwrap_or(n_heads);
    let head_dim = match m.uint("attention.key_length")? {
        Some(d) => d,
        // llama.cpp's default, as transformers': the embedding split evenly across heads.
        None if n_heads == 0 || n_heads > dim => {
            return Err(Error::format(format!(
                "{file}: metadata {} is {n_heads}, expected 1 to {} {dim} (there is no {})",
                m.key("attention.head_count"),
                m.key("embedding_length"),
                m.key("attention.key_length")
            )))
        }
        None => dim / n_heads,
    };
    let vocab_size = match f.tensor("token_embd.weight") {
        Some(t) => t.ne.get(1).copied().unwrap_or(0) as usize,
        None => return Err(Error::format(format!("{file}: no token_embd.weight"))),
    };
    let norm = if arch == Arch::Gpt2 {
        Norm::Layer {
            eps: m.float("attention.layer_norm_epsilon")?.unwrap_or(1e-5),
        }
    } else {
        Norm::Rms {
            eps: m.float("attention.layer_norm_rms_epsilon")?.unwrap_or(1e-5),
        }
    };
    let rope = if arch == Arch::Gpt2 {
        None
    } else {
        let mut freq_factors =
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
        let dims = m.uint("rope.dimension_count")?.unwrap_or(head_dim);
        // llama.cpp's rope scaling types: linear slows every frequency by its factor (as
        // transformers' "linear" divides the positions); YaRN is not run here.
        let scaling_key = m.key("rope.scaling.type");
        let scaling = match f.get(&scaling_key) {
            None => None,
            Some(v) => Some(
                v.as_str()
                    .ok_or_else(|| m.wrong(&scaling_key, v, "a string"))?,
            ),
        };
        match scaling {
            None | Some("none") => {}
            Some("linear") => {
                let factor = m.float("rope.scaling.factor")?.unwrap_or(1.0);
                if !(factor.is_finite() && factor > 0.0) {
                    return Err(Error::format(format!(
                        "{file}: metadata {} is {factor}, expected a positive number",
                        m.key("rope.scaling.factor")
                    )));
                }
                if factor != 1.0 {
                    if freq_factors.is_some() {
                        return Err(Error::unsupported(format!(
                            "{file}: linear rope scaling beside rope_freqs.weight"
                        )));
                    }
                    freq_factors = Some(vec![factor; dims / 2]);
                }
            }
            Some(other) => {
                return Err(Error::unsupported(format!(
                    "{file}: rope scaling '{other}' (kiln runs none and linear, and Llama 3's rope_freqs.weight)"
                )))
            }
        }
        Some(Rope {
            theta: m.float("rope.freq_base")?.unwrap_or(10000.0),
            dims,
            // llama.cpp rotates adjacent pairs for the models whose Q/K its converter permutes.
            layout: match arch {
                Arch::Llama | Arch::Mistral => RopeLayout::Interleaved,
                _ => RopeLayout::Neox,
            },
            llama3: None,
            freq_factors,
        })
    };
    // llama.cpp's Gemma 2 scale: 1/sqrt(head_dim), except the 27B (46 layers) which uses
    // dim / heads (its query_pre_attn_scalar); GGUF does not store the scalar.
    let attn_scale = if arch == Arch::Gemma2 && n_layers == 46 && n_heads > 0 {
        1.0 / ((dim / n_heads) as f32).sqrt()
    } else {
        1.0 / (head_dim as f32).sqrt()
    };
    // 0 turns the window and the softcaps off, as llama.cpp reads them.
    let sliding_window = m.uint("attention.sliding_window")?.filter(|&w| w > 0);
    let softcap = |k: &str| -> Result<Option<f32>> { Ok(m.float(k)?.filter(|&c| c != 0.0)) };
    let sliding_layers = (0..n_layers)
        .map(|l| match arch {
            Arch::Gemma2 => l % 2 == 0,
            _ => sliding_window.is_some(),
        })
        .collect();
    let config = ModelConfig {
        arch,
        vocab_size,
        dim,
        n_layers,
        n_heads,
        n_kv_heads,
        head_dim,
        ffn_dim: m.need("feed_forward_length")?,
        max_positions: m.uint("context_length")?.unwrap_or(2048),
        norm,
        ffn: ffn_kind(arch),
        rope,
        attn_scale,
        attn_softcap: softcap("attn_logit_softcapping")?,
        final_softcap: softcap("final_logit_softcapping")?,
        sliding_window,
        sliding_layers,
        embed_scale: matches!(arch, Arch::Gemma | Arch::Gemma2).then(|| (dim as f32).sqrt()),
        post_norms: arch == Arch::Gemma2,
    };
    config.validate(&ConfigKeys {
        file: file.clone(),
        format: KeyFormat::Gguf {
            arch: arch_name.to_string(),
        },
    })?;
    // kiln's attention reads keys and values of one width.
    if let Some(v) = m.uint("attention.value_length")? {
        if v != head_dim {
            return Err(Error::unsupported(format!(
                "{file}: metadata {} is {v} and the key length {head_dim}; kiln needs them equal",
                m.key("attention.value_length")
            )));
        }
    }
    Ok(config)
}
