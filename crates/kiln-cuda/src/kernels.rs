//! The loaded kernel module: functions looked up by name once, and launched with their
//! arguments packed the way `cuLaunchKernel` reads them.

use crate::driver_error;
use cudarc::driver::{result, sys};
use kiln_core::{Error, Result};
use std::collections::HashMap;
use std::ffi::{c_char, c_void, CStr};
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

/// A kernel argument. Each is stored in a u64 slot; the kernel reads as many bytes as
/// its parameter has, which on a little-endian machine are the value's own.
#[derive(Clone, Copy)]
pub(crate) enum Arg {
    Ptr(u64),
    I32(i32),
    F32(f32),
    U64(u64),
}

impl Arg {
    fn slot(self) -> u64 {
        match self {
            Arg::Ptr(p) | Arg::U64(p) => p,
            Arg::I32(v) => v as u32 as u64,
            Arg::F32(v) => v.to_bits() as u64,
        }
    }
}

/// Loading a module's functions while any thread of the process records a CUDA graph
/// invalidates that recording (the driver does not permit it during stream capture), and
/// so does making a backend's context and stream (cudarc synchronises the device when a
/// context's first stream is made: two backends of one process saw
/// `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED` and a failed `new`). Those and recordings
/// exclude each other: recordings share the lock, the others take it alone.
static LOAD_OR_RECORD: RwLock<()> = RwLock::new(());

/// Held while a graph is recorded (see [`LOAD_OR_RECORD`]).
pub(crate) fn recording() -> RwLockReadGuard<'static, ()> {
    LOAD_OR_RECORD.read().unwrap_or_else(|e| e.into_inner())
}

/// Held while something no recording survives runs (see [`LOAD_OR_RECORD`]).
pub(crate) fn outside_recordings() -> RwLockWriteGuard<'static, ()> {
    LOAD_OR_RECORD.write().unwrap_or_else(|e| e.into_inner())
}

/// A kernel and the limits the driver gives for it.
struct Function {
    f: sys::CUfunction,
    /// The largest block it can run (fewer than 1024 threads where its registers run
    /// out first).
    max_threads: u32,
    max_dynamic_shared: u32,
}

pub(crate) struct Kernels {
    module: sys::CUmodule,
    /// Every kernel of the module, checked at load (see [`Kernels::load`]).
    functions: HashMap<String, Function>,
    /// Launch with programmatic dependent launch (see `follow_previous` in common.cuh).
    programmatic: bool,
}

// CUmodule and CUfunction are handles the driver lets any thread of the context use.
unsafe impl Send for Kernels {}
unsafe impl Sync for Kernels {}

/// The least a kernel's launch code needs of it: blocks of this many threads (launch
/// code that adapts to a smaller limit asks for its smallest block), and this much
/// dynamic shared memory at most.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LaunchNeed {
    pub(crate) threads: u32,
    pub(crate) dynamic_shared: u32,
}

/// What each kernel's launch code needs of it (the launch sites' own constants). Kernels
/// launched with more than 256 threads a block are compiled with `__launch_bounds__`
/// for it (norms, sampling, 1-query attention), or their launch code takes what the
/// function allows (matvec, 2-query attention); the check at load holds both to it.
fn launch_need(name: &str) -> LaunchNeed {
    let threads = |threads| LaunchNeed {
        threads,
        dynamic_shared: 0,
    };
    if name.starts_with("matvec") || name.starts_with("gate_up") {
        return threads(crate::matmul::MATVEC_LEAST_THREADS);
    }
    if let Some(need) = crate::attention::launch_need(name) {
        return need;
    }
    if let Some(need) = crate::attention_tc::launch_need(name) {
        return need;
    }
    if let Some(need) = crate::attention_grad_tc::launch_need(name) {
        return need;
    }
    if crate::gemm_tc::is_product_kernel(name) {
        return threads(crate::gemm_tc::THREADS);
    }
    match name {
        "rms_norm" | "layer_norm" => threads(crate::norm::MAX_THREADS),
        "sample_rows" => threads(crate::sample::THREADS),
        // Elementwise and reduction kernels: blocks of 256 threads or fewer, which every
        // kernel can run (256 threads of 255 registers fill one SM's 64k registers).
        _ => threads(256),
    }
}

fn attribute(f: sys::CUfunction, attr: sys::CUfunction_attribute) -> Result<i32> {
    unsafe { result::function::get_function_attribute(f, attr) }.map_err(driver_error)
}

/// The functions of a loaded module, with their names.
fn module_functions(module: sys::CUmodule) -> Result<Vec<(String, sys::CUfunction)>> {
    let mut count = 0u32;
    unsafe { sys::cuModuleGetFunctionCount(&mut count, module) }
        .result()
        .map_err(driver_error)?;
    let mut fs: Vec<sys::CUfunction> = vec![std::ptr::null_mut(); count as usize];
    unsafe { sys::cuModuleEnumerateFunctions(fs.as_mut_ptr(), count, module) }
        .result()
        .map_err(driver_error)?;
    fs.into_iter()
        .map(|f| {
            let mut name: *const c_char = std::ptr::null();
            unsafe { sys::cuFuncGetName(&mut name, f) }
                .result()
                .map_err(driver_error)?;
            // SAFETY: the driver returns a NUL-terminated name it owns for the module's life.
            let name = unsafe { CStr::from_ptr(name) }
                .to_string_lossy()
                .into_owned();
            // Enumerated handles of a lazily loaded module are not loaded yet.
            unsafe { sys::cuFuncLoad(f) }
                .result()
                .map_err(driver_error)?;
            Ok((name, f))
        })
        .collect()
}

impl Kernels {
    /// Load the module and check every kernel in it against what its launch code needs
    /// (see [`launch_need`]): a kernel this GPU cannot run as kiln launches it is an
    /// error here, naming it, rather than a failed launch mid-generation.
    /// `max_shared`: the most shared memory a block may have on this GPU.
    /// `programmatic`: launch each kernel so that it may be scheduled while the one
    /// before it finishes (sm_90 and later).
    pub(crate) fn load(cubin: &[u8], max_shared: i32, programmatic: bool) -> Result<Kernels> {
        let _loading = outside_recordings();
        let module = unsafe { result::module::load_data(cubin.as_ptr() as *const c_void) }
            .map_err(|e| Error::Device(format!("cannot load the compiled kernels: {e}")))?;
        // Built first, so that an error below still unloads the module.
        let mut kernels = Kernels {
            module,
            functions: HashMap::new(),
            programmatic,
        };
        for (name, f) in module_functions(module)? {
            use sys::CUfunction_attribute as A;
            let max_threads = attribute(f, A::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK)?;
            let registers = attribute(f, A::CU_FUNC_ATTRIBUTE_NUM_REGS)?;
            let static_shared = attribute(f, A::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)?;
            let need = launch_need(&name);
            if (max_threads as u32) < need.threads {
                return Err(Error::Device(format!(
                    "kernel {name} cannot run on this GPU: kiln launches it with blocks of \
                     {} threads, and with its {registers} registers a thread it runs at most {max_threads}",
                    need.threads
                )));
            }
            let max_dynamic_shared = max_shared - static_shared;
            if (max_dynamic_shared as i64) < need.dynamic_shared as i64 {
                return Err(Error::Device(format!(
                    "kernel {name} cannot run on this GPU: it needs {} bytes of shared memory \
                     a block beside its own {static_shared}, and the GPU allows {max_shared} in all",
                    need.dynamic_shared
                )));
            }
            // Let every kernel use as much dynamic shared memory as the GPU allows beside
            // its static shared memory (attention needs more than the default 48 KiB for
            // large heads).
            unsafe {
                sys::cuFuncSetAttribute(
                    f,
                    A::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    max_dynamic_shared,
                )
            }
            .result()
            .map_err(driver_error)?;
            kernels.functions.insert(
                name,
                Function {
                    f,
                    max_threads: max_threads as u32,
                    max_dynamic_shared: max_dynamic_shared as u32,
                },
            );
        }
        Ok(kernels)
    }

    fn function(&self, name: &str) -> Result<&Function> {
        self.functions
            .get(name)
            .ok_or_else(|| Error::Device(format!("kernel {name} is missing")))
    }

    /// The largest block `name` can run (at least what [`launch_need`] gives it).
    pub(crate) fn max_threads(&self, name: &str) -> Result<u32> {
        Ok(self.function(name)?.max_threads)
    }

    /// Blocks of `threads` threads and `shared` bytes of dynamic shared memory that one
    /// multiprocessor runs at once of kernel `name` (its registers and shared memory
    /// decide), at least 1.
    pub(crate) fn blocks_per_sm(&self, name: &str, threads: u32, shared: u32) -> Result<usize> {
        let mut blocks = 0i32;
        unsafe {
            sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(
                &mut blocks,
                self.function(name)?.f,
                threads as i32,
                shared as usize,
            )
        }
        .result()
        .map_err(driver_error)?;
        Ok(blocks.max(1) as usize)
    }

    /// Launch `name`; `programmatic` (where this GPU allows it) lets it be scheduled
    /// while the kernel before it finishes.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn launch(
        &self,
        stream: sys::CUstream,
        name: &'static str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        shared: u32,
        args: &[Arg],
        programmatic: bool,
    ) -> Result<()> {
        let function = self.function(name)?;
        let threads = block.0 * block.1 * block.2;
        // Launch code keeps to the limits checked at load; this names a slip in it
        // instead of the driver's bare "out of resources".
        if threads > function.max_threads || shared > function.max_dynamic_shared {
            return Err(Error::Device(format!(
                "launching {name}: a block of {threads} threads and {shared} bytes of shared \
                 memory, over its limits of {} and {}",
                function.max_threads, function.max_dynamic_shared
            )));
        }
        let f = function.f;
        let mut slots: Vec<u64> = args.iter().map(|a| a.slot()).collect();
        let mut params: Vec<*mut c_void> = slots
            .iter_mut()
            .map(|s| s as *mut u64 as *mut c_void)
            .collect();
        let err = |e| Error::Device(format!("launching {name}: {e}"));
        if !(programmatic && self.programmatic) {
            return unsafe { result::launch_kernel(f, grid, block, shared, stream, &mut params) }
                .map_err(err);
        }
        // SAFETY: the attribute union is plain data; zeroed, then the one field set.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block.0,
            blockDimY: block.1,
            blockDimZ: block.2,
            sharedMemBytes: shared,
            hStream: stream,
            attrs: &mut attr,
            numAttrs: 1,
        };
        unsafe { sys::cuLaunchKernelEx(&config, f, params.as_mut_ptr(), std::ptr::null_mut()) }
            .result()
            .map_err(err)
    }
}

impl Drop for Kernels {
    fn drop(&mut self) {
        let _ = unsafe { result::module::unload(self.module) };
    }
}
