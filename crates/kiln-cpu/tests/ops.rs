//! Every CPU op against a plain float64 reference on fresh random inputs of awkward sizes.

use kiln_core::{
    quant, to_device, AttentionParams, Backend, DType, HostBytes, RopeLayout, Shape, Tensor,
};
use kiln_cpu::CpuBackend;
use rand::{rngs::StdRng, Rng, SeedableRng};

fn backend() -> CpuBackend {
    CpuBackend::new(Some(2)).unwrap()
}

fn random(n: usize, rng: &mut StdRng, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| rng.random_range(-1.0f32..1.0) * scale)
        .collect()
}

fn upload(b: &CpuBackend, dtype: DType, dims: &[usize], values: &[f32]) -> Tensor {
    let bytes = quant::quantize(dtype, values).unwrap();
    b.upload(
        dtype,
        Shape::new(dims.to_vec()).unwrap(),
        HostBytes::from_vec(bytes),
    )
    .unwrap()
}

fn read(b: &CpuBackend, t: &Tensor) -> Vec<f32> {
    let bytes = b.download(t).unwrap();
    quant::dequantize_to_vec(DType::F32, &bytes, t.shape().numel()).unwrap()
}

fn zeros(b: &CpuBackend, dims: &[usize]) -> Tensor {
    b.zeros(DType::F32, Shape::new(dims.to_vec()).unwrap())
        .unwrap()
}

/// An I32 `[n]` tensor of token ids or positions.
fn indices(b: &CpuBackend, values: &[i32]) -> Tensor {
    let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    b.upload(
        DType::I32,
        Shape::new(vec![values.len()]).unwrap(),
        HostBytes::from_vec(bytes),
    )
    .unwrap()
}

fn read_i32(b: &CpuBackend, t: &Tensor) -> Vec<i32> {
    b.download(t)
        .unwrap()
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// Fill an output with NaN first so that an element the op forgets to write shows.
fn poisoned(b: &CpuBackend, dims: &[usize]) -> Tensor {
    let n: usize = dims.iter().product();
    upload(b, DType::F32, dims, &vec![f32::NAN; n])
}

fn assert_close(got: &[f32], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g as f64 - w).abs() <= tol * (1.0 + w.abs()),
            "{what}: element {i}: got {g}, want {w}"
        );
    }
}

#[test]
fn matmul_every_dtype_against_f64() {
    let b = backend();
    let mut rng = StdRng::seed_from_u64(1);
    for dtype in DType::ALL {
        let bs = dtype.block_size().max(1);
        let ks: Vec<usize> = if bs == 1 {
            vec![1, 7, 33, 1000]
        } else {
            vec![bs, bs * 3, bs * 17]
        };
        for &k in &ks {
            for &(n, m) in &[(1usize, 1usize), (1, 37), (3, 17), (9, 70)] {
                let wv = random(m * k, &mut rng, 1.0);
                let xv = random(n * k, &mut rng, 2.0);
                let w = upload(&b, dtype, &[m, k], &wv);
                let x = upload(&b, DType::F32, &[n, k], &xv);
                let mut out = poisoned(&b, &[n, m]);
                b.matmul(&x, &w, &mut out).unwrap();
                let got = read(&b, &out);
                // Reference: the weights as stored (dequantized), the activations exact.
                let wd =
                    quant::dequantize_to_vec(dtype, &quant::quantize(dtype, &wv).unwrap(), m * k)
                        .unwrap();
                for i in 0..n {
                    for r in 0..m {
                        let (mut dot, mut mag) = (0f64, 0f64);
                        for j in 0..k {
                            let p = wd[r * k + j] as f64 * xv[i * k + j] as f64;
                            dot += p;
                            mag += p.abs();
                        }
                        // Quantized types also quantize the activations to 8 bits; F16/BF16
                        // prompts on AMX keep them to 16 bits (2^-15 per product, see
                        // `fgemm::amx`).
                        let tol = match dtype {
                            _ if dtype.is_quantized() => 1e-2,
                            DType::F16 | DType::BF16 if n > 1 => 2f64.powi(-15),
                            _ => 1e-5,
                        };
                        let g = got[i * m + r] as f64;
                        assert!(
                            (g - dot).abs() <= tol * mag + 1e-6,
                            "{dtype} n={n} m={m} k={k} [{i},{r}]: got {g}, want {dot} (Σ|wx| {mag})"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn matmul_rejects_shapes_that_do_not_fit() {
    let b = backend();
    let w = zeros(&b, &[4, 8]);
    let x = zeros(&b, &[2, 7]);
    let mut out = zeros(&b, &[2, 4]);
    assert!(b.matmul(&x, &w, &mut out).is_err());
    let x = zeros(&b, &[2, 8]);
    let mut out = zeros(&b, &[2, 5]);
    assert!(b.matmul(&x, &w, &mut out).is_err());
}

#[test]
fn norms_against_f64() {
    let b = backend();
    let mut rng = StdRng::seed_from_u64(2);
    for &(rows, dim) in &[(1usize, 1usize), (3, 7), (5, 33), (130, 257)] {
        let xv = random(rows * dim, &mut rng, 3.0);
        let wv = random(dim, &mut rng, 1.5);
        let bv = random(dim, &mut rng, 0.5);
        let x = upload(&b, DType::F32, &[rows, dim], &xv);
        let w = upload(&b, DType::F32, &[dim], &wv);
        let bias = upload(&b, DType::F32, &[dim], &bv);
        let eps = 1e-5;

        let mut out = poisoned(&b, &[rows, dim]);
        b.rms_norm(&x, &w, eps, &mut out).unwrap();
        let mut want = Vec::new();
        for r in xv.chunks(dim) {
            let ms = r.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / dim as f64;
            let s = 1.0 / (ms + eps as f64).sqrt();
            want.extend(r.iter().zip(&wv).map(|(&v, &w)| v as f64 * s * w as f64));
        }
        assert_close(&read(&b, &out), &want, 1e-5, "rms_norm");

        let mut out = poisoned(&b, &[rows, dim]);
        b.layer_norm(&x, &w, &bias, eps, &mut out).unwrap();
        let mut want = Vec::new();
        for r in xv.chunks(dim) {
            let mean = r.iter().map(|&v| v as f64).sum::<f64>() / dim as f64;
            let var = r.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / dim as f64;
            let s = 1.0 / (var + eps as f64).sqrt();
            want.extend(
                r.iter()
                    .zip(wv.iter().zip(&bv))
                    .map(|(&v, (&w, &bb))| (v as f64 - mean) * s * w as f64 + bb as f64),
            );
        }
        assert_close(&read(&b, &out), &want, 1e-5, "layer_norm");

        let mut s = upload(&b, DType::F32, &[rows, dim], &xv);
        b.softmax(&mut s).unwrap();
        let mut want = Vec::new();
        for r in xv.chunks(dim) {
            let max = r.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
            let e: Vec<f64> = r.iter().map(|&v| (v as f64 - max).exp()).collect();
            let sum: f64 = e.iter().sum();
            want.extend(e.iter().map(|v| v / sum));
        }
        assert_close(&read(&b, &s), &want, 1e-6, "softmax");
    }
    let mut masked = upload(&b, DType::F32, &[1, 3], &[f32::NEG_INFINITY; 3]);
    b.softmax(&mut masked).unwrap();
    assert_eq!(read(&b, &masked), vec![0.0; 3]);
}

#[test]
fn rope_both_layouts_against_f64() {
    let b = backend();
    let mut rng = StdRng::seed_from_u64(3);
    for layout in [RopeLayout::Interleaved, RopeLayout::Neox] {
        // (heads, head_dim, rotated dims, positions): positions need not be consecutive.
        let cases: [(usize, usize, usize, &[i32]); 4] = [
            (1, 2, 2, &[1234]),
            (3, 10, 10, &[1234, 1235, 1236, 1237, 1238]),
            (2, 16, 8, &[1234, 1235, 1236, 1237]),
            (3, 12, 8, &[5, 2, 9]),
        ];
        for (heads, head_dim, rot, positions) in cases {
            let tokens = positions.len();
            let xv = random(tokens * heads * head_dim, &mut rng, 2.0);
            let half = rot / 2;
            let freqs: Vec<f32> = (0..half)
                .map(|i| 10000f32.powf(-2.0 * i as f32 / rot as f32))
                .collect();
            let mut x = upload(&b, DType::F32, &[tokens, heads, head_dim], &xv);
            let f = upload(&b, DType::F32, &[half], &freqs);
            b.rope(&mut x, &indices(&b, positions), &f, layout).unwrap();
            let mut want: Vec<f64> = xv.iter().map(|&v| v as f64).collect();
            for (t, &pos) in positions.iter().enumerate() {
                for h in 0..heads {
                    let base = (t * heads + h) * head_dim;
                    for (i, &f) in freqs.iter().enumerate() {
                        let theta = pos as f64 * f as f64;
                        let (a, c) = match layout {
                            RopeLayout::Interleaved => (2 * i, 2 * i + 1),
                            RopeLayout::Neox => (i, i + half),
                        };
                        let (x0, x1) = (xv[base + a] as f64, xv[base + c] as f64);
                        want[base + a] = x0 * theta.cos() - x1 * theta.sin();
                        want[base + c] = x0 * theta.sin() + x1 * theta.cos();
                    }
                }
            }
            // Angles at position ~1e3 carry f32 rounding of the product, as in transformers.
            assert_close(
                &read(&b, &x),
                &want,
                2e-3,
                &format!("rope {layout:?} at {positions:?}"),
            );
        }
    }
    // Positions must be i32, one per token, and not negative.
    let f = upload(&b, DType::F32, &[1], &[1.0]);
    let mut x = zeros(&b, &[2, 1, 2]);
    let layout = RopeLayout::Neox;
    assert!(b.rope(&mut x, &indices(&b, &[0, -1]), &f, layout).is_err());
    assert!(b.rope(&mut x, &indices(&b, &[0]), &f, layout).is_err());
    assert!(b.rope(&mut x, &zeros(&b, &[2]), &f, layout).is_err());
}

#[test]
fn elementwise_against_f64() {
    let b = backend();
    let mut rng = StdRng::seed_from_u64(4);
    let (rows, dim) = (3, 37);
    let gv = random(rows * dim, &mut rng, 6.0);
    let uv = random(rows * dim, &mut rng, 2.0);
    let g = upload(&b, DType::F32, &[rows, dim], &gv);
    let u = upload(&b, DType::F32, &[rows, dim], &uv);

    let mut out = poisoned(&b, &[rows, dim]);
    b.silu_mul(&g, &u, &mut out).unwrap();
    let want: Vec<f64> = gv
        .iter()
        .zip(&uv)
        .map(|(&g, &u)| g as f64 / (1.0 + (-(g as f64)).exp()) * u as f64)
        .collect();
    assert_close(&read(&b, &out), &want, 1e-5, "silu_mul");

    let gelu = |x: f64| {
        0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh())
    };
    let mut out = poisoned(&b, &[rows, dim]);
    b.gelu_mul(&g, &u, &mut out).unwrap();
    let want: Vec<f64> = gv
        .iter()
        .zip(&uv)
        .map(|(&g, &u)| gelu(g as f64) * u as f64)
        .collect();
    assert_close(&read(&b, &out), &want, 1e-5, "gelu_mul");

    let mut x = upload(&b, DType::F32, &[rows, dim], &gv);
    b.gelu(&mut x).unwrap();
    let want: Vec<f64> = gv.iter().map(|&g| gelu(g as f64)).collect();
    assert_close(&read(&b, &x), &want, 1e-5, "gelu");

    let mut acc = upload(&b, DType::F32, &[rows, dim], &gv);
    b.add_assign(&mut acc, &u).unwrap();
    let want: Vec<f64> = gv
        .iter()
        .zip(&uv)
        .map(|(&a, &b)| a as f64 + b as f64)
        .collect();
    assert_close(&read(&b, &acc), &want, 1e-6, "add_assign");

    let row = upload(&b, DType::F32, &[dim], &uv[..dim]);
    let mut acc = upload(&b, DType::F32, &[rows, dim], &gv);
    b.mul_assign(&mut acc, &row).unwrap();
    let want: Vec<f64> = gv
        .iter()
        .enumerate()
        .map(|(i, &a)| a as f64 * uv[i % dim] as f64)
        .collect();
    assert_close(&read(&b, &acc), &want, 1e-6, "mul_assign broadcast");

    b.scale(&mut acc, -0.5).unwrap();
    let want: Vec<f64> = want.iter().map(|v| v * -0.5).collect();
    assert_close(&read(&b, &acc), &want, 1e-6, "scale");

    let wrong = zeros(&b, &[rows, dim + 1]);
    assert!(b.add_assign(&mut acc, &wrong).is_err());
}

#[test]
fn embedding_dequantizes_rows_and_checks_ids() {
    let b = backend();
    let mut rng = StdRng::seed_from_u64(5);
    let (vocab, dim) = (11, 256);
    for dtype in DType::ALL {
        let tv = random(vocab * dim, &mut rng, 1.0);
        let table = upload(&b, dtype, &[vocab, dim], &tv);
        let ids = [3, 0, 10, 3];
        let mut out = poisoned(&b, &[ids.len(), dim]);
        b.embedding(&table, &indices(&b, &ids), &mut out).unwrap();
        let stored =
            quant::dequantize_to_vec(dtype, &quant::quantize(dtype, &tv).unwrap(), vocab * dim)
                .unwrap();
        let want: Vec<f64> = ids
            .iter()
            .flat_map(|&id| stored[id as usize * dim..][..dim].iter().map(|&v| v as f64))
            .collect();
        assert_close(&read(&b, &out), &want, 0.0, "embedding");
        for bad in [11, -1] {
            let err = b
                .embedding(&table, &indices(&b, &[0, bad]), &mut zeros(&b, &[2, dim]))
                .unwrap_err();
            assert!(
                err.to_string().contains(&format!("token id {bad}")),
                "{err}"
            );
        }
        // One id per output row.
        assert!(b
            .embedding(&table, &indices(&b, &[0]), &mut zeros(&b, &[2, dim]))
            .is_err());
    }
}

#[test]
fn upload_checks_sizes_and_writes_copy_shared_data() {
    let b = backend();
    let bad = b.upload(
        DType::Q8_0,
        Shape::new(vec![2, 32]).unwrap(),
        HostBytes::from_vec(vec![0; 67]),
    );
    assert!(bad.is_err());
    let source = HostBytes::from_vec(quant::quantize(DType::F32, &[1.0, 2.0]).unwrap());
    let mut t = b
        .upload(DType::F32, Shape::new(vec![2]).unwrap(), source.clone())
        .unwrap();
    b.scale(&mut t, 2.0).unwrap();
    assert_eq!(read(&b, &t), vec![2.0, 4.0]);
    assert_eq!(
        source.as_slice(),
        quant::quantize(DType::F32, &[1.0, 2.0]).unwrap()
    );
}

#[test]
fn buffers_are_created_filled_copied_between_devices_and_read_back() {
    let (a, b) = (backend(), CpuBackend::new(Some(1)).unwrap());
    let mut t = zeros(&a, &[3, 5]);
    assert_eq!(read(&a, &t), vec![0.0; 15]);
    a.fill(&mut t, 2.5).unwrap();
    let copy = to_device(&t, &a, &b).unwrap();
    assert_eq!((copy.dtype(), copy.dims()), (DType::F32, &[3usize, 5][..]));
    assert_eq!(read(&b, &copy), vec![2.5; 15]);
    // Quantized data crosses byte for byte.
    let mut rng = StdRng::seed_from_u64(6);
    let q = upload(&a, DType::Q4_K, &[2, 256], &random(512, &mut rng, 1.0));
    let q2 = to_device(&q, &a, &b).unwrap();
    assert_eq!(a.download(&q).unwrap(), b.download(&q2).unwrap());
    // Filling a quantized tensor is refused, not silently wrong.
    let mut q = q;
    assert!(a.fill(&mut q, 1.0).is_err());
}

#[test]
fn attention_against_f64() {
    let b = backend();
    let mut rng = StdRng::seed_from_u64(7);
    let (heads, kv_heads, hd, capacity) = (6, 2, 5, 40);
    let consecutive = |pos0: i32, n: i32| (pos0..pos0 + n).collect::<Vec<i32>>();
    let cases = [
        (consecutive(0, 7), None, None),
        (consecutive(9, 1), None, Some(30.0f32)),
        (consecutive(3, 11), Some(4usize), None),
        (consecutive(20, 3), Some(6), Some(5.0)),
        // Queries need not be in order: each sees the rows up to its own position.
        (vec![5, 2, 9], None, None),
        (vec![5, 2, 9], Some(3), Some(5.0)),
        (vec![39], Some(6), None),
    ];
    for (positions, window, softcap) in cases {
        let n = positions.len();
        let kv = random(capacity * kv_heads * hd, &mut rng, 1.5);
        let vv = random(capacity * kv_heads * hd, &mut rng, 1.0);
        let qv = random(n * heads * hd, &mut rng, 1.5);
        let k = upload(&b, DType::F32, &[capacity, kv_heads, hd], &kv);
        let v = upload(&b, DType::F32, &[capacity, kv_heads, hd], &vv);
        let q = upload(&b, DType::F32, &[n, heads, hd], &qv);
        let mut out = poisoned(&b, &[n, heads, hd]);
        let params = AttentionParams {
            scale: 0.37,
            softcap,
            window,
        };
        let pos = indices(&b, &positions);
        b.attention(&q, &k, &v, &pos, &params, &mut out).unwrap();
        let mut want = vec![0f64; n * heads * hd];
        for (i, &pos) in positions.iter().enumerate() {
            let pos = pos as usize;
            for h in 0..heads {
                let g = h / (heads / kv_heads);
                let first = window.map_or(0, |w| (pos + 1).saturating_sub(w));
                let scores: Vec<f64> = (first..=pos)
                    .map(|j| {
                        let mut s = 0f64;
                        for d in 0..hd {
                            s += qv[(i * heads + h) * hd + d] as f64
                                * kv[(j * kv_heads + g) * hd + d] as f64;
                        }
                        s *= 0.37;
                        softcap.map_or(s, |c| c as f64 * (s / c as f64).tanh())
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let sum: f64 = e.iter().sum();
                for (w, j) in e.iter().zip(first..=pos) {
                    for d in 0..hd {
                        want[(i * heads + h) * hd + d] +=
                            w / sum * vv[(j * kv_heads + g) * hd + d] as f64;
                    }
                }
            }
        }
        assert_close(
            &read(&b, &out),
            &want,
            1e-5,
            &format!("attention at {positions:?}"),
        );
    }
    // A position past the cache's capacity is an error, not an out-of-bounds read; so are
    // negative positions and a count that does not match the queries.
    let q = zeros(&b, &[2, heads, hd]);
    let k = zeros(&b, &[4, kv_heads, hd]);
    let mut out = zeros(&b, &[2, heads, hd]);
    let p = AttentionParams {
        scale: 1.0,
        softcap: None,
        window: None,
    };
    assert!(b
        .attention(&q, &k, &k, &indices(&b, &[0, 3]), &p, &mut out)
        .is_ok());
    for bad in [&[3, 4][..], &[-1, 0], &[0]] {
        let err = b.attention(&q, &k, &k, &indices(&b, bad), &p, &mut out);
        assert!(err.is_err(), "positions {bad:?}");
    }
}

#[test]
fn rows_columns_and_softcap() {
    let b = backend();
    let mut rng = StdRng::seed_from_u64(8);
    let sv = random(3 * 10, &mut rng, 4.0);
    let src = upload(&b, DType::F32, &[3, 10], &sv);
    let mut dst = poisoned(&b, &[3, 4]);
    b.slice_cols(&src, 5, &mut dst).unwrap();
    let want: Vec<f64> = (0..3)
        .flat_map(|r| sv[r * 10 + 5..r * 10 + 9].iter().map(|&v| v as f64))
        .collect();
    assert_close(&read(&b, &dst), &want, 0.0, "slice_cols");
    assert!(b.slice_cols(&src, 7, &mut dst).is_err());

    let mut cache = zeros(&b, &[6, 2, 5]);
    let rows = upload(&b, DType::F32, &[2, 2, 5], &sv[..20]);
    b.write_rows(&rows, &mut cache, &indices(&b, &[3, 4]))
        .unwrap();
    let got = read(&b, &cache);
    assert_eq!(&got[30..50], &sv[..20]);
    assert!(got[..30].iter().chain(&got[50..]).all(|&v| v == 0.0));
    for bad in [&[5, 6][..], &[-1, 0], &[3]] {
        assert!(
            b.write_rows(&rows, &mut cache, &indices(&b, bad)).is_err(),
            "positions {bad:?}"
        );
    }
    // Rows go where their positions say, in any order.
    let mut cache = zeros(&b, &[10, 2, 5]);
    let rows = upload(&b, DType::F32, &[3, 2, 5], &sv);
    b.write_rows(&rows, &mut cache, &indices(&b, &[5, 2, 9]))
        .unwrap();
    let got = read(&b, &cache);
    let mut want = vec![0f64; 100];
    for (i, p) in [5, 2, 9].into_iter().enumerate() {
        for (w, &v) in want[p * 10..][..10].iter_mut().zip(&sv[i * 10..][..10]) {
            *w = v as f64;
        }
    }
    assert_close(&got, &want, 0.0, "write_rows at [5, 2, 9]");

    let mut x = upload(&b, DType::F32, &[3, 10], &sv);
    b.softcap(&mut x, 3.0).unwrap();
    let want: Vec<f64> = sv.iter().map(|&v| 3.0 * (v as f64 / 3.0).tanh()).collect();
    assert_close(&read(&b, &x), &want, 1e-6, "softcap");
}

#[test]
fn argmax_takes_the_first_maximum_of_each_row() {
    let b = backend();
    let mut rng = StdRng::seed_from_u64(9);
    for &(rows, cols) in &[(1usize, 1usize), (1, 32000), (4, 37)] {
        let xv = random(rows * cols, &mut rng, 10.0);
        let x = upload(&b, DType::F32, &[rows, cols], &xv);
        let mut out = b
            .zeros(DType::I32, Shape::new(vec![rows]).unwrap())
            .unwrap();
        b.argmax(&x, &mut out).unwrap();
        let want: Vec<i32> = xv
            .chunks(cols)
            .map(|r| {
                let max = r.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                r.iter().position(|&v| v == max).unwrap() as i32
            })
            .collect();
        assert_eq!(read_i32(&b, &out), want, "argmax [{rows}, {cols}]");
    }
    let x = upload(
        &b,
        DType::F32,
        &[3, 4],
        &[
            1.0, 3.0, 3.0, 0.0, -2.0, -2.0, -2.0, -2.0, 0.0, 0.0, 0.0, 5.0,
        ],
    );
    let mut out = indices(&b, &[-1, -1, -1]);
    b.argmax(&x, &mut out).unwrap();
    assert_eq!(read_i32(&b, &out), vec![1, 0, 3]);
    // One output per row, of i32.
    assert!(b.argmax(&x, &mut indices(&b, &[0, 0])).is_err());
    assert!(b.argmax(&x, &mut zeros(&b, &[3])).is_err());
}

#[test]
fn write_overwrites_whole_tensors_of_any_dtype() {
    let b = backend();
    let mut ids = b.zeros(DType::I32, Shape::new(vec![3]).unwrap()).unwrap();
    assert_eq!(read_i32(&b, &ids), vec![0, 0, 0]);
    let bytes: Vec<u8> = [7i32, -2, 1 << 30]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    b.write(&mut ids, &bytes).unwrap();
    assert_eq!(read_i32(&b, &ids), vec![7, -2, 1 << 30]);
    assert!(b.write(&mut ids, &bytes[..8]).is_err());
    assert!(b.write(&mut ids, &[0; 16]).is_err());
    assert_eq!(read_i32(&b, &ids), vec![7, -2, 1 << 30]);

    // An uploaded tensor that uses host bytes in place: writing it leaves them alone.
    let source = HostBytes::from_vec(quant::quantize(DType::F32, &[1.0, 2.0]).unwrap());
    let mut t = b
        .upload(DType::F32, Shape::new(vec![2]).unwrap(), source.clone())
        .unwrap();
    b.write(&mut t, &quant::quantize(DType::F32, &[3.0, -4.0]).unwrap())
        .unwrap();
    assert_eq!(read(&b, &t), vec![3.0, -4.0]);
    assert_eq!(
        source.as_slice(),
        quant::quantize(DType::F32, &[1.0, 2.0]).unwrap()
    );
}
