//! Opening a model and its tokenizer from a path, on the chosen backend.

use crate::console::{CliResult, Failure};
use kiln_core::{Backend, DType, Device, Error, Result};
use kiln_cpu::CpuBackend;
use kiln_cuda::CudaBackend;
use kiln_io::gguf::GgufFile;
use kiln_io::{detect_format, FileFormat};
use kiln_models::memory::{self, MemoryPlan};
use kiln_models::{Checkpoint, Model, ModelConfig};
use kiln_tokenizer::Tokenizer;
use kiln_wgpu::WgpuBackend;
use std::path::Path;
use std::sync::Arc;

/// `--device`: where the model runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceChoice {
    /// An NVIDIA GPU through CUDA when one is usable, else a GPU through wgpu (not a CPU
    /// rasterizer), else the CPU.
    Auto,
    Cpu,
    /// An NVIDIA GPU by CUDA ordinal (`cuda` is `cuda:0`); an error when there is none.
    Cuda(usize),
    /// A wgpu adapter by its index in `kiln devices` (`wgpu` is `wgpu:0`).
    Wgpu(usize),
}

impl std::str::FromStr for DeviceChoice {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let (kind, index) = match s.split_once(':') {
            Some((k, i)) => {
                let i = i
                    .parse::<usize>()
                    .map_err(|_| format!("`{i}` is not a device number"))?;
                (k, i)
            }
            None => (s, 0),
        };
        match (kind, s.contains(':')) {
            ("auto", false) => Ok(DeviceChoice::Auto),
            ("cpu", false) => Ok(DeviceChoice::Cpu),
            ("cuda", _) => Ok(DeviceChoice::Cuda(index)),
            ("wgpu", _) => Ok(DeviceChoice::Wgpu(index)),
            _ => Err("one of auto, cpu, cuda, cuda:N, wgpu, wgpu:N (see `kiln devices`)".into()),
        }
    }
}

impl std::fmt::Display for DeviceChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceChoice::Auto => f.write_str("auto"),
            DeviceChoice::Cpu => f.write_str("cpu"),
            DeviceChoice::Cuda(i) => write!(f, "cuda:{i}"),
            DeviceChoice::Wgpu(i) => write!(f, "wgpu:{i}"),
        }
    }
}

/// Threads beyond this many per core only add stacks and hand-offs.
const THREADS_PER_CORE: usize = 4;

/// Refuse a thread count of 0, or far above the machine's cores.
pub fn check_threads(threads: Option<usize>) -> CliResult<()> {
    let Some(n) = threads else { return Ok(()) };
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let most = cores * THREADS_PER_CORE;
    if n == 0 || n > most {
        return Err(Failure::usage(format!(
            "-t {n}: from 1 to {most} threads ({cores} cores here)"
        )));
    }
    Ok(())
}

pub fn backend(device: DeviceChoice, threads: Option<usize>) -> CliResult<Arc<dyn Backend>> {
    check_threads(threads)?;
    Ok(match device {
        DeviceChoice::Cpu => Arc::new(CpuBackend::new(threads)?),
        DeviceChoice::Cuda(i) => Arc::new(CudaBackend::new(i)?),
        DeviceChoice::Wgpu(i) => Arc::new(WgpuBackend::new(i)?),
        DeviceChoice::Auto => match CudaBackend::new(0) {
            Ok(cuda) => Arc::new(cuda),
            Err(e) => {
                // Expected on machines without a GPU; worth a word when one is there.
                if kiln_cuda::is_available() {
                    tracing::warn!("the NVIDIA GPU cannot be used ({e})");
                }
                auto_without_cuda(threads)?
            }
        },
    })
}

/// The first wgpu adapter that is a GPU of its own, else the CPU.
fn auto_without_cuda(threads: Option<usize>) -> Result<Arc<dyn Backend>> {
    if let Some(a) = kiln_wgpu::adapters().into_iter().find(|a| a.is_gpu()) {
        match WgpuBackend::new(a.index) {
            Ok(b) => return Ok(Arc::new(b)),
            Err(e) => tracing::warn!("{} cannot be used ({e}); running on the CPU", a.name),
        }
    }
    Ok(Arc::new(CpuBackend::new(threads)?))
}

/// kiln's default model (models/README.md): a small LLaMA trained on license texts,
/// embedded so that `kiln run` works with no download.
const DEFAULT_MODEL: &[u8] = include_bytes!("../../../models/kiln-default.gguf");

/// A model file opened, its configuration and tokenizer read, its weights not yet loaded.
pub struct ModelFile {
    pub checkpoint: Checkpoint,
    pub tokenizer: Tokenizer,
    /// The path, or "the default model", for messages.
    pub name: String,
    /// Bytes to read while loading, for the progress bar.
    size: u64,
}

/// Open `path`, or the embedded default model when `None`.
pub fn open(path: Option<&Path>) -> Result<ModelFile> {
    let Some(path) = path else {
        let file = GgufFile::from_bytes("<embedded kiln-default.gguf>", DEFAULT_MODEL.to_vec())?;
        let tokenizer = Tokenizer::from_gguf(&file)?;
        return Ok(ModelFile {
            checkpoint: Checkpoint::from_gguf(file)?,
            tokenizer,
            name: "the default model".into(),
            size: 0,
        });
    };
    let name = path.display().to_string();
    match detect_format(path)? {
        FileFormat::Gguf => {
            let file = GgufFile::open(path)?;
            let tokenizer = Tokenizer::from_gguf(&file)?;
            let size = file.file_size();
            Ok(ModelFile {
                checkpoint: Checkpoint::from_gguf(file)?,
                tokenizer,
                name,
                size,
            })
        }
        FileFormat::HfDirectory => {
            let checkpoint = Checkpoint::open_hf_dir(path)?;
            Ok(ModelFile {
                checkpoint,
                tokenizer: Tokenizer::from_hf_dir(path)?,
                name,
                size: dir_size(path),
            })
        }
        FileFormat::Safetensors => Err(Error::unsupported(format!(
            "{}: give the Hugging Face directory that holds this file (kiln needs its config.json and tokenizer)",
            path.display()
        ))),
    }
}

impl ModelFile {
    pub fn config(&self) -> &ModelConfig {
        &self.checkpoint.config
    }

    /// Refuse, before anything is allocated, a context whose buffers `plan` says do not
    /// fit on `backend`'s device; then load the weights. `setting` names the options that
    /// set the context, for the message when it does not fit.
    pub fn load(
        &self,
        backend: Arc<dyn Backend>,
        plan: &MemoryPlan,
        context: usize,
        setting: &str,
    ) -> CliResult<Model> {
        if let Some(free) = memory::free_memory(backend.as_ref())? {
            plan.check(context, &free).map_err(|no_room| {
                let msg = format!("{}: {no_room} ({setting})", self.name);
                // A smaller context helps only when some context fits.
                if no_room.largest > 0 {
                    Failure::Usage(msg)
                } else {
                    Failure::Kiln(Error::Device(msg))
                }
            })?;
        }
        warn_above_trained(context, self.config(), &self.name);
        let bar = progress_bar(self.size);
        let tick = |n: u64| bar.iter().for_each(|b| b.inc(n));
        let model = self.checkpoint.load(backend, Some(&tick));
        bar.iter().for_each(|b| b.finish_and_clear());
        Ok(model?)
    }

    /// The plan for this model on `backend`'s device with its keys and values kept as
    /// `kv` (see [`MemoryPlan::new`]).
    pub fn plan(
        &self,
        backend: &dyn Backend,
        batch: usize,
        all_logits: bool,
        kv: DType,
    ) -> MemoryPlan {
        MemoryPlan::new(
            self.config(),
            self.checkpoint.weight_bytes(),
            backend.device(),
            batch,
            all_logits,
            kv,
        )
    }
}

/// `--kv-type`'s help: what each type is, and why the defaults differ.
pub const KV_TYPE_HELP: &str = "Type of the KV cache: f16, bf16, f32 or q8_0 (q8_0 for heads \
of a multiple of 32 dimensions). Default: f16 on a GPU, half the memory and the attention \
bandwidth of f32 (llama.cpp's default too); f32 on the CPU, where it keeps output identical \
to the fixtures kiln is checked against (a batch gives each request the same tokens as \
alone with either)";

/// Parses `--kv-type`: one of the KV cache types.
/// `--precision`: how training computes its products.
pub fn products_arg(s: &str) -> std::result::Result<kiln_core::Products, String> {
    kiln_core::Products::parse(&s.trim().to_ascii_lowercase())
        .ok_or_else(|| format!("{s:?}: the precisions are f32, tf32, bf16 and f16"))
}

pub fn kv_type_arg(s: &str) -> std::result::Result<DType, String> {
    DType::KV_CACHE
        .into_iter()
        .find(|d| d.name().eq_ignore_ascii_case(s.trim()))
        .ok_or_else(|| format!("{s:?}: the KV cache types are f16, bf16, f32 and q8_0"))
}

/// The KV type for `config` on `backend`: `asked`, else f16 on a GPU and f32 on the CPU;
/// a usage error when the model's heads cannot be kept in it.
pub fn kv_type(
    asked: Option<DType>,
    backend: &dyn Backend,
    config: &ModelConfig,
    name: &str,
) -> CliResult<DType> {
    let kv = asked.unwrap_or(match backend.device() {
        Device::Cpu => DType::F32,
        Device::Cuda(_) | Device::Wgpu(_) => DType::F16,
    });
    kiln_models::check_kv_type(config, kv).map_err(|e| {
        let why = match e {
            Error::Unsupported(why) => why,
            e => e.to_string(),
        };
        Failure::usage(format!("--kv-type {kv} for {name}: {why}"))
    })?;
    Ok(kv)
}

/// The largest context kiln can address: positions are i32 on the device.
pub const MAX_CONTEXT: usize = i32::MAX as usize;

/// Parses `--ctx-size`: a count of tokens kiln can address.
pub fn context_arg(s: &str) -> std::result::Result<usize, String> {
    let n: u128 = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a whole number of tokens"))?;
    if n > MAX_CONTEXT as u128 {
        return Err(format!(
            "{n} tokens is above the largest context kiln can address ({MAX_CONTEXT})"
        ));
    }
    Ok(n as usize)
}

/// The context to use: `asked`, or the model's own for 0 or when not given (at most
/// `default_cap` then). Above the length the model was trained for is allowed (llama.cpp's
/// behaviour; see [`warn_above_trained`]), except for learned positions, which have no
/// embedding past it.
pub fn context_size(
    asked: Option<usize>,
    config: &ModelConfig,
    name: &str,
    default_cap: usize,
) -> CliResult<usize> {
    let trained = config.max_positions;
    let context = match asked {
        Some(0) if trained == 0 => {
            return Err(Failure::usage(format!(
                "--ctx-size 0 asks for the model's own context, and {name} does not say how long it is: give --ctx-size N"
            )))
        }
        Some(0) => trained,
        Some(n) => n,
        None if trained == 0 => default_cap,
        None => trained.min(default_cap),
    };
    if trained > 0 && context > trained && config.rope.is_none() {
        return Err(Failure::usage(format!(
            "--ctx-size {context}: {name} has learned position embeddings for {trained} positions, no more"
        )));
    }
    Ok(context)
}

/// Say so when `context` is longer than the model was trained for: it runs, and its
/// output may degrade. Called once the context is known to fit, so that a refusal is
/// the only line.
pub fn warn_above_trained(context: usize, config: &ModelConfig, name: &str) {
    let trained = config.max_positions;
    if trained > 0 && context > trained {
        tracing::warn!(
            "--ctx-size {context} is above the {trained} positions {name} was trained for; its output may degrade past them"
        );
    }
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
