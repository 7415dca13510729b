use super::{Array, Value, DEFAULT_ALIGNMENT, MAGIC, MAX_DIMS};
use crate::GgmlType;
use kiln_core::{DType, Error, Result};
use std::io::Write;
use std::path::Path;

/// A tensor's bytes: given when it was added, or `None` for bytes made while the file is
/// written ([`GgufWriter::write_to_making`]).
struct PendingTensor {
    name: String,
    ne: Vec<u64>,
    ggml_type: GgmlType,
    len: u64,
    data: Option<Vec<u8>>,
}

/// Builds a GGUF version 3 file: metadata in insertion order, tensors packed at the
/// alignment in insertion order (the layout llama.cpp writes and expects). A tensor's
/// bytes may be made while the file is written ([`GgufWriter::add_tensor_later`]), so
/// that a model larger than memory in another type is written one tensor at a time.
pub struct GgufWriter {
    alignment: u64,
    metadata: Vec<(String, Value)>,
    tensors: Vec<PendingTensor>,
}

impl Default for GgufWriter {
    fn default() -> Self {
        Self::new()
    }
}

impl GgufWriter {
    pub fn new() -> Self {
        GgufWriter {
            alignment: DEFAULT_ALIGNMENT,
            metadata: Vec::new(),
            tensors: Vec::new(),
        }
    }

    /// Set `general.alignment` (a power of two).
    pub fn set_alignment(&mut self, alignment: u32) -> Result<()> {
        if !alignment.is_power_of_two() {
            return Err(Error::shape(format!(
                "alignment {alignment} is not a power of two"
            )));
        }
        self.alignment = alignment as u64;
        self.set("general.alignment", Value::U32(alignment))
    }

    /// Bytes of tensor data added so far (the bulk of the file).
    pub fn tensor_data_len(&self) -> u64 {
        self.tensors.iter().map(|t| t.len).sum()
    }

    /// Add or replace a metadata key.
    pub fn set(&mut self, key: &str, value: Value) -> Result<()> {
        check_value(&value, 0)?;
        match self.metadata.iter_mut().find(|(k, _)| k == key) {
            Some(entry) => entry.1 = value,
            None => self.metadata.push((key.to_string(), value)),
        }
        Ok(())
    }

    /// Add a tensor of a kiln dtype; `shape` is outermost first, `data` its encoding.
    pub fn add_tensor(
        &mut self,
        name: &str,
        dtype: DType,
        shape: &[usize],
        data: Vec<u8>,
    ) -> Result<()> {
        let ne = shape.iter().rev().map(|&d| d as u64).collect();
        self.add_raw_tensor(name, GgmlType::from_dtype(dtype), ne, data)
    }

    /// Add a tensor of a kiln dtype whose encoding is made when the file is written
    /// ([`GgufWriter::write_to_making`]; its length is checked then).
    pub fn add_tensor_later(&mut self, name: &str, dtype: DType, shape: &[usize]) -> Result<()> {
        let ne = shape.iter().rev().map(|&d| d as u64).collect();
        self.push(name, GgmlType::from_dtype(dtype), ne, None)
    }

    /// Add a tensor of any ggml type, with dimensions in ggml order (innermost first).
    pub fn add_raw_tensor(
        &mut self,
        name: &str,
        ggml_type: GgmlType,
        ne: Vec<u64>,
        data: Vec<u8>,
    ) -> Result<()> {
        self.push(name, ggml_type, ne, Some(data))
    }

    fn push(
        &mut self,
        name: &str,
        ggml_type: GgmlType,
        ne: Vec<u64>,
        data: Option<Vec<u8>>,
    ) -> Result<()> {
        if ne.len() > MAX_DIMS {
            return Err(Error::shape(format!(
                "tensor '{name}' has more than {MAX_DIMS} dimensions"
            )));
        }
        if self.tensors.iter().any(|t| t.name == name) {
            return Err(Error::shape(format!("tensor '{name}' added twice")));
        }
        let row_len = ne.first().copied().unwrap_or(1);
        let numel = ne.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        let want = numel.and_then(|n| {
            let rows = n.checked_div(row_len).unwrap_or(0);
            ggml_type.bytes_for(row_len, rows)
        });
        let Some(len) = want else {
            return Err(Error::shape(format!(
                "tensor '{name}' of {ggml_type} {ne:?} is too large"
            )));
        };
        if let Some(d) = &data {
            if d.len() as u64 != len {
                return Err(Error::shape(format!(
                    "tensor '{name}' of {ggml_type} {ne:?} needs {len} bytes, got {}",
                    d.len()
                )));
            }
        }
        self.tensors.push(PendingTensor {
            name: name.to_string(),
            ne,
            ggml_type,
            len,
            data,
        });
        Ok(())
    }

    /// Write the file to `w` (every tensor's bytes given when it was added).
    pub fn write_to(&self, w: &mut impl Write) -> std::io::Result<()> {
        self.write_to_making(w, |name| {
            Err(Error::shape(format!(
                "tensor '{name}' is made while the file is written: write it with write_to_making"
            )))
        })
    }

    /// Write the file to `w`, the bytes of each tensor added with
    /// [`GgufWriter::add_tensor_later`] made by `make(name)` when its turn comes and
    /// dropped once written: one such tensor in memory at a time.
    pub fn write_to_making(
        &self,
        w: &mut impl Write,
        make: impl Fn(&str) -> Result<Vec<u8>>,
    ) -> std::io::Result<()> {
        let mut header = Vec::new();
        header.extend_from_slice(MAGIC);
        header.extend_from_slice(&3u32.to_le_bytes());
        header.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        header.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            header.extend(encode_string(key));
            header.extend_from_slice(&(value.value_type() as u32).to_le_bytes());
            header.extend(encode_value(value));
        }
        let mut offset = 0u64;
        for t in &self.tensors {
            header.extend(encode_string(&t.name));
            header.extend_from_slice(&(t.ne.len() as u32).to_le_bytes());
            for d in &t.ne {
                header.extend_from_slice(&d.to_le_bytes());
            }
            header.extend_from_slice(&t.ggml_type.id.to_le_bytes());
            header.extend_from_slice(&offset.to_le_bytes());
            offset = (offset + t.len).next_multiple_of(self.alignment);
        }
        let pad = |len: u64| vec![0u8; (len.next_multiple_of(self.alignment) - len) as usize];
        if !self.tensors.is_empty() {
            header.extend(pad(header.len() as u64));
        }
        w.write_all(&header)?;
        for t in &self.tensors {
            match &t.data {
                Some(d) => w.write_all(d)?,
                None => {
                    let d = make(&t.name)
                        .map_err(|e| std::io::Error::other(format!("tensor '{}': {e}", t.name)))?;
                    if d.len() as u64 != t.len {
                        return Err(std::io::Error::other(format!(
                            "tensor '{}' of {} {:?} was made of {} bytes, not {}",
                            t.name,
                            t.ggml_type,
                            t.ne,
                            d.len(),
                            t.len
                        )));
                    }
                    w.write_all(&d)?;
                }
            }
            w.write_all(&pad(t.len))?;
        }
        Ok(())
    }

    pub fn write_file(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let file = std::fs::File::create(path).map_err(|e| Error::io(path.display(), e))?;
        let mut w = std::io::BufWriter::new(file);
        self.write_to(&mut w)
            .and_then(|_| w.flush())
            .map_err(|e| Error::io(path.display(), e))
    }
}

fn check_value(value: &Value, depth: usize) -> Result<()> {
    if let Value::Array(a) = value {
        check_array(a, depth)?;
    }
    Ok(())
}

fn check_array(a: &Array, depth: usize) -> Result<()> {
    if depth >= 4 {
        return Err(Error::shape("metadata arrays nest at most 4 deep"));
    }
    if let Array::Array(items) = a {
        for item in items {
            check_array(item, depth + 1)?;
        }
    }
    Ok(())
}

fn encode_string(s: &str) -> Vec<u8> {
    let mut out = (s.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(s.as_bytes());
    out
}

fn encode_value(v: &Value) -> Vec<u8> {
    match v {
        Value::U8(x) => vec![*x],
        Value::I8(x) => vec![*x as u8],
        Value::U16(x) => x.to_le_bytes().to_vec(),
        Value::I16(x) => x.to_le_bytes().to_vec(),
        Value::U32(x) => x.to_le_bytes().to_vec(),
        Value::I32(x) => x.to_le_bytes().to_vec(),
        Value::F32(x) => x.to_le_bytes().to_vec(),
        Value::Bool(x) => vec![*x as u8],
        Value::String(s) => encode_string(s),
        Value::Array(a) => encode_array(a),
        Value::U64(x) => x.to_le_bytes().to_vec(),
        Value::I64(x) => x.to_le_bytes().to_vec(),
        Value::F64(x) => x.to_le_bytes().to_vec(),
    }
}

fn encode_array(a: &Array) -> Vec<u8> {
    let mut out = (a.element_type() as u32).to_le_bytes().to_vec();
    out.extend_from_slice(&(a.len() as u64).to_le_bytes());
    fn extend<T, const N: usize>(out: &mut Vec<u8>, items: &[T], f: fn(&T) -> [u8; N]) {
        for item in items {
            out.extend_from_slice(&f(item));
        }
    }
    match a {
        Array::U8(v) => out.extend_from_slice(v),
        Array::I8(v) => extend(&mut out, v, |x| x.to_le_bytes()),
        Array::U16(v) => extend(&mut out, v, |x| x.to_le_bytes()),
        Array::I16(v) => extend(&mut out, v, |x| x.to_le_bytes()),
        Array::U32(v) => extend(&mut out, v, |x| x.to_le_bytes()),
        Array::I32(v) => extend(&mut out, v, |x| x.to_le_bytes()),
        Array::F32(v) => extend(&mut out, v, |x| x.to_le_bytes()),
        Array::Bool(v) => extend(&mut out, v, |x| [*x as u8]),
        Array::U64(v) => extend(&mut out, v, |x| x.to_le_bytes()),
        Array::I64(v) => extend(&mut out, v, |x| x.to_le_bytes()),
        Array::F64(v) => extend(&mut out, v, |x| x.to_le_bytes()),
        Array::String(v) => v.iter().for_each(|s| out.extend(encode_string(s))),
        Array::Array(v) => v.iter().for_each(|a| out.extend(encode_array(a))),
    }
    out
}
