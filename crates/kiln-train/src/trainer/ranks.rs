//! Training over several ranks: gradients all-reduced in buckets as the backward pass
//! makes them, and the optimizer's state sharded over the ranks (ZeRO stage 1).

use super::{check_norm, Trainer};
use kiln_core::{Collective, DType, Error, Result, Shape, Tensor};
use kiln_optim::{Optimizer, ParamLayout, StepConfig};
use std::sync::Arc;

/// The flat gradient buffer cut into spans of whole tensors, from its end: the backward
/// pass makes the last layers' gradients first, so the first span is whole soonest.
pub(super) struct Buckets {
    /// Per trainable tensor (entry of the flat buffers): its bucket.
    pub(super) of: Vec<usize>,
    /// Per bucket: its first value, its length and how many tensors it holds.
    pub(super) spans: Vec<(usize, usize, usize)>,
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
pub(super) struct Shard {
    /// The whole parameters' layout (the optimizer's own is the shard's one entry).
    whole: ParamLayout,
    params: Tensor,
    grads: Tensor,
}

/// Gradient buckets' size unless told: PyTorch DDP's default, 25 MiB.
pub const DEFAULT_BUCKET_BYTES: usize = 25 << 20;

/// The layout of the whole flat buffers, sharded or not.
pub(super) fn layout_of<'a>(opt: &'a Optimizer, shard: &'a Option<Shard>) -> &'a ParamLayout {
    shard.as_ref().map_or(opt.layout(), |s| &s.whole)
}

impl Trainer {
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

    /// A sharded optimizer's update (ZeRO stage 1): the gradients summed and scattered,
    /// each rank holding the sum of its shard; their global norm from the shards' sums of
    /// squares, and clipping as the fused step clips (`max_norm / (norm + 1e-6)`, at most
    /// 1); the shard's step; every shard's new weights gathered into the whole flat
    /// buffer. Returns the norm.
    pub(super) fn sharded_update(
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
    pub(super) fn sum_over_ranks(&self, c: &dyn Collective, value: f64) -> Result<f64> {
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
}
