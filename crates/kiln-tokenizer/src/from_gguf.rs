//! Loading the vocabulary embedded in a GGUF file (`tokenizer.ggml.*` keys).

use crate::byte_bpe::ByteBpe;
use crate::hf_json::HfJson;
use crate::pretokenize::PreTokenizer;
use crate::sentencepiece::{Algorithm, SentencePiece};
use crate::to_gguf::HF_JSON_KEY;
use crate::vocab::{TokenType, Vocab};
use crate::{Model, Tokenizer};
use kiln_core::{Error, Result};
use kiln_io::gguf::{Array, GgufFile, Value};

/// Texts llama.cpp treats as end-of-generation wherever they appear in a vocabulary.
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<|end_of_text|>",
    "<end_of_utterance>",
];

fn key_err(key: &str, what: &str) -> Error {
    Error::format(format!("GGUF {key} {what}"))
}

fn opt_str<'a>(f: &'a GgufFile, key: &str) -> Result<Option<&'a str>> {
    match f.get(key) {
        None => Ok(None),
        Some(v) => v.as_str().map(Some).ok_or_else(|| {
            key_err(
                key,
                &format!("is a {}, not a string", v.value_type().name()),
            )
        }),
    }
}

fn opt_bool(f: &GgufFile, key: &str) -> Result<Option<bool>> {
    match f.get(key) {
        None => Ok(None),
        Some(v) => v
            .as_bool()
            .map(Some)
            .ok_or_else(|| key_err(key, &format!("is a {}, not a bool", v.value_type().name()))),
    }
}

fn opt_u64(f: &GgufFile, key: &str) -> Result<Option<u64>> {
    match f.get(key) {
        None => Ok(None),
        Some(v) => v.as_u64().map(Some).ok_or_else(|| {
            key_err(
                key,
                &format!("is a {}, not an unsigned integer", v.value_type().name()),
            )
        }),
    }
}

fn opt_array<'a>(f: &'a GgufFile, key: &str) -> Result<Option<&'a Array>> {
    match f.get(key) {
        None => Ok(None),
        Some(Value::Array(a)) => Ok(Some(a)),
        Some(v) => Err(key_err(
            key,
            &format!("is a {}, not an array", v.value_type().name()),
        )),
    }
}

fn strings<'a>(key: &str, a: &'a Array) -> Result<&'a [String]> {
    match a {
        Array::String(v) => Ok(v),
        other => Err(key_err(
            key,
            &format!(
                "is an array of {}, not of strings",
                other.element_type().name()
            ),
        )),
    }
}

fn scores(f: &GgufFile, n: usize) -> Result<Vec<f32>> {
    const KEY: &str = "tokenizer.ggml.scores";
    let Some(a) = opt_array(f, KEY)? else {
        return Ok(vec![0.0; n]);
    };
    let v: Vec<f32> = match a {
        Array::F32(v) => v.clone(),
        Array::F64(v) => v.iter().map(|&x| x as f32).collect(),
        other => {
            return Err(key_err(
                KEY,
                &format!("is an array of {}, not of f32", other.element_type().name()),
            ))
        }
    };
    if v.len() != n {
        return Err(key_err(
            KEY,
            &format!("has {} entries for {n} tokens", v.len()),
        ));
    }
    Ok(v)
}

fn token_types(f: &GgufFile, n: usize) -> Result<Vec<TokenType>> {
    const KEY: &str = "tokenizer.ggml.token_type";
    let Some(a) = opt_array(f, KEY)? else {
        return Ok(vec![TokenType::Normal; n]);
    };
    let raw: Vec<i64> = match a {
        Array::I32(v) => v.iter().map(|&x| x as i64).collect(),
        Array::U32(v) => v.iter().map(|&x| x as i64).collect(),
        Array::I8(v) => v.iter().map(|&x| x as i64).collect(),
        Array::U8(v) => v.iter().map(|&x| x as i64).collect(),
        other => {
            return Err(key_err(
                KEY,
                &format!(
                    "is an array of {}, not of integers",
                    other.element_type().name()
                ),
            ))
        }
    };
    if raw.len() != n {
        return Err(key_err(
            KEY,
            &format!("has {} entries for {n} tokens", raw.len()),
        ));
    }
    raw.iter()
        .enumerate()
        .map(|(i, &t)| {
            TokenType::from_i64(t)
                .ok_or_else(|| key_err(KEY, &format!("entry {i} is {t}, not a known token type")))
        })
        .collect()
}

/// An id key, checked against the vocabulary; `default` applies when the key is absent.
fn token_id(f: &GgufFile, vocab: &Vocab, key: &str, default: Option<u32>) -> Result<Option<u32>> {
    match opt_u64(f, key)? {
        Some(id) => vocab.check_id(&format!("GGUF {key}"), id).map(Some),
        None => Ok(default.filter(|&i| (i as usize) < vocab.len())),
    }
}

/// The tokenizer of a GGUF file; every error names the file.
pub fn load(f: &GgufFile) -> Result<Tokenizer> {
    let in_file = |msg: String| format!("{}: {msg}", f.path.display());
    load_keys(f).map_err(|e| match e {
        Error::Format(msg) => Error::Format(in_file(msg)),
        Error::Unsupported(msg) => Error::Unsupported(in_file(msg)),
        other => other,
    })
}

fn load_keys(f: &GgufFile) -> Result<Tokenizer> {
    // A tokenizer.json kept whole is the tokenizer exactly; `tokenizer.ggml.*` keys
    // beside it (kiln writes both where llama.cpp can read them) say it for llama.cpp.
    if let Some(json) = opt_str(f, HF_JSON_KEY)? {
        return load_hf_json(f, json);
    }
    const MODEL: &str = "tokenizer.ggml.model";
    let kind = opt_str(f, MODEL)?.ok_or_else(|| key_err(MODEL, "is missing"))?;
    let is_llama = match kind {
        "llama" => true,
        "gpt2" => false,
        other => {
            return Err(Error::unsupported(format!(
                "GGUF tokenizer.ggml.model '{other}' is not supported"
            )))
        }
    };
    const TOKENS: &str = "tokenizer.ggml.tokens";
    let tokens = strings(
        TOKENS,
        opt_array(f, TOKENS)?.ok_or_else(|| key_err(TOKENS, "is missing"))?,
    )?;
    let n = tokens.len();
    let vocab = Vocab::new(tokens.to_vec(), scores(f, n)?, token_types(f, n)?)
        .map_err(|e| Error::format(format!("GGUF tokenizer: {e}")))?;

    // llama.cpp's defaults for SentencePiece vocabularies: unk 0, bos 1, eos 2.
    let (d_unk, d_bos, d_eos) = if is_llama {
        (Some(0), Some(1), Some(2))
    } else {
        (None, None, None)
    };
    let unk = token_id(f, &vocab, "tokenizer.ggml.unknown_token_id", d_unk)?;
    let bos = token_id(f, &vocab, "tokenizer.ggml.bos_token_id", d_bos)?;
    let eos = token_id(f, &vocab, "tokenizer.ggml.eos_token_id", d_eos)?;
    let eot = token_id(f, &vocab, "tokenizer.ggml.eot_token_id", None)?;
    let eom = token_id(f, &vocab, "tokenizer.ggml.eom_token_id", None)?;
    let mut eos_ids: Vec<u32> = [eos, eot, eom].into_iter().flatten().collect();
    eos_ids.extend(EOG_TEXTS.iter().filter_map(|t| vocab.id(t)));
    let mut seen = std::collections::HashSet::new();
    eos_ids.retain(|id| seen.insert(*id));

    let pre = opt_str(f, "tokenizer.ggml.pre")?;
    let llama3 = matches!(pre, Some("llama3" | "llama-v3" | "llama-bpe"));
    // llama.cpp: SentencePiece vocabularies and llama-3 add BOS unless told otherwise.
    let add_bos = opt_bool(f, "tokenizer.ggml.add_bos_token")?.unwrap_or(is_llama || llama3);
    let add_eos = opt_bool(f, "tokenizer.ggml.add_eos_token")?.unwrap_or(false);
    let chat_template = opt_str(f, "tokenizer.chat_template")?.map(str::to_string);

    let model = if is_llama {
        let mut spm = SentencePiece::new(vocab, Algorithm::Bpe)?;
        spm.set_unk(unk);
        spm.add_space_prefix = opt_bool(f, "tokenizer.ggml.add_space_prefix")?.unwrap_or(true);
        Model::Spm(spm)
    } else {
        const MERGES: &str = "tokenizer.ggml.merges";
        let merges = strings(
            MERGES,
            opt_array(f, MERGES)?.ok_or_else(|| key_err(MERGES, "is missing"))?,
        )?;
        let pre = PreTokenizer::by_name(pre)?;
        Model::ByteBpe(
            ByteBpe::new(vocab, merges, pre)
                .map_err(|e| Error::format(format!("GGUF {MERGES}: {e}")))?,
        )
    };
    Ok(Tokenizer {
        model,
        bos,
        eos: eos_ids,
        add_bos: add_bos && bos.is_some(),
        add_eos: add_eos && eos.is_some(),
        eos_primary: eos,
        chat_template,
    })
}

/// A tokenizer.json kept whole (`tokenizer.huggingface.json`, as kiln writes a model
/// whose tokenizer came as one), with the special tokens of the `tokenizer.ggml.*` keys.
fn load_hf_json(f: &GgufFile, json: &str) -> Result<Tokenizer> {
    let h = HfJson::parse(json.to_string(), &format!("GGUF {HF_JSON_KEY}"))?;
    let id = |key: &str| -> Result<Option<u32>> {
        match opt_u64(f, key)? {
            Some(id) => match u32::try_from(id).ok().filter(|&i| h.has_id(i)) {
                Some(i) => Ok(Some(i)),
                None => Err(key_err(
                    key,
                    &format!("{id} is not a token of its vocabulary"),
                )),
            },
            None => Ok(None),
        }
    };
    let bos = id("tokenizer.ggml.bos_token_id")?;
    let eos = id("tokenizer.ggml.eos_token_id")?;
    let mut eos_ids: Vec<u32> = [
        eos,
        id("tokenizer.ggml.eot_token_id")?,
        id("tokenizer.ggml.eom_token_id")?,
    ]
    .into_iter()
    .flatten()
    .collect();
    eos_ids.extend(EOG_TEXTS.iter().filter_map(|t| h.id(t)));
    let mut seen = std::collections::HashSet::new();
    eos_ids.retain(|id| seen.insert(*id));
    let add_bos = opt_bool(f, "tokenizer.ggml.add_bos_token")?.unwrap_or(false);
    let add_eos = opt_bool(f, "tokenizer.ggml.add_eos_token")?.unwrap_or(false);
    let chat_template = opt_str(f, "tokenizer.chat_template")?.map(str::to_string);
    Ok(Tokenizer {
        model: Model::Hf(Box::new(h)),
        bos,
        eos: eos_ids,
        add_bos: add_bos && bos.is_some(),
        add_eos: add_eos && eos.is_some(),
        eos_primary: eos,
        chat_template,
    })
}
