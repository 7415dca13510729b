//! `matmul` for every weight dtype: awkward small shapes, one row and prompts at the
//! widths of real models, and the check that the bound catches a dropped block.

use crate::rounding::{assert_products, outside, products, Expected};
use crate::target::{random, stored, Target};
use kiln_core::DType;

/// Row lengths of real models: TinyLlama's and Llama 3 8B's hidden sizes, TinyLlama's and
/// Llama 3 8B's feed-forward.
const MODEL_WIDTHS: [usize; 4] = [2048, 4096, 5632, 14336];

/// `x[n, k] · w[m, k]ᵀ` on the target, checked against the float64 reference.
fn check_matmul(t: &Target, dtype: DType, n: usize, m: usize, k: usize, stream: u64) {
    let mut rng = t.rng(stream);
    let wv = random(&mut rng, m * k, 1.0);
    let xv = random(&mut rng, n * k, 2.0);
    let w = t.upload(dtype, &[m, k], &wv);
    let x = t.upload(DType::F32, &[n, k], &xv);
    let mut out = t.poisoned(&[n, m]);
    t.backend.matmul(&x, &w, &mut out).unwrap();
    let want = products(&xv, &stored(dtype, &wv), k, t.rounding(dtype, n, k));
    assert_products(&t.read(&out), &want, &format!("{dtype} n={n} m={m} k={k}"));
}

/// `acc[n, m] += x[n, k] · w[m, k]ᵀ` (`matmul_add`, the residual add a projection feeds)
/// on the target, checked against the float64 reference.
pub(crate) fn check_matmul_add(
    t: &Target,
    dtype: DType,
    n: usize,
    m: usize,
    k: usize,
    stream: u64,
) {
    let mut rng = t.rng(stream);
    let wv = random(&mut rng, m * k, 1.0);
    let xv = random(&mut rng, n * k, 1.0);
    let av = random(&mut rng, n * m, 1.0);
    let w = t.upload(dtype, &[m, k], &wv);
    let x = t.upload(DType::F32, &[n, k], &xv);
    let mut acc = t.upload(DType::F32, &[n, m], &av);
    let mut tmp = t.poisoned(&[n, m]);
    t.backend.matmul_add(&x, &w, &mut acc, &mut tmp).unwrap();
    let want: Vec<Expected> = products(&xv, &stored(dtype, &wv), k, t.rounding(dtype, n, k))
        .into_iter()
        .zip(&av)
        .map(|(e, &a)| e.plus(a))
        .collect();
    assert_products(
        &t.read(&acc),
        &want,
        &format!("matmul_add {dtype} n={n} m={m} k={k}"),
    );
}

/// Row lengths of one block, a few, and many; for plain floats also lengths that are no
/// multiple of anything.
pub fn matmul_every_dtype(t: &Target) {
    let shapes = [
        (1, 1),
        (1, 45),
        (2, 77),
        (3, 17),
        (5, 77),
        (8, 77),
        (9, 70),
        (40, 77),
        (70, 33),
        (130, 131),
    ];
    for (d, dtype) in DType::ALL.into_iter().enumerate() {
        let bs = dtype.block_size();
        let ks = if bs == 1 {
            vec![1, 7, 37, 512]
        } else {
            vec![bs, 3 * bs, 17 * bs]
        };
        for (i, &k) in ks.iter().enumerate() {
            for (j, &(n, m)) in shapes.iter().enumerate() {
                // The largest products only at the smaller lengths: time, not coverage.
                if n * m * k > 2_000_000 && k > 1000 {
                    continue;
                }
                check_matmul(t, dtype, n, m, k, (d * 100 + i * 10 + j) as u64);
            }
        }
    }
}

/// One row of x (decode) against every dtype at model widths: the rounding of x spans many
/// workgroups at 14,336.
pub fn one_row_products_at_model_widths(t: &Target) {
    for (d, dtype) in DType::ALL.into_iter().enumerate() {
        for (i, k) in MODEL_WIDTHS.into_iter().enumerate() {
            check_matmul(t, dtype, 1, 37, k, (d * 10 + i) as u64);
        }
    }
}

/// Prompts' products at model widths, partial tiles both ways, through `matmul_add` (the
/// residual add a projection feeds).
pub fn prompt_products_at_model_widths(t: &Target) {
    let mut shapes: Vec<(DType, usize, usize, usize)> =
        DType::ALL.iter().map(|&d| (d, 77, 300, 2048)).collect();
    shapes.extend([(DType::Q6_K, 20, 64, 14336), (DType::F16, 20, 64, 14336)]);
    // Rows of both operands in whole tiles of 128 × 128 and past them (kiln-wgpu's
    // tensor-core tiles store whole tiles straight into the output, or start from it, and
    // the edges element by element), for F16 and a decoded type; output rows that are no
    // multiple of 4 (whole tiles then also stored element by element).
    shapes.extend([
        (DType::F16, 130, 272, 2048),
        (DType::Q4_K, 130, 256, 2048),
        (DType::F16, 130, 262, 2048),
    ]);
    for (s, (dtype, n, m, k)) in shapes.into_iter().enumerate() {
        check_matmul_add(t, dtype, n, m, k, s as u64);
    }
    check_matmul(t, DType::F16, 130, 272, 2048, 99);
}

/// The bound is worth something only if a wrong kernel fails it: a weight with one block
/// (32 values for plain floats) zeroed in every row must fall outside it for most rows,
/// at the widest k, for one row and for a prompt.
pub fn tolerance_catches_a_dropped_block(t: &Target) {
    for (d, dtype) in DType::ALL.into_iter().enumerate() {
        let block = dtype.block_size().max(32);
        for (s, (n, m, k)) in [(1usize, 37usize, 14336usize), (12, 37, 4096)]
            .into_iter()
            .enumerate()
        {
            let mut rng = t.rng((d * 10 + s) as u64);
            let wv = random(&mut rng, m * k, 1.0);
            let xv = random(&mut rng, n * k, 1.0);
            let mut dropped = wv.clone();
            let j = k / block / 2;
            for row in dropped.chunks_mut(k) {
                row[j * block..][..block].fill(0.0);
            }
            let x = t.upload(DType::F32, &[n, k], &xv);
            let want = products(&xv, &stored(dtype, &wv), k, t.rounding(dtype, n, k));
            let what = format!("{dtype} n={n} k={k}");
            for (values, drop) in [(&wv, false), (&dropped, true)] {
                let w = t.upload(dtype, &[m, k], values);
                let mut out = t.poisoned(&[n, m]);
                t.backend.matmul(&x, &w, &mut out).unwrap();
                let got = t.read(&out);
                if !drop {
                    assert_products(&got, &want, &what);
                    continue;
                }
                let caught = outside(&got, &want).len();
                assert!(
                    2 * caught > got.len(),
                    "{what}: a block of {block} dropped in every row, yet only {caught} of {} \
                     products fall outside their bound",
                    got.len()
                );
            }
        }
    }
}

/// Products right after other kernels (a GPU may let a kernel start before its
/// predecessor ends): each must read what the op before it wrote.
pub fn products_in_sequence_see_each_others_outputs(t: &Target) {
    let (m, k, n) = (1024, 2048, 12);
    let mut rng = t.rng(0);
    let weights: Vec<_> = [DType::Q6_K, DType::Q4_K, DType::Q8_0]
        .into_iter()
        .map(|d| {
            let values = random(&mut rng, m * k, 1.0);
            (d, t.upload(d, &[m, k], &values), stored(d, &values))
        })
        .collect();
    for round in 0..12 {
        let (dtype, w, wd) = &weights[round % 3];
        let xv = random(&mut rng, n * k, 1.0);
        let mut x = t.upload(DType::F32, &[n, k], &xv);
        // An op on x right before the product that reads it.
        t.backend.scale(&mut x, 2.0).unwrap();
        let mut out = t.poisoned(&[n, m]);
        t.backend.matmul(&x, w, &mut out).unwrap();
        let doubled: Vec<f32> = xv.iter().map(|v| 2.0 * v).collect();
        let rows: Vec<usize> = (0..m).step_by(97).collect();
        let w_rows: Vec<f32> = rows
            .iter()
            .flat_map(|&r| wd[r * k..][..k].to_vec())
            .collect();
        let want = products(&doubled, &w_rows, k, t.rounding(*dtype, n, k));
        let got = t.read(&out);
        let got: Vec<f32> = (0..n)
            .flat_map(|i| rows.iter().map(|&r| got[i * m + r]).collect::<Vec<_>>())
            .collect();
        assert_products(&got, &want, &format!("round {round} {dtype}"));
    }
}
