//! `out[n, m] = x[n, k] · w[m, k]ᵀ` for every weight dtype.
//!
//! Quantized weights are never expanded: each activation row is quantized once (Q8_0 for
//! Q8_0/Q4_0 weights, Q8_K for the K formats, as ggml does) and every weight row is dotted
//! with it in integer arithmetic. Weight rows are split over the thread pool; each thread
//! streams its own contiguous range of the weight matrix, which is what a memory-bound
//! matrix-vector product needs. With many activation rows each weight is reused across
//! rows and the product is compute-bound: on AVX-512 it goes to the register-tiled kernels
//! (`qgemm`, `kgemm`, `fgemm`); F32/F16/BF16 weights elsewhere go to the `gemm` crate.
//! Decode (one activation row) on AVX-512 or AVX2 goes to the several-rows kernels of
//! `gemv`; elsewhere each weight row is dotted on its own (`by_rows`).

use crate::pool::{Pool, SharedMut};
use crate::{
    amx, dot, f32s, f32s_mut, fgemm, gemv, kgemm, panels, qgemm, quantize, storage, CpuStorage,
};
use half::{bf16, f16};
use kiln_core::quant::{
    self, as_blocks, BlockQ4K, BlockQ4_0, BlockQ6K, BlockQ8K, BlockQ8_0, QK, QK_K,
};
use kiln_core::{DType, Error, Result, Tensor};

/// Activation rows from which F32/F16/BF16 products go through GEMM.
const GEMM_MIN_ROWS: usize = 8;
/// Weight rows per task on the GEMM path (F16/BF16 rows are converted to f32 a task at a
/// time, so this bounds the scratch).
const GEMM_WEIGHT_CHUNK: usize = 256;

pub(crate) fn matmul(pool: &Pool, x: &Tensor, w: &Tensor, out: &mut Tensor) -> Result<()> {
    let &[m, k] = w.dims() else {
        return Err(Error::shape(format!(
            "matmul weight must be [m, k], got {}",
            w.shape()
        )));
    };
    let n = x.shape().rows();
    if x.shape().row_len() != k || out.shape().row_len() != m || out.shape().rows() != n {
        return Err(Error::shape(format!(
            "matmul: x {} · w {}ᵀ into {}",
            x.shape(),
            w.shape(),
            out.shape()
        )));
    }
    let exact_rows = x.exact_rows();
    let xs = f32s(x)?;
    let out = f32s_mut(out)?;
    if n == 0 || m == 0 {
        return Ok(());
    }
    let w_storage = storage(w)?;
    if exact_rows && n > 1 {
        // Each row as a one-row product (see `Tensor::set_exact_rows`).
        for (x, o) in xs.chunks_exact(k).zip(out.chunks_exact_mut(m)) {
            product(pool, x, w_storage, w.dtype(), o, 1, m, k)?;
        }
        return Ok(());
    }
    product(pool, xs, w_storage, w.dtype(), out, n, m, k)
}

/// `out[n, m] = x[n, k] · w[m, k]ᵀ` on slices, the kernel chosen by weight type, layout
/// and rows.
#[allow(clippy::too_many_arguments)]
fn product(
    pool: &Pool,
    xs: &[f32],
    w: &CpuStorage,
    dtype: DType,
    out: &mut [f32],
    n: usize,
    m: usize,
    k: usize,
) -> Result<()> {
    // Weights in the interleaved layout: decode and prompts read the panels.
    if let Some(w) = w.panels() {
        return match w.format() {
            panels::Format::Q4_0 => {
                let xq = quantize::q8_0_rows(pool, xs, k)?;
                panels::matmul_q4_0(pool, w, &xq, out, n)
            }
            panels::Format::Q4K => {
                let xq = quantize::q8_k_rows(pool, xs, k)?;
                panels::matmul_q4_k(pool, w, &xq, out, n)
            }
        };
    }
    let wb = w.bytes()?;
    match dtype {
        DType::I32 => return Err(Error::unsupported("matmul weights cannot be i32")),
        // Prefill on AMX: 16-bit weights split into bf16 tiles.
        DType::F16 | DType::BF16 if n >= fgemm::MIN_ROWS && amx::bf16_available() => {
            if dtype == DType::F16 {
                fgemm::amx::matmul::<f16>(pool, cast(wb)?, xs, out, n, m, k)
            } else {
                fgemm::amx::matmul::<bf16>(pool, cast(wb)?, xs, out, n, m, k)
            }
        }
        // Prefill on AVX-512: the kernel that reads 16-bit weights where they lie.
        DType::F32 | DType::F16 | DType::BF16 if n >= fgemm::MIN_ROWS && fgemm::available() => {
            match dtype {
                DType::F32 => fgemm::matmul::<f32>(pool, cast(wb)?, xs, out, n, m, k),
                DType::F16 => fgemm::matmul::<f16>(pool, cast(wb)?, xs, out, n, m, k),
                _ => fgemm::matmul::<bf16>(pool, cast(wb)?, xs, out, n, m, k),
            }
        }
        DType::F32 | DType::F16 | DType::BF16 if n >= GEMM_MIN_ROWS => {
            gemm_f32(pool, xs, wb, dtype, out, n, m, k)
        }
        // Decode: several weight rows per loop with the prefetch interleaved (`gemv`).
        DType::F32 | DType::F16 | DType::BF16 if n == 1 && gemv::supported() => match dtype {
            DType::F32 => gemv::float::matvec::<f32>(pool, cast(wb)?, xs, out, m),
            DType::F16 => gemv::float::matvec::<f16>(pool, cast(wb)?, xs, out, m),
            _ => gemv::float::matvec::<bf16>(pool, cast(wb)?, xs, out, m),
        },
        DType::F32 => {
            let ws: &[f32] = cast(wb)?;
            by_rows(pool, out, n, m, wb, |r, i| {
                dot::dot_f32(&ws[r * k..][..k], &xs[i * k..][..k])
            });
        }
        DType::F16 => {
            let ws: &[f16] = cast(wb)?;
            by_rows(pool, out, n, m, wb, |r, i| {
                dot::dot_f16(&ws[r * k..][..k], &xs[i * k..][..k])
            });
        }
        DType::BF16 => {
            let ws: &[bf16] = cast(wb)?;
            by_rows(pool, out, n, m, wb, |r, i| {
                dot::dot_bf16(&ws[r * k..][..k], &xs[i * k..][..k])
            });
        }
        DType::Q8_0 | DType::Q4_0 => {
            let nb = k / QK;
            let xq = quantize::q8_0_rows(pool, xs, k)?;
            // Prefill: register-tiled VNNI kernel that reuses each unpacked weight block
            // across several activation rows (see `qgemm`).
            if n >= qgemm::MIN_ROWS && qgemm::available() {
                if dtype == DType::Q8_0 {
                    qgemm::matmul::<BlockQ8_0>(pool, &as_blocks(wb)?, &xq, out, n, m, k);
                } else {
                    qgemm::matmul::<BlockQ4_0>(pool, &as_blocks(wb)?, &xq, out, n, m, k);
                }
                return Ok(());
            }
            // Prompts on AVX2: the decode kernels, each group of weight rows against every
            // activation row while it is in L1.
            if n > 1 && dot::isa() == dot::Isa::Avx2 {
                if dtype == DType::Q8_0 {
                    let w = as_blocks(wb)?;
                    gemv::avx2::matmul_q8::<BlockQ8_0>(pool, &w, &xq, out, n, m, k, dot::dot_q8_0);
                } else {
                    let w = as_blocks(wb)?;
                    gemv::avx2::matmul_q8::<BlockQ4_0>(pool, &w, &xq, out, n, m, k, dot::dot_q4_0);
                }
                return Ok(());
            }
            // Decode: several weight rows per loop against the once-prepared row (`gemv`).
            if n == 1 && gemv::supported() {
                if dtype == DType::Q8_0 {
                    let w = as_blocks(wb)?;
                    gemv::q8_0::matvec::<BlockQ8_0>(pool, &w, &xq, out, m, k, dot::dot_q8_0);
                } else {
                    let w = as_blocks(wb)?;
                    gemv::q8_0::matvec::<BlockQ4_0>(pool, &w, &xq, out, m, k, dot::dot_q4_0);
                }
                return Ok(());
            }
            let xq = |i: usize| &xq[i * nb..][..nb];
            if dtype == DType::Q8_0 {
                let ws = as_blocks(wb)?;
                by_rows(pool, out, n, m, wb, |r, i| {
                    dot::dot_q8_0(&ws[r * nb..][..nb], xq(i))
                });
            } else {
                let ws = as_blocks(wb)?;
                by_rows(pool, out, n, m, wb, |r, i| {
                    dot::dot_q4_0(&ws[r * nb..][..nb], xq(i))
                });
            }
        }
        DType::Q4_K | DType::Q6_K => {
            let nb = k / QK_K;
            let xq = quantize::q8_k_rows(pool, xs, k)?;
            let xq: &[BlockQ8K] = &xq;
            // Prefill on AMX-INT8 (Q4_K), else the register-tiled VNNI kernel (`kgemm`).
            if dtype == DType::Q4_K && n >= kgemm::amx::MIN_ROWS && amx::int8_available() {
                let w = as_blocks(wb)?;
                kgemm::amx::matmul(pool, kgemm::KRows::File(&w), xq, out, n, m, k);
                return Ok(());
            }
            if n >= qgemm::MIN_ROWS && qgemm::available() {
                if dtype == DType::Q4_K {
                    let w = as_blocks(wb)?;
                    kgemm::matmul::<BlockQ4K>(pool, kgemm::KRows::File(&w), xq, out, n, m, k);
                } else {
                    let w = as_blocks(wb)?;
                    kgemm::matmul::<BlockQ6K>(pool, kgemm::KRows::File(&w), xq, out, n, m, k);
                }
                return Ok(());
            }
            if n > 1 && dot::isa() == dot::Isa::Avx2 {
                if dtype == DType::Q4_K {
                    gemv::avx2::matmul_q4k(pool, &as_blocks(wb)?, xq, out, n, m);
                } else {
                    gemv::avx2::matmul_q6k(pool, &as_blocks(wb)?, xq, out, n, m);
                }
                return Ok(());
            }
            if n == 1 && gemv::supported() {
                if dtype == DType::Q4_K {
                    gemv::k_quants::matvec_q4k(pool, &as_blocks(wb)?, xq, out, m);
                } else {
                    gemv::k_quants::matvec_q6k(pool, &as_blocks(wb)?, xq, out, m);
                }
                return Ok(());
            }
            let xq = |i: usize| &xq[i * nb..][..nb];
            if dtype == DType::Q4_K {
                let ws = as_blocks(wb)?;
                by_rows(pool, out, n, m, wb, |r, i| {
                    dot::dot_q4_k(&ws[r * nb..][..nb], xq(i))
                });
            } else {
                let ws = as_blocks(wb)?;
                by_rows(pool, out, n, m, wb, |r, i| {
                    dot::dot_q6_k(&ws[r * nb..][..nb], xq(i))
                });
            }
        }
    }
    Ok(())
}

fn cast<T: bytemuck::Pod>(bytes: &[u8]) -> Result<&[T]> {
    bytemuck::try_cast_slice(bytes)
        .map_err(|e| Error::Device(format!("misaligned weight data: {e}")))
}

/// Weight rows a thread takes at a time: enough to amortise scheduling, small enough to
/// balance the pool.
fn chunk_rows(pool: &Pool, m: usize) -> usize {
    (m / (pool.threads() * 8)).clamp(1, 64)
}

/// Fill `out[i, r] = f(r, i)` with weight rows `r` (of `w`, m rows) spread over the pool.
/// For several activation rows each weight row is used for all of them while it is in
/// cache.
fn by_rows(
    pool: &Pool,
    out: &mut [f32],
    n: usize,
    m: usize,
    w: &[u8],
    f: impl Fn(usize, usize) -> f32 + Sync,
) {
    let chunk = chunk_rows(pool, m);
    let row_bytes = w.len() / m;
    // The next row, requested before this one is read: rows of a few KiB are too short
    // for the hardware prefetcher to ramp up (Q4_K_M and F16 decode ran ~1.15x faster with
    // this on the 2-core machine, before AVX-512 decode moved to `gemv`, whose prefetch
    // interleaved with the loads does better still).
    let ahead = |r: usize| prefetch(w, (r + 1) * row_bytes, row_bytes);
    if n == 1 {
        pool.for_chunks_mut(&mut out[..m], chunk, |c, o| {
            for (j, v) in o.iter_mut().enumerate() {
                ahead(c * chunk + j);
                *v = f(c * chunk + j, 0);
            }
        });
        return;
    }
    // Compute weight-row-major, then transpose into [n, m].
    let mut t = vec![0f32; m * n];
    pool.for_chunks_mut(&mut t, chunk * n, |c, o| {
        for (j, row) in o.chunks_exact_mut(n).enumerate() {
            ahead(c * chunk + j);
            for (i, v) in row.iter_mut().enumerate() {
                *v = f(c * chunk + j, i);
            }
        }
    });
    for r in 0..m {
        for i in 0..n {
            out[i * m + r] = t[r * n + i];
        }
    }
}

/// Ask for `bytes[from..from + len]` (clamped to `bytes`) in L1; a hint, never a fault.
fn prefetch(bytes: &[u8], from: usize, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let end = (from + len).min(bytes.len());
        for off in (from..end).step_by(64) {
            // SAFETY: `off` < bytes.len(); prefetching has no other effect on memory. SSE
            // is part of x86_64.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(bytes.as_ptr().add(off) as *const i8) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (bytes, from, len);
}

/// F32/F16/BF16 weights through the `gemm` crate, single-threaded on each task's range of
/// weight rows (output columns); F16/BF16 rows are converted to f32 first.
#[allow(clippy::too_many_arguments)]
fn gemm_f32(
    pool: &Pool,
    xs: &[f32],
    wb: &[u8],
    dtype: DType,
    out: &mut [f32],
    n: usize,
    m: usize,
    k: usize,
) {
    let row_bytes = k * if dtype == DType::F32 { 4 } else { 2 };
    // What the raw `gemm` calls below rely on.
    assert!(xs.len() >= n * k && out.len() >= n * m && wb.len() >= m * row_bytes);
    let chunk = (m / (pool.threads() * 4)).clamp(16, GEMM_WEIGHT_CHUNK);
    let cols = SharedMut::new(out);
    let scratch = || {
        let len = if dtype == DType::F32 { 0 } else { chunk * k };
        vec![0f32; len]
    };
    pool.for_each_init(m.div_ceil(chunk), scratch, |scratch, c| {
        let r0 = c * chunk;
        let rows = chunk.min(m - r0);
        let src = &wb[r0 * row_bytes..(r0 + rows) * row_bytes];
        let w: &[f32] = if dtype == DType::F32 {
            bytemuck::cast_slice(src)
        } else {
            let w = &mut scratch[..rows * k];
            for (w, s) in w.chunks_exact_mut(k).zip(src.chunks_exact(row_bytes)) {
                quant::dequantize(dtype, s, w).expect("row lengths match");
            }
            w
        };
        // out[n, r0..r0 + rows] = x[n, k] · wᵀ, where wᵀ[kk, j] = w[j·k + kk].
        // SAFETY: this task alone writes columns r0..r0 + rows of out's n rows of m, and
        // every pointer/stride pair addresses only inside its slice: x is n × k (row
        // stride k), w is rows × k read transposed (column stride k), out has row stride m.
        unsafe {
            gemm::gemm(
                n,
                rows,
                k,
                cols.at(r0),
                1,
                m as isize,
                false,
                xs.as_ptr(),
                1,
                k as isize,
                w.as_ptr(),
                k as isize,
                1,
                0.0,
                1.0,
                false,
                false,
                false,
                gemm::Parallelism::None,
            );
        }
    });
}
