//! kiln's optimizers: fused steps over flat buffers.
//!
//! An optimizer knows flat buffers, not models. Every trainable tensor of a model lies in
//! one F32 buffer of parameters (the FP32 master weights), at the offset a [`ParamLayout`]
//! gives it; its gradient lies at the same offset of one F32 buffer of gradients. The
//! [`Optimizer`] owns its rule's state buffers (laid out the same way) and a small control
//! block on the device, and a step is one pass over all tensors, run by the backend
//! ([`kiln_core::optim`]: the formulas, PyTorch's, and what runs where). Nothing is read
//! back during a step: a recorded step (CUDA graph) replays as it is, the learning rate
//! and step count moving on the device.
//!
//! ```no_run
//! # use kiln_core::{Backend, DType, Shape};
//! # fn demo(backend: &dyn Backend) -> kiln_core::Result<()> {
//! use kiln_optim::{Optimizer, ParamLayout, Rule, Schedule, StepConfig};
//! let layout = ParamLayout::new([("w", vec![64, 32]), ("b", vec![64])])?;
//! let mut params = backend.zeros(DType::F32, Shape::new(vec![layout.numel()])?)?;
//! let grads = backend.zeros(DType::F32, Shape::new(vec![layout.numel()])?)?;
//! let config = StepConfig {
//!     rule: Rule::adamw(0.1),
//!     schedule: Schedule::Cosine { lr: 3e-4, min_lr: 3e-5, warmup: 100, total: 10_000 },
//!     max_grad_norm: Some(1.0),
//!     loss_scaling: None,
//! };
//! let mut opt = Optimizer::new(backend, layout, config)?;
//! // ... the backward pass writes `grads` ...
//! opt.step(backend, &mut params, &grads, None)?;
//! let status = opt.status(backend)?; // reads back: lr, step, gradient norm
//! # Ok(()) }
//! ```
//!
//! Parameter groups with other hyperparameters (no weight decay on norms, say) are
//! separate optimizers over separate flat buffers: each is still one launch.

mod checkpoint;
mod layout;

pub use kiln_core::optim::{LossScaling, Rule, Schedule, StepConfig, StepControl};
pub use layout::{ParamEntry, ParamLayout};

use kiln_core::optim::StepBuffers;
use kiln_core::{Backend, DType, Error, HostBytes, Result, Shape, Tensor};

/// An update rule's state for one flat parameter buffer, and the step's control block.
pub struct Optimizer {
    config: StepConfig,
    layout: ParamLayout,
    /// One flat F32 buffer per name of [`Rule::states`].
    states: Vec<Tensor>,
    /// [`StepControl`] on the device.
    control: Tensor,
}

impl Optimizer {
    /// An optimizer for parameters laid out as `layout`, its states allocated on
    /// `backend` (zeros, or Adagrad's initial sum); an error if the backend has no
    /// optimizer kernels or the configuration is out of range.
    pub fn new(backend: &dyn Backend, layout: ParamLayout, config: StepConfig) -> Result<Self> {
        config.validate()?;
        kernels(backend)?;
        let shape = Shape::new(vec![layout.numel()])?;
        let mut states = Vec::new();
        for _ in config.rule.states() {
            let mut t = backend.zeros(DType::F32, shape.clone())?;
            let init = config.rule.initial_state_value();
            if init != 0.0 {
                backend.fill(&mut t, init)?;
            }
            states.push(t);
        }
        let control = backend.upload(
            DType::F32,
            Shape::new(vec![StepControl::WORDS])?,
            HostBytes::from_vec(StepControl::new(&config).to_bytes()),
        )?;
        Ok(Optimizer {
            config,
            layout,
            states,
            control,
        })
    }

    /// One step: `params` (F32, [`ParamLayout::numel`] elements) updated from `grads`
    /// (the same), which the step reads only (unscaling and clipping its own copy of
    /// each value). `compute_copy` (BF16 or F16, the same count), when given, receives
    /// the updated parameters rounded to its type: the weights a mixed-precision forward
    /// pass reads. With loss scaling, gradients hold `loss_scale ×` their values; an
    /// inf/NaN among them skips the update (found on the device; see [`Self::status`]).
    pub fn step(
        &mut self,
        backend: &dyn Backend,
        params: &mut Tensor,
        grads: &Tensor,
        compute_copy: Option<&mut Tensor>,
    ) -> Result<()> {
        let n = self.layout.numel();
        if params.shape().numel() != n {
            return Err(Error::shape(format!(
                "optimizer step: the parameter buffer has {} elements, its layout {n}",
                params.shape().numel()
            )));
        }
        kernels(backend)?.step(
            &self.config,
            StepBuffers {
                params,
                grads,
                states: &mut self.states,
                compute_copy,
                control: &mut self.control,
            },
        )
    }

    /// The control block as the last step left it: step count, learning rate, gradient
    /// norm, loss scale, whether the step was skipped. Reads from the device (waits for
    /// queued work).
    pub fn status(&self, backend: &dyn Backend) -> Result<StepControl> {
        StepControl::from_bytes(&backend.download(&self.control)?)
    }

    /// The loss scale to multiply the next loss by (1 without loss scaling). Reads from
    /// the device.
    pub fn loss_scale(&self, backend: &dyn Backend) -> Result<f32> {
        Ok(self.status(backend)?.loss_scale)
    }

    /// The state buffer `name` (one of [`Rule::states`]).
    pub fn state(&self, name: &str) -> Option<&Tensor> {
        let i = self.config.rule.states().iter().position(|s| *s == name)?;
        self.states.get(i)
    }

    pub fn config(&self) -> &StepConfig {
        &self.config
    }

    pub fn layout(&self) -> &ParamLayout {
        &self.layout
    }

    /// Change the schedule, clipping or loss scaling from the next step on (resuming
    /// with a longer schedule, say); the rule, whose states these are, stays.
    pub fn reconfigure(&mut self, config: StepConfig) -> Result<()> {
        config.validate()?;
        if config.rule != self.config.rule {
            return Err(Error::unsupported(format!(
                "optimizer: the rule is {:?}; a new rule {:?} needs a new optimizer",
                self.config.rule, config.rule
            )));
        }
        self.config = config;
        Ok(())
    }
}

fn kernels(backend: &dyn Backend) -> Result<&dyn kiln_core::OptimKernels> {
    backend.optim().ok_or_else(|| {
        Error::unsupported(format!(
            "the optimizer step is not implemented on {} yet (it is on cpu and cuda)",
            backend.device()
        ))
    })
}
