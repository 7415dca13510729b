use crate::dot;
#[cfg(target_arch = "x86_64")]
use crate::dot::Isa;
use crate::pool::Pool;
use crate::storage::Rows;
use crate::{f32s, f32s_mut, i32s_mut, indices, same_shape, storage, storage_mut};
use kiln_core::{quant, DType, Error, Result, Tensor};

/// Elements per task of the threaded elementwise ops.
const CHUNK: usize = 1 << 13;

/// `e^x` in straight-line arithmetic, so that loops over it vectorize (libm's `expf` is
/// one call per element): Cody-Waite reduction `x = n·ln2 + r`, |r| ≤ ln2/2, Cephes'
/// degree-6 polynomial for `e^r`, `2^n` built in the exponent bits. Within 2 ulp of the
/// true value (tested); inputs below −87.3 give 0 and above 88 give e^88, which is all
/// softmax and SiLU need.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split so that n·LN2_HI is exact for |n| < 2^9.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let xc = x.clamp(-87.3, 88.0);
    let n = (xc * LOG2E + 0.5).floor();
    let r = xc - n * LN2_HI - n * LN2_LO;
    let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 1.666_666_5e-1)
        * r
        + 0.5;
    let y = p * r * r + r + 1.0;
    let scale = f32::from_bits((((n as i32) + 127) << 23) as u32);
    if x < -87.3 {
        0.0
    } else {
        y * scale
    }
}

#[inline(always)]
pub(crate) fn silu(x: f32) -> f32 {
    x / (1.0 + exp(-x))
}

/// GELU, tanh approximation (what GPT-2's `gelu_new` and Gemma's `gelu_pytorch_tanh` use).
pub(crate) fn gelu(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x)).tanh())
}

/// `out = act(gate) · up`, threaded over chunks.
pub(crate) fn gated(
    pool: &Pool,
    gate: &Tensor,
    up: &Tensor,
    out: &mut Tensor,
    op: &str,
    act: fn(f32) -> f32,
) -> Result<()> {
    same_shape(gate, up, op)?;
    same_shape(gate, out, op)?;
    let (g, u) = (f32s(gate)?, f32s(up)?);
    pool.for_chunks_mut(f32s_mut(out)?, CHUNK, |c, o| {
        let (g, u) = (&g[c * CHUNK..], &u[c * CHUNK..]);
        for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
            *o = act(g) * u;
        }
    });
    Ok(())
}

/// `out = silu(gate) · up`, threaded over chunks, vectorized for AVX-512 where present.
pub(crate) fn silu_mul(pool: &Pool, gate: &Tensor, up: &Tensor, out: &mut Tensor) -> Result<()> {
    same_shape(gate, up, "silu_mul")?;
    same_shape(gate, out, "silu_mul")?;
    let (g, u) = (f32s(gate)?, f32s(up)?);
    pool.for_chunks_mut(f32s_mut(out)?, CHUNK, |c, o| {
        let (g, u) = (&g[c * CHUNK..][..o.len()], &u[c * CHUNK..][..o.len()]);
        match dot::isa() {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the ISA was detected (see `dot::isa`).
            Isa::Avx512Vnni => unsafe { x86::silu_mul(g, u, o) },
            _ => silu_mul_body(g, u, o),
        }
    });
    Ok(())
}

#[inline(always)]
fn silu_mul_body(g: &[f32], u: &[f32], o: &mut [f32]) {
    for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
        *o = silu(g) * u;
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    /// [`super::silu_mul_body`] compiled for AVX-512 (it is inlined here).
    ///
    /// # Safety
    /// AVX-512 F/BW/VL, AVX2 and FMA must be available.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    pub(super) unsafe fn silu_mul(g: &[f32], u: &[f32], o: &mut [f32]) {
        super::silu_mul_body(g, u, o)
    }
}

/// `acc op= x` where `x` has `acc`'s shape or is one row broadcast over `acc`'s rows.
pub(crate) fn broadcast_assign(
    acc: &mut Tensor,
    x: &Tensor,
    op: &str,
    // Generic, not a function pointer: the loop below then inlines and vectorises it (as a
    // pointer it cost a call per element, 208 µs for a 64-row prompt's residual add).
    f: impl Fn(&mut f32, f32),
) -> Result<()> {
    let row = acc.shape().row_len();
    let broadcast = x.shape().numel() == row && x.shape().row_len() == row;
    if x.shape() != acc.shape() && !broadcast {
        return Err(Error::shape(format!(
            "{op}: {} into {}",
            x.shape(),
            acc.shape()
        )));
    }
    let xs = f32s(x)?;
    let a = f32s_mut(acc)?;
    if row == 0 {
        return Ok(());
    }
    for chunk in a.chunks_mut(xs.len().max(1)) {
        chunk.iter_mut().zip(xs).for_each(|(a, &b)| f(a, b));
    }
    Ok(())
}

pub(crate) fn embedding(table: &Tensor, ids: &Tensor, out: &mut Tensor) -> Result<()> {
    let rows = Rows::of(table, "embedding")?;
    let (vocab, dim) = rows.dims();
    let n = out.dims().first().copied().unwrap_or(0);
    if out.dims() != [n, dim] {
        return Err(Error::shape(format!(
            "embedding rows of {dim} into {}",
            out.shape()
        )));
    }
    let ids = indices(ids, n, vocab, "token ids", |id| {
        Error::shape(format!(
            "token id {id} is outside the vocabulary of {vocab}"
        ))
    })?;
    for (&id, o) in ids.iter().zip(f32s_mut(out)?.chunks_exact_mut(dim.max(1))) {
        rows.decode(id as usize, o)?;
    }
    Ok(())
}

/// Rows of `src` into rows `pos` of a KV cache, converted to the cache's type (see
/// `Backend::write_rows`), or copied as stored when `src` has that type.
pub(crate) fn write_rows(src: &Tensor, dst: &mut Tensor, pos: &Tensor) -> Result<()> {
    let dst_row: usize = dst.dims().iter().skip(1).product();
    let src_row: usize = src.dims().iter().skip(1).product();
    let rows = src.dims().first().copied().unwrap_or(1);
    let dst_rows = dst.dims().first().copied().unwrap_or(1);
    let dtype = dst.dtype();
    if !DType::KV_CACHE.contains(&dtype) || (src.dtype() != DType::F32 && src.dtype() != dtype) {
        return Err(Error::unsupported(format!(
            "write_rows: {} rows into a {dtype} tensor (a KV cache is f32, f16, bf16 or q8_0, \
             written from f32 or its own type)",
            src.dtype()
        )));
    }
    if src_row != dst_row {
        return Err(Error::shape(format!(
            "write_rows: {} into {}",
            src.shape(),
            dst.shape()
        )));
    }
    let positions = indices(pos, rows, dst_rows, "write_rows positions", |p| {
        Error::shape(format!(
            "write_rows: row {p} is outside the {dst_rows} rows of the destination"
        ))
    })?;
    let row_bytes = dtype.row_bytes(dst_row)?;
    // From F32 each row is encoded; from the cache's own type copied.
    let values = if src.dtype() == dtype {
        None
    } else {
        Some(f32s(src)?)
    };
    let s = storage(src)?.bytes()?;
    let d = storage_mut(dst)?.bytes_mut()?;
    if row_bytes == 0 {
        return Ok(());
    }
    for (i, &p) in positions.iter().enumerate() {
        let out = &mut d[p as usize * row_bytes..][..row_bytes];
        match values {
            Some(v) => quant::quantize_into(dtype, &v[i * dst_row..][..dst_row], out)?,
            None => out.copy_from_slice(&s[i * row_bytes..][..row_bytes]),
        }
    }
    Ok(())
}

/// The first index of each row's largest value. NaN never wins (unless first), as in
/// the sampler's argmax, so that greedy decoding on the device and on the host agree.
pub(crate) fn argmax(x: &Tensor, out: &mut Tensor) -> Result<()> {
    let &[rows, cols] = x.dims() else {
        return Err(Error::shape(format!(
            "argmax takes [rows, cols], got {}",
            x.shape()
        )));
    };
    if out.dims() != [rows] || cols == 0 || i32::try_from(cols).is_err() {
        return Err(Error::shape(format!(
            "argmax of {} into {}",
            x.shape(),
            out.shape()
        )));
    }
    let xs = f32s(x)?;
    for (row, o) in xs.chunks_exact(cols).zip(i32s_mut(out)?) {
        let mut best = 0;
        for (i, &v) in row.iter().enumerate() {
            if v > row[best] {
                best = i;
            }
        }
        *o = best as i32;
    }
    Ok(())
}

pub(crate) fn slice_cols(src: &Tensor, col0: usize, dst: &mut Tensor) -> Result<()> {
    let (&[n, cols], &[dn, dcols]) = (src.dims(), dst.dims()) else {
        return Err(Error::shape(format!(
            "slice_cols takes 2-D tensors, got {} and {}",
            src.shape(),
            dst.shape()
        )));
    };
    if n != dn || col0 + dcols > cols {
        return Err(Error::shape(format!(
            "slice_cols: columns {col0}..{} of {} into {}",
            col0 + dcols,
            src.shape(),
            dst.shape()
        )));
    }
    let s = f32s(src)?;
    let d = f32s_mut(dst)?;
    if dcols == 0 {
        return Ok(());
    }
    for (row, out) in d.chunks_exact_mut(dcols).enumerate() {
        out.copy_from_slice(&s[row * cols + col0..][..dcols]);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every 97th f32 bit pattern between −87 and 88 (and the edges): within 2 ulp of the
    /// f64 exponential, and 0 / finite outside.
    #[test]
    fn exp_is_within_two_ulp() {
        let mut worst = 0f64;
        let mut bits = (-87.0f32).to_bits();
        let mut check = |x: f32| {
            let want = (x as f64).exp();
            let got = exp(x) as f64;
            let ulp = (want as f32).next_up() as f64 - want as f32 as f64;
            worst = worst.max((got - want).abs() / ulp);
        };
        // Negative side: bit patterns of −87..−0 descend as bits fall.
        while bits > (-0.0f32).to_bits() {
            check(f32::from_bits(bits));
            bits -= 97;
        }
        let mut x = 0f32;
        while x < 88.0 {
            check(x);
            x = f32::from_bits(x.to_bits() + 97);
        }
        assert!(worst <= 2.0, "worst error {worst} ulp");
        assert_eq!(exp(-100.0), 0.0);
        assert!(exp(100.0).is_finite() && exp(100.0) > 1e38);
        assert_eq!(exp(0.0), 1.0);
    }

    #[test]
    fn silu_matches_definition() {
        for i in -2000..2000 {
            let x = i as f32 * 0.05;
            let want = x as f64 / (1.0 + (-(x as f64)).exp());
            assert!(
                (silu(x) as f64 - want).abs() <= 1e-6 * want.abs().max(1e-3),
                "silu({x}) = {}, want {want}",
                silu(x)
            );
        }
    }
}
