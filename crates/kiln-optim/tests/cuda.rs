//! kiln's optimizers on a CUDA GPU: the PyTorch fixtures (bit-equal, as on the CPU), the
//! CPU's results on large buffers of awkward length, and a step recorded as a CUDA graph.

mod common;

use common::{download, same, upload};
use kiln_core::{Backend, DType, Shape};
use kiln_cpu::CpuBackend;
use kiln_cuda::CudaBackend;
use kiln_optim::{LossScaling, Optimizer, ParamLayout, Rule, Schedule, StepConfig};

fn gpu() -> CudaBackend {
    CudaBackend::new(0).expect("a CUDA device")
}

#[test]
#[ignore = "needs a CUDA device"]
fn every_rule_is_bit_equal_to_pytorch_on_cuda() {
    common::check_all(&gpu(), 1e-5);
}

fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    (0..n)
        .map(|i| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let v = ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 4.0;
            match i % 997 {
                0 => 0.0,
                1 => 1e-40,
                2 => 1e30,
                _ => v,
            }
        })
        .collect()
}

/// Every rule, with and without clipping and loss scaling, on 3·2²⁰ + 5 elements: the
/// GPU's parameters, states and BF16 copy against the CPU's after 4 steps.
#[test]
#[ignore = "needs a CUDA device"]
fn cuda_steps_equal_the_cpus_on_large_buffers() {
    let (gpu, cpu) = (gpu(), CpuBackend::new(None).unwrap());
    let layout = ParamLayout::new([("a", vec![3 << 20]), ("b", vec![5])]).unwrap();
    let n = layout.numel();
    let sgd = Rule::Sgd {
        momentum: 0.9,
        dampening: 0.0,
        nesterov: true,
        weight_decay: 1e-2,
    };
    let adam = Rule::Adam {
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.01,
        decoupled_weight_decay: false,
        amsgrad: true,
    };
    let rms = Rule::RmsProp {
        alpha: 0.99,
        eps: 1e-8,
        weight_decay: 0.01,
        momentum: 0.9,
        centered: true,
    };
    let adagrad = Rule::Adagrad {
        lr_decay: 0.01,
        weight_decay: 0.0,
        eps: 1e-10,
        initial_accumulator_value: 0.1,
    };
    let schedule = Schedule::OneCycle {
        max_lr: 1e-2,
        total: 10,
        pct_start: 0.3,
        div_factor: 25.0,
        final_div_factor: 1e4,
    };
    let mut configs = Vec::new();
    for rule in [sgd, adam, Rule::adamw(0.1), rms, adagrad] {
        configs.push(StepConfig {
            rule,
            schedule,
            max_grad_norm: None,
            loss_scaling: None,
        });
    }
    configs.push(StepConfig {
        rule: Rule::adamw(0.1),
        schedule,
        max_grad_norm: Some(1.0),
        loss_scaling: Some(LossScaling {
            growth_interval: 2,
            ..LossScaling::default()
        }),
    });
    let mut failures = Vec::new();
    for config in configs {
        let mut results = Vec::new();
        for b in [&gpu as &dyn Backend, &cpu] {
            let mut params = upload(b, &values(n, 1));
            let mut copy = b.zeros(DType::BF16, Shape::new(vec![n]).unwrap()).unwrap();
            let mut opt = Optimizer::new(b, layout.clone(), config).unwrap();
            for k in 0..4 {
                let mut g = values(n, 2 + k);
                if k == 1 {
                    g[12345] = f32::NAN; // skipped under loss scaling, propagated otherwise
                }
                opt.step(b, &mut params, &upload(b, &g), Some(&mut copy))
                    .unwrap();
            }
            let mut arrays = vec![download(b, &params)];
            for name in config.rule.states() {
                arrays.push(download(b, opt.state(name).unwrap()));
            }
            let halves: Vec<u16> = bytemuck::pod_collect_to_vec(&b.download(&copy).unwrap());
            arrays.push(
                halves
                    .iter()
                    .map(|&h| half::bf16::from_bits(h).to_f32())
                    .collect(),
            );
            results.push((arrays, opt.status(b).unwrap()));
        }
        let (gpu_arrays, gpu_status) = &results[0];
        let (cpu_arrays, cpu_status) = &results[1];
        // Clipping divides by a norm the GPU sums in another order than the CPU.
        let rel = if config.max_grad_norm.is_some() {
            1e-5
        } else {
            0.0
        };
        for (i, (g, c)) in gpu_arrays.iter().zip(cpu_arrays).enumerate() {
            let bad = g
                .iter()
                .zip(c)
                .filter(|(g, c)| !common::close(**g, **c, rel, 0.0))
                .count();
            if bad > 0 {
                let first = g
                    .iter()
                    .zip(c)
                    .position(|(g, c)| !common::close(*g, *c, rel, 0.0))
                    .unwrap();
                failures.push(format!(
                    "{:?}: array {i}: {bad} differ, first at {first}: gpu {:e} cpu {:e}",
                    config.rule, g[first], c[first]
                ));
            }
        }
        if gpu_status.steps != cpu_status.steps || gpu_status.loss_scale != cpu_status.loss_scale {
            failures.push(format!(
                "{:?}: status gpu {gpu_status:?} cpu {cpu_status:?}",
                config.rule
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A step recorded once and replayed gives what the same steps give run one by one: the
/// step count and learning rate move on the device.
#[test]
#[ignore = "needs a CUDA device"]
fn a_recorded_step_replays_with_the_schedule_moving_on() {
    let b = gpu();
    let layout = ParamLayout::new([("w", vec![1000, 77])]).unwrap();
    let n = layout.numel();
    let config = StepConfig {
        rule: Rule::adamw(0.1),
        schedule: Schedule::Cosine {
            lr: 1e-3,
            min_lr: 1e-4,
            warmup: 2,
            total: 8,
        },
        max_grad_norm: Some(0.5),
        loss_scaling: None,
    };
    let grads = upload(&b, &values(n, 9));
    let mut eager_params = upload(&b, &values(n, 8));
    let mut eager = Optimizer::new(&b, layout.clone(), config).unwrap();
    for _ in 0..5 {
        eager.step(&b, &mut eager_params, &grads, None).unwrap();
    }
    let mut params = upload(&b, &values(n, 8));
    let mut opt = Optimizer::new(&b, layout, config).unwrap();
    // One step outside the recording: the step's work buffers are allocated then.
    opt.step(&b, &mut params, &grads, None).unwrap();
    let replay = b
        .capture(&mut || opt.step(&b, &mut params, &grads, None))
        .unwrap()
        .expect("CUDA records");
    for _ in 0..4 {
        replay.replay().unwrap();
    }
    let (a, e) = (download(&b, &params), download(&b, &eager_params));
    assert!(
        a.iter().zip(&e).all(|(a, e)| same(*a, *e)),
        "replayed steps differ from eager ones"
    );
    let (s, es) = (opt.status(&b).unwrap(), eager.status(&b).unwrap());
    assert_eq!((s.steps, s.lr), (5.0, es.lr));
}
