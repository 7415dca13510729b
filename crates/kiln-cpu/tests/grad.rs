//! kiln's gradient suite (crates/kiln-conformance/src/grad) on the CPU.

kiln_conformance::grad_suite! {
    backend: kiln_cpu::CpuBackend::new(Some(2)).unwrap(),
}
