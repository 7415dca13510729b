//! Row reductions: RMS and layer norms, softmax, argmax. One workgroup per row.

use crate::elementwise::count;
use crate::kernels::{ARGMAX, LAYER_NORM, RMS_NORM, SOFTMAX};
use crate::stream::Binding;
use crate::{f32_tensor, WgpuBackend};
use kiln_core::{DType, Error, Result, Tensor};

fn launch(
    b: &WgpuBackend,
    spec: &crate::kernels::KernelSpec,
    bindings: &[Binding],
    rows: usize,
    cols: usize,
    eps: f32,
) -> Result<()> {
    let (groups, groups_x) = b.grid(rows)?;
    let kernel = b.kernel(spec, &[])?;
    b.stream.dispatch(
        &kernel,
        bindings,
        &[
            count(cols, "row")?,
            eps.to_bits(),
            count(rows, "rows")?,
            groups_x,
        ],
        groups,
    )
}

fn check_norm(x: &Tensor, weight: &Tensor, out: &Tensor, what: &str) -> Result<()> {
    if x.dims() != out.dims() || weight.shape().numel() != x.shape().row_len() {
        return Err(Error::shape(format!(
            "{what}: x {}, weight {}, out {}",
            x.shape(),
            weight.shape(),
            out.shape()
        )));
    }
    Ok(())
}

pub(crate) fn rms_norm(
    b: &WgpuBackend,
    x: &Tensor,
    weight: &Tensor,
    eps: f32,
    out: &mut Tensor,
) -> Result<()> {
    check_norm(x, weight, out, "rms_norm")?;
    let w = f32_tensor(weight, "rms_norm weight")?;
    let bindings = [
        f32_tensor(x, "rms_norm input")?,
        w,
        w,
        f32_tensor(out, "rms_norm output")?,
    ];
    launch(
        b,
        &RMS_NORM,
        &bindings,
        x.shape().rows(),
        x.shape().row_len(),
        eps,
    )
}

pub(crate) fn layer_norm(
    b: &WgpuBackend,
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    eps: f32,
    out: &mut Tensor,
) -> Result<()> {
    check_norm(x, weight, out, "layer_norm")?;
    check_norm(x, bias, out, "layer_norm bias")?;
    let bindings = [
        f32_tensor(x, "layer_norm input")?,
        f32_tensor(weight, "layer_norm weight")?,
        f32_tensor(bias, "layer_norm bias")?,
        f32_tensor(out, "layer_norm output")?,
    ];
    launch(
        b,
        &LAYER_NORM,
        &bindings,
        x.shape().rows(),
        x.shape().row_len(),
        eps,
    )
}

pub(crate) fn softmax(b: &WgpuBackend, x: &mut Tensor) -> Result<()> {
    let (rows, cols) = (x.shape().rows(), x.shape().row_len());
    let bindings = [f32_tensor(x, "softmax")?];
    launch(b, &SOFTMAX, &bindings, rows, cols, 0.0)
}

pub(crate) fn argmax(b: &WgpuBackend, x: &Tensor, out: &mut Tensor) -> Result<()> {
    let (rows, cols) = (x.shape().rows(), x.shape().row_len());
    if out.dtype() != DType::I32 || out.shape().numel() != rows || cols == 0 {
        return Err(Error::shape(format!(
            "argmax of {} into {} {}",
            x.shape(),
            out.dtype(),
            out.shape()
        )));
    }
    if cols >= 1 << 24 {
        return Err(Error::shape(format!(
            "argmax: rows of {cols} values are past what the shader indexes exactly (2^24)"
        )));
    }
    let bindings = [
        f32_tensor(x, "argmax input")?,
        crate::storage(out, "argmax output")?.binding(),
    ];
    launch(b, &ARGMAX, &bindings, rows, cols, 0.0)
}
