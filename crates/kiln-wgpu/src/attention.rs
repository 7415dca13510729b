//! Rotary embeddings and causal attention over the KV cache, in any of its types: one
//! sequence's contiguous cache, or a pool of blocks shared by a server's sequences.

use crate::elementwise::count;
use crate::kernels::{ATTENTION, ATTENTION_COOP, ATTENTION_TILES, ROPE, ROPE_WRITE_KV};
use crate::kv_cache::kv_tensor;
use crate::{f32_tensor, i32_tensor, WgpuBackend};
use kiln_core::{AttentionParams, Error, Pages, Result, RopeLayout, Tensor};

/// Queries a workgroup of `attention_tiles` takes (shaders/attention.wgsl, `TQ`).
const TILE_QUERIES: usize = 16;
/// Its workgroup memory: q, k (padded) and v tiles and the scores.
const TILES_WORKGROUP_BYTES: usize = 4 * (2048 + 2064 + 2048 + 256);
/// Queries a workgroup of `attention_coop` takes (shaders/attention_coop.wgsl, `TQA`).
const COOP_QUERIES: usize = 64;
/// Its workgroup memory: the f16 tiles of q (then k and v), f32 scores, the f16
/// probabilities' two parts, the rows' sums.
const COOP_WORKGROUP_BYTES: usize = 2 * 8704 + 4 * 2304 + 2 * 2 * 2560 + 4 * 128;

pub(crate) fn rope(
    b: &WgpuBackend,
    x: &mut Tensor,
    pos: &Tensor,
    inv_freq: &Tensor,
    layout: RopeLayout,
) -> Result<()> {
    let &[tokens, heads, head_dim] = x.dims() else {
        return Err(Error::shape(format!(
            "rope takes [tokens, heads, head_dim], got {}",
            x.shape()
        )));
    };
    let half = inv_freq.shape().numel();
    if 2 * half > head_dim {
        return Err(Error::shape(format!(
            "rope: {half} frequencies rotate {} dimensions, heads have {head_dim}",
            2 * half
        )));
    }
    let bindings = [
        f32_tensor(x, "rope input")?,
        i32_tensor(pos, tokens, "rope positions")?,
        f32_tensor(inv_freq, "rope frequencies")?,
    ];
    let what = "rope";
    let pairs = tokens * heads * half;
    count(pairs, what)?;
    let (groups, groups_x) = b.grid(pairs.div_ceil(256))?;
    let kernel = b.kernel(&ROPE, &[])?;
    b.stream.dispatch(
        &kernel,
        &bindings,
        &[
            count(tokens, what)?,
            count(heads, what)?,
            count(head_dim, what)?,
            count(half, what)?,
            u32::from(layout == RopeLayout::Neox),
            groups_x,
        ],
        groups,
    )
}

pub(crate) fn attention(
    b: &WgpuBackend,
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    pos: &Tensor,
    p: &AttentionParams,
    out: &mut Tensor,
) -> Result<()> {
    run(b, q, k_cache, v_cache, pos, None, p, out)
}

/// [`attention`] over a pool of blocks shared by many sequences (see [`Pages`]): a
/// workgroup a query and head, reading keys and values through the query's block table;
/// table entries outside the pool hide their keys (the device cannot report them).
#[allow(clippy::too_many_arguments)]
pub(crate) fn paged_attention(
    b: &WgpuBackend,
    q: &Tensor,
    k_pool: &Tensor,
    v_pool: &Tensor,
    pos: &Tensor,
    pages: &Pages,
    p: &AttentionParams,
    out: &mut Tensor,
) -> Result<()> {
    let &[_, max_blocks] = pages.tables.dims() else {
        return Err(Error::shape(format!(
            "block tables must be [sequences, max_blocks], got {}",
            pages.tables.shape()
        )));
    };
    let rows = k_pool.dims().first().copied().unwrap_or(0);
    if pages.block == 0 || !rows.is_multiple_of(pages.block) || max_blocks == 0 {
        return Err(Error::shape(format!(
            "paged attention: a pool of {rows} rows in blocks of {}, tables {}",
            pages.block,
            pages.tables.shape()
        )));
    }
    run(b, q, k_pool, v_pool, pos, Some((pages, max_blocks)), p, out)
}

#[allow(clippy::too_many_arguments)]
fn run(
    b: &WgpuBackend,
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    pos: &Tensor,
    paged: Option<(&Pages, usize)>,
    p: &AttentionParams,
    out: &mut Tensor,
) -> Result<()> {
    let &[n, heads, hd] = q.dims() else {
        return Err(Error::shape(format!(
            "attention q must be [n, heads, head_dim], got {}",
            q.shape()
        )));
    };
    let &[capacity, kv_heads, kv_hd] = k_cache.dims() else {
        return Err(Error::shape(format!(
            "k cache must be [capacity, kv_heads, head_dim], got {}",
            k_cache.shape()
        )));
    };
    if v_cache.dims() != k_cache.dims() || out.dims() != q.dims() || kv_hd != hd {
        return Err(Error::shape(format!(
            "attention: q {}, k {}, v {}, out {}",
            q.shape(),
            k_cache.shape(),
            v_cache.shape(),
            out.shape()
        )));
    }
    if kv_heads == 0 || heads % kv_heads != 0 {
        return Err(Error::shape(format!(
            "{heads} query heads cannot share {kv_heads} KV heads"
        )));
    }
    if v_cache.dtype() != k_cache.dtype() {
        return Err(Error::unsupported(format!(
            "attention over a {} key cache and a {} value cache (one type for both)",
            k_cache.dtype(),
            v_cache.dtype()
        )));
    }
    let (k_binding, kv) = kv_tensor(k_cache, "k cache")?;
    let (v_binding, _) = kv_tensor(v_cache, "v cache")?;
    if hd > 256 {
        return Err(Error::shape(format!(
            "attention on wgpu takes heads of at most 256 dimensions, got {hd}"
        )));
    }
    if n == 0 || hd == 0 {
        return Ok(());
    }
    let (seq, tables) = match paged {
        Some((pages, max_blocks)) => (
            i32_tensor(pages.seq, n, "query sequences")?,
            i32_tensor(pages.tables, max_blocks, "block tables")?,
        ),
        // Unread by a contiguous cache's kernels; any buffer fills the slots.
        None => (
            i32_tensor(pos, n, "attention positions")?,
            i32_tensor(pos, n, "attention positions")?,
        ),
    };
    let bindings = [
        f32_tensor(q, "attention queries")?,
        k_binding,
        v_binding,
        i32_tensor(pos, n, "attention positions")?,
        f32_tensor(out, "attention output")?,
        seq,
        tables,
    ];
    let what = "attention";
    // Prompts: on tensor cores in tiles of 64 queries where the adapter has cooperative
    // matrices, the cache is f16 (whose keys and values the matrices take exactly) and
    // the heads fit (36.5 KiB of workgroup memory), else in tiles of 16
    // where the heads and workgroup memory fit (25.1 KiB); decode and the rest: a
    // workgroup a query and head.
    let prompt = paged.is_none() && n >= TILE_QUERIES && hd <= 128;
    let coop = prompt
        && b.caps.cooperative_matrices
        && k_cache.dtype() == kiln_core::DType::F16
        && hd.is_multiple_of(16)
        && b.caps.workgroup_memory as usize >= COOP_WORKGROUP_BYTES;
    let tiled =
        prompt && hd.is_multiple_of(4) && b.caps.workgroup_memory as usize >= TILES_WORKGROUP_BYTES;
    let (spec, tasks) = if coop {
        (&ATTENTION_COOP, n.div_ceil(COOP_QUERIES) * heads)
    } else if tiled {
        (&ATTENTION_TILES, n.div_ceil(TILE_QUERIES) * heads)
    } else {
        (&ATTENTION, n * heads)
    };
    let (groups, groups_x) = b.grid(tasks)?;
    let kernel = if coop {
        b.kernel(spec, &[("KV", kv), ("HD", hd as f64)])?
    } else {
        b.kernel(spec, &[("KV", kv)])?
    };
    // The shaders index the caches' values in u32.
    count(capacity * kv_heads * hd, what)?;
    b.stream.dispatch(
        &kernel,
        &bindings,
        &[
            count(n, what)?,
            count(heads, what)?,
            count(kv_heads, what)?,
            count(hd, what)?,
            count(capacity, what)?,
            p.scale.to_bits(),
            p.softcap.unwrap_or(0.0).to_bits(),
            count(p.window.unwrap_or(0).min(u32::MAX as usize), what)?,
            groups_x,
            count(paged.map_or(0, |(_, max_blocks)| max_blocks), what)?,
            count(paged.map_or(0, |(pages, _)| pages.block), what)?,
        ],
        groups,
    )
}

/// Rotate q and k in place and write k and v into the caches, in one dispatch.
#[allow(clippy::too_many_arguments)]
pub(crate) fn rope_write_kv(
    b: &WgpuBackend,
    q: &mut Tensor,
    k: &mut Tensor,
    v: &Tensor,
    pos: &Tensor,
    rope: Option<(&Tensor, RopeLayout)>,
    k_cache: &mut Tensor,
    v_cache: &mut Tensor,
) -> Result<()> {
    let (&[tokens, heads, hd], &[kt, kv_heads, khd]) = (q.dims(), k.dims()) else {
        return Err(Error::shape(format!(
            "rope_write_kv: q {} and k {} must be [tokens, heads, head_dim]",
            q.shape(),
            k.shape()
        )));
    };
    let &[capacity, ..] = k_cache.dims() else {
        return Err(Error::shape("rope_write_kv: an empty cache shape"));
    };
    if kt != tokens
        || khd != hd
        || v.dims() != k.dims()
        || k_cache.dims() != [capacity, kv_heads, hd]
        || v_cache.dims() != k_cache.dims()
    {
        return Err(Error::shape(format!(
            "rope_write_kv: q {}, k {}, v {}, caches {} and {}",
            q.shape(),
            k.shape(),
            v.shape(),
            k_cache.shape(),
            v_cache.shape()
        )));
    }
    let (half, neox) = match rope {
        Some((f, layout)) => {
            let half = f.shape().numel();
            if 2 * half > hd {
                return Err(Error::shape(format!(
                    "rope: {half} frequencies rotate {} dimensions, heads have {hd}",
                    2 * half
                )));
            }
            (half, layout == RopeLayout::Neox)
        }
        None => (0, false),
    };
    if hd > 256 {
        return Err(Error::shape(format!(
            "rope_write_kv on wgpu takes heads of at most 256 dimensions, got {hd}"
        )));
    }
    if v_cache.dtype() != k_cache.dtype() {
        return Err(Error::unsupported(format!(
            "rope_write_kv into a {} key cache and a {} value cache (one type for both)",
            k_cache.dtype(),
            v_cache.dtype()
        )));
    }
    let what = "rope_write_kv";
    let kb = f32_tensor(k, "keys")?;
    // Without rotation the frequencies are never read; v stands in for the binding.
    let freqs = match rope {
        Some((f, _)) => f32_tensor(f, "rope frequencies")?,
        None => f32_tensor(v, "values")?,
    };
    let bindings = [
        f32_tensor(q, "queries")?,
        kb,
        f32_tensor(v, "values")?,
        i32_tensor(pos, tokens, "positions")?,
        freqs,
        kv_tensor(k_cache, "k cache")?.0,
        kv_tensor(v_cache, "v cache")?.0,
    ];
    let kv = crate::kv_cache::kv_constant(k_cache.dtype())?;
    // Workgroups of 256 lanes over q's elements, then one a token's KV head.
    let q_groups = (tokens * heads * hd).div_ceil(256);
    count(tokens * heads * hd, what)?;
    count(capacity * kv_heads * hd, what)?;
    let (groups, groups_x) = b.grid(q_groups + tokens * kv_heads)?;
    let kernel = b.kernel(&ROPE_WRITE_KV, &[("KV", kv)])?;
    b.stream.dispatch(
        &kernel,
        &bindings,
        &[
            count(tokens, what)?,
            count(heads, what)?,
            count(kv_heads, what)?,
            count(hd, what)?,
            count(half, what)?,
            u32::from(neox),
            count(capacity, what)?,
            groups_x,
            count(q_groups, what)?,
        ],
        groups,
    )
}
