//! The tiered store end to end on real files with O_DIRECT: spill to disk and back, the
//! frequency filter, write-through, restart with index rebuild, corruption, a full disk,
//! KV events, and random operation sequences against a model.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use kvfabric::agent::{Agent, AgentConfig};
use kvfabric::events::{KvEventData, RecordingSink, TierKind};
use kvfabric::hash::SequenceHash;
use kvfabric_tiers::disk::io::IoPreference;
use kvfabric_tiers::disk::DiskConfig;
use kvfabric_tiers::{StoreConfig, StoreError, TieredStore};
use proptest::prelude::*;

const BLOCK: u64 = 20_000; // not a multiple of 4096: exercises padding

fn content(hash: SequenceHash, len: u64) -> Vec<u8> {
    let mut x = hash.0 | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn h(i: u64) -> SequenceHash {
    SequenceHash(0x1000 + i)
}

async fn agent() -> Agent {
    Agent::start(AgentConfig::new("store-test", b"s".to_vec())).await.unwrap()
}

fn disk(dir: &Path, blocks: u32) -> DiskConfig {
    let mut d = DiskConfig::new(dir.join("g3.slots"), blocks);
    d.grow_blocks = 8;
    d
}

async fn open(
    agent: &Agent,
    host: u32,
    disk_cfg: Option<DiskConfig>,
    min_hits: u32,
) -> (TieredStore, Arc<RecordingSink>) {
    let sink = RecordingSink::new();
    let mut cfg = StoreConfig::new(BLOCK, host);
    cfg.disk = disk_cfg;
    cfg.disk_admit_min_hits = min_hits;
    cfg.shared_host = false;
    (TieredStore::open(cfg, agent, sink.clone()).await.unwrap(), sink)
}

async fn put(s: &TieredStore, i: u64) {
    let parent = i.checked_sub(1).map(h);
    s.put(h(i), parent, &content(h(i), BLOCK)).await.unwrap();
}

async fn assert_bytes(s: &TieredStore, i: u64) {
    let refs = s.get(&[h(i)]).await.unwrap();
    assert_eq!(refs.len(), 1, "block {i} should be served");
    assert!(refs[0].to_vec() == content(h(i), BLOCK), "block {i} bytes");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_tier_stores_pins_and_evicts_lru() {
    let a = agent().await;
    let (s, sink) = open(&a, 4, None, 0).await;
    for i in 0..4 {
        put(&s, i).await;
    }
    assert!(matches!(
        s.put(h(0), None, &content(h(0), BLOCK)).await,
        Err(StoreError::AlreadyStored(_))
    ));
    // Pin 1 and 2; touch 0 (lookup); then two more blocks evict 3 and... 0 is newer than 3.
    let pinned = s.get(&[h(1), h(2)]).await.unwrap();
    assert_eq!(s.lookup_prefix(&[h(0)]), vec![TierKind::Host]);
    put(&s, 10).await;
    put(&s, 11).await;
    assert!(s.lookup_prefix(&[h(3)]).is_empty(), "3 was least recently used");
    assert!(s.lookup_prefix(&[h(0)]).is_empty(), "then 0");
    assert_eq!(s.lookup_prefix(&[h(1), h(2)]).len(), 2, "pinned blocks stay");
    // Everything pinned: a new block cannot get a slot.
    let more = s.get(&[h(10), h(11)]).await.unwrap();
    assert!(matches!(
        s.put(h(20), None, &content(h(20), BLOCK)).await,
        Err(StoreError::Full(TierKind::Host))
    ));
    assert_eq!(pinned[0].to_vec(), content(h(1), BLOCK));
    drop((pinned, more));
    put(&s, 20).await;
    // Events: 7 stores, 3 removals, ids 1.. without gaps.
    let ev = sink.snapshot();
    assert!(ev.iter().enumerate().all(|(i, e)| e.event_id == i as u64 + 1));
    let stored = ev
        .iter()
        .filter(|e| matches!(e.data, KvEventData::Stored { tier: TierKind::Host, .. }))
        .count();
    let removed = ev
        .iter()
        .filter(|e| matches!(e.data, KvEventData::Removed { tier: TierKind::Host, .. }))
        .count();
    assert_eq!((stored, removed), (7, 3));
    let m = s.metrics();
    assert_eq!((m.host_used_blocks, m.host_capacity_blocks), (4, 4));
    assert_eq!((m.host_evicted_blocks, m.disk_evicted_blocks), (3, 0), "each removal counted");
}

/// A dropped store gives its host tier back: the region is deregistered from the agent (a
/// process that opens and closes stores, as the C ABI's users do, does not grow).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_store_deregisters_its_host_region() {
    let dir = tempfile::tempdir().unwrap();
    let a = agent().await;
    let (s, _sink) = open(&a, 4, Some(disk(dir.path(), 16)), 0).await;
    for i in 0..6 {
        put(&s, i).await;
    }
    assert_bytes(&s, 0).await; // a disk block read through the region
    let id = s.host_region().id();
    assert!(a.region(id).is_ok());
    let clone = s.clone();
    drop(s);
    assert!(a.region(id).is_ok(), "a clone keeps the store");
    drop(clone);
    assert!(a.region(id).is_err(), "the last handle deregisters the region");
}

/// Polls `f` once (its I/O is then submitted) and drops it; whether it was done.
fn poll_once_then_drop<F: std::future::Future>(f: F) -> bool {
    let mut f = std::pin::pin!(f);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    f.as_mut().poll(&mut cx).is_ready()
}

/// Onboard and offload run in the caller's task (no spawn on the data path); a caller that
/// gives up mid-way (drops its future after the first poll, as a timeout would) must leave nothing
/// half-done: the I/O and its bookkeeping finish on their own, no slot stays reserved or
/// pinned, and the blocks are served afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_that_drops_an_onboard_or_offload_leaves_nothing_half_done() {
    use std::time::Duration;
    let dir = tempfile::tempdir().unwrap();
    let a = agent().await;
    let (s, _sink) = open(&a, 4, Some(disk(dir.path(), 64)), 0).await;
    for i in 0..8 {
        put(&s, i).await;
    }
    // Give up on writing block 6 (in host memory) to disk after one poll. First: the reads
    // below need host slots, and in the background they may evict block 6 before a later
    // offload looks for it (then nothing would be written, in no time).
    assert!(!poll_once_then_drop(s.offload(&[h(6)])), "a disk write completes in one poll");
    // Blocks 0..4 are on disk only; give up on reading 0 and 1 after one poll, too.
    assert_eq!(s.metrics().onboard_blocks, 0);
    for i in 0..2 {
        assert!(!poll_once_then_drop(s.get(&[h(i)])), "a disk read completes in one poll");
    }
    // Everything completes in the background.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while (s.metrics().onboard_blocks < 2 || !s.disk().unwrap().has(h(6)))
        && std::time::Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let m = s.metrics();
    assert_eq!(m.onboard_blocks, 2, "both abandoned reads finished");
    assert!(s.disk().unwrap().has(h(6)), "the abandoned write finished");
    // Nothing stayed reserved or pinned: every block is served, and the host tier can still
    // evict all of its slots to make room for four new blocks.
    for i in 0..8 {
        assert_bytes(&s, i).await;
    }
    for i in 100..104 {
        put(&s, i).await;
    }
    for i in 100..104 {
        assert_bytes(&s, i).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_working_set_larger_than_host_spills_to_disk_and_comes_back() {
    let dir = tempfile::tempdir().unwrap();
    let a = agent().await;
    let (s, sink) = open(&a, 4, Some(disk(dir.path(), 64)), 0).await;
    for i in 0..20 {
        put(&s, i).await;
    }
    let m = s.metrics();
    assert_eq!(m.offload_blocks, 16);
    assert_eq!(m.disk_used_blocks, 16);
    assert_eq!(m.host_evicted_blocks, 16, "moved down to disk, counted as host evictions");
    let hashes: Vec<_> = (0..20).map(h).collect();
    let tiers = s.lookup_prefix(&hashes);
    assert_eq!(tiers.len(), 20);
    // Computed before the prefetch it triggers: the 16 oldest on disk, the 4 newest in host.
    assert!(tiers[..16].iter().all(|&t| t == TierKind::Disk), "{tiers:?}");
    assert!(tiers[16..].iter().all(|&t| t == TierKind::Host), "{tiers:?}");
    // Every block comes back with its bytes, disk blocks through checksum-verified reads.
    for i in 0..20 {
        assert_bytes(&s, i).await;
    }
    let m = s.metrics();
    assert!(m.onboard_blocks >= 16, "{m:?}");
    assert!(m.disk_io_backend.is_some());
    let ev = sink.snapshot();
    assert!(ev.iter().any(|e| matches!(&e.data, KvEventData::Stored { tier: TierKind::Disk, sequence_hashes, parent } if sequence_hashes == &vec![h(1)] && *parent == Some(h(0)))));
    // A prefix lookup stops at the first miss.
    assert_eq!(s.lookup_prefix(&[h(0), h(1), h(99), h(2)]).len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_frequency_filter_keeps_one_off_blocks_off_the_disk() {
    let dir = tempfile::tempdir().unwrap();
    let a = agent().await;
    let (s, _) = open(&a, 4, Some(disk(dir.path(), 64)), 2).await;
    for i in 0..4 {
        put(&s, i).await;
    }
    // Blocks 0 and 1 are hit twice; 2 and 3 never.
    for _ in 0..2 {
        assert_eq!(s.lookup_prefix(&[h(0), h(1)]).len(), 2);
    }
    for i in 10..14 {
        put(&s, i).await;
    }
    let disk = s.disk().unwrap();
    assert!(disk.has(h(0)) && disk.has(h(1)), "popular blocks offloaded");
    assert!(!disk.has(h(2)) && !disk.has(h(3)), "one-off blocks dropped");
    assert_eq!(s.metrics().offload_blocks, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_through_puts_every_block_on_disk() {
    let dir = tempfile::tempdir().unwrap();
    let a = agent().await;
    let sink = RecordingSink::new();
    let mut cfg = StoreConfig::new(BLOCK, 8);
    cfg.disk = Some(disk(dir.path(), 64));
    cfg.write_through = true;
    let s = TieredStore::open(cfg, &a, sink).await.unwrap();
    for i in 0..5 {
        put(&s, i).await;
    }
    for _ in 0..200 {
        if (0..5).all(|i| s.disk().unwrap().has(h(i))) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert!((0..5).all(|i| s.disk().unwrap().has(h(i))));
    assert_eq!(
        s.lookup_prefix(&[h(0)]),
        vec![TierKind::Host],
        "host is the fastest tier holding it"
    );
}

/// Write-through holds each committed block (a pin) until its disk write ends. A burst of
/// saves larger than the host tier waits for those writes to release slots instead of
/// failing `Full`: every block is stored, and every one comes back with its bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_larger_than_host_waits_for_write_through_instead_of_failing() {
    let dir = tempfile::tempdir().unwrap();
    let a = agent().await;
    let mut cfg = StoreConfig::new(BLOCK, 8);
    cfg.disk = Some(disk(dir.path(), 64));
    cfg.write_through = true;
    cfg.shared_host = false;
    let s = TieredStore::open(cfg, &a, RecordingSink::new()).await.unwrap();
    let puts = (0..40u64).map(|i| {
        let s = &s;
        async move { s.put(h(i), None, &content(h(i), BLOCK)).await }
    });
    let results = futures_util::future::join_all(puts).await;
    for (i, r) in results.iter().enumerate() {
        assert!(r.is_ok(), "block {i}: {r:?}");
    }
    for i in 0..40 {
        assert_bytes(&s, i).await;
    }
    // A store whose every host slot a user holds has nothing to wait for: full at once.
    let mut cfg = StoreConfig::new(BLOCK, 2);
    cfg.shared_host = false;
    let s = TieredStore::open(cfg, &a, RecordingSink::new()).await.unwrap();
    for i in 0..2 {
        s.put(h(i), None, &content(h(i), BLOCK)).await.unwrap();
    }
    let held = s.get(&[h(0), h(1)]).await.unwrap();
    let t0 = std::time::Instant::now();
    let e = s.put(h(2), None, &content(h(2), BLOCK)).await.unwrap_err();
    assert!(matches!(e, StoreError::Full(TierKind::Host)), "{e}");
    assert!(t0.elapsed() < std::time::Duration::from_secs(1), "{:?}", t0.elapsed());
    drop(held);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_free_target_writes_back_in_the_background_and_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let a = agent().await;
    let sink = RecordingSink::new();
    let mut cfg = StoreConfig::new(BLOCK, 8);
    cfg.disk = Some(disk(dir.path(), 64));
    cfg.disk_admit_min_hits = 0;
    cfg.host_free_target = 3;
    cfg.shared_host = false;
    let s = TieredStore::open(cfg, &a, sink).await.unwrap();
    for i in 0..8 {
        put(&s, i).await;
    }
    // The oldest blocks leave host memory for disk without any allocation asking.
    let in_host = |s: &TieredStore| s.lookup_prefix(&(0..8).map(h).collect::<Vec<_>>());
    for _ in 0..300 {
        if s.metrics().offload_blocks >= 3 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    let tiers = in_host(&s);
    assert_eq!(tiers.len(), 8, "every block is still held: {tiers:?}");
    let on_disk = tiers.iter().filter(|t| **t == TierKind::Disk).count();
    assert!(on_disk >= 3, "at least 3 written back: {tiers:?}");
    assert!(
        tiers[..3].iter().all(|t| *t == TierKind::Disk),
        "the least recently used go first: {tiers:?}"
    );
    for i in 0..8 {
        assert_bytes(&s, i).await;
    }
}

/// A slot file of the first layout (a header page before each block, magic `KVFBLK01`) is
/// recognised on open: said, and none of its blocks read as this layout's. A file of this
/// layout is not taken for one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_file_of_the_first_layout_is_recognised_and_not_read() {
    use kvfabric_tiers::disk::format::FIRST_LAYOUT_MAGIC;
    use kvfabric_tiers::disk::DiskTier;
    let dir = tempfile::tempdir().unwrap();
    let cfg = disk(dir.path(), 64);
    {
        let (tier, recovered) = DiskTier::open(&cfg, BLOCK).await.unwrap();
        assert!(!recovered.first_layout);
        drop(tier);
    }
    {
        let a = agent().await;
        let (s, _) = open(&a, 2, Some(cfg.clone()), 0).await;
        put(&s, 0).await;
        assert_eq!(s.offload(&[h(0)]).await.unwrap(), 1);
    }
    let (_, recovered) = DiskTier::open(&cfg, BLOCK).await.unwrap();
    assert_eq!((recovered.blocks.len(), recovered.first_layout), (1, false));
    // Slot 0 as the first layout wrote it: its header at offset 0, then the block.
    {
        use std::os::unix::fs::FileExt;
        let mut page = vec![0u8; 4096];
        page[..8].copy_from_slice(&FIRST_LAYOUT_MAGIC);
        let f = std::fs::OpenOptions::new().write(true).open(&cfg.path).unwrap();
        f.write_at(&page, 0).unwrap();
    }
    let (_, recovered) = DiskTier::open(&cfg, BLOCK).await.unwrap();
    assert!(recovered.first_layout);
    assert!(recovered.blocks.is_empty());
}

/// A block goes to disk as two requests, data and header. A crash between them can leave a
/// new block's header over an older block's data: after a restart the header is indexed,
/// and the read that finds data not matching it drops the block. The older bytes are never
/// served, under either name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_header_over_older_data_is_dropped_never_served() {
    use kvfabric_tiers::disk::format::{SlotHeader, HEADER_BYTES};
    let dir = tempfile::tempdir().unwrap();
    let a = agent().await;
    let header0 = {
        let (s, _) = open(&a, 2, Some(disk(dir.path(), 64)), 0).await;
        put(&s, 0).await;
        put(&s, 1).await;
        assert_eq!(s.offload(&[h(0), h(1)]).await.unwrap(), 2);
        let d = s.disk().unwrap();
        d.header_offset(d.slot_of(h(0)).unwrap())
    };
    // Block 9's header, as its write would have put it, over block 0's slot.
    {
        use std::os::unix::fs::FileExt;
        let mut page = vec![0u8; HEADER_BYTES as usize];
        SlotHeader {
            hash: h(9),
            parent: None,
            block_bytes: BLOCK,
            data_checksum: kvfabric::hash::data_checksum(&content(h(9), BLOCK)),
            write_seq: 1 << 40,
        }
        .encode(&mut page);
        let f = std::fs::OpenOptions::new().write(true).open(dir.path().join("g3.slots")).unwrap();
        f.write_at(&page, header0).unwrap();
    }
    let (s, _) = open(&a, 2, Some(disk(dir.path(), 64)), 0).await;
    let d = s.disk().unwrap();
    assert!(d.has(h(9)) && !d.has(h(0)), "the slot's header names block 9 now");
    assert!(s.get(&[h(9)]).await.unwrap().is_empty(), "block 0's bytes are not block 9's");
    assert_eq!(s.metrics().disk_corrupt_blocks, 1);
    assert!(!d.has(h(9)) && s.get(&[h(0)]).await.unwrap().is_empty());
    assert_bytes(&s, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_rebuilds_the_index_and_corrupt_blocks_are_never_served() {
    let dir = tempfile::tempdir().unwrap();
    let a = agent().await;
    {
        let (s, _) = open(&a, 2, Some(disk(dir.path(), 64)), 0).await;
        for i in 0..12 {
            put(&s, i).await;
        }
        assert_eq!(s.offload(&[h(10), h(11)]).await.unwrap(), 2);
        // Removed on purpose: must not come back after the restart.
        assert!(s.remove(h(5)).await);
    }
    // Corrupt block 3's data and block 4's header, directly in the file.
    let (data3, header4) = {
        let (s, _) = open(&a, 2, Some(disk(dir.path(), 64)), 0).await;
        let d = s.disk().unwrap();
        (d.data_offset(d.slot_of(h(3)).unwrap()), d.header_offset(d.slot_of(h(4)).unwrap()))
    };
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new().write(true).open(dir.path().join("g3.slots")).unwrap();
        f.write_at(&[0xff; 16], data3 + 100).unwrap();
        f.write_at(&[0x00; 8], header4 + 8).unwrap();
    }
    let (s, sink) = open(&a, 2, Some(disk(dir.path(), 64)), 0).await;
    let ev = sink.snapshot();
    let recovered: Vec<SequenceHash> = ev
        .iter()
        .filter_map(|e| match &e.data {
            KvEventData::Stored { sequence_hashes, tier: TierKind::Disk, .. } => {
                Some(sequence_hashes[0])
            }
            _ => None,
        })
        .collect();
    assert_eq!(recovered.len(), 10, "12 blocks written, 5 removed, block 4's header torn");
    assert!(!recovered.contains(&h(4)) && !recovered.contains(&h(5)));
    // Block 3 has a valid header but bad data: found, then dropped on read, never served.
    assert_eq!(s.health(), Default::default());
    assert!(s.get(&[h(3)]).await.unwrap().is_empty());
    assert_eq!(s.metrics().disk_corrupt_blocks, 1);
    assert!(!s.disk().unwrap().has(h(3)));
    // ... and seen: the store says it is degraded, and why.
    let health = s.health();
    assert_eq!(health.disk_corrupt.as_ref().map(|c| c.blocks), Some(1), "{health:?}");
    let why = health.reasons();
    assert!(why.len() == 1 && why[0].contains("1 block(s) found corrupt on disk"), "{why:?}");
    assert!(sink.snapshot().iter().any(|e| matches!(&e.data, KvEventData::Removed { sequence_hashes, tier: TierKind::Disk } if sequence_hashes == &vec![h(3)])));
    for i in (0..12).filter(|&i| ![3, 4, 5].contains(&i)) {
        assert_bytes(&s, i).await;
    }
}

/// A read fetches a block's bytes alone and checks them against the checksum the running
/// store recorded when it wrote them: bytes corrupted under a live store are caught without a
/// restart, and a header page damaged under it does not change what is served (the header
/// only matters when the index is rebuilt, which then drops that block).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_store_verifies_reads_against_the_checksums_it_wrote() {
    let dir = tempfile::tempdir().unwrap();
    let a = agent().await;
    let (s, _) = open(&a, 2, Some(disk(dir.path(), 64)), 0).await;
    for i in 0..6 {
        put(&s, i).await;
    }
    let all: Vec<_> = (0..6).map(h).collect();
    s.offload(&all).await.unwrap();
    let d = s.disk().unwrap();
    for i in 0..6 {
        assert!(d.has(h(i)), "block {i} on disk");
    }
    let (slot1, slot2) =
        (d.data_offset(d.slot_of(h(1)).unwrap()), d.header_offset(d.slot_of(h(2)).unwrap()));
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new().write(true).open(dir.path().join("g3.slots")).unwrap();
        f.write_at(&[0xa5; 8], slot1 + BLOCK - 8).unwrap();
        f.write_at(&[0x00; 8], slot2 + 8).unwrap();
    }
    // Two new blocks fill host memory: blocks 0..6 are on disk only, so the reads below
    // go to disk.
    put(&s, 10).await;
    put(&s, 11).await;
    assert!(s.get(&[h(1)]).await.unwrap().is_empty(), "corrupt bytes are never served");
    assert_eq!(s.metrics().disk_corrupt_blocks, 1);
    assert!(!d.has(h(1)));
    assert_bytes(&s, 2).await;
    assert_bytes(&s, 3).await;
    drop(s);
    let (s, _) = open(&a, 2, Some(disk(dir.path(), 64)), 0).await;
    let d = s.disk().unwrap();
    assert!(!d.has(h(2)), "a torn header drops its block on rebuild");
    assert!(d.has(h(0)) && d.has(h(3)));
}

/// Blocks of 1 MiB and more are verified on the blocking pool when other reads are in flight:
/// a batch of concurrent reads with one corrupt block in the middle serves the good ones,
/// byte for byte, and never the corrupt one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_blocks_read_concurrently_are_verified_and_a_corrupt_one_is_dropped() {
    const BIG: u64 = (3 << 19) + 1000; // 1.5 MiB and change: the parallel path, padded
    let dir = tempfile::tempdir().unwrap();
    let a = agent().await;
    let mut cfg = StoreConfig::new(BIG, 8);
    cfg.disk = Some(disk(dir.path(), 32));
    cfg.disk_admit_min_hits = 0;
    cfg.shared_host = false;
    let (s, slot5) = {
        let s = TieredStore::open(cfg.clone(), &a, RecordingSink::new()).await.unwrap();
        for i in 0..20 {
            s.put(h(i), i.checked_sub(1).map(h), &content(h(i), BIG)).await.unwrap();
        }
        let d = s.disk().unwrap();
        let slot5 = d.data_offset(d.slot_of(h(5)).unwrap());
        (s, slot5)
    };
    drop(s);
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new().write(true).open(dir.path().join("g3.slots")).unwrap();
        f.write_at(&[0x5a; 64], slot5 + BIG - 64).unwrap();
    }
    let s = TieredStore::open(cfg, &a, RecordingSink::new()).await.unwrap();
    // Blocks 0..8 are read at once: eight reads in flight, verified in parallel.
    let hashes: Vec<_> = (0..8).map(h).collect();
    let refs = s.get(&hashes).await.unwrap();
    assert_eq!(refs.len(), 5, "the leading run stops at the corrupt block 5");
    for (i, r) in refs.iter().enumerate() {
        assert!(r.to_vec() == content(h(i as u64), BIG), "block {i} bytes");
    }
    drop(refs);
    assert_eq!(s.metrics().disk_corrupt_blocks, 1);
    assert!(!s.disk().unwrap().has(h(5)));
    for i in [6u64, 7] {
        let r = s.get(&[h(i)]).await.unwrap();
        assert!(r.len() == 1 && r[0].to_vec() == content(h(i), BIG), "block {i} bytes");
    }
}

/// A full filesystem: a real tmpfs of a few MiB. The offload that cannot grow the file fails
/// with a typed error and the block stays in host memory; afterwards the disk tier makes room
/// by evicting its own blocks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_is_a_typed_error_and_the_block_stays_in_host_memory() {
    let mnt = tempfile::tempdir().unwrap();
    let status = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=3m", "tmpfs"])
        .arg(mnt.path())
        .status()
        .expect("mount(8) runs");
    assert!(
        status.success(),
        "this test needs root to mount a small tmpfs (scripts/test.sh runs as root)"
    );
    struct Unmount<'a>(&'a Path);
    impl Drop for Unmount<'_> {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg("-l").arg(self.0).status();
        }
    }
    let _guard = Unmount(mnt.path());
    let a = agent().await;
    let sink = RecordingSink::new();
    // 1 MiB blocks: the 3 MiB filesystem holds two slots (1 MiB + 4 KiB each).
    let block = 1u64 << 20;
    let mut cfg = StoreConfig::new(block, 2);
    let mut d = DiskConfig::new(mnt.path().join("g3.slots"), 16);
    d.grow_blocks = 1;
    cfg.disk = Some(d);
    cfg.disk_admit_min_hits = 0;
    cfg.shared_host = false;
    let s = TieredStore::open(cfg, &a, sink).await.unwrap();
    let data = |i: u64| content(h(i), block);
    s.put(h(0), None, &data(0)).await.unwrap();
    s.put(h(1), None, &data(1)).await.unwrap();
    assert_eq!(s.offload(&[h(0), h(1)]).await.unwrap(), 2);
    s.put(h(2), None, &data(2)).await.unwrap(); // evicts 0 (already on disk)
    let err = s.offload(&[h(2)]).await.unwrap_err();
    assert!(err.to_string().contains("disk tier full"), "{err}");
    assert_eq!(s.lookup_prefix(&[h(2)]), vec![TierKind::Host], "the block stayed in host memory");
    assert_eq!(s.get(&[h(2)]).await.unwrap()[0].to_vec(), data(2));
    assert_eq!(s.metrics().disk_capacity_blocks, 2, "the tier capped itself at what fits");
    let health = s.health();
    assert_eq!(health.disk_full, Some(kvfabric::health::DiskFull { usable: 2, configured: 16 }));
    let why = health.reasons();
    assert!(why.len() == 1 && why[0].contains("2 of 16 slots usable"), "{why:?}");
    // Later offloads evict disk blocks instead of failing.
    assert_eq!(s.offload(&[h(2)]).await.unwrap(), 1);
    assert!(s.disk().unwrap().has(h(2)));
    assert_eq!(s.metrics().offload_errors, 1);
    drop(s);

    // A filesystem full before the first write: capped (and degraded) from the start.
    let filler = mnt.path().join("filler");
    let free = 3u64 << 20;
    let _ = std::fs::write(&filler, vec![0u8; free as usize]); // fills what is left
    let mut cfg = StoreConfig::new(block, 2);
    let mut d = DiskConfig::new(mnt.path().join("other.slots"), 16);
    d.grow_blocks = 4;
    cfg.disk = Some(d);
    cfg.shared_host = false;
    let s = TieredStore::open(cfg, &a, RecordingSink::new()).await.unwrap();
    let why = s.health().reasons();
    assert!(why.len() == 1 && why[0].contains("0 of 16 slots usable"), "{why:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pread_fallback_behaves_the_same() {
    let dir = tempfile::tempdir().unwrap();
    let a = agent().await;
    let mut d = disk(dir.path(), 64);
    d.io = IoPreference::Pread;
    let (s, _) = open(&a, 2, Some(d), 0).await;
    for i in 0..8 {
        put(&s, i).await;
    }
    assert_eq!(s.metrics().disk_io_backend, Some("pread"));
    for i in 0..8 {
        assert_bytes(&s, i).await;
    }
}

#[derive(Debug, Clone)]
enum Op {
    Store(u64),
    Lookup(u64),
    Pin(u64),
    Unpin(usize),
    Offload(u64),
    Get(u64),
    Remove(u64),
    Restart,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (0u64..24).prop_map(Op::Store),
        2 => (0u64..24).prop_map(Op::Lookup),
        2 => (0u64..24).prop_map(Op::Pin),
        2 => any::<usize>().prop_map(Op::Unpin),
        1 => (0u64..24).prop_map(Op::Offload),
        3 => (0u64..24).prop_map(Op::Get),
        1 => (0u64..24).prop_map(Op::Remove),
        1 => Just(Op::Restart),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Random sequences of store, lookup, pin, unpin, offload, onboard (get), remove and
    /// restart: every block served has the bytes stored under its hash, a pinned block stays
    /// readable and correct however hard the store is pushed, and capacity is never exceeded.
    #[test]
    fn random_operations_never_serve_wrong_bytes(ops in proptest::collection::vec(op(), 1..60)) {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        rt.block_on(async move {
            let dir = tempfile::tempdir().unwrap();
            let a = agent().await;
            let (mut s, _) = open(&a, 3, Some(disk(dir.path(), 6)), 0).await;
            let mut pins: Vec<kvfabric_tiers::BlockRef> = Vec::new();
            let mut stored: HashMap<u64, ()> = HashMap::new();
            for o in ops {
                match o {
                    Op::Store(i) => match s.put(h(i), None, &content(h(i), BLOCK)).await {
                        Ok(()) => { stored.insert(i, ()); }
                        // BeingWritten: a background prefetch is bringing the block in right now.
                        Err(StoreError::AlreadyStored(_) | StoreError::BeingWritten(_) | StoreError::Full(_)) => {}
                        Err(e) => panic!("store {i}: {e}"),
                    },
                    Op::Lookup(i) => { let _ = s.lookup_prefix(&[h(i)]); }
                    Op::Pin(i) => if let Ok(mut r) = s.get(&[h(i)]).await { pins.append(&mut r) },
                    Op::Unpin(k) => if !pins.is_empty() { pins.swap_remove(k % pins.len()); },
                    Op::Offload(i) => { let _ = s.offload(&[h(i)]).await; }
                    Op::Get(i) => {
                        for r in s.get(&[h(i)]).await.unwrap_or_default() {
                            assert!(r.to_vec() == content(r.hash(), BLOCK), "wrong bytes for {i}");
                        }
                    }
                    Op::Remove(i) => { s.remove(h(i)).await; }
                    Op::Restart => {
                        pins.clear();
                        drop(s);
                        s = open(&a, 3, Some(disk(dir.path(), 6)), 0).await.0;
                    }
                }
                for r in &pins {
                    assert!(r.to_vec() == content(r.hash(), BLOCK), "a pinned block changed");
                }
                let m = s.metrics();
                assert!(m.host_used_blocks <= m.host_capacity_blocks);
                assert!(m.disk_used_blocks <= m.disk_capacity_blocks);
            }
        });
    }
}

/// A prompt's blocks come back from disk in one `get` with one block already in host memory
/// among them: every byte right, and a corrupt block ends what is served, is dropped, and
/// spares the blocks behind it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_mixing_host_and_disk_blocks_comes_back_byte_for_byte() {
    let dir = tempfile::tempdir().unwrap();
    let a = agent().await;
    let (slot9, _) = {
        let (s, _) = open(&a, 4, Some(disk(dir.path(), 64)), 0).await;
        for i in 0..14 {
            put(&s, i).await;
        }
        let all: Vec<_> = (0..14).map(h).collect();
        s.offload(&all).await.unwrap();
        let d = s.disk().unwrap();
        let slots: Vec<u32> = (0..14).map(|i| d.slot_of(h(i)).unwrap()).collect();
        assert!(slots.windows(2).filter(|w| w[1] == w[0] + 1).count() >= 10, "{slots:?}");
        (d.data_offset(slots[9]), ())
    };
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new().write(true).open(dir.path().join("g3.slots")).unwrap();
        f.write_at(&[0xee; 32], slot9 + 500).unwrap();
    }
    // A restarted store: every block on disk only.
    let (s, _) = open(&a, 16, Some(disk(dir.path(), 64)), 0).await;
    // Block 4 in host memory first.
    assert_bytes(&s, 4).await;
    let hashes: Vec<_> = (0..14).map(h).collect();
    let refs = s.get(&hashes).await.unwrap();
    assert_eq!(refs.len(), 9, "the leading run stops at the corrupt block 9");
    for (i, r) in refs.iter().enumerate() {
        assert!(r.to_vec() == content(h(i as u64), BLOCK), "block {i} bytes");
    }
    drop(refs);
    assert_eq!(s.metrics().disk_corrupt_blocks, 1);
    assert!(!s.disk().unwrap().has(h(9)));
    for i in 10..14 {
        assert_bytes(&s, i).await;
    }
}

/// A store with a remote tier (G4) but no disk, before any fabric node is known (serving
/// workers have one by default): a full host tier still evicts, dropping the block as a
/// store without G4 does, instead of refusing every new block.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remote_tier_with_no_node_yet_does_not_stop_evictions() {
    let a = agent().await;
    let mut cfg = StoreConfig::new(BLOCK, 4);
    cfg.shared_host = false;
    // Every evicted block is admitted to the lower tiers, as in serving workers.
    cfg.disk_admit_min_hits = 0;
    cfg.remote =
        Some(kvfabric_tiers::remote::RemoteTier::new(a.clone(), std::time::Duration::from_secs(1)));
    let s = TieredStore::open(cfg, &a, RecordingSink::new()).await.unwrap();
    for i in 0..12 {
        put(&s, i).await;
    }
    for i in 8..12 {
        assert_bytes(&s, i).await;
    }
    assert!(s.get(&[h(0)]).await.unwrap().is_empty(), "evicted, nowhere to go");
}
