//! What a run shows as it goes: the progress bar (or lines now and then) and the
//! `train.json` log.

use kiln_core::Error;
use kiln_train::{StepReport, Trainer};
use serde_json::json;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};

/// The progress bar on a terminal; otherwise a line now and then.
pub(super) struct Progress {
    bar: Option<indicatif::ProgressBar>,
    quiet: bool,
    /// Plain lines: one per this many steps.
    every: usize,
    tokens_per_second: f64,
}

impl Progress {
    pub(super) fn new(t: &Trainer, quiet: bool) -> Progress {
        let steps = t.settings().steps as u64;
        let bar = (!quiet && std::io::stderr().is_terminal()).then(|| {
            let bar = indicatif::ProgressBar::new(steps);
            bar.set_style(
                indicatif::ProgressStyle::with_template(
                    "{bar:30} {pos}/{len} {msg} [{elapsed_precise}, ETA {eta_precise}]",
                )
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            bar.set_position(t.steps_done() as u64);
            bar
        });
        Progress {
            bar,
            quiet,
            every: (t.settings().steps / 20).max(1),
            tokens_per_second: 0.0,
        }
    }

    pub(super) fn step(&mut self, r: &StepReport, seconds: f64) {
        self.tokens_per_second = r.tokens as f64 / seconds.max(1e-9);
        let msg = format!(
            "loss {:.4} · {:.0} tok/s · lr {:.2e}",
            r.loss, self.tokens_per_second, r.lr
        );
        match &self.bar {
            Some(bar) => {
                bar.set_message(msg);
                bar.set_position(r.step as u64);
            }
            None if !self.quiet && r.step.is_multiple_of(self.every) => {
                eprintln!("step {}: {msg}", r.step)
            }
            None => {}
        }
    }

    pub(super) fn say(&self, line: &str) {
        match &self.bar {
            Some(bar) => bar.println(line),
            None if !self.quiet => eprintln!("{line}"),
            None => {}
        }
    }

    pub(super) fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish();
        }
    }
}

/// `train.json` in the output directory: what the run was, and how it went. A resumed
/// run goes on with the log its checkpoint's run wrote.
pub(super) struct Log {
    path: PathBuf,
    value: serde_json::Value,
    /// Seconds of earlier sessions of this run.
    before: f64,
}

impl Log {
    pub(super) fn open(out: &Path, t: &Trainer, device: &str) -> kiln_core::Result<Log> {
        let path = out.join("train.json");
        let c = &t.model().config;
        let fresh = json!({
            "settings": t.settings(),
            "model": {
                "arch": c.arch.name(), "vocab": c.vocab_size, "dim": c.dim, "layers": c.n_layers,
                "heads": c.n_heads, "kv_heads": c.n_kv_heads, "ffn": c.ffn_dim,
                "context": c.max_positions, "parameters": t.parameter_count(),
            },
            "data": {
                "files": t.data().files, "train_tokens": t.data().train.len(),
                "held_out_tokens": t.data().held_out.len(), "fingerprint": t.data().fingerprint(),
            },
            "device": device,
            "steps": [],
            "evals": [],
        });
        // A log whose steps go past the checkpoint's belongs to a later, lost session:
        // cut back to the checkpoint.
        let done = t.steps_done() as u64;
        let (mut value, before) = match std::fs::read_to_string(&path)
            .ok()
            .and_then(|s| serde_json::from_str::<serde_json::Value>(&s).ok())
        {
            Some(old) if done > 0 => {
                let before = old["seconds"].as_f64().unwrap_or(0.0);
                (old, before)
            }
            _ => (fresh, 0.0),
        };
        for key in ["steps", "evals"] {
            if let Some(list) = value[key].as_array_mut() {
                list.retain(|e| e["step"].as_u64().is_some_and(|s| s <= done));
            }
        }
        Ok(Log {
            path,
            value,
            before,
        })
    }

    pub(super) fn step(&mut self, r: &StepReport, seconds: f64) {
        if let Some(list) = self.value["steps"].as_array_mut() {
            list.push(json!({
                "step": r.step, "loss": r.loss, "lr": r.lr, "grad_norm": r.grad_norm,
                "skipped": r.skipped, "seconds": seconds,
            }));
        }
    }

    pub(super) fn eval(&mut self, step: usize, loss: f64) {
        if let Some(list) = self.value["evals"].as_array_mut() {
            list.push(json!({"step": step, "held_out_loss": loss, "perplexity": loss.exp()}));
        }
    }

    pub(super) fn write(&mut self, seconds: f64) -> kiln_core::Result<()> {
        self.value["seconds"] = json!(self.before + seconds);
        let text = serde_json::to_string_pretty(&self.value)
            .map_err(|e| Error::format(format!("the training log: {e}")))?;
        kiln_io::file::write_replacing(&self.path, |w| {
            use std::io::Write;
            w.write_all(text.as_bytes())
        })
    }
}
