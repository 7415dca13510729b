//! Bad vocabularies and model files give errors that name the problem, never panics.

use kiln_io::gguf::{Array, GgufFile, GgufWriter, Value};
use kiln_tokenizer::Tokenizer;
use std::path::PathBuf;

fn data(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}

fn strings(v: &[&str]) -> Value {
    Value::Array(Array::String(v.iter().map(|s| s.to_string()).collect()))
}

/// A GGUF holding only the given metadata.
fn gguf(keys: Vec<(&str, Value)>) -> GgufFile {
    let mut w = GgufWriter::new();
    for (k, v) in keys {
        w.set(k, v).unwrap();
    }
    let mut bytes = Vec::new();
    w.write_to(&mut bytes).unwrap();
    GgufFile::from_bytes("test.gguf", bytes).unwrap()
}

/// The error, which must name the file first.
fn gguf_err(keys: Vec<(&str, Value)>) -> String {
    match Tokenizer::from_gguf(&gguf(keys)) {
        Ok(_) => panic!("expected an error"),
        Err(e) => {
            let msg = e.to_string();
            let msg = msg.strip_prefix("unsupported: ").unwrap_or(&msg);
            assert!(msg.starts_with("test.gguf: "), "{msg}");
            msg.to_string()
        }
    }
}

fn llama(extra: Vec<(&'static str, Value)>) -> Vec<(&'static str, Value)> {
    let mut keys = vec![
        ("tokenizer.ggml.model", Value::String("llama".into())),
        (
            "tokenizer.ggml.tokens",
            strings(&["<unk>", "<s>", "</s>", "▁a"]),
        ),
    ];
    for (k, v) in extra {
        keys.retain(|(key, _)| *key != k);
        keys.push((k, v));
    }
    keys
}

fn gpt2(merges: &[&str]) -> Vec<(&'static str, Value)> {
    vec![
        ("tokenizer.ggml.model", Value::String("gpt2".into())),
        ("tokenizer.ggml.tokens", strings(&["a", "b", "ab"])),
        ("tokenizer.ggml.merges", strings(merges)),
    ]
}

#[test]
fn minimal_vocabularies_load() {
    assert!(Tokenizer::from_gguf(&gguf(llama(vec![]))).is_ok());
    let tok = Tokenizer::from_gguf(&gguf(gpt2(&["a b"]))).unwrap();
    assert_eq!(tok.encode("ab", true).unwrap(), vec![2]);
}

#[test]
fn unsupported_model_is_named() {
    let e = gguf_err(vec![("tokenizer.ggml.model", Value::String("rwkv".into()))]);
    assert!(
        e.contains("tokenizer.ggml.model 'rwkv' is not supported"),
        "{e}"
    );
    let e = gguf_err(vec![]);
    assert!(e.contains("tokenizer.ggml.model is missing"), "{e}");
}

#[test]
fn missing_tokens() {
    let e = gguf_err(vec![(
        "tokenizer.ggml.model",
        Value::String("llama".into()),
    )]);
    assert!(e.contains("tokenizer.ggml.tokens is missing"), "{e}");
    let e = gguf_err(llama(vec![("tokenizer.ggml.tokens", Value::U32(3))]));
    assert!(e.contains("tokenizer.ggml.tokens is a u32"), "{e}");
    let e = gguf_err(llama(vec![("tokenizer.ggml.tokens", strings(&[]))]));
    assert!(e.contains("empty"), "{e}");
}

#[test]
fn scores_length_mismatch() {
    let e = gguf_err(llama(vec![(
        "tokenizer.ggml.scores",
        Value::Array(Array::F32(vec![0.0; 3])),
    )]));
    assert!(
        e.contains("tokenizer.ggml.scores has 3 entries for 4 tokens"),
        "{e}"
    );
    let e = gguf_err(llama(vec![(
        "tokenizer.ggml.token_type",
        Value::Array(Array::I32(vec![1; 5])),
    )]));
    assert!(
        e.contains("tokenizer.ggml.token_type has 5 entries for 4 tokens"),
        "{e}"
    );
    let e = gguf_err(llama(vec![(
        "tokenizer.ggml.token_type",
        Value::Array(Array::I32(vec![1, 1, 9, 1])),
    )]));
    assert!(e.contains("entry 2 is 9"), "{e}");
}

#[test]
fn special_ids_out_of_range() {
    let e = gguf_err(llama(vec![("tokenizer.ggml.bos_token_id", Value::U32(99))]));
    assert!(
        e.contains("tokenizer.ggml.bos_token_id 99 is out of range"),
        "{e}"
    );
}

#[test]
fn bad_merges() {
    let e = gguf_err(gpt2(&["a c"]));
    assert!(e.contains("\"c\", which is not in the vocabulary"), "{e}");
    let e = gguf_err(gpt2(&["ab"]));
    assert!(e.contains("not two tokens"), "{e}");
    let e = gguf_err(gpt2(&["b a"]));
    assert!(e.contains("\"ba\", which is not in the vocabulary"), "{e}");
    let mut keys = gpt2(&[]);
    keys.retain(|(k, _)| *k != "tokenizer.ggml.merges");
    let e = gguf_err(keys);
    assert!(e.contains("tokenizer.ggml.merges is missing"), "{e}");
    let mut keys = gpt2(&["a b"]);
    keys.push(("tokenizer.ggml.pre", Value::String("martian".into())));
    let e = gguf_err(keys);
    assert!(
        e.contains("tokenizer.ggml.pre 'martian' is not supported"),
        "{e}"
    );
}

#[test]
fn text_outside_a_tiny_vocabulary_does_not_panic() {
    // No byte tokens: a run of unknown characters becomes one <unk>, as in sentencepiece.
    let tok = Tokenizer::from_gguf(&gguf(llama(vec![]))).unwrap();
    assert_eq!(tok.encode("a é", true).unwrap(), vec![1, 3, 0]);
    assert_eq!(tok.encode("a é a", true).unwrap(), vec![1, 3, 0, 3]);
    // GPT-2 vocabulary without the byte alphabet: unknown bytes are dropped.
    let tok = Tokenizer::from_gguf(&gguf(gpt2(&["a b"]))).unwrap();
    assert_eq!(tok.encode("xab🙂", false).unwrap(), vec![2]);
}

fn model_dir(bytes: &[u8]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("tokenizer.model"), bytes).unwrap();
    dir
}

#[test]
fn truncated_or_garbage_tokenizer_model() {
    let good = std::fs::read(data("hf_spm/tokenizer.model")).unwrap();
    let e = Tokenizer::from_hf_dir(model_dir(&good[..good.len() / 2]).path())
        .err()
        .expect("a truncated model must not load");
    assert!(
        e.to_string()
            .contains("tokenizer.model: SentencePiece model: protobuf"),
        "{e}"
    );

    let e = Tokenizer::from_hf_dir(model_dir(b"").path()).err().unwrap();
    assert!(e.to_string().contains("no pieces"), "{e}");

    let e = Tokenizer::from_hf_dir(model_dir(b"\xff\xff\xff\xff not a model").path())
        .err()
        .unwrap();
    assert!(e.to_string().contains("SentencePiece model"), "{e}");

    // Every truncation and a sweep of corrupted bytes: errors or a usable tokenizer.
    let mut state = 0x2545F4914F6CDD1Du64;
    for cut in (0..good.len()).step_by(97) {
        let mut bytes = good[..cut].to_vec();
        if !bytes.is_empty() {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let i = (state as usize) % bytes.len();
            bytes[i] = (state >> 32) as u8;
        }
        if let Ok(tok) = Tokenizer::from_hf_dir(model_dir(&bytes).path()) {
            let ids = tok.encode("Hello wörld 🙂", true).unwrap_or_default();
            let _ = tok.decode(&ids);
        }
    }
}

#[test]
fn missing_or_bad_hf_files() {
    let dir = tempfile::tempdir().unwrap();
    let e = Tokenizer::from_hf_dir(dir.path()).err().unwrap();
    assert!(
        e.to_string()
            .contains("neither tokenizer.json nor tokenizer.model"),
        "{e}"
    );

    std::fs::write(dir.path().join("tokenizer.json"), "{ nope").unwrap();
    let e = Tokenizer::from_hf_dir(dir.path()).err().unwrap();
    assert!(e.to_string().contains("tokenizer.json"), "{e}");

    std::fs::copy(
        data("hf_bpe/tokenizer.json"),
        dir.path().join("tokenizer.json"),
    )
    .unwrap();
    std::fs::write(dir.path().join("tokenizer_config.json"), "[1,").unwrap();
    let e = Tokenizer::from_hf_dir(dir.path()).err().unwrap();
    assert!(e.to_string().contains("tokenizer_config.json"), "{e}");
}

#[test]
fn a_bad_tokenizer_json_in_gguf_is_named() {
    let e = gguf_err(vec![(
        "tokenizer.huggingface.json",
        Value::String("{\"model\": 3".into()),
    )]);
    assert!(e.contains("tokenizer.huggingface.json"), "{e}");
    let json = std::fs::read_to_string(data("hf_bpe/tokenizer.json")).unwrap();
    let e = gguf_err(vec![
        ("tokenizer.huggingface.json", Value::String(json.clone())),
        ("tokenizer.ggml.bos_token_id", Value::U32(1 << 30)),
    ]);
    assert!(
        e.contains("tokenizer.ggml.bos_token_id 1073741824 is not a token"),
        "{e}"
    );
    let e = gguf_err(vec![
        ("tokenizer.huggingface.json", Value::String(json)),
        ("tokenizer.ggml.eos_token_id", Value::String("x".into())),
    ]);
    assert!(e.contains("tokenizer.ggml.eos_token_id is a string"), "{e}");
}
