//! The forward pass, written once for every architecture: one straight sequence of
//! backend ops, steered by [`ModelConfig`].

use crate::batch::{DecodeGraphs, PagedKvCache, PagedRows};
use crate::config::{Ffn, ModelConfig, Norm};
use crate::kv_cache::KvCache;
use crate::weights::{FfnWeights, GateUp, Linear, ModelWeights, NormWeights, Qkv};
use kiln_core::{
    quant, AttentionParams, Backend, Collective, DType, Error, Replay, Result, RmsNorm,
    SampleParams, Shape, Tensor,
};
use std::sync::Arc;

/// Which positions' logits a forward pass returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// The last position only (generation).
    Last,
    /// Every position (perplexity, tests).
    All,
}

/// What a step ends with: logits, or (for training, which fuses the output projection
/// into its loss) the final normed hidden states.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Output {
    Logits(Logits),
    Hidden,
}

/// Where a step's keys and values go and come from.
pub(crate) enum KvTarget<'a> {
    /// One sequence's contiguous cache: position `p` is row `p`.
    Contiguous(&'a mut KvCache),
    /// Blocks of a pool shared by the step's sequences.
    Paged {
        cache: &'a mut PagedKvCache,
        rows: PagedRows<'a>,
    },
}

/// Buffers for a batch of `n` tokens, allocated once per batch size and reused.
pub(crate) struct Scratch {
    pub(crate) n: usize,
    /// I32 `[n]`: the token ids and their positions, the only inputs a step writes.
    pub(crate) ids: Tensor,
    /// I32 `[n]`: the ids as rows of this rank's slice of a split embedding table.
    pub(crate) local_ids: Option<Tensor>,
    pub(crate) positions: Tensor,
    pub(crate) x: Tensor,
    pub(crate) h: Tensor,
    pub(crate) q: Tensor,
    pub(crate) k: Tensor,
    pub(crate) v: Tensor,
    pub(crate) qkv: Option<Tensor>,
    pub(crate) attn: Tensor,
    pub(crate) o: Tensor,
    pub(crate) gate: Tensor,
    pub(crate) up: Tensor,
    pub(crate) gate_up: Option<Tensor>,
    pub(crate) act: Tensor,
    pub(crate) down: Tensor,
    /// GPT-2's learned position embeddings of the batch.
    pub(crate) pos_embed: Option<Tensor>,
    /// The last row of `h`, `[1, dim]`.
    pub(crate) last: Tensor,
    /// `[1, vocab]`: the last position's logits.
    pub(crate) logits: Tensor,
    /// `[1, rows]`: this rank's part of them, where the output head is split by
    /// vocabulary over the ranks.
    pub(crate) head_part: Option<Tensor>,
    /// `[n, vocab]`, made by the first [`Logits::All`] pass of this size: large, and
    /// needed only for perplexity and tests.
    pub(crate) all_logits: Option<Tensor>,
    /// Where a vocabulary-split head gathers `all_logits`, made with them.
    pub(crate) split_logits: Option<SplitLogits>,
    /// I32 `[1]`: the greedy token, all that [`Model::forward_argmax`] reads back.
    pub(crate) next: Tensor,
}

/// A vocabulary-split head's buffers for `n` rows (see [`Model::gather_all_logits`]).
pub(crate) struct SplitLogits {
    /// `[n, rows]`: this rank's columns.
    part: Tensor,
    /// `[world · n, rows]`: every rank's, rank-major.
    gathered: Tensor,
    /// I32 `[world · n]`: where each gathered row goes in `[n · world, rows]`.
    to: Tensor,
}

impl Scratch {
    fn logits(&self, which: Logits) -> &Tensor {
        match which {
            Logits::All => self.all_logits.as_ref().expect("made before the step"),
            Logits::Last => &self.logits,
        }
    }
}

/// Where one-token steps stand with recording (see [`Backend::capture`]).
enum Graph {
    /// No one-token step yet on the cache in use.
    Cold,
    /// One step ran eagerly on cache `cache`, so the backend's own buffers exist and the
    /// next step can be recorded.
    Warm { cache: u64 },
    /// The step recorded on cache `cache`.
    Recorded { cache: u64, replay: Box<dyn Replay> },
    /// The backend does not record: stop asking.
    Unsupported,
}

pub struct Model {
    pub config: ModelConfig,
    weights: ModelWeights,
    backend: Arc<dyn Backend>,
    /// One-token steps have their own scratch, so that prefills do not move the buffers a
    /// recorded step refers to.
    decode: Option<Scratch>,
    /// The most recent batch of several tokens.
    prefill: Option<Scratch>,
    graphs: bool,
    graph: Graph,
    /// Recorded decode steps of a server's batches (see `batch::graphs`).
    pub(crate) decode_graphs: DecodeGraphs,
    /// The other ranks of a model split over several devices (`crate::tp`): the
    /// attention's output and the feed-forward's down projection are partial sums here,
    /// completed through it before the residual add.
    pub(crate) collective: Option<Arc<dyn Collective>>,
}

fn f32_tensor(b: &dyn Backend, dims: &[usize]) -> Result<Tensor> {
    b.zeros(DType::F32, Shape::new(dims.to_vec())?)
}

fn reshape(t: &mut Tensor, dims: &[usize]) -> Result<()> {
    t.reshape(Shape::new(dims.to_vec())?)
}

/// Little-endian I32 bytes of ids or positions (checked by the caller to fit).
fn i32_bytes(values: impl Iterator<Item = usize>) -> Vec<u8> {
    values.flat_map(|v| (v as i32).to_le_bytes()).collect()
}

impl Model {
    pub(crate) fn new(
        config: ModelConfig,
        weights: ModelWeights,
        backend: Arc<dyn Backend>,
    ) -> Self {
        Model {
            config,
            weights,
            backend,
            decode: None,
            prefill: None,
            graphs: std::env::var_os("KILN_NO_GRAPHS").is_none_or(|v| v != "1"),
            graph: Graph::Cold,
            decode_graphs: DecodeGraphs::default(),
            collective: None,
        }
    }

    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// Bytes of weights a one-token step reads (see [`ModelWeights::decode_bytes`]).
    pub fn decode_bytes(&self) -> usize {
        self.weights.decode_bytes()
    }

    /// Whether steps are recorded and replayed where the backend can (see `set_graphs`).
    pub(crate) fn graphs_on(&self) -> bool {
        self.graphs
    }

    /// Rows of the embedding table: token ids must be below it.
    pub(crate) fn vocab_rows(&self) -> usize {
        match self.split_embed() {
            Some(_) => self.config.vocab_size,
            None => self.weights.embed.dims()[0],
        }
    }

    /// The collective and this rank's first token id, where this rank holds a slice of
    /// the embedding table (and a zero row after it, see [`crate::tp`]).
    fn split_embed(&self) -> Option<(&Arc<dyn Collective>, usize)> {
        let rows = self.weights.embed.dims()[0];
        let c = self
            .collective
            .as_ref()
            .filter(|_| rows != self.config.vocab_size)?;
        Some((c, c.rank() * (rows - 1)))
    }

    /// Write a step's token ids into `s`, and where the embedding is split, each id as
    /// a row of this rank's slice (the zero row for the others' tokens).
    pub(crate) fn write_ids(
        &self,
        s: &mut Scratch,
        ids: impl Iterator<Item = usize> + Clone,
    ) -> Result<()> {
        let b = self.backend.as_ref();
        b.write(&mut s.ids, &i32_bytes(ids.clone()))?;
        if let (Some((_, first)), Some(local)) = (self.split_embed(), s.local_ids.as_mut()) {
            let zero = self.weights.embed.dims()[0] - 1;
            let rows = ids.map(|id| match id.checked_sub(first) {
                Some(r) if r < zero => r,
                _ => zero,
            });
            b.write(local, &i32_bytes(rows))?;
        }
        Ok(())
    }

    /// Positions a model with learned position embeddings (GPT-2) has.
    pub(crate) fn learned_positions(&self) -> Option<usize> {
        self.weights.pos_embed.as_ref().map(|pe| pe.dims()[0])
    }

    pub(crate) fn out_norm(&self) -> &NormWeights {
        &self.weights.out_norm
    }

    /// The output projection (the embedding table when they are tied).
    pub(crate) fn head_weight(&self) -> &Tensor {
        self.weights.output.as_ref().unwrap_or(&self.weights.embed)
    }

    /// The collective that gathers the logits, where this rank holds a slice of the
    /// output head's rows (the vocabulary split over the ranks, see [`crate::tp`]).
    pub(crate) fn split_head(&self) -> Option<&Arc<dyn Collective>> {
        let rows = self.head_weight().dims()[0];
        self.collective
            .as_ref()
            .filter(|_| rows != self.config.vocab_size)
    }

    pub(crate) fn weights(&self) -> &ModelWeights {
        &self.weights
    }

    pub(crate) fn weights_mut(&mut self) -> &mut ModelWeights {
        &mut self.weights
    }

    /// Record one-token steps and replay them (CUDA graphs) where the backend can. On by
    /// default; `KILN_NO_GRAPHS=1` turns it off.
    pub fn set_graphs(&mut self, on: bool) {
        self.graphs = on;
        if !on && !matches!(self.graph, Graph::Unsupported) {
            self.graph = Graph::Cold;
        }
        if !on {
            self.decode_graphs = DecodeGraphs::default();
        }
    }

    pub(crate) fn new_scratch(&self, n: usize) -> Result<Scratch> {
        let c = &self.config;
        let b = self.backend.as_ref();
        let fused_qkv = self
            .weights
            .layers
            .iter()
            .any(|l| matches!(l.qkv, Qkv::Fused(_)));
        let fused_gu = self.weights.layers.iter().any(|l| {
            matches!(
                l.ffn,
                FfnWeights::Gated {
                    gate_up: GateUp::Fused(_),
                    ..
                }
            )
        });
        let i32_tensor = |len: usize| b.zeros(DType::I32, Shape::new(vec![len])?);
        Ok(Scratch {
            n,
            ids: i32_tensor(n)?,
            local_ids: self.split_embed().map(|_| i32_tensor(n)).transpose()?,
            positions: i32_tensor(n)?,
            x: f32_tensor(b, &[n, c.dim])?,
            h: f32_tensor(b, &[n, c.dim])?,
            q: f32_tensor(b, &[n, c.q_dim()])?,
            k: f32_tensor(b, &[n, c.kv_dim()])?,
            v: f32_tensor(b, &[n, c.kv_dim()])?,
            qkv: fused_qkv
                .then(|| f32_tensor(b, &[n, c.q_dim() + 2 * c.kv_dim()]))
                .transpose()?,
            attn: f32_tensor(b, &[n, c.n_heads, c.head_dim])?,
            o: f32_tensor(b, &[n, c.dim])?,
            gate: f32_tensor(b, &[n, c.ffn_dim])?,
            up: f32_tensor(b, &[n, c.ffn_dim])?,
            gate_up: fused_gu
                .then(|| f32_tensor(b, &[n, 2 * c.ffn_dim]))
                .transpose()?,
            act: f32_tensor(b, &[n, c.ffn_dim])?,
            down: f32_tensor(b, &[n, c.dim])?,
            pos_embed: self
                .weights
                .pos_embed
                .is_some()
                .then(|| f32_tensor(b, &[n, c.dim]))
                .transpose()?,
            last: f32_tensor(b, &[1, c.dim])?,
            logits: f32_tensor(b, &[1, c.vocab_size])?,
            head_part: self
                .split_head()
                .map(|_| f32_tensor(b, &[1, self.head_weight().dims()[0]]))
                .transpose()?,
            all_logits: None,
            split_logits: None,
            next: i32_tensor(1)?,
        })
    }

    /// Run `ids` at positions `pos0..` through the model, filling the cache, and return
    /// logits (row-major, `vocab_size` per returned position).
    pub fn forward(
        &mut self,
        ids: &[u32],
        pos0: usize,
        cache: &mut KvCache,
        which: Logits,
    ) -> Result<Vec<f32>> {
        // One token's logits are the last position's: a decode step either way.
        let which = if ids.len() == 1 { Logits::Last } else { which };
        self.run(ids, pos0, cache, Output::Logits(which), |m, s| {
            download_f32(m.backend.as_ref(), s.logits(which))
        })
    }

    /// Run `ids` at positions `pos0..` like [`Model::forward`], but stop at the final
    /// norm: `f` gets the normed hidden states `[n, dim]` and the output projection
    /// `[vocab, dim]` (the embeddings, when tied). Training fuses the projection into its
    /// loss, so that the `[n, vocab]` logits never exist whole. The final softcap, when the
    /// model has one, is `config.final_softcap`.
    pub fn forward_hidden<T>(
        &mut self,
        ids: &[u32],
        pos0: usize,
        cache: &mut KvCache,
        f: impl FnOnce(&Tensor, &Tensor) -> Result<T>,
    ) -> Result<T> {
        self.run(ids, pos0, cache, Output::Hidden, |m, s| {
            f(&s.h, m.head_weight())
        })
    }

    /// Like [`Model::forward`] with [`Logits::Last`], but return only the most likely next
    /// token (the first, on ties), found on the device: greedy decoding reads back 4 bytes.
    pub fn forward_argmax(&mut self, ids: &[u32], pos0: usize, cache: &mut KvCache) -> Result<u32> {
        self.run(ids, pos0, cache, Output::Logits(Logits::Last), |m, s| {
            let b = m.backend.as_ref();
            b.argmax(&s.logits, &mut s.next)?;
            read_token(b, &s.next)
        })
    }

    /// Like [`Model::forward_argmax`], but draw the next token with `params`, the
    /// repetition penalty applying to `penalized`; where the backend samples on the
    /// device, only the token is read back.
    pub fn forward_sample(
        &mut self,
        ids: &[u32],
        pos0: usize,
        cache: &mut KvCache,
        penalized: &[u32],
        params: &SampleParams,
    ) -> Result<u32> {
        self.run(ids, pos0, cache, Output::Logits(Logits::Last), |m, s| {
            let b = m.backend.as_ref();
            b.sample(&mut s.logits, penalized, params, &mut s.next)?;
            read_token(b, &s.next)
        })
    }

    /// Check the inputs, take the scratch for `ids.len()` tokens, run the step, and `read`
    /// its result.
    fn run<T>(
        &mut self,
        ids: &[u32],
        pos0: usize,
        cache: &mut KvCache,
        which: Output,
        read: impl FnOnce(&Model, &mut Scratch) -> Result<T>,
    ) -> Result<T> {
        let n = ids.len();
        if n == 0 {
            return Err(Error::shape("forward of no tokens"));
        }
        if pos0 + n > cache.capacity {
            return Err(Error::shape(format!(
                "positions {pos0}..{} exceed the context of {} tokens",
                pos0 + n,
                cache.capacity
            )));
        }
        // Checked here because a device may not report a bad index mid-step.
        let vocab = self.vocab_rows();
        if let Some(id) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(Error::shape(format!(
                "token id {id} is outside the vocabulary of {vocab}"
            )));
        }
        if let Some(pe) = &self.weights.pos_embed {
            if pos0 + n > pe.dims()[0] {
                return Err(Error::shape(format!(
                    "positions {pos0}..{} exceed the model's {} learned positions",
                    pos0 + n,
                    pe.dims()[0]
                )));
            }
        }
        let kept = if n == 1 {
            self.decode.take()
        } else {
            self.prefill.take().filter(|s| s.n == n)
        };
        let mut s = match kept {
            Some(s) => s,
            None => self.new_scratch(n)?,
        };
        let result = self
            .step(&mut s, ids, pos0, cache, which)
            .and_then(|()| read(self, &mut s));
        if n == 1 {
            self.decode = Some(s);
        } else {
            self.prefill = Some(s);
        }
        result
    }

    /// Write the step's ids and positions, then run its ops: eagerly, or for one-token
    /// steps by recording them once and replaying the recording. On a rank of a split
    /// model, an error where the ranks' collective failed (a replay does not call it).
    fn step(
        &mut self,
        s: &mut Scratch,
        ids: &[u32],
        pos0: usize,
        cache: &mut KvCache,
        which: Output,
    ) -> Result<()> {
        // Before too: a recorded step would replay collectives on an aborted group.
        if let Some(c) = &self.collective {
            c.check()?;
        }
        self.step_ops(s, ids, pos0, cache, which)?;
        match &self.collective {
            Some(c) => c.check(),
            None => Ok(()),
        }
    }

    fn step_ops(
        &mut self,
        s: &mut Scratch,
        ids: &[u32],
        pos0: usize,
        cache: &mut KvCache,
        which: Output,
    ) -> Result<()> {
        let b = self.backend.clone();
        let n = ids.len();
        self.write_ids(s, ids.iter().map(|&id| id as usize))?;
        b.write(&mut s.positions, &i32_bytes(pos0..pos0 + n))?;
        if which == Output::Logits(Logits::All) && s.all_logits.is_none() {
            s.all_logits = Some(f32_tensor(b.as_ref(), &[n, self.config.vocab_size])?);
            s.split_logits = self.split_logits(n)?;
        }
        if !(self.graphs && n == 1 && which == Output::Logits(Logits::Last)) {
            return self.ops(s, cache, which);
        }
        // Taken out while the step runs: an error leaves `Cold`, and the next steps start
        // over.
        self.graph = match std::mem::replace(&mut self.graph, Graph::Cold) {
            Graph::Unsupported => {
                self.ops(s, cache, which)?;
                Graph::Unsupported
            }
            Graph::Recorded { cache: id, replay } if id == cache.id => {
                replay.replay()?;
                Graph::Recorded { cache: id, replay }
            }
            Graph::Warm { cache: id } if id == cache.id => {
                match b.capture(&mut || self.ops(s, cache, which))? {
                    // Recorded, not yet run.
                    Some(replay) => {
                        replay.replay()?;
                        Graph::Recorded { cache: id, replay }
                    }
                    None => Graph::Unsupported,
                }
            }
            // The first step on this cache (a recording on another is dropped): eager, so
            // that the backend sets up its buffers before anything is recorded.
            _ => {
                self.ops(s, cache, which)?;
                Graph::Warm { cache: cache.id }
            }
        };
        Ok(())
    }

    /// The step's ops, from the embedding to the logits. Nothing here allocates: the ops
    /// may be recorded.
    fn ops(&self, s: &mut Scratch, cache: &mut KvCache, which: Output) -> Result<()> {
        self.layers(s, &mut KvTarget::Contiguous(cache))?;
        self.head(s, which)
    }

    /// The embedding and every layer: `s.x` holds the last layer's output.
    pub(crate) fn layers(&self, s: &mut Scratch, kv: &mut KvTarget) -> Result<()> {
        self.embed(s)?;
        for l in 0..self.weights.layers.len() {
            self.layer(l, s, kv)?;
        }
        Ok(())
    }

    /// The embedding of `s.ids` (at `s.positions`) into `s.x`, the first layer's input.
    pub(crate) fn embed(&self, s: &mut Scratch) -> Result<()> {
        let c = &self.config;
        let b = self.backend.as_ref();
        let w = &self.weights;
        match (self.split_embed(), &s.local_ids) {
            (Some((c, _)), Some(local)) => {
                b.embedding(&w.embed, local, &mut s.x)?;
                c.all_reduce_sum(&mut s.x)?;
            }
            _ => b.embedding(&w.embed, &s.ids, &mut s.x)?,
        }
        if let Some(scale) = c.embed_scale {
            b.scale(&mut s.x, scale)?;
        }
        if let (Some(pe), Some(pos)) = (&w.pos_embed, s.pos_embed.as_mut()) {
            b.embedding(pe, &s.positions, pos)?;
            b.add_assign(&mut s.x, pos)?;
        }
        Ok(())
    }

    /// Layer `l` over `s.x`, in place: its input is `s.x`, and so is its output.
    pub(crate) fn layer(&self, l: usize, s: &mut Scratch, kv: &mut KvTarget) -> Result<()> {
        let c = &self.config;
        let b = self.backend.as_ref();
        let lw = &self.weights.layers[l];
        let w = &self.weights;
        let n = s.n;
        // Attention block.
        match &lw.qkv {
            Qkv::Fused(qkv) => {
                self.norm(&lw.attn_norm, &s.x, &mut s.h)?;
                let buf = s.qkv.as_mut().expect("allocated for fused models");
                self.linear(qkv, &s.h, buf)?;
                b.slice_cols(buf, 0, &mut s.q)?;
                b.slice_cols(buf, c.q_dim(), &mut s.k)?;
                b.slice_cols(buf, c.q_dim() + c.kv_dim(), &mut s.v)?;
            }
            Qkv::Split { q, k, v } => {
                let (ws, outs) = (&[&q.w, &k.w, &v.w], &mut [&mut s.q, &mut s.k, &mut s.v]);
                match self.rms_norm(&lw.attn_norm, &s.x) {
                    Some(norm) => b.rms_norm_matmul_many(&norm, &mut s.h, ws, outs)?,
                    None => {
                        self.norm(&lw.attn_norm, &s.x, &mut s.h)?;
                        b.matmul_many(&s.h, ws, outs)?;
                    }
                }
                for (l, out) in [(q, &mut s.q), (k, &mut s.k), (v, &mut s.v)] {
                    if let Some(bias) = &l.b {
                        b.add_assign(out, bias)?;
                    }
                }
            }
        }
        reshape(&mut s.q, &[n, c.n_heads, c.head_dim])?;
        reshape(&mut s.k, &[n, c.n_kv_heads, c.head_dim])?;
        reshape(&mut s.v, &[n, c.n_kv_heads, c.head_dim])?;
        let rope = c
            .rope
            .as_ref()
            .zip(w.inv_freq.as_ref())
            .map(|(rope, inv_freq)| (inv_freq, rope.layout));
        let params = AttentionParams {
            scale: c.attn_scale,
            softcap: c.attn_softcap,
            window: c.layer_window(l),
        };
        match kv {
            KvTarget::Contiguous(cache) => {
                let (k_cache, v_cache) = (&mut cache.k[l], &mut cache.v[l]);
                b.rope_write_kv(
                    &mut s.q,
                    &mut s.k,
                    &s.v,
                    &s.positions,
                    None,
                    rope,
                    k_cache,
                    v_cache,
                )?;
                b.attention(
                    &s.q,
                    &cache.k[l],
                    &cache.v[l],
                    &s.positions,
                    &params,
                    &mut s.attn,
                )?;
            }
            KvTarget::Paged { cache, rows } => {
                let (k_pool, v_pool) = (&mut cache.k[l], &mut cache.v[l]);
                b.rope_write_kv(
                    &mut s.q,
                    &mut s.k,
                    &s.v,
                    &s.positions,
                    Some(rows.slots),
                    rope,
                    k_pool,
                    v_pool,
                )?;
                b.paged_attention(
                    &s.q,
                    &cache.k[l],
                    &cache.v[l],
                    &s.positions,
                    &rows.pages(cache.block),
                    &params,
                    &mut s.attn,
                )?;
            }
        }
        reshape(&mut s.q, &[n, c.q_dim()])?;
        reshape(&mut s.k, &[n, c.kv_dim()])?;
        reshape(&mut s.v, &[n, c.kv_dim()])?;
        reshape(&mut s.attn, &[n, c.q_dim()])?;
        if let Some(pn) = &lw.post_attn_norm {
            self.linear(&lw.o, &s.attn, &mut s.o)?;
            self.norm(pn, &s.o, &mut s.h)?;
            b.add_assign(&mut s.x, &s.h)?;
        } else {
            self.linear_add(&lw.o, &s.attn, &mut s.x, &mut s.o)?;
        }
        reshape(&mut s.attn, &[n, c.n_heads, c.head_dim])?;

        // Feed-forward block.
        match &lw.ffn {
            FfnWeights::Gated {
                gate_up: GateUp::Split { gate, up },
                ..
            } if gate.b.is_none() && up.b.is_none() => {
                let gelu = c.ffn == Ffn::GeGlu;
                match self.rms_norm(&lw.ffn_norm, &s.x) {
                    Some(norm) => b.rms_norm_gated_ffn(
                        &norm,
                        &mut s.h,
                        &gate.w,
                        &up.w,
                        gelu,
                        &mut s.act,
                        &mut s.gate,
                        &mut s.up,
                    )?,
                    None => {
                        self.norm(&lw.ffn_norm, &s.x, &mut s.h)?;
                        b.gated_ffn(
                            &s.h,
                            &gate.w,
                            &up.w,
                            gelu,
                            &mut s.act,
                            &mut s.gate,
                            &mut s.up,
                        )?;
                    }
                }
            }
            FfnWeights::Gated { gate_up, .. } => {
                self.norm(&lw.ffn_norm, &s.x, &mut s.h)?;
                match gate_up {
                    GateUp::Fused(gu) => {
                        let buf = s.gate_up.as_mut().expect("allocated for fused models");
                        self.linear(gu, &s.h, buf)?;
                        b.slice_cols(buf, 0, &mut s.gate)?;
                        b.slice_cols(buf, c.ffn_dim, &mut s.up)?;
                    }
                    GateUp::Split { gate, up } => {
                        self.linear(gate, &s.h, &mut s.gate)?;
                        self.linear(up, &s.h, &mut s.up)?;
                    }
                }
                match c.ffn {
                    Ffn::GeGlu => b.gelu_mul(&s.gate, &s.up, &mut s.act)?,
                    _ => b.silu_mul(&s.gate, &s.up, &mut s.act)?,
                }
            }
            FfnWeights::Plain { up, .. } => {
                self.norm(&lw.ffn_norm, &s.x, &mut s.h)?;
                self.linear(up, &s.h, &mut s.act)?;
                b.gelu(&mut s.act)?;
            }
        }
        let down = match &lw.ffn {
            FfnWeights::Gated { down, .. } | FfnWeights::Plain { down, .. } => down,
        };
        if let Some(pn) = &lw.post_ffn_norm {
            self.linear(down, &s.act, &mut s.down)?;
            self.norm(pn, &s.down, &mut s.h)?;
            b.add_assign(&mut s.x, &s.h)?;
        } else {
            self.linear_add(down, &s.act, &mut s.x, &mut s.down)?;
        }
        Ok(())
    }

    /// The final norm and the output head over the last layer's output `s.x`.
    pub(crate) fn head(&self, s: &mut Scratch, which: Output) -> Result<()> {
        let c = &self.config;
        let b = self.backend.as_ref();
        let w = &self.weights;
        let n = s.n;
        self.norm(&w.out_norm, &s.x, &mut s.h)?;
        let which = match which {
            Output::Hidden => return Ok(()),
            Output::Logits(which) => which,
        };
        let head = w.output.as_ref().unwrap_or(&w.embed);
        let split = self.split_head();
        let logits = match which {
            Logits::All => {
                let logits = s.all_logits.as_mut().expect("made before the step");
                match (split, s.split_logits.as_mut()) {
                    (Some(c), Some(parts)) => {
                        self.gather_all_logits(c.as_ref(), &s.h, logits, parts)?
                    }
                    _ => b.matmul(&s.h, head, logits)?,
                }
                logits
            }
            Logits::Last => {
                // The last row of h, as a [1, dim] tensor.
                reshape(&mut s.h, &[1, n * c.dim])?;
                let sliced = b.slice_cols(&s.h, (n - 1) * c.dim, &mut s.last);
                reshape(&mut s.h, &[n, c.dim])?;
                sliced?;
                match (split, s.head_part.as_mut()) {
                    (Some(c), Some(part)) => {
                        // Rank r's slice is columns r·rows.. of the whole: in rank order.
                        b.matmul(&s.last, head, part)?;
                        c.all_gather(part, &mut s.logits)?;
                    }
                    _ => b.matmul(&s.last, head, &mut s.logits)?,
                }
                &mut s.logits
            }
        };
        if let Some(cap) = c.final_softcap {
            b.softcap(logits, cap)?;
        }
        Ok(())
    }

    /// The buffers [`Self::gather_all_logits`] needs for `n` positions, where the head is
    /// split (made before any step is recorded: the gather allocates nothing).
    pub(crate) fn split_logits(&self, n: usize) -> Result<Option<SplitLogits>> {
        let Some(c) = self.split_head() else {
            return Ok(None);
        };
        let b = self.backend.as_ref();
        let (rows, world) = (self.head_weight().dims()[0], c.world());
        let mut to = b.zeros(DType::I32, Shape::new(vec![world * n])?)?;
        // Row i·world + j of `[n · world, rows]` is position i's columns from rank j.
        b.write(
            &mut to,
            &i32_bytes((0..world * n).map(|g| (g % n) * world + g / n)),
        )?;
        Ok(Some(SplitLogits {
            part: f32_tensor(b, &[n, rows])?,
            gathered: f32_tensor(b, &[world * n, rows])?,
            to,
        }))
    }

    /// Every row's logits from a vocabulary-split head: this rank's columns of them,
    /// gathered from all ranks (rank-major: rank j's `[n, rows]` block after rank j-1's),
    /// then each rank's block moved to its columns.
    pub(crate) fn gather_all_logits(
        &self,
        c: &dyn Collective,
        h: &Tensor,
        logits: &mut Tensor,
        parts: &mut SplitLogits,
    ) -> Result<()> {
        let b = self.backend.as_ref();
        let (n, rows) = (h.dims()[0], self.head_weight().dims()[0]);
        b.matmul(h, self.head_weight(), &mut parts.part)?;
        c.all_gather(&parts.part, &mut parts.gathered)?;
        reshape(logits, &[n * c.world(), rows])?;
        let written = b.write_rows(&parts.gathered, logits, &parts.to);
        reshape(logits, &[n, c.world() * rows])?;
        written
    }

    /// `logits = h · headᵀ` for any rows `h`, through the split head's gather where it
    /// is split (allocating: not for recorded steps).
    pub(crate) fn head_logits(&self, h: &Tensor, logits: &mut Tensor) -> Result<()> {
        match (self.split_head(), self.split_logits(h.dims()[0])?) {
            (Some(c), Some(mut parts)) => self.gather_all_logits(c.as_ref(), h, logits, &mut parts),
            _ => self.backend.matmul(h, self.head_weight(), logits),
        }
    }

    /// The norm `nw` of `x` as an [`RmsNorm`] a backend can fuse into the matmuls it
    /// feeds; `None` for LayerNorm.
    fn rms_norm<'a>(&self, nw: &'a NormWeights, x: &'a Tensor) -> Option<RmsNorm<'a>> {
        match self.config.norm {
            Norm::Rms { eps } => Some(RmsNorm {
                x,
                weight: &nw.w,
                eps,
            }),
            Norm::Layer { .. } => None,
        }
    }

    pub(crate) fn norm(&self, nw: &NormWeights, x: &Tensor, out: &mut Tensor) -> Result<()> {
        match (self.config.norm, &nw.b) {
            (Norm::Rms { eps }, _) => self.backend.rms_norm(x, &nw.w, eps, out),
            (Norm::Layer { eps }, Some(bias)) => self.backend.layer_norm(x, &nw.w, bias, eps, out),
            (Norm::Layer { .. }, None) => Err(Error::format("LayerNorm without a bias")),
        }
    }

    /// `acc += x · wᵀ + bias`, through `tmp` where the backend does not fuse; on a rank of
    /// a split model, `x · wᵀ` is this rank's part of the sum, completed by the ranks'
    /// all-reduce before it is added.
    fn linear_add(&self, l: &Linear, x: &Tensor, acc: &mut Tensor, tmp: &mut Tensor) -> Result<()> {
        match (&l.b, &self.collective) {
            (None, None) => self.backend.matmul_add(x, &l.w, acc, tmp),
            (Some(_), None) => {
                self.linear(l, x, tmp)?;
                self.backend.add_assign(acc, tmp)
            }
            (None, Some(c)) => {
                self.backend.matmul(x, &l.w, tmp)?;
                c.all_reduce_sum(tmp)?;
                self.backend.add_assign(acc, tmp)
            }
            (Some(_), Some(_)) => Err(Error::unsupported(
                "a split model's residual projections with a bias (each rank would add it)",
            )),
        }
    }

    fn linear(&self, l: &Linear, x: &Tensor, out: &mut Tensor) -> Result<()> {
        self.backend.matmul(x, &l.w, out)?;
        if let Some(bias) = &l.b {
            self.backend.add_assign(out, bias)?;
        }
        Ok(())
    }
}

pub(crate) fn download_f32(b: &dyn Backend, t: &Tensor) -> Result<Vec<f32>> {
    let bytes = b.download(t)?;
    quant::dequantize_to_vec(DType::F32, &bytes, t.shape().numel())
}

/// The token id a device op left in `next` (I32 `[1]`).
fn read_token(b: &dyn Backend, next: &Tensor) -> Result<u32> {
    let bytes = b.download(next)?;
    let id = <[u8; 4]>::try_from(bytes.as_slice())
        .map(i32::from_le_bytes)
        .map_err(|_| Error::Device(format!("a token read back as {} bytes", bytes.len())))?;
    u32::try_from(id).map_err(|_| Error::Device(format!("the device picked token {id}")))
}
