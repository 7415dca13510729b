//! Iteration-level scheduling: before every step the scheduler decides which tokens of
//! which sequences the step computes. First the decodes of all running sequences (one
//! token each), then prompt chunks up to the step's token budget (chunked prefill), so that
//! a long prompt never stalls the sequences that are generating.
//!
//! Prompt chunks start at multiples of `prefill_chunk` and are never cut by the budget (a
//! chunk that does not fit waits for the next step): the chunks a prompt is computed in do
//! not depend on what else is running, so a request at temperature 0 gets the same tokens
//! alone and among others (the kernels' results depend on the rows they are given).
//!
//! A new sequence first takes the whole blocks of its prompt that the prefix cache holds
//! (see `blocks.rs`) and computes from there.
//!
//! KV memory is taken in blocks as positions are written. When a decode finds no free
//! block, the newest running sequence is preempted: its blocks return to the pool and it
//! goes back to the front of the waiting queue, to be recomputed (prompt and generated
//! tokens as one prompt) when room returns.

use super::blocks::BlockPool;
use super::sequence::{SeqId, Sequence};
use std::collections::{HashSet, VecDeque};
use std::ops::Range;

#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Sequences running at once.
    pub max_seqs: usize,
    /// Tokens a step computes at most (decodes and prompt chunks), beyond the first chunk.
    pub token_budget: usize,
    /// The longest prompt chunk; chunks start at its multiples.
    pub prefill_chunk: usize,
}

/// A sequence's tokens in the coming step: `tokens[range]`, at positions `range`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Work {
    pub seq: SeqId,
    pub range: Range<usize>,
}

pub struct Scheduler {
    pub waiting: VecDeque<Sequence>,
    /// In the order they were admitted: the last is the first preempted.
    pub running: Vec<Sequence>,
    pub pool: BlockPool,
    pub limits: Limits,
}

/// What the scheduler did to make a step.
#[derive(Debug, Default)]
pub struct Plan {
    pub work: Vec<Work>,
    /// Sequences whose blocks were taken back, to be recomputed.
    pub preempted: Vec<SeqId>,
    /// Prompt positions new sequences took from the prefix cache instead of computing.
    pub prefix_hits: usize,
}

impl Scheduler {
    pub fn new(pool: BlockPool, limits: Limits) -> Self {
        Scheduler {
            waiting: VecDeque::new(),
            running: Vec::new(),
            pool,
            limits,
        }
    }

    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    /// The next prompt chunk of a sequence with tokens to compute.
    fn chunk(&self, seq: &Sequence) -> Range<usize> {
        next_chunk(seq, self.limits.prefill_chunk)
    }

    /// Decide the next step.
    pub fn schedule(&mut self) -> Plan {
        let mut plan = Plan::default();
        let mut budget = self.limits.token_budget;

        // Decodes first, oldest first: each needs room for the position it writes.
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].pending() != 1 {
                i += 1;
                continue;
            }
            let need = self.running[i].tokens.len();
            if !self.make_room(i, need, &mut plan) {
                // Nothing newer to take from: this one gives way itself.
                self.preempt(i, &mut plan);
                continue;
            }
            let seq = &self.running[i];
            plan.work.push(Work {
                seq: seq.id,
                range: seq.computed..seq.tokens.len(),
            });
            budget = budget.saturating_sub(1);
            i += 1;
        }

        // Then the prompts already started, oldest first.
        let mut chunks = 0;
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].pending() <= 1
                || plan.work.iter().any(|w| w.seq == self.running[i].id)
            {
                i += 1;
                continue;
            }
            let range = self.chunk(&self.running[i]);
            if range.len() > budget && chunks > 0 {
                break;
            }
            if !self.make_room(i, range.end, &mut plan) {
                break;
            }
            budget = budget.saturating_sub(range.len());
            chunks += 1;
            plan.work.push(Work {
                seq: self.running[i].id,
                range,
            });
            i += 1;
        }

        // The prompt blocks this step fills: a new sequence whose prompt goes on with one
        // of them waits a step and takes it from the cache instead of computing it again
        // (requests sharing a system prompt that arrive together).
        let mut filling: HashSet<u64> = HashSet::new();
        let admitting = !self.waiting.is_empty() && self.running.len() < self.limits.max_seqs;
        for w in plan.work.iter().filter(|w| admitting && w.range.len() > 1) {
            if let Some(seq) = self.running.iter().find(|s| s.id == w.seq) {
                filling.extend(
                    self.pool
                        .hashes_filled(&seq.blocks, &seq.tokens, w.range.end),
                );
            }
        }

        // Then new sequences, first come first served, while there is room. A sequence
        // left waiting gives back the cached blocks it took: waiting sequences that held
        // blocks could, between them, hold the whole pool with nothing running to free it.
        while self.running.len() < self.limits.max_seqs {
            let Some(seq) = self.waiting.front_mut() else {
                break;
            };
            // Whole blocks of its prompt that another sequence computed are taken as they are.
            if seq.blocks.is_empty() {
                seq.computed = self.pool.take_prefix(&mut seq.blocks, &seq.tokens);
            }
            let range = next_chunk(seq, self.limits.prefill_chunk);
            let wait = self
                .pool
                .next_prefix_hash(&seq.blocks, &seq.tokens)
                .is_some_and(|h| filling.contains(&h))
                || (range.len() > budget && chunks > 0)
                || !self.pool.reserve(&mut seq.blocks, range.end);
            if wait {
                self.pool.release(&mut seq.blocks);
                seq.computed = 0;
                break;
            }
            let mut seq = self.waiting.pop_front().expect("looked at above");
            plan.prefix_hits += seq.computed;
            seq.admitted_once = true;
            budget = budget.saturating_sub(range.len());
            chunks += 1;
            filling.extend(self.pool.hashes_filled(&seq.blocks, &seq.tokens, range.end));
            plan.work.push(Work { seq: seq.id, range });
            self.running.push(seq);
        }
        plan
    }

    /// Reserve blocks for `positions` positions of running sequence `i`, preempting newer
    /// sequences while the pool is short; false when only `i` itself is left to take from.
    fn make_room(&mut self, i: usize, positions: usize, plan: &mut Plan) -> bool {
        loop {
            if self.pool.reserve(&mut self.running[i].blocks, positions) {
                return true;
            }
            if self.running.len() <= i + 1 {
                return false;
            }
            self.preempt(self.running.len() - 1, plan);
        }
    }

    /// Take running sequence `i`'s blocks back and queue it first, to be recomputed.
    fn preempt(&mut self, i: usize, plan: &mut Plan) {
        let mut seq = self.running.remove(i);
        tracing::info!(
            seq = seq.id,
            positions = seq.tokens.len(),
            blocks = seq.blocks.len(),
            "KV blocks ran out: preempting the newest sequence, to be recomputed"
        );
        self.pool.release(&mut seq.blocks);
        seq.computed = 0;
        plan.work.retain(|w| w.seq != seq.id);
        plan.preempted.push(seq.id);
        self.waiting.push_front(seq);
    }

    /// Take a sequence out, wherever it is, returning its blocks.
    pub fn remove(&mut self, id: SeqId) -> Option<Sequence> {
        let mut seq = if let Some(i) = self.running.iter().position(|s| s.id == id) {
            self.running.remove(i)
        } else {
            let i = self.waiting.iter().position(|s| s.id == id)?;
            self.waiting.remove(i)?
        };
        self.pool.release(&mut seq.blocks);
        Some(seq)
    }
}

/// The next prompt chunk of a sequence with tokens to compute: up to the next multiple
/// of `chunk`.
fn next_chunk(seq: &Sequence, chunk: usize) -> Range<usize> {
    let c = chunk.max(1);
    let start = seq.computed;
    let end = ((start / c + 1) * c).min(seq.tokens.len());
    start..end
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::blocks::BLOCK_POSITIONS;
    use crate::engine::sequence::SamplingParams;
    use crate::engine::test_events;
    use std::time::Instant;

    fn scheduler(blocks: usize) -> Scheduler {
        Scheduler::new(
            BlockPool::new(blocks),
            Limits {
                max_seqs: 4,
                token_budget: 36,
                prefill_chunk: 32,
            },
        )
    }

    fn add(s: &mut Scheduler, id: SeqId, prompt_len: usize) {
        let (tx, rx) = test_events();
        std::mem::forget(rx);
        s.waiting.push_back(Sequence::new(
            id,
            0,
            vec![1; prompt_len],
            SamplingParams::greedy(),
            tx,
            Instant::now(),
        ));
    }

    /// Pretend the step ran: every scheduled token is computed, and a sequence whose
    /// prompt is done gets one more token.
    fn run(s: &mut Scheduler, plan: &Plan) {
        for w in &plan.work {
            let seq = s.running.iter_mut().find(|q| q.id == w.seq).unwrap();
            seq.computed = w.range.end;
            if seq.computed == seq.tokens.len() {
                seq.tokens.push(2);
            }
        }
    }

    #[test]
    fn decodes_come_first_and_prompts_go_in_aligned_chunks() {
        let mut s = scheduler(100);
        add(&mut s, 0, 5);
        let plan = s.schedule();
        assert_eq!(
            plan.work,
            [Work {
                seq: 0,
                range: 0..5
            }]
        );
        run(&mut s, &plan);
        add(&mut s, 1, 70);
        let plan = s.schedule();
        // One decode, then the new prompt's first chunk (it alone may pass the budget).
        assert_eq!(
            plan.work,
            [
                Work {
                    seq: 0,
                    range: 5..6
                },
                Work {
                    seq: 1,
                    range: 0..32
                }
            ]
        );
        run(&mut s, &plan);
        add(&mut s, 2, 3);
        let plan = s.schedule();
        // 1 decode + 32 leave 3 of the budget: the new prompt of 3 fits.
        assert_eq!(
            plan.work,
            [
                Work {
                    seq: 0,
                    range: 6..7
                },
                Work {
                    seq: 1,
                    range: 32..64
                },
                Work {
                    seq: 2,
                    range: 0..3
                }
            ]
        );
        run(&mut s, &plan);
        add(&mut s, 3, 40);
        let plan = s.schedule();
        // Two decodes, then the started prompt's last 6; the new prompt's 32 would pass
        // the budget, and a chunk is never cut to fit.
        assert_eq!(
            plan.work,
            [
                Work {
                    seq: 0,
                    range: 7..8
                },
                Work {
                    seq: 2,
                    range: 3..4
                },
                Work {
                    seq: 1,
                    range: 64..70
                }
            ]
        );
        assert_eq!(s.pool.used(), 1 + 5 + 1);
    }

    /// Requests sharing a prompt's first blocks that arrive together: the second waits one
    /// step and takes those blocks from the cache instead of computing them beside the
    /// first; one with another prompt goes in at once.
    #[test]
    fn a_prompt_block_being_computed_is_waited_for_not_computed_twice() {
        let mut s = scheduler(100);
        let prompt: Vec<u32> = (0..40).collect();
        for id in 0..2 {
            add(&mut s, id, 40);
            s.waiting[id as usize].tokens = prompt.clone();
        }
        let plan = s.schedule();
        assert_eq!(
            plan.work,
            [Work {
                seq: 0,
                range: 0..32
            }]
        );
        assert_eq!(s.waiting.len(), 1);
        // The step ran: its full blocks become the prefix cache's.
        run(&mut s, &plan);
        let seq = &mut s.running[0];
        s.pool.register(&mut seq.blocks, &seq.tokens, seq.computed);
        let plan = s.schedule();
        assert_eq!(plan.prefix_hits, 32);
        assert_eq!(
            plan.work,
            [
                Work {
                    seq: 0,
                    range: 32..40
                },
                Work {
                    seq: 1,
                    range: 32..40
                }
            ]
        );

        // Prompts that share no block go in together.
        let mut s = scheduler(100);
        for id in 0..2 {
            add(&mut s, id, 17);
            s.waiting[id as usize].tokens = (0..17).map(|t| t + 100 * id as u32).collect();
        }
        let plan = s.schedule();
        assert_eq!(plan.work.len(), 2, "{:?}", plan.work);
    }

    #[test]
    fn a_sequence_left_waiting_holds_no_blocks() {
        // Three blocks. Sequence 0's 40-token prompt fills them, its first two blocks
        // cached; sequence 1 shares those tokens, takes the two cached blocks, and finds
        // no third one free.
        let mut s = scheduler(3);
        add(&mut s, 0, 40);
        for _ in 0..2 {
            let plan = s.schedule();
            run(&mut s, &plan);
            let seq = &mut s.running[0];
            s.pool.register(&mut seq.blocks, &seq.tokens, seq.computed);
        }
        assert_eq!(s.pool.free(), 0);
        add(&mut s, 1, 40);
        let plan = s.schedule();
        assert_eq!(plan.work.iter().map(|w| w.seq).collect::<Vec<_>>(), [0]);
        assert_eq!(plan.prefix_hits, 0, "counted when admitted");
        let waiting = &s.waiting[0];
        assert!(
            waiting.blocks.is_empty(),
            "it kept {:?}",
            waiting.blocks.ids()
        );
        assert_eq!(waiting.computed, 0);
        assert_eq!(s.pool.used(), 3, "only sequence 0's blocks are in use");
        // Once sequence 0 ends, sequence 1 takes its cached blocks again and runs.
        s.remove(0);
        let plan = s.schedule();
        assert_eq!(
            plan.work,
            [Work {
                seq: 1,
                range: 2 * BLOCK_POSITIONS..40
            }]
        );
        assert_eq!(plan.prefix_hits, 2 * BLOCK_POSITIONS);
    }

    #[test]
    fn running_out_of_blocks_preempts_the_newest() {
        // Two blocks: each of two sequences holds one until the first needs a second.
        let mut s = scheduler(2);
        add(&mut s, 0, BLOCK_POSITIONS - 1);
        add(&mut s, 1, 4);
        let plan = s.schedule();
        assert_eq!(plan.work.len(), 2);
        run(&mut s, &plan);
        // Sequence 0 now writes position 15 (its block's last): no new block yet.
        let plan = s.schedule();
        assert!(plan.preempted.is_empty());
        run(&mut s, &plan);
        // Position 16 needs a second block: sequence 1, the newest, gives its back.
        let plan = s.schedule();
        assert_eq!(plan.preempted, [1]);
        assert_eq!(
            plan.work,
            [Work {
                seq: 0,
                range: 16..17
            }]
        );
        assert_eq!(s.waiting.front().map(|q| (q.id, q.computed)), Some((1, 0)));
        // Its prompt and generated tokens come back as one prompt once there is room.
        let len = s.waiting[0].tokens.len();
        s.remove(0);
        let plan = s.schedule();
        assert_eq!(
            plan.work,
            [Work {
                seq: 1,
                range: 0..len
            }]
        );
    }
}
