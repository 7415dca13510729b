use crate::pool::Pool;
use crate::{f32s, f32s_mut, same_shape};
use kiln_core::{Error, Result, Tensor};

/// Rows at a time below which threading costs more than it saves.
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

/// Apply `f` to each (input row, output row) pair, in parallel when there is enough work.
fn per_row(
    pool: &Pool,
    x: &[f32],
    out: &mut [f32],
    row: usize,
    f: impl Fn(&[f32], &mut [f32]) + Sync,
) {
    if row == 0 {
        return;
    }
    if x.len() < SERIAL_ELEMENTS {
        x.chunks_exact(row)
            .zip(out.chunks_exact_mut(row))
            .for_each(|(x, o)| f(x, o));
    } else {
        let rows = x.len() / row;
        pool.for_chunks_mut(&mut out[..rows * row], row, |i, o| {
            f(&x[i * row..][..row], o)
        });
    }
}

pub(crate) fn rms_norm(
    pool: &Pool,
    x: &Tensor,
    weight: &Tensor,
    eps: f32,
    out: &mut Tensor,
) -> Result<()> {
    same_shape(x, out, "rms_norm")?;
    let row = x.shape().row_len();
    check_row_param(weight, row, "rms_norm weight")?;
    let w = f32s(weight)?;
    per_row(pool, f32s(x)?, f32s_mut(out)?, row, |x, o| {
        // ggml sums in double; so do we, so that long rows lose nothing.
        let ss: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
        let scale = (1.0 / (ss / row as f64 + eps as f64).sqrt()) as f32;
        for ((o, &v), &w) in o.iter_mut().zip(x).zip(w) {
            *o = v * scale * w;
        }
    });
    Ok(())
}

pub(crate) fn layer_norm(
    pool: &Pool,
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    eps: f32,
    out: &mut Tensor,
) -> Result<()> {
    same_shape(x, out, "layer_norm")?;
    let row = x.shape().row_len();
    check_row_param(weight, row, "layer_norm weight")?;
    check_row_param(bias, row, "layer_norm bias")?;
    let (w, b) = (f32s(weight)?, f32s(bias)?);
    per_row(pool, f32s(x)?, f32s_mut(out)?, row, |x, o| {
        let mean = x.iter().map(|&v| v as f64).sum::<f64>() / row as f64;
        let var = x.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / row as f64;
        let inv = 1.0 / (var + eps as f64).sqrt();
        for (((o, &v), &w), &b) in o.iter_mut().zip(x).zip(w).zip(b) {
            *o = ((v as f64 - mean) * inv) as f32 * w + b;
        }
    });
    Ok(())
}

pub(crate) fn softmax(pool: &Pool, x: &mut Tensor) -> Result<()> {
    let row = x.shape().row_len();
    let v = f32s_mut(x)?;
    if row == 0 {
        return Ok(());
    }
    let f = |r: &mut [f32]| {
        let max = r.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        if max == f32::NEG_INFINITY {
            // Every position masked: leave zeros rather than NaN.
            r.fill(0.0);
            return;
        }
        let mut sum = 0f64;
        for v in r.iter_mut() {
            *v = (*v - max).exp();
            sum += *v as f64;
        }
        let inv = (1.0 / sum) as f32;
        r.iter_mut().for_each(|v| *v *= inv);
    };
    if v.len() < SERIAL_ELEMENTS {
        v.chunks_exact_mut(row).for_each(f);
    } else {
        let rows = v.len() / row;
        pool.for_chunks_mut(&mut v[..rows * row], row, |_, r| f(r));
    }
    Ok(())
}
