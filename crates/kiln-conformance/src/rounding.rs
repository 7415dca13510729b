//! How a backend rounds x before a product, the float64 reference that rounds x the same
//! way, and the error a correct kernel may make beyond that.
//!
//! With x rounded as the backend rounds it and the weights as stored, what is left is the
//! rounding of the products and of their sums. Those errors are bounded the way Higham and
//! Mary bound them ("A new approach to probabilistic rounding error analysis", 2019): each
//! rounding is a relative error of at most u, the errors are independent and of mean zero,
//! and by Azuma–Hoeffding a sum of n terms is then off by at most λ·√n·u·Σ|wx| but for a
//! probability of 2·exp(-λ²/2) (λ = 8 below: 3e-14). Unlike a bound proportional to
//! Σ|wx| alone, this one grows as √k times slower than the sum, so at k = 14,336 it is a
//! tenth of what one dropped block of 32 products is worth (≈ √32·E|wx|).

use half::{bf16, f16};
use kiln_core::quant::{self, BlockQ8K, QK, QK_K};
use kiln_core::DType;

/// What one row of x becomes before a backend multiplies it by a weight. Each backend
/// declares its own in its `tests/ops.rs`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rounding {
    /// x as it is, products and sums in f32.
    None,
    /// ggml's Q8_0 per 32 values (scale amax/127, kept as f16): the CPU's activations for
    /// Q8_0 and Q4_0 weights.
    Q8_0,
    /// ggml's Q8_K per 256 values (scale max/-127 in f32): the CPU's for the K formats.
    Q8K,
    /// int8 per 32 values, scale amax/127 in f32, half to even: the GPUs' decode with
    /// quantized weights.
    Int8,
    /// x to f16, products summed four at a time in f16 (vec4 dot products), those sums in
    /// f32: wgpu's decode with F16 weights where the device has f16 arithmetic.
    F16Dot4,
    /// x and the weights to f16, exact products summed in f32 on tensor cores (which may
    /// round those sums a little coarser than IEEE).
    F16,
    /// x to bf16 against bf16 weights, on tensor cores as [`Rounding::F16`].
    Bf16,
    /// x kept to 16 significant bits, as two bf16 halves with the smallest cross product
    /// dropped: at most 2^-15 of each product (the CPU's F16/BF16 prompts on AMX).
    Split16,
}

/// λ of the probabilistic bounds: each fails with probability 2·exp(-λ²/2).
const LAMBDA: f64 = 8.0;
const U32: f64 = f32::EPSILON as f64 / 2.0;
const U16: f64 = 1.0 / 2048.0;
/// Values of an int8 row that may round the other way than the reference rounds them
/// (a shader's 1/scale may be an ulp off), each by one step.
const FLIPS: f64 = 3.0;

/// Σ v² over the values a 4-term dot product in f16 rounds (its products and partial
/// sums), each off by at most U16·|v|. The order of the sums is the device's: the two
/// partial sums before the last are bounded by the largest sum of 2 or 3 of the products.
fn dot4_rounded_sq(p: &[f64]) -> f64 {
    let subsets = (1..1u32 << p.len()).filter(|s| (2..p.len() as u32).contains(&s.count_ones()));
    let partial = subsets
        .map(|s| {
            (0..p.len())
                .filter(|i| s >> i & 1 == 1)
                .map(|i| p[i])
                .sum::<f64>()
                .abs()
        })
        .fold(0f64, f64::max);
    let total: f64 = p.iter().sum();
    p.iter().map(|v| v * v).sum::<f64>() + 2.0 * partial * partial + total * total
}

/// The expected value of one product and how far from it a correct kernel may land.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Expected {
    pub value: f64,
    pub tol: f64,
}

impl Expected {
    /// This product added to `a` in f32 (`matmul_add`).
    pub(crate) fn plus(self, a: f32) -> Expected {
        let value = self.value + a as f64;
        Expected {
            value,
            tol: self.tol + 2.0 * U32 * (value.abs() + (a as f64).abs()),
        }
    }

    pub(crate) fn admits(&self, got: f32) -> bool {
        (got as f64 - self.value).abs() <= self.tol
    }
}

/// One row of x as a backend rounds it, ready to be dotted with rows of weights.
pub(crate) struct RoundedRow {
    rounding: Rounding,
    values: Vec<f64>,
    /// Per value, one step of its rounding (int8 forms), for values that round the other way.
    steps: Vec<f64>,
}

impl RoundedRow {
    pub(crate) fn new(x: &[f32], rounding: Rounding) -> RoundedRow {
        let k = x.len();
        let (values, steps): (Vec<f64>, Vec<f64>) = match rounding {
            Rounding::None | Rounding::Split16 => (x.iter().map(|&v| v as f64).collect(), vec![]),
            Rounding::F16 | Rounding::F16Dot4 => (
                x.iter().map(|&v| f16::from_f32(v).to_f64()).collect(),
                vec![],
            ),
            Rounding::Bf16 => (
                x.iter().map(|&v| bf16::from_f32(v).to_f64()).collect(),
                vec![],
            ),
            Rounding::Q8_0 => {
                let q = quant::quantize(DType::Q8_0, x).unwrap();
                let values = quant::dequantize_to_vec(DType::Q8_0, &q, k).unwrap();
                let steps = q
                    .chunks_exact(DType::Q8_0.block_bytes())
                    .flat_map(|b| {
                        let d = f16::from_le_bytes([b[0], b[1]]).to_f64();
                        [d; QK]
                    })
                    .collect();
                (values.iter().map(|&v| v as f64).collect(), steps)
            }
            Rounding::Q8K => {
                let empty = BlockQ8K {
                    d: 0.0,
                    qs: [0; QK_K],
                    bsums: [0; QK_K / 16],
                };
                let mut blocks = vec![empty; k / QK_K];
                quant::quantize_q8_k(x, &mut blocks).unwrap();
                blocks
                    .iter()
                    .flat_map(|b| {
                        b.qs.iter()
                            .map(move |&q| (q as f64 * b.d as f64, b.d as f64))
                    })
                    .unzip()
            }
            Rounding::Int8 => x
                .chunks(QK)
                .flat_map(|unit| {
                    let d = unit.iter().fold(0f32, |a, v| a.max(v.abs())) / 127.0;
                    let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
                    unit.iter()
                        .map(move |&v| ((v * inv).round_ties_even() as f64 * d as f64, d as f64))
                })
                .unzip(),
        };
        RoundedRow {
            rounding,
            values,
            steps,
        }
    }

    /// This row · `w` (a row of stored weights, decoded).
    pub(crate) fn dot(&self, w: &[f32]) -> Expected {
        assert_eq!(w.len(), self.values.len(), "row lengths");
        let k = w.len() as f64;
        let (mut value, mut mag, mut flip) = (0f64, 0f64, 0f64);
        let mut p = Vec::with_capacity(w.len());
        for (j, (&wj, &xj)) in w.iter().zip(&self.values).enumerate() {
            let wj = match self.rounding {
                Rounding::F16 => f16::from_f32(wj).to_f64(),
                _ => wj as f64,
            };
            p.push(wj * xj);
            value += wj * xj;
            mag += (wj * xj).abs();
            if let Some(step) = self.steps.get(j) {
                flip = flip.max((wj * step).abs());
            }
        }
        // f32 products and sums (tensor cores' sums: a unit twice as coarse).
        let sums = match self.rounding {
            Rounding::F16 | Rounding::Bf16 => 2.0 * U32,
            _ => U32,
        };
        let mut tol = LAMBDA * k.sqrt() * sums * mag + FLIPS * flip;
        tol += match self.rounding {
            Rounding::F16Dot4 => {
                LAMBDA * U16 * p.chunks(4).map(dot4_rounded_sq).sum::<f64>().sqrt()
            }
            Rounding::Split16 => mag / 32768.0,
            _ => 0.0,
        };
        Expected { value, tol }
    }
}

/// Every product `x[n, k] · w[m, k]ᵀ` as `rounding` rounds each row of x, `w` the stored
/// weights decoded: `[n * m]` expectations.
pub(crate) fn products(x: &[f32], w: &[f32], k: usize, rounding: Rounding) -> Vec<Expected> {
    x.chunks(k)
        .flat_map(|row| {
            let row = RoundedRow::new(row, rounding);
            w.chunks(k).map(move |wr| row.dot(wr)).collect::<Vec<_>>()
        })
        .collect()
}

/// The indices of `got` outside their expectations.
pub(crate) fn outside(got: &[f32], want: &[Expected]) -> Vec<usize> {
    assert_eq!(got.len(), want.len(), "number of results");
    (0..got.len())
        .filter(|&i| !want[i].admits(got[i]))
        .collect()
}

/// Panic, naming the first few, if any of `got` is outside its expectation.
#[track_caller]
pub(crate) fn assert_products(got: &[f32], want: &[Expected], what: &str) {
    let bad = outside(got, want);

    if let Some(&i) = bad.first() {
        let e = want[i];
        panic!(
            "{what}: {} of {} products outside their bound; first [{i}]: got {}, want {} ± {:.3e} (off by {:.3e})",
            bad.len(),
            got.len(),
            got[i],
            e.value,
            e.tol,
            (got[i] as f64 - e.value).abs()
        );
    }
}

/// `act(g) · u` from the products `g` and `u` (`gated_ffn`), act SiLU or GELU. The
/// products' errors pass through act, whose slope is at most 1.13 for both; act itself
/// is taken at 1e-5 of its value (device `exp` and `tanh` are a few ulps off).
pub(crate) fn gated(g: Expected, u: Expected, gelu: bool) -> Expected {
    const SLOPE: f64 = 1.13;
    let act = if gelu {
        crate::reference::gelu(g.value)
    } else {
        crate::reference::silu(g.value)
    };
    let value = act * u.value;
    let tol = SLOPE * g.tol * (u.value.abs() + u.tol)
        + (act.abs() + SLOPE * g.tol) * u.tol
        + 1e-5 * value.abs()
        + 1e-6;
    Expected { value, tol }
}
