//! Training's attention backward on tensor cores (kernels/attention_grad_tc.cu), flash-style,
//! under BF16 / F16 products with heads of 64 or 128 on sm_80 and later: it recomputes the
//! scores a tile at a time and never writes them, and skips the keys no query sees.
//! grad.rs keeps the cuBLAS path (five products around the softmax backward's rows) for
//! F32 and TF32 products, other head sizes and older GPUs.

use crate::kernels::{Arg, LaunchNeed};
use crate::{driver_error, to_i32, CudaBackend};
use cudarc::driver::result;
use kiln_core::{AttentionParams, AttentionRun, Error, Result};

/// Rows (query rows for the dQ kernel, key positions for the dK / dV one) a block owns:
/// 16 a warp, 4 warps (`AGT_KEYS`).
const TILE: usize = 64;
const WARPS: u32 = 4;
/// Chunks of query rows the dK / dV kernel keeps a bit for (`32 · AGT_CHUNK_WORDS`): longer
/// runs are cut into pieces of this many chunks.
const MOST_CHUNKS: usize = 32 * 64;

/// The kernels (dQ, then dK and dV) by head size and 16-bit type, with the query rows
/// the dK / dV kernel holds a chunk (its `QC`).
const KERNELS: [(usize, bool, &str, &str, usize); 4] = [
    (64, true, "agt_dq_64_bf16", "agt_dkv_64_bf16", 64),
    (64, false, "agt_dq_64_f16", "agt_dkv_64_f16", 64),
    (128, true, "agt_dq_128_bf16", "agt_dkv_128_bf16", 32),
    (128, false, "agt_dq_128_f16", "agt_dkv_128_f16", 32),
];
/// Each row's D from a kept output, by head size and 16-bit type.
const DSUM_KERNELS: [(usize, bool, &str); 4] = [
    (64, true, "agt_dsum_64_bf16"),
    (64, false, "agt_dsum_64_f16"),
    (128, true, "agt_dsum_128_bf16"),
    (128, false, "agt_dsum_128_f16"),
];

/// The dQ and dK / dV kernels for heads of `d` over operands rounded to bf16 (or f16),
/// if this GPU has them.
pub(crate) fn kernels(b: &CudaBackend, d: usize, bf16: bool) -> Option<Kernels> {
    if b.arch.0 < 8 {
        return None;
    }
    KERNELS
        .iter()
        .find(|k| k.0 == d && k.1 == bf16)
        .map(|&(d, bf, dq, dkv, chunk)| Kernels {
            d,
            dq,
            dkv,
            dsum: DSUM_KERNELS
                .iter()
                .find(|k| k.0 == d && k.1 == bf)
                .map(|k| k.2)
                .expect("a D kernel for every pair"),
            chunk,
        })
}

#[derive(Clone, Copy)]
pub(crate) struct Kernels {
    d: usize,
    dq: &'static str,
    dkv: &'static str,
    dsum: &'static str,
    chunk: usize,
}

/// Dynamic shared memory: the dQ kernel's two chunks of keys and of values; the dK / dV
/// kernel's keys and values, and two chunks of queries and output gradients with each
/// row's lse, D and last key. Rows padded by 8 halves.
fn shared_bytes(d: usize, chunk: Option<usize>) -> usize {
    let row = (d + 8) * 2;
    match chunk {
        None => 2 * 2 * TILE * row,
        Some(qc) => 2 * TILE * row + 2 * 2 * qc * row + 2 * qc * 3 * 4,
    }
}

/// What the launch code needs of a kernel of this file (see `kernels::launch_need`).
pub(crate) fn launch_need(name: &str) -> Option<LaunchNeed> {
    if DSUM_KERNELS.iter().any(|k| k.2 == name) {
        return Some(LaunchNeed {
            threads: 256,
            dynamic_shared: 0,
        });
    }
    let k = KERNELS.iter().find(|k| k.2 == name || k.3 == name)?;
    let chunk = (k.3 == name).then_some(k.4);
    Some(LaunchNeed {
        threads: 32 * WARPS,
        dynamic_shared: shared_bytes(k.0, chunk) as u32,
    })
}

/// The tiles of `runs` the kernels take, 6 ints each (the run's first query row and
/// rows, first key row and keys, the tile's first offset and count): tiles of query rows
/// for dQ, of key positions for dK / dV. Empty runs have none.
fn tiles(runs: &[AttentionRun], by_keys: bool) -> Result<Vec<[i32; 6]>> {
    let i = |v: usize| to_i32(v, "attention rows");
    let mut out = Vec::new();
    for r in runs.iter().filter(|r| r.rows.1 > 0 && r.keys.1 > 0) {
        let span = if by_keys { r.keys.1 } else { r.rows.1 };
        for t0 in (0..span).step_by(TILE) {
            out.push([
                i(r.rows.0)?,
                i(r.rows.1)?,
                i(r.keys.0)?,
                i(r.keys.1)?,
                i(t0)?,
                i(TILE.min(span - t0))?,
            ]);
        }
    }
    Ok(out)
}

/// Whether the spans (first, count) overlap nowhere: then each row of the gradients has
/// one block adding into it, and a launch may hold every run.
fn disjoint(spans: impl Iterator<Item = (usize, usize)>) -> bool {
    let mut spans: Vec<_> = spans.filter(|s| s.1 > 0).collect();
    spans.sort_unstable();
    spans.windows(2).all(|w| w[0].0 + w[0].1 <= w[1].0)
}

/// Device addresses of the operands: the 16-bit copies of q, k, v and dout, the queries'
/// positions, and the F32 gradients the kernels add into.
pub(crate) struct Operands {
    pub half: [u64; 4],
    pub pos: u64,
    pub grads: [u64; 3],
    pub rows: usize,
    pub heads: usize,
    pub kv_heads: usize,
}

/// `runs` with any longer than `most` query rows cut into pieces of `most` (over the same
/// keys).
fn pieces(runs: &[AttentionRun], most: usize) -> Vec<AttentionRun> {
    runs.iter()
        .flat_map(|r| {
            (0..r.rows.1).step_by(most).map(move |o| AttentionRun {
                rows: (r.rows.0 + o, most.min(r.rows.1 - o)),
                keys: r.keys,
            })
        })
        .collect()
}

/// Each query row's lse and D (F32 `[rows, heads]` each), from the dQ kernel to the
/// dK / dV one: device addresses, and whether they are given before the dQ kernel runs.
#[derive(Clone, Copy)]
struct Stats {
    lse: u64,
    dsum: u64,
    given: bool,
}

/// Where [`backward`] of `runs` over `rows` query rows writes every row of dQ, and every
/// row of dK and dV that a run's keys hold, exactly once (one launch, runs disjoint, their
/// rows covering dQ's): the pool rows no run holds, as (first, count) spans, which a
/// gradient beginning there must have zeroed; `None` where the kernels must add.
pub(crate) fn write_plan(
    k: Kernels,
    runs: &[AttentionRun],
    rows: usize,
    pool_rows: usize,
) -> Option<Vec<(usize, usize)>> {
    let runs = pieces(runs, MOST_CHUNKS * k.chunk);
    let live: Vec<_> = runs
        .iter()
        .filter(|r| r.rows.1 > 0 && r.keys.1 > 0)
        .collect();
    let whole = disjoint(runs.iter().map(|r| r.rows))
        && disjoint(runs.iter().map(|r| r.keys))
        && live.iter().map(|r| r.rows.1).sum::<usize>() == rows;
    if !whole {
        return None;
    }
    let mut held: Vec<_> = live.iter().map(|r| r.keys).collect();
    held.sort_unstable();
    let (mut gaps, mut at) = (Vec::new(), 0);
    for (first, count) in held {
        if first > at {
            gaps.push((at, first - at));
        }
        at = first + count;
    }
    if pool_rows > at {
        gaps.push((at, pool_rows - at));
    }
    Some(gaps)
}

/// The backward of `runs` (each a sequence's query rows and its span of key rows, a key's
/// position its offset in the span): dQ, dK and dV added into `o.grads`, or written where
/// `write` (only where [`write_plan`] gives a plan, its gaps zeroed). Runs whose rows (or
/// key spans) overlap go one launch each, in order. `kept`: the forward's lse and rounded
/// output (device addresses), from which the dQ kernel's first pass is spared.
pub(crate) fn backward(
    b: &CudaBackend,
    k: Kernels,
    o: &Operands,
    runs: &[AttentionRun],
    params: &AttentionParams,
    kept: Option<(u64, u64)>,
    write: bool,
) -> Result<()> {
    let count = o.rows * o.heads;
    let stats = match kept {
        Some((lse, out_half)) => {
            let dsum = b.scratch("grad_attention_dsum", 4 * count)?;
            b.launch(
                k.dsum,
                (to_i32(count.div_ceil(8), "query rows")? as u32, 1, 1),
                (256, 1, 1),
                0,
                &[
                    Arg::Ptr(o.half[3]),
                    Arg::Ptr(out_half),
                    Arg::Ptr(dsum),
                    Arg::I32(to_i32(count, "query rows")?),
                ],
            )?;
            Stats {
                lse,
                dsum,
                given: true,
            }
        }
        None => {
            let lse = b.scratch("grad_attention_lse", 2 * 4 * count)?;
            Stats {
                lse,
                dsum: lse + 4 * count as u64,
                given: false,
            }
        }
    };
    let runs = &pieces(runs, MOST_CHUNKS * k.chunk)[..];
    let one_launch = disjoint(runs.iter().map(|r| r.rows)) && disjoint(runs.iter().map(|r| r.keys));
    if one_launch {
        return launch(b, k, o, runs, params, stats, write);
    }
    if write {
        return Err(Error::Device(
            "attention gradient: written over runs that overlap".into(),
        ));
    }
    runs.iter()
        .try_for_each(|r| launch(b, k, o, std::slice::from_ref(r), params, stats, false))
}

fn launch(
    b: &CudaBackend,
    k: Kernels,
    o: &Operands,
    runs: &[AttentionRun],
    params: &AttentionParams,
    stats: Stats,
    write: bool,
) -> Result<()> {
    let (dq_tiles, dkv_tiles) = (tiles(runs, false)?, tiles(runs, true)?);
    if dq_tiles.is_empty() {
        return Ok(());
    }
    let words: Vec<u8> = dq_tiles
        .iter()
        .chain(&dkv_tiles)
        .flatten()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let list = b.scratch("grad_attention_tiles", words.len())?;
    // From pageable memory the driver stages the bytes before returning; queued after the
    // kernels that read the buffer's last lists.
    b.bind()?;
    b.queued_other_work();
    unsafe { result::memcpy_htod_async(list, &words[..], b.stream.cu_stream()) }
        .map_err(driver_error)?;
    let Stats { lse, dsum, given } = stats;
    let [q, kk, v, dout] = o.half;
    let [dq, dk, dv] = o.grads;
    let window = params.window.map_or(Ok(0), |w| to_i32(w, "window"))?;
    let tail = [
        Arg::I32(to_i32(o.heads, "heads")?),
        Arg::I32(to_i32(o.kv_heads, "KV heads")?),
        Arg::F32(params.scale),
        Arg::F32(params.softcap.unwrap_or(0.0)),
        Arg::I32(window),
    ];
    let grid = |count: usize, across: usize| -> Result<(u32, u32, u32)> {
        let count = u32::try_from(count)
            .map_err(|_| Error::shape(format!("{count} attention tiles in one launch")))?;
        Ok((count, across as u32, 1))
    };
    let operands = [
        Arg::Ptr(q),
        Arg::Ptr(kk),
        Arg::Ptr(v),
        Arg::Ptr(dout),
        Arg::Ptr(o.pos),
    ];
    let mut args = operands.to_vec();
    args.extend([Arg::Ptr(list), Arg::Ptr(dq), Arg::Ptr(lse), Arg::Ptr(dsum)]);
    args.extend(tail);
    args.extend([Arg::I32(given as i32), Arg::I32(write as i32)]);
    b.launch(
        k.dq,
        grid(dq_tiles.len(), o.heads)?,
        (32, WARPS, 1),
        shared_bytes(k.d, None) as u32,
        &args,
    )?;
    let mut args = operands.to_vec();
    args.extend([
        Arg::Ptr(list + 24 * dq_tiles.len() as u64),
        Arg::Ptr(lse),
        Arg::Ptr(dsum),
        Arg::Ptr(dk),
        Arg::Ptr(dv),
    ]);
    args.extend(tail);
    args.push(Arg::I32(write as i32));
    b.launch(
        k.dkv,
        grid(dkv_tiles.len(), o.kv_heads)?,
        (32, WARPS, 1),
        shared_bytes(k.d, Some(k.chunk)) as u32,
        &args,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(rows: (usize, usize), keys: (usize, usize)) -> AttentionRun {
        AttentionRun { rows, keys }
    }

    #[test]
    fn runs_are_cut_into_tiles_of_query_rows_and_of_key_positions() {
        let runs = [
            run((0, 70), (100, 130)),
            run((70, 0), (0, 5)),
            run((70, 64), (0, 64)),
        ];
        let by_rows = tiles(&runs, false).unwrap();
        assert_eq!(
            by_rows,
            vec![
                [0, 70, 100, 130, 0, 64],
                [0, 70, 100, 130, 64, 6],
                [70, 64, 0, 64, 0, 64],
            ]
        );
        let by_keys = tiles(&runs, true).unwrap();
        assert_eq!(
            by_keys,
            vec![
                [0, 70, 100, 130, 0, 64],
                [0, 70, 100, 130, 64, 64],
                [0, 70, 100, 130, 128, 2],
                [70, 64, 0, 64, 0, 64],
            ]
        );
    }

    #[test]
    fn a_write_plan_names_the_pool_rows_no_run_holds() {
        let k = Kernels {
            d: 64,
            dq: "",
            dkv: "",
            dsum: "",
            chunk: 64,
        };
        // Training's pool: each sequence's block longer than its keys.
        let runs = [run((0, 5), (0, 5)), run((5, 4), (8, 4))];
        assert_eq!(write_plan(k, &runs, 9, 16), Some(vec![(5, 3), (12, 4)]));
        assert_eq!(write_plan(k, &runs, 9, 12), Some(vec![(5, 3)]));
        // Rows dQ has beyond the runs', or runs over one span of keys: the kernels add.
        assert_eq!(write_plan(k, &runs, 10, 16), None);
        let shared = [run((0, 5), (0, 5)), run((5, 4), (2, 4))];
        assert_eq!(write_plan(k, &shared, 9, 16), None);
        // A run without keys writes none of its rows.
        let keyless = [run((0, 5), (0, 5)), run((5, 4), (8, 0))];
        assert_eq!(write_plan(k, &keyless, 9, 16), None);
    }

    #[test]
    fn long_runs_are_cut_into_pieces_over_the_same_keys() {
        let runs = [
            run((5, 10), (0, 40)),
            run((15, 0), (40, 1)),
            run((15, 4), (40, 4)),
        ];
        assert_eq!(
            pieces(&runs, 4),
            vec![
                run((5, 4), (0, 40)),
                run((9, 4), (0, 40)),
                run((13, 2), (0, 40)),
                run((15, 4), (40, 4)),
            ]
        );
    }

    #[test]
    fn overlapping_spans_are_found() {
        assert!(disjoint([(0, 10), (10, 5), (30, 0), (20, 3)].into_iter()));
        assert!(!disjoint([(20, 3), (0, 10), (9, 5)].into_iter()));
        assert!(disjoint([(5, 0), (5, 3)].into_iter()));
    }
}
