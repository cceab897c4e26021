//! The router service's membership with a real (in-process) discovery and bus: who joins,
//! who is left out and why, what the frontend is told, how load reports and refusals weigh on
//! routing. No model runtime anywhere: the tokenizer a frontend would load is the
//! [`Admission`]'s business.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use kvfabric::contract::discovery::{
    CodecSpec, ModelInfo, Role, WorkerApi, WorkerMetadata, WORKER_KIND,
};
use kvfabric::contract::{self, Load, Message};
use kvfabric::control::memory::{MemoryBus, MemoryDiscovery};
use kvfabric::control::{Discovery, EventBus, Instance};
use kvfabric::layout::ModelSpec;
use kvfabric_router::feed::worker_id;
use kvfabric_router::membership::{Admission, Membership, MembershipConfig, Refusal};
use kvfabric_router::{RouterConfig, RoutingMode};
use parking_lot::Mutex;

/// Records what the membership told it; refuses a worker named `no-tokenizer`.
#[derive(Clone, Default)]
struct Recorder(Arc<Mutex<Vec<String>>>);

impl Admission for Recorder {
    async fn admit(&self, name: &str, _md: &WorkerMetadata) -> Result<(), String> {
        if name == "no-tokenizer" {
            return Err("its tokenizer cannot be loaded".into());
        }
        Ok(())
    }
    fn joined(&self, name: &str, addr: SocketAddr) {
        self.0.lock().push(format!("joined {name} {addr}"));
    }
    fn left(&self, name: &str, addr: SocketAddr) {
        self.0.lock().push(format!("left {name} {addr}"));
    }
}

fn metadata(model: &str, port: u16, api: WorkerApi) -> serde_json::Value {
    let layout = ModelSpec::preset("smollm2-135m").unwrap().block_layout(16).unwrap();
    serde_json::to_value(WorkerMetadata {
        model: ModelInfo { id: model.into(), context_len: 2048, layout },
        codec: CodecSpec::Bytes,
        addr: SocketAddr::from(([127, 0, 0, 1], port)),
        role: Role::Aggregated,
        api,
        store: None,
    })
    .unwrap()
}

fn ours() -> WorkerApi {
    WorkerApi::Kvfabric { protocol: contract::worker::PROTOCOL }
}

async fn wait_for(what: &str, mut ok: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while !ok() {
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn workers_join_leave_report_and_are_routed_to_only_when_they_can_be_reached() {
    let discovery = Arc::new(MemoryDiscovery::new());
    let bus = Arc::new(MemoryBus::new());
    let ttl = Duration::from_secs(30);
    let reg = |id: &str, metadata: serde_json::Value| {
        discovery.register(Instance { kind: WORKER_KIND.into(), id: id.into(), metadata }, ttl)
    };
    // Registered before the membership follows discovery: known when `follow` returns.
    let _a = reg("a", metadata("m", 9001, ours())).await.unwrap();
    let _old = reg("old", metadata("m", 9002, WorkerApi::Kvfabric { protocol: 1 })).await.unwrap();
    let _bad = reg("bad", serde_json::json!({"model": 7})).await.unwrap();
    let _tok = reg("no-tokenizer", metadata("m", 9003, ours())).await.unwrap();
    let engine = WorkerApi::OpenAi { model: "served".into(), priority: false };
    let e = reg("engine", metadata("other", 9004, engine)).await.unwrap();

    let cfg = MembershipConfig {
        router: RouterConfig { mode: RoutingMode::RoundRobin, ..RouterConfig::default() },
        name: "frontend".into(),
        kind: WORKER_KIND.into(),
        slow_penalty: Duration::from_secs(60),
    };
    let members = Membership::new(bus.clone(), cfg).await.unwrap();
    let told = Recorder::default();
    let task = members.follow(discovery.clone(), told.clone()).await.unwrap();

    // Unreadable metadata and a refused admission leave a worker out; another protocol
    // version is known (shown) but never routed to; only our protocol's worker is checked.
    let mut names: Vec<String> = members.read(|m| m.workers.keys().cloned().collect());
    names.sort();
    assert_eq!(names, ["a", "engine", "old"]);
    assert_eq!(*told.0.lock(), ["joined a 127.0.0.1:9001"]);
    let why =
        members.read(|m| m.workers["old"].refused_now(std::time::Instant::now()).map(String::from));
    assert!(why.unwrap().contains("speaks worker protocol 1"));
    let models: Vec<String> = members.models().into_iter().map(|m| m.id).collect();
    assert_eq!(models, ["m", "other"]);
    assert_eq!(members.model("m").unwrap().1, CodecSpec::Bytes);
    for rid in 0..6 {
        let pick = members.route("m", rid, &[1, 2, 3], &[]).unwrap();
        assert_eq!(pick.name, "a", "request {rid} went to a worker that cannot be reached");
        members.free("m", rid);
    }
    assert_eq!(
        members.route("other", 9, &[1], &[]).unwrap().api,
        WorkerApi::OpenAi { model: "served".into(), priority: false }
    );

    // A second worker joins while followed; round-robin reaches both.
    let b = reg("b", metadata("m", 9005, ours())).await.unwrap();
    wait_for("b to join", || members.read(|m| m.workers.contains_key("b"))).await;
    let mut seen: Vec<String> =
        (10..14).map(|rid| members.route("m", rid, &[1], &[]).unwrap().name).collect();
    seen.sort();
    seen.dedup();
    assert_eq!(seen, ["a", "b"]);
    // What was tried for a request is avoided; a slow worker is avoided while another is
    // fresh; a refused one never chosen, even when it is the last.
    assert_eq!(members.route("m", 20, &[1], &[worker_id("a")]).unwrap().name, "b");
    members.penalise("b");
    assert!((21..25).all(|rid| members.route("m", rid, &[1], &[]).unwrap().name == "a"));
    members.forgive("b");
    members.refuse("a", "refused this frontend's secret".into(), Refusal::Secret);
    assert!((25..29).all(|rid| members.route("m", rid, &[1], &[]).unwrap().name == "b"));
    assert!(members.route("m", 30, &[1], &[worker_id("b")]).is_none());

    // Load reports off the bus reach the worker; a report of nobody is dropped.
    let load = Load { active_blocks: 7, queued_prefill_tokens: 64, accepted: Some(3) };
    for source in ["b", "stranger"] {
        let msg = Message::Load { source: source.into(), load, stats: None };
        bus.publish(msg.topic(), msg.encode()).await.unwrap();
    }
    wait_for("b's load", || members.read(|m| m.workers["b"].load == load)).await;
    assert!(members.read(|m| m.reporters.is_empty()), "a report without stats is no reporter");

    // Leaving: the frontend is told (to forget connections), the worker is kept a while for
    // dashboards, and a model goes with its last worker.
    b.revoke().await;
    wait_for("b to leave", || !members.read(|m| m.workers.contains_key("b"))).await;
    assert!(told.0.lock().contains(&"left b 127.0.0.1:9005".to_string()));
    assert_eq!(
        members.read(|m| m.departed.iter().map(|d| d.name.clone()).collect::<Vec<_>>()),
        ["b"]
    );
    e.revoke().await;
    // Its last worker gone, the model is vacated: no longer served, still known for a while
    // (requests for it wait for a worker to join: a restart).
    wait_for("the engine's model to go", || members.vacated("other")).await;
    assert!(members.read(|m| !m.models.contains_key("other")));
    assert!(members.model("other").is_some());
    task.abort();
}

#[tokio::test]
async fn a_pick_names_the_peer_to_pull_from_priced_at_the_link_its_worker_measured() {
    let discovery = Arc::new(MemoryDiscovery::new());
    let bus = Arc::new(MemoryBus::new());
    let ttl = Duration::from_secs(30);
    // Both register their stores (as workers that pool them do).
    let pooled = |port: u16| {
        let mut md = metadata("m", port, ours());
        let layout = ModelSpec::preset("smollm2-135m").unwrap().block_layout(16).unwrap();
        let agent = kvfabric::agent::AgentMetadata {
            name: format!("w{port}"),
            tcp_addr: SocketAddr::from(([127, 0, 0, 1], port + 100)),
            host_id: "host".into(),
            pid: 1,
            regions: Vec::new(),
            transports: Vec::new(),
            rdma: Default::default(),
        };
        let store = kvfabric::contract::discovery::NodeInfo {
            agent,
            block_bytes: layout.bytes_per_block(),
        };
        md["store"] = serde_json::to_value(store).unwrap();
        md
    };
    let reg = |id: &str, metadata: serde_json::Value| {
        discovery.register(Instance { kind: WORKER_KIND.into(), id: id.into(), metadata }, ttl)
    };
    let _h = reg("holder", pooled(9101)).await.unwrap();
    let _i = reg("idle", pooled(9102)).await.unwrap();
    let cfg = MembershipConfig {
        router: RouterConfig {
            pull: Some(kvfabric_router::PullPricing {
                block_bytes: 0,
                // 1 Gbit/s until measured.
                link_bytes_per_s: 0.125e9,
                overhead_s: 2e-3,
                prefill_tokens_per_s: 25_000.0,
            }),
            ..RouterConfig::default()
        },
        name: "frontend".into(),
        kind: WORKER_KIND.into(),
        slow_penalty: Duration::from_secs(60),
    };
    let members = Membership::new(bus.clone(), cfg).await.unwrap();
    let task = members.follow(discovery.clone(), Recorder::default()).await.unwrap();
    // The holder holds a 40-block prompt and has a deep prefill queue.
    let prompt: Vec<u32> = (0..641).map(|i| i % 250).collect();
    let hashes = kvfabric::hash::TokenBlockHasher::new(
        kvfabric::units::BlockTokens::of(16),
        Default::default(),
    )
    .sequence_hashes(&prompt);
    members.index().ingest(
        worker_id("holder"),
        &kvfabric::events::KvEvent {
            event_id: 1,
            data: kvfabric::events::KvEventData::Stored {
                sequence_hashes: hashes.clone(),
                parent: None,
                tier: kvfabric::events::TierKind::Host,
            },
        },
    );
    let busy = Load { active_blocks: 0, queued_prefill_tokens: 100_000, accepted: None };
    let msg = Message::Load { source: "holder".into(), load: busy, stats: None };
    bus.publish(msg.topic(), msg.encode()).await.unwrap();
    wait_for("the holder's load", || members.read(|m| m.workers["holder"].load == busy)).await;

    // At 1 Gbit/s a block moves slower than it computes: the idle worker computes.
    let pick = members.route("m", 1, &prompt, &[]).unwrap();
    assert_eq!((pick.name.as_str(), &pick.pull), ("idle", &None));
    assert_eq!(pick.path, kvfabric_router::Path::Compute);
    members.free("m", 1);

    // The idle worker measured 3 GB/s pulling from the holder: it is told to pull.
    let stats = kvfabric::contract::WorkerStats {
        links: vec![kvfabric::contract::LinkRate {
            peer: "holder".into(),
            bytes_per_s: 3_000_000_000,
        }],
        ..Default::default()
    };
    let msg = Message::Load {
        source: "idle".into(),
        load: Load::default(),
        stats: Some(Box::new(stats)),
    };
    bus.publish(msg.topic(), msg.encode()).await.unwrap();
    wait_for("the idle worker's links", || {
        members.read(|m| m.workers["idle"].stats.as_ref().is_some_and(|s| !s.links.is_empty()))
    })
    .await;
    let pick = members.route("m", 2, &prompt, &[]).unwrap();
    assert_eq!(pick.name, "idle");
    assert_eq!(
        pick.pull,
        Some(kvfabric::contract::generate::PullHint { from: "holder".into(), blocks: 40 })
    );
    assert_eq!(pick.path, kvfabric_router::Path::Pull);
    task.abort();
}
