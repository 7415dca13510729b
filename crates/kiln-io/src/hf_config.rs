//! Hugging Face `config.json`: the fields kiln's architectures read, the rest kept raw.

use kiln_core::{Error, Result};
use serde::Deserialize;
use std::path::Path;

/// `rope_scaling` as transformers writes it (`rope_type` or the older `type`).
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct RopeScaling {
    #[serde(alias = "type")]
    pub rope_type: Option<String>,
    pub factor: Option<f64>,
    pub low_freq_factor: Option<f64>,
    pub high_freq_factor: Option<f64>,
    pub original_max_position_embeddings: Option<u64>,
}

#[derive(Clone, Debug, Deserialize)]
pub struct HfConfig {
    #[serde(default)]
    pub architectures: Vec<String>,
    pub model_type: Option<String>,
    pub vocab_size: Option<u64>,
    #[serde(alias = "n_embd")]
    pub hidden_size: Option<u64>,
    #[serde(alias = "n_inner")]
    pub intermediate_size: Option<u64>,
    #[serde(alias = "n_layer")]
    pub num_hidden_layers: Option<u64>,
    #[serde(alias = "n_head")]
    pub num_attention_heads: Option<u64>,
    pub num_key_value_heads: Option<u64>,
    pub head_dim: Option<u64>,
    #[serde(alias = "n_positions")]
    pub max_position_embeddings: Option<u64>,
    pub rms_norm_eps: Option<f64>,
    #[serde(alias = "layer_norm_epsilon")]
    pub layer_norm_eps: Option<f64>,
    pub rope_theta: Option<f64>,
    pub rope_scaling: Option<RopeScaling>,
    pub tie_word_embeddings: Option<bool>,
    pub torch_dtype: Option<String>,
    pub sliding_window: Option<u64>,
    /// Everything, for fields particular to one architecture.
    #[serde(skip)]
    pub raw: serde_json::Value,
}

impl HfConfig {
    pub fn from_json(text: &str) -> std::result::Result<Self, serde_json::Error> {
        let raw: serde_json::Value = serde_json::from_str(text)?;
        let mut config: HfConfig = serde_json::from_value(raw.clone())?;
        config.raw = raw;
        Ok(config)
    }

    pub fn load(path: &Path) -> Result<Self> {
        let text = crate::file::read_to_string(path, crate::file::FileKind::CONFIG_JSON)?;
        Self::from_json(&text).map_err(|e| Error::format(format!("{}: {e}", path.display())))
    }

    /// The architecture name: the first of `architectures`, else `model_type`.
    pub fn architecture(&self) -> Option<&str> {
        self.architectures
            .first()
            .map(String::as_str)
            .or(self.model_type.as_deref())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_llama_and_gpt2_names() {
        let c = HfConfig::from_json(
            r#"{"architectures":["LlamaForCausalLM"],"hidden_size":64,"num_attention_heads":4,
                "rope_scaling":{"rope_type":"llama3","factor":8.0},"custom":1}"#,
        )
        .unwrap();
        assert_eq!(c.architecture(), Some("LlamaForCausalLM"));
        assert_eq!(c.hidden_size, Some(64));
        assert_eq!(c.rope_scaling.unwrap().rope_type.as_deref(), Some("llama3"));
        assert_eq!(c.raw["custom"], 1);
        let g = HfConfig::from_json(r#"{"model_type":"gpt2","n_embd":32,"n_layer":2}"#).unwrap();
        assert_eq!((g.hidden_size, g.num_hidden_layers), (Some(32), Some(2)));
        assert!(HfConfig::from_json(r#"{"hidden_size":"big"}"#).is_err());
    }
}
