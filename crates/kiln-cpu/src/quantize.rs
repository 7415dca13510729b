//! Activation rows quantized for the integer dot products (Q8_0 for Q8_0/Q4_0 weights,
//! Q8_K for the K formats), rows over the thread pool.
//!
//! The results are bit for bit those of `kiln_core::quant` (ggml's reference rounding,
//! tested): the AVX-512 bodies only do the same arithmetic 16 lanes at a time. The
//! reference's scalar scan for the largest magnitude is branchy and made activation
//! quantization ~8% of a Q4_K_M prompt.

use crate::dot::{self, Isa};
use crate::pool::Pool;
use bytemuck::Zeroable;
use kiln_core::quant::{self, BlockQ8K, BlockQ8_0, QK, QK_K};
use kiln_core::{DType, Error, Result};
use std::sync::OnceLock;

/// Each row of `k` values (whole blocks: checked by the weight's shape) as Q8_0 blocks.
pub(crate) fn q8_0_rows(pool: &Pool, xs: &[f32], k: usize) -> Result<Vec<BlockQ8_0>> {
    #[cfg(target_arch = "x86_64")]
    let avx512 = Some(x86::q8_0 as unsafe fn(&[f32]) -> BlockQ8_0);
    #[cfg(not(target_arch = "x86_64"))]
    let avx512 = None;
    rows(pool, xs, k, QK, avx512, |x, b| {
        quant::quantize_into(DType::Q8_0, x, bytemuck::cast_slice_mut(b))
    })
}

/// Each row of `k` values (whole super-blocks: checked by the weight's shape) as Q8_K.
pub(crate) fn q8_k_rows(pool: &Pool, xs: &[f32], k: usize) -> Result<Vec<BlockQ8K>> {
    #[cfg(target_arch = "x86_64")]
    let avx512 = Some(x86::q8_k as unsafe fn(&[f32]) -> BlockQ8K);
    #[cfg(not(target_arch = "x86_64"))]
    let avx512 = None;
    rows(pool, xs, k, QK_K, avx512, quant::quantize_q8_k)
}

/// Rows of `k` values in blocks of `len`, over the pool: by `avx512` (one block per call)
/// where the CPU has it, else by `reference` (a whole row per call).
fn rows<B: bytemuck::Pod + Zeroable + Send>(
    pool: &Pool,
    xs: &[f32],
    k: usize,
    len: usize,
    avx512: Option<unsafe fn(&[f32]) -> B>,
    reference: impl Fn(&[f32], &mut [B]) -> Result<()> + Sync,
) -> Result<Vec<B>> {
    let mut blocks = vec![B::zeroed(); xs.len() / len];
    let avx512 = avx512.filter(|_| dot::isa() == Isa::Avx512Vnni);
    let failed = OnceLock::<Error>::new();
    pool.for_chunks_mut(&mut blocks, (k / len).max(1), |i, b| {
        let x = &xs[(i * k).min(xs.len())..((i + 1) * k).min(xs.len())];
        match avx512 {
            Some(block) => {
                for (x, b) in x.chunks_exact(len).zip(b) {
                    // SAFETY: the ISA was detected (see `dot::isa`).
                    *b = unsafe { block(x) };
                }
            }
            None => {
                if let Err(e) = reference(x, b) {
                    let _ = failed.set(e);
                }
            }
        }
    });
    match failed.into_inner() {
        Some(e) => Err(e),
        None => Ok(blocks),
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use half::f16;
    use std::arch::x86_64::*;

    /// ggml's `nearest_int` on 16 lanes: add 1.5·2^23 (rounds half to even) and read the
    /// low mantissa bits.
    #[inline(always)]
    unsafe fn nearest_int(v: __m512) -> __m512i {
        // SAFETY: the caller enabled AVX-512 F.
        unsafe {
            let x = _mm512_add_ps(v, _mm512_set1_ps(12_582_912.0));
            _mm512_sub_epi32(
                _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x007f_ffff)),
                _mm512_set1_epi32(0x0040_0000),
            )
        }
    }

    /// `quantize_row_q8_K_ref` for one block.
    ///
    /// # Safety
    /// AVX-512 F/BW/VL must be available.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    pub(super) unsafe fn q8_k(x: &[f32]) -> BlockQ8K {
        assert_eq!(x.len(), QK_K);
        // SAFETY: the features are enabled; every load reads 16 of the 256 values.
        unsafe {
            let v: [__m512; 16] = std::array::from_fn(|i| _mm512_loadu_ps(x.as_ptr().add(16 * i)));
            // `max_ps` returns its second operand when either is NaN: NaNs are skipped, as
            // in the reference's `>` scan.
            let amax = v.iter().fold(_mm512_setzero_ps(), |m, &v| {
                _mm512_max_ps(_mm512_abs_ps(v), m)
            });
            let amax = _mm512_reduce_max_ps(amax);
            if amax == 0.0 {
                return BlockQ8K::zeroed();
            }
            // The reference keeps the first value of largest magnitude (a strict `>` scan).
            let first = x.iter().position(|v| v.abs() == amax).unwrap_or(0);
            let iscale = -127.0 / x[first];
            let s = _mm512_set1_ps(iscale);
            let mut out = BlockQ8K::zeroed();
            for (i, &v) in v.iter().enumerate() {
                let q = _mm512_min_epi32(nearest_int(_mm512_mul_ps(s, v)), _mm512_set1_epi32(127));
                _mm_storeu_si128(
                    out.qs.as_mut_ptr().add(16 * i) as *mut _,
                    _mm512_cvtepi32_epi8(q),
                );
                out.bsums[i] = _mm512_reduce_add_epi32(q) as i16;
            }
            out.d = 1.0 / iscale;
            out
        }
    }

    /// `quantize_row_q8_0_ref` for one block: scale absmax / 127, rounding half away from
    /// zero.
    ///
    /// # Safety
    /// AVX-512 F/BW/VL must be available.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    pub(super) unsafe fn q8_0(x: &[f32]) -> BlockQ8_0 {
        assert_eq!(x.len(), QK);
        // SAFETY: the features are enabled; both loads read 16 of the 32 values.
        unsafe {
            let v = [
                _mm512_loadu_ps(x.as_ptr()),
                _mm512_loadu_ps(x.as_ptr().add(16)),
            ];
            // NaNs skipped as by the reference's `f32::max` (see `q8_k`).
            let zero = _mm512_setzero_ps();
            let m = _mm512_max_ps(_mm512_abs_ps(v[0]), zero);
            let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[1]), m));
            let d = amax / 127.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            let mut out = BlockQ8_0 {
                d: f16::from_f32(d),
                qs: [0; QK],
            };
            for (i, &v) in v.iter().enumerate() {
                let y = _mm512_mul_ps(v, _mm512_set1_ps(id));
                // round(): truncate, then step away from zero where |fraction| ≥ 1/2 (the
                // fraction is exact in f32).
                let t = _mm512_roundscale_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(y);
                let frac = _mm512_abs_ps(_mm512_sub_ps(y, t));
                let away = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(frac, _mm512_set1_ps(0.5));
                let step = _mm512_or_ps(
                    _mm512_set1_ps(1.0),
                    _mm512_and_ps(y, _mm512_castsi512_ps(_mm512_set1_epi32(i32::MIN))),
                );
                let r = _mm512_mask_add_ps(t, away, t, step);
                let q = _mm512_cvttps_epi32(r);
                _mm_storeu_si128(
                    out.qs.as_mut_ptr().add(16 * i) as *mut _,
                    _mm512_cvtepi32_epi8(q),
                );
            }
            out
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dot::test_util::test_pool;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// Rows with ordinary values, exact ties (multiples of a half step), repeated extremes
    /// of both signs, NaNs and all-zero blocks: every block identical to the reference's.
    fn rows(rng: &mut StdRng, k: usize, n: usize) -> Vec<f32> {
        (0..n * k)
            .map(|i| match (i / 32) % 5 {
                0 => 0.0,
                1 => rng.random_range(-3.0f32..3.0),
                2 => (rng.random_range(-254i32..=254) as f32) * 0.5 / 127.0,
                3 => [1.0, -1.0, 0.25, -0.75, f32::NAN][rng.random_range(0..5)],
                _ => rng.random_range(-1e-3f32..1e-3),
            })
            .collect()
    }

    #[test]
    fn q8_0_rows_match_the_reference() {
        let mut rng = StdRng::seed_from_u64(0x80);
        for (k, n) in [(32, 1), (256, 7), (2048, 3)] {
            let x = rows(&mut rng, k, n);
            let got = q8_0_rows(test_pool(), &x, k).unwrap();
            let want = quant::quantize(DType::Q8_0, &x).unwrap();
            assert_eq!(
                bytemuck::cast_slice::<BlockQ8_0, u8>(&got),
                &want[..],
                "k={k} n={n}"
            );
        }
    }

    #[test]
    fn q8_k_rows_match_the_reference() {
        let mut rng = StdRng::seed_from_u64(0x8c);
        for (k, n) in [(256, 1), (512, 5), (2048, 3)] {
            let x = rows(&mut rng, k, n);
            let got = q8_k_rows(test_pool(), &x, k).unwrap();
            let mut want = vec![BlockQ8K::zeroed(); x.len() / QK_K];
            quant::quantize_q8_k(&x, &mut want).unwrap();
            assert_eq!(
                bytemuck::cast_slice::<BlockQ8K, u8>(&got),
                bytemuck::cast_slice::<BlockQ8K, u8>(&want),
                "k={k} n={n}"
            );
        }
    }
}
