//! Training's F32-weight products in each arithmetic `GradOps::set_products` offers, against
//! float64 over the inputs rounded as that arithmetic rounds them: the sums must be F32's,
//! and the rounding must really happen. Needs a GPU (ignored in CI).

use half::bf16;
mod common;

use common::{read, upload_f32 as upload, upload_i32};
use kiln_core::{Backend, GradInto, Products};
use kiln_cuda::CudaBackend;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// `x · wᵀ` in float64 over `round`ed inputs, and Σ|x·w| per output.
fn reference(x: &[f32], w: &[f32], k: usize, round: fn(f32) -> f32) -> (Vec<f64>, Vec<f64>) {
    let (mut out, mut abs) = (Vec::new(), Vec::new());
    for xr in x.chunks_exact(k) {
        for wr in w.chunks_exact(k) {
            let (mut s, mut a) = (0f64, 0f64);
            for (&p, &q) in xr.iter().zip(wr) {
                let t = round(p) as f64 * round(q) as f64;
                s += t;
                a += t.abs();
            }
            out.push(s);
            abs.push(a);
        }
    }
    (out, abs)
}

#[test]
#[ignore = "needs a CUDA device"]
fn bf16_products_round_their_inputs_and_sum_in_f32() {
    let b = CudaBackend::new(0).unwrap_or_else(|e| panic!("no CUDA backend: {e}"));
    let mut rng = StdRng::seed_from_u64(0xbf16);
    // Rows past the one-row kernels (cuBLAS), awkward sizes.
    let (n, m, k) = (37, 53, 301);
    let x: Vec<f32> = (0..n * k).map(|_| rng.random_range(-2.0..2.0)).collect();
    let w: Vec<f32> = (0..m * k).map(|_| rng.random_range(-1.0..1.0)).collect();
    let (xt, wt) = (upload(&b, &[n, k], &x), upload(&b, &[m, k], &w));
    let mut out = upload(&b, &[n, m], &vec![f32::NAN; n * m]);
    let grad = b.grad().expect("CUDA trains");
    grad.set_products(Products::Bf16).unwrap();
    let run = b.matmul(&xt, &wt, &mut out);
    grad.set_products(Products::F32).unwrap();
    run.unwrap();
    let got = read(&b, &out);
    let (want, abs) = reference(&x, &w, k, |v| bf16::from_f32(v).to_f32());
    let (exact, _) = reference(&x, &w, k, |v| v);
    let mut moved = 0f64;
    for i in 0..n * m {
        let err = (got[i] as f64 - want[i]).abs();
        assert!(
            err <= 1e-5 * abs[i],
            "[{i}]: {} against {} over BF16 inputs (Σ|xw| {})",
            got[i],
            want[i],
            abs[i]
        );
        moved = moved.max((got[i] as f64 - exact[i]).abs() / abs[i]);
    }
    // BF16 keeps 8 bits: unrounded inputs would land within F32's error of `exact`.
    assert!(
        moved > 1e-4,
        "the products are F32's: the setting did nothing ({moved:e})"
    );
}

/// A product's rounded operand is reused by the next product over the same operand (the
/// key projection after the query's), but never once anything has been queued since: an
/// operand scaled in place by a kernel, or written from the host, is rounded again.
#[test]
#[ignore = "needs a CUDA device"]
fn a_rounded_operand_is_reused_only_while_nothing_else_ran() {
    let b = CudaBackend::new(0).unwrap_or_else(|e| panic!("no CUDA backend: {e}"));
    let mut rng = StdRng::seed_from_u64(0x5eed);
    let (n, m, k) = (37, 53, 301);
    let mut x: Vec<f32> = (0..n * k).map(|_| rng.random_range(-2.0..2.0)).collect();
    let w1: Vec<f32> = (0..m * k).map(|_| rng.random_range(-1.0..1.0)).collect();
    let w2: Vec<f32> = (0..m * k).map(|_| rng.random_range(-1.0..1.0)).collect();
    let mut xt = upload(&b, &[n, k], &x);
    let (w1t, w2t) = (upload(&b, &[m, k], &w1), upload(&b, &[m, k], &w2));
    let grad = b.grad().expect("CUDA trains");
    let round = |v: f32| bf16::from_f32(v).to_f32();
    let check = |what: &str, got: &[f32], x: &[f32], w: &[f32]| {
        let (want, abs) = reference(x, w, k, round);
        for i in 0..n * m {
            assert!(
                (got[i] as f64 - want[i]).abs() <= 1e-5 * abs[i],
                "{what} [{i}]: {} against {}",
                got[i],
                want[i]
            );
        }
    };
    grad.set_products(Products::Bf16).unwrap();
    let product = |x: &kiln_core::Tensor, w: &kiln_core::Tensor| {
        let mut out = upload(&b, &[n, m], &vec![f32::NAN; n * m]);
        b.matmul(x, w, &mut out).unwrap();
        read(&b, &out)
    };
    let first = product(&xt, &w1t);
    let second = product(&xt, &w2t);
    // A kernel scales x in place: the next product must see it.
    b.scale(&mut xt, 2.0).unwrap();
    let scaled = product(&xt, &w2t);
    // The host writes new values: likewise.
    for v in x.iter_mut() {
        *v = -*v * 0.5;
    }
    let bytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
    b.write(&mut xt, &bytes).unwrap();
    let written = product(&xt, &w2t);
    grad.set_products(Products::F32).unwrap();
    let x0: Vec<f32> = x.iter().map(|v| -2.0 * v).collect();
    check("first", &first, &x0, &w1);
    check("second, the operand reused", &second, &x0, &w2);
    let doubled: Vec<f32> = x0.iter().map(|v| 2.0 * v).collect();
    check("after a kernel scaled x", &scaled, &doubled, &w2);
    check("after the host wrote x", &written, &x, &w2);
}

/// Causal grouped-query attention in float64 over `round`ed keys and values: `q` [n,
/// heads, d] at `pos`, row t of sequence `seq[t]` seeing that sequence's keys 0..=pos[t]
/// (`k`, `v` [sequence][position][kv_heads, d]).
#[allow(clippy::too_many_arguments)]
fn attention_reference(
    q: &[f32],
    k: &[Vec<f32>],
    v: &[Vec<f32>],
    pos: &[usize],
    seq: &[usize],
    (heads, kv_heads, d): (usize, usize, usize),
    scale: f64,
    round: fn(f32) -> f32,
) -> Vec<f64> {
    let mut out = Vec::with_capacity(q.len());
    for (t, (&p, &s)) in pos.iter().zip(seq).enumerate() {
        for h in 0..heads {
            let kvh = h / (heads / kv_heads);
            let qr = &q[(t * heads + h) * d..][..d];
            let at = |j: usize| (j * kv_heads + kvh) * d;
            let scores: Vec<f64> = (0..=p)
                .map(|j| {
                    let kr = &k[s][at(j)..][..d];
                    scale
                        * qr.iter()
                            .zip(kr)
                            .map(|(&a, &b)| a as f64 * round(b) as f64)
                            .sum::<f64>()
                })
                .collect();
            let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = scores.iter().map(|x| (x - max).exp()).collect();
            let total: f64 = e.iter().sum();
            for c in 0..d {
                let sum: f64 = (0..=p).map(|j| e[j] * round(v[s][at(j) + c]) as f64).sum();
                out.push(sum / total);
            }
        }
    }
    out
}

/// Training's attention over its F32 pool runs on tensor cores once the products round
/// their inputs: queries (times the scale and log2(e)), keys and values rounded to f16, and the
/// probabilities rounded to f16 for the value sum, so the result is float64's over the
/// rounded queries, keys and values within what rounding the probabilities moves (a unit
/// of f16's last place of the largest value), and not float64's over the exact ones.
/// Under F32 products the pool keeps the F32 kernel.
#[test]
#[ignore = "needs a CUDA device"]
fn attention_over_an_f32_pool_rounds_keys_and_values_only_under_rounded_products() {
    let b = CudaBackend::new(0).unwrap_or_else(|e| panic!("no CUDA backend: {e}"));
    let mut rng = StdRng::seed_from_u64(0xa77e);
    let (heads, kv_heads, block) = (4, 2, 16);
    for d in [64, 128] {
        // Two prompts of awkward lengths, their blocks out of order in a pool of 12.
        let runs = [70usize, 45];
        let tables: [&[i32]; 2] = [&[7, 2, 9, 0, 5], &[3, 11, 1]];
        let (pool_blocks, width) = (12, kv_heads * d);
        let mut pool_k = vec![0f32; pool_blocks * block * width];
        let mut pool_v = pool_k.clone();
        let (mut k, mut v) = (Vec::new(), Vec::new());
        let (mut pos, mut seq) = (Vec::new(), Vec::new());
        for (s, &r) in runs.iter().enumerate() {
            let ks: Vec<f32> = (0..r * width)
                .map(|_| rng.random_range(-2.0..2.0))
                .collect();
            let vs: Vec<f32> = (0..r * width)
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            for p in 0..r {
                let row = tables[s][p / block] as usize * block + p % block;
                pool_k[row * width..][..width].copy_from_slice(&ks[p * width..][..width]);
                pool_v[row * width..][..width].copy_from_slice(&vs[p * width..][..width]);
                pos.push(p);
                seq.push(s);
            }
            k.push(ks);
            v.push(vs);
        }
        let n = pos.len();
        let q: Vec<f32> = (0..n * heads * d)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let qt = upload(&b, &[n, heads, d], &q);
        let kt = upload(&b, &[pool_blocks * block, kv_heads, d], &pool_k);
        let vt = upload(&b, &[pool_blocks * block, kv_heads, d], &pool_v);
        let pos_t = upload_i32(&b, &[n], &pos.iter().map(|&p| p as i32).collect::<Vec<_>>());
        let seq_t = upload_i32(&b, &[n], &seq.iter().map(|&s| s as i32).collect::<Vec<_>>());
        let mut flat_tables = vec![0i32; 2 * 5];
        flat_tables[..5].copy_from_slice(tables[0]);
        flat_tables[5..8].copy_from_slice(tables[1]);
        let tables_t = upload_i32(&b, &[2, 5], &flat_tables);
        let scale = 1.0 / (d as f32).sqrt();
        let params = kiln_core::AttentionParams {
            scale,
            softcap: None,
            window: None,
        };
        let run = |how: Products| {
            b.grad().unwrap().set_products(how).unwrap();
            let mut out = upload(&b, &[n, heads, d], &vec![f32::NAN; n * heads * d]);
            let pages = kiln_core::Pages {
                seq: &seq_t,
                tables: &tables_t,
                block,
                runs: &runs,
            };
            let done = b.paged_attention(&qt, &kt, &vt, &pos_t, &pages, &params, &mut out);
            b.grad().unwrap().set_products(Products::F32).unwrap();
            done.unwrap();
            read(&b, &out)
        };
        let shape = (heads, kv_heads, d);
        let exact = attention_reference(&q, &k, &v, &pos, &seq, shape, scale as f64, |x| x);
        let to_f16 = |x: f32| half::f16::from_f32(x).to_f32();
        // The kernels work in log2 units: queries times scale · log2(e) rounded to f16.
        let log2e = std::f32::consts::LOG2_E;
        let q_scaled: Vec<f32> = q
            .iter()
            .map(|&x| to_f16(x * (scale * log2e)) / log2e)
            .collect();
        let rounded = attention_reference(&q_scaled, &k, &v, &pos, &seq, shape, 1.0, to_f16);
        let worst = |got: &[f32], want: &[f64]| {
            got.iter()
                .zip(want)
                .map(|(&g, &w)| (g as f64 - w).abs())
                .fold(0f64, f64::max)
        };
        let f32_run = run(Products::F32);
        let tf32_run = run(Products::Tf32);
        let (f32_err, tf32_err) = (worst(&f32_run, &exact), worst(&tf32_run, &rounded));
        let tf32_exact_err = worst(&tf32_run, &exact);
        eprintln!(
            "d {d}: F32 products {f32_err:e} from float64; TF32 {tf32_err:e} from float64 over f16 queries, keys and values, {tf32_exact_err:e} from the exact"
        );
        // Outputs are means of values in [-1, 1]: F32's sums leave ~1e-6, probabilities
        // rounded to f16 at most 2^-11 of them.
        assert!(f32_err < 1e-5, "d {d}: the F32 kernel is {f32_err:e} off");
        assert!(
            tf32_err < 2f64.powi(-11) + 1e-5,
            "d {d}: tensor cores are {tf32_err:e} off the rounded reference"
        );
        assert!(
            tf32_exact_err > 2.0 * tf32_err,
            "d {d}: the operands were not rounded ({tf32_exact_err:e} from the exact result)"
        );
    }
}

/// The attention backward under BF16 and F16 products reads 16-bit operands (the scores
/// from rounded queries and keys, the probabilities and score gradients rounded by the
/// softmax backward): its gradients stay within a 16-bit format's error of the F32
/// products' (a few of its 8 or 11 significant bits), and are not the F32 ones.
#[test]
#[ignore = "needs a CUDA device"]
fn the_attention_backward_under_16_bit_products_stays_near_f32() {
    let b = CudaBackend::new(0).unwrap_or_else(|e| panic!("no CUDA backend: {e}"));
    let mut rng = StdRng::seed_from_u64(0xa77);
    let (n, heads, kv_heads, d) = (70, 4, 2, 64);
    let values = |rng: &mut StdRng, len: usize| -> Vec<f32> {
        (0..len).map(|_| rng.random_range(-1.0..1.0)).collect()
    };
    let (q, k, v, dout) = (
        values(&mut rng, n * heads * d),
        values(&mut rng, n * kv_heads * d),
        values(&mut rng, n * kv_heads * d),
        values(&mut rng, n * heads * d),
    );
    let pos = upload_i32(&b, &[n], &(0..n as i32).collect::<Vec<_>>());
    let params = kiln_core::AttentionParams {
        scale: 0.125,
        softcap: None,
        window: None,
    };
    let grad = b.grad().expect("CUDA trains");
    let run = |how: Products| {
        grad.set_products(how).unwrap();
        let (qd, kd) = ([n, heads, d], [n, kv_heads, d]);
        let (mut dq, mut dk, mut dv) = (
            upload(&b, &qd, &vec![0.0; n * heads * d]),
            upload(&b, &kd, &vec![0.0; n * kv_heads * d]),
            upload(&b, &kd, &vec![0.0; n * kv_heads * d]),
        );
        let done = grad.attention_backward(
            &upload(&b, &qd, &q),
            &upload(&b, &kd, &k),
            &upload(&b, &kd, &v),
            &pos,
            &params,
            &upload(&b, &qd, &dout),
            &mut dq,
            &mut dk,
            &mut dv,
        );
        grad.set_products(Products::F32).unwrap();
        done.unwrap();
        [read(&b, &dq), read(&b, &dk), read(&b, &dv)]
    };
    let exact = run(Products::F32);
    for (how, bits) in [(Products::Bf16, 8), (Products::F16, 11)] {
        let got = run(how);
        for (name, (g, e)) in ["dq", "dk", "dv"].iter().zip(got.iter().zip(&exact)) {
            let largest = e.iter().fold(0f32, |m, x| m.max(x.abs()));
            let off = g.iter().zip(e).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / largest;
            eprintln!(
                "{} {name}: {off:e} of the largest gradient off F32's",
                how.name()
            );
            // Each operand rounded once, sums of up to 70 terms: a few units of the
            // format's last place.
            let unit = 2f32.powi(-bits);
            assert!(
                off <= 16.0 * unit,
                "{} {name}: {off:e} off F32's",
                how.name()
            );
            assert!(
                off > 1e-3 * unit,
                "{} {name}: the operands were not rounded",
                how.name()
            );
        }
    }
}

/// What the tape keeps of a matmul's input under 16-bit products, the input rounded as
/// the products round it: a weight gradient over it is the one over the F32 input, to the
/// bit, and a forward product over the input just kept (which reads the kept copy instead
/// of rounding again) is the one it would be. Under F32 and TF32 products nothing is
/// rounded: the tape keeps F32.
#[test]
#[ignore = "needs a CUDA device"]
fn a_kept_rounded_input_gives_the_products_of_the_f32_one() {
    let b = CudaBackend::new(0).unwrap_or_else(|e| panic!("no CUDA backend: {e}"));
    let mut rng = StdRng::seed_from_u64(0x5eed);
    let (n, m, k) = (67, 45, 130);
    let x: Vec<f32> = (0..n * k).map(|_| rng.random_range(-2.0..2.0)).collect();
    let w: Vec<f32> = (0..m * k).map(|_| rng.random_range(-1.0..1.0)).collect();
    let dy: Vec<f32> = (0..n * m).map(|_| rng.random_range(-1.0..1.0)).collect();
    let (xt, wt, dyt) = (
        upload(&b, &[n, k], &x),
        upload(&b, &[m, k], &w),
        upload(&b, &[n, m], &dy),
    );
    let g = b.grad().expect("CUDA trains");
    for how in [Products::F32, Products::Tf32] {
        g.set_products(how).unwrap();
        assert!(g.rounded_for_products(&xt).unwrap().is_none(), "{how:?}");
    }
    for (how, dtype) in [
        (Products::Bf16, kiln_core::DType::BF16),
        (Products::F16, kiln_core::DType::F16),
    ] {
        g.set_products(how).unwrap();
        let run = || -> kiln_core::Result<_> {
            let mut out_f32 = upload(&b, &[n, m], &vec![0.0; n * m]);
            b.matmul(&xt, &wt, &mut out_f32)?;
            let mut dw_f32 = upload(&b, &[m, k], &vec![0.0; m * k]);
            g.matmul_dw(&dyt, &xt, &mut dw_f32)?;
            let kept = g.rounded_for_products(&xt)?.expect("16-bit products round");
            assert_eq!(kept.dtype(), dtype);
            let mut out_kept = upload(&b, &[n, m], &vec![0.0; n * m]);
            b.matmul(&xt, &wt, &mut out_kept)?;
            let mut dw_kept = upload(&b, &[m, k], &vec![0.0; m * k]);
            g.matmul_dw(&dyt, &kept, &mut dw_kept)?;
            Ok([out_f32, dw_f32, out_kept, dw_kept].map(|t| read(&b, &t)))
        };
        let r = run();
        g.set_products(Products::F32).unwrap();
        let [out_f32, dw_f32, out_kept, dw_kept] = r.unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&out_kept), bits(&out_f32), "{how:?}: forward");
        assert_eq!(bits(&dw_kept), bits(&dw_f32), "{how:?}: weight gradient");
        // And the products did round (the F32 weight gradient differs).
        let mut dw_exact = upload(&b, &[m, k], &vec![0.0; m * k]);
        g.matmul_dw(&dyt, &xt, &mut dw_exact).unwrap();
        assert_ne!(bits(&read(&b, &dw_exact)), bits(&dw_kept), "{how:?}");
    }
    // A rounded input under F32 products is refused, not read as F32.
    let kept = {
        g.set_products(Products::Bf16).unwrap();
        let kept = g.rounded_for_products(&xt);
        g.set_products(Products::F32).unwrap();
        kept.unwrap().unwrap()
    };
    let mut dw = upload(&b, &[m, k], &vec![0.0; m * k]);
    let e = g.matmul_dw(&dyt, &kept, &mut dw).unwrap_err().to_string();
    assert!(e.contains("bf16 input under f32 products"), "{e}");
}

/// Under 16-bit products the tape keeps the gated activation's gate and up rounded: its
/// gradient over those copies is the F32 kernel's over the rounded values, to the bit,
/// added or written.
#[test]
#[ignore = "needs a CUDA device"]
fn the_gated_gradient_over_kept_gate_and_up_is_the_f32_one_over_their_values() {
    let b = CudaBackend::new(0).unwrap_or_else(|e| panic!("no CUDA backend: {e}"));
    let g = b.grad().expect("CUDA trains");
    let mut rng = StdRng::seed_from_u64(0x9a7e);
    // An odd count: the last few elements take the one-at-a-time path.
    let n = 4 * 1001 + 3;
    let gate: Vec<f32> = (0..n).map(|_| rng.random_range(-4.0..4.0)).collect();
    let up: Vec<f32> = (0..n).map(|_| rng.random_range(-2.0..2.0)).collect();
    let dout: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
    let start: Vec<f32> = (0..n).map(|_| rng.random_range(-0.5..0.5)).collect();
    let (gt, ut, dt) = (
        upload(&b, &[n], &gate),
        upload(&b, &[n], &up),
        upload(&b, &[n], &dout),
    );
    for how in [Products::Bf16, Products::F16] {
        g.set_products(how).unwrap();
        let kept = [&gt, &ut].map(|t| g.rounded_for_products(t).unwrap().unwrap());
        g.set_products(Products::F32).unwrap();
        // The kept values, widened on the host.
        let widened = kept.each_ref().map(|t| {
            let bytes = b.download(t).unwrap();
            let v: Vec<f32> = bytes
                .chunks_exact(2)
                .map(|c| {
                    let h = u16::from_le_bytes([c[0], c[1]]);
                    match how {
                        Products::Bf16 => bf16::from_bits(h).to_f32(),
                        _ => half::f16::from_bits(h).to_f32(),
                    }
                })
                .collect();
            upload(&b, &[n], &v)
        });
        for gelu in [false, true] {
            for into in [GradInto::Add, GradInto::Write] {
                let begin = |into| match into {
                    GradInto::Add => upload(&b, &[n], &start),
                    GradInto::Write => upload(&b, &[n], &vec![f32::NAN; n]),
                };
                let run = |[gate, up]: [&kiln_core::Tensor; 2]| {
                    let (mut dg, mut du) = (begin(into), begin(into));
                    g.gated_backward(gate, up, gelu, &dt, &mut dg, &mut du, into)
                        .unwrap();
                    [read(&b, &dg), read(&b, &du)]
                };
                let got = run([&kept[0], &kept[1]]);
                let want = run([&widened[0], &widened[1]]);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                for (i, name) in ["dgate", "dup"].into_iter().enumerate() {
                    assert_eq!(
                        bits(&got[i]),
                        bits(&want[i]),
                        "{how:?} gelu {gelu} {into:?}: {name}"
                    );
                    assert!(got[i].iter().all(|v| v.is_finite()), "{how:?} {into:?}");
                }
            }
        }
    }
}

/// The gated activation in one pass keeping its rounded copies: the output is
/// `silu_mul`'s / `gelu_mul`'s to the bit, the copies `rounded_for_products`' of gate, up
/// and that output; under F32 products there is no such pass.
#[test]
#[ignore = "needs a CUDA device"]
fn the_gated_activation_keeps_what_rounding_each_operand_would() {
    let b = CudaBackend::new(0).unwrap_or_else(|e| panic!("no CUDA backend: {e}"));
    let g = b.grad().expect("CUDA trains");
    let mut rng = StdRng::seed_from_u64(0x6a7e);
    let n = 4 * 777 + 2;
    let gate: Vec<f32> = (0..n).map(|_| rng.random_range(-5.0..5.0)).collect();
    let up: Vec<f32> = (0..n).map(|_| rng.random_range(-2.0..2.0)).collect();
    let (gt, ut) = (upload(&b, &[n], &gate), upload(&b, &[n], &up));
    let mut out = upload(&b, &[n], &vec![f32::NAN; n]);
    assert!(g.gated_saving(&gt, &ut, false, &mut out).unwrap().is_none());
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for how in [Products::Bf16, Products::F16] {
        for gelu in [false, true] {
            g.set_products(how).unwrap();
            let run = || -> kiln_core::Result<_> {
                let mut plain = upload(&b, &[n], &vec![f32::NAN; n]);
                match gelu {
                    true => b.gelu_mul(&gt, &ut, &mut plain)?,
                    false => b.silu_mul(&gt, &ut, &mut plain)?,
                }
                let mut out = upload(&b, &[n], &vec![f32::NAN; n]);
                let kept = g
                    .gated_saving(&gt, &ut, gelu, &mut out)?
                    .expect("16-bit products keep");
                let want = [&gt, &ut, &plain].map(|t| g.rounded_for_products(t));
                let mut rounded = Vec::new();
                for w in want {
                    rounded.push(b.download(&w?.expect("16-bit products round"))?);
                }
                let kept: Vec<Vec<u8>> = kept
                    .iter()
                    .map(|t| b.download(t))
                    .collect::<Result<_, _>>()?;
                Ok((read(&b, &plain), read(&b, &out), kept, rounded))
            };
            let r = run();
            g.set_products(Products::F32).unwrap();
            let (plain, out, kept, rounded) = r.unwrap();
            assert_eq!(bits(&out), bits(&plain), "{how:?} gelu {gelu}: output");
            for (i, name) in ["gate", "up", "output"].into_iter().enumerate() {
                assert_eq!(kept[i], rounded[i], "{how:?} gelu {gelu}: kept {name}");
            }
        }
    }
}

/// The norm in one pass keeping what training keeps of it: the output is `rms_norm`'s to
/// the bit, the input's copy is the input, the rounded output `rounded_for_products`' of
/// it; under F32 products, or rows that are not whole float4 steps, there is no such pass.
#[test]
#[ignore = "needs a CUDA device"]
fn the_norm_keeps_its_input_and_its_rounded_output_from_its_own_pass() {
    let b = CudaBackend::new(0).unwrap_or_else(|e| panic!("no CUDA backend: {e}"));
    let g = b.grad().expect("CUDA trains");
    let mut rng = StdRng::seed_from_u64(0x40a1);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for (rows, dim) in [(37, 768), (5, 4100), (3, 30)] {
        let x: Vec<f32> = (0..rows * dim)
            .map(|_| rng.random_range(-3.0..3.0))
            .collect();
        let w: Vec<f32> = (0..dim).map(|_| rng.random_range(0.5..1.5)).collect();
        let (xt, wt) = (upload(&b, &[rows, dim], &x), upload(&b, &[dim], &w));
        let mut out = upload(&b, &[rows, dim], &vec![f32::NAN; rows * dim]);
        let none = g.rms_norm_saving(&xt, &wt, 1e-5, &mut out, true).unwrap();
        assert!(none.is_none(), "F32 products");
        for how in [Products::Bf16, Products::F16] {
            g.set_products(how).unwrap();
            let run = || -> kiln_core::Result<_> {
                let mut plain = upload(&b, &[rows, dim], &vec![f32::NAN; rows * dim]);
                b.rms_norm(&xt, &wt, 1e-5, &mut plain)?;
                let mut out = upload(&b, &[rows, dim], &vec![f32::NAN; rows * dim]);
                let Some((copy, rounded)) = g.rms_norm_saving(&xt, &wt, 1e-5, &mut out, true)?
                else {
                    return Ok(None);
                };
                let want = g
                    .rounded_for_products(&plain)?
                    .expect("16-bit products round");
                let copy = read(&b, &copy.expect("asked for the copy"));
                Ok(Some((
                    read(&b, &plain),
                    read(&b, &out),
                    copy,
                    b.download(&rounded)?,
                    b.download(&want)?,
                )))
            };
            let r = run();
            g.set_products(Products::F32).unwrap();
            let Some((plain, out, copy, rounded, want)) = r.unwrap() else {
                assert!(dim % 4 != 0, "{how:?}: rows of {dim} have the pass");
                continue;
            };
            assert!(dim % 4 == 0, "{how:?}: rows of {dim} have no such pass");
            assert_eq!(bits(&out), bits(&plain), "{how:?} rows of {dim}: output");
            assert_eq!(bits(&copy), bits(&x), "{how:?} rows of {dim}: input's copy");
            assert_eq!(rounded, want, "{how:?} rows of {dim}: rounded output");
        }
    }
}
