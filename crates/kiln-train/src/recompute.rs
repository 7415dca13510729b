//! Activation checkpointing: a micro-batch's forward pass keeps only each layer's input,
//! and the backward pass runs each layer again, recorded, just before walking back
//! through it. The activations held at once shrink from every layer's to one layer's
//! (plus one `[tokens, dim]` input a layer), for one more forward pass of the layers.
//!
//! The pass is cut into segments: 0 is the embedding, `l + 1` is layer `l`. The forward
//! runs through on a tape that keeps nothing ([`Tape::begin_checkpointed`]) but notes
//! which segment first reads each parameter, so that a parameter shared by two segments
//! (tied embeddings) is reported whole only after the earlier one's backward. The last
//! layer and the head are recorded as they run: nothing is run twice there.

use crate::tape::Tape;
use kiln_core::{DType, Error, Result, Tensor};
use kiln_models::{BatchItem, Model, PagedKvCache};

/// The losses of `items` (from `loss(normed hidden, output matrix)`), their gradients
/// added into the tape's parameters (`params` as [`Tape::backward`] takes them); `whole`
/// as in [`Tape::backward_with`].
pub(crate) fn checkpointed_pass(
    tape: &Tape,
    model: &Model,
    cache: &mut PagedKvCache,
    items: &[BatchItem],
    params: &[&Tensor],
    loss: impl FnOnce(&Tensor, &Tensor) -> Result<Vec<f32>>,
    whole: &mut dyn FnMut(usize, &Tensor) -> Result<()>,
) -> Result<Vec<f32>> {
    let result = (|| {
        let last = model
            .config
            .n_layers
            .checked_sub(1)
            .ok_or_else(|| Error::shape("checkpointing a model of no layers"))?;
        let inner = tape.inner().clone();
        let g = tape.grad_ops();
        let missing = || Error::Device("backward: a segment's input got no gradient".into());

        tape.begin_checkpointed();
        let mut pass = model.hidden_pass(items, cache)?;
        pass.embed()?;
        let mut inputs = Vec::with_capacity(last);
        for l in 0..last {
            tape.next_segment();
            let mut x = inner.zeros(DType::F32, pass.hidden().shape().clone())?;
            g.copy(pass.hidden(), &mut x)?;
            inputs.push(x);
            pass.layer(l, cache)?;
        }

        tape.record_segment(last + 1);
        let input = tape.input(pass.hidden());
        pass.layer(last, cache)?;
        let losses = pass.head(loss)?;
        let mut dx = tape
            .backward_segment(params, None, Some(input), whole)?
            .ok_or_else(missing)?;
        for l in (0..last).rev() {
            tape.record_segment(l + 1);
            let x = inputs.pop().ok_or_else(missing)?;
            // Not through the tape: the segment starts from this copy as its input value.
            g.copy(&x, pass.hidden_mut())?;
            drop(x);
            let input = tape.input(pass.hidden());
            pass.layer(l, cache)?;
            dx = tape
                .backward_segment(params, Some((pass.hidden(), dx)), Some(input), whole)?
                .ok_or_else(missing)?;
        }
        tape.record_segment(0);
        pass.embed()?;
        tape.backward_segment(params, Some((pass.hidden(), dx)), None, whole)?;
        Ok(losses)
    })();
    // Whatever happened, the next pass starts from a clear tape.
    tape.begin();
    result
}
