//! Decode's products with quantized weights: the row of x rounded to int8 per 32 values
//! once (`quantize_row`, the RMS norm in front where it is fused), then every product that
//! reads it meets the weights in integer dot products (`matvec_q8`). The rounded row lives
//! in a scratch buffer of the backend, kept and grown; the guard that `quantize_row`
//! returns holds it until the products are recorded.

use crate::elementwise::count;
use crate::kernels::{MATVEC1_Q8, QUANTIZE_ROW};
use crate::matmul::{chunks, wtype, Epilogue, NormFirst};
use crate::memory::WgpuStorage;
use crate::{f32_tensor, WgpuBackend};
use kiln_core::quant::gpu_layout;
use kiln_core::{Error, Result, Tensor};
use std::sync::MutexGuard;

/// x rounded to int8: `k / 4` words of quads, then `k / 32` f32 scales.
pub(crate) struct QuantizedRow<'a> {
    k: usize,
    scratch: MutexGuard<'a, Option<WgpuStorage>>,
}

/// Whether one row of x by `w` takes this path: a quantized weight whose every chunk's
/// quants start on 16 bytes (the kernel reads 16-byte items) and scales on a word.
pub(crate) fn takes(b: &WgpuBackend, x: &Tensor, w: &Tensor) -> Result<bool> {
    if x.shape().rows() != 1 || gpu_layout::quant_span(w.dtype()).is_none() {
        return Ok(false);
    }
    Ok(chunks(b, w)?
        .iter()
        .all(|c| c.q_base % 4 == 0 && c.m_base % 4 == 0))
}

/// Round the one row of `x` (normed first when `norm` is given) into the scratch.
pub(crate) fn quantize_row<'a>(
    b: &'a WgpuBackend,
    x: &Tensor,
    norm: Option<&NormFirst>,
) -> Result<QuantizedRow<'a>> {
    let k = x.shape().row_len();
    if x.shape().rows() != 1 || !k.is_multiple_of(32) {
        return Err(Error::shape(format!(
            "rounding a row to int8: x {} (one row, a multiple of 32)",
            x.shape()
        )));
    }
    let bytes = k + k / 8 + 16;
    let mut scratch = b.row_q8.lock().unwrap();
    if scratch.as_ref().is_none_or(|s| (s.bytes as usize) < bytes) {
        *scratch = Some(b.alloc(bytes)?);
    }
    let xb = f32_tensor(x, "row to round")?;
    let out = scratch.as_ref().unwrap().binding();
    // Unused bindings stand in with buffers already bound the same way (the normed row,
    // written only when asked, with the scratch).
    let (norm_w, normed, eps, write_normed) = match norm {
        Some(nf) => {
            if nf.weight.shape().numel() != k || nf.normed.is_some_and(|t| t.dims() != x.dims()) {
                return Err(Error::shape(format!(
                    "rms_norm in front of a product: weight {} for rows of {k}",
                    nf.weight.shape()
                )));
            }
            let normed = match nf.normed {
                Some(t) => f32_tensor(t, "normed row")?,
                None => out,
            };
            (
                f32_tensor(nf.weight, "norm weight")?,
                normed,
                nf.eps,
                nf.normed.is_some(),
            )
        }
        None => (xb, out, 0.0, false),
    };
    let kernel = b.kernel(&QUANTIZE_ROW, &[])?;
    let (groups, groups_x) = b.grid(k.div_ceil(4 * 256))?;
    b.stream.dispatch(
        &kernel,
        &[xb, norm_w, normed, out],
        &[
            count(k, "row")?,
            u32::from(norm.is_some()),
            eps.to_bits(),
            u32::from(write_normed),
            groups_x,
        ],
        groups,
    )?;
    Ok(QuantizedRow { k, scratch })
}

/// `out = x · wᵀ` (or as `epilogue` says) for the row in `row`; `w` must take this path.
pub(crate) fn matvec_q8(
    b: &WgpuBackend,
    row: &QuantizedRow,
    w: &Tensor,
    out: &mut Tensor,
    epilogue: Epilogue,
) -> Result<()> {
    let (m, k) = (w.shape().rows(), w.shape().row_len());
    if k != row.k || out.shape().rows() != 1 || out.shape().row_len() != m {
        return Err(Error::shape(format!(
            "matmul: a row of {} · w {}ᵀ into {}",
            row.k,
            w.shape(),
            out.shape()
        )));
    }
    let what = "matmul";
    let ob = f32_tensor(out, "matmul output")?;
    let xq = row.scratch.as_ref().unwrap().binding();
    // Without a gate, `aux` stands in with the rounded row (read here anyway).
    let (mode, aux) = match epilogue {
        Epilogue::Store => (0, xq),
        Epilogue::Add => (1, xq),
        Epilogue::Gated { gate, gelu } => {
            if gate.dims() != out.dims() {
                return Err(Error::shape(format!(
                    "gated product: gate {} for output {}",
                    gate.shape(),
                    out.shape()
                )));
            }
            (2 + u32::from(gelu), f32_tensor(gate, "gate")?)
        }
    };
    let kernel = b.kernel(&MATVEC1_Q8, &[("WTYPE", wtype(w.dtype())?)])?;
    let rows_per_group = b.matvec_row_slots();
    for c in chunks(b, w)? {
        if c.q_base % 4 != 0 || c.m_base % 4 != 0 {
            return Err(Error::Device(format!(
                "a chunk of {} at an offset the int8 product cannot read",
                w.shape()
            )));
        }
        let (groups, groups_x) = b.grid(c.rows.div_ceil(rows_per_group))?;
        let mut params = [0u32; 11];
        params[..9].copy_from_slice(&[
            count(k, what)?,
            count(c.rows, what)?,
            1,
            c.q_base,
            c.m_base,
            count(c.row0, what)?,
            count(m, what)?,
            rows_per_group as u32,
            groups_x,
        ]);
        params[10] = mode;
        b.stream
            .dispatch(&kernel, &[xq, c.quants, c.scales, ob, aux], &params, groups)?;
    }
    Ok(())
}
