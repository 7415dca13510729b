//! kiln's CPU backend.
pub mod dot;
