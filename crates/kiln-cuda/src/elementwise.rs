//! Element-wise ops, row copies, rope and argmax.

use crate::attention::kv_index;
use crate::kernels::Arg;
use crate::{expect, ptr, same_shape, to_i32, CudaBackend};
use kiln_core::{DType, Error, Result, RopeLayout, Tensor};

/// `acc op= x`, with x the same shape as acc or one row of it.
pub(crate) fn broadcast_assign(
    b: &CudaBackend,
    kernel: &'static str,
    acc: &mut Tensor,
    x: &Tensor,
) -> Result<()> {
    expect(acc, DType::F32, kernel)?;
    expect(x, DType::F32, kernel)?;
    let (n, period) = (acc.shape().numel(), x.shape().numel());
    let row = acc.shape().row_len();
    if period != n && period != row {
        return Err(Error::shape(format!(
            "{kernel}: {} is neither {} nor one row of it",
            x.shape(),
            acc.shape()
        )));
    }
    // Four elements a thread.
    b.launch_1d(
        kernel,
        n.div_ceil(4),
        &[
            Arg::Ptr(ptr(acc)?),
            Arg::Ptr(ptr(x)?),
            Arg::U64(n as u64),
            Arg::U64(period.max(1) as u64),
        ],
    )
}

/// `x = f(x)`, with one float parameter for the kernels that take one.
pub(crate) fn in_place(
    b: &CudaBackend,
    kernel: &'static str,
    x: &mut Tensor,
    param: Option<f32>,
) -> Result<()> {
    expect(x, DType::F32, kernel)?;
    let n = x.shape().numel();
    let mut args = vec![Arg::Ptr(ptr(x)?), Arg::U64(n as u64)];
    args.extend(param.map(Arg::F32));
    b.launch_1d(kernel, n, &args)
}

/// The element count of a gated activation's operands, checked (F32, one shape).
fn gated_len(kernel: &str, gate: &Tensor, up: &Tensor, out: &Tensor) -> Result<usize> {
    for t in [gate, up, out] {
        expect(t, DType::F32, kernel)?;
    }
    same_shape(gate, up, kernel)?;
    same_shape(gate, out, kernel)?;
    Ok(out.shape().numel())
}

pub(crate) fn gated(
    b: &CudaBackend,
    kernel: &'static str,
    gate: &Tensor,
    up: &Tensor,
    out: &mut Tensor,
) -> Result<()> {
    let n = gated_len(kernel, gate, up, out)?;
    // Four elements a thread.
    b.launch_1d(
        kernel,
        n.div_ceil(4),
        &[
            Arg::Ptr(ptr(gate)?),
            Arg::Ptr(ptr(up)?),
            Arg::Ptr(ptr(out)?),
            Arg::U64(n as u64),
        ],
    )
}

/// [`gated`] (`gelu`: GELU·mul, else SiLU·mul) also writing its output rounded to BF16
/// (`bf16`) or F16 at `dst`, noted as the stream's latest rounded copy: the down
/// projection's 16-bit product reads it instead of rounding `out` again. `inputs`: where
/// gate and up go rounded too (what training keeps for the gradient), if anywhere.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gated_rounded(
    b: &CudaBackend,
    gelu: bool,
    gate: &Tensor,
    up: &Tensor,
    out: &mut Tensor,
    dst: u64,
    inputs: Option<[u64; 2]>,
    bf16: bool,
) -> Result<()> {
    let kernel = if gelu {
        "gelu_mul_keep"
    } else {
        "silu_mul_keep"
    };
    let n = gated_len(kernel, gate, up, out)?;
    let [gate_r, up_r] = inputs.unwrap_or([0, 0]);
    b.launch_1d(
        kernel,
        n.div_ceil(4),
        &[
            Arg::Ptr(ptr(gate)?),
            Arg::Ptr(ptr(up)?),
            Arg::Ptr(ptr(out)?),
            Arg::Ptr(gate_r),
            Arg::Ptr(up_r),
            Arg::Ptr(dst),
            Arg::U64(n as u64),
            Arg::I32(bf16 as i32),
        ],
    )?;
    b.note_rounded_copy(ptr(out)?, n, bf16, dst);
    Ok(())
}

fn check_positions(pos: &Tensor, n: usize, op: &str) -> Result<()> {
    expect(pos, DType::I32, &format!("{op} positions"))?;
    if pos.shape().numel() != n {
        return Err(Error::shape(format!(
            "{op}: {} positions for {n} rows",
            pos.shape().numel()
        )));
    }
    Ok(())
}

/// The row-writing kernels by KV type (kernels/kv_cache.cu), in the order of
/// [`DType::KV_CACHE`].
const WRITE_ROWS: [&str; 4] = [
    "write_rows_f32",
    "write_rows_f16",
    "write_rows_bf16",
    "write_rows_q8_0",
];
const ROPE_WRITE_KV: [&str; 4] = [
    "rope_write_kv_f32",
    "rope_write_kv_f16",
    "rope_write_kv_bf16",
    "rope_write_kv_q8_0",
];

/// Rows of `src` into rows `pos` of a KV cache: F32 rows converted to the cache's type,
/// or rows of its own type copied as stored (see `Backend::write_rows`).
pub(crate) fn write_rows(
    b: &CudaBackend,
    src: &Tensor,
    dst: &mut Tensor,
    pos: &Tensor,
) -> Result<()> {
    let kv = kv_index(dst.dtype())?;
    let rows = src.dims().first().copied().unwrap_or(1);
    let dst_rows = dst.dims().first().copied().unwrap_or(1);
    let row_len = src.shape().numel() / rows.max(1);
    if src.dtype() != DType::F32 && src.dtype() != dst.dtype() {
        return Err(Error::unsupported(format!(
            "write_rows: {} rows into a {} cache (from f32 or its own type)",
            src.dtype(),
            dst.dtype()
        )));
    }
    if rows == 0 {
        return Ok(());
    }
    if dst.shape().numel() != dst_rows * row_len || src.shape().numel() != rows * row_len {
        return Err(Error::shape(format!(
            "write_rows: rows of {} do not fit {}",
            src.shape(),
            dst.shape()
        )));
    }
    // Rows of whole blocks (a tensor of a block type holds whole blocks per row).
    let row_bytes = dst.dtype().row_bytes(row_len)?;
    check_positions(pos, rows, "write_rows")?;
    let grid = (to_i32(rows, "rows")? as u32, 1, 1);
    let (src_ptr, dst_ptr, pos_ptr) = (ptr(src)?, ptr(dst)?, ptr(pos)?);
    let dst_rows = to_i32(dst_rows, "rows")?;
    if src.dtype() == DType::F32 {
        return b.launch(
            WRITE_ROWS[kv],
            grid,
            (256, 1, 1),
            0,
            &[
                Arg::Ptr(src_ptr),
                Arg::Ptr(dst_ptr),
                Arg::Ptr(pos_ptr),
                Arg::I32(to_i32(row_len, "row length")?),
                Arg::I32(dst_rows),
            ],
        );
    }
    // Copied as stored: a Q8_0 cache's quants (a byte a value), then its scales, each
    // region laid out by rows (see kernels/kv_cache.cu); other types in one piece.
    let quant_bytes = match dst.dtype() {
        DType::Q8_0 => row_len,
        _ => row_bytes,
    };
    let mut regions = vec![(0, 0, quant_bytes)];
    if quant_bytes != row_bytes {
        regions.push((
            rows * row_len,
            dst_rows as usize * row_len,
            row_bytes - quant_bytes,
        ));
    }
    for (src_at, dst_at, bytes) in regions {
        b.launch(
            "copy_rows",
            grid,
            (256, 1, 1),
            0,
            &[
                Arg::Ptr(src_ptr + src_at as u64),
                Arg::Ptr(dst_ptr + dst_at as u64),
                Arg::Ptr(pos_ptr),
                Arg::I32(to_i32(bytes, "row bytes")?),
                Arg::I32(dst_rows),
            ],
        )?;
    }
    Ok(())
}

pub(crate) fn slice_cols(
    b: &CudaBackend,
    src: &Tensor,
    col0: usize,
    dst: &mut Tensor,
) -> Result<()> {
    expect(src, DType::F32, "slice_cols source")?;
    expect(dst, DType::F32, "slice_cols destination")?;
    let (rows, src_cols) = (src.shape().rows(), src.shape().row_len());
    let dst_cols = dst.shape().row_len();
    if dst.shape().rows() != rows || col0 + dst_cols > src_cols {
        return Err(Error::shape(format!(
            "slice_cols: columns {col0}..{} of {} into {}",
            col0 + dst_cols,
            src.shape(),
            dst.shape()
        )));
    }
    if rows == 0 {
        return Ok(());
    }
    b.launch(
        "slice_cols",
        (to_i32(rows, "rows")? as u32, 1, 1),
        (256, 1, 1),
        0,
        &[
            Arg::Ptr(ptr(src)?),
            Arg::Ptr(ptr(dst)?),
            Arg::I32(to_i32(src_cols, "columns")?),
            Arg::I32(col0 as i32),
            Arg::I32(dst_cols as i32),
        ],
    )
}

pub(crate) fn rope(
    b: &CudaBackend,
    x: &mut Tensor,
    pos: &Tensor,
    inv_freq: &Tensor,
    layout: RopeLayout,
) -> Result<()> {
    expect(x, DType::F32, "rope input")?;
    expect(inv_freq, DType::F32, "rope frequencies")?;
    let &[tokens, heads, head_dim] = x.dims() else {
        return Err(Error::shape(format!(
            "rope wants [tokens, heads, head_dim], got {}",
            x.shape()
        )));
    };
    let rot_dim = 2 * inv_freq.shape().numel();
    if rot_dim > head_dim {
        return Err(Error::shape(format!(
            "rope: {rot_dim} rotated dimensions in heads of {head_dim}"
        )));
    }
    check_positions(pos, tokens, "rope")?;
    if tokens * heads == 0 {
        return Ok(());
    }
    let rows = to_i32(tokens * heads, "rows")?;
    b.launch(
        "rope",
        ((rows as u32).div_ceil(ROPE_ROWS), 1, 1),
        (32, ROPE_ROWS, 1),
        0,
        &[
            Arg::Ptr(ptr(x)?),
            Arg::Ptr(ptr(pos)?),
            Arg::Ptr(ptr(inv_freq)?),
            Arg::I32(rows),
            Arg::I32(heads as i32),
            Arg::I32(to_i32(head_dim, "head_dim")?),
            Arg::I32(rot_dim as i32),
            Arg::I32((layout == RopeLayout::Neox) as i32),
        ],
    )
}

/// (Token, head) rows a block of `rope` and `grad_rope` turns, a warp each.
pub(crate) const ROPE_ROWS: u32 = 8;

pub(crate) fn argmax(b: &CudaBackend, x: &Tensor, out: &mut Tensor) -> Result<()> {
    expect(x, DType::F32, "argmax input")?;
    expect(out, DType::I32, "argmax output")?;
    let (rows, cols) = (x.shape().rows(), x.shape().row_len());
    if out.shape().numel() != rows {
        return Err(Error::shape(format!(
            "argmax of {} into {}",
            x.shape(),
            out.shape()
        )));
    }
    if rows == 0 || cols == 0 {
        return Ok(());
    }
    // A piece per 4096 values, at most 128 of them.
    let pieces = cols.div_ceil(4096).clamp(1, 128);
    if rows > 65_535 {
        return Err(Error::shape(format!(
            "argmax of {rows} rows: at most 65535 a launch"
        )));
    }
    let rows_i = rows as i32;
    let piece_v = b.scratch("argmax_piece_v", 4 * rows * pieces)?;
    let piece_i = b.scratch("argmax_piece_i", 4 * rows * pieces)?;
    b.launch(
        "argmax_pieces",
        (pieces as u32, rows_i as u32, 1),
        (256, 1, 1),
        0,
        &[
            Arg::Ptr(ptr(x)?),
            Arg::Ptr(piece_v),
            Arg::Ptr(piece_i),
            Arg::I32(to_i32(cols, "columns")?),
        ],
    )?;
    b.launch(
        "argmax_finish",
        (rows_i as u32, 1, 1),
        (32 * pieces.div_ceil(32) as u32, 1, 1),
        0,
        &[
            Arg::Ptr(piece_v),
            Arg::Ptr(piece_i),
            Arg::I32(pieces as i32),
            Arg::Ptr(ptr(out)?),
        ],
    )
}

/// Rope on q and k, and k, v into the caches in their type at the positions or at `rows`
/// (a paged pool's slots), in one launch (see kernels/rope.cu).
#[allow(clippy::too_many_arguments)]
pub(crate) fn rope_write_kv(
    b: &CudaBackend,
    q: &mut Tensor,
    k: &mut Tensor,
    v: &Tensor,
    pos: &Tensor,
    rows: Option<&Tensor>,
    rope: Option<(&Tensor, RopeLayout)>,
    k_cache: &mut Tensor,
    v_cache: &mut Tensor,
) -> Result<()> {
    for (t, what) in [(&*q, "q"), (&*k, "k"), (v, "v")] {
        expect(t, DType::F32, &format!("rope_write_kv {what}"))?;
    }
    let kv = kv_index(k_cache.dtype())?;
    if v_cache.dtype() != k_cache.dtype() {
        return Err(Error::unsupported(format!(
            "rope_write_kv into a {} key cache and a {} value cache (one type for both)",
            k_cache.dtype(),
            v_cache.dtype()
        )));
    }
    let (&[tokens, heads, d], &[kt, kv_heads, kd], &[cap, ch, cd]) =
        (q.dims(), k.dims(), k_cache.dims())
    else {
        return Err(Error::shape(format!(
            "rope_write_kv wants [tokens, heads, head_dim] tensors, got q {}, k {}, cache {}",
            q.shape(),
            k.shape(),
            k_cache.shape()
        )));
    };
    if kt != tokens
        || kd != d
        || v.shape() != k.shape()
        || (ch, cd) != (kv_heads, d)
        || v_cache.shape() != k_cache.shape()
    {
        return Err(Error::shape(format!(
            "rope_write_kv: q {}, k {}, v {}, caches {} / {}",
            q.shape(),
            k.shape(),
            v.shape(),
            k_cache.shape(),
            v_cache.shape()
        )));
    }
    check_positions(pos, tokens, "rope_write_kv")?;
    if let Some(r) = rows {
        check_positions(r, tokens, "rope_write_kv rows")?;
    }
    let (freq_ptr, rot_dim, neox) = match rope {
        Some((f, layout)) => {
            expect(f, DType::F32, "rope frequencies")?;
            let rot = 2 * f.shape().numel();
            if rot > d {
                return Err(Error::shape(format!(
                    "rope: {rot} rotated dimensions in heads of {d}"
                )));
            }
            (ptr(f)?, rot, layout == RopeLayout::Neox)
        }
        None => (0, 0, false),
    };
    if tokens == 0 {
        return Ok(());
    }
    b.launch(
        ROPE_WRITE_KV[kv],
        (to_i32(tokens * (heads + kv_heads), "rows")? as u32, 1, 1),
        (64, 1, 1),
        0,
        &[
            Arg::Ptr(ptr(q)?),
            Arg::Ptr(ptr(k)?),
            Arg::Ptr(ptr(v)?),
            Arg::Ptr(ptr(pos)?),
            Arg::Ptr(rows.map(ptr).transpose()?.unwrap_or(0)),
            Arg::Ptr(freq_ptr),
            Arg::Ptr(ptr(k_cache)?),
            Arg::Ptr(ptr(v_cache)?),
            Arg::I32(tokens as i32),
            Arg::I32(heads as i32),
            Arg::I32(kv_heads as i32),
            Arg::I32(to_i32(d, "head_dim")?),
            Arg::I32(rot_dim as i32),
            Arg::I32(neox as i32),
            Arg::I32(to_i32(cap, "capacity")?),
        ],
    )
}
