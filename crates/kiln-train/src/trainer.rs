//! The training loop: sequences drawn at random from the training text, each run forward
//! through the model on a [`Tape`] and backward, their gradients summed over the step's
//! sequences; then one optimizer update of the flat parameters, copied back to the
//! model's tensors.
//!
//! The model runs one sequence per forward pass (its KV cache holds one), so a step's
//! `batch × grad_accum` sequences run one after another and their gradients accumulate in
//! the parameters' gradient buffers: `--batch` and `--grad-accum` differ only in name
//! here. Activations are kept for one sequence at a time (no checkpointing of them yet).

use crate::checkpoint::{self, RunState};
use crate::data::TextData;
use crate::optimizer::{clip_global_norm, learning_rate, AdamW, AdamWSettings, Schedule};
use crate::rng::Rng;
use crate::tape::Tape;
use kiln_core::{quant, Backend, DType, Error, Result, Tensor};
use kiln_io::gguf::{GgufFile, GgufWriter, Value};
use kiln_models::{KvCache, Model};
use kiln_tokenizer::Tokenizer;
use serde::{Deserialize, Serialize};
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

/// What defines a run: a resumed run takes these from its checkpoint.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Settings {
    /// Sequences per micro-batch, and micro-batches per optimizer step.
    pub batch: usize,
    pub grad_accum: usize,
    /// Tokens per sequence (each predicts the next, so a window is one longer).
    pub seq_len: usize,
    pub steps: usize,
    /// Peak learning rate, reached after `warmup` steps; the schedule ends at `min_lr`.
    pub lr: f32,
    pub min_lr: f32,
    pub warmup: usize,
    pub schedule: Schedule,
    pub adamw: AdamWSettings,
    /// Global gradient-norm clipping.
    pub clip: Option<f32>,
    pub seed: u64,
    /// Held-out windows of `seq_len` tokens scored at most by one evaluation.
    pub eval_windows: usize,
}

/// What one step did.
#[derive(Clone, Debug)]
pub struct StepReport {
    /// Steps done, this one included.
    pub step: usize,
    /// Mean cross-entropy of the step's tokens (nats).
    pub loss: f64,
    pub lr: f32,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    pub tokens: usize,
}

/// One parameter's place in the flat buffers.
struct Slot {
    range: Range<usize>,
}

pub struct Trainer {
    tape: Arc<Tape>,
    model: Model,
    cache: KvCache,
    settings: Settings,
    data: TextData,
    /// The start file's `tokenizer.*` and `general.name` metadata, for what is written.
    carried: Vec<(String, Value)>,
    /// Every parameter, flat (the optimizer's master copy), and their gradients.
    params: Vec<f32>,
    grads: Vec<f32>,
    slots: Vec<Slot>,
    /// The parameters weight decay applies to: matrices, not norms or biases.
    decay: Vec<Range<usize>>,
    opt: AdamW,
    rng: Rng,
    step: usize,
}

fn f32_values(b: &dyn Backend, t: &Tensor) -> Result<Vec<f32>> {
    quant::dequantize_to_vec(t.dtype(), &b.download(t)?, t.shape().numel())
}

impl Trainer {
    /// A new run from `start`, a model whose weights are all F32 (see
    /// `kiln_train::start`), on a tape over `backend`.
    pub fn new(
        start: &GgufFile,
        data: TextData,
        settings: Settings,
        backend: Arc<dyn Backend>,
    ) -> Result<Trainer> {
        let rng = Rng::new(settings.seed);
        Self::build(start, data, settings, backend, rng)
    }

    /// Go on with the run checkpoint `ckpt` saved, on the same `data`: what it does from
    /// here is what the uninterrupted run would have done.
    pub fn resume(ckpt: &GgufFile, data: TextData, backend: Arc<dyn Backend>) -> Result<Trainer> {
        let state = checkpoint::read_state(ckpt)?;
        let file = ckpt.path.display();
        if state.data != data.fingerprint() {
            return Err(Error::format(format!(
                "{file}: the run trained on other text (its data's fingerprint is {}, this text's {}): give the same --data and --held-out",
                state.data,
                data.fingerprint()
            )));
        }
        let mut t = Self::build(ckpt, data, state.settings, backend, Rng::new(state.rng))?;
        if state.m.len() != t.params.len() || state.v.len() != t.params.len() {
            return Err(Error::format(format!(
                "{file}: the optimizer state holds {} values, the model {} parameters",
                state.m.len(),
                t.params.len()
            )));
        }
        t.opt.m = state.m;
        t.opt.v = state.v;
        t.opt.t = state.adam_t;
        t.step = usize::try_from(state.step).unwrap_or(usize::MAX);
        if t.step > t.settings.steps {
            return Err(Error::format(format!(
                "{file}: step {} is past the run's {} steps",
                t.step, t.settings.steps
            )));
        }
        Ok(t)
    }

    fn build(
        start: &GgufFile,
        data: TextData,
        settings: Settings,
        backend: Arc<dyn Backend>,
        rng: Rng,
    ) -> Result<Trainer> {
        let tape = Arc::new(Tape::new(backend)?);
        let model = Model::from_gguf(start, tape.clone(), None)?;
        check_settings(&settings, &model, &data)?;
        let inner = tape.inner().clone();
        let mut params = Vec::new();
        let mut slots = Vec::new();
        let mut decay = Vec::new();
        for (name, t) in model.parameters() {
            if t.dtype() != DType::F32 {
                return Err(Error::unsupported(format!(
                    "{}: {name} is {}; training starts from F32 weights",
                    start.path.display(),
                    t.dtype()
                )));
            }
            let range = params.len()..params.len() + t.shape().numel();
            params.extend(f32_values(inner.as_ref(), t)?);
            if t.dims().len() == 2 {
                decay.push(range.clone());
            }
            slots.push(Slot { range });
        }
        let refs: Vec<&Tensor> = model.parameters().into_iter().map(|(_, t)| t).collect();
        tape.set_parameters(&refs, &vec![true; refs.len()])?;
        let cache = model.new_cache(settings.seq_len)?;
        let carried = start
            .metadata
            .iter()
            .filter(|(k, _)| k.starts_with("tokenizer.") || k == "general.name")
            .cloned()
            .collect();
        let opt = AdamW::new(settings.adamw, params.len());
        Ok(Trainer {
            grads: vec![0.0; params.len()],
            tape,
            model,
            cache,
            settings,
            data,
            carried,
            params,
            slots,
            decay,
            opt,
            rng,
            step: 0,
        })
    }

    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    /// Steps done so far.
    pub fn steps_done(&self) -> usize {
        self.step
    }

    pub fn data(&self) -> &TextData {
        &self.data
    }

    /// Parameters in all.
    pub fn parameter_count(&self) -> usize {
        self.params.len()
    }

    fn param_refs(&self) -> Vec<&Tensor> {
        self.model
            .parameters()
            .into_iter()
            .map(|(_, t)| t)
            .collect()
    }

    /// The mean loss of `ids` predicting `targets`; with `record`, its gradients (scaled
    /// by `scale`) are added into the parameters'.
    fn sequence(&mut self, ids: &[u32], targets: &[u32], scale: f32, record: bool) -> Result<f64> {
        if record {
            self.tape.begin();
        } else {
            self.tape.stop();
        }
        let tape = self.tape.clone();
        let softcap = self.model.config.final_softcap;
        let losses = self
            .model
            .forward_hidden(ids, 0, &mut self.cache, |h, head| {
                tape.cross_entropy(h, head, targets, softcap, scale)
            })?;
        if record {
            let params = self.param_refs();
            self.tape.backward(&params)?;
        }
        Ok(losses.iter().map(|&l| l as f64).sum())
    }

    /// One optimizer step over `batch × grad_accum` random windows of the training text.
    /// A loss or gradient that is not finite stops the run with an error naming the step;
    /// the parameters are then left as they were.
    pub fn step(&mut self) -> Result<StepReport> {
        let s = self.settings.clone();
        if self.step >= s.steps {
            return Err(Error::format(format!(
                "the run's {} steps are done",
                s.steps
            )));
        }
        let number = self.step + 1;
        let seqs = s.batch * s.grad_accum;
        let tokens = seqs * s.seq_len;
        let scale = 1.0 / tokens as f32;
        self.tape.zero_grads()?;
        let mut sum = 0f64;
        for _ in 0..seqs {
            // Windows of seq_len + 1 tokens, starting anywhere (checked to fit).
            let span = (self.data.train.len() - s.seq_len) as u64;
            let start = self.rng.below(span) as usize;
            let window = self.data.train[start..start + s.seq_len + 1].to_vec();
            sum += self.sequence(&window[..s.seq_len], &window[1..], scale, true)?;
        }
        let loss = sum / tokens as f64;
        if !loss.is_finite() {
            return Err(Error::format(format!(
                "step {number}: the training loss is {loss}; the run stops here (nothing of this step is kept or saved)"
            )));
        }
        self.tape.read_grads(&mut self.grads)?;
        let grad_norm = clip_global_norm(&mut self.grads, s.clip);
        if !grad_norm.is_finite() {
            return Err(Error::format(format!(
                "step {number}: the gradient's norm is {grad_norm}; the run stops here (nothing of this step is kept or saved)"
            )));
        }
        let lr = learning_rate(s.schedule, s.lr, s.min_lr, s.warmup, self.step, s.steps);
        let before = (self.params.clone(), self.opt.m.clone(), self.opt.v.clone());
        self.opt
            .step(&mut self.params, &self.grads, lr, &self.decay);
        if let Some(i) = self.params.iter().position(|p| !p.is_finite()) {
            let bad = self.params[i];
            (self.params, self.opt.m, self.opt.v) = before;
            self.opt.t -= 1;
            return Err(Error::format(format!(
                "step {number}: the update made parameter value {i} {bad} (learning rate {lr:e}); the run stops here (nothing of this step is kept or saved)"
            )));
        }
        self.write_params()?;
        self.step = number;
        Ok(StepReport {
            step: number,
            loss,
            lr,
            grad_norm,
            tokens,
        })
    }

    /// Copy the flat parameters into the model's tensors.
    fn write_params(&mut self) -> Result<()> {
        let inner = self.tape.inner().clone();
        let params = &self.params;
        for ((_, t), slot) in self.model.parameters_mut().into_iter().zip(&self.slots) {
            inner.write(t, f32_bytes(&params[slot.range.clone()]).as_slice())?;
        }
        Ok(())
    }

    /// The mean loss over the held-out text: consecutive windows of `seq_len` tokens, at
    /// most `eval_windows` of them. `exp` of it is the held-out perplexity.
    pub fn held_out_loss(&mut self) -> Result<f64> {
        let seq = self.settings.seq_len;
        let held = std::mem::take(&mut self.data.held_out);
        let mut total = (0f64, 0usize);
        let mut run = || -> Result<()> {
            for start in (0..held.len().saturating_sub(seq))
                .step_by(seq)
                .take(self.settings.eval_windows)
            {
                let window = &held[start..start + seq + 1];
                total.0 += self.sequence(&window[..seq], &window[1..], 1.0, false)?;
                total.1 += seq;
            }
            Ok(())
        };
        let result = run();
        self.data.held_out = held;
        result?;
        Ok(total.0 / total.1.max(1) as f64)
    }

    /// The model as a GGUF writer with the start file's tokenizer and name.
    fn model_gguf(&self, dtype: DType) -> Result<GgufWriter> {
        let name = match self.carried.iter().find(|(k, _)| k == "general.name") {
            Some((_, Value::String(n))) => n.clone(),
            _ => "kiln-trained".into(),
        };
        let mut w = self.model.to_gguf(&name, dtype)?;
        for (k, v) in &self.carried {
            w.set(k, v.clone())?;
        }
        Ok(w)
    }

    /// Write a checkpoint to `path` (atomically; see [`checkpoint`]). Refused, before
    /// anything is written, when a parameter is not finite.
    pub fn save_checkpoint(&self, path: &Path) -> Result<()> {
        if let Some(i) = self.params.iter().position(|p| !p.is_finite()) {
            return Err(Error::format(format!(
                "after step {}: parameter value {i} is {}; no checkpoint is written",
                self.step, self.params[i]
            )));
        }
        let mut w = self.model_gguf(DType::F32)?;
        checkpoint::add_state(
            &mut w,
            &RunState {
                step: self.step as u64,
                rng: self.rng.state,
                adam_t: self.opt.t,
                settings: self.settings.clone(),
                data: self.data.fingerprint(),
                m: self.opt.m.clone(),
                v: self.opt.v.clone(),
            },
        )?;
        checkpoint::write(&w, path)
    }

    /// Write the model to `path` as GGUF, matrices as `dtype` (atomically).
    pub fn export_gguf(&self, path: &Path, dtype: DType) -> Result<()> {
        let w = self.model_gguf(dtype)?;
        kiln_io::file::write_replacing(path, |b| w.write_to(b))
    }

    /// Write the model to the directory `dir` as Hugging Face lays a model out
    /// (`config.json`, `model.safetensors` in F32, and `tokenizer`'s files), each file
    /// atomically; llama and mistral models with SentencePiece vocabularies.
    pub fn export_hf(&self, dir: &Path, tokenizer: &Tokenizer) -> Result<()> {
        let mut files = self
            .model
            .to_hf(tokenizer.bos_id(), tokenizer.eos_ids().first().copied())?;
        files.extend(tokenizer.hf_files()?);
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir.display(), e))?;
        for (name, bytes) in files {
            kiln_io::file::write_replacing(&dir.join(name), |w| {
                use std::io::Write;
                w.write_all(&bytes)
            })?;
        }
        Ok(())
    }

    /// The flat parameters (for comparing runs).
    pub fn parameters_flat(&self) -> &[f32] {
        &self.params
    }
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Refuse settings no run can take: sizes of zero, a context past the model's, text too
/// short for one window.
fn check_settings(s: &Settings, model: &Model, data: &TextData) -> Result<()> {
    let bad = |what: String| Err(Error::format(what));
    for (name, v) in [
        ("batch", s.batch),
        ("grad-accum", s.grad_accum),
        ("seq-len", s.seq_len),
        ("steps", s.steps),
    ] {
        if v == 0 {
            return bad(format!("--{name} 0: it must be at least 1"));
        }
    }
    let context = model.config.max_positions;
    if s.seq_len > context {
        return bad(format!(
            "--seq-len {}: the model's context is {context} positions",
            s.seq_len
        ));
    }
    if data.train.len() <= s.seq_len {
        return bad(format!(
            "the training text is {} tokens; one window of --seq-len {} needs {}",
            data.train.len(),
            s.seq_len,
            s.seq_len + 1
        ));
    }
    if data.held_out.len() <= s.seq_len {
        return bad(format!(
            "the held-out text is {} tokens; one window of --seq-len {} needs {}",
            data.held_out.len(),
            s.seq_len,
            s.seq_len + 1
        ));
    }
    if !(s.lr.is_finite() && s.lr > 0.0 && s.min_lr.is_finite() && s.min_lr >= 0.0) {
        return bad(format!(
            "--lr {} / --min-lr {}: finite, lr > 0",
            s.lr, s.min_lr
        ));
    }
    Ok(())
}
