//! Cross-checks with the `gguf` Python package, llama.cpp's own reader and writer, in both
//! directions (see scripts/gguf_crosscheck.py). CI installs gguf-py and sets
//! KILN_REQUIRE_GGUF_PY=1, so there these tests fail rather than skip when it is missing.

use kiln_core::{quant, DType};
use kiln_io::gguf::{Array, GgufFile, GgufWriter, Value};
use rand::{rngs::StdRng, Rng, SeedableRng};
use serde_json::Value as Json;
use std::path::{Path, PathBuf};
use std::process::Command;

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/gguf_crosscheck.py")
}

/// Whether gguf-py can be used; when it cannot and CI requires it, fail.
fn gguf_py_available() -> bool {
    let ok = Command::new("python3")
        .args(["-c", "import gguf, numpy"])
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if !ok {
        assert!(
            std::env::var("KILN_REQUIRE_GGUF_PY").as_deref() != Ok("1"),
            "gguf-py is required (KILN_REQUIRE_GGUF_PY=1) but `python3 -c 'import gguf'` fails"
        );
        eprintln!("SKIPPED: the gguf Python package is not installed (pip install gguf)");
    }
    ok
}

fn run_script(args: &[&Path]) -> String {
    let out = Command::new("python3")
        .arg(script())
        .args(args)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "gguf_crosscheck.py failed:\n{text}");
    text
}

fn hex_f32(s: &str) -> Vec<f32> {
    let bytes: Vec<u8> = (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect();
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

/// The metadata value a JSON description stands for.
fn json_to_value(e: &Json) -> Value {
    let ty = e["type"].as_str().unwrap();
    let v = &e["value"];
    if ty == "array" {
        let items = v.as_array().unwrap();
        let array = match e["element"].as_str().unwrap() {
            "i32" => Array::I32(items.iter().map(|x| x.as_i64().unwrap() as i32).collect()),
            "f32" => Array::F32(items.iter().map(|x| x.as_f64().unwrap() as f32).collect()),
            "u8" => Array::U8(items.iter().map(|x| x.as_u64().unwrap() as u8).collect()),
            "bool" => Array::Bool(items.iter().map(|x| x.as_bool().unwrap()).collect()),
            "string" => Array::String(items.iter().map(|x| x.as_str().unwrap().into()).collect()),
            other => panic!("no test arrays of {other}"),
        };
        return Value::Array(array);
    }
    match ty {
        "u8" => Value::U8(v.as_u64().unwrap() as u8),
        "i8" => Value::I8(v.as_i64().unwrap() as i8),
        "u16" => Value::U16(v.as_u64().unwrap() as u16),
        "i16" => Value::I16(v.as_i64().unwrap() as i16),
        "u32" => Value::U32(v.as_u64().unwrap() as u32),
        "i32" => Value::I32(v.as_i64().unwrap() as i32),
        "f32" => Value::F32(v.as_f64().unwrap() as f32),
        "bool" => Value::Bool(v.as_bool().unwrap()),
        "string" => Value::String(v.as_str().unwrap().into()),
        "u64" => Value::U64(v.as_u64().unwrap()),
        "i64" => Value::I64(v.as_i64().unwrap()),
        "f64" => Value::F64(v.as_f64().unwrap()),
        other => panic!("unknown type {other}"),
    }
}

#[test]
fn kiln_reads_and_decodes_what_gguf_py_writes() {
    if !gguf_py_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (gguf, json) = (dir.path().join("py.gguf"), dir.path().join("py.json"));
    run_script(&[
        Path::new("write"),
        &gguf,
        &json,
        Path::new("--seed"),
        Path::new("7"),
    ]);
    let expect: Json = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let file = GgufFile::open(&gguf).unwrap();

    let metadata = expect["metadata"].as_object().unwrap();
    for (key, e) in metadata {
        assert_eq!(file.get(key), Some(&json_to_value(e)), "metadata {key}");
    }

    let src_info = file.tensor("src").unwrap();
    let src = quant::dequantize_to_vec(DType::F32, file.tensor_data(src_info), 3 * 512).unwrap();
    let py_quantizes: Vec<&str> = expect["py_quantizes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    let mut checked = 0;
    for (name, e) in expect["tensors"].as_object().unwrap() {
        let t = file
            .tensor(name)
            .unwrap_or_else(|| panic!("tensor {name} missing"));
        let type_name = e["type"].as_str().unwrap();
        assert_eq!(t.ggml_type.name, type_name, "{name}");
        let shape: Vec<usize> = e["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap() as usize)
            .collect();
        assert_eq!(t.shape().unwrap().dims(), &shape[..], "{name}");
        let want = hex_f32(e["values"].as_str().unwrap());
        let Some(dtype) = t.ggml_type.dtype() else {
            // A format kiln expands to f32 at load.
            let format = quant::ExpandedFormat::from_ggml_id(t.ggml_type.id).unwrap();
            let mut got = vec![0f32; want.len()];
            format.dequantize(file.tensor_data(t), &mut got).unwrap();
            for (i, (a, b)) in want.iter().zip(&got).enumerate() {
                assert_eq!(
                    a.to_bits(),
                    b.to_bits(),
                    "{name}: element {i}: gguf-py {a}, kiln {b}"
                );
            }
            checked += 1;
            continue;
        };
        let got = quant::dequantize_to_vec(dtype, file.tensor_data(t), want.len()).unwrap();
        for (i, (a, b)) in want.iter().zip(&got).enumerate() {
            assert_eq!(
                a.to_bits(),
                b.to_bits(),
                "{name}: element {i}: gguf-py {a}, kiln {b}"
            );
        }
        if py_quantizes.contains(&type_name) {
            let ours = quant::quantize(dtype, &src).unwrap();
            assert!(
                ours == file.tensor_data(t),
                "{type_name}: kiln's quantization differs from gguf-py's"
            );
        }
        checked += 1;
    }
    assert_eq!(checked, 12);
}

#[test]
fn gguf_py_reads_and_decodes_what_kiln_writes() {
    if !gguf_py_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // Take the metadata to write from gguf-py's own description of its test values.
    let (py_gguf, py_json) = (dir.path().join("py.gguf"), dir.path().join("py.json"));
    run_script(&[Path::new("write"), &py_gguf, &py_json]);
    let expect: Json = serde_json::from_str(&std::fs::read_to_string(&py_json).unwrap()).unwrap();

    let mut w = GgufWriter::new();
    for (key, e) in expect["metadata"].as_object().unwrap() {
        w.set(key, json_to_value(e)).unwrap();
    }
    let (rows, cols) = (4, 768);
    let mut rng = StdRng::seed_from_u64(11);
    let mut src: Vec<f32> = (0..rows * cols)
        .map(|_| rng.random_range(-2.0f32..2.0))
        .collect();
    src[300..332].fill(0.0);
    src[1000] = 40.0;
    w.add_tensor(
        "src",
        DType::F32,
        &[rows, cols],
        quant::quantize(DType::F32, &src).unwrap(),
    )
    .unwrap();
    for dtype in DType::ALL.into_iter().filter(|&d| d != DType::F32) {
        let q = quant::quantize(dtype, &src).unwrap();
        let deq = quant::dequantize_to_vec(dtype, &q, src.len()).unwrap();
        w.add_tensor(&format!("t.{}", dtype.name()), dtype, &[rows, cols], q)
            .unwrap();
        let deq = quant::quantize(DType::F32, &deq).unwrap();
        w.add_tensor(
            &format!("deq.{}", dtype.name()),
            DType::F32,
            &[rows, cols],
            deq,
        )
        .unwrap();
    }
    let kiln_gguf = dir.path().join("kiln.gguf");
    w.write_file(&kiln_gguf).unwrap();
    let out = run_script(&[Path::new("check"), &kiln_gguf, &py_json]);
    eprint!("{out}");
    assert!(out.contains("checks agree"), "{out}");
}
