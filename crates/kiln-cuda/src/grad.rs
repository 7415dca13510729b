//! The backward kernels (`kiln_core::GradOps`) on the GPU: `kernels/grad.cu`, and cuBLAS
//! for the products; attention's backward (and the training forward that keeps what it
//! needs) in `attention`, the loss fused with the output projection in `loss`.

mod attention;
mod loss;

use crate::blas::{round_into, sgemm, sgemm_rounded_a};
use crate::kernels::Arg;
use crate::{expect, ptr, same_shape, to_i32, CudaBackend};
use kiln_core::{
    AttentionParams, AttentionRun, AttentionSaved, Backend, DType, Error, GradInto, GradOps, Pages,
    Products, Result, RopeLayout, Shape, Tensor,
};

/// cuBLAS's β for a product into a gradient: 1 adds, 0 writes (C is not read).
pub(crate) fn beta(into: GradInto) -> f32 {
    match into {
        GradInto::Add => 1.0,
        GradInto::Write => 0.0,
    }
}

/// Blocks of `sum_squares` at most: its partials are read back and added on the host.
const SUM_BLOCKS: usize = 1024;

fn f32s(ts: &[&Tensor], op: &str) -> Result<()> {
    ts.iter().try_for_each(|t| expect(t, DType::F32, op))
}

fn rows_of(t: &Tensor) -> (usize, usize) {
    (t.shape().rows(), t.shape().row_len())
}

/// Rows of `t` by its outermost dimension, and the elements of each.
fn outer_rows(t: &Tensor) -> (usize, usize) {
    let rows = t.dims().first().copied().unwrap_or(1);
    (rows, t.shape().numel() / rows.max(1))
}

impl CudaBackend {
    fn launch_rows(
        &self,
        name: &'static str,
        rows: usize,
        threads: u32,
        args: &[Arg],
    ) -> Result<()> {
        if rows == 0 {
            return Ok(());
        }
        let grid = u32::try_from(rows).map_err(|_| Error::shape(format!("{name}: {rows} rows")))?;
        self.launch(name, (grid, 1, 1), (threads, 1, 1), 0, args)
    }
}

impl GradOps for CudaBackend {
    fn set_products(&self, how: Products) -> Result<()> {
        self.blas.set_f32_products(how);
        Ok(())
    }

    fn copy(&self, src: &Tensor, dst: &mut Tensor) -> Result<()> {
        if src.dtype() != dst.dtype()
            || src.shape().numel() != dst.shape().numel()
            || src.dtype().block_bytes() != 4
        {
            return Err(Error::shape(format!(
                "copy: {} {} into {} {} (4-byte elements of one count)",
                src.dtype(),
                src.shape(),
                dst.dtype(),
                dst.shape()
            )));
        }
        let n = src.shape().numel();
        self.launch_1d(
            "grad_copy",
            n.div_ceil(4),
            &[Arg::Ptr(ptr(dst)?), Arg::Ptr(ptr(src)?), Arg::U64(n as u64)],
        )
    }

    fn copy_span(
        &self,
        src: &Tensor,
        src_at: usize,
        dst: &mut Tensor,
        dst_at: usize,
        n: usize,
    ) -> Result<()> {
        f32s(&[src, dst], "copy_span")?;
        for (what, t, at) in [("source", src, src_at), ("destination", &*dst, dst_at)] {
            let len = t.shape().numel();
            if at.checked_add(n).is_none_or(|end| end > len) {
                return Err(Error::shape(format!(
                    "copy_span: {n} elements at {at} reach past the {what}'s {len}"
                )));
            }
        }
        self.launch_1d(
            "grad_copy",
            n.div_ceil(4),
            &[
                Arg::Ptr(ptr(dst)? + 4 * dst_at as u64),
                Arg::Ptr(ptr(src)? + 4 * src_at as u64),
                Arg::U64(n as u64),
            ],
        )
    }

    fn sum_squares(&self, x: &Tensor) -> Result<f64> {
        f32s(&[x], "sum_squares")?;
        let n = x.shape().numel();
        let blocks = n.div_ceil(256 * 16).clamp(1, SUM_BLOCKS);
        // f64 partials in an F32 tensor of twice as many words, read back whole.
        let partials = self.zeros(DType::F32, Shape::new(vec![2 * blocks])?)?;
        self.launch(
            "grad_sum_squares",
            (blocks as u32, 1, 1),
            (256, 1, 1),
            0,
            &[
                Arg::Ptr(ptr(x)?),
                Arg::U64(n as u64),
                Arg::Ptr(ptr(&partials)?),
            ],
        )?;
        Ok(self
            .download(&partials)?
            .chunks_exact(8)
            .map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes")))
            .sum())
    }

    fn add_scaled(&self, acc: &mut Tensor, x: &Tensor, a: f32) -> Result<()> {
        f32s(&[acc, x], "add_scaled")?;
        let n = acc.shape().numel();
        if x.shape().numel() != n {
            return Err(Error::shape(format!(
                "add_scaled: {} into {}",
                x.shape(),
                acc.shape()
            )));
        }
        self.launch_1d(
            "grad_add_scaled",
            n.div_ceil(4),
            &[
                Arg::Ptr(ptr(acc)?),
                Arg::Ptr(ptr(x)?),
                Arg::U64(n as u64),
                Arg::F32(a),
            ],
        )
    }

    fn sum_rows(&self, x: &Tensor, acc: &mut Tensor) -> Result<()> {
        f32s(&[x, acc], "sum_rows")?;
        let (rows, cols) = rows_of(x);
        if acc.shape().numel() != cols {
            return Err(Error::shape(format!(
                "sum_rows: rows of {} into {}",
                x.shape(),
                acc.shape()
            )));
        }
        self.launch_1d(
            "grad_sum_rows",
            cols,
            &[
                Arg::Ptr(ptr(x)?),
                Arg::Ptr(ptr(acc)?),
                Arg::I32(to_i32(rows, "rows")?),
                Arg::I32(to_i32(cols, "columns")?),
            ],
        )
    }

    fn frozen_as_stored(&self, dtype: DType) -> bool {
        crate::frozen::takes(dtype)
    }

    fn paged_attention_saving(
        &self,
        q: &Tensor,
        k_pool: &Tensor,
        v_pool: &Tensor,
        pos: &Tensor,
        pages: &Pages,
        params: &AttentionParams,
        out: &mut Tensor,
        lse: &mut Tensor,
        out_rounded: &mut Tensor,
    ) -> Result<bool> {
        self.attention_forward_kept(q, k_pool, v_pool, pos, pages, params, out, lse, out_rounded)
    }

    fn rounded_for_products(&self, x: &Tensor) -> Result<Option<Tensor>> {
        expect(x, DType::F32, "a rounded copy")?;
        let Some(dtype) = self.rounded_type() else {
            return Ok(None);
        };
        let out = self.alloc_tensor(dtype, x.shape().clone())?;
        let n = x.shape().numel();
        let (src, dst, bf16) = (ptr(x)?, ptr(&out)?, dtype == DType::BF16);
        round_into(self, src, dst, n, bf16)?;
        // The forward product over `x` that follows reads this copy instead of rounding.
        self.note_rounded_copy(src, n, bf16, dst);
        Ok(Some(out))
    }

    fn rms_norm_saving(
        &self,
        x: &Tensor,
        weight: &Tensor,
        eps: f32,
        out: &mut Tensor,
        copy_x: bool,
    ) -> Result<Option<(Option<Tensor>, Tensor)>> {
        let Some(dtype) = self.rounded_type() else {
            return Ok(None);
        };
        let Some(kept) = crate::norm::rms_norm_saving(self, x, weight, eps, out, dtype, copy_x)?
        else {
            return Ok(None);
        };
        // The products that read the output next read its rounded copy.
        let n = out.shape().numel();
        self.note_rounded_copy(ptr(out)?, n, dtype == DType::BF16, ptr(&kept.1)?);
        Ok(Some(kept))
    }

    fn gated_saving(
        &self,
        gate: &Tensor,
        up: &Tensor,
        gelu: bool,
        out: &mut Tensor,
    ) -> Result<Option<[Tensor; 3]>> {
        let Some(dtype) = self.rounded_type() else {
            return Ok(None);
        };
        let kept = [
            self.alloc_tensor(dtype, gate.shape().clone())?,
            self.alloc_tensor(dtype, gate.shape().clone())?,
            self.alloc_tensor(dtype, gate.shape().clone())?,
        ];
        // The down projection that follows reads the rounded output instead of rounding.
        crate::elementwise::gated_rounded(
            self,
            gelu,
            gate,
            up,
            out,
            ptr(&kept[2])?,
            Some([ptr(&kept[0])?, ptr(&kept[1])?]),
            dtype == DType::BF16,
        )?;
        Ok(Some(kept))
    }

    fn matmul_dx(&self, dy: &Tensor, w: &Tensor, dx: &mut Tensor, into: GradInto) -> Result<()> {
        f32s(&[dy, dx], "matmul_dx")?;
        let (n, m) = rows_of(dy);
        let &[wm, k] = w.dims() else {
            return Err(Error::shape(format!("matmul_dx: weight {}", w.shape())));
        };
        if wm != m || rows_of(dx) != (n, k) {
            return Err(Error::shape(format!(
                "matmul_dx: dy {} · w {} into {}",
                dy.shape(),
                w.shape(),
                dx.shape()
            )));
        }
        if m == 0 {
            // Nothing to add; a gradient to write is zeros.
            return match into {
                GradInto::Add => Ok(()),
                GradInto::Write => self.fill(dx, 0.0),
            };
        }
        if w.dtype() != DType::F32 {
            return self.matmul_dx_stored(ptr(dy)?, w, ptr(dx)?, (n, m, k), beta(into));
        }
        // Row-major dx[n, k] += dy[n, m]·w[m, k]: column-major dxᵀ = wᵀ·dyᵀ, where w read
        // as k × m column-major is wᵀ and dy as m × n is dyᵀ.
        sgemm(
            self,
            (false, false),
            (k, n, m),
            (ptr(w)?, k),
            (ptr(dy)?, m),
            beta(into),
            (ptr(dx)?, k),
        )
    }

    fn matmul_dw(&self, dy: &Tensor, x: &Tensor, dw: &mut Tensor) -> Result<()> {
        f32s(&[dy, dw], "matmul_dw")?;
        // F32, or 16-bit as the products round it (rounded_for_products).
        let x_rounded = x.dtype() != DType::F32;
        if x_rounded && Some(x.dtype()) != self.rounded_type() {
            return Err(Error::unsupported(format!(
                "matmul_dw over a {} input under {} products",
                x.dtype(),
                self.blas.f32_products().name()
            )));
        }
        let (n, m) = rows_of(dy);
        let &[wm, k] = dw.dims() else {
            return Err(Error::shape(format!("matmul_dw: weight {}", dw.shape())));
        };
        // A kept rounded input may carry the shape of the op that made it (the attention's
        // [n, heads, head_dim] output, read by its projection as [n, dim]): its elements,
        // row-major, are what count.
        let x_fits = match x_rounded {
            true => x.shape().numel() == n * k,
            false => rows_of(x) == (n, k),
        };
        if wm != m || !x_fits {
            return Err(Error::shape(format!(
                "matmul_dw: dy {}ᵀ · x {} into {}",
                dy.shape(),
                x.shape(),
                dw.shape()
            )));
        }
        if n == 0 {
            return Ok(());
        }
        // Row-major dw[m, k] += dyᵀ·x: column-major dwᵀ (k × m) = xᵀ (x read as k × n) ·
        // dy (dy read as m × n, transposed).
        let product = if x_rounded { sgemm_rounded_a } else { sgemm };
        product(
            self,
            (false, true),
            (k, m, n),
            (ptr(x)?, k),
            (ptr(dy)?, m),
            1.0,
            (ptr(dw)?, k),
        )
    }

    fn embedding_backward(&self, dy: &Tensor, ids: &Tensor, dtable: &mut Tensor) -> Result<()> {
        f32s(&[dy, dtable], "embedding gradient")?;
        expect(ids, DType::I32, "token ids")?;
        let &[vocab, dim] = dtable.dims() else {
            return Err(Error::shape(format!(
                "embedding gradient: table {}",
                dtable.shape()
            )));
        };
        let (n, row) = rows_of(dy);
        if row != dim || ids.shape().numel() != n {
            return Err(Error::shape(format!(
                "embedding gradient: {} rows for {} ids into {}",
                dy.shape(),
                ids.shape(),
                dtable.shape()
            )));
        }
        if n == 0 || dim == 0 || vocab == 0 {
            return Ok(());
        }
        // Table rows a block owns (EMB_ROWS in grad.cu).
        const EMB_ROWS: usize = 128;
        let grid = (
            to_i32(dim.div_ceil(256), "column blocks")? as u32,
            to_i32(vocab.div_ceil(EMB_ROWS), "row blocks")? as u32,
            1,
        );
        self.launch(
            "grad_embedding",
            grid,
            (256, 1, 1),
            0,
            &[
                Arg::Ptr(ptr(dy)?),
                Arg::Ptr(ptr(ids)?),
                Arg::Ptr(ptr(dtable)?),
                Arg::I32(to_i32(n, "rows")?),
                Arg::I32(to_i32(dim, "width")?),
                Arg::I32(to_i32(vocab, "vocabulary")?),
            ],
        )
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
        norm_backward(self, false, x, weight, eps, dy, (dx, into), dweight)
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
        norm_backward(self, true, x, weight, eps, dy, (dx, into), dweight)
    }

    fn softmax_backward(&self, y: &Tensor, dy: &Tensor, dx: &mut Tensor) -> Result<()> {
        f32s(&[y, dy, dx], "softmax gradient")?;
        same_shape(y, dy, "softmax gradient")?;
        same_shape(y, dx, "softmax gradient")?;
        let (rows, cols) = rows_of(y);
        self.launch_rows(
            "grad_softmax",
            rows,
            256,
            &[
                Arg::Ptr(ptr(y)?),
                Arg::Ptr(ptr(dy)?),
                Arg::Ptr(ptr(dx)?),
                Arg::I32(to_i32(cols, "columns")?),
            ],
        )
    }

    fn rope_backward(
        &self,
        d: &mut Tensor,
        pos: &Tensor,
        inv_freq: &Tensor,
        layout: RopeLayout,
    ) -> Result<()> {
        f32s(&[d, inv_freq], "rope gradient")?;
        expect(pos, DType::I32, "rope positions")?;
        let &[tokens, heads, head_dim] = d.dims() else {
            return Err(Error::shape(format!(
                "rope gradient takes [tokens, heads, head_dim], got {}",
                d.shape()
            )));
        };
        let rot = 2 * inv_freq.shape().numel();
        if rot > head_dim || pos.shape().numel() != tokens {
            return Err(Error::shape(format!(
                "rope gradient: {} frequencies, {} positions for {}",
                rot / 2,
                pos.shape().numel(),
                d.shape()
            )));
        }
        let rows = to_i32(tokens * heads, "rows")?;
        if rows == 0 {
            return Ok(());
        }
        let per_block = crate::elementwise::ROPE_ROWS;
        self.launch(
            "grad_rope",
            ((rows as u32).div_ceil(per_block), 1, 1),
            (32, per_block, 1),
            0,
            &[
                Arg::Ptr(ptr(d)?),
                Arg::Ptr(ptr(pos)?),
                Arg::Ptr(ptr(inv_freq)?),
                Arg::I32(rows),
                Arg::I32(to_i32(heads, "heads")?),
                Arg::I32(to_i32(head_dim, "head width")?),
                Arg::I32(to_i32(rot, "rotated width")?),
                Arg::I32((layout == RopeLayout::Neox) as i32),
            ],
        )
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
        self.attention_grads(q, k_cache, v_cache, pos, params, dout, dq, dk, dv)
    }

    fn attention_backward_runs(
        &self,
        q: &Tensor,
        k_pool: &Tensor,
        v_pool: &Tensor,
        pos: &Tensor,
        runs: &[AttentionRun],
        params: &AttentionParams,
        saved: Option<AttentionSaved>,
        dout: &Tensor,
        dq: &mut Tensor,
        dk: &mut Tensor,
        dv: &mut Tensor,
        into: GradInto,
    ) -> Result<bool> {
        self.attention_grads_runs(
            q,
            k_pool,
            v_pool,
            pos,
            runs,
            params,
            saved,
            dout,
            [dq, dk, dv],
            into,
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
        f32s(&[dout, dgate, dup], "gated gradient")?;
        // gate and up F32, or both kept rounded (16-bit products).
        let kernel = match (gate.dtype(), up.dtype()) {
            (DType::F32, DType::F32) => "grad_gated",
            (DType::BF16, DType::BF16) | (DType::F16, DType::F16) => "grad_gated_half",
            (g, u) => {
                return Err(Error::unsupported(format!(
                    "gated gradient over a {g} gate and a {u} up"
                )))
            }
        };
        for t in [up, dout, &*dgate, &*dup] {
            same_shape(gate, t, "gated gradient")?;
        }
        let n = gate.shape().numel();
        let mut args = vec![
            Arg::Ptr(ptr(gate)?),
            Arg::Ptr(ptr(up)?),
            Arg::Ptr(ptr(dout)?),
            Arg::Ptr(ptr(dgate)?),
            Arg::Ptr(ptr(dup)?),
            Arg::U64(n as u64),
            Arg::I32(gelu as i32),
            Arg::I32((into == GradInto::Write) as i32),
        ];
        if kernel == "grad_gated_half" {
            args.push(Arg::I32((gate.dtype() == DType::BF16) as i32));
        }
        self.launch_1d(kernel, n.div_ceil(4), &args)
    }

    fn gelu_backward(&self, x: &Tensor, dy: &Tensor, dx: &mut Tensor) -> Result<()> {
        f32s(&[x, dy, dx], "gelu gradient")?;
        same_shape(x, dy, "gelu gradient")?;
        let n = x.shape().numel();
        if dx.shape().numel() != n {
            return Err(Error::shape(format!("gelu gradient into {}", dx.shape())));
        }
        self.launch_1d(
            "grad_gelu",
            n,
            &[
                Arg::Ptr(ptr(x)?),
                Arg::Ptr(ptr(dy)?),
                Arg::Ptr(ptr(dx)?),
                Arg::U64(n as u64),
            ],
        )
    }

    fn softcap_backward(&self, y: &Tensor, cap: f32, dy: &Tensor, dx: &mut Tensor) -> Result<()> {
        f32s(&[y, dy, dx], "softcap gradient")?;
        same_shape(y, dy, "softcap gradient")?;
        let n = y.shape().numel();
        if dx.shape().numel() != n {
            return Err(Error::shape(format!(
                "softcap gradient into {}",
                dx.shape()
            )));
        }
        self.launch_1d(
            "grad_softcap",
            n,
            &[
                Arg::Ptr(ptr(y)?),
                Arg::Ptr(ptr(dy)?),
                Arg::Ptr(ptr(dx)?),
                Arg::U64(n as u64),
                Arg::F32(cap),
            ],
        )
    }

    fn slice_cols_backward(&self, ddst: &Tensor, col0: usize, dsrc: &mut Tensor) -> Result<()> {
        f32s(&[ddst, dsrc], "slice_cols gradient")?;
        let (&[rows, cols], &[src_rows, src_cols]) = (ddst.dims(), dsrc.dims()) else {
            return Err(Error::shape(format!(
                "slice_cols gradient: {} into {} (both 2-D)",
                ddst.shape(),
                dsrc.shape()
            )));
        };
        if rows != src_rows || col0.checked_add(cols).is_none_or(|e| e > src_cols) {
            return Err(Error::shape(format!(
                "slice_cols gradient: {} at column {col0} into {}",
                ddst.shape(),
                dsrc.shape()
            )));
        }
        self.launch_1d(
            "grad_slice_cols",
            rows * cols,
            &[
                Arg::Ptr(ptr(ddst)?),
                Arg::Ptr(ptr(dsrc)?),
                Arg::I32(to_i32(rows, "rows")?),
                Arg::I32(to_i32(cols, "columns")?),
                Arg::I32(to_i32(src_cols, "columns")?),
                Arg::I32(to_i32(col0, "column")?),
            ],
        )
    }

    fn gather_rows(
        &self,
        ddst: &Tensor,
        pos: &Tensor,
        dsrc: &mut Tensor,
        into: GradInto,
    ) -> Result<()> {
        f32s(&[ddst, dsrc], "write_rows gradient")?;
        expect(pos, DType::I32, "write_rows positions")?;
        let ((rows, row), (dst_rows, dst_row)) = (outer_rows(dsrc), outer_rows(ddst));
        if row != dst_row || pos.shape().numel() != rows {
            return Err(Error::shape(format!(
                "write_rows gradient: {} from {}",
                dsrc.shape(),
                ddst.shape()
            )));
        }
        self.launch_1d(
            "grad_gather_rows",
            (rows * row).div_ceil(4),
            &[
                Arg::Ptr(ptr(ddst)?),
                Arg::Ptr(ptr(pos)?),
                Arg::Ptr(ptr(dsrc)?),
                Arg::I32(to_i32(rows, "rows")?),
                Arg::I32(to_i32(row, "row length")?),
                Arg::I32(to_i32(dst_rows, "rows")?),
                Arg::I32((into == GradInto::Write) as i32),
            ],
        )
    }

    fn zero_rows(&self, ddst: &mut Tensor, pos: &Tensor) -> Result<()> {
        expect(ddst, DType::F32, "write_rows gradient")?;
        expect(pos, DType::I32, "write_rows positions")?;
        let (dst_rows, row) = outer_rows(ddst);
        let rows = pos.shape().numel();
        self.launch_1d(
            "grad_zero_rows",
            rows * row,
            &[
                Arg::Ptr(ptr(ddst)?),
                Arg::Ptr(ptr(pos)?),
                Arg::I32(to_i32(rows, "rows")?),
                Arg::I32(to_i32(row, "row length")?),
                Arg::I32(to_i32(dst_rows, "rows")?),
            ],
        )
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
        self.fused_loss(h, w, targets, softcap, scale, losses, dh, dw)
    }
}

/// RMSNorm's (`layer` false) or LayerNorm's gradients: a kernel per row for `dx` (which
/// keeps each row's statistics), then a thread per column for the weight's.
#[allow(clippy::too_many_arguments)]
fn norm_backward(
    b: &CudaBackend,
    layer: bool,
    x: &Tensor,
    weight: &Tensor,
    eps: f32,
    dy: &Tensor,
    (dx, into): (&mut Tensor, GradInto),
    dweight: Option<&mut Tensor>,
) -> Result<()> {
    let op = if layer {
        "layer_norm gradient"
    } else {
        "rms_norm gradient"
    };
    f32s(&[x, weight, dy, dx], op)?;
    same_shape(x, dy, op)?;
    same_shape(x, dx, op)?;
    let (rows, dim) = rows_of(x);
    let dw_fits = dweight.as_deref().is_none_or(|d| d.shape().numel() == dim);
    if weight.shape().numel() != dim || !dw_fits {
        return Err(Error::shape(format!(
            "{op}: weight {} for rows of {dim}",
            weight.shape()
        )));
    }
    if rows == 0 || dim == 0 {
        return Ok(());
    }
    let stats = b.scratch("grad_norm_stats", rows * 2 * 4)?;
    let dim_arg = Arg::I32(to_i32(dim, "width")?);
    let dx_kernel = match layer {
        true => "grad_layer_norm_dx",
        false => "grad_rms_norm_dx",
    };
    b.launch_rows(
        dx_kernel,
        rows,
        256,
        &[
            Arg::Ptr(ptr(x)?),
            Arg::Ptr(ptr(weight)?),
            Arg::Ptr(ptr(dy)?),
            Arg::Ptr(ptr(dx)?),
            Arg::Ptr(stats),
            dim_arg,
            Arg::F32(eps),
            Arg::I32((into == GradInto::Write) as i32),
        ],
    )?;
    if let Some(dw) = dweight {
        expect(dw, DType::F32, op)?;
        // Parts of at least 64 rows, at most 64 of them: a prompt's 1024 rows of a
        // 768-wide model are 24 × 16 blocks.
        let n_parts = rows.div_ceil(64).clamp(1, 64);
        let per_part = rows.div_ceil(n_parts);
        let parts = b.scratch("grad_norm_dw_parts", n_parts * dim * 4)?;
        b.launch(
            "norm_dw_parts",
            (to_i32(dim.div_ceil(32), "width")? as u32, n_parts as u32, 1),
            (32, 8, 1),
            0,
            &[
                Arg::Ptr(ptr(x)?),
                Arg::Ptr(ptr(dy)?),
                Arg::Ptr(stats),
                Arg::Ptr(parts),
                Arg::I32(to_i32(rows, "rows")?),
                dim_arg,
                Arg::I32(to_i32(per_part, "rows a part")?),
                Arg::I32(layer as i32),
            ],
        )?;
        b.launch_1d(
            "norm_dw_sum",
            dim,
            &[
                Arg::Ptr(parts),
                Arg::Ptr(ptr(dw)?),
                Arg::I32(n_parts as i32),
                dim_arg,
            ],
        )?;
    }
    Ok(())
}

impl CudaBackend {
    /// The type the products round their F32 operands to, if they do.
    fn rounded_type(&self) -> Option<DType> {
        match self.blas.f32_products() {
            Products::Bf16 => Some(DType::BF16),
            Products::F16 => Some(DType::F16),
            Products::F32 | Products::Tf32 => None,
        }
    }
}
