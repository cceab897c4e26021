//! vLLM's and SGLang's KV events, end to end: payloads captured from a real vLLM 0.32 and
//! golden payloads that msgspec encoded from the engines' own struct declarations decode and
//! map to kvfabric's hashes; a publisher process that is the engines' `ZmqEventPublisher`
//! (msgspec + pyzmq, `tests/engines/kv_events.py`) feeds the subscriber, and the prefix
//! index ends up with exactly the blocks the events describe — across a gap that replay
//! fills and a gap that it cannot.
//!
//! The publisher needs Python with msgspec and pyzmq: `KVFABRIC_TEST_PYTHON`, as
//! `scripts/test.sh` sets it (`scripts/setup.sh test` creates the environment).

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use kvfabric::events::{KvEvent, KvEventData, TierKind};
use kvfabric::hash::{HashSeed, SequenceHash, TokenBlockHasher};
use kvfabric_attach::engine::decode::{Medium, Stored};
use kvfabric_attach::engine::{
    decode_batch, EngineEvent, EngineHash, EngineMirror, EventsEndpoint, FeedItem, Flavor,
    Subscriber, SubscriberConfig,
};
use kvfabric_router::{PrefixIndex, WorkerId};
use serde_json::{json, Value};

fn data(rel: &str) -> PathBuf {
    std::path::PathBuf::from(
        std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_else(|| env!("CARGO_MANIFEST_DIR").into()),
    )
    .join("tests/data")
    .join(rel)
}

/// The payload frame of a captured message (`frameN len=L: HEX` lines).
fn capture(rel: &str) -> (u64, Vec<u8>) {
    let text = std::fs::read_to_string(data(rel)).unwrap();
    let frames: Vec<Vec<u8>> =
        text.lines().filter_map(|l| l.split_once(": ").map(|(_, h)| hex(h.trim()))).collect();
    assert_eq!(frames.len(), 3, "{rel}: [topic, seq, payload]");
    (u64::from_be_bytes(frames[1].as_slice().try_into().unwrap()), frames[2].clone())
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

#[test]
fn captures_of_a_real_vllm_decode_and_chain_without_orphans() {
    let mut mirror = EngineMirror::new(kvfabric::units::BlockTokens::of(128));
    let mut out = Vec::new();
    let mut stored = 0;
    for i in 0..5 {
        let (seq, payload) = capture(&format!("vllm-0.32/msg0{i}.hex"));
        assert_eq!(seq, i);
        let batch = decode_batch(&payload, Flavor::Vllm).unwrap();
        assert_eq!(batch.rank, Some(0));
        for ev in &batch.events {
            let EngineEvent::Stored(s) = ev else { panic!("{ev:?}") };
            assert_eq!(s.tokens.len(), s.hashes.len() * 128);
            assert_eq!(s.medium, Some(Medium::Tier(TierKind::Device)));
            assert!(matches!(s.hashes[0], EngineHash::Int(_)));
            stored += s.hashes.len();
        }
        mirror.apply(&batch, &mut out);
    }
    let st = mirror.stats();
    assert_eq!((st.stored as usize, st.orphans, st.invalid), (stored, 0, 0), "{st:?}");
    assert_eq!(mirror.len(), stored);
    // Children continue their parents' kvfabric hashes: msg02's blocks extend msg01's chain.
    let chains: Vec<(&Vec<SequenceHash>, &Option<SequenceHash>)> = out
        .iter()
        .map(|e| match e {
            KvEventData::Stored { sequence_hashes, parent, .. } => (sequence_hashes, parent),
            _ => panic!(),
        })
        .collect();
    assert_eq!(chains[2].1.as_ref(), chains[1].0.last(), "msg02 is msg01's child");

    // Evictions and a clear.
    let mut mirror = EngineMirror::new(kvfabric::units::BlockTokens::of(128));
    let (mut stored, mut removed) = (0u64, 0u64);
    for i in 0..6 {
        let (_, payload) = capture(&format!("vllm-0.32/evict-clear/msg0{i}.hex"));
        let batch = decode_batch(&payload, Flavor::Vllm).unwrap();
        for ev in &batch.events {
            match ev {
                EngineEvent::Stored(s) => stored += s.hashes.len() as u64,
                EngineEvent::Removed(r) => removed += r.hashes.len() as u64,
                EngineEvent::Cleared => {
                    stored = 0;
                    removed = 0;
                }
                EngineEvent::Unknown => panic!(),
            }
        }
        mirror.apply(&batch, &mut Vec::new());
    }
    let st = mirror.stats();
    assert_eq!((st.cleared, st.unknown_removed, st.orphans), (1, 0, 0), "{st:?}");
    assert_eq!(mirror.len() as u64, stored - removed);

    // Hashes as 32-byte binaries.
    let (_, payload) = capture("vllm-0.32/bytes-hash/msg00.hex");
    let batch = decode_batch(&payload, Flavor::Vllm).unwrap();
    let EngineEvent::Stored(s) = &batch.events[0] else { panic!() };
    assert!(s.hashes.iter().all(|h| matches!(h, EngineHash::Bytes(_))));
}

#[test]
fn golden_payloads_of_every_layout_decode_alike() {
    for (name, flavor, rank) in [
        ("vllm", Flavor::Vllm, Some(1)),
        ("vllm-map", Flavor::Vllm, Some(1)),
        ("vllm-legacy", Flavor::Vllm, None),
        ("sglang", Flavor::Sglang, Some(1)),
    ] {
        let bytes =
            hex(std::fs::read_to_string(data(&format!("golden/{name}.hex"))).unwrap().trim());
        let b = decode_batch(&bytes, flavor).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!((b.ts, b.rank), (1.5, rank), "{name}");
        assert_eq!(b.events.len(), 4, "{name}");
        let EngineEvent::Stored(s) = &b.events[0] else { panic!("{name}") };
        // SGLang's signed -5 and vLLM's unsigned 2^64-5 are the same 64 bits.
        assert_eq!(s.hashes, [EngineHash::Int(u64::MAX - 4), EngineHash::Int(7)], "{name}");
        assert_eq!((s.parent, s.block_size, s.tokens.len()), (None, 16, 32), "{name}");
        assert_eq!(s.medium, Some(Medium::Tier(TierKind::Device)), "{name}");
        assert!(!s.lora && !s.unkeyable, "{name}");
        let EngineEvent::Stored(Stored { parent, medium, .. }) = &b.events[1] else { panic!() };
        assert_eq!(*parent, Some(EngineHash::Int(7)), "{name}");
        assert_eq!(*medium, Some(Medium::Tier(TierKind::Host)), "{name}");
        let EngineEvent::Removed(r) = &b.events[2] else { panic!("{name}") };
        assert_eq!(
            (r.hashes.as_slice(), r.medium),
            (&[EngineHash::Int(9)][..], Some(Medium::Tier(TierKind::Host)))
        );
        assert_eq!(b.events[3], EngineEvent::Cleared, "{name}");
    }
}

struct Publisher {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    pub_endpoint: String,
    replay: String,
}

impl Drop for Publisher {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Publisher {
    fn start(flavor: &str) -> Publisher {
        let script = std::path::PathBuf::from(
            std::env::var_os("CARGO_MANIFEST_DIR")
                .unwrap_or_else(|| env!("CARGO_MANIFEST_DIR").into()),
        )
        .join("tests/engines/kv_events.py");
        let mut child = Command::new(kvfabric::testkit::engine_python())
            .arg(script)
            .args(["--flavor", flavor])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        let v: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"));
        Publisher {
            child,
            stdin,
            stdout,
            pub_endpoint: v["pub"].as_str().unwrap().into(),
            replay: v["replay"].as_str().unwrap().into(),
        }
    }

    fn cmd(&mut self, c: Value) -> Value {
        writeln!(self.stdin, "{c}").unwrap();
        self.stdin.flush().unwrap();
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        serde_json::from_str(&line).unwrap()
    }

    /// Publishes a chain of blocks of `tokens` (16 per block) with engine hashes `hashes`.
    fn store(&mut self, hashes: &[u64], parent: Option<u64>, tokens: &[u32], send: bool) -> u64 {
        let ev = json!({
            "type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens, "block_size": 16, "medium": "GPU",
        });
        self.cmd(json!({ "cmd": "publish", "events": [ev], "send": send }))["seq"].as_u64().unwrap()
    }
}

/// The subscriber, the mirror and the index, as `kvfabric attach` and a router chain them.
struct Follower {
    sub: Subscriber,
    mirror: EngineMirror,
    flavor: Flavor,
    index: PrefixIndex,
    next_id: u64,
    resets: usize,
    last_seq: Option<u64>,
}

const W: WorkerId = WorkerId(42);

impl Follower {
    async fn pump_until(&mut self, what: &str, mut done: impl FnMut(&Follower) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(15);
        while !done(self) {
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(!left.is_zero(), "timed out waiting for {what}");
            let Ok(Some(item)) = tokio::time::timeout(left, self.sub.recv()).await else {
                panic!("timed out waiting for {what}")
            };
            let mut out = Vec::new();
            match item {
                FeedItem::Batch { seq, payload } => {
                    let b = decode_batch(&payload, self.flavor).unwrap();
                    self.mirror.apply(&b, &mut out);
                    self.last_seq = Some(seq);
                }
                FeedItem::Reset { .. } => {
                    self.resets += 1;
                    out.push(self.mirror.clear());
                }
                _ => {}
            }
            for data in out {
                self.index.ingest(W, &KvEvent { event_id: self.next_id, data });
                self.next_id += 1;
            }
        }
    }

    fn cached(&self, tokens: &[u32]) -> usize {
        let hashes =
            TokenBlockHasher::new(kvfabric::units::BlockTokens::of(16), HashSeed::default())
                .sequence_hashes(tokens);
        self.index.overlap(&hashes).blocks(W)
    }
}

async fn live_events_with_replay(flavor_name: &str, flavor: Flavor) {
    let mut publisher = Publisher::start(flavor_name);
    let mut cfg = SubscriberConfig::new(EventsEndpoint::Connect(publisher.pub_endpoint.clone()));
    cfg.replay = Some(publisher.replay.clone());
    cfg.topic = b"kv".to_vec();
    let index = PrefixIndex::new();
    index.add_worker(W);
    let mut f = Follower {
        sub: Subscriber::start(cfg).await.unwrap(),
        mirror: EngineMirror::new(kvfabric::units::BlockTokens::of(16)),
        flavor,
        index,
        next_id: 1,
        resets: 0,
        last_seq: None,
    };
    let connected = async {
        loop {
            if let Some(FeedItem::Connected { .. }) = f.sub.recv().await {
                break;
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(10), connected).await.expect("connected");

    let a: Vec<u32> = (0..64).collect(); // 4 blocks
    let b: Vec<u32> = (64..96).collect(); // 2 blocks, children of a
    let c: Vec<u32> = (1000..1032).collect(); // 2 blocks
    let ab: Vec<u32> = a.iter().chain(&b).copied().collect();
    // Hashes above 2^63, as vLLM's often are.
    let h = |i: u64| u64::MAX - i;
    publisher.store(&[h(1), h(2), h(3), h(4)], None, &a, true);
    // Batch 1 never reaches the live stream: the gap is seen at batch 2 and replayed.
    publisher.store(&[h(5), h(6)], Some(h(4)), &b, false);
    publisher.store(&[h(7), h(8)], None, &c, true);
    f.pump_until("the replayed gap", |f| f.cached(&ab) == 6 && f.cached(&c) == 2).await;
    assert_eq!(f.resets, 0);
    assert_eq!(f.index.worker_blocks(W), 8);

    // A removal of the last block of c.
    let rm = json!({ "type": "BlockRemoved", "block_hashes": [h(8)], "medium": "GPU" });
    publisher.cmd(json!({ "cmd": "publish", "events": [rm] }));
    f.pump_until("the removal", |f| f.cached(&c) == 1).await;

    // A gap the engine can no longer replay: its blocks are dropped and rebuilt.
    let d: Vec<u32> = (2000..2016).collect();
    let e: Vec<u32> = (3000..3032).collect();
    publisher.store(&[h(9)], None, &d, false);
    publisher.cmd(json!({ "cmd": "trim", "keep": 0 }));
    let last = publisher.store(&[h(10), h(11)], None, &e, true);
    f.pump_until("the reset", |f| f.last_seq == Some(last)).await;
    assert_eq!(f.resets, 1);
    assert_eq!((f.cached(&e), f.cached(&ab), f.cached(&c), f.cached(&d)), (2, 0, 0, 0));
    assert_eq!(f.index.worker_blocks(W), 2);
    writeln!(publisher.stdin, "{}", json!({ "cmd": "quit" })).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_events_over_zeromq_fill_the_index_across_replayed_and_lost_gaps() {
    live_events_with_replay("vllm", Flavor::Vllm).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_events_over_zeromq_fill_the_index_across_replayed_and_lost_gaps() {
    live_events_with_replay("sglang", Flavor::Sglang).await;
}
