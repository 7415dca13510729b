//! Collectives between GPUs through NCCL, loaded at run time like CUDA's other libraries
//! (a machine without it gets an error saying so, not a crash). A rank's communicator
//! runs on its backend's stream, so a collective is ordered with the kernels around it
//! as any op is; started sums (gradient buckets) run on a stream of its own, beside the
//! kernels queued after them, until the backend's stream waits for them.
//!
//! How the ranks agree on a communicator: one of them makes an [`NcclId`] and the others
//! receive its 128 bytes (`kiln_dist::rendezvous` between processes or hosts, a copy
//! between threads of one process); each then calls [`CudaBackend::communicator`] with its
//! rank. NCCL's initialisation blocks until every rank has joined.
//!
//! Ranks that are threads of one process may also meet on a [`PeerBoard`]
//! ([`CudaBackend::communicator_in_process`]): small sums then take the one-shot kernel
//! over peer memory where it measured faster (see `one_shot`).

use crate::one_shot::{OneShot, PeerBoard, Probe};
use crate::{driver_error, ptr, CudaBackend};
use cudarc::driver::CudaStream;
use cudarc::nccl::{result as nccl, sys};
use kiln_core::collective::check_span;
use kiln_core::{Collective, DType, Error, Result, Tensor};
use std::sync::{Arc, Mutex};

/// Whether NCCL's library can be loaded here.
pub fn nccl_available() -> bool {
    // SAFETY: looking for a shared library by name has no other effect.
    unsafe { sys::is_culib_present() }
}

fn unavailable() -> Error {
    Error::Device(
        "NCCL (libnccl.so.2) is not installed here: several GPUs need it (NVIDIA's nccl package, or pip's nvidia-nccl-cu13 with its lib folder on LD_LIBRARY_PATH)"
            .into(),
    )
}

fn nccl_type(dtype: DType) -> Result<sys::ncclDataType_t> {
    Ok(match dtype {
        DType::F32 => sys::ncclDataType_t::ncclFloat32,
        DType::F16 => sys::ncclDataType_t::ncclFloat16,
        DType::BF16 => sys::ncclDataType_t::ncclBfloat16,
        other => {
            return Err(Error::unsupported(format!(
                "all-reduce of {other} tensors (F32, F16, BF16)"
            )))
        }
    })
}

fn nccl_error(what: &str, e: nccl::NcclError) -> Error {
    Error::Device(format!("NCCL {what}: {e:?}"))
}

/// The identity of one communicator, made by one rank and handed to the others.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NcclId(pub [u8; 128]);

impl NcclId {
    pub fn new() -> Result<NcclId> {
        if !nccl_available() {
            return Err(unavailable());
        }
        let id = nccl::get_uniqueid().map_err(|e| nccl_error("unique id", e))?;
        Ok(NcclId(id.internal.map(|c| c as u8)))
    }

    /// The id in bytes another rank sent; an error unless it is 128 of them.
    pub fn from_bytes(bytes: &[u8]) -> Result<NcclId> {
        let id: [u8; 128] = bytes
            .try_into()
            .map_err(|_| Error::format(format!("an NCCL id is 128 bytes, not {}", bytes.len())))?;
        Ok(NcclId(id))
    }
}

/// One rank's end of a communicator, on one backend's stream.
pub struct Communicator {
    comm: sys::ncclComm_t,
    stream: sys::cudaStream_t,
    /// The backend's stream, and a stream of the communicator's own where started sums
    /// run beside it (`start_sum`).
    main: Arc<CudaStream>,
    side: Arc<CudaStream>,
    ordinal: usize,
    rank: usize,
    world: usize,
    /// One NCCL call at a time on this communicator.
    calls: Mutex<()>,
    /// Set once the communicator is aborted: calls then fail, and drop leaves it be.
    aborted: std::sync::atomic::AtomicBool,
    /// Why it was aborted.
    why: Mutex<Option<String>>,
    /// The backend's count of work queued on its stream (see `CudaBackend::queued`):
    /// every call here counts, since it may write tensors whose copies the backend keeps.
    queued: Arc<std::sync::atomic::AtomicU64>,
    /// The one-shot path and the backend it launches on, where the ranks set it up.
    one_shot: Option<(Arc<CudaBackend>, OneShot)>,
}

// SAFETY: an NCCL communicator may be used from any thread, one call at a time: `calls`
// serialises them.
unsafe impl Send for Communicator {}
unsafe impl Sync for Communicator {}

impl CudaBackend {
    /// Join communicator `id` as `rank` of `world`: blocks until every rank has joined.
    pub fn communicator(&self, id: &NcclId, rank: usize, world: usize) -> Result<Communicator> {
        if !nccl_available() {
            return Err(unavailable());
        }
        if rank >= world {
            return Err(Error::shape(format!("rank {rank} of {world}")));
        }
        let (n, r) = (
            i32::try_from(world).map_err(|_| Error::shape("world size"))?,
            i32::try_from(rank).map_err(|_| Error::shape("rank"))?,
        );
        self.ctx.bind_to_thread().map_err(crate::driver_error)?;
        let mut comm = std::mem::MaybeUninit::uninit();
        let uid = sys::ncclUniqueId {
            internal: id.0.map(|b| b as std::ffi::c_char),
        };
        // SAFETY: `comm` is written by NCCL before it is read; the id is 128 bytes; the
        // calling thread's current device is this backend's (`bind`).
        let comm = unsafe {
            nccl::comm_init_rank(comm.as_mut_ptr(), n, uid, r)
                .map_err(|e| nccl_error(&format!("rank {rank} of {world} joining"), e))?;
            comm.assume_init()
        };
        Ok(Communicator {
            comm,
            stream: self.stream.cu_stream() as sys::cudaStream_t,
            main: self.stream.clone(),
            side: self.stream.fork().map_err(crate::driver_error)?,
            ordinal: self.ordinal,
            rank,
            world,
            calls: Mutex::new(()),
            aborted: std::sync::atomic::AtomicBool::new(false),
            why: Mutex::new(None),
            queued: self.queued.clone(),
            one_shot: None,
        })
    }

    /// [`CudaBackend::communicator`] for ranks that are threads of this process, all
    /// meeting on `board`: sums of the sizes where the one-shot kernel measured faster
    /// than NCCL take it (where every pair of the GPUs reaches the other's memory).
    pub fn communicator_in_process(
        self: &Arc<Self>,
        id: &NcclId,
        board: &PeerBoard,
        rank: usize,
        world: usize,
    ) -> Result<Communicator> {
        let mut comm = self.communicator(id, rank, world)?;
        if world > 1 {
            let nccl = |t: &mut Tensor| comm.nccl_all_reduce(t);
            let one_shot = OneShot::join(self, &nccl, board, rank, world)?;
            comm.one_shot = one_shot.map(|o| (self.clone(), o));
        }
        Ok(comm)
    }
}

impl Collective for Communicator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn abort(&self, why: &str) {
        self.why
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_or_insert_with(|| why.to_string());
        tracing::warn!("rank {} aborts its NCCL communicator: {why}", self.rank);
        self.abort_once();
    }

    fn check(&self) -> Result<()> {
        let _one_call = self.enter()?;
        let mut state = sys::ncclResult_t::ncclSuccess;
        // SAFETY: the communicator is live: checked under `calls`, which an abort takes
        // too; NCCL documents this call as safe beside the communicator's other use.
        let asked = unsafe { sys::ncclCommGetAsyncError(self.comm, &mut state) };
        match (asked, state) {
            (sys::ncclResult_t::ncclSuccess, sys::ncclResult_t::ncclSuccess)
            | (sys::ncclResult_t::ncclSuccess, sys::ncclResult_t::ncclInProgress) => Ok(()),
            (sys::ncclResult_t::ncclSuccess, e) => Err(Error::Device(format!(
                "rank {}: NCCL reports {e:?} (another rank or host failed or left)",
                self.rank
            ))),
            (e, _) => Err(Error::Device(format!(
                "rank {}: asking NCCL for errors: {e:?}",
                self.rank
            ))),
        }
    }

    /// `t` becomes the sum of every rank's `t`, elementwise, in place (F32, F16 or BF16):
    /// queued on the stream like any op.
    fn all_reduce_sum(&self, t: &mut Tensor) -> Result<()> {
        nccl_type(t.dtype())?;
        self.on_this_gpu(t)?;
        if let Some((backend, one)) = self.one_shot.as_ref().filter(|(_, o)| o.takes(t)) {
            self.check_live()?;
            return one.all_reduce(backend, t, self.rank, self.world);
        }
        self.nccl_all_reduce(t)
    }

    /// Through NCCL on the communicator's side stream, after an event of the backend's
    /// stream: the kernels queued after it run beside the sum.
    fn start_sum(&self, t: &mut Tensor, offset: usize, len: usize) -> Result<()> {
        let ty = nccl_type(t.dtype())?;
        check_span("sum of a span", t, offset, len)?;
        self.on_this_gpu(t)?;
        let bytes = t.dtype().row_bytes(offset)? as u64;
        let p = (ptr(t)? + bytes) as *mut std::ffi::c_void;
        let _one_call = self.enter()?;
        self.side.join(&self.main).map_err(driver_error)?;
        // SAFETY: `p` addresses `len` elements of `ty` inside the tensor (checked above) on
        // this rank's device; the side stream waits for what the backend's stream was
        // given so far, and the caller leaves the span alone until `wait_started`.
        unsafe {
            nccl::all_reduce(
                p,
                p,
                len,
                ty,
                sys::ncclRedOp_t::ncclSum,
                self.comm,
                self.side.cu_stream() as sys::cudaStream_t,
            )
        }
        .map_err(|e| nccl_error(&format!("sum of a span on rank {}", self.rank), e))?;
        Ok(())
    }

    fn wait_started(&self) -> Result<()> {
        self.main.join(&self.side).map_err(driver_error)
    }

    /// Through NCCL, queued on the stream like any op.
    fn reduce_scatter_sum(&self, whole: &Tensor, part: &mut Tensor) -> Result<()> {
        let n = part.shape().numel();
        kiln_core::collective::check_parts("reduce-scatter", self.world, part, whole)?;
        if part.dtype() != DType::F32 {
            return Err(Error::unsupported(format!(
                "reduce-scatter of {} tensors (F32)",
                part.dtype()
            )));
        }
        self.on_this_gpu(whole)?;
        self.on_this_gpu(part)?;
        let (src, dst) = (ptr(whole)?, ptr(part)?);
        let _one_call = self.enter()?;
        // SAFETY: `src` holds `world · n` F32 values and `dst` `n` on this rank's device;
        // `part` is borrowed mutably, and the stream orders the reduction after the ops
        // that wrote `whole` and before those that read `part`.
        unsafe {
            nccl::reduce_scatter(
                src as *const std::ffi::c_void,
                dst as *mut std::ffi::c_void,
                n,
                sys::ncclDataType_t::ncclFloat32,
                sys::ncclRedOp_t::ncclSum,
                self.comm,
                self.stream,
            )
        }
        .map_err(|e| nccl_error(&format!("reduce-scatter on rank {}", self.rank), e))?;
        Ok(())
    }

    /// Through NCCL (F32, F16 or BF16), queued on the stream like any op.
    fn all_gather(&self, part: &Tensor, whole: &mut Tensor) -> Result<()> {
        let ty = nccl_type(part.dtype())?;
        let n = part.shape().numel();
        kiln_core::collective::check_parts("all-gather", self.world, part, whole)?;
        self.on_this_gpu(part)?;
        self.on_this_gpu(whole)?;
        let (src, dst) = (ptr(part)?, ptr(whole)?);
        let _one_call = self.enter()?;
        // SAFETY: `src` holds `n` elements of `ty` and `dst` `world · n` on this rank's
        // device; `whole` is borrowed mutably, and the stream orders the gather after
        // the ops that wrote `part` and before those that read `whole`.
        unsafe {
            nccl::all_gather(
                src as *const std::ffi::c_void,
                dst as *mut std::ffi::c_void,
                n,
                ty,
                self.comm,
                self.stream,
            )
        }
        .map_err(|e| nccl_error(&format!("all-gather on rank {}", self.rank), e))?;
        Ok(())
    }
}

impl Communicator {
    /// The one-shot path's largest sum in bytes, and what was measured to choose it,
    /// where this rank has the path.
    pub fn one_shot(&self) -> Option<(usize, Vec<Probe>)> {
        self.one_shot
            .as_ref()
            .map(|(_, o)| (o.max_bytes, o.probes.clone()))
    }

    fn check_live(&self) -> Result<()> {
        if self.aborted.load(std::sync::atomic::Ordering::SeqCst) {
            let why = self.why.lock().unwrap_or_else(|e| e.into_inner()).clone();
            return Err(Error::Device(format!(
                "rank {}'s communicator was aborted{}",
                self.rank,
                why.map_or(String::new(), |w| format!(": {w}"))
            )));
        }
        Ok(())
    }

    /// The right to use the NCCL handle for one call: an error once the communicator is
    /// aborted (checked before taking the lock, which an abort may hold while NCCL waits,
    /// and again under it).
    fn enter(&self) -> Result<std::sync::MutexGuard<'_, ()>> {
        self.check_live()?;
        let guard = self.calls.lock().unwrap_or_else(|e| e.into_inner());
        self.check_live()?;
        self.queued
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(guard)
    }

    fn on_this_gpu(&self, t: &Tensor) -> Result<()> {
        if t.device() != kiln_core::Device::Cuda(self.ordinal) {
            return Err(Error::Device(format!(
                "rank {}'s communicator is on cuda:{}, a tensor on {}",
                self.rank,
                self.ordinal,
                t.device()
            )));
        }
        Ok(())
    }

    fn nccl_all_reduce(&self, t: &mut Tensor) -> Result<()> {
        let ty = nccl_type(t.dtype())?;
        let p = ptr(t)? as *mut std::ffi::c_void;
        let _one_call = self.enter()?;
        // SAFETY: `p` addresses the tensor's `numel` elements of `ty` on this rank's
        // device; the tensor is borrowed mutably, and the stream orders the reduction
        // after the ops that wrote it and before those that read it.
        unsafe {
            nccl::all_reduce(
                p,
                p,
                t.shape().numel(),
                ty,
                sys::ncclRedOp_t::ncclSum,
                self.comm,
                self.stream,
            )
        }
        .map_err(|e| nccl_error(&format!("all-reduce on rank {}", self.rank), e))?;
        Ok(())
    }

    /// Abort the communicator (NCCL's way out of a hang: it may be called while another
    /// thread waits in one of its collectives, which then returns an error).
    fn abort_once(&self) {
        // The flag first, so that no call takes the lock from here on (they check it
        // before locking); then the lock, so that no call under way uses the handle as
        // it goes. NCCL's abort may itself wait on the GPU: the lock stays with it.
        if !self.aborted.swap(true, std::sync::atomic::Ordering::SeqCst) {
            let _one_call = self.calls.lock().unwrap_or_else(|e| e.into_inner());
            // SAFETY: NCCL documents ncclCommAbort as the way to end a communicator whose
            // operations are pending (a rank that will never join them); it runs once (the
            // flag), and kiln's own calls check the flag before using the handle.
            let _ = unsafe { nccl::comm_abort(self.comm) };
        }
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        // Abort (unlike destroy) does not wait for the other ranks, so a rank that fails
        // does not hang on the others.
        self.abort_once();
    }
}
