//! The ranks of a run split over several devices of this machine, a thread each: GPUs
//! cuda:0..N summing through NCCL, or shares of the CPU's threads summing through host
//! memory (`--device cpu`). Used by `kiln run --tp` and `kiln train --dp`.

use crate::console::{CliResult, Failure};
use crate::model_file::DeviceChoice;
use kiln_core::{Backend, Collective};
use kiln_cpu::CpuBackend;
use kiln_cuda::{CudaBackend, NcclId, PeerBoard};
use std::sync::{Arc, Mutex};

/// A CPU rank's backend and its end of the host group, until the rank takes them.
type CpuRank = Option<(Arc<dyn Backend>, kiln_dist::host::HostCollective)>;

/// Where the ranks run and how they sum.
pub(crate) enum Ranks {
    /// NCCL's id, and the board where the ranks set up the one-shot all-reduce.
    Cuda(NcclId, Arc<PeerBoard>),
    /// One group of host collectives, taken by the ranks in turn.
    Cpu(Mutex<Vec<CpuRank>>),
}

impl Ranks {
    /// `n` ranks on `device`; `flag` names the option in messages (`--tp`, `--dp`).
    pub(crate) fn new(
        flag: &str,
        n: usize,
        device: DeviceChoice,
        threads: Option<usize>,
    ) -> CliResult<Ranks> {
        match device {
            DeviceChoice::Cpu => {
                let total = threads
                    .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
                let each = (total / n).max(1);
                let backends = (0..n)
                    .map(|_| Ok(Arc::new(CpuBackend::new(Some(each))?) as Arc<dyn Backend>))
                    .collect::<kiln_core::Result<Vec<_>>>()?;
                let group = kiln_dist::host::group(backends.clone());
                Ok(Ranks::Cpu(Mutex::new(
                    backends.into_iter().zip(group).map(Some).collect(),
                )))
            }
            DeviceChoice::Auto | DeviceChoice::Cuda(0) => {
                let gpus = kiln_cuda::devices().map_or(0, |d| d.len());
                if gpus < n {
                    return Err(Failure::usage(format!(
                        "{flag} {n}: this machine has {gpus} NVIDIA GPU(s) (--device cpu splits over the CPU's threads)"
                    )));
                }
                Ok(Ranks::Cuda(NcclId::new()?, PeerBoard::new(n)?))
            }
            other => Err(Failure::usage(format!(
                "{flag} with --device {other}: the ranks are cuda:0..N (--device cuda) or the CPU (--device cpu)"
            ))),
        }
    }

    /// Rank `rank`'s backend and its end of the collective.
    pub(crate) fn take(
        &self,
        rank: usize,
        world: usize,
    ) -> CliResult<(Arc<dyn Backend>, Arc<dyn Collective>)> {
        match self {
            Ranks::Cuda(id, board) => {
                let cuda = Arc::new(CudaBackend::new(rank)?);
                let comm: Arc<dyn Collective> =
                    Arc::new(cuda.communicator_in_process(id, board, rank, world)?);
                Ok((cuda, comm))
            }
            Ranks::Cpu(slots) => {
                let (b, c) = slots.lock().unwrap_or_else(|e| e.into_inner())[rank]
                    .take()
                    .ok_or_else(|| Failure::usage(format!("rank {rank} taken twice")))?;
                Ok((b, Arc::new(c)))
            }
        }
    }
}
