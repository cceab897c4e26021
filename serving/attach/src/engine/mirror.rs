//! What an engine's events say it holds, in kvfabric's terms.
//!
//! An engine names a block by its own hash (vLLM: sha256 of its tokens and extra keys, SGLang:
//! its own); kvfabric's index names it by the sequence hash of its tokens (the published
//! spec: XXH3-64 per block, chained). For each stored chain the mirror computes kvfabric's
//! hashes from the event's `token_ids`, continuing from the parent's kvfabric hash, and keeps
//! the engine hash → kvfabric hash mapping per worker so that `BlockRemoved` (which carries
//! only engine hashes) can be translated. The output is kvfabric's own [`KvEventData`]; the
//! mirror also answers dumps (every block it believes the engine holds).
//!
//! Blocks the router cannot key are skipped and counted: another block size, LoRA blocks,
//! blocks with extra keys (multimodal inputs, cache salts), and groups that are not the
//! model's full-attention group. A chain whose parent the mirror never saw is an orphan: its
//! kvfabric hashes cannot be computed, so it is skipped and counted too.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use kvfabric::contract::DumpBlock;
use kvfabric::events::{KvEventData, TierKind};
use kvfabric::hash::{HashSeed, SequenceHash, TokenBlockHasher};
use kvfabric::units::BlockTokens;

use super::decode::{EngineBatch, EngineEvent, EngineHash, Medium, Removed, Stored};

/// Counters of one mirror.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MirrorStats {
    /// Blocks stored (per tier they were stored in).
    pub stored: u64,
    /// Blocks removed (per tier).
    pub removed: u64,
    /// `AllBlocksCleared` events.
    pub cleared: u64,
    /// Blocks of another block size than the router's.
    pub skipped_block_size: u64,
    /// Blocks of a LoRA adapter.
    pub skipped_lora: u64,
    /// Blocks with extra keys, or tokens that are not plain ids.
    pub skipped_unkeyable: u64,
    /// Blocks of a group that is not the full-attention group.
    pub skipped_group: u64,
    /// Blocks whose parent is unknown.
    pub orphans: u64,
    /// Blocks in a medium this build does not know.
    pub unknown_medium: u64,
    /// Removals of blocks the mirror does not hold (in that tier).
    pub unknown_removed: u64,
    /// Events of a type this build does not know.
    pub unknown_events: u64,
    /// `BlockStored` events whose token count is not blocks × block size.
    pub invalid: u64,
}

/// One block the engine holds.
#[derive(Debug, Clone, Copy)]
struct Block {
    kv: SequenceHash,
    parent: Option<SequenceHash>,
    /// Bit i: held in `TierKind::ALL[i]`.
    tiers: u8,
}

/// A multiplicative hasher for engine hashes (already uniformly distributed digests).
#[derive(Debug, Default, Clone, Copy)]
pub struct DigestHasher(u64);

impl Hasher for DigestHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut w = [0u8; 8];
            w[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(w));
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0.rotate_left(5) ^ v).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
}

type Map = HashMap<EngineHash, Block, BuildHasherDefault<DigestHasher>>;

fn bit(t: TierKind) -> u8 {
    1 << (t as u8)
}

/// One engine's blocks, keyed by its hashes.
#[derive(Debug)]
pub struct EngineMirror {
    hasher: TokenBlockHasher,
    blocks: Map,
    /// The full-attention group, once an event named one.
    group: Option<i64>,
    stats: MirrorStats,
}

impl EngineMirror {
    /// A mirror for an engine of `block_tokens` tokens per block.
    pub fn new(block_tokens: BlockTokens) -> Self {
        EngineMirror {
            hasher: TokenBlockHasher::new(block_tokens, HashSeed::default()),
            blocks: Map::default(),
            group: None,
            stats: MirrorStats::default(),
        }
    }

    /// The counters.
    pub fn stats(&self) -> MirrorStats {
        self.stats
    }

    /// Blocks held (in any tier).
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// True when nothing is held.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Applies a batch; kvfabric's events for it are appended to `out`.
    pub fn apply(&mut self, batch: &EngineBatch, out: &mut Vec<KvEventData>) {
        for ev in &batch.events {
            match ev {
                EngineEvent::Stored(s) => self.stored(s, out),
                EngineEvent::Removed(r) => self.removed(r, out),
                EngineEvent::Cleared => {
                    self.stats.cleared += 1;
                    out.push(self.clear());
                }
                EngineEvent::Unknown => self.stats.unknown_events += 1,
            }
        }
    }

    /// Forgets every block (the engine cleared its cache, or its events were lost); the
    /// event that says so.
    pub fn clear(&mut self) -> KvEventData {
        self.blocks.clear();
        KvEventData::Cleared
    }

    /// Every block held, with its parent and tier, parents before children of a chain.
    pub fn dump(&self) -> Vec<DumpBlock> {
        let mut v = Vec::with_capacity(self.blocks.len());
        for b in self.blocks.values() {
            for t in TierKind::ALL {
                if b.tiers & bit(t) != 0 {
                    v.push(DumpBlock { tier: t, hash: b.kv, parent: b.parent });
                }
            }
        }
        v
    }

    fn stored(&mut self, s: &Stored, out: &mut Vec<KvEventData>) {
        let n = s.hashes.len() as u64;
        let skip = if s.lora {
            &mut self.stats.skipped_lora
        } else if s.unkeyable {
            &mut self.stats.skipped_unkeyable
        } else if s.full_attention == Some(false) {
            &mut self.stats.skipped_group
        } else if s.block_size != self.hasher.block_tokens().as_u64() {
            &mut self.stats.skipped_block_size
        } else if s.tokens.len() as u64 != n.saturating_mul(s.block_size) {
            &mut self.stats.invalid
        } else {
            match (s.group, self.group) {
                (Some(g), None) => {
                    self.group = Some(g);
                    self.store_chain(s, out);
                    return;
                }
                (Some(g), Some(h)) if g != h => &mut self.stats.skipped_group,
                _ => {
                    self.store_chain(s, out);
                    return;
                }
            }
        };
        *skip += n;
    }

    fn store_chain(&mut self, s: &Stored, out: &mut Vec<KvEventData>) {
        let n = s.hashes.len() as u64;
        let tier = match s.medium.unwrap_or(Medium::Tier(TierKind::Device)) {
            Medium::Tier(t) => t,
            Medium::Unknown => {
                self.stats.unknown_medium += n;
                return;
            }
        };
        let parent = match s.parent {
            None => None,
            Some(p) => match self.blocks.get(&p) {
                Some(b) => Some(b.kv),
                None => {
                    self.stats.orphans += n;
                    return;
                }
            },
        };
        let kvs = self.hasher.extend(parent, &s.tokens);
        let mut prev = parent;
        for (h, &kv) in s.hashes.iter().zip(&kvs) {
            let b = self.blocks.entry(*h).or_insert(Block { kv, parent: prev, tiers: 0 });
            if b.kv != kv {
                // The engine reused its hash for other tokens: the newest wins.
                *b = Block { kv, parent: prev, tiers: 0 };
            }
            b.tiers |= bit(tier);
            prev = Some(kv);
        }
        self.stats.stored += n;
        out.push(KvEventData::Stored { sequence_hashes: kvs, parent, tier });
    }

    fn removed(&mut self, r: &Removed, out: &mut Vec<KvEventData>) {
        let n = r.hashes.len() as u64;
        if let (Some(g), Some(h)) = (r.group, self.group) {
            if g != h {
                self.stats.skipped_group += n;
                return;
            }
        }
        let tier = match r.medium.unwrap_or(Medium::Tier(TierKind::Device)) {
            Medium::Tier(t) => t,
            Medium::Unknown => {
                self.stats.unknown_medium += n;
                return;
            }
        };
        let mut gone = Vec::with_capacity(r.hashes.len());
        for h in &r.hashes {
            match self.blocks.get_mut(h) {
                Some(b) if b.tiers & bit(tier) != 0 => {
                    b.tiers &= !bit(tier);
                    gone.push(b.kv);
                    if b.tiers == 0 {
                        self.blocks.remove(h);
                    }
                }
                _ => self.stats.unknown_removed += 1,
            }
        }
        self.stats.removed += gone.len() as u64;
        if !gone.is_empty() {
            out.push(KvEventData::Removed { sequence_hashes: gone, tier });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(hashes: &[u64], parent: Option<u64>, tokens: Vec<u32>, bs: u64) -> EngineEvent {
        EngineEvent::Stored(Stored {
            hashes: hashes.iter().map(|&h| EngineHash::Int(h)).collect(),
            parent: parent.map(EngineHash::Int),
            tokens,
            block_size: bs,
            ..Stored::default()
        })
    }

    fn batch(events: Vec<EngineEvent>) -> EngineBatch {
        EngineBatch { ts: 0.0, events, rank: None }
    }

    #[test]
    fn chains_get_kvfabric_hashes_from_their_tokens_and_removals_are_translated() {
        let mut m = EngineMirror::new(kvfabric::units::BlockTokens::of(2));
        let mut out = Vec::new();
        let tokens: Vec<u32> = (0..6).collect();
        // Two events: blocks 1,2 then block 3 as a child of 2.
        m.apply(&batch(vec![stored(&[11, 12], None, tokens[..4].to_vec(), 2)]), &mut out);
        m.apply(&batch(vec![stored(&[13], Some(12), tokens[4..].to_vec(), 2)]), &mut out);
        let want = TokenBlockHasher::new(kvfabric::units::BlockTokens::of(2), HashSeed::default())
            .sequence_hashes(&tokens);
        let got: Vec<SequenceHash> = out
            .iter()
            .flat_map(|e| match e {
                KvEventData::Stored { sequence_hashes, .. } => sequence_hashes.clone(),
                _ => vec![],
            })
            .collect();
        assert_eq!(got, want, "the same hashes as a request of these tokens");
        out.clear();
        let rm = EngineEvent::Removed(Removed {
            hashes: vec![EngineHash::Int(12), EngineHash::Int(99)],
            medium: None,
            group: None,
        });
        m.apply(&batch(vec![rm]), &mut out);
        assert_eq!(
            out,
            [KvEventData::Removed { sequence_hashes: vec![want[1]], tier: TierKind::Device }]
        );
        assert_eq!((m.len(), m.stats().unknown_removed), (2, 1));
        // A child of a block never seen is an orphan.
        m.apply(&batch(vec![stored(&[20], Some(77), vec![1, 2], 2)]), &mut out);
        assert_eq!(m.stats().orphans, 1);
    }

    #[test]
    fn what_cannot_be_keyed_is_skipped_and_counted() {
        let mut m = EngineMirror::new(kvfabric::units::BlockTokens::of(2));
        let mut out = Vec::new();
        let mut lora = stored(&[1], None, vec![1, 2], 2);
        if let EngineEvent::Stored(s) = &mut lora {
            s.lora = true;
        }
        let mut window = stored(&[2], None, vec![1, 2], 2);
        if let EngineEvent::Stored(s) = &mut window {
            s.full_attention = Some(false);
        }
        let mut disk = stored(&[3], None, vec![5, 6], 2);
        if let EngineEvent::Stored(s) = &mut disk {
            s.medium = Some(Medium::Tier(TierKind::Disk));
        }
        let events = vec![
            lora,
            window,
            stored(&[4], None, vec![1, 2, 3], 3),
            stored(&[5, 6], None, vec![1, 2, 3], 2),
            disk,
            EngineEvent::Unknown,
        ];
        m.apply(&batch(events), &mut out);
        let s = m.stats();
        assert_eq!(
            (s.skipped_lora, s.skipped_group, s.skipped_block_size, s.invalid, s.unknown_events),
            (1, 1, 1, 2, 1)
        );
        assert_eq!(out.len(), 1);
        assert_eq!(m.dump().len(), 1);
        assert_eq!(m.dump()[0].tier, TierKind::Disk);
        assert_eq!(m.clear(), KvEventData::Cleared);
        assert!(m.is_empty());
    }
}
