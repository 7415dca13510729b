//! F16 and BF16 prompts on AMX-BF16 tiles (see [`crate::amx`]): `out[n, m] = x · wᵀ`.
//!
//! Tiles multiply bf16, whose 8-bit significand holds neither an f16 weight (11 bits) nor
//! an f32 activation (24). So each value is split in two, `v = hi + lo`: `hi` is `v`
//! rounded to bf16 and `lo` the remainder (exact in f32, at most 2^-8·|v|) rounded to
//! bf16. For an f16 weight the remainder has at most 3 significant bits and the split is
//! exact (a bf16 weight has no remainder); an activation keeps 16 significant bits
//! (relative error ≤ 2^-16). A product then takes three tile products, `wh·xh + wh·xl +
//! wl·xh`, and drops `wl·xl` (≤ 2^-16 of it): at most 2^-15 relative error per product,
//! where llama.cpp's F16 path rounds activations to f16 (2^-11). The sums accumulate in
//! f32 over all of k: unlike the quantized formats there is no per-block scale, so tiles
//! stay in registers from the first k to the last.
//!
//! Layout: the weights are the A operand (rows of 32 bf16 in their own order, split per
//! call into a 16-row panel), the activations the B operand (bf16 pairs per column, laid
//! out once per call). C[r][c] is weight row r · activation row c. Four activation tiles
//! share each loaded weight tile: C0-3, weight hi/lo and activation hi/lo are all eight
//! tile registers.

use super::FloatWeight;
use crate::pool::Pool;
use crate::qgemm::{for_panels, P};
use bytemuck::Zeroable;

/// k per tile step: 32 bf16 make a 64-byte tile row.
const KS: usize = 32;
/// Activation rows per tile.
const T: usize = 16;
/// Activation tiles per pass over a weight panel.
const GROUP: usize = 4;

/// k-step `s` of a 16-row weight panel, split: two A tiles of contiguous 64-byte rows
/// (rows a whole panel apart would all fall in one L1 set).
#[repr(C, align(64))]
#[derive(Clone, Copy, Zeroable)]
struct WeightStep {
    hi: [[u16; KS]; P],
    lo: [[u16; KS]; P],
}

/// k-step `s` of one tile of activation rows, split, as B tiles: `[j][2c + i]` is element
/// `2j + i` of row c.
#[repr(C, align(64))]
#[derive(Clone, Copy, Zeroable)]
struct ActStep {
    hi: [[u16; 2 * T]; KS / 2],
    lo: [[u16; 2 * T]; KS / 2],
}

/// `x` rounded to the nearest bf16 (ties to even), as bits.
fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

/// `(hi, lo)` with `x ≈ hi + lo` (see the module docs).
fn split(x: f32) -> (u16, u16) {
    let hi = bf16_bits(x);
    (hi, bf16_bits(x - f32::from_bits((hi as u32) << 16)))
}

/// The activation rows as B tiles, `[tile][step]`, zero past row n and column k; tiles
/// over the pool.
fn activation_steps(pool: &Pool, xs: &[f32], n: usize, k: usize) -> Vec<ActStep> {
    let steps = k.div_ceil(KS);
    let mut a = vec![ActStep::zeroed(); n.div_ceil(T) * steps];
    pool.for_chunks_mut(&mut a, steps, |t, a| {
        let rows = &xs[t * T * k..n.min((t + 1) * T) * k];
        for (c, row) in rows.chunks_exact(k).enumerate() {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `amx::bf16_available()` (checked by the caller) implies AVX-512.
            unsafe {
                x86::split_row(row, c, a)
            };
            #[cfg(not(target_arch = "x86_64"))]
            let _ = (row, c);
        }
    });
    a
}

/// `out[n, m] = x · wᵀ` for `w` of `m` rows of `k`. Requires [`crate::amx::bf16_available()`].
pub(crate) fn matmul<W: FloatWeight>(
    pool: &Pool,
    w: &[W],
    xs: &[f32],
    out: &mut [f32],
    n: usize,
    m: usize,
    k: usize,
) {
    assert!(crate::amx::bf16_available(), "AMX-BF16 tiles not available");
    assert!(w.len() >= m * k && xs.len() >= n * k && out.len() >= n * m);
    if n == 0 || m == 0 {
        return;
    }
    let steps = k.div_ceil(KS);
    let xa = activation_steps(pool, xs, n, k);
    for_panels(
        pool,
        out,
        n,
        m,
        || vec![WeightStep::zeroed(); steps],
        |rows, panel| {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `amx::bf16_available()` (asserted) implies the AVX-512 features.
            unsafe {
                x86::repack(w, rows, k, panel)
            };
            #[cfg(not(target_arch = "x86_64"))]
            let _ = (rows, panel);
        },
        |panel, o| {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `amx::bf16_available()` (asserted): AMX granted and AVX-512 present.
            unsafe {
                x86::product::<W>(panel, &xa, steps, o)
            };
            #[cfg(not(target_arch = "x86_64"))]
            let _ = (panel, o);
        },
    );
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use crate::amx::{x86 as tiles, TileConfig};
    use std::arch::x86_64::*;

    /// The upper 16 bits of each f32 lane of `a` then `b`, as 32 u16.
    #[inline(always)]
    unsafe fn upper_halves(a: __m512i, b: __m512i) -> __m512i {
        // SAFETY: the caller enabled AVX-512 F/BW.
        unsafe {
            let odd: [u16; 32] = std::array::from_fn(|i| 2 * i as u16 + 1);
            _mm512_permutex2var_epi16(a, _mm512_loadu_si512(odd.as_ptr() as *const _), b)
        }
    }

    /// [`split`] row `c` of a tile of activation rows into its steps `a` (B layout: the
    /// pair of elements 2j, 2j + 1 of step s goes to `a[s].hi[j][2c..2c + 2]`).
    ///
    /// # Safety
    /// AVX-512 F/BW/VL, AVX2, FMA and F16C must be available.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub(super) unsafe fn split_row(row: &[f32], c: usize, a: &mut [ActStep]) {
        assert!(c < T && a.len() * KS >= row.len());
        let full = row.len() / KS;
        // SAFETY: the features are enabled on this function; loads read inside `row`
        // (whole steps only); the scatters write u32 lane j to `[j][2c..2c + 2]` of a
        // 16 × 64-byte array inside `a[s]`.
        unsafe {
            let idx = _mm512_add_epi32(
                _mm512_mullo_epi32(
                    _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                    _mm512_set1_epi32(T as i32),
                ),
                _mm512_set1_epi32(c as i32),
            );
            for (s, step) in a[..full].iter_mut().enumerate() {
                let v = [0, 16]
                    .map(|h| _mm512_castps_si512(_mm512_loadu_ps(row.as_ptr().add(KS * s + h))));
                let hi = v.map(|v| round_bf16(_mm512_castsi512_ps(v)));
                let lo = [0, 1].map(|h| {
                    let rest = _mm512_sub_ps(_mm512_castsi512_ps(v[h]), _mm512_castsi512_ps(hi[h]));
                    round_bf16(rest)
                });
                _mm512_i32scatter_epi32::<4>(
                    step.hi.as_mut_ptr() as *mut _,
                    idx,
                    upper_halves(hi[0], hi[1]),
                );
                _mm512_i32scatter_epi32::<4>(
                    step.lo.as_mut_ptr() as *mut _,
                    idx,
                    upper_halves(lo[0], lo[1]),
                );
            }
        }
        if full * KS < row.len() {
            let step = &mut a[full];
            for (e, &x) in row[full * KS..].iter().enumerate() {
                let (hi, lo) = split(x);
                step.hi[e / 2][2 * c + e % 2] = hi;
                step.lo[e / 2][2 * c + e % 2] = lo;
            }
        }
    }

    /// f32 lanes rounded to the nearest bf16 (ties to even), as f32 bits (low halves 0).
    #[inline(always)]
    unsafe fn round_bf16(v: __m512) -> __m512i {
        // SAFETY: the caller enabled AVX-512 F.
        unsafe {
            let b = _mm512_castps_si512(v);
            let odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
            let r = _mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
            _mm512_and_si512(r, _mm512_set1_epi32(0xffff_0000u32 as i32))
        }
    }

    /// Split weight rows `rows` (16 indices into `w`, rows of `k`) into `panel` (one
    /// [`WeightStep`] per 32 of k, zero past k). For f16 and bf16 weights the remainder
    /// after rounding to bf16 has at most 3 significant bits, so it is exact as bf16.
    ///
    /// # Safety
    /// AVX-512 F/BW/VL, AVX2, FMA and F16C must be available.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub(super) unsafe fn repack<W: FloatWeight>(
        w: &[W],
        rows: [usize; P],
        k: usize,
        panel: &mut [WeightStep],
    ) {
        let full = k / KS;
        for (r, &row) in rows.iter().enumerate() {
            let src = &w[row * k..][..k];
            // SAFETY: the features are enabled on this function; each 16-element load
            // reads inside `src` (steps below `full` are whole); stores go to `panel`.
            unsafe {
                for (s, d) in panel[..full].iter_mut().enumerate() {
                    let v = [0, 16].map(|h| W::load16(src.as_ptr().add(KS * s + h)));
                    let hi = v.map(|v| round_bf16(v));
                    // Exact: the remainder has at most 3 significant bits.
                    let lo = [0, 1].map(|h| {
                        _mm512_castps_si512(_mm512_sub_ps(v[h], _mm512_castsi512_ps(hi[h])))
                    });
                    _mm512_store_si512(d.hi[r].as_mut_ptr() as *mut _, upper_halves(hi[0], hi[1]));
                    _mm512_store_si512(d.lo[r].as_mut_ptr() as *mut _, upper_halves(lo[0], lo[1]));
                }
                if let Some(d) = panel.get_mut(full) {
                    let mut wide = [0f32; KS];
                    let tail = &src[KS * full..];
                    W::widen(tail, &mut wide[..tail.len()]);
                    for (e, &x) in wide.iter().enumerate() {
                        (d.hi[r][e], d.lo[r][e]) = split(x);
                    }
                }
            }
        }
    }

    /// Activation tile `a` of this step into `C`: `C += wh·xh + wh·xl + wl·xh` with the
    /// weights in tiles 4 (hi) and 5 (lo; none for bf16 weights).
    ///
    /// # Safety
    /// As for [`product`], inside its configuration.
    #[inline(always)]
    unsafe fn step<W: FloatWeight, const C: usize>(a: &ActStep) {
        // SAFETY: the caller guarantees the configuration; `a` is two 16 × 64-byte tiles.
        unsafe {
            tiles::load::<6>(a.hi.as_ptr() as *const u8, 64);
            tiles::load::<7>(a.lo.as_ptr() as *const u8, 64);
            tiles::dot_bf16::<C, 4, 6>();
            tiles::dot_bf16::<C, 4, 7>();
            if !W::IS_BF16 {
                tiles::dot_bf16::<C, 5, 6>();
            }
        }
    }

    /// Store tile `C` (weight rows × activation columns) into `o` transposed: activation
    /// rows `16·t..` of it, as many as `o` has.
    ///
    /// # Safety
    /// As for [`product`], inside its configuration.
    #[inline(always)]
    unsafe fn flush<const C: usize>(o: &mut [[f32; P]], t: usize) {
        let mut c = [[0f32; T]; P];
        // SAFETY: the caller guarantees the configuration; `c` is 16 × 64 bytes.
        unsafe { tiles::store::<C, f32>(&mut c) };
        for (col, orow) in o.iter_mut().skip(T * t).take(T).enumerate() {
            for (r, v) in orow.iter_mut().enumerate() {
                *v = c[r][col];
            }
        }
    }

    /// One pass of `G` activation tiles from tile `t0` over the whole panel.
    ///
    /// # Safety
    /// As for [`product`], inside its configuration; tiles `t0..t0 + G` exist in `xa`.
    #[inline(always)]
    unsafe fn pass<W: FloatWeight, const G: usize>(
        panel: &[WeightStep],
        xa: &[ActStep],
        steps: usize,
        t0: usize,
        o: &mut [[f32; P]],
    ) {
        // SAFETY: the caller guarantees the configuration; weight tiles are the 16 × 64
        // contiguous bytes of `panel[s].hi`/`.lo`, activation tiles `xa[(t0 + t)·steps + s]`.
        unsafe {
            tiles::zero::<0>();
            tiles::zero::<1>();
            tiles::zero::<2>();
            tiles::zero::<3>();
            for s in 0..steps {
                let wp = panel.get_unchecked(s);
                tiles::load::<4>(wp.hi.as_ptr() as *const u8, 64);
                if !W::IS_BF16 {
                    tiles::load::<5>(wp.lo.as_ptr() as *const u8, 64);
                }
                let a = |t: usize| xa.get_unchecked((t0 + t) * steps + s);
                step::<W, 0>(a(0));
                if G > 1 {
                    step::<W, 1>(a(1));
                }
                if G > 2 {
                    step::<W, 2>(a(2));
                }
                if G > 3 {
                    step::<W, 3>(a(3));
                }
            }
            flush::<0>(o, t0);
            if G > 1 {
                flush::<1>(o, t0 + 1);
            }
            if G > 2 {
                flush::<2>(o, t0 + 2);
            }
            if G > 3 {
                flush::<3>(o, t0 + 3);
            }
        }
    }

    /// `o[c][r]` = activation row c · panel row r for all `o.len()` activation rows.
    ///
    /// # Safety
    /// [`crate::amx::bf16_available`] must hold (it implies the AVX-512 features enabled here).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub(super) unsafe fn product<W: FloatWeight>(
        panel: &[WeightStep],
        xa: &[ActStep],
        steps: usize,
        o: &mut [[f32; P]],
    ) {
        let tiles_n = o.len().div_ceil(T);
        assert!(panel.len() >= steps && xa.len() >= tiles_n * steps);
        let (c, t) = ((P, 64), (T, 64));
        // SAFETY: AMX is available and granted (caller) and configured here for every
        // tile `pass` uses; `pass` gets tiles inside `xa` (asserted).
        unsafe {
            tiles::configure(&TileConfig::new(&[c, c, c, c, t, t, t, t]));
            for t0 in (0..tiles_n).step_by(GROUP) {
                match (tiles_n - t0).min(GROUP) {
                    1 => pass::<W, 1>(panel, xa, steps, t0, o),
                    2 => pass::<W, 2>(panel, xa, steps, t0, o),
                    3 => pass::<W, 3>(panel, xa, steps, t0, o),
                    _ => pass::<W, 4>(panel, xa, steps, t0, o),
                }
            }
            tiles::release();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dot::test_util::{ref_dot, test_pool};
    use half::{bf16, f16};
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn check<W: FloatWeight>(from: fn(f32) -> W, to: fn(W) -> f32) {
        let mut rng = StdRng::seed_from_u64(0xb16);
        for &k in &[32usize, 100, 2048] {
            for &m in &[1usize, 20, 130] {
                for &n in &[8usize, 17, 64, 100] {
                    let w: Vec<W> = (0..m * k)
                        .map(|_| from(rng.random_range(-1.0..1.0)))
                        .collect();
                    let x: Vec<f32> = (0..n * k).map(|_| rng.random_range(-1.0..1.0)).collect();
                    let mut out = vec![f32::NAN; n * m];
                    matmul(test_pool(), &w, &x, &mut out, n, m, k);
                    for i in 0..n {
                        for r in 0..m {
                            let wf: Vec<f32> = w[r * k..][..k].iter().map(|&v| to(v)).collect();
                            let (exact, abs) = ref_dot(&wf, &x[i * k..][..k]);
                            let got = out[i * m + r] as f64;
                            assert!(
                                (got - exact).abs() <= 2f64.powi(-15) * abs + 1e-30,
                                "k={k} m={m} n={n} [{i}, {r}]: got {got}, want {exact}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn amx_matmul_matches_reference() {
        if !crate::amx::bf16_available() {
            eprintln!("no AMX-BF16: AMX matmul not testable here");
            return;
        }
        check::<f16>(f16::from_f32, f16::to_f32);
        check::<bf16>(bf16::from_f32, bf16::to_f32);
    }

    #[test]
    fn split_keeps_sixteen_bits() {
        let mut rng = StdRng::seed_from_u64(5);
        for _ in 0..10_000 {
            let x: f32 = rng.random_range(-1e3..1e3);
            let (hi, lo) = split(x);
            let back =
                f32::from_bits((hi as u32) << 16) as f64 + f32::from_bits((lo as u32) << 16) as f64;
            assert!(
                (back - x as f64).abs() <= x.abs() as f64 * 2f64.powi(-16),
                "{x}: {back}"
            );
        }
        // An f16 value splits exactly.
        for i in 0..=u16::MAX {
            let v = f16::from_bits(i).to_f32();
            if v.is_finite() {
                let (hi, lo) = split(v);
                let back = f32::from_bits((hi as u32) << 16) + f32::from_bits((lo as u32) << 16);
                assert_eq!(back, v, "f16 bits {i:#x}");
            }
        }
    }
}
