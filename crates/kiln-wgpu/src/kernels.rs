//! The compute pipelines: each kernel is an entry point of one of `src/shaders/*.wgsl`,
//! assembled with the reduction helpers the device can run (subgroups or workgroup
//! memory) and specialised by override constants (the weight type). Pipelines are made
//! once, on first use, through the on-disk pipeline cache where the platform has one.

use crate::device::Caps;
use crate::pipeline_cache::PipelineCache;
use kiln_core::{Error, Result};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// How a kernel touches one of its storage bindings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Access {
    Read,
    Write,
}

use Access::{Read, Write};

/// One entry point: its shader file, name and storage bindings (group 0, in order).
/// Every kernel also reads its parameters from a uniform at group 1, binding 0.
pub(crate) struct KernelSpec {
    pub file: &'static str,
    pub entry: &'static str,
    pub bindings: &'static [Access],
}

const fn spec(file: &'static str, entry: &'static str, bindings: &'static [Access]) -> KernelSpec {
    KernelSpec {
        file,
        entry,
        bindings,
    }
}

pub(crate) const FILL: KernelSpec = spec("elementwise", "fill", &[Write]);
pub(crate) const BINARY: KernelSpec = spec("elementwise", "binary", &[Write, Read]);
pub(crate) const UNARY: KernelSpec = spec("elementwise", "unary", &[Write]);
pub(crate) const GATED: KernelSpec = spec("gated", "gated", &[Read, Read, Write]);
/// Rows into a KV cache (specialised by the override `KV`, the cache's type).
pub(crate) const WRITE_ROWS: KernelSpec = spec("kv_rows", "write_rows", &[Read, Write, Read]);
pub(crate) const COPY_ROWS: KernelSpec = spec("kv_rows", "copy_rows", &[Read, Write, Read]);
pub(crate) const SLICE_COLS: KernelSpec = spec("cols", "slice_cols", &[Read, Write]);
pub(crate) const ROPE: KernelSpec = spec("rope", "rope", &[Write, Read, Read]);
pub(crate) const RMS_NORM: KernelSpec = spec("norm", "rms_norm", &[Read, Read, Read, Write]);
pub(crate) const LAYER_NORM: KernelSpec = spec("norm", "layer_norm", &[Read, Read, Read, Write]);
pub(crate) const SOFTMAX: KernelSpec = spec("softmax", "softmax", &[Write]);
pub(crate) const ARGMAX: KernelSpec = spec("argmax", "argmax", &[Read, Write]);
pub(crate) const EMBEDDING: KernelSpec = spec("embedding", "embedding", &[Read, Read, Read, Write]);
/// x, weight quants, weight scales, out, aux (the gate), norm weight, normed row.
const MATVEC_BINDINGS: &[Access] = &[Read, Read, Read, Write, Read, Read, Write];
pub(crate) const MATVEC: KernelSpec = spec("matvec", "matvec", MATVEC_BINDINGS);
pub(crate) const MATVEC1: KernelSpec = spec("matvec", "matvec1", MATVEC_BINDINGS);
/// x rounded, weight quants, weight scales, out, aux (the gate), then the quants, scales
/// and out of a second and a third weight (shaders/matvec_items.wgsl).
const ITEM_BINDINGS: &[Access] = &[
    Read, Read, Read, Write, Read, Read, Read, Write, Read, Read, Write,
];
/// Storage bindings the item kernels take: an adapter with fewer keeps decode's products
/// on the float kernels.
pub(crate) const ITEM_BINDING_COUNT: u32 = ITEM_BINDINGS.len() as u32;
pub(crate) const MATVEC_Q8: KernelSpec = spec("matvec_q8", "matvec_items", ITEM_BINDINGS);
pub(crate) const MATVEC_F16: KernelSpec = spec("matvec_f16", "matvec_items", ITEM_BINDINGS);
pub(crate) const MATVEC_Q8_GATED: KernelSpec =
    spec("matvec_q8", "matvec_items_gated", ITEM_BINDINGS);
pub(crate) const MATVEC_F16_GATED: KernelSpec =
    spec("matvec_f16", "matvec_items_gated", ITEM_BINDINGS);
/// x, norm weight, normed row, x rounded.
const ROUND_BINDINGS: &[Access] = &[Read, Read, Write, Write];
pub(crate) const QUANTIZE_ROW: KernelSpec = spec("quantize_row", "quantize_row", ROUND_BINDINGS);
pub(crate) const ROW_TO_F16: KernelSpec = spec("quantize_row", "row_to_f16", ROUND_BINDINGS);
pub(crate) const ROPE_WRITE_KV: KernelSpec = spec(
    "rope_kv",
    "rope_write_kv",
    &[Write, Write, Read, Read, Read, Write, Write],
);
pub(crate) const GEMM: KernelSpec = spec("gemm", "gemm", &[Read, Read, Read, Write]);
/// x rounded to f16, the weight's quants and scales, out (shaders/gemm_tiles.wgsl): F16
/// weights as stored, or any type decoded.
pub(crate) const GEMM_COOP_F16: KernelSpec =
    spec("gemm_coop_f16", "gemm_tiles", &[Read, Read, Read, Write]);
pub(crate) const GEMM_COOP_Q: KernelSpec =
    spec("gemm_coop_q", "gemm_tiles", &[Read, Read, Read, Write]);
/// logits, penalized ids, ids drawn, the draws' records.
pub(crate) const SAMPLE_ROWS: KernelSpec =
    spec("sample", "sample_rows", &[Write, Read, Write, Read]);
/// q, k cache, v cache, positions, out, and for a paged cache each query's sequence and the
/// block tables.
const ATTENTION_BINDINGS: &[Access] = &[Read, Read, Read, Read, Write, Read, Read];
pub(crate) const ATTENTION: KernelSpec = spec("attention", "attention", ATTENTION_BINDINGS);
pub(crate) const ATTENTION_TILES: KernelSpec =
    spec("attention", "attention_tiles", ATTENTION_BINDINGS);
pub(crate) const ATTENTION_COOP: KernelSpec =
    spec("attention_coop", "attention_coop", ATTENTION_BINDINGS);

/// params, grads, three states, the compute copy.
pub(crate) const OPTIM_UPDATE: KernelSpec = spec(
    "optim",
    "optim_update",
    &[Write, Read, Write, Write, Write, Write],
);
/// grads, the workgroups' partial statistics.
pub(crate) const GRAD_STATS: KernelSpec = spec("optim_stats", "grad_stats", &[Read, Write]);

/// Every shader file with kernels: its name and text.
const SHADERS: &[(&str, &str)] = &[
    ("elementwise", include_str!("shaders/elementwise.wgsl")),
    ("gated", include_str!("shaders/gated.wgsl")),
    ("cols", include_str!("shaders/cols.wgsl")),
    ("kv_rows", include_str!("shaders/kv_rows.wgsl")),
    ("softmax", include_str!("shaders/softmax.wgsl")),
    ("argmax", include_str!("shaders/argmax.wgsl")),
    ("rope", include_str!("shaders/rope.wgsl")),
    ("rope_kv", include_str!("shaders/rope_kv.wgsl")),
    ("norm", include_str!("shaders/norm.wgsl")),
    ("embedding", include_str!("shaders/embedding.wgsl")),
    ("matvec", include_str!("shaders/matvec.wgsl")),
    ("matvec_q8", include_str!("shaders/matvec_q8.wgsl")),
    ("matvec_f16", include_str!("shaders/matvec_f16.wgsl")),
    ("quantize_row", include_str!("shaders/quantize_row.wgsl")),
    ("gemm", include_str!("shaders/gemm.wgsl")),
    ("gemm_coop_f16", include_str!("shaders/gemm_coop_f16.wgsl")),
    ("gemm_coop_q", include_str!("shaders/gemm_coop_q.wgsl")),
    ("attention", include_str!("shaders/attention.wgsl")),
    (
        "attention_coop",
        include_str!("shaders/attention_coop.wgsl"),
    ),
    ("sample", include_str!("shaders/sample.wgsl")),
    ("optim", include_str!("shaders/optim.wgsl")),
    ("optim_stats", include_str!("shaders/optim_stats.wgsl")),
];

fn source(file: &str) -> &'static str {
    SHADERS
        .iter()
        .find(|(name, _)| *name == file)
        .map(|(_, text)| *text)
        .unwrap_or_else(|| unreachable!("no shader file {file}"))
}

/// The WGSL of shader file `file` as a module: the extensions it enables, the reductions
/// (`subgroups` or workgroup memory), the helpers every kernel shares, and what the kernels
/// reading weights share.
fn module_source(file: &str, subgroups: bool) -> String {
    let reduce = if subgroups {
        REDUCE_SUBGROUP
    } else {
        REDUCE_WORKGROUP
    };
    // The kernels that read weights share their parameters and scales, and those that
    // read them a word at a time the decoding; the matrix-vector kernels share what a
    // result becomes, the float ones x and the fused norm.
    let shared: &[&str] = match file {
        "matvec" => &[WPARAMS, WEIGHTS, EPILOGUE, MATVEC_IO],
        "matvec_q8" | "matvec_f16" => &[WPARAMS, EPILOGUE, MATVEC_ITEMS],
        "gemm" | "embedding" => &[WPARAMS, WEIGHTS],
        "gemm_coop_f16" => &[WPARAMS, GEMM_TILES],
        "gemm_coop_q" => &[WPARAMS, WEIGHTS, GEMM_TILES],
        "attention" | "attention_coop" => &[KV_CACHE, ATTENTION_IO],
        "rope_kv" | "kv_rows" => &[KV_CACHE],
        _ => &[],
    };
    // f16 arithmetic and cooperative matrices are WGSL extensions, declared before
    // anything else.
    let enable = match file {
        "matvec_f16" => "enable f16;\n",
        "gemm_coop_f16" | "gemm_coop_q" | "attention_coop" => {
            "enable f16;\nenable wgpu_cooperative_matrix;\n"
        }
        _ => "",
    };
    format!(
        "{enable}{reduce}\n{COMMON}\n{}\n{}",
        shared.join("\n"),
        source(file)
    )
}

/// Every shader file, for the pipeline cache's key.
pub(crate) fn all_sources() -> Vec<&'static str> {
    let mut all = vec![
        COMMON,
        WPARAMS,
        WEIGHTS,
        EPILOGUE,
        MATVEC_IO,
        MATVEC_ITEMS,
        KV_CACHE,
        ATTENTION_IO,
        GEMM_TILES,
        REDUCE_SUBGROUP,
        REDUCE_WORKGROUP,
    ];
    all.extend(SHADERS.iter().map(|(_, text)| *text));
    all
}

const COMMON: &str = include_str!("shaders/common.wgsl");
const WPARAMS: &str = include_str!("shaders/wparams.wgsl");
const WEIGHTS: &str = include_str!("shaders/weights.wgsl");
const EPILOGUE: &str = include_str!("shaders/epilogue.wgsl");
const MATVEC_IO: &str = include_str!("shaders/matvec_io.wgsl");
const MATVEC_ITEMS: &str = include_str!("shaders/matvec_items.wgsl");
const KV_CACHE: &str = include_str!("shaders/kv_cache.wgsl");
const ATTENTION_IO: &str = include_str!("shaders/attention_io.wgsl");
const GEMM_TILES: &str = include_str!("shaders/gemm_tiles.wgsl");
const REDUCE_SUBGROUP: &str = include_str!("shaders/reduce_subgroup.wgsl");
const REDUCE_WORKGROUP: &str = include_str!("shaders/reduce_workgroup.wgsl");

/// A pipeline and the layout of its storage bindings.
pub(crate) struct Kernel {
    pub name: String,
    pub pipeline: wgpu::ComputePipeline,
    pub storage_layout: wgpu::BindGroupLayout,
}

pub(crate) struct Kernels {
    caps: Caps,
    params_layout: wgpu::BindGroupLayout,
    modules: Mutex<HashMap<&'static str, wgpu::ShaderModule>>,
    made: Mutex<HashMap<String, Arc<Kernel>>>,
    cache: Option<PipelineCache>,
    /// Whether wgpu's bounds checks are compiled into the shaders.
    bounds_checks: bool,
    /// Pipelines built since the cache was loaded: the cache is saved when there are any.
    built: std::sync::atomic::AtomicUsize,
}

impl Kernels {
    pub fn new(device: &wgpu::Device, caps: Caps, cache: Option<PipelineCache>) -> Self {
        let params_layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
            label: Some("kiln params"),
            entries: &[wgpu::BindGroupLayoutEntry {
                binding: 0,
                visibility: wgpu::ShaderStages::COMPUTE,
                ty: wgpu::BindingType::Buffer {
                    ty: wgpu::BufferBindingType::Uniform,
                    has_dynamic_offset: true,
                    min_binding_size: wgpu::BufferSize::new(crate::stream::PARAMS_BYTES),
                },
                count: None,
            }],
        });
        Kernels {
            caps,
            params_layout,
            modules: Mutex::new(HashMap::new()),
            made: Mutex::new(HashMap::new()),
            cache,
            bounds_checks: std::env::var_os("KILN_WGPU_BOUNDS_CHECKS").is_some_and(|v| v == "1"),
            built: Default::default(),
        }
    }

    pub fn params_layout(&self) -> &wgpu::BindGroupLayout {
        &self.params_layout
    }

    /// Save the pipeline cache if pipelines were built since it was loaded.
    pub fn save_cache(&self) {
        if self.built.load(std::sync::atomic::Ordering::Relaxed) > 0 {
            if let Some(c) = &self.cache {
                c.save();
            }
        }
    }

    /// The kernel `spec` with override constants `constants`, made on first use.
    pub fn get(
        &self,
        device: &wgpu::Device,
        spec: &KernelSpec,
        constants: &[(&str, f64)],
    ) -> Result<Arc<Kernel>> {
        let mut name = format!("{}::{}", spec.file, spec.entry);
        for (k, v) in constants {
            name.push_str(&format!(" {k}={v}"));
        }
        if let Some(k) = self.made.lock().unwrap().get(&name) {
            return Ok(k.clone());
        }
        let module = self.module(device, spec.file)?;
        let entries: Vec<wgpu::BindGroupLayoutEntry> = spec
            .bindings
            .iter()
            .enumerate()
            .map(|(i, access)| wgpu::BindGroupLayoutEntry {
                binding: i as u32,
                visibility: wgpu::ShaderStages::COMPUTE,
                ty: wgpu::BindingType::Buffer {
                    ty: wgpu::BufferBindingType::Storage {
                        read_only: *access == Read,
                    },
                    has_dynamic_offset: false,
                    min_binding_size: None,
                },
                count: None,
            })
            .collect();
        let scope = device.push_error_scope(wgpu::ErrorFilter::Validation);
        let storage_layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
            label: Some(&name),
            entries: &entries,
        });
        let layout = device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
            label: Some(&name),
            bind_group_layouts: &[Some(&storage_layout), Some(&self.params_layout)],
            immediate_size: 0,
        });
        let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(&name),
            layout: Some(&layout),
            module: &module,
            entry_point: Some(spec.entry),
            compilation_options: wgpu::PipelineCompilationOptions {
                constants,
                zero_initialize_workgroup_memory: false,
            },
            cache: self.cache.as_ref().map(|c| &c.cache),
        });
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(Error::Device(format!(
                "wgpu: kernel {name} cannot be built on this adapter: {e}"
            )));
        }
        self.built
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let kernel = Arc::new(Kernel {
            name: name.clone(),
            pipeline,
            storage_layout,
        });
        self.made.lock().unwrap().insert(name, kernel.clone());
        Ok(kernel)
    }

    fn module(&self, device: &wgpu::Device, file: &'static str) -> Result<wgpu::ShaderModule> {
        if let Some(m) = self.modules.lock().unwrap().get(file) {
            return Ok(m.clone());
        }
        let text = module_source(file, self.caps.subgroups);
        let scope = device.push_error_scope(wgpu::ErrorFilter::Validation);
        let desc = wgpu::ShaderModuleDescriptor {
            label: Some(file),
            source: wgpu::ShaderSource::Wgsl(text.into()),
        };
        let module = if self.bounds_checks {
            device.create_shader_module(desc)
        } else {
            // SAFETY: every index a kernel forms is within the buffers the host bound for
            // it: shapes are checked before each dispatch and the shaders guard the edges
            // of their grids. The checks wgpu would add (a clamp on every load) cost the
            // decode kernels most of their speed on an H200; KILN_WGPU_BOUNDS_CHECKS=1
            // puts them back to debug a kernel.
            unsafe {
                device.create_shader_module_trusted(desc, wgpu::ShaderRuntimeChecks::unchecked())
            }
        };
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(Error::Device(format!(
                "wgpu: shader {file}.wgsl does not compile on this adapter: {e}"
            )));
        }
        self.modules.lock().unwrap().insert(file, module.clone());
        Ok(module)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use wgpu::naga;

    /// Every module parses, validates and translates to SPIR-V with naga, with both
    /// reductions, whatever this machine's adapter can run (the f16 and cooperative-matrix
    /// kernels included: lavapipe builds no cooperative-matrix pipeline, and naga's SPIR-V
    /// writer has panicked on a module its validator accepted).
    #[test]
    fn every_shader_module_validates() {
        for (file, _) in SHADERS {
            for subgroups in [true, false] {
                let text = module_source(file, subgroups);
                let module = naga::front::wgsl::parse_str(&text)
                    .unwrap_or_else(|e| panic!("{file}.wgsl: {}", e.emit_to_string(&text)));
                let info = naga::valid::Validator::new(
                    naga::valid::ValidationFlags::all(),
                    naga::valid::Capabilities::all(),
                )
                .validate(&module)
                .unwrap_or_else(|e| panic!("{file}.wgsl (subgroups {subgroups}): {e:?}"));
                let options = naga::back::spv::Options {
                    lang_version: (1, 4),
                    ..Default::default()
                };
                let (module, info) = naga::back::pipeline_constants::process_overrides(
                    &module,
                    &info,
                    None,
                    &Default::default(),
                )
                .unwrap_or_else(|e| panic!("{file}.wgsl overrides: {e:?}"));
                naga::back::spv::write_vec(&module, &info, &options, None)
                    .unwrap_or_else(|e| panic!("{file}.wgsl to SPIR-V: {e:?}"));
            }
        }
    }
}
