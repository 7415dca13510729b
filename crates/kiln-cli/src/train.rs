//! `kiln train`: train a model on text, from scratch (an architecture and size, the
//! embedded model's tokenizer or another model's) or from a model file (full fine-tune,
//! or LoRA adapters of chosen projections),
//! with a progress bar, held-out loss every N steps, checkpoints that a crash cannot
//! corrupt, and the model exported at the end. Everything goes into `--out`:
//! `checkpoint.gguf` (the last complete checkpoint, itself a model `kiln run` loads),
//! `model.gguf` (the export) and `train.json` (settings, losses, evaluations, timings).

use crate::console::{CliResult, Failure};
use crate::model_file::{self, DeviceChoice};
use crate::ranks::Ranks;
use kiln_core::{Backend, Collective, DType, Error, RopeLayout};
use kiln_io::gguf::{GgufFile, Value};
use kiln_models::{Arch, Ffn, ModelConfig, Norm, Rope};
use kiln_tokenizer::Tokenizer;
use kiln_train::data::{self, HeldOut};
use kiln_train::init;
use kiln_train::{LoraSettings, Rule, Schedule, Settings, StepConfig, StepReport, Trainer};
use serde_json::json;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

/// The flags that define a run: a resumed run takes them from its checkpoint.
const RUN_FLAGS: &[&str] = &[
    "from",
    "arch",
    "dim",
    "layers",
    "heads",
    "kv_heads",
    "ffn",
    "context",
    "tokenizer",
    "init_std",
    "untied",
    "batch",
    "seq_len",
    "grad_accum",
    "steps",
    "optimizer",
    "lr",
    "min_lr",
    "warmup",
    "schedule",
    "step_size",
    "gamma",
    "pct_start",
    "weight_decay",
    "betas",
    "eps",
    "momentum",
    "nesterov",
    "amsgrad",
    "alpha",
    "centered",
    "clip",
    "seed",
    "precision",
    "eval_windows",
    "lora_rank",
    "lora_alpha",
    "lora_targets",
];

#[derive(clap::Args)]
pub struct TrainArgs {
    /// Text to train on: a file, or a directory of text files.
    #[arg(long)]
    pub data: PathBuf,
    /// Held-out text, scored every --eval-every steps (taken out of --data's directory
    /// when it is in it). Default: the last 10% of the training text's tokens.
    #[arg(long)]
    pub held_out: Option<PathBuf>,
    /// Where the checkpoint, the exported model and the log go (created if missing).
    #[arg(short = 'o', long)]
    pub out: PathBuf,
    /// Go on from --out's checkpoint.gguf, with its settings (give the same --data).
    #[arg(long, conflicts_with_all = RUN_FLAGS)]
    pub resume: bool,
    /// Fine-tune this model (a .gguf file or a Hugging Face directory; in F32: every
    /// weight is trained, or with --lora-rank low-rank updates of some) instead of starting
    /// from scratch.
    #[arg(long, conflicts_with_all = ["arch", "dim", "layers", "heads", "kv_heads", "ffn", "context", "tokenizer", "init_std", "untied"])]
    pub from: Option<PathBuf>,
    /// With --from: train LoRA adapters of this rank (the model's weights frozen); the
    /// exported model has them merged in.
    #[arg(long, requires = "from")]
    pub lora_rank: Option<usize>,
    /// LoRA: the updates are scaled by alpha / rank (default: twice the rank).
    #[arg(long, requires = "lora_rank")]
    pub lora_alpha: Option<f32>,
    /// LoRA: the projections adapted in every layer, of q, k, v, o, gate, up, down.
    #[arg(
        long,
        requires = "lora_rank",
        value_delimiter = ',',
        default_value = "q,k,v,o"
    )]
    pub lora_targets: Vec<String>,
    /// Data parallelism: this many replicas (GPUs cuda:0..N through NCCL, or with
    /// --device cpu shares of the CPU's threads), each running its share of every step's
    /// sequences (--batch × --grad-accum must divide among them), gradients summed.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub dp: Option<u16>,
    /// With --dp: shard the optimizer's state over the ranks (ZeRO stage 1): each keeps
    /// and updates 1/N of it; gradients are reduce-scattered, weights all-gathered.
    #[arg(long, requires = "dp")]
    pub zero1: bool,
    /// With --dp: sum the gradients in buckets of about this many MiB, each as soon as the
    /// backward pass has made it, beside the rest of the pass (25 unless told, as PyTorch
    /// DDP); 0 sums them all after it. (With --zero1 they are reduce-scattered after it.)
    #[arg(long, requires = "dp", conflicts_with = "zero1")]
    pub bucket_mb: Option<u32>,
    #[command(flatten)]
    pub nodes: crate::ranks::NodeArgs,
    /// From scratch: llama or gpt2.
    #[arg(long, default_value = "llama")]
    pub arch: String,
    #[arg(long, default_value_t = 256)]
    pub dim: usize,
    #[arg(long, default_value_t = 4)]
    pub layers: usize,
    #[arg(long, default_value_t = 4)]
    pub heads: usize,
    /// Grouped-query attention (default: as many as --heads).
    #[arg(long)]
    pub kv_heads: Option<usize>,
    #[arg(long, default_value_t = 704)]
    pub ffn: usize,
    /// Positions the model is made for.
    #[arg(long, default_value_t = 512)]
    pub context: usize,
    /// From scratch: the tokenizer of this model (default: the embedded model's).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// From scratch: weights are drawn from N(0, this).
    #[arg(long, default_value_t = 0.02)]
    pub init_std: f32,
    /// From scratch: an output projection of its own (default: the embeddings, tied).
    #[arg(long)]
    pub untied: bool,
    /// Sequences per micro-batch, run in one forward pass (the activations of all of them
    /// are kept until its backward, unless --checkpoint-activations).
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    /// Keep only each layer's input for the backward pass, which runs the layer again:
    /// a layer's activations in memory instead of every layer's, for about a third more
    /// compute. The results are the same; a resumed run may choose again.
    #[arg(long)]
    pub checkpoint_activations: bool,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 256)]
    pub seq_len: usize,
    /// Micro-batches per optimizer step.
    #[arg(long, default_value_t = 1)]
    pub grad_accum: usize,
    #[arg(long, default_value_t = 1000)]
    pub steps: usize,
    /// The update rule: adamw, adam, sgd, rmsprop or adagrad (kiln-optim's, with
    /// PyTorch's formulas).
    #[arg(long, default_value = "adamw")]
    pub optimizer: String,
    /// Peak learning rate (one-cycle's max_lr).
    #[arg(long, default_value_t = 3e-3)]
    pub lr: f64,
    /// cosine: the learning rate it ends at.
    #[arg(long, default_value_t = 0.0)]
    pub min_lr: f64,
    /// Steps of linear warm-up (cosine and linear; default 100, at most --steps / 10).
    #[arg(long)]
    pub warmup: Option<u64>,
    /// cosine (warm-up, then half a cosine down to --min-lr at the last step), linear
    /// (warm-up from lr/warmup, then constant), constant, step (× --gamma every
    /// --step-size steps) or onecycle (PyTorch's OneCycleLR, cosine, up to --lr).
    #[arg(long, default_value = "cosine")]
    pub schedule: String,
    /// step: steps between decays.
    #[arg(long)]
    pub step_size: Option<u64>,
    /// step: the factor of each decay.
    #[arg(long, default_value_t = 0.1)]
    pub gamma: f64,
    /// onecycle: the fraction of steps spent rising.
    #[arg(long, default_value_t = 0.3)]
    pub pct_start: f64,
    /// Weight decay of every parameter (decoupled for adamw, added to the gradient for
    /// the others).
    #[arg(long, default_value_t = 0.1)]
    pub weight_decay: f64,
    /// adam, adamw: beta1,beta2.
    #[arg(long, default_value = "0.9,0.95", value_delimiter = ',', num_args = 1)]
    pub betas: Vec<f64>,
    /// adam, adamw, rmsprop, adagrad: the denominator's epsilon (default PyTorch's: 1e-8,
    /// adagrad 1e-10).
    #[arg(long)]
    pub eps: Option<f64>,
    /// sgd, rmsprop: momentum.
    #[arg(long, default_value_t = 0.0)]
    pub momentum: f64,
    /// sgd: Nesterov momentum.
    #[arg(long)]
    pub nesterov: bool,
    /// adam, adamw: AMSGrad.
    #[arg(long)]
    pub amsgrad: bool,
    /// rmsprop: the square average's smoothing constant.
    #[arg(long, default_value_t = 0.99)]
    pub alpha: f64,
    /// rmsprop: centered.
    #[arg(long)]
    pub centered: bool,
    /// Clip the gradient's global norm to this; 0 turns clipping off.
    #[arg(long, default_value_t = 1.0)]
    pub clip: f32,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// The products' arithmetic: f32, or tf32 / bf16 / f16 (inputs rounded on a CUDA GPU's
    /// tensor cores; weights, gradients, sums and the optimizer stay F32: BF16 compute with
    /// F32 master weights). f16 scales the loss dynamically (an overflow skips the step).
    #[arg(long, default_value = "f32", value_parser = crate::model_file::products_arg)]
    pub precision: kiln_core::Products,
    /// Score the held-out text every N steps (and at the end); 0: only at the end.
    #[arg(long, default_value_t = 100)]
    pub eval_every: usize,
    /// Held-out windows of --seq-len tokens scored at most per evaluation.
    #[arg(long, default_value_t = 64)]
    pub eval_windows: usize,
    /// Write a checkpoint every N steps (and at the end); 0: only at the end.
    #[arg(long, default_value_t = 100)]
    pub save_every: usize,
    /// Stop this session after N steps, with a checkpoint (go on later with --resume).
    #[arg(long)]
    pub pause_after: Option<usize>,
    /// Weight type of the exported model.gguf: f32, f16, bf16, q8_0, q4_0, q4_K, q6_K.
    #[arg(long = "export-type", default_value = "f32")]
    pub export_type: String,
    /// general.name of what is written.
    #[arg(long, default_value = "kiln-trained")]
    pub name: String,
    /// cpu or cuda[:N] (wgpu has no backward kernels yet).
    #[arg(long, default_value_t = DeviceChoice::Cpu)]
    pub device: DeviceChoice,
    #[arg(short = 't', long)]
    pub threads: Option<usize>,
}

/// Refuse flags that cannot be used, before anything is read; the optimizer's
/// configuration and the export's type.
fn check(a: &TrainArgs) -> CliResult<(StepConfig, DType)> {
    let export = DType::from_name(&a.export_type)
        .filter(|d| *d != DType::I32)
        .ok_or_else(|| {
            Failure::usage(format!(
                "--export-type {}: one of f32, f16, bf16, q8_0, q4_0, q4_K, q6_K",
                a.export_type
            ))
        })?;
    for (flag, v) in [
        ("--batch", a.batch),
        ("--seq-len", a.seq_len),
        ("--grad-accum", a.grad_accum),
        ("--steps", a.steps),
        ("--eval-windows", a.eval_windows),
    ] {
        if v == 0 {
            return Err(Failure::usage(format!("{flag} 0: it must be at least 1")));
        }
    }
    let finite = |flag: &str, v: f64, ok: bool| {
        if v.is_finite() && ok {
            Ok(())
        } else {
            Err(Failure::usage(format!("{flag} {v}: out of range")))
        }
    };
    finite("--lr", a.lr, a.lr > 0.0)?;
    finite("--min-lr", a.min_lr, a.min_lr >= 0.0 && a.min_lr <= a.lr)?;
    finite("--clip", a.clip as f64, a.clip >= 0.0)?;
    finite("--init-std", a.init_std as f64, a.init_std > 0.0)?;
    if !matches!(a.device, DeviceChoice::Cpu | DeviceChoice::Cuda(_)) {
        return Err(Failure::usage(format!(
            "--device {}: training runs on cpu or cuda (backward kernels exist only there)",
            a.device
        )));
    }
    let config = StepConfig {
        rule: rule(a)?,
        schedule: schedule(a)?,
        max_grad_norm: (a.clip > 0.0).then_some(a.clip),
        // F16 products scale the loss as torch.amp.GradScaler does, with its defaults.
        loss_scaling: (a.precision == kiln_core::Products::F16)
            .then(kiln_core::optim::LossScaling::default),
    };
    // kiln-optim's own checks, in its words.
    config.validate().map_err(Failure::usage)?;
    Ok((config, export))
}

/// `--optimizer` and its hyperparameters.
fn rule(a: &TrainArgs) -> CliResult<Rule> {
    let &[beta1, beta2] = a.betas.as_slice() else {
        return Err(Failure::usage(format!(
            "--betas {:?}: two values, beta1,beta2",
            a.betas
        )));
    };
    let eps = a.eps.unwrap_or(1e-8);
    Ok(match a.optimizer.as_str() {
        "adamw" | "adam" => Rule::Adam {
            beta1,
            beta2,
            eps,
            weight_decay: a.weight_decay,
            decoupled_weight_decay: a.optimizer == "adamw",
            amsgrad: a.amsgrad,
        },
        "sgd" => Rule::Sgd {
            momentum: a.momentum,
            dampening: 0.0,
            nesterov: a.nesterov,
            weight_decay: a.weight_decay,
        },
        "rmsprop" => Rule::RmsProp {
            alpha: a.alpha,
            eps,
            weight_decay: a.weight_decay,
            momentum: a.momentum,
            centered: a.centered,
        },
        "adagrad" => Rule::Adagrad {
            lr_decay: 0.0,
            weight_decay: a.weight_decay,
            eps: a.eps.unwrap_or(1e-10),
            initial_accumulator_value: 0.0,
        },
        other => {
            return Err(Failure::usage(format!(
                "--optimizer {other}: one of adamw, adam, sgd, rmsprop, adagrad"
            )))
        }
    })
}

/// `--schedule` over the run's `--steps`.
fn schedule(a: &TrainArgs) -> CliResult<Schedule> {
    let steps = a.steps as u64;
    let no_warmup = |name: &str| match a.warmup {
        Some(w) if w > 0 => Err(Failure::usage(format!(
            "--warmup {w}: the {name} schedule has no warm-up (cosine and linear have)"
        ))),
        _ => Ok(()),
    };
    let warmup = match a.warmup {
        Some(w) if w >= steps && a.schedule == "cosine" => {
            return Err(Failure::usage(format!(
                "--warmup {w}: the cosine schedule's warm-up must end before the last of --steps {steps}"
            )))
        }
        Some(w) => w,
        None => 100.min(steps / 10),
    };
    Ok(match a.schedule.as_str() {
        "cosine" => Schedule::Cosine {
            lr: a.lr,
            min_lr: a.min_lr,
            warmup,
            total: steps,
        },
        "linear" if warmup == 0 => Schedule::Constant { lr: a.lr },
        "linear" => Schedule::LinearWarmup {
            lr: a.lr,
            start_factor: 1.0 / warmup as f64,
            warmup,
        },
        "constant" => {
            no_warmup("constant")?;
            Schedule::Constant { lr: a.lr }
        }
        "step" => {
            no_warmup("step")?;
            let step_size = a.step_size.ok_or_else(|| {
                Failure::usage("--schedule step needs --step-size N (steps between decays)")
            })?;
            Schedule::Step {
                lr: a.lr,
                step_size,
                gamma: a.gamma,
            }
        }
        "onecycle" => {
            no_warmup("onecycle")?;
            Schedule::OneCycle {
                max_lr: a.lr,
                total: steps,
                pct_start: a.pct_start,
                div_factor: 25.0,
                final_div_factor: 1e4,
            }
        }
        other => {
            return Err(Failure::usage(format!(
                "--schedule {other}: one of cosine, linear, constant, step, onecycle"
            )))
        }
    })
}

/// The sizes of a model made from scratch (`--dim`, `--layers`, ...).
pub(crate) struct ScratchShape {
    pub dim: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub ffn: usize,
    pub context: usize,
}

impl ScratchShape {
    fn of(a: &TrainArgs) -> ScratchShape {
        ScratchShape {
            dim: a.dim,
            layers: a.layers,
            heads: a.heads,
            kv_heads: a.kv_heads.unwrap_or(a.heads),
            ffn: a.ffn,
            context: a.context,
        }
    }
}

/// The configuration of a from-scratch `arch` model (llama or gpt2) of shape `a`.
pub(crate) fn scratch_config(arch: &str, a: &ScratchShape, vocab: usize) -> CliResult<ModelConfig> {
    let arch = match arch {
        "llama" => Arch::Llama,
        "gpt2" => Arch::Gpt2,
        other => {
            return Err(Failure::usage(format!(
            "--arch {other}: from scratch kiln trains llama or gpt2 (--from fine-tunes the others)"
        )))
        }
    };
    let kv = a.kv_heads;
    let sizes = [
        ("--dim", a.dim),
        ("--layers", a.layers),
        ("--heads", a.heads),
        ("--kv-heads", kv),
        ("--ffn", a.ffn),
        ("--context", a.context),
    ];
    for (flag, v) in sizes {
        if !(1..=1 << 16).contains(&v) {
            return Err(Failure::usage(format!("{flag} {v}: from 1 to 65536")));
        }
    }
    if !a.dim.is_multiple_of(a.heads) || !a.heads.is_multiple_of(kv) {
        return Err(Failure::usage(format!(
            "--dim {} --heads {} --kv-heads {kv}: heads must divide dim, kv-heads heads",
            a.dim, a.heads
        )));
    }
    let head_dim = a.dim / a.heads;
    let rope = (arch == Arch::Llama).then_some(Rope {
        theta: 10000.0,
        dims: head_dim,
        layout: RopeLayout::Interleaved,
        llama3: None,
        freq_factors: None,
    });
    if rope.is_some() && head_dim % 2 == 1 {
        return Err(Failure::usage(format!(
            "--dim {} / --heads {}: rope needs an even head width",
            a.dim, a.heads
        )));
    }
    Ok(ModelConfig {
        arch,
        vocab_size: vocab,
        dim: a.dim,
        n_layers: a.layers,
        n_heads: a.heads,
        n_kv_heads: kv,
        head_dim,
        ffn_dim: a.ffn,
        max_positions: a.context,
        norm: match arch {
            Arch::Gpt2 => Norm::Layer { eps: 1e-5 },
            _ => Norm::Rms { eps: 1e-5 },
        },
        ffn: match arch {
            Arch::Gpt2 => Ffn::Gelu,
            _ => Ffn::SwiGlu,
        },
        rope,
        attn_scale: 1.0 / (head_dim as f32).sqrt(),
        attn_softcap: None,
        final_softcap: None,
        sliding_window: None,
        sliding_layers: vec![false; a.layers],
        embed_scale: None,
        post_norms: false,
    })
}

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
            true => init::frozen_start(&model, &a.name, meta)?,
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

pub fn run(a: TrainArgs, quiet: bool) -> CliResult {
    let (optimizer, export_type) = check(&a)?;
    let dp = usize::from(a.dp.unwrap_or(1));
    // With several replicas, each rank makes its backend; the start is made on the CPU.
    let backend: Arc<dyn Backend> = match dp {
        1 => model_file::backend(a.device, a.threads)?,
        _ => Arc::new(kiln_cpu::CpuBackend::new(a.threads)?),
    };
    std::fs::create_dir_all(&a.out).map_err(|e| Error::io(a.out.display(), e))?;
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

/// The progress bar on a terminal; otherwise a line now and then.
struct Progress {
    bar: Option<indicatif::ProgressBar>,
    quiet: bool,
    /// Plain lines: one per this many steps.
    every: usize,
    tokens_per_second: f64,
}

impl Progress {
    fn new(t: &Trainer, quiet: bool) -> Progress {
        let steps = t.settings().steps as u64;
        let bar = (!quiet && std::io::stderr().is_terminal()).then(|| {
            let bar = indicatif::ProgressBar::new(steps);
            bar.set_style(
                indicatif::ProgressStyle::with_template(
                    "{bar:30} {pos}/{len} {msg} [{elapsed_precise}, ETA {eta_precise}]",
                )
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            bar.set_position(t.steps_done() as u64);
            bar
        });
        Progress {
            bar,
            quiet,
            every: (t.settings().steps / 20).max(1),
            tokens_per_second: 0.0,
        }
    }

    fn step(&mut self, r: &StepReport, seconds: f64) {
        self.tokens_per_second = r.tokens as f64 / seconds.max(1e-9);
        let msg = format!(
            "loss {:.4} · {:.0} tok/s · lr {:.2e}",
            r.loss, self.tokens_per_second, r.lr
        );
        match &self.bar {
            Some(bar) => {
                bar.set_message(msg);
                bar.set_position(r.step as u64);
            }
            None if !self.quiet && r.step.is_multiple_of(self.every) => {
                eprintln!("step {}: {msg}", r.step)
            }
            None => {}
        }
    }

    fn say(&self, line: &str) {
        match &self.bar {
            Some(bar) => bar.println(line),
            None if !self.quiet => eprintln!("{line}"),
            None => {}
        }
    }

    fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish();
        }
    }
}

/// `train.json` in the output directory: what the run was, and how it went. A resumed
/// run goes on with the log its checkpoint's run wrote.
struct Log {
    path: PathBuf,
    value: serde_json::Value,
    /// Seconds of earlier sessions of this run.
    before: f64,
}

impl Log {
    fn open(out: &Path, t: &Trainer, device: &str) -> kiln_core::Result<Log> {
        let path = out.join("train.json");
        let c = &t.model().config;
        let fresh = json!({
            "settings": t.settings(),
            "model": {
                "arch": c.arch.name(), "vocab": c.vocab_size, "dim": c.dim, "layers": c.n_layers,
                "heads": c.n_heads, "kv_heads": c.n_kv_heads, "ffn": c.ffn_dim,
                "context": c.max_positions, "parameters": t.parameter_count(),
            },
            "data": {
                "files": t.data().files, "train_tokens": t.data().train.len(),
                "held_out_tokens": t.data().held_out.len(), "fingerprint": t.data().fingerprint(),
            },
            "device": device,
            "steps": [],
            "evals": [],
        });
        // A log whose steps go past the checkpoint's belongs to a later, lost session:
        // cut back to the checkpoint.
        let done = t.steps_done() as u64;
        let (mut value, before) = match std::fs::read_to_string(&path)
            .ok()
            .and_then(|s| serde_json::from_str::<serde_json::Value>(&s).ok())
        {
            Some(old) if done > 0 => {
                let before = old["seconds"].as_f64().unwrap_or(0.0);
                (old, before)
            }
            _ => (fresh, 0.0),
        };
        for key in ["steps", "evals"] {
            if let Some(list) = value[key].as_array_mut() {
                list.retain(|e| e["step"].as_u64().is_some_and(|s| s <= done));
            }
        }
        Ok(Log {
            path,
            value,
            before,
        })
    }

    fn step(&mut self, r: &StepReport, seconds: f64) {
        if let Some(list) = self.value["steps"].as_array_mut() {
            list.push(json!({
                "step": r.step, "loss": r.loss, "lr": r.lr, "grad_norm": r.grad_norm,
                "skipped": r.skipped, "seconds": seconds,
            }));
        }
    }

    fn eval(&mut self, step: usize, loss: f64) {
        if let Some(list) = self.value["evals"].as_array_mut() {
            list.push(json!({"step": step, "held_out_loss": loss, "perplexity": loss.exp()}));
        }
    }

    fn write(&mut self, seconds: f64) -> kiln_core::Result<()> {
        self.value["seconds"] = json!(self.before + seconds);
        let text = serde_json::to_string_pretty(&self.value)
            .map_err(|e| Error::format(format!("the training log: {e}")))?;
        kiln_io::file::write_replacing(&self.path, |w| {
            use std::io::Write;
            w.write_all(text.as_bytes())
        })
    }
}
