//! kiln's optimizers on the CPU against PyTorch's single-tensor path
//! (tests/fixtures, made by scripts/optim/make_fixtures.py): 50 steps of every rule and
//! setting, with zero, denormal, huge, inf and NaN gradients.

mod common;

use kiln_cpu::CpuBackend;
use kiln_optim::{Rule, StepConfig};

fn cpu() -> CpuBackend {
    CpuBackend::new(Some(2)).unwrap()
}

#[test]
fn every_rule_is_bit_equal_to_pytorch() {
    common::check_all(&cpu(), 1e-5);
}

/// The comparison above can fail: beta1 one f32 ulp away from PyTorch's changes the
/// results.
#[test]
fn a_perturbed_hyperparameter_is_caught() {
    let f = common::load();
    let backend = cpu();
    let case = f.cases.iter().find(|c| c.name == "adam").unwrap();
    let mut config: StepConfig = case.config();
    if let Rule::Adam { beta1, .. } = &mut config.rule {
        *beta1 = f32::from_bits((*beta1 as f32).to_bits() + 1) as f64;
    }
    let out = common::run(&f, case, &backend, config);
    let diffs = common::differences(&out, None);
    assert!(!diffs.is_empty(), "a changed beta1 went unnoticed");
}

#[test]
fn schedules_match_pytorchs_schedulers() {
    let f = common::load();
    for s in &f.schedules {
        let schedule = s.schedule();
        for (k, &torch) in s.lrs.iter().enumerate() {
            let kiln = schedule.lr(k as f64);
            assert!(
                (kiln - torch).abs() <= 1e-12 * torch.abs(),
                "{schedule:?} at step {k}: kiln {kiln:e}, torch {torch:e}"
            );
        }
    }
}
