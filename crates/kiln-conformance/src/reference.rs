//! Float64 references of the ops other than products, written as plainly as the contract
//! in `kiln_core::backend` states them, and the comparison they are held to.

use kiln_core::RopeLayout;

/// Panic, naming the first, if an element of `got` is off `want` by more than
/// `tol · (1 + |want|)` (relative for large values, absolute near zero).
#[track_caller]
pub(crate) fn assert_close(got: &[f32], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let bad: Vec<usize> = (0..got.len())
        .filter(|&i| !within(got[i], want[i], tol))
        .collect();
    if let Some(&i) = bad.first() {
        panic!(
            "{what}: {} of {} elements off; first [{i}]: got {}, want {} (tolerance {tol:e})",
            bad.len(),
            got.len(),
            got[i],
            want[i]
        );
    }
}

/// Whether `got` is within `tol · (1 + |want|)` of `want` (never, for NaN).
fn within(got: f32, want: f64, tol: f64) -> bool {
    (got as f64 - want).abs() <= tol * (1.0 + want.abs())
}

pub(crate) fn widen(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

pub(crate) fn rms_norm(x: &[f32], weight: &[f32], eps: f32) -> Vec<f64> {
    x.chunks(weight.len())
        .flat_map(|r| {
            let ms = r.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / r.len() as f64;
            let s = 1.0 / (ms + eps as f64).sqrt();
            r.iter()
                .zip(weight)
                .map(move |(&v, &w)| v as f64 * s * w as f64)
        })
        .collect()
}

pub(crate) fn layer_norm(x: &[f32], weight: &[f32], bias: &[f32], eps: f32) -> Vec<f64> {
    x.chunks(weight.len())
        .flat_map(|r| {
            let n = r.len() as f64;
            let mean = r.iter().map(|&v| v as f64).sum::<f64>() / n;
            let var = r.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n;
            let s = 1.0 / (var + eps as f64).sqrt();
            r.iter()
                .zip(weight.iter().zip(bias))
                .map(move |(&v, (&w, &b))| (v as f64 - mean) * s * w as f64 + b as f64)
        })
        .collect()
}

pub(crate) fn softmax(x: &[f32], cols: usize) -> Vec<f64> {
    x.chunks(cols)
        .flat_map(|r| {
            let max = r.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
            let e: Vec<f64> = r.iter().map(|&v| (v as f64 - max).exp()).collect();
            let sum: f64 = e.iter().sum();
            e.into_iter().map(move |v| v / sum)
        })
        .collect()
}

pub(crate) fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

/// GELU, tanh approximation.
pub(crate) fn gelu(x: f64) -> f64 {
    0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh())
}

/// Rope of `x` `[tokens, heads, head_dim]` in place, token `t` at `positions[t]`.
pub(crate) fn rope(
    x: &mut [f64],
    heads: usize,
    head_dim: usize,
    positions: &[i32],
    inv_freq: &[f32],
    layout: RopeLayout,
) {
    let half = inv_freq.len();
    for (t, &pos) in positions.iter().enumerate() {
        for h in 0..heads {
            let base = (t * heads + h) * head_dim;
            for (i, &f) in inv_freq.iter().enumerate() {
                // The angle as transformers forms it: the product rounded to f32.
                let theta = (pos as f32 * f) as f64;
                let (a, b) = match layout {
                    RopeLayout::Interleaved => (2 * i, 2 * i + 1),
                    RopeLayout::Neox => (i, i + half),
                };
                let (x0, x1) = (x[base + a], x[base + b]);
                x[base + a] = x0 * theta.cos() - x1 * theta.sin();
                x[base + b] = x0 * theta.sin() + x1 * theta.cos();
            }
        }
    }
}

/// Shapes and parameters of one attention call.
#[derive(Clone, Copy, Debug)]
pub(crate) struct AttentionShape {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
    pub softcap: Option<f32>,
    pub window: Option<usize>,
}

/// Causal attention of `q` `[n, heads, d]` over caches `[capacity, kv_heads, d]`.
pub(crate) fn attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    positions: &[i32],
    s: AttentionShape,
) -> Vec<f64> {
    let (heads, kvh, hd) = (s.heads, s.kv_heads, s.head_dim);
    let mut out = vec![0f64; positions.len() * heads * hd];
    for (i, &pos) in positions.iter().enumerate() {
        let pos = pos as usize;
        let first = s.window.map_or(0, |w| (pos + 1).saturating_sub(w));
        for h in 0..heads {
            let g = h / (heads / kvh);
            let qh = &q[(i * heads + h) * hd..][..hd];
            let scores: Vec<f64> = (first..=pos)
                .map(|j| {
                    let kj = &k[(j * kvh + g) * hd..][..hd];
                    let dot: f64 = qh.iter().zip(kj).map(|(&a, &b)| a as f64 * b as f64).sum();
                    let s0 = dot * s.scale as f64;
                    s.softcap.map_or(s0, |c| c as f64 * (s0 / c as f64).tanh())
                })
                .collect();
            let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = scores.iter().map(|x| (x - max).exp()).collect();
            let sum: f64 = e.iter().sum();
            let o = &mut out[(i * heads + h) * hd..][..hd];
            for (w, j) in e.iter().zip(first..=pos) {
                let vj = &v[(j * kvh + g) * hd..][..hd];
                for (o, &vv) in o.iter_mut().zip(vj) {
                    *o += w / sum * vv as f64;
                }
            }
        }
    }
    out
}
