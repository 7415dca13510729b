//! What a case runs on (the backend under test, how it rounds, the case's inputs' seed),
//! and how [`run_case`] runs one: skipped without a device, the seed printed on failure,
//! known failures turned around.

use crate::Rounding;
use kiln_core::{quant, Backend, DType, HostBytes, Shape, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};

/// The seed when `KILN_CONFORMANCE_SEED` is not set.
const DEFAULT_SEED: u64 = 0x6b69_6c6e;

/// The backend a case runs on, with its declared rounding and the case's random inputs.
pub struct Target<'a> {
    pub(crate) backend: &'a dyn Backend,
    rounding: &'a dyn Fn(DType, usize, usize) -> Rounding,
    seed: u64,
}

/// Run case `case` (`body`) on the backend `backend` makes (`None`: no device here, the
/// case is skipped with a notice). `failing` lists the cases known to fail on it, with why.
pub fn run_case<B: Backend>(
    case: &str,
    body: fn(&Target),
    backend: impl FnOnce() -> Option<B>,
    rounding: impl Fn(&B, DType, usize, usize) -> Rounding,
    failing: &[(&str, &str)],
) {
    for (name, _) in failing {
        assert!(
            crate::CASES.contains(name),
            "`failing` names {name}, which is no case of the suite"
        );
    }
    let Some(b) = backend() else {
        eprintln!("SKIPPED: {case}: no device to run it on");
        return;
    };
    let seed = match std::env::var("KILN_CONFORMANCE_SEED") {
        Ok(s) => s
            .parse()
            .unwrap_or_else(|_| panic!("KILN_CONFORMANCE_SEED={s} is not a u64")),
        Err(_) => DEFAULT_SEED,
    };
    let round = |dtype, rows, k| rounding(&b, dtype, rows, k);
    let target = Target {
        backend: &b,
        rounding: &round,
        // Each case its own inputs, all of them moved by the one seed.
        seed: seed ^ name_hash(case),
    };
    let outcome = catch_unwind(AssertUnwindSafe(|| body(&target)));
    let declared = failing.iter().find(|(name, _)| *name == case);
    match (outcome, declared) {
        (Ok(()), None) => {}
        (Err(panic), None) => {
            eprintln!(
                "{case} failed on {} with KILN_CONFORMANCE_SEED={seed}",
                b.describe()
            );
            resume_unwind(panic)
        }
        (Err(_), Some((_, why))) => eprintln!("{case} fails, as declared: {why}"),
        (Ok(()), Some((_, why))) => panic!(
            "{case} passes but is declared failing ({why}): take it off the backend's `failing` list"
        ),
    }
}

/// FNV-1a: a stable hash of a case's name.
fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

impl Target<'_> {
    /// The case's random numbers; `stream` tells apart several sources in one case.
    pub(crate) fn rng(&self, stream: u64) -> StdRng {
        StdRng::seed_from_u64(self.seed.wrapping_add(stream))
    }

    /// How the backend rounds `rows` rows of x of length `k` before a product with a
    /// `dtype` weight.
    pub(crate) fn rounding(&self, dtype: DType, rows: usize, k: usize) -> Rounding {
        (self.rounding)(dtype, rows, k)
    }

    /// `values` stored as `dtype` (quantized as ggml's reference quantizers do).
    pub(crate) fn upload(&self, dtype: DType, dims: &[usize], values: &[f32]) -> Tensor {
        self.upload_bytes(dtype, dims, quant::quantize(dtype, values).unwrap())
    }

    pub(crate) fn upload_bytes(&self, dtype: DType, dims: &[usize], bytes: Vec<u8>) -> Tensor {
        self.backend
            .upload(dtype, shape(dims), HostBytes::from_vec(bytes))
            .unwrap()
    }

    /// An I32 `[n]` tensor of token ids or positions.
    pub(crate) fn ints(&self, values: &[i32]) -> Tensor {
        let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.upload_bytes(DType::I32, &[values.len()], bytes)
    }

    pub(crate) fn zeros(&self, dtype: DType, dims: &[usize]) -> Tensor {
        self.backend.zeros(dtype, shape(dims)).unwrap()
    }

    /// An F32 output filled with NaN, so that an element an op forgets to write shows.
    pub(crate) fn poisoned(&self, dims: &[usize]) -> Tensor {
        let mut t = self.zeros(DType::F32, dims);
        self.backend.fill(&mut t, f32::NAN).unwrap();
        t
    }

    /// An F32 tensor's values.
    pub(crate) fn read(&self, t: &Tensor) -> Vec<f32> {
        let bytes = self.backend.download(t).unwrap();
        quant::dequantize_to_vec(DType::F32, &bytes, t.shape().numel()).unwrap()
    }

    /// A tensor's values in any type, decoded as `quant::dequantize` decodes them.
    pub(crate) fn read_decoded(&self, t: &Tensor) -> Vec<f32> {
        let bytes = self.backend.download(t).unwrap();
        quant::dequantize_to_vec(t.dtype(), &bytes, t.shape().numel()).unwrap()
    }

    pub(crate) fn read_ints(&self, t: &Tensor) -> Vec<i32> {
        self.backend
            .download(t)
            .unwrap()
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }
}

pub(crate) fn shape(dims: &[usize]) -> Shape {
    Shape::new(dims.to_vec()).unwrap()
}

/// `n` values uniform in `[-scale, scale)`.
pub(crate) fn random(rng: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-scale..scale)).collect()
}

/// `values` as the weights of `dtype` hold them (quantized, then decoded).
pub(crate) fn stored(dtype: DType, values: &[f32]) -> Vec<f32> {
    let bytes = quant::quantize(dtype, values).unwrap();
    quant::dequantize_to_vec(dtype, &bytes, values.len()).unwrap()
}
