//! `/v1/completions` and `/v1/chat/completions`: the request checked into sequences for
//! the engine, and the engine's events back into OpenAI's response objects, whole or
//! streamed.

use super::error::ApiError;
use super::request::{parse, Endpoint, GenerationRequest, PromptInput, MAX_N};
use super::{blocking, check_ids, stream, App};
use crate::engine::sequence::{FinishReason, SeqEvent, TokenLogprob};
use crate::engine::{QueueFull, Submission};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use kiln_tokenizer::Tokenizer;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

pub async fn completions(
    State(app): State<Arc<App>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    generate(app, body?, Endpoint::Completions).await
}

pub async fn chat_completions(
    State(app): State<Arc<App>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    generate(app, body?, Endpoint::Chat).await
}

/// What a response says besides its choices.
pub struct Job {
    pub endpoint: Endpoint,
    pub id: String,
    pub created: u64,
    pub model: String,
    pub choices: usize,
    /// Tokens of the prompts, each counted once however many choices it has.
    pub prompt_tokens: usize,
    pub include_usage: bool,
    pub tokenizer: Arc<Tokenizer>,
    /// Each choice's prompt text, sent before its own (`echo`); empty otherwise.
    pub echo: Vec<String>,
}

async fn generate(app: Arc<App>, body: Bytes, endpoint: Endpoint) -> Result<Response, ApiError> {
    let mut req: GenerationRequest = parse(&body)?;
    app.check_model(req.model.as_deref())?;
    let params = req.sampling(endpoint)?;
    let n = req.n()?;
    // Chat has no echo (OpenAI's neither): an unknown field there, ignored.
    let echo = endpoint == Endpoint::Completions && req.echo.unwrap_or(false);
    if echo && req.logprobs.is_some() {
        return Err(ApiError::field(
            "echo",
            "with logprobs is not supported: kiln does not score the prompt's tokens",
        ));
    }
    let (prompts, texts): (Vec<Vec<u32>>, Vec<String>) = match endpoint {
        Endpoint::Completions => completion_prompts(&app, req.prompt.take())
            .await?
            .into_iter()
            .unzip(),
        Endpoint::Chat => match &req.messages {
            Some(messages) => (vec![app.chat_prompt(messages).await?], Vec::new()),
            None => return Err(ApiError::field("messages", "is required")),
        },
    };
    let context = app.model.context;
    let param = match endpoint {
        Endpoint::Completions => "prompt",
        Endpoint::Chat => "messages",
    };
    for p in &prompts {
        if p.is_empty() {
            return Err(ApiError::field(param, "the prompt has no tokens"));
        }
        if p.len() >= context {
            return Err(ApiError::field(
                param,
                format!(
                    "the prompt has {} tokens and the context {context}: it must be shorter than the context",
                    p.len()
                ),
            ));
        }
        check_ids(&app.tokenizer, p, param)?;
    }
    if prompts.len() * n > MAX_N as usize {
        return Err(ApiError::field(
            "n",
            format!(
                "{} prompts times n = {n} is more than {MAX_N} sequences",
                prompts.len()
            ),
        ));
    }
    let prompt_tokens = prompts.iter().map(Vec::len).sum();
    // Choice k is prompt k / n's.
    let echo: Vec<String> = match echo {
        true => texts
            .iter()
            .flat_map(|t| std::iter::repeat_n(t.clone(), n))
            .collect(),
        false => Vec::new(),
    };
    let mut sequences = Vec::with_capacity(prompts.len() * n);
    for prompt in prompts {
        for j in 0..n {
            let mut p = params.clone();
            p.fit_context(prompt.len(), context);
            // Each choice draws its own tokens, reproducibly from the request's seed.
            p.seed = p.seed.wrapping_add(j as u64);
            sequences.push((prompt.clone(), p));
        }
    }
    if !app.engine.is_alive() {
        return Err(ApiError::engine_down());
    }
    let choices = sequences.len();
    // More than the queue ever holds: not a 429 (clients retry those), the request's own.
    if choices > app.engine.max_waiting() {
        return Err(ApiError::field(
            "n",
            format!(
                "{} prompts times n = {n} is {choices} sequences, more than this server queues at once (--max-waiting {})",
                choices / n.max(1),
                app.engine.max_waiting()
            ),
        ));
    }
    let submission = app
        .engine
        .submit(sequences)
        .map_err(|QueueFull| ApiError::queue_full())?;
    let job = Job {
        endpoint,
        id: response_id(endpoint),
        created: unix_seconds(),
        model: app.model.id.clone(),
        choices,
        prompt_tokens,
        include_usage: req.include_usage(),
        tokenizer: app.tokenizer.clone(),
        echo,
    };
    if req.stream.unwrap_or(false) {
        Ok(stream::sse(job, submission).into_response())
    } else {
        whole(job, submission)
            .await
            .map(IntoResponse::into_response)
    }
}

/// The prompts of a `/v1/completions` request as tokens (text gets the model's BOS).
/// Each prompt's token ids and its text (as given, or the ids decoded).
async fn completion_prompts(
    app: &Arc<App>,
    prompt: Option<PromptInput>,
) -> Result<Vec<(Vec<u32>, String)>, ApiError> {
    let tokenizer = app.tokenizer.clone();
    let decoded = |lists: Vec<Vec<u32>>| {
        blocking(move || {
            lists
                .into_iter()
                .map(|ids| {
                    // An id outside the vocabulary is refused later, naming it.
                    let text = tokenizer.decode(&ids).unwrap_or_default();
                    Ok((ids, text))
                })
                .collect()
        })
    };
    let texts = match prompt {
        None => return Err(ApiError::field("prompt", "is required")),
        Some(PromptInput::Ids(ids)) => return decoded(vec![ids]).await,
        Some(PromptInput::IdLists(lists)) if lists.is_empty() => {
            return Err(ApiError::field("prompt", "is empty"))
        }
        Some(PromptInput::IdLists(lists)) => return decoded(lists).await,
        Some(PromptInput::Text(t)) => vec![t],
        Some(PromptInput::Texts(ts)) if ts.is_empty() => {
            return Err(ApiError::field("prompt", "is empty"))
        }
        Some(PromptInput::Texts(ts)) => ts,
    };
    let tokenizer = app.tokenizer.clone();
    blocking(move || {
        texts
            .into_iter()
            .map(|t| Ok((tokenizer.encode(&t, true)?, t)))
            .collect::<Result<Vec<_>, kiln_core::Error>>()
            .map_err(|e| ApiError::field("prompt", e.to_string()))
    })
    .await
}

/// A response's id: the server's start in nanoseconds, then a count, so that ids neither
/// repeat within a server nor across a restart (the start's seconds and the count written
/// side by side did both: 0x1 then 0x23 reads as 0x12 then 0x3).
fn response_id(endpoint: Endpoint) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    static START: std::sync::OnceLock<u128> = std::sync::OnceLock::new();
    let start = START.get_or_init(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    });
    let prefix = match endpoint {
        Endpoint::Completions => "cmpl",
        Endpoint::Chat => "chatcmpl",
    };
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("{prefix}-{start:x}-{n:x}")
}

pub fn unix_seconds() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// One choice as it builds up.
#[derive(Default)]
pub struct Choice {
    pub text: String,
    pub logprobs: Vec<TokenLogprob>,
    pub finish: Option<FinishReason>,
    pub completion_tokens: usize,
}

/// Wait for every choice to finish, then answer with them all.
async fn whole(job: Job, mut submission: Submission) -> Result<Json<Value>, ApiError> {
    let mut choices: Vec<Choice> = (0..job.choices)
        .map(|i| Choice {
            text: job.echo.get(i).cloned().unwrap_or_default(),
            ..Choice::default()
        })
        .collect();
    let mut left = job.choices;
    while left > 0 {
        let Some((i, event)) = submission.events.recv().await else {
            return Err(ApiError::internal(
                "the engine stopped before the request finished",
            ));
        };
        let c = &mut choices[i];
        match event {
            SeqEvent::Token { text, logprob } => {
                c.text.push_str(&text);
                c.logprobs.extend(logprob);
            }
            SeqEvent::Finished {
                tail,
                reason,
                completion_tokens,
                ..
            } => {
                c.text.push_str(&tail);
                c.finish = Some(reason);
                c.completion_tokens = completion_tokens;
                left -= 1;
            }
            SeqEvent::Failed(message) => return Err(ApiError::internal(message)),
        }
    }
    let wants_logprobs = choices.iter().any(|c| !c.logprobs.is_empty());
    let rendered: Vec<Value> = choices
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let logprobs = wants_logprobs.then(|| job.logprobs(&c.logprobs, 0));
            let finish = c.finish.map(FinishReason::as_str);
            match job.endpoint {
                Endpoint::Completions => json!({
                    "index": i, "text": c.text, "logprobs": logprobs, "finish_reason": finish,
                }),
                Endpoint::Chat => json!({
                    "index": i,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": logprobs,
                    "finish_reason": finish,
                }),
            }
        })
        .collect();
    let completion_tokens = choices.iter().map(|c| c.completion_tokens).sum();
    Ok(Json(json!({
        "id": job.id,
        "object": job.object(false),
        "created": job.created,
        "model": job.model,
        "choices": rendered,
        "usage": job.usage(completion_tokens),
    })))
}

impl Job {
    pub fn object(&self, chunk: bool) -> &'static str {
        match (self.endpoint, chunk) {
            (Endpoint::Completions, _) => "text_completion",
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
        }
    }

    pub fn usage(&self, completion_tokens: usize) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
        })
    }

    fn token_text(&self, id: u32) -> String {
        String::from_utf8_lossy(&self.tokenizer.token_bytes(id)).into_owned()
    }

    /// Characters of these tokens' texts: how far they move `text_offset`.
    pub fn text_chars(&self, tokens: &[TokenLogprob]) -> usize {
        tokens
            .iter()
            .map(|t| self.token_text(t.token).chars().count())
            .sum()
    }

    /// Log-probabilities as the endpoint reports them; `text_offset` counts characters
    /// (as OpenAI's and vLLM's do) from `offset` (the tokens reported before these, when
    /// streaming).
    pub fn logprobs(&self, tokens: &[TokenLogprob], offset: usize) -> Value {
        match self.endpoint {
            Endpoint::Completions => {
                let mut at = offset;
                let mut offsets = Vec::with_capacity(tokens.len());
                for t in tokens {
                    offsets.push(at);
                    at += self.token_text(t.token).chars().count();
                }
                json!({
                    "tokens": tokens.iter().map(|t| self.token_text(t.token)).collect::<Vec<_>>(),
                    "token_logprobs": tokens.iter().map(|t| t.logprob).collect::<Vec<_>>(),
                    "top_logprobs": tokens.iter().map(|t| {
                        t.top.iter().map(|&(id, lp)| (self.token_text(id), json!(lp)))
                            .collect::<serde_json::Map<_, _>>()
                    }).collect::<Vec<_>>(),
                    "text_offset": offsets,
                })
            }
            Endpoint::Chat => {
                let entry = |id: u32, lp: f32| {
                    json!({
                        "token": self.token_text(id),
                        "logprob": lp,
                        "bytes": self.tokenizer.token_bytes(id),
                    })
                };
                let content: Vec<Value> = tokens
                    .iter()
                    .map(|t| {
                        let mut e = entry(t.token, t.logprob);
                        e["top_logprobs"] = t.top.iter().map(|&(id, lp)| entry(id, lp)).collect();
                        e
                    })
                    .collect();
                json!({ "content": content })
            }
        }
    }
}
