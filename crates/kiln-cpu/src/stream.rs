//! How decode's kernels stream weights from memory on this CPU: which cache software
//! prefetches fill, whether float and Q8_0 rows go one at a time, and how far ahead of
//! its loads a sequential stream prefetches.
//!
//! Decode reads every weight once per token, so its speed is the rate at which one core
//! keeps enough cache lines in flight. What does that best differs between CPUs, and the
//! figures here were measured, not derived (BENCHMARKS.md):
//! - Intel Xeon (sessions 1-8, Sapphire Rapids in session 14): four rows read side by
//!   side, prefetching into L1 the same place four rows on; panels 1 KiB ahead.
//! - AMD Zen 4 (session 12): prefetches into L2 (an L1 prefetch holds one of the core's
//!   few L1 miss buffers until it lands); Q8_0 one row at a time, one sequential stream.
//! - AMD Zen 5 (session 15): one row at a time for floats too (F16 decode 14.6 → 17.0
//!   t/s), and a stream prefetched 4-8 KiB ahead instead of 1 KiB (Q4_0 in panels 45 →
//!   53 t/s, Q8_0 31 → 35, F16 21 → 24), Q6_K one row at a time as well (Q4_K_M 55 → 58);
//!   Zen 4 had read Q8_0 fastest with no software prefetch at all, which is why each
//!   kind of stream is measured apart.
//!
//! The distance ahead is the quantity that depends most on the machine (bytes in flight
//! = the rate a core consumes × the memory's latency), so it is measured on the machine
//! itself at load ([`crate::calibrate`]); the vendor's plan gives the rest.

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::OnceLock;

/// The vendor's part of the plan, chosen once per process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Plan {
    /// Software prefetches fill L2 (else L1).
    pub prefetch_to_l2: bool,
    /// Float and Q8_0 rows go through decode one at a time, each a sequential stream
    /// prefetched [`ahead`] bytes on (else four rows side by side, each prefetching the
    /// same place four rows on).
    pub one_row: bool,
    /// Decode over panels (Q4_0, Q4_K) and rows one at a time in two long runs a thread,
    /// else in tasks of 64 rows taken in turn. Zen 5, against 64-row tasks: tg32 Q4_0
    /// 1.04x, Q4_K_M 1.03x, Q8_0 1.22x, F16 1.04x (BENCHMARKS.md); not measured on an
    /// Intel CPU, which keeps what was measured there.
    pub long_tasks: bool,
}

impl Plan {
    const INTEL: Plan = Plan {
        prefetch_to_l2: false,
        one_row: false,
        long_tasks: false,
    };
    const AMD: Plan = Plan {
        prefetch_to_l2: true,
        one_row: true,
        long_tasks: true,
    };

    /// This CPU's plan: by vendor, or `KILN_CPU_STREAMING=intel|amd` to run one vendor's
    /// plan on the other's machine.
    pub(crate) fn get() -> Plan {
        static PLAN: OnceLock<Plan> = OnceLock::new();
        *PLAN.get_or_init(|| match std::env::var("KILN_CPU_STREAMING").as_deref() {
            Ok("amd") => Plan::AMD,
            Ok("intel") => Plan::INTEL,
            _ if cpu_is_amd() => Plan::AMD,
            _ => Plan::INTEL,
        })
    }
}

/// Whether the CPU's vendor string is AMD's (or Hygon's, a Zen licensee).
fn cpu_is_amd() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        let id = std::arch::x86_64::__cpuid(0);
        let vendor: Vec<u8> = [id.ebx, id.edx, id.ecx]
            .iter()
            .flat_map(|r| r.to_le_bytes())
            .collect();
        vendor == b"AuthenticAMD" || vendor == b"HygonGenuine"
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// The kinds of stream, which consume bytes at different rates and so may want different
/// distances: quantized weights in panels (unpacking nibbles takes time per byte), Q8_0
/// and Q6_K rows (one row at a time), and float weights (a conversion and an FMA per 16
/// weights: near the memory's own rate). Each is measured with its own kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Stream {
    Quant,
    Float,
    Q8,
    Q6K,
}

impl Stream {
    pub(crate) fn index(self) -> usize {
        self as usize
    }

    /// The distance used until the machine has been measured: what was measured on the
    /// vendor's machines (see the module docs).
    fn default_ahead(self) -> usize {
        match (Plan::get().one_row, self) {
            (false, _) => 1024,
            (true, Stream::Quant | Stream::Q8 | Stream::Q6K) => 4096,
            (true, Stream::Float) => 8192,
        }
    }
}

/// `KILN_CPU_PREFETCH_AHEAD=BYTES`: every stream's distance, and no measuring.
pub(crate) fn forced_ahead() -> Option<usize> {
    static FORCED: OnceLock<Option<usize>> = OnceLock::new();
    *FORCED.get_or_init(|| {
        let v = std::env::var("KILN_CPU_PREFETCH_AHEAD").ok()?;
        match v.trim().parse::<usize>() {
            Ok(n) if n <= 1 << 20 => Some(n / 64 * 64),
            _ => {
                tracing::warn!(
                    "KILN_CPU_PREFETCH_AHEAD={v:?} is not a byte count up to 1 MiB; ignored"
                );
                None
            }
        }
    })
}

/// A distance not yet chosen.
const UNSET: usize = usize::MAX;

/// Each stream's distance, [`UNSET`] until first read.
static AHEAD: [AtomicUsize; 4] = [
    AtomicUsize::new(UNSET),
    AtomicUsize::new(UNSET),
    AtomicUsize::new(UNSET),
    AtomicUsize::new(UNSET),
];

/// How many bytes ahead of its loads a sequential stream of `kind` prefetches; 0: none
/// (the stream is left to the hardware prefetcher).
#[inline(always)]
pub(crate) fn ahead(kind: Stream) -> usize {
    match AHEAD[kind.index()].load(Relaxed) {
        UNSET => {
            let a = forced_ahead().unwrap_or_else(|| kind.default_ahead());
            AHEAD[kind.index()].store(a, Relaxed);
            a
        }
        a => a,
    }
}

/// Set `kind`'s distance (the measured one); prefetches have no architectural effect, so
/// a kernel running meanwhile computes the same sums either way.
pub(crate) fn set_ahead(kind: Stream, bytes: usize) {
    AHEAD[kind.index()].store(bytes.min(1 << 20), Relaxed);
}

/// The software prefetches of one task's stream: [`ahead`] bytes before each load, and
/// never at or past `reach` bytes from the stream's start, where the task's bytes end
/// (what follows is another task's, usually read by another core: a prefetch there is
/// bandwidth spent for nothing, up to a tenth of a short task's).
#[derive(Clone, Copy, Debug)]
// Read by the x86 kernels alone (prefetches are x86's here).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) struct Ahead {
    pub distance: usize,
    reach: usize,
}

impl Ahead {
    /// No prefetches at all.
    pub(crate) const NONE: Ahead = Ahead {
        distance: 0,
        reach: 0,
    };

    /// Prefetches for a stream of `kind` whose task owns `reach` bytes from its start.
    pub(crate) fn new(kind: Stream, reach: usize) -> Ahead {
        match ahead(kind) {
            0 => Ahead::NONE,
            distance => Ahead { distance, reach },
        }
    }

    /// Ask for the line at `offset` bytes from the stream's start `base`, if the task owns
    /// it.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    pub(crate) fn fetch(self, base: *const u8, offset: usize) {
        if offset < self.reach {
            prefetch(base.wrapping_add(offset));
        }
    }
}

/// Ask for the cache line at `p` (any address: prefetches never fault), into the cache
/// the [`Plan`] chose.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn prefetch<T>(p: *const T) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0, _MM_HINT_T1};
    // SAFETY: a prefetch has no architectural effect and never faults; SSE is baseline on
    // x86_64.
    unsafe {
        if Plan::get().prefetch_to_l2 {
            _mm_prefetch::<_MM_HINT_T1>(p as *const i8)
        } else {
            _mm_prefetch::<_MM_HINT_T0>(p as *const i8)
        }
    }
}
