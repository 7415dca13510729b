//! An optimizer's state as bytes, for checkpoints.
//!
//! Layout: `KILNOPT\0`, a u32 version, a u32 header length, the header (JSON: the rule
//! and the tensors' names and shapes, which must match on load), the control block
//! ([`StepControl`]: step, learning rate clock, loss scale), then each state buffer as
//! f32 little-endian values. A checkpoint restores exactly: the next step after a load
//! is bit-equal to the step an uninterrupted run takes.

use crate::{Optimizer, StepControl};
use kiln_core::{Backend, Error, Result};

const MAGIC: &[u8; 8] = b"KILNOPT\0";
const VERSION: u32 = 1;

impl Optimizer {
    fn header(&self) -> String {
        let layout: Vec<serde_json::Value> = self
            .layout
            .entries()
            .iter()
            .map(|e| serde_json::json!([e.name, e.shape]))
            .collect();
        serde_json::json!({
            // Debug formatting of f64 round-trips exactly, so equal text is an equal rule.
            "rule": format!("{:?}", self.config.rule),
            "states": self.config.rule.states(),
            "numel": self.layout.numel(),
            "layout": layout,
        })
        .to_string()
    }

    /// The optimizer's state (control block and state buffers) as bytes. Reads from the
    /// device.
    pub fn save(&self, backend: &dyn Backend) -> Result<Vec<u8>> {
        let header = self.header();
        let mut out = Vec::with_capacity(
            16 + header.len() + 80 + 4 * self.layout.numel() * self.states.len(),
        );
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&(header.len() as u32).to_le_bytes());
        out.extend_from_slice(header.as_bytes());
        out.extend_from_slice(&backend.download(&self.control)?);
        for s in &self.states {
            out.extend_from_slice(&backend.download(s)?);
        }
        Ok(out)
    }

    /// Restore a state written by [`Optimizer::save`] of an optimizer with the same rule
    /// and layout; anything else is an error saying what differs, and leaves this
    /// optimizer as it was.
    pub fn load(&mut self, backend: &dyn Backend, bytes: &[u8]) -> Result<()> {
        let bad = |msg: String| Error::format(format!("optimizer state: {msg}"));
        if bytes.len() < 16 || &bytes[..8] != MAGIC {
            return Err(bad("not a kiln optimizer state (no KILNOPT header)".into()));
        }
        let version = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
        if version != VERSION {
            return Err(bad(format!(
                "version {version}; this kiln reads version {VERSION}"
            )));
        }
        let header_len = u32::from_le_bytes(bytes[12..16].try_into().expect("4 bytes")) as usize;
        let header = bytes
            .get(16..16 + header_len)
            .ok_or_else(|| bad(format!("a header of {header_len} bytes past the end")))?;
        let saved: serde_json::Value = serde_json::from_slice(header)
            .map_err(|e| bad(format!("its header is not JSON: {e}")))?;
        let ours: serde_json::Value =
            serde_json::from_str(&self.header()).expect("our own header is JSON");
        for key in ["rule", "states", "numel", "layout"] {
            if saved.get(key) != ours.get(key) {
                return Err(bad(format!(
                    "saved for {key} {}, this optimizer has {}",
                    short(saved.get(key)),
                    short(ours.get(key))
                )));
            }
        }
        let control_len = StepControl::WORDS * 4;
        let state_len = 4 * self.layout.numel();
        let body = &bytes[16 + header_len..];
        let want = control_len + state_len * self.states.len();
        if body.len() != want {
            return Err(bad(format!(
                "{} bytes of state, {want} expected",
                body.len()
            )));
        }
        StepControl::from_bytes(&body[..control_len])?;
        backend.write(&mut self.control, &body[..control_len])?;
        for (i, s) in self.states.iter_mut().enumerate() {
            let at = control_len + i * state_len;
            backend.write(s, &body[at..at + state_len])?;
        }
        Ok(())
    }
}

/// A JSON value for an error message, cut to a readable length.
fn short(v: Option<&serde_json::Value>) -> String {
    let s = v.map_or("nothing".to_string(), |v| v.to_string());
    if s.chars().count() > 160 {
        format!("{}...", s.chars().take(160).collect::<String>())
    } else {
        s
    }
}
