//! The optimizer step ([`kiln_core::optim`]) on wgpu: the gradients' statistics when asked
//! (shaders/optim_stats.wgsl), [`StepControl::prepare`], then the update of every element
//! in one dispatch (shaders/optim.wgsl).
//!
//! WGSL has no f64, and the control block's clock, learning rate and bias corrections are
//! f64 (so that every backend rounds PyTorch's Python floats the same way): here the host
//! prepares each step, from the control block as the last step left it (kept on the host;
//! read back only when the tensor was written since, a restored state say). With clipping
//! or loss scaling it reads back the workgroups' partial sums of the gradients' squares,
//! summed in f64 in order: one small read a step, where the CPU and CUDA read nothing
//! back. The element-wise formulas
//! are the CPU's; a GPU's division and square root may differ from IEEE's by an ulp or two,
//! so results follow the CPU's closely rather than to the bit.

use crate::elementwise::count;
use crate::kernels::{GRAD_STATS, OPTIM_UPDATE};
use crate::{f32_tensor, memory, storage, WgpuBackend};
use kiln_core::optim::{GradStats, Rule, StepBuffers, StepConfig, StepControl};
use kiln_core::{DType, OptimKernels, Result};

/// Gradients a workgroup of `grad_stats` sums (its `STATS_CHUNK`).
const STATS_CHUNK: usize = 4096;
/// Elements a workgroup of `optim_update` takes: two a lane.
const UPDATE_CHUNK: usize = 512;

// The update's flags (shaders/optim.wgsl).
const FLAG_UNSCALE: u32 = 1;
const FLAG_CLIP: u32 = 2;
const FLAG_A: u32 = 4;
const FLAG_B: u32 = 8;
const FLAG_C: u32 = 16;
const FLAG_D: u32 = 32;

impl OptimKernels for WgpuBackend {
    fn step(&self, config: &StepConfig, bufs: StepBuffers<'_>) -> Result<()> {
        config.validate()?;
        let n = bufs.check(config)?;
        let what = "optimizer step";
        count(n, what)?;
        let control_store = storage(bufs.control, "the control block")?;
        let kept = *self.optim_control.lock().unwrap();
        let mut control = match kept {
            Some((id, control)) if id == control_store.id => control,
            _ => StepControl::from_bytes(&memory::read(
                &self.stream,
                control_store,
                control_store.bytes,
            )?)?,
        };
        let stats = if config.needs_grad_stats() {
            self.grad_stats(bufs.grads, n, config, control.unscale_factor())?
        } else {
            GradStats::default()
        };
        control.prepare(config, stats);
        memory::write(&self.stream, control_store, &control.to_bytes())?;
        *self.optim_control.lock().unwrap() = Some((control_store.id, control));
        if control.skipped != 0 || n == 0 {
            return Ok(());
        }
        let (rule, mut flags) = rule_flags(config.rule, control.factors);
        if config.loss_scaling.is_some() {
            flags |= FLAG_UNSCALE;
        }
        if config.max_grad_norm.is_some() {
            flags |= FLAG_CLIP;
        }
        let params = f32_tensor(bufs.params, "the parameters")?;
        let mut states = Vec::with_capacity(3);
        for s in bufs.states.iter() {
            states.push(f32_tensor(s, "an optimizer state")?);
        }
        // Unused slots stand in with the parameters (never touched there).
        let state = |i: usize| states.get(i).copied().unwrap_or(params);
        let (copy, copy_type) = match &bufs.compute_copy {
            Some(t) => (
                storage(t, "the compute copy")?.binding(),
                if t.dtype() == DType::BF16 { 1 } else { 2 },
            ),
            None => (params, 0),
        };
        let (groups, groups_x) = self.grid(n.div_ceil(UPDATE_CHUNK))?;
        let f = control.factors;
        let words = [
            n as u32,
            rule,
            flags,
            groups_x,
            f[0].to_bits(),
            f[1].to_bits(),
            f[2].to_bits(),
            f[3].to_bits(),
            f[4].to_bits(),
            f[5].to_bits(),
            f[6].to_bits(),
            f[7].to_bits(),
            control.inv_scale.to_bits(),
            control.clip_coef.to_bits(),
            copy_type,
            0,
        ];
        let kernel = self.kernel(&OPTIM_UPDATE, &[])?;
        self.stream.dispatch(
            &kernel,
            &[
                params,
                f32_tensor(bufs.grads, "the gradients")?,
                state(0),
                state(1),
                state(2),
                copy,
            ],
            &words,
            groups,
        )
    }
}

impl WgpuBackend {
    /// Drop the kept control block if it lives in storage `id`, which is being written.
    pub(crate) fn forget_optim_control(&self, id: u64) {
        let mut kept = self.optim_control.lock().unwrap();
        if kept.is_some_and(|(kept_id, _)| kept_id == id) {
            *kept = None;
        }
    }

    /// Σ (g·unscale)² and whether any g is inf/NaN: a partial a workgroup on the device,
    /// summed here in f64.
    fn grad_stats(
        &self,
        grads: &kiln_core::Tensor,
        n: usize,
        config: &StepConfig,
        unscale: f32,
    ) -> Result<GradStats> {
        if n == 0 {
            return Ok(GradStats::default());
        }
        let chunks = n.div_ceil(STATS_CHUNK);
        let partials = self.alloc(8 * chunks)?;
        let (groups, groups_x) = self.grid(chunks)?;
        let kernel = self.kernel(&GRAD_STATS, &[])?;
        self.stream.dispatch(
            &kernel,
            &[f32_tensor(grads, "the gradients")?, partials.binding()],
            &[
                n as u32,
                u32::from(config.loss_scaling.is_some()),
                unscale.to_bits(),
                groups_x,
            ],
            groups,
        )?;
        let bytes = memory::read(&self.stream, &partials, partials.bytes)?;
        let words: Vec<f32> = bytemuck::pod_collect_to_vec(&bytes);
        Ok(words
            .chunks_exact(2)
            .take(chunks)
            .fold(GradStats::default(), |a, p| GradStats {
                sum_squares: a.sum_squares + p[0] as f64,
                non_finite: a.non_finite || p[1] != 0.0,
            }))
    }
}

/// The rule's number in the shader and its flags (see `StepControl::prepare` for the
/// factors' order; PyTorch tests its Python floats against zero, as the CPU does).
fn rule_flags(rule: Rule, factors: [f32; 8]) -> (u32, u32) {
    let flag = |on: bool, f: u32| if on { f } else { 0 };
    match rule {
        Rule::Sgd {
            momentum,
            nesterov,
            weight_decay,
            ..
        } => (
            0,
            flag(weight_decay != 0.0, FLAG_A)
                | flag(momentum != 0.0, FLAG_B)
                | flag(factors[4] != 0.0, FLAG_C)
                | flag(nesterov, FLAG_D),
        ),
        Rule::Adam {
            weight_decay,
            decoupled_weight_decay,
            amsgrad,
            ..
        } => (
            1,
            flag(weight_decay != 0.0, FLAG_A)
                | flag(decoupled_weight_decay, FLAG_B)
                | flag(amsgrad, FLAG_C),
        ),
        Rule::RmsProp {
            weight_decay,
            momentum,
            centered,
            ..
        } => (
            2,
            flag(weight_decay != 0.0, FLAG_A)
                | flag(momentum > 0.0, FLAG_B)
                | flag(centered, FLAG_C),
        ),
        Rule::Adagrad { weight_decay, .. } => (3, flag(weight_decay != 0.0, FLAG_A)),
    }
}
