//! The files a Hugging Face model directory holds for a SentencePiece vocabulary:
//! `tokenizer.model` (SentencePiece's `ModelProto`, the fields `sentencepiece_model`
//! reads) and `tokenizer_config.json` (its special tokens), so that a model kiln trained
//! can be written as a Hugging Face directory.

use crate::sentencepiece::{Algorithm, SentencePiece};
use crate::vocab::TokenType;
use crate::{Model, Tokenizer};
use kiln_core::{Error, Result};

/// Protobuf's base-128 varint; negative int32s are sign-extended to 64 bits, as the
/// format says.
fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn key(out: &mut Vec<u8>, field: u32, wire: u8) {
    varint(out, ((field as u64) << 3) | wire as u64);
}

fn int_field(out: &mut Vec<u8>, field: u32, v: i64) {
    key(out, field, 0);
    varint(out, v as u64);
}

fn bytes_field(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    key(out, field, 2);
    varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

fn type_number(t: TokenType) -> i64 {
    match t {
        TokenType::Normal => 1,
        TokenType::Unknown => 2,
        TokenType::Control => 3,
        TokenType::UserDefined => 4,
        TokenType::Unused => 5,
        TokenType::Byte => 6,
    }
}

impl Tokenizer {
    /// `(file name, contents)` of the tokenizer's files in a Hugging Face directory:
    /// a tokenizer.json as it came, or a SentencePiece vocabulary as tokenizer.model.
    pub fn hf_files(&self) -> Result<Vec<(&'static str, Vec<u8>)>> {
        match &self.model {
            Model::Spm(spm) => self.spm_files(spm),
            Model::Hf(h) => {
                let config = self.config_json(
                    serde_json::json!({"tokenizer_class": "PreTrainedTokenizerFast"}),
                    |id| h.text(id).map(str::to_string),
                    None,
                )?;
                Ok(vec![
                    ("tokenizer.json", h.json().as_bytes().to_vec()),
                    ("tokenizer_config.json", config),
                ])
            }
            Model::ByteBpe(_) => Err(Error::unsupported(
                "writing a GGUF file's byte-level BPE vocabulary as tokenizer.json",
            )),
        }
    }

    /// tokenizer_config.json: `base` with the special tokens (their texts by `text`),
    /// the BOS/EOS flags and the chat template.
    fn config_json(
        &self,
        mut config: serde_json::Value,
        text: impl Fn(u32) -> Option<String>,
        unk: Option<u32>,
    ) -> Result<Vec<u8>> {
        config["add_bos_token"] = self.add_bos.into();
        config["add_eos_token"] = self.add_eos.into();
        for (k, id) in [
            ("bos_token", self.bos),
            ("eos_token", self.eos_primary),
            ("unk_token", unk),
        ] {
            if let Some(t) = id.and_then(&text) {
                config[k] = serde_json::Value::String(t);
            }
        }
        if let Some(t) = &self.chat_template {
            config["chat_template"] = serde_json::Value::String(t.clone());
        }
        serde_json::to_vec_pretty(&config)
            .map_err(|e| Error::format(format!("tokenizer_config.json: {e}")))
    }

    fn spm_files(&self, spm: &SentencePiece) -> Result<Vec<(&'static str, Vec<u8>)>> {
        let v = &spm.vocab;
        let mut proto = Vec::new();
        for ((piece, &score), &ty) in v.tokens.iter().zip(&v.scores).zip(&v.types) {
            let mut p = Vec::new();
            bytes_field(&mut p, 1, piece.as_bytes());
            key(&mut p, 2, 5);
            p.extend_from_slice(&score.to_bits().to_le_bytes());
            int_field(&mut p, 3, type_number(ty));
            bytes_field(&mut proto, 1, &p);
        }
        let id = |v: Option<u32>| v.map_or(-1, |i| i as i64);
        let mut trainer = Vec::new();
        let model_type = match spm.algorithm {
            Algorithm::Unigram => 1,
            Algorithm::Bpe => 2,
        };
        int_field(&mut trainer, 3, model_type);
        let byte_fallback = v.types.contains(&TokenType::Byte);
        int_field(&mut trainer, 35, byte_fallback as i64);
        int_field(&mut trainer, 40, id(v.first_of_type(TokenType::Unknown)));
        int_field(&mut trainer, 41, id(self.bos));
        int_field(&mut trainer, 42, id(self.eos_primary));
        int_field(&mut trainer, 43, -1);
        bytes_field(&mut proto, 2, &trainer);
        let mut normalizer = Vec::new();
        bytes_field(&mut normalizer, 1, b"identity");
        int_field(&mut normalizer, 3, spm.add_space_prefix as i64);
        int_field(&mut normalizer, 4, spm.remove_extra_whitespaces as i64);
        int_field(&mut normalizer, 5, spm.escape_whitespaces as i64);
        bytes_field(&mut proto, 3, &normalizer);

        let config = self.config_json(
            serde_json::json!({"tokenizer_class": "LlamaTokenizer", "legacy": true}),
            |i| v.text(i).map(str::to_string),
            v.first_of_type(TokenType::Unknown),
        )?;
        Ok(vec![
            ("tokenizer.model", proto),
            ("tokenizer_config.json", config),
        ])
    }
}
