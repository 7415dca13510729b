//! What runs a step's tokens through the model. The scheduler decides which sequences'
//! tokens make up a step; a [`StepRunner`] computes them.
//!
//! **Today's runner is serial**: kiln's kernels run one sequence at a time, so
//! [`SerialRunner`] runs a step's sequences one after another, each on a KV cache of its
//! own (contiguous, grown by copy as its block table grows). A step of 16 decodes costs 16
//! single-sequence decodes. Batched kernels (one weight read for all rows), attention over
//! paged blocks and prefix caching are later steps of issue 17; they replace this runner
//! behind the same trait, and the scheduler does not change.

use super::sequence::SeqId;
use kiln_core::{Result, SampleParams};
use kiln_models::{KvCache, Logits, Model};
use std::collections::HashMap;

/// What the runner returns for a sequence's part of a step.
#[derive(Clone, Debug, PartialEq)]
pub enum Want {
    /// Nothing: a prompt chunk that is not the prompt's last.
    Nothing,
    /// The most likely next token, picked on the device.
    Argmax,
    /// A token drawn on the device with these parameters, the repetition penalty applying
    /// to `penalized`.
    Sample {
        params: SampleParams,
        penalized: Vec<u32>,
    },
    /// The next token's logits, for sampling on the host (log-probabilities, OpenAI's
    /// penalties).
    Logits,
}

#[derive(Debug, PartialEq)]
pub enum StepOutput {
    Nothing,
    Token(u32),
    Logits(Vec<f32>),
}

/// One sequence's part of a step: `tokens` at positions `pos0..`, into a cache that must
/// hold `capacity` positions (its block table's).
pub struct StepItem<'a> {
    pub seq: SeqId,
    pub tokens: &'a [u32],
    pub pos0: usize,
    pub capacity: usize,
    pub want: Want,
}

pub trait StepRunner: Send {
    /// Run a step; one result per item, in order. An error fails only its own sequence.
    fn run(&mut self, items: Vec<StepItem<'_>>) -> Vec<Result<StepOutput>>;

    /// Forget a sequence's keys and values (finished, cancelled or preempted).
    fn release(&mut self, seq: SeqId);
}

/// Runs each sequence of a step in turn through one [`Model`], each on its own cache.
pub struct SerialRunner {
    model: Model,
    caches: HashMap<SeqId, KvCache>,
}

impl SerialRunner {
    pub fn new(model: Model) -> Self {
        SerialRunner {
            model,
            caches: HashMap::new(),
        }
    }

    fn run_one(&mut self, item: StepItem<'_>) -> Result<StepOutput> {
        let mut cache = match self.caches.remove(&item.seq) {
            Some(mut cache) => {
                self.model.grow_cache(&mut cache, item.capacity)?;
                cache
            }
            None => self.model.new_cache(item.capacity)?,
        };
        let m = &mut self.model;
        let out = match item.want {
            Want::Nothing => m
                .forward_argmax(item.tokens, item.pos0, &mut cache)
                .map(|_| StepOutput::Nothing),
            Want::Argmax => m
                .forward_argmax(item.tokens, item.pos0, &mut cache)
                .map(StepOutput::Token),
            Want::Sample { params, penalized } => m
                .forward_sample(item.tokens, item.pos0, &mut cache, &penalized, &params)
                .map(StepOutput::Token),
            Want::Logits => m
                .forward(item.tokens, item.pos0, &mut cache, Logits::Last)
                .map(StepOutput::Logits),
        };
        self.caches.insert(item.seq, cache);
        out
    }
}

impl StepRunner for SerialRunner {
    fn run(&mut self, items: Vec<StepItem<'_>>) -> Vec<Result<StepOutput>> {
        items.into_iter().map(|item| self.run_one(item)).collect()
    }

    fn release(&mut self, seq: SeqId) {
        self.caches.remove(&seq);
    }
}
