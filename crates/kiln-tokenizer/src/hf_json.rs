//! `tokenizer.json`, delegated to Hugging Face's `tokenizers` crate.

use crate::byte_level;
use crate::sentencepiece::parse_byte_token;
use kiln_core::{Error, Result};
use kiln_io::file::{self, FileKind};
use std::collections::{HashMap, HashSet};
use std::path::Path;

pub struct HfJson {
    tok: tokenizers::Tokenizer,
    /// id → vocabulary text, added tokens included. A map, not a table indexed by id:
    /// the ids are the file's, and one id near 2^32 must not size a table. Ids need not be
    /// dense either: transformers and the `tokenizers` crate keep the vocabulary as a
    /// dictionary, and llama.cpp's converter fills holes with unused `[PAD<id>]` tokens,
    /// so a vocabulary with holes is valid (the model refuses ids past its embeddings).
    texts: HashMap<u32, String>,
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

/// The one part of tokenizer.json read besides what `tokenizers` reads; the rest is
/// skipped, not held.
#[derive(serde::Deserialize)]
struct DecoderOnly {
    decoder: Option<serde_json::Value>,
}

impl HfJson {
    pub fn load(path: &Path) -> Result<HfJson> {
        let text = file::read_to_string(path, FileKind::TOKENIZER_JSON)?;
        let tok: tokenizers::Tokenizer = text
            .parse()
            .map_err(|e| Error::format(format!("{}: {e}", path.display())))?;
        let json: DecoderOnly = serde_json::from_str(&text)
            .map_err(|e| Error::format(format!("{}: {e}", path.display())))?;
        let byte_level = json.decoder.as_ref().is_some_and(has_byte_level);
        let texts = tok
            .get_vocab(true)
            .into_iter()
            .map(|(t, id)| (id, t))
            .collect();
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
        self.texts.get(&id).map(String::as_str)
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
