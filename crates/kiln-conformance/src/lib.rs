//! kiln's op tests, written once for every backend.
//!
//! Each case runs ops of [`kiln_core::Backend`] on seeded random inputs of awkward sizes and
//! of real model widths, and checks them against float64 references computed here. Products
//! are held to a bound derived from how the backend rounds (see [`Rounding`]): tight enough
//! that a kernel dropping one block of 32 values fails, which the case
//! `tolerance_catches_a_dropped_block` checks on the backend itself.
//!
//! A backend's `tests/ops.rs` is one invocation of [`suite!`], which makes one `#[test]` per
//! case, so that a failure names its case:
//!
//! ```ignore
//! kiln_conformance::suite! {
//!     backend: kiln_cpu::CpuBackend::new(Some(2)).unwrap(),
//!     rounding: rounding, // fn(&CpuBackend, weight DType, rows of x, k) -> Rounding
//!     // Optional: skip (with a notice) when this is false.
//!     available: true,
//!     // Optional: cases known to fail here, with why. They still run, and their test
//!     // fails if one passes (take it off the list then).
//!     failing { attention: "why" },
//! }
//! ```
//! Attributes before `backend:` go on every test (`#[ignore = "needs a CUDA device"]`).
//! Inputs come from `KILN_CONFORMANCE_SEED` (a u64) when it is set, else from a fixed seed;
//! a failing case prints the seed it ran with.

#[doc(hidden)]
pub mod cases;
pub mod grad;
mod reference;
mod rounding;
mod target;

pub use rounding::Rounding;
#[doc(hidden)]
pub use target::{run_case, Target};

/// Calls `$callback! { $args case case ... }` with every case's name: the one list of
/// cases, from which [`suite!`] makes its tests and [`CASES`] is made. Each name is a
/// function of [`cases`].
#[doc(hidden)]
#[macro_export]
macro_rules! with_cases {
    ([$($callback:tt)*] $args:tt) => {
        $($callback)*! { $args
            matmul_every_dtype
            one_row_products_at_model_widths
            prompt_products_at_model_widths
            tolerance_catches_a_dropped_block
            products_in_sequence_see_each_others_outputs
            matmul_add
            matmul_many
            matmul_many_pair
            matmul_many_uploaded_together
            gated_ffn
            rms_norm_matmul_many
            rms_norm_gated_ffn
            attention_output_feeds_a_product
            embedding_every_dtype
            embedding_ids_outside_the_table
            weights_read_back_as_written
            weights_past_128_mib
            rms_norm
            layer_norm
            softmax
            softmax_of_a_masked_row_is_zeros
            elementwise
            softcap
            slice_cols
            write_rows
            rope
            rope_write_kv
            padding_rows_write_only_their_row
            kv_caches_of_other_types_are_refused
            attention
            attention_at_model_shapes
            prompt_attention_in_tiles
            paged_attention
            paged_attention_with_a_block_outside_the_pool
            argmax
            sampling_follows_the_host_reference
            sampling_into_a_wrong_output_is_an_error
            a_batch_of_draws_draws_each_row_as_alone
            recorded_steps_replay_on_new_contents
            buffers_are_created_filled_copied_and_read_back
            write_overwrites_whole_tensors
            upload_checks_sizes_and_keeps_host_bytes
            shapes_that_do_not_fit_are_errors
            bad_positions_are_errors
            positions_out_of_range_are_errors
            tensors_of_another_device_are_refused
            a_tensor_larger_than_memory_is_an_error
        }
    };
}

macro_rules! case_names {
    ([] $($case:ident)*) => {
        /// The name of every case, as its test is named.
        pub const CASES: &[&str] = &[$(stringify!($case)),*];
    };
}
with_cases!([case_names] []);

/// One `#[test]` per case for a backend; see the crate's documentation.
#[macro_export]
macro_rules! suite {
    (
        $(#[$attr:meta])*
        backend: $backend:expr,
        rounding: $rounding:expr
        $(, available: $available:expr)?
        $(, failing { $($failing:ident: $reason:expr),* $(,)? })?
        $(,)?
    ) => {
        fn conformance_case(case: &str, body: fn(&$crate::Target)) {
            $crate::run_case(
                case,
                body,
                || {
                    $(if !$available {
                        return None;
                    })?
                    Some($backend)
                },
                $rounding,
                &[$($((stringify!($failing), $reason)),*)?],
            );
        }
        $crate::with_cases!([$crate::tests_for_cases] [$(#[$attr])*]);
    };
}

/// The tests [`suite!`] makes, one case at a time (attributes repeat for each).
#[doc(hidden)]
#[macro_export]
macro_rules! tests_for_cases {
    ($attrs:tt) => {};
    ([$(#[$attr:meta])*] $case:ident $($rest:ident)*) => {
        #[test]
        $(#[$attr])*
        fn $case() {
            conformance_case(stringify!($case), $crate::cases::$case);
        }
        $crate::tests_for_cases!([$(#[$attr])*] $($rest)*);
    };
}
