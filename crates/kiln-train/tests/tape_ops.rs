//! The tape's ops that no model uses today (softmax, `mul_assign`, a row added to every
//! row, `scale` and `gelu` in place), chained on one buffer written in place, and their
//! gradients against central differences along a direction per parameter.

use kiln_core::{quant, Backend, DType, HostBytes, Shape, Tensor};
use kiln_cpu::CpuBackend;
use kiln_train::rng::Rng;
use kiln_train::Tape;
use std::sync::Arc;

fn upload(b: &dyn Backend, dims: &[usize], values: &[f32]) -> Tensor {
    let bytes = quant::quantize(DType::F32, values).unwrap();
    b.upload(
        DType::F32,
        Shape::new(dims.to_vec()).unwrap(),
        HostBytes::from_vec(bytes),
    )
    .unwrap()
}

fn read(b: &dyn Backend, t: &Tensor) -> Vec<f32> {
    quant::dequantize_to_vec(DType::F32, &b.download(t).unwrap(), t.shape().numel()).unwrap()
}

/// `L = Σ CE(gelu(0.7 · softmax((A + b) ⊙ c ⊙ D)) · Wᵀ)`, with `b`, `c` rows broadcast.
fn loss(tape: &Tape, p: &[Tensor], record: bool) -> f64 {
    if record {
        tape.begin();
    } else {
        tape.stop();
    }
    let mut t = tape
        .zeros(DType::F32, Shape::new(vec![4, 6]).unwrap())
        .unwrap();
    tape.add_assign(&mut t, &p[0]).unwrap();
    tape.add_assign(&mut t, &p[1]).unwrap();
    tape.mul_assign(&mut t, &p[2]).unwrap();
    tape.mul_assign(&mut t, &p[3]).unwrap();
    tape.softmax(&mut t).unwrap();
    tape.scale(&mut t, 0.7).unwrap();
    tape.gelu(&mut t).unwrap();
    let losses = tape
        .cross_entropy(&t, &p[4], &[1, 4, 0, 2], None, 1.0)
        .unwrap();
    if record {
        tape.backward(&p.iter().collect::<Vec<_>>()).unwrap();
    }
    losses.iter().map(|&l| l as f64).sum()
}

#[test]
fn in_place_chain_gradients_match_differences() {
    let cpu: Arc<dyn Backend> = Arc::new(CpuBackend::new(Some(1)).unwrap());
    let tape = Tape::new(cpu.clone()).unwrap();
    let mut rng = Rng::new(9);
    let dims: [&[usize]; 5] = [&[4, 6], &[6], &[6], &[4, 6], &[5, 6]];
    let params: Vec<Tensor> = dims
        .iter()
        .map(|d| {
            let n: usize = d.iter().product();
            let v: Vec<f32> = (0..n).map(|_| 2.0 * rng.normal() as f32).collect();
            upload(cpu.as_ref(), d, &v)
        })
        .collect();
    tape.set_parameters(&params.iter().collect::<Vec<_>>(), &[true; 5])
        .unwrap();
    loss(&tape, &params, true);
    let total: usize = params.iter().map(|p| p.shape().numel()).sum();
    let mut grads = vec![0f32; total];
    tape.read_grads(&mut grads).unwrap();
    let mut at = 0;
    let mut params = params;
    for i in 0..params.len() {
        let n = params[i].shape().numel();
        let g = grads[at..at + n].to_vec();
        at += n;
        let theta = read(cpu.as_ref(), &params[i]);
        let gnorm = g.iter().map(|&v| (v as f64).powi(2)).sum::<f64>().sqrt();
        assert!(gnorm > 1e-3, "parameter {i}: no gradient reached it");
        let dir: Vec<f64> = g.iter().map(|&v| v as f64 / gnorm).collect();
        let eps = (2e-3 / gnorm).min(1e-2);
        let mut at_eps = |sign: f64| {
            let v: Vec<f32> = theta
                .iter()
                .zip(&dir)
                .map(|(&t, d)| (t as f64 + sign * eps * d) as f32)
                .collect();
            cpu.write(&mut params[i], &quant::quantize(DType::F32, &v).unwrap())
                .unwrap();
            loss(&tape, &params, false)
        };
        let fd = (at_eps(1.0) - at_eps(-1.0)) / (2.0 * eps);
        cpu.write(
            &mut params[i],
            &quant::quantize(DType::F32, &theta).unwrap(),
        )
        .unwrap();
        assert!(
            (gnorm - fd).abs() <= 2e-3 * fd.abs() + 1e-5,
            "parameter {i}: gradient norm {gnorm:e}, differences along it {fd:e}"
        );
    }
}
