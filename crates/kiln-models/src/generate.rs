//! Text generation: prefill the prompt, then sample one token at a time, streaming text,
//! stopping at an end-of-generation token, a stop string, or the token budget.

use crate::model::Model;
use crate::sampler::Sampler;
use kiln_core::{Error, Result};
use kiln_tokenizer::Tokenizer;
use std::time::{Duration, Instant};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// An end-of-generation token.
    Eos,
    /// One of the stop strings appeared.
    StopString,
    /// The requested number of tokens.
    Length,
    /// The context is full.
    Context,
}

pub struct Generation {
    pub prompt_tokens: Vec<u32>,
    /// Generated ids (the stopping EOS excluded).
    pub tokens: Vec<u32>,
    pub text: String,
    pub stop: StopReason,
    pub prompt_time: Duration,
    pub gen_time: Duration,
}

pub struct GenerateOptions<'a> {
    pub max_tokens: usize,
    /// Context size (positions in the KV cache).
    pub context: usize,
    /// The type the KV cache keeps keys and values in (see [`crate::check_kv_type`]).
    pub kv_type: kiln_core::DType,
    pub stop_strings: &'a [String],
}

/// Turns token bytes into text as it becomes valid UTF-8, holding back text that could
/// still become a stop string. Public so that the server detokenizes and stops its
/// sequences exactly as `kiln run` does.
pub struct TextStream {
    pending: Vec<u8>,
    text: String,
    emitted: usize,
    stops: Vec<String>,
}

impl TextStream {
    pub fn new(stops: Vec<String>) -> Self {
        TextStream {
            pending: Vec::new(),
            text: String::new(),
            emitted: 0,
            stops,
        }
    }

    /// Add a token's bytes; returns true when a stop string completed (the text is then
    /// cut before it).
    pub fn push(&mut self, bytes: &[u8]) -> bool {
        self.pending.extend_from_slice(bytes);
        let valid = match std::str::from_utf8(&self.pending) {
            Ok(s) => s.len(),
            Err(e) if e.error_len().is_some() => {
                // Invalid bytes that no continuation can fix: show them as U+FFFD.
                let lossy = String::from_utf8_lossy(&self.pending).into_owned();
                self.text.push_str(&lossy);
                self.pending.clear();
                return self.cut_at_stop();
            }
            Err(e) => e.valid_up_to(),
        };
        let s = std::str::from_utf8(&self.pending[..valid]).expect("checked");
        self.text.push_str(s);
        self.pending.drain(..valid);
        self.cut_at_stop()
    }

    /// All the text so far, cut before a stop string once one appeared.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Cut the text before the earliest match of any stop string (whichever the list
    /// names first: the text never holds a stop string).
    fn cut_at_stop(&mut self) -> bool {
        let mut earliest: Option<usize> = None;
        for stop in self.stops.iter().filter(|s| !s.is_empty()) {
            // Only the new text (plus a stop's length of context) can hold a new match.
            let from = self.emitted.saturating_sub(stop.len());
            let from = (from..=self.text.len())
                .find(|&i| self.text.is_char_boundary(i))
                .unwrap_or(0);
            if let Some(i) = self.text[from..].find(stop.as_str()) {
                earliest = Some(earliest.map_or(from + i, |e| e.min(from + i)));
            }
        }
        match earliest {
            Some(at) => {
                self.text.truncate(at);
                true
            }
            None => false,
        }
    }

    /// Text that can be shown now: all of it but a tail that could begin a stop string.
    pub fn ready(&mut self) -> &str {
        let mut end = self.text.len();
        for stop in self.stops.iter().filter(|s| !s.is_empty()) {
            for k in (1..stop.len()).rev() {
                if self.text.len() >= k
                    && self.text.is_char_boundary(self.text.len() - k)
                    && stop
                        .as_bytes()
                        .starts_with(&self.text.as_bytes()[self.text.len() - k..])
                {
                    end = end.min(self.text.len() - k);
                    break;
                }
            }
        }
        let end = end.max(self.emitted);
        let out = &self.text[self.emitted..end];
        self.emitted = end;
        out
    }

    /// Everything not yet shown (at the end, once nothing more can complete a stop).
    pub fn rest(&mut self) -> &str {
        let out = &self.text[self.emitted..];
        self.emitted = self.text.len();
        out
    }
}

/// Generate from `prompt` (token ids, BOS included when wanted), calling `on_text` with
/// each piece of text as it is decided.
pub fn generate(
    model: &mut Model,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    sampler: &mut Sampler,
    opts: &GenerateOptions,
    mut on_text: impl FnMut(&str),
) -> Result<Generation> {
    if prompt.is_empty() {
        return Err(Error::shape("the prompt is empty"));
    }
    if prompt.len() >= opts.context {
        return Err(Error::shape(format!(
            "the prompt has {} tokens and the context {}: the context must be longer than the prompt",
            prompt.len(),
            opts.context,
        )));
    }
    let mut cache = model.new_cache(opts.context, opts.kv_type)?;
    let eos = tokenizer.eos_ids();
    let mut history = prompt.to_vec();
    let mut stream = TextStream::new(opts.stop_strings.to_vec());
    let mut tokens = Vec::new();

    // The token is picked on the device (where it can) and only it is read back.
    let greedy = sampler.is_greedy();
    let mut step = |model: &mut Model, ids: &[u32], pos0: usize, history: &[u32]| {
        if greedy {
            model.forward_argmax(ids, pos0, &mut cache)
        } else {
            let params = sampler.next_params();
            let penalized = sampler.penalized(history);
            model.forward_sample(ids, pos0, &mut cache, &penalized, &params)
        }
    };

    let start = Instant::now();
    let mut next = step(model, prompt, 0, &history)?;
    let prompt_time = start.elapsed();
    let start = Instant::now();
    let mut stop = StopReason::Length;
    while tokens.len() < opts.max_tokens {
        if eos.contains(&next) {
            stop = StopReason::Eos;
            break;
        }
        tokens.push(next);
        history.push(next);
        if stream.push(&tokenizer.token_bytes(next)) {
            stop = StopReason::StopString;
            break;
        }
        on_text(stream.ready());
        if tokens.len() == opts.max_tokens {
            break;
        }
        if history.len() >= opts.context {
            stop = StopReason::Context;
            break;
        }
        next = step(model, &[next], history.len() - 1, &history)?;
    }
    let gen_time = start.elapsed();
    if stop != StopReason::StopString {
        stream.push(&[]);
    }
    on_text(stream.rest());
    Ok(Generation {
        prompt_tokens: prompt.to_vec(),
        tokens,
        text: stream.text,
        stop,
        prompt_time,
        gen_time,
    })
}

#[cfg(test)]
mod tests {
    use super::TextStream;

    #[test]
    fn stream_holds_back_partial_stops_and_utf8() {
        let stops = vec!["END".to_string()];
        let mut s = TextStream::new(stops);
        assert!(!s.push(b"hello E"));
        assert_eq!(s.ready(), "hello ");
        assert!(!s.push(b"N"));
        assert_eq!(s.ready(), "");
        assert!(s.push(b"D tail"));
        assert_eq!(s.rest(), "");
        assert_eq!(s.text, "hello ");

        let mut s = TextStream::new(Vec::new());
        assert!(!s.push(&"é".as_bytes()[..1]));
        assert_eq!(s.ready(), "");
        assert!(!s.push(&"é".as_bytes()[1..]));
        assert_eq!(s.ready(), "é");
    }

    #[test]
    fn the_earliest_stop_in_the_text_cuts_whatever_the_list_order() {
        for stops in [["u", "Yo"], ["Yo", "u"]] {
            let mut s = TextStream::new(stops.map(String::from).to_vec());
            assert!(s.push(b" by You"));
            assert_eq!(s.text(), " by ", "stops {stops:?}");
        }
    }
}
