//! The loss fused with the output projection (`GradOps::cross_entropy`), as llm.c does it:
//! a block of rows of logits at a time, never the whole probability matrix.

use super::{f32s, rows_of};
use crate::blas::{rounded_copy, sgemm, sgemm_batched, Strided};
use crate::kernels::Arg;
use crate::{expect, ptr, to_i32, CudaBackend};
use kiln_core::{DType, Error, Products, Result, Tensor};

/// Logits a block of the fused loss holds at once (128 MiB of f32): 1,048 rows of a
/// 32,000-word vocabulary. Each block's three products read the whole output matrix (and
/// under BF16 / F16 products round it again): at 131 rows a block, those roundings were 4%
/// of a 16 × 1,024-token training step.
const BLOCK_LOGITS: usize = 1 << 25;

impl CudaBackend {
    /// `GradOps::cross_entropy`: the loss fused with the output projection, a block of rows
    /// of logits at a time.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn fused_loss(
        &self,
        h: &Tensor,
        w: &Tensor,
        targets: &Tensor,
        softcap: Option<f32>,
        scale: f32,
        losses: &mut Tensor,
        dh: Option<&mut Tensor>,
        dw: Option<&mut Tensor>,
    ) -> Result<()> {
        f32s(&[h, losses], "cross_entropy")?;
        expect(targets, DType::I32, "targets")?;
        if w.dtype() != DType::F32 && dw.is_some() {
            return Err(Error::unsupported(format!(
                "cross_entropy: a trained output projection is F32, not {}",
                w.dtype()
            )));
        }
        let &[vocab, dim] = w.dims() else {
            return Err(Error::shape(format!(
                "cross_entropy: projection {}",
                w.shape()
            )));
        };
        let (n, hd) = rows_of(h);
        let grads_fit = dh.as_deref().is_none_or(|d| d.shape() == h.shape())
            && dw.as_deref().is_none_or(|d| d.shape() == w.shape());
        if hd != dim || losses.shape().numel() != n || targets.shape().numel() != n || !grads_fit {
            return Err(Error::shape(format!(
                "cross_entropy: h {}, w {}, {} targets, losses {}",
                h.shape(),
                w.shape(),
                targets.shape().numel(),
                losses.shape()
            )));
        }
        if n == 0 || vocab == 0 || dim == 0 {
            return Ok(());
        }
        let grad = dh.is_some() || dw.is_some();
        let dh_ptr = dh.map(|t| ptr(t)).transpose()?;
        let dw_ptr = dw.map(|t| ptr(t)).transpose()?;
        let block = (BLOCK_LOGITS / vocab).clamp(1, n);
        let z = self.scratch("grad_cross_entropy", block * vocab * 4)?;
        // A frozen projection kept as stored is read decoded, whole (every block of rows
        // reads every vocabulary row).
        let w_ptr = match w.dtype() {
            DType::F32 => ptr(w)?,
            _ => self.decoded_rows(w, 0, vocab)?,
        };
        let (h_ptr, t_ptr, l_ptr) = (ptr(h)?, ptr(targets)?, ptr(losses)?);
        // Under BF16 / F16 products the projection is rounded once for every block (the
        // products would round it twice a block), each block's rows once for both of
        // their products, and its logits' gradient, as the rows kernel writes it, once for
        // both of its.
        let half = match self.blas.f32_products() {
            Products::Bf16 => Some(true),
            Products::F16 => Some(false),
            Products::F32 | Products::Tf32 => None,
        };
        let w_half = half
            .map(|bf16| rounded_copy(self, "grad_ce_w_half", w_ptr, vocab * dim, bf16))
            .transpose()?;
        let one = |at: u64, ld: usize| Strided { at, ld, stride: 0 };
        for r0 in (0..n).step_by(block) {
            let rows = block.min(n - r0);
            let h_blk = h_ptr + (r0 * dim * 4) as u64;
            let h_half = half
                .map(|bf16| rounded_copy(self, "grad_ce_h_half", h_blk, rows * dim, bf16))
                .transpose()?;
            // z[rows, vocab] = h·wᵀ: column-major zᵀ (vocab × rows) = w (read as dim ×
            // vocab, transposed) · hᵀ (read as dim × rows).
            match (w_half, h_half) {
                (Some(wh), Some(hh)) => sgemm_batched(
                    self,
                    half,
                    (true, false),
                    (vocab, rows, dim),
                    one(wh, dim),
                    one(hh, dim),
                    0.0,
                    one(z, vocab),
                    1,
                )?,
                _ => sgemm(
                    self,
                    (true, false),
                    (vocab, rows, dim),
                    (w_ptr, dim),
                    (h_blk, dim),
                    0.0,
                    (z, vocab),
                )?,
            }
            // The logits' gradient, rounded by the rows kernel itself for 16-bit products.
            let dz_half = match (grad, half) {
                (true, Some(_)) => Some(self.scratch("grad_ce_dz_half", 2 * rows * vocab)?),
                _ => None,
            };
            self.launch_rows(
                "grad_cross_entropy_rows",
                rows,
                256,
                &[
                    Arg::Ptr(z),
                    Arg::Ptr(t_ptr + (r0 * 4) as u64),
                    Arg::Ptr(l_ptr + (r0 * 4) as u64),
                    Arg::I32(to_i32(vocab, "vocabulary")?),
                    Arg::F32(softcap.unwrap_or(0.0)),
                    Arg::F32(scale),
                    Arg::I32(grad as i32),
                    Arg::Ptr(dz_half.unwrap_or(0)),
                    Arg::I32((half == Some(true)) as i32),
                ],
            )?;
            if !grad {
                continue;
            }
            if let Some(dh) = dh_ptr {
                // dh[rows, dim] += dz[rows, vocab]·w[vocab, dim] (as matmul_dx).
                let dh_blk = dh + (r0 * dim * 4) as u64;
                match (w_half, dz_half) {
                    (Some(wh), Some(dzh)) => sgemm_batched(
                        self,
                        half,
                        (false, false),
                        (dim, rows, vocab),
                        one(wh, dim),
                        one(dzh, vocab),
                        1.0,
                        one(dh_blk, dim),
                        1,
                    )?,
                    _ => sgemm(
                        self,
                        (false, false),
                        (dim, rows, vocab),
                        (w_ptr, dim),
                        (z, vocab),
                        1.0,
                        (dh_blk, dim),
                    )?,
                }
            }
            if let Some(dw) = dw_ptr {
                // dw[vocab, dim] += dzᵀ·h (as matmul_dw).
                match (h_half, dz_half) {
                    (Some(hh), Some(dzh)) => sgemm_batched(
                        self,
                        half,
                        (false, true),
                        (dim, vocab, rows),
                        one(hh, dim),
                        one(dzh, vocab),
                        1.0,
                        one(dw, dim),
                        1,
                    )?,
                    _ => sgemm(
                        self,
                        (false, true),
                        (dim, vocab, rows),
                        (h_blk, dim),
                        (z, vocab),
                        1.0,
                        (dw, dim),
                    )?,
                }
            }
        }
        Ok(())
    }
}
