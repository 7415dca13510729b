//! The GGUF parser. It reads from the mapped bytes through a bounds-checked cursor; every
//! count is checked against the bytes left before anything is allocated for it.

use super::{Array, TensorInfo, Value, ValueType, DEFAULT_ALIGNMENT, MAGIC, MAX_DIMS};
use crate::GgmlType;
use std::collections::HashSet;

/// Arrays of arrays nest at most this deep (llama.cpp writes none; the bound keeps a
/// hostile file from recursing without limit).
const MAX_ARRAY_DEPTH: usize = 4;

pub(super) struct Parsed {
    pub version: u32,
    pub alignment: u64,
    pub data_offset: u64,
    pub metadata: Vec<(String, Value)>,
    pub tensors: Vec<TensorInfo>,
}

type Res<T> = std::result::Result<T, String>;

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    fn take(&mut self, n: u64, what: &str) -> Res<&'a [u8]> {
        if n > self.remaining() {
            return Err(format!(
                "at byte {}: {what} needs {n} bytes but the file ends {} bytes later (truncated?)",
                self.pos,
                self.remaining()
            ));
        }
        let start = self.pos;
        self.pos += n as usize;
        Ok(&self.buf[start..self.pos])
    }

    fn array<const N: usize>(&mut self, what: &str) -> Res<[u8; N]> {
        Ok(self.take(N as u64, what)?.try_into().expect("took N bytes"))
    }

    fn u32(&mut self, what: &str) -> Res<u32> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &str) -> Res<u64> {
        self.array(what).map(u64::from_le_bytes)
    }

    fn string(&mut self, what: &str) -> Res<String> {
        let at = self.pos;
        let len = self.u64(what)?;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|e| format!("at byte {at}: {what} is not valid UTF-8 ({e})"))
    }

    /// Refuse a count of items that cannot fit in the bytes left, before allocating.
    fn check_count(&self, count: u64, min_size: u64, what: &str) -> Res<usize> {
        match count.checked_mul(min_size) {
            Some(need) if need <= self.remaining() => Ok(count as usize),
            _ => Err(format!(
                "at byte {}: {what} claims {count} items, more than the {} bytes left can hold",
                self.pos,
                self.remaining()
            )),
        }
    }
}

pub(super) fn parse(buf: &[u8]) -> Res<Parsed> {
    let mut c = Cursor { buf, pos: 0 };
    if buf.len() < 4 || &buf[..4] != MAGIC {
        let shown = &buf[..buf.len().min(4)];
        return Err(format!(
            "not a GGUF file (starts with {shown:?}, expected \"GGUF\")"
        ));
    }
    c.pos = 4;
    let version = c.u32("the version")?;
    match version {
        2 | 3 => {}
        1 => return Err("GGUF version 1 is not supported (kiln reads versions 2 and 3)".into()),
        v if v.swap_bytes() <= 3 => {
            return Err(format!(
                "big-endian GGUF (version {}) is not supported",
                v.swap_bytes()
            ))
        }
        v => {
            return Err(format!(
                "unsupported GGUF version {v} (kiln reads versions 2 and 3)"
            ))
        }
    }
    let n_tensors = c.u64("the tensor count")?;
    let n_kv = c.u64("the metadata count")?;
    // Least bytes per entry: a key/value is a length, a type and one byte; a tensor info a
    // name length, a dimension count, a type and an offset.
    let n_kv = c.check_count(n_kv, 8 + 4 + 1, "the metadata count")?;
    let n_tensors = c.check_count(n_tensors, 8 + 4 + 4 + 8, "the tensor count")?;

    let mut metadata = Vec::with_capacity(n_kv);
    let mut keys = HashSet::with_capacity(n_kv);
    for i in 0..n_kv {
        let key = c.string(&format!("metadata key #{i}"))?;
        let what = format!("metadata '{key}'");
        if !keys.insert(key.clone()) {
            return Err(format!("{what} appears twice"));
        }
        let at = c.pos;
        let ty = c.u32(&what)?;
        let ty = ValueType::from_u32(ty)
            .ok_or_else(|| format!("at byte {at}: {what} has unknown value type {ty}"))?;
        let value = read_value(&mut c, ty, 0, &what)?;
        metadata.push((key, value));
    }

    let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some((_, Value::U32(a))) if *a != 0 && a.is_power_of_two() => *a as u64,
        Some((_, v)) => {
            return Err(format!(
                "general.alignment must be a power-of-two u32, found {} {v}",
                v.value_type().name()
            ))
        }
    };

    let mut tensors = Vec::with_capacity(n_tensors);
    let mut names = HashSet::with_capacity(n_tensors);
    for i in 0..n_tensors {
        let name = c.string(&format!("tensor #{i}'s name"))?;
        let what = format!("tensor '{name}'");
        if !names.insert(name.clone()) {
            return Err(format!("{what} appears twice"));
        }
        let n_dims = c.u32(&what)? as usize;
        if n_dims > MAX_DIMS {
            return Err(format!(
                "{what} has {n_dims} dimensions (at most {MAX_DIMS})"
            ));
        }
        let mut ne = Vec::with_capacity(n_dims);
        for _ in 0..n_dims {
            ne.push(c.u64(&what)?);
        }
        // ggml keeps element counts in int64.
        let numel = ne
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .filter(|&n| n <= i64::MAX as u64)
            .ok_or_else(|| format!("{what} has dimensions {ne:?} whose product overflows"))?;
        let type_at = c.pos;
        let type_id = c.u32(&what)?;
        let ggml_type = GgmlType::from_id(type_id).ok_or_else(|| {
            format!("at byte {type_at}: {what} has unknown tensor type {type_id}")
        })?;
        let row_len = ne.first().copied().unwrap_or(1);
        let rows = numel.checked_div(row_len).unwrap_or(0);
        let size_bytes = ggml_type.bytes_for(row_len, rows).ok_or_else(|| {
            format!(
                "{what}: rows of {row_len} elements are not a whole number of {} blocks of {}",
                ggml_type.name, ggml_type.block_size
            )
        })?;
        let offset = c.u64(&what)?;
        tensors.push(TensorInfo {
            name,
            ne,
            ggml_type,
            offset,
            size_bytes,
        });
    }

    let file_len = buf.len() as u64;
    let data_offset = (c.pos as u64).next_multiple_of(alignment);
    check_tensor_data(&tensors, alignment, data_offset, file_len)?;
    Ok(Parsed {
        version,
        alignment,
        data_offset,
        metadata,
        tensors,
    })
}

/// Each tensor's data must be aligned, inside the file, and apart from every other's.
fn check_tensor_data(
    tensors: &[TensorInfo],
    alignment: u64,
    data_offset: u64,
    file_len: u64,
) -> Res<()> {
    let mut spans = Vec::with_capacity(tensors.len());
    for t in tensors {
        if t.offset % alignment != 0 {
            return Err(format!(
                "tensor '{}' has offset {} that is not a multiple of the alignment {alignment}",
                t.name, t.offset
            ));
        }
        let start = data_offset.checked_add(t.offset);
        let end = start.and_then(|s| s.checked_add(t.size_bytes));
        match (start, end) {
            (Some(start), Some(end)) if end <= file_len => spans.push((start, end, &t.name)),
            _ => {
                return Err(format!(
                    "tensor '{}' ({} bytes at data offset {}) runs past the end of the file ({file_len} bytes; truncated?)",
                    t.name, t.size_bytes, t.offset
                ))
            }
        }
    }
    spans.sort_unstable();
    for pair in spans.windows(2) {
        let ((_, end_a, a), (start_b, _, b)) = (pair[0], pair[1]);
        if start_b < end_a {
            return Err(format!("tensors '{a}' and '{b}' overlap in the file"));
        }
    }
    Ok(())
}

fn read_value(c: &mut Cursor, ty: ValueType, depth: usize, what: &str) -> Res<Value> {
    Ok(match ty {
        ValueType::U8 => Value::U8(c.array::<1>(what)?[0]),
        ValueType::I8 => Value::I8(c.array::<1>(what)?[0] as i8),
        ValueType::U16 => Value::U16(u16::from_le_bytes(c.array(what)?)),
        ValueType::I16 => Value::I16(i16::from_le_bytes(c.array(what)?)),
        ValueType::U32 => Value::U32(c.u32(what)?),
        ValueType::I32 => Value::I32(i32::from_le_bytes(c.array(what)?)),
        ValueType::F32 => Value::F32(f32::from_le_bytes(c.array(what)?)),
        ValueType::U64 => Value::U64(c.u64(what)?),
        ValueType::I64 => Value::I64(i64::from_le_bytes(c.array(what)?)),
        ValueType::F64 => Value::F64(f64::from_le_bytes(c.array(what)?)),
        ValueType::Bool => Value::Bool(read_bool(c, what)?),
        ValueType::String => Value::String(c.string(what)?),
        ValueType::Array => Value::Array(read_array(c, depth, what)?),
    })
}

fn read_bool(c: &mut Cursor, what: &str) -> Res<bool> {
    let at = c.pos;
    match c.array::<1>(what)?[0] {
        0 => Ok(false),
        1 => Ok(true),
        b => Err(format!(
            "at byte {at}: {what} has bool value {b} (must be 0 or 1)"
        )),
    }
}

/// Decode `n` fixed-size little-endian items.
fn fixed<const N: usize, T>(
    c: &mut Cursor,
    n: usize,
    what: &str,
    f: fn([u8; N]) -> T,
) -> Res<Vec<T>> {
    let bytes = c.take((n * N) as u64, what)?;
    Ok(bytes
        .chunks_exact(N)
        .map(|b| f(b.try_into().expect("chunk of N")))
        .collect())
}

fn read_array(c: &mut Cursor, depth: usize, what: &str) -> Res<Array> {
    if depth >= MAX_ARRAY_DEPTH {
        return Err(format!(
            "{what}: arrays nested deeper than {MAX_ARRAY_DEPTH}"
        ));
    }
    let at = c.pos;
    let ty = c.u32(what)?;
    let ty = ValueType::from_u32(ty)
        .ok_or_else(|| format!("at byte {at}: {what} is an array of unknown type {ty}"))?;
    let n = c.u64(what)?;
    let n = c.check_count(n, ty.min_size(), what)?;
    Ok(match ty {
        ValueType::U8 => Array::U8(c.take(n as u64, what)?.to_vec()),
        ValueType::I8 => Array::I8(fixed(c, n, what, |b: [u8; 1]| b[0] as i8)?),
        ValueType::U16 => Array::U16(fixed(c, n, what, u16::from_le_bytes)?),
        ValueType::I16 => Array::I16(fixed(c, n, what, i16::from_le_bytes)?),
        ValueType::U32 => Array::U32(fixed(c, n, what, u32::from_le_bytes)?),
        ValueType::I32 => Array::I32(fixed(c, n, what, i32::from_le_bytes)?),
        ValueType::F32 => Array::F32(fixed(c, n, what, f32::from_le_bytes)?),
        ValueType::U64 => Array::U64(fixed(c, n, what, u64::from_le_bytes)?),
        ValueType::I64 => Array::I64(fixed(c, n, what, i64::from_le_bytes)?),
        ValueType::F64 => Array::F64(fixed(c, n, what, f64::from_le_bytes)?),
        ValueType::Bool => Array::Bool((0..n).map(|_| read_bool(c, what)).collect::<Res<_>>()?),
        ValueType::String => Array::String((0..n).map(|_| c.string(what)).collect::<Res<_>>()?),
        ValueType::Array => Array::Array(
            (0..n)
                .map(|_| read_array(c, depth + 1, what))
                .collect::<Res<_>>()?,
        ),
    })
}
