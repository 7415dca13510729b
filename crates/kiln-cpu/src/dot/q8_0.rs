//! Q8_0 and Q4_0 weights against Q8_0 activations (blocks of 32, one f16 scale each).
//!
//! Per block: an exact integer dot product of the 32 quants, then one multiply by
//! `d_w · d_x` in f32. The vector kernels avoid ggml's `sign`/`abs` trick for i8·i8
//! (which is wrong when an activation is -128 against a negative weight) and instead use
//! forms that are exact for every input:
//! - AVX2 Q8_0 widens both sides to i16 and uses `madd`;
//! - VNNI Q8_0 computes `Σ (w + 128)·x − 128·Σ x` with `dpbusd`, the `+128` being a xor;
//! - Q4_0 keeps the nibbles unsigned (0..=15) and subtracts `8·Σ x`.

use kiln_core::quant::{BlockQ4_0, BlockQ8_0, QK};

pub(crate) fn dot_q8_0_portable(w: &[BlockQ8_0], x: &[BlockQ8_0]) -> f32 {
    let mut sum = 0f32;
    for (w, x) in w.iter().zip(x) {
        let sumi: i32 =
            w.qs.iter()
                .zip(&x.qs)
                .map(|(&a, &b)| a as i32 * b as i32)
                .sum();
        sum += sumi as f32 * (w.d.to_f32() * x.d.to_f32());
    }
    sum
}

pub(crate) fn dot_q4_0_portable(w: &[BlockQ4_0], x: &[BlockQ8_0]) -> f32 {
    let mut sum = 0f32;
    for (w, x) in w.iter().zip(x) {
        let mut sumi = 0i32;
        for j in 0..QK / 2 {
            let lo = (w.qs[j] & 0x0F) as i32 - 8;
            let hi = (w.qs[j] >> 4) as i32 - 8;
            sumi += lo * x.qs[j] as i32 + hi * x.qs[j + QK / 2] as i32;
        }
        sum += sumi as f32 * (w.d.to_f32() * x.d.to_f32());
    }
    sum
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    //! Helpers are `#[inline(always)]` without `target_feature` so they inline into the
    //! feature-enabled entry points; each is only sound to call from such a function.
    use super::*;
    use crate::dot::k_quants::x86::hsum256;
    use std::arch::x86_64::*;

    /// `d_w[k] · d_x[k]` for four consecutive blocks, converting all eight f16 with one
    /// `vcvtph2ps`. Needs AVX + F16C.
    #[inline(always)]
    unsafe fn scales4(dw: [u16; 4], dx: [u16; 4]) -> __m128 {
        // SAFETY: the caller enabled AVX and F16C.
        unsafe {
            let h = _mm_setr_epi16(
                dw[0] as i16,
                dw[1] as i16,
                dw[2] as i16,
                dw[3] as i16,
                dx[0] as i16,
                dx[1] as i16,
                dx[2] as i16,
                dx[3] as i16,
            );
            let f = _mm256_cvtph_ps(h);
            _mm_mul_ps(_mm256_castps256_ps128(f), _mm256_extractf128_ps(f, 1))
        }
    }

    /// `d_w · d_x` for one block. Needs F16C.
    #[inline(always)]
    unsafe fn scale1(dw: u16, dx: u16) -> f32 {
        // SAFETY: the caller enabled F16C (and so SSE3).
        unsafe {
            let f = _mm_cvtph_ps(_mm_cvtsi32_si128((dw as u32 | (dx as u32) << 16) as i32));
            _mm_cvtss_f32(_mm_mul_ss(f, _mm_movehdup_ps(f)))
        }
    }

    /// 32 i8 of a Q8_0 block. Needs AVX.
    #[inline(always)]
    unsafe fn load_q8(b: &BlockQ8_0) -> __m256i {
        // SAFETY: `qs` is 32 readable bytes (unaligned load); the caller enabled AVX.
        unsafe { _mm256_loadu_si256(b.qs.as_ptr() as *const __m256i) }
    }

    /// Two Q8_0 blocks' quants side by side (block `a` in the low 256 bits). Needs AVX-512F.
    #[inline(always)]
    unsafe fn load_q8_pair(a: &BlockQ8_0, b: &BlockQ8_0) -> __m512i {
        // SAFETY: the caller enabled AVX-512F.
        unsafe { _mm512_inserti64x4(_mm512_castsi256_si512(load_q8(a)), load_q8(b), 1) }
    }

    /// A weight block type that pairs with Q8_0 activations.
    trait Q8Pair: Sized {
        fn d_bits(&self) -> u16;
        /// Exact Σ w·x of one block as eight i32 partial sums. Needs AVX2.
        unsafe fn block_avx2(&self, x: &BlockQ8_0) -> __m256i;
        /// Exact Σ w·x of two blocks: lanes 0..8 hold partial sums of (w0, x0), lanes 8..16
        /// of (w1, x1). Needs AVX-512 F/BW and VNNI.
        unsafe fn pair_vnni(w0: &Self, w1: &Self, x0: &BlockQ8_0, x1: &BlockQ8_0) -> __m512i;
    }

    impl Q8Pair for BlockQ8_0 {
        #[inline(always)]
        fn d_bits(&self) -> u16 {
            self.d.to_bits()
        }

        #[inline(always)]
        unsafe fn block_avx2(&self, x: &BlockQ8_0) -> __m256i {
            // SAFETY: the caller enabled AVX2. Widening to i16 makes `madd` exact.
            unsafe {
                let (a, b) = (load_q8(self), load_q8(x));
                let lo = _mm256_madd_epi16(
                    _mm256_cvtepi8_epi16(_mm256_castsi256_si128(a)),
                    _mm256_cvtepi8_epi16(_mm256_castsi256_si128(b)),
                );
                let hi = _mm256_madd_epi16(
                    _mm256_cvtepi8_epi16(_mm256_extracti128_si256(a, 1)),
                    _mm256_cvtepi8_epi16(_mm256_extracti128_si256(b, 1)),
                );
                _mm256_add_epi32(lo, hi)
            }
        }

        #[inline(always)]
        unsafe fn pair_vnni(w0: &Self, w1: &Self, x0: &BlockQ8_0, x1: &BlockQ8_0) -> __m512i {
            // SAFETY: the caller enabled AVX-512F/BW and VNNI. `(w ^ 0x80)` read as u8 is
            // `w + 128`, so Σ w·x = dpbusd(w ^ 0x80, x) − dpbusd(128, x), exactly.
            unsafe {
                let bias = _mm512_set1_epi8(-128);
                let u = _mm512_xor_si512(load_q8_pair(w0, w1), bias);
                let y = load_q8_pair(x0, x1);
                let zero = _mm512_setzero_si512();
                _mm512_sub_epi32(
                    _mm512_dpbusd_epi32(zero, u, y),
                    _mm512_dpbusd_epi32(zero, bias, y),
                )
            }
        }
    }

    impl Q8Pair for BlockQ4_0 {
        #[inline(always)]
        fn d_bits(&self) -> u16 {
            self.d.to_bits()
        }

        #[inline(always)]
        unsafe fn block_avx2(&self, x: &BlockQ8_0) -> __m256i {
            // SAFETY: `qs` is 16 readable bytes (unaligned load); the caller enabled AVX2.
            // `maddubs` cannot saturate: 15·128·2 and 8·128·2 are far below 32767.
            unsafe {
                let v = _mm_loadu_si128(self.qs.as_ptr() as *const __m128i);
                // Low nibbles are elements 0..16, high nibbles 16..32.
                let both = _mm256_set_m128i(_mm_srli_epi16(v, 4), v);
                let u = _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
                let y = load_q8(x);
                let p = _mm256_sub_epi16(
                    _mm256_maddubs_epi16(u, y),
                    _mm256_maddubs_epi16(_mm256_set1_epi8(8), y),
                );
                _mm256_madd_epi16(p, _mm256_set1_epi16(1))
            }
        }

        #[inline(always)]
        unsafe fn pair_vnni(w0: &Self, w1: &Self, x0: &BlockQ8_0, x1: &BlockQ8_0) -> __m512i {
            // SAFETY: `qs` is 16 readable bytes (unaligned loads); the caller enabled
            // AVX-512F/BW and VNNI.
            unsafe {
                let a = _mm_loadu_si128(w0.qs.as_ptr() as *const __m128i);
                let b = _mm_loadu_si128(w1.qs.as_ptr() as *const __m128i);
                // 128-bit lanes a, a, b, b; lanes 1 and 3 (qwords 2, 3, 6, 7) take the high
                // nibbles.
                let v = _mm512_inserti64x4(
                    _mm512_castsi256_si512(_mm256_set_m128i(a, a)),
                    _mm256_set_m128i(b, b),
                    1,
                );
                let v = _mm512_mask_blend_epi64(0xCC, v, _mm512_srli_epi16(v, 4));
                let u = _mm512_and_si512(v, _mm512_set1_epi8(0x0F));
                let y = load_q8_pair(x0, x1);
                let zero = _mm512_setzero_si512();
                let eight = _mm512_set1_epi8(8);
                _mm512_sub_epi32(
                    _mm512_dpbusd_epi32(zero, u, y),
                    _mm512_dpbusd_epi32(zero, eight, y),
                )
            }
        }
    }

    /// AVX2 loop: four blocks per iteration into two accumulators (hiding FMA latency),
    /// their eight scales converted together.
    #[inline(always)]
    unsafe fn dot_avx2<W: Q8Pair>(w: &[W], x: &[BlockQ8_0]) -> f32 {
        let n = w.len().min(x.len());
        // SAFETY: the caller enabled AVX2, FMA and F16C; memory is read through references.
        unsafe {
            let mut acc = [_mm256_setzero_ps(); 2];
            let mut i = 0;
            while i + 4 <= n {
                let (w4, x4) = (&w[i..i + 4], &x[i..i + 4]);
                let dw = [
                    w4[0].d_bits(),
                    w4[1].d_bits(),
                    w4[2].d_bits(),
                    w4[3].d_bits(),
                ];
                let dx = [x4[0].d, x4[1].d, x4[2].d, x4[3].d].map(|h| h.to_bits());
                let mut s = [0f32; 4];
                _mm_storeu_ps(s.as_mut_ptr(), scales4(dw, dx));
                for k in 0..4 {
                    let p = _mm256_cvtepi32_ps(w4[k].block_avx2(&x4[k]));
                    acc[k & 1] = _mm256_fmadd_ps(_mm256_set1_ps(s[k]), p, acc[k & 1]);
                }
                i += 4;
            }
            while i < n {
                let s = scale1(w[i].d_bits(), x[i].d.to_bits());
                let p = _mm256_cvtepi32_ps(w[i].block_avx2(&x[i]));
                acc[0] = _mm256_fmadd_ps(_mm256_set1_ps(s), p, acc[0]);
                i += 1;
            }
            hsum256(_mm256_add_ps(acc[0], acc[1]))
        }
    }

    /// AVX-512 loop: four blocks (two registers) per iteration into two accumulators; the
    /// last few blocks go through the AVX2 block kernel.
    #[inline(always)]
    unsafe fn dot_avx512<W: Q8Pair>(w: &[W], x: &[BlockQ8_0]) -> f32 {
        let n = w.len().min(x.len());
        // SAFETY: the caller enabled AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C; memory is
        // read through references.
        unsafe {
            // Lane l of a pair's scale vector is the scale of block l / 8 of the pair.
            let idx0 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
            let idx1 = _mm512_setr_epi32(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
            let mut acc = [_mm512_setzero_ps(); 2];
            let mut i = 0;
            while i + 4 <= n {
                let (w4, x4) = (&w[i..i + 4], &x[i..i + 4]);
                let dw = [
                    w4[0].d_bits(),
                    w4[1].d_bits(),
                    w4[2].d_bits(),
                    w4[3].d_bits(),
                ];
                let dx = [x4[0].d, x4[1].d, x4[2].d, x4[3].d].map(|h| h.to_bits());
                let s = _mm512_castps128_ps512(scales4(dw, dx));
                let p0 = W::pair_vnni(&w4[0], &w4[1], &x4[0], &x4[1]);
                let p1 = W::pair_vnni(&w4[2], &w4[3], &x4[2], &x4[3]);
                let s0 = _mm512_permutexvar_ps(idx0, s);
                let s1 = _mm512_permutexvar_ps(idx1, s);
                acc[0] = _mm512_fmadd_ps(s0, _mm512_cvtepi32_ps(p0), acc[0]);
                acc[1] = _mm512_fmadd_ps(s1, _mm512_cvtepi32_ps(p1), acc[1]);
                i += 4;
            }
            let mut tail = _mm256_setzero_ps();
            while i < n {
                let s = scale1(w[i].d_bits(), x[i].d.to_bits());
                let p = _mm256_cvtepi32_ps(w[i].block_avx2(&x[i]));
                tail = _mm256_fmadd_ps(_mm256_set1_ps(s), p, tail);
                i += 1;
            }
            _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1])) + hsum256(tail)
        }
    }

    /// # Safety
    /// AVX2, FMA and F16C must be available.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q8_0_avx2(w: &[BlockQ8_0], x: &[BlockQ8_0]) -> f32 {
        // SAFETY: the features `dot_avx2` needs are enabled on this function.
        unsafe { dot_avx2(w, x) }
    }

    /// # Safety
    /// AVX2, FMA and F16C must be available.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q4_0_avx2(w: &[BlockQ4_0], x: &[BlockQ8_0]) -> f32 {
        // SAFETY: the features `dot_avx2` needs are enabled on this function.
        unsafe { dot_avx2(w, x) }
    }

    /// # Safety
    /// AVX-512 F, BW, VL and VNNI, AVX2, FMA and F16C must be available.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub unsafe fn dot_q8_0_avx512(w: &[BlockQ8_0], x: &[BlockQ8_0]) -> f32 {
        // SAFETY: the features `dot_avx512` needs are enabled on this function.
        unsafe { dot_avx512(w, x) }
    }

    /// # Safety
    /// AVX-512 F, BW, VL and VNNI, AVX2, FMA and F16C must be available.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub unsafe fn dot_q4_0_avx512(w: &[BlockQ4_0], x: &[BlockQ8_0]) -> f32 {
        // SAFETY: the features `dot_avx512` needs are enabled on this function.
        unsafe { dot_avx512(w, x) }
    }
}

#[cfg(target_arch = "aarch64")]
pub(crate) mod neon {
    //! Widening multiplies (`smull`) and pairwise accumulation (`sadalp`): exact for all
    //! inputs and available on every aarch64 CPU (no `dotprod` requirement).
    use super::*;
    use std::arch::aarch64::*;

    /// Σ a·b over 16 + 16 i8 lanes added into `acc`. Needs NEON.
    #[inline(always)]
    unsafe fn mac(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
        // SAFETY: the caller enabled NEON. |i8·i8| ≤ 16384 fits i16.
        unsafe {
            let acc = vpadalq_s16(acc, vmull_s8(vget_low_s8(a), vget_low_s8(b)));
            vpadalq_s16(acc, vmull_high_s8(a, b))
        }
    }

    /// # Safety
    /// NEON must be available.
    #[target_feature(enable = "neon")]
    pub unsafe fn dot_q8_0(w: &[BlockQ8_0], x: &[BlockQ8_0]) -> f32 {
        let mut sum = 0f32;
        for (w, x) in w.iter().zip(x) {
            // SAFETY: each `qs` is 32 readable bytes; NEON is enabled.
            let sumi = unsafe {
                let (wp, xp) = (w.qs.as_ptr(), x.qs.as_ptr());
                let acc = mac(vdupq_n_s32(0), vld1q_s8(wp), vld1q_s8(xp));
                let acc = mac(acc, vld1q_s8(wp.add(16)), vld1q_s8(xp.add(16)));
                vaddvq_s32(acc)
            };
            sum += sumi as f32 * (w.d.to_f32() * x.d.to_f32());
        }
        sum
    }

    /// # Safety
    /// NEON must be available.
    #[target_feature(enable = "neon")]
    pub unsafe fn dot_q4_0(w: &[BlockQ4_0], x: &[BlockQ8_0]) -> f32 {
        let mut sum = 0f32;
        for (w, x) in w.iter().zip(x) {
            // SAFETY: `w.qs` is 16 and `x.qs` 32 readable bytes; NEON is enabled.
            let sumi = unsafe {
                let v = vld1q_u8(w.qs.as_ptr());
                let eight = vdupq_n_s8(8);
                let lo = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(v, vdupq_n_u8(0x0F))), eight);
                let hi = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8::<4>(v)), eight);
                let xp = x.qs.as_ptr();
                let acc = mac(vdupq_n_s32(0), lo, vld1q_s8(xp));
                let acc = mac(acc, hi, vld1q_s8(xp.add(16)));
                vaddvq_s32(acc)
            };
            sum += sumi as f32 * (w.d.to_f32() * x.d.to_f32());
        }
        sum
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dot::test_util::{assert_close, isas, ref_dot};
    use crate::dot::Isa;
    use half::f16;
    use kiln_core::quant::{as_blocks, dequantize_to_vec, quantize};
    use kiln_core::DType;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn run_q8(isa: Isa, w: &[BlockQ8_0], x: &[BlockQ8_0]) -> f32 {
        match isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: tests only run ISAs reported available.
            Isa::Avx2 => unsafe { x86::dot_q8_0_avx2(w, x) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            Isa::Avx512Vnni => unsafe { x86::dot_q8_0_avx512(w, x) },
            #[cfg(target_arch = "aarch64")]
            // SAFETY: as above.
            Isa::Neon => unsafe { neon::dot_q8_0(w, x) },
            _ => dot_q8_0_portable(w, x),
        }
    }

    fn run_q4(isa: Isa, w: &[BlockQ4_0], x: &[BlockQ8_0]) -> f32 {
        match isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: tests only run ISAs reported available.
            Isa::Avx2 => unsafe { x86::dot_q4_0_avx2(w, x) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            Isa::Avx512Vnni => unsafe { x86::dot_q4_0_avx512(w, x) },
            #[cfg(target_arch = "aarch64")]
            // SAFETY: as above.
            Isa::Neon => unsafe { neon::dot_q4_0(w, x) },
            _ => dot_q4_0_portable(w, x),
        }
    }

    fn deq<B: bytemuck::Pod>(dtype: DType, blocks: &[B]) -> Vec<f32> {
        let bytes: &[u8] = bytemuck::cast_slice(blocks);
        dequantize_to_vec(dtype, bytes, blocks.len() * QK).unwrap()
    }

    fn blocks<B: bytemuck::Pod>(dtype: DType, v: &[f32]) -> Vec<B> {
        as_blocks::<B>(&quantize(dtype, v).unwrap())
            .unwrap()
            .into_owned()
    }

    /// Every ISA's Q8_0 and Q4_0 kernels against the f64 dot of the dequantized values.
    fn check(w8: &[BlockQ8_0], w4: &[BlockQ4_0], x: &[BlockQ8_0], what: &str) {
        let xf = deq(DType::Q8_0, x);
        let (r8, a8) = ref_dot(&deq(DType::Q8_0, w8), &xf);
        let (r4, a4) = ref_dot(&deq(DType::Q4_0, w4), &xf);
        let n = x.len();
        for isa in isas() {
            let tag = |k: &str| format!("{what} {k} blocks={n} {}", isa.name());
            assert_close(run_q8(isa, w8, x), r8, a8, 1e-5, &tag("q8_0"));
            assert_close(run_q4(isa, w4, x), r4, a4, 1e-5, &tag("q4_0"));
        }
        assert_close(
            crate::dot::dot_q8_0(w8, x),
            r8,
            a8,
            1e-5,
            &format!("{what} dispatch q8_0"),
        );
        assert_close(
            crate::dot::dot_q4_0(w4, x),
            r4,
            a4,
            1e-5,
            &format!("{what} dispatch q4_0"),
        );
    }

    const BLOCKS: [usize; 9] = [0, 1, 2, 3, 4, 5, 8, 17, 64];

    #[test]
    fn quantized_random() {
        let mut rng = StdRng::seed_from_u64(0x0080);
        for n in BLOCKS {
            let wv: Vec<f32> = (0..n * QK).map(|_| rng.random_range(-2.0..2.0)).collect();
            let xv: Vec<f32> = (0..n * QK).map(|_| rng.random_range(-1.0..1.0)).collect();
            let x = blocks::<BlockQ8_0>(DType::Q8_0, &xv);
            let w8 = blocks::<BlockQ8_0>(DType::Q8_0, &wv);
            let w4 = blocks::<BlockQ4_0>(DType::Q4_0, &wv);
            check(&w8, &w4, &x, "quantized");
        }
    }

    /// Raw random bytes cover every quant value, -128 included, which ggml's quantizer never
    /// produces but the kernels must still get right.
    #[test]
    fn raw_random() {
        let mut rng = StdRng::seed_from_u64(0x0081);
        let d = |rng: &mut StdRng| f16::from_f32(rng.random_range(-0.1..0.1));
        for n in BLOCKS {
            let x: Vec<BlockQ8_0> = (0..n)
                .map(|_| BlockQ8_0 {
                    d: d(&mut rng),
                    qs: rng.random(),
                })
                .collect();
            let w8: Vec<BlockQ8_0> = (0..n)
                .map(|_| BlockQ8_0 {
                    d: d(&mut rng),
                    qs: rng.random(),
                })
                .collect();
            let w4: Vec<BlockQ4_0> = (0..n)
                .map(|_| BlockQ4_0 {
                    d: d(&mut rng),
                    qs: rng.random(),
                })
                .collect();
            check(&w8, &w4, &x, "raw");
        }
    }

    #[test]
    fn equal_and_extreme() {
        for n in BLOCKS {
            // All-equal values quantize to all-equal quants.
            let w8 = blocks::<BlockQ8_0>(DType::Q8_0, &vec![0.75; n * QK]);
            let w4 = blocks::<BlockQ4_0>(DType::Q4_0, &vec![0.75; n * QK]);
            let x = blocks::<BlockQ8_0>(DType::Q8_0, &vec![-1.5; n * QK]);
            check(&w8, &w4, &x, "equal");
            // The most negative quants at a large scale: every product is the maximum
            // 128·128 (Q8_0) or 8·128 (Q4_0), with no saturation allowed.
            let big = f16::from_f32(1e4);
            let w8 = vec![
                BlockQ8_0 {
                    d: big,
                    qs: [-128; QK]
                };
                n
            ];
            let w4 = vec![
                BlockQ4_0 {
                    d: big,
                    qs: [0; QK / 2]
                };
                n
            ];
            let x = vec![
                BlockQ8_0 {
                    d: big,
                    qs: [-128; QK]
                };
                n
            ];
            check(&w8, &w4, &x, "extreme-neg");
            let x = vec![
                BlockQ8_0 {
                    d: big,
                    qs: [127; QK]
                };
                n
            ];
            let w4 = vec![
                BlockQ4_0 {
                    d: big,
                    qs: [0xFF; QK / 2]
                };
                n
            ];
            let w8 = vec![
                BlockQ8_0 {
                    d: -big,
                    qs: [-128; QK]
                };
                n
            ];
            check(&w8, &w4, &x, "extreme-mixed");
        }
    }
}
