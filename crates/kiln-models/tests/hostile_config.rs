//! Hostile configurations, in GGUF metadata and in config.json: each must be refused
//! before anything is sized by it, with one line naming the key and the value found.
//! The fixtures' tiny models are rewritten with one key changed. The allocator of this
//! test binary refuses any single allocation above 256 MiB (the process aborts), so a
//! configuration that reaches a huge allocation fails the run instead of passing slowly.

use kiln_cpu::CpuBackend;
use kiln_io::gguf::{GgufFile, GgufWriter, Value};
use kiln_models::Model;
use serde_json::{json, Value as Json};
use std::alloc::{GlobalAlloc, Layout, System};
use std::path::{Path, PathBuf};
use std::sync::Arc;

struct CappedAlloc;

const ALLOC_CAP: usize = 256 << 20;

unsafe impl GlobalAlloc for CappedAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if layout.size() > ALLOC_CAP {
            return std::ptr::null_mut();
        }
        System.alloc(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if layout.size() > ALLOC_CAP {
            return std::ptr::null_mut();
        }
        System.alloc_zeroed(layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > ALLOC_CAP {
            return std::ptr::null_mut();
        }
        System.realloc(ptr, layout, new_size)
    }
}

#[global_allocator]
static ALLOC: CappedAlloc = CappedAlloc;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

/// The fixture `file` with metadata `changes` applied (`None` removes the key), loaded;
/// the error's message without the file name that starts it.
fn gguf_error(file: &str, changes: &[(&str, Option<Value>)]) -> String {
    gguf_error_with(file, changes, None)
}

/// As [`gguf_error`], with the f32 tensor `replace.0` replaced by `replace.1`.
fn gguf_error_with(
    file: &str,
    changes: &[(&str, Option<Value>)],
    replace: Option<(&str, &[f32])>,
) -> String {
    let src = GgufFile::open(fixture(file)).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in &src.metadata {
        if !changes.iter().any(|(c, _)| c == k) {
            w.set(k, v.clone()).unwrap();
        }
    }
    for (k, v) in changes {
        if let Some(v) = v {
            w.set(k, v.clone()).unwrap();
        }
    }
    for t in &src.tensors {
        match replace {
            Some((name, values)) if name == t.name => {
                let data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
                let ne = vec![values.len() as u64];
                w.add_raw_tensor(&t.name, t.ggml_type, ne, data).unwrap();
            }
            _ => {
                let data = src.tensor_data(t).to_vec();
                w.add_raw_tensor(&t.name, t.ggml_type, t.ne.clone(), data)
                    .unwrap();
            }
        }
    }
    let mut bytes = Vec::new();
    w.write_to(&mut bytes).unwrap();
    let f = GgufFile::from_bytes("hostile.gguf", bytes).unwrap();
    let err = match Model::from_gguf(&f, Arc::new(CpuBackend::new(Some(1)).unwrap()), None) {
        Ok(_) => return "loaded".into(),
        Err(e) => e.to_string(),
    };
    assert!(!err.contains('\n'), "one line: {err}");
    assert!(err.contains("hostile.gguf: "), "names the file: {err}");
    err.replacen("hostile.gguf: ", "", 1)
}

fn llama(changes: &[(&str, Option<Value>)]) -> String {
    gguf_error("llama/llama-f32.gguf", changes)
}

#[test]
fn gguf_metadata_out_of_domain_is_refused_by_key_and_value() {
    let set = |k: &'static str, v: Value| [(k, Some(v))];
    type Changes = Vec<(&'static str, Option<Value>)>;
    let cases: Vec<(Changes, &str)> = vec![
        (vec![], "loaded"),
        (
            set("llama.attention.key_length", Value::U32(16)).into(),
            "loaded",
        ),
        (
            vec![("llama.embedding_length", None)],
            "metadata llama.embedding_length is missing",
        ),
        (
            set("llama.embedding_length", Value::I32(-64)).into(),
            "metadata llama.embedding_length is -64 (i32), expected a non-negative integer",
        ),
        (
            set("llama.embedding_length", Value::U64(1 << 40)).into(),
            "llama.embedding_length is 1099511627776, expected 1 to 1048576",
        ),
        (
            set("llama.attention.head_count", Value::String("four".into())).into(),
            "metadata llama.attention.head_count is \"four\" (string), expected a non-negative integer",
        ),
        (
            set("llama.attention.head_count", Value::U32(0)).into(),
            "llama.attention.head_count is 0, expected 1 to 1048576",
        ),
        (
            set("llama.attention.head_count_kv", Value::U32(0)).into(),
            "llama.attention.head_count_kv is 0, expected a divisor of llama.attention.head_count 4",
        ),
        (
            set("llama.attention.head_count_kv", Value::U32(3)).into(),
            "llama.attention.head_count_kv is 3, expected a divisor of llama.attention.head_count 4",
        ),
        (
            set("llama.attention.key_length", Value::U32(0)).into(),
            "llama.attention.key_length is 0, expected 1 to 1048576",
        ),
        // 4 heads × 2^62 wraps to 0 in 64 bits.
        (
            set("llama.attention.key_length", Value::U64(1 << 62)).into(),
            "llama.attention.key_length is 4611686018427387904, expected 1 to 1048576",
        ),
        (
            set("llama.attention.key_length", Value::U32(1 << 19)).into(),
            "llama.attention.key_length is 524288, expected at most 262144 (llama.attention.head_count 4 × llama.attention.key_length must not exceed 1048576)",
        ),
        (
            set("llama.attention.value_length", Value::U32(32)).into(),
            "unsupported: metadata llama.attention.value_length is 32 and the key length 16; kiln needs them equal",
        ),
        (
            set("llama.rope.dimension_count", Value::U64(1 << 40)).into(),
            "llama.rope.dimension_count is 1099511627776, expected an even number from 2 to llama.attention.key_length 16",
        ),
        (
            set("llama.rope.dimension_count", Value::U32(7)).into(),
            "llama.rope.dimension_count is 7, expected an even number from 2 to llama.attention.key_length 16",
        ),
        (
            set("llama.rope.dimension_count", Value::U32(0)).into(),
            "llama.rope.dimension_count is 0, expected an even number from 2 to llama.attention.key_length 16",
        ),
        (
            set("llama.rope.freq_base", Value::F32(f32::NAN)).into(),
            "llama.rope.freq_base is NaN, expected a finite number > 0",
        ),
        (
            set("llama.rope.freq_base", Value::F32(-10000.0)).into(),
            "llama.rope.freq_base is -10000, expected a finite number > 0",
        ),
        (
            set("llama.rope.freq_base", Value::F32(0.0)).into(),
            "llama.rope.freq_base is 0, expected a finite number > 0",
        ),
        (
            set("llama.rope.freq_base", Value::F64(1e300)).into(),
            "llama.rope.freq_base is inf, expected a finite number > 0",
        ),
        (
            set("llama.rope.freq_base", Value::Bool(true)).into(),
            "metadata llama.rope.freq_base is true (bool), expected a number",
        ),
        (
            set("llama.attention.layer_norm_rms_epsilon", Value::F32(-1e-5)).into(),
            "llama.attention.layer_norm_rms_epsilon is -0.00001, expected a finite number ≥ 0",
        ),
        (
            set("llama.attention.layer_norm_rms_epsilon", Value::F32(f32::NAN)).into(),
            "llama.attention.layer_norm_rms_epsilon is NaN, expected a finite number ≥ 0",
        ),
        (
            set("llama.attention.layer_norm_rms_epsilon", Value::F32(0.0)).into(),
            "loaded",
        ),
        (
            set("llama.context_length", Value::U32(0)).into(),
            "llama.context_length is 0, expected 1 to 16777216",
        ),
        (
            set("llama.context_length", Value::U64(u64::MAX)).into(),
            "llama.context_length is 18446744073709551615, expected 1 to 16777216",
        ),
        (
            set("llama.block_count", Value::U32(1_000_000)).into(),
            "metadata llama.block_count is 1000000, but the file holds only 21 tensors",
        ),
        (
            set("llama.block_count", Value::U32(0)).into(),
            "llama.block_count is 0, expected 1 to 65536",
        ),
        (
            set("llama.feed_forward_length", Value::U32(0)).into(),
            "llama.feed_forward_length is 0, expected 1 to 1048576",
        ),
        (
            set("llama.feed_forward_length", Value::F32(128.0)).into(),
            "metadata llama.feed_forward_length is 128.0 (f32), expected a non-negative integer",
        ),
        (
            set("llama.attention.sliding_window", Value::I64(-1)).into(),
            "metadata llama.attention.sliding_window is -1 (i64), expected a non-negative integer",
        ),
        (
            set("llama.attn_logit_softcapping", Value::F32(f32::NAN)).into(),
            "llama.attn_logit_softcapping is NaN, expected a finite number > 0",
        ),
        (
            set("llama.final_logit_softcapping", Value::F32(-30.0)).into(),
            "llama.final_logit_softcapping is -30, expected a finite number > 0",
        ),
        (
            set("general.architecture", Value::U32(7)).into(),
            "metadata general.architecture is 7 (u32), expected a string",
        ),
        // Rope scaling: linear runs (its factor checked), other types are refused rather
        // than ignored.
        (
            set("llama.rope.scaling.type", Value::String("yarn".into())).into(),
            "unsupported: rope scaling 'yarn' (kiln runs none and linear, and Llama 3's rope_freqs.weight)",
        ),
        (
            set("llama.rope.scaling.type", Value::U32(7)).into(),
            "metadata llama.rope.scaling.type is 7 (u32), expected a string",
        ),
        (
            vec![
                ("llama.rope.scaling.type", Some(Value::String("linear".into()))),
                ("llama.rope.scaling.factor", Some(Value::F32(0.0))),
            ],
            "metadata llama.rope.scaling.factor is 0, expected a positive number",
        ),
        (
            vec![
                ("llama.rope.scaling.type", Some(Value::String("linear".into()))),
                ("llama.rope.scaling.factor", Some(Value::F32(4.0))),
            ],
            "loaded",
        ),
        (
            set("llama.rope.scaling.type", Value::String("none".into())).into(),
            "loaded",
        ),
    ];
    for (changes, want) in cases {
        let got = llama(&changes);
        let want = want
            .strip_prefix("unsupported: hostile.gguf: ")
            .map_or(want.to_string(), |rest| rest.to_string());
        assert_eq!(got, want, "{changes:?}");
    }
}

#[test]
fn rope_frequency_factors_must_fit_the_rotated_pairs() {
    let file = "llama3/llama3-f32.gguf";
    assert_eq!(gguf_error(file, &[]), "loaded");
    let replaced = |values: &[f32]| gguf_error_with(file, &[], Some(("rope_freqs.weight", values)));
    assert_eq!(
        replaced(&[1.0; 3]),
        "tensor rope_freqs.weight is 3 values, expected 8 values (one per rotated pair)"
    );
    let mut values = [1.0f32; 8];
    values[5] = f32::NAN;
    assert_eq!(
        replaced(&values),
        "tensor rope_freqs.weight is holding NaN, expected finite values > 0"
    );
    values[5] = 0.0;
    assert_eq!(
        replaced(&values),
        "tensor rope_freqs.weight is holding 0, expected finite values > 0"
    );
}

#[test]
fn gpt2_positions_beyond_the_table_are_refused_at_load() {
    // The fixture's table has 256 rows.
    assert_eq!(
        gguf_error(
            "gpt2/gpt2-f32.gguf",
            &[("gpt2.context_length", Some(Value::U32(1024)))]
        ),
        "tensor position_embd.weight is [256, 64], the config implies [1024, 64]"
    );
    let got = hf_error("gpt2", |c| c["n_positions"] = json!(1024));
    assert_eq!(
        got,
        "tensor transformer.wpe.weight is [256, 64], the config implies [1024, 64]"
    );
}

/// A copy of the fixture's Hugging Face directory with its config.json edited.
fn hf_dir(name: &str, edit: impl FnOnce(&mut Json)) -> PathBuf {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("kiln-hostile-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = fixture(name).join("hf");
    for entry in std::fs::read_dir(&src).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.join(entry.file_name())).unwrap();
    }
    let mut config: Json =
        serde_json::from_slice(&std::fs::read(src.join("config.json")).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    dir
}

fn hf_error(name: &str, edit: impl FnOnce(&mut Json)) -> String {
    let dir = hf_dir(name, edit);
    let result = Model::from_hf_dir(&dir, Arc::new(CpuBackend::new(Some(1)).unwrap()), None);
    std::fs::remove_dir_all(&dir).unwrap();
    let err = match result {
        Ok(_) => return "loaded".into(),
        Err(e) => e.to_string(),
    };
    assert!(!err.contains('\n'), "one line: {err}");
    let prefix = format!("{}/config.json: ", dir.display());
    let prefix_dir = format!("{}: ", dir.display());
    err.strip_prefix(&prefix)
        .or_else(|| err.strip_prefix(&prefix_dir))
        .unwrap_or_else(|| panic!("names the file: {err}"))
        .to_string()
}

#[test]
fn config_json_out_of_domain_is_refused_by_key_and_value() {
    type Edit = Box<dyn FnOnce(&mut Json)>;
    let set = |k: &'static str, v: Json| -> Edit { Box::new(move |c: &mut Json| c[k] = v) };
    let cases: Vec<(&str, Edit, &str)> = vec![
        ("llama", Box::new(|_| {}), "loaded"),
        (
            "llama",
            set("num_key_value_heads", json!(-2)),
            "num_key_value_heads is -2, expected a non-negative integer",
        ),
        (
            "llama",
            set("num_key_value_heads", json!(0)),
            "num_key_value_heads is 0, expected a divisor of num_attention_heads 4",
        ),
        (
            "llama",
            set("num_key_value_heads", json!(3)),
            "num_key_value_heads is 3, expected a divisor of num_attention_heads 4",
        ),
        (
            "llama",
            set("hidden_size", json!("64")),
            "hidden_size is \"64\", expected a non-negative integer",
        ),
        (
            "llama",
            Box::new(|c: &mut Json| {
                c.as_object_mut().unwrap().remove("hidden_size");
            }),
            "hidden_size is missing",
        ),
        (
            "llama",
            set("num_attention_heads", json!(0)),
            "num_attention_heads is 0, expected 1 to 1048576",
        ),
        (
            "llama",
            Box::new(|c: &mut Json| {
                c["num_attention_heads"] = json!(0);
                c.as_object_mut().unwrap().remove("head_dim");
            }),
            "num_attention_heads is 0, expected 1 to hidden_size 64 (there is no head_dim)",
        ),
        (
            "llama",
            set("head_dim", json!(1u64 << 62)),
            "head_dim is 4611686018427387904, expected 1 to 1048576",
        ),
        (
            "llama",
            set("head_dim", json!(1 << 19)),
            "head_dim is 524288, expected at most 262144 (num_attention_heads 4 × head_dim must not exceed 1048576)",
        ),
        (
            "llama",
            set("head_dim", json!(1 << 18)),
            "tensor model.layers.0.self_attn.q_proj.weight is [64, 64], the config implies [1048576, 64]",
        ),
        (
            "llama",
            set("partial_rotary_factor", json!(1e6)),
            "partial_rotary_factor is 1000000, expected a number in (0, 1]",
        ),
        (
            "llama",
            set("partial_rotary_factor", json!(0)),
            "partial_rotary_factor is 0, expected a number in (0, 1]",
        ),
        (
            "llama",
            set("partial_rotary_factor", json!("half")),
            "partial_rotary_factor is \"half\", expected a number",
        ),
        (
            "llama",
            set("partial_rotary_factor", json!(0.05)),
            "head_dim × partial_rotary_factor is 0, expected an even number from 2 to head_dim 16",
        ),
        (
            "llama",
            set("head_dim", json!(15)),
            "head_dim × partial_rotary_factor is 15, expected an even number from 2 to head_dim 15",
        ),
        (
            "llama",
            set("rope_theta", json!(-1)),
            "rope_theta is -1, expected a finite number > 0",
        ),
        (
            "llama",
            set("rope_parameters", json!({"rope_theta": 0.0, "rope_type": "default"})),
            "rope_theta is 0, expected a finite number > 0",
        ),
        (
            "llama",
            set("rope_parameters", json!({"rope_theta": "x"})),
            "rope_parameters.rope_theta is \"x\", expected a number",
        ),
        (
            "llama",
            set("rms_norm_eps", json!(-1e-5)),
            "rms_norm_eps is -0.00001, expected a finite number ≥ 0",
        ),
        (
            "llama",
            set("rms_norm_eps", json!(1e39)),
            "rms_norm_eps is inf, expected a finite number ≥ 0",
        ),
        (
            "llama",
            set("rope_scaling", json!({"rope_type": "llama3", "factor": 0.0})),
            "rope_scaling.factor is 0, expected a finite number > 0",
        ),
        (
            "llama",
            set("rope_scaling", json!({"type": "linear", "factor": -2.0})),
            "rope_scaling.factor is -2, expected a finite number > 0",
        ),
        (
            "llama",
            set("rope_scaling", json!({"type": "linear", "factor": 2.0})),
            "loaded",
        ),
        (
            "llama",
            set(
                "rope_scaling",
                json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0}),
            ),
            "rope_scaling.high_freq_factor is 1, expected a finite number above rope_scaling.low_freq_factor 1",
        ),
        (
            "llama",
            set("rope_scaling", json!({"rope_type": "llama3", "low_freq_factor": -1.0})),
            "rope_scaling.low_freq_factor is -1, expected a finite number > 0",
        ),
        (
            "llama",
            set(
                "rope_scaling",
                json!({"rope_type": "llama3", "original_max_position_embeddings": 0}),
            ),
            "rope_scaling.original_max_position_embeddings is 0, expected a finite number > 0",
        ),
        (
            "llama",
            set(
                "rope_parameters",
                json!({"rope_type": "llama3", "rope_theta": 500000.0, "factor": -8.0}),
            ),
            "rope_parameters.factor is -8, expected a finite number > 0",
        ),
        (
            "llama",
            set("max_position_embeddings", json!(0)),
            "max_position_embeddings is 0, expected 1 to 16777216",
        ),
        (
            "llama",
            set("max_position_embeddings", json!(1_000_000_000_000u64)),
            "max_position_embeddings is 1000000000000, expected 1 to 16777216",
        ),
        (
            "llama",
            set("vocab_size", json!(0)),
            "vocab_size is 0, expected 1 to 16777216",
        ),
        (
            "llama",
            set("vocab_size", json!(1u64 << 40)),
            "vocab_size is 1099511627776, expected 1 to 16777216",
        ),
        (
            "llama",
            set("num_hidden_layers", json!(1_000_000_000)),
            "num_hidden_layers is 1000000000, expected 1 to 65536",
        ),
        (
            "llama",
            set("intermediate_size", json!(0)),
            "intermediate_size is 0, expected 1 to 1048576",
        ),
        (
            "llama",
            set("sliding_window", json!(-1)),
            "sliding_window is -1, expected a non-negative integer",
        ),
        (
            "llama",
            set("architectures", json!("LlamaForCausalLM")),
            "architectures is \"LlamaForCausalLM\", expected a list of strings",
        ),
        (
            "mistral",
            set("use_sliding_window", json!("yes")),
            "use_sliding_window is \"yes\", expected true or false",
        ),
        (
            "gemma2",
            set("layer_types", json!(["sliding_attention"])),
            "layer_types has 1 entries, expected num_hidden_layers 4",
        ),
        (
            "gemma2",
            set("layer_types", json!([1, 2])),
            "layer_types is [1,2], expected a list of strings",
        ),
        (
            "gemma2",
            set("query_pre_attn_scalar", json!(-4)),
            "query_pre_attn_scalar is -4, expected a finite number > 0",
        ),
        (
            "gemma2",
            set("final_logit_softcapping", json!(0)),
            "final_logit_softcapping is 0, expected a finite number > 0",
        ),
        (
            "gemma2",
            set("attn_logit_softcapping", json!(-50.0)),
            "attn_logit_softcapping is -50, expected a finite number > 0",
        ),
        (
            "gpt2",
            set("layer_norm_epsilon", json!(-1)),
            "layer_norm_epsilon is -1, expected a finite number ≥ 0",
        ),
        (
            "gpt2",
            set("n_head", json!(3)),
            "tensor transformer.h.0.attn.c_attn.weight is [192, 64], the config implies [189, 64]",
        ),
    ];
    for (fixture, edit, want) in cases {
        assert_eq!(hf_error(fixture, edit), want, "{fixture}");
    }
}

/// A directory that holds no config.json is not a model: the error says that and what to
/// give instead, not which file was missing (`kiln run -m /tmp` said
/// "/tmp/config.json: No such file or directory").
#[test]
fn a_directory_without_a_config_is_not_a_model() {
    let dir = std::env::temp_dir().join(format!("kiln-no-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("notes.txt"), "x").unwrap();
    let backend: Arc<dyn kiln_core::Backend> = Arc::new(CpuBackend::new(Some(1)).unwrap());
    let err = match Model::from_hf_dir(&dir, backend, None) {
        Ok(_) => panic!("a directory without config.json loaded"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains("not a Hugging Face model directory (no config.json)"),
        "{err}"
    );
    let out = dir.join("x.gguf");
    let err = kiln_models::convert_hf_to_gguf(&dir, &out, kiln_core::DType::F32, "x")
        .unwrap_err()
        .to_string();
    assert!(err.contains("no config.json"), "{err}");
    assert!(!out.exists());
    std::fs::remove_dir_all(&dir).unwrap();
}
