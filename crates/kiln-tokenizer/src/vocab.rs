//! A vocabulary: token texts, scores and types, with a text → id index.

use kiln_core::{Error, Result};
use std::collections::HashMap;

/// Token types, numbered as SentencePiece and GGUF's `tokenizer.ggml.token_type` number them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenType {
    Normal,
    Unknown,
    Control,
    UserDefined,
    Unused,
    Byte,
}

impl TokenType {
    pub fn from_i64(v: i64) -> Option<TokenType> {
        Some(match v {
            1 => TokenType::Normal,
            2 => TokenType::Unknown,
            3 => TokenType::Control,
            4 => TokenType::UserDefined,
            5 => TokenType::Unused,
            6 => TokenType::Byte,
            _ => return None,
        })
    }
}

pub struct Vocab {
    pub tokens: Vec<String>,
    pub scores: Vec<f32>,
    pub types: Vec<TokenType>,
    ids: HashMap<String, u32>,
}

impl Vocab {
    /// `scores` and `types` must match `tokens` in length (callers fill defaults).
    pub fn new(tokens: Vec<String>, scores: Vec<f32>, types: Vec<TokenType>) -> Result<Vocab> {
        if tokens.is_empty() {
            return Err(Error::format("the vocabulary is empty"));
        }
        if u32::try_from(tokens.len()).is_err() {
            return Err(Error::format(format!(
                "the vocabulary has {} tokens, more than u32 ids can name",
                tokens.len()
            )));
        }
        if scores.len() != tokens.len() || types.len() != tokens.len() {
            return Err(Error::format(format!(
                "the vocabulary has {} tokens but {} scores and {} token types",
                tokens.len(),
                scores.len(),
                types.len()
            )));
        }
        // A repeated text maps to its last id, as llama.cpp's `token_to_id` does.
        let ids = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        Ok(Vocab {
            tokens,
            scores,
            types,
            ids,
        })
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn id(&self, text: &str) -> Option<u32> {
        self.ids.get(text).copied()
    }

    pub fn text(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    pub fn token_type(&self, id: u32) -> Option<TokenType> {
        self.types.get(id as usize).copied()
    }

    pub fn score(&self, id: u32) -> f32 {
        self.scores
            .get(id as usize)
            .copied()
            .unwrap_or(f32::NEG_INFINITY)
    }

    /// The first token of the given type, e.g. the unknown token.
    pub fn first_of_type(&self, t: TokenType) -> Option<u32> {
        self.types.iter().position(|&x| x == t).map(|i| i as u32)
    }

    /// Checks that an id from a file names a token.
    pub fn check_id(&self, what: &str, id: u64) -> Result<u32> {
        match u32::try_from(id) {
            Ok(i) if (i as usize) < self.len() => Ok(i),
            _ => Err(Error::format(format!(
                "{what} {id} is out of range for a vocabulary of {} tokens",
                self.len()
            ))),
        }
    }
}
