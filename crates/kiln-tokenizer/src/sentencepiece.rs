//! SentencePiece-style tokenizers (GGUF `llama` and `tokenizer.model`): normalisation to
//! '▁'-escaped text, BPE or unigram segmentation, byte fallback, and detokenisation.

use crate::vocab::{TokenType, Vocab};
use crate::{spm_bpe, unigram};
use kiln_core::{Error, Result};

const SPACE: char = '\u{2581}';

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Algorithm {
    Bpe,
    Unigram,
}

pub struct SentencePiece {
    pub vocab: Vocab,
    pub algorithm: Algorithm,
    /// Prefix the text with a space (SentencePiece's dummy prefix).
    pub add_space_prefix: bool,
    /// Drop leading/trailing spaces and collapse runs (sentencepiece's default normaliser;
    /// llama.cpp never does this).
    pub remove_extra_whitespaces: bool,
    /// Replace ' ' with '▁' before segmenting.
    pub escape_whitespaces: bool,
    /// sentencepiece proper never merges into control, unknown or byte pieces; llama.cpp
    /// looks every vocabulary entry up.
    pub merge_any_type: bool,
    unk: Option<u32>,
    /// The pieces unigram segmentation uses (empty for BPE).
    lattice_pieces: unigram::PieceIndex,
    unk_score: f32,
    /// The highest normal piece score: user-defined pieces score above any split.
    max_score: f32,
}

impl SentencePiece {
    /// Fails only for a unigram vocabulary with a piece longer than sentencepiece allows.
    pub fn new(vocab: Vocab, algorithm: Algorithm) -> Result<SentencePiece> {
        let unk = vocab.first_of_type(TokenType::Unknown);
        let normal_scores = || {
            vocab
                .scores
                .iter()
                .zip(&vocab.types)
                .filter(|(_, &t)| t == TokenType::Normal)
                .map(|(&s, _)| s)
        };
        // sentencepiece: unknown characters score 10 below the least likely normal piece.
        let min_score = normal_scores().fold(f32::INFINITY, f32::min);
        let unk_score = if min_score.is_finite() {
            min_score
        } else {
            0.0
        } - 10.0;
        let max_score = normal_scores().fold(0.0, f32::max);
        let lattice_pieces = match algorithm {
            Algorithm::Bpe => unigram::PieceIndex::default(),
            Algorithm::Unigram => unigram::PieceIndex::new(&vocab, |id| {
                matches!(
                    vocab.token_type(id),
                    Some(TokenType::Normal | TokenType::UserDefined)
                )
            })?,
        };
        Ok(SentencePiece {
            vocab,
            algorithm,
            add_space_prefix: true,
            remove_extra_whitespaces: false,
            escape_whitespaces: true,
            merge_any_type: true,
            unk,
            lattice_pieces,
            unk_score,
            max_score,
        })
    }

    pub fn set_unk(&mut self, unk: Option<u32>) {
        self.unk = unk;
    }

    fn mergeable(&self, id: u32) -> bool {
        match self.vocab.token_type(id) {
            Some(TokenType::Normal | TokenType::UserDefined | TokenType::Unused) => true,
            Some(_) => self.merge_any_type,
            None => false,
        }
    }

    fn normalize(&self, text: &str) -> String {
        let text = if self.remove_extra_whitespaces {
            let mut s = String::with_capacity(text.len());
            for word in text.split(' ').filter(|w| !w.is_empty()) {
                if !s.is_empty() {
                    s.push(' ');
                }
                s.push_str(word);
            }
            s
        } else {
            text.to_string()
        };
        if text.is_empty() {
            return text;
        }
        let mut s = String::with_capacity(text.len() + 3);
        if self.add_space_prefix {
            s.push(' ');
        }
        s.push_str(&text);
        if self.escape_whitespaces {
            s = s.replace(' ', "\u{2581}");
        }
        s
    }

    pub fn encode(&self, text: &str, out: &mut Vec<u32>) -> Result<()> {
        let text = self.normalize(text);
        if text.is_empty() {
            return Ok(());
        }
        let pieces = match self.algorithm {
            Algorithm::Bpe => spm_bpe::merge(&text, |p| {
                let id = self.vocab.id(p)?;
                self.mergeable(id).then(|| (id, self.vocab.score(id)))
            }),
            Algorithm::Unigram => unigram::viterbi(
                &text,
                &self.lattice_pieces,
                &self.vocab,
                self.unk_score,
                |id| match self.vocab.token_type(id) {
                    // sentencepiece prefers user-defined pieces over any split of them.
                    Some(TokenType::UserDefined) => {
                        self.vocab.tokens[id as usize].len() as f32 * self.max_score - 0.1
                    }
                    _ => self.vocab.score(id),
                },
            ),
        };
        let mut prev_unk = false;
        for piece in pieces {
            match piece {
                Ok(id) => {
                    out.push(id);
                    prev_unk = false;
                }
                Err(range) => {
                    prev_unk = self.byte_fallback(&text.as_bytes()[range], prev_unk, out)?
                }
            }
        }
        Ok(())
    }

    /// Text outside the vocabulary: one `<0xNN>` token per byte (llama.cpp's
    /// `byte_to_token`), else the unknown token, one for a run of unknown text as
    /// sentencepiece merges them. Returns whether it emitted the unknown token.
    fn byte_fallback(&self, bytes: &[u8], prev_unk: bool, out: &mut Vec<u32>) -> Result<bool> {
        let has_bytes = self.vocab.id("<0x00>").is_some();
        if !has_bytes {
            return match self.unk {
                Some(unk) => {
                    if !prev_unk {
                        out.push(unk);
                    }
                    Ok(true)
                }
                None => Err(Error::format(format!(
                    "text {:?} is not in the vocabulary, which has neither byte tokens nor an unknown token",
                    String::from_utf8_lossy(bytes)
                ))),
            };
        }
        for &b in bytes {
            let id = self
                .vocab
                .id(&format!("<0x{b:02X}>"))
                .or_else(|| {
                    // llama.cpp's second try: the byte as a one-character token.
                    if b.is_ascii() {
                        self.vocab.id(&(b as char).to_string())
                    } else {
                        None
                    }
                })
                .or(self.unk)
                .ok_or_else(|| {
                    Error::format(format!(
                        "byte 0x{b:02X} has no token and there is no unknown token"
                    ))
                })?;
            out.push(id);
        }
        Ok(false)
    }

    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        let Some(text) = self.vocab.text(id) else {
            return Vec::new();
        };
        match self.vocab.token_type(id) {
            Some(TokenType::Byte) => match parse_byte_token(text) {
                Some(b) => vec![b],
                None => text.as_bytes().to_vec(),
            },
            Some(TokenType::Control) => text.as_bytes().to_vec(),
            _ => text.replace(SPACE, " ").into_bytes(),
        }
    }

    /// Concatenated token bytes, less the dummy-prefix space of the first token.
    pub fn decode(&self, ids: &[u32]) -> Vec<u8> {
        let mut out = Vec::new();
        for (i, &id) in ids.iter().enumerate() {
            let bytes = self.token_bytes(id);
            let strip = i == 0 && self.add_space_prefix && bytes.first() == Some(&b' ');
            out.extend_from_slice(if strip { &bytes[1..] } else { &bytes });
        }
        out
    }
}

/// `<0xNN>` → the byte.
pub fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}
