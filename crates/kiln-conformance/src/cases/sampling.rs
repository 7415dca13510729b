//! Drawing a token on the device against the host reference (`kiln_core::sampling::pick`)
//! on the same logits, penalized ids and parameters.

use crate::target::{random, Target};
use kiln_core::{sampling, DType, SampleParams};
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
