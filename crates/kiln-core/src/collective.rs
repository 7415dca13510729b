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
