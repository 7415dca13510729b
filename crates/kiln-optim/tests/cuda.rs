//! kiln's optimizers on a CUDA GPU: the PyTorch fixtures (bit-equal, as on the CPU), the
//! CPU's results on large buffers of awkward length, and a step recorded as a CUDA graph.

mod common;

use common::{download, same, upload, values};
use kiln_core::Backend;
use kiln_cuda::CudaBackend;
use kiln_optim::{Optimizer, ParamLayout, Rule, Schedule, StepConfig};

fn gpu() -> CudaBackend {
    CudaBackend::new(0).expect("a CUDA device")
}

#[test]
#[ignore = "needs a CUDA device"]
fn every_rule_is_bit_equal_to_pytorch_on_cuda() {
    common::check_all(&gpu(), 1e-5);
}

/// Every rule, with and without clipping and loss scaling, on 3·2²⁰ + 5 elements: the
/// GPU's parameters, states and BF16 copy against the CPU's after 4 steps, bit-equal
/// (clipping divides by a norm the GPU sums in another order: within 1e-5).
#[test]
#[ignore = "needs a CUDA device"]
fn cuda_steps_equal_the_cpus_on_large_buffers() {
    common::steps_follow_the_cpus(&gpu(), 3 << 20, 0.0, 1e-5);
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
