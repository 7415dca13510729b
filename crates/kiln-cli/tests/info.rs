//! `kiln info` on real files and on the corpus of hostile ones.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Run `kiln info PATH` the way the hostile-file judge does: at most 1 GiB of address space.
fn kiln_info(path: &Path) -> (Output, Duration) {
    let start = Instant::now();
    let out = Command::new("sh")
        .arg("-c")
        .arg("ulimit -v 1048576 && exec \"$0\" info \"$1\"")
        .arg(env!("CARGO_BIN_EXE_kiln"))
        .arg(path)
        .output()
        .unwrap();
    (out, start.elapsed())
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
fn describes_a_gguf_written_by_gguf_py() {
    let (out, _) = kiln_info(&repo().join("tests/data/tiny-llama.gguf"));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = stdout(&out);
    assert!(text.contains("GGUF v3 (alignment 32"), "{text}");
    assert!(text.contains("architecture  llama"));
    assert!(text.contains("llama.block_count"));
    assert!(
        text.contains("... (300 string items)"),
        "long arrays are abbreviated: {text}"
    );
    for (name, shape, dtype) in [
        ("token_embd.weight", "[300, 256]", "q4_K"),
        ("blk.1.attn_v.weight", "[128, 256]", "q6_K"),
        ("blk.0.ffn_down.weight", "[256, 512]", "q6_K"),
        ("output_norm.weight", "[256]", "f32"),
    ] {
        let line = text
            .lines()
            .find(|l| l.trim_start().starts_with(name))
            .unwrap();
        assert!(line.contains(shape) && line.contains(dtype), "{line}");
    }
    assert!(text.contains("total         21 tensors"), "{text}");
}

#[test]
fn describes_hugging_face_directories() {
    for dir in ["tests/data/tiny-hf", "tests/data/tiny-hf-sharded"] {
        let (out, _) = kiln_info(&repo().join(dir));
        assert!(
            out.status.success(),
            "{dir}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = stdout(&out);
        assert!(text.contains("LlamaForCausalLM"), "{text}");
        for (name, dtype) in [
            ("model.embed_tokens.weight", "bf16"),
            ("model.norm.weight", "f32"),
            ("model.layers.0.mlp.down_proj.weight", "f16"),
        ] {
            let line = text
                .lines()
                .find(|l| l.trim_start().starts_with(name))
                .unwrap();
            assert!(line.contains(dtype), "{line}");
        }
        assert!(text.contains("total         4 tensors"), "{text}");
    }
    let (out, _) = kiln_info(&repo().join("tests/data/tiny-hf/model.safetensors"));
    assert!(out.status.success());
    assert!(stdout(&out).contains("format        safetensors"));
}

#[test]
fn every_hostile_file_gets_one_line_and_status_1() {
    let mut seen = 0;
    for sub in ["gguf", "safetensors"] {
        let dir = repo().join("tests/corpus").join(sub);
        let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        files.sort();
        for file in files {
            let (out, took) = kiln_info(&file);
            let err = String::from_utf8_lossy(&out.stderr);
            let name = file.file_name().unwrap().to_string_lossy();
            assert_eq!(
                out.status.code(),
                Some(1),
                "{name}: status {:?}, stderr {err}",
                out.status
            );
            assert_eq!(
                err.lines().count(),
                1,
                "{name}: stderr must be one line: {err}"
            );
            assert!(
                err.contains(&*name),
                "{name}: the message must name the file: {err}"
            );
            assert!(took < Duration::from_secs(5), "{name}: took {took:?}");
            seen += 1;
        }
    }
    assert!(seen >= 50, "corpus has only {seen} files");
}

#[test]
fn missing_files_and_unknown_formats_are_clear_errors() {
    let (out, _) = kiln_info(Path::new("/nonexistent/model.gguf"));
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/model.gguf"));
    let (out, _) = kiln_info(&repo().join("Cargo.toml"));
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown format"));
}
