//! Every CUDA op against the CPU backend (itself tested against float64) or a float64
//! reference, on fresh random inputs of awkward sizes. These need a GPU: CI lists them as
//! ignored; the GPU machine runs them with `--include-ignored`.

use kiln_core::{quant, AttentionParams, Backend, DType, HostBytes, RopeLayout, Shape, Tensor};
use kiln_cpu::CpuBackend;
use kiln_cuda::CudaBackend;
use rand::{rngs::StdRng, Rng, SeedableRng};

fn gpu() -> CudaBackend {
    CudaBackend::new(0).unwrap_or_else(|e| panic!("no CUDA backend: {e}"))
}

fn cpu() -> CpuBackend {
    CpuBackend::new(Some(2)).unwrap()
}

fn random(n: usize, rng: &mut StdRng, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| rng.random_range(-1.0f32..1.0) * scale)
        .collect()
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

fn indices(b: &dyn Backend, values: &[i32]) -> Tensor {
    let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    b.upload(
        DType::I32,
        Shape::new(vec![values.len()]).unwrap(),
        HostBytes::from_vec(bytes),
    )
    .unwrap()
}

fn read(b: &dyn Backend, t: &Tensor) -> Vec<f32> {
    let bytes = b.download(t).unwrap();
    quant::dequantize_to_vec(DType::F32, &bytes, t.shape().numel()).unwrap()
}

fn read_i32(b: &dyn Backend, t: &Tensor) -> Vec<i32> {
    b.download(t)
        .unwrap()
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// An F32 output filled with NaN, so that an element an op forgets to write shows.
fn poisoned(b: &dyn Backend, dims: &[usize]) -> Tensor {
    let mut t = b
        .zeros(DType::F32, Shape::new(dims.to_vec()).unwrap())
        .unwrap();
    b.fill(&mut t, f32::NAN).unwrap();
    t
}

/// The stored weights of `values` (quantized and decoded back), as the GPU sees them.
fn stored(dtype: DType, values: &[f32]) -> Vec<f32> {
    quant::dequantize_to_vec(
        dtype,
        &quant::quantize(dtype, values).unwrap(),
        values.len(),
    )
    .unwrap()
}

/// Row `r` of x [_, k] dotted with row `c` of w [_, k] in float64, and the sum of the
/// products' magnitudes (the scale rounding errors grow with).
fn dot_f64(x: &[f32], w: &[f32], k: usize, r: usize, c: usize) -> (f64, f64) {
    let (mut dot, mut mag) = (0f64, 0f64);
    for i in 0..k {
        let p = x[r * k + i] as f64 * w[c * k + i] as f64;
        dot += p;
        mag += p.abs();
    }
    (dot, mag)
}

fn assert_close(got: &[f32], want: &[f32], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let err = (g - w).abs();
        assert!(
            err <= tol * (1.0 + w.abs()),
            "{what}: element {i}: got {g}, want {w} (|Δ| {err:e})"
        );
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn matmul_every_dtype_and_batch_against_f64() {
    let g = gpu();
    let mut rng = StdRng::seed_from_u64(1);
    for dtype in DType::ALL {
        // Row lengths: whole K-quant blocks for block types; for plain floats also one
        // that is not a multiple of 32.
        let ks: &[usize] = if dtype.is_quantized() {
            &[256, 768]
        } else {
            &[100, 512]
        };
        for &k in ks {
            for n in [1, 2, 3, 5, 8, 9, 40] {
                let m = 77;
                let w_vals = random(m * k, &mut rng, 1.0);
                let x_vals = random(n * k, &mut rng, 1.0);
                let w = upload(&g, dtype, &[m, k], &w_vals);
                let x = upload(&g, DType::F32, &[n, k], &x_vals);
                let mut out = poisoned(&g, &[n, m]);
                g.matmul(&x, &w, &mut out).unwrap();
                let got = read(&g, &out);
                // Reference: the stored weights, decoded, in float64.
                let wq = stored(dtype, &w_vals);
                // Batches past 8 round x to 16 bits for the tensor cores; up to 8 rows,
                // quantized weights meet x rounded to int8 per 32 values (error at most
                // half a step, max|x| / 254, per value), float weights x as it is.
                let tol = match (n > 8, dtype) {
                    (false, _) | (true, DType::F32) => 1e-5,
                    (true, DType::BF16) => 8e-3,
                    (true, _) => 1e-3,
                };
                let int8_x = n <= 8 && dtype.is_quantized();
                for r in 0..n {
                    for c in 0..m {
                        let (dot, mag) = dot_f64(&x_vals, &wq, k, r, c);
                        let mut rounding = 0f64;
                        if int8_x {
                            for blk in 0..k / 32 {
                                let xs = &x_vals[r * k + blk * 32..][..32];
                                let amax = xs.iter().fold(0f32, |a, v| a.max(v.abs())) as f64;
                                let wsum: f64 = wq[c * k + blk * 32..][..32]
                                    .iter()
                                    .map(|w| w.abs() as f64)
                                    .sum();
                                rounding += amax / 254.0 * wsum;
                            }
                        }
                        let v = got[r * m + c] as f64;
                        assert!(
                            (v - dot).abs() <= tol * mag + 1.001 * rounding,
                            "{dtype} k={k} n={n} [{r},{c}]: got {v}, want {dot} (scale {mag})"
                        );
                    }
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn embedding_every_dtype_matches_the_cpu() {
    let (g, c) = (gpu(), cpu());
    let mut rng = StdRng::seed_from_u64(2);
    for dtype in DType::ALL {
        let (rows, dim) = (37, if dtype.is_quantized() { 512 } else { 72 });
        let vals = random(rows * dim, &mut rng, 2.0);
        let ids = [3, 0, 36, 3, 17];
        let outs: Vec<Vec<f32>> = [&g as &dyn Backend, &c]
            .into_iter()
            .map(|b| {
                let table = upload(b, dtype, &[rows, dim], &vals);
                let mut out = poisoned(b, &[ids.len(), dim]);
                b.embedding(&table, &indices(b, &ids), &mut out).unwrap();
                read(b, &out)
            })
            .collect();
        assert_close(&outs[0], &outs[1], 1e-6, &format!("embedding {dtype}"));
    }
}

/// Run `op` on the GPU and the CPU on the same F32 inputs; compare every output.
fn same_on_both(
    inputs: &[(&[usize], Vec<f32>)],
    outputs: &[&[usize]],
    tol: f32,
    what: &str,
    op: impl Fn(&dyn Backend, &mut [Tensor]),
) {
    let (g, c) = (gpu(), cpu());
    let results: Vec<Vec<Vec<f32>>> = [&g as &dyn Backend, &c]
        .into_iter()
        .map(|b| {
            let mut ts: Vec<Tensor> = inputs
                .iter()
                .map(|(dims, v)| upload(b, DType::F32, dims, v))
                .collect();
            ts.extend(outputs.iter().map(|d| poisoned(b, d)));
            op(b, &mut ts);
            ts.iter().map(|t| read(b, t)).collect()
        })
        .collect();
    for (i, (a, b)) in results[0].iter().zip(&results[1]).enumerate() {
        assert_close(a, b, tol, &format!("{what}: tensor {i}"));
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn norms_and_softmax_match_the_cpu() {
    let mut rng = StdRng::seed_from_u64(3);
    for (rows, dim) in [(1, 64), (5, 1000), (3, 4096)] {
        let x = random(rows * dim, &mut rng, 3.0);
        let w = random(dim, &mut rng, 1.5);
        let bias = random(dim, &mut rng, 0.5);
        same_on_both(
            &[
                (&[rows, dim], x.clone()),
                (&[dim], w.clone()),
                (&[dim], bias),
            ],
            &[&[rows, dim], &[rows, dim]],
            2e-5,
            "norms",
            |b, t| {
                let [x, w, bias, rms, ln] = t else {
                    unreachable!()
                };
                b.rms_norm(x, w, 1e-5, rms).unwrap();
                b.layer_norm(x, w, bias, 1e-5, ln).unwrap();
                b.softmax(x).unwrap();
            },
        );
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn elementwise_and_row_ops_match_the_cpu() {
    let mut rng = StdRng::seed_from_u64(4);
    let (rows, cols) = (7, 333);
    let a = random(rows * cols, &mut rng, 4.0);
    let bv = random(rows * cols, &mut rng, 4.0);
    let row = random(cols, &mut rng, 2.0);
    same_on_both(
        &[
            (&[rows, cols], a.clone()),
            (&[rows, cols], bv.clone()),
            (&[cols], row),
        ],
        &[&[rows, cols], &[rows, cols], &[rows, 100], &[rows, cols]],
        1e-5,
        "elementwise",
        |b, t| {
            let [x, y, r, silu, gelu_gate, slice, acc] = t else {
                unreachable!()
            };
            b.silu_mul(x, y, silu).unwrap();
            b.gelu_mul(x, y, gelu_gate).unwrap();
            b.slice_cols(x, 200, slice).unwrap();
            b.fill(acc, 0.5).unwrap();
            b.add_assign(acc, x).unwrap();
            b.add_assign(acc, r).unwrap();
            b.mul_assign(acc, r).unwrap();
            b.mul_assign(acc, y).unwrap();
            b.scale(acc, 0.3).unwrap();
            b.gelu(y).unwrap();
            b.softcap(x, 2.5).unwrap();
        },
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn rope_and_write_rows_follow_positions() {
    let mut rng = StdRng::seed_from_u64(5);
    let (tokens, heads, hd) = (3, 4, 64);
    let x = random(tokens * heads * hd, &mut rng, 1.0);
    let cache = random(12 * heads * hd, &mut rng, 1.0);
    for layout in [RopeLayout::Interleaved, RopeLayout::Neox] {
        for rot in [hd, hd / 2] {
            let inv_freq: Vec<f32> = (0..rot / 2)
                .map(|i| 10000f32.powf(-2.0 * i as f32 / rot as f32))
                .collect();
            let (g, c) = (gpu(), cpu());
            let outs: Vec<(Vec<f32>, Vec<f32>)> = [&g as &dyn Backend, &c]
                .into_iter()
                .map(|b| {
                    let mut xt = upload(b, DType::F32, &[tokens, heads, hd], &x);
                    let mut ct = upload(b, DType::F32, &[12, heads, hd], &cache);
                    let pos = indices(b, &[5, 2, 9]);
                    let f = upload(b, DType::F32, &[rot / 2], &inv_freq);
                    b.rope(&mut xt, &pos, &f, layout).unwrap();
                    b.write_rows(&xt, &mut ct, &pos).unwrap();
                    (read(b, &xt), read(b, &ct))
                })
                .collect();
            assert_close(
                &outs[0].0,
                &outs[1].0,
                2e-6,
                &format!("rope {layout:?} {rot}"),
            );
            assert_close(&outs[0].1, &outs[1].1, 2e-6, "write_rows");
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn argmax_takes_the_first_maximum() {
    let g = gpu();
    let mut rng = StdRng::seed_from_u64(6);
    let (rows, cols) = (4, 128_256);
    let mut x = random(rows * cols, &mut rng, 10.0);
    x[5] = 50.0;
    x[cols - 1] = 50.0; // a tie in row 0: the first wins
    x[cols + 70_000] = 60.0;
    x[2 * cols + cols - 1] = 11.0;
    x[3 * cols + 1] = f32::NAN; // NaN never wins
    x[3 * cols + 2] = 12.0;
    let xt = upload(&g, DType::F32, &[rows, cols], &x);
    let mut out = g
        .zeros(DType::I32, Shape::new(vec![rows]).unwrap())
        .unwrap();
    g.argmax(&xt, &mut out).unwrap();
    assert_eq!(read_i32(&g, &out), vec![5, 70_000, (cols - 1) as i32, 2]);
}

#[test]
#[ignore = "needs a CUDA device"]
fn attention_matches_the_cpu() {
    let mut rng = StdRng::seed_from_u64(7);
    // (queries, heads, kv_heads, head_dim, capacity, first position, window, softcap)
    type Case = (
        usize,
        usize,
        usize,
        usize,
        usize,
        usize,
        Option<usize>,
        Option<f32>,
    );
    let cases: &[Case] = &[
        (1, 4, 2, 16, 64, 20, None, None),
        (1, 32, 4, 64, 700, 517, None, None), // decode, split over the capacity
        (3, 8, 1, 128, 600, 300, None, None), // a few queries, split
        (40, 6, 6, 96, 64, 0, None, None),    // a prompt, multi-head, head_dim 96
        (33, 8, 2, 256, 80, 5, Some(7), Some(30.0)), // Gemma 2: window and soft-cap
        (1, 16, 8, 128, 2048, 2000, Some(512), None),
    ];
    for &(n, heads, kvh, hd, cap, p0, window, softcap) in cases {
        let q = random(n * heads * hd, &mut rng, 1.0);
        let k = random(cap * kvh * hd, &mut rng, 1.0);
        let v = random(cap * kvh * hd, &mut rng, 1.0);
        let positions: Vec<i32> = (p0..p0 + n).map(|p| p as i32).collect();
        let params = AttentionParams {
            scale: 1.0 / (hd as f32).sqrt(),
            softcap,
            window,
        };
        let (g, c) = (gpu(), cpu());
        let outs: Vec<Vec<f32>> = [&g as &dyn Backend, &c]
            .into_iter()
            .map(|b| {
                let qt = upload(b, DType::F32, &[n, heads, hd], &q);
                let kt = upload(b, DType::F32, &[cap, kvh, hd], &k);
                let vt = upload(b, DType::F32, &[cap, kvh, hd], &v);
                let mut out = poisoned(b, &[n, heads, hd]);
                b.attention(&qt, &kt, &vt, &indices(b, &positions), &params, &mut out)
                    .unwrap();
                read(b, &out)
            })
            .collect();
        assert_close(
            &outs[0],
            &outs[1],
            2e-5,
            &format!("attention n={n} heads={heads}/{kvh} d={hd} cap={cap} pos0={p0}"),
        );
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn recorded_steps_replay_on_new_contents() {
    let g = gpu();
    let mut rng = StdRng::seed_from_u64(8);
    let (heads, hd, cap) = (4, 32, 600);
    let k = random(cap * heads * hd, &mut rng, 1.0);
    let kt = upload(&g, DType::F32, &[cap, heads, hd], &k);
    let mut q = upload(
        &g,
        DType::F32,
        &[1, heads, hd],
        &random(heads * hd, &mut rng, 1.0),
    );
    let mut pos = indices(&g, &[0]);
    let mut out = poisoned(&g, &[1, heads, hd]);
    let params = AttentionParams {
        scale: 0.2,
        softcap: None,
        window: None,
    };
    // Warm up (the op allocates its split buffers), then record.
    g.attention(&q, &kt, &kt, &pos, &params, &mut out).unwrap();
    let replay = g
        .capture(&mut || g.attention(&q, &kt, &kt, &pos, &params, &mut out))
        .unwrap()
        .expect("the CUDA backend records");
    for p in [3i32, 290, 599] {
        let qv = random(heads * hd, &mut rng, 1.0);
        g.write(&mut q, &quant::quantize(DType::F32, &qv).unwrap())
            .unwrap();
        g.write(&mut pos, &p.to_le_bytes()).unwrap();
        replay.replay().unwrap();
        let got = read(&g, &out);
        let mut want = poisoned(&g, &[1, heads, hd]);
        g.attention(&q, &kt, &kt, &pos, &params, &mut want).unwrap();
        assert_close(&got, &read(&g, &want), 0.0, &format!("replay at {p}"));
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn bad_inputs_are_errors() {
    let g = gpu();
    let c = cpu();
    let w = upload(&g, DType::Q4_0, &[8, 64], &[0.5; 512]);
    let x = upload(&g, DType::F32, &[2, 32], &[1.0; 64]);
    let mut out = poisoned(&g, &[2, 8]);
    assert!(g.matmul(&x, &w, &mut out).is_err(), "k mismatch");
    let on_cpu = upload(&c, DType::F32, &[2, 64], &[1.0; 128]);
    let err = g.matmul(&on_cpu, &w, &mut out).unwrap_err().to_string();
    assert!(err.contains("cpu"), "{err}");
    let mut t = g.zeros(DType::F32, Shape::new(vec![4]).unwrap()).unwrap();
    assert!(g.write(&mut t, &[0u8; 12]).is_err());
    // More memory than the GPU has: an error naming the sizes, not an abort.
    let huge = Shape::new(vec![1 << 20, 1 << 20]).unwrap();
    let err = g.zeros(DType::F32, huge).unwrap_err().to_string();
    assert!(err.contains("out of GPU memory"), "{err}");
}

/// The fused ops against the same work done op by op on the GPU (the plain ops are
/// checked against float64 above) and, for rope_write_kv, against the CPU.
#[test]
#[ignore = "needs a CUDA device"]
fn fused_ops_match_their_plain_sequences() {
    let g = gpu();
    let mut rng = StdRng::seed_from_u64(9);
    for dtype in [DType::F16, DType::Q4_K, DType::Q8_0] {
        let (k, m) = (512, 96);
        for n in [1, 3, 8, 20] {
            let x = upload(&g, DType::F32, &[n, k], &random(n * k, &mut rng, 1.0));
            let ws: Vec<Tensor> = (0..3)
                .map(|i| {
                    upload(
                        &g,
                        dtype,
                        &[m + 32 * i, k],
                        &random((m + 32 * i) * k, &mut rng, 1.0),
                    )
                })
                .collect();
            // matmul_add
            let base = random(n * m, &mut rng, 1.0);
            let mut acc = upload(&g, DType::F32, &[n, m], &base);
            let mut tmp = poisoned(&g, &[n, m]);
            g.matmul_add(&x, &ws[0], &mut acc, &mut tmp).unwrap();
            let mut plain = poisoned(&g, &[n, m]);
            g.matmul(&x, &ws[0], &mut plain).unwrap();
            let want: Vec<f32> = read(&g, &plain)
                .iter()
                .zip(&base)
                .map(|(a, b)| a + b)
                .collect();
            assert_close(
                &read(&g, &acc),
                &want,
                1e-5,
                &format!("matmul_add {dtype} n={n}"),
            );
            // matmul_many
            let mut outs: Vec<Tensor> = (0..3).map(|i| poisoned(&g, &[n, m + 32 * i])).collect();
            {
                let [o0, o1, o2] = &mut outs[..] else {
                    unreachable!()
                };
                g.matmul_many(&x, &[&ws[0], &ws[1], &ws[2]], &mut [o0, o1, o2])
                    .unwrap();
            }
            for (i, w) in ws.iter().enumerate() {
                let mut one = poisoned(&g, &[n, m + 32 * i]);
                g.matmul(&x, w, &mut one).unwrap();
                assert_close(
                    &read(&g, &outs[i]),
                    &read(&g, &one),
                    1e-6,
                    &format!("matmul_many {dtype} n={n} #{i}"),
                );
            }
            // gated_ffn, both activations
            let up = upload(&g, dtype, &[m, k], &random(m * k, &mut rng, 1.0));
            for gelu in [false, true] {
                let mut out = poisoned(&g, &[n, m]);
                let (mut tg, mut tu) = (poisoned(&g, &[n, m]), poisoned(&g, &[n, m]));
                g.gated_ffn(&x, &ws[0], &up, gelu, &mut out, &mut tg, &mut tu)
                    .unwrap();
                let (mut pg, mut pu, mut want) = (
                    poisoned(&g, &[n, m]),
                    poisoned(&g, &[n, m]),
                    poisoned(&g, &[n, m]),
                );
                g.matmul(&x, &ws[0], &mut pg).unwrap();
                g.matmul(&x, &up, &mut pu).unwrap();
                if gelu {
                    g.gelu_mul(&pg, &pu, &mut want).unwrap();
                } else {
                    g.silu_mul(&pg, &pu, &mut want).unwrap();
                }
                assert_close(
                    &read(&g, &out),
                    &read(&g, &want),
                    1e-5,
                    &format!("gated_ffn {dtype} n={n} gelu={gelu}"),
                );
            }
        }
    }

    let (tokens, heads, kvh, d, cap) = (3, 8, 2, 64, 16);
    let q = random(tokens * heads * d, &mut rng, 1.0);
    let kv = random(tokens * kvh * d, &mut rng, 1.0);
    let vv = random(tokens * kvh * d, &mut rng, 1.0);
    let cache = random(cap * kvh * d, &mut rng, 1.0);
    let inv_freq: Vec<f32> = (0..d / 4)
        .map(|i| 10000f32.powf(-4.0 * i as f32 / d as f32))
        .collect();
    for rope in [None, Some(RopeLayout::Interleaved), Some(RopeLayout::Neox)] {
        let c = cpu();
        let outs: Vec<Vec<Vec<f32>>> = [&g as &dyn Backend, &c]
            .into_iter()
            .map(|b| {
                let mut qt = upload(b, DType::F32, &[tokens, heads, d], &q);
                let mut kt = upload(b, DType::F32, &[tokens, kvh, d], &kv);
                let vt = upload(b, DType::F32, &[tokens, kvh, d], &vv);
                let mut kc = upload(b, DType::F32, &[cap, kvh, d], &cache);
                let mut vc = upload(b, DType::F32, &[cap, kvh, d], &cache);
                let f = upload(b, DType::F32, &[d / 4], &inv_freq);
                let pos = indices(b, &[7, 0, 15]);
                b.rope_write_kv(
                    &mut qt,
                    &mut kt,
                    &vt,
                    &pos,
                    rope.map(|l| (&f, l)),
                    &mut kc,
                    &mut vc,
                )
                .unwrap();
                [&qt, &kt, &kc, &vc].iter().map(|t| read(b, t)).collect()
            })
            .collect();
        for (i, (gpu_out, cpu_out)) in outs[0].iter().zip(&outs[1]).enumerate() {
            assert_close(
                gpu_out,
                cpu_out,
                2e-6,
                &format!("rope_write_kv {rope:?} tensor {i}"),
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn quantized_tensors_read_back_as_written() {
    // The GPU keeps quantized blocks split into quants and scales; reads give the file's
    // layout back.
    let g = gpu();
    let mut rng = StdRng::seed_from_u64(11);
    for dtype in DType::ALL {
        let (m, k) = (5, 512);
        let bytes = quant::quantize(dtype, &random(m * k, &mut rng, 2.0)).unwrap();
        let shape = Shape::new(vec![m, k]).unwrap();
        let mut t = g
            .upload(dtype, shape, HostBytes::from_vec(bytes.clone()))
            .unwrap();
        assert_eq!(g.download(&t).unwrap(), bytes, "{dtype} upload");
        let other = quant::quantize(dtype, &random(m * k, &mut rng, 1.0)).unwrap();
        g.write(&mut t, &other).unwrap();
        assert_eq!(g.download(&t).unwrap(), other, "{dtype} write");
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn sampling_on_the_device_follows_the_host_reference() {
    use kiln_core::sampling::pick;
    use kiln_core::SampleParams;
    let g = gpu();
    let mut rng = StdRng::seed_from_u64(12);
    let mut exact = 0;
    let mut trials = 0;
    for vocab in [1000, 32_000, 128_256] {
        for case in 0..40 {
            // Some rows with many equal logits (ties must go to the lowest ids).
            let mut logits = random(vocab, &mut rng, 6.0);
            if case % 4 == 0 {
                for l in &mut logits {
                    *l = (*l * 2.0).round() / 2.0;
                }
            }
            let params = SampleParams {
                temperature: [0.0, 0.3, 0.8, 1.5][case % 4],
                top_k: [1, 40, 5, 1024, 200][case % 5],
                top_p: [1.0, 0.9, 0.5][case % 3],
                min_p: [0.0, 0.05, 0.3][(case / 3) % 3],
                repeat_penalty: if case % 2 == 0 { 1.0 } else { 1.3 },
                draw: rng.random_range(0.0..1.0),
            };
            let penalized: Vec<u32> = (0..64).map(|i| (i * 37 % vocab) as u32).collect();
            let penalized = if params.repeat_penalty == 1.0 {
                &[][..]
            } else {
                &penalized[..]
            };
            let want = pick(&mut logits.clone(), penalized, &params);
            let mut lt = upload(&g, DType::F32, &[1, vocab], &logits);
            let mut out = g.zeros(DType::I32, Shape::new(vec![1]).unwrap()).unwrap();
            g.sample(&mut lt, penalized, &params, &mut out).unwrap();
            let got = read_i32(&g, &out)[0] as u32;
            if penalized.is_empty() {
                assert_eq!(
                    read(&g, &lt),
                    logits,
                    "vocab {vocab} case {case}: logits changed"
                );
            }
            trials += 1;
            if got == want {
                exact += 1;
                continue;
            }
            // f32 sums on the device against f64 on the host: a different token only
            // where the draw or top-p sits at a boundary.
            let nudged = [(-1e-4, 0.0), (1e-4, 0.0), (0.0, -1e-4), (0.0, 1e-4)]
                .iter()
                .any(|&(dd, dp)| {
                    let p = SampleParams {
                        draw: (params.draw + dd).clamp(0.0, 0.999_999),
                        top_p: if params.top_p < 1.0 {
                            params.top_p + dp
                        } else {
                            1.0
                        },
                        ..params.clone()
                    };
                    pick(&mut logits.clone(), penalized, &p) == got
                });
            assert!(
                nudged,
                "vocab {vocab} case {case} {params:?}: device {got}, host {want}"
            );
        }
    }
    assert!(exact * 100 >= trials * 95, "{exact} of {trials} exact");
    // Top-k off (the whole vocabulary) is drawn by the host reference: exact.
    let logits = random(5000, &mut rng, 4.0);
    let params = SampleParams {
        temperature: 1.0,
        top_k: 0,
        top_p: 0.95,
        min_p: 0.0,
        repeat_penalty: 1.0,
        draw: 0.37,
    };
    let mut lt = upload(&g, DType::F32, &[1, 5000], &logits);
    let mut out = g.zeros(DType::I32, Shape::new(vec![1]).unwrap()).unwrap();
    g.sample(&mut lt, &[], &params, &mut out).unwrap();
    assert_eq!(
        read_i32(&g, &out)[0] as u32,
        pick(&mut logits.clone(), &[], &params)
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn prompt_gemms_read_what_the_kernels_before_them_wrote() {
    // cuBLAS runs right after kiln's own kernels (weights decoded to f16, x rounded),
    // which let their successor start early; each product must still see their output.
    let g = gpu();
    let mut rng = StdRng::seed_from_u64(13);
    let (m, k, n) = (2048, 2048, 12);
    for round in 0..12 {
        let dtype = [DType::Q6_K, DType::Q4_K, DType::Q8_0][round % 3];
        let w_vals = random(m * k, &mut rng, 1.0);
        let x_vals = random(n * k, &mut rng, 1.0);
        let w = upload(&g, dtype, &[m, k], &w_vals);
        let x = upload(&g, DType::F32, &[n, k], &x_vals);
        let mut out = poisoned(&g, &[n, m]);
        g.matmul(&x, &w, &mut out).unwrap();
        let got = read(&g, &out);
        let wq = stored(dtype, &w_vals);
        for idx in (0..n * m).step_by(97) {
            let (r, c) = (idx / m, idx % m);
            let (dot, mag) = dot_f64(&x_vals, &wq, k, r, c);
            let v = got[idx] as f64;
            assert!(
                (v - dot).abs() <= 1e-3 * mag,
                "round {round} {dtype} [{r},{c}]: got {v}, want {dot}"
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn norms_fused_into_matmuls_match_the_plain_sequence() {
    use kiln_core::RmsNorm;
    let g = gpu();
    let mut rng = StdRng::seed_from_u64(14);
    let (k, m) = (512, 96);
    // The three projections of one type, or of two (Q4_K_M's Q6_K values).
    for dtypes in [
        [DType::Q4_K; 3],
        [DType::Q4_K, DType::Q4_K, DType::Q6_K],
        [DType::Q8_0; 3],
        [DType::F16; 3],
    ] {
        for n in [1, 3, 12] {
            let x = upload(&g, DType::F32, &[n, k], &random(n * k, &mut rng, 2.0));
            let weight = upload(&g, DType::F32, &[k], &random(k, &mut rng, 1.5));
            let norm = RmsNorm {
                x: &x,
                weight: &weight,
                eps: 1e-5,
            };
            let mut plain_normed = poisoned(&g, &[n, k]);
            g.rms_norm(&x, &weight, 1e-5, &mut plain_normed).unwrap();
            let ws: Vec<Tensor> = dtypes
                .iter()
                .map(|&dt| upload(&g, dt, &[m, k], &random(m * k, &mut rng, 1.0)))
                .collect();
            let what = format!("{dtypes:?} n={n}");

            let mut normed = poisoned(&g, &[n, k]);
            let mut outs: Vec<Tensor> = (0..3).map(|_| poisoned(&g, &[n, m])).collect();
            {
                let [o0, o1, o2] = &mut outs[..] else {
                    unreachable!()
                };
                g.rms_norm_matmul_many(
                    &norm,
                    &mut normed,
                    &[&ws[0], &ws[1], &ws[2]],
                    &mut [o0, o1, o2],
                )
                .unwrap();
            }
            assert_close(&read(&g, &normed), &read(&g, &plain_normed), 0.0, &what);
            for (i, w) in ws.iter().enumerate() {
                let mut one = poisoned(&g, &[n, m]);
                g.matmul(&plain_normed, w, &mut one).unwrap();
                assert_close(
                    &read(&g, &outs[i]),
                    &read(&g, &one),
                    1e-6,
                    &format!("{what} #{i}"),
                );
            }

            let mut normed = poisoned(&g, &[n, k]);
            let mut out = poisoned(&g, &[n, m]);
            let (mut tg, mut tu) = (poisoned(&g, &[n, m]), poisoned(&g, &[n, m]));
            g.rms_norm_gated_ffn(
                &norm,
                &mut normed,
                &ws[0],
                &ws[1],
                false,
                &mut out,
                &mut tg,
                &mut tu,
            )
            .unwrap();
            let mut want = poisoned(&g, &[n, m]);
            let (mut pg, mut pu) = (poisoned(&g, &[n, m]), poisoned(&g, &[n, m]));
            g.gated_ffn(
                &plain_normed,
                &ws[0],
                &ws[1],
                false,
                &mut want,
                &mut pg,
                &mut pu,
            )
            .unwrap();
            assert_close(&read(&g, &normed), &read(&g, &plain_normed), 0.0, &what);
            assert_close(
                &read(&g, &out),
                &read(&g, &want),
                1e-6,
                &format!("{what} ffn"),
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn attention_output_feeds_the_next_matvec_as_int8() {
    // Attention also writes its output as int8 rows for the quantized projection after
    // it; that copy must give what rounding the output afresh gives, and must not be
    // used once anything else has run.
    let g = gpu();
    let mut rng = StdRng::seed_from_u64(15);
    // (queries, heads, kv_heads, head_dim, capacity, first position): one split, several
    for (n, heads, kvh, hd, cap, p0) in [(1, 8, 2, 64, 40, 30), (2, 4, 4, 128, 700, 600)] {
        let qt = upload(
            &g,
            DType::F32,
            &[n, heads, hd],
            &random(n * heads * hd, &mut rng, 1.0),
        );
        let kt = upload(
            &g,
            DType::F32,
            &[cap, kvh, hd],
            &random(cap * kvh * hd, &mut rng, 1.0),
        );
        let vt = upload(
            &g,
            DType::F32,
            &[cap, kvh, hd],
            &random(cap * kvh * hd, &mut rng, 1.0),
        );
        let positions: Vec<i32> = (p0..p0 + n).map(|p| p as i32).collect();
        let pos = indices(&g, &positions);
        let params = AttentionParams {
            scale: 1.0 / (hd as f32).sqrt(),
            softcap: None,
            window: None,
        };
        let (k, m) = (heads * hd, 72);
        for dtype in [DType::Q4_K, DType::Q8_0, DType::Q6_K] {
            let w = upload(&g, dtype, &[m, k], &random(m * k, &mut rng, 1.0));
            let what = format!("{dtype} n={n} hd={hd}");
            let mut attn = poisoned(&g, &[n, heads, hd]);
            g.attention(&qt, &kt, &vt, &pos, &params, &mut attn)
                .unwrap();
            attn.reshape(Shape::new(vec![n, k]).unwrap()).unwrap();
            let mut fused = poisoned(&g, &[n, m]);
            g.matmul(&attn, &w, &mut fused).unwrap();
            // The same values in a fresh tensor: rounded by the matmul itself.
            let fresh = upload(&g, DType::F32, &[n, k], &read(&g, &attn));
            let mut want = poisoned(&g, &[n, m]);
            g.matmul(&fresh, &w, &mut want).unwrap();
            assert_close(&read(&g, &fused), &read(&g, &want), 1e-6, &what);
            // Attention, then an op on its output: the int8 copy is stale.
            attn.reshape(Shape::new(vec![n, heads, hd]).unwrap())
                .unwrap();
            g.attention(&qt, &kt, &vt, &pos, &params, &mut attn)
                .unwrap();
            attn.reshape(Shape::new(vec![n, k]).unwrap()).unwrap();
            g.scale(&mut attn, 2.0).unwrap();
            let mut scaled = poisoned(&g, &[n, m]);
            g.matmul(&attn, &w, &mut scaled).unwrap();
            let twice: Vec<f32> = read(&g, &want).iter().map(|v| 2.0 * v).collect();
            assert_close(
                &read(&g, &scaled),
                &twice,
                1e-5,
                &format!("{what} after scale"),
            );
        }
    }
}
