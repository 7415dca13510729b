//! The optimizer: AdamW over flat host buffers (every parameter in one `Vec<f32>`, every
//! gradient and each moment in another of the same layout), global-norm clipping and the
//! learning-rate schedule. One module, so that kiln-optim's fused device kernels can
//! take its place: they work on the same flat layout.

use serde::{Deserialize, Serialize};

/// How the learning rate moves over the run, after a linear warm-up.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Schedule {
    Constant,
    /// Half a cosine from the peak down to `min_lr` at the last step.
    Cosine,
    /// A straight line from the peak down to `min_lr` at the last step.
    Linear,
}

impl Schedule {
    pub fn from_name(name: &str) -> Option<Schedule> {
        match name {
            "constant" => Some(Schedule::Constant),
            "cosine" => Some(Schedule::Cosine),
            "linear" => Some(Schedule::Linear),
            _ => None,
        }
    }
}

/// The learning rate at `step` (from 0) of `steps`: `lr · (step + 1) / warmup` during the
/// warm-up, then the schedule from `lr` down to `min_lr`.
pub fn learning_rate(
    schedule: Schedule,
    lr: f32,
    min_lr: f32,
    warmup: usize,
    step: usize,
    steps: usize,
) -> f32 {
    if step < warmup {
        return lr * (step + 1) as f32 / warmup as f32;
    }
    let span = steps.saturating_sub(warmup).max(1);
    let done = ((step - warmup) as f64 / span as f64).min(1.0);
    let fraction = match schedule {
        Schedule::Constant => return lr,
        Schedule::Cosine => 0.5 * (1.0 + (std::f64::consts::PI * done).cos()),
        Schedule::Linear => 1.0 - done,
    };
    (min_lr as f64 + (lr - min_lr) as f64 * fraction) as f32
}

/// Scale `grads` so that their global L2 norm is at most `max_norm`; returns the norm
/// before clipping.
pub fn clip_global_norm(grads: &mut [f32], max_norm: Option<f32>) -> f64 {
    let norm = grads
        .iter()
        .map(|&g| (g as f64) * (g as f64))
        .sum::<f64>()
        .sqrt();
    if let Some(max) = max_norm {
        if norm > max as f64 && norm.is_finite() {
            let s = (max as f64 / norm) as f32;
            grads.iter_mut().for_each(|g| *g *= s);
        }
    }
    norm
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct AdamWSettings {
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
}

/// AdamW (decoupled weight decay, bias-corrected moments), as PyTorch's single-tensor
/// path computes it, on flat f32 buffers.
pub struct AdamW {
    pub settings: AdamWSettings,
    /// First and second moments, laid out as the parameters.
    pub m: Vec<f32>,
    pub v: Vec<f32>,
    /// Updates taken (the bias correction's `t`).
    pub t: u64,
}

impl AdamW {
    pub fn new(settings: AdamWSettings, len: usize) -> AdamW {
        AdamW {
            settings,
            m: vec![0.0; len],
            v: vec![0.0; len],
            t: 0,
        }
    }

    /// One update of `params` from `grads` at learning rate `lr`; weight decay applies
    /// where `decay` (a range of the flat layout per decayed tensor) says.
    pub fn step(
        &mut self,
        params: &mut [f32],
        grads: &[f32],
        lr: f32,
        decay: &[std::ops::Range<usize>],
    ) {
        let s = self.settings;
        self.t += 1;
        let bc1 = 1.0 - (s.beta1 as f64).powi(self.t as i32);
        let bc2 = 1.0 - (s.beta2 as f64).powi(self.t as i32);
        let step_size = (lr as f64 / bc1) as f32;
        let bc2_sqrt = bc2.sqrt() as f32;
        for r in decay {
            let keep = 1.0 - lr * s.weight_decay;
            params[r.clone()].iter_mut().for_each(|p| *p *= keep);
        }
        for (((p, &g), m), v) in params
            .iter_mut()
            .zip(grads)
            .zip(self.m.iter_mut())
            .zip(self.v.iter_mut())
        {
            *m = s.beta1 * *m + (1.0 - s.beta1) * g;
            *v = s.beta2 * *v + (1.0 - s.beta2) * g * g;
            let denom = v.sqrt() / bc2_sqrt + s.eps;
            *p -= step_size * *m / denom;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_cosine_to_the_floor() {
        let lr = |s| learning_rate(Schedule::Cosine, 1.0, 0.1, 10, s, 110);
        assert_eq!(lr(0), 0.1);
        assert_eq!(lr(9), 1.0);
        assert!((lr(10) - 1.0).abs() < 1e-6);
        assert!((lr(60) - 0.55).abs() < 1e-6);
        assert!((lr(110) - 0.1).abs() < 1e-6);
        assert!((learning_rate(Schedule::Linear, 1.0, 0.0, 0, 25, 100) - 0.75).abs() < 1e-6);
        assert_eq!(learning_rate(Schedule::Constant, 0.5, 0.0, 0, 99, 100), 0.5);
    }

    #[test]
    fn clipping_scales_to_the_norm() {
        let mut g = vec![3.0, 4.0];
        assert_eq!(clip_global_norm(&mut g, Some(1.0)), 5.0);
        assert!((g[0] - 0.6).abs() < 1e-6 && (g[1] - 0.8).abs() < 1e-6);
        let mut g = vec![0.3, 0.4];
        clip_global_norm(&mut g, Some(1.0));
        assert_eq!(g, vec![0.3, 0.4]);
    }

    /// Two steps worked by hand from PyTorch's AdamW formula.
    #[test]
    fn adamw_steps_follow_the_formula() {
        let s = AdamWSettings {
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
            weight_decay: 0.1,
        };
        let mut opt = AdamW::new(s, 2);
        let mut p = vec![1.0f32, -2.0];
        let decay_first = [std::ops::Range { start: 0, end: 1 }];
        opt.step(&mut p, &[0.5, -1.0], 0.01, &decay_first);
        // Step 1: m̂ = g, v̂ = g², update lr·sign(g) (to eps); p[0] decayed first.
        assert!(
            (p[0] - (1.0 * (1.0 - 0.001) - 0.01)).abs() < 1e-6,
            "{}",
            p[0]
        );
        assert!((p[1] - (-2.0 + 0.01)).abs() < 1e-6, "{}", p[1]);
        opt.step(&mut p, &[0.5, 1.0], 0.01, &[]);
        // Step 2, p[1]: m = 0.9·-0.1 + 0.1 = 0.01 → m̂ = 0.01/0.19; v = 0.99·0.01 + 0.01·1 →
        // v̂ = 0.0199/0.0199 = 1.
        let m_hat = 0.01f64 / 0.19;
        let v_hat = (0.99 * 0.01 + 0.01) / (1.0 - 0.99f64 * 0.99);
        let want = -2.0 + 0.01 - 0.01 * m_hat / (v_hat.sqrt() + 1e-8);
        assert!((p[1] as f64 - want).abs() < 1e-6, "{} vs {want}", p[1]);
    }
}
