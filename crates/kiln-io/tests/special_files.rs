//! Paths that are not regular files (FIFOs, devices, directories) and files larger than
//! their kind allows are refused at once, by every reader, with a message naming the file.
//! The special files are made here at run time, never committed.

use kiln_io::file::{self, FileKind};
use kiln_io::gguf::GgufFile;
use kiln_io::hf_config::HfConfig;
use kiln_io::safetensors::SafetensorsModel;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

fn mkfifo(path: &Path) {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo");
}

/// Runs `f` on a thread and returns its error message; a reader that blocks on a FIFO
/// fails the test after a few seconds instead of hanging it.
fn error_of<T: Send + 'static>(
    f: impl FnOnce() -> kiln_core::Result<T> + Send + 'static,
) -> String {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f().err().map(|e| e.to_string()));
    });
    rx.recv_timeout(Duration::from_secs(5))
        .expect("the reader blocked")
        .expect("a special file was accepted")
}

/// A directory holding `name` as a FIFO, and the same name as a link to /dev/zero.
fn fifo_and_zero(name: &str) -> (tempfile::TempDir, tempfile::TempDir) {
    let fifo = tempfile::tempdir().unwrap();
    mkfifo(&fifo.path().join(name));
    let zero = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink("/dev/zero", zero.path().join(name)).unwrap();
    (fifo, zero)
}

fn assert_refused(msg: &str, path: &Path, kind: &str) {
    assert!(
        msg.starts_with(&path.display().to_string())
            && msg.contains("not a regular file")
            && msg.contains(kind),
        "{msg}"
    );
}

#[test]
fn readers_refuse_fifos_and_devices() {
    let kinds = [
        FileKind::CONFIG_JSON,
        FileKind::SAFETENSORS_INDEX,
        FileKind::TOKENIZER_JSON,
        FileKind::SENTENCEPIECE_MODEL,
        FileKind::CHAT_TEMPLATE,
        FileKind::TEXT,
    ];
    let (fifo, zero) = fifo_and_zero("f");
    for kind in kinds {
        for (dir, what) in [(&fifo, "a FIFO"), (&zero, "a character device")] {
            let p = dir.path().join("f");
            let q = p.clone();
            assert_refused(&error_of(move || file::read(&q, kind)), &p, what);
            let q = p.clone();
            let msg = error_of(move || file::read_to_string_if_present(&q, kind));
            assert_refused(&msg, &p, what);
        }
    }
    let p = fifo.path().to_path_buf();
    assert_refused(
        &error_of(move || file::read(&p, FileKind::TEXT)),
        fifo.path(),
        "a directory",
    );
}

#[test]
fn model_files_refuse_fifos_and_devices() {
    for name in ["model.gguf", "model.safetensors", "config.json"] {
        let (fifo, zero) = fifo_and_zero(name);
        for (dir, what) in [(&fifo, "a FIFO"), (&zero, "a character device")] {
            let p: PathBuf = dir.path().join(name);
            let q = p.clone();
            assert_refused(&error_of(move || kiln_io::detect_format(&q)), &p, what);
            let q = p.clone();
            assert_refused(&error_of(move || GgufFile::open(&q)), &p, what);
            let q = p.clone();
            assert_refused(&error_of(move || SafetensorsModel::open_file(&q)), &p, what);
            let q = p.clone();
            assert_refused(&error_of(move || HfConfig::load(&q)), &p, what);
            if name == "model.safetensors" {
                let d = dir.path().to_path_buf();
                assert_refused(&error_of(move || SafetensorsModel::open_dir(&d)), &p, what);
            }
        }
    }
}

#[test]
fn sharded_checkpoints_refuse_special_shards_and_indexes() {
    let (fifo, zero) = fifo_and_zero("shard.safetensors");
    for (dir, what) in [(&fifo, "a FIFO"), (&zero, "a character device")] {
        std::fs::write(
            dir.path().join("model.safetensors.index.json"),
            r#"{"weight_map":{"a":"shard.safetensors"}}"#,
        )
        .unwrap();
        let d = dir.path().to_path_buf();
        let msg = error_of(move || SafetensorsModel::open_dir(&d));
        assert_refused(&msg, &dir.path().join("shard.safetensors"), what);
    }
    let (fifo, zero) = fifo_and_zero("model.safetensors.index.json");
    for (dir, what) in [(&fifo, "a FIFO"), (&zero, "a character device")] {
        let d = dir.path().to_path_buf();
        let msg = error_of(move || SafetensorsModel::open_dir(&d));
        assert_refused(&msg, &dir.path().join("model.safetensors.index.json"), what);
    }
}

#[test]
fn files_larger_than_their_kind_are_refused_unread() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("config.json");
    // Sparse: the size is checked before anything is read.
    let f = std::fs::File::create(&p).unwrap();
    f.set_len(FileKind::CONFIG_JSON.max_bytes + 1).unwrap();
    let msg = HfConfig::load(&p).unwrap_err().to_string();
    assert_eq!(
        msg,
        format!(
            "{}: 16777217 bytes, larger than the 16 MiB kiln accepts for a JSON configuration file",
            p.display()
        )
    );
    f.set_len(FileKind::CHAT_TEMPLATE.max_bytes).unwrap();
    assert_eq!(
        file::read(&p, FileKind::CHAT_TEMPLATE).unwrap().len(),
        1 << 20
    );

    std::fs::write(&p, b"{\"a\": \"\xff\"}").unwrap();
    let msg = file::read_to_string(&p, FileKind::CONFIG_JSON)
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("not UTF-8 text (invalid byte at offset 7)"),
        "{msg}"
    );
    assert_eq!(
        file::read_to_string_if_present(&dir.path().join("absent"), FileKind::TEXT).unwrap(),
        None
    );
}

/// Outputs are written by renaming a finished file over the path: a FIFO, a device or a
/// directory there is refused and left as it was; a link is written through, the link
/// kept.
#[test]
fn outputs_refuse_what_is_not_a_regular_file_and_write_through_links() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("out.gguf");
    mkfifo(&fifo);
    let write = |p: &Path| file::write_replacing(p, |w| std::io::Write::write_all(w, b"data"));
    let msg = write(&fifo).unwrap_err().to_string();
    assert!(msg.contains("not a regular file"), "{msg}");
    assert!(std::fs::symlink_metadata(&fifo)
        .unwrap()
        .file_type()
        .is_fifo());
    let msg = write(dir.path()).unwrap_err().to_string();
    assert!(msg.contains("not a regular file"), "{msg}");
    let zero = dir.path().join("zero.gguf");
    std::os::unix::fs::symlink("/dev/null", &zero).unwrap();
    let msg = write(&zero).unwrap_err().to_string();
    assert!(msg.contains("not a regular file"), "{msg}");
    // A link to a regular file: the file gets the bytes, the link stays a link.
    let target = dir.path().join("target.gguf");
    std::fs::write(&target, b"old").unwrap();
    let link = dir.path().join("link.gguf");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    write(&link).unwrap();
    assert_eq!(std::fs::read(&target).unwrap(), b"data");
    assert!(std::fs::symlink_metadata(&link)
        .unwrap()
        .file_type()
        .is_symlink());
    // A new path is written as named.
    write(&dir.path().join("new.gguf")).unwrap();
    assert_eq!(std::fs::read(dir.path().join("new.gguf")).unwrap(), b"data");
}

/// A killed writer's temporary file goes (its process no longer runs); this process's
/// and other files stay.
#[test]
fn stale_partials_of_dead_writers_are_removed() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let dead = child.id();
    child.wait().unwrap();
    let stale = dir.path().join(format!(".checkpoint.gguf.{dead}.partial"));
    let ours = dir
        .path()
        .join(format!(".model.gguf.{}.partial", std::process::id()));
    let other = dir.path().join("train.json");
    for p in [&stale, &ours, &other] {
        std::fs::write(p, b"x").unwrap();
    }
    assert_eq!(file::remove_stale_partials(dir.path()), 1);
    assert!(!stale.exists());
    assert!(ours.exists() && other.exists());
}
