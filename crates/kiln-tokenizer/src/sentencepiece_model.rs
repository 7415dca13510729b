//! SentencePiece's `tokenizer.model` (a serialized `ModelProto`), parsed by hand.
//!
//! ModelProto: 1 repeated SentencePiece {1 piece, 2 score, 3 type}, 2 TrainerSpec,
//! 3 NormalizerSpec. Only the fields that change tokenisation are read.

use crate::protobuf::{Field, Reader};
use crate::sentencepiece::{Algorithm, SentencePiece};
use crate::vocab::{TokenType, Vocab};
use kiln_core::{Error, Result};

pub struct ModelFile {
    pub model: SentencePiece,
    /// TrainerSpec bos_id / eos_id (negative: none).
    pub bos: Option<u32>,
    pub eos: Option<u32>,
}

fn bad(what: impl std::fmt::Display) -> Error {
    Error::format(format!("SentencePiece model: {what}"))
}

fn as_i64(f: &Field) -> Option<i64> {
    match *f {
        // int32 fields are sign-extended to 64 bits on the wire.
        Field::Varint(v) => Some(v as i64),
        _ => None,
    }
}

pub fn parse(bytes: &[u8]) -> Result<ModelFile> {
    let mut tokens = Vec::new();
    let mut scores = Vec::new();
    let mut types = Vec::new();
    let mut model_type = 1i64; // UNIGRAM is the proto default
    let (mut unk_id, mut bos_id, mut eos_id) = (0i64, 1i64, 2i64);
    let (mut dummy_prefix, mut remove_ws, mut escape_ws) = (true, true, true);
    let mut treat_ws_as_suffix = false;

    let mut r = Reader::new(bytes);
    while let Some((num, field)) = r.next_field().map_err(bad)? {
        let Field::Bytes(body) = field else {
            continue;
        };
        match num {
            1 => {
                let (piece, score, ty) = parse_piece(body).map_err(bad)?;
                tokens.push(piece);
                scores.push(score);
                types.push(ty);
            }
            2 => {
                let mut t = Reader::new(body);
                while let Some((n, f)) = t.next_field().map_err(bad)? {
                    let v = as_i64(&f);
                    match (n, v) {
                        (3, Some(v)) => model_type = v,
                        (24, Some(v)) => treat_ws_as_suffix = v != 0,
                        (40, Some(v)) => unk_id = v,
                        (41, Some(v)) => bos_id = v,
                        (42, Some(v)) => eos_id = v,
                        _ => {}
                    }
                }
            }
            3 => {
                let mut t = Reader::new(body);
                while let Some((n, f)) = t.next_field().map_err(bad)? {
                    match (n, as_i64(&f)) {
                        (3, Some(v)) => dummy_prefix = v != 0,
                        (4, Some(v)) => remove_ws = v != 0,
                        (5, Some(v)) => escape_ws = v != 0,
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    if tokens.is_empty() {
        return Err(bad("no pieces (not a SentencePiece model?)"));
    }
    let algorithm = match model_type {
        1 => Algorithm::Unigram,
        2 => Algorithm::Bpe,
        3 => {
            return Err(Error::unsupported(
                "SentencePiece model type WORD is not supported",
            ))
        }
        4 => {
            return Err(Error::unsupported(
                "SentencePiece model type CHAR is not supported",
            ))
        }
        t => return Err(bad(format!("unknown model type {t}"))),
    };
    if treat_ws_as_suffix {
        return Err(Error::unsupported(
            "SentencePiece treat_whitespace_as_suffix is not supported",
        ));
    }
    let vocab = Vocab::new(tokens, scores, types).map_err(bad)?;
    let id = |v: i64| {
        u32::try_from(v)
            .ok()
            .filter(|&i| (i as usize) < vocab.len())
    };
    let (unk, bos, eos) = (id(unk_id), id(bos_id), id(eos_id));
    let mut model = SentencePiece::new(vocab, algorithm).map_err(bad)?;
    if unk.is_some() {
        model.set_unk(unk);
    }
    model.add_space_prefix = dummy_prefix;
    model.remove_extra_whitespaces = remove_ws;
    model.escape_whitespaces = escape_ws;
    model.merge_any_type = false;
    Ok(ModelFile { model, bos, eos })
}

fn parse_piece(body: &[u8]) -> Result<(String, f32, TokenType)> {
    let mut r = Reader::new(body);
    let (mut piece, mut score, mut ty) = (None, 0.0f32, TokenType::Normal);
    while let Some((n, f)) = r.next_field()? {
        match (n, f) {
            (1, Field::Bytes(b)) => {
                piece = Some(
                    String::from_utf8(b.to_vec())
                        .map_err(|_| Error::format("a piece is not valid UTF-8"))?,
                )
            }
            (2, Field::Fixed32(v)) => score = f32::from_bits(v),
            (3, Field::Varint(v)) => {
                ty = i64::try_from(v)
                    .ok()
                    .and_then(TokenType::from_i64)
                    .ok_or_else(|| Error::format(format!("unknown piece type {v}")))?
            }
            _ => {}
        }
    }
    let piece = piece.ok_or_else(|| Error::format("a piece has no text"))?;
    Ok((piece, score, ty))
}
