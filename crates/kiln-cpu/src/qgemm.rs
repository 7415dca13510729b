//! Batched (prefill) matmul for Q8_0 and Q4_0 weights against Q8_0 activations on
//! AVX-512 VNNI: `out[n, m] = x[n, k] · w[m, k]ᵀ` with n ≥ [`MIN_ROWS`]. (Q4_0 comes here
//! only in the file's layout: by default it is in [`crate::panels`], stored in the
//! transposed form this kernel repacks into, and read by their own tile.)
//!
//! The per-row dot kernels in [`crate::dot`] re-unpack every weight block and reduce
//! horizontally once per (weight row, activation row). Here weights are handled in panels
//! of [`P`] = 16 rows, one row per i32 lane of a zmm register:
//!
//! - Each panel is repacked once (per matmul call) into unsigned bytes: for every k block,
//!   8 zmm registers where lane `r` of register `j` holds quants `4j..4j+4` of row `r`
//!   (offset to be unsigned, see below), plus the 16 row scales as f32. Repacking costs
//!   O(16·k) and is reused by all n activation rows.
//! - A register tile is the panel's 16 rows × [`C`] = 8 activation rows. Per k block and
//!   per 4 quants, one weight register is multiplied with each activation row's 4 quants
//!   broadcast to all lanes (`vpdpbusd` with a 32-bit memory broadcast): 64 MACs per
//!   instruction, all useful, with no horizontal reduction at all — lane r ends the block
//!   holding the exact integer dot of row r with that activation block.
//! - `dpbusd` multiplies unsigned by signed bytes, so weights are offset to be unsigned
//!   (Q4_0 nibbles are already 0..=15 = q + 8; Q8_0 gets `q ^ 0x80` = q + 128) and the
//!   error `offset · Σx` is removed exactly by starting the integer accumulator at
//!   `−offset · Σx` (precomputed per activation block).
//! - After each block the 8 integer sums are converted, scaled by `d_w` (per lane) and
//!   `d_x` (broadcast), and added into 8 f32 accumulators.
//!
//! Registers: 8 i32 + 8 f32 accumulators, one weight register and a scale: well inside
//! the 32 zmm. Per block and tile that is 64 `vpdpbusd` for 24 conversion/scale ops.

use crate::dot::{self, Isa};
use crate::pool::Pool;
use kiln_core::quant::{BlockQ4_0, BlockQ8_0, QK};

/// Activation rows from which the batched path is used (fewer go through `dot`).
pub(crate) const MIN_ROWS: usize = 4;

/// Weight rows per panel: one per i32 lane of a zmm register.
pub(crate) const P: usize = 16;
/// Activation rows per register tile.
pub(crate) const C: usize = 8;

/// Whether this CPU can run the batched kernels.
pub(crate) fn available() -> bool {
    dot::isa() == Isa::Avx512Vnni
}

/// One k block of a 16-row weight panel, transposed for the kernel.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub(crate) struct PanelBlock {
    /// `q[j]` lane `r` (bytes `4r..4r+4`) = unsigned quants `4j..4j+4` of row `r`.
    q: [[u8; 64]; 8],
    /// Row scales.
    d: [f32; 16],
}

const PANEL_ZERO: PanelBlock = PanelBlock {
    q: [[0; 64]; 8],
    d: [0.0; 16],
};

/// A weight block type the kernel can consume.
pub(crate) trait WeightBlock: bytemuck::Pod + Sync {
    /// What the unsigned form adds to each quant.
    const OFFSET: i32;
    fn d_bits(&self) -> u16;
    /// The block's 32 quants as unsigned bytes (`q + OFFSET`), in element order.
    #[cfg(target_arch = "x86_64")]
    unsafe fn unsigned(&self) -> std::arch::x86_64::__m256i;
}

impl WeightBlock for BlockQ8_0 {
    const OFFSET: i32 = 128;
    #[inline(always)]
    fn d_bits(&self) -> u16 {
        self.d.to_bits()
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn unsigned(&self) -> std::arch::x86_64::__m256i {
        use std::arch::x86_64::*;
        // SAFETY: `qs` is 32 readable bytes (unaligned load); the caller enabled AVX2.
        // `q ^ 0x80` read as u8 is `q + 128`.
        unsafe {
            let v = _mm256_loadu_si256(self.qs.as_ptr() as *const __m256i);
            _mm256_xor_si256(v, _mm256_set1_epi8(-128))
        }
    }
}

impl WeightBlock for BlockQ4_0 {
    const OFFSET: i32 = 8;
    #[inline(always)]
    fn d_bits(&self) -> u16 {
        self.d.to_bits()
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn unsigned(&self) -> std::arch::x86_64::__m256i {
        use std::arch::x86_64::*;
        // SAFETY: `qs` is 16 readable bytes (unaligned load); the caller enabled AVX2.
        // Element e < 16 is the low nibble of byte e, element e + 16 the high nibble.
        unsafe {
            let v = _mm_loadu_si128(self.qs.as_ptr() as *const __m128i);
            let both = _mm256_set_m128i(_mm_srli_epi16(v, 4), v);
            _mm256_and_si256(both, _mm256_set1_epi8(0x0F))
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) use x86::transpose_rows;

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use std::arch::x86_64::*;

    /// Transpose 16 rows of 32 bytes into 8 registers: lane `r` (bytes `4r..4r+4`) of
    /// `out[j]` = bytes `4j..4j+4` of row `r`. In-register shuffles, not gathers.
    ///
    /// # Safety
    /// AVX-512 F, BW, VL and VNNI, AVX2, FMA and F16C must be available.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(crate) unsafe fn transpose_rows(r: [__m256i; P], out: &mut [[u8; 64]; 8]) {
        // SAFETY: the features are enabled on this function; stores go through references.
        unsafe {
            // Qword indices picking 128-bit lanes (a0, b0, a2, b2) and (a1, b1, a3, b3).
            let lo = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
            let hi = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
            // z[i]: row i in the low 256 bits, row i + 8 in the high 256 bits.
            let z: [__m512i; 8] = std::array::from_fn(|i| {
                _mm512_inserti64x4(_mm512_castsi256_si512(r[i]), r[i + 8], 1)
            });
            // Classic 8 × 8 dword transpose, applied to both 256-bit halves at once.
            let t: [__m512i; 8] = std::array::from_fn(|i| {
                let (x, y) = (z[i / 2 * 2], z[i / 2 * 2 + 1]);
                if i % 2 == 0 {
                    _mm512_unpacklo_epi32(x, y)
                } else {
                    _mm512_unpackhi_epi32(x, y)
                }
            });
            // u[g·4 + c], c < 4: per 128-bit lane, column c (lanes 0, 2) or c + 4
            // (lanes 1, 3) of rows 4g..4g+4 (lanes 0, 1) and 8 + 4g.. (lanes 2, 3).
            let u: [__m512i; 8] = std::array::from_fn(|i| {
                let (g, c) = (i / 4, i % 4);
                let (x, y) = (t[g * 4 + c / 2], t[g * 4 + 2 + c / 2]);
                if c % 2 == 0 {
                    _mm512_unpacklo_epi64(x, y)
                } else {
                    _mm512_unpackhi_epi64(x, y)
                }
            });
            for (j, o) in out.iter_mut().enumerate() {
                let idx = if j < 4 { lo } else { hi };
                let v = _mm512_permutex2var_epi64(u[j % 4], idx, u[4 + j % 4]);
                _mm512_storeu_si512(o.as_mut_ptr() as *mut _, v);
            }
        }
    }

    /// Repack rows `rows` (16 indices into `w`, each a row of `nb` blocks) into `panel`:
    /// per block a 16 × 8 transpose of dwords (row r's quants 4j..4j+4 go to lane r of
    /// `q[j]`).
    ///
    /// # Safety
    /// AVX-512 F, BW, VL and VNNI, AVX2, FMA and F16C must be available.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn repack<W: WeightBlock>(
        w: &[W],
        rows: [usize; P],
        nb: usize,
        panel: &mut [PanelBlock],
    ) {
        let rows: [&[W]; P] = rows.map(|r| &w[r * nb..][..nb]);
        // SAFETY: the features are enabled on this function; all memory is accessed
        // through references.
        unsafe {
            for (b, out) in panel[..nb].iter_mut().enumerate() {
                let mut parts = [_mm256_setzero_si256(); P];
                for (p, row) in parts.iter_mut().zip(&rows) {
                    *p = row[b].unsigned();
                }
                transpose_rows(parts, &mut out.q);
                let d: [u16; P] = std::array::from_fn(|i| rows[i][b].d_bits());
                let d = _mm512_cvtph_ps(_mm256_loadu_si256(d.as_ptr() as *const __m256i));
                _mm512_storeu_ps(out.d.as_mut_ptr(), d);
            }
        }
    }

    /// The tile `panel · x[c]ᵀ` for the C activation rows `x` (each `nb` blocks, with
    /// their corrections `corr` and f32 scales `dx`): lane r of result c is row r · x[c].
    ///
    /// # Safety
    /// AVX-512 F, BW, VL and VNNI, AVX2, FMA and F16C must be available.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn tile(
        panel: &[PanelBlock],
        x: [&[BlockQ8_0]; C],
        corr: [&[i32]; C],
        dx: [&[f32]; C],
        nb: usize,
    ) -> [[f32; P]; C] {
        assert!(panel.len() >= nb);
        assert!((0..C).all(|c| x[c].len() >= nb && corr[c].len() >= nb && dx[c].len() >= nb));
        // SAFETY: the features are enabled on this function; every index is < nb, which
        // all slices cover (asserted), and each 4-byte read lies inside a 32-byte `qs`.
        unsafe {
            let mut acc = [_mm512_setzero_ps(); C];
            for b in 0..nb {
                let pb = panel.get_unchecked(b);
                let mut ia: [__m512i; C] =
                    std::array::from_fn(|c| _mm512_set1_epi32(*corr[c].get_unchecked(b)));
                for j in 0..8 {
                    let wv = _mm512_loadu_si512(pb.q[j].as_ptr() as *const _);
                    for c in 0..C {
                        let xp = x[c].get_unchecked(b).qs.as_ptr().add(4 * j) as *const i32;
                        let xv = _mm512_set1_epi32(xp.read_unaligned());
                        ia[c] = _mm512_dpbusd_epi32(ia[c], wv, xv);
                    }
                }
                let dw = _mm512_loadu_ps(pb.d.as_ptr());
                for c in 0..C {
                    let s = _mm512_mul_ps(_mm512_cvtepi32_ps(ia[c]), dw);
                    acc[c] = _mm512_fmadd_ps(s, _mm512_set1_ps(*dx[c].get_unchecked(b)), acc[c]);
                }
            }
            acc.map(|v| {
                let mut o = [0f32; P];
                _mm512_storeu_ps(o.as_mut_ptr(), v);
                o
            })
        }
    }
}

/// `out[n, m] = x · wᵀ` for `w` of `m` rows of `k / QK` blocks and `xq` the Q8_0
/// activations (`n` rows). Requires [`available()`].
pub(crate) fn matmul<W: WeightBlock>(
    pool: &Pool,
    w: &[W],
    xq: &[BlockQ8_0],
    out: &mut [f32],
    n: usize,
    m: usize,
    k: usize,
) {
    assert!(available(), "batched matmul needs AVX-512 VNNI");
    let nb = k / QK;
    assert!(w.len() >= m * nb && xq.len() >= n * nb && out.len() >= n * m);
    // Per activation block: the exactness correction and the scale as f32.
    let corr: Vec<i32> = xq[..n * nb]
        .iter()
        .map(|b| -W::OFFSET * b.qs.iter().map(|&q| q as i32).sum::<i32>())
        .collect();
    let dx: Vec<f32> = xq[..n * nb].iter().map(|b| b.d.to_f32()).collect();
    run_panels(
        pool,
        out,
        n,
        m,
        || vec![PANEL_ZERO; nb],
        |rows, panel| {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `available()` (asserted above) means AVX-512 F/BW/VL/VNNI, AVX2,
            // FMA and F16C were detected.
            unsafe {
                x86::repack(w, rows, nb, panel)
            };
            #[cfg(not(target_arch = "x86_64"))]
            let _ = (rows, panel);
        },
        |panel, cols| {
            let x = cols.map(|c| &xq[c * nb..][..nb]);
            let cr = cols.map(|c| &corr[c * nb..][..nb]);
            let ds = cols.map(|c| &dx[c * nb..][..nb]);
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            return unsafe { x86::tile(panel, x, cr, ds, nb) };
            #[cfg(not(target_arch = "x86_64"))]
            {
                let _ = (x, cr, ds, panel);
                unreachable!("checked by available()")
            }
        },
    );
}

/// The driver of the panel kernels (this one and [`crate::kgemm`]): weight rows in panels
/// of [`P`], each repacked once per task into a scratch from `scratch` by `repack`, then
/// multiplied by `tile` with every group of [`C`] activation rows; `out[n, m]` is
/// assembled from the panels' results. A ragged last panel or group repeats its last row;
/// the repeats are not stored.
pub(crate) fn run_panels<B: Send>(
    pool: &Pool,
    out: &mut [f32],
    n: usize,
    m: usize,
    scratch: impl Fn() -> Vec<B> + Sync + Send,
    repack: impl Fn([usize; P], &mut [B]) + Sync,
    tile: impl Fn(&[B], [usize; C]) -> [[f32; P]; C] + Sync,
) {
    for_panels(pool, out, n, m, scratch, repack, |panel, o| {
        for ct in (0..n).step_by(C) {
            let res = tile(panel, std::array::from_fn(|j| (ct + j).min(n - 1)));
            o[ct..].iter_mut().zip(&res).for_each(|(o, v)| *o = *v);
        }
    });
}

/// [`run_panels`] where one call of `product` computes a repacked panel's products with
/// all `n` activation rows: `o[c][r]` = activation row c · the panel's row r.
pub(crate) fn for_panels<B: Send>(
    pool: &Pool,
    out: &mut [f32],
    n: usize,
    m: usize,
    scratch: impl Fn() -> Vec<B> + Sync,
    repack: impl Fn([usize; P], &mut [B]) + Sync,
    product: impl Fn(&[B], &mut [[f32; P]]) + Sync,
) {
    let panels = m.div_ceil(P);
    // Results panel-major: t[p·n + c][r] is out[c, p·16 + r], so each task owns one
    // panel's contiguous slice.
    let mut t = vec![[0f32; P]; panels * n];
    pool.for_chunks_mut_init(&mut t, n, scratch, |panel, p, o| {
        repack(std::array::from_fn(|r| (p * P + r).min(m - 1)), panel);
        product(panel, o);
    });
    panels_to_rows(pool, &t, out, n, m);
}

/// `out[n, m]` from panel-major results: `t[p·n + c][r]` is `out[c, p·P + r]`.
pub(crate) fn panels_to_rows(pool: &Pool, t: &[[f32; P]], out: &mut [f32], n: usize, m: usize) {
    // Output rows over the pool, each written front to back from every panel's slice.
    pool.for_chunks_mut(&mut out[..n * m], m, |i, row| {
        for (p, dst) in row.chunks_mut(P).enumerate() {
            let src = &t[p * n + i];
            match <&mut [f32; P]>::try_from(&mut *dst) {
                Ok(whole) => *whole = *src,
                Err(_) => dst.copy_from_slice(&src[..dst.len()]),
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dot::test_util::{assert_batched, ref_dot, test_pool};
    use kiln_core::quant::{as_blocks, dequantize_to_vec, quantize};
    use kiln_core::DType;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn check<W: WeightBlock>(dtype: DType, dot: fn(&[W], &[BlockQ8_0]) -> f32) {
        let mut rng = StdRng::seed_from_u64(0x9e44);
        for &k in &[32usize, 96, 2048] {
            for &m in &[1usize, 7, 130] {
                for &n in &[4usize, 5, 17, 64] {
                    let wv: Vec<f32> = (0..m * k).map(|_| rng.random_range(-2.0..2.0)).collect();
                    let xv: Vec<f32> = (0..n * k).map(|_| rng.random_range(-1.0..1.0)).collect();
                    let wbytes = quantize(dtype, &wv).unwrap();
                    let w = as_blocks::<W>(&wbytes).unwrap().into_owned();
                    let xbytes = quantize(DType::Q8_0, &xv).unwrap();
                    let xq = as_blocks::<BlockQ8_0>(&xbytes).unwrap().into_owned();
                    let wf = dequantize_to_vec(dtype, &wbytes, m * k).unwrap();
                    let xf = dequantize_to_vec(DType::Q8_0, &xbytes, n * k).unwrap();
                    let mut out = vec![f32::NAN; n * m];
                    matmul(test_pool(), &w, &xq, &mut out, n, m, k);
                    let nb = k / QK;
                    let what = format!("{dtype} k={k} m={m} n={n}");
                    assert_batched(&out, n, m, &what, |i, r| {
                        let want = dot(&w[r * nb..][..nb], &xq[i * nb..][..nb]);
                        (want, ref_dot(&wf[r * k..][..k], &xf[i * k..][..k]).1)
                    });
                }
            }
        }
    }

    #[test]
    fn batched_matches_dot_q8_0() {
        if !available() {
            eprintln!("no AVX-512 VNNI: batched path not testable here");
            return;
        }
        check::<BlockQ8_0>(DType::Q8_0, dot::dot_q8_0);
    }

    #[test]
    fn batched_matches_dot_q4_0() {
        if !available() {
            eprintln!("no AVX-512 VNNI: batched path not testable here");
            return;
        }
        check::<BlockQ4_0>(DType::Q4_0, dot::dot_q4_0);
    }
}

/// Throughput of the batched kernel: `cargo test --release -p kiln-cpu --lib
/// qgemm::bench -- --ignored --nocapture`.
#[cfg(test)]
mod bench {
    use super::*;
    use crate::dot::test_util::best_seconds;
    use kiln_core::quant::{as_blocks, quantize};
    use kiln_core::DType;

    #[test]
    #[ignore]
    fn batched_throughput() {
        if !available() {
            return;
        }
        let (n, m, k) = (64, 2048, 2048);
        let wv: Vec<f32> = (0..m * k)
            .map(|i| ((i * 7919 % 1000) as f32 - 500.0) * 1e-3)
            .collect();
        let xv: Vec<f32> = (0..n * k)
            .map(|i| ((i * 104729 % 1000) as f32 - 500.0) * 1e-3)
            .collect();
        let wb = quantize(DType::Q4_0, &wv).unwrap();
        let w = as_blocks::<BlockQ4_0>(&wb).unwrap().into_owned();
        let xb = quantize(DType::Q8_0, &xv).unwrap();
        let xq = as_blocks::<BlockQ8_0>(&xb).unwrap().into_owned();
        let mut out = vec![0f32; n * m];
        let best = best_seconds(1, 5, |pool| matmul(pool, &w, &xq, &mut out, n, m, k));
        eprintln!(
            "q4_0 n={n} m={m} k={k}: {:.2} ms, {:.1} GMAC/s on 1 thread",
            best * 1e3,
            (n * m * k) as f64 / best / 1e9
        );
    }
}
