//! Causal (optionally windowed, soft-capped) grouped-query attention over a KV cache.
//!
//! One task per (token, head): scores against every visible key, a softmax, then the
//! weighted sum of values. Scores live in a per-task buffer of the visible length.

use crate::{f32s, f32s_mut, indices};
use kiln_core::{AttentionParams, Error, Result, Tensor};
use rayon::prelude::*;

pub(crate) fn attention(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    pos: &Tensor,
    p: &AttentionParams,
    out: &mut Tensor,
) -> Result<()> {
    let &[n, heads, hd] = q.dims() else {
        return Err(Error::shape(format!(
            "attention q must be [n, heads, head_dim], got {}",
            q.shape()
        )));
    };
    let &[capacity, kv_heads, kv_hd] = k_cache.dims() else {
        return Err(Error::shape(format!(
            "k cache must be [capacity, kv_heads, head_dim], got {}",
            k_cache.shape()
        )));
    };
    if v_cache.dims() != k_cache.dims() || out.dims() != q.dims() || kv_hd != hd {
        return Err(Error::shape(format!(
            "attention: q {}, k {}, v {}, out {}",
            q.shape(),
            k_cache.shape(),
            v_cache.shape(),
            out.shape()
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
    let group = heads / kv_heads;
    let (qs, ks, vs) = (f32s(q)?, f32s(k_cache)?, f32s(v_cache)?);
    let o = f32s_mut(out)?;
    if hd == 0 {
        return Ok(());
    }
    o.par_chunks_mut(hd).enumerate().for_each(|(task, o)| {
        let (i, h) = (task / heads, task % heads);
        let pos = positions[i] as usize;
        let first = p.window.map_or(0, |w| (pos + 1).saturating_sub(w));
        let g = h / group;
        let qv = &qs[task * hd..][..hd];
        let mut scores: Vec<f32> = (first..=pos)
            .map(|j| {
                let kv = &ks[(j * kv_heads + g) * hd..][..hd];
                let s = qv.iter().zip(kv).map(|(a, b)| a * b).sum::<f32>() * p.scale;
                match p.softcap {
                    Some(cap) => cap * (s / cap).tanh(),
                    None => s,
                }
            })
            .collect();
        let max = scores.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
        let mut sum = 0f32;
        for s in scores.iter_mut() {
            *s = (*s - max).exp();
            sum += *s;
        }
        o.fill(0.0);
        for (s, j) in scores.iter().zip(first..=pos) {
            let w = s / sum;
            let vv = &vs[(j * kv_heads + g) * hd..][..hd];
            o.iter_mut().zip(vv).for_each(|(o, v)| *o += w * v);
        }
    });
    Ok(())
}
