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
use kiln_core::Result;
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
}

/// Runs a step's sequences together through one [`Model`] over one paged KV cache.
pub struct PagedRunner {
    model: Model,
    cache: PagedKvCache,
}

impl PagedRunner {
    /// The runner over `model`, with a KV pool of `blocks` blocks of
    /// [`super::blocks::BLOCK_POSITIONS`] positions (checked against free memory).
    pub fn new(model: Model, blocks: usize) -> Result<Self> {
        let cache = model.new_paged_cache(blocks, super::blocks::BLOCK_POSITIONS)?;
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
}
