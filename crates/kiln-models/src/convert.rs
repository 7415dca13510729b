//! Hugging Face → GGUF for LLaMA-family checkpoints, following llama.cpp's converter's
//! conventions (tensor names, metadata keys, Q/K rows permuted for rope on adjacent
//! pairs), so that llama.cpp and kiln read the result the same way.

use crate::config::Arch;
use crate::load::config_from_hf;
use kiln_core::{quant, DType, Error, Result};
use kiln_io::gguf::{GgufWriter, Value};
use kiln_io::hf_config::HfConfig;
use kiln_io::safetensors::SafetensorsModel;
use kiln_tokenizer::Tokenizer;
use std::path::Path;

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
fn permute_rows(w: &[f32], rows: usize, cols: usize, heads: usize) -> Vec<f32> {
    let hd = rows / heads;
    let mut out = vec![0f32; w.len()];
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

/// Convert the Hugging Face directory `dir` to a GGUF file at `out`, matrices in `dtype`
/// (norms stay f32). Returns the number of tensors written.
pub fn convert_hf_to_gguf(dir: &Path, out: &Path, dtype: DType, name: &str) -> Result<usize> {
    let file_type = file_type(dtype)?;
    let dir_name = dir.display().to_string();
    let hf = HfConfig::load(&dir.join("config.json"))?;
    let c = config_from_hf(&hf, &dir_name)?;
    if !matches!(c.arch, Arch::Llama | Arch::Mistral) {
        return Err(Error::unsupported(format!(
            "kiln convert writes llama and mistral models; {dir_name} is {}",
            c.arch.name()
        )));
    }
    let rope = c.rope.as_ref().expect("llama has rope");
    if rope.llama3.is_some() {
        return Err(Error::unsupported(
            "converting llama3 rope scaling (rope_freqs) is not implemented",
        ));
    }
    let st = SafetensorsModel::open_dir(dir)?;
    let tokenizer = Tokenizer::from_hf_dir_sentencepiece(dir)?;
    let arch = c.arch.name();
    let mut w = GgufWriter::new();
    let mut set = |k: &str, v: Value| w.set(k, v);
    set("general.architecture", Value::String(arch.into()))?;
    set("general.name", Value::String(name.into()))?;
    set("general.file_type", Value::U32(file_type))?;
    let key = |k: &str| format!("{arch}.{k}");
    set(&key("context_length"), Value::U32(c.max_positions as u32))?;
    set(&key("embedding_length"), Value::U32(c.dim as u32))?;
    set(&key("block_count"), Value::U32(c.n_layers as u32))?;
    set(&key("feed_forward_length"), Value::U32(c.ffn_dim as u32))?;
    set(&key("rope.dimension_count"), Value::U32(rope.dims as u32))?;
    set(&key("rope.freq_base"), Value::F32(rope.theta))?;
    set(&key("attention.head_count"), Value::U32(c.n_heads as u32))?;
    set(
        &key("attention.head_count_kv"),
        Value::U32(c.n_kv_heads as u32),
    )?;
    if let crate::config::Norm::Rms { eps } = c.norm {
        set(&key("attention.layer_norm_rms_epsilon"), Value::F32(eps))?;
    }
    set(&key("vocab_size"), Value::U32(c.vocab_size as u32))?;
    for (k, v) in tokenizer.gguf_metadata()? {
        set(&k, v)?;
    }

    let read = |name: &str| -> Result<(Vec<f32>, Vec<usize>)> {
        let t = st
            .tensor(name)
            .ok_or_else(|| Error::format(format!("{dir_name}: tensor {name} is missing")))?;
        let dt = t
            .kiln_dtype()
            .ok_or_else(|| Error::unsupported(format!("{name} is {}", t.dtype_name())))?;
        let n = t.shape.iter().product();
        Ok((
            quant::dequantize_to_vec(dt, st.tensor_data(t), n)?,
            t.shape.clone(),
        ))
    };
    let mut count = 0;
    let mut put = |w: &mut GgufWriter,
                   gguf_name: &str,
                   values: &[f32],
                   shape: &[usize],
                   matrix: bool|
     -> Result<()> {
        // Rows that are not whole blocks of the requested type stay f16, as llama.cpp does.
        let t = if !matrix {
            DType::F32
        } else if shape.last().is_some_and(|&k| k % dtype.block_size() == 0) {
            dtype
        } else {
            DType::F16
        };
        w.add_tensor(gguf_name, t, shape, quant::quantize(t, values)?)?;
        count += 1;
        Ok(())
    };
    let (embed, shape) = read("model.embed_tokens.weight")?;
    put(&mut w, "token_embd.weight", &embed, &shape, true)?;
    for l in 0..c.n_layers {
        let hf = |n: &str| format!("model.layers.{l}.{n}.weight");
        let gg = |n: &str| format!("blk.{l}.{n}.weight");
        let (v, s) = read(&hf("input_layernorm"))?;
        put(&mut w, &gg("attn_norm"), &v, &s, false)?;
        let (q, s) = read(&hf("self_attn.q_proj"))?;
        put(
            &mut w,
            &gg("attn_q"),
            &permute_rows(&q, s[0], s[1], c.n_heads),
            &s,
            true,
        )?;
        let (k, s) = read(&hf("self_attn.k_proj"))?;
        put(
            &mut w,
            &gg("attn_k"),
            &permute_rows(&k, s[0], s[1], c.n_kv_heads),
            &s,
            true,
        )?;
        for (from, to) in [
            ("self_attn.v_proj", "attn_v"),
            ("self_attn.o_proj", "attn_output"),
            ("mlp.gate_proj", "ffn_gate"),
            ("mlp.up_proj", "ffn_up"),
            ("mlp.down_proj", "ffn_down"),
        ] {
            let (v, s) = read(&hf(from))?;
            put(&mut w, &gg(to), &v, &s, true)?;
        }
        let (v, s) = read(&hf("post_attention_layernorm"))?;
        put(&mut w, &gg("ffn_norm"), &v, &s, false)?;
    }
    let (v, s) = read("model.norm.weight")?;
    put(&mut w, "output_norm.weight", &v, &s, false)?;
    if st.tensor("lm_head.weight").is_some() && !hf.tie_word_embeddings.unwrap_or(false) {
        let (v, s) = read("lm_head.weight")?;
        put(&mut w, "output.weight", &v, &s, true)?;
    }
    w.write_file(out)?;
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
