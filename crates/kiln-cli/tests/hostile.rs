//! The corpus of hostile inputs (tests/corpus/hostile, made by
//! scripts/make_hostile_corpus.py): each case runs the `kiln` binary under a 20 s time
//! limit and a 1 GiB address-space limit, and must end in exit status 1 or 2 with one
//! `kiln: error:` line (or succeed, where the input is valid), never a panic, an abort or
//! a hang, and leave every input file as it was.
//!
//! `KILN_HOSTILE_CASE=substring` runs only the cases whose names contain it.

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

const TIME_LIMIT: Duration = Duration::from_secs(20);
const ADDRESS_SPACE: u64 = 1 << 30;
/// Output past this is a failure in itself (and files stop growing there).
const OUTPUT_LIMIT: u64 = 64 << 20;
/// stderr of any case: a few lines, never a log that grows with the input.
const STDERR_LIMIT: usize = 64 << 10;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

struct Case {
    name: String,
    spec: serde_json::Value,
    dir: PathBuf,
}

fn cases() -> Vec<Case> {
    let root = repo().join("tests/corpus/hostile");
    let filter = std::env::var("KILN_HOSTILE_CASE").unwrap_or_default();
    let mut cases: Vec<Case> = fs::read_dir(&root)
        .expect("tests/corpus/hostile exists: run scripts/make_hostile_corpus.py")
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("case.json").is_file())
        .map(|dir| Case {
            name: dir.file_name().unwrap().to_string_lossy().into_owned(),
            spec: serde_json::from_str(&fs::read_to_string(dir.join("case.json")).unwrap())
                .unwrap(),
            dir,
        })
        .filter(|c| c.name.contains(&filter))
        .collect();
    cases.sort_by(|a, b| a.name.cmp(&b.name));
    cases
}

fn copy_tree(from: &Path, to: &Path) {
    fs::create_dir_all(to).unwrap();
    for e in fs::read_dir(from).unwrap() {
        let p = e.unwrap().path();
        let dest = to.join(p.file_name().unwrap());
        if p.is_dir() {
            copy_tree(&p, &dest);
        } else if p.file_name().unwrap() != "case.json" {
            fs::copy(&p, &dest).unwrap();
        }
    }
}

/// Contents of every regular file under `dir` (links and special files left out).
fn snapshot(dir: &Path, out: &mut BTreeMap<PathBuf, Vec<u8>>) {
    for e in fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        let t = e.file_type().unwrap();
        if t.is_dir() {
            snapshot(&e.path(), out);
        } else if t.is_file() {
            out.insert(e.path(), fs::read(e.path()).unwrap());
        }
    }
}

/// Lay the case out in `tmp`: its base directory as model/, shared copies, its own files,
/// less the files it removes, then its special files.
fn prepare(case: &Case, tmp: &Path) {
    let s = &case.spec;
    if let Some(base) = s["base"].as_str() {
        copy_tree(&repo().join(base), &tmp.join("model"));
    }
    for pair in s["copy"].as_array().into_iter().flatten() {
        let dest = tmp.join(pair[1].as_str().unwrap());
        fs::create_dir_all(dest.parent().unwrap()).unwrap();
        fs::copy(repo().join(pair[0].as_str().unwrap()), dest).unwrap();
    }
    copy_tree(&case.dir, tmp);
    for rel in s["remove"].as_array().into_iter().flatten() {
        fs::remove_file(tmp.join(rel.as_str().unwrap())).unwrap();
    }
    for sp in s["special"].as_array().into_iter().flatten() {
        let path = tmp.join(sp["path"].as_str().unwrap());
        let _ = fs::remove_file(&path);
        match sp["kind"].as_str().unwrap() {
            "fifo" => {
                let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
                assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0, "mkfifo");
            }
            "dev-zero" => std::os::unix::fs::symlink("/dev/zero", &path).unwrap(),
            other => panic!("{}: unknown special kind {other}", case.name),
        }
    }
}

struct Outcome {
    code: Option<i32>,
    timed_out: bool,
    stdout: String,
    stderr: String,
    elapsed: Duration,
}

fn run_limited(args: &[String], cwd: &Path, out_dir: &Path) -> Outcome {
    let stdout_path = out_dir.join("stdout");
    let stderr_path = out_dir.join("stderr");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kiln"));
    cmd.args(args)
        .current_dir(cwd)
        .env_remove("RUST_LOG")
        .env_remove("RUST_BACKTRACE")
        .stdin(Stdio::null())
        .stdout(fs::File::create(&stdout_path).unwrap())
        .stderr(fs::File::create(&stderr_path).unwrap());
    unsafe {
        cmd.pre_exec(|| {
            let limit = |resource, bytes: u64| {
                let r = libc::rlimit {
                    rlim_cur: bytes,
                    rlim_max: bytes,
                };
                if libc::setrlimit(resource, &r) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            };
            limit(libc::RLIMIT_AS, ADDRESS_SPACE)?;
            limit(libc::RLIMIT_FSIZE, OUTPUT_LIMIT)
        });
    }
    let start = Instant::now();
    let mut child = cmd.spawn().unwrap();
    let mut timed_out = false;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > TIME_LIMIT {
            timed_out = true;
            let _ = child.kill();
            break child.wait().unwrap();
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let read = |p: &Path| String::from_utf8_lossy(&fs::read(p).unwrap()).into_owned();
    Outcome {
        code: status.code(),
        timed_out,
        stdout: read(&stdout_path),
        stderr: read(&stderr_path),
        elapsed: start.elapsed(),
    }
}

/// What is wrong with the case's outcome, if anything.
fn check(case: &Case) -> Result<Duration, String> {
    let s = &case.spec;
    let tmp = tempfile::tempdir().unwrap();
    let out_dir = tempfile::tempdir().unwrap();
    prepare(case, tmp.path());
    let mut before = BTreeMap::new();
    snapshot(tmp.path(), &mut before);
    let tmp_str = tmp.path().to_str().unwrap();
    let args: Vec<String> = s["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().replace("{tmp}", tmp_str))
        .collect();
    let o = run_limited(&args, tmp.path(), out_dir.path());
    let tail = || {
        let lines: Vec<&str> = o.stderr.lines().collect();
        lines[lines.len().saturating_sub(3)..].join(" | ")
    };
    if o.timed_out {
        return Err(format!("no answer in {TIME_LIMIT:?} (stderr: {})", tail()));
    }
    let Some(code) = o.code else {
        return Err(format!("killed by a signal (stderr: {})", tail()));
    };
    for bad in [
        "panicked",
        "RUST_BACKTRACE",
        "memory allocation of",
        "stack overflow",
    ] {
        if o.stderr.contains(bad) {
            return Err(format!("stderr has {bad:?}: {}", tail()));
        }
    }
    if o.stderr.len() > STDERR_LIMIT {
        return Err(format!("{} bytes of stderr", o.stderr.len()));
    }
    if let Some(max) = s["max_stderr"].as_u64() {
        if o.stderr.len() as u64 > max {
            return Err(format!("{} bytes of stderr, at most {max}", o.stderr.len()));
        }
    }
    let expect = s["expect"].as_str().unwrap();
    let any = s["expect_any"].as_bool().unwrap_or(false);
    match (expect, code) {
        ("ok", 0) => {}
        ("error", 1 | 2) => {}
        (_, 0..=2) if any => {}
        _ => {
            return Err(format!(
                "exit status {code}, expected {expect} (stderr: {})",
                tail()
            ))
        }
    }
    if code != 0 {
        let errors: Vec<&str> = o
            .stderr
            .lines()
            .filter(|l| l.contains("kiln: error:"))
            .collect();
        let last = o.stderr.lines().rev().find(|l| !l.trim().is_empty());
        if errors.len() != 1 || last != Some(errors[0]) || !errors[0].starts_with("kiln: error: ") {
            return Err(format!(
                "the error is not one `kiln: error:` line at the end of stderr: {:?}",
                o.stderr
            ));
        }
        if let Some(m) = s["message"].as_str() {
            if !errors[0].contains(m) {
                return Err(format!("the error does not say {m:?}: {}", errors[0]));
            }
        }
        if s["stdout_empty"].as_bool() == Some(true) && !o.stdout.is_empty() {
            return Err(format!("printed {:?} on stdout before the error", o.stdout));
        }
    }
    if let Some(m) = s["stderr_has"].as_str() {
        if !o.stderr.contains(m) {
            return Err(format!("stderr does not say {m:?}: {}", tail()));
        }
    }
    let mut after = BTreeMap::new();
    snapshot(tmp.path(), &mut after);
    for (path, content) in &before {
        if after.get(path) != Some(content) {
            return Err(format!("{} was modified or removed", path.display()));
        }
    }
    Ok(o.elapsed)
}

#[test]
fn every_hostile_case_ends_cleanly_within_its_limits() {
    let cases = cases();
    assert!(!cases.is_empty(), "no cases matched");
    let next = AtomicUsize::new(0);
    let results = Mutex::new(Vec::new());
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get().min(4));
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(case) = cases.get(i) else { break };
                let r = check(case);
                results
                    .lock()
                    .unwrap()
                    .push((case.name.clone(), case.spec["cls"].clone(), r));
            });
        }
    });
    let mut results = results.into_inner().unwrap();
    results.sort_by(|a, b| a.0.cmp(&b.0));
    let mut failed = 0;
    for (name, cls, r) in &results {
        match r {
            Ok(t) => eprintln!("ok   {name} ({:.2} s)", t.as_secs_f64()),
            Err(why) => {
                failed += 1;
                eprintln!("FAIL {name} [{}]: {why}", cls.as_str().unwrap_or("?"));
            }
        }
    }
    assert_eq!(
        failed,
        0,
        "{failed} of {} hostile cases failed",
        results.len()
    );
}
