use super::*;
use crate::dot::{
    self,
    test_util::{assert_batched, ref_dot, test_pool},
};
use kiln_core::quant::{as_blocks, dequantize_to_vec, quantize, quantize_q8_k};
use kiln_core::DType;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The product of `matmul` against the per-row dot kernels (`dot`) and the plain f64
/// sums of the dequantized values.
fn check<W: KBlock>(dtype: DType, dot: fn(&[W], &[BlockQ8K]) -> f32, matmul: Kernel<W>) {
    let mut rng = StdRng::seed_from_u64(0x4b9e);
    for &k in &[256usize, 768, 2048] {
        for &m in &[1usize, 7, 130] {
            for &n in &[4usize, 5, 17, 64] {
                let wv: Vec<f32> = (0..m * k).map(|_| rng.random_range(-2.0..2.0)).collect();
                let xv: Vec<f32> = (0..n * k).map(|_| rng.random_range(-1.0..1.0)).collect();
                let wbytes = quantize(dtype, &wv).unwrap();
                let w = as_blocks::<W>(&wbytes).unwrap().into_owned();
                let mut xq = vec![BlockQ8K::zeroed(); n * k / QK_K];
                quantize_q8_k(&xv, &mut xq).unwrap();
                let wf = dequantize_to_vec(dtype, &wbytes, m * k).unwrap();
                let xf: Vec<f32> = xq
                    .iter()
                    .flat_map(|b| b.qs.map(|q| q as f32 * b.d))
                    .collect();
                // From the file's layout, and (Q4_K) from the CPU's panels.
                let panels = (dtype == DType::Q4_K)
                    .then(|| Panels::from_file(test_pool(), Format::Q4K, m, k, &wbytes).unwrap());
                let sources = [Some(KRows::File(&w)), panels.as_ref().map(KRows::Panels)];
                for (s, rows) in sources.into_iter().flatten().enumerate() {
                    let mut out = vec![f32::NAN; n * m];
                    matmul(test_pool(), rows, &xq, &mut out, n, m, k);
                    let nb = k / QK_K;
                    let what = format!("{dtype} k={k} m={m} n={n} source {s}");
                    assert_batched(&out, n, m, &what, |i, r| {
                        let want = dot(&w[r * nb..][..nb], &xq[i * nb..][..nb]);
                        (want, ref_dot(&wf[r * k..][..k], &xf[i * k..][..k]).1)
                    });
                }
            }
        }
    }
}

#[test]
fn batched_matches_dot_q4_k() {
    if !qgemm::available() {
        eprintln!("no AVX-512 VNNI: batched path not testable here");
        return;
    }
    check::<BlockQ4K>(DType::Q4_K, dot::dot_q4_k, matmul::<BlockQ4K>);
}

#[test]
fn amx_matches_dot_q4_k() {
    if !crate::amx::int8_available() {
        eprintln!("no AMX-INT8 (or not granted): AMX Q4_K path not testable here");
        return;
    }
    check::<BlockQ4K>(DType::Q4_K, dot::dot_q4_k, amx::matmul);
}

#[test]
fn batched_matches_dot_q6_k() {
    if !qgemm::available() {
        eprintln!("no AVX-512 VNNI: batched path not testable here");
        return;
    }
    check::<BlockQ6K>(DType::Q6_K, dot::dot_q6_k, matmul::<BlockQ6K>);
}

/// A batched K-format kernel, as the tests and benches take it: `(w, xq, out, n, m, k)`.
type Kernel<W> = fn(&Pool, KRows<'_, W>, &[BlockQ8K], &mut [f32], usize, usize, usize);

mod bench {
    use super::*;
    use crate::dot::test_util::best_seconds;

    /// The best of 5 runs of each kernel, alternating 3 times (this machine's speed moves
    /// between runs: only kernels timed side by side compare).
    fn throughput<W: KBlock>(
        dtype: DType,
        (n, m, k): (usize, usize, usize),
        kernels: &[(&str, Kernel<W>)],
    ) {
        let wv: Vec<f32> = (0..m * k)
            .map(|i| ((i * 7919 % 1000) as f32 - 500.0) * 1e-3)
            .collect();
        let xv: Vec<f32> = (0..n * k)
            .map(|i| ((i * 104729 % 1000) as f32 - 500.0) * 1e-3)
            .collect();
        let wb = quantize(dtype, &wv).unwrap();
        let w = as_blocks::<W>(&wb).unwrap().into_owned();
        let mut xq = vec![BlockQ8K::zeroed(); n * k / QK_K];
        quantize_q8_k(&xv, &mut xq).unwrap();
        let mut out = vec![0f32; n * m];
        let mut best = vec![f64::INFINITY; kernels.len()];
        for _ in 0..3 {
            for (b, (_, kernel)) in best.iter_mut().zip(kernels) {
                *b = b.min(best_seconds(1, 5, |pool| {
                    kernel(pool, KRows::File(&w), &xq, &mut out, n, m, k)
                }));
            }
        }
        for ((name, _), best) in kernels.iter().zip(best) {
            eprintln!(
                "{dtype} {name} n={n} m={m} k={k}: {:.2} ms, {:.1} GMAC/s on 1 thread",
                best * 1e3,
                (n * m * k) as f64 / best / 1e9
            );
        }
    }

    /// `cargo test --release -p kiln-cpu --lib kgemm::tests::bench -- --ignored --nocapture`;
    /// `KILN_BENCH_NMK=n,m,k` measures that shape instead of the two defaults.
    #[test]
    #[ignore]
    fn batched_throughput() {
        if !qgemm::available() {
            return;
        }
        let shapes = match std::env::var("KILN_BENCH_NMK").ok().and_then(|v| {
            let d: Vec<usize> = v.split(',').filter_map(|x| x.parse().ok()).collect();
            (d.len() == 3).then(|| (d[0], d[1], d[2]))
        }) {
            Some(shape) => vec![shape],
            None => vec![(64, 2048, 2048), (512, 2048, 2048)],
        };
        for shape in shapes {
            let mut q4k: Vec<(&str, Kernel<BlockQ4K>)> = vec![("avx512", matmul::<BlockQ4K>)];
            if crate::amx::int8_available() {
                q4k.push(("amx", amx::matmul));
            }
            throughput(DType::Q4_K, shape, &q4k);
            throughput(DType::Q6_K, shape, &[("avx512", matmul::<BlockQ6K>)]);
        }
    }
}
