//! `kiln perplexity`: llama.cpp's method, so that figures compare with
//! `llama-perplexity`'s: tokenize the whole text (with BOS when the tokenizer adds one),
//! cut it into chunks of `ctx` tokens, make each chunk's first token BOS (when the
//! tokenizer adds one), and score only the second half of each chunk.

use crate::console::{CliResult, Failure};
use crate::model_file::{self, DeviceChoice};
use kiln_core::DType;
use kiln_models::perplexity;
use kiln_tokenizer::Tokenizer;
use std::io::IsTerminal;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct PerplexityArgs {
    #[arg(short = 'm', long)]
    pub model: PathBuf,
    /// The text file to score.
    #[arg(short = 'f', long)]
    pub file: PathBuf,
    /// Chunk size in tokens (0: the model's context).
    #[arg(short = 'c', long = "ctx-size", default_value_t = 512, value_parser = model_file::context_arg, allow_hyphen_values = true)]
    pub ctx: usize,
    /// Score at most this many chunks (all when not given); the text after them is not
    /// even tokenized.
    #[arg(long)]
    pub chunks: Option<usize>,
    #[arg(long, default_value_t = DeviceChoice::Auto)]
    pub device: DeviceChoice,
    #[arg(long, value_parser = model_file::kv_type_arg, help = model_file::KV_TYPE_HELP)]
    pub kv_type: Option<DType>,
    #[arg(short = 't', long)]
    pub threads: Option<usize>,
}

/// Text is tokenized in pieces of about this many bytes: a tokenizer's working memory
/// grows with the text it is given (tens of bytes per byte), the ids only by 4 bytes a
/// token.
const PIECE_BYTES: usize = 1 << 20;

/// Where the piece starting at `from` ends: after a newline that a non-space character
/// follows, where whole-text tokenization splits too (pre-tokenizers cut there); at a
/// character boundary when no such newline comes soon.
fn piece_end(text: &str, from: usize) -> usize {
    let min = from + PIECE_BYTES;
    if min >= text.len() {
        return text.len();
    }
    let bytes = text.as_bytes();
    let search_end = (min + PIECE_BYTES).min(text.len() - 1);
    (min..search_end)
        .find(|&i| bytes[i] == b'\n' && !bytes[i + 1].is_ascii_whitespace())
        .map(|i| i + 1)
        .unwrap_or_else(|| {
            (min..=text.len())
                .find(|&i| text.is_char_boundary(i))
                .unwrap_or(text.len())
        })
}

/// Token ids of `text` (BOS first when the tokenizer adds one), stopping once `limit`
/// ids are there. Texts longer than one piece are tokenized a piece at a time; with a
/// SentencePiece tokenizer that adds a dummy-prefix space, each piece after the first
/// starts with one, a token of difference per megabyte from tokenizing the whole text.
fn tokenize(
    tokenizer: &Tokenizer,
    text: &str,
    limit: Option<usize>,
) -> kiln_core::Result<Vec<u32>> {
    let mut ids = Vec::new();
    if tokenizer.add_bos() {
        ids.extend(tokenizer.bos_id());
    }
    let mut from = 0;
    while from < text.len() && limit.is_none_or(|l| ids.len() < l) {
        let end = piece_end(text, from);
        ids.extend(tokenizer.encode(&text[from..end], false)?);
        from = end;
    }
    if from == text.len() && tokenizer.add_eos() {
        ids.extend(tokenizer.eos_ids().first());
    }
    if let Some(l) = limit {
        ids.truncate(l);
    }
    Ok(ids)
}

/// Progress after each chunk: rewritten in place on a terminal; otherwise about ten
/// lines in all, so that a log does not grow with the number of chunks.
struct Progress {
    total: usize,
    terminal: bool,
    quiet: bool,
}

impl Progress {
    fn chunk(&self, i: usize, running: f64) {
        let done = i + 1;
        if self.quiet {
            return;
        }
        if self.terminal {
            eprint!("\r[{done}/{}] PPL {running:.4}", self.total);
        } else if done.is_multiple_of(self.total.div_ceil(10).max(1)) || done == self.total {
            eprintln!("[{done}/{}] PPL {running:.4}", self.total);
        }
    }
}

pub fn run(a: PerplexityArgs, quiet: bool) -> CliResult {
    let text = kiln_io::file::read_to_string(&a.file, kiln_io::file::FileKind::TEXT)?;
    let backend = model_file::backend(a.device, a.threads)?;
    let file = model_file::open(Some(&a.model))?;
    let ctx = model_file::context_size(Some(a.ctx), file.config(), &file.name, usize::MAX)?;
    let kv_type = model_file::kv_type(a.kv_type, backend.as_ref(), file.config(), &file.name)?;
    if ctx < 4 {
        return Err(Failure::usage(format!(
            "--ctx-size {ctx}: perplexity needs chunks of at least 4 tokens"
        )));
    }
    if a.chunks == Some(0) {
        return Err(Failure::usage("--chunks 0: score at least one chunk"));
    }
    let limit = a.chunks.map(|n| n.saturating_mul(ctx));
    let tokens = tokenize(&file.tokenizer, &text, limit)?;
    drop(text);
    if tokens.len() < 2 * ctx {
        return Err(Failure::usage(format!(
            "-f {}: {} tokens; perplexity with --ctx-size {ctx} needs at least {} (two chunks)",
            a.file.display(),
            tokens.len(),
            2 * ctx
        )));
    }
    let plan = file.plan(backend.as_ref(), ctx, true, kv_type);
    let mut model = file.load(backend, &plan, ctx, "--ctx-size")?;
    let bos = file
        .tokenizer
        .add_bos()
        .then(|| file.tokenizer.bos_id())
        .flatten();
    let progress = Progress {
        total: tokens.len() / ctx,
        terminal: std::io::stderr().is_terminal(),
        quiet,
    };
    let start = std::time::Instant::now();
    let p = perplexity(&mut model, &tokens, ctx, bos, kv_type, |i, running| {
        progress.chunk(i, running)
    })?;
    if progress.terminal && !quiet {
        eprintln!();
    }
    if !quiet {
        eprintln!(
            "{} chunks of {ctx} tokens, {} scored, KV cache {kv_type}, {:.2} s",
            p.chunks,
            p.scored,
            start.elapsed().as_secs_f64()
        );
    }
    let result = format!("PPL = {:.6} +/- {:.6}\n", p.ppl, p.error);
    crate::console::stream(&mut std::io::stdout().lock(), &result);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_end_after_a_newline_before_text_and_cover_the_text() {
        let line = "word ".repeat(50) + "\n";
        let text = line.repeat(3 * PIECE_BYTES / line.len());
        let mut from = 0;
        let mut pieces = 0;
        while from < text.len() {
            let end = piece_end(&text, from);
            assert!(end > from);
            assert!(end == text.len() || text.as_bytes()[end - 1] == b'\n');
            from = end;
            pieces += 1;
        }
        assert_eq!(from, text.len());
        assert!((2..=4).contains(&pieces), "{pieces}");
        // No newline at all: cut at a character boundary.
        let text = "é".repeat(PIECE_BYTES);
        let end = piece_end(&text, 0);
        assert!(text.is_char_boundary(end) && end >= PIECE_BYTES);
    }
}
