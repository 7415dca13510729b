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

/// The keys read into typed fields above, by the JSON type each must have, so that a
/// wrong type is reported by key and value rather than by serde's line and column.
const UINT_KEYS: &[&str] = &[
    "vocab_size",
    "hidden_size",
    "n_embd",
    "intermediate_size",
    "n_inner",
    "num_hidden_layers",
    "n_layer",
    "num_attention_heads",
    "n_head",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "n_positions",
    "sliding_window",
];
const FLOAT_KEYS: &[&str] = &[
    "rms_norm_eps",
    "layer_norm_eps",
    "layer_norm_epsilon",
    "rope_theta",
];
const STRING_KEYS: &[&str] = &["model_type", "torch_dtype"];
const SCALING_FLOAT_KEYS: &[&str] = &["factor", "low_freq_factor", "high_freq_factor"];

/// A JSON value as a message quotes it, cut short when long.
pub fn quote(v: &serde_json::Value) -> String {
    let s = v.to_string();
    match s.char_indices().nth(60) {
        Some((end, _)) => format!("{}...", &s[..end]),
        None => s,
    }
}

/// `key is VALUE, expected WHAT` when `v` is present (not null) but not what `ok` accepts.
fn expect(
    key: &str,
    v: Option<&serde_json::Value>,
    ok: fn(&serde_json::Value) -> bool,
    what: &str,
) -> std::result::Result<(), String> {
    match v {
        Some(v) if !v.is_null() && !ok(v) => Err(format!("{key} is {}, expected {what}", quote(v))),
        _ => Ok(()),
    }
}

fn check_types(raw: &serde_json::Value) -> std::result::Result<(), String> {
    use serde_json::Value as J;
    let Some(obj) = raw.as_object() else {
        return Err(format!(
            "the top level is {}, expected an object",
            quote(raw)
        ));
    };
    let uint = |v: &J| v.is_u64();
    let uint_what = "a non-negative integer";
    for k in UINT_KEYS {
        expect(k, obj.get(*k), uint, uint_what)?;
    }
    for k in FLOAT_KEYS {
        expect(k, obj.get(*k), J::is_number, "a number")?;
    }
    for k in STRING_KEYS {
        expect(k, obj.get(*k), J::is_string, "a string")?;
    }
    expect(
        "tie_word_embeddings",
        obj.get("tie_word_embeddings"),
        J::is_boolean,
        "true or false",
    )?;
    let names = |v: &J| v.as_array().is_some_and(|a| a.iter().all(J::is_string));
    expect(
        "architectures",
        obj.get("architectures"),
        names,
        "a list of strings",
    )?;
    if let Some(s) = obj.get("rope_scaling").filter(|v| !v.is_null()) {
        let Some(s) = s.as_object() else {
            return Err(format!("rope_scaling is {}, expected an object", quote(s)));
        };
        for k in SCALING_FLOAT_KEYS {
            expect(
                &format!("rope_scaling.{k}"),
                s.get(*k),
                J::is_number,
                "a number",
            )?;
        }
        let k = "original_max_position_embeddings";
        expect(&format!("rope_scaling.{k}"), s.get(k), uint, uint_what)?;
        for k in ["rope_type", "type"] {
            expect(
                &format!("rope_scaling.{k}"),
                s.get(k),
                J::is_string,
                "a string",
            )?;
        }
    }
    Ok(())
}

impl HfConfig {
    /// Parse `config.json`; the error names the key and value at fault, not the file.
    pub fn from_json(text: &str) -> std::result::Result<Self, String> {
        let raw: serde_json::Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
        check_types(&raw)?;
        let mut config: HfConfig =
            serde_json::from_value(raw.clone()).map_err(|e| e.to_string())?;
        config.raw = raw;
        Ok(config)
    }

    /// The `config.json` of the Hugging Face model directory `dir`; a directory without
    /// one is not a model, and the error says so rather than naming the missing file.
    pub fn load_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        if !path.exists() {
            return Err(Error::format(format!(
                "{}: not a Hugging Face model directory (no config.json): give a .gguf file, or a directory with config.json and the model's .safetensors",
                dir.display()
            )));
        }
        Self::load(&path)
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
    }

    #[test]
    fn wrong_types_are_named_with_their_value() {
        let err = |text: &str| HfConfig::from_json(text).unwrap_err();
        assert_eq!(
            err(r#"{"hidden_size":"big"}"#),
            r#"hidden_size is "big", expected a non-negative integer"#
        );
        assert_eq!(
            err(r#"{"num_key_value_heads":-2}"#),
            "num_key_value_heads is -2, expected a non-negative integer"
        );
        assert_eq!(
            err(r#"{"n_head":2.5}"#),
            "n_head is 2.5, expected a non-negative integer"
        );
        assert_eq!(
            err(r#"{"vocab_size":100000000000000000000}"#),
            "vocab_size is 1e+20, expected a non-negative integer"
        );
        assert_eq!(
            err(r#"{"rope_theta":"1e4"}"#),
            r#"rope_theta is "1e4", expected a number"#
        );
        assert_eq!(
            err(r#"{"rope_scaling":{"factor":[8]}}"#),
            "rope_scaling.factor is [8], expected a number"
        );
        assert_eq!(
            err(r#"{"architectures":"LlamaForCausalLM"}"#),
            r#"architectures is "LlamaForCausalLM", expected a list of strings"#
        );
        assert_eq!(err("[1]"), "the top level is [1], expected an object");
        // null stands for absent, as transformers reads it.
        let c = HfConfig::from_json(r#"{"n_inner":null,"sliding_window":null}"#).unwrap();
        assert_eq!((c.intermediate_size, c.sliding_window), (None, None));
    }
}
