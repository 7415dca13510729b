//! Every conformance fixture's gradient against PyTorch's: transformers computed, in
//! float64, the mean next-token cross-entropy of the fixture's prompt and its gradient
//! with respect to every weight (`scripts/fixtures/make_grads.py`, which also brought
//! those gradients into GGUF's names and layout through llama.cpp's converter). Here kiln
//! loads the fixture's F32 GGUF (Gemma 2: its Hugging Face files), runs the same loss forward and backward through the tape
//! on the CPU, and compares the loss and every parameter's gradient.

use kiln_core::{quant, Backend, DType};
use kiln_cpu::CpuBackend;
use kiln_io::gguf::GgufFile;
use kiln_models::Model;
use kiln_train::Tape;
use std::path::{Path, PathBuf};
use std::sync::Arc;

const FIXTURES: [&str; 8] = [
    "gemma", "gemma2", "gpt2", "llama", "llama3", "mistral", "phi3", "qwen2",
];

/// A gradient element may be off PyTorch's float64 one by this much of its tensor's
/// largest: kiln's forward and backward run in f32 (measured worst of the eight, CPU,
/// 2026-11-25: 5.1e-6, Gemma's attn_norm). A gradient 0.01% off fails.
const TOL: f64 = 5e-5;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

fn check(name: &str) {
    let dir = fixture(name);
    let info: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("grads.json")).unwrap()).unwrap();
    let ids: Vec<u32> = info["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let torch_loss = info["loss"].as_f64().unwrap();
    let reference = GgufFile::open(dir.join("grads.gguf")).unwrap();

    let cpu: Arc<dyn Backend> = Arc::new(CpuBackend::new(Some(2)).unwrap());
    let tape = Arc::new(Tape::new(cpu.clone()).unwrap());
    // Gemma 2's GGUF cannot say its query_pre_attn_scalar (llama.cpp assumes head_dim;
    // the fixture sets it apart on purpose): kiln reads that one from hf/, with its
    // parameters in the same names and layout as the converter's.
    let mut model = if name == "gemma2" {
        Model::from_hf_dir(&dir.join("hf"), tape.clone(), None).unwrap()
    } else {
        let file = GgufFile::open(dir.join(format!("{name}-f32.gguf"))).unwrap();
        Model::from_gguf(&file, tape.clone(), None).unwrap()
    };
    let params: Vec<_> = model.parameters().into_iter().map(|(_, t)| t).collect();
    tape.set_parameters(&params, &vec![true; params.len()])
        .unwrap();
    let n = ids.len() - 1;
    let mut cache = model.new_cache(n, DType::F32).unwrap();
    let softcap = model.config.final_softcap;
    tape.begin();
    let losses = model
        .forward_hidden(&ids[..n], 0, &mut cache, |h, head| {
            tape.cross_entropy(h, head, &ids[1..], softcap, 1.0 / n as f32)
        })
        .unwrap();
    let params: Vec<_> = model.parameters().into_iter().map(|(_, t)| t).collect();
    tape.backward(&params).unwrap();
    let loss = losses.iter().map(|&l| l as f64).sum::<f64>() / n as f64;
    assert!(
        (loss - torch_loss).abs() < 1e-6 * torch_loss,
        "{name}: loss {loss}, PyTorch's {torch_loss}"
    );

    let sizes: Vec<(String, usize)> = model
        .parameters()
        .into_iter()
        .map(|(n, t)| (n, t.shape().numel()))
        .collect();
    let mut grads = vec![0f32; sizes.iter().map(|(_, n)| n).sum()];
    tape.read_grads(&mut grads).unwrap();
    let mut at = 0;
    let mut worst = (0f64, String::new());
    for (pname, len) in &sizes {
        let got = &grads[at..at + len];
        at += len;
        let t = reference
            .tensor(pname)
            .unwrap_or_else(|| panic!("{name}: PyTorch has no gradient for {pname}"));
        let want =
            quant::dequantize_to_vec(DType::F32, reference.tensor_data(t), t.numel() as usize)
                .unwrap();
        assert_eq!(want.len(), *len, "{name}: {pname}'s size");
        let scale = want.iter().fold(0f64, |m, &v| m.max((v as f64).abs()));
        assert!(scale > 0.0, "{name}: {pname}: PyTorch's gradient is zero");
        let (i, off) = got
            .iter()
            .zip(&want)
            .map(|(&g, &w)| (g as f64 - w as f64).abs() / scale)
            .enumerate()
            .fold((0, 0f64), |b, (i, e)| if e > b.1 { (i, e) } else { b });
        assert!(
            off <= TOL,
            "{name}: {pname}[{i}] = {}, PyTorch's {} (off by {off:.2e} of the tensor's largest, {scale:.3e})",
            got[i],
            want[i]
        );
        if off > worst.0 {
            worst = (off, pname.clone());
        }
    }
    assert_eq!(
        reference.tensors.len(),
        sizes.len(),
        "{name}: PyTorch's gradients name other tensors than kiln's parameters"
    );
    eprintln!(
        "{name}: loss {loss:.6} (PyTorch {torch_loss:.6}), worst gradient {:.2e} of its tensor's largest ({})",
        worst.0, worst.1
    );
}

macro_rules! fixture_tests {
    ($($name:ident)*) => {$(
        #[test]
        fn $name() {
            check(stringify!($name));
        }
    )*};
}

fixture_tests!(gemma gemma2 gpt2 llama llama3 mistral phi3 qwen2);

#[test]
fn every_fixture_is_checked() {
    let mut on_disk: Vec<String> = std::fs::read_dir(fixture(""))
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.path().join("hf").is_dir())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    on_disk.sort();
    assert_eq!(on_disk, FIXTURES, "a fixture without a gradient test");
}
