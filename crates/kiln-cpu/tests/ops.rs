//! kiln's conformance suite (crates/kiln-conformance) on the CPU.

use kiln_conformance::Rounding;
use kiln_core::DType;
use kiln_cpu::CpuBackend;

/// What the CPU rounds x to (kiln_cpu's matmul): ggml's activation blocks for quantized
/// weights; for F16/BF16 prompts on AMX, two bf16 halves (exact f32 elsewhere, within
/// the same bound).
fn rounding(_: &CpuBackend, weight: DType, rows: usize, _k: usize) -> Rounding {
    match weight {
        DType::Q8_0 | DType::Q4_0 => Rounding::Q8_0,
        DType::Q4_K | DType::Q6_K => Rounding::Q8K,
        DType::F16 | DType::BF16 if rows >= 8 => Rounding::Split16,
        _ => Rounding::None,
    }
}

/// As a model runs: Q4_0 and Q4_K weights in the CPU's interleaved layout where it is the
/// default (AVX2, AVX-512).
mod default_layout {
    use super::*;
    kiln_conformance::suite! {
        backend: CpuBackend::new(Some(2)).unwrap(),
        rounding: rounding,
    }
}

/// Every weight in the file's layout (`KILN_CPU_LAYOUT=file`), whose kernels the
/// interleaved layout bypasses.
mod file_layout {
    use super::*;
    kiln_conformance::suite! {
        backend: CpuBackend::new(Some(2)).unwrap().file_layout(),
        rounding: rounding,
    }
}
