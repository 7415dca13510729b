//! kiln's CPU backend.
//!
//! Matrix-vector and matrix products run on ggml's block formats directly: activations
//! are quantized to Q8_0 or Q8_K (`quantize`) and multiplied with integer SIMD dot
//! products chosen at run time ([`dot`]), rows spread over kiln's own thread pool
//! ([`pool`]: the caller works too, idle workers poll before they sleep). On AVX2 and
//! AVX-512 ([`panels_by_default`]), Q4_0 and Q4_K weights are repacked at upload into
//! panels of 16 interleaved rows (`panels`), read by their own decode and prompt kernels;
//! other weights keep the file's layout, where decode takes several weight rows per loop
//! (`gemv`). Products with
//! several activation rows (prompts) use register-tiled kernels on AVX-512 (`qgemm` and
//! `kgemm` for quantized weights, `fgemm` for F32/F16/BF16, on AMX tiles where present:
//! `amx`) and the `gemm` crate for float weights elsewhere. The remaining ops are f32
//! loops, the heavier ones (SiLU, attention) compiled for AVX-512 where the CPU has it.

// The AVX-512/AMX kernel modules: on other targets only their `available() == false`
// paths are reachable, so the kernel-side items they declare go unused there.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code, unused))]
mod amx;
mod attention;
mod calibrate;
pub mod dot;
mod elementwise;
#[cfg_attr(
    not(target_arch = "x86_64"),
    allow(dead_code, unused, clippy::never_loop)
)]
mod fgemm;
#[cfg_attr(
    not(target_arch = "x86_64"),
    allow(dead_code, unused, unreachable_code)
)]
mod gemv;
mod grad;
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code, unused))]
mod kgemm;
mod matmul;
mod norm;
mod optim;
#[cfg_attr(
    not(target_arch = "x86_64"),
    allow(dead_code, unused, unreachable_code)
)]
mod panels;
pub mod peak;
mod pool;
mod profile;
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code, unused))]
mod qgemm;
mod quantize;
mod rope;
mod storage;
mod stream;

use panels::Panels;
use pool::Pool;
use profile::Profile;
pub use storage::CpuStorage;

use kiln_core::{
    AttentionParams, Backend, DType, Device, Error, GradOps, HostBytes, KernelTime, Pages, Result,
    RopeLayout, Shape, Tensor,
};

pub struct CpuBackend {
    pool: Pool,
    profile: Profile,
    /// Whether quantized weights go into the interleaved layout of [`panels`] where the
    /// kernels read one.
    panels: bool,
    /// A frozen weight decoded for a backward product over it (LoRA over a quantized
    /// model), kept between calls.
    decoded: std::sync::Mutex<Vec<f32>>,
}

/// Whether weights go into panels unless `KILN_CPU_LAYOUT` says: on every CPU with panel
/// kernels (AVX2, AVX-512). Measured faster in decode on AVX2 (Zen 3), on AVX-512 with AMX
/// (Sapphire Rapids, where the AVX-512 kernels and the AMX prompts passed their tests) and
/// on AVX-512 without AMX (Zen 5); not on Zen 4: see BENCHMARKS.md.
pub fn panels_by_default() -> bool {
    matches!(dot::isa(), dot::Isa::Avx2 | dot::Isa::Avx512Vnni)
}

impl CpuBackend {
    /// A backend running on `threads` threads, the calling one included (all cores when
    /// `None`). Weights go into panels where [`panels_by_default`] says so;
    /// `KILN_CPU_LAYOUT=file` or `=panels` decides instead.
    pub fn new(threads: Option<usize>) -> Result<Self> {
        let threads =
            threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
        let panels = match std::env::var("KILN_CPU_LAYOUT").as_deref().map(str::trim) {
            Ok("file") => false,
            Ok("panels") => true,
            _ => panels_by_default(),
        };
        Ok(CpuBackend {
            pool: Pool::new(threads)?,
            profile: Profile::from_env(),
            panels,
            decoded: Default::default(),
        })
    }

    /// This backend with every weight kept in the file's layout, read by the kernels that
    /// take it (where the CPU's interleaved layout would be chosen otherwise): for
    /// comparing the two.
    pub fn file_layout(mut self) -> Self {
        self.panels = false;
        self
    }

    pub fn threads(&self) -> usize {
        self.pool.threads()
    }

    /// The interleaved layout weights of `dtype` take on this backend, if any.
    fn panel_format(&self, dtype: DType) -> Option<panels::Format> {
        panels::Format::for_dtype(dtype).filter(|_| self.panels)
    }
}

/// The CPU storage of a tensor, or an error naming the device it is really on.
pub(crate) fn storage(t: &Tensor) -> Result<&CpuStorage> {
    t.storage()
        .as_any()
        .downcast_ref::<CpuStorage>()
        .ok_or_else(|| Error::Device(format!("tensor is on {}, not the CPU", t.device())))
}

pub(crate) fn storage_mut(t: &mut Tensor) -> Result<&mut CpuStorage> {
    let device = t.device();
    t.storage_mut()
        .as_any_mut()
        .downcast_mut::<CpuStorage>()
        .ok_or_else(|| Error::Device(format!("tensor is on {device}, not the CPU")))
}

/// An F32 tensor's values.
pub(crate) fn f32s(t: &Tensor) -> Result<&[f32]> {
    expect_f32(t)?;
    Ok(bytemuck::cast_slice(storage(t)?.bytes()?))
}

pub(crate) fn f32s_mut(t: &mut Tensor) -> Result<&mut [f32]> {
    expect_f32(t)?;
    Ok(bytemuck::cast_slice_mut(storage_mut(t)?.bytes_mut()?))
}

fn expect_f32(t: &Tensor) -> Result<()> {
    if t.dtype() != DType::F32 {
        return Err(Error::unsupported(format!(
            "this op takes f32 activations, got {}",
            t.dtype()
        )));
    }
    Ok(())
}

fn expect_i32(t: &Tensor, what: &str) -> Result<()> {
    if t.dtype() != DType::I32 {
        return Err(Error::unsupported(format!(
            "{what} must be i32, got {}",
            t.dtype()
        )));
    }
    Ok(())
}

/// The values of `t`, an I32 `[n]` tensor of ids or positions, each checked to lie in
/// `0..limit` (`out_of_range` makes the error for one that does not).
pub(crate) fn indices<'a>(
    t: &'a Tensor,
    n: usize,
    limit: usize,
    what: &str,
    out_of_range: impl Fn(i32) -> Error,
) -> Result<&'a [i32]> {
    expect_i32(t, what)?;
    if t.dims() != [n] {
        return Err(Error::shape(format!(
            "{what} must be [{n}], got {}",
            t.shape()
        )));
    }
    let v: &[i32] = bytemuck::cast_slice(storage(t)?.bytes()?);
    match v
        .iter()
        .find(|&&i| usize::try_from(i).map_or(true, |i| i >= limit))
    {
        Some(&bad) => Err(out_of_range(bad)),
        None => Ok(v),
    }
}

/// An I32 tensor's values.
pub(crate) fn i32s<'a>(t: &'a Tensor, what: &str) -> Result<&'a [i32]> {
    expect_i32(t, what)?;
    Ok(bytemuck::cast_slice(storage(t)?.bytes()?))
}

pub(crate) fn i32s_mut(t: &mut Tensor) -> Result<&mut [i32]> {
    expect_i32(t, "the output")?;
    Ok(bytemuck::cast_slice_mut(storage_mut(t)?.bytes_mut()?))
}

pub(crate) fn same_shape(a: &Tensor, b: &Tensor, op: &str) -> Result<()> {
    if a.shape() != b.shape() {
        return Err(Error::shape(format!(
            "{op}: {} vs {}",
            a.shape(),
            b.shape()
        )));
    }
    Ok(())
}

/// A product's profile label: weight type and shape, and whether it is decode's one row.
fn matmul_label(x: &Tensor, w: &Tensor) -> String {
    let rows = if x.shape().rows() == 1 {
        "1 row"
    } else {
        "rows"
    };
    format!(
        "matmul {} {}x{} ({rows})",
        w.dtype(),
        w.shape().rows(),
        w.shape().row_len()
    )
}

/// Attention's profile label, telling decode's one token (one position) from a prompt's
/// many.
fn attention_label(pos: &Tensor) -> String {
    let tokens = if pos.shape().numel() == 1 {
        "1 token"
    } else {
        "tokens"
    };
    format!("attention ({tokens})")
}

impl Backend for CpuBackend {
    fn device(&self) -> Device {
        Device::Cpu
    }

    fn describe(&self) -> String {
        let amx = if amx::bf16_available() { "+amx" } else { "" };
        format!(
            "cpu ({} threads, {}{amx})",
            self.threads(),
            dot::isa().name()
        )
    }

    fn zeros(&self, dtype: DType, shape: Shape) -> Result<Tensor> {
        let bytes = shape
            .rows()
            .checked_mul(dtype.row_bytes(shape.row_len())?)
            .ok_or_else(|| Error::shape(format!("{shape} of {dtype} does not fit in memory")))?;
        let storage = match self.panel_format(dtype) {
            Some(format) => {
                CpuStorage::Panels(Panels::zeroed(format, shape.rows(), shape.row_len())?)
            }
            None => CpuStorage::try_zeroed(bytes)?,
        };
        Ok(Tensor::from_storage(Box::new(storage), dtype, shape))
    }

    fn upload(&self, dtype: DType, shape: Shape, data: HostBytes) -> Result<Tensor> {
        let want = shape
            .rows()
            .checked_mul(dtype.row_bytes(shape.row_len())?)
            .ok_or_else(|| Error::shape(format!("{shape} of {dtype} does not fit in memory")))?;
        if data.len() != want {
            return Err(Error::shape(format!(
                "{shape} of {dtype} takes {want} bytes, got {}",
                data.len()
            )));
        }
        // Weights the kernels read interleaved are repacked once, here; the file's pages
        // then leave this process's memory (`release`), so only the panels stay resident.
        let storage = match self.panel_format(dtype) {
            Some(format) => {
                let panels = Panels::from_file(
                    &self.pool,
                    format,
                    shape.rows(),
                    shape.row_len(),
                    data.as_slice(),
                )?;
                data.release();
                CpuStorage::Panels(panels)
            }
            None => CpuStorage::from_host(data),
        };
        // The first weight large enough for decode's prefetch distance to matter has the
        // distance measured on this machine, before any of the model runs.
        if want >= calibrate::FROM_BYTES {
            let in_panels = matches!(storage, CpuStorage::Panels(_));
            if let Some(kind) = calibrate::stream_of(dtype, in_panels) {
                calibrate::ensure(&self.pool, kind);
            }
        }
        Ok(Tensor::from_storage(Box::new(storage), dtype, shape))
    }

    fn download(&self, t: &Tensor) -> Result<Vec<u8>> {
        match storage(t)? {
            CpuStorage::Panels(p) => Ok(p.to_file()),
            s => Ok(s.bytes()?.to_vec()),
        }
    }

    fn write(&self, t: &mut Tensor, data: &[u8]) -> Result<()> {
        let want = t.size_bytes();
        if data.len() != want {
            return Err(Error::shape(format!(
                "{} of {} takes {want} bytes, got {}",
                t.shape(),
                t.dtype(),
                data.len()
            )));
        }
        match storage_mut(t)? {
            CpuStorage::Panels(p) => p.write_file(&self.pool, data),
            s => s.bytes_mut()?.copy_from_slice(data),
        }
        Ok(())
    }

    fn fill(&self, t: &mut Tensor, value: f32) -> Result<()> {
        f32s_mut(t)?.fill(value);
        Ok(())
    }

    fn matmul(&self, x: &Tensor, w: &Tensor, out: &mut Tensor) -> Result<()> {
        self.profile.time(
            || matmul_label(x, w),
            || matmul::matmul(&self.pool, x, w, out),
        )
    }

    fn embedding(&self, table: &Tensor, ids: &Tensor, out: &mut Tensor) -> Result<()> {
        self.profile.time(
            || "embedding".into(),
            || elementwise::embedding(table, ids, out),
        )
    }

    fn rms_norm(&self, x: &Tensor, weight: &Tensor, eps: f32, out: &mut Tensor) -> Result<()> {
        self.profile.time(
            || "rms_norm".into(),
            || norm::rms_norm(&self.pool, x, weight, eps, out),
        )
    }

    fn layer_norm(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: &Tensor,
        eps: f32,
        out: &mut Tensor,
    ) -> Result<()> {
        self.profile.time(
            || "layer_norm".into(),
            || norm::layer_norm(&self.pool, x, weight, bias, eps, out),
        )
    }

    fn softmax(&self, x: &mut Tensor) -> Result<()> {
        self.profile
            .time(|| "softmax".into(), || norm::softmax(&self.pool, x))
    }

    fn rope(
        &self,
        x: &mut Tensor,
        pos: &Tensor,
        inv_freq: &Tensor,
        layout: RopeLayout,
    ) -> Result<()> {
        self.profile
            .time(|| "rope".into(), || rope::rope(x, pos, inv_freq, layout))
    }

    fn add_assign(&self, acc: &mut Tensor, x: &Tensor) -> Result<()> {
        self.profile.time(
            || "add_assign".into(),
            || elementwise::broadcast_assign(acc, x, "add", |a, b| *a += b),
        )
    }

    fn mul_assign(&self, acc: &mut Tensor, x: &Tensor) -> Result<()> {
        self.profile.time(
            || "mul_assign".into(),
            || elementwise::broadcast_assign(acc, x, "mul", |a, b| *a *= b),
        )
    }

    fn scale(&self, x: &mut Tensor, s: f32) -> Result<()> {
        self.profile.time(
            || "scale".into(),
            || {
                f32s_mut(x)?.iter_mut().for_each(|v| *v *= s);
                Ok(())
            },
        )
    }

    fn silu_mul(&self, gate: &Tensor, up: &Tensor, out: &mut Tensor) -> Result<()> {
        self.profile.time(
            || "silu_mul".into(),
            || elementwise::silu_mul(&self.pool, gate, up, out),
        )
    }

    fn gelu_mul(&self, gate: &Tensor, up: &Tensor, out: &mut Tensor) -> Result<()> {
        self.profile.time(
            || "gelu_mul".into(),
            || elementwise::gated(&self.pool, gate, up, out, "gelu_mul", elementwise::gelu),
        )
    }

    fn gelu(&self, x: &mut Tensor) -> Result<()> {
        self.profile.time(
            || "gelu".into(),
            || {
                f32s_mut(x)?
                    .iter_mut()
                    .for_each(|v| *v = elementwise::gelu(*v));
                Ok(())
            },
        )
    }

    fn softcap(&self, x: &mut Tensor, cap: f32) -> Result<()> {
        self.profile.time(
            || "softcap".into(),
            || {
                f32s_mut(x)?
                    .iter_mut()
                    .for_each(|v| *v = cap * (*v / cap).tanh());
                Ok(())
            },
        )
    }

    fn write_rows(&self, src: &Tensor, dst: &mut Tensor, pos: &Tensor) -> Result<()> {
        self.profile.time(
            || "write_rows".into(),
            || elementwise::write_rows(src, dst, pos),
        )
    }

    fn slice_cols(&self, src: &Tensor, col0: usize, dst: &mut Tensor) -> Result<()> {
        self.profile.time(
            || "slice_cols".into(),
            || elementwise::slice_cols(src, col0, dst),
        )
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
        self.profile.time(
            || attention_label(pos),
            || attention::attention(&self.pool, q, k_cache, v_cache, pos, params, out),
        )
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
        self.profile.time(
            || "attention (paged)".into(),
            || attention::paged_attention(&self.pool, q, k_pool, v_pool, pos, pages, params, out),
        )
    }

    fn optim(&self) -> Option<&dyn kiln_core::OptimKernels> {
        Some(self)
    }

    fn kernel_profile(&self) -> Option<Vec<KernelTime>> {
        self.profile.report()
    }

    fn grad(&self) -> Option<&dyn GradOps> {
        Some(self)
    }

    fn argmax(&self, x: &Tensor, out: &mut Tensor) -> Result<()> {
        self.profile
            .time(|| "argmax".into(), || elementwise::argmax(x, out))
    }
}
