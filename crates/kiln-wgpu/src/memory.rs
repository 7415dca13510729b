//! Tensors' buffers. Every tensor is one storage buffer; quantized weights are stored split
//! (`kiln_core::quant::gpu_layout`: all quants, then all scales) so that WGSL reads them
//! as `array<u32>`. Sizes are rounded up to whole words.

use crate::stream::{Binding, Stream};
use kiln_core::{Device, Error, Result, Storage};
use std::any::Any;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

pub struct WgpuStorage {
    pub(crate) buffer: wgpu::Buffer,
    pub(crate) id: u64,
    /// Bytes of the tensor's data (the buffer may be a few bytes longer).
    pub(crate) bytes: u64,
    device: usize,
    dropped: Arc<Mutex<Vec<u64>>>,
}

impl fmt::Debug for WgpuStorage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "WgpuStorage({} bytes on wgpu:{})",
            self.bytes, self.device
        )
    }
}

impl Drop for WgpuStorage {
    fn drop(&mut self) {
        // Cached bind groups keep the buffer alive; the stream drops them at its next
        // submission.
        self.dropped.lock().unwrap().push(self.id);
    }
}

impl Storage for WgpuStorage {
    fn device(&self) -> Device {
        Device::Wgpu(self.device)
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

impl WgpuStorage {
    /// The whole buffer as a binding.
    pub(crate) fn binding(&self) -> Binding<'_> {
        Binding {
            buffer: &self.buffer,
            id: self.id,
            offset: 0,
            size: self.buffer.size(),
        }
    }
}

/// Word-rounded size of `bytes` (at least one word: wgpu refuses empty bindings).
pub(crate) fn padded(bytes: u64) -> u64 {
    bytes.div_ceil(4).max(1) * 4
}

/// A zeroed buffer of `bytes` on adapter `device` (named `adapter` in errors).
pub(crate) fn alloc(
    stream: &Stream,
    device: usize,
    adapter: &str,
    bytes: u64,
    max_buffer: u64,
) -> Result<WgpuStorage> {
    let size = padded(bytes);
    if size > max_buffer {
        return Err(Error::Device(format!(
            "a tensor of {bytes} bytes is larger than the largest buffer of wgpu:{device} \
             ({adapter}: {max_buffer} bytes): use a smaller model or a more compact weight type"
        )));
    }
    let scope = stream
        .device()
        .push_error_scope(wgpu::ErrorFilter::OutOfMemory);
    let buffer = stream.device().create_buffer(&wgpu::BufferDescriptor {
        label: None,
        size,
        usage: wgpu::BufferUsages::STORAGE
            | wgpu::BufferUsages::COPY_SRC
            | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    if let Some(e) = pollster::block_on(scope.pop()) {
        return Err(Error::Device(format!(
            "out of GPU memory on wgpu:{device} ({adapter}): allocating {bytes} bytes: {e}"
        )));
    }
    Ok(WgpuStorage {
        buffer,
        id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
        bytes,
        device,
        dropped: stream.dropped(),
    })
}

/// Write `data` at the start of `dst`, in order with the recorded ops.
pub(crate) fn write(stream: &Stream, dst: &WgpuStorage, data: &[u8]) -> Result<()> {
    if data.is_empty() {
        return Ok(());
    }
    let mut words = data.to_vec();
    words.resize(padded(data.len() as u64) as usize, 0);
    if stream.is_idle() {
        stream.queue().write_buffer(&dst.buffer, 0, &words);
        return Ok(());
    }
    // Ops recorded before this write may read the old contents: copy through a staging
    // buffer inside the encoder instead of writing ahead of them.
    let staging = stream.device().create_buffer(&wgpu::BufferDescriptor {
        label: Some("kiln upload"),
        size: words.len() as u64,
        usage: wgpu::BufferUsages::COPY_SRC,
        mapped_at_creation: true,
    });
    staging
        .slice(..)
        .get_mapped_range_mut()
        .map_err(|e| Error::Device(format!("wgpu: mapping an upload buffer: {e}")))?
        .copy_from_slice(&words);
    staging.unmap();
    stream.encode(|e| e.copy_buffer_to_buffer(&staging, 0, &dst.buffer, 0, words.len() as u64));
    Ok(())
}

/// The first `bytes` bytes of `src`, after every recorded op.
pub(crate) fn read(stream: &Stream, src: &WgpuStorage, bytes: u64) -> Result<Vec<u8>> {
    let size = padded(bytes);
    let staging = stream.device().create_buffer(&wgpu::BufferDescriptor {
        label: Some("kiln readback"),
        size,
        usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    stream.encode(|e| e.copy_buffer_to_buffer(&src.buffer, 0, &staging, 0, size));
    stream.flush()?;
    let (tx, rx) = std::sync::mpsc::channel();
    staging.map_async(wgpu::MapMode::Read, .., move |r| {
        let _ = tx.send(r);
    });
    stream.finish()?;
    match rx.recv() {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err(Error::Device(format!("wgpu: reading a buffer back: {e}"))),
        Err(_) => {
            return Err(Error::Device(
                "wgpu: reading a buffer back: the GPU never answered".to_string(),
            ))
        }
    }
    let out = staging
        .slice(..)
        .get_mapped_range()
        .map_err(|e| Error::Device(format!("wgpu: reading a buffer back: {e}")))?[..bytes as usize]
        .to_vec();
    staging.unmap();
    Ok(out)
}
