//! Decode steps of a paged cache recorded once and replayed (CUDA graphs).
//!
//! A server's decode step is hundreds of small launches; at 64 sequences of an 8B model the
//! GPU ran ~4 ms of kernels in a 7.5 ms step (H200, `kiln bench -b 64`): the rest was the
//! host issuing them, cuBLAS's per-call work most of all. A recording replays them with
//! one launch. A recording holds fixed tensors and shapes, so steps are padded to a few
//! sizes: the number of sequences to a bucket (1, 2, 4, ... 256), the block tables to a
//! width (blocks a table holds, a power of two). Padding rows decode token 0 at position 0
//! into the cache's spare block, and nothing reads their results. Each (bucket, width)
//! runs once eagerly (the backend sets up its work buffers), is recorded the next time,
//! and replayed after; recordings belong to one cache.

use super::{exact_rows, i32_bytes, BatchItem, PagedKvCache, PagedRows, StepOutput};
use crate::model::{KvTarget, Logits, Model, Output, Scratch};
use kiln_core::{DType, Replay, Result, Shape, Tensor};
use std::collections::HashMap;

/// Sequence counts a recorded step is padded to; larger steps run eagerly.
const BUCKETS: [usize; 9] = [1, 2, 4, 8, 16, 32, 64, 128, 256];

/// The recordings of one cache's decode steps.
#[derive(Default)]
pub(crate) struct DecodeGraphs {
    /// The cache they write into.
    cache: Option<u64>,
    buckets: HashMap<usize, Bucket>,
    /// The backend does not record: steps run eagerly.
    unsupported: bool,
}

/// The fixed buffers of one bucket of sequences.
struct Bucket {
    /// Activations, `all_logits` `[bucket, vocab]` included.
    s: Scratch,
    /// I32 `[bucket]`: each row's pool row, its table row (its own), its greedy pick.
    slots: Tensor,
    seq: Tensor,
    next: Tensor,
    /// By table width: the tables (`[bucket, width]`) and where recording stands.
    widths: HashMap<usize, Width>,
}

struct Width {
    tables: Tensor,
    recording: Option<Box<dyn Replay>>,
}

impl Model {
    /// Whether a server's decode steps are recorded and replayed: graphs on, and the
    /// backend has not declined to record one (until a step has been offered, that it
    /// might).
    pub fn records_decode_steps(&self) -> bool {
        self.graphs_on() && !self.decode_graphs.unsupported
    }

    /// A decode step (one token per sequence) through a recording, if it can be one:
    /// `None` when the step runs eagerly instead.
    pub(crate) fn step_recorded(
        &mut self,
        items: &[&BatchItem],
        cache: &mut PagedKvCache,
    ) -> Result<Option<Vec<StepOutput>>> {
        let n = items.len();
        let Some(&bucket) = BUCKETS.iter().find(|&&b| b >= n) else {
            return Ok(None);
        };
        if !self.graphs_on()
            || self.decode_graphs.unsupported
            || items.iter().any(|it| it.tokens.len() != 1)
        {
            return Ok(None);
        }
        if self.decode_graphs.cache != Some(cache.id) {
            self.decode_graphs.buckets.clear();
            self.decode_graphs.cache = Some(cache.id);
        }
        let block = cache.block;
        let width = items
            .iter()
            .map(|it| (it.pos0 + 1).div_ceil(block))
            .max()
            .unwrap_or(1)
            .next_power_of_two();
        let mut bk = match self.decode_graphs.buckets.remove(&bucket) {
            Some(bk) => bk,
            None => self.new_bucket(bucket)?,
        };
        // On an error the bucket is dropped: its next step starts over.
        let (outs, recorded) = self.run_bucket(&mut bk, items, cache, width)?;
        if recorded {
            self.decode_graphs.buckets.insert(bucket, bk);
        } else {
            // Its buffers are freed: later steps run eagerly.
            self.decode_graphs.unsupported = true;
        }
        Ok(Some(outs))
    }

    fn new_bucket(&self, bucket: usize) -> Result<Bucket> {
        let b = self.backend().as_ref();
        let mut s = self.new_scratch(bucket)?;
        s.all_logits = Some(b.zeros(
            DType::F32,
            Shape::new(vec![bucket, self.config.vocab_size])?,
        )?);
        s.split_logits = self.split_logits(bucket)?;
        exact_rows(&mut s);
        let ints = || b.zeros(DType::I32, Shape::new(vec![bucket])?);
        // Row i reads table row i, in every step.
        let mut seq = ints()?;
        b.write(
            &mut seq,
            &i32_bytes(&(0..bucket as i32).collect::<Vec<_>>()),
        )?;
        Ok(Bucket {
            s,
            slots: ints()?,
            seq,
            next: ints()?,
            widths: HashMap::new(),
        })
    }

    /// Write the step's rows into the bucket's buffers, run or replay the step, and read
    /// the results, with whether the backend records (when it does not, the step ran
    /// eagerly all the same).
    fn run_bucket(
        &mut self,
        bk: &mut Bucket,
        items: &[&BatchItem],
        cache: &mut PagedKvCache,
        width: usize,
    ) -> Result<(Vec<StepOutput>, bool)> {
        let b = self.backend().clone();
        let bucket = bk.s.n;
        let (block, spare) = (cache.block, cache.blocks as i32);
        let mut ids = vec![0i32; bucket];
        let mut positions = vec![0i32; bucket];
        let mut slots = vec![spare * block as i32; bucket];
        let mut tables = vec![spare; bucket * width];
        for (i, it) in items.iter().enumerate() {
            let p = it.pos0;
            ids[i] = it.tokens[0] as i32;
            positions[i] = p as i32;
            slots[i] = (it.blocks[p / block] as usize * block + p % block) as i32;
            for (t, &blk) in tables[i * width..][..width].iter_mut().zip(it.blocks) {
                *t = blk as i32;
            }
        }
        self.write_ids(&mut bk.s, ids.iter().map(|&id| id as usize))?;
        b.write(&mut bk.s.positions, &i32_bytes(&positions))?;
        b.write(&mut bk.slots, &i32_bytes(&slots))?;
        let fresh = !bk.widths.contains_key(&width);
        if fresh {
            let t = b.zeros(DType::I32, Shape::new(vec![bucket, width])?)?;
            bk.widths.insert(
                width,
                Width {
                    tables: t,
                    recording: None,
                },
            );
        }
        let Bucket {
            s,
            slots: slot_t,
            seq: seq_t,
            next,
            widths,
        } = bk;
        let w = widths.get_mut(&width).expect("made above");
        b.write(&mut w.tables, &i32_bytes(&tables))?;
        // Every row is a sequence of its own.
        let runs = vec![1; bucket];
        let mut step = || -> Result<()> {
            let rows = PagedRows {
                slots: slot_t,
                seq: seq_t,
                tables: &w.tables,
                runs: &runs,
            };
            self.layers(s, &mut KvTarget::Paged { cache, rows })?;
            self.head(s, Output::Logits(Logits::All))?;
            let logits = s.all_logits.as_ref().expect("made with the bucket");
            b.argmax(logits, next)
        };
        let mut recorded = true;
        match &w.recording {
            Some(r) => r.replay()?,
            // The first step of this shape runs eagerly: the backend's work buffers exist
            // before anything is recorded.
            None if fresh => step()?,
            // A backend that does not record runs the step as it is offered.
            None => match b.capture(&mut step)? {
                Some(r) => {
                    r.replay()?;
                    w.recording = Some(r);
                }
                None => recorded = false,
            },
        }
        let row_of: Vec<Option<usize>> = (0..items.len()).map(Some).collect();
        let logits = s.all_logits.as_mut().expect("made with the bucket");
        let outs = self.read_outputs(items, logits, &row_of, Some(next))?;
        Ok((outs, recorded))
    }
}
