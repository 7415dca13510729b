//! Opening a model and its tokenizer from a path, on the chosen backend.

use kiln_core::{Backend, Error, Result};
use kiln_cpu::CpuBackend;
use kiln_cuda::CudaBackend;
use kiln_io::gguf::GgufFile;
use kiln_io::{detect_format, FileFormat};
use kiln_models::Model;
use kiln_tokenizer::Tokenizer;
use std::path::Path;
use std::sync::Arc;

/// `--device`: where the model runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DeviceChoice {
    /// The first GPU when one is usable, else the CPU.
    Auto,
    Cpu,
    /// The first NVIDIA GPU; an error when there is none.
    Cuda,
}

pub fn backend(device: DeviceChoice, threads: Option<usize>) -> Result<Arc<dyn Backend>> {
    match device {
        DeviceChoice::Cpu => Ok(Arc::new(CpuBackend::new(threads)?)),
        DeviceChoice::Cuda => Ok(Arc::new(CudaBackend::new(0)?)),
        DeviceChoice::Auto => match CudaBackend::new(0) {
            Ok(cuda) => Ok(Arc::new(cuda)),
            Err(e) => {
                // Expected on machines without a GPU; worth a word when one is there.
                if kiln_cuda::is_available() {
                    eprintln!("kiln: the GPU cannot be used ({e}); running on the CPU");
                }
                Ok(Arc::new(CpuBackend::new(threads)?))
            }
        },
    }
}

/// kiln's default model (models/README.md): a small LLaMA trained on license texts,
/// embedded so that `kiln run` works with no download.
const DEFAULT_MODEL: &[u8] = include_bytes!("../../../models/kiln-default.gguf");

/// The embedded default model.
pub fn open_default(backend: Arc<dyn Backend>) -> Result<(Model, Tokenizer)> {
    let file = GgufFile::from_bytes("<embedded kiln-default.gguf>", DEFAULT_MODEL.to_vec())?;
    let tokenizer = Tokenizer::from_gguf(&file)?;
    Ok((Model::from_gguf(&file, backend, None)?, tokenizer))
}

/// A progress bar over `total` bytes when stderr is a terminal and the model is large
/// enough for loading to take a moment.
fn progress_bar(total: u64) -> Option<indicatif::ProgressBar> {
    use std::io::IsTerminal;
    if total < 256 << 20 || !std::io::stderr().is_terminal() {
        return None;
    }
    let bar = indicatif::ProgressBar::new(total);
    bar.set_style(
        indicatif::ProgressStyle::with_template("loading {bar:40} {bytes}/{total_bytes} ({eta})")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    Some(bar)
}

fn dir_size(path: &Path) -> u64 {
    std::fs::read_dir(path)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok()?.metadata().ok())
                .filter(|m| m.is_file())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

pub fn open(path: &Path, backend: Arc<dyn Backend>) -> Result<(Model, Tokenizer)> {
    match detect_format(path)? {
        FileFormat::Gguf => {
            let file = GgufFile::open(path)?;
            let tokenizer = Tokenizer::from_gguf(&file)?;
            let bar = progress_bar(file.file_size());
            let tick = |n: u64| bar.iter().for_each(|b| b.inc(n));
            let model = Model::from_gguf(&file, backend, Some(&tick));
            bar.iter().for_each(|b| b.finish_and_clear());
            Ok((model?, tokenizer))
        }
        FileFormat::HfDirectory => {
            let bar = progress_bar(dir_size(path));
            let tick = |n: u64| bar.iter().for_each(|b| b.inc(n));
            let model = Model::from_hf_dir(path, backend, Some(&tick));
            bar.iter().for_each(|b| b.finish_and_clear());
            Ok((model?, Tokenizer::from_hf_dir(path)?))
        }
        FileFormat::Safetensors => Err(Error::unsupported(format!(
            "{}: give the Hugging Face directory that holds this file (kiln needs its config.json and tokenizer)",
            path.display()
        ))),
    }
}
