//! `kiln serve`: an OpenAI-compatible HTTP server over kiln's models.
//!
//! Two layers that know little of each other: [`engine`] schedules many sequences over one
//! model (continuous batching, KV memory in blocks, preemption) and knows nothing of HTTP;
//! [`api`] speaks OpenAI's protocol (requests, validation, Server-Sent Events, errors) and
//! knows nothing of kernels. [`metrics`] is what both report.
//!
//! The first runner is serial (see [`engine::runner`]): kiln's kernels run one sequence at
//! a time, so a step runs its sequences one after another.

pub mod api;
pub mod engine;
pub mod metrics;

pub use api::{router, serve, App, ChatRenderer, RenderError, ServedModel};
pub use engine::runner::{PagedRunner, SplitRunner, StepRunner};
pub use engine::scheduler::Limits;
pub use engine::{Engine, EngineConfig};
