//! Training for kiln's models: autograd over the one model definition, the loop around
//! it, and its checkpoints.
//!
//! The forward pass that training differentiates is the one inference runs
//! (`kiln_models::Model`, immediate-mode calls on `&dyn Backend`): the model is built on a
//! [`Tape`], a backend that runs each op on the real one and records it, and
//! [`Tape::backward`] walks the record in reverse through the backend's backward kernels
//! ([`kiln_core::GradOps`]). The loss, cross-entropy, is fused with the output projection
//! and never makes the `[tokens, vocab]` logits whole. The update is a kiln-optim
//! [`kiln_optim::Optimizer`] step over flat buffers of every parameter, gradient and
//! state (see [`Trainer`]).

mod backward;
pub mod checkpoint;
pub mod data;
pub mod init;
pub mod lora;
mod paged;
mod recompute;
pub mod rng;
mod tape;
mod trainer;

pub use kiln_optim::{LossScaling, Rule, Schedule, StepConfig};
pub use lora::LoraSettings;
pub use tape::Tape;
pub use trainer::{Settings, StepReport, Trainer, DEFAULT_BUCKET_BYTES};
