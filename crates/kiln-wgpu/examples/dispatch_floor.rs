//! What a dispatch costs apart from its work, on the first wgpu adapter: a chain of small
//! dispatches, each reading what the one before wrote (so wgpu puts a barrier between
//! them), against the same work in one dispatch. Decode is ~10 dispatches a layer, so this
//! floor, not bandwidth, sets a small model's speed (BENCHMARKS.md, issue 16).
//!
//!     cargo run --release -p kiln-wgpu --example dispatch_floor [DISPATCHES]

use kiln_core::{Backend, DType, Result, Shape, Tensor};
use kiln_wgpu::WgpuBackend;
use std::time::Instant;

fn zeros(g: &WgpuBackend, n: usize) -> Result<Tensor> {
    g.zeros(DType::F32, Shape::new(vec![n])?)
}

/// Wall time of `f`, after everything before it finished, until the GPU has finished it,
/// and the part of it the CPU spent recording and submitting.
fn timed(g: &WgpuBackend, probe: &Tensor, f: impl FnOnce() -> Result<()>) -> Result<(f64, f64)> {
    g.download(probe)?;
    let t = Instant::now();
    f()?;
    let cpu = t.elapsed().as_secs_f64();
    g.download(probe)?;
    Ok((t.elapsed().as_secs_f64(), cpu))
}

fn main() -> Result<()> {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(4000);
    let g = WgpuBackend::new(0)?;
    println!("{}", g.describe());
    let width = 1024;
    let mut x = zeros(&g, width)?;
    let probe = zeros(&g, 1)?;
    let mut many: Vec<Tensor> = (0..64).map(|_| zeros(&g, width)).collect::<Result<_>>()?;
    let mut big = zeros(&g, width * n)?;
    for round in 0..3 {
        let chain = timed(&g, &probe, || {
            for _ in 0..n {
                g.scale(&mut x, 1.0001)?;
            }
            Ok(())
        })?;
        let spread = timed(&g, &probe, || {
            for i in 0..n {
                g.scale(&mut many[i % 64], 1.0001)?;
            }
            Ok(())
        })?;
        let (one, _) = timed(&g, &probe, || g.scale(&mut big, 1.0001))?;
        let us = |t: f64| t * 1e6 / n as f64;
        println!(
            "round {round}: {n} dispatches on one buffer {:.2} µs each (CPU {:.2}), over 64 buffers {:.2} µs each (CPU {:.2}); the same work in one dispatch {:.1} µs",
            us(chain.0),
            us(chain.1),
            us(spread.0),
            us(spread.1),
            one * 1e6
        );
    }
    Ok(())
}
