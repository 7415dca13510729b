//! kiln's tokenizers: the vocabularies GGUF files embed (SentencePiece `llama`, byte-level
//! BPE `gpt2`), Hugging Face `tokenizer.json` (through the `tokenizers` crate) and bare
//! SentencePiece `tokenizer.model` files (parsed and run by hand).
//!
//! The hand-written algorithms follow llama.cpp (`llm_tokenizer_spm`, `llm_tokenizer_bpe`)
//! and sentencepiece, so that ids match the model's training exactly.

mod byte_bpe;
mod byte_level;
mod from_gguf;
mod hf_dir;
mod hf_json;
mod pretokenize;
mod protobuf;
mod sentencepiece;
mod sentencepiece_model;
mod spm_bpe;
mod to_gguf;
mod to_hf;
mod unigram;
mod vocab;

pub use kiln_core::{Error, Result};

use byte_bpe::ByteBpe;
use hf_json::HfJson;
use sentencepiece::SentencePiece;

enum Model {
    Spm(SentencePiece),
    ByteBpe(ByteBpe),
    Hf(Box<HfJson>),
}

impl Model {
    fn vocab_size(&self) -> usize {
        match self {
            Model::Spm(m) => m.vocab.len(),
            Model::ByteBpe(m) => m.vocab.len(),
            Model::Hf(h) => h.vocab_size(),
        }
    }

    /// Whether `id` names a token (tokenizer.json ids may have holes).
    fn has_id(&self, id: u32) -> bool {
        match self {
            Model::Spm(m) => (id as usize) < m.vocab.len(),
            Model::ByteBpe(m) => (id as usize) < m.vocab.len(),
            Model::Hf(h) => h.has_id(id),
        }
    }

    fn id(&self, text: &str) -> Option<u32> {
        match self {
            Model::Spm(m) => m.vocab.id(text),
            Model::ByteBpe(m) => m.vocab.id(text),
            Model::Hf(h) => h.id(text),
        }
    }
}

/// A tokenizer with its special tokens and chat template.
pub struct Tokenizer {
    model: Model,
    bos: Option<u32>,
    /// End-of-generation ids, the EOS token first.
    eos: Vec<u32>,
    add_bos: bool,
    add_eos: bool,
    /// The EOS that `encode(.., true)` appends when `add_eos`.
    eos_primary: Option<u32>,
    chat_template: Option<String>,
}

impl Tokenizer {
    /// Vocabulary embedded in a GGUF file (`tokenizer.ggml.model` = "llama" or "gpt2").
    pub fn from_gguf(file: &kiln_io::gguf::GgufFile) -> Result<Tokenizer> {
        from_gguf::load(file)
    }

    /// A Hugging Face model directory: tokenizer.json if present, else tokenizer.model;
    /// tokenizer_config.json and generation_config.json supply special tokens and the
    /// chat template.
    pub fn from_hf_dir(dir: &std::path::Path) -> Result<Tokenizer> {
        hf_dir::load(dir, false)
    }

    /// Like `from_hf_dir`, but the SentencePiece `tokenizer.model` wins over
    /// tokenizer.json when both are present (to write its vocabulary to GGUF).
    pub fn from_hf_dir_sentencepiece(dir: &std::path::Path) -> Result<Tokenizer> {
        hf_dir::load(dir, true)
    }

    /// Token ids for `text`. Special-token text in `text` is plain text for the GGUF and
    /// SentencePiece tokenizers (llama.cpp's `parse_special = false`); tokenizer.json
    /// matches its added tokens, as the `tokenizers` crate does.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if add_special && self.add_bos {
            out.extend(self.bos);
        }
        match &self.model {
            Model::Spm(m) => m.encode(text, &mut out)?,
            Model::ByteBpe(m) => m.encode(text, &mut out)?,
            // BOS/EOS are added here, not by the post-processor, so that add_bos() and
            // tokenizer_config.json's flags say what happens.
            Model::Hf(h) => out.extend(h.encode(text, false)?),
        }
        if add_special && self.add_eos {
            out.extend(self.eos_primary);
        }
        Ok(out)
    }

    /// Like `encode`, but text spelling a control or user-defined token (`<|im_start|>`,
    /// `<start_of_turn>`, ...) becomes that token, as llama.cpp does for chat prompts
    /// (`parse_special = true`). tokenizer.json tokenizers already do this.
    pub fn encode_with_special_tokens(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        let vocab = match &self.model {
            Model::Spm(m) => &m.vocab,
            Model::ByteBpe(m) => &m.vocab,
            Model::Hf(_) => return self.encode(text, add_special),
        };
        let mut specials: Vec<(&str, u32)> = (0..vocab.len() as u32)
            .filter(|&id| {
                matches!(
                    vocab.token_type(id),
                    Some(vocab::TokenType::Control | vocab::TokenType::UserDefined)
                )
            })
            .filter_map(|id| vocab.text(id).filter(|t| !t.is_empty()).map(|t| (t, id)))
            .collect();
        // Longest first, so that a special token containing another wins.
        specials.sort_by_key(|(t, _)| std::cmp::Reverse(t.len()));
        let mut out = Vec::new();
        if add_special && self.add_bos {
            out.extend(self.bos);
        }
        let mut plain_start = 0;
        let mut i = 0;
        while i < text.len() {
            match specials.iter().find(|(t, _)| text[i..].starts_with(t)) {
                Some(&(t, id)) => {
                    if plain_start < i {
                        out.extend(self.encode(&text[plain_start..i], false)?);
                    }
                    out.push(id);
                    i += t.len();
                    plain_start = i;
                }
                None => i += text[i..].chars().next().map_or(1, char::len_utf8),
            }
        }
        if plain_start < text.len() {
            out.extend(self.encode(&text[plain_start..], false)?);
        }
        if add_special && self.add_eos {
            out.extend(self.eos_primary);
        }
        Ok(out)
    }

    /// The text of a whole sequence; a leading BOS is dropped, every other token kept.
    /// Bytes that are not valid UTF-8 become U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        let ids = match (ids.first(), self.bos) {
            (Some(&first), Some(bos)) if first == bos => &ids[1..],
            _ => ids,
        };
        let bytes = match &self.model {
            Model::Spm(m) => m.decode(ids),
            Model::ByteBpe(m) => ids.iter().flat_map(|&id| m.token_bytes(id)).collect(),
            Model::Hf(h) => return h.decode(ids),
        };
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// Bytes one token adds to the output stream: '▁' → ' ', `<0xNN>` → that byte,
    /// GPT-2 byte-level characters → bytes, control tokens → their text. Empty for ids
    /// outside the vocabulary. Unlike `decode`, the dummy-prefix space is kept.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        match &self.model {
            Model::Spm(m) => m.token_bytes(id),
            Model::ByteBpe(m) => m.token_bytes(id),
            Model::Hf(h) => h.token_bytes(id),
        }
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    /// Ids that end generation: EOS, then EOT/EOM and other end-of-turn tokens.
    pub fn eos_ids(&self) -> Vec<u32> {
        self.eos.clone()
    }

    /// Whether `encode(.., true)` prepends BOS.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// Whether `encode(.., true)` appends EOS.
    pub fn add_eos(&self) -> bool {
        self.add_eos
    }

    pub fn vocab_size(&self) -> usize {
        self.model.vocab_size()
    }

    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// The raw vocabulary entry.
    pub fn token_text(&self, id: u32) -> Option<&str> {
        match &self.model {
            Model::Spm(m) => m.vocab.text(id),
            Model::ByteBpe(m) => m.vocab.text(id),
            Model::Hf(h) => h.text(id),
        }
    }

    /// The id of a vocabulary entry, e.g. a chat template's `<|im_end|>`.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.model.id(text)
    }
}
