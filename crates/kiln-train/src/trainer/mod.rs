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
//! one micro-batch at a time, or one layer's with activation checkpointing
//! ([`crate::recompute`]). Over several ranks: [`ranks`]; checkpoints and exports:
//! [`save`].
//!
//! With LoRA ([`crate::lora`]) the trainable parameters, and so the flat buffers, are the
//! adapters' matrices alone; the model's weights are registered frozen.

use crate::checkpoint;
use crate::data::TextData;
use crate::lora::{self, Adapter, LoraSettings};
use crate::recompute::checkpointed_pass;
use crate::rng::Rng;
use crate::tape::Tape;
use kiln_core::{Backend, Collective, DType, Error, GradOps, Products, Result, Shape, Tensor};
use kiln_io::gguf::{GgufFile, Value};
use kiln_models::{BatchItem, Model, PagedKvCache, StepWant};
use kiln_optim::{Optimizer, ParamLayout, StepConfig};
use serde::{Deserialize, Serialize};
use std::sync::Arc;

mod ranks;
mod save;

pub use ranks::DEFAULT_BUCKET_BYTES;
use ranks::{layout_of, Buckets, Shard};

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
