use crate::panels::Panels;
use crate::pool::Pool;
use kiln_core::{quant, DType, Device, Error, HostBytes, Result, Storage, Tensor};
use std::any::Any;
use std::sync::Mutex;

/// CPU tensor data: owned (4-byte aligned, which every block type needs), host bytes used
/// in place, such as a tensor in a memory-mapped model file, or a quantized weight in the
/// interleaved layout of [`crate::panels`].
#[derive(Debug)]
pub enum CpuStorage {
    Owned { words: Vec<u32>, len: usize },
    Shared(HostBytes),
    Panels(Panels),
}

impl CpuStorage {
    pub fn zeroed(len: usize) -> Self {
        CpuStorage::Owned {
            words: vec![0; len.div_ceil(4)],
            len,
        }
    }

    /// Like `zeroed`, but a size the machine cannot hold is an error, not an abort: the
    /// sizes of model buffers come from files and flags.
    pub fn try_zeroed(len: usize) -> Result<Self> {
        let mut words = Vec::new();
        words
            .try_reserve_exact(len.div_ceil(4))
            .map_err(|_| Error::Device(format!("cannot allocate {len} bytes of CPU memory")))?;
        words.resize(len.div_ceil(4), 0);
        Ok(CpuStorage::Owned { words, len })
    }

    /// Use `bytes` in place when they are aligned for any block type, else copy them.
    pub fn from_host(bytes: HostBytes) -> Self {
        if bytes.as_slice().as_ptr().align_offset(4) == 0 {
            return CpuStorage::Shared(bytes);
        }
        let mut owned = CpuStorage::zeroed(bytes.len());
        if let CpuStorage::Owned { words, len } = &mut owned {
            bytemuck::cast_slice_mut(words)[..*len].copy_from_slice(bytes.as_slice());
        }
        bytes.release();
        owned
    }

    /// The bytes in the dtype's encoding, or an error for a weight in panels (which has
    /// no such bytes to lend: [`CpuStorage::panels`] reads it).
    pub fn bytes(&self) -> Result<&[u8]> {
        match self {
            CpuStorage::Owned { words, len } => Ok(&bytemuck::cast_slice(words)[..*len]),
            CpuStorage::Shared(b) => Ok(b.as_slice()),
            CpuStorage::Panels(p) => Err(in_panels(p)),
        }
    }

    /// The weight in the interleaved layout, if it is in one.
    pub(crate) fn panels(&self) -> Option<&Panels> {
        match self {
            CpuStorage::Panels(p) => Some(p),
            _ => None,
        }
    }

    /// Writable bytes, or an error for a weight in panels. Shared data is copied first
    /// (copy on write): weights mapped from a file stay in place because nothing writes
    /// them, while outputs can be uploaded.
    pub fn bytes_mut(&mut self) -> Result<&mut [u8]> {
        if let CpuStorage::Shared(b) = self {
            let mut owned = CpuStorage::zeroed(b.len());
            owned.bytes_mut()?.copy_from_slice(b.as_slice());
            *self = owned;
        }
        match self {
            CpuStorage::Owned { words, len } => Ok(&mut bytemuck::cast_slice_mut(words)[..*len]),
            CpuStorage::Shared(_) => unreachable!("made owned above"),
            CpuStorage::Panels(p) => Err(in_panels(p)),
        }
    }
}

/// The rows of a 2-D weight of any type, in the file's layout or in panels, decoded to f32
/// one at a time: embedding lookups, and the backward products over frozen weights kept
/// as stored.
pub(crate) struct Rows<'a> {
    source: Source<'a>,
    rows: usize,
    cols: usize,
}

enum Source<'a> {
    Panels(&'a Panels),
    Bytes {
        data: &'a [u8],
        dtype: DType,
        row_bytes: usize,
    },
}

impl<'a> Rows<'a> {
    /// `t`'s rows (`t` is `[rows, cols]`), or an error naming `op` for another shape.
    pub(crate) fn of(t: &'a Tensor, op: &str) -> Result<Rows<'a>> {
        let &[rows, cols] = t.dims() else {
            return Err(Error::shape(format!(
                "{op}: the weight must be [rows, cols], got {}",
                t.shape()
            )));
        };
        let storage = crate::storage(t)?;
        let source = match storage.panels() {
            Some(p) => Source::Panels(p),
            None => {
                let row_bytes = t.dtype().row_bytes(cols)?;
                let data = storage.bytes()?;
                if data.len() != rows * row_bytes {
                    return Err(Error::shape(format!(
                        "{op}: {} bytes for {} of {}",
                        data.len(),
                        t.shape(),
                        t.dtype()
                    )));
                }
                Source::Bytes {
                    data,
                    dtype: t.dtype(),
                    row_bytes,
                }
            }
        };
        Ok(Rows { source, rows, cols })
    }

    /// `(rows, cols)`.
    pub(crate) fn dims(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }

    /// Row `r` decoded into `dst` (`cols` values), as `quant::dequantize` decodes it.
    pub(crate) fn decode(&self, r: usize, dst: &mut [f32]) -> Result<()> {
        if r >= self.rows || dst.len() != self.cols {
            return Err(Error::shape(format!(
                "row {r} of {} into {} values",
                self.rows,
                dst.len()
            )));
        }
        match &self.source {
            Source::Panels(p) => p.dequantize_row(r, dst),
            Source::Bytes {
                data,
                dtype,
                row_bytes,
            } => quant::dequantize(*dtype, &data[r * row_bytes..(r + 1) * row_bytes], dst),
        }
    }

    /// Rows `r0..r0 + rows` decoded into `buf` (grown where it is smaller, an error
    /// rather than an abort where memory cannot hold it), rows in tasks on `pool`;
    /// returns the decoded `[rows, cols]` values at its start.
    pub(crate) fn decode_range_into<'b>(
        &self,
        pool: &Pool,
        r0: usize,
        rows: usize,
        buf: &'b mut Vec<f32>,
    ) -> Result<&'b [f32]> {
        let len = rows * self.cols;
        if buf.len() < len {
            buf.try_reserve_exact(len - buf.len()).map_err(|_| {
                Error::Device(format!(
                    "cannot allocate {} bytes of CPU memory to decode {rows} rows of a [{}, {}] weight",
                    len * 4,
                    self.rows,
                    self.cols
                ))
            })?;
            buf.resize(len, 0f32);
        }
        let out = &mut buf[..len];
        if len == 0 {
            return Ok(out);
        }
        const ROWS_PER_TASK: usize = 64;
        let failed = Mutex::new(None);
        pool.for_chunks_mut(out, ROWS_PER_TASK * self.cols, |c, chunk| {
            for (i, row) in chunk.chunks_exact_mut(self.cols).enumerate() {
                if let Err(e) = self.decode(r0 + c * ROWS_PER_TASK + i, row) {
                    *failed.lock().unwrap_or_else(|e| e.into_inner()) = Some(e);
                    return;
                }
            }
        });
        match failed.into_inner().unwrap_or_else(|e| e.into_inner()) {
            Some(e) => Err(e),
            None => Ok(out),
        }
    }
}

/// The error for reading a weight in panels as plain bytes: a kernel that does not know
/// the layout was handed one.
fn in_panels(p: &Panels) -> Error {
    Error::Device(format!(
        "{p:?} is in the CPU's interleaved layout, which this op does not read"
    ))
}

impl Storage for CpuStorage {
    fn device(&self) -> Device {
        Device::Cpu
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}
