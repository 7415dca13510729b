//! `kiln convert`: a Hugging Face directory converted to GGUF must compute the same
//! logits as the directory itself, for each architecture convert writes; and convert must
//! refuse, before writing, a checkpoint that disagrees with its config or an output path
//! that is one of its inputs, leaving any earlier output intact.

use kiln_core::DType;
use kiln_cpu::CpuBackend;
use kiln_io::gguf::{GgufFile, Value};
use kiln_models::{convert_hf_to_gguf, Logits, Model};
use serde_json::{json, Value as Json};
use std::path::{Path, PathBuf};
use std::sync::Arc;

fn fixture_hf(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
        .join("hf")
}

fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-convert-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn backend() -> Arc<CpuBackend> {
    Arc::new(CpuBackend::new(Some(1)).unwrap())
}

fn logits(mut model: Model, ids: &[u32]) -> Vec<f32> {
    let mut cache = model.new_cache(64, DType::F32).unwrap();
    model.forward(ids, 0, &mut cache, Logits::All).unwrap()
}

/// Convert `dir` to f32 GGUF and compare the logits of both on `ids`; returns the GGUF.
fn round_trip(dir: &Path, out_dir: &Path, ids: &[u32]) -> PathBuf {
    let out = out_dir.join("model.gguf");
    convert_hf_to_gguf(dir, &out, DType::F32, "test").unwrap();
    let hf = logits(Model::from_hf_dir(dir, backend(), None).unwrap(), ids);
    let file = GgufFile::open(&out).unwrap();
    let gguf = logits(Model::from_gguf(&file, backend(), None).unwrap(), ids);
    assert_eq!(hf.len(), gguf.len());
    let max_diff = hf
        .iter()
        .zip(&gguf)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    let scale = hf.iter().map(|v| v.abs()).fold(0f32, f32::max);
    assert!(scale > 0.0, "{}: logits are not all zero", dir.display());
    assert!(
        max_diff < 1e-4,
        "{}: max |Δlogit| {max_diff} (largest logit {scale})",
        dir.display()
    );
    out
}

const PROMPT: &[u32] = &[1, 5, 17, 42, 100, 383, 7, 7, 250];

#[test]
fn llama_llama3_and_mistral_fixtures_round_trip() {
    // llama3's rope scaling travels as rope_freqs.weight; its embeddings are tied.
    for name in ["llama", "llama3", "mistral"] {
        let out = temp_dir(name);
        round_trip(&fixture_hf(name), &out, PROMPT);
        std::fs::remove_dir_all(&out).unwrap();
    }
}

/// Writes a safetensors file of f32 tensors.
fn write_safetensors(path: &Path, tensors: &[(String, Vec<usize>, Vec<f32>)]) {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, shape, values) in tensors {
        let start = data.len();
        data.extend(values.iter().flat_map(|v| v.to_le_bytes()));
        header.insert(
            name.clone(),
            json!({"dtype": "F32", "shape": shape, "data_offsets": [start, data.len()]}),
        );
    }
    let mut header = Json::Object(header).to_string().into_bytes();
    while !header.len().is_multiple_of(8) {
        header.push(b' ');
    }
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend(header);
    bytes.extend(data);
    std::fs::write(path, bytes).unwrap();
}

/// A random-weight Mistral with the mistral fixture's tokenizer and `config` changes;
/// `shape_of` may change any tensor's shape (to make the checkpoint disagree).
fn generated_model(
    tag: &str,
    edit: impl FnOnce(&mut Json),
    shape_of: impl Fn(&str, Vec<usize>) -> Vec<usize>,
) -> PathBuf {
    let dir = temp_dir(tag);
    let src = fixture_hf("mistral");
    for name in ["tokenizer.json", "tokenizer.model", "tokenizer_config.json"] {
        std::fs::copy(src.join(name), dir.join(name)).unwrap();
    }
    let mut config: Json =
        serde_json::from_slice(&std::fs::read(src.join("config.json")).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let n = |k: &str| config[k].as_u64().unwrap() as usize;
    let (dim, ffn, vocab) = (n("hidden_size"), n("intermediate_size"), n("vocab_size"));
    let (heads, kv_heads, head_dim) = (
        n("num_attention_heads"),
        n("num_key_value_heads"),
        n("head_dim"),
    );
    let (q, kv) = (heads * head_dim, kv_heads * head_dim);
    let mut shapes = vec![("model.embed_tokens.weight".to_string(), vec![vocab, dim])];
    for l in 0..n("num_hidden_layers") {
        let p = |s: &str| format!("model.layers.{l}.{s}.weight");
        shapes.extend([
            (p("input_layernorm"), vec![dim]),
            (p("self_attn.q_proj"), vec![q, dim]),
            (p("self_attn.k_proj"), vec![kv, dim]),
            (p("self_attn.v_proj"), vec![kv, dim]),
            (p("self_attn.o_proj"), vec![dim, q]),
            (p("mlp.gate_proj"), vec![ffn, dim]),
            (p("mlp.up_proj"), vec![ffn, dim]),
            (p("mlp.down_proj"), vec![dim, ffn]),
            (p("post_attention_layernorm"), vec![dim]),
        ]);
    }
    shapes.push(("model.norm.weight".into(), vec![dim]));
    shapes.push(("lm_head.weight".into(), vec![vocab, dim]));
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut uniform = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 11) as f32 / (1u64 << 53) as f32 - 0.5
    };
    let tensors: Vec<_> = shapes
        .into_iter()
        .map(|(name, shape)| {
            let shape = shape_of(&name, shape);
            let len = shape.iter().product();
            let norm = name.contains("norm");
            let values = (0..len)
                .map(|_| {
                    if norm {
                        1.0 + 0.1 * uniform()
                    } else {
                        0.3 * uniform()
                    }
                })
                .collect();
            (name, shape, values)
        })
        .collect();
    write_safetensors(&dir.join("model.safetensors"), &tensors);
    dir
}

#[test]
fn head_dim_other_than_dim_over_heads_round_trips() {
    // Mistral-Nemo's shape in miniature: 4 heads of 32 on a width of 64.
    let dir = generated_model("nemo", |c| c["head_dim"] = json!(32), |_, s| s);
    let out = round_trip(&dir, &dir, PROMPT);
    let f = GgufFile::open(&out).unwrap();
    for key in ["attention.key_length", "attention.value_length"] {
        assert_eq!(
            f.get(&format!("mistral.{key}")),
            Some(&Value::U32(32)),
            "{key}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

fn convert_error(dir: &Path, out: &Path) -> String {
    let err = convert_hf_to_gguf(dir, out, DType::F32, "test")
        .unwrap_err()
        .to_string();
    assert!(!err.contains('\n'), "one line: {err}");
    err
}

/// Files in `dir` and their contents.
fn snapshot(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let p = e.unwrap().path();
            let bytes = std::fs::read(&p).unwrap_or_default();
            (p, bytes)
        })
        .collect();
    files.sort();
    files
}

type ConfigEdit = Box<dyn Fn(&mut Json)>;
type ShapeEdit = Box<dyn Fn(&str, Vec<usize>) -> Vec<usize>>;

#[test]
fn an_inconsistent_checkpoint_is_refused_before_writing() {
    let cases: Vec<(&str, ConfigEdit, ShapeEdit, &str)> = vec![
        (
            "zero-kv",
            Box::new(|c| c["num_key_value_heads"] = json!(0)),
            Box::new(|_, s| s),
            "config.json: num_key_value_heads is 0, expected a divisor of num_attention_heads 4",
        ),
        (
            "flat-q",
            Box::new(|_| {}),
            Box::new(|n, s| {
                if n.ends_with("1.self_attn.q_proj.weight") {
                    vec![s.iter().product()]
                } else {
                    s
                }
            }),
            ": tensor model.layers.1.self_attn.q_proj.weight is [4096], the config implies [64, 64]",
        ),
        (
            "short-k",
            Box::new(|_| {}),
            Box::new(|n, s| {
                if n.ends_with("0.self_attn.k_proj.weight") {
                    vec![s[0] - 2, s[1]]
                } else {
                    s
                }
            }),
            ": tensor model.layers.0.self_attn.k_proj.weight is [30, 64], the config implies [32, 64]",
        ),
        (
            "vocab",
            Box::new(|c| c["vocab_size"] = json!(500)),
            Box::new(|_, s| s),
            ": tensor model.embed_tokens.weight is [384, 64], the config implies [500, 64]",
        ),
    ];
    for (tag, edit, shape_of, want) in cases {
        // The shapes come from the unedited config; the edit only changes config.json.
        let dir = generated_model(tag, |_| {}, shape_of);
        let config = dir.join("config.json");
        let mut c: Json = serde_json::from_slice(&std::fs::read(&config).unwrap()).unwrap();
        edit(&mut c);
        std::fs::write(&config, c.to_string()).unwrap();
        let out = dir.join("model.gguf");
        std::fs::write(&out, b"earlier output").unwrap();
        let before = snapshot(&dir);
        let err = convert_error(&dir, &out);
        assert!(err.ends_with(want), "{tag}: {err}");
        assert!(err.starts_with(&dir.display().to_string()), "{tag}: {err}");
        assert_eq!(
            snapshot(&dir),
            before,
            "{tag}: nothing written or left behind"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn an_output_that_is_an_input_is_refused() {
    let dir = generated_model("inputs", |_| {}, |_, s| s);
    let before = snapshot(&dir);
    let elsewhere = temp_dir("inputs-link");
    let link = elsewhere.join("link.gguf");
    std::os::unix::fs::symlink(dir.join("model.safetensors"), &link).unwrap();
    let through_dots = dir
        .join("..")
        .join(dir.file_name().unwrap())
        .join("config.json");
    for (out, input) in [
        (dir.join("model.safetensors"), "model.safetensors"),
        (dir.join("config.json"), "config.json"),
        (dir.join("tokenizer.model"), "tokenizer.model"),
        (through_dots, "config.json"),
        (link.clone(), "model.safetensors"),
    ] {
        let err = convert_error(&dir, &out);
        assert_eq!(
            err,
            format!(
                "the output {} is the input file {}; write the GGUF to another path",
                out.display(),
                dir.join(input).display()
            )
        );
    }
    let err = convert_error(&dir, &elsewhere);
    assert_eq!(
        err,
        format!(
            "the output {} is a directory; give the path of the GGUF file to write",
            elsewhere.display()
        )
    );
    assert_eq!(snapshot(&dir), before, "the inputs are untouched");

    // A good conversion replaces an earlier output whole, and leaves nothing else.
    let out = elsewhere.join("model.gguf");
    std::fs::write(&out, b"earlier output").unwrap();
    convert_hf_to_gguf(&dir, &out, DType::Q8_0, "test").unwrap();
    GgufFile::open(&out).unwrap();
    let mut names: Vec<_> = std::fs::read_dir(&elsewhere)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    names.sort();
    assert_eq!(names, ["link.gguf", "model.gguf"]);
    std::fs::remove_dir_all(&dir).unwrap();
    std::fs::remove_dir_all(&elsewhere).unwrap();
}
