//! The forward pass, written once for every architecture: one straight sequence of
//! backend ops, steered by [`ModelConfig`].

use crate::config::{Ffn, ModelConfig, Norm};
use crate::weights::{FfnWeights, GateUp, Linear, ModelWeights, NormWeights, Qkv};
use kiln_core::{quant, AttentionParams, Backend, DType, Error, Result, Shape, Tensor};
use std::sync::Arc;

/// Which positions' logits a forward pass returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// The last position only (generation).
    Last,
    /// Every position (perplexity, tests).
    All,
}

/// Keys and values of every layer, `[capacity, kv_heads, head_dim]` each, on the device.
pub struct KvCache {
    k: Vec<Tensor>,
    v: Vec<Tensor>,
    capacity: usize,
}

/// Activations for a batch of `n` tokens, allocated once per batch size and reused.
struct Scratch {
    n: usize,
    x: Tensor,
    h: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    qkv: Option<Tensor>,
    attn: Tensor,
    o: Tensor,
    gate: Tensor,
    up: Tensor,
    gate_up: Option<Tensor>,
    act: Tensor,
    down: Tensor,
    pos: Option<Tensor>,
}

pub struct Model {
    pub config: ModelConfig,
    weights: ModelWeights,
    backend: Arc<dyn Backend>,
    scratch: Option<Scratch>,
}

fn f32_tensor(b: &dyn Backend, dims: &[usize]) -> Result<Tensor> {
    b.zeros(DType::F32, Shape::new(dims.to_vec())?)
}

fn reshape(t: &mut Tensor, dims: &[usize]) -> Result<()> {
    t.reshape(Shape::new(dims.to_vec())?)
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
            scratch: None,
        }
    }

    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// A KV cache for `capacity` positions (at most the model's trained context).
    pub fn new_cache(&self, capacity: usize) -> Result<KvCache> {
        let c = &self.config;
        let mut k = Vec::with_capacity(c.n_layers);
        let mut v = Vec::with_capacity(c.n_layers);
        for _ in 0..c.n_layers {
            k.push(f32_tensor(
                self.backend.as_ref(),
                &[capacity, c.n_kv_heads, c.head_dim],
            )?);
            v.push(f32_tensor(
                self.backend.as_ref(),
                &[capacity, c.n_kv_heads, c.head_dim],
            )?);
        }
        Ok(KvCache { k, v, capacity })
    }

    fn scratch(&mut self, n: usize) -> Result<Scratch> {
        if let Some(s) = self.scratch.take().filter(|s| s.n == n) {
            return Ok(s);
        }
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
        Ok(Scratch {
            n,
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
            pos: self
                .weights
                .pos_embed
                .is_some()
                .then(|| f32_tensor(b, &[n, c.dim]))
                .transpose()?,
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
        let mut s = self.scratch(n)?;
        let result = self.forward_with(&mut s, ids, pos0, cache, which);
        self.scratch = Some(s);
        result
    }

    fn forward_with(
        &self,
        s: &mut Scratch,
        ids: &[u32],
        pos0: usize,
        cache: &mut KvCache,
        which: Logits,
    ) -> Result<Vec<f32>> {
        let c = &self.config;
        let b = self.backend.as_ref();
        let w = &self.weights;
        let n = ids.len();

        b.embedding(&w.embed, ids, &mut s.x)?;
        if let Some(scale) = c.embed_scale {
            b.scale(&mut s.x, scale)?;
        }
        if let (Some(pe), Some(pos)) = (&w.pos_embed, s.pos.as_mut()) {
            let positions: Vec<u32> = (pos0..pos0 + n).map(|p| p as u32).collect();
            b.embedding(pe, &positions, pos)?;
            b.add_assign(&mut s.x, pos)?;
        }

        for (l, lw) in w.layers.iter().enumerate() {
            // Attention block.
            self.norm(&lw.attn_norm, &s.x, &mut s.h)?;
            match &lw.qkv {
                Qkv::Fused(qkv) => {
                    let buf = s.qkv.as_mut().expect("allocated for fused models");
                    self.linear(qkv, &s.h, buf)?;
                    b.slice_cols(buf, 0, &mut s.q)?;
                    b.slice_cols(buf, c.q_dim(), &mut s.k)?;
                    b.slice_cols(buf, c.q_dim() + c.kv_dim(), &mut s.v)?;
                }
                Qkv::Split { q, k, v } => {
                    self.linear(q, &s.h, &mut s.q)?;
                    self.linear(k, &s.h, &mut s.k)?;
                    self.linear(v, &s.h, &mut s.v)?;
                }
            }
            reshape(&mut s.q, &[n, c.n_heads, c.head_dim])?;
            reshape(&mut s.k, &[n, c.n_kv_heads, c.head_dim])?;
            reshape(&mut s.v, &[n, c.n_kv_heads, c.head_dim])?;
            if let (Some(rope), Some(inv_freq)) = (&c.rope, &w.inv_freq) {
                b.rope(&mut s.q, pos0, inv_freq, rope.layout)?;
                b.rope(&mut s.k, pos0, inv_freq, rope.layout)?;
            }
            b.write_rows(&s.k, &mut cache.k[l], pos0)?;
            b.write_rows(&s.v, &mut cache.v[l], pos0)?;
            let params = AttentionParams {
                scale: c.attn_scale,
                softcap: c.attn_softcap,
                window: c.layer_window(l),
            };
            b.attention(&s.q, &cache.k[l], &cache.v[l], pos0, &params, &mut s.attn)?;
            reshape(&mut s.q, &[n, c.q_dim()])?;
            reshape(&mut s.k, &[n, c.kv_dim()])?;
            reshape(&mut s.v, &[n, c.kv_dim()])?;
            reshape(&mut s.attn, &[n, c.q_dim()])?;
            self.linear(&lw.o, &s.attn, &mut s.o)?;
            reshape(&mut s.attn, &[n, c.n_heads, c.head_dim])?;
            if let Some(pn) = &lw.post_attn_norm {
                self.norm(pn, &s.o, &mut s.h)?;
                b.add_assign(&mut s.x, &s.h)?;
            } else {
                b.add_assign(&mut s.x, &s.o)?;
            }

            // Feed-forward block.
            self.norm(&lw.ffn_norm, &s.x, &mut s.h)?;
            match &lw.ffn {
                FfnWeights::Gated { gate_up, down } => {
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
                    self.linear(down, &s.act, &mut s.down)?;
                }
                FfnWeights::Plain { up, down } => {
                    self.linear(up, &s.h, &mut s.act)?;
                    b.gelu(&mut s.act)?;
                    self.linear(down, &s.act, &mut s.down)?;
                }
            }
            if let Some(pn) = &lw.post_ffn_norm {
                self.norm(pn, &s.down, &mut s.h)?;
                b.add_assign(&mut s.x, &s.h)?;
            } else {
                b.add_assign(&mut s.x, &s.down)?;
            }
        }

        self.norm(&w.out_norm, &s.x, &mut s.h)?;
        let head = w.output.as_ref().unwrap_or(&w.embed);
        let rows = match which {
            Logits::All => n,
            Logits::Last => 1,
        };
        let mut logits = f32_tensor(b, &[rows, c.vocab_size])?;
        match which {
            Logits::All => b.matmul(&s.h, head, &mut logits)?,
            Logits::Last => {
                // The last row of h, as a [1, dim] tensor.
                reshape(&mut s.h, &[1, n * c.dim])?;
                let mut last = f32_tensor(b, &[1, c.dim])?;
                let sliced = b.slice_cols(&s.h, (n - 1) * c.dim, &mut last);
                reshape(&mut s.h, &[n, c.dim])?;
                sliced?;
                b.matmul(&last, head, &mut logits)?;
            }
        }
        if let Some(cap) = c.final_softcap {
            b.softcap(&mut logits, cap)?;
        }
        download_f32(b, &logits)
    }

    fn norm(&self, nw: &NormWeights, x: &Tensor, out: &mut Tensor) -> Result<()> {
        match (self.config.norm, &nw.b) {
            (Norm::Rms { eps }, _) => self.backend.rms_norm(x, &nw.w, eps, out),
            (Norm::Layer { eps }, Some(bias)) => self.backend.layer_norm(x, &nw.w, bias, eps, out),
            (Norm::Layer { .. }, None) => Err(Error::format("LayerNorm without a bias")),
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
