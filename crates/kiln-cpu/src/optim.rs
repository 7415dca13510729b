//! The optimizer step ([`kiln_core::optim`]) on the CPU: a pass over the gradients for
//! their norm and inf/NaN when asked, [`StepControl::prepare`], then the update, each a
//! loop over chunks of the flat buffers spread over the pool.
//!
//! Each update is PyTorch's single-tensor path written out per element, with PyTorch's
//! roundings: its CPU kernels fuse `a + s·b` (`add` with `alpha`, `lerp`, `addcmul`) into
//! one fused multiply-add, and compute `addcdiv` as `a + (s·b)/c`. Rust never contracts
//! `a * b + c` by itself, so every fused step here is an explicit `mul_add`.

use crate::pool::{Pool, SharedMut};
use crate::{f32s, storage_mut, CpuBackend};
use kiln_core::optim::{GradStats, Rule, StepBuffers, StepConfig, StepControl};
use kiln_core::{DType, OptimKernels, Result, Tensor};

/// Elements per task: large enough that a task's overhead is small, small enough that
/// two threads share a small model's buffers evenly.
const CHUNK: usize = 1 << 14;

impl OptimKernels for CpuBackend {
    fn step(&self, config: &StepConfig, bufs: StepBuffers<'_>) -> Result<()> {
        config.validate()?;
        let n = bufs.check(config)?;
        let mut control = read_control(bufs.control)?;
        let stats = if config.needs_grad_stats() {
            grad_stats(
                &self.pool,
                f32s(bufs.grads)?,
                control.unscale_factor(),
                config,
            )
        } else {
            GradStats::default()
        };
        control.prepare(config, stats);
        storage_mut(bufs.control)?
            .bytes_mut()?
            .copy_from_slice(&control.to_bytes());
        if control.skipped != 0 || n == 0 {
            return Ok(());
        }
        let grad = GradPrep {
            unscale: config.loss_scaling.map(|_| control.inv_scale),
            clip: config.max_grad_norm.map(|_| control.clip_coef),
        };
        let rule = RuleKernel::new(config.rule, control.factors);
        let params = SharedMut::new(crate::f32s_mut(bufs.params)?);
        let grads = f32s(bufs.grads)?;
        let mut states: Vec<SharedMut<f32>> = Vec::with_capacity(bufs.states.len());
        for s in bufs.states.iter_mut() {
            states.push(SharedMut::new(crate::f32s_mut(s)?));
        }
        let copy = match bufs.compute_copy {
            Some(t) => {
                let dtype = t.dtype();
                let halves: &mut [u16] = bytemuck::cast_slice_mut(storage_mut(t)?.bytes_mut()?);
                Some((dtype, SharedMut::new(halves)))
            }
            None => None,
        };
        self.pool.for_each_init(
            n.div_ceil(CHUNK),
            || (),
            |(), i| {
                let start = i * CHUNK;
                let len = CHUNK.min(n - start);
                // SAFETY: each chunk index is claimed once, so the ranges are disjoint, and
                // every buffer was checked to hold `n` elements and is borrowed mutably for
                // the whole loop.
                let chunk = unsafe {
                    let slice =
                        |s: SharedMut<f32>| std::slice::from_raw_parts_mut(s.at(start), len);
                    Chunk {
                        p: slice(params),
                        g: &grads[start..start + len],
                        s: [0, 1, 2].map(|k| states.get(k).map_or(&mut [][..], |&s| slice(s))),
                    }
                };
                update(&rule, grad, chunk);
                if let Some((dtype, halves)) = copy {
                    // SAFETY: as above; the copy holds `n` halves.
                    let out = unsafe { std::slice::from_raw_parts_mut(halves.at(start), len) };
                    // SAFETY: same range of the parameters, which this task just wrote.
                    let p = unsafe { std::slice::from_raw_parts(params.at(start), len) };
                    write_copy(dtype, p, out);
                }
            },
        );
        Ok(())
    }
}

fn read_control(t: &mut Tensor) -> Result<StepControl> {
    StepControl::from_bytes(storage_mut(t)?.bytes_mut()?)
}

/// Σ (g·inv_scale)² and whether any g is inf/NaN, in chunks summed in order: the same
/// result whatever the number of threads.
fn grad_stats(pool: &Pool, grads: &[f32], inv_scale: f32, config: &StepConfig) -> GradStats {
    let scaled = config.loss_scaling.is_some();
    let mut partials = vec![GradStats::default(); grads.len().div_ceil(CHUNK)];
    pool.for_chunks_mut(&mut partials, 1, |i, out| {
        let chunk = &grads[i * CHUNK..grads.len().min((i + 1) * CHUNK)];
        let mut s = GradStats::default();
        for &g in chunk {
            s.non_finite |= !g.is_finite();
            let g = if scaled { g * inv_scale } else { g };
            s.sum_squares += (g * g) as f64;
        }
        out[0] = s;
    });
    partials
        .iter()
        .fold(GradStats::default(), |a, b| GradStats {
            sum_squares: a.sum_squares + b.sum_squares,
            non_finite: a.non_finite | b.non_finite,
        })
}

/// What happens to each gradient before the update: GradScaler's unscale, then
/// `clip_grad_norm_`'s multiply, each a rounded product as in PyTorch.
#[derive(Clone, Copy)]
struct GradPrep {
    unscale: Option<f32>,
    clip: Option<f32>,
}

impl GradPrep {
    #[inline(always)]
    fn apply(self, mut g: f32) -> f32 {
        if let Some(s) = self.unscale {
            g *= s;
        }
        if let Some(c) = self.clip {
            g *= c;
        }
        g
    }
}

/// A rule with this step's factors (see [`StepControl::prepare`] for their order).
enum RuleKernel {
    Sgd {
        weight_decay: Option<f32>,
        momentum: Option<f32>,
        keep: f32,
        neg_lr: f32,
        first: bool,
        nesterov: bool,
    },
    Adam {
        w1: f32,
        beta2: f32,
        w2: f32,
        bc2_sqrt: f32,
        eps: f32,
        neg_step_size: f32,
        /// `Some((factor, decoupled))`.
        decay: Option<(f32, bool)>,
        amsgrad: bool,
    },
    RmsProp {
        weight_decay: Option<f32>,
        alpha: f32,
        w: f32,
        eps: f32,
        momentum: Option<f32>,
        neg_lr: f32,
        centered: bool,
    },
    Adagrad {
        weight_decay: Option<f32>,
        eps: f32,
        neg_clr: f32,
    },
}

impl RuleKernel {
    fn new(rule: Rule, f: [f32; 8]) -> RuleKernel {
        // PyTorch tests its Python floats against zero, not the rounded factors.
        let when = |on: bool, v: f32| on.then_some(v);
        match rule {
            Rule::Sgd {
                momentum,
                nesterov,
                weight_decay,
                ..
            } => RuleKernel::Sgd {
                weight_decay: when(weight_decay != 0.0, f[0]),
                momentum: when(momentum != 0.0, f[1]),
                keep: f[2],
                neg_lr: f[3],
                first: f[4] != 0.0,
                nesterov,
            },
            Rule::Adam {
                weight_decay,
                decoupled_weight_decay,
                amsgrad,
                ..
            } => RuleKernel::Adam {
                w1: f[0],
                beta2: f[1],
                w2: f[2],
                bc2_sqrt: f[3],
                eps: f[4],
                neg_step_size: f[5],
                decay: when(weight_decay != 0.0, f[6]).map(|d| (d, decoupled_weight_decay)),
                amsgrad,
            },
            Rule::RmsProp {
                weight_decay,
                momentum,
                centered,
                ..
            } => RuleKernel::RmsProp {
                weight_decay: when(weight_decay != 0.0, f[0]),
                alpha: f[1],
                w: f[2],
                eps: f[3],
                momentum: when(momentum > 0.0, f[4]),
                neg_lr: f[5],
                centered,
            },
            Rule::Adagrad { weight_decay, .. } => RuleKernel::Adagrad {
                weight_decay: when(weight_decay != 0.0, f[0]),
                eps: f[1],
                neg_clr: f[2],
            },
        }
    }
}

/// One task's part of the buffers; unused states are empty.
struct Chunk<'a> {
    p: &'a mut [f32],
    g: &'a [f32],
    s: [&'a mut [f32]; 3],
}

/// `torch.lerp(start, end, w)` as PyTorch's CPU kernel computes it.
#[inline(always)]
fn lerp(start: f32, end: f32, w: f32) -> f32 {
    if w.abs() < 0.5 {
        w.mul_add(end - start, start)
    } else {
        (w - 1.0).mul_add(end - start, end)
    }
}

/// `torch.maximum`: NaN if either is NaN.
#[inline(always)]
fn maximum(a: f32, b: f32) -> f32 {
    if a.is_nan() || b.is_nan() {
        f32::NAN
    } else {
        a.max(b)
    }
}

fn update(rule: &RuleKernel, prep: GradPrep, c: Chunk) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: AVX2 and FMA are present.
        return unsafe { x86::update(rule, prep, c) };
    }
    update_body(rule, prep, c)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    /// [`super::update_body`] with fused multiply-adds as instructions (elsewhere
    /// `mul_add` is a library call: correct, slower).
    ///
    /// # Safety
    /// AVX2 and FMA must be available.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn update(rule: &super::RuleKernel, prep: super::GradPrep, c: super::Chunk) {
        super::update_body(rule, prep, c)
    }
}

#[inline(always)]
fn update_body(rule: &RuleKernel, prep: GradPrep, c: Chunk) {
    let Chunk {
        p,
        g,
        s: [s0, s1, s2],
    } = c;
    match *rule {
        RuleKernel::Sgd {
            weight_decay,
            momentum,
            keep,
            neg_lr,
            first,
            nesterov,
        } => {
            for (i, (p, &g)) in p.iter_mut().zip(g).enumerate() {
                let mut g = prep.apply(g);
                if let Some(wd) = weight_decay {
                    g = p.mul_add(wd, g);
                }
                if let Some(m) = momentum {
                    let buf = &mut s0[i];
                    *buf = if first { g } else { g.mul_add(keep, *buf * m) };
                    g = if nesterov { buf.mul_add(m, g) } else { *buf };
                }
                *p = g.mul_add(neg_lr, *p);
            }
        }
        RuleKernel::Adam {
            w1,
            beta2,
            w2,
            bc2_sqrt,
            eps,
            neg_step_size,
            decay,
            amsgrad,
        } => {
            for (i, (p, &g)) in p.iter_mut().zip(g).enumerate() {
                let mut g = prep.apply(g);
                match decay {
                    Some((d, true)) => *p *= d,
                    Some((wd, false)) => g = p.mul_add(wd, g),
                    None => {}
                }
                let m = lerp(s0[i], g, w1);
                s0[i] = m;
                let mut v = (w2 * g).mul_add(g, s1[i] * beta2);
                s1[i] = v;
                if amsgrad {
                    v = maximum(s2[i], v);
                    s2[i] = v;
                }
                let denom = v.sqrt() / bc2_sqrt + eps;
                *p += (neg_step_size * m) / denom;
            }
        }
        RuleKernel::RmsProp {
            weight_decay,
            alpha,
            w,
            eps,
            momentum,
            neg_lr,
            centered,
        } => {
            // States: square_avg, then momentum_buffer if any, then grad_avg if centered.
            let (bufs, grad_avgs) = match momentum {
                Some(_) => (s1, s2),
                None => (s2, s1),
            };
            for (i, (p, &g)) in p.iter_mut().zip(g).enumerate() {
                let mut g = prep.apply(g);
                if let Some(wd) = weight_decay {
                    g = p.mul_add(wd, g);
                }
                let sq = (w * g).mul_add(g, s0[i] * alpha);
                s0[i] = sq;
                let avg = if centered {
                    let ga = lerp(grad_avgs[i], g, w);
                    grad_avgs[i] = ga;
                    (-ga).mul_add(ga, sq).sqrt()
                } else {
                    sq.sqrt()
                } + eps;
                match momentum {
                    Some(m) => {
                        let buf = bufs[i] * m + g / avg;
                        bufs[i] = buf;
                        *p = buf.mul_add(neg_lr, *p);
                    }
                    None => *p += (neg_lr * g) / avg,
                }
            }
        }
        RuleKernel::Adagrad {
            weight_decay,
            eps,
            neg_clr,
        } => {
            for (i, (p, &g)) in p.iter_mut().zip(g).enumerate() {
                let mut g = prep.apply(g);
                if let Some(wd) = weight_decay {
                    g = p.mul_add(wd, g);
                }
                let sum = g.mul_add(g, s0[i]);
                s0[i] = sum;
                *p += (neg_clr * g) / (sum.sqrt() + eps);
            }
        }
    }
}

/// The compute copy of updated master weights, rounded to nearest even.
fn write_copy(dtype: DType, p: &[f32], out: &mut [u16]) {
    if dtype == DType::BF16 {
        for (o, &v) in out.iter_mut().zip(p) {
            *o = half::bf16::from_f32(v).to_bits();
        }
    } else {
        for (o, &v) in out.iter_mut().zip(p) {
            *o = half::f16::from_f32(v).to_bits();
        }
    }
}
