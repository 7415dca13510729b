//! The attention's gradient cases: one sequence's cache, and runs of a paged pool in
//! place.

use super::super::reference::{self as r64, Attn};
use super::super::{check, cotangent_f32 as cotangent, weighted, widen, Elements, MODES};
use crate::target::random;
use crate::Target;
use kiln_core::{AttentionParams, DType};
use rand::rngs::StdRng;

/// Queries of `heads` heads over `kv_heads` of width `hd`, at `pos`, in a cache of `cap`
/// rows; `sample`: how many elements of each gradient are checked (all when `None`).
pub(super) struct AttnCase {
    heads: usize,
    kv_heads: usize,
    hd: usize,
    cap: usize,
    pos: Vec<i32>,
    sample: Option<usize>,
}

/// 5 queries of 6 heads over 2 KV heads of width 9, in a cache of 11 rows.
pub(super) fn small_attention() -> AttnCase {
    AttnCase {
        heads: 6,
        kv_heads: 2,
        hd: 9,
        cap: 11,
        pos: vec![3, 7, 4, 6, 5],
        sample: None,
    }
}

/// `most` sampled elements, or all.
fn elements(most: Option<usize>, pick: &mut StdRng) -> Elements<'_> {
    match most {
        Some(most) => Elements::Sample(most, pick),
        None => Elements::All,
    }
}

/// Attention's three gradients; the cache rows past the last position must get nothing.
pub(super) fn attention_case(
    t: &Target,
    params: AttentionParams,
    kernel_window: Option<usize>,
    c: AttnCase,
) {
    let g = t.grad();
    let mut rng = t.rng(params.window.unwrap_or(0) as u64);
    let (n, heads, kvh, hd, cap) = (c.pos.len(), c.heads, c.kv_heads, c.hd, c.cap);
    let pos = c.pos;
    let q = random(&mut rng, n * heads * hd, 1.0);
    let k = random(&mut rng, cap * kvh * hd, 1.0);
    let v = random(&mut rng, cap * kvh * hd, 1.0);
    let r = cotangent(&mut rng, n * heads * hd);
    let (mut dq, bq) = t.grad_buffer(&mut rng, &[n, heads, hd]);
    let (mut dk, bk) = t.grad_buffer(&mut rng, &[cap, kvh, hd]);
    let (mut dv, bv) = t.grad_buffer(&mut rng, &[cap, kvh, hd]);
    g.attention_backward(
        &t.upload(DType::F32, &[n, heads, hd], &q),
        &t.upload(DType::F32, &[cap, kvh, hd], &k),
        &t.upload(DType::F32, &[cap, kvh, hd], &v),
        &t.ints(&pos),
        &AttentionParams {
            window: kernel_window,
            ..params
        },
        &t.upload(DType::F32, &[n, heads, hd], &r),
        &mut dq,
        &mut dk,
        &mut dv,
    )
    .unwrap();
    let a = Attn {
        heads,
        kv_heads: kvh,
        hd,
        scale: params.scale as f64,
        softcap: params.softcap.map(|c| c as f64),
        window: params.window,
    };
    let (q64, k64, v64, r) = (widen(&q), widen(&k), widen(&v), widen(&r));
    let got_dk = t.added(&dk, &bk);
    let got_dv = t.added(&dv, &bv);
    // Rows past every position are not read, so get no gradient at all.
    let unseen = (pos.iter().max().map_or(0, |&p| p as usize + 1)) * kvh * hd;
    assert!(
        got_dk[unseen..]
            .iter()
            .chain(&got_dv[unseen..])
            .all(|&d| d == 0.0),
        "attention: cache rows no query sees got a gradient"
    );
    let mut pick = t.rng(7);
    check(
        "attention dq",
        &t.added(&dq, &bq),
        &q,
        elements(c.sample, &mut pick),
        |q| weighted(&r64::attention(q, &k64, &v64, &pos, a), &r),
    );
    check(
        "attention dk",
        &got_dk,
        &k,
        elements(c.sample, &mut pick),
        |k| weighted(&r64::attention(&q64, k, &v64, &pos, a), &r),
    );
    check(
        "attention dv",
        &got_dv,
        &v,
        elements(c.sample, &mut pick),
        |v| weighted(&r64::attention(&q64, &k64, v, &pos, a), &r),
    );
}

/// Two sequences' runs over their spans of a shared pool, in place
/// ([`kiln_core::GradOps::attention_backward_runs`]), where the backend has that path: each
/// run's gradients against central differences of the contiguous attention of its rows
/// over its span, pool rows outside every span untouched. A backend without it composes
/// the paged backward from the contiguous one (checked by kiln-train's model gradients).
pub fn attention_gradients_of_runs_in_place(t: &Target) {
    use kiln_core::AttentionRun;
    let g = t.grad();
    let mut rng = t.rng(11);
    let (heads, kvh, hd) = (4, 2, 8);
    // Two short runs (one of them with positions out of order) and a long one.
    let long = 300;
    let runs = [
        AttentionRun {
            rows: (0, 5),
            keys: (3, 6),
        },
        AttentionRun {
            rows: (5, 7),
            keys: (11, 7),
        },
        AttentionRun {
            rows: (12, long),
            keys: (20, long + 2),
        },
    ];
    let mut pos: Vec<i32> = vec![1, 3, 2, 4, 5, 0, 1, 2, 3, 4, 5, 6];
    pos.extend(2..2 + long as i32);
    let pool = 20 + long + 2;
    let n = pos.len();
    let (qw, kw) = (heads * hd, kvh * hd);
    let q = random(&mut rng, n * qw, 1.0);
    let k = random(&mut rng, pool * kw, 1.0);
    let v = random(&mut rng, pool * kw, 1.0);
    let r = cotangent(&mut rng, n * qw);
    let params = AttentionParams {
        scale: 0.4,
        softcap: None,
        window: None,
    };
    let a = Attn {
        heads,
        kv_heads: kvh,
        hd,
        scale: params.scale as f64,
        softcap: None,
        window: None,
    };
    let forward = |q: &[f64], k: &[f64], v: &[f64]| -> Vec<f64> {
        runs.iter()
            .flat_map(|run| {
                let (r0, rn) = run.rows;
                let (k0, kn) = run.keys;
                r64::attention(
                    &q[r0 * qw..(r0 + rn) * qw],
                    &k[k0 * kw..(k0 + kn) * kw],
                    &v[k0 * kw..(k0 + kn) * kw],
                    &pos[r0..r0 + rn],
                    a,
                )
            })
            .collect()
    };
    let (q64, k64, v64, r64s) = (widen(&q), widen(&k), widen(&v), widen(&r));
    // Added, and written (the pool's rows 18 and 19 are no run's keys: zeros).
    for into in MODES {
        let (mut dq, bq) = t.grad_buffer_into(&mut rng, &[n, heads, hd], into);
        let (mut dk, bk) = t.grad_buffer_into(&mut rng, &[pool, kvh, hd], into);
        let (mut dv, bv) = t.grad_buffer_into(&mut rng, &[pool, kvh, hd], into);
        let ran = g
            .attention_backward_runs(
                &t.upload(DType::F32, &[n, heads, hd], &q),
                &t.upload(DType::F32, &[pool, kvh, hd], &k),
                &t.upload(DType::F32, &[pool, kvh, hd], &v),
                &t.ints(&pos),
                &runs,
                &params,
                None,
                &t.upload(DType::F32, &[n, heads, hd], &r),
                &mut dq,
                &mut dk,
                &mut dv,
                into,
            )
            .unwrap();
        if !ran {
            eprintln!("skipped: this backend has no in-place paged attention backward");
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&t.read(&dq)),
                bits(&bq),
                "a backend that declined wrote dq"
            );
            return;
        }
        // Sampled: each difference is a whole forward of the long run.
        let mut pick = t.rng(7);
        let r = &r64s;
        let dq = t.result(&dq, &bq, into);
        check(
            &format!("runs dq ({into:?})"),
            &dq,
            &q,
            Elements::Sample(300, &mut pick),
            |q| weighted(&forward(q, &k64, &v64), r),
        );
        let dk = t.result(&dk, &bk, into);
        check(
            &format!("runs dk ({into:?})"),
            &dk,
            &k,
            Elements::Sample(300, &mut pick),
            |k| weighted(&forward(&q64, k, &v64), r),
        );
        let dv = t.result(&dv, &bv, into);
        check(
            &format!("runs dv ({into:?})"),
            &dv,
            &v,
            Elements::Sample(300, &mut pick),
            |v| weighted(&forward(&q64, &k64, v), r),
        );
    }
}

pub fn attention_gradients(t: &Target) {
    let params = AttentionParams {
        scale: 1.0 / 3.0,
        softcap: None,
        window: None,
    };
    attention_case(t, params, None, small_attention());
}

/// A real model's heads (32 on 8 KV heads of 128: CUDA batches each product over the 8
/// heads of one slot of the groups) over a 160-token prompt, at sampled elements.
pub fn attention_gradients_at_a_real_head_layout(t: &Target) {
    let params = AttentionParams {
        scale: 1.0 / 128f32.sqrt(),
        softcap: None,
        window: None,
    };
    let case = AttnCase {
        heads: 32,
        kv_heads: 8,
        hd: 128,
        cap: 192,
        pos: (0..160).collect(),
        sample: Some(6),
    };
    attention_case(t, params, None, case);
}

pub fn attention_gradients_softcapped_and_windowed(t: &Target) {
    // Scale 1 on inputs of ±1 over 9 dimensions: scores reach the cap of 2.
    let params = AttentionParams {
        scale: 1.0,
        softcap: Some(2.0),
        window: Some(3),
    };
    attention_case(t, params, params.window, small_attention());
}
