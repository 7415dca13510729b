//! Dot products between one weight row and one activation vector, the inner loop of every
//! matrix-vector product on the CPU.
//!
//! Each public function dispatches on [`isa()`] (detected once) to one of:
//! - a portable scalar kernel, always compiled, mirroring ggml's `ggml_vec_dot_*_generic`;
//! - an AVX2 + FMA + F16C kernel (x86_64);
//! - an AVX-512 (F + BW + VL + VNNI) kernel (x86_64);
//! - on aarch64, NEON (see the per-family files for which kernels have a NEON body).
//!
//! Quantized kernels compute exact integer dot products per block and apply the block
//! scales in f32, like ggml. Activations are quantized to Q8_0 (for Q8_0/Q4_0 weights) or
//! Q8_K (for the K formats) by the caller.

mod float;
pub(crate) mod k_quants;
mod q8_0;

use half::{bf16, f16};
use kiln_core::quant::{BlockQ4K, BlockQ4_0, BlockQ6K, BlockQ8K, BlockQ8_0};
use std::sync::OnceLock;

/// The instruction set a kernel family is compiled for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// x86_64 with AVX-512 F, BW, VL and VNNI (plus AVX2, FMA, F16C).
    Avx512Vnni,
    /// x86_64 with AVX2, FMA and F16C.
    Avx2,
    /// aarch64 Advanced SIMD.
    Neon,
    /// Scalar Rust, any target.
    Portable,
}

impl Isa {
    /// The best instruction set this CPU supports.
    pub fn detect() -> Isa {
        if Isa::Avx512Vnni.available() {
            Isa::Avx512Vnni
        } else if Isa::Avx2.available() {
            Isa::Avx2
        } else if Isa::Neon.available() {
            Isa::Neon
        } else {
            Isa::Portable
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Isa::Avx512Vnni => "avx512vnni",
            Isa::Avx2 => "avx2",
            Isa::Neon => "neon",
            Isa::Portable => "portable",
        }
    }

    /// Whether this CPU can run kernels built for `self`.
    pub(crate) fn available(self) -> bool {
        match self {
            Isa::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vnni => {
                Isa::Avx2.available()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => std::arch::is_aarch64_feature_detected!("neon"),
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    fn from_name(name: &str) -> Option<Isa> {
        match name.trim().to_ascii_lowercase().as_str() {
            "portable" | "scalar" | "generic" => Some(Isa::Portable),
            "avx2" => Some(Isa::Avx2),
            // AMX is an addition to AVX-512 (see `crate::amx::bf16_available`).
            "avx512" | "avx512vnni" | "avx512_vnni" | "amx" => Some(Isa::Avx512Vnni),
            "neon" => Some(Isa::Neon),
            _ => None,
        }
    }
}

/// The instruction set the public kernels use: detected on first call, or the one named by
/// `KILN_CPU_ISA` (`portable`, `avx2`, `avx512`, `amx`, `neon`) when this CPU supports it.
/// AMX tiles are used on top of AVX-512 unless another set is named.
pub fn isa() -> Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(|| {
        std::env::var("KILN_CPU_ISA")
            .ok()
            .and_then(|name| Isa::from_name(&name))
            .filter(|isa| isa.available())
            .unwrap_or_else(Isa::detect)
    })
}

// Every `unsafe` call below relies on the same fact: `isa()` only returns an ISA for which
// `Isa::available()` holds, so the target features the kernel is compiled with are present.

/// Σ w·x over f32.
pub fn dot_f32(w: &[f32], x: &[f32]) -> f32 {
    debug_assert_eq!(w.len(), x.len());
    match isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX-512 F/BW/VL/VNNI, AVX2, FMA, F16C were detected (see `isa`).
        Isa::Avx512Vnni => unsafe { float::x86::dot_f32_avx512(w, x) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2, FMA, F16C were detected (see `isa`).
        Isa::Avx2 => unsafe { float::x86::dot_f32_avx2(w, x) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: NEON was detected (see `isa`).
        Isa::Neon => unsafe { float::neon::dot_f32(w, x) },
        _ => float::dot_f32_portable(w, x),
    }
}

/// Σ w·x with f16 weights.
pub fn dot_f16(w: &[f16], x: &[f32]) -> f32 {
    debug_assert_eq!(w.len(), x.len());
    match isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX-512 F/BW/VL/VNNI, AVX2, FMA, F16C were detected (see `isa`).
        Isa::Avx512Vnni => unsafe { float::x86::dot_f16_avx512(w, x) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2, FMA, F16C were detected (see `isa`).
        Isa::Avx2 => unsafe { float::x86::dot_f16_avx2(w, x) },
        _ => float::dot_f16_portable(w, x),
    }
}

/// Σ w·x with bf16 weights.
pub fn dot_bf16(w: &[bf16], x: &[f32]) -> f32 {
    debug_assert_eq!(w.len(), x.len());
    match isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX-512 F/BW/VL/VNNI, AVX2, FMA, F16C were detected (see `isa`).
        Isa::Avx512Vnni => unsafe { float::x86::dot_bf16_avx512(w, x) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2, FMA, F16C were detected (see `isa`).
        Isa::Avx2 => unsafe { float::x86::dot_bf16_avx2(w, x) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: NEON was detected (see `isa`).
        Isa::Neon => unsafe { float::neon::dot_bf16(w, x) },
        _ => float::dot_bf16_portable(w, x),
    }
}

/// Q8_0 weights · Q8_0 activations.
pub fn dot_q8_0(w: &[BlockQ8_0], x: &[BlockQ8_0]) -> f32 {
    debug_assert_eq!(w.len(), x.len());
    match isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX-512 F/BW/VL/VNNI, AVX2, FMA, F16C were detected (see `isa`).
        Isa::Avx512Vnni => unsafe { q8_0::x86::dot_q8_0_avx512(w, x) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2, FMA, F16C were detected (see `isa`).
        Isa::Avx2 => unsafe { q8_0::x86::dot_q8_0_avx2(w, x) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: NEON was detected (see `isa`).
        Isa::Neon => unsafe { q8_0::neon::dot_q8_0(w, x) },
        _ => q8_0::dot_q8_0_portable(w, x),
    }
}

/// Q4_0 weights · Q8_0 activations.
pub fn dot_q4_0(w: &[BlockQ4_0], x: &[BlockQ8_0]) -> f32 {
    debug_assert_eq!(w.len(), x.len());
    match isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX-512 F/BW/VL/VNNI, AVX2, FMA, F16C were detected (see `isa`).
        Isa::Avx512Vnni => unsafe { q8_0::x86::dot_q4_0_avx512(w, x) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2, FMA, F16C were detected (see `isa`).
        Isa::Avx2 => unsafe { q8_0::x86::dot_q4_0_avx2(w, x) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: NEON was detected (see `isa`).
        Isa::Neon => unsafe { q8_0::neon::dot_q4_0(w, x) },
        _ => q8_0::dot_q4_0_portable(w, x),
    }
}

/// Q4_K weights · Q8_K activations.
pub fn dot_q4_k(w: &[BlockQ4K], x: &[BlockQ8K]) -> f32 {
    debug_assert_eq!(w.len(), x.len());
    match isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX-512 F/BW/VL/VNNI, AVX2, FMA, F16C were detected (see `isa`).
        Isa::Avx512Vnni => unsafe { k_quants::x86::dot_q4_k_avx512(w, x) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2, FMA, F16C were detected (see `isa`).
        Isa::Avx2 => unsafe { k_quants::x86::dot_q4_k_avx2(w, x) },
        _ => k_quants::dot_q4_k_portable(w, x),
    }
}

/// Q6_K weights · Q8_K activations.
pub fn dot_q6_k(w: &[BlockQ6K], x: &[BlockQ8K]) -> f32 {
    debug_assert_eq!(w.len(), x.len());
    match isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX-512 F/BW/VL/VNNI, AVX2, FMA, F16C were detected (see `isa`).
        Isa::Avx512Vnni => unsafe { k_quants::x86::dot_q6_k_avx512(w, x) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2, FMA, F16C were detected (see `isa`).
        Isa::Avx2 => unsafe { k_quants::x86::dot_q6_k_avx2(w, x) },
        _ => k_quants::dot_q6_k_portable(w, x),
    }
}

#[cfg(test)]
pub(crate) mod test_util {
    use super::Isa;
    use crate::pool::Pool;

    /// A pool of two threads shared by the kernel tests, so that they run their parallel
    /// loops as the backend does.
    pub fn test_pool() -> &'static Pool {
        static POOL: std::sync::OnceLock<Pool> = std::sync::OnceLock::new();
        POOL.get_or_init(|| Pool::new(2).expect("test threads"))
    }

    /// The best of `reps` runs of `f` on a pool of `threads` threads, in seconds (for the
    /// `bench` modules' kernel timings).
    pub fn best_seconds(threads: usize, reps: usize, mut f: impl FnMut(&Pool)) -> f64 {
        let pool = Pool::new(threads).expect("bench threads");
        (0..reps)
            .map(|_| {
                let t = std::time::Instant::now();
                f(&pool);
                t.elapsed().as_secs_f64()
            })
            .fold(f64::INFINITY, f64::min)
    }

    /// The ISAs this machine can run, each tested directly.
    pub fn isas() -> Vec<Isa> {
        [Isa::Portable, Isa::Avx2, Isa::Avx512Vnni, Isa::Neon]
            .into_iter()
            .filter(|i| i.available())
            .collect()
    }

    /// |got − want| ≤ tol · Σ|w·x| (plus a tiny absolute floor for all-zero inputs).
    #[track_caller]
    pub fn assert_close(got: f32, want: f64, abs_sum: f64, tol: f64, what: &str) {
        let err = (got as f64 - want).abs();
        let bound = tol * abs_sum + 1e-30;
        assert!(
            err <= bound,
            "{what}: got {got}, want {want}, err {err:e} > {bound:e} (Σ|wx| = {abs_sum:e})"
        );
    }

    /// A batched kernel's `out[n, m]` against the per-row dot kernel: `want(i, r)` is the
    /// dot kernel's value for activation row i and weight row r, with Σ|w·x| of the
    /// dequantized values; they must agree to 1e-5 of the larger of the two.
    #[track_caller]
    pub fn assert_batched(
        out: &[f32],
        n: usize,
        m: usize,
        what: &str,
        want: impl Fn(usize, usize) -> (f32, f64),
    ) {
        for i in 0..n {
            for r in 0..m {
                let (want, abs) = want(i, r);
                let got = out[i * m + r];
                let err = (got - want).abs() as f64;
                assert!(
                    err <= 1e-5 * abs.max(want.abs() as f64) + 1e-30,
                    "{what} [{i}, {r}]: got {got}, want {want}"
                );
            }
        }
    }

    /// Σ w·x and Σ|w·x| in f64.
    pub fn ref_dot(w: &[f32], x: &[f32]) -> (f64, f64) {
        assert_eq!(w.len(), x.len());
        w.iter().zip(x).fold((0.0, 0.0), |(s, a), (&w, &x)| {
            let p = w as f64 * x as f64;
            (s + p, a + p.abs())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn isa_names_and_detection() {
        let detected = Isa::detect();
        let names: Vec<_> = test_util::isas().iter().map(|i| i.name()).collect();
        eprintln!(
            "detected {}, dispatching {}, testing {names:?}",
            detected.name(),
            isa().name()
        );
        assert!(detected.available());
        assert!(isa().available());
        for i in [Isa::Avx512Vnni, Isa::Avx2, Isa::Neon, Isa::Portable] {
            assert_eq!(Isa::from_name(i.name()), Some(i));
        }
        assert_eq!(Isa::from_name("AVX512"), Some(Isa::Avx512Vnni));
        assert_eq!(Isa::from_name("nope"), None);
    }
}

/// Single-thread throughput of every kernel on every available ISA, in GB/s of weights
/// streamed. `cargo test -p kiln-cpu --lib dot::bench -- --ignored --nocapture` (build with
/// optimisations for meaningful numbers).
#[cfg(all(test, target_arch = "x86_64"))]
mod bench {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{RngCore, SeedableRng};
    use std::time::Instant;

    /// Random bytes; fine for quant blocks (f16 scales become normal f32 values or NaN,
    /// neither slower than usual).
    fn random_blocks<B: bytemuck::Pod>(rng: &mut StdRng, n: usize) -> Vec<B> {
        let mut bytes = vec![0u8; n * std::mem::size_of::<B>()];
        rng.fill_bytes(&mut bytes);
        bytemuck::pod_collect_to_vec(&bytes)
    }

    /// Weight-like floats (random bits would include f32 subnormals, which are slow).
    fn floats<T>(n: usize, f: fn(f32) -> T) -> Vec<T> {
        (0..n)
            .map(|i| f(((i * 7919 % 1000) as f32 - 500.0) * 1e-3))
            .collect()
    }

    /// Runs `f(row)` over all rows a few times, returning the best GB/s.
    fn time(rows: usize, row_bytes: usize, mut f: impl FnMut(usize) -> f32) -> f64 {
        let mut best = f64::INFINITY;
        let mut sink = 0f32;
        for _ in 0..5 {
            let t = Instant::now();
            for r in 0..rows {
                sink += f(r);
            }
            best = best.min(t.elapsed().as_secs_f64());
        }
        std::hint::black_box(sink);
        (rows * row_bytes) as f64 / best / 1e9
    }

    fn bench_all(k: usize, total_bytes: usize) {
        let mut rng = StdRng::seed_from_u64(7);
        let isas = test_util::isas();
        let x: Vec<f32> = (0..k).map(|i| (i as f32).sin()).collect();
        let xq8: Vec<BlockQ8_0> = random_blocks(&mut rng, k / 32);
        let mut xq8k: Vec<BlockQ8K> = random_blocks(&mut rng, k / 256);
        xq8k.iter_mut().for_each(|b| b.d = 0.01);
        macro_rules! run {
            ($name:expr, $ty:ty, $per_row:expr, $xs:expr, $call:ident, $make:expr) => {{
                let row_bytes = $per_row * std::mem::size_of::<$ty>();
                let rows = (total_bytes / row_bytes).max(1);
                let w: Vec<$ty> = $make(&mut rng, rows * $per_row);
                let mut line = format!(
                    "{:>6} k={k} {:>7.1} MB:",
                    $name,
                    (rows * row_bytes) as f64 / 1e6
                );
                for &i in &isas {
                    let gbs = time(rows, row_bytes, |r| {
                        $call(i, &w[r * $per_row..(r + 1) * $per_row], &$xs)
                    });
                    line += &format!("  {} {gbs:6.1} GB/s", i.name());
                }
                eprintln!("{line}");
            }};
        }

        run!("f32", f32, k, x, call_f32, |_: &mut StdRng, n| floats(
            n,
            |v| v
        ));
        run!("f16", f16, k, x, call_f16, |_: &mut StdRng, n| floats(
            n,
            f16::from_f32
        ));
        run!("bf16", bf16, k, x, call_bf16, |_: &mut StdRng, n| floats(
            n,
            bf16::from_f32
        ));
        run!("q8_0", BlockQ8_0, k / 32, xq8, call_q8_0, random_blocks);
        run!("q4_0", BlockQ4_0, k / 32, xq8, call_q4_0, random_blocks);
        run!("q4_K", BlockQ4K, k / 256, xq8k, call_q4_k, random_blocks);
        run!("q6_K", BlockQ6K, k / 256, xq8k, call_q6_k, random_blocks);
    }

    /// Forces one ISA by calling its kernel directly.
    macro_rules! direct {
        ($fn_name:ident, $w:ty, $x:ty, $portable:path, $avx2:path, $avx512:path) => {
            fn $fn_name(isa: Isa, w: &[$w], x: &[$x]) -> f32 {
                match isa {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: only ISAs reported available are benchmarked.
                    Isa::Avx2 => unsafe { $avx2(w, x) },
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: as above.
                    Isa::Avx512Vnni => unsafe { $avx512(w, x) },
                    _ => $portable(w, x),
                }
            }
        };
    }
    direct!(
        call_f32,
        f32,
        f32,
        float::dot_f32_portable,
        float::x86::dot_f32_avx2,
        float::x86::dot_f32_avx512
    );
    direct!(
        call_f16,
        f16,
        f32,
        float::dot_f16_portable,
        float::x86::dot_f16_avx2,
        float::x86::dot_f16_avx512
    );
    direct!(
        call_bf16,
        bf16,
        f32,
        float::dot_bf16_portable,
        float::x86::dot_bf16_avx2,
        float::x86::dot_bf16_avx512
    );
    direct!(
        call_q8_0,
        BlockQ8_0,
        BlockQ8_0,
        q8_0::dot_q8_0_portable,
        q8_0::x86::dot_q8_0_avx2,
        q8_0::x86::dot_q8_0_avx512
    );
    direct!(
        call_q4_0,
        BlockQ4_0,
        BlockQ8_0,
        q8_0::dot_q4_0_portable,
        q8_0::x86::dot_q4_0_avx2,
        q8_0::x86::dot_q4_0_avx512
    );
    direct!(
        call_q4_k,
        BlockQ4K,
        BlockQ8K,
        k_quants::dot_q4_k_portable,
        k_quants::x86::dot_q4_k_avx2,
        k_quants::x86::dot_q4_k_avx512
    );
    direct!(
        call_q6_k,
        BlockQ6K,
        BlockQ8K,
        k_quants::dot_q6_k_portable,
        k_quants::x86::dot_q6_k_avx2,
        k_quants::x86::dot_q6_k_avx512
    );

    #[test]
    #[ignore]
    fn throughput() {
        eprintln!("in cache (L2-resident weights):");
        bench_all(4096, 512 << 10);
        eprintln!("from memory:");
        bench_all(4096, 256 << 20);
    }
}
