//! The step's state on the device and the one-thread preparation of each step's factors.

use super::{GradStats, Rule, StepConfig};
use crate::{Error, Result};

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
