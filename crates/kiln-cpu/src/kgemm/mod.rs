//! Batched (prefill) matmul for the K formats, Q4_K and Q6_K weights against Q8_K
//! activations on AVX-512 VNNI: `out[n, m] = x[n, k] · w[m, k]ᵀ` with n ≥
//! [`qgemm::MIN_ROWS`].
//!
//! The same scheme as [`qgemm`] (read it first): a panel of 16 weight rows, one per i32
//! lane, repacked per call into unsigned bytes so that `vpdpbusd` multiplies one weight
//! register with 4 broadcast activation quants of each of 8 activation rows. What differs
//! is the scales: a 256-element super-block has a scale per group of 32 (Q4_K) or 16
//! (Q6_K) elements, so the exact integer sum of each group is converted and multiplied by
//! that group's `d · scale` per lane, in f32:
//!
//! - Q4_K: `w = d·sc_j·q − dmin·m_j` with `q` in 0..=15, already unsigned. The `−dmin·m_j`
//!   part contributes `−dmin·m_j · Σx` over the group, taken per super-block from the
//!   activation block's sums of 16 (`bsums`), as ggml does.
//! - Q6_K: `w = d·sc_g·(q − 32)` with `q` in 0..=63 as the unsigned form; the group's
//!   integer sum starts at `−32·Σx` (from `bsums` again), which removes the offset exactly.
//!
//! Per group and activation row that is 8 (Q4_K) or 4 (Q6_K) `vpdpbusd` for one
//! conversion and one FMA.

pub(crate) mod amx;

use crate::panels::{Format, Panels};
use crate::pool::Pool;
use crate::qgemm::{self, C, P};
use bytemuck::Zeroable;
use kiln_core::quant::{BlockQ4K, BlockQ6K, BlockQ8K, QK_K};

/// One super-block of a 16-row weight panel, transposed for the kernel.
#[repr(C, align(64))]
#[derive(Clone, Copy, Zeroable)]
pub(crate) struct KPanelBlock {
    /// `q[j]` lane `r` (bytes `4r..4r+4`) = unsigned quants `4j..4j+4` of row `r`.
    q: [[u8; 64]; QK_K / 4],
    /// Per scale group, `d · scale` of each row (Q4_K uses the first 8 groups).
    scale: [[f32; P]; 16],
    /// Q4_K: per group of 32, `dmin · m` of each row.
    min: [[f32; P]; 8],
}

/// What the kernel needs of an activation block besides its quants.
#[derive(Clone, Copy, Zeroable)]
struct ActBlock {
    d: f32,
    /// Q6_K: `−32 · Σx` per group of 16, the integer sums' starting values.
    corr: [i32; 16],
    /// Q4_K: `Σx` per group of 32.
    sum32: [f32; 8],
}

/// A K-format weight block the kernel can consume.
pub(crate) trait KBlock: bytemuck::Pod + Sync {
    /// Scale groups per super-block.
    const GROUPS: usize;
    /// Whether the format subtracts a per-group minimum (Q4_K) rather than an offset.
    const HAS_MIN: bool;
    /// Quants `32·part..32·part + 32` as unsigned bytes.
    #[cfg(target_arch = "x86_64")]
    unsafe fn unsigned(&self, part: usize) -> std::arch::x86_64::__m256i;
    /// `out.scale[g][r]` = `d · scale` of group g of `blocks[r]` (and `out.min[g][r]` =
    /// `dmin · min`), as f32: the 16 rows at once, one lane each.
    ///
    /// # Safety
    /// AVX-512 F, BW and VL and F16C must be available.
    #[cfg(target_arch = "x86_64")]
    unsafe fn panel_scales(blocks: [&Self; P], out: &mut KPanelBlock);
}

/// `field` of each of the 16 blocks, one u32 lane each.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn lanes<T>(blocks: &[&T; P], field: impl Fn(&T) -> u32) -> std::arch::x86_64::__m512i {
    let words: [u32; P] = std::array::from_fn(|r| field(blocks[r]));
    // SAFETY: `words` is 64 readable bytes; the caller enabled AVX-512 F.
    unsafe { std::arch::x86_64::_mm512_loadu_si512(words.as_ptr() as *const _) }
}

fn word(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"))
}

impl KBlock for BlockQ4K {
    const GROUPS: usize = 8;
    const HAS_MIN: bool = true;
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn unsigned(&self, part: usize) -> std::arch::x86_64::__m256i {
        use std::arch::x86_64::*;
        // SAFETY: 32 readable bytes at `32·(part/2)` < 128; the caller enabled AVX2. Part
        // 2g is the low nibbles of bytes 32g.., part 2g + 1 their high nibbles.
        unsafe {
            let v = _mm256_loadu_si256(self.qs.as_ptr().add(32 * (part / 2)) as *const __m256i);
            let v = _mm256_srl_epi16(v, _mm_cvtsi32_si128(4 * (part % 2) as i32));
            _mm256_and_si256(v, _mm256_set1_epi8(0x0F))
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn panel_scales(blocks: [&Self; P], out: &mut KPanelBlock) {
        // SAFETY: the caller enabled the features; stores go through references.
        unsafe { Q4KLanes::of(&blocks).store(out) }
    }
}

/// The scales of 16 Q4_K blocks, one block per lane.
#[cfg(target_arch = "x86_64")]
struct Q4KLanes {
    d: std::arch::x86_64::__m512,
    dmin: std::arch::x86_64::__m512,
    /// Group j's 6-bit scale and minimum (u32 lanes).
    sc: [std::arch::x86_64::__m512i; 8],
    mn: [std::arch::x86_64::__m512i; 8],
}

#[cfg(target_arch = "x86_64")]
impl Q4KLanes {
    /// # Safety
    /// AVX-512 F, BW and VL and F16C must be available.
    #[inline(always)]
    unsafe fn of(blocks: &[&BlockQ4K; P]) -> Q4KLanes {
        use std::arch::x86_64::*;
        // SAFETY: the caller enabled the features.
        unsafe {
            let dd = lanes(blocks, |b| {
                b.d.to_bits() as u32 | (b.dmin.to_bits() as u32) << 16
            });
            let d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dd));
            let dmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dd, 16)));
            let u0 = lanes(blocks, |b| word(&b.scales, 0));
            let u1 = lanes(blocks, |b| word(&b.scales, 4));
            let u2 = lanes(blocks, |b| word(&b.scales, 8));
            Q4KLanes::from_words(d, dmin, [u0, u1, u2])
        }
    }

    /// Super-block `b` of a Q4_K panel (`nb` super-blocks a row; see [`crate::panels`]),
    /// whose headers already hold the 16 rows side by side.
    ///
    /// # Safety
    /// AVX-512 F, BW and VL and F16C must be available; `panel` must hold `nb` super-blocks
    /// of 16 rows (checked).
    #[inline(always)]
    unsafe fn of_panel(panel: &[u8], nb: usize, b: usize) -> Q4KLanes {
        use std::arch::x86_64::*;
        assert!(b < nb && panel.len() >= 2304 * nb);
        // SAFETY: the caller enabled the features; the 256 header bytes of super-block b
        // lie inside `panel` (asserted).
        unsafe {
            let hdr = panel.as_ptr().add(256 * b);
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(hdr as *const __m256i));
            let dmin = _mm512_cvtph_ps(_mm256_loadu_si256(hdr.add(32) as *const __m256i));
            let u0 = _mm512_loadu_si512(hdr.add(64) as *const _);
            let u1 = _mm512_loadu_si512(hdr.add(128) as *const _);
            let u2 = _mm512_loadu_si512(hdr.add(192) as *const _);
            Q4KLanes::from_words(d, dmin, [u0, u1, u2])
        }
    }

    /// The lanes from each block's scales and mins as three u32 words (bytes 0..4, 4..8
    /// and 8..12 of `scales`).
    ///
    /// # Safety
    /// AVX-512 F, BW and VL must be available.
    #[inline(always)]
    unsafe fn from_words(
        d: std::arch::x86_64::__m512,
        dmin: std::arch::x86_64::__m512,
        [u0, u1, u2]: [std::arch::x86_64::__m512i; 3],
    ) -> Q4KLanes {
        use std::arch::x86_64::*;
        // SAFETY: the caller enabled the features.
        unsafe {
            // The 6-bit fields as ggml's `utmp` unpacking lays them out (see
            // `dot::k_quants::unpack_q4k_scales`), four per u32.
            let k6 = _mm512_set1_epi32(0x3f3f_3f3f);
            let k4 = _mm512_set1_epi32(0x0f0f_0f0f);
            let k2 = _mm512_set1_epi32(0x0303_0303);
            let hi2 =
                |u: __m512i| _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 6), k2), 4);
            let sc = [
                _mm512_and_si512(u0, k6),
                _mm512_or_si512(_mm512_and_si512(u2, k4), hi2(u0)),
            ];
            let mn = [
                _mm512_and_si512(u1, k6),
                _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(u2, 4), k4), hi2(u1)),
            ];
            let byte = |v: __m512i, i: usize| {
                _mm512_and_si512(
                    _mm512_srlv_epi32(v, _mm512_set1_epi32(8 * i as i32)),
                    _mm512_set1_epi32(0xff),
                )
            };
            // Loops, not `array::from_fn`: its closure would be compiled on its own,
            // without AVX-512, and every intrinsic in it become a call.
            let mut lanes = Q4KLanes {
                d,
                dmin,
                sc: [_mm512_setzero_si512(); 8],
                mn: [_mm512_setzero_si512(); 8],
            };
            for j in 0..8 {
                lanes.sc[j] = byte(sc[j / 4], j % 4);
                lanes.mn[j] = byte(mn[j / 4], j % 4);
            }
            lanes
        }
    }

    /// `out.scale[j]` = `d · sc_j` and `out.min[j]` = `dmin · m_j`, per lane.
    ///
    /// # Safety
    /// AVX-512 F must be available.
    #[inline(always)]
    unsafe fn store(&self, out: &mut KPanelBlock) {
        use std::arch::x86_64::*;
        // SAFETY: the caller enabled the features; stores go through references.
        unsafe {
            for j in 0..8 {
                let scale = _mm512_mul_ps(self.d, _mm512_cvtepi32_ps(self.sc[j]));
                _mm512_storeu_ps(out.scale[j].as_mut_ptr(), scale);
                let min = _mm512_mul_ps(self.dmin, _mm512_cvtepi32_ps(self.mn[j]));
                _mm512_storeu_ps(out.min[j].as_mut_ptr(), min);
            }
        }
    }
}

/// Lane r = unsigned quants `4j..4j + 4` of row r of super-block `b` of a Q4_K panel (the
/// lane layout of [`KPanelBlock::q`]): element `4j` is in the group of 64 `j / 16`, a low
/// nibble of the group's chunk `j % 8` for `j % 16 < 8`, else a high nibble.
///
/// # Safety
/// AVX-512 F and BW must be available; `panel` must hold `nb` super-blocks of 16 rows,
/// `b < nb` and `j < 64`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn panel_quants(
    panel: &[u8],
    nb: usize,
    b: usize,
    j: usize,
) -> std::arch::x86_64::__m512i {
    use std::arch::x86_64::*;
    debug_assert!(b < nb && j < 64 && panel.len() >= 2304 * nb);
    let c = 8 * (j / 16) + j % 8;
    // SAFETY: the caller enabled the features; chunk c of super-block b lies inside the
    // panel's quants (below 256·nb + 2048·nb: the caller's guarantee).
    unsafe {
        let v = _mm512_loadu_si512(panel.as_ptr().add(256 * nb + 2048 * b + 64 * c) as *const _);
        let v = if j % 16 < 8 {
            v
        } else {
            _mm512_srli_epi16(v, 4)
        };
        _mm512_and_si512(v, _mm512_set1_epi8(0x0F))
    }
}

impl KBlock for BlockQ6K {
    const GROUPS: usize = 16;
    const HAS_MIN: bool = false;
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn unsigned(&self, part: usize) -> std::arch::x86_64::__m256i {
        use std::arch::x86_64::*;
        // Element 128h + 32s + l (s < 4, l < 32): low 4 bits from `ql[64h + 32(s%2) + l]`
        // (low nibble for s < 2, high for s ≥ 2), high 2 bits from `qh[32h + l]` bits 2s..
        let (h, s) = (part / 4, part % 4);
        // SAFETY: 32 readable bytes at 64h + 32(s%2) + 32 ≤ 128 in `ql` and at 32h + 32
        // ≤ 64 in `qh`; the caller enabled AVX2.
        unsafe {
            let ql = _mm256_loadu_si256(self.ql.as_ptr().add(64 * h + 32 * (s % 2)) as *const _);
            let qh = _mm256_loadu_si256(self.qh.as_ptr().add(32 * h) as *const __m256i);
            let lo = _mm256_and_si256(
                _mm256_srl_epi16(ql, _mm_cvtsi32_si128(4 * (s / 2) as i32)),
                _mm256_set1_epi8(0x0F),
            );
            let hi = _mm256_and_si256(
                _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * s as i32)),
                _mm256_set1_epi8(0x03),
            );
            _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4))
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn panel_scales(blocks: [&Self; P], out: &mut KPanelBlock) {
        use std::arch::x86_64::*;
        // SAFETY: the caller enabled the features; stores go through references.
        unsafe {
            let d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(lanes(&blocks, |b| {
                b.d.to_bits() as u32
            })));
            for (w, out) in out.scale.chunks_exact_mut(4).enumerate() {
                let v = lanes(&blocks, |b| word(bytemuck::cast_slice(&b.scales), 4 * w));
                for (i, o) in out.iter_mut().enumerate() {
                    // Byte i moved to the top, then shifted down with its sign.
                    let sc = _mm512_srai_epi32(
                        _mm512_sllv_epi32(v, _mm512_set1_epi32(24 - 8 * i as i32)),
                        24,
                    );
                    _mm512_storeu_ps(o.as_mut_ptr(), _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc)));
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use std::arch::x86_64::*;

    /// Repack rows `rows` (16 indices into `w`, each a row of `nb` super-blocks) into
    /// `panel`.
    ///
    /// # Safety
    /// AVX-512 F, BW, VL and VNNI, AVX2, FMA and F16C must be available.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn repack<W: KBlock>(
        w: &[W],
        rows: [usize; P],
        nb: usize,
        panel: &mut [KPanelBlock],
    ) {
        let rows: [&[W]; P] = rows.map(|r| &w[r * nb..][..nb]);
        // SAFETY: the features are enabled on this function; memory goes through
        // references.
        unsafe {
            for (b, out) in panel[..nb].iter_mut().enumerate() {
                for (part, q) in out.q.chunks_exact_mut(8).enumerate() {
                    let q: &mut [[u8; 64]; 8] = q.try_into().expect("chunks of 8");
                    let mut parts = [_mm256_setzero_si256(); P];
                    for (p, row) in parts.iter_mut().zip(&rows) {
                        *p = row[b].unsigned(part);
                    }
                    qgemm::transpose_rows(parts, q);
                }
                W::panel_scales(std::array::from_fn(|r| &rows[r][b]), out);
            }
        }
    }

    /// Repack panel `panel` of Q4_K panels (`nb` super-blocks a row) into `out`.
    ///
    /// # Safety
    /// AVX-512 F, BW, VL and VNNI, AVX2, FMA and F16C must be available.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn repack_q4k_panel(panel: &[u8], nb: usize, out: &mut [KPanelBlock]) {
        assert!(panel.len() >= 2304 * nb && out.len() >= nb);
        // SAFETY: the features are enabled on this function; the panel holds nb
        // super-blocks (asserted) and stores go through references.
        unsafe {
            for (b, out) in out[..nb].iter_mut().enumerate() {
                for (j, q) in out.q.iter_mut().enumerate() {
                    let v = panel_quants(panel, nb, b, j);
                    _mm512_storeu_si512(q.as_mut_ptr() as *mut _, v);
                }
                Q4KLanes::of_panel(panel, nb, b).store(out);
            }
        }
    }

    /// The tile `panel · x[c]ᵀ` for the C activation rows `x` (each `nb` blocks, with
    /// `act` beside them): lane r of result c is row r · x[c].
    ///
    /// # Safety
    /// AVX-512 F, BW, VL and VNNI, AVX2, FMA and F16C must be available.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn tile<W: KBlock>(
        panel: &[KPanelBlock],
        x: [&[BlockQ8K]; C],
        act: [&[ActBlock]; C],
        nb: usize,
    ) -> [[f32; P]; C] {
        assert!(panel.len() >= nb);
        assert!((0..C).all(|c| x[c].len() >= nb && act[c].len() >= nb));
        let regs = QK_K / 4 / W::GROUPS;
        // SAFETY: the features are enabled on this function; every block index is < nb,
        // which all slices cover (asserted), and each 4-byte read lies inside a 256-byte
        // `qs` (register index < 64).
        unsafe {
            let mut acc = [_mm512_setzero_ps(); C];
            for b in 0..nb {
                let pb = panel.get_unchecked(b);
                let mut f = [_mm512_setzero_ps(); C];
                for g in 0..W::GROUPS {
                    let mut ia: [__m512i; C] = std::array::from_fn(|c| {
                        if W::HAS_MIN {
                            _mm512_setzero_si512()
                        } else {
                            _mm512_set1_epi32(act[c].get_unchecked(b).corr[g])
                        }
                    });
                    for j in g * regs..(g + 1) * regs {
                        let wv = _mm512_loadu_si512(pb.q[j].as_ptr() as *const _);
                        for c in 0..C {
                            let xp = x[c].get_unchecked(b).qs.as_ptr().add(4 * j) as *const i32;
                            let xv = _mm512_set1_epi32(xp.read_unaligned());
                            ia[c] = _mm512_dpbusd_epi32(ia[c], wv, xv);
                        }
                    }
                    let sc = _mm512_loadu_ps(pb.scale[g].as_ptr());
                    for c in 0..C {
                        f[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[c]), sc, f[c]);
                    }
                }
                if W::HAS_MIN {
                    for j in 0..8 {
                        let mn = _mm512_loadu_ps(pb.min[j].as_ptr());
                        for c in 0..C {
                            let s = _mm512_set1_ps(act[c].get_unchecked(b).sum32[j]);
                            f[c] = _mm512_fnmadd_ps(mn, s, f[c]);
                        }
                    }
                }
                for c in 0..C {
                    let d = _mm512_set1_ps(act[c].get_unchecked(b).d);
                    acc[c] = _mm512_fmadd_ps(f[c], d, acc[c]);
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

/// Where a prompt kernel reads its weight rows.
pub(crate) enum KRows<'a, W> {
    /// The file's layout: `m` rows of `k / QK_K` super-blocks.
    File(&'a [W]),
    /// Q4_K panels of the CPU's layout ([`crate::panels`]): already interleaved a row per
    /// lane, so repacking a panel is unpacking its nibbles and scales.
    Panels(&'a Panels),
}

impl<W> KRows<'_, W> {
    /// That `self` holds `m` rows of `k`: in panels, Q4_K ones (`W` must be Q4_K too).
    pub(crate) fn check(&self, m: usize, k: usize, q4k: bool) {
        match self {
            KRows::File(w) => assert!(w.len() >= m * (k / QK_K), "{m} weight rows of {k}"),
            KRows::Panels(p) => assert!(
                q4k && p.format() == Format::Q4K && p.rows() == m && p.cols() == k,
                "Q4_K panels of {m} × {k}"
            ),
        }
    }
}

/// `out[n, m] = x · wᵀ` for `w` of `m` rows of `k / QK_K` super-blocks and `xq` the Q8_K
/// activations (`n` rows). Requires a CPU with AVX-512 VNNI (whichever kernels
/// `KILN_CPU_ISA` chose for the rest: tests run these beside the AVX2 ones).
pub(crate) fn matmul<W: KBlock>(
    pool: &Pool,
    w: KRows<'_, W>,
    xq: &[BlockQ8K],
    out: &mut [f32],
    n: usize,
    m: usize,
    k: usize,
) {
    assert!(
        crate::dot::Isa::Avx512Vnni.available(),
        "batched matmul needs AVX-512 VNNI"
    );
    let nb = k / QK_K;
    assert!(xq.len() >= n * nb && out.len() >= n * m);
    w.check(m, k, W::HAS_MIN);
    let act: Vec<ActBlock> = xq[..n * nb]
        .iter()
        .map(|b| ActBlock {
            d: b.d,
            corr: b.bsums.map(|s| -32 * s as i32),
            sum32: std::array::from_fn(|j| {
                (b.bsums[2 * j] as i32 + b.bsums[2 * j + 1] as i32) as f32
            }),
        })
        .collect();
    qgemm::run_panels(
        pool,
        out,
        n,
        m,
        || vec![KPanelBlock::zeroed(); nb],
        |rows, panel| {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `available()` (asserted above) means AVX-512 F/BW/VL/VNNI, AVX2,
            // FMA and F16C were detected.
            unsafe {
                match &w {
                    KRows::File(w) => x86::repack(w, rows, nb, panel),
                    KRows::Panels(p) => x86::repack_q4k_panel(p.panel(rows[0] / P), nb, panel),
                }
            };
            #[cfg(not(target_arch = "x86_64"))]
            let _ = (rows, panel);
        },
        |panel, cols| {
            let x = cols.map(|c| &xq[c * nb..][..nb]);
            let a = cols.map(|c| &act[c * nb..][..nb]);
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            return unsafe { x86::tile::<W>(panel, x, a, nb) };
            #[cfg(not(target_arch = "x86_64"))]
            {
                let _ = (x, a, panel);
                unreachable!("checked by available()")
            }
        },
    );
}

#[cfg(test)]
mod tests;
