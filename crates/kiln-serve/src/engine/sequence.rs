//! One sequence: a prompt and what has been generated after it, how it samples, where its
//! text stands against its stop strings, and the channel its tokens go out on.

use super::blocks::BlockTable;
use super::runner::{StepOutput, Want};
use kiln_models::generate::TextStream;
use kiln_models::{Sampler, SamplerConfig};
use kiln_tokenizer::Tokenizer;
use std::collections::HashMap;
use std::time::Instant;
use tokio::sync::mpsc::UnboundedSender;

pub type SeqId = u64;

/// How a sequence picks its tokens and when it stops: the request's fields, checked.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 is greedy.
    pub temperature: f32,
    /// 1 keeps all.
    pub top_p: f32,
    /// 0 keeps all.
    pub top_k: usize,
    /// 0 keeps all.
    pub min_p: f32,
    /// OpenAI's: subtracted from the logit of every token generated so far.
    pub presence_penalty: f32,
    /// OpenAI's: subtracted once per time a token was generated.
    pub frequency_penalty: f32,
    /// llama.cpp's and transformers': divides positive logits of recent tokens; 1 is off.
    pub repetition_penalty: f32,
    pub seed: u64,
    /// Tokens to generate at most (already within the context).
    pub max_new_tokens: usize,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    /// Report each token's log-probability and this many alternatives.
    pub logprobs: Option<usize>,
}

/// The most alternatives a token's log-probabilities list (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-generation token or a stop string.
    Stop,
    /// `max_new_tokens`, or the context is full.
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// A token's log-probability under the model (before penalties and temperature, as
/// OpenAI reports it), and the most likely alternatives.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// What a sequence sends to the request that made it.
#[derive(Debug)]
pub enum SeqEvent {
    /// A token, and the text it completed (possibly empty: text that could still become a
    /// stop string, or an unfinished UTF-8 character, is held back).
    Token {
        text: String,
        logprob: Option<TokenLogprob>,
    },
    /// The end: text held back until now, and the counts for `usage`.
    Finished {
        tail: String,
        reason: FinishReason,
        prompt_tokens: usize,
        completion_tokens: usize,
    },
    /// The sequence could not go on (a device error); its blocks are free.
    Failed(String),
}

/// Events of a request's sequences, tagged with their choice index.
pub type EventSender = UnboundedSender<(usize, SeqEvent)>;

pub struct Sequence {
    pub id: SeqId,
    /// Which of its request's choices this sequence is.
    pub choice: usize,
    /// The prompt, then each token generated.
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    /// Positions whose keys and values are in the sequence's cache.
    pub computed: usize,
    pub blocks: BlockTable,
    pub params: SamplingParams,
    sampler: Sampler,
    text: TextStream,
    /// How often each token was generated (presence and frequency penalties).
    generated: HashMap<u32, u32>,
    pub events: EventSender,
    pub arrived: Instant,
    pub last_token_at: Option<Instant>,
    /// Whether it has left the waiting queue once (the queue limit counts new arrivals).
    pub admitted_once: bool,
}

/// What happened to a sequence when a step gave it a token.
#[derive(Debug, PartialEq, Eq)]
pub enum Progress {
    Continues,
    Finished(FinishReason),
}

impl Sequence {
    pub fn new(
        id: SeqId,
        choice: usize,
        prompt: Vec<u32>,
        params: SamplingParams,
        events: EventSender,
        arrived: Instant,
    ) -> Self {
        let sampler = Sampler::new(SamplerConfig {
            temperature: params.temperature,
            top_k: params.top_k,
            top_p: params.top_p,
            min_p: params.min_p,
            repeat_penalty: params.repetition_penalty,
            seed: params.seed,
            ..SamplerConfig::default()
        });
        Sequence {
            id,
            choice,
            prompt_len: prompt.len(),
            tokens: prompt,
            computed: 0,
            blocks: BlockTable::default(),
            text: TextStream::new(params.stop.clone()),
            params,
            sampler,
            generated: HashMap::new(),
            events,
            arrived,
            last_token_at: None,
            admitted_once: false,
        }
    }

    /// Tokens not yet in the cache: 1 for a decode, more for a prompt (or a recompute).
    pub fn pending(&self) -> usize {
        self.tokens.len() - self.computed
    }

    pub fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Whether the client is gone (its stream dropped the receiver).
    pub fn abandoned(&self) -> bool {
        self.events.is_closed()
    }

    /// What the runner should return after the sequence's last pending token: the token
    /// itself where the device can pick it, else the logits.
    pub fn want(&mut self) -> Want {
        let p = &self.params;
        if p.logprobs.is_some() || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            return Want::Logits;
        }
        if self.sampler.is_greedy() {
            return Want::Argmax;
        }
        Want::Sample {
            params: self.sampler.next_params(),
            penalized: self.sampler.penalized(&self.tokens),
        }
    }

    /// Take the step's result for the sequence's last token: pick the next token, send its
    /// text, and say whether the sequence is done.
    pub fn accept(
        &mut self,
        out: StepOutput,
        tokenizer: &Tokenizer,
        eos: &[u32],
        now: Instant,
    ) -> Progress {
        let (token, logprob) = match out {
            StepOutput::Token(t) => (t, None),
            StepOutput::Logits(mut logits) => {
                // Reported from the model's own distribution, before the penalties move it.
                let raw = self.params.logprobs.map(|top| (top, logits.clone()));
                for (&t, &count) in &self.generated {
                    if let Some(l) = logits.get_mut(t as usize) {
                        *l -= self.params.presence_penalty
                            + self.params.frequency_penalty * count as f32;
                    }
                }
                let token = self.sampler.sample(&mut logits, &self.tokens);
                (token, raw.map(|(top, raw)| logprobs_of(&raw, token, top)))
            }
            StepOutput::Nothing => return Progress::Continues,
        };
        self.last_token_at = Some(now);
        self.tokens.push(token);
        *self.generated.entry(token).or_default() += 1;
        let end = eos.contains(&token);
        if end && !self.params.ignore_eos {
            // The end adds no text, but it is a completion token: its logprob is reported
            // too, so that logprobs and `completion_tokens` agree (as vLLM does).
            if logprob.is_some() {
                let text = String::new();
                let _ = self
                    .events
                    .send((self.choice, SeqEvent::Token { text, logprob }));
            }
            return Progress::Finished(FinishReason::Stop);
        }
        // An end passed over (`ignore_eos`) marks an end, it is not text: none is added
        // ("</s>" went into the output).
        let bytes = if end {
            Vec::new()
        } else {
            tokenizer.token_bytes(token)
        };
        let stopped = self.text.push(&bytes);
        let text = self.text.ready().to_string();
        let _ = self
            .events
            .send((self.choice, SeqEvent::Token { text, logprob }));
        if stopped {
            Progress::Finished(FinishReason::Stop)
        } else if self.generated() >= self.params.max_new_tokens {
            Progress::Finished(FinishReason::Length)
        } else {
            Progress::Continues
        }
    }

    /// Send the end: the text held back, the reason and the counts.
    pub fn finish(&mut self, reason: FinishReason) {
        let tail = self.text.rest().to_string();
        let _ = self.events.send((
            self.choice,
            SeqEvent::Finished {
                tail,
                reason,
                prompt_tokens: self.prompt_len,
                completion_tokens: self.generated(),
            },
        ));
    }

    pub fn fail(&self, message: String) {
        let _ = self.events.send((self.choice, SeqEvent::Failed(message)));
    }
}

/// `token`'s log-probability under `logits` and the `top` most likely tokens' (ties to
/// the lower id, as the greedy pick).
fn logprobs_of(logits: &[f32], token: u32, top: usize) -> TokenLogprob {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
    let lse = max + sum.ln() as f32;
    let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
    let top = top.min(ids.len());
    let by_logit = |a: &u32, b: &u32| {
        logits[*b as usize]
            .total_cmp(&logits[*a as usize])
            .then(a.cmp(b))
    };
    if top > 0 {
        ids.select_nth_unstable_by(top - 1, by_logit);
    }
    ids.truncate(top);
    ids.sort_by(by_logit);
    TokenLogprob {
        token,
        logprob: logits
            .get(token as usize)
            .map_or(f32::NEG_INFINITY, |l| l - lse),
        top: ids
            .into_iter()
            .map(|t| (t, logits[t as usize] - lse))
            .collect(),
    }
}

#[cfg(test)]
impl SamplingParams {
    /// Greedy, 100 tokens at most, nothing else asked: the engine's tests' requests.
    pub(crate) fn greedy() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            seed: 0,
            max_new_tokens: 100,
            stop: Vec::new(),
            ignore_eos: false,
            logprobs: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::test_events;

    fn params(ignore_eos: bool) -> SamplingParams {
        SamplingParams {
            ignore_eos,
            logprobs: Some(1),
            ..SamplingParams::greedy()
        }
    }

    #[test]
    fn the_end_reports_its_logprob_and_an_end_passed_over_adds_no_text() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../models/kiln-default.gguf"
        );
        let file = kiln_io::gguf::GgufFile::open(path).unwrap();
        let tokenizer = Tokenizer::from_gguf(&file).unwrap();
        let eos = tokenizer.eos_ids();
        let end = eos[0];
        assert!(
            !tokenizer.token_bytes(end).is_empty(),
            "the end has text to leave out"
        );
        // Greedy over logits where the end is the best token.
        let mut logits = vec![0.0f32; end as usize + 2];
        logits[end as usize] = 5.0;
        for ignore_eos in [false, true] {
            let (tx, mut rx) = test_events();
            let mut seq = Sequence::new(0, 0, vec![1, 2], params(ignore_eos), tx, Instant::now());
            let progress = seq.accept(
                StepOutput::Logits(logits.clone()),
                &tokenizer,
                &eos,
                Instant::now(),
            );
            let want = if ignore_eos {
                Progress::Continues
            } else {
                Progress::Finished(FinishReason::Stop)
            };
            assert_eq!(progress, want);
            assert_eq!(seq.generated(), 1, "a completion token either way");
            match rx.try_recv().unwrap().1 {
                SeqEvent::Token { text, logprob } => {
                    assert_eq!(text, "", "ignore_eos {ignore_eos}");
                    assert_eq!(logprob.unwrap().token, end);
                }
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn logprobs_are_log_softmax_with_the_top_in_order() {
        let lp = logprobs_of(&[0.0, 2.0, 1.0, 2.0], 2, 3);
        let lse = (1f32 + 2.0 * 2f32.exp() + 1f32.exp()).ln();
        assert!((lp.logprob - (1.0 - lse)).abs() < 1e-5);
        let ids: Vec<u32> = lp.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, [1, 3, 2]);
        let total: f32 = [0.0f32, 2.0, 1.0, 2.0]
            .iter()
            .map(|l| (l - lse).exp())
            .sum();
        assert!((total - 1.0).abs() < 1e-5);
        assert!(logprobs_of(&[1.0], 0, 0).top.is_empty());
    }
}
