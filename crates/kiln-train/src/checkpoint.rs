//! Checkpoints: one GGUF file that `kiln run` loads like any model (its weights F32 under
//! GGUF's names, its configuration and tokenizer as metadata) and that also holds the
//! run's state: the optimizer's state as kiln-optim saves it (one `i8` tensor of its
//! bytes: control block and state buffers), the step, the random generator, the settings
//! and the data's fingerprint under `kiln.train.*` keys. It is written beside its final
//! name and renamed over it (`kiln_io::file::write_replacing`): a crash while saving
//! leaves the last complete checkpoint.

use crate::trainer::Settings;
use kiln_core::{Error, Result};
use kiln_io::gguf::{GgufFile, GgufWriter, Value};
use kiln_io::GgmlType;
use std::path::Path;

const STEP: &str = "kiln.train.step";
const RNG: &str = "kiln.train.rng";
const SETTINGS: &str = "kiln.train.settings";
const DATA: &str = "kiln.train.data";
const OPTIMIZER: &str = "train.optimizer";

/// ggml's `i8`: the optimizer's state is bytes, not numbers to compute with.
const I8: u32 = 24;

/// The run's state beside the model's weights.
pub struct RunState {
    pub step: u64,
    pub rng: u64,
    pub settings: Settings,
    pub data: String,
    /// `kiln_optim::Optimizer::save`'s bytes.
    pub optimizer: Vec<u8>,
}

/// Add `state` to `w`, a model's GGUF writer.
pub fn add_state(w: &mut GgufWriter, state: &RunState) -> Result<()> {
    let settings = serde_json::to_string(&state.settings)
        .map_err(|e| Error::format(format!("settings: {e}")))?;
    w.set(STEP, Value::U64(state.step))?;
    w.set(RNG, Value::U64(state.rng))?;
    w.set(SETTINGS, Value::String(settings))?;
    w.set(DATA, Value::String(state.data.clone()))?;
    let i8 = GgmlType::from_id(I8).expect("ggml knows i8");
    w.add_raw_tensor(
        OPTIMIZER,
        i8,
        vec![state.optimizer.len() as u64],
        state.optimizer.clone(),
    )
}

/// A checkpoint's contents, copied off the device ([`crate::Trainer::checkpoint`]): the
/// run may go on while another thread writes them. A LoRA run's frozen weights are not
/// copied: they are read from the start file, which holds them as they are, while the
/// checkpoint is written.
pub struct Checkpoint {
    pub(crate) writer: GgufWriter,
    pub(crate) frozen: Option<GgufFile>,
}

impl Checkpoint {
    /// Write it to `path` atomically (see the module's documentation).
    pub fn write(&self, path: &Path) -> Result<()> {
        kiln_io::file::write_replacing(path, |b| {
            self.writer.write_to_making(b, |name| {
                let f = self.frozen.as_ref().ok_or_else(|| {
                    Error::shape(format!("{name}: the checkpoint holds no bytes for it"))
                })?;
                let t = f.tensor(name).ok_or_else(|| {
                    Error::format(format!("{}: {name} is missing", f.path.display()))
                })?;
                Ok(f.tensor_data(t).to_vec())
            })
        })
    }
}

/// The run's state in checkpoint `f`; an error names what is missing or wrong.
pub fn read_state(f: &GgufFile) -> Result<RunState> {
    let file = f.path.display();
    let missing = |k: &str| {
        Error::format(format!(
            "{file}: {k} is missing: not a kiln training checkpoint (a model to start from is given with --from)"
        ))
    };
    let uint =
        |k: &str| -> Result<u64> { f.get(k).and_then(Value::as_u64).ok_or_else(|| missing(k)) };
    let string = |k: &str| -> Result<String> {
        match f.get(k) {
            Some(Value::String(s)) => Ok(s.clone()),
            _ => Err(missing(k)),
        }
    };
    let settings: Settings = serde_json::from_str(&string(SETTINGS)?)
        .map_err(|e| Error::format(format!("{file}: {SETTINGS}: {e}")))?;
    let t = f.tensor(OPTIMIZER).ok_or_else(|| missing(OPTIMIZER))?;
    if t.ggml_type.id != I8 {
        return Err(Error::format(format!(
            "{file}: {OPTIMIZER} is {}, not i8",
            t.ggml_type
        )));
    }
    Ok(RunState {
        step: uint(STEP)?,
        rng: uint(RNG)?,
        settings,
        data: string(DATA)?,
        optimizer: f.tensor_data(t).to_vec(),
    })
}
