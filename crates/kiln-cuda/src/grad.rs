//! The backward kernels (`kiln_core::GradOps`) on the GPU: `kernels/grad.cu`, and cuBLAS
//! for the products. Attention's backward recomputes the scores from q and k (nothing of
//! the forward is kept): under BF16 / F16 products flash-style on tensor cores
//! (attention_grad_tc.rs: tiles of scores never written, masked tiles skipped); under F32
//! and TF32 products with cuBLAS, holding the probabilities and the scores' gradients of a
//! sequence in two `[tokens · heads, capacity]` work buffers.

use crate::attention_grad_tc;
use crate::kernels::Arg;
use crate::matmul::{round_into, rounded_copy, sgemm, sgemm_batched, sgemm_rounded_a, Strided};
use crate::{expect, ptr, same_shape, to_i32, CudaBackend};
use kiln_core::{
    AttentionParams, AttentionRun, AttentionSaved, Backend, DType, Error, GradOps, Pages, Products,
    Result, RopeLayout, Shape, Tensor,
};

/// Logits a block of the fused loss holds at once (128 MiB of f32): 1,048 rows of a
/// 32,000-word vocabulary. Each block's three products read the whole output matrix (and
/// under BF16 / F16 products round it again): at 131 rows a block, those roundings were 4%
/// of a 16 × 1,024-token training step.
const BLOCK_LOGITS: usize = 1 << 25;

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
        // Kept operands of the products' type only, and a flash backward to read them.
        let Some(half) = self.rounded_type() else {
            return Ok(false);
        };
        let d = q.dims().last().copied().unwrap_or(0);
        if q.dtype() != half || attention_grad_tc::kernels(self, d, half == DType::BF16).is_none() {
            return Ok(false);
        }
        if !crate::attention::paged_kept(
            self,
            q,
            k_pool,
            v_pool,
            pos,
            pages,
            params,
            out,
            lse,
            out_rounded,
        )? {
            return Ok(false);
        }
        // The output projection's product that follows reads the rounded output as its
        // input, instead of rounding `out` again.
        let queued = self.queued.load(std::sync::atomic::Ordering::Relaxed);
        let n = out.shape().numel();
        self.blas
            .note_rounded_copy(ptr(out)?, n, half == DType::BF16, ptr(out_rounded)?, queued);
        Ok(true)
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
        let queued = self.queued.load(std::sync::atomic::Ordering::Relaxed);
        self.blas.note_rounded_copy(src, n, bf16, dst, queued);
        Ok(Some(out))
    }

    fn matmul_dx(&self, dy: &Tensor, w: &Tensor, dx: &mut Tensor) -> Result<()> {
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
            return Ok(());
        }
        if w.dtype() != DType::F32 {
            return self.matmul_dx_stored(ptr(dy)?, w, ptr(dx)?, (n, m, k));
        }
        // Row-major dx[n, k] += dy[n, m]·w[m, k]: column-major dxᵀ = wᵀ·dyᵀ, where w read
        // as k × m column-major is wᵀ and dy as m × n is dyᵀ.
        sgemm(
            self,
            (false, false),
            (k, n, m),
            (ptr(w)?, k),
            (ptr(dy)?, m),
            1.0,
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
        dweight: Option<&mut Tensor>,
    ) -> Result<()> {
        norm_backward(self, false, x, weight, eps, dy, dx, dweight)
    }

    fn layer_norm_backward(
        &self,
        x: &Tensor,
        weight: &Tensor,
        eps: f32,
        dy: &Tensor,
        dx: &mut Tensor,
        dweight: Option<&mut Tensor>,
    ) -> Result<()> {
        norm_backward(self, true, x, weight, eps, dy, dx, dweight)
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
        f32s(
            &[q, k_cache, v_cache, dout, dq, dk, dv],
            "attention gradient",
        )?;
        expect(pos, DType::I32, "attention positions")?;
        let (&[n, heads, d], &[cap, kv_heads, kd]) = (q.dims(), k_cache.dims()) else {
            return Err(Error::shape(format!(
                "attention gradient: q {}, k {}",
                q.shape(),
                k_cache.shape()
            )));
        };
        if kd != d
            || v_cache.dims() != k_cache.dims()
            || dk.dims() != k_cache.dims()
            || dv.dims() != k_cache.dims()
            || dout.dims() != q.dims()
            || dq.dims() != q.dims()
            || pos.shape().numel() != n
            || kv_heads == 0
            || heads % kv_heads != 0
        {
            return Err(Error::shape(format!(
                "attention gradient: q {}, k {}, v {}, dout {}",
                q.shape(),
                k_cache.shape(),
                v_cache.shape(),
                dout.shape()
            )));
        }
        let ptrs = [ptr(q)?, ptr(k_cache)?, ptr(v_cache)?, ptr(dout)?, ptr(pos)?];
        let grads = [ptr(dq)?, ptr(dk)?, ptr(dv)?];
        let half = self.attention_half_copies([q, k_cache, v_cache, dout])?;
        if let Some((kernels, copies)) = self.flash_backward(half, d) {
            let operands = attention_grad_tc::Operands {
                half: copies,
                pos: ptrs[4],
                grads,
                rows: n,
                heads,
                kv_heads,
            };
            let run = AttentionRun {
                rows: (0, n),
                keys: (0, cap),
            };
            return attention_grad_tc::backward(self, kernels, &operands, &[run], params, None);
        }
        self.attention_backward_at(ptrs, grads, (n, cap, heads, kv_heads, d), params, half)
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
    ) -> Result<bool> {
        f32s(&[dout, dq, dk, dv], "paged attention gradient")?;
        self.attention_operands([q, k_pool, v_pool], "paged attention gradient")?;
        expect(pos, DType::I32, "attention positions")?;
        let (&[n, heads, d], &[pool_rows, kv_heads, kd]) = (q.dims(), k_pool.dims()) else {
            return Err(Error::shape(format!(
                "paged attention gradient: q {}, pool {}",
                q.shape(),
                k_pool.shape()
            )));
        };
        let fits = kd == d
            && v_pool.dims() == k_pool.dims()
            && dk.dims() == k_pool.dims()
            && dv.dims() == k_pool.dims()
            && dout.dims() == q.dims()
            && dq.dims() == q.dims()
            && pos.shape().numel() == n
            && kv_heads > 0
            && heads % kv_heads == 0
            && runs
                .iter()
                .all(|r| r.rows.0 + r.rows.1 <= n && r.keys.0 + r.keys.1 <= pool_rows);
        if !fits {
            return Err(Error::shape(format!(
                "paged attention gradient: q {}, pools {}, runs {runs:?}",
                q.shape(),
                k_pool.shape()
            )));
        }
        let f = std::mem::size_of::<f32>() as u64;
        let (q_p, k_p, v_p, do_p, pos_p) =
            (ptr(q)?, ptr(k_pool)?, ptr(v_pool)?, ptr(dout)?, ptr(pos)?);
        let (dq_p, dk_p, dv_p) = (ptr(dq)?, ptr(dk)?, ptr(dv)?);
        // The 16-bit copies (under BF16 / F16 products) of all rows at once.
        let half = self.attention_half_copies([q, k_pool, v_pool, dout])?;
        if let Some((kernels, copies)) = self.flash_backward(half, d) {
            let operands = attention_grad_tc::Operands {
                half: copies,
                pos: pos_p,
                grads: [dq_p, dk_p, dv_p],
                rows: n,
                heads,
                kv_heads,
            };
            let kept = match saved {
                Some(sv) => {
                    let heads_n = n * heads;
                    if sv.lse.dtype() != DType::F32
                        || sv.lse.shape().numel() != heads_n
                        || sv.out.dims() != q.dims()
                        || Some(sv.out.dtype()) != self.rounded_type()
                    {
                        return Err(Error::shape(format!(
                            "paged attention gradient: kept lse {} {} and output {} {} for q {}",
                            sv.lse.dtype(),
                            sv.lse.shape(),
                            sv.out.dtype(),
                            sv.out.shape(),
                            q.shape()
                        )));
                    }
                    Some((ptr(sv.lse)?, ptr(sv.out)?))
                }
                None => None,
            };
            attention_grad_tc::backward(self, kernels, &operands, runs, params, kept)?;
            return Ok(true);
        }
        // Each run in place: its query rows and its span of pool rows, by offsets.
        for r in runs {
            let (q_el, kv_el) = (
                (r.rows.0 * heads * d) as u64,
                (r.keys.0 * kv_heads * d) as u64,
            );
            let (qo, ko) = (q_el * f, kv_el * f);
            let half_at = half.map(|(bf16, [hq, hk, hv, hd])| {
                (
                    bf16,
                    [hq + 2 * q_el, hk + 2 * kv_el, hv + 2 * kv_el, hd + 2 * q_el],
                )
            });
            self.attention_backward_at(
                [
                    q_p + qo,
                    k_p + ko,
                    v_p + ko,
                    do_p + qo,
                    pos_p + r.rows.0 as u64 * 4,
                ],
                [dq_p + qo, dk_p + ko, dv_p + ko],
                (r.rows.1, r.keys.1, heads, kv_heads, d),
                params,
                half_at,
            )?;
        }
        Ok(true)
    }

    fn gated_backward(
        &self,
        gate: &Tensor,
        up: &Tensor,
        gelu: bool,
        dout: &Tensor,
        dgate: &mut Tensor,
        dup: &mut Tensor,
    ) -> Result<()> {
        f32s(&[gate, up, dout, dgate, dup], "gated gradient")?;
        for t in [up, dout, &*dgate, &*dup] {
            same_shape(gate, t, "gated gradient")?;
        }
        let n = gate.shape().numel();
        self.launch_1d(
            "grad_gated",
            n.div_ceil(4),
            &[
                Arg::Ptr(ptr(gate)?),
                Arg::Ptr(ptr(up)?),
                Arg::Ptr(ptr(dout)?),
                Arg::Ptr(ptr(dgate)?),
                Arg::Ptr(ptr(dup)?),
                Arg::U64(n as u64),
                Arg::I32(gelu as i32),
            ],
        )
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

    fn gather_rows(&self, ddst: &Tensor, pos: &Tensor, dsrc: &mut Tensor) -> Result<()> {
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
    dx: &mut Tensor,
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
    /// Under BF16 / F16 products, whether BF16 and 16-bit copies of `spans` (address and
    /// F32 count each: the attention backward's q, k, v and dout) in work buffers; the
    /// products then read those.
    /// The type the products round their F32 operands to, if they do.
    fn rounded_type(&self) -> Option<DType> {
        match self.blas.f32_products() {
            Products::Bf16 => Some(DType::BF16),
            Products::F16 => Some(DType::F16),
            Products::F32 | Products::Tf32 => None,
        }
    }

    /// The 16-bit copies of q, k, v and dout the attention's backward reads under BF16 /
    /// F16 products: each tensor's own data where it is one already (what the tape kept,
    /// `rounded_for_products`), else rounded into a work buffer.
    fn attention_half_copies(&self, ts: [&Tensor; 4]) -> Result<Option<(bool, [u64; 4])>> {
        let Some(dtype) = self.rounded_type() else {
            return Ok(None);
        };
        let bf16 = dtype == DType::BF16;
        let slots = [
            "attention_half_q",
            "attention_half_k",
            "attention_half_v",
            "attention_half_do",
        ];
        let mut out = [0u64; 4];
        for ((t, slot), dst) in ts.iter().zip(slots).zip(&mut out) {
            *dst = match t.dtype() {
                d if d == dtype => ptr(t)?,
                _ => rounded_copy(self, slot, ptr(t)?, t.shape().numel(), bf16)?,
            };
        }
        Ok(Some((bf16, out)))
    }

    /// Attention's q, k and v as the backward takes them: F32, or (under BF16 / F16
    /// products) rounded as the products round them.
    fn attention_operands(&self, ts: [&Tensor; 3], op: &str) -> Result<()> {
        let rounded = self.rounded_type();
        for t in ts {
            if t.dtype() != DType::F32 && Some(t.dtype()) != rounded {
                return Err(Error::unsupported(format!(
                    "{op}: a {} operand under {} products",
                    t.dtype(),
                    self.blas.f32_products().name()
                )));
            }
        }
        Ok(())
    }

    /// The flash-style kernels for heads of `d` and the 16-bit copies they read, when the
    /// products round to 16 bits (`half`) and this GPU has them.
    fn flash_backward(
        &self,
        half: Option<(bool, [u64; 4])>,
        d: usize,
    ) -> Option<(attention_grad_tc::Kernels, [u64; 4])> {
        let (bf16, copies) = half?;
        Some((attention_grad_tc::kernels(self, d, bf16)?, copies))
    }

    /// [`GradOps::attention_backward`] over device addresses: `n` queries at `q_p` (rows
    /// of `heads · d`), `cap` keys and values at `k_p`, `v_p` (rows of `kv_heads · d`), the
    /// queries' positions at `pos_p`; the gradients added at `dq_p`, `dk_p`, `dv_p`. With
    /// `half` (whether BF16, and 16-bit copies of q, k, v and dout at the same element
    /// offsets), the five products read 16-bit operands: the scores from the rounded
    /// queries and keys, and the probabilities and score gradients that the softmax
    /// backward writes rounded; their sums stay F32.
    fn attention_backward_at(
        &self,
        [q_p, k_p, v_p, do_p, pos_p]: [u64; 5],
        [dq_p, dk_p, dv_p]: [u64; 3],
        (n, cap, heads, kv_heads, d): (usize, usize, usize, usize, usize),
        params: &AttentionParams,
        half: Option<(bool, [u64; 4])>,
    ) -> Result<()> {
        if n == 0 || d == 0 || cap == 0 {
            return Ok(());
        }
        // Five cuBLAS products a head around one softmax-backward kernel (the scores of
        // every query against every key of the cache are n × cap, as the forward's):
        //   S = Q·Kᵀ, dP = dO·Vᵀ; (S, dP) → (P, dS) by rows; dQ += dS·K, dK += dSᵀ·Q,
        //   dV += Pᵀ·dO.
        // Row-major [rows, cols] with row stride `ld` is, to cuBLAS, a column-major
        // cols × rows matrix of leading dimension `ld`: each product is written below as
        // the transposed one cuBLAS computes.
        let scores = n * heads * cap;
        let s_buf = self.scratch("grad_attention_p", scores * 4)?;
        let ds_buf = self.scratch("grad_attention_ds", scores * 4)?;
        let (q_ld, kv_ld, s_ld) = (heads * d, kv_heads * d, heads * cap);
        let group = heads / kv_heads;
        // Each product runs for the heads `r, r + group, ...` (head `g·group + r` on KV
        // head g) in one batched call: a query head's matrices lie `group` heads apart,
        // its KV head's one apart. `bytes`: of an element.
        let of_heads = |base: u64, r: usize, width: usize, ld: usize, bytes: u64| Strided {
            at: base + (r * width) as u64 * bytes,
            ld,
            stride: group * width,
        };
        let of_kv = |base: u64, width: usize, ld: usize| Strided {
            at: base,
            ld,
            stride: width,
        };
        // The operands the products read: F32, or the 16-bit copies.
        let kind = half.map(|(bf16, _)| bf16);
        let ([qi, ki, vi, doi], in_bytes) = match half {
            Some((_, copies)) => (copies, 2),
            None => ([q_p, k_p, v_p, do_p], 4),
        };
        let (p_half, ds_half) = match half {
            Some(_) => (
                self.scratch("grad_attention_p_half", scores * 2)?,
                self.scratch("grad_attention_ds_half", scores * 2)?,
            ),
            None => (0, 0),
        };
        for r in 0..group {
            // Sᵀ[cap, n] = K_g[cap, d] · Q_hᵀ[d, n]; dPᵀ likewise from V and dO.
            for (keys, rows, out) in [(ki, qi, s_buf), (vi, doi, ds_buf)] {
                sgemm_batched(
                    self,
                    kind,
                    (true, false),
                    (cap, n, d),
                    of_kv(keys, d, kv_ld),
                    of_heads(rows, r, d, q_ld, in_bytes),
                    0.0,
                    of_heads(out, r, cap, s_ld, 4),
                    kv_heads,
                )?;
            }
        }
        let i = |v: usize, what| to_i32(v, what).map(Arg::I32);
        let window = params.window.map_or(Ok(0), |w| to_i32(w, "window"))?;
        self.launch_rows(
            "grad_attention_rows",
            n * heads,
            256,
            &[
                Arg::Ptr(s_buf),
                Arg::Ptr(ds_buf),
                Arg::Ptr(pos_p),
                i(heads, "heads")?,
                i(cap, "capacity")?,
                Arg::F32(params.scale),
                Arg::F32(params.softcap.unwrap_or(0.0)),
                Arg::I32(window),
                Arg::Ptr(p_half),
                Arg::Ptr(ds_half),
                Arg::I32(match kind {
                    None => 0,
                    Some(true) => 1,
                    Some(false) => 2,
                }),
            ],
        )?;
        let (p_in, ds_in, s_bytes) = match half {
            Some(_) => (p_half, ds_half, 2),
            None => (s_buf, ds_buf, 4),
        };
        for r in 0..group {
            // dQ_hᵀ[d, n] += K_gᵀ[d, cap] · dS_hᵀ[cap, n].
            sgemm_batched(
                self,
                kind,
                (false, false),
                (d, n, cap),
                of_kv(ki, d, kv_ld),
                of_heads(ds_in, r, cap, s_ld, s_bytes),
                1.0,
                of_heads(dq_p, r, d, q_ld, 4),
                kv_heads,
            )?;
            // dK_gᵀ[d, cap] += Q_hᵀ[d, n] · dS_h[n, cap]; dV_g from dO and P likewise.
            // The heads of a group add into their KV head one call after another.
            for (rows, weights, out) in [(qi, ds_in, dk_p), (doi, p_in, dv_p)] {
                sgemm_batched(
                    self,
                    kind,
                    (false, true),
                    (d, cap, n),
                    of_heads(rows, r, d, q_ld, in_bytes),
                    of_heads(weights, r, cap, s_ld, s_bytes),
                    1.0,
                    of_kv(out, d, kv_ld),
                    kv_heads,
                )?;
            }
        }
        Ok(())
    }
}
