//! The backward kernels training needs, beside the forward ops of [`crate::Backend`].
//!
//! A backend that can train returns itself from [`crate::Backend::grad`]. Each method is
//! the derivative of one forward op, taking the forward's inputs (as saved by the caller)
//! and the gradient of its output, and *adding* into the gradients of its inputs (`+=`),
//! so that a value read by several ops sums their contributions in place; the ops that
//! begin most gradients (a matmul's input, a norm's, the gated activation's, a written
//! row's source) take a [`GradInto`] and *write* a gradient that nothing has begun, into
//! memory left unfilled ([`crate::Backend::empty`]): at a 134M model's training shape, the
//! zeros those gradients had started as were ~12 GB of fills a step, read back by the
//! adds. Shapes are the
//! forward op's; trained weights are F32 (their gradients are F32 of the same shape), and
//! frozen ones may stay as stored where [`GradOps::frozen_as_stored`] says so. Kernels
//! that change a gradient in place say so.

use crate::{AttentionParams, DType, Result, RopeLayout, Tensor};

/// One sequence of a paged attention's backward (see [`GradOps::attention_backward_runs`]):
/// its query rows and the pool rows of its keys, each as (first, count).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionRun {
    pub rows: (usize, usize),
    pub keys: (usize, usize),
}

/// What a training forward pass kept of a paged attention
/// ([`GradOps::paged_attention_saving`]) for its backward: each query row's log-sum-exp
/// of its scores per head (in log2 units: `log2 Σ 2^(z·log2 e)`; F32 `[n, heads]`) and
/// the output rounded as the products round their operands (`[n, heads, head_dim]`).
/// The backward then computes each row's `Σ P·dP` as `dout · out` and reads the
/// softmax's normaliser instead of recomputing both from the scores.
#[derive(Clone, Copy)]
pub struct AttentionSaved<'a> {
    pub lse: &'a Tensor,
    pub out: &'a Tensor,
}

/// Whether an op adds its result into a gradient tensor or writes it there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GradInto {
    /// `+=`: the tensor holds a gradient begun by other ops.
    Add,
    /// `=`: nothing has begun this gradient; the tensor's contents are unspecified (made by
    /// [`crate::Backend::empty`]) and every element is written.
    Write,
}

/// How the products of training (the forward pass's matmuls over F32 weights and the
/// backward pass's) are computed. The weights, gradients and every sum stay F32: TF32
/// and BF16 round the products' inputs only (PyTorch's `allow_tf32`, and BF16 compute
/// over F32 master weights as under `autocast`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Products {
    /// F32 inputs, F32 arithmetic.
    #[default]
    F32,
    /// Inputs rounded to TF32 (10-bit mantissas), on tensor cores.
    Tf32,
    /// Inputs rounded to BF16 (7-bit mantissas), on tensor cores at twice TF32's rate.
    Bf16,
    /// Inputs rounded to F16 (10-bit mantissas, 5-bit exponents), on tensor cores: small
    /// gradients underflow unless the loss is scaled.
    F16,
}

impl Products {
    pub fn name(self) -> &'static str {
        match self {
            Products::F32 => "f32",
            Products::Tf32 => "tf32",
            Products::Bf16 => "bf16",
            Products::F16 => "f16",
        }
    }

    /// The setting named `s` (f32, tf32, bf16, f16).
    pub fn parse(s: &str) -> Option<Products> {
        [Products::F32, Products::Tf32, Products::Bf16, Products::F16]
            .into_iter()
            .find(|p| p.name() == s)
    }
}

pub trait GradOps: Send + Sync {
    /// Compute F32-weight products as `how` says from now on; an error where this
    /// backend has no such arithmetic (F32 it always has).
    fn set_products(&self, how: Products) -> Result<()> {
        match how {
            Products::F32 => Ok(()),
            other => Err(crate::Error::unsupported(format!(
                "{} products on this device (they are for CUDA GPUs; use f32)",
                other.name()
            ))),
        }
    }

    /// Whether a frozen weight of `dtype` may stay as stored: [`GradOps::matmul_dx`]
    /// takes it as `w`, and [`GradOps::cross_entropy`] (without `dw`) as its output
    /// projection, reading it as `quant::dequantize` decodes it. LoRA over a quantized
    /// model keeps the model quantized where this holds, and converts it to F32 at the
    /// start where not.
    fn frozen_as_stored(&self, dtype: DType) -> bool {
        dtype == DType::F32
    }

    /// `dst = src`, of one dtype and element count (F32 activations, I32 ids and
    /// positions): keeps a value the forward pass is about to overwrite.
    fn copy(&self, src: &Tensor, dst: &mut Tensor) -> Result<()>;

    /// `dst[dst_at..dst_at + n] = src[src_at..src_at + n]`, F32 elements of two buffers
    /// of any shapes: moves a parameter or its gradient in and out of the flat buffers an
    /// optimizer steps over (a tensor cannot be a view of one of them).
    fn copy_span(
        &self,
        src: &Tensor,
        src_at: usize,
        dst: &mut Tensor,
        dst_at: usize,
        n: usize,
    ) -> Result<()>;

    /// `Σ x²` of an F32 tensor, each square and the sum in f64 (a finite `x` gives a
    /// finite sum; an inf or NaN anywhere gives a sum that is not finite). Read back to
    /// the host: the trainer's check that gradients and parameters are finite, and the
    /// gradient norm it reports.
    fn sum_squares(&self, x: &Tensor) -> Result<f64>;

    /// `acc += a · x`, element-wise, both F32 of one element count.
    fn add_scaled(&self, acc: &mut Tensor, x: &Tensor, a: f32) -> Result<()>;

    /// `acc[c] += Σ_r x[r, c]`: the gradient of a row added to every row (a bias).
    fn sum_rows(&self, x: &Tensor, acc: &mut Tensor) -> Result<()>;

    /// Matmul's input gradient: `dx[n, k] += dy[n, m] · w[m, k]` (`=` under
    /// [`GradInto::Write`]; `w` F32, or of a type [`GradOps::frozen_as_stored`] takes).
    fn matmul_dx(&self, dy: &Tensor, w: &Tensor, dx: &mut Tensor, into: GradInto) -> Result<()>;

    /// Matmul's weight gradient: `dw[m, k] += dy[n, m]ᵀ · x[n, k]` (`x` F32, or what
    /// [`GradOps::rounded_for_products`] or [`GradOps::paged_attention_saving`] made of
    /// one: then any shape of `n · k` elements, read row-major as `[n, k]`).
    fn matmul_dw(&self, dy: &Tensor, x: &Tensor, dw: &mut Tensor) -> Result<()>;

    /// `x` (F32) rounded as the products round their operands (BF16 or F16 products), a
    /// new tensor of that type, or `None` where the products read F32: what the tape
    /// keeps of a matmul's input for [`GradOps::matmul_dw`], which would round it so
    /// anyway (half the bytes of an F32 copy, and no rounding in the backward pass).
    fn rounded_for_products(&self, _x: &Tensor) -> Result<Option<Tensor>> {
        Ok(None)
    }

    /// `out = rms_norm(x) · weight` as [`crate::Backend::rms_norm`] computes it, also
    /// returning, from the same pass, `out` rounded as [`GradOps::rounded_for_products`]
    /// rounds it and (with `copy_x`) a copy of `x`: what training keeps of a norm under
    /// 16-bit products (the backward's input, the products' operand). `None`, having done
    /// nothing, where the products read F32 or the backend has no such path.
    fn rms_norm_saving(
        &self,
        _x: &Tensor,
        _weight: &Tensor,
        _eps: f32,
        _out: &mut Tensor,
        _copy_x: bool,
    ) -> Result<Option<(Option<Tensor>, Tensor)>> {
        Ok(None)
    }

    /// `out = act(gate) · up` as [`crate::Backend::silu_mul`] (or `gelu_mul` when `gelu`)
    /// computes it, also returning `gate`, `up` and `out` rounded as
    /// [`GradOps::rounded_for_products`] rounds them: what training keeps of the gated
    /// activation under 16-bit products, in one pass over it instead of three roundings.
    /// `None`, having done nothing, where the products read F32 or the backend has no
    /// such path.
    fn gated_saving(
        &self,
        _gate: &Tensor,
        _up: &Tensor,
        _gelu: bool,
        _out: &mut Tensor,
    ) -> Result<Option<[Tensor; 3]>> {
        Ok(None)
    }

    /// [`crate::Backend::paged_attention`] over `q`, `k_pool` and `v_pool` as
    /// [`GradOps::rounded_for_products`] made them (the forward then reads the operands
    /// its backward will), keeping what the backward can use: each row's log-sum-exp
    /// into `lse` (F32 `[n, heads]`) and the output, besides `out`, rounded into
    /// `out_rounded` (see [`AttentionSaved`]). Returns false, having done nothing, where
    /// the backend has no such path.
    #[allow(clippy::too_many_arguments)]
    fn paged_attention_saving(
        &self,
        _q: &Tensor,
        _k_pool: &Tensor,
        _v_pool: &Tensor,
        _pos: &Tensor,
        _pages: &crate::Pages,
        _params: &AttentionParams,
        _out: &mut Tensor,
        _lse: &mut Tensor,
        _out_rounded: &mut Tensor,
    ) -> Result<bool> {
        Ok(false)
    }

    /// Embedding's table gradient: `dtable[ids[i]] += dy[i]` (`ids` I32 `[n]`; repeated
    /// ids sum).
    fn embedding_backward(&self, dy: &Tensor, ids: &Tensor, dtable: &mut Tensor) -> Result<()>;

    /// RMSNorm's gradients (see [`crate::Backend::rms_norm`]): `dx` always (as `into`
    /// says), `dweight` (added into) when asked.
    #[allow(clippy::too_many_arguments)]
    fn rms_norm_backward(
        &self,
        x: &Tensor,
        weight: &Tensor,
        eps: f32,
        dy: &Tensor,
        dx: &mut Tensor,
        into: GradInto,
        dweight: Option<&mut Tensor>,
    ) -> Result<()>;

    /// LayerNorm's gradients (see [`crate::Backend::layer_norm`]), as
    /// [`GradOps::rms_norm_backward`]'s; the bias's gradient is `sum_rows(dy)`.
    #[allow(clippy::too_many_arguments)]
    fn layer_norm_backward(
        &self,
        x: &Tensor,
        weight: &Tensor,
        eps: f32,
        dy: &Tensor,
        dx: &mut Tensor,
        into: GradInto,
        dweight: Option<&mut Tensor>,
    ) -> Result<()>;

    /// Softmax's gradient from its output `y`: `dx += y · (dy − Σ_row dy·y)`.
    fn softmax_backward(&self, y: &Tensor, dy: &Tensor, dx: &mut Tensor) -> Result<()>;

    /// Rope's gradient, in place: `d` (the rotated value's gradient, shaped as
    /// [`crate::Backend::rope`]'s `x`) is turned back by each pair's angle, becoming the
    /// gradient of the value before rotation.
    fn rope_backward(
        &self,
        d: &mut Tensor,
        pos: &Tensor,
        inv_freq: &Tensor,
        layout: RopeLayout,
    ) -> Result<()>;

    /// Attention's gradients (see [`crate::Backend::attention`]), recomputing the softmax
    /// from `q`, `k_cache` and `v_cache`: `dq` `[n, heads, head_dim]`, `dk`, `dv`
    /// `[capacity, kv_heads, head_dim]`.
    #[allow(clippy::too_many_arguments)]
    fn attention_backward(
        &self,
        q: &Tensor,
        k_cache: &Tensor,
        v_cache: &Tensor,
        pos: &Tensor,
        params: &AttentionParams,
        dout: &Tensor,
        dq: &mut Tensor,
        dk: &mut Tensor,
        dv: &mut Tensor,
    ) -> Result<()>;

    /// [`GradOps::attention_backward`] of a paged attention whose sequences' keys each
    /// lie in one span of the pool: each run's query rows and key rows taken as one
    /// sequence's queries and cache (positions `0..keys.1` at pool rows `keys.0..`), the
    /// gradients added into those rows of `dq`, `dk` and `dv`. Returns false, having done
    /// nothing, where the backend has no such path: the caller then copies each run's
    /// rows out and back around [`GradOps::attention_backward`]. `q`, `k_pool` and
    /// `v_pool` may be what [`GradOps::rounded_for_products`] made of them.
    /// `saved`, where the forward kept it, spares recomputing the softmax's statistics.
    /// Under [`GradInto::Write`] all three gradients begin here: every element is written
    /// (rows no run reaches as zeros).
    #[allow(clippy::too_many_arguments)]
    fn attention_backward_runs(
        &self,
        _q: &Tensor,
        _k_pool: &Tensor,
        _v_pool: &Tensor,
        _pos: &Tensor,
        _runs: &[AttentionRun],
        _params: &AttentionParams,
        _saved: Option<AttentionSaved>,
        _dout: &Tensor,
        _dq: &mut Tensor,
        _dk: &mut Tensor,
        _dv: &mut Tensor,
        _into: GradInto,
    ) -> Result<bool> {
        Ok(false)
    }

    /// The gradients of `out = act(gate) · up`: SiLU, or GELU (tanh) when `gelu`; `into`
    /// for both. `gate` and `up` are F32, or both what [`GradOps::rounded_for_products`]
    /// made of them (the tape keeps them so under 16-bit products, as PyTorch's autocast
    /// does).
    #[allow(clippy::too_many_arguments)]
    fn gated_backward(
        &self,
        gate: &Tensor,
        up: &Tensor,
        gelu: bool,
        dout: &Tensor,
        dgate: &mut Tensor,
        dup: &mut Tensor,
        into: GradInto,
    ) -> Result<()>;

    /// GELU's (tanh approximation) gradient from its input `x`: `dx += gelu'(x) · dy`.
    fn gelu_backward(&self, x: &Tensor, dy: &Tensor, dx: &mut Tensor) -> Result<()>;

    /// Softcap's gradient from its output `y = cap·tanh(x/cap)`: `dx += (1 − (y/cap)²)·dy`.
    fn softcap_backward(&self, y: &Tensor, cap: f32, dy: &Tensor, dx: &mut Tensor) -> Result<()>;

    /// `slice_cols`'s gradient: `dsrc[i, col0 + j] += ddst[i, j]`.
    fn slice_cols_backward(&self, ddst: &Tensor, col0: usize, dsrc: &mut Tensor) -> Result<()>;

    /// `write_rows`'s gradient for the source: `dsrc[i] += ddst[pos[i]]` (`=` under
    /// [`GradInto::Write`]).
    fn gather_rows(
        &self,
        ddst: &Tensor,
        pos: &Tensor,
        dsrc: &mut Tensor,
        into: GradInto,
    ) -> Result<()>;

    /// `write_rows`'s gradient for the destination's earlier contents, in place: the
    /// overwritten rows `pos[i]` of `ddst` become zero.
    fn zero_rows(&self, ddst: &mut Tensor, pos: &Tensor) -> Result<()>;

    /// Cross-entropy of the logits `h · wᵀ` (softcapped when `softcap` is given) against
    /// `targets` (I32 `[n]`), fused so that the `[n, vocab]` logits exist a block of rows
    /// at a time: `losses[i] = logsumexp(z_i) − z_i[targets[i]]` (F32 `[n]`), and when asked
    /// `dh += scale · ∂L/∂h` and `dw += scale · ∂L/∂w`, where `L = Σ losses` (`scale`
    /// makes it a mean over a batch). `w` is F32, or without `dw` of a type
    /// [`GradOps::frozen_as_stored`] takes.
    #[allow(clippy::too_many_arguments)]
    fn cross_entropy(
        &self,
        h: &Tensor,
        w: &Tensor,
        targets: &Tensor,
        softcap: Option<f32>,
        scale: f32,
        losses: &mut Tensor,
        dh: Option<&mut Tensor>,
        dw: Option<&mut Tensor>,
    ) -> Result<()>;
}
