//! The cases, one public function each (named as its test), grouped by op family.
//! `with_cases!` in lib.rs lists them.

mod attention;
mod buffers;
mod fused;
mod paged;
mod products;
mod rows;
mod sampling;
mod tables;

pub use attention::*;
pub use buffers::*;
pub use fused::*;
pub use paged::*;
pub use products::*;
pub use rows::*;
pub use sampling::*;
pub use tables::*;
