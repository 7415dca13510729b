//! Matrix-vector products (decode, one activation row) on AVX-512, or AVX2 ([`avx2`]):
//! `out[r] = w[r] · x`.
//!
//! Decode reads every weight once per token, so these kernels are about keeping memory
//! busy while doing as little per weight as possible. Shared by every format here:
//! - [`ROWS`] weight rows go through the loop together, so each piece of the activation
//!   row is loaded (and anything derived from it computed) once for all of them;
//! - work that depends only on the activation row is done once per call, not per row;
//! - each load of a weight row is paired with a software prefetch: of the same place
//!   [`ROWS`] rows on, the rows the next group reads, or, where rows go one at a time, of
//!   the place a measured distance ahead in the row's stream. Rows are a few KiB, too
//!   short for the hardware prefetcher to ramp up on four interleaved streams, and
//!   requesting a whole row up front (as `matmul::by_rows` does) fills the line-fill
//!   buffers and stalls the core; one request per line consumed keeps a steady stream in
//!   flight. Which cache the prefetches fill, whether float and Q8_0 rows go one at a
//!   time, and the distance depend on the CPU ([`crate::stream`]).
//!
//! Formats: Q8_0/Q4_0 ([`q8_0`]), Q4_K/Q6_K ([`k_quants`]), F32/F16/BF16 ([`float`]); each
//! hands over to [`avx2`] on CPUs without AVX-512 (`KILN_CPU_ISA=avx2` forces it). Q4_0
//! and Q4_K weights come here only in the file's layout (`KILN_CPU_LAYOUT=file`): by
//! default they are repacked into [`crate::panels`], whose kernels read them.

pub(crate) mod avx2;
pub(crate) mod float;
pub(crate) mod k_quants;
pub(crate) mod q8_0;

use crate::dot::{self, Isa};
use crate::pool::Pool;
use crate::stream::Plan;

/// Weight rows per loop.
const ROWS: usize = 4;

/// Whether this CPU can run the AVX-512 kernels.
pub(crate) fn available() -> bool {
    dot::isa() == Isa::Avx512Vnni
}

/// Whether this CPU runs the decode kernels, those for AVX-512 or those for AVX2
/// ([`avx2`]); else `matmul` dots row by row.
pub(crate) fn supported() -> bool {
    matches!(dot::isa(), Isa::Avx512Vnni | Isa::Avx2)
}

/// Fill `out[..m]` over the thread pool, `R` rows at a time: `group(rows)` returns the
/// products of weight rows `rows`. A ragged last group repeats its last row; the repeats
/// are not stored.
fn by_groups<const R: usize>(
    pool: &Pool,
    out: &mut [f32],
    m: usize,
    group: impl Fn([usize; R]) -> [f32; R] + Sync,
) {
    if m == 0 {
        return;
    }
    let chunk = match Plan::get().long_tasks && R == 1 {
        // Rows one at a time on AMD: two long runs of rows a thread, one stream each that
        // the prefetch follows from row to row (Zen 5 tg32 against 64-row tasks: Q8_0
        // 1.22x, F16 1.04x, BENCHMARKS.md).
        true => m.div_ceil(2 * pool.threads()).max(1),
        // Enough rows per task to amortise scheduling, few enough to balance the pool.
        false => (m / (pool.threads() * 8)).clamp(R, 64) / R * R,
    };
    pool.for_chunks_mut(&mut out[..m], chunk, |c, o| {
        for (g, og) in o.chunks_mut(R).enumerate() {
            let r0 = c * chunk + g * R;
            let sums = group(std::array::from_fn(|i| (r0 + i).min(m - 1)));
            og.copy_from_slice(&sums[..og.len()]);
        }
    });
}

/// [`by_groups`] for `n` activation rows into `out[n, m]`: `group(rows, i)` returns the
/// products of weight rows `rows` with activation row `i`. Each group of weight rows is
/// used for every activation row while it is in L1, so the weights stream from memory once.
fn by_groups_batched(
    pool: &Pool,
    out: &mut [f32],
    n: usize,
    m: usize,
    group: impl Fn([usize; ROWS], usize) -> [f32; ROWS] + Sync,
) {
    if m == 0 || n == 0 {
        return;
    }
    let chunk = (m / (pool.threads() * 8)).clamp(ROWS, 64) / ROWS * ROWS;
    // Weight-row-major [m, n] first (each task owns whole rows), then transposed.
    let mut t = vec![0f32; m * n];
    pool.for_chunks_mut(&mut t, chunk * n, |c, o| {
        for (g, og) in o.chunks_mut(ROWS * n).enumerate() {
            let r0 = c * chunk + g * ROWS;
            let rows = std::array::from_fn(|j| (r0 + j).min(m - 1));
            for i in 0..n {
                let sums = group(rows, i);
                for (row, s) in og.chunks_exact_mut(n).zip(sums) {
                    row[i] = s;
                }
            }
        }
    });
    for (r, row) in t.chunks_exact(n).enumerate() {
        for (i, &v) in row.iter().enumerate() {
            out[i * m + r] = v;
        }
    }
}
