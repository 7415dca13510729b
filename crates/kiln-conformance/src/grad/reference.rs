//! Float64 forwards of the ops whose gradients are checked, taking f64 inputs so that
//! central differences can move any one of them.

use kiln_core::RopeLayout;

/// `out[n, m] = x[n, k] · w[m, k]ᵀ`.
pub(crate) fn matmul(x: &[f64], w: &[f64], n: usize, m: usize, k: usize) -> Vec<f64> {
    let mut out = vec![0f64; n * m];
    for i in 0..n {
        for r in 0..m {
            out[i * m + r] = (0..k).map(|c| x[i * k + c] * w[r * k + c]).sum();
        }
    }
    out
}

pub(crate) fn rms_norm(x: &[f64], w: &[f64], eps: f64) -> Vec<f64> {
    let d = w.len();
    x.chunks(d)
        .flat_map(|r| {
            let s = 1.0 / (r.iter().map(|v| v * v).sum::<f64>() / d as f64 + eps).sqrt();
            r.iter().zip(w).map(move |(v, w)| v * s * w)
        })
        .collect()
}

pub(crate) fn layer_norm(x: &[f64], w: &[f64], b: &[f64], eps: f64) -> Vec<f64> {
    let d = w.len();
    x.chunks(d)
        .flat_map(|r| {
            let mean = r.iter().sum::<f64>() / d as f64;
            let var = r.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / d as f64;
            let s = 1.0 / (var + eps).sqrt();
            r.iter()
                .zip(w.iter().zip(b))
                .map(move |(v, (w, b))| (v - mean) * s * w + b)
        })
        .collect()
}

pub(crate) fn softmax(x: &[f64], cols: usize) -> Vec<f64> {
    x.chunks(cols)
        .flat_map(|r| {
            let max = r.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let sum: f64 = r.iter().map(|v| (v - max).exp()).sum();
            r.iter().map(move |v| (v - max).exp() / sum)
        })
        .collect()
}

/// Rope on `[tokens, heads, head_dim]` with the angles the backends use (`pos · f` in f32).
pub(crate) fn rope(
    x: &[f64],
    heads: usize,
    hd: usize,
    pos: &[i32],
    inv_freq: &[f32],
    layout: RopeLayout,
) -> Vec<f64> {
    let half = inv_freq.len();
    let mut out = x.to_vec();
    for (t, &p) in pos.iter().enumerate() {
        for h in 0..heads {
            let head = &mut out[(t * heads + h) * hd..][..hd];
            for (i, &f) in inv_freq.iter().enumerate() {
                let theta = (p as f32 * f) as f64;
                let (c, s) = (theta.cos(), theta.sin());
                let (a, b) = match layout {
                    RopeLayout::Interleaved => (2 * i, 2 * i + 1),
                    RopeLayout::Neox => (i, i + half),
                };
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0 * c - x1 * s;
                head[b] = x0 * s + x1 * c;
            }
        }
    }
    out
}

/// The shape and parameters of an attention call.
#[derive(Clone, Copy)]
pub(crate) struct Attn {
    pub heads: usize,
    pub kv_heads: usize,
    pub hd: usize,
    pub scale: f64,
    pub softcap: Option<f64>,
    pub window: Option<usize>,
}

pub(crate) fn attention(q: &[f64], k: &[f64], v: &[f64], pos: &[i32], a: Attn) -> Vec<f64> {
    let (heads, kvh, hd) = (a.heads, a.kv_heads, a.hd);
    let mut out = vec![0f64; pos.len() * heads * hd];
    for (i, &p) in pos.iter().enumerate() {
        let p = p as usize;
        let first = a.window.map_or(0, |w| (p + 1).saturating_sub(w));
        for h in 0..heads {
            let g = h / (heads / kvh);
            let qh = &q[(i * heads + h) * hd..][..hd];
            let scores: Vec<f64> = (first..=p)
                .map(|j| {
                    let kj = &k[(j * kvh + g) * hd..][..hd];
                    let s: f64 = qh.iter().zip(kj).map(|(a, b)| a * b).sum::<f64>() * a.scale;
                    a.softcap.map_or(s, |c| c * (s / c).tanh())
                })
                .collect();
            let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let sum: f64 = e.iter().sum();
            let o = &mut out[(i * heads + h) * hd..][..hd];
            for (w, j) in e.iter().zip(first..=p) {
                let vj = &v[(j * kvh + g) * hd..][..hd];
                o.iter_mut().zip(vj).for_each(|(o, vv)| *o += w / sum * vv);
            }
        }
    }
    out
}

pub(crate) fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

pub(crate) fn gelu(x: f64) -> f64 {
    let c = (2.0 / std::f64::consts::PI).sqrt();
    0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())
}

/// `Σ_i logsumexp(z_i) − z_i[t_i]` with `z = cap·tanh(h·wᵀ/cap)` (or `h·wᵀ`), per row.
/// The gradients of `scale · Σ cross_entropy(h, w)` (no softcap), from their formula:
/// `dz = scale · (softmax(z) − onehot)`, `dh = dz · w`, `dw = dzᵀ · h`. For shapes whose
/// central differences drown in the rounding of a long float64 sum.
pub(crate) fn cross_entropy_grads(
    h: &[f64],
    w: &[f64],
    targets: &[i32],
    dim: usize,
    scale: f64,
) -> (Vec<f64>, Vec<f64>) {
    let (n, vocab) = (targets.len(), w.len() / dim);
    let z = matmul(h, w, n, vocab, dim);
    let (mut dh, mut dw) = (vec![0f64; n * dim], vec![0f64; vocab * dim]);
    for (r, (zr, &t)) in z.chunks(vocab).zip(targets).enumerate() {
        let max = zr.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let total: f64 = zr.iter().map(|v| (v - max).exp()).sum();
        let hr = &h[r * dim..][..dim];
        for (j, &v) in zr.iter().enumerate() {
            let dz = scale * ((v - max).exp() / total - (j == t as usize) as u8 as f64);
            for c in 0..dim {
                dh[r * dim + c] += dz * w[j * dim + c];
                dw[j * dim + c] += dz * hr[c];
            }
        }
    }
    (dh, dw)
}

pub(crate) fn cross_entropy(
    h: &[f64],
    w: &[f64],
    targets: &[i32],
    dim: usize,
    softcap: Option<f64>,
) -> Vec<f64> {
    let (n, vocab) = (targets.len(), w.len() / dim);
    let z = matmul(h, w, n, vocab, dim);
    z.chunks(vocab)
        .zip(targets)
        .map(|(r, &t)| {
            let r: Vec<f64> = r
                .iter()
                .map(|&v| softcap.map_or(v, |c| c * (v / c).tanh()))
                .collect();
            let max = r.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = max + r.iter().map(|v| (v - max).exp()).sum::<f64>().ln();
            lse - r[t as usize]
        })
        .collect()
}
