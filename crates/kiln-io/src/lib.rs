//! kiln's model files.
//!
//! - [`gguf`]: llama.cpp's format, read through a memory map with zero-copy tensor data,
//!   and written (for tests, `kiln quantize` and the converter).
//! - [`safetensors`]: Hugging Face checkpoints, single files and sharded ones.
//! - [`hf_config`]: Hugging Face `config.json`.
//! - [`file`]: opening any of them, and the other files kiln reads, safely.
//!
//! Readers treat every file as hostile: they never panic, never allocate more than the
//! file's size can justify, never read out of bounds, and report what is wrong and where.

pub mod file;
pub mod ggml_type;
pub mod gguf;
pub mod hf_config;
pub mod safetensors;

pub use ggml_type::GgmlType;

use kiln_core::{Error, Result};
use std::io::Read;
use std::path::Path;
use std::sync::Arc;

/// A whole file's bytes: a read-only memory map, or (for fuzzing and tests) a vector.
/// Shared by every tensor that views it.
pub(crate) type FileBytes = Arc<dyn AsRef<[u8]> + Send + Sync>;

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
    let (file, size) = file::open(path)?;
    let mut head = Vec::with_capacity(8);
    file.take(8)
        .read_to_end(&mut head)
        .map_err(|e| Error::io(path.display(), e))?;
    if head.starts_with(b"GGUF") {
        return Ok(FileFormat::Gguf);
    }
    // safetensors starts with a little-endian u64 header length, then '{'.
    if let Ok(len) = <[u8; 8]>::try_from(head.as_slice()) {
        if u64::from_le_bytes(len) < size {
            return Ok(FileFormat::Safetensors);
        }
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
