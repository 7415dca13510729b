//! Checkpoints: one GGUF file that `kiln run` loads like any model (its weights F32 under
//! GGUF's names, its configuration and tokenizer as metadata) and that also holds the
//! run's state: the optimizer's moments as two flat tensors, the step, the random
//! generator, the settings and the data's fingerprint under `kiln.train.*` keys. It is
//! written beside its final name and renamed over it (`kiln_io::file::write_replacing`):
//! a crash while saving leaves the last complete checkpoint.

use crate::trainer::Settings;
use kiln_core::{quant, DType, Error, Result};
use kiln_io::gguf::{GgufFile, GgufWriter, Value};
use std::io::Write;
use std::path::Path;

const STEP: &str = "kiln.train.step";
const RNG: &str = "kiln.train.rng";
const ADAM_T: &str = "kiln.train.adam_t";
const SETTINGS: &str = "kiln.train.settings";
const DATA: &str = "kiln.train.data";
const MOMENT1: &str = "train.adam.m";
const MOMENT2: &str = "train.adam.v";

/// For tests of a crash while saving: when this variable is set, the process aborts
/// once it has written half of a checkpoint's temporary file (before the rename).
pub const ABORT_IN_SAVE: &str = "KILN_TEST_ABORT_IN_SAVE";

/// The run's state beside the model's weights.
pub struct RunState {
    pub step: u64,
    pub rng: u64,
    /// Updates the optimizer took (its bias correction's `t`).
    pub adam_t: u64,
    pub settings: Settings,
    pub data: String,
    pub m: Vec<f32>,
    pub v: Vec<f32>,
}

/// Add `state` to `w`, a model's GGUF writer.
pub fn add_state(w: &mut GgufWriter, state: &RunState) -> Result<()> {
    let settings = serde_json::to_string(&state.settings)
        .map_err(|e| Error::format(format!("settings: {e}")))?;
    w.set(STEP, Value::U64(state.step))?;
    w.set(RNG, Value::U64(state.rng))?;
    w.set(ADAM_T, Value::U64(state.adam_t))?;
    w.set(SETTINGS, Value::String(settings))?;
    w.set(DATA, Value::String(state.data.clone()))?;
    for (name, values) in [(MOMENT1, &state.m), (MOMENT2, &state.v)] {
        w.add_tensor(
            name,
            DType::F32,
            &[values.len()],
            quant::quantize(DType::F32, values)?,
        )?;
    }
    Ok(())
}

/// Write `w` to `path` atomically (see the module's documentation).
pub fn write(w: &GgufWriter, path: &Path) -> Result<()> {
    let abort_at = std::env::var_os(ABORT_IN_SAVE).map(|_| w.tensor_data_len() / 2);
    kiln_io::file::write_replacing(path, |b| match abort_at {
        None => w.write_to(b),
        Some(at) => w.write_to(&mut AbortAfter { inner: b, left: at }),
    })
}

/// A writer that aborts the process after `left` bytes: a crash in the middle of a save.
struct AbortAfter<W> {
    inner: W,
    left: u64,
}

impl<W: Write> Write for AbortAfter<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if buf.len() as u64 >= self.left {
            let _ = self.inner.write_all(&buf[..self.left as usize]);
            let _ = self.inner.flush();
            eprintln!("{ABORT_IN_SAVE}: aborting in the middle of a save");
            std::process::abort();
        }
        self.left -= buf.len() as u64;
        self.inner.write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
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
    let moment = |name: &str| -> Result<Vec<f32>> {
        let t = f.tensor(name).ok_or_else(|| missing(name))?;
        if t.ggml_type.dtype() != Some(DType::F32) {
            return Err(Error::format(format!(
                "{file}: {name} is {}, not f32",
                t.ggml_type
            )));
        }
        quant::dequantize_to_vec(DType::F32, f.tensor_data(t), t.numel() as usize)
    };
    Ok(RunState {
        step: uint(STEP)?,
        rng: uint(RNG)?,
        adam_t: uint(ADAM_T)?,
        settings,
        data: string(DATA)?,
        m: moment(MOMENT1)?,
        v: moment(MOMENT2)?,
    })
}

/// Whether `name` is a tensor of the run's state (not of the model).
pub fn is_state_tensor(name: &str) -> bool {
    name == MOMENT1 || name == MOMENT2
}
