//! The op-level interface every backend implements and every model is written against.
//!
//! Activations are F32 tensors whose rows are tokens; weights keep their stored dtype.
//! Ops write into caller-provided outputs so that a forward pass allocates its buffers
//! once and reuses them every step.

use crate::{DType, Device, HostBytes, Result, Shape, Tensor};

/// How rope pairs the dimensions it rotates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeLayout {
    /// Adjacent pairs `(2i, 2i+1)`: the original LLaMA layout, and what llama.cpp's
    /// converter produces by permuting Q and K rows.
    Interleaved,
    /// Pairs `(i, i + d/2)`: GPT-NeoX and Hugging Face's `rotate_half`.
    Neox,
}

/// How attention scores are formed beyond `q·k`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionParams {
    /// Multiplies `q·k` (usually `1/sqrt(head_dim)`).
    pub scale: f32,
    /// Gemma 2: scores become `cap · tanh(scores / cap)` before the softmax.
    pub softcap: Option<f32>,
    /// Sliding window: a query at position `p` sees keys at positions `> p - window`.
    pub window: Option<usize>,
}

pub trait Backend: Send + Sync {
    fn device(&self) -> Device;

    /// A human-readable description (device name, threads, instruction set).
    fn describe(&self) -> String;

    /// A tensor of zeros.
    fn zeros(&self, dtype: DType, shape: Shape) -> Result<Tensor>;

    /// A tensor holding `data`, which must be exactly `shape` elements of `dtype` in
    /// ggml's encoding. Backends that can use host memory in place do not copy.
    fn upload(&self, dtype: DType, shape: Shape, data: HostBytes) -> Result<Tensor>;

    /// The tensor's bytes, in its dtype's encoding.
    fn download(&self, t: &Tensor) -> Result<Vec<u8>>;

    /// Set every element of an F32 tensor to `value`.
    fn fill(&self, t: &mut Tensor, value: f32) -> Result<()>;

    /// `out[n, m] = x[n, k] · w[m, k]ᵀ`, with `x` and `out` F32 and `w` any dtype.
    /// One row of `x` is a matrix-vector product; more rows are a matrix product.
    fn matmul(&self, x: &Tensor, w: &Tensor, out: &mut Tensor) -> Result<()>;

    /// `out[i] = table[ids[i]]`, dequantized to F32.
    fn embedding(&self, table: &Tensor, ids: &[u32], out: &mut Tensor) -> Result<()>;

    /// Per row: `x / sqrt(mean(x²) + eps) * weight`.
    fn rms_norm(&self, x: &Tensor, weight: &Tensor, eps: f32, out: &mut Tensor) -> Result<()>;

    /// Per row: `(x - mean) / sqrt(var + eps) * weight + bias`.
    fn layer_norm(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: &Tensor,
        eps: f32,
        out: &mut Tensor,
    ) -> Result<()>;

    /// Softmax over each row, in place.
    fn softmax(&self, x: &mut Tensor) -> Result<()>;

    /// Rotate `x` of shape `[tokens, heads, head_dim]` in place; token `t` is at position
    /// `pos0 + t`. `inv_freq` (F32, `rot_dim / 2` values) gives each pair's frequency;
    /// dimensions past `rot_dim` are left as they are.
    fn rope(
        &self,
        x: &mut Tensor,
        pos0: usize,
        inv_freq: &Tensor,
        layout: RopeLayout,
    ) -> Result<()>;

    /// `acc += x`, element-wise; `x` may also be one row, added to every row of `acc`.
    fn add_assign(&self, acc: &mut Tensor, x: &Tensor) -> Result<()>;

    /// `acc *= x`, element-wise; `x` may also be one row, applied to every row of `acc`.
    fn mul_assign(&self, acc: &mut Tensor, x: &Tensor) -> Result<()>;

    /// `x *= s`.
    fn scale(&self, x: &mut Tensor, s: f32) -> Result<()>;

    /// SwiGLU: `out = silu(gate) * up`.
    fn silu_mul(&self, gate: &Tensor, up: &Tensor, out: &mut Tensor) -> Result<()>;

    /// GeGLU: `out = gelu(gate) * up` (tanh approximation).
    fn gelu_mul(&self, gate: &Tensor, up: &Tensor, out: &mut Tensor) -> Result<()>;

    /// `x = gelu(x)` (tanh approximation), in place.
    fn gelu(&self, x: &mut Tensor) -> Result<()>;

    /// `x = cap · tanh(x / cap)`, in place (Gemma 2's final logit soft-capping).
    fn softcap(&self, x: &mut Tensor, cap: f32) -> Result<()>;

    /// Copy the rows of `src` (its outermost dimension) into `dst` from row `row0` on;
    /// both F32, rows of equal size. Writes keys and values into a KV cache.
    fn write_rows(&self, src: &Tensor, dst: &mut Tensor, row0: usize) -> Result<()>;

    /// `dst[i, :] = src[i, col0 .. col0 + dst_cols]` for 2-D F32 tensors: splits the
    /// output of a fused projection (QKV, gate+up).
    fn slice_cols(&self, src: &Tensor, col0: usize, dst: &mut Tensor) -> Result<()>;

    /// Causal attention of `q` `[n, heads, head_dim]` (tokens at positions `pos0..pos0+n`)
    /// over the cached keys and values `[capacity, kv_heads, head_dim]` of positions
    /// `0..pos0+n`, into `out` `[n, heads, head_dim]`. Query head `h` reads KV head
    /// `h / (heads / kv_heads)` (grouped-query attention).
    fn attention(
        &self,
        q: &Tensor,
        k_cache: &Tensor,
        v_cache: &Tensor,
        pos0: usize,
        params: &AttentionParams,
        out: &mut Tensor,
    ) -> Result<()>;
}

/// Copy a tensor held by backend `from` to backend `to` (through host memory: backends
/// know nothing of each other). The result has the same dtype, shape and bytes.
pub fn to_device(t: &Tensor, from: &dyn Backend, to: &dyn Backend) -> Result<Tensor> {
    let bytes = from.download(t)?;
    to.upload(t.dtype(), t.shape().clone(), HostBytes::from_vec(bytes))
}
