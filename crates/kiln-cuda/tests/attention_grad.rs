//! The attention backward under BF16 / F16 products (flash-style on tensor cores) against
//! float64 over the operands it reads: q, k, v and dout rounded once to the 16-bit type.
//! What the kernels add on top is the rounding of the probabilities and score gradients
//! to the same type before their products, and F32 sums: a few units of the type's last
//! place off the reference, relative to the largest gradient. Causal masks over positions
//! that start past 0, grouped heads, windows, softcaps, runs of a paged pool, heads of 64
//! and 128, and a training sequence of 1,024 tokens. Needs a GPU (ignored in CI).

mod common;

use common::{read, upload_f32, upload_i32};
use half::{bf16, f16};
use kiln_core::{AttentionParams, AttentionRun, Backend, GradInto, Products};
use kiln_cuda::CudaBackend;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

struct Shape4 {
    heads: usize,
    kv_heads: usize,
    d: usize,
}

/// One run's gradients in float64, added into `dq` (its rows), `dk` and `dv` (its key
/// span): queries `q` at positions `pos`, keys and values `k`, `v` whose positions are
/// their offsets. Operands as the kernels read them (already rounded).
#[allow(clippy::too_many_arguments)]
fn reference(
    s: &Shape4,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    dout: &[f64],
    pos: &[i32],
    keys: usize,
    p: &AttentionParams,
    (dq, dk, dv): (&mut [f64], &mut [f64], &mut [f64]),
    (out, lse2): (&mut [f64], &mut [f64]),
) {
    let (h_n, kv_n, d) = (s.heads, s.kv_heads, s.d);
    let group = h_n / kv_n;
    let mut z = vec![0f64; keys];
    let mut dz = vec![0f64; keys];
    let mut dp = vec![0f64; keys];
    for (i, &qp) in pos.iter().enumerate() {
        let last = (qp as i64).min(keys as i64 - 1);
        let first = p.window.map_or(0, |w| (last - w as i64 + 1).max(0));
        if last < 0 {
            continue;
        }
        let seen = first as usize..=last as usize;
        for h in 0..h_n {
            let kvh = h / group;
            let qr = &q[(i * h_n + h) * d..][..d];
            let dor = &dout[(i * h_n + h) * d..][..d];
            let mut m = f64::NEG_INFINITY;
            for j in seen.clone() {
                let kr = &k[(j * kv_n + kvh) * d..][..d];
                let raw = p.scale as f64 * qr.iter().zip(kr).map(|(a, b)| a * b).sum::<f64>();
                (z[j], dz[j]) = match p.softcap {
                    Some(c) => {
                        let t = (raw / c as f64).tanh();
                        (c as f64 * t, 1.0 - t * t)
                    }
                    None => (raw, 1.0),
                };
                let vr = &v[(j * kv_n + kvh) * d..][..d];
                dp[j] = dor.iter().zip(vr).map(|(a, b)| a * b).sum();
                m = m.max(z[j]);
            }
            let l: f64 = seen.clone().map(|j| (z[j] - m).exp()).sum();
            let delta: f64 = seen.clone().map(|j| (z[j] - m).exp() / l * dp[j]).sum();
            lse2[i * h_n + h] = (m + l.ln()) * std::f64::consts::LOG2_E;
            for j in seen.clone() {
                let pj = (z[j] - m).exp() / l;
                let vr = &v[(j * kv_n + kvh) * d..][..d];
                for x in 0..d {
                    out[(i * h_n + h) * d + x] += pj * vr[x];
                }
                let ds = pj * (dp[j] - delta) * dz[j] * p.scale as f64;
                let (kr, at) = (&k[(j * kv_n + kvh) * d..][..d], (j * kv_n + kvh) * d);
                for x in 0..d {
                    dq[(i * h_n + h) * d + x] += ds * kr[x];
                    dk[at + x] += ds * qr[x];
                    dv[at + x] += pj * dor[x];
                }
            }
        }
    }
}

/// A case: the query rows and positions of each run, its key span in a pool of `pool`
/// rows; every run goes through `attention_backward_runs` (one run over the whole pool:
/// also through `attention_backward`).
struct Case {
    name: &'static str,
    shape: Shape4,
    pool: usize,
    runs: Vec<(Vec<i32>, (usize, usize))>,
    params: AttentionParams,
}

fn check(b: &CudaBackend, case: &Case, how: Products, seed: u64) {
    let s = &case.shape;
    let (hd, kvd) = (s.heads * s.d, s.kv_heads * s.d);
    let n: usize = case.runs.iter().map(|r| r.0.len()).sum();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut values =
        |len: usize| -> Vec<f32> { (0..len).map(|_| rng.random_range(-1.0..1.0)).collect() };
    let (q, k, v, dout) = (
        values(n * hd),
        values(case.pool * kvd),
        values(case.pool * kvd),
        values(n * hd),
    );
    let round = |x: &[f32]| -> Vec<f64> {
        x.iter()
            .map(|&x| match how {
                Products::Bf16 => bf16::from_f32(x).to_f64(),
                _ => f16::from_f32(x).to_f64(),
            })
            .collect()
    };
    let (rq, rk, rv, rdo) = (round(&q), round(&k), round(&v), round(&dout));
    let (mut eq, mut ek, mut ev) = (
        vec![0f64; n * hd],
        vec![0f64; case.pool * kvd],
        vec![0f64; case.pool * kvd],
    );
    let (mut eo, mut e_lse) = (vec![0f64; n * hd], vec![f64::INFINITY; n * s.heads]);
    let (mut runs, mut pos, mut row) = (Vec::new(), Vec::new(), 0);
    for (run_pos, keys) in &case.runs {
        let rows = run_pos.len();
        let (qs, ks) = (
            row * hd..(row + rows) * hd,
            keys.0 * kvd..(keys.0 + keys.1) * kvd,
        );
        reference(
            s,
            &rq[qs.clone()],
            &rk[ks.clone()],
            &rv[ks.clone()],
            &rdo[qs.clone()],
            run_pos,
            keys.1,
            &case.params,
            (&mut eq[qs.clone()], &mut ek[ks.clone()], &mut ev[ks]),
            (
                &mut eo[qs],
                &mut e_lse[row * s.heads..(row + rows) * s.heads],
            ),
        );
        runs.push(AttentionRun {
            rows: (row, rows),
            keys: *keys,
        });
        pos.extend_from_slice(run_pos);
        row += rows;
    }
    let grad = b.grad().expect("CUDA trains");
    let pos_t = upload_i32(b, &[pos.len()], &pos);
    // The gradients are added to what the buffers hold.
    const HELD: f32 = 0.25;
    // The runs as a paged batch (blocks of one position, positions past a run's keys
    // outside the pool), for the forward over kept operands.
    let max_pos = pos.iter().map(|&p| p as usize + 1).max().unwrap_or(1);
    let mut tables = vec![-1i32; runs.len() * max_pos];
    let mut seq = Vec::with_capacity(n);
    for (i, r) in runs.iter().enumerate() {
        for j in 0..r.keys.1.min(max_pos) {
            tables[i * max_pos + j] = (r.keys.0 + j) as i32;
        }
        seq.extend(std::iter::repeat_n(i as i32, r.rows.1));
    }
    let (seq_t, tables_t) = (
        upload_i32(b, &[n], &seq),
        upload_i32(b, &[runs.len(), max_pos], &tables),
    );
    let run_rows: Vec<usize> = runs.iter().map(|r| r.rows.1).collect();
    // `kept`: q, k and v as the tape keeps them under 16-bit products (rounded);
    // `forward`: and the forward over them keeps its lse and rounded output, which the
    // backward reads (its output and lse come back too).
    // `start`: the gradients' value before (HELD, or NaN where they are written).
    let run_into = |whole: bool, kept: bool, forward: bool, (into, start): (GradInto, f32)| {
        grad.set_products(how).unwrap();
        let (qd, kd) = ([n, s.heads, s.d], [case.pool, s.kv_heads, s.d]);
        let (mut dq, mut dk, mut dv) = (
            upload_f32(b, &qd, &vec![start; n * hd]),
            upload_f32(b, &kd, &vec![start; case.pool * kvd]),
            upload_f32(b, &kd, &vec![start; case.pool * kvd]),
        );
        let (mut qt, mut kt, mut vt, dot) = (
            upload_f32(b, &qd, &q),
            upload_f32(b, &kd, &k),
            upload_f32(b, &kd, &v),
            upload_f32(b, &qd, &dout),
        );
        if kept {
            for t in [&mut qt, &mut kt, &mut vt] {
                *t = grad
                    .rounded_for_products(t)
                    .unwrap()
                    .expect("16-bit products");
            }
        }
        let mut fwd = None;
        if forward {
            let mut out = upload_f32(b, &qd, &vec![f32::NAN; n * hd]);
            let mut lse = upload_f32(b, &[n, s.heads], &vec![f32::NAN; n * s.heads]);
            let mut out_r = grad.rounded_for_products(&out).unwrap().unwrap();
            let pages = kiln_core::Pages {
                seq: &seq_t,
                tables: &tables_t,
                block: 1,
                runs: &run_rows,
            };
            let ran = grad
                .paged_attention_saving(
                    &qt,
                    &kt,
                    &vt,
                    &pos_t,
                    &pages,
                    &case.params,
                    &mut out,
                    &mut lse,
                    &mut out_r,
                )
                .unwrap();
            assert!(ran, "{}: the forward over kept operands runs", case.name);
            fwd = Some((out, lse, out_r));
        }
        let saved = fwd
            .as_ref()
            .map(|(_, lse, out_r)| kiln_core::AttentionSaved { lse, out: out_r });
        let done = if whole {
            grad.attention_backward(
                &qt,
                &kt,
                &vt,
                &pos_t,
                &case.params,
                &dot,
                &mut dq,
                &mut dk,
                &mut dv,
            )
            .map(|()| true)
        } else {
            grad.attention_backward_runs(
                &qt,
                &kt,
                &vt,
                &pos_t,
                &runs,
                &case.params,
                saved,
                &dot,
                &mut dq,
                &mut dk,
                &mut dv,
                into,
            )
        };
        grad.set_products(Products::F32).unwrap();
        assert!(
            done.unwrap(),
            "{}: CUDA runs the paged backward in place",
            case.name
        );
        let fwd = fwd.map(|(out, lse, _)| (read(b, &out), read(b, &lse)));
        ([read(b, &dq), read(b, &dk), read(b, &dv)], fwd)
    };
    let run = |whole: bool, kept: bool, forward: bool| {
        run_into(whole, kept, forward, (GradInto::Add, HELD))
    };
    // Gradients that begin here, written over NaN, are what adding into zeros gives (as
    // values: a written -0 is an added +0), every row of the pool included.
    for (kept, forward) in [(false, false), (true, true)] {
        if forward && !case.runs.iter().all(|r| r.0.len() > 8) {
            continue;
        }
        let added = run_into(false, kept, forward, (GradInto::Add, 0.0)).0;
        let written = run_into(false, kept, forward, (GradInto::Write, f32::NAN)).0;
        for (i, name) in ["dq", "dk", "dv"].into_iter().enumerate() {
            assert!(
                added[i] == written[i],
                "{}: {name} written differs from added into zeros (kept {kept})",
                case.name
            );
        }
    }
    let one_run = case.runs.len() == 1 && case.runs[0].1 == (0, case.pool);
    let bits = if how == Products::Bf16 { 8 } else { 11 };
    let modes: &[bool] = if one_run { &[false, true] } else { &[false] };
    // The rounded inputs the tape keeps give the same gradients, to the bit.
    let bits_of = |v: &[Vec<f32>; 3]| v.iter().flatten().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(
        bits_of(&run(false, true, false).0),
        bits_of(&run(false, false, false).0),
        "{}: kept rounded inputs",
        case.name
    );
    let unit = 2f64.powi(-bits);
    let mut results = Vec::new();
    for &whole in modes {
        results.push((whole, run(whole, false, false).0));
    }
    // The forward over kept operands (where every run is prompt-shaped): its output within
    // what rounding the probabilities moves, its log-sum-exp within f32's sums; then the
    // backward from what it kept, within the same bound as the others.
    if case.runs.iter().all(|r| r.0.len() > 8) {
        let (grads, fwd) = run(false, true, true);
        let (out, lse) = fwd.expect("the forward ran");
        let largest = eo.iter().fold(0f64, |m, x| m.max(x.abs()));
        let off = out
            .iter()
            .zip(&eo)
            .fold(0f64, |m, (&a, b)| m.max((a as f64 - b).abs()))
            / largest;
        eprintln!(
            "{} {} forward: {off:e} of the largest off float64",
            case.name,
            how.name()
        );
        assert!(
            off <= 2.0 * unit,
            "{} {}: forward {off:e} off",
            case.name,
            how.name()
        );
        for (i, (&a, &b)) in lse.iter().zip(&e_lse).enumerate() {
            assert!(
                (a as f64 - b).abs() <= 1e-4 * b.abs().max(1.0),
                "{} {}: lse[{i}] {a} against {b}",
                case.name,
                how.name()
            );
        }
        results.push((false, grads));
    }
    for (whole, got) in results {
        for (name, (g, e)) in ["dq", "dk", "dv"]
            .iter()
            .zip(got.iter().zip([&eq, &ek, &ev]))
        {
            let largest = e.iter().fold(0f64, |m, x| m.max(x.abs()));
            assert!(largest > 0.0, "{}: {name} is all zeros", case.name);
            let off = g
                .iter()
                .zip(e)
                .fold(0f64, |m, (&a, b)| m.max((a as f64 - HELD as f64 - b).abs()))
                / largest;
            eprintln!(
                "{} {} {name} (whole: {whole}): {off:e} of the largest off float64",
                case.name,
                how.name()
            );
            // The probabilities and score gradients rounded once before their products.
            assert!(
                off <= 4.0 * unit,
                "{} {} {name}: {off:e} of the largest gradient off float64",
                case.name,
                how.name()
            );
        }
    }
}

fn params(scale: f32, softcap: Option<f32>, window: Option<usize>) -> AttentionParams {
    AttentionParams {
        scale,
        softcap,
        window,
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn the_attention_backward_under_16_bit_products_matches_float64() {
    let b = CudaBackend::new(0).unwrap_or_else(|e| panic!("no CUDA backend: {e}"));
    let cases = [
        // A prompt continuing at position 50 over 200 keys, grouped heads.
        Case {
            name: "continued prompt",
            shape: Shape4 {
                heads: 4,
                kv_heads: 2,
                d: 64,
            },
            pool: 200,
            runs: vec![((50..200).collect(), (0, 200))],
            params: params(0.125, None, None),
        },
        // Heads of 128, four a KV head, a window and a softcap.
        Case {
            name: "window and softcap",
            shape: Shape4 {
                heads: 8,
                kv_heads: 2,
                d: 128,
            },
            pool: 130,
            runs: vec![((0..130).collect(), (0, 130))],
            params: params(0.088, Some(1.5), Some(37)),
        },
        // A paged batch: runs of 70, 1 and 130 rows over scattered spans of a pool, one
        // of its spans shorter than its positions reach.
        Case {
            name: "paged runs",
            shape: Shape4 {
                heads: 6,
                kv_heads: 6,
                d: 64,
            },
            pool: 400,
            runs: vec![
                ((30..100).collect(), (250, 100)),
                (vec![19], (0, 20)),
                ((0..130).collect(), (100, 130)),
                ((0..9).map(|p| p + 20).collect(), (20, 16)),
            ],
            params: params(0.125, None, None),
        },
        // Two runs over one span of keys (a shared prefix): their key gradients add.
        Case {
            name: "shared keys",
            shape: Shape4 {
                heads: 2,
                kv_heads: 1,
                d: 64,
            },
            pool: 80,
            runs: vec![((0..40).collect(), (0, 50)), ((10..75).collect(), (0, 80))],
            params: params(0.125, None, None),
        },
    ];
    for (i, case) in cases.iter().enumerate() {
        for how in [Products::Bf16, Products::F16] {
            check(&b, case, how, 0xa77 + i as u64);
        }
    }
}

/// Issue 18's training shape: a sequence of 1,024 tokens, heads of 64 (12 of them in the
/// model; 4 here keep the float64 reference quick), the GPU's launch sizes of training.
#[test]
#[ignore = "needs a CUDA device"]
fn the_attention_backward_of_a_training_sequence_matches_float64() {
    let b = CudaBackend::new(0).unwrap_or_else(|e| panic!("no CUDA backend: {e}"));
    let case = Case {
        name: "training sequence",
        shape: Shape4 {
            heads: 4,
            kv_heads: 4,
            d: 64,
        },
        pool: 1024,
        runs: vec![((0..1024).collect(), (0, 1024))],
        params: params(0.125, None, None),
    };
    check(&b, &case, Products::Bf16, 0x134);
}
