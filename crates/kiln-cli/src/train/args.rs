//! `kiln train`'s flags and what they mean: the run's settings, the optimizer, the
//! schedule, the shape of a model made from scratch.

use crate::console::{CliResult, Failure};
use crate::model_file::DeviceChoice;
use kiln_core::{DType, RopeLayout};
use kiln_models::{Arch, Ffn, ModelConfig, Norm, Rope};
use kiln_train::{Rule, Schedule, StepConfig};
use std::path::PathBuf;

/// The flags that define a run: a resumed run takes them from its checkpoint.
pub(super) const RUN_FLAGS: &[&str] = &[
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
pub(super) fn check(a: &TrainArgs) -> CliResult<(StepConfig, DType)> {
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
    // A micro-batch's tokens are rows that devices address with 32-bit integers.
    let tokens = a.batch.checked_mul(a.seq_len);
    if tokens.is_none_or(|t| t > i32::MAX as usize) || a.batch.checked_mul(a.grad_accum).is_none() {
        return Err(Failure::usage(format!(
            "--batch {} × --seq-len {} (× --grad-accum {}): more tokens than a step can hold (at most {} a micro-batch); give a smaller --batch",
            a.batch,
            a.seq_len,
            a.grad_accum,
            i32::MAX
        )));
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
    if let Some(eps) = a.eps {
        // The optimizers divide by it (a step of 0/0 where a gradient is 0).
        finite("--eps", eps, eps > 0.0)?;
    }
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
pub(super) fn rule(a: &TrainArgs) -> CliResult<Rule> {
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
pub(super) fn schedule(a: &TrainArgs) -> CliResult<Schedule> {
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
    pub(super) fn of(a: &TrainArgs) -> ScratchShape {
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
            "--dim {} --heads {} --kv-heads {kv}: heads must divide dim, and kv-heads must divide heads",
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
