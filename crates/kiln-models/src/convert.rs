//! Hugging Face → GGUF for LLaMA-family checkpoints, following llama.cpp's converter's
//! conventions (tensor names, metadata keys, Q/K rows permuted for rope on adjacent
//! pairs), so that llama.cpp and kiln read the result the same way.

use crate::config::{Arch, ModelConfig, Norm, Rope};
use crate::config_hf::config_from_hf;
use crate::model_gguf::matrix_type;
use kiln_core::{quant, DType, Error, Result};
use kiln_io::gguf::{GgufWriter, Value};
use kiln_io::hf_config::HfConfig;
use kiln_io::safetensors::{SafetensorsModel, INDEX_FILE};
use kiln_tokenizer::Tokenizer;
use std::path::{Path, PathBuf};

/// llama.cpp's `general.file_type` numbers for the types kiln writes.
fn file_type(dtype: DType) -> Result<u32> {
    Ok(match dtype {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::Q4_0 => 2,
        DType::Q8_0 => 7,
        DType::Q4_K => 15,
        DType::Q6_K => 18,
        DType::BF16 => 32,
        DType::I32 => return Err(Error::unsupported("weights cannot be converted to i32")),
    })
}

/// llama.cpp's `permute`: within each head, rows `[i, i + d/2]` become `[2i, 2i + 1]`.
pub(crate) fn permute_rows<T: Copy + Default>(
    w: &[T],
    rows: usize,
    cols: usize,
    heads: usize,
) -> Vec<T> {
    let hd = rows / heads;
    let mut out = vec![T::default(); w.len()];
    for h in 0..heads {
        for half in 0..2 {
            for i in 0..hd / 2 {
                let from = h * hd + half * (hd / 2) + i;
                let to = h * hd + 2 * i + half;
                out[to * cols..(to + 1) * cols].copy_from_slice(&w[from * cols..(from + 1) * cols]);
            }
        }
    }
    out
}

/// What becomes of one checkpoint tensor.
enum Kind {
    /// Kept f32.
    Norm,
    /// In the requested type where its rows are whole blocks.
    Matrix,
    /// A Q or K projection: rows permuted within each of this many heads.
    Heads(usize),
}

/// One tensor to write: its checkpoint name, its GGUF name, the shape the config implies.
struct Planned {
    hf: String,
    gguf: String,
    shape: Vec<usize>,
    kind: Kind,
}

/// Every tensor the GGUF will hold, each checked against the config (present, a dtype
/// kiln reads, the shape the config implies) before anything is read or written.
fn plan(c: &ModelConfig, st: &SafetensorsModel, tied: bool, dir: &str) -> Result<Vec<Planned>> {
    let (dim, q, kv, ffn) = (c.dim, c.q_dim(), c.kv_dim(), c.ffn_dim);
    let mut plan = Vec::new();
    let mut add = |hf: String, gguf: String, shape: Vec<usize>, kind: Kind| {
        plan.push(Planned {
            hf,
            gguf,
            shape,
            kind,
        })
    };
    add(
        "model.embed_tokens.weight".into(),
        "token_embd.weight".into(),
        vec![c.vocab_size, dim],
        Kind::Matrix,
    );
    for l in 0..c.n_layers {
        let hf = |n: &str| format!("model.layers.{l}.{n}.weight");
        let gg = |n: &str| format!("blk.{l}.{n}.weight");
        let layer = [
            ("input_layernorm", "attn_norm", vec![dim], Kind::Norm),
            (
                "self_attn.q_proj",
                "attn_q",
                vec![q, dim],
                Kind::Heads(c.n_heads),
            ),
            (
                "self_attn.k_proj",
                "attn_k",
                vec![kv, dim],
                Kind::Heads(c.n_kv_heads),
            ),
            ("self_attn.v_proj", "attn_v", vec![kv, dim], Kind::Matrix),
            (
                "self_attn.o_proj",
                "attn_output",
                vec![dim, q],
                Kind::Matrix,
            ),
            ("mlp.gate_proj", "ffn_gate", vec![ffn, dim], Kind::Matrix),
            ("mlp.up_proj", "ffn_up", vec![ffn, dim], Kind::Matrix),
            ("mlp.down_proj", "ffn_down", vec![dim, ffn], Kind::Matrix),
            (
                "post_attention_layernorm",
                "ffn_norm",
                vec![dim],
                Kind::Norm,
            ),
        ];
        for (from, to, shape, kind) in layer {
            add(hf(from), gg(to), shape, kind);
        }
    }
    add(
        "model.norm.weight".into(),
        "output_norm.weight".into(),
        vec![dim],
        Kind::Norm,
    );
    // Without an lm_head (or with tied embeddings) the GGUF has no output and kiln,
    // like llama.cpp, multiplies by the embeddings.
    if st.tensor("lm_head.weight").is_some() && !tied {
        add(
            "lm_head.weight".into(),
            "output.weight".into(),
            vec![c.vocab_size, dim],
            Kind::Matrix,
        );
    }
    for p in &plan {
        let t = st
            .tensor(&p.hf)
            .ok_or_else(|| Error::format(format!("{dir}: tensor {} is missing", p.hf)))?;
        if t.kiln_dtype().is_none() {
            return Err(Error::unsupported(format!(
                "{dir}: tensor {} is {}; kiln converts f32, f16 and bf16 checkpoints",
                p.hf,
                t.dtype_name()
            )));
        }
        if t.shape != p.shape {
            return Err(Error::format(format!(
                "{dir}: tensor {} is {:?}, the config implies {:?}",
                p.hf, t.shape, p.shape
            )));
        }
    }
    Ok(plan)
}

/// The files of a model directory that conversion reads besides its shards.
const INPUT_FILES: &[&str] = &[
    "config.json",
    INDEX_FILE,
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
];

/// Two paths name one file when they resolve to one place (through symlinks and `..`)
/// or, on Unix, to one inode (hard links).
fn same_file(a: &Path, b: &Path) -> bool {
    if let (Ok(x), Ok(y)) = (std::fs::canonicalize(a), std::fs::canonicalize(b)) {
        if x == y {
            return true;
        }
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        if let (Ok(x), Ok(y)) = (std::fs::metadata(a), std::fs::metadata(b)) {
            return x.dev() == y.dev() && x.ino() == y.ino();
        }
    }
    false
}

/// Refuse an output that would replace one of the inputs.
fn check_output(out: &Path, dir: &Path, shards: &[PathBuf]) -> Result<()> {
    if out.is_dir() {
        return Err(Error::format(format!(
            "the output {} is a directory; give the path of the GGUF file to write",
            out.display()
        )));
    }
    let inputs = INPUT_FILES.iter().map(|n| dir.join(n));
    for input in shards.iter().cloned().chain(inputs) {
        if same_file(&input, out) {
            return Err(Error::format(format!(
                "the output {} is the input file {}; write the GGUF to another path",
                out.display(),
                input.display()
            )));
        }
    }
    Ok(())
}

/// Convert the Hugging Face directory `dir` to a GGUF file at `out`, matrices in `dtype`
/// (norms stay f32). Returns the number of tensors written.
pub fn convert_hf_to_gguf(dir: &Path, out: &Path, dtype: DType, name: &str) -> Result<usize> {
    let file_type = file_type(dtype)?;
    let dir_name = dir.display().to_string();
    let hf = HfConfig::load_dir(dir)?;
    let c = config_from_hf(&hf, &dir_name)?;
    if !matches!(c.arch, Arch::Llama | Arch::Mistral) {
        return Err(Error::unsupported(format!(
            "kiln convert writes llama and mistral models; {dir_name} is {}",
            c.arch.name()
        )));
    }
    let rope = c.rope.as_ref().expect("llama has rope");
    // The row permutation moves whole heads' halves: it is right only when rope turns
    // the whole head.
    if rope.dims != c.head_dim {
        return Err(Error::unsupported(format!(
            "{dir_name}: rope turns {} of each head's {} dimensions; kiln converts only full rotary",
            rope.dims, c.head_dim
        )));
    }
    let st = SafetensorsModel::open_dir(dir)?;
    check_output(out, dir, &st.files)?;
    let plan = plan(&c, &st, hf.tie_word_embeddings.unwrap_or(false), &dir_name)?;
    let tokenizer = Tokenizer::from_hf_dir_sentencepiece(dir)?;

    let arch = c.arch.name();
    let mut w = GgufWriter::new();
    let key = |k: &str| format!("{arch}.{k}");
    // Sizes are bounded by the config's validation far below u32::MAX.
    let int = |v: usize| Value::U32(v as u32);
    let mut meta = vec![
        (
            "general.architecture".to_string(),
            Value::String(arch.into()),
        ),
        ("general.name".into(), Value::String(name.into())),
        ("general.file_type".into(), Value::U32(file_type)),
        (key("context_length"), int(c.max_positions)),
        (key("embedding_length"), int(c.dim)),
        (key("block_count"), int(c.n_layers)),
        (key("feed_forward_length"), int(c.ffn_dim)),
        (key("rope.dimension_count"), int(rope.dims)),
        (key("rope.freq_base"), Value::F32(rope.theta)),
        (key("attention.head_count"), int(c.n_heads)),
        (key("attention.head_count_kv"), int(c.n_kv_heads)),
        // Written always, as head_dim need not be dim / heads (Mistral-Nemo's is not).
        (key("attention.key_length"), int(c.head_dim)),
        (key("attention.value_length"), int(c.head_dim)),
        (key("vocab_size"), int(c.vocab_size)),
    ];
    if let Norm::Rms { eps } = c.norm {
        meta.push((key("attention.layer_norm_rms_epsilon"), Value::F32(eps)));
    }
    if let Some(window) = c.sliding_window {
        meta.push((key("attention.sliding_window"), int(window)));
    }
    meta.extend(tokenizer.gguf_metadata()?);
    for (k, v) in meta {
        w.set(&k, v)?;
    }

    // Each tensor converted as the file is written: one in memory at a time.
    let type_of = |p: &Planned| match p.kind {
        Kind::Norm => DType::F32,
        Kind::Heads(_) | Kind::Matrix => matrix_type(dtype, &p.shape),
    };
    for p in &plan {
        w.add_tensor_later(&p.gguf, type_of(p), &p.shape)?;
    }
    let convert = |gguf: &str| -> Result<Vec<u8>> {
        let p = plan
            .iter()
            .find(|p| p.gguf == gguf)
            .ok_or_else(|| Error::shape(format!("{gguf} was not planned")))?;
        let t = st.tensor(&p.hf).expect("planned tensors exist");
        let dt = t.kiln_dtype().expect("planned tensors have a kiln dtype");
        let values = quant::dequantize_to_vec(dt, st.tensor_data(t), p.shape.iter().product())?;
        let values = match p.kind {
            Kind::Heads(heads) => permute_rows(&values, p.shape[0], p.shape[1], heads),
            Kind::Norm | Kind::Matrix => values,
        };
        quant::quantize(type_of(p), &values)
    };
    let mut count = plan.len();
    if rope.llama3.is_some() {
        // As llama.cpp's converter: the scaling as one divisor per rotated pair, which
        // the GGUF reader applies to the unscaled frequencies.
        let plain = Rope {
            llama3: None,
            ..rope.clone()
        };
        let divisors: Vec<f32> = (plain.inv_freq().iter().zip(rope.inv_freq()))
            .map(|(base, scaled)| base / scaled)
            .collect();
        let bytes = quant::quantize(DType::F32, &divisors)?;
        w.add_tensor("rope_freqs.weight", DType::F32, &[divisors.len()], bytes)?;
        count += 1;
    }
    kiln_io::file::write_replacing(out, |b| w.write_to_making(b, convert))?;
    Ok(count)
}

#[cfg(test)]
mod tests {
    use super::permute_rows;

    #[test]
    fn permute_interleaves_halves_per_head() {
        // 2 heads of 4 rows, 1 column: head rows [a0 a1 b0 b1] -> [a0 b0 a1 b1].
        let w: Vec<f32> = (0..8).map(|i| i as f32).collect();
        assert_eq!(
            permute_rows(&w, 8, 1, 2),
            vec![0., 2., 1., 3., 4., 6., 5., 7.]
        );
    }
}
