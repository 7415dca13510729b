//! What runs a step's tokens through the model. The scheduler decides which sequences'
//! tokens make up a step; a [`StepRunner`] computes them.
//!
//! [`PagedRunner`] runs all of a step's sequences as one batch through the model
//! ([`Model::forward_batch`]): every weight is read once for the whole step, and keys and
//! values live in one pool of blocks ([`PagedKvCache`]) whose block ids are the
//! scheduler's: a sequence's block table is where its positions are, so nothing is copied
//! when a sequence grows, and blocks shared through the prefix cache are read in place.

use super::blocks::BlockId;
use super::sequence::SeqId;
use kiln_core::{DType, Result};
use kiln_models::{BatchItem, Model, PagedKvCache};

pub use kiln_models::{StepOutput, StepWant as Want};

/// One sequence's part of a step: `tokens` at positions `pos0..`, its keys and values in
/// `blocks` (its block table, covering the positions it writes).
pub struct StepItem<'a> {
    pub seq: SeqId,
    pub tokens: &'a [u32],
    pub pos0: usize,
    pub blocks: &'a [BlockId],
    pub want: Want,
}

pub trait StepRunner: Send {
    /// Run a step; one result per item, in order. An error fails only its own sequence
    /// where it can be told apart (a bad token); a device error fails the whole step.
    fn run(&mut self, items: Vec<StepItem<'_>>) -> Vec<Result<StepOutput>>;

    /// Whether decode steps are recorded per size (CUDA graphs), as far as the steps run
    /// so far tell.
    fn records_steps(&self) -> bool {
        false
    }
}

/// Runs a step's sequences together through one [`Model`] over one paged KV cache.
pub struct PagedRunner {
    model: Model,
    cache: PagedKvCache,
}

impl PagedRunner {
    /// The runner over `model`, with a KV pool of `blocks` blocks of
    /// [`super::blocks::BLOCK_POSITIONS`] positions whose keys and values are kept as `kv`
    /// (checked against free memory).
    pub fn new(model: Model, blocks: usize, kv: DType) -> Result<Self> {
        let cache = model.new_paged_cache(blocks, super::blocks::BLOCK_POSITIONS, kv)?;
        Ok(PagedRunner { model, cache })
    }
}

impl StepRunner for PagedRunner {
    fn run(&mut self, items: Vec<StepItem<'_>>) -> Vec<Result<StepOutput>> {
        let batch: Vec<BatchItem> = items
            .into_iter()
            .map(|it| BatchItem {
                tokens: it.tokens,
                pos0: it.pos0,
                blocks: it.blocks,
                want: it.want,
            })
            .collect();
        self.model.forward_batch(&batch, &mut self.cache)
    }

    fn records_steps(&self) -> bool {
        self.model.records_decode_steps()
    }
}

/// A step's item with its own copies of the tokens and the block table, for another
/// thread.
struct OwnedItem {
    seq: SeqId,
    tokens: Vec<u32>,
    pos0: usize,
    blocks: Vec<BlockId>,
    want: Want,
}

/// A rank other than the first: its thread runs every step it is sent on its own part of
/// the model and says whether the step went through.
struct Rank {
    steps: std::sync::mpsc::Sender<Vec<OwnedItem>>,
    done: std::sync::mpsc::Receiver<std::result::Result<(), String>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// Runs a step on a model split over several ranks (`kiln_models::tp`, `kiln serve
/// --tp`): the first rank on the engine's thread, the others on threads of their own,
/// each with its own part of the model and its own KV pool of the same blocks (the
/// scheduler's block ids are every rank's). Every rank runs the same step, the
/// collectives inside keep them in step, and every rank gets the same tokens: the first
/// rank's are the step's.
pub struct SplitRunner {
    first: PagedRunner,
    others: Vec<Rank>,
    /// Called when a rank fails, to end the collectives the others wait in.
    abort: std::sync::Arc<dyn Fn(&str) + Send + Sync>,
}

impl SplitRunner {
    /// The ranks' models in rank order (rank 0 first), each with a pool of `blocks`
    /// blocks kept as `kv`; `abort` ends the ranks' collectives (a rank that fails).
    pub fn new(
        models: Vec<Model>,
        blocks: usize,
        kv: DType,
        abort: std::sync::Arc<dyn Fn(&str) + Send + Sync>,
    ) -> Result<Self> {
        let mut models = models.into_iter();
        let first = models
            .next()
            .ok_or_else(|| kiln_core::Error::shape("a split model of no ranks"))?;
        let first = PagedRunner::new(first, blocks, kv)?;
        let mut others = Vec::new();
        for (i, model) in models.enumerate() {
            let mut runner = PagedRunner::new(model, blocks, kv)?;
            let (steps, inbox) = std::sync::mpsc::channel::<Vec<OwnedItem>>();
            let (outbox, done) = std::sync::mpsc::channel();
            let abort = abort.clone();
            let thread = std::thread::Builder::new()
                .name(format!("kiln-rank-{}", i + 1))
                .spawn(move || {
                    // A rank that panics ends the others' collectives too: rank 0 would
                    // otherwise wait in its step's first one for ever.
                    let _on_panic = AbortOnPanic(abort.clone());
                    for owned in inbox {
                        let items = owned
                            .iter()
                            .map(|o| StepItem {
                                seq: o.seq,
                                tokens: &o.tokens,
                                pos0: o.pos0,
                                blocks: &o.blocks,
                                want: o.want.clone(),
                            })
                            .collect();
                        let failed = runner.run(items).into_iter().find_map(|r| {
                            r.err().filter(|e| matches!(e, kiln_core::Error::Device(_)))
                        });
                        let outcome = match failed {
                            Some(e) => {
                                let why = format!("rank {}: {e}", i + 1);
                                abort(&why);
                                Err(why)
                            }
                            None => Ok(()),
                        };
                        if outbox.send(outcome).is_err() {
                            return;
                        }
                    }
                })
                .map_err(|e| kiln_core::Error::io("starting a rank's thread", e))?;
            others.push(Rank {
                steps,
                done,
                thread: Some(thread),
            });
        }
        Ok(SplitRunner {
            first,
            others,
            abort,
        })
    }
}

struct AbortOnPanic(std::sync::Arc<dyn Fn(&str) + Send + Sync>);

impl Drop for AbortOnPanic {
    fn drop(&mut self) {
        if std::thread::panicking() {
            (self.0)("a rank's thread panicked");
        }
    }
}

impl StepRunner for SplitRunner {
    fn run(&mut self, items: Vec<StepItem<'_>>) -> Vec<Result<StepOutput>> {
        let n = items.len();
        let mut sent = true;
        for rank in &self.others {
            let owned = items
                .iter()
                .map(|it| OwnedItem {
                    seq: it.seq,
                    tokens: it.tokens.to_vec(),
                    pos0: it.pos0,
                    blocks: it.blocks.to_vec(),
                    want: it.want.clone(),
                })
                .collect();
            sent &= rank.steps.send(owned).is_ok();
        }
        if !sent {
            let why = "a rank of the split model has stopped".to_string();
            (self.abort)(&why);
            return (0..n)
                .map(|_| Err(kiln_core::Error::Device(why.clone())))
                .collect();
        }
        let mut outs = self.first.run(items);
        if outs
            .iter()
            .any(|r| matches!(r, Err(kiln_core::Error::Device(_))))
        {
            (self.abort)("rank 0's step failed");
        }
        // Every rank answers for every step, so the next step starts together.
        let mut failure = None;
        for rank in &self.others {
            match rank.done.recv() {
                Ok(Ok(())) => {}
                Ok(Err(why)) => failure = failure.or(Some(why)),
                Err(_) => failure = failure.or(Some("a rank's thread ended".to_string())),
            }
        }
        if let Some(why) = failure {
            outs = (0..n)
                .map(|_| Err(kiln_core::Error::Device(why.clone())))
                .collect();
        }
        outs
    }

    /// The ranks run one kind of backend: the first rank's answer is theirs.
    fn records_steps(&self) -> bool {
        self.first.records_steps()
    }
}

impl Drop for SplitRunner {
    fn drop(&mut self) {
        for rank in &mut self.others {
            // Closing the channel ends the rank's loop.
            let (closed, _) = std::sync::mpsc::channel();
            drop(std::mem::replace(&mut rank.steps, closed));
            if let Some(t) = rank.thread.take() {
                let _ = t.join();
            }
        }
    }
}
