//! The tensor-parallel split of a LLaMA-family model over `world` ranks (Megatron-LM's):
//!
//! - attention: the query heads are divided among the ranks; Q, K and V are split by
//!   rows (a rank computes its heads whole), and the output projection by columns, so
//!   each rank's product is a partial sum that an all-reduce completes. K and V heads
//!   are divided too when there are at least as many as ranks; with fewer, each rank
//!   keeps the one K/V head its query heads read (copies of it on `world / kv_heads`
//!   ranks);
//! - feed-forward: gate and up by rows (a rank's slice of the hidden width), down by
//!   columns, followed by the same all-reduce;
//! - embedding and output head: by vocabulary rows (a rank looks up the ids in its range
//!   and contributes zeros for the others, then an all-reduce; its logits are its rows'
//!   of the vocabulary);
//! - norms: whole on every rank.
//!
//! A column range of a quantized weight must start and end on its blocks (32 or 256
//! values): [`Plan::check_blocks`] says which tensor does not, before any is loaded.

use kiln_core::{Error, Result};
use kiln_models::{Arch, ModelConfig};
use std::ops::Range;

/// What a rank holds of one tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Shard {
    /// The whole tensor (norms).
    Whole,
    /// Rows `range` of a `[rows, cols]` weight (or elements of a bias), all columns.
    Rows(Range<usize>),
    /// Columns `range` of every row.
    Cols(Range<usize>),
}

/// One rank's part of the model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankPlan {
    pub rank: usize,
    /// Query heads this rank computes.
    pub heads: Range<usize>,
    /// K/V heads it holds (those its query heads read).
    pub kv_heads: Range<usize>,
    /// Its slice of the feed-forward's hidden width.
    pub ffn: Range<usize>,
    /// Its rows of the vocabulary (embedding and output head).
    pub vocab: Range<usize>,
}

/// The split of a model over `world` ranks.
#[derive(Clone, Debug)]
pub struct Plan {
    pub world: usize,
    pub ranks: Vec<RankPlan>,
    head_dim: usize,
}

impl Plan {
    /// The split of `config` over `world` ranks, or an error saying why it cannot be
    /// split so (and what would do).
    pub fn new(config: &ModelConfig, world: usize) -> Result<Plan> {
        let refuse = |why: String| Err(Error::unsupported(format!("--tp {world}: {why}")));
        if world == 0 {
            return refuse("at least one rank".into());
        }
        if !matches!(config.arch, Arch::Llama | Arch::Mistral) {
            return refuse(format!(
                "tensor parallelism is for the LLaMA family (llama, mistral); this model is {}",
                config.arch.name()
            ));
        }
        let (heads, kv) = (config.n_heads, config.n_kv_heads);
        if !heads.is_multiple_of(world) {
            return refuse(format!(
                "the model's {heads} attention heads do not divide among {world} ranks"
            ));
        }
        if kv == 0 || !heads.is_multiple_of(kv) {
            return refuse(format!("{heads} query heads over {kv} K/V heads"));
        }
        if !kv.is_multiple_of(world) && !world.is_multiple_of(kv) {
            return refuse(format!(
                "the model's {kv} K/V heads neither divide among {world} ranks nor divide them"
            ));
        }
        if !config.ffn_dim.is_multiple_of(world) {
            return refuse(format!(
                "the feed-forward width {} does not divide among {world} ranks",
                config.ffn_dim
            ));
        }
        let group = heads / kv;
        let per_rank = heads / world;
        let ffn = config.ffn_dim / world;
        let vocab = config.vocab_size.div_ceil(world);
        let ranks = (0..world)
            .map(|rank| {
                let q = rank * per_rank..(rank + 1) * per_rank;
                // The K/V heads its query heads read: q.start / group .. (q.end - 1) / group.
                let kv_heads = q.start / group..(q.end - 1) / group + 1;
                RankPlan {
                    rank,
                    heads: q,
                    kv_heads,
                    ffn: rank * ffn..(rank + 1) * ffn,
                    vocab: (rank * vocab).min(config.vocab_size)
                        ..((rank + 1) * vocab).min(config.vocab_size),
                }
            })
            .collect();
        Ok(Plan {
            world,
            ranks,
            head_dim: config.head_dim,
        })
    }

    /// What `rank` holds of the tensor named `name` (GGUF names); an error for a tensor
    /// the split does not know.
    pub fn shard(&self, rank: usize, name: &str) -> Result<Shard> {
        let r = self
            .ranks
            .get(rank)
            .ok_or_else(|| Error::shape(format!("rank {rank} of {}", self.world)))?;
        let hd = self.head_dim;
        let heads = r.heads.start * hd..r.heads.end * hd;
        let kv = r.kv_heads.start * hd..r.kv_heads.end * hd;
        let layer = name
            .strip_prefix("blk.")
            .and_then(|rest| rest.split_once('.'))
            .map(|(_, t)| t);
        let shard = match (layer, name) {
            (Some("attn_q.weight" | "attn_q.bias"), _) => Shard::Rows(heads),
            (Some("attn_k.weight" | "attn_k.bias" | "attn_v.weight" | "attn_v.bias"), _) => {
                Shard::Rows(kv)
            }
            (Some("attn_output.weight"), _) => Shard::Cols(heads),
            (Some("ffn_gate.weight" | "ffn_up.weight"), _) => Shard::Rows(r.ffn.clone()),
            (Some("ffn_down.weight"), _) => Shard::Cols(r.ffn.clone()),
            (Some("attn_norm.weight" | "ffn_norm.weight"), _) => Shard::Whole,
            (None, "token_embd.weight" | "output.weight") => Shard::Rows(r.vocab.clone()),
            (None, "output_norm.weight") => Shard::Whole,
            _ => {
                return Err(Error::unsupported(format!(
                    "{name}: not a tensor of the LLaMA family's tensor-parallel split"
                )))
            }
        };
        Ok(shard)
    }

    /// Refuse a column split that cuts a quantized block: `blocks(name)` is the block
    /// length of the tensor's type (1 for float types). Checked for every rank before
    /// anything is loaded.
    pub fn check_blocks(&self, names: &[(&str, usize)]) -> Result<()> {
        for rank in 0..self.world {
            for &(name, block) in names {
                if let Shard::Cols(c) = self.shard(rank, name)? {
                    if block > 1 && (c.start % block != 0 || c.end % block != 0) {
                        return Err(Error::unsupported(format!(
                            "--tp {}: rank {rank} would hold columns {}..{} of {name}, which cut its blocks of {block}; use fewer ranks or another weight type",
                            self.world, c.start, c.end
                        )));
                    }
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_models::{Ffn, Norm};

    fn llama(heads: usize, kv: usize, ffn: usize, vocab: usize) -> ModelConfig {
        ModelConfig {
            arch: Arch::Llama,
            vocab_size: vocab,
            dim: heads * 128,
            n_layers: 2,
            n_heads: heads,
            n_kv_heads: kv,
            head_dim: 128,
            ffn_dim: ffn,
            max_positions: 8192,
            norm: Norm::Rms { eps: 1e-5 },
            ffn: Ffn::SwiGlu,
            rope: None,
            attn_scale: 1.0,
            attn_softcap: None,
            final_softcap: None,
            sliding_window: None,
            sliding_layers: vec![false; 2],
            embed_scale: None,
            post_norms: false,
        }
    }

    /// Every rank's rows of a row-split tensor, in rank order, must tile `0..len` (or,
    /// for replicated K/V heads, cover it with each head on world / kv ranks).
    fn rows(plan: &Plan, name: &str) -> Vec<Range<usize>> {
        (0..plan.world)
            .map(|r| match plan.shard(r, name).unwrap() {
                Shard::Rows(x) | Shard::Cols(x) => x,
                Shard::Whole => panic!("{name} whole"),
            })
            .collect()
    }

    fn tiles(parts: &[Range<usize>], len: usize) -> bool {
        parts.first().is_some_and(|p| p.start == 0)
            && parts.windows(2).all(|w| w[0].end == w[1].start)
            && parts.last().is_some_and(|p| p.end == len)
    }

    #[test]
    fn llama3_70b_splits_evenly_at_2_4_and_8() {
        // 64 heads, 8 K/V heads, FFN 28672, vocabulary 128256.
        let c = llama(64, 8, 28672, 128256);
        for world in [1, 2, 4, 8] {
            let p = Plan::new(&c, world).unwrap();
            assert!(tiles(&rows(&p, "blk.0.attn_q.weight"), 64 * 128));
            assert!(tiles(&rows(&p, "blk.3.attn_k.weight"), 8 * 128));
            assert!(tiles(&rows(&p, "blk.3.attn_output.weight"), 64 * 128));
            assert!(tiles(&rows(&p, "blk.1.ffn_up.weight"), 28672));
            assert!(tiles(&rows(&p, "blk.1.ffn_down.weight"), 28672));
            assert!(tiles(&rows(&p, "output.weight"), 128256));
            assert_eq!(p.shard(0, "blk.0.attn_norm.weight").unwrap(), Shard::Whole);
            // K/V heads are those the rank's query heads read (groups of 8 here).
            for r in &p.ranks {
                assert_eq!(r.kv_heads.start, r.heads.start / 8);
                assert_eq!(r.kv_heads.end, (r.heads.end - 1) / 8 + 1);
            }
            // Q4_K and Q6_K blocks of 256: the column splits fall on them.
            p.check_blocks(&[
                ("blk.0.attn_output.weight", 256),
                ("blk.0.ffn_down.weight", 256),
            ])
            .unwrap();
        }
    }

    #[test]
    fn fewer_kv_heads_than_ranks_are_replicated() {
        // 32 query heads over 2 K/V heads, 8 ranks: 4 query heads a rank, one K/V head
        // each, every K/V head on 4 ranks.
        let p = Plan::new(&llama(32, 2, 1024, 1000), 8).unwrap();
        let kv: Vec<_> = p.ranks.iter().map(|r| r.kv_heads.clone()).collect();
        assert_eq!(kv, [0..1, 0..1, 0..1, 0..1, 1..2, 1..2, 1..2, 1..2]);
        assert_eq!(
            p.shard(5, "blk.0.attn_v.weight").unwrap(),
            Shard::Rows(128..256)
        );
        // An uneven vocabulary: the last rank's range is shorter, and all of them tile it.
        assert!(tiles(&rows(&p, "token_embd.weight"), 1000));
        assert_eq!(p.ranks[7].vocab, 875..1000);
    }

    #[test]
    fn splits_that_cannot_work_are_refused_naming_why() {
        let err = |c: ModelConfig, w: usize| Plan::new(&c, w).unwrap_err().to_string();
        assert!(err(llama(32, 8, 1024, 100), 3).contains("32 attention heads"));
        assert!(err(llama(24, 6, 1024, 100), 4).contains("6 K/V heads"));
        assert!(err(llama(32, 8, 1000, 100), 16).contains("feed-forward width 1000"));
        assert!(err(llama(32, 8, 1024, 100), 0).contains("at least one rank"));
        let mut gpt2 = llama(32, 8, 1024, 100);
        gpt2.arch = Arch::Gpt2;
        assert!(err(gpt2, 2).contains("LLaMA family"));
        // A column split inside a block of 256: 2 heads of 64 dimensions a rank.
        let mut c = llama(8, 8, 1024, 100);
        c.head_dim = 64;
        let p = Plan::new(&c, 4).unwrap();
        let msg = p
            .check_blocks(&[("blk.0.attn_output.weight", 256)])
            .unwrap_err()
            .to_string();
        assert!(msg.contains("cut its blocks of 256"), "{msg}");
        p.check_blocks(&[("blk.0.attn_output.weight", 32)]).unwrap();
        assert!(p.shard(0, "blk.0.attn_qkv.weight").is_err());
    }
}
