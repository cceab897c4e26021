//! The units that get mixed up, as types: tokens per block ([`BlockTokens`], never zero),
//! token counts ([`Tokens`]), block counts ([`Blocks`]) and sizes ([`Bytes`]). The
//! conversions between them live here and nowhere else: a count of tokens becomes blocks
//! only through a [`BlockTokens`], rounding said by the method's name.

use std::num::NonZeroU32;

/// Tokens per KV block: at least 1 (a zero block size is refused where it is read, so no
/// caller divides by it or guards with `.max(1)`).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(try_from = "u32", into = "u32")]
pub struct BlockTokens(NonZeroU32);

/// A count in a unit: a `u64`, serialized as the number.
macro_rules! count {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(
            Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default,
            serde::Serialize, serde::Deserialize,
        )]
        #[serde(transparent)]
        pub struct $name(pub u64);
    };
}

count!(
    /// A count of tokens.
    Tokens
);
count!(
    /// A count of KV blocks.
    Blocks
);
count!(
    /// A size in bytes.
    Bytes
);

/// A block size of zero tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("a block holds at least 1 token (block_tokens 0)")]
pub struct ZeroBlockTokens;

impl BlockTokens {
    /// 16 tokens per block: vLLM's default, and kvfabric's.
    pub const DEFAULT: BlockTokens = BlockTokens(NonZeroU32::new(16).unwrap());

    /// `n` tokens per block; None for 0.
    pub const fn new(n: u32) -> Option<Self> {
        match NonZeroU32::new(n) {
            Some(n) => Some(BlockTokens(n)),
            None => None,
        }
    }

    /// `n` tokens per block, for constants: a zero fails at compile time in a `const`, and
    /// panics otherwise (a block size from input goes through [`BlockTokens::new`]).
    pub const fn of(n: u32) -> Self {
        match BlockTokens::new(n) {
            Some(b) => b,
            None => panic!("a block holds at least 1 token"),
        }
    }

    /// Tokens per block.
    pub const fn get(self) -> u32 {
        self.0.get()
    }

    /// Tokens per block, for indexing.
    pub const fn as_usize(self) -> usize {
        self.0.get() as usize
    }

    /// Tokens per block, for arithmetic with counts.
    pub const fn as_u64(self) -> u64 {
        self.0.get() as u64
    }

    /// The full blocks of `tokens` (a partial last block left out: it is not hashed).
    pub const fn full_blocks(self, tokens: Tokens) -> Blocks {
        Blocks(tokens.0 / self.as_u64())
    }

    /// The blocks that hold `tokens` (a partial last block counted).
    pub const fn blocks_for(self, tokens: Tokens) -> Blocks {
        Blocks(tokens.0.div_ceil(self.as_u64()))
    }

    /// The tokens of `blocks` full blocks.
    pub const fn tokens_of(self, blocks: Blocks) -> Tokens {
        Tokens(blocks.0.saturating_mul(self.as_u64()))
    }

    /// The bytes of one block at `per_token` bytes a token.
    pub const fn block_bytes(self, per_token: Bytes) -> Bytes {
        Bytes(per_token.0.saturating_mul(self.as_u64()))
    }
}

impl Default for BlockTokens {
    fn default() -> Self {
        BlockTokens::DEFAULT
    }
}

impl TryFrom<u32> for BlockTokens {
    type Error = ZeroBlockTokens;
    fn try_from(n: u32) -> Result<Self, ZeroBlockTokens> {
        BlockTokens::new(n).ok_or(ZeroBlockTokens)
    }
}

impl From<BlockTokens> for u32 {
    fn from(b: BlockTokens) -> u32 {
        b.get()
    }
}

impl std::fmt::Display for BlockTokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::str::FromStr for BlockTokens {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let n: u32 = s.parse().map_err(|e| format!("{s:?}: {e}"))?;
        BlockTokens::new(n).ok_or_else(|| ZeroBlockTokens.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conversions_round_as_their_names_say() {
        let bt = BlockTokens::new(16).unwrap();
        assert_eq!(bt.full_blocks(Tokens(47)), Blocks(2));
        assert_eq!(bt.blocks_for(Tokens(47)), Blocks(3));
        assert_eq!(bt.blocks_for(Tokens(48)), Blocks(3));
        assert_eq!(bt.tokens_of(Blocks(3)), Tokens(48));
        assert_eq!(bt.block_bytes(Bytes(1024)), Bytes(16 * 1024));
        assert_eq!(BlockTokens::new(0), None);
        assert_eq!(BlockTokens::DEFAULT.get(), 16);
    }

    #[test]
    fn zero_is_refused_where_it_is_read() {
        assert!(serde_json::from_str::<BlockTokens>("0").is_err());
        assert_eq!(serde_json::from_str::<BlockTokens>("32").unwrap().get(), 32);
        assert_eq!(serde_json::to_string(&BlockTokens::DEFAULT).unwrap(), "16");
        assert!("0".parse::<BlockTokens>().is_err());
        assert_eq!("8".parse::<BlockTokens>().unwrap().as_usize(), 8);
    }
}
