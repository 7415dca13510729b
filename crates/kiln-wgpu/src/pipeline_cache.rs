//! The driver's compiled pipelines on disk (Vulkan's pipeline cache), beside the CUDA
//! kernel cache: `<cache dir>/wgpu/<adapter and driver key>-<shader hash>.bin`. The file is
//! our checksum, then the driver's bytes; a file that fails the checksum (or that wgpu
//! refuses) is rebuilt, never handed to the driver.

use kiln_core::disk_cache::{self, fnv1a, FNV_OFFSET};
use std::path::PathBuf;

/// Refuse to read more than this: a pipeline cache of kiln's few dozen kernels is far
/// smaller, and a larger file is not ours.
const MAX_BYTES: u64 = 256 << 20;

pub(crate) struct PipelineCache {
    pub cache: wgpu::PipelineCache,
    path: PathBuf,
}

/// The cache for this adapter, driver and shader source, loaded when present; `None`
/// where the platform has none or there is no cache directory.
pub(crate) fn open(
    device: &wgpu::Device,
    info: &wgpu::AdapterInfo,
    features: wgpu::Features,
    source_hash: u64,
) -> Option<PipelineCache> {
    if !features.contains(wgpu::Features::PIPELINE_CACHE) {
        return None;
    }
    let key = wgpu::util::pipeline_cache_key(info)?;
    let path = disk_cache::dir()?
        .join("wgpu")
        .join(format!("{key}-{source_hash:016x}.bin"));
    let data = read(&path);
    // SAFETY: the data is what `get_data` returned for an adapter with this key (checked
    // by our checksum and by wgpu's own header), and `fallback` makes wgpu start empty
    // when the driver does not take it.
    let cache = unsafe {
        device.create_pipeline_cache(&wgpu::PipelineCacheDescriptor {
            label: Some("kiln"),
            data: data.as_deref(),
            fallback: true,
        })
    };
    Some(PipelineCache { cache, path })
}

fn read(path: &PathBuf) -> Option<Vec<u8>> {
    let meta = std::fs::metadata(path).ok()?;
    if !meta.is_file() || meta.len() > MAX_BYTES || meta.len() < 8 {
        return None;
    }
    let bytes = std::fs::read(path).ok()?;
    let (sum, data) = bytes.split_at(8);
    if u64::from_le_bytes(sum.try_into().ok()?) != fnv1a(data, FNV_OFFSET) {
        tracing::warn!(
            "the wgpu pipeline cache {} is corrupt; building the pipelines again",
            path.display()
        );
        let _ = std::fs::remove_file(path);
        return None;
    }
    Some(data.to_vec())
}

impl PipelineCache {
    /// Write what the driver has compiled (through a temporary file and a rename, so
    /// that a crash leaves the old file or the new one).
    pub fn save(&self) {
        let Some(data) = self.cache.get_data() else {
            return;
        };
        let result = (|| -> std::io::Result<()> {
            let dir = self.path.parent().expect("the cache file has a directory");
            std::fs::create_dir_all(dir)?;
            let tmp = self
                .path
                .with_extension(format!("{}.partial", std::process::id()));
            let mut bytes = fnv1a(&data, FNV_OFFSET).to_le_bytes().to_vec();
            bytes.extend_from_slice(&data);
            std::fs::write(&tmp, &bytes)?;
            std::fs::rename(&tmp, &self.path)
        })();
        if let Err(e) = result {
            tracing::warn!(
                "cannot write the wgpu pipeline cache {}: {e}",
                self.path.display()
            );
        }
    }
}

/// A hash of everything that shapes the pipelines: the shader files.
pub(crate) fn source_hash(sources: &[&str]) -> u64 {
    sources
        .iter()
        .fold(FNV_OFFSET, |h, s| fnv1a(s.as_bytes(), h))
}
