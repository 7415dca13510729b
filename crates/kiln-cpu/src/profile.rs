//! Wall time per op, turned on by `KILN_CPU_PROFILE=1`, for `kiln bench`'s kernel table:
//! where a decode step's time goes (the products, attention, norms, the output head) and,
//! against the step's own time, how much goes between the ops. Off, an op pays one branch.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

use kiln_core::KernelTime;

pub(crate) struct Profile {
    /// Per op label: calls and nanoseconds; `None` when profiling is off.
    totals: Option<Mutex<HashMap<String, (u64, u128)>>>,
}

impl Profile {
    pub fn from_env() -> Self {
        let on = std::env::var("KILN_CPU_PROFILE").is_ok_and(|v| v == "1");
        Profile {
            totals: on.then(|| Mutex::new(HashMap::new())),
        }
    }

    /// Run `op`, adding its wall time to `label()`'s total when profiling.
    pub fn time<R>(&self, label: impl FnOnce() -> String, op: impl FnOnce() -> R) -> R {
        let Some(totals) = &self.totals else {
            return op();
        };
        let start = Instant::now();
        let r = op();
        let ns = start.elapsed().as_nanos();
        let mut totals = totals.lock().unwrap_or_else(|e| e.into_inner());
        let entry = totals.entry(label()).or_default();
        entry.0 += 1;
        entry.1 += ns;
        r
    }

    /// Every label's totals, largest first; `None` when profiling is off.
    pub fn report(&self) -> Option<Vec<KernelTime>> {
        let totals = self.totals.as_ref()?;
        let totals = totals.lock().unwrap_or_else(|e| e.into_inner());
        let mut rows: Vec<KernelTime> = totals
            .iter()
            .map(|(name, &(calls, ns))| KernelTime {
                name: name.clone(),
                calls,
                total_ms: ns as f64 / 1e6,
            })
            .collect();
        rows.sort_by(|a, b| b.total_ms.total_cmp(&a.total_ms));
        Some(rows)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_add_up_per_label_largest_first() {
        let off = Profile { totals: None };
        assert_eq!(off.time(|| unreachable!("no label when off"), || 7), 7);
        assert!(off.report().is_none());

        let on = Profile {
            totals: Some(Mutex::new(HashMap::new())),
        };
        for _ in 0..3 {
            on.time(|| "short".into(), || ());
        }
        on.time(
            || "long".into(),
            || std::thread::sleep(std::time::Duration::from_millis(5)),
        );
        let rows = on.report().unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!((rows[0].name.as_str(), rows[0].calls), ("long", 1));
        assert!(rows[0].total_ms >= 5.0);
        assert_eq!((rows[1].name.as_str(), rows[1].calls), ("short", 3));
    }
}
