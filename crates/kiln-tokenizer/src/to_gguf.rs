//! The GGUF metadata that describes a tokenizer, as llama.cpp's converter writes it, so
//! that kiln's own converter and `kiln train` can embed a vocabulary in the files they
//! write.

use crate::sentencepiece::{Algorithm, SentencePiece};
use crate::vocab::TokenType;
use crate::{Model, Tokenizer};
use kiln_core::{Error, Result};
use kiln_io::gguf::{Array, Value};

/// GGUF's key for a whole Hugging Face tokenizer.json (in the GGUF specification).
pub(crate) const HF_JSON_KEY: &str = "tokenizer.huggingface.json";

impl Tokenizer {
    /// `tokenizer.*` keys for this vocabulary: SentencePiece BPE vocabularies as
    /// llama.cpp's `llama` tokenizer model; a tokenizer.json whole, as
    /// `tokenizer.huggingface.json` (what kiln reads back, exactly), and where it is a
    /// byte-level BPE whose pre-tokenizer llama.cpp names (GPT-2's, Llama 3's, Qwen 2's)
    /// also as llama.cpp's `gpt2` tokenizer model, for llama.cpp.
    pub fn gguf_metadata(&self) -> Result<Vec<(String, Value)>> {
        let mut kv = match &self.model {
            Model::Spm(spm) => spm_keys(spm)?,
            Model::Hf(h) => {
                let mut kv = vec![(HF_JSON_KEY.into(), Value::String(h.json().into()))];
                kv.extend(byte_bpe_keys(h.json()).unwrap_or_default());
                kv
            }
            Model::ByteBpe(_) => {
                return Err(Error::unsupported(
                    "writing a GGUF file's byte-level BPE vocabulary to GGUF again (copy its tokenizer.* keys)",
                ))
            }
        };
        kv.extend([
            (
                "tokenizer.ggml.add_bos_token".into(),
                Value::Bool(self.add_bos),
            ),
            (
                "tokenizer.ggml.add_eos_token".into(),
                Value::Bool(self.add_eos),
            ),
        ]);
        if let Some(bos) = self.bos {
            kv.push(("tokenizer.ggml.bos_token_id".into(), Value::U32(bos)));
        }
        if let Some(&eos) = self.eos.first() {
            kv.push(("tokenizer.ggml.eos_token_id".into(), Value::U32(eos)));
        }
        if let Some(t) = &self.chat_template {
            kv.push(("tokenizer.chat_template".into(), Value::String(t.clone())));
        }
        Ok(kv)
    }
}

fn spm_keys(spm: &SentencePiece) -> Result<Vec<(String, Value)>> {
    if spm.algorithm != Algorithm::Bpe {
        return Err(Error::unsupported(
            "writing a SentencePiece unigram vocabulary to GGUF",
        ));
    }
    let v = &spm.vocab;
    let types = v
        .types
        .iter()
        .map(|t| match t {
            TokenType::Normal => 1,
            TokenType::Unknown => 2,
            TokenType::Control => 3,
            TokenType::UserDefined => 4,
            TokenType::Unused => 5,
            TokenType::Byte => 6,
        })
        .collect();
    let mut kv = vec![
        (
            "tokenizer.ggml.model".to_string(),
            Value::String("llama".into()),
        ),
        (
            "tokenizer.ggml.tokens".into(),
            Value::Array(Array::String(v.tokens.clone())),
        ),
        (
            "tokenizer.ggml.scores".into(),
            Value::Array(Array::F32(v.scores.clone())),
        ),
        (
            "tokenizer.ggml.token_type".into(),
            Value::Array(Array::I32(types)),
        ),
        (
            "tokenizer.ggml.add_space_prefix".into(),
            Value::Bool(spm.add_space_prefix),
        ),
    ];
    if let Some(unk) = v.first_of_type(TokenType::Unknown) {
        kv.push(("tokenizer.ggml.unknown_token_id".into(), Value::U32(unk)));
    }
    Ok(kv)
}

/// Most ids a derived vocabulary may span per token it holds: holes (ids no token has)
/// become `[PAD<id>]` tokens, as llama.cpp's converter writes them, and one id near 2^32
/// must not size a table.
const MOST_HOLES: usize = 4;

/// A byte-level BPE tokenizer.json as llama.cpp's `gpt2` tokenizer model (its tokens by
/// id, their types, its merges, the pre-tokenizer's name); `None` where it is not one
/// llama.cpp's keys can say exactly (another model or pre-tokenizer, a normalizer,
/// byte fallback, word affixes).
fn byte_bpe_keys(json: &str) -> Option<Vec<(String, Value)>> {
    let j: serde_json::Value = serde_json::from_str(json).ok()?;
    let model = j.get("model")?;
    let plain = |k: &str| {
        model
            .get(k)
            .is_none_or(|v| v.is_null() || v == &serde_json::json!(""))
    };
    if model.get("type")?.as_str()? != "BPE"
        || model.get("byte_fallback").and_then(|b| b.as_bool()) == Some(true)
        || !plain("continuing_subword_prefix")
        || !plain("end_of_word_suffix")
        || !j.get("normalizer").is_none_or(|n| n.is_null())
        || j.get("decoder")?.get("type")?.as_str()? != "ByteLevel"
    {
        return None;
    }
    let ignore_merges = model.get("ignore_merges").and_then(|b| b.as_bool()) == Some(true);
    let pre = crate::pretokenize::ggml_name(j.get("pre_tokenizer")?, ignore_merges)?;
    // Tokens by id: the model's vocabulary, then the added tokens (control when special,
    // user-defined otherwise).
    let mut by_id: std::collections::HashMap<u32, (String, i32)> = model
        .get("vocab")?
        .as_object()?
        .iter()
        .map(|(t, id)| Some((u32::try_from(id.as_u64()?).ok()?, (t.clone(), 1))))
        .collect::<Option<_>>()?;
    for a in j
        .get("added_tokens")
        .and_then(|a| a.as_array())
        .into_iter()
        .flatten()
    {
        let id = u32::try_from(a.get("id")?.as_u64()?).ok()?;
        let special = a.get("special").and_then(|s| s.as_bool()) == Some(true);
        let text = a.get("content")?.as_str()?.to_string();
        by_id.entry(id).or_insert((text, 0)).1 = if special { 3 } else { 4 };
    }
    let len = by_id.keys().map(|&id| id as usize + 1).max()?;
    if len > MOST_HOLES * by_id.len() {
        return None;
    }
    let mut tokens: Vec<String> = (0..len).map(|i| format!("[PAD{i}]")).collect();
    let mut types = vec![5i32; len];
    for (id, (text, ty)) in by_id {
        tokens[id as usize] = text;
        types[id as usize] = ty;
    }
    let merges = model
        .get("merges")?
        .as_array()?
        .iter()
        .map(|m| match m {
            serde_json::Value::String(s) => Some(s.clone()),
            serde_json::Value::Array(p) => match p.as_slice() {
                [a, b] => Some(format!("{} {}", a.as_str()?, b.as_str()?)),
                _ => None,
            },
            _ => None,
        })
        .collect::<Option<Vec<_>>>()?;
    Some(vec![
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::String(pre.into())),
        (
            "tokenizer.ggml.tokens".into(),
            Value::Array(Array::String(tokens)),
        ),
        (
            "tokenizer.ggml.token_type".into(),
            Value::Array(Array::I32(types)),
        ),
        (
            "tokenizer.ggml.merges".into(),
            Value::Array(Array::String(merges)),
        ),
    ])
}
