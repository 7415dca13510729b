//! Every op on the wgpu device against the CPU backend on the same random inputs.

use kiln_core::{quant, AttentionParams, Backend, DType, HostBytes, RopeLayout, Shape, Tensor};
use kiln_cpu::CpuBackend;
use kiln_wgpu::WgpuBackend;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn backends() -> (WgpuBackend, CpuBackend) {
    (
        WgpuBackend::new(0).expect("a wgpu adapter (lavapipe in CI)"),
        CpuBackend::new(Some(2)).unwrap(),
    )
}

fn random(n: usize, rng: &mut StdRng, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-scale..scale)).collect()
}

fn upload(b: &dyn Backend, dtype: DType, dims: &[usize], values: &[f32]) -> Tensor {
    let bytes = quant::quantize(dtype, values).unwrap();
    b.upload(dtype, Shape::new(dims.to_vec()).unwrap(), HostBytes::from_vec(bytes))
        .unwrap()
}

fn ints(b: &dyn Backend, v: &[i32]) -> Tensor {
    let bytes = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    b.upload(DType::I32, Shape::new(vec![v.len()]).unwrap(), HostBytes::from_vec(bytes))
        .unwrap()
}

fn read(b: &dyn Backend, t: &Tensor) -> Vec<f32> {
    b.download(t)
        .unwrap()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn close(got: &[f32], want: &[f32], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tol * (1.0 + w.abs()), "{what} [{i}]: wgpu {g}, cpu {w}");
    }
}

#[test]
fn matmul_and_embedding_every_dtype() {
    let (g, c) = backends();
    let mut rng = StdRng::seed_from_u64(7);
    for dtype in DType::ALL {
        let bs = dtype.block_size();
        let k = if bs == 1 { 37 } else { bs * 3 };
        for &(n, m) in &[(1usize, 45usize), (3, 17), (70, 33)] {
            let wv = random(m * k, &mut rng, 1.0);
            let xv = random(n * k, &mut rng, 1.0);
            let mut outs = Vec::new();
            for b in [&g as &dyn Backend, &c] {
                let w = upload(b, dtype, &[m, k], &wv);
                let x = upload(b, DType::F32, &[n, k], &xv);
                let mut o = b.zeros(DType::F32, Shape::new(vec![n, m]).unwrap()).unwrap();
                b.matmul(&x, &w, &mut o).unwrap();
                let ids = ints(b, &[0, (m - 1) as i32, 5, 2, 16]);
                let mut e = b.zeros(DType::F32, Shape::new(vec![5, k]).unwrap()).unwrap();
                b.embedding(&w, &ids, &mut e).unwrap();
                outs.push((read(b, &o), read(b, &e)));
            }
            // wgpu keeps activations in f32: against the stored weights in f64, within f32
            // rounding of the sum (the CPU rounds activations to int8 for quantized types).
            let wd = quant::dequantize_to_vec(dtype, &quant::quantize(dtype, &wv).unwrap(), m * k)
                .unwrap();
            for t in 0..n {
                for r in 0..m {
                    let (mut dot, mut mag) = (0f64, 0f64);
                    for j in 0..k {
                        let p = wd[r * k + j] as f64 * xv[t * k + j] as f64;
                        dot += p;
                        mag += p.abs();
                    }
                    let got = outs[0].0[t * m + r] as f64;
                    assert!(
                        (got - dot).abs() <= 1e-5 * mag + 1e-6,
                        "matmul {dtype} n={n} m={m} [{t},{r}]: wgpu {got}, f64 {dot}"
                    );
                }
            }
            close(&outs[0].1, &outs[1].1, 1e-6, &format!("embedding {dtype}"));
            let back = g.download(&upload(&g, dtype, &[m, k], &wv)).unwrap();
            assert_eq!(back, quant::quantize(dtype, &wv).unwrap(), "{dtype} round trip");
        }
    }
}

#[test]
fn norms_elementwise_rope_attention() {
    let (g, c) = backends();
    let mut rng = StdRng::seed_from_u64(9);
    let (rows, cols) = (5, 301);
    let xv = random(rows * cols, &mut rng, 2.0);
    let yv = random(rows * cols, &mut rng, 2.0);
    let wv = random(cols, &mut rng, 1.0);
    let (n, heads, kvh, hd, cap) = (3usize, 4usize, 2usize, 64usize, 40usize);
    let qv = random(n * heads * hd, &mut rng, 1.0);
    let kv = random(cap * kvh * hd, &mut rng, 1.0);
    let vv = random(cap * kvh * hd, &mut rng, 1.0);
    let freqs: Vec<f32> = (0..24).map(|i| 10000f32.powf(-(i as f32) / 24.0)).collect();
    let mut results: Vec<Vec<Vec<f32>>> = Vec::new();
    for b in [&g as &dyn Backend, &c] {
        let mut r = Vec::new();
        let x = upload(b, DType::F32, &[rows, cols], &xv);
        let y = upload(b, DType::F32, &[rows, cols], &yv);
        let w = upload(b, DType::F32, &[cols], &wv);
        let mut o = b.zeros(DType::F32, Shape::new(vec![rows, cols]).unwrap()).unwrap();
        b.rms_norm(&x, &w, 1e-5, &mut o).unwrap();
        r.push(read(b, &o));
        b.layer_norm(&x, &w, &w, 1e-5, &mut o).unwrap();
        r.push(read(b, &o));
        let mut s = upload(b, DType::F32, &[rows, cols], &xv);
        b.softmax(&mut s).unwrap();
        r.push(read(b, &s));
        b.add_assign(&mut s, &y).unwrap();
        b.mul_assign(&mut s, &w).unwrap();
        b.scale(&mut s, 0.7).unwrap();
        r.push(read(b, &s));
        b.silu_mul(&x, &y, &mut o).unwrap();
        r.push(read(b, &o));
        b.gelu_mul(&x, &y, &mut o).unwrap();
        b.gelu(&mut o).unwrap();
        b.softcap(&mut o, 1.5).unwrap();
        r.push(read(b, &o));
        let mut sl = b.zeros(DType::F32, Shape::new(vec![rows, 17]).unwrap()).unwrap();
        b.slice_cols(&x, 100, &mut sl).unwrap();
        r.push(read(b, &sl));
        let mut am = b.zeros(DType::I32, Shape::new(vec![rows]).unwrap()).unwrap();
        b.argmax(&x, &mut am).unwrap();
        r.push(b.download(&am).unwrap().chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().unwrap()) as f32).collect());
        for layout in [RopeLayout::Interleaved, RopeLayout::Neox] {
            let mut q = upload(b, DType::F32, &[n, heads, hd], &qv);
            let pos = ints(b, &[3, 17, 3000]);
            let f = upload(b, DType::F32, &[24], &freqs);
            b.rope(&mut q, &pos, &f, layout).unwrap();
            r.push(read(b, &q));
        }
        let q = upload(b, DType::F32, &[n, heads, hd], &qv);
        let mut kc = b.zeros(DType::F32, Shape::new(vec![cap, kvh, hd]).unwrap()).unwrap();
        let mut vc = b.zeros(DType::F32, Shape::new(vec![cap, kvh, hd]).unwrap()).unwrap();
        let ks = upload(b, DType::F32, &[cap, kvh, hd], &kv);
        let vs = upload(b, DType::F32, &[cap, kvh, hd], &vv);
        let all: Vec<i32> = (0..cap as i32).collect();
        let allp = ints(b, &all);
        b.write_rows(&ks, &mut kc, &allp).unwrap();
        b.write_rows(&vs, &mut vc, &allp).unwrap();
        let pos = ints(b, &[0, 20, 39]);
        for params in [
            AttentionParams { scale: 0.125, softcap: None, window: None },
            AttentionParams { scale: 0.125, softcap: Some(5.0), window: Some(7) },
        ] {
            let mut out = b.zeros(DType::F32, Shape::new(vec![n, heads, hd]).unwrap()).unwrap();
            b.attention(&q, &kc, &vc, &pos, &params, &mut out).unwrap();
            r.push(read(b, &out));
        }
        results.push(r);
    }
    let names = ["rms", "layer", "softmax", "binary", "silu", "gelu/softcap", "slice", "argmax", "rope-i", "rope-n", "attn", "attn-window"];
    for (i, name) in names.iter().enumerate() {
        close(&results[0][i], &results[1][i], 2e-5, name);
    }
}
