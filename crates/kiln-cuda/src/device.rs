//! Finding GPUs and describing them (`kiln devices`), with no CUDA needed at build time.

use crate::compile::nvrtc_version;
use crate::driver_error;
use cudarc::driver::{result, sys};
use kiln_core::{Error, Result};

/// One GPU, as `kiln devices` shows it.
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    pub compute_capability: (i32, i32),
    pub memory_total: usize,
    pub memory_free: usize,
    pub sm_count: i32,
    /// The kernel driver's release (`580.159.04`), when the system says.
    pub driver_release: Option<String>,
    /// The CUDA version the driver supports (`13.0`).
    pub cuda_version: String,
    /// NVRTC's version, when the library is present.
    pub nvrtc_version: Option<String>,
}

/// Why CUDA cannot be used here, or `Ok` with the driver's CUDA version (e.g. 13000).
pub(crate) fn init_driver() -> Result<i32> {
    if !unsafe { sys::is_culib_present() } {
        return Err(Error::Device(
            "no NVIDIA driver found (libcuda.so cannot be loaded)".to_string(),
        ));
    }
    result::init().map_err(|e| Error::Device(format!("the CUDA driver did not start: {e}")))?;
    let mut version = 0;
    unsafe { sys::cuDriverGetVersion(&mut version) }
        .result()
        .map_err(driver_error)?;
    Ok(version)
}

pub(crate) fn device_count() -> Result<usize> {
    init_driver()?;
    Ok(result::device::get_count().map_err(driver_error)? as usize)
}

fn driver_release() -> Option<String> {
    // "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build ..."
    let text = std::fs::read_to_string("/proc/driver/nvidia/version").ok()?;
    let line = text.lines().next()?;
    line.split_whitespace()
        .find(|w| w.contains('.') && w.chars().all(|c| c.is_ascii_digit() || c == '.'))
        .map(str::to_string)
}

fn attribute(dev: sys::CUdevice, a: sys::CUdevice_attribute) -> Result<i32> {
    unsafe { result::device::get_attribute(dev, a) }.map_err(driver_error)
}

/// Every GPU the driver sees; an error when there is no driver.
pub fn devices() -> Result<Vec<DeviceInfo>> {
    let version = init_driver()?;
    let count = result::device::get_count().map_err(driver_error)?;
    let nvrtc = unsafe { cudarc::nvrtc::sys::is_culib_present() }
        .then(nvrtc_version)
        .and_then(Result::ok)
        .map(|(a, b)| format!("{a}.{b}"));
    let mut out = Vec::new();
    for ordinal in 0..count {
        let dev = result::device::get(ordinal).map_err(driver_error)?;
        let ctx = cudarc::driver::CudaContext::new(ordinal as usize).map_err(driver_error)?;
        let (free, total) = ctx.mem_get_info().map_err(driver_error)?;
        use sys::CUdevice_attribute::*;
        out.push(DeviceInfo {
            ordinal: ordinal as usize,
            name: result::device::get_name(dev).map_err(driver_error)?,
            compute_capability: (
                attribute(dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
                attribute(dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
            ),
            memory_total: total,
            memory_free: free,
            sm_count: attribute(dev, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
            driver_release: driver_release(),
            cuda_version: format!("{}.{}", version / 1000, (version % 1000) / 10),
            nvrtc_version: nvrtc.clone(),
        });
    }
    Ok(out)
}

/// How GPU `from` reaches GPU `to`'s memory directly (peer to peer), as the driver says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerLink {
    /// Loads and stores into the peer's memory work (NVLink or PCIe).
    pub access: bool,
    /// Atomics on the peer's memory are native (NVLink).
    pub native_atomics: bool,
    /// The driver's relative rank of the link's performance (0 is the best it has).
    pub performance_rank: i32,
}

/// The peer-access matrix of every pair of GPUs: `[from][to]`, `None` on the diagonal.
pub fn peer_links() -> Result<Vec<Vec<Option<PeerLink>>>> {
    let count = device_count()?;
    let devs: Vec<sys::CUdevice> = (0..count)
        .map(|i| result::device::get(i as i32).map_err(driver_error))
        .collect::<Result<_>>()?;
    let p2p = |a: sys::CUdevice_P2PAttribute, from: sys::CUdevice, to: sys::CUdevice| {
        let mut v = 0;
        // SAFETY: `v` is written by the driver; both devices are valid handles.
        unsafe { sys::cuDeviceGetP2PAttribute(&mut v, a, from, to) }
            .result()
            .map_err(driver_error)
            .map(|()| v)
    };
    use sys::CUdevice_P2PAttribute::*;
    let mut out = Vec::with_capacity(count);
    for (i, &from) in devs.iter().enumerate() {
        let mut row = Vec::with_capacity(count);
        for (j, &to) in devs.iter().enumerate() {
            row.push(if i == j {
                None
            } else {
                Some(PeerLink {
                    access: p2p(CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED, from, to)? != 0,
                    native_atomics: p2p(CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED, from, to)?
                        != 0,
                    performance_rank: p2p(CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK, from, to)?,
                })
            });
        }
        out.push(row);
    }
    Ok(out)
}

/// Bytes read plus bytes written per second by device-to-device copies of `bytes` on GPU
/// `ordinal`: the most a step that streams its weights can read per second, to set its
/// speed against (a roofline).
pub fn copy_bandwidth(ordinal: usize, bytes: usize) -> Result<f64> {
    let ctx = cudarc::driver::CudaContext::new(ordinal).map_err(driver_error)?;
    let stream = ctx.new_stream().map_err(driver_error)?;
    let src = stream.alloc_zeros::<u8>(bytes).map_err(driver_error)?;
    let mut dst = stream.alloc_zeros::<u8>(bytes).map_err(driver_error)?;
    // The best of many short rounds: an idle GPU's clocks take a while to rise.
    const COPIES: usize = 10;
    let mut best = 0f64;
    let started = std::time::Instant::now();
    while started.elapsed() < std::time::Duration::from_millis(300) {
        let clock = std::time::Instant::now();
        for _ in 0..COPIES {
            stream.memcpy_dtod(&src, &mut dst).map_err(driver_error)?;
        }
        stream.synchronize().map_err(driver_error)?;
        best = best.max((2 * bytes * COPIES) as f64 / clock.elapsed().as_secs_f64());
    }
    Ok(best)
}
