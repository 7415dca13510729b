//! Ids must equal those of Python's sentencepiece and tokenizers on the strings in
//! tests/data/expected.json (written by tests/data/make.py), and decode must invert encode.

use kiln_io::gguf::GgufFile;
use kiln_tokenizer::Tokenizer;
use std::path::PathBuf;

fn data(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}

struct Expected {
    tests: Vec<String>,
    ids: Vec<Vec<u32>>,
}

fn expected(key: &str) -> Expected {
    let text = std::fs::read_to_string(data("expected.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let tests: Vec<String> = serde_json::from_value(v["tests"].clone()).unwrap();
    let ids: Vec<Vec<u32>> = serde_json::from_value(v[key].clone()).unwrap();
    assert!(
        tests.len() > 20 && ids.len() == tests.len(),
        "{key}: bad expected.json"
    );
    Expected { tests, ids }
}

/// Encodes every test string with BOS as configured; checks ids, decode and token_bytes.
fn check(tok: &Tokenizer, key: &str, strip_prefix: bool) {
    check_except(tok, key, strip_prefix, &[]);
}

/// As `check`, not requiring round trips for strings containing any of `no_round_trip`.
fn check_except(tok: &Tokenizer, key: &str, strip_prefix: bool, no_round_trip: &[&str]) {
    let e = expected(key);
    let mut failures = Vec::new();
    for (text, want) in e.tests.iter().zip(&e.ids) {
        let got = tok.encode(text, true).unwrap();
        if &got != want {
            failures.push(format!("{text:?}:\n  got  {got:?}\n  want {want:?}"));
            continue;
        }
        if no_round_trip.iter().any(|s| text.contains(s)) {
            continue;
        }
        // SentencePiece escapes spaces as '▁', so a literal '▁' comes back as a space
        // (sentencepiece's own decode does the same).
        let text = &if strip_prefix {
            text.replace('\u{2581}', " ")
        } else {
            text.clone()
        };
        let decoded = tok.decode(&got).unwrap();
        if &decoded != text {
            failures.push(format!("{text:?}: decoded to {decoded:?}"));
        }
        // Streaming: the tokens' bytes (after BOS) concatenate to the text, with the
        // dummy-prefix space SentencePiece adds.
        let body = match tok.bos_id() {
            Some(b) if got.first() == Some(&b) => &got[1..],
            _ => &got[..],
        };
        let bytes: Vec<u8> = body.iter().flat_map(|&id| tok.token_bytes(id)).collect();
        let mut want_bytes = Vec::new();
        if strip_prefix && !text.is_empty() {
            want_bytes.push(b' ');
        }
        want_bytes.extend_from_slice(text.as_bytes());
        if bytes != want_bytes {
            failures.push(format!(
                "{text:?}: token bytes give {:?}",
                String::from_utf8_lossy(&bytes)
            ));
        }
    }
    assert!(failures.is_empty(), "{key}:\n{}", failures.join("\n"));
}

#[test]
fn gguf_llama_matches_sentencepiece() {
    let f = GgufFile::open(data("llama.gguf")).unwrap();
    let tok = Tokenizer::from_gguf(&f).unwrap();
    assert!(tok.add_bos());
    assert_eq!(tok.bos_id(), Some(1));
    assert_eq!(tok.eos_ids(), vec![2]);
    assert_eq!(tok.token_text(1), Some("<s>"));
    assert!(tok.chat_template().is_some());
    assert_eq!(tok.vocab_size(), 1000);
    check(&tok, "spm_bpe", true);
    // Without add_special: no BOS.
    let plain = tok.encode("Hello world", false).unwrap();
    assert_eq!(plain, tok.encode("Hello world", true).unwrap()[1..]);
    assert_eq!(tok.encode("", false).unwrap(), Vec::<u32>::new());
}

#[test]
fn tokenizer_model_bpe_matches_sentencepiece() {
    let tok = Tokenizer::from_hf_dir(&data("hf_spm")).unwrap();
    assert!(tok.add_bos());
    assert_eq!(tok.bos_id(), Some(1));
    assert_eq!(tok.eos_ids(), vec![2]);
    assert_eq!(tok.chat_template(), Some("{{ messages }}"));
    check(&tok, "spm_bpe", true);
}

#[test]
fn tokenizer_model_unigram_matches_sentencepiece() {
    let tok = Tokenizer::from_hf_dir(&data("hf_uni")).unwrap();
    check(&tok, "spm_unigram", true);
}

#[test]
fn tokenizer_json_matches_tokenizers() {
    let tok = Tokenizer::from_hf_dir(&data("hf_bpe")).unwrap();
    assert!(!tok.add_bos());
    let eot = tok.token_id("<|endoftext|>").unwrap();
    assert_eq!(tok.eos_ids(), vec![eot]);
    check(&tok, "bpe", false);
}

#[test]
fn gguf_gpt2_matches_tokenizers() {
    let f = GgufFile::open(data("bpe.gguf")).unwrap();
    let tok = Tokenizer::from_gguf(&f).unwrap();
    assert!(!tok.add_bos());
    check(&tok, "bpe", false);
    // Control tokens in text stay plain text.
    let ids = tok.encode("<|endoftext|>", true).unwrap();
    assert!(ids.len() > 1, "{ids:?}");
    let eot = tok.token_id("<|endoftext|>").unwrap();
    assert_eq!(tok.token_bytes(eot), b"<|endoftext|>");
}

#[test]
fn byte_tokens_stream_raw_bytes() {
    let f = GgufFile::open(data("llama.gguf")).unwrap();
    let tok = Tokenizer::from_gguf(&f).unwrap();
    let nl = tok.token_id("<0x0A>").unwrap();
    assert_eq!(tok.token_bytes(nl), b"\n");
    let e9 = tok.token_id("<0xE9>").unwrap();
    assert_eq!(tok.token_bytes(e9), [0xE9]);
    assert_eq!(tok.token_bytes(u32::MAX), Vec::<u8>::new());
    assert_eq!(tok.token_text(u32::MAX), None);
}

#[test]
fn generation_config_adds_eos_ids() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        data("hf_spm/tokenizer.model"),
        dir.path().join("tokenizer.model"),
    )
    .unwrap();
    std::fs::write(
        dir.path().join("generation_config.json"),
        r#"{"bos_token_id": 1, "eos_token_id": [2, 5]}"#,
    )
    .unwrap();
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        r#"{"add_bos_token": false, "add_eos_token": true, "eos_token": {"content": "</s>"}}"#,
    )
    .unwrap();
    let tok = Tokenizer::from_hf_dir(dir.path()).unwrap();
    assert_eq!(tok.eos_ids(), vec![2, 5]);
    assert!(!tok.add_bos());
    let ids = tok.encode("Hello", true).unwrap();
    assert_eq!(ids.last(), Some(&2));
    assert_ne!(ids.first(), Some(&1));
}

#[test]
fn llama3_pre_tokenizer_matches_tokenizers() {
    let f = GgufFile::open(data("llama3.gguf")).unwrap();
    let tok = Tokenizer::from_gguf(&f).unwrap();
    check(&tok, "llama3", false);
    let tok = Tokenizer::from_hf_dir(&data("hf_llama3")).unwrap();
    check(&tok, "llama3", false);
}

#[test]
fn qwen2_pre_tokenizer_matches_tokenizers() {
    let f = GgufFile::open(data("qwen2.gguf")).unwrap();
    let tok = Tokenizer::from_gguf(&f).unwrap();
    check(&tok, "qwen2", false);
    let tok = Tokenizer::from_hf_dir(&data("hf_qwen2")).unwrap();
    check(&tok, "qwen2", false);
}

#[test]
fn llama_style_tokenizer_json_matches_tokenizers() {
    let tok = Tokenizer::from_hf_dir(&data("hf_spm_json")).unwrap();
    // The "<s> $A" post-processor is detected.
    assert!(tok.add_bos());
    assert_eq!(tok.bos_id(), Some(1));
    assert_eq!(tok.eos_ids(), vec![2]);
    // tokenizer.json splits special tokens out of text (unlike llama.cpp), and then
    // prefixes the next piece with '▁' again, so such text does not round-trip.
    check_except(&tok, "spm_json", true, &["<s>"]);
    let nl = tok.token_id("<0x0A>").unwrap();
    assert_eq!(tok.token_bytes(nl), b"\n");
}

#[test]
fn tokenizer_config_overrides_the_post_processor() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        data("hf_spm_json/tokenizer.json"),
        dir.path().join("tokenizer.json"),
    )
    .unwrap();
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        r#"{"add_bos_token": false, "add_eos_token": true, "bos_token": "<s>", "eos_token": "</s>",
            "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}"#,
    )
    .unwrap();
    let tok = Tokenizer::from_hf_dir(dir.path()).unwrap();
    assert!(!tok.add_bos());
    let ids = tok.encode("Hello", true).unwrap();
    assert_ne!(ids.first(), Some(&1));
    assert_eq!(ids.last(), Some(&2));
    assert_eq!(tok.chat_template(), Some("D"));
}

/// A GGUF holding only `tok`'s metadata, read back.
fn through_gguf(tok: &Tokenizer) -> Tokenizer {
    let mut w = kiln_io::gguf::GgufWriter::new();
    for (k, v) in tok.gguf_metadata().unwrap() {
        w.set(&k, v).unwrap();
    }
    let mut bytes = Vec::new();
    w.write_to(&mut bytes).unwrap();
    Tokenizer::from_gguf(&GgufFile::from_bytes("t.gguf", bytes).unwrap()).unwrap()
}

/// `tok`'s Hugging Face files written to a directory, read back.
fn through_hf_dir(tok: &Tokenizer) -> Tokenizer {
    let dir = tempfile::tempdir().unwrap();
    for (name, bytes) in tok.hf_files().unwrap() {
        std::fs::write(dir.path().join(name), bytes).unwrap();
    }
    Tokenizer::from_hf_dir(dir.path()).unwrap()
}

/// What a model kiln writes (a checkpoint, an export) carries of a tokenizer.json: the
/// same ids for every test string, the same special tokens and template.
#[test]
fn a_tokenizer_json_survives_gguf_and_hugging_face_exports() {
    for (dir, key) in [
        ("hf_bpe", "bpe"),
        ("hf_llama3", "llama3"),
        ("hf_qwen2", "qwen2"),
    ] {
        // The fixture with BOS added and a chat template, so that both must survive.
        let src = tempfile::tempdir().unwrap();
        std::fs::copy(
            data(dir).join("tokenizer.json"),
            src.path().join("tokenizer.json"),
        )
        .unwrap();
        let template = "{% for m in messages %}{{ m['content'] }}{% endfor %}";
        let config = serde_json::json!({
            "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
            "add_bos_token": true, "chat_template": template,
        });
        std::fs::write(src.path().join("tokenizer_config.json"), config.to_string()).unwrap();
        let tok = Tokenizer::from_hf_dir(src.path()).unwrap();
        assert!(tok.add_bos() && tok.bos_id().is_some(), "{dir}");
        for (how, back) in [("GGUF", through_gguf(&tok)), ("HF", through_hf_dir(&tok))] {
            let what = format!("{dir} through {how}");
            for text in expected(key).tests {
                assert_eq!(
                    back.encode(&text, true).unwrap(),
                    tok.encode(&text, true).unwrap(),
                    "{what}: {text:?}"
                );
            }
            assert_eq!(back.bos_id(), tok.bos_id(), "{what}");
            assert_eq!(back.add_bos(), tok.add_bos(), "{what}");
            assert_eq!(back.add_eos(), tok.add_eos(), "{what}");
            assert_eq!(back.eos_ids().first(), tok.eos_ids().first(), "{what}");
            // GGUF readers add the end-of-generation texts of the vocabulary.
            assert!(
                tok.eos_ids().iter().all(|id| back.eos_ids().contains(id)),
                "{what}: {:?} lost some of {:?}",
                back.eos_ids(),
                tok.eos_ids()
            );
            assert_eq!(back.vocab_size(), tok.vocab_size(), "{what}");
            assert_eq!(back.chat_template(), Some(template), "{what}");
        }
    }
}

/// What kiln writes of a byte-level BPE tokenizer.json for llama.cpp (its `gpt2`
/// tokenizer model, derived from the json): read through those keys alone, as llama.cpp
/// would, the ids equal Python tokenizers' on every test string. A tokenizer.json those
/// keys cannot say (SentencePiece-style BPE with byte fallback) gets none.
#[test]
fn llama_cpp_keys_derived_from_a_tokenizer_json_tokenize_as_it_does() {
    for (dir, key, pre) in [
        ("hf_bpe", "bpe", "gpt-2"),
        ("hf_llama3", "llama3", "llama-bpe"),
        ("hf_qwen2", "qwen2", "qwen2"),
    ] {
        let tok = Tokenizer::from_hf_dir(&data(dir)).unwrap();
        let mut w = kiln_io::gguf::GgufWriter::new();
        let meta = tok.gguf_metadata().unwrap();
        assert!(
            meta.iter()
                .any(|(k, v)| k == "tokenizer.ggml.pre" && v.as_str() == Some(pre)),
            "{dir}: no tokenizer.ggml.pre {pre}"
        );
        // The same keys as the converter's (tests/data/make.py, as llama.cpp's writes a
        // GPT-2 style BPE) of the same vocabulary.
        let theirs = GgufFile::open(data(&format!("{key}.gguf"))).unwrap();
        for k in [
            "tokenizer.ggml.tokens",
            "tokenizer.ggml.token_type",
            "tokenizer.ggml.merges",
            "tokenizer.ggml.pre",
        ] {
            let ours = meta.iter().find(|(n, _)| n == k).map(|(_, v)| v);
            assert_eq!(ours, theirs.get(k), "{dir}: {k}");
        }
        for (k, v) in meta {
            if k != "tokenizer.huggingface.json" {
                w.set(&k, v).unwrap();
            }
        }
        let mut bytes = Vec::new();
        w.write_to(&mut bytes).unwrap();
        let ggml = Tokenizer::from_gguf(&GgufFile::from_bytes("t.gguf", bytes).unwrap()).unwrap();
        check(&ggml, key, false);
        assert_eq!(ggml.vocab_size(), tok.vocab_size(), "{dir}");
        assert_eq!(ggml.eos_ids().first(), tok.eos_ids().first(), "{dir}");
    }
    let spm_json = Tokenizer::from_hf_dir(&data("hf_spm_json")).unwrap();
    let meta = spm_json.gguf_metadata().unwrap();
    assert!(
        meta.iter().all(|(k, _)| k != "tokenizer.ggml.model"),
        "a byte-fallback BPE written as llama.cpp's gpt2 model"
    );
}
