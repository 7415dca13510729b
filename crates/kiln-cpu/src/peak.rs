//! The machine's f32 multiply-add rate, measured: the ceiling of the products of prompts
//! over float weights (each weight-activation pair one FMA), against which `kiln bench
//! --kernels` sets them, as it sets decode's against the read bandwidth.
//!
//! Each thread runs chains of FMAs on registers only (no memory traffic), as wide as the
//! instruction set the kernels use and with enough independent chains to cover the FMA
//! latency on two pipes.

use crate::dot::Isa;
use std::time::Instant;

/// Independent accumulators a thread keeps: FMA latency (4-5 cycles) times two pipes,
/// with room to spare.
const CHAINS: usize = 12;

/// Multiply-adds per thread per measurement (floats, across all chains and lanes).
const FMAS_PER_THREAD: u64 = 1 << 31;

/// GFLOP/s (two per multiply-add) of f32 FMA on `threads` threads at once.
pub fn fma_gflops(threads: usize) -> f64 {
    let isa = Isa::detect();
    let threads = threads.max(1);
    let start = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(move || std::hint::black_box(fma_chains(isa, FMAS_PER_THREAD)));
        }
    });
    let seconds = start.elapsed().as_secs_f64();
    2.0 * FMAS_PER_THREAD as f64 * threads as f64 / seconds / 1e9
}

/// `fmas` multiply-adds in CHAINS chains; returns their sum (so that none is optimised away).
fn fma_chains(isa: Isa, fmas: u64) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: each body runs only where `isa` says the CPU has its instructions.
        match isa {
            Isa::Avx512Vnni => return unsafe { x86::fma_512(fmas / (16 * CHAINS as u64)) },
            Isa::Avx2 => return unsafe { x86::fma_256(fmas / (8 * CHAINS as u64)) },
            _ => {}
        }
    }
    let _ = isa;
    let mut acc = [0f32; CHAINS];
    for _ in 0..fmas / CHAINS as u64 {
        for a in acc.iter_mut() {
            *a = a.mul_add(0.999_999, 1e-7);
        }
    }
    acc.iter().sum()
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::CHAINS;
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn fma_512(rounds: u64) -> f32 {
        let (a, b) = (_mm512_set1_ps(0.999_999), _mm512_set1_ps(1e-7));
        let mut acc = [_mm512_setzero_ps(); CHAINS];
        for _ in 0..rounds {
            for v in acc.iter_mut() {
                *v = _mm512_fmadd_ps(*v, a, b);
            }
        }
        acc.iter().map(|&v| _mm512_reduce_add_ps(v)).sum()
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn fma_256(rounds: u64) -> f32 {
        let (a, b) = (_mm256_set1_ps(0.999_999), _mm256_set1_ps(1e-7));
        let mut acc = [_mm256_setzero_ps(); CHAINS];
        for _ in 0..rounds {
            for v in acc.iter_mut() {
                *v = _mm256_fmadd_ps(*v, a, b);
            }
        }
        let mut lanes = [0f32; 8];
        let mut sum = 0.0;
        for v in acc {
            _mm256_storeu_ps(lanes.as_mut_ptr(), v);
            sum += lanes.iter().sum::<f32>();
        }
        sum
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every path computes the same chains: CHAINS × lanes values of the recurrence
    /// a ← 0.999999·a + 1e-7 from 0 (checked against the scalar recurrence for the lanes
    /// this CPU has).
    #[test]
    fn every_path_runs_the_same_recurrence() {
        let rounds = 1000u64;
        let one = (0..rounds).fold(0f32, |a, _| a.mul_add(0.999_999, 1e-7));
        let portable = fma_chains(Isa::Portable, rounds * CHAINS as u64);
        assert!((portable - CHAINS as f32 * one).abs() <= 1e-6 * portable.abs());
        let isa = Isa::detect();
        let lanes: u64 = match isa {
            Isa::Avx512Vnni => 16,
            Isa::Avx2 => 8,
            _ => 1,
        };
        let wide = fma_chains(isa, rounds * lanes * CHAINS as u64);
        let want = (lanes * CHAINS as u64) as f32 * one;
        assert!(
            (wide - want).abs() <= 1e-5 * want.abs(),
            "{isa:?}: {wide} vs {want}"
        );
    }
}
