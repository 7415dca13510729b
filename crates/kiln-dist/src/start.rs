//! Ranks that are threads of one process start together or not at all: each says whether
//! it could start (load its part of the model, join the communicator), and learns whether
//! all could, before any computes. A rank that failed alone would leave the others
//! waiting in their first collective for it, for ever.

use std::fmt::Display;
use std::sync::{Barrier, Mutex};

pub struct StartLine {
    barrier: Barrier,
    failed: Mutex<Vec<(usize, String)>>,
}

impl StartLine {
    pub fn new(world: usize) -> StartLine {
        StartLine {
            barrier: Barrier::new(world),
            failed: Mutex::new(Vec::new()),
        }
    }

    /// Rank `rank`'s start, `started`: waits for every rank's, then gives back this rank's
    /// value when all started, else the first failed rank's reason and which others failed
    /// (the same message on every rank).
    pub fn cross<T, E: Display>(&self, rank: usize, started: Result<T, E>) -> Result<T, String> {
        let failed = || self.failed.lock().unwrap_or_else(|e| e.into_inner());
        if let Err(e) = &started {
            failed().push((rank, e.to_string()));
        }
        self.barrier.wait();
        let mut all = failed().clone();
        if all.is_empty() {
            return started.map_err(|e| e.to_string());
        }
        all.sort();
        let others: Vec<String> = all[1..].iter().map(|(r, _)| r.to_string()).collect();
        let also = match others.is_empty() {
            true => String::new(),
            false => format!(" (ranks {} failed too)", others.join(", ")),
        };
        Err(format!("rank {}: {}{also}", all[0].0, all[0].1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(outcomes: &[Result<u32, &'static str>]) -> Vec<Result<u32, String>> {
        let line = StartLine::new(outcomes.len());
        std::thread::scope(|s| {
            let handles: Vec<_> = outcomes
                .iter()
                .enumerate()
                .map(|(rank, o)| {
                    let line = &line;
                    s.spawn(move || line.cross(rank, *o))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn all_start_or_none_does() {
        assert_eq!(run(&[Ok(1), Ok(2), Ok(3)]), [Ok(1), Ok(2), Ok(3)]);
        let got = run(&[Ok(1), Err("out of memory"), Err("no file")]);
        let want = "rank 1: out of memory (ranks 2 failed too)".to_string();
        assert!(got.iter().all(|g| g.as_ref() == Err(&want)), "{got:?}");
    }
}
