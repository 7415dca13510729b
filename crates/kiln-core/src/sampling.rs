//! One draw of the next token from logits, in llama.cpp's order: repetition penalty,
//! top-k, top-p, min-p, temperature, then the draw. This is the reference every backend's
//! [`crate::Backend::sample`] follows; the random number comes from the caller, so the
//! same draw gives the same token on every device (up to float rounding at a boundary).

/// What one draw does. Temperature 0 (or below) is greedy.
#[derive(Clone, Debug, PartialEq)]
pub struct SampleParams {
    pub temperature: f32,
    /// 0 keeps every token.
    pub top_k: usize,
    /// 1.0 disables.
    pub top_p: f32,
    /// 0.0 disables.
    pub min_p: f32,
    /// 1.0 disables; applies to the `penalized` tokens.
    pub repeat_penalty: f32,
    /// Uniform in [0, 1): where the draw falls in the final distribution.
    pub draw: f64,
}

impl SampleParams {
    /// What a device's draw kernel takes for these settings: its top-k (0: off) and the
    /// penalty, top-p, min-p, temperature and draw. Greedy (with a penalty, or the caller
    /// would have used argmax) is a top-1 draw at temperature 1.
    pub fn device_draw(&self, vocab: usize) -> (usize, [f32; 5]) {
        let draw = self.draw as f32;
        match self.temperature <= 0.0 {
            true => (1, [self.repeat_penalty, 1.0, 0.0, 1.0, draw]),
            false => (
                self.top_k.min(vocab),
                [
                    self.repeat_penalty,
                    self.top_p,
                    self.min_p,
                    self.temperature,
                    draw,
                ],
            ),
        }
    }
}

/// Apply the repetition penalty to `logits` at `penalized` (each id once; ids outside
/// the vocabulary are ignored).
pub fn penalize(logits: &mut [f32], penalized: &[u32], penalty: f32) {
    if penalty == 1.0 {
        return;
    }
    for &t in penalized {
        if let Some(l) = logits.get_mut(t as usize) {
            *l = if *l > 0.0 { *l / penalty } else { *l * penalty };
        }
    }
}

/// Pick a token from `logits`, which the penalty modifies in place; `penalized` holds
/// distinct ids.
pub fn pick(logits: &mut [f32], penalized: &[u32], p: &SampleParams) -> u32 {
    penalize(logits, penalized, p.repeat_penalty);
    if p.temperature <= 0.0 {
        return argmax(logits);
    }
    let mut cand: Vec<(u32, f32)> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| (i as u32, l))
        .collect();
    cand.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    if p.top_k > 0 {
        cand.truncate(p.top_k);
    }
    // Probabilities at temperature 1 for top-p and min-p, as llama.cpp does them.
    let probs = softmax(cand.iter().map(|&(_, l)| l));
    if p.top_p < 1.0 {
        let mut acc = 0.0;
        let mut keep = cand.len();
        for (i, q) in probs.iter().enumerate() {
            acc += q;
            if acc >= p.top_p as f64 {
                keep = i + 1;
                break;
            }
        }
        cand.truncate(keep.max(1));
    }
    if p.min_p > 0.0 {
        let threshold = probs[0] * p.min_p as f64;
        let keep = probs
            .iter()
            .take(cand.len())
            .take_while(|&&q| q >= threshold)
            .count();
        cand.truncate(keep.max(1));
    }
    let probs = softmax(cand.iter().map(|&(_, l)| l / p.temperature));
    let mut r = p.draw;
    for (&(id, _), q) in cand.iter().zip(&probs) {
        if r < *q {
            return id;
        }
        r -= q;
    }
    cand.last().map(|&(id, _)| id).unwrap_or(0)
}

fn softmax(logits: impl Iterator<Item = f32> + Clone) -> Vec<f64> {
    let max = logits.clone().fold(f32::NEG_INFINITY, f32::max) as f64;
    let e: Vec<f64> = logits.map(|l| (l as f64 - max).exp()).collect();
    let sum: f64 = e.iter().sum();
    e.into_iter().map(|v| v / sum).collect()
}

/// The index of the largest logit (the first, on ties, as transformers' argmax).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}
