//! The training loop: sequences drawn at random from the training text, each run forward
//! through the model on a [`Tape`] and backward, their gradients summed over the step's
//! sequences; then one step of a kiln-optim [`Optimizer`] over flat buffers.
//!
//! The trainer owns three kinds of flat F32 buffers on the backend, laid out by a
//! [`ParamLayout`] in the order of `Model::parameters`: the parameters (the master
//! weights), their gradients, and the optimizer's states. A tensor cannot be a view of a
//! flat buffer yet, so the model keeps its own weight tensors and two device copies per
//! step move values between them: each parameter's gradient into the flat gradient buffer
//! after backward, and the updated master weights back into the model's tensors after
//! the step (8 bytes a parameter per step, against the optimizer's 28).
//!
//! A micro-batch's `batch` sequences run through the model in one forward pass, as a
//! server's step runs its sequences: one row per token, each sequence's keys and values
//! in its own block of a paged cache, attention within each sequence (its backward in
//! [`crate::paged`]). The `grad_accum` micro-batches of a step run one after another, their
//! gradients accumulating in the parameters' gradient buffers. Activations are kept for
//! one micro-batch at a time (no checkpointing of them yet).
//!
//! With LoRA ([`crate::lora`]) the trainable parameters, and so the flat buffers, are the
//! adapters' matrices alone; the model's weights are registered frozen.

use crate::checkpoint::{self, RunState};
use crate::data::TextData;
use crate::lora::{self, Adapter, LoraSettings};
use crate::recompute::checkpointed_pass;
use crate::rng::Rng;
use crate::tape::Tape;
use kiln_core::{Backend, Collective, DType, Error, GradOps, Products, Result, Shape, Tensor};
use kiln_io::gguf::{GgufFile, GgufWriter, Value};
use kiln_models::{BatchItem, Model, PagedKvCache, StepWant};
use kiln_optim::{Optimizer, ParamLayout, StepConfig};
use kiln_tokenizer::Tokenizer;
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::sync::Arc;

/// What defines a run: a resumed run takes these from its checkpoint.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Settings {
    /// Sequences per micro-batch, and micro-batches per optimizer step.
    pub batch: usize,
    pub grad_accum: usize,
    /// Tokens per sequence (each predicts the next, so a window is one longer).
    pub seq_len: usize,
    pub steps: usize,
    /// The update rule, the learning-rate schedule (its clock counts optimizer steps)
    /// and gradient clipping, as kiln-optim takes them. Weight decay applies to every
    /// parameter, as `torch.optim.AdamW(model.parameters())`: all of them are one flat
    /// buffer, stepped in one launch, so that clipping sees the global norm (kiln-optim's
    /// parameter groups are separate optimizers).
    pub optimizer: StepConfig,
    pub seed: u64,
    /// Held-out windows of `seq_len` tokens scored at most by one evaluation.
    pub eval_windows: usize,
    /// Train low-rank updates of these projections instead of every weight (the model's
    /// own weights frozen); `None`: every weight is trained.
    #[serde(default)]
    pub lora: Option<LoraSettings>,
    /// How the products are computed (F32 weights and gradients either way).
    #[serde(default)]
    pub products: Products,
}

/// What one step did.
#[derive(Clone, Debug)]
pub struct StepReport {
    /// Steps done, this one included.
    pub step: usize,
    /// Mean cross-entropy of the step's tokens (nats).
    pub loss: f64,
    /// The learning rate of this step's update.
    pub lr: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    pub tokens: usize,
    /// Under loss scaling: a gradient overflowed and the update was skipped.
    pub skipped: bool,
}

pub struct Trainer {
    tape: Arc<Tape>,
    model: Model,
    /// A block of `seq_len` positions for each sequence of a micro-batch.
    cache: PagedKvCache,
    settings: Settings,
    data: TextData,
    /// The start file's `tokenizer.*` and `general.name` metadata, for what is written.
    carried: Vec<(String, Value)>,
    /// Under LoRA, the start file when it holds every weight of the model as the model
    /// does (type and bytes): checkpoints read the frozen weights from it as they are
    /// written, instead of copying them off the device at every save.
    frozen_source: Option<GgufFile>,
    /// Every parameter, flat (the optimizer's master copy), and their gradients: F32 on
    /// the backend, laid out by the optimizer's [`ParamLayout`].
    params: Tensor,
    grads: Tensor,
    opt: Optimizer,
    rng: Rng,
    step: usize,
    /// Why the run cannot go on: an update made a parameter non-finite, so the master
    /// weights and the optimizer's state are past the model's tensors and must not be
    /// saved.
    broken: Option<String>,
    /// Data parallelism: the other ranks, each with a replica of the model, running
    /// their share of every step's sequences; the gradients are summed through it.
    collective: Option<Arc<dyn Collective>>,
    /// ZeRO stage 1: the shard of the parameters this rank updates, `opt` being its
    /// optimizer (see [`Trainer::shard_optimizer`]).
    shard: Option<Shard>,
    /// Data parallelism's gradient buckets, summed while the backward pass goes on (see
    /// [`Trainer::bucket_bytes`]); `None`: one sum after it.
    buckets: Option<Buckets>,
    /// Keep only each layer's input for the backward pass and run the layer again there
    /// (see [`crate::recompute`]).
    checkpoint_activations: bool,
    /// Per parameter of the tape: its place among the trainable tensors (the flat
    /// buffers' entries), `None` when frozen.
    flat_index: Vec<Option<usize>>,
}

/// The flat gradient buffer cut into spans of whole tensors, from its end: the backward
/// pass makes the last layers' gradients first, so the first span is whole soonest.
struct Buckets {
    /// Per trainable tensor (entry of the flat buffers): its bucket.
    of: Vec<usize>,
    /// Per bucket: its first value, its length and how many tensors it holds.
    spans: Vec<(usize, usize, usize)>,
}

impl Buckets {
    /// Buckets of at least `bytes` of F32 gradients each (but the last), tensors whole;
    /// the padding between two tensors goes with the later one, so the spans tile the
    /// buffer.
    fn new(layout: &ParamLayout, bytes: usize) -> Buckets {
        let entries = layout.entries();
        let mut of = vec![0; entries.len()];
        let mut spans = Vec::new();
        let (mut end, mut count) = (entries.last().map_or(0, |e| e.offset + e.len), 0);
        for (j, e) in entries.iter().enumerate().rev() {
            of[j] = spans.len();
            count += 1;
            if (end - e.offset) * 4 >= bytes || j == 0 {
                spans.push((e.offset, end - e.offset, count));
                (end, count) = (e.offset, 0);
            }
        }
        Buckets { of, spans }
    }
}

/// One rank's part of a sharded optimizer (ZeRO stage 1): its chunk of the flat buffers
/// (padded to a multiple of the ranks; chunk `rank`), its copy of those master weights
/// and its chunk of the summed gradients.
struct Shard {
    /// The whole parameters' layout (the optimizer's own is the shard's one entry).
    whole: ParamLayout,
    params: Tensor,
    grads: Tensor,
}

/// Gradient buckets' size unless told: PyTorch DDP's default, 25 MiB.
pub const DEFAULT_BUCKET_BYTES: usize = 25 << 20;

/// The layout of the whole flat buffers, sharded or not.
fn layout_of<'a>(opt: &'a Optimizer, shard: &'a Option<Shard>) -> &'a ParamLayout {
    shard.as_ref().map_or(opt.layout(), |s| &s.whole)
}

impl Trainer {
    /// A new run from `start` (see `kiln_train::init`), on a tape over `backend`: a
    /// model whose weights are all F32, or under LoRA of types the backend's backward
    /// reads as stored ([`kiln_core::GradOps::frozen_as_stored`]).
    pub fn new(
        start: &GgufFile,
        data: TextData,
        settings: Settings,
        backend: Arc<dyn Backend>,
    ) -> Result<Trainer> {
        let rng = Rng::new(settings.seed);
        Self::build(start, data, settings, backend, rng)
    }

    /// Go on with the run checkpoint `ckpt` saved, on the same `data`: what it does from
    /// here is what the uninterrupted run would have done.
    pub fn resume(ckpt: &GgufFile, data: TextData, backend: Arc<dyn Backend>) -> Result<Trainer> {
        let state = checkpoint::read_state(ckpt)?;
        let file = ckpt.path.display();
        if state.data != data.fingerprint() {
            return Err(Error::format(format!(
                "{file}: the run trained on other text (its data's fingerprint is {}, this text's {}): give the same --data and --held-out",
                state.data,
                data.fingerprint()
            )));
        }
        let mut t = Self::build(ckpt, data, state.settings, backend, Rng::new(state.rng))?;
        let inner = t.tape.inner().clone();
        t.opt
            .load(inner.as_ref(), &state.optimizer)
            .map_err(|e| Error::format(format!("{file}: {e}")))?;
        t.step = usize::try_from(state.step).unwrap_or(usize::MAX);
        let updates = t.opt.status(inner.as_ref())?.steps;
        if updates != state.step as f64 {
            return Err(Error::format(format!(
                "{file}: the optimizer's state is after {updates} updates, the run after {} steps",
                state.step
            )));
        }
        if t.step > t.settings.steps {
            return Err(Error::format(format!(
                "{file}: step {} is past the run's {} steps",
                t.step, t.settings.steps
            )));
        }
        Ok(t)
    }

    fn build(
        start: &GgufFile,
        data: TextData,
        settings: Settings,
        backend: Arc<dyn Backend>,
        rng: Rng,
    ) -> Result<Trainer> {
        if let Some(grad) = backend.grad() {
            grad.set_products(settings.products)?;
        }
        let tape = Arc::new(Tape::new(backend)?);
        let model = Model::from_gguf(start, tape.clone(), None)?;
        check_settings(&settings, &model, &data)?;
        let inner = tape.inner().clone();
        let grad_ops = tape.grad_ops();
        for (name, t) in model.parameters() {
            let dtype = t.dtype();
            if dtype == DType::F32 {
                continue;
            }
            let file = start.path.display();
            if settings.lora.is_none() {
                return Err(Error::unsupported(format!(
                    "{file}: {name} is {dtype}; a full fine-tune trains F32 weights (convert the model to F32, or train LoRA adapters over it)"
                )));
            }
            if !grad_ops.frozen_as_stored(dtype) {
                return Err(Error::unsupported(format!(
                    "{file}: {name} is {dtype}; {} trains LoRA over F32 weights alone (start from the model with `kiln train --from`, which converts it, or train on the CPU: --device cpu)",
                    inner.describe()
                )));
            }
        }
        let adapters = match &settings.lora {
            Some(l) => adapters_of(start, &model, l, inner.as_ref(), settings.seed)?,
            None => Vec::new(),
        };
        // The trainable tensors, in the order of the flat buffers: the model's weights,
        // or the adapters' A and B.
        let trainable: Vec<(String, &Tensor)> = match settings.lora {
            Some(_) => adapters
                .iter()
                .flat_map(|ad| {
                    let (a, b) = Adapter::tensor_names(&ad.weight);
                    [(a, &ad.a), (b, &ad.b)]
                })
                .collect(),
            None => model.parameters(),
        };
        let layout = ParamLayout::new(
            trainable
                .iter()
                .map(|(name, t)| (name.clone(), t.dims().to_vec())),
        )?;
        let flat = Shape::new(vec![layout.numel()])?;
        let mut params = inner.zeros(DType::F32, flat.clone())?;
        for ((_, t), e) in trainable.iter().zip(layout.entries()) {
            grad_ops.copy_span(t, 0, &mut params, e.offset, e.len)?;
        }
        drop(trainable);
        let grads = inner.zeros(DType::F32, flat)?;
        let opt = Optimizer::new(inner.as_ref(), layout, settings.optimizer)?;
        let mut refs: Vec<&Tensor> = model.parameters().into_iter().map(|(_, t)| t).collect();
        let mut flags = vec![settings.lora.is_none(); refs.len()];
        refs.extend(adapters.iter().flat_map(|ad| [&ad.a, &ad.b]));
        flags.resize(refs.len(), true);
        tape.set_parameters(&refs, &flags)?;
        let flat_index = flags
            .iter()
            .scan(0, |next, &trained| {
                let at = trained.then_some(*next);
                *next += usize::from(trained);
                Some(at)
            })
            .collect();
        let params_of = model.parameters();
        let adapted: Vec<&Tensor> = adapters
            .iter()
            .map(|ad| {
                params_of
                    .iter()
                    .find(|(n, _)| *n == ad.weight)
                    .map(|(_, t)| *t)
                    .ok_or_else(|| Error::shape(format!("{} is not a parameter", ad.weight)))
            })
            .collect::<Result<_>>()?;
        drop(refs);
        tape.set_adapters(adapters, &adapted)?;
        drop((adapted, params_of));
        let cache = model.new_paged_cache(settings.batch, settings.seq_len, DType::F32)?;
        let carried = start
            .metadata
            .iter()
            .filter(|(k, _)| k.starts_with("tokenizer.") || k == "general.name")
            .cloned()
            .collect();
        let frozen_source = match settings.lora {
            Some(_) if holds_as_stored(start, &model)? => Some(start.clone()),
            _ => None,
        };
        Ok(Trainer {
            tape,
            model,
            cache,
            settings,
            data,
            carried,
            frozen_source,
            params,
            grads,
            opt,
            rng,
            step: 0,
            broken: None,
            collective: None,
            shard: None,
            buckets: None,
            checkpoint_activations: false,
            flat_index,
        })
    }

    /// Make this trainer rank `collective.rank()` of a data-parallel run: every rank
    /// starts from the same model and text and draws the same windows, runs every
    /// `world`-th of them, and sums its gradients with the others' before the update,
    /// so every replica takes the one-rank run's step (up to the order of the sums).
    pub fn data_parallel(mut self, collective: Arc<dyn Collective>) -> Result<Trainer> {
        let (world, seqs) = (
            collective.world(),
            self.settings.batch * self.settings.grad_accum,
        );
        if !seqs.is_multiple_of(world) {
            return Err(Error::format(format!(
                "--dp {world}: a step's {seqs} sequences (--batch × --grad-accum) do not divide among {world} ranks"
            )));
        }
        self.collective = Some(collective);
        self.bucket_bytes(DEFAULT_BUCKET_BYTES)
    }

    /// Sum a data-parallel run's gradients in buckets of about `bytes` (whole tensors),
    /// each started as soon as the last sequence's backward pass has made it, beside the
    /// rest of that pass; 0: one sum of all of them after it. Every rank must give the same
    /// size. A sharded optimizer (ZeRO-1) reduce-scatters after the backward pass instead.
    pub fn bucket_bytes(mut self, bytes: usize) -> Result<Trainer> {
        if self.collective.is_none() {
            return Err(Error::format(
                "gradient buckets are for data-parallel ranks: give --dp",
            ));
        }
        self.buckets =
            (bytes > 0 && self.shard.is_none()).then(|| Buckets::new(self.opt.layout(), bytes));
        Ok(self)
    }

    /// Activation checkpointing: a micro-batch's backward pass runs each layer's forward
    /// again instead of keeping its activations (about a third more compute, a layer's
    /// activations held instead of every layer's). The results are the same either way:
    /// a resumed run may choose again.
    pub fn checkpoint_activations(mut self, on: bool) -> Trainer {
        self.checkpoint_activations = on;
        self
    }

    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    /// Steps done so far.
    pub fn steps_done(&self) -> usize {
        self.step
    }

    pub fn data(&self) -> &TextData {
        &self.data
    }

    /// Parameters in all.
    pub fn parameter_count(&self) -> usize {
        layout_of(&self.opt, &self.shard)
            .entries()
            .iter()
            .map(|e| e.len)
            .sum()
    }

    /// The summed loss of `windows` (each `seq_len + 1` tokens: every token predicts the
    /// next), at most `batch` of them, in one forward pass; with `record`, its gradients
    /// (scaled by `scale`) are added into the parameters'. With `last` (a step's last
    /// micro-batch on a data-parallel rank with buckets), the gradients are also written
    /// into the flat buffer and summed over the ranks, bucket by bucket, as the backward
    /// pass makes them.
    fn sequences(
        &mut self,
        windows: &[&[u32]],
        scale: f32,
        record: bool,
        last: bool,
    ) -> Result<f64> {
        let seq = self.settings.seq_len;
        let kept = match self.checkpoint_activations {
            true => "each layer's input and one layer's activations are kept for the backward pass",
            false => "the activations of every layer are kept for the backward pass: --checkpoint-activations keeps one layer's, or",
        };
        self.micro_batch(windows, scale, record, last)
            .map_err(|e| match e {
                Error::Device(m) if m.starts_with("out of GPU memory") => Error::Device(format!(
                    "{m}, running a micro-batch of {} sequences of {seq} tokens ({kept}): lower --batch, and raise --grad-accum to keep the step's sequences",
                    windows.len()
                )),
                e => e,
            })
    }

    /// [`Trainer::sequences`], without the advice on memory.
    fn micro_batch(
        &mut self,
        windows: &[&[u32]],
        scale: f32,
        record: bool,
        last: bool,
    ) -> Result<f64> {
        let seq = self.settings.seq_len;
        if windows.len() > self.cache.blocks() || windows.iter().any(|w| w.len() != seq + 1) {
            return Err(Error::shape(format!(
                "{} windows for a micro-batch of {} sequences of {seq} tokens",
                windows.len(),
                self.cache.blocks()
            )));
        }
        let blocks: Vec<[u32; 1]> = (0..windows.len() as u32).map(|b| [b]).collect();
        let items: Vec<BatchItem> = windows
            .iter()
            .zip(&blocks)
            .map(|(w, b)| BatchItem {
                tokens: &w[..seq],
                pos0: 0,
                blocks: b,
                want: StepWant::Nothing,
            })
            .collect();
        let targets: Vec<u32> = windows
            .iter()
            .flat_map(|w| w[1..].iter().copied())
            .collect();
        let tape = self.tape.clone();
        let softcap = self.model.config.final_softcap;
        let loss =
            |h: &Tensor, head: &Tensor| tape.cross_entropy(h, head, &targets, softcap, scale);
        if !record {
            self.tape.stop();
            let losses = self
                .model
                .forward_hidden_batch(&items, &mut self.cache, loss)?;
            return Ok(losses.iter().map(|&l| l as f64).sum());
        }
        // The model's (the tape holds the adapters).
        let params: Vec<&Tensor> = self
            .model
            .parameters()
            .into_iter()
            .map(|(_, t)| t)
            .collect();
        // With gradient buckets (a step's last micro-batch on a data-parallel rank), each
        // gradient is written into the flat buffer as soon as it is whole, and a bucket's
        // sum over the ranks starts once all of its tensors are.
        let buckets = match (&self.collective, &self.buckets) {
            (Some(c), Some(b)) if last => Some((c, b)),
            _ => None,
        };
        let entries = self.opt.layout().entries();
        let (grads, index) = (&mut self.grads, &self.flat_index);
        let grad_ops = self.tape.grad_ops();
        let mut left: Vec<usize> =
            buckets.map_or(Vec::new(), |(_, b)| b.spans.iter().map(|s| s.2).collect());
        let mut whole = |i: usize, grad: &Tensor| -> Result<()> {
            let Some((c, b)) = buckets else {
                return Ok(());
            };
            let j = index[i].ok_or_else(|| {
                Error::Device(format!("parameter {i} is frozen but has a gradient"))
            })?;
            let e = &entries[j];
            grad_ops.copy_span(grad, 0, grads, e.offset, e.len)?;
            let k = b.of[j];
            left[k] -= 1;
            if left[k] == 0 {
                c.start_sum(grads, b.spans[k].0, b.spans[k].1)?;
            }
            Ok(())
        };
        let losses = match self.checkpoint_activations {
            true => checkpointed_pass(
                &self.tape,
                &self.model,
                &mut self.cache,
                &items,
                &params,
                loss,
                &mut whole,
            )?,
            false => {
                self.tape.begin();
                let losses = self
                    .model
                    .forward_hidden_batch(&items, &mut self.cache, loss)?;
                self.tape.backward_with(&params, &mut whole)?;
                losses
            }
        };
        if let Some((c, _)) = buckets {
            c.wait_started()?;
            if let Some(k) = left.iter().position(|&n| n > 0) {
                return Err(Error::Device(format!(
                    "gradient bucket {k}: {} of its tensors never got a whole gradient",
                    left[k]
                )));
            }
        }
        Ok(losses.iter().map(|&l| l as f64).sum())
    }

    /// One optimizer step over `batch × grad_accum` random windows of the training text.
    /// A loss or gradient that is not finite stops the run with an error naming the step,
    /// the parameters and the optimizer left as they were; an update that makes a
    /// parameter non-finite stops it too, and the run can then be neither continued nor
    /// saved (its last checkpoint is the step before).
    pub fn step(&mut self) -> Result<StepReport> {
        if let Some(why) = &self.broken {
            return Err(Error::format(why.clone()));
        }
        let s = self.settings.clone();
        if self.step >= s.steps {
            return Err(Error::format(format!(
                "the run's {} steps are done",
                s.steps
            )));
        }
        let number = self.step + 1;
        let seqs = s.batch * s.grad_accum;
        let tokens = seqs * s.seq_len;
        let inner = self.tape.inner().clone();
        // Under loss scaling the gradients are made `loss_scale` times larger (the seed of
        // the backward pass), so that F16-rounded products keep the small ones; the
        // optimizer unscales them, and skips the update (found on the device) when one
        // overflowed.
        let loss_scale = match s.optimizer.loss_scaling {
            Some(_) => self.opt.loss_scale(inner.as_ref())?,
            None => 1.0,
        };
        let scale = loss_scale / tokens as f32;
        self.tape.zero_grads()?;
        let mut sum = 0f64;
        let (rank, world) = self
            .collective
            .as_ref()
            .map_or((0, 1), |c| (c.rank(), c.world()));
        // Windows of seq_len + 1 tokens, starting anywhere (checked to fit). Every rank
        // draws every window, so that their generators stay together; each runs its share
        // (window i on rank i % world) of each micro-batch.
        let span = (self.data.train.len() - s.seq_len) as u64;
        let starts: Vec<usize> = (0..seqs).map(|_| self.rng.below(span) as usize).collect();
        let mine = |m: usize| (m * s.batch..(m + 1) * s.batch).filter(move |i| i % world == rank);
        let last_micro = (0..s.grad_accum).rev().find(|&m| mine(m).next().is_some());
        for m in 0..s.grad_accum {
            // Copies (a few hundred KB): the model borrows the trainer mutably.
            let windows: Vec<Vec<u32>> = mine(m)
                .map(|i| self.data.train[starts[i]..starts[i] + s.seq_len + 1].to_vec())
                .collect();
            if !windows.is_empty() {
                let windows: Vec<&[u32]> = windows.iter().map(Vec::as_slice).collect();
                sum += self.sequences(&windows, scale, true, Some(m) == last_micro)?;
            }
        }
        if let Some(c) = &self.collective {
            sum = self.sum_over_ranks(c.as_ref(), sum)?;
        }
        let loss = sum / tokens as f64;
        if !loss.is_finite() {
            return Err(Error::format(format!(
                "step {number}: the training loss is {loss}; the run stops here (nothing of this step is kept or saved)"
            )));
        }
        let offsets: Vec<usize> = layout_of(&self.opt, &self.shard)
            .entries()
            .iter()
            .map(|e| e.offset)
            .collect();
        if self.buckets.is_none() {
            self.tape.write_grads(&mut self.grads, &offsets)?;
        }
        let grad_norm = match (self.collective.clone(), self.shard.take()) {
            (Some(c), Some(mut shard)) => {
                let norm = self.sharded_update(c.as_ref(), &mut shard, number);
                self.shard = Some(shard);
                norm?
            }
            (c, _) => {
                if let (Some(c), None) = (&c, &self.buckets) {
                    // Each rank's gradient is its sequences' share of the step's mean:
                    // summed, they are the whole step's (the buckets were summed already).
                    c.all_reduce_sum(&mut self.grads)?;
                }
                let grad_norm =
                    self.grad_ops().sum_squares(&self.grads)?.sqrt() / f64::from(loss_scale);
                if s.optimizer.loss_scaling.is_none() {
                    check_norm(grad_norm, number)?;
                }
                self.opt
                    .step(inner.as_ref(), &mut self.params, &self.grads, None)?;
                grad_norm
            }
        };
        let status = self.opt.status(inner.as_ref())?;
        let lr = status.lr;
        if status.skipped != 0 {
            tracing::warn!(
                step = number,
                "a gradient overflowed at loss scale {loss_scale}: the update is skipped and the scale is now {}",
                status.loss_scale
            );
        }
        if !self.grad_ops().sum_squares(&self.params)?.is_finite() {
            let flat = self.parameters_flat()?;
            let (i, bad) = flat
                .iter()
                .enumerate()
                .find(|(_, p)| !p.is_finite())
                .map_or((0, f32::NAN), |(i, &p)| (i, p));
            let why = format!(
                "step {number}: the update made parameter value {i} {bad} (learning rate {lr:e}); the run stops here (nothing of this step is saved)"
            );
            self.broken = Some(why.clone());
            return Err(Error::format(why));
        }
        self.write_params()?;
        self.step = number;
        Ok(StepReport {
            step: number,
            loss,
            lr,
            grad_norm,
            tokens,
            skipped: status.skipped != 0,
        })
    }

    /// A sharded optimizer's update (ZeRO stage 1): the gradients summed and scattered,
    /// each rank holding the sum of its shard; their global norm from the shards' sums of
    /// squares, and clipping as the fused step clips (`max_norm / (norm + 1e-6)`, at most
    /// 1); the shard's step; every shard's new weights gathered into the whole flat
    /// buffer. Returns the norm.
    fn sharded_update(
        &mut self,
        c: &dyn Collective,
        shard: &mut Shard,
        number: usize,
    ) -> Result<f64> {
        let inner = self.tape.inner().clone();
        c.reduce_scatter_sum(&self.grads, &mut shard.grads)?;
        let local = self.grad_ops().sum_squares(&shard.grads)?;
        let grad_norm = self.sum_over_ranks(c, local)?.sqrt();
        check_norm(grad_norm, number)?;
        if let Some(max_norm) = self.settings.optimizer.max_grad_norm {
            let coef = (1.0f32 / (grad_norm as f32 + 1e-6f32)) * max_norm;
            if coef < 1.0 {
                inner.scale(&mut shard.grads, coef)?;
            }
        }
        self.opt
            .step(inner.as_ref(), &mut shard.params, &shard.grads, None)?;
        c.all_gather(&shard.params, &mut self.params)?;
        Ok(grad_norm)
    }

    /// Shard the optimizer over the data-parallel ranks (ZeRO stage 1): each rank keeps
    /// the optimizer's state for `1/world` of the parameters only and updates that part;
    /// the gradients are reduce-scattered and the new weights all-gathered. The same steps
    /// as unsharded, up to the rounding of the gradient norm; checkpoints hold the whole
    /// state ([`Trainer::gather_optimizer`]), so a run resumes sharded or not.
    pub fn shard_optimizer(mut self) -> Result<Trainer> {
        let c = self.collective.clone().ok_or_else(|| {
            Error::format("a sharded optimizer (ZeRO-1) shards over data-parallel ranks: give --dp")
        })?;
        if self.shard.is_some() {
            return Ok(self);
        }
        if self.settings.optimizer.loss_scaling.is_some() {
            return Err(Error::format(
                "loss scaling (F16 products) with a sharded optimizer (--zero1): not supported; use --precision bf16, or leave --zero1 out",
            ));
        }
        let inner = self.tape.inner().clone();
        let grad_ops = self.tape.grad_ops();
        let (world, rank) = (c.world(), c.rank());
        let whole = self.opt.layout().clone();
        let numel = whole.numel();
        let len = numel.div_ceil(world).max(1);
        let (first, padded) = (rank * len, len * world);
        let flat = |n: usize| inner.zeros(DType::F32, Shape::new(vec![n])?);
        let mut params = flat(padded)?;
        grad_ops.copy_span(&self.params, 0, &mut params, 0, numel)?;
        let mut shard_params = flat(len)?;
        grad_ops.copy_span(&params, first, &mut shard_params, 0, len)?;
        let config = StepConfig {
            max_grad_norm: None,
            ..self.settings.optimizer
        };
        let mut opt = Optimizer::new(
            inner.as_ref(),
            ParamLayout::new([("shard", vec![len])])?,
            config,
        )?;
        // The state so far (a resumed run's), this rank's part of it.
        opt.load_shard(
            inner.as_ref(),
            &self.opt.save(inner.as_ref())?,
            &whole,
            first,
        )?;
        self.shard = Some(Shard {
            whole,
            params: shard_params,
            grads: flat(len)?,
        });
        self.opt = opt;
        self.params = params;
        self.grads = flat(padded)?;
        self.buckets = None;
        Ok(self)
    }

    /// The optimizer's whole state as [`Optimizer::save`] writes it: gathered from every
    /// rank's shard when sharded (every rank must call it then, at the same point: rank 0
    /// writes the checkpoint, the others only take part).
    pub fn gather_optimizer(&self) -> Result<Vec<u8>> {
        let inner = self.tape.inner().clone();
        let (Some(c), Some(shard)) = (&self.collective, &self.shard) else {
            return self.opt.save(inner.as_ref());
        };
        let padded = shard.params.shape().numel() * c.world();
        let mut states = Vec::new();
        for name in self.settings.optimizer.rule.states() {
            let part = self
                .opt
                .state(name)
                .ok_or_else(|| Error::format(format!("optimizer state {name} is missing")))?;
            let mut whole = inner.zeros(DType::F32, Shape::new(vec![padded])?)?;
            c.all_gather(part, &mut whole)?;
            states.push(inner.download(&whole)?);
        }
        self.opt.save_whole(inner.as_ref(), &shard.whole, &states)
    }

    /// A rank other than 0 at a point where rank 0 saves a checkpoint: a sharded
    /// optimizer's state is gathered from every rank, so each must take part (nothing to
    /// do otherwise).
    pub fn join_save(&self) -> Result<()> {
        if self.shard.is_some() {
            self.gather_optimizer()?;
        }
        Ok(())
    }

    /// `value` summed over the ranks of `c` (the step's losses), through a one-value
    /// tensor on this rank's device.
    fn sum_over_ranks(&self, c: &dyn Collective, value: f64) -> Result<f64> {
        let inner = self.tape.inner().clone();
        let mut t = inner.upload(
            DType::F32,
            Shape::new(vec![1])?,
            kiln_core::HostBytes::from_vec((value as f32).to_le_bytes().to_vec()),
        )?;
        c.all_reduce_sum(&mut t)?;
        let bytes = inner.download(&t)?;
        Ok(f32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]) as f64)
    }

    fn grad_ops(&self) -> &dyn GradOps {
        self.tape.grad_ops()
    }

    /// Copy the flat master weights into the model's tensors.
    fn write_params(&mut self) -> Result<()> {
        let grad_ops = self.tape.grad_ops();
        let entries = layout_of(&self.opt, &self.shard).entries();
        if self.settings.lora.is_some() {
            let mut adapters = self.tape.adapters();
            let targets = adapters
                .list
                .iter_mut()
                .flat_map(|ad| [&mut ad.a, &mut ad.b]);
            for (t, e) in targets.zip(entries) {
                grad_ops.copy_span(&self.params, e.offset, t, 0, e.len)?;
            }
            return Ok(());
        }
        for ((_, t), e) in self.model.parameters_mut().into_iter().zip(entries) {
            grad_ops.copy_span(&self.params, e.offset, t, 0, e.len)?;
        }
        Ok(())
    }

    /// The model's weights with the adapters' updates merged: `w + scale · B · A` for each
    /// adapted weight (in the model's layout), others unchanged.
    fn merge_adapters(&self, name: &str, values: &mut Vec<f32>) -> Result<()> {
        let adapters = self.tape.adapters();
        let Some(ad) = adapters.list.iter().find(|ad| ad.weight == name) else {
            return Ok(());
        };
        let inner = self.tape.inner().as_ref();
        let (a, b) = (lora::download(inner, &ad.a)?, lora::download(inner, &ad.b)?);
        let (m, k) = (ad.b.dims()[0], ad.a.dims()[1]);
        *values = lora::merged(values, &a, &b, m, k, ad.scale);
        Ok(())
    }

    /// The mean loss over the held-out text: consecutive windows of `seq_len` tokens, at
    /// most `eval_windows` of them. `exp` of it is the held-out perplexity. Data-parallel
    /// ranks score every `world`-th window each and add their sums, so every rank must
    /// call it at the same points (and none waits on another's whole evaluation).
    pub fn held_out_loss(&mut self) -> Result<f64> {
        let seq = self.settings.seq_len;
        let (rank, world) = self
            .collective
            .as_ref()
            .map_or((0, 1), |c| (c.rank(), c.world()));
        let held = std::mem::take(&mut self.data.held_out);
        let starts: Vec<usize> = (0..held.len().saturating_sub(seq))
            .step_by(seq)
            .take(self.settings.eval_windows)
            .collect();
        let mut sum = 0f64;
        let mine: Vec<&[u32]> = starts
            .iter()
            .skip(rank)
            .step_by(world)
            .map(|&start| &held[start..start + seq + 1])
            .collect();
        let mut run = || -> Result<()> {
            for windows in mine.chunks(self.settings.batch) {
                sum += self.sequences(windows, 1.0, false, false)?;
            }
            Ok(())
        };
        let result = run();
        self.data.held_out = held;
        result?;
        if let Some(c) = self.collective.clone() {
            sum = self.sum_over_ranks(c.as_ref(), sum)?;
        }
        Ok(sum / (starts.len() * seq).max(1) as f64)
    }

    /// The name the start file gave the model.
    fn model_name(&self) -> String {
        match self.carried.iter().find(|(k, _)| k == "general.name") {
            Some((_, Value::String(n))) => n.clone(),
            _ => "kiln-trained".into(),
        }
    }

    /// The start file's tokenizer and name, into `w`.
    fn add_carried(&self, w: &mut GgufWriter) -> Result<()> {
        for (k, v) in &self.carried {
            w.set(k, v.clone())?;
        }
        Ok(())
    }

    /// Write a checkpoint to `path` (atomically; see [`checkpoint`]): the model's
    /// weights, the optimizer's state as kiln-optim saves it, the step, the random
    /// generator, the settings. Refused, before anything is written, after an update that
    /// made a parameter non-finite.
    pub fn save_checkpoint(&self, path: &Path) -> Result<()> {
        self.checkpoint()?.write(path)
    }

    /// What [`Trainer::save_checkpoint`] writes, on the host: for a writer that runs
    /// beside the next steps. With a sharded optimizer every rank takes part (as in
    /// [`Trainer::join_save`]).
    pub fn checkpoint(&self) -> Result<checkpoint::Checkpoint> {
        self.check_not_broken()?;
        // The model's own weights (frozen under LoRA) and each adapter's matrices apart,
        // so that a resumed run goes on exactly.
        let mut w = match self.frozen_source {
            Some(_) => self.model.to_gguf_declared(&self.model_name())?,
            None => self.model.to_gguf_as_stored(&self.model_name())?,
        };
        self.add_carried(&mut w)?;
        for ad in &self.tape.adapters().list {
            let (a, b) = Adapter::tensor_names(&ad.weight);
            for (name, t) in [(a, &ad.a), (b, &ad.b)] {
                let bytes = self.tape.inner().download(t)?;
                w.add_tensor(&name, DType::F32, t.dims(), bytes)?;
            }
        }
        checkpoint::add_state(
            &mut w,
            &RunState {
                step: self.step as u64,
                rng: self.rng.state,
                settings: self.settings.clone(),
                data: self.data.fingerprint(),
                optimizer: self.gather_optimizer()?,
            },
        )?;
        Ok(checkpoint::Checkpoint {
            writer: w,
            frozen: self.frozen_source.clone(),
        })
    }

    fn check_not_broken(&self) -> Result<()> {
        match &self.broken {
            Some(why) => Err(Error::format(format!("nothing is written: {why}"))),
            None => Ok(()),
        }
    }

    /// Write the model to `path` as GGUF, matrices as `dtype` (atomically).
    pub fn export_gguf(&self, path: &Path, dtype: DType) -> Result<()> {
        self.check_not_broken()?;
        // The adapters' updates merged in; each tensor is made as the file is written.
        let mut export = self
            .model
            .to_gguf_with(&self.model_name(), dtype, |n, v| self.merge_adapters(n, v))?;
        self.add_carried(&mut export.writer)?;
        kiln_io::file::write_replacing(path, |b| export.write_to(b))
    }

    /// Write the model to the directory `dir` as Hugging Face lays a model out
    /// (`config.json`, `model.safetensors` in F32, and `tokenizer`'s files), each file
    /// atomically; llama and mistral models (a SentencePiece vocabulary or a tokenizer.json).
    pub fn export_hf(&self, dir: &Path, tokenizer: &Tokenizer) -> Result<()> {
        self.check_not_broken()?;
        let model = self.model.to_hf_with(
            tokenizer.bos_id(),
            tokenizer.eos_ids().first().copied(),
            |n, v| self.merge_adapters(n, v),
        )?;
        let mut files = vec![("config.json", model.config.clone())];
        files.extend(tokenizer.hf_files()?);
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir.display(), e))?;
        kiln_io::file::write_replacing(&dir.join("model.safetensors"), |w| model.write_weights(w))?;
        for (name, bytes) in files {
            kiln_io::file::write_replacing(&dir.join(name), |w| {
                use std::io::Write;
                w.write_all(&bytes)
            })?;
        }
        Ok(())
    }

    /// The flat master weights, read from the backend (gaps of the layout included; for
    /// comparing runs).
    pub fn parameters_flat(&self) -> Result<Vec<f32>> {
        let bytes = self.tape.inner().download(&self.params)?;
        // A sharded run's buffer is padded to a multiple of the ranks: not parameters.
        let numel = layout_of(&self.opt, &self.shard).numel();
        Ok(bytes
            .chunks_exact(4)
            .take(numel)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }
}

/// Whether `file` holds every weight of `model` as the model would write it (its type,
/// its bytes as the device gives them back), tensor by tensor.
fn holds_as_stored(file: &GgufFile, model: &Model) -> Result<bool> {
    for (name, t) in model.parameters() {
        let Some(info) = file.tensor(&name) else {
            return Ok(false);
        };
        if info.ggml_type.dtype() != Some(t.dtype())
            || file.tensor_data(info) != model.backend().download(t)?.as_slice()
        {
            return Ok(false);
        }
    }
    Ok(true)
}

fn check_norm(grad_norm: f64, number: usize) -> Result<()> {
    if !grad_norm.is_finite() {
        return Err(Error::format(format!(
            "step {number}: the gradient's norm is {grad_norm}; the run stops here (nothing of this step is kept or saved)"
        )));
    }
    Ok(())
}

/// Refuse settings no run can take: sizes of zero, a context past the model's, text too
/// short for one window.
fn check_settings(s: &Settings, model: &Model, data: &TextData) -> Result<()> {
    let bad = |what: String| Err(Error::format(what));
    for (name, v) in [
        ("batch", s.batch),
        ("grad-accum", s.grad_accum),
        ("seq-len", s.seq_len),
        ("steps", s.steps),
    ] {
        if v == 0 {
            return bad(format!("--{name} 0: it must be at least 1"));
        }
    }
    let context = model.config.max_positions;
    if s.seq_len > context {
        return bad(format!(
            "--seq-len {}: the model's context is {context} positions",
            s.seq_len
        ));
    }
    if data.train.len() <= s.seq_len {
        return bad(format!(
            "the training text is {} tokens; one window of --seq-len {} needs {}",
            data.train.len(),
            s.seq_len,
            s.seq_len + 1
        ));
    }
    if data.held_out.len() <= s.seq_len {
        return bad(format!(
            "the held-out text is {} tokens; one window of --seq-len {} needs {}",
            data.held_out.len(),
            s.seq_len,
            s.seq_len + 1
        ));
    }
    s.optimizer.validate()?;
    if let Some(l) = &s.lora {
        l.validate()?;
    }
    if s.products == Products::F16 && s.optimizer.loss_scaling.is_none() {
        return bad(
            "F16 products without loss scaling: small gradients would round to zero; scale the loss (kiln train does by default with --precision f16)"
                .to_string(),
        );
    }
    Ok(())
}

/// The adapters of a LoRA run: fresh ones (A drawn from a generator of the run's seed, B
/// zero), with the matrices `start` holds under their checkpoint names put in their place
/// (a resumed run, or a new one that starts from a LoRA checkpoint).
fn adapters_of(
    start: &GgufFile,
    model: &Model,
    l: &LoraSettings,
    backend: &dyn Backend,
    seed: u64,
) -> Result<Vec<Adapter>> {
    // Not the data's generator: a LoRA run draws the same windows as a full one.
    let mut rng = Rng::new(seed ^ 0x104a_5eed);
    let mut adapters = lora::fresh(model, l, backend, &mut rng)?;
    let file = start.path.display();
    for ad in &mut adapters {
        let (a, b) = Adapter::tensor_names(&ad.weight);
        for (name, t) in [(a, &mut ad.a), (b, &mut ad.b)] {
            let Some(info) = start.tensor(&name) else {
                continue;
            };
            let wrong = |what: String| Error::format(format!("{file}: {name}: {what}"));
            let shape = info.shape()?;
            if info.ggml_type.dtype() != Some(DType::F32) || shape.dims() != t.dims() {
                return Err(wrong(format!(
                    "{} {shape}, where the run's adapter is F32 {} (another --lora-rank?)",
                    info.ggml_type,
                    t.shape()
                )));
            }
            backend.write(t, start.tensor_data(info))?;
        }
    }
    Ok(adapters)
}
