//! kiln's architectures, written once against [`kiln_core::Backend`].
//!
//! [`Model::load`] reads a GGUF file or a Hugging Face directory, settles the format's
//! conventions, and uploads the weights in their stored dtype; [`Model::forward`] runs
//! tokens through it.

mod batch;
pub mod chat;
mod checkpoint;
mod config;
mod config_gguf;
mod config_hf;
mod convert;
pub mod generate;
mod kv_cache;
mod load;
pub mod memory;
mod model;
mod model_gguf;
mod model_hf;
mod parameters;
mod perplexity;
pub mod sampler;
mod source;
mod synthetic;
pub mod tp;
mod weights;

pub use batch::{BatchItem, HiddenPass, PagedKvCache, StepOutput, StepWant};
pub use checkpoint::Checkpoint;
pub use config::{Arch, Ffn, Llama3Scaling, ModelConfig, Norm, Rope};
pub use convert::convert_hf_to_gguf;
pub use generate::{generate, GenerateOptions, Generation, StopReason};
pub use kv_cache::{check_kv_type, KvCache};
pub use model::{Logits, Model};
pub use model_gguf::{gguf_writer, GgufExport};
pub use model_hf::HfFiles;
pub use perplexity::{perplexity, Perplexity};
pub use sampler::{Sampler, SamplerConfig};
pub use synthetic::{SyntheticShape, SyntheticType};

use kiln_core::{Backend, Error, Result};
use kiln_io::gguf::GgufFile;
use kiln_io::{detect_format, FileFormat};
use std::path::Path;
use std::sync::Arc;

impl Model {
    /// Load a model from a `.gguf` file or a Hugging Face model directory.
    pub fn load(
        path: &Path,
        backend: Arc<dyn Backend>,
        progress: Option<&dyn Fn(u64)>,
    ) -> Result<Model> {
        match detect_format(path)? {
            FileFormat::Gguf => Self::from_gguf(&GgufFile::open(path)?, backend, progress),
            FileFormat::HfDirectory => Self::from_hf_dir(path, backend, progress),
            FileFormat::Safetensors => Err(Error::unsupported(format!(
                "{}: a lone safetensors file has no config; give its Hugging Face directory",
                path.display()
            ))),
        }
    }

    /// `progress`, when given, is told the bytes of each tensor as it is uploaded.
    pub fn from_gguf(
        file: &GgufFile,
        backend: Arc<dyn Backend>,
        progress: Option<&dyn Fn(u64)>,
    ) -> Result<Model> {
        let config = config_gguf::config_from_gguf(file)?;
        checkpoint::load_model(&source::GgufSource(file), config, false, backend, progress)
    }

    /// A random-weight model of a known shape (see [`SyntheticShape`]).
    pub fn synthetic(
        shape: SyntheticShape,
        ty: SyntheticType,
        backend: Arc<dyn Backend>,
    ) -> Result<Model> {
        Self::synthetic_from_config(shape.config(), ty, backend)
    }

    pub fn from_hf_dir(
        dir: &Path,
        backend: Arc<dyn Backend>,
        progress: Option<&dyn Fn(u64)>,
    ) -> Result<Model> {
        Checkpoint::open_hf_dir(dir)?.load(backend, progress)
    }
}
