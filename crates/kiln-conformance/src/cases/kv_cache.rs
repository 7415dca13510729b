//! Writing keys and values into a KV cache of each type (`write_rows`, `rope_write_kv`):
//! rows converted from F32 as `Backend::write_rows` states, rows copied as stored, rows
//! not written left as they were.

use super::attention::{inv_freq, LAYOUTS};
use crate::reference::{self, assert_close, widen};
use crate::target::{random, stored, Target};
use half::f16;
use kiln_core::{quant, AttentionParams, DType, RopeLayout, Tensor};

/// What a cache of `dtype` holds after rows of `src` (`[rows, row_len]`, F32) are written
/// at `positions` into one that held `before` (already values of `dtype`): the values,
/// and how far from each a correct backend may land. Floats are exact; a written Q8_0
/// value may be one step of its block's scale off (a GPU's reciprocal, see
/// `Backend::write_rows`), or a little more where the device's `max/127` rounds the scale
/// to the neighbouring f16.
pub(crate) fn cache_after(
    dtype: DType,
    before: &[f32],
    src: &[f32],
    row_len: usize,
    positions: &[i32],
) -> (Vec<f64>, Vec<f64>) {
    let mut want = widen(before);
    let mut slack = vec![0f64; want.len()];
    for (row, &p) in src.chunks(row_len).zip(positions) {
        let at = p as usize * row_len;
        want[at..][..row_len].copy_from_slice(&widen(&stored(dtype, row)));
        if dtype == DType::Q8_0 {
            let bytes = quant::quantize(dtype, row).unwrap();
            for (b, block) in bytes.chunks_exact(dtype.block_bytes()).enumerate() {
                let d = f16::from_le_bytes([block[0], block[1]]).to_f64();
                slack[at + b * 32..][..32].fill(1.125 * d);
            }
        }
    }
    (want, slack)
}

/// Panic, naming the first, if an element of the cache is further from `want` than its
/// slack.
#[track_caller]
pub(crate) fn assert_cache(t: &Target, cache: &Tensor, want: &(Vec<f64>, Vec<f64>), what: &str) {
    let got = t.read_decoded(cache);
    let (want, slack) = want;
    assert_eq!(got.len(), want.len(), "{what}: length");
    // Written so that NaN is never within.
    let within = |i: usize| (got[i] as f64 - want[i]).abs() <= slack[i];
    let bad: Vec<usize> = (0..got.len()).filter(|&i| !within(i)).collect();
    if let Some(&i) = bad.first() {
        panic!(
            "{what} ({}): {} of {} values off; first [{i}]: got {}, want {} ± {:e}",
            cache.dtype(),
            bad.len(),
            got.len(),
            got[i],
            want[i],
            slack[i]
        );
    }
}

/// The KV types a head of `hd` dimensions can be stored in (Q8_0 takes whole blocks).
pub(crate) fn kv_types(hd: usize) -> impl Iterator<Item = DType> {
    DType::KV_CACHE
        .into_iter()
        .filter(move |d| hd.is_multiple_of(d.block_size()))
}

pub fn write_rows(t: &Target) {
    let mut rng = t.rng(0);
    // (capacity, kv_heads, head_dim, positions): in order, out of order, every row; Q8_0
    // rows of an odd number of blocks (3 heads of one block; 3 heads of 3), so that two
    // rows' scales share a word on devices that store them in pairs.
    let all: Vec<i32> = (0..40).collect();
    for (cap, kvh, hd, positions) in [
        (6, 2, 5, &[3, 4][..]),
        (10, 2, 5, &[5, 2, 9][..]),
        (9, 3, 32, &[8, 0, 1, 2, 7][..]),
        (12, 3, 96, &[4, 5, 11, 3][..]),
        (40, 2, 64, &all[..]),
    ] {
        let row_len = kvh * hd;
        for dtype in kv_types(hd) {
            let before = stored(dtype, &random(&mut rng, cap * row_len, 1.0));
            let sv = random(&mut rng, positions.len() * row_len, 1.0);
            let mut cache = t.upload(dtype, &[cap, kvh, hd], &before);
            let src = t.upload(DType::F32, &[positions.len(), kvh, hd], &sv);
            t.backend
                .write_rows(&src, &mut cache, &t.ints(positions))
                .unwrap();
            let want = cache_after(dtype, &before, &sv, row_len, positions);
            assert_cache(
                t,
                &cache,
                &want,
                &format!("rows of {kvh}x{hd} at {positions:?}"),
            );

            // Rows of the cache's own type are copied as stored, bit for bit.
            let mut grown = t.zeros(dtype, &[cap + 3, kvh, hd]);
            let rows: Vec<i32> = (0..cap as i32).map(|r| r + 3).collect();
            t.backend
                .write_rows(&cache, &mut grown, &t.ints(&rows))
                .unwrap();
            let bytes = t.backend.download(&grown).unwrap();
            let row_bytes = dtype.row_bytes(row_len).unwrap();
            assert!(
                bytes[..3 * row_bytes].iter().all(|&b| b == 0),
                "{dtype} copy of {kvh}x{hd}: rows before the copied ones were written"
            );
            assert_eq!(
                &bytes[3 * row_bytes..],
                &t.backend.download(&cache).unwrap()[..],
                "{dtype} copy of {kvh}x{hd} rows"
            );
        }
    }
}

/// Rope by the positions, rows written at the positions or (a paged pool's slots) at
/// rows of their own.
pub fn rope_write_kv(t: &Target) {
    let mut rng = t.rng(0);
    let (n, heads, kvh, cap) = (3, 8, 2, 16);
    let positions = [7, 0, 15];
    let slots = [3, 12, 9];
    // (head_dim, rotated pairs): all, part, none.
    for (hd, pairs) in [(64, Some(32)), (64, Some(16)), (80, Some(16)), (64, None)] {
        let qv = random(&mut rng, n * heads * hd, 1.0);
        let kv = random(&mut rng, n * kvh * hd, 1.0);
        let vv = random(&mut rng, n * kvh * hd, 1.0);
        let before = random(&mut rng, cap * kvh * hd, 1.0);
        let freqs = inv_freq(pairs.unwrap_or(1), 500.0);
        for ((layout, dtype), paged) in LAYOUTS
            .into_iter()
            .flat_map(|l| kv_types(hd).map(move |d| (l, d)))
            .flat_map(|ld| [(ld, false), (ld, true)])
        {
            let rows = if paged { &slots } else { &positions };
            let before = stored(dtype, &before);
            let mut q = t.upload(DType::F32, &[n, heads, hd], &qv);
            let mut k = t.upload(DType::F32, &[n, kvh, hd], &kv);
            let v = t.upload(DType::F32, &[n, kvh, hd], &vv);
            let mut kc = t.upload(dtype, &[cap, kvh, hd], &before);
            let mut vc = t.upload(dtype, &[cap, kvh, hd], &before);
            let f = t.upload(DType::F32, &[freqs.len()], &freqs);
            t.backend
                .rope_write_kv(
                    &mut q,
                    &mut k,
                    &v,
                    &t.ints(&positions),
                    paged.then(|| t.ints(&slots)).as_ref(),
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
            let what = format!("hd={hd} pairs={pairs:?} {layout:?} {dtype} rows {rows:?}");
            assert_close(&t.read(&q), &q_want, 2e-5, &format!("{what}: q"));
            assert_close(&k_rotated, &k_want, 2e-5, &format!("{what}: k"));
            // The cache holds the rotated keys the backend left in k, in its type.
            let row_len = kvh * hd;
            let k_cache = cache_after(dtype, &before, &k_rotated, row_len, rows);
            assert_cache(t, &kc, &k_cache, &format!("{what}: k cache"));
            let v_cache = cache_after(dtype, &before, &vv, row_len, rows);
            assert_cache(t, &vc, &v_cache, &format!("{what}: v cache"));
        }
    }
}

/// A recorded batch step pads itself with rows that all write into one spare row (the
/// paged pool's spare block, see kiln-models' `batch::graphs`), at the same time and past
/// the last row of a real block. Those writes must stay within their row: the rows beside
/// it read back exactly as written, on every KV type, with rows of an odd length (f16 and
/// bf16 pairs sharing a word) and of an odd number of Q8_0 blocks (scales sharing a
/// word). What the spare row ends up holding is not checked: nothing reads it.
pub fn padding_rows_write_only_their_row(t: &Target) {
    let mut rng = t.rng(0);
    // Real rows (the spare's neighbours on both sides) and padding rows, mixed.
    let (cap, spare) = (8, 5);
    let positions = [4, spare, 0, spare, 6, spare, spare];
    let real: Vec<usize> = (0..positions.len())
        .filter(|&i| positions[i] != spare)
        .collect();
    let real_positions: Vec<i32> = real.iter().map(|&i| positions[i]).collect();
    let n = positions.len();
    // (kv_heads, head_dim, rotated pairs)
    for (kvh, hd, pairs) in [(1, 5, None), (3, 32, Some(16)), (2, 64, Some(32))] {
        let row_len = kvh * hd;
        let heads = 2 * kvh;
        let freqs = inv_freq(pairs.unwrap_or(1), 500.0);
        for dtype in kv_types(hd) {
            let before = stored(dtype, &random(&mut rng, cap * row_len, 1.0));
            let kv = random(&mut rng, n * row_len, 1.0);
            let vv = random(&mut rng, n * row_len, 1.0);
            let what = format!("{kvh}x{hd} {dtype} with padding rows");
            let real_rows = |values: &[f32]| -> Vec<f32> {
                real.iter()
                    .flat_map(|&i| values[i * row_len..][..row_len].to_vec())
                    .collect()
            };
            let check = |cache: &Tensor, written: &[f32], what: &str| {
                let (want, slack) = cache_after(
                    dtype,
                    &before,
                    &real_rows(written),
                    row_len,
                    &real_positions,
                );
                let got = t.read_decoded(cache);
                for i in (0..spare as usize * row_len)
                    .chain((spare as usize + 1) * row_len..cap * row_len)
                {
                    assert!(
                        (got[i] as f64 - want[i]).abs() <= slack[i],
                        "{what}: row {} [{}]: got {}, want {} ± {:e}",
                        i / row_len,
                        i % row_len,
                        got[i],
                        want[i],
                        slack[i]
                    );
                }
            };

            let mut cache = t.upload(dtype, &[cap, kvh, hd], &before);
            let src = t.upload(DType::F32, &[n, kvh, hd], &kv);
            t.backend
                .write_rows(&src, &mut cache, &t.ints(&positions))
                .unwrap();
            check(&cache, &kv, &format!("{what}: write_rows"));

            let mut q = t.upload(
                DType::F32,
                &[n, heads, hd],
                &random(&mut rng, n * heads * hd, 1.0),
            );
            let mut k = t.upload(DType::F32, &[n, kvh, hd], &kv);
            let v = t.upload(DType::F32, &[n, kvh, hd], &vv);
            let mut kc = t.upload(dtype, &[cap, kvh, hd], &before);
            let mut vc = t.upload(dtype, &[cap, kvh, hd], &before);
            let f = t.upload(DType::F32, &[freqs.len()], &freqs);
            t.backend
                .rope_write_kv(
                    &mut q,
                    &mut k,
                    &v,
                    &t.ints(&positions),
                    None,
                    pairs.map(|_| (&f, RopeLayout::Neox)),
                    &mut kc,
                    &mut vc,
                )
                .unwrap();
            check(&kc, &t.read(&k), &format!("{what}: rope_write_kv k"));
            check(&vc, &vv, &format!("{what}: rope_write_kv v"));
        }
    }
}

/// A KV cache is F32, F16, BF16 or Q8_0, its keys and values of one type, written from
/// F32 or its own type: anything else is an error, not garbage.
pub fn kv_caches_of_other_types_are_refused(t: &Target) {
    let b = t.backend;
    let (kvh, hd) = (2, 32);
    let rows = t.zeros(DType::F32, &[2, kvh, hd]);
    let positions = t.ints(&[0, 1]);
    for dtype in [DType::Q4_0, DType::Q4_K, DType::I32] {
        let cap = if dtype == DType::Q4_K { 8 } else { 4 };
        let hd = if dtype == DType::Q4_K { 256 } else { hd };
        let rows = t.zeros(DType::F32, &[2, kvh, hd]);
        let mut cache = t.zeros(dtype, &[cap, kvh, hd]);
        assert!(
            b.write_rows(&rows, &mut cache, &positions).is_err(),
            "write_rows into a {dtype} cache"
        );
    }
    let mut f16_cache = t.zeros(DType::F16, &[4, kvh, hd]);
    let bf16_rows = t.zeros(DType::BF16, &[2, kvh, hd]);
    assert!(
        b.write_rows(&bf16_rows, &mut f16_cache, &positions)
            .is_err(),
        "bf16 rows into an f16 cache"
    );
    b.write_rows(&rows, &mut f16_cache, &positions).unwrap();

    let q = t.zeros(DType::F32, &[1, 4, hd]);
    let mut out = t.zeros(DType::F32, &[1, 4, hd]);
    let p = AttentionParams {
        scale: 1.0,
        softcap: None,
        window: None,
    };
    let bf16_cache = t.zeros(DType::BF16, &[4, kvh, hd]);
    assert!(
        b.attention(&q, &f16_cache, &bf16_cache, &t.ints(&[1]), &p, &mut out)
            .is_err(),
        "keys f16, values bf16"
    );
    let q4 = t.zeros(DType::Q4_0, &[4, kvh, hd]);
    assert!(
        b.attention(&q, &q4, &q4, &t.ints(&[1]), &p, &mut out)
            .is_err(),
        "a q4_0 cache"
    );
    b.attention(&q, &f16_cache, &f16_cache, &t.ints(&[1]), &p, &mut out)
        .unwrap();
}
