//! Blocks as the simulated tiers move them: a prompt's hashes (memoized), blocks stored
//! into G1 with their evictions cascading down the tiers, offloads, and G4's writes, each
//! a KV event to the index.

use super::*;

/// The sequence hashes of the full blocks of a prompt of `input` tokens with trace ids `ids`:
/// each trace block's are computed once per (parent, id) while the memo holds them, and
/// reused wherever that block appears.
pub(super) fn prompt_hashes(
    ids: &[u64],
    input: u64,
    expander: &Expander,
    hasher: &TokenBlockHasher,
    memo: &mut HashMemo,
) -> Vec<SequenceHash> {
    let tb = u64::from(expander.block_tokens);
    let mut out = Vec::with_capacity((input / hasher.block_tokens().as_u64()) as usize);
    let mut parent: Option<SequenceHash> = None;
    let mut tokens = Vec::new();
    for (k, &id) in ids.iter().enumerate() {
        let take = tb.min(input.saturating_sub(k as u64 * tb)) as usize;
        if take < tb as usize {
            tokens.clear();
            expander.block(id, take, &mut tokens);
            out.extend(hasher.extend(parent, &tokens));
            break;
        }
        let hashes = memo.get((parent, id), || {
            tokens.clear();
            expander.block(id, take, &mut tokens);
            hasher.extend(parent, &tokens).into_boxed_slice()
        });
        out.extend_from_slice(hashes);
        parent = hashes.last().copied().or(parent);
    }
    out
}

/// Puts blocks in G1, pinned (evicting what must go down a tier), `parent` the block before
/// the first; returns the pinned slots and the blocks that no tier held (computed here).
#[allow(clippy::too_many_arguments)]
pub(super) fn store_blocks(
    w: &mut SimWorker,
    hashes: &[SequenceHash],
    parent: Option<SequenceHash>,
    events: &mut Events<'_>,
    rates: &mut Rates,
    t: f64,
    block_bytes: u64,
    r: &mut SimResult,
) -> (Vec<u32>, Vec<SequenceHash>) {
    // As long as what it pins (G1's slots at most), not as the prompt: a request in flight
    // keeps it.
    let mut pinned = Vec::new();
    let mut stored = Vec::new();
    let mut computed = Vec::new();
    let mut removed = Vec::new();
    let mut offloads: Vec<(SequenceHash, Option<SequenceHash>)> = Vec::new();
    let g1_kind = w.tiers[0].as_ref().map_or(TierKind::Device, |g1| g1.kind);
    {
        let Some(g1) = w.tiers[0].as_mut() else { return (pinned, computed) };
        for (k, &h) in hashes.iter().enumerate() {
            if let Some(s) = g1.pool.lookup(h) {
                g1.pool.touch(s);
                if g1.pool.pin(s).is_ok() {
                    pinned.push(s);
                }
                continue;
            }
            let parent = k.checked_sub(1).map(|p| hashes[p]).or(parent);
            let slot = match g1.pool.reserve(h, parent) {
                Ok(s) => Some(s),
                Err(_) => match g1.pool.begin_evict() {
                    Some(v) => {
                        let _ = g1.pool.finish_evict(v.slot, true);
                        removed.push(v.hash);
                        offloads.push((v.hash, v.parent));
                        g1.pool.reserve(h, parent).ok()
                    }
                    None => None,
                },
            };
            let Some(slot) = slot else {
                r.g1_full += 1;
                continue;
            };
            if g1.pool.commit(slot, 1).is_ok() {
                pinned.push(slot);
                stored.push(h);
            }
        }
    }
    let (id, tier) = (w.id, g1_kind);
    events.emit(id, &mut w.event_id, KvEventData::Removed { sequence_hashes: removed, tier });
    events.emit(
        id,
        &mut w.event_id,
        KvEventData::Stored { sequence_hashes: stored.clone(), parent: None, tier },
    );
    // Blocks that no lower tier holds were computed here.
    for &h in &stored {
        let below = w.tiers[1..].iter().flatten().any(|t| t.pool.lookup(h).is_some());
        if !below {
            computed.push(h);
        }
    }
    offload(w, 1, offloads, events, rates, t, block_bytes, r);
    pinned.shrink_to_fit();
    (pinned, computed)
}

/// Moves victims of tier `to - 1` into tier `to` (G2, or G3 if the filter admits them);
/// cascades that tier's own victims.
#[allow(clippy::too_many_arguments)]
pub(super) fn offload(
    w: &mut SimWorker,
    to: usize,
    blocks: Vec<(SequenceHash, Option<SequenceHash>)>,
    events: &mut Events<'_>,
    rates: &mut Rates,
    t: f64,
    block_bytes: u64,
    r: &mut SimResult,
) {
    if blocks.is_empty() {
        return;
    }
    if to > 2 {
        if w.keep_fallen {
            w.fallen.extend(blocks.into_iter().map(|b| b.0));
        }
        return;
    }
    let filter = &w.filter;
    let Some(tier) = w.tiers[to].as_mut() else {
        // No such tier: the victims go on down (G1 straight to disk, as a store without a
        // host tier of its own does).
        return offload(w, to + 1, blocks, events, rates, t, block_bytes, r);
    };
    let (mut stored, mut removed, mut next) = (Vec::new(), Vec::new(), Vec::new());
    for (h, parent) in blocks {
        if to == 2 && !filter.admits(h) {
            continue;
        }
        if let Some(s) = tier.pool.lookup(h) {
            tier.pool.touch(s);
            continue;
        }
        let slot = match tier.pool.reserve(h, parent) {
            Ok(s) => Some(s),
            Err(_) => tier.pool.begin_evict().and_then(|v| {
                let _ = tier.pool.finish_evict(v.slot, true);
                removed.push(v.hash);
                next.push((v.hash, v.parent));
                tier.pool.reserve(h, parent).ok()
            }),
        };
        if let Some(s) = slot {
            if tier.pool.commit(s, 0).is_ok() {
                stored.push(h);
            }
        }
    }
    let kind = tier.kind;
    let bytes = stored.len() as u64 * block_bytes;
    let what = if to == 1 { OFFLOAD_G2 } else { OFFLOAD_G3 };
    *r.bytes.fields()[what] += bytes;
    rates.add(t, what, bytes);
    let id = w.id;
    events.emit(id, &mut w.event_id, KvEventData::Removed { sequence_hashes: removed, tier: kind });
    events.emit(
        id,
        &mut w.event_id,
        KvEventData::Stored { sequence_hashes: stored, parent: None, tier: kind },
    );
    offload(w, to + 1, next, events, rates, t, block_bytes, r);
}

/// Writes a prefill's computed blocks through to the shared G4 pool (LRU; victims dropped).
pub(super) fn write_g4(
    g4: &mut Tier,
    blocks: &[SequenceHash],
    events: &mut Events<'_>,
    event_id: &mut u64,
    rates: &mut Rates,
    t: f64,
    block_bytes: u64,
) -> u64 {
    let (mut stored, mut removed) = (Vec::new(), Vec::new());
    for &h in blocks {
        if let Some(s) = g4.pool.lookup(h) {
            g4.pool.touch(s);
            continue;
        }
        let slot = match g4.pool.reserve(h, None) {
            Ok(s) => Some(s),
            Err(_) => g4.pool.begin_evict().and_then(|v| {
                let _ = g4.pool.finish_evict(v.slot, true);
                removed.push(v.hash);
                g4.pool.reserve(h, None).ok()
            }),
        };
        if let Some(s) = slot {
            if g4.pool.commit(s, 0).is_ok() {
                stored.push(h);
            }
        }
    }
    let bytes = stored.len() as u64 * block_bytes;
    rates.add(t, WRITE_G4, bytes);
    let id = WorkerId(0);
    events.emit(
        id,
        event_id,
        KvEventData::Removed { sequence_hashes: removed, tier: TierKind::Remote },
    );
    events.emit(
        id,
        event_id,
        KvEventData::Stored { sequence_hashes: stored, parent: None, tier: TierKind::Remote },
    );
    bytes
}
