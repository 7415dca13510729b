//! `kiln perplexity`: llama.cpp's method, so that figures compare with
//! `llama-perplexity`'s: tokenize the whole text (with BOS when the tokenizer adds one),
//! cut it into chunks of `ctx` tokens, make each chunk's first token BOS (when the
//! tokenizer adds one), and score only the second half of each chunk.

use crate::model_file::{self, DeviceChoice};
use kiln_core::{Error, Result};
use kiln_models::perplexity;
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
    if ctx > model.config.max_positions && model.config.rope.is_none() {
        return Err(Error::shape(format!(
            "--ctx-size {ctx} exceeds the model's {} positions",
            model.config.max_positions
        )));
    }
    let tokens = tokenizer.encode(&text, true)?;
    let bos = tokenizer.add_bos().then(|| tokenizer.bos_id()).flatten();
    let start = std::time::Instant::now();
    let mut line = String::new();
    let p = perplexity(&mut model, &tokens, ctx, bos, |i, running| {
        line += &format!("[{}]{running:.4},", i + 1);
        eprint!("\r{line}");
    })
    .map_err(|e| Error::shape(format!("{}: {e}", a.file.display())))?;
    eprintln!();
    eprintln!(
        "{} chunks of {ctx} tokens, {} scored, {:.2} s",
        p.chunks,
        p.scored,
        start.elapsed().as_secs_f64()
    );
    println!("PPL = {:.6} +/- {:.6}", p.ppl, p.error);
    Ok(())
}
