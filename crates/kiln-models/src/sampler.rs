//! The sampler's settings and its random numbers. The draw itself (llama.cpp's order:
//! repetition penalty, top-k, top-p, min-p, temperature) is `kiln_core::sampling`, run by
//! the backend. Temperature 0 is greedy. A seed makes draws reproducible (the generator
//! is kiln's own, so results do not change with a crate version).

pub use kiln_core::sampling::argmax;
use kiln_core::{sampling, SampleParams};

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
}

impl Sampler {
    pub fn new(cfg: SamplerConfig) -> Self {
        let rng = SplitMix64(cfg.seed);
        Sampler { cfg, rng }
    }

    /// Whether every pick is the argmax of the logits (no temperature, no penalty), so
    /// that the device can make it and only the token need be read back.
    pub fn is_greedy(&self) -> bool {
        self.cfg.temperature <= 0.0 && self.cfg.repeat_penalty == 1.0
    }

    /// The next draw's parameters (each call takes a new random number).
    pub fn next_params(&mut self) -> SampleParams {
        let c = &self.cfg;
        SampleParams {
            temperature: c.temperature,
            top_k: c.top_k,
            top_p: c.top_p,
            min_p: c.min_p,
            repeat_penalty: c.repeat_penalty,
            draw: if c.temperature > 0.0 {
                self.rng.next_f64()
            } else {
                0.0
            },
        }
    }

    /// The distinct tokens among the last `repeat_last_n` of `history` (none when the
    /// penalty is off).
    pub fn penalized(&self, history: &[u32]) -> Vec<u32> {
        if self.cfg.repeat_penalty == 1.0 {
            return Vec::new();
        }
        let recent = &history[history.len().saturating_sub(self.cfg.repeat_last_n)..];
        let mut seen = std::collections::HashSet::new();
        recent.iter().copied().filter(|&t| seen.insert(t)).collect()
    }

    /// Pick a token from `logits` (modified in place by the penalty) on the host, given
    /// the tokens so far.
    pub fn sample(&mut self, logits: &mut [f32], history: &[u32]) -> u32 {
        let params = self.next_params();
        sampling::pick(logits, &self.penalized(history), &params)
    }
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
