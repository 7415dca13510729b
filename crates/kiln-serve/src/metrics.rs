//! What `/metrics` reports, in Prometheus' text format: the engine writes, the HTTP layer
//! reads. Atomics only, so that a scrape never waits for a step.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// A histogram of durations with fixed bucket bounds (seconds).
pub struct Histogram {
    bounds: &'static [f64],
    /// One count per bound, then the count above the last (Prometheus' `+Inf`).
    counts: Vec<AtomicU64>,
    sum_micros: AtomicU64,
}

/// Time to first token and request latency: from a few milliseconds to minutes.
const LATENCY_BOUNDS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];
/// Inter-token latency: a step, from well under a millisecond to seconds.
const STEP_BOUNDS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
];

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_micros: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        let i = self
            .bounds
            .iter()
            .position(|&b| secs <= b)
            .unwrap_or(self.bounds.len());
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        self.sum_micros
            .fetch_add(d.as_micros() as u64, Ordering::Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (i, count) in self.counts.iter().enumerate() {
            cumulative += count.load(Ordering::Relaxed);
            let le = self
                .bounds
                .get(i)
                .map_or_else(|| "+Inf".to_string(), |b| b.to_string());
            let _ = writeln!(out, "{name}_bucket{{le=\"{le}\"}} {cumulative}");
        }
        let sum = self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6;
        let _ = writeln!(out, "{name}_sum {sum}\n{name}_count {cumulative}");
    }
}

pub struct Metrics {
    pub running: AtomicU64,
    /// Sequences in the scheduler's queue (set by the engine after each step)...
    pub waiting: AtomicU64,
    /// ...and those submitted that the engine has not taken in yet: the gauge reports
    /// both, so that a request shows as waiting as soon as it is accepted.
    pub submitted: AtomicU64,
    pub kv_blocks_used: AtomicU64,
    pub kv_blocks_total: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub generation_tokens: AtomicU64,
    pub preemptions: AtomicU64,
    pub prefix_cache_hit_tokens: AtomicU64,
    pub finished_stop: AtomicU64,
    pub finished_length: AtomicU64,
    pub cancelled: AtomicU64,
    pub failed: AtomicU64,
    pub time_to_first_token: Histogram,
    pub inter_token_latency: Histogram,
    pub request_latency: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        let zero = || AtomicU64::new(0);
        Metrics {
            running: zero(),
            waiting: zero(),
            submitted: zero(),
            kv_blocks_used: zero(),
            kv_blocks_total: zero(),
            prompt_tokens: zero(),
            generation_tokens: zero(),
            preemptions: zero(),
            prefix_cache_hit_tokens: zero(),
            finished_stop: zero(),
            finished_length: zero(),
            cancelled: zero(),
            failed: zero(),
            time_to_first_token: Histogram::new(LATENCY_BOUNDS),
            inter_token_latency: Histogram::new(STEP_BOUNDS),
            request_latency: Histogram::new(LATENCY_BOUNDS),
        }
    }
}

impl Metrics {
    pub fn add(counter: &AtomicU64, n: usize) {
        counter.fetch_add(n as u64, Ordering::Relaxed);
    }

    pub fn set(gauge: &AtomicU64, n: usize) {
        gauge.store(n as u64, Ordering::Relaxed);
    }

    /// The Prometheus text exposition of everything.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut one = |name: &str, kind: &str, help: &str, value: u64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}"
            );
        };
        one(
            "kiln_requests_running",
            "gauge",
            "Sequences in the running batch.",
            get(&self.running),
        );
        one(
            "kiln_requests_waiting",
            "gauge",
            "Sequences waiting to be scheduled.",
            get(&self.waiting) + get(&self.submitted),
        );
        one(
            "kiln_kv_blocks_used",
            "gauge",
            "KV cache blocks held by sequences.",
            get(&self.kv_blocks_used),
        );
        one(
            "kiln_kv_blocks_total",
            "gauge",
            "KV cache blocks in the pool.",
            get(&self.kv_blocks_total),
        );
        one(
            "kiln_prompt_tokens_total",
            "counter",
            "Prompt tokens computed (recomputed ones after preemption included).",
            get(&self.prompt_tokens),
        );
        one(
            "kiln_generation_tokens_total",
            "counter",
            "Tokens generated.",
            get(&self.generation_tokens),
        );
        one(
            "kiln_preemptions_total",
            "counter",
            "Sequences preempted (to be recomputed) because KV blocks ran out.",
            get(&self.preemptions),
        );
        one(
            "kiln_prefix_cache_hit_tokens_total",
            "counter",
            "Prompt tokens whose keys and values were taken from the prefix cache.",
            get(&self.prefix_cache_hit_tokens),
        );
        let _ = writeln!(
            out,
            "# HELP kiln_sequences_finished_total Sequences ended, by how.\n\
             # TYPE kiln_sequences_finished_total counter\n\
             kiln_sequences_finished_total{{reason=\"stop\"}} {}\n\
             kiln_sequences_finished_total{{reason=\"length\"}} {}\n\
             kiln_sequences_finished_total{{reason=\"cancelled\"}} {}\n\
             kiln_sequences_finished_total{{reason=\"error\"}} {}",
            get(&self.finished_stop),
            get(&self.finished_length),
            get(&self.cancelled),
            get(&self.failed),
        );
        self.time_to_first_token.render(
            &mut out,
            "kiln_time_to_first_token_seconds",
            "From a sequence's arrival to its first token.",
        );
        self.inter_token_latency.render(
            &mut out,
            "kiln_inter_token_latency_seconds",
            "Between a sequence's consecutive tokens.",
        );
        self.request_latency.render(
            &mut out,
            "kiln_request_latency_seconds",
            "From a sequence's arrival to its end.",
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_are_cumulative_with_an_infinite_bucket() {
        let m = Metrics::default();
        m.time_to_first_token.observe(Duration::from_millis(3));
        m.time_to_first_token.observe(Duration::from_millis(30));
        m.time_to_first_token.observe(Duration::from_secs(1000));
        let text = m.render();
        assert!(text.contains("kiln_time_to_first_token_seconds_bucket{le=\"0.005\"} 1\n"));
        assert!(text.contains("kiln_time_to_first_token_seconds_bucket{le=\"0.05\"} 2\n"));
        assert!(text.contains("kiln_time_to_first_token_seconds_bucket{le=\"+Inf\"} 3\n"));
        assert!(text.contains("kiln_time_to_first_token_seconds_count 3\n"));
        assert!(text.contains("# TYPE kiln_requests_running gauge\nkiln_requests_running 0\n"));
    }
}
