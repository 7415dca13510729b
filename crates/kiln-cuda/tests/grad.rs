//! kiln's gradient suite (crates/kiln-conformance/src/grad: every backward kernel against
//! float64 central differences) on the first CUDA device. These need a GPU: CI lists them
//! as ignored; the GPU machine runs them with `--include-ignored`.

kiln_conformance::grad_suite! {
    #[ignore = "needs a CUDA device"]
    backend: kiln_cuda::CudaBackend::new(0).unwrap_or_else(|e| panic!("no CUDA backend: {e}")),
}
