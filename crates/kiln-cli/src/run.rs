//! `kiln run`: generate text from a prompt.

use crate::model_file::{self, DeviceChoice};
use kiln_core::{Error, Result};
use kiln_models::chat::Message;
use kiln_models::{generate, GenerateOptions, Sampler, SamplerConfig};
use std::io::Write;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct RunArgs {
    /// Model: a .gguf file or a Hugging Face directory (default: the embedded model).
    #[arg(short = 'm', long)]
    pub model: Option<PathBuf>,
    /// The prompt.
    #[arg(short = 'p', long)]
    pub prompt: String,
    /// Tokens to generate.
    #[arg(short = 'n', long = "n-predict", default_value_t = 128)]
    pub n_predict: usize,
    /// Temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.8, value_parser = non_negative)]
    pub temp: f32,
    /// Keep the k most likely tokens; 0 keeps all.
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    /// Keep the most likely tokens up to this much probability; 1 keeps all.
    #[arg(long, default_value_t = 0.95, value_parser = probability)]
    pub top_p: f32,
    /// Drop tokens less likely than this share of the most likely one; 0 keeps all.
    #[arg(long, default_value_t = 0.05, value_parser = probability)]
    pub min_p: f32,
    /// Divide the logits of recent tokens by this (multiply when negative); 1 is off.
    #[arg(long, default_value_t = 1.0, value_parser = positive)]
    pub repeat_penalty: f32,
    /// Random seed (default: from the clock).
    #[arg(short = 's', long)]
    pub seed: Option<u64>,
    /// Stop when this text appears (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
    /// Context size in tokens (default: the model's, at most 4096).
    #[arg(short = 'c', long = "ctx-size")]
    pub ctx_size: Option<usize>,
    #[arg(long, value_enum, default_value_t = DeviceChoice::Auto)]
    pub device: DeviceChoice,
    #[arg(short = 't', long)]
    pub threads: Option<usize>,
    /// Wrap the prompt in the model's chat template as one user turn.
    #[arg(long)]
    pub chat: bool,
    /// `json`: print one JSON object (prompt and generated ids, text, timings) at the end.
    #[arg(short = 'o', long, value_enum, default_value_t = Output::Text)]
    pub output: Output,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    Text,
    Json,
}

pub fn run(a: RunArgs) -> Result<()> {
    let backend = model_file::backend(a.device, a.threads)?;
    let (mut model, tokenizer) = match &a.model {
        Some(path) => model_file::open(path, backend)?,
        None => model_file::open_default(backend)?,
    };
    let model_name = a
        .model
        .as_ref()
        .map_or("the default model".to_string(), |p| p.display().to_string());
    let prompt = if a.chat {
        let template = tokenizer.chat_template().ok_or_else(|| {
            Error::unsupported(format!("{model_name}: the model has no chat template"))
        })?;
        let text_of = |id: Option<u32>| {
            id.and_then(|id| tokenizer.token_text(id))
                .unwrap_or("")
                .to_string()
        };
        let bos = text_of(tokenizer.bos_id());
        let eos = text_of(tokenizer.eos_ids().first().copied());
        let user = [Message {
            role: "user".into(),
            content: a.prompt.clone(),
        }];
        let text = kiln_models::chat::render(template, &user, &bos, &eos)?;
        // The template writes BOS itself when the model wants one.
        tokenizer.encode_with_special_tokens(&text, false)?
    } else {
        tokenizer.encode(&a.prompt, true)?
    };
    let context = a
        .ctx_size
        .unwrap_or_else(|| model.config.max_positions.min(4096));
    if context > model.config.max_positions && model.config.rope.is_none() {
        return Err(Error::shape(format!(
            "--ctx-size {context} exceeds the {} positions this model has embeddings for",
            model.config.max_positions
        )));
    }
    let seed = a.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0)
    });
    let mut sampler = Sampler::new(SamplerConfig {
        temperature: a.temp,
        top_k: a.top_k,
        top_p: a.top_p,
        min_p: a.min_p,
        repeat_penalty: a.repeat_penalty,
        seed,
        ..Default::default()
    });
    let opts = GenerateOptions {
        max_tokens: a.n_predict,
        context,
        stop_strings: &a.stop,
    };
    let streaming = a.output == Output::Text;
    let mut stdout = std::io::stdout().lock();
    if streaming && !a.chat {
        let _ = write!(stdout, "{}", a.prompt);
        let _ = stdout.flush();
    }
    let g = generate(
        &mut model,
        &tokenizer,
        &prompt,
        &mut sampler,
        &opts,
        |piece| {
            if streaming {
                let _ = write!(stdout, "{piece}");
                let _ = stdout.flush();
            }
        },
    )?;
    let pp = g.prompt_tokens.len() as f64 / g.prompt_time.as_secs_f64().max(1e-9);
    let tg = g.tokens.len() as f64 / g.gen_time.as_secs_f64().max(1e-9);
    if streaming {
        let _ = writeln!(stdout);
        eprintln!(
            "\nprompt: {} tokens, {:.1} ms, {pp:.1} tokens/s | generation: {} tokens, {:.1} ms, {tg:.1} tokens/s | stop: {:?}",
            g.prompt_tokens.len(),
            g.prompt_time.as_secs_f64() * 1e3,
            g.tokens.len(),
            g.gen_time.as_secs_f64() * 1e3,
            g.stop
        );
    } else {
        let json = serde_json::json!({
            "prompt_tokens": g.prompt_tokens,
            "tokens": g.tokens,
            "text": g.text,
            "stop": format!("{:?}", g.stop).to_lowercase(),
            "timings": {
                "prompt_ms": g.prompt_time.as_secs_f64() * 1e3,
                "prompt_tokens_per_s": pp,
                "generation_ms": g.gen_time.as_secs_f64() * 1e3,
                "generation_tokens_per_s": tg,
            }
        });
        let _ = writeln!(stdout, "{json}");
    }
    Ok(())
}

fn number(s: &str) -> Result<f32, String> {
    let v: f32 = s.parse().map_err(|_| format!("{s:?} is not a number"))?;
    if v.is_finite() {
        Ok(v)
    } else {
        Err(format!("{s} is not a finite number"))
    }
}

fn non_negative(s: &str) -> Result<f32, String> {
    number(s).and_then(|v| {
        if v >= 0.0 {
            Ok(v)
        } else {
            Err(format!("{v} is below 0"))
        }
    })
}

fn positive(s: &str) -> Result<f32, String> {
    number(s).and_then(|v| {
        if v > 0.0 {
            Ok(v)
        } else {
            Err(format!("{v} is not above 0"))
        }
    })
}

fn probability(s: &str) -> Result<f32, String> {
    number(s).and_then(|v| {
        if (0.0..=1.0).contains(&v) {
            Ok(v)
        } else {
            Err(format!("{v} is not between 0 and 1"))
        }
    })
}
