//! Update rules: PyTorch's formulas, operation by operation.

use crate::{Error, Result};

/// An update rule and its hyperparameters, with PyTorch's names (`torch.optim`).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
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
