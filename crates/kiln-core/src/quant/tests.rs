use super::*;
use rand::{rngs::StdRng, Rng, SeedableRng};

fn random(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n)
        .map(|_| rng.random_range(-1.0f32..1.0) * scale)
        .collect()
}

/// Root-mean-square error of quantize → dequantize, relative to the signal's RMS.
fn relative_rms_error(dtype: DType, x: &[f32]) -> f64 {
    let q = quantize(dtype, x).unwrap();
    let y = dequantize_to_vec(dtype, &q, x.len()).unwrap();
    let (mut err, mut sig) = (0f64, 0f64);
    for (a, b) in x.iter().zip(&y) {
        err += ((a - b) as f64).powi(2);
        sig += (*a as f64).powi(2);
    }
    (err / sig).sqrt()
}

#[test]
fn round_trip_error_is_what_each_format_allows() {
    let x = random(QK_K * 40, 1, 3.0);
    // Uniform data: error ≈ step / sqrt(12) relative to RMS ≈ 1/sqrt(3).
    let bounds = [
        (DType::F32, 0.0),
        (DType::F16, 1e-3),
        (DType::BF16, 5e-3),
        (DType::Q8_0, 0.01),
        (DType::Q6_K, 0.03),
        (DType::Q4_0, 0.15),
        (DType::Q4_K, 0.12),
    ];
    for (dtype, bound) in bounds {
        let e = relative_rms_error(dtype, &x);
        assert!(e <= bound, "{dtype}: relative error {e} above {bound}");
        if dtype.is_quantized() {
            assert!(e > 0.0, "{dtype}: lossless on random data is suspicious");
        }
    }
}

#[test]
fn zero_and_constant_blocks_survive() {
    for dtype in DType::ALL {
        let n = dtype.block_size().max(QK_K);
        for fill in [0.0f32, 0.25, -7.5] {
            let x = vec![fill; n];
            let q = quantize(dtype, &x).unwrap();
            let y = dequantize_to_vec(dtype, &q, n).unwrap();
            for v in &y {
                assert!(
                    (v - fill).abs() <= fill.abs() * 0.01 + 1e-6,
                    "{dtype} {fill}: got {v}"
                );
            }
        }
    }
}

#[test]
fn q4_0_and_q8_0_scale_from_the_extreme_value() {
    let mut x = random(QK, 2, 1.0);
    x[7] = -4.0;
    let q = quantize(DType::Q4_0, &x).unwrap();
    let b: BlockQ4_0 = bytemuck::pod_read_unaligned(&q);
    assert_eq!(b.d.to_f32(), 0.5); // -4 / -8
    assert_eq!(b.qs[7] & 0xF, 0); // the extreme maps to level 0 (-8)
    let q = quantize(DType::Q8_0, &x).unwrap();
    let b: BlockQ8_0 = bytemuck::pod_read_unaligned(&q);
    assert_eq!(b.qs[7], -127);
}

#[test]
fn nearest_int_rounds_half_to_even() {
    assert_eq!(
        [0.5f32, 1.5, 2.5, -0.5, -1.5, 3.49, -3.51].map(nearest_int),
        [0, 2, 2, 0, -2, 3, -4]
    );
}

#[test]
fn bf16_matches_ggml_rounding() {
    assert_eq!(f32_to_bf16(1.0), 0x3f80);
    // Halfway between two bf16 values rounds to the even one.
    assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8000)), 0x3f80);
    assert_eq!(f32_to_bf16(f32::from_bits(0x3f81_8000)), 0x3f82);
    assert_eq!(f32_to_bf16(f32::NAN) & 0x7fc0, 0x7fc0);
}

#[test]
fn q8_k_keeps_block_sums() {
    let x = random(QK_K * 3, 3, 2.0);
    let mut blocks = vec![BlockQ8K::zeroed(); 3];
    quantize_q8_k(&x, &mut blocks).unwrap();
    for (b, x) in blocks.iter().zip(x.chunks_exact(QK_K)) {
        for g in 0..16 {
            let s: i32 = b.qs[16 * g..16 * g + 16].iter().map(|&q| q as i32).sum();
            assert_eq!(s, b.bsums[g] as i32);
        }
        for (q, v) in b.qs.iter().zip(x) {
            assert!((*q as f32 * b.d - v).abs() <= b.d.abs() * 0.51);
        }
    }
}

#[test]
fn lengths_that_do_not_fit_are_errors() {
    assert!(quantize(DType::Q4_K, &[0.0; 100]).is_err());
    let mut out = [0f32; 32];
    assert!(dequantize(DType::Q8_0, &[0u8; 33], &mut out).is_err());
}
