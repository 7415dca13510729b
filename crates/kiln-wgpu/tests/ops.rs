//! kiln's conformance suite (crates/kiln-conformance) on the first wgpu adapter (lavapipe
//! in CI), twice: with all the adapter has (subgroups, f16 arithmetic, cooperative
//! matrices where it has them) and on the portable paths (workgroup-memory reductions,
//! f32 arithmetic, the tiled GEMM).

use kiln_conformance::Rounding;
use kiln_core::DType;
use kiln_wgpu::{Options, WgpuBackend};
use std::sync::OnceLock;

/// What one row of x meets a weight in (kiln_wgpu's rounded_row and matmul): prompts on
/// cooperative matrices in f16; one row (decode) in int8 per 32 values for quantized
/// weights, in f16 for F16 ones where the device has f16 arithmetic; f32 otherwise.
fn rounding(g: &WgpuBackend, weight: DType, rows: usize, k: usize) -> Rounding {
    match weight {
        _ if rows > 8 && g.uses_cooperative_matrices() => Rounding::F16,
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
            attention_past_the_cache_is_an_error: "positions are read on the device, where a query past the cache cannot be reported (the contract gives write_rows and embedding a fallback, not attention)",
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
            attention_past_the_cache_is_an_error: "positions are read on the device, where a query past the cache cannot be reported (the contract gives write_rows and embedding a fallback, not attention)",
        },
    }
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
