//! A group of ranks that compute together, each on its own device (tensor parallelism):
//! what a model split over several devices needs of them. NCCL's communicators (kiln-cuda)
//! and a group of threads of one process over any backend (kiln-dist) implement it.

use crate::{Error, Result, Tensor};

pub trait Collective: Send + Sync {
    /// This rank's index, `0..world`.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn world(&self) -> usize;
    /// `t` (on this rank's device) becomes the elementwise sum of every rank's `t`, the
    /// same on every rank. Every rank must call it, in the same order.
    fn all_reduce_sum(&self, t: &mut Tensor) -> Result<()>;

    /// `whole` (on this rank's device, `world` times `part`'s elements, of its dtype)
    /// becomes every rank's `part` one after another in rank order, the same on every
    /// rank. Every rank must call it, in the same order.
    fn all_gather(&self, part: &Tensor, whole: &mut Tensor) -> Result<()>;

    /// `part` (`whole`'s elements / `world`, F32) becomes chunk `rank` of the elementwise
    /// sum of every rank's `whole`: what each rank of a sharded optimizer updates. Every
    /// rank must call it, in the same order.
    fn reduce_scatter_sum(&self, whole: &Tensor, part: &mut Tensor) -> Result<()>;

    /// Start summing values `offset..offset + len` of `t` (F32, F16 or BF16) over the
    /// ranks: after the work this rank's device was given before, and beside the work
    /// given after, until [`Collective::wait_started`]. Gradient buckets overlap the
    /// backward pass this way; nothing may read or write the span until then. Every rank
    /// must call it, in the same order, with the same spans.
    fn start_sum(&self, t: &mut Tensor, offset: usize, len: usize) -> Result<()>;

    /// The work this rank's device is given from here on runs after every started sum.
    fn wait_started(&self) -> Result<()>;

    /// An error if the group can no longer be trusted: aborted (by this rank or its
    /// watchdog) or failed in the library (a peer gone). A recorded step replays its
    /// collectives without calling them, so callers check after each step.
    fn check(&self) -> Result<()>;

    /// This rank stops for `why`: the group's collectives under way or to come end with an
    /// error on every rank instead of waiting for this one for ever.
    fn abort(&self, why: &str);
}

/// Refuse a gather or scatter (`op`) whose tensors do not fit each other: `whole` holds
/// `world` times `part`'s values, both of one type.
pub fn check_parts(op: &str, world: usize, part: &Tensor, whole: &Tensor) -> Result<()> {
    let n = part.shape().numel();
    if part.dtype() != whole.dtype() || whole.shape().numel() != n * world {
        return Err(Error::shape(format!(
            "{op}: {n} {} values a rank over {world} ranks, and {} {} values in all (the whole is world × a rank's part, of one type)",
            part.dtype(),
            whole.shape().numel(),
            whole.dtype()
        )));
    }
    Ok(())
}

/// Refuse a span of `t` (`op`) that runs past its end or is empty.
pub fn check_span(op: &str, t: &Tensor, offset: usize, len: usize) -> Result<()> {
    let n = t.shape().numel();
    if len == 0 || offset.checked_add(len).is_none_or(|end| end > n) {
        return Err(Error::shape(format!(
            "{op}: values {offset}..{offset}+{len} of a tensor of {n} (a span is non-empty and inside the tensor)"
        )));
    }
    Ok(())
}
