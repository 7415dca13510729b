use crate::{f32s, f32s_mut, i32s_mut, indices, same_shape, storage};
use kiln_core::{quant, Error, Result, Tensor};

pub(crate) fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// GELU, tanh approximation (what GPT-2's `gelu_new` and Gemma's `gelu_pytorch_tanh` use).
pub(crate) fn gelu(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x)).tanh())
}

pub(crate) fn gated(
    gate: &Tensor,
    up: &Tensor,
    out: &mut Tensor,
    op: &str,
    act: fn(f32) -> f32,
) -> Result<()> {
    same_shape(gate, up, op)?;
    same_shape(gate, out, op)?;
    let (g, u) = (f32s(gate)?, f32s(up)?);
    for ((o, &g), &u) in f32s_mut(out)?.iter_mut().zip(g).zip(u) {
        *o = act(g) * u;
    }
    Ok(())
}

/// `acc op= x` where `x` has `acc`'s shape or is one row broadcast over `acc`'s rows.
pub(crate) fn broadcast_assign(
    acc: &mut Tensor,
    x: &Tensor,
    op: &str,
    f: fn(&mut f32, f32),
) -> Result<()> {
    let row = acc.shape().row_len();
    let broadcast = x.shape().numel() == row && x.shape().row_len() == row;
    if x.shape() != acc.shape() && !broadcast {
        return Err(Error::shape(format!(
            "{op}: {} into {}",
            x.shape(),
            acc.shape()
        )));
    }
    let xs = f32s(x)?;
    let a = f32s_mut(acc)?;
    if row == 0 {
        return Ok(());
    }
    for chunk in a.chunks_mut(xs.len().max(1)) {
        chunk.iter_mut().zip(xs).for_each(|(a, &b)| f(a, b));
    }
    Ok(())
}

pub(crate) fn embedding(table: &Tensor, ids: &Tensor, out: &mut Tensor) -> Result<()> {
    let [vocab, dim] = table.dims() else {
        return Err(Error::shape(format!(
            "embedding table must be 2-D, got {}",
            table.shape()
        )));
    };
    let (vocab, dim) = (*vocab, *dim);
    let n = out.dims().first().copied().unwrap_or(0);
    if out.dims() != [n, dim] {
        return Err(Error::shape(format!(
            "embedding rows of {dim} into {}",
            out.shape()
        )));
    }
    let ids = indices(ids, n, vocab, "token ids", |id| {
        Error::shape(format!(
            "token id {id} is outside the vocabulary of {vocab}"
        ))
    })?;
    let row_bytes = table.dtype().row_bytes(dim)?;
    let data = storage(table)?.bytes();
    let dtype = table.dtype();
    for (&id, o) in ids.iter().zip(f32s_mut(out)?.chunks_exact_mut(dim.max(1))) {
        let id = id as usize;
        quant::dequantize(dtype, &data[id * row_bytes..(id + 1) * row_bytes], o)?;
    }
    Ok(())
}

pub(crate) fn write_rows(src: &Tensor, dst: &mut Tensor, pos: &Tensor) -> Result<()> {
    let dst_row: usize = dst.dims().iter().skip(1).product();
    let src_row: usize = src.dims().iter().skip(1).product();
    let rows = src.dims().first().copied().unwrap_or(1);
    let dst_rows = dst.dims().first().copied().unwrap_or(1);
    if src_row != dst_row {
        return Err(Error::shape(format!(
            "write_rows: {} into {}",
            src.shape(),
            dst.shape()
        )));
    }
    let positions = indices(pos, rows, dst_rows, "write_rows positions", |p| {
        Error::shape(format!(
            "write_rows: row {p} is outside the {dst_rows} rows of the destination"
        ))
    })?;
    let s = f32s(src)?;
    let d = f32s_mut(dst)?;
    if dst_row == 0 {
        return Ok(());
    }
    for (&p, row) in positions.iter().zip(s.chunks_exact(dst_row)) {
        d[p as usize * dst_row..][..dst_row].copy_from_slice(row);
    }
    Ok(())
}

/// The first index of each row's largest value. NaN never wins (unless first), as in
/// the sampler's argmax, so that greedy decoding on the device and on the host agree.
pub(crate) fn argmax(x: &Tensor, out: &mut Tensor) -> Result<()> {
    let &[rows, cols] = x.dims() else {
        return Err(Error::shape(format!(
            "argmax takes [rows, cols], got {}",
            x.shape()
        )));
    };
    if out.dims() != [rows] || cols == 0 || i32::try_from(cols).is_err() {
        return Err(Error::shape(format!(
            "argmax of {} into {}",
            x.shape(),
            out.shape()
        )));
    }
    let xs = f32s(x)?;
    for (row, o) in xs.chunks_exact(cols).zip(i32s_mut(out)?) {
        let mut best = 0;
        for (i, &v) in row.iter().enumerate() {
            if v > row[best] {
                best = i;
            }
        }
        *o = best as i32;
    }
    Ok(())
}

pub(crate) fn slice_cols(src: &Tensor, col0: usize, dst: &mut Tensor) -> Result<()> {
    let (&[n, cols], &[dn, dcols]) = (src.dims(), dst.dims()) else {
        return Err(Error::shape(format!(
            "slice_cols takes 2-D tensors, got {} and {}",
            src.shape(),
            dst.shape()
        )));
    };
    if n != dn || col0 + dcols > cols {
        return Err(Error::shape(format!(
            "slice_cols: columns {col0}..{} of {} into {}",
            col0 + dcols,
            src.shape(),
            dst.shape()
        )));
    }
    let s = f32s(src)?;
    let d = f32s_mut(dst)?;
    if dcols == 0 {
        return Ok(());
    }
    for (row, out) in d.chunks_exact_mut(dcols).enumerate() {
        out.copy_from_slice(&s[row * cols + col0..][..dcols]);
    }
    Ok(())
}
