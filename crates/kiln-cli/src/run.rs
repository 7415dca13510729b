//! `kiln run`: generate text from a prompt.

use crate::console::{self, CliResult, Failure};
use crate::model_file::{self, DeviceChoice};
use crate::run_tp;
use kiln_core::DType;
use kiln_models::chat::Message;
use kiln_models::{generate, GenerateOptions, Sampler, SamplerConfig};
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

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
    #[arg(long, default_value_t = 0.8, value_parser = non_negative, allow_hyphen_values = true)]
    pub temp: f32,
    /// Keep the k most likely tokens; 0 keeps all.
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    /// Keep the most likely tokens up to this much probability; 1 keeps all.
    #[arg(long, default_value_t = 0.95, value_parser = probability, allow_hyphen_values = true)]
    pub top_p: f32,
    /// Drop tokens less likely than this share of the most likely one; 0 keeps all.
    #[arg(long, default_value_t = 0.05, value_parser = probability, allow_hyphen_values = true)]
    pub min_p: f32,
    /// Divide the logits of recent tokens by this (multiply when negative); 1 is off.
    #[arg(long, default_value_t = 1.0, value_parser = positive, allow_hyphen_values = true)]
    pub repeat_penalty: f32,
    /// Random seed (default: from the clock).
    #[arg(short = 's', long)]
    pub seed: Option<u64>,
    /// Stop when this text appears (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
    /// Context size in tokens (default: the model's, at most 4096; 0: the model's).
    #[arg(short = 'c', long = "ctx-size", value_parser = model_file::context_arg, allow_hyphen_values = true)]
    pub ctx_size: Option<usize>,
    #[arg(long, default_value_t = DeviceChoice::Auto)]
    pub device: DeviceChoice,
    #[arg(long, value_parser = model_file::kv_type_arg, help = model_file::KV_TYPE_HELP)]
    pub kv_type: Option<DType>,
    #[arg(short = 't', long)]
    pub threads: Option<usize>,
    /// Wrap the prompt in the model's chat template as one user turn.
    #[arg(long)]
    pub chat: bool,
    /// `json`: print one JSON object (prompt and generated ids, text, timings) at the end.
    #[arg(short = 'o', long, value_enum, default_value_t = Output::Text)]
    pub output: Output,
    /// Split the model over this many ranks (tensor parallelism, the LLaMA family): GPUs
    /// cuda:0..N through NCCL, or with --device cpu shares of the CPU's threads.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub tp: Option<u16>,
    #[command(flatten)]
    pub nodes: crate::ranks::NodeArgs,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    Text,
    Json,
}

/// The default context when --ctx-size is not given: the model's, at most this.
const DEFAULT_CONTEXT: usize = 4096;

pub fn run(a: RunArgs, quiet: bool) -> CliResult {
    let tp = usize::from(a.tp.unwrap_or(1));
    // A split model's ranks make their own backends; a CPU one stands in here for the
    // checks of --kv-type against the model.
    let backend = match tp {
        1 => model_file::backend(a.device, a.threads)?,
        _ => Arc::new(kiln_cpu::CpuBackend::new(Some(1))?),
    };
    let file = model_file::open(a.model.as_deref())?;
    let tokenizer = &file.tokenizer;
    let prompt = if a.chat {
        let template = tokenizer
            .chat_template()
            .ok_or_else(|| Failure::usage(format!("--chat: {} has no chat template", file.name)))?;
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
        let text = crate::chat_sandbox::render(&file.name, template, &user, &bos, &eos)?;
        // The template writes BOS itself when the model wants one.
        tokenizer.encode_with_special_tokens(&text, false)?
    } else {
        tokenizer.encode(&a.prompt, true)?
    };
    if prompt.is_empty() {
        return Err(Failure::usage(
            "-p: the prompt is empty (and the model adds no BOS)",
        ));
    }
    let context = model_file::context_size(a.ctx_size, file.config(), &file.name, DEFAULT_CONTEXT)?;
    // Everything the user can get wrong is checked before any text is printed.
    if prompt.len() >= context {
        return Err(Failure::usage(format!(
            "the prompt has {} tokens, and --ctx-size {context} leaves no room to generate: raise --ctx-size above {} ({} was trained for {} positions)",
            prompt.len(),
            prompt.len(),
            file.name,
            file.config().max_positions
        )));
    }
    let kv_type = match (tp, a.device, a.kv_type) {
        // The ranks' device decides the default: f16 on GPUs, f32 on the CPU.
        (1, _, _) | (_, _, Some(_)) => {
            model_file::kv_type(a.kv_type, backend.as_ref(), file.config(), &file.name)?
        }
        (_, DeviceChoice::Cpu, None) => DType::F32,
        (_, _, None) => DType::F16,
    };
    if a.nodes.nnodes > 1 && a.seed.is_none() && a.temp > 0.0 {
        return Err(Failure::usage(
            "--nnodes: give --seed (or --temp 0), so that every host draws the same tokens",
        ));
    }
    // Greedy runs over hosts need no seed: one fixed, so their fingerprints agree.
    let seed = a
        .seed
        .or((a.nodes.nnodes > 1).then_some(0))
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0)
        });
    let sampler = SamplerConfig {
        temperature: a.temp,
        top_k: a.top_k,
        top_p: a.top_p,
        min_p: a.min_p,
        repeat_penalty: a.repeat_penalty,
        seed,
        ..Default::default()
    };
    let opts = GenerateOptions {
        max_tokens: a.n_predict,
        context,
        kv_type,
        stop_strings: &a.stop,
    };
    let streaming = a.output == Output::Text;
    // The prompt is echoed once the model is loaded: a load that fails prints nothing.
    let echo = || {
        if streaming && !a.chat {
            console::stream(&mut std::io::stdout().lock(), &a.prompt);
        }
    };
    let show = |piece: &str| {
        if streaming {
            console::stream(&mut std::io::stdout().lock(), piece);
        }
    };
    let g = if tp > 1 {
        let split = run_tp::SplitRun {
            tp,
            device: a.device,
            threads: a.threads,
            prompt: &prompt,
            fingerprint: crate::ranks::fingerprint(
                a.model.as_deref(),
                &format!(
                    "{prompt:?} {sampler:?} {:?} {:?} {:?}",
                    a.n_predict, a.ctx_size, a.stop
                ),
            ),
            sampler,
            opts,
            nodes: a.nodes.clone(),
        };
        run_tp::generate_split(&file, &split, &echo, &show)?
    } else {
        let plan = file.plan(backend.as_ref(), prompt.len(), false, kv_type);
        let mut model = file.load(backend, &plan, context, "--ctx-size")?;
        echo();
        let mut sampler = Sampler::new(sampler);
        generate(&mut model, tokenizer, &prompt, &mut sampler, &opts, show)?
    };
    let mut stdout = std::io::stdout().lock();
    let pp = g.prompt_tokens.len() as f64 / g.prompt_time.as_secs_f64().max(1e-9);
    let tg = g.tokens.len() as f64 / g.gen_time.as_secs_f64().max(1e-9);
    if streaming {
        console::stream(&mut stdout, "\n");
        if !quiet {
            eprintln!(
                "\nprompt: {} tokens, {:.1} ms, {pp:.1} tokens/s | generation: {} tokens, {:.1} ms, {tg:.1} tokens/s | stop: {:?}",
                g.prompt_tokens.len(),
                g.prompt_time.as_secs_f64() * 1e3,
                g.tokens.len(),
                g.gen_time.as_secs_f64() * 1e3,
                g.stop
            );
        }
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
    // A model may have more output rows than its tokenizer has tokens (padding, or a
    // tokenizer of another model): an id past them has no text, so nothing was shown.
    let known = tokenizer.vocab_size();
    let past: Vec<u32> = g
        .tokens
        .iter()
        .copied()
        .filter(|&t| t as usize >= known)
        .collect();
    if let Some(first) = past.first() {
        tracing::warn!(
            "{} of the {} tokens generated (the first: id {first}) are past the tokenizer's {known} tokens: they have no text, and nothing was shown for them",
            past.len(),
            g.tokens.len()
        );
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
