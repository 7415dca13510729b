//! Opening the files kiln reads: each must be a regular file, and a file read whole must
//! fit the size its kind can justify.
//!
//! Paths come from users and from downloaded model directories, so a name may stand for a
//! FIFO (opening it for reading blocks until a writer appears), a device such as
//! `/dev/zero` (endless) or a file far larger than its kind ever is. Every file is
//! `stat`ed first, which never blocks, and refused unless it is a regular file; it is then
//! opened without blocking and checked again, in case it was swapped in between.

use crate::FileBytes;
use kiln_core::{Error, Result};
use memmap2::Mmap;
use std::fs::{File, Metadata};
use std::io::Read;
use std::path::Path;
use std::sync::Arc;

const MIB: u64 = 1 << 20;

/// What a file read whole is, for messages, and the largest size kiln accepts for it.
///
/// The limits are several times the largest such file published, and small enough that
/// parsing the largest accepted file stays well under a gigabyte.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileKind {
    pub what: &'static str,
    pub max_bytes: u64,
}

impl FileKind {
    /// `config.json`, `tokenizer_config.json`, `generation_config.json`: a few kilobytes in
    /// practice (the largest tokenizer_config.json, with every added token listed, ~1 MB).
    pub const CONFIG_JSON: FileKind = FileKind {
        what: "JSON configuration file",
        max_bytes: 16 * MIB,
    };
    /// `model.safetensors.index.json`: one line per tensor, a few MB for the largest
    /// checkpoints (~100k tensors).
    pub const SAFETENSORS_INDEX: FileKind = FileKind {
        what: "safetensors index",
        max_bytes: 64 * MIB,
    };
    /// `tokenizer.json`: the largest published is Gemma 3's, 33.4 MB (31.8 MiB). Parsing
    /// costs the `tokenizers` crate up to ~23 bytes of memory per byte (a file of nothing
    /// but short vocabulary entries: 915 MB peak for 39 MiB), so the limit leaves Gemma 3
    /// some headroom and keeps the densest accepted file near 840 MB.
    pub const TOKENIZER_JSON: FileKind = FileKind {
        what: "tokenizer.json",
        max_bytes: 36 * MIB,
    };
    /// `tokenizer.model` (SentencePiece): Gemma's, 4.2-4.7 MB, is the largest in use.
    pub const SENTENCEPIECE_MODEL: FileKind = FileKind {
        what: "SentencePiece model",
        max_bytes: 16 * MIB,
    };
    /// `chat_template.jinja`: published templates are under 30 KB.
    pub const CHAT_TEMPLATE: FileKind = FileKind {
        what: "chat template",
        max_bytes: MIB,
    };
    /// Text to score (`kiln perplexity -f`): wikitext-2's test set, the usual one, is
    /// 1.3 MB; tokenizing and scoring hold tens of bytes per byte of text.
    pub const TEXT: FileKind = FileKind {
        what: "text file",
        max_bytes: 16 * MIB,
    };
}

/// What a path is when it is not a regular file.
fn file_type_name(meta: &Metadata) -> &'static str {
    let t = meta.file_type();
    if t.is_dir() {
        return "a directory";
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_fifo() {
            return "a FIFO";
        }
        if t.is_char_device() {
            return "a character device";
        }
        if t.is_block_device() {
            return "a block device";
        }
        if t.is_socket() {
            return "a socket";
        }
    }
    "not a file"
}

fn check_regular(path: &Path, meta: &Metadata) -> Result<()> {
    if meta.is_file() {
        return Ok(());
    }
    Err(Error::format(format!(
        "{}: not a regular file ({}); kiln reads only regular files",
        path.display(),
        file_type_name(meta)
    )))
}

/// Opens a regular file for reading, refusing anything else without blocking on it.
/// Returns the file and its size.
pub fn open(path: &Path) -> Result<(File, u64)> {
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path.display(), e))?;
    check_regular(path, &meta)?;
    let mut options = std::fs::OpenOptions::new();
    options.read(true);
    #[cfg(unix)]
    {
        // A FIFO swapped in after the stat would otherwise block the open.
        use std::os::unix::fs::OpenOptionsExt;
        options.custom_flags(libc::O_NONBLOCK);
    }
    let file = options
        .open(path)
        .map_err(|e| Error::io(path.display(), e))?;
    let meta = file.metadata().map_err(|e| Error::io(path.display(), e))?;
    check_regular(path, &meta)?;
    Ok((file, meta.len()))
}

/// The whole file, when it is a regular file of at most `kind.max_bytes`.
pub fn read(path: &Path, kind: FileKind) -> Result<Vec<u8>> {
    let (file, size) = open(path)?;
    let too_large = |size: u64| {
        Error::format(format!(
            "{}: {size} bytes, larger than the {} MiB kiln accepts for a {}",
            path.display(),
            kind.max_bytes / MIB,
            kind.what
        ))
    };
    if size > kind.max_bytes {
        return Err(too_large(size));
    }
    // The size can change after the stat (and some kernel files report 0): read one
    // byte past the limit to notice.
    let mut bytes = Vec::with_capacity(size as usize);
    file.take(kind.max_bytes + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| Error::io(path.display(), e))?;
    if bytes.len() as u64 > kind.max_bytes {
        return Err(too_large(bytes.len() as u64));
    }
    Ok(bytes)
}

/// Like [`read`], for text: the file must be UTF-8.
pub fn read_to_string(path: &Path, kind: FileKind) -> Result<String> {
    String::from_utf8(read(path, kind)?).map_err(|e| {
        Error::format(format!(
            "{}: not UTF-8 text (invalid byte at offset {}); a {} must be UTF-8",
            path.display(),
            e.utf8_error().valid_up_to(),
            kind.what
        ))
    })
}

/// Like [`read_to_string`], or `None` when nothing is at `path` (a dangling link counts as
/// nothing, as `Path::exists` does).
pub fn read_to_string_if_present(path: &Path, kind: FileKind) -> Result<Option<String>> {
    match std::fs::metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        _ => read_to_string(path, kind).map(Some),
    }
}

/// Drop the whole pages of `bytes`, part of a read-only file mapping made by [`map`],
/// from this process's resident memory (`MADV_DONTNEED`): on a file mapping that discards
/// nothing, the kernel reads a page back from the file if it is touched again.
pub(crate) fn release_mapped(bytes: &[u8]) {
    #[cfg(unix)]
    {
        // SAFETY: sysconf has no preconditions.
        let Ok(page) = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }) else {
            return;
        };
        if page == 0 {
            return;
        }
        let (start, end) = (
            bytes.as_ptr() as usize,
            bytes.as_ptr() as usize + bytes.len(),
        );
        let (first, last) = (start.next_multiple_of(page), end / page * page);
        if last > first {
            // SAFETY: [first, last) lies inside `bytes`, a read-only mapping of a file:
            // MADV_DONTNEED there changes no byte anyone can read, only whether the page
            // is resident. A failure leaves the pages resident, which is harmless.
            unsafe {
                libc::madvise(
                    first as *mut libc::c_void,
                    last - first,
                    libc::MADV_DONTNEED,
                )
            };
        }
    }
    #[cfg(not(unix))]
    let _ = bytes;
}

/// Maps a whole regular file read-only (GGUF files and safetensors shards, which may be
/// larger than memory: mapping reads nothing until a tensor is used).
pub(crate) fn map(path: &Path) -> Result<FileBytes> {
    let (file, _) = open(path)?;
    // SAFETY: the map is read-only. Another process truncating the file while it is
    // mapped would fault; that is the accepted contract of mmap-based model loaders.
    let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path.display(), e))?;
    Ok(Arc::new(map))
}

/// Write `path` by `write`ing a temporary file beside it (same directory, so the rename
/// cannot cross file systems), flushing it to disk, renaming it over `path` and flushing
/// the directory: a failure or a crash at any point leaves `path` as it was (absent, or
/// the previous complete file), never a partial file. The temporary file is removed on
/// failure; after a crash one named `.NAME.PID.partial` may remain. A symbolic link is
/// written through (its target replaced); an existing path that is not a regular file (a
/// device, a fifo, a directory) is refused, since renaming over it would replace it.
pub fn write_replacing(
    path: &Path,
    write: impl FnOnce(&mut std::io::BufWriter<File>) -> std::io::Result<()>,
) -> Result<()> {
    let resolved;
    let path = match std::fs::canonicalize(path) {
        Ok(target) => {
            let meta = std::fs::metadata(&target).map_err(|e| Error::io(path.display(), e))?;
            if !meta.is_file() {
                return Err(Error::format(format!(
                    "{}: not a regular file (kiln writes its outputs by replacing a file; give a new path or a regular file)",
                    path.display()
                )));
            }
            resolved = target;
            resolved.as_path()
        }
        // Not there yet (or a dangling link): written as named.
        Err(_) => path,
    };
    let name = path.file_name().ok_or_else(|| {
        Error::format(format!("{}: the output path names no file", path.display()))
    })?;
    let tmp = path.with_file_name(format!(
        ".{}.{}.partial",
        name.to_string_lossy(),
        std::process::id()
    ));
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&tmp)
        .map_err(|e| Error::io(tmp.display(), e))?;
    let written = (|| {
        let mut b = std::io::BufWriter::new(file);
        write(&mut b)?;
        b.into_inner().map_err(|e| e.into_error())?.sync_all()?;
        std::fs::rename(&tmp, path)?;
        // The rename is durable once the directory is.
        #[cfg(unix)]
        {
            let dir = match path.parent() {
                Some(d) if !d.as_os_str().is_empty() => d,
                _ => Path::new("."),
            };
            File::open(dir)?.sync_all()?;
        }
        Ok(())
    })();
    written.map_err(|e: std::io::Error| {
        let _ = std::fs::remove_file(&tmp);
        Error::io(path.display(), e)
    })
}

/// Remove the temporary files that [`write_replacing`] left in `dir` when the process
/// writing them was killed (`.NAME.PID.partial` of a PID no longer running; another
/// running process's are kept); returns how many went. A run that saves often and is
/// killed often would otherwise pile them up (one a kill, each a whole checkpoint).
pub fn remove_stale_partials(dir: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut removed = 0;
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(rest) = name
            .to_str()
            .and_then(|n| n.strip_prefix('.'))
            .and_then(|n| n.strip_suffix(".partial"))
        else {
            continue;
        };
        let Some(pid) = rest
            .rsplit_once('.')
            .and_then(|(_, p)| p.parse::<u32>().ok())
        else {
            continue;
        };
        if pid != std::process::id() && !running(pid) && std::fs::remove_file(e.path()).is_ok() {
            removed += 1;
        }
    }
    removed
}

/// Whether a process `pid` exists (one that exists but is not ours counts as running).
fn running(pid: u32) -> bool {
    #[cfg(unix)]
    {
        let Ok(pid) = libc::pid_t::try_from(pid) else {
            return false;
        };
        // SAFETY: signal 0 only asks whether the process exists; nothing is sent.
        let r = unsafe { libc::kill(pid, 0) };
        r == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
    }
    #[cfg(not(unix))]
    {
        let _ = pid;
        true
    }
}
