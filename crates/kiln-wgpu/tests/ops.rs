//! kiln's conformance suite (crates/kiln-conformance) on the first wgpu adapter (lavapipe
//! in CI), twice: with all the adapter has (subgroups, f16 arithmetic, cooperative
//! matrices where it has them) and on the portable paths (workgroup-memory reductions,
//! f32 arithmetic, the tiled GEMM).

use kiln_conformance::Rounding;
use kiln_core::{Backend, DType};
use kiln_wgpu::{Options, WgpuBackend};
use std::sync::OnceLock;

/// What one row of x meets a weight in (kiln_wgpu's rounded_row and matmul): prompts on
/// cooperative matrices in f16 (F16 and quantized weights); one row (decode) in int8 per
/// 32 values for quantized weights, in f16 for F16 ones where the device has f16
/// arithmetic; f32 otherwise.
fn rounding(g: &WgpuBackend, weight: DType, rows: usize, k: usize) -> Rounding {
    match weight {
        _ if rows > 8 && g.tensor_cores_take(weight, k) => Rounding::F16,
        _ if rows != 1 => Rounding::None,
        DType::F16 if g.uses_f16() && k.is_multiple_of(8) => Rounding::F16Dot4,
        d if d.is_quantized() => Rounding::Int8,
        _ => Rounding::None,
    }
}

/// Whether there is an adapter (asked once: each asking lists them all).
fn adapter() -> bool {
    static FOUND: OnceLock<bool> = OnceLock::new();
    *FOUND.get_or_init(kiln_wgpu::adapter_for_tests)
}

mod all_features {
    use super::*;
    kiln_conformance::suite! {
        backend: WgpuBackend::with_options(0, Options::default()).unwrap(),
        rounding: rounding,
        available: adapter(),
        failing {
            softmax_of_a_masked_row_is_zeros: "a row of -inf has max -inf, and exp(-inf - max) is NaN",
            positions_out_of_range_are_errors: "positions are read on the device, mid-step: write_rows skips them as the contract allows; attention and rope take them as they come (the contract says nothing for those two)",
        },
    }
}

mod portable {
    use super::*;
    kiln_conformance::suite! {
        backend: WgpuBackend::with_options(
            0,
            Options {
                subgroups: false,
                f16: false,
                cooperative_matrices: false,
            },
        )
        .unwrap(),
        rounding: rounding,
        available: adapter(),
        failing {
            softmax_of_a_masked_row_is_zeros: "a row of -inf has max -inf, and exp(-inf - max) is NaN",
            positions_out_of_range_are_errors: "positions are read on the device, mid-step: write_rows skips them as the contract allows; attention and rope take them as they come (the contract says nothing for those two)",
        },
    }
}

/// A tensor past the adapter's largest buffer: an error naming the adapter and the limit.
#[test]
fn a_tensor_past_the_largest_buffer_names_the_limit() {
    if !adapter() {
        return;
    }
    let g = WgpuBackend::new(0).unwrap();
    let too_big = g.summary().max_buffer as usize / 4 + 1;
    let err = g
        .zeros(DType::F32, kiln_core::Shape::new(vec![too_big]).unwrap())
        .expect_err("past the largest buffer")
        .to_string();
    assert!(
        err.contains("largest buffer") && err.contains("wgpu:0"),
        "{err}"
    );
}

/// An adapter index past the last: an error that says so, never a panic.
#[test]
fn a_missing_adapter_is_an_error() {
    let err = WgpuBackend::new(usize::MAX)
        .err()
        .expect("no such adapter")
        .to_string();
    assert!(err.contains("no wgpu adapter"), "{err}");
}

/// More dispatches than the parameter arena has slots, none read back between: each
/// keeps its own parameters (the step goes out in pieces, the arena's slots a ring).
#[test]
fn a_long_run_of_ops_keeps_each_its_parameters() {
    if !adapter() {
        return;
    }
    let g = WgpuBackend::new(0).unwrap();
    let start: Vec<f32> = (0..37).map(|i| 1.0 + i as f32 / 8.0).collect();
    let bytes: Vec<u8> = start.iter().flat_map(|v| v.to_le_bytes()).collect();
    let shape = kiln_core::Shape::new(vec![start.len()]).unwrap();
    let mut x = g
        .upload(DType::F32, shape, kiln_core::HostBytes::from_vec(bytes))
        .unwrap();
    let mut want = start;
    for i in 0..9_000u32 {
        let s = 1.0 + ((i * 7919) % 61) as f32 / 256.0 * if i % 2 == 0 { 1.0 } else { -1.0 };
        g.scale(&mut x, s).unwrap();
        want.iter_mut().for_each(|v| *v *= s);
    }
    let got: Vec<f32> = g
        .download(&x)
        .unwrap()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    assert_eq!(got, want);
}
