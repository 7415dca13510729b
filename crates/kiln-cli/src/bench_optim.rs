//! `kiln bench --optimizer`: AdamW steps over flat FP32 buffers (by default 268M
//! parameters in 64 tensors, the benchmark), in parameters per second.
//!
//! A step reads parameters, gradients and both moments and writes back parameters and
//! moments: 28 bytes a parameter, which is the floor of its time at the device's copy
//! bandwidth (an H200 copies 4.20 TB/s, read + written: 150 G params/s at most).

use crate::console::{CliResult, Failure};
use crate::model_file::{self, DeviceChoice};
use kiln_core::{Backend, DType, Shape};
use kiln_models::memory::human_bytes;
use kiln_optim::{Optimizer, ParamLayout, Rule, Schedule, StepConfig};
use std::time::Instant;

/// Bytes a parameter moves in an AdamW step (4 read, 3 written, 4 bytes each).
const BYTES_PER_PARAM: usize = 28;

pub struct OptimizerBench {
    pub device: DeviceChoice,
    pub threads: Option<usize>,
    pub reps: usize,
    pub params: usize,
    pub tensors: usize,
    pub json: bool,
}

pub fn run(opts: &OptimizerBench) -> CliResult<String> {
    if opts.tensors == 0 || opts.params < opts.tensors {
        return Err(Failure::usage(format!(
            "--params {} --tensors {}: at least one parameter a tensor, and one tensor",
            opts.params, opts.tensors
        )));
    }
    let backend = model_file::backend(opts.device, opts.threads)?;
    let b: &dyn Backend = backend.as_ref();
    let per = opts.params / opts.tensors;
    let layout = ParamLayout::new((0..opts.tensors).map(|i| {
        let len = if i + 1 == opts.tensors {
            opts.params - per * (opts.tensors - 1)
        } else {
            per
        };
        (format!("t{i}"), vec![len])
    }))?;
    let n = layout.numel();
    // Parameters, gradients and two moments.
    let need = 4 * 4 * n as u128;
    let free = match b.free_memory()? {
        Some(bytes) => Some(bytes as u128),
        None => kiln_models::memory::host_free_memory().map(|f| f.bytes),
    };
    if let Some(free) = free.filter(|&f| need > f) {
        return Err(Failure::usage(format!(
            "--params {}: the benchmark needs {} and {} is free on {}",
            opts.params,
            human_bytes(need),
            human_bytes(free),
            b.device()
        )));
    }
    let shape = Shape::new(vec![n])?;
    let mut params = b.zeros(DType::F32, shape.clone())?;
    b.fill(&mut params, 0.5)?;
    let mut grads = b.zeros(DType::F32, shape)?;
    b.fill(&mut grads, 0.01)?;
    let config = StepConfig {
        rule: Rule::adamw(0.01),
        schedule: Schedule::Constant { lr: 1e-3 },
        max_grad_norm: None,
        loss_scaling: None,
    };
    let mut opt = Optimizer::new(b, layout, config)?;
    // Steps between waits for the device, so that a wait's latency is spread thin.
    let steps = if b.device() == kiln_core::Device::Cpu {
        1
    } else {
        20
    };
    opt.step(b, &mut params, &grads, None)?;
    opt.status(b)?;
    let mut times = Vec::with_capacity(opts.reps);
    for _ in 0..opts.reps {
        let t = Instant::now();
        for _ in 0..steps {
            opt.step(b, &mut params, &grads, None)?;
        }
        opt.status(b)?; // waits for the queued steps
        times.push(t.elapsed().as_secs_f64() / steps as f64);
    }
    times.sort_by(f64::total_cmp);
    let s = times[times.len() / 2];
    let gps = opts.params as f64 / s / 1e9;
    let gbs = (BYTES_PER_PARAM * opts.params) as f64 / s / 1e9;
    let device = b.describe();
    Ok(if opts.json {
        format!(
            "{}\n",
            serde_json::json!({
                "test": "adamw",
                "device": device,
                "params": opts.params,
                "tensors": opts.tensors,
                "median_ms": s * 1e3,
                "g_params_per_s": gps,
                "gb_per_s": gbs,
                "reps": opts.reps,
            })
        )
    } else {
        format!(
            "# AdamW step over flat FP32 buffers, {device}\n\n\
             | params | tensors | median ms/step | G params/s | GB/s moved ({BYTES_PER_PARAM} B/param) |\n\
             |---:|---:|---:|---:|---:|\n\
             | {} | {} | {:.3} | {gps:.1} | {gbs:.0} |\n",
            opts.params,
            opts.tensors,
            s * 1e3
        )
    })
}
