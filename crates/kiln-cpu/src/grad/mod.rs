//! The CPU's backward kernels (see [`kiln_core::GradOps`]): f32 loops, the products
//! through the `gemm` crate on the thread pool.

mod attention;
mod cross_entropy;
mod elementwise;
mod matmul;
mod norm;

use crate::CpuBackend;
use kiln_core::{AttentionParams, DType, GradInto, GradOps, Result, RopeLayout, Tensor};

/// A gradient an op writes (`GradInto::Write`) made zeros first, for the loops that add
/// (the products write it themselves).
fn begin(t: &mut Tensor, into: GradInto) -> Result<()> {
    if into == GradInto::Write {
        crate::f32s_mut(t)?.fill(0.0);
    }
    Ok(())
}

impl GradOps for CpuBackend {
    /// Every weight type: a frozen weight is decoded for each backward product over it.
    fn frozen_as_stored(&self, dtype: DType) -> bool {
        DType::ALL.contains(&dtype)
    }

    fn copy(&self, src: &Tensor, dst: &mut Tensor) -> Result<()> {
        elementwise::copy(src, dst)
    }

    fn copy_span(
        &self,
        src: &Tensor,
        src_at: usize,
        dst: &mut Tensor,
        dst_at: usize,
        n: usize,
    ) -> Result<()> {
        elementwise::copy_span(src, src_at, dst, dst_at, n)
    }

    fn sum_squares(&self, x: &Tensor) -> Result<f64> {
        elementwise::sum_squares(&self.pool, x)
    }

    fn add_scaled(&self, acc: &mut Tensor, x: &Tensor, a: f32) -> Result<()> {
        elementwise::add_scaled(&self.pool, acc, x, a)
    }

    fn sum_rows(&self, x: &Tensor, acc: &mut Tensor) -> Result<()> {
        elementwise::sum_rows(x, acc)
    }

    fn matmul_dx(&self, dy: &Tensor, w: &Tensor, dx: &mut Tensor, into: GradInto) -> Result<()> {
        matmul::matmul_dx(&self.pool, &self.decoded, dy, w, dx, into)
    }

    fn matmul_dw(&self, dy: &Tensor, x: &Tensor, dw: &mut Tensor) -> Result<()> {
        matmul::matmul_dw(&self.pool, dy, x, dw)
    }

    fn embedding_backward(&self, dy: &Tensor, ids: &Tensor, dtable: &mut Tensor) -> Result<()> {
        elementwise::embedding_backward(dy, ids, dtable)
    }

    fn rms_norm_backward(
        &self,
        x: &Tensor,
        weight: &Tensor,
        eps: f32,
        dy: &Tensor,
        dx: &mut Tensor,
        into: GradInto,
        dweight: Option<&mut Tensor>,
    ) -> Result<()> {
        begin(dx, into)?;
        norm::rms_norm_backward(&self.pool, x, weight, eps, dy, dx, dweight)
    }

    fn layer_norm_backward(
        &self,
        x: &Tensor,
        weight: &Tensor,
        eps: f32,
        dy: &Tensor,
        dx: &mut Tensor,
        into: GradInto,
        dweight: Option<&mut Tensor>,
    ) -> Result<()> {
        begin(dx, into)?;
        norm::layer_norm_backward(&self.pool, x, weight, eps, dy, dx, dweight)
    }

    fn softmax_backward(&self, y: &Tensor, dy: &Tensor, dx: &mut Tensor) -> Result<()> {
        norm::softmax_backward(&self.pool, y, dy, dx)
    }

    fn rope_backward(
        &self,
        d: &mut Tensor,
        pos: &Tensor,
        inv_freq: &Tensor,
        layout: RopeLayout,
    ) -> Result<()> {
        elementwise::rope_backward(d, pos, inv_freq, layout)
    }

    fn attention_backward(
        &self,
        q: &Tensor,
        k_cache: &Tensor,
        v_cache: &Tensor,
        pos: &Tensor,
        params: &AttentionParams,
        dout: &Tensor,
        dq: &mut Tensor,
        dk: &mut Tensor,
        dv: &mut Tensor,
    ) -> Result<()> {
        attention::attention_backward(
            &self.pool, q, k_cache, v_cache, pos, params, dout, dq, dk, dv,
        )
    }

    fn gated_backward(
        &self,
        gate: &Tensor,
        up: &Tensor,
        gelu: bool,
        dout: &Tensor,
        dgate: &mut Tensor,
        dup: &mut Tensor,
        into: GradInto,
    ) -> Result<()> {
        begin(dgate, into)?;
        begin(dup, into)?;
        elementwise::gated_backward(&self.pool, gate, up, gelu, dout, dgate, dup)
    }

    fn gelu_backward(&self, x: &Tensor, dy: &Tensor, dx: &mut Tensor) -> Result<()> {
        elementwise::gelu_backward(&self.pool, x, dy, dx)
    }

    fn softcap_backward(&self, y: &Tensor, cap: f32, dy: &Tensor, dx: &mut Tensor) -> Result<()> {
        elementwise::softcap_backward(y, cap, dy, dx)
    }

    fn slice_cols_backward(&self, ddst: &Tensor, col0: usize, dsrc: &mut Tensor) -> Result<()> {
        elementwise::slice_cols_backward(ddst, col0, dsrc)
    }

    fn gather_rows(
        &self,
        ddst: &Tensor,
        pos: &Tensor,
        dsrc: &mut Tensor,
        into: GradInto,
    ) -> Result<()> {
        begin(dsrc, into)?;
        elementwise::gather_rows(ddst, pos, dsrc)
    }

    fn zero_rows(&self, ddst: &mut Tensor, pos: &Tensor) -> Result<()> {
        elementwise::zero_rows(ddst, pos)
    }

    fn cross_entropy(
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
        cross_entropy::cross_entropy(
            &self.pool,
            &self.decoded,
            h,
            w,
            targets,
            softcap,
            scale,
            losses,
            dh,
            dw,
        )
    }
}
