//! The `kiln` command.

mod bench;
mod info;

use clap::{Parser, Subcommand};
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
    /// Describe a model file: a .gguf, a .safetensors, or a Hugging Face model directory.
    Info {
        /// The file or directory.
        path: PathBuf,
    },
    /// Measure speed. `--kernels`: CPU matrix-vector GB/s per dtype against the machine's
    /// memory bandwidth.
    Bench {
        /// Time the matrix-vector kernels (the only mode until models load).
        #[arg(long, required = true)]
        kernels: bool,
        /// Threads (default: all cores).
        #[arg(short = 't', long)]
        threads: Option<usize>,
        /// Timed repetitions (the median is reported).
        #[arg(short = 'r', long, default_value_t = 10)]
        reps: usize,
        /// Weight rows.
        #[arg(long, default_value_t = 4096)]
        rows: usize,
        /// Weight columns (a multiple of 256).
        #[arg(long, default_value_t = 14336)]
        cols: usize,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Info { path } => info::run(&path),
        Command::Bench {
            kernels: _,
            threads,
            reps,
            rows,
            cols,
        } => bench::kernels(&bench::KernelBench {
            threads,
            reps,
            rows,
            cols,
        })
        .map(|t| print!("{t}")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kiln: error: {e}");
            ExitCode::FAILURE
        }
    }
}
