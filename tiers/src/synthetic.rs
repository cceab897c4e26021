//! Deterministic synthetic KV bytes derived from a block's sequence hash: for the mock engine,
//! benchmarks and crash tests, which must recognize a block's true bytes after the fact.

use kvfabric::hash::SequenceHash;

/// Fills `out` with the synthetic bytes of `hash` (xorshift64 seeded by the hash).
pub fn fill(hash: SequenceHash, out: &mut [u8]) {
    let mut x = hash.0 ^ 0x9e37_79b9_7f4a_7c15;
    if x == 0 {
        x = 1;
    }
    let mut chunks = out.chunks_exact_mut(8);
    for c in &mut chunks {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        c.copy_from_slice(&x.to_le_bytes());
    }
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    let rest = chunks.into_remainder();
    let n = rest.len();
    rest.copy_from_slice(&x.to_le_bytes()[..n]);
}

/// The synthetic bytes of `hash`, `len` long.
pub fn block(hash: SequenceHash, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    fill(hash, &mut v);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_and_distinct() {
        assert_eq!(block(SequenceHash(1), 100), block(SequenceHash(1), 100));
        assert_ne!(block(SequenceHash(1), 100), block(SequenceHash(2), 100));
        assert_eq!(&block(SequenceHash(3), 13)[..8], &block(SequenceHash(3), 16)[..8]);
        assert!(block(SequenceHash(0), 64).iter().any(|&b| b != 0));
    }
}
