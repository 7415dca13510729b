//! RMSNorm, LayerNorm and softmax: one block per row.

use crate::kernels::Arg;
use crate::{expect, ptr, same_shape, to_i32, CudaBackend};
use kiln_core::{DType, Error, Result, Tensor};

/// The largest block of rms_norm and layer_norm, which each must be able to run.
pub(crate) const MAX_THREADS: u32 = 1024;

/// Threads per row: one float4 each where the row allows, in whole warps, at most
/// [`MAX_THREADS`].
fn block_for(dim: usize) -> (u32, u32, u32) {
    (
        (dim.div_ceil(4).div_ceil(32) * 32).clamp(32, MAX_THREADS as usize) as u32,
        1,
        1,
    )
}

fn rows(x: &Tensor) -> Result<u32> {
    Ok(to_i32(x.shape().rows(), "rows")? as u32)
}

fn check_vector(v: &Tensor, dim: usize, what: &str) -> Result<()> {
    expect(v, DType::F32, what)?;
    if v.shape().numel() != dim {
        return Err(Error::shape(format!(
            "{what} has {} values for rows of {dim}",
            v.shape().numel()
        )));
    }
    Ok(())
}

pub(crate) fn rms_norm(
    b: &CudaBackend,
    x: &Tensor,
    w: &Tensor,
    eps: f32,
    out: &mut Tensor,
) -> Result<()> {
    rms_norm_with(b, x, w, eps, out, Copies::default())
}

/// What an RMSNorm launch writes besides its output (device addresses): the output as
/// the quantized matvec kernels read it (int8 rows and per-32 scales, rows of whole
/// 32-value units), a copy of x, the output rounded to BF16 (`bf16`) or F16 as
/// f32_to_half rounds it. The last two need rows of whole float4 steps.
#[derive(Default)]
struct Copies {
    quantized: Option<[Arg; 2]>,
    x_copy: Option<u64>,
    rounded: Option<(u64, bool)>,
}

/// `rms_norm`, also writing its output as the quantized matvec kernels read it (in the
/// buffers `matmul::quantized_x` hands out). Rows of a multiple of 32 values.
pub(crate) fn rms_norm_quantized(
    b: &CudaBackend,
    x: &Tensor,
    w: &Tensor,
    eps: f32,
    out: &mut Tensor,
) -> Result<[Arg; 2]> {
    let quantized = crate::matmul::quantized_x(b, x.shape().numel())?;
    let copies = Copies {
        quantized: Some(quantized),
        ..Copies::default()
    };
    rms_norm_with(b, x, w, eps, out, copies)?;
    Ok(quantized)
}

/// `rms_norm`, also writing its output rounded to BF16 (`bf16`) or F16 at `dst`, noted as
/// the stream's latest rounded copy so that the 16-bit products reading `out` next take
/// it instead of rounding `out` again. Rows of a multiple of 4 values.
pub(crate) fn rms_norm_rounded(
    b: &CudaBackend,
    norm: (&Tensor, &Tensor, f32),
    out: &mut Tensor,
    dst: u64,
    bf16: bool,
) -> Result<()> {
    let (x, w, eps) = norm;
    let copies = Copies {
        rounded: Some((dst, bf16)),
        ..Copies::default()
    };
    rms_norm_with(b, x, w, eps, out, copies)?;
    b.note_rounded_copy(ptr(out)?, out.shape().numel(), bf16, dst);
    Ok(())
}

fn rms_norm_with(
    b: &CudaBackend,
    x: &Tensor,
    w: &Tensor,
    eps: f32,
    out: &mut Tensor,
    copies: Copies,
) -> Result<()> {
    expect(x, DType::F32, "rms_norm input")?;
    expect(out, DType::F32, "rms_norm output")?;
    same_shape(x, out, "rms_norm")?;
    let dim = x.shape().row_len();
    check_vector(w, dim, "rms_norm weight")?;
    if x.shape().numel() == 0 {
        return Ok(());
    }
    if copies.quantized.is_some() && !dim.is_multiple_of(32) {
        return Err(Error::shape(format!(
            "rms_norm into int8: rows of {dim} are not whole 32-value units"
        )));
    }
    if (copies.x_copy.is_some() || copies.rounded.is_some()) && !dim.is_multiple_of(4) {
        return Err(Error::shape(format!(
            "rms_norm with copies: rows of {dim} are not whole float4 steps"
        )));
    }
    let [xq, xd] = copies.quantized.unwrap_or([Arg::Ptr(0), Arg::Ptr(0)]);
    let (rounded, bf16) = copies.rounded.unwrap_or((0, false));
    b.launch(
        "rms_norm",
        (rows(x)?, 1, 1),
        block_for(dim),
        0,
        &[
            Arg::Ptr(ptr(x)?),
            Arg::Ptr(ptr(w)?),
            Arg::Ptr(ptr(out)?),
            xq,
            xd,
            Arg::I32(to_i32(dim, "row length")?),
            Arg::F32(eps),
            Arg::Ptr(copies.x_copy.unwrap_or(0)),
            Arg::Ptr(rounded),
            Arg::I32(bf16 as i32),
        ],
    )
}

/// [`rms_norm`] also writing its output rounded to `half` (BF16 or F16) and, with
/// `copy_x`, a copy of `x` (see `GradOps::rms_norm_saving`): the two new tensors, or
/// `None` for rows that are not whole float4 steps.
pub(crate) fn rms_norm_saving(
    b: &CudaBackend,
    x: &Tensor,
    w: &Tensor,
    eps: f32,
    out: &mut Tensor,
    half: DType,
    copy_x: bool,
) -> Result<Option<(Option<Tensor>, Tensor)>> {
    if x.shape().numel() == 0 || !x.shape().row_len().is_multiple_of(4) {
        return Ok(None);
    }
    let x_copy = match copy_x {
        true => Some(b.alloc_tensor(DType::F32, x.shape().clone())?),
        false => None,
    };
    let out_half = b.alloc_tensor(half, x.shape().clone())?;
    let copies = Copies {
        quantized: None,
        x_copy: x_copy.as_ref().map(ptr).transpose()?,
        rounded: Some((ptr(&out_half)?, half == DType::BF16)),
    };
    rms_norm_with(b, x, w, eps, out, copies)?;
    Ok(Some((x_copy, out_half)))
}

pub(crate) fn layer_norm(
    b: &CudaBackend,
    x: &Tensor,
    w: &Tensor,
    bias: &Tensor,
    eps: f32,
    out: &mut Tensor,
) -> Result<()> {
    expect(x, DType::F32, "layer_norm input")?;
    same_shape(x, out, "layer_norm")?;
    let dim = x.shape().row_len();
    check_vector(w, dim, "layer_norm weight")?;
    check_vector(bias, dim, "layer_norm bias")?;
    if x.shape().numel() == 0 {
        return Ok(());
    }
    b.launch(
        "layer_norm",
        (rows(x)?, 1, 1),
        block_for(dim),
        0,
        &[
            Arg::Ptr(ptr(x)?),
            Arg::Ptr(ptr(w)?),
            Arg::Ptr(ptr(bias)?),
            Arg::Ptr(ptr(out)?),
            Arg::I32(to_i32(dim, "row length")?),
            Arg::F32(eps),
        ],
    )
}

pub(crate) fn softmax(b: &CudaBackend, x: &mut Tensor) -> Result<()> {
    expect(x, DType::F32, "softmax input")?;
    if x.shape().numel() == 0 {
        return Ok(());
    }
    b.launch(
        "softmax",
        (rows(x)?, 1, 1),
        (256, 1, 1),
        0,
        &[
            Arg::Ptr(ptr(x)?),
            Arg::I32(to_i32(x.shape().row_len(), "row length")?),
        ],
    )
}
