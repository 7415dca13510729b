//! Row-wise and element-wise ops: norms, softmax, activations, arithmetic, slicing,
//! soft-capping and argmax.

use crate::reference::{self, assert_close, widen};
use crate::target::{random, Target};
use kiln_core::{DType, Result, Tensor};

/// (rows, columns): single values, odd widths, a prompt's rows, model widths.
const ROW_SHAPES: [(usize, usize); 7] = [
    (1, 1),
    (3, 7),
    (5, 33),
    (5, 301),
    (130, 257),
    (5, 1000),
    (3, 4096),
];

pub fn rms_norm(t: &Target) {
    for (s, (rows, dim)) in ROW_SHAPES.into_iter().enumerate() {
        let mut rng = t.rng(s as u64);
        let xv = random(&mut rng, rows * dim, 3.0);
        let wv = random(&mut rng, dim, 1.5);
        let (x, w) = (
            t.upload(DType::F32, &[rows, dim], &xv),
            t.upload(DType::F32, &[dim], &wv),
        );
        let mut out = t.poisoned(&[rows, dim]);
        t.backend.rms_norm(&x, &w, 1e-5, &mut out).unwrap();
        let want = reference::rms_norm(&xv, &wv, 1e-5);
        assert_close(&t.read(&out), &want, 1e-5, &format!("[{rows}, {dim}]"));
    }
}

pub fn layer_norm(t: &Target) {
    for (s, (rows, dim)) in ROW_SHAPES.into_iter().enumerate() {
        let mut rng = t.rng(s as u64);
        let xv = random(&mut rng, rows * dim, 3.0);
        let wv = random(&mut rng, dim, 1.5);
        let bv = random(&mut rng, dim, 0.5);
        let x = t.upload(DType::F32, &[rows, dim], &xv);
        let (w, b) = (
            t.upload(DType::F32, &[dim], &wv),
            t.upload(DType::F32, &[dim], &bv),
        );
        let mut out = t.poisoned(&[rows, dim]);
        t.backend.layer_norm(&x, &w, &b, 1e-5, &mut out).unwrap();
        let want = reference::layer_norm(&xv, &wv, &bv, 1e-5);
        assert_close(&t.read(&out), &want, 1e-5, &format!("[{rows}, {dim}]"));
    }
}

pub fn softmax(t: &Target) {
    for (s, (rows, dim)) in ROW_SHAPES.into_iter().enumerate() {
        let mut rng = t.rng(s as u64);
        let xv = random(&mut rng, rows * dim, 3.0);
        let mut x = t.upload(DType::F32, &[rows, dim], &xv);
        t.backend.softmax(&mut x).unwrap();
        let want = reference::softmax(&xv, dim);
        assert_close(&t.read(&x), &want, 1e-6, &format!("[{rows}, {dim}]"));
    }
}

/// A row masked whole gives zeros, not NaN.
pub fn softmax_of_a_masked_row_is_zeros(t: &Target) {
    let mut masked = t.upload(DType::F32, &[1, 3], &[f32::NEG_INFINITY; 3]);
    t.backend.softmax(&mut masked).unwrap();
    assert_eq!(t.read(&masked), vec![0.0; 3], "a row of -inf");
}

pub fn elementwise(t: &Target) {
    // Rows of a multiple of 4 take the GPUs' 16-byte paths (a row broadcast included).
    for (s, (rows, cols)) in [(3, 37), (7, 333), (5, 301), (6, 68)]
        .into_iter()
        .enumerate()
    {
        let mut rng = t.rng(s as u64);
        let gv = random(&mut rng, rows * cols, 6.0);
        let uv = random(&mut rng, rows * cols, 2.0);
        let rv = random(&mut rng, cols, 2.0);
        let g = t.upload(DType::F32, &[rows, cols], &gv);
        let u = t.upload(DType::F32, &[rows, cols], &uv);
        let row = t.upload(DType::F32, &[cols], &rv);
        let what = |op: &str| format!("{op} [{rows}, {cols}]");
        let pairs = || gv.iter().zip(&uv).map(|(&g, &u)| (g as f64, u as f64));

        let mut out = t.poisoned(&[rows, cols]);
        t.backend.silu_mul(&g, &u, &mut out).unwrap();
        let want: Vec<f64> = pairs().map(|(g, u)| reference::silu(g) * u).collect();
        assert_close(&t.read(&out), &want, 1e-5, &what("silu_mul"));

        t.backend.gelu_mul(&g, &u, &mut out).unwrap();
        let want: Vec<f64> = pairs().map(|(g, u)| reference::gelu(g) * u).collect();
        assert_close(&t.read(&out), &want, 1e-5, &what("gelu_mul"));

        let mut x = t.upload(DType::F32, &[rows, cols], &gv);
        t.backend.gelu(&mut x).unwrap();
        let want: Vec<f64> = pairs().map(|(g, _)| reference::gelu(g)).collect();
        assert_close(&t.read(&x), &want, 1e-5, &what("gelu"));

        // acc = (g + u + row) · row · u · 0.3, an op at a time, each checked.
        let mut acc = t.upload(DType::F32, &[rows, cols], &gv);
        let mut want = widen(&gv);
        let mut step =
            |op: &str, run: &dyn Fn(&mut Tensor) -> Result<()>, f: &dyn Fn(f64, usize) -> f64| {
                run(&mut acc).unwrap();
                want = want.iter().enumerate().map(|(i, &a)| f(a, i)).collect();
                assert_close(&t.read(&acc), &want, 1e-6, &what(op));
            };
        step("add_assign", &|a| t.backend.add_assign(a, &u), &|a, i| {
            a + uv[i] as f64
        });
        step(
            "add_assign of a row",
            &|a| t.backend.add_assign(a, &row),
            &|a, i| a + rv[i % cols] as f64,
        );
        step(
            "mul_assign of a row",
            &|a| t.backend.mul_assign(a, &row),
            &|a, i| a * rv[i % cols] as f64,
        );
        step("mul_assign", &|a| t.backend.mul_assign(a, &u), &|a, i| {
            a * uv[i] as f64
        });
        step("scale", &|a| t.backend.scale(a, 0.3), &|a, _| a * 0.3);
    }
}

pub fn softcap(t: &Target) {
    let mut rng = t.rng(0);
    for (rows, cols) in [(3, 10), (5, 301)] {
        let xv = random(&mut rng, rows * cols, 8.0);
        for cap in [3.0f32, 1.5, 30.0] {
            let mut x = t.upload(DType::F32, &[rows, cols], &xv);
            t.backend.softcap(&mut x, cap).unwrap();
            let want: Vec<f64> = xv
                .iter()
                .map(|&v| cap as f64 * (v as f64 / cap as f64).tanh())
                .collect();
            assert_close(
                &t.read(&x),
                &want,
                1e-5,
                &format!("cap {cap} [{rows}, {cols}]"),
            );
        }
    }
}

pub fn slice_cols(t: &Target) {
    let mut rng = t.rng(0);
    for (rows, cols, col0, width) in [
        (3, 10, 5, 4),
        (7, 333, 200, 100),
        (5, 301, 100, 17),
        (2, 9, 0, 9),
    ] {
        let sv = random(&mut rng, rows * cols, 4.0);
        let src = t.upload(DType::F32, &[rows, cols], &sv);
        let mut dst = t.poisoned(&[rows, width]);
        t.backend.slice_cols(&src, col0, &mut dst).unwrap();
        let want: Vec<f64> = sv
            .chunks(cols)
            .flat_map(|r| widen(&r[col0..col0 + width]))
            .collect();
        assert_close(
            &t.read(&dst),
            &want,
            0.0,
            &format!("[{rows}, {cols}] from {col0}"),
        );
        assert!(
            t.backend
                .slice_cols(&src, cols - width + 1, &mut dst)
                .is_err(),
            "columns past the end"
        );
    }
}

/// The first largest value of each row; NaN never wins.
pub fn argmax(t: &Target) {
    let mut rng = t.rng(0);
    let first_max = |r: &[f32]| {
        let max = r.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        r.iter().position(|&v| v == max).unwrap() as i32
    };
    for (rows, cols) in [(1, 1), (1, 32000), (4, 37), (5, 301)] {
        let xv = random(&mut rng, rows * cols, 10.0);
        let x = t.upload(DType::F32, &[rows, cols], &xv);
        let mut out = t.zeros(DType::I32, &[rows]);
        t.backend.argmax(&x, &mut out).unwrap();
        let want: Vec<i32> = xv.chunks(cols).map(first_max).collect();
        assert_eq!(t.read_ints(&out), want, "argmax [{rows}, {cols}]");
    }
    let ties = [
        1.0, 3.0, 3.0, 0.0, -2.0, -2.0, -2.0, -2.0, 0.0, 0.0, 0.0, 5.0,
    ];
    let x = t.upload(DType::F32, &[3, 4], &ties);
    let mut out = t.ints(&[-1, -1, -1]);
    t.backend.argmax(&x, &mut out).unwrap();
    assert_eq!(t.read_ints(&out), vec![1, 0, 3], "ties");
    // A vocabulary as large as Llama 3's, ties far apart, a NaN.
    let (rows, cols) = (4, 128_256);
    let mut xv = random(&mut rng, rows * cols, 10.0);
    xv[5] = 50.0;
    xv[cols - 1] = 50.0;
    xv[cols + 70_000] = 60.0;
    xv[2 * cols + cols - 1] = 11.0;
    xv[3 * cols + 1] = f32::NAN;
    xv[3 * cols + 2] = 12.0;
    let x = t.upload(DType::F32, &[rows, cols], &xv);
    let mut out = t.zeros(DType::I32, &[rows]);
    t.backend.argmax(&x, &mut out).unwrap();
    assert_eq!(
        t.read_ints(&out),
        vec![5, 70_000, (cols - 1) as i32, 2],
        "argmax over 128,256"
    );
    // One I32 output per row.
    assert!(t.backend.argmax(&x, &mut t.ints(&[0, 0])).is_err());
    assert!(t
        .backend
        .argmax(&x, &mut t.zeros(DType::F32, &[rows]))
        .is_err());
}
