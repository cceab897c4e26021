//! One KV pool across workers: a worker told by a router where its prompt's prefix is pulls
//! those blocks from its peer's store (checksummed, over the transfer engine) instead of
//! computing them, and answers token for token as if it had computed them. A holder that went
//! away, stops answering, or no longer holds the blocks costs a recompute, never a wrong
//! token or a hang.
//!
//! Workers here are assembled in process by the library, on loopback (the namespace-host test
//! in `cli/tests/hosts.rs` kills and cuts off a holder that is another process on
//! another host).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvfabric::agent::RpcHandler;
use kvfabric::contract::generate::{CacheHits, PullHint};
use kvfabric::control::memory::{MemoryBus, MemoryDiscovery};
use kvfabric::control::{Discovery, EventBus};
use kvfabric_serving::engine::llama::LlamaOptions;
use kvfabric_serving::engine::mock::MockConfig;
use kvfabric_serving::engine::{GenEvent, GenerateRequest, Scheduler, SchedulerConfig};
use kvfabric_serving::worker::{EngineSpec, PeerConfig, Served, WorkerConfig, WorkerStack};
use kvfabric_tiers::fabric::{FabricNode, PeerLimits};
use kvfabric_tiers::remote::peers::PeerStats;

const SECRET: &[u8] = b"pool-test-secret";

fn config(name: &str, engine: EngineSpec, peer_deadline: Duration) -> WorkerConfig {
    WorkerConfig {
        name: name.into(),
        engine,
        scheduler: SchedulerConfig::default(),
        secret: Some(SECRET.into()),
        tls: None,
        host_blocks: 256,
        disk: None,
        disk_admit_min_hits: 0,
        remote_tier: false,
        rdma: None,
        transfer_listen: ([127, 0, 0, 1], 0).into(),
        transfer_advertise: None,
        remote_write_min_bytes_per_s: 0.0,
        peers: Some(PeerConfig { deadline: peer_deadline, ..PeerConfig::default() }),
    }
}

fn mock() -> EngineSpec {
    EngineSpec::Mock {
        name: "mock".into(),
        block_tokens: 16,
        model_dir: None,
        config: MockConfig { decode_step_us: 100.0, ..MockConfig::default() },
    }
}

fn llama() -> EngineSpec {
    let path = std::env::var_os("KVFABRIC_TEST_MODEL").map(PathBuf::from).unwrap_or_else(|| {
        let home = std::env::var_os("HOME").expect("HOME is set");
        PathBuf::from(home).join(".cache/kvfabric/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    });
    EngineSpec::Llama {
        path,
        options: LlamaOptions { name: Some("smol".into()), ..Default::default() },
    }
}

struct Plane {
    discovery: Arc<dyn Discovery>,
    bus: Arc<dyn EventBus>,
}

impl Plane {
    fn new() -> Self {
        Plane { discovery: Arc::new(MemoryDiscovery::new()), bus: Arc::new(MemoryBus::new()) }
    }

    async fn worker(&self, cfg: WorkerConfig) -> (WorkerStack, Served) {
        crate::worker::start_worker(cfg, &self.discovery, &self.bus).await
    }
}

/// Generates `n` tokens greedily for `prompt`, told to pull from `pull`: the tokens, where
/// the prompt's KV came from, and how long it took.
async fn generate(
    sched: &Scheduler,
    prompt: &[u32],
    n: usize,
    pull: Option<PullHint>,
) -> (Vec<u32>, CacheHits, Duration) {
    let started = Instant::now();
    let mut req = GenerateRequest::new(prompt.to_vec(), n, Duration::from_secs(60));
    req.ignore_eos = true;
    req.pull = pull;
    let mut rx = sched.submit(req).unwrap();
    let (mut tokens, mut hits) = (Vec::new(), CacheHits::default());
    while let Some(ev) = rx.recv().await {
        match ev {
            GenEvent::Started { cached, .. } => hits = cached,
            GenEvent::Cached(c) => hits = c,
            GenEvent::Token { id, .. } => tokens.push(id),
            GenEvent::Done { .. } => break,
            GenEvent::Error(e) => panic!("{e}"),
            GenEvent::Accepted { .. } => {}
        }
    }
    (tokens, hits, started.elapsed())
}

/// Waits until `stack` knows `peer`'s store (discovery told it).
async fn knows(stack: &WorkerStack, peer: &str) {
    let peers = stack.store.peers().expect("the worker pools its store");
    let until = Instant::now() + Duration::from_secs(10);
    while !peers.known().iter().any(|p| p == peer) {
        assert!(Instant::now() < until, "{peer} never became a known peer: {:?}", peers.known());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits until `stack`'s store holds the leading `blocks` of `prompt`.
async fn holds(stack: &WorkerStack, prompt: &[u32], blocks: usize) {
    let hashes = stack.sched.sequence_hashes(prompt);
    let until = Instant::now() + Duration::from_secs(10);
    while stack.store.held_prefix(&hashes[..blocks]) < blocks {
        assert!(Instant::now() < until, "the holder never stored the prompt's blocks");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A prompt of `len` token ids below `vocab` (the mock's: bytes), different per `salt`.
fn prompt(len: usize, salt: u32, vocab: u32) -> Vec<u32> {
    (0..len as u32).map(|i| 32 + (i * 37 + salt * 101) % (vocab - 32)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_pulls_its_peers_prefix_and_answers_token_for_token_the_same() {
    let plane = Plane::new();
    let (a, _a_served) = plane.worker(config("a", llama(), Duration::from_secs(10))).await;
    let (b, _b_served) = plane.worker(config("b", llama(), Duration::from_secs(10))).await;
    knows(&b, "a").await;
    let p = prompt(200, 1, 20_000);
    // 200 tokens: 12 full blocks, and at least one token left to compute.
    let blocks = 12;
    let (computed, hits, _) = generate(&a.sched, &p, 12, None).await;
    assert_eq!(hits.total(), 0, "the holder computed the prompt");
    holds(&a, &p, blocks).await;

    let hint = PullHint { from: "a".into(), blocks: blocks as u32 };
    let (pulled, hits, _) = generate(&b.sched, &p, 12, Some(hint)).await;
    assert_eq!(hits.peer_tokens, blocks * 16, "the prefix came from the peer: {hits:?}");
    assert_eq!(pulled, computed, "pulled KV answers token for token as computed KV does");
    let pulls = b.store.peers().unwrap().snapshot();
    assert_eq!(pulls.pulled_blocks, blocks as u64);
    assert_eq!(pulls.pulled_bytes, blocks as u64 * b.store.block_bytes());
    assert!(pulls.failures.iter().all(|(_, n)| *n == 0), "{pulls:?}");
    let served = a.store.peers().unwrap().snapshot();
    assert_eq!(served.served_blocks, blocks as u64);

    // What it pulled is its own now: the same prompt again is a hit in its host tier.
    let (again, hits, _) = generate(&b.sched, &p, 12, None).await;
    assert_eq!(again, computed);
    assert_eq!((hits.host_tokens, hits.peer_tokens), (blocks * 16, 0), "{hits:?}");
}

/// A holder whose store answers a peer's `GET` as `mode` says.
struct Faulty {
    inner: Arc<FabricNode>,
    mode: Fault,
}

#[derive(Clone, Copy, PartialEq)]
enum Fault {
    /// It never answers (a host cut off mid-pull: no reset, no answer).
    Silent,
    /// It fails the call (a process whose store went away mid-pull).
    Gone,
}

impl RpcHandler for Faulty {
    fn handle<'a>(
        &'a self,
        from: &'a str,
        method: u16,
        body: Vec<u8>,
    ) -> kvfabric::agent::RpcReply<'a> {
        Box::pin(async move {
            if method == kvfabric_tiers::remote::protocol::method::GET {
                match self.mode {
                    Fault::Silent => std::future::pending::<()>().await,
                    Fault::Gone => return Err("the store is gone".into()),
                }
            }
            self.inner.handle(from, method, body).await
        })
    }
}

async fn a_failed_pull_costs_a_recompute(mode: Fault, reason: &str) {
    let plane = Plane::new();
    let deadline = Duration::from_millis(800);
    let (a, _a_served) = plane.worker(config("a", mock(), deadline)).await;
    let (b, _b_served) = plane.worker(config("b", mock(), deadline)).await;
    let (c, _c_served) = plane.worker(config("c", mock(), deadline)).await;
    knows(&b, "a").await;
    let p = prompt(330, 2, 256);
    let blocks = 20;
    let (computed, _, _) = generate(&a.sched, &p, 8, None).await;
    holds(&a, &p, blocks).await;
    let node = FabricNode::serve_peers(
        a.agent.clone(),
        a.store.clone(),
        deadline,
        PeerLimits::share(0.25, 256, None),
        Arc::new(PeerStats::default()),
    );
    a.agent.set_rpc_handler(Arc::new(Faulty { inner: node, mode }));

    let hint = PullHint { from: "a".into(), blocks: blocks as u32 };
    let (tokens, hits, took) = generate(&b.sched, &p, 8, Some(hint)).await;
    assert_eq!(hits.total(), 0, "nothing came from the holder: {hits:?}");
    assert_eq!(tokens, computed, "the recomputed answer is the holder's");
    assert!(
        took < deadline + Duration::from_secs(5),
        "the pull's deadline bounds the wait: {took:?}"
    );
    let pulls = b.store.peers().unwrap().snapshot();
    let failed: Vec<_> = pulls.failures.iter().filter(|(_, n)| *n > 0).collect();
    assert_eq!(failed, vec![&(reason, 1)], "{pulls:?}");

    // A third worker computing from nothing agrees.
    let (fresh, _, _) = generate(&c.sched, &p, 8, None).await;
    assert_eq!(fresh, computed);
    a.agent.clear_rpc_handler();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_cut_off_during_a_pull_costs_a_recompute_within_the_pulls_deadline() {
    a_failed_pull_costs_a_recompute(Fault::Silent, "timeout").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_whose_store_goes_away_during_a_pull_costs_a_recompute() {
    a_failed_pull_costs_a_recompute(Fault::Gone, "unreachable").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_that_evicted_part_of_the_prefix_serves_the_rest_and_the_worker_computes_it() {
    let plane = Plane::new();
    let (a, _a_served) = plane.worker(config("a", mock(), Duration::from_secs(5))).await;
    let (b, _b_served) = plane.worker(config("b", mock(), Duration::from_secs(5))).await;
    knows(&b, "a").await;
    // The holder computed the first 100 tokens' prompt (6 blocks); the router believes it
    // holds 20 blocks of the longer prompt.
    let long = prompt(330, 3, 256);
    let (_, _, _) = generate(&a.sched, &long[..100], 1, None).await;
    holds(&a, &long, 6).await;
    let hint = PullHint { from: "a".into(), blocks: 20 };
    let (tokens, hits, _) = generate(&b.sched, &long, 8, Some(hint)).await;
    assert_eq!(hits.peer_tokens, 6 * 16, "the blocks it still held: {hits:?}");
    let (computed, _, _) = generate(&a.sched, &long, 8, None).await;
    assert_eq!(tokens, computed);
    let pulls = b.store.peers().unwrap().snapshot();
    assert!(pulls.failures.contains(&("evicted", 1)), "{pulls:?}");

    // A peer nobody knows: computed, counted.
    let hint = PullHint { from: "nobody".into(), blocks: 20 };
    let other = prompt(330, 4, 256);
    let (_, hits, _) = generate(&b.sched, &other, 2, Some(hint)).await;
    assert_eq!(hits.total(), 0);
    let pulls = b.store.peers().unwrap().snapshot();
    assert!(pulls.failures.contains(&("unknown_peer", 1)), "{pulls:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_serves_at_most_its_share_of_its_host_tier_at_once() {
    let plane = Plane::new();
    let (a, _a_served) = plane.worker(config("a", mock(), Duration::from_secs(5))).await;
    let (b, _b_served) = plane.worker(config("b", mock(), Duration::from_secs(5))).await;
    knows(&b, "a").await;
    let p = prompt(330, 5, 256);
    let _ = generate(&a.sched, &p, 1, None).await;
    holds(&a, &p, 20).await;
    // A share of 8 blocks: a pull of 20 is served in part, and says it was busy.
    let node = FabricNode::serve_peers(
        a.agent.clone(),
        a.store.clone(),
        Duration::from_secs(5),
        PeerLimits { bytes_per_s: None, blocks_max: 8 },
        Arc::new(PeerStats::default()),
    );
    let hint = PullHint { from: "a".into(), blocks: 20 };
    let (tokens, hits, _) = generate(&b.sched, &p, 4, Some(hint)).await;
    assert_eq!(hits.peer_tokens, 8 * 16, "{hits:?}");
    let (computed, _, _) = generate(&a.sched, &p, 4, None).await;
    assert_eq!(tokens, computed);
    let pulls = b.store.peers().unwrap().snapshot();
    assert!(pulls.failures.contains(&("busy", 1)), "{pulls:?}");
    drop(node);
    a.agent.clear_rpc_handler();
}
