//! The PyTorch fixtures (scripts/optim/make_fixtures.py) and a run of one case on any
//! backend, shared by the CPU and CUDA parity tests.
// Each test binary uses its own part of these helpers.
#![allow(dead_code)]

use kiln_core::{Backend, DType, HostBytes, Shape, Tensor};
use kiln_optim::{LossScaling, Optimizer, ParamLayout, Rule, Schedule, StepConfig};
use serde::Deserialize;
use serde_json::Value;
use std::collections::BTreeMap;

#[derive(Deserialize, Clone, Copy)]
pub struct Ref {
    offset: usize,
    len: usize,
}

#[derive(Deserialize)]
pub struct LayoutEntry {
    name: String,
    shape: Vec<usize>,
}

#[derive(Deserialize)]
pub struct Checkpoint {
    pub step: usize,
    params: Ref,
}

#[derive(Deserialize)]
pub struct Case {
    pub name: String,
    rule: Value,
    schedule: Value,
    max_grad_norm: Option<f32>,
    loss_scaling: Option<Value>,
    pub checkpoints: Vec<Checkpoint>,
    pub lrs: Vec<f64>,
    /// `None`: inf or NaN.
    pub norms: Vec<Option<f64>>,
    pub loss_scales: Vec<f64>,
    pub skipped: Vec<bool>,
    states: BTreeMap<String, Ref>,
    grads: Option<Ref>,
}

#[derive(Deserialize)]
pub struct ScheduleCase {
    schedule: Value,
    pub lrs: Vec<f64>,
}

#[derive(Deserialize)]
pub struct Fixtures {
    layout: Vec<LayoutEntry>,
    steps: usize,
    init: Ref,
    grads: Ref,
    pub cases: Vec<Case>,
    pub schedules: Vec<ScheduleCase>,
    #[serde(skip)]
    data: Vec<f32>,
}

pub fn load() -> Fixtures {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures");
    let json = std::fs::read_to_string(format!("{dir}/optim.json")).expect("optim.json");
    let mut f: Fixtures = serde_json::from_str(&json).expect("fixture index");
    let bin = std::fs::read(format!("{dir}/optim.bin")).expect("optim.bin");
    f.data = bin
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    f
}

fn num(v: &Value, key: &str) -> f64 {
    v[key].as_f64().unwrap_or_else(|| panic!("{key} in {v}"))
}

fn flag(v: &Value, key: &str) -> bool {
    v[key].as_bool().unwrap_or_else(|| panic!("{key} in {v}"))
}

fn steps(v: &Value, key: &str) -> u64 {
    v[key].as_u64().unwrap_or_else(|| panic!("{key} in {v}"))
}

pub fn rule(v: &Value) -> Rule {
    match v["kind"].as_str().expect("rule kind") {
        "sgd" => Rule::Sgd {
            momentum: num(v, "momentum"),
            dampening: num(v, "dampening"),
            nesterov: flag(v, "nesterov"),
            weight_decay: num(v, "weight_decay"),
        },
        "adam" => Rule::Adam {
            beta1: num(v, "beta1"),
            beta2: num(v, "beta2"),
            eps: num(v, "eps"),
            weight_decay: num(v, "weight_decay"),
            decoupled_weight_decay: flag(v, "decoupled_weight_decay"),
            amsgrad: flag(v, "amsgrad"),
        },
        "rmsprop" => Rule::RmsProp {
            alpha: num(v, "alpha"),
            eps: num(v, "eps"),
            weight_decay: num(v, "weight_decay"),
            momentum: num(v, "momentum"),
            centered: flag(v, "centered"),
        },
        "adagrad" => Rule::Adagrad {
            lr_decay: num(v, "lr_decay"),
            weight_decay: num(v, "weight_decay"),
            eps: num(v, "eps"),
            initial_accumulator_value: num(v, "initial_accumulator_value"),
        },
        k => panic!("rule {k}"),
    }
}

pub fn schedule(v: &Value) -> Schedule {
    match v["kind"].as_str().expect("schedule kind") {
        "constant" => Schedule::Constant { lr: num(v, "lr") },
        "linear_warmup" => Schedule::LinearWarmup {
            lr: num(v, "lr"),
            start_factor: num(v, "start_factor"),
            warmup: steps(v, "warmup"),
        },
        "cosine" => Schedule::Cosine {
            lr: num(v, "lr"),
            min_lr: num(v, "min_lr"),
            warmup: steps(v, "warmup"),
            total: steps(v, "total"),
        },
        "step" => Schedule::Step {
            lr: num(v, "lr"),
            step_size: steps(v, "step_size"),
            gamma: num(v, "gamma"),
        },
        "one_cycle" => Schedule::OneCycle {
            max_lr: num(v, "max_lr"),
            total: steps(v, "total"),
            pct_start: num(v, "pct_start"),
            div_factor: num(v, "div_factor"),
            final_div_factor: num(v, "final_div_factor"),
        },
        k => panic!("schedule {k}"),
    }
}

impl ScheduleCase {
    pub fn schedule(&self) -> Schedule {
        schedule(&self.schedule)
    }
}

impl Case {
    pub fn config(&self) -> StepConfig {
        StepConfig {
            rule: rule(&self.rule),
            schedule: schedule(&self.schedule),
            max_grad_norm: self.max_grad_norm,
            loss_scaling: self.loss_scaling.as_ref().map(|v| LossScaling {
                init_scale: num(v, "init_scale") as f32,
                growth_factor: num(v, "growth_factor") as f32,
                backoff_factor: num(v, "backoff_factor") as f32,
                growth_interval: steps(v, "growth_interval") as u32,
            }),
        }
    }

    /// Whether kiln's result is held to bit equality: clipping scales the gradients by a
    /// coefficient from their norm, which kiln sums in another order than PyTorch.
    pub fn exact(&self) -> bool {
        self.max_grad_norm.is_none()
    }
}

impl Fixtures {
    fn slice(&self, r: Ref) -> &[f32] {
        &self.data[r.offset..r.offset + r.len]
    }

    pub fn layout(&self) -> ParamLayout {
        ParamLayout::new(
            self.layout
                .iter()
                .map(|e| (e.name.clone(), e.shape.clone())),
        )
        .unwrap()
    }

    /// A fixture's array (tensors end to end, no gaps) as a flat buffer of `layout`.
    fn to_flat(&self, layout: &ParamLayout, packed: &[f32]) -> Vec<f32> {
        let mut parts = Vec::new();
        let mut at = 0;
        for e in layout.entries() {
            parts.push(&packed[at..at + e.len]);
            at += e.len;
        }
        assert_eq!(at, packed.len(), "fixture array length");
        layout.flatten(&parts).unwrap()
    }

    fn from_flat(layout: &ParamLayout, flat: &[f32]) -> Vec<f32> {
        layout.split(flat).unwrap().concat()
    }
}

/// What a run of a case on kiln gave, beside what PyTorch gave.
pub struct Outcome {
    /// (what, kiln, torch) for every array compared.
    pub arrays: Vec<(String, Vec<f32>, Vec<f32>)>,
    pub lrs: Vec<f64>,
    pub norms: Vec<f32>,
    pub loss_scales: Vec<f64>,
    pub skipped: Vec<bool>,
}

pub fn upload(backend: &dyn Backend, values: &[f32]) -> Tensor {
    backend
        .upload(
            DType::F32,
            Shape::new(vec![values.len()]).unwrap(),
            HostBytes::from_vec(bytemuck::cast_slice(values).to_vec()),
        )
        .unwrap()
}

pub fn download(backend: &dyn Backend, t: &Tensor) -> Vec<f32> {
    bytemuck::pod_collect_to_vec(&backend.download(t).unwrap())
}

/// Run `case` for all its steps on `backend` with `config` (the case's own, or a
/// perturbed one).
pub fn run(f: &Fixtures, case: &Case, backend: &dyn Backend, config: StepConfig) -> Outcome {
    let layout = f.layout();
    let n = layout.numel();
    let mut params = upload(backend, &f.to_flat(&layout, f.slice(f.init)));
    let mut grads = upload(backend, &vec![0.0; n]);
    let mut opt = Optimizer::new(backend, layout.clone(), config).unwrap();
    let all_grads = f.slice(case.grads.unwrap_or(f.grads));
    let per_step = all_grads.len() / f.steps;
    let mut out = Outcome {
        arrays: Vec::new(),
        lrs: Vec::new(),
        norms: Vec::new(),
        loss_scales: Vec::new(),
        skipped: Vec::new(),
    };
    let mut checkpoints = case.checkpoints.iter().peekable();
    for k in 0..f.steps {
        out.loss_scales
            .push(opt.loss_scale(backend).unwrap() as f64);
        let g = f.to_flat(&layout, &all_grads[k * per_step..(k + 1) * per_step]);
        backend.write(&mut grads, bytemuck::cast_slice(&g)).unwrap();
        opt.step(backend, &mut params, &grads, None).unwrap();
        let status = opt.status(backend).unwrap();
        out.lrs.push(status.lr);
        out.norms.push(status.grad_norm);
        out.skipped.push(status.skipped != 0);
        if let Some(c) = checkpoints.next_if(|c| c.step == k + 1) {
            let kiln = Fixtures::from_flat(&layout, &download(backend, &params));
            out.arrays.push((
                format!("params after step {}", c.step),
                kiln,
                f.slice(c.params).to_vec(),
            ));
        }
    }
    for (name, r) in &case.states {
        let t = opt.state(name).unwrap_or_else(|| panic!("state {name}"));
        let kiln = Fixtures::from_flat(&layout, &download(backend, t));
        out.arrays
            .push((format!("state {name}"), kiln, f.slice(*r).to_vec()));
    }
    out
}

/// Equal bits, or both NaN (NaN payloads are not compared: CUDA makes its own).
pub fn same(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

/// Equal within `rel` of the larger magnitude, or within `abs` (equal infinities, both
/// NaN).
pub fn close(a: f32, b: f32, rel: f32, abs: f32) -> bool {
    same(a, b)
        || (a.is_finite()
            && b.is_finite()
            && (a - b).abs() <= (rel * a.abs().max(b.abs())).max(abs))
}

/// Every difference between kiln's and PyTorch's arrays, as lines; empty when all agree
/// (bitwise when `rel` is `None`; else within `rel`, or `rel` of the array's largest
/// finite magnitude: a value near zero after cancellation keeps only an absolute error).
pub fn differences(out: &Outcome, rel: Option<f32>) -> Vec<String> {
    let mut lines = Vec::new();
    for (what, kiln, torch) in &out.arrays {
        assert_eq!(kiln.len(), torch.len(), "{what}: lengths");
        let scale = torch
            .iter()
            .filter(|v| v.is_finite())
            .fold(0.0f32, |m, v| m.max(v.abs()));
        let bad: Vec<usize> = (0..kiln.len())
            .filter(|&i| match rel {
                None => !same(kiln[i], torch[i]),
                Some(r) => !close(kiln[i], torch[i], r, r * scale),
            })
            .collect();
        if let Some(&i) = bad.first() {
            lines.push(format!(
                "{what}: {} of {} differ, first at {i}: kiln {:e} ({:#010x}), torch {:e} ({:#010x})",
                bad.len(),
                kiln.len(),
                kiln[i],
                kiln[i].to_bits(),
                torch[i],
                torch[i].to_bits()
            ));
        }
    }
    lines
}

/// Run every case on `backend` and check it against PyTorch: bit-equal parameters and
/// states, the same learning rates, loss scales and skipped steps; with clipping,
/// within `rel_clipped` and norms within 1e-6.
pub fn check_all(backend: &dyn Backend, rel_clipped: f32) {
    check_cases(backend, |case| (!case.exact()).then_some(rel_clipped), 1e-6);
}

/// [`check_all`] with parameters, states and norms within `rel` in every case (a backend
/// whose division and square root are not IEEE's to the bit).
pub fn check_all_within(backend: &dyn Backend, rel: f32) {
    check_cases(backend, |_| Some(rel), rel.max(1e-6));
}

fn check_cases(backend: &dyn Backend, rel: impl Fn(&Case) -> Option<f32>, rel_norm: f32) {
    let f = load();
    let mut failures = Vec::new();
    for case in &f.cases {
        let out = run(&f, case, backend, case.config());
        let mut lines = differences(&out, rel(case));
        for (k, (&kiln, &torch)) in out.lrs.iter().zip(&case.lrs).enumerate() {
            if out.skipped[k] {
                continue; // a skipped call leaves the last update's lr in place
            }
            // PyTorch's CosineAnnealingLR steps by a recurrence, kiln by the closed form.
            if (kiln - torch).abs() > 1e-13 * torch.abs() {
                lines.push(format!(
                    "lr of step {}: kiln {kiln:e}, torch {torch:e}",
                    k + 1
                ));
                break;
            }
        }
        for (k, (&kiln, &torch)) in out.norms.iter().zip(&case.norms).enumerate() {
            let agree = match torch {
                Some(torch) => close(kiln, torch as f32, rel_norm, 0.0),
                None => !kiln.is_finite(),
            };
            if !agree {
                lines.push(format!(
                    "norm of step {}: kiln {kiln:e}, torch {torch:?}",
                    k + 1
                ));
                break;
            }
        }
        if !case.loss_scales.is_empty() && out.loss_scales != case.loss_scales {
            lines.push(format!(
                "loss scales: kiln {:?}, torch {:?}",
                out.loss_scales, case.loss_scales
            ));
        }
        if !case.skipped.is_empty() && out.skipped != case.skipped {
            lines.push(format!(
                "skipped steps: kiln {:?}, torch {:?}",
                out.skipped, case.skipped
            ));
        }
        if !lines.is_empty() {
            failures.push(format!("{}:\n  {}", case.name, lines.join("\n  ")));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases differ from PyTorch:\n{}",
        failures.len(),
        f.cases.len(),
        failures.join("\n")
    );
}

pub fn values(n: usize, seed: u64) -> Vec<f32> {
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

/// Every rule, with and without clipping and loss scaling, on `big` + 5 elements: `gpu`'s
/// parameters, states and BF16 copy against the CPU's after 4 steps, within `rel` (with
/// clipping `rel_clipped`) or, when that is not 0, as much in absolute terms (values of
/// order 1 that cancel) and an ulp of the BF16 copy (a master weight at a rounding tie).
pub fn steps_follow_the_cpus(gpu: &dyn Backend, big: usize, rel: f32, rel_clipped: f32) {
    let cpu = kiln_cpu::CpuBackend::new(None).unwrap();
    let layout = ParamLayout::new([("a", vec![big]), ("b", vec![5])]).unwrap();
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
        for b in [gpu, &cpu as &dyn Backend] {
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
        let rel = if config.max_grad_norm.is_some() {
            rel_clipped
        } else {
            rel
        };
        for (i, (g, c)) in gpu_arrays.iter().zip(cpu_arrays).enumerate() {
            let copy = i + 1 == gpu_arrays.len();
            let rel = if copy && rel > 0.0 { 1.0 / 128.0 } else { rel };
            let ok = |g: f32, c: f32| close(g, c, rel, rel);
            let bad = g.iter().zip(c).filter(|(g, c)| !ok(**g, **c)).count();
            if bad > 0 {
                let first = g.iter().zip(c).position(|(g, c)| !ok(*g, *c)).unwrap();
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
