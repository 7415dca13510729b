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
    /// The file's text, written out again as it was (GGUF's `tokenizer.huggingface.json`,
    /// a Hugging Face export's tokenizer.json).
    json: String,
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

/// The parts of tokenizer.json read besides what `tokenizers` reads (the decoder's kind,
/// and what is checked before `tokenizers` runs it); the rest is skipped, not held.
#[derive(serde::Deserialize)]
struct Checked {
    decoder: Option<serde_json::Value>,
    normalizer: Option<serde_json::Value>,
    post_processor: Option<serde_json::Value>,
}

/// How many times longer a normalizer or decoder may make a text before kiln refuses it:
/// a chain of replacements grows a text geometrically, and the `tokenizers` crate has no
/// bound of its own (eight stages of 'a' → ten 'a's made a 3-byte text 1.6 GB).
const MAX_GROWTH: f64 = 1024.0;

/// The most a normalizer or decoder can multiply a text's length by, counting what kiln
/// can see: `Replace` stages (a string pattern by its content's length over the
/// pattern's; a regex, which may match empty strings, by its content's length plus one),
/// `Prepend`, and `Sequence`s of them; other stages count once.
fn growth(v: &serde_json::Value) -> f64 {
    let chars = |k: &str| {
        v.get(k)
            .and_then(|s| s.as_str())
            .map_or(0, |s| s.chars().count()) as f64
    };
    match v.get("type").and_then(|t| t.as_str()) {
        Some("Sequence") => ["normalizers", "decoders"]
            .iter()
            .filter_map(|k| v.get(*k).and_then(|a| a.as_array()))
            .flatten()
            .map(growth)
            .product(),
        Some("Replace") => {
            let content = chars("content");
            match v
                .get("pattern")
                .and_then(|p| p.get("String"))
                .and_then(|s| s.as_str())
            {
                Some(p) if !p.is_empty() => (content / p.chars().count() as f64).max(1.0),
                _ => content + 1.0,
            }
        }
        Some("Prepend") => 1.0 + chars("prepend"),
        _ => 1.0,
    }
}

/// The ids of the special tokens a `TemplateProcessing` post-processor (anywhere in
/// `v`) puts in its templates but does not define: `tokenizers` panics on the first
/// encode that meets one.
fn undefined_template_tokens(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(m) => {
            if m.get("type").and_then(|t| t.as_str()) == Some("TemplateProcessing") {
                let defined = m.get("special_tokens").and_then(|s| s.as_object());
                for piece in ["single", "pair"]
                    .iter()
                    .filter_map(|k| m.get(*k).and_then(|a| a.as_array()))
                    .flatten()
                {
                    if let Some(id) = piece
                        .get("SpecialToken")
                        .and_then(|s| s.get("id"))
                        .and_then(|i| i.as_str())
                    {
                        if !defined.is_some_and(|d| d.contains_key(id)) {
                            out.push(id.to_string());
                        }
                    }
                }
            }
            m.values().for_each(|x| undefined_template_tokens(x, out));
        }
        serde_json::Value::Array(a) => a.iter().for_each(|x| undefined_template_tokens(x, out)),
        _ => {}
    }
}

impl HfJson {
    pub fn load(path: &Path) -> Result<HfJson> {
        let text = file::read_to_string(path, FileKind::TOKENIZER_JSON)?;
        HfJson::parse(text, &path.display().to_string())
    }

    /// A tokenizer.json's text; errors name `origin` (a file, or a GGUF key).
    pub fn parse(text: String, origin: &str) -> Result<HfJson> {
        let limit = FileKind::TOKENIZER_JSON.max_bytes;
        if text.len() as u64 > limit {
            return Err(Error::format(format!(
                "{origin}: {} bytes of tokenizer.json, more than kiln reads ({limit})",
                text.len()
            )));
        }
        let json: Checked =
            serde_json::from_str(&text).map_err(|e| Error::format(format!("{origin}: {e}")))?;
        for (part, v) in [("normalizer", &json.normalizer), ("decoder", &json.decoder)] {
            let g = v.as_ref().map_or(1.0, growth);
            if g > MAX_GROWTH {
                return Err(Error::format(format!(
                    "{origin}: its {part} can make a text {g:.0} times longer (chained replacements); kiln refuses more than {MAX_GROWTH:.0}"
                )));
            }
        }
        let mut undefined = Vec::new();
        if let Some(pp) = &json.post_processor {
            undefined_template_tokens(pp, &mut undefined);
        }
        if !undefined.is_empty() {
            return Err(Error::format(format!(
                "{origin}: the post-processor's template uses special tokens it does not define in its special_tokens: {}",
                undefined.join(", ")
            )));
        }
        let tok: tokenizers::Tokenizer = text
            .parse()
            .map_err(|e| Error::format(format!("{origin}: {e}")))?;
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
            json: text,
        })
    }

    pub fn json(&self) -> &str {
        &self.json
    }

    /// Whether `id` names a token (the ids may have holes).
    pub fn has_id(&self, id: u32) -> bool {
        self.texts.contains_key(&id)
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
