//! A step's results from its logits: greedy picks, draws, or the logits themselves.

use super::{i32_bytes, BatchItem, StepOutput, StepWant};
use crate::model::{download_f32, Model};
use kiln_core::{DType, Error, Result, Shape, Tensor};

impl Model {
    /// Each item's result: item `i`'s logits are row `row_of[i]` of `logits` (`None`: it
    /// wants nothing). `argmax`, when given, holds every row's greedy pick, made on the
    /// device with the logits; else the picks are made here when some item wants one.
    pub(crate) fn read_outputs(
        &self,
        items: &[&BatchItem],
        logits: &Tensor,
        row_of: &[Option<usize>],
        argmax: Option<&Tensor>,
    ) -> Result<Vec<StepOutput>> {
        let b = self.backend().as_ref();
        let vocab = self.config.vocab_size;
        let mut outs: Vec<StepOutput> = items.iter().map(|_| StepOutput::Nothing).collect();
        let wants = |w: &dyn Fn(&StepWant) -> bool| items.iter().any(|it| w(&it.want));
        if wants(&|w| *w == StepWant::Argmax) {
            let ids = match argmax {
                Some(ids) => b.download(ids)?,
                None => {
                    let mut ids = b.zeros(DType::I32, Shape::new(vec![logits.dims()[0]])?)?;
                    b.argmax(logits, &mut ids)?;
                    b.download(&ids)?
                }
            };
            for (it, (out, row)) in items.iter().zip(outs.iter_mut().zip(row_of)) {
                if let (StepWant::Argmax, Some(r)) = (&it.want, row) {
                    *out = StepOutput::Token(token(&ids[4 * r..])?);
                }
            }
        }
        let all = if wants(&|w| *w == StepWant::Logits) {
            Some(download_f32(b, logits)?)
        } else {
            None
        };
        // A draw's buffers, made only when some item draws (a greedy step needs none).
        let mut draw = None;
        for (it, (out, r)) in items.iter().zip(outs.iter_mut().zip(row_of)) {
            let Some(r) = *r else { continue };
            match &it.want {
                StepWant::Logits => {
                    let all = all.as_ref().expect("downloaded above");
                    *out = StepOutput::Logits(all[r * vocab..][..vocab].to_vec());
                }
                StepWant::Sample { params, penalized } => {
                    let (row, one, next) = match &mut draw {
                        Some(d) => d,
                        None => draw.insert((
                            b.zeros(DType::F32, Shape::new(vec![1, vocab])?)?,
                            b.zeros(DType::I32, Shape::new(vec![1])?)?,
                            b.zeros(DType::I32, Shape::new(vec![1])?)?,
                        )),
                    };
                    b.write(one, &i32_bytes(&[r as i32]))?;
                    b.embedding(logits, one, row)?;
                    b.sample(row, penalized, params, next)?;
                    *out = StepOutput::Token(token(&b.download(next)?)?);
                }
                StepWant::Argmax | StepWant::Nothing => {}
            }
        }
        Ok(outs)
    }
}

/// The token id at the start of `bytes` (an I32 the device wrote).
fn token(bytes: &[u8]) -> Result<u32> {
    let id = bytes
        .get(..4)
        .and_then(|b| <[u8; 4]>::try_from(b).ok())
        .map(i32::from_le_bytes)
        .ok_or_else(|| Error::Device(format!("a token read back as {} bytes", bytes.len())))?;
    u32::try_from(id).map_err(|_| Error::Device(format!("the device picked token {id}")))
}
