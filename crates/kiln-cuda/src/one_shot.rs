//! The one-shot all-reduce between GPUs of one process (`kernels/collective.cu`): for the
//! few kilobytes a decode step sums twice a layer, a kernel that pushes its values, each
//! with the call's epoch, straight into every peer's memory over NVLink beats NCCL's
//! latency. Which sizes take
//! it is measured when the ranks join (both ways, recorded as CUDA graphs as decode runs
//! them), and every rank decides from the same measurements, so they always agree.
//!
//! The ranks meet on a [`PeerBoard`]: each posts its context and buffers, then enables
//! access to every peer's memory.

use crate::memory::DeviceBuffer;
use crate::{driver_error, kernels::Arg, CudaBackend};
use cudarc::driver::{result, sys};
use kiln_core::{Backend, Error, Result, Shape, Tensor};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Blocks of every one-shot launch: the epochs on the device count calls only if every
/// call has the same grid.
const BLOCKS: u32 = 32;
/// The largest sum that may take the one-shot path (bytes of f32). Each sender's slot in
/// the staging area is twice that: 8 bytes of values ride in each 16-byte line.
const CAP_BYTES: usize = 1 << 20;
const CAP_LINES: usize = CAP_BYTES / 8;
/// Sizes measured when the ranks join, in bytes of f32.
const PROBE_BYTES: [usize; 6] = [4 << 10, 16 << 10, 64 << 10, 128 << 10, 256 << 10, 1 << 20];
/// How long a rank waits for the others to set up the path.
const WAIT: Duration = Duration::from_secs(60);
/// How long the kernel waits for a peer before it stops the GPU (a trap: the context is
/// lost). A backstop only: a run's own watchdog (the CLI's, 300 s by default) ends the
/// process with its reason well before.
const KERNEL_WAIT: Duration = Duration::from_secs(1800);

/// What a rank posts on the board.
#[derive(Clone, Copy)]
struct Post {
    ordinal: usize,
    ctx: usize,
    staging: u64,
}

/// Where the ranks of one process meet to set up the one-shot path; shared by all of
/// them (made once, before the ranks start).
pub struct PeerBoard {
    posts: Mutex<Vec<Option<Post>>>,
    posted: Condvar,
    /// Each rank's measurements, when it has made them.
    probes: Mutex<Vec<Option<Vec<Probe>>>>,
    /// Ranks at the meeting under way, and how many meetings there have been.
    met: Mutex<(usize, u64)>,
    all_met: Condvar,
    world: usize,
    /// The largest one-shot sum in bytes if fixed rather than measured (0: NCCL only).
    fixed: Option<usize>,
}

impl PeerBoard {
    /// A board for `world` ranks, which measure where the one-shot path pays, unless
    /// `KILN_ONE_SHOT_MAX_BYTES` fixes its largest sum (0 turns it off).
    pub fn new(world: usize) -> Result<Arc<PeerBoard>> {
        let fixed = match std::env::var("KILN_ONE_SHOT_MAX_BYTES") {
            Ok(v) => Some(v.parse::<usize>().map_err(|_| {
                Error::Device(format!(
                    "KILN_ONE_SHOT_MAX_BYTES={v}: give a number of bytes"
                ))
            })?),
            Err(_) => None,
        };
        Ok(Self::with_max_bytes(world, fixed))
    }

    /// A board whose one-shot path takes sums up to `max_bytes` (at most 1 MiB; 0 turns
    /// it off), or measures where it pays (`None`).
    pub fn with_max_bytes(world: usize, max_bytes: Option<usize>) -> Arc<PeerBoard> {
        Arc::new(PeerBoard {
            posts: Mutex::new(vec![None; world]),
            posted: Condvar::new(),
            probes: Mutex::new(vec![None; world]),
            met: Mutex::new((0, 0)),
            all_met: Condvar::new(),
            world,
            fixed: max_bytes,
        })
    }

    /// Wait until every rank has come here; an error after [`WAIT`] (a rank that failed
    /// while measuring does not come).
    fn meet(&self, rank: usize) -> Result<()> {
        let mut met = self.met.lock().unwrap_or_else(|e| e.into_inner());
        let meeting = met.1;
        met.0 += 1;
        if met.0 == self.world {
            *met = (0, meeting + 1);
            self.all_met.notify_all();
            return Ok(());
        }
        let deadline = Instant::now() + WAIT;
        while met.1 == meeting {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Device(format!(
                    "rank {rank} waited {} s for the other ranks while timing the all-reduce (one of them failed: see its message)",
                    WAIT.as_secs()
                )));
            }
            met = self
                .all_met
                .wait_timeout(met, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        Ok(())
    }

    /// Post `rank`'s part and wait for every rank's.
    fn exchange(&self, rank: usize, post: Post) -> Result<Vec<Post>> {
        let mut posts = self.posts.lock().unwrap_or_else(|e| e.into_inner());
        posts[rank] = Some(post);
        self.posted.notify_all();
        let deadline = Instant::now() + WAIT;
        loop {
            if posts.iter().all(Option::is_some) {
                return Ok(posts.iter().flatten().copied().collect());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let missing: Vec<String> = posts
                    .iter()
                    .enumerate()
                    .filter(|(_, p)| p.is_none())
                    .map(|(r, _)| r.to_string())
                    .collect();
                return Err(Error::Device(format!(
                    "rank {rank} waited {} s for ranks {} to set up the one-shot all-reduce",
                    WAIT.as_secs(),
                    missing.join(", ")
                )));
            }
            posts = self
                .posted
                .wait_timeout(posts, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

/// One size timed both ways when the ranks joined (the slowest rank's times).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Probe {
    pub bytes: usize,
    pub nccl_us: f64,
    pub one_shot_us: f64,
}

/// A rank's side of the one-shot path.
pub(crate) struct OneShot {
    /// Sums of at most this many bytes (f32) take it.
    pub(crate) max_bytes: usize,
    /// What was measured when the ranks joined (empty where the board fixed `max_bytes`).
    pub(crate) probes: Vec<Probe>,
    /// Every rank's staging address, in rank order.
    table: DeviceBuffer,
    _staging: DeviceBuffer,
    /// This rank's epoch per block.
    epochs: DeviceBuffer,
}

/// Why the one-shot path cannot join these GPUs, if it cannot.
fn unreachable_pair(ordinals: &[usize]) -> Result<Option<String>> {
    let links = crate::peer_links()?;
    for &a in ordinals {
        for &b in ordinals {
            if a != b && !links[a][b].is_some_and(|l| l.access) {
                return Ok(Some(format!("cuda:{a} cannot reach cuda:{b}'s memory")));
            }
        }
    }
    Ok(None)
}

impl OneShot {
    /// Set up rank `rank`'s side, with every other rank of `board` doing the same, then
    /// measure where it beats NCCL (unless the board fixes it). `None` where the GPUs
    /// cannot reach each other (with a log line) or the board turns it off.
    pub(crate) fn join(
        backend: &Arc<CudaBackend>,
        nccl: &dyn Fn(&mut Tensor) -> Result<()>,
        board: &PeerBoard,
        rank: usize,
        world: usize,
    ) -> Result<Option<OneShot>> {
        let fixed = board.fixed;
        let b = backend.as_ref();
        b.bind()?;
        let staging_bytes = 2 * world * CAP_LINES * 16;
        let staging = b.pool.alloc(staging_bytes)?;
        let epochs = b.pool.alloc(BLOCKS as usize * 4)?;
        // Zero epochs: the first call's is 1, which no line holds yet.
        for (buf, bytes) in [(&staging, staging_bytes), (&epochs, BLOCKS as usize * 4)] {
            unsafe { result::memset_d8_async(buf.ptr, 0, bytes, b.stream.cu_stream()) }
                .map_err(driver_error)?;
        }
        b.synchronize()?;
        let posts = board.exchange(
            rank,
            Post {
                ordinal: b.ordinal,
                ctx: b.ctx.cu_ctx() as usize,
                staging: staging.ptr,
            },
        )?;
        let ordinals: Vec<usize> = posts.iter().map(|p| p.ordinal).collect();
        // Every rank sees the same posts, so every rank takes the same way here.
        if let Some(why) = unreachable_pair(&ordinals)? {
            if rank == 0 {
                tracing::info!("one-shot all-reduce off ({why}): NCCL for every size");
            }
            return Ok(None);
        }
        if fixed == Some(0) {
            return Ok(None);
        }
        for p in posts.iter().filter(|p| p.ordinal != b.ordinal) {
            // SAFETY: `p.ctx` is the peer's primary context, alive while its backend is.
            match unsafe { sys::cuCtxEnablePeerAccess(p.ctx as sys::CUcontext, 0) } {
                sys::CUresult::CUDA_SUCCESS
                | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {}
                e => {
                    return Err(Error::Device(format!(
                        "enabling access from cuda:{} to cuda:{}'s memory: {e:?}",
                        b.ordinal, p.ordinal
                    )))
                }
            }
        }
        let table_bytes: Vec<u8> = posts.iter().flat_map(|p| p.staging.to_le_bytes()).collect();
        let table = b.pool.alloc(table_bytes.len())?;
        unsafe { result::memcpy_htod_async(table.ptr, &table_bytes, b.stream.cu_stream()) }
            .map_err(driver_error)?;
        b.synchronize()?;
        let mut one = OneShot {
            max_bytes: CAP_BYTES,
            probes: Vec::new(),
            table,
            _staging: staging,
            epochs,
        };
        match fixed {
            Some(bytes) => one.max_bytes = bytes.min(CAP_BYTES),
            None => {
                one.probes = one.measure(backend, nccl, board, rank, world)?;
                one.max_bytes = threshold(&one.probes);
            }
        }
        if rank == 0 {
            for p in &one.probes {
                tracing::debug!(
                    "all-reduce of {} KiB over {world} GPUs: NCCL {:.1} µs, one-shot {:.1} µs",
                    p.bytes >> 10,
                    p.nccl_us,
                    p.one_shot_us
                );
            }
            tracing::info!(
                "one-shot all-reduce for sums up to {} KiB over {world} GPUs, NCCL above",
                one.max_bytes >> 10
            );
        }
        Ok(Some(one))
    }

    /// `t` (F32, an even number of values, at most `max_bytes`) becomes the sum over the
    /// ranks, queued on `b`'s stream.
    pub(crate) fn all_reduce(
        &self,
        b: &CudaBackend,
        t: &mut Tensor,
        rank: usize,
        world: usize,
    ) -> Result<()> {
        let n = t.shape().numel();
        b.launch(
            "all_reduce_one_shot",
            (BLOCKS, 1, 1),
            (256, 1, 1),
            0,
            &[
                Arg::Ptr(crate::ptr(t)?),
                Arg::I32((n / 2) as i32),
                Arg::I32(rank as i32),
                Arg::I32(world as i32),
                Arg::Ptr(self.table.ptr),
                Arg::Ptr(self.epochs.ptr),
                Arg::I32(CAP_LINES as i32),
                Arg::U64(KERNEL_WAIT.as_nanos() as u64),
            ],
        )
    }

    /// Whether `t` may take the one-shot path.
    pub(crate) fn takes(&self, t: &Tensor) -> bool {
        let n = t.shape().numel();
        // Not empty: every call must exchange a line, or a fast rank's next call could
        // overwrite what a slow one has still to read.
        t.dtype() == kiln_core::DType::F32
            && n > 0
            && n.is_multiple_of(2)
            && n * 4 <= self.max_bytes
    }

    /// Each probed size's bytes and its time both ways (µs), the same on every rank:
    /// each rank times both, and the slowest rank's times are taken.
    fn measure(
        &self,
        backend: &Arc<CudaBackend>,
        nccl: &dyn Fn(&mut Tensor) -> Result<()>,
        board: &PeerBoard,
        rank: usize,
        world: usize,
    ) -> Result<Vec<Probe>> {
        const CALLS: usize = 20;
        let b = backend.as_ref();
        let mut mine = Vec::new();
        for bytes in PROBE_BYTES {
            let mut t = b.zeros(kiln_core::DType::F32, Shape::new(vec![bytes / 4])?)?;
            let mut time = |one_shot: bool| -> Result<f64> {
                let op = |t: &mut Tensor| match one_shot {
                    true => self.all_reduce(b, t, rank, world),
                    false => nccl(t),
                };
                // Once eagerly (NCCL sets itself up on its first call), then as decode
                // runs it: recorded once, replayed.
                op(&mut t)?;
                let replay = b
                    .capture(&mut || (0..CALLS).try_for_each(|_| op(&mut t)))?
                    .ok_or_else(|| Error::Device("the CUDA backend did not record".into()))?;
                replay.replay()?;
                b.synchronize()?;
                board.meet(rank)?;
                let clock = Instant::now();
                for _ in 0..3 {
                    replay.replay()?;
                }
                b.synchronize()?;
                Ok(clock.elapsed().as_secs_f64() * 1e6 / (3 * CALLS) as f64)
            };
            mine.push(Probe {
                bytes,
                nccl_us: time(false)?,
                one_shot_us: time(true)?,
            });
        }
        let mut probes = board.probes.lock().unwrap_or_else(|e| e.into_inner());
        probes[rank] = Some(mine);
        drop(probes);
        board.meet(rank)?;
        let probes = board.probes.lock().unwrap_or_else(|e| e.into_inner());
        let slowest = |i: usize, f: fn(&Probe) -> f64| {
            probes
                .iter()
                .flatten()
                .map(|p| f(&p[i]))
                .fold(0f64, f64::max)
        };
        Ok((0..PROBE_BYTES.len())
            .map(|i| Probe {
                bytes: PROBE_BYTES[i],
                nccl_us: slowest(i, |p| p.nccl_us),
                one_shot_us: slowest(i, |p| p.one_shot_us),
            })
            .collect())
    }
}

/// The largest probed size up to which the one-shot path was faster than NCCL at every
/// probed size (0: never).
fn threshold(probes: &[Probe]) -> usize {
    probes
        .iter()
        .take_while(|p| p.one_shot_us < p.nccl_us)
        .last()
        .map_or(0, |p| p.bytes)
}
