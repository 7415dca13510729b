//! Q4_K and Q6_K weights against one Q8_K activation row.
//!
//! The arithmetic is that of the per-row kernels in [`crate::dot`] (unsigned quants
//! through `maddubs`, sub-block scales through `dpwssd`, the offsets moved out of the loop
//! with the activation's sums), with the activation's 256-quant blocks loaded once per
//! group of rows. For Q4_K the activation quants are also reordered once per call
//! ([`PreparedQ4K`]) to match how the weight nibbles fall out of one 64-byte load: the low
//! nibbles of `qs[64h..64h + 64]` are sub-blocks `4h` and `4h + 2`, the high nibbles
//! `4h + 1` and `4h + 3`, so two `and`s and a shift unpack 128 quants.

use super::{available, avx2, by_groups, ROWS};
use crate::pool::Pool;
use crate::stream::Plan;
use kiln_core::quant::{BlockQ4K, BlockQ6K, BlockQ8K, QK_K};

/// One Q8_K block laid out for the Q4_K kernel.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct PreparedQ4K {
    /// Sub-blocks (32 quants each) in the order 0, 2, 1, 3, 4, 6, 5, 7.
    q: [i8; QK_K],
    /// Σ of each 32-quant sub-block, in element order (for the mins).
    sums: [i16; 8],
    d: f32,
}

fn prepare_q4k(x: &[BlockQ8K]) -> Vec<PreparedQ4K> {
    const ORDER: [usize; 8] = [0, 2, 1, 3, 4, 6, 5, 7];
    x.iter()
        .map(|b| {
            let mut p = PreparedQ4K {
                q: [0; QK_K],
                sums: [0; 8],
                d: b.d,
            };
            for (dst, &src) in p.q.chunks_exact_mut(32).zip(&ORDER) {
                dst.copy_from_slice(&b.qs[32 * src..][..32]);
            }
            for (j, s) in p.sums.iter_mut().enumerate() {
                *s = b.bsums[2 * j] + b.bsums[2 * j + 1];
            }
            p
        })
        .collect()
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use crate::dot::k_quants::unpack_q4k_scales;
    use crate::dot::k_quants::x86::{f16x2_times, q6k_block, q6k_scale_index};
    use crate::stream::prefetch;
    use std::arch::x86_64::*;

    /// Prefetch every cache line of the block at `p`, [`ROWS`] rows on (`row_len` blocks
    /// per row). A line that straddles into the next block is asked for by that block.
    #[inline(always)]
    fn prefetch_ahead<T>(p: *const T, row_len: usize) {
        let ahead = p.wrapping_add(ROWS * row_len) as *const u8;
        for off in (0..std::mem::size_of::<T>()).step_by(64) {
            prefetch(ahead.wrapping_add(off));
        }
    }

    /// i16 lanes 0..16 take scale `a`, lanes 16..32 scale `b`.
    #[inline(always)]
    unsafe fn halves(a: i16, b: i16) -> __m512i {
        // SAFETY: the caller enabled AVX-512 F.
        unsafe {
            _mm512_set_epi16(
                b, b, b, b, b, b, b, b, b, b, b, b, b, b, b, b, a, a, a, a, a, a, a, a, a, a, a, a,
                a, a, a, a,
            )
        }
    }

    /// `w[r] · x` for ROWS Q4_K rows of `x.len()` blocks.
    ///
    /// # Safety
    /// AVX-512 F, BW, VL and VNNI, AVX2, FMA and F16C must be available.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn rows_q4k(w: [&[BlockQ4K]; ROWS], x: &[PreparedQ4K]) -> [f32; ROWS] {
        assert!(w.iter().all(|r| r.len() == x.len()));
        // SAFETY: the features are enabled on this function; block indices are < x.len()
        // = every row's length (asserted); loads read inside block fields of their size.
        unsafe {
            let m4 = _mm512_set1_epi8(0x0F);
            // Scale of each maddubs lane: for the low nibbles of half h sub-blocks 4h and
            // 4h + 2, for the high nibbles 4h + 1 and 4h + 3.
            let idx = [halves(0, 2), halves(1, 3), halves(4, 6), halves(5, 7)];
            let mut acc = [_mm512_setzero_ps(); ROWS];
            let mut acc_m = [_mm_setzero_ps(); ROWS];
            for (b, xb) in x.iter().enumerate() {
                let y: [__m512i; 4] = std::array::from_fn(|i| {
                    _mm512_load_si512(xb.q.as_ptr().add(64 * i) as *const _)
                });
                let sums = _mm_load_si128(xb.sums.as_ptr() as *const __m128i);
                for (r, row) in w.iter().enumerate() {
                    let blk = row.get_unchecked(b);
                    prefetch_ahead(blk, row.len());
                    let (d, dmin) = f16x2_times(blk.d.to_bits(), blk.dmin.to_bits(), xb.d);
                    let sm = unpack_q4k_scales(&blk.scales);
                    // Σ m_j · (sub-block sum j): the −dmin·m offset of every quant.
                    let mins = _mm_cvtepu8_epi16(_mm_loadl_epi64(sm.as_ptr().add(8) as *const _));
                    let prod = _mm_madd_epi16(mins, sums);
                    acc_m[r] = _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(prod), acc_m[r]);
                    let sc = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_loadl_epi64(
                        sm.as_ptr() as *const _,
                    )));
                    let mut sumi = _mm512_setzero_si512();
                    for h in 0..2 {
                        let v = _mm512_loadu_si512(blk.qs.as_ptr().add(64 * h) as *const _);
                        let lo = _mm512_and_si512(v, m4);
                        let hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                        // ≤ 15·127·2 per i16: no saturation.
                        let plo = _mm512_maddubs_epi16(lo, y[2 * h]);
                        let phi = _mm512_maddubs_epi16(hi, y[2 * h + 1]);
                        let slo = _mm512_permutexvar_epi16(idx[2 * h], sc);
                        let shi = _mm512_permutexvar_epi16(idx[2 * h + 1], sc);
                        sumi = _mm512_dpwssd_epi32(sumi, plo, slo);
                        sumi = _mm512_dpwssd_epi32(sumi, phi, shi);
                    }
                    acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(sumi), acc[r]);
                }
            }
            std::array::from_fn(|r| {
                let m = _mm_add_ps(acc_m[r], _mm_movehl_ps(acc_m[r], acc_m[r]));
                let m = _mm_add_ss(m, _mm_movehdup_ps(m));
                _mm512_reduce_add_ps(acc[r]) - _mm_cvtss_f32(m)
            })
        }
    }

    /// `w[r] · x` for ROWS Q6_K rows of `x.len()` blocks.
    ///
    /// # Safety
    /// AVX-512 F, BW, VL and VNNI, AVX2, FMA and F16C must be available.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn rows_q6k<const R: usize>(w: [&[BlockQ6K]; R], x: &[BlockQ8K]) -> [f32; R] {
        assert!(w.iter().all(|r| r.len() == x.len()));
        let distance = crate::stream::ahead(crate::stream::Stream::Q6K);
        // SAFETY: as in `rows_q4k`.
        unsafe {
            let idx = q6k_scale_index();
            let mut acc = [_mm512_setzero_ps(); R];
            for (b, xb) in x.iter().enumerate() {
                let y: [__m512i; 4] = std::array::from_fn(|i| {
                    _mm512_loadu_si512(xb.qs.as_ptr().add(64 * i) as *const _)
                });
                let bsums = _mm256_loadu_si256(xb.bsums.as_ptr() as *const __m256i);
                for (r, row) in w.iter().enumerate() {
                    let blk = row.get_unchecked(b);
                    if R > 1 {
                        prefetch_ahead(blk, row.len());
                    } else if distance > 0 {
                        let on = (blk as *const BlockQ6K as *const u8).wrapping_add(distance);
                        for off in (0..std::mem::size_of::<BlockQ6K>()).step_by(64) {
                            prefetch(on.wrapping_add(off));
                        }
                    }
                    let (d, _) = f16x2_times(blk.d.to_bits(), 0, xb.d);
                    let total = q6k_block(blk, &y, bsums, &idx);
                    acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(total), acc[r]);
                }
            }
            acc.map(|v| _mm512_reduce_add_ps(v))
        }
    }
}

/// `out[r] = w[r] · x` for Q4_K `w` of `m` rows of `x.len()` blocks. Requires
/// [`available()`].
pub(crate) fn matvec_q4k(pool: &Pool, w: &[BlockQ4K], x: &[BlockQ8K], out: &mut [f32], m: usize) {
    if crate::dot::isa() == crate::dot::Isa::Avx2 {
        return avx2::matmul_q4k(pool, w, x, out, 1, m);
    }
    assert!(available(), "matvec kernel needs AVX-512 VNNI");
    let nb = x.len();
    assert!(w.len() >= m * nb && out.len() >= m);
    let prepared = prepare_q4k(x);
    by_groups::<ROWS>(pool, out, m, |r| {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `available()` (asserted above) means AVX-512 F/BW/VL/VNNI, AVX2, FMA and
        // F16C were detected.
        return unsafe { x86::rows_q4k(r.map(|r| &w[r * nb..][..nb]), &prepared) };
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("checked by available()")
    });
}

/// `out[r] = w[r] · x` for Q6_K `w` of `m` rows of `x.len()` blocks. Requires
/// [`available()`].
pub(crate) fn matvec_q6k(pool: &Pool, w: &[BlockQ6K], x: &[BlockQ8K], out: &mut [f32], m: usize) {
    if crate::dot::isa() == crate::dot::Isa::Avx2 {
        return avx2::matmul_q6k(pool, w, x, out, 1, m);
    }
    if Plan::get().one_row {
        matvec_q6k_rows::<1>(pool, w, x, out, m)
    } else {
        matvec_q6k_rows::<ROWS>(pool, w, x, out, m)
    }
}

/// [`matvec_q6k`], `R` rows at a time: with one, a sequential stream prefetched
/// [`crate::stream::ahead`] bytes on, as Q8_0's (Q6_K's 6.6 bits a weight make it as
/// much memory's as compute's; measured one row at a time on a Zen 5, Q4_K_M decode,
/// whose FFN down projections are Q6_K in half the layers: 54.6-55.2 → 57.2-58.3 t/s).
/// Requires [`available()`].
pub(crate) fn matvec_q6k_rows<const R: usize>(
    pool: &Pool,
    w: &[BlockQ6K],
    x: &[BlockQ8K],
    out: &mut [f32],
    m: usize,
) {
    assert!(available(), "matvec kernel needs AVX-512 VNNI");
    let nb = x.len();
    assert!(w.len() >= m * nb && out.len() >= m);
    by_groups::<R>(pool, out, m, |r| {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `available()` (asserted above) means AVX-512 VNNI and its companions.
        return unsafe { x86::rows_q6k(r.map(|r| &w[r * nb..][..nb]), x) };
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("checked by available()")
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dot;
    use crate::dot::test_util::{ref_dot, test_pool};
    use crate::gemv::supported;
    use kiln_core::quant::{as_blocks, dequantize_to_vec, quantize, quantize_q8_k};
    use kiln_core::DType;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// Every row against the per-row kernel (same integer arithmetic, so nearly exact) and
    /// within the f64 reference's rounding bound.
    fn check<W: bytemuck::Pod>(
        dtype: DType,
        matvec: fn(&Pool, &[W], &[BlockQ8K], &mut [f32], usize),
        dot: fn(&[W], &[BlockQ8K]) -> f32,
    ) {
        let mut rng = StdRng::seed_from_u64(0x4b9);
        for &k in &[256usize, 512, 2048] {
            for &m in &[1usize, 3, 4, 130, 515] {
                let wv: Vec<f32> = (0..m * k).map(|_| rng.random_range(-2.0..2.0)).collect();
                let xv: Vec<f32> = (0..k).map(|_| rng.random_range(-1.0..1.0)).collect();
                let wbytes = quantize(dtype, &wv).unwrap();
                let w = as_blocks::<W>(&wbytes).unwrap().into_owned();
                let mut x = vec![bytemuck::Zeroable::zeroed(); k / QK_K];
                quantize_q8_k(&xv, &mut x).unwrap();
                let wf = dequantize_to_vec(dtype, &wbytes, m * k).unwrap();
                let xf: Vec<f32> = x
                    .iter()
                    .flat_map(|b: &BlockQ8K| b.qs.map(|q| q as f32 * b.d))
                    .collect();
                let mut out = vec![f32::NAN; m + 1];
                matvec(test_pool(), &w, &x, &mut out, m);
                assert!(out[m].is_nan(), "{dtype}: wrote past m");
                let nb = k / QK_K;
                for r in 0..m {
                    let want = dot(&w[r * nb..][..nb], &x);
                    let (exact, abs) = ref_dot(&wf[r * k..][..k], &xf);
                    let tol = 1e-5 * abs.max(want.abs() as f64) + 1e-30;
                    assert!(
                        ((out[r] - want).abs() as f64) <= tol,
                        "{dtype} k={k} m={m} row {r}: got {}, per-row kernel {want}",
                        out[r]
                    );
                    assert!(
                        (out[r] as f64 - exact).abs() <= tol,
                        "{dtype} k={k} m={m} row {r}: got {}, f64 reference {exact}",
                        out[r]
                    );
                }
            }
        }
    }

    #[test]
    fn matvec_matches_dot_q4_k() {
        if !supported() {
            eprintln!("no AVX2 or AVX-512 VNNI: matvec kernel not testable here");
            return;
        }
        check::<BlockQ4K>(DType::Q4_K, matvec_q4k, dot::dot_q4_k);
    }

    #[test]
    fn matvec_matches_dot_q6_k() {
        if !supported() {
            eprintln!("no AVX2 or AVX-512 VNNI: matvec kernel not testable here");
            return;
        }
        check::<BlockQ6K>(DType::Q6_K, matvec_q6k, dot::dot_q6_k);
    }

    /// Both row plans of Q6_K, whichever this CPU's vendor picks.
    #[test]
    fn q6_k_one_and_four_rows_match_dot() {
        if !available() {
            eprintln!("no AVX-512 VNNI: the AVX-512 matvec kernels are not testable here");
            return;
        }
        check::<BlockQ6K>(DType::Q6_K, matvec_q6k_rows::<1>, dot::dot_q6_k);
        check::<BlockQ6K>(DType::Q6_K, matvec_q6k_rows::<ROWS>, dot::dot_q6_k);
    }
}
