//! A reproducible random generator for everything that draws numbers from a seed: sampling,
//! routing draws, synthetic prompts, planner simulations. SplitMix64: tiny, well mixed, and
//! the same sequence for a seed on every platform and release. Not for secrets (nonces and
//! keys come from the OS).

/// SplitMix64: a tiny, well-mixed, reproducible generator.
#[derive(Debug, Clone)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in [lo, hi] (lo when hi < lo).
    pub fn range_u32(&mut self, lo: u32, hi: u32) -> u32 {
        lo + (self.next_u64() % (u64::from(hi.saturating_sub(lo)) + 1)) as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sequence_of_a_seed_is_fixed() {
        // The reference SplitMix64 outputs for seed 0.
        let mut r = SplitMix64(0);
        assert_eq!(r.next_u64(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(r.next_u64(), 0x6E78_9E6A_A1B9_65F4);
        let x = SplitMix64(7).next_f64();
        assert!((0.0..1.0).contains(&x));
        let mut r = SplitMix64(3);
        assert!((0..1000).map(|_| r.range_u32(5, 7)).all(|x| (5..=7).contains(&x)));
        assert_eq!(r.range_u32(9, 2), 9);
    }
}
