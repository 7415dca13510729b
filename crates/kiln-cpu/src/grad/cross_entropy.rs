//! Cross-entropy fused with the output projection, as llm.c does it: the logits of a
//! block of rows are made, turned into the loss and (when asked) into their gradient in
//! place, and that gradient multiplied back into `dh` and `dw`, before the next block's
//! logits overwrite them. The `[n, vocab]` matrix never exists whole.

use super::matmul::{dw_slices, dx_slices, for_weight_tiles, xwt_slices};
use crate::pool::Pool;
use crate::{f32s, f32s_mut, indices};
use kiln_core::{DType, Error, Result, Tensor};
use std::sync::Mutex;

/// Logits held at once: about 4 MiB of f32.
const BLOCK_LOGITS: usize = 1 << 20;

/// Logits held at once over an output matrix decoded for each block (a frozen one kept as
/// stored): about 64 MiB of f32.
const DECODED_BLOCK_LOGITS: usize = 1 << 24;

#[allow(clippy::too_many_arguments)]
pub(crate) fn cross_entropy(
    pool: &Pool,
    scratch: &Mutex<Vec<f32>>,
    h: &Tensor,
    w: &Tensor,
    targets: &Tensor,
    softcap: Option<f32>,
    scale: f32,
    losses: &mut Tensor,
    mut dh: Option<&mut Tensor>,
    mut dw: Option<&mut Tensor>,
) -> Result<()> {
    let &[vocab, dim] = w.dims() else {
        return Err(Error::shape(format!(
            "cross_entropy: the output projection must be [vocab, dim], got {}",
            w.shape()
        )));
    };
    let n = h.shape().rows();
    let grads_fit = dh.as_deref().is_none_or(|d| d.shape() == h.shape())
        && dw.as_deref().is_none_or(|d| d.shape() == w.shape());
    if h.shape().row_len() != dim || losses.shape().numel() != n || !grads_fit {
        return Err(Error::shape(format!(
            "cross_entropy: h {}, w {}, losses {}",
            h.shape(),
            w.shape(),
            losses.shape()
        )));
    }
    let targets = indices(targets, n, vocab, "targets", |t| {
        Error::shape(format!("target {t} is outside the vocabulary of {vocab}"))
    })?;
    if dw.is_some() && w.dtype() != DType::F32 {
        return Err(Error::unsupported(format!(
            "cross_entropy: the gradient of a {} output projection (train F32 weights)",
            w.dtype()
        )));
    }
    let hs = f32s(h)?;
    let loss = f32s_mut(losses)?;
    if n == 0 || vocab == 0 {
        return Ok(());
    }
    // A frozen output matrix kept as stored is decoded a tile of rows at a time, twice a
    // block (the logits, then dh): blocks of more rows, to decode it less often.
    let block = match w.dtype() {
        DType::F32 => BLOCK_LOGITS / vocab,
        _ => DECODED_BLOCK_LOGITS / vocab,
    }
    .clamp(1, n);
    let mut z = vec![0f32; block * vocab];
    let want_grad = dh.is_some() || dw.is_some();
    for r0 in (0..n).step_by(block) {
        let rows = block.min(n - r0);
        let h_blk = &hs[r0 * dim..(r0 + rows) * dim];
        let z = &mut z[..rows * vocab];
        for_weight_tiles(pool, scratch, w, "cross_entropy", |t0, trows, ws| {
            xwt_slices(pool, h_blk, ws, &mut z[t0..], vocab, rows, trows, dim);
            Ok(())
        })?;
        for (i, zr) in z.chunks_exact_mut(vocab).enumerate() {
            if let Some(cap) = softcap {
                zr.iter_mut().for_each(|v| *v = cap * (*v / cap).tanh());
            }
            let max = zr.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            let sum: f64 = zr.iter().map(|&v| ((v - max) as f64).exp()).sum();
            let lse = max as f64 + sum.ln();
            let t = targets[r0 + i] as usize;
            loss[r0 + i] = (lse - zr[t] as f64) as f32;
            if want_grad {
                // ∂L/∂z = softmax(z) − onehot(t), then through the softcap:
                // ∂z/∂raw = 1 − (z/cap)².
                for (j, v) in zr.iter_mut().enumerate() {
                    let p = ((*v as f64 - lse).exp() - if j == t { 1.0 } else { 0.0 }) as f32;
                    let through_cap = softcap.map_or(1.0, |cap| 1.0 - (*v / cap) * (*v / cap));
                    *v = p * scale * through_cap;
                }
            }
        }
        if let Some(dh) = dh.as_deref_mut() {
            let dh = &mut f32s_mut(dh)?[r0 * dim..(r0 + rows) * dim];
            for_weight_tiles(pool, scratch, w, "cross_entropy", |t0, trows, ws| {
                dx_slices(pool, &z[t0..], vocab, ws, dh, (rows, trows, dim), true);
                Ok(())
            })?;
        }
        if let Some(dw) = dw.as_deref_mut() {
            dw_slices(pool, z, h_blk, f32s_mut(dw)?, rows, vocab, dim);
        }
    }
    Ok(())
}
