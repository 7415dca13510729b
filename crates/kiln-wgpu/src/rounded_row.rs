//! Decode's products with weights that meet x in a narrower type: the row of x is rounded
//! once (`round_row`, the RMS norm in front where it is fused) to int8 per 32 values for
//! quantized weights or to f16 for F16 weights, and every product that reads it takes the
//! weight in 16-byte items (`matvec`, shaders/matvec_items.wgsl). The rounded row lives in
//! a scratch buffer of the backend, kept and grown; the guard that `round_row` returns
//! holds it until the products are recorded.

use crate::elementwise::count;
use crate::kernels::{
    ITEM_BINDING_COUNT, MATVEC_F16, MATVEC_F16_GATED, MATVEC_Q8, MATVEC_Q8_GATED, QUANTIZE_ROW,
    ROW_TO_F16,
};
use crate::matmul::{chunks, wtype, Chunk, Epilogue, NormFirst};
use crate::memory::WgpuStorage;
use crate::stream::Binding;
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
        _ if x.shape().rows() != 1 || b.caps.storage_bindings < ITEM_BINDING_COUNT => {
            return Ok(None)
        }
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
    check(row, w, out)?;
    let ob = f32_tensor(out, "matmul output")?;
    let xq = row.binding();
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
    for c in item_chunks(b, w)? {
        let p = Piece { w, c: &c, out: ob };
        dispatch(b, row, row.spec(false), &[p], aux, mode)?;
    }
    Ok(())
}

/// `outs[i] = x · ws[i]ᵀ` for the row in `row`, every weight taking its form: up to three
/// weights of one type a dispatch where each is one binding (Q, K and V of a layer).
pub(crate) fn matvec_many(
    b: &WgpuBackend,
    row: &RoundedRow,
    ws: &[&Tensor],
    outs: &mut [&mut Tensor],
) -> Result<()> {
    if ws.len() != outs.len() {
        return Err(Error::shape("matmul_many: as many outputs as weights"));
    }
    let mut first = 0;
    while first < ws.len() {
        let mut end = first + 1;
        let Some(c0) = whole(b, ws[first])? else {
            matvec(b, row, ws[first], outs[first], Epilogue::Store)?;
            first += 1;
            continue;
        };
        let mut cs = vec![c0];
        while end < ws.len() && end - first < 3 && ws[end].dtype() == ws[first].dtype() {
            match whole(b, ws[end])? {
                Some(c) => cs.push(c),
                None => break,
            }
            end += 1;
        }
        let mut pieces = Vec::with_capacity(cs.len());
        for (i, c) in cs.iter().enumerate() {
            check(row, ws[first + i], outs[first + i])?;
            pieces.push(Piece {
                w: ws[first + i],
                c,
                out: f32_tensor(outs[first + i], "matmul output")?,
            });
        }
        dispatch(b, row, row.spec(false), &pieces, row.binding(), 0)?;
        first = end;
    }
    Ok(())
}

/// `out = act(x · gateᵀ) · (x · upᵀ)` (SiLU, or GELU when `gelu`) for the row in `row`,
/// both products in one dispatch where each weight is one binding of one type; `tmp_gate`
/// holds the gate's product otherwise.
pub(crate) fn matvec_gated(
    b: &WgpuBackend,
    row: &RoundedRow,
    gate: &Tensor,
    up: &Tensor,
    gelu: bool,
    out: &mut Tensor,
    tmp_gate: &mut Tensor,
) -> Result<()> {
    let (gc, uc) = (item_chunks(b, gate)?, item_chunks(b, up)?);
    if gc.len() != 1 || uc.len() != 1 || gate.dtype() != up.dtype() || gate.dims() != up.dims() {
        matvec(b, row, gate, tmp_gate, Epilogue::Store)?;
        let epilogue = Epilogue::Gated {
            gate: tmp_gate,
            gelu,
        };
        return matvec(b, row, up, out, epilogue);
    }
    check(row, gate, out)?;
    let ob = f32_tensor(out, "gated product output")?;
    let pieces = [
        Piece {
            w: gate,
            c: &gc[0],
            out: ob,
        },
        Piece {
            w: up,
            c: &uc[0],
            out: ob,
        },
    ];
    let mode = 2 + u32::from(gelu);
    dispatch(b, row, row.spec(true), &pieces, row.binding(), mode)
}

/// One weight's chunk and where its results go.
struct Piece<'a> {
    w: &'a Tensor,
    c: &'a Chunk<'a>,
    out: Binding<'a>,
}

impl RoundedRow<'_> {
    fn binding(&self) -> Binding<'_> {
        self.scratch.as_ref().unwrap().binding()
    }

    fn spec(&self, gated: bool) -> &'static crate::kernels::KernelSpec {
        match (self.form, gated) {
            (Form::Int8, false) => &MATVEC_Q8,
            (Form::F16, false) => &MATVEC_F16,
            (Form::Int8, true) => &MATVEC_Q8_GATED,
            (Form::F16, true) => &MATVEC_F16_GATED,
        }
    }
}

fn check(row: &RoundedRow, w: &Tensor, out: &Tensor) -> Result<()> {
    let (m, k) = (w.shape().rows(), w.shape().row_len());
    if k != row.k || out.shape().rows() != 1 || out.shape().row_len() != m {
        return Err(Error::shape(format!(
            "matmul: a row of {} · w {}ᵀ into {}",
            row.k,
            w.shape(),
            out.shape()
        )));
    }
    Ok(())
}

/// `w` as one chunk, if it is bound whole.
fn whole<'a>(b: &WgpuBackend, w: &'a Tensor) -> Result<Option<Chunk<'a>>> {
    let mut cs = item_chunks(b, w)?;
    Ok(if cs.len() == 1 { cs.pop() } else { None })
}

/// `w`'s chunks, each at offsets the item kernels can read.
fn item_chunks<'a>(b: &WgpuBackend, w: &'a Tensor) -> Result<Vec<Chunk<'a>>> {
    let cs = chunks(b, w)?;
    if cs.iter().any(|c| c.q_base % 4 != 0 || c.m_base % 4 != 0) {
        return Err(Error::Device(format!(
            "a chunk of {} at an offset the item kernels cannot read",
            w.shape()
        )));
    }
    Ok(cs)
}

/// One dispatch of `spec` over `pieces` (one to three weights of one type; the first may
/// be a chunk, the others are whole): each weight's rows in workgroups of their own
/// (matvec_items), or the first weight's rows with the second's beside them
/// (matvec_items_gated).
fn dispatch(
    b: &WgpuBackend,
    row: &RoundedRow,
    spec: &crate::kernels::KernelSpec,
    pieces: &[Piece],
    aux: Binding,
    mode: u32,
) -> Result<()> {
    let what = "matmul";
    let kernel = b.kernel(spec, &[("WTYPE", wtype(pieces[0].w.dtype())?)])?;
    let per_group = b.matvec_row_slots();
    let first = &pieces[0];
    let at = |i: usize| pieces.get(i).unwrap_or(first);
    let gated = spec.entry == "matvec_items_gated";
    let weights = if gated { 1 } else { pieces.len() };
    let groups_of = |i: usize| pieces[i].c.rows.div_ceil(per_group);
    let (groups, groups_x) = b.grid((0..weights).map(groups_of).sum())?;
    // Workgroups where weights 1 and 2 begin (past every workgroup when absent).
    let (g0, g1) = match weights {
        1 => (u32::MAX, u32::MAX),
        2 => (count(groups_of(0), what)?, u32::MAX),
        _ => (
            count(groups_of(0), what)?,
            count(groups_of(0) + groups_of(1), what)?,
        ),
    };
    let mut params = [0u32; 14];
    params.copy_from_slice(&[
        count(row.k, what)?,
        count(first.c.rows, what)?,
        g0,
        first.c.q_base,
        first.c.m_base,
        count(first.c.row0, what)?,
        g1,
        per_group as u32,
        groups_x,
        count(at(1).c.rows, what)?,
        mode,
        at(1).c.m_base,
        count(at(2).c.rows, what)?,
        at(2).c.m_base,
    ]);
    let xq = row.binding();
    let bindings = [
        xq,
        first.c.quants,
        first.c.scales,
        first.out,
        aux,
        at(1).c.quants,
        at(1).c.scales,
        at(1).out,
        at(2).c.quants,
        at(2).c.scales,
        at(2).out,
    ];
    b.stream.dispatch(&kernel, &bindings, &params, groups)
}
