//! Drawing the next token on the GPU (shaders/sample.wgsl), so that only its id is read
//! back. Top-k up to [`MAX_TOP_K`] (llama.cpp's default is 40) runs on the device; top-k
//! off or larger falls back to the host reference, reading the logits back.

use crate::elementwise::count;
use crate::kernels::SAMPLE;
use crate::{f32_tensor, memory, storage, WgpuBackend};
use kiln_core::{DType, Error, Result, SampleParams, Tensor};

/// The most candidates the shader keeps: one a lane of its workgroup.
pub(crate) const MAX_TOP_K: usize = 256;

/// Draw on the device; `Ok(false)` when these parameters are the host's to handle.
pub(crate) fn sample(
    b: &WgpuBackend,
    logits: &mut Tensor,
    penalized: &[u32],
    params: &SampleParams,
    out: &mut Tensor,
) -> Result<bool> {
    let vocab = logits.shape().row_len();
    if logits.dtype() != DType::F32
        || out.dtype() != DType::I32
        || out.shape().numel() != 1
        || vocab == 0
    {
        return Err(Error::shape(format!(
            "sampling from {} logits {} into {} {}",
            logits.dtype(),
            logits.shape(),
            out.dtype(),
            out.shape()
        )));
    }
    // Greedy (with a penalty, or the caller would have used argmax) is top-1.
    let greedy = params.temperature <= 0.0;
    let top_k = if greedy { 1 } else { params.top_k.min(vocab) };
    if top_k == 0 || top_k > MAX_TOP_K {
        return Ok(false);
    }
    let (temperature, top_p, min_p) = if greedy {
        (1.0, 1.0, 0.0)
    } else {
        (params.temperature, params.top_p, params.min_p)
    };
    let ids: Vec<u8> = penalized
        .iter()
        .filter(|&&t| (t as usize) < vocab)
        .flat_map(|&t| (t as i32).to_le_bytes())
        .collect();
    let what = "sampling";
    let mut scratch = b.penalized.lock().unwrap();
    if scratch
        .as_ref()
        .is_none_or(|s| (s.bytes as usize) < ids.len().max(4))
    {
        *scratch = Some(b.alloc(ids.len().max(4) * 2)?);
    }
    let pen = scratch.as_ref().unwrap();
    memory::write(&b.stream, pen, &ids)?;
    let bindings = [
        f32_tensor(logits, "logits")?,
        pen.binding(),
        storage(out, "sampled token")?.binding(),
    ];
    let kernel = b.kernel(&SAMPLE, &[])?;
    b.stream.dispatch(
        &kernel,
        &bindings,
        &[
            count(vocab, what)?,
            count(logits.shape().numel() - vocab, what)?,
            count(ids.len() / 4, what)?,
            params.repeat_penalty.to_bits(),
            top_k as u32,
            top_p.to_bits(),
            min_p.to_bits(),
            temperature.to_bits(),
            (params.draw as f32).to_bits(),
        ],
        (1, 1, 1),
    )?;
    Ok(true)
}
