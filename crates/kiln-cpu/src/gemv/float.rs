//! F32, F16 and BF16 weights against one f32 activation row: weights widened to f32 as
//! they are loaded, two accumulators per row. Rows go [`ROWS`] at a time, or one at a
//! time where the CPU's [`Plan`] says so (a float row's work per byte is one conversion
//! and one FMA per 16 weights, so these rows run at the memory's own rate and gain most
//! from a single sequential stream).

use super::{available, avx2, by_groups, ROWS};
use crate::fgemm::FloatWeight;
use crate::pool::Pool;
use crate::stream::Plan;

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use crate::stream::{ahead, prefetch, Stream};
    use std::arch::x86_64::*;

    /// Elements per step: one 64-byte line of 16-bit weights.
    const STEP: usize = 32;

    /// `w[r] · x` for R rows of `x.len()` elements. Each line loaded is paired with a
    /// prefetch: with several rows, of the same place R rows on (the next group's rows);
    /// with one, of the place [`ahead`] bytes on in its stream (none when that is 0).
    ///
    /// # Safety
    /// AVX-512 F, BW and VL, AVX2, FMA and F16C must be available.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub(super) unsafe fn rows<W: FloatWeight, const R: usize>(w: [&[W]; R], x: &[f32]) -> [f32; R] {
        let k = x.len();
        assert!(w.iter().all(|r| r.len() == k));
        let body = k / STEP * STEP;
        let lines = (STEP * std::mem::size_of::<W>()).div_ceil(64);
        let distance = if R > 1 {
            R * k * std::mem::size_of::<W>()
        } else {
            ahead(Stream::Float)
        };
        // SAFETY: the features are enabled on this function; every 16-element load starts
        // at i or i + 16 with i + STEP ≤ body ≤ k = every row's length.
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); 2]; R];
            for i in (0..body).step_by(STEP) {
                let x0 = _mm512_loadu_ps(x.as_ptr().add(i));
                let x1 = _mm512_loadu_ps(x.as_ptr().add(i + 16));
                for (r, row) in w.iter().enumerate() {
                    let p = row.as_ptr().add(i);
                    if distance > 0 {
                        let on = (p as *const u8).wrapping_add(distance);
                        for l in 0..lines {
                            prefetch(on.wrapping_add(64 * l));
                        }
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
    if Plan::get().one_row {
        matvec_rows::<W, 1>(pool, w, x, out, m)
    } else {
        matvec_rows::<W, ROWS>(pool, w, x, out, m)
    }
}

/// [`matvec`], `R` weight rows at a time. Requires [`available()`].
pub(crate) fn matvec_rows<W: FloatWeight, const R: usize>(
    pool: &Pool,
    w: &[W],
    x: &[f32],
    out: &mut [f32],
    m: usize,
) {
    assert!(available(), "matvec kernel needs AVX-512");
    let k = x.len();
    assert!(w.len() >= m * k && out.len() >= m);
    by_groups::<R>(pool, out, m, |r| {
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

    type Matvec<W> = fn(&Pool, &[W], &[f32], &mut [f32], usize);

    fn check<W: FloatWeight + avx2::Float>(
        from: fn(f32) -> W,
        to: fn(W) -> f32,
        matvec: Matvec<W>,
    ) {
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
        check::<f32>(|v| v, |v| v, matvec);
        check::<f16>(f16::from_f32, f16::to_f32, matvec);
        check::<bf16>(bf16::from_f32, bf16::to_f32, matvec);
    }

    /// Both row plans, whichever this CPU's vendor picks.
    #[test]
    fn one_and_four_rows_match_reference() {
        if !available() {
            eprintln!("no AVX-512: the AVX-512 matvec kernels are not testable here");
            return;
        }
        check::<f16>(f16::from_f32, f16::to_f32, matvec_rows::<f16, 1>);
        check::<f16>(f16::from_f32, f16::to_f32, matvec_rows::<f16, ROWS>);
        check::<f32>(|v| v, |v| v, matvec_rows::<f32, 1>);
        check::<bf16>(bf16::from_f32, bf16::to_f32, matvec_rows::<bf16, ROWS>);
    }
}
