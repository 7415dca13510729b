//! The norms' and softmax's gradients, per row; row sums in f64 as the forwards take them.

use crate::pool::Pool;
use crate::{f32s, f32s_mut, same_shape};
use kiln_core::{Error, Result, Tensor};

/// Rows whose elements number fewer than this run on the calling thread.
const SERIAL_ELEMENTS: usize = 1 << 14;

fn check_row_param(p: &Tensor, row: usize, what: &str) -> Result<()> {
    if p.shape().numel() != row {
        return Err(Error::shape(format!(
            "{what} has {} values, rows have {row}",
            p.shape().numel()
        )));
    }
    Ok(())
}

/// `f(row index, dx row)` for every row of `dx`, threaded when there is enough work.
fn per_row(pool: &Pool, dx: &mut [f32], row: usize, f: impl Fn(usize, &mut [f32]) + Sync) {
    if row == 0 {
        return;
    }
    if dx.len() < SERIAL_ELEMENTS {
        dx.chunks_exact_mut(row)
            .enumerate()
            .for_each(|(i, o)| f(i, o));
    } else {
        pool.for_chunks_mut(dx, row, f);
    }
}

/// `1 / sqrt(mean(x²) + eps)` of one row.
fn rms_scale(x: &[f32], eps: f32) -> f64 {
    let ss: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
    1.0 / (ss / x.len() as f64 + eps as f64).sqrt()
}

/// Check `x`, `dy`, `dx` of one shape and `weight` (and `dweight`) of one row.
fn check_norm(
    op: &str,
    x: &Tensor,
    weight: &Tensor,
    dy: &Tensor,
    dx: &Tensor,
    dweight: Option<&Tensor>,
) -> Result<usize> {
    same_shape(x, dy, op)?;
    same_shape(x, dx, op)?;
    let row = x.shape().row_len();
    check_row_param(weight, row, &format!("{op} weight"))?;
    if let Some(dw) = dweight {
        check_row_param(dw, row, &format!("{op} weight gradient"))?;
    }
    Ok(row)
}

pub(crate) fn rms_norm_backward(
    pool: &Pool,
    x: &Tensor,
    weight: &Tensor,
    eps: f32,
    dy: &Tensor,
    dx: &mut Tensor,
    dweight: Option<&mut Tensor>,
) -> Result<()> {
    let row = check_norm("rms_norm", x, weight, dy, dx, dweight.as_deref())?;
    let (xs, w, d) = (f32s(x)?, f32s(weight)?, f32s(dy)?);
    // y = x·r·w with r = (mean(x²) + eps)^-½:
    // dx_j = r·w_j·dy_j − x_j·r³/row · Σ_i dy_i·w_i·x_i.
    per_row(pool, f32s_mut(dx)?, row, |i, o| {
        let (x, d) = (&xs[i * row..][..row], &d[i * row..][..row]);
        let r = rms_scale(x, eps);
        let dot: f64 = (0..row)
            .map(|j| d[j] as f64 * w[j] as f64 * x[j] as f64)
            .sum();
        let c = dot * r * r * r / row as f64;
        for j in 0..row {
            o[j] += (r * w[j] as f64 * d[j] as f64 - x[j] as f64 * c) as f32;
        }
    });
    if let Some(dw) = dweight {
        let dw = f32s_mut(dw)?;
        let mut acc = vec![0f64; row];
        for (x, d) in xs.chunks_exact(row.max(1)).zip(d.chunks_exact(row.max(1))) {
            let r = rms_scale(x, eps);
            for j in 0..row {
                acc[j] += d[j] as f64 * x[j] as f64 * r;
            }
        }
        dw.iter_mut().zip(acc).for_each(|(w, a)| *w += a as f32);
    }
    Ok(())
}

/// Mean and `1 / sqrt(var + eps)` of one row.
fn moments(x: &[f32], eps: f32) -> (f64, f64) {
    let n = x.len() as f64;
    let mean = x.iter().map(|&v| v as f64).sum::<f64>() / n;
    let var = x.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n;
    (mean, 1.0 / (var + eps as f64).sqrt())
}

pub(crate) fn layer_norm_backward(
    pool: &Pool,
    x: &Tensor,
    weight: &Tensor,
    eps: f32,
    dy: &Tensor,
    dx: &mut Tensor,
    dweight: Option<&mut Tensor>,
) -> Result<()> {
    let row = check_norm("layer_norm", x, weight, dy, dx, dweight.as_deref())?;
    let (xs, w, d) = (f32s(x)?, f32s(weight)?, f32s(dy)?);
    // x̂ = (x − mean)·r, y = x̂·w + b, g = dy·w:
    // dx = r·(g − mean(g) − x̂·mean(g·x̂)).
    per_row(pool, f32s_mut(dx)?, row, |i, o| {
        let (x, d) = (&xs[i * row..][..row], &d[i * row..][..row]);
        let (mean, r) = moments(x, eps);
        let n = row as f64;
        let (mut g_mean, mut gx_mean) = (0f64, 0f64);
        for j in 0..row {
            let g = d[j] as f64 * w[j] as f64;
            g_mean += g;
            gx_mean += g * (x[j] as f64 - mean) * r;
        }
        g_mean /= n;
        gx_mean /= n;
        for j in 0..row {
            let g = d[j] as f64 * w[j] as f64;
            let xhat = (x[j] as f64 - mean) * r;
            o[j] += (r * (g - g_mean - xhat * gx_mean)) as f32;
        }
    });
    if let Some(dw) = dweight {
        let dw = f32s_mut(dw)?;
        let mut acc = vec![0f64; row];
        for (x, d) in xs.chunks_exact(row.max(1)).zip(d.chunks_exact(row.max(1))) {
            let (mean, r) = moments(x, eps);
            for j in 0..row {
                acc[j] += d[j] as f64 * (x[j] as f64 - mean) * r;
            }
        }
        dw.iter_mut().zip(acc).for_each(|(w, a)| *w += a as f32);
    }
    Ok(())
}

pub(crate) fn softmax_backward(
    pool: &Pool,
    y: &Tensor,
    dy: &Tensor,
    dx: &mut Tensor,
) -> Result<()> {
    same_shape(y, dy, "softmax")?;
    same_shape(y, dx, "softmax")?;
    let row = y.shape().row_len();
    let (ys, d) = (f32s(y)?, f32s(dy)?);
    per_row(pool, f32s_mut(dx)?, row, |i, o| {
        let (y, d) = (&ys[i * row..][..row], &d[i * row..][..row]);
        let dot: f64 = y.iter().zip(d).map(|(&y, &d)| y as f64 * d as f64).sum();
        for j in 0..row {
            o[j] += (y[j] as f64 * (d[j] as f64 - dot)) as f32;
        }
    });
    Ok(())
}
