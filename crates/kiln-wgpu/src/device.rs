//! Finding adapters, describing them, and opening one as a device with the features kiln
//! uses where the adapter has them.

use kiln_core::{Error, Result};
use std::fmt;

/// What kiln reports of an adapter (`kiln devices`) and decides its shaders by.
#[derive(Clone, Debug)]
pub struct AdapterSummary {
    /// Index in [`adapters`]' list: `--device wgpu:N`.
    pub index: usize,
    pub name: String,
    /// Vulkan, Metal, DX12.
    pub backend: String,
    pub device_type: wgpu::DeviceType,
    pub driver: String,
    pub subgroup_sizes: (u32, u32),
    pub subgroups: bool,
    pub shader_f16: bool,
    pub timestamps: bool,
    pub pipeline_cache: bool,
    pub max_binding: u64,
    pub max_buffer: u64,
    pub workgroup_memory: u32,
    /// The cooperative-matrix (tensor core) shapes wgpu offers on this adapter, as
    /// "MxNxK a->c"; empty when it offers none (wgpu 30 takes only 8×8 f32 on Vulkan).
    pub cooperative_matrices: Vec<String>,
}

impl AdapterSummary {
    fn new(index: usize, adapter: &wgpu::Adapter) -> Self {
        let info = adapter.get_info();
        let features = adapter.features();
        let limits = adapter.limits();
        let driver = match (info.driver.is_empty(), info.driver_info.is_empty()) {
            (false, false) => format!("{} {}", info.driver, info.driver_info),
            (false, true) => info.driver.clone(),
            _ => info.driver_info.clone(),
        };
        AdapterSummary {
            index,
            name: info.name.clone(),
            backend: format!("{:?}", info.backend),
            device_type: info.device_type,
            driver,
            subgroup_sizes: (info.subgroup_min_size, info.subgroup_max_size),
            subgroups: features.contains(wgpu::Features::SUBGROUP),
            shader_f16: features.contains(wgpu::Features::SHADER_F16),
            timestamps: features.contains(wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES),
            pipeline_cache: features.contains(wgpu::Features::PIPELINE_CACHE),
            max_binding: limits.max_storage_buffer_binding_size,
            max_buffer: limits.max_buffer_size,
            workgroup_memory: limits.max_compute_workgroup_storage_size,
            cooperative_matrices: if features
                .contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX)
            {
                adapter
                    .cooperative_matrix_properties()
                    .iter()
                    .map(|p| {
                        format!(
                            "{}x{}x{} {:?}->{:?}",
                            p.m_size, p.n_size, p.k_size, p.ab_type, p.cr_type
                        )
                    })
                    .collect()
            } else {
                Vec::new()
            },
        }
    }

    /// A GPU of its own (not a CPU rasterizer such as lavapipe, nor unknown): what
    /// `--device auto` takes.
    pub fn is_gpu(&self) -> bool {
        matches!(
            self.device_type,
            wgpu::DeviceType::DiscreteGpu
                | wgpu::DeviceType::IntegratedGpu
                | wgpu::DeviceType::VirtualGpu
        )
    }
}

impl fmt::Display for AdapterSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.device_type {
            wgpu::DeviceType::DiscreteGpu => "discrete GPU",
            wgpu::DeviceType::IntegratedGpu => "integrated GPU",
            wgpu::DeviceType::VirtualGpu => "virtual GPU",
            wgpu::DeviceType::Cpu => "CPU",
            wgpu::DeviceType::Other => "other",
        };
        let mib = |b: u64| b >> 20;
        write!(
            f,
            "wgpu:{}  {} ({}, {kind}, driver {})\n    subgroups: {}, shader-f16: {}, timestamps: {}, pipeline cache: {}\n    max binding {} MiB, max buffer {} MiB, workgroup memory {} KiB\n    cooperative matrices: {}",
            self.index,
            self.name,
            self.backend,
            if self.driver.is_empty() { "unknown" } else { &self.driver },
            if self.subgroups {
                format!("{}-{}", self.subgroup_sizes.0, self.subgroup_sizes.1)
            } else {
                "no".to_string()
            },
            yes_no(self.shader_f16),
            yes_no(self.timestamps),
            yes_no(self.pipeline_cache),
            mib(self.max_binding),
            mib(self.max_buffer),
            self.workgroup_memory / 1024,
            if self.cooperative_matrices.is_empty() {
                "none".to_string()
            } else {
                self.cooperative_matrices.join(", ")
            },
        )
    }
}

fn yes_no(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "no"
    }
}

/// The native backends kiln drives; GL lacks what the shaders need (storage buffers in
/// every stage, subgroups) and the browser is not a target. One instance serves the whole
/// process, as wgpu advises: on the H200 the NVIDIA driver stopped listing its GPU after
/// about 26 instances had been made and dropped in one process (a backend per test case).
fn instance() -> wgpu::Instance {
    static INSTANCE: std::sync::OnceLock<wgpu::Instance> = std::sync::OnceLock::new();
    INSTANCE
        .get_or_init(|| {
            let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
            desc.backends = wgpu::Backends::VULKAN | wgpu::Backends::METAL | wgpu::Backends::DX12;
            wgpu::Instance::new(desc)
        })
        .clone()
}

fn list(instance: &wgpu::Instance) -> Vec<wgpu::Adapter> {
    let backends = wgpu::Backends::VULKAN | wgpu::Backends::METAL | wgpu::Backends::DX12;
    pollster::block_on(instance.enumerate_adapters(backends))
}

/// Every adapter wgpu finds, in the order `wgpu:N` counts them.
pub fn adapters() -> Vec<AdapterSummary> {
    list(&instance())
        .iter()
        .enumerate()
        .map(|(i, a)| AdapterSummary::new(i, a))
        .collect()
}

/// For test suites: whether there is an adapter to test on. Without one they skip with a
/// notice, unless `KILN_REQUIRE_WGPU=1` (CI, the GPU machine) makes that a failure.
pub fn adapter_for_tests() -> bool {
    if !adapters().is_empty() {
        return true;
    }
    let hint = "no wgpu adapter (install mesa-vulkan-drivers for lavapipe)";
    assert!(std::env::var_os("KILN_REQUIRE_WGPU").is_none(), "{hint}");
    eprintln!("SKIPPED: {hint}");
    false
}

/// Which of the adapter's optional features kiln may use; turning one off forces the
/// portable path (what an adapter without it runs).
#[derive(Clone, Copy, Debug)]
pub struct Options {
    pub subgroups: bool,
    /// f16 arithmetic (`SHADER_F16`) in the kernels that have an f16 form.
    pub f16: bool,
    /// Cooperative matrices (tensor cores: wgpu's experimental feature) for prompts'
    /// products, where the adapter offers 16×16×16 f16 products into f32.
    pub cooperative_matrices: bool,
}

impl Default for Options {
    /// Everything the adapter has.
    fn default() -> Self {
        Options {
            subgroups: true,
            f16: true,
            cooperative_matrices: true,
        }
    }
}

impl Options {
    /// Everything the adapter has, less what `KILN_WGPU_NO_SUBGROUPS=1`,
    /// `KILN_WGPU_NO_F16=1` and `KILN_WGPU_NO_COOP=1` turn off.
    pub fn from_env() -> Self {
        let off = |name: &str| std::env::var_os(name).is_some_and(|v| v == "1");
        Options {
            subgroups: !off("KILN_WGPU_NO_SUBGROUPS"),
            f16: !off("KILN_WGPU_NO_F16"),
            cooperative_matrices: !off("KILN_WGPU_NO_COOP"),
        }
    }
}

/// What the shaders may use on an opened device.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Caps {
    pub subgroups: bool,
    /// The largest subgroup the adapter may run, so that a workgroup of 256 has at least
    /// `256 / max` subgroups.
    pub subgroup_max: u32,
    /// f16 arithmetic in shaders (`enable f16;`).
    pub f16: bool,
    /// 16×16×16 f16 cooperative matrices into f32, in subgroups of 32
    /// (`enable wgpu_cooperative_matrix;`).
    pub cooperative_matrices: bool,
    pub timestamps: bool,
    pub max_binding: u64,
    pub max_buffer: u64,
    pub storage_align: u64,
    pub uniform_align: u64,
    pub max_groups: u32,
    /// Bytes of workgroup memory a workgroup may use.
    pub workgroup_memory: u32,
    /// Storage buffers one kernel may bind.
    pub storage_bindings: u32,
}

pub(crate) struct Opened {
    pub summary: AdapterSummary,
    pub adapter: wgpu::Adapter,
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
    pub caps: Caps,
}

/// Open adapter `index` with what kiln needs (storage buffers as large as the adapter
/// allows) and what it can use (subgroups, f16, timestamps, pipeline cache).
pub(crate) fn open(index: usize, options: Options) -> Result<Opened> {
    let instance = instance();
    let mut all = list(&instance);
    if index >= all.len() {
        return Err(Error::Device(if all.is_empty() {
            "no wgpu adapter: no Vulkan, Metal or DX12 driver was found (on Linux, install \
             the GPU's Vulkan driver, or mesa-vulkan-drivers for a CPU device)"
                .to_string()
        } else {
            format!(
                "no wgpu adapter {index}: this machine has {} (see `kiln devices`)",
                all.len()
            )
        }));
    }
    let adapter = all.swap_remove(index);
    let summary = AdapterSummary::new(index, &adapter);
    let have = adapter.features();
    let limits = adapter.limits();
    // A subgroup size outside WGSL's 4..=128 would break the reductions' assumptions.
    let subgroup_sizes_ok = (4..=128).contains(&summary.subgroup_sizes.0)
        && (4..=128).contains(&summary.subgroup_sizes.1);
    let subgroups = summary.subgroups && subgroup_sizes_ok && options.subgroups;
    let mut wanted = wgpu::Features::empty();
    if subgroups {
        wanted |= wgpu::Features::SUBGROUP;
    }
    let f16 = options.f16 && have.contains(wgpu::Features::SHADER_F16);
    if f16 {
        wanted |= wgpu::Features::SHADER_F16;
    }
    // The tensor-core kernels (prompts' products and attention) take 16×16×16 f16
    // products into f32, a subgroup of 32 lanes each (4 in a workgroup of 128).
    let cooperative_matrices = options.cooperative_matrices
        && f16
        && summary.subgroup_sizes == (32, 32)
        && summary
            .cooperative_matrices
            .iter()
            .any(|c| c == "16x16x16 F16->F32");
    if cooperative_matrices {
        wanted |= wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX;
    }
    for optional in [
        wgpu::Features::TIMESTAMP_QUERY,
        wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES,
        wgpu::Features::TIMESTAMP_QUERY_INSIDE_ENCODERS,
        wgpu::Features::PIPELINE_CACHE,
    ] {
        if have.contains(optional) {
            wanted |= optional;
        }
    }
    let desc = wgpu::DeviceDescriptor {
        label: Some("kiln"),
        required_features: wanted,
        required_limits: limits.clone(),
        // SAFETY: of the experimental features only cooperative matrices are asked for,
        // and only by gemm_tiles.wgsl and attention_coop.wgsl, which the op tests check
        // against float64 on every adapter that offers them; KILN_WGPU_NO_COOP=1 turns
        // them off.
        experimental_features: if cooperative_matrices {
            unsafe { wgpu::ExperimentalFeatures::enabled() }
        } else {
            wgpu::ExperimentalFeatures::disabled()
        },
        ..Default::default()
    };
    let (device, queue) = pollster::block_on(adapter.request_device(&desc)).map_err(|e| {
        Error::Device(format!(
            "wgpu adapter {index} ({}) refused a device: {e}",
            summary.name
        ))
    })?;
    let caps = Caps {
        subgroups,
        subgroup_max: summary.subgroup_sizes.1.max(4),
        f16,
        cooperative_matrices,
        timestamps: wanted.contains(wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES),
        max_binding: limits.max_storage_buffer_binding_size,
        max_buffer: limits.max_buffer_size,
        storage_align: u64::from(limits.min_storage_buffer_offset_alignment),
        uniform_align: u64::from(limits.min_uniform_buffer_offset_alignment),
        max_groups: limits.max_compute_workgroups_per_dimension,
        workgroup_memory: limits.max_compute_workgroup_storage_size,
        storage_bindings: limits.max_storage_buffers_per_shader_stage,
    };
    Ok(Opened {
        summary,
        adapter,
        device,
        queue,
        caps,
    })
}
