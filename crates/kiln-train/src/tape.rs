//! The tape: a [`Backend`] that runs every op on the backend it wraps and, while
//! recording, writes down what the op was and what its backward needs. A model built on
//! a tape runs its one forward pass (`Model::ops`) unchanged; the fused trait methods are
//! left to their defaults here, so they arrive as the primitives they stand for.
//!
//! A *value* is one version of a buffer: the model reuses its scratch buffers in every
//! layer and writes some in place (rope, `add_assign`), so each write makes a new value,
//! and what a backward needs of an input is copied when the op runs (once per value),
//! before a later op can overwrite it. Buffers are known by the address of their storage,
//! which a tensor keeps for its life; a buffer the tape has not seen written is a constant.
//! Parameters (registered by the trainer) are never copied: backward is handed them.
//! Under BF16 / F16 products what a product (or the attention) reads is kept rounded to
//! the products' type instead, as the backward's products would read it, and so are the
//! gated activation's gate and up (as PyTorch's autocast keeps them).
//!
//! The state and the recorder are here; each op as the tape records it, in `ops`.

mod ops;

use crate::backward::{Backward, Node, Read, Saved, Written};
use crate::lora::Adapter;
use kiln_core::{
    AttentionParams, Backend, DType, Error, GradOps, HostBytes, Pages, Result, Shape, Storage,
    Tensor,
};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

pub(crate) type ValueId = usize;

/// What an op read: a parameter (by its index) or a value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Operand {
    Param(usize),
    Value(ValueId),
}

/// The identity of a tensor's buffer.
fn key(t: &Tensor) -> usize {
    t.storage() as *const dyn Storage as *const () as usize
}

pub(crate) struct ValueInfo {
    /// Whether a gradient flows into it (it depends on a trainable parameter).
    pub grad: bool,
}

#[derive(Default)]
pub(crate) struct State {
    recording: bool,
    /// Whether the recording keeps its nodes and the copies their backward needs. A
    /// checkpointed pass's forward keeps nothing: it notes which segment first reads each
    /// parameter, and each segment is recorded again, kept, just before its backward.
    keep: bool,
    /// The segment being recorded (0 outside checkpointed passes).
    segment: usize,
    /// Per parameter: the first segment of the pass that reads it. Its gradient is whole
    /// once that segment's backward is done.
    first_segment: HashMap<usize, usize>,
    /// The pass's first backward walk is done: the parameters it never reads were
    /// reported whole then.
    walked: bool,
    /// Buffer → the value it holds now.
    current: HashMap<usize, ValueId>,
    pub values: Vec<ValueInfo>,
    pub nodes: Vec<Node>,
    /// Copies made for backward, and which value each holds (as it is, and rounded as
    /// the products round their operands: see `Recorder::save_rounded`).
    pub saved: Vec<Tensor>,
    saved_of: HashMap<ValueId, usize>,
    rounded_of: HashMap<ValueId, usize>,
    /// Buffer → parameter index.
    params: HashMap<usize, usize>,
    param_keys: Vec<usize>,
    /// Per parameter: its gradient (F32, its shape), `None` when frozen.
    pub param_grads: Vec<Option<Tensor>>,
    /// Per parameter: the number of nodes recorded before it was first read in this
    /// recording. No node below that adds to its gradient, so the backward walk has its
    /// gradient whole once it has passed that node.
    first_read: HashMap<usize, usize>,
}

impl State {
    fn read(&mut self, t: &Tensor) -> Read {
        let k = key(t);
        let op = match self.params.get(&k) {
            Some(&i) => {
                self.first_read.entry(i).or_insert(self.nodes.len());
                self.first_segment.entry(i).or_insert(self.segment);
                Operand::Param(i)
            }
            None => match self.current.get(&k) {
                Some(&v) => Operand::Value(v),
                None => {
                    let v = self.new_value(false);
                    self.current.insert(k, v);
                    Operand::Value(v)
                }
            },
        };
        Read {
            op,
            dims: t.dims().to_vec(),
        }
    }

    fn new_value(&mut self, grad: bool) -> ValueId {
        self.values.push(ValueInfo { grad });
        self.values.len() - 1
    }

    /// `t` now holds a new value.
    fn write(&mut self, t: &Tensor, grad: bool) -> Written {
        let id = self.new_value(grad);
        self.current.insert(key(t), id);
        Written {
            id,
            dims: t.dims().to_vec(),
            grad,
        }
    }

    /// Whether a gradient flows into what `r` read.
    pub(crate) fn needs_grad(&self, r: &Read) -> bool {
        match r.op {
            Operand::Param(i) => self.param_grads[i].is_some(),
            Operand::Value(v) => self.values[v].grad,
        }
    }
}

/// Records the ops run through it; see the module's documentation.
pub struct Tape {
    inner: Arc<dyn Backend>,
    state: Mutex<State>,
    adapters: Mutex<Adapters>,
}

/// LoRA's updates of frozen weights (see [`crate::lora`]): every product with an adapted
/// weight gains its update, as ops recorded like the model's.
#[derive(Default)]
pub(crate) struct Adapters {
    pub list: Vec<Adapter>,
    /// Weight buffer → its adapter in `list`.
    by_weight: HashMap<usize, usize>,
}

impl Tape {
    /// A tape over `inner`, which must have backward kernels.
    pub fn new(inner: Arc<dyn Backend>) -> Result<Tape> {
        if inner.grad().is_none() {
            return Err(Error::unsupported(format!(
                "training on {} ({}): it has no backward kernels yet",
                inner.device(),
                inner.describe()
            )));
        }
        Ok(Tape {
            inner,
            state: Mutex::new(State::default()),
            adapters: Mutex::new(Adapters::default()),
        })
    }

    /// Adapt `weights[i]` (the model's tensors) with `list[i]`: from now on each product
    /// with one of them adds its adapter's update.
    pub(crate) fn set_adapters(&self, list: Vec<Adapter>, weights: &[&Tensor]) -> Result<()> {
        if list.len() != weights.len() {
            return Err(Error::shape("set_adapters: one weight per adapter"));
        }
        let by_weight = weights
            .iter()
            .enumerate()
            .map(|(i, w)| (key(w), i))
            .collect();
        *self.adapters() = Adapters { list, by_weight };
        Ok(())
    }

    pub(crate) fn adapters(&self) -> MutexGuard<'_, Adapters> {
        self.adapters.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `out = x · wᵀ`, recorded, without looking for an adapter.
    fn matmul_recorded(&self, x: &Tensor, w: &Tensor, out: &mut Tensor) -> Result<()> {
        self.record(|rec| {
            let (xr, wr) = (rec.read(x), rec.read(w));
            let (gx, gw) = (rec.needs(&xr), rec.needs(&wr));
            let sx = match gw {
                true => Some(rec.save_rounded(&xr, x)?),
                false => None,
            };
            let sw = match gx {
                true => Some(rec.save(&wr, w)?),
                false => None,
            };
            let out = rec.write(out, gx || gw);
            if gx || gw {
                rec.push(Node::Matmul {
                    x: xr,
                    w: wr,
                    sx,
                    sw,
                    out,
                });
            }
            Ok(())
        })?;
        self.inner.matmul(x, w, out)
    }

    /// The backend the ops run on.
    pub fn inner(&self) -> &Arc<dyn Backend> {
        &self.inner
    }

    pub(crate) fn grad_ops(&self) -> &dyn GradOps {
        self.inner.grad().expect("checked in Tape::new")
    }

    pub(crate) fn state(&self) -> MutexGuard<'_, State> {
        // A panic while recording leaves a tape that `begin` clears.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Make `params` the parameters (in this order), with a zeroed gradient each for those
    /// `trainable` marks. Each is a tensor of this tape's backend, F32 where trained.
    pub fn set_parameters(&self, params: &[&Tensor], trainable: &[bool]) -> Result<()> {
        if params.len() != trainable.len() {
            return Err(Error::shape("set_parameters: one flag per parameter"));
        }
        let mut st = self.state();
        st.params.clear();
        st.param_keys.clear();
        st.param_grads.clear();
        for (i, (p, &train)) in params.iter().zip(trainable).enumerate() {
            if p.dtype() != DType::F32 && train {
                return Err(Error::unsupported(format!(
                    "training a {} parameter (train F32 weights)",
                    p.dtype()
                )));
            }
            if st.params.insert(key(p), i).is_some() {
                return Err(Error::shape(format!("parameter {i} is listed twice")));
            }
            st.param_keys.push(key(p));
            let grad = match train {
                true => Some(self.inner.zeros(DType::F32, p.shape().clone())?),
                false => None,
            };
            st.param_grads.push(grad);
        }
        Ok(())
    }

    /// Start recording a forward pass: what an earlier one recorded is dropped
    /// (parameter gradients are kept: they accumulate until [`Tape::zero_grads`]).
    pub fn begin(&self) {
        self.begin_pass(true);
    }

    /// Start a checkpointed pass: its forward runs through, keeping no copies, as
    /// segments (the first is 0, [`Tape::next_segment`] starts the next); before each
    /// segment's backward, the caller runs it again under [`Tape::record_segment`].
    pub(crate) fn begin_checkpointed(&self) {
        self.begin_pass(false);
    }

    fn begin_pass(&self, keep: bool) {
        let mut st = self.state();
        st.first_segment.clear();
        st.walked = false;
        drop(st);
        self.record_segment(0);
        self.state().keep = keep;
    }

    /// The checkpointed forward pass goes on to its next segment.
    pub(crate) fn next_segment(&self) {
        self.state().segment += 1;
    }

    /// Record segment `segment` of a checkpointed pass, kept for its backward: what was
    /// recorded before is dropped (the pass's notes of which segment reads what stay).
    pub(crate) fn record_segment(&self, segment: usize) {
        let mut st = self.state();
        st.recording = true;
        st.keep = true;
        st.segment = segment;
        st.current.clear();
        st.values.clear();
        st.nodes.clear();
        st.saved.clear();
        st.saved_of.clear();
        st.rounded_of.clear();
        st.first_read.clear();
    }

    /// While recording: `t` holds a segment's input, a value whose gradient
    /// [`Tape::backward_segment`] returns.
    pub(crate) fn input(&self, t: &Tensor) -> ValueId {
        self.state().write(t, true).id
    }

    /// Stop recording and drop what was recorded: ops run through untouched (held-out
    /// loss, generation).
    pub fn stop(&self) {
        self.begin();
        self.state().recording = false;
    }

    pub fn zero_grads(&self) -> Result<()> {
        let mut st = self.state();
        for g in st.param_grads.iter_mut().flatten() {
            self.inner.fill(g, 0.0)?;
        }
        Ok(())
    }

    /// Read every trainable parameter's gradient into `out` on the host (registration
    /// order, frozen parameters skipped): for checks, not for the training step.
    pub fn read_grads(&self, out: &mut [f32]) -> Result<()> {
        let st = self.state();
        let mut at = 0;
        for g in st.param_grads.iter().flatten() {
            let n = g.shape().numel();
            let dst = out
                .get_mut(at..at + n)
                .ok_or_else(|| Error::shape("read_grads: the buffer is too short"))?;
            let bytes = self.inner.download(g)?;
            for (d, c) in dst.iter_mut().zip(bytes.chunks_exact(4)) {
                *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
            at += n;
        }
        Ok(())
    }

    /// Copy every trainable parameter's gradient into `flat` (F32, on this tape's
    /// backend), the `i`-th (registration order, frozen parameters skipped) at
    /// `offsets[i]`: the flat gradient buffer an optimizer steps over.
    pub fn write_grads(&self, flat: &mut Tensor, offsets: &[usize]) -> Result<()> {
        let st = self.state();
        let grads: Vec<&Tensor> = st.param_grads.iter().flatten().collect();
        if grads.len() != offsets.len() {
            return Err(Error::shape(format!(
                "write_grads: {} offsets for {} trainable parameters",
                offsets.len(),
                grads.len()
            )));
        }
        for (g, &at) in grads.into_iter().zip(offsets) {
            self.grad_ops()
                .copy_span(g, 0, flat, at, g.shape().numel())?;
        }
        Ok(())
    }

    /// Cross-entropy of the logits `h · wᵀ` (softcapped when `softcap` is given) against
    /// `targets`, fused (see [`GradOps::cross_entropy`]): returns each row's loss. While
    /// recording, the gradients of `scale · Σ losses` are made here, in the same pass: the
    /// projection's into its parameter gradient, `h`'s kept for [`Tape::backward`].
    pub fn cross_entropy(
        &self,
        h: &Tensor,
        w: &Tensor,
        targets: &[u32],
        softcap: Option<f32>,
        scale: f32,
    ) -> Result<Vec<f32>> {
        let n = targets.len();
        let ids: Vec<u8> = targets
            .iter()
            .flat_map(|&t| (t as i32).to_le_bytes())
            .collect();
        let targets =
            self.inner
                .upload(DType::I32, Shape::new(vec![n])?, HostBytes::from_vec(ids))?;
        let mut losses = self.inner.zeros(DType::F32, Shape::new(vec![n])?)?;
        let g = self.grad_ops();
        let mut st = self.state();
        if !st.recording {
            drop(st);
            g.cross_entropy(h, w, &targets, softcap, scale, &mut losses, None, None)?;
        } else if !st.keep {
            return Err(Error::unsupported(
                "a loss in the forward run of a checkpointed pass (record its segment)",
            ));
        } else {
            let (hr, wr) = (st.read(h), st.read(w));
            let mut dh = match st.needs_grad(&hr) {
                true => Some(self.inner.zeros(DType::F32, h.shape().clone())?),
                false => None,
            };
            let mut dw = match wr.op {
                Operand::Param(i) => st.param_grads[i].take(),
                Operand::Value(_) if st.needs_grad(&wr) => {
                    return Err(Error::unsupported(
                        "a loss whose output projection is computed, not a parameter",
                    ))
                }
                Operand::Value(_) => None,
            };
            let run = g.cross_entropy(
                h,
                w,
                &targets,
                softcap,
                scale,
                &mut losses,
                dh.as_mut(),
                dw.as_mut(),
            );
            if let Operand::Param(i) = wr.op {
                st.param_grads[i] = dw;
            }
            run?;
            if let Some(dh) = dh {
                st.nodes.push(Node::Loss { h: hr, dh });
            }
        }
        let bytes = self.inner.download(&losses)?;
        Ok(bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    /// Walk the recorded ops backwards from the losses, adding into the parameters'
    /// gradients; `params` are the registered parameters, in order, but the LoRA
    /// adapters' (the last ones), which the tape holds itself. The recording is dropped
    /// after.
    pub fn backward(&self, params: &[&Tensor]) -> Result<()> {
        self.backward_with(params, &mut |_, _| Ok(()))
    }

    /// [`Tape::backward`], calling `whole(i, gradient)` for each trainable parameter `i`
    /// as soon as the walk has its gradient whole (nothing left adds to it), before the
    /// walk goes on: gradient buckets start their sums there. Parameters the recording
    /// never reads come first; every trainable one comes once.
    pub fn backward_with(
        &self,
        params: &[&Tensor],
        whole: &mut dyn FnMut(usize, &Tensor) -> Result<()>,
    ) -> Result<()> {
        let result = self.backward_segment(params, None, None, whole);
        self.begin();
        result.map(drop)
    }

    /// The backward walk of what was recorded, from the losses and from `seed` (a buffer
    /// and the gradient of the value it holds now: the segment's output; dropped when no
    /// trainable parameter made that value); returns the gradient of `input` (see
    /// [`Tape::input`]). `whole` as in [`Tape::backward_with`]: in a checkpointed pass,
    /// for the parameters whose first segment this is. The nodes and copies are dropped;
    /// the caller records the next segment.
    pub(crate) fn backward_segment(
        &self,
        params: &[&Tensor],
        seed: Option<(&Tensor, Tensor)>,
        input: Option<ValueId>,
        whole: &mut dyn FnMut(usize, &Tensor) -> Result<()>,
    ) -> Result<Option<Tensor>> {
        // Adapters, then the state: the order `matmul` takes them in.
        let adapters = self.adapters();
        let params: Vec<&Tensor> = params
            .iter()
            .copied()
            .chain(adapters.list.iter().flat_map(|ad| [&ad.a, &ad.b]))
            .collect();
        let mut st = self.state();
        if params.len() != st.param_keys.len()
            || params.iter().zip(&st.param_keys).any(|(p, &k)| key(p) != k)
        {
            return Err(Error::shape(
                "backward: the parameters differ from those the tape was given",
            ));
        }
        let seed = match seed {
            Some((t, grad)) => match st.current.get(&key(t)) {
                Some(&v) => st.values[v].grad.then_some((v, grad)),
                None => {
                    return Err(Error::shape(
                        "backward: the seed's buffer was not written in this recording",
                    ))
                }
            },
            None => None,
        };
        let nodes = std::mem::take(&mut st.nodes);
        let mut param_grads = std::mem::take(&mut st.param_grads);
        // Per node, the parameters whose gradients are whole once it is walked.
        let mut whole_after: Vec<Vec<usize>> = vec![Vec::new(); nodes.len()];
        let mut first = Vec::new();
        for i in (0..param_grads.len()).filter(|&i| param_grads[i].is_some()) {
            match st.first_segment.get(&i) {
                Some(&s) if s == st.segment => match st.first_read.get(&i) {
                    Some(&n) if n < nodes.len() => whole_after[n].push(i),
                    _ => first.push(i),
                },
                // Whole in another segment's walk.
                Some(_) => {}
                // Never read: whole now, reported by the pass's first walk.
                None if !st.walked => first.push(i),
                None => {}
            }
        }
        st.walked = true;
        let result = Backward::new(
            self.grad_ops(),
            self.inner.as_ref(),
            &params,
            &st.saved,
            &st.values,
            &mut param_grads,
        )
        .run(nodes, seed, input, &first, &whole_after, whole);
        st.param_grads = param_grads;
        st.saved.clear();
        st.saved_of.clear();
        st.rounded_of.clear();
        result
    }

    /// While recording, `f` records an op before it runs (it may overwrite what its
    /// backward needs).
    fn record(&self, f: impl FnOnce(&mut Recorder) -> Result<()>) -> Result<()> {
        let mut st = self.state();
        if !st.recording {
            return Ok(());
        }
        f(&mut Recorder {
            st: &mut st,
            tape: self,
        })
    }
}

/// Records one op: reads its inputs, saves what its backward needs (before the op runs:
/// it may overwrite them), and names its output.
pub(crate) struct Recorder<'a, 'b> {
    st: &'a mut MutexGuard<'b, State>,
    tape: &'a Tape,
}

impl Recorder<'_, '_> {
    fn read(&mut self, t: &Tensor) -> Read {
        self.st.read(t)
    }

    fn needs(&self, r: &Read) -> bool {
        self.st.needs_grad(r)
    }

    /// What backward will need of `t` (read as `r`): a parameter as it is, a value copied
    /// once.
    fn save(&mut self, r: &Read, t: &Tensor) -> Result<Saved> {
        let v = match r.op {
            Operand::Param(i) => return Ok(Saved::Param(i)),
            Operand::Value(v) => v,
        };
        if let Some(&s) = self.st.saved_of.get(&v) {
            return Ok(Saved::Copy(s));
        }
        if !self.st.keep {
            // The node it goes into is dropped (see `push`).
            return Ok(Saved::Copy(usize::MAX));
        }
        let mut copy = self.tape.inner.zeros(t.dtype(), t.shape().clone())?;
        self.tape.grad_ops().copy(t, &mut copy)?;
        self.st.saved.push(copy);
        let s = self.st.saved.len() - 1;
        self.st.saved_of.insert(v, s);
        Ok(Saved::Copy(s))
    }

    /// What a matmul's weight gradient (or a paged attention's backward) needs of its
    /// input `t`: rounded as the products round their operands where they do (the
    /// product would round it so anyway), else as [`Recorder::save`] keeps it.
    fn save_rounded(&mut self, r: &Read, t: &Tensor) -> Result<Saved> {
        let v = match r.op {
            Operand::Param(i) => return Ok(Saved::Param(i)),
            Operand::Value(v) => v,
        };
        if let Some(&s) = self.st.rounded_of.get(&v) {
            return Ok(Saved::Copy(s));
        }
        if !self.st.keep {
            return Ok(Saved::Copy(usize::MAX));
        }
        let Some(rounded) = self.tape.grad_ops().rounded_for_products(t)? else {
            return self.save(r, t);
        };
        self.st.saved.push(rounded);
        let s = self.st.saved.len() - 1;
        self.st.rounded_of.insert(v, s);
        Ok(Saved::Copy(s))
    }

    /// A paged attention run over the operands `saved` kept rounded (16-bit products),
    /// keeping each row's log-sum-exp and the rounded output (which is then what a product
    /// reading the output `out_value` keeps too): the saved indices of both, or `None`
    /// where the operands are F32 or the backend has no such path (the caller runs the
    /// attention itself). A pass that keeps nothing (activation checkpointing's first)
    /// runs the same kernel over copies of `qkv` it drops, so that the pass recorded again
    /// before the backward computes what it computed.
    #[allow(clippy::too_many_arguments)]
    fn attention_saving(
        &mut self,
        qkv: [&Tensor; 3],
        saved: &[Saved; 6],
        pos: &Tensor,
        pages: &Pages,
        params: &AttentionParams,
        out: &mut Tensor,
        out_value: ValueId,
    ) -> Result<Option<[Saved; 2]>> {
        let g = self.tape.grad_ops();
        let dropped: Vec<Tensor>;
        let (q, k, v) = if self.st.keep {
            let [Saved::Copy(sq), Saved::Copy(sk), Saved::Copy(sv), ..] = *saved else {
                return Ok(None);
            };
            let all = &self.st.saved;
            (&all[sq], &all[sk], &all[sv])
        } else {
            dropped = match qkv.map(|t| g.rounded_for_products(t)) {
                [Ok(Some(q)), Ok(Some(k)), Ok(Some(v))] => vec![q, k, v],
                [a, b, c] => {
                    a?;
                    b?;
                    c?;
                    return Ok(None);
                }
            };
            (&dropped[0], &dropped[1], &dropped[2])
        };
        if q.dtype() == DType::F32 {
            return Ok(None);
        }
        let heads = q.dims().get(1).copied().unwrap_or(0);
        let inner = &self.tape.inner;
        let mut lse = inner.zeros(DType::F32, Shape::new(vec![q.dims()[0], heads])?)?;
        let mut out_rounded = inner.zeros(q.dtype(), out.shape().clone())?;
        if !g.paged_attention_saving(
            q,
            k,
            v,
            pos,
            pages,
            params,
            out,
            &mut lse,
            &mut out_rounded,
        )? {
            return Ok(None);
        }
        if !self.st.keep {
            // The node goes nowhere (see `push`).
            return Ok(Some([Saved::Copy(usize::MAX); 2]));
        }
        self.st.saved.push(lse);
        self.st.saved.push(out_rounded);
        let n = self.st.saved.len();
        self.st.rounded_of.insert(out_value, n - 1);
        Ok(Some([Saved::Copy(n - 2), Saved::Copy(n - 1)]))
    }

    /// The gated activation run by [`GradOps::gated_saving`] where the backend can (16-bit
    /// products, a pass that keeps): gate, up and the output `out_value` kept rounded from
    /// that one pass, as [`Recorder::save_rounded`] would keep them. `None`, having done
    /// nothing, elsewhere (the caller saves and runs the op itself).
    fn gated_saving(
        &mut self,
        [(gate, gr), (up, ur)]: [(&Tensor, &Read); 2],
        gelu: bool,
        out: &mut Tensor,
    ) -> Result<Option<[usize; 3]>> {
        let (Operand::Value(g), Operand::Value(u)) = (gr.op, ur.op) else {
            return Ok(None);
        };
        if !self.st.keep
            || self.st.rounded_of.contains_key(&g)
            || self.st.rounded_of.contains_key(&u)
        {
            return Ok(None);
        }
        let Some(kept) = self.tape.grad_ops().gated_saving(gate, up, gelu, out)? else {
            return Ok(None);
        };
        let at = self.st.saved.len();
        self.st.saved.extend(kept);
        self.st.rounded_of.insert(g, at);
        self.st.rounded_of.insert(u, at + 1);
        Ok(Some([at, at + 1, at + 2]))
    }

    /// The norm run by [`GradOps::rms_norm_saving`] where the backend can (16-bit products,
    /// a pass that keeps): what the backward needs of `x` (read as `xr`; its copy made in
    /// that pass unless kept already) and the index of the output's rounded copy. `None`,
    /// having done nothing, elsewhere.
    fn rms_norm_saving(
        &mut self,
        (x, xr): (&Tensor, &Read),
        weight: &Tensor,
        eps: f32,
        out: &mut Tensor,
    ) -> Result<Option<(Saved, usize)>> {
        if !self.st.keep {
            return Ok(None);
        }
        let value = match xr.op {
            Operand::Value(v) => Some(v),
            Operand::Param(_) => None,
        };
        let have = value.and_then(|v| self.st.saved_of.get(&v).copied());
        let copy_x = value.is_some() && have.is_none();
        let g = self.tape.grad_ops();
        let Some((x_copy, rounded)) = g.rms_norm_saving(x, weight, eps, out, copy_x)? else {
            return Ok(None);
        };
        let sx = match (xr.op, have, x_copy) {
            (Operand::Param(i), ..) => Saved::Param(i),
            (Operand::Value(_), Some(s), _) => Saved::Copy(s),
            (Operand::Value(v), None, Some(copy)) => {
                self.st.saved.push(copy);
                let s = self.st.saved.len() - 1;
                self.st.saved_of.insert(v, s);
                Saved::Copy(s)
            }
            (Operand::Value(_), None, None) => {
                return Err(Error::Device("a norm's input copy went missing".into()))
            }
        };
        self.st.saved.push(rounded);
        Ok(Some((sx, self.st.saved.len() - 1)))
    }

    /// `t` will hold the op's output, a new value with a gradient when `grad`.
    fn write(&mut self, t: &Tensor, grad: bool) -> Written {
        self.st.write(t, grad)
    }

    /// What the rounded copy saved at `at` holds: value `v` (see [`Recorder::save_rounded`]).
    fn note_rounded(&mut self, v: ValueId, at: usize) {
        self.st.rounded_of.insert(v, at);
    }

    fn push(&mut self, node: Node) {
        if self.st.keep {
            self.st.nodes.push(node);
        }
    }

    /// The output of an op whose input's value is written in place: saves `before` of
    /// the input (when `save_input`), and the output's value.
    fn in_place(&mut self, x: &Tensor, save_input: bool) -> Result<(Read, Option<Saved>, Written)> {
        let r = self.read(x);
        let grad = self.needs(&r);
        let saved = match grad && save_input {
            true => Some(self.save(&r, x)?),
            false => None,
        };
        Ok((r, saved, self.write(x, grad)))
    }
}
