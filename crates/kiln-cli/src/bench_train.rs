//! `kiln bench --train SHAPE`: training steps of a LLaMA-shaped model made from scratch,
//! on random token ids, in tokens per second (forward, backward and the AdamW step with
//! clipping, as `kiln train` runs them). `llama-134m` is the training issue's benchmark
//! (dim 768, 12 layers, 12 heads, FFN 2048, vocabulary 32000); `kiln-default` is the
//! embedded model's shape.

use crate::console::{CliResult, Failure};
use crate::model_file::{self, DeviceChoice};
use crate::train::{scratch_config, ScratchShape};
use kiln_train::data::TextData;
use kiln_train::init::scratch_start;
use kiln_train::rng::Rng;
use kiln_train::{Rule, Schedule, Settings, StepConfig, Trainer};
use std::time::Instant;

pub struct TrainBench {
    pub shape: String,
    pub device: DeviceChoice,
    pub threads: Option<usize>,
    /// Timed steps, after one untimed.
    pub reps: usize,
    /// Sequences a step.
    pub batch: usize,
    pub seq_len: usize,
    pub products: kiln_core::Products,
    /// Run each layer again in the backward pass instead of keeping its activations.
    pub checkpoint_activations: bool,
    pub json: bool,
}

/// The named shapes: their sizes and vocabulary.
fn shape(name: &str, seq_len: usize) -> CliResult<(ScratchShape, usize)> {
    let (dim, layers, heads, ffn, vocab) = match name {
        "llama-134m" => (768, 12, 12, 2048, 32000),
        "kiln-default" => (256, 4, 4, 704, 1024),
        other => {
            return Err(Failure::usage(format!(
                "--train {other}: the shapes are llama-134m and kiln-default"
            )))
        }
    };
    let shape = ScratchShape {
        dim,
        layers,
        heads,
        kv_heads: heads,
        ffn,
        context: seq_len,
    };
    Ok((shape, vocab))
}

pub fn run(opts: &TrainBench) -> CliResult<String> {
    let (shape, vocab) = shape(&opts.shape, opts.seq_len)?;
    if opts.batch == 0 || opts.seq_len == 0 {
        return Err(Failure::usage(format!(
            "-b {} --seq-len {}: at least one sequence of one token",
            opts.batch, opts.seq_len
        )));
    }
    let config = scratch_config("llama", &shape, vocab)?;
    let backend = model_file::backend(opts.device, opts.threads)?;
    let start = scratch_start(&config, true, 0.02, 0, &opts.shape, vec![])?;
    // Random ids: the speed does not depend on the text. Enough for a window a sequence.
    let mut rng = Rng::new(0);
    let mut ids =
        |n: usize| -> Vec<u32> { (0..n).map(|_| rng.below(vocab as u64) as u32).collect() };
    let data = TextData {
        train: ids(4 * (opts.seq_len + 1)),
        held_out: ids(opts.seq_len + 1),
        files: vec![],
    };
    let settings = Settings {
        batch: opts.batch,
        grad_accum: 1,
        seq_len: opts.seq_len,
        steps: opts.reps + 1,
        optimizer: StepConfig {
            rule: Rule::adamw(0.1),
            schedule: Schedule::Constant { lr: 1e-4 },
            max_grad_norm: Some(1.0),
            loss_scaling: (opts.products == kiln_core::Products::F16)
                .then(kiln_core::optim::LossScaling::default),
        },
        seed: 0,
        eval_windows: 1,
        lora: None,
        products: opts.products,
    };
    // Device memory the run takes: kiln's allocator keeps freed buffers for reuse, so
    // what is gone from the free memory after the steps is the steps' high-water mark.
    let free_before = backend.free_memory()?;
    let mut t = Trainer::new(&start, data, settings, backend.clone())?
        .checkpoint_activations(opts.checkpoint_activations);
    t.step()?;
    let mut times = Vec::with_capacity(opts.reps);
    for _ in 0..opts.reps {
        let at = Instant::now();
        t.step()?; // returns once the step's loss and norm are read back
        times.push(at.elapsed().as_secs_f64());
    }
    let held = free_before
        .zip(backend.free_memory()?)
        .map(|(before, after)| before.saturating_sub(after) as f64 / (1u64 << 30) as f64);
    times.sort_by(f64::total_cmp);
    let s = times[times.len() / 2];
    let tokens = opts.batch * opts.seq_len;
    let tps = tokens as f64 / s;
    let params = t.parameter_count();
    let device = backend.describe();
    Ok(if opts.json {
        format!(
            "{}\n",
            serde_json::json!({
                "test": "train",
                "shape": opts.shape,
                "device": device,
                "params": params,
                "batch": opts.batch,
                "seq_len": opts.seq_len,
                "precision": opts.products.name(),
                "median_s": s,
                "tokens_per_s": tps,
                "checkpoint_activations": opts.checkpoint_activations,
                "device_memory_gib": held,
                "reps": opts.reps,
            })
        )
    } else {
        let memory = held.map_or("-".to_string(), |g| format!("{g:.2}"));
        format!(
            "# Training steps (F32 weights, {} products, AdamW, clipping{}), {device}\n\n\
             | shape | params | batch × seq | median s/step | tokens/s | device memory (GiB) |\n\
             |---|---:|---:|---:|---:|---:|\n\
             | {} | {params} | {} × {} | {s:.3} | {tps:.0} | {memory} |\n",
            opts.products.name(),
            match opts.checkpoint_activations {
                true => ", activation checkpointing",
                false => "",
            },
            opts.shape,
            opts.batch,
            opts.seq_len
        )
    })
}
