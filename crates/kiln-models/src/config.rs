//! What distinguishes one architecture from another, as data: the forward pass in
//! `model.rs` is one straight sequence of ops that reads these fields.

use kiln_core::RopeLayout;

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

#[derive(Clone, Debug)]
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
}
