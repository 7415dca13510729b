//! `kiln bench -m MODEL | --synthetic SHAPE --type TYPE`: llama-bench's tests.
//! `pp<p>`: a prompt of p tokens in one pass; `tg<n>`: n tokens generated one at a time
//! from an empty context. Each test runs once to warm up, then `r` times; the table gives
//! the mean and standard deviation of tokens per second. Like llama-bench, neither test
//! reads back logits: the next token is picked on the device.

use crate::console::{CliResult, Failure};
use crate::model_file::{self, DeviceChoice};
use kiln_core::{DType, KernelTime};
use kiln_models::memory::{self, MemoryPlan};
use kiln_models::{BatchItem, Model, StepOutput, StepWant, SyntheticShape, SyntheticType};
use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

pub struct ModelBench {
    pub model: Option<PathBuf>,
    pub synthetic: Option<String>,
    pub ty: String,
    pub prompt: usize,
    pub gen: usize,
    /// Positions in the KV cache before the tg test's first token.
    pub depth: usize,
    /// Sequences decoded together in the tg test.
    pub batch: usize,
    pub reps: usize,
    pub threads: Option<usize>,
    pub device: DeviceChoice,
    pub kv_type: Option<DType>,
    pub json: bool,
}

struct Row {
    model: String,
    ty: String,
    kv: DType,
    device: String,
    test: String,
    mean: f64,
    stddev: f64,
}

fn mean_std(v: &[f64]) -> (f64, f64) {
    let mean = v.iter().sum::<f64>() / v.len() as f64;
    let var = if v.len() > 1 {
        v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (v.len() - 1) as f64
    } else {
        0.0
    };
    (mean, var.sqrt())
}

/// Positions a block of the batched test's paged cache holds (as `kiln serve`'s).
const BLOCK: usize = 16;

/// What sets the tests' context, for a message that it does not fit: the larger of the
/// prompt and depth + generated tokens.
const CONTEXT_SETTING: &str = "-p, or -d with -n, sets it";

pub fn run(b: &ModelBench) -> CliResult<String> {
    let ctx = b
        .prompt
        .max(b.depth.saturating_add(b.gen))
        .saturating_add(1);
    if ctx > model_file::MAX_CONTEXT {
        return Err(Failure::usage(format!(
            "-p {} -n {} -d {}: at most {} positions for the prompt and for depth + generated",
            b.prompt,
            b.gen,
            b.depth,
            model_file::MAX_CONTEXT - 1
        )));
    }
    let at_depth = match b.depth {
        0 => String::new(),
        d => format!(" @ d{d}"),
    };
    let backend = model_file::backend(b.device, b.threads)?;
    let profiled = backend.clone();
    let device = backend.describe();
    let (mut model, name, ty, kv) = match (&b.model, &b.synthetic) {
        (Some(path), None) => {
            let file = model_file::open(Some(path))?;
            let kv = model_file::kv_type(b.kv_type, backend.as_ref(), file.config(), &file.name)?;
            let plan = file.plan(backend.as_ref(), b.prompt, false, kv);
            let m = file.load(backend, &plan, ctx, CONTEXT_SETTING)?;
            let name = path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            (m, name, "file".to_string(), kv)
        }
        (None, Some(shape)) => {
            let s = SyntheticShape::from_name(shape).ok_or_else(|| {
                Failure::usage(format!(
                    "--synthetic {shape}: the shapes are tinyllama-1.1b, llama3-8b and llama3-70b"
                ))
            })?;
            let t = SyntheticType::from_name(&b.ty).ok_or_else(|| {
                Failure::usage(format!(
                    "--type {}: the types are f32, f16, bf16, q8_0, q4_0, q4_k_m",
                    b.ty
                ))
            })?;
            let kv = model_file::kv_type(b.kv_type, backend.as_ref(), &s.config(), s.name())?;
            // Its weights are made in memory, on the host for the CPU (where the plan
            // counts none, a file's being mapped), so they are checked there first.
            let weights = t.weight_bytes(&s.config());
            let plan = MemoryPlan::new(&s.config(), weights, backend.device(), b.prompt, false, kv);
            if let Some(free) = memory::free_memory(backend.as_ref())? {
                if backend.device() == kiln_core::Device::Cpu && u128::from(weights) > free.bytes {
                    return Err(Failure::usage(format!(
                        "--synthetic {shape} --type {}: its weights take {}, and {} has {} free: pick a smaller shape or a narrower --type",
                        b.ty,
                        memory::human_bytes(u128::from(weights)),
                        free.what,
                        memory::human_bytes(free.bytes)
                    )));
                }
                plan.check(ctx, &free)
                    .map_err(|no_room| Failure::usage(format!("{no_room} ({CONTEXT_SETTING})")))?;
            }
            eprintln!(
                "building a random {} model with {} weights...",
                s.name(),
                t.name()
            );
            (
                Model::synthetic(s, t, backend)?,
                s.name().to_string(),
                t.name(),
                kv,
            )
        }
        _ => return Err(Failure::usage("give either -m MODEL or --synthetic SHAPE")),
    };
    let vocab = model.config.vocab_size as u64;
    let mut seed = 12345u64;
    let mut token = move || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((seed >> 33) % vocab) as u32
    };
    let mut cache = model.new_cache(ctx, kv)?;
    let mut rows = Vec::new();
    // The timed runs' wall time, to set the kernel profile against, and what the
    // warm-ups added to the profile (first touches of mapped weights, kernel builds), which
    // is taken out of it.
    let mut wall_ms = 0.0;
    let mut warm_up = Warmup::default();
    if b.prompt > 0 {
        let ids: Vec<u32> = (0..b.prompt).map(|_| token()).collect();
        let mut speeds = Vec::new();
        for rep in 0..=b.reps {
            let before = (rep == 0).then(|| profiled.kernel_profile()).flatten();
            let t = Instant::now();
            model.forward_argmax(&ids, 0, &mut cache)?;
            if rep == 0 {
                warm_up.add(before, profiled.kernel_profile());
                note_slow_warm_up(&format!("pp{}", b.prompt), t.elapsed(), b.reps);
            } else {
                wall_ms += t.elapsed().as_secs_f64() * 1e3;
                speeds.push(b.prompt as f64 / t.elapsed().as_secs_f64());
            }
        }
        let (mean, stddev) = mean_std(&speeds);
        rows.push(Row {
            model: name.clone(),
            ty: ty.clone(),
            kv,
            device: device.clone(),
            test: format!("pp{}", b.prompt),
            mean,
            stddev,
        });
    }
    if b.gen > 0 && b.batch == 1 {
        let mut speeds = Vec::new();
        for rep in 0..=b.reps {
            let mut next = token();
            let before = (rep == 0).then(|| profiled.kernel_profile()).flatten();
            let t = Instant::now();
            for pos in b.depth..b.depth + b.gen {
                next = model.forward_argmax(&[next], pos, &mut cache)?;
            }
            if rep == 0 {
                warm_up.add(before, profiled.kernel_profile());
                note_slow_warm_up(&format!("tg{}", b.gen), t.elapsed(), b.reps);
            } else {
                wall_ms += t.elapsed().as_secs_f64() * 1e3;
                speeds.push(b.gen as f64 / t.elapsed().as_secs_f64());
            }
        }
        let (mean, stddev) = mean_std(&speeds);
        rows.push(Row {
            model: name.clone(),
            ty: ty.clone(),
            kv,
            device: device.clone(),
            test: format!("tg{}{at_depth}", b.gen),
            mean,
            stddev,
        });
    }
    if b.gen > 0 && b.batch > 1 {
        drop(cache);
        let per_seq = (b.depth + b.gen).div_ceil(BLOCK);
        let mut pool = model.new_paged_cache(b.batch * per_seq, BLOCK, kv)?;
        let tables: Vec<Vec<u32>> = (0..b.batch)
            .map(|s| ((s * per_seq) as u32..((s + 1) * per_seq) as u32).collect())
            .collect();
        let mut speeds = Vec::new();
        for rep in 0..=b.reps {
            let mut next: Vec<u32> = (0..b.batch).map(|_| token()).collect();
            let before = (rep == 0).then(|| profiled.kernel_profile()).flatten();
            let t = Instant::now();
            for pos in b.depth..b.depth + b.gen {
                let items: Vec<BatchItem> = next
                    .iter()
                    .zip(&tables)
                    .map(|(id, blocks)| BatchItem {
                        tokens: std::slice::from_ref(id),
                        pos0: pos,
                        blocks,
                        want: StepWant::Argmax,
                    })
                    .collect();
                let outs = model.forward_batch(&items, &mut pool);
                for (n, out) in next.iter_mut().zip(outs) {
                    *n = match out? {
                        StepOutput::Token(id) => id,
                        other => unreachable!("asked for a token, got {other:?}"),
                    };
                }
            }
            if rep == 0 {
                warm_up.add(before, profiled.kernel_profile());
                let test = format!("tg{} x{}", b.gen, b.batch);
                note_slow_warm_up(&test, t.elapsed(), b.reps);
            } else {
                wall_ms += t.elapsed().as_secs_f64() * 1e3;
                speeds.push((b.batch * b.gen) as f64 / t.elapsed().as_secs_f64());
            }
        }
        let (mean, stddev) = mean_std(&speeds);
        rows.push(Row {
            model: name,
            ty,
            kv,
            device,
            test: format!("tg{} x{}{at_depth}", b.gen, b.batch),
            mean,
            stddev,
        });
    }
    Ok(if b.json {
        let rows: Vec<serde_json::Value> = rows
            .iter()
            .map(|r| {
                serde_json::json!({
                    "model": r.model, "type": r.ty, "kv_type": r.kv.name(), "device": r.device,
                    "test": r.test,
                    "tokens_per_s": r.mean, "stddev": r.stddev, "repetitions": b.reps,
                })
            })
            .collect();
        format!("{}\n", serde_json::Value::Array(rows))
    } else {
        let mut out = String::from(
            "| model | type | kv | device | test | t/s |\n|---|---|---|---|---|---:|\n",
        );
        for r in &rows {
            out += &format!(
                "| {} | {} | {} | {} | {} | {:.2} ± {:.2} |\n",
                r.model, r.ty, r.kv, r.device, r.test, r.mean, r.stddev
            );
        }
        // Kernel times of the timed runs above, warm-ups taken out (`-p 0` for decode
        // alone).
        if let Some(kernels) = profiled.kernel_profile() {
            let kernels = warm_up.remove_from(kernels);
            out += "\n| kernel | calls | total ms | µs per call |\n|---|---:|---:|---:|\n";
            let (calls, ms) = kernels
                .iter()
                .fold((0, 0.0), |(c, t), k| (c + k.calls, t + k.total_ms));
            for k in kernels {
                out += &format!(
                    "| {} | {} | {:.2} | {:.2} |\n",
                    k.name,
                    k.calls,
                    k.total_ms,
                    1e3 * k.total_ms / k.calls.max(1) as f64
                );
            }
            // Against the runs' own time: what is left went between the kernels.
            out += &format!("| all kernels | {calls} | {ms:.2} | |\n");
            out += &format!("| timed runs (wall) | | {wall_ms:.2} | |\n");
        }
        out
    })
}

/// What the warm-up runs added to the kernel profile, per kernel.
#[derive(Default)]
struct Warmup(HashMap<String, (u64, f64)>);

impl Warmup {
    /// Add what a warm-up added between two readings of the profile.
    fn add(&mut self, before: Option<Vec<KernelTime>>, after: Option<Vec<KernelTime>>) {
        let Some(after) = after else {
            return;
        };
        let before: HashMap<String, (u64, f64)> = before
            .unwrap_or_default()
            .into_iter()
            .map(|k| (k.name, (k.calls, k.total_ms)))
            .collect();
        for k in after {
            let (calls, ms) = before.get(&k.name).copied().unwrap_or((0, 0.0));
            let added = self.0.entry(k.name).or_default();
            added.0 += k.calls.saturating_sub(calls);
            added.1 += k.total_ms - ms;
        }
    }

    /// `kernels` less the warm-ups' share, largest first; kernels only warm-ups ran go.
    fn remove_from(&self, kernels: Vec<KernelTime>) -> Vec<KernelTime> {
        let mut left: Vec<KernelTime> = kernels
            .into_iter()
            .filter_map(|mut k| {
                let (calls, ms) = self.0.get(&k.name).copied().unwrap_or((0, 0.0));
                k.calls = k.calls.saturating_sub(calls);
                k.total_ms -= ms;
                (k.calls > 0).then_some(k)
            })
            .collect();
        left.sort_by(|a, b| b.total_ms.total_cmp(&a.total_ms));
        left
    }
}

/// A warm-up run longer than this gets a note of what the timed runs will take.
const SLOW_WARM_UP: Duration = Duration::from_secs(10);

/// What the timed runs of `test` will take, from its warm-up run, when that was slow (a
/// long prompt on the CPU runs for minutes with nothing shown): `None` when it was not.
fn slow_warm_up_note(test: &str, warm_up: Duration, reps: usize) -> Option<String> {
    if warm_up < SLOW_WARM_UP || reps == 0 {
        return None;
    }
    let secs = warm_up.as_secs_f64();
    let rest = secs * reps as f64;
    let human = |s: f64| {
        if s < 120.0 {
            format!("{s:.0} s")
        } else {
            format!("{:.0} min", s / 60.0)
        }
    };
    Some(format!(
        "{test}: the warm-up run took {}; the {reps} timed run{} will take about {} more (-r sets their number)",
        human(secs),
        if reps == 1 { "" } else { "s" },
        human(rest)
    ))
}

fn note_slow_warm_up(test: &str, warm_up: Duration, reps: usize) {
    if let Some(note) = slow_warm_up_note(test, warm_up, reps) {
        eprintln!("{note}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slow_warm_up_says_what_the_timed_runs_will_take() {
        assert_eq!(slow_warm_up_note("pp512", Duration::from_secs(2), 3), None);
        assert_eq!(slow_warm_up_note("pp512", Duration::from_secs(60), 0), None);
        assert_eq!(
            slow_warm_up_note("pp100000", Duration::from_secs(300), 3).as_deref(),
            Some("pp100000: the warm-up run took 5 min; the 3 timed runs will take about 15 min more (-r sets their number)")
        );
        assert_eq!(
            slow_warm_up_note("tg128", Duration::from_secs(12), 1).as_deref(),
            Some("tg128: the warm-up run took 12 s; the 1 timed run will take about 12 s more (-r sets their number)")
        );
    }

    fn kernel(name: &str, calls: u64, total_ms: f64) -> KernelTime {
        KernelTime {
            name: name.into(),
            calls,
            total_ms,
        }
    }

    #[test]
    fn warm_ups_are_taken_out_of_the_profile() {
        let mut warm_up = Warmup::default();
        // The first warm-up starts from nothing; the second after some timed runs.
        warm_up.add(
            None,
            Some(vec![kernel("build", 1, 90.0), kernel("mm", 2, 8.0)]),
        );
        warm_up.add(
            Some(vec![kernel("build", 1, 90.0), kernel("mm", 6, 20.0)]),
            Some(vec![
                kernel("build", 1, 90.0),
                kernel("mm", 7, 24.0),
                kernel("attn", 1, 1.0),
            ]),
        );
        let left = warm_up.remove_from(vec![
            kernel("build", 1, 90.0),
            kernel("mm", 20, 63.0),
            kernel("attn", 5, 5.0),
        ]);
        let got: Vec<(&str, u64, f64)> = left
            .iter()
            .map(|k| (k.name.as_str(), k.calls, k.total_ms))
            .collect();
        assert_eq!(got, [("mm", 17, 51.0), ("attn", 4, 4.0)]);
        // Off: nothing to take out.
        let mut off = Warmup::default();
        off.add(None, None);
        assert!(off.0.is_empty());
    }
}
