//! Drawing the next token on the GPU (shaders/sample.wgsl), so that only its id is read
//! back: every setting (top-k up to 256 by a sort of the candidates, top-k off or larger
//! by a search over the whole vocabulary), one row or a server's batch in one dispatch.

use crate::elementwise::count;
use crate::kernels::SAMPLE_ROWS;
use crate::{f32_tensor, memory, storage, WgpuBackend, WgpuStorage};
use kiln_core::backend::{check_row_draws, token_ids};
use kiln_core::{Backend, DType, Error, Result, RowDraw, SampleParams, Shape, Tensor};

/// Draw on the device from the last row of `logits` into `out` (I32 `[1]`): the batch's
/// shader with one draw.
pub(crate) fn sample(
    b: &WgpuBackend,
    logits: &mut Tensor,
    penalized: &[u32],
    params: &SampleParams,
    out: &mut Tensor,
) -> Result<()> {
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
    let draw = RowDraw {
        row: logits.shape().numel() / vocab - 1,
        penalized,
        params,
    };
    dispatch_draws(b, logits, &[draw], out)
}

/// Every draw of a batch in one dispatch (a workgroup a draw) and one read-back of the ids.
pub(crate) fn sample_rows(
    b: &WgpuBackend,
    logits: &mut Tensor,
    draws: &[RowDraw<'_>],
) -> Result<Vec<u32>> {
    check_row_draws(logits, draws)?;
    if draws.is_empty() {
        return Ok(Vec::new());
    }
    let n = draws.len();
    let mut slot = b.drawn.lock().unwrap();
    if slot.as_ref().is_none_or(|out| out.shape().numel() < n) {
        *slot = Some(b.zeros(DType::I32, Shape::new(vec![2 * n])?)?);
    }
    let out = slot.as_ref().expect("made above");
    dispatch_draws(b, logits, draws, out)?;
    token_ids(&b.download(out)?[..4 * n])
}

/// One dispatch of `sample_rows` for `draws`, draw `i`'s token into
/// I32 `out[i]`. The draws' records (`Draw` in the shader) and penalized ids go to buffers
/// kept and grown on the backend, so that a step's bindings, and their bind group, repeat.
fn dispatch_draws(
    b: &WgpuBackend,
    logits: &Tensor,
    draws: &[RowDraw<'_>],
    out: &Tensor,
) -> Result<()> {
    let vocab = logits.shape().row_len();
    let what = "sampling";
    let mut pen = Vec::new();
    let mut records: Vec<u32> = Vec::with_capacity(9 * draws.len());
    for d in draws {
        let (top_k, [penalty, top_p, min_p, temperature, draw]) = d.params.device_draw(vocab);
        let ids: Vec<u8> = d
            .penalized
            .iter()
            .filter(|&&t| (t as usize) < vocab)
            .flat_map(|&t| (t as i32).to_le_bytes())
            .collect();
        records.extend([
            count(d.row * vocab, what)?,
            count(pen.len() / 4, what)?,
            count(ids.len() / 4, what)?,
            penalty.to_bits(),
            count(top_k, what)?,
            top_p.to_bits(),
            min_p.to_bits(),
            temperature.to_bits(),
            draw.to_bits(),
        ]);
        pen.extend(ids);
    }
    let records: Vec<u8> = records.iter().flat_map(|w| w.to_le_bytes()).collect();
    let mut pen_slot = b.penalized.lock().unwrap();
    let pen_buf = grown(b, &mut pen_slot, pen.len())?;
    memory::write(&b.stream, pen_buf, &pen)?;
    let mut record_slot = b.draw_records.lock().unwrap();
    let record_buf = grown(b, &mut record_slot, records.len())?;
    memory::write(&b.stream, record_buf, &records)?;
    let bindings = [
        f32_tensor(logits, "logits")?,
        pen_buf.binding(),
        storage(out, "drawn tokens")?.binding(),
        record_buf.binding(),
    ];
    let kernel = b.kernel(&SAMPLE_ROWS, &[])?;
    b.stream.dispatch(
        &kernel,
        &bindings,
        &[count(vocab, what)?],
        (count(draws.len(), what)?, 1, 1),
    )
}

/// `slot`'s buffer, replaced by one twice the size when it holds fewer than `bytes`
/// (kept, so that a step's bindings stay the same and their bind group is reused).
fn grown<'a>(
    b: &WgpuBackend,
    slot: &'a mut Option<WgpuStorage>,
    bytes: usize,
) -> Result<&'a WgpuStorage> {
    if slot
        .as_ref()
        .is_none_or(|s| (s.bytes as usize) < bytes.max(4))
    {
        *slot = Some(b.alloc(bytes.max(4) * 2)?);
    }
    Ok(slot.as_ref().expect("made above"))
}
