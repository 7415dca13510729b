//! Matmul's two backward products, `dx += dy · w` and `dw += dyᵀ · x`, through the `gemm`
//! crate (single-threaded inside each of the pool's tasks, as the forward's F32 path).

use crate::pool::{Pool, SharedMut};
use crate::storage::Rows;
use crate::{f32s, f32s_mut};
use kiln_core::{DType, Error, Result, Tensor};
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

/// `f` of a product's weight as f32 values: an F32 weight's own, or a frozen weight kept
/// as stored (LoRA over a quantized model) decoded for this call into `scratch`, which
/// stays allocated between calls (fresh pages for every product would cost as much as
/// the decoding).
pub(crate) fn with_weight_values<R>(
    pool: &Pool,
    scratch: &Mutex<Vec<f32>>,
    w: &Tensor,
    op: &str,
    f: impl FnOnce(&[f32]) -> R,
) -> Result<R> {
    if w.dtype() == DType::F32 {
        return Ok(f(f32s(w)?));
    }
    let rows = Rows::of(w, op)?;
    let mut buf = scratch.lock().unwrap_or_else(|e| e.into_inner());
    Ok(f(rows.decode_into(pool, &mut buf)?))
}

/// `dx[n, k] += dy[n, m] · w[m, k]`, tasks over rows of `dx`.
pub(crate) fn matmul_dx(
    pool: &Pool,
    scratch: &Mutex<Vec<f32>>,
    dy: &Tensor,
    w: &Tensor,
    dx: &mut Tensor,
) -> Result<()> {
    let (n, m, k) = dims(dy, weight_dims(w, "matmul_dx")?, dx, "matmul_dx")?;
    let (dys, dxs) = (f32s(dy)?, f32s_mut(dx)?);
    with_weight_values(pool, scratch, w, "matmul_dx", |ws| {
        dx_slices(pool, dys, ws, dxs, n, m, k)
    })
}

/// [`matmul_dx`] on slices of at least the sizes `n`, `m`, `k` make.
pub(crate) fn dx_slices(
    pool: &Pool,
    dys: &[f32],
    ws: &[f32],
    dxs: &mut [f32],
    n: usize,
    m: usize,
    k: usize,
) {
    assert!(dys.len() >= n * m && ws.len() >= m * k && dxs.len() >= n * k);
    if n == 0 || m == 0 || k == 0 {
        return;
    }
    let chunk = rows_per_task(pool, n);
    let out = SharedMut::new(dxs);
    pool.for_each_init(
        n.div_ceil(chunk),
        || (),
        |(), c| {
            let r0 = c * chunk;
            let rows = chunk.min(n - r0);
            // SAFETY: this task alone writes rows r0..r0 + rows of dx (n × k, row stride k);
            // dy is read at rows r0.. (row stride m) and w whole (m × k, row stride k), each
            // inside its slice (asserted above).
            unsafe {
                gemm::gemm(
                    rows,
                    k,
                    m,
                    out.at(r0 * k),
                    1,
                    k as isize,
                    true,
                    dys.as_ptr().add(r0 * m),
                    1,
                    m as isize,
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

/// `out[n, m] = x[n, k] · w[m, k]ᵀ` on slices (the forward product the fused loss
/// recomputes), tasks over columns of `out`.
pub(crate) fn xwt_slices(
    pool: &Pool,
    xs: &[f32],
    ws: &[f32],
    out: &mut [f32],
    n: usize,
    m: usize,
    k: usize,
) {
    assert!(xs.len() >= n * k && ws.len() >= m * k && out.len() >= n * m);
    if n == 0 || m == 0 {
        return;
    }
    let chunk = rows_per_task(pool, m);
    let cols = SharedMut::new(out);
    pool.for_each_init(
        m.div_ceil(chunk),
        || (),
        |(), c| {
            let r0 = c * chunk;
            let rows = chunk.min(m - r0);
            // SAFETY: this task alone writes columns r0..r0 + rows of out (n × m, row stride
            // m); x is n × k (row stride k) and w's rows r0.. are read transposed (column
            // stride k), each inside its slice (asserted above).
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
