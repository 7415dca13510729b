//! What the tape records of each op, and the reverse walk over it: each node's backward
//! kernels ([`GradOps`]), gradients kept per value and dropped once used.
//!
//! Every value's consumers ran after it was made, so when the walk reaches the op that
//! made a value, its gradient is complete: the op takes it (dropping it from the map) and
//! adds into the gradients of what it read.

use crate::tape::{Operand, ValueId, ValueInfo};
use kiln_core::{
    AttentionParams, AttentionSaved, Backend, DType, Error, GradInto, GradOps, Pages, Result,
    RopeLayout, Shape, Tensor,
};

/// An op's input as the op saw it: which value (or parameter), and its shape then (a
/// buffer is reshaped between ops; its gradient is shaped to match each use).
pub(crate) struct Read {
    pub op: Operand,
    pub dims: Vec<usize>,
}

impl Read {
    /// The value an op just wrote, read (to save it for backward).
    pub fn value(w: &Written) -> Read {
        Read {
            op: Operand::Value(w.id),
            dims: w.dims.clone(),
        }
    }
}

/// An op's output: a new value.
pub(crate) struct Written {
    pub id: ValueId,
    pub dims: Vec<usize>,
    /// A gradient flows into it.
    pub grad: bool,
}

/// A tensor a backward needs: a parameter (handed to backward), or the tape's copy.
#[derive(Clone, Copy)]
pub(crate) enum Saved {
    Param(usize),
    Copy(usize),
}

/// One recorded op; fields named as the forward op's arguments, `s*` what was saved of
/// them.
pub(crate) enum Node {
    Matmul {
        x: Read,
        w: Read,
        /// `x` when `w` takes a gradient; `w` when `x` does.
        sx: Option<Saved>,
        sw: Option<Saved>,
        out: Written,
    },
    Embedding {
        table: Read,
        ids: Saved,
        out: Written,
    },
    RmsNorm {
        x: Read,
        w: Read,
        eps: f32,
        sx: Saved,
        sw: Saved,
        out: Written,
    },
    LayerNorm {
        x: Read,
        w: Read,
        b: Read,
        eps: f32,
        sx: Saved,
        sw: Saved,
        out: Written,
    },
    Softmax {
        x: Read,
        /// The output.
        y: Saved,
        out: Written,
    },
    Rope {
        x: Read,
        pos: Saved,
        inv_freq: Saved,
        layout: RopeLayout,
        out: Written,
    },
    Add {
        acc: Read,
        x: Read,
        /// `x` was one row added to every row of `acc`.
        broadcast: bool,
        out: Written,
    },
    Mul {
        acc: Read,
        x: Read,
        sa: Saved,
        sx: Saved,
        broadcast: bool,
        out: Written,
    },
    Scale {
        x: Read,
        s: f32,
        out: Written,
    },
    Gated {
        gate: Read,
        up: Read,
        sg: Saved,
        su: Saved,
        gelu: bool,
        out: Written,
    },
    Gelu {
        x: Read,
        sx: Saved,
        out: Written,
    },
    Softcap {
        x: Read,
        /// The output.
        y: Saved,
        cap: f32,
        out: Written,
    },
    WriteRows {
        src: Read,
        dst: Read,
        pos: Saved,
        out: Written,
    },
    SliceCols {
        src: Read,
        col0: usize,
        out: Written,
    },
    Attention {
        q: Read,
        k: Read,
        v: Read,
        /// q, k cache, v cache, positions.
        saved: [Saved; 4],
        params: AttentionParams,
        out: Written,
    },
    /// Attention over a paged pool: per sequence as [`Node::Attention`] (see
    /// [`crate::paged`]).
    PagedAttention {
        q: Read,
        k: Read,
        v: Read,
        /// q, k pool, v pool, positions, each row's sequence, the block tables.
        saved: [Saved; 6],
        /// What the forward kept for the backward (`GradOps::paged_attention_saving`):
        /// each row's log-sum-exp and the rounded output.
        kept: Option<[Saved; 2]>,
        runs: Vec<usize>,
        block: usize,
        params: AttentionParams,
        out: Written,
    },
    /// The fused loss's gradient of its input `h`, made in the forward pass.
    Loss {
        h: Read,
        dh: Tensor,
    },
}

fn shape(dims: &[usize]) -> Result<Shape> {
    Shape::new(dims.to_vec())
}

pub(crate) struct Backward<'a> {
    g: &'a dyn GradOps,
    b: &'a dyn Backend,
    params: &'a [&'a Tensor],
    saved: &'a [Tensor],
    values: &'a [ValueInfo],
    param_grads: &'a mut [Option<Tensor>],
    /// Per value: its gradient so far.
    grads: Vec<Option<Tensor>>,
    /// The operands whose gradients the current node has taken out (one value read
    /// twice by one op would be taken twice).
    taken: Vec<Operand>,
}

impl<'a> Backward<'a> {
    pub fn new(
        g: &'a dyn GradOps,
        b: &'a dyn Backend,
        params: &'a [&'a Tensor],
        saved: &'a [Tensor],
        values: &'a [ValueInfo],
        param_grads: &'a mut [Option<Tensor>],
    ) -> Self {
        Backward {
            g,
            b,
            params,
            saved,
            values,
            param_grads,
            grads: (0..values.len()).map(|_| None).collect(),
            taken: Vec::new(),
        }
    }

    /// Walk `nodes` from the last, the gradient of value `seed.0` starting as `seed.1`;
    /// `whole(i, gradient)` is called for the parameters of `first` before the walk and
    /// for those of `whole_after[n]` once node `n` is walked. Returns the gradient of
    /// `input` (an error when none reached it).
    pub fn run(
        mut self,
        nodes: Vec<Node>,
        seed: Option<(ValueId, Tensor)>,
        input: Option<ValueId>,
        first: &[usize],
        whole_after: &[Vec<usize>],
        whole: &mut dyn FnMut(usize, &Tensor) -> Result<()>,
    ) -> Result<Option<Tensor>> {
        let mut report = |b: &Self, params: &[usize]| -> Result<()> {
            for &i in params {
                let g = b.param_grads[i]
                    .as_ref()
                    .ok_or_else(|| Error::Device("a gradient went missing".into()))?;
                whole(i, g)?;
            }
            Ok(())
        };
        if let Some((v, grad)) = seed {
            self.grads[v] = Some(grad);
        }
        report(&self, first)?;
        for (n, node) in nodes.into_iter().enumerate().rev() {
            self.taken.clear();
            self.node(node)?;
            report(&self, &whole_after[n])?;
        }
        let Some(v) = input else {
            return Ok(None);
        };
        match self.grads[v].take() {
            Some(t) => Ok(Some(t)),
            None => Err(Error::Device(
                "backward: no gradient reached the segment's input".into(),
            )),
        }
    }

    fn saved(&self, s: Saved) -> &'a Tensor {
        match s {
            Saved::Param(i) => self.params[i],
            Saved::Copy(i) => &self.saved[i],
        }
    }

    fn zeros(&self, dims: &[usize]) -> Result<Tensor> {
        self.b.zeros(DType::F32, shape(dims)?)
    }

    fn empty(&self, dims: &[usize]) -> Result<Tensor> {
        self.b.empty(DType::F32, shape(dims)?)
    }

    /// The gradient of an op's output, shaped as the op wrote it; `None` when nothing
    /// flows into it (its value was never used on the way to the loss).
    fn out_grad(&mut self, w: &Written) -> Result<Option<Tensor>> {
        match self.grads[w.id].take() {
            Some(mut t) => {
                t.reshape(shape(&w.dims)?)?;
                Ok(Some(t))
            }
            None => Ok(None),
        }
    }

    /// The gradient `r` adds into, taken out and shaped as `r` was read: `Some(None)` when
    /// nothing has begun it, `None` when no gradient flows into it.
    fn take(&mut self, r: &Read) -> Result<Option<Option<Tensor>>> {
        if self.taken.contains(&r.op) {
            return Err(Error::unsupported(
                "differentiating an op that reads one value twice",
            ));
        }
        let taken = match r.op {
            Operand::Param(i) => match self.param_grads[i].take() {
                Some(t) => Some(t),
                None => return Ok(None),
            },
            Operand::Value(v) if !self.values[v].grad => return Ok(None),
            Operand::Value(v) => self.grads[v].take(),
        };
        self.taken.push(r.op);
        Ok(Some(match taken {
            Some(mut t) => {
                t.reshape(shape(&r.dims)?)?;
                Some(t)
            }
            None => None,
        }))
    }

    /// The gradient `r` adds into (zeros the first time); `None` when no gradient flows
    /// into it. Give it back with [`Self::put`].
    fn acc(&mut self, r: &Read) -> Result<Option<Tensor>> {
        match self.take(r)? {
            None => Ok(None),
            Some(Some(t)) => Ok(Some(t)),
            Some(None) => Ok(Some(self.zeros(&r.dims)?)),
        }
    }

    /// As [`Self::acc`], for an op that takes a [`GradInto`]: the first time, unfilled
    /// memory that the op writes.
    fn acc_into(&mut self, r: &Read) -> Result<Option<(Tensor, GradInto)>> {
        match self.take(r)? {
            None => Ok(None),
            Some(Some(t)) => Ok(Some((t, GradInto::Add))),
            Some(None) => Ok(Some((self.empty(&r.dims)?, GradInto::Write))),
        }
    }

    /// [`Self::acc`], or a scratch buffer whose contents are dropped when `r` takes no
    /// gradient (for kernels that always write it).
    fn acc_or_scratch(&mut self, r: &Read) -> Result<(Tensor, bool)> {
        match self.acc(r)? {
            Some(t) => Ok((t, true)),
            None => Ok((self.zeros(&r.dims)?, false)),
        }
    }

    /// As [`Self::acc_or_scratch`], for an op that takes a [`GradInto`] (the scratch is
    /// written too).
    fn acc_or_scratch_into(&mut self, r: &Read) -> Result<((Tensor, bool), GradInto)> {
        match self.acc_into(r)? {
            Some((t, into)) => Ok(((t, true), into)),
            None => Ok(((self.empty(&r.dims)?, false), GradInto::Write)),
        }
    }

    fn put(&mut self, r: &Read, t: Tensor) {
        match r.op {
            Operand::Param(i) => self.param_grads[i] = Some(t),
            Operand::Value(v) => self.grads[v] = Some(t),
        }
    }

    fn put_if(&mut self, r: &Read, (t, keep): (Tensor, bool)) {
        if keep {
            self.put(r, t);
        }
    }

    /// Add the whole gradient `t` into `r`'s: moved in when `r` has none yet.
    fn add(&mut self, r: &Read, mut t: Tensor) -> Result<()> {
        if !self.needs(r) {
            return Ok(());
        }
        t.reshape(shape(&r.dims)?)?;
        if let Operand::Value(v) = r.op {
            if self.grads[v].is_none() {
                self.grads[v] = Some(t);
                return Ok(());
            }
        }
        let mut acc = self
            .acc(r)?
            .ok_or_else(|| Error::Device("a gradient went missing".into()))?;
        let result = self.g.add_scaled(&mut acc, &t, 1.0);
        self.put(r, acc);
        result
    }

    fn node(&mut self, node: Node) -> Result<()> {
        let g = self.g;
        if let Node::Loss { h, dh } = node {
            return self.add(&h, dh);
        }
        let out = match &node {
            Node::Matmul { out, .. }
            | Node::Embedding { out, .. }
            | Node::RmsNorm { out, .. }
            | Node::LayerNorm { out, .. }
            | Node::Softmax { out, .. }
            | Node::Rope { out, .. }
            | Node::Add { out, .. }
            | Node::Mul { out, .. }
            | Node::Scale { out, .. }
            | Node::Gated { out, .. }
            | Node::Gelu { out, .. }
            | Node::Softcap { out, .. }
            | Node::WriteRows { out, .. }
            | Node::SliceCols { out, .. }
            | Node::Attention { out, .. }
            | Node::PagedAttention { out, .. } => out,
            Node::Loss { .. } => unreachable!("handled above"),
        };
        let Some(mut dy) = self.out_grad(out)? else {
            return Ok(());
        };
        let missing = || Error::Device("the tape did not save what a backward needs".into());
        match node {
            Node::Matmul { x, w, sx, sw, .. } => {
                if let Some((mut dx, into)) = self.acc_into(&x)? {
                    let r = g.matmul_dx(&dy, self.saved(sw.ok_or_else(missing)?), &mut dx, into);
                    self.put(&x, dx);
                    r?;
                }
                if let Some(mut dw) = self.acc(&w)? {
                    let r = g.matmul_dw(&dy, self.saved(sx.ok_or_else(missing)?), &mut dw);
                    self.put(&w, dw);
                    r?;
                }
            }
            Node::Embedding { table, ids, .. } => {
                if let Some(mut dt) = self.acc(&table)? {
                    let r = g.embedding_backward(&dy, self.saved(ids), &mut dt);
                    self.put(&table, dt);
                    r?;
                }
            }
            Node::RmsNorm {
                x, w, eps, sx, sw, ..
            } => {
                let (mut dx, into) = self.acc_or_scratch_into(&x)?;
                let mut dw = self.acc(&w)?;
                let r = g.rms_norm_backward(
                    self.saved(sx),
                    self.saved(sw),
                    eps,
                    &dy,
                    &mut dx.0,
                    into,
                    dw.as_mut(),
                );
                self.put_if(&x, dx);
                if let Some(dw) = dw {
                    self.put(&w, dw);
                }
                r?;
            }
            Node::LayerNorm {
                x,
                w,
                b,
                eps,
                sx,
                sw,
                ..
            } => {
                let (mut dx, into) = self.acc_or_scratch_into(&x)?;
                let mut dw = self.acc(&w)?;
                let r = g.layer_norm_backward(
                    self.saved(sx),
                    self.saved(sw),
                    eps,
                    &dy,
                    &mut dx.0,
                    into,
                    dw.as_mut(),
                );
                self.put_if(&x, dx);
                if let Some(dw) = dw {
                    self.put(&w, dw);
                }
                r?;
                if let Some(mut db) = self.acc(&b)? {
                    let r = g.sum_rows(&dy, &mut db);
                    self.put(&b, db);
                    r?;
                }
            }
            Node::Softmax { x, y, .. } => {
                if let Some(mut dx) = self.acc(&x)? {
                    let r = g.softmax_backward(self.saved(y), &dy, &mut dx);
                    self.put(&x, dx);
                    r?;
                }
            }
            Node::Rope {
                x,
                pos,
                inv_freq,
                layout,
                ..
            } => {
                g.rope_backward(&mut dy, self.saved(pos), self.saved(inv_freq), layout)?;
                self.add(&x, dy)?;
            }
            Node::Add {
                acc, x, broadcast, ..
            } => {
                if let Some(mut dx) = self.acc(&x)? {
                    let r = match broadcast {
                        true => g.sum_rows(&dy, &mut dx),
                        false => g.add_scaled(&mut dx, &dy, 1.0),
                    };
                    self.put(&x, dx);
                    r?;
                }
                self.add(&acc, dy)?;
            }
            Node::Mul {
                acc,
                x,
                sa,
                sx,
                broadcast,
                ..
            } => {
                // d(acc) = dy · x; dx = dy · acc (summed over rows when x was one row).
                if self.needs(&x) {
                    let mut t = self.copy(&dy)?;
                    self.b.mul_assign(&mut t, self.saved(sa))?;
                    match broadcast {
                        true => {
                            if let Some(mut dx) = self.acc(&x)? {
                                let r = g.sum_rows(&t, &mut dx);
                                self.put(&x, dx);
                                r?;
                            }
                        }
                        false => self.add(&x, t)?,
                    }
                }
                self.b.mul_assign(&mut dy, self.saved(sx))?;
                self.add(&acc, dy)?;
            }
            Node::Scale { x, s, .. } => {
                self.b.scale(&mut dy, s)?;
                self.add(&x, dy)?;
            }
            Node::Gated {
                gate,
                up,
                sg,
                su,
                gelu,
                ..
            } => {
                let (mut dg, g_into) = self.acc_or_scratch_into(&gate)?;
                let (mut du, u_into) = self.acc_or_scratch_into(&up)?;
                // One mode for both: a fresh one beside a begun one starts as zeros.
                let into = match (g_into, u_into) {
                    (GradInto::Write, GradInto::Write) => GradInto::Write,
                    _ => {
                        for (t, into) in [(&mut dg.0, g_into), (&mut du.0, u_into)] {
                            if into == GradInto::Write {
                                self.b.fill(t, 0.0)?;
                            }
                        }
                        GradInto::Add
                    }
                };
                let r = g.gated_backward(
                    self.saved(sg),
                    self.saved(su),
                    gelu,
                    &dy,
                    &mut dg.0,
                    &mut du.0,
                    into,
                );
                self.put_if(&gate, dg);
                self.put_if(&up, du);
                r?;
            }
            Node::Gelu { x, sx, .. } => {
                if let Some(mut dx) = self.acc(&x)? {
                    let r = g.gelu_backward(self.saved(sx), &dy, &mut dx);
                    self.put(&x, dx);
                    r?;
                }
            }
            Node::Softcap { x, y, cap, .. } => {
                if let Some(mut dx) = self.acc(&x)? {
                    let r = g.softcap_backward(self.saved(y), cap, &dy, &mut dx);
                    self.put(&x, dx);
                    r?;
                }
            }
            Node::WriteRows { src, dst, pos, .. } => {
                if let Some((mut ds, into)) = self.acc_into(&src)? {
                    let r = g.gather_rows(&dy, self.saved(pos), &mut ds, into);
                    self.put(&src, ds);
                    r?;
                }
                if self.needs(&dst) {
                    g.zero_rows(&mut dy, self.saved(pos))?;
                    self.add(&dst, dy)?;
                }
            }
            Node::SliceCols { src, col0, .. } => {
                if let Some(mut ds) = self.acc(&src)? {
                    let r = g.slice_cols_backward(&dy, col0, &mut ds);
                    self.put(&src, ds);
                    r?;
                }
            }
            Node::Attention {
                q,
                k,
                v,
                saved: [sq, sk, sv, spos],
                params,
                ..
            } => {
                let mut dq = self.acc_or_scratch(&q)?;
                let mut dk = self.acc_or_scratch(&k)?;
                let mut dv = self.acc_or_scratch(&v)?;
                let r = g.attention_backward(
                    self.saved(sq),
                    self.saved(sk),
                    self.saved(sv),
                    self.saved(spos),
                    &params,
                    &dy,
                    &mut dq.0,
                    &mut dk.0,
                    &mut dv.0,
                );
                self.put_if(&q, dq);
                self.put_if(&k, dk);
                self.put_if(&v, dv);
                r?;
            }
            Node::PagedAttention {
                q,
                k,
                v,
                saved: [sq, sk, sv, spos, sseq, stables],
                kept,
                runs,
                block,
                params,
                ..
            } => {
                let (mut dq, q_into) = self.acc_or_scratch_into(&q)?;
                let (mut dk, k_into) = self.acc_or_scratch_into(&k)?;
                let (mut dv, v_into) = self.acc_or_scratch_into(&v)?;
                let pages = Pages {
                    seq: self.saved(sseq),
                    tables: self.saved(stables),
                    block,
                    runs: &runs,
                };
                let kept = kept.map(|[lse, out]| AttentionSaved {
                    lse: self.saved(lse),
                    out: self.saved(out),
                });
                let r = crate::paged::attention_backward(
                    self.b,
                    g,
                    [self.saved(sq), self.saved(sk), self.saved(sv)],
                    self.saved(spos),
                    &pages,
                    &params,
                    kept,
                    &dy,
                    [&mut dq.0, &mut dk.0, &mut dv.0],
                    [q_into, k_into, v_into],
                );
                self.put_if(&q, dq);
                self.put_if(&k, dk);
                self.put_if(&v, dv);
                r?;
            }
            Node::Loss { .. } => unreachable!("handled above"),
        }
        Ok(())
    }

    fn needs(&self, r: &Read) -> bool {
        match r.op {
            Operand::Param(i) => self.param_grads[i].is_some(),
            Operand::Value(v) => self.values[v].grad,
        }
    }

    fn copy(&self, t: &Tensor) -> Result<Tensor> {
        let mut c = self.zeros(t.dims())?;
        self.g.copy(t, &mut c)?;
        Ok(c)
    }
}
