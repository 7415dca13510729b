//! kiln across several devices and hosts, the parts that need no device of their own:
//! - [`rendezvous`]: how the ranks of a run find each other (rank 0 publishes the
//!   collective library's unique id over TCP) and refuse to start together when their
//!   model files or settings differ;
//! - [`host`]: a group of ranks that are threads of one process, summing their tensors
//!   through host memory, over any backend (tests, and tensor parallelism on CPUs);
//! - [`start`]: such ranks start together or not at all;
//! - [`gate`]: a barrier one of them can break.
//!
//! The tensor-parallel split of a model is `kiln_models::tp`; NCCL lives with the CUDA
//! backend.

pub mod gate;
pub mod host;
pub mod rendezvous;
pub mod start;
