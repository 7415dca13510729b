//! Batched (prefill) matmul for F32, F16 and BF16 weights on AVX-512:
//! `out[n, m] = x[n, k] · w[m, k]ᵀ` with n ≥ [`MIN_ROWS`].
//!
//! Why not a general GEMM: at prompt sizes (tens of activation rows against 16-bit
//! weights) a general GEMM packs both operands on every call, and the `gemm` crate spent as
//! long packing as multiplying. Here only the small operand moves:
//!
//! - the activations are transposed once per call into `xt[k][16·CV]` (zero-padded), so one
//!   zmm register holds 16 activation rows at one k;
//! - weights are read where they lie, row-major in their stored type: each thread widens
//!   R rows × [`KC`] columns to f32 into a scratch that stays in L1;
//! - a register tile is R weight rows × 16·CV activation rows: per k, CV vector loads of
//!   `xt`, R broadcasts of one weight each and R·CV FMAs into 24 accumulators, with no
//!   horizontal sums at all;
//! - k advances in blocks of [`KC`] so that the block of `xt` stays in L1 while every weight row of the thread's chunk passes over it; the
//!   chunk's accumulators wait in a small buffer between blocks.

pub(crate) mod amx;

use crate::dot::{self, Isa};
use crate::pool::{Pool, SharedMut};
use half::{bf16, f16};
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::{_MM_HINT_T0, _MM_HINT_T1};

/// Activation rows from which the batched path is used (fewer go through `dot`).
pub(crate) const MIN_ROWS: usize = 8;

/// Columns of k per block: `xt`'s block (KC × 64 f32 = 16 KiB) stays in L1 beside the
/// chunk's accumulators (12 KiB); 128 was slower (the two no longer fit together), 32
/// slower still (too little work per tile call).
const KC: usize = 64;
/// Activation rows handled per pass over the weights: four zmm registers of 16.
const GROUP: usize = 64;
/// Register tiles per task: a task's weight chunk is `R · TILES` rows.
const TILES: usize = 8;

/// Whether this CPU can run the batched kernels.
pub(crate) fn available() -> bool {
    dot::isa() == Isa::Avx512Vnni
}

/// A weight element type the kernel widens to f32.
pub(crate) trait FloatWeight: bytemuck::Pod + Sync {
    /// Whether the values are bf16 already (the AMX kernel needs no remainder).
    const IS_BF16: bool = false;
    /// `dst[i] = src[i]` as f32 (same lengths).
    ///
    /// # Safety
    /// AVX-512 F/BW/VL, AVX2, FMA and F16C must be available.
    #[cfg(target_arch = "x86_64")]
    unsafe fn widen(src: &[Self], dst: &mut [f32]);

    /// The 16 elements at `p` as f32.
    ///
    /// # Safety
    /// 16 elements must be readable at `p`; the caller must have enabled AVX-512 F/BW and
    /// F16C.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512;
}

impl FloatWeight for f32 {
    #[cfg(target_arch = "x86_64")]
    unsafe fn widen(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const f32) -> std::arch::x86_64::__m512 {
        // SAFETY: the caller guarantees 16 readable elements and AVX-512 F.
        unsafe { std::arch::x86_64::_mm512_loadu_ps(p) }
    }
}

impl FloatWeight for f16 {
    #[cfg(target_arch = "x86_64")]
    unsafe fn widen(src: &[f16], dst: &mut [f32]) {
        // SAFETY: the caller guarantees the features.
        unsafe { x86::widen_f16(src, dst) }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const f16) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        // SAFETY: the caller guarantees 16 readable elements, AVX-512 F and F16C.
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)) }
    }
}

impl FloatWeight for bf16 {
    const IS_BF16: bool = true;
    #[cfg(target_arch = "x86_64")]
    unsafe fn widen(src: &[bf16], dst: &mut [f32]) {
        // SAFETY: the caller guarantees the features.
        unsafe { x86::widen_bf16(src, dst) }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const bf16) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        // SAFETY: the caller guarantees 16 readable elements and AVX-512 F. A bf16 is the
        // top half of the f32 with its bits.
        unsafe {
            let h = _mm256_loadu_si256(p as *const __m256i);
            _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{bf16, f16};
    use std::arch::x86_64::*;

    /// # Safety
    /// AVX-512 F/BW/VL, AVX2, FMA and F16C must be available.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub(super) unsafe fn widen_f16(src: &[f16], dst: &mut [f32]) {
        assert_eq!(src.len(), dst.len());
        let body = src.len() / 16 * 16;
        // SAFETY: features enabled on this function; every 16-element access lies below
        // `body` ≤ both lengths.
        unsafe {
            for i in (0..body).step_by(16) {
                let h = _mm256_loadu_si256(src.as_ptr().add(i) as *const __m256i);
                _mm512_storeu_ps(dst.as_mut_ptr().add(i), _mm512_cvtph_ps(h));
            }
        }
        for i in body..src.len() {
            dst[i] = src[i].to_f32();
        }
    }

    /// # Safety
    /// AVX-512 F/BW/VL, AVX2, FMA and F16C must be available.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub(super) unsafe fn widen_bf16(src: &[bf16], dst: &mut [f32]) {
        assert_eq!(src.len(), dst.len());
        let body = src.len() / 16 * 16;
        // SAFETY: as in `widen_f16`. A bf16 is the top half of the f32 with its bits.
        unsafe {
            for i in (0..body).step_by(16) {
                let h = _mm256_loadu_si256(src.as_ptr().add(i) as *const __m256i);
                let w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
                _mm512_storeu_ps(dst.as_mut_ptr().add(i), _mm512_castsi512_ps(w));
            }
        }
        for i in body..src.len() {
            dst[i] = src[i].to_f32();
        }
    }

    /// `acc[r][j] += Σ_kk w[r·kc + kk] · xt[kk·16·CV + j]` for R rows and 16·CV columns.
    ///
    /// # Safety
    /// AVX-512 F/BW/VL, AVX2, FMA and F16C must be available.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub(super) unsafe fn tile<const R: usize, const CV: usize>(
        w: &[f32],
        xt: &[f32],
        kc: usize,
        acc: &mut [f32],
    ) {
        let width = 16 * CV;
        assert!(w.len() >= R * kc && xt.len() >= kc * width && acc.len() >= R * width);
        // SAFETY: features enabled on this function; reads stay below R·kc in `w`,
        // kc·width in `xt` and R·width in `acc` (asserted).
        unsafe {
            let mut a: [[__m512; CV]; R] = std::array::from_fn(|r| {
                std::array::from_fn(|v| _mm512_loadu_ps(acc.as_ptr().add(r * width + 16 * v)))
            });
            let (wp, xp) = (w.as_ptr(), xt.as_ptr());
            for kk in 0..kc {
                let xv: [__m512; CV] =
                    std::array::from_fn(|v| _mm512_loadu_ps(xp.add(kk * width + 16 * v)));
                for (r, ar) in a.iter_mut().enumerate() {
                    let b = _mm512_set1_ps(*wp.add(r * kc + kk));
                    for (av, &x) in ar.iter_mut().zip(&xv) {
                        *av = _mm512_fmadd_ps(b, x, *av);
                    }
                }
            }
            for (r, ar) in a.iter().enumerate() {
                for (v, av) in ar.iter().enumerate() {
                    _mm512_storeu_ps(acc.as_mut_ptr().add(r * width + 16 * v), *av);
                }
            }
        }
    }

    /// Ask for `row[from..from + len]` ahead of its use (`HINT`: which cache).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub(super) unsafe fn prefetch<W, const HINT: i32>(row: &[W], from: usize, len: usize) {
        let bytes = len.min(row.len().saturating_sub(from)) * size_of::<W>();
        // SAFETY: prefetches never fault; the addresses lie inside `row` anyway.
        unsafe {
            let p = row.as_ptr().add(from.min(row.len())) as *const i8;
            for off in (0..bytes).step_by(64) {
                _mm_prefetch::<HINT>(p.add(off));
            }
        }
    }
}

/// `out[n, m] = x · wᵀ` for `w` of `m` rows of `k` elements and `xs` the f32 activations
/// (`n` rows of `k`). Requires [`available()`].
pub(crate) fn matmul<W: FloatWeight>(
    pool: &Pool,
    w: &[W],
    xs: &[f32],
    out: &mut [f32],
    n: usize,
    m: usize,
    k: usize,
) {
    assert!(available(), "batched float matmul needs AVX-512");
    assert!(w.len() >= m * k && xs.len() >= n * k && out.len() >= n * m);
    for g0 in (0..n).step_by(GROUP) {
        let rows = GROUP.min(n - g0);
        let x = &xs[g0 * k..(g0 + rows) * k];
        let out = &mut out[g0 * m..(g0 + rows) * m];
        // Registers: R·CV accumulators + CV activation vectors + one broadcast ≤ 32.
        match rows.div_ceil(16) {
            1 => group::<W, 24, 1>(pool, w, x, out, rows, m, k),
            2 => group::<W, 12, 2>(pool, w, x, out, rows, m, k),
            3 => group::<W, 8, 3>(pool, w, x, out, rows, m, k),
            _ => group::<W, 6, 4>(pool, w, x, out, rows, m, k),
        }
    }
}

/// One group of at most 16·CV activation rows against all `m` weight rows.
fn group<W: FloatWeight, const R: usize, const CV: usize>(
    pool: &Pool,
    w: &[W],
    x: &[f32],
    out: &mut [f32],
    rows: usize,
    m: usize,
    k: usize,
) {
    let width = 16 * CV;
    // Transposed in bands of 16 k: each band reads a short run of every activation row.
    let mut xt = vec![0f32; k * width];
    pool.for_chunks_mut(&mut xt, 16 * width, |b, band| {
        for (i, xr) in x.chunks_exact(k).enumerate() {
            for (j, &v) in xr[16 * b..].iter().take(16).enumerate() {
                band[j * width + i] = v;
            }
        }
    });
    let chunk = R * TILES;
    let cols = SharedMut::new(out);
    pool.for_each_init(
        m.div_ceil(chunk),
        || (vec![0f32; R * KC], vec![0f32; chunk * width]),
        |(scratch, acc), c| {
            let r0 = c * chunk;
            acc.fill(0.0);
            for k0 in (0..k).step_by(KC) {
                let kc = KC.min(k - k0);
                let scratch = &mut scratch[..R * kc];
                for (tt, acc) in acc.chunks_exact_mut(R * width).enumerate() {
                    let rt = r0 + tt * R;
                    if rt >= m {
                        break;
                    }
                    for r in 0..R {
                        // A ragged last tile repeats the last row; its results are not copied out.
                        let row = &w[(rt + r).min(m - 1) * k..][..k];
                        // The next tile's rows: the tile runs long enough to hide a miss.
                        let next = &w[(rt + R + r).min(m - 1) * k..][..k];
                        #[cfg(target_arch = "x86_64")]
                        // SAFETY: `available()` (asserted by `matmul`) means AVX-512
                        // F/BW/VL, AVX2, FMA and F16C were detected.
                        unsafe {
                            x86::prefetch::<_, _MM_HINT_T0>(next, k0, kc);
                            x86::prefetch::<_, _MM_HINT_T1>(row, k0 + KC, KC);
                            W::widen(&row[k0..k0 + kc], &mut scratch[r * kc..][..kc]);
                        }
                    }
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: as above.
                    unsafe {
                        x86::tile::<R, CV>(scratch, &xt[k0 * width..][..kc * width], kc, acc)
                    };
                    #[cfg(not(target_arch = "x86_64"))]
                    unreachable!("checked by available()");
                }
            }
            // acc[r][i] = out[i, r0 + r].
            let len = chunk.min(m - r0);
            for i in 0..rows {
                // SAFETY: this task alone writes columns r0..r0 + len of out's `rows` rows
                // of m (len ≤ m − r0), and `out` outlives the parallel loop.
                let dst = unsafe { std::slice::from_raw_parts_mut(cols.at(i * m + r0), len) };
                for (r, v) in dst.iter_mut().enumerate() {
                    *v = acc[r * width + i];
                }
            }
        },
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dot::test_util::{ref_dot, test_pool};
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn check<W: FloatWeight>(from: fn(f32) -> W, to: fn(W) -> f32) {
        let mut rng = StdRng::seed_from_u64(0xf9e3);
        for &k in &[1usize, 17, 128, 300] {
            for &m in &[1usize, 7, 53] {
                for &n in &[8usize, 17, 33, 50, 64, 100] {
                    let w: Vec<W> = (0..m * k)
                        .map(|_| from(rng.random_range(-2.0..2.0)))
                        .collect();
                    let x: Vec<f32> = (0..n * k).map(|_| rng.random_range(-1.0..1.0)).collect();
                    let wf: Vec<f32> = w.iter().map(|&v| to(v)).collect();
                    let mut out = vec![f32::NAN; n * m];
                    matmul(test_pool(), &w, &x, &mut out, n, m, k);
                    for i in 0..n {
                        for r in 0..m {
                            let (want, abs) = ref_dot(&wf[r * k..][..k], &x[i * k..][..k]);
                            let got = out[i * m + r] as f64;
                            assert!(
                                (got - want).abs() <= 1e-5 * abs + 1e-30,
                                "k={k} m={m} n={n} [{i}, {r}]: got {got}, want {want}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn batched_matches_reference_f32() {
        if !available() {
            eprintln!("no AVX-512: batched float path not testable here");
            return;
        }
        check::<f32>(|v| v, |v| v);
    }

    #[test]
    fn batched_matches_reference_f16() {
        if !available() {
            eprintln!("no AVX-512: batched float path not testable here");
            return;
        }
        check::<f16>(f16::from_f32, f16::to_f32);
    }

    #[test]
    fn batched_matches_reference_bf16() {
        if !available() {
            eprintln!("no AVX-512: batched float path not testable here");
            return;
        }
        check::<bf16>(bf16::from_f32, bf16::to_f32);
    }
}

/// Throughput of the batched kernel: `cargo test --release -p kiln-cpu --lib
/// fgemm::bench -- --ignored --nocapture`.
#[cfg(test)]
mod bench {
    use super::*;
    use crate::dot::test_util::best_seconds;

    #[test]
    #[ignore]
    fn batched_throughput() {
        if !available() {
            return;
        }
        let (n, m, k) = std::env::var("KILN_BENCH_NMK")
            .ok()
            .and_then(|v| {
                let d: Vec<usize> = v.split(',').filter_map(|x| x.parse().ok()).collect();
                (d.len() == 3).then(|| (d[0], d[1], d[2]))
            })
            .unwrap_or((64, 2048, 2048));
        let w: Vec<f16> = (0..m * k)
            .map(|i| f16::from_f32(((i * 7919 % 1000) as f32 - 500.0) * 1e-3))
            .collect();
        let x: Vec<f32> = (0..n * k)
            .map(|i| ((i * 104729 % 1000) as f32 - 500.0) * 1e-3)
            .collect();
        let mut out = vec![0f32; n * m];
        for use_amx in [false, true] {
            if use_amx && !crate::amx::bf16_available() {
                eprintln!("no AMX-BF16 here");
                continue;
            }
            for threads in [1, 2] {
                let best = best_seconds(threads, 30, |pool| {
                    if use_amx {
                        amx::matmul(pool, &w, &x, &mut out, n, m, k)
                    } else {
                        matmul(pool, &w, &x, &mut out, n, m, k)
                    }
                });
                eprintln!(
                    "f16 amx={use_amx} n={n} m={m} k={k}: {:.2} ms, {:.1} GFLOP/s on {threads} thread(s)",
                    best * 1e3,
                    2.0 * (n * m * k) as f64 / best / 1e9
                );
            }
        }
    }
}
