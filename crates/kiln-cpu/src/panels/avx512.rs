//! Panel kernels on AVX-512 VNNI: a 512-bit register holds a whole panel's 16 lanes.
//!
//! Per block and chunk `c` of 4 quants, one 64-byte load brings those 4 quants of the 16
//! rows; the low and high nibbles go through one `vpdpbusd` each against the activation's
//! matching 4 quants broadcast to every lane (unsigned nibble × signed quant, 4 products
//! summed into i32), the sum starting from the offset correction. Per block that is 4
//! loads, 12 unpacking steps and 8 `vpdpbusd` for 16 rows, one `vcvtph2ps` for their
//! scales, and one FMA: no gathers, no permutes, no horizontal sums. Prompts reuse each
//! unpacked chunk for a register tile of [`C`] activation rows.

use super::{XBlock, P};
use crate::gemv::prefetch;
use kiln_core::quant::BlockQ8_0;
use std::arch::x86_64::*;

/// Activation rows per register tile of the prompt kernel: 8 i32 and 8 f32 sums.
const C: usize = 8;

/// How far ahead of the loads decode's prefetches run, in bytes of the panel stream.
const AHEAD: usize = 1024;

/// The panel's 16 rows times `C` activation rows (each `nb` blocks of `x`, with their
/// [`XBlock`]s): lane `r` of `out[i]` is row `r` · activation row `i`. With `PREFETCH`,
/// each chunk's line is requested [`AHEAD`] bytes on.
///
/// # Safety
/// AVX-512 F, BW, VL and VNNI, AVX2, FMA and F16C must be available.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q4_0_tile<const C: usize, const PREFETCH: bool>(
    panel: &[u8],
    nb: usize,
    x: [&[BlockQ8_0]; C],
    xb: [&[XBlock]; C],
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
                if PREFETCH {
                    prefetch(q.wrapping_add(64 * c + AHEAD));
                }
                let v = _mm512_loadu_si512(q.add(64 * c) as *const _);
                let lo = _mm512_and_si512(v, low);
                let hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                for i in 0..C {
                    let qs = x[i].get_unchecked(b).qs.as_ptr();
                    let xl = _mm512_set1_epi32((qs.add(4 * c) as *const i32).read_unaligned());
                    let xh =
                        _mm512_set1_epi32((qs.add(16 + 4 * c) as *const i32).read_unaligned());
                    lo_sum[i] = _mm512_dpbusd_epi32(lo_sum[i], lo, xl);
                    hi_sum[i] = _mm512_dpbusd_epi32(hi_sum[i], hi, xh);
                }
            }
            if PREFETCH && b % 2 == 0 {
                prefetch(base.add(32 * b).wrapping_add(AHEAD / 8));
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
/// stream.
///
/// # Safety
/// AVX-512 F, BW, VL and VNNI, AVX2, FMA and F16C must be available.
pub(super) unsafe fn q4_0_panel(panel: &[u8], nb: usize, x: &[BlockQ8_0], xb: &[XBlock]) -> [f32; P] {
    // SAFETY: the caller's guarantee is all the kernel needs.
    unsafe { q4_0_tile::<1, true>(panel, nb, [x], [xb])[0] }
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
            q4_0_tile::<C, false>(
                panel,
                nb,
                rows.map(|i| &x[i * nb..][..nb]),
                rows.map(|i| &xb[i * nb..][..nb]),
            )
        };
        o[i0..].iter_mut().zip(sums).for_each(|(o, s)| *o = s);
    }
}
