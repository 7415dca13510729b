//! Drawing the next token on the GPU (kernels/sample.cu), so that only its id is read
//! back. Top-k up to [`MAX_TOP_K`] (llama.cpp's default is 40) runs on the device; top-k
//! off or larger falls back to the host reference, reading the logits back.

use crate::kernels::Arg;
use crate::{driver_error, expect, ptr, to_i32, CudaBackend};
use cudarc::driver::result;
use kiln_core::{DType, Error, Result, SampleParams, Tensor};

/// The most candidates the kernel keeps (its shared-memory sort), as SAMPLE_MAX_K.
pub(crate) const MAX_TOP_K: usize = 1024;

/// Threads of the one block of `sample_top_k` (its prefix sums and sort assume them).
pub(crate) const THREADS: u32 = 1024;

/// Draw on the device; `Ok(false)` when these parameters are the host's to handle.
pub(crate) fn sample(
    b: &CudaBackend,
    logits: &mut Tensor,
    penalized: &[u32],
    params: &SampleParams,
    out: &mut Tensor,
) -> Result<bool> {
    expect(logits, DType::F32, "sampling logits")?;
    expect(out, DType::I32, "sampled token")?;
    let vocab = logits.shape().row_len();
    if out.shape().numel() != 1 || vocab == 0 {
        return Err(Error::shape(format!(
            "sampling from logits {} into {}",
            logits.shape(),
            out.shape()
        )));
    }
    // Greedy (with a penalty, or the caller would have used argmax) is top-1.
    let greedy = params.temperature <= 0.0;
    let top_k = if greedy { 1 } else { params.top_k.min(vocab) };
    if top_k == 0 || top_k > MAX_TOP_K {
        return Ok(false);
    }
    let last_row = ptr(logits)? + 4 * (logits.shape().numel() - vocab) as u64;
    let pen: Vec<i32> = penalized
        .iter()
        .filter(|&&t| (t as usize) < vocab)
        .map(|&t| t as i32)
        .collect();
    let pen_ptr = b.scratch("sample_penalized", 4 * pen.len().max(1))?;
    if !pen.is_empty() {
        let bytes: Vec<u8> = pen.iter().flat_map(|t| t.to_le_bytes()).collect();
        // From pageable memory the driver stages the bytes before returning.
        b.queued_other_work();
        unsafe { result::memcpy_htod_async(pen_ptr, &bytes[..], b.stream.cu_stream()) }
            .map_err(driver_error)?;
    }
    let (temperature, top_p, min_p) = if greedy {
        (1.0, 1.0, 0.0)
    } else {
        (params.temperature, params.top_p, params.min_p)
    };
    b.launch(
        "sample_top_k",
        (1, 1, 1),
        (THREADS, 1, 1),
        0,
        &[
            Arg::Ptr(last_row),
            Arg::I32(to_i32(vocab, "vocabulary")?),
            Arg::Ptr(pen_ptr),
            Arg::I32(pen.len() as i32),
            Arg::F32(params.repeat_penalty),
            Arg::I32(top_k as i32),
            Arg::F32(top_p),
            Arg::F32(min_p),
            Arg::F32(temperature),
            Arg::F32(params.draw as f32),
            Arg::Ptr(ptr(out)?),
        ],
    )?;
    Ok(true)
}
