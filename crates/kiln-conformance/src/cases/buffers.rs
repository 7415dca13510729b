//! Buffers (zeros, fill, upload, write, download, copies between backends), recorded
//! steps, and inputs that must be refused with an error, never a panic.

use crate::reference::{self, assert_close, AttentionShape};
use crate::target::{random, shape, Target};
use kiln_core::{
    quant, to_device, AttentionParams, DType, Device, HostBytes, RopeLayout, Storage, Tensor,
};
use std::any::Any;

pub fn buffers_are_created_filled_copied_and_read_back(t: &Target) {
    let b = t.backend;
    let mut z = t.zeros(DType::F32, &[3, 5]);
    assert_eq!(t.read(&z), vec![0.0; 15]);
    b.fill(&mut z, 2.5).unwrap();
    // Through the host and back: what moving a tensor between backends does.
    let copy = to_device(&z, b, b).unwrap();
    assert_eq!((copy.dtype(), copy.dims()), (DType::F32, &[3usize, 5][..]));
    assert_eq!(t.read(&copy), vec![2.5; 15]);
    // Quantized data crosses byte for byte.
    let mut q = t.upload(DType::Q4_K, &[2, 256], &random(&mut t.rng(0), 512, 1.0));
    let q2 = to_device(&q, b, b).unwrap();
    assert_eq!(b.download(&q).unwrap(), b.download(&q2).unwrap());
    // Filling a quantized tensor is refused, not silently wrong.
    assert!(b.fill(&mut q, 1.0).is_err());
}

pub fn write_overwrites_whole_tensors(t: &Target) {
    let b = t.backend;
    let mut ids = t.zeros(DType::I32, &[3]);
    assert_eq!(t.read_ints(&ids), vec![0, 0, 0]);
    let bytes: Vec<u8> = [7i32, -2, 1 << 30]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    b.write(&mut ids, &bytes).unwrap();
    assert_eq!(t.read_ints(&ids), vec![7, -2, 1 << 30]);
    // Exactly the tensor's bytes, or nothing changes.
    assert!(b.write(&mut ids, &bytes[..8]).is_err());
    assert!(b.write(&mut ids, &[0; 16]).is_err());
    assert_eq!(t.read_ints(&ids), vec![7, -2, 1 << 30]);
    let mut f = t.zeros(DType::F32, &[4]);
    assert!(b.write(&mut f, &[0; 12]).is_err());

    // Writing a tensor uploaded from host bytes leaves those bytes alone (a backend
    // may have used them in place).
    let source = HostBytes::from_vec(quant::quantize(DType::F32, &[1.0, 2.0]).unwrap());
    let mut x = b.upload(DType::F32, shape(&[2]), source.clone()).unwrap();
    b.write(&mut x, &quant::quantize(DType::F32, &[3.0, -4.0]).unwrap())
        .unwrap();
    assert_eq!(t.read(&x), vec![3.0, -4.0]);
    assert_eq!(
        source.as_slice(),
        quant::quantize(DType::F32, &[1.0, 2.0]).unwrap()
    );
}

pub fn upload_checks_sizes_and_keeps_host_bytes(t: &Target) {
    let b = t.backend;
    for (dims, len) in [(&[2, 32][..], 67), (&[1, 32], 33), (&[2, 32], 69)] {
        let wrong = b.upload(DType::Q8_0, shape(dims), HostBytes::from_vec(vec![0; len]));
        assert!(wrong.is_err(), "{len} bytes for Q8_0 {dims:?}");
    }
    let source = HostBytes::from_vec(quant::quantize(DType::F32, &[1.0, 2.0]).unwrap());
    let mut x = b.upload(DType::F32, shape(&[2]), source.clone()).unwrap();
    b.scale(&mut x, 2.0).unwrap();
    assert_eq!(t.read(&x), vec![2.0, 4.0]);
    assert_eq!(
        source.as_slice(),
        quant::quantize(DType::F32, &[1.0, 2.0]).unwrap()
    );
}

pub fn shapes_that_do_not_fit_are_errors(t: &Target) {
    let b = t.backend;
    let w = t.zeros(DType::F32, &[4, 8]);
    // x's k, out's columns, out's rows: each wrong in turn against w [4, 8].
    for (x, out) in [([2, 7], [2, 4]), ([2, 8], [2, 5]), ([2, 8], [3, 4])] {
        let mut out_t = t.zeros(DType::F32, &out);
        assert!(
            b.matmul(&t.zeros(DType::F32, &x), &w, &mut out_t).is_err(),
            "x {x:?} into {out:?}"
        );
    }
    let q = t.upload(DType::Q4_0, &[8, 64], &[0.5; 512]);
    let x = t.upload(DType::F32, &[2, 32], &[1.0; 64]);
    assert!(
        b.matmul(&x, &q, &mut t.poisoned(&[2, 8])).is_err(),
        "k of 32 against 64"
    );
    let mut acc = t.zeros(DType::F32, &[2, 2]);
    assert!(b.add_assign(&mut acc, &w).is_err());
    assert!(b.mul_assign(&mut acc, &t.zeros(DType::F32, &[3])).is_err());
    let normed = &mut t.zeros(DType::F32, &[4, 8]);
    assert!(b
        .rms_norm(&w, &t.zeros(DType::F32, &[7]), 1e-5, normed)
        .is_err());
    assert!(b.silu_mul(&w, &acc, normed).is_err());
}

/// Positions: I32, one per row or query. Past the cache, or negative: for write_rows an
/// error, or (on devices that cannot report errors mid-step) skipped.
pub fn bad_positions_are_errors(t: &Target) {
    let b = t.backend;
    let (heads, kvh, hd) = (6, 2, 5);
    let rows = t.upload(
        DType::F32,
        &[2, kvh, hd],
        &random(&mut t.rng(0), 2 * kvh * hd, 1.0),
    );
    let mut cache = t.zeros(DType::F32, &[6, kvh, hd]);
    assert!(
        b.write_rows(&rows, &mut cache, &t.ints(&[3])).is_err(),
        "one position for two rows"
    );
    for bad in [[5, 6], [-1, 0]] {
        let mut cache = t.zeros(DType::F32, &[6, kvh, hd]);
        if b.write_rows(&rows, &mut cache, &t.ints(&bad)).is_ok() {
            // Skipped: nothing lands outside the rows the valid position names.
            let got = t.read(&cache);
            let valid = if bad[0] < 0 { 0 } else { 5 };
            let outside = got
                .chunks(kvh * hd)
                .enumerate()
                .filter(|&(r, row)| r != valid && row.iter().any(|&v| v != 0.0))
                .count();
            assert_eq!(outside, 0, "write_rows at {bad:?} wrote other rows");
        }
    }

    let f = t.upload(DType::F32, &[1], &[1.0]);
    let mut x = t.zeros(DType::F32, &[2, 1, 2]);
    assert!(
        b.rope(&mut x, &t.ints(&[0]), &f, RopeLayout::Neox).is_err(),
        "one position, two tokens"
    );
    let float_positions = t.zeros(DType::F32, &[2]);
    assert!(
        b.rope(&mut x, &float_positions, &f, RopeLayout::Neox)
            .is_err(),
        "F32 positions"
    );

    let q = t.zeros(DType::F32, &[2, heads, hd]);
    let k = t.zeros(DType::F32, &[4, kvh, hd]);
    let mut out = t.zeros(DType::F32, &[2, heads, hd]);
    let p = AttentionParams {
        scale: 1.0,
        softcap: None,
        window: None,
    };
    assert!(b
        .attention(&q, &k, &k, &t.ints(&[0, 3]), &p, &mut out)
        .is_ok());
    assert!(
        b.attention(&q, &k, &k, &t.ints(&[0]), &p, &mut out)
            .is_err(),
        "one position, two queries"
    );
}

/// Positions past a cache or negative are errors where the backend can see them (the
/// host's backends; a GPU reads positions on the device, mid-step).
pub fn positions_out_of_range_are_errors(t: &Target) {
    let b = t.backend;
    let (heads, kvh, hd) = (6, 2, 5);
    let q = t.zeros(DType::F32, &[2, heads, hd]);
    let k = t.zeros(DType::F32, &[4, kvh, hd]);
    let mut out = t.zeros(DType::F32, &[2, heads, hd]);
    let p = AttentionParams {
        scale: 1.0,
        softcap: None,
        window: None,
    };
    for bad in [[3, 4], [-1, 0]] {
        let positions = t.ints(&bad);
        let attention = b.attention(&q, &k, &k, &positions, &p, &mut out);
        assert!(attention.is_err(), "attention at {bad:?} over a cache of 4");
        let rows = t.zeros(DType::F32, &[2, kvh, hd]);
        let mut cache = t.zeros(DType::F32, &[4, kvh, hd]);
        let write = b.write_rows(&rows, &mut cache, &positions);
        assert!(write.is_err(), "write_rows at {bad:?} into 4 rows");
    }
    let f = t.upload(DType::F32, &[1], &[1.0]);
    let mut x = t.zeros(DType::F32, &[2, 1, 2]);
    let rope = b.rope(&mut x, &t.ints(&[0, -1]), &f, RopeLayout::Neox);
    assert!(rope.is_err(), "rope at a negative position");
}

/// A buffer of a device that is not the backend's.
#[derive(Debug)]
struct Elsewhere(Device);

impl Storage for Elsewhere {
    fn device(&self) -> Device {
        self.0
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

pub fn tensors_of_another_device_are_refused(t: &Target) {
    let b = t.backend;
    let other = match b.device() {
        Device::Cuda(_) => Device::Wgpu(7),
        _ => Device::Cuda(7),
    };
    let foreign = || Tensor::from_storage(Box::new(Elsewhere(other)), DType::F32, shape(&[2, 4]));
    let w = t.zeros(DType::F32, &[3, 4]);
    let mut out = t.zeros(DType::F32, &[2, 3]);
    let named = |e: kiln_core::Error| assert!(e.to_string().contains(&other.to_string()), "{e}");
    named(b.matmul(&foreign(), &w, &mut out).unwrap_err());
    let x = t.zeros(DType::F32, &[2, 4]);
    named(b.add_assign(&mut foreign(), &x).unwrap_err());
    named(
        b.add_assign(&mut t.zeros(DType::F32, &[2, 4]), &foreign())
            .unwrap_err(),
    );
    named(b.download(&foreign()).unwrap_err());
}

pub fn a_tensor_larger_than_memory_is_an_error(t: &Target) {
    // 2^62 bytes: more than any device holds, and than any address space maps.
    let huge = t.backend.zeros(DType::F32, shape(&[1 << 31, 1 << 29]));
    assert!(huge.is_err());
}

/// A recorded step (where the backend records) replayed with new q and position, against
/// float64 each time; where it does not record, the step ran once, and that is checked.
pub fn recorded_steps_replay_on_new_contents(t: &Target) {
    let b = t.backend;
    let mut rng = t.rng(0);
    let (heads, hd, cap) = (4, 32, 600);
    let kv = random(&mut rng, cap * heads * hd, 1.0);
    let k = t.upload(DType::F32, &[cap, heads, hd], &kv);
    let mut qv = random(&mut rng, heads * hd, 1.0);
    let mut q = t.upload(DType::F32, &[1, heads, hd], &qv);
    let mut pos = t.ints(&[0]);
    let mut out = t.poisoned(&[1, heads, hd]);
    let shape = AttentionShape {
        heads,
        kv_heads: heads,
        head_dim: hd,
        scale: 0.2,
        softcap: None,
        window: None,
    };
    let params = AttentionParams {
        scale: shape.scale,
        softcap: None,
        window: None,
    };
    let want = |qv: &[f32], p: i32| reference::attention(qv, &kv, &kv, &[p], shape);
    // Warm up (an op may allocate its scratch the first time), then record.
    b.attention(&q, &k, &k, &pos, &params, &mut out).unwrap();
    let replay = b
        .capture(&mut || b.attention(&q, &k, &k, &pos, &params, &mut out))
        .unwrap();
    let Some(replay) = replay else {
        assert_close(
            &t.read(&out),
            &want(&qv, 0),
            2e-5,
            "a step that ran when not recorded",
        );
        return;
    };
    for p in [3i32, 290, 599] {
        qv = random(&mut rng, heads * hd, 1.0);
        b.write(&mut q, &quant::quantize(DType::F32, &qv).unwrap())
            .unwrap();
        b.write(&mut pos, &p.to_le_bytes()).unwrap();
        replay.replay().unwrap();
        assert_close(
            &t.read(&out),
            &want(&qv, p),
            2e-5,
            &format!("replay at {p}"),
        );
    }
}
