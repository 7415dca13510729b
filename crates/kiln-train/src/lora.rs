//! Low-rank adaptation (LoRA, Hu et al. 2021): a frozen projection `W [m, k]` gains a
//! trainable update `scale · B · A`, `A [r, k]` and `B [m, r]`, so that the product the
//! model asks for becomes `x · Wᵀ + scale · (x · Aᵀ) · Bᵀ` with `scale = alpha / r`.
//!
//! The model does not know: the [`crate::Tape`] it runs on adds the update to every
//! product with an adapted weight (as primitive ops it records, so backward reaches A and
//! B), and the model's own weights are registered frozen. A starts as PEFT starts it
//! (Kaiming-uniform, `U(-1/√k, 1/√k)`) and B at zero, so step 0 is the base model. An
//! exported model has the updates merged into its weights (`W + scale · B · A`, F32), and
//! `kiln run` loads it like any other.

use crate::rng::Rng;
use kiln_core::{Backend, DType, Error, HostBytes, Result, Shape, Tensor};
use kiln_models::Model;
use serde::{Deserialize, Serialize};

/// What is adapted, and how.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LoraSettings {
    /// The update's rank `r`.
    pub rank: usize,
    /// The update is scaled by `alpha / rank`.
    pub alpha: f32,
    /// Short names of the adapted projections (see [`TARGETS`]), in every layer.
    pub targets: Vec<String>,
}

/// The projections LoRA can adapt: short name, and the GGUF name of the weight in a layer
/// (`blk.N.<name>.weight`).
pub const TARGETS: [(&str, &str); 7] = [
    ("q", "attn_q"),
    ("k", "attn_k"),
    ("v", "attn_v"),
    ("o", "attn_output"),
    ("gate", "ffn_gate"),
    ("up", "ffn_up"),
    ("down", "ffn_down"),
];

impl LoraSettings {
    /// Refuse settings no run can take, naming the flag.
    pub fn validate(&self) -> Result<()> {
        if self.rank == 0 {
            return Err(Error::format("--lora-rank 0: the rank must be at least 1"));
        }
        if !(self.alpha.is_finite() && self.alpha > 0.0) {
            return Err(Error::format(format!(
                "--lora-alpha {}: it must be a positive number",
                self.alpha
            )));
        }
        if self.targets.is_empty() {
            return Err(Error::format(
                "--lora-targets: name at least one projection",
            ));
        }
        for t in &self.targets {
            if !TARGETS.iter().any(|(short, _)| short == t) {
                return Err(Error::format(format!(
                    "--lora-targets: {t:?} is not one of {}",
                    TARGETS.map(|(s, _)| s).join(", ")
                )));
            }
        }
        Ok(())
    }

    pub fn scale(&self) -> f32 {
        self.alpha / self.rank as f32
    }

    /// Whether the model's parameter `name` is adapted.
    fn adapts(&self, name: &str) -> bool {
        let Some(rest) = name.strip_prefix("blk.") else {
            return false;
        };
        let Some((layer, weight)) = rest.split_once('.') else {
            return false;
        };
        layer.parse::<usize>().is_ok()
            && TARGETS.iter().any(|(short, gguf)| {
                self.targets.iter().any(|t| t == short) && weight == format!("{gguf}.weight")
            })
    }
}

/// One adapted weight's update.
pub(crate) struct Adapter {
    /// The model's parameter it adapts (its GGUF name).
    pub weight: String,
    /// `[r, k]` and `[m, r]`, F32.
    pub a: Tensor,
    pub b: Tensor,
    pub scale: f32,
}

impl Adapter {
    /// The GGUF names an adapter's matrices are saved under in a checkpoint.
    pub fn tensor_names(weight: &str) -> (String, String) {
        (format!("lora.{weight}.a"), format!("lora.{weight}.b"))
    }
}

/// Fresh adapters for `model`'s weights that `settings` names, in the order of
/// `Model::parameters`: A drawn from `rng`, B zero. An error when no weight matches.
pub(crate) fn fresh(
    model: &Model,
    settings: &LoraSettings,
    backend: &dyn Backend,
    rng: &mut Rng,
) -> Result<Vec<Adapter>> {
    settings.validate()?;
    let r = settings.rank;
    let mut out = Vec::new();
    for (name, w) in model.parameters() {
        if !settings.adapts(&name) {
            continue;
        }
        let &[m, k] = w.dims() else {
            return Err(Error::shape(format!(
                "{name} is {}, not a matrix: LoRA adapts projections",
                w.shape()
            )));
        };
        if r > m.min(k) {
            return Err(Error::format(format!(
                "--lora-rank {r}: {name} is {m} × {k}; a rank above {} adds nothing",
                m.min(k)
            )));
        }
        let bound = 1.0 / (k as f64).sqrt();
        let a: Vec<f32> = (0..r * k)
            .map(|_| ((2.0 * rng.uniform() - 1.0) * bound) as f32)
            .collect();
        out.push(Adapter {
            a: upload(backend, &a, r, k)?,
            b: upload(backend, &vec![0f32; m * r], m, r)?,
            weight: name,
            scale: settings.scale(),
        });
    }
    if out.is_empty() {
        return Err(Error::format(format!(
            "--lora-targets {}: the model has none of these projections (its layers' weights are blk.N.<attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down>.weight in llama-family models)",
            settings.targets.join(",")
        )));
    }
    Ok(out)
}

/// `values` as an F32 `[rows, cols]` tensor on `backend`.
pub(crate) fn upload(
    backend: &dyn Backend,
    values: &[f32],
    rows: usize,
    cols: usize,
) -> Result<Tensor> {
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    backend.upload(
        DType::F32,
        Shape::new(vec![rows, cols])?,
        HostBytes::from_vec(bytes),
    )
}

/// A tensor's F32 values, read back.
pub(crate) fn download(backend: &dyn Backend, t: &Tensor) -> Result<Vec<f32>> {
    if t.dtype() != DType::F32 {
        return Err(Error::unsupported(format!(
            "reading a {} tensor as F32",
            t.dtype()
        )));
    }
    Ok(backend
        .download(t)?
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

/// `w + scale · b · a` on the host, in f64 sums: the weight an exported model holds.
pub(crate) fn merged(w: &[f32], a: &[f32], b: &[f32], m: usize, k: usize, scale: f32) -> Vec<f32> {
    let r = a.len() / k.max(1);
    let mut out = w.to_vec();
    for i in 0..m {
        for (j, o) in out[i * k..][..k].iter_mut().enumerate() {
            let delta: f64 = (0..r)
                .map(|t| b[i * r + t] as f64 * a[t * k + j] as f64)
                .sum();
            *o = (*o as f64 + scale as f64 * delta) as f32;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::init::{fresh_tensors, gguf_of};
    use crate::Tape;
    use kiln_core::{quant, RopeLayout};
    use kiln_cpu::CpuBackend;
    use kiln_models::{Arch, Ffn, ModelConfig, Norm, Rope};
    use std::sync::Arc;

    fn config() -> ModelConfig {
        ModelConfig {
            arch: Arch::Llama,
            vocab_size: 29,
            dim: 16,
            n_layers: 2,
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 4,
            ffn_dim: 24,
            max_positions: 16,
            norm: Norm::Rms { eps: 1e-5 },
            ffn: Ffn::SwiGlu,
            rope: Some(Rope {
                theta: 10000.0,
                dims: 4,
                layout: RopeLayout::Interleaved,
                llama3: None,
                freq_factors: None,
            }),
            attn_scale: 0.5,
            attn_softcap: None,
            final_softcap: None,
            sliding_window: None,
            sliding_layers: vec![false; 2],
            embed_scale: None,
            post_norms: false,
        }
    }

    struct Setup {
        tape: Arc<Tape>,
        model: Model,
        seqs: Vec<(Vec<u32>, Vec<u32>)>,
    }

    /// A tiny LLaMA on a tape with every projection adapted (rank 2, B drawn too, so that
    /// A's gradient is not zero), its own weights frozen.
    fn setup() -> Setup {
        let c = config();
        let mut rng = Rng::new(21);
        let file = gguf_of(
            &c,
            &fresh_tensors(&c, false, 0.3, &mut rng),
            "lora test",
            vec![],
        )
        .unwrap();
        let cpu: Arc<dyn Backend> = Arc::new(CpuBackend::new(Some(2)).unwrap());
        let tape = Arc::new(Tape::new(cpu.clone()).unwrap());
        let model = Model::from_gguf(&file, tape.clone(), None).unwrap();
        let l = LoraSettings {
            rank: 2,
            ..settings(&["q", "k", "v", "o", "gate", "up", "down"])
        };
        let mut adapters = fresh(&model, &l, cpu.as_ref(), &mut rng).unwrap();
        assert_eq!(adapters.len(), 14);
        for ad in &mut adapters {
            let b: Vec<f32> = (0..ad.b.shape().numel())
                .map(|_| 0.3 * rng.normal() as f32)
                .collect();
            cpu.write(&mut ad.b, &quant::quantize(DType::F32, &b).unwrap())
                .unwrap();
        }
        let mut refs: Vec<&Tensor> = model.parameters().into_iter().map(|(_, t)| t).collect();
        let mut flags = vec![false; refs.len()];
        refs.extend(adapters.iter().flat_map(|ad| [&ad.a, &ad.b]));
        flags.resize(refs.len(), true);
        tape.set_parameters(&refs, &flags).unwrap();
        let weights: Vec<&Tensor> = adapters
            .iter()
            .map(|ad| {
                model
                    .parameters()
                    .into_iter()
                    .find(|(n, _)| *n == ad.weight)
                    .unwrap()
                    .1
            })
            .collect();
        drop(refs);
        tape.set_adapters(adapters, &weights).unwrap();
        drop(weights);
        let seq = |rng: &mut Rng| -> (Vec<u32>, Vec<u32>) {
            let ids: Vec<u32> = (0..8).map(|_| rng.below(29) as u32).collect();
            (ids[..7].to_vec(), ids[1..].to_vec())
        };
        let seqs = vec![seq(&mut rng), seq(&mut rng)];
        Setup { tape, model, seqs }
    }

    /// The mean loss over the sequences; with `record`, also their gradients.
    fn loss(s: &mut Setup, record: bool) -> f64 {
        let scale = 1.0 / 14.0;
        let mut cache = s.model.new_cache(7, DType::F32).unwrap();
        let mut total = 0f64;
        for (ids, targets) in &s.seqs {
            if record {
                s.tape.begin();
            } else {
                s.tape.stop();
            }
            let tape = s.tape.clone();
            let losses = s
                .model
                .forward_hidden(ids, 0, &mut cache, |h, head| {
                    tape.cross_entropy(h, head, targets, None, scale)
                })
                .unwrap();
            total += losses.iter().map(|&l| l as f64).sum::<f64>() * scale as f64;
            if record {
                let params: Vec<&Tensor> =
                    s.model.parameters().into_iter().map(|(_, t)| t).collect();
                s.tape.backward(&params).unwrap();
            }
        }
        total
    }

    /// Each adapter matrix's gradient along a direction against central differences of
    /// the loss (f32 forward: one direction a matrix, as the model's gradient tests do),
    /// and the loss with the adapters against the base model's with B = 0.
    #[test]
    fn adapter_gradients_match_differences() {
        let mut s = setup();
        s.tape.zero_grads().unwrap();
        let base = loss(&mut s, true);
        let inner = s.tape.inner().clone();
        let count = 2 * s.tape.adapters().list.len();
        let sizes: Vec<usize> = (0..count)
            .map(|i| {
                let ads = s.tape.adapters();
                let ad = &ads.list[i / 2];
                [&ad.a, &ad.b][i % 2].shape().numel()
            })
            .collect();
        let mut grads = vec![0f32; sizes.iter().sum()];
        s.tape.read_grads(&mut grads).unwrap();
        let mut rng = Rng::new(5);
        let mut at = 0;
        for (i, &n) in sizes.iter().enumerate() {
            let g = &grads[at..at + n];
            at += n;
            let theta = {
                let ads = s.tape.adapters();
                let ad = &ads.list[i / 2];
                download(inner.as_ref(), [&ad.a, &ad.b][i % 2]).unwrap()
            };
            let unit = |v: Vec<f64>| {
                let norm = v.iter().map(|d| d * d).sum::<f64>().sqrt();
                v.into_iter().map(|d| d / norm).collect::<Vec<f64>>()
            };
            let towards = unit(g.iter().map(|&g| g as f64).collect());
            let random = unit((0..n).map(|_| rng.normal()).collect());
            let dir = unit(towards.iter().zip(&random).map(|(a, b)| a + b).collect());
            let along: f64 = g.iter().zip(&dir).map(|(&g, d)| g as f64 * d).sum();
            let eps = (2e-3 / along.abs()).min(1e-2);
            let tape = s.tape.clone();
            let set = |values: &[f32]| {
                let mut ads = tape.adapters();
                let ad = &mut ads.list[i / 2];
                let t = if i % 2 == 0 { &mut ad.a } else { &mut ad.b };
                inner
                    .write(t, &quant::quantize(DType::F32, values).unwrap())
                    .unwrap();
            };
            let moved = |sign: f64| -> Vec<f32> {
                theta
                    .iter()
                    .zip(&dir)
                    .map(|(&t, d)| (t as f64 + sign * eps * d) as f32)
                    .collect()
            };
            set(&moved(1.0));
            let up = loss(&mut s, false);
            set(&moved(-1.0));
            let down = loss(&mut s, false);
            set(&theta);
            let fd = (up - down) / (2.0 * eps);
            let tol = 2e-3 * fd.abs() + 1e-5;
            let name = {
                let ads = s.tape.adapters();
                format!("{} {}", ads.list[i / 2].weight, ["A", "B"][i % 2])
            };
            assert!(
                (along - fd).abs() <= tol,
                "{name}: the gradient along a direction is {along:e}, central differences give {fd:e}"
            );
            assert!(
                (1.01 * along - fd).abs() > tol,
                "{name}: a gradient 1% off would pass ({fd:e} is too small to check)"
            );
        }
        // The adapters change the loss; with every B at zero it is the base model's.
        for ad in &mut s.tape.adapters().list {
            inner.fill(&mut ad.b, 0.0).unwrap();
        }
        let plain = loss(&mut s, false);
        s.tape.set_adapters(Vec::new(), &[]).unwrap();
        let without = loss(&mut s, false);
        assert!((plain - without).abs() < 1e-9, "{plain} vs {without}");
        assert!(
            (base - plain).abs() > 1e-3,
            "the adapters did not move the loss"
        );
    }

    fn settings(targets: &[&str]) -> LoraSettings {
        LoraSettings {
            rank: 4,
            alpha: 8.0,
            targets: targets.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn targets_match_their_layer_weights_only() {
        let s = settings(&["q", "down"]);
        assert!(s.adapts("blk.0.attn_q.weight"));
        assert!(s.adapts("blk.11.ffn_down.weight"));
        assert!(!s.adapts("blk.0.attn_k.weight"));
        assert!(!s.adapts("blk.0.attn_q.bias"));
        assert!(!s.adapts("blk.x.attn_q.weight"));
        assert!(!s.adapts("token_embd.weight"));
        assert!(!s.adapts("output.weight"));
    }

    #[test]
    fn bad_settings_name_the_flag() {
        let err = |s: LoraSettings| s.validate().unwrap_err().to_string();
        assert!(err(LoraSettings {
            rank: 0,
            ..settings(&["q"])
        })
        .contains("--lora-rank"));
        assert!(err(LoraSettings {
            alpha: f32::NAN,
            ..settings(&["q"])
        })
        .contains("--lora-alpha"));
        assert!(err(settings(&[])).contains("--lora-targets"));
        assert!(err(settings(&["qkv"])).contains("\"qkv\""));
        settings(&["q", "k", "v", "o", "gate", "up", "down"])
            .validate()
            .unwrap();
    }

    #[test]
    fn merging_adds_the_scaled_product() {
        // w 2×3, a 1×3, b 2×1: w + 0.5 · b·a.
        let w = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let a = [1.0, 0.0, -1.0];
        let b = [2.0, -4.0];
        let got = merged(&w, &a, &b, 2, 3, 0.5);
        assert_eq!(got, vec![2.0, 2.0, 2.0, 2.0, 5.0, 8.0]);
    }
}
