//! Rope and attention: small awkward shapes, positions in any order, windows and
//! soft-caps, and the shapes of real models, over caches of every KV type (the reference
//! reads the values the cache holds, so the bound is the same for all).

use super::kv_cache::kv_types;
use crate::reference::{self, assert_close, widen, AttentionShape};
use crate::target::{random, stored, Target};
use kiln_core::{AttentionParams, DType, RopeLayout};

pub(crate) const LAYOUTS: [RopeLayout; 2] = [RopeLayout::Interleaved, RopeLayout::Neox];

pub(crate) fn inv_freq(pairs: usize, base: f32) -> Vec<f32> {
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

/// One attention call on random q and caches, against float64: for each KV type the
/// head size allows, the caches hold the random values as that type stores them.
fn check_attention(
    t: &Target,
    stream: u64,
    shape: AttentionShape,
    capacity: usize,
    positions: &[i32],
) {
    for kv in kv_types(shape.head_dim) {
        check_attention_of(t, stream, shape, capacity, positions, kv);
    }
}

fn check_attention_of(
    t: &Target,
    stream: u64,
    shape: AttentionShape,
    capacity: usize,
    positions: &[i32],
    dtype: DType,
) {
    let mut rng = t.rng(stream);
    let (n, heads, kvh, hd) = (positions.len(), shape.heads, shape.kv_heads, shape.head_dim);
    let qv = random(&mut rng, n * heads * hd, 1.5);
    let kv = stored(dtype, &random(&mut rng, capacity * kvh * hd, 1.5));
    let vv = stored(dtype, &random(&mut rng, capacity * kvh * hd, 1.0));
    let q = t.upload(DType::F32, &[n, heads, hd], &qv);
    let k = t.upload(dtype, &[capacity, kvh, hd], &kv);
    let v = t.upload(dtype, &[capacity, kvh, hd], &vv);
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
    let what = format!("{shape:?} {dtype} capacity {capacity}, {n} queries from {first}");
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
    let cases: [Case; 10] = [
        (1, 4, 2, 16, 64, 20, None, None),
        (1, 32, 4, 64, 700, 517, None, None),
        (3, 8, 1, 128, 600, 300, None, None),
        (40, 6, 6, 96, 64, 0, None, None),
        (33, 8, 2, 256, 80, 5, Some(7), Some(30.0)),
        (1, 16, 8, 128, 2048, 2000, Some(512), None),
        // Groups of 32 and 12 heads (several sets of heads a block), 256-wide heads
        // decoding with a window.
        (2, 32, 1, 64, 300, 250, None, None),
        (1, 12, 1, 256, 100, 90, None, Some(50.0)),
        (1, 8, 4, 256, 300, 299, Some(100), None),
        // A group of 16 heads decoding with a soft-cap.
        (2, 16, 1, 128, 200, 150, None, Some(20.0)),
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

/// Prompts in tiles of queries (16 on wgpu, 16 or 32 on CUDA's tensor cores): a partial
/// last tile, heads of 64, 96 and 128, grouped KV heads, positions past the start of the
/// cache, a window and a soft-cap.
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
    // Real models' groups (llama3-8b's 32 heads on 8 of 128, tinyllama's groups of 8 heads
    // of 64, Qwen2's 7, heads without groups), prompts whose keys span several chunks of 64
    // and tiles of 16 and 32 rows, a window across chunk edges.
    let cases = [
        (32, 8, 128, 100, 0, None),
        (16, 2, 64, 70, 30, None),
        (14, 2, 128, 40, 90, Some(50usize)),
        (4, 4, 64, 50, 0, None),
    ];
    for (c, (heads, kvh, hd, n, p0, window)) in cases.into_iter().enumerate() {
        let shape = AttentionShape {
            heads,
            kv_heads: kvh,
            head_dim: hd,
            scale: 1.0 / (hd as f32).sqrt(),
            softcap: None,
            window,
        };
        check_attention(t, 100 + c as u64, shape, 140, &consecutive(p0, n));
    }
}
