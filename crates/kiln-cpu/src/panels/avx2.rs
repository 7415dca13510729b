//! Panel kernels on AVX2 (x86_64 without AVX-512: AMD Zen 2/3, Intel client cores).
//!
//! A 256-bit register holds 8 lanes: half a panel. Per block and chunk `c` of 4 quants,
//! one load brings those 4 quants of 8 rows; the low and high nibbles (elements `4c..` and
//! `16+4c..` of each row's block) are multiplied with the activation's 4 matching quants
//! broadcast to every lane (`vpmaddubsw`: unsigned nibble × signed quant, pairs summed to
//! i16). The 8 such products of a block add up in i16 (at most 8 · 2 · 15 · 128 = 30,720:
//! no overflow), then go to i32 once, take the offset correction, and are scaled by the 8
//! rows' scales (one `vcvtph2ps`) times the activation block's scale.

use super::{ahead_at, KXBlock, XBlock, P};
use crate::stream::Ahead;
use kiln_core::quant::{BlockQ8K, BlockQ8_0};
use std::arch::x86_64::*;

/// Activation rows per register tile of the prompt kernel: with one half panel, 4 i16
/// sums, 4 f32 sums, the unpacked weights and broadcasts fit AVX2's 16 registers.
const C: usize = 4;

/// Activation rows per register tile of the Q4_K prompt kernel: its sums take twice the
/// registers of Q4_0's (low and high nibbles sum apart).
const KC: usize = 2;

/// Lanes of `H` half panels (starting at half `h0`) times `C` activation rows (each `nb`
/// blocks of `x`, with their [`XBlock`]s): `out[i][h]` lane `r` is row `8(h0 + h) + r`
/// of `panel` · activation row `i`. Each chunk's line is requested `ahead.distance`
/// bytes on (scales at an eighth of that), inside what `ahead` lets the task read.
///
/// # Safety
/// AVX2, FMA and F16C must be available.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_0_tile<const C: usize, const H: usize>(
    panel: &[u8],
    nb: usize,
    h0: usize,
    x: [&[BlockQ8_0]; C],
    xb: [&[XBlock]; C],
    ahead: Ahead,
) -> [[[f32; 8]; H]; C] {
    assert!(panel.len() >= 288 * nb && h0 + H <= 2);
    assert!((0..C).all(|i| x[i].len() >= nb && xb[i].len() >= nb));
    // SAFETY: the features are enabled on this function; every pointer below addresses
    // bytes of `panel` (scales below 32·nb, quants below 288·nb, asserted) or of the
    // asserted activation blocks (a 4-byte read at 4c or 16 + 4c inside a 32-byte `qs`).
    unsafe {
        let base = panel.as_ptr();
        let low = _mm256_set1_epi8(0x0F);
        let ones = _mm256_set1_epi16(1);
        let mut acc = [[_mm256_setzero_ps(); H]; C];
        for b in 0..nb {
            let q = base.add(32 * nb + 256 * b + 32 * h0);
            let mut s16 = [[_mm256_setzero_si256(); H]; C];
            for c in 0..4 {
                let pos = 256 * b + 32 * h0 + 64 * c + ahead.distance;
                ahead.fetch(base, ahead_at(32 * nb, 256 * nb, 288 * nb, pos));
                let mut lo = [_mm256_setzero_si256(); H];
                let mut hi = [_mm256_setzero_si256(); H];
                for h in 0..H {
                    let v = _mm256_loadu_si256(q.add(64 * c + 32 * h) as *const __m256i);
                    lo[h] = _mm256_and_si256(v, low);
                    hi[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                }
                for i in 0..C {
                    let qs = x[i].get_unchecked(b).qs.as_ptr();
                    let xl = _mm256_set1_epi32((qs.add(4 * c) as *const i32).read_unaligned());
                    let xh = _mm256_set1_epi32((qs.add(16 + 4 * c) as *const i32).read_unaligned());
                    for h in 0..H {
                        let s = _mm256_add_epi16(s16[i][h], _mm256_maddubs_epi16(lo[h], xl));
                        s16[i][h] = _mm256_add_epi16(s, _mm256_maddubs_epi16(hi[h], xh));
                    }
                }
            }
            if b % 2 == 0 {
                let pos = 32 * b + ahead.distance / 8;
                ahead.fetch(base, ahead_at(0, 32 * nb, 288 * nb, pos));
            }
            let dw: [__m256; H] = std::array::from_fn(|h| {
                _mm256_cvtph_ps(_mm_loadu_si128(base.add(32 * b + 16 * (h0 + h)) as *const _))
            });
            for i in 0..C {
                let xbi = xb[i].get_unchecked(b);
                let (d, corr) = (_mm256_set1_ps(xbi.d), _mm256_set1_epi32(xbi.corr));
                for h in 0..H {
                    let s32 = _mm256_add_epi32(_mm256_madd_epi16(s16[i][h], ones), corr);
                    let scale = _mm256_mul_ps(dw[h], d);
                    acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), scale, acc[i][h]);
                }
            }
        }
        acc.map(|row| {
            row.map(|v| {
                let mut o = [0f32; 8];
                _mm256_storeu_ps(o.as_mut_ptr(), v);
                o
            })
        })
    }
}

/// Decode: panel · x for one activation row (`nb` blocks), both halves in one pass so
/// that each broadcast serves 16 rows, prefetching ahead of the stream.
///
/// # Safety
/// AVX2, FMA and F16C must be available.
pub(super) unsafe fn q4_0_panel(
    panel: &[u8],
    nb: usize,
    x: &[BlockQ8_0],
    xb: &[XBlock],
    ahead: Ahead,
) -> [f32; P] {
    // SAFETY: the caller's guarantee is all the kernel needs.
    let [[a, b]] = unsafe { q4_0_tile::<1, 2>(panel, nb, 0, [x], [xb], ahead) };
    std::array::from_fn(|r| if r < 8 { a[r] } else { b[r - 8] })
}

/// Prompts: `o[i]` = panel · activation row `i` for the `o.len()` rows of `x` (`nb`
/// blocks each), [`C`] activation rows per tile against each half panel while it is in
/// L1.
///
/// # Safety
/// AVX2, FMA and F16C must be available.
pub(super) unsafe fn q4_0_rows(
    panel: &[u8],
    nb: usize,
    x: &[BlockQ8_0],
    xb: &[XBlock],
    o: &mut [[f32; P]],
) {
    let n = o.len();
    for h in 0..2 {
        for i0 in (0..n).step_by(C) {
            // A ragged last tile repeats its last row; the repeats are not stored.
            let rows: [usize; C] = std::array::from_fn(|j| (i0 + j).min(n - 1));
            // SAFETY: the caller's guarantee is all the kernel needs.
            let sums = unsafe {
                q4_0_tile::<C, 1>(
                    panel,
                    nb,
                    h,
                    rows.map(|i| &x[i * nb..][..nb]),
                    rows.map(|i| &xb[i * nb..][..nb]),
                    Ahead::NONE,
                )
            };
            for (j, s) in sums.iter().enumerate().take(n - i0) {
                o[i0 + j][8 * h..][..8].copy_from_slice(&s[0]);
            }
        }
    }
}

/// `pshufb` indices that put byte `k` of each 32-bit lane into both of its 16-bit halves,
/// zero-extended: a row's scale of one sub-block, ready for `vpmaddwd` with the sub-block's
/// two i16 partial sums.
const fn scale_pairs(k: usize) -> [u8; 32] {
    let mut p = [0x80u8; 32];
    let mut i = 0;
    while i < 8 {
        p[4 * i] = (4 * (i % 4) + k) as u8;
        p[4 * i + 2] = (4 * (i % 4) + k) as u8;
        i += 1;
    }
    p
}

const SCALE_PAIRS: [[u8; 32]; 4] = [
    scale_pairs(0),
    scale_pairs(1),
    scale_pairs(2),
    scale_pairs(3),
];

/// Q4_K: lanes of `H` half panels (from half `h0`) times `C` activation rows (each `nb`
/// super-blocks of `x`, with their [`KXBlock`]s), as [`q4_0_tile`]. Per super-block and
/// half panel the 8 rows' packed scales and mins are unpacked in registers (sub-block `s`
/// of every lane: byte `s % 4` of `sc[s / 4]`); per group `j` of 64 elements the 8 chunks'
/// low nibbles (sub-block `2j`) and high nibbles (`2j + 1`) each sum in i16 (at most
/// 30,720, as in Q4_0), then meet their scales in one `vpmaddwd` each.
///
/// # Safety
/// AVX2, FMA and F16C must be available.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_k_tile<const C: usize, const H: usize>(
    panel: &[u8],
    nb: usize,
    h0: usize,
    x: [&[BlockQ8K]; C],
    xb: [&[KXBlock]; C],
    ahead: Ahead,
) -> [[[f32; 8]; H]; C] {
    assert!(panel.len() >= 2304 * nb && h0 + H <= 2);
    assert!((0..C).all(|i| x[i].len() >= nb && xb[i].len() >= nb));
    // SAFETY: the features are enabled on this function; every pointer below addresses
    // bytes of `panel` (headers below 256·nb, quants below 2304·nb, asserted) or of the
    // asserted activation blocks (4-byte reads inside a 256-byte `qs`).
    unsafe {
        let base = panel.as_ptr();
        let low = _mm256_set1_epi8(0x0F);
        let six = _mm256_set1_epi8(0x3F);
        let top = _mm256_set1_epi8(0x30);
        let even = _mm256_set1_epi16(0x00FF);
        let pairs: [__m256i; 4] =
            std::array::from_fn(|k| _mm256_loadu_si256(SCALE_PAIRS[k].as_ptr() as *const _));
        let mut acc = [[_mm256_setzero_ps(); H]; C];
        for b in 0..nb {
            let hdr = base.add(256 * b);
            let q = base.add(256 * nb + 2048 * b + 32 * h0);
            // Per half: sc[0] bytes = scales of sub-blocks 0..4, sc[1] of 4..8; mn alike.
            let words = |h: usize, w: usize| {
                _mm256_loadu_si256(hdr.add(64 + 64 * w + 32 * (h0 + h)) as *const __m256i)
            };
            let sc: [[__m256i; 2]; H] = std::array::from_fn(|h| {
                let (w0, w2) = (words(h, 0), words(h, 2));
                [
                    _mm256_and_si256(w0, six),
                    _mm256_or_si256(
                        _mm256_and_si256(w2, low),
                        _mm256_and_si256(_mm256_srli_epi32(w0, 2), top),
                    ),
                ]
            });
            let mut isum = [[_mm256_setzero_si256(); H]; C];
            for j in 0..4 {
                // The next super-block's headers, a line per group.
                ahead.fetch(
                    base,
                    ahead_at(0, 256 * nb, 2304 * nb, 256 * (b + 1) + 64 * j),
                );
                let mut s16 = [[[_mm256_setzero_si256(); 2]; H]; C];
                for t in 0..8 {
                    let c = 8 * j + t;
                    let pos = 2048 * b + 32 * h0 + 64 * c + ahead.distance;
                    ahead.fetch(base, ahead_at(256 * nb, 2048 * nb, 2304 * nb, pos));
                    let mut lo = [_mm256_setzero_si256(); H];
                    let mut hi = [_mm256_setzero_si256(); H];
                    for h in 0..H {
                        let v = _mm256_loadu_si256(q.add(64 * c + 32 * h) as *const __m256i);
                        lo[h] = _mm256_and_si256(v, low);
                        hi[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                    }
                    for i in 0..C {
                        let qs = x[i].get_unchecked(b).qs.as_ptr().add(64 * j + 4 * t);
                        let xl = _mm256_set1_epi32((qs as *const i32).read_unaligned());
                        let xh = _mm256_set1_epi32((qs.add(32) as *const i32).read_unaligned());
                        for h in 0..H {
                            let [sl, sh] = &mut s16[i][h];
                            *sl = _mm256_add_epi16(*sl, _mm256_maddubs_epi16(lo[h], xl));
                            *sh = _mm256_add_epi16(*sh, _mm256_maddubs_epi16(hi[h], xh));
                        }
                    }
                }
                for h in 0..H {
                    // Sub-blocks 2j and 2j + 1: bytes (2j) % 4 and (2j + 1) % 4 of sc[j / 2].
                    let s = sc[h][j / 2];
                    let sl = _mm256_shuffle_epi8(s, pairs[(2 * j) % 4]);
                    let sh = _mm256_shuffle_epi8(s, pairs[(2 * j + 1) % 4]);
                    for i in 0..C {
                        let [a, b] = s16[i][h];
                        let both =
                            _mm256_add_epi32(_mm256_madd_epi16(a, sl), _mm256_madd_epi16(b, sh));
                        isum[i][h] = _mm256_add_epi32(isum[i][h], both);
                    }
                }
            }
            for h in 0..H {
                // Mins as i16 pairs per lane: sub-blocks (0, 2), (1, 3), (4, 6), (5, 7).
                let (w1, w2) = (words(h, 1), words(h, 2));
                let m03 = _mm256_and_si256(w1, six);
                let m47 = _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi32(w2, 4), low),
                    _mm256_and_si256(_mm256_srli_epi32(w1, 2), top),
                );
                let m = [
                    _mm256_and_si256(m03, even),
                    _mm256_srli_epi16(m03, 8),
                    _mm256_and_si256(m47, even),
                    _mm256_srli_epi16(m47, 8),
                ];
                let dw = _mm256_cvtph_ps(_mm_loadu_si128(hdr.add(16 * (h0 + h)) as *const _));
                let dm = _mm256_cvtph_ps(_mm_loadu_si128(hdr.add(32 + 16 * (h0 + h)) as *const _));
                for i in 0..C {
                    let xbi = xb[i].get_unchecked(b);
                    let mut msum = _mm256_setzero_si256();
                    for (mk, &s) in m.iter().zip(&xbi.sums) {
                        msum = _mm256_add_epi32(msum, _mm256_madd_epi16(*mk, _mm256_set1_epi32(s)));
                    }
                    let d = _mm256_set1_ps(xbi.d);
                    let a = _mm256_fmadd_ps(
                        _mm256_cvtepi32_ps(isum[i][h]),
                        _mm256_mul_ps(dw, d),
                        acc[i][h],
                    );
                    acc[i][h] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(dm, d), a);
                }
            }
        }
        acc.map(|row| {
            row.map(|v| {
                let mut o = [0f32; 8];
                _mm256_storeu_ps(o.as_mut_ptr(), v);
                o
            })
        })
    }
}

/// Q4_K decode: as [`q4_0_panel`].
///
/// # Safety
/// AVX2, FMA and F16C must be available.
pub(super) unsafe fn q4_k_panel(
    panel: &[u8],
    nb: usize,
    x: &[BlockQ8K],
    xb: &[KXBlock],
    ahead: Ahead,
) -> [f32; P] {
    // SAFETY: the caller's guarantee is all the kernel needs.
    let [[a, b]] = unsafe { q4_k_tile::<1, 2>(panel, nb, 0, [x], [xb], ahead) };
    std::array::from_fn(|r| if r < 8 { a[r] } else { b[r - 8] })
}

/// Q4_K prompts: as [`q4_0_rows`], [`KC`] activation rows per tile.
///
/// # Safety
/// AVX2, FMA and F16C must be available.
pub(super) unsafe fn q4_k_rows(
    panel: &[u8],
    nb: usize,
    x: &[BlockQ8K],
    xb: &[KXBlock],
    o: &mut [[f32; P]],
) {
    let n = o.len();
    for h in 0..2 {
        for i0 in (0..n).step_by(KC) {
            let rows: [usize; KC] = std::array::from_fn(|j| (i0 + j).min(n - 1));
            // SAFETY: the caller's guarantee is all the kernel needs.
            let sums = unsafe {
                q4_k_tile::<KC, 1>(
                    panel,
                    nb,
                    h,
                    rows.map(|i| &x[i * nb..][..nb]),
                    rows.map(|i| &xb[i * nb..][..nb]),
                    Ahead::NONE,
                )
            };
            for (j, s) in sums.iter().enumerate().take(n - i0) {
                o[i0 + j][8 * h..][..8].copy_from_slice(&s[0]);
            }
        }
    }
}
