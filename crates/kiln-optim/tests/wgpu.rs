//! kiln's optimizers on the first wgpu adapter (lavapipe in CI): the PyTorch fixtures within
//! 1e-5, and the CPU's results on large buffers within 1e-4. Not to the bit: a driver may
//! compute `fma` as a product and a sum (lavapipe does), and its division and square root
//! may be an ulp or two from IEEE's; a centered RMSprop's variance, a difference of two
//! close numbers, shows that most (2.9e-5 of a momentum buffer on lavapipe). The gradients'
//! statistics are summed by subgroups or in workgroup memory: both are run.

mod common;

use kiln_wgpu::{Options, WgpuBackend};
use std::sync::OnceLock;

/// The adapter, if there is one (`KILN_REQUIRE_WGPU=1` makes its absence a failure).
fn gpu() -> Option<WgpuBackend> {
    adapter().then(|| WgpuBackend::new(0).expect("a wgpu adapter"))
}

/// The adapter on its portable paths (workgroup-memory reductions, no f16 arithmetic).
fn portable_gpu() -> Option<WgpuBackend> {
    let portable = Options {
        subgroups: false,
        f16: false,
        cooperative_matrices: false,
    };
    adapter().then(|| WgpuBackend::with_options(0, portable).expect("a wgpu adapter"))
}

fn adapter() -> bool {
    static FOUND: OnceLock<bool> = OnceLock::new();
    *FOUND.get_or_init(kiln_wgpu::adapter_for_tests)
}

#[test]
fn every_rule_follows_pytorch_on_wgpu() {
    for gpu in [gpu(), portable_gpu()].into_iter().flatten() {
        common::check_all_within(&gpu, 1e-5);
    }
}

#[test]
fn wgpu_steps_follow_the_cpus_on_large_buffers() {
    for gpu in [gpu(), portable_gpu()].into_iter().flatten() {
        common::steps_follow_the_cpus(&gpu, 1 << 20, 1e-4, 1e-4);
    }
}

/// The compute copy of values over the whole f32 range (f16's subnormals, ties, values
/// that overflow to inf, inf and NaN) is what `half` rounds them to, in BF16 and in F16.
#[test]
fn the_compute_copy_rounds_as_half_does() {
    use kiln_core::{Backend, DType, Shape};
    use kiln_optim::{Optimizer, ParamLayout, Rule, Schedule, StepConfig};
    let Some(gpu) = gpu() else {
        return;
    };
    let mut bits = 0x2545_F491u32;
    let mut values: Vec<f32> = (0..50_001)
        .map(|_| {
            bits ^= bits << 13;
            bits ^= bits >> 17;
            bits ^= bits << 5;
            // Exponents 2^-30 .. 2^17 (f16's subnormals to past its largest), either sign.
            let exponent = 97 + (bits >> 8) % 48;
            f32::from_bits((bits & 0x8000_0000) | (exponent << 23) | (bits & 0x7f_ffff))
        })
        .collect();
    values.extend([
        65504.0,
        65519.996,
        65520.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        5.960_464_5e-8,
        2.980_232_2e-8,
        8.940_697e-8,
        -0.0,
        1.0 + f32::EPSILON * 4096.0,
    ]);
    let n = values.len();
    let layout = ParamLayout::new([("w", vec![n])]).unwrap();
    let config = StepConfig {
        rule: Rule::Sgd {
            momentum: 0.0,
            dampening: 0.0,
            nesterov: false,
            weight_decay: 0.0,
        },
        schedule: Schedule::Constant { lr: 1e-3 },
        max_grad_norm: None,
        loss_scaling: None,
    };
    for dtype in [DType::BF16, DType::F16] {
        // Zero gradients leave the parameters as they are; the copy is made of them.
        let mut params = common::upload(&gpu, &values);
        let grads = common::upload(&gpu, &vec![0.0; n]);
        let mut copy = gpu.zeros(dtype, Shape::new(vec![n]).unwrap()).unwrap();
        let mut opt = Optimizer::new(&gpu, layout.clone(), config).unwrap();
        opt.step(&gpu, &mut params, &grads, Some(&mut copy))
            .unwrap();
        // The step leaves them as they were, but for a NaN's payload (NVIDIA's GPUs make
        // every NaN 0x7fffffff); the copy rounds what the step wrote.
        let after = common::download(&gpu, &params);
        for (a, v) in after.iter().zip(&values) {
            assert!(
                a.to_bits() == v.to_bits() || (a.is_nan() && v.is_nan()),
                "{v:e} became {a:e}"
            );
        }
        let got: Vec<u16> = bytemuck::pod_collect_to_vec(&gpu.download(&copy).unwrap());
        let want: Vec<u16> = after
            .iter()
            .map(|&v| match dtype {
                DType::BF16 => half::bf16::from_f32(v).to_bits(),
                _ => half::f16::from_f32(v).to_bits(),
            })
            .collect();
        let bad: Vec<String> = (0..n)
            .filter(|&i| got[i] != want[i])
            .take(5)
            .map(|i| format!("{:e}: {:#06x}, want {:#06x}", after[i], got[i], want[i]))
            .collect();
        assert!(bad.is_empty(), "{dtype}: {}", bad.join("; "));
    }
}

/// A state restored into the same optimizer (its control block written over) is what the
/// next steps go on from: the steps after it equal the steps that first followed it.
#[test]
fn a_restored_state_is_where_the_next_steps_start() {
    use kiln_core::Backend;
    use kiln_optim::{Optimizer, ParamLayout, Rule, Schedule, StepConfig};
    let Some(gpu) = gpu() else {
        return;
    };
    let layout = ParamLayout::new([("w", vec![3000]), ("b", vec![7])]).unwrap();
    let n = layout.numel();
    let config = StepConfig {
        rule: Rule::adamw(0.1),
        schedule: Schedule::Cosine {
            lr: 1e-2,
            min_lr: 1e-3,
            warmup: 1,
            total: 6,
        },
        max_grad_norm: None,
        loss_scaling: None,
    };
    let grads: Vec<_> = (0..5)
        .map(|k| common::upload(&gpu, &common::values(n, 20 + k)))
        .collect();
    let mut params = common::upload(&gpu, &common::values(n, 1));
    let mut opt = Optimizer::new(&gpu, layout, config).unwrap();
    for g in &grads[..3] {
        opt.step(&gpu, &mut params, g, None).unwrap();
    }
    let (saved, saved_params) = (opt.save(&gpu).unwrap(), gpu.download(&params).unwrap());
    for g in &grads[3..] {
        opt.step(&gpu, &mut params, g, None).unwrap();
    }
    let first = common::download(&gpu, &params);
    opt.load(&gpu, &saved).unwrap();
    gpu.write(&mut params, &saved_params).unwrap();
    for g in &grads[3..] {
        opt.step(&gpu, &mut params, g, None).unwrap();
    }
    let again = common::download(&gpu, &params);
    assert!(
        first.iter().zip(&again).all(|(a, b)| common::same(*a, *b)),
        "steps 4 and 5 after the restore differ from the first time"
    );
    assert_eq!(opt.status(&gpu).unwrap().steps, 5.0);
}
