//! `tokenizer.json`, delegated to Hugging Face's `tokenizers` crate.

use crate::byte_level;
use crate::sentencepiece::parse_byte_token;
use kiln_core::{Error, Result};
use std::collections::HashSet;
use std::path::Path;

pub struct HfJson {
    tok: tokenizers::Tokenizer,
    /// id → vocabulary text, added tokens included.
    texts: Vec<Option<String>>,
    added: HashSet<u32>,
    /// The decoder maps GPT-2's byte alphabet back to bytes (else SentencePiece-style).
    byte_level: bool,
}

fn has_byte_level(v: &serde_json::Value) -> bool {
    match v {
        serde_json::Value::Object(m) => {
            m.get("type").and_then(|t| t.as_str()) == Some("ByteLevel")
                || m.values().any(has_byte_level)
        }
        serde_json::Value::Array(a) => a.iter().any(has_byte_level),
        _ => false,
    }
}

impl HfJson {
    pub fn load(path: &Path) -> Result<HfJson> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path.display(), e))?;
        let tok: tokenizers::Tokenizer = text
            .parse()
            .map_err(|e| Error::format(format!("{}: {e}", path.display())))?;
        let json: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| Error::format(format!("{}: {e}", path.display())))?;
        let byte_level = json.get("decoder").is_some_and(has_byte_level);
        let vocab = tok.get_vocab(true);
        let n = vocab.values().map(|&i| i as usize + 1).max().unwrap_or(0);
        let mut texts = vec![None; n];
        for (t, id) in vocab {
            texts[id as usize] = Some(t);
        }
        let added = tok.get_added_tokens_decoder().keys().copied().collect();
        Ok(HfJson {
            tok,
            texts,
            added,
            byte_level,
        })
    }

    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        let enc = self
            .tok
            .encode(text, add_special)
            .map_err(|e| Error::format(format!("tokenizer.json encode: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.tok
            .decode(ids, false)
            .map_err(|e| Error::format(format!("tokenizer.json decode: {e}")))
    }

    pub fn id(&self, text: &str) -> Option<u32> {
        self.tok.token_to_id(text)
    }

    pub fn text(&self, id: u32) -> Option<&str> {
        self.texts.get(id as usize)?.as_deref()
    }

    pub fn vocab_size(&self) -> usize {
        self.tok.get_vocab_size(true)
    }

    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        let Some(text) = self.text(id) else {
            return Vec::new();
        };
        if self.added.contains(&id) {
            return text.as_bytes().to_vec();
        }
        if self.byte_level {
            let mut out = Vec::with_capacity(text.len());
            byte_level::decode_into(text, &mut out);
            return out;
        }
        match parse_byte_token(text) {
            Some(b) => vec![b],
            None => text.replace('\u{2581}', " ").into_bytes(),
        }
    }
}
