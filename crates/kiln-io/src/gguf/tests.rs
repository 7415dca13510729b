use super::*;
use kiln_core::{quant, DType};

fn sample_writer() -> GgufWriter {
    let mut w = GgufWriter::new();
    w.set("general.architecture", Value::String("llama".into()))
        .unwrap();
    w.set("u8", Value::U8(7)).unwrap();
    w.set("i8", Value::I8(-7)).unwrap();
    w.set("u16", Value::U16(65535)).unwrap();
    w.set("i16", Value::I16(-300)).unwrap();
    w.set("u32", Value::U32(1 << 31)).unwrap();
    w.set("i32", Value::I32(-1 << 30)).unwrap();
    w.set("f32", Value::F32(1.5)).unwrap();
    w.set("bool", Value::Bool(true)).unwrap();
    w.set("u64", Value::U64(u64::MAX)).unwrap();
    w.set("i64", Value::I64(i64::MIN)).unwrap();
    w.set("f64", Value::F64(-2.25)).unwrap();
    w.set(
        "strings",
        Value::Array(Array::String(vec!["a".into(), "ü🙂".into(), String::new()])),
    )
    .unwrap();
    w.set(
        "nested",
        Value::Array(Array::Array(vec![
            Array::I32(vec![1, 2]),
            Array::F64(vec![]),
        ])),
    )
    .unwrap();
    let x: Vec<f32> = (0..512).map(|i| (i as f32 * 0.37).sin()).collect();
    w.add_tensor(
        "f32",
        DType::F32,
        &[2, 256],
        quant::quantize(DType::F32, &x).unwrap(),
    )
    .unwrap();
    w.add_tensor(
        "q4k",
        DType::Q4_K,
        &[2, 256],
        quant::quantize(DType::Q4_K, &x).unwrap(),
    )
    .unwrap();
    w.add_tensor(
        "q8",
        DType::Q8_0,
        &[512],
        quant::quantize(DType::Q8_0, &x).unwrap(),
    )
    .unwrap();
    w
}

#[test]
fn writer_output_reads_back() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.gguf");
    let w = sample_writer();
    w.write_file(&path).unwrap();
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.version, 3);
    assert_eq!(f.architecture(), Some("llama"));
    assert_eq!(f.metadata.len(), 14);
    assert_eq!(f.get("i64"), Some(&Value::I64(i64::MIN)));
    assert_eq!(f.get("u16").and_then(Value::as_u64), Some(65535));
    assert_eq!(
        f.get("nested"),
        Some(&Value::Array(Array::Array(vec![
            Array::I32(vec![1, 2]),
            Array::F64(vec![])
        ])))
    );
    let t = f.tensor("q4k").unwrap();
    assert_eq!(t.ne, vec![256, 2]);
    assert_eq!(t.shape().unwrap().dims(), &[2, 256]);
    assert_eq!(t.ggml_type.name, "q4_K");
    assert_eq!(t.size_bytes, 288);
    assert_eq!(f.data_offset % 32, 0);
    for t in &f.tensors {
        assert_eq!(t.offset % 32, 0);
    }
    let mut bytes = Vec::new();
    w.write_to(&mut bytes).unwrap();
    let q8 = f.tensor("q8").unwrap();
    assert_eq!(
        f.tensor_data(q8),
        &bytes[(f.data_offset + q8.offset) as usize..][..544]
    );
}

#[test]
fn custom_alignment_is_honoured() {
    let mut w = sample_writer();
    w.set_alignment(64).unwrap();
    let mut bytes = Vec::new();
    w.write_to(&mut bytes).unwrap();
    let p = read::parse(&bytes).unwrap();
    assert_eq!(p.alignment, 64);
    assert!(p.tensors.iter().all(|t| t.offset % 64 == 0));
    assert!(w.set_alignment(48).is_err());
}

#[test]
fn every_truncation_is_an_error() {
    let mut bytes = Vec::new();
    sample_writer().write_to(&mut bytes).unwrap();
    for cut in 0..bytes.len() {
        assert!(read::parse(&bytes[..cut]).is_err(), "cut at {cut} parsed");
    }
    assert!(read::parse(&bytes).is_ok());
}

#[test]
fn writer_refuses_what_readers_would() {
    let mut w = GgufWriter::new();
    assert!(w.add_tensor("a", DType::Q8_0, &[33], vec![0; 34]).is_err());
    assert!(w.add_tensor("a", DType::F32, &[2], vec![0; 8]).is_ok());
    assert!(w.add_tensor("a", DType::F32, &[2], vec![0; 8]).is_err());
    assert!(w
        .add_tensor("b", DType::F32, &[1, 1, 1, 1, 1], vec![0; 4])
        .is_err());
}

/// Tensors made while the file is written give the file of tensors given up front, each
/// made once a write; a tensor made of the wrong length, or whose making fails, fails
/// the write with its name.
#[test]
fn tensors_made_while_writing_read_back_as_given() {
    let mut given = Vec::new();
    sample_writer().write_to(&mut given).unwrap();
    let file = read::parse(&given).unwrap();
    let made = std::cell::Cell::new(0);
    let mut w = GgufWriter::new();
    for (k, v) in &file.metadata {
        w.set(k, v.clone()).unwrap();
    }
    for t in &file.tensors {
        let dims: Vec<usize> = t.shape().unwrap().dims().to_vec();
        w.add_tensor_later(&t.name, t.ggml_type.dtype().unwrap(), &dims)
            .unwrap();
    }
    assert_eq!(w.tensor_data_len(), sample_writer().tensor_data_len());
    let err = w.write_to(&mut Vec::new()).unwrap_err().to_string();
    assert!(err.contains("write_to_making"), "{err}");
    let mut later = Vec::new();
    w.write_to_making(&mut later, |name| {
        made.set(made.get() + 1);
        let t = file.tensors.iter().find(|t| t.name == name).unwrap();
        Ok(given[(file.data_offset + t.offset) as usize..][..t.size_bytes as usize].to_vec())
    })
    .unwrap();
    assert!(later == given, "the files differ");
    assert_eq!(made.get(), file.tensors.len());

    let mut short = GgufWriter::new();
    short.add_tensor_later("short", DType::F32, &[3]).unwrap();
    let err = short
        .write_to_making(&mut Vec::new(), |_| Ok(vec![0; 8]))
        .unwrap_err()
        .to_string();
    assert!(err.contains("'short'") && err.contains("8 bytes"), "{err}");
    let err = short
        .write_to_making(&mut Vec::new(), |_| {
            Err(kiln_core::Error::Device("the device went away".into()))
        })
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("the device went away") && err.contains("'short'"),
        "{err}"
    );
}

/// `GgufFile::set` changes a key of the opened file in memory and adds a missing one,
/// both then read by `get`.
#[test]
fn an_opened_files_metadata_can_be_set() {
    let mut bytes = Vec::new();
    sample_writer().write_to(&mut bytes).unwrap();
    let mut f = GgufFile::from_bytes("t.gguf", bytes).unwrap();
    f.set("general.architecture", Value::String("mistral".into()));
    f.set("general.name", Value::String("renamed".into()));
    assert_eq!(f.architecture(), Some("mistral"));
    assert_eq!(
        f.get("general.name"),
        Some(&Value::String("renamed".into()))
    );
    assert_eq!(f.metadata.len(), 15);
}

/// A released tensor's pages leave the process but not the file: its bytes (spanning
/// several whole pages here) read back unchanged, in a mapped file and in one held in
/// memory alike.
#[test]
fn released_tensor_bytes_read_back_unchanged() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.gguf");
    let mut w = GgufWriter::new();
    let x: Vec<f32> = (0..64 * 1024).map(|i| (i as f32 * 0.01).cos()).collect();
    let data = quant::quantize(DType::F32, &x).unwrap();
    w.add_tensor("w", DType::F32, &[64, 1024], data.clone())
        .unwrap();
    w.write_file(&path).unwrap();
    let mut image = Vec::new();
    w.write_to(&mut image).unwrap();
    for f in [
        GgufFile::open(&path).unwrap(),
        GgufFile::from_bytes("in memory", image).unwrap(),
    ] {
        let t = f.tensor("w").unwrap();
        let bytes = f.tensor_bytes(t).unwrap();
        assert_eq!(bytes.as_slice(), &data[..]);
        bytes.release();
        assert_eq!(bytes.as_slice(), &data[..], "{}", f.path.display());
        assert_eq!(f.tensor_data(t), &data[..]);
    }
}
