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
    /// `tokenizer.huggingface.json` (kiln reads it back exactly; llama.cpp wants
    /// `tokenizer.ggml.*` keys, which kiln does not derive from tokenizer.json).
    pub fn gguf_metadata(&self) -> Result<Vec<(String, Value)>> {
        let mut kv = match &self.model {
            Model::Spm(spm) => spm_keys(spm)?,
            Model::Hf(h) => vec![(HF_JSON_KEY.into(), Value::String(h.json().into()))],
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
