use kiln_core::{Device, Error, HostBytes, Result, Storage};
use std::any::Any;

/// CPU tensor data: owned (4-byte aligned, which every block type needs), or host bytes
/// used in place, such as a tensor in a memory-mapped model file.
#[derive(Debug)]
pub enum CpuStorage {
    Owned { words: Vec<u32>, len: usize },
    Shared(HostBytes),
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
        owned.bytes_mut().copy_from_slice(bytes.as_slice());
        owned
    }

    pub fn bytes(&self) -> &[u8] {
        match self {
            CpuStorage::Owned { words, len } => &bytemuck::cast_slice(words)[..*len],
            CpuStorage::Shared(b) => b.as_slice(),
        }
    }

    /// Writable bytes. Shared data is copied first (copy on write): weights mapped from a
    /// file stay in place because nothing writes them, while outputs can be uploaded.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        if let CpuStorage::Shared(b) = self {
            let mut owned = CpuStorage::zeroed(b.len());
            owned.bytes_mut().copy_from_slice(b.as_slice());
            *self = owned;
        }
        match self {
            CpuStorage::Owned { words, len } => &mut bytemuck::cast_slice_mut(words)[..*len],
            CpuStorage::Shared(_) => unreachable!("made owned above"),
        }
    }
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
