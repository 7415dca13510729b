//! What distinguishes one architecture from another, as data: the forward pass in
//! `model.rs` is one straight sequence of ops that reads these fields.

use kiln_core::{Error, Result, RopeLayout};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Mistral,
    Qwen2,
    Gemma,
    Gemma2,
    Phi3,
    Gpt2,
}

impl Arch {
    /// From GGUF `general.architecture` or a Hugging Face `architectures` / `model_type`.
    pub fn from_name(name: &str) -> Option<Arch> {
        Some(match name {
            "llama" | "LlamaForCausalLM" => Arch::Llama,
            "mistral" | "MistralForCausalLM" => Arch::Mistral,
            "qwen2" | "Qwen2ForCausalLM" => Arch::Qwen2,
            "gemma" | "GemmaForCausalLM" => Arch::Gemma,
            "gemma2" | "Gemma2ForCausalLM" => Arch::Gemma2,
            "phi3" | "Phi3ForCausalLM" => Arch::Phi3,
            "gpt2" | "GPT2LMHeadModel" => Arch::Gpt2,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Mistral => "mistral",
            Arch::Qwen2 => "qwen2",
            Arch::Gemma => "gemma",
            Arch::Gemma2 => "gemma2",
            Arch::Phi3 => "phi3",
            Arch::Gpt2 => "gpt2",
        }
    }

    pub const SUPPORTED: &'static str = "llama, mistral, qwen2, gemma, gemma2, phi3, gpt2";
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Norm {
    Rms {
        eps: f32,
    },
    /// With bias (GPT-2).
    Layer {
        eps: f32,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ffn {
    /// `down(silu(gate(x)) * up(x))`.
    SwiGlu,
    /// `down(gelu(gate(x)) * up(x))` (Gemma).
    GeGlu,
    /// `down(gelu(up(x)))` with biases (GPT-2).
    Gelu,
}

/// Llama 3's frequency-dependent rope scaling.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Llama3Scaling {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_max_positions: f32,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Rope {
    pub theta: f32,
    /// Dimensions rotated per head (the rest pass through).
    pub dims: usize,
    pub layout: RopeLayout,
    pub llama3: Option<Llama3Scaling>,
    /// Per-frequency divisors stored in the file (GGUF `rope_freqs.weight`).
    pub freq_factors: Option<Vec<f32>>,
}

impl Rope {
    /// Inverse frequencies, one per rotated pair, as transformers computes them.
    pub fn inv_freq(&self) -> Vec<f32> {
        let half = self.dims / 2;
        (0..half)
            .map(|i| {
                let mut f = 1.0 / (self.theta as f64).powf(2.0 * i as f64 / self.dims as f64);
                if let Some(s) = self.llama3 {
                    f = llama3_scale(f, s);
                }
                if let Some(ff) = &self.freq_factors {
                    f /= ff.get(i).copied().unwrap_or(1.0) as f64;
                }
                f as f32
            })
            .collect()
    }
}

/// transformers' `_compute_llama3_parameters`: long wavelengths are slowed by `factor`,
/// short ones kept, and the band between blended.
fn llama3_scale(inv_freq: f64, s: Llama3Scaling) -> f64 {
    let pi = std::f64::consts::PI;
    let old = s.original_max_positions as f64;
    let low_wavelen = old / s.low_freq_factor as f64;
    let high_wavelen = old / s.high_freq_factor as f64;
    let wavelen = 2.0 * pi / inv_freq;
    if wavelen > low_wavelen {
        inv_freq / s.factor as f64
    } else if wavelen < high_wavelen {
        inv_freq
    } else {
        let smooth = (old / wavelen - s.low_freq_factor as f64)
            / (s.high_freq_factor as f64 - s.low_freq_factor as f64);
        (1.0 - smooth) * inv_freq / s.factor as f64 + smooth * inv_freq
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    pub vocab_size: usize,
    pub dim: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub ffn_dim: usize,
    /// Longest context the model was trained for.
    pub max_positions: usize,
    pub norm: Norm,
    pub ffn: Ffn,
    /// `None` for learned absolute positions (GPT-2).
    pub rope: Option<Rope>,
    /// Scales `q·k` (1/sqrt(head_dim), or Gemma 2's `query_pre_attn_scalar^-0.5`).
    pub attn_scale: f32,
    pub attn_softcap: Option<f32>,
    pub final_softcap: Option<f32>,
    /// Sliding-window size, and which layers use it (one flag per layer).
    pub sliding_window: Option<usize>,
    pub sliding_layers: Vec<bool>,
    /// Multiplies the embeddings (Gemma: sqrt(dim)).
    pub embed_scale: Option<f32>,
    /// Gemma 2 normalises the attention and FFN outputs before the residual add.
    pub post_norms: bool,
}

impl ModelConfig {
    pub fn layer_window(&self, layer: usize) -> Option<usize> {
        match self.sliding_layers.get(layer) {
            Some(true) => self.sliding_window,
            _ => None,
        }
    }

    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// Refuse a configuration that no model can have, before anything is sized by it:
    /// every size that sets an allocation or a loop bound within what kiln can hold (so
    /// products of sizes cannot wrap), every hyperparameter inside its domain. Messages
    /// name the file and the key as `keys` spells it.
    pub(crate) fn validate(&self, keys: &ConfigKeys) -> Result<()> {
        let bad = |field: Field, value: &dyn std::fmt::Display, allowed: &str| {
            Err(Error::format(format!(
                "{}: {} is {value}, expected {allowed}",
                keys.file,
                keys.name(field)
            )))
        };
        let size = |field: Field, v: usize, max: usize| {
            if (1..=max).contains(&v) {
                Ok(())
            } else {
                bad(field, &v, &format!("1 to {max}"))
            }
        };
        size(Field::Vocab, self.vocab_size, MAX_VOCAB)?;
        size(Field::Dim, self.dim, MAX_WIDTH)?;
        size(Field::Layers, self.n_layers, MAX_LAYERS)?;
        size(Field::Heads, self.n_heads, MAX_WIDTH)?;
        size(Field::HeadDim, self.head_dim, MAX_WIDTH)?;
        size(Field::FfnDim, self.ffn_dim, MAX_WIDTH)?;
        size(Field::MaxPositions, self.max_positions, MAX_POSITIONS)?;
        if self.n_kv_heads == 0 || !self.n_heads.is_multiple_of(self.n_kv_heads) {
            let allowed = format!("a divisor of {} {}", keys.name(Field::Heads), self.n_heads);
            return bad(Field::KvHeads, &self.n_kv_heads, &allowed);
        }
        // Q is n_heads × head_dim wide; checked so that a head_dim that wraps it to 0 (and
        // so matches zero-size tensors) cannot pass.
        match self.n_heads.checked_mul(self.head_dim) {
            Some(q) if q <= MAX_WIDTH => {}
            _ => {
                let allowed = format!(
                    "at most {} ({} {} × {} must not exceed {MAX_WIDTH})",
                    MAX_WIDTH / self.n_heads,
                    keys.name(Field::Heads),
                    self.n_heads,
                    keys.name(Field::HeadDim)
                );
                return bad(Field::HeadDim, &self.head_dim, &allowed);
            }
        }
        // A sliding window needs no bound: the attention kernels clamp it.
        if self.sliding_layers.len() != self.n_layers {
            return Err(Error::format(format!(
                "{}: {} sliding-window flags for {} layers",
                keys.file,
                self.sliding_layers.len(),
                self.n_layers
            )));
        }
        let eps = match self.norm {
            Norm::Rms { eps } | Norm::Layer { eps } => eps,
        };
        // 0 is allowed: transformers and PyTorch accept it, and it only matters for an
        // all-zero row; below 0 the root of a small variance is NaN.
        if !(eps.is_finite() && eps >= 0.0) {
            return bad(Field::NormEps, &eps, "a finite number ≥ 0");
        }
        let positive = |field: Field, v: f32| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                bad(field, &v, "a finite number > 0")
            }
        };
        if let Some(c) = self.attn_softcap {
            positive(Field::AttnSoftcap, c)?;
        }
        if let Some(c) = self.final_softcap {
            positive(Field::FinalSoftcap, c)?;
        }
        if !(self.attn_scale.is_finite() && self.attn_scale > 0.0) {
            return bad(Field::AttnScale, &self.attn_scale, "a finite number > 0");
        }
        if let Some(rope) = &self.rope {
            self.validate_rope(rope, keys)?;
        }
        Ok(())
    }

    fn validate_rope(&self, rope: &Rope, keys: &ConfigKeys) -> Result<()> {
        let bad = |field: Field, value: &dyn std::fmt::Display, allowed: &str| {
            Err(Error::format(format!(
                "{}: {} is {value}, expected {allowed}",
                keys.file,
                keys.name(field)
            )))
        };
        let positive = |field: Field, v: f32| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                bad(field, &v, "a finite number > 0")
            }
        };
        positive(Field::RopeTheta, rope.theta)?;
        if rope.dims < 2 || !rope.dims.is_multiple_of(2) || rope.dims > self.head_dim {
            let allowed = format!(
                "an even number from 2 to {} {}",
                keys.name(Field::HeadDim),
                self.head_dim
            );
            return bad(Field::RopeDims, &rope.dims, &allowed);
        }
        if let Some(s) = rope.llama3 {
            positive(Field::RopeFactor, s.factor)?;
            positive(Field::LowFreqFactor, s.low_freq_factor)?;
            // The band between the two is blended over high - low: equal divides by zero.
            if !(s.high_freq_factor.is_finite() && s.high_freq_factor > s.low_freq_factor) {
                let allowed = format!(
                    "a finite number above {} {}",
                    keys.name(Field::LowFreqFactor),
                    s.low_freq_factor
                );
                return bad(Field::HighFreqFactor, &s.high_freq_factor, &allowed);
            }
            positive(Field::OriginalMaxPositions, s.original_max_positions)?;
        }
        if let Some(ff) = &rope.freq_factors {
            if ff.len() != rope.dims / 2 {
                let allowed = format!("{} values (one per rotated pair)", rope.dims / 2);
                return bad(
                    Field::FreqFactors,
                    &format!("{} values", ff.len()),
                    &allowed,
                );
            }
            if let Some(v) = ff.iter().find(|v| !(v.is_finite() && **v > 0.0)) {
                return bad(
                    Field::FreqFactors,
                    &format!("holding {v}"),
                    "finite values > 0",
                );
            }
        }
        Ok(())
    }
}

/// Bounds on sizes, far above any published model and far below what overflows: the
/// widest (Llama 3.1 405B's FFN) is 53248, the largest vocabulary 262144, the longest
/// context 10M positions; products of two widths stay below 2^40.
pub(crate) const MAX_WIDTH: usize = 1 << 20;
pub(crate) const MAX_VOCAB: usize = 1 << 24;
pub(crate) const MAX_LAYERS: usize = 1 << 16;
pub(crate) const MAX_POSITIONS: usize = 1 << 24;

/// The fields of a configuration, for naming them as a file's format spells them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Field {
    Vocab,
    Dim,
    Layers,
    Heads,
    KvHeads,
    HeadDim,
    FfnDim,
    MaxPositions,
    NormEps,
    AttnSoftcap,
    FinalSoftcap,
    AttnScale,
    RopeTheta,
    RopeDims,
    RopeFactor,
    LowFreqFactor,
    HighFreqFactor,
    OriginalMaxPositions,
    FreqFactors,
}

/// Where a configuration came from: the file, and how its format spells each field.
pub(crate) struct ConfigKeys {
    pub file: String,
    pub format: KeyFormat,
}

pub(crate) enum KeyFormat {
    /// llama.cpp's keys, which start with the architecture's name.
    Gguf { arch: String },
    /// `config.json`: GPT-2 has names of its own; rope scaling sits in `rope_scaling` or
    /// (transformers 5) `rope_parameters`.
    Hf { gpt2: bool, scaling: &'static str },
}

impl ConfigKeys {
    pub fn name(&self, field: Field) -> String {
        use Field::*;
        match &self.format {
            KeyFormat::Gguf { arch } => {
                let key = match field {
                    Vocab => return "tensor token_embd.weight's row count".into(),
                    FreqFactors => return "tensor rope_freqs.weight".into(),
                    AttnScale => return "the attention scale".into(),
                    RopeFactor | LowFreqFactor | HighFreqFactor | OriginalMaxPositions => {
                        return format!("llama3 rope scaling's {field:?}")
                    }
                    Dim => "embedding_length",
                    Layers => "block_count",
                    Heads => "attention.head_count",
                    KvHeads => "attention.head_count_kv",
                    HeadDim => "attention.key_length",
                    FfnDim => "feed_forward_length",
                    MaxPositions => "context_length",
                    NormEps if arch == "gpt2" => "attention.layer_norm_epsilon",
                    NormEps => "attention.layer_norm_rms_epsilon",
                    AttnSoftcap => "attn_logit_softcapping",
                    FinalSoftcap => "final_logit_softcapping",
                    RopeTheta => "rope.freq_base",
                    RopeDims => "rope.dimension_count",
                };
                format!("{arch}.{key}")
            }
            KeyFormat::Hf { gpt2, scaling } => {
                let scaled = |k: &str| format!("{scaling}.{k}");
                match (field, gpt2) {
                    (Dim, true) => "n_embd".into(),
                    (Layers, true) => "n_layer".into(),
                    (Heads, true) => "n_head".into(),
                    (FfnDim, true) => "n_inner".into(),
                    (MaxPositions, true) => "n_positions".into(),
                    (NormEps, true) => "layer_norm_epsilon".into(),
                    (Vocab, _) => "vocab_size".into(),
                    (Dim, _) => "hidden_size".into(),
                    (Layers, _) => "num_hidden_layers".into(),
                    (Heads, _) => "num_attention_heads".into(),
                    (KvHeads, _) => "num_key_value_heads".into(),
                    (HeadDim, _) => "head_dim".into(),
                    (FfnDim, _) => "intermediate_size".into(),
                    (MaxPositions, _) => "max_position_embeddings".into(),
                    (NormEps, _) => "rms_norm_eps".into(),
                    (AttnSoftcap, _) => "attn_logit_softcapping".into(),
                    (FinalSoftcap, _) => "final_logit_softcapping".into(),
                    (AttnScale, _) => "the attention scale".into(),
                    (RopeTheta, _) => "rope_theta".into(),
                    (RopeDims, _) => "head_dim × partial_rotary_factor".into(),
                    (RopeFactor, _) => scaled("factor"),
                    (LowFreqFactor, _) => scaled("low_freq_factor"),
                    (HighFreqFactor, _) => scaled("high_freq_factor"),
                    (OriginalMaxPositions, _) => scaled("original_max_position_embeddings"),
                    (FreqFactors, _) => "rope frequency factors".into(),
                }
            }
        }
    }
}
