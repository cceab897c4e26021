//! Token-block hashing: the key of a KV block everywhere in kvfabric.
//!
//! The spec, with test vectors anyone can recompute with an XXH3 library, is
//! `docs/hashing.md`. In short (all integers little-endian):
//! - a *token block* is `block_tokens` consecutive token ids; only full blocks are hashed;
//! - `block_hash = XXH3-64(u32 tokens, seed)`, where `seed` is 1337 unless a LoRA name or a
//!   salt is given (see [`HashSeed`]);
//! - `seq[0] = block[0]`, `seq[i] = XXH3-64(u64 seq[i-1] ‖ u64 block[i], 1337)`.
//!
//! This matches NVIDIA Dynamo's router (`compute_block_hash_for_seq`, `compute_seq_hash_for_block`,
//! `compute_salt_hash`), so kvfabric's KV events interoperate with Dynamo's.

use xxhash_rust::xxh3::xxh3_64_with_seed;

pub use crate::units::BlockTokens;

/// XXH3-64 (seed 0) of bulk bytes: the checksum of KV data everywhere (transfers, the disk
/// tier's slots). The same value as any XXH3 library's `XXH3_64bits`; computed with the widest
/// SIMD kernel the CPU has, chosen at run time, because verifying a block read from disk sits
/// on the latency path of every onboard.
pub fn data_checksum(bytes: &[u8]) -> u64 {
    twox_hash::XxHash3_64::oneshot(bytes)
}

/// The XXH3 seed of block hashes without salt or LoRA, and of every chaining step.
pub const KV_HASH_SEED: u64 = 1337;

/// The default number of tokens per block.
pub const DEFAULT_BLOCK_TOKENS: usize = 16;

/// Hash of one block's tokens alone (Dynamo's `LocalBlockHash`).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(transparent)]
pub struct BlockHash(pub u64);

/// Chained hash of a block and every block before it: the key of a KV block.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(transparent)]
pub struct SequenceHash(pub u64);

impl std::fmt::Display for BlockHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::fmt::Display for SequenceHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// The seed of block hashes: 1337, shifted by an optional LoRA adapter name and salt so that
/// different adapters or tenants never share KV blocks.
///
/// `seed = 1337 (+ XXH3-64(lora_name, 0)) (+ XXH3-64(salt, 1))`, wrapping; an empty name or
/// salt counts as absent (Dynamo's `compute_salt_hash`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HashSeed(u64);

impl HashSeed {
    /// The seed without LoRA or salt.
    pub const DEFAULT: HashSeed = HashSeed(KV_HASH_SEED);

    /// The seed for an optional LoRA adapter name and an optional salt.
    pub fn new(lora_name: Option<&str>, salt: Option<&str>) -> Self {
        let mut seed = KV_HASH_SEED;
        if let Some(lora) = lora_name.filter(|s| !s.is_empty()) {
            seed = seed.wrapping_add(xxh3_64_with_seed(lora.as_bytes(), 0));
        }
        if let Some(salt) = salt.filter(|s| !s.is_empty()) {
            seed = seed.wrapping_add(xxh3_64_with_seed(salt.as_bytes(), 1));
        }
        HashSeed(seed)
    }

    /// This seed with `salt` folded in (nothing for an empty salt): blocks hashed with it
    /// have other names than those of the same tokens under this seed.
    pub fn salted(self, salt: &str) -> Self {
        if salt.is_empty() {
            return self;
        }
        HashSeed(self.0.wrapping_add(xxh3_64_with_seed(salt.as_bytes(), 1)))
    }

    /// The raw seed value.
    pub fn get(self) -> u64 {
        self.0
    }
}

impl Default for HashSeed {
    fn default() -> Self {
        HashSeed::DEFAULT
    }
}

/// Hashes one block's tokens, which may be of any length (callers pass full blocks).
#[inline]
pub fn block_hash(tokens: &[u32], seed: HashSeed) -> BlockHash {
    BlockHash(hash_u32s(tokens, seed.0))
}

/// Chains a block onto its parent's sequence hash; the first block has no parent and its
/// sequence hash is its block hash.
#[inline]
pub fn sequence_hash(parent: Option<SequenceHash>, block: BlockHash) -> SequenceHash {
    match parent {
        None => SequenceHash(block.0),
        Some(parent) => {
            let mut buf = [0u8; 16];
            buf[..8].copy_from_slice(&parent.0.to_le_bytes());
            buf[8..].copy_from_slice(&block.0.to_le_bytes());
            SequenceHash(xxh3_64_with_seed(&buf, KV_HASH_SEED))
        }
    }
}

#[inline]
fn hash_u32s(tokens: &[u32], seed: u64) -> u64 {
    if cfg!(target_endian = "little") {
        // The in-memory bytes of a u32 slice are its little-endian encoding here.
        xxh3_64_with_seed(bytemuck::cast_slice(tokens), seed)
    } else {
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        xxh3_64_with_seed(&bytes, seed)
    }
}

/// Hashes token sequences into block and sequence hashes for one block size and seed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenBlockHasher {
    block_tokens: BlockTokens,
    seed: HashSeed,
}

impl TokenBlockHasher {
    /// A hasher for `block_tokens` tokens per block.
    pub const fn new(block_tokens: BlockTokens, seed: HashSeed) -> Self {
        TokenBlockHasher { block_tokens, seed }
    }

    /// Tokens per block.
    pub fn block_tokens(&self) -> BlockTokens {
        self.block_tokens
    }

    /// The block-hash seed.
    pub fn seed(&self) -> HashSeed {
        self.seed
    }

    /// Block hashes of every full block of `tokens` (a trailing partial block is ignored).
    pub fn block_hashes(&self, tokens: &[u32]) -> Vec<BlockHash> {
        tokens
            .chunks_exact(self.block_tokens.as_usize())
            .map(|b| block_hash(b, self.seed))
            .collect()
    }

    /// Sequence hashes of every full block of `tokens`.
    pub fn sequence_hashes(&self, tokens: &[u32]) -> Vec<SequenceHash> {
        let mut out = Vec::with_capacity(tokens.len() / self.block_tokens.as_usize());
        self.for_each_block(tokens, |_, seq| out.push(seq));
        out
    }

    /// Both hashes of every full block of `tokens`, in order.
    pub fn hash(&self, tokens: &[u32]) -> (Vec<BlockHash>, Vec<SequenceHash>) {
        let n = tokens.len() / self.block_tokens.as_usize();
        let (mut blocks, mut seqs) = (Vec::with_capacity(n), Vec::with_capacity(n));
        self.for_each_block(tokens, |b, s| {
            blocks.push(b);
            seqs.push(s);
        });
        (blocks, seqs)
    }

    /// Calls `f(block_hash, sequence_hash)` for every full block of `tokens`, in order,
    /// without allocating.
    #[inline]
    pub fn for_each_block(&self, tokens: &[u32], mut f: impl FnMut(BlockHash, SequenceHash)) {
        let mut parent = None;
        for chunk in tokens.chunks_exact(self.block_tokens.as_usize()) {
            let block = block_hash(chunk, self.seed);
            let seq = sequence_hash(parent, block);
            f(block, seq);
            parent = Some(seq);
        }
    }

    /// Extends a sequence by more full blocks: `parent` is the sequence hash of the block
    /// before `tokens` (None at the start of a sequence).
    pub fn extend(&self, parent: Option<SequenceHash>, tokens: &[u32]) -> Vec<SequenceHash> {
        let mut parent = parent;
        tokens
            .chunks_exact(self.block_tokens.as_usize())
            .map(|chunk| {
                let seq = sequence_hash(parent, block_hash(chunk, self.seed));
                parent = Some(seq);
                seq
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn le_bytes(tokens: &[u32]) -> Vec<u8> {
        tokens.iter().flat_map(|t| t.to_le_bytes()).collect()
    }

    /// The vectors of docs/hashing.md; recomputed there with Python's `xxhash` package.
    #[test]
    fn data_checksum_is_plain_xxh3_64() {
        // Every length class of XXH3 (0, 1-3, 4-8, 9-16, 17-128, 129-240, long, long with a
        // partial stripe) and a large block.
        let data: Vec<u8> =
            (0..3_000_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8).collect();
        for len in (0..300).chain([1023, 1024, 1025, 4096, 65_537, 368_640, 2_097_152, 3_000_000]) {
            assert_eq!(
                data_checksum(&data[..len]),
                xxhash_rust::xxh3::xxh3_64(&data[..len]),
                "len {len}"
            );
        }
    }

    #[test]
    fn spec_test_vectors() {
        let tokens: Vec<u32> = (0..16).collect();
        let h = TokenBlockHasher::new(BlockTokens::of(4), HashSeed::DEFAULT);
        let (blocks, seqs) = h.hash(&tokens);
        assert_eq!(blocks.len(), 4);
        assert_eq!(blocks.iter().map(|b| b.0).collect::<Vec<_>>(), VECTOR_BLOCKS.to_vec());
        assert_eq!(seqs.iter().map(|s| s.0).collect::<Vec<_>>(), VECTOR_SEQS.to_vec());
        assert_eq!(block_hash(&[1, 2, 3, 4], HashSeed::DEFAULT).0, VECTOR_1234);
        assert_eq!(HashSeed::new(Some("my-lora"), None).get(), VECTOR_SEED_LORA);
        assert_eq!(HashSeed::new(None, Some("tenant-a")).get(), VECTOR_SEED_SALT);
        assert_eq!(HashSeed::new(Some("my-lora"), Some("tenant-a")).get(), VECTOR_SEED_BOTH);
        let salted =
            TokenBlockHasher::new(BlockTokens::of(4), HashSeed::new(None, Some("tenant-a")));
        assert_eq!(
            salted.sequence_hashes(&tokens[..8]).iter().map(|s| s.0).collect::<Vec<_>>(),
            VECTOR_SALTED_SEQS.to_vec()
        );
    }

    // Computed independently by docs/hashing_vectors.py (Python `xxhash` 3.x);
    // VECTOR_1234 is also the value Dynamo's own tests use.
    const VECTOR_BLOCKS: [u64; 4] =
        [9143094415614847814, 12124091508212882195, 1088361764653601668, 16024980976528976948];
    const VECTOR_SEQS: [u64; 4] =
        [9143094415614847814, 9510318385840434533, 16998148715716822651, 16790386768269814709];
    const VECTOR_1234: u64 = 14643705804678351452;
    const VECTOR_SEED_LORA: u64 = 12827409268353072861;
    const VECTOR_SEED_SALT: u64 = 1948188790972764086;
    const VECTOR_SEED_BOTH: u64 = 14775598059325835610;
    const VECTOR_SALTED_SEQS: [u64; 2] = [17009624042690211646, 18279821067719767880];

    #[test]
    fn block_hash_is_xxh3_of_le_u32_with_seed_1337() {
        let tokens = [7u32, 0xdead_beef, 42, u32::MAX];
        assert_eq!(
            block_hash(&tokens, HashSeed::DEFAULT).0,
            xxh3_64_with_seed(&le_bytes(&tokens), 1337)
        );
    }

    #[test]
    fn chaining_is_parent_then_block() {
        let h = TokenBlockHasher::new(BlockTokens::of(2), HashSeed::DEFAULT);
        let (b, s) = h.hash(&[1, 2, 3, 4, 5, 6]);
        assert_eq!(s[0].0, b[0].0);
        let mut buf = s[0].0.to_le_bytes().to_vec();
        buf.extend_from_slice(&b[1].0.to_le_bytes());
        assert_eq!(s[1].0, xxh3_64_with_seed(&buf, 1337));
        // Order matters: swapping parent and block gives another hash.
        let mut swapped = b[1].0.to_le_bytes().to_vec();
        swapped.extend_from_slice(&s[0].0.to_le_bytes());
        assert_ne!(s[1].0, xxh3_64_with_seed(&swapped, 1337));
        // The same block after another prefix gets another sequence hash.
        let (b2, s2) = h.hash(&[9, 9, 3, 4]);
        assert_eq!(b2[1], b[1]);
        assert_ne!(s2[1], s[1]);
    }

    #[test]
    fn partial_blocks_are_not_hashed() {
        let h = TokenBlockHasher::new(BlockTokens::of(16), HashSeed::DEFAULT);
        assert!(h.sequence_hashes(&[1; 15]).is_empty());
        assert_eq!(h.sequence_hashes(&[1; 33]).len(), 2);
        assert_eq!(h.sequence_hashes(&[1; 32]), h.sequence_hashes(&[1; 47]));
    }

    #[test]
    fn salt_and_lora_change_every_hash_and_empty_means_absent() {
        let tokens: Vec<u32> = (0..64).collect();
        let plain =
            TokenBlockHasher::new(BlockTokens::of(16), HashSeed::DEFAULT).sequence_hashes(&tokens);
        let salted = TokenBlockHasher::new(BlockTokens::of(16), HashSeed::new(None, Some("a")))
            .sequence_hashes(&tokens);
        let lora = TokenBlockHasher::new(BlockTokens::of(16), HashSeed::new(Some("a"), None))
            .sequence_hashes(&tokens);
        for i in 0..4 {
            assert_ne!(plain[i], salted[i]);
            assert_ne!(plain[i], lora[i]);
            assert_ne!(salted[i], lora[i]);
        }
        assert_eq!(HashSeed::new(Some(""), Some("")), HashSeed::DEFAULT);
    }

    #[test]
    fn extend_continues_a_chain() {
        let h = TokenBlockHasher::new(BlockTokens::of(4), HashSeed::DEFAULT);
        let tokens: Vec<u32> = (100..124).collect();
        let all = h.sequence_hashes(&tokens);
        let head = h.sequence_hashes(&tokens[..8]);
        let tail = h.extend(head.last().copied(), &tokens[8..]);
        assert_eq!([head, tail].concat(), all);
    }
}
