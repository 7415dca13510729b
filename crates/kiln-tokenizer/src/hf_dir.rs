//! A Hugging Face model directory: `tokenizer.json` or `tokenizer.model`, plus the special
//! tokens and chat template from `tokenizer_config.json` / `generation_config.json`.

use crate::hf_json::HfJson;
use crate::{sentencepiece_model, Model, Tokenizer};
use kiln_core::{Error, Result};
use kiln_io::file::{self, FileKind};
use serde_json::Value;
use std::path::Path;

fn read_json(path: &Path) -> Result<Option<Value>> {
    let Some(text) = file::read_to_string_if_present(path, FileKind::CONFIG_JSON)? else {
        return Ok(None);
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| Error::format(format!("{}: {e}", path.display())))
}

/// A special token in tokenizer_config.json: a string or an AddedToken `{"content": ..}`.
fn token_field<'a>(cfg: &'a Value, key: &str) -> Option<&'a str> {
    let v = cfg.get(key)?;
    v.as_str()
        .or_else(|| v.get("content").and_then(Value::as_str))
}

/// `chat_template` is a string, or a list of `{name, template}` (take "default").
fn chat_template(cfg: &Value) -> Option<String> {
    match cfg.get("chat_template")? {
        Value::String(s) => Some(s.clone()),
        Value::Array(list) => {
            let named = |n: &str| {
                list.iter()
                    .find(|t| t.get("name").and_then(Value::as_str) == Some(n))
            };
            named("default")
                .or_else(|| list.first())
                .and_then(|t| t.get("template"))
                .and_then(Value::as_str)
                .map(str::to_string)
        }
        _ => None,
    }
}

/// generation_config.json ids: a number or a list of numbers.
fn ids_field(cfg: &Value, key: &str) -> Vec<u64> {
    match cfg.get(key) {
        Some(Value::Number(n)) => n.as_u64().into_iter().collect(),
        Some(Value::Array(a)) => a.iter().filter_map(Value::as_u64).collect(),
        _ => Vec::new(),
    }
}

pub fn load(dir: &Path, prefer_sentencepiece: bool) -> Result<Tokenizer> {
    let cfg = read_json(&dir.join("tokenizer_config.json"))?.unwrap_or(Value::Null);
    let gen = read_json(&dir.join("generation_config.json"))?.unwrap_or(Value::Null);
    let cfg_bool = |k: &str| cfg.get(k).and_then(Value::as_bool);
    let mut chat = chat_template(&cfg);
    if chat.is_none() {
        // Newer transformers save the template beside the config. Read (bounded) even
        // when no chat is asked for: a tokenizer carries its template.
        chat = file::read_to_string_if_present(
            &dir.join("chat_template.jinja"),
            FileKind::CHAT_TEMPLATE,
        )?;
    }

    let json_path = dir.join("tokenizer.json");
    let model_path = dir.join("tokenizer.model");
    let (model, model_bos, model_eos) =
        if json_path.exists() && !(prefer_sentencepiece && model_path.exists()) {
            (Model::Hf(Box::new(HfJson::load(&json_path)?)), None, None)
        } else if model_path.exists() {
            let bytes = file::read(&model_path, FileKind::SENTENCEPIECE_MODEL)?;
            let m = sentencepiece_model::parse(&bytes)
                .map_err(|e| Error::format(format!("{}: {e}", model_path.display())))?;
            (Model::Spm(m.model), m.bos, m.eos)
        } else {
            return Err(Error::format(format!(
                "{}: neither tokenizer.json nor tokenizer.model is present",
                dir.display()
            )));
        };

    let lookup = |t: &str| model.id(t);
    let in_vocab = |id: u64| u32::try_from(id).ok().filter(|&i| model.has_id(i));
    let mut bos = token_field(&cfg, "bos_token")
        .and_then(lookup)
        .or_else(|| {
            ids_field(&gen, "bos_token_id")
                .into_iter()
                .find_map(in_vocab)
        })
        .or(model_bos);
    let eos_primary = token_field(&cfg, "eos_token")
        .and_then(lookup)
        .or_else(|| {
            ids_field(&gen, "eos_token_id")
                .into_iter()
                .find_map(in_vocab)
        })
        .or(model_eos);
    let mut eos: Vec<u32> = eos_primary.into_iter().collect();
    for id in ids_field(&gen, "eos_token_id")
        .into_iter()
        .filter_map(in_vocab)
    {
        if !eos.contains(&id) {
            eos.push(id);
        }
    }

    let (add_bos, add_eos) = match &model {
        Model::Hf(h) => {
            // What the post-processor adds, found by asking it; tokenizer_config's flags
            // override it, as transformers' fast Llama tokenizers do.
            let with = h.encode("a", true)?;
            let without = h.encode("a", false)?;
            let extra = with.len() > without.len();
            if bos.is_none() && extra && with.first() != without.first() {
                bos = with.first().copied();
            }
            let pp_bos = extra && bos.is_some() && with.first() == bos.as_ref();
            let pp_eos = extra && eos_primary.is_some() && with.last() == eos_primary.as_ref();
            (
                cfg_bool("add_bos_token").unwrap_or(pp_bos),
                cfg_bool("add_eos_token").unwrap_or(pp_eos),
            )
        }
        // Llama-style SentencePiece models add BOS unless the config says not to.
        _ => (
            cfg_bool("add_bos_token").unwrap_or(true),
            cfg_bool("add_eos_token").unwrap_or(false),
        ),
    };
    Ok(Tokenizer {
        model,
        bos,
        eos,
        add_bos: add_bos && bos.is_some(),
        add_eos: add_eos && eos_primary.is_some(),
        eos_primary,
        chat_template: chat,
    })
}
