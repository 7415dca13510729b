//! Learning-rate schedules, as PyTorch's schedulers.

use crate::{Error, Result};

/// The learning rate as a function of the step: `lr(k)` for the `k`-th call of the step
/// (from 0), skipped calls included, as PyTorch's schedulers when `scheduler.step()`
/// follows every `optimizer.step()`.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
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
