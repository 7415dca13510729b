//! Perplexity by llama.cpp's method (`llama-perplexity`), so that figures compare: cut the
//! tokens into chunks of `ctx`, make each chunk's first token BOS (when given), run each
//! chunk from an empty cache, and score only the second half of each chunk (logits at
//! `ctx/2 .. ctx-2` against the next token).

use crate::model::{Logits, Model};
use kiln_core::{DType, Error, Result};

pub struct Perplexity {
    pub ppl: f64,
    /// llama.cpp's uncertainty estimate: ppl · stddev(NLL) / sqrt(n - 1).
    pub error: f64,
    pub chunks: usize,
    pub scored: usize,
}

/// `on_chunk(i, running_ppl)` is called after each chunk; keys and values are kept as
/// `kv` (see [`crate::check_kv_type`]).
pub fn perplexity(
    model: &mut Model,
    tokens: &[u32],
    ctx: usize,
    bos: Option<u32>,
    kv: DType,
    mut on_chunk: impl FnMut(usize, f64),
) -> Result<Perplexity> {
    if ctx < 4 {
        return Err(Error::shape(format!(
            "a context of {ctx} tokens is too small"
        )));
    }
    if tokens.len() < 2 * ctx {
        return Err(Error::shape(format!(
            "{} tokens; perplexity with a context of {ctx} needs at least {}",
            tokens.len(),
            2 * ctx
        )));
    }
    let vocab = model.config.vocab_size;
    let first = ctx / 2;
    let mut cache = model.new_cache(ctx, kv)?;
    let (mut nll, mut nll2, mut count) = (0f64, 0f64, 0usize);
    let chunks = tokens.len() / ctx;
    for (i, chunk) in tokens.chunks_exact(ctx).enumerate() {
        let mut ids = chunk.to_vec();
        if let Some(b) = bos {
            ids[0] = b;
        }
        let logits = model.forward(&ids, 0, &mut cache, Logits::All)?;
        for pos in first..ctx - 1 {
            let row = &logits[pos * vocab..(pos + 1) * vocab];
            let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
            let lse = row
                .iter()
                .map(|&v| (v as f64 - max).exp())
                .sum::<f64>()
                .ln()
                + max;
            let lp = row[ids[pos + 1] as usize] as f64 - lse;
            nll -= lp;
            nll2 += lp * lp;
            count += 1;
        }
        on_chunk(i, (nll / count as f64).exp());
    }
    let mean = nll / count as f64;
    let var = (nll2 / count as f64 - mean * mean).max(0.0);
    let ppl = mean.exp();
    Ok(Perplexity {
        ppl,
        error: ppl * (var / (count.max(2) - 1) as f64).sqrt(),
        chunks,
        scored: count,
    })
}
