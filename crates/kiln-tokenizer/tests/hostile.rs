//! Hostile tokenizer files: special files in a model directory, ids that would size
//! huge tables, and unigram pieces that would make encoding quadratic. Special files are
//! made here at run time, never committed.

use kiln_tokenizer::Tokenizer;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

fn data(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}

/// A model directory with the files of `tests/data/<from>`.
fn copy_of(from: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(data(from)).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.path().join(e.file_name())).unwrap();
    }
    dir
}

fn mkfifo(path: &Path) {
    let _ = std::fs::remove_file(path);
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo");
}

/// Loads `dir` on a thread: a reader blocked on a FIFO fails the test, not hangs it.
fn load_error(dir: &Path) -> String {
    let (tx, rx) = mpsc::channel();
    let dir = dir.to_path_buf();
    std::thread::spawn(move || {
        let _ = tx.send(Tokenizer::from_hf_dir(&dir).err().map(|e| e.to_string()));
    });
    rx.recv_timeout(Duration::from_secs(5))
        .expect("loading blocked")
        .expect("a special file was accepted")
}

#[test]
fn special_files_in_a_model_directory_are_refused() {
    let cases = [
        ("hf_bpe", "tokenizer.json"),
        ("hf_bpe", "tokenizer_config.json"),
        ("hf_bpe", "generation_config.json"),
        ("hf_bpe", "chat_template.jinja"),
        ("hf_uni", "tokenizer.model"),
    ];
    for (from, name) in cases {
        for what in ["a FIFO", "a character device"] {
            let dir = copy_of(from);
            let path = dir.path().join(name);
            if what == "a FIFO" {
                mkfifo(&path);
            } else {
                let _ = std::fs::remove_file(&path);
                std::os::unix::fs::symlink("/dev/zero", &path).unwrap();
            }
            let msg = load_error(dir.path());
            assert_eq!(
                msg,
                format!(
                    "{}: not a regular file ({what}); kiln reads only regular files",
                    path.display()
                )
            );
        }
    }
}

/// The process's peak resident memory, from /proc.
fn peak_rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
    line.split_whitespace()
        .nth(1)
        .unwrap()
        .parse::<u64>()
        .unwrap()
        * 1024
}

#[test]
fn huge_token_ids_cost_no_memory() {
    let text = std::fs::read_to_string(data("hf_bpe/tokenizer.json")).unwrap();
    for id in [60_000_000u64, 4_294_967_000] {
        let mut json: Value = serde_json::from_str(&text).unwrap();
        json["model"]["vocab"]["zzfar"] = id.into();
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("tokenizer.json"), json.to_string()).unwrap();
        let tok = Tokenizer::from_hf_dir(dir.path()).unwrap();
        // Ids need not be dense (transformers and llama.cpp's converter accept holes).
        assert_eq!(tok.token_text(id as u32), Some("zzfar"));
        assert_eq!(tok.token_id("zzfar"), Some(id as u32));
        assert_eq!(tok.token_text(1_000_000), None);
    }
    // A table indexed by id would have taken 1.4 GB for the first and 96 GB for the second.
    assert!(
        peak_rss_bytes() < 512 << 20,
        "peak {} bytes",
        peak_rss_bytes()
    );
}

fn varint(mut v: u64, out: &mut Vec<u8>) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// A serialized SentencePiece `ModelProto.pieces` entry: {1: text, 2: score}.
fn piece_field(text: &str, score: f32) -> Vec<u8> {
    let mut body = vec![0x0a];
    varint(text.len() as u64, &mut body);
    body.extend_from_slice(text.as_bytes());
    body.push(0x15);
    body.extend_from_slice(&score.to_le_bytes());
    let mut field = vec![0x0a];
    varint(body.len() as u64, &mut field);
    field.extend(body);
    field
}

/// The unigram test model with `pieces` appended (a repeated field may come anywhere).
fn unigram_with(pieces: &[String]) -> tempfile::TempDir {
    let dir = copy_of("hf_uni");
    let mut bytes = std::fs::read(data("hf_uni/tokenizer.model")).unwrap();
    for p in pieces {
        bytes.extend(piece_field(p, -1.0));
    }
    std::fs::write(dir.path().join("tokenizer.model"), bytes).unwrap();
    dir
}

#[test]
fn long_unigram_pieces_keep_encoding_linear() {
    let text = "a".repeat(20_000);
    let sets: [Vec<String>; 2] = [
        // The longest piece sentencepiece allows.
        vec!["a".repeat(512)],
        // Many long pieces sharing prefixes: each position has hundreds of candidates.
        (1..512).map(|k| "a".repeat(k) + "b").collect(),
    ];
    for pieces in sets {
        let tok = Tokenizer::from_hf_dir(unigram_with(&pieces).path()).unwrap();
        let start = Instant::now();
        let ids = tok.encode(&text, false).unwrap();
        let took = start.elapsed();
        assert_eq!(tok.decode(&ids).unwrap(), text);
        // Measured ~0.05 s; quadratic in the piece length, this took ~20 s.
        assert!(took < Duration::from_secs(2), "{took:?}");
    }
}

#[test]
fn unigram_pieces_longer_than_sentencepiece_allows_are_refused() {
    let dir = unigram_with(&["a".repeat(100_000)]);
    let msg = Tokenizer::from_hf_dir(dir.path())
        .err()
        .unwrap()
        .to_string();
    assert!(
        msg.starts_with(&dir.path().join("tokenizer.model").display().to_string())
            && msg.ends_with(
                "is 100000 characters long; unigram pieces may have at most 512 (sentencepiece's limit)"
            ),
        "{msg}"
    );
}

/// tokenizer.json parts that the `tokenizers` crate runs without a bound or panics on are
/// refused at load, naming the file: a normalizer or decoder whose replacements multiply
/// a text (eight stages of 'a' → ten 'a's took 18 GB on a 3-byte probe), and a
/// post-processor template naming a special token it does not define (a panic inside
/// `tokenizers` on the first encode). A growth within the bound still loads.
#[test]
fn runaway_normalizers_and_undefined_template_tokens_are_refused() {
    let text = std::fs::read_to_string(data("hf_bpe/tokenizer.json")).unwrap();
    let grow = |n: usize| {
        serde_json::json!({"type": "Sequence", "normalizers": vec![
            serde_json::json!({"type": "Replace", "pattern": {"String": "a"}, "content": "aaaaaaaaaa"}); n]})
    };
    let load = |edit: &dyn Fn(&mut Value)| {
        let mut json: Value = serde_json::from_str(&text).unwrap();
        edit(&mut json);
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("tokenizer.json"), json.to_string()).unwrap();
        let path = dir.path().join("tokenizer.json").display().to_string();
        (
            Tokenizer::from_hf_dir(dir.path())
                .err()
                .map(|e| e.to_string()),
            path,
        )
    };
    let (err, path) = load(&|j| j["normalizer"] = grow(8));
    let msg = err.expect("refused");
    assert!(
        msg.starts_with(&path) && msg.contains("normalizer can make a text 100000000 times longer"),
        "{msg}"
    );
    let (err, _) = load(&|j| {
        j["decoder"] = serde_json::json!({"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"Regex": "."}, "content": "x".repeat(40)},
            {"type": "Replace", "pattern": {"Regex": "."}, "content": "x".repeat(40)}]})
    });
    assert!(err
        .expect("refused")
        .contains("decoder can make a text 1681 times longer"));
    let (err, _) = load(&|j| j["normalizer"] = grow(3));
    assert_eq!(err, None, "a growth of 1000 loads");
    let (err, path) = load(&|j| {
        j["post_processor"] = serde_json::json!({"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<nope>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [], "special_tokens": {}})
    });
    let msg = err.expect("refused");
    assert!(
        msg.starts_with(&path) && msg.ends_with("does not define in its special_tokens: <nope>"),
        "{msg}"
    );
}

/// A tokenizer.json whose added token has an id near 2^32 still goes into GGUF (whole),
/// without llama.cpp's keys, which would need a table of 4 billion tokens: nothing that
/// size is allocated.
#[test]
fn a_far_token_id_gets_no_llama_cpp_table() {
    let dir = tempfile::tempdir().unwrap();
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/hf_bpe");
    let mut json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(src.join("tokenizer.json")).unwrap()).unwrap();
    json["added_tokens"]
        .as_array_mut()
        .unwrap()
        .push(serde_json::json!({
            "id": 4_000_000_000u64, "content": "<far>", "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true
        }));
    std::fs::write(dir.path().join("tokenizer.json"), json.to_string()).unwrap();
    std::fs::copy(
        src.join("tokenizer_config.json"),
        dir.path().join("tokenizer_config.json"),
    )
    .unwrap();
    let tok = match Tokenizer::from_hf_dir(dir.path()) {
        Ok(t) => t,
        // Refused at load is as good: nothing was allocated for it.
        Err(e) => return eprintln!("refused at load: {e}"),
    };
    let meta = tok.gguf_metadata().unwrap();
    assert!(meta.iter().any(|(k, _)| k == "tokenizer.huggingface.json"));
    assert!(meta.iter().all(|(k, _)| k != "tokenizer.ggml.tokens"));
}
