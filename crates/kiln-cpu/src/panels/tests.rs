use super::*;
use crate::dot::test_util::{isas, ref_dot, test_pool};
use bytemuck::Zeroable;
use kiln_core::quant::{
    as_blocks, dequantize, dequantize_to_vec, quantize, quantize_q8_k, BlockQ4K,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Row counts: under a panel, one, one and a bit, several with a ragged end.
const ROWS: [usize; 6] = [1, 7, 16, 17, 37, 130];

const FORMATS: [Format; 2] = [Format::Q4_0, Format::Q4K];

/// Arbitrary bytes of `rows` rows of `nb` blocks: any scale bits (NaN included) and any
/// quants, which the layout must carry unchanged.
fn random_file(rng: &mut StdRng, format: Format, rows: usize, nb: usize) -> Vec<u8> {
    (0..rows * nb * format.block_bytes())
        .map(|_| rng.random())
        .collect()
}

/// The ISAs of this CPU that have panel kernels.
fn panel_isas() -> Vec<Isa> {
    isas()
        .into_iter()
        .filter(|i| matches!(i, Isa::Avx2 | Isa::Avx512Vnni))
        .collect()
}

#[test]
fn file_bytes_round_trip_exactly() {
    let mut rng = StdRng::seed_from_u64(0x9a7e);
    for format in FORMATS {
        for nb in [1, 3, 8] {
            for rows in ROWS {
                let k = nb * format.block_len();
                let file = random_file(&mut rng, format, rows, nb);
                let mut p = Panels::from_file(test_pool(), format, rows, k, &file).unwrap();
                assert_eq!(p.to_file(), file, "{format:?} rows={rows} nb={nb}");
                // Rewriting in place gives the new bytes back, none of the old.
                let other = random_file(&mut rng, format, rows, nb);
                p.write_file(test_pool(), &other);
                assert_eq!(
                    p.to_file(),
                    other,
                    "{format:?} rewritten rows={rows} nb={nb}"
                );
            }
        }
    }
}

#[test]
fn rows_dequantize_as_the_files_rows() {
    let mut rng = StdRng::seed_from_u64(0x9a7f);
    for format in FORMATS {
        let (rows, nb) = (37, 3);
        let (k, bb) = (nb * format.block_len(), format.block_bytes());
        let values: Vec<f32> = (0..rows * k).map(|_| rng.random_range(-3.0..3.0)).collect();
        let file = quantize(format.dtype(), &values).unwrap();
        let p = Panels::from_file(test_pool(), format, rows, k, &file).unwrap();
        for r in 0..rows {
            let mut want = vec![0f32; k];
            dequantize(format.dtype(), &file[r * nb * bb..][..nb * bb], &mut want).unwrap();
            let mut got = vec![f32::NAN; k];
            p.dequantize_row(r, &mut got).unwrap();
            let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "{format:?} row {r}");
        }
    }
}

/// `out[n, m]` from `isa`'s kernels against the per-row dot kernel's `want(i, r)` (same
/// integer sums, so to 1e-5 of the larger of |sum| and Σ|w·x|) and against float64 on the
/// dequantized weights `wf` and activations `xf`.
fn assert_products(
    what: &str,
    out: &[f32],
    (n, m, k): (usize, usize, usize),
    wf: &[f32],
    xf: &[f32],
    want: impl Fn(usize, usize) -> f32,
) {
    for i in 0..n {
        for r in 0..m {
            let want = want(i, r);
            let (exact, abs) = ref_dot(&wf[r * k..][..k], &xf[i * k..][..k]);
            let got = out[i * m + r];
            let what = format!("{what} k={k} m={m} n={n} [{i}, {r}]");
            let err = (got - want).abs() as f64;
            assert!(
                err <= 1e-5 * abs.max(want.abs() as f64) + 1e-30,
                "{what}: got {got}, per-row dot {want}"
            );
            assert!(
                (got as f64 - exact).abs() <= 1e-5 * abs + 1e-30,
                "{what}: got {got}, float64 {exact}"
            );
        }
    }
}

/// Random values, quantized: the file's bytes and the values they decode to.
fn random_weight(rng: &mut StdRng, dtype: DType, len: usize) -> (Vec<u8>, Vec<f32>) {
    let v: Vec<f32> = (0..len).map(|_| rng.random_range(-2.0..2.0)).collect();
    let bytes = quantize(dtype, &v).unwrap();
    let values = dequantize_to_vec(dtype, &bytes, len).unwrap();
    (bytes, values)
}

/// Q4_0 panels of `m × k` times `n` Q8_0 activation rows, on every ISA with panel kernels.
fn check_q4_0(rng: &mut StdRng, m: usize, k: usize, n: usize) {
    let (wbytes, wf) = random_weight(rng, DType::Q4_0, m * k);
    let xv: Vec<f32> = (0..n * k).map(|_| rng.random_range(-1.0..1.0)).collect();
    let xbytes = quantize(DType::Q8_0, &xv).unwrap();
    let x = as_blocks::<BlockQ8_0>(&xbytes).unwrap().into_owned();
    let xf = dequantize_to_vec(DType::Q8_0, &xbytes, n * k).unwrap();
    let w = as_blocks::<BlockQ4_0>(&wbytes).unwrap().into_owned();
    let p = Panels::from_file(test_pool(), Format::Q4_0, m, k, &wbytes).unwrap();
    let nb = k / QK;
    for isa in panel_isas() {
        let mut out = vec![f32::NAN; n * m];
        matmul_q4_0_on(isa, test_pool(), &p, &x, &mut out, n).unwrap();
        assert_products(
            &format!("Q4_0 {}", isa.name()),
            &out,
            (n, m, k),
            &wf,
            &xf,
            |i, r| crate::dot::dot_q4_0(&w[r * nb..][..nb], &x[i * nb..][..nb]),
        );
    }
}

/// Q4_K panels of `m × k` times `n` Q8_K activation rows, on every ISA with panel kernels.
fn check_q4_k(rng: &mut StdRng, m: usize, k: usize, n: usize) {
    let (wbytes, wf) = random_weight(rng, DType::Q4_K, m * k);
    let xv: Vec<f32> = (0..n * k).map(|_| rng.random_range(-1.0..1.0)).collect();
    let nb = k / QK_K;
    let mut x = vec![BlockQ8K::zeroed(); n * nb];
    quantize_q8_k(&xv, &mut x).unwrap();
    let xf: Vec<f32> = x
        .iter()
        .flat_map(|b| b.qs.map(|q| q as f32 * b.d))
        .collect();
    let w = as_blocks::<BlockQ4K>(&wbytes).unwrap().into_owned();
    let p = Panels::from_file(test_pool(), Format::Q4K, m, k, &wbytes).unwrap();
    for isa in panel_isas() {
        let mut out = vec![f32::NAN; n * m];
        matmul_q4_k_on(isa, test_pool(), &p, &x, &mut out, n).unwrap();
        assert_products(
            &format!("Q4_K {}", isa.name()),
            &out,
            (n, m, k),
            &wf,
            &xf,
            |i, r| crate::dot::dot_q4_k(&w[r * nb..][..nb], &x[i * nb..][..nb]),
        );
    }
}

#[test]
fn q4_0_products_match_the_per_row_dot_and_float64() {
    if panel_isas().is_empty() {
        eprintln!("no AVX2 or AVX-512: panel kernels not testable here");
        return;
    }
    let mut rng = StdRng::seed_from_u64(0x9a80);
    // k: one block, three (odd: panels off 64-byte lines), seven, a model width.
    for k in [32usize, 96, 224, 2048] {
        for m in ROWS {
            for n in [1usize, 2, 5, 9] {
                if k == 2048 && m > 40 && n > 2 {
                    continue; // time, not coverage
                }
                check_q4_0(&mut rng, m, k, n);
            }
        }
    }
}

#[test]
fn q4_k_products_match_the_per_row_dot_and_float64() {
    if panel_isas().is_empty() {
        eprintln!("no AVX2 or AVX-512: panel kernels not testable here");
        return;
    }
    let mut rng = StdRng::seed_from_u64(0x9a81);
    // k: one super-block, three, a model width; n past the AVX-512 prompt kernels' start.
    for k in [256usize, 768, 2048] {
        for m in ROWS {
            for n in [1usize, 2, 3, 5] {
                if k == 2048 && m > 40 && n > 2 {
                    continue; // time, not coverage
                }
                check_q4_k(&mut rng, m, k, n);
            }
        }
    }
}

/// The largest sums the i16 stage can meet (every nibble 15 against every quant ±128 or
/// 127) are exact.
#[test]
fn extreme_quants_do_not_overflow() {
    let kernels = panel_isas();
    let (m, nb) = (16, 2);
    let w: Vec<BlockQ4_0> = (0..m * nb)
        .map(|_| BlockQ4_0 {
            d: half::f16::ONE,
            qs: [0xFF; 16],
        })
        .collect();
    let wbytes = bytemuck::cast_slice::<BlockQ4_0, u8>(&w).to_vec();
    let p = Panels::from_file(test_pool(), Format::Q4_0, m, nb * QK, &wbytes).unwrap();
    for q in [-128i8, 127] {
        let x = vec![
            BlockQ8_0 {
                d: half::f16::ONE,
                qs: [q; QK],
            };
            nb
        ];
        let want = 7.0 * q as f32 * (nb * QK) as f32;
        for &isa in &kernels {
            let mut out = vec![f32::NAN; m];
            matmul_q4_0_on(isa, test_pool(), &p, &x, &mut out, 1).unwrap();
            assert!(
                out.iter().all(|&v| v == want),
                "{} q={q}: {out:?}",
                isa.name()
            );
        }
    }
}

/// Q4_K's largest sums: every nibble 15, every scale and min 63 (packed bytes 0xFF),
/// every quant ±128 or 127: the i16 stage and the i32 scaling are exact.
#[test]
fn q4_k_extreme_quants_do_not_overflow() {
    let (m, nb) = (16, 2);
    let w = vec![
        BlockQ4K {
            d: half::f16::ONE,
            dmin: half::f16::ONE,
            scales: [0xFF; 12],
            qs: [0xFF; QK_K / 2],
        };
        m * nb
    ];
    let wbytes = bytemuck::cast_slice::<BlockQ4K, u8>(&w).to_vec();
    let p = Panels::from_file(test_pool(), Format::Q4K, m, nb * QK_K, &wbytes).unwrap();
    for q in [-128i8, 127] {
        let x = vec![
            BlockQ8K {
                d: 1.0,
                qs: [q; QK_K],
                bsums: [16 * q as i16; QK_K / 16],
            };
            nb
        ];
        // Each weight is 63·15 − 63 = 882.
        let want = 882.0 * q as f32 * (nb * QK_K) as f32;
        assert_eq!(
            crate::dot::dot_q4_k(&w[..nb], &x),
            want,
            "per-row dot, q={q}"
        );
        for isa in panel_isas() {
            let mut out = vec![f32::NAN; m];
            matmul_q4_k_on(isa, test_pool(), &p, &x, &mut out, 1).unwrap();
            assert!(
                out.iter().all(|&v| v == want),
                "{} q={q}: {out:?}",
                isa.name()
            );
        }
    }
}

/// Decode in the file's layout (the `gemv` kernels) against panels, best of 5 on 1 and 2
/// threads, for a matrix held in L3 and one streamed from memory:
/// `cargo test --release -p kiln-cpu --lib panels::tests::decode_throughput -- --ignored
/// --nocapture`.
#[test]
#[ignore]
fn decode_throughput() {
    use crate::dot::test_util::best_seconds;
    if panel_isas().is_empty() {
        return;
    }
    let mut rng = StdRng::seed_from_u64(7);
    for (m, k) in [(5632, 2048), (2048, 5632), (65536, 2048)] {
        let (q40, _) = random_weight(&mut rng, DType::Q4_0, 2048 * k);
        let (q4k, _) = random_weight(&mut rng, DType::Q4_K, 2048 * k);
        // Tile the rows: random draws of 100M values are slow, and repeats stream alike.
        let tile = |rows: &[u8]| -> Vec<u8> {
            rows.iter()
                .copied()
                .cycle()
                .take(rows.len() * m / 2048)
                .collect()
        };
        let (q40, q4k) = (tile(&q40), tile(&q4k));
        let xv: Vec<f32> = (0..k).map(|_| rng.random_range(-1.0..1.0)).collect();
        let x0 = as_blocks::<BlockQ8_0>(&quantize(DType::Q8_0, &xv).unwrap())
            .unwrap()
            .into_owned();
        let mut xk = vec![BlockQ8K::zeroed(); k / QK_K];
        quantize_q8_k(&xv, &mut xk).unwrap();
        let w0 = as_blocks::<BlockQ4_0>(&q40).unwrap().into_owned();
        let wk = as_blocks::<BlockQ4K>(&q4k).unwrap().into_owned();
        let p0 = Panels::from_file(test_pool(), Format::Q4_0, m, k, &q40).unwrap();
        let pk = Panels::from_file(test_pool(), Format::Q4K, m, k, &q4k).unwrap();
        let mut out = vec![0f32; m];
        for threads in [1, 2] {
            let gbs = |bytes: usize, s: f64| bytes as f64 / s / 1e9;
            let file0 = best_seconds(threads, 5, |pool| {
                crate::gemv::q8_0::matvec(pool, &w0, &x0, &mut out, m, k, crate::dot::dot_q4_0)
            });
            let panel0 = best_seconds(threads, 5, |pool| {
                matmul_q4_0(pool, &p0, &x0, &mut out, 1).unwrap()
            });
            let filek = best_seconds(threads, 5, |pool| {
                crate::gemv::k_quants::matvec_q4k(pool, &wk, &xk, &mut out, m)
            });
            let panelk = best_seconds(threads, 5, |pool| {
                matmul_q4_k(pool, &pk, &xk, &mut out, 1).unwrap()
            });
            eprintln!(
                "{m}x{k} {threads} thread(s): q4_0 file {:.1} GB/s, panels {:.1}; q4_K file {:.1}, panels {:.1}",
                gbs(q40.len(), file0),
                gbs(q40.len(), panel0),
                gbs(q4k.len(), filek),
                gbs(q4k.len(), panelk)
            );
        }
    }
}
