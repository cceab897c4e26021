//! Many threads ingesting and querying one index at once.
//!
//! Writers only add blocks (each worker stores its own chain, block by block, in order), so
//! every worker's overlap with its chain can only grow: each reader checks that the answers it
//! sees never shrink and never exceed what was written, and at the end every answer is exact.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use kvfabric::events::{KvEvent, KvEventData, TierKind};
use kvfabric::hash::{HashSeed, SequenceHash, TokenBlockHasher};
use kvfabric_router::{PrefixIndex, WorkerId};

const WORKERS: u64 = 8;
const BLOCKS: usize = 2000;

fn chain(w: u64) -> Vec<SequenceHash> {
    // Workers share the first 100 blocks (a common system prompt), then diverge.
    let tokens: Vec<u32> =
        (0..BLOCKS as u32 * 16).map(|i| if i < 1600 { i } else { i * 7 + w as u32 }).collect();
    TokenBlockHasher::new(kvfabric::units::BlockTokens::of(16), HashSeed::DEFAULT)
        .sequence_hashes(&tokens)
}

#[test]
fn concurrent_ingest_and_query_give_consistent_answers() {
    let ix = Arc::new(PrefixIndex::new());
    for w in 0..WORKERS {
        ix.add_worker(WorkerId(w));
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
                    assert_eq!(ix.ingest(WorkerId(w), &e), kvfabric_router::Ingest::Applied);
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
                            let idx = worker.0 as usize;
                            let n = run.blocks as usize;
                            assert!(n <= BLOCKS);
                            assert_eq!(run.per_tier[1] as usize, n, "all in host memory");
                            if *worker == WorkerId((w + r) % WORKERS) {
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
            if (0..WORKERS).all(|w| ix.worker_blocks(WorkerId(w)) == BLOCKS) {
                done.store(true, Ordering::Release);
                break;
            }
            std::thread::yield_now();
        }
    });
    for w in 0..WORKERS {
        let o = ix.overlap(&chains[w as usize]);
        assert_eq!(o.blocks(WorkerId(w)), BLOCKS);
        for other in (0..WORKERS).filter(|&x| x != w) {
            assert_eq!(o.blocks(WorkerId(other)), 100);
        }
    }
}
