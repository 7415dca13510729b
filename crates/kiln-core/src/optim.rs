//! The optimizer step as backends implement it: update rules with PyTorch's formulas,
//! learning-rate schedules, gradient clipping and loss scaling, over flat F32 buffers.
//!
//! Parameters, gradients and each state of an update rule are each one contiguous F32
//! buffer holding every tensor of a model end to end, so that a step is one pass (one
//! kernel launch) over all of them. What changes from step to step (step count, learning
//! rate, loss scale, the gradients' norm) lives in a small device buffer, a
//! [`StepControl`], which the step reads and updates on the device: nothing is read back,
//! and a recorded step (a CUDA graph) replays without being recorded again.
//!
//! A step runs in three parts, each on the device:
//! 1. when clipping or loss scaling is on, a pass over the gradients sums their squares
//!    (after unscaling) and notes any inf/NaN;
//! 2. [`StepControl::prepare`] (one thread) turns that and the step count into this step's
//!    factors: clipping coefficient, learning rate from the schedule, bias corrections;
//!    with loss scaling, an inf/NaN gradient skips the step and halves the scale;
//! 3. the update: one pass over parameters, gradients and states.
//!
//! The element-wise formulas are PyTorch's single-tensor path (`foreach=False`), operation
//! by operation, with every scalar computed in double precision and rounded to f32 where
//! PyTorch rounds it (see each [`Rule`] variant).

use crate::{DType, Error, Result, Tensor};

/// An update rule and its hyperparameters, with PyTorch's names (`torch.optim`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Rule {
    /// `torch.optim.SGD`. State: the momentum buffer when `momentum != 0`.
    Sgd {
        momentum: f64,
        dampening: f64,
        nesterov: bool,
        weight_decay: f64,
    },
    /// `torch.optim.Adam` (`decoupled_weight_decay: false`, weight decay added to the
    /// gradient) and `torch.optim.AdamW` (`true`, parameters multiplied by
    /// `1 - lr·weight_decay`). States: `exp_avg`, `exp_avg_sq`, and `max_exp_avg_sq`
    /// with `amsgrad`.
    Adam {
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
        decoupled_weight_decay: bool,
        amsgrad: bool,
    },
    /// `torch.optim.RMSprop`. States: `square_avg`, then `momentum_buffer` when
    /// `momentum > 0`, then `grad_avg` when `centered`.
    RmsProp {
        alpha: f64,
        eps: f64,
        weight_decay: f64,
        momentum: f64,
        centered: bool,
    },
    /// `torch.optim.Adagrad`. State: `sum`, which starts at `initial_accumulator_value`.
    Adagrad {
        lr_decay: f64,
        weight_decay: f64,
        eps: f64,
        initial_accumulator_value: f64,
    },
}

impl Rule {
    /// `torch.optim.AdamW`'s defaults.
    pub fn adamw(weight_decay: f64) -> Rule {
        Rule::Adam {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay,
            decoupled_weight_decay: true,
            amsgrad: false,
        }
    }

    /// The names of the rule's state buffers, in the order the step takes them.
    pub fn states(&self) -> Vec<&'static str> {
        match *self {
            Rule::Sgd { momentum, .. } => {
                if momentum != 0.0 {
                    vec!["momentum_buffer"]
                } else {
                    vec![]
                }
            }
            Rule::Adam { amsgrad, .. } => {
                let mut s = vec!["exp_avg", "exp_avg_sq"];
                if amsgrad {
                    s.push("max_exp_avg_sq");
                }
                s
            }
            Rule::RmsProp {
                momentum, centered, ..
            } => {
                let mut s = vec!["square_avg"];
                if momentum > 0.0 {
                    s.push("momentum_buffer");
                }
                if centered {
                    s.push("grad_avg");
                }
                s
            }
            Rule::Adagrad { .. } => vec!["sum"],
        }
    }

    /// The value each state starts at (PyTorch's zeros, or Adagrad's initial sum).
    pub fn initial_state_value(&self) -> f32 {
        match *self {
            Rule::Adagrad {
                initial_accumulator_value,
                ..
            } => initial_accumulator_value as f32,
            _ => 0.0,
        }
    }

    /// PyTorch's checks of the hyperparameters, with its messages' sense.
    pub fn validate(&self) -> Result<()> {
        let bad = |what: &str, v: f64| {
            Err(Error::unsupported(format!(
                "optimizer: {what} = {v} is out of range"
            )))
        };
        let finite_nonneg = |v: f64| v.is_finite() && v >= 0.0;
        match *self {
            Rule::Sgd {
                momentum,
                dampening,
                nesterov,
                weight_decay,
            } => {
                if !finite_nonneg(momentum) {
                    return bad("momentum", momentum);
                }
                if !dampening.is_finite() {
                    return bad("dampening", dampening);
                }
                if !finite_nonneg(weight_decay) {
                    return bad("weight_decay", weight_decay);
                }
                if nesterov && (momentum <= 0.0 || dampening != 0.0) {
                    return Err(Error::unsupported(
                        "optimizer: Nesterov momentum requires a momentum and zero dampening",
                    ));
                }
            }
            Rule::Adam {
                beta1,
                beta2,
                eps,
                weight_decay,
                ..
            } => {
                if !(0.0..1.0).contains(&beta1) {
                    return bad("beta1 (0 <= beta1 < 1)", beta1);
                }
                if !(0.0..1.0).contains(&beta2) {
                    return bad("beta2 (0 <= beta2 < 1)", beta2);
                }
                if !finite_nonneg(eps) {
                    return bad("eps", eps);
                }
                if !finite_nonneg(weight_decay) {
                    return bad("weight_decay", weight_decay);
                }
            }
            Rule::RmsProp {
                alpha,
                eps,
                weight_decay,
                momentum,
                ..
            } => {
                if !finite_nonneg(alpha) {
                    return bad("alpha", alpha);
                }
                if !finite_nonneg(eps) {
                    return bad("eps", eps);
                }
                if !finite_nonneg(weight_decay) {
                    return bad("weight_decay", weight_decay);
                }
                if !finite_nonneg(momentum) {
                    return bad("momentum", momentum);
                }
            }
            Rule::Adagrad {
                lr_decay,
                weight_decay,
                eps,
                initial_accumulator_value,
            } => {
                if !finite_nonneg(lr_decay) {
                    return bad("lr_decay", lr_decay);
                }
                if !finite_nonneg(weight_decay) {
                    return bad("weight_decay", weight_decay);
                }
                if !finite_nonneg(eps) {
                    return bad("eps", eps);
                }
                if !finite_nonneg(initial_accumulator_value) {
                    return bad("initial_accumulator_value", initial_accumulator_value);
                }
            }
        }
        Ok(())
    }
}

/// The learning rate as a function of the step: `lr(k)` for the `k`-th call of the step
/// (from 0), skipped calls included, as PyTorch's schedulers when `scheduler.step()`
/// follows every `optimizer.step()`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Schedule {
    Constant {
        lr: f64,
    },
    /// `torch.optim.lr_scheduler.LinearLR(start_factor, end_factor=1, total_iters=warmup)`:
    /// from `lr·start_factor` up to `lr` over `warmup` steps, then `lr`.
    LinearWarmup {
        lr: f64,
        start_factor: f64,
        warmup: u64,
    },
    /// Linear warm-up from `lr/warmup` to `lr` over `warmup` steps, then a half cosine
    /// from `lr` down to `min_lr` at step `total`, then `min_lr`. With `warmup = 0` this
    /// is `CosineAnnealingLR(T_max=total, eta_min=min_lr)` up to `total`.
    Cosine {
        lr: f64,
        min_lr: f64,
        warmup: u64,
        total: u64,
    },
    /// `StepLR`: `lr·gamma^⌊k/step_size⌋`.
    Step {
        lr: f64,
        step_size: u64,
        gamma: f64,
    },
    /// `OneCycleLR(max_lr, total_steps=total, pct_start, div_factor, final_div_factor,
    /// anneal_strategy='cos', three_phase=False, cycle_momentum=False)`; past `total`
    /// steps it stays at its final value (PyTorch raises).
    OneCycle {
        max_lr: f64,
        total: u64,
        pct_start: f64,
        div_factor: f64,
        final_div_factor: f64,
    },
}

impl Schedule {
    /// The learning rate of call `k` (0-based). The CUDA kernel (`optim.cu`,
    /// `schedule_lr`) computes the same, in the same order of operations.
    pub fn lr(&self, k: f64) -> f64 {
        match *self {
            Schedule::Constant { lr } => lr,
            Schedule::LinearWarmup {
                lr,
                start_factor,
                warmup,
            } => {
                if warmup == 0 || k >= warmup as f64 {
                    return lr;
                }
                lr * (start_factor + (1.0 - start_factor) * k / warmup as f64)
            }
            Schedule::Cosine {
                lr,
                min_lr,
                warmup,
                total,
            } => {
                if k < warmup as f64 {
                    return lr * (k + 1.0) / warmup as f64;
                }
                if k >= total as f64 {
                    return min_lr;
                }
                let ratio = (k - warmup as f64) / (total - warmup) as f64;
                min_lr + (lr - min_lr) * (1.0 + (std::f64::consts::PI * ratio).cos()) / 2.0
            }
            Schedule::Step {
                lr,
                step_size,
                gamma,
            } => lr * gamma.powf((k / step_size as f64).floor()),
            Schedule::OneCycle {
                max_lr,
                total,
                pct_start,
                div_factor,
                final_div_factor,
            } => {
                let initial = max_lr / div_factor;
                let min_lr = initial / final_div_factor;
                let end_up = pct_start * total as f64 - 1.0;
                let end_down = total as f64 - 1.0;
                let anneal = |start: f64, end: f64, pct: f64| {
                    let cos_out = (std::f64::consts::PI * pct).cos() + 1.0;
                    end + (start - end) / 2.0 * cos_out
                };
                if k <= end_up {
                    anneal(initial, max_lr, k / end_up)
                } else if k <= end_down {
                    anneal(max_lr, min_lr, (k - end_up) / (end_down - end_up))
                } else {
                    min_lr
                }
            }
        }
    }

    pub fn validate(&self) -> Result<()> {
        let bad = |msg: String| Err(Error::unsupported(format!("schedule: {msg}")));
        let lr_ok = |lr: f64| lr.is_finite() && lr >= 0.0;
        match *self {
            Schedule::Constant { lr } | Schedule::LinearWarmup { lr, .. } if !lr_ok(lr) => {
                bad(format!("lr {lr} must be finite and >= 0"))
            }
            Schedule::LinearWarmup { start_factor, .. }
                if !(start_factor > 0.0 && start_factor <= 1.0) =>
            {
                bad(format!("start_factor {start_factor} must be in (0, 1]"))
            }
            Schedule::Cosine {
                lr,
                min_lr,
                warmup,
                total,
            } if !lr_ok(lr) || !lr_ok(min_lr) || total <= warmup => bad(format!(
                "cosine needs finite lr {lr} and min_lr {min_lr} >= 0 and total {total} > warmup {warmup}"
            )),
            Schedule::Step {
                lr,
                step_size,
                gamma,
            } if !lr_ok(lr) || step_size == 0 || !gamma.is_finite() => bad(format!(
                "step schedule needs finite lr {lr} >= 0, step_size {step_size} > 0 and a finite gamma {gamma}"
            )),
            Schedule::OneCycle {
                max_lr,
                total,
                pct_start,
                div_factor,
                final_div_factor,
            } if !lr_ok(max_lr)
                || total < 2
                || !(pct_start > 0.0 && pct_start < 1.0)
                || pct_start * total as f64 - 1.0 <= 0.0
                || !(div_factor > 0.0 && final_div_factor > 0.0) =>
            {
                bad(format!(
                    "one-cycle needs finite max_lr {max_lr} >= 0, total {total} >= 2, pct_start {pct_start} \
                     in (0, 1) with pct_start·total > 1, and positive div factors ({div_factor}, {final_div_factor})"
                ))
            }
            _ => Ok(()),
        }
    }
}

/// Dynamic loss scaling, as `torch.amp.GradScaler`: gradients arrive multiplied by the
/// scale; the step unscales them, and an inf/NaN among them skips the step and multiplies
/// the scale by `backoff_factor`; after `growth_interval` steps in a row without one, the
/// scale is multiplied by `growth_factor`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossScaling {
    pub init_scale: f32,
    pub growth_factor: f32,
    pub backoff_factor: f32,
    pub growth_interval: u32,
}

impl Default for LossScaling {
    /// GradScaler's defaults.
    fn default() -> Self {
        LossScaling {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
        }
    }
}

/// Everything a step does besides the buffers it runs over.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepConfig {
    pub rule: Rule,
    pub schedule: Schedule,
    /// Clip the gradients to this global L2 norm first (`clip_grad_norm_`).
    pub max_grad_norm: Option<f32>,
    pub loss_scaling: Option<LossScaling>,
}

impl StepConfig {
    pub fn validate(&self) -> Result<()> {
        self.rule.validate()?;
        self.schedule.validate()?;
        if let Some(m) = self.max_grad_norm {
            if !(m.is_finite() && m > 0.0) {
                return Err(Error::unsupported(format!(
                    "max_grad_norm {m} must be finite and > 0"
                )));
            }
        }
        if let Some(s) = self.loss_scaling {
            let valid = s.init_scale.is_finite()
                && s.init_scale > 0.0
                && s.growth_factor.is_finite()
                && s.growth_factor > 1.0
                && s.backoff_factor > 0.0
                && s.backoff_factor < 1.0
                && s.growth_interval > 0;
            if !valid {
                return Err(Error::unsupported(format!(
                    "loss scaling {s:?}: the scale must be positive, growth_factor > 1, \
                     0 < backoff_factor < 1 and growth_interval > 0"
                )));
            }
        }
        Ok(())
    }

    /// Whether the step first reads the gradients once for their norm and inf/NaN.
    pub fn needs_grad_stats(&self) -> bool {
        self.max_grad_norm.is_some() || self.loss_scaling.is_some()
    }
}

/// What the gradient pass found (see the module's step 1).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct GradStats {
    /// Σ (g · inv_scale)², each square an f32 (one that overflows is inf, as in
    /// PyTorch's norm of huge gradients), summed in f64.
    pub sum_squares: f64,
    /// Some element was inf or NaN.
    pub non_finite: bool,
}

/// The state a step reads and updates on the device, kept in a small F32 tensor of
/// [`StepControl::WORDS`] words (see [`StepControl::new_tensor`]). The CUDA kernels read
/// it through a C struct of the same layout (`optim.cu`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct StepControl {
    /// Calls of the step so far, skipped ones included: the schedule's clock.
    pub calls: f64,
    /// Updates applied (Adam's `t`).
    pub steps: f64,
    /// The learning rate of the last update.
    pub lr: f64,
    /// The current loss scale (1 without loss scaling).
    pub loss_scale: f32,
    /// Updates in a row without inf/NaN since the scale last changed.
    pub growth_tracker: i32,
    /// The global L2 norm of the last call's unscaled gradients (0 when not computed).
    pub grad_norm: f32,
    /// The factor the last call multiplied the gradients by (1 when not clipping).
    pub clip_coef: f32,
    /// The factor the last call unscaled the gradients by (`1/loss_scale` then).
    pub inv_scale: f32,
    /// 1 when the last call found an inf/NaN under loss scaling and skipped the update.
    pub skipped: i32,
    /// The update's factors for this call, per rule (see [`StepControl::prepare`]).
    pub factors: [f32; 8],
}

impl StepControl {
    /// F32 words a control tensor holds.
    pub const WORDS: usize = std::mem::size_of::<StepControl>() / 4;

    pub fn new(config: &StepConfig) -> StepControl {
        let scale = config.loss_scaling.map_or(1.0, |s| s.init_scale);
        StepControl {
            calls: 0.0,
            steps: 0.0,
            lr: 0.0,
            loss_scale: scale,
            growth_tracker: 0,
            grad_norm: 0.0,
            clip_coef: 1.0,
            inv_scale: 1.0,
            skipped: 0,
            factors: [0.0; 8],
        }
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        bytemuck::bytes_of(self).to_vec()
    }

    pub fn from_bytes(bytes: &[u8]) -> Result<StepControl> {
        if bytes.len() != std::mem::size_of::<StepControl>() {
            return Err(Error::format(format!(
                "an optimizer control block is {} bytes, not {}",
                std::mem::size_of::<StepControl>(),
                bytes.len()
            )));
        }
        Ok(bytemuck::pod_read_unaligned(bytes))
    }

    /// The factor that unscales gradients: GradScaler's `scale.double().reciprocal().float()`.
    pub fn unscale_factor(&self) -> f32 {
        (1.0 / self.loss_scale as f64) as f32
    }

    /// Step 2 of a call (see the module): from the gradient pass's `stats` (when
    /// [`StepConfig::needs_grad_stats`]) decide whether to update, and set this call's
    /// factors. The CUDA kernel `optim_prepare` does the same, in the same order.
    ///
    /// Factors by rule (each rounded to f32 from f64, as PyTorch passes Python floats):
    /// - SGD: `[weight_decay, momentum, 1 - dampening, -lr, first]`, `first` = 1 on the
    ///   first update (the momentum buffer is then the gradient itself);
    /// - Adam: `[1 - beta1, beta2, 1 - beta2, sqrt(1 - beta2^t), eps, -lr/(1 - beta1^t),
    ///   decay]` with `decay` = `1 - lr·weight_decay` (AdamW) or `weight_decay` (Adam);
    /// - RMSprop: `[weight_decay, alpha, 1 - alpha, eps, momentum, -lr]`;
    /// - Adagrad: `[weight_decay, eps, -lr/(1 + (t-1)·lr_decay)]`.
    pub fn prepare(&mut self, config: &StepConfig, stats: GradStats) {
        self.inv_scale = match config.loss_scaling {
            Some(_) => self.unscale_factor(),
            None => 1.0,
        };
        self.grad_norm = if config.needs_grad_stats() {
            stats.sum_squares.sqrt() as f32
        } else {
            0.0
        };
        self.clip_coef = match config.max_grad_norm {
            // clip_grad_norm_: max_norm / (total_norm + 1e-6), which PyTorch evaluates as
            // reciprocal(total_norm + 1e-6) · max_norm, clamped to at most 1 (NaN stays).
            Some(max_norm) => {
                let coef = (1.0f32 / (self.grad_norm + 1e-6f32)) * max_norm;
                if coef > 1.0 {
                    1.0
                } else {
                    coef
                }
            }
            None => 1.0,
        };
        let found_inf = config.loss_scaling.is_some() && stats.non_finite;
        let k = self.calls;
        self.calls += 1.0;
        if let Some(s) = config.loss_scaling {
            // torch._amp_update_scale_.
            if found_inf {
                self.loss_scale *= s.backoff_factor;
                self.growth_tracker = 0;
            } else {
                let successful = self.growth_tracker + 1;
                if successful as u32 == s.growth_interval {
                    let grown = self.loss_scale * s.growth_factor;
                    if grown.is_finite() {
                        self.loss_scale = grown;
                    }
                    self.growth_tracker = 0;
                } else {
                    self.growth_tracker = successful;
                }
            }
        }
        self.skipped = found_inf as i32;
        if found_inf {
            return;
        }
        self.steps += 1.0;
        let t = self.steps;
        let lr = config.schedule.lr(k);
        self.lr = lr;
        let f = |v: f64| v as f32;
        self.factors = match config.rule {
            Rule::Sgd {
                momentum,
                dampening,
                weight_decay,
                ..
            } => [
                f(weight_decay),
                f(momentum),
                f(1.0 - dampening),
                f(-lr),
                if t == 1.0 { 1.0 } else { 0.0 },
                0.0,
                0.0,
                0.0,
            ],
            Rule::Adam {
                beta1,
                beta2,
                eps,
                weight_decay,
                decoupled_weight_decay,
                ..
            } => {
                let step_size = lr / (1.0 - beta1.powf(t));
                let decay = if decoupled_weight_decay {
                    1.0 - lr * weight_decay
                } else {
                    weight_decay
                };
                [
                    f(1.0 - beta1),
                    f(beta2),
                    f(1.0 - beta2),
                    f((1.0 - beta2.powf(t)).sqrt()),
                    f(eps),
                    f(-step_size),
                    f(decay),
                    0.0,
                ]
            }
            Rule::RmsProp {
                alpha,
                eps,
                weight_decay,
                momentum,
                ..
            } => [
                f(weight_decay),
                f(alpha),
                f(1.0 - alpha),
                f(eps),
                f(momentum),
                f(-lr),
                0.0,
                0.0,
            ],
            Rule::Adagrad {
                lr_decay,
                weight_decay,
                eps,
                ..
            } => {
                let clr = lr / (1.0 + (t - 1.0) * lr_decay);
                [f(weight_decay), f(eps), f(-clr), 0.0, 0.0, 0.0, 0.0, 0.0]
            }
        };
    }
}

/// The buffers of one step. All are F32 `[n]` except `compute_copy`, BF16 or F16 `[n]`:
/// the weights the forward pass reads, rewritten from the updated `params` (the FP32
/// master weights) by the same pass.
pub struct StepBuffers<'a> {
    pub params: &'a mut Tensor,
    /// Read only: the step unscales and clips its own copy of each value, as it goes.
    pub grads: &'a Tensor,
    /// One per name of [`Rule::states`], in that order.
    pub states: &'a mut [Tensor],
    pub compute_copy: Option<&'a mut Tensor>,
    /// [`StepControl::WORDS`] F32 words.
    pub control: &'a mut Tensor,
}

impl StepBuffers<'_> {
    /// Elements per buffer, after checking that every buffer fits `config`: the same
    /// length, the right dtypes, as many states as the rule has.
    pub fn check(&self, config: &StepConfig) -> Result<usize> {
        let n = self.params.shape().numel();
        let f32_of_n = |t: &Tensor, what: &str| -> Result<()> {
            if t.dtype() != DType::F32 {
                return Err(Error::unsupported(format!(
                    "optimizer step: {what} must be F32, not {}",
                    t.dtype()
                )));
            }
            if t.shape().numel() != n {
                return Err(Error::shape(format!(
                    "optimizer step: {what} has {} elements, the parameters {n}",
                    t.shape().numel()
                )));
            }
            Ok(())
        };
        f32_of_n(self.params, "the parameters")?;
        f32_of_n(self.grads, "the gradients")?;
        let names = config.rule.states();
        if self.states.len() != names.len() {
            return Err(Error::shape(format!(
                "optimizer step: {:?} keeps {} state buffers ({}), {} given",
                config.rule,
                names.len(),
                names.join(", "),
                self.states.len()
            )));
        }
        for (t, name) in self.states.iter().zip(&names) {
            f32_of_n(t, &format!("state {name}"))?;
        }
        if let Some(c) = &self.compute_copy {
            if !matches!(c.dtype(), DType::BF16 | DType::F16) {
                return Err(Error::unsupported(format!(
                    "optimizer step: the compute copy of the weights is BF16 or F16, not {}",
                    c.dtype()
                )));
            }
            if c.shape().numel() != n {
                return Err(Error::shape(format!(
                    "optimizer step: the compute copy has {} elements, the parameters {n}",
                    c.shape().numel()
                )));
            }
        }
        if self.control.dtype() != DType::F32 || self.control.shape().numel() != StepControl::WORDS
        {
            return Err(Error::shape(format!(
                "optimizer step: the control block is F32 [{}], not {} {}",
                StepControl::WORDS,
                self.control.dtype(),
                self.control.shape()
            )));
        }
        Ok(n)
    }
}

/// A backend's optimizer kernels, reached through [`crate::Backend::optim`].
pub trait OptimKernels: Send + Sync {
    /// One optimizer step over `bufs` (see the module for its parts). Queued on the
    /// device like any op: nothing is read back, so it can be recorded and replayed.
    fn step(&self, config: &StepConfig, bufs: StepBuffers<'_>) -> Result<()>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_layout_has_no_padding_and_whole_words() {
        assert_eq!(std::mem::size_of::<StepControl>(), 80);
        assert_eq!(StepControl::WORDS, 20);
    }

    #[test]
    fn loss_scale_backs_off_on_inf_and_grows_after_the_interval() {
        let config = StepConfig {
            rule: Rule::adamw(0.0),
            schedule: Schedule::Constant { lr: 1e-3 },
            max_grad_norm: None,
            loss_scaling: Some(LossScaling {
                growth_interval: 2,
                ..LossScaling::default()
            }),
        };
        let mut c = StepControl::new(&config);
        let inf = GradStats {
            sum_squares: f64::INFINITY,
            non_finite: true,
        };
        c.prepare(&config, inf);
        assert_eq!((c.skipped, c.steps, c.loss_scale), (1, 0.0, 32768.0));
        c.prepare(&config, GradStats::default());
        assert_eq!((c.skipped, c.steps, c.loss_scale), (0, 1.0, 32768.0));
        c.prepare(&config, GradStats::default());
        assert_eq!((c.steps, c.loss_scale, c.growth_tracker), (2.0, 65536.0, 0));
        assert_eq!(c.calls, 3.0);
    }

    #[test]
    fn schedules_start_and_end_where_pytorch_does() {
        let one_cycle = Schedule::OneCycle {
            max_lr: 0.1,
            total: 100,
            pct_start: 0.3,
            div_factor: 25.0,
            final_div_factor: 1e4,
        };
        assert!((one_cycle.lr(0.0) - 0.004).abs() < 1e-15);
        assert!((one_cycle.lr(29.0) - 0.1).abs() < 1e-15);
        assert!((one_cycle.lr(99.0) - 0.004 / 1e4).abs() < 1e-18);
        let cosine = Schedule::Cosine {
            lr: 1.0,
            min_lr: 0.1,
            warmup: 10,
            total: 110,
        };
        assert_eq!(cosine.lr(0.0), 0.1);
        assert_eq!(cosine.lr(9.0), 1.0);
        assert_eq!(cosine.lr(10.0), 1.0);
        assert!((cosine.lr(60.0) - 0.55).abs() < 1e-15);
        assert_eq!(cosine.lr(500.0), 0.1);
        let step = Schedule::Step {
            lr: 1.0,
            step_size: 3,
            gamma: 0.5,
        };
        assert_eq!([step.lr(2.0), step.lr(3.0), step.lr(6.0)], [1.0, 0.5, 0.25]);
    }
}
