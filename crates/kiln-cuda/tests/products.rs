//! Training's F32-weight products in each arithmetic `GradOps::set_products` offers, against
//! float64 over the inputs rounded as that arithmetic rounds them: the sums must be F32's,
//! and the rounding must really happen. Needs a GPU (ignored in CI).

use half::bf16;
use kiln_core::{Backend, DType, Products, Shape};
use kiln_cuda::CudaBackend;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn upload(b: &CudaBackend, dims: &[usize], v: &[f32]) -> kiln_core::Tensor {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    b.upload(
        DType::F32,
        Shape::new(dims.to_vec()).unwrap(),
        kiln_core::HostBytes::from_vec(bytes),
    )
    .unwrap()
}

fn read(b: &CudaBackend, t: &kiln_core::Tensor) -> Vec<f32> {
    b.download(t)
        .unwrap()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// `x · wᵀ` in float64 over `round`ed inputs, and Σ|x·w| per output.
fn reference(x: &[f32], w: &[f32], k: usize, round: fn(f32) -> f32) -> (Vec<f64>, Vec<f64>) {
    let (mut out, mut abs) = (Vec::new(), Vec::new());
    for xr in x.chunks_exact(k) {
        for wr in w.chunks_exact(k) {
            let (mut s, mut a) = (0f64, 0f64);
            for (&p, &q) in xr.iter().zip(wr) {
                let t = round(p) as f64 * round(q) as f64;
                s += t;
                a += t.abs();
            }
            out.push(s);
            abs.push(a);
        }
    }
    (out, abs)
}

#[test]
#[ignore = "needs a CUDA device"]
fn bf16_products_round_their_inputs_and_sum_in_f32() {
    let b = CudaBackend::new(0).unwrap_or_else(|e| panic!("no CUDA backend: {e}"));
    let mut rng = StdRng::seed_from_u64(0xbf16);
    // Rows past the one-row kernels (cuBLAS), awkward sizes.
    let (n, m, k) = (37, 53, 301);
    let x: Vec<f32> = (0..n * k).map(|_| rng.random_range(-2.0..2.0)).collect();
    let w: Vec<f32> = (0..m * k).map(|_| rng.random_range(-1.0..1.0)).collect();
    let (xt, wt) = (upload(&b, &[n, k], &x), upload(&b, &[m, k], &w));
    let mut out = upload(&b, &[n, m], &vec![f32::NAN; n * m]);
    let grad = b.grad().expect("CUDA trains");
    grad.set_products(Products::Bf16).unwrap();
    let run = b.matmul(&xt, &wt, &mut out);
    grad.set_products(Products::F32).unwrap();
    run.unwrap();
    let got = read(&b, &out);
    let (want, abs) = reference(&x, &w, k, |v| bf16::from_f32(v).to_f32());
    let (exact, _) = reference(&x, &w, k, |v| v);
    let mut moved = 0f64;
    for i in 0..n * m {
        let err = (got[i] as f64 - want[i]).abs();
        assert!(
            err <= 1e-5 * abs[i],
            "[{i}]: {} against {} over BF16 inputs (Σ|xw| {})",
            got[i],
            want[i],
            abs[i]
        );
        moved = moved.max((got[i] as f64 - exact[i]).abs() / abs[i]);
    }
    // BF16 keeps 8 bits: unrounded inputs would land within F32's error of `exact`.
    assert!(
        moved > 1e-4,
        "the products are F32's: the setting did nothing ({moved:e})"
    );
}
