//! Measures, once per process and kind of stream, how far ahead of its loads decode's
//! sequential weight streams should prefetch on this machine ([`crate::stream`]).
//!
//! The best distance is the bytes a core must keep in flight: the rate it consumes them
//! times the memory's latency, both properties of the machine (and of its neighbours, on
//! a shared host) rather than of the code. So the decode kernel itself is timed, over a
//! weight twice the size of the last-level cache (so that it streams from memory, as a
//! model's weights do), at each candidate distance in turn, a few rounds in alternation;
//! the fastest pass of each candidate decides. It runs when the first weight large enough
//! for the distance to matter is loaded (a few tens of milliseconds), before any timing of
//! the model; `KILN_CPU_PREFETCH_AHEAD=BYTES` sets the distance instead.

use crate::gemv;
use crate::panels::{self, Format, Panels};
use crate::pool::Pool;
use crate::stream::{self, Plan, Stream};
use bytemuck::Zeroable;
use half::f16;
use kiln_core::quant::{BlockQ6K, BlockQ8K, BlockQ8_0, QK, QK_K};
use kiln_core::DType;
use std::sync::Once;
use std::time::{Duration, Instant};

/// A weight from which a model is large enough for the distance to matter (test fixtures
/// are far smaller; a 1B model's layers are larger).
pub(crate) const FROM_BYTES: usize = 4 << 20;

/// Distances tried, in bytes (0: no software prefetch, the hardware's prefetcher alone).
/// Floats consume bytes faster, so their range reaches further.
fn candidates(kind: Stream) -> &'static [usize] {
    match kind {
        Stream::Quant | Stream::Q8 | Stream::Q6K => &[0, 1024, 2048, 4096, 8192],
        Stream::Float => &[0, 2048, 4096, 8192, 16384],
    }
}

/// Rounds over all candidates: the machine's bandwidth drifts on a shared host, so each
/// candidate's fastest pass is taken, and the order turns each round.
const ROUNDS: usize = 3;

/// The kind of stream that a weight of `dtype` is read by in decode, if its distance is
/// measured: quantized weights in panels, and Q8_0, Q6_K and float weights where they go
/// one row at a time.
pub(crate) fn stream_of(dtype: DType, in_panels: bool) -> Option<Stream> {
    match dtype {
        _ if in_panels => Some(Stream::Quant),
        DType::Q8_0 if gemv::available() && Plan::get().one_row => Some(Stream::Q8),
        DType::Q6_K if gemv::available() && Plan::get().one_row => Some(Stream::Q6K),
        DType::F16 | DType::BF16 | DType::F32 if gemv::available() && Plan::get().one_row => {
            Some(Stream::Float)
        }
        _ => None,
    }
}

/// Measure `kind`'s distance unless it was measured in this process or is set by
/// `KILN_CPU_PREFETCH_AHEAD`. A machine where the measuring cannot run keeps the plan's
/// distance.
pub(crate) fn ensure(pool: &Pool, kind: Stream) {
    static ONCE: [Once; 4] = [Once::new(), Once::new(), Once::new(), Once::new()];
    if stream::forced_ahead().is_some() {
        return;
    }
    ONCE[kind.index()].call_once(|| {
        let before = stream::ahead(kind);
        match measure(pool, kind, working_set()) {
            Some((best, times)) => {
                stream::set_ahead(kind, best);
                tracing::info!(
                    "CPU decode: {kind:?} weights prefetched {best} bytes ahead (measured, \
                     fastest pass at each distance: {}; the plan's guess was {before})",
                    times
                        .iter()
                        .map(|(d, t)| format!("{d}: {:.2} ms", t.as_secs_f64() * 1e3))
                        .collect::<Vec<_>>()
                        .join(", ")
                );
            }
            None => tracing::debug!("CPU decode: {kind:?} distance not measured here"),
        }
    });
}

/// Bytes of weight the measuring streams: twice the last-level cache, so that a pass
/// reads from memory; 32-256 MiB.
fn working_set() -> usize {
    let llc = std::fs::read_to_string("/sys/devices/system/cpu/cpu0/cache/index3/size")
        .ok()
        .and_then(|s| parse_cache_size(&s))
        .unwrap_or(32 << 20);
    (2 * llc).clamp(32 << 20, 256 << 20)
}

/// A size as sysfs writes it: `32768K`, `1M`, or bytes.
fn parse_cache_size(s: &str) -> Option<usize> {
    let s = s.trim();
    let (digits, unit) = match s.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((i, _)) => (&s[..i], &s[i..]),
        None => (s, ""),
    };
    let n: usize = digits.parse().ok()?;
    match unit {
        "" => Some(n),
        "K" => n.checked_mul(1 << 10),
        "M" => n.checked_mul(1 << 20),
        "G" => n.checked_mul(1 << 30),
        _ => None,
    }
}

/// Each candidate's fastest pass over a `bytes`-sized weight of the kind's kernel, and the
/// fastest candidate; `None` where this CPU does not run the kernel.
fn measure(pool: &Pool, kind: Stream, bytes: usize) -> Option<(usize, Vec<(usize, Duration)>)> {
    // Rows of tinyllama's width, the common case (a row is a few KiB: short streams).
    let cols = 2048;
    let mut pass: Box<dyn FnMut() + '_> = match kind {
        Stream::Quant => {
            let format = Format::for_dtype(DType::Q4_0)?;
            let rows = (bytes / (cols / QK * 18)).next_multiple_of(panels::P);
            // Zeroed panels are written memory (not the shared zero page), and all-zero
            // blocks take the kernel as long as any others.
            let w = Panels::zeroed(format, rows, cols).ok()?;
            let x = vec![BlockQ8_0::zeroed(); cols / QK];
            let mut out = vec![0f32; rows];
            Box::new(move || {
                // The product of zeros cannot fail; an error would only say the kernel
                // cannot run, which `for_dtype` ruled out.
                let _ = panels::matmul_q4_0(pool, &w, &x, &mut out, 1);
            })
        }
        Stream::Q8 => {
            if !(gemv::available() && Plan::get().one_row) {
                return None;
            }
            let rows = bytes / (cols / QK * 34);
            let mut w = Vec::new();
            w.try_reserve_exact(rows * cols / QK).ok()?;
            // Written blocks (not the zero page): a scale of 1, quants of 1.
            w.resize(
                rows * cols / QK,
                BlockQ8_0 {
                    d: f16::ONE,
                    qs: [1; QK],
                },
            );
            let x = vec![BlockQ8_0::zeroed(); cols / QK];
            let mut out = vec![0f32; rows];
            Box::new(move || {
                gemv::q8_0::matvec_rows::<BlockQ8_0, 1>(
                    pool,
                    &w,
                    &x,
                    &mut out,
                    rows,
                    cols,
                    crate::dot::dot_q8_0,
                )
            })
        }
        Stream::Q6K => {
            if !(gemv::available() && Plan::get().one_row) {
                return None;
            }
            let nb = cols / QK_K;
            let rows = bytes / (nb * std::mem::size_of::<BlockQ6K>());
            let mut w = Vec::new();
            w.try_reserve_exact(rows * nb).ok()?;
            w.resize(rows * nb, BlockQ6K::zeroed());
            let x = vec![BlockQ8K::zeroed(); nb];
            let mut out = vec![0f32; rows];
            Box::new(move || gemv::k_quants::matvec_q6k_rows::<1>(pool, &w, &x, &mut out, rows))
        }
        Stream::Float => {
            if !(gemv::available() && Plan::get().one_row) {
                return None;
            }
            let rows = bytes / (cols * 2);
            // A machine short of memory skips the measuring rather than aborting.
            let mut w = Vec::new();
            w.try_reserve_exact(rows * cols).ok()?;
            w.resize(rows * cols, f16::ONE);
            let x = vec![1f32; cols];
            let mut out = vec![0f32; rows];
            Box::new(move || gemv::float::matvec_rows::<f16, 1>(pool, &w, &x, &mut out, rows))
        }
    };
    let list = candidates(kind);
    let mut best = vec![Duration::MAX; list.len()];
    pass(); // the first touch of the output and activation, and a warm pool
    for round in 0..ROUNDS {
        for i in 0..list.len() {
            let c = (i + round) % list.len();
            stream::set_ahead(kind, list[c]);
            let t = Instant::now();
            pass();
            best[c] = best[c].min(t.elapsed());
        }
    }
    let fastest = (0..list.len()).min_by_key(|&c| best[c])?;
    Some((list[fastest], list.iter().copied().zip(best).collect()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_sizes_parse_as_sysfs_writes_them() {
        assert_eq!(parse_cache_size("32768K\n"), Some(32 << 20));
        assert_eq!(parse_cache_size("1M"), Some(1 << 20));
        assert_eq!(parse_cache_size("512"), Some(512));
        assert_eq!(parse_cache_size("12Q"), None);
        assert_eq!(parse_cache_size(""), None);
    }

    /// The measuring runs on this CPU's kernels and picks one of the candidates (a small
    /// weight: only that it runs and chooses is tested, not which).
    #[test]
    fn measuring_picks_a_candidate() {
        let pool = Pool::new(2).unwrap();
        for kind in [Stream::Quant, Stream::Float, Stream::Q8, Stream::Q6K] {
            let before = stream::ahead(kind);
            match measure(&pool, kind, 1 << 20) {
                Some((best, times)) => {
                    assert!(candidates(kind).contains(&best), "{kind:?}: {best}");
                    assert_eq!(times.len(), candidates(kind).len());
                    assert!(times.iter().all(|(_, t)| *t < Duration::MAX));
                }
                None => eprintln!("{kind:?}: this CPU does not run the kernel; not measured"),
            }
            stream::set_ahead(kind, before);
        }
    }
}
