//! `kiln info`: what a model file holds.

use kiln_core::Result;
use kiln_io::gguf::GgufFile;
use kiln_io::hf_config::HfConfig;
use kiln_io::safetensors::SafetensorsModel;
use kiln_io::{detect_format, FileFormat};
use std::fmt::Write as _;
use std::io::Write as _;
use std::path::Path;

pub fn run(path: &Path) -> Result<()> {
    let text = match detect_format(path)? {
        FileFormat::Gguf => describe_gguf(&GgufFile::open(path)?),
        FileFormat::Safetensors => {
            let model = SafetensorsModel::open_file(path)?;
            let mut out = format!("{}\nformat        safetensors\n", path.display());
            describe_safetensors(&model, &mut out);
            out
        }
        FileFormat::HfDirectory => describe_hf_dir(path)?,
    };
    // A closed pipe (`kiln info x | head`) is not an error worth a message.
    let _ = std::io::stdout().lock().write_all(text.as_bytes());
    Ok(())
}

/// One row of the tensor table.
struct Row {
    name: String,
    shape: String,
    dtype: String,
    bytes: u64,
    numel: u64,
}

fn describe_gguf(f: &GgufFile) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "{}", f.path.display());
    let _ = writeln!(
        out,
        "format        GGUF v{} (alignment {}, tensor data at byte {})",
        f.version, f.alignment, f.data_offset
    );
    let _ = writeln!(
        out,
        "architecture  {}",
        f.architecture().unwrap_or("(not stated)")
    );
    let _ = writeln!(out, "metadata      {} keys", f.metadata.len());
    let width = f.metadata.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    for (key, value) in &f.metadata {
        let _ = writeln!(
            out,
            "  {key:width$}  {:6}  {value}",
            value.value_type().name()
        );
    }
    let rows = f
        .tensors
        .iter()
        .map(|t| Row {
            name: t.name.clone(),
            shape: format_dims(t.ne.iter().rev()),
            dtype: t.ggml_type.name.to_string(),
            bytes: t.size_bytes,
            numel: t.numel(),
        })
        .collect::<Vec<_>>();
    table(&mut out, &rows);
    out
}

fn describe_safetensors(model: &SafetensorsModel, out: &mut String) {
    if model.files.len() > 1 {
        let _ = writeln!(out, "shards        {}", model.files.len());
    }
    if !model.metadata.is_empty() {
        let _ = writeln!(out, "metadata      {} keys", model.metadata.len());
        for (k, v) in &model.metadata {
            let _ = writeln!(out, "  {k} = {v:?}");
        }
    }
    let rows = model
        .tensors
        .iter()
        .map(|t| Row {
            name: t.name.clone(),
            shape: format_dims(t.shape.iter()),
            dtype: t.dtype_name(),
            bytes: t.size_bytes() as u64,
            numel: t.shape.iter().map(|&d| d as u64).product(),
        })
        .collect::<Vec<_>>();
    table(out, &rows);
}

fn describe_hf_dir(dir: &Path) -> Result<String> {
    let mut out = format!("{}\nformat        Hugging Face directory\n", dir.display());
    let config_path = dir.join("config.json");
    if config_path.is_file() {
        let c = HfConfig::load(&config_path)?;
        let _ = writeln!(
            out,
            "architecture  {}",
            c.architecture().unwrap_or("(not stated)")
        );
        let fields = [
            ("model_type", c.model_type.clone()),
            ("vocab_size", c.vocab_size.map(|v| v.to_string())),
            ("hidden_size", c.hidden_size.map(|v| v.to_string())),
            (
                "intermediate_size",
                c.intermediate_size.map(|v| v.to_string()),
            ),
            (
                "num_hidden_layers",
                c.num_hidden_layers.map(|v| v.to_string()),
            ),
            (
                "num_attention_heads",
                c.num_attention_heads.map(|v| v.to_string()),
            ),
            (
                "num_key_value_heads",
                c.num_key_value_heads.map(|v| v.to_string()),
            ),
            (
                "max_position_embeddings",
                c.max_position_embeddings.map(|v| v.to_string()),
            ),
            ("rope_theta", c.rope_theta.map(|v| v.to_string())),
            ("torch_dtype", c.torch_dtype.clone()),
        ];
        let _ = writeln!(out, "config.json");
        for (k, v) in fields {
            if let Some(v) = v {
                let _ = writeln!(out, "  {k:24}  {v}");
            }
        }
    } else {
        let _ = writeln!(out, "config.json   (missing)");
    }
    let tokenizers: Vec<&str> = ["tokenizer.json", "tokenizer.model", "tokenizer_config.json"]
        .into_iter()
        .filter(|f| dir.join(f).is_file())
        .collect();
    let _ = writeln!(
        out,
        "tokenizer     {}",
        if tokenizers.is_empty() {
            "(none)".to_string()
        } else {
            tokenizers.join(", ")
        }
    );
    let model = SafetensorsModel::open_dir(dir)?;
    let _ = writeln!(out, "weights       safetensors");
    describe_safetensors(&model, &mut out);
    Ok(out)
}

fn format_dims<'a>(dims: impl Iterator<Item = impl std::fmt::Display + 'a>) -> String {
    let parts: Vec<String> = dims.map(|d| d.to_string()).collect();
    format!("[{}]", parts.join(", "))
}

fn table(out: &mut String, rows: &[Row]) {
    let _ = writeln!(out, "tensors       {}", rows.len());
    let name_w = rows.iter().map(|r| r.name.len()).max().unwrap_or(0).max(4);
    let shape_w = rows.iter().map(|r| r.shape.len()).max().unwrap_or(0).max(5);
    let _ = writeln!(
        out,
        "  {:name_w$}  {:shape_w$}  {:7}  {:>14}",
        "name", "shape", "type", "bytes"
    );
    for r in rows {
        let _ = writeln!(
            out,
            "  {:name_w$}  {:shape_w$}  {:7}  {:>14}",
            r.name, r.shape, r.dtype, r.bytes
        );
    }
    let bytes = rows.iter().fold(0u64, |s, r| s.saturating_add(r.bytes));
    let params = rows.iter().fold(0u64, |s, r| s.saturating_add(r.numel));
    let _ = writeln!(
        out,
        "total         {} tensors, {} bytes ({}), {} parameters",
        rows.len(),
        bytes,
        human_bytes(bytes),
        params
    );
}

fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    format!("{v:.2} {}", UNITS[unit])
}
