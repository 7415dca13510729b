//! Prompt-shaped attention on tensor cores (kernels/attention_tc.cu): a prompt over its
//! own cache, or a server's prompt chunks over the paged pool, in tiles of one sequence's
//! consecutive query rows, for f16 caches (the GPU default) and heads of 64 or 128. The
//! queries and probabilities go in as two f16 parts each, so results keep the f32
//! kernel's accuracy (attention.rs takes every other case). F32 caches (training's pool)
//! come here too when the F32 products were asked to round their inputs
//! (`GradOps::set_products`: TF32, BF16 or F16): then keys and values are rounded to f16
//! into work buffers first, and queries and probabilities go in rounded to f16 once, an
//! input rounding like TF32's.
//!
//! It replaced, for prompts, attention.cu's tile kernel (f32 arithmetic on CUDA cores,
//! 35% of an 8B model's 512-token prompt) and, for a server's prompt chunks, the decode
//! kernel, which read every key again for each query row.

use crate::blas::rounded_copy;
use crate::kernels::{Arg, LaunchNeed};
use crate::{ptr, to_i32, CudaBackend};
use kiln_core::{AttentionParams, DType, Products, Result, Tensor};

/// The kernels by cache type and head size.
const KERNELS: [(DType, usize, &str); 4] = [
    (DType::F16, 64, "attention_tc_64"),
    (DType::F16, 128, "attention_tc_128"),
    (DType::F32, 64, "attention_tc_once_64"),
    (DType::F32, 128, "attention_tc_once_128"),
];
/// Training's kernels over the kept (rounded) operands, by their type and head size.
const KEPT_KERNELS: [(DType, usize, &str); 4] = [
    (DType::F16, 64, "attention_tc_kept_f16_64"),
    (DType::F16, 128, "attention_tc_kept_f16_128"),
    (DType::BF16, 64, "attention_tc_kept_bf16_64"),
    (DType::BF16, 128, "attention_tc_kept_bf16_128"),
];
/// Keys a chunk holds (`ATC_KEYS`).
const KEYS: usize = 64;
/// Warps a block aims at: tiles of 16 rows are added until a block has this many.
const WARPS: usize = 4;
/// The most warps a block may have (the kernels' launch bound): the largest group.
const MAX_WARPS: usize = 8;

/// The kernel for a cache of `kv`, heads of `d` dimensions and `group` query heads a KV
/// head, if this GPU (sm_80 and later) has one: an F32 cache only while products round
/// their inputs.
pub(crate) fn kernel(b: &CudaBackend, kv: DType, d: usize, group: usize) -> Option<&'static str> {
    let rounded = kv == DType::F16 || (kv == DType::F32 && b.blas.f32_products() != Products::F32);
    if !rounded || group > MAX_WARPS || b.arch.0 < 8 {
        return None;
    }
    KERNELS
        .iter()
        .find(|&&(t, hd, _)| t == kv && hd == d)
        .map(|&(_, _, k)| k)
}

/// The kernel over kept operands of type `half` (bf16 or f16), heads of `d` and `group`
/// query heads a KV head, if this GPU (sm_80 and later) has one.
pub(crate) fn kept_kernel(
    b: &CudaBackend,
    half: DType,
    d: usize,
    group: usize,
) -> Option<&'static str> {
    if group > MAX_WARPS || b.arch.0 < 8 {
        return None;
    }
    KEPT_KERNELS
        .iter()
        .find(|&&(t, hd, _)| t == half && hd == d)
        .map(|&(_, _, k)| k)
}

/// Query rows a tile holds and warps a block has, for `group` heads a KV head.
pub(crate) fn block_shape(group: usize) -> (usize, usize) {
    let tiles = (WARPS / group).max(1);
    (16 * tiles, group * tiles)
}

/// Dynamic shared memory: two chunks of keys and of values, rows padded by
/// 8 halves, and a flag a key for each chunk.
fn shared_bytes(d: usize) -> usize {
    2 * 2 * KEYS * (d + 8) * 2 + 2 * KEYS * 4
}

/// What the launch code needs of a kernel of this file (see `kernels::launch_need`).
pub(crate) fn launch_need(name: &str) -> Option<LaunchNeed> {
    let &(_, d, _) = KERNELS
        .iter()
        .chain(&KEPT_KERNELS)
        .find(|&&(_, _, k)| k == name)?;
    Some(LaunchNeed {
        threads: 32 * MAX_WARPS as u32,
        dynamic_shared: shared_bytes(d) as u32,
    })
}

/// Where a launch's queries and keys are: the attention's operands as device pointers.
pub(crate) struct TcLaunch<'a> {
    pub q: &'a Tensor,
    pub k_cache: &'a Tensor,
    pub v_cache: &'a Tensor,
    pub pos: &'a Tensor,
    /// A paged pool's (sequence of each row, tables, blocks a table holds, positions a
    /// block holds), or none for one sequence's cache.
    pub paged: Option<(u64, u64, usize, usize)>,
    /// Rows of the cache or pool.
    pub cap: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub d: usize,
}

/// Launch `name` over `tiles` (device pointer and count of (first row, rows) pairs, each
/// within one sequence), or with none over the rows in order as one sequence's tiles.
/// `kept`: a kept kernel's log-sum-exp and rounded output (device pointers).
pub(crate) fn launch(
    b: &CudaBackend,
    name: &'static str,
    l: &TcLaunch,
    tiles: Option<(u64, usize)>,
    params: &AttentionParams,
    kept: Option<(u64, u64)>,
    out: &mut Tensor,
) -> Result<()> {
    let n = l.q.dims()[0];
    let (qt, warps) = block_shape(l.heads / l.kv_heads);
    let count = tiles.map_or(n.div_ceil(qt), |(_, c)| c);
    if count == 0 {
        return Ok(());
    }
    let (seq, tables, max_blocks, block) = l.paged.unwrap_or((0, 0, 0, 1));
    // An F32 cache as f16 (the kernels read f16 by cp.async, overlapping the products).
    let (k, v) = match l.k_cache.dtype() {
        DType::F32 => {
            let span = l.k_cache.shape().numel();
            (
                rounded_copy(b, "attention_k_f16", ptr(l.k_cache)?, span, false)?,
                rounded_copy(b, "attention_v_f16", ptr(l.v_cache)?, span, false)?,
            )
        }
        _ => (ptr(l.k_cache)?, ptr(l.v_cache)?),
    };
    b.launch(
        name,
        (to_i32(count, "query tiles")? as u32, l.kv_heads as u32, 1),
        (32, warps as u32, 1),
        shared_bytes(l.d) as u32,
        &[
            Arg::Ptr(ptr(l.q)?),
            Arg::Ptr(k),
            Arg::Ptr(v),
            Arg::Ptr(ptr(l.pos)?),
            Arg::Ptr(ptr(out)?),
            Arg::Ptr(seq),
            Arg::Ptr(tables),
            Arg::Ptr(tiles.map_or(0, |(p, _)| p)),
            Arg::I32(to_i32(max_blocks, "blocks a table holds")?),
            Arg::I32(to_i32(block, "block positions")?),
            Arg::I32(to_i32(l.cap, "KV rows")?),
            Arg::I32(to_i32(n, "queries")?),
            Arg::I32(l.heads as i32),
            Arg::I32(l.kv_heads as i32),
            Arg::F32(params.scale),
            Arg::F32(params.softcap.unwrap_or(0.0)),
            Arg::I32(params.window.map_or(0, |w| w.min(i32::MAX as usize) as i32)),
            Arg::Ptr(kept.map_or(0, |k| k.0)),
            Arg::Ptr(kept.map_or(0, |k| k.1)),
        ],
    )
}

/// A paged batch's rows by kernel, from its runs (rows of each sequence, in order): the
/// rows of runs of at most `few` rows (decodes, short tails of prompts: the decode kernel
/// splits their keys over the GPU, which a few rows' tiles would not fill), and tiles of at
/// most `qt` rows cut from the longer runs, as (first row, rows).
pub(crate) fn split_runs(runs: &[usize], few: usize, qt: usize) -> (Vec<i32>, Vec<[i32; 2]>) {
    let (mut singles, mut tiles) = (Vec::new(), Vec::new());
    let mut row = 0;
    for &r in runs {
        if r <= few {
            singles.extend((row..row + r).map(|i| i as i32));
        } else {
            for t in (0..r).step_by(qt) {
                tiles.push([(row + t) as i32, qt.min(r - t) as i32]);
            }
        }
        row += r;
    }
    (singles, tiles)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_split_into_decodes_and_tiles_of_one_sequence() {
        let (singles, tiles) = split_runs(&[1, 40, 1, 1, 2, 16, 9], 8, 16);
        assert_eq!(singles, vec![0, 41, 42, 43, 44]);
        assert_eq!(tiles, vec![[1, 16], [17, 16], [33, 8], [45, 16], [61, 9]]);
        let (singles, tiles) = split_runs(&[1, 2, 3], 1, 16);
        assert_eq!((singles, tiles), (vec![0], vec![[1, 2], [3, 3]]));
        for group in 1..=MAX_WARPS {
            let (qt, warps) = block_shape(group);
            assert!(warps <= MAX_WARPS && warps % group == 0 && qt == 16 * (warps / group));
        }
    }

    #[test]
    fn every_kernel_has_a_need() {
        for (_, d, name) in KERNELS {
            let need = launch_need(name).unwrap();
            assert_eq!(need.dynamic_shared as usize, shared_bytes(d));
            assert!(need.threads <= 256);
        }
        assert_eq!(launch_need("attention_f16_4_2"), None);
    }
}
