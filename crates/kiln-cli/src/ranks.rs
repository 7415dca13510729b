//! The ranks of a run split over several devices, a thread each: GPUs summing through
//! NCCL, or shares of the CPU's threads summing through host memory (`--device cpu`).
//! Used by `kiln run|bench --tp` and `kiln train --dp`.
//!
//! On one host the ranks are cuda:0..N. Over several (`--nnodes M --node-rank K
//! --master-addr HOST:PORT`, the same command on every host but for `--node-rank`), each
//! host runs N/M ranks on its cuda:0..N/M, host K holding ranks K·N/M..; host 0 makes
//! NCCL's id and hands it to the others through `kiln_dist::rendezvous`, which refuses a
//! host whose model or settings differ. Ranks of one process also meet on a
//! [`PeerBoard`] for the one-shot all-reduce; across hosts NCCL does every sum.

use crate::console::{CliResult, Failure};
use crate::model_file::DeviceChoice;
use kiln_core::{Backend, Collective};
use kiln_cpu::CpuBackend;
use kiln_cuda::{CudaBackend, NcclId, PeerBoard};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long host 0 waits for the other hosts to arrive, and they for it.
const RENDEZVOUS: Duration = Duration::from_secs(300);
/// How long a rank whose watchdog aborted its collective has to end before the process
/// is ended for it.
const GRACE: Duration = Duration::from_secs(20);

/// Where this process stands among the hosts of a run.
#[derive(clap::Args, Clone, Debug)]
pub struct NodeArgs {
    /// Hosts the ranks are spread over, the same number on each (NCCL between them).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub nnodes: u16,
    /// This host's place among them, 0..nnodes; host 0 holds rank 0 and the rendezvous.
    #[arg(long, default_value_t = 0)]
    pub node_rank: u16,
    /// host:port where host 0 listens for the others to fetch NCCL's id (with --nnodes).
    #[arg(long)]
    pub master_addr: Option<String>,
}

/// A CPU rank's backend and its end of the host group, until the rank takes them.
type CpuRank = Option<(Arc<dyn Backend>, kiln_dist::host::HostCollective)>;

/// Where the ranks run and how they sum.
pub(crate) enum Devices {
    /// NCCL's id, and where the ranks are threads of one process, the board where they
    /// set up the one-shot all-reduce.
    Cuda(NcclId, Option<Arc<PeerBoard>>),
    /// One group of host collectives, taken by the ranks in turn.
    Cpu(Mutex<Vec<CpuRank>>),
}

/// The ranks this process runs.
pub(crate) struct Ranks {
    pub(crate) devices: Devices,
    /// The global ranks run here.
    here: Range<usize>,
    world: usize,
    /// The collectives of the ranks here, taken so far: a rank that fails ends them all,
    /// so no rank of this process waits for it.
    taken: Mutex<Vec<Arc<dyn Collective>>>,
}

impl Ranks {
    /// `n` ranks in all on `device`, those of this host (`nodes`); `flag` names the
    /// option in messages (`--tp`, `--dp`); `fingerprint` names the model and the
    /// settings, which every host must share.
    pub(crate) fn new(
        flag: &str,
        n: usize,
        device: DeviceChoice,
        threads: Option<usize>,
        nodes: &NodeArgs,
        fingerprint: &str,
    ) -> CliResult<Ranks> {
        let hosts = usize::from(nodes.nnodes);
        let node = usize::from(nodes.node_rank);
        if node >= hosts {
            return Err(Failure::usage(format!(
                "--node-rank {node}: the hosts are 0..{hosts} (--nnodes {hosts})"
            )));
        }
        if !n.is_multiple_of(hosts) {
            return Err(Failure::usage(format!(
                "{flag} {n} over --nnodes {hosts}: every host runs the same number of ranks"
            )));
        }
        let local = n / hosts;
        let here = node * local..(node + 1) * local;
        let devices = match device {
            DeviceChoice::Cpu if hosts > 1 => {
                return Err(Failure::usage(
                    "--nnodes with --device cpu: ranks on several hosts sum through NCCL, on GPUs",
                ))
            }
            DeviceChoice::Cpu => {
                let total = threads
                    .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
                let each = (total / n).max(1);
                let backends = (0..n)
                    .map(|_| Ok(Arc::new(CpuBackend::new(Some(each))?) as Arc<dyn Backend>))
                    .collect::<kiln_core::Result<Vec<_>>>()?;
                let group = kiln_dist::host::group(backends.clone());
                Devices::Cpu(Mutex::new(
                    backends.into_iter().zip(group).map(Some).collect(),
                ))
            }
            DeviceChoice::Auto | DeviceChoice::Cuda(0) => {
                let gpus = kiln_cuda::devices().map_or(0, |d| d.len());
                if gpus < local {
                    return Err(Failure::usage(format!(
                        "{flag} {n}: this host runs {local} ranks and has {gpus} NVIDIA GPU(s) (--device cpu splits over the CPU's threads)"
                    )));
                }
                if hosts == 1 {
                    Devices::Cuda(NcclId::new()?, Some(PeerBoard::new(n)?))
                } else {
                    Devices::Cuda(rendezvous(flag, n, nodes, fingerprint)?, None)
                }
            }
            other => {
                return Err(Failure::usage(format!(
                    "{flag} with --device {other}: the ranks are cuda:0..N (--device cuda) or the CPU (--device cpu)"
                )))
            }
        };
        Ok(Ranks {
            devices,
            here,
            world: n,
            taken: Mutex::new(Vec::new()),
        })
    }

    /// The global ranks this process runs.
    pub(crate) fn here(&self) -> Range<usize> {
        self.here.clone()
    }

    /// `task(rank)` for every rank here, each on a thread of its own; the results in rank
    /// order, a rank that panicked an error.
    pub(crate) fn each<T: Send>(
        &self,
        task: impl Fn(usize) -> CliResult<T> + Sync,
    ) -> Vec<CliResult<T>> {
        std::thread::scope(|s| {
            let handles: Vec<_> = self
                .here()
                .map(|rank| {
                    let task = &task;
                    s.spawn(move || task(rank))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(Failure::usage("a rank panicked")))
                })
                .collect()
        })
    }

    /// Rank `rank` failed (`why`): end the collectives of every rank here, whose next
    /// or current wait would be for it.
    pub(crate) fn abort(&self, rank: usize, why: &str) {
        self.abort_all(&format!("rank {rank} failed: {why}"));
    }

    /// End the collectives of every rank here, for `why`.
    pub(crate) fn abort_all(&self, why: &str) {
        for c in self.taken.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            c.abort(why);
        }
    }

    /// Rank `rank`'s backend and its end of the collective.
    pub(crate) fn take(&self, rank: usize) -> CliResult<(Arc<dyn Backend>, Arc<dyn Collective>)> {
        let (b, c) = self.make(rank)?;
        self.taken
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(c.clone());
        Ok((b, c))
    }

    fn make(&self, rank: usize) -> CliResult<(Arc<dyn Backend>, Arc<dyn Collective>)> {
        let world = self.world;
        match &self.devices {
            Devices::Cuda(id, board) => {
                let cuda = Arc::new(CudaBackend::new(rank - self.here.start)?);
                let comm: Arc<dyn Collective> = match board {
                    Some(board) => Arc::new(cuda.communicator_in_process(id, board, rank, world)?),
                    None => Arc::new(cuda.communicator(id, rank, world)?),
                };
                Ok((cuda, comm))
            }
            Devices::Cpu(slots) => {
                let (b, c) = slots.lock().unwrap_or_else(|e| e.into_inner())[rank]
                    .take()
                    .ok_or_else(|| Failure::usage(format!("rank {rank} taken twice")))?;
                Ok((b, Arc::new(c)))
            }
        }
    }
}

/// NCCL's id for a run over several hosts: made by host 0 and handed to the others once
/// all have arrived with the same fingerprint.
fn rendezvous(flag: &str, n: usize, nodes: &NodeArgs, fingerprint: &str) -> CliResult<NcclId> {
    let addr = nodes.master_addr.as_deref().ok_or_else(|| {
        Failure::usage("--nnodes: give --master-addr HOST:PORT, where host 0 listens")
    })?;
    let hosts = usize::from(nodes.nnodes);
    let node = usize::from(nodes.node_rank);
    // The rendezvous's ranks are the hosts; what each runs is in the fingerprint.
    let fingerprint = format!("{flag}={n}/{hosts}:{fingerprint}");
    let said = |e: kiln_core::Error| {
        Failure::from(kiln_core::Error::Device(format!(
            "between the hosts (the rendezvous's ranks are --node-rank): {e}"
        )))
    };
    if node == 0 {
        let id = NcclId::new()?;
        kiln_dist::rendezvous::publish(addr, hosts, &fingerprint, &id.0, RENDEZVOUS)
            .map_err(said)?;
        Ok(id)
    } else {
        let bytes = kiln_dist::rendezvous::fetch(addr, node, hosts, &fingerprint, RENDEZVOUS)
            .map_err(said)?;
        Ok(NcclId::from_bytes(&bytes)?)
    }
}

/// A short digest of what must be the same on every host: the model file (its name,
/// size and first and last MiB) or a synthetic shape, and the settings.
pub(crate) fn fingerprint(model: Option<&std::path::Path>, settings: &str) -> String {
    // FNV-1a, 64 bits: a check that hosts were started alike, not a defence.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    };
    eat(settings.as_bytes());
    if let Some(path) = model {
        use std::io::{Read, Seek, SeekFrom};
        eat(path.file_name().map_or(&[][..], |n| n.as_encoded_bytes()));
        if let Ok(mut f) = std::fs::File::open(path) {
            let len = f.metadata().map_or(0, |m| m.len());
            eat(&len.to_le_bytes());
            for at in [0, len.saturating_sub(1 << 20)] {
                let mut buf = Vec::new();
                // Read to the MiB's end: one read may return less (a network file system).
                if f.seek(SeekFrom::Start(at)).is_ok()
                    && (&mut f).take(1 << 20).read_to_end(&mut buf).is_ok()
                {
                    eat(&buf);
                }
            }
        }
    }
    format!("{h:016x}")
}

/// Ends a rank's collectives when it stops making progress: a rank that waits longer
/// than `limit` for the others (a rank that died, a host that went away) aborts its end
/// of the collective, so its wait ends in an error naming it instead of lasting for ever;
/// if even that does not end the wait, the process ends ([`GRACE`] later), with the
/// message. Each step calls [`Watchdog::alive`]; dropping it stops the watch.
pub(crate) struct Watchdog {
    shared: Arc<WatchState>,
}

struct WatchState {
    /// Milliseconds since `start` at the last sign of life.
    last: AtomicU64,
    start: Instant,
    done: AtomicBool,
}

impl Watchdog {
    /// Watch a rank that has started and holds its collective `c`.
    pub(crate) fn new(rank: usize, c: Arc<dyn Collective>, limit: Duration) -> Watchdog {
        let why = format!(
            "rank {rank} made no progress for {} s: a rank it waits for stopped (see that rank's own message) or hangs",
            limit.as_secs()
        );
        Self::watch(Some(c), why, limit)
    }

    /// Watch a rank's start (joining the others, loading its part): one that takes more
    /// than `limit` ends the process, since NCCL's joining cannot be aborted.
    pub(crate) fn starting(rank: usize, limit: Duration) -> Watchdog {
        let why = format!(
            "rank {rank} did not start within {} s: the ranks it joins did not all come (one that failed says why in its own output), or loading took longer (KILN_RANK_TIMEOUT raises the limit)",
            limit.as_secs()
        );
        Self::watch(None, why, limit)
    }

    fn watch(c: Option<Arc<dyn Collective>>, why: String, limit: Duration) -> Watchdog {
        let shared = Arc::new(WatchState {
            last: AtomicU64::new(0),
            start: Instant::now(),
            done: AtomicBool::new(false),
        });
        let s = shared.clone();
        std::thread::spawn(move || {
            let tick = limit.min(Duration::from_secs(1));
            while !s.done.load(Ordering::Relaxed) {
                std::thread::sleep(tick);
                let now = s.start.elapsed().as_millis() as u64;
                let quiet =
                    Duration::from_millis(now.saturating_sub(s.last.load(Ordering::Relaxed)));
                if quiet > limit && !s.done.load(Ordering::Relaxed) {
                    // The abort ends the rank's waits in NCCL, and the rank its run with
                    // an error. A wait it does not end (a kernel spinning on a peer that
                    // is gone, a start) ends the process, a grace period later.
                    if let Some(c) = c.clone() {
                        // On a thread of its own: an abort may itself wait (on a call
                        // under way, or on the GPU), and the exit below must not.
                        let why = why.clone();
                        std::thread::spawn(move || c.abort(&why));
                        std::thread::sleep(GRACE.min(limit));
                    }
                    if !s.done.load(Ordering::Relaxed) {
                        eprintln!("kiln: error: {why}; the process ends here");
                        std::process::exit(1);
                    }
                    return;
                }
            }
        });
        Watchdog { shared }
    }

    /// The rank made progress.
    pub(crate) fn alive(&self) {
        let s = &self.shared;
        s.last
            .store(s.start.elapsed().as_millis() as u64, Ordering::Relaxed);
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.shared.done.store(true, Ordering::Relaxed);
    }
}

/// The longest a rank may wait on the others (`KILN_RANK_TIMEOUT` seconds, 300 by
/// default: a first step on a cold machine compiles kernels and records graphs); a
/// rank's start (joining, loading) may take three times that.
pub(crate) fn rank_timeout() -> CliResult<Duration> {
    match std::env::var("KILN_RANK_TIMEOUT") {
        Ok(v) => v
            .parse::<u64>()
            .ok()
            .filter(|&s| s > 0)
            .map(Duration::from_secs)
            .ok_or_else(|| {
                Failure::usage(format!("KILN_RANK_TIMEOUT={v}: give a number of seconds"))
            }),
        Err(_) => Ok(Duration::from_secs(300)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_core::{DType, Shape};

    #[test]
    fn a_rank_left_waiting_ends_with_a_message_naming_it() {
        let backends: Vec<Arc<dyn Backend>> = (0..2)
            .map(|_| Arc::new(CpuBackend::new(Some(1)).unwrap()) as Arc<dyn Backend>)
            .collect();
        let mut group = kiln_dist::host::group(backends.clone());
        // Rank 1 never comes to the all-reduce; rank 0's watch runs out after a second.
        let _absent = group.pop();
        let c: Arc<dyn Collective> = Arc::new(group.pop().unwrap());
        let dog = Watchdog::new(0, c.clone(), Duration::from_secs(1));
        dog.alive();
        let mut t = backends[0]
            .zeros(DType::F32, Shape::new(vec![1, 4]).unwrap())
            .unwrap();
        let clock = Instant::now();
        let err = c.all_reduce_sum(&mut t).unwrap_err().to_string();
        // Done with it before its grace period ends the test's process.
        drop(dog);
        assert!(clock.elapsed() < Duration::from_secs(10), "{err}");
        assert!(err.contains("rank 0 made no progress for 1 s"), "{err}");
    }

    #[test]
    fn fingerprints_tell_settings_and_files_apart() {
        let dir = std::env::temp_dir().join(format!("kiln-fp-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (a, b) = (dir.join("a.gguf"), dir.join("b.gguf"));
        std::fs::write(&a, vec![1u8; 3 << 20]).unwrap();
        std::fs::write(&b, vec![2u8; 3 << 20]).unwrap();
        let same = fingerprint(Some(&a), "-n 8");
        assert_eq!(same, fingerprint(Some(&a), "-n 8"));
        assert_ne!(same, fingerprint(Some(&a), "-n 9"));
        std::fs::rename(&b, dir.join("a2.gguf")).unwrap();
        std::fs::create_dir_all(dir.join("x")).unwrap();
        std::fs::rename(dir.join("a2.gguf"), dir.join("x/a.gguf")).unwrap();
        // Same name and size, other bytes.
        assert_ne!(same, fingerprint(Some(&dir.join("x/a.gguf")), "-n 8"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
