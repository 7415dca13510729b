//! Device memory: a caching allocator and the storage behind kiln tensors on the GPU.
//!
//! `cuMemAlloc`/`cuMemFree` synchronise and cost tens of microseconds; a forward pass
//! that allocates per step would pay that per op. Freed buffers go back to a pool keyed
//! by size class and are handed out again. All work runs on one stream, so a buffer
//! reused by a later op is ordered after every earlier op that used it.

use crate::driver_error;
use cudarc::driver::{result, CudaContext};
use kiln_core::{Device, Error, Result, Storage};
use std::any::Any;
use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

pub(crate) struct Pool {
    ctx: Arc<CudaContext>,
    free: Mutex<HashMap<usize, Vec<u64>>>,
    /// Set while a step is being recorded: allocating then would not be replayed.
    pub(crate) capturing: AtomicBool,
}

/// Sizes are rounded up so that buffers of nearby sizes can be reused: powers of two
/// up to 1 MiB, whole MiBs above.
fn size_class(bytes: usize) -> usize {
    const MIB: usize = 1 << 20;
    if bytes <= MIB {
        bytes.next_power_of_two().max(256)
    } else {
        bytes.div_ceil(MIB) * MIB
    }
}

impl Pool {
    pub(crate) fn new(ctx: Arc<CudaContext>) -> Arc<Pool> {
        Arc::new(Pool {
            ctx,
            free: Mutex::new(HashMap::new()),
            capturing: AtomicBool::new(false),
        })
    }

    pub(crate) fn alloc(self: &Arc<Self>, bytes: usize) -> Result<DeviceBuffer> {
        if bytes == 0 {
            return Ok(DeviceBuffer {
                ptr: 0,
                class: 0,
                pool: self.clone(),
            });
        }
        let class = size_class(bytes);
        if let Some(ptr) = self
            .free
            .lock()
            .expect("pool lock")
            .get_mut(&class)
            .and_then(Vec::pop)
        {
            return Ok(DeviceBuffer {
                ptr,
                class,
                pool: self.clone(),
            });
        }
        if self.capturing.load(Ordering::Relaxed) {
            return Err(Error::Device(format!(
                "a recorded step asked for {bytes} new bytes of GPU memory (ops must allocate before recording)"
            )));
        }
        self.ctx.bind_to_thread().map_err(driver_error)?;
        let ptr = match unsafe { result::malloc_sync(class) } {
            Ok(p) => p,
            Err(_) => {
                // Give the cached buffers back to the driver and try once more.
                self.release_cached();
                unsafe { result::malloc_sync(class) }.map_err(|_| {
                    let (free, total) = result::mem_get_info().unwrap_or((0, 0));
                    Error::Device(format!(
                        "out of GPU memory: {} needed, {} free of {}",
                        human_bytes(class),
                        human_bytes(free),
                        human_bytes(total)
                    ))
                })?
            }
        };
        Ok(DeviceBuffer {
            ptr,
            class,
            pool: self.clone(),
        })
    }

    fn release_cached(&self) {
        // A cached buffer may still be in use by queued kernels (its tensor dropped after
        // they were launched); once freed, another allocation, possibly of another
        // stream, could take its memory while they run. Let the GPU finish first.
        let _ = result::ctx::synchronize();
        let mut free = self.free.lock().expect("pool lock");
        for (_, ptrs) in free.drain() {
            for p in ptrs {
                let _ = unsafe { result::free_sync(p) };
            }
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            self.release_cached();
        }
    }
}

pub(crate) fn human_bytes(b: usize) -> String {
    const GIB: f64 = (1u64 << 30) as f64;
    const MIB: f64 = (1u64 << 20) as f64;
    if b as f64 >= GIB {
        format!("{:.2} GiB", b as f64 / GIB)
    } else {
        format!("{:.1} MiB", b as f64 / MIB)
    }
}

/// A block of device memory that returns to its pool when dropped.
pub(crate) struct DeviceBuffer {
    pub(crate) ptr: u64,
    class: usize,
    pool: Arc<Pool>,
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.class > 0 {
            self.pool
                .free
                .lock()
                .expect("pool lock")
                .entry(self.class)
                .or_default()
                .push(self.ptr);
        }
    }
}

impl DeviceBuffer {
    pub(crate) fn capacity(&self) -> usize {
        self.class
    }
}

/// A tensor's bytes on one GPU: its own buffer, or its part of one that weights uploaded
/// together share ([`kiln_core::Backend::upload_together`]), `offset` bytes in.
pub struct CudaStorage {
    pub(crate) buf: Arc<DeviceBuffer>,
    pub(crate) offset: u64,
    pub(crate) bytes: usize,
    pub(crate) ordinal: usize,
}

impl CudaStorage {
    /// The device address of the tensor's first byte.
    pub(crate) fn ptr(&self) -> u64 {
        self.buf.ptr + self.offset
    }
}

impl fmt::Debug for CudaStorage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "CudaStorage(cuda:{}, {} bytes)",
            self.ordinal, self.bytes
        )
    }
}

impl Storage for CudaStorage {
    fn device(&self) -> Device {
        Device::Cuda(self.ordinal)
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}
