//! An optimizer's state as bytes, for checkpoints.
//!
//! Layout: `KILNOPT\0`, a u32 version, a u32 header length, the header (JSON: the rule
//! and the tensors' names and shapes, which must match on load), the control block
//! ([`StepControl`]: step, learning rate clock, loss scale), then each state buffer as
//! f32 little-endian values. A checkpoint restores exactly: the next step after a load
//! is bit-equal to the step an uninterrupted run takes.

use crate::{Optimizer, ParamLayout, Rule, StepControl};
use kiln_core::{Backend, Error, Result};

const MAGIC: &[u8; 8] = b"KILNOPT\0";
const VERSION: u32 = 1;

fn header(rule: &Rule, layout: &ParamLayout) -> String {
    let entries: Vec<serde_json::Value> = layout
        .entries()
        .iter()
        .map(|e| serde_json::json!([e.name, e.shape]))
        .collect();
    serde_json::json!({
        // Debug formatting of f64 round-trips exactly, so equal text is an equal rule.
        "rule": format!("{:?}", rule),
        "states": rule.states(),
        "numel": layout.numel(),
        "layout": entries,
    })
    .to_string()
}

fn state_bytes(header: &str, control: &[u8], states: &[Vec<u8>]) -> Vec<u8> {
    let mut out = Vec::with_capacity(
        16 + header.len() + control.len() + states.iter().map(Vec::len).sum::<usize>(),
    );
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&(header.len() as u32).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(control);
    for s in states {
        out.extend_from_slice(s);
    }
    out
}

impl Optimizer {
    fn header(&self) -> String {
        header(&self.config.rule, &self.layout)
    }

    /// The optimizer's state (control block and state buffers) as bytes. Reads from the
    /// device.
    pub fn save(&self, backend: &dyn Backend) -> Result<Vec<u8>> {
        let states = self
            .states
            .iter()
            .map(|s| backend.download(s))
            .collect::<Result<Vec<_>>>()?;
        Ok(state_bytes(
            &self.header(),
            &backend.download(&self.control)?,
            &states,
        ))
    }

    /// For an optimizer that updates one shard of the parameters (ZeRO stage 1): the
    /// bytes [`Optimizer::save`] of an optimizer over all of them, laid out as `whole`,
    /// would write, from this one's control block and every shard's states gathered
    /// (`states`: one buffer per state of the rule, each at least `whole.numel()` F32
    /// values, its padding past them dropped). A run resumes from them sharded or not.
    pub fn save_whole(
        &self,
        backend: &dyn Backend,
        whole: &ParamLayout,
        states: &[Vec<u8>],
    ) -> Result<Vec<u8>> {
        let len = 4 * whole.numel();
        if states.len() != self.states.len() || states.iter().any(|s| s.len() < len) {
            return Err(Error::shape(format!(
                "optimizer state: {} gathered states for {} of {} values",
                states.len(),
                self.states.len(),
                whole.numel()
            )));
        }
        let trimmed: Vec<Vec<u8>> = states.iter().map(|s| s[..len].to_vec()).collect();
        Ok(state_bytes(
            &header(&self.config.rule, whole),
            &backend.download(&self.control)?,
            &trimmed,
        ))
    }

    /// Restore this shard's part of a state written for all parameters laid out as
    /// `whole` ([`Optimizer::save`] or [`Optimizer::save_whole`]): the control block,
    /// and elements `first..` of each state buffer (zeros past the end: padding).
    pub fn load_shard(
        &mut self,
        backend: &dyn Backend,
        bytes: &[u8],
        whole: &ParamLayout,
        first: usize,
    ) -> Result<()> {
        let (control, states) = parse(
            bytes,
            &header(&self.config.rule, whole),
            self.states.len(),
            whole.numel(),
        )?;
        let n = self.layout.numel();
        let mut parts = Vec::with_capacity(states.len());
        for s in &states {
            let mut part = vec![0u8; 4 * n];
            let from = (4 * first).min(s.len());
            let to = (4 * (first + n)).min(s.len());
            part[..to - from].copy_from_slice(&s[from..to]);
            parts.push(part);
        }
        backend.write(&mut self.control, control)?;
        for (t, p) in self.states.iter_mut().zip(&parts) {
            backend.write(t, p)?;
        }
        Ok(())
    }

    /// Restore a state written by [`Optimizer::save`] of an optimizer with the same rule
    /// and layout; anything else is an error saying what differs, and leaves this
    /// optimizer as it was.
    pub fn load(&mut self, backend: &dyn Backend, bytes: &[u8]) -> Result<()> {
        let (control, states) = parse(
            bytes,
            &self.header(),
            self.states.len(),
            self.layout.numel(),
        )?;
        backend.write(&mut self.control, control)?;
        for (t, s) in self.states.iter_mut().zip(states) {
            backend.write(t, s)?;
        }
        Ok(())
    }
}

/// The control block and state buffers of `bytes`, checked against the header `ours`
/// (`states` buffers of `numel` values each): an error saying what differs.
fn parse<'a>(
    bytes: &'a [u8],
    ours: &str,
    states: usize,
    numel: usize,
) -> Result<(&'a [u8], Vec<&'a [u8]>)> {
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
    let saved: serde_json::Value =
        serde_json::from_slice(header).map_err(|e| bad(format!("its header is not JSON: {e}")))?;
    let ours: serde_json::Value = serde_json::from_str(ours).expect("our own header is JSON");
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
    let state_len = 4 * numel;
    let body = &bytes[16 + header_len..];
    let want = control_len + state_len * states;
    if body.len() != want {
        return Err(bad(format!(
            "{} bytes of state, {want} expected",
            body.len()
        )));
    }
    StepControl::from_bytes(&body[..control_len])?;
    let buffers = (0..states)
        .map(|i| &body[control_len + i * state_len..control_len + (i + 1) * state_len])
        .collect();
    Ok((&body[..control_len], buffers))
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
