//! A sequence's KV as a block table: the memory of each of its blocks, where it lives.
//!
//! Cached blocks are store slots pinned for as long as the sequence runs, read in place by
//! attention: a cache hit copies nothing. Blocks the engine computes are written once,
//! straight into store slots that then become the stored blocks (a slot reserved for a prompt
//! block's hash, or a scratch slot named when its last token is known). Engine memory is the
//! fallback when there is no store slot to be had (store off, full of pinned blocks), and what
//! an engine uses on its own (tests, benchmarks).

use kvfabric_tiers::{BlockRef, ScratchSlot, WriteSlot};

use super::EngineError;

/// The memory of one KV block.
#[derive(Debug)]
pub enum KvBlock {
    /// A stored block, pinned: read in place, never written.
    Cached(BlockRef),
    /// A store slot reserved for the block of a known hash, being computed.
    Writing(WriteSlot),
    /// A store slot for a block whose tokens are not all known yet.
    Scratch(ScratchSlot),
    /// Engine memory (8-byte aligned).
    Owned {
        /// The bytes, as words for alignment.
        words: Vec<u64>,
        /// Bytes of the block.
        len: usize,
    },
}

impl KvBlock {
    /// A zeroed block of engine memory.
    pub fn owned(len: usize) -> Self {
        KvBlock::Owned { words: vec![0; len.div_ceil(8)], len }
    }

    /// Engine memory holding a copy of `bytes`.
    pub fn copy_of(bytes: &[u8]) -> Self {
        let mut b = Self::owned(bytes.len());
        if let Some(dst) = b.bytes_mut() {
            dst.copy_from_slice(bytes);
        }
        b
    }

    /// Whether it is a stored block (read-only).
    pub fn is_cached(&self) -> bool {
        matches!(self, KvBlock::Cached(_))
    }

    /// Its bytes.
    pub fn bytes(&self) -> &[u8] {
        match self {
            KvBlock::Cached(r) => r.bytes(),
            // SAFETY: the scheduler reserves the engine's write slots itself and never hands
            // their descriptors to a transfer, so no transfer touches them while viewed.
            KvBlock::Writing(w) => unsafe { w.bytes() },
            KvBlock::Scratch(s) => s.bytes(),
            KvBlock::Owned { words, len } => &bytemuck::cast_slice(words)[..*len],
        }
    }

    /// Its bytes to write; None for a stored block.
    pub fn bytes_mut(&mut self) -> Option<&mut [u8]> {
        match self {
            KvBlock::Cached(_) => None,
            // SAFETY: as in `bytes`: no transfer touches the engine's write slots.
            KvBlock::Writing(w) => Some(unsafe { w.bytes_mut() }),
            KvBlock::Scratch(s) => Some(s.bytes_mut()),
            KvBlock::Owned { words, len } => Some(&mut bytemuck::cast_slice_mut(words)[..*len]),
        }
    }

    /// Its bytes as f32 (the llama engine's KV); an error when they are not aligned.
    pub fn f32s(&self) -> Result<&[f32], EngineError> {
        bytemuck::try_cast_slice(self.bytes())
            .map_err(|e| EngineError::model(format!("KV block not f32-aligned: {e:?}")))
    }

    /// Its bytes as f32 to write; None for a stored block.
    pub fn f32s_mut(&mut self) -> Result<Option<&mut [f32]>, EngineError> {
        match self.bytes_mut() {
            None => Ok(None),
            Some(b) => bytemuck::try_cast_slice_mut(b)
                .map(Some)
                .map_err(|e| EngineError::model(format!("KV block not f32-aligned: {e:?}"))),
        }
    }
}

/// One sequence's KV: its blocks and how many tokens of them are computed.
#[derive(Debug, Default)]
pub struct KvTable {
    /// Block `i` holds tokens `i*bt..(i+1)*bt`.
    pub blocks: Vec<KvBlock>,
    /// Tokens whose KV is present.
    pub len: usize,
}

/// A sequence's blocks go from its end: a stored block becomes evictable when its pin goes,
/// so the children become evictable (and are evicted) before their parents, and what the
/// store keeps of the sequence stays a prefix that a lookup finds.
impl Drop for KvTable {
    fn drop(&mut self) {
        while self.blocks.pop().is_some() {}
    }
}

impl KvTable {
    /// Appends a cached block (its KV present); it must come right after the computed ones
    /// (block `len / bt`, with `len` a multiple of `bt`) and before any fresh memory.
    pub fn push_cached(&mut self, bt: usize, block: KvBlock) -> Result<(), EngineError> {
        if self.len % bt != 0 || self.blocks.len() != self.len / bt {
            return Err(EngineError::invalid("block imported out of order or of a wrong size"));
        }
        self.blocks.push(block);
        self.len += bt;
        Ok(())
    }

    /// Makes sure blocks cover `tokens` tokens, adding engine memory of `bytes` each.
    pub fn reserve_owned(&mut self, bt: usize, tokens: usize, bytes: usize) {
        while self.blocks.len() * bt < tokens {
            self.blocks.push(KvBlock::owned(bytes));
        }
    }

    /// Moves the first stored block into engine memory (a copy), unpinning its store slot so
    /// that the store can write it back to a lower tier and reuse the slot; false when the
    /// table holds no stored block. The way out when a sequence's own pinned blocks fill the
    /// host tier (a sequence longer than the tier).
    pub fn spill_one(&mut self) -> bool {
        match self.blocks.iter().position(KvBlock::is_cached) {
            Some(i) => {
                self.blocks[i] = KvBlock::copy_of(self.blocks[i].bytes());
                true
            }
            None => false,
        }
    }

    /// Copies block `block` out, once its tokens are computed.
    pub fn export(&self, bt: usize, block: usize, out: &mut [u8]) -> Result<(), EngineError> {
        match self.blocks.get(block) {
            Some(b) if self.len >= (block + 1) * bt && b.bytes().len() == out.len() => {
                out.copy_from_slice(b.bytes());
                Ok(())
            }
            _ => Err(EngineError::invalid(format!("block {block} is not computed"))),
        }
    }
}
