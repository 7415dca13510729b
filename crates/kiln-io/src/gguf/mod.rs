//! GGUF, llama.cpp's model format (versions 2 and 3).
//!
//! Layout: magic `GGUF`, version, tensor count, metadata count, the metadata key/values,
//! the tensor infos (name, dimensions innermost first, ggml type, offset), padding to the
//! alignment (`general.alignment`, default 32), then the tensor data. All little-endian.

mod read;
mod value;
mod write;

pub use value::{Array, Value, ValueType};
pub use write::GgufWriter;

use crate::{FileBytes, GgmlType};
use kiln_core::{Error, HostBytes, Result, Shape};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub const MAGIC: &[u8; 4] = b"GGUF";
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml's `GGML_MAX_DIMS`.
pub const MAX_DIMS: usize = 4;

/// One tensor's entry in the file.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub name: String,
    /// Dimensions as stored: innermost (row length) first, as ggml's `ne`.
    pub ne: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Offset from the start of the data section.
    pub offset: u64,
    pub size_bytes: u64,
}

impl TensorInfo {
    /// Dimensions outermost first, kiln's (and PyTorch's) order.
    pub fn shape(&self) -> Result<Shape> {
        let dims = self
            .ne
            .iter()
            .rev()
            .map(|&d| {
                usize::try_from(d).map_err(|_| Error::shape(format!("dimension {d} too large")))
            })
            .collect::<Result<Vec<_>>>()?;
        Shape::new(dims)
    }

    pub fn numel(&self) -> u64 {
        self.ne.iter().product()
    }
}

/// A GGUF file, memory-mapped. Tensor data is viewed in place, never copied (a clone
/// shares the mapping).
#[derive(Clone)]
pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    pub alignment: u64,
    /// Byte offset of the data section in the file.
    pub data_offset: u64,
    /// Metadata in file order.
    pub metadata: Vec<(String, Value)>,
    pub tensors: Vec<TensorInfo>,
    key_index: HashMap<String, usize>,
    tensor_index: HashMap<String, usize>,
    bytes: FileBytes,
    /// Whether `bytes` map the file (rather than hold a copy in memory).
    mapped: bool,
}

impl GgufFile {
    /// Map and validate a GGUF file. Every error message starts with the path.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        Self::from_file_bytes(path, crate::file::map(path)?, true)
    }

    /// Parse a GGUF image held in memory; `name` stands for the path in messages.
    pub fn from_bytes(name: impl AsRef<Path>, bytes: Vec<u8>) -> Result<Self> {
        Self::from_file_bytes(name.as_ref(), Arc::new(bytes), false)
    }

    fn from_file_bytes(path: &Path, bytes: FileBytes, mapped: bool) -> Result<Self> {
        let parsed = read::parse((*bytes).as_ref())
            .map_err(|e| Error::format(format!("{}: {e}", path.display())))?;
        let key_index = parsed
            .metadata
            .iter()
            .enumerate()
            .map(|(i, (k, _))| (k.clone(), i))
            .collect();
        let tensor_index = parsed
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        Ok(GgufFile {
            path: path.to_path_buf(),
            version: parsed.version,
            alignment: parsed.alignment,
            data_offset: parsed.data_offset,
            metadata: parsed.metadata,
            tensors: parsed.tensors,
            key_index,
            tensor_index,
            bytes,
            mapped,
        })
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.key_index.get(key).map(|&i| &self.metadata[i].1)
    }

    /// Set a metadata key of this opened file (in memory, not on disk): a run that
    /// starts from the file under another name.
    pub fn set(&mut self, key: &str, value: Value) {
        match self.key_index.get(key) {
            Some(&i) => self.metadata[i].1 = value,
            None => {
                self.key_index.insert(key.to_string(), self.metadata.len());
                self.metadata.push((key.to_string(), value));
            }
        }
    }

    /// `general.architecture`, when present and a string.
    pub fn architecture(&self) -> Option<&str> {
        self.get("general.architecture").and_then(Value::as_str)
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    fn data_range(&self, t: &TensorInfo) -> std::ops::Range<usize> {
        // Validated at open: the range lies inside the file.
        let start = (self.data_offset + t.offset) as usize;
        start..start + t.size_bytes as usize
    }

    /// The tensor's bytes, in place in the mapping.
    pub fn tensor_data(&self, t: &TensorInfo) -> &[u8] {
        &(*self.bytes).as_ref()[self.data_range(t)]
    }

    /// The tensor's bytes as a shareable handle (for uploading to a backend without a
    /// copy); a backend that keeps its own copy can [`HostBytes::release`] the mapped pages.
    pub fn tensor_bytes(&self, t: &TensorInfo) -> Result<HostBytes> {
        let bytes = HostBytes::new(self.bytes.clone(), self.data_range(t))?;
        Ok(if self.mapped {
            bytes.with_release(crate::file::release_mapped)
        } else {
            bytes
        })
    }

    pub fn file_size(&self) -> u64 {
        (*self.bytes).as_ref().len() as u64
    }
}

#[cfg(test)]
mod tests;
