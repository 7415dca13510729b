//! Errors as OpenAI returns them: a status and `{"error": {message, type, param, code}}`.

use axum::extract::rejection::BytesRejection;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// The request field at fault, when one is.
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    /// A bad field value: 400, naming the field.
    pub fn field(param: impl Into<String>, message: impl Into<String>) -> Self {
        let param = param.into();
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: format!("{param}: {}", message.into()),
            param: Some(param),
            code: None,
        }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: None,
            code: None,
        }
    }

    pub fn unknown_model(model: &str) -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("the model `{model}` does not exist (see /v1/models)"),
            param: Some("model".into()),
            code: Some("model_not_found"),
        }
    }

    pub fn unauthorized() -> Self {
        ApiError {
            status: StatusCode::UNAUTHORIZED,
            message: "a missing or wrong API key: send `Authorization: Bearer KEY`".into(),
            param: None,
            code: Some("invalid_api_key"),
        }
    }

    pub fn queue_full() -> Self {
        ApiError {
            status: StatusCode::TOO_MANY_REQUESTS,
            message: "the server's waiting queue is full; retry shortly".into(),
            param: None,
            code: Some("queue_full"),
        }
    }

    pub fn engine_down() -> Self {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: "the engine is not running".into(),
            param: None,
            code: None,
        }
    }

    pub fn internal(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            param: None,
            code: None,
        }
    }

    fn kind(&self) -> &'static str {
        match self.status {
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            s if s.is_server_error() => "server_error",
            _ => "invalid_request_error",
        }
    }

    /// The error object, also sent as an SSE event when a stream fails midway.
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind(),
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

/// The largest request body the server reads (axum's default, stated: a prompt of the
/// longest contexts served, as text or as token ids, is far below it).
pub const MAX_BODY_BYTES: usize = 2 << 20;

/// A body the server could not read (too large, cut off): the same error object as any
/// other, where axum alone answers in plain text.
impl From<BytesRejection> for ApiError {
    fn from(r: BytesRejection) -> Self {
        let status = r.status();
        let too_large = status == StatusCode::PAYLOAD_TOO_LARGE;
        let message = match too_large {
            true => format!(
                "the request body is larger than the server's limit of {} MiB",
                MAX_BODY_BYTES >> 20
            ),
            false => format!("the request body could not be read: {}", r.body_text()),
        };
        ApiError {
            status,
            message,
            param: None,
            code: too_large.then_some("request_too_large"),
        }
    }
}

/// Seconds a client refused for a full queue should wait.
const RETRY_AFTER_SECONDS: &str = "1";

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, Json(self.body())).into_response();
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            response.headers_mut().insert(
                header::RETRY_AFTER,
                HeaderValue::from_static(RETRY_AFTER_SECONDS),
            );
        }
        if self.status == StatusCode::PAYLOAD_TOO_LARGE {
            // The rest of the body is not read, so the connection cannot carry another
            // request: say so, or a client reusing it meets a broken pipe.
            response
                .headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        response
    }
}
