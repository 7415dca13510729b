//! What wgpu's cooperative matrices (16×16×16 f16 products into f32) deliver on the first
//! adapter that offers them (on subgroups of 32), apart from any GEMM: products on matrices held in registers,
//! the same with each step's matrices loaded from workgroup memory, and loaded from a
//! storage buffer. Session 23's staged prompt GEMM (one matrix loaded per product, since
//! replaced by shaders/gemm_tiles.wgsl) ran at ~35 TFLOPS on an H200; this said which of
//! the three bounded it (BENCHMARKS.md, issue 16).
//!
//!     cargo run --release -p kiln-wgpu --example coop_rate

use std::time::Instant;

const SHADER: &str = r#"
enable f16;
enable wgpu_cooperative_matrix;

@group(0) @binding(0) var<storage, read> src: array<f16>;
@group(0) @binding(1) var<storage, read_write> dst: array<f32>;
var<workgroup> tile: array<f16, 8192>;

const ITERS: u32 = 128u;
const STRIDE: u32 = 4096u;

fn fill(li: u32) {
    for (var i = li; i < 8192u; i += 256u) {
        tile[i] = f16(f32(i % 7u) * 0.01);
    }
    workgroupBarrier();
}

// Indices of cooperative loads and stores are `let`s: naga 30's SPIR-V writer panics on
// inline ones.
fn finish(c: coop_mat16x16<f32, C>, li: u32, wg: u32) {
    let at = (wg * 8u + li / 32u) * 256u;
    coopStoreT(c, &dst[at], 16u);
}

@compute @workgroup_size(256)
fn from_registers(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wg: vec3<u32>) {
    fill(li);
    let a = coopLoadT<coop_mat16x16<f16, A>>(&tile[0], 16u);
    let b0 = coopLoad<coop_mat16x16<f16, B>>(&tile[256], 16u);
    let b1 = coopLoad<coop_mat16x16<f16, B>>(&tile[512], 16u);
    let b2 = coopLoad<coop_mat16x16<f16, B>>(&tile[768], 16u);
    let b3 = coopLoad<coop_mat16x16<f16, B>>(&tile[1024], 16u);
    var c0 = coop_mat16x16<f32, C>();
    var c1 = coop_mat16x16<f32, C>();
    var c2 = coop_mat16x16<f32, C>();
    var c3 = coop_mat16x16<f32, C>();
    for (var i = 0u; i < ITERS; i++) {
        c0 = coopMultiplyAdd(a, b0, c0);
        c1 = coopMultiplyAdd(a, b1, c1);
        c2 = coopMultiplyAdd(a, b2, c2);
        c3 = coopMultiplyAdd(a, b3, c3);
    }
    finish(c0 + c1 + c2 + c3, li, wg.x);
}

@compute @workgroup_size(256)
fn from_workgroup(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wg: vec3<u32>) {
    fill(li);
    let s = li / 32u;
    var c0 = coop_mat16x16<f32, C>();
    var c1 = coop_mat16x16<f32, C>();
    var c2 = coop_mat16x16<f32, C>();
    var c3 = coop_mat16x16<f32, C>();
    for (var i = 0u; i < ITERS; i++) {
        let ia0 = ((i * 16u) % 64u) + (s % 4u) * 512u;
        let ia1 = ia0 + 512u;
        let ib0 = ia0 + 4096u;
        let ib1 = ib0 + 512u;
        let a0 = coopLoadT<coop_mat16x16<f16, A>>(&tile[ia0], 64u);
        let a1 = coopLoadT<coop_mat16x16<f16, A>>(&tile[ia1], 64u);
        let b0 = coopLoad<coop_mat16x16<f16, B>>(&tile[ib0], 64u);
        let b1 = coopLoad<coop_mat16x16<f16, B>>(&tile[ib1], 64u);
        c0 = coopMultiplyAdd(a0, b0, c0);
        c1 = coopMultiplyAdd(a0, b1, c1);
        c2 = coopMultiplyAdd(a1, b0, c2);
        c3 = coopMultiplyAdd(a1, b1, c3);
    }
    finish(c0 + c1 + c2 + c3, li, wg.x);
}

@compute @workgroup_size(256)
fn from_storage(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wg: vec3<u32>) {
    let s = li / 32u;
    let row = ((wg.x * 8u + s) * 32u) % 2048u;
    var c0 = coop_mat16x16<f32, C>();
    var c1 = coop_mat16x16<f32, C>();
    var c2 = coop_mat16x16<f32, C>();
    var c3 = coop_mat16x16<f32, C>();
    for (var i = 0u; i < ITERS; i++) {
        let ia0 = row * STRIDE + i * 16u;
        let ia1 = ia0 + 16u * STRIDE;
        let ib0 = ia0 + 2048u * STRIDE;
        let ib1 = ib0 + 16u * STRIDE;
        let a0 = coopLoadT<coop_mat16x16<f16, A>>(&src[ia0], STRIDE);
        let a1 = coopLoadT<coop_mat16x16<f16, A>>(&src[ia1], STRIDE);
        let b0 = coopLoad<coop_mat16x16<f16, B>>(&src[ib0], STRIDE);
        let b1 = coopLoad<coop_mat16x16<f16, B>>(&src[ib1], STRIDE);
        c0 = coopMultiplyAdd(a0, b0, c0);
        c1 = coopMultiplyAdd(a0, b1, c1);
        c2 = coopMultiplyAdd(a1, b0, c2);
        c3 = coopMultiplyAdd(a1, b1, c3);
    }
    finish(c0 + c1 + c2 + c3, li, wg.x);
}
"#;

const GROUPS: u32 = 1056;
const ITERS: f64 = 128.0;

fn main() {
    let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
    desc.backends = backends();
    let instance = wgpu::Instance::new(desc);
    let mut adapters = pollster::block_on(instance.enumerate_adapters(backends()));
    let wanted = wgpu::Features::SHADER_F16 | wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX;
    // The shaders take 16×16×16 f16 → f32 matrices and a subgroup of 32 lanes in each 32
    // of a workgroup, as kiln-wgpu's kernels do: the first adapter kiln would run them on
    // (its summaries list the adapters in the same order).
    let Some(index) = kiln_wgpu::adapters().iter().position(|a| {
        a.subgroup_sizes == (32, 32)
            && a.cooperative_matrices
                .iter()
                .any(|c| c == "16x16x16 F16->F32")
    }) else {
        println!("no adapter offers 16×16×16 f16 matrices on subgroups of 32: nothing measured");
        return;
    };
    let adapter = adapters.swap_remove(index);
    println!("{}", adapter.get_info().name);
    let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
        label: None,
        required_features: wanted,
        required_limits: adapter.limits(),
        // SAFETY: only cooperative matrices are used, in this measurement alone.
        experimental_features: unsafe { wgpu::ExperimentalFeatures::enabled() },
        ..Default::default()
    }))
    .expect("a device");
    let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
        label: None,
        source: wgpu::ShaderSource::Wgsl(SHADER.into()),
    });
    // 4,096 rows of 4,096 f16: the storage form reads 2,048 rows of x and 2,048 of w.
    let src = device.create_buffer(&wgpu::BufferDescriptor {
        label: None,
        size: 4096 * 4096 * 2,
        usage: wgpu::BufferUsages::STORAGE,
        mapped_at_creation: false,
    });
    let dst = device.create_buffer(&wgpu::BufferDescriptor {
        label: None,
        size: GROUPS as u64 * 8 * 256 * 4,
        usage: wgpu::BufferUsages::STORAGE,
        mapped_at_creation: false,
    });
    for entry in ["from_registers", "from_workgroup", "from_storage"] {
        let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: None,
            layout: None,
            module: &module,
            entry_point: Some(entry),
            compilation_options: Default::default(),
            cache: None,
        });
        let layout = pipeline.get_bind_group_layout(0);
        let mut entries = vec![wgpu::BindGroupEntry {
            binding: 1,
            resource: dst.as_entire_binding(),
        }];
        if entry == "from_storage" {
            entries.push(wgpu::BindGroupEntry {
                binding: 0,
                resource: src.as_entire_binding(),
            });
        }
        let group = device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: None,
            layout: &layout,
            entries: &entries,
        });
        for round in 0..3 {
            let mut encoder = device.create_command_encoder(&Default::default());
            {
                let mut pass = encoder.begin_compute_pass(&Default::default());
                pass.set_pipeline(&pipeline);
                pass.set_bind_group(0, &group, &[]);
                pass.dispatch_workgroups(GROUPS, 1, 1);
            }
            let t = Instant::now();
            queue.submit([encoder.finish()]);
            device
                .poll(wgpu::PollType::wait_indefinitely())
                .expect("the GPU finished");
            let s = t.elapsed().as_secs_f64();
            let flops = GROUPS as f64 * 8.0 * ITERS * 4.0 * 2.0 * 4096.0;
            println!(
                "{entry} round {round}: {:.3} ms, {:.1} TFLOPS",
                s * 1e3,
                flops / s / 1e12
            );
        }
    }
}

fn backends() -> wgpu::Backends {
    wgpu::Backends::VULKAN | wgpu::Backends::METAL | wgpu::Backends::DX12
}
