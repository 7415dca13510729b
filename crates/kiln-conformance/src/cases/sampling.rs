//! Drawing a token on the device against the host reference (`kiln_core::sampling::pick`)
//! on the same logits, penalized ids and parameters.

use crate::target::{random, Target};
use kiln_core::{sampling, DType, RowDraw, SampleParams};
use rand::Rng;

/// Every parameter over rows with ties and spread-out rows, vocabularies from one token
/// to Llama 3's. A device sums in f32 where the host sums in f64, so a draw or a top-p that
/// sits on a boundary between candidates may go either way: a result the host gives with
/// the draw or top-p moved by 1e-4 is accepted, and at most 5% of draws may need that.
pub fn sampling_follows_the_host_reference(t: &Target) {
    let mut rng = t.rng(0);
    let (mut exact, mut trials) = (0, 0);
    for vocab in [1usize, 7, 1000, 32_000, 128_256] {
        for case in 0..24 {
            let rows = if case % 3 == 0 { 2 } else { 1 };
            let scale = if case % 2 == 0 { 4.0 } else { 12.0 };
            let mut logits = random(&mut rng, rows * vocab, scale);
            if case % 4 == 1 {
                // Values on a coarse grid: ties, which go to the lowest id.
                logits
                    .iter_mut()
                    .for_each(|l| *l = (*l * 2.0).round() / 2.0);
            }
            let params = SampleParams {
                temperature: [0.0, 0.3, 0.8, 1.5][case % 4],
                top_k: [1, 40, 256, 5, 1024, 0][case % 6],
                top_p: [1.0, 0.9, 0.5][case % 3],
                min_p: [0.0, 0.05, 0.3][(case / 3) % 3],
                repeat_penalty: [1.0, 1.3][(case / 2) % 2],
                draw: rng.random_range(0.0..1.0),
            };
            // Distinct ids, some past the vocabulary (ignored).
            let mut penalized: Vec<u32> = (0..(case % 5) * 3)
                .map(|_| rng.random_range(0..vocab as u32 + 3))
                .collect();
            penalized.sort_unstable();
            penalized.dedup();
            let last = &logits[(rows - 1) * vocab..];
            let host = |p: &SampleParams| sampling::pick(&mut last.to_vec(), &penalized, p);
            let want = host(&params);

            let mut lt = t.upload(DType::F32, &[rows, vocab], &logits);
            let mut out = t.zeros(DType::I32, &[1]);
            t.backend
                .sample(&mut lt, &penalized, &params, &mut out)
                .unwrap();
            let got = t.read_ints(&out)[0] as u32;
            let what = format!("vocab {vocab} case {case}: {params:?} penalized {penalized:?}");
            if params.repeat_penalty == 1.0 {
                assert_eq!(t.read(&lt), logits, "{what}: logits changed");
            }
            trials += 1;
            if got == want {
                exact += 1;
                continue;
            }
            let moved = [(-1e-4, 0.0), (1e-4, 0.0), (0.0, -1e-4), (0.0, 1e-4)]
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
                    host(&p) == got
                });
            assert!(moved, "{what}: device drew {got}, host {want}");
        }
    }
    assert!(
        exact * 100 >= trials * 95,
        "{exact} of {trials} draws exact"
    );
}

pub fn sampling_into_a_wrong_output_is_an_error(t: &Target) {
    let mut logits = t.upload(DType::F32, &[8], &[0.0; 8]);
    let params = SampleParams {
        temperature: 0.8,
        top_k: 4,
        top_p: 1.0,
        min_p: 0.0,
        repeat_penalty: 1.0,
        draw: 0.5,
    };
    let mut f32_out = t.zeros(DType::F32, &[1]);
    assert!(t
        .backend
        .sample(&mut logits, &[], &params, &mut f32_out)
        .is_err());
}

/// A server's batch drawn at once (`sample_rows`, one launch where the device can) gives
/// each row the token `sample` gives that row alone, with its own settings: greedy with a
/// penalty, top-k past what a device kernel keeps (the host's), ties, penalized ids past
/// the vocabulary. Rows drawn twice or missing are errors.
pub fn a_batch_of_draws_draws_each_row_as_alone(t: &Target) {
    let mut rng = t.rng(1);
    for vocab in [7usize, 1000, 32_000] {
        let rows = 11;
        let mut logits = random(&mut rng, rows * vocab, 6.0);
        // Row 3 on a coarse grid: ties, which go to the lowest id.
        logits[3 * vocab..4 * vocab]
            .iter_mut()
            .for_each(|l| *l = (*l * 2.0).round() / 2.0);
        let params: Vec<SampleParams> = (0..rows)
            .map(|i| SampleParams {
                temperature: [0.0, 0.7, 1.2, 0.4][i % 4],
                top_k: [40, 1, 0, 2000, 256][i % 5],
                top_p: [1.0, 0.9, 0.6][i % 3],
                min_p: [0.0, 0.1][i % 2],
                repeat_penalty: [1.0, 1.4, 1.0][i % 3],
                draw: rng.random_range(0.0..1.0),
            })
            .collect();
        let penalized: Vec<Vec<u32>> = (0..rows)
            .map(|i| {
                let mut p: Vec<u32> = (0..i % 4 * 3)
                    .map(|_| rng.random_range(0..vocab as u32 + 3))
                    .collect();
                p.sort_unstable();
                p.dedup();
                p
            })
            .collect();
        // Rows in another order than the draws, one row left out.
        let order = [4usize, 0, 9, 2, 7, 3, 10, 1, 8, 5];
        let draws: Vec<RowDraw> = order
            .iter()
            .map(|&r| RowDraw {
                row: r,
                penalized: &penalized[r],
                params: &params[r],
            })
            .collect();
        let mut lt = t.upload(DType::F32, &[rows, vocab], &logits);
        let got = t.backend.sample_rows(&mut lt, &draws).unwrap();
        assert_eq!(got.len(), draws.len());
        for (&r, &id) in order.iter().zip(&got) {
            let row = &logits[r * vocab..][..vocab];
            let mut alone = t.upload(DType::F32, &[1, vocab], row);
            let mut out = t.zeros(DType::I32, &[1]);
            t.backend
                .sample(&mut alone, &penalized[r], &params[r], &mut out)
                .unwrap();
            let want = t.read_ints(&out)[0] as u32;
            assert_eq!(
                id, want,
                "vocab {vocab}, row {r}: {:?} penalized {:?}: drawn {id} in the batch, {want} alone",
                params[r], penalized[r]
            );
        }
        let twice = [draws[0], draws[0]];
        let e = t
            .backend
            .sample_rows(&mut lt, &twice)
            .unwrap_err()
            .to_string();
        assert!(e.contains("two draws from row 4"), "{e}");
        let past = [RowDraw {
            row: rows,
            ..draws[0]
        }];
        assert!(t.backend.sample_rows(&mut lt, &past).is_err());
        assert!(t.backend.sample_rows(&mut lt, &[]).unwrap().is_empty());
    }
}
