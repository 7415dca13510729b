//! A model's configuration from a Hugging Face `config.json`, read as transformers reads it.

use crate::config::{
    Arch, ConfigKeys, KeyFormat, Llama3Scaling, ModelConfig, Norm, Rope, MAX_LAYERS,
};
use crate::config_gguf::{ffn_kind, unknown_arch};
use kiln_core::{Error, Result, RopeLayout};
use kiln_io::hf_config::{quote, HfConfig};
use serde_json::{Map, Value as Json};

/// The keys of one JSON object that `HfConfig` does not type: absent (or null) is `None`,
/// present with the wrong type an error that quotes it.
struct Keys<'a> {
    obj: Option<&'a Map<String, Json>>,
    /// `config.json` or `config.json: rope_scaling.`, for messages.
    file: &'a str,
    prefix: &'a str,
}

impl Keys<'_> {
    fn get<T>(&self, k: &str, read: fn(&Json) -> Option<T>, expected: &str) -> Result<Option<T>> {
        match self.obj.and_then(|o| o.get(k)).filter(|v| !v.is_null()) {
            None => Ok(None),
            Some(v) => read(v).map(Some).ok_or_else(|| {
                Error::format(format!(
                    "{}: {}{k} is {}, expected {expected}",
                    self.file,
                    self.prefix,
                    quote(v)
                ))
            }),
        }
    }

    fn float(&self, k: &str) -> Result<Option<f64>> {
        self.get(k, Json::as_f64, "a number")
    }
}

pub(crate) fn config_from_hf(c: &HfConfig, dir: &str) -> Result<ModelConfig> {
    let file = format!("{dir}/config.json");
    let arch_name = c
        .architecture()
        .ok_or_else(|| Error::format(format!("{file}: names no architecture")))?;
    let arch = Arch::from_name(arch_name)
        .or_else(|| c.model_type.as_deref().and_then(Arch::from_name))
        .ok_or_else(|| unknown_arch(arch_name, dir))?;
    let gpt2 = arch == Arch::Gpt2;
    let top = Keys {
        obj: c.raw.as_object(),
        file: &file,
        prefix: "",
    };
    let missing = |k: &str| Error::format(format!("{file}: {k} is missing"));
    let need = |v: Option<u64>, k: &str| v.map(|v| v as usize).ok_or_else(|| missing(k));
    let (dim_key, heads_key) = if gpt2 {
        ("n_embd", "n_head")
    } else {
        ("hidden_size", "num_attention_heads")
    };
    let dim = need(c.hidden_size, dim_key)?;
    let n_heads = need(c.num_attention_heads, heads_key)?;
    let n_layers = need(
        c.num_hidden_layers,
        if gpt2 { "n_layer" } else { "num_hidden_layers" },
    )?;
    // Bounded before anything is sized by it (the per-layer flags below).
    if n_layers > MAX_LAYERS {
        return Err(Error::format(format!(
            "{file}: num_hidden_layers is {n_layers}, expected 1 to {MAX_LAYERS}"
        )));
    }
    let head_dim = match c.head_dim {
        Some(d) => d as usize,
        // transformers' default: hidden_size // num_attention_heads.
        None if n_heads == 0 || n_heads > dim => {
            return Err(Error::format(format!(
                "{file}: {heads_key} is {n_heads}, expected 1 to {dim_key} {dim} (there is no head_dim)"
            )))
        }
        None => dim / n_heads,
    };
    // transformers 5 keeps rope settings in `rope_parameters`, older versions at top level
    // and in `rope_scaling`.
    let rope_params = c.raw.get("rope_parameters").and_then(Json::as_object);
    let params = Keys {
        obj: rope_params,
        file: &file,
        prefix: "rope_parameters.",
    };
    let (scaling_key, scaling) = match c.raw.get("rope_scaling").and_then(Json::as_object) {
        Some(s) => ("rope_scaling", Some(s)),
        None => ("rope_parameters", rope_params),
    };
    let scaled_prefix = format!("{scaling_key}.");
    let scaled = Keys {
        obj: scaling,
        file: &file,
        prefix: &scaled_prefix,
    };
    let rope_type = match scaled.get("rope_type", |v| v.as_str().map(str::to_owned), "a string")? {
        Some(t) => Some(t),
        None => scaled.get("type", |v| v.as_str().map(str::to_owned), "a string")?,
    };
    // transformers' "linear" divides the positions by its factor: every frequency slowed.
    let mut linear = None;
    let llama3 = match rope_type.as_deref() {
        Some("linear") => {
            let factor = scaled.float("factor")?.unwrap_or(1.0);
            if !(factor.is_finite() && factor > 0.0) {
                return Err(Error::format(format!(
                    "{file}: {scaled_prefix}factor is {factor}, expected a finite number > 0"
                )));
            }
            linear = Some(factor as f32);
            None
        }
        Some("llama3") => {
            let g = |k: &str, default: f32| -> Result<f32> {
                Ok(scaled.float(k)?.map_or(default, |v| v as f32))
            };
            Some(Llama3Scaling {
                factor: g("factor", 8.0)?,
                low_freq_factor: g("low_freq_factor", 1.0)?,
                high_freq_factor: g("high_freq_factor", 4.0)?,
                original_max_positions: g("original_max_position_embeddings", 8192.0)?,
            })
        }
        None | Some("default") => None,
        Some(other) => {
            return Err(Error::unsupported(format!(
                "{file}: rope scaling '{other}' is not supported"
            )))
        }
    };
    let theta = match c.rope_theta {
        Some(t) => Some(t),
        None => params.float("rope_theta")?,
    };
    let partial = match top.float("partial_rotary_factor")? {
        Some(p) => Some(p),
        None => params.float("partial_rotary_factor")?,
    };
    // A fraction of each head is rotated: more than all of it, or none, is no rope.
    if let Some(p) = partial.filter(|p| !(*p > 0.0 && *p <= 1.0)) {
        return Err(Error::format(format!(
            "{file}: partial_rotary_factor is {p}, expected a number in (0, 1]"
        )));
    }
    // int(head_dim * factor), as transformers: an odd count is refused by validation
    // (transformers fails on it too).
    let dims = (head_dim as f64 * partial.unwrap_or(1.0)) as usize;
    let rope = (!gpt2).then(|| Rope {
        theta: theta.unwrap_or(10000.0) as f32,
        dims,
        layout: RopeLayout::Neox,
        llama3,
        freq_factors: linear.map(|f| vec![f; dims / 2]),
    });
    let eps = c
        .rms_norm_eps
        .or(c.layer_norm_eps)
        .unwrap_or(if gpt2 { 1e-5 } else { 1e-6 }) as f32;
    let norm = if gpt2 {
        Norm::Layer { eps }
    } else {
        Norm::Rms { eps }
    };
    let attn_scale = match top.float("query_pre_attn_scalar")? {
        Some(s) if arch == Arch::Gemma2 => {
            if !(s.is_finite() && s > 0.0) {
                return Err(Error::format(format!(
                    "{file}: query_pre_attn_scalar is {s}, expected a finite number > 0"
                )));
            }
            1.0 / (s as f32).sqrt()
        }
        _ => 1.0 / (head_dim as f32).sqrt(),
    };
    let use_window = top
        .get("use_sliding_window", Json::as_bool, "true or false")?
        .unwrap_or(true);
    let sliding_window = c.sliding_window.map(|w| w as usize).filter(|&w| {
        w > 0
            && use_window
            && matches!(
                arch,
                Arch::Mistral | Arch::Gemma2 | Arch::Qwen2 | Arch::Phi3
            )
    });
    let layer_types = top.get(
        "layer_types",
        |v| {
            v.as_array()?
                .iter()
                .map(|t| t.as_str().map(|t| t == "sliding_attention"))
                .collect::<Option<Vec<bool>>>()
        },
        "a list of strings",
    )?;
    let sliding_layers = match layer_types {
        Some(types) if types.len() != n_layers => {
            return Err(Error::format(format!(
                "{file}: layer_types has {} entries, expected num_hidden_layers {n_layers}",
                types.len()
            )))
        }
        Some(types) => types,
        None => (0..n_layers)
            .map(|l| match arch {
                Arch::Gemma2 => l % 2 == 0,
                _ => sliding_window.is_some(),
            })
            .collect(),
    };
    let ffn_dim = match arch {
        Arch::Gpt2 => c
            .intermediate_size
            .map_or(dim.saturating_mul(4), |v| v as usize),
        _ => need(c.intermediate_size, "intermediate_size")?,
    };
    // transformers applies a softcap whenever it is not null.
    let softcap = |k: &str| -> Result<Option<f32>> {
        Ok(if arch == Arch::Gemma2 {
            top.float(k)?.map(|v| v as f32)
        } else {
            None
        })
    };
    let config = ModelConfig {
        arch,
        vocab_size: need(c.vocab_size, "vocab_size")?,
        dim,
        n_layers,
        n_heads,
        n_kv_heads: c.num_key_value_heads.map_or(n_heads, |v| v as usize),
        head_dim,
        ffn_dim,
        max_positions: c.max_position_embeddings.map_or(2048, |v| v as usize),
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
        file,
        format: KeyFormat::Hf {
            gpt2,
            scaling: scaling_key,
        },
    })?;
    Ok(config)
}
