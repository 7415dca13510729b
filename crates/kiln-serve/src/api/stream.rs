//! Streaming responses: Server-Sent Events, `data: {chunk}` per piece of text and
//! `data: [DONE]` at the end, with one last chunk of `usage` (and no choices) when the
//! request asked for it (`stream_options.include_usage`).
//!
//! The stream owns the request's [`Submission`]: when the client disconnects, hyper drops
//! the stream, the submission with it, and the engine cancels the sequences and frees
//! their blocks before its next step.

use super::error::ApiError;
use super::generation::Job;
use super::request::Endpoint;
use crate::engine::sequence::{FinishReason, SeqEvent, TokenLogprob};
use crate::engine::Submission;
use axum::response::sse::{Event, KeepAlive, Sse};
use futures_util::Stream;
use serde_json::{json, Value};
use std::collections::VecDeque;
use std::convert::Infallible;
use std::time::Duration;

/// Sent while nothing else is, so that a client that went away is noticed (a write fails)
/// even while its sequences wait in the queue.
const KEEP_ALIVE: Duration = Duration::from_secs(5);

struct StreamState {
    job: Job,
    submission: Submission,
    /// Events built and not yet sent.
    queue: VecDeque<Event>,
    /// Per choice: characters of the tokens reported so far (completions' `text_offset`,
    /// as in a whole response: text held back for a stop string does not move it).
    reported: Vec<usize>,
    completion_tokens: usize,
    left: usize,
    done: bool,
}

pub fn sse(job: Job, submission: Submission) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let mut state = StreamState {
        reported: vec![0; job.choices],
        left: job.choices,
        job,
        submission,
        queue: VecDeque::new(),
        completion_tokens: 0,
        done: false,
    };
    // `echo`: each choice opens with its prompt's text.
    for i in 0..state.job.echo.len() {
        let chunk = state.chunk(i, Value::String(state.job.echo[i].clone()), None, None);
        state.queue.push_back(chunk);
    }
    if state.job.endpoint == Endpoint::Chat {
        // OpenAI opens each choice with its role.
        for i in 0..state.job.choices {
            let chunk = state.chunk(i, json!({"role": "assistant", "content": ""}), None, None);
            state.queue.push_back(chunk);
        }
    }
    let events = futures_util::stream::unfold(state, |mut s| async move {
        loop {
            if let Some(event) = s.queue.pop_front() {
                return Some((Ok(event), s));
            }
            if s.done {
                return None;
            }
            match s.submission.events.recv().await {
                Some((i, event)) => s.take(i, event),
                None => {
                    let e = ApiError::internal("the engine stopped before the request finished");
                    s.queue
                        .push_back(Event::default().data(e.body().to_string()));
                    s.finish();
                }
            }
        }
    });
    Sse::new(events).keep_alive(KeepAlive::new().interval(KEEP_ALIVE))
}

impl StreamState {
    fn take(&mut self, i: usize, event: SeqEvent) {
        match event {
            SeqEvent::Token { text, logprob } => {
                if !text.is_empty() || logprob.is_some() {
                    let logprobs: Vec<TokenLogprob> = logprob.into_iter().collect();
                    self.push_text(i, text, &logprobs, None);
                }
            }
            SeqEvent::Finished {
                tail,
                reason,
                completion_tokens,
                ..
            } => {
                self.completion_tokens += completion_tokens;
                self.push_text(i, tail, &[], Some(reason));
                self.left -= 1;
                if self.left == 0 {
                    self.finish();
                }
            }
            SeqEvent::Failed(message) => {
                let e = ApiError::internal(message);
                self.queue
                    .push_back(Event::default().data(e.body().to_string()));
                self.finish();
            }
        }
    }

    fn push_text(
        &mut self,
        i: usize,
        text: String,
        logprobs: &[TokenLogprob],
        finish: Option<FinishReason>,
    ) {
        let lp = (!logprobs.is_empty()).then(|| self.job.logprobs(logprobs, self.reported[i]));
        self.reported[i] += self.job.text_chars(logprobs);
        let content = match self.job.endpoint {
            Endpoint::Completions => Value::String(text),
            // The closing chunk's delta is empty, as OpenAI sends it.
            Endpoint::Chat if text.is_empty() && finish.is_some() => json!({}),
            Endpoint::Chat => json!({ "content": text }),
        };
        let chunk = self.chunk(i, content, lp, finish);
        self.queue.push_back(chunk);
    }

    /// One choice's chunk: `text` for completions, `delta` for chat.
    fn chunk(
        &self,
        i: usize,
        content: Value,
        logprobs: Option<Value>,
        finish: Option<FinishReason>,
    ) -> Event {
        let key = match self.job.endpoint {
            Endpoint::Completions => "text",
            Endpoint::Chat => "delta",
        };
        let mut choice = json!({
            "index": i,
            "logprobs": logprobs,
            "finish_reason": finish.map(FinishReason::as_str),
        });
        choice[key] = content;
        let mut chunk = json!({
            "id": self.job.id,
            "object": self.job.object(true),
            "created": self.job.created,
            "model": self.job.model,
            "choices": [choice],
        });
        if self.job.include_usage {
            chunk["usage"] = Value::Null;
        }
        Event::default().data(chunk.to_string())
    }

    /// The usage chunk when asked for, then `[DONE]`.
    fn finish(&mut self) {
        if self.job.include_usage {
            let chunk = json!({
                "id": self.job.id,
                "object": self.job.object(true),
                "created": self.job.created,
                "model": self.job.model,
                "choices": [],
                "usage": self.job.usage(self.completion_tokens),
            });
            self.queue
                .push_back(Event::default().data(chunk.to_string()));
        }
        self.queue.push_back(Event::default().data("[DONE]"));
        self.done = true;
    }
}
