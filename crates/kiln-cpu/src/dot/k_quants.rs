//! Q4_K and Q6_K weights against Q8_K activations (super-blocks of 256).
//!
//! Both kernels keep the weight quants unsigned so that `maddubs` (u8 × i8 → i16 pairs)
//! applies, multiply the i16 pair sums by the sub-block scales with `madd` (AVX2) or
//! `dpwssd` (VNNI), and move the offsets out of the inner loop using the activation's
//! 16-element sums `bsums`:
//! - Q4_K: `w = d·sc·q − dmin·m`, so `Σ w·x = d·Σ sc·q·x − dmin·Σ m·(bsum pair)`;
//! - Q6_K: `w = d·sc·(q − 32)`, so `Σ w·x = d·(Σ sc·q·x − 32·Σ sc·bsum)`.
//!
//! The integer sums are exact (|Σ sc·q·x| < 2^29); scales apply once per super-block.

use kiln_core::quant::{BlockQ4K, BlockQ6K, BlockQ8K, QK_K};

/// The eight 6-bit scales (bytes 0..8) and eight 6-bit mins (bytes 8..16) of a Q4_K block,
/// unpacked four at a time with 32-bit masks (ggml's `utmp` trick).
#[inline(always)]
pub(crate) fn unpack_q4k_scales(s: &[u8; 12]) -> [u8; 16] {
    const K1: u32 = 0x3f3f_3f3f;
    const K2: u32 = 0x0f0f_0f0f;
    const K3: u32 = 0x0303_0303;
    let word = |i: usize| u32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]]);
    let (u0, u1, u2) = (word(0), word(1), word(2));
    let scales_lo = u0 & K1;
    let scales_hi = (u2 & K2) | (((u0 >> 6) & K3) << 4);
    let mins_lo = u1 & K1;
    let mins_hi = ((u2 >> 4) & K2) | (((u1 >> 6) & K3) << 4);
    let mut out = [0u8; 16];
    for (o, w) in out
        .chunks_exact_mut(4)
        .zip([scales_lo, scales_hi, mins_lo, mins_hi])
    {
        o.copy_from_slice(&w.to_le_bytes());
    }
    out
}

pub(crate) fn dot_q4_k_portable(w: &[BlockQ4K], x: &[BlockQ8K]) -> f32 {
    let mut sum = 0f32;
    for (w, x) in w.iter().zip(x) {
        let sm = unpack_q4k_scales(&w.scales);
        let (mut sumi, mut summ) = (0i32, 0i32);
        for g in 0..QK_K / 64 {
            let q = &w.qs[32 * g..32 * g + 32];
            let y = &x.qs[64 * g..64 * g + 64];
            let (mut lo, mut hi) = (0i32, 0i32);
            for l in 0..32 {
                lo += (q[l] & 0xF) as i32 * y[l] as i32;
                hi += (q[l] >> 4) as i32 * y[l + 32] as i32;
            }
            sumi += sm[2 * g] as i32 * lo + sm[2 * g + 1] as i32 * hi;
        }
        for j in 0..QK_K / 32 {
            summ += sm[8 + j] as i32 * (x.bsums[2 * j] as i32 + x.bsums[2 * j + 1] as i32);
        }
        sum += x.d * w.d.to_f32() * sumi as f32 - x.d * w.dmin.to_f32() * summ as f32;
    }
    sum
}

pub(crate) fn dot_q6_k_portable(w: &[BlockQ6K], x: &[BlockQ8K]) -> f32 {
    let mut sum = 0f32;
    for (w, x) in w.iter().zip(x) {
        // Unpack the 6-bit quants (0..=63, offset not yet removed) in element order.
        let mut q = [0u8; QK_K];
        for h in 0..2 {
            let (ql, qh) = (&w.ql[64 * h..64 * h + 64], &w.qh[32 * h..32 * h + 32]);
            let out = &mut q[128 * h..128 * h + 128];
            for l in 0..32 {
                out[l] = (ql[l] & 0xF) | ((qh[l] & 3) << 4);
                out[l + 32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
                out[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
                out[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
            }
        }
        let mut sumi = 0i32;
        for (j, (q, y)) in q.chunks_exact(16).zip(x.qs.chunks_exact(16)).enumerate() {
            let s: i32 = q.iter().zip(y).map(|(&q, &y)| q as i32 * y as i32).sum();
            sumi += w.scales[j] as i32 * (s - 32 * x.bsums[j] as i32);
        }
        sum += x.d * w.d.to_f32() * sumi as f32;
    }
    sum
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    //! Helpers are `#[inline(always)]` without `target_feature` so they inline into the
    //! feature-enabled entry points; each is only sound to call from such a function.
    use super::*;
    use std::arch::x86_64::*;

    /// `[a·xd, b·xd]` for two f16 bit patterns `a`, `b`. Needs F16C.
    #[inline(always)]
    pub(crate) unsafe fn f16x2_times(a: u16, b: u16, xd: f32) -> (f32, f32) {
        // SAFETY: the caller enabled F16C (and so SSE4.1).
        unsafe {
            let f = _mm_cvtph_ps(_mm_cvtsi32_si128((a as u32 | (b as u32) << 16) as i32));
            let f = _mm_mul_ps(f, _mm_set1_ps(xd));
            (_mm_cvtss_f32(f), _mm_cvtss_f32(_mm_movehdup_ps(f)))
        }
    }

    /// Needs AVX.
    #[inline(always)]
    pub(crate) unsafe fn hsum256(v: __m256) -> f32 {
        // SAFETY: the caller enabled AVX.
        unsafe {
            let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            let s = _mm_add_ss(s, _mm_movehdup_ps(s));
            _mm_cvtss_f32(s)
        }
    }

    /// Needs SSE3.
    #[inline(always)]
    unsafe fn hsum128(s: __m128) -> f32 {
        // SAFETY: the caller enabled SSE3.
        unsafe {
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
        }
    }

    /// Σ m_j·(bsum_{2j} + bsum_{2j+1}) of a Q4_K block as four i32. Needs AVX2.
    #[inline(always)]
    unsafe fn q4k_mins(sm: &[u8; 16], x: &BlockQ8K) -> __m128i {
        // SAFETY: `sm[8..16]` is 8 readable bytes and `bsums` 32; the caller enabled AVX2.
        unsafe {
            let mins = _mm_cvtepu8_epi16(_mm_loadl_epi64(sm.as_ptr().add(8) as *const __m128i));
            let b = _mm256_loadu_si256(x.bsums.as_ptr() as *const __m256i);
            // Pairwise sums of the sixteen 16-element sums: one per 32-element sub-block.
            let pairs = _mm_hadd_epi16(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
            _mm_madd_epi16(mins, pairs)
        }
    }

    /// One Q4_K block against `x`: `Σ_j sc_j · (q · x)` over its sub-blocks as eight i32,
    /// and `Σ_j m_j · (Σ x over sub-block j)` as four i32. Needs AVX2.
    #[inline(always)]
    pub(crate) unsafe fn q4k_block_avx2(w: &BlockQ4K, x: &BlockQ8K) -> (__m256i, __m128i) {
        // SAFETY: the caller enabled AVX2; every load reads inside a block field of the
        // stated size (qs: 128 / 256 bytes, offsets below are in range).
        unsafe {
            let m4 = _mm256_set1_epi8(0x0F);
            // Shuffle masks broadcasting i16 lane k of each 128-bit half.
            let bcast = |k: i16| _mm256_set1_epi16(((2 * k + 1) << 8) | (2 * k));
            let sm = unpack_q4k_scales(&w.scales);
            let mins = q4k_mins(&sm, x);
            // The eight scales as i16, the same in both 128-bit halves.
            let sc = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_loadl_epi64(
                sm.as_ptr() as *const __m128i
            )));
            let (qp, yp) = (w.qs.as_ptr(), x.qs.as_ptr());
            let mut sumi = _mm256_setzero_si256();
            for g in 0..QK_K / 64 {
                // 32 bytes hold 64 quants: low nibbles are sub-block 2g, high 2g + 1.
                let bits = _mm256_loadu_si256(qp.add(32 * g) as *const __m256i);
                let lo = _mm256_and_si256(bits, m4);
                let hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
                let ylo = _mm256_loadu_si256(yp.add(64 * g) as *const __m256i);
                let yhi = _mm256_loadu_si256(yp.add(64 * g + 32) as *const __m256i);
                // ≤ 15·128·2 per i16: no saturation.
                let plo = _mm256_maddubs_epi16(lo, ylo);
                let phi = _mm256_maddubs_epi16(hi, yhi);
                let slo = _mm256_shuffle_epi8(sc, bcast(2 * g as i16));
                let shi = _mm256_shuffle_epi8(sc, bcast(2 * g as i16 + 1));
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(slo, plo));
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(shi, phi));
            }
            (sumi, mins)
        }
    }

    /// # Safety
    /// AVX2, FMA and F16C must be available.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q4_k_avx2(w: &[BlockQ4K], x: &[BlockQ8K]) -> f32 {
        // SAFETY: this function enables AVX2, FMA, F16C, which the helpers need.
        unsafe {
            let mut acc = _mm256_setzero_ps();
            let mut acc_m = _mm_setzero_ps();
            for (w, x) in w.iter().zip(x) {
                let (d, dmin) = f16x2_times(w.d.to_bits(), w.dmin.to_bits(), x.d);
                let (sumi, mins) = q4k_block_avx2(w, x);
                acc_m = _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(mins), acc_m);
                acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
            }
            hsum256(acc) - hsum128(acc_m)
        }
    }

    /// # Safety
    /// AVX-512 F, BW, VL and VNNI, AVX2, FMA and F16C must be available.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub unsafe fn dot_q4_k_avx512(w: &[BlockQ4K], x: &[BlockQ8K]) -> f32 {
        // SAFETY: this function enables the features used; every load reads inside a block
        // field of the stated size.
        unsafe {
            let m4 = _mm512_set1_epi8(0x0F);
            // i16 lanes 0..16 take scale 2g, lanes 16..32 scale 2g + 1.
            let idx = |g: i16| {
                let (a, b) = (2 * g, 2 * g + 1);
                _mm512_set_epi16(
                    b, b, b, b, b, b, b, b, b, b, b, b, b, b, b, b, a, a, a, a, a, a, a, a, a, a,
                    a, a, a, a, a, a,
                )
            };
            let idxs = [idx(0), idx(1), idx(2), idx(3)];
            let mut acc = _mm512_setzero_ps();
            let mut acc_m = _mm_setzero_ps();
            for (w, x) in w.iter().zip(x) {
                let (d, dmin) = f16x2_times(w.d.to_bits(), w.dmin.to_bits(), x.d);
                let sm = unpack_q4k_scales(&w.scales);
                let prod = q4k_mins(&sm, x);
                acc_m = _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(prod), acc_m);

                let sc = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_loadl_epi64(
                    sm.as_ptr() as *const __m128i
                )));
                let (qp, yp) = (w.qs.as_ptr(), x.qs.as_ptr());
                let mut sumi = _mm512_setzero_si512();
                for (g, idx) in idxs.iter().enumerate() {
                    // The 32 bytes of group g in both halves; the upper half takes the high
                    // nibbles, so the 64 quants line up with 64 contiguous activations.
                    let bits = _mm512_broadcast_i64x4(_mm256_loadu_si256(
                        qp.add(32 * g) as *const __m256i
                    ));
                    let bits = _mm512_mask_blend_epi64(0xF0, bits, _mm512_srli_epi16(bits, 4));
                    let q = _mm512_and_si512(bits, m4);
                    let y = _mm512_loadu_si512(yp.add(64 * g) as *const _);
                    let p = _mm512_maddubs_epi16(q, y);
                    sumi = _mm512_dpwssd_epi32(sumi, p, _mm512_permutexvar_epi16(*idx, sc));
                }
                acc = _mm512_fmadd_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(sumi), acc);
            }
            _mm512_reduce_add_ps(acc) - hsum128(acc_m)
        }
    }

    /// Shuffle masks for [`dot_q6_k_avx2`]: bytes `[2i; 8] ++ [2i + 1; 8]`.
    #[inline(always)]
    unsafe fn q6_scale_shuffle(i: i8) -> __m128i {
        // SAFETY: the caller enabled SSE2.
        unsafe {
            let (a, b) = (2 * i, 2 * i + 1);
            _mm_setr_epi8(a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b)
        }
    }

    /// `Σ q·x` of one Q6_K block against `x` with its sub-block scales (the −32 offset
    /// taken out) as eight i32. Needs AVX2.
    #[inline(always)]
    pub(crate) unsafe fn q6k_block_avx2(w: &BlockQ6K, x: &BlockQ8K) -> __m256i {
        // SAFETY: the caller enabled AVX2; every load reads inside a block field of the
        // stated size (ql 128, qh 64, scales 16, qs 256, bsums 32 bytes).
        unsafe {
            let m4 = _mm256_set1_epi8(0x0F);
            let m30 = _mm256_set1_epi8(0x30);
            let shuf: [__m128i; 8] = std::array::from_fn(|i| q6_scale_shuffle(i as i8));
            let scales = _mm_loadu_si128(w.scales.as_ptr() as *const __m128i);
            // 32·Σ sc·bsum, the −32 offset of every quant.
            let bsums = _mm256_loadu_si256(x.bsums.as_ptr() as *const __m256i);
            let summ = _mm256_madd_epi16(_mm256_cvtepi8_epi16(scales), bsums);
            let mut sumi = _mm256_setzero_si256();
            for h in 0..2 {
                let ql = w.ql.as_ptr().add(64 * h);
                let ql0 = _mm256_loadu_si256(ql as *const __m256i);
                let ql1 = _mm256_loadu_si256(ql.add(32) as *const __m256i);
                let qh = _mm256_loadu_si256(w.qh.as_ptr().add(32 * h) as *const __m256i);
                // Bit pairs 0-1, 2-3, 4-5, 6-7 of qh moved to bits 4-5 (the 16-bit shifts
                // leak bits across bytes only outside the 0x30 mask).
                let q = [
                    _mm256_or_si256(
                        _mm256_and_si256(ql0, m4),
                        _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(ql1, m4),
                        _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                        _mm256_and_si256(qh, m30),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                        _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30),
                    ),
                ];
                for (k, q) in q.iter().enumerate() {
                    let y =
                        _mm256_loadu_si256(x.qs.as_ptr().add(128 * h + 32 * k) as *const __m256i);
                    // ≤ 63·128·2 per i16: no saturation.
                    let p = _mm256_maddubs_epi16(*q, y);
                    // i16 lanes 0..8 are the first 16 elements, lanes 8..16 the next.
                    let sc = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, shuf[4 * h + k]));
                    sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(sc, p));
                }
            }
            _mm256_sub_epi32(sumi, _mm256_slli_epi32(summ, 5))
        }
    }

    /// # Safety
    /// AVX2, FMA and F16C must be available.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q6_k_avx2(w: &[BlockQ6K], x: &[BlockQ8K]) -> f32 {
        // SAFETY: this function enables AVX2, FMA, F16C, which the helper needs.
        unsafe {
            let mut acc = _mm256_setzero_ps();
            for (w, x) in w.iter().zip(x) {
                let (d, _) = f16x2_times(w.d.to_bits(), 0, x.d);
                let total = q6k_block_avx2(w, x);
                acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(total), acc);
            }
            hsum256(acc)
        }
    }

    /// # Safety
    /// AVX-512 F, BW, VL and VNNI, AVX2, FMA and F16C must be available.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub unsafe fn dot_q6_k_avx512(w: &[BlockQ6K], x: &[BlockQ8K]) -> f32 {
        // SAFETY: this function enables the features used; every load reads inside a block
        // field of the stated size.
        unsafe {
            let idx = q6k_scale_index();
            let mut acc = _mm512_setzero_ps();
            for (w, x) in w.iter().zip(x) {
                let (d, _) = f16x2_times(w.d.to_bits(), 0, x.d);
                let y = std::array::from_fn(|i| {
                    _mm512_loadu_si512(x.qs.as_ptr().add(64 * i) as *const _)
                });
                let bsums = _mm256_loadu_si256(x.bsums.as_ptr() as *const __m256i);
                let total = q6k_block(w, &y, bsums, &idx);
                acc = _mm512_fmadd_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(total), acc);
            }
            _mm512_reduce_add_ps(acc)
        }
    }

    /// The permute indices [`q6k_block`] takes: i16 lane i of a 64-quant product covers
    /// elements 2i, 2i + 1, so it takes scale `base + i/8`, for bases 0, 4, 8, 12.
    ///
    /// # Safety
    /// AVX-512 F must be available.
    #[inline(always)]
    pub(crate) unsafe fn q6k_scale_index() -> [__m512i; 4] {
        let lanes: [[i16; 32]; 4] =
            std::array::from_fn(|q| std::array::from_fn(|i| (4 * q + i / 8) as i16));
        let load = |l: &[i16; 32]| l.as_ptr() as *const __m512i;
        // SAFETY: each row of `lanes` is 64 readable bytes; the caller enabled AVX-512 F.
        // (The loads are not in a closure: one would be compiled without AVX-512.)
        unsafe {
            [
                _mm512_loadu_si512(load(&lanes[0]) as *const _),
                _mm512_loadu_si512(load(&lanes[1]) as *const _),
                _mm512_loadu_si512(load(&lanes[2]) as *const _),
                _mm512_loadu_si512(load(&lanes[3]) as *const _),
            ]
        }
    }

    /// `Σ sc·(q − 32)·y` of one Q6_K block as 16 i32 lanes (to be summed), given the
    /// activation block's 256 quants `y` (four 64-byte loads) and 16 sums `bsums`.
    ///
    /// # Safety
    /// AVX-512 F/BW/VNNI and AVX2 must be available.
    #[inline(always)]
    pub(crate) unsafe fn q6k_block(
        w: &BlockQ6K,
        y: &[__m512i; 4],
        bsums: __m256i,
        idx: &[__m512i; 4],
    ) -> __m512i {
        // SAFETY: the caller enabled the features; loads read inside the block's fields.
        unsafe {
            let m4 = _mm512_set1_epi8(0x0F);
            let m30 = _mm512_set1_epi8(0x30);
            let sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(w.scales.as_ptr() as *const __m128i));
            // 32·Σ sc·bsum, the −32 offset of every quant.
            let summ = _mm512_zextsi256_si512(_mm256_madd_epi16(sc16, bsums));
            let sc = _mm512_castsi256_si512(sc16);
            let mut sumi = _mm512_setzero_si512();
            for h in 0..2 {
                // ql's 64 bytes: low nibbles are elements 0..64 of this half, high nibbles
                // elements 64..128, each matching 64 contiguous activations.
                let ql = _mm512_loadu_si512(w.ql.as_ptr().add(64 * h) as *const _);
                let qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(
                    w.qh.as_ptr().add(32 * h) as *const __m256i
                ));
                // Lower 256 bits take qh bits 0-1 (resp. 4-5), upper bits 2-3 (6-7).
                let hlo = _mm512_mask_blend_epi64(
                    0xF0,
                    _mm512_slli_epi16(qh, 4),
                    _mm512_slli_epi16(qh, 2),
                );
                let hhi = _mm512_mask_blend_epi64(0xF0, qh, _mm512_srli_epi16(qh, 2));
                // (a & 0x0F) | (b & 0x30), the second step one ternary-logic op.
                let qlo = _mm512_ternarylogic_epi32::<0xD8>(_mm512_and_si512(ql, m4), hlo, m30);
                let qhi = _mm512_ternarylogic_epi32::<0xD8>(
                    _mm512_and_si512(_mm512_srli_epi16(ql, 4), m4),
                    hhi,
                    m30,
                );
                // ≤ 63·128·2 per i16: no saturation.
                let plo = _mm512_maddubs_epi16(qlo, y[2 * h]);
                let phi = _mm512_maddubs_epi16(qhi, y[2 * h + 1]);
                sumi = _mm512_dpwssd_epi32(sumi, plo, _mm512_permutexvar_epi16(idx[2 * h], sc));
                sumi = _mm512_dpwssd_epi32(sumi, phi, _mm512_permutexvar_epi16(idx[2 * h + 1], sc));
            }
            _mm512_sub_epi32(sumi, _mm512_slli_epi32(summ, 5))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dot::test_util::{assert_close, isas, ref_dot};
    use crate::dot::Isa;
    use half::f16;
    use kiln_core::quant::{as_blocks, dequantize_to_vec, q4k_scale_min, quantize, quantize_q8_k};
    use kiln_core::DType;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn run_q4k(isa: Isa, w: &[BlockQ4K], x: &[BlockQ8K]) -> f32 {
        match isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: tests only run ISAs reported available.
            Isa::Avx2 => unsafe { x86::dot_q4_k_avx2(w, x) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            Isa::Avx512Vnni => unsafe { x86::dot_q4_k_avx512(w, x) },
            _ => dot_q4_k_portable(w, x),
        }
    }

    fn run_q6k(isa: Isa, w: &[BlockQ6K], x: &[BlockQ8K]) -> f32 {
        match isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: tests only run ISAs reported available.
            Isa::Avx2 => unsafe { x86::dot_q6_k_avx2(w, x) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            Isa::Avx512Vnni => unsafe { x86::dot_q6_k_avx512(w, x) },
            _ => dot_q6_k_portable(w, x),
        }
    }

    fn deq<B: bytemuck::Pod>(dtype: DType, blocks: &[B]) -> Vec<f32> {
        let bytes: &[u8] = bytemuck::cast_slice(blocks);
        dequantize_to_vec(dtype, bytes, blocks.len() * QK_K).unwrap()
    }

    fn blocks<B: bytemuck::Pod>(dtype: DType, v: &[f32]) -> Vec<B> {
        as_blocks::<B>(&quantize(dtype, v).unwrap())
            .unwrap()
            .into_owned()
    }

    fn q8k(v: &[f32]) -> Vec<BlockQ8K> {
        let mut out = vec![bytemuck::Zeroable::zeroed(); v.len() / QK_K];
        quantize_q8_k(v, &mut out).unwrap();
        out
    }

    /// Q8_K values are `q · d`.
    fn deq_q8k(x: &[BlockQ8K]) -> Vec<f32> {
        x.iter()
            .flat_map(|b| b.qs.iter().map(move |&q| q as f32 * b.d))
            .collect()
    }

    /// Sets `bsums` from `qs`, as `quantize_q8_k` does.
    fn with_bsums(mut b: BlockQ8K) -> BlockQ8K {
        for (s, g) in b.bsums.iter_mut().zip(b.qs.chunks_exact(16)) {
            *s = g.iter().map(|&q| q as i16).sum();
        }
        b
    }

    fn check(w4: &[BlockQ4K], w6: &[BlockQ6K], x: &[BlockQ8K], what: &str) {
        let xf = deq_q8k(x);
        let (r4, a4) = ref_dot(&deq(DType::Q4_K, w4), &xf);
        let (r6, a6) = ref_dot(&deq(DType::Q6_K, w6), &xf);
        let n = x.len();
        for isa in isas() {
            let tag = |k: &str| format!("{what} {k} blocks={n} {}", isa.name());
            assert_close(run_q4k(isa, w4, x), r4, a4, 1e-5, &tag("q4_K"));
            assert_close(run_q6k(isa, w6, x), r6, a6, 1e-5, &tag("q6_K"));
        }
        assert_close(
            crate::dot::dot_q4_k(w4, x),
            r4,
            a4,
            1e-5,
            &format!("{what} dispatch q4_K"),
        );
        assert_close(
            crate::dot::dot_q6_k(w6, x),
            r6,
            a6,
            1e-5,
            &format!("{what} dispatch q6_K"),
        );
    }

    const BLOCKS: [usize; 6] = [0, 1, 2, 3, 5, 17];

    #[test]
    fn unpack_scales_matches_core() {
        let mut rng = StdRng::seed_from_u64(0x5CA1E);
        for _ in 0..1000 {
            let s: [u8; 12] = rng.random();
            let u = unpack_q4k_scales(&s);
            for j in 0..8 {
                assert_eq!((u[j], u[8 + j]), q4k_scale_min(j, &s));
            }
        }
    }

    #[test]
    fn quantized_random() {
        let mut rng = StdRng::seed_from_u64(0x4B);
        for n in BLOCKS {
            let wv: Vec<f32> = (0..n * QK_K).map(|_| rng.random_range(-1.0..1.5)).collect();
            let xv: Vec<f32> = (0..n * QK_K).map(|_| rng.random_range(-1.0..1.0)).collect();
            let x = q8k(&xv);
            check(
                &blocks(DType::Q4_K, &wv),
                &blocks(DType::Q6_K, &wv),
                &x,
                "quantized",
            );
        }
    }

    /// Raw random bytes cover every quant, scale and min value (-128 activations included).
    #[test]
    fn raw_random() {
        let mut rng = StdRng::seed_from_u64(0x4C);
        for n in BLOCKS {
            let x: Vec<BlockQ8K> = (0..n)
                .map(|_| {
                    let mut b: BlockQ8K = bytemuck::Zeroable::zeroed();
                    b.d = rng.random_range(-0.01..0.01);
                    rng.fill(&mut b.qs[..]);
                    with_bsums(b)
                })
                .collect();
            let w4: Vec<BlockQ4K> = (0..n)
                .map(|_| BlockQ4K {
                    d: f16::from_f32(rng.random_range(-0.01..0.01)),
                    dmin: f16::from_f32(rng.random_range(-0.01..0.01)),
                    scales: rng.random(),
                    qs: std::array::from_fn(|_| rng.random()),
                })
                .collect();
            let w6: Vec<BlockQ6K> = (0..n)
                .map(|_| BlockQ6K {
                    ql: std::array::from_fn(|_| rng.random()),
                    qh: std::array::from_fn(|_| rng.random()),
                    scales: rng.random(),
                    d: f16::from_f32(rng.random_range(-0.01..0.01)),
                })
                .collect();
            check(&w4, &w6, &x, "raw");
        }
    }

    #[test]
    fn equal_and_extreme() {
        for n in BLOCKS {
            let w = vec![0.25f32; n * QK_K];
            let x = q8k(&vec![-2.0f32; n * QK_K]);
            check(
                &blocks(DType::Q4_K, &w),
                &blocks(DType::Q6_K, &w),
                &x,
                "equal",
            );

            // Largest magnitudes: quants 15 / 0 (Q4_K) and 0 → -32 (Q6_K), scales 63 and
            // -128, activations -128, all at scale 1e4.
            let big = f16::from_f32(1e4);
            let mut xb: BlockQ8K = bytemuck::Zeroable::zeroed();
            xb.d = 1e4;
            xb.qs = [-128; QK_K];
            let x = vec![with_bsums(xb); n];
            let w4 = vec![
                BlockQ4K {
                    d: big,
                    dmin: big,
                    scales: [0xFF; 12],
                    qs: [0x0F; QK_K / 2]
                };
                n
            ];
            let w6 = vec![
                BlockQ6K {
                    ql: [0; QK_K / 2],
                    qh: [0; QK_K / 4],
                    scales: [-128; 16],
                    d: big
                };
                n
            ];
            check(&w4, &w6, &x, "extreme-neg");
            let w6 = vec![
                BlockQ6K {
                    ql: [0xFF; QK_K / 2],
                    qh: [0xFF; QK_K / 4],
                    scales: [127; 16],
                    d: -big
                };
                n
            ];
            let w4 = vec![
                BlockQ4K {
                    d: -big,
                    dmin: big,
                    scales: [0x3F; 12],
                    qs: [0xF0; QK_K / 2]
                };
                n
            ];
            check(&w4, &w6, &x, "extreme-mixed");
        }
    }
}
