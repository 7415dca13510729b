use crate::panels::Panels;
use kiln_core::{Device, Error, HostBytes, Result, Storage};
use std::any::Any;

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
