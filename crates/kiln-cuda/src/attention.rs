//! Causal grouped-query attention over the KV cache (kernels/attention.cu): one sequence's
//! contiguous cache, or a pool of blocks shared by a server's sequences.
//!
//! Prompts: one block per (tile of queries, KV head), whole key range; on tensor cores
//! where attention_tc.rs has a kernel (f16 caches, or f32 ones under rounded products; heads of 64 or 128), else on CUDA
//! cores. Queries on their own (decode, a server's paged rows) with heads of 64, 128 or
//! 256: one block per (query, KV head, piece of the key range), keys read into registers
//! (`attention_decode_*`); other head sizes take the prompt kernel with one query a tile.
//! A paged batch whose runs (`Pages::runs`) include prompt chunks of more than
//! [`SPLIT_MAX_QUERIES`] rows sends those to the tensor-core kernel in tiles of one
//! sequence, and its other rows (decodes, short tails), by a row list, to the decode
//! kernel. The key range is split
//! over the whole cache capacity or the longest block table (not the current length, so
//! a recorded step's launch shape stays valid as the sequence grows; pieces past the
//! current position end at once), and `attention_combine` merges the pieces.

use crate::attention_tc::{self, TcLaunch};
use crate::driver_error;
use crate::kernels::{Arg, LaunchNeed};
use crate::{expect, ptr, to_i32, CudaBackend};
use cudarc::driver::result;
use kiln_core::{AttentionParams, DType, Error, Pages, Result, Tensor};

/// Keys per split-K piece in decode: two chunks of 32 per block keeps each block's
/// chain of loads short; more pieces only add to the (cheap) merge.
const SPAN: usize = 64;
/// The most pieces a decode step's key range is split into.
const MAX_SPLITS: usize = 128;
/// Queries up to which the key range is split.
const SPLIT_MAX_QUERIES: usize = 8;
/// Queries of a paged batch up to which the key range is split: with more, the (query,
/// KV head) blocks fill the GPU's 132 SMs several times over.
const PAGED_SPLIT_MAX_QUERIES: usize = 64;

/// The most query heads a KV head may have: one block holds them all.
const MAX_GROUP: usize = 32;

/// Warps per block that query tiles aim at.
const TILE_WARPS: usize = 16;

/// The attention kernels of one KV type, by output dimensions per lane (1..8) and
/// queries per warp (1, 2).
macro_rules! kernels_of {
    ($kv:literal) => {
        [
            [
                concat!("attention_", $kv, "_1_1"),
                concat!("attention_", $kv, "_1_2"),
            ],
            [
                concat!("attention_", $kv, "_2_1"),
                concat!("attention_", $kv, "_2_2"),
            ],
            [
                concat!("attention_", $kv, "_3_1"),
                concat!("attention_", $kv, "_3_2"),
            ],
            [
                concat!("attention_", $kv, "_4_1"),
                concat!("attention_", $kv, "_4_2"),
            ],
            [
                concat!("attention_", $kv, "_5_1"),
                concat!("attention_", $kv, "_5_2"),
            ],
            [
                concat!("attention_", $kv, "_6_1"),
                concat!("attention_", $kv, "_6_2"),
            ],
            [
                concat!("attention_", $kv, "_7_1"),
                concat!("attention_", $kv, "_7_2"),
            ],
            [
                concat!("attention_", $kv, "_8_1"),
                concat!("attention_", $kv, "_8_2"),
            ],
        ]
    };
}

/// The decode kernels (kernels/attention.cu, `attention_decode_body`) by KV type and head
/// size: [`DECODE_HEAD_DIMS`].
const DECODE_KERNELS: [[&str; 3]; 4] = [
    [
        "attention_decode_f32_64",
        "attention_decode_f32_128",
        "attention_decode_f32_256",
    ],
    [
        "attention_decode_f16_64",
        "attention_decode_f16_128",
        "attention_decode_f16_256",
    ],
    [
        "attention_decode_bf16_64",
        "attention_decode_bf16_128",
        "attention_decode_bf16_256",
    ],
    [
        "attention_decode_q8_0_64",
        "attention_decode_q8_0_128",
        "attention_decode_q8_0_256",
    ],
];
const DECODE_HEAD_DIMS: [usize; 3] = [64, 128, 256];
/// Heads of a group a decode warp scores.
const DECODE_HEADS_PER_WARP: usize = 4;
/// Warps of a decode block, at least (key slots times head sets).
const DECODE_WARPS: usize = 4;

/// By KV type (in the order of [`DType::KV_CACHE`]), output dimensions per lane and
/// queries per warp.
const KERNELS: [[[&str; 2]; 8]; 4] = [
    kernels_of!("f32"),
    kernels_of!("f16"),
    kernels_of!("bf16"),
    kernels_of!("q8_0"),
];

/// The index of a KV cache type in [`DType::KV_CACHE`] (and in the kernel tables named by
/// it), or an error for another type.
pub(crate) fn kv_index(dtype: DType) -> Result<usize> {
    DType::KV_CACHE
        .iter()
        .position(|&d| d == dtype)
        .ok_or_else(|| {
            Error::unsupported(format!(
                "a KV cache of {dtype} (the KV cache types are f32, f16, bf16 and q8_0)"
            ))
        })
}

/// Queries per warp and query tiles of a block for `n` queries of `group` heads a KV
/// head, where the kernels for 1 and 2 queries a warp run at most `max_warps` warps a
/// block. A block holds group * tiles warps sharing each chunk of keys; a warp takes
/// `per_warp` queries of one head: two for prompts, so that each key and value read from
/// shared memory serves both, where a group fits in [`TILE_WARPS`] warps and that
/// kernel runs them (the 1-query kernels are checked at load to hold a group of
/// [`MAX_GROUP`]). A block takes at most 32 queries either way.
fn block_shape(n: usize, group: usize, max_warps: [usize; 2]) -> (usize, usize) {
    let per_warp = if n > SPLIT_MAX_QUERIES && group <= max_warps[1].min(TILE_WARPS) {
        2
    } else {
        1
    };
    let tiles = (TILE_WARPS / group)
        .min(max_warps[per_warp - 1] / group)
        .max(1)
        .min(n.div_ceil(per_warp));
    (per_warp, tiles)
}

/// [`block_shape`] for a paged batch, whose tiles must each lie in one run (a tile reads
/// one block table): the shortest run's shape, its tiles halved until every run starts on
/// a tile boundary; one query a tile where none does.
fn run_tile_shape(runs: &[usize], group: usize, max_warps: [usize; 2]) -> (usize, usize) {
    let shortest = runs.iter().copied().min().unwrap_or(1);
    let (per_warp, mut tiles) = block_shape(shortest, group, max_warps);
    let starts: Vec<usize> = runs
        .iter()
        .scan(0, |at, &r| {
            let start = *at;
            *at += r;
            Some(start)
        })
        .collect();
    loop {
        if starts.iter().all(|s| s % (per_warp * tiles) == 0) {
            return (per_warp, tiles);
        }
        if tiles == 1 {
            return (1, 1);
        }
        tiles /= 2;
    }
}

/// Dynamic shared memory of a block: a chunk of 32 keys (rows padded by 4) and of 32
/// values, and the block's `queries`, of `d` dimensions each.
fn shared_bytes(d: usize, queries: usize) -> usize {
    (32 * (d + 4) + 32 * d + queries * d) * 4
}

/// What the launch code above needs of an attention kernel (see `kernels::launch_need`):
/// the 1-query kernels blocks of a whole [`MAX_GROUP`]; the 2-query kernels one warp (a
/// group their blocks cannot hold goes to the 1-query kernel); both, shared memory for
/// heads of their largest size and the most queries a block takes (32 either way).
pub(crate) fn launch_need(name: &str) -> Option<LaunchNeed> {
    if name == "attention_combine" {
        // A thread a dimension of heads up to 256; a weight a split.
        return Some(LaunchNeed {
            threads: 256,
            dynamic_shared: (MAX_SPLITS * 4) as u32,
        });
    }
    if let Some(d) = DECODE_KERNELS
        .iter()
        .find_map(|by_d| by_d.iter().position(|&k| k == name))
    {
        // Blocks of a whole group of MAX_GROUP heads in sets of four.
        let (threads, shared) = decode_block(DECODE_HEAD_DIMS[d], MAX_GROUP);
        return Some(LaunchNeed {
            threads,
            dynamic_shared: shared,
        });
    }
    let (dv, per_warp) = KERNELS
        .iter()
        .flat_map(|by_dv| by_dv.iter().enumerate())
        .find_map(|(i, pair)| {
            pair.iter()
                .position(|&k| k == name)
                .map(|qw| (i + 1, qw + 1))
        })?;
    Some(LaunchNeed {
        threads: if per_warp == 1 {
            32 * MAX_GROUP as u32
        } else {
            32
        },
        dynamic_shared: shared_bytes(32 * dv, MAX_GROUP) as u32,
    })
}

/// Threads and dynamic shared memory of a decode block for heads of `d` dimensions and
/// `group` query heads a KV head: head sets of four, each with enough key slots that the
/// block has [`DECODE_WARPS`] warps; each warp's (max, sum, output) of four heads in
/// shared memory.
fn decode_block(d: usize, group: usize) -> (u32, u32) {
    let sets = group.div_ceil(DECODE_HEADS_PER_WARP);
    let warps = sets * (DECODE_WARPS / sets).max(1);
    (
        (32 * warps) as u32,
        (warps * DECODE_HEADS_PER_WARP * (d + 2) * 4) as u32,
    )
}

pub(crate) fn attention(
    b: &CudaBackend,
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    pos: &Tensor,
    params: &AttentionParams,
    out: &mut Tensor,
) -> Result<()> {
    run(b, q, k_cache, v_cache, pos, None, params, out)
}

/// [`attention`] over a pool of blocks shared by many sequences (see [`Pages`]): one
/// query a block (a tile's queries share the keys they load, and neighbouring rows may be
/// other sequences), the key range split as for decode up to the longest table's
/// positions. Table entries outside the pool hide their keys (the kernel cannot report
/// them mid-step).
#[allow(clippy::too_many_arguments)]
pub(crate) fn paged_attention(
    b: &CudaBackend,
    q: &Tensor,
    k_pool: &Tensor,
    v_pool: &Tensor,
    pos: &Tensor,
    pages: &Pages,
    params: &AttentionParams,
    out: &mut Tensor,
) -> Result<()> {
    let paged = paged_of(pages, k_pool, pos)?;
    run(b, q, k_pool, v_pool, pos, Some(&paged), params, out)
}

/// `pages` checked against the pool and the queries' positions, as the kernels take it.
fn paged_of<'a>(pages: &Pages<'a>, k_pool: &Tensor, pos: &Tensor) -> Result<Paged<'a>> {
    expect(pages.seq, DType::I32, "query sequences")?;
    expect(pages.tables, DType::I32, "block tables")?;
    let &[_, max_blocks] = pages.tables.dims() else {
        return Err(Error::shape(format!(
            "block tables must be [sequences, max_blocks], got {}",
            pages.tables.shape()
        )));
    };
    let rows = k_pool.dims().first().copied().unwrap_or(0);
    if pages.block == 0 || !rows.is_multiple_of(pages.block) || pages.seq.dims() != pos.dims() {
        return Err(Error::shape(format!(
            "paged attention: a pool of {rows} rows in blocks of {}, sequences {} for positions {}",
            pages.block,
            pages.seq.shape(),
            pos.shape()
        )));
    }
    if pages.runs.iter().sum::<usize>() != pos.shape().numel() {
        return Err(Error::shape(format!(
            "paged attention: runs of {} rows for {} queries",
            pages.runs.iter().sum::<usize>(),
            pos.shape().numel()
        )));
    }
    Ok(Paged {
        seq: ptr(pages.seq)?,
        tables: ptr(pages.tables)?,
        max_blocks,
        block: pages.block,
        runs: pages.runs,
    })
}

/// Training's forward of a paged attention over the operands the tape keeps for the
/// backward (`GradOps::paged_attention_saving`): q, k and v rounded already (bf16 or
/// f16), on tensor cores (attention_tc.cu's kept kernels), with each row's log-sum-exp
/// (log2 units) into `lse` and the output rounded into `out_half` besides `out`. False,
/// having done nothing, where those kernels do not serve: another head size or group,
/// a GPU before sm_80, or runs of a few rows (decode-shaped).
#[allow(clippy::too_many_arguments)]
pub(crate) fn paged_kept(
    b: &CudaBackend,
    q: &Tensor,
    k_pool: &Tensor,
    v_pool: &Tensor,
    pos: &Tensor,
    pages: &Pages,
    params: &AttentionParams,
    out: &mut Tensor,
    lse: &mut Tensor,
    out_half: &mut Tensor,
) -> Result<bool> {
    let half = q.dtype();
    for (t, what) in [
        (k_pool, "keys"),
        (v_pool, "values"),
        (&*out_half, "rounded output"),
    ] {
        if t.dtype() != half {
            return Err(Error::unsupported(format!(
                "attention over kept operands: {half} queries and {} {what}",
                t.dtype()
            )));
        }
    }
    expect(out, DType::F32, "attention output")?;
    expect(lse, DType::F32, "attention log-sum-exp")?;
    let (&[n, heads, d], &[_, kv_heads, kd]) = (q.dims(), k_pool.dims()) else {
        return Err(Error::shape(format!(
            "attention over kept operands: q {}, pool {}",
            q.shape(),
            k_pool.shape()
        )));
    };
    if kd != d
        || v_pool.dims() != k_pool.dims()
        || out.dims() != q.dims()
        || out_half.dims() != q.dims()
        || lse.shape().numel() != n * heads
        || kv_heads == 0
        || !heads.is_multiple_of(kv_heads)
    {
        return Err(Error::shape(format!(
            "attention over kept operands: q {}, pools {}, output {}, lse {}",
            q.shape(),
            k_pool.shape(),
            out.shape(),
            lse.shape()
        )));
    }
    let Some(kernel) = attention_tc::kept_kernel(b, half, d, heads / kv_heads) else {
        return Ok(false);
    };
    if pages.runs.iter().any(|&r| r <= SPLIT_MAX_QUERIES) {
        return Ok(false);
    }
    expect(pos, DType::I32, "attention positions")?;
    if pos.shape().numel() != n {
        return Err(Error::shape(format!(
            "attention over kept operands: {} positions for {n} queries",
            pos.shape().numel()
        )));
    }
    let paged = paged_of(pages, k_pool, pos)?;
    if n == 0 {
        return Ok(true);
    }
    let (qt, _) = attention_tc::block_shape(heads / kv_heads);
    let (_, tiles) = attention_tc::split_runs(pages.runs, SPLIT_MAX_QUERIES, qt);
    let words: Vec<u8> = tiles
        .iter()
        .flatten()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let list = upload_rows(b, words)?;
    let launch = TcLaunch {
        q,
        k_cache: k_pool,
        v_cache: v_pool,
        pos,
        paged: Some((paged.seq, paged.tables, paged.max_blocks, paged.block)),
        cap: k_pool.dims()[0],
        heads,
        kv_heads,
        d,
    };
    let kept = Some((ptr(lse)?, ptr(out_half)?));
    attention_tc::launch(
        b,
        kernel,
        &launch,
        Some((list, tiles.len())),
        params,
        kept,
        out,
    )?;
    Ok(true)
}

/// A paged launch's tables (device pointers) and their sizes, and its rows' runs.
struct Paged<'a> {
    seq: u64,
    tables: u64,
    max_blocks: usize,
    block: usize,
    runs: &'a [usize],
}

#[allow(clippy::too_many_arguments)]
fn run(
    b: &CudaBackend,
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    pos: &Tensor,
    paged: Option<&Paged>,
    params: &AttentionParams,
    out: &mut Tensor,
) -> Result<()> {
    expect(q, DType::F32, "attention queries")?;
    expect(out, DType::F32, "attention output")?;
    let kv = kv_index(k_cache.dtype())?;
    if v_cache.dtype() != k_cache.dtype() {
        return Err(Error::unsupported(format!(
            "attention over a {} key cache and a {} value cache (one type for both)",
            k_cache.dtype(),
            v_cache.dtype()
        )));
    }
    let kernels = &KERNELS[kv];
    expect(pos, DType::I32, "attention positions")?;
    let (&[n, heads, d], &[cap, kv_heads, kd]) = (q.dims(), k_cache.dims()) else {
        return Err(Error::shape(format!(
            "attention wants q [n, heads, head_dim] and caches [capacity, kv_heads, head_dim], got {} and {}",
            q.shape(),
            k_cache.shape()
        )));
    };
    if kd != d
        || v_cache.shape() != k_cache.shape()
        || out.shape() != q.shape()
        || pos.shape().numel() != n
        || kv_heads == 0
        || !heads.is_multiple_of(kv_heads)
    {
        return Err(Error::shape(format!(
            "attention: q {}, caches {} / {}, positions {}, output {}",
            q.shape(),
            k_cache.shape(),
            v_cache.shape(),
            pos.shape(),
            out.shape()
        )));
    }
    if n == 0 {
        return Ok(());
    }
    let group = heads / kv_heads;
    if group > MAX_GROUP {
        return Err(Error::unsupported(format!(
            "attention with {group} query heads per KV head (at most {MAX_GROUP})"
        )));
    }
    let operands = Operands {
        q,
        k_cache,
        v_cache,
        pos,
        paged,
        cap,
        heads,
        kv_heads,
        d,
    };
    let tc = attention_tc::kernel(b, k_cache.dtype(), d, group);
    let decode_kernel = DECODE_HEAD_DIMS
        .iter()
        .position(|&x| x == d)
        .map(|i| DECODE_KERNELS[kv][i]);
    // A server's prompt chunks in tiles on tensor cores, its decodes (and runs of a few
    // rows) beside them.
    if let (Some(p), Some(tc), Some(dk)) = (paged, tc, decode_kernel) {
        if p.runs.iter().any(|&r| r > SPLIT_MAX_QUERIES) {
            return paged_runs(b, tc, dk, &operands, p, params, out);
        }
    }
    // Queries on their own (a server's batch, a few tokens of decode) go to the decode
    // kernel where it has their head size; a prompt's tiles share their key reads, and so
    // do those of a paged batch of prompts alone (training's micro-batch over F32).
    let prompts_only = paged.is_some_and(|p| p.runs.iter().all(|&r| r > SPLIT_MAX_QUERIES));
    if (paged.is_some() && !prompts_only) || n <= SPLIT_MAX_QUERIES {
        if let Some(dk) = decode_kernel {
            let reach = paged.map_or(cap, |p| p.max_blocks * p.block);
            return decode(b, dk, reach, &operands, None, params, out);
        }
    }
    if let (None, Some(tc)) = (paged, tc) {
        return attention_tc::launch(b, tc, &operands.tc(), None, params, None, out);
    }
    let dv = d.div_ceil(32);
    if dv == 0 || dv > kernels.len() {
        return Err(Error::unsupported(format!(
            "attention heads of {d} dimensions (at most 256)"
        )));
    }
    let max_warps = [
        b.kernels.max_threads(kernels[dv - 1][0])? as usize / 32,
        b.kernels.max_threads(kernels[dv - 1][1])? as usize / 32,
    ];
    let (per_warp, tiles) = match paged {
        Some(p) => run_tile_shape(p.runs, group, max_warps),
        None => block_shape(n, group, max_warps),
    };
    let (qt, rows) = (tiles * per_warp, group * tiles);
    let shared = shared_bytes(d, rows * per_warp);
    // The positions a query may see: the cache's, or the longest block table's.
    let reach = paged.map_or(cap, |p| p.max_blocks * p.block);
    // A paged batch splits its keys while its queries alone would leave the GPU idle (a
    // server's decodes); a batch of prompt chunks has queries enough.
    let split = n <= SPLIT_MAX_QUERIES || (paged.is_some() && n <= PAGED_SPLIT_MAX_QUERIES);
    let (splits, span) = if split && reach > SPAN {
        // Long caches get longer pieces: at most MAX_SPLITS to merge.
        let span = SPAN.max(reach.div_ceil(MAX_SPLITS).next_multiple_of(32));
        (reach.div_ceil(span), span)
    } else {
        (1, reach.max(1))
    };
    launch_split(
        b,
        kernels[dv - 1][per_warp - 1],
        None,
        (
            to_i32(n.div_ceil(qt), "query tiles")? as u32,
            rows as u32,
            shared as u32,
        ),
        &operands,
        splits,
        &[
            Arg::I32(d as i32),
            Arg::F32(params.scale),
            Arg::F32(params.softcap.unwrap_or(0.0)),
            Arg::I32(params.window.map_or(0, |w| w.min(i32::MAX as usize) as i32)),
            Arg::I32(qt as i32),
            Arg::I32(to_i32(span, "capacity")?),
        ],
        out,
    )
}

/// What both attention kernels read and where their keys are.
struct Operands<'a> {
    q: &'a Tensor,
    k_cache: &'a Tensor,
    v_cache: &'a Tensor,
    pos: &'a Tensor,
    paged: Option<&'a Paged<'a>>,
    /// Rows of the cache (or the pool).
    cap: usize,
    heads: usize,
    kv_heads: usize,
    d: usize,
}

impl Operands<'_> {
    fn tc(&self) -> TcLaunch<'_> {
        TcLaunch {
            q: self.q,
            k_cache: self.k_cache,
            v_cache: self.v_cache,
            pos: self.pos,
            paged: self.paged.map(|p| (p.seq, p.tables, p.max_blocks, p.block)),
            cap: self.cap,
            heads: self.heads,
            kv_heads: self.kv_heads,
            d: self.d,
        }
    }
}

/// A paged batch with prompt chunks among its rows: the chunks in tiles of one sequence on
/// tensor cores (`tc`), the other rows (decodes, short tails) by the decode kernel (`dk`)
/// through a row list. Both lists go to the device in one copy, made by the step's first
/// layer (the others find the same lists there).
fn paged_runs(
    b: &CudaBackend,
    tc: &'static str,
    dk: &'static str,
    o: &Operands,
    p: &Paged,
    params: &AttentionParams,
    out: &mut Tensor,
) -> Result<()> {
    let (qt, _) = attention_tc::block_shape(o.heads / o.kv_heads);
    let (singles, tiles) = attention_tc::split_runs(p.runs, SPLIT_MAX_QUERIES, qt);
    let words: Vec<u8> = singles
        .iter()
        .chain(tiles.iter().flatten())
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let base = upload_rows(b, words)?;
    if !singles.is_empty() {
        let reach = p.max_blocks * p.block;
        decode(b, dk, reach, o, Some((base, singles.len())), params, out)?;
    }
    let tile_list = (base + 4 * singles.len() as u64, tiles.len());
    attention_tc::launch(b, tc, &o.tc(), Some(tile_list), params, None, out)
}

/// `words` (a row or tile list) in the work buffer the tensor-core launches read, copied
/// only when it differs from what the buffer holds (the step's first layer copies it; the
/// others find it there); its address.
fn upload_rows(b: &CudaBackend, words: Vec<u8>) -> Result<u64> {
    let base = b.scratch("attention_rows", words.len())?;
    let mut uploaded = b.attention_rows.lock().expect("attention rows lock");
    if !matches!(uploaded.as_ref(), Some((at, w)) if *at == base && *w == words) {
        // From pageable memory the driver stages the bytes before returning; queued after
        // the kernels that read the buffer's last lists.
        b.bind()?;
        b.queued_other_work();
        unsafe { result::memcpy_htod_async(base, &words[..], b.stream.cu_stream()) }
            .map_err(driver_error)?;
        *uploaded = Some((base, words));
    }
    Ok(base)
}

/// Launch an attention kernel as (`name`, (blocks along the queries, warps a block,
/// dynamic shared memory)) over `splits` pieces of the key range, then merge the
/// pieces (`attention_combine`). Both kernels take the same arguments up to the KV heads
/// (queries, caches, positions, output, partials, int8 copy, f16 copy, tables, sizes);
/// `tail` are the kernel's own after them. `rows`: the decode kernel's row list (device
/// pointer and count), when it serves only those rows. With every query served the
/// output also goes out as the output projection reads it, instead of being rounded by a
/// launch of its own: as int8 rows for a few queries (the quantized matrix-vector
/// kernels), as f16 for more (the tensor-core products; BF16 weights round again).
#[allow(clippy::too_many_arguments)]
fn launch_split(
    b: &CudaBackend,
    name: &'static str,
    rows: Option<(u64, usize)>,
    (blocks, warps, shared): (u32, u32, u32),
    o: &Operands,
    splits: usize,
    tail: &[Arg],
    out: &mut Tensor,
) -> Result<()> {
    let (heads, d) = (o.heads, o.d);
    let n = rows.map_or(o.q.dims()[0], |(_, count)| count);
    let part = if splits > 1 {
        b.scratch("attention_partials", splits * n * heads * (d + 2) * 4)?
    } else {
        0
    };
    let out_ptr = ptr(out)?;
    let int8 = (rows.is_none() && crate::matmul::reads_int8(n, heads * d) && d.is_multiple_of(32))
        .then(|| crate::matmul::quantized_x(b, n * heads * d))
        .transpose()?;
    let [xq, xd] = int8.unwrap_or([Arg::Ptr(0), Arg::Ptr(0)]);
    let width = heads * d;
    // The output projection's type is not known here: F16 and BF16 weights read f16 from
    // two rows on, every other type but F32 later, so those rows write the copy.
    let half = (rows.is_none() && crate::matmul::reads_half(n, width, DType::F16))
        .then(|| crate::matmul::rounded_input_buffer(b, n * width, false))
        .transpose()?;
    let mut args = vec![
        Arg::Ptr(ptr(o.q)?),
        Arg::Ptr(ptr(o.k_cache)?),
        Arg::Ptr(ptr(o.v_cache)?),
        Arg::Ptr(ptr(o.pos)?),
        Arg::Ptr(out_ptr),
        Arg::Ptr(part),
        xq,
        xd,
        Arg::Ptr(half.unwrap_or(0)),
        Arg::Ptr(o.paged.map_or(0, |p| p.seq)),
        Arg::Ptr(o.paged.map_or(0, |p| p.tables)),
        Arg::I32(to_i32(
            o.paged.map_or(0, |p| p.max_blocks),
            "blocks a table holds",
        )?),
        Arg::I32(to_i32(o.paged.map_or(1, |p| p.block), "block positions")?),
        Arg::I32(to_i32(o.cap, "KV rows")?),
        Arg::I32(n as i32),
        Arg::I32(heads as i32),
        Arg::I32(o.kv_heads as i32),
    ];
    args.extend_from_slice(tail);
    b.launch(
        name,
        (blocks, o.kv_heads as u32, splits as u32),
        (32, warps, 1),
        shared,
        &args,
    )?;
    if splits > 1 {
        b.launch(
            "attention_combine",
            (to_i32(n * heads, "rows")? as u32, 1, 1),
            (32 * d.div_ceil(32) as u32, 1, 1),
            (splits * 4) as u32,
            &[
                Arg::Ptr(part),
                Arg::Ptr(out_ptr),
                xq,
                xd,
                Arg::Ptr(half.unwrap_or(0)),
                Arg::I32(n as i32),
                Arg::I32(heads as i32),
                Arg::I32(d as i32),
                Arg::I32(splits as i32),
                Arg::Ptr(rows.map_or(0, |(p, _)| p)),
            ],
        )?;
    }
    if let Some(int8) = int8 {
        b.note_int8_copy(out, int8)?;
    }
    if let Some(dst) = half {
        b.note_rounded_copy(out_ptr, n * width, false, dst);
    }
    Ok(())
}

/// Key range pieces and their length for a decode launch of `pairs` (query, KV head)
/// blocks over `reach` positions: as many pieces as fit in one `wave` (the blocks the GPU
/// runs at once), of at least [`SPAN`] keys, at most [`MAX_SPLITS`]. One wave,
/// not more: a block's reads are a chain, so a second wave's blocks and the merge of
/// more pieces cost more than the shorter chains save (a server's 64-row step of llama3-8b
/// on an H200, 512 blocks: 8,800 tok/s in one piece, 8,550 in two, 8,340 in four).
fn decode_splits(pairs: usize, reach: usize, wave: usize) -> (usize, usize) {
    let splits = (wave / pairs.max(1))
        .min(reach.div_ceil(SPAN))
        .clamp(1, MAX_SPLITS);
    let span = reach.div_ceil(splits).next_multiple_of(32).max(1);
    (reach.div_ceil(span).max(1), span)
}

/// A decode launch of `name` over keys up to `reach` positions (the cache's, or the
/// longest block table's), for every query or those of a row list (see [`launch_split`]).
fn decode(
    b: &CudaBackend,
    name: &'static str,
    reach: usize,
    o: &Operands,
    rows: Option<(u64, usize)>,
    params: &AttentionParams,
    out: &mut Tensor,
) -> Result<()> {
    let n = rows.map_or(o.q.dims()[0], |(_, count)| count);
    let (threads, shared) = decode_block(o.d, o.heads / o.kv_heads);
    let wave = b.sms * b.kernels.blocks_per_sm(name, threads, shared)?;
    let (splits, span) = decode_splits(n * o.kv_heads, reach, wave);
    launch_split(
        b,
        name,
        rows,
        (to_i32(n, "queries")? as u32, threads / 32, shared),
        o,
        splits,
        &[
            Arg::F32(params.scale),
            Arg::F32(params.softcap.unwrap_or(0.0)),
            Arg::I32(params.window.map_or(0, |w| w.min(i32::MAX as usize) as i32)),
            Arg::I32(to_i32(span, "capacity")?),
            Arg::Ptr(rows.map_or(0, |(p, _)| p)),
        ],
        out,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A paged batch's tiles never cross from one run into the next.
    #[test]
    fn run_tiles_stay_in_their_runs() {
        for runs in [
            vec![1024, 1024, 1024],
            vec![9, 9, 9],
            vec![16, 48, 40],
            vec![33, 31],
            vec![12, 64],
        ] {
            for group in [1, 2, 4, 8] {
                let (per_warp, tiles) = run_tile_shape(&runs, group, [32, 32]);
                let qt = per_warp * tiles;
                let mut start = 0;
                for &r in &runs {
                    assert_eq!(start % qt, 0, "runs {runs:?}, group {group}: tiles of {qt}");
                    start += r;
                }
                assert!(tiles * group <= TILE_WARPS.max(group), "{runs:?} {group}");
            }
        }
        // Long aligned runs keep the prompt shape.
        assert_eq!(
            run_tile_shape(&[1024; 4], 1, [32, 32]),
            block_shape(1024, 1, [32, 32])
        );
    }

    /// Whatever the group, query count and the kernels' register-bound limits (down to
    /// what the load check lets through), a block fits its kernel, holds whole groups
    /// and at most the 32 queries the shared-memory need was checked for.
    #[test]
    fn attention_blocks_fit_the_kernels_they_launch() {
        let least_qw2 = launch_need(KERNELS[0][7][1]).unwrap().threads as usize / 32;
        let qw1 = launch_need(KERNELS[0][7][0]).unwrap().threads as usize / 32;
        for max_qw2 in least_qw2..=32 {
            for group in 1..=MAX_GROUP {
                for n in 1..=80 {
                    let (per_warp, tiles) = block_shape(n, group, [qw1, max_qw2]);
                    let warps = group * tiles;
                    let limit = [qw1, max_qw2][per_warp - 1];
                    assert!(
                        warps <= limit && warps * per_warp <= MAX_GROUP && tiles >= 1,
                        "group {group}, {n} queries, limit {max_qw2}: {per_warp} x {tiles}"
                    );
                    assert!(per_warp == 1 || n > SPLIT_MAX_QUERIES);
                }
            }
        }
        // Prompts keep two queries a warp where the group fits 16 warps.
        assert_eq!(block_shape(100, 4, [32, 16]), (2, 4));
        assert_eq!(block_shape(100, 25, [32, 16]), (1, 1));
        assert_eq!(block_shape(100, 8, [32, 5]), (1, 2));
    }

    /// Decode blocks stay within the kernels' 256-thread bound for every group, and the
    /// pieces of a split key range cover it, each at least SPAN keys unless there is one.
    #[test]
    fn decode_launches_fit_and_cover_the_keys() {
        for group in 1..=MAX_GROUP {
            for d in DECODE_HEAD_DIMS {
                let (threads, shared) = decode_block(d, group);
                let need = launch_need(
                    DECODE_KERNELS[1][DECODE_HEAD_DIMS.iter().position(|&x| x == d).unwrap()],
                )
                .unwrap();
                assert!(
                    threads <= 256 && threads <= need.threads,
                    "group {group}: {threads}"
                );
                assert!(shared <= need.dynamic_shared);
                assert!(threads >= 32 * group.div_ceil(DECODE_HEADS_PER_WARP) as u32);
            }
        }
        for wave in [1, 528, 2048] {
            for pairs in [1, 8, 100, 512, 4096, 100_000] {
                for reach in [1, 31, 64, 65, 512, 700, 8192, 131_072] {
                    let (splits, span) = decode_splits(pairs, reach, wave);
                    assert!((1..=MAX_SPLITS).contains(&splits) && span % 32 == 0);
                    assert!(
                        splits * span >= reach && (splits - 1) * span < reach,
                        "{pairs} {reach}"
                    );
                    assert!(splits == 1 || span >= SPAN);
                }
            }
        }
        // A server's 64 decodes of 8 KV heads over 512 positions on an H200 (4 blocks of
        // 4 warps on each of 132 SMs): one piece; one sequence: 66 pieces of 64.
        assert_eq!(decode_splits(512, 512, 528), (1, 512));
        assert_eq!(decode_splits(8, 4224, 528), (66, 64));
    }

    #[test]
    fn every_attention_kernel_has_a_need() {
        for (kv, by_dv) in KERNELS.iter().enumerate() {
            for (i, pair) in by_dv.iter().enumerate() {
                for (qw, name) in pair.iter().enumerate() {
                    assert_eq!(
                        *name,
                        format!("attention_{}_{}_{}", DType::KV_CACHE[kv], i + 1, qw + 1)
                    );
                    let need = launch_need(name).unwrap();
                    assert_eq!(
                        need.dynamic_shared as usize,
                        shared_bytes(32 * (i + 1), MAX_GROUP)
                    );
                }
            }
        }
        assert_eq!(launch_need("attention_combine").unwrap().threads, 256);
        assert_eq!(launch_need("matvec_f16_1"), None);
    }

    /// Every kernel the tables name is in the source, once per KV type.
    #[test]
    fn the_kernel_source_defines_each_kv_type() {
        let source = include_str!("kernels/attention.cu");
        for kv in DType::KV_CACHE {
            let kernel = format!("ATTENTION_KV(KV_{}, {kv})", kv.name().to_uppercase());
            assert!(source.contains(&kernel), "{kernel}");
        }
    }
}
