//! Drawing on the GPU against the host reference (`kiln_core::sampling::pick`), with the
//! same logits, penalized ids and parameters.

use kiln_core::{sampling, Backend, DType, HostBytes, SampleParams, Shape};
use kiln_wgpu::WgpuBackend;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn device() -> Option<WgpuBackend> {
    kiln_wgpu::adapter_for_tests().then(|| WgpuBackend::new(0).unwrap())
}

fn pick_on(g: &WgpuBackend, rows: &[f32], vocab: usize, pen: &[u32], p: &SampleParams) -> u32 {
    let bytes = rows.iter().flat_map(|v| v.to_le_bytes()).collect();
    let shape = Shape::new(vec![rows.len() / vocab, vocab]).unwrap();
    let mut logits = g
        .upload(DType::F32, shape, HostBytes::from_vec(bytes))
        .unwrap();
    let mut out = g.zeros(DType::I32, Shape::new(vec![1]).unwrap()).unwrap();
    g.sample(&mut logits, pen, p, &mut out).unwrap();
    i32::from_le_bytes(g.download(&out).unwrap()[..4].try_into().unwrap()) as u32
}

#[test]
fn draws_follow_the_host_reference() {
    let Some(g) = device() else { return };
    let mut rng = StdRng::seed_from_u64(5);
    let (mut checked, mut skipped) = (0, 0);
    for &vocab in &[1usize, 7, 1000, 32000] {
        for case in 0..24 {
            let rows = if case % 3 == 0 { 2 } else { 1 };
            // Some rows with ties (values on a coarse grid), some spread wide.
            let scale = if case % 2 == 0 { 4.0 } else { 12.0 };
            let logits: Vec<f32> = (0..rows * vocab)
                .map(|_| {
                    let v: f32 = rng.random_range(-scale..scale);
                    if case % 4 == 1 {
                        (v * 2.0).round() / 2.0
                    } else {
                        v
                    }
                })
                .collect();
            let pen: Vec<u32> = (0..(case % 5) * 3)
                .map(|_| rng.random_range(0..vocab as u32 + 3))
                .collect();
            let mut pen = pen;
            pen.sort_unstable();
            pen.dedup();
            let p = SampleParams {
                temperature: [0.0, 0.7, 1.3][case % 3],
                top_k: [1, 40, 256, 40][case % 4],
                top_p: [1.0, 0.9][case % 2],
                min_p: [0.0, 0.05, 0.0][case % 3],
                repeat_penalty: [1.0, 1.3][(case / 2) % 2],
                draw: rng.random_range(0.0..1.0),
            };
            let last = &logits[(rows - 1) * vocab..];
            let host = |draw: f64| {
                let mut row = last.to_vec();
                sampling::pick(&mut row, &pen, &SampleParams { draw, ..p })
            };
            let want = host(p.draw);
            // A draw this close to a boundary between candidates is f32's to decide.
            if host((p.draw - 1e-5).max(0.0)) != want
                || host((p.draw + 1e-5).min(0.999_999)) != want
            {
                skipped += 1;
                continue;
            }
            let got = pick_on(&g, &logits, vocab, &pen, &p);
            assert_eq!(
                got, want,
                "vocab {vocab} case {case}: {p:?} penalized {pen:?}"
            );
            checked += 1;
        }
    }
    assert!(
        skipped * 20 <= checked,
        "{skipped} draws skipped of {checked}"
    );
}

#[test]
fn bad_sampling_inputs_are_errors() {
    let Some(g) = device() else { return };
    let logits = vec![0u8; 4 * 8];
    let mut l = g
        .upload(
            DType::F32,
            Shape::new(vec![8]).unwrap(),
            HostBytes::from_vec(logits),
        )
        .unwrap();
    let mut wrong = g.zeros(DType::F32, Shape::new(vec![1]).unwrap()).unwrap();
    let p = SampleParams {
        temperature: 0.8,
        top_k: 4,
        top_p: 1.0,
        min_p: 0.0,
        repeat_penalty: 1.0,
        draw: 0.5,
    };
    assert!(g.sample(&mut l, &[], &p, &mut wrong).is_err());
}
