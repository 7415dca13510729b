//! OpenAI's HTTP surface: `/v1/completions`, `/v1/chat/completions`, `/v1/models`, and
//! vLLM's `/health`, `/metrics`, `/tokenize`, `/detokenize`.

mod error;
mod generation;
pub mod request;
mod stream;

use crate::engine::Engine;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
pub use error::ApiError;
use kiln_models::chat::Message;
use kiln_tokenizer::Tokenizer;
use request::{parse, ChatMessage, MessageContent};
use serde::Deserialize;
use std::future::Future;
use std::sync::Arc;

/// Renders a conversation with the model's chat template. The CLI's renders in a child
/// process limited in memory and time (templates come with downloaded models: untrusted
/// code); rendering blocks, so it is called off the async threads.
pub trait ChatRenderer: Send + Sync {
    fn render(&self, messages: &[Message]) -> Result<String, RenderError>;
}

/// Why a conversation was not rendered.
#[derive(Debug)]
pub enum RenderError {
    /// The template refused these messages or failed on them (the request's 400).
    Messages(String),
    /// The renderer itself could not run (the server's 500): the request was not at fault.
    Renderer(String),
}

/// Roles a chat message may have (OpenAI's, and `function`, its older name for `tool`).
/// A role is written into the prompt as it is, so any other text is refused rather than
/// passed to the template.
const ROLES: [&str; 6] = [
    "system",
    "developer",
    "user",
    "assistant",
    "tool",
    "function",
];

/// The model as clients name it.
pub struct ServedModel {
    /// The id `/v1/models` lists.
    pub id: String,
    /// Other names accepted in `model` (the path it was started with).
    pub aliases: Vec<String>,
    /// Positions a sequence may use.
    pub context: usize,
}

/// Everything a request handler needs.
pub struct App {
    pub engine: Arc<Engine>,
    pub tokenizer: Arc<Tokenizer>,
    pub model: ServedModel,
    pub chat: Arc<dyn ChatRenderer>,
    pub api_key: Option<String>,
    /// When the server started (unix seconds): `created` of the model.
    pub started: u64,
}

impl App {
    /// Accept a request's `model` when it names the served one (or none).
    fn check_model(&self, asked: Option<&str>) -> Result<(), ApiError> {
        match asked {
            None | Some("") => Ok(()),
            Some(m) if m == self.model.id || self.model.aliases.iter().any(|a| a == m) => Ok(()),
            Some(m) => Err(ApiError::unknown_model(m)),
        }
    }

    /// The text of `messages` through the chat template, then its tokens.
    async fn chat_prompt(self: &Arc<Self>, messages: &[ChatMessage]) -> Result<Vec<u32>, ApiError> {
        if messages.is_empty() {
            return Err(ApiError::field("messages", "is empty"));
        }
        let mut plain = Vec::with_capacity(messages.len());
        for (i, m) in messages.iter().enumerate() {
            if !ROLES.contains(&m.role.as_str()) {
                return Err(ApiError::field(
                    format!("messages[{i}].role"),
                    format!(
                        "`{}` is not one of {}",
                        m.role.escape_debug(),
                        ROLES.join(", ")
                    ),
                ));
            }
            let content = match &m.content {
                // An assistant's turn may be content-less (it called a tool); every other
                // role's message is its content.
                None if m.role == "assistant" => String::new(),
                None => {
                    return Err(ApiError::field(
                        format!("messages[{i}].content"),
                        format!("is required in a `{}` message", m.role),
                    ))
                }
                Some(MessageContent::Text(t)) => t.clone(),
                Some(MessageContent::Parts(parts)) => {
                    let mut text = String::new();
                    for (j, p) in parts.iter().enumerate() {
                        match (p.kind.as_str(), &p.text) {
                            ("text", Some(t)) => text.push_str(t),
                            _ => {
                                return Err(ApiError::field(
                                    format!("messages[{i}].content[{j}]"),
                                    format!("a `{}` part: this model reads text only", p.kind),
                                ))
                            }
                        }
                    }
                    text
                }
            };
            plain.push(Message {
                role: m.role.clone(),
                content,
            });
        }
        let app = self.clone();
        blocking(move || {
            let text = app.chat.render(&plain).map_err(|e| match e {
                RenderError::Messages(e) => ApiError::field("messages", e),
                RenderError::Renderer(e) => ApiError::internal(format!("rendering the chat: {e}")),
            })?;
            // The template writes BOS itself when the model wants one.
            app.tokenizer
                .encode_with_special_tokens(&text, false)
                .map_err(|e| ApiError::field("messages", e.to_string()))
        })
        .await
    }
}

/// Run blocking work (tokenizing a long prompt, rendering a template) off the async threads.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::internal(format!("a worker failed: {e}")))?
}

pub fn router(app: Arc<App>) -> Router {
    let guarded = Router::new()
        .route("/v1/completions", post(generation::completions))
        .route("/v1/chat/completions", post(generation::chat_completions))
        .route("/v1/models", get(models))
        .route("/v1/models/{*id}", get(model))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .layer(DefaultBodyLimit::max(error::MAX_BODY_BYTES))
        .route_layer(middleware::from_fn_with_state(app.clone(), require_key));
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .merge(guarded)
        .fallback(|| async {
            ApiError {
                status: StatusCode::NOT_FOUND,
                message: "no such endpoint".into(),
                param: None,
                code: None,
            }
        })
        .method_not_allowed_fallback(|| async {
            ApiError {
                status: StatusCode::METHOD_NOT_ALLOWED,
                message: "this endpoint takes another method: POST for /v1/completions, \
                          /v1/chat/completions, /tokenize and /detokenize, GET for /v1/models, \
                          /health and /metrics"
                    .into(),
                param: None,
                code: None,
            }
        })
        .with_state(app)
}

/// Serve `app` on `listener` until `shutdown` completes; then stop accepting, let the
/// requests in flight finish, and stop the engine once they have.
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: Arc<App>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    use axum::serve::ListenerExt;
    let engine = app.engine.clone();
    // Tokens go out as small writes: Nagle's algorithm would hold each behind the
    // client's delayed ACK (~40 ms on Linux).
    let listener = listener.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!("TCP_NODELAY: {e}");
        }
    });
    axum::serve(listener, router(app))
        .with_graceful_shutdown(shutdown)
        .await?;
    tokio::task::spawn_blocking(move || engine.stop())
        .await
        .map_err(std::io::Error::other)
}

/// Refuse requests without the API key, when the server has one.
async fn require_key(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    if let Some(key) = &app.api_key {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(bearer_token)
            .unwrap_or("");
        if !same_secret(given.trim().as_bytes(), key.as_bytes()) {
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(req).await
}

/// The token of an `Authorization: Bearer TOKEN` value; the scheme's name is
/// case-insensitive (RFC 9110), so `bearer` and `BEARER` are taken too.
fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim_start().split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then_some(token)
}

/// Compare secrets in time that does not depend on where they differ.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn health(State(app): State<Arc<App>>) -> Response {
    if app.engine.is_alive() {
        StatusCode::OK.into_response()
    } else {
        ApiError::engine_down().into_response()
    }
}

async fn metrics(State(app): State<Arc<App>>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        app.engine.metrics.render(),
    )
        .into_response()
}

async fn models(State(app): State<Arc<App>>) -> Json<serde_json::Value> {
    Json(serde_json::json!({
        "object": "list",
        "data": [model_card(&app)],
    }))
}

/// `GET /v1/models/{id}` (openai-python's `models.retrieve`): the served model under any
/// name a request may give it, or a 404.
async fn model(
    State(app): State<Arc<App>>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Result<Json<serde_json::Value>, ApiError> {
    if id.is_empty() {
        return Err(ApiError::unknown_model(&id));
    }
    app.check_model(Some(&id))?;
    Ok(Json(model_card(&app)))
}

fn model_card(app: &App) -> serde_json::Value {
    serde_json::json!({
        "id": app.model.id,
        "object": "model",
        "created": app.started,
        "owned_by": "kiln",
        "max_model_len": app.model.context,
    })
}

#[derive(Deserialize)]
struct TokenizeRequest {
    model: Option<String>,
    prompt: Option<String>,
    messages: Option<Vec<ChatMessage>>,
    add_special_tokens: Option<bool>,
}

async fn tokenize(
    State(app): State<Arc<App>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let req: TokenizeRequest = parse(&body?)?;
    app.check_model(req.model.as_deref())?;
    let tokens = match (req.prompt, req.messages) {
        (Some(prompt), None) => {
            let add_special = req.add_special_tokens.unwrap_or(true);
            let tokenizer = app.tokenizer.clone();
            blocking(move || {
                tokenizer
                    .encode(&prompt, add_special)
                    .map_err(|e| ApiError::field("prompt", e.to_string()))
            })
            .await?
        }
        (None, Some(messages)) => app.chat_prompt(&messages).await?,
        _ => return Err(ApiError::bad_request("give one of `prompt` or `messages`")),
    };
    Ok(Json(serde_json::json!({
        "count": tokens.len(),
        "max_model_len": app.model.context,
        "tokens": tokens,
    }))
    .into_response())
}

#[derive(Deserialize)]
struct DetokenizeRequest {
    model: Option<String>,
    tokens: Vec<u32>,
}

async fn detokenize(
    State(app): State<Arc<App>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let req: DetokenizeRequest = parse(&body?)?;
    app.check_model(req.model.as_deref())?;
    check_ids(&app.tokenizer, &req.tokens, "tokens")?;
    let text = app
        .tokenizer
        .decode(&req.tokens)
        .map_err(|e| ApiError::field("tokens", e.to_string()))?;
    Ok(Json(serde_json::json!({ "prompt": text })).into_response())
}

/// Refuse token ids outside the vocabulary.
fn check_ids(tokenizer: &Tokenizer, ids: &[u32], param: &str) -> Result<(), ApiError> {
    let vocab = tokenizer.vocab_size();
    match ids.iter().find(|&&id| id as usize >= vocab) {
        Some(id) => Err(ApiError::field(
            param,
            format!("token id {id} is outside the vocabulary of {vocab}"),
        )),
        None => Ok(()),
    }
}
