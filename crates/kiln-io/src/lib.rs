//! kiln's model files.
//!
//! - [`gguf`]: llama.cpp's format, read through a memory map with zero-copy tensor data,
//!   and written (for tests, `kiln quantize` and the converter).
//! - [`safetensors`]: Hugging Face checkpoints, single files and sharded ones.
//! - [`hf_config`]: Hugging Face `config.json`.
//!
//! Readers treat every file as hostile: they never panic, never allocate more than the
//! file's size can justify, never read out of bounds, and report what is wrong and where.

pub mod ggml_type;
pub mod gguf;
pub mod hf_config;
pub mod safetensors;

pub use ggml_type::GgmlType;

use kiln_core::{Error, Result};
use memmap2::Mmap;
use std::fs::File;
use std::path::Path;
use std::sync::Arc;

/// A whole file's bytes: a read-only memory map, or (for fuzzing and tests) a vector.
/// Shared by every tensor that views it.
pub(crate) type FileBytes = Arc<dyn AsRef<[u8]> + Send + Sync>;

/// Map a whole file read-only.
pub(crate) fn map_file(path: &Path) -> Result<FileBytes> {
    let file = File::open(path).map_err(|e| Error::io(path.display(), e))?;
    let meta = file.metadata().map_err(|e| Error::io(path.display(), e))?;
    if !meta.is_file() {
        return Err(Error::format(format!(
            "{}: not a regular file",
            path.display()
        )));
    }
    // SAFETY: the map is read-only. Another process truncating the file while it is
    // mapped would fault; that is the accepted contract of mmap-based model loaders.
    let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path.display(), e))?;
    Ok(Arc::new(map))
}

/// The formats `kiln info` and the loaders recognise.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileFormat {
    Gguf,
    Safetensors,
    /// A Hugging Face model directory (`config.json` and safetensors weights).
    HfDirectory,
}

/// Tell a file's format from its first bytes (not its name); a directory is a Hugging
/// Face model directory.
pub fn detect_format(path: &Path) -> Result<FileFormat> {
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path.display(), e))?;
    if meta.is_dir() {
        return Ok(FileFormat::HfDirectory);
    }
    let mut head = [0u8; 8];
    let n = {
        use std::io::Read;
        let mut f = File::open(path).map_err(|e| Error::io(path.display(), e))?;
        let mut n = 0;
        while n < head.len() {
            match f.read(&mut head[n..]) {
                Ok(0) => break,
                Ok(k) => n += k,
                Err(e) => return Err(Error::io(path.display(), e)),
            }
        }
        n
    };
    if n >= 4 && &head[..4] == b"GGUF" {
        return Ok(FileFormat::Gguf);
    }
    // safetensors starts with a little-endian u64 header length, then '{'.
    if n == 8 && u64::from_le_bytes(head) < meta.len() {
        return Ok(FileFormat::Safetensors);
    }
    // Inconclusive bytes: trust the name, so the reader can say what is wrong inside.
    match path.extension().and_then(|e| e.to_str()) {
        Some("gguf") => return Ok(FileFormat::Gguf),
        Some("safetensors") => return Ok(FileFormat::Safetensors),
        _ => {}
    }
    Err(Error::format(format!(
        "{}: unknown format (not GGUF, safetensors, or a Hugging Face directory)",
        path.display()
    )))
}
