//! `kiln serve`: the model behind an OpenAI-compatible HTTP server (kiln-serve), with the
//! KV pool sized once here from `--kv-memory`.

use crate::console::{CliResult, Failure};
use crate::model_file::{self, DeviceChoice, ModelFile};
use crate::ranks::Ranks;
use kiln_core::{Backend, DType, Error};
use kiln_models::chat::Message;
use kiln_models::memory::{self, human_bytes};
use kiln_models::ModelConfig;
use kiln_serve::engine::blocks::{blocks_for, BLOCK_POSITIONS};
use kiln_serve::engine::warm_up::warm_up;
use kiln_serve::{
    App, ChatRenderer, Engine, EngineConfig, Limits, PagedRunner, RenderError, ServedModel,
    SplitRunner, StepRunner,
};
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;

#[derive(clap::Args)]
pub struct ServeArgs {
    /// Model: a .gguf file or a Hugging Face directory (default: the embedded model).
    #[arg(short = 'm', long)]
    pub model: Option<PathBuf>,
    #[arg(long, default_value_t = DeviceChoice::Auto)]
    pub device: DeviceChoice,
    /// Address to listen on (loopback unless told otherwise).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: IpAddr,
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Sequences running at once.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u16).range(1..=4096))]
    pub max_seqs: u16,
    /// Tokens a step computes at most: every running sequence's decode, then prompt chunks
    /// of up to 256 tokens until this budget (the first chunk even past it). Larger steps
    /// read the weights fewer times per prompt token; smaller ones keep decodes waiting
    /// less behind prompts.
    #[arg(long, default_value_t = 2048,
          value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub max_batch_tokens: u32,
    /// New sequences that may wait for a place; beyond it requests get 429.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub max_waiting: u32,
    /// Positions a sequence may use (default: the model's, at most 4096; 0: the model's).
    #[arg(short = 'c', long = "ctx-size", value_parser = model_file::context_arg)]
    pub ctx_size: Option<usize>,
    /// Memory for the KV pool: a fraction (0-1] of what is free after the weights, or bytes
    /// (suffix K, M, G). Default: room for --max-seqs full contexts, at most half of it.
    #[arg(long, value_parser = kv_memory_arg)]
    pub kv_memory: Option<KvMemory>,
    #[arg(long, value_parser = model_file::kv_type_arg, help = model_file::KV_TYPE_HELP)]
    pub kv_type: Option<DType>,
    /// Require `Authorization: Bearer KEY` on /v1/*, /tokenize and /detokenize.
    #[arg(long)]
    pub api_key: Option<String>,
    /// A Jinja chat template to use instead of the model's.
    #[arg(long)]
    pub chat_template: Option<PathBuf>,
    #[arg(short = 't', long)]
    pub threads: Option<usize>,
    /// Split the model over this many ranks (tensor parallelism, the LLaMA family): GPUs
    /// cuda:0..N through NCCL, or with --device cpu shares of the CPU's threads. Every
    /// step runs on all of them; the KV pool is each rank's share of the heads.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub tp: Option<u16>,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KvMemory {
    Fraction(f64),
    Bytes(u128),
}

fn kv_memory_arg(s: &str) -> Result<KvMemory, String> {
    let t = s.trim();
    if t.contains('.') {
        let f: f64 = t
            .parse()
            .map_err(|_| format!("{s:?} is not a fraction or a size"))?;
        if f > 0.0 && f <= 1.0 {
            return Ok(KvMemory::Fraction(f));
        }
        return Err(format!("{f}: a fraction is above 0 and at most 1"));
    }
    let (digits, scale) = match t.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        None => (t, 1u128),
        Some((i, _)) => {
            let scale = match t[i..].to_ascii_uppercase().as_str() {
                "K" | "KB" | "KIB" => 1 << 10,
                "M" | "MB" | "MIB" => 1 << 20,
                "G" | "GB" | "GIB" => 1 << 30,
                "T" | "TB" | "TIB" => 1 << 40,
                _ => return Err(format!("{s:?}: sizes end in K, M, G or T")),
            };
            (&t[..i], scale)
        }
    };
    let n: u128 = digits
        .parse()
        .map_err(|_| format!("{s:?} is not a fraction or a size"))?;
    if n == 0 {
        return Err("the KV pool needs some memory".into());
    }
    if n == 1 && scale == 1 {
        return Ok(KvMemory::Fraction(1.0));
    }
    Ok(KvMemory::Bytes(n.saturating_mul(scale)))
}

/// Used when neither the model nor `--chat-template` gives a template (the embedded
/// model has none): each turn as `role: content`, then the assistant's cue.
const PLAIN_TEMPLATE: &str = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}";

/// Renders in the CLI's sandboxed child processes (see `chat_sandbox`).
struct SandboxedChat(crate::chat_sandbox::Renderer);

impl ChatRenderer for SandboxedChat {
    fn render(&self, messages: &[Message]) -> Result<String, RenderError> {
        self.0.render(messages).map_err(|e| match e {
            // Starting or talking to the child failed: not the messages' doing.
            Failure::Kiln(Error::Io { .. }) => RenderError::Renderer(e.to_string()),
            e => RenderError::Messages(e.to_string()),
        })
    }
}

/// The default context when --ctx-size is not given: the model's, at most this.
const DEFAULT_CONTEXT: usize = 4096;

pub fn run(a: ServeArgs, quiet: bool) -> CliResult {
    let tp = usize::from(a.tp.unwrap_or(1));
    let backend = match tp {
        1 => model_file::backend(a.device, a.threads)?,
        // The ranks make their own backends; this one only reads the settings.
        _ => Arc::new(kiln_cpu::CpuBackend::new(Some(1))?) as Arc<dyn Backend>,
    };
    let file = model_file::open(a.model.as_deref())?;
    let context = model_file::context_size(a.ctx_size, file.config(), &file.name, DEFAULT_CONTEXT)?;
    let max_seqs = usize::from(a.max_seqs);
    // A step's rows: every running sequence's decode, then prompt chunks up to the budget
    // (the first chunk even past it).
    let budget = a.max_batch_tokens as usize;
    let step_rows = max_seqs.max(budget) + PREFILL_CHUNK;
    let chat = chat_renderer(&file, a.chat_template.as_deref())?;
    let (mut runner, kv_blocks, kv_type, describe): (Box<dyn StepRunner>, _, _, _) = if tp > 1 {
        split_runner(&a, tp, &file, context, step_rows)?
    } else {
        let kv_type = model_file::kv_type(a.kv_type, backend.as_ref(), file.config(), &file.name)?;
        let plan = file.plan(backend.as_ref(), step_rows, false, kv_type);
        let free_after_weights = memory::free_memory(backend.as_ref())?
            .map(|free| (free.bytes.saturating_sub(plan.total(0)), free.what));
        let kv_blocks = kv_blocks(
            file.config(),
            free_after_weights,
            context,
            max_seqs,
            a.kv_memory,
            kv_type,
        )?;
        // The pool was checked against free memory above; the weights are checked here.
        let model = file.load(backend.clone(), &plan, 0, "--ctx-size")?;
        let runner = Box::new(PagedRunner::new(model, kv_blocks, kv_type)?);
        (runner, kv_blocks, kv_type, backend.describe())
    };
    let tokenizer = Arc::new(file.tokenizer);
    let limits = Limits {
        max_seqs,
        token_budget: budget,
        prefill_chunk: PREFILL_CHUNK,
    };
    // A GPU's first use of a step's shape costs tens of milliseconds (the CPU's nothing
    // worth a start-up's wait): paid here, not by the first clients.
    if tp > 1 || backend.device() != kiln_core::Device::Cpu {
        let done = warm_up(runner.as_mut(), &limits, kv_blocks, context)?;
        if !quiet {
            eprintln!(
                "kiln serve: warmed up ({} steps of each shape a step takes, {:.1} s)",
                done.steps,
                done.took.as_secs_f64()
            );
        }
    }
    let engine = Engine::start(
        runner,
        tokenizer.clone(),
        EngineConfig {
            limits,
            kv_blocks,
            max_waiting: a.max_waiting as usize,
        },
    )
    .map_err(|e| Error::io("starting the engine's thread", e))?;
    let (id, aliases) = match &a.model {
        None => ("kiln-default".to_string(), Vec::new()),
        Some(path) => {
            let stem = path
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| path.display().to_string());
            (stem, vec![path.display().to_string()])
        }
    };
    let app = Arc::new(App {
        engine: Arc::new(engine),
        tokenizer,
        model: ServedModel {
            id: id.clone(),
            aliases,
            context,
        },
        chat,
        api_key: a.api_key,
        started: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
    });
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::io("starting the server's runtime", e))?;
    let addr = SocketAddr::new(a.host, a.port);
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| Failure::usage(format!("--host {} --port {}: {e}", a.host, a.port)))?;
        let bound = listener
            .local_addr()
            .map_err(|e| Error::io("reading the listening address", e))?;
        if !quiet {
            eprintln!(
                "kiln serve: {id} ({}) on {}, context {context}, {max_seqs} sequences at once, KV pool {kv_blocks} blocks of {BLOCK_POSITIONS} positions ({kv_type}); listening on http://{bound}",
                file.name,
                describe,
            );
        }
        kiln_serve::serve(listener, app, shutdown_signal())
            .await
            .map_err(|e| Failure::from(Error::io("serving", e)))
    })?;
    if !quiet {
        eprintln!("kiln serve: stopped");
    }
    Ok(())
}

/// The longest prompt chunk a step takes of one sequence.
const PREFILL_CHUNK: usize = 256;

/// SIGTERM or Ctrl-C.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::warn!("cannot listen for SIGTERM ({e}); Ctrl-C still stops the server");
                std::future::pending::<()>().await
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
    tracing::info!("stopping: no new connections; finishing the requests in flight");
}

/// Blocks in the KV pool of a model of `config` (a rank's, when split), from
/// `--kv-memory`, keys and values kept as `kv` (an f16 pool holds twice the blocks of an
/// f32 one in the same memory); refused when the pool cannot hold one whole context or
/// does not fit in the memory free after the weights.
fn kv_blocks(
    config: &ModelConfig,
    free_after_weights: Option<(u128, String)>,
    context: usize,
    max_seqs: usize,
    asked: Option<KvMemory>,
    kv: DType,
) -> CliResult<usize> {
    let per_block = memory::kv_cache_bytes(config, BLOCK_POSITIONS, kv).max(1);
    // The pool holds one block more than sequences may use: the spare that the padding rows
    // of recorded steps write into (kiln_models::PagedKvCache). It is counted in the bytes.
    let everyone = per_block.saturating_mul((max_seqs * blocks_for(context) + 1) as u128);
    let bytes = match (asked, &free_after_weights) {
        (Some(KvMemory::Bytes(b)), _) => b,
        (Some(KvMemory::Fraction(f)), Some((free, _))) => (*free as f64 * f) as u128,
        (Some(KvMemory::Fraction(_)), None) => return Err(Failure::usage(
            "--kv-memory as a fraction: the free memory of this device cannot be read; give bytes",
        )),
        (None, Some((free, _))) => everyone.min(free / 2),
        (None, None) => everyone,
    };
    if let Some((free, what)) = &free_after_weights {
        if bytes > *free {
            return Err(Failure::usage(format!(
                "--kv-memory {}: only {} of {what} is free after the weights",
                human_bytes(bytes),
                human_bytes(*free)
            )));
        }
    }
    let blocks = usize::try_from(bytes / per_block)
        .unwrap_or(usize::MAX)
        .saturating_sub(1);
    let one_context = blocks_for(context);
    if blocks < one_context {
        return Err(Failure::usage(format!(
            "a KV pool of {} holds {blocks} blocks of {BLOCK_POSITIONS} positions as {kv} (and a spare), and one context of {context} needs {one_context} ({}): raise --kv-memory or lower --ctx-size",
            human_bytes(bytes),
            human_bytes(per_block * (one_context as u128 + 1))
        )));
    }
    Ok(blocks)
}

/// `--tp N`: the ranks load their parts in threads of their own (NCCL's join needs all
/// of them at once), then the pool is sized from a rank's share of the heads and the
/// memory free on rank 0 after its weights.
fn split_runner(
    a: &ServeArgs,
    tp: usize,
    file: &ModelFile,
    context: usize,
    step_rows: usize,
) -> CliResult<(Box<dyn StepRunner>, usize, DType, String)> {
    kiln_models::tp::Plan::new(file.config(), tp).map_err(|e| match e {
        Error::Unsupported(why) => Failure::usage(why),
        e => Failure::from(e),
    })?;
    let nodes = crate::ranks::NodeArgs {
        nnodes: 1,
        node_rank: 0,
        master_addr: None,
    };
    let ranks = Arc::new(Ranks::new("--tp", tp, a.device, a.threads, &nodes, "")?);
    let start = kiln_dist::start::StartLine::new(tp);
    let loaded = ranks.each(|rank| {
        let model = ranks
            .take(rank)
            .and_then(|(b, c)| Ok((file.checkpoint.load_rank(b.clone(), c)?, b)));
        start.cross(rank, model).map_err(Failure::usage)
    });
    let mut models = Vec::new();
    let mut first: Option<Arc<dyn Backend>> = None;
    for r in loaded {
        let (m, b) = r?;
        first.get_or_insert(b);
        models.push(m);
    }
    let first = first.ok_or_else(|| Failure::usage("--tp: no rank loaded"))?;
    let rank_config = kiln_models::tp::Plan::new(file.config(), tp)?.config(file.config(), 0)?;
    let kv_type = model_file::kv_type(a.kv_type, first.as_ref(), file.config(), &file.name)?;
    // The step's activations are still to come; the whole model's are an upper bound.
    let buffers = file.plan(first.as_ref(), step_rows, false, kv_type).buffers;
    let free_after_weights = memory::free_memory(first.as_ref())?
        .map(|free| (free.bytes.saturating_sub(buffers), free.what));
    let blocks = kv_blocks(
        &rank_config,
        free_after_weights,
        context,
        usize::from(a.max_seqs),
        a.kv_memory,
        kv_type,
    )?;
    let abort_ranks = ranks.clone();
    let abort = Arc::new(move |why: &str| abort_ranks.abort_all(why));
    let describe = format!("{} × {tp}", first.describe());
    let runner = SplitRunner::new(models, blocks, kv_type, abort)?;
    Ok((Box::new(runner), blocks, kv_type, describe))
}

fn chat_renderer(
    file: &ModelFile,
    path: Option<&std::path::Path>,
) -> CliResult<Arc<dyn ChatRenderer>> {
    let tokenizer = &file.tokenizer;
    let template = match (path, tokenizer.chat_template()) {
        (Some(path), _) => {
            kiln_io::file::read_to_string(path, kiln_io::file::FileKind::CHAT_TEMPLATE)?
        }
        (None, Some(t)) => t.to_string(),
        (None, None) => {
            tracing::warn!(
                "{} has no chat template: chat requests get `role: content` lines (--chat-template FILE to give one)",
                file.name
            );
            PLAIN_TEMPLATE.to_string()
        }
    };
    let text_of = |id: Option<u32>| {
        id.and_then(|id| tokenizer.token_text(id))
            .unwrap_or("")
            .to_string()
    };
    Ok(Arc::new(SandboxedChat(crate::chat_sandbox::Renderer::new(
        &file.name,
        &template,
        &text_of(tokenizer.bos_id()),
        &text_of(tokenizer.eos_ids().first().copied()),
    ))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_memory_is_a_fraction_or_a_size() {
        assert_eq!(kv_memory_arg("0.25"), Ok(KvMemory::Fraction(0.25)));
        assert_eq!(kv_memory_arg("1"), Ok(KvMemory::Fraction(1.0)));
        assert_eq!(kv_memory_arg("512M"), Ok(KvMemory::Bytes(512 << 20)));
        assert_eq!(kv_memory_arg("2GiB"), Ok(KvMemory::Bytes(2 << 30)));
        assert_eq!(kv_memory_arg("4096"), Ok(KvMemory::Bytes(4096)));
        for bad in ["0", "1.5", "-1", "0.0", "12X", "lots"] {
            assert!(kv_memory_arg(bad).is_err(), "{bad}");
        }
    }
}
