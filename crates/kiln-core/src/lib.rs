//! kiln's shared vocabulary.
//!
//! Everything a backend, a file reader and a model have to agree on lives here: element
//! types and ggml's block formats ([`DType`], [`quant`]), shapes, the [`Device`] a buffer lives
//! on, the [`Tensor`] handle, and the op-level [`Backend`] interface that every backend
//! implements and every model is written against.

pub mod backend;
pub mod collective;
pub mod device;
pub mod disk_cache;
pub mod dtype;
pub mod error;
pub mod grad;
pub mod optim;
pub mod quant;
pub mod sampling;
pub mod shape;
pub mod tensor;

pub use backend::{
    rope_write_kv_by_ops, to_device, AttentionParams, Backend, KernelTime, Pages, Replay, RmsNorm,
    RopeLayout, RowDraw,
};
pub use collective::Collective;
pub use device::Device;
pub use dtype::DType;
pub use error::{Error, Result};
pub use grad::{AttentionRun, AttentionSaved, GradInto, GradOps, Products};
pub use optim::OptimKernels;
pub use sampling::SampleParams;
pub use shape::Shape;
pub use tensor::{HostBytes, Storage, Tensor};
