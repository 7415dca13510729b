//! What a trainer writes: checkpoints (weights, optimizer state, step, RNG), and the
//! trained model as GGUF or Hugging Face files.

use super::{layout_of, Trainer};
use crate::checkpoint::{self, RunState};
use crate::lora::{self, Adapter};
use kiln_core::{DType, Error, Result};
use kiln_io::gguf::{GgufWriter, Value};
use kiln_tokenizer::Tokenizer;
use std::path::Path;

impl Trainer {
    /// The model's weights with the adapters' updates merged: `w + scale · B · A` for each
    /// adapted weight (in the model's layout), others unchanged.
    fn merge_adapters(&self, name: &str, values: &mut Vec<f32>) -> Result<()> {
        let adapters = self.tape.adapters();
        let Some(ad) = adapters.list.iter().find(|ad| ad.weight == name) else {
            return Ok(());
        };
        let inner = self.tape.inner().as_ref();
        let (a, b) = (lora::download(inner, &ad.a)?, lora::download(inner, &ad.b)?);
        let (m, k) = (ad.b.dims()[0], ad.a.dims()[1]);
        *values = lora::merged(values, &a, &b, m, k, ad.scale);
        Ok(())
    }

    /// The name the start file gave the model.
    fn model_name(&self) -> String {
        match self.carried.iter().find(|(k, _)| k == "general.name") {
            Some((_, Value::String(n))) => n.clone(),
            _ => "kiln-trained".into(),
        }
    }

    /// The start file's tokenizer and name, into `w`.
    fn add_carried(&self, w: &mut GgufWriter) -> Result<()> {
        for (k, v) in &self.carried {
            w.set(k, v.clone())?;
        }
        Ok(())
    }

    /// Write a checkpoint to `path` (atomically; see [`checkpoint`]): the model's
    /// weights, the optimizer's state as kiln-optim saves it, the step, the random
    /// generator, the settings. Refused, before anything is written, after an update that
    /// made a parameter non-finite.
    pub fn save_checkpoint(&self, path: &Path) -> Result<()> {
        self.checkpoint()?.write(path)
    }

    /// What [`Trainer::save_checkpoint`] writes, on the host: for a writer that runs
    /// beside the next steps. With a sharded optimizer every rank takes part (as in
    /// [`Trainer::join_save`]).
    pub fn checkpoint(&self) -> Result<checkpoint::Checkpoint> {
        self.check_not_broken()?;
        // The model's own weights (frozen under LoRA) and each adapter's matrices apart,
        // so that a resumed run goes on exactly.
        let mut w = match self.frozen_source {
            Some(_) => self.model.to_gguf_declared(&self.model_name())?,
            None => self.model.to_gguf_as_stored(&self.model_name())?,
        };
        self.add_carried(&mut w)?;
        for ad in &self.tape.adapters().list {
            let (a, b) = Adapter::tensor_names(&ad.weight);
            for (name, t) in [(a, &ad.a), (b, &ad.b)] {
                let bytes = self.tape.inner().download(t)?;
                w.add_tensor(&name, DType::F32, t.dims(), bytes)?;
            }
        }
        checkpoint::add_state(
            &mut w,
            &RunState {
                step: self.step as u64,
                rng: self.rng.state,
                settings: self.settings.clone(),
                data: self.data.fingerprint(),
                optimizer: self.gather_optimizer()?,
            },
        )?;
        Ok(checkpoint::Checkpoint {
            writer: w,
            frozen: self.frozen_source.clone(),
        })
    }

    fn check_not_broken(&self) -> Result<()> {
        match &self.broken {
            Some(why) => Err(Error::format(format!("nothing is written: {why}"))),
            None => Ok(()),
        }
    }

    /// Write the model to `path` as GGUF, matrices as `dtype` (atomically).
    pub fn export_gguf(&self, path: &Path, dtype: DType) -> Result<()> {
        self.check_not_broken()?;
        // The adapters' updates merged in; each tensor is made as the file is written.
        let mut export = self
            .model
            .to_gguf_with(&self.model_name(), dtype, |n, v| self.merge_adapters(n, v))?;
        self.add_carried(&mut export.writer)?;
        kiln_io::file::write_replacing(path, |b| export.write_to(b))
    }

    /// Write the model to the directory `dir` as Hugging Face lays a model out
    /// (`config.json`, `model.safetensors` in F32, and `tokenizer`'s files), each file
    /// atomically; llama and mistral models (a SentencePiece vocabulary or a tokenizer.json).
    pub fn export_hf(&self, dir: &Path, tokenizer: &Tokenizer) -> Result<()> {
        self.check_not_broken()?;
        let model = self.model.to_hf_with(
            tokenizer.bos_id(),
            tokenizer.eos_ids().first().copied(),
            |n, v| self.merge_adapters(n, v),
        )?;
        let mut files = vec![("config.json", model.config.clone())];
        files.extend(tokenizer.hf_files()?);
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir.display(), e))?;
        kiln_io::file::write_replacing(&dir.join("model.safetensors"), |w| model.write_weights(w))?;
        for (name, bytes) in files {
            kiln_io::file::write_replacing(&dir.join(name), |w| {
                use std::io::Write;
                w.write_all(&bytes)
            })?;
        }
        Ok(())
    }

    /// The flat master weights, read from the backend (gaps of the layout included; for
    /// comparing runs).
    pub fn parameters_flat(&self) -> Result<Vec<f32>> {
        let bytes = self.tape.inner().download(&self.params)?;
        // A sharded run's buffer is padded to a multiple of the ranks: not parameters.
        let numel = layout_of(&self.opt, &self.shard).numel();
        Ok(bytes
            .chunks_exact(4)
            .take(numel)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }
}
