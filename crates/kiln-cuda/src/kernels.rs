//! The loaded kernel module: functions looked up by name once, and launched with their
//! arguments packed the way `cuLaunchKernel` reads them.

use crate::driver_error;
use cudarc::driver::{result, sys};
use kiln_core::{Error, Result};
use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::sync::Mutex;

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

pub(crate) struct Kernels {
    module: sys::CUmodule,
    functions: Mutex<HashMap<&'static str, sys::CUfunction>>,
    /// The most dynamic shared memory a block may ask for on this GPU.
    max_shared: i32,
    /// Launch with programmatic dependent launch (see `follow_previous` in common.cuh).
    programmatic: bool,
}

// CUmodule and CUfunction are handles the driver lets any thread of the context use.
unsafe impl Send for Kernels {}
unsafe impl Sync for Kernels {}

impl Kernels {
    /// `programmatic`: launch each kernel so that it may be scheduled while the one
    /// before it finishes (sm_90 and later).
    pub(crate) fn load(cubin: &[u8], max_shared: i32, programmatic: bool) -> Result<Kernels> {
        let module = unsafe { result::module::load_data(cubin.as_ptr() as *const c_void) }
            .map_err(|e| Error::Device(format!("cannot load the compiled kernels: {e}")))?;
        Ok(Kernels {
            module,
            functions: Mutex::new(HashMap::new()),
            max_shared,
            programmatic,
        })
    }

    fn function(&self, name: &'static str) -> Result<sys::CUfunction> {
        let mut functions = self.functions.lock().expect("kernel table lock");
        if let Some(&f) = functions.get(name) {
            return Ok(f);
        }
        let cname = CString::new(name).expect("kernel names hold no NUL");
        let f = unsafe { result::module::get_function(self.module, cname) }
            .map_err(|e| Error::Device(format!("kernel {name} is missing: {e}")))?;
        // Let every kernel use as much dynamic shared memory as the GPU allows beside its
        // static shared memory (attention needs more than the default 48 KiB for large
        // heads).
        let static_shared = unsafe {
            result::function::get_function_attribute(
                f,
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES,
            )
        }
        .map_err(driver_error)?;
        unsafe {
            sys::cuFuncSetAttribute(
                f,
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                self.max_shared - static_shared,
            )
        }
        .result()
        .map_err(driver_error)?;
        functions.insert(name, f);
        Ok(f)
    }

    pub(crate) fn max_shared(&self) -> usize {
        self.max_shared as usize
    }

    pub(crate) fn programmatic(&self) -> bool {
        self.programmatic
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
        let f = self.function(name)?;
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
