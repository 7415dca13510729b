//! Q4_K prompts on AMX-INT8 tiles (see [`crate::amx`]): `out[n, m] = x · wᵀ` against
//! Q8_K activations, the same sums as [`super`]'s AVX-512 kernel.
//!
//! A tile product adds 16 × 16 dot products of 64 bytes, two Q4_K scale groups. Scaling
//! the integer sums per group would take them out of the tiles every 32 values, so the
//! group scales go into the weights instead, where they are small integers: `sc` (6 bits)
//! `= 16·hi + lo` with `lo` < 16 and `hi` < 4, and `q·lo` ≤ 225 and `q·hi` ≤ 45 still fit
//! in an unsigned byte. Two tiles accumulate `x · (q·lo)` and `x · (q·hi)` over the whole
//! super-block, and `C_lo + 16·C_hi = Σ_g sc_g · (x · q)_g` exactly (|x| ≤ 128, 256
//! terms: below 2^25). The f32 work then happens once per super-block and activation
//! row, in AVX-512: `d · C − dmin · Σ_g m_g · Σx_g`, times the activation's `d`, where the
//! minimums' sum is four `vpdpwssd` of i16 pairs (`m` ≤ 63, `Σx_g` over 32 quants ≤ 4096).
//!
//! Layout: the activations are the A operand, copied once per call into aligned tiles of
//! 16 rows × 64 quants, zero past row n (read in place at a stride of `nb` blocks, the
//! rows straddle cache lines, and the kernel bench ran slower). The weights are the B
//! operand: per 16-row panel, repacked per call into the lane layout of [`super`] (lane r of register j =
//! quants 4j..4j + 4 of row r) times each group's `lo` and `hi`, so that 16 registers
//! are one B tile. C[c][r] is activation row c · weight row r, the orientation of the
//! output.

use crate::kgemm::KRows;
use crate::pool::Pool;
use crate::qgemm::{self, P};
use bytemuck::Zeroable;
use kiln_core::quant::{BlockQ4K, BlockQ8K, QK_K};

/// Activation rows per tile.
const T: usize = 16;
/// Quants per tile row.
const KS: usize = 64;

/// Activation rows from which this kernel is used (fewer would leave most of a tile
/// empty; the AVX-512 kernel takes them).
pub(crate) const MIN_ROWS: usize = T;

/// One super-block of a 16-row weight panel, as B tiles and lane scales.
#[repr(C, align(64))]
#[derive(Clone, Copy, Zeroable)]
struct AmxBlock {
    /// `lo[16·s..16·s + 16]` is the B tile of quants `64·s..64·s + 64`: lane r of `lo[j]`
    /// = quants 4j..4j + 4 of row r, times the low 4 bits of their group's scale.
    lo: [[u8; 64]; QK_K / 4],
    /// The same times the high 2 bits of the scale.
    hi: [[u8; 64]; QK_K / 4],
    d: [f32; P],
    dmin: [f32; P],
    /// For groups 2i and 2i + 1, each row's two minimums as the i16 halves of its lane.
    mins: [[i32; P]; 4],
}

/// An activation block's scale and its sums of 32 quants, as i16 pairs (groups 2i and
/// 2i + 1 in pair i).
#[derive(Clone, Copy, Zeroable)]
struct ActSums {
    d: f32,
    pairs: [i32; 4],
}

/// One A tile: 64 quants of 16 activation rows.
#[repr(C, align(64))]
#[derive(Clone, Copy, Zeroable)]
struct ATile([[i8; KS]; T]);

/// The activations as A tiles, `[(t·nb + b)·4 + s]` for activation rows 16t.., block b and
/// quants 64s..: contiguous and aligned, zero past row n.
fn a_tiles(xq: &[BlockQ8K], n: usize, nb: usize) -> Vec<ATile> {
    let steps = QK_K / KS;
    let mut xa = vec![ATile::zeroed(); n.div_ceil(T) * nb * steps];
    for (i, row) in xq[..n * nb].chunks_exact(nb).enumerate() {
        let (t, c) = (i / T, i % T);
        for (b, block) in row.iter().enumerate() {
            for (s, q) in block.qs.chunks_exact(KS).enumerate() {
                xa[(t * nb + b) * steps + s].0[c].copy_from_slice(q);
            }
        }
    }
    xa
}

/// `out[n, m] = x · wᵀ` for `w` of `m` rows of `k / QK_K` super-blocks and `xq` the Q8_K
/// activations (`n` rows). Requires [`crate::amx::int8_available()`].
pub(crate) fn matmul(
    pool: &Pool,
    w: KRows<'_, BlockQ4K>,
    xq: &[BlockQ8K],
    out: &mut [f32],
    n: usize,
    m: usize,
    k: usize,
) {
    assert!(crate::amx::int8_available(), "AMX-INT8 tiles not available");
    let nb = k / QK_K;
    assert!(xq.len() >= n * nb && out.len() >= n * m);
    w.check(m, k, true);
    if n == 0 || m == 0 {
        return;
    }
    let xa = a_tiles(xq, n, nb);
    let sums: Vec<ActSums> = xq[..n * nb]
        .iter()
        .map(|b| {
            let sum32 = |g: usize| b.bsums[2 * g] as i32 + b.bsums[2 * g + 1] as i32;
            ActSums {
                d: b.d,
                pairs: std::array::from_fn(|i| sum32(2 * i) & 0xffff | sum32(2 * i + 1) << 16),
            }
        })
        .collect();
    qgemm::for_panels(
        pool,
        out,
        n,
        m,
        || vec![AmxBlock::zeroed(); nb],
        |rows, panel| {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `int8_available()` (asserted) implies the AVX-512 features.
            unsafe {
                match &w {
                    KRows::File(w) => x86::repack(w, rows, nb, panel),
                    KRows::Panels(p) => x86::repack_panel(p.panel(rows[0] / P), nb, panel),
                }
            };
            #[cfg(not(target_arch = "x86_64"))]
            let _ = (rows, panel);
        },
        |panel, o| {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `int8_available()` (asserted): AMX granted and AVX-512 present.
            unsafe {
                x86::product(panel, &xa, &sums, nb, o)
            };
            #[cfg(not(target_arch = "x86_64"))]
            let _ = (panel, o, &sums);
        },
    );
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use crate::amx::{x86 as tiles, TileConfig};
    use crate::kgemm::{panel_quants, KBlock, Q4KLanes};
    use std::arch::x86_64::*;

    /// Repack rows `rows` (16 indices into `w`, each a row of `nb` super-blocks) into
    /// `panel`.
    ///
    /// # Safety
    /// AVX-512 F, BW, VL and VNNI, AVX2, FMA and F16C must be available.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn repack(
        w: &[BlockQ4K],
        rows: [usize; P],
        nb: usize,
        panel: &mut [AmxBlock],
    ) {
        let rows: [&[BlockQ4K]; P] = rows.map(|r| &w[r * nb..][..nb]);
        // SAFETY: the features are enabled on this function; memory goes through
        // references.
        unsafe {
            for (b, out) in panel[..nb].iter_mut().enumerate() {
                let blocks: [&BlockQ4K; P] = std::array::from_fn(|r| &rows[r][b]);
                fill(&Q4KLanes::of(&blocks), out, |g, lo| {
                    let mut parts = [_mm256_setzero_si256(); P];
                    for (p, block) in parts.iter_mut().zip(&blocks) {
                        *p = block.unsigned(g);
                    }
                    qgemm::transpose_rows(parts, lo);
                });
            }
        }
    }

    /// Repack panel `panel` of Q4_K panels (`nb` super-blocks a row; rows already one a
    /// lane) into `out`.
    ///
    /// # Safety
    /// AVX-512 F, BW, VL and VNNI, AVX2, FMA and F16C must be available.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn repack_panel(panel: &[u8], nb: usize, out: &mut [AmxBlock]) {
        assert!(panel.len() >= 2304 * nb && out.len() >= nb);
        // SAFETY: the features are enabled on this function; the panel holds nb
        // super-blocks (asserted) and stores go through references.
        unsafe {
            for (b, out) in out[..nb].iter_mut().enumerate() {
                fill(&Q4KLanes::of_panel(panel, nb, b), out, |g, lo| {
                    for (t, reg) in lo.iter_mut().enumerate() {
                        let v = panel_quants(panel, nb, b, 8 * g + t);
                        _mm512_storeu_si512(reg.as_mut_ptr() as *mut _, v);
                    }
                });
            }
        }
    }

    /// One super-block of `out` from its scales `s` and `quants(g, lo)`, which stores the
    /// unsigned quants of group g (32 of each row) into the 8 registers `lo` (lane r of
    /// register t = quants `32g + 4t..` of row r).
    ///
    /// # Safety
    /// AVX-512 F and BW must be available.
    #[inline(always)]
    unsafe fn fill(
        s: &Q4KLanes,
        out: &mut AmxBlock,
        mut quants: impl FnMut(usize, &mut [[u8; 64]; 8]),
    ) {
        // SAFETY: the caller enabled the features; memory goes through references.
        unsafe {
            _mm512_storeu_ps(out.d.as_mut_ptr(), s.d);
            _mm512_storeu_ps(out.dmin.as_mut_ptr(), s.dmin);
            for (i, mins) in out.mins.iter_mut().enumerate() {
                let pair = _mm512_or_si512(s.mn[2 * i], _mm512_slli_epi32(s.mn[2 * i + 1], 16));
                _mm512_storeu_si512(mins.as_mut_ptr() as *mut _, pair);
            }
            for g in 0..8 {
                let lo: &mut [[u8; 64]; 8] = (&mut out.lo[8 * g..8 * g + 8])
                    .try_into()
                    .expect("8 registers");
                quants(g, lo);
                // Each 16-bit lane holds two quants of one row, so one 16-bit multiply
                // by the digit in both halves scales both; no product carries into
                // the other byte (≤ 225).
                let both = |v: __m512i| _mm512_or_si512(v, _mm512_slli_epi32(v, 16));
                let slo = both(_mm512_and_si512(s.sc[g], _mm512_set1_epi32(15)));
                let shi = both(_mm512_srli_epi32(s.sc[g], 4));
                for j in 8 * g..8 * g + 8 {
                    let q = _mm512_load_si512(out.lo[j].as_ptr() as *const _);
                    let hi = _mm512_mullo_epi16(q, shi);
                    _mm512_store_si512(out.hi[j].as_mut_ptr() as *mut _, hi);
                    let lo = _mm512_mullo_epi16(q, slo);
                    _mm512_store_si512(out.lo[j].as_mut_ptr() as *mut _, lo);
                }
            }
        }
    }

    /// Add tile `t`'s super-block `b` into `o`: `c` holds its stored `C_lo` and `C_hi`.
    ///
    /// # Safety
    /// AVX-512 F, BW and VNNI must be available; `sums` covers the rows of `o` (checked
    /// by [`product`]).
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn scale_into(
        c: &[[[i32; P]; T]; 2],
        pb: &AmxBlock,
        sums: &[ActSums],
        nb: usize,
        b: usize,
        t: usize,
        o: &mut [[f32; P]],
    ) {
        // SAFETY: the caller enabled the features; rows `i` < o.len() and their blocks
        // exist in `sums` (checked by `product`).
        unsafe {
            let d = _mm512_loadu_ps(pb.d.as_ptr());
            let dmin = _mm512_loadu_ps(pb.dmin.as_ptr());
            let mins: [__m512i; 4] =
                std::array::from_fn(|i| _mm512_loadu_si512(pb.mins[i].as_ptr() as *const _));
            let rows = T.min(o.len() - T * t);
            for (cc, (lo, hi)) in c[0].iter().zip(&c[1]).enumerate().take(rows) {
                let i = T * t + cc;
                let s = sums.get_unchecked(i * nb + b);
                let v = _mm512_add_epi32(
                    _mm512_loadu_si512(lo.as_ptr() as *const _),
                    _mm512_slli_epi32(_mm512_loadu_si512(hi.as_ptr() as *const _), 4),
                );
                let mut mn = _mm512_setzero_si512();
                for (p, &pair) in s.pairs.iter().enumerate() {
                    mn = _mm512_dpwssd_epi32(mn, mins[p], _mm512_set1_epi32(pair));
                }
                let f = _mm512_fnmadd_ps(
                    dmin,
                    _mm512_cvtepi32_ps(mn),
                    _mm512_mul_ps(d, _mm512_cvtepi32_ps(v)),
                );
                let o = o.get_unchecked_mut(i);
                let acc = _mm512_fmadd_ps(f, _mm512_set1_ps(s.d), _mm512_loadu_ps(o.as_ptr()));
                _mm512_storeu_ps(o.as_mut_ptr(), acc);
            }
        }
    }

    /// `o[c][r]` = activation row c · panel row r for all `o.len()` activation rows, whose
    /// quants `xa` holds as A tiles. Super-block by super-block, so that its 8 KiB of
    /// B tiles stay in L1 while every activation tile passes over them; two activation
    /// tiles per pass share each loaded B tile.
    ///
    /// # Safety
    /// [`crate::amx::int8_available`] must hold (it implies the AVX-512 features enabled
    /// here).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn product(
        panel: &[AmxBlock],
        xa: &[ATile],
        sums: &[ActSums],
        nb: usize,
        o: &mut [[f32; P]],
    ) {
        let n = o.len();
        let tiles = n.div_ceil(T);
        let steps = QK_K / KS;
        assert!(panel.len() >= nb && xa.len() >= tiles * nb * steps && sums.len() >= n * nb);
        o.fill([0.0; P]);
        let a = |t: usize, b: usize, s: usize| xa[(t * nb + b) * steps + s].0.as_ptr() as *const u8;
        let mut c = [[[[0i32; P]; T]; 2]; 2];
        // SAFETY: AMX-INT8 is available and granted (caller) and configured here for all
        // eight tiles (16 rows of 64 bytes); A and B tiles are 16 × 64 contiguous bytes,
        // an `ATile` of `xa` (bounds-checked index) or inside `panel[b]`; stores go to `c`.
        unsafe {
            tiles::configure(&TileConfig::new(&[(T, 64); 8]));
            for (b, pb) in panel[..nb].iter().enumerate() {
                for t0 in (0..tiles).step_by(2) {
                    let pair = t0 + 1 < tiles;
                    tiles::zero::<0>();
                    tiles::zero::<1>();
                    tiles::zero::<2>();
                    tiles::zero::<3>();
                    for s in 0..QK_K / KS {
                        tiles::load::<4>(pb.lo[16 * s].as_ptr(), 64);
                        tiles::load::<5>(pb.hi[16 * s].as_ptr(), 64);
                        tiles::load::<6>(a(t0, b, s), KS);
                        tiles::dot_s8u8::<0, 6, 4>();
                        tiles::dot_s8u8::<1, 6, 5>();
                        if pair {
                            tiles::load::<7>(a(t0 + 1, b, s), KS);
                            tiles::dot_s8u8::<2, 7, 4>();
                            tiles::dot_s8u8::<3, 7, 5>();
                        }
                    }
                    tiles::store::<0, i32>(&mut c[0][0]);
                    tiles::store::<1, i32>(&mut c[0][1]);
                    scale_into(&c[0], pb, sums, nb, b, t0, o);
                    if pair {
                        tiles::store::<2, i32>(&mut c[1][0]);
                        tiles::store::<3, i32>(&mut c[1][1]);
                        scale_into(&c[1], pb, sums, nb, b, t0 + 1, o);
                    }
                }
            }
            tiles::release();
        }
    }
}
