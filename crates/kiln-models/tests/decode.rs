//! Decoding one token at a time: greedy picks made on the device agree with the logits,
//! sampled ones follow the seed, and one-token steps are recorded and replayed as `Backend::capture` lays down.

use kiln_core::{
    AttentionParams, Backend, DType, Device, HostBytes, Replay, Result, RopeLayout, Shape, Tensor,
};
use kiln_cpu::CpuBackend;
use kiln_io::gguf::GgufFile;
use kiln_models::sampler::argmax;
use kiln_models::{generate, GenerateOptions, Logits, Model, Sampler, SamplerConfig};
use kiln_tokenizer::Tokenizer;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(format!("../../tests/fixtures/{name}/{name}-f32.gguf"))
}

fn prompt_ids(name: &str) -> Vec<u32> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(format!("../../tests/fixtures/{name}/reference.json"));
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    reference["prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect()
}

fn load(name: &str, backend: Arc<dyn Backend>) -> (Model, Tokenizer) {
    let f = GgufFile::open(fixture(name)).unwrap();
    (
        Model::from_gguf(&f, backend, None).unwrap(),
        Tokenizer::from_gguf(&f).unwrap(),
    )
}

#[test]
fn greedy_on_the_device_matches_the_logits_with_and_without_graphs() {
    greedy_with_and_without_graphs(Arc::new(CpuBackend::new(Some(2)).unwrap()));
}

/// On the GPU the recorded steps are real CUDA graphs, replayed on new ids and positions.
#[test]
#[ignore = "needs a CUDA device"]
fn greedy_on_cuda_matches_the_logits_with_and_without_graphs() {
    greedy_with_and_without_graphs(Arc::new(kiln_cuda::CudaBackend::new(0).unwrap()));
}

fn greedy_with_and_without_graphs(backend: Arc<dyn Backend>) {
    // Rope and learned positions, sliding windows and soft-capping.
    for name in ["llama", "gpt2", "gemma2"] {
        let (mut model, tokenizer) = load(name, backend.clone());
        let prompt = prompt_ids(name);

        // Step by step, each pick both ways, on a cache of its own each.
        let (mut host, mut device) = (
            model.new_cache(96, DType::F32).unwrap(),
            model.new_cache(96, DType::F32).unwrap(),
        );
        let mut want = Vec::new();
        let mut ids = prompt.clone();
        let mut pos = 0;
        for _ in 0..8 {
            let logits = model.forward(&ids, pos, &mut host, Logits::Last).unwrap();
            let next = model.forward_argmax(&ids, pos, &mut device).unwrap();
            assert_eq!(next, argmax(&logits), "{name}: token {}", want.len());
            want.push(next);
            pos += ids.len();
            ids = vec![next];
        }

        let opts = GenerateOptions {
            max_tokens: 8,
            context: 96,
            kv_type: DType::F32,
            stop_strings: &[],
        };
        let run = |model: &mut Model| {
            let mut sampler = Sampler::new(SamplerConfig::greedy());
            generate(model, &tokenizer, &prompt, &mut sampler, &opts, |_| {})
                .unwrap()
                .tokens
        };
        // Sampled (on the device where it can), with a penalty: the seed decides.
        let sampled = |model: &mut Model, seed: u64| {
            let mut sampler = Sampler::new(SamplerConfig {
                temperature: 1.2,
                top_k: 40,
                repeat_penalty: 1.1,
                seed,
                ..Default::default()
            });
            generate(model, &tokenizer, &prompt, &mut sampler, &opts, |_| {})
                .unwrap()
                .tokens
        };
        let with_graphs = run(&mut model);
        let sampled_with = [sampled(&mut model, 7), sampled(&mut model, 8)];
        model.set_graphs(false);
        let without = run(&mut model);
        assert_eq!(with_graphs, without, "{name}");
        assert_eq!(sampled_with[0], sampled(&mut model, 7), "{name}: seed 7");
        assert_eq!(sampled_with[1], sampled(&mut model, 8), "{name}: seed 8");
        assert_ne!(sampled_with[0], sampled_with[1], "{name}: seeds 7 and 8");
        // Generation may stop early at an end-of-generation token.
        assert!(
            !with_graphs.is_empty() && want.starts_with(&with_graphs),
            "{name}: {with_graphs:?} vs {want:?}"
        );
    }
}

/// A CPU backend that records: inside `capture` it logs the ops instead of running them,
/// and its replays only log. Outputs are then meaningless; the log shows what the model
/// asked for, and when.
struct Recorder {
    cpu: CpuBackend,
    /// False: `capture` runs the ops and returns `None`, as the CPU does.
    records: bool,
    recording: AtomicBool,
    log: Arc<Mutex<Vec<String>>>,
}

struct Recording(Arc<Mutex<Vec<String>>>);

impl Replay for Recording {
    fn replay(&self) -> Result<()> {
        self.0.lock().unwrap().push("replay".into());
        Ok(())
    }
}

impl Recorder {
    fn new(records: bool) -> Self {
        Recorder {
            cpu: CpuBackend::new(Some(2)).unwrap(),
            records,
            recording: AtomicBool::new(false),
            log: Arc::new(Mutex::new(Vec::new())),
        }
    }

    fn note(&self, entry: String) {
        self.log.lock().unwrap().push(entry);
    }

    /// Run (or, while recording, log) an op.
    fn op(&self, name: &str, run: impl FnOnce() -> Result<()>) -> Result<()> {
        if self.recording.load(Ordering::SeqCst) {
            self.note(format!("rec:{name}"));
            return Ok(());
        }
        self.note(name.into());
        run()
    }

    /// Buffers are made and read back outside recordings only.
    fn host(&self, name: &str) -> Result<()> {
        if self.recording.load(Ordering::SeqCst) {
            return Err(kiln_core::Error::Device(format!("{name} while recording")));
        }
        self.note(name.into());
        Ok(())
    }

    fn take(&self) -> Vec<String> {
        std::mem::take(&mut self.log.lock().unwrap())
    }
}

impl Backend for Recorder {
    fn device(&self) -> Device {
        self.cpu.device()
    }
    fn describe(&self) -> String {
        "recorder".into()
    }
    fn zeros(&self, dtype: DType, shape: Shape) -> Result<Tensor> {
        self.host("zeros")?;
        self.cpu.zeros(dtype, shape)
    }
    fn upload(&self, dtype: DType, shape: Shape, data: HostBytes) -> Result<Tensor> {
        self.host("upload")?;
        self.cpu.upload(dtype, shape, data)
    }
    fn download(&self, t: &Tensor) -> Result<Vec<u8>> {
        self.host("download")?;
        self.cpu.download(t)
    }
    fn write(&self, t: &mut Tensor, data: &[u8]) -> Result<()> {
        let values: Vec<i32> = data
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        self.host(&format!("write{values:?}"))?;
        self.cpu.write(t, data)
    }
    fn fill(&self, t: &mut Tensor, value: f32) -> Result<()> {
        self.op("fill", || self.cpu.fill(t, value))
    }
    fn matmul(&self, x: &Tensor, w: &Tensor, out: &mut Tensor) -> Result<()> {
        self.op("matmul", || self.cpu.matmul(x, w, out))
    }
    fn embedding(&self, table: &Tensor, ids: &Tensor, out: &mut Tensor) -> Result<()> {
        self.op("embedding", || self.cpu.embedding(table, ids, out))
    }
    fn rms_norm(&self, x: &Tensor, weight: &Tensor, eps: f32, out: &mut Tensor) -> Result<()> {
        self.op("rms_norm", || self.cpu.rms_norm(x, weight, eps, out))
    }
    fn layer_norm(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: &Tensor,
        eps: f32,
        out: &mut Tensor,
    ) -> Result<()> {
        self.op("layer_norm", || {
            self.cpu.layer_norm(x, weight, bias, eps, out)
        })
    }
    fn softmax(&self, x: &mut Tensor) -> Result<()> {
        self.op("softmax", || self.cpu.softmax(x))
    }
    fn rope(
        &self,
        x: &mut Tensor,
        pos: &Tensor,
        inv_freq: &Tensor,
        layout: RopeLayout,
    ) -> Result<()> {
        self.op("rope", || self.cpu.rope(x, pos, inv_freq, layout))
    }
    fn add_assign(&self, acc: &mut Tensor, x: &Tensor) -> Result<()> {
        self.op("add_assign", || self.cpu.add_assign(acc, x))
    }
    fn mul_assign(&self, acc: &mut Tensor, x: &Tensor) -> Result<()> {
        self.op("mul_assign", || self.cpu.mul_assign(acc, x))
    }
    fn scale(&self, x: &mut Tensor, s: f32) -> Result<()> {
        self.op("scale", || self.cpu.scale(x, s))
    }
    fn silu_mul(&self, gate: &Tensor, up: &Tensor, out: &mut Tensor) -> Result<()> {
        self.op("silu_mul", || self.cpu.silu_mul(gate, up, out))
    }
    fn gelu_mul(&self, gate: &Tensor, up: &Tensor, out: &mut Tensor) -> Result<()> {
        self.op("gelu_mul", || self.cpu.gelu_mul(gate, up, out))
    }
    fn gelu(&self, x: &mut Tensor) -> Result<()> {
        self.op("gelu", || self.cpu.gelu(x))
    }
    fn softcap(&self, x: &mut Tensor, cap: f32) -> Result<()> {
        self.op("softcap", || self.cpu.softcap(x, cap))
    }
    fn write_rows(&self, src: &Tensor, dst: &mut Tensor, pos: &Tensor) -> Result<()> {
        self.op("write_rows", || self.cpu.write_rows(src, dst, pos))
    }
    fn slice_cols(&self, src: &Tensor, col0: usize, dst: &mut Tensor) -> Result<()> {
        self.op("slice_cols", || self.cpu.slice_cols(src, col0, dst))
    }
    fn attention(
        &self,
        q: &Tensor,
        k_cache: &Tensor,
        v_cache: &Tensor,
        pos: &Tensor,
        params: &AttentionParams,
        out: &mut Tensor,
    ) -> Result<()> {
        self.op("attention", || {
            self.cpu.attention(q, k_cache, v_cache, pos, params, out)
        })
    }
    fn argmax(&self, x: &Tensor, out: &mut Tensor) -> Result<()> {
        self.op("argmax", || self.cpu.argmax(x, out))
    }
    fn capture(&self, step: &mut dyn FnMut() -> Result<()>) -> Result<Option<Box<dyn Replay>>> {
        self.note("capture".into());
        if !self.records {
            step()?;
            return Ok(None);
        }
        self.recording.store(true, Ordering::SeqCst);
        let result = step();
        self.recording.store(false, Ordering::SeqCst);
        result?;
        Ok(Some(Box::new(Recording(self.log.clone()))))
    }
}

/// The entries of a log that are the step's own ops, run eagerly.
fn eager_ops(log: &[String]) -> usize {
    log.iter()
        .filter(|e| !e.starts_with("rec:") && !e.starts_with("write["))
        .filter(|e| !["zeros", "download", "argmax", "capture", "replay"].contains(&e.as_str()))
        .count()
}

fn recorded_ops(log: &[String]) -> usize {
    log.iter().filter(|e| e.starts_with("rec:")).count()
}

#[test]
fn one_token_steps_are_recorded_once_per_cache_and_replayed() {
    let rec = Arc::new(Recorder::new(true));
    let (mut model, _) = load("llama", rec.clone());
    model.set_graphs(true);
    let (mut a, mut b) = (
        model.new_cache(32, DType::F32).unwrap(),
        model.new_cache(32, DType::F32).unwrap(),
    );
    rec.take();
    let replayed = |token: i32, pos: i32| {
        vec![
            format!("write[{token}]"),
            format!("write[{pos}]"),
            "replay".to_string(),
            "argmax".into(),
            "download".into(),
        ]
    };

    // A prefill runs eagerly and leaves graphs alone.
    model.forward_argmax(&[1, 2, 3, 4], 0, &mut a).unwrap();
    let log = rec.take();
    assert!(log.contains(&"write[0, 1, 2, 3]".to_string()), "{log:?}");
    assert!(
        !log.iter().any(|e| e == "capture" || e == "replay"),
        "{log:?}"
    );

    // The first one-token step on a cache runs eagerly (and makes the decode buffers).
    model.forward_argmax(&[5], 4, &mut a).unwrap();
    let log = rec.take();
    let ops = eager_ops(&log);
    assert!(ops > 0 && log.contains(&"zeros".to_string()), "{log:?}");
    assert!(
        !log.iter().any(|e| e == "capture" || e == "replay"),
        "{log:?}"
    );

    // The second is recorded, after its inputs are written, and run by a replay.
    model.forward_argmax(&[6], 5, &mut a).unwrap();
    let log = rec.take();
    assert_eq!(&log[..3], ["write[6]", "write[5]", "capture"], "{log:?}");
    assert_eq!((recorded_ops(&log), eager_ops(&log)), (ops, 0), "{log:?}");
    assert_eq!(&log[log.len() - 3..], ["replay", "argmax", "download"]);

    // Then: write the inputs, replay. Neither a prefill between nor `forward` changes that.
    model.forward_argmax(&[7], 6, &mut a).unwrap();
    assert_eq!(rec.take(), replayed(7, 6));
    model.forward(&[8, 9], 7, &mut a, Logits::All).unwrap();
    let log = rec.take();
    assert!(eager_ops(&log) > 0 && !log.contains(&"replay".to_string()));
    // The same prefill size again allocates nothing.
    model.forward(&[8, 9], 7, &mut a, Logits::All).unwrap();
    assert!(!rec.take().contains(&"zeros".to_string()));
    model.forward_argmax(&[10], 9, &mut a).unwrap();
    assert_eq!(rec.take(), replayed(10, 9));
    model.forward(&[11], 10, &mut a, Logits::Last).unwrap();
    assert_eq!(
        rec.take(),
        [&replayed(11, 10)[..3], &["download".to_string()]].concat()
    );

    // Another cache: eager, then recorded anew; back on the first, the same again.
    for (cache, pos) in [(&mut b, 0), (&mut a, 11)] {
        model.forward_argmax(&[12], pos, cache).unwrap();
        assert_eq!(eager_ops(&rec.take()), ops);
        model.forward_argmax(&[13], pos + 1, cache).unwrap();
        assert_eq!(recorded_ops(&rec.take()), ops);
        model.forward_argmax(&[14], pos + 2, cache).unwrap();
        assert_eq!(rec.take(), replayed(14, pos as i32 + 2));
    }

    // Off: every step eager. On again: eager, then recorded.
    model.set_graphs(false);
    for pos in 14..16 {
        model.forward_argmax(&[15], pos, &mut a).unwrap();
        assert_eq!(eager_ops(&rec.take()), ops);
    }
    model.set_graphs(true);
    model.forward_argmax(&[16], 16, &mut a).unwrap();
    assert_eq!(eager_ops(&rec.take()), ops);
    model.forward_argmax(&[17], 17, &mut a).unwrap();
    assert_eq!(recorded_ops(&rec.take()), ops);
}

#[test]
fn a_backend_that_does_not_record_is_asked_once() {
    let rec = Arc::new(Recorder::new(false));
    let (mut model, _) = load("llama", rec.clone());
    model.set_graphs(true);
    let (mut a, mut b) = (
        model.new_cache(32, DType::F32).unwrap(),
        model.new_cache(32, DType::F32).unwrap(),
    );
    rec.take();
    model.forward_argmax(&[1], 0, &mut a).unwrap();
    let ops = eager_ops(&rec.take());
    // Asked to record, it ran the ops instead.
    model.forward_argmax(&[2], 1, &mut a).unwrap();
    let log = rec.take();
    assert!(log.contains(&"capture".to_string()), "{log:?}");
    assert_eq!(eager_ops(&log), ops);
    for (cache, pos) in [(&mut a, 2), (&mut b, 0)] {
        for pos in pos..pos + 2 {
            model.forward_argmax(&[3], pos, cache).unwrap();
            let log = rec.take();
            assert!(!log.contains(&"capture".to_string()), "{log:?}");
            assert_eq!(eager_ops(&log), ops);
        }
    }
}

/// A cache grown mid-sequence keeps its rows, as stored in its type: the steps after the
/// growth see the same keys and values as on a cache that had the room from the start.
#[test]
fn a_grown_cache_continues_as_a_full_one() {
    let backend: Arc<dyn Backend> = Arc::new(CpuBackend::new(Some(2)).unwrap());
    let (mut model, _) = load("llama", backend);
    let prompt = prompt_ids("llama");
    let full_capacity = prompt.len() + 8;
    for kv in [DType::F32, DType::F16, DType::BF16] {
        let mut full = model.new_cache(full_capacity, kv).unwrap();
        let mut grown = model.new_cache(prompt.len(), kv).unwrap();
        let a = model.forward_argmax(&prompt, 0, &mut full).unwrap();
        let b = model.forward_argmax(&prompt, 0, &mut grown).unwrap();
        assert_eq!(a, b);
        model.grow_cache(&mut grown, full_capacity).unwrap();
        assert_eq!(grown.capacity(), full_capacity);
        assert_eq!(grown.dtype(), kv);
        let mut next = a;
        for pos in prompt.len()..full_capacity {
            let want = model
                .forward(&[next], pos, &mut full, Logits::Last)
                .unwrap();
            let got = model
                .forward(&[next], pos, &mut grown, Logits::Last)
                .unwrap();
            assert_eq!(want, got, "{kv} position {pos}");
            next = argmax(&want);
        }
        // Shrinking is not growing: the cache is left as it is.
        model.grow_cache(&mut grown, 4).unwrap();
        assert_eq!(grown.capacity(), full_capacity);
    }
}
