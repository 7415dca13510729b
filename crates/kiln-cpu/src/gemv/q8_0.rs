//! Q8_0 and Q4_0 weights against one Q8_0 activation row.
//!
//! The per-row dot kernels in [`crate::dot`] redo, for every weight row, work that depends
//! only on `x`: loading and pairing its blocks, the second `vpdpbusd` that removes the
//! unsigned offset, and converting its scales. Here that is done once per call
//! ([`Prepared`]), and [`ROWS`] weight rows go through the loop together, so each loaded
//! pair of activation blocks serves all of them. Per row and pair of blocks what is left
//! is unpacking the weights (`qgemm::WeightBlock::unsigned`), one `vpdpbusd` that starts
//! from the offset correction, and the scale: the two weight scales broadcast to their
//! halves, times the prepared activation scales, into one FMA.

use super::{available, by_groups, ROWS};
use crate::qgemm::WeightBlock;
use kiln_core::quant::{BlockQ8_0, QK};

/// One pair of activation blocks, laid out for the kernel.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct PreparedPair {
    /// The two blocks' quants.
    q: [i8; 2 * QK],
    /// `−OFFSET · Σx` of the first block in lane 0, of the second in lane 8 (the unsigned
    /// form of the weights adds OFFSET to every quant).
    corr: [i32; 16],
    /// The first block's scale in lanes 0..8, the second's in lanes 8..16.
    d: [f32; 16],
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use std::arch::x86_64::*;

    /// `Σ` over pairs of `w[r] · x` for ROWS rows, each `2 · pairs.len()` blocks.
    ///
    /// # Safety
    /// AVX-512 F, BW, VL and VNNI, AVX2, FMA and F16C must be available.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn rows<W: WeightBlock>(
        w: [&[W]; ROWS],
        pairs: &[PreparedPair],
    ) -> [f32; ROWS] {
        assert!(w.iter().all(|r| r.len() >= 2 * pairs.len()));
        // SAFETY: the features are enabled on this function; block indices are
        // < 2·pairs.len() ≤ every row's length (asserted).
        unsafe {
            let mut acc = [_mm512_setzero_ps(); ROWS];
            for (p, xp) in pairs.iter().enumerate() {
                let xv = _mm512_load_si512(xp.q.as_ptr() as *const _);
                let init = _mm512_load_si512(xp.corr.as_ptr() as *const _);
                let dx = _mm512_load_ps(xp.d.as_ptr());
                for (r, row) in w.iter().enumerate() {
                    let (a, b) = (row.get_unchecked(2 * p), row.get_unchecked(2 * p + 1));
                    // The next group's rows (see the module docs of `gemv`).
                    crate::gemv::prefetch((a as *const W).wrapping_add(ROWS * row.len()));
                    let u =
                        _mm512_inserti64x4(_mm512_castsi256_si512(a.unsigned()), b.unsigned(), 1);
                    let ia = _mm512_dpbusd_epi32(init, u, xv);
                    let dw = _mm256_set_m128i(
                        _mm_set1_epi16(b.d_bits() as i16),
                        _mm_set1_epi16(a.d_bits() as i16),
                    );
                    let s = _mm512_mul_ps(_mm512_cvtph_ps(dw), dx);
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia), s, acc[r]);
                }
            }
            acc.map(|v| _mm512_reduce_add_ps(v))
        }
    }
}

/// The activation row, prepared once for every weight row.
fn prepare<W: WeightBlock>(x: &[BlockQ8_0]) -> Vec<PreparedPair> {
    x.chunks_exact(2)
        .map(|xb| {
            let mut p = PreparedPair {
                q: [0; 2 * QK],
                corr: [0; 16],
                d: [0.0; 16],
            };
            for (h, b) in xb.iter().enumerate() {
                p.q[h * QK..][..QK].copy_from_slice(&b.qs);
                p.corr[8 * h] = -W::OFFSET * b.qs.iter().map(|&q| q as i32).sum::<i32>();
                p.d[8 * h..][..8].fill(b.d.to_f32());
            }
            p
        })
        .collect()
}

/// `out[r] = w[r] · x` for `w` of `m` rows of `k / QK` blocks. Requires [`available()`].
pub(crate) fn matvec<W: WeightBlock>(
    w: &[W],
    x: &[BlockQ8_0],
    out: &mut [f32],
    m: usize,
    k: usize,
    dot: fn(&[W], &[BlockQ8_0]) -> f32,
) {
    assert!(available(), "matvec kernel needs AVX-512 VNNI");
    let nb = k / QK;
    assert!(w.len() >= m * nb && x.len() >= nb && out.len() >= m);
    let pairs = prepare::<W>(&x[..nb]);
    // An odd last block goes through the per-row kernel.
    let tail = 2 * pairs.len();
    by_groups(out, m, |r| {
        let rows: [&[W]; ROWS] = r.map(|r| &w[r * nb..][..nb]);
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `available()` (asserted above) means AVX-512 F/BW/VL/VNNI, AVX2, FMA and
        // F16C were detected.
        let mut sums = unsafe { x86::rows(rows, &pairs) };
        #[cfg(not(target_arch = "x86_64"))]
        let mut sums: [f32; ROWS] = unreachable!("checked by available()");
        if tail < nb {
            for (s, row) in sums.iter_mut().zip(rows) {
                *s += dot(&row[tail..], &x[tail..nb]);
            }
        }
        sums
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dot;
    use crate::dot::test_util::ref_dot;
    use kiln_core::quant::{as_blocks, dequantize_to_vec, quantize, BlockQ4_0};
    use kiln_core::DType;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn check<W: WeightBlock>(dtype: DType, dot: fn(&[W], &[BlockQ8_0]) -> f32) {
        let mut rng = StdRng::seed_from_u64(0x6e3f);
        for &k in &[32usize, 64, 96, 2048] {
            for &m in &[1usize, 5, 130, 1000] {
                let wv: Vec<f32> = (0..m * k).map(|_| rng.random_range(-2.0..2.0)).collect();
                let xv: Vec<f32> = (0..k).map(|_| rng.random_range(-1.0..1.0)).collect();
                let wbytes = quantize(dtype, &wv).unwrap();
                let w = as_blocks::<W>(&wbytes).unwrap().into_owned();
                let xbytes = quantize(DType::Q8_0, &xv).unwrap();
                let x = as_blocks::<BlockQ8_0>(&xbytes).unwrap().into_owned();
                let wf = dequantize_to_vec(dtype, &wbytes, m * k).unwrap();
                let xf = dequantize_to_vec(DType::Q8_0, &xbytes, k).unwrap();
                let mut out = vec![f32::NAN; m];
                matvec(&w, &x, &mut out, m, k, dot);
                let nb = k / QK;
                for r in 0..m {
                    let want = dot(&w[r * nb..][..nb], &x);
                    let (_, abs) = ref_dot(&wf[r * k..][..k], &xf);
                    let err = (out[r] - want).abs() as f64;
                    assert!(
                        err <= 1e-5 * abs.max(want.abs() as f64) + 1e-30,
                        "{dtype} k={k} m={m} row {r}: got {}, want {want}",
                        out[r]
                    );
                }
            }
        }
    }

    #[test]
    fn matvec_matches_dot_q8_0() {
        if !available() {
            eprintln!("no AVX-512 VNNI: matvec kernel not testable here");
            return;
        }
        check::<BlockQ8_0>(DType::Q8_0, dot::dot_q8_0);
    }

    #[test]
    fn matvec_matches_dot_q4_0() {
        if !available() {
            eprintln!("no AVX-512 VNNI: matvec kernel not testable here");
            return;
        }
        check::<BlockQ4_0>(DType::Q4_0, dot::dot_q4_0);
    }
}
