//! `kiln perplexity`: llama.cpp's method, so that figures compare with
//! `llama-perplexity`'s: tokenize the whole text (with BOS when the tokenizer adds one),
//! cut it into chunks of `ctx` tokens, make each chunk's first token BOS (when the
//! tokenizer adds one), and score only the second half of each chunk.

use crate::model_file::{self, DeviceChoice};
use kiln_core::{Error, Result};
use kiln_models::Logits;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct PerplexityArgs {
    #[arg(short = 'm', long)]
    pub model: PathBuf,
    /// The text file to score.
    #[arg(short = 'f', long)]
    pub file: PathBuf,
    /// Chunk size in tokens.
    #[arg(short = 'c', long = "ctx-size", default_value_t = 512)]
    pub ctx: usize,
    #[arg(long, value_enum, default_value_t = DeviceChoice::Auto)]
    pub device: DeviceChoice,
    #[arg(short = 't', long)]
    pub threads: Option<usize>,
}

pub fn run(a: PerplexityArgs) -> Result<()> {
    let text = std::fs::read_to_string(&a.file).map_err(|e| Error::io(a.file.display(), e))?;
    let backend = model_file::backend(a.device, a.threads)?;
    let (mut model, tokenizer) = model_file::open(&a.model, backend)?;
    let ctx = a.ctx;
    if ctx < 4 {
        return Err(Error::shape(format!("--ctx-size {ctx} is too small")));
    }
    if ctx > model.config.max_positions && model.config.rope.is_none() {
        return Err(Error::shape(format!(
            "--ctx-size {ctx} exceeds the model's {} positions",
            model.config.max_positions
        )));
    }
    let tokens = tokenizer.encode(&text, true)?;
    if tokens.len() < 2 * ctx {
        return Err(Error::shape(format!(
            "{}: {} tokens; perplexity with a context of {ctx} needs at least {}",
            a.file.display(),
            tokens.len(),
            2 * ctx
        )));
    }
    let n_chunks = tokens.len() / ctx;
    let bos = tokenizer.add_bos().then(|| tokenizer.bos_id()).flatten();
    let vocab = model.config.vocab_size;
    let first = ctx / 2;
    let mut cache = model.new_cache(ctx)?;
    let (mut nll, mut nll2, mut count) = (0f64, 0f64, 0usize);
    let start = std::time::Instant::now();
    let mut line = String::new();
    for chunk in 0..n_chunks {
        let mut ids = tokens[chunk * ctx..(chunk + 1) * ctx].to_vec();
        if let Some(bos) = bos {
            ids[0] = bos;
        }
        let logits = model.forward(&ids, 0, &mut cache, Logits::All)?;
        for pos in first..ctx - 1 {
            let row = &logits[pos * vocab..(pos + 1) * vocab];
            let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
            let sum: f64 = row.iter().map(|&v| (v as f64 - max).exp()).sum();
            let target = ids[pos + 1] as usize;
            let lp = row[target] as f64 - max - sum.ln();
            nll -= lp;
            nll2 += lp * lp;
            count += 1;
        }
        line += &format!("[{}]{:.4},", chunk + 1, (nll / count as f64).exp());
        eprint!("\r{line}");
    }
    eprintln!();
    let mean = nll / count as f64;
    let var = (nll2 / count as f64 - mean * mean).max(0.0);
    let ppl = mean.exp();
    // The error estimate llama.cpp prints: ppl · stddev of the NLL over sqrt(n - 1).
    let err = ppl * (var / (count.max(2) - 1) as f64).sqrt();
    eprintln!(
        "{n_chunks} chunks of {ctx} tokens, {count} scored, {:.2} s",
        start.elapsed().as_secs_f64()
    );
    println!("PPL = {ppl:.6} +/- {err:.6}");
    Ok(())
}
