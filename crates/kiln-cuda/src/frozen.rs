//! Frozen weights kept as stored (LoRA over an F16, BF16 or quantized model, "QLoRA"): the
//! backward's products read them decoded to F32 in a work buffer, a tile of rows at a
//! time for `matmul_dx` (32 MiB of F32), the whole matrix for the fused loss's output
//! projection (its blocks of rows read every vocabulary row). The model stays in its
//! type on the GPU; only one decoded tile or head is held at once.

use crate::blas::sgemm;
use crate::kernels::Arg;
use crate::{ptr, to_i32, CudaBackend};
use kiln_core::{DType, Error, Result, Tensor};

/// F32 values of a decoded tile of `matmul_dx` (32 MiB).
const TILE_VALUES: usize = 1 << 23;

/// The decoding kernel of each quantized type; F16 and BF16 go through `half_to_f32`.
fn dequant_kernel(dtype: DType) -> Option<&'static str> {
    Some(match dtype {
        DType::Q8_0 => "dequant_rows_f32_q8_0",
        DType::Q4_0 => "dequant_rows_f32_q4_0",
        DType::Q4_K => "dequant_rows_f32_q4_k",
        DType::Q6_K => "dequant_rows_f32_q6_k",
        _ => return None,
    })
}

/// Whether the backward reads a frozen weight of `dtype` as stored.
pub(crate) fn takes(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F16 | DType::BF16) || dequant_kernel(dtype).is_some()
}

impl CudaBackend {
    /// Rows `[r0, r0 + rows)` of `w` ([m, k], F16, BF16 or quantized) decoded to F32
    /// into the work buffer `grad_decoded`: its address.
    pub(crate) fn decoded_rows(&self, w: &Tensor, r0: usize, rows: usize) -> Result<u64> {
        let &[m, k] = w.dims() else {
            return Err(Error::shape(format!("a frozen weight of {}", w.shape())));
        };
        if r0 + rows > m {
            return Err(Error::shape(format!(
                "rows {r0}..{} of a weight of {}",
                r0 + rows,
                w.shape()
            )));
        }
        let out = self.scratch("grad_decoded", rows * k * 4)?;
        match (w.dtype(), dequant_kernel(w.dtype())) {
            (DType::F16 | DType::BF16, _) => self.launch_1d(
                "half_to_f32",
                rows * k,
                &[
                    Arg::Ptr(ptr(w)? + (r0 * k * 2) as u64),
                    Arg::Ptr(out),
                    Arg::U64((rows * k) as u64),
                    Arg::I32((w.dtype() == DType::BF16) as i32),
                ],
            )?,
            (_, Some(kernel)) => self.launch_1d(
                kernel,
                rows * k / 32,
                &[
                    Arg::Ptr(ptr(w)?),
                    Arg::Ptr(out),
                    Arg::I32(to_i32(m, "weight rows")?),
                    Arg::I32(to_i32(k, "weight width")?),
                    Arg::I32(to_i32(r0, "first row")?),
                    Arg::I32(to_i32(rows, "rows")?),
                ],
            )?,
            (other, None) => {
                return Err(Error::unsupported(format!(
                    "a frozen {other} weight in training's backward on CUDA (F32, F16, BF16, Q8_0, Q4_0, Q4_K and Q6_K are read as stored)"
                )))
            }
        }
        Ok(out)
    }

    /// `dx[n, k] = beta · dx + dy[n, m] · w[m, k]` over a stored `w` (`beta` 1 or 0),
    /// decoded a tile of rows at a time: each tile adds its rows' share (dy's matching
    /// columns).
    pub(crate) fn matmul_dx_stored(
        &self,
        dy: u64,
        w: &Tensor,
        dx: u64,
        (n, m, k): (usize, usize, usize),
        beta: f32,
    ) -> Result<()> {
        let tile = (TILE_VALUES / k.max(1)).clamp(1, m);
        for r0 in (0..m).step_by(tile) {
            let rows = tile.min(m - r0);
            let wt = self.decoded_rows(w, r0, rows)?;
            // Column-major dxᵀ (k × n) += wtᵀ (wt read as k × rows) · dy's columns r0.. (read
            // as rows × n with leading dimension m).
            sgemm(
                self,
                (false, false),
                (k, n, rows),
                (wt, k),
                (dy + (r0 * 4) as u64, m),
                // The first tile writes or adds as asked; the others add to it.
                if r0 == 0 { beta } else { 1.0 },
                (dx, k),
            )?;
        }
        Ok(())
    }
}
