//! `kiln bench-serve`: a load generator for an OpenAI-compatible server (`kiln serve`,
//! llama.cpp's `llama-server`, vLLM) on this machine. For each concurrency level, that many
//! clients stream `/v1/completions` requests back to back (prompts of a set length sharing a
//! prefix, a set number of tokens out with `ignore_eos`), bounded in requests and in time.
//! It prints output tok/s, per-user tok/s (its tokens over the time from request to last
//! token), time to first token and inter-token latency (per request: its mean gap), as a
//! table and as one JSON line; requests that came back with fewer tokens than asked are
//! counted as short, with the finish reasons the server gave, since a server that ends
//! requests early would otherwise look faster per token than it is.

use crate::console::{CliResult, Failure};
use kiln_core::Error;
use serde_json::{json, Value};
use std::io::Write;
use std::net::IpAddr;
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct BenchServeArgs {
    /// The server: http://HOST:PORT, on this machine (loopback only).
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    pub url: String,
    /// Concurrent clients, one level after another.
    #[arg(long, value_delimiter = ',', default_value = "1,16,64")]
    pub concurrency: Vec<usize>,
    /// Prompt tokens a request.
    #[arg(long, default_value_t = 128)]
    pub prompt_tokens: usize,
    /// Tokens generated a request.
    #[arg(long, default_value_t = 64)]
    pub output_tokens: usize,
    /// Share of each prompt that is a prefix common to all requests (0-1).
    #[arg(long, default_value_t = 0.5)]
    pub shared_prefix: f64,
    /// Requests a level (default: twice its concurrency).
    #[arg(long)]
    pub requests: Option<usize>,
    /// Seconds a level may take; requests still running then are dropped from the count.
    #[arg(long, default_value_t = 120)]
    pub max_seconds: u64,
    /// The requests' temperature: 0 is greedy; above it each token is drawn (with no
    /// top-k, as OpenAI's clients send).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// The `model` field (default: the first of /v1/models).
    #[arg(long)]
    pub model: Option<String>,
    #[arg(long)]
    pub api_key: Option<String>,
}

/// Upper bounds, so that a run always ends.
const MAX_CONCURRENCY: usize = 1024;
const MAX_REQUESTS: usize = 100_000;
const MAX_TOKENS: usize = 1 << 20;

/// What one request saw.
struct Sample {
    ttft: Duration,
    tokens: usize,
    /// From the first token to the last.
    decode: Duration,
    /// The server's `finish_reason`, if it sent one.
    finish: Option<String>,
}

impl Sample {
    /// The mean time between its tokens. Per request rather than per event: several
    /// events often arrive in one read, and the gaps inside a read say nothing.
    fn inter_token(&self) -> Option<Duration> {
        (self.tokens > 1).then(|| self.decode / (self.tokens as u32 - 1))
    }
}

struct Level {
    concurrency: usize,
    requests: usize,
    failed: usize,
    /// Requests that returned fewer tokens than asked.
    short: usize,
    /// How many requests ended for each finish reason (`none`: not sent).
    finishes: std::collections::BTreeMap<String, usize>,
    output_tokens: usize,
    wall: Duration,
    per_user: f64,
    ttft: Vec<Duration>,
    itl: Vec<Duration>,
}

pub fn run(a: BenchServeArgs) -> CliResult {
    check_loopback(&a.url)?;
    if a.concurrency.is_empty() || a.concurrency.iter().any(|&c| c == 0 || c > MAX_CONCURRENCY) {
        return Err(Failure::usage(format!(
            "--concurrency: levels from 1 to {MAX_CONCURRENCY}"
        )));
    }
    if !(0.0..=1.0).contains(&a.shared_prefix) {
        return Err(Failure::usage("--shared-prefix: a share from 0 to 1"));
    }
    if !(0.0..=2.0).contains(&a.temperature) {
        return Err(Failure::usage(
            "--temperature: from 0 to 2, as OpenAI takes it",
        ));
    }
    if a.prompt_tokens == 0
        || a.prompt_tokens > MAX_TOKENS
        || a.output_tokens == 0
        || a.output_tokens > MAX_TOKENS
    {
        return Err(Failure::usage(format!(
            "--prompt-tokens and --output-tokens: from 1 to {MAX_TOKENS}"
        )));
    }
    if a.requests.is_some_and(|r| r == 0 || r > MAX_REQUESTS) {
        return Err(Failure::usage(format!(
            "--requests: from 1 to {MAX_REQUESTS}"
        )));
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::io("starting the load generator's runtime", e))?;
    let levels = runtime.block_on(sweep(&a))?;
    // A closed stdout (`| head`) is not worth a panic.
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{}\n{}", table(&a, &levels), to_json(&a, &levels));
    Ok(())
}

/// Refuse any server but this machine's: a load generator must not be pointed elsewhere.
fn check_loopback(url: &str) -> CliResult<()> {
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| Failure::usage(format!("--url {url}: http://HOST:PORT")))?;
    let authority = rest.split('/').next().unwrap_or("");
    let host = match authority.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or(""),
        None => authority.rsplit_once(':').map_or(authority, |(h, _)| h),
    };
    let loopback = host == "localhost" || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback());
    if !loopback {
        return Err(Failure::usage(format!(
            "--url {url}: bench-serve loads servers on this machine only (127.0.0.1, ::1, localhost)"
        )));
    }
    Ok(())
}

fn http_error(what: &str, e: impl std::fmt::Display) -> Failure {
    Failure::from(Error::Device(format!("{what}: {e}")))
}

async fn sweep(a: &BenchServeArgs) -> CliResult<Vec<Level>> {
    let client = reqwest::Client::new();
    let base = a.url.trim_end_matches('/').to_string();
    let auth = |r: reqwest::RequestBuilder| match &a.api_key {
        Some(k) => r.bearer_auth(k),
        None => r,
    };
    let model = match &a.model {
        Some(m) => m.clone(),
        None => {
            let models: Value = auth(client.get(format!("{base}/v1/models")))
                .send()
                .await
                .map_err(|e| http_error(&format!("{base}/v1/models"), e))?
                .json()
                .await
                .map_err(|e| http_error("/v1/models", e))?;
            models["data"][0]["id"]
                .as_str()
                .ok_or_else(|| http_error("/v1/models", "lists no model"))?
                .to_string()
        }
    };
    // Real token ids, so that prompts have exactly the asked length.
    let corpus: Value = auth(client.post(format!("{base}/tokenize")))
        .json(&json!({"model": model, "prompt": CORPUS, "content": CORPUS}))
        .send()
        .await
        .map_err(|e| http_error("/tokenize", e))?
        .json()
        .await
        .map_err(|e| http_error("/tokenize", e))?;
    let corpus: Vec<u64> = corpus["tokens"]
        .as_array()
        .map(|t| t.iter().filter_map(Value::as_u64).collect())
        .unwrap_or_default();
    if corpus.len() < 2 {
        return Err(http_error("/tokenize", "returned no tokens"));
    }
    let shared = (a.prompt_tokens as f64 * a.shared_prefix).round() as usize;
    let mut levels = Vec::new();
    let mut request_no = 0usize;
    for &c in &a.concurrency {
        let total = a.requests.unwrap_or(2 * c);
        let deadline = Instant::now() + Duration::from_secs(a.max_seconds);
        let next = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let start = Instant::now();
        let mut clients = Vec::new();
        for _ in 0..c {
            let (client, next, base, model) =
                (client.clone(), next.clone(), base.clone(), model.clone());
            let corpus = corpus.clone();
            let (prompt_tokens, output_tokens, key, temperature) = (
                a.prompt_tokens,
                a.output_tokens,
                a.api_key.clone(),
                a.temperature,
            );
            let first = request_no;
            clients.push(tokio::spawn(async move {
                let mut samples = Vec::new();
                let mut failed = 0;
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if i >= total || Instant::now() >= deadline {
                        break;
                    }
                    let prompt = prompt_ids(&corpus, prompt_tokens, shared, first + i);
                    let body = json!({
                        "model": model, "prompt": prompt, "max_tokens": output_tokens,
                        "temperature": temperature, "ignore_eos": true, "stream": true,
                        "stream_options": {"include_usage": true},
                    });
                    let mut req = client.post(format!("{base}/v1/completions")).json(&body);
                    if let Some(k) = &key {
                        req = req.bearer_auth(k);
                    }
                    let left = deadline.saturating_duration_since(Instant::now());
                    match tokio::time::timeout(left, one_request(req)).await {
                        Ok(Some(s)) => samples.push(s),
                        Ok(None) => failed += 1,
                        Err(_) => break,
                    }
                }
                (samples, failed)
            }));
        }
        let mut samples = Vec::new();
        let mut failed = 0;
        for client in clients {
            let (s, f) = client.await.map_err(|e| http_error("a client", e))?;
            samples.extend(s);
            failed += f;
        }
        request_no += total;
        levels.push(level(c, samples, failed, start.elapsed(), a.output_tokens));
    }
    Ok(levels)
}

/// A prompt: `shared` tokens common to every request, then tokens that differ by request.
fn prompt_ids(corpus: &[u64], len: usize, shared: usize, request: usize) -> Vec<u64> {
    let skip_bos = usize::from(corpus.len() > 2);
    let body = &corpus[skip_bos..];
    let mut ids: Vec<u64> = corpus[..skip_bos].to_vec();
    ids.extend((0..shared).map(|i| body[i % body.len()]));
    // A different stride through the corpus per request.
    let stride = 1 + request % (body.len() - 1).max(1);
    ids.extend(
        (0..len.saturating_sub(ids.len()))
            .map(|i| body[(request * 7919 + i * stride) % body.len()]),
    );
    ids.truncate(len.max(1));
    ids
}

/// Stream one request; `None` when it fails.
async fn one_request(req: reqwest::RequestBuilder) -> Option<Sample> {
    let start = Instant::now();
    let mut r = req.send().await.ok()?;
    if !r.status().is_success() {
        return None;
    }
    let mut buf = String::new();
    let (mut first, mut last) = (None::<Instant>, None::<Instant>);
    // Tokens from the usage chunk; servers that send none (llama-server's streams) are
    // counted by the chunks that carry text, one token each.
    let (mut tokens, mut text_chunks) = (None::<usize>, 0);
    let mut finish = None;
    while let Some(chunk) = r.chunk().await.ok()? {
        buf.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            let now = Instant::now();
            for data in event.lines().filter_map(|l| l.strip_prefix("data: ")) {
                if data == "[DONE]" {
                    continue;
                }
                let v: Value = serde_json::from_str(data).ok()?;
                if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                    tokens = Some(n as usize);
                }
                if let Some(f) = v["choices"][0]["finish_reason"].as_str() {
                    finish = Some(f.to_string());
                }
                let text = v["choices"][0]["text"].as_str().unwrap_or("");
                if !text.is_empty() {
                    text_chunks += 1;
                    first.get_or_insert(now);
                    last = Some(now);
                }
            }
        }
    }
    let first = first?;
    Some(Sample {
        ttft: first - start,
        tokens: tokens.unwrap_or(text_chunks),
        decode: last.unwrap_or(first) - first,
        finish,
    })
}

fn level(
    concurrency: usize,
    samples: Vec<Sample>,
    failed: usize,
    wall: Duration,
    asked: usize,
) -> Level {
    let mut finishes = std::collections::BTreeMap::new();
    for s in &samples {
        let f = s.finish.clone().unwrap_or_else(|| "none".to_string());
        *finishes.entry(f).or_insert(0) += 1;
    }
    // What a user sees: its tokens over the time from sending the request to the last.
    let per_user: Vec<f64> = samples
        .iter()
        .map(|s| s.tokens as f64 / (s.ttft + s.decode).as_secs_f64().max(1e-9))
        .collect();
    Level {
        concurrency,
        requests: samples.len(),
        failed,
        short: samples.iter().filter(|s| s.tokens < asked).count(),
        finishes,
        output_tokens: samples.iter().map(|s| s.tokens).sum(),
        wall,
        per_user: per_user.iter().sum::<f64>() / per_user.len().max(1) as f64,
        ttft: samples.iter().map(|s| s.ttft).collect(),
        itl: samples.iter().filter_map(Sample::inter_token).collect(),
    }
}

/// The `p`-th percentile in milliseconds (nearest rank); 0 for no values.
fn percentile_ms(values: &[Duration], p: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let mut v = values.to_vec();
    v.sort();
    let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
    v[rank.clamp(1, v.len()) - 1].as_secs_f64() * 1e3
}

fn table(a: &BenchServeArgs, levels: &[Level]) -> String {
    let mut out = format!(
        "{} prompt tokens ({:.0}% shared prefix), {} out\n\n| clients | requests | failed | short | output tok/s | per-user tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        a.prompt_tokens, a.shared_prefix * 100.0, a.output_tokens
    );
    for l in levels {
        out.push_str(&format!(
            "| {} | {} | {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2} | {:.2} |\n",
            l.concurrency,
            l.requests,
            l.failed,
            l.short,
            l.output_tokens as f64 / l.wall.as_secs_f64(),
            l.per_user,
            percentile_ms(&l.ttft, 50.0),
            percentile_ms(&l.ttft, 99.0),
            percentile_ms(&l.itl, 50.0),
            percentile_ms(&l.itl, 99.0),
        ));
    }
    out
}

fn to_json(a: &BenchServeArgs, levels: &[Level]) -> Value {
    json!({
        "url": a.url,
        "prompt_tokens": a.prompt_tokens,
        "output_tokens": a.output_tokens,
        "shared_prefix": a.shared_prefix,
        "levels": levels.iter().map(|l| json!({
            "concurrency": l.concurrency,
            "requests": l.requests,
            "failed": l.failed,
            "short": l.short,
            "finish_reasons": l.finishes,
            "output_tokens": l.output_tokens,
            "seconds": l.wall.as_secs_f64(),
            "output_tokens_per_s": l.output_tokens as f64 / l.wall.as_secs_f64(),
            "per_user_tokens_per_s": l.per_user,
            "ttft_ms": {"p50": percentile_ms(&l.ttft, 50.0), "p99": percentile_ms(&l.ttft, 99.0)},
            "itl_ms": {"p50": percentile_ms(&l.itl, 50.0), "p99": percentile_ms(&l.itl, 99.0)},
        })).collect::<Vec<_>>(),
    })
}

/// Text the prompts' tokens are drawn from.
const CORPUS: &str = "Permission is hereby granted, free of charge, to any person obtaining a copy of this software and associated documentation files (the Software), to deal in the Software without restriction, including without limitation the rights to use, copy, modify, merge, publish, distribute, sublicense, and/or sell copies of the Software, and to permit persons to whom the Software is furnished to do so, subject to the following conditions. The above copyright notice and this permission notice shall be included in all copies or substantial portions of the Software.";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_loopback_urls() {
        for ok in [
            "http://127.0.0.1:8080",
            "http://localhost:1",
            "http://[::1]:8080/",
            "http://127.1.2.3:9",
        ] {
            assert!(check_loopback(ok).is_ok(), "{ok}");
        }
        for bad in [
            "http://10.0.0.1:8080",
            "https://127.0.0.1:1",
            "http://example.com:80",
            "127.0.0.1:80",
        ] {
            assert!(check_loopback(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn prompts_have_their_length_and_share_their_prefix() {
        let corpus: Vec<u64> = (0..50).collect();
        let a = prompt_ids(&corpus, 40, 20, 1);
        let b = prompt_ids(&corpus, 40, 20, 2);
        assert_eq!((a.len(), b.len()), (40, 40));
        assert_eq!(a[..21], b[..21]);
        assert_ne!(a[21..], b[21..]);
        assert_eq!(
            percentile_ms(&[Duration::from_millis(3), Duration::from_millis(1)], 50.0),
            1.0
        );
    }

    #[test]
    fn requests_that_end_early_are_counted_short_with_their_reasons() {
        let sample = |tokens, finish: Option<&str>| Sample {
            ttft: Duration::from_millis(10),
            tokens,
            decode: Duration::from_millis(100),
            finish: finish.map(str::to_string),
        };
        let l = level(
            2,
            vec![
                sample(128, Some("length")),
                sample(40, Some("stop")),
                sample(12, None),
            ],
            1,
            Duration::from_secs(1),
            128,
        );
        assert_eq!((l.requests, l.failed, l.short), (3, 1, 2));
        assert_eq!(
            l.finishes.into_iter().collect::<Vec<_>>(),
            vec![
                ("length".to_string(), 1),
                ("none".to_string(), 1),
                ("stop".to_string(), 1)
            ]
        );
    }
}
