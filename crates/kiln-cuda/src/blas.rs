//! cuBLAS in kiln-cuda: the handle of the backend's stream, how F32 products are computed
//! (`GradOps::set_products`), the 16-bit copies of F32 operands that products share, and
//! the F32-operand products of training and the frozen paths (`sgemm`, batched and
//! strided, rounding their operands to 16 bits when asked). Products with weights in
//! their stored formats are `matmul`'s.

use crate::kernels::Arg;
use crate::{to_i32, CudaBackend};
use cudarc::cublas::{result as blas, sys as blas_sys};
use cudarc::driver::CudaStream;
use kiln_core::{Error, Products, Result};
use std::sync::{Arc, Mutex};

pub(crate) struct Blas {
    handle: Mutex<BlasHandle>,
    /// How F32 products are computed (`GradOps::set_products`): an index into
    /// [`F32_COMPUTE`].
    f32_products: std::sync::atomic::AtomicU8,
    /// What each of the two 16-bit work buffers of [`f32_gemm`] holds, and (third) the
    /// last rounded copy `GradOps::rounded_for_products` made, which a product of the same
    /// operand reads too (training's forward product over the input the tape keeps).
    half_copies: Mutex<[Option<HalfCopy>; 3]>,
}

/// An F32 operand rounded to 16 bits in a work buffer, and the stream's `queued` count
/// right after the product that read it: while nothing else has been queued, neither the
/// operand nor the buffer has changed, and the next product over the same operand (the
/// key and value projections after the query's, a weight gradient after its input
/// gradient) reads the buffer instead of rounding again.
#[derive(Clone, Copy, PartialEq)]
struct HalfCopy {
    src: u64,
    span: usize,
    bf16: bool,
    dst: u64,
    queued_at: u64,
}

impl Blas {
    /// `dst` now holds the F32 `span` at `src` rounded (BF16 or F16), made by the op
    /// queued last (count `queued`); the copies made before it stay whole (it wrote only
    /// `dst`).
    pub(crate) fn note_rounded_copy(
        &self,
        src: u64,
        span: usize,
        bf16: bool,
        dst: u64,
        queued: u64,
    ) {
        let mut copies = self.half_copies.lock().expect("half copies lock");
        for h in copies.iter_mut().flatten() {
            if h.queued_at + 1 == queued {
                h.queued_at = queued;
            }
        }
        copies[2] = Some(HalfCopy {
            src,
            span,
            bf16,
            dst,
            queued_at: queued,
        });
    }
}

impl Blas {
    /// The address of a rounded copy of the F32 `span` at `src` that is still whole
    /// (nothing has been queued since the op that made or last read it: `now`).
    pub(crate) fn rounded_copy_of(
        &self,
        src: u64,
        span: usize,
        bf16: bool,
        now: u64,
    ) -> Option<u64> {
        self.half_copies
            .lock()
            .expect("half copies lock")
            .iter()
            .flatten()
            .find(|h| h.src == src && h.span == span && h.bf16 == bf16 && h.queued_at == now)
            .map(|h| h.dst)
    }
}

/// The arithmetic of F32 products, in [`Products`]' order.
const PRODUCTS: [Products; 4] = [Products::F32, Products::Tf32, Products::Bf16, Products::F16];

impl Blas {
    pub(crate) fn set_f32_products(&self, how: Products) {
        let i = PRODUCTS.iter().position(|&p| p == how).unwrap_or(0);
        self.f32_products
            .store(i as u8, std::sync::atomic::Ordering::Relaxed);
    }

    pub(crate) fn f32_products(&self) -> Products {
        PRODUCTS[self.f32_products.load(std::sync::atomic::Ordering::Relaxed) as usize]
    }

    /// The cuBLAS handle, held while a call is queued on the stream.
    pub(crate) fn handle(&self) -> std::sync::MutexGuard<'_, BlasHandle> {
        self.handle.lock().expect("cuBLAS lock")
    }
}

pub(crate) struct BlasHandle(pub(crate) blas_sys::cublasHandle_t);

// The handle is used under the mutex only, from whichever thread holds it.
unsafe impl Send for BlasHandle {}

impl Drop for BlasHandle {
    fn drop(&mut self) {
        let _ = unsafe { blas::destroy_handle(self.0) };
    }
}

impl Blas {
    pub(crate) fn new(stream: &Arc<CudaStream>) -> Result<Blas> {
        if !unsafe { blas_sys::is_culib_present() } {
            return Err(Error::Device(
                "cuBLAS (libcublas.so) cannot be loaded".to_string(),
            ));
        }
        let handle = blas::create_handle().map_err(|e| Error::Device(format!("cuBLAS: {e:?}")))?;
        unsafe { blas::set_stream(handle, stream.cu_stream() as _) }
            .map_err(|e| Error::Device(format!("cuBLAS: {e:?}")))?;
        let blas = Blas {
            handle: Mutex::new(BlasHandle(handle)),
            f32_products: std::sync::atomic::AtomicU8::new(0),
            half_copies: Mutex::new([None; 3]),
        };
        // Opt-in, as PyTorch's `allow_tf32`: F32 products (F32 weights, and every product
        // of training) on tensor cores with TF32 inputs (10-bit mantissas), F32 sums.
        if std::env::var("KILN_CUDA_TF32").is_ok_and(|v| v.trim() == "1") {
            blas.set_f32_products(Products::Tf32);
        }
        Ok(blas)
    }
}

/// cuBLAS's operation for "use the transpose" (`t`) or not.
fn blas_op(t: bool) -> blas_sys::cublasOperation_t {
    if t {
        blas_sys::cublasOperation_t::CUBLAS_OP_T
    } else {
        blas_sys::cublasOperation_t::CUBLAS_OP_N
    }
}

/// `c = a·b + beta·c` in cuBLAS's column-major terms (`ta`/`tb`: use the transpose of
/// `a`/`b`), F32: the products of the backward kernels (see `grad`).
pub(crate) fn sgemm(
    b: &CudaBackend,
    t: (bool, bool),
    dims: (usize, usize, usize),
    a: (u64, usize),
    bm: (u64, usize),
    beta: f32,
    c: (u64, usize),
) -> Result<()> {
    product(b, t, dims, (a.0, a.1, false), bm, beta, c)
}

/// [`sgemm`] with `a` 16-bit already, rounded as the products round their operands (BF16
/// or F16 products only): `b` is rounded as usual.
pub(crate) fn sgemm_rounded_a(
    b: &CudaBackend,
    t: (bool, bool),
    dims: (usize, usize, usize),
    a: (u64, usize),
    bm: (u64, usize),
    beta: f32,
    c: (u64, usize),
) -> Result<()> {
    product(b, t, dims, (a.0, a.1, true), bm, beta, c)
}

fn product(
    b: &CudaBackend,
    (ta, tb): (bool, bool),
    (m, n, k): (usize, usize, usize),
    (a, lda, a_rounded): (u64, usize, bool),
    (bm, ldb): (u64, usize),
    beta: f32,
    (c, ldc): (u64, usize),
) -> Result<()> {
    if m == 0 || n == 0 {
        return Ok(());
    }
    let i = |v: usize| to_i32(v, "a product's size");
    f32_gemm(
        b,
        (blas_op(ta), blas_op(tb)),
        (i(m)?, i(n)?, i(k)?),
        (a, i(lda)?, a_rounded),
        (bm, i(ldb)?),
        beta,
        (c, i(ldc)?),
    )
}

/// One operand of [`sgemm_batched`]: device address, leading dimension, and the stride
/// (in elements) from one product's matrix to the next's.
pub(crate) struct Strided {
    pub at: u64,
    pub ld: usize,
    pub stride: usize,
}

/// `count` products of [`sgemm`]'s form in one cuBLAS call, the i-th over `a`, `b` and
/// `c` advanced by i strides: the backward of attention runs a product for every head
/// of a KV group at once. F32 operands: F32 products are F32, the others TF32. With
/// `half` (whether BF16), `a` and `b` are 16-bit operands the caller rounded (addresses,
/// leading dimensions and strides in their elements), summed in F32; `c` is F32 always.
#[allow(clippy::too_many_arguments)]
pub(crate) fn sgemm_batched(
    b: &CudaBackend,
    half: Option<bool>,
    (ta, tb): (bool, bool),
    (m, n, k): (usize, usize, usize),
    a: Strided,
    bm: Strided,
    beta: f32,
    c: Strided,
    count: usize,
) -> Result<()> {
    use blas_sys::cublasComputeType_t as Compute;
    if m == 0 || n == 0 || count == 0 {
        return Ok(());
    }
    let i = |v: usize| to_i32(v, "a product's size");
    let stride = |v: usize| {
        i64::try_from(v).map_err(|_| Error::shape(format!("a product's stride {v} does not fit")))
    };
    let (alpha, f32_type) = (1.0f32, blas_sys::cudaDataType::CUDA_R_32F);
    let (in_type, compute) = match (half, b.blas.f32_products()) {
        (Some(true), _) => (
            blas_sys::cudaDataType::CUDA_R_16BF,
            Compute::CUBLAS_COMPUTE_32F,
        ),
        (Some(false), _) => (
            blas_sys::cudaDataType::CUDA_R_16F,
            Compute::CUBLAS_COMPUTE_32F,
        ),
        (None, Products::F32) => (f32_type, Compute::CUBLAS_COMPUTE_32F),
        (None, _) => (f32_type, Compute::CUBLAS_COMPUTE_32F_FAST_TF32),
    };
    let handle = b.blas.handle();
    b.queued_other_work();
    unsafe {
        blas::gemm_strided_batched_ex(
            handle.0,
            blas_op(ta),
            blas_op(tb),
            i(m)?,
            i(n)?,
            i(k)?,
            &alpha as *const f32 as *const _,
            a.at as *const _,
            in_type,
            i(a.ld)?,
            stride(a.stride)?,
            bm.at as *const _,
            in_type,
            i(bm.ld)?,
            stride(bm.stride)?,
            &beta as *const f32 as *const _,
            c.at as *mut _,
            f32_type,
            i(c.ld)?,
            stride(c.stride)?,
            i(count)?,
            compute,
            blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(|e| Error::Device(format!("cuBLAS batched GEMM {count} x {m}x{n}x{k}: {e:?}")))
}

/// `span` F32 values at `src` rounded to BF16 (or F16) into work buffer `slot`; its
/// address.
pub(crate) fn rounded_copy(
    b: &CudaBackend,
    slot: &'static str,
    src: u64,
    span: usize,
    bf16: bool,
) -> Result<u64> {
    if !src.is_multiple_of(16) {
        return Err(Error::unsupported(format!(
            "a 16-bit product over an operand at {src:#x} (it reads 16-byte aligned F32)"
        )));
    }
    let dst = b.scratch(slot, 2 * span.max(1))?;
    round_into(b, src, dst, span, bf16)?;
    Ok(dst)
}

/// `span` F32 values at `src` rounded to BF16 (or F16) into `dst`.
pub(crate) fn round_into(
    b: &CudaBackend,
    src: u64,
    dst: u64,
    span: usize,
    bf16: bool,
) -> Result<()> {
    b.launch_1d(
        "f32_to_half",
        span.div_ceil(4),
        &[
            Arg::Ptr(src),
            Arg::Ptr(dst),
            Arg::U64(span as u64),
            Arg::I32(bf16 as i32),
        ],
    )
}

/// The stored operand of a column-major product rounded to BF16 (or F16) into the scratch
/// `slot`: `rows` × `cols` (op(A) = A when `trans` is N) with leading dimension `ld`, the
/// whole span it covers converted so the same `ld` addresses the copy (or one of `known`,
/// copies made before that still hold this operand); whether it was rounded now.
fn half_operand(
    b: &CudaBackend,
    slot: usize,
    (p, ld): (u64, i32),
    trans: blas_sys::cublasOperation_t,
    (rows, cols): (i32, i32),
    bf16: bool,
    known: [Option<HalfCopy>; 2],
) -> Result<(HalfCopy, bool)> {
    let (r, c) = match trans {
        blas_sys::cublasOperation_t::CUBLAS_OP_N => (rows, cols),
        _ => (cols, rows),
    };
    let span = if c == 0 {
        0
    } else {
        ld as usize * (c as usize - 1) + r as usize
    };
    if let Some(h) = known
        .into_iter()
        .flatten()
        .find(|h| h.src == p && h.span == span && h.bf16 == bf16)
    {
        return Ok((h, false));
    }
    let dst = rounded_copy(b, ["half_a", "half_b"][slot], p, span, bf16)?;
    let fresh = HalfCopy {
        src: p,
        span,
        bf16,
        dst,
        queued_at: 0,
    };
    Ok((fresh, true))
}

/// An F32 product through cuBLAS (column-major terms, as [`sgemm`]), in the arithmetic
/// `GradOps::set_products` chose. cuBLAS takes TF32 as a compute type over F32 operands,
/// but BF16 and F16 only from operands of that type (its FAST_16BF and FAST_16F compute
/// types over F32 operands ran its TF32 kernels on an H200, to the bit), so those
/// products first round both operands into work buffers.
pub(crate) fn f32_gemm(
    b: &CudaBackend,
    (ta, tb): (blas_sys::cublasOperation_t, blas_sys::cublasOperation_t),
    (m, n, k): (i32, i32, i32),
    (a, lda, a_rounded): (u64, i32, bool),
    (bm, ldb): (u64, i32),
    beta: f32,
    (c, ldc): (u64, i32),
) -> Result<()> {
    use blas_sys::cublasComputeType_t as Compute;
    let alpha = 1.0f32;
    let f32_type = blas_sys::cudaDataType::CUDA_R_32F;
    let mut rounded = None;
    let (a, bm, in_type, compute) = match b.blas.f32_products() {
        Products::F32 | Products::Tf32 if a_rounded => {
            return Err(Error::unsupported(
                "a 16-bit operand in a product over F32 (rounded operands are for BF16 and F16 products)",
            ))
        }
        Products::F32 => (a, bm, f32_type, Compute::CUBLAS_COMPUTE_32F),
        Products::Tf32 => (a, bm, f32_type, Compute::CUBLAS_COMPUTE_32F_FAST_TF32),
        half @ (Products::Bf16 | Products::F16) => {
            let bf16 = half == Products::Bf16;
            // Which copies are still whole is decided before either rounding is queued.
            let now = b.queued.load(std::sync::atomic::Ordering::Relaxed);
            let last = b
                .blas
                .half_copies
                .lock()
                .expect("half copies lock")
                .map(|h| h.filter(|h| h.queued_at == now));
            // Each operand from its own work buffer's last copy or the kept one (never
            // the other work buffer's: its operand may be rounded over it now). A
            // rounded `a` goes in as it is.
            let ha = match a_rounded {
                true => None,
                false => Some(half_operand(b, 0, (a, lda), ta, (m, k), bf16, [last[0], last[2]])?),
            };
            let hb = half_operand(b, 1, (bm, ldb), tb, (k, n), bf16, [last[1], last[2]])?;
            // What each work buffer holds now: its new copy, or what it held.
            let held = |h: Option<(HalfCopy, bool)>, before: Option<HalfCopy>| match h {
                Some((h, true)) => Some(h),
                _ => before,
            };
            rounded = Some([held(ha, last[0]), held(Some(hb), last[1]), last[2]]);
            let (ha, hb) = (ha.map(|h| h.0), hb.0);
            (
                ha.map_or(a, |h| h.dst),
                hb.dst,
                if bf16 {
                    blas_sys::cudaDataType::CUDA_R_16BF
                } else {
                    blas_sys::cudaDataType::CUDA_R_16F
                },
                Compute::CUBLAS_COMPUTE_32F,
            )
        }
    };
    let handle = b.blas.handle();
    b.queued_other_work();
    unsafe {
        blas::gemm_ex(
            handle.0,
            ta,
            tb,
            m,
            n,
            k,
            &alpha as *const f32 as *const _,
            a as *const _,
            in_type,
            lda,
            bm as *const _,
            in_type,
            ldb,
            &beta as *const f32 as *const _,
            c as *mut _,
            f32_type,
            ldc,
            compute,
            blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(|e| Error::Device(format!("cuBLAS F32 GEMM {m}x{n}x{k}: {e:?}")))?;
    if let Some(copies) = rounded {
        let after = b.queued.load(std::sync::atomic::Ordering::Relaxed);
        *b.blas.half_copies.lock().expect("half copies lock") = copies.map(|h| {
            h.map(|h| HalfCopy {
                queued_at: after,
                ..h
            })
        });
    }
    Ok(())
}
