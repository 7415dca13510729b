//! Element-wise ops and column slices: one lane per element.

use crate::kernels::{BINARY, FILL, GATED, SLICE_COLS, UNARY};
use crate::{f32_tensor, WgpuBackend};
use kiln_core::{Error, Result, Tensor};

/// Element count as the shaders' u32, or an error for tensors past 2^32 elements.
pub(crate) fn count(n: usize, what: &str) -> Result<u32> {
    u32::try_from(n).map_err(|_| {
        Error::shape(format!(
            "{what}: {n} elements are more than one wgpu dispatch addresses (2^32)"
        ))
    })
}

/// The shaders' `EParams`, less the grid: what an element-wise kernel is told.
#[derive(Default)]
struct Elementwise {
    /// Elements to write.
    n: usize,
    op: u32,
    a: f32,
    len: u32,
    cols: u32,
    col0: u32,
}

/// Dispatch an element-wise kernel over `p.n` elements.
fn launch(
    b: &WgpuBackend,
    spec: &crate::kernels::KernelSpec,
    bindings: &[crate::stream::Binding],
    p: Elementwise,
    what: &str,
) -> Result<()> {
    let n32 = count(p.n, what)?;
    let (groups, groups_x) = b.grid(p.n.div_ceil(256))?;
    let kernel = b.kernel(spec, &[])?;
    b.stream.dispatch(
        &kernel,
        bindings,
        &[n32, p.op, p.a.to_bits(), p.len, p.cols, p.col0, groups_x],
        groups,
    )
}

pub(crate) fn fill(b: &WgpuBackend, t: &mut Tensor, value: f32) -> Result<()> {
    let n = t.shape().numel();
    let dst = f32_tensor(t, "fill")?;
    let p = Elementwise {
        n,
        a: value,
        ..Default::default()
    };
    launch(b, &FILL, &[dst], p, "fill")
}

pub(crate) fn binary(
    b: &WgpuBackend,
    acc: &mut Tensor,
    x: &Tensor,
    op: u32,
    what: &str,
) -> Result<()> {
    let n = acc.shape().numel();
    let len = x.shape().numel();
    let broadcast_row = len == acc.shape().row_len() && acc.dims().last() == x.dims().last();
    if !(x.dims() == acc.dims() || broadcast_row) || len == 0 && n > 0 {
        return Err(Error::shape(format!(
            "{what}: {} cannot be applied to {}",
            x.shape(),
            acc.shape()
        )));
    }
    let (dst, src) = (f32_tensor(acc, what)?, f32_tensor(x, what)?);
    let p = Elementwise {
        n,
        op,
        len: count(len.max(1), what)?,
        ..Default::default()
    };
    launch(b, &BINARY, &[dst, src], p, what)
}

pub(crate) fn unary(b: &WgpuBackend, x: &mut Tensor, op: u32, a: f32) -> Result<()> {
    let n = x.shape().numel();
    let dst = f32_tensor(x, "unary op")?;
    let p = Elementwise {
        n,
        op,
        a,
        ..Default::default()
    };
    launch(b, &UNARY, &[dst], p, "unary op")
}

pub(crate) fn gated(
    b: &WgpuBackend,
    gate: &Tensor,
    up: &Tensor,
    out: &mut Tensor,
    op: u32,
) -> Result<()> {
    if gate.dims() != up.dims() || out.dims() != gate.dims() {
        return Err(Error::shape(format!(
            "gated activation: gate {}, up {}, out {}",
            gate.shape(),
            up.shape(),
            out.shape()
        )));
    }
    let n = gate.shape().numel();
    let bindings = [
        f32_tensor(gate, "gate")?,
        f32_tensor(up, "up")?,
        f32_tensor(out, "gated output")?,
    ];
    let p = Elementwise {
        n,
        op,
        ..Default::default()
    };
    launch(b, &GATED, &bindings, p, "gated activation")
}

pub(crate) fn slice_cols(
    b: &WgpuBackend,
    src: &Tensor,
    col0: usize,
    dst: &mut Tensor,
) -> Result<()> {
    let (&[rows, src_cols], &[dst_rows, dst_cols]) = (src.dims(), dst.dims()) else {
        return Err(Error::shape(format!(
            "slice_cols takes 2-D tensors, got {} and {}",
            src.shape(),
            dst.shape()
        )));
    };
    if rows != dst_rows || col0.checked_add(dst_cols).is_none_or(|end| end > src_cols) {
        return Err(Error::shape(format!(
            "slice_cols: columns {col0}..{} of {} into {}",
            col0.saturating_add(dst_cols),
            src.shape(),
            dst.shape()
        )));
    }
    let what = "slice_cols";
    let bindings = [f32_tensor(src, what)?, f32_tensor(dst, what)?];
    let p = Elementwise {
        n: rows * dst_cols,
        len: count(dst_cols.max(1), what)?,
        cols: count(src_cols, what)?,
        col0: count(col0, what)?,
        ..Default::default()
    };
    launch(b, &SLICE_COLS, &bindings, p, what)
}
