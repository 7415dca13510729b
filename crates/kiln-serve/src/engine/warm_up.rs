//! Steps of every kind a server runs, run once before it takes requests.
//!
//! A GPU backend does work at a shape's first use: it loads kernels (cuBLAS loads each
//! of its kernels lazily), chooses algorithms, sizes its work buffers, and a decode step of
//! a new sequence count or block-table width is run once and then recorded (CUDA graphs).
//! On the H200 the host took 107 ms to issue an 8B model's first 256-token prompt chunk
//! (~4 ms once warm) and 24 ms its first 64-token one (~3); a lone client's time to first
//! token went from 35 to 15 ms (p50) with the warm-up. Here those costs are paid at start.
//!
//! The steps write keys and values into blocks nobody holds yet (the pool starts empty,
//! and a block's positions are written before they are read), and their tokens are
//! thrown away.

use super::blocks::{BlockId, BLOCK_POSITIONS};
use super::runner::{StepItem, StepRunner, Want};
use super::scheduler::Limits;
use kiln_core::{Error, Result};
use std::time::{Duration, Instant};

/// Sequence counts of the decode steps kiln-models records (powers of two up to this;
/// larger steps run as they come).
const RECORDED_SEQUENCES: usize = 256;

/// What was run.
pub struct WarmedUp {
    pub steps: usize,
    pub took: Duration,
}

/// Run, on a pool of `blocks` blocks: prompt steps of 16 rows up to the most a step takes
/// under `limits` (the products choose their kernels by the rows: see
/// [`prompt_step_rows`]), then decode steps of each recorded sequence count up to
/// `limits.max_seqs`, at each block-table width up to `context` positions, twice each
/// (run, then recorded). Sizes the pool cannot hold are left out. Where the runner turns
/// out not to record steps (found after the first pair), one decode step of each count
/// is run, at the narrowest width: there is nothing to record.
pub fn warm_up(
    runner: &mut dyn StepRunner,
    limits: &Limits,
    blocks: usize,
    context: usize,
) -> Result<WarmedUp> {
    let started = Instant::now();
    let mut steps = 0;
    // No position past the context: a model with learned positions refuses them.
    let chunk = limits.prefill_chunk.min(context).max(1);
    let most_rows = limits.max_seqs.max(limits.token_budget) + chunk;
    for rows in prompt_step_rows(most_rows) {
        // Sequences of one chunk each (the last shorter), each in blocks of its own.
        let lens: Vec<usize> = (0..rows.div_ceil(chunk))
            .map(|i| chunk.min(rows - i * chunk))
            .collect();
        let tables = own_blocks(&lens, blocks);
        let Some(tables) = tables else { continue };
        let tokens = vec![0u32; chunk];
        let items = lens
            .iter()
            .zip(&tables)
            .map(|(&len, table)| StepItem {
                seq: 0,
                tokens: &tokens[..len],
                pos0: 0,
                blocks: table,
                want: Want::Argmax,
            })
            .collect();
        run(runner, items, &format!("a prompt step of {rows} tokens"))?;
        steps += 1;
    }
    let widest = context
        .div_ceil(BLOCK_POSITIONS)
        .next_power_of_two()
        .min(1 << blocks.max(1).ilog2());
    let table: Vec<BlockId> = (0..widest as BlockId).collect();
    let most_seqs = limits.max_seqs.next_power_of_two().min(RECORDED_SEQUENCES);
    let token = [0u32];
    let mut records = true;
    for seqs in std::iter::successors(Some(1usize), |s| Some(s * 2)).take_while(|&s| s <= most_seqs)
    {
        for width in
            std::iter::successors(Some(1usize), |w| Some(w * 2)).take_while(|&w| w <= widest)
        {
            if !records && width > 1 {
                break;
            }
            // Every sequence at the last position of `width` blocks (or of the context,
            // which the widest table covers), all in the same blocks.
            let pos0 = (width * BLOCK_POSITIONS).min(context.max(1)) - 1;
            for _ in 0..if records { 2 } else { 1 } {
                let items = (0..seqs)
                    .map(|_| StepItem {
                        seq: 0,
                        tokens: &token,
                        pos0,
                        blocks: &table[..width],
                        want: Want::Argmax,
                    })
                    .collect();
                run(runner, items, &format!("a decode step of {seqs} sequences"))?;
                steps += 1;
            }
            records = records && runner.records_steps();
        }
    }
    Ok(WarmedUp {
        steps,
        took: started.elapsed(),
    })
}

/// Every multiple of 16 up to 512 (a prompt's last chunk is any length, and cuBLAS may
/// choose other kernels between powers of two), then 768, 1024, 1536, ... up to `most`,
/// and `most` itself.
fn prompt_step_rows(most: usize) -> Vec<usize> {
    let mut rows: Vec<usize> = (1..=32).map(|i| 16 * i).filter(|&r| r <= most).collect();
    rows.extend(
        std::iter::successors(Some(512usize), |r| Some(r * 2))
            .flat_map(|r| [r + r / 2, 2 * r])
            .take_while(|&r| r <= most),
    );
    if rows.last() != Some(&most) {
        rows.push(most);
    }
    rows
}

/// Block tables of their own for sequences of `lens` positions, if `blocks` hold them.
fn own_blocks(lens: &[usize], blocks: usize) -> Option<Vec<Vec<BlockId>>> {
    let mut next = 0usize;
    let mut tables = Vec::with_capacity(lens.len());
    for &len in lens {
        let n = len.div_ceil(BLOCK_POSITIONS);
        if next + n > blocks {
            return None;
        }
        tables.push((next as BlockId..(next + n) as BlockId).collect());
        next += n;
    }
    Some(tables)
}

fn run(runner: &mut dyn StepRunner, items: Vec<StepItem<'_>>, what: &str) -> Result<()> {
    match runner.run(items).into_iter().find_map(|r| r.err()) {
        Some(e) => Err(Error::Device(format!("warming up with {what}: {e}"))),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::super::runner::StepOutput;
    use super::*;

    #[test]
    fn prompt_steps_cover_each_size_class_up_to_the_largest_step() {
        let rows = prompt_step_rows(2304);
        assert_eq!(rows[..3], [16, 32, 48]);
        assert_eq!(rows[30..], [496, 512, 768, 1024, 1536, 2048, 2304]);
        assert_eq!(prompt_step_rows(100), vec![16, 32, 48, 64, 80, 96, 100]);
        assert_eq!(prompt_step_rows(8), vec![8]);
    }

    /// Records what it is asked to run; `records` is what it says of recording steps.
    #[derive(Default)]
    struct Recorder {
        steps: Vec<Vec<(usize, usize, Vec<BlockId>)>>,
        records: bool,
    }

    /// A runner that says it records steps (as CUDA's does).
    fn recording() -> Recorder {
        Recorder {
            records: true,
            ..Recorder::default()
        }
    }

    impl StepRunner for Recorder {
        fn run(&mut self, items: Vec<StepItem<'_>>) -> Vec<Result<StepOutput>> {
            self.steps.push(
                items
                    .iter()
                    .map(|it| (it.tokens.len(), it.pos0, it.blocks.to_vec()))
                    .collect(),
            );
            items.iter().map(|_| Ok(StepOutput::Nothing)).collect()
        }

        fn records_steps(&self) -> bool {
            self.records
        }
    }

    #[test]
    fn steps_stay_inside_the_pool_and_cover_every_bucket_and_width() {
        let limits = Limits {
            max_seqs: 6,
            token_budget: 40,
            prefill_chunk: 32,
        };
        let mut r = recording();
        let done = warm_up(&mut r, &limits, 4, 100).unwrap();
        assert_eq!(done.steps, r.steps.len());
        for step in &r.steps {
            for (len, pos0, table) in step {
                assert!(table.iter().all(|&b| (b as usize) < 4), "{table:?}");
                assert!(pos0 + len <= table.len() * BLOCK_POSITIONS);
                assert!(pos0 + len <= 100, "past the context: {pos0} + {len}");
            }
        }
        // Prompt steps of 16 ... 72 rows (6.max(40) + 32): 72 (5 blocks) is left out.
        let prompts: Vec<usize> = r
            .steps
            .iter()
            .filter(|s| s[0].0 > 1)
            .map(|s| s.iter().map(|it| it.0).sum())
            .collect();
        assert_eq!(prompts, vec![16, 32, 48, 64]);
        // Decode steps: 1, 2, 4, 8 sequences at widths 1, 2, 4 (100 positions need 7
        // blocks, 8 as a power of two, more than the pool's 4), twice each.
        let decodes: Vec<(usize, usize)> = r
            .steps
            .iter()
            .filter(|s| s[0].0 == 1)
            .map(|s| (s.len(), s[0].2.len()))
            .collect();
        let mut want = Vec::new();
        for seqs in [1, 2, 4, 8] {
            for width in [1, 2, 4] {
                want.extend([(seqs, width); 2]);
            }
        }
        assert_eq!(decodes, want);
    }

    /// A context shorter than a chunk and than the widest table: no position past it,
    /// and the last decode steps still read the widest table a sequence can have.
    #[test]
    fn a_short_context_bounds_every_position() {
        let limits = Limits {
            max_seqs: 2,
            token_budget: 64,
            prefill_chunk: 32,
        };
        let mut r = recording();
        warm_up(&mut r, &limits, 64, 20).unwrap();
        for step in &r.steps {
            for (len, pos0, _) in step {
                assert!(pos0 + len <= 20, "{pos0} + {len}");
            }
        }
        // 20 positions: tables of 1 and 2 blocks, the last position 19.
        let widest = r
            .steps
            .iter()
            .filter(|s| s[0].0 == 1)
            .map(|s| (s[0].1, s[0].2.len()))
            .max();
        assert_eq!(widest, Some((19, 2)));
    }

    /// A runner that records nothing gets one decode step of each count, at the narrowest
    /// width, after the first pair that found it out.
    #[test]
    fn a_runner_that_records_nothing_gets_one_step_a_size() {
        let limits = Limits {
            max_seqs: 8,
            token_budget: 16,
            prefill_chunk: 16,
        };
        let mut r = Recorder::default();
        warm_up(&mut r, &limits, 64, 256).unwrap();
        let decodes: Vec<(usize, usize)> = r
            .steps
            .iter()
            .filter(|s| s[0].0 == 1)
            .map(|s| (s.len(), s[0].2.len()))
            .collect();
        assert_eq!(decodes, vec![(1, 1), (1, 1), (2, 1), (4, 1), (8, 1)]);
    }

    #[test]
    fn a_failed_step_is_an_error_naming_it() {
        struct Failing;
        impl StepRunner for Failing {
            fn run(&mut self, items: Vec<StepItem<'_>>) -> Vec<Result<StepOutput>> {
                items
                    .iter()
                    .map(|_| Err(Error::Device("out of GPU memory".into())))
                    .collect()
            }
        }
        let limits = Limits {
            max_seqs: 4,
            token_budget: 64,
            prefill_chunk: 32,
        };
        let e = warm_up(&mut Failing, &limits, 100, 64)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("a prompt step of 16 tokens") && e.contains("out of GPU memory"),
            "{e}"
        );
    }
}
