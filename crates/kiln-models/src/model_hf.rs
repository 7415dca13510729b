//! Writing a model as a Hugging Face directory (`config.json` and `model.safetensors`,
//! F32): the inverse of what `kiln convert` reads, for llama and mistral. Q and K rows go
//! back to rotating halves (`rotate_half`) when the model has llama.cpp's adjacent pairs.

use crate::config::{Arch, Ffn, Norm};
use crate::convert::permute_rows;
use crate::model::Model;
use kiln_core::{quant, Error, Result, RopeLayout};
use serde_json::json;

/// The inverse of [`permute_rows`]: adjacent pairs back to halves, within each head.
fn unpermute_rows(w: &[f32], rows: usize, cols: usize, heads: usize) -> Vec<f32> {
    let forward = permute_rows(
        &(0..rows).map(|r| r as f32).collect::<Vec<_>>(),
        rows,
        1,
        heads,
    );
    let mut out = vec![0f32; w.len()];
    // forward[to] = from: row `to` of the permuted matrix is row `from` of the original.
    for (to, &from) in forward.iter().enumerate() {
        let from = from as usize;
        out[from * cols..(from + 1) * cols].copy_from_slice(&w[to * cols..(to + 1) * cols]);
    }
    out
}

/// The Hugging Face name of a GGUF-named llama parameter.
fn hf_name(gguf: &str) -> Option<String> {
    let global = match gguf {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(n) = global {
        return Some(n.to_string());
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, name) = rest.split_once('.')?;
    let hf = match name {
        "attn_norm.weight" => "input_layernorm.weight",
        "attn_q.weight" => "self_attn.q_proj.weight",
        "attn_k.weight" => "self_attn.k_proj.weight",
        "attn_v.weight" => "self_attn.v_proj.weight",
        "attn_output.weight" => "self_attn.o_proj.weight",
        "ffn_norm.weight" => "post_attention_layernorm.weight",
        "ffn_gate.weight" => "mlp.gate_proj.weight",
        "ffn_up.weight" => "mlp.up_proj.weight",
        "ffn_down.weight" => "mlp.down_proj.weight",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}"))
}

/// What makes tensor `i`'s values.
type MakeValues<'a> = Box<dyn Fn(usize) -> Result<Vec<f32>> + 'a>;

/// A model as a Hugging Face directory holds it: `config.json`, and `model.safetensors`
/// (F32), whose tensors are made one at a time while it is written.
pub struct HfFiles<'a> {
    pub config: Vec<u8>,
    /// Each tensor's Hugging Face name and shape, in the order they are written.
    weights: Vec<(String, Vec<usize>)>,
    /// Tensor `i`'s values.
    make: MakeValues<'a>,
}

impl HfFiles<'_> {
    /// Write `model.safetensors` to `w`, one tensor in memory at a time.
    pub fn write_weights(&self, w: &mut impl std::io::Write) -> std::io::Result<()> {
        kiln_io::safetensors::write_f32(w, &self.weights, &self.make)
    }
}

impl Model {
    /// This model as a Hugging Face directory holds it (F32 weights), llama and mistral
    /// models, each parameter's values passed through `adjust` as they are written (see
    /// [`Model::to_gguf_with`]). The caller writes the files, with the tokenizer's, and
    /// may give `bos` and `eos` ids for the config.
    pub fn to_hf_with<'a>(
        &'a self,
        bos: Option<u32>,
        eos: Option<u32>,
        adjust: impl Fn(&str, &mut Vec<f32>) -> Result<()> + 'a,
    ) -> Result<HfFiles<'a>> {
        let c = &self.config;
        let unsupported = |what: &str| {
            Err(Error::unsupported(format!(
                "writing this {} model as a Hugging Face directory: {what}",
                c.arch.name()
            )))
        };
        if !matches!(c.arch, Arch::Llama | Arch::Mistral) {
            return unsupported("kiln writes llama and mistral directories");
        }
        let Norm::Rms { eps } = c.norm else {
            return unsupported("LayerNorm");
        };
        let Some(rope) = &c.rope else {
            return unsupported("no rope");
        };
        if c.ffn != Ffn::SwiGlu || rope.freq_factors.is_some() || rope.dims != c.head_dim {
            return unsupported("its feed-forward, rope frequency factors or partial rope");
        }
        let interleaved = rope.layout == RopeLayout::Interleaved;
        let params = self.parameters();
        let mut weights = Vec::with_capacity(params.len());
        let mut tied = true;
        for (name, t) in &params {
            let hf = hf_name(name).ok_or_else(|| {
                Error::unsupported(format!("writing {name} as a Hugging Face tensor"))
            })?;
            tied &= name != "output.weight";
            weights.push((hf, t.dims().to_vec()));
        }
        let make = move |i: usize| -> Result<Vec<f32>> {
            let (name, t) = &params[i];
            let bytes = self.backend().download(t)?;
            let mut values = quant::dequantize_to_vec(t.dtype(), &bytes, t.shape().numel())?;
            adjust(name, &mut values)?;
            let dims = t.dims();
            let heads = match name.rsplit_once('.').map(|(n, _)| n) {
                Some(n) if n.ends_with("attn_q") => Some(c.n_heads),
                Some(n) if n.ends_with("attn_k") => Some(c.n_kv_heads),
                _ => None,
            };
            if let (true, Some(heads)) = (interleaved, heads) {
                values = unpermute_rows(&values, dims[0], dims[1], heads);
            }
            Ok(values)
        };
        let mut config = json!({
            "architectures": [if c.arch == Arch::Mistral { "MistralForCausalLM" } else { "LlamaForCausalLM" }],
            "model_type": c.arch.name(),
            "vocab_size": c.vocab_size,
            "hidden_size": c.dim,
            "intermediate_size": c.ffn_dim,
            "num_hidden_layers": c.n_layers,
            "num_attention_heads": c.n_heads,
            "num_key_value_heads": c.n_kv_heads,
            "head_dim": c.head_dim,
            "max_position_embeddings": c.max_positions,
            "rms_norm_eps": eps,
            "rope_theta": rope.theta,
            "hidden_act": "silu",
            "tie_word_embeddings": tied,
            "torch_dtype": "float32",
        });
        if let Some(s) = rope.llama3 {
            config["rope_scaling"] = json!({
                "rope_type": "llama3",
                "factor": s.factor,
                "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_positions,
            });
        }
        if let Some(w) = c.sliding_window {
            config["sliding_window"] = json!(w);
        }
        if let Some(b) = bos {
            config["bos_token_id"] = json!(b);
        }
        if let Some(e) = eos {
            config["eos_token_id"] = json!(e);
        }
        let config = serde_json::to_vec_pretty(&config)
            .map_err(|e| Error::format(format!("config.json: {e}")))?;
        Ok(HfFiles {
            config,
            weights,
            make: Box::new(make),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::{permute_rows, unpermute_rows};

    #[test]
    fn unpermute_undoes_permute() {
        let w: Vec<f32> = (0..48).map(|i| i as f32).collect();
        let p = permute_rows(&w, 12, 4, 3);
        assert_ne!(p, w);
        assert_eq!(unpermute_rows(&p, 12, 4, 3), w);
    }
}
