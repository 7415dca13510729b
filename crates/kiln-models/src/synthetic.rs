//! Random-weight models of real shapes, built without a file, for `kiln bench
//! --synthetic`. Random weights time the same as trained ones: only the shapes and dtypes
//! matter. Weights are drawn N(0, 0.02) like the anchors' models; to keep start-up fast,
//! each matrix repeats a pool of 64 distinct quantized rows (far larger than any cache,
//! so the repetition does not change what is measured).

use crate::config::{Arch, Ffn, ModelConfig, Norm, Rope};
use crate::source::{GgufNames, RawTensor, Role, Source};
use crate::{load, Model};
use kiln_core::{quant, Backend, DType, Error, HostBytes, Result, RopeLayout, Shape};
use std::collections::HashMap;
use std::sync::Arc;

/// The shapes `kiln bench --synthetic` knows (those of `../shared/anchors.md`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SyntheticShape {
    TinyLlama,
    Llama3_8b,
    /// Too large for one GPU in BF16 (141 GB): for `kiln bench --tp`.
    Llama3_70b,
}

impl SyntheticShape {
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "tinyllama-1.1b" => Some(SyntheticShape::TinyLlama),
            "llama3-8b" => Some(SyntheticShape::Llama3_8b),
            "llama3-70b" => Some(SyntheticShape::Llama3_70b),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            SyntheticShape::TinyLlama => "tinyllama-1.1b",
            SyntheticShape::Llama3_8b => "llama3-8b",
            SyntheticShape::Llama3_70b => "llama3-70b",
        }
    }

    pub fn config(self) -> ModelConfig {
        // (vocab, dim, ffn, layers, heads, kv heads, rope theta, context)
        let (vocab, dim, ffn, layers, heads, kv, theta, ctx) = match self {
            SyntheticShape::TinyLlama => (32000, 2048, 5632, 22, 32, 4, 10000.0, 2048),
            SyntheticShape::Llama3_8b => (128256, 4096, 14336, 32, 32, 8, 500000.0, 8192),
            SyntheticShape::Llama3_70b => (128256, 8192, 28672, 80, 64, 8, 500000.0, 8192),
        };
        let head_dim = dim / heads;
        ModelConfig {
            arch: Arch::Llama,
            vocab_size: vocab,
            dim,
            n_layers: layers,
            n_heads: heads,
            n_kv_heads: kv,
            head_dim,
            ffn_dim: ffn,
            max_positions: ctx,
            norm: Norm::Rms { eps: 1e-5 },
            ffn: Ffn::SwiGlu,
            rope: Some(Rope {
                theta,
                dims: head_dim,
                layout: RopeLayout::Interleaved,
                llama3: None,
                freq_factors: None,
            }),
            attn_scale: 1.0 / (head_dim as f32).sqrt(),
            attn_softcap: None,
            final_softcap: None,
            sliding_window: None,
            sliding_layers: vec![false; layers],
            embed_scale: None,
            post_norms: false,
        }
    }
}

impl Model {
    /// A random-weight Llama-style model of any `config`: a known shape's (see
    /// [`SyntheticShape::config`]), or one changed from it (the GPU tests keep a few of
    /// its layers, or give it another head count).
    pub fn synthetic_from_config(
        config: ModelConfig,
        ty: SyntheticType,
        backend: Arc<dyn Backend>,
    ) -> Result<Model> {
        Self::synthetic_with(SyntheticSource::new(config, ty), backend)
    }

    /// Rank `collective.rank()` of [`Model::synthetic_from_config`]'s model split over
    /// `collective.world()` ranks (see [`crate::tp`]).
    pub fn synthetic_rank(
        config: ModelConfig,
        ty: SyntheticType,
        backend: Arc<dyn Backend>,
        collective: Arc<dyn kiln_core::Collective>,
    ) -> Result<Model> {
        // Random weights: the rank's slices are random matrices of the slices' shapes,
        // drawn at those shapes (the rank's configuration) rather than cut from whole
        // ones, which for a 70B model would have every rank build all 141 GB.
        let plan = crate::tp::Plan::new(&config, collective.world())?;
        let rank = collective.rank();
        let mut src = SyntheticSource::new(plan.config(&config, rank)?, ty);
        src.output_rows = plan.ranks[rank].vocab.as_ref().map(|v| v.len());
        src.embed_rows = plan
            .split_embed
            .then(|| plan.embed_rows(rank, config.vocab_size));
        let mut model = Self::synthetic_with(src, backend)?;
        model.collective = Some(collective);
        Ok(model)
    }

    /// [`Model::synthetic_from_config`]'s model with every matrix decoded to F32: the same
    /// weights, run without rounding activations to the weights' type (the reference the
    /// GPU tests measure each weight type's error against).
    pub fn synthetic_decoded(
        config: ModelConfig,
        ty: SyntheticType,
        backend: Arc<dyn Backend>,
    ) -> Result<Model> {
        let mut src = SyntheticSource::new(config, ty);
        src.decoded = true;
        Self::synthetic_with(src, backend)
    }

    fn synthetic_with(src: SyntheticSource, backend: Arc<dyn Backend>) -> Result<Model> {
        let config = src.config.clone();
        let weights = load::WeightLoader {
            src: &src,
            backend: backend.as_ref(),
            cfg: &config,
            norm_plus_one: false,
            transpose_linear: false,
            progress: None,
        }
        .load()?;
        Ok(Model::new(config, weights, backend))
    }
}

/// The weight types of a synthetic model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SyntheticType {
    /// Every matrix in one dtype.
    Uniform(DType),
    /// llama-quantize's Q4_K_M mix: Q4_K, with Q6_K for the output and for `attn_v` and
    /// `ffn_down` in the layers `use_more_bits` picks.
    Q4KM,
}

impl SyntheticType {
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "q4_k_m" | "Q4_K_M" => Some(SyntheticType::Q4KM),
            other => DType::from_name(other).map(SyntheticType::Uniform),
        }
    }

    pub fn name(self) -> String {
        match self {
            SyntheticType::Q4KM => "q4_K_M".into(),
            SyntheticType::Uniform(d) => d.name().into(),
        }
    }

    /// Bytes of the weights a synthetic model of `config` holds in these types (every
    /// matrix, the output head counted apart from the embedding), to check memory before
    /// building it.
    pub fn weight_bytes(self, config: &ModelConfig) -> u64 {
        let src = SyntheticSource::new(config.clone(), self);
        let mut names: Vec<String> = ["token_embd", "output", "output_norm"]
            .iter()
            .map(|n| format!("{n}.weight"))
            .collect();
        for l in 0..config.n_layers {
            for r in [
                "attn_norm",
                "ffn_norm",
                "attn_q",
                "attn_k",
                "attn_v",
                "attn_output",
                "ffn_gate",
                "ffn_up",
                "ffn_down",
            ] {
                names.push(format!("blk.{l}.{r}.weight"));
            }
        }
        names
            .iter()
            .filter_map(|n| {
                let shape = src.shape_of(n)?;
                let (&cols, rows) = shape.split_last()?;
                let dtype = match rows {
                    [] => DType::F32,
                    _ => self.dtype_for(n, config.n_layers),
                };
                let row = dtype.row_bytes(cols).ok()? as u64;
                Some(row.saturating_mul(rows.iter().product::<usize>() as u64))
            })
            .fold(0u64, u64::saturating_add)
    }

    fn dtype_for(self, name: &str, n_layers: usize) -> DType {
        let d = match self {
            SyntheticType::Uniform(d) => return d,
            SyntheticType::Q4KM => DType::Q4_K,
        };
        // llama.cpp's `use_more_bits`: the first and last eighth, and every third between.
        let more_bits =
            |i: usize| i < n_layers / 8 || i >= 7 * n_layers / 8 || (i - n_layers / 8) % 3 == 2;
        let layer = name
            .strip_prefix("blk.")
            .and_then(|r| r.split('.').next())
            .and_then(|i| i.parse::<usize>().ok());
        match (name, layer) {
            ("output.weight", _) => DType::Q6_K,
            (n, Some(i))
                if (n.ends_with("attn_v.weight") || n.ends_with("ffn_down.weight"))
                    && more_bits(i) =>
            {
                DType::Q6_K
            }
            _ => d,
        }
    }
}

/// Quantized rows to tile matrices from, by (dtype, row length).
type RowPools = HashMap<(DType, usize), std::sync::Arc<Vec<u8>>>;

pub(crate) struct SyntheticSource {
    config: ModelConfig,
    ty: SyntheticType,
    /// Matrices decoded to F32 (see [`Model::synthetic_decoded`]).
    decoded: bool,
    /// Rows of the output head where it is a rank's slice of the vocabulary.
    output_rows: Option<usize>,
    /// Rows of the embedding where it is a rank's slice, its last row zeros.
    embed_rows: Option<usize>,
    /// Quantized row pools, by (dtype, row length).
    pools: std::sync::Mutex<RowPools>,
}

impl SyntheticSource {
    pub fn new(config: ModelConfig, ty: SyntheticType) -> Self {
        SyntheticSource {
            config,
            ty,
            decoded: false,
            output_rows: None,
            embed_rows: None,
            pools: Default::default(),
        }
    }

    fn shape_of(&self, name: &str) -> Option<Vec<usize>> {
        let c = &self.config;
        let base = name.strip_suffix(".weight")?;
        let role = base.rsplit('.').next()?;
        Some(match role {
            "token_embd" => vec![self.embed_rows(c.vocab_size), c.dim],
            "output" => vec![self.output_rows(c.vocab_size), c.dim],
            "attn_norm" | "ffn_norm" | "output_norm" => vec![c.dim],
            "attn_q" => vec![c.q_dim(), c.dim],
            "attn_k" | "attn_v" => vec![c.kv_dim(), c.dim],
            "attn_output" => vec![c.dim, c.q_dim()],
            "ffn_gate" | "ffn_up" => vec![c.ffn_dim, c.dim],
            "ffn_down" => vec![c.dim, c.ffn_dim],
            _ => return None,
        })
    }

    fn pool(&self, dtype: DType, cols: usize) -> Result<std::sync::Arc<Vec<u8>>> {
        let mut pools = self
            .pools
            .lock()
            .map_err(|_| Error::Device("synthetic pool poisoned".into()))?;
        if let Some(p) = pools.get(&(dtype, cols)) {
            return Ok(p.clone());
        }
        // A fixed-seed normal-ish draw (sum of uniforms), std 0.02.
        let mut state = 0x2545_f491_4f6c_dd1du64 ^ (cols as u64) ^ ((dtype.ggml_id() as u64) << 40);
        let mut uniform = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 11) as f32 / (1u64 << 53) as f32
        };
        let values: Vec<f32> = (0..POOL_ROWS * cols)
            .map(|_| ((0..4).map(|_| uniform()).sum::<f32>() - 2.0) * 0.02 * 1.732)
            .collect();
        let p = std::sync::Arc::new(quant::quantize(dtype, &values)?);
        pools.insert((dtype, cols), p.clone());
        Ok(p)
    }
}

const POOL_ROWS: usize = 64;

impl Source for SyntheticSource {
    fn name(&self) -> String {
        format!("synthetic model ({})", self.ty.name())
    }

    fn get(&self, name: &str) -> Result<Option<RawTensor>> {
        let Some(dims) = self.shape_of(name) else {
            return Ok(None);
        };
        let (rows, cols) = match dims.as_slice() {
            [n] => (1, *n),
            [r, c] => (*r, *c),
            _ => return Ok(None),
        };
        // Norms are ones, in f32, as a trained model's are near.
        if dims.len() == 1 {
            let bytes = quant::quantize(DType::F32, &vec![1.0; cols])?;
            return Ok(Some(RawTensor {
                dtype: DType::F32,
                shape: Shape::new(dims)?,
                bytes: HostBytes::from_vec(bytes),
            }));
        }
        let mut dtype = self.ty.dtype_for(name, self.config.n_layers);
        let mut pool = self.pool(dtype, cols)?;
        if self.decoded {
            let values = quant::dequantize_to_vec(dtype, &pool, POOL_ROWS * cols)?;
            pool = std::sync::Arc::new(quant::quantize(DType::F32, &values)?);
            dtype = DType::F32;
        }
        let row_bytes = dtype.row_bytes(cols)?;
        let mut bytes = Vec::with_capacity(rows * row_bytes);
        while bytes.len() < rows * row_bytes {
            let take = (rows * row_bytes - bytes.len()).min(pool.len());
            bytes.extend_from_slice(&pool[..take]);
        }
        if name == "token_embd.weight" && self.embed_rows.is_some() {
            // A rank's slice ends in the row the others' tokens read: zeros.
            let last = bytes.len() - row_bytes;
            bytes[last..].fill(0);
        }
        Ok(Some(RawTensor {
            dtype,
            shape: Shape::new(dims)?,
            bytes: HostBytes::from_vec(bytes),
        }))
    }

    fn role_name(&self, arch: Arch, role: Role, layer: usize) -> Option<String> {
        GgufNames.role_name(arch, role, layer)
    }

    fn output_rows(&self, vocab: usize) -> usize {
        self.output_rows.unwrap_or(vocab)
    }

    fn embed_rows(&self, vocab: usize) -> usize {
        self.embed_rows.unwrap_or(vocab)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The estimate a memory check uses is the built model's bytes (a small model of
    /// each kind: one dtype, and the Q4_K_M mix with its Q6_K layers).
    #[test]
    fn weight_bytes_are_the_built_models() {
        let mut config = SyntheticShape::TinyLlama.config();
        (
            config.vocab_size,
            config.dim,
            config.ffn_dim,
            config.n_layers,
        ) = (300, 256, 512, 9);
        (config.n_heads, config.n_kv_heads, config.head_dim) = (4, 2, 64);
        config.sliding_layers.truncate(9);
        if let Some(rope) = config.rope.as_mut() {
            rope.dims = 64;
        }
        for ty in [SyntheticType::Uniform(DType::F16), SyntheticType::Q4KM] {
            let cpu = Arc::new(kiln_cpu::CpuBackend::new(Some(1)).unwrap());
            let model = Model::synthetic_from_config(config.clone(), ty, cpu).unwrap();
            let built: usize = model.parameters().iter().map(|(_, t)| t.size_bytes()).sum();
            assert_eq!(ty.weight_bytes(&config), built as u64, "{}", ty.name());
        }
    }
}
