//! Causal (optionally windowed, soft-capped) grouped-query attention over a KV cache.
//!
//! The keys and values lie in one contiguous cache, or in blocks of a pool shared by many
//! sequences (a server's paged cache), as f32 or in a smaller type (f16, bf16, q8_0) whose
//! rows are decoded to f32 as they are read. One task per (token, head): scores against
//! every visible key, a softmax, then the weighted sum of values. Scores live in a per-task
//! buffer of the visible length.

use crate::dot;
#[cfg(target_arch = "x86_64")]
use crate::dot::Isa;
use crate::elementwise::exp;
use crate::pool::Pool;
use crate::{f32s, f32s_mut, i32s, indices, storage};
use kiln_core::{quant, AttentionParams, DType, Error, Pages, Result, Tensor};

pub(crate) fn attention(
    pool: &Pool,
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    pos: &Tensor,
    p: &AttentionParams,
    out: &mut Tensor,
) -> Result<()> {
    let shapes = Shapes::check(q, k_cache, v_cache, out)?;
    let capacity = shapes.capacity;
    let positions = indices(pos, shapes.n, capacity, "attention positions", |p| {
        Error::shape(format!(
            "position {p} is outside the KV cache capacity of {capacity}"
        ))
    })?;
    run(pool, &shapes, q, k_cache, v_cache, positions, None, p, out)
}

/// [`attention`] over a pool of KV blocks shared by many sequences (see
/// [`kiln_core::Pages`]). Every block a query reads is checked to lie in the pool.
#[allow(clippy::too_many_arguments)]
pub(crate) fn paged_attention(
    pool: &Pool,
    q: &Tensor,
    k_pool: &Tensor,
    v_pool: &Tensor,
    pos: &Tensor,
    pages: &Pages,
    p: &AttentionParams,
    out: &mut Tensor,
) -> Result<()> {
    let shapes = Shapes::check(q, k_pool, v_pool, out)?;
    let block = pages.block;
    let &[sequences, max_blocks] = pages.tables.dims() else {
        return Err(Error::shape(format!(
            "block tables must be [sequences, max_blocks], got {}",
            pages.tables.shape()
        )));
    };
    if block == 0 || shapes.capacity % block != 0 {
        return Err(Error::shape(format!(
            "a KV pool of {} rows is not whole blocks of {block}",
            shapes.capacity
        )));
    }
    let blocks = shapes.capacity / block;
    let positions = indices(
        pos,
        shapes.n,
        max_blocks * block,
        "attention positions",
        |p| {
            Error::shape(format!(
                "position {p} is past the {max_blocks} blocks of {block} a block table holds"
            ))
        },
    )?;
    let seq = indices(pages.seq, shapes.n, sequences, "query sequences", |s| {
        Error::shape(format!(
            "sequence {s} of a query has no block table (there are {sequences})"
        ))
    })?;
    let tables = i32s(pages.tables, "block tables")?;
    for (&s, &pos) in seq.iter().zip(positions) {
        let row = &tables[s as usize * max_blocks..][..pos as usize / block + 1];
        if let Some(&bad) = row
            .iter()
            .find(|&&b| usize::try_from(b).map_or(true, |b| b >= blocks))
        {
            return Err(Error::shape(format!(
                "block {bad} of sequence {s}'s table is outside the KV pool of {blocks} blocks"
            )));
        }
    }
    let paged = Paged {
        seq,
        tables,
        max_blocks,
        block,
    };
    run(
        pool,
        &shapes,
        q,
        k_pool,
        v_pool,
        positions,
        Some(&paged),
        p,
        out,
    )
}

/// The checked dimensions of an attention call.
struct Shapes {
    n: usize,
    heads: usize,
    kv_heads: usize,
    hd: usize,
    /// Rows of the key and value tensors.
    capacity: usize,
}

impl Shapes {
    fn check(q: &Tensor, k: &Tensor, v: &Tensor, out: &Tensor) -> Result<Shapes> {
        let &[n, heads, hd] = q.dims() else {
            return Err(Error::shape(format!(
                "attention q must be [n, heads, head_dim], got {}",
                q.shape()
            )));
        };
        let &[capacity, kv_heads, kv_hd] = k.dims() else {
            return Err(Error::shape(format!(
                "k cache must be [capacity, kv_heads, head_dim], got {}",
                k.shape()
            )));
        };
        if v.dims() != k.dims() || out.dims() != q.dims() || kv_hd != hd {
            return Err(Error::shape(format!(
                "attention: q {}, k {}, v {}, out {}",
                q.shape(),
                k.shape(),
                v.shape(),
                out.shape()
            )));
        }
        if kv_heads == 0 || heads % kv_heads != 0 {
            return Err(Error::shape(format!(
                "{heads} query heads cannot share {kv_heads} KV heads"
            )));
        }
        if v.dtype() != k.dtype() || !DType::KV_CACHE.contains(&k.dtype()) {
            return Err(Error::unsupported(format!(
                "attention over a {} key cache and a {} value cache (both f32, f16, bf16 or q8_0)",
                k.dtype(),
                v.dtype()
            )));
        }
        Ok(Shapes {
            n,
            heads,
            kv_heads,
            hd,
            capacity,
        })
    }
}

/// A paged cache's block tables, checked.
struct Paged<'a> {
    seq: &'a [i32],
    tables: &'a [i32],
    max_blocks: usize,
    block: usize,
}

#[allow(clippy::too_many_arguments)]
fn run(
    pool: &Pool,
    shapes: &Shapes,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    positions: &[i32],
    paged: Option<&Paged>,
    p: &AttentionParams,
    out: &mut Tensor,
) -> Result<()> {
    let Shapes {
        heads,
        kv_heads,
        hd,
        ..
    } = *shapes;
    let group = heads / kv_heads;
    let (qs, ks, vs) = (f32s(q)?, Stored::of(k)?, Stored::of(v)?);
    let o = f32s_mut(out)?;
    if hd == 0 {
        return Ok(());
    }
    pool.for_chunks_mut(o, hd, |task, o| {
        let (i, h) = (task / heads, task % heads);
        let pos = positions[i] as usize;
        let first = p.window.map_or(0, |w| (pos + 1).saturating_sub(w));
        let g = h / group;
        let rows = Rows {
            q: &qs[task * hd..][..hd],
            k: ks,
            v: vs,
            stride: kv_heads * hd,
            offset: g * hd,
            visible: first..pos + 1,
            table: paged.map(|pg| {
                let s = pg.seq[i] as usize;
                (&pg.tables[s * pg.max_blocks..][..pg.max_blocks], pg.block)
            }),
        };
        match dot::isa() {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the ISA was detected (see `dot::isa`).
            Isa::Avx512Vnni => unsafe { x86::head(&rows, p, o) },
            _ => head_with(&rows, p, o, dot),
        }
    });
    Ok(())
}

/// A cache's values as stored: F32 read in place, other types decoded a row at a time.
#[derive(Clone, Copy)]
enum Stored<'a> {
    F32(&'a [f32]),
    Encoded(DType, &'a [u8]),
}

impl<'a> Stored<'a> {
    fn of(t: &'a Tensor) -> Result<Self> {
        Ok(match t.dtype() {
            DType::F32 => Stored::F32(f32s(t)?),
            dtype => Stored::Encoded(dtype, storage(t)?.bytes()?),
        })
    }

    /// Elements `at..at + n` as f32: in place, or decoded into `buf` (`at` is a head's
    /// first element, so a whole number of blocks in; `n` a head's length).
    #[inline(always)]
    fn row<'b>(&'b self, at: usize, n: usize, buf: &'b mut [f32]) -> &'b [f32] {
        match *self {
            Stored::F32(values) => &values[at..][..n],
            Stored::Encoded(dtype, bytes) => {
                let (bs, bb) = (dtype.block_size(), dtype.block_bytes());
                let out = &mut buf[..n];
                let row = &bytes[at / bs * bb..][..n / bs * bb];
                quant::dequantize(dtype, row, out).expect("heads are whole blocks");
                out
            }
        }
    }

    /// A buffer for [`Stored::row`]: empty when rows are read in place.
    fn buffer(&self, hd: usize) -> Vec<f32> {
        match self {
            Stored::F32(_) => Vec::new(),
            Stored::Encoded(..) => vec![0.0; hd],
        }
    }
}

/// One query row and the cache rows it sees: key/value j is element `j·stride + offset`
/// on, `hd` of them.
struct Rows<'a> {
    q: &'a [f32],
    k: Stored<'a>,
    v: Stored<'a>,
    stride: usize,
    offset: usize,
    visible: std::ops::Range<usize>,
    /// A paged cache: the sequence's block table and the positions a block holds
    /// (position `j` is row `table[j / block] · block + j % block`); `None`: row `j`.
    table: Option<(&'a [i32], usize)>,
}

/// One (token, head) task: scores, softmax, weighted sum of values into `o`, with `dot`
/// for the scores. Written to vectorize: the exponential inline, no collecting iterators.
#[inline(always)]
fn head_with(r: &Rows, p: &AttentionParams, o: &mut [f32], dot: impl Fn(&[f32], &[f32]) -> f32) {
    let hd = r.q.len();
    let at = |j: usize| {
        let row = match r.table {
            Some((table, block)) => table[j / block] as usize * block + j % block,
            None => j,
        };
        row * r.stride + r.offset
    };
    // A plain loop, not `map().collect()`: the collecting function would be compiled
    // apart from this one, without the AVX-512 features of its caller.
    let mut scores = vec![0f32; r.visible.len()];
    let (mut kbuf, mut vbuf) = (r.k.buffer(hd), r.v.buffer(hd));
    for (s, j) in scores.iter_mut().zip(r.visible.clone()) {
        let v = dot(r.q, r.k.row(at(j), hd, &mut kbuf)) * p.scale;
        *s = match p.softcap {
            Some(cap) => cap * (v / cap).tanh(),
            None => v,
        };
    }
    let max = scores.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
    for s in scores.iter_mut() {
        *s = exp(*s - max);
    }
    let sum: f32 = scores.iter().sum();
    o.fill(0.0);
    for (s, j) in scores.iter().zip(r.visible.clone()) {
        let w = s / sum;
        let value = r.v.row(at(j), hd, &mut vbuf);
        o.iter_mut().zip(value).for_each(|(o, v)| *o += w * v);
    }
}

/// Σ a·b with 16 independent partial sums (vectorizes without reassociation).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..16 {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use std::arch::x86_64::*;

    /// [`super::head_with`] compiled for AVX-512 (it is inlined here), scores by FMA.
    ///
    /// # Safety
    /// AVX-512 F/BW/VL, AVX2 and FMA must be available.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    pub(super) unsafe fn head(r: &Rows, p: &AttentionParams, o: &mut [f32]) {
        head_with(r, p, o, |a, b| {
            let body = a.len() / 16 * 16;
            // SAFETY: AVX-512 F is enabled on the enclosing function; loads read 16
            // elements below `body` ≤ both lengths (`b` is a head row as long as `a`).
            let v = unsafe {
                let mut acc = _mm512_setzero_ps();
                for i in (0..body).step_by(16) {
                    let (x, y) = (
                        _mm512_loadu_ps(a.as_ptr().add(i)),
                        _mm512_loadu_ps(b.as_ptr().add(i)),
                    );
                    acc = _mm512_fmadd_ps(x, y, acc);
                }
                _mm512_reduce_add_ps(acc)
            };
            v + a[body..]
                .iter()
                .zip(&b[body..])
                .map(|(x, y)| x * y)
                .sum::<f32>()
        })
    }
}
