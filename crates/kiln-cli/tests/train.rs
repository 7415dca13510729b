//! `kiln train` as a user runs it, on a tiny model and the fixtures' text: the loss and
//! the held-out perplexity fall and the result runs; a paused and resumed run ends with
//! the same model, byte for byte, as one that ran through; a process killed in the
//! middle of a save leaves the last complete checkpoint, from which the run goes on; bad
//! flags and a NaN are one-line errors.

use kiln_core::DType;
use kiln_io::gguf::{GgufFile, Value};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn kiln(args: &[&str], env: &[(&str, &str)]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .envs(env.iter().copied())
        .current_dir(repo())
        .output()
        .unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A tiny llama on the fixtures' text, writing into `out`; `extra` flags are added, or
/// replace the defaults' values.
fn train(out: &Path, extra: &[&str], env: &[(&str, &str)]) -> Output {
    let out = out.to_str().unwrap();
    let defaults = [
        ("--data", "tests/fixtures/ppl.txt"),
        ("--out", out),
        ("--dim", "32"),
        ("--layers", "2"),
        ("--heads", "4"),
        ("--kv-heads", "2"),
        ("--ffn", "64"),
        ("--context", "64"),
        ("--seq-len", "32"),
        ("--batch", "2"),
        ("--grad-accum", "2"),
        ("--lr", "1e-2"),
        ("--warmup", "2"),
        ("--eval-windows", "8"),
        ("-t", "2"),
    ];
    let mut args = vec!["train"];
    for (flag, value) in defaults {
        if !extra.contains(&flag) {
            args.extend([flag, value]);
        }
    }
    args.extend_from_slice(extra);
    kiln(&args, env)
}

fn log(out: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(out.join("train.json")).unwrap()).unwrap()
}

fn checkpoint_step(path: &Path) -> u64 {
    let f = GgufFile::open(path).unwrap();
    match f.get("kiln.train.step") {
        Some(Value::U64(s)) => *s,
        other => panic!("kiln.train.step is {other:?}"),
    }
}

#[test]
fn loss_and_held_out_perplexity_fall_and_the_model_runs() {
    let dir = tempfile::tempdir().unwrap();
    let o = train(
        dir.path(),
        &[
            "--steps",
            "40",
            "--eval-every",
            "20",
            "--export-type",
            "q8_0",
        ],
        &[],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let log = log(dir.path());
    let losses: Vec<f64> = log["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["loss"].as_f64().unwrap())
        .collect();
    assert_eq!(losses.len(), 40);
    let (first, last) = (
        losses[..4].iter().sum::<f64>() / 4.0,
        losses[36..].iter().sum::<f64>() / 4.0,
    );
    assert!(last < first - 1.0, "training loss {first} -> {last}");
    let ppl: Vec<f64> = log["evals"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["perplexity"].as_f64().unwrap())
        .collect();
    assert_eq!(ppl.len(), 2);
    // From chance (1024 tokens) to far below it.
    assert!(
        ppl[1] < ppl[0] && ppl[1] < 400.0,
        "held-out perplexity {ppl:?}"
    );

    for model in [dir.path().join("model.gguf"), dir.path().join("hf")] {
        let m = model.to_str().unwrap();
        let o = kiln(
            &["run", "-m", m, "-p", "A kiln", "-n", "8", "--temp", "0"],
            &[],
        );
        assert!(o.status.success(), "{m}: {}", stderr(&o));
        let o = kiln(
            &[
                "perplexity",
                "-m",
                m,
                "-f",
                "tests/fixtures/ppl.txt",
                "-c",
                "32",
            ],
            &[],
        );
        assert!(o.status.success(), "{m}: {}", stderr(&o));
        assert!(String::from_utf8_lossy(&o.stdout).contains("PPL = "));
    }
}

#[test]
fn a_paused_and_resumed_run_ends_with_the_same_model() {
    let (whole, parts) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let o = train(whole.path(), &["--steps", "6", "--eval-every", "3"], &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = train(
        parts.path(),
        &["--steps", "6", "--eval-every", "3", "--pause-after", "4"],
        &[],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("--resume"), "{}", stderr(&o));
    assert!(!parts.path().join("model.gguf").exists());
    assert_eq!(checkpoint_step(&parts.path().join("checkpoint.gguf")), 4);
    let out = parts.path().to_str().unwrap();
    let o = kiln(
        &[
            "train",
            "--data",
            "tests/fixtures/ppl.txt",
            "--out",
            out,
            "--resume",
            "--eval-every",
            "3",
            // Not a run flag: the resumed steps run each layer again in their backward
            // passes, and are the same steps.
            "--checkpoint-activations",
        ],
        &[],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    for file in ["model.gguf", "checkpoint.gguf"] {
        let a = std::fs::read(whole.path().join(file)).unwrap();
        let b = std::fs::read(parts.path().join(file)).unwrap();
        assert!(
            a == b,
            "{file} differs between the whole and the resumed run"
        );
    }
    assert_eq!(step_records(whole.path()), step_records(parts.path()));
}

/// The log's steps without their timings (which differ between runs).
fn step_records(out: &Path) -> Vec<String> {
    log(out)["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| format!("{} {} {} {}", s["step"], s["loss"], s["lr"], s["grad_norm"]))
        .collect()
}

#[test]
fn a_kill_while_saving_leaves_the_last_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().to_str().unwrap();
    // Wider than the other tests' model, so that a save (weights and Adam's moments,
    // ~20 MB, then fsync) lasts long enough to be caught in the middle.
    let args = [
        "train",
        "--data",
        "tests/fixtures/ppl.txt",
        "--out",
        out,
        "--dim",
        "256",
        "--layers",
        "2",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--ffn",
        "512",
        "--context",
        "64",
        "--seq-len",
        "32",
        "--batch",
        "1",
        "--grad-accum",
        "1",
        "--lr",
        "1e-3",
        "--warmup",
        "0",
        "--steps",
        "400",
        "--save-every",
        "1",
        "--eval-windows",
        "2",
        "-t",
        "2",
    ];
    let partial = |dir: &Path| {
        std::fs::read_dir(dir)
            .unwrap()
            .filter_map(|e| e.ok())
            .any(|e| e.file_name().to_string_lossy().ends_with(".partial"))
    };
    let ckpt = dir.path().join("checkpoint.gguf");
    let mut caught = false;
    for _attempt in 0..20 {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kiln"))
            .args(args)
            .current_dir(repo())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        // Wait until a checkpoint exists and the next save has begun, then SIGKILL.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while !(ckpt.exists() && partial(dir.path())) {
            if std::time::Instant::now() > deadline || child.try_wait().unwrap().is_some() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
        child.kill().unwrap();
        child.wait().unwrap();
        // The kill may have landed after the rename: then no half-written file is left,
        // and the run is tried again.
        if ckpt.exists() && partial(dir.path()) {
            caught = true;
            break;
        }
    }
    assert!(caught, "no kill landed in the middle of a save in 20 tries");
    // The checkpoint is a whole one, and the run goes on from it.
    let step = checkpoint_step(&ckpt);
    assert!(step >= 1);
    let resume = [
        "train",
        "--data",
        "tests/fixtures/ppl.txt",
        "--out",
        out,
        "--resume",
        "--pause-after",
        "1",
    ];
    let o = kiln(&resume, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(checkpoint_step(&ckpt), step + 1);
}

#[test]
fn a_nan_loss_stops_naming_the_step_and_saves_nothing_of_it() {
    let dir = tempfile::tempdir().unwrap();
    let o = train(
        dir.path(),
        &[
            "--steps",
            "5",
            "--lr",
            "1e36",
            "--warmup",
            "0",
            "--clip",
            "0",
            "--save-every",
            "1",
        ],
        &[],
    );
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let err = stderr(&o);
    let line = err.lines().last().unwrap();
    assert!(line.starts_with("kiln: error: step "), "{err}");
    assert!(line.contains("NaN") || line.contains("inf"), "{err}");
    // The step named failed; the checkpoint is the step before, and finite.
    let failed: u64 = line["kiln: error: step ".len()..]
        .split(':')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let ckpt = dir.path().join("checkpoint.gguf");
    assert_eq!(checkpoint_step(&ckpt), failed - 1);
    let f = GgufFile::open(&ckpt).unwrap();
    // The weights (the optimizer's state is bytes, read back by the resume tests).
    for t in f
        .tensors
        .iter()
        .filter(|t| t.ggml_type.dtype() == Some(kiln_core::DType::F32))
    {
        let v = kiln_core::quant::dequantize_to_vec(
            kiln_core::DType::F32,
            f.tensor_data(t),
            t.numel() as usize,
        )
        .unwrap();
        assert!(v.iter().all(|x| x.is_finite()), "{} is not finite", t.name);
    }
}

#[test]
fn bad_flags_and_data_are_one_line_errors() {
    let dir = tempfile::tempdir().unwrap();
    for (extra, want) in [
        (&["--seq-len", "65"][..], "--seq-len 65"),
        (&["--schedule", "sawtooth"][..], "--schedule sawtooth"),
        (&["--batch", "0"][..], "--batch 0"),
        (&["--heads", "3"][..], "heads must divide dim"),
        (&["--kv-heads", "3"][..], "kv-heads must divide heads"),
        (&["--eps", "0"][..], "--eps 0"),
        (&["--resume"][..], "cannot be used with"),
        // Tokens past what a step can address: one line, no overflow panic.
        (
            &["--batch", "18446744073709551615"][..],
            "--batch 18446744073709551615",
        ),
        (&["--batch", "1000000000"][..], "give a smaller --batch"),
    ] {
        let o = train(dir.path(), &[&["--steps", "3"][..], extra].concat(), &[]);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{extra:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{extra:?}: {err}");
        assert!(err.contains(want), "{extra:?}: {err}");
    }
    let out = dir.path().to_str().unwrap();
    let missing = ["train", "--data", "/nonexistent/text", "--out", out];
    let o = kiln(&missing, &[]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("/nonexistent/text"), "{}", stderr(&o));
    let resume_nothing = [
        "train",
        "--data",
        "tests/fixtures/ppl.txt",
        "--out",
        out,
        "--resume",
    ];
    let o = kiln(&resume_nothing, &[]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    // --out naming a file, not a directory.
    let file_out = dir.path().join("model.gguf");
    std::fs::write(&file_out, b"x").unwrap();
    let o = train(&file_out, &["--steps", "3"], &[]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("a file; --out names the directory"), "{err}");
    // A binary among the text (a NUL byte): refused, naming the file.
    let data = dir.path().join("data");
    std::fs::create_dir(&data).unwrap();
    std::fs::copy(repo().join("tests/fixtures/ppl.txt"), data.join("a.txt")).unwrap();
    std::fs::write(data.join("b.bin"), b"\x7fELF\x02\x01\x01\x00\x00\x00").unwrap();
    let o = train(
        &dir.path().join("run"),
        &["--steps", "3", "--data", data.to_str().unwrap()],
        &[],
    );
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("b.bin") && err.contains("not text"), "{err}");
    // --out inside --data's directory: the run would read its own checkpoints as text.
    std::fs::remove_file(data.join("b.bin")).unwrap();
    let o = train(
        &data.join("run"),
        &["--steps", "3", "--data", data.to_str().unwrap()],
        &[],
    );
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("is inside --data"), "{err}");
}

/// An export type whose blocks do not divide the rows (q4_K's 256 at dim 32) writes those
/// matrices as F16 and says so; q8_0's 32 divides them and says nothing.
#[test]
fn an_export_type_the_rows_do_not_fit_is_a_warning() {
    let dir = tempfile::tempdir().unwrap();
    for (export, warned) in [("q4_K", true), ("q8_0", false)] {
        let out = dir.path().join(export);
        let o = train(&out, &["--steps", "3", "--export-type", export], &[]);
        let err = stderr(&o);
        assert!(o.status.success(), "{err}");
        assert_eq!(
            err.contains("not whole blocks of 256"),
            warned,
            "{export}: {err}"
        );
    }
}

/// Checkpoints are written by a thread beside the steps: a write that fails still ends the
/// run with an error naming the file, and nothing claims it was written.
#[test]
fn a_checkpoint_that_cannot_be_written_fails_the_run() {
    let dir = tempfile::tempdir().unwrap();
    // A directory with something in it where the checkpoint goes: no file can replace it.
    let blocked = dir.path().join("checkpoint.gguf");
    std::fs::create_dir(&blocked).unwrap();
    std::fs::write(blocked.join("keep"), b"x").unwrap();
    let o = train(dir.path(), &["--steps", "3", "--save-every", "1"], &[]);
    let err = stderr(&o);
    assert!(!o.status.success(), "{err}");
    assert!(err.contains("checkpoint.gguf"), "{err}");
    assert!(!err.contains("wrote "), "{err}");
    assert!(blocked.join("keep").exists());
}

#[test]
fn a_lora_fine_tune_exports_a_merged_model_that_runs() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().to_str().unwrap();
    let lora = |extra: &[&str]| {
        let mut args = vec![
            "train",
            "--from",
            "models/kiln-default.gguf",
            "--data",
            "tests/fixtures/ppl.txt",
            "--out",
            out,
            "--seq-len",
            "32",
            "--batch",
            "2",
            "--steps",
            "3",
            "--eval-windows",
            "2",
            "-t",
            "2",
        ];
        args.extend_from_slice(extra);
        kiln(&args, &[])
    };
    let o = lora(&["--lora-rank", "4", "--lora-targets", "q,v,down"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("LoRA of rank 4 merged in"),
        "{}",
        stderr(&o)
    );
    let ckpt = GgufFile::open(dir.path().join("checkpoint.gguf")).unwrap();
    assert!(ckpt.tensor("lora.blk.0.attn_v.weight.b").is_some());
    assert!(ckpt.tensor("lora.blk.0.attn_k.weight.b").is_none());
    // The model is the default's Q8_0, kept as it is (LoRA over quantized weights on the
    // CPU), not an F32 copy.
    let default = GgufFile::open(repo().join("models/kiln-default.gguf")).unwrap();
    for name in ["blk.0.attn_v.weight", "blk.1.ffn_down.weight"] {
        let (kept, given) = (ckpt.tensor(name).unwrap(), default.tensor(name).unwrap());
        assert_eq!(kept.ggml_type.dtype(), Some(DType::Q8_0), "{name}");
        assert!(
            ckpt.tensor_data(kept) == default.tensor_data(given),
            "{name} changed"
        );
    }
    // Two replicas on the CPU keep it as stored too.
    let o = lora(&["--lora-rank", "4", "--dp", "2", "--device", "cpu"]);
    assert!(o.status.success(), "--dp 2: {}", stderr(&o));
    let ckpt = GgufFile::open(dir.path().join("checkpoint.gguf")).unwrap();
    let kept = ckpt.tensor("blk.0.attn_q.weight").unwrap();
    assert_eq!(kept.ggml_type.dtype(), Some(DType::Q8_0), "--dp 2");
    let model = dir.path().join("model.gguf");
    let run = kiln(
        &[
            "run",
            "-m",
            model.to_str().unwrap(),
            "-p",
            "Permission is",
            "-n",
            "4",
            "-t",
            "2",
        ],
        &[],
    );
    assert!(run.status.success(), "{}", stderr(&run));
    // Settings a run cannot take: one line, exit 2, naming the flag.
    for (extra, want) in [
        (&["--lora-rank", "0"][..], "--lora-rank 0"),
        (
            &["--lora-rank", "4", "--lora-targets", "qkv"][..],
            "\"qkv\"",
        ),
        (&["--lora-alpha", "4"][..], "--lora-rank"),
    ] {
        let o = lora(extra);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{extra:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{extra:?}: {err}");
        assert!(err.contains(want), "{extra:?}: {err}");
    }
}

/// `--dp 2 --device cpu`: two replicas, each half of every step's sequences, take the
/// one-replica run's steps (losses equal up to the order of the sums), with the
/// optimizer sharded over them too (`--zero1`); a step's sequences that do not divide
/// among the replicas are a one-line error.
#[test]
fn data_parallel_replicas_train_as_one() {
    let losses = |extra: &[&str]| {
        let dir = tempfile::tempdir().unwrap();
        let mut args = vec!["--steps", "6", "--device", "cpu"];
        args.extend_from_slice(extra);
        let o = train(dir.path(), &args, &[]);
        assert!(o.status.success(), "{extra:?}: {}", stderr(&o));
        log(dir.path())["steps"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["loss"].as_f64().unwrap())
            .collect::<Vec<f64>>()
    };
    let one = losses(&[]);
    assert_eq!(one.len(), 6);
    // `--save-every 2`: a sharded run's workers take part in every save.
    for extra in [
        &["--dp", "2"][..],
        &["--dp", "2", "--zero1", "--save-every", "2"][..],
    ] {
        let two = losses(extra);
        assert_eq!(two.len(), 6, "{extra:?}");
        for (step, (a, b)) in one.iter().zip(&two).enumerate() {
            assert!(
                (a - b).abs() <= 1e-5 * a,
                "step {}: {a} alone, {b} with {extra:?}",
                step + 1
            );
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let o = train(
        dir.path(),
        &["--steps", "4", "--device", "cpu", "--dp", "3"],
        &[],
    );
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("do not divide among 3 ranks"), "{err}");
}

/// A Hugging Face model whose tokenizer is a tokenizer.json (Llama 3's byte-level BPE)
/// fine-tunes, and what it writes carries that tokenizer: the checkpoint and the exports
/// run and tokenize as the model does.
#[test]
fn a_fine_tune_of_a_model_with_a_tokenizer_json_writes_models_that_run() {
    // The llama3 fixture without its rope scaling, which kiln's Hugging Face export does
    // not write.
    let from = tempfile::tempdir().unwrap();
    let fixture = repo().join("tests/fixtures/llama3/hf");
    for e in std::fs::read_dir(&fixture).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, from.path().join(p.file_name().unwrap())).unwrap();
    }
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixture.join("config.json")).unwrap()).unwrap();
    config["rope_parameters"] = serde_json::json!({"rope_type": "default", "rope_theta": 500000.0});
    std::fs::write(from.path().join("config.json"), config.to_string()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().to_str().unwrap();
    let o = kiln(
        &[
            "train",
            "--from",
            from.path().to_str().unwrap(),
            "--data",
            "tests/fixtures/ppl.txt",
            "--out",
            out,
            "--seq-len",
            "32",
            "--batch",
            "2",
            "--steps",
            "2",
            "--eval-windows",
            "2",
            "-t",
            "2",
        ],
        &[],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let hf = dir.path().join("hf");
    assert!(hf.join("tokenizer.json").exists(), "{}", stderr(&o));
    let given =
        kiln_tokenizer::Tokenizer::from_hf_dir(&repo().join("tests/fixtures/llama3/hf")).unwrap();
    let text = "Hello, wörld! 12345 tokens\n\tand more";
    let want = given.encode(text, true).unwrap();
    for name in ["model.gguf", "checkpoint.gguf"] {
        let f = GgufFile::open(dir.path().join(name)).unwrap();
        let tok = kiln_tokenizer::Tokenizer::from_gguf(&f).unwrap();
        assert_eq!(tok.encode(text, true).unwrap(), want, "{name}");
        let path = dir.path().join(name);
        let o = kiln(
            &[
                "run",
                "-m",
                path.to_str().unwrap(),
                "-p",
                "Hi",
                "-n",
                "3",
                "-t",
                "2",
            ],
            &[],
        );
        assert!(o.status.success(), "{name}: {}", stderr(&o));
    }
    let back = kiln_tokenizer::Tokenizer::from_hf_dir(&hf).unwrap();
    assert_eq!(back.encode(text, true).unwrap(), want);
}
