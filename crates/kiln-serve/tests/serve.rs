//! `kiln serve` from the outside: a server on a loopback port with the embedded model on the
//! CPU, spoken to over HTTP as OpenAI's clients do.

use kiln_core::DType;
use kiln_core::{Backend, Collective};
use kiln_cpu::CpuBackend;
use kiln_io::gguf::GgufFile;
use kiln_models::chat::Message;
use kiln_models::{generate, GenerateOptions, Model, Sampler, SamplerConfig};
use kiln_serve::{
    App, ChatRenderer, Engine, EngineConfig, Limits, PagedRunner, RenderError, ServedModel,
    SplitRunner, StepRunner,
};
use kiln_tokenizer::Tokenizer;
use serde_json::{json, Value};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The embedded model's context.
const CONTEXT: usize = 512;

fn model_path() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/kiln-default.gguf")
}

fn load() -> (Model, Tokenizer) {
    let file = GgufFile::open(model_path()).unwrap();
    let backend = Arc::new(CpuBackend::new(Some(1)).unwrap());
    (
        Model::from_gguf(&file, backend, None).unwrap(),
        Tokenizer::from_gguf(&file).unwrap(),
    )
}

/// The template the CLI falls back on, rendered in-process (the CLI sandboxes it).
struct PlainChat;

impl ChatRenderer for PlainChat {
    fn render(&self, messages: &[Message]) -> Result<String, RenderError> {
        let template =
            "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:";
        kiln_models::chat::render(template, messages, "", "")
            .map_err(|e| RenderError::Messages(e.to_string()))
    }
}

struct Options {
    max_seqs: usize,
    max_waiting: usize,
    kv_blocks: usize,
    api_key: Option<String>,
    /// Ranks the model is split over (1: whole), threads summing through host memory.
    tp: usize,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            max_seqs: 16,
            max_waiting: 64,
            kv_blocks: 16 * CONTEXT / 16,
            api_key: None,
            tp: 1,
        }
    }
}

struct Server {
    url: String,
    app: Arc<App>,
    client: reqwest::Client,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

/// The model split over `tp` ranks, each on a CPU backend of its own.
fn split_runner(tp: usize, kv_blocks: usize) -> SplitRunner {
    let file = GgufFile::open(model_path()).unwrap();
    let backends: Vec<Arc<dyn Backend>> = (0..tp)
        .map(|_| Arc::new(CpuBackend::new(Some(1)).unwrap()) as Arc<dyn Backend>)
        .collect();
    let group: Vec<Arc<dyn Collective>> = kiln_dist::host::group(backends.clone())
        .into_iter()
        .map(|c| Arc::new(c) as Arc<dyn Collective>)
        .collect();
    let models = backends
        .into_iter()
        .zip(group.clone())
        .map(|(b, c)| Model::from_gguf_rank(&file, b, c).unwrap())
        .collect();
    let abort = Arc::new(move |why: &str| group.iter().for_each(|c| c.abort(why)));
    SplitRunner::new(models, kv_blocks, DType::F32, abort).unwrap()
}

async fn start(o: Options) -> Server {
    let (model, tokenizer) = load();
    let tokenizer = Arc::new(tokenizer);
    let runner: Box<dyn StepRunner> = match o.tp {
        1 => Box::new(PagedRunner::new(model, o.kv_blocks, DType::F32).unwrap()),
        tp => Box::new(split_runner(tp, o.kv_blocks)),
    };
    let engine = Engine::start(
        runner,
        tokenizer.clone(),
        EngineConfig {
            limits: Limits {
                max_seqs: o.max_seqs,
                token_budget: 512,
                prefill_chunk: 256,
            },
            kv_blocks: o.kv_blocks,
            max_waiting: o.max_waiting,
        },
    )
    .unwrap();
    let app = Arc::new(App {
        engine: Arc::new(engine),
        tokenizer,
        model: ServedModel {
            id: "kiln-default".into(),
            aliases: vec!["models/kiln-default.gguf".into()],
            context: CONTEXT,
        },
        chat: Arc::new(PlainChat),
        api_key: o.api_key,
        started: 0,
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (tx, rx) = tokio::sync::oneshot::channel();
    let task = tokio::spawn(kiln_serve::serve(listener, app.clone(), async {
        let _ = rx.await;
    }));
    Server {
        url,
        app,
        client: reqwest::Client::new(),
        stop: Some(tx),
        task,
    }
}

impl Server {
    async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        let r = self
            .client
            .post(format!("{}{path}", self.url))
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }

    async fn get(&self, path: &str) -> (u16, String) {
        let r = self
            .client
            .get(format!("{}{path}", self.url))
            .send()
            .await
            .unwrap();
        (r.status().as_u16(), r.text().await.unwrap())
    }

    /// The `data:` payloads of a streamed response, `[DONE]` included.
    async fn stream(&self, path: &str, body: Value) -> Vec<String> {
        let r = self
            .client
            .post(format!("{}{path}", self.url))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert!(r.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream"));
        let text = r.text().await.unwrap();
        text.lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .map(str::to_string)
            .collect()
    }

    async fn metric(&self, name: &str) -> f64 {
        let (_, text) = self.get("/metrics").await;
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("{name} not in /metrics:\n{text}"))
    }

    /// Wait until the engine holds no sequence and no block.
    async fn wait_idle(&self) {
        let start = Instant::now();
        loop {
            let busy = self.metric("kiln_requests_running").await
                + self.metric("kiln_requests_waiting").await
                + self.metric("kiln_kv_blocks_used").await;
            if busy == 0.0 {
                return;
            }
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "the engine did not empty"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn shut_down(mut self) {
        let _ = self.stop.take().unwrap().send(());
        self.task.await.unwrap().unwrap();
        assert!(!self.app.engine.is_alive());
    }
}

fn text_of(choice: &Value) -> String {
    choice["text"]
        .as_str()
        .or_else(|| choice["message"]["content"].as_str())
        .unwrap()
        .to_string()
}

const PROMPT: &str = "Permission is hereby granted, free of charge, to any person";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_completions_match_kiln_run() {
    let s = start(Options::default()).await;
    let (status, r) = s
        .post(
            "/v1/completions",
            json!({"model": "kiln-default", "prompt": PROMPT, "max_tokens": 24, "temperature": 0,
                   "ignore_eos": true, "unknown_field": [1, 2]}),
        )
        .await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["object"], "text_completion");
    assert_eq!(r["model"], "kiln-default");
    assert_eq!(r["choices"][0]["finish_reason"], "length");
    assert_eq!(r["usage"]["completion_tokens"], 24);
    let (mut model, tokenizer) = load();
    let prompt = tokenizer.encode(PROMPT, true).unwrap();
    assert_eq!(r["usage"]["prompt_tokens"], prompt.len());
    assert_eq!(r["usage"]["total_tokens"], prompt.len() + 24);
    let g = generate(
        &mut model,
        &tokenizer,
        &prompt,
        &mut Sampler::new(SamplerConfig::greedy()),
        &GenerateOptions {
            max_tokens: 24,
            context: CONTEXT,
            kv_type: DType::F32,
            stop_strings: &[],
        },
        |_| {},
    )
    .unwrap();
    assert_eq!(text_of(&r["choices"][0]), g.text);

    // The same through a stream, with usage at the end.
    let events = s
        .stream(
            "/v1/completions",
            json!({"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": true,
                   "stream": true, "stream_options": {"include_usage": true}}),
        )
        .await;
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 24);
    let streamed: String = chunks
        .iter()
        .flat_map(|c| c["choices"].as_array().unwrap())
        .map(|c| c["text"].as_str().unwrap())
        .collect();
    assert_eq!(streamed, g.text);
    let finish = &chunks[chunks.len() - 2]["choices"][0];
    assert_eq!(finish["finish_reason"], "length");
    assert!(chunks[..chunks.len() - 1]
        .iter()
        .all(|c| c["usage"].is_null()));
    s.wait_idle().await;
    s.shut_down().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_prompt_forms_n_stop_and_logprobs() {
    let s = start(Options::default()).await;
    let messages = json!([{"role": "system", "content": "You write licenses."},
                          {"role": "user", "content": [{"type": "text", "text": "Write one."}]}]);
    let (status, r) = s
        .post(
            "/v1/chat/completions",
            json!({"messages": messages, "max_completion_tokens": 12, "temperature": 0}),
        )
        .await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["object"], "chat.completion");
    assert_eq!(r["choices"][0]["message"]["role"], "assistant");
    let whole = text_of(&r["choices"][0]);

    let events = s
        .stream(
            "/v1/chat/completions",
            json!({"messages": messages, "max_tokens": 12, "temperature": 0, "stream": true}),
        )
        .await;
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(chunks[0]["object"], "chat.completion.chunk");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let streamed: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(streamed, whole);
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "length"
    );

    // Several prompts, as text and as ids, n choices each, seeded.
    let ids = s.app.tokenizer.encode(PROMPT, true).unwrap();
    let (status, r) = s
        .post(
            "/v1/completions",
            json!({"prompt": [PROMPT, "The software is provided"], "n": 2, "max_tokens": 6,
                   "temperature": 1.0, "top_k": 40, "seed": 7}),
        )
        .await;
    assert_eq!(status, 200, "{r}");
    let indexes: Vec<u64> = r["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["index"].as_u64().unwrap())
        .collect();
    assert_eq!(indexes, [0, 1, 2, 3]);
    let (_, again) = s
        .post(
            "/v1/completions",
            json!({"prompt": [PROMPT, "The software is provided"], "n": 2, "max_tokens": 6,
                   "temperature": 1.0, "top_k": 40, "seed": 7}),
        )
        .await;
    assert_eq!(r["choices"], again["choices"], "a seed reproduces");
    let (status, by_ids) = s
        .post(
            "/v1/completions",
            json!({"prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": true}),
        )
        .await;
    assert_eq!(status, 200);
    let (_, by_text) = s
        .post(
            "/v1/completions",
            json!({"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": true}),
        )
        .await;
    assert_eq!(by_ids["choices"], by_text["choices"]);

    // A stop string cuts the text before it.
    let full = text_of(&by_text["choices"][0]);
    let stop: String = full.chars().skip(6).take(4).collect();
    let (_, r) = s
        .post(
            "/v1/completions",
            json!({"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stop": [stop]}),
        )
        .await;
    assert_eq!(r["choices"][0]["finish_reason"], "stop");
    let cut = text_of(&r["choices"][0]);
    assert!(
        full.starts_with(&cut) && !cut.contains(&stop),
        "{cut:?} of {full:?} at {stop:?}"
    );

    // Log-probabilities: the greedy token is the most likely one.
    let (_, r) = s
        .post(
            "/v1/completions",
            json!({"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "logprobs": 2}),
        )
        .await;
    let lp = &r["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 3);
    let first = lp["token_logprobs"][0].as_f64().unwrap();
    let top: Vec<f64> = lp["top_logprobs"][0]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_f64().unwrap())
        .collect();
    assert_eq!(top.len(), 2);
    assert!(first <= 0.0 && top.iter().all(|&t| t <= first + 1e-6));
    let (_, r) = s
        .post(
            "/v1/chat/completions",
            json!({"messages": messages, "max_tokens": 2, "logprobs": true, "top_logprobs": 3}),
        )
        .await;
    let content = &r["choices"][0]["logprobs"]["content"];
    assert_eq!(content[0]["top_logprobs"].as_array().unwrap().len(), 3);

    // Tokenize and back.
    let (status, t) = s.post("/tokenize", json!({"prompt": PROMPT})).await;
    assert_eq!(status, 200);
    assert_eq!(t["tokens"], json!(ids));
    assert_eq!(t["max_model_len"], CONTEXT);
    let (_, d) = s
        .post("/detokenize", json!({"tokens": t["tokens"].clone()}))
        .await;
    assert!(d["prompt"].as_str().unwrap().ends_with(PROMPT));
    s.wait_idle().await;
    s.shut_down().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_openai_errors() {
    let s = start(Options {
        api_key: Some("sesame".into()),
        ..Options::default()
    })
    .await;
    let send = |body: &'static str, key: Option<&'static str>| {
        let mut r = s
            .client
            .post(format!("{}/v1/completions", s.url))
            .body(body);
        if body.len() > 1 << 20 {
            // The server answers a body past its limit without reading it and closes the
            // connection: kept for the next request, the client would find it closed.
            r = r.header(reqwest::header::CONNECTION, "close");
        }
        if let Some(k) = key {
            r = r.bearer_auth(k);
        }
        async move {
            let r = r.send().await.unwrap();
            let status = r.status().as_u16();
            let retry = r.headers().get("retry-after").cloned();
            (status, r.json::<Value>().await.unwrap(), retry)
        }
    };
    let (status, e, _) = send(r#"{"prompt": "x"}"#, None).await;
    assert_eq!(status, 401);
    assert_eq!(e["error"]["code"], "invalid_api_key");
    assert_eq!(send(r#"{"prompt": "x"}"#, Some("wrong")).await.0, 401);
    let key = Some("sesame");
    let (status, e, _) = send(r#"{"prompt": "x", "max_tokens": 1}"#, key).await;
    assert_eq!(status, 200, "{e}");
    // The same fields asking for nothing are accepted, as clients send them by default.
    let (status, e, _) = send(
        r#"{"prompt": "x", "max_tokens": 1, "response_format": {"type": "text"}, "tools": [],
            "best_of": 1, "logit_bias": {}, "suffix": ""}"#,
        key,
    )
    .await;
    assert_eq!(status, 200, "{e}");
    let (status, e, _) = send(
        r#"{"prompt": "x", "max_tokens": 1, "tool_choice": "none",
            "tools": [{"type": "function", "function": {"name": "f"}}]}"#,
        key,
    )
    .await;
    assert_eq!(status, 200, "{e}");
    let (status, e, _) = send("{not json", key).await;
    assert_eq!(status, 400);
    assert_eq!(e["error"]["type"], "invalid_request_error");
    // The scheme's name in any case (RFC 9110), as some clients send it.
    let r = s
        .client
        .post(format!("{}/v1/completions", s.url))
        .header(reqwest::header::AUTHORIZATION, "bearer sesame")
        .body(r#"{"prompt": "x", "max_tokens": 1}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    // A role outside OpenAI's is refused, not written into the prompt as it is.
    for role in ["wizard", "", "user\nassistant"] {
        let r = s
            .client
            .post(format!("{}/v1/chat/completions", s.url))
            .bearer_auth("sesame")
            .json(&json!({"messages": [{"role": role, "content": "hi"}], "max_tokens": 1}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 400, "{role:?}");
        let e = r.json::<Value>().await.unwrap();
        assert_eq!(e["error"]["param"], "messages[0].role", "{e}");
    }
    let cases = [
        (r#"{"prompt": "x", "temperature": "hot"}"#, "temperature"),
        (r#"{"prompt": "x", "temperature": -1}"#, "temperature"),
        (r#"{"prompt": "x", "temperature": 2.5}"#, "temperature"),
        (r#"{"prompt": "x", "n": 0}"#, "n"),
        (r#"{"prompt": "x", "max_tokens": -3}"#, "max_tokens"),
        (r#"{"prompt": [], "max_tokens": 1}"#, "prompt"),
        (r#"{"prompt": [999999]}"#, "prompt"),
        (r#"{"max_tokens": 1}"#, "prompt"),
        (r#"{"prompt": "x", "stop": 3}"#, "stop"),
        // OpenAI fields kiln does not implement, asked for: refused, not ignored.
        (
            r#"{"prompt": "x", "response_format": {"type": "json_object"}}"#,
            "response_format",
        ),
        (
            r#"{"prompt": "x", "tools": [{"type": "function", "function": {"name": "f"}}]}"#,
            "tools",
        ),
        (
            r#"{"prompt": "x", "functions": [{"name": "f"}], "function_call": "auto"}"#,
            "functions",
        ),
        (r#"{"prompt": "x", "best_of": 3}"#, "best_of"),
        (
            r#"{"prompt": "x", "logit_bias": {"50256": -100}}"#,
            "logit_bias",
        ),
        (r#"{"prompt": "x", "suffix": "end"}"#, "suffix"),
    ];
    for (body, param) in cases {
        let (status, e, _) = send(body, key).await;
        assert_eq!(status, 400, "{body}: {e}");
        assert_eq!(e["error"]["param"], param, "{body}: {e}");
    }
    // A field of several forms says which it takes.
    let (status, e, _) = send(r#"{"prompt": ["x", [1, 2]]}"#, key).await;
    assert_eq!(status, 400);
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("an array of token ids"),
        "{e}"
    );
    let long = format!(r#"{{"prompt": "{}"}}"#, "licence ".repeat(CONTEXT));
    let long: &'static str = Box::leak(long.into_boxed_str());
    let (status, e, _) = send(long, key).await;
    assert_eq!(status, 400);
    assert!(
        e["error"]["message"].as_str().unwrap().contains("context"),
        "{e}"
    );
    let (status, e, _) = send(r#"{"prompt": "x", "model": "gpt-9"}"#, key).await;
    assert_eq!(status, 404);
    assert_eq!(e["error"]["code"], "model_not_found");
    // A body past the server's limit: 413, as an error object (axum alone says it in
    // plain text), on the tokenizer's endpoint too.
    let huge = format!(r#"{{"prompt": "{}"}}"#, "x".repeat(3 << 20));
    let huge: &'static str = Box::leak(huge.into_boxed_str());
    let (status, e, _) = send(huge, key).await;
    assert_eq!(status, 413, "{e}");
    assert_eq!(e["error"]["code"], "request_too_large", "{e}");
    assert!(
        e["error"]["message"].as_str().unwrap().contains("2 MiB"),
        "{e}"
    );
    // A client of its own, not asking to close: the server says it closes (the body's
    // rest is not read), so that a client does not reuse the connection.
    let r = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap()
        .post(format!("{}/tokenize", s.url))
        .bearer_auth("sesame")
        .body(huge)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 413);
    assert_eq!(r.headers()["connection"], "close");
    assert_eq!(
        r.json::<Value>().await.unwrap()["error"]["code"],
        "request_too_large"
    );
    // Chat messages: every role but the assistant's has content; text parts only.
    let chat_cases = [
        (json!({"messages": []}), "messages"),
        (
            json!({"messages": [{"role": "user"}]}),
            "messages[0].content",
        ),
        (
            json!({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": null}]}),
            "messages[1].content",
        ),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
            "messages[0].content[0]",
        ),
    ];
    for (body, param) in chat_cases {
        let r = s
            .client
            .post(format!("{}/v1/chat/completions", s.url))
            .bearer_auth("sesame")
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 400, "{body}");
        let e = r.json::<Value>().await.unwrap();
        assert_eq!(e["error"]["param"], param, "{body}: {e}");
    }
    // A content-less assistant turn (a tool call's) is part of a conversation.
    let r = s
        .client
        .post(format!("{}/v1/chat/completions", s.url))
        .bearer_auth("sesame")
        .json(&json!({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": null},
                                    {"role": "user", "content": "Go on"}], "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    // A wrong method: 405 as an error object.
    let r = s
        .client
        .get(format!("{}/v1/chat/completions", s.url))
        .bearer_auth("sesame")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 405);
    let e = r.json::<Value>().await.unwrap();
    assert!(
        e["error"]["message"].as_str().unwrap().contains("POST"),
        "{e}"
    );
    // Health and metrics need no key; the models list does.
    assert_eq!(s.get("/health").await.0, 200);
    assert_eq!(s.get("/v1/models").await.0, 401);
    assert_eq!(s.get("/no/such/thing").await.0, 404);
    s.wait_idle().await;
    s.shut_down().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_is_429_and_a_disconnect_frees_everything() {
    let s = start(Options {
        max_seqs: 1,
        max_waiting: 1,
        ..Options::default()
    })
    .await;
    // More sequences than the queue ever holds: the request's fault (400), not a 429 that
    // a client would retry for ever.
    let r = s
        .client
        .post(format!("{}/v1/completions", s.url))
        .json(&json!({"prompt": "x", "n": 2, "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["param"], "n", "{e}");
    let long = json!({"prompt": PROMPT, "max_tokens": 400, "ignore_eos": true, "stream": true});
    let mut running = s
        .client
        .post(format!("{}/v1/completions", s.url))
        .json(&long)
        .send()
        .await
        .unwrap();
    // Its first tokens: it is running.
    running.chunk().await.unwrap().unwrap();
    let queued = s
        .client
        .post(format!("{}/v1/completions", s.url))
        .json(&long)
        .send();
    let queued = tokio::spawn(queued);
    let start = Instant::now();
    while s.metric("kiln_requests_waiting").await < 1.0 {
        assert!(start.elapsed() < Duration::from_secs(10));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let r = s
        .client
        .post(format!("{}/v1/completions", s.url))
        .json(&json!({"prompt": "x"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["retry-after"], "1");
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["type"], "rate_limit_error");

    // Both clients go away mid-stream: their sequences end and their blocks come back.
    // (Blocks are held throughout but for the moment between the first one's end, should
    // it finish first, and the second's admission: polled.)
    let start = Instant::now();
    while s.metric("kiln_kv_blocks_used").await == 0.0 {
        assert!(start.elapsed() < Duration::from_secs(10), "no blocks held");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    drop(running);
    let queued = queued.await.unwrap().unwrap();
    drop(queued);
    s.wait_idle().await;
    assert!(
        s.metric("kiln_generation_tokens_total").await < 2.0 * 400.0,
        "cancelled before the end"
    );
    let (_, metrics) = s.get("/metrics").await;
    assert!(
        metrics.contains("kiln_sequences_finished_total{reason=\"cancelled\"} 2"),
        "{metrics}"
    );
    s.shut_down().await;
}

/// A request at temperature 0 gets the same tokens, and the same log-probabilities to the
/// bit, alone and among others: a long prompt (two chunks) included, and others that share
/// its first blocks through the prefix cache, or start a cold cache.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_tokens_do_not_depend_on_the_batch() {
    let s = start(Options::default()).await;
    let long_prompt =
        "Permission is hereby granted to deal in the Software without restriction, ".repeat(20);
    let request = |prompt: &str| {
        json!({"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": true,
               "logprobs": 1})
    };
    // Alone, on a cold cache.
    let alone_short = s.post("/v1/completions", request(PROMPT)).await.1;
    let alone_long = s.post("/v1/completions", request(&long_prompt)).await.1;
    assert_eq!(s.metric("kiln_prefix_cache_hit_tokens_total").await, 0.0);
    let mut others = Vec::new();
    for i in 0..14 {
        // Half share the long prompt's first blocks, half do not.
        let prompt = if i % 2 == 0 {
            format!("{}{i} The licensor grants", &long_prompt[..200])
        } else {
            format!("{i} The licensor grants")
        };
        let body = json!({"prompt": prompt, "max_tokens": 40, "temperature": 0.9, "seed": i,
                          "ignore_eos": true});
        let (client, url) = (s.client.clone(), format!("{}/v1/completions", s.url));
        others.push(tokio::spawn(async move {
            client.post(url).json(&body).send().await.unwrap().status()
        }));
    }
    let (short, long) = tokio::join!(
        s.post("/v1/completions", request(PROMPT)),
        s.post("/v1/completions", request(&long_prompt))
    );
    for o in others {
        assert_eq!(o.await.unwrap(), 200);
    }
    assert!(s.metric("kiln_prefix_cache_hit_tokens_total").await > 0.0);
    for (alone, together) in [(alone_short, short.1), (alone_long, long.1)] {
        for field in ["tokens", "token_logprobs"] {
            assert_eq!(
                alone["choices"][0]["logprobs"][field],
                together["choices"][0]["logprobs"][field]
            );
        }
        assert_eq!(alone["choices"][0]["text"], together["choices"][0]["text"]);
    }
    s.wait_idle().await;
    s.shut_down().await;
}

/// `text_offset` counts the characters of the tokens before, the same streamed as whole:
/// text held back while it may still begin a stop string (the greedy text here is
/// newlines and spaces: a trailing space may begin " qzx", which never completes) does
/// not move it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_offsets_are_the_same_streamed_and_whole() {
    let s = start(Options::default()).await;
    let ask = |stream: bool| {
        json!({"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": true,
               "logprobs": 1, "stop": " qzx", "stream": stream})
    };
    let whole = s.post("/v1/completions", ask(false)).await.1;
    let lp = &whole["choices"][0]["logprobs"];
    let offsets: Vec<u64> = serde_json::from_value(lp["text_offset"].clone()).unwrap();
    let tokens: Vec<String> = serde_json::from_value(lp["tokens"].clone()).unwrap();
    assert_eq!(offsets.len(), 16);
    assert_eq!(offsets[0], 0);
    for k in 1..offsets.len() {
        assert_eq!(
            offsets[k] - offsets[k - 1],
            tokens[k - 1].chars().count() as u64,
            "{tokens:?}"
        );
    }
    let mut streamed = Vec::new();
    for data in s.stream("/v1/completions", ask(true)).await {
        if data == "[DONE]" {
            continue;
        }
        let chunk: Value = serde_json::from_str(&data).unwrap();
        if let Some(o) = chunk["choices"][0]["logprobs"]["text_offset"].as_array() {
            streamed.extend(o.iter().map(|v| v.as_u64().unwrap()));
        }
    }
    assert_eq!(streamed, offsets);
    s.wait_idle().await;
    s.shut_down().await;
}

/// `echo`: the prompt's text before the choice's, whole and streamed, for text and token
/// id prompts; with logprobs, a 400 saying why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_puts_the_prompt_before_the_completion() {
    let s = start(Options::default()).await;
    let ask = |prompt: Value, echo: bool, stream: bool| {
        json!({"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": true,
               "echo": echo, "stream": stream})
    };
    let plain = s
        .post("/v1/completions", ask(json!(PROMPT), false, false))
        .await
        .1;
    let echoed = s
        .post("/v1/completions", ask(json!(PROMPT), true, false))
        .await
        .1;
    let completion = text_of(&plain["choices"][0]);
    assert_eq!(
        text_of(&echoed["choices"][0]),
        format!("{PROMPT}{completion}")
    );
    assert_eq!(echoed["usage"], plain["usage"]);
    let events = s
        .stream("/v1/completions", ask(json!(PROMPT), true, true))
        .await;
    let streamed: String = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str::<Value>(e).unwrap())
        .flat_map(|c| c["choices"].as_array().unwrap().clone())
        .map(|c| c["text"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(streamed, format!("{PROMPT}{completion}"));
    // Token ids echo as their text.
    let (_, tokenizer) = load();
    let ids = tokenizer.encode(PROMPT, false).unwrap();
    let by_ids = s
        .post("/v1/completions", ask(json!(ids), true, false))
        .await
        .1;
    let text = text_of(&by_ids["choices"][0]);
    assert!(text.starts_with(&tokenizer.decode(&ids).unwrap()), "{text}");
    let mut with_logprobs = ask(json!(PROMPT), true, false);
    with_logprobs["logprobs"] = json!(1);
    let (status, e) = s.post("/v1/completions", with_logprobs).await;
    assert_eq!(status, 400, "{e}");
    assert!(
        e["error"]["message"].as_str().unwrap().contains("echo"),
        "{e}"
    );
    s.wait_idle().await;
    s.shut_down().await;
}

/// The model split over two ranks (`kiln serve --tp 2`, here ranks on the CPU summing
/// through host memory) serves the whole model's greedy tokens to concurrent requests,
/// long prompts in chunks among them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_split_model_serves_what_the_whole_one_does() {
    let long_prompt =
        "Permission is hereby granted to deal in the Software without restriction, ".repeat(8);
    let prompts = [
        PROMPT.to_string(),
        long_prompt,
        "The licensor grants".to_string(),
    ];
    let mut texts = Vec::new();
    for tp in [1, 2] {
        let s = start(Options {
            tp,
            ..Options::default()
        })
        .await;
        let asks = prompts.iter().map(|p| {
            s.post(
                "/v1/completions",
                json!({"prompt": p, "max_tokens": 16, "temperature": 0, "ignore_eos": true}),
            )
        });
        let answers = futures_util::future::join_all(asks).await;
        texts.push(
            answers
                .into_iter()
                .map(|(status, r)| {
                    assert_eq!(status, 200, "--tp {tp}: {r}");
                    text_of(&r["choices"][0])
                })
                .collect::<Vec<_>>(),
        );
        s.wait_idle().await;
        s.shut_down().await;
    }
    assert_eq!(texts[0], texts[1]);
}

/// With a pool of one context, concurrent sequences run out of blocks: the newest are
/// preempted and recomputed, and every request still ends with all its tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preemption_recomputes_and_every_request_finishes() {
    let s = start(Options {
        kv_blocks: CONTEXT / 16,
        ..Options::default()
    })
    .await;
    let mut requests = Vec::new();
    for i in 0..4 {
        let body = json!({"prompt": format!("{i} {PROMPT}"), "max_tokens": 150,
                          "temperature": 0, "ignore_eos": true});
        let (client, url) = (s.client.clone(), format!("{}/v1/completions", s.url));
        requests.push(tokio::spawn(async move {
            client
                .post(url)
                .json(&body)
                .send()
                .await
                .unwrap()
                .json::<Value>()
                .await
                .unwrap()
        }));
    }
    for r in requests {
        let r = r.await.unwrap();
        assert_eq!(r["usage"]["completion_tokens"], 150, "{r}");
    }
    assert!(s.metric("kiln_preemptions_total").await > 0.0);
    s.wait_idle().await;
    s.shut_down().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_metrics_and_a_stopped_engine() {
    let s = start(Options::default()).await;
    let (status, models) = s.get("/v1/models").await;
    assert_eq!(status, 200);
    let models: Value = serde_json::from_str(&models).unwrap();
    assert_eq!(models["data"][0]["id"], "kiln-default");
    // One model by name (openai-python's models.retrieve), also by the path it was loaded
    // from; another name is a 404.
    for name in ["kiln-default", "models/kiln-default.gguf"] {
        let (status, card) = s.get(&format!("/v1/models/{name}")).await;
        assert_eq!(status, 200, "{name}: {card}");
        let card: Value = serde_json::from_str(&card).unwrap();
        assert_eq!(card["id"], "kiln-default");
        assert_eq!(card["object"], "model");
    }
    assert_eq!(s.get("/v1/models/other").await.0, 404);
    // A body of one JSON object and then more is not a request.
    let r = s
        .client
        .post(format!("{}/v1/completions", s.url))
        .header("content-type", "application/json")
        .body(r#"{"prompt": "x", "max_tokens": 1} xyz"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let (status, r) = s
        .post(
            "/v1/completions",
            json!({"model": "models/kiln-default.gguf", "prompt": PROMPT, "max_tokens": 4}),
        )
        .await;
    assert_eq!(status, 200, "{r}");
    let (_, metrics) = s.get("/metrics").await;
    for name in [
        "kiln_requests_running",
        "kiln_requests_waiting",
        "kiln_kv_blocks_used",
        "kiln_prompt_tokens_total",
        "kiln_generation_tokens_total",
        "kiln_time_to_first_token_seconds_bucket",
        "kiln_inter_token_latency_seconds_bucket",
        "kiln_request_latency_seconds_count 1",
    ] {
        assert!(metrics.contains(name), "{name} in {metrics}");
    }
    s.app.engine.stop();
    assert_eq!(s.get("/health").await.0, 503);
    let (status, _) = s
        .post(
            "/v1/completions",
            json!({"prompt": PROMPT, "max_tokens": 4}),
        )
        .await;
    assert_eq!(status, 503);
    s.shut_down().await;
}
