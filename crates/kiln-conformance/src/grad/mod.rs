//! Gradient checks, written once for every backend that can train: each backward kernel
//! of [`kiln_core::GradOps`] against central finite differences of a float64 forward
//! (`reference`), on seeded random inputs of awkward sizes.
//!
//! Each case forms a scalar `L = Σ forward(inputs) · r` with a random `r`, hands `r` to
//! the backward kernel as the output's gradient, and compares what the kernel *added* to
//! each input's gradient (buffers start filled with random values, so a kernel that
//! overwrites instead of accumulating fails) with `(L(x + h) − L(x − h)) / 2h` in f64.
//! The tolerance is [`TOL`] of the largest gradient of that input; every check then also
//! moves one element of the kernel's gradient by ten times that and asserts the check
//! fails, so a tolerance too loose to catch a wrong kernel cannot pass unnoticed.
//!
//! A backend's `tests/grad.rs` is one invocation of [`grad_suite!`]:
//!
//! ```ignore
//! kiln_conformance::grad_suite! {
//!     backend: kiln_cpu::CpuBackend::new(Some(2)).unwrap(),
//! }
//! ```

#[doc(hidden)]
pub mod cases;
mod reference;

use crate::Target;
use kiln_core::{DType, GradInto, GradOps, Tensor};
use rand::rngs::StdRng;
use rand::Rng;

/// A kernel's gradient may be off the float64 one by this much of the input's largest
/// gradient: f32 arithmetic over the short sums of these shapes stays well inside it.
pub(crate) const TOL: f64 = 1e-4;

/// The finite-difference step: in f64 the truncation error (∝ h²) and the rounding error
/// (∝ 2⁻⁵² / h) both stay below 1e-8 of a gradient.
const STEP: f64 = 1e-5;

/// Calls `$callback! { $args case ... }` with every gradient case's name.
#[doc(hidden)]
#[macro_export]
macro_rules! with_grad_cases {
    ([$($callback:tt)*] $args:tt) => {
        $($callback)*! { $args
            copy_add_scaled_and_sum_rows
            copy_span_and_sum_squares
            matmul_gradients
            matmul_gradients_over_many_tasks
            embedding_gradient_sums_repeated_ids
            embedding_gradient_over_a_large_table
            rms_norm_gradients
            layer_norm_gradients
            softmax_gradient
            rope_gradient
            attention_gradients
            attention_gradients_softcapped_and_windowed
            attention_gradients_at_a_real_head_layout
            attention_gradients_of_runs_in_place
            gated_gradients
            gelu_and_softcap_gradients
            slice_cols_and_write_rows_gradients
            cross_entropy_loss_and_gradients
            cross_entropy_over_blocks_of_rows
            gradients_through_frozen_weights_as_stored
            frozen_weights_over_many_decoded_tiles
            a_wrong_gradient_is_caught
        }
    };
}

/// One `#[test]` per gradient case for a backend; see the module's documentation.
#[macro_export]
macro_rules! grad_suite {
    (
        $(#[$attr:meta])*
        backend: $backend:expr
        $(, available: $available:expr)?
        $(,)?
    ) => {
        fn grad_case(case: &str, body: fn(&$crate::Target)) {
            $crate::run_case(
                case,
                body,
                || {
                    $(if !$available {
                        return None;
                    })?
                    Some($backend)
                },
                |_, _, _, _| $crate::Rounding::None,
                &[],
            );
        }
        $crate::with_grad_cases!([$crate::grad_tests_for_cases] [$(#[$attr])*]);
    };
}

/// The tests [`grad_suite!`] makes, one case at a time.
#[doc(hidden)]
#[macro_export]
macro_rules! grad_tests_for_cases {
    ($attrs:tt) => {};
    ([$(#[$attr:meta])*] $case:ident $($rest:ident)*) => {
        #[test]
        $(#[$attr])*
        fn $case() {
            grad_case(stringify!($case), $crate::grad::cases::$case);
        }
        $crate::grad_tests_for_cases!([$(#[$attr])*] $($rest)*);
    };
}

impl Target<'_> {
    /// The backend's backward kernels; a backend in the gradient suite must have them.
    pub(crate) fn grad(&self) -> &dyn GradOps {
        self.backend.grad().unwrap_or_else(|| {
            panic!(
                "{} has no backward kernels (Backend::grad is None)",
                self.backend.describe()
            )
        })
    }

    /// A gradient buffer filled with random values of about the gradients' size, and
    /// those values: what a kernel adds is read back as the difference.
    pub(crate) fn grad_buffer(&self, rng: &mut StdRng, dims: &[usize]) -> (Tensor, Vec<f32>) {
        self.grad_buffer_of(rng, dims, 0.5)
    }

    /// [`Target::grad_buffer`] with values in `±size`: small gradients would drown in the
    /// rounding of large starting values.
    pub(crate) fn grad_buffer_of(
        &self,
        rng: &mut StdRng,
        dims: &[usize],
        size: f32,
    ) -> (Tensor, Vec<f32>) {
        let n: usize = dims.iter().product();
        let before = crate::target::random(rng, n, size);
        (self.upload(DType::F32, dims, &before), before)
    }

    /// What a kernel added to a buffer made by [`Target::grad_buffer`].
    pub(crate) fn added(&self, t: &Tensor, before: &[f32]) -> Vec<f64> {
        self.read(t)
            .iter()
            .zip(before)
            .map(|(&a, &b)| a as f64 - b as f64)
            .collect()
    }

    /// A buffer for a kernel told `into`: [`Target::grad_buffer`]'s under `Add`; under
    /// `Write` NaN throughout, so that an element the kernel leaves, or reads, shows.
    pub(crate) fn grad_buffer_into(
        &self,
        rng: &mut StdRng,
        dims: &[usize],
        into: GradInto,
    ) -> (Tensor, Vec<f32>) {
        match into {
            GradInto::Add => self.grad_buffer(rng, dims),
            GradInto::Write => {
                let before = vec![f32::NAN; dims.iter().product()];
                (self.upload(DType::F32, dims, &before), before)
            }
        }
    }

    /// What a kernel told `into` left in a buffer of [`Target::grad_buffer_into`]: what
    /// it added, or what it wrote.
    pub(crate) fn result(&self, t: &Tensor, before: &[f32], into: GradInto) -> Vec<f64> {
        match into {
            GradInto::Add => self.added(t, before),
            GradInto::Write => widen(&self.read(t)),
        }
    }
}

/// Both ways a kernel can take a gradient: the cases of the kernels that take a
/// [`GradInto`] run each.
pub(crate) const MODES: [GradInto; 2] = [GradInto::Add, GradInto::Write];

/// `n` random values in `[-1, 1)`: the weights `r` of `L`, handed to kernels as the
/// output's gradient (and widened for the references).
pub(crate) fn cotangent_f32(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0..1.0)).collect()
}

/// `Σ a·b`.
pub(crate) fn weighted(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(a, b)| a * b).sum()
}

pub(crate) fn widen(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

/// Which elements of an input a check differentiates: all of them, or `at most` of them
/// drawn at random (for inputs whose every difference would cost too long).
pub(crate) enum Elements<'a> {
    All,
    Sample(usize, &'a mut StdRng),
}

/// Assert that `got` (what a kernel added to the gradient of input `what`) matches the
/// central differences of `loss` at `x`, at the elements `which` picks; then that the
/// same comparison rejects `got` with one element moved by ten times the tolerance.
#[track_caller]
pub(crate) fn check(
    what: &str,
    got: &[f64],
    x: &[f32],
    which: Elements,
    loss: impl Fn(&[f64]) -> f64,
) {
    assert_eq!(got.len(), x.len(), "{what}: gradient length");
    let at: Vec<usize> = match which {
        Elements::All => (0..x.len()).collect(),
        Elements::Sample(most, rng) if most < x.len() => {
            (0..most).map(|_| rng.random_range(0..x.len())).collect()
        }
        Elements::Sample(..) => (0..x.len()).collect(),
    };
    let mut xs = widen(x);
    let want: Vec<f64> = at
        .iter()
        .map(|&i| {
            let x0 = xs[i];
            let h = STEP * x0.abs().max(1.0);
            xs[i] = x0 + h;
            let up = loss(&xs);
            xs[i] = x0 - h;
            let down = loss(&xs);
            xs[i] = x0;
            (up - down) / (2.0 * h)
        })
        .collect();
    let got_at: Vec<f64> = at.iter().map(|&i| got[i]).collect();
    let largest = want.iter().fold(0f64, |m, w| m.max(w.abs()));
    assert!(
        largest > 0.0 && largest.is_finite(),
        "{what}: the differences are all zero (or not finite): the check would check nothing"
    );
    let bound = TOL * largest;
    if let Some(j) = first_off(&got_at, &want, bound) {
        panic!(
            "{what}: gradient [{}] is {}, central differences give {} (bound {bound:e}, largest {largest:e})",
            at[j], got_at[j], want[j]
        );
    }
    let mut moved = got_at.clone();
    let middle = moved.len() / 2;
    moved[middle] += 10.0 * bound;
    assert!(
        first_off(&moved, &want, bound).is_some(),
        "{what}: the check does not catch a gradient moved by ten times its tolerance"
    );
}

/// The first element off by more than `bound` (NaN counts as off).
fn first_off(got: &[f64], want: &[f64], bound: f64) -> Option<usize> {
    (0..got.len()).find(|&i| {
        let off = (got[i] - want[i]).abs();
        off.is_nan() || off > bound
    })
}
