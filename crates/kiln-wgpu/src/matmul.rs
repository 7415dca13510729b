//! Products with weights in their stored format, and embedding lookups.
//!
//! A weight is bound as two ranges of its buffer (quants, scales) per chunk of rows, each
//! chunk within the adapter's largest binding (128 MiB on lavapipe): an 8B model's output
//! matrix is several chunks there and one on a discrete GPU. Binding offsets are rounded
//! down to the adapter's alignment and the shader steps over the difference.

use crate::elementwise::count;
use crate::kernels::{EMBEDDING, GEMM, GEMM_COOP_F16, GEMM_COOP_Q, MATVEC, MATVEC1, ROW_TO_F16};
use crate::rounded_row;
use crate::stream::Binding;
use crate::{f32_tensor, i32_tensor, storage, WgpuBackend};
use kiln_core::quant::gpu_layout;
use kiln_core::{DType, Error, Result, Tensor};

/// Rows of x up to which one pass of the matrix-vector kernel reads the weights once.
const MATVEC_MAX_ROWS: usize = 8;
/// The tensor-core tiles' workgroup memory (shaders/gemm_tiles.wgsl): two buffers of an
/// x and a w tile of 128 rows of 40 f16, and a 16×16 f32 block for each of 4 subgroups.
const TILES_WORKGROUP_BYTES: usize = 2 * 2 * 10240 + 4 * 1024;

pub(crate) fn wtype(dtype: DType) -> Result<f64> {
    Ok(match dtype {
        DType::F32 => 0.0,
        DType::F16 => 1.0,
        DType::BF16 => 2.0,
        DType::Q8_0 => 3.0,
        DType::Q4_0 => 4.0,
        DType::Q4_K => 5.0,
        DType::Q6_K => 6.0,
        DType::I32 => return Err(Error::shape("an I32 tensor is not a weight")),
    })
}

/// One chunk of a weight's rows, bound.
pub(crate) struct Chunk<'a> {
    pub row0: usize,
    pub rows: usize,
    pub quants: Binding<'a>,
    pub scales: Binding<'a>,
    pub q_base: u32,
    pub m_base: u32,
}

/// `w`'s rows in chunks that each fit one binding.
pub(crate) fn chunks<'a>(b: &WgpuBackend, w: &'a Tensor) -> Result<Vec<Chunk<'a>>> {
    let s = storage(w, "the weight")?;
    let (m, k) = (w.shape().rows(), w.shape().row_len());
    let dtype = w.dtype();
    let (q_row, m_row) = match gpu_layout::quant_span(dtype) {
        Some((_, q_len)) => {
            let blocks = k / dtype.block_size();
            (blocks * q_len, blocks * (dtype.block_bytes() - q_len))
        }
        None => (dtype.row_bytes(k).unwrap_or(0), 0),
    };
    let meta_start = m * q_row;
    let align = b.caps.storage_align.max(4) as usize;
    let max = b.caps.max_binding as usize;
    // Whole-buffer bindings when it fits: the common case, and one bind group per weight.
    if s.buffer.size() as usize <= max {
        let whole = s.binding();
        return Ok(vec![Chunk {
            row0: 0,
            rows: m,
            quants: whole,
            scales: whole,
            q_base: 0,
            m_base: count(meta_start, "weight")?,
        }]);
    }
    // Chunks of an even number of rows (so that 2-byte rows start on a word), with room
    // for the alignment slack.
    let per_chunk = (max.saturating_sub(2 * align) / q_row.max(1)) & !7;
    if per_chunk == 0 {
        return Err(Error::Device(format!(
            "a row of {k} {dtype} values is larger than this adapter's largest binding ({max} bytes)"
        )));
    }
    let bind = |start: usize, len: usize| -> (Binding<'a>, u32) {
        let at = start - start % align;
        let end = (start + len).div_ceil(4) * 4;
        (
            Binding {
                buffer: &s.buffer,
                id: s.id,
                offset: at as u64,
                size: (end - at).max(4) as u64,
            },
            (start - at) as u32,
        )
    };
    let mut out = Vec::new();
    let mut row0 = 0;
    while row0 < m {
        let rows = per_chunk.min(m - row0);
        let (quants, q_skip) = bind(row0 * q_row, rows * q_row);
        let (scales, m_skip) = if m_row == 0 {
            (quants, 0)
        } else {
            bind(meta_start + row0 * m_row, rows * m_row)
        };
        out.push(Chunk {
            row0,
            rows,
            quants,
            scales,
            q_base: q_skip / 4,
            m_base: m_skip,
        });
        row0 += rows;
    }
    Ok(out)
}

/// What a product's result becomes.
#[derive(Clone, Copy)]
pub(crate) enum Epilogue<'a> {
    /// `out = x · wᵀ`
    Store,
    /// `out += x · wᵀ`
    Add,
    /// `out = act(gate) · (x · wᵀ)`, SiLU or (when `gelu`) GELU: the gated feed-forward,
    /// one row of x only.
    Gated { gate: &'a Tensor, gelu: bool },
}

/// An RMS norm fused in front of a one-row product: x is read as rms_norm(x)·weight, and
/// `normed` (when given) receives that row.
pub(crate) struct NormFirst<'a> {
    pub weight: &'a Tensor,
    pub eps: f32,
    pub normed: Option<&'a Tensor>,
}

/// Whether the one-row kernel, which alone takes the fused forms, runs for this product.
pub(crate) fn fusable(x: &Tensor) -> bool {
    x.shape().rows() == 1 && x.shape().row_len().is_multiple_of(4)
}

/// `out = x · wᵀ` (or as `epilogue` says), with `norm` in front when given.
pub(crate) fn matmul(
    b: &WgpuBackend,
    x: &Tensor,
    w: &Tensor,
    out: &mut Tensor,
    epilogue: Epilogue,
    norm: Option<&NormFirst>,
) -> Result<()> {
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
    if let Some(form) = rounded_row::form(b, x, w)? {
        let row = rounded_row::round_row(b, x, norm, form)?;
        return rounded_row::matvec(b, &row, w, out, epilogue);
    }
    let what = "matmul";
    count(n * k, what)?;
    count(n * m, what)?;
    let constants = [("WTYPE", wtype(w.dtype())?)];
    if (matches!(epilogue, Epilogue::Gated { .. }) || norm.is_some()) && !fusable(x) {
        return Err(Error::shape(
            "fused products take one row of x, k a multiple of 4",
        ));
    }
    let xb = f32_tensor(x, "matmul input")?;
    let ob = f32_tensor(out, "matmul output")?;
    let (mode, aux) = match epilogue {
        Epilogue::Store => (0, xb),
        Epilogue::Add => (1, xb),
        Epilogue::Gated { gate, gelu } => {
            if gate.dims() != out.dims() {
                return Err(Error::shape(format!(
                    "gated product: gate {} for output {}",
                    gate.shape(),
                    out.shape()
                )));
            }
            (2 + u32::from(gelu), f32_tensor(gate, "gate")?)
        }
    };
    let (norm_w, normed, eps, write_normed) = match norm {
        Some(nf) => {
            if nf.weight.shape().numel() != k || nf.normed.is_some_and(|t| t.dims() != x.dims()) {
                return Err(Error::shape(format!(
                    "rms_norm in front of a product: weight {} for rows of {k}",
                    nf.weight.shape()
                )));
            }
            let normed = match nf.normed {
                Some(t) => f32_tensor(t, "normed row")?,
                None => ob,
            };
            (
                f32_tensor(nf.weight, "norm weight")?,
                normed,
                nf.eps,
                nf.normed.is_some(),
            )
        }
        // Unused bindings stand in with tensors already bound the same way.
        None => (xb, ob, 0.0, false),
    };
    // One row: a lane per block; up to 8 rows: weights read once for all; the tiled
    // kernel past that, on tensor cores for the weights `tensor_cores_take`.
    let small = n <= MATVEC_MAX_ROWS;
    if !small && tensor_core_tiles(b, x, w, out, mode)? {
        return Ok(());
    }
    let spec = match n {
        1 if k.is_multiple_of(4) => &MATVEC1,
        _ if small => &MATVEC,
        _ => &GEMM,
    };
    let kernel = b.kernel(spec, &constants)?;
    let rows_per_group = b.matvec_row_slots();
    for c in chunks(b, w)? {
        let (groups, groups_x) = if small {
            b.grid(c.rows.div_ceil(rows_per_group))?
        } else {
            let gx = c.rows.div_ceil(128);
            let gy = n.div_ceil(64);
            if gx > b.caps.max_groups as usize || gy > b.caps.max_groups as usize {
                return Err(Error::Device(format!(
                    "matmul of {n}×{k} by {m}×{k} needs more workgroups than this adapter launches"
                )));
            }
            ((gx as u32, gy as u32, 1), gx as u32)
        };
        let params = [
            count(k, what)?,
            count(c.rows, what)?,
            count(n, what)?,
            c.q_base,
            c.m_base,
            count(c.row0, what)?,
            count(m, what)?,
            rows_per_group as u32,
            groups_x,
            0,
            mode,
            u32::from(norm.is_some()),
            eps.to_bits(),
            u32::from(write_normed),
        ];
        let bindings = [xb, c.quants, c.scales, ob, aux, norm_w, normed];
        let used = if small { &bindings[..] } else { &bindings[..4] };
        b.stream.dispatch(&kernel, used, &params, groups)?;
    }
    Ok(())
}

/// x's rows times the weights on cooperative matrices in tiles of 128 × 128
/// (shaders/gemm_tiles.wgsl) where the adapter has them and `tensor_cores_take` the
/// weight: F16 weights read as stored, 16 bytes a load, where every chunk starts on
/// 16 bytes, other types decoded to f16 as they are loaded. x is rounded to f16 first into
/// the backend's rounding scratch, its rows padded to the tile's 128 (the extra rows are
/// read but never stored). `false`, with nothing done, where the device or the weight do
/// not suit it.
fn tensor_core_tiles(
    b: &WgpuBackend,
    x: &Tensor,
    w: &Tensor,
    out: &Tensor,
    mode: u32,
) -> Result<bool> {
    let (n, k) = (x.shape().rows(), x.shape().row_len());
    let m = w.shape().rows();
    if !tensor_cores_take(b, w.dtype(), k) {
        return Ok(false);
    }
    let parts = chunks(b, w)?;
    let as_stored = w.dtype() == DType::F16 && parts.iter().all(|c| c.q_base.is_multiple_of(4));
    let what = "matmul";
    let padded = n.div_ceil(128) * 128;
    let values = count(padded * k, what)?;
    let ob = f32_tensor(out, "matmul output")?;
    let xb = f32_tensor(x, "matmul input")?;
    let mut scratch = b.rounded_row.lock().unwrap();
    let bytes = 2 * values as usize;
    if scratch.as_ref().is_none_or(|s| (s.bytes as usize) < bytes) {
        *scratch = Some(b.alloc(bytes)?);
    }
    let xh = scratch.as_ref().unwrap().binding();
    // x's n·k values rounded as one long row (the rows past n keep whatever they held).
    let round = b.kernel(&ROW_TO_F16, &[])?;
    let (groups, groups_x) = b.grid((n * k).div_ceil(4 * 256))?;
    b.stream.dispatch(
        &round,
        &[xb, xb, xh, xh],
        &[count(n * k, what)?, 0, 0, 0, groups_x],
        groups,
    )?;
    let kernel = if as_stored {
        b.kernel(&GEMM_COOP_F16, &[])?
    } else {
        b.kernel(&GEMM_COOP_Q, &[("WTYPE", wtype(w.dtype())?)])?
    };
    for c in parts {
        let gx = c.rows.div_ceil(128);
        let gy = padded / 128;
        if gx > b.caps.max_groups as usize || gy > b.caps.max_groups as usize {
            return Err(Error::Device(format!(
                "matmul of {n}×{k} by {m}×{k} needs more workgroups than this adapter launches"
            )));
        }
        let mut params = [0u32; 11];
        params[..7].copy_from_slice(&[
            count(k, what)?,
            count(c.rows, what)?,
            count(n, what)?,
            c.q_base,
            c.m_base,
            count(c.row0, what)?,
            count(m, what)?,
        ]);
        params[10] = mode;
        b.stream.dispatch(
            &kernel,
            &[xh, c.quants, c.scales, ob],
            &params,
            (gx as u32, gy as u32, 1),
        )?;
    }
    Ok(true)
}

pub(crate) fn embedding(
    b: &WgpuBackend,
    table: &Tensor,
    ids: &Tensor,
    out: &mut Tensor,
) -> Result<()> {
    let (rows, k) = (table.shape().rows(), table.shape().row_len());
    let n = ids.shape().numel();
    if out.shape().rows() != n || out.shape().row_len() != k {
        return Err(Error::shape(format!(
            "embedding: {n} ids of a {} table into {}",
            table.shape(),
            out.shape()
        )));
    }
    let what = "embedding";
    let elements = count(n * k, what)?;
    let constants = [("WTYPE", wtype(table.dtype())?)];
    let kernel = b.kernel(&EMBEDDING, &constants)?;
    let idb = i32_tensor(ids, n, "embedding ids")?;
    let ob = f32_tensor(out, "embedding output")?;
    let (groups, groups_x) = b.grid((n * k).div_ceil(256))?;
    for c in chunks(b, table)? {
        let mut params = [0u32; 10];
        params[..9].copy_from_slice(&[
            count(k, what)?,
            count(c.rows, what)?,
            count(n, what)?,
            c.q_base,
            c.m_base,
            count(c.row0, what)?,
            elements,
            0,
            groups_x,
        ]);
        params[9] = count(rows, what)?;
        b.stream
            .dispatch(&kernel, &[idb, c.quants, c.scales, ob], &params, groups)?;
    }
    Ok(())
}

/// Whether prompts' products with `dtype` weights of rows of `k` run on the tensor-core
/// tiles (shaders/gemm_tiles.wgsl): where the adapter has cooperative matrices, f16 and the
/// tiles' workgroup memory, for F16 weights as stored and quantized blocks decoded to f16
/// (as kiln-cuda and llama.cpp decode them for their prompt GEMMs), k in the kernel's steps
/// of 32. F32 weights would lose 13 bits of every value there (on the H200, F32 fixtures'
/// prompt logits moved 2-5e-3 from transformers') and BF16 ones f16's range: those stay in
/// f32 arithmetic.
pub(crate) fn tensor_cores_take(b: &WgpuBackend, dtype: DType, k: usize) -> bool {
    b.caps.cooperative_matrices
        && b.caps.f16
        && b.caps.workgroup_memory as usize >= TILES_WORKGROUP_BYTES
        && (dtype == DType::F16 || dtype.is_quantized())
        && k >= 32
        && k.is_multiple_of(32)
}
