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
    // Between GPUs: which pairs reach each other's memory, and how (what the all-reduce
    // of several GPUs can use besides NCCL).
    if let Ok(links) = kiln_cuda::peer_links() {
        if links.len() > 1 {
            say!("peer access (from row to column; NV: with native atomics, as over NVLink; the number is the driver's performance rank):");
            let head: Vec<String> = (0..links.len())
                .map(|j| format!("{:>8}", format!("cuda:{j}")))
                .collect();
            say!("        {}", head.join(""));
            for (i, row) in links.iter().enumerate() {
                let cells: Vec<String> = row
                    .iter()
                    .map(|l| {
                        let cell = match l {
                            None => "-".to_string(),
                            Some(l) if !l.access => "no".to_string(),
                            Some(l) if l.native_atomics => format!("NV {}", l.performance_rank),
                            Some(l) => format!("yes {}", l.performance_rank),
                        };
                        format!("{cell:>8}")
                    })
                    .collect();
                say!("{:>8}{}", format!("cuda:{i}"), cells.join(""));
            }
            say!(
                "NCCL: {}",
                if kiln_cuda::nccl_available() {
                    "found"
                } else {
                    "not found (several GPUs need libnccl.so.2)"
                }
            );
        }
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
