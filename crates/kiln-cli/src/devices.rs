//! `kiln devices`: what kiln can run on here.

use kiln_core::{Backend, Result};
use kiln_cpu::CpuBackend;

pub fn run() -> Result<()> {
    let cpu = CpuBackend::new(None)?;
    println!("cpu: {}", cpu.describe());
    println!("(no GPU backend in this build yet)");
    Ok(())
}
