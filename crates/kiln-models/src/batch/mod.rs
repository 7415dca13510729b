//! Many sequences in one step over a paged KV cache: what a server runs.
//!
//! The keys and values of every sequence live in one pool of fixed-size blocks per layer
//! ([`PagedKvCache`]); each sequence brings its block table. A step concatenates the
//! sequences' tokens (one row per decoding sequence, a block of rows per prompt chunk) and
//! runs them through the same layers as [`Model::forward`], once: every weight is read
//! once for all of them. Keys and values are written to the rows their blocks give, and
//! attention reads each query's own sequence through its table.
//!
//! The rows are marked exact ([`Tensor::set_exact_rows`]): on backends that honour it (the
//! CPU) every row is multiplied as a one-row product would be, so that a request's tokens
//! at temperature 0 do not depend on what else runs, how its prompt was cut into chunks,
//! or whether its prefix came from the cache.

mod graphs;
mod outputs;

pub(crate) use graphs::DecodeGraphs;

use crate::model::{KvTarget, Model, Output, Scratch};
use kiln_core::{DType, Error, Pages, Result, SampleParams, Shape, Tensor};

/// Keys and values of every layer for many sequences: `[(blocks + 1) · block, kv_heads,
/// head_dim]` per layer, in one of the types of [`DType::KV_CACHE`], made once (a server
/// sizes it at start). Block `blocks`, past those sequences may hold, takes the writes of
/// a recorded step's padding rows.
pub struct PagedKvCache {
    pub(crate) k: Vec<Tensor>,
    pub(crate) v: Vec<Tensor>,
    /// Blocks sequences may hold (ids `0..blocks`).
    pub(crate) blocks: usize,
    /// Positions a block holds.
    pub(crate) block: usize,
    /// Unique to this cache: recorded steps write into its tensors.
    pub(crate) id: u64,
}

impl PagedKvCache {
    pub fn blocks(&self) -> usize {
        self.blocks
    }

    /// Positions a block holds.
    pub fn block_positions(&self) -> usize {
        self.block
    }

    /// The type its keys and values are stored in.
    pub fn dtype(&self) -> DType {
        self.k.first().map_or(DType::F32, Tensor::dtype)
    }
}

/// A step's device tensors that say where its rows' keys and values go and come from.
pub(crate) struct PagedRows<'a> {
    /// I32 `[n]`: the pool row each token's key and value are written to.
    pub slots: &'a Tensor,
    /// I32 `[n]`: each token's sequence (row of `tables`).
    pub seq: &'a Tensor,
    /// I32 `[sequences, max_blocks]`: the sequences' block tables.
    pub tables: &'a Tensor,
    /// Each sequence's rows (consecutive), in order.
    pub runs: &'a [usize],
}

impl<'a> PagedRows<'a> {
    pub(crate) fn pages(&self, block: usize) -> Pages<'a> {
        Pages {
            seq: self.seq,
            tables: self.tables,
            block,
            runs: self.runs,
        }
    }
}

/// The device tensors behind a step's [`PagedRows`].
struct RowTensors {
    slots: Tensor,
    seq: Tensor,
    tables: Tensor,
}

impl RowTensors {
    fn rows<'a>(&'a self, runs: &'a [usize]) -> PagedRows<'a> {
        PagedRows {
            slots: &self.slots,
            seq: &self.seq,
            tables: &self.tables,
            runs,
        }
    }
}

/// A micro-batch's forward pass run a part at a time over the [`PagedKvCache`] it was
/// made for (see [`Model::hidden_pass`]). Every part reads and writes the residual
/// stream, [`HiddenPass::hidden`]: `[tokens, dim]`, the items' rows in order.
pub struct HiddenPass<'m> {
    model: &'m Model,
    s: Scratch,
    rows: RowTensors,
    runs: Vec<usize>,
    /// The cache the items' blocks were checked against ([`PagedKvCache::id`]).
    cache: u64,
}

impl HiddenPass<'_> {
    /// The embedding of the items' tokens: the first layer's input.
    pub fn embed(&mut self) -> Result<()> {
        self.model.embed(&mut self.s)
    }

    /// Layer `l`, from the residual stream to the residual stream; its keys and values
    /// are written to `cache`.
    pub fn layer(&mut self, l: usize, cache: &mut PagedKvCache) -> Result<()> {
        if l >= self.model.config.n_layers {
            return Err(Error::shape(format!(
                "layer {l} of a model of {}",
                self.model.config.n_layers
            )));
        }
        if cache.id != self.cache {
            return Err(Error::shape(
                "a forward pass's layer over another KV cache than the one it was made for",
            ));
        }
        let rows = self.rows.rows(&self.runs);
        self.model
            .layer(l, &mut self.s, &mut KvTarget::Paged { cache, rows })
    }

    /// The residual stream: what the next part reads.
    pub fn hidden(&self) -> &Tensor {
        &self.s.x
    }

    /// The residual stream, to set a layer's input (a copy kept from an earlier run).
    pub fn hidden_mut(&mut self) -> &mut Tensor {
        &mut self.s.x
    }

    /// The final norm of the residual stream: `f` gets the normed hidden states and the
    /// output matrix (see [`Model::forward_hidden_batch`]).
    pub fn head<T>(&mut self, f: impl FnOnce(&Tensor, &Tensor) -> Result<T>) -> Result<T> {
        self.model.head(&mut self.s, Output::Hidden)?;
        f(&self.s.h, self.model.head_weight())
    }
}

/// What a sequence wants from its part of a step.
#[derive(Clone, Debug, PartialEq)]
pub enum StepWant {
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
    /// The next token's logits, for sampling on the host.
    Logits,
}

/// A sequence's result of a step.
#[derive(Debug, PartialEq)]
pub enum StepOutput {
    Nothing,
    Token(u32),
    Logits(Vec<f32>),
}

/// One sequence's part of a step: `tokens` at positions `pos0..`, its keys and values in
/// `blocks` (its block table, covering at least `pos0 + tokens.len()` positions).
pub struct BatchItem<'a> {
    pub tokens: &'a [u32],
    pub pos0: usize,
    pub blocks: &'a [u32],
    pub want: StepWant,
}

/// The host side of a step: every row's id, position, pool row and sequence.
struct Layout {
    ids: Vec<i32>,
    positions: Vec<i32>,
    slots: Vec<i32>,
    seq: Vec<i32>,
    /// `[sequences, max_blocks]`, row-major.
    tables: Vec<i32>,
    max_blocks: usize,
    /// Per sequence of the step (in order): its rows.
    runs: Vec<usize>,
    /// Per sequence of the step (in order): its last row, when it wants a result.
    outputs: Vec<Option<usize>>,
}

fn i32_of(v: usize, what: &str) -> Result<i32> {
    i32::try_from(v).map_err(|_| Error::shape(format!("{what} {v} does not fit in i32")))
}

impl Model {
    /// A paged KV cache of `blocks` blocks of `block` positions (and one more for the
    /// padding of recorded steps), its keys and values kept as `dtype` (see
    /// [`crate::check_kv_type`]), checked against free memory first.
    pub fn new_paged_cache(
        &self,
        blocks: usize,
        block: usize,
        dtype: DType,
    ) -> Result<PagedKvCache> {
        let rows = (blocks + 1)
            .checked_mul(block)
            .filter(|&r| block > 0 && i32::try_from(r).is_ok())
            .ok_or_else(|| {
                Error::shape(format!(
                    "a KV pool of {blocks} blocks of {block} positions (rows are i32 on the device)"
                ))
            })?;
        let what = format!("a KV pool of {blocks} blocks ({rows} positions)");
        let (k, v) = crate::kv_cache::layer_tensors(self, rows, dtype, &what)?;
        Ok(PagedKvCache {
            k,
            v,
            blocks,
            block,
            id: crate::kv_cache::NEXT_CACHE_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        })
    }

    /// Why `item` cannot run on `cache`, if it cannot.
    fn check_item(&self, item: &BatchItem, cache: &PagedKvCache) -> Result<()> {
        let n = item.tokens.len();
        if n == 0 {
            return Err(Error::shape("a step's sequence with no tokens"));
        }
        let end = item.pos0 + n;
        if end > item.blocks.len() * cache.block {
            return Err(Error::shape(format!(
                "positions {}..{end} exceed the {} positions of the sequence's {} blocks",
                item.pos0,
                item.blocks.len() * cache.block,
                item.blocks.len()
            )));
        }
        if let Some(&b) = item.blocks.iter().find(|&&b| b as usize >= cache.blocks) {
            return Err(Error::shape(format!(
                "block {b} is outside the KV pool of {} blocks",
                cache.blocks
            )));
        }
        let vocab = self.vocab_rows();
        if let Some(id) = item.tokens.iter().find(|&&id| id as usize >= vocab) {
            return Err(Error::shape(format!(
                "token id {id} is outside the vocabulary of {vocab}"
            )));
        }
        if let Some(limit) = self.learned_positions() {
            if end > limit {
                return Err(Error::shape(format!(
                    "positions {}..{end} exceed the model's {limit} learned positions",
                    item.pos0
                )));
            }
        }
        Ok(())
    }

    fn layout(&self, items: &[&BatchItem], block: usize) -> Result<Layout> {
        let max_blocks = items
            .iter()
            .map(|it| (it.pos0 + it.tokens.len()).div_ceil(block))
            .max()
            .unwrap_or(0)
            .max(1);
        let mut l = Layout {
            ids: Vec::new(),
            positions: Vec::new(),
            slots: Vec::new(),
            seq: Vec::new(),
            tables: vec![0; items.len() * max_blocks],
            max_blocks,
            runs: items.iter().map(|it| it.tokens.len()).collect(),
            outputs: Vec::new(),
        };
        for (s, it) in items.iter().enumerate() {
            let used = (it.pos0 + it.tokens.len()).div_ceil(block);
            for (t, &b) in l.tables[s * max_blocks..][..used].iter_mut().zip(it.blocks) {
                *t = i32_of(b as usize, "block")?;
            }
            for (j, &id) in it.tokens.iter().enumerate() {
                let p = it.pos0 + j;
                l.ids.push(i32_of(id as usize, "token id")?);
                l.positions.push(i32_of(p, "position")?);
                l.slots.push(i32_of(
                    it.blocks[p / block] as usize * block + p % block,
                    "pool row",
                )?);
                l.seq.push(s as i32);
            }
            let last = l.ids.len() - 1;
            l.outputs
                .push((it.want != StepWant::Nothing).then_some(last));
        }
        Ok(l)
    }

    /// Run a step of many sequences over `cache`; one result per item, in order. An item
    /// that cannot run (a token outside the vocabulary, positions past its blocks) fails
    /// alone; the others run.
    pub fn forward_batch(
        &mut self,
        items: &[BatchItem],
        cache: &mut PagedKvCache,
    ) -> Vec<Result<StepOutput>> {
        let mut results: Vec<Option<Result<StepOutput>>> = items
            .iter()
            .map(|it| self.check_item(it, cache).err().map(Err))
            .collect();
        let valid: Vec<(usize, &BatchItem)> = items
            .iter()
            .enumerate()
            .filter(|(i, _)| results[*i].is_none())
            .collect();
        if !valid.is_empty() {
            let runnable: Vec<&BatchItem> = valid.iter().map(|(_, it)| *it).collect();
            match self.step_batch(&runnable, cache) {
                Ok(outs) => {
                    for ((i, _), out) in valid.iter().zip(outs) {
                        results[*i] = Some(Ok(out));
                    }
                }
                Err(e) => {
                    let msg = e.to_string();
                    for (i, _) in &valid {
                        results[*i] = Some(Err(Error::Device(msg.clone())));
                    }
                }
            }
        }
        results
            .into_iter()
            .map(|r| r.expect("every item has a result"))
            .collect()
    }

    fn step_batch(
        &mut self,
        items: &[&BatchItem],
        cache: &mut PagedKvCache,
    ) -> Result<Vec<StepOutput>> {
        if let Some(outs) = self.step_recorded(items, cache)? {
            return Ok(outs);
        }
        let l = self.layout(items, cache.block)?;
        let mut s = self.new_scratch(l.ids.len())?;
        exact_rows(&mut s);
        self.paged_layers(&mut s, &l, cache)?;
        self.outputs(&mut s, items, &l)
    }

    /// The step's inputs written and its layers run: `s.x` holds the last layer's output.
    fn paged_layers(&self, s: &mut Scratch, l: &Layout, cache: &mut PagedKvCache) -> Result<()> {
        let inputs = self.paged_inputs(s, l)?;
        let rows = inputs.rows(&l.runs);
        self.layers(s, &mut KvTarget::Paged { cache, rows })
    }

    /// Write a step's token ids and positions into `s`, and upload where its rows' keys
    /// and values go.
    fn paged_inputs(&self, s: &mut Scratch, l: &Layout) -> Result<RowTensors> {
        let b = self.backend().as_ref();
        let ints = |v: &[i32], dims: Vec<usize>| -> Result<Tensor> {
            let mut t = b.zeros(DType::I32, Shape::new(dims)?)?;
            b.write(&mut t, &i32_bytes(v))?;
            Ok(t)
        };
        self.write_ids(s, l.ids.iter().map(|&id| id as usize))?;
        b.write(&mut s.positions, &i32_bytes(&l.positions))?;
        Ok(RowTensors {
            slots: ints(&l.slots, vec![l.ids.len()])?,
            seq: ints(&l.seq, vec![l.ids.len()])?,
            tables: ints(&l.tables, vec![l.runs.len(), l.max_blocks])?,
        })
    }

    /// [`Model::forward_hidden`] for several sequences in one pass over `cache` (a
    /// training micro-batch): each item's tokens at its positions, keys and values in its
    /// blocks, its `want` ignored. `f` gets the final normed hidden states of every
    /// item's tokens, concatenated in order, and the output matrix. The rows are not
    /// marked exact: products run over all of them at once.
    pub fn forward_hidden_batch<T>(
        &self,
        items: &[BatchItem],
        cache: &mut PagedKvCache,
        f: impl FnOnce(&Tensor, &Tensor) -> Result<T>,
    ) -> Result<T> {
        let mut pass = self.hidden_pass(items, cache)?;
        pass.embed()?;
        for l in 0..self.config.n_layers {
            pass.layer(l, cache)?;
        }
        pass.head(f)
    }

    /// [`Model::forward_hidden_batch`] a part at a time, for a trainer that keeps only
    /// each layer's input and runs a layer again during its backward pass (activation
    /// checkpointing): the items checked and their inputs written, nothing run yet.
    pub fn hidden_pass(&self, items: &[BatchItem], cache: &PagedKvCache) -> Result<HiddenPass<'_>> {
        if items.is_empty() {
            return Err(Error::shape("a forward pass of no sequences"));
        }
        for it in items {
            self.check_item(it, cache)?;
        }
        let refs: Vec<&BatchItem> = items.iter().collect();
        let layout = self.layout(&refs, cache.block)?;
        let mut s = self.new_scratch(layout.ids.len())?;
        let rows = self.paged_inputs(&mut s, &layout)?;
        Ok(HiddenPass {
            model: self,
            s,
            rows,
            runs: layout.runs,
            cache: cache.id,
        })
    }

    /// The logits of the rows that want a result (the final norm and the head over those
    /// rows alone), then each sequence's token or logits.
    fn outputs(
        &self,
        s: &mut Scratch,
        items: &[&BatchItem],
        l: &Layout,
    ) -> Result<Vec<StepOutput>> {
        let rows: Vec<i32> = l.outputs.iter().flatten().map(|&r| r as i32).collect();
        if rows.is_empty() {
            return Ok(items.iter().map(|_| StepOutput::Nothing).collect());
        }
        let c = &self.config;
        let b = self.backend().as_ref();
        let m = rows.len();
        let f32_tensor = |dims: Vec<usize>| b.zeros(DType::F32, Shape::new(dims)?);
        let mut which = b.zeros(DType::I32, Shape::new(vec![m])?)?;
        b.write(&mut which, &i32_bytes(&rows))?;
        // The wanted rows of the last layer's output.
        let mut last = f32_tensor(vec![m, c.dim])?;
        b.embedding(&s.x, &which, &mut last)?;
        let mut normed = f32_tensor(vec![m, c.dim])?;
        self.norm(self.out_norm(), &last, &mut normed)?;
        normed.set_exact_rows(true);
        let mut logits = f32_tensor(vec![m, c.vocab_size])?;
        self.head_logits(&normed, &mut logits)?;
        if let Some(cap) = c.final_softcap {
            b.softcap(&mut logits, cap)?;
        }
        // Row r of `logits` is the r-th item that wants a result.
        let mut r = 0;
        let row_of: Vec<Option<usize>> = items
            .iter()
            .map(|it| {
                (it.want != StepWant::Nothing).then(|| {
                    r += 1;
                    r - 1
                })
            })
            .collect();
        self.read_outputs(items, &mut logits, &row_of, None)
    }
}

/// Mark every activation buffer that feeds a product as exact rows.
pub(crate) fn exact_rows(s: &mut Scratch) {
    for t in [
        &mut s.x,
        &mut s.h,
        &mut s.q,
        &mut s.k,
        &mut s.v,
        &mut s.attn,
        &mut s.o,
        &mut s.gate,
        &mut s.up,
        &mut s.act,
        &mut s.down,
    ] {
        t.set_exact_rows(true);
    }
    for t in [s.qkv.as_mut(), s.gate_up.as_mut()].into_iter().flatten() {
        t.set_exact_rows(true);
    }
}

pub(crate) fn i32_bytes(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}
