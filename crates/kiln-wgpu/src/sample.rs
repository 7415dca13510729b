//! Drawing the next token on the GPU (shaders/sample.wgsl), so that only its id is read
//! back. Top-k up to [`MAX_TOP_K`] (llama.cpp's default is 40) runs on the device, a
//! server's batch in one dispatch and one read-back; top-k off or larger falls back to the
//! host reference, reading the logits back (row by row).

use crate::elementwise::count;
use crate::kernels::{SAMPLE, SAMPLE_ROWS};
use crate::{f32_tensor, memory, storage, WgpuBackend, WgpuStorage};
use kiln_core::backend::{check_row_draws, sample_rows_one_by_one, token_ids};
use kiln_core::{Backend, DType, Error, Result, RowDraw, SampleParams, Shape, Tensor};

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
    let Some((top_k, [penalty, top_p, min_p, temperature, draw])) = shader_draw(params, vocab)
    else {
        return Ok(false);
    };
    let ids = penalized_bytes(penalized, vocab);
    let what = "sampling";
    let mut scratch = b.penalized.lock().unwrap();
    let pen = grown(b, &mut scratch, ids.len())?;
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
            penalty.to_bits(),
            top_k,
            top_p.to_bits(),
            min_p.to_bits(),
            temperature.to_bits(),
            draw.to_bits(),
        ],
        (1, 1, 1),
    )?;
    Ok(true)
}

/// The shader's top-k and settings (penalty, top-p, min-p, temperature, draw) for
/// `params`: greedy (with a penalty, or the caller would have used argmax) is top-1;
/// `None` where the host draws (top-k off or past [`MAX_TOP_K`]).
fn shader_draw(params: &SampleParams, vocab: usize) -> Option<(u32, [f32; 5])> {
    let greedy = params.temperature <= 0.0;
    let top_k = if greedy { 1 } else { params.top_k.min(vocab) };
    if top_k == 0 || top_k > MAX_TOP_K {
        return None;
    }
    let settings = match greedy {
        true => [params.repeat_penalty, 1.0, 0.0, 1.0, params.draw as f32],
        false => [
            params.repeat_penalty,
            params.top_p,
            params.min_p,
            params.temperature,
            params.draw as f32,
        ],
    };
    Some((top_k as u32, settings))
}

/// The penalized ids inside the vocabulary, as the shader's i32.
fn penalized_bytes(penalized: &[u32], vocab: usize) -> Vec<u8> {
    penalized
        .iter()
        .filter(|&&t| (t as usize) < vocab)
        .flat_map(|&t| (t as i32).to_le_bytes())
        .collect()
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

/// Every draw of a batch the shader can make in one dispatch (a workgroup a draw) and one
/// read-back of the ids; the others row by row through the host reference.
pub(crate) fn sample_rows(
    b: &WgpuBackend,
    logits: &mut Tensor,
    draws: &[RowDraw<'_>],
) -> Result<Vec<u32>> {
    check_row_draws(logits, draws)?;
    let vocab = logits.shape().row_len();
    let what = "sampling a batch";
    let (on_device, on_host): (Vec<usize>, Vec<usize>) =
        (0..draws.len()).partition(|&i| shader_draw(draws[i].params, vocab).is_some());
    let mut ids = vec![0u32; draws.len()];
    if !on_device.is_empty() {
        let n = on_device.len();
        let mut pen = Vec::new();
        let mut records: Vec<u32> = Vec::with_capacity(10 * n);
        for &i in &on_device {
            let d = &draws[i];
            let (top_k, [penalty, top_p, min_p, temperature, draw]) =
                shader_draw(d.params, vocab).expect("partitioned above");
            let ids = penalized_bytes(d.penalized, vocab);
            records.extend([
                count(d.row * vocab, what)?,
                count(pen.len() / 4, what)?,
                count(ids.len() / 4, what)?,
                penalty.to_bits(),
                top_k,
                top_p.to_bits(),
                min_p.to_bits(),
                temperature.to_bits(),
                draw.to_bits(),
                0,
            ]);
            pen.extend(ids);
        }
        let record_bytes: Vec<u8> = records.iter().flat_map(|w| w.to_le_bytes()).collect();
        let mut pen_slot = b.penalized.lock().unwrap();
        let pen_buf = grown(b, &mut pen_slot, pen.len())?;
        memory::write(&b.stream, pen_buf, &pen)?;
        let mut slot = b.draws.lock().unwrap();
        if slot.as_ref().is_none_or(|(r, out)| {
            (r.bytes as usize) < record_bytes.len() || out.shape().numel() < n
        }) {
            *slot = Some((
                b.alloc(record_bytes.len() * 2)?,
                b.zeros(DType::I32, Shape::new(vec![2 * n])?)?,
            ));
        }
        let (record_buf, out) = slot.as_ref().expect("made above");
        memory::write(&b.stream, record_buf, &record_bytes)?;
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
            (count(n, what)?, 1, 1),
        )?;
        let got = token_ids(&b.download(out)?[..4 * n])?;
        for (&i, id) in on_device.iter().zip(got) {
            ids[i] = id;
        }
    }
    if !on_host.is_empty() {
        let rest: Vec<RowDraw<'_>> = on_host.iter().map(|&i| draws[i]).collect();
        for (&i, id) in on_host
            .iter()
            .zip(sample_rows_one_by_one(b, logits, &rest)?)
        {
            ids[i] = id;
        }
    }
    Ok(ids)
}
