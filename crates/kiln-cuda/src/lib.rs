//! kiln's CUDA backend.
//!
//! Weights stay on the GPU in their stored dtype; every op of the forward pass is a kernel
//! (from `src/kernels/*.cu`, compiled with NVRTC for the GPU present and cached on disk)
//! or a cuBLAS call; everything is queued on one stream, and a decode step can be
//! recorded once as a CUDA graph and replayed. The CUDA libraries are loaded at run time:
//! the crate builds without a toolkit, and [`CudaBackend::new`] reports a clear error on
//! a machine without a driver or GPU.

mod attention;
mod attention_grad_tc;
mod attention_tc;
mod blas;
mod collective;
mod compile;
mod device;
mod elementwise;
mod frozen;
mod gemm_tc;
mod grad;
mod kernels;
mod matmul;
mod memory;
mod norm;
mod one_shot;
mod optim;
mod sample;

pub use collective::{nccl_available, Communicator, NcclId};
pub use compile::CacheOutcome;
pub use device::{copy_bandwidth, devices, peer_links, DeviceInfo, PeerLink};
pub use memory::CudaStorage;
pub use one_shot::{PeerBoard, Probe};

use cudarc::driver::{result, sys, CudaContext, CudaStream, DriverError};
use kernels::{Arg, Kernels};
use kiln_core::{
    AttentionParams, Backend, DType, Device, Error, GradOps, HostBytes, Pages, Replay, Result,
    RmsNorm, RopeLayout, SampleParams, Shape, Tensor,
};
use memory::{DeviceBuffer, Pool};
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

pub(crate) fn driver_error(e: DriverError) -> Error {
    Error::Device(format!("CUDA: {e}"))
}

/// Is there a usable NVIDIA GPU? (Driver present, at least one device.)
pub fn is_available() -> bool {
    device::device_count().is_ok_and(|n| n > 0)
}

pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    ordinal: usize,
    name: String,
    arch: (i32, i32),
    /// Streaming multiprocessors: launches that split work size it by them.
    sms: usize,
    kernels: Kernels,
    pool: Arc<Pool>,
    blas: blas::Blas,
    /// Work buffers of the ops (decoded weight tiles, rounded activations, attention
    /// partials), kept and grown, so that steady-state steps allocate nothing.
    scratch: Mutex<HashMap<&'static str, DeviceBuffer>>,
    /// Work buffers outgrown: a recorded step (a CUDA graph) may still write to them, so
    /// they are never handed to other tensors. Growth doubles, so they hold less than the
    /// buffers in use.
    outgrown: Mutex<Vec<DeviceBuffer>>,
    cache_outcome: CacheOutcome,
    /// Whether the last operation queued on the stream was one of our kernels: only then
    /// may the next kernel launch programmatically (its wait covers a kernel before it,
    /// not a copy, a memset or a library call). A library call after one of our kernels
    /// needs no fence: cuBLAS launches its kernel either the ordinary way (it starts once
    /// ours has completed) or programmatically, and then it waits for ours itself, as a
    /// kernel that may follow any early trigger must (the fence kiln had there was 1.6% of
    /// a server's decode step, and a training run without it ended on the same held-out
    /// loss to the bit).
    follows_kernel: std::sync::atomic::AtomicBool,
    /// Work queued on the stream so far (kernels, copies, library calls, and the calls
    /// of its collectives, which share it): a tag that tells whether anything ran after
    /// a given op.
    queued: Arc<std::sync::atomic::AtomicU64>,
    /// A tensor whose last writer also wrote it as int8 rows; current only while
    /// nothing else has been queued since.
    int8_copy: Mutex<Option<Int8Copy>>,
    /// What the paged attention's row and tile lists last copied into their work buffer
    /// (its address and bytes): every layer of a step uses the same lists, so only the
    /// first layer's copy is made.
    attention_rows: Mutex<Option<(u64, Vec<u8>)>>,
}

/// A tensor (address, length) also written as int8 rows (`matmul::quantized_x`), and
/// the `queued` count right after that write.
#[derive(Clone, Copy)]
struct Int8Copy {
    tensor: (u64, usize),
    queued_at: u64,
    buffers: [Arg; 2],
}

impl CudaBackend {
    /// The GPU with CUDA ordinal `ordinal`; compiles (or loads cached) kernels for it.
    pub fn new(ordinal: usize) -> Result<Self> {
        let driver = device::init_driver()?;
        let count = device::device_count()?;
        if ordinal >= count {
            return Err(Error::Device(if count == 0 {
                "the NVIDIA driver sees no GPU".to_string()
            } else {
                format!("no CUDA device {ordinal}: this machine has {count}")
            }));
        }
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            return Err(Error::Device(
                "NVRTC (libnvrtc.so) cannot be loaded: kiln compiles its kernels with it"
                    .to_string(),
            ));
        }
        let (ctx, stream) = {
            let _alone = kernels::outside_recordings();
            let ctx = CudaContext::new(ordinal).map_err(driver_error)?;
            let stream = ctx.new_stream().map_err(driver_error)?;
            (ctx, stream)
        };
        let arch = ctx.compute_capability().map_err(driver_error)?;
        let name = ctx.name().map_err(driver_error)?;
        let max_shared = ctx
            .attribute(
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            )
            .map_err(driver_error)?;
        let sms = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(driver_error)? as usize;
        let (cubin, cache_outcome) = compile::kernels_for(arch, driver)?;
        // Programmatic dependent launch from Hopper on; KILN_NO_PDL=1 turns it off (to
        // measure what it brings).
        let programmatic = arch.0 >= 9 && std::env::var_os("KILN_NO_PDL").is_none_or(|v| v != "1");
        let kernels = match Kernels::load(&cubin, max_shared, programmatic) {
            Ok(k) => k,
            Err(e) if cache_outcome == CacheOutcome::Hit => {
                // A cached binary the driver refuses: drop it and compile afresh.
                tracing::warn!("{e}; compiling the kernels again");
                if let Some(p) = compile::cache_path(arch, driver)? {
                    let _ = std::fs::remove_file(p);
                }
                Kernels::load(
                    &compile::kernels_for(arch, driver)?.0,
                    max_shared,
                    programmatic,
                )?
            }
            Err(e) => return Err(e),
        };
        let blas = blas::Blas::new(&stream)?;
        Ok(CudaBackend {
            pool: Pool::new(ctx.clone()),
            ctx,
            stream,
            ordinal,
            name,
            arch,
            sms,
            kernels,
            blas,
            scratch: Mutex::new(HashMap::new()),
            outgrown: Mutex::new(Vec::new()),
            cache_outcome,
            follows_kernel: std::sync::atomic::AtomicBool::new(false),
            queued: Arc::new(std::sync::atomic::AtomicU64::new(0)),
            int8_copy: Mutex::new(None),
            attention_rows: Mutex::new(None),
        })
    }

    /// Whether the kernels came from the disk cache this time.
    pub fn kernel_cache_outcome(&self) -> CacheOutcome {
        self.cache_outcome
    }

    /// Free and total bytes of GPU memory.
    pub fn memory_info(&self) -> Result<(usize, usize)> {
        self.ctx.bind_to_thread().map_err(driver_error)?;
        result::mem_get_info().map_err(driver_error)
    }

    /// Wait for every queued op to finish.
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(driver_error)
    }

    pub(crate) fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(driver_error)
    }

    pub(crate) fn launch(
        &self,
        name: &'static str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        shared: u32,
        args: &[Arg],
    ) -> Result<()> {
        self.bind()?;
        self.queued.fetch_add(1, Ordering::Relaxed);
        let programmatic = self.follows_kernel.swap(true, Ordering::Relaxed);
        self.kernels.launch(
            self.stream.cu_stream(),
            name,
            grid,
            block,
            shared,
            args,
            programmatic,
        )
    }

    /// Record that something other than one of our kernels was queued on the stream.
    /// `n` F32 words at device address `at` set to `value`, by a memset: a training step's
    /// gradients that start as zeros (~50 MB each) filled at ~4x the rate of the
    /// one-value-a-thread kernel this replaced.
    pub(crate) fn fill_words(&self, at: u64, n: usize, value: f32) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        self.bind()?;
        self.queued_other_work();
        unsafe { sys::cuMemsetD32Async(at, value.to_bits(), n, self.stream.cu_stream()) }
            .result()
            .map_err(driver_error)
    }

    pub(crate) fn queued_other_work(&self) {
        self.queued.fetch_add(1, Ordering::Relaxed);
        self.follows_kernel.store(false, Ordering::Relaxed);
    }

    /// The op just queued also wrote the F32 `span` at `src` rounded to BF16 (`bf16`) or
    /// F16 at `dst` (and wrote nothing else): a 16-bit product that reads `src` before
    /// anything else is queued takes the copy instead of rounding again.
    pub(crate) fn note_rounded_copy(&self, src: u64, span: usize, bf16: bool, dst: u64) {
        let queued = self.queued.load(Ordering::Relaxed);
        self.blas.note_rounded_copy(src, span, bf16, dst, queued);
    }

    /// The op just queued also wrote `t` as int8 rows into `int8`.
    pub(crate) fn note_int8_copy(&self, t: &Tensor, int8: [Arg; 2]) -> Result<()> {
        *self.int8_copy.lock().expect("int8 copy lock") = Some(Int8Copy {
            tensor: (ptr(t)?, t.shape().numel()),
            queued_at: self.queued.load(Ordering::Relaxed),
            buffers: int8,
        });
        Ok(())
    }

    /// `x` as int8 rows, if the op that wrote it also wrote those and nothing has been
    /// queued since (so neither `x` nor the buffers changed).
    pub(crate) fn int8_copy(&self, x: &Tensor) -> Result<Option<[Arg; 2]>> {
        let tensor = (ptr(x)?, x.shape().numel());
        let now = self.queued.load(Ordering::Relaxed);
        let copy = *self.int8_copy.lock().expect("int8 copy lock");
        Ok(copy
            .filter(|c| c.tensor == tensor && c.queued_at == now)
            .map(|c| c.buffers))
    }

    /// A 1-D launch over `n` elements.
    pub(crate) fn launch_1d(&self, name: &'static str, n: usize, args: &[Arg]) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let blocks = n.div_ceil(256);
        let blocks = u32::try_from(blocks)
            .map_err(|_| Error::shape(format!("{n} elements are too many for one launch")))?;
        self.launch(name, (blocks, 1, 1), (256, 1, 1), 0, args)
    }

    /// A work buffer of at least `bytes`, reused across calls under `slot`.
    pub(crate) fn scratch(&self, slot: &'static str, bytes: usize) -> Result<u64> {
        let mut scratch = self.scratch.lock().expect("scratch lock");
        if let Some(b) = scratch.get(slot).filter(|b| b.capacity() >= bytes) {
            return Ok(b.ptr);
        }
        let bytes = match scratch.get(slot) {
            Some(old) => bytes.max(2 * old.capacity()),
            None => bytes,
        };
        let b = self.pool.alloc(bytes)?;
        let ptr = b.ptr;
        if let Some(old) = scratch.insert(slot, b) {
            self.outgrown.lock().expect("outgrown lock").push(old);
        }
        Ok(ptr)
    }

    fn alloc_tensor(&self, dtype: DType, shape: Shape) -> Result<Tensor> {
        let bytes = shape
            .rows()
            .checked_mul(dtype.row_bytes(shape.row_len())?)
            .ok_or_else(|| Error::shape(format!("{shape} of {dtype} overflows")))?;
        let buf = self.pool.alloc(bytes)?;
        Ok(Tensor::from_storage(
            Box::new(CudaStorage {
                buf: Arc::new(buf),
                offset: 0,
                bytes,
                ordinal: self.ordinal,
            }),
            dtype,
            shape,
        ))
    }
}

pub(crate) fn storage(t: &Tensor) -> Result<&CudaStorage> {
    t.storage()
        .as_any()
        .downcast_ref::<CudaStorage>()
        .ok_or_else(|| {
            Error::Device(format!(
                "a tensor on {} given to the CUDA backend",
                t.device()
            ))
        })
}

/// The device address of a tensor's data.
pub(crate) fn ptr(t: &Tensor) -> Result<u64> {
    Ok(storage(t)?.ptr())
}

pub(crate) fn expect(t: &Tensor, dtype: DType, what: &str) -> Result<()> {
    if t.dtype() != dtype {
        return Err(Error::unsupported(format!(
            "{what} must be {dtype}, not {}",
            t.dtype()
        )));
    }
    Ok(())
}

pub(crate) fn same_shape(a: &Tensor, b: &Tensor, op: &str) -> Result<()> {
    if a.shape() != b.shape() {
        return Err(Error::shape(format!(
            "{op}: {} and {} differ",
            a.shape(),
            b.shape()
        )));
    }
    Ok(())
}

pub(crate) fn to_i32(v: usize, what: &str) -> Result<i32> {
    i32::try_from(v)
        .map_err(|_| Error::shape(format!("{what} of {v} is too large for the GPU kernels")))
}

impl Backend for CudaBackend {
    fn device(&self) -> Device {
        Device::Cuda(self.ordinal)
    }

    fn describe(&self) -> String {
        format!("{} (sm_{}{})", self.name, self.arch.0, self.arch.1)
    }

    fn zeros(&self, dtype: DType, shape: Shape) -> Result<Tensor> {
        let t = self.alloc_tensor(dtype, shape)?;
        let bytes = storage(&t)?.bytes;
        if bytes > 0 {
            self.bind()?;
            self.queued_other_work();
            unsafe { result::memset_d8_async(ptr(&t)?, 0, bytes, self.stream.cu_stream()) }
                .map_err(driver_error)?;
        }
        Ok(t)
    }

    /// No fill: a gradient's first op writes all of it.
    fn empty(&self, dtype: DType, shape: Shape) -> Result<Tensor> {
        self.alloc_tensor(dtype, shape)
    }

    fn upload(&self, dtype: DType, shape: Shape, data: HostBytes) -> Result<Tensor> {
        let want = shape.rows() * dtype.row_bytes(shape.row_len())?;
        if data.len() != want {
            return Err(Error::shape(format!(
                "{shape} of {dtype} takes {want} bytes, got {}",
                data.len()
            )));
        }
        let t = self.alloc_tensor(dtype, shape)?;
        if want > 0 {
            let split = kiln_core::quant::gpu_layout::split(dtype, data.as_slice());
            let bytes = split.as_deref().unwrap_or(data.as_slice());
            self.bind()?;
            // On our stream, so that the kernels queued after it see the bytes: a
            // synchronous copy from pageable memory goes through the legacy stream and
            // may return before the bytes land, and our stream does not wait for it.
            // The synchronize keeps `data` alive until the copy is done.
            self.queued_other_work();
            unsafe { result::memcpy_htod_async(ptr(&t)?, bytes, self.stream.cu_stream()) }
                .map_err(driver_error)?;
            self.stream.synchronize().map_err(driver_error)?;
        }
        Ok(t)
    }

    fn upload_together(&self, parts: Vec<(DType, Shape, HostBytes)>) -> Result<Vec<Tensor>> {
        // End to end only where one product can read them as one matrix: 16-bit weights
        // of one type and row length, each a whole number of 256-byte pieces (so that
        // every part stays aligned for cuBLAS when read alone).
        let first = parts.first().map(|(d, s, _)| (*d, s.row_len()));
        let together = parts.len() > 1
            && matches!(first, Some((DType::F16 | DType::BF16, _)))
            && parts.iter().all(|(d, s, data)| {
                Some((*d, s.row_len())) == first
                    && s.dims().len() == 2
                    && !data.is_empty()
                    && data.len().is_multiple_of(256)
            });
        if !together {
            return parts
                .into_iter()
                .map(|(dtype, shape, data)| self.upload(dtype, shape, data))
                .collect();
        }
        let mut total = 0usize;
        for (dtype, shape, data) in &parts {
            let want = shape.rows() * dtype.row_bytes(shape.row_len())?;
            if data.len() != want {
                return Err(Error::shape(format!(
                    "{shape} of {dtype} takes {want} bytes, got {}",
                    data.len()
                )));
            }
            total += want;
        }
        let buf = Arc::new(self.pool.alloc(total)?);
        self.bind()?;
        self.queued_other_work();
        let mut tensors = Vec::with_capacity(parts.len());
        let mut offset = 0u64;
        for (dtype, shape, data) in &parts {
            // On our stream, as `upload` copies; the synchronize below keeps `parts` alive
            // until every copy is done, also when a copy fails after others were queued.
            let copied = unsafe {
                result::memcpy_htod_async(
                    buf.ptr + offset,
                    data.as_slice(),
                    self.stream.cu_stream(),
                )
            };
            if let Err(e) = copied {
                let _ = self.stream.synchronize();
                return Err(driver_error(e));
            }
            tensors.push(Tensor::from_storage(
                Box::new(CudaStorage {
                    buf: buf.clone(),
                    offset,
                    bytes: data.len(),
                    ordinal: self.ordinal,
                }),
                *dtype,
                shape.clone(),
            ));
            offset += data.len() as u64;
        }
        self.stream.synchronize().map_err(driver_error)?;
        Ok(tensors)
    }

    fn download(&self, t: &Tensor) -> Result<Vec<u8>> {
        let s = storage(t)?;
        let mut out = vec![0u8; s.bytes];
        if s.bytes > 0 {
            self.bind()?;
            // Queued on our stream (after the kernels that wrote `t`), then waited for.
            self.queued_other_work();
            unsafe { result::memcpy_dtoh_async(&mut out, s.ptr(), self.stream.cu_stream()) }
                .map_err(driver_error)?;
            self.stream.synchronize().map_err(driver_error)?;
        }
        Ok(kiln_core::quant::gpu_layout::join(t.dtype(), &out).unwrap_or(out))
    }

    fn write(&self, t: &mut Tensor, data: &[u8]) -> Result<()> {
        let s = storage(t)?;
        if data.len() != s.bytes {
            return Err(Error::shape(format!(
                "writing {} bytes into a tensor of {} bytes",
                data.len(),
                s.bytes
            )));
        }
        if !data.is_empty() {
            let split = kiln_core::quant::gpu_layout::split(t.dtype(), data);
            let bytes = split.as_deref().unwrap_or(data);
            self.bind()?;
            // From pageable memory the driver stages the bytes before returning.
            self.queued_other_work();
            unsafe { result::memcpy_htod_async(s.ptr(), bytes, self.stream.cu_stream()) }
                .map_err(driver_error)?;
        }
        Ok(())
    }

    fn fill(&self, t: &mut Tensor, value: f32) -> Result<()> {
        expect(t, DType::F32, "fill")?;
        self.fill_words(ptr(t)?, t.shape().numel(), value)
    }

    fn matmul(&self, x: &Tensor, w: &Tensor, out: &mut Tensor) -> Result<()> {
        matmul::matmul(self, x, w, out, false)
    }

    fn embedding(&self, table: &Tensor, ids: &Tensor, out: &mut Tensor) -> Result<()> {
        matmul::embedding(self, table, ids, out)
    }

    fn rms_norm(&self, x: &Tensor, weight: &Tensor, eps: f32, out: &mut Tensor) -> Result<()> {
        norm::rms_norm(self, x, weight, eps, out)
    }

    fn layer_norm(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: &Tensor,
        eps: f32,
        out: &mut Tensor,
    ) -> Result<()> {
        norm::layer_norm(self, x, weight, bias, eps, out)
    }

    fn softmax(&self, x: &mut Tensor) -> Result<()> {
        norm::softmax(self, x)
    }

    fn rope(
        &self,
        x: &mut Tensor,
        pos: &Tensor,
        inv_freq: &Tensor,
        layout: RopeLayout,
    ) -> Result<()> {
        elementwise::rope(self, x, pos, inv_freq, layout)
    }

    fn add_assign(&self, acc: &mut Tensor, x: &Tensor) -> Result<()> {
        elementwise::broadcast_assign(self, "add_assign", acc, x)
    }

    fn mul_assign(&self, acc: &mut Tensor, x: &Tensor) -> Result<()> {
        elementwise::broadcast_assign(self, "mul_assign", acc, x)
    }

    fn scale(&self, x: &mut Tensor, s: f32) -> Result<()> {
        elementwise::in_place(self, "scale", x, Some(s))
    }

    fn silu_mul(&self, gate: &Tensor, up: &Tensor, out: &mut Tensor) -> Result<()> {
        elementwise::gated(self, "silu_mul", gate, up, out)
    }

    fn gelu_mul(&self, gate: &Tensor, up: &Tensor, out: &mut Tensor) -> Result<()> {
        elementwise::gated(self, "gelu_mul", gate, up, out)
    }

    fn gelu(&self, x: &mut Tensor) -> Result<()> {
        elementwise::in_place(self, "gelu", x, None)
    }

    fn softcap(&self, x: &mut Tensor, cap: f32) -> Result<()> {
        elementwise::in_place(self, "softcap", x, Some(cap))
    }

    fn write_rows(&self, src: &Tensor, dst: &mut Tensor, pos: &Tensor) -> Result<()> {
        elementwise::write_rows(self, src, dst, pos)
    }

    fn slice_cols(&self, src: &Tensor, col0: usize, dst: &mut Tensor) -> Result<()> {
        elementwise::slice_cols(self, src, col0, dst)
    }

    fn attention(
        &self,
        q: &Tensor,
        k_cache: &Tensor,
        v_cache: &Tensor,
        pos: &Tensor,
        params: &AttentionParams,
        out: &mut Tensor,
    ) -> Result<()> {
        attention::attention(self, q, k_cache, v_cache, pos, params, out)
    }

    fn paged_attention(
        &self,
        q: &Tensor,
        k_pool: &Tensor,
        v_pool: &Tensor,
        pos: &Tensor,
        pages: &Pages,
        params: &AttentionParams,
        out: &mut Tensor,
    ) -> Result<()> {
        attention::paged_attention(self, q, k_pool, v_pool, pos, pages, params, out)
    }

    fn argmax(&self, x: &Tensor, out: &mut Tensor) -> Result<()> {
        elementwise::argmax(self, x, out)
    }

    fn sample(
        &self,
        logits: &mut Tensor,
        penalized: &[u32],
        params: &SampleParams,
        out: &mut Tensor,
    ) -> Result<()> {
        sample::sample(self, logits, penalized, params, out)
    }

    fn sample_rows(
        &self,
        logits: &mut Tensor,
        draws: &[kiln_core::RowDraw<'_>],
    ) -> Result<Vec<u32>> {
        sample::sample_rows(self, logits, draws)
    }

    fn matmul_add(
        &self,
        x: &Tensor,
        w: &Tensor,
        acc: &mut Tensor,
        _tmp: &mut Tensor,
    ) -> Result<()> {
        matmul::matmul(self, x, w, acc, true)
    }

    fn matmul_many(&self, x: &Tensor, ws: &[&Tensor], outs: &mut [&mut Tensor]) -> Result<()> {
        matmul::matmul_many(self, x, ws, outs)
    }

    fn rms_norm_matmul_many(
        &self,
        norm: &RmsNorm,
        normed: &mut Tensor,
        ws: &[&Tensor],
        outs: &mut [&mut Tensor],
    ) -> Result<()> {
        matmul::rms_norm_matmul_many(self, norm, normed, ws, outs)
    }

    fn rms_norm_gated_ffn(
        &self,
        norm: &RmsNorm,
        normed: &mut Tensor,
        gate: &Tensor,
        up: &Tensor,
        gelu: bool,
        out: &mut Tensor,
        tmp_gate: &mut Tensor,
        tmp_up: &mut Tensor,
    ) -> Result<()> {
        matmul::rms_norm_gated_ffn(self, norm, normed, gate, up, gelu, out, tmp_gate, tmp_up)
    }

    fn gated_ffn(
        &self,
        x: &Tensor,
        gate: &Tensor,
        up: &Tensor,
        gelu: bool,
        out: &mut Tensor,
        tmp_gate: &mut Tensor,
        tmp_up: &mut Tensor,
    ) -> Result<()> {
        matmul::gated_ffn(self, x, gate, up, gelu, out, tmp_gate, tmp_up)
    }

    fn rope_write_kv(
        &self,
        q: &mut Tensor,
        k: &mut Tensor,
        v: &Tensor,
        pos: &Tensor,
        rows: Option<&Tensor>,
        rope: Option<(&Tensor, RopeLayout)>,
        k_cache: &mut Tensor,
        v_cache: &mut Tensor,
    ) -> Result<()> {
        elementwise::rope_write_kv(self, q, k, v, pos, rows, rope, k_cache, v_cache)
    }

    fn grad(&self) -> Option<&dyn GradOps> {
        Some(self)
    }

    fn free_memory(&self) -> Result<Option<usize>> {
        Ok(Some(self.memory_info()?.0))
    }

    fn optim(&self) -> Option<&dyn kiln_core::OptimKernels> {
        Some(self)
    }

    fn capture(&self, step: &mut dyn FnMut() -> Result<()>) -> Result<Option<Box<dyn Replay>>> {
        self.bind()?;
        let _recording = kernels::recording();
        self.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(driver_error)?;
        self.pool.capturing.store(true, Ordering::Relaxed);
        let recorded = step();
        self.pool.capturing.store(false, Ordering::Relaxed);
        // End the capture whatever happened, or the stream stays unusable.
        let graph = self
            .stream
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .map_err(driver_error);
        recorded?;
        let graph = graph?.ok_or_else(|| Error::Device("the recorded step was empty".into()))?;
        graph.upload().map_err(driver_error)?;
        Ok(Some(Box::new(CudaReplay { graph })))
    }
}

/// A recorded step: one CUDA graph, launched on the backend's stream.
struct CudaReplay {
    graph: cudarc::driver::CudaGraph,
}

// The graph is only launched through `&self` by its one owner (the model); CUDA allows
// launching an executable graph from any thread of its context.
unsafe impl Send for CudaReplay {}

impl Replay for CudaReplay {
    fn replay(&self) -> Result<()> {
        self.graph.launch().map_err(driver_error)
    }
}
