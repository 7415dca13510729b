//! The backward of attention over a paged pool (several sequences trained in one forward
//! pass), composed of the contiguous one: each sequence's queries and the keys and values
//! its block table names are copied out, [`GradOps::attention_backward`] runs on them as
//! on one sequence's cache, and the gradients go back to the rows they came from. No
//! backend needs a paged backward kernel; the cost is a copy of each sequence's rows. A
//! backend with [`GradOps::attention_backward_runs`] (CUDA) runs the sequences in place
//! instead where each one's keys lie in one span of the pool, as training's do.
//!
//! The block tables, the rows' sequences and their positions are read back to the host
//! once per call: the copies are planned there.

use std::ops::Range;

use kiln_core::{
    AttentionParams, AttentionRun, AttentionSaved, Backend, DType, Error, GradInto, GradOps, Pages,
    Result, Shape, Tensor,
};

/// Rows of a tensor as (first row, rows) pieces.
type Spans = Vec<(usize, usize)>;

fn ints(b: &dyn Backend, t: &Tensor, what: &str) -> Result<Vec<i32>> {
    if t.dtype() != DType::I32 {
        return Err(Error::shape(format!(
            "{what} must be I32, got {}",
            t.dtype()
        )));
    }
    Ok(b.download(t)?
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

fn f32_zeros(b: &dyn Backend, dims: &[usize]) -> Result<Tensor> {
    b.zeros(DType::F32, Shape::new(dims.to_vec())?)
}

/// Rows `[at, at + rows)` of `src` (rows of `width` elements) copied into a new tensor of
/// `dims`.
fn rows_of(
    b: &dyn Backend,
    g: &dyn GradOps,
    src: &Tensor,
    spans: &[(usize, usize)],
    width: usize,
    dims: &[usize],
) -> Result<Tensor> {
    let mut t = f32_zeros(b, dims)?;
    let mut at = 0;
    for &(row, rows) in spans {
        g.copy_span(src, row * width, &mut t, at * width, rows * width)?;
        at += rows;
    }
    Ok(t)
}

/// The inverse of [`rows_of`]: `t`'s rows written back over `dst`'s spans.
fn put_rows(
    g: &dyn GradOps,
    t: &Tensor,
    dst: &mut Tensor,
    spans: &[(usize, usize)],
    width: usize,
) -> Result<()> {
    let mut at = 0;
    for &(row, rows) in spans {
        g.copy_span(t, at * width, dst, row * width, rows * width)?;
        at += rows;
    }
    Ok(())
}

/// The pool rows holding positions `0..reach` of the sequence whose block table is
/// `table`, as (first row, rows) spans, consecutive blocks merged.
fn key_spans(
    table: &[i32],
    block: usize,
    reach: usize,
    pool_rows: usize,
) -> Result<Vec<(usize, usize)>> {
    let mut spans: Vec<(usize, usize)> = Vec::new();
    for (i, &id) in table.iter().enumerate().take(reach.div_ceil(block)) {
        let row = usize::try_from(id)
            .ok()
            .and_then(|id| id.checked_mul(block))
            .filter(|&r| r + block <= pool_rows)
            .ok_or_else(|| {
                Error::shape(format!(
                    "paged attention gradient: block {id} is outside a pool of {pool_rows} rows"
                ))
            })?;
        let rows = block.min(reach - i * block);
        match spans.last_mut() {
            Some((r, n)) if *r + *n == row => *n += rows,
            _ => spans.push((row, rows)),
        }
    }
    Ok(spans)
}

/// `dq`, `dk`, `dv` (the pools' gradients) += the gradient of
/// [`Backend::paged_attention`]`(q, k_pool, v_pool, pos, pages, params)` given `dout`
/// (`kept`: what the forward kept, when it could; see [`AttentionSaved`]); each gradient
/// as its [`GradInto`] says.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_backward(
    b: &dyn Backend,
    g: &dyn GradOps,
    [q, k_pool, v_pool]: [&Tensor; 3],
    pos: &Tensor,
    pages: &Pages,
    params: &AttentionParams,
    kept: Option<AttentionSaved>,
    dout: &Tensor,
    [dq, dk, dv]: [&mut Tensor; 3],
    into: [GradInto; 3],
) -> Result<()> {
    let (&[n, heads, d], &[pool_rows, kv_heads, kd]) = (q.dims(), k_pool.dims()) else {
        return Err(Error::shape(format!(
            "paged attention gradient: q {}, pool {}",
            q.shape(),
            k_pool.shape()
        )));
    };
    let &[sequences, max_blocks] = pages.tables.dims() else {
        return Err(Error::shape(format!(
            "block tables must be [sequences, max_blocks], got {}",
            pages.tables.shape()
        )));
    };
    if kd != d
        || v_pool.dims() != k_pool.dims()
        || dk.dims() != k_pool.dims()
        || dv.dims() != k_pool.dims()
        || dq.dims() != q.dims()
        || dout.dims() != q.dims()
        || pages.runs.iter().sum::<usize>() != n
        || pages.block == 0
    {
        return Err(Error::shape(format!(
            "paged attention gradient: q {}, pools {}, runs of {} rows in blocks of {}",
            q.shape(),
            k_pool.shape(),
            pages.runs.iter().sum::<usize>(),
            pages.block
        )));
    }
    let pos_t = pos;
    let (pos, seq, tables) = (
        ints(b, pos, "attention positions")?,
        ints(b, pages.seq, "query sequences")?,
        ints(b, pages.tables, "block tables")?,
    );
    if pos.len() != n || seq.len() != n {
        return Err(Error::shape(format!(
            "paged attention gradient: {} positions and {} sequences for {n} queries",
            pos.len(),
            seq.len()
        )));
    }
    // Each run's rows, and the pool rows of its keys (positions 0..reach).
    let mut plans: Vec<(Range<usize>, Spans)> = Vec::new();
    let mut r0 = 0;
    for &len in pages.runs {
        let rows = r0..r0 + len;
        r0 += len;
        let s = seq[rows.start];
        if seq[rows.clone()].iter().any(|&x| x != s) {
            return Err(Error::shape(format!(
                "paged attention gradient: rows {rows:?} are one run but not one sequence"
            )));
        }
        let table = usize::try_from(s)
            .ok()
            .filter(|&s| s < sequences)
            .map(|s| &tables[s * max_blocks..][..max_blocks])
            .ok_or_else(|| Error::shape(format!("query sequence {s} has no block table")))?;
        let reach = pos[rows.clone()]
            .iter()
            .map(|&p| p.max(0) as usize + 1)
            .max()
            .unwrap_or(0);
        if reach > max_blocks * pages.block {
            return Err(Error::shape(format!(
                "paged attention gradient: position {} is past its table's {} positions",
                reach - 1,
                max_blocks * pages.block
            )));
        }
        plans.push((rows, key_spans(table, pages.block, reach, pool_rows)?));
    }
    // Gradients begin here written where all three do; elsewhere the new ones start as
    // zeros and everything adds.
    let into = match into {
        [GradInto::Write, GradInto::Write, GradInto::Write] => GradInto::Write,
        _ => {
            for (t, into) in [
                (&mut *dq, into[0]),
                (&mut *dk, into[1]),
                (&mut *dv, into[2]),
            ] {
                if into == GradInto::Write {
                    b.fill(t, 0.0)?;
                }
            }
            GradInto::Add
        }
    };
    // Where every sequence's keys lie in one span (training's: a block of seq_len each),
    // the backend may run the runs in place.
    if plans.iter().all(|(_, keys)| keys.len() == 1) {
        let runs: Vec<AttentionRun> = plans
            .iter()
            .map(|(rows, keys)| AttentionRun {
                rows: (rows.start, rows.len()),
                keys: keys[0],
            })
            .collect();
        if g.attention_backward_runs(
            q, k_pool, v_pool, pos_t, &runs, params, kept, dout, dq, dk, dv, into,
        )? {
            return Ok(());
        }
    }
    if into == GradInto::Write {
        for t in [&mut *dq, &mut *dk, &mut *dv] {
            b.fill(t, 0.0)?;
        }
    }
    // Rows are copied out and back as F32 below: inputs the tape kept rounded (16-bit
    // products) go only to a backend's runs in place, as training's pool always allows.
    if [q, k_pool, v_pool].iter().any(|t| t.dtype() != DType::F32) {
        return Err(Error::unsupported(
            "a paged attention gradient over rounded inputs whose keys are not one span of the pool",
        ));
    }
    let (q_width, kv_width) = (heads * d, kv_heads * d);
    for (rows, keys) in plans {
        let len = rows.len();
        let reach = keys.iter().map(|k| k.1).sum();
        let own = [(rows.start, len)];
        let q_dims = [len, heads, d];
        let kv_dims = [reach, kv_heads, d];
        let q_s = rows_of(b, g, q, &own, q_width, &q_dims)?;
        let dout_s = rows_of(b, g, dout, &own, q_width, &q_dims)?;
        let k_s = rows_of(b, g, k_pool, &keys, kv_width, &kv_dims)?;
        let v_s = rows_of(b, g, v_pool, &keys, kv_width, &kv_dims)?;
        // The gradients so far, which the contiguous backward adds to.
        let mut dq_s = rows_of(b, g, dq, &own, q_width, &q_dims)?;
        let mut dk_s = rows_of(b, g, dk, &keys, kv_width, &kv_dims)?;
        let mut dv_s = rows_of(b, g, dv, &keys, kv_width, &kv_dims)?;
        let mut pos_s = b.zeros(DType::I32, Shape::new(vec![len])?)?;
        let pos_bytes: Vec<u8> = pos[rows].iter().flat_map(|p| p.to_le_bytes()).collect();
        b.write(&mut pos_s, &pos_bytes)?;
        g.attention_backward(
            &q_s, &k_s, &v_s, &pos_s, params, &dout_s, &mut dq_s, &mut dk_s, &mut dv_s,
        )?;
        put_rows(g, &dq_s, dq, &own, q_width)?;
        put_rows(g, &dk_s, dk, &keys, kv_width)?;
        put_rows(g, &dv_s, dv, &keys, kv_width)?;
    }
    Ok(())
}
