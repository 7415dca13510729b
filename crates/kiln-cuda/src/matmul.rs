//! `out[n, m] = x[n, k] · w[m, k]ᵀ` for every stored weight type, and the embedding
//! lookup (the other op that decodes weights).
//!
//! One row of x (decode), up to 4 over F32 weights and up to 8 over quantized ones (small
//! batches), run the matvec kernels, which read each weight once for all rows and are
//! bound by memory bandwidth. Past one row, F16/BF16 weights go to cuBLAS: the matvec
//! kernels' f32 x, read again for every weight row, took an 8B model's 8-row step to 12.4
//! ms against cuBLAS's 5.1 (H200; 4 rows 8.2 against 5.0; F32 weights, 8 rows: 21.2
//! against 18.1, 4 rows 11.3 against 12.5). Up to 64 rows (a
//! server's decode step) over quantized weights run `gemm_tc`, which decodes each weight
//! once in shared memory for tensor cores. The rest go to cuBLAS on tensor cores: F16/BF16
//! weights as stored, with x rounded to the same type; quantized weights of prompts
//! decoded to an f16 matrix first (one pass over the weights, small next to the
//! arithmetic of 65 rows and more); F32 weights through SGEMM. Q, K and V uploaded
//! together (end to end in memory) run as one product up to 128 rows; otherwise two
//! F16/BF16 weights of one shape reading one x (K and V, gate and up) go as one strided
//! batched call.

use crate::blas::{f32_gemm, sgemm_batched, Strided};
use crate::kernels::Arg;
use crate::{expect, ptr, storage, to_i32, CudaBackend};
use cudarc::cublas::{result as blas, sys as blas_sys};
use kiln_core::{DType, Error, Result, RmsNorm, Tensor};
use std::sync::Arc;

/// Rows of x up to which products over weights of `dtype` run the matvec kernels.
fn matvec_max_rows(dtype: DType) -> usize {
    match dtype {
        DType::F16 | DType::BF16 => 1,
        DType::F32 => 4,
        _ => 8,
    }
}

fn kernel_suffix(dtype: DType) -> Result<usize> {
    Ok(match dtype {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::BF16 => 2,
        DType::Q8_0 => 3,
        DType::Q4_0 => 4,
        DType::Q4_K => 5,
        DType::Q6_K => 6,
        DType::I32 => return Err(Error::unsupported("i32 weights")),
    })
}

/// Kernel names per weight type (in `kernel_suffix` order) and batch bound (1, 2, 4, 8;
/// F32 up to 4, F16 and BF16 only 1: see [`matvec_max_rows`]).
macro_rules! by_type_and_batch {
    ($op:literal) => {
        [
            by_type_and_batch!(@four $op, "f32"),
            by_type_and_batch!(@one $op, "f16"),
            by_type_and_batch!(@one $op, "bf16"),
            by_type_and_batch!(@rows $op, "q8_0"),
            by_type_and_batch!(@rows $op, "q4_0"),
            by_type_and_batch!(@rows $op, "q4_k"),
            by_type_and_batch!(@rows $op, "q6_k"),
        ]
    };
    (@rows $p:literal, $t:literal) => {
        [
            Some(concat!($p, "_", $t, "_1")),
            Some(concat!($p, "_", $t, "_2")),
            Some(concat!($p, "_", $t, "_4")),
            Some(concat!($p, "_", $t, "_8")),
        ]
    };
    (@four $p:literal, $t:literal) => {
        [
            Some(concat!($p, "_", $t, "_1")),
            Some(concat!($p, "_", $t, "_2")),
            Some(concat!($p, "_", $t, "_4")),
            None,
        ]
    };
    (@one $p:literal, $t:literal) => {
        [Some(concat!($p, "_", $t, "_1")), None, None, None]
    };
}

const MATVEC: [[Option<&str>; 4]; 7] = by_type_and_batch!("matvec");
const MATVEC3: [[Option<&str>; 4]; 7] = by_type_and_batch!("matvec3");
const GATE_UP: [[Option<&str>; 4]; 7] = by_type_and_batch!("gate_up");

fn batch_kernel(names: [Option<&'static str>; 4], n: usize) -> Result<&'static str> {
    let bound = match n {
        1 => 0,
        2 => 1,
        3 | 4 => 2,
        _ => 3,
    };
    names[bound].ok_or_else(|| Error::unsupported(format!("matvec kernels for {n} rows of x")))
}

/// A launch's grid or block size.
type Dim3 = (u32, u32, u32);

/// Warps (blockDim.y) per block of the matvec kernels.
const MATVEC_WARPS_PER_BLOCK: usize = 4;

/// The smallest block of the matvec kernels (rows not split over parts), which each of
/// them must be able to run; larger blocks are taken only where the kernel allows them.
pub(crate) const MATVEC_LEAST_THREADS: u32 = 32 * MATVEC_WARPS_PER_BLOCK as u32;

/// Weight rows a warp of the matvec and matvec3 kernels takes, and rows of each matrix a
/// gate_up warp takes (the same names in matvec.cu).
const MATVEC_ROWS_PER_WARP: usize = 2;
const GATE_UP_ROWS_PER_WARP: usize = 1;

/// 16-byte pieces a lane takes at a time along a row of k values (chunks of 8 values
/// for float weights, the `Item`s of dot_q8.cu for quantized ones).
fn items_per_row(dtype: DType, k: usize) -> usize {
    match dtype {
        DType::Q8_0 => k / 16,
        DType::Q4_0 | DType::Q4_K | DType::Q6_K => k / 32,
        DType::F32 | DType::F16 | DType::BF16 | DType::I32 => k / 8,
    }
}

/// Grid and block of a matvec launch over `rows` weight rows of `items` pieces each,
/// `per_warp` rows to a warp, by a kernel that runs blocks of up to `max_threads`. A
/// warp walks its rows with a chain of loads; with few rows (tinyllama's 2048) that
/// chain, not the bandwidth, sets the time, so short matrices split each row over up to
/// 4 warps (blockDim.z), aiming at ~6k warps in flight on the GPU, as long as each warp
/// keeps a full round of 32 pieces and the block fits the kernel (kernels with many
/// registers, such as those for 8 rows of x, may not run 512 threads).
fn matvec_shape(
    rows: usize,
    items: usize,
    per_warp: usize,
    max_threads: u32,
) -> Result<(Dim3, Dim3)> {
    let warps = rows.div_ceil(per_warp).max(1);
    let by_rows = 6144usize.div_ceil(warps).next_power_of_two();
    let by_items = (items / 32).max(1);
    let by_items = 1usize << by_items.ilog2();
    let by_limit = (max_threads / MATVEC_LEAST_THREADS).max(1) as usize;
    let parts = by_rows.min(by_items).min(by_limit).clamp(1, 4);
    let blocks = u32::try_from(warps.div_ceil(MATVEC_WARPS_PER_BLOCK))
        .map_err(|_| Error::shape(format!("{rows} rows are too many for one launch")))?;
    Ok((
        (blocks, 1, 1),
        (32, MATVEC_WARPS_PER_BLOCK as u32, parts as u32),
    ))
}

const EMBEDDING: [&str; 7] = [
    "embedding_f32",
    "embedding_f16",
    "embedding_bf16",
    "embedding_q8_0",
    "embedding_q4_0",
    "embedding_q4_k",
    "embedding_q6_k",
];

const DEQUANT_F16: [Option<&str>; 7] = [
    None,
    None,
    None,
    Some("dequant_f16_q8_0"),
    Some("dequant_f16_q4_0"),
    Some("dequant_f16_q4_k"),
    Some("dequant_f16_q6_k"),
];

/// Check `x [n, k]`, `w [m, k]`, `out [n, m]`; returns (n, m, k).
fn matmul_dims(x: &Tensor, w: &Tensor, out: &Tensor) -> Result<(usize, usize, usize)> {
    expect(x, DType::F32, "matmul input")?;
    expect(out, DType::F32, "matmul output")?;
    let (n, k) = (x.shape().rows(), x.shape().row_len());
    let (m, wk) = (w.shape().rows(), w.shape().row_len());
    if wk != k || out.shape().rows() != n || out.shape().row_len() != m {
        return Err(Error::shape(format!(
            "matmul: x {} · w {}ᵀ into {}",
            x.shape(),
            w.shape(),
            out.shape()
        )));
    }
    Ok((n, m, k))
}

fn use_matvec(n: usize, k: usize, dtype: DType) -> bool {
    n <= matvec_max_rows(dtype) && k.is_multiple_of(4)
}

/// Whether an input of `n` rows of `k` values reaches quantized weights as int8 rows
/// (the matvec kernels) rather than as f16 (`gemm_tc`, cuBLAS).
pub(crate) fn reads_int8(n: usize, k: usize) -> bool {
    use_matvec(n, k, DType::Q8_0) && k.is_multiple_of(32)
}

/// Whether an input of `n` rows of `k` values reaches weights of `dtype` rounded to 16
/// bits (the products past the matvec kernels; never F32 weights).
pub(crate) fn reads_half(n: usize, k: usize, dtype: DType) -> bool {
    dtype != DType::F32 && !use_matvec(n, k, dtype)
}

/// `out = x · wᵀ`, or `out += x · wᵀ` when `accumulate` (the matvec kernels add in
/// their epilogue, cuBLAS with beta = 1).
pub(crate) fn matmul(
    b: &CudaBackend,
    x: &Tensor,
    w: &Tensor,
    out: &mut Tensor,
    accumulate: bool,
) -> Result<()> {
    matmul_in(b, x, None, &mut HalfX::default(), w, out, accumulate)
}

/// [`matmul`] where `quantized`, when given, is x already rounded to int8 by the op
/// that made it (see [`quantized_x`]).
fn matmul_in(
    b: &CudaBackend,
    x: &Tensor,
    quantized: Option<[Arg; 2]>,
    half_x: &mut HalfX,
    w: &Tensor,
    out: &mut Tensor,
    accumulate: bool,
) -> Result<()> {
    let (n, m, k) = matmul_dims(x, w, out)?;
    if n == 0 || m == 0 {
        return Ok(());
    }
    let t = kernel_suffix(w.dtype())?;
    if use_matvec(n, k, w.dtype()) {
        return matvec(b, t, x, quantized, w, out, accumulate);
    }
    gemm(b, t, x, half_x, w, out, accumulate)
}

/// Buffers for `values` activations rounded to int8 per 32 values: the quants, then
/// one f32 scale per 32 (what the quantized matvec kernels read).
pub(crate) fn quantized_x(b: &CudaBackend, values: usize) -> Result<[Arg; 2]> {
    let units = values / 32;
    Ok([
        Arg::Ptr(b.scratch("matvec_xq", units * 32)?),
        Arg::Ptr(b.scratch("matvec_xd", units * 4)?),
    ])
}

/// The activation arguments of the matvec kernels: x itself for float weights; for
/// quantized weights x rounded to int8 per 32 values: `quantized` where the op that
/// made x wrote it, else made here.
fn matvec_input(
    b: &CudaBackend,
    dtype: DType,
    x: &Tensor,
    quantized: Option<[Arg; 2]>,
) -> Result<Vec<Arg>> {
    if !dtype.is_quantized() {
        return Ok(vec![Arg::Ptr(ptr(x)?)]);
    }
    if let Some(q) = quantized.or(b.int8_copy(x)?) {
        return Ok(q.to_vec());
    }
    let units = x.shape().numel() / 32;
    let [xq, xd] = quantized_x(b, x.shape().numel())?;
    b.launch_1d(
        "quantize_x_q8",
        units,
        &[Arg::Ptr(ptr(x)?), xq, xd, Arg::I32(to_i32(units, "units")?)],
    )?;
    Ok(vec![xq, xd])
}

fn matvec(
    b: &CudaBackend,
    t: usize,
    x: &Tensor,
    quantized: Option<[Arg; 2]>,
    w: &Tensor,
    out: &mut Tensor,
    accumulate: bool,
) -> Result<()> {
    let (n, k, m) = (x.shape().rows(), x.shape().row_len(), w.shape().rows());
    let mut args = vec![Arg::Ptr(ptr(w)?)];
    args.extend(matvec_input(b, w.dtype(), x, quantized)?);
    args.extend([
        Arg::Ptr(ptr(out)?),
        Arg::I32(to_i32(m, "rows")?),
        Arg::I32(to_i32(k, "row length")?),
        Arg::I32(n as i32),
        Arg::I32(accumulate as i32),
    ]);
    let kernel = batch_kernel(MATVEC[t], n)?;
    let (grid, block) = matvec_shape(
        m,
        items_per_row(w.dtype(), k),
        MATVEC_ROWS_PER_WARP,
        b.kernels.max_threads(kernel)?,
    )?;
    b.launch(kernel, grid, block, 0, &args)
}

/// Q, K and V of a few tokens in one launch when the three share a type; otherwise
/// one matmul each.
pub(crate) fn matmul_many(
    b: &CudaBackend,
    x: &Tensor,
    ws: &[&Tensor],
    outs: &mut [&mut Tensor],
) -> Result<()> {
    matmul_many_in(b, x, None, ws, outs)
}

/// `normed = rms_norm(x)` feeding [`matmul_many`]: for a few tokens and quantized
/// weights the norm kernel also rounds its output to int8, so no separate launch does.
pub(crate) fn rms_norm_matmul_many(
    b: &CudaBackend,
    norm: &RmsNorm,
    normed: &mut Tensor,
    ws: &[&Tensor],
    outs: &mut [&mut Tensor],
) -> Result<()> {
    let quantized = rms_norm_for(b, norm, normed, ws)?;
    matmul_many_in(b, normed, quantized, ws, outs)
}

/// The norm, with int8 output where the matvec kernels of `ws` will read it, or rounded
/// to 16 bits where the tensor-core products of `ws` will (a server's step: no rounding
/// launch before the products).
fn rms_norm_for(
    b: &CudaBackend,
    norm: &RmsNorm,
    normed: &mut Tensor,
    ws: &[&Tensor],
) -> Result<Option<[Arg; 2]>> {
    let (n, k) = (norm.x.shape().rows(), norm.x.shape().row_len());
    if reads_int8(n, k) && ws.iter().any(|w| w.dtype().is_quantized()) {
        return crate::norm::rms_norm_quantized(b, norm.x, norm.weight, norm.eps, normed).map(Some);
    }
    if let Some((dst, bf16)) = rounded_input_for(b, ws, n, k)? {
        crate::norm::rms_norm_rounded(b, (norm.x, norm.weight, norm.eps), normed, dst, bf16)?;
        return Ok(None);
    }
    crate::norm::rms_norm(b, norm.x, norm.weight, norm.eps, normed)?;
    Ok(None)
}

/// Where the op making an input of `n` rows of `k` values for products over `ws` should
/// also write it rounded, and whether to BF16: the work buffer [`HalfX`] rounds x into,
/// when every product over `ws` reads x in 16 bits and rows are whole float4 steps.
fn rounded_input_for(
    b: &CudaBackend,
    ws: &[&Tensor],
    n: usize,
    k: usize,
) -> Result<Option<(u64, bool)>> {
    let Some(first) = ws.first() else {
        return Ok(None);
    };
    if !k.is_multiple_of(4) || !ws.iter().all(|w| reads_half(n, k, w.dtype())) {
        return Ok(None);
    }
    let bf16 = first.dtype() == DType::BF16;
    Ok(Some((rounded_input_buffer(b, n * k, bf16)?, bf16)))
}

fn matmul_many_in(
    b: &CudaBackend,
    x: &Tensor,
    quantized: Option<[Arg; 2]>,
    ws: &[&Tensor],
    outs: &mut [&mut Tensor],
) -> Result<()> {
    if ws.len() != outs.len() {
        return Err(Error::shape("matmul_many: as many outputs as weights"));
    }
    let mut dims = Vec::with_capacity(ws.len());
    for (w, out) in ws.iter().zip(outs.iter()) {
        dims.push(matmul_dims(x, w, out)?);
    }
    let (n, k) = (x.shape().rows(), x.shape().row_len());
    let fused = ws.len() == 3
        && use_matvec(n, k, ws[0].dtype())
        && n > 0
        && ws.iter().all(|w| w.dtype() == ws[0].dtype());
    if !fused {
        let mut half_x = HalfX::default();
        if one_product(b, x, &mut half_x, ws, outs)? {
            return Ok(());
        }
        if let ([wq, wk, wv], [oq, ok, ov]) = (ws, &mut *outs) {
            // K and V (one shape) in one cuBLAS call where they can be.
            if pair_as_batch(b, x, &mut half_x, [wk, wv], [&**ok, &**ov])? {
                return matmul_in(b, x, quantized, &mut half_x, wq, oq, false);
            }
        }
        for (w, out) in ws.iter().zip(outs.iter_mut()) {
            matmul_in(b, x, quantized, &mut half_x, w, out, false)?;
        }
        return Ok(());
    }
    let t = kernel_suffix(ws[0].dtype())?;
    let (m0, m1, m2) = (dims[0].1, dims[1].1, dims[2].1);
    let mut args = vec![
        Arg::Ptr(ptr(ws[0])?),
        Arg::Ptr(ptr(ws[1])?),
        Arg::Ptr(ptr(ws[2])?),
        Arg::Ptr(ptr(outs[0])?),
        Arg::Ptr(ptr(outs[1])?),
        Arg::Ptr(ptr(outs[2])?),
        Arg::I32(to_i32(m0, "rows")?),
        Arg::I32(to_i32(m1, "rows")?),
        Arg::I32(to_i32(m2, "rows")?),
    ];
    args.extend(matvec_input(b, ws[0].dtype(), x, quantized)?);
    args.extend([Arg::I32(to_i32(k, "row length")?), Arg::I32(n as i32)]);
    let kernel = batch_kernel(MATVEC3[t], n)?;
    let (grid, block) = matvec_shape(
        m0 + m1 + m2,
        items_per_row(ws[0].dtype(), k),
        MATVEC_ROWS_PER_WARP,
        b.kernels.max_threads(kernel)?,
    )?;
    b.launch(kernel, grid, block, 0, &args)
}

/// Rows of x up to which [`one_product`] reads weights uploaded together as one matrix:
/// where the products stream their weights (measured 16-128 rows); past that they are
/// compute-bound and splitting the output would only add a pass.
const ONE_PRODUCT_MAX_ROWS: usize = 128;

/// `outs[i] = x · ws[i]ᵀ` as one cuBLAS product over three F16 or BF16 weights that lie
/// end to end in memory in this order (uploaded together: Q, K and V), past the few-row
/// kernels and up to [`ONE_PRODUCT_MAX_ROWS`] rows, F32 outputs: the product's rows go to
/// a work buffer and one launch splits them by columns. An 8B model's Q, K and V at 64
/// rows: 22.4 µs as Q, then K and V batched; 17.2 µs as one product
/// (scripts/gpu/qkv_products.py, H200); its 16-row step +6-7%, tinyllama's +7-9%
/// (BENCHMARKS.md). Returns whether it ran; when not, nothing was launched.
fn one_product(
    b: &CudaBackend,
    x: &Tensor,
    half_x: &mut HalfX,
    ws: &[&Tensor],
    outs: &[&mut Tensor],
) -> Result<bool> {
    let (n, k) = (x.shape().rows(), x.shape().row_len());
    let (&[w0, w1, w2], [o0, o1, o2]) = (ws, outs) else {
        return Ok(false);
    };
    let (o0, o1, o2): (&Tensor, &Tensor, &Tensor) = (o0, o1, o2);
    let dtype = w0.dtype();
    if !matches!(dtype, DType::F16 | DType::BF16)
        || n > ONE_PRODUCT_MAX_ROWS
        || use_matvec(n, k, dtype)
        || [w1, w2].iter().any(|w| w.dtype() != dtype)
        || [o0, o1, o2].iter().any(|o| o.dtype() != DType::F32)
    {
        return Ok(false);
    }
    let ms = [
        matmul_dims(x, w0, o0)?.1,
        matmul_dims(x, w1, o1)?.1,
        matmul_dims(x, w2, o2)?.1,
    ];
    if ms.iter().any(|m| !m.is_multiple_of(4)) {
        return Ok(false);
    }
    // End to end inside one upload's buffer (separate allocations may also touch).
    let buf = &storage(w0)?.buf;
    if !Arc::ptr_eq(buf, &storage(w1)?.buf) || !Arc::ptr_eq(buf, &storage(w2)?.buf) {
        return Ok(false);
    }
    let row_bytes = 2 * k as u64;
    let at = [ptr(w0)?, ptr(w1)?, ptr(w2)?];
    if at[1] != at[0] + ms[0] as u64 * row_bytes || at[2] != at[1] + ms[1] as u64 * row_bytes {
        return Ok(false);
    }
    let total: usize = ms.iter().sum();
    let bf16 = dtype == DType::BF16;
    let xh = half_x.get(b, x, bf16)?;
    let rows = b.scratch("one_product_rows", n * total * 4)?;
    let operand = |at: u64, ld: usize| Strided { at, ld, stride: 0 };
    sgemm_batched(
        b,
        Some(bf16),
        (true, false),
        (total, n, k),
        operand(at[0], k),
        operand(xh, k),
        0.0,
        operand(rows, total),
        1,
    )?;
    let cols = |m: usize| to_i32(m, "rows").map(Arg::I32);
    b.launch_1d(
        "split_cols3",
        n * total / 4,
        &[
            Arg::Ptr(rows),
            Arg::Ptr(ptr(o0)?),
            Arg::Ptr(ptr(o1)?),
            Arg::Ptr(ptr(o2)?),
            Arg::I32(to_i32(n, "rows")?),
            cols(ms[0])?,
            cols(ms[1])?,
            cols(ms[2])?,
        ],
    )?;
    Ok(true)
}

/// `outs[i] = x · ws[i]ᵀ` for two F16 or BF16 weights of one shape (K and V, gate and
/// up) as one strided batched cuBLAS call, where the matvec kernels do not take x and the
/// second weight and output lie after the first ones in memory (or both before: the pair
/// is then taken the other way round), at any distance. Two products of 1,024 rows (an
/// 8B model's K and V) each fill only part of the GPU and ran at ~0.9 TB/s through
/// split-K on a 64-row step; as one call they fill it together. Returns whether it ran;
/// when not, nothing was launched.
fn pair_as_batch(
    b: &CudaBackend,
    x: &Tensor,
    half_x: &mut HalfX,
    ws: [&Tensor; 2],
    outs: [&Tensor; 2],
) -> Result<bool> {
    let (n, k) = (x.shape().rows(), x.shape().row_len());
    let dtype = ws[0].dtype();
    let half = matches!(dtype, DType::F16 | DType::BF16);
    if !half
        || use_matvec(n, k, dtype)
        || ws[1].dtype() != dtype
        || ws[0].shape() != ws[1].shape()
        || outs[0].shape() != outs[1].shape()
    {
        return Ok(false);
    }
    let m = matmul_dims(x, ws[0], outs[0])?.1;
    matmul_dims(x, ws[1], outs[1])?;
    let (mut w, mut o) = ([ptr(ws[0])?, ptr(ws[1])?], [ptr(outs[0])?, ptr(outs[1])?]);
    if w[1] < w[0] && o[1] < o[0] {
        w.swap(0, 1);
        o.swap(0, 1);
    }
    // Strides in elements: 2-byte weights, f32 outputs.
    if w[1] <= w[0] || o[1] <= o[0] || (w[1] - w[0]) % 2 != 0 || (o[1] - o[0]) % 4 != 0 {
        return Ok(false);
    }
    let bf16 = dtype == DType::BF16;
    let xh = half_x.get(b, x, bf16)?;
    let at = |at: u64, ld: usize, stride: u64| Strided {
        at,
        ld,
        stride: stride as usize,
    };
    sgemm_batched(
        b,
        Some(bf16),
        (true, false),
        (m, n, k),
        at(w[0], k, (w[1] - w[0]) / 2),
        at(xh, k, 0),
        0.0,
        at(o[0], m, (o[1] - o[0]) / 4),
        2,
    )?;
    Ok(true)
}

/// `out = act(x · gateᵀ) * (x · upᵀ)`: for a few tokens one kernel reads the gate and
/// up rows side by side and applies the activation in its epilogue.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gated_ffn(
    b: &CudaBackend,
    x: &Tensor,
    gate: &Tensor,
    up: &Tensor,
    gelu: bool,
    out: &mut Tensor,
    tmp_gate: &mut Tensor,
    tmp_up: &mut Tensor,
) -> Result<()> {
    gated_ffn_in(b, x, None, gate, up, gelu, out, tmp_gate, tmp_up)
}

/// `normed = rms_norm(x)` feeding [`gated_ffn`], the norm writing int8 where the
/// matvec kernels read it.
#[allow(clippy::too_many_arguments)]
pub(crate) fn rms_norm_gated_ffn(
    b: &CudaBackend,
    norm: &RmsNorm,
    normed: &mut Tensor,
    gate: &Tensor,
    up: &Tensor,
    gelu: bool,
    out: &mut Tensor,
    tmp_gate: &mut Tensor,
    tmp_up: &mut Tensor,
) -> Result<()> {
    let quantized = rms_norm_for(b, norm, normed, &[gate, up])?;
    gated_ffn_in(b, normed, quantized, gate, up, gelu, out, tmp_gate, tmp_up)
}

#[allow(clippy::too_many_arguments)]
fn gated_ffn_in(
    b: &CudaBackend,
    x: &Tensor,
    quantized: Option<[Arg; 2]>,
    gate: &Tensor,
    up: &Tensor,
    gelu: bool,
    out: &mut Tensor,
    tmp_gate: &mut Tensor,
    tmp_up: &mut Tensor,
) -> Result<()> {
    let (n, m, k) = matmul_dims(x, gate, out)?;
    matmul_dims(x, up, out)?;
    if n == 0 || m == 0 {
        return Ok(());
    }
    if !(use_matvec(n, k, gate.dtype()) && gate.dtype() == up.dtype()) {
        let mut half_x = HalfX::default();
        if !pair_as_batch(b, x, &mut half_x, [gate, up], [&*tmp_gate, &*tmp_up])? {
            matmul_in(b, x, quantized, &mut half_x, gate, tmp_gate, false)?;
            matmul_in(b, x, quantized, &mut half_x, up, tmp_up, false)?;
        }
        // The down projection (of the gate's type, in practice) reads the output rounded.
        return match rounded_input_for(b, &[gate], n, m)? {
            Some((dst, bf16)) => {
                crate::elementwise::gated_rounded(b, gelu, tmp_gate, tmp_up, out, dst, None, bf16)
            }
            None => {
                let kernel = if gelu { "gelu_mul" } else { "silu_mul" };
                crate::elementwise::gated(b, kernel, tmp_gate, tmp_up, out)
            }
        };
    }
    let t = kernel_suffix(gate.dtype())?;
    let mut args = vec![Arg::Ptr(ptr(gate)?), Arg::Ptr(ptr(up)?)];
    args.extend(matvec_input(b, gate.dtype(), x, quantized)?);
    args.extend([
        Arg::Ptr(ptr(out)?),
        Arg::I32(to_i32(m, "rows")?),
        Arg::I32(to_i32(k, "row length")?),
        Arg::I32(n as i32),
        Arg::I32(gelu as i32),
    ]);
    let kernel = batch_kernel(GATE_UP[t], n)?;
    let (grid, block) = matvec_shape(
        m,
        items_per_row(gate.dtype(), k),
        GATE_UP_ROWS_PER_WARP,
        b.kernels.max_threads(kernel)?,
    )?;
    b.launch(kernel, grid, block, 0, &args)
}

/// `out (+)= x · wᵀ` through cuBLAS (beta = 1 adds to what `out` holds).
/// x rounded to f16 and to bf16 for cuBLAS, each made at most once for the GEMMs of one
/// op that all read the same x (the projections of Q, K and V; gate and up).
#[derive(Default)]
struct HalfX {
    f16: Option<u64>,
    bf16: Option<u64>,
}

/// The work buffer the products round an input of `values` into (BF16 or F16), where the
/// op making the input may write it rounded instead.
pub(crate) fn rounded_input_buffer(b: &CudaBackend, values: usize, bf16: bool) -> Result<u64> {
    b.scratch(if bf16 { "gemm_x_bf16" } else { "gemm_x_f16" }, values * 2)
}

impl HalfX {
    fn get(&mut self, b: &CudaBackend, x: &Tensor, bf16: bool) -> Result<u64> {
        let slot = if bf16 { &mut self.bf16 } else { &mut self.f16 };
        if let Some(p) = *slot {
            return Ok(p);
        }
        let n = x.shape().numel();
        // The op that wrote x may have rounded it already (a norm, the gated activation).
        let now = b.queued.load(std::sync::atomic::Ordering::Relaxed);
        if let Some(p) = b.blas.rounded_copy_of(ptr(x)?, n, bf16, now) {
            *slot = Some(p);
            return Ok(p);
        }
        let p = rounded_input_buffer(b, n, bf16)?;
        b.launch_1d(
            "f32_to_half",
            n.div_ceil(4),
            &[
                Arg::Ptr(ptr(x)?),
                Arg::Ptr(p),
                Arg::U64(n as u64),
                Arg::I32(bf16 as i32),
            ],
        )?;
        *slot = Some(p);
        Ok(p)
    }
}

fn gemm(
    b: &CudaBackend,
    t: usize,
    x: &Tensor,
    half_x: &mut HalfX,
    w: &Tensor,
    out: &mut Tensor,
    accumulate: bool,
) -> Result<()> {
    let (n, k, m) = (x.shape().rows(), x.shape().row_len(), w.shape().rows());
    let (mi, ni, ki) = (
        to_i32(m, "rows")?,
        to_i32(n, "rows")?,
        to_i32(k, "row length")?,
    );
    let (alpha, beta) = (1.0f32, if accumulate { 1.0f32 } else { 0.0 });
    let out_ptr = ptr(out)?;
    let blas_err = |e: blas::CublasError| Error::Device(format!("cuBLAS GEMM {n}x{m}x{k}: {e:?}"));
    // Column-major view: out[n, m] row-major is outᵀ (m × n) column-major, which is
    // w (stored k × m column-major, transposed) times x (k × n column-major).
    if w.dtype() == DType::F32 {
        return f32_gemm(
            b,
            (
                blas_sys::cublasOperation_t::CUBLAS_OP_T,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
            ),
            (mi, ni, ki),
            (ptr(w)?, ki, false),
            (ptr(x)?, ki),
            beta,
            (out_ptr, mi),
        );
    }
    // Half-precision inputs: bf16 weights pair with bf16 activations, all else with f16.
    let bf16 = w.dtype() == DType::BF16;
    let half_type = if bf16 {
        blas_sys::cudaDataType::CUDA_R_16BF
    } else {
        blas_sys::cudaDataType::CUDA_R_16F
    };
    let x_half = half_x.get(b, x, bf16)?;
    if crate::gemm_tc::takes(b, t, (n, m, k)) {
        return crate::gemm_tc::gemm_tc(b, t, x_half, w, out, accumulate);
    }
    let w_half = match DEQUANT_F16[t] {
        None => ptr(w)?,
        Some(kernel) => {
            let buf = b.scratch("gemm_w_f16", m * k * 2)?;
            b.launch_1d(
                kernel,
                m * k / 32,
                &[Arg::Ptr(ptr(w)?), Arg::Ptr(buf), Arg::I32(mi), Arg::I32(ki)],
            )?;
            buf
        }
    };
    let handle = b.blas.handle();
    b.queued_other_work();
    unsafe {
        blas::gemm_ex(
            handle.0,
            blas_sys::cublasOperation_t::CUBLAS_OP_T,
            blas_sys::cublasOperation_t::CUBLAS_OP_N,
            mi,
            ni,
            ki,
            &alpha as *const f32 as *const _,
            w_half as *const _,
            half_type,
            ki,
            x_half as *const _,
            half_type,
            ki,
            &beta as *const f32 as *const _,
            out_ptr as *mut _,
            blas_sys::cudaDataType::CUDA_R_32F,
            mi,
            blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(blas_err)
}

pub(crate) fn embedding(
    b: &CudaBackend,
    table: &Tensor,
    ids: &Tensor,
    out: &mut Tensor,
) -> Result<()> {
    expect(ids, DType::I32, "embedding ids")?;
    expect(out, DType::F32, "embedding output")?;
    let n = ids.shape().numel();
    let (rows, dim) = (table.shape().rows(), table.shape().row_len());
    if out.shape().rows() != n || out.shape().row_len() != dim {
        return Err(Error::shape(format!(
            "embedding: {n} ids of a {} table into {}",
            table.shape(),
            out.shape()
        )));
    }
    if n == 0 {
        return Ok(());
    }
    let t = kernel_suffix(table.dtype())?;
    b.launch(
        EMBEDDING[t],
        (to_i32(n, "ids")? as u32, 1, 1),
        (256, 1, 1),
        0,
        &[
            Arg::Ptr(ptr(table)?),
            Arg::Ptr(ptr(ids)?),
            Arg::Ptr(ptr(out)?),
            Arg::I32(to_i32(rows, "table rows")?),
            Arg::I32(to_i32(dim, "table width")?),
        ],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Blocks never pass the kernel's limit (from the least the load check allows to a
    /// full 1024), and rows are split over parts only as far as the limit allows.
    #[test]
    fn matvec_blocks_fit_the_kernel() {
        for max_threads in [128, 255, 256, 384, 480, 512, 1024] {
            for rows in [1, 7, 256, 1024, 2048, 5632, 14336, 128256] {
                for items in [1, 31, 32, 64, 128, 176, 512, 1792] {
                    let (grid, block) = matvec_shape(rows, items, 2, max_threads).unwrap();
                    let threads = block.0 * block.1 * block.2;
                    assert!(threads <= max_threads.max(MATVEC_LEAST_THREADS));
                    assert!((1..=4).contains(&block.2));
                    assert!(grid.0 as usize * MATVEC_WARPS_PER_BLOCK * 2 >= rows);
                }
            }
        }
        // tinyllama's Q/K/V (2048 + 2 x 256 rows of 2048 / 8 pieces): four parts where
        // 512 threads fit, two where 8-row kernels run 384.
        assert_eq!(matvec_shape(2560, 256, 2, 512).unwrap().1, (32, 4, 4));
        assert_eq!(matvec_shape(2560, 256, 2, 384).unwrap().1, (32, 4, 3));
    }

    /// Every row count a type takes to the matvec kernels has a kernel of each family
    /// (the .cu file builds only those), and one past it goes elsewhere.
    #[test]
    fn matvec_kernels_cover_the_rows_they_take() {
        for dtype in DType::ALL {
            let t = kernel_suffix(dtype).unwrap();
            let most = matvec_max_rows(dtype);
            for n in 1..=most {
                for family in [MATVEC, MATVEC3, GATE_UP] {
                    assert!(batch_kernel(family[t], n).is_ok(), "{dtype} n={n}");
                }
                assert!(use_matvec(n, 4096, dtype));
            }
            assert!(!use_matvec(most + 1, 4096, dtype), "{dtype}");
        }
        assert!(batch_kernel(MATVEC[kernel_suffix(DType::F16).unwrap()], 2).is_err());
        assert!(reads_half(2, 4096, DType::BF16) && !reads_half(2, 4096, DType::Q4_K));
        assert!(!reads_half(9, 4096, DType::F32) && reads_int8(8, 4096));
    }
}
