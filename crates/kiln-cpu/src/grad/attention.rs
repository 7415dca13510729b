//! Causal attention's backward, as FlashAttention-2 does it: nothing of the forward but
//! q, k and v is kept; the softmax is recomputed from them.
//!
//! Pass 1, one task per (query token, head): the scores' softmax `p`, its log-sum-exp `L`,
//! `dp_j = dO·v_j`, `D = Σ_j p_j·dp_j`, the scores' gradient `ds_j = p_j·(dp_j − D)`
//! (through the softcap's `1 − tanh²` when there is one) and `dq = scale · Σ_j ds_j·k_j`.
//! Pass 2, one task per (key row, KV head): every query that sees that key (each head of
//! the group) recomputes `p_j = exp(z_j − L)` and `ds_j` from `L` and `D`, and adds
//! `p_j·dO` into `dv` and `scale·ds_j·q` into `dk`. Each task writes only its own rows,
//! so the passes need no atomics.

use crate::pool::{Pool, SharedMut};
use crate::{f32s, f32s_mut, indices};
use kiln_core::{AttentionParams, Error, Result, Tensor};

fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// A score after scaling and the softcap: `(z, dz/draw)`.
fn capped(raw: f32, p: &AttentionParams) -> (f32, f32) {
    match p.softcap {
        Some(cap) => {
            let t = (raw / cap).tanh();
            (cap * t, 1.0 - t * t)
        }
        None => (raw, 1.0),
    }
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_backward<'a>(
    pool: &Pool,
    q: &Tensor,
    k_cache: &'a Tensor,
    v_cache: &'a Tensor,
    pos: &Tensor,
    p: &AttentionParams,
    dout: &Tensor,
    dq: &mut Tensor,
    dk: &mut Tensor,
    dv: &mut Tensor,
) -> Result<()> {
    let &[n, heads, hd] = q.dims() else {
        return Err(Error::shape(format!(
            "attention gradient: q must be [n, heads, head_dim], got {}",
            q.shape()
        )));
    };
    let &[capacity, kv_heads, kv_hd] = k_cache.dims() else {
        return Err(Error::shape(format!(
            "attention gradient: k cache must be [capacity, kv_heads, head_dim], got {}",
            k_cache.shape()
        )));
    };
    if v_cache.dims() != k_cache.dims()
        || dk.dims() != k_cache.dims()
        || dv.dims() != k_cache.dims()
        || dout.dims() != q.dims()
        || dq.dims() != q.dims()
        || kv_hd != hd
    {
        return Err(Error::shape(format!(
            "attention gradient: q {}, k {}, v {}, dout {}, dq {}, dk {}, dv {}",
            q.shape(),
            k_cache.shape(),
            v_cache.shape(),
            dout.shape(),
            dq.shape(),
            dk.shape(),
            dv.shape()
        )));
    }
    if kv_heads == 0 || heads % kv_heads != 0 {
        return Err(Error::shape(format!(
            "{heads} query heads cannot share {kv_heads} KV heads"
        )));
    }
    let positions = indices(pos, n, capacity, "attention positions", |p| {
        Error::shape(format!(
            "position {p} is outside the KV cache capacity of {capacity}"
        ))
    })?;
    if hd == 0 || n == 0 {
        return Ok(());
    }
    let group = heads / kv_heads;
    let (qs, ks, vs, dos) = (f32s(q)?, f32s(k_cache)?, f32s(v_cache)?, f32s(dout)?);
    let stride = kv_heads * hd;
    let first = |i: usize| {
        let pos = positions[i] as usize;
        p.window.map_or(0, |w| (pos + 1).saturating_sub(w))
    };
    let q_row = |i: usize, h: usize| &qs[(i * heads + h) * hd..][..hd];
    let do_row = |i: usize, h: usize| &dos[(i * heads + h) * hd..][..hd];
    let kv_row =
        |t: &'a [f32], j: usize, g: usize| -> &'a [f32] { &t[j * stride + g * hd..][..hd] };

    // Pass 1: per (token, head), into dq, with L and D kept for pass 2.
    let mut lse = vec![0f32; n * heads];
    let mut delta = vec![0f32; n * heads];
    let (lse_out, delta_out) = (SharedMut::new(&mut lse), SharedMut::new(&mut delta));
    pool.for_chunks_mut_init(
        f32s_mut(dq)?,
        hd,
        Vec::new,
        |scratch: &mut Vec<(f32, f32, f32)>, task, dq| {
            let (i, h) = (task / heads, task % heads);
            let g = h / group;
            let visible = first(i)..positions[i] as usize + 1;
            let (qi, doi) = (q_row(i, h), do_row(i, h));
            // (z, dz/draw, dp) per visible key.
            scratch.clear();
            for j in visible.clone() {
                let (z, dcap) = capped(dot(qi, kv_row(ks, j, g)) * p.scale, p);
                scratch.push((z, dcap, dot(doi, kv_row(vs, j, g))));
            }
            let max = scratch.iter().fold(f32::NEG_INFINITY, |m, s| m.max(s.0));
            let sum: f32 = scratch.iter().map(|s| (s.0 - max).exp()).sum();
            let l = max + sum.ln();
            let d: f32 = scratch.iter().map(|s| (s.0 - l).exp() * s.2).sum();
            for (s, j) in scratch.iter().zip(visible) {
                let ds = (s.0 - l).exp() * (s.2 - d) * s.1 * p.scale;
                dq.iter_mut()
                    .zip(kv_row(ks, j, g))
                    .for_each(|(o, &k)| *o += ds * k);
            }
            // SAFETY: task `task` alone writes element `task` of lse and delta, which have
            // n·heads elements and outlive the loop.
            unsafe {
                *lse_out.at(task) = l;
                *delta_out.at(task) = d;
            }
        },
    );

    // Pass 2: per (key row, KV head), into dk and dv.
    let (dks, dvs) = (f32s_mut(dk)?, f32s_mut(dv)?);
    let (dk_out, dv_out) = (SharedMut::new(dks), SharedMut::new(dvs));
    let (lse, delta) = (&lse, &delta);
    pool.for_each_init(
        capacity * kv_heads,
        || (),
        |(), task| {
            let (j, g) = (task / kv_heads, task % kv_heads);
            // SAFETY: task `task` alone writes the hd elements at task·hd of dk and dv, which
            // are capacity·kv_heads·hd long and borrowed mutably for the loop.
            let (dkj, dvj) = unsafe {
                (
                    std::slice::from_raw_parts_mut(dk_out.at(task * hd), hd),
                    std::slice::from_raw_parts_mut(dv_out.at(task * hd), hd),
                )
            };
            let (kj, vj) = (kv_row(ks, j, g), kv_row(vs, j, g));
            for (i, &pos) in positions.iter().enumerate() {
                if j < first(i) || j > pos as usize {
                    continue;
                }
                for h in g * group..(g + 1) * group {
                    let (qi, doi) = (q_row(i, h), do_row(i, h));
                    let (z, dcap) = capped(dot(qi, kj) * p.scale, p);
                    let at = i * heads + h;
                    let pj = (z - lse[at]).exp();
                    let ds = pj * (dot(doi, vj) - delta[at]) * dcap * p.scale;
                    dvj.iter_mut().zip(doi).for_each(|(o, &d)| *o += pj * d);
                    dkj.iter_mut().zip(qi).for_each(|(o, &q)| *o += ds * q);
                }
            }
        },
    );
    Ok(())
}
