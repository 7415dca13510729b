//! Where the GPU backends keep what they compile (CUDA kernels, wgpu pipelines), and the
//! hash that names and checks their files.

use std::path::PathBuf;

/// `KILN_CACHE_DIR`, else `$XDG_CACHE_HOME/kiln`, else `~/.cache/kiln`.
pub fn dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("KILN_CACHE_DIR") {
        return Some(PathBuf::from(d));
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("kiln"))
}

/// FNV-1a: stable across Rust versions (unlike std's hasher), which a disk key needs.
pub fn fnv1a(bytes: &[u8], mut h: u64) -> u64 {
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The FNV-1a starting value.
pub const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
