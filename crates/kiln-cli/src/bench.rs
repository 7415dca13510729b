//! `kiln bench`: speed measurements.
//!
//! `--kernels` times the CPU matrix-vector product of a 4096 × 14336 weight (llama3-8b's
//! `ffn_down`) in every dtype, as GB/s of weight bytes streamed, beside the machine's own
//! read and copy bandwidth measured the same way (same threads, same bytes, same timer),
//! and its f32 FMA rate (the ceiling of prompts over float weights).

use crate::console::Failure;
use kiln_core::{quant, Backend, DType, HostBytes, Result, Shape};
use kiln_cpu::CpuBackend;
use kiln_models::memory::{self, human_bytes};
use rand::{rngs::StdRng, Rng, SeedableRng};
use rayon::prelude::*;
use std::time::Instant;

pub struct KernelBench {
    pub threads: Option<usize>,
    pub reps: usize,
    pub rows: usize,
    pub cols: usize,
}

impl KernelBench {
    /// Refuse sizes the benchmark cannot run: empty matrices, rows the quantized types
    /// cannot split into blocks, and matrices the machine has no memory for.
    pub fn checked(self) -> Result<Self, Failure> {
        crate::model_file::check_threads(self.threads)?;
        let block = DType::ALL.iter().map(|d| d.block_size()).max().unwrap_or(1);
        if self.rows == 0 {
            return Err(Failure::usage(
                "--rows 0: the matrix needs at least one row",
            ));
        }
        if self.cols == 0 {
            return Err(Failure::usage(
                "--cols 0: the matrix needs at least one column",
            ));
        }
        // The bandwidth runs hold two F32-sized buffers at once; each dtype's weight
        // is at most that size again.
        let need = (self.rows as u128 * self.cols as u128) * 4 * 2;
        if let Some(free) = memory::host_free_memory() {
            if need > free.bytes {
                return Err(Failure::usage(format!(
                    "--rows {} --cols {}: the benchmark needs {} and {} is free in {}",
                    self.rows,
                    self.cols,
                    human_bytes(need),
                    human_bytes(free.bytes),
                    free.what
                )));
            }
        }
        if !self.cols.is_multiple_of(block) {
            return Err(Failure::usage(format!(
                "--cols {}: a positive multiple of {block} (the largest quantization block)",
                self.cols
            )));
        }
        Ok(self)
    }
}

/// Median seconds of `reps` runs of `f`, after one warm-up run.
fn median_secs(reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps.max(1) {
        let t = Instant::now();
        f()?;
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// A weight of `rows × cols` in `dtype`: 64 distinct random rows, repeated. The matrix is
/// far larger than any cache, so repetition does not change what is measured, and it
/// keeps the (slow) reference quantizers out of the run time.
fn weight(dtype: DType, rows: usize, cols: usize, rng: &mut StdRng) -> Result<Vec<u8>> {
    let distinct = rows.min(64);
    let x: Vec<f32> = (0..distinct * cols)
        .map(|_| rng.random_range(-0.1f32..0.1))
        .collect();
    let block = quant::quantize(dtype, &x)?;
    let row_bytes = block.len() / distinct;
    let mut out = Vec::with_capacity(rows * row_bytes);
    for r in 0..rows {
        let i = r % distinct;
        out.extend_from_slice(&block[i * row_bytes..(i + 1) * row_bytes]);
    }
    Ok(out)
}

pub fn kernels(opts: &KernelBench) -> Result<String> {
    let backend = CpuBackend::new(opts.threads)?;
    let threads = backend.threads();
    let (rows, cols) = (opts.rows, opts.cols);
    let mut rng = StdRng::seed_from_u64(1);
    let mut out = format!(
        "# CPU matrix-vector product, {rows} x {cols}, {}\n\n| dtype | weight MB | median ms | GB/s | share of read bandwidth |\n|---|---:|---:|---:|---:|\n",
        backend.describe()
    );

    // The ceilings: stream the size of the F32 weight once (read), and copy it (read+write),
    // on the same number of threads.
    let bytes = rows * cols * 4;
    let src: Vec<u64> = (0..bytes / 8).map(|i| i as u64).collect();
    let mut dst = vec![0u64; src.len()];
    let chunk = src.len().div_ceil(threads * 4);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .map_err(|e| kiln_core::Error::Device(e.to_string()))?;
    let read_s = median_secs(opts.reps, || {
        let sum: u64 = pool.install(|| {
            src.par_chunks(chunk)
                .map(|c| c.iter().fold(0u64, |a, &v| a ^ v))
                .reduce(|| 0, |a, b| a ^ b)
        });
        std::hint::black_box(sum);
        Ok(())
    })?;
    let copy_s = median_secs(opts.reps, || {
        pool.install(|| {
            dst.par_chunks_mut(chunk)
                .zip(src.par_chunks(chunk))
                .for_each(|(d, s)| d.copy_from_slice(s))
        });
        std::hint::black_box(&dst);
        Ok(())
    })?;
    let read_gbs = bytes as f64 / read_s / 1e9;
    drop((src, dst));

    let x: Vec<f32> = (0..cols).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let x = backend.upload(
        DType::F32,
        Shape::new(vec![1, cols])?,
        HostBytes::from_vec(quant::quantize(DType::F32, &x)?),
    )?;
    let mut y = backend.zeros(DType::F32, Shape::new(vec![1, rows])?)?;
    for dtype in DType::ALL {
        let w = weight(dtype, rows, cols, &mut rng)?;
        let w_bytes = w.len();
        let w = backend.upload(dtype, Shape::new(vec![rows, cols])?, HostBytes::from_vec(w))?;
        let s = median_secs(opts.reps, || backend.matmul(&x, &w, &mut y))?;
        let gbs = w_bytes as f64 / s / 1e9;
        out += &format!(
            "| {} | {:.1} | {:.2} | {:.1} | {:.0}% |\n",
            dtype,
            w_bytes as f64 / 1e6,
            s * 1e3,
            gbs,
            100.0 * gbs / read_gbs
        );
    }
    out += &format!(
        "\nmachine read bandwidth ({threads} threads, {:.0} MB streamed): {read_gbs:.1} GB/s; copy: {:.1} GB/s of bytes read + written\n",
        bytes as f64 / 1e6,
        2.0 * bytes as f64 / copy_s / 1e9
    );
    // The arithmetic ceiling of prompts over float weights (one FMA a weight and token):
    // the best of a few runs, as clocks ramp.
    let gflops = (0..opts.reps.clamp(1, 5))
        .map(|_| kiln_cpu::peak::fma_gflops(threads))
        .fold(0f64, f64::max);
    out +=
        &format!("machine f32 FMA rate ({threads} threads, registers only): {gflops:.0} GFLOP/s\n");
    Ok(out)
}
