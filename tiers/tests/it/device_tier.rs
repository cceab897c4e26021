//! G1, the device tier, with host memory standing in for GPU memory (this machine has no
//! GPU): G1 slot accounting, eviction down to host memory and onboarding back up, pins, the
//! KV events of every move, and the bytes after each copy. The copies between G1 and G2 are
//! local transfers of the store's agent: here the local transport's memcpy; with G1 in GPU
//! memory the cuda transport's D2H and H2D, which only the GPU test (`gpu-check.sh`) proves.

use std::sync::Arc;

use kvfabric::agent::{Agent, AgentConfig};
use kvfabric::events::{KvEvent, KvEventData, RecordingSink, TierKind};
use kvfabric::hash::SequenceHash;
use kvfabric::memory::{Region, RegionOptions};
use kvfabric_tiers::disk::DiskConfig;
use kvfabric_tiers::store::{DeviceSlots, DeviceTierConfig};
use kvfabric_tiers::{StoreConfig, StoreError, TieredStore};

const BLOCK: u64 = 8192;

fn h(i: u64) -> SequenceHash {
    SequenceHash(0xd000 + i)
}

fn content(i: u64) -> Vec<u8> {
    (0..BLOCK).map(|j| ((j * 7 + i * 131) % 251) as u8).collect()
}

async fn store(
    device_blocks: u32,
    host_blocks: u32,
    disk_dir: Option<&std::path::Path>,
) -> (TieredStore, Arc<Region>, Arc<RecordingSink>, Agent) {
    let agent = Agent::start(AgentConfig::new("g1-test", b"g1".to_vec())).await.unwrap();
    // Host memory standing in for the GPU's.
    let g1 = agent
        .alloc_region((device_blocks as u64 * BLOCK) as usize, RegionOptions::default())
        .unwrap();
    let sink = RecordingSink::new();
    let mut cfg = StoreConfig::new(BLOCK, host_blocks);
    cfg.shared_host = false;
    cfg.disk_admit_min_hits = 0;
    cfg.device =
        Some(DeviceTierConfig { blocks: device_blocks, slots: DeviceSlots::Region(g1.clone()) });
    if let Some(dir) = disk_dir {
        let mut d = DiskConfig::new(dir.join("g3.slots"), 64);
        d.grow_blocks = 8;
        cfg.disk = Some(d);
    }
    let s = TieredStore::open(cfg, &agent, sink.clone()).await.unwrap();
    (s, g1, sink, agent)
}

/// The engine writes block `i` into a new G1 slot (here with a host write; on a GPU, a kernel).
async fn put_device(s: &TieredStore, g1: &Region, i: u64) {
    let w = s.allocate_device(h(i), i.checked_sub(1).map(h)).await.unwrap();
    g1.write_at(w.offset(), &content(i)).unwrap();
    drop(w.commit());
}

fn moves(events: &[KvEvent]) -> Vec<(char, TierKind, u64)> {
    events
        .iter()
        .flat_map(|e| match &e.data {
            KvEventData::Stored { sequence_hashes, tier, .. } => {
                sequence_hashes.iter().map(|x| ('+', *tier, x.0 - 0xd000)).collect::<Vec<_>>()
            }
            KvEventData::Removed { sequence_hashes, tier } => {
                sequence_hashes.iter().map(|x| ('-', *tier, x.0 - 0xd000)).collect()
            }
            KvEventData::Cleared => vec![],
        })
        .collect()
}

/// The blocks of each `Removed{device}` event, in order: one list per eviction round.
fn removed_from_g1(events: &[KvEvent]) -> Vec<Vec<u64>> {
    events
        .iter()
        .filter_map(|e| match &e.data {
            KvEventData::Removed { sequence_hashes, tier: TierKind::Device } => {
                Some(sequence_hashes.iter().map(|x| x.0 - 0xd000).collect())
            }
            _ => None,
        })
        .collect()
}

#[tokio::test]
async fn a_full_device_tier_moves_its_oldest_blocks_to_host_memory_byte_for_byte() {
    let (s, g1, sink, _a) = store(4, 16, None).await;
    for i in 0..6 {
        put_device(&s, &g1, i).await;
    }
    assert_eq!(s.device_occupancy(), (4, 4));
    // Blocks 0 and 1 (least recently used) went down to host memory, in order.
    let ev = moves(&sink.take());
    let want: Vec<(char, TierKind, u64)> = vec![
        ('+', TierKind::Device, 0),
        ('+', TierKind::Device, 1),
        ('+', TierKind::Device, 2),
        ('+', TierKind::Device, 3),
        ('+', TierKind::Host, 0),
        ('-', TierKind::Device, 0),
        ('+', TierKind::Device, 4),
        ('+', TierKind::Host, 1),
        ('-', TierKind::Device, 1),
        ('+', TierKind::Device, 5),
    ];
    assert_eq!(ev, want);
    let tiers = s.lookup_prefix(&(0..7).map(h).collect::<Vec<_>>());
    assert_eq!(
        tiers,
        vec![
            TierKind::Host,
            TierKind::Host,
            TierKind::Device,
            TierKind::Device,
            TierKind::Device,
            TierKind::Device
        ]
    );
    // What went down is the bytes the engine wrote.
    let host = s.get(&[h(0), h(1)]).await.unwrap();
    for (i, r) in host.iter().enumerate() {
        let mut got = vec![0u8; BLOCK as usize];
        r.region().read_at(r.offset(), &mut got).unwrap();
        assert_eq!(got, content(i as u64), "block {i} in host memory");
    }
}

#[tokio::test]
async fn get_device_brings_a_prefix_up_from_host_and_disk_and_pins_it() {
    let dir = tempfile::tempdir().unwrap();
    let (s, g1, sink, _a) = store(4, 8, Some(dir.path())).await;
    // Fourteen blocks through a 4-slot G1 and an 8-slot G2: 10..13 in G1, 2..9 in host
    // memory, 0 and 1 on disk.
    for i in 0..14 {
        put_device(&s, &g1, i).await;
    }
    let _ = sink.take();
    let prefix: Vec<SequenceHash> = (0..3).map(h).collect();
    assert_eq!(s.lookup_prefix(&prefix), vec![TierKind::Disk, TierKind::Disk, TierKind::Host]);
    let refs = s.get_device(&prefix).await.unwrap();
    assert_eq!(refs.len(), 3);
    for (i, r) in refs.iter().enumerate() {
        assert_eq!(r.hash(), h(i as u64));
        let mut got = vec![0u8; BLOCK as usize];
        r.region().read_at(r.offset(), &mut got).unwrap();
        assert_eq!(got, content(i as u64), "block {i} after coming up to G1");
    }
    let ups: Vec<_> =
        moves(&sink.take()).into_iter().filter(|m| m.0 == '+' && m.1 == TierKind::Device).collect();
    assert_eq!(
        ups,
        vec![('+', TierKind::Device, 0), ('+', TierKind::Device, 1), ('+', TierKind::Device, 2)]
    );
    assert_eq!(s.lookup_prefix(&prefix), vec![TierKind::Device; 3]);
    // Pinned: a fourth block may take the one free slot, a fifth finds G1 full of pins.
    put_device(&s, &g1, 100).await;
    let w = s.allocate_device(h(101), None).await;
    assert!(w.is_ok(), "block 100 is unpinned and can go down");
    drop(w);
    drop(refs);
    // Unpinned, they can go down again.
    for i in 200..204 {
        put_device(&s, &g1, i).await;
    }
    assert_eq!(s.device_occupancy(), (4, 4));
}

/// A run brought up into a full G1 moves as many least recently used blocks down as it
/// needs, in one round (one `Removed{device}` event, one D2H transfer), and comes up in one
/// transfer; every byte on both sides survives.
#[tokio::test]
async fn a_run_brought_up_into_a_full_g1_moves_the_victims_it_needs_down_in_one_round() {
    let (s, g1, sink, _a) = store(4, 16, None).await;
    for i in 0..8 {
        put_device(&s, &g1, i).await;
    }
    // G1 holds 4..7 (4 oldest), host memory 0..3.
    let _ = sink.take();
    let run: Vec<SequenceHash> = (0..3).map(h).collect();
    assert_eq!(s.lookup_prefix(&run), vec![TierKind::Host; 3]);
    let refs = s.get_device(&run).await.unwrap();
    assert_eq!(refs.iter().map(|r| r.hash()).collect::<Vec<_>>(), run);
    for (i, r) in refs.iter().enumerate() {
        let mut got = vec![0u8; BLOCK as usize];
        r.region().read_at(r.offset(), &mut got).unwrap();
        assert_eq!(got, content(i as u64), "block {i} in G1");
    }
    let events = sink.take();
    let removed = removed_from_g1(&events);
    assert_eq!(removed, vec![vec![4, 5, 6]], "three victims, least recently used first, one round");
    let mut m = moves(&events);
    m.sort();
    let mut want =
        vec![('+', TierKind::Host, 4), ('+', TierKind::Host, 5), ('+', TierKind::Host, 6)];
    want.extend((0..3).map(|i| ('+', TierKind::Device, i)));
    want.extend((4..7).map(|i| ('-', TierKind::Device, i)));
    want.sort();
    assert_eq!(m, want);
    // The victims are in host memory, byte for byte; block 7 stayed in G1.
    for i in 4..7 {
        let b = s.get(&[h(i)]).await.unwrap();
        assert_eq!(b[0].bytes(), &content(i)[..], "block {i} after going down");
    }
    assert_eq!(s.lookup_prefix(&[h(7)]), vec![TierKind::Device]);
    assert_eq!(s.device_occupancy(), (4, 4));
}

/// Under pressure a larger G1 frees slots ahead of need: one round moves a sixteenth of it
/// (here 4 of 64) down in one transfer, and the next allocations find free slots.
#[tokio::test]
async fn a_full_g1_frees_slots_ahead_a_batch_per_round() {
    let (s, g1, sink, _a) = store(64, 128, None).await;
    for i in 0..64 {
        put_device(&s, &g1, i).await;
    }
    let _ = sink.take();
    put_device(&s, &g1, 64).await;
    let removed = removed_from_g1(&sink.take());
    assert_eq!(removed, vec![vec![0, 1, 2, 3]], "the four oldest, in one round");
    assert_eq!(s.device_occupancy(), (61, 64));
    // Three more fit without moving anything.
    for i in 65..68 {
        put_device(&s, &g1, i).await;
    }
    assert!(moves(&sink.take()).iter().all(|m| m.0 == '+'), "nothing went down");
    // Every block moved down is whole in host memory.
    for i in 0..4 {
        let b = s.get(&[h(i)]).await.unwrap();
        assert_eq!(b[0].bytes(), &content(i)[..], "block {i}");
    }
}

/// Many writers at once on a full G1: one frees a batch ahead, the others wait for its round
/// instead of each moving a block down; every one finishes, and every block is whole in
/// some tier.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_writers_on_a_full_g1_all_finish_and_lose_nothing() {
    let (s, g1, _sink, _a) = store(64, 256, None).await;
    for i in 0..64 {
        put_device(&s, &g1, i).await;
    }
    let writers: Vec<_> = (64..192)
        .map(|i| {
            let (s, g1) = (s.clone(), g1.clone());
            tokio::spawn(async move {
                let w = s.allocate_device(h(i), None).await.unwrap();
                g1.write_at(w.offset(), &content(i)).unwrap();
                drop(w.commit());
            })
        })
        .collect();
    let all = futures_util::future::join_all(writers);
    for r in tokio::time::timeout(std::time::Duration::from_secs(30), all).await.expect("stalled") {
        r.unwrap();
    }
    assert!(s.device_occupancy().0 <= 64);
    for i in 0..192 {
        let tiers = s.lookup_prefix(&[h(i)]);
        assert_eq!(tiers.len(), 1, "block {i} lost");
        let got = match tiers[0] {
            TierKind::Device => {
                let r = s.get_device(&[h(i)]).await.unwrap();
                let mut got = vec![0u8; BLOCK as usize];
                r[0].region().read_at(r[0].offset(), &mut got).unwrap();
                got
            }
            _ => s.get(&[h(i)]).await.unwrap()[0].bytes().to_vec(),
        };
        assert_eq!(got, content(i), "block {i}");
    }
}

#[tokio::test]
async fn a_device_tier_of_pinned_blocks_is_full_typed_and_nothing_is_lost() {
    let (s, g1, _sink, _a) = store(2, 8, None).await;
    let w0 = s.allocate_device(h(0), None).await.unwrap();
    g1.write_at(w0.offset(), &content(0)).unwrap();
    let p0 = w0.commit();
    let w1 = s.allocate_device(h(1), Some(h(0))).await.unwrap();
    g1.write_at(w1.offset(), &content(1)).unwrap();
    let p1 = w1.commit();
    match s.allocate_device(h(2), Some(h(1))).await {
        Err(StoreError::Full(TierKind::Device)) => {}
        other => panic!("{other:?}"),
    }
    // A write abandoned before commit frees its slot, and its block is never visible.
    drop(p1);
    let w = s.allocate_device(h(3), None).await.unwrap();
    drop(w);
    assert_eq!(s.lookup_prefix(&[h(3)]), vec![]);
    assert_eq!(s.lookup_prefix(&[h(0), h(1)]), vec![TierKind::Device, TierKind::Host]);
    // A block already in G1 is not stored twice.
    assert!(matches!(s.allocate_device(h(0), None).await, Err(StoreError::AlreadyStored(_))));
    drop(p0);
    // remove() and clear() reach G1 too.
    assert!(s.remove(h(0)).await);
    assert_eq!(s.lookup_prefix(&[h(0)]), vec![]);
    s.clear().await.unwrap();
    assert_eq!(s.device_occupancy().0, 0);
}

#[tokio::test]
async fn a_device_region_too_small_for_its_blocks_is_refused() {
    let agent = Agent::start(AgentConfig::new("g1-small", b"g1".to_vec())).await.unwrap();
    let g1 = agent.alloc_region(BLOCK as usize, RegionOptions::default()).unwrap();
    let mut cfg = StoreConfig::new(BLOCK, 4);
    cfg.shared_host = false;
    cfg.device = Some(DeviceTierConfig { blocks: 2, slots: DeviceSlots::Region(g1) });
    match TieredStore::open(cfg, &agent, RecordingSink::new()).await {
        Err(StoreError::Invalid(m)) => assert!(m.contains("device region holds"), "{m}"),
        other => panic!("{other:?}"),
    }
}

/// The same moves with G1 in GPU memory the store allocates: blocks written into G1 slots
/// (H2D from a host staging region, as an engine's kernel would write them), moved down to
/// host memory by D2H when G1 is full, and brought back up by H2D, byte for byte.
#[tokio::test]
#[ignore = "needs an NVIDIA GPU and driver: scripts/gpu-check.sh runs it"]
async fn with_g1_in_gpu_memory_blocks_go_down_and_come_back_byte_for_byte() {
    use kvfabric::transfer::{Desc, TransferOp, TransferRequest};
    let agent = Agent::start(AgentConfig::new("g1-gpu", b"g1".to_vec())).await.unwrap();
    let sink = RecordingSink::new();
    let mut cfg = StoreConfig::new(BLOCK, 16);
    cfg.shared_host = false;
    cfg.device = Some(DeviceTierConfig { blocks: 4, slots: DeviceSlots::Allocate { ordinal: 0 } });
    let s = TieredStore::open(cfg, &agent, sink.clone()).await.unwrap();
    let staging = agent.alloc_region(BLOCK as usize, RegionOptions::default()).unwrap();
    let copy = |src: &Region, so: u64, dst: &Region, dof: u64| {
        let req = TransferRequest::new(
            TransferOp::Write,
            "g1-gpu",
            vec![Desc::new(src.id(), so, BLOCK)],
            vec![Desc::new(dst.id(), dof, BLOCK)],
        );
        let h = agent.post(req);
        async move { h.unwrap().wait().await.unwrap() }
    };
    for i in 0..8 {
        let w = s.allocate_device(h(i), i.checked_sub(1).map(h)).await.unwrap();
        assert!(matches!(w.region().kind(), kvfabric::memory::MemoryKind::Device(0)));
        staging.write_at(0, &content(i)).unwrap();
        copy(&staging, 0, w.region(), w.offset()).await;
        drop(w.commit());
    }
    assert_eq!(s.lookup_prefix(&[h(0), h(4)]), vec![TierKind::Host, TierKind::Device]);
    let refs = s.get_device(&(0..4).map(h).collect::<Vec<_>>()).await.unwrap();
    assert_eq!(refs.len(), 4);
    for (i, r) in refs.iter().enumerate() {
        copy(r.region(), r.offset(), &staging, 0).await;
        let mut got = vec![0u8; BLOCK as usize];
        staging.read_at(0, &mut got).unwrap();
        assert_eq!(got, content(i as u64), "block {i} after G1 -> G2 -> G1");
    }
}
