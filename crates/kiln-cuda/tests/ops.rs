//! kiln's conformance suite (crates/kiln-conformance) on the first CUDA device. These need
//! a GPU: CI lists them as ignored; the GPU machine runs them with `--include-ignored`.

use kiln_conformance::Rounding;
use kiln_core::DType;
use kiln_cuda::CudaBackend;

/// What x meets the weights in (kiln_cuda's matmul): up to 8 rows, int8 per 32 values for
/// quantized weights and f32 for float ones; more rows, cuBLAS on tensor cores with x in
/// the weight's 16-bit type (quantized weights decoded to f16), F32 through SGEMM.
fn rounding(_: &CudaBackend, weight: DType, rows: usize, _k: usize) -> Rounding {
    match weight {
        DType::F32 => Rounding::None,
        _ if rows <= 8 && weight.is_quantized() => Rounding::Int8,
        _ if rows <= 8 => Rounding::None,
        DType::BF16 => Rounding::Bf16,
        _ => Rounding::F16,
    }
}

kiln_conformance::suite! {
    #[ignore = "needs a CUDA device"]
    backend: CudaBackend::new(0).unwrap_or_else(|e| panic!("no CUDA backend: {e}")),
    rounding: rounding,
}
