//! Matmul's two backward products, `dx += dy · w` and `dw += dyᵀ · x`, through the `gemm`
//! crate (single-threaded inside each of the pool's tasks, as the forward's F32 path).

use crate::pool::{Pool, SharedMut};
use crate::storage::Rows;
use crate::{f32s, f32s_mut};
use kiln_core::{DType, Error, GradInto, Result, Tensor};
use std::sync::Mutex;

/// Output rows per task: enough work to amortise a task, few enough to balance the pool.
fn rows_per_task(pool: &Pool, rows: usize) -> usize {
    (rows / (pool.threads() * 4)).clamp(16, 256)
}

/// `(n, m, k)` of a product whose forward was `out[n, m] = x[n, k] · w[m, k]ᵀ`.
fn dims(
    dy: &Tensor,
    w_rows_cols: (usize, usize),
    x_or_dx: &Tensor,
    op: &str,
) -> Result<(usize, usize, usize)> {
    let (m, k) = w_rows_cols;
    let n = dy.shape().rows();
    if dy.shape().row_len() != m || x_or_dx.shape().rows() != n || x_or_dx.shape().row_len() != k {
        return Err(Error::shape(format!(
            "{op}: dy {}, x {}, weight [{m}, {k}]",
            dy.shape(),
            x_or_dx.shape()
        )));
    }
    Ok((n, m, k))
}

fn weight_dims(w: &Tensor, op: &str) -> Result<(usize, usize)> {
    match w.dims() {
        &[m, k] => Ok((m, k)),
        _ => Err(Error::shape(format!(
            "{op}: the weight must be [m, k], got {}",
            w.shape()
        ))),
    }
}

/// A frozen weight is decoded this many bytes of f32 rows at a time: the decoded copy
/// stays small whatever the matrix (an 8B model's output head is 2.1 GB in f32).
const DECODED_TILE_BYTES: usize = 32 << 20;

/// `f(r0, rows, values)` over the rows of the weight `w` `[m, k]`, a tile of them at a
/// time: an F32 weight as one tile, its own values; a frozen weight kept as stored (LoRA
/// over a quantized model) decoded a tile at a time into `scratch`, which stays
/// allocated between calls (fresh pages for every product cost as much as the decoding).
pub(crate) fn for_weight_tiles(
    pool: &Pool,
    scratch: &Mutex<Vec<f32>>,
    w: &Tensor,
    op: &str,
    mut f: impl FnMut(usize, usize, &[f32]) -> Result<()>,
) -> Result<()> {
    if w.dtype() == DType::F32 {
        let (m, _) = weight_dims(w, op)?;
        return f(0, m, f32s(w)?);
    }
    let rows = Rows::of(w, op)?;
    let (m, k) = rows.dims();
    let tile = (DECODED_TILE_BYTES / (k.max(1) * 4)).max(1);
    let mut buf = scratch.lock().unwrap_or_else(|e| e.into_inner());
    for r0 in (0..m).step_by(tile) {
        let n = tile.min(m - r0);
        f(r0, n, rows.decode_range_into(pool, r0, n, &mut buf)?)?;
    }
    Ok(())
}

/// `dx[n, k] += dy[n, m] · w[m, k]` (`=` under `GradInto::Write`: the first tile of a
/// stored weight's rows writes, the others add), tasks over rows of `dx`.
pub(crate) fn matmul_dx(
    pool: &Pool,
    scratch: &Mutex<Vec<f32>>,
    dy: &Tensor,
    w: &Tensor,
    dx: &mut Tensor,
    into: GradInto,
) -> Result<()> {
    let (n, m, k) = dims(dy, weight_dims(w, "matmul_dx")?, dx, "matmul_dx")?;
    let (dys, dxs) = (f32s(dy)?, f32s_mut(dx)?);
    if m == 0 && into == GradInto::Write {
        dxs.fill(0.0);
    }
    for_weight_tiles(pool, scratch, w, "matmul_dx", |r0, rows, ws| {
        let add = into == GradInto::Add || r0 > 0;
        dx_slices(pool, &dys[r0..], m, ws, dxs, (n, rows, k), add);
        Ok(())
    })
}

/// `dx[n, k] += dy[n, m] · w[m, k]` on slices (`=` where not `add`), `dy`'s rows
/// `dy_stride` apart (a tile of columns of a wider matrix) and the others packed, tasks
/// over rows of `dx`.
pub(crate) fn dx_slices(
    pool: &Pool,
    dys: &[f32],
    dy_stride: usize,
    ws: &[f32],
    dxs: &mut [f32],
    (n, m, k): (usize, usize, usize),
    add: bool,
) {
    if n == 0 || m == 0 || k == 0 {
        return;
    }
    assert!(dy_stride >= m && dys.len() >= (n - 1) * dy_stride + m);
    assert!(ws.len() >= m * k && dxs.len() >= n * k);
    let chunk = rows_per_task(pool, n);
    let out = SharedMut::new(dxs);
    pool.for_each_init(
        n.div_ceil(chunk),
        || (),
        |(), c| {
            let r0 = c * chunk;
            let rows = chunk.min(n - r0);
            // SAFETY: this task alone writes rows r0..r0 + rows of dx (n × k, row stride k);
            // dy is read at rows r0.. (row stride dy_stride, m values each) and w whole
            // (m × k, row stride k), each inside its slice (asserted above).
            unsafe {
                gemm::gemm(
                    rows,
                    k,
                    m,
                    out.at(r0 * k),
                    1,
                    k as isize,
                    add,
                    dys.as_ptr().add(r0 * dy_stride),
                    1,
                    dy_stride as isize,
                    ws.as_ptr(),
                    1,
                    k as isize,
                    1.0,
                    1.0,
                    false,
                    false,
                    false,
                    gemm::Parallelism::None,
                );
            }
        },
    );
}

/// `dw[m, k] += dy[n, m]ᵀ · x[n, k]`, tasks over rows of `dw`.
pub(crate) fn matmul_dw(pool: &Pool, dy: &Tensor, x: &Tensor, dw: &mut Tensor) -> Result<()> {
    let (n, m, k) = dims(dy, weight_dims(dw, "matmul_dw")?, x, "matmul_dw")?;
    dw_slices(pool, f32s(dy)?, f32s(x)?, f32s_mut(dw)?, n, m, k);
    Ok(())
}

/// [`matmul_dw`] on slices of at least the sizes `n`, `m`, `k` make.
pub(crate) fn dw_slices(
    pool: &Pool,
    dys: &[f32],
    xs: &[f32],
    dws: &mut [f32],
    n: usize,
    m: usize,
    k: usize,
) {
    assert!(dys.len() >= n * m && xs.len() >= n * k && dws.len() >= m * k);
    if n == 0 || m == 0 || k == 0 {
        return;
    }
    let chunk = rows_per_task(pool, m);
    let out = SharedMut::new(dws);
    pool.for_each_init(
        m.div_ceil(chunk),
        || (),
        |(), c| {
            let r0 = c * chunk;
            let rows = chunk.min(m - r0);
            // SAFETY: this task alone writes rows r0..r0 + rows of dw (m × k, row stride k);
            // dyᵀ is read from column r0 on (element (r, t) at dy[t·m + r]: column stride 1,
            // row stride m, n columns), x whole (n × k), each inside its slice (asserted
            // above).
            unsafe {
                gemm::gemm(
                    rows,
                    k,
                    n,
                    out.at(r0 * k),
                    1,
                    k as isize,
                    true,
                    dys.as_ptr().add(r0),
                    m as isize,
                    1,
                    xs.as_ptr(),
                    1,
                    k as isize,
                    1.0,
                    1.0,
                    false,
                    false,
                    false,
                    gemm::Parallelism::None,
                );
            }
        },
    );
}

/// `out[n, m] = x[n, k] · w[m, k]ᵀ` on slices, `out`'s rows `out_stride` apart (a tile of
/// columns of a wider matrix): the forward product the fused loss recomputes, tasks over
/// columns of `out`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn xwt_slices(
    pool: &Pool,
    xs: &[f32],
    ws: &[f32],
    out: &mut [f32],
    out_stride: usize,
    n: usize,
    m: usize,
    k: usize,
) {
    if n == 0 || m == 0 {
        return;
    }
    assert!(xs.len() >= n * k && ws.len() >= m * k);
    assert!(out_stride >= m && out.len() >= (n - 1) * out_stride + m);
    let chunk = rows_per_task(pool, m);
    let cols = SharedMut::new(out);
    pool.for_each_init(
        m.div_ceil(chunk),
        || (),
        |(), c| {
            let r0 = c * chunk;
            let rows = chunk.min(m - r0);
            // SAFETY: this task alone writes columns r0..r0 + rows of out (n rows,
            // row stride out_stride); x is n × k (row stride k) and w's rows r0.. are read
            // transposed (column stride k), each inside its slice (asserted above).
            unsafe {
                gemm::gemm(
                    n,
                    rows,
                    k,
                    cols.at(r0),
                    1,
                    out_stride as isize,
                    false,
                    xs.as_ptr(),
                    1,
                    k as isize,
                    ws.as_ptr().add(r0 * k),
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
        },
    );
}
