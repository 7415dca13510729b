//! The fused ops (a backend may override each default), against the same float64
//! references as the plain products. Where an op also writes the normed row, the products
//! are checked on the row it wrote (checked itself against float64), as the backend rounds it.

use crate::cases::products::check_matmul_add;
use crate::reference::{self, assert_close};
use crate::rounding::{assert_products, gated, products, Expected};
use crate::target::{random, shape, stored, Target};
use kiln_core::{AttentionParams, DType, HostBytes, RmsNorm, Shape, Tensor};

/// The weights' dtypes the fused cases take: F16, a 32-block and a K format (Q4_K_M's
/// projections mix Q4_K and Q6_K).
const FUSED_DTYPES: [DType; 5] = [
    DType::F32,
    DType::F16,
    DType::Q8_0,
    DType::Q4_K,
    DType::Q6_K,
];

pub fn matmul_add(t: &Target) {
    let (m, k) = (70, 512);
    for (d, dtype) in [
        DType::F16,
        DType::Q4_0,
        DType::Q6_K,
        DType::Q8_0,
        DType::Q4_K,
    ]
    .into_iter()
    .enumerate()
    {
        for n in [1, 3, 8, 20, 130] {
            check_matmul_add(t, dtype, n, m, k, (d * 1000 + n) as u64);
        }
    }
}

/// Several weights of different heights reading one x (Q, K and V).
pub fn matmul_many(t: &Target) {
    let (m, k) = (96, 512);
    for (d, dtype) in FUSED_DTYPES.into_iter().enumerate() {
        for n in [1, 3, 8, 20] {
            let mut rng = t.rng((d * 1000 + n) as u64);
            let xv = random(&mut rng, n * k, 1.0);
            let x = t.upload(DType::F32, &[n, k], &xv);
            let values: Vec<Vec<f32>> = (0..3)
                .map(|i| random(&mut rng, (m + 32 * i) * k, 1.0))
                .collect();
            let ws: Vec<Tensor> = values
                .iter()
                .enumerate()
                .map(|(i, v)| t.upload(dtype, &[m + 32 * i, k], v))
                .collect();
            let what = format!("{dtype} n={n}");
            check_matmul_many(t, (&x, &xv), &ws, &values, [0, 1, 2], &what);
        }
    }
}

/// K and V of one shape after a taller Q, 16-bit weights, past the few-row kernels (a
/// backend may run K and V as one product), in both orders of the pair.
pub fn matmul_many_pair(t: &Target) {
    let k = 512;
    let heights = [160, 64, 64];
    for (d, dtype) in [DType::F16, DType::BF16].into_iter().enumerate() {
        for n in [20, 64] {
            let mut rng = t.rng((d * 1000 + n) as u64 + 77);
            let xv = random(&mut rng, n * k, 1.0);
            let x = t.upload(DType::F32, &[n, k], &xv);
            let values: Vec<Vec<f32>> = heights
                .iter()
                .map(|m| random(&mut rng, m * k, 1.0))
                .collect();
            let ws: Vec<Tensor> = values
                .iter()
                .zip(heights)
                .map(|(v, m)| t.upload(dtype, &[m, k], v))
                .collect();
            for order in [[0, 1, 2], [0, 2, 1]] {
                let what = format!("{dtype} n={n} order={order:?}");
                check_matmul_many(t, (&x, &xv), &ws, &values, order, &what);
            }
        }
    }
}

/// Q, K and V uploaded together ([`kiln_core::Backend::upload_together`]: a backend may lay
/// them end to end and run one product over them), every row count from one to past a
/// prompt chunk, against the float64 products; each weight reads back as uploaded. Also
/// parts that cannot lie end to end aligned (a few short rows).
pub fn matmul_many_uploaded_together(t: &Target) {
    for (d, dtype) in [DType::F16, DType::BF16, DType::F32, DType::Q8_0]
        .into_iter()
        .enumerate()
    {
        for (k, heights) in [(512, [160, 64, 64]), (64, [3, 5, 7])] {
            let mut rng = t.rng((d * 1000 + k) as u64 + 91);
            let values: Vec<Vec<f32>> = heights
                .iter()
                .map(|m| random(&mut rng, m * k, 1.0))
                .collect();
            let ws = upload_together(t, &[dtype; 3], &values, k);
            for (i, (w, v)) in ws.iter().zip(&values).enumerate() {
                assert_eq!(w.shape().dims(), [heights[i], k]);
                assert_eq!(t.read_decoded(w), stored(dtype, v), "{dtype} k={k} #{i}");
            }
            for n in [1, 3, 20, 64, 130] {
                let xv = random(&mut rng, n * k, 1.0);
                let x = t.upload(DType::F32, &[n, k], &xv);
                // Handed over in another order, the weights no longer lie end to end.
                for order in [[0, 1, 2], [0, 2, 1]] {
                    let what = format!("{dtype} k={k} n={n} order={order:?}");
                    check_matmul_many(t, (&x, &xv), &ws, &values, order, &what);
                }
            }
        }
    }
}

/// `values[i]` (rows of `k`) stored as `dtypes[i]` through `upload_together`.
fn upload_together(t: &Target, dtypes: &[DType], values: &[Vec<f32>], k: usize) -> Vec<Tensor> {
    let parts = dtypes
        .iter()
        .zip(values)
        .map(|(&dtype, v)| {
            let bytes = kiln_core::quant::quantize(dtype, v).unwrap();
            (dtype, shape(&[v.len() / k, k]), HostBytes::from_vec(bytes))
        })
        .collect();
    let ws = t.backend.upload_together(parts).unwrap();
    assert_eq!(ws.len(), values.len(), "a tensor for each part");
    ws
}

/// `matmul_many` of `x` (its values `xv`) over the three weights `ws` (made from `values`),
/// handed to the op in `order`, into poisoned outputs, each checked against its float64
/// products.
fn check_matmul_many(
    t: &Target,
    (x, xv): (&Tensor, &[f32]),
    ws: &[Tensor],
    values: &[Vec<f32>],
    order: [usize; 3],
    what: &str,
) {
    let (n, k) = (x.shape().rows(), x.shape().row_len());
    let mut outs: Vec<Tensor> = ws
        .iter()
        .map(|w| t.poisoned(&[n, w.shape().rows()]))
        .collect();
    let [o0, o1, o2] = &mut outs[..] else {
        panic!("three weights, {} given", ws.len())
    };
    let mut by_index = [Some(o0), Some(o1), Some(o2)];
    let [a, b, c] = order.map(|i| by_index[i].take().expect("an order of 0, 1 and 2"));
    let [wa, wb, wc] = order.map(|i| &ws[i]);
    t.backend
        .matmul_many(x, &[wa, wb, wc], &mut [a, b, c])
        .unwrap();
    for (i, (v, out)) in values.iter().zip(&outs).enumerate() {
        let dtype = ws[i].dtype();
        let want = products(xv, &stored(dtype, v), k, t.rounding(dtype, n, k));
        assert_products(&t.read(out), &want, &format!("{what} #{i}"));
    }
}

/// `act(x · gateᵀ) · (x · upᵀ)` against the float64 products of `x`.
fn gated_want(
    t: &Target,
    x: &[f32],
    (dtype, gate, up): (DType, &[f32], &[f32]),
    k: usize,
    gelu: bool,
) -> Vec<Expected> {
    let rounding = t.rounding(dtype, x.len() / k, k);
    let g = products(x, &stored(dtype, gate), k, rounding);
    let u = products(x, &stored(dtype, up), k, rounding);
    g.into_iter()
        .zip(u)
        .map(|(g, u)| gated(g, u, gelu))
        .collect()
}

pub fn gated_ffn(t: &Target) {
    let (m, k) = (100, 512);
    for (d, dtype) in FUSED_DTYPES.into_iter().enumerate() {
        for n in [1, 5, 20] {
            let mut rng = t.rng((d * 1000 + n) as u64);
            let xv = random(&mut rng, n * k, 1.0);
            let (gv, uv) = (random(&mut rng, m * k, 1.0), random(&mut rng, m * k, 1.0));
            let x = t.upload(DType::F32, &[n, k], &xv);
            let (gate, up) = (t.upload(dtype, &[m, k], &gv), t.upload(dtype, &[m, k], &uv));
            for gelu in [false, true] {
                let mut out = t.poisoned(&[n, m]);
                let (mut tg, mut tu) = (t.poisoned(&[n, m]), t.poisoned(&[n, m]));
                t.backend
                    .gated_ffn(&x, &gate, &up, gelu, &mut out, &mut tg, &mut tu)
                    .unwrap();
                let want = gated_want(t, &xv, (dtype, &gv, &uv), k, gelu);
                assert_products(&t.read(&out), &want, &format!("{dtype} n={n} gelu={gelu}"));
            }
        }
    }
}

/// The norm's inputs for the fused-norm cases: x, its norm weight, and the float64 normed row.
struct NormInput {
    x: Tensor,
    weight: Tensor,
    want: Vec<f64>,
}

fn norm_input(t: &Target, rng: &mut rand::rngs::StdRng, n: usize, k: usize) -> NormInput {
    let xv = random(rng, n * k, 2.0);
    let nv = random(rng, k, 1.5);
    NormInput {
        x: t.upload(DType::F32, &[n, k], &xv),
        weight: t.upload(DType::F32, &[k], &nv),
        want: reference::rms_norm(&xv, &nv, 1e-5),
    }
}

/// The normed row the backend wrote, checked against float64.
fn normed_row(t: &Target, normed: &Tensor, input: &NormInput, what: &str) -> Vec<f32> {
    let got = t.read(normed);
    assert_close(&got, &input.want, 1e-5, &format!("{what}: normed"));
    got
}

/// Q, K and V of one dtype or of two (Q4_K_M's V in Q6_K), small and at model widths.
pub fn rms_norm_matmul_many(t: &Target) {
    // (dtypes, n, m, k, uploaded together)
    let mut cases: Vec<([DType; 3], usize, usize, usize, bool)> = Vec::new();
    for dtypes in [
        [DType::Q4_K; 3],
        [DType::Q4_K, DType::Q4_K, DType::Q6_K],
        [DType::Q8_0; 3],
        [DType::F16; 3],
        [DType::BF16; 3],
    ] {
        for n in [1, 3, 12] {
            cases.push((dtypes, n, 96, 512, false));
        }
    }
    // 16-bit weights uploaded together (a backend may read them as one matrix), past the
    // few-row kernels: the norm's rounded row feeding that product.
    for dtypes in [[DType::F16; 3], [DType::BF16; 3]] {
        for n in [20, 64] {
            cases.push((dtypes, n, 96, 512, true));
        }
    }
    // One row at model widths: every workgroup that rounds the row finds the norm alone.
    for dtype in [
        DType::F16,
        DType::Q8_0,
        DType::Q4_0,
        DType::Q4_K,
        DType::Q6_K,
    ] {
        for k in [2048, 14336] {
            cases.push(([dtype; 3], 1, 37, k, false));
        }
    }
    for (c, (dtypes, n, m, k, together)) in cases.into_iter().enumerate() {
        let mut rng = t.rng(c as u64);
        let input = norm_input(t, &mut rng, n, k);
        let values: Vec<Vec<f32>> = (0..3).map(|_| random(&mut rng, m * k, 1.0)).collect();
        let ws: Vec<Tensor> = if together {
            upload_together(t, &dtypes, &values, k)
        } else {
            dtypes
                .iter()
                .zip(&values)
                .map(|(&d, v)| t.upload(d, &[m, k], v))
                .collect()
        };
        let mut normed = t.poisoned(&[n, k]);
        let mut outs: Vec<Tensor> = (0..3).map(|_| t.poisoned(&[n, m])).collect();
        let norm = RmsNorm {
            x: &input.x,
            weight: &input.weight,
            eps: 1e-5,
        };
        let [o0, o1, o2] = &mut outs[..] else {
            unreachable!()
        };
        t.backend
            .rms_norm_matmul_many(
                &norm,
                &mut normed,
                &[&ws[0], &ws[1], &ws[2]],
                &mut [o0, o1, o2],
            )
            .unwrap();
        let what = format!("{dtypes:?} n={n} k={k} together={together}");
        let row = normed_row(t, &normed, &input, &what);
        for (i, ((&dtype, v), out)) in dtypes.iter().zip(&values).zip(&outs).enumerate() {
            let want = products(&row, &stored(dtype, v), k, t.rounding(dtype, n, k));
            assert_products(&t.read(out), &want, &format!("{what} #{i}"));
        }
    }
}

pub fn rms_norm_gated_ffn(t: &Target) {
    let (m, k) = (100, 512);
    for (d, dtype) in FUSED_DTYPES.into_iter().enumerate() {
        for n in [1, 3, 12] {
            let mut rng = t.rng((d * 1000 + n) as u64);
            let input = norm_input(t, &mut rng, n, k);
            let (gv, uv) = (random(&mut rng, m * k, 1.0), random(&mut rng, m * k, 1.0));
            let (gate, up) = (t.upload(dtype, &[m, k], &gv), t.upload(dtype, &[m, k], &uv));
            let norm = RmsNorm {
                x: &input.x,
                weight: &input.weight,
                eps: 1e-5,
            };
            for gelu in [false, true] {
                let mut normed = t.poisoned(&[n, k]);
                let mut out = t.poisoned(&[n, m]);
                let (mut tg, mut tu) = (t.poisoned(&[n, m]), t.poisoned(&[n, m]));
                t.backend
                    .rms_norm_gated_ffn(
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
                let what = format!("{dtype} n={n} gelu={gelu}");
                let row = normed_row(t, &normed, &input, &what);
                let want = gated_want(t, &row, (dtype, &gv, &uv), k, gelu);
                assert_products(&t.read(&out), &want, &what);
            }
        }
    }
}

/// Attention's output read by the next product (a backend may hand it over in the form
/// the product reads, as CUDA's int8 copy): the product must see what attention wrote,
/// and once another op has changed it, the changed values.
pub fn attention_output_feeds_a_product(t: &Target) {
    // (queries, heads, kv_heads, head_dim, capacity, first position, cache type): one
    // split, several; f32 and f16 caches (f16 the GPUs' default); a few queries (the
    // matrix-vector products, int8 for quantized weights) and more (16-bit products).
    for (c, (n, heads, kvh, hd, cap, p0, kv)) in [
        (1, 8, 2, 64, 40, 30, DType::F32),
        (2, 4, 4, 128, 700, 600, DType::F32),
        (1, 8, 2, 64, 40, 30, DType::F16),
        (2, 4, 4, 128, 700, 600, DType::F16),
        (12, 4, 4, 128, 700, 600, DType::F32),
        (12, 8, 2, 64, 40, 20, DType::F16),
    ]
    .into_iter()
    .enumerate()
    {
        let mut rng = t.rng(c as u64);
        let q = t.upload(
            DType::F32,
            &[n, heads, hd],
            &random(&mut rng, n * heads * hd, 1.0),
        );
        let kc = t.upload(
            kv,
            &[cap, kvh, hd],
            &stored(kv, &random(&mut rng, cap * kvh * hd, 1.0)),
        );
        let vc = t.upload(
            kv,
            &[cap, kvh, hd],
            &stored(kv, &random(&mut rng, cap * kvh * hd, 1.0)),
        );
        let positions: Vec<i32> = (p0..p0 + n as i32).collect();
        let pos = t.ints(&positions);
        let params = AttentionParams {
            scale: 1.0 / (hd as f32).sqrt(),
            softcap: None,
            window: None,
        };
        let (k, m) = (heads * hd, 72);
        for dtype in [DType::Q4_K, DType::Q8_0, DType::Q6_K, DType::F16] {
            let wv = random(&mut rng, m * k, 1.0);
            let (w, wd) = (t.upload(dtype, &[m, k], &wv), stored(dtype, &wv));
            let rounding = t.rounding(dtype, n, k);
            let what = format!("{dtype} n={n} hd={hd} over a {kv} cache");
            let mut attn = t.poisoned(&[n, heads, hd]);
            // Made first, as a model's scratch is, so that nothing runs between the two
            // ops (a backend may hand the output over only then).
            let mut out = t.poisoned(&[n, m]);
            t.backend
                .attention(&q, &kc, &vc, &pos, &params, &mut attn)
                .unwrap();
            attn.reshape(Shape::new(vec![n, k]).unwrap()).unwrap();
            t.backend.matmul(&attn, &w, &mut out).unwrap();
            let seen = t.read(&attn);
            assert_products(&t.read(&out), &products(&seen, &wd, k, rounding), &what);
            // Attention, then an op on its output before the product.
            attn.reshape(Shape::new(vec![n, heads, hd]).unwrap())
                .unwrap();
            t.backend
                .attention(&q, &kc, &vc, &pos, &params, &mut attn)
                .unwrap();
            attn.reshape(Shape::new(vec![n, k]).unwrap()).unwrap();
            t.backend.scale(&mut attn, 2.0).unwrap();
            t.backend.matmul(&attn, &w, &mut out).unwrap();
            let doubled: Vec<f32> = seen.iter().map(|v| 2.0 * v).collect();
            assert_products(
                &t.read(&out),
                &products(&doubled, &wd, k, rounding),
                &format!("{what} after scale"),
            );
        }
    }
}
