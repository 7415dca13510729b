//! `kiln run`, `kiln perplexity` and `kiln bench` as a user runs them.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn kiln(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .current_dir(repo())
        .output()
        .unwrap()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn the_default_model_runs_and_json_output_is_complete() {
    let o = kiln(&[
        "run",
        "-p",
        "Permission is hereby granted",
        "-n",
        "12",
        "--temp",
        "0",
        "-o",
        "json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let line = stdout(&o).lines().last().unwrap().to_string();
    let v: serde_json::Value = serde_json::from_str(&line).unwrap();
    assert_eq!(v["tokens"].as_array().unwrap().len(), 12);
    assert_eq!(
        v["prompt_tokens"][0], 1,
        "SentencePiece prompts start with BOS"
    );
    assert!(v["timings"]["generation_tokens_per_s"].as_f64().unwrap() > 0.0);
    // The model learned license texts; greedy text from this prompt reads like one
    // (" by You to the extent of the", from the model of 2026-11-25).
    assert!(
        v["text"].as_str().unwrap().contains("to the extent"),
        "{line}"
    );
    // Greedy is deterministic; a seed makes sampling reproducible.
    let again = kiln(&[
        "run",
        "-p",
        "Permission is hereby granted",
        "-n",
        "12",
        "--temp",
        "0",
        "-o",
        "json",
    ]);
    let again: serde_json::Value =
        serde_json::from_str(stdout(&again).lines().last().unwrap()).unwrap();
    assert_eq!(again["tokens"], v["tokens"]);
    let sample = |seed: &str| {
        let o = kiln(&[
            "run", "-p", "You may", "-n", "16", "--temp", "1.2", "--seed", seed, "-o", "json",
        ]);
        stdout(&o).lines().last().unwrap().to_string()
    };
    let a = serde_json::from_str::<serde_json::Value>(&sample("7")).unwrap()["tokens"].clone();
    let b = serde_json::from_str::<serde_json::Value>(&sample("7")).unwrap()["tokens"].clone();
    assert_eq!(a, b);
}

#[test]
fn stop_strings_end_generation() {
    let o = kiln(&[
        "run",
        "-p",
        "Permission is hereby granted",
        "-n",
        "60",
        "--temp",
        "0",
        "--stop",
        "extent",
        "-o",
        "json",
    ]);
    let v: serde_json::Value = serde_json::from_str(stdout(&o).lines().last().unwrap()).unwrap();
    assert_eq!(v["stop"], "stopstring");
    assert_eq!(v["text"], " by You to the ");
}

#[test]
fn a_prompt_longer_than_the_context_is_a_clear_error_before_any_output() {
    let long = "word ".repeat(400);
    let o = kiln(&["run", "-p", &long, "-c", "64", "-n", "4"]);
    assert_eq!(o.status.code(), Some(2));
    let err = stderr(&o);
    assert!(err.contains("--ctx-size 64"), "{err}");
    assert!(!err.contains("shape mismatch"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert_eq!(stdout(&o), "", "the prompt was echoed before the error");
}

#[test]
fn perplexity_matches_the_transformers_reference() {
    let o = kiln(&[
        "perplexity",
        "-m",
        "tests/fixtures/llama/llama-f32.gguf",
        "-f",
        "scripts/fixtures/ppl.txt",
        "-c",
        "128",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let line = stdout(&o);
    let ppl: f64 = line
        .trim()
        .strip_prefix("PPL = ")
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let reference: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(repo().join("tests/fixtures/llama/reference.json")).unwrap(),
    )
    .unwrap();
    let want = reference["ppl"].as_f64().unwrap();
    assert!(
        (ppl - want).abs() / want < 1e-5,
        "kiln {ppl}, transformers {want}"
    );
}

#[test]
fn bench_prints_llama_bench_rows() {
    let o = kiln(&[
        "bench",
        "-m",
        "tests/data/tiny-llama.gguf",
        "-p",
        "16",
        "-n",
        "4",
        "-r",
        "2",
        "-o",
        "json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let rows: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    let tests: Vec<&str> = rows
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["test"].as_str().unwrap())
        .collect();
    assert_eq!(tests, ["pp16", "tg4"]);
    for r in rows.as_array().unwrap() {
        assert!(r["tokens_per_s"].as_f64().unwrap() > 0.0);
        assert!(r["stddev"].as_f64().is_some() && r["device"].as_str().unwrap().starts_with("cpu"));
    }
}

/// `-d` starts the tg tests that many positions in (llama-bench's depth), single and
/// batched; a depth past what kiln addresses or what memory holds is refused in one line.
#[test]
fn bench_decodes_at_a_depth() {
    let o = kiln(&[
        "bench",
        "-m",
        "tests/data/tiny-llama.gguf",
        "-p",
        "0",
        "-n",
        "3",
        "-d",
        "40",
        "-r",
        "1",
        "-o",
        "json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let rows: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(rows[0]["test"].as_str(), Some("tg3 @ d40"), "{rows}");
    let o = kiln(&[
        "bench",
        "-m",
        "tests/data/tiny-llama.gguf",
        "-p",
        "0",
        "-n",
        "3",
        "-d",
        "40",
        "-b",
        "3",
        "-r",
        "1",
        "-o",
        "json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let rows: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(rows[0]["test"].as_str(), Some("tg3 x3 @ d40"), "{rows}");
    // Past the positions kiln addresses, or past memory: one line, before anything runs.
    let model = "tests/data/tiny-llama.gguf";
    let o = kiln(&["bench", "-m", model, "-d", "3000000000"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("-d 3000000000"), "{}", stderr(&o));
    let o = kiln(&["bench", "-m", model, "-d", "100000000"]);
    assert!(!o.status.success());
    let err = stderr(&o);
    assert!(err.contains("does not fit"), "{err}");
    // bench has no --ctx-size: the message names what sets its context.
    assert!(err.contains("(-p, or -d with -n, sets it)"), "{err}");
    assert!(!err.contains("--ctx-size"), "{err}");
    // A synthetic model larger than the host (263 GiB: larger than any machine this
    // runs on): refused before its weights are made (the F16 one was killed for memory
    // at 24 GB).
    let o = kiln(&[
        "bench",
        "--synthetic",
        "llama3-70b",
        "--type",
        "f32",
        "-p",
        "1",
        "-n",
        "0",
    ]);
    assert!(!o.status.success());
    let err = stderr(&o);
    assert!(
        err.contains("its weights take 262.83 GiB") && err.contains("free: pick a smaller shape"),
        "{err}"
    );
}

#[test]
fn bench_times_training_steps() {
    let o = kiln(&[
        "bench",
        "--train",
        "kiln-default",
        "-b",
        "2",
        "--seq-len",
        "16",
        "-r",
        "2",
        "--device",
        "cpu",
        "-o",
        "json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let row: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(row["params"].as_u64(), Some(3_475_712), "{row}");
    assert!(row["tokens_per_s"].as_f64().unwrap() > 0.0, "{row}");
    let o = kiln(&["bench", "--train", "gpt-9", "--device", "cpu"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("--train gpt-9"), "{}", stderr(&o));
}

#[test]
fn a_context_the_machine_cannot_hold_is_refused_with_what_fits() {
    let o = kiln(&["run", "-p", "hi", "-c", "2000000000", "-n", "2"]);
    assert_eq!(o.status.code(), Some(2));
    let err = stderr(&o);
    assert_eq!(err.lines().count(), 1, "{err}");
    for says in [
        "a context of 2000000000 tokens",
        "KV cache needs",
        "free after the weights",
    ] {
        assert!(err.contains(says), "{says}: {err}");
    }
    let largest: usize = err
        .split("the largest context that fits is ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no largest context in {err}"));
    assert!(largest > 512 && largest < 2_000_000_000, "{largest}");
    assert!(err.contains("(--ctx-size)"), "names the setting: {err}");
    assert!(err.contains("as f32"), "the CPU's default KV type: {err}");
    assert_eq!(stdout(&o), "");

    // Keys and values as q8_0 take 34 bytes per 32 values instead of 128: about 3.8 times
    // the context fits.
    let o = kiln(&[
        "run",
        "-p",
        "hi",
        "-c",
        "2000000000",
        "-n",
        "2",
        "--kv-type",
        "q8_0",
    ]);
    assert_eq!(o.status.code(), Some(2));
    let err = stderr(&o);
    assert!(err.contains("as q8_0"), "{err}");
    let q8_largest: usize = err
        .split("the largest context that fits is ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no largest context in {err}"));
    let ratio = q8_largest as f64 / largest as f64;
    assert!(ratio > 3.5 && ratio < 3.9, "{q8_largest} vs {largest}");
}

#[test]
fn kv_types_are_chosen_and_checked() {
    let run = |extra: &[&str]| {
        kiln(
            &[
                &["run", "-p", "Permission", "-n", "4", "--temp", "0"][..],
                extra,
            ]
            .concat(),
        )
    };
    for kv in ["f16", "bf16", "q8_0", "F32"] {
        let o = run(&["--kv-type", kv]);
        assert!(o.status.success(), "--kv-type {kv}: {}", stderr(&o));
    }
    let o = run(&["--kv-type", "q4_0"]);
    assert_eq!(o.status.code(), Some(2));
    let err = stderr(&o);
    assert!(
        err.contains("f16, bf16, f32 and q8_0") && err.lines().count() == 1,
        "{err}"
    );
    // The fixture's heads have 16 dimensions: not whole q8_0 blocks.
    let o = run(&[
        "-m",
        "tests/fixtures/llama/llama-f32.gguf",
        "--kv-type",
        "q8_0",
    ]);
    assert_eq!(o.status.code(), Some(2));
    let err = stderr(&o);
    assert!(
        err.contains("16 dimensions") && err.lines().count() == 1,
        "{err}"
    );
}

#[test]
fn contexts_that_wrap_or_are_zero_are_handled() {
    let o = kiln(&["run", "-p", "hi", "-n", "1", "-c", "18446744073709551615"]);
    assert_eq!(o.status.code(), Some(2));
    let err = stderr(&o);
    assert!(
        err.starts_with("kiln: error: ")
            && err.contains("18446744073709551615")
            && err.contains("2147483647"),
        "{err}"
    );
    assert_eq!(err.lines().count(), 1, "{err}");
    // 0: the model's own context.
    let o = kiln(&[
        "run",
        "-p",
        "Permission",
        "-n",
        "2",
        "--temp",
        "0",
        "-c",
        "0",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
}

/// Above the trained context is allowed, with a warning on stderr (llama.cpp's
/// behaviour); `-q` and `RUST_LOG=off` silence it.
#[test]
fn a_context_above_the_trained_one_warns_and_runs() {
    let args = [
        "run",
        "-m",
        "tests/data/tiny-llama.gguf",
        "-p",
        "hi",
        "-n",
        "2",
        "--temp",
        "0",
        "-c",
        "200",
    ];
    let o = kiln(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("WARN") && stderr(&o).contains("above the 128 positions"),
        "{}",
        stderr(&o)
    );
    let quiet = kiln(&[&args[..], &["-q"]].concat());
    assert!(quiet.status.success());
    assert!(!stderr(&quiet).contains("WARN"), "{}", stderr(&quiet));
    let off = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .current_dir(repo())
        .env("RUST_LOG", "off")
        .output()
        .unwrap();
    assert!(off.status.success());
    assert!(!stderr(&off).contains("WARN"), "{}", stderr(&off));
}

/// When generation fails after the prompt was echoed, the error still starts a line of
/// its own on a terminal that shows stdout and stderr together.
#[test]
fn an_error_after_streamed_text_starts_its_own_line() {
    let model = repo().join("tests/corpus/hostile/vocab_above_embedding/model.gguf");
    let dir = tempfile::tempdir().unwrap();
    let both = dir.path().join("both");
    let file = std::fs::File::create(&both).unwrap();
    let status = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args([
            "run",
            "--device",
            "cpu",
            "-m",
            model.to_str().unwrap(),
            "-p",
            "the the the",
            "-n",
            "2",
        ])
        .stdout(file.try_clone().unwrap())
        .stderr(file)
        .status()
        .unwrap();
    let text = std::fs::read_to_string(&both).unwrap();
    assert!(matches!(status.code(), Some(1 | 2)), "{text}");
    let error = text
        .lines()
        .find(|l| l.contains("kiln: error:"))
        .unwrap_or_else(|| panic!("{text}"));
    assert!(error.starts_with("kiln: error:"), "{text:?}");
}

#[test]
fn bench_kernel_sizes_are_checked_before_allocating() {
    for (args, says) in [
        (&["--rows", "0"][..], "--rows 0"),
        (&["--rows", "1000000", "--cols", "1000000"][..], "needs"),
        (&["--rows", "8", "--cols", "100"][..], "--cols 100"),
        (&["-t", "0"][..], "-t 0"),
    ] {
        let o = kiln(&[&["bench", "--kernels"][..], args].concat());
        assert_eq!(o.status.code(), Some(2), "{args:?}");
        let err = stderr(&o);
        assert!(
            err.starts_with("kiln: error: ") && err.contains(says),
            "{args:?}: {err}"
        );
        assert_eq!(err.lines().count(), 1, "{err}");
    }
}

#[test]
fn perplexity_errors_have_one_prefix_and_progress_stays_short() {
    let o = kiln(&[
        "perplexity",
        "-m",
        "tests/data/tiny-llama.gguf",
        "-f",
        "README.md",
        "-c",
        "100000",
    ]);
    assert_eq!(o.status.code(), Some(2));
    let err = stderr(&o);
    assert_eq!(err.matches("kiln: error:").count(), 1, "{err}");
    assert!(
        !err.contains("shape mismatch") && err.contains("needs at least 200000"),
        "{err}"
    );
    // Hundreds of chunks; the log has a dozen lines, not a line's worth per chunk.
    let o = kiln(&[
        "perplexity",
        "-m",
        "tests/data/tiny-llama.gguf",
        "-f",
        "scripts/fixtures/ppl.txt",
        "-c",
        "4",
        "--chunks",
        "300",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.lines().count() <= 12 && err.len() < 1024, "{err}");
    assert!(err.contains("300 chunks of 4 tokens"), "{err}");
}

/// Without a GPU, `--device cuda` is one clear line and status 1, and `--device auto`
/// (the default) runs on the CPU. On a GPU machine both must simply run.
#[test]
fn cuda_without_a_gpu_is_a_clear_error_and_auto_falls_back() {
    let args = ["run", "-p", "Permission", "-n", "2", "--temp", "0"];
    let gpu = kiln_cuda::is_available();
    let cuda = kiln(&[&args[..], &["--device", "cuda"]].concat());
    let auto = kiln(&[&args[..], &["--device", "auto"]].concat());
    assert!(auto.status.success(), "{}", stderr(&auto));
    if gpu {
        eprintln!("a GPU is present: the no-GPU error path is not exercised here");
        assert!(cuda.status.success(), "{}", stderr(&cuda));
        return;
    }
    assert_eq!(cuda.status.code(), Some(1));
    let err = stderr(&cuda);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(
        err.contains("no NVIDIA driver") || err.contains("sees no GPU"),
        "{err}"
    );
}

#[test]
fn sampling_settings_out_of_range_are_clear_errors() {
    for (flag, value, says) in [
        ("--top-p", "1.5", "not between 0 and 1"),
        ("--min-p", "-0.1", "not between 0 and 1"),
        ("--temp", "nan", "not a finite number"),
        ("--temp", "-1", "below 0"),
        ("--repeat-penalty", "0", "not above 0"),
    ] {
        let o = kiln(&["run", "-p", "x", "-n", "1", &format!("{flag}={value}")]);
        assert_eq!(o.status.code(), Some(2), "{flag} {value}");
        let err = stderr(&o);
        assert!(
            err.contains(flag) && err.contains(says),
            "{flag} {value}: {err}"
        );
    }
}

/// Where no desktop session runs (no XDG_RUNTIME_DIR: a server, ssh, a container), the
/// probe of GPUs for `--device auto` prints nothing of Mesa's Vulkan layers, and a reader
/// that closes stdout early (`| head`) ends no command with a panic.
#[test]
fn no_desktop_session_and_a_closed_stdout_leave_stderr_clean() {
    let run = |args: &[&str], close_stdout: bool| {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kiln"))
            .args(args)
            .current_dir(repo())
            .env_remove("XDG_RUNTIME_DIR")
            .env_remove("NODEVICE_SELECT")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        if close_stdout {
            drop(child.stdout.take());
        }
        child.wait_with_output().unwrap()
    };
    for (args, close) in [
        (&["run", "-p", "Permission is", "-n", "4"][..], false),
        (&["devices"][..], false),
        (
            &[
                "bench",
                "-m",
                "models/kiln-default.gguf",
                "-p",
                "8",
                "-n",
                "4",
                "-r",
                "1",
            ][..],
            true,
        ),
        (&["devices"][..], true),
    ] {
        let o = run(args, close);
        let err = stderr(&o);
        assert!(o.status.success(), "{args:?}: {err}");
        assert!(!err.contains("XDG_RUNTIME_DIR"), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

/// The default model split over two ranks on the CPU (`--tp 2 --device cpu`: shares of
/// the CPU's threads summing through host memory) generates what the whole model does;
/// a split the model cannot take is one line, before anything runs.
#[test]
fn a_model_split_over_two_ranks_generates_the_same_text() {
    let json = |extra: &[&str]| {
        let mut args = vec![
            "run",
            "-p",
            "Permission is hereby granted",
            "-n",
            "24",
            "--temp",
            "0",
            "-o",
            "json",
            "--device",
            "cpu",
            "-t",
            "2",
        ];
        args.extend_from_slice(extra);
        let o = kiln(&args);
        assert!(o.status.success(), "{extra:?}: {}", stderr(&o));
        let line = stdout(&o).lines().last().unwrap().to_string();
        serde_json::from_str::<serde_json::Value>(&line).unwrap()
    };
    let whole = json(&[]);
    let split = json(&["--tp", "2"]);
    assert_eq!(split["tokens"], whole["tokens"]);
    assert_eq!(split["text"], whole["text"]);
    // The bench runs the split too: a pp and a tg row, named after the ranks' device.
    let o = kiln(&[
        "bench",
        "-m",
        "models/kiln-default.gguf",
        "--tp",
        "2",
        "--device",
        "cpu",
        "-p",
        "8",
        "-n",
        "8",
        "-r",
        "1",
        "-t",
        "2",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let table = stdout(&o);
    assert!(
        table.contains("× 2 | pp8 |") && table.contains("× 2 | tg8 |"),
        "{table}"
    );
    for (tp, want) in [
        ("3", "4 attention heads do not divide among 3 ranks"),
        ("4", "cut its q8_0 blocks"),
    ] {
        let o = kiln(&["run", "-p", "x", "-n", "2", "--device", "cpu", "--tp", tp]);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "--tp {tp}: {err}");
        assert_eq!(err.lines().count(), 1, "--tp {tp}: {err}");
        assert!(err.contains(want), "--tp {tp}: {err}");
    }
}

/// Spreading ranks over hosts that cannot be: one line each, before anything loads.
#[test]
fn impossible_host_settings_are_refused_naming_the_flag() {
    for (args, want) in [
        (
            &["--tp", "2", "--nnodes", "2", "--node-rank", "2"][..],
            "--node-rank 2: the hosts are 0..2",
        ),
        (
            &["--tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1:9"][..],
            "--nnodes with --device cpu",
        ),
        (
            &["--tp", "2", "--nnodes", "4"][..],
            "every host runs the same number of ranks",
        ),
        (
            &["--tp", "2", "--nnodes", "2", "--temp", "0.8"][..],
            "give --seed (or --temp 0)",
        ),
    ] {
        let mut all = vec!["run", "-p", "x", "-n", "2", "--device", "cpu"];
        if !args.contains(&"--temp") {
            all.extend_from_slice(&["--temp", "0"]);
        }
        all.extend_from_slice(args);
        let o = kiln(&all);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
    }
}

/// A tokenizer that knows fewer tokens than the model has output rows: the ids past it have
/// no text, and a warning on stderr says how many there were.
#[test]
fn ids_past_the_tokenizers_tokens_are_named_in_a_warning() {
    use kiln_io::gguf::{Array, GgufFile, GgufWriter, Value};
    let src = GgufFile::open(repo().join("tests/fixtures/llama/llama-f32.gguf")).unwrap();
    let keep = 200;
    let mut w = GgufWriter::new();
    w.set_alignment(src.alignment as u32).unwrap();
    for (key, value) in &src.metadata {
        let value = match (key.as_str(), value) {
            ("tokenizer.ggml.tokens", Value::Array(Array::String(v))) => {
                Value::Array(Array::String(v[..keep].to_vec()))
            }
            ("tokenizer.ggml.scores", Value::Array(Array::F32(v))) => {
                Value::Array(Array::F32(v[..keep].to_vec()))
            }
            ("tokenizer.ggml.token_type", Value::Array(Array::I32(v))) => {
                Value::Array(Array::I32(v[..keep].to_vec()))
            }
            _ => value.clone(),
        };
        w.set(key, value).unwrap();
    }
    for t in &src.tensors {
        w.add_raw_tensor(
            &t.name,
            t.ggml_type,
            t.ne.clone(),
            src.tensor_data(t).to_vec(),
        )
        .unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("short-vocabulary.gguf");
    w.write_file(&path).unwrap();
    let model = path.to_str().unwrap();
    let o = kiln(&[
        "run", "-m", model, "-p", "the", "-n", "48", "--temp", "1.5", "--seed", "7", "-o", "json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let json: serde_json::Value = serde_json::from_str(stdout(&o).lines().last().unwrap()).unwrap();
    let past = json["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| t.as_u64().unwrap() >= keep as u64)
        .count();
    assert!(
        past > 0,
        "the run drew no id past {keep}: pick another seed"
    );
    let err = stderr(&o);
    assert!(
        err.contains(&format!("{past} of the ")) && err.contains("past the tokenizer's 200 tokens"),
        "{err}"
    );
}
