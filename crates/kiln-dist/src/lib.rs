//! kiln across several GPUs and hosts, the parts that do not depend on a device:
//! - [`split`]: which rows and columns of each weight a rank of a tensor-parallel group
//!   holds (the Megatron split of the LLaMA family), checked against the model before
//!   anything is loaded;
//! - [`rendezvous`]: how the ranks of a run find each other (rank 0 publishes the
//!   collective library's unique id over TCP) and refuse to start together when their
//!   model files or settings differ.
//!
//! The collectives themselves (NCCL) live with the CUDA backend.

pub mod rendezvous;
pub mod split;
