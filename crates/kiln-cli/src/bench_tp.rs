//! `kiln bench --tp N`: llama-bench's pp and tg tests on a model split over N ranks
//! (`kiln_models::tp`; GPUs through NCCL, or with --device cpu shares of the CPU: see
//! `ranks`), a thread each. Every rank runs the same steps; each picks the same next token
//! on its own device (the all-reduce leaves every rank the same hidden state), and rank
//! 0's clock is reported.

use crate::console::{CliResult, Failure};
use crate::model_file::DeviceChoice;
use crate::ranks::{self, Devices, NodeArgs, Ranks, Watchdog};
use kiln_core::{Backend, Collective, DType};
use kiln_dist::gate::Gate;
use kiln_dist::start::StartLine;
use kiln_io::gguf::GgufFile;
use kiln_models::{Model, SyntheticShape, SyntheticType};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

pub struct TpBench {
    pub tp: usize,
    pub device: DeviceChoice,
    pub threads: Option<usize>,
    pub model: Option<PathBuf>,
    pub synthetic: Option<String>,
    pub ty: String,
    pub prompt: usize,
    pub gen: usize,
    pub reps: usize,
    pub kv_type: Option<DType>,
    pub nodes: NodeArgs,
}

/// What a rank measured.
struct Measured {
    device: String,
    /// Each test's name and the tokens/s of its timed repetitions.
    tests: Vec<(String, Vec<f64>)>,
    /// Weight bytes a decode step reads on this rank.
    decode_bytes: usize,
    /// The GPU's copy bandwidth (bytes read + written a second); `None` on the CPU.
    copy_bandwidth: Option<f64>,
}

/// One rank's model.
fn load(b: &TpBench, backend: Arc<dyn Backend>, c: Arc<dyn Collective>) -> CliResult<Model> {
    match (&b.model, &b.synthetic) {
        (Some(path), None) => Ok(Model::from_gguf_rank(&GgufFile::open(path)?, backend, c)?),
        (None, Some(shape)) => {
            let s = SyntheticShape::from_name(shape).ok_or_else(|| {
                Failure::usage(format!(
                    "--synthetic {shape}: the shapes are tinyllama-1.1b, llama3-8b and llama3-70b"
                ))
            })?;
            let t = SyntheticType::from_name(&b.ty)
                .ok_or_else(|| Failure::usage(format!("--type {}: not a weight type", b.ty)))?;
            Ok(Model::synthetic_rank(s.config(), t, backend, c)?)
        }
        _ => Err(Failure::usage(
            "--tp: give either -m MODEL.gguf or --synthetic SHAPE",
        )),
    }
}

/// What rank `rank` measured.
fn rank_run(
    b: &TpBench,
    rank: usize,
    ranks: &Ranks,
    start: &StartLine,
    barrier: &Gate,
) -> CliResult<Measured> {
    let setup = || -> CliResult<(Model, String, Arc<dyn Collective>)> {
        let (backend, c) = ranks.take(rank)?;
        let describe = backend.describe();
        Ok((load(b, backend, c.clone())?, describe, c))
    };
    let timeout = ranks::rank_timeout()?;
    let starting = Watchdog::starting(rank, 3 * timeout);
    let (mut model, describe, c) = start.cross(rank, setup()).map_err(Failure::usage)?;
    drop(starting);
    let dog = Watchdog::new(rank, c, timeout);
    let measured = measure(b, rank, ranks, &mut model, barrier, &dog);
    if let Err(e) = &measured {
        // The others stop waiting for it: at the gate between tests, and in collectives.
        barrier.break_with(format!("rank {rank} failed: {e}"));
        ranks.abort(rank, &e.to_string());
    }
    Ok(Measured {
        device: describe,
        ..measured?
    })
}

/// Rank `rank`'s runs of the tests (its `device` left for the caller).
fn measure(
    b: &TpBench,
    rank: usize,
    ranks: &Ranks,
    model: &mut Model,
    barrier: &Gate,
    dog: &Watchdog,
) -> CliResult<Measured> {
    // The roofline's bandwidth: 256 MiB copies, far beyond the L2 cache.
    let copy_bandwidth = match ranks.devices {
        Devices::Cuda(..) => Some(kiln_cuda::copy_bandwidth(
            rank - ranks.here().start,
            256 << 20,
        )?),
        Devices::Cpu(_) => None,
    };
    // F16 keys and values on GPUs, F32 on the CPU, as on one device.
    let kv = b.kv_type.unwrap_or(match b.device {
        DeviceChoice::Cpu => DType::F32,
        _ => DType::F16,
    });
    let ctx = b.prompt.max(b.gen) + 1;
    let mut cache = model.new_cache(ctx, kv)?;
    let vocab = model.config.vocab_size as u32;
    let mut out = Vec::new();
    let tests = [(b.prompt, true), (b.gen, false)];
    for (tokens, prompt) in tests.into_iter().filter(|(n, _)| *n > 0) {
        let mut speeds = Vec::new();
        for rep in 0..=b.reps {
            barrier.wait()?;
            let clock = Instant::now();
            if prompt {
                let ids: Vec<u32> = (0..tokens as u32)
                    .map(|i| (i * 7919 + 13) % vocab)
                    .collect();
                model.forward_argmax(&ids, 0, &mut cache)?;
            } else {
                let mut next = 1;
                for pos in 0..tokens {
                    next = model.forward_argmax(&[next], pos, &mut cache)?;
                    dog.alive();
                }
            }
            dog.alive();
            if rep > 0 {
                speeds.push(tokens as f64 / clock.elapsed().as_secs_f64());
            }
        }
        let test = if prompt {
            format!("pp{tokens}")
        } else {
            format!("tg{tokens}")
        };
        out.push((test, speeds));
    }
    Ok(Measured {
        device: String::new(),
        tests: out,
        decode_bytes: model.decode_bytes(),
        copy_bandwidth,
    })
}

pub fn run(b: &TpBench) -> CliResult<String> {
    if b.tp < 2 {
        return Err(Failure::usage(format!("--tp {}: give 2 or more", b.tp)));
    }
    let settings = format!(
        "{:?} {} -p {} -n {} -r {} {:?}",
        b.synthetic, b.ty, b.prompt, b.gen, b.reps, b.kv_type
    );
    let fingerprint = ranks::fingerprint(b.model.as_deref(), &settings);
    let ranks = Ranks::new("--tp", b.tp, b.device, b.threads, &b.nodes, &fingerprint)?;
    let here = ranks.here();
    let barrier = Gate::new(here.len());
    let start = StartLine::new(here.len());
    let results = ranks.each(|rank| rank_run(b, rank, &ranks, &start, &barrier));
    // Ranks that failed at the start all report the same message: rank 0's says it.
    let mut measured = Vec::new();
    for r in results {
        measured.push(r?);
    }
    let name = match (&b.model, &b.synthetic) {
        (Some(p), _) => p.display().to_string(),
        (_, Some(s)) => format!("{s} ({})", b.ty),
        _ => String::new(),
    };
    let mut out = String::from("| model | device | test | t/s |\n|---|---|---|---:|\n");
    let Measured { device, tests, .. } = &measured[0];
    for (test, speeds) in tests {
        let mean = speeds.iter().sum::<f64>() / speeds.len() as f64;
        let sd = (speeds.iter().map(|v| (v - mean).powi(2)).sum::<f64>()
            / (speeds.len().max(2) - 1) as f64)
            .sqrt();
        out += &format!(
            "| {name} | {device} × {} | {test} | {mean:.2} ± {sd:.2} |\n",
            b.tp
        );
    }
    // Decode's bound: the slowest rank streaming its weights at its copy bandwidth.
    let bound = measured
        .iter()
        .map(|m| m.copy_bandwidth.map(|bw| (m.decode_bytes as f64 / bw, m)))
        .collect::<Option<Vec<_>>>()
        .and_then(|v| v.into_iter().max_by(|a, b| a.0.total_cmp(&b.0)));
    let tg = tests.iter().find(|(t, _)| t.starts_with("tg"));
    if let (Some((seconds, m)), Some((test, speeds))) = (bound, tg) {
        let mean = speeds.iter().sum::<f64>() / speeds.len() as f64;
        out += &format!(
            "\n{test}: {:.1}% of the HBM roofline ({:.2} GB of weights a token on each rank, {:.0} GB/s copy bandwidth: {:.1} t/s at most)\n",
            100.0 * mean * seconds,
            m.decode_bytes as f64 / 1e9,
            m.copy_bandwidth.unwrap_or(0.0) / 1e9,
            1.0 / seconds
        );
    }
    Ok(out)
}
