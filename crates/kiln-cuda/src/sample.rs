//! Drawing the next token on the GPU (kernels/sample.cu), so that only its id is read
//! back: top-k up to 1024 (`SAMPLE_MAX_K`; llama.cpp's default is 40) through a sort of the k
//! best, top-k off or larger (OpenAI's default) through weighted radix descents over the
//! whole vocabulary. A server's batch draws in one launch, a block a row.

use crate::kernels::Arg;
use crate::{driver_error, expect, ptr, to_i32, CudaBackend};
use cudarc::driver::result;
use kiln_core::backend::{check_row_draws, token_ids};
use kiln_core::{Backend, DType, Error, Result, RowDraw, SampleParams, Shape, Tensor};

/// Threads of a block of `sample_rows` (its prefix sums and sort assume them).
pub(crate) const THREADS: u32 = 1024;

/// Draw on the device from the last row of `logits` into `out` (I32 `[1]`): the batch's
/// kernel with one draw.
pub(crate) fn sample(
    b: &CudaBackend,
    logits: &mut Tensor,
    penalized: &[u32],
    params: &SampleParams,
    out: &mut Tensor,
) -> Result<()> {
    expect(out, DType::I32, "sampled token")?;
    let vocab = logits.shape().row_len();
    if out.shape().numel() != 1 || vocab == 0 {
        return Err(Error::shape(format!(
            "sampling from logits {} into {}",
            logits.shape(),
            out.shape()
        )));
    }
    let draw = RowDraw {
        row: logits.shape().numel() / vocab - 1,
        penalized,
        params,
    };
    launch_draws(b, logits, &[draw], ptr(out)?)
}

/// Every draw of a batch in one launch and one read-back of the ids.
pub(crate) fn sample_rows(
    b: &CudaBackend,
    logits: &mut Tensor,
    draws: &[RowDraw<'_>],
) -> Result<Vec<u32>> {
    if draws.is_empty() {
        return check_row_draws(logits, draws).map(|_| Vec::new());
    }
    let out = b.zeros(DType::I32, Shape::new(vec![draws.len()])?)?;
    launch_draws(b, logits, draws, ptr(&out)?)?;
    token_ids(&b.download(&out)?)
}

/// Launch `sample_rows` for `draws` (at least one), draw `i`'s token into I32 `out[i]`.
fn launch_draws(
    b: &CudaBackend,
    logits: &mut Tensor,
    draws: &[RowDraw<'_>],
    out: u64,
) -> Result<()> {
    check_row_draws(logits, draws)?;
    let vocab = logits.shape().row_len();
    // One upload: rows, top-k, penalized spans, penalized ids (i32), then settings.
    let n = draws.len();
    let mut ints: Vec<i32> = Vec::with_capacity(3 * n + 1);
    let mut top_ks: Vec<i32> = Vec::with_capacity(n);
    let mut pen: Vec<i32> = Vec::new();
    let mut at = vec![0i32];
    let mut floats: Vec<f32> = Vec::with_capacity(5 * n);
    for d in draws {
        let (top_k, settings) = d.params.device_draw(vocab);
        ints.push(to_i32(d.row, "logits row")?);
        top_ks.push(to_i32(top_k, "top-k")?);
        pen.extend(
            d.penalized
                .iter()
                .filter(|&&t| (t as usize) < vocab)
                .map(|&t| t as i32),
        );
        at.push(to_i32(pen.len(), "penalized ids")?);
        floats.extend(settings);
    }
    ints.extend(&top_ks);
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
            Arg::Ptr(out),
        ],
    )
}
