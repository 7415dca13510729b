//! The trainer's random numbers: SplitMix64, whose whole state is one u64, so that a
//! checkpoint holds it exactly and a resumed run draws what the uninterrupted one would.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rng {
    pub state: u64,
}

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng { state: seed }
    }

    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`, with 53 random bits.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `0..n` (`n` > 0), by rejection so that no value is favoured.
    pub fn below(&mut self, n: u64) -> u64 {
        let zone = u64::MAX - u64::MAX % n;
        loop {
            let v = self.next_u64();
            if v < zone {
                return v % n;
            }
        }
    }

    /// A standard normal draw (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.uniform(); // (0, 1]: the logarithm stays finite
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
}

#[cfg(test)]
mod tests {
    use super::Rng;

    #[test]
    fn draws_are_reproducible_from_the_state() {
        let mut a = Rng::new(7);
        a.next_u64();
        let mut b = a;
        assert_eq!(a.next_u64(), b.next_u64());
        assert_eq!(Rng::new(7).below(10), Rng::new(7).below(10));
    }

    /// The draws a replay outside kiln reproduces (scripts/train/loss_parity.py draws each
    /// step's window starts as `Trainer::step` does, with the same SplitMix64).
    #[test]
    fn draws_are_splitmix64s() {
        let mut r = Rng::new(7);
        assert_eq!(r.next_u64(), 0x63cb_e1e4_5932_0dd7);
        assert_eq!(r.next_u64(), 0x044c_3cd7_f43c_661c);
        let mut r = Rng::new(7);
        let starts: Vec<u64> = (0..5).map(|_| r.below(1000)).collect();
        assert_eq!(starts, [487, 804, 346, 203, 674]);
    }

    #[test]
    fn normal_draws_have_unit_variance() {
        let mut r = Rng::new(1);
        let n = 20_000;
        let draws: Vec<f64> = (0..n).map(|_| r.normal()).collect();
        let mean = draws.iter().sum::<f64>() / n as f64;
        let var = draws.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n as f64;
        assert!(
            mean.abs() < 0.03 && (var - 1.0).abs() < 0.05,
            "{mean} {var}"
        );
    }

    #[test]
    fn below_covers_its_range_evenly() {
        let mut r = Rng::new(3);
        let mut counts = [0u32; 6];
        for _ in 0..60_000 {
            counts[r.below(6) as usize] += 1;
        }
        assert!(
            counts.iter().all(|&c| (9_000..11_000).contains(&c)),
            "{counts:?}"
        );
    }
}
