//! The engine: many sequences over one model, stepped together. It knows nothing of HTTP:
//! requests come in as token ids and sampling settings, tokens go out on a channel per
//! request. It runs on a thread of its own (a step is blocking compute), driven by the
//! [`Scheduler`] and computed by a [`StepRunner`].

pub mod blocks;
pub mod runner;
pub mod scheduler;
pub mod sequence;
pub mod warm_up;

use crate::metrics::Metrics;
use blocks::BlockPool;
use kiln_tokenizer::Tokenizer;
use runner::{StepItem, StepOutput, StepRunner, Want};
use scheduler::{Limits, Scheduler};
use sequence::{FinishReason, Progress, SamplingParams, SeqEvent, SeqId, Sequence};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedReceiver;

#[derive(Clone, Copy, Debug)]
pub struct EngineConfig {
    pub limits: Limits,
    /// Blocks in the KV pool.
    pub kv_blocks: usize,
    /// New sequences that may wait to be scheduled; more are refused.
    pub max_waiting: usize,
}

enum Command {
    Add(Vec<Sequence>),
    Cancel(Vec<SeqId>),
    /// Finish what is queued and running, then end the thread.
    Stop,
}

/// The waiting queue is full.
#[derive(Debug)]
pub struct QueueFull;

/// A request's sequences in the engine. Dropping it cancels those still running: a client
/// that goes away takes its sequences with it.
pub struct Submission {
    pub events: UnboundedReceiver<(usize, SeqEvent)>,
    ids: Vec<SeqId>,
    commands: Sender<Command>,
}

impl Drop for Submission {
    fn drop(&mut self) {
        // Finished sequences are already gone; the engine ignores their ids.
        let _ = self
            .commands
            .send(Command::Cancel(std::mem::take(&mut self.ids)));
    }
}

pub struct Engine {
    commands: Sender<Command>,
    next_id: AtomicU64,
    /// New sequences submitted and not yet scheduled.
    waiting: Arc<AtomicUsize>,
    max_waiting: usize,
    alive: Arc<AtomicBool>,
    pub metrics: Arc<Metrics>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Engine {
    /// Start the engine's thread.
    pub fn start(
        runner: Box<dyn StepRunner>,
        tokenizer: Arc<Tokenizer>,
        config: EngineConfig,
    ) -> std::io::Result<Engine> {
        let (tx, rx) = mpsc::channel();
        let metrics = Arc::new(Metrics::default());
        Metrics::set(&metrics.kv_blocks_total, config.kv_blocks);
        let waiting = Arc::new(AtomicUsize::new(0));
        let alive = Arc::new(AtomicBool::new(true));
        let state = EngineLoop {
            scheduler: Scheduler::new(BlockPool::new(config.kv_blocks), config.limits),
            last_step_end: None,
            runner,
            eos: tokenizer.eos_ids(),
            tokenizer,
            metrics: metrics.clone(),
            waiting: waiting.clone(),
        };
        let down = AliveFlag(alive.clone());
        let thread = std::thread::Builder::new()
            .name("kiln-engine".into())
            .spawn(move || {
                let _down = down;
                state.run(rx);
            })?;
        Ok(Engine {
            commands: tx,
            next_id: AtomicU64::new(0),
            waiting,
            max_waiting: config.max_waiting,
            alive,
            metrics,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// The most sequences that may wait at once (`--max-waiting`): a request of more can
    /// never be queued.
    pub fn max_waiting(&self) -> usize {
        self.max_waiting
    }

    /// Queue one sequence per `(prompt, params)`, the i-th being choice i; refused when the
    /// waiting queue has no room for all of them.
    pub fn submit(
        &self,
        sequences: Vec<(Vec<u32>, SamplingParams)>,
    ) -> Result<Submission, QueueFull> {
        let n = sequences.len();
        self.waiting
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
                (w + n <= self.max_waiting).then_some(w + n)
            })
            .map_err(|_| QueueFull)?;
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let now = Instant::now();
        let seqs: Vec<Sequence> = sequences
            .into_iter()
            .enumerate()
            .map(|(choice, (prompt, params))| {
                let id = self.next_id.fetch_add(1, Ordering::Relaxed);
                Sequence::new(id, choice, prompt, params, tx.clone(), now)
            })
            .collect();
        let ids = seqs.iter().map(|s| s.id).collect();
        Metrics::add(&self.metrics.submitted, n);
        if self.commands.send(Command::Add(seqs)).is_err() {
            // The engine is down: the receiver sees its senders dropped and reports it.
            self.waiting.fetch_sub(n, Ordering::AcqRel);
            self.metrics
                .submitted
                .fetch_sub(n as u64, Ordering::Relaxed);
        }
        Ok(Submission {
            events: rx,
            ids,
            commands: self.commands.clone(),
        })
    }

    pub fn is_alive(&self) -> bool {
        self.alive.load(Ordering::Acquire)
    }

    /// Let queued and running sequences finish, then end the engine's thread.
    pub fn stop(&self) {
        let _ = self.commands.send(Command::Stop);
        let thread = self.thread.lock().map(|mut t| t.take()).unwrap_or(None);
        if let Some(t) = thread {
            if t.join().is_err() {
                tracing::error!("the engine's thread panicked");
            }
        }
    }
}

/// Marks the engine down when its thread ends, however it ends (a panic included).
struct AliveFlag(Arc<AtomicBool>);

impl Drop for AliveFlag {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

struct EngineLoop {
    scheduler: Scheduler,
    /// When the last step's results were handled: the host's time between steps is
    /// measured from here.
    last_step_end: Option<Instant>,
    runner: Box<dyn StepRunner>,
    tokenizer: Arc<Tokenizer>,
    eos: Vec<u32>,
    metrics: Arc<Metrics>,
    waiting: Arc<AtomicUsize>,
}

/// How a sequence left the engine, for the metrics.
enum Ending {
    Finished(FinishReason),
    Cancelled,
    Failed(String),
}

impl EngineLoop {
    fn run(mut self, commands: Receiver<Command>) {
        let mut stopping = false;
        loop {
            if self.scheduler.is_idle() {
                if stopping {
                    break;
                }
                // Nothing to do: sleep until a request comes (an idle wait is not a gap
                // between steps).
                self.last_step_end = None;
                match commands.recv() {
                    Ok(c) => self.apply(c, &mut stopping),
                    Err(_) => break,
                }
            }
            while let Ok(c) = commands.try_recv() {
                self.apply(c, &mut stopping);
            }
            self.drop_abandoned();
            if !self.step() && !self.scheduler.is_idle() {
                // Nothing could be scheduled (cannot happen while the pool holds a whole
                // context, which start-up checks); do not spin.
                std::thread::sleep(Duration::from_millis(1));
            }
            self.publish();
        }
        self.publish();
    }

    fn apply(&mut self, command: Command, stopping: &mut bool) {
        match command {
            Command::Add(seqs) => {
                self.metrics
                    .submitted
                    .fetch_sub(seqs.len() as u64, Ordering::Relaxed);
                self.scheduler.waiting.extend(seqs);
                self.publish();
            }
            Command::Cancel(ids) => {
                for id in ids {
                    self.end(id, Ending::Cancelled);
                }
            }
            Command::Stop => *stopping = true,
        }
    }

    /// Cancel the sequences whose clients are gone.
    fn drop_abandoned(&mut self) {
        let s = &self.scheduler;
        let gone: Vec<SeqId> = s
            .running
            .iter()
            .chain(s.waiting.iter())
            .filter(|seq| seq.abandoned())
            .map(|seq| seq.id)
            .collect();
        for id in gone {
            self.end(id, Ending::Cancelled);
        }
    }

    /// Take a sequence out of the engine, free its blocks and cache, and tell its client.
    fn end(&mut self, id: SeqId, how: Ending) {
        let Some(mut seq) = self.scheduler.remove(id) else {
            return;
        };
        if !seq.admitted_once {
            self.waiting.fetch_sub(1, Ordering::AcqRel);
        }
        let m = &self.metrics;
        match how {
            Ending::Finished(reason) => {
                Metrics::add(
                    match reason {
                        FinishReason::Stop => &m.finished_stop,
                        FinishReason::Length => &m.finished_length,
                    },
                    1,
                );
                m.request_latency.observe(seq.arrived.elapsed());
                seq.finish(reason);
            }
            Ending::Cancelled => {
                tracing::debug!(seq = id, "cancelled");
                Metrics::add(&m.cancelled, 1);
            }
            Ending::Failed(message) => {
                tracing::warn!(seq = id, "failed: {message}");
                Metrics::add(&m.failed, 1);
                seq.fail(message);
            }
        }
    }

    /// Schedule and run one step; false when nothing could be scheduled.
    fn step(&mut self) -> bool {
        let before = self
            .scheduler
            .waiting
            .iter()
            .filter(|s| !s.admitted_once)
            .count();
        let plan = self.scheduler.schedule();
        let after = self
            .scheduler
            .waiting
            .iter()
            .filter(|s| !s.admitted_once)
            .count();
        self.waiting.fetch_sub(before - after, Ordering::AcqRel);
        Metrics::add(&self.metrics.preemptions, plan.preempted.len());
        Metrics::add(&self.metrics.prefix_cache_hit_tokens, plan.prefix_hits);
        if plan.work.is_empty() {
            return false;
        }
        let running = &mut self.scheduler.running;
        let index_of = |running: &[Sequence], id: SeqId| {
            running
                .iter()
                .position(|s| s.id == id)
                .expect("scheduled sequences are running")
        };
        // What each sequence wants back: a token only after its last pending token.
        let wants: Vec<Want> = plan
            .work
            .iter()
            .map(|w| {
                let i = index_of(running, w.seq);
                if w.range.end == running[i].tokens.len() {
                    running[i].want()
                } else {
                    Want::Nothing
                }
            })
            .collect();
        // A step that reads nothing back returns once queued: its time is the host's, and
        // the device's lands in the next step that reads.
        let reads_back = wants.iter().any(|w| *w != Want::Nothing);
        let items = plan
            .work
            .iter()
            .zip(wants)
            .map(|(w, want)| {
                let seq = &running[index_of(running, w.seq)];
                StepItem {
                    seq: w.seq,
                    tokens: &seq.tokens[w.range.clone()],
                    pos0: w.range.start,
                    blocks: seq.blocks.ids(),
                    want,
                }
            })
            .collect();
        let started = Instant::now();
        let outputs = self.runner.run(items);
        let now = Instant::now();
        // What a step was and what it took, for finding where a server's time goes
        // (`RUST_LOG=kiln_serve::engine=debug`; scripts/gpu/serve_steps.py sums them).
        if tracing::enabled!(tracing::Level::DEBUG) {
            let decodes = plan.work.iter().filter(|w| w.range.len() == 1).count();
            let prompt_tokens: usize = plan
                .work
                .iter()
                .filter(|w| w.range.len() > 1)
                .map(|w| w.range.len())
                .sum();
            let between = self.last_step_end.map(|t| started - t);
            tracing::debug!(
                decodes,
                prompt_chunks = plan.work.len() - decodes,
                prompt_tokens,
                run_us = (now - started).as_micros() as u64,
                reads_back,
                before_us = between.map_or(0, |d| d.as_micros() as u64),
                "step"
            );
        }
        let mut ended = Vec::new();
        for (w, out) in plan.work.iter().zip(outputs) {
            let i = index_of(running, w.seq);
            let seq = &mut running[i];
            if w.range.len() > 1 {
                Metrics::add(&self.metrics.prompt_tokens, w.range.len());
            }
            let out = match out {
                Ok(out) => out,
                Err(e) => {
                    ended.push((w.seq, Ending::Failed(e.to_string())));
                    continue;
                }
            };
            seq.computed = w.range.end;
            // Blocks this step filled become the prefix cache's.
            self.scheduler
                .pool
                .register(&mut seq.blocks, &seq.tokens, seq.computed);
            if out == StepOutput::Nothing {
                continue;
            }
            let previous = seq.last_token_at;
            let progress = seq.accept(out, &self.tokenizer, &self.eos, now);
            Metrics::add(&self.metrics.generation_tokens, 1);
            match previous {
                Some(t) => self.metrics.inter_token_latency.observe(now - t),
                None => self.metrics.time_to_first_token.observe(now - seq.arrived),
            }
            if let Progress::Finished(reason) = progress {
                ended.push((w.seq, Ending::Finished(reason)));
            }
        }
        for (id, how) in ended {
            self.end(id, how);
        }
        self.last_step_end = Some(Instant::now());
        true
    }

    fn publish(&self) {
        let (m, s) = (&self.metrics, &self.scheduler);
        Metrics::set(&m.running, s.running.len());
        Metrics::set(&m.waiting, s.waiting.len());
        Metrics::set(&m.kv_blocks_used, s.pool.used());
    }
}

/// Send-side of a request's events, for tests of the scheduler.
#[cfg(test)]
pub(crate) fn test_events() -> (sequence::EventSender, UnboundedReceiver<(usize, SeqEvent)>) {
    tokio::sync::mpsc::unbounded_channel()
}
