//! The fields of `/v1/completions` and `/v1/chat/completions` requests, parsed so that an
//! error names the field at fault, and checked into the engine's [`SamplingParams`].
//! Unknown fields are ignored, as OpenAI's clients expect; OpenAI fields that would change
//! what is generated and that kiln does not implement (JSON mode, tools, `best_of`,
//! `logit_bias`, `suffix`) are a 400 naming the field when asked for, not ignored (a
//! client asking for JSON would otherwise get free text without knowing).

use super::error::ApiError;
use crate::engine::sequence::{SamplingParams, MAX_TOP_LOGPROBS};
use serde::de::DeserializeOwned;
use serde::Deserialize;

/// Parse a JSON body; a syntax error or a field of the wrong type is a 400 naming it.
pub fn parse<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    // A request is an object: any other JSON would reach serde as a struct read from a
    // sequence, whose errors name positions and the parser's types.
    match body.iter().find(|b| !b.is_ascii_whitespace()) {
        None => {
            return Err(ApiError::bad_request(
                "the body is empty: send the request as a JSON object",
            ))
        }
        Some(b'{') => {}
        Some(_) => return Err(ApiError::bad_request(
            "the body is not a JSON object: send the request's fields as one (`{\"model\": ...}`)",
        )),
    }
    let de = &mut serde_json::Deserializer::from_slice(body);
    let request = serde_path_to_error::deserialize(&mut *de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if inner.is_syntax() || inner.is_eof() || path == "." {
            ApiError::bad_request(format!("the body is not a valid JSON request: {inner}"))
        } else {
            ApiError::field(path, inner.to_string())
        }
    })?;
    // Only whitespace may follow the object (`{...} xyz` is not one JSON value).
    de.end()
        .map_err(|e| ApiError::bad_request(format!("the body is not a valid JSON request: {e}")))?;
    Ok(request)
}

#[derive(Deserialize, Debug)]
#[serde(
    untagged,
    expecting = "a string, an array of strings, an array of token ids, or an array of arrays of token ids"
)]
pub enum PromptInput {
    Text(String),
    Ids(Vec<u32>),
    Texts(Vec<String>),
    IdLists(Vec<Vec<u32>>),
}

#[derive(Deserialize, Debug)]
#[serde(untagged, expecting = "a string or an array of strings")]
pub enum StopInput {
    One(String),
    Many(Vec<String>),
}

/// `logprobs`: a count of alternatives in `/v1/completions`, a switch in chat.
#[derive(Deserialize, Debug, Clone, Copy)]
#[serde(
    untagged,
    expecting = "true or false (chat), or a count of alternatives (completions)"
)]
pub enum LogprobsInput {
    On(bool),
    Top(u64),
}

#[derive(Deserialize, Debug)]
#[serde(untagged, expecting = "a string or an array of content parts")]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Deserialize, Debug)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Deserialize, Debug)]
pub struct ChatMessage {
    pub role: String,
    #[serde(default)]
    pub content: Option<MessageContent>,
}

#[derive(Deserialize, Debug, Default)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// Every field either endpoint reads; each handler requires its own (`prompt` or
/// `messages`).
#[derive(Deserialize, Debug, Default)]
pub struct GenerationRequest {
    pub model: Option<String>,
    pub prompt: Option<PromptInput>,
    pub messages: Option<Vec<ChatMessage>>,
    pub max_tokens: Option<u64>,
    pub max_completion_tokens: Option<u64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub seed: Option<i64>,
    pub stop: Option<StopInput>,
    pub n: Option<u64>,
    pub logprobs: Option<LogprobsInput>,
    pub top_logprobs: Option<u64>,
    pub ignore_eos: Option<bool>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    /// `/v1/completions`: the prompt's text before each choice's.
    pub echo: Option<bool>,
    /// Refused unless they ask for nothing (`unsupported`).
    pub response_format: Option<serde_json::Value>,
    pub tools: Option<Vec<serde_json::Value>>,
    pub tool_choice: Option<serde_json::Value>,
    /// The older form of `tools` and `tool_choice`.
    pub functions: Option<Vec<serde_json::Value>>,
    pub function_call: Option<serde_json::Value>,
    pub best_of: Option<u64>,
    pub logit_bias: Option<serde_json::Map<String, serde_json::Value>>,
    pub suffix: Option<String>,
}

/// The most choices a request may ask for.
pub const MAX_N: u64 = 128;
/// Stop strings a request may give, and their longest.
const MAX_STOPS: usize = 16;
const MAX_STOP_BYTES: usize = 1024;

/// Which endpoint a request came to: their defaults and `logprobs` differ.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    Chat,
}

/// `max_tokens` of `/v1/completions` when not given (OpenAI's).
const DEFAULT_COMPLETION_TOKENS: usize = 16;

fn in_range(name: &str, v: Option<f32>, lo: f32, hi: f32, default: f32) -> Result<f32, ApiError> {
    let v = v.unwrap_or(default);
    if !v.is_finite() || v < lo || v > hi {
        return Err(ApiError::field(
            name,
            format!("{v} is not within [{lo}, {hi}]"),
        ));
    }
    Ok(v)
}

impl GenerationRequest {
    /// The sampling settings, before the prompt's length is known: `max_new_tokens` is the
    /// asked-for count (or the endpoint's default), for [`SamplingParams::fit_context`].
    pub fn sampling(&self, endpoint: Endpoint) -> Result<SamplingParams, ApiError> {
        self.unsupported()?;
        // OpenAI's range: clients that validate against it expect the same answer here.
        let temperature = in_range("temperature", self.temperature, 0.0, 2.0, 1.0)?;
        let top_p = in_range("top_p", self.top_p, 0.0, 1.0, 1.0)?;
        if top_p == 0.0 {
            return Err(ApiError::field("top_p", "0 keeps no token; use (0, 1]"));
        }
        let top_k = match self.top_k.unwrap_or(0) {
            -1 | 0 => 0,
            k if k > 0 => k as usize,
            k => {
                return Err(ApiError::field(
                    "top_k",
                    format!("{k}: -1 or 0 is off, else at least 1"),
                ))
            }
        };
        let min_p = in_range("min_p", self.min_p, 0.0, 1.0, 0.0)?;
        let presence_penalty = in_range("presence_penalty", self.presence_penalty, -2.0, 2.0, 0.0)?;
        let frequency_penalty =
            in_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0, 0.0)?;
        let repetition_penalty = in_range(
            "repetition_penalty",
            self.repetition_penalty,
            0.0,
            100.0,
            1.0,
        )?;
        if repetition_penalty == 0.0 {
            return Err(ApiError::field(
                "repetition_penalty",
                "must be above 0 (1 is off)",
            ));
        }
        let max_new_tokens = match (self.max_completion_tokens, self.max_tokens) {
            (Some(n), _) | (None, Some(n)) if n == 0 => {
                let name = if self.max_completion_tokens.is_some() {
                    "max_completion_tokens"
                } else {
                    "max_tokens"
                };
                return Err(ApiError::field(name, "must be at least 1"));
            }
            (Some(n), _) | (None, Some(n)) => usize::try_from(n).unwrap_or(usize::MAX),
            (None, None) => match endpoint {
                Endpoint::Completions => DEFAULT_COMPLETION_TOKENS,
                // Up to the context.
                Endpoint::Chat => usize::MAX,
            },
        };
        let stop = match &self.stop {
            None => Vec::new(),
            Some(StopInput::One(s)) => vec![s.clone()],
            Some(StopInput::Many(v)) => v.clone(),
        };
        if stop.len() > MAX_STOPS {
            return Err(ApiError::field(
                "stop",
                format!("at most {MAX_STOPS} stop strings"),
            ));
        }
        if stop.iter().any(|s| s.len() > MAX_STOP_BYTES) {
            return Err(ApiError::field(
                "stop",
                format!("a stop string is longer than {MAX_STOP_BYTES} bytes"),
            ));
        }
        let logprobs = self.logprobs(endpoint)?;
        Ok(SamplingParams {
            temperature,
            top_p,
            top_k,
            min_p,
            presence_penalty,
            frequency_penalty,
            repetition_penalty,
            // The seed's bits, negative ones included; without one, a fresh draw.
            seed: self.seed.map_or_else(fresh_seed, |s| s as u64),
            max_new_tokens,
            stop: stop.into_iter().filter(|s| !s.is_empty()).collect(),
            ignore_eos: self.ignore_eos.unwrap_or(false),
            logprobs,
        })
    }

    /// A 400 for a field kiln does not implement that asks for something: JSON mode or a
    /// schema, tools (or functions) the model may call, `best_of` other than 1 or `n`,
    /// biased logits, a suffix.
    fn unsupported(&self) -> Result<(), ApiError> {
        if let Some(format) = &self.response_format {
            let kind = format.get("type").and_then(|t| t.as_str());
            if kind != Some("text") {
                return Err(ApiError::field(
                    "response_format",
                    format!(
                        "{} is not supported: kiln has no constrained decoding (leave it out, \
                         or {{\"type\": \"text\"}}, and ask for JSON in the prompt)",
                        kind.map_or_else(|| format.to_string(), |k| format!("\"{k}\"")),
                    ),
                ));
            }
        }
        // Tools offered with the choice "none" ask for no call (agents send that on turns
        // that want text).
        let calls = |offered: &Option<Vec<serde_json::Value>>,
                     choice: &Option<serde_json::Value>| {
            offered.as_ref().is_some_and(|t| !t.is_empty())
                && choice.as_ref().and_then(|c| c.as_str()) != Some("none")
        };
        if calls(&self.tools, &self.tool_choice) {
            return Err(ApiError::field(
                "tools",
                "tool calls are not supported: leave `tools` out or empty, or set \
                 `tool_choice` to \"none\"",
            ));
        }
        if calls(&self.functions, &self.function_call) {
            return Err(ApiError::field(
                "functions",
                "function calls are not supported: leave `functions` out or empty, or set \
                 `function_call` to \"none\"",
            ));
        }
        if let Some(best_of) = self.best_of {
            let n = self.n.unwrap_or(1);
            if best_of != n && best_of != 1 {
                return Err(ApiError::field(
                    "best_of",
                    format!("{best_of} is not supported: only `n` ({n}) choices are drawn"),
                ));
            }
        }
        if self.logit_bias.as_ref().is_some_and(|b| !b.is_empty()) {
            return Err(ApiError::field(
                "logit_bias",
                "biased logits are not supported",
            ));
        }
        if self.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
            return Err(ApiError::field(
                "suffix",
                "text after the completion (insertion) is not supported",
            ));
        }
        Ok(())
    }

    fn logprobs(&self, endpoint: Endpoint) -> Result<Option<usize>, ApiError> {
        let check = |name: &str, n: u64| {
            if n > MAX_TOP_LOGPROBS as u64 {
                Err(ApiError::field(
                    name,
                    format!("{n} is above {MAX_TOP_LOGPROBS}"),
                ))
            } else {
                Ok(n as usize)
            }
        };
        match (endpoint, self.logprobs) {
            (_, None) | (Endpoint::Chat, Some(LogprobsInput::On(false))) => {
                if endpoint == Endpoint::Chat && self.top_logprobs.is_some_and(|n| n > 0) {
                    return Err(ApiError::field("top_logprobs", "needs `logprobs: true`"));
                }
                Ok(None)
            }
            (Endpoint::Chat, Some(LogprobsInput::On(true))) => {
                check("top_logprobs", self.top_logprobs.unwrap_or(0)).map(Some)
            }
            (Endpoint::Completions, Some(LogprobsInput::Top(n))) => check("logprobs", n).map(Some),
            (Endpoint::Chat, Some(LogprobsInput::Top(_))) => Err(ApiError::field(
                "logprobs",
                "is true or false here (top_logprobs gives the count)",
            )),
            (Endpoint::Completions, Some(LogprobsInput::On(_))) => Err(ApiError::field(
                "logprobs",
                "is a count of alternatives (0 to 20) here",
            )),
        }
    }

    pub fn n(&self) -> Result<usize, ApiError> {
        match self.n.unwrap_or(1) {
            n @ 1..=MAX_N => Ok(n as usize),
            n => Err(ApiError::field(
                "n",
                format!("{n} is not within 1 to {MAX_N}"),
            )),
        }
    }

    pub fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false)
    }
}

impl SamplingParams {
    /// Fit the tokens to generate into what the context leaves after the prompt.
    pub fn fit_context(&mut self, prompt_len: usize, context: usize) {
        self.max_new_tokens = self.max_new_tokens.min(context - prompt_len);
    }
}

/// A seed for a request that gave none: the clock's nanoseconds and a counter.
fn fresh_seed() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    nanos ^ COUNTER.fetch_add(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampling(json: &str, endpoint: Endpoint) -> Result<SamplingParams, ApiError> {
        parse::<GenerationRequest>(json.as_bytes())?.sampling(endpoint)
    }

    #[test]
    fn errors_name_the_field() {
        let e =
            parse::<GenerationRequest>(br#"{"prompt": "x", "temperature": "hot"}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("temperature"));
        let e = parse::<GenerationRequest>(br#"{"messages": [{"role": 3}]}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].role"));
        let e = parse::<GenerationRequest>(b"{\"prompt\": ").unwrap_err();
        assert!(e.param.is_none() && e.message.contains("not a valid JSON"));
        for (body, says) in [
            (&b"[[1], {}]"[..], "not a JSON object"),
            (b" \"x\"", "not a JSON object"),
            (b"\xff", "not a JSON object"),
            (b" \n", "the body is empty"),
        ] {
            let e = parse::<GenerationRequest>(body).unwrap_err();
            assert!(
                e.param.is_none() && e.message.contains(says),
                "{}",
                e.message
            );
        }
        let e = sampling(r#"{"top_p": 1.5}"#, Endpoint::Chat).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("top_p"));
        let e = sampling(r#"{"max_tokens": 0}"#, Endpoint::Chat).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        let e = sampling(r#"{"logprobs": 21}"#, Endpoint::Completions).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("logprobs"));
        let e = sampling(r#"{"top_logprobs": 2}"#, Endpoint::Chat).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("top_logprobs"));
    }

    #[test]
    fn defaults_and_unknown_fields() {
        let p = sampling(
            r#"{"prompt": [1, 2], "unknown": {"x": 1}, "seed": -1}"#,
            Endpoint::Completions,
        )
        .unwrap();
        assert_eq!((p.temperature, p.top_k, p.max_new_tokens), (1.0, 0, 16));
        assert_eq!(p.seed, u64::MAX);
        let p = sampling(
            r#"{"max_completion_tokens": 5, "max_tokens": 9, "stop": "x", "top_k": -1,
                "logprobs": true, "top_logprobs": 3}"#,
            Endpoint::Chat,
        )
        .unwrap();
        assert_eq!(
            (p.max_new_tokens, p.stop.clone(), p.logprobs),
            (5, vec!["x".into()], Some(3))
        );
        let p = sampling("{}", Endpoint::Chat).unwrap();
        assert_eq!(p.max_new_tokens, usize::MAX);
    }
}
