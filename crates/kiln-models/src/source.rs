//! Where a model's tensors come from: a GGUF file or a Hugging Face checkpoint, seen
//! through one interface, with each format's tensor names.

use crate::config::Arch;
use kiln_core::{quant, DType, Error, HostBytes, Result, Shape};
use kiln_io::gguf::GgufFile;
use kiln_io::safetensors::SafetensorsModel;

pub(crate) struct RawTensor {
    pub dtype: DType,
    pub shape: Shape,
    pub bytes: HostBytes,
}

/// A role a tensor plays; `layer` roles take the block index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Role {
    Embed,
    PosEmbed,
    OutNorm,
    Output,
    AttnNorm,
    Q,
    K,
    V,
    Qkv,
    O,
    PostAttnNorm,
    FfnNorm,
    Gate,
    Up,
    GateUp,
    Down,
    PostFfnNorm,
}

pub(crate) trait Source {
    /// The file, for messages.
    fn name(&self) -> String;
    /// The tensor `name`, or `None` when the file has no such tensor.
    fn get(&self, name: &str) -> Result<Option<RawTensor>>;
    /// The tensor name of `role` (`.weight` or `.bias` added by the caller).
    fn role_name(&self, arch: Arch, role: Role, layer: usize) -> Option<String>;
    /// The bytes of all its tensors as stored, when known before reading them: what a
    /// device must have free before loading starts.
    fn stored_bytes(&self) -> Option<u64> {
        None
    }
    /// Rows of the output head it gives, for a model of `vocab` tokens: fewer where it is
    /// a rank's slice of the vocabulary.
    fn output_rows(&self, vocab: usize) -> usize {
        vocab
    }
    /// Rows of the embedding table it gives: more than a rank's slice (its zero row, see
    /// `tp`) where it is one.
    fn embed_rows(&self, vocab: usize) -> usize {
        vocab
    }
}

pub(crate) struct GgufSource<'a>(pub &'a GgufFile);

impl Source for GgufSource<'_> {
    fn name(&self) -> String {
        self.0.path.display().to_string()
    }

    fn stored_bytes(&self) -> Option<u64> {
        Some(self.0.tensors.iter().map(|t| t.size_bytes).sum())
    }

    fn get(&self, name: &str) -> Result<Option<RawTensor>> {
        let Some(t) = self.0.tensor(name) else {
            return Ok(None);
        };
        if let Some(format) = quant::ExpandedFormat::from_ggml_id(t.ggml_type.id) {
            // Read but not computed with yet: expanded to f32 here.
            let mut values = vec![0f32; t.numel() as usize];
            format.dequantize(self.0.tensor_data(t), &mut values)?;
            return Ok(Some(RawTensor {
                dtype: DType::F32,
                shape: t.shape()?,
                bytes: HostBytes::from_vec(quant::quantize(DType::F32, &values)?),
            }));
        }
        let dtype = t.ggml_type.dtype().ok_or_else(|| {
            Error::unsupported(format!(
                "{}: tensor '{name}' is {}, which kiln does not compute with yet",
                self.name(),
                t.ggml_type
            ))
        })?;
        Ok(Some(RawTensor {
            dtype,
            shape: t.shape()?,
            bytes: self.0.tensor_bytes(t)?,
        }))
    }

    fn role_name(&self, arch: Arch, role: Role, layer: usize) -> Option<String> {
        GgufNames.role_name(arch, role, layer)
    }
}

/// llama.cpp's tensor names.
pub(crate) struct GgufNames;

impl GgufNames {
    pub fn role_name(&self, _arch: Arch, role: Role, layer: usize) -> Option<String> {
        let global = |n: &str| Some(n.to_string());
        let blk = |n: &str| Some(format!("blk.{layer}.{n}"));
        match role {
            Role::Embed => global("token_embd"),
            Role::PosEmbed => global("position_embd"),
            Role::OutNorm => global("output_norm"),
            Role::Output => global("output"),
            Role::AttnNorm => blk("attn_norm"),
            Role::Q => blk("attn_q"),
            Role::K => blk("attn_k"),
            Role::V => blk("attn_v"),
            Role::Qkv => blk("attn_qkv"),
            Role::O => blk("attn_output"),
            Role::PostAttnNorm => blk("post_attention_norm"),
            Role::FfnNorm => blk("ffn_norm"),
            Role::Gate => blk("ffn_gate"),
            // Phi-3's fused gate+up is stored as ffn_up with twice the rows.
            Role::Up | Role::GateUp => blk("ffn_up"),
            Role::Down => blk("ffn_down"),
            Role::PostFfnNorm => blk("post_ffw_norm"),
        }
    }
}

pub(crate) struct HfSource<'a> {
    pub model: &'a SafetensorsModel,
    pub dir: String,
    /// GPT-2 checkpoints name tensors with or without a `transformer.` prefix.
    pub gpt2_prefix: &'static str,
}

impl Source for HfSource<'_> {
    fn name(&self) -> String {
        self.dir.clone()
    }

    fn stored_bytes(&self) -> Option<u64> {
        Some(
            self.model
                .tensors
                .iter()
                .map(|t| t.size_bytes() as u64)
                .sum(),
        )
    }

    fn get(&self, name: &str) -> Result<Option<RawTensor>> {
        let Some(t) = self.model.tensor(name) else {
            return Ok(None);
        };
        let dtype = t.kiln_dtype().ok_or_else(|| {
            Error::unsupported(format!(
                "{}: tensor '{name}' is {}; kiln reads f32, f16 and bf16 checkpoints",
                self.name(),
                t.dtype_name()
            ))
        })?;
        Ok(Some(RawTensor {
            dtype,
            shape: t.shape()?,
            bytes: self.model.tensor_bytes(t)?,
        }))
    }

    fn role_name(&self, arch: Arch, role: Role, layer: usize) -> Option<String> {
        if arch == Arch::Gpt2 {
            let p = self.gpt2_prefix;
            let h = |n: &str| Some(format!("{p}h.{layer}.{n}"));
            return match role {
                Role::Embed => Some(format!("{p}wte")),
                Role::PosEmbed => Some(format!("{p}wpe")),
                Role::OutNorm => Some(format!("{p}ln_f")),
                Role::Output => Some("lm_head".into()),
                Role::AttnNorm => h("ln_1"),
                Role::Qkv => h("attn.c_attn"),
                Role::O => h("attn.c_proj"),
                Role::FfnNorm => h("ln_2"),
                Role::Up => h("mlp.c_fc"),
                Role::Down => h("mlp.c_proj"),
                _ => None,
            };
        }
        let l = |n: &str| Some(format!("model.layers.{layer}.{n}"));
        match role {
            Role::Embed => Some("model.embed_tokens".into()),
            Role::OutNorm => Some("model.norm".into()),
            Role::Output => Some("lm_head".into()),
            Role::PosEmbed => None,
            Role::AttnNorm => l("input_layernorm"),
            Role::Q => l("self_attn.q_proj"),
            Role::K => l("self_attn.k_proj"),
            Role::V => l("self_attn.v_proj"),
            Role::Qkv => l("self_attn.qkv_proj"),
            Role::O => l("self_attn.o_proj"),
            // Gemma 2 has four norms per layer; the others two.
            Role::PostAttnNorm => l("post_attention_layernorm"),
            Role::FfnNorm if arch == Arch::Gemma2 => l("pre_feedforward_layernorm"),
            Role::FfnNorm => l("post_attention_layernorm"),
            Role::PostFfnNorm => l("post_feedforward_layernorm"),
            Role::Gate => l("mlp.gate_proj"),
            Role::Up => l("mlp.up_proj"),
            Role::GateUp => l("mlp.gate_up_proj"),
            Role::Down => l("mlp.down_proj"),
        }
    }
}
