//! `kiln train`: train a model on text, from scratch (an architecture and size, the
//! embedded model's tokenizer or another model's) or from a model file (full fine-tune,
//! or LoRA adapters of chosen projections),
//! with a progress bar, held-out loss every N steps, checkpoints that a crash cannot
//! corrupt, and the model exported at the end. Everything goes into `--out`:
//! `checkpoint.gguf` (the last complete checkpoint, itself a model `kiln run` loads),
//! `model.gguf` (the export) and `train.json` (settings, losses, evaluations, timings).

use crate::console::{CliResult, Failure};
use crate::model_file::{self};
use crate::ranks::Ranks;
use kiln_core::{Backend, Collective, DType, Error};
use kiln_io::gguf::{GgufFile, Value};
use kiln_tokenizer::Tokenizer;
use kiln_train::data::{self, HeldOut};
use kiln_train::init;
use kiln_train::{LoraSettings, Settings, StepConfig, Trainer};
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

mod args;
mod report;

use args::check;
pub use args::TrainArgs;
pub(crate) use args::{scratch_config, ScratchShape};
use report::{Log, Progress};

/// A model file's tokenizer as GGUF metadata: a GGUF's own keys as they are, else the
/// vocabulary written out (SentencePiece vocabularies).
fn tokenizer_metadata(file: &model_file::ModelFile) -> kiln_core::Result<Vec<(String, Value)>> {
    match file.checkpoint.gguf() {
        Some(g) => Ok(g
            .metadata
            .iter()
            .filter(|(k, _)| k.starts_with("tokenizer."))
            .cloned()
            .collect()),
        None => file.tokenizer.gguf_metadata(),
    }
}

/// What the run starts from, and its tokenizer.
fn start(a: &TrainArgs, backend: &Arc<dyn Backend>) -> CliResult<(GgufFile, Tokenizer)> {
    let ckpt = a.out.join("checkpoint.gguf");
    if a.resume {
        if !ckpt.exists() {
            return Err(Failure::usage(format!(
                "--resume: {} does not exist (no run to go on with in {})",
                ckpt.display(),
                a.out.display()
            )));
        }
        let f = GgufFile::open(&ckpt)?;
        let tok = Tokenizer::from_gguf(&f)?;
        return Ok((f, tok));
    }
    if let Some(from) = &a.from {
        let file = model_file::open(Some(from))?;
        let context = file.config().max_positions;
        if a.seq_len > context {
            return Err(Failure::usage(format!(
                "--seq-len {}: {} was made for {context} positions",
                a.seq_len,
                from.display()
            )));
        }
        let meta = tokenizer_metadata(&file)?;
        // A GGUF file kept as stored is the start itself, mapped (the pages of weights the
        // kernels repack are released; the rest is page cache), not a copy in memory,
        // and its weights are not loaded twice.
        if let Some(g) = file.checkpoint.gguf() {
            let types: Vec<(&str, Option<DType>)> = g
                .tensors
                .iter()
                .map(|t| (t.name.as_str(), t.ggml_type.dtype()))
                .collect();
            if keeps_stored(a, backend.as_ref(), &types) {
                let mut f = GgufFile::open(from)?;
                f.set("general.name", Value::String(a.name.clone()));
                return Ok((f, file.tokenizer));
            }
        }
        let model = file.checkpoint.load(backend.clone(), None)?;
        let params = model.parameters();
        let types: Vec<(&str, Option<DType>)> = params
            .iter()
            .map(|(n, t)| (n.as_str(), Some(t.dtype())))
            .collect();
        let start = match keeps_stored(a, backend.as_ref(), &types) {
            true => init::frozen_start(&model, &a.name, meta, &a.out.join("start.gguf"))?,
            false => {
                warn_f32_copy(a, &types);
                init::model_start(&model, &a.name, meta)?
            }
        };
        return Ok((start, file.tokenizer));
    }
    let file = model_file::open(a.tokenizer.as_deref())?;
    let config = scratch_config(&a.arch, &ScratchShape::of(a), file.tokenizer.vocab_size())?;
    if a.seq_len > a.context {
        return Err(Failure::usage(format!(
            "--seq-len {}: the model's --context is {}",
            a.seq_len, a.context
        )));
    }
    let meta = tokenizer_metadata(&file)?;
    let start = init::scratch_start(&config, !a.untied, a.init_std, a.seed, &a.name, meta)?;
    Ok((start, file.tokenizer))
}

/// Whether a run from a model of these weights (name, type; `None` for a type kiln
/// converts as it loads) keeps them in their types: LoRA (the model is frozen) on one
/// backend whose backward reads them as stored (replicas, which make their own
/// backends, on the CPU alone). Otherwise the run starts from an F32 copy.
fn keeps_stored(a: &TrainArgs, backend: &dyn Backend, weights: &[(&str, Option<DType>)]) -> bool {
    let one_backend =
        a.dp.is_none_or(|d| d == 1) || matches!(a.device, model_file::DeviceChoice::Cpu);
    let takes = |g: &dyn kiln_core::GradOps| {
        weights
            .iter()
            .all(|(_, t)| t.is_some_and(|t| g.frozen_as_stored(t)))
    };
    a.lora_rank.is_some()
        && weights.iter().any(|(_, t)| *t != Some(DType::F32))
        && one_backend
        && backend.grad().is_some_and(takes)
}

/// Under LoRA, say why a model of these weights starts from an F32 copy.
fn warn_f32_copy(a: &TrainArgs, weights: &[(&str, Option<DType>)]) {
    let other = weights.iter().find_map(|&(n, t)| match t {
        Some(DType::F32) => None,
        t => Some((n, t.map_or("converted", |d| d.name()))),
    });
    if let (Some(_), Some((name, dtype))) = (a.lora_rank, other) {
        tracing::warn!(
            "LoRA over {dtype} weights ({name} is one) starts from an F32 copy of the model here: {}",
            match a.dp.is_none_or(|d| d == 1) {
                true =>
                    "this device's backward reads F32 weights alone; on the CPU they stay as stored",
                false => "replicas (--dp) on GPUs start from F32",
            }
        );
    }
}

/// Refuse an --out that is --data's directory or inside it: the run would read its own
/// checkpoints and exports as training text (and a resume then finds other text).
fn out_outside_data(a: &TrainArgs) -> CliResult {
    // Data that cannot be found is the text loader's to report.
    let (Ok(out), Ok(data)) = (
        std::fs::canonicalize(&a.out),
        std::fs::canonicalize(&a.data),
    ) else {
        return Ok(());
    };
    if data.is_dir() && out.starts_with(&data) {
        return Err(Failure::usage(format!(
            "--out {} is inside --data {}: the run would train on its own checkpoints; write elsewhere",
            a.out.display(),
            a.data.display()
        )));
    }
    Ok(())
}

pub fn run(a: TrainArgs, quiet: bool) -> CliResult {
    let (optimizer, export_type) = check(&a)?;
    let dp = usize::from(a.dp.unwrap_or(1));
    // With several replicas, each rank makes its backend; the start is made on the CPU.
    let backend: Arc<dyn Backend> = match dp {
        1 => model_file::backend(a.device, a.threads)?,
        _ => Arc::new(kiln_cpu::CpuBackend::new(a.threads)?),
    };
    if a.out.exists() && !a.out.is_dir() {
        return Err(Failure::usage(format!(
            "--out {}: a file; --out names the directory the run writes its checkpoint and exports into",
            a.out.display()
        )));
    }
    std::fs::create_dir_all(&a.out).map_err(|e| Error::io(a.out.display(), e))?;
    out_outside_data(&a)?;
    let stale = kiln_io::file::remove_stale_partials(&a.out);
    if stale > 0 {
        tracing::info!(
            "removed {stale} temporary files that killed runs left in {}",
            a.out.display()
        );
    }
    let (start_file, tokenizer) = start(&a, &backend)?;
    let held_out = match &a.held_out {
        Some(p) => HeldOut::File(p.clone()),
        None => HeldOut::Fraction(0.1),
    };
    // The text is an argument: what is wrong with it is for the user to change.
    let text = data::load(&a.data, &held_out, &tokenizer).map_err(Failure::usage)?;
    if dp > 1 {
        return data_parallel(
            &a,
            dp,
            quiet,
            &start_file,
            &tokenizer,
            text,
            optimizer,
            export_type,
        );
    }
    let t = make_trainer(&a, &start_file, text, optimizer, backend.clone())?;
    drive(
        &a,
        quiet,
        t,
        &tokenizer,
        export_type,
        &backend.describe(),
        None,
    )
}

/// The trainer of `a`'s run on `backend`: resumed, or new with `a`'s settings.
fn make_trainer(
    a: &TrainArgs,
    start_file: &GgufFile,
    text: data::TextData,
    optimizer: StepConfig,
    backend: Arc<dyn Backend>,
) -> CliResult<Trainer> {
    if a.resume {
        Trainer::resume(start_file, text, backend)
    } else {
        let settings = Settings {
            batch: a.batch,
            grad_accum: a.grad_accum,
            seq_len: a.seq_len,
            steps: a.steps,
            optimizer,
            seed: a.seed,
            eval_windows: a.eval_windows,
            lora: a.lora_rank.map(|rank| LoraSettings {
                rank,
                alpha: a.lora_alpha.unwrap_or(2.0 * rank as f32),
                targets: a.lora_targets.clone(),
            }),
            products: a.precision,
        };
        Trainer::new(start_file, text, settings, backend)
    }
    .map(|t| t.checkpoint_activations(a.checkpoint_activations))
    .map_err(|e| match e {
        // Settings that do not fit the text or the model.
        Error::Format(msg) => Failure::Usage(msg),
        e => Failure::Kiln(e),
    })
}

/// `--dp N`: ranks 1..N step in threads of their own, rank 0 here with the progress bar,
/// the log, the checkpoints and the exports (over several hosts, host 0; the others'
/// ranks all step as workers). Every rank here starts or none does; a rank that fails
/// stops the others' collectives, and a rank that waits too long on the others stops its
/// own (see `ranks::Watchdog`), so none waits for ever.
#[allow(clippy::too_many_arguments)]
fn data_parallel(
    a: &TrainArgs,
    dp: usize,
    quiet: bool,
    start_file: &GgufFile,
    tokenizer: &Tokenizer,
    text: data::TextData,
    optimizer: StepConfig,
    export_type: DType,
) -> CliResult {
    // Every host must run the same collectives: the sharding and buckets too.
    let settings = format!(
        "{} {} {} {} {} {} {} {} {} {:?} {:?} {} {} {} {} {} {:?}",
        text.fingerprint(),
        a.arch,
        a.dim,
        a.layers,
        a.heads,
        a.ffn,
        a.batch,
        a.seq_len,
        a.grad_accum,
        a.from,
        a.lora_rank,
        a.steps,
        a.optimizer,
        a.lr,
        a.seed,
        a.zero1,
        a.bucket_mb
    );
    let fingerprint = crate::ranks::fingerprint(None, &settings);
    let ranks = Ranks::new("--dp", dp, a.device, a.threads, &a.nodes, &fingerprint)?;
    let here = ranks.here();
    let timeout = crate::ranks::rank_timeout()?;
    let start = kiln_dist::start::StartLine::new(here.len());
    let replica = |rank: usize| -> CliResult<(Trainer, Arc<dyn Collective>, String)> {
        let (backend, c) = ranks.take(rank)?;
        let describe = backend.describe();
        let t = make_trainer(a, start_file, text.clone(), optimizer, backend)?
            .data_parallel(c.clone())?;
        let t = match a.zero1 {
            true => t.shard_optimizer()?,
            false => {
                t.bucket_bytes(a.bucket_mb.map_or(kiln_train::DEFAULT_BUCKET_BYTES, |mb| {
                    mb as usize * (1 << 20)
                }))?
            }
        };
        Ok((t, c, describe))
    };
    std::thread::scope(|s| {
        let workers: Vec<_> = here
            .clone()
            .filter(|&rank| rank != 0)
            .map(|rank| {
                let (replica, start, ranks) = (&replica, &start, &ranks);
                s.spawn(move || -> CliResult {
                    let starting = crate::ranks::Watchdog::starting(rank, 3 * timeout);
                    let (mut t, c, _) = start.cross(rank, replica(rank)).map_err(Failure::usage)?;
                    drop(starting);
                    let dog = crate::ranks::Watchdog::new(rank, c, timeout);
                    let pause_at = a.pause_after.map(|n| t.steps_done() + n);
                    let steps = t.settings().steps;
                    let mut work = || -> kiln_core::Result<()> {
                        while t.steps_done() < steps && pause_at.is_none_or(|p| t.steps_done() < p)
                        {
                            let n = t.step()?.step;
                            dog.alive();
                            // Every rank scores its share of the held-out windows.
                            if evaluates_after(a, n, steps) {
                                t.held_out_loss()?;
                                dog.alive();
                            }
                            // Rank 0 saves here: a sharded optimizer's state is gathered
                            // from every rank.
                            if saves_after(a, n, steps) {
                                t.join_save()?;
                            }
                        }
                        if t.steps_done() < steps {
                            // Paused: rank 0 saves.
                            t.join_save()?;
                        }
                        Ok(())
                    };
                    if let Err(e) = work() {
                        ranks.abort(rank, &e.to_string());
                        return Err(e.into());
                    }
                    Ok(())
                })
            })
            .collect();
        let result = match here.contains(&0) {
            false => Ok(()),
            true => {
                let starting = crate::ranks::Watchdog::starting(0, 3 * timeout);
                let first = start.cross(0, replica(0)).map_err(Failure::usage);
                drop(starting);
                first
            }
            .and_then(|(t, c, describe)| {
                let out = drive(
                    a,
                    quiet,
                    t,
                    tokenizer,
                    export_type,
                    &format!("{describe} × {dp} (data-parallel)"),
                    Some(crate::ranks::Watchdog::new(0, c, timeout)),
                );
                if let Err(e) = &out {
                    ranks.abort(0, &e.to_string());
                }
                out
            }),
        };
        // Rank 0's failure is the one to show; a worker's when rank 0 had none.
        let mut failure = result.err();
        for w in workers {
            let r = w
                .join()
                .unwrap_or_else(|_| Err(Failure::usage("a rank panicked")));
            if let (None, Err(e)) = (&failure, r) {
                failure = Some(e);
            }
        }
        failure.map_or(Ok(()), Err)
    })
}

/// Whether the held-out loss is taken after step `n` of `steps` (every data-parallel
/// rank scores its share of it).
fn evaluates_after(a: &TrainArgs, n: usize, steps: usize) -> bool {
    n == steps || (a.eval_every > 0 && n.is_multiple_of(a.eval_every))
}

/// Whether a checkpoint is written after step `n` of `steps` (every rank of a sharded
/// run must know: each takes part in gathering the optimizer's state).
fn saves_after(a: &TrainArgs, n: usize, steps: usize) -> bool {
    n == steps || (a.save_every > 0 && n.is_multiple_of(a.save_every))
}

/// Steps, evaluations, checkpoints and exports of one trainer (rank 0 of a data-parallel
/// run), with the progress bar and the log.
fn drive(
    a: &TrainArgs,
    quiet: bool,
    mut t: Trainer,
    tokenizer: &Tokenizer,
    export_type: DType,
    device: &str,
    watch: Option<crate::ranks::Watchdog>,
) -> CliResult {
    let alive = || {
        if let Some(w) = &watch {
            w.alive();
        }
    };
    let mut log = Log::open(&a.out, &t, device)?;
    let mut bar = Progress::new(&t, quiet);
    let ckpt = a.out.join("checkpoint.gguf");
    let mut saves = BackgroundSave::default();
    let steps = t.settings().steps;
    let started = Instant::now();
    let pause_at = a.pause_after.map(|n| t.steps_done() + n);
    while t.steps_done() < steps {
        if pause_at.is_some_and(|p| t.steps_done() >= p) {
            saves.start(t.checkpoint()?, &ckpt)?;
            saves.wait()?;
            log.write(started.elapsed().as_secs_f64())?;
            bar.finish();
            if !quiet {
                eprintln!(
                    "paused after step {} of {steps}; {} holds the run (go on with --resume)",
                    t.steps_done(),
                    ckpt.display()
                );
            }
            return Ok(());
        }
        let at = Instant::now();
        let report = t.step()?;
        alive();
        let seconds = at.elapsed().as_secs_f64();
        bar.step(&report, seconds);
        log.step(&report, seconds);
        let n = report.step;
        if evaluates_after(a, n, steps) {
            let loss = t.held_out_loss()?;
            bar.say(&format!(
                "step {n}: held-out loss {loss:.4} (perplexity {:.2})",
                loss.exp()
            ));
            log.eval(n, loss);
            alive();
        }
        if saves_after(a, n, steps) {
            saves.start(t.checkpoint()?, &ckpt)?;
            log.write(started.elapsed().as_secs_f64())?;
            alive();
        }
    }
    // No collectives from here on: the exports take as long as they take.
    drop(watch);
    bar.finish();
    let model_out = a.out.join("model.gguf");
    // Matrices whose rows are not whole blocks of the type are written as F16: say so.
    let c = &t.model().config;
    let block = export_type.block_size();
    if let Some(k) = [c.dim, c.q_dim(), c.ffn_dim]
        .into_iter()
        .find(|k| k % block != 0)
    {
        tracing::warn!(
            "--export-type {}: rows of {k} values are not whole blocks of {block}; those matrices are written as F16",
            a.export_type
        );
    }
    t.export_gguf(&model_out, export_type)?;
    // A Hugging Face directory where the architecture and tokenizer allow one.
    let hf = a.out.join("hf");
    let hf_note = match t.export_hf(&hf, tokenizer) {
        Ok(()) => format!(", {}", hf.display()),
        Err(e @ Error::Unsupported(_)) => {
            tracing::warn!("no Hugging Face export: {e}");
            String::new()
        }
        Err(e) => return Err(e.into()),
    };
    saves.wait()?;
    log.write(started.elapsed().as_secs_f64())?;
    if !quiet {
        eprintln!(
            "wrote {} ({}, {}){hf_note} and {}",
            model_out.display(),
            a.export_type,
            match &t.settings().lora {
                Some(l) => format!(
                    "LoRA of rank {} merged in: {} parameters trained",
                    l.rank,
                    t.parameter_count()
                ),
                None => format!("{} parameters", t.parameter_count()),
            },
            ckpt.display()
        );
    }
    Ok(())
}

/// Checkpoints written by a thread of their own while the run goes on: a step waits for
/// the state's copy to the host, not for the disk (nor does a data-parallel rank's
/// watchdog, which would count a long write as a hung rank). Each save, and the end of
/// the run, first waits for the write before it (so an older checkpoint never lands
/// after a newer one) and reports its error. Dropped on an error, it still finishes the
/// write under way; a crash mid-write leaves the last complete checkpoint (the write is
/// atomic).
#[derive(Default)]
struct BackgroundSave {
    writing: Option<std::thread::JoinHandle<kiln_core::Result<()>>>,
}

impl BackgroundSave {
    fn start(
        &mut self,
        c: kiln_train::checkpoint::Checkpoint,
        path: &Path,
    ) -> kiln_core::Result<()> {
        self.wait()?;
        let path = path.to_path_buf();
        self.writing = Some(std::thread::spawn(move || c.write(&path)));
        Ok(())
    }

    fn wait(&mut self) -> kiln_core::Result<()> {
        match self.writing.take() {
            Some(w) => w
                .join()
                .unwrap_or_else(|_| Err(Error::format("the checkpoint's writer panicked"))),
            None => Ok(()),
        }
    }
}

impl Drop for BackgroundSave {
    fn drop(&mut self) {
        let _ = self.wait();
    }
}
