//! Tensor parallelism: a LLaMA-family model split over `world` ranks (Megatron-LM's
//! split), each rank a [`Model`] of its own on its own device, summing partial results
//! through a [`Collective`].
//!
//! - attention: the query heads are divided among the ranks; Q, K and V are split by rows
//!   (a rank computes its heads whole), the output projection by columns, so each rank's
//!   product is a partial sum that the all-reduce completes before the residual add. K/V
//!   heads are divided too when there are at least as many as ranks; with fewer, each
//!   rank keeps the one K/V head its query heads read (copies of it on `world / kv`
//!   ranks);
//! - feed-forward: gate and up by rows (a rank's slice of the hidden width), down by
//!   columns, and the same all-reduce;
//! - the output head by rows (the vocabulary), when the vocabulary divides among the
//!   ranks: each rank computes its slice of the logits and an all-gather puts them
//!   together, the same on every rank, so each samples the same token. A decode step reads
//!   1/world of the head on each rank (2.1 GB for llama3-70b in BF16, 11% of a TP=4 rank's
//!   step);
//! - the embedding by rows too, when the head is split and not tied to it: each rank holds
//!   its slice of the vocabulary and a zero row after it, looks its slice's tokens up and
//!   the others' as the zero row, and an all-reduce sums the ranks' rows (memory: 2.1 GB
//!   of llama3-70b's BF16 table a rank less at TP=2, for one small all-reduce a step);
//! - norms: whole on every rank (the hidden state is the same on all of them after each
//!   all-reduce).
//!
//! A rank's model is the same model definition with a smaller configuration (its heads,
//! K/V heads and FFN width) and the weights' slices, read straight from the file: no
//! rank holds another's part. A column slice of a quantized weight must fall on its
//! blocks (32 or 256 values); one that would not is refused before anything is loaded.

use crate::checkpoint::load_model;
use crate::config::{Arch, ModelConfig};
use crate::source::{GgufSource, RawTensor, Role, Source};
use crate::{config_gguf, Model};
use kiln_core::{Backend, Collective, Error, HostBytes, Result, Shape};
use kiln_io::gguf::GgufFile;
use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};

/// What a rank holds of one tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Shard {
    /// The whole tensor.
    Whole,
    /// Rows `range` of a `[rows, cols]` weight (elements of a bias), all columns.
    Rows(Range<usize>),
    /// Columns `range` of every row.
    Cols(Range<usize>),
}

/// The part of a layer or model a tensor is (the split is by part, whatever the file
/// calls it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
    Output,
    Embed,
    /// Norms.
    Replicated,
}

impl Part {
    fn of(role: Role) -> Result<Part> {
        Ok(match role {
            Role::Q => Part::Q,
            Role::K => Part::K,
            Role::V => Part::V,
            Role::O => Part::O,
            Role::Gate => Part::Gate,
            Role::Up => Part::Up,
            Role::Down => Part::Down,
            Role::Output => Part::Output,
            Role::Embed => Part::Embed,
            Role::OutNorm | Role::AttnNorm | Role::FfnNorm => Part::Replicated,
            Role::PosEmbed | Role::Qkv | Role::PostAttnNorm | Role::GateUp | Role::PostFfnNorm => {
                return Err(Error::unsupported(format!(
                    "{role:?} tensors: tensor parallelism splits the LLaMA family's separate Q, K, V and gate, up projections"
                )))
            }
        })
    }
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
    /// Its rows of the output head (its slice of the vocabulary), `None` where the head
    /// stays whole (a vocabulary that does not divide among the ranks).
    pub vocab: Option<Range<usize>>,
}

/// The split of a model over `world` ranks.
#[derive(Clone, Debug)]
pub struct Plan {
    pub world: usize,
    pub ranks: Vec<RankPlan>,
    head_dim: usize,
    /// Whether the embedding is split with the head (not where the head is the
    /// embedding: see [`Plan::with_tied_head`]).
    pub split_embed: bool,
}

impl Plan {
    /// The split of `config` over `world` ranks, or an error saying why it cannot be
    /// split so.
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
        let vocab = config.vocab_size / world;
        let split_vocab = world > 1 && config.vocab_size.is_multiple_of(world);
        let ranks = (0..world)
            .map(|rank| {
                let q = rank * per_rank..(rank + 1) * per_rank;
                RankPlan {
                    rank,
                    // The K/V heads its query heads read.
                    kv_heads: q.start / group..(q.end - 1) / group + 1,
                    heads: q,
                    ffn: rank * ffn..(rank + 1) * ffn,
                    vocab: split_vocab.then(|| rank * vocab..(rank + 1) * vocab),
                }
            })
            .collect();
        Ok(Plan {
            world,
            split_embed: split_vocab,
            ranks,
            head_dim: config.head_dim,
        })
    }

    /// The plan for a model whose output head is its embedding table (`tied`): the table
    /// stays whole, and so does the head.
    pub fn with_tied_head(mut self, tied: bool) -> Plan {
        self.split_embed &= !tied;
        self
    }

    /// Rows of the embedding table `rank` holds for a vocabulary of `vocab`: its slice and
    /// the zero row after it, or all of them.
    pub fn embed_rows(&self, rank: usize, vocab: usize) -> usize {
        match (
            self.split_embed,
            self.ranks.get(rank).and_then(|r| r.vocab.as_ref()),
        ) {
            (true, Some(v)) => v.len() + 1,
            _ => vocab,
        }
    }

    fn rank(&self, rank: usize) -> Result<&RankPlan> {
        self.ranks
            .get(rank)
            .ok_or_else(|| Error::shape(format!("rank {rank} of {}", self.world)))
    }

    /// What `rank` holds of a tensor that is `part`.
    pub fn shard(&self, rank: usize, part: Part) -> Result<Shard> {
        let r = self.rank(rank)?;
        let hd = self.head_dim;
        let heads = r.heads.start * hd..r.heads.end * hd;
        Ok(match part {
            Part::Q => Shard::Rows(heads),
            Part::K | Part::V => Shard::Rows(r.kv_heads.start * hd..r.kv_heads.end * hd),
            Part::O => Shard::Cols(heads),
            Part::Gate | Part::Up => Shard::Rows(r.ffn.clone()),
            Part::Down => Shard::Cols(r.ffn.clone()),
            Part::Output => r.vocab.clone().map_or(Shard::Whole, Shard::Rows),
            Part::Embed => match (self.split_embed, r.vocab.clone()) {
                (true, Some(v)) => Shard::Rows(v),
                _ => Shard::Whole,
            },
            Part::Replicated => Shard::Whole,
        })
    }

    /// `config` as `rank` runs it: its heads, K/V heads and FFN width.
    pub fn config(&self, config: &ModelConfig, rank: usize) -> Result<ModelConfig> {
        let r = self.rank(rank)?;
        Ok(ModelConfig {
            n_heads: r.heads.len(),
            n_kv_heads: r.kv_heads.len(),
            ffn_dim: r.ffn.len(),
            ..config.clone()
        })
    }
}

/// `t`'s part `shard`, as a tensor of its own; an error when a column range cuts `t`'s
/// blocks.
fn slice(name: &str, t: RawTensor, shard: &Shard) -> Result<RawTensor> {
    let dims = t.shape.dims().to_vec();
    let (rows, cols) = match dims.as_slice() {
        [n] => (*n, 1),
        [r, c] => (*r, *c),
        _ => return Err(Error::shape(format!("{name}: {} is not a matrix", t.shape))),
    };
    match shard {
        Shard::Whole => Ok(t),
        Shard::Rows(r) => {
            if r.end > rows {
                return Err(Error::shape(format!(
                    "{name} has {rows} rows; the split wants {}..{}",
                    r.start, r.end
                )));
            }
            // One element a row for a bias: its bytes are the row's.
            let row = t.dtype.row_bytes(cols)?;
            let bytes = t.bytes.slice(r.start * row..r.end * row)?;
            let mut d = dims.clone();
            d[0] = r.len();
            Ok(RawTensor {
                dtype: t.dtype,
                shape: Shape::new(d)?,
                bytes,
            })
        }
        Shard::Cols(c) => {
            if dims.len() != 2 || c.end > cols {
                return Err(Error::shape(format!(
                    "{name} ({}) has no columns {}..{}",
                    t.shape, c.start, c.end
                )));
            }
            let (Ok(skip), Ok(keep)) = (t.dtype.row_bytes(c.start), t.dtype.row_bytes(c.len()))
            else {
                return Err(Error::unsupported(format!(
                    "{name}: a rank would hold its columns {}..{}, which cut its {} blocks; use fewer ranks or another weight type",
                    c.start, c.end, t.dtype
                )));
            };
            let row = t.dtype.row_bytes(cols)?;
            let src = t.bytes.as_slice();
            let mut out = Vec::with_capacity(rows * keep);
            for r in 0..rows {
                out.extend_from_slice(&src[r * row + skip..][..keep]);
            }
            Ok(RawTensor {
                dtype: t.dtype,
                shape: Shape::new(vec![rows, c.len()])?,
                bytes: HostBytes::from_vec(out),
            })
        }
    }
}

/// `t` with a row of zeros after its rows (zero bytes are zeros in every type kiln
/// stores: a block's scale is zero too).
fn with_zero_row(t: RawTensor) -> Result<RawTensor> {
    let dims = t.shape.dims().to_vec();
    let row = t.dtype.row_bytes(dims[1])?;
    let mut bytes = t.bytes.as_slice().to_vec();
    bytes.resize(bytes.len() + row, 0);
    Ok(RawTensor {
        dtype: t.dtype,
        shape: Shape::new(vec![dims[0] + 1, dims[1]])?,
        bytes: HostBytes::from_vec(bytes),
    })
}

/// Refuse, before anything is loaded, a split whose column ranges would cut the blocks of
/// the output or down projections' type.
fn check_blocks(src: &dyn Source, config: &ModelConfig, plan: &Plan, rank: usize) -> Result<()> {
    for layer in 0..config.n_layers {
        for (role, part) in [(Role::O, Part::O), (Role::Down, Part::Down)] {
            let Some(name) = src.role_name(config.arch, role, layer) else {
                continue;
            };
            let name = format!("{name}.weight");
            let (Some(t), Shard::Cols(c)) = (src.get(&name)?, plan.shard(rank, part)?) else {
                continue;
            };
            if t.dtype.row_bytes(c.start).is_err() || t.dtype.row_bytes(c.len()).is_err() {
                return Err(Error::unsupported(format!(
                    "--tp {}: {name}: rank {rank} would hold its columns {}..{}, which cut its {} blocks; use fewer ranks or another weight type",
                    plan.world, c.start, c.end, t.dtype
                )));
            }
        }
    }
    Ok(())
}

/// A source that hands out one rank's slices of another source's tensors.
struct ShardSource<'a> {
    inner: &'a dyn Source,
    plan: &'a Plan,
    rank: usize,
    arch: Arch,
    /// The part of each tensor name the loader asked for (names come from `role_name`).
    parts: Mutex<HashMap<String, Role>>,
}

impl Source for ShardSource<'_> {
    fn name(&self) -> String {
        format!(
            "{} (rank {} of {})",
            self.inner.name(),
            self.rank,
            self.plan.world
        )
    }

    fn get(&self, name: &str) -> Result<Option<RawTensor>> {
        let Some(t) = self.inner.get(name)? else {
            return Ok(None);
        };
        let base = name
            .strip_suffix(".weight")
            .or_else(|| name.strip_suffix(".bias"))
            .unwrap_or(name);
        let role = self
            .parts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(base)
            .copied();
        let part = match role {
            Some(role) => Part::of(role)?,
            None => Part::Replicated,
        };
        let shard = self.plan.shard(self.rank, part)?;
        let sliced = slice(name, t, &shard)?;
        match (part, shard) {
            (Part::Embed, Shard::Rows(_)) => with_zero_row(sliced).map(Some),
            _ => Ok(Some(sliced)),
        }
    }

    fn embed_rows(&self, vocab: usize) -> usize {
        self.plan.embed_rows(self.rank, vocab)
    }

    /// What this rank holds, for the loader's check of free memory before it loads: its
    /// share of the split tensors (1/world of them) and the tensors it keeps whole (the
    /// embedding and head where they are not split; norms are counted as split, a few
    /// MB that the loader's working margin covers).
    fn stored_bytes(&self) -> Option<u64> {
        let total = self.inner.stored_bytes()?;
        let bytes_of = |role| -> u64 {
            self.inner
                .role_name(self.arch, role, 0)
                .and_then(|n| self.inner.get(&format!("{n}.weight")).ok().flatten())
                .map_or(0, |t| t.bytes.len() as u64)
        };
        let vocab_split = self.plan.ranks[self.rank].vocab.is_some();
        let whole = match (self.plan.split_embed, vocab_split) {
            (true, _) => 0,
            (false, true) => bytes_of(Role::Embed),
            (false, false) => bytes_of(Role::Embed) + bytes_of(Role::Output),
        };
        let world = self.plan.world as u64;
        Some((total - whole.min(total)).div_ceil(world) + whole)
    }

    fn output_rows(&self, vocab: usize) -> usize {
        self.plan.ranks[self.rank]
            .vocab
            .as_ref()
            .map_or(vocab, |v| v.len())
    }

    fn role_name(&self, arch: Arch, role: Role, layer: usize) -> Option<String> {
        let name = self.inner.role_name(arch, role, layer)?;
        self.parts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name.clone(), role);
        Some(name)
    }
}

impl Model {
    /// Rank `collective.rank()` of `file`'s model split over `collective.world()` ranks:
    /// its slices of the weights on `backend`, and the collective its projections sum
    /// through. Every rank loads its own, with the same file.
    pub fn from_gguf_rank(
        file: &GgufFile,
        backend: Arc<dyn Backend>,
        collective: Arc<dyn Collective>,
    ) -> Result<Model> {
        let config = config_gguf::config_from_gguf(file)?;
        Self::rank_of(&GgufSource(file), config, false, backend, collective)
    }

    /// A rank of the model `src` holds; `hf` for a Hugging Face checkpoint.
    pub(crate) fn rank_of(
        src: &dyn Source,
        config: ModelConfig,
        hf: bool,
        backend: Arc<dyn Backend>,
        collective: Arc<dyn Collective>,
    ) -> Result<Model> {
        let (rank, world) = (collective.rank(), collective.world());
        let tied = match src.role_name(config.arch, Role::Output, 0) {
            Some(name) => src.get(&format!("{name}.weight"))?.is_none(),
            None => true,
        };
        let plan = Plan::new(&config, world)?.with_tied_head(tied);
        check_blocks(src, &config, &plan, rank)?;
        let shard = ShardSource {
            inner: src,
            plan: &plan,
            rank,
            arch: config.arch,
            parts: Mutex::new(HashMap::new()),
        };
        let mut model = load_model(&shard, plan.config(&config, rank)?, hf, backend, None)?;
        model.collective = Some(collective);
        Ok(model)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Ffn, Norm};
    use kiln_core::DType;

    fn llama(heads: usize, kv: usize, ffn: usize) -> ModelConfig {
        ModelConfig {
            arch: Arch::Llama,
            vocab_size: 1000,
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

    fn ranges(plan: &Plan, part: Part) -> Vec<Range<usize>> {
        (0..plan.world)
            .map(|r| match plan.shard(r, part).unwrap() {
                Shard::Rows(x) | Shard::Cols(x) => x,
                Shard::Whole => panic!("{part:?} whole"),
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
        // 64 heads, 8 K/V heads, FFN 28672.
        let c = llama(64, 8, 28672);
        for world in [1, 2, 4, 8] {
            let p = Plan::new(&c, world).unwrap();
            assert!(tiles(&ranges(&p, Part::Q), 64 * 128));
            assert!(tiles(&ranges(&p, Part::K), 8 * 128));
            assert!(tiles(&ranges(&p, Part::O), 64 * 128));
            assert!(tiles(&ranges(&p, Part::Up), 28672));
            assert!(tiles(&ranges(&p, Part::Down), 28672));
            assert_eq!(p.shard(0, Part::Replicated).unwrap(), Shard::Whole);
            if world > 1 {
                assert!(tiles(&ranges(&p, Part::Output), 1000));
            }
            for r in &p.ranks {
                assert_eq!(r.kv_heads.start, r.heads.start / 8);
                assert_eq!(r.kv_heads.end, (r.heads.end - 1) / 8 + 1);
                let rc = p.config(&c, r.rank).unwrap();
                assert_eq!(
                    (rc.n_heads, rc.n_kv_heads, rc.ffn_dim, rc.dim),
                    (64 / world, 8 / world, 28672 / world, c.dim)
                );
            }
        }
    }

    #[test]
    fn a_vocabulary_that_does_not_divide_keeps_the_head_whole() {
        let mut c = llama(32, 8, 1024);
        c.vocab_size = 1001;
        let p = Plan::new(&c, 2).unwrap();
        assert_eq!(p.shard(1, Part::Output).unwrap(), Shard::Whole);
        assert_eq!(
            Plan::new(&c, 1).unwrap().shard(0, Part::Output).unwrap(),
            Shard::Whole
        );
    }

    #[test]
    fn a_ranks_stored_bytes_are_its_share() {
        let file = kiln_io::gguf::GgufFile::open(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../tests/fixtures/llama/llama-f32.gguf"),
        )
        .unwrap();
        let src = GgufSource(&file);
        let config = config_gguf::config_from_gguf(&file).unwrap();
        let total = src.stored_bytes().unwrap();
        for world in [2, 4] {
            // Untied and divisible: everything split, each rank about 1/world.
            let plan = Plan::new(&config, world).unwrap().with_tied_head(false);
            let shard = ShardSource {
                inner: &src,
                plan: &plan,
                rank: 1,
                arch: config.arch,
                parts: Mutex::new(HashMap::new()),
            };
            assert_eq!(shard.stored_bytes(), Some(total.div_ceil(world as u64)));
            // A tied head keeps the embedding whole on every rank.
            let tied = Plan::new(&config, world).unwrap().with_tied_head(true);
            let shard = ShardSource {
                plan: &tied,
                ..shard
            };
            let embed = 64 * 384 * 4;
            let want = (total - embed).div_ceil(world as u64) + embed;
            assert_eq!(shard.stored_bytes(), Some(want));
        }
    }

    #[test]
    fn fewer_kv_heads_than_ranks_are_replicated() {
        // 32 query heads over 2 K/V heads, 8 ranks: 4 query heads a rank, one K/V head
        // each, every K/V head on 4 ranks.
        let p = Plan::new(&llama(32, 2, 1024), 8).unwrap();
        let kv: Vec<_> = p.ranks.iter().map(|r| r.kv_heads.clone()).collect();
        assert_eq!(kv, [0..1, 0..1, 0..1, 0..1, 1..2, 1..2, 1..2, 1..2]);
        assert_eq!(p.shard(5, Part::V).unwrap(), Shard::Rows(128..256));
    }

    #[test]
    fn splits_that_cannot_work_are_refused_naming_why() {
        let err = |c: ModelConfig, w: usize| Plan::new(&c, w).unwrap_err().to_string();
        assert!(err(llama(32, 8, 1024), 3).contains("32 attention heads"));
        assert!(err(llama(24, 6, 1024), 4).contains("6 K/V heads"));
        assert!(err(llama(32, 8, 1000), 16).contains("feed-forward width 1000"));
        assert!(err(llama(32, 8, 1024), 0).contains("at least one rank"));
        let mut gpt2 = llama(32, 8, 1024);
        gpt2.arch = Arch::Gpt2;
        assert!(err(gpt2, 2).contains("LLaMA family"));
        assert!(Part::of(Role::Qkv).is_err());
    }

    #[test]
    fn slices_take_the_rows_and_columns_they_name() {
        // A 3 × 64 F32 matrix whose element (r, c) is 1000 r + c.
        let values: Vec<f32> = (0..3 * 64)
            .map(|i| (1000 * (i / 64) + i % 64) as f32)
            .collect();
        let raw = || RawTensor {
            dtype: DType::F32,
            shape: Shape::new(vec![3, 64]).unwrap(),
            bytes: HostBytes::from_vec(kiln_core::quant::quantize(DType::F32, &values).unwrap()),
        };
        let floats = |t: &RawTensor| -> Vec<f32> {
            t.bytes
                .as_slice()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()
        };
        let rows = slice("w", raw(), &Shard::Rows(1..3)).unwrap();
        assert_eq!(rows.shape.dims(), &[2, 64]);
        assert_eq!(floats(&rows)[0], 1000.0);
        let cols = slice("w", raw(), &Shard::Cols(32..40)).unwrap();
        assert_eq!(cols.shape.dims(), &[3, 8]);
        assert_eq!(floats(&cols)[..3], [32.0, 33.0, 34.0]);
        assert_eq!(floats(&cols)[8], 1032.0);
        // Q8_0 columns must fall on its blocks of 32.
        let q8 = RawTensor {
            dtype: DType::Q8_0,
            shape: Shape::new(vec![3, 64]).unwrap(),
            bytes: HostBytes::from_vec(kiln_core::quant::quantize(DType::Q8_0, &values).unwrap()),
        };
        let e = slice("blk.0.ffn_down.weight", q8, &Shard::Cols(16..48))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("cut its q8_0 blocks"), "{e}");
        assert!(slice("w", raw(), &Shard::Rows(2..4)).is_err());
    }
}
