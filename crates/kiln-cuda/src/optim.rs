//! The optimizer step on the GPU (kernels in `kernels/optim.cu`): the gradient pass when
//! clipping or loss scaling, `optim_prepare` (one thread: the step's factors, in the
//! control block), then one update launch over the flat buffers. Nothing is read back:
//! the step can be recorded in a CUDA graph and replayed.

use crate::kernels::Arg;
use crate::{ptr, CudaBackend};
use kiln_core::optim::{Rule, Schedule, StepBuffers, StepConfig};
use kiln_core::{DType, Error, OptimKernels, Result};

/// Blocks of the gradient pass at most: enough to fill any GPU, few enough that
/// `optim_prepare` sums their partials in a few microseconds.
const STATS_BLOCKS: usize = 1024;

/// Elements each thread of the update takes (one float4 of each buffer).
const PER_THREAD: usize = 4;

// Flags of the update kernels (optim.cu).
const UNSCALE: i32 = 1;
const CLIP: i32 = 2;
const COPY_BF16: i32 = 4;
const COPY_F16: i32 = 8;
const VECTOR: i32 = 16;
const RULE_A: i32 = 32;
const RULE_B: i32 = 64;
const RULE_C: i32 = 128;

/// `optim_prepare`'s rule arguments: kind, four hyperparameters, flags.
fn rule_args(rule: Rule) -> [Arg; 6] {
    let f = |v: f64| Arg::U64(v.to_bits());
    let (kind, h, flags) = match rule {
        Rule::Sgd {
            momentum,
            dampening,
            weight_decay,
            ..
        } => (0, [momentum, dampening, weight_decay, 0.0], 0),
        Rule::Adam {
            beta1,
            beta2,
            eps,
            weight_decay,
            decoupled_weight_decay,
            ..
        } => (
            1,
            [beta1, beta2, eps, weight_decay],
            decoupled_weight_decay as i32,
        ),
        Rule::RmsProp {
            alpha,
            eps,
            weight_decay,
            momentum,
            ..
        } => (2, [alpha, eps, weight_decay, momentum], 0),
        Rule::Adagrad {
            lr_decay,
            weight_decay,
            eps,
            ..
        } => (3, [lr_decay, weight_decay, eps, 0.0], 0),
    };
    [
        Arg::I32(kind),
        f(h[0]),
        f(h[1]),
        f(h[2]),
        f(h[3]),
        Arg::I32(flags),
    ]
}

/// `optim_prepare`'s schedule arguments: kind and five parameters.
fn schedule_args(schedule: Schedule) -> [Arg; 6] {
    let (kind, s) = match schedule {
        Schedule::Constant { lr } => (0, [lr, 0.0, 0.0, 0.0, 0.0]),
        Schedule::LinearWarmup {
            lr,
            start_factor,
            warmup,
        } => (1, [lr, start_factor, warmup as f64, 0.0, 0.0]),
        Schedule::Cosine {
            lr,
            min_lr,
            warmup,
            total,
        } => (2, [lr, min_lr, warmup as f64, total as f64, 0.0]),
        Schedule::Step {
            lr,
            step_size,
            gamma,
        } => (3, [lr, step_size as f64, gamma, 0.0, 0.0]),
        Schedule::OneCycle {
            max_lr,
            total,
            pct_start,
            div_factor,
            final_div_factor,
        } => (
            4,
            [
                max_lr,
                total as f64,
                pct_start,
                div_factor,
                final_div_factor,
            ],
        ),
    };
    let f = |v: f64| Arg::U64(v.to_bits());
    [Arg::I32(kind), f(s[0]), f(s[1]), f(s[2]), f(s[3]), f(s[4])]
}

/// The update kernel, its rule flags, and which state goes in which of its three slots.
fn update_kernel(rule: Rule) -> (&'static str, i32, [Option<usize>; 3]) {
    let bit = |on: bool, b: i32| if on { b } else { 0 };
    match rule {
        Rule::Sgd {
            momentum,
            nesterov,
            weight_decay,
            ..
        } => (
            "optim_sgd",
            bit(weight_decay != 0.0, RULE_A) | bit(momentum != 0.0, RULE_B) | bit(nesterov, RULE_C),
            [(momentum != 0.0).then_some(0), None, None],
        ),
        Rule::Adam {
            weight_decay,
            decoupled_weight_decay,
            amsgrad,
            ..
        } => (
            "optim_adam",
            bit(weight_decay != 0.0, RULE_A)
                | bit(decoupled_weight_decay, RULE_B)
                | bit(amsgrad, RULE_C),
            [Some(0), Some(1), amsgrad.then_some(2)],
        ),
        Rule::RmsProp {
            weight_decay,
            momentum,
            centered,
            ..
        } => {
            let has_momentum = momentum > 0.0;
            (
                "optim_rmsprop",
                bit(weight_decay != 0.0, RULE_A)
                    | bit(has_momentum, RULE_B)
                    | bit(centered, RULE_C),
                [
                    Some(0),
                    has_momentum.then_some(1),
                    centered.then_some(1 + has_momentum as usize),
                ],
            )
        }
        Rule::Adagrad { weight_decay, .. } => (
            "optim_adagrad",
            bit(weight_decay != 0.0, RULE_A),
            [Some(0), None, None],
        ),
    }
}

impl OptimKernels for CudaBackend {
    fn step(&self, config: &StepConfig, bufs: StepBuffers<'_>) -> Result<()> {
        config.validate()?;
        let n = bufs.check(config)?;
        let control = ptr(bufs.control)?;
        let grads = ptr(bufs.grads)?;
        let (sums, bads, partials) = if config.needs_grad_stats() {
            let blocks = n.div_ceil(256 * 16).clamp(1, STATS_BLOCKS);
            let sums = self.scratch("optim_partial_sums", blocks * 8)?;
            let bads = self.scratch("optim_partial_bad", blocks * 4)?;
            self.launch(
                "optim_grad_stats",
                (blocks as u32, 1, 1),
                (256, 1, 1),
                0,
                &[
                    Arg::Ptr(grads),
                    Arg::U64(n as u64),
                    Arg::Ptr(control),
                    Arg::I32(config.loss_scaling.is_some() as i32),
                    Arg::Ptr(sums),
                    Arg::Ptr(bads),
                ],
            )?;
            (sums, bads, blocks)
        } else {
            (0, 0, 0)
        };
        let scaling = config.loss_scaling;
        let mut args = vec![
            Arg::Ptr(control),
            Arg::Ptr(sums),
            Arg::Ptr(bads),
            Arg::I32(partials as i32),
        ];
        args.extend(rule_args(config.rule));
        args.extend(schedule_args(config.schedule));
        args.extend([
            Arg::F32(config.max_grad_norm.unwrap_or(0.0)),
            Arg::I32(scaling.is_some() as i32),
            Arg::F32(scaling.map_or(1.0, |s| s.growth_factor)),
            Arg::F32(scaling.map_or(1.0, |s| s.backoff_factor)),
            Arg::I32(scaling.map_or(0, |s| s.growth_interval.min(i32::MAX as u32) as i32)),
        ]);
        self.launch("optim_prepare", (1, 1, 1), (1, 1, 1), 0, &args)?;
        if n == 0 {
            return Ok(());
        }

        let (kernel, rule_flags, slots) = update_kernel(config.rule);
        let states: Vec<u64> = bufs.states.iter().map(ptr).collect::<Result<_>>()?;
        let slot_ptrs = slots.map(|s| s.map_or(0, |i| states[i]));
        let (copy, copy_flag) = match &bufs.compute_copy {
            Some(t) => (
                ptr(t)?,
                if t.dtype() == DType::BF16 {
                    COPY_BF16
                } else {
                    COPY_F16
                },
            ),
            None => (0, 0),
        };
        let params = ptr(bufs.params)?;
        let aligned = [params, grads]
            .iter()
            .chain(slot_ptrs.iter().filter(|&&p| p != 0))
            .all(|p| p % 16 == 0)
            && copy % 8 == 0;
        let flags = rule_flags
            | copy_flag
            | if scaling.is_some() { UNSCALE } else { 0 }
            | if config.max_grad_norm.is_some() {
                CLIP
            } else {
                0
            }
            | if aligned { VECTOR } else { 0 };
        let blocks = u32::try_from(n.div_ceil(256 * PER_THREAD)).map_err(|_| {
            Error::shape(format!(
                "{n} parameters are too many for one optimizer launch"
            ))
        })?;
        self.launch(
            kernel,
            (blocks, 1, 1),
            (256, 1, 1),
            0,
            &[
                Arg::Ptr(params),
                Arg::Ptr(grads),
                Arg::Ptr(slot_ptrs[0]),
                Arg::Ptr(slot_ptrs[1]),
                Arg::Ptr(slot_ptrs[2]),
                Arg::Ptr(copy),
                Arg::U64(n as u64),
                Arg::Ptr(control),
                Arg::I32(flags),
            ],
        )
    }
}
