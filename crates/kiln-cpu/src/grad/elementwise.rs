//! The backward kernels of the element-wise and bookkeeping ops: copies, sums, the
//! activations' derivatives, the embedding's scatter, rope's inverse rotation, and the
//! gradients of `slice_cols` and `write_rows`.

use crate::pool::Pool;
use crate::{f32s, f32s_mut, indices, same_shape, storage, storage_mut};
use kiln_core::{Error, Result, RopeLayout, Tensor};

/// Elements per task of the threaded loops.
const CHUNK: usize = 1 << 13;

fn same_len(a: &Tensor, b: &Tensor, op: &str) -> Result<()> {
    if a.shape().numel() != b.shape().numel() {
        return Err(Error::shape(format!(
            "{op}: {} vs {}",
            a.shape(),
            b.shape()
        )));
    }
    Ok(())
}

pub(crate) fn copy(src: &Tensor, dst: &mut Tensor) -> Result<()> {
    same_len(src, dst, "copy")?;
    if src.dtype() != dst.dtype() {
        return Err(Error::shape(format!(
            "copy: {} into {}",
            src.dtype(),
            dst.dtype()
        )));
    }
    storage_mut(dst)?
        .bytes_mut()?
        .copy_from_slice(storage(src)?.bytes()?);
    Ok(())
}

pub(crate) fn copy_span(
    src: &Tensor,
    src_at: usize,
    dst: &mut Tensor,
    dst_at: usize,
    n: usize,
) -> Result<()> {
    let (src_len, dst_len) = (src.shape().numel(), dst.shape().numel());
    let outside = |what: &str, at: usize, len: usize| {
        Error::shape(format!(
            "copy_span: {n} elements at {at} reach past the {what}'s {len}"
        ))
    };
    let from = f32s(src)?
        .get(src_at..src_at.saturating_add(n))
        .ok_or_else(|| outside("source", src_at, src_len))?;
    f32s_mut(dst)?
        .get_mut(dst_at..dst_at.saturating_add(n))
        .ok_or_else(|| outside("destination", dst_at, dst_len))?
        .copy_from_slice(from);
    Ok(())
}

pub(crate) fn sum_squares(pool: &Pool, x: &Tensor) -> Result<f64> {
    let xs = f32s(x)?;
    // Chunks summed in order: the same bits whatever the number of threads.
    let mut partials = vec![0f64; xs.len().div_ceil(CHUNK)];
    pool.for_chunks_mut(&mut partials, 1, |i, out| {
        let chunk = &xs[i * CHUNK..xs.len().min((i + 1) * CHUNK)];
        out[0] = chunk.iter().map(|&v| v as f64 * v as f64).sum();
    });
    Ok(partials.iter().sum())
}

pub(crate) fn add_scaled(pool: &Pool, acc: &mut Tensor, x: &Tensor, a: f32) -> Result<()> {
    same_len(acc, x, "add_scaled")?;
    let xs = f32s(x)?;
    pool.for_chunks_mut(f32s_mut(acc)?, CHUNK, |c, o| {
        for (o, &x) in o.iter_mut().zip(&xs[c * CHUNK..]) {
            *o += a * x;
        }
    });
    Ok(())
}

pub(crate) fn sum_rows(x: &Tensor, acc: &mut Tensor) -> Result<()> {
    let row = acc.shape().numel();
    if x.shape().row_len() != row {
        return Err(Error::shape(format!(
            "sum_rows: rows of {} into {}",
            x.shape(),
            acc.shape()
        )));
    }
    let xs = f32s(x)?;
    let a = f32s_mut(acc)?;
    if row == 0 {
        return Ok(());
    }
    // Summed in f64 across rows: a bias's gradient adds up every token's.
    let mut sum = vec![0f64; row];
    for r in xs.chunks_exact(row) {
        sum.iter_mut().zip(r).for_each(|(s, &v)| *s += v as f64);
    }
    a.iter_mut().zip(sum).for_each(|(a, s)| *a += s as f32);
    Ok(())
}

pub(crate) fn embedding_backward(dy: &Tensor, ids: &Tensor, dtable: &mut Tensor) -> Result<()> {
    let &[vocab, dim] = dtable.dims() else {
        return Err(Error::shape(format!(
            "embedding gradient: the table must be 2-D, got {}",
            dtable.shape()
        )));
    };
    let n = dy.shape().rows();
    if dy.shape().row_len() != dim {
        return Err(Error::shape(format!(
            "embedding gradient: rows {} into a table {}",
            dy.shape(),
            dtable.shape()
        )));
    }
    let ids = indices(ids, n, vocab, "token ids", |id| {
        Error::shape(format!(
            "token id {id} is outside the vocabulary of {vocab}"
        ))
    })?;
    let d = f32s(dy)?;
    let t = f32s_mut(dtable)?;
    if dim == 0 {
        return Ok(());
    }
    for (&id, row) in ids.iter().zip(d.chunks_exact(dim)) {
        let dst = &mut t[id as usize * dim..][..dim];
        dst.iter_mut().zip(row).for_each(|(t, &g)| *t += g);
    }
    Ok(())
}

/// σ(x), in f32 as the forward's SiLU computes it.
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// d/dx of GELU's tanh approximation `0.5·x·(1 + tanh(c·(x + 0.044715·x³)))`.
pub(crate) fn gelu_grad(x: f32) -> f32 {
    const C: f32 = 0.797_884_6;
    let u = C * (x + 0.044_715 * x * x * x);
    let t = u.tanh();
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * C * (1.0 + 3.0 * 0.044_715 * x * x)
}

pub(crate) fn gated_backward(
    pool: &Pool,
    gate: &Tensor,
    up: &Tensor,
    gelu: bool,
    dout: &Tensor,
    dgate: &mut Tensor,
    dup: &mut Tensor,
) -> Result<()> {
    let op = if gelu { "gelu_mul" } else { "silu_mul" };
    for t in [up, dout, &*dgate, &*dup] {
        same_shape(gate, t, op)?;
    }
    let (g, u, d) = (f32s(gate)?, f32s(up)?, f32s(dout)?);
    let du = f32s_mut(dup)?;
    // Two passes (one output each), so that each is one threaded loop over disjoint chunks.
    pool.for_chunks_mut(f32s_mut(dgate)?, CHUNK, |c, o| {
        let at = c * CHUNK;
        for (i, o) in o.iter_mut().enumerate() {
            let (g, u, d) = (g[at + i], u[at + i], d[at + i]);
            let act_grad = if gelu {
                gelu_grad(g)
            } else {
                let s = sigmoid(g);
                s * (1.0 + g * (1.0 - s))
            };
            *o += d * u * act_grad;
        }
    });
    pool.for_chunks_mut(du, CHUNK, |c, o| {
        let at = c * CHUNK;
        for (i, o) in o.iter_mut().enumerate() {
            let g = g[at + i];
            let act = if gelu {
                crate::elementwise::gelu(g)
            } else {
                g * sigmoid(g)
            };
            *o += d[at + i] * act;
        }
    });
    Ok(())
}

pub(crate) fn gelu_backward(pool: &Pool, x: &Tensor, dy: &Tensor, dx: &mut Tensor) -> Result<()> {
    same_shape(x, dy, "gelu")?;
    same_len(x, dx, "gelu")?;
    let (xs, d) = (f32s(x)?, f32s(dy)?);
    pool.for_chunks_mut(f32s_mut(dx)?, CHUNK, |c, o| {
        let at = c * CHUNK;
        for (i, o) in o.iter_mut().enumerate() {
            *o += d[at + i] * gelu_grad(xs[at + i]);
        }
    });
    Ok(())
}

pub(crate) fn softcap_backward(y: &Tensor, cap: f32, dy: &Tensor, dx: &mut Tensor) -> Result<()> {
    same_shape(y, dy, "softcap")?;
    same_len(y, dx, "softcap")?;
    let (ys, d) = (f32s(y)?, f32s(dy)?);
    for ((o, &y), &d) in f32s_mut(dx)?.iter_mut().zip(ys).zip(d) {
        let t = y / cap;
        *o += d * (1.0 - t * t);
    }
    Ok(())
}

pub(crate) fn slice_cols_backward(ddst: &Tensor, col0: usize, dsrc: &mut Tensor) -> Result<()> {
    let (&[rows, cols], &[src_rows, src_cols]) = (ddst.dims(), dsrc.dims()) else {
        return Err(Error::shape(format!(
            "slice_cols gradient: {} into {} (both 2-D)",
            ddst.shape(),
            dsrc.shape()
        )));
    };
    if rows != src_rows || col0.checked_add(cols).is_none_or(|end| end > src_cols) {
        return Err(Error::shape(format!(
            "slice_cols gradient: {} at column {col0} into {}",
            ddst.shape(),
            dsrc.shape()
        )));
    }
    let d = f32s(ddst)?;
    let s = f32s_mut(dsrc)?;
    if cols == 0 {
        return Ok(());
    }
    for (r, row) in d.chunks_exact(cols).enumerate() {
        let dst = &mut s[r * src_cols + col0..][..cols];
        dst.iter_mut().zip(row).for_each(|(s, &g)| *s += g);
    }
    Ok(())
}

/// Rows of `dst` (its outermost dimension) and their length; checks `src`'s rows match.
fn row_geometry(src: &Tensor, dst: &Tensor, op: &str) -> Result<(usize, usize, usize)> {
    let row: usize = dst.dims().iter().skip(1).product();
    let src_row: usize = src.dims().iter().skip(1).product();
    if row != src_row {
        return Err(Error::shape(format!(
            "{op}: rows of {} and {}",
            src.shape(),
            dst.shape()
        )));
    }
    let rows = src.dims().first().copied().unwrap_or(1);
    let dst_rows = dst.dims().first().copied().unwrap_or(1);
    Ok((rows, dst_rows, row))
}

pub(crate) fn gather_rows(ddst: &Tensor, pos: &Tensor, dsrc: &mut Tensor) -> Result<()> {
    let (rows, dst_rows, row) = row_geometry(dsrc, ddst, "write_rows gradient")?;
    let positions = indices(pos, rows, dst_rows, "write_rows positions", |p| {
        Error::shape(format!(
            "write_rows gradient: row {p} is outside the {dst_rows} rows"
        ))
    })?;
    let d = f32s(ddst)?;
    let s = f32s_mut(dsrc)?;
    if row == 0 {
        return Ok(());
    }
    for (&p, out) in positions.iter().zip(s.chunks_exact_mut(row)) {
        let from = &d[p as usize * row..][..row];
        out.iter_mut().zip(from).for_each(|(o, &g)| *o += g);
    }
    Ok(())
}

pub(crate) fn zero_rows(ddst: &mut Tensor, pos: &Tensor) -> Result<()> {
    let row: usize = ddst.dims().iter().skip(1).product();
    let dst_rows = ddst.dims().first().copied().unwrap_or(1);
    let n = pos.shape().numel();
    let positions = indices(pos, n, dst_rows, "write_rows positions", |p| {
        Error::shape(format!(
            "write_rows gradient: row {p} is outside the {dst_rows} rows"
        ))
    })?;
    let d = f32s_mut(ddst)?;
    for &p in positions {
        d[p as usize * row..][..row].fill(0.0);
    }
    Ok(())
}

/// Rope's inverse: each pair turned by −θ (the transpose of the forward's rotation), with
/// the forward's angles (f32 `pos · inv_freq`, cos and sin in f64).
pub(crate) fn rope_backward(
    d: &mut Tensor,
    pos: &Tensor,
    inv_freq: &Tensor,
    layout: RopeLayout,
) -> Result<()> {
    let &[tokens, heads, head_dim] = d.dims() else {
        return Err(Error::shape(format!(
            "rope gradient takes [tokens, heads, head_dim], got {}",
            d.shape()
        )));
    };
    let freqs = f32s(inv_freq)?;
    let half = freqs.len();
    if 2 * half > head_dim {
        return Err(Error::shape(format!(
            "rope gradient: {half} frequencies rotate {} dimensions, heads have {head_dim}",
            2 * half
        )));
    }
    let positions = indices(pos, tokens, usize::MAX, "rope positions", |p| {
        Error::shape(format!("rope: negative position {p}"))
    })?;
    let v = f32s_mut(d)?;
    let mut cos_sin = vec![(0f32, 0f32); half];
    for (t, &pos) in positions.iter().enumerate() {
        let pos = pos as f32;
        for (cs, &f) in cos_sin.iter_mut().zip(freqs) {
            let theta = (pos * f) as f64;
            *cs = (theta.cos() as f32, theta.sin() as f32);
        }
        for h in 0..heads {
            let head = &mut v[(t * heads + h) * head_dim..][..head_dim];
            for (i, &(c, s)) in cos_sin.iter().enumerate() {
                let (a, b) = match layout {
                    RopeLayout::Interleaved => (2 * i, 2 * i + 1),
                    RopeLayout::Neox => (i, i + half),
                };
                let (g0, g1) = (head[a], head[b]);
                head[a] = g0 * c + g1 * s;
                head[b] = -g0 * s + g1 * c;
            }
        }
    }
    Ok(())
}
