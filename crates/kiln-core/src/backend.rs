//! The op-level interface every backend implements and every model is written against.
//!
//! Activations are F32 tensors whose rows are tokens; weights keep their stored dtype.
//! Ops write into caller-provided outputs so that a forward pass allocates its buffers
//! once and reuses them every step. Token ids and positions are I32 tensors on the device,
//! written once per step, so that a recorded step (see [`Backend::capture`]) can be
//! replayed for the next token with nothing but those two small writes.

use crate::{
    sampling, DType, Device, Error, GradOps, HostBytes, Result, SampleParams, Shape, Tensor,
};

/// How rope pairs the dimensions it rotates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeLayout {
    /// Adjacent pairs `(2i, 2i+1)`: the original LLaMA layout, and what llama.cpp's
    /// converter produces by permuting Q and K rows.
    Interleaved,
    /// Pairs `(i, i + d/2)`: GPT-NeoX and Hugging Face's `rotate_half`.
    Neox,
}

/// An RMS norm on the way into matmuls: `x / sqrt(mean(x²) + eps) * weight` per row.
pub struct RmsNorm<'a> {
    pub x: &'a Tensor,
    pub weight: &'a Tensor,
    pub eps: f32,
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

/// Where keys and values live when many sequences share one pool of fixed-size blocks (a
/// server's paged KV cache): position `j` of sequence `s` is row
/// `tables[s, j / block] · block + j % block` of the pool.
pub struct Pages<'a> {
    /// I32 `[n]`: the sequence (row of `tables`) of each query row.
    pub seq: &'a Tensor,
    /// I32 `[sequences, max_blocks]`: each sequence's blocks in the order of its
    /// positions; entries past the blocks a query can see are not read.
    pub tables: &'a Tensor,
    /// Positions a block holds.
    pub block: usize,
    /// The query rows as runs of consecutive rows of one sequence, in row order (their
    /// lengths add up to the rows): a prompt chunk is one run, a decode a run of one. A
    /// backend may let a run's queries share the keys they read, taking the sequence of a
    /// run's first row for all of its rows: runs must agree with `seq`.
    pub runs: &'a [usize],
}

/// [`Backend::rope_write_kv`] as the ops it stands for: for backends whose fused kernel
/// does not take every case.
#[allow(clippy::too_many_arguments)]
pub fn rope_write_kv_by_ops<B: Backend + ?Sized>(
    b: &B,
    q: &mut Tensor,
    k: &mut Tensor,
    v: &Tensor,
    pos: &Tensor,
    rows: Option<&Tensor>,
    rope: Option<(&Tensor, RopeLayout)>,
    k_cache: &mut Tensor,
    v_cache: &mut Tensor,
) -> Result<()> {
    if let Some((inv_freq, layout)) = rope {
        b.rope(q, pos, inv_freq, layout)?;
        b.rope(k, pos, inv_freq, layout)?;
    }
    b.write_rows(k, k_cache, rows.unwrap_or(pos))?;
    b.write_rows(v, v_cache, rows.unwrap_or(pos))
}

pub trait Backend: Send + Sync {
    fn device(&self) -> Device;

    /// A human-readable description (device name, threads, instruction set).
    fn describe(&self) -> String;

    /// A tensor of zeros.
    fn zeros(&self, dtype: DType, shape: Shape) -> Result<Tensor>;

    /// A tensor whose contents are unspecified, for an op that writes every element (a
    /// gradient begun under [`crate::GradInto::Write`]): no fill where the backend can
    /// skip it. Zeros by default.
    fn empty(&self, dtype: DType, shape: Shape) -> Result<Tensor> {
        self.zeros(dtype, shape)
    }

    /// A tensor holding `data`, which must be exactly `shape` elements of `dtype` in
    /// ggml's encoding. Backends that can use host memory in place do not copy.
    fn upload(&self, dtype: DType, shape: Shape, data: HostBytes) -> Result<Tensor>;

    /// [`Backend::upload`] of weights that the model reads together (Q, K and V from one
    /// input), in order. A backend may lay them end to end in one allocation, so that one
    /// product reads them as one matrix; each tensor is still its own.
    fn upload_together(&self, parts: Vec<(DType, Shape, HostBytes)>) -> Result<Vec<Tensor>> {
        parts
            .into_iter()
            .map(|(dtype, shape, data)| self.upload(dtype, shape, data))
            .collect()
    }

    /// The tensor's bytes, in its dtype's encoding.
    fn download(&self, t: &Tensor) -> Result<Vec<u8>>;

    /// Overwrite an existing tensor with `data` (exactly its bytes, in its dtype's
    /// encoding): token ids and positions for the next step.
    fn write(&self, t: &mut Tensor, data: &[u8]) -> Result<()>;

    /// Set every element of an F32 tensor to `value`.
    fn fill(&self, t: &mut Tensor, value: f32) -> Result<()>;

    /// `out[n, m] = x[n, k] · w[m, k]ᵀ`, with `x` and `out` F32 and `w` any dtype.
    /// One row of `x` is a matrix-vector product; more rows are a matrix product.
    fn matmul(&self, x: &Tensor, w: &Tensor, out: &mut Tensor) -> Result<()>;

    /// `out[i] = table[ids[i]]`, dequantized to F32; `ids` is I32 `[n]`. An id outside
    /// the table gives a row of zeros on devices that cannot report errors mid-step.
    fn embedding(&self, table: &Tensor, ids: &Tensor, out: &mut Tensor) -> Result<()>;

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
    /// `pos[t]` (`pos`: I32 `[tokens]`). `inv_freq` (F32, `rot_dim / 2` values) gives each
    /// pair's frequency; dimensions past `rot_dim` are left as they are.
    fn rope(
        &self,
        x: &mut Tensor,
        pos: &Tensor,
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

    /// Copy row `i` of `src` (its outermost dimension) to row `pos[i]` of `dst`, rows of
    /// equal element count, `pos` I32 `[rows of src]`: writes keys and values into a KV
    /// cache. Positions outside `dst` are an error, or skipped on devices that cannot
    /// report errors mid-step. `dst` is one of [`DType::KV_CACHE`]; `src` is F32, each row
    /// converted to `dst`'s type as it is written, or of `dst`'s type, its rows copied as
    /// stored (a cache moved to a larger one). From F32:
    /// - F32: as it is.
    /// - F16, BF16: each value rounded to the nearest, ties to even (past F16's range, ±∞).
    /// - Q8_0 (rows of whole blocks: `head_dim` a multiple of 32): ggml's
    ///   `quantize_row_q8_0`, per block of 32 values the scale `d = max|x| / 127` stored as
    ///   f16 and each value `round(x · (1/d))` (ties away from zero) with `d` and `1/d` in
    ///   f32. A GPU's reciprocal may put a value one step (`d`) from where the CPU puts it.
    fn write_rows(&self, src: &Tensor, dst: &mut Tensor, pos: &Tensor) -> Result<()>;

    /// `dst[i, :] = src[i, col0 .. col0 + dst_cols]` for 2-D F32 tensors: splits the
    /// output of a fused projection (QKV, gate+up).
    fn slice_cols(&self, src: &Tensor, col0: usize, dst: &mut Tensor) -> Result<()>;

    /// Causal attention of `q` `[n, heads, head_dim]` over the cached keys and values
    /// `[capacity, kv_heads, head_dim]`, into `out` `[n, heads, head_dim]`. Query `i` is at
    /// position `pos[i]` (`pos`: I32 `[n]`) and sees the cache rows `0..=pos[i]`. Query
    /// head `h` reads KV head `h / (heads / kv_heads)` (grouped-query attention). The
    /// caches are one of [`DType::KV_CACHE`], both the same: their values are decoded to
    /// f32 exactly as [`crate::quant::dequantize`] decodes them, and everything after
    /// is f32 arithmetic, as over an F32 cache holding those values.
    fn attention(
        &self,
        q: &Tensor,
        k_cache: &Tensor,
        v_cache: &Tensor,
        pos: &Tensor,
        params: &AttentionParams,
        out: &mut Tensor,
    ) -> Result<()>;

    /// [`Backend::attention`] for queries of many sequences whose keys and values lie in
    /// blocks of a shared pool (`[blocks · block, kv_heads, head_dim]` each): query `i`, of
    /// sequence `pages.seq[i]` at position `pos[i]`, sees that sequence's positions
    /// `0..=pos[i]` (less the window), found through its block table. Each query's result
    /// is what [`Backend::attention`] gives over the same keys and values laid out
    /// contiguously. Block ids outside the pool are an error, or skipped on devices that
    /// cannot report errors mid-step.
    #[allow(clippy::too_many_arguments)]
    fn paged_attention(
        &self,
        q: &Tensor,
        k_pool: &Tensor,
        v_pool: &Tensor,
        pos: &Tensor,
        pages: &Pages,
        params: &AttentionParams,
        out: &mut Tensor,
    ) -> Result<()> {
        let _ = (q, k_pool, v_pool, pos, pages, params, out);
        Err(Error::unsupported(format!(
            "attention over a paged KV cache on {}",
            self.device()
        )))
    }

    // ---- Fused ops. Each default is the plain sequence it stands for; a backend
    // overrides one where doing it in one pass saves a trip through memory or a
    // launch. `tmp*` arguments are the caller's buffers for the plain sequence.

    /// `acc += x · wᵀ` (a projection feeding the residual stream).
    fn matmul_add(&self, x: &Tensor, w: &Tensor, acc: &mut Tensor, tmp: &mut Tensor) -> Result<()> {
        self.matmul(x, w, tmp)?;
        self.add_assign(acc, tmp)
    }

    /// `outs[i] = x · ws[i]ᵀ` for several weights reading the same input (Q, K and V).
    fn matmul_many(&self, x: &Tensor, ws: &[&Tensor], outs: &mut [&mut Tensor]) -> Result<()> {
        if ws.len() != outs.len() {
            return Err(crate::Error::shape(
                "matmul_many: as many outputs as weights",
            ));
        }
        for (w, out) in ws.iter().zip(outs.iter_mut()) {
            self.matmul(x, w, out)?;
        }
        Ok(())
    }

    /// `normed = rms_norm(norm)`, then `outs[i] = normed · ws[i]ᵀ`: the norm feeding the
    /// attention's projections, which a device may fuse (the norm writing its output in
    /// the form the matmuls read).
    fn rms_norm_matmul_many(
        &self,
        norm: &RmsNorm,
        normed: &mut Tensor,
        ws: &[&Tensor],
        outs: &mut [&mut Tensor],
    ) -> Result<()> {
        self.rms_norm(norm.x, norm.weight, norm.eps, normed)?;
        self.matmul_many(normed, ws, outs)
    }

    /// `normed = rms_norm(norm)` feeding [`Backend::gated_ffn`].
    #[allow(clippy::too_many_arguments)]
    fn rms_norm_gated_ffn(
        &self,
        norm: &RmsNorm,
        normed: &mut Tensor,
        gate: &Tensor,
        up: &Tensor,
        gelu: bool,
        out: &mut Tensor,
        tmp_gate: &mut Tensor,
        tmp_up: &mut Tensor,
    ) -> Result<()> {
        self.rms_norm(norm.x, norm.weight, norm.eps, normed)?;
        self.gated_ffn(normed, gate, up, gelu, out, tmp_gate, tmp_up)
    }

    /// `out = act(x · gateᵀ) * (x · upᵀ)`, with `act` SiLU or, when `gelu`, GELU (tanh).
    #[allow(clippy::too_many_arguments)]
    fn gated_ffn(
        &self,
        x: &Tensor,
        gate: &Tensor,
        up: &Tensor,
        gelu: bool,
        out: &mut Tensor,
        tmp_gate: &mut Tensor,
        tmp_up: &mut Tensor,
    ) -> Result<()> {
        self.matmul(x, gate, tmp_gate)?;
        self.matmul(x, up, tmp_up)?;
        if gelu {
            self.gelu_mul(tmp_gate, tmp_up, out)
        } else {
            self.silu_mul(tmp_gate, tmp_up, out)
        }
    }

    /// Rotate `q` in place and `k` (when `rope` is given) by the positions `pos`, then
    /// write `k` and `v` into the caches at `rows` (a paged pool's slots; `None`: at the
    /// positions), converted to the caches' type as [`Backend::write_rows`] converts rows.
    #[allow(clippy::too_many_arguments)]
    fn rope_write_kv(
        &self,
        q: &mut Tensor,
        k: &mut Tensor,
        v: &Tensor,
        pos: &Tensor,
        rows: Option<&Tensor>,
        rope: Option<(&Tensor, RopeLayout)>,
        k_cache: &mut Tensor,
        v_cache: &mut Tensor,
    ) -> Result<()> {
        rope_write_kv_by_ops(self, q, k, v, pos, rows, rope, k_cache, v_cache)
    }

    /// The backward kernels, where this backend can train (see [`GradOps`]); `None`
    /// makes training on it an error that names the device.
    fn grad(&self) -> Option<&dyn GradOps> {
        None
    }

    /// Bytes of device memory free for weights and buffers; `None` where the
    /// question does not apply (host memory).
    fn free_memory(&self) -> Result<Option<usize>> {
        Ok(None)
    }

    /// GPU time per kernel so far, where the backend measures it (wgpu with
    /// `KILN_WGPU_PROFILE=1`); largest total first.
    fn kernel_profile(&self) -> Option<Vec<KernelTime>> {
        None
    }

    /// `out[r]` = the index of the largest value of row `r` of `x` (the first, on ties);
    /// `x` F32 `[rows, cols]`, `out` I32 `[rows]`. Greedy decoding reads back only this.
    fn argmax(&self, x: &Tensor, out: &mut Tensor) -> Result<()>;

    /// `out[0]` = a token drawn from the last row of `logits` (F32 `[rows, vocab]`) as
    /// [`sampling::pick`] draws it, with the repetition penalty on `penalized` (distinct
    /// ids; the penalty may change `logits`). `out` is I32 `[1]`. This default reads the row
    /// back and picks on the host; a device that can pick in place reads back only `out`.
    fn sample(
        &self,
        logits: &mut Tensor,
        penalized: &[u32],
        params: &SampleParams,
        out: &mut Tensor,
    ) -> Result<()> {
        sample_on_host(self, logits, penalized, params, out)
    }

    /// A token drawn from row `draws[i].row` of `logits` (F32 `[rows, vocab]`) for each
    /// draw, as [`Backend::sample`] draws from one row (the penalty may change the rows;
    /// they must be distinct). This default draws row by row through `sample`, a read-back
    /// each; a device that can draws them all in one launch and reads back only the ids.
    fn sample_rows(&self, logits: &mut Tensor, draws: &[RowDraw<'_>]) -> Result<Vec<u32>> {
        sample_rows_one_by_one(self, logits, draws)
    }

    /// The fused optimizer step's kernels ([`crate::optim`]), where this backend has them.
    fn optim(&self) -> Option<&dyn crate::OptimKernels> {
        None
    }

    /// Record the ops `step` issues, so that they can be replayed as one unit (a CUDA
    /// graph). `Some`: the ops were recorded, not run; replay to run them. `None`: the
    /// backend does not record, and the ops ran as usual. A recording stays valid while
    /// every tensor it touched is alive and unmoved; only their contents may change
    /// between replays. Ops inside `step` must not allocate.
    fn capture(&self, step: &mut dyn FnMut() -> Result<()>) -> Result<Option<Box<dyn Replay>>> {
        step()?;
        Ok(None)
    }
}

/// One kernel's share of a profile (see [`Backend::kernel_profile`]).
#[derive(Clone, Debug)]
pub struct KernelTime {
    pub name: String,
    pub calls: u64,
    pub total_ms: f64,
}

/// A recorded sequence of ops (see [`Backend::capture`]).
pub trait Replay: Send {
    /// Run the recorded ops again, on the tensors' current contents.
    fn replay(&self) -> Result<()>;
}

/// Copy a tensor held by backend `from` to backend `to` (through host memory: backends
/// know nothing of each other). The result has the same dtype, shape and bytes.
pub fn to_device(t: &Tensor, from: &dyn Backend, to: &dyn Backend) -> Result<Tensor> {
    let bytes = from.download(t)?;
    to.upload(t.dtype(), t.shape().clone(), HostBytes::from_vec(bytes))
}

/// One row of a batch's logits to draw a token from (see [`Backend::sample_rows`]).
#[derive(Clone, Copy, Debug)]
pub struct RowDraw<'a> {
    pub row: usize,
    /// Distinct ids the repetition penalty applies to.
    pub penalized: &'a [u32],
    pub params: &'a SampleParams,
}

/// Refuse draws from rows that `logits` (F32 `[rows, vocab]`) lacks, or from one row twice.
pub fn check_row_draws(logits: &Tensor, draws: &[RowDraw<'_>]) -> Result<()> {
    let (rows, vocab) = match logits.dims() {
        [.., vocab] if *vocab > 0 => (logits.shape().numel() / vocab, *vocab),
        _ => (0, 0),
    };
    if logits.dtype() != DType::F32 || vocab == 0 {
        return Err(Error::shape(format!(
            "sampling from {} logits {} (F32 rows of the vocabulary)",
            logits.dtype(),
            logits.shape()
        )));
    }
    let mut seen = vec![false; rows];
    for d in draws {
        match seen.get_mut(d.row) {
            Some(s) if !*s => *s = true,
            Some(_) => {
                return Err(Error::shape(format!(
                    "two draws from row {} of the logits (each row once: the penalty changes it)",
                    d.row
                )))
            }
            None => {
                return Err(Error::shape(format!(
                    "a draw from row {} of logits {}",
                    d.row,
                    logits.shape()
                )))
            }
        }
    }
    Ok(())
}

/// [`Backend::sample_rows`] one row at a time: each copied out and drawn by
/// [`Backend::sample`], its id read back.
pub fn sample_rows_one_by_one<B: Backend + ?Sized>(
    b: &B,
    logits: &Tensor,
    draws: &[RowDraw<'_>],
) -> Result<Vec<u32>> {
    check_row_draws(logits, draws)?;
    if draws.is_empty() {
        return Ok(Vec::new());
    }
    let vocab = logits.shape().row_len();
    let mut row = b.zeros(DType::F32, Shape::new(vec![1, vocab])?)?;
    let mut which = b.zeros(DType::I32, Shape::new(vec![1])?)?;
    let mut next = b.zeros(DType::I32, Shape::new(vec![1])?)?;
    let mut ids = Vec::with_capacity(draws.len());
    for d in draws {
        b.write(&mut which, &(d.row as i32).to_le_bytes())?;
        b.embedding(logits, &which, &mut row)?;
        b.sample(&mut row, d.penalized, d.params, &mut next)?;
        ids.extend(token_ids(&b.download(&next)?)?);
    }
    Ok(ids)
}

/// Token ids a device wrote as I32 (an error names one that is not an id).
pub fn token_ids(bytes: &[u8]) -> Result<Vec<u32>> {
    bytes
        .chunks_exact(4)
        .map(|c| {
            let id = i32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            u32::try_from(id).map_err(|_| Error::Device(format!("the device picked token {id}")))
        })
        .collect()
}

/// [`Backend::sample`] by reading the logits back and picking on the host.
pub fn sample_on_host<B: Backend + ?Sized>(
    b: &B,
    logits: &Tensor,
    penalized: &[u32],
    params: &SampleParams,
    out: &mut Tensor,
) -> Result<()> {
    if out.dtype() != DType::I32 || out.shape().numel() != 1 {
        return Err(Error::shape(format!(
            "sampling into {} {}: the id goes into I32 [1]",
            out.dtype(),
            out.shape()
        )));
    }
    let bytes = b.download(logits)?;
    let vocab = logits.shape().row_len();
    if vocab == 0 || bytes.len() < 4 * vocab {
        return Err(Error::shape(format!(
            "sampling from logits {}",
            logits.shape()
        )));
    }
    let mut row: Vec<f32> = bytes[bytes.len() - 4 * vocab..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let id = sampling::pick(&mut row, penalized, params) as i32;
    b.write(out, &id.to_le_bytes())
}
