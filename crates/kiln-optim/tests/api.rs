//! The Optimizer's API on the CPU: compute copies, checkpoints that resume exactly,
//! skipped steps under loss scaling, and errors for buffers that do not fit.

mod common;

use common::{download, upload};
use kiln_core::{Backend, DType, Shape};
use kiln_cpu::CpuBackend;
use kiln_optim::{LossScaling, Optimizer, ParamLayout, Rule, Schedule, StepConfig};

fn layout() -> ParamLayout {
    ParamLayout::new([("w", vec![7, 19]), ("b", vec![7]), ("n", vec![300])]).unwrap()
}

/// Values of every magnitude, the same for a given seed.
fn values(n: usize, seed: u32) -> Vec<f32> {
    let mut x = seed.wrapping_mul(2654435761) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x as f32 / u32::MAX as f32 - 0.5) * 4.0
        })
        .collect()
}

fn adamw() -> StepConfig {
    StepConfig {
        rule: Rule::Adam {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.1,
            decoupled_weight_decay: true,
            amsgrad: true,
        },
        schedule: Schedule::Cosine {
            lr: 1e-2,
            min_lr: 1e-3,
            warmup: 2,
            total: 10,
        },
        max_grad_norm: Some(1.0),
        loss_scaling: None,
    }
}

#[test]
fn the_compute_copy_is_the_rounded_master_weights() {
    let b = CpuBackend::new(Some(2)).unwrap();
    let n = layout().numel();
    for dtype in [DType::BF16, DType::F16] {
        let mut params = upload(&b, &values(n, 1));
        let grads = upload(&b, &values(n, 2));
        let mut copy = b.zeros(dtype, Shape::new(vec![n]).unwrap()).unwrap();
        let mut opt = Optimizer::new(&b, layout(), adamw()).unwrap();
        opt.step(&b, &mut params, &grads, Some(&mut copy)).unwrap();
        let master = download(&b, &params);
        let halves: Vec<u16> = bytemuck::pod_collect_to_vec(&b.download(&copy).unwrap());
        for (i, (&m, &h)) in master.iter().zip(&halves).enumerate() {
            let want = if dtype == DType::BF16 {
                half::bf16::from_f32(m).to_bits()
            } else {
                half::f16::from_f32(m).to_bits()
            };
            assert_eq!(h, want, "{dtype} element {i} of {m}");
        }
    }
}

#[test]
fn a_saved_state_resumes_exactly() {
    let b = CpuBackend::new(Some(2)).unwrap();
    let n = layout().numel();
    let grads: Vec<_> = (0..6).map(|k| upload(&b, &values(n, 10 + k))).collect();
    let mut params = upload(&b, &values(n, 3));
    let mut opt = Optimizer::new(&b, layout(), adamw()).unwrap();
    for g in &grads[..3] {
        opt.step(&b, &mut params, g, None).unwrap();
    }
    let saved = opt.save(&b).unwrap();
    let params_at_3 = download(&b, &params);
    for g in &grads[3..] {
        opt.step(&b, &mut params, g, None).unwrap();
    }
    let straight = download(&b, &params);

    let mut resumed = Optimizer::new(&b, layout(), adamw()).unwrap();
    resumed.load(&b, &saved).unwrap();
    let mut params = upload(&b, &params_at_3);
    for g in &grads[3..] {
        resumed.step(&b, &mut params, g, None).unwrap();
    }
    let again = download(&b, &params);
    assert!(straight
        .iter()
        .zip(&again)
        .all(|(a, b)| a.to_bits() == b.to_bits()));
    assert_eq!(resumed.status(&b).unwrap(), opt.status(&b).unwrap());

    // A state for another rule or layout, or cut short, is refused.
    let mut sgd = Optimizer::new(
        &b,
        layout(),
        StepConfig {
            rule: Rule::Sgd {
                momentum: 0.9,
                dampening: 0.0,
                nesterov: false,
                weight_decay: 0.0,
            },
            ..adamw()
        },
    )
    .unwrap();
    let err = sgd.load(&b, &saved).unwrap_err().to_string();
    assert!(err.contains("rule"), "{err}");
    let other = ParamLayout::new([("w", vec![7, 19])]).unwrap();
    let err = Optimizer::new(&b, other, adamw())
        .unwrap()
        .load(&b, &saved)
        .unwrap_err()
        .to_string();
    assert!(err.contains("numel") || err.contains("layout"), "{err}");
    let err = resumed
        .load(&b, &saved[..saved.len() - 4])
        .unwrap_err()
        .to_string();
    assert!(err.contains("bytes of state"), "{err}");
}

#[test]
fn an_overflow_under_loss_scaling_skips_the_step() {
    let b = CpuBackend::new(Some(2)).unwrap();
    let n = layout().numel();
    let config = StepConfig {
        loss_scaling: Some(LossScaling::default()),
        ..adamw()
    };
    let mut opt = Optimizer::new(&b, layout(), config).unwrap();
    let start = values(n, 4);
    let mut params = upload(&b, &start);
    let mut g = values(n, 5);
    g[17] = f32::INFINITY;
    opt.step(&b, &mut params, &upload(&b, &g), None).unwrap();
    let status = opt.status(&b).unwrap();
    assert_eq!(
        (status.skipped, status.steps, status.loss_scale),
        (1, 0.0, 32768.0)
    );
    assert_eq!(
        download(&b, &params),
        start,
        "a skipped step changes nothing"
    );
    g[17] = 1.0;
    opt.step(&b, &mut params, &upload(&b, &g), None).unwrap();
    let status = opt.status(&b).unwrap();
    assert_eq!((status.skipped, status.steps), (0, 1.0));
    assert_ne!(download(&b, &params), start);
}

#[test]
fn buffers_that_do_not_fit_are_errors() {
    let b = CpuBackend::new(Some(2)).unwrap();
    let n = layout().numel();
    let mut opt = Optimizer::new(&b, layout(), adamw()).unwrap();
    let grads = upload(&b, &values(n, 6));
    let mut short = upload(&b, &values(n - 1, 6));
    let err = opt
        .step(&b, &mut short, &grads, None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("parameter buffer has"), "{err}");
    let mut params = upload(&b, &values(n, 7));
    let err = opt
        .step(&b, &mut params, &short, None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("gradients"), "{err}");
    let mut f32_copy = b.zeros(DType::F32, Shape::new(vec![n]).unwrap()).unwrap();
    let err = opt
        .step(&b, &mut params, &grads, Some(&mut f32_copy))
        .unwrap_err()
        .to_string();
    assert!(err.contains("BF16 or F16"), "{err}");
    let bad = StepConfig {
        rule: Rule::Adam {
            beta1: 1.0,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            decoupled_weight_decay: true,
            amsgrad: false,
        },
        ..adamw()
    };
    assert!(Optimizer::new(&b, layout(), bad).is_err());
}
