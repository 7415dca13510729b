//! Drawing the next token on the GPU (kernels/sample.cu), so that only its id is read
//! back: top-k up to 1024 (`SAMPLE_MAX_K`; llama.cpp's default is 40) through a sort of the k
//! best, top-k off or larger (OpenAI's default) through weighted radix descents over the
//! whole vocabulary. A server's batch draws in one launch, a block a row.

use crate::kernels::Arg;
use crate::{driver_error, expect, ptr, to_i32, CudaBackend};
use cudarc::driver::result;
use kiln_core::backend::{check_row_draws, token_ids};
use kiln_core::{Backend, DType, Error, Result, RowDraw, SampleParams, Shape, Tensor};

/// Threads of the one block of `sample_top_k` (its prefix sums and sort assume them).
pub(crate) const THREADS: u32 = 1024;

/// Draw on the device from the last row of `logits`.
pub(crate) fn sample(
    b: &CudaBackend,
    logits: &mut Tensor,
    penalized: &[u32],
    params: &SampleParams,
    out: &mut Tensor,
) -> Result<()> {
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
    let top_k = device_top_k(params, vocab)?;
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
    let [penalty, top_p, min_p, temperature, draw] = settings(params);
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
            Arg::F32(penalty),
            Arg::I32(top_k),
            Arg::F32(top_p),
            Arg::F32(min_p),
            Arg::F32(temperature),
            Arg::F32(draw),
            Arg::Ptr(ptr(out)?),
        ],
    )
}

/// The kernel's top-k for `params`: greedy (with a penalty, or the caller would have used
/// argmax) is top-1; 0 is off (the whole vocabulary).
fn device_top_k(params: &SampleParams, vocab: usize) -> Result<i32> {
    match params.temperature <= 0.0 {
        true => Ok(1),
        false => to_i32(params.top_k.min(vocab), "top-k"),
    }
}

/// The kernel's penalty, top-p, min-p, temperature and draw (a greedy draw at
/// temperature 1 from its top-1).
fn settings(params: &SampleParams) -> [f32; 5] {
    match params.temperature <= 0.0 {
        true => [params.repeat_penalty, 1.0, 0.0, 1.0, params.draw as f32],
        false => [
            params.repeat_penalty,
            params.top_p,
            params.min_p,
            params.temperature,
            params.draw as f32,
        ],
    }
}

/// Every draw of a batch in one launch of `sample_rows` and one read-back of the ids.
pub(crate) fn sample_rows(
    b: &CudaBackend,
    logits: &mut Tensor,
    draws: &[RowDraw<'_>],
) -> Result<Vec<u32>> {
    check_row_draws(logits, draws)?;
    if draws.is_empty() {
        return Ok(Vec::new());
    }
    let vocab = logits.shape().row_len();
    // One upload: rows, top-k, penalized spans, penalized ids (i32), then settings.
    let n = draws.len();
    let mut ints: Vec<i32> = Vec::with_capacity(3 * n + 1);
    let mut pen: Vec<i32> = Vec::new();
    let mut at = vec![0i32];
    let mut floats: Vec<f32> = Vec::with_capacity(5 * n);
    for d in draws {
        ints.push(to_i32(d.row, "logits row")?);
        pen.extend(
            d.penalized
                .iter()
                .filter(|&&t| (t as usize) < vocab)
                .map(|&t| t as i32),
        );
        at.push(to_i32(pen.len(), "penalized ids")?);
        floats.extend(settings(d.params));
    }
    for d in draws {
        ints.push(device_top_k(d.params, vocab)?);
    }
    ints.extend(&at);
    ints.extend(&pen);
    let mut bytes: Vec<u8> = ints.iter().flat_map(|v| v.to_le_bytes()).collect();
    bytes.extend(floats.iter().flat_map(|v| v.to_le_bytes()));
    let base = b.scratch("sample_rows", bytes.len())?;
    // From pageable memory the driver stages the bytes before returning.
    b.queued_other_work();
    unsafe { result::memcpy_htod_async(base, &bytes[..], b.stream.cu_stream()) }
        .map_err(driver_error)?;
    let word = |k: usize| base + 4 * k as u64;
    let out = b.zeros(DType::I32, Shape::new(vec![n])?)?;
    b.launch(
        "sample_rows",
        (to_i32(n, "draws")? as u32, 1, 1),
        (THREADS, 1, 1),
        0,
        &[
            Arg::Ptr(ptr(logits)?),
            Arg::I32(to_i32(vocab, "vocabulary")?),
            Arg::Ptr(base),
            Arg::Ptr(word(n)),
            Arg::Ptr(word(2 * n)),
            Arg::Ptr(word(3 * n + 1)),
            Arg::Ptr(word(3 * n + 1 + pen.len())),
            Arg::Ptr(ptr(&out)?),
        ],
    )?;
    token_ids(&b.download(&out)?)
}
