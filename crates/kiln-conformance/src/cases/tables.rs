//! Weights as tables: embedding lookups, weights read back in the file's layout, and
//! weights larger than one GPU binding.

use crate::reference::{assert_close, widen};
use crate::rounding::{assert_products, RoundedRow};
use crate::target::{random, stored, Target};
use kiln_core::{quant, DType};

pub fn embedding_every_dtype(t: &Target) {
    for (d, dtype) in DType::ALL.into_iter().enumerate() {
        let mut rng = t.rng(d as u64);
        for (vocab, dim) in [(37, if dtype.is_quantized() { 512 } else { 72 }), (11, 256)] {
            let values = random(&mut rng, vocab * dim, 2.0);
            let table = t.upload(dtype, &[vocab, dim], &values);
            let ids = [3, 0, vocab as i32 - 1, 3, 7];
            let mut out = t.poisoned(&[ids.len(), dim]);
            t.backend
                .embedding(&table, &t.ints(&ids), &mut out)
                .unwrap();
            let table_values = stored(dtype, &values);
            let want: Vec<f64> = ids
                .iter()
                .flat_map(|&id| widen(&table_values[id as usize * dim..][..dim]))
                .collect();
            // Decoding a row is exact in f32.
            assert_close(&t.read(&out), &want, 0.0, &format!("embedding {dtype}"));
        }
    }
}

/// An id outside the table is an error naming it, or (on devices that cannot report
/// errors mid-step) a row of zeros; one id per output row.
pub fn embedding_ids_outside_the_table(t: &Target) {
    let (vocab, dim) = (11, 256);
    let mut rng = t.rng(0);
    for dtype in DType::ALL {
        let table = t.upload(dtype, &[vocab, dim], &random(&mut rng, vocab * dim, 1.0));
        for bad in [vocab as i32, -1] {
            let mut out = t.poisoned(&[2, dim]);
            match t.backend.embedding(&table, &t.ints(&[0, bad]), &mut out) {
                Err(e) => assert!(
                    e.to_string().contains(&format!("token id {bad}")),
                    "{dtype}: {e}"
                ),
                Ok(()) => assert!(
                    t.read(&out)[dim..].iter().all(|&v| v == 0.0),
                    "{dtype}: id {bad} gave a row that is not zeros"
                ),
            }
        }
        let mut two_rows = t.poisoned(&[2, dim]);
        assert!(
            t.backend
                .embedding(&table, &t.ints(&[0]), &mut two_rows)
                .is_err(),
            "{dtype}: one id for two output rows"
        );
    }
}

/// A backend may repack weights at upload (quants and scales apart); reads give the
/// file's layout back, after an upload and after a write.
pub fn weights_read_back_as_written(t: &Target) {
    let mut rng = t.rng(0);
    for dtype in DType::ALL {
        let bs = dtype.block_size();
        for (m, k) in [(5, 512), (131, 3 * bs.max(12))] {
            let bytes = quant::quantize(dtype, &random(&mut rng, m * k, 2.0)).unwrap();
            let mut w = t.upload_bytes(dtype, &[m, k], bytes.clone());
            assert_eq!(
                t.backend.download(&w).unwrap(),
                bytes,
                "{dtype} [{m}, {k}] upload"
            );
            let other = quant::quantize(dtype, &random(&mut rng, m * k, 1.0)).unwrap();
            t.backend.write(&mut w, &other).unwrap();
            assert_eq!(
                t.backend.download(&w).unwrap(),
                other,
                "{dtype} [{m}, {k}] write"
            );
        }
    }
}

/// WebGPU's default largest binding (lavapipe's too).
const BINDING_LIMIT: usize = 128 << 20;

/// Weights past 128 MiB, which a GPU backend may have to bind in pieces of rows: rows on
/// both sides of where a piece would end, every 97th, and the last 400 (a piece starting
/// in the wrong place shifts all after it), by products and by embedding lookups.
pub fn weights_past_128_mib(t: &Target) {
    let mut rng = t.rng(0);
    for (dtype, k) in [(DType::F32, 1024), (DType::Q8_0, 4096)] {
        let row_bytes = dtype.row_bytes(k).unwrap();
        let m = BINDING_LIMIT / row_bytes + 300;
        let boundary = BINDING_LIMIT / row_bytes;
        let checked: Vec<usize> = (0..m)
            .step_by(97)
            .chain(boundary - 2..boundary + 2)
            .chain(m - 400..m)
            .collect();
        // The weight made a row at a time; only the checked rows kept decoded.
        let mut bytes = Vec::with_capacity(m * row_bytes);
        let mut kept = Vec::with_capacity(checked.len() * k);
        let mut next = checked
            .iter()
            .copied()
            .collect::<std::collections::BTreeSet<_>>();
        for r in 0..m {
            let row = quant::quantize(dtype, &random(&mut rng, k, 1.0)).unwrap();
            if next.remove(&r) {
                kept.push((r, quant::dequantize_to_vec(dtype, &row, k).unwrap()));
            }
            bytes.extend_from_slice(&row);
        }
        let w = t.upload_bytes(dtype, &[m, k], bytes);
        let xv = random(&mut rng, 2 * k, 1.0);
        let x = t.upload(DType::F32, &[2, k], &xv);
        let mut out = t.poisoned(&[2, m]);
        t.backend.matmul(&x, &w, &mut out).unwrap();
        let got = t.read(&out);
        let rounding = t.rounding(dtype, 2, k);
        for (i, row) in xv.chunks(k).enumerate() {
            let x_row = RoundedRow::new(row, rounding);
            let want: Vec<_> = kept.iter().map(|(_, w)| x_row.dot(w)).collect();
            let got_rows: Vec<f32> = kept.iter().map(|(r, _)| got[i * m + r]).collect();
            assert_products(
                &got_rows,
                &want,
                &format!("{dtype} [{m}, {k}] row {i} of x"),
            );
        }
        let ids: Vec<i32> = kept.iter().map(|(r, _)| *r as i32).collect();
        let mut rows = t.poisoned(&[ids.len(), k]);
        t.backend.embedding(&w, &t.ints(&ids), &mut rows).unwrap();
        let want: Vec<f64> = kept.iter().flat_map(|(_, w)| widen(w)).collect();
        assert_close(&t.read(&rows), &want, 0.0, &format!("{dtype} embedding"));
    }
}
