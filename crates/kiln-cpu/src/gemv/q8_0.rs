//! Q8_0 and Q4_0 weights against one Q8_0 activation row.
//!
//! The per-row dot kernels in [`crate::dot`] redo, for every weight row, work that depends
//! only on `x`: loading and pairing its blocks, the second `vpdpbusd` that removes the
//! unsigned offset, and converting its scales. Here that is done once per call
//! ([`PreparedPair`]), and [`ROWS`] weight rows go through the loop together, so each
//! loaded pair of activation blocks serves all of them. Per row and pair of blocks what is
//! left is unpacking the weights ([`PairBlock::pair`]), one `vpdpbusd` that starts from
//! the offset correction, one permute that spreads the two blocks' scales over their
//! lanes, and one FMA. The scales themselves are fetched 16 blocks at a time with one
//! gather and multiplied by the activation scales in one go, rather than broadcast
//! pair by pair (which took more instructions than the dot product).

use super::{available, avx2, by_groups, ROWS};
use crate::pool::Pool;
use crate::qgemm::WeightBlock;
use crate::stream::Plan;
use kiln_core::quant::{BlockQ4_0, BlockQ8_0, QK};

/// Blocks whose scales one gather fetches.
const GROUP: usize = 16;

/// A weight block format the kernel unpacks two blocks at a time.
pub(crate) trait PairBlock: WeightBlock {
    /// A quant takes a whole byte (Q8_0), not a nibble: twice the bytes for the same work,
    /// so these rows are bound by memory and go one at a time where the CPU's [`Plan`]
    /// says so.
    const BYTE_QUANTS: bool;
    /// The 64 quants of `a` then `b` as unsigned bytes (`q + OFFSET`), byte `e` holding
    /// element [`Self::element`]`(e)` of the pair (b's elements are 32..64).
    #[cfg(target_arch = "x86_64")]
    unsafe fn pair(a: &Self, b: &Self) -> std::arch::x86_64::__m512i;
    /// Which element of the pair byte `e` of [`Self::pair`] holds.
    fn element(e: usize) -> usize;
}

impl PairBlock for BlockQ8_0 {
    const BYTE_QUANTS: bool = true;
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn pair(a: &Self, b: &Self) -> std::arch::x86_64::__m512i {
        use std::arch::x86_64::*;
        // SAFETY: 32 readable bytes in each `qs`; the caller enabled AVX-512 F. `q ^ 0x80`
        // read as u8 is `q + 128`.
        unsafe {
            let v = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_loadu_si256(a.qs.as_ptr() as *const _)),
                _mm256_loadu_si256(b.qs.as_ptr() as *const _),
                1,
            );
            _mm512_xor_si512(v, _mm512_set1_epi8(-128))
        }
    }
    fn element(e: usize) -> usize {
        e
    }
}

impl PairBlock for BlockQ4_0 {
    const BYTE_QUANTS: bool = false;
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn pair(a: &Self, b: &Self) -> std::arch::x86_64::__m512i {
        use std::arch::x86_64::*;
        // SAFETY: 16 readable bytes in each `qs`; the caller enabled AVX-512 F. Low
        // nibbles are elements 0..16 of a block, high nibbles 16..32.
        unsafe {
            let v = _mm256_set_m128i(
                _mm_loadu_si128(b.qs.as_ptr() as *const _),
                _mm_loadu_si128(a.qs.as_ptr() as *const _),
            );
            let both = _mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1);
            _mm512_and_si512(both, _mm512_set1_epi8(0x0F))
        }
    }
    fn element(e: usize) -> usize {
        // Bytes: a low nibbles, b low, a high, b high.
        match e / 16 {
            0 => e,
            1 => 32 + (e - 16),
            2 => 16 + (e - 32),
            _ => e,
        }
    }
}

/// One pair of activation blocks, laid out for the kernel.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct PreparedPair {
    /// The two blocks' quants in [`PairBlock::element`] order.
    q: [i8; 2 * QK],
    /// `−OFFSET · Σx` of each block in one lane that belongs to it (the unsigned form of
    /// the weights adds OFFSET to every quant).
    corr: [i32; 16],
}

/// The activation row, prepared once for every weight row: pairs, and each block's scale.
fn prepare<W: PairBlock>(x: &[BlockQ8_0]) -> (Vec<PreparedPair>, Vec<f32>) {
    let pairs = x
        .chunks_exact(2)
        .map(|xb| {
            let mut p = PreparedPair {
                q: [0; 2 * QK],
                corr: [0; 16],
            };
            for (e, q) in p.q.iter_mut().enumerate() {
                let el = W::element(e);
                *q = xb[el / QK].qs[el % QK];
            }
            for (h, b) in xb.iter().enumerate() {
                let lane = (0..16)
                    .find(|&l| W::element(4 * l) / QK == h)
                    .expect("a lane per block");
                p.corr[lane] = -W::OFFSET * b.qs.iter().map(|&q| q as i32).sum::<i32>();
            }
            p
        })
        .collect();
    (pairs, x.iter().map(|b| b.d.to_f32()).collect())
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use std::arch::x86_64::*;

    /// `Σ` over the first `GROUP · (pairs.len() / (GROUP/2))` blocks of `w[r] · x` for R
    /// rows. With more than one row, each load is paired with a prefetch of the next
    /// group's rows; one row alone is a sequential stream, prefetched
    /// [`crate::stream::ahead`] bytes on (left to the hardware prefetcher when that is 0).
    ///
    /// # Safety
    /// AVX-512 F, BW, VL and VNNI, AVX2, FMA and F16C must be available.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn rows<W: PairBlock, const R: usize>(
        w: [&[W]; R],
        pairs: &[PreparedPair],
        dx: &[f32],
    ) -> [f32; R] {
        let groups = pairs.len() / (GROUP / 2);
        assert!(w.iter().all(|r| r.len() >= groups * GROUP) && dx.len() >= groups * GROUP);
        // Lane l of pair p's products belongs to block 2p + (which half of the pair the
        // element at byte 4l is in): the permute index of its scale within the group.
        let index: [__m512i; GROUP / 2] = std::array::from_fn(|p| {
            let lanes: [i32; 16] = std::array::from_fn(|l| (2 * p + W::element(4 * l) / QK) as i32);
            // SAFETY: AVX-512 F is enabled on this function; `lanes` is 64 bytes.
            unsafe { _mm512_loadu_si512(lanes.as_ptr() as *const _) }
        });
        // SAFETY: the features are enabled on this function; block indices are below
        // groups·GROUP ≤ every row's length (asserted); the gather reads the 4 bytes at the
        // start of each of 16 blocks of a row (its f16 scale and the next 2 bytes).
        unsafe {
            let size = std::mem::size_of::<W>() as i32;
            let offsets = _mm512_mullo_epi32(
                _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                _mm512_set1_epi32(size),
            );
            let mut acc = [_mm512_setzero_ps(); R];
            let ahead = crate::stream::ahead(crate::stream::Stream::Q8);
            for g in 0..groups {
                let dxg = _mm512_loadu_ps(dx.as_ptr().add(GROUP * g));
                // Per row: the 16 blocks' scales times the activation blocks' scales.
                let scale: [__m512; R] = std::array::from_fn(|r| {
                    let base = w[r].as_ptr().add(GROUP * g) as *const i32;
                    let bits = _mm512_i32gather_epi32::<1>(offsets, base);
                    _mm512_mul_ps(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(bits)), dxg)
                });
                for (j, idx) in index.iter().enumerate() {
                    let p = (GROUP / 2) * g + j;
                    let xp = pairs.get_unchecked(p);
                    let xv = _mm512_load_si512(xp.q.as_ptr() as *const _);
                    let init = _mm512_load_si512(xp.corr.as_ptr() as *const _);
                    for (r, row) in w.iter().enumerate() {
                        let (a, b) = (row.get_unchecked(2 * p), row.get_unchecked(2 * p + 1));
                        if R > 1 {
                            // The next group's rows (see the module docs of `gemv`).
                            crate::stream::prefetch((a as *const W).wrapping_add(R * row.len()));
                        } else if ahead > 0 {
                            // A pair of blocks is 68 bytes: two requests cover its lines.
                            let on = (a as *const W as *const u8).wrapping_add(ahead);
                            crate::stream::prefetch(on);
                            crate::stream::prefetch(on.wrapping_add(64));
                        }
                        let ia = _mm512_dpbusd_epi32(init, W::pair(a, b), xv);
                        let s = _mm512_permutexvar_ps(*idx, scale[r]);
                        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia), s, acc[r]);
                    }
                }
            }
            acc.map(|v| _mm512_reduce_add_ps(v))
        }
    }
}

/// `out[r] = w[r] · x` for `w` of `m` rows of `k / QK` blocks. Requires [`super::supported`]
/// (on AVX2 the kernels of [`avx2`] run).
pub(crate) fn matvec<W: PairBlock + avx2::Block>(
    pool: &Pool,
    w: &[W],
    x: &[BlockQ8_0],
    out: &mut [f32],
    m: usize,
    k: usize,
    dot: fn(&[W], &[BlockQ8_0]) -> f32,
) {
    if crate::dot::isa() == crate::dot::Isa::Avx2 {
        return avx2::matmul_q8(pool, w, x, out, 1, m, k, dot);
    }
    // Q4_0 keeps four rows even there: it is bound by unpacking nibbles, not by memory,
    // and sharing each activation load among four rows pays (measured 33 against 31 t/s).
    if W::BYTE_QUANTS && Plan::get().one_row {
        matvec_rows::<W, 1>(pool, w, x, out, m, k, dot)
    } else {
        matvec_rows::<W, ROWS>(pool, w, x, out, m, k, dot)
    }
}

/// [`matvec`], `R` weight rows at a time. Requires [`available()`].
pub(crate) fn matvec_rows<W: PairBlock, const R: usize>(
    pool: &Pool,
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
    let (pairs, dx) = prepare::<W>(&x[..nb]);
    // Blocks past the last whole group go through the per-row kernel.
    let tail = nb / GROUP * GROUP;
    let group = |r: [usize; R]| {
        let rows: [&[W]; R] = r.map(|r| &w[r * nb..][..nb]);
        // SAFETY: `available()` was asserted above.
        let mut sums = unsafe { group_sums(rows, &pairs, &dx) };
        if tail < nb {
            for (s, row) in sums.iter_mut().zip(rows) {
                *s += dot(&row[tail..], &x[tail..nb]);
            }
        }
        sums
    };
    by_groups(pool, out, m, group);
}

/// The whole groups of `rows` · x (see [`x86::rows`]).
///
/// # Safety
/// [`available()`] must hold.
unsafe fn group_sums<W: PairBlock, const R: usize>(
    rows: [&[W]; R],
    pairs: &[PreparedPair],
    dx: &[f32],
) -> [f32; R] {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `available()` (the caller's guarantee) means AVX-512 F/BW/VL/VNNI, AVX2,
    // FMA and F16C were detected.
    return unsafe { x86::rows(rows, pairs, dx) };
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (rows, pairs, dx);
        unreachable!("available() is false off x86_64")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dot;
    use crate::dot::test_util::{ref_dot, test_pool};
    use crate::gemv::supported;
    use kiln_core::quant::{as_blocks, dequantize_to_vec, quantize};
    use kiln_core::DType;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn check<W: PairBlock + avx2::Block>(dtype: DType, dot: fn(&[W], &[BlockQ8_0]) -> f32) {
        let mut rng = StdRng::seed_from_u64(0x6e3f);
        // k: one block, a pair, under a group, a group and a ragged tail, many groups.
        for &k in &[32usize, 64, 96, 512 + 96, 2048] {
            for &m in &[1usize, 5, 130, 1000] {
                let wv: Vec<f32> = (0..m * k).map(|_| rng.random_range(-2.0..2.0)).collect();
                let xv: Vec<f32> = (0..k).map(|_| rng.random_range(-1.0..1.0)).collect();
                let wbytes = quantize(dtype, &wv).unwrap();
                let w = as_blocks::<W>(&wbytes).unwrap().into_owned();
                let xbytes = quantize(DType::Q8_0, &xv).unwrap();
                let x = as_blocks::<BlockQ8_0>(&xbytes).unwrap().into_owned();
                let wf = dequantize_to_vec(dtype, &wbytes, m * k).unwrap();
                let xf = dequantize_to_vec(DType::Q8_0, &xbytes, k).unwrap();
                // As this CPU's plan chooses, and with one and four rows a pass.
                let mut outs = vec![vec![f32::NAN; m]; 3];
                matvec(test_pool(), &w, &x, &mut outs[0], m, k, dot);
                if available() {
                    matvec_rows::<W, 1>(test_pool(), &w, &x, &mut outs[1], m, k, dot);
                    matvec_rows::<W, ROWS>(test_pool(), &w, &x, &mut outs[2], m, k, dot);
                } else {
                    outs.truncate(1);
                }
                let nb = k / QK;
                for (o, out) in outs.iter().enumerate() {
                    for r in 0..m {
                        let want = dot(&w[r * nb..][..nb], &x);
                        let (_, abs) = ref_dot(&wf[r * k..][..k], &xf);
                        let err = (out[r] - want).abs() as f64;
                        assert!(
                            err <= 1e-5 * abs.max(want.abs() as f64) + 1e-30,
                            "{dtype} k={k} m={m} row {r} (run {o}): got {}, want {want}",
                            out[r]
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn matvec_matches_dot_q8_0() {
        if !supported() {
            eprintln!("no AVX2 or AVX-512 VNNI: matvec kernel not testable here");
            return;
        }
        check::<BlockQ8_0>(DType::Q8_0, dot::dot_q8_0);
    }

    #[test]
    fn matvec_matches_dot_q4_0() {
        if !supported() {
            eprintln!("no AVX2 or AVX-512 VNNI: matvec kernel not testable here");
            return;
        }
        check::<BlockQ4_0>(DType::Q4_0, dot::dot_q4_0);
    }
}
