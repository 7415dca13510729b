//! Attention's backward on the GPU, and under BF16 / F16 products the training forward that
//! keeps what it needs. Under 16-bit products flash-style on tensor cores
//! (attention_grad_tc.rs: tiles of scores never written, masked tiles skipped), reading
//! the q, k and v the tape kept rounded and, where the forward ran over them, each row's
//! log-sum-exp and the rounded output; under F32 and TF32 products with cuBLAS, holding
//! the probabilities and the scores' gradients of a sequence in two
//! `[tokens · heads, capacity]` work buffers.

use super::f32s;
use crate::attention_grad_tc;
use crate::blas::{rounded_copy, sgemm_batched, Strided};
use crate::kernels::Arg;
use crate::{expect, ptr, to_i32, CudaBackend};
use kiln_core::{
    AttentionParams, AttentionRun, AttentionSaved, Backend, DType, Error, GradInto, Pages, Result,
    Tensor,
};

impl CudaBackend {
    /// `GradOps::paged_attention_saving`: the forward over the kept operands, where the
    /// flash backward will read what it keeps.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention_forward_kept(
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
        let n = out.shape().numel();
        self.note_rounded_copy(ptr(out)?, n, half == DType::BF16, ptr(out_rounded)?);
        Ok(true)
    }

    /// `GradOps::attention_backward`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention_grads(
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
            return attention_grad_tc::backward(
                self,
                kernels,
                &operands,
                &[run],
                params,
                None,
                false,
            );
        }
        self.attention_backward_at(ptrs, grads, (n, cap, heads, kv_heads, d), params, half)
    }

    /// `GradOps::attention_backward_runs`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention_grads_runs(
        &self,
        q: &Tensor,
        k_pool: &Tensor,
        v_pool: &Tensor,
        pos: &Tensor,
        runs: &[AttentionRun],
        params: &AttentionParams,
        saved: Option<AttentionSaved>,
        dout: &Tensor,
        [dq, dk, dv]: [&mut Tensor; 3],
        into: GradInto,
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
        let flash = self.flash_backward(half, d);
        // Gradients that begin here are written where the flash kernels write every row
        // once (the pool rows no run holds zeroed); elsewhere they start as zeros and the
        // kernels add.
        let plan = match (into, flash) {
            (GradInto::Write, Some((k, _))) => attention_grad_tc::write_plan(k, runs, n, pool_rows),
            _ => None,
        };
        let write = plan.is_some();
        match plan {
            Some(gaps) => {
                let row = kv_heads * d;
                for (first, count) in gaps {
                    let at = (first * row) as u64 * f;
                    self.fill_words(dk_p + at, count * row, 0.0)?;
                    self.fill_words(dv_p + at, count * row, 0.0)?;
                }
            }
            None if into == GradInto::Write => {
                for t in [dq, dk, dv] {
                    self.fill(t, 0.0)?;
                }
            }
            None => {}
        }
        if let Some((kernels, copies)) = flash {
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
            attention_grad_tc::backward(self, kernels, &operands, runs, params, kept, write)?;
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
