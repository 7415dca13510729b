//! Rope, the KV cache's writes and attention: small awkward shapes, positions in any
//! order, windows and soft-caps, and the shapes of real models.

use crate::reference::{self, assert_close, widen, AttentionShape};
use crate::target::{random, Target};
use kiln_core::{AttentionParams, DType, RopeLayout};

const LAYOUTS: [RopeLayout; 2] = [RopeLayout::Interleaved, RopeLayout::Neox];

/// Rows of `src` (`[rows, row_len]`) written into a cache of `capacity` rows filled
/// with `before`: what the cache holds after.
fn cache_after(before: &[f32], src: &[f32], row_len: usize, positions: &[i32]) -> Vec<f64> {
    let mut want = widen(before);
    for (row, &p) in src.chunks(row_len).zip(positions) {
        want[p as usize * row_len..][..row_len].copy_from_slice(&widen(row));
    }
    want
}

pub fn write_rows(t: &Target) {
    let mut rng = t.rng(0);
    // (capacity, kv_heads, head_dim, positions): in order, out of order, every row.
    let all: Vec<i32> = (0..40).collect();
    for (cap, kvh, hd, positions) in [
        (6, 2, 5, &[3, 4][..]),
        (10, 2, 5, &[5, 2, 9][..]),
        (40, 2, 64, &all[..]),
    ] {
        let row_len = kvh * hd;
        let before = random(&mut rng, cap * row_len, 1.0);
        let sv = random(&mut rng, positions.len() * row_len, 1.0);
        let mut cache = t.upload(DType::F32, &[cap, kvh, hd], &before);
        let src = t.upload(DType::F32, &[positions.len(), kvh, hd], &sv);
        t.backend
            .write_rows(&src, &mut cache, &t.ints(positions))
            .unwrap();
        let want = cache_after(&before, &sv, row_len, positions);
        assert_close(&t.read(&cache), &want, 0.0, &format!("at {positions:?}"));
    }
}

fn inv_freq(pairs: usize, base: f32) -> Vec<f32> {
    (0..pairs)
        .map(|i| base.powf(-(i as f32) / pairs as f32))
        .collect()
}

pub fn rope(t: &Target) {
    let mut rng = t.rng(0);
    // (heads, head_dim, rotated pairs, positions): positions need not be consecutive or
    // small; some dimensions may stay as they are.
    let cases: [(usize, usize, usize, &[i32]); 7] = [
        (1, 2, 1, &[1234]),
        (3, 10, 5, &[1234, 1235, 1236, 1237, 1238]),
        (2, 16, 4, &[1234, 1235, 1236, 1237]),
        (3, 12, 4, &[5, 2, 9]),
        (4, 64, 32, &[5, 2, 9]),
        (4, 64, 16, &[5, 2, 9]),
        (4, 64, 24, &[3, 17, 3000]),
    ];
    for layout in LAYOUTS {
        for (heads, hd, pairs, positions) in cases {
            let xv = random(&mut rng, positions.len() * heads * hd, 2.0);
            let freqs = inv_freq(pairs, 10000.0);
            let mut x = t.upload(DType::F32, &[positions.len(), heads, hd], &xv);
            let f = t.upload(DType::F32, &[pairs], &freqs);
            t.backend
                .rope(&mut x, &t.ints(positions), &f, layout)
                .unwrap();
            let mut want = widen(&xv);
            reference::rope(&mut want, heads, hd, positions, &freqs, layout);
            let what = format!("{layout:?} hd={hd} pairs={pairs} at {positions:?}");
            assert_close(&t.read(&x), &want, 2e-5, &what);
        }
    }
}

pub fn rope_write_kv(t: &Target) {
    let mut rng = t.rng(0);
    let (n, heads, kvh, cap) = (3, 8, 2, 16);
    let positions = [7, 0, 15];
    // (head_dim, rotated pairs): all, part, none.
    for (hd, pairs) in [(64, Some(32)), (64, Some(16)), (80, Some(16)), (64, None)] {
        let qv = random(&mut rng, n * heads * hd, 1.0);
        let kv = random(&mut rng, n * kvh * hd, 1.0);
        let vv = random(&mut rng, n * kvh * hd, 1.0);
        let before = random(&mut rng, cap * kvh * hd, 1.0);
        let freqs = inv_freq(pairs.unwrap_or(1), 500.0);
        for layout in LAYOUTS {
            let mut q = t.upload(DType::F32, &[n, heads, hd], &qv);
            let mut k = t.upload(DType::F32, &[n, kvh, hd], &kv);
            let v = t.upload(DType::F32, &[n, kvh, hd], &vv);
            let mut kc = t.upload(DType::F32, &[cap, kvh, hd], &before);
            let mut vc = t.upload(DType::F32, &[cap, kvh, hd], &before);
            let f = t.upload(DType::F32, &[freqs.len()], &freqs);
            t.backend
                .rope_write_kv(
                    &mut q,
                    &mut k,
                    &v,
                    &t.ints(&positions),
                    pairs.map(|_| (&f, layout)),
                    &mut kc,
                    &mut vc,
                )
                .unwrap();
            let (mut q_want, mut k_want) = (widen(&qv), widen(&kv));
            if pairs.is_some() {
                reference::rope(&mut q_want, heads, hd, &positions, &freqs, layout);
                reference::rope(&mut k_want, kvh, hd, &positions, &freqs, layout);
            }
            let k_rotated: Vec<f32> = t.read(&k);
            let what = format!("hd={hd} pairs={pairs:?} {layout:?}");
            assert_close(&t.read(&q), &q_want, 2e-5, &format!("{what}: q"));
            assert_close(&k_rotated, &k_want, 2e-5, &format!("{what}: k"));
            let row_len = kvh * hd;
            let k_cache = cache_after(&before, &k_rotated, row_len, &positions);
            assert_close(&t.read(&kc), &k_cache, 0.0, &format!("{what}: k cache"));
            let v_cache = cache_after(&before, &vv, row_len, &positions);
            assert_close(&t.read(&vc), &v_cache, 0.0, &format!("{what}: v cache"));
        }
    }
}

/// One attention call on random q and caches, against float64.
fn check_attention(
    t: &Target,
    stream: u64,
    shape: AttentionShape,
    capacity: usize,
    positions: &[i32],
) {
    let mut rng = t.rng(stream);
    let (n, heads, kvh, hd) = (positions.len(), shape.heads, shape.kv_heads, shape.head_dim);
    let qv = random(&mut rng, n * heads * hd, 1.5);
    let kv = random(&mut rng, capacity * kvh * hd, 1.5);
    let vv = random(&mut rng, capacity * kvh * hd, 1.0);
    let q = t.upload(DType::F32, &[n, heads, hd], &qv);
    let k = t.upload(DType::F32, &[capacity, kvh, hd], &kv);
    let v = t.upload(DType::F32, &[capacity, kvh, hd], &vv);
    let mut out = t.poisoned(&[n, heads, hd]);
    let params = AttentionParams {
        scale: shape.scale,
        softcap: shape.softcap,
        window: shape.window,
    };
    t.backend
        .attention(&q, &k, &v, &t.ints(positions), &params, &mut out)
        .unwrap();
    let want = reference::attention(&qv, &kv, &vv, positions, shape);
    let first = positions.first().copied().unwrap_or(0);
    let what = format!("{shape:?} capacity {capacity}, {n} queries from {first}");
    assert_close(&t.read(&out), &want, 2e-5, &what);
}

fn consecutive(first: i32, n: i32) -> Vec<i32> {
    (first..first + n).collect()
}

/// Small heads, positions in and out of order, windows and soft-caps.
pub fn attention(t: &Target) {
    let cases = [
        (consecutive(0, 7), None, None),
        (consecutive(9, 1), None, Some(30.0f32)),
        (consecutive(3, 11), Some(4usize), None),
        (consecutive(20, 3), Some(6), Some(5.0)),
        // Each query sees the rows up to its own position, in whatever order they come.
        (vec![5, 2, 9], None, None),
        (vec![5, 2, 9], Some(3), Some(5.0)),
        (vec![39], Some(6), None),
    ];
    for (c, (positions, window, softcap)) in cases.into_iter().enumerate() {
        let shape = AttentionShape {
            heads: 6,
            kv_heads: 2,
            head_dim: 5,
            scale: 0.37,
            softcap,
            window,
        };
        check_attention(t, c as u64, shape, 40, &positions);
    }
    for (c, (window, softcap)) in [(None, None), (Some(7), Some(5.0))].into_iter().enumerate() {
        let shape = AttentionShape {
            heads: 4,
            kv_heads: 2,
            head_dim: 64,
            scale: 0.125,
            softcap,
            window,
        };
        check_attention(t, 100 + c as u64, shape, 40, &[0, 20, 39]);
    }
}

/// The shapes of real models: decode over long caches (split over the capacity), a few
/// queries, prompts, heads of 64 to 256 dimensions, Gemma 2's window and soft-cap.
pub fn attention_at_model_shapes(t: &Target) {
    // (queries, heads, kv_heads, head_dim, capacity, first position, window, softcap)
    type Case = (
        usize,
        usize,
        usize,
        usize,
        usize,
        i32,
        Option<usize>,
        Option<f32>,
    );
    let cases: [Case; 6] = [
        (1, 4, 2, 16, 64, 20, None, None),
        (1, 32, 4, 64, 700, 517, None, None),
        (3, 8, 1, 128, 600, 300, None, None),
        (40, 6, 6, 96, 64, 0, None, None),
        (33, 8, 2, 256, 80, 5, Some(7), Some(30.0)),
        (1, 16, 8, 128, 2048, 2000, Some(512), None),
    ];
    for (c, (n, heads, kvh, hd, cap, p0, window, softcap)) in cases.into_iter().enumerate() {
        let shape = AttentionShape {
            heads,
            kv_heads: kvh,
            head_dim: hd,
            scale: 1.0 / (hd as f32).sqrt(),
            softcap,
            window,
        };
        check_attention(t, c as u64, shape, cap, &consecutive(p0, n as i32));
    }
}

/// Prompts in tiles of queries (16 on wgpu): a partial last tile, heads of 64, 96 and 128,
/// grouped KV heads, positions past the start of the cache, a window and a soft-cap.
pub fn prompt_attention_in_tiles(t: &Target) {
    for (c, hd) in [64, 96, 128].into_iter().enumerate() {
        for (p, (scale, softcap, window)) in [
            (1.0 / (hd as f32).sqrt(), None, None),
            (0.2, Some(3.0), Some(21)),
        ]
        .into_iter()
        .enumerate()
        {
            let shape = AttentionShape {
                heads: 4,
                kv_heads: 2,
                head_dim: hd,
                scale,
                softcap,
                window,
            };
            check_attention(t, (c * 10 + p) as u64, shape, 90, &consecutive(40, 37));
        }
    }
}
