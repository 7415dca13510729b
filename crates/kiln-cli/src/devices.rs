//! `kiln devices`: what kiln can run on here.

use crate::console;
use kiln_core::{Backend, Result};
use kiln_cpu::CpuBackend;
use std::fmt::Write;

pub fn run() -> Result<()> {
    let mut out = String::new();
    // Writing to a String cannot fail.
    macro_rules! say {
        ($($arg:tt)*) => {{
            let _ = writeln!(out, $($arg)*);
        }};
    }
    let cpu = CpuBackend::new(None)?;
    say!("cpu: {}", cpu.describe());
    match kiln_cuda::devices() {
        Ok(gpus) if gpus.is_empty() => say!("cuda: the NVIDIA driver sees no GPU"),
        Ok(gpus) => {
            for d in gpus {
                const GIB: f64 = (1u64 << 30) as f64;
                say!(
                    "cuda:{}: {}, compute capability {}.{}, {} SMs, {:.1} GiB total, {:.1} GiB free",
                    d.ordinal,
                    d.name,
                    d.compute_capability.0,
                    d.compute_capability.1,
                    d.sm_count,
                    d.memory_total as f64 / GIB,
                    d.memory_free as f64 / GIB
                );
                say!(
                    "        driver {}, CUDA {}, NVRTC {}",
                    d.driver_release.as_deref().unwrap_or("(release unknown)"),
                    d.cuda_version,
                    d.nvrtc_version
                        .as_deref()
                        .unwrap_or("not found (kernels cannot be compiled)")
                );
            }
        }
        Err(e) => say!("cuda: unavailable ({e})"),
    }
    let adapters = kiln_wgpu::adapters();
    if adapters.is_empty() {
        say!("wgpu: no Vulkan, Metal or DX12 adapter");
    }
    for a in adapters {
        say!("{a}");
    }
    console::stream(&mut std::io::stdout().lock(), &out);
    Ok(())
}
