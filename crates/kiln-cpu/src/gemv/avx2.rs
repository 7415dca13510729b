//! The decode kernels on AVX2 (x86_64 without AVX-512, e.g. AMD Zen 2/3, Intel client
//! cores): the scheme of the AVX-512 ones in 256-bit registers. [`ROWS`] weight rows go
//! through the loop together; what depends only on the activation row (Q8_0 quants
//! widened to i16, Q4_0's offset correction, the activation scales) is prepared once per
//! call; each weight load is paired with a prefetch of the same place [`ROWS`] rows on.
//!
//! Per-row dot products (`crate::dot`), which decode used before on AVX2, redo the
//! activation's share for every row and request a whole row up front.

use super::{by_groups, by_groups_batched, ROWS};
use crate::pool::Pool;
use half::{bf16, f16};
use kiln_core::quant::{BlockQ4K, BlockQ4_0, BlockQ6K, BlockQ8K, BlockQ8_0, QK};
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Blocks whose scales are converted together (one `vcvtph2ps`).
pub(super) const GROUP: usize = 8;

/// One activation block prepared for the weight format `W`.
#[repr(C, align(32))]
#[derive(Clone, Copy)]
pub(crate) struct Prepared {
    /// Q8_0 weights: the 32 quants widened to i16. Q4_0: the 32 quants as i8, then zeros.
    q: [i16; QK],
    /// Q4_0: `−8 · Σ` of the four quants whose products land in each i32 lane (the
    /// unsigned nibbles are `q + 8`). Q8_0: zero.
    corr: [i32; 8],
}

/// A weight block format of 32 quants and one f16 scale.
pub(crate) trait Block: bytemuck::Pod + Sync {
    fn d_bits(&self) -> u16;
    /// `x` laid out for [`Block::dot`].
    fn prepare(x: &BlockQ8_0) -> Prepared;
    /// Exact `Σ w·x` of the block as eight i32 partial sums.
    ///
    /// # Safety
    /// AVX2 must be available.
    #[cfg(target_arch = "x86_64")]
    unsafe fn dot(&self, x: &Prepared) -> __m256i;
}

impl Block for BlockQ8_0 {
    fn d_bits(&self) -> u16 {
        self.d.to_bits()
    }
    fn prepare(x: &BlockQ8_0) -> Prepared {
        Prepared {
            q: x.qs.map(i16::from),
            corr: [0; 8],
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn dot(&self, x: &Prepared) -> __m256i {
        // SAFETY: `qs` is 32 readable bytes and `x.q` 64 (32-byte aligned); the caller
        // enabled AVX2. i16 products summed in pairs cannot overflow i32.
        unsafe {
            let p = self.qs.as_ptr() as *const __m128i;
            let lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(p));
            let hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(p.add(1)));
            let y = x.q.as_ptr() as *const __m256i;
            _mm256_add_epi32(
                _mm256_madd_epi16(lo, _mm256_load_si256(y)),
                _mm256_madd_epi16(hi, _mm256_load_si256(y.add(1))),
            )
        }
    }
}

impl Block for BlockQ4_0 {
    fn d_bits(&self) -> u16 {
        self.d.to_bits()
    }
    fn prepare(x: &BlockQ8_0) -> Prepared {
        let mut p = Prepared {
            q: [0; QK],
            corr: [0; 8],
        };
        bytemuck::cast_slice_mut::<i16, i8>(&mut p.q)[..QK].copy_from_slice(&x.qs);
        for (c, four) in p.corr.iter_mut().zip(x.qs.chunks_exact(4)) {
            *c = -8 * four.iter().map(|&q| q as i32).sum::<i32>();
        }
        p
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn dot(&self, x: &Prepared) -> __m256i {
        // SAFETY: `qs` is 16 readable bytes, `x.q` 64 and `x.corr` 32 (32-byte aligned);
        // the caller enabled AVX2. Nibble e < 16 is element e, the high nibbles 16..32, as
        // in `x.q`; maddubs of 15·127·2 cannot saturate.
        unsafe {
            let v = _mm_loadu_si128(self.qs.as_ptr() as *const __m128i);
            let u = _mm256_and_si256(
                _mm256_set_m128i(_mm_srli_epi16(v, 4), v),
                _mm256_set1_epi8(0x0F),
            );
            let y = _mm256_load_si256(x.q.as_ptr() as *const __m256i);
            let p = _mm256_madd_epi16(_mm256_maddubs_epi16(u, y), _mm256_set1_epi16(1));
            _mm256_add_epi32(p, _mm256_load_si256(x.corr.as_ptr() as *const __m256i))
        }
    }
}

/// The activation row for `W`: each block prepared, and its scale.
pub(super) fn prepare<W: Block>(x: &[BlockQ8_0]) -> (Vec<Prepared>, Vec<f32>) {
    (
        x.iter().map(W::prepare).collect(),
        x.iter().map(|b| b.d.to_f32()).collect(),
    )
}

/// A 16-bit or 32-bit float weight loaded 8 at a time.
pub(crate) trait Float: bytemuck::Pod + Sync {
    fn widen(self) -> f32;
    /// The 8 elements at `p` as f32.
    ///
    /// # Safety
    /// 8 elements must be readable at `p`; the caller must have enabled AVX2 and F16C.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> __m256;
}

impl Float for f32 {
    fn widen(self) -> f32 {
        self
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> __m256 {
        // SAFETY: the caller guarantees 8 readable elements and AVX.
        unsafe { _mm256_loadu_ps(p) }
    }
}

impl Float for f16 {
    fn widen(self) -> f32 {
        self.to_f32()
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const f16) -> __m256 {
        // SAFETY: the caller guarantees 16 readable bytes and F16C.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
    }
}

impl Float for bf16 {
    fn widen(self) -> f32 {
        self.to_f32()
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const bf16) -> __m256 {
        // SAFETY: the caller guarantees 16 readable bytes and AVX2; bf16 is the high half
        // of an f32.
        unsafe {
            let h = _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i));
            _mm256_castsi256_ps(_mm256_slli_epi32(h, 16))
        }
    }
}

/// `out[i, r] = w[r] · x[i]` for Q8_0/Q4_0 `w` of `m` rows of `k / QK` blocks and `n`
/// activation rows (decode, or a prompt: each group of weight rows meets every activation
/// row while in L1); blocks past the last whole group go through `dot`. Requires AVX2,
/// FMA and F16C.
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul_q8<W: Block>(
    pool: &Pool,
    w: &[W],
    x: &[BlockQ8_0],
    out: &mut [f32],
    n: usize,
    m: usize,
    k: usize,
    dot: fn(&[W], &[BlockQ8_0]) -> f32,
) {
    assert!(crate::dot::isa() == crate::dot::Isa::Avx2, "needs AVX2");
    let nb = k / QK;
    assert!(w.len() >= m * nb && x.len() >= n * nb && out.len() >= n * m);
    let (prepared, dx) = prepare::<W>(&x[..n * nb]);
    let tail = nb / GROUP * GROUP;
    let group = |r: [usize; ROWS], i: usize| {
        let rows: [&[W]; ROWS] = r.map(|r| &w[r * nb..][..nb]);
        let (xp, dxi) = (&prepared[i * nb..][..nb], &dx[i * nb..][..nb]);
        let mut sums = rows_q8(rows, xp, dxi);
        if tail < nb {
            for (s, row) in sums.iter_mut().zip(rows) {
                *s += dot(&row[tail..], &x[i * nb + tail..(i + 1) * nb]);
            }
        }
        sums
    };
    if n == 1 {
        by_groups::<ROWS>(pool, out, m, |r| group(r, 0));
    } else {
        by_groups_batched(pool, out, n, m, group);
    }
}

/// [`x86::rows_q8`] behind the ISA check that `matmul_q8` made.
fn rows_q8<W: Block>(rows: [&[W]; ROWS], xp: &[Prepared], dx: &[f32]) -> [f32; ROWS] {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: matmul_q8 asserted an ISA with AVX2, FMA and F16C.
    return unsafe { x86::rows_q8(rows, xp, dx) };
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("AVX2 is x86_64 only: {:p} {xp:p} {dx:p}", rows[0])
}

/// `out[r] = w[r] · x` for float `w` of `m` rows of `x.len()` elements. Requires AVX2,
/// FMA and F16C.
pub(super) fn matvec_float<W: Float>(pool: &Pool, w: &[W], x: &[f32], out: &mut [f32], m: usize) {
    assert!(crate::dot::isa() == crate::dot::Isa::Avx2, "needs AVX2");
    let k = x.len();
    assert!(w.len() >= m * k && out.len() >= m);
    by_groups::<ROWS>(pool, out, m, |r| {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the ISA asserted above has AVX2, FMA and F16C.
        return unsafe { x86::rows_float(r.map(|r| &w[r * k..][..k]), x) };
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("AVX2 is x86_64 only")
    });
}

/// `out[i, r] = w[r] · x[i]` for Q4_K or Q6_K `w` of `m` rows of `nb` blocks and `n`
/// activation rows (as [`matmul_q8`]). Requires AVX2, FMA and F16C.
fn matmul_k<W: Sync>(
    pool: &Pool,
    w: &[W],
    x: &[BlockQ8K],
    out: &mut [f32],
    n: usize,
    m: usize,
    rows_fn: unsafe fn([&[W]; ROWS], &[BlockQ8K]) -> [f32; ROWS],
) {
    assert!(crate::dot::isa() == crate::dot::Isa::Avx2, "needs AVX2");
    let nb = x.len() / n.max(1);
    assert!(w.len() >= m * nb && x.len() == n * nb && out.len() >= n * m);
    let group = |r: [usize; ROWS], i: usize| {
        // SAFETY: the ISA asserted above has AVX2, FMA and F16C, all `rows_fn` needs.
        unsafe { rows_fn(r.map(|r| &w[r * nb..][..nb]), &x[i * nb..][..nb]) }
    };
    if n == 1 {
        by_groups::<ROWS>(pool, out, m, |r| group(r, 0));
    } else {
        by_groups_batched(pool, out, n, m, group);
    }
}

/// Q4_K weights (see [`matmul_k`]).
pub(crate) fn matmul_q4k(
    pool: &Pool,
    w: &[BlockQ4K],
    x: &[BlockQ8K],
    out: &mut [f32],
    n: usize,
    m: usize,
) {
    #[cfg(target_arch = "x86_64")]
    matmul_k(pool, w, x, out, n, m, x86::rows_q4k);
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("AVX2 is x86_64 only: {pool:p} {w:p} {x:p} {out:p} {n} {m}")
}

/// Q6_K weights (see [`matmul_k`]).
pub(crate) fn matmul_q6k(
    pool: &Pool,
    w: &[BlockQ6K],
    x: &[BlockQ8K],
    out: &mut [f32],
    n: usize,
    m: usize,
) {
    #[cfg(target_arch = "x86_64")]
    matmul_k(pool, w, x, out, n, m, x86::rows_q6k);
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("AVX2 is x86_64 only: {pool:p} {w:p} {x:p} {out:p} {n} {m}")
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use crate::dot::k_quants::x86::{f16x2_times, hsum256, q4k_block_avx2, q6k_block_avx2};
    use crate::stream::prefetch;

    /// `Σ` over the first `GROUP · (x.len() / GROUP)` blocks of `w[r] · x` for ROWS rows.
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be available.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn rows_q8<W: Block>(
        w: [&[W]; ROWS],
        x: &[Prepared],
        dx: &[f32],
    ) -> [f32; ROWS] {
        let groups = x.len() / GROUP;
        assert!(w.iter().all(|r| r.len() >= groups * GROUP) && dx.len() >= groups * GROUP);
        // SAFETY: the features are enabled on this function; block indices are below
        // groups·GROUP ≤ every row's length (asserted).
        unsafe {
            let mut acc = [_mm256_setzero_ps(); ROWS];
            for g in 0..groups {
                let dxg = _mm256_loadu_ps(dx.as_ptr().add(GROUP * g));
                // Per row: the GROUP blocks' scales times the activation blocks' scales.
                let mut scale = [[0f32; GROUP]; ROWS];
                for (s, row) in scale.iter_mut().zip(&w) {
                    let b = row.get_unchecked(GROUP * g..GROUP * (g + 1));
                    let bits = _mm_setr_epi16(
                        b[0].d_bits() as i16,
                        b[1].d_bits() as i16,
                        b[2].d_bits() as i16,
                        b[3].d_bits() as i16,
                        b[4].d_bits() as i16,
                        b[5].d_bits() as i16,
                        b[6].d_bits() as i16,
                        b[7].d_bits() as i16,
                    );
                    _mm256_storeu_ps(s.as_mut_ptr(), _mm256_mul_ps(_mm256_cvtph_ps(bits), dxg));
                }
                for (j, xb) in x
                    .get_unchecked(GROUP * g..GROUP * (g + 1))
                    .iter()
                    .enumerate()
                {
                    for (r, row) in w.iter().enumerate() {
                        let blk = row.get_unchecked(GROUP * g + j);
                        // The next group's rows (see the module docs of `gemv`).
                        prefetch((blk as *const W).wrapping_add(ROWS * row.len()));
                        let p = _mm256_cvtepi32_ps(blk.dot(xb));
                        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(scale[r][j]), p, acc[r]);
                    }
                }
            }
            acc.map(|v| hsum256(v))
        }
    }

    /// Elements per step of the float kernel: one 64-byte line of 16-bit weights.
    const STEP: usize = 32;

    /// `w[r] · x` for ROWS float rows of `x.len()` elements, two accumulators per row.
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be available.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn rows_float<W: Float>(w: [&[W]; ROWS], x: &[f32]) -> [f32; ROWS] {
        let k = x.len();
        assert!(w.iter().all(|r| r.len() == k));
        let body = k / STEP * STEP;
        let lines = (STEP * std::mem::size_of::<W>()).div_ceil(64);
        // SAFETY: the features are enabled on this function; every 8-element load starts at
        // i + 8j with i + STEP ≤ body ≤ k = every row's length.
        unsafe {
            let mut acc = [[_mm256_setzero_ps(); 2]; ROWS];
            for i in (0..body).step_by(STEP) {
                for row in &w {
                    let ahead = row.as_ptr().add(i).wrapping_add(ROWS * k) as *const u8;
                    for l in 0..lines {
                        prefetch(ahead.wrapping_add(64 * l));
                    }
                }
                for j in 0..STEP / 8 {
                    let xv = _mm256_loadu_ps(x.as_ptr().add(i + 8 * j));
                    for (r, row) in w.iter().enumerate() {
                        let a = &mut acc[r][j & 1];
                        *a = _mm256_fmadd_ps(W::load8(row.as_ptr().add(i + 8 * j)), xv, *a);
                    }
                }
            }
            let mut sums = acc.map(|[a, b]| hsum256(_mm256_add_ps(a, b)));
            for (s, row) in sums.iter_mut().zip(w) {
                *s += row[body..]
                    .iter()
                    .zip(&x[body..])
                    .map(|(w, x)| w.widen() * x)
                    .sum::<f32>();
            }
            sums
        }
    }

    /// Prefetch every cache line of the block at `p`, [`ROWS`] rows on (`row_len` blocks
    /// per row).
    #[inline(always)]
    fn prefetch_block_ahead<T>(p: *const T, row_len: usize) {
        let ahead = p.wrapping_add(ROWS * row_len) as *const u8;
        for off in (0..std::mem::size_of::<T>()).step_by(64) {
            prefetch(ahead.wrapping_add(off));
        }
    }

    /// `w[r] · x` for ROWS Q4_K rows of `x.len()` blocks: the per-row kernel's block
    /// arithmetic, rows interleaved block by block so the prefetch runs ahead of them all.
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be available.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn rows_q4k(w: [&[BlockQ4K]; ROWS], x: &[BlockQ8K]) -> [f32; ROWS] {
        assert!(w.iter().all(|r| r.len() == x.len()));
        // SAFETY: the features are enabled on this function; block indices are below
        // x.len() = every row's length (asserted).
        unsafe {
            let mut acc = [_mm256_setzero_ps(); ROWS];
            let mut acc_m = [_mm256_setzero_ps(); ROWS];
            for (b, xb) in x.iter().enumerate() {
                for (r, row) in w.iter().enumerate() {
                    let blk = row.get_unchecked(b);
                    prefetch_block_ahead(blk, row.len());
                    let (d, dmin) = f16x2_times(blk.d.to_bits(), blk.dmin.to_bits(), xb.d);
                    let (sumi, mins) = q4k_block_avx2(blk, xb);
                    let mins = _mm256_castps128_ps256(_mm_cvtepi32_ps(mins));
                    acc_m[r] = _mm256_fmadd_ps(_mm256_set1_ps(dmin), mins, acc_m[r]);
                    acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc[r]);
                }
            }
            std::array::from_fn(|r| hsum256(acc[r]) - hsum256(acc_m[r]))
        }
    }

    /// `w[r] · x` for ROWS Q6_K rows of `x.len()` blocks (as [`rows_q4k`]).
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be available.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn rows_q6k(w: [&[BlockQ6K]; ROWS], x: &[BlockQ8K]) -> [f32; ROWS] {
        assert!(w.iter().all(|r| r.len() == x.len()));
        // SAFETY: as in `rows_q4k`.
        unsafe {
            let mut acc = [_mm256_setzero_ps(); ROWS];
            for (b, xb) in x.iter().enumerate() {
                for (r, row) in w.iter().enumerate() {
                    let blk = row.get_unchecked(b);
                    prefetch_block_ahead(blk, row.len());
                    let (d, _) = f16x2_times(blk.d.to_bits(), 0, xb.d);
                    let total = q6k_block_avx2(blk, xb);
                    acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(total), acc[r]);
                }
            }
            acc.map(|v| hsum256(v))
        }
    }
}
