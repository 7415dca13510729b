//! Writing a model as GGUF under llama.cpp's conventions: its configuration as metadata
//! (what `config_gguf` reads back, checked by reading it back), its parameters under
//! their GGUF names. Training writes its checkpoints and exports this way.

use crate::config::{Arch, ModelConfig, Norm, Rope};
use crate::config_gguf::config_from_gguf;
use crate::convert::permute_rows;
use crate::model::Model;
use kiln_core::{quant, DType, Error, Result, RopeLayout, Tensor};
use kiln_io::gguf::{GgufFile, GgufWriter, Value};

/// What GGUF says of a configuration: its metadata, the values of the `rope_freqs.weight`
/// tensor when the rope frequencies need one (Llama 3 scaling, or divisors the model was
/// read with), and whether Q and K rows must be permuted on the way (a Hugging Face llama
/// rotates halves, llama.cpp's adjacent pairs).
struct GgufConfig {
    meta: Vec<(String, Value)>,
    freqs: Option<Vec<f32>>,
    permute_qk: bool,
}

/// `config` as GGUF says it; an error names what GGUF cannot say.
fn metadata(c: &ModelConfig) -> Result<GgufConfig> {
    let arch = c.arch.name();
    let key = |k: &str| format!("{arch}.{k}");
    // Sizes are bounded by the configuration's validation far below u32::MAX.
    let int = |v: usize| Value::U32(v as u32);
    let mut meta = vec![
        (
            "general.architecture".to_string(),
            Value::String(arch.into()),
        ),
        (key("context_length"), int(c.max_positions)),
        (key("embedding_length"), int(c.dim)),
        (key("block_count"), int(c.n_layers)),
        (key("feed_forward_length"), int(c.ffn_dim)),
        (key("attention.head_count"), int(c.n_heads)),
        (key("attention.head_count_kv"), int(c.n_kv_heads)),
        (key("attention.key_length"), int(c.head_dim)),
        (key("attention.value_length"), int(c.head_dim)),
        (key("vocab_size"), int(c.vocab_size)),
    ];
    match c.norm {
        Norm::Rms { eps } => meta.push((key("attention.layer_norm_rms_epsilon"), Value::F32(eps))),
        Norm::Layer { eps } => meta.push((key("attention.layer_norm_epsilon"), Value::F32(eps))),
    }
    let (mut freqs, mut permute_qk) = (None, false);
    if let Some(rope) = &c.rope {
        if rope.layout != gguf_layout(c.arch) {
            // Moving each head's halves to adjacent pairs is right only when rope turns
            // the whole head (as in `kiln convert`); the other way no model needs.
            if rope.layout != RopeLayout::Neox || rope.dims != c.head_dim {
                return Err(Error::unsupported(format!(
                    "writing this {arch} model to GGUF: llama.cpp's {arch} rotates {:?} pairs, the model {:?} pairs over {} of {} dimensions",
                    gguf_layout(c.arch),
                    rope.layout,
                    rope.dims,
                    c.head_dim
                )));
            }
            permute_qk = true;
        }
        meta.push((key("rope.freq_base"), Value::F32(rope.theta)));
        meta.push((key("rope.dimension_count"), int(rope.dims)));
        if rope.llama3.is_some() || rope.freq_factors.is_some() {
            // As llama.cpp's converter: one divisor per rotated pair, which the reader
            // applies to the plain frequencies.
            let plain = Rope {
                llama3: None,
                freq_factors: None,
                ..rope.clone()
            };
            freqs = Some(
                plain
                    .inv_freq()
                    .iter()
                    .zip(rope.inv_freq())
                    .map(|(base, scaled)| base / scaled)
                    .collect(),
            );
        }
    }
    if let Some(w) = c.sliding_window {
        meta.push((key("attention.sliding_window"), int(w)));
    }
    if let Some(cap) = c.attn_softcap {
        meta.push((key("attn_logit_softcapping"), Value::F32(cap)));
    }
    if let Some(cap) = c.final_softcap {
        meta.push((key("final_logit_softcapping"), Value::F32(cap)));
    }
    Ok(GgufConfig {
        meta,
        freqs,
        permute_qk,
    })
}

/// How llama.cpp pairs the dimensions rope rotates: adjacent pairs for the models whose Q
/// and K rows its converter permutes, halves for the others.
fn gguf_layout(arch: Arch) -> RopeLayout {
    match arch {
        Arch::Llama | Arch::Mistral => RopeLayout::Interleaved,
        _ => RopeLayout::Neox,
    }
}

/// A GGUF writer holding `config` as metadata, named `name`, with the `rope_freqs` tensor
/// where one is needed, and whether the Q and K rows must be permuted (see [`GgufConfig`]);
/// the caller adds the tokenizer's metadata and the tensors. Refused when the file would
/// be read back as another configuration (a setting GGUF cannot hold, such as a Hugging
/// Face attention scale llama.cpp derives otherwise).
fn writer(config: &ModelConfig, name: &str) -> Result<(GgufWriter, bool)> {
    let g = metadata(config)?;
    let mut w = GgufWriter::new();
    for (k, v) in &g.meta {
        w.set(k, v.clone())?;
    }
    w.set("general.name", Value::String(name.into()))?;
    if let Some(f) = &g.freqs {
        w.add_tensor(
            "rope_freqs.weight",
            DType::F32,
            &[f.len()],
            quant::quantize(DType::F32, f)?,
        )?;
    }
    let mut expected = config.clone();
    if let Some(rope) = &mut expected.rope {
        rope.layout = gguf_layout(config.arch);
    }
    check_reads_back(&expected, &g.meta, g.freqs.as_deref())?;
    Ok((w, g.permute_qk))
}

/// A GGUF writer holding `config` as metadata and named `name` (with the `rope_freqs`
/// tensor where the frequencies need one), for a caller who adds the tensors in GGUF's
/// conventions (Q and K rows as llama.cpp's rope pairs them) and the tokenizer's metadata.
/// Refused when the file would be read back as another configuration.
pub fn gguf_writer(config: &ModelConfig, name: &str) -> Result<GgufWriter> {
    let (w, permute_qk) = writer(config, name)?;
    if permute_qk {
        return Err(Error::unsupported(format!(
            "a {} model whose rope rotates halves: GGUF's pairs are adjacent (permute Q and K, as Model::to_gguf does)",
            config.arch.name()
        )));
    }
    Ok(w)
}

/// Read the metadata back through `config_from_gguf`, from a file of stand-in tensors
/// (the embeddings' row count is the vocabulary), and compare.
fn check_reads_back(
    config: &ModelConfig,
    meta: &[(String, Value)],
    freqs: Option<&[f32]>,
) -> Result<()> {
    let mut probe = GgufWriter::new();
    for (k, v) in meta {
        probe.set(k, v.clone())?;
    }
    let f32s = |n: usize| quant::quantize(DType::F32, &vec![0.0; n]);
    probe.add_tensor(
        "token_embd.weight",
        DType::F32,
        &[config.vocab_size, 1],
        f32s(config.vocab_size)?,
    )?;
    // The reader takes more layers than tensors for a broken file.
    for l in 0..config.n_layers {
        probe.add_tensor(
            &format!("blk.{l}.attn_norm.weight"),
            DType::F32,
            &[1],
            f32s(1)?,
        )?;
    }
    if let Some(f) = freqs {
        probe.add_tensor(
            "rope_freqs.weight",
            DType::F32,
            &[f.len()],
            quant::quantize(DType::F32, f)?,
        )?;
    }
    let mut bytes = Vec::new();
    probe
        .write_to(&mut bytes)
        .map_err(|e| Error::Device(format!("writing GGUF metadata to memory: {e}")))?;
    let back = config_from_gguf(&GgufFile::from_bytes("<metadata>", bytes)?)?;
    if !same_config(&back, config) {
        return Err(Error::unsupported(format!(
            "writing this {} model to GGUF: it would be read back as another model ({back:?}, not {config:?})",
            config.arch.name()
        )));
    }
    Ok(())
}

/// Equal, with the rope frequencies compared as the values they make (a Llama 3 scaling
/// comes back as the divisors that give the same frequencies).
fn same_config(a: &ModelConfig, b: &ModelConfig) -> bool {
    let strip = |c: &ModelConfig| ModelConfig {
        rope: c.rope.as_ref().map(|r| Rope {
            llama3: None,
            freq_factors: None,
            ..r.clone()
        }),
        ..c.clone()
    };
    let freqs = |c: &ModelConfig| c.rope.as_ref().map(Rope::inv_freq);
    let close = match (freqs(a), freqs(b)) {
        (Some(x), Some(y)) => {
            x.len() == y.len()
                && x.iter()
                    .zip(&y)
                    .all(|(p, q)| (p - q).abs() <= 1e-6 * p.abs().max(q.abs()))
        }
        (None, None) => true,
        _ => false,
    };
    strip(a) == strip(b) && close
}

/// Rows that are not whole blocks of `dtype` stay F16, as llama.cpp does.
pub(crate) fn matrix_type(dtype: DType, shape: &[usize]) -> DType {
    if shape.last().is_some_and(|&k| k % dtype.block_size() == 0) {
        dtype
    } else {
        DType::F16
    }
}

/// `t`'s bytes as the device gives them back, its rows permuted within `heads` heads
/// where given (whole rows: a block type's blocks stay whole).
fn stored_bytes(model: &Model, t: &Tensor, heads: Option<usize>) -> Result<Vec<u8>> {
    let bytes = model.backend().download(t)?;
    let Some(heads) = heads else {
        return Ok(bytes);
    };
    let dims = t.dims();
    let cols = if dims.len() == 1 { 1 } else { dims[1] };
    Ok(permute_rows(
        &bytes,
        dims[0],
        t.dtype().row_bytes(cols)?,
        heads,
    ))
}

/// What makes a tensor's bytes, given its name.
type MakeTensor<'a> = Box<dyn Fn(&str) -> Result<Vec<u8>> + 'a>;

/// A model as a GGUF file: the writer, which holds the metadata (a caller adds its own)
/// and each tensor's name, type and shape, and the tensors' bytes, made one at a time
/// as the file is written.
pub struct GgufExport<'a> {
    pub writer: GgufWriter,
    make: MakeTensor<'a>,
}

impl GgufExport<'_> {
    pub fn write_to(&self, w: &mut impl std::io::Write) -> std::io::Result<()> {
        self.writer.write_to_making(w, &self.make)
    }
}

impl Model {
    /// This model as a GGUF file, its configuration as llama.cpp's metadata (refused
    /// when it would read back as another) and every parameter read back from the device
    /// under its GGUF name: matrices stored as `dtype` (F16 where rows are not whole blocks
    /// of it), norms and biases F32; a Hugging Face llama's Q and K rows permuted to
    /// llama.cpp's rope pairs, as `kiln convert` does. The caller adds the tokenizer's
    /// metadata (and anything else) and writes the file.
    pub fn to_gguf(&self, name: &str, dtype: DType) -> Result<GgufExport<'_>> {
        self.to_gguf_with(name, dtype, |_, _| Ok(()))
    }

    /// [`Model::to_gguf`], each parameter's values (F32, the model's own layout) passed
    /// through `adjust(name, values)` before they are written: how updates kept beside
    /// the model (LoRA's) are merged into what is exported. Each tensor is read from the
    /// device and encoded as the file is written, so that no more than one of them is
    /// held in another type at once.
    pub fn to_gguf_with<'a>(
        &'a self,
        name: &str,
        dtype: DType,
        adjust: impl Fn(&str, &mut Vec<f32>) -> Result<()> + 'a,
    ) -> Result<GgufExport<'a>> {
        let ty = move |t: &Tensor| match t.dims() {
            [_] => DType::F32,
            dims => matrix_type(dtype, dims),
        };
        self.export_later(name, ty, move |pname, t, heads| {
            let bytes = self.backend().download(t)?;
            let mut values = quant::dequantize_to_vec(t.dtype(), &bytes, t.shape().numel())?;
            adjust(pname, &mut values)?;
            if let Some(heads) = heads {
                let dims = t.dims();
                let cols = if dims.len() == 1 { 1 } else { dims[1] };
                values = permute_rows(&values, dims[0], cols, heads);
            }
            quant::quantize(ty(t), &values)
        })
    }

    /// [`Model::to_gguf`] with every parameter in the type it has on the device, its
    /// bytes as they are (Q and K rows permuted whole), read now into a writer that owns
    /// them: a frozen quantized model saved beside LoRA adapters without a round trip
    /// through F32, written while training goes on.
    pub fn to_gguf_as_stored(&self, name: &str) -> Result<GgufWriter> {
        let (mut w, permute) = self.writer_and_heads(name)?;
        for (pname, t) in self.parameters() {
            let bytes = stored_bytes(self, t, permute(&pname))?;
            w.add_tensor(&pname, t.dtype(), t.dims(), bytes)?;
        }
        Ok(w)
    }

    /// [`Model::to_gguf_as_stored`] read as the file is written, one tensor at a time:
    /// a frozen model written out whole without a second copy in memory.
    pub fn to_gguf_as_stored_later(&self, name: &str) -> Result<GgufExport<'_>> {
        self.export_later(name, Tensor::dtype, |_, t, heads| {
            stored_bytes(self, t, heads)
        })
    }

    /// A GGUF file of this model whose parameters, declared in the types `ty` gives,
    /// are made by `make(name, tensor, heads)` as the file is written (`heads`: the heads
    /// its rows are permuted within, where they are).
    fn export_later<'a>(
        &'a self,
        name: &str,
        ty: impl Fn(&Tensor) -> DType,
        make: impl Fn(&str, &Tensor, Option<usize>) -> Result<Vec<u8>> + 'a,
    ) -> Result<GgufExport<'a>> {
        let (mut writer, permute) = self.writer_and_heads(name)?;
        let params = self.parameters();
        for (pname, t) in &params {
            writer.add_tensor_later(pname, ty(t), t.dims())?;
        }
        let make = move |wanted: &str| -> Result<Vec<u8>> {
            let (pname, t) = params
                .iter()
                .find(|(n, _)| n == wanted)
                .ok_or_else(|| Error::shape(format!("{wanted} is not a parameter")))?;
            make(pname, t, permute(pname))
        };
        Ok(GgufExport {
            writer,
            make: Box::new(make),
        })
    }

    /// The writer of [`Model::to_gguf_as_stored`] with every parameter declared in its
    /// type but not read ([`GgufWriter::add_tensor_later`]): for a caller who has the
    /// bytes elsewhere (a frozen model's start file) and gives them as it writes.
    pub fn to_gguf_declared(&self, name: &str) -> Result<GgufWriter> {
        let (mut w, _) = self.writer_and_heads(name)?;
        for (pname, t) in self.parameters() {
            w.add_tensor_later(&pname, t.dtype(), t.dims())?;
        }
        Ok(w)
    }

    /// The writer of [`Model::to_gguf`], and for a parameter's name the number of heads
    /// its rows are permuted within, where they are (a Hugging Face llama's Q and K).
    fn writer_and_heads(&self, name: &str) -> Result<(GgufWriter, impl Fn(&str) -> Option<usize>)> {
        let c = &self.config;
        let (w, permute_qk) = writer(c, name)?;
        let (q, k) = (c.n_heads, c.n_kv_heads);
        let heads = move |pname: &str| {
            if !permute_qk {
                None
            } else if pname.ends_with(".attn_q.weight") || pname.ends_with(".attn_q.bias") {
                Some(q)
            } else if pname.ends_with(".attn_k.weight") || pname.ends_with(".attn_k.bias") {
                Some(k)
            } else {
                None
            }
        };
        Ok((w, heads))
    }
}
