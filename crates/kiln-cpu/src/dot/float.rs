//! f32, f16 and bf16 weights against f32 activations.
//!
//! All vector kernels keep four independent accumulators so that the FMA latency (4 cycles)
//! is hidden behind loads; the loop is memory bound once rows exceed the cache.

use half::{bf16, f16};

pub(crate) fn dot_f32_portable(w: &[f32], x: &[f32]) -> f32 {
    // Eight partial sums let the compiler vectorise without reassociating a single chain.
    let mut acc = [0f32; 8];
    let (wc, xc) = (w.chunks_exact(8), x.chunks_exact(8));
    let (wr, xr) = (wc.remainder(), xc.remainder());
    for (w, x) in wc.zip(xc) {
        for i in 0..8 {
            acc[i] += w[i] * x[i];
        }
    }
    let mut sum: f32 = acc.iter().sum();
    for (w, x) in wr.iter().zip(xr) {
        sum += w * x;
    }
    sum
}

pub(crate) fn dot_f16_portable(w: &[f16], x: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (wc, xc) = (w.chunks_exact(8), x.chunks_exact(8));
    let (wr, xr) = (wc.remainder(), xc.remainder());
    for (w, x) in wc.zip(xc) {
        for i in 0..8 {
            acc[i] += w[i].to_f32() * x[i];
        }
    }
    let mut sum: f32 = acc.iter().sum();
    for (w, x) in wr.iter().zip(xr) {
        sum += w.to_f32() * x;
    }
    sum
}

pub(crate) fn dot_bf16_portable(w: &[bf16], x: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (wc, xc) = (w.chunks_exact(8), x.chunks_exact(8));
    let (wr, xr) = (wc.remainder(), xc.remainder());
    for (w, x) in wc.zip(xc) {
        for i in 0..8 {
            // bf16 is the top half of an f32: widening is a shift.
            acc[i] += f32::from_bits((w[i].to_bits() as u32) << 16) * x[i];
        }
    }
    let mut sum: f32 = acc.iter().sum();
    for (w, x) in wr.iter().zip(xr) {
        sum += f32::from_bits((w.to_bits() as u32) << 16) * x;
    }
    sum
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    // Explicit imports: `std::arch::x86_64` also exports a `bf16`.
    use half::{bf16, f16};
    use std::arch::x86_64::*;

    /// Needs AVX. (Helpers here are `#[inline(always)]` without `target_feature` so they
    /// inline into the feature-enabled entry points.)
    #[inline(always)]
    unsafe fn hsum256(v: __m256) -> f32 {
        // SAFETY: the caller enabled AVX.
        unsafe {
            let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            let s = _mm_add_ss(s, _mm_movehdup_ps(s));
            _mm_cvtss_f32(s)
        }
    }

    /// Loads 8 f32-widened weights starting at element `i`.
    trait Load8: Copy {
        fn widen(self) -> f32;
        /// # Safety
        /// `p` must point to 8 readable elements; AVX2 and F16C must be available.
        unsafe fn load8(p: *const Self) -> __m256;
    }
    impl Load8 for f32 {
        #[inline(always)]
        fn widen(self) -> f32 {
            self
        }
        #[inline(always)]
        unsafe fn load8(p: *const f32) -> __m256 {
            // SAFETY: caller guarantees 8 readable f32 and AVX.
            unsafe { _mm256_loadu_ps(p) }
        }
    }
    impl Load8 for f16 {
        #[inline(always)]
        fn widen(self) -> f32 {
            self.to_f32()
        }
        #[inline(always)]
        unsafe fn load8(p: *const f16) -> __m256 {
            // SAFETY: caller guarantees 8 readable f16 (16 bytes) and F16C.
            unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
        }
    }
    impl Load8 for bf16 {
        #[inline(always)]
        fn widen(self) -> f32 {
            f32::from_bits((self.to_bits() as u32) << 16)
        }
        #[inline(always)]
        unsafe fn load8(p: *const bf16) -> __m256 {
            // SAFETY: caller guarantees 8 readable bf16 (16 bytes) and AVX2.
            unsafe {
                let h = _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i));
                _mm256_castsi256_ps(_mm256_slli_epi32(h, 16))
            }
        }
    }

    /// Shared AVX2 body: 32 elements per iteration in four accumulators, then 8 at a time,
    /// then a scalar tail.
    #[inline(always)]
    unsafe fn dot_avx2<T: Load8>(w: &[T], x: &[f32]) -> f32 {
        let n = w.len().min(x.len());
        let (wp, xp) = (w.as_ptr(), x.as_ptr());
        // SAFETY: every load reads elements `i..i + 8` with `i + 8 <= n`; the caller enabled
        // AVX2, FMA and F16C.
        unsafe {
            let mut acc = [_mm256_setzero_ps(); 4];
            let mut i = 0;
            while i + 32 <= n {
                for (k, a) in acc.iter_mut().enumerate() {
                    let j = i + 8 * k;
                    *a = _mm256_fmadd_ps(T::load8(wp.add(j)), _mm256_loadu_ps(xp.add(j)), *a);
                }
                i += 32;
            }
            while i + 8 <= n {
                acc[0] = _mm256_fmadd_ps(T::load8(wp.add(i)), _mm256_loadu_ps(xp.add(i)), acc[0]);
                i += 8;
            }
            let s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
            let mut sum = hsum256(s);
            while i < n {
                sum += w.get_unchecked(i).widen() * *x.get_unchecked(i);
                i += 1;
            }
            sum
        }
    }

    /// # Safety
    /// AVX2, FMA and F16C must be available.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_f32_avx2(w: &[f32], x: &[f32]) -> f32 {
        // SAFETY: features enabled on this function.
        unsafe { dot_avx2(w, x) }
    }

    /// # Safety
    /// AVX2, FMA and F16C must be available.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_f16_avx2(w: &[f16], x: &[f32]) -> f32 {
        // SAFETY: features enabled on this function.
        unsafe { dot_avx2(w, x) }
    }

    /// # Safety
    /// AVX2, FMA and F16C must be available.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_bf16_avx2(w: &[bf16], x: &[f32]) -> f32 {
        // SAFETY: features enabled on this function.
        unsafe { dot_avx2(w, x) }
    }

    /// Loads 16 f32-widened weights, the lanes outside `mask` reading nothing and giving 0.
    trait Load16 {
        /// # Safety
        /// The masked-in elements at `p` must be readable; AVX-512F must be available.
        unsafe fn load16(p: *const Self, mask: __mmask16) -> __m512;
    }
    impl Load16 for f32 {
        #[inline(always)]
        unsafe fn load16(p: *const f32, mask: __mmask16) -> __m512 {
            // SAFETY: masked loads do not touch masked-out lanes.
            unsafe { _mm512_maskz_loadu_ps(mask, p) }
        }
    }
    impl Load16 for f16 {
        #[inline(always)]
        unsafe fn load16(p: *const f16, mask: __mmask16) -> __m512 {
            // SAFETY: masked loads (BW + VL for 16-bit lanes) do not touch masked-out lanes.
            unsafe { _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p as *const i16)) }
        }
    }
    impl Load16 for bf16 {
        #[inline(always)]
        unsafe fn load16(p: *const bf16, mask: __mmask16) -> __m512 {
            // SAFETY: masked loads (BW + VL for 16-bit lanes) do not touch masked-out lanes.
            unsafe {
                let h = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p as *const i16));
                _mm512_castsi512_ps(_mm512_slli_epi32(h, 16))
            }
        }
    }

    /// Shared AVX-512 body: 64 elements per iteration in four accumulators, then 16 at a
    /// time; the tail is one masked load, so there is no scalar loop.
    #[inline(always)]
    unsafe fn dot_avx512<T: Load16>(w: &[T], x: &[f32]) -> f32 {
        let n = w.len().min(x.len());
        let (wp, xp) = (w.as_ptr(), x.as_ptr());
        // SAFETY: full loads read `i..i + 16` with `i + 16 <= n`; the tail load is masked to
        // the `n - i` remaining elements. The caller enabled AVX-512 F/BW/VL.
        unsafe {
            let mut acc = [_mm512_setzero_ps(); 4];
            let mut i = 0;
            while i + 64 <= n {
                for (k, a) in acc.iter_mut().enumerate() {
                    let j = i + 16 * k;
                    *a = _mm512_fmadd_ps(T::load16(wp.add(j), !0), _mm512_loadu_ps(xp.add(j)), *a);
                }
                i += 64;
            }
            while i + 16 <= n {
                acc[0] =
                    _mm512_fmadd_ps(T::load16(wp.add(i), !0), _mm512_loadu_ps(xp.add(i)), acc[0]);
                i += 16;
            }
            if i < n {
                let m: __mmask16 = (1u16 << (n - i)) - 1;
                let xv = _mm512_maskz_loadu_ps(m, xp.add(i));
                acc[1] = _mm512_fmadd_ps(T::load16(wp.add(i), m), xv, acc[1]);
            }
            let s = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
            _mm512_reduce_add_ps(s)
        }
    }

    /// # Safety
    /// AVX-512 F, BW and VL must be available.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub unsafe fn dot_f32_avx512(w: &[f32], x: &[f32]) -> f32 {
        // SAFETY: features enabled on this function.
        unsafe { dot_avx512(w, x) }
    }

    /// # Safety
    /// AVX-512 F, BW and VL must be available.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub unsafe fn dot_f16_avx512(w: &[f16], x: &[f32]) -> f32 {
        // SAFETY: features enabled on this function.
        unsafe { dot_avx512(w, x) }
    }

    /// # Safety
    /// AVX-512 F, BW and VL must be available.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub unsafe fn dot_bf16_avx512(w: &[bf16], x: &[f32]) -> f32 {
        // SAFETY: features enabled on this function.
        unsafe { dot_avx512(w, x) }
    }
}

#[cfg(target_arch = "aarch64")]
pub(crate) mod neon {
    use super::*;
    use std::arch::aarch64::*;

    /// # Safety
    /// NEON must be available (it always is on aarch64 Linux/macOS).
    #[target_feature(enable = "neon")]
    pub unsafe fn dot_f32(w: &[f32], x: &[f32]) -> f32 {
        let n = w.len().min(x.len());
        let (wp, xp) = (w.as_ptr(), x.as_ptr());
        // SAFETY: each load reads `i..i + 4` with `i + 4 <= n`.
        unsafe {
            let mut acc = [vdupq_n_f32(0.0); 4];
            let mut i = 0;
            while i + 16 <= n {
                for (k, a) in acc.iter_mut().enumerate() {
                    let j = i + 4 * k;
                    *a = vfmaq_f32(*a, vld1q_f32(wp.add(j)), vld1q_f32(xp.add(j)));
                }
                i += 16;
            }
            while i + 4 <= n {
                acc[0] = vfmaq_f32(acc[0], vld1q_f32(wp.add(i)), vld1q_f32(xp.add(i)));
                i += 4;
            }
            let s = vaddq_f32(vaddq_f32(acc[0], acc[1]), vaddq_f32(acc[2], acc[3]));
            let mut sum = vaddvq_f32(s);
            while i < n {
                sum += w[i] * x[i];
                i += 1;
            }
            sum
        }
    }

    /// # Safety
    /// NEON must be available.
    #[target_feature(enable = "neon")]
    pub unsafe fn dot_bf16(w: &[bf16], x: &[f32]) -> f32 {
        let n = w.len().min(x.len());
        let (wp, xp) = (w.as_ptr() as *const u16, x.as_ptr());
        // SAFETY: each load reads `i..i + 8` with `i + 8 <= n`.
        unsafe {
            let mut acc = [vdupq_n_f32(0.0); 2];
            let mut i = 0;
            while i + 8 <= n {
                let h = vld1q_u16(wp.add(i));
                // Widening shift left by 16 turns each bf16 into its f32 bit pattern.
                let lo = vreinterpretq_f32_u32(vshll_n_u16::<16>(vget_low_u16(h)));
                let hi = vreinterpretq_f32_u32(vshll_n_u16::<16>(vget_high_u16(h)));
                acc[0] = vfmaq_f32(acc[0], lo, vld1q_f32(xp.add(i)));
                acc[1] = vfmaq_f32(acc[1], hi, vld1q_f32(xp.add(i + 4)));
                i += 8;
            }
            let mut sum = vaddvq_f32(vaddq_f32(acc[0], acc[1]));
            while i < n {
                sum += w[i].to_f32() * x[i];
                i += 1;
            }
            sum
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dot::test_util::{assert_close, isas, ref_dot};
    use crate::dot::Isa;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn run_f32(isa: Isa, w: &[f32], x: &[f32]) -> f32 {
        match isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: tests only run ISAs reported available.
            Isa::Avx2 => unsafe { x86::dot_f32_avx2(w, x) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            Isa::Avx512Vnni => unsafe { x86::dot_f32_avx512(w, x) },
            #[cfg(target_arch = "aarch64")]
            // SAFETY: as above.
            Isa::Neon => unsafe { neon::dot_f32(w, x) },
            _ => dot_f32_portable(w, x),
        }
    }

    fn run_f16(isa: Isa, w: &[f16], x: &[f32]) -> f32 {
        match isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: tests only run ISAs reported available.
            Isa::Avx2 => unsafe { x86::dot_f16_avx2(w, x) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            Isa::Avx512Vnni => unsafe { x86::dot_f16_avx512(w, x) },
            _ => dot_f16_portable(w, x),
        }
    }

    fn run_bf16(isa: Isa, w: &[bf16], x: &[f32]) -> f32 {
        match isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: tests only run ISAs reported available.
            Isa::Avx2 => unsafe { x86::dot_bf16_avx2(w, x) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            Isa::Avx512Vnni => unsafe { x86::dot_bf16_avx512(w, x) },
            #[cfg(target_arch = "aarch64")]
            // SAFETY: as above.
            Isa::Neon => unsafe { neon::dot_bf16(w, x) },
            _ => dot_bf16_portable(w, x),
        }
    }

    const LENS: [usize; 12] = [0, 1, 7, 8, 15, 16, 17, 33, 64, 65, 1000, 4099];

    fn check_all(w: &[f32], x: &[f32], tol: f64, what: &str) {
        let n = w.len();
        let wh: Vec<f16> = w.iter().map(|&v| f16::from_f32(v)).collect();
        let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
        let whf: Vec<f32> = wh.iter().map(|v| v.to_f32()).collect();
        let wbf: Vec<f32> = wb.iter().map(|v| v.to_f32()).collect();
        let (r32, a32) = ref_dot(w, x);
        let (r16, a16) = ref_dot(&whf, x);
        let (rb, ab) = ref_dot(&wbf, x);
        for isa in isas() {
            let tag = |k: &str| format!("{what} {k} n={n} {}", isa.name());
            assert_close(run_f32(isa, w, x), r32, a32, tol, &tag("f32"));
            assert_close(run_f16(isa, &wh, x), r16, a16, tol, &tag("f16"));
            assert_close(run_bf16(isa, &wb, x), rb, ab, tol, &tag("bf16"));
        }
        // The dispatched entry points agree with the direct calls.
        assert_close(
            crate::dot::dot_f32(w, x),
            r32,
            a32,
            tol,
            &format!("{what} dispatch f32"),
        );
        assert_close(
            crate::dot::dot_f16(&wh, x),
            r16,
            a16,
            tol,
            &format!("{what} dispatch f16"),
        );
        assert_close(
            crate::dot::dot_bf16(&wb, x),
            rb,
            ab,
            tol,
            &format!("{what} dispatch bf16"),
        );
    }

    #[test]
    fn random() {
        let mut rng = StdRng::seed_from_u64(0xF10A7);
        for n in LENS {
            let w: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
            let x: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
            check_all(&w, &x, 1e-5, "random");
        }
    }

    #[test]
    fn equal_and_extreme() {
        for n in LENS {
            let w = vec![0.5f32; n];
            let x = vec![-3.0f32; n];
            check_all(&w, &x, 1e-5, "equal");
            // Large magnitudes (still finite in f16) with alternating signs.
            let w: Vec<f32> = (0..n)
                .map(|i| if i % 2 == 0 { 6.0e4 } else { -1.0e4 })
                .collect();
            let x: Vec<f32> = (0..n)
                .map(|i| if i % 3 == 0 { 1.0e4 } else { -2.5 })
                .collect();
            check_all(&w, &x, 1e-5, "extreme");
        }
    }
}
