//! A model file opened and its configuration read, its weights not yet loaded: what a
//! caller needs to plan memory (see [`crate::memory`]) before anything is allocated.

use crate::config::{Arch, ModelConfig};
use crate::load::WeightLoader;
use crate::model::Model;
use crate::source::{GgufSource, HfSource, Source};
use kiln_core::{Backend, Result};
use kiln_io::gguf::GgufFile;
use kiln_io::hf_config::HfConfig;
use kiln_io::safetensors::SafetensorsModel;
use std::path::Path;
use std::sync::Arc;

enum Weights {
    Gguf(GgufFile),
    HfDir {
        name: String,
        st: SafetensorsModel,
        gpt2_prefix: &'static str,
    },
}

pub struct Checkpoint {
    pub config: ModelConfig,
    weights: Weights,
}

impl Checkpoint {
    pub fn from_gguf(file: GgufFile) -> Result<Checkpoint> {
        Ok(Checkpoint {
            config: crate::config_gguf::config_from_gguf(&file)?,
            weights: Weights::Gguf(file),
        })
    }

    pub fn open_hf_dir(dir: &Path) -> Result<Checkpoint> {
        let name = dir.display().to_string();
        let hf = HfConfig::load_dir(dir)?;
        let config = crate::config_hf::config_from_hf(&hf, &name)?;
        let st = SafetensorsModel::open_dir(dir)?;
        let gpt2_prefix = if st.tensor("transformer.wte.weight").is_some() {
            "transformer."
        } else {
            ""
        };
        Ok(Checkpoint {
            config,
            weights: Weights::HfDir {
                name,
                st,
                gpt2_prefix,
            },
        })
    }

    /// The GGUF file, for its tokenizer.
    pub fn gguf(&self) -> Option<&GgufFile> {
        match &self.weights {
            Weights::Gguf(f) => Some(f),
            Weights::HfDir { .. } => None,
        }
    }

    /// Bytes of the weights as stored: what a device needs for them.
    pub fn weight_bytes(&self) -> u64 {
        self.with_source(|src| src.stored_bytes().unwrap_or(0))
    }

    fn with_source<T>(&self, f: impl FnOnce(&dyn Source) -> T) -> T {
        match &self.weights {
            Weights::Gguf(file) => f(&GgufSource(file)),
            Weights::HfDir {
                name,
                st,
                gpt2_prefix,
            } => f(&HfSource {
                model: st,
                dir: name.clone(),
                gpt2_prefix,
            }),
        }
    }

    /// Upload the weights to `backend`; `progress`, when given, is told the bytes of each
    /// tensor as it is uploaded.
    pub fn load(&self, backend: Arc<dyn Backend>, progress: Option<&dyn Fn(u64)>) -> Result<Model> {
        let hf = matches!(self.weights, Weights::HfDir { .. });
        self.with_source(|src| load_model(src, self.config.clone(), hf, backend, progress))
    }

    /// Rank `collective.rank()` of the model split over `collective.world()` ranks (see
    /// [`crate::tp`]): its slices of the weights on `backend`.
    pub fn load_rank(
        &self,
        backend: Arc<dyn Backend>,
        collective: Arc<dyn kiln_core::Collective>,
    ) -> Result<Model> {
        let hf = matches!(self.weights, Weights::HfDir { .. });
        self.with_source(|src| Model::rank_of(src, self.config.clone(), hf, backend, collective))
    }
}

/// The model of `config` with weights from `src`; `hf` for a Hugging Face checkpoint.
pub(crate) fn load_model(
    src: &dyn Source,
    config: ModelConfig,
    hf: bool,
    backend: Arc<dyn Backend>,
    progress: Option<&dyn Fn(u64)>,
) -> Result<Model> {
    // Hugging Face stores Gemma norms as `w` (kiln computes with `1 + w`) and GPT-2's
    // linear weights as Conv1D `[in, out]`.
    let weights = WeightLoader {
        src,
        backend: backend.as_ref(),
        cfg: &config,
        norm_plus_one: hf && matches!(config.arch, Arch::Gemma | Arch::Gemma2),
        transpose_linear: hf && config.arch == Arch::Gpt2,
        progress,
    }
    .load()?;
    Ok(Model::new(config, weights, backend))
}
