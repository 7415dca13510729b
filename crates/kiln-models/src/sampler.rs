//! Choosing the next token from logits, in llama.cpp's order: repetition penalty, top-k,
//! top-p, min-p, temperature, then a draw. Temperature 0 is greedy. A seed makes draws
//! reproducible (the generator is kiln's own, so results do not change with a crate
//! version).

#[derive(Clone, Debug, PartialEq)]
pub struct SamplerConfig {
    pub temperature: f32,
    /// 0 disables.
    pub top_k: usize,
    /// 1.0 disables.
    pub top_p: f32,
    /// 0.0 disables.
    pub min_p: f32,
    /// 1.0 disables.
    pub repeat_penalty: f32,
    /// How many recent tokens the penalty looks at.
    pub repeat_last_n: usize,
    pub seed: u64,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        // llama.cpp's defaults.
        SamplerConfig {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            seed: 0,
        }
    }
}

impl SamplerConfig {
    pub fn greedy() -> Self {
        SamplerConfig {
            temperature: 0.0,
            ..Default::default()
        }
    }
}

/// SplitMix64: small, fast, and stable across versions.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

pub struct Sampler {
    cfg: SamplerConfig,
    rng: SplitMix64,
    /// (token, logit) candidates, reused between calls.
    candidates: Vec<(u32, f32)>,
}

impl Sampler {
    pub fn new(cfg: SamplerConfig) -> Self {
        let rng = SplitMix64(cfg.seed);
        Sampler {
            cfg,
            rng,
            candidates: Vec::new(),
        }
    }

    /// Whether every pick is the argmax of the logits (no temperature, no penalty), so
    /// that the device can make it and only the token need be read back.
    pub fn is_greedy(&self) -> bool {
        self.cfg.temperature <= 0.0 && self.cfg.repeat_penalty == 1.0
    }

    /// Pick a token from `logits` (modified in place by the penalty), given the tokens
    /// so far.
    pub fn sample(&mut self, logits: &mut [f32], history: &[u32]) -> u32 {
        let c = &self.cfg;
        if c.repeat_penalty != 1.0 {
            let recent = &history[history.len().saturating_sub(c.repeat_last_n)..];
            let mut seen = std::collections::HashSet::new();
            for &t in recent {
                if seen.insert(t) {
                    if let Some(l) = logits.get_mut(t as usize) {
                        *l = if *l > 0.0 {
                            *l / c.repeat_penalty
                        } else {
                            *l * c.repeat_penalty
                        };
                    }
                }
            }
        }
        if c.temperature <= 0.0 {
            return argmax(logits);
        }
        let cand = &mut self.candidates;
        cand.clear();
        cand.extend(logits.iter().enumerate().map(|(i, &l)| (i as u32, l)));
        cand.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if c.top_k > 0 {
            cand.truncate(c.top_k);
        }
        // Probabilities at temperature 1 for top-p and min-p, as llama.cpp does them.
        let probs = softmax(cand.iter().map(|&(_, l)| l));
        if c.top_p < 1.0 {
            let mut acc = 0.0;
            let mut keep = cand.len();
            for (i, p) in probs.iter().enumerate() {
                acc += p;
                if acc >= c.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
            cand.truncate(keep.max(1));
        }
        if c.min_p > 0.0 {
            let threshold = probs[0] * c.min_p as f64;
            let keep = probs
                .iter()
                .take(cand.len())
                .take_while(|&&p| p >= threshold)
                .count();
            cand.truncate(keep.max(1));
        }
        let probs = softmax(cand.iter().map(|&(_, l)| l / c.temperature));
        let mut r = self.rng.next_f64();
        for (&(id, _), p) in cand.iter().zip(&probs) {
            if r < *p {
                return id;
            }
            r -= p;
        }
        cand.last().map(|&(id, _)| id).unwrap_or(0)
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_first_maximum() {
        let mut s = Sampler::new(SamplerConfig::greedy());
        assert!(s.is_greedy());
        assert_eq!(s.sample(&mut [0.1, 3.0, 3.0, -1.0], &[]), 1);
        assert!(!Sampler::new(SamplerConfig::default()).is_greedy());
        assert!(!Sampler::new(SamplerConfig {
            repeat_penalty: 1.1,
            ..SamplerConfig::greedy()
        })
        .is_greedy());
    }

    #[test]
    fn seeds_reproduce_and_filters_hold() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let cfg = SamplerConfig {
            temperature: 1.5,
            top_k: 5,
            top_p: 1.0,
            min_p: 0.0,
            seed: 42,
            ..Default::default()
        };
        let draw = |cfg: &SamplerConfig| {
            let mut s = Sampler::new(cfg.clone());
            (0..200)
                .map(|_| s.sample(&mut logits.clone(), &[]))
                .collect::<Vec<_>>()
        };
        let a = draw(&cfg);
        assert_eq!(a, draw(&cfg));
        let mut top5: Vec<usize> = (0..50).collect();
        top5.sort_by(|&x, &y| logits[y].total_cmp(&logits[x]));
        top5.truncate(5);
        assert!(a.iter().all(|t| top5.contains(&(*t as usize))));
        assert!(a.iter().collect::<std::collections::HashSet<_>>().len() > 1);
        assert_ne!(
            a,
            draw(&SamplerConfig {
                seed: 43,
                ..cfg.clone()
            })
        );
        // min-p 1.0 keeps only the most likely token.
        let only = draw(&SamplerConfig { min_p: 1.0, ..cfg });
        assert!(only.iter().all(|&t| t as usize == top5[0]));
    }

    #[test]
    fn repeat_penalty_pushes_seen_tokens_down() {
        let mut s = Sampler::new(SamplerConfig {
            repeat_penalty: 2.0,
            ..SamplerConfig::greedy()
        });
        let mut logits = [2.0, 1.5, -1.0];
        assert_eq!(s.sample(&mut logits, &[0, 0]), 1);
        assert_eq!(logits, [1.0, 1.5, -1.0]);
    }
}
