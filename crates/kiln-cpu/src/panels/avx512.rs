//! Panel kernels on AVX-512 VNNI: a 512-bit register holds a whole panel's 16 lanes.
//!
//! Per block and chunk `c` of 4 quants, one 64-byte load brings those 4 quants of the 16
//! rows; the low and high nibbles go through one `vpdpbusd` each against the activation's
//! matching 4 quants broadcast to every lane (unsigned nibble × signed quant, 4 products
//! summed into i32), the sum starting from the offset correction. Per block that is 4
//! loads, 12 unpacking steps and 8 `vpdpbusd` for 16 rows, one `vcvtph2ps` for their
//! scales, and one FMA: no gathers, no permutes, no horizontal sums. Prompts reuse each
//! unpacked chunk for a register tile of [`C`] activation rows.

use super::{ahead_at, KXBlock, XBlock, P};
use crate::stream::Ahead;
use kiln_core::quant::{BlockQ8K, BlockQ8_0};
use std::arch::x86_64::*;

/// Activation rows per register tile of the prompt kernel: 8 i32 and 8 f32 sums.
const C: usize = 8;

/// The panel's 16 rows times `C` activation rows (each `nb` blocks of `x`, with their
/// [`XBlock`]s): lane `r` of `out[i]` is row `r` · activation row `i`. Each chunk's line
/// is requested `ahead.distance` bytes on (scales at an eighth of that: they stream at an
/// eighth of the quants' rate), inside what `ahead` lets the task read.
///
/// # Safety
/// AVX-512 F, BW, VL and VNNI, AVX2, FMA and F16C must be available.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q4_0_tile<const C: usize>(
    panel: &[u8],
    nb: usize,
    x: [&[BlockQ8_0]; C],
    xb: [&[XBlock]; C],
    ahead: Ahead,
) -> [[f32; P]; C] {
    assert!(panel.len() >= 288 * nb);
    assert!((0..C).all(|i| x[i].len() >= nb && xb[i].len() >= nb));
    // SAFETY: the features are enabled on this function; every pointer below addresses
    // bytes of `panel` (scales below 32·nb, quants below 288·nb, asserted) or of the
    // asserted activation blocks (a 4-byte read at 4c or 16 + 4c inside a 32-byte `qs`).
    unsafe {
        let base = panel.as_ptr();
        let low = _mm512_set1_epi8(0x0F);
        let mut acc = [_mm512_setzero_ps(); C];
        for b in 0..nb {
            let q = base.add(32 * nb + 256 * b);
            // Low and high nibbles in separate sums: two dependency chains of 4.
            let mut lo_sum: [__m512i; C] =
                std::array::from_fn(|i| _mm512_set1_epi32(xb[i].get_unchecked(b).corr));
            let mut hi_sum = [_mm512_setzero_si512(); C];
            for c in 0..4 {
                let pos = 256 * b + 64 * c + ahead.distance;
                ahead.fetch(base, ahead_at(32 * nb, 256 * nb, 288 * nb, pos));
                let v = _mm512_loadu_si512(q.add(64 * c) as *const _);
                let lo = _mm512_and_si512(v, low);
                let hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                for i in 0..C {
                    let qs = x[i].get_unchecked(b).qs.as_ptr();
                    let xl = _mm512_set1_epi32((qs.add(4 * c) as *const i32).read_unaligned());
                    let xh = _mm512_set1_epi32((qs.add(16 + 4 * c) as *const i32).read_unaligned());
                    lo_sum[i] = _mm512_dpbusd_epi32(lo_sum[i], lo, xl);
                    hi_sum[i] = _mm512_dpbusd_epi32(hi_sum[i], hi, xh);
                }
            }
            if b % 2 == 0 {
                let pos = 32 * b + ahead.distance / 8;
                ahead.fetch(base, ahead_at(0, 32 * nb, 288 * nb, pos));
            }
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(base.add(32 * b) as *const __m256i));
            for i in 0..C {
                let s = _mm512_cvtepi32_ps(_mm512_add_epi32(lo_sum[i], hi_sum[i]));
                let d = _mm512_set1_ps(xb[i].get_unchecked(b).d);
                acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(s, dw), d, acc[i]);
            }
        }
        acc.map(|v| {
            let mut o = [0f32; P];
            _mm512_storeu_ps(o.as_mut_ptr(), v);
            o
        })
    }
}

/// Decode: panel · x for one activation row (`nb` blocks), prefetching ahead of the
/// stream as `ahead` says.
///
/// # Safety
/// AVX-512 F, BW, VL and VNNI, AVX2, FMA and F16C must be available.
pub(super) unsafe fn q4_0_panel(
    panel: &[u8],
    nb: usize,
    x: &[BlockQ8_0],
    xb: &[XBlock],
    ahead: Ahead,
) -> [f32; P] {
    // SAFETY: the caller's guarantee is all the kernel needs.
    unsafe { q4_0_tile::<1>(panel, nb, [x], [xb], ahead)[0] }
}

/// Prompts: `o[i]` = panel · activation row `i` for the `o.len()` rows of `x` (`nb`
/// blocks each), in register tiles of [`C`] activation rows.
///
/// # Safety
/// AVX-512 F, BW, VL and VNNI, AVX2, FMA and F16C must be available.
pub(super) unsafe fn q4_0_rows(
    panel: &[u8],
    nb: usize,
    x: &[BlockQ8_0],
    xb: &[XBlock],
    o: &mut [[f32; P]],
) {
    let n = o.len();
    for i0 in (0..n).step_by(C) {
        // A ragged last tile repeats its last row; the repeats are not stored.
        let rows: [usize; C] = std::array::from_fn(|j| (i0 + j).min(n - 1));
        // SAFETY: the caller's guarantee is all the kernel needs.
        let sums = unsafe {
            q4_0_tile::<C>(
                panel,
                nb,
                rows.map(|i| &x[i * nb..][..nb]),
                rows.map(|i| &xb[i * nb..][..nb]),
                Ahead::NONE,
            )
        };
        o[i0..].iter_mut().zip(sums).for_each(|(o, s)| *o = s);
    }
}

/// `pshufb` indices that zero-extend byte `k` of each 32-bit lane to the whole lane: a
/// row's scale of one sub-block, for `vpmulld` with the sub-block's i32 sum.
const fn lane_byte(k: usize) -> [u8; 64] {
    let mut p = [0x80u8; 64];
    let mut i = 0;
    while i < 16 {
        p[4 * i] = (4 * (i % 4) + k) as u8;
        i += 1;
    }
    p
}

const LANE_BYTES: [[u8; 64]; 4] = [lane_byte(0), lane_byte(1), lane_byte(2), lane_byte(3)];

/// Q4_K decode: the panel's 16 rows · one activation row (`nb` super-blocks of `x`, with
/// their [`KXBlock`]s), prefetching ahead of the stream. Per super-block the 16 rows'
/// packed scales and mins are unpacked in registers (sub-block `s` of every lane: byte
/// `s % 4` of `sc[s / 4]`); per group `j` of 64 elements, the 8 chunks' low nibbles
/// (sub-block `2j`) and high nibbles (`2j + 1`) sum through `vpdpbusd` apart, and each sum
/// is multiplied by its lane's scale in i32 (at most 63 · 61,440 a sub-block).
///
/// # Safety
/// AVX-512 F, BW, VL and VNNI, AVX2, FMA and F16C must be available.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn q4_k_panel(
    panel: &[u8],
    nb: usize,
    x: &[BlockQ8K],
    xb: &[KXBlock],
    ahead: Ahead,
) -> [f32; P] {
    assert!(panel.len() >= 2304 * nb && x.len() >= nb && xb.len() >= nb);
    // SAFETY: the features are enabled on this function; every pointer below addresses
    // bytes of `panel` (headers below 256·nb, quants below 2304·nb, asserted) or of the
    // asserted activation blocks (4-byte reads inside a 256-byte `qs`).
    unsafe {
        let base = panel.as_ptr();
        let low = _mm512_set1_epi8(0x0F);
        let six = _mm512_set1_epi8(0x3F);
        let top = _mm512_set1_epi8(0x30);
        let even = _mm512_set1_epi16(0x00FF);
        let bytes: [__m512i; 4] =
            std::array::from_fn(|k| _mm512_loadu_si512(LANE_BYTES[k].as_ptr() as *const _));
        let mut acc = _mm512_setzero_ps();
        for b in 0..nb {
            let hdr = base.add(256 * b);
            let q = base.add(256 * nb + 2048 * b);
            let xq = x.get_unchecked(b).qs.as_ptr();
            let words = |w: usize| _mm512_loadu_si512(hdr.add(64 + 64 * w) as *const _);
            let (w0, w1, w2) = (words(0), words(1), words(2));
            // Scales of sub-blocks 0..4 and 4..8, a byte each per lane.
            let sc = [
                _mm512_and_si512(w0, six),
                _mm512_or_si512(
                    _mm512_and_si512(w2, low),
                    _mm512_and_si512(_mm512_srli_epi32(w0, 2), top),
                ),
            ];
            let mut isum = _mm512_setzero_si512();
            for j in 0..4 {
                ahead.fetch(
                    base,
                    ahead_at(0, 256 * nb, 2304 * nb, 256 * (b + 1) + 64 * j),
                );
                let (mut lo_sum, mut hi_sum) = (_mm512_setzero_si512(), _mm512_setzero_si512());
                for t in 0..8 {
                    let c = 8 * j + t;
                    let pos = 2048 * b + 64 * c + ahead.distance;
                    ahead.fetch(base, ahead_at(256 * nb, 2048 * nb, 2304 * nb, pos));
                    let v = _mm512_loadu_si512(q.add(64 * c) as *const _);
                    let lo = _mm512_and_si512(v, low);
                    let hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                    let xs = xq.add(64 * j + 4 * t);
                    let xl = _mm512_set1_epi32((xs as *const i32).read_unaligned());
                    let xh = _mm512_set1_epi32((xs.add(32) as *const i32).read_unaligned());
                    lo_sum = _mm512_dpbusd_epi32(lo_sum, lo, xl);
                    hi_sum = _mm512_dpbusd_epi32(hi_sum, hi, xh);
                }
                let s = sc[j / 2];
                let sl = _mm512_shuffle_epi8(s, bytes[(2 * j) % 4]);
                let sh = _mm512_shuffle_epi8(s, bytes[(2 * j + 1) % 4]);
                isum = _mm512_add_epi32(isum, _mm512_mullo_epi32(lo_sum, sl));
                isum = _mm512_add_epi32(isum, _mm512_mullo_epi32(hi_sum, sh));
            }
            // Mins as i16 pairs per lane: sub-blocks (0, 2), (1, 3), (4, 6), (5, 7).
            let m03 = _mm512_and_si512(w1, six);
            let m47 = _mm512_or_si512(
                _mm512_and_si512(_mm512_srli_epi32(w2, 4), low),
                _mm512_and_si512(_mm512_srli_epi32(w1, 2), top),
            );
            let m = [
                _mm512_and_si512(m03, even),
                _mm512_srli_epi16(m03, 8),
                _mm512_and_si512(m47, even),
                _mm512_srli_epi16(m47, 8),
            ];
            let xbb = xb.get_unchecked(b);
            let mut msum = _mm512_setzero_si512();
            for (mk, &s) in m.iter().zip(&xbb.sums) {
                msum = _mm512_add_epi32(msum, _mm512_madd_epi16(*mk, _mm512_set1_epi32(s)));
            }
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(hdr as *const __m256i));
            let dm = _mm512_cvtph_ps(_mm256_loadu_si256(hdr.add(32) as *const __m256i));
            let d = _mm512_set1_ps(xbb.d);
            let a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dw, d), acc);
            acc = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(msum), _mm512_mul_ps(dm, d), a);
        }
        let mut o = [0f32; P];
        _mm512_storeu_ps(o.as_mut_ptr(), acc);
        o
    }
}
