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

mod control;
mod rule;
mod schedule;

pub use control::StepControl;
pub use rule::Rule;
pub use schedule::Schedule;

use crate::{DType, Error, Result, Tensor};

/// Dynamic loss scaling, as `torch.amp.GradScaler`: gradients arrive multiplied by the
/// scale; the step unscales them, and an inf/NaN among them skips the step and multiplies
/// the scale by `backoff_factor`; after `growth_interval` steps in a row without one, the
/// scale is multiplied by `growth_factor`.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
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
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
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
