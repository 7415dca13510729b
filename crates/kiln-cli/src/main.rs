//! The `kiln` command.

mod bench;
mod bench_model;
mod devices;
mod info;
mod model_file;
mod perplexity;
mod run;

use clap::{Parser, Subcommand};
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
    /// Measure speed: llama-bench's pp/tg tests on a model, or `--kernels`.
    Bench(BenchArgs),
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
    #[arg(short = 'm', long, conflicts_with_all = ["synthetic", "kernels"])]
    model: Option<PathBuf>,
    /// A random-weight model of a known shape: tinyllama-1.1b or llama3-8b.
    #[arg(long, conflicts_with = "kernels")]
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
    /// Timed repetitions after a warm-up.
    #[arg(short = 'r', long, default_value_t = 3)]
    reps: usize,
    #[arg(short = 't', long)]
    threads: Option<usize>,
    #[arg(long, value_enum, default_value_t = DeviceChoice::Auto)]
    device: DeviceChoice,
    /// Output: md (a table) or json (an array of rows).
    #[arg(short = 'o', long, default_value = "md")]
    output: String,
    /// Time the CPU matrix-vector kernels instead (GB/s per dtype beside memory bandwidth).
    #[arg(long)]
    kernels: bool,
    /// With --kernels: weight rows and columns.
    #[arg(long, default_value_t = 4096, requires = "kernels")]
    rows: usize,
    #[arg(long, default_value_t = 14336, requires = "kernels")]
    cols: usize,
}

fn bench(a: BenchArgs) -> kiln_core::Result<()> {
    let text = if a.kernels {
        bench::kernels(&bench::KernelBench {
            threads: a.threads,
            reps: a.reps.max(5),
            rows: a.rows,
            cols: a.cols,
        })?
    } else {
        if a.output != "md" && a.output != "json" {
            return Err(kiln_core::Error::unsupported(format!(
                "-o {} (md or json)",
                a.output
            )));
        }
        bench_model::run(&bench_model::ModelBench {
            model: a.model,
            synthetic: a.synthetic,
            ty: a.ty,
            prompt: a.prompt,
            gen: a.gen,
            reps: a.reps.max(1),
            threads: a.threads,
            device: a.device,
            json: a.output == "json",
        })?
    };
    print!("{text}");
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(a) => run::run(a),
        Command::Perplexity(a) => perplexity::run(a),
        Command::Info { path } => info::run(&path),
        Command::Bench(a) => bench(a),
        Command::Devices => devices::run(),
        Command::Convert { dir, out, ty, name } => match kiln_core::DType::from_name(&ty) {
            Some(dtype) => kiln_models::convert_hf_to_gguf(&dir, &out, dtype, &name)
                .map(|n| eprintln!("wrote {} ({n} tensors, {ty})", out.display())),
            None => Err(kiln_core::Error::unsupported(format!("--type {ty}"))),
        },
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kiln: error: {e}");
            ExitCode::FAILURE
        }
    }
}
