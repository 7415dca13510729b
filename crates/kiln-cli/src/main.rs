//! The `kiln` command.

mod bench;
mod bench_model;
mod bench_optim;
mod bench_serve;
mod bench_tp;
mod bench_train;
mod chat_sandbox;
mod console;
mod devices;
mod info;
mod model_file;
mod perplexity;
mod ranks;
mod run;
mod run_tp;
mod serve;
mod train;

use clap::{ArgAction, Parser, Subcommand};
use console::{CliResult, Failure};
use model_file::DeviceChoice;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "kiln",
    version,
    about = "Run large language models at the speed of the hardware"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// More log lines on stderr (-v info, -vv debug, -vvv trace); RUST_LOG overrides.
    #[arg(short = 'v', long = "verbose", global = true, action = ArgAction::Count)]
    verbose: u8,
    /// Errors only on stderr: no warnings or progress.
    #[arg(short = 'q', long = "quiet", global = true, conflicts_with = "verbose")]
    quiet: bool,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt.
    Run(run::RunArgs),
    /// Perplexity of a text file, by llama.cpp's method (prints `PPL = <value>`).
    Perplexity(perplexity::PerplexityArgs),
    /// Describe a model file: a .gguf, a .safetensors, or a Hugging Face model directory.
    Info {
        /// The file or directory.
        path: PathBuf,
    },
    /// Measure speed: llama-bench's pp/tg tests on a model, `--kernels`, `--optimizer` or
    /// `--train`.
    Bench(BenchArgs),
    /// Serve the model over HTTP with OpenAI's API (completions, chat, models).
    Serve(serve::ServeArgs),
    /// Load a server on this machine: concurrency sweep of streamed completions.
    BenchServe(bench_serve::BenchServeArgs),
    /// Train a model on text: from scratch, or fine-tune a model file.
    Train(Box<train::TrainArgs>),
    /// List the devices kiln can use.
    Devices,
    /// Convert a Hugging Face LLaMA-family directory to GGUF (llama.cpp's conventions).
    Convert {
        /// The Hugging Face model directory.
        dir: PathBuf,
        /// The GGUF file to write.
        #[arg(short = 'o', long)]
        out: PathBuf,
        /// Type of the weight matrices: f32, f16, bf16, q8_0, q4_0, q4_K, q6_K.
        #[arg(long = "type", default_value = "f16")]
        ty: String,
        /// general.name to record.
        #[arg(long, default_value = "model")]
        name: String,
    },
}

#[derive(clap::Args)]
struct BenchArgs {
    /// Model file or Hugging Face directory.
    #[arg(short = 'm', long, conflicts_with_all = ["synthetic", "kernels", "optimizer", "train"])]
    model: Option<PathBuf>,
    /// A random-weight model of a known shape: tinyllama-1.1b, llama3-8b or llama3-70b
    /// (split that one with --tp).
    #[arg(long, conflicts_with_all = ["kernels", "optimizer", "train"])]
    synthetic: Option<String>,
    /// Weight type of a synthetic model: f32, f16, bf16, q8_0, q4_0, q4_k_m.
    #[arg(long = "type", default_value = "f16")]
    ty: String,
    /// Prompt tokens (the pp test); 0 skips it.
    #[arg(short = 'p', long = "n-prompt", default_value_t = 512)]
    prompt: usize,
    /// Generated tokens (the tg test); 0 skips it.
    #[arg(short = 'n', long = "n-gen", default_value_t = 128)]
    gen: usize,
    /// Positions already in each sequence's KV cache when the tg test starts (llama-bench's
    /// -d): decode then attends over them. Their keys and values are not computed (the
    /// cache's zeros are read), which times the same.
    #[arg(short = 'd', long, default_value_t = 0,
          conflicts_with_all = ["kernels", "optimizer", "train", "tp"])]
    depth: usize,
    /// Timed repetitions after a warm-up (1 to 1000: a run must end).
    #[arg(short = 'r', long, default_value_t = 3,
          value_parser = clap::value_parser!(u16).range(1..=1000))]
    reps: u16,
    /// Sequences decoded together in the tg test, as a server steps them (one batch over a
    /// paged KV cache); the speed is all sequences' tokens per second. With --train: the
    /// sequences of a step.
    #[arg(short = 'b', long, default_value_t = 1,
          value_parser = clap::value_parser!(u16).range(1..=1024))]
    batch: u16,
    #[arg(short = 't', long)]
    threads: Option<usize>,
    #[arg(long, default_value_t = DeviceChoice::Auto)]
    device: DeviceChoice,
    #[arg(long, value_parser = model_file::kv_type_arg, help = model_file::KV_TYPE_HELP,
          conflicts_with_all = ["kernels", "optimizer"])]
    kv_type: Option<kiln_core::DType>,
    /// Output: md (a table) or json (an array of rows).
    #[arg(short = 'o', long, default_value = "md")]
    output: String,
    /// Split the model over this many GPUs of this machine (tensor parallelism through
    /// NCCL; the LLaMA family, -m GGUF or --synthetic, pp and tg tests).
    #[arg(long, conflicts_with_all = ["kernels", "optimizer", "train"])]
    tp: Option<usize>,
    #[command(flatten)]
    nodes: ranks::NodeArgs,
    /// Time the CPU matrix-vector kernels instead (GB/s per dtype beside memory bandwidth).
    #[arg(long)]
    kernels: bool,
    /// With --kernels: weight rows and columns.
    #[arg(long, default_value_t = 4096, requires = "kernels")]
    rows: usize,
    #[arg(long, default_value_t = 14336, requires = "kernels")]
    cols: usize,
    /// Time an AdamW step over flat FP32 buffers on --device instead (G params/s).
    #[arg(long, conflicts_with = "kernels")]
    optimizer: bool,
    /// With --optimizer: parameters in all (default 268M, 2^28).
    #[arg(long, default_value_t = 1 << 28, requires = "optimizer")]
    params: usize,
    /// With --optimizer: tensors they are split into.
    #[arg(long, default_value_t = 64, requires = "optimizer")]
    tensors: usize,
    /// Time training steps of a model of this shape made from scratch instead
    /// (tokens/s): llama-134m or kiln-default. -b sequences a step, -r timed steps.
    #[arg(long, conflicts_with_all = ["kernels", "optimizer"])]
    train: Option<String>,
    /// With --train: tokens a sequence.
    #[arg(long, default_value_t = 1024, requires = "train")]
    seq_len: usize,
    /// With --train: the products' arithmetic, f32, tf32, bf16 or f16 (F32 weights either
    /// way; the others on CUDA; f16 with dynamic loss scaling).
    #[arg(long, default_value = "f32", value_parser = model_file::products_arg, requires = "train")]
    precision: kiln_core::Products,
    /// With --train: activation checkpointing (each layer run again in the backward pass).
    #[arg(long, requires = "train")]
    checkpoint_activations: bool,
}

fn bench(a: BenchArgs) -> CliResult {
    if a.output != "md" && a.output != "json" {
        return Err(Failure::usage(format!(
            "-o {}: the output is md or json",
            a.output
        )));
    }
    let text = if let Some(tp) = a.tp {
        bench_tp::run(&bench_tp::TpBench {
            tp,
            device: a.device,
            threads: a.threads,
            model: a.model,
            synthetic: a.synthetic,
            ty: a.ty,
            prompt: a.prompt,
            gen: a.gen,
            reps: usize::from(a.reps),
            kv_type: a.kv_type,
            nodes: a.nodes,
        })?
    } else if let Some(shape) = a.train {
        bench_train::run(&bench_train::TrainBench {
            shape,
            device: a.device,
            threads: a.threads,
            reps: usize::from(a.reps),
            batch: usize::from(a.batch),
            seq_len: a.seq_len,
            products: a.precision,
            checkpoint_activations: a.checkpoint_activations,
            json: a.output == "json",
        })?
    } else if a.optimizer {
        bench_optim::run(&bench_optim::OptimizerBench {
            device: a.device,
            threads: a.threads,
            reps: usize::from(a.reps).max(5),
            params: a.params,
            tensors: a.tensors,
            json: a.output == "json",
        })?
    } else if a.kernels {
        bench::kernels(
            &bench::KernelBench {
                threads: a.threads,
                reps: usize::from(a.reps).max(5),
                rows: a.rows,
                cols: a.cols,
            }
            .checked()?,
        )?
    } else {
        bench_model::run(&bench_model::ModelBench {
            model: a.model,
            synthetic: a.synthetic,
            ty: a.ty,
            prompt: a.prompt,
            gen: a.gen,
            depth: a.depth,
            batch: usize::from(a.batch),
            reps: usize::from(a.reps),
            threads: a.threads,
            device: a.device,
            kv_type: a.kv_type,
            json: a.output == "json",
        })?
    };
    console::stream(&mut std::io::stdout().lock(), &text);
    Ok(())
}

/// clap's message without its usage block and hints, on one line.
fn clap_message(e: &clap::Error) -> String {
    e.render()
        .to_string()
        .lines()
        .map(str::trim)
        .filter(|l| {
            !l.is_empty() && !l.starts_with("Usage:") && !l.starts_with("For more information")
        })
        .collect::<Vec<_>>()
        .join(" ")
        .trim_start_matches("error: ")
        .to_string()
}

/// A tokenizer.json is written whole (`tokenizer.huggingface.json`): kiln reads it, but
/// llama.cpp needs `tokenizer.ggml.*` keys, which kiln derives from SentencePiece
/// vocabularies and from byte-level BPEs with a pre-tokenizer llama.cpp names only.
fn warn_if_only_kiln_reads_its_tokenizer(path: &std::path::Path) {
    if let Ok(f) = kiln_io::gguf::GgufFile::open(path) {
        if f.get("tokenizer.ggml.model").is_none() {
            tracing::warn!(
                "{}: its tokenizer is stored as tokenizer.huggingface.json (tokenizer.json whole), which kiln reads and llama.cpp does not",
                path.display()
            );
        }
    }
}

fn main() -> ExitCode {
    // kiln picks its GPU itself. Mesa's implicit Vulkan layer that ranks GPUs by the
    // desktop's display (VK_LAYER_MESA_device_select) connects to a Wayland display to do
    // so, and prints "XDG_RUNTIME_DIR is invalid" on every adapter enumeration where none
    // runs (a server, ssh, CI); it is turned off as its manifest allows, unless the user
    // chose otherwise. First thing in main: no other thread reads the environment yet.
    if std::env::var_os("NODEVICE_SELECT").is_none() {
        std::env::set_var("NODEVICE_SELECT", "1");
    }
    if std::env::args_os()
        .nth(1)
        .is_some_and(|a| a == chat_sandbox::CHILD_ARG)
    {
        return chat_sandbox::child_main();
    }
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) if !e.use_stderr() => e.exit(), // --help, --version
        Err(e) => {
            let failure = Failure::usage(clap_message(&e));
            console::report(&failure);
            return ExitCode::from(failure.exit_code());
        }
    };
    console::init_logging(cli.verbose, cli.quiet);
    let result = match cli.command {
        Command::Run(a) => run::run(a, cli.quiet),
        Command::Perplexity(a) => perplexity::run(a, cli.quiet),
        Command::Info { path } => info::run(&path).map_err(Failure::from),
        Command::Bench(a) => bench(a),
        Command::Serve(a) => serve::run(a, cli.quiet),
        Command::BenchServe(a) => bench_serve::run(a),
        Command::Train(a) => train::run(*a, cli.quiet),
        Command::Devices => devices::run().map_err(Failure::from),
        Command::Convert { dir, out, ty, name } => match kiln_core::DType::from_name(&ty) {
            Some(dtype) => kiln_models::convert_hf_to_gguf(&dir, &out, dtype, &name)
                .map(|n| {
                    eprintln!("wrote {} ({n} tensors, {ty})", out.display());
                    warn_if_only_kiln_reads_its_tokenizer(&out);
                })
                .map_err(Failure::from),
            None => Err(Failure::usage(format!(
                "--type {ty}: the types are f32, f16, bf16, q8_0, q4_0, q4_K, q6_K"
            ))),
        },
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) => {
            console::report(&failure);
            ExitCode::from(failure.exit_code())
        }
    }
}
