//! The kernels' source, compiled with NVRTC for the GPU present and kept on disk, so that
//! a second start compiles nothing.
//!
//! A cache entry is named by a hash of everything that changes the binary (source, GPU
//! architecture, driver and NVRTC versions) and carries its own length and checksum: a
//! truncated or corrupt entry is compiled again and overwritten, never loaded.

use cudarc::nvrtc::sys as nvrtc;
use kiln_core::{Error, Result};
use std::ffi::{c_char, c_int, CString};
use std::path::PathBuf;
use std::time::Instant;

/// Every kernel file, in the order they are joined (the shared header first).
const SOURCES: [(&str, &str); 18] = [
    ("common.cuh", include_str!("kernels/common.cuh")),
    ("mma.cuh", include_str!("kernels/mma.cuh")),
    ("dot_float.cu", include_str!("kernels/dot_float.cu")),
    ("dot_q8.cu", include_str!("kernels/dot_q8.cu")),
    ("matvec.cu", include_str!("kernels/matvec.cu")),
    ("convert.cu", include_str!("kernels/convert.cu")),
    ("gemm_tc.cu", include_str!("kernels/gemm_tc.cu")),
    ("norm.cu", include_str!("kernels/norm.cu")),
    ("elementwise.cu", include_str!("kernels/elementwise.cu")),
    ("kv_cache.cu", include_str!("kernels/kv_cache.cu")),
    ("rope.cu", include_str!("kernels/rope.cu")),
    ("attention.cu", include_str!("kernels/attention.cu")),
    ("attention_tc.cu", include_str!("kernels/attention_tc.cu")),
    (
        "attention_grad_tc.cu",
        include_str!("kernels/attention_grad_tc.cu"),
    ),
    ("sample.cu", include_str!("kernels/sample.cu")),
    ("optim.cu", include_str!("kernels/optim.cu")),
    ("grad.cu", include_str!("kernels/grad.cu")),
    ("collective.cu", include_str!("kernels/collective.cu")),
];

const MAGIC: &[u8; 8] = b"KILNCUBN";

fn program_source() -> String {
    let mut src = String::new();
    for (name, text) in SOURCES {
        src.push_str(&format!("// ---- {name} ----\n#line 1 \"{name}\"\n"));
        src.push_str(text);
        src.push('\n');
    }
    src
}

use kiln_core::disk_cache::{fnv1a, FNV_OFFSET};

pub(crate) fn nvrtc_version() -> Result<(i32, i32)> {
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    unsafe { nvrtc::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| Error::Device(format!("NVRTC version: {e:?}")))?;
    Ok((major, minor))
}

/// Where the compiled kernels for this source, GPU and toolchain live.
pub(crate) fn cache_path(arch: (i32, i32), driver: i32) -> Result<Option<PathBuf>> {
    let (nv_major, nv_minor) = nvrtc_version()?;
    let mut h = fnv1a(program_source().as_bytes(), FNV_OFFSET);
    h = fnv1a(
        format!(
            "sm_{}{} driver {driver} nvrtc {nv_major}.{nv_minor}",
            arch.0, arch.1
        )
        .as_bytes(),
        h,
    );
    Ok(kiln_core::disk_cache::dir().map(|d| {
        d.join("cuda")
            .join(format!("kernels-sm{}{}-{h:016x}.cubin", arch.0, arch.1))
    }))
}

fn read_entry(path: &PathBuf) -> Option<Vec<u8>> {
    let bytes = std::fs::read(path).ok()?;
    if bytes.len() < 24 || &bytes[..8] != MAGIC {
        return None;
    }
    let len = u64::from_le_bytes(bytes[8..16].try_into().ok()?) as usize;
    let sum = u64::from_le_bytes(bytes[16..24].try_into().ok()?);
    let payload = &bytes[24..];
    (payload.len() == len && fnv1a(payload, FNV_OFFSET) == sum).then(|| payload.to_vec())
}

fn write_entry(path: &PathBuf, cubin: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().expect("cache paths have a directory");
    std::fs::create_dir_all(dir)?;
    let mut bytes = Vec::with_capacity(cubin.len() + 24);
    bytes.extend_from_slice(MAGIC);
    bytes.extend_from_slice(&(cubin.len() as u64).to_le_bytes());
    bytes.extend_from_slice(&fnv1a(cubin, FNV_OFFSET).to_le_bytes());
    bytes.extend_from_slice(cubin);
    // Write aside, then rename: a reader never sees half an entry.
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, &bytes)?;
    std::fs::rename(&tmp, path)
}

/// What `kernels_for` did, for callers that report it (and for tests of the cache).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheOutcome {
    Hit,
    /// Compiled, and stored (or, when the cache is not writable, not).
    Compiled,
    /// An entry was there but corrupt: compiled again and replaced.
    Rebuilt,
}

/// The cubin for `arch`, from the disk cache or freshly compiled.
pub(crate) fn kernels_for(arch: (i32, i32), driver: i32) -> Result<(Vec<u8>, CacheOutcome)> {
    let path = cache_path(arch, driver)?;
    let mut outcome = CacheOutcome::Compiled;
    if let Some(p) = &path {
        if p.exists() {
            match read_entry(p) {
                Some(cubin) => {
                    tracing::info!("CUDA kernels from the cache: {}", p.display());
                    return Ok((cubin, CacheOutcome::Hit));
                }
                None => {
                    tracing::warn!(
                        "{}: corrupt kernel cache entry; compiling again",
                        p.display()
                    );
                    outcome = CacheOutcome::Rebuilt;
                }
            }
        }
    }
    let start = Instant::now();
    let cubin = compile(arch)?;
    tracing::info!(
        "compiled CUDA kernels for sm_{}{} in {:.1} s",
        arch.0,
        arch.1,
        start.elapsed().as_secs_f64()
    );
    if let Some(p) = &path {
        if let Err(e) = write_entry(p, &cubin) {
            tracing::warn!("{}: cannot store compiled kernels: {e}", p.display());
        }
    }
    Ok((cubin, outcome))
}

fn compile(arch: (i32, i32)) -> Result<Vec<u8>> {
    let src = CString::new(program_source()).expect("kernel sources hold no NUL");
    let name = CString::new("kiln_kernels.cu").expect("no NUL");
    let mut prog: nvrtc::nvrtcProgram = std::ptr::null_mut();
    unsafe {
        nvrtc::nvrtcCreateProgram(
            &mut prog,
            src.as_ptr(),
            name.as_ptr(),
            0,
            std::ptr::null(),
            std::ptr::null(),
        )
    }
    .result()
    .map_err(|e| Error::Device(format!("NVRTC: cannot create the program: {e:?}")))?;
    let opts: Vec<CString> = [
        format!("--gpu-architecture=sm_{}{}", arch.0, arch.1),
        "--std=c++17".to_string(),
        "--fmad=true".to_string(),
        "-lineinfo".to_string(),
    ]
    .into_iter()
    .map(|o| CString::new(o).expect("no NUL"))
    .collect();
    let ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
    let compiled = unsafe { nvrtc::nvrtcCompileProgram(prog, ptrs.len() as c_int, ptrs.as_ptr()) };
    let result = if compiled.result().is_err() {
        let log = program_log(prog);
        Err(Error::Device(format!(
            "NVRTC could not compile kiln's kernels for sm_{}{}:\n{log}",
            arch.0, arch.1
        )))
    } else {
        cubin(prog)
    };
    unsafe { nvrtc::nvrtcDestroyProgram(&mut prog) };
    result
}

fn program_log(prog: nvrtc::nvrtcProgram) -> String {
    let mut size = 0usize;
    if unsafe { nvrtc::nvrtcGetProgramLogSize(prog, &mut size) }
        .result()
        .is_err()
    {
        return String::from("(no log)");
    }
    let mut log = vec![0u8; size];
    unsafe { nvrtc::nvrtcGetProgramLog(prog, log.as_mut_ptr() as *mut c_char) };
    String::from_utf8_lossy(&log)
        .trim_end_matches('\0')
        .to_string()
}

fn cubin(prog: nvrtc::nvrtcProgram) -> Result<Vec<u8>> {
    let mut size = 0usize;
    unsafe { nvrtc::nvrtcGetCUBINSize(prog, &mut size) }
        .result()
        .map_err(|e| Error::Device(format!("NVRTC: no cubin: {e:?}")))?;
    let mut bin = vec![0u8; size];
    unsafe { nvrtc::nvrtcGetCUBIN(prog, bin.as_mut_ptr() as *mut c_char) }
        .result()
        .map_err(|e| Error::Device(format!("NVRTC: no cubin: {e:?}")))?;
    Ok(bin)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// NVRTC needs no GPU: the kernels are compiled here wherever the library loads
    /// (CI installs it from PyPI), so a kernel that does not compile fails every build.
    #[test]
    fn kernels_compile_for_hopper_and_ampere() {
        if !unsafe { nvrtc::is_culib_present() } {
            assert!(
                std::env::var_os("KILN_REQUIRE_NVRTC").is_none(),
                "KILN_REQUIRE_NVRTC is set but libnvrtc cannot be loaded"
            );
            eprintln!("skipped: libnvrtc not found (set LD_LIBRARY_PATH to it)");
            return;
        }
        for arch in [(9, 0), (8, 0)] {
            let cubin = compile(arch).unwrap_or_else(|e| panic!("{e}"));
            assert!(
                cubin.len() > 1000,
                "sm_{}{}: {} bytes",
                arch.0,
                arch.1,
                cubin.len()
            );
            assert_eq!(&cubin[..4], b"\x7fELF");
        }
    }

    #[test]
    fn corrupt_entries_are_not_loaded() {
        let dir = std::env::temp_dir().join(format!("kiln-cache-test-{}", std::process::id()));
        let path = dir.join("entry.cubin");
        write_entry(&path, b"\x7fELF and more bytes").unwrap();
        assert_eq!(read_entry(&path).unwrap(), b"\x7fELF and more bytes");
        let mut bytes = std::fs::read(&path).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        assert!(read_entry(&path).is_none(), "a flipped bit is caught");
        std::fs::write(&path, &bytes[..bytes.len() - 3]).unwrap();
        assert!(read_entry(&path).is_none(), "a truncated entry is caught");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
