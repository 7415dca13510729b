//! Decode's products with weights that meet x in a narrower type: the row of x is rounded
//! once (`round_row`, the RMS norm in front where it is fused) to int8 per 32 values for
//! quantized weights or to f16 for F16 weights, and every product that reads it takes the
//! weight in 16-byte items (`matvec`, shaders/matvec_items.wgsl). The rounded row lives in
//! a scratch buffer of the backend, kept and grown; the guard that `round_row` returns
//! holds it until the products are recorded.

use crate::elementwise::count;
use crate::kernels::{MATVEC_F16, MATVEC_Q8, QUANTIZE_ROW, ROW_TO_F16};
use crate::matmul::{chunks, wtype, Epilogue, NormFirst};
use crate::memory::WgpuStorage;
use crate::{f32_tensor, WgpuBackend};
use kiln_core::quant::gpu_layout;
use kiln_core::{DType, Error, Result, Tensor};
use std::sync::MutexGuard;

/// What x is rounded to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Form {
    /// `k / 4` words of int8 quads, then `k / 32` f32 scales.
    Int8,
    /// `k / 2` words of f16 pairs.
    F16,
}

pub(crate) struct RoundedRow<'a> {
    k: usize,
    form: Form,
    scratch: MutexGuard<'a, Option<WgpuStorage>>,
}

/// The form one row of x by `w` is rounded to, if it takes this path: a quantized weight,
/// or an F16 one on a device with f16 arithmetic, whose every chunk's quants start on 16
/// bytes (the kernel reads 16-byte items) and scales on a word.
pub(crate) fn form(b: &WgpuBackend, x: &Tensor, w: &Tensor) -> Result<Option<Form>> {
    let k = w.shape().row_len();
    let form = match w.dtype() {
        _ if x.shape().rows() != 1 => return Ok(None),
        DType::F16 if b.caps.f16 && k.is_multiple_of(8) => Form::F16,
        d if gpu_layout::quant_span(d).is_some() => Form::Int8,
        _ => return Ok(None),
    };
    let aligned = chunks(b, w)?
        .iter()
        .all(|c| c.q_base % 4 == 0 && c.m_base % 4 == 0);
    Ok(aligned.then_some(form))
}

/// The form shared by every product of the one row `x` by `ws`, if there is one.
pub(crate) fn shared_form(b: &WgpuBackend, x: &Tensor, ws: &[&Tensor]) -> Result<Option<Form>> {
    let mut shared = None;
    for w in ws {
        match (form(b, x, w)?, shared) {
            (None, _) => return Ok(None),
            (Some(f), Some(s)) if f != s => return Ok(None),
            (f, _) => shared = f,
        }
    }
    Ok(shared)
}

/// Round the one row of `x` (normed first when `norm` is given) into the scratch.
pub(crate) fn round_row<'a>(
    b: &'a WgpuBackend,
    x: &Tensor,
    norm: Option<&NormFirst>,
    form: Form,
) -> Result<RoundedRow<'a>> {
    let k = x.shape().row_len();
    let unit = match form {
        Form::Int8 => 32,
        Form::F16 => 8,
    };
    if x.shape().rows() != 1 || !k.is_multiple_of(unit) {
        return Err(Error::shape(format!(
            "rounding a row for a product: x {} (one row, a multiple of {unit})",
            x.shape()
        )));
    }
    let bytes = match form {
        Form::Int8 => k + k / 8,
        Form::F16 => 2 * k,
    } + 16;
    let mut scratch = b.rounded_row.lock().unwrap();
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
    let spec = match form {
        Form::Int8 => &QUANTIZE_ROW,
        Form::F16 => &ROW_TO_F16,
    };
    let kernel = b.kernel(spec, &[])?;
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
    Ok(RoundedRow { k, form, scratch })
}

/// `out = x · wᵀ` (or as `epilogue` says) for the row in `row`; `w` must take its form.
pub(crate) fn matvec(
    b: &WgpuBackend,
    row: &RoundedRow,
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
    let spec = match row.form {
        Form::Int8 => &MATVEC_Q8,
        Form::F16 => &MATVEC_F16,
    };
    let kernel = b.kernel(spec, &[("WTYPE", wtype(w.dtype())?)])?;
    let rows_per_group = b.matvec_row_slots();
    for c in chunks(b, w)? {
        if c.q_base % 4 != 0 || c.m_base % 4 != 0 {
            return Err(Error::Device(format!(
                "a chunk of {} at an offset the item kernels cannot read",
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
