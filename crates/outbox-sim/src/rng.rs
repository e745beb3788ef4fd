//! A tiny, stable PRNG (SplitMix64), kept in-crate so a seed replays the same trace whatever
//! version of any dependency is installed.

/// SplitMix64 (Steele, Lea, Flood 2014). Not cryptographic; fast, and every seed is fine.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    /// The generator of trace `trace` of run `seed`: independent of every other trace.
    pub fn for_trace(seed: u64, trace: u64) -> Self {
        let mut s = SplitMix64(seed ^ 0x6a09_e667_f3bc_c908);
        let a = s.next_u64();
        SplitMix64(a ^ trace.wrapping_mul(0x9e37_79b9_7f4a_7c15)).skip()
    }

    /// An independent generator derived from this one's state, without drawing from it: a
    /// fault decided on it leaves every other draw of the trace where it was.
    pub fn fork(&self, stream: u64) -> SplitMix64 {
        SplitMix64(self.0 ^ stream.wrapping_mul(0xd6e8_feb8_6659_fd93)).skip()
    }

    fn skip(mut self) -> Self {
        self.next_u64();
        self
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        // Lemire's multiply-shift; the tiny bias is irrelevant for a simulator.
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// Uniform in `lo..hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo)
    }

    /// True with probability `per_mille / 1000`.
    pub fn chance(&mut self, per_mille: u64) -> bool {
        self.below(1000) < per_mille
    }

    /// An index into `weights`, drawn proportionally to them (some weight must be > 0).
    pub fn weighted(&mut self, weights: &[u64]) -> usize {
        let total: u64 = weights.iter().sum();
        let mut x = self.below(total);
        for (i, w) in weights.iter().enumerate() {
            if x < *w {
                return i;
            }
            x -= w;
        }
        weights.len() - 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traces_replay_and_differ() {
        let a: Vec<u64> = (0..4)
            .map(|_| SplitMix64::for_trace(1, 7).next_u64())
            .collect();
        assert!(a.windows(2).all(|w| w[0] == w[1]));
        assert_ne!(
            SplitMix64::for_trace(1, 7).next_u64(),
            SplitMix64::for_trace(1, 8).next_u64()
        );
        assert_ne!(
            SplitMix64::for_trace(1, 7).next_u64(),
            SplitMix64::for_trace(2, 7).next_u64()
        );
        let mut r = SplitMix64::new(3);
        assert!((0..1000).all(|_| r.below(5) < 5));
    }
}
