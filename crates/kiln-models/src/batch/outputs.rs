//! A step's results from its logits: greedy picks, draws, or the logits themselves.

use super::{BatchItem, StepOutput, StepWant};
use crate::model::{download_f32, Model};
use kiln_core::backend::token_ids;
use kiln_core::{DType, Error, Result, RowDraw, Shape, Tensor};

impl Model {
    /// Each item's result: item `i`'s logits are row `row_of[i]` of `logits` (`None`: it
    /// wants nothing; a draw's repetition penalty changes its row). `argmax`, when given, holds every row's greedy pick, made on the
    /// device with the logits; else the picks are made here when some item wants one.
    pub(crate) fn read_outputs(
        &self,
        items: &[&BatchItem],
        logits: &mut Tensor,
        row_of: &[Option<usize>],
        argmax: Option<&Tensor>,
    ) -> Result<Vec<StepOutput>> {
        let b = self.backend().as_ref();
        let vocab = self.config.vocab_size;
        let mut outs: Vec<StepOutput> = items.iter().map(|_| StepOutput::Nothing).collect();
        let wants = |w: &dyn Fn(&StepWant) -> bool| items.iter().any(|it| w(&it.want));
        if wants(&|w| *w == StepWant::Argmax) {
            let ids = token_ids(&match argmax {
                Some(ids) => b.download(ids)?,
                None => {
                    let mut ids = b.zeros(DType::I32, Shape::new(vec![logits.dims()[0]])?)?;
                    b.argmax(logits, &mut ids)?;
                    b.download(&ids)?
                }
            })?;
            for (it, (out, row)) in items.iter().zip(outs.iter_mut().zip(row_of)) {
                if let (StepWant::Argmax, Some(&r)) = (&it.want, row.as_ref()) {
                    let id = ids.get(r).ok_or_else(|| {
                        Error::Device(format!("row {r} of {} greedy picks", ids.len()))
                    })?;
                    *out = StepOutput::Token(*id);
                }
            }
        }
        let all = if wants(&|w| *w == StepWant::Logits) {
            Some(download_f32(b, logits)?)
        } else {
            None
        };
        // Every draw of the step at once (one launch and one read-back where the device
        // can).
        let mut drawn = Vec::new();
        let mut draws = Vec::new();
        for (i, (it, r)) in items.iter().zip(row_of).enumerate() {
            match (&it.want, *r) {
                (StepWant::Logits, Some(r)) => {
                    let all = all.as_ref().expect("downloaded above");
                    outs[i] = StepOutput::Logits(all[r * vocab..][..vocab].to_vec());
                }
                (StepWant::Sample { params, penalized }, Some(row)) => {
                    drawn.push(i);
                    draws.push(RowDraw {
                        row,
                        penalized,
                        params,
                    });
                }
                _ => {}
            }
        }
        if !draws.is_empty() {
            let ids = b.sample_rows(logits, &draws)?;
            for (i, id) in drawn.into_iter().zip(ids) {
                outs[i] = StepOutput::Token(id);
            }
        }
        Ok(outs)
    }
}
