//! Every op on the wgpu device against the CPU backend on the same random inputs.

use kiln_core::{quant, AttentionParams, Backend, DType, HostBytes, RopeLayout, Shape, Tensor};
use kiln_cpu::CpuBackend;
use kiln_wgpu::{Options, WgpuBackend};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The first adapter with all it has (subgroups, f16, cooperative matrices where it has
/// them) and on the portable paths (workgroup-memory reductions, f32 arithmetic, the
/// tiled GEMM); none when this machine has no adapter and `KILN_REQUIRE_WGPU=1` is not
/// set.
fn devices() -> Vec<WgpuBackend> {
    if !kiln_wgpu::adapter_for_tests() {
        return Vec::new();
    }
    [true, false]
        .into_iter()
        .map(|all| {
            let options = Options {
                subgroups: all,
                f16: all,
                cooperative_matrices: all,
            };
            WgpuBackend::with_options(0, options).unwrap()
        })
        .collect()
}

fn random(n: usize, rng: &mut StdRng, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-scale..scale)).collect()
}

fn upload(b: &dyn Backend, dtype: DType, dims: &[usize], values: &[f32]) -> Tensor {
    let bytes = quant::quantize(dtype, values).unwrap();
    b.upload(
        dtype,
        Shape::new(dims.to_vec()).unwrap(),
        HostBytes::from_vec(bytes),
    )
    .unwrap()
}

fn ints(b: &dyn Backend, v: &[i32]) -> Tensor {
    let bytes = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    b.upload(
        DType::I32,
        Shape::new(vec![v.len()]).unwrap(),
        HostBytes::from_vec(bytes),
    )
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
        assert!(
            (g - w).abs() <= tol * (1.0 + w.abs()),
            "{what} [{i}]: wgpu {g}, cpu {w}"
        );
    }
}

/// What one row of x meets a weight in on the device (decode's products).
#[derive(Clone, Copy, PartialEq)]
enum Rounding {
    /// f32: several rows of x, or a weight without a narrower path.
    None,
    /// int8 per 32 values: quantized weights.
    Int8,
    /// f16, 8-product sums in f16: F16 weights where the device has f16 arithmetic.
    F16,
    /// x and the weights rounded to f16, products summed in f32: prompts on cooperative
    /// matrices (tensor cores).
    BothF16,
}

/// How one row of x (`n` rows) by a `dtype` weight of rows of `k` is rounded on `g`.
fn rounding(g: &WgpuBackend, dtype: DType, n: usize, k: usize) -> Rounding {
    match dtype {
        _ if n > 8 && g.uses_cooperative_matrices() => Rounding::BothF16,
        _ if n != 1 => Rounding::None,
        DType::F16 if g.uses_f16() && k.is_multiple_of(8) => Rounding::F16,
        d if d.block_size() > 1 => Rounding::Int8,
        _ => Rounding::None,
    }
}

/// `w · x` in f64 and the error a correct kernel may make. For int8, x is first rounded per
/// 32 values as the kernel does (scale amax/127, round half to even) and the product taken
/// with those values; the slack allows f32 rounding of the sum and three values rounded
/// the other way (the shader's 1/scale may be off by an ulp), far below one 32-value
/// block's share of the sum. For f16, x rounded to f16 and each 8-product sum in f16: at
/// most ~3 f16 ulps (2^-11) of that item's magnitude. For both in f16, the products are
/// exact in f32 and the tensor cores' f32 sums may round a little coarser than IEEE
/// (1e-4 of the magnitude).
fn reference_dot(w: &[f32], x: &[f32], rounding: Rounding) -> (f64, f64) {
    let (mut dot, mut mag, mut flip) = (0f64, 0f64, 0f64);
    for (j, (&wj, &xj)) in w.iter().zip(x).enumerate() {
        let xv = match rounding {
            Rounding::Int8 => {
                let unit = &x[j / 32 * 32..][..32];
                let d = unit.iter().fold(0f32, |a, v| a.max(v.abs())) / 127.0;
                let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
                flip = flip.max((wj as f64 * d as f64).abs());
                (xj * inv).round_ties_even() as f64 * d as f64
            }
            Rounding::F16 | Rounding::BothF16 => half::f16::from_f32(xj).to_f64(),
            Rounding::None => xj as f64,
        };
        let wv = match rounding {
            Rounding::BothF16 => half::f16::from_f32(wj).to_f64(),
            _ => wj as f64,
        };
        let p = wv * xv;
        dot += p;
        mag += p.abs();
    }
    let f16_sums = if rounding == Rounding::F16 {
        3.0 * mag / 2048.0
    } else {
        0.0
    };
    let sums = if rounding == Rounding::BothF16 {
        1e-4
    } else {
        1e-5
    };
    (dot, sums * mag + 3.0 * flip + f16_sums + 1e-6)
}

#[test]
fn matmul_and_embedding_every_dtype() {
    for g in devices() {
        matmul_and_embedding_on(&g);
    }
}

fn matmul_and_embedding_on(g: &WgpuBackend) {
    let c = CpuBackend::new(Some(2)).unwrap();
    let mut rng = StdRng::seed_from_u64(7);
    for dtype in DType::ALL {
        let bs = dtype.block_size();
        let k = if bs == 1 { 37 } else { bs * 3 };
        for &(n, m) in &[(1usize, 45usize), (3, 17), (70, 33), (130, 131)] {
            let wv = random(m * k, &mut rng, 1.0);
            let xv = random(n * k, &mut rng, 1.0);
            let mut outs = Vec::new();
            for b in [g as &dyn Backend, &c] {
                let w = upload(b, dtype, &[m, k], &wv);
                let x = upload(b, DType::F32, &[n, k], &xv);
                let mut o = b
                    .zeros(DType::F32, Shape::new(vec![n, m]).unwrap())
                    .unwrap();
                b.matmul(&x, &w, &mut o).unwrap();
                let ids = ints(b, &[0, (m - 1) as i32, 5, 2, 16]);
                let mut e = b
                    .zeros(DType::F32, Shape::new(vec![5, k]).unwrap())
                    .unwrap();
                b.embedding(&w, &ids, &mut e).unwrap();
                outs.push((read(b, &o), read(b, &e)));
            }
            // Against the stored weights in f64 (see reference_dot).
            let wd = quant::dequantize_to_vec(dtype, &quant::quantize(dtype, &wv).unwrap(), m * k)
                .unwrap();
            for t in 0..n {
                for r in 0..m {
                    let (dot, tol) = reference_dot(
                        &wd[r * k..][..k],
                        &xv[t * k..][..k],
                        rounding(g, dtype, n, k),
                    );
                    let got = outs[0].0[t * m + r] as f64;
                    assert!(
                        (got - dot).abs() <= tol,
                        "matmul {dtype} n={n} m={m} [{t},{r}]: wgpu {got}, f64 {dot}"
                    );
                }
            }
            close(&outs[0].1, &outs[1].1, 1e-6, &format!("embedding {dtype}"));
            let back = g.download(&upload(g, dtype, &[m, k], &wv)).unwrap();
            assert_eq!(
                back,
                quant::quantize(dtype, &wv).unwrap(),
                "{dtype} round trip"
            );
        }
    }
}

#[test]
fn norms_elementwise_rope_attention() {
    for g in devices() {
        norms_elementwise_rope_attention_on(&g);
    }
}

fn norms_elementwise_rope_attention_on(g: &WgpuBackend) {
    let c = CpuBackend::new(Some(2)).unwrap();
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
    for b in [g as &dyn Backend, &c] {
        let mut r = Vec::new();
        let x = upload(b, DType::F32, &[rows, cols], &xv);
        let y = upload(b, DType::F32, &[rows, cols], &yv);
        let w = upload(b, DType::F32, &[cols], &wv);
        let mut o = b
            .zeros(DType::F32, Shape::new(vec![rows, cols]).unwrap())
            .unwrap();
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
        let mut sl = b
            .zeros(DType::F32, Shape::new(vec![rows, 17]).unwrap())
            .unwrap();
        b.slice_cols(&x, 100, &mut sl).unwrap();
        r.push(read(b, &sl));
        let mut am = b
            .zeros(DType::I32, Shape::new(vec![rows]).unwrap())
            .unwrap();
        b.argmax(&x, &mut am).unwrap();
        r.push(
            b.download(&am)
                .unwrap()
                .chunks_exact(4)
                .map(|c| i32::from_le_bytes(c.try_into().unwrap()) as f32)
                .collect(),
        );
        for layout in [RopeLayout::Interleaved, RopeLayout::Neox] {
            let mut q = upload(b, DType::F32, &[n, heads, hd], &qv);
            let pos = ints(b, &[3, 17, 3000]);
            let f = upload(b, DType::F32, &[24], &freqs);
            b.rope(&mut q, &pos, &f, layout).unwrap();
            r.push(read(b, &q));
        }
        let q = upload(b, DType::F32, &[n, heads, hd], &qv);
        let mut kc = b
            .zeros(DType::F32, Shape::new(vec![cap, kvh, hd]).unwrap())
            .unwrap();
        let mut vc = b
            .zeros(DType::F32, Shape::new(vec![cap, kvh, hd]).unwrap())
            .unwrap();
        let ks = upload(b, DType::F32, &[cap, kvh, hd], &kv);
        let vs = upload(b, DType::F32, &[cap, kvh, hd], &vv);
        let all: Vec<i32> = (0..cap as i32).collect();
        let allp = ints(b, &all);
        b.write_rows(&ks, &mut kc, &allp).unwrap();
        b.write_rows(&vs, &mut vc, &allp).unwrap();
        let pos = ints(b, &[0, 20, 39]);
        for params in [
            AttentionParams {
                scale: 0.125,
                softcap: None,
                window: None,
            },
            AttentionParams {
                scale: 0.125,
                softcap: Some(5.0),
                window: Some(7),
            },
        ] {
            let mut out = b
                .zeros(DType::F32, Shape::new(vec![n, heads, hd]).unwrap())
                .unwrap();
            b.attention(&q, &kc, &vc, &pos, &params, &mut out).unwrap();
            r.push(read(b, &out));
        }
        results.push(r);
    }
    let names = [
        "rms",
        "layer",
        "softmax",
        "binary",
        "silu",
        "gelu/softcap",
        "slice",
        "argmax",
        "rope-i",
        "rope-n",
        "attn",
        "attn-window",
    ];
    for (i, name) in names.iter().enumerate() {
        close(&results[0][i], &results[1][i], 2e-5, name);
    }
}

/// Weights larger than one binding (128 MiB on lavapipe) are bound in chunks of rows:
/// the rows on either side of each chunk boundary, and embedding lookups there, must match.
#[test]
fn weights_past_the_binding_limit_are_bound_in_chunks() {
    let Some(g) = devices().into_iter().next() else {
        return;
    };
    let max = g.summary().max_binding as usize;
    let mut rng = StdRng::seed_from_u64(11);
    for (dtype, k) in [(DType::F32, 1024usize), (DType::Q8_0, 4096)] {
        let row_bytes = dtype.row_bytes(k).unwrap();
        let m = max / row_bytes + 300;
        if m * row_bytes > g.summary().max_buffer as usize {
            eprintln!("SKIPPED: {dtype} weight of {m} rows exceeds this adapter's largest buffer");
            continue;
        }
        let wv = random(m * k, &mut rng, 1.0);
        let stored = quant::quantize(dtype, &wv).unwrap();
        let wd = quant::dequantize_to_vec(dtype, &stored, m * k).unwrap();
        let w = g
            .upload(
                dtype,
                Shape::new(vec![m, k]).unwrap(),
                HostBytes::from_vec(stored),
            )
            .unwrap();
        let xv = random(2 * k, &mut rng, 1.0);
        let x = upload(&g, DType::F32, &[2, k], &xv);
        let mut out = g
            .zeros(DType::F32, Shape::new(vec![2, m]).unwrap())
            .unwrap();
        g.matmul(&x, &w, &mut out).unwrap();
        let got = read(&g, &out);
        let ids: Vec<i32> = vec![0, (m / 2) as i32, (m - 1) as i32, (max / row_bytes) as i32];
        let idt = ints(&g, &ids);
        let mut e = g
            .zeros(DType::F32, Shape::new(vec![ids.len(), k]).unwrap())
            .unwrap();
        g.embedding(&w, &idt, &mut e).unwrap();
        let emb = read(&g, &e);
        for (i, &id) in ids.iter().enumerate() {
            let id = id as usize;
            assert_eq!(
                &emb[i * k..(i + 1) * k],
                &wd[id * k..(id + 1) * k],
                "{dtype} embedding row {id}"
            );
        }
        // Every row is checked: a chunk that starts in the wrong place shifts them all.
        for t in 0..2 {
            for r in (0..m).step_by(97).chain(m - 400..m) {
                let (dot, tol) =
                    reference_dot(&wd[r * k..][..k], &xv[t * k..][..k], Rounding::None);
                let v = got[t * m + r] as f64;
                assert!((v - dot).abs() <= tol, "{dtype} [{t},{r}]: {v} vs {dot}");
            }
        }
    }
}

/// Prompt attention (tiles of 16 queries) against the CPU: a partial last tile, heads of
/// 64, 96 and 128 dimensions, grouped KV heads, positions past the start of the cache, a
/// window and a softcap.
#[test]
fn prompt_attention_in_tiles() {
    for g in devices() {
        let c = CpuBackend::new(Some(2)).unwrap();
        let mut rng = StdRng::seed_from_u64(21);
        for hd in [64usize, 96, 128] {
            let (n, heads, kvh, cap) = (37usize, 4usize, 2usize, 90usize);
            let qv = random(n * heads * hd, &mut rng, 1.0);
            let kv = random(cap * kvh * hd, &mut rng, 1.0);
            let vv = random(cap * kvh * hd, &mut rng, 1.0);
            let positions: Vec<i32> = (40..40 + n as i32).collect();
            for params in [
                AttentionParams {
                    scale: 1.0 / (hd as f32).sqrt(),
                    softcap: None,
                    window: None,
                },
                AttentionParams {
                    scale: 0.2,
                    softcap: Some(3.0),
                    window: Some(21),
                },
            ] {
                let mut outs = Vec::new();
                for b in [&g as &dyn Backend, &c] {
                    let q = upload(b, DType::F32, &[n, heads, hd], &qv);
                    let kc = upload(b, DType::F32, &[cap, kvh, hd], &kv);
                    let vc = upload(b, DType::F32, &[cap, kvh, hd], &vv);
                    let pos = ints(b, &positions);
                    let mut out = b
                        .zeros(DType::F32, Shape::new(vec![n, heads, hd]).unwrap())
                        .unwrap();
                    b.attention(&q, &kc, &vc, &pos, &params, &mut out).unwrap();
                    outs.push(read(b, &out));
                }
                close(
                    &outs[0],
                    &outs[1],
                    2e-5,
                    &format!("prompt attention hd={hd}"),
                );
            }
        }
    }
}

/// The fused ops the wgpu backend overrides against the CPU's plain sequences.
#[test]
fn fused_ops_match_the_plain_sequences() {
    for g in devices() {
        let c = CpuBackend::new(Some(2)).unwrap();
        let mut rng = StdRng::seed_from_u64(13);
        for dtype in [DType::F16, DType::Q4_0, DType::Q6_K] {
            for n in [1usize, 5, 130] {
                let (m, k) = (70usize, 512usize);
                let wv = random(m * k, &mut rng, 1.0);
                let xv = random(n * k, &mut rng, 1.0);
                let av = random(n * m, &mut rng, 1.0);
                let w = upload(&g, dtype, &[m, k], &wv);
                let x = upload(&g, DType::F32, &[n, k], &xv);
                let mut acc = upload(&g, DType::F32, &[n, m], &av);
                let mut tmp = g
                    .zeros(DType::F32, Shape::new(vec![n, m]).unwrap())
                    .unwrap();
                g.matmul_add(&x, &w, &mut acc, &mut tmp).unwrap();
                let got = read(&g, &acc);
                let wd =
                    quant::dequantize_to_vec(dtype, &quant::quantize(dtype, &wv).unwrap(), m * k)
                        .unwrap();
                for t in 0..n {
                    for r in 0..m {
                        let rounded = rounding(&g, dtype, n, k);
                        let (dot, tol) =
                            reference_dot(&wd[r * k..][..k], &xv[t * k..][..k], rounded);
                        let a = av[t * m + r] as f64;
                        let v = got[t * m + r] as f64;
                        assert!(
                            (v - a - dot).abs() <= tol + 1e-5 * a.abs(),
                            "matmul_add {dtype} n={n} [{t},{r}]: {v} vs {}",
                            a + dot
                        );
                    }
                }
            }
        }
        // The norm and the gated activation fused into one-row products, against the same
        // device's plain sequence.
        for dtype in [DType::F32, DType::Q8_0, DType::Q4_K] {
            let (m, k) = (100usize, 512usize);
            let shape = |r: usize, c: usize| Shape::new(vec![r, c]).unwrap();
            let (wg, wu) = (random(m * k, &mut rng, 1.0), random(m * k, &mut rng, 1.0));
            let (xv, nv) = (random(k, &mut rng, 2.0), random(k, &mut rng, 1.0));
            let gate = upload(&g, dtype, &[m, k], &wg);
            let up = upload(&g, dtype, &[m, k], &wu);
            let x = upload(&g, DType::F32, &[1, k], &xv);
            let nw = upload(&g, DType::F32, &[k], &nv);
            let norm = kiln_core::RmsNorm {
                x: &x,
                weight: &nw,
                eps: 1e-5,
            };
            for gelu in [false, true] {
                let mut normed = g.zeros(DType::F32, shape(1, k)).unwrap();
                let mut out = g.zeros(DType::F32, shape(1, m)).unwrap();
                let mut tg = g.zeros(DType::F32, shape(1, m)).unwrap();
                let mut tu = g.zeros(DType::F32, shape(1, m)).unwrap();
                g.rms_norm_gated_ffn(
                    &norm,
                    &mut normed,
                    &gate,
                    &up,
                    gelu,
                    &mut out,
                    &mut tg,
                    &mut tu,
                )
                .unwrap();
                let (fused_out, fused_normed) = (read(&g, &out), read(&g, &normed));
                g.rms_norm(&x, &nw, 1e-5, &mut normed).unwrap();
                g.matmul(&normed, &gate, &mut tg).unwrap();
                g.matmul(&normed, &up, &mut tu).unwrap();
                if gelu {
                    g.gelu_mul(&tg, &tu, &mut out).unwrap();
                } else {
                    g.silu_mul(&tg, &tu, &mut out).unwrap();
                }
                close(
                    &fused_normed,
                    &read(&g, &normed),
                    1e-6,
                    &format!("normed {dtype}"),
                );
                close(
                    &fused_out,
                    &read(&g, &out),
                    1e-5,
                    &format!("rms_norm_gated_ffn {dtype} gelu={gelu}"),
                );
                let mut q = g.zeros(DType::F32, shape(1, m)).unwrap();
                let mut kk = g.zeros(DType::F32, shape(1, m)).unwrap();
                let mut normed2 = g.zeros(DType::F32, shape(1, k)).unwrap();
                g.rms_norm_matmul_many(&norm, &mut normed2, &[&gate, &up], &mut [&mut q, &mut kk])
                    .unwrap();
                close(
                    &read(&g, &normed2),
                    &read(&g, &normed),
                    1e-6,
                    "normed (many)",
                );
                close(
                    &read(&g, &q),
                    &read(&g, &tg),
                    1e-5,
                    &format!("rms_norm_matmul_many {dtype} [0]"),
                );
                close(
                    &read(&g, &kk),
                    &read(&g, &tu),
                    1e-5,
                    &format!("rms_norm_matmul_many {dtype} [1]"),
                );
            }
        }
        for (hd, rot) in [(64usize, Some(32usize)), (80, Some(16)), (64, None)] {
            let (n, heads, kvh, cap) = (3usize, 4usize, 2usize, 9usize);
            let qv = random(n * heads * hd, &mut rng, 1.0);
            let kv = random(n * kvh * hd, &mut rng, 1.0);
            let vv = random(n * kvh * hd, &mut rng, 1.0);
            for layout in [RopeLayout::Interleaved, RopeLayout::Neox] {
                let mut got = Vec::new();
                for b in [&g as &dyn Backend, &c] {
                    let mut q = upload(b, DType::F32, &[n, heads, hd], &qv);
                    let mut k = upload(b, DType::F32, &[n, kvh, hd], &kv);
                    let v = upload(b, DType::F32, &[n, kvh, hd], &vv);
                    let pos = ints(b, &[2, 5, 8]);
                    let freqs: Vec<f32> = (0..rot.unwrap_or(1))
                        .map(|i| 0.9f32.powi(i as i32))
                        .collect();
                    let f = upload(b, DType::F32, &[freqs.len()], &freqs);
                    let shape = Shape::new(vec![cap, kvh, hd]).unwrap();
                    let mut kc = b.zeros(DType::F32, shape.clone()).unwrap();
                    let mut vc = b.zeros(DType::F32, shape).unwrap();
                    b.rope_write_kv(
                        &mut q,
                        &mut k,
                        &v,
                        &pos,
                        rot.map(|_| (&f, layout)),
                        &mut kc,
                        &mut vc,
                    )
                    .unwrap();
                    got.push([read(b, &q), read(b, &k), read(b, &kc), read(b, &vc)]);
                }
                for (i, what) in ["q", "k", "k cache", "v cache"].iter().enumerate() {
                    close(
                        &got[0][i],
                        &got[1][i],
                        2e-6,
                        &format!("rope_write_kv {what} hd={hd} {layout:?}"),
                    );
                }
            }
        }
    }
}

/// A missing adapter, a tensor past the adapter's largest buffer, a tensor of another
/// device and shapes that do not fit: errors that say so, never a panic.
#[test]
fn bad_devices_and_inputs_are_errors() {
    let err = WgpuBackend::new(usize::MAX)
        .err()
        .expect("no such adapter")
        .to_string();
    assert!(err.contains("no wgpu adapter"), "{err}");
    let Some(g) = devices().into_iter().next() else {
        return;
    };
    let too_big = g.summary().max_buffer as usize / 4 + 1;
    let err = g
        .zeros(DType::F32, Shape::new(vec![too_big]).unwrap())
        .expect_err("past the largest buffer")
        .to_string();
    assert!(
        err.contains("largest buffer") && err.contains("wgpu:0"),
        "{err}"
    );
    let c = CpuBackend::new(Some(1)).unwrap();
    let on_cpu = upload(&c, DType::F32, &[2, 4], &[0.0; 8]);
    let w = upload(&g, DType::F32, &[3, 4], &[0.0; 12]);
    let mut out = g
        .zeros(DType::F32, Shape::new(vec![2, 3]).unwrap())
        .unwrap();
    let err = g
        .matmul(&on_cpu, &w, &mut out)
        .expect_err("a CPU tensor")
        .to_string();
    assert!(err.contains("not on a wgpu device"), "{err}");
    let x = upload(&g, DType::F32, &[2, 5], &[0.0; 10]);
    assert!(g.matmul(&x, &w, &mut out).is_err(), "k of 5 against 4");
    let mut small = g
        .zeros(DType::F32, Shape::new(vec![2, 2]).unwrap())
        .unwrap();
    assert!(g.add_assign(&mut small, &w).is_err());
    let wrong = g.upload(
        DType::Q8_0,
        Shape::new(vec![1, 32]).unwrap(),
        HostBytes::from_vec(vec![0; 33]),
    );
    assert!(wrong.is_err(), "33 bytes for a 34-byte block");
}

/// One row of x by quantized and F16 weights at model widths (the rounding of x spans
/// several workgroups at 14,336, llama3-8b's feed-forward), plain and with the norm fused.
#[test]
fn one_row_products_at_model_widths() {
    for g in devices() {
        let mut rng = StdRng::seed_from_u64(17);
        for dtype in [
            DType::F16,
            DType::Q8_0,
            DType::Q4_0,
            DType::Q4_K,
            DType::Q6_K,
        ] {
            for k in [2048usize, 14336] {
                let m = 37;
                let wv = random(m * k, &mut rng, 1.0);
                let xv = random(k, &mut rng, 1.0);
                let w = upload(&g, dtype, &[m, k], &wv);
                let x = upload(&g, DType::F32, &[1, k], &xv);
                let mut o = g
                    .zeros(DType::F32, Shape::new(vec![1, m]).unwrap())
                    .unwrap();
                g.matmul(&x, &w, &mut o).unwrap();
                let got = read(&g, &o);
                let wd =
                    quant::dequantize_to_vec(dtype, &quant::quantize(dtype, &wv).unwrap(), m * k)
                        .unwrap();
                for r in 0..m {
                    let (dot, tol) =
                        reference_dot(&wd[r * k..][..k], &xv, rounding(&g, dtype, 1, k));
                    assert!(
                        (got[r] as f64 - dot).abs() <= tol,
                        "{dtype} k={k} row {r}: wgpu {}, f64 {dot}",
                        got[r]
                    );
                }
                // The norm in front: every workgroup of the rounding finds it alone.
                let nw = upload(&g, DType::F32, &[k], &random(k, &mut rng, 1.0));
                let norm = kiln_core::RmsNorm {
                    x: &x,
                    weight: &nw,
                    eps: 1e-5,
                };
                let shape = Shape::new(vec![1, k]).unwrap();
                let mut normed = g.zeros(DType::F32, shape.clone()).unwrap();
                let mut fused = g
                    .zeros(DType::F32, Shape::new(vec![1, m]).unwrap())
                    .unwrap();
                g.rms_norm_matmul_many(&norm, &mut normed, &[&w], &mut [&mut fused])
                    .unwrap();
                let mut plain = g.zeros(DType::F32, shape).unwrap();
                g.rms_norm(&x, &nw, 1e-5, &mut plain).unwrap();
                close(&read(&g, &normed), &read(&g, &plain), 1e-5, "normed row");
                g.matmul(&plain, &w, &mut o).unwrap();
                close(
                    &read(&g, &fused),
                    &read(&g, &o),
                    1e-3,
                    &format!("{dtype} k={k} fused"),
                );
            }
        }
    }
}

/// Prompt products (the tiled GEMM, or cooperative matrices where the adapter has them) at
/// a model's width, with partial tiles in both directions and the residual add.
#[test]
fn prompt_products_at_model_widths() {
    for g in devices() {
        let mut rng = StdRng::seed_from_u64(23);
        for dtype in [DType::F16, DType::Q8_0, DType::Q4_K] {
            let (n, m, k) = (77usize, 300usize, 2048usize);
            let wv = random(m * k, &mut rng, 1.0);
            let xv = random(n * k, &mut rng, 1.0);
            let av = random(n * m, &mut rng, 1.0);
            let w = upload(&g, dtype, &[m, k], &wv);
            let x = upload(&g, DType::F32, &[n, k], &xv);
            let mut acc = upload(&g, DType::F32, &[n, m], &av);
            let mut tmp = g
                .zeros(DType::F32, Shape::new(vec![n, m]).unwrap())
                .unwrap();
            g.matmul_add(&x, &w, &mut acc, &mut tmp).unwrap();
            let got = read(&g, &acc);
            let wd = quant::dequantize_to_vec(dtype, &quant::quantize(dtype, &wv).unwrap(), m * k)
                .unwrap();
            let rounded = rounding(&g, dtype, n, k);
            for t in 0..n {
                for r in 0..m {
                    let (dot, tol) = reference_dot(&wd[r * k..][..k], &xv[t * k..][..k], rounded);
                    let a = av[t * m + r] as f64;
                    let v = got[t * m + r] as f64;
                    assert!(
                        (v - a - dot).abs() <= tol + 1e-5 * a.abs(),
                        "{dtype} [{t},{r}]: {v} vs {}",
                        a + dot
                    );
                }
            }
        }
    }
}
