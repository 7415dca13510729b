//! Products of 9 to 64 rows (a server's decode step) with quantized weights on tensor
//! cores (`kernels/gemm_tc.cu`): each weight is read and decoded in shared memory once for
//! every 64 rows of the batch, where cuBLAS would need the whole matrix decoded to f16
//! first.

use crate::kernels::Arg;
use crate::{ptr, to_i32, CudaBackend};
use kiln_core::{Error, Result, Tensor};

/// Rows of x up to which the kernel is used: one tile of x, each weight decoded once. Past
/// it every weight tile is decoded again for each further 64 rows, and the decoded copy
/// and cuBLAS win (H200, llama3-8b Q4_K_M prompts, this kernel against cuBLAS: 64 rows
/// 5,068 against 4,111 tok/s, 96 rows 4,879 against 5,946, 128 6,000 against 7,674, 256
/// 7,045 against 13,934; Q8_0 160 rows 6,480 against 9,275).
pub(crate) const MAX_ROWS: usize = 64;

/// Past [`MAX_ROWS`], up to [`MAX_ROWS_LARGE`] rows a weight whose decoded copy would
/// exceed [`MAX_DECODED_COPY`] stays here: a decode step's output matrix for 65-256
/// sequences (llama3-8b's decoded: 1 GiB), which the memory plan's working margin (256
/// MiB) does not hold. Prompts compute that matrix for their last rows only.
const MAX_ROWS_LARGE: usize = 256;
const MAX_DECODED_COPY: usize = 256 << 20;

/// Weight and activation rows a block takes (TC_BM, TC_BN in gemm_tc.cu).
const BLOCK_ROWS: usize = 128;
const BLOCK_X_ROWS: usize = 64;
/// Threads of a product block (TC_THREADS, its `__launch_bounds__`).
pub(crate) const THREADS: u32 = 128;

/// Units of 32 values a part of k takes at least: fewer, and the parts' sums cost more
/// than the parallelism they bring.
const LEAST_UNITS_PER_PART: usize = 8;
const MOST_PARTS: usize = 16;

/// Kernels by `matmul::kernel_suffix` order; `None` for the types this path does not
/// take. F16/BF16 weights stay on cuBLAS: the same kernel over F16 (a copy for a decode)
/// decoded 64 rows of llama3-8b at 4,437 tok/s on an H200, cuBLAS at 8,231.
const KERNELS: [Option<&str>; 7] = [
    None,
    None,
    None,
    Some("gemm_tc_q8_0"),
    Some("gemm_tc_q4_0"),
    Some("gemm_tc_q4_k"),
    Some("gemm_tc_q6_k"),
];

/// The product kernels (not their parts' sum, a 1-D launch of 256 threads).
pub(crate) fn is_product_kernel(name: &str) -> bool {
    name.starts_with("gemm_tc_") && name != "gemm_tc_sum"
}

/// Whether `n` rows of `k` values times `m` weight rows of `dtype` go to this kernel: mma
/// needs sm_80.
pub(crate) fn takes(b: &CudaBackend, t: usize, (n, m, k): (usize, usize, usize)) -> bool {
    let rows = if m.saturating_mul(k).saturating_mul(2) > MAX_DECODED_COPY {
        MAX_ROWS_LARGE
    } else {
        MAX_ROWS
    };
    KERNELS[t].is_some() && n <= rows && k.is_multiple_of(32) && b.arch.0 >= 8
}

/// How many parts k is cut into, from the weight's shape and the GPU alone (never the
/// number of rows, so that a row's sums do not depend on its batch): enough blocks for
/// two a multiprocessor, each part at least [`LEAST_UNITS_PER_PART`] units.
fn parts(m: usize, units: usize, sms: usize) -> usize {
    let tiles = m.div_ceil(BLOCK_ROWS);
    let wanted = (2 * sms).div_ceil(tiles);
    let per_part = units.div_ceil(
        wanted
            .min(units / LEAST_UNITS_PER_PART)
            .clamp(1, MOST_PARTS),
    );
    units.div_ceil(per_part)
}

/// `out (+)= x · wᵀ`, with `x_half` x rounded to f16 (`[n, k]`).
pub(crate) fn gemm_tc(
    b: &CudaBackend,
    t: usize,
    x_half: u64,
    w: &Tensor,
    out: &mut Tensor,
    accumulate: bool,
) -> Result<()> {
    let kernel =
        KERNELS[t].ok_or_else(|| Error::unsupported("tensor-core product of this type"))?;
    let (n, m, k) = (out.shape().rows(), w.shape().rows(), w.shape().row_len());
    let units = k / 32;
    let count = parts(m, units, b.sms);
    let per_part = units.div_ceil(count);
    let grid = (
        u32::try_from(m.div_ceil(BLOCK_ROWS))
            .map_err(|_| Error::shape(format!("{m} weight rows are too many for one launch")))?,
        n.div_ceil(BLOCK_X_ROWS) as u32,
        count as u32,
    );
    let out_ptr = ptr(out)?;
    let parts_ptr = if count > 1 {
        b.scratch("gemm_tc_parts", count * n * m * 4)?
    } else {
        0
    };
    b.launch(
        kernel,
        grid,
        (THREADS, 1, 1),
        0,
        &[
            Arg::Ptr(ptr(w)?),
            Arg::Ptr(x_half),
            Arg::Ptr(out_ptr),
            Arg::Ptr(parts_ptr),
            Arg::I32(to_i32(m, "rows")?),
            Arg::I32(to_i32(k, "row length")?),
            Arg::I32(n as i32),
            Arg::I32(per_part as i32),
            Arg::I32(accumulate as i32),
        ],
    )?;
    if count == 1 {
        return Ok(());
    }
    b.launch_1d(
        "gemm_tc_sum",
        n * m,
        &[
            Arg::Ptr(parts_ptr),
            Arg::Ptr(out_ptr),
            Arg::U64((n * m) as u64),
            Arg::I32(count as i32),
            Arg::I32(accumulate as i32),
        ],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Parts depend on the weight's shape only, cover k without an empty part, and each
    /// keeps its least units where k allows.
    #[test]
    fn parts_cover_k_without_empty_ones() {
        for m in [1, 33, 128, 1024, 4096, 14336, 128256] {
            for units in [1, 3, 8, 17, 128, 136, 448] {
                for sms in [1, 78, 132] {
                    let count = parts(m, units, sms);
                    let per = units.div_ceil(count);
                    assert!(
                        (1..=MOST_PARTS).contains(&count),
                        "{m} {units} {sms}: {count}"
                    );
                    assert!(per * (count - 1) < units, "{m} {units}: an empty part");
                    assert!(
                        count == 1 || per >= LEAST_UNITS_PER_PART,
                        "{m} {units}: {per} units a part"
                    );
                }
            }
        }
        // Llama 3 8B's products on an H100/H200 (132 multiprocessors).
        assert_eq!(parts(4096, 128, 132), 9);
        assert_eq!(parts(1024, 128, 132), 16);
        assert_eq!(parts(14336, 128, 132), 3);
        assert_eq!(parts(4096, 448, 132), 9);
    }
}
