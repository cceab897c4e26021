//! Many threads ingesting and querying one index at once.
//!
//! Writers only add blocks (each worker stores its own chain, block by block, in order), so
//! every worker's overlap with its chain can only grow: each reader checks that the answers it
//! sees never shrink and never exceed what was written, and at the end every answer is exact.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use kvfabric::events::{KvEvent, KvEventData, TierKind};
use kvfabric::hash::{HashSeed, SequenceHash, TokenBlockHasher};
use kvfabric_router::PrefixIndex;

const WORKERS: u64 = 8;
const BLOCKS: usize = 2000;

fn chain(w: u64) -> Vec<SequenceHash> {
    // Workers share the first 100 blocks (a common system prompt), then diverge.
    let tokens: Vec<u32> =
        (0..BLOCKS as u32 * 16).map(|i| if i < 1600 { i } else { i * 7 + w as u32 }).collect();
    TokenBlockHasher::new(16, HashSeed::DEFAULT).unwrap().sequence_hashes(&tokens)
}

#[test]
fn concurrent_ingest_and_query_give_consistent_answers() {
    let ix = Arc::new(PrefixIndex::new());
    for w in 0..WORKERS {
        ix.add_worker(w);
    }
    let chains: Arc<Vec<Vec<SequenceHash>>> = Arc::new((0..WORKERS).map(chain).collect());
    let done = Arc::new(AtomicBool::new(false));
    std::thread::scope(|s| {
        for w in 0..WORKERS {
            let (ix, chains) = (ix.clone(), chains.clone());
            s.spawn(move || {
                for (i, &h) in chains[w as usize].iter().enumerate() {
                    let e = KvEvent {
                        event_id: i as u64 + 1,
                        data: KvEventData::Stored {
                            sequence_hashes: vec![h],
                            parent: None,
                            tier: TierKind::Host,
                        },
                    };
                    assert_eq!(ix.ingest(w, &e), kvfabric_router::Ingest::Applied);
                }
            });
        }
        for r in 0..4u64 {
            let (ix, chains, done) = (ix.clone(), chains.clone(), done.clone());
            s.spawn(move || {
                let mut seen = vec![0usize; WORKERS as usize];
                let mut rounds = 0;
                while !done.load(Ordering::Acquire) || rounds < 3 {
                    rounds += 1;
                    for w in 0..WORKERS {
                        let q = &chains[((w + r) % WORKERS) as usize];
                        let o = ix.overlap(q);
                        for (worker, run) in &o.workers {
                            let idx = *worker as usize;
                            let n = run.blocks as usize;
                            assert!(n <= BLOCKS);
                            assert_eq!(run.per_tier[1] as usize, n, "all in host memory");
                            if *worker == (w + r) % WORKERS {
                                assert!(n >= seen[idx], "overlap shrank");
                                seen[idx] = n;
                            } else {
                                assert!(n <= 100, "other workers share only the system prompt");
                            }
                        }
                    }
                }
            });
        }
        // Let the writers finish, then release the readers.
        loop {
            if (0..WORKERS).all(|w| ix.worker_blocks(w) == BLOCKS) {
                done.store(true, Ordering::Release);
                break;
            }
            std::thread::yield_now();
        }
    });
    for w in 0..WORKERS {
        let o = ix.overlap(&chains[w as usize]);
        assert_eq!(o.blocks(w), BLOCKS);
        for other in (0..WORKERS).filter(|&x| x != w) {
            assert_eq!(o.blocks(other), 100);
        }
    }
}

/// The router fed from the (embedded) control plane: events on the bus and membership from
/// discovery reach the index; a node that leaves discovery leaves routing; a dump resets a
/// source.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fed_from_the_control_plane() {
    use kvfabric::control::memory::{MemoryBus, MemoryDiscovery};
    use kvfabric::control::{Discovery, EventBus, Instance};
    use kvfabric_router::service::{feed_from_control_plane, worker_id, RouterService};
    use kvfabric_router::{Router, RouterConfig};
    use std::time::Duration;
    use tokio::sync::mpsc;

    let bus = Arc::new(MemoryBus::new());
    let discovery = Arc::new(MemoryDiscovery::new());
    let inst = |id: &str| Instance {
        kind: "worker".into(),
        id: id.into(),
        metadata: serde_json::json!({}),
    };
    let reg_a = discovery.register(inst("w-a"), Duration::from_secs(5)).await.unwrap();
    let (etx, erx) = mpsc::channel(64);
    let (mtx, mrx) = mpsc::channel(64);
    let (ntx, _nrx) = mpsc::channel(8);
    let svc = RouterService::spawn(Router::new(RouterConfig::default()), erx, mrx, ntx);
    let _feed = feed_from_control_plane(
        bus.clone(),
        discovery.clone(),
        "kv-events",
        "worker",
        svc.index.clone(),
        etx,
        mtx,
    )
    .await
    .unwrap();
    let reg_b = discovery.register(inst("w-b"), Duration::from_secs(5)).await.unwrap();
    let stored = |id: u64, h: u64| {
        serde_json::json!({ "source": "w-a", "event": KvEvent { event_id: id, data: KvEventData::Stored {
            sequence_hashes: vec![SequenceHash(h)], parent: None, tier: TierKind::Host } } })
    };
    bus.publish("kv-events", stored(1, 500).to_string().into_bytes()).await.unwrap();
    for _ in 0..200 {
        if svc.index.overlap(&[SequenceHash(500)]).blocks(worker_id("w-a")) == 1
            && svc.router.lock().workers().len() == 2
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(svc.index.overlap(&[SequenceHash(500)]).blocks(worker_id("w-a")), 1);
    assert_eq!(svc.router.lock().workers().len(), 2);
    // A dump replaces w-a's blocks.
    let dump = serde_json::json!({ "source": "w-a", "dump": [{ "tier": "disk", "hash": 600, "parent": null }], "last_event_id": 9 });
    bus.publish("kv-events", dump.to_string().into_bytes()).await.unwrap();
    for _ in 0..200 {
        if svc.index.overlap(&[SequenceHash(600)]).blocks(worker_id("w-a")) == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        svc.index.overlap(&[SequenceHash(600)]).run(worker_id("w-a")).per_tier[2],
        1,
        "on disk"
    );
    assert_eq!(svc.index.overlap(&[SequenceHash(500)]).blocks(worker_id("w-a")), 0);
    // w-b leaves discovery: it leaves routing.
    reg_b.revoke().await;
    for _ in 0..200 {
        if svc.router.lock().workers().len() == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(svc.router.lock().workers(), &[worker_id("w-a")]);
    drop(reg_a);
}
