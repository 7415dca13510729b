//! F32, F16 and BF16 weights against one f32 activation row: weights widened to f32 as
//! they are loaded, two accumulators per row (so ROWS · 2 independent FMA chains).

use super::{available, avx2, by_groups, ROWS};
use crate::fgemm::FloatWeight;
use crate::pool::Pool;

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use crate::gemv::prefetch;
    use std::arch::x86_64::*;

    /// Elements per step: one 64-byte line of 16-bit weights.
    const STEP: usize = 32;

    /// `w[r] · x` for ROWS rows of `x.len()` elements.
    ///
    /// # Safety
    /// AVX-512 F, BW and VL, AVX2, FMA and F16C must be available.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub(super) unsafe fn rows<W: FloatWeight>(w: [&[W]; ROWS], x: &[f32]) -> [f32; ROWS] {
        let k = x.len();
        assert!(w.iter().all(|r| r.len() == k));
        let body = k / STEP * STEP;
        let lines = (STEP * std::mem::size_of::<W>()).div_ceil(64);
        // SAFETY: the features are enabled on this function; every 16-element load starts
        // at i or i + 16 with i + STEP ≤ body ≤ k = every row's length.
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); 2]; ROWS];
            for i in (0..body).step_by(STEP) {
                let x0 = _mm512_loadu_ps(x.as_ptr().add(i));
                let x1 = _mm512_loadu_ps(x.as_ptr().add(i + 16));
                for (r, row) in w.iter().enumerate() {
                    let p = row.as_ptr().add(i);
                    // The next group's rows (see the module docs of `gemv`).
                    let ahead = p.wrapping_add(ROWS * k) as *const u8;
                    for l in 0..lines {
                        prefetch(ahead.wrapping_add(64 * l));
                    }
                    acc[r][0] = _mm512_fmadd_ps(W::load16(p), x0, acc[r][0]);
                    acc[r][1] = _mm512_fmadd_ps(W::load16(p.add(16)), x1, acc[r][1]);
                }
            }
            let mut sums = acc.map(|[a, b]| _mm512_reduce_add_ps(_mm512_add_ps(a, b)));
            if body < k {
                let mut wide = [0f32; STEP];
                let wide = &mut wide[..k - body];
                for (s, row) in sums.iter_mut().zip(w) {
                    W::widen(&row[body..], wide);
                    *s += wide.iter().zip(&x[body..]).map(|(w, x)| w * x).sum::<f32>();
                }
            }
            sums
        }
    }
}

/// `out[r] = w[r] · x` for `w` of `m` rows of `x.len()` elements. Requires
/// [`available()`].
pub(crate) fn matvec<W: FloatWeight + avx2::Float>(
    pool: &Pool,
    w: &[W],
    x: &[f32],
    out: &mut [f32],
    m: usize,
) {
    if crate::dot::isa() == crate::dot::Isa::Avx2 {
        return avx2::matvec_float(pool, w, x, out, m);
    }
    assert!(available(), "matvec kernel needs AVX-512");
    let k = x.len();
    assert!(w.len() >= m * k && out.len() >= m);
    by_groups::<ROWS>(pool, out, m, |r| {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `available()` (asserted above) means AVX-512 F/BW/VL, AVX2, FMA and F16C
        // were detected.
        return unsafe { x86::rows(r.map(|r| &w[r * k..][..k]), x) };
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("checked by available()")
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dot::test_util::{ref_dot, test_pool};
    use crate::gemv::supported;
    use half::{bf16, f16};
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn check<W: FloatWeight + avx2::Float>(from: fn(f32) -> W, to: fn(W) -> f32) {
        let mut rng = StdRng::seed_from_u64(0xf16);
        // k: a whole number of steps, a ragged tail, shorter than one step.
        for &k in &[64usize, 2048, 100, 7] {
            for &m in &[1usize, 4, 6, 131] {
                let w: Vec<W> = (0..m * k)
                    .map(|_| from(rng.random_range(-1.0..1.0)))
                    .collect();
                let x: Vec<f32> = (0..k).map(|_| rng.random_range(-1.0..1.0)).collect();
                let mut out = vec![f32::NAN; m + 1];
                matvec(test_pool(), &w, &x, &mut out, m);
                assert!(out[m].is_nan(), "wrote past m");
                for r in 0..m {
                    let wf: Vec<f32> = w[r * k..][..k].iter().map(|&v| to(v)).collect();
                    let (exact, abs) = ref_dot(&wf, &x);
                    assert!(
                        (out[r] as f64 - exact).abs() <= 1e-6 * abs + 1e-30,
                        "k={k} m={m} row {r}: got {}, want {exact}",
                        out[r]
                    );
                }
            }
        }
    }

    #[test]
    fn matvec_matches_reference() {
        if !supported() {
            eprintln!("no AVX2 or AVX-512: matvec kernel not testable here");
            return;
        }
        check::<f32>(|v| v, |v| v);
        check::<f16>(f16::from_f32, f16::to_f32);
        check::<bf16>(bf16::from_f32, bf16::to_f32);
    }
}
