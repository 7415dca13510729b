use super::*;
use crate::dot::test_util::{isas, ref_dot, test_pool};
use kiln_core::quant::{as_blocks, dequantize, dequantize_to_vec, quantize};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Row counts: under a panel, one, one and a bit, several with a ragged end.
const ROWS: [usize; 6] = [1, 7, 16, 17, 37, 130];

/// Arbitrary bytes of `rows` Q4_0 rows of `nb` blocks: any scale bits (NaN included) and
/// any nibbles, which the layout must carry unchanged.
fn random_file(rng: &mut StdRng, rows: usize, nb: usize) -> Vec<u8> {
    (0..rows * nb * 18).map(|_| rng.random()).collect()
}

#[test]
fn file_bytes_round_trip_exactly() {
    let mut rng = StdRng::seed_from_u64(0x9a7e);
    for nb in [1, 3, 64] {
        for rows in ROWS {
            let file = random_file(&mut rng, rows, nb);
            let p = Panels::from_file(test_pool(), Format::Q4_0, rows, nb * QK, &file).unwrap();
            assert_eq!(p.to_file(), file, "rows={rows} nb={nb}");
            // Rewriting in place gives the new bytes back, none of the old.
            let mut p = p;
            let other = random_file(&mut rng, rows, nb);
            p.write_file(test_pool(), &other);
            assert_eq!(p.to_file(), other, "rewritten rows={rows} nb={nb}");
        }
    }
}

#[test]
fn rows_dequantize_as_the_files_rows() {
    let mut rng = StdRng::seed_from_u64(0x9a7f);
    let (rows, nb) = (37, 5);
    let values: Vec<f32> = (0..rows * nb * QK).map(|_| rng.random_range(-3.0..3.0)).collect();
    let file = quantize(DType::Q4_0, &values).unwrap();
    let p = Panels::from_file(test_pool(), Format::Q4_0, rows, nb * QK, &file).unwrap();
    let k = nb * QK;
    for r in 0..rows {
        let mut want = vec![0f32; k];
        dequantize(DType::Q4_0, &file[r * nb * 18..][..nb * 18], &mut want).unwrap();
        let mut got = vec![f32::NAN; k];
        p.dequantize_row(r, &mut got).unwrap();
        assert_eq!(
            got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            "row {r}"
        );
    }
}

/// Every ISA this CPU runs panels with: the products against the per-row dot kernel
/// (same integer sums, so to 1e-5 of the larger of |sum| and Σ|w·x|) and against float64.
#[test]
fn products_match_the_per_row_dot_and_float64() {
    let kernels: Vec<Isa> = isas()
        .into_iter()
        .filter(|i| matches!(i, Isa::Avx2 | Isa::Avx512Vnni))
        .collect();
    if kernels.is_empty() {
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
                let wv: Vec<f32> = (0..m * k).map(|_| rng.random_range(-2.0..2.0)).collect();
                let xv: Vec<f32> = (0..n * k).map(|_| rng.random_range(-1.0..1.0)).collect();
                let wbytes = quantize(DType::Q4_0, &wv).unwrap();
                let w = as_blocks::<BlockQ4_0>(&wbytes).unwrap().into_owned();
                let xbytes = quantize(DType::Q8_0, &xv).unwrap();
                let x = as_blocks::<BlockQ8_0>(&xbytes).unwrap().into_owned();
                let wf = dequantize_to_vec(DType::Q4_0, &wbytes, m * k).unwrap();
                let xf = dequantize_to_vec(DType::Q8_0, &xbytes, n * k).unwrap();
                let p = Panels::from_file(test_pool(), Format::Q4_0, m, k, &wbytes).unwrap();
                let nb = k / QK;
                for &isa in &kernels {
                    let mut out = vec![f32::NAN; n * m];
                    matmul_q4_0_on(isa, test_pool(), &p, &x, &mut out, n).unwrap();
                    for i in 0..n {
                        let xi = &x[i * nb..][..nb];
                        for r in 0..m {
                            let want = crate::dot::dot_q4_0(&w[r * nb..][..nb], xi);
                            let (exact, abs) = ref_dot(&wf[r * k..][..k], &xf[i * k..][..k]);
                            let got = out[i * m + r];
                            let what = format!("{} k={k} m={m} n={n} [{i}, {r}]", isa.name());
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
            }
        }
    }
}

/// The largest sums the i16 stage can meet (every nibble 15 against every quant ±128 or
/// 127) are exact.
#[test]
fn extreme_quants_do_not_overflow() {
    let kernels: Vec<Isa> = isas()
        .into_iter()
        .filter(|i| matches!(i, Isa::Avx2 | Isa::Avx512Vnni))
        .collect();
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
            assert!(out.iter().all(|&v| v == want), "{} q={q}: {out:?}", isa.name());
        }
    }
}
