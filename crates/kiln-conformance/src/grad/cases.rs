//! The gradient cases, one public function each (named as its test); `with_grad_cases!`
//! lists them.

mod attention;

pub use attention::{
    attention_gradients, attention_gradients_at_a_real_head_layout,
    attention_gradients_of_runs_in_place, attention_gradients_softcapped_and_windowed,
};

use super::reference as r64;
use super::{check, cotangent_f32 as cotangent, weighted, widen, Elements, MODES};
use crate::target::{random, stored};
use crate::Target;
use attention::{attention_case, small_attention};
use kiln_core::{AttentionParams, DType, GradInto, RopeLayout};
use rand::rngs::StdRng;
use std::panic::{catch_unwind, AssertUnwindSafe};

pub fn copy_add_scaled_and_sum_rows(t: &Target) {
    let g = t.grad();
    let mut rng = t.rng(0);
    let src = random(&mut rng, 35, 3.0);
    let x = t.upload(DType::F32, &[5, 7], &src);
    let mut dst = t.poisoned(&[35]);
    g.copy(&x, &mut dst).unwrap();
    assert_eq!(t.read(&dst), src, "copy");

    let (mut acc, before) = t.grad_buffer(&mut rng, &[5, 7]);
    g.add_scaled(&mut acc, &x, -0.7).unwrap();
    let got = t.added(&acc, &before);
    for (i, (&g, &s)) in got.iter().zip(&src).enumerate() {
        assert!((g - -0.7 * s as f64).abs() < 1e-6, "add_scaled [{i}]: {g}");
    }

    let (mut sums, before) = t.grad_buffer(&mut rng, &[7]);
    g.sum_rows(&x, &mut sums).unwrap();
    let got = t.added(&sums, &before);
    for c in 0..7 {
        let want: f64 = (0..5).map(|r| src[r * 7 + c] as f64).sum();
        assert!(
            (got[c] - want).abs() < 1e-5,
            "sum_rows [{c}]: {} vs {want}",
            got[c]
        );
    }
}

/// The flat-buffer moves of a training step: a span of one buffer into another (the rest
/// untouched, a span past either end refused), and `Σ x²` against float64 at a length
/// that leaves partial blocks, then with an inf and a NaN in it.
pub fn copy_span_and_sum_squares(t: &Target) {
    let g = t.grad();
    let mut rng = t.rng(1);
    let src = random(&mut rng, 1000, 3.0);
    let x = t.upload(DType::F32, &[8, 125], &src);
    let before = random(&mut rng, 777, 1.0);
    let mut dst = t.upload(DType::F32, &[777], &before);
    g.copy_span(&x, 301, &mut dst, 45, 500).unwrap();
    let mut want = before.clone();
    want[45..545].copy_from_slice(&src[301..801]);
    assert_eq!(t.read(&dst), want, "copy_span");
    for (src_at, dst_at, n) in [(600, 0, 401), (0, 300, 478), (usize::MAX, 0, 2)] {
        assert!(
            g.copy_span(&x, src_at, &mut dst, dst_at, n).is_err(),
            "copy_span of {n} from {src_at} to {dst_at} was accepted"
        );
    }
    assert_eq!(t.read(&dst), want, "a refused copy_span wrote");

    for n in [1, 1000, 70_001] {
        let v = random(&mut rng, n, 2.0);
        let want: f64 = v.iter().map(|&a| a as f64 * a as f64).sum();
        let got = g.sum_squares(&t.upload(DType::F32, &[n], &v)).unwrap();
        assert!(
            (got - want).abs() <= 1e-9 * want,
            "sum_squares of {n}: {got} vs {want}"
        );
    }
    for bad in [f32::INFINITY, f32::NAN] {
        let mut v = random(&mut rng, 5000, 1.0);
        v[4321] = bad;
        let got = g.sum_squares(&t.upload(DType::F32, &[5000], &v)).unwrap();
        assert!(!got.is_finite(), "sum_squares with {bad} in it: {got}");
    }
}

/// The gradients of `x · wᵀ` for `x [n, k]`, `w [m, k]`, checked at up to `sample`
/// elements of each.
fn matmul_case(t: &Target, (n, m, k): (usize, usize, usize), sample: usize) {
    let g = t.grad();
    let mut rng = t.rng(n as u64);
    let (x, w, r) = (
        random(&mut rng, n * k, 1.0),
        random(&mut rng, m * k, 1.0),
        cotangent(&mut rng, n * m),
    );
    let (xt, wt, rt) = (
        t.upload(DType::F32, &[n, k], &x),
        t.upload(DType::F32, &[m, k], &w),
        t.upload(DType::F32, &[n, m], &r),
    );
    let r = widen(&r);
    let (mut dw, before_w) = t.grad_buffer(&mut rng, &[m, k]);
    g.matmul_dw(&rt, &xt, &mut dw).unwrap();
    let (x64, w64) = (widen(&x), widen(&w));
    for into in MODES {
        let (mut dx, before_x) = t.grad_buffer_into(&mut rng, &[n, k], into);
        g.matmul_dx(&rt, &wt, &mut dx, into).unwrap();
        check(
            &format!("matmul dx ({into:?})"),
            &t.result(&dx, &before_x, into),
            &x,
            Elements::Sample(sample, &mut rng),
            |x| weighted(&r64::matmul(x, &w64, n, m, k), &r),
        );
    }
    check(
        "matmul dw",
        &t.added(&dw, &before_w),
        &w,
        Elements::Sample(sample, &mut rng),
        |w| weighted(&r64::matmul(&x64, w, n, m, k), &r),
    );
}

pub fn matmul_gradients(t: &Target) {
    matmul_case(t, (5, 7, 33), usize::MAX);
    matmul_case(t, (1, 3, 2), usize::MAX);
}

/// Shapes the CPU splits into many tasks over rows of dx and of dw.
pub fn matmul_gradients_over_many_tasks(t: &Target) {
    matmul_case(t, (70, 300, 41), 60);
}

/// A table wider than a block of columns and taller than a block of rows, ids repeated
/// and at both ends: every element is its tokens' float64 sum, added to what was there.
pub fn embedding_gradient_over_a_large_table(t: &Target) {
    let g = t.grad();
    let mut rng = t.rng(1);
    let (vocab, dim, n) = (1000, 300, 600);
    let ids: Vec<i32> = (0..n as i32)
        .map(|i| match i % 7 {
            0 => 0,
            1 => vocab as i32 - 1,
            2 => 129,
            _ => (i * 37 + 11) % vocab as i32,
        })
        .collect();
    let r = cotangent(&mut rng, n * dim);
    let rt = t.upload(DType::F32, &[n, dim], &r);
    let (mut dt, before) = t.grad_buffer(&mut rng, &[vocab, dim]);
    g.embedding_backward(&rt, &t.ints(&ids), &mut dt).unwrap();
    let mut want: Vec<f64> = before.iter().map(|&b| b as f64).collect();
    for (i, &id) in ids.iter().enumerate() {
        for c in 0..dim {
            want[id as usize * dim + c] += r[i * dim + c] as f64;
        }
    }
    let got = t.read(&dt);
    for (e, (&g, &w)) in got.iter().zip(&want).enumerate() {
        // ~90 f32 additions of values below 1 into one element.
        assert!(
            (g as f64 - w).abs() <= 1e-5 * w.abs().max(1.0),
            "embedding dtable[{}, {}]: {g} against {w}",
            e / dim,
            e % dim
        );
    }
}

pub fn embedding_gradient_sums_repeated_ids(t: &Target) {
    let g = t.grad();
    let mut rng = t.rng(0);
    let (vocab, dim) = (11, 6);
    let ids = [3, 0, 3, 10, 7, 3, 1, 0, 10];
    let table = random(&mut rng, vocab * dim, 1.0);
    let r = cotangent(&mut rng, ids.len() * dim);
    let rt = t.upload(DType::F32, &[ids.len(), dim], &r);
    let (mut dt, before) = t.grad_buffer(&mut rng, &[vocab, dim]);
    g.embedding_backward(&rt, &t.ints(&ids), &mut dt).unwrap();
    let r = widen(&r);
    check(
        "embedding dtable",
        &t.added(&dt, &before),
        &table,
        Elements::All,
        |tab| {
            let rows: Vec<f64> = ids
                .iter()
                .flat_map(|&i| tab[i as usize * dim..][..dim].to_vec())
                .collect();
            weighted(&rows, &r)
        },
    );
}

/// Every element of a few rows; 24 sampled ones of many.
fn small_or_sampled(rows: usize, rng: &mut rand::rngs::StdRng) -> Elements<'_> {
    match rows {
        0..8 => Elements::All,
        _ => Elements::Sample(24, rng),
    }
}

/// Small rows, and a model's width over a prompt's rows (where the weight's gradient is
/// summed over many rows: the kernels split them), the latter checked at sampled elements.
pub fn rms_norm_gradients(t: &Target) {
    let g = t.grad();
    for (case, (eps, n, d)) in [(1e-5f32, 4, 37), (0.3, 4, 37), (1e-5, 1031, 768)]
        .into_iter()
        .enumerate()
    {
        let mut rng = t.rng(case as u64);
        let mut picks = t.rng(100 + case as u64);
        let x = random(&mut rng, n * d, 2.0);
        let w = random(&mut rng, d, 1.5);
        let r = cotangent(&mut rng, n * d);
        // The weight's gradient is always added; dx as told (on a small case: written, it
        // is the same arithmetic).
        let into = MODES[case % 2];
        let (mut dx, bx) = t.grad_buffer_into(&mut rng, &[n, d], into);
        let (mut dw, bw) = t.grad_buffer(&mut rng, &[d]);
        g.rms_norm_backward(
            &t.upload(DType::F32, &[n, d], &x),
            &t.upload(DType::F32, &[d], &w),
            eps,
            &t.upload(DType::F32, &[n, d], &r),
            &mut dx,
            into,
            Some(&mut dw),
        )
        .unwrap();
        let (x64, w64, r) = (widen(&x), widen(&w), widen(&r));
        let eps = eps as f64;
        check(
            &format!("rms_norm dx ({into:?})"),
            &t.result(&dx, &bx, into),
            &x,
            small_or_sampled(n, &mut picks),
            |x| weighted(&r64::rms_norm(x, &w64, eps), &r),
        );
        check(
            "rms_norm dweight",
            &t.added(&dw, &bw),
            &w,
            small_or_sampled(n, &mut picks),
            |w| weighted(&r64::rms_norm(&x64, w, eps), &r),
        );
    }
}

/// As [`rms_norm_gradients`]: small rows, and a model's width over many rows.
pub fn layer_norm_gradients(t: &Target) {
    for (case, (n, d)) in [(3usize, 29usize), (517, 640)].into_iter().enumerate() {
        layer_norm_case(t, case as u64, n, d);
    }
}

fn layer_norm_case(t: &Target, case: u64, n: usize, d: usize) {
    let g = t.grad();
    let mut rng = t.rng(case);
    let mut picks = t.rng(100 + case);
    let eps = 1e-5f32;
    // Off-centre rows, so that the mean matters.
    let x: Vec<f32> = random(&mut rng, n * d, 2.0)
        .iter()
        .map(|v| v + 0.8)
        .collect();
    let w = random(&mut rng, d, 1.5);
    let b = random(&mut rng, d, 1.0);
    let r = cotangent(&mut rng, n * d);
    let rt = t.upload(DType::F32, &[n, d], &r);
    let into = MODES[case as usize % 2];
    let (mut dx, bx) = t.grad_buffer_into(&mut rng, &[n, d], into);
    let (mut dw, bw) = t.grad_buffer(&mut rng, &[d]);
    let (mut db, bb) = t.grad_buffer(&mut rng, &[d]);
    g.layer_norm_backward(
        &t.upload(DType::F32, &[n, d], &x),
        &t.upload(DType::F32, &[d], &w),
        eps,
        &rt,
        &mut dx,
        into,
        Some(&mut dw),
    )
    .unwrap();
    g.sum_rows(&rt, &mut db).unwrap();
    let (x64, w64, b64, r) = (widen(&x), widen(&w), widen(&b), widen(&r));
    let eps = eps as f64;
    check(
        &format!("layer_norm dx ({into:?})"),
        &t.result(&dx, &bx, into),
        &x,
        small_or_sampled(n, &mut picks),
        |x| weighted(&r64::layer_norm(x, &w64, &b64, eps), &r),
    );
    check(
        "layer_norm dweight",
        &t.added(&dw, &bw),
        &w,
        small_or_sampled(n, &mut picks),
        |w| weighted(&r64::layer_norm(&x64, w, &b64, eps), &r),
    );
    check(
        "layer_norm dbias",
        &t.added(&db, &bb),
        &b,
        small_or_sampled(n, &mut picks),
        |b| weighted(&r64::layer_norm(&x64, &w64, b, eps), &r),
    );
}

pub fn softmax_gradient(t: &Target) {
    let g = t.grad();
    let mut rng = t.rng(0);
    let (n, c) = (3, 19);
    let x = random(&mut rng, n * c, 3.0);
    let r = cotangent(&mut rng, n * c);
    let mut y = t.upload(DType::F32, &[n, c], &x);
    t.backend.softmax(&mut y).unwrap();
    let (mut dx, bx) = t.grad_buffer(&mut rng, &[n, c]);
    g.softmax_backward(&y, &t.upload(DType::F32, &[n, c], &r), &mut dx)
        .unwrap();
    let r = widen(&r);
    check("softmax dx", &t.added(&dx, &bx), &x, Elements::All, |x| {
        weighted(&r64::softmax(x, c), &r)
    });
}

pub fn rope_gradient(t: &Target) {
    let g = t.grad();
    let (tokens, heads, hd) = (5, 3, 10);
    let pos = [0, 3, 7, 100, 2];
    // 4 frequencies on heads of 10: the last two dimensions pass through.
    let inv_freq: Vec<f32> = (0..4)
        .map(|i| 1.0 / 10000f32.powf(i as f32 / 4.0))
        .collect();
    for (case, layout) in [RopeLayout::Interleaved, RopeLayout::Neox]
        .into_iter()
        .enumerate()
    {
        let mut rng = t.rng(case as u64);
        let x = random(&mut rng, tokens * heads * hd, 1.0);
        let r = cotangent(&mut rng, x.len());
        let mut d = t.upload(DType::F32, &[tokens, heads, hd], &r);
        g.rope_backward(
            &mut d,
            &t.ints(&pos),
            &t.upload(DType::F32, &[4], &inv_freq),
            layout,
        )
        .unwrap();
        let got = widen(&t.read(&d));
        let r = widen(&r);
        check(
            &format!("rope ({layout:?}) dx"),
            &got,
            &x,
            Elements::All,
            |x| weighted(&r64::rope(x, heads, hd, &pos, &inv_freq, layout), &r),
        );
    }
}

pub fn gated_gradients(t: &Target) {
    let g = t.grad();
    let cases = [false, true]
        .into_iter()
        .flat_map(|gelu| MODES.map(|into| (gelu, into)));
    for (case, (gelu, into)) in cases.enumerate() {
        let mut rng = t.rng(case as u64);
        let (n, d) = (4, 23);
        let gate = random(&mut rng, n * d, 3.0);
        let up = random(&mut rng, n * d, 2.0);
        let r = cotangent(&mut rng, n * d);
        let (mut dg, bg) = t.grad_buffer_into(&mut rng, &[n, d], into);
        let (mut du, bu) = t.grad_buffer_into(&mut rng, &[n, d], into);
        g.gated_backward(
            &t.upload(DType::F32, &[n, d], &gate),
            &t.upload(DType::F32, &[n, d], &up),
            gelu,
            &t.upload(DType::F32, &[n, d], &r),
            &mut dg,
            &mut du,
            into,
        )
        .unwrap();
        let act = if gelu { r64::gelu } else { r64::silu };
        let forward = |g: &[f64], u: &[f64]| -> Vec<f64> {
            g.iter().zip(u).map(|(&g, &u)| act(g) * u).collect()
        };
        let (g64, u64, r) = (widen(&gate), widen(&up), widen(&r));
        let name = if gelu { "gelu_mul" } else { "silu_mul" };
        check(
            &format!("{name} dgate ({into:?})"),
            &t.result(&dg, &bg, into),
            &gate,
            Elements::All,
            |g| weighted(&forward(g, &u64), &r),
        );
        check(
            &format!("{name} dup ({into:?})"),
            &t.result(&du, &bu, into),
            &up,
            Elements::All,
            |u| weighted(&forward(&g64, u), &r),
        );
    }
}

pub fn gelu_and_softcap_gradients(t: &Target) {
    let g = t.grad();
    let mut rng = t.rng(0);
    let (n, d, cap) = (3, 17, 2.5f32);
    let x = random(&mut rng, n * d, 6.0);
    let r = cotangent(&mut rng, n * d);
    let (xt, rt) = (
        t.upload(DType::F32, &[n, d], &x),
        t.upload(DType::F32, &[n, d], &r),
    );
    let r64v = widen(&r);
    let (mut dx, bx) = t.grad_buffer(&mut rng, &[n, d]);
    g.gelu_backward(&xt, &rt, &mut dx).unwrap();
    check("gelu dx", &t.added(&dx, &bx), &x, Elements::All, |x| {
        let y: Vec<f64> = x.iter().map(|&v| r64::gelu(v)).collect();
        weighted(&y, &r64v)
    });
    let mut y = t.upload(DType::F32, &[n, d], &x);
    t.backend.softcap(&mut y, cap).unwrap();
    let (mut dx, bx) = t.grad_buffer(&mut rng, &[n, d]);
    g.softcap_backward(&y, cap, &rt, &mut dx).unwrap();
    let c = cap as f64;
    check("softcap dx", &t.added(&dx, &bx), &x, Elements::All, |x| {
        let y: Vec<f64> = x.iter().map(|&v| c * (v / c).tanh()).collect();
        weighted(&y, &r64v)
    });
}

pub fn slice_cols_and_write_rows_gradients(t: &Target) {
    let g = t.grad();
    let mut rng = t.rng(0);
    // slice_cols: columns 5..11 of [4, 13].
    let src = random(&mut rng, 4 * 13, 1.0);
    let r = cotangent(&mut rng, 4 * 6);
    let (mut ds, bs) = t.grad_buffer(&mut rng, &[4, 13]);
    g.slice_cols_backward(&t.upload(DType::F32, &[4, 6], &r), 5, &mut ds)
        .unwrap();
    let r64v = widen(&r);
    check(
        "slice_cols dsrc",
        &t.added(&ds, &bs),
        &src,
        Elements::All,
        |s| {
            let cols: Vec<f64> = (0..4).flat_map(|i| s[i * 13 + 5..][..6].to_vec()).collect();
            weighted(&cols, &r64v)
        },
    );

    // write_rows: 3 rows of [2, w] into rows 4, 0, 6 of [7, 2, w]; rows of 12 values take
    // the GPUs' 16-byte path.
    for (w, into) in [5, 6].into_iter().flat_map(|w| MODES.map(|into| (w, into))) {
        let (rows, row, dst_rows) = (3, 2 * w, 7);
        let pos = [4, 0, 6];
        let src = random(&mut rng, rows * row, 1.0);
        let dst = random(&mut rng, dst_rows * row, 1.0);
        let r = cotangent(&mut rng, dst_rows * row);
        let forward = |s: &[f64], d: &[f64]| {
            let mut out = d.to_vec();
            for (i, &p) in pos.iter().enumerate() {
                out[p as usize * row..][..row].copy_from_slice(&s[i * row..][..row]);
            }
            out
        };
        let rt = t.upload(DType::F32, &[dst_rows, 2, w], &r);
        let (mut dsrc, bs) = t.grad_buffer_into(&mut rng, &[rows, 2, w], into);
        g.gather_rows(&rt, &t.ints(&pos), &mut dsrc, into).unwrap();
        let mut ddst = t.upload(DType::F32, &[dst_rows, 2, w], &r);
        g.zero_rows(&mut ddst, &t.ints(&pos)).unwrap();
        let (s64, d64, r) = (widen(&src), widen(&dst), widen(&r));
        check(
            &format!("write_rows dsrc, rows of {row} ({into:?})"),
            &t.result(&dsrc, &bs, into),
            &src,
            Elements::All,
            |s| weighted(&forward(s, &d64), &r),
        );
        check(
            &format!("write_rows ddst, rows of {row}"),
            &widen(&t.read(&ddst)),
            &dst,
            Elements::All,
            |d| weighted(&forward(&s64, d), &r),
        );
    }
}

/// The scale of the fused loss's sum in its cases.
const CE_SCALE: f32 = 0.37;

/// One run of the fused loss over random inputs, its losses checked against float64.
struct CrossEntropyRun {
    h: Vec<f32>,
    w: Vec<f32>,
    targets: Vec<i32>,
    losses: Vec<f32>,
    /// What the kernel added to each gradient.
    dh: Vec<f64>,
    dw: Vec<f64>,
}

/// The fused loss of `n` rows of `dim` against a vocabulary of `vocab`, with gradients.
fn cross_entropy_run(
    t: &Target,
    rng: &mut StdRng,
    (n, dim, vocab): (usize, usize, usize),
    softcap: Option<f32>,
) -> CrossEntropyRun {
    let h = random(rng, n * dim, 1.0);
    let w = random(rng, vocab * dim, 1.0);
    let targets: Vec<i32> = (0..n).map(|i| ((i * 7919 + 13) % vocab) as i32).collect();
    let (mut dh, bh) = t.grad_buffer(rng, &[n, dim]);
    // Each of dw's elements sums n rows of probabilities about 1/vocab.
    let dw_size = (n as f32 / vocab as f32).min(0.5);
    let (mut dw, bw) = t.grad_buffer_of(rng, &[vocab, dim], dw_size);
    let mut losses = t.poisoned(&[n]);
    t.grad()
        .cross_entropy(
            &t.upload(DType::F32, &[n, dim], &h),
            &t.upload(DType::F32, &[vocab, dim], &w),
            &t.ints(&targets),
            softcap,
            CE_SCALE,
            &mut losses,
            Some(&mut dh),
            Some(&mut dw),
        )
        .unwrap();
    let cap = softcap.map(|c| c as f64);
    let want = r64::cross_entropy(&widen(&h), &widen(&w), &targets, dim, cap);
    let losses = t.read(&losses);
    check_losses("cross_entropy", &losses, &want);
    CrossEntropyRun {
        dh: t.added(&dh, &bh),
        dw: t.added(&dw, &bw),
        h,
        w,
        targets,
        losses,
    }
}

/// The fused loss of `n` rows of `dim` against a vocabulary of `vocab`: the losses
/// against the float64 ones, and both gradients at up to `sample` elements each.
fn cross_entropy_case(
    t: &Target,
    (n, dim, vocab): (usize, usize, usize),
    softcap: Option<f32>,
    sample: usize,
) {
    let mut rng = t.rng(vocab as u64 + softcap.is_some() as u64);
    let run = cross_entropy_run(t, &mut rng, (n, dim, vocab), softcap);
    let (h64, w64) = (widen(&run.h), widen(&run.w));
    let cap = softcap.map(|c| c as f64);
    let total = |h: &[f64], w: &[f64]| {
        CE_SCALE as f64
            * r64::cross_entropy(h, w, &run.targets, dim, cap)
                .iter()
                .sum::<f64>()
    };
    let pick = Elements::Sample(sample, &mut rng);
    check("cross_entropy dh", &run.dh, &run.h, pick, |h| {
        total(h, &w64)
    });
    let pick = Elements::Sample(sample, &mut rng);
    check("cross_entropy dw", &run.dw, &run.w, pick, |w| {
        total(&h64, w)
    });

    // Without gradients asked: the same losses, and nothing else touched.
    let mut again = t.poisoned(&[n]);
    t.grad()
        .cross_entropy(
            &t.upload(DType::F32, &[n, dim], &run.h),
            &t.upload(DType::F32, &[vocab, dim], &run.w),
            &t.ints(&run.targets),
            softcap,
            CE_SCALE,
            &mut again,
            None,
            None,
        )
        .unwrap();
    assert_eq!(
        t.read(&again),
        run.losses,
        "cross_entropy without gradients"
    );
}

pub fn cross_entropy_loss_and_gradients(t: &Target) {
    cross_entropy_case(t, (9, 13, 29), None, usize::MAX);
    cross_entropy_case(t, (9, 13, 29), Some(3.0), usize::MAX);
}

/// A vocabulary large enough that backends take the rows a block at a time, and rows
/// enough for more than one block of each (the CPU's blocks hold 26 of these rows,
/// CUDA's 838): central differences at few rows, and every element of both gradients
/// against their float64 formula at many (there the differences would measure the
/// rounding of float64's sums of 40,000 terms).
pub fn cross_entropy_over_blocks_of_rows(t: &Target) {
    cross_entropy_case(t, (30, 4, 40_000), None, 12);
    let (n, dim, vocab) = (850, 3, 40_000);
    let run = cross_entropy_run(t, &mut t.rng(3), (n, dim, vocab), None);
    let (h64, w64) = (widen(&run.h), widen(&run.w));
    let (want_dh, want_dw) =
        r64::cross_entropy_grads(&h64, &w64, &run.targets, dim, CE_SCALE as f64);
    check_formula("cross_entropy dh", &run.dh, &want_dh);
    check_formula("cross_entropy dw", &run.dw, &want_dw);
}

/// Each loss within 1e-5 (relative, beyond 1) of its float64 value.
#[track_caller]
fn check_losses(what: &str, got: &[f32], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}: losses");
    for (i, (&got, want)) in got.iter().zip(want).enumerate() {
        assert!(
            (got as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()),
            "{what} loss [{i}]: {got} vs {want}"
        );
    }
}

/// Every element of a gradient within [`super::TOL`] of the largest of its float64
/// formula's: at sizes where central differences would measure float64's own rounding.
#[track_caller]
fn check_formula(what: &str, got: &[f64], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let largest = want.iter().fold(0f64, |m, v| m.max(v.abs()));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= super::TOL * largest,
            "{what} [{i}]: {g} against {w} (largest {largest})"
        );
    }
}

/// Frozen weights kept as stored (LoRA over a quantized model): `matmul_dx` and the fused
/// loss without `dw` read each type the backend takes as `quant::dequantize` decodes it,
/// at 37 rows (a partial panel of the CPU's 16) and rows of 512 (whole K-quant blocks);
/// a type the backend does not take is refused, not misread.
pub fn gradients_through_frozen_weights_as_stored(t: &Target) {
    let g = t.grad();
    let (n, m, k) = (6, 37, 512);
    for (i, dtype) in DType::ALL.into_iter().enumerate() {
        let mut rng = t.rng(40 + i as u64);
        let (x, w, r) = (
            random(&mut rng, n * k, 1.0),
            random(&mut rng, m * k, 1.0),
            cotangent(&mut rng, n * m),
        );
        let (wt, rt) = (
            t.upload(dtype, &[m, k], &w),
            t.upload(DType::F32, &[n, m], &r),
        );
        // Written by the odd types, added by the even ones.
        let into = MODES[i % 2];
        let (mut dx, before) = t.grad_buffer_into(&mut rng, &[n, k], into);
        let result = g.matmul_dx(&rt, &wt, &mut dx, into);
        if !g.frozen_as_stored(dtype) {
            assert!(result.is_err(), "matmul_dx over {dtype} weights was taken");
            continue;
        }
        result.unwrap();
        let (w64, r) = (widen(&stored(dtype, &w)), widen(&r));
        check(
            &format!("matmul dx through {dtype} weights ({into:?})"),
            &t.result(&dx, &before, into),
            &x,
            Elements::Sample(40, &mut rng),
            |x| weighted(&r64::matmul(x, &w64, n, m, k), &r),
        );

        // The same weight as the output projection of the fused loss.
        let (vocab, dim) = (m, k);
        let h = random(&mut rng, n * dim, 1.0);
        let targets: Vec<i32> = (0..n).map(|i| ((i * 11 + 3) % vocab) as i32).collect();
        let (mut dh, bh) = t.grad_buffer(&mut rng, &[n, dim]);
        let mut losses = t.poisoned(&[n]);
        let h_t = t.upload(DType::F32, &[n, dim], &h);
        let ids = t.ints(&targets);
        g.cross_entropy(
            &h_t,
            &wt,
            &ids,
            None,
            CE_SCALE,
            &mut losses,
            Some(&mut dh),
            None,
        )
        .unwrap();
        let want = r64::cross_entropy(&widen(&h), &w64, &targets, dim, None);
        check_losses(
            &format!("cross_entropy over {dtype} weights"),
            &t.read(&losses),
            &want,
        );
        check(
            &format!("cross_entropy dh through {dtype} weights"),
            &t.added(&dh, &bh),
            &h,
            Elements::Sample(40, &mut rng),
            |h| {
                CE_SCALE as f64
                    * r64::cross_entropy(h, &w64, &targets, dim, None)
                        .iter()
                        .sum::<f64>()
            },
        );
        if dtype != DType::F32 {
            let (mut dw, _) = t.grad_buffer(&mut rng, &[vocab, dim]);
            let asked = g.cross_entropy(
                &h_t,
                &wt,
                &ids,
                None,
                CE_SCALE,
                &mut losses,
                None,
                Some(&mut dw),
            );
            assert!(
                asked.is_err(),
                "the gradient of a {dtype} projection was taken"
            );
        }
    }
}

/// A frozen Q8_0 weight taller than the CPU decodes at once (32 MiB of f32 rows: 1,024
/// rows of 8,192): `matmul_dx` and the fused loss's `dh` over it against their float64
/// formulas at every element, and the losses.
pub fn frozen_weights_over_many_decoded_tiles(t: &Target) {
    let g = t.grad();
    let dtype = DType::Q8_0;
    if !g.frozen_as_stored(dtype) {
        return;
    }
    let (n, m, k) = (3, 2_500, 8_192);
    let mut rng = t.rng(77);
    let w = random(&mut rng, m * k, 1.0);
    let wt = t.upload(dtype, &[m, k], &w);
    let w64 = widen(&stored(dtype, &w));
    let r = cotangent(&mut rng, n * m);
    // Written: the first tile of rows writes, the others add to it.
    let into = GradInto::Write;
    let (mut dx, before) = t.grad_buffer_into(&mut rng, &[n, k], into);
    g.matmul_dx(&t.upload(DType::F32, &[n, m], &r), &wt, &mut dx, into)
        .unwrap();
    let got = t.result(&dx, &before, into);
    let want: Vec<f64> = (0..n * k)
        .map(|e| {
            let (i, c) = (e / k, e % k);
            (0..m).map(|o| r[i * m + o] as f64 * w64[o * k + c]).sum()
        })
        .collect();
    check_formula(&format!("matmul dx over {m} rows of Q8_0"), &got, &want);

    let h = random(&mut rng, n * k, 0.05);
    let targets: Vec<i32> = (0..n).map(|i| (i * 977 + 5) as i32 % m as i32).collect();
    let (mut dh, bh) = t.grad_buffer(&mut rng, &[n, k]);
    let mut losses = t.poisoned(&[n]);
    g.cross_entropy(
        &t.upload(DType::F32, &[n, k], &h),
        &wt,
        &t.ints(&targets),
        None,
        CE_SCALE,
        &mut losses,
        Some(&mut dh),
        None,
    )
    .unwrap();
    let h64 = widen(&h);
    let want = r64::cross_entropy(&h64, &w64, &targets, k, None);
    let what = format!("cross_entropy over {m} rows of Q8_0");
    check_losses(&what, &t.read(&losses), &want);
    let (want_dh, _) = r64::cross_entropy_grads(&h64, &w64, &targets, k, CE_SCALE as f64);
    check_formula(&format!("{what}: dh"), &t.added(&dh, &bh), &want_dh);
}

/// Whether `f` panics (its message still printed: it shows what was caught).
fn panics(f: impl FnOnce()) -> bool {
    catch_unwind(AssertUnwindSafe(f)).is_err()
}

/// The checks fail for kernels that are slightly wrong: attention whose window is off by
/// one, and a product that reads one weight 0.1% off.
pub fn a_wrong_gradient_is_caught(t: &Target) {
    let params = AttentionParams {
        scale: 1.0 / 3.0,
        softcap: None,
        window: Some(3),
    };
    assert!(
        panics(|| attention_case(t, params, Some(4), small_attention())),
        "an attention gradient with the window off by one passed"
    );

    let g = t.grad();
    let mut rng = t.rng(0);
    let (n, m, k) = (4, 5, 6);
    let w = random(&mut rng, m * k, 1.0);
    let r = cotangent(&mut rng, n * m);
    let mut misread = w.clone();
    misread[7] *= 1.001;
    let (mut dx, bx) = t.grad_buffer(&mut rng, &[n, k]);
    g.matmul_dx(
        &t.upload(DType::F32, &[n, m], &r),
        &t.upload(DType::F32, &[m, k], &misread),
        &mut dx,
        GradInto::Add,
    )
    .unwrap();
    let x = random(&mut rng, n * k, 1.0);
    let (w64, r) = (widen(&w), widen(&r));
    let got = t.added(&dx, &bx);
    assert!(
        panics(|| check(
            "matmul dx, one weight misread",
            &got,
            &x,
            Elements::All,
            |x| { weighted(&r64::matmul(x, &w64, n, m, k), &r) }
        )),
        "a matmul gradient from a weight 0.1% off passed"
    );
}
