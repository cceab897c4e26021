//! A worker assembled in process by the library (no binary, no child process): it serves a
//! routing frontend found through discovery, publishes the KV events that feed the frontend's
//! index, and leaves discovery when revoked.

use crate::common;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use kvfabric::control::memory::{MemoryBus, MemoryDiscovery};
use kvfabric::control::{Discovery, EventBus};
use kvfabric_serving::disagg::DisaggConfig;
use kvfabric_serving::engine::mock::MockConfig;
use kvfabric_serving::engine::SchedulerConfig;
use kvfabric_serving::http::{router, ServerConfig};
use kvfabric_serving::routed::{RoutedBackend, RoutedConfig};
use kvfabric_serving::worker::{EngineSpec, Role, WorkerConfig, WorkerStack, WORKER_KIND};
use serde_json::json;

const SECRET: &[u8] = b"worker-test-secret";

/// A mock worker named `name`, served and registered in `discovery`.
async fn mock_worker(
    name: &str,
    discovery: &Arc<dyn Discovery>,
    bus: &Arc<dyn EventBus>,
) -> (WorkerStack, kvfabric_serving::worker::Served) {
    mock_worker_with(name, discovery, bus, SECRET, false).await
}

/// A mock worker that authenticates with `secret`, using the fabric nodes in discovery as its
/// remote tier when `remote_tier`.
async fn mock_worker_with(
    name: &str,
    discovery: &Arc<dyn Discovery>,
    bus: &Arc<dyn EventBus>,
    secret: &[u8],
    remote_tier: bool,
) -> (WorkerStack, kvfabric_serving::worker::Served) {
    let mock = MockConfig { decode_step_us: 100.0, ..MockConfig::default() };
    let cfg = worker_config(name, secret, remote_tier, mock, SchedulerConfig::default());
    start_worker(cfg, discovery, bus).await
}

fn worker_config(
    name: &str,
    secret: &[u8],
    remote_tier: bool,
    mock: MockConfig,
    scheduler: SchedulerConfig,
) -> WorkerConfig {
    WorkerConfig {
        name: name.into(),
        tls: None,
        engine: EngineSpec::Mock {
            name: "mock".into(),
            block_tokens: 16,
            model_dir: None,
            config: mock,
        },
        scheduler,
        secret: Some(secret.into()),
        host_blocks: 64,
        disk: None,
        disk_admit_min_hits: 0,
        remote_tier,
        rdma: None,
        transfer_listen: ([127, 0, 0, 1], 0).into(),
        transfer_advertise: None,
        remote_write_min_bytes_per_s: 0.0,
        peers: None,
    }
}

/// Starts the worker `cfg` describes, served and registered in `discovery` (the pool's
/// tests start theirs with it too).
pub(crate) async fn start_worker(
    cfg: WorkerConfig,
    discovery: &Arc<dyn Discovery>,
    bus: &Arc<dyn EventBus>,
) -> (WorkerStack, kvfabric_serving::worker::Served) {
    let name = cfg.name.clone();
    let stack = WorkerStack::start(&cfg, discovery, bus.clone(), |_, _| {}).await.unwrap();
    let served = stack
        .serve(
            &name,
            Role::Aggregated,
            "127.0.0.1:0".parse().unwrap(),
            None,
            discovery,
            bus,
            4,
            DisaggConfig::default(),
            Duration::from_secs(5),
        )
        .await
        .unwrap();
    (stack, served)
}

/// A routing frontend over `discovery`, serving HTTP on a free port.
async fn frontend(
    discovery: &Arc<dyn Discovery>,
    bus: &Arc<dyn EventBus>,
) -> (Arc<RoutedBackend>, std::net::SocketAddr) {
    let routed = Arc::new(
        RoutedBackend::start(
            discovery.clone(),
            bus.clone(),
            // A model without workers is an outage at once here (no restart to wait for).
            RoutedConfig { restart_wait: Duration::ZERO, ..RoutedConfig::new(SECRET) },
        )
        .await
        .unwrap(),
    );
    let app = router(routed.clone(), ServerConfig::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (routed, addr)
}

/// Strangers who connect to a worker's request port and never send a byte (the fault round's
/// 130), each holding its connection until the worker closes it; the counter says how many
/// connected.
fn silent_flood(
    addr: std::net::SocketAddr,
    n: usize,
) -> (Vec<tokio::task::JoinHandle<()>>, Arc<std::sync::atomic::AtomicUsize>) {
    let connected = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let tasks = (0..n)
        .map(|_| {
            let connected = connected.clone();
            tokio::spawn(async move {
                let Ok(mut c) = tokio::net::TcpStream::connect(addr).await else { return };
                connected.fetch_add(1, Ordering::Relaxed);
                // Held until the worker closes it (reading what it sends: its challenge).
                let mut sink = Vec::new();
                let _ = tokio::io::AsyncReadExt::read_to_end(&mut c, &mut sink).await;
            })
        })
        .collect();
    (tasks, connected)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_connections_on_a_request_port_do_not_shut_frontends_out() {
    use kvfabric::session::admission::AdmissionLimits;
    let discovery: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new());
    let bus: Arc<dyn EventBus> = Arc::new(MemoryBus::new());
    let (stack, served) = mock_worker("w-flood", &discovery, &bus).await;
    let (_routed, addr) = frontend(&discovery, &bus).await;
    let body = json!({ "model": "mock", "prompt": "a prompt of a few words", "max_tokens": 2 });
    assert_eq!(common::post_json(addr, "/v1/completions", &body).await.status, 200);

    let (flood, connected) = silent_flood(served.addr, 130);
    let port = served.stats.clone().unwrap().port.clone();
    // 130 strangers from one address (a burst is let in while young; those past their grace
    // give way to newer ones of their address).
    common::wait_until(Duration::from_secs(10), || connected.load(Ordering::Relaxed) == 130);
    // The frontend that was already serving: its connection is kept, nothing to win.
    for i in 0..118 {
        let r = common::post_json(addr, "/v1/completions", &body).await;
        assert_eq!(r.status, 200, "request {i} during the flood: {}", r.text());
    }
    // A frontend that starts during the flood connects anew, once the strangers have had
    // their grace: its connection trims the address's pending handshakes to their budget
    // (32), oldest first, and is kept from then on.
    tokio::time::sleep(AdmissionLimits::default().handshake_grace * 2).await;
    let (_late, late_addr) = frontend(&discovery, &bus).await;
    for i in 0..20 {
        let r = common::post_json(late_addr, "/v1/completions", &body).await;
        assert_eq!(r.status, 200, "late frontend, request {i}: {}", r.text());
    }
    let s = port.snapshot();
    let per_source = AdmissionLimits::default().handshakes_per_source_max as u64;
    // Closed: evicted by newer connections, or (on a slow machine) timed out in the handshake.
    use kvfabric::session::admission::Cause;
    let closed = s.count(Cause::Evicted) + s.count(Cause::Handshake);
    assert!(s.count(Cause::Evicted) >= 1 && closed >= 130 - per_source, "{s:?}");
    assert!(s.pending <= per_source, "the pre-auth budget holds: {s:?}");
    assert!(s.admitted <= 2, "one kept connection per frontend: {s:?}");
    for f in flood {
        f.abort();
    }
    served.server.abort();
    stack.shutdown().await;
}

/// A small completion request, distinct per `i`.
fn completion(i: usize) -> serde_json::Value {
    json!({ "model": "mock", "prompt": format!("request {i}"), "max_tokens": 2 })
}

/// Sends `n` completions to the frontend at `addr`: every one is served by `worker`.
async fn all_served_by(addr: std::net::SocketAddr, n: usize, worker: &str) {
    for i in 0..n {
        let r = common::post_json(addr, "/v1/completions", &completion(i)).await;
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.header("x-kvfabric-worker"), Some(worker), "request {i}");
    }
}

/// A worker of another request-protocol version (here one registered as the unversioned
/// version 1) is known from its registration: shown refused with the versions in words, never
/// sent a request, and named in the error when it is all that is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_of_another_protocol_version_is_named_and_never_sent_a_request() {
    use kvfabric::control::Instance;
    use kvfabric_serving::protocol::{WorkerApi, WorkerMetadata, PROTOCOL};
    let discovery: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new());
    let bus: Arc<dyn EventBus> = Arc::new(MemoryBus::new());
    let (good, good_served) = mock_worker("w-good", &discovery, &bus).await;
    // The same worker's registration, as a release before versions wrote it (no `protocol`).
    let listed = discovery.list(WORKER_KIND).await.unwrap();
    let mut md: WorkerMetadata = serde_json::from_value(listed[0].metadata.clone()).unwrap();
    assert_eq!(md.api, WorkerApi::Kvfabric { protocol: PROTOCOL });
    md.api = WorkerApi::Kvfabric { protocol: 1 };
    let mut old = serde_json::to_value(&md).unwrap();
    old["api"].as_object_mut().unwrap().remove("protocol");
    assert_eq!(serde_json::from_value::<WorkerMetadata>(old.clone()).unwrap().api, md.api);
    let instance = Instance { kind: WORKER_KIND.into(), id: "w-old".into(), metadata: old };
    let old_reg = discovery.register(instance, Duration::from_secs(30)).await.unwrap();
    let (routed, addr) = frontend(&discovery, &bus).await;
    let r = routed.clone();
    common::wait_until(Duration::from_secs(10), || {
        r.dashboard().workers.iter().any(|w| w.name == "w-old" && w.state == "refused")
    });
    let h = common::get(addr, "/health").await.json();
    assert_eq!(h["status"], "degraded", "{h}");
    let why = format!("speaks worker protocol 1, this frontend speaks {PROTOCOL}");
    assert!(h["reasons"][0].as_str().unwrap().contains(&why), "{h}");
    all_served_by(addr, 10, "w-good").await;
    // Not a secret problem: nothing counted as one.
    assert_eq!(routed.stats().auth_failures.load(Ordering::Relaxed), 0);
    good_served.registration.revoke().await;
    let r = common::post_json(addr, "/v1/completions", &completion(99)).await;
    assert_eq!(r.status, 503, "{}", r.text());
    assert!(r.text().contains(&format!("w-old {why}")), "{}", r.text());
    old_reg.revoke().await;
    good_served.server.abort();
    good.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_with_another_secret_is_not_shown_healthy_and_gets_no_requests() {
    let discovery: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new());
    let bus: Arc<dyn EventBus> = Arc::new(MemoryBus::new());
    let (good, good_served) = mock_worker("w-good", &discovery, &bus).await;
    let (bad, bad_served) =
        mock_worker_with("w-bad", &discovery, &bus, b"another secret", false).await;
    let (routed, addr) = frontend(&discovery, &bus).await;
    // The frontend checks each worker's handshake when it joins: w-bad is known to refuse it
    // before any request needs it.
    let r = routed.clone();
    common::wait_until(Duration::from_secs(10), || {
        r.stats().auth_failures.load(Ordering::Relaxed) == 1
    });
    let h = common::get(addr, "/health").await;
    assert_eq!(h.status, 200, "still serving: {}", h.text());
    let h = h.json();
    assert_eq!(h["status"], "degraded", "{h}");
    assert!(h["reasons"][0].as_str().unwrap().contains("w-bad"), "{h}");
    let view = routed.dashboard();
    assert_eq!(view.workers.iter().find(|w| w.name == "w-bad").unwrap().state, "refused");
    all_served_by(addr, 10, "w-good").await;
    assert_eq!(routed.stats().auth_failures.load(Ordering::Relaxed), 1, "no request tried w-bad");
    // With only the wrong-secret worker left: an outage, said as such.
    good_served.registration.revoke().await;
    let r = common::post_json(addr, "/v1/completions", &completion(99)).await;
    assert_eq!(r.status, 503, "{}", r.text());
    assert!(r.text().contains("w-bad refused this frontend's secret"), "{}", r.text());
    let h = common::get(addr, "/health").await;
    assert_eq!(h.status, 503, "{}", h.text());
    assert_eq!(h.json()["status"], "no usable workers");
    let metrics = common::get(addr, "/metrics").await.text();
    assert!(metrics.contains("kvfabric_frontend_worker_auth_failures_total 1"), "{metrics}");
    assert!(metrics.contains("kvfabric_frontend_no_worker_total 1"), "{metrics}");
    // The worker counted the failed handshake on its request port.
    let port = bad_served.stats.clone().unwrap().port.snapshot();
    assert!(port.count(kvfabric::session::admission::Cause::Handshake) >= 1, "{port:?}");
    let shown = "kvfabric_port_connections_closed_total{port=\"request\",reason=\"handshake\"} 1";
    assert!(bad_served.metrics.render().contains(shown));
    good_served.server.abort();
    bad_served.server.abort();
    good.shutdown().await;
    bad.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fabric_node_no_worker_can_use_is_shown_so() {
    use kvfabric_tiers::remote::protocol::{NodeInfo, FABRIC_KIND};
    let discovery: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new());
    let bus: Arc<dyn EventBus> = Arc::new(MemoryBus::new());
    let (stack, served) = mock_worker("w-f", &discovery, &bus).await;
    let agent = kvfabric::Agent::start(kvfabric::AgentConfig::new("node-x", SECRET.to_vec()))
        .await
        .unwrap();
    let info = NodeInfo { agent: agent.metadata(), block_bytes: 12_345 };
    let inst = kvfabric::control::Instance {
        kind: FABRIC_KIND.into(),
        id: "node-x".into(),
        metadata: serde_json::to_value(info).unwrap(),
    };
    let _reg = discovery.register(inst, Duration::from_secs(5)).await.unwrap();
    let (routed, addr) = frontend(&discovery, &bus).await;
    let view = routed.dashboard();
    let node = &view.fabric[0];
    assert_eq!((node.name.as_str(), node.state), ("node-x", "ignored"));
    let note = node.note.as_deref().unwrap();
    assert!(note.contains("12345") && note.contains("no worker uses it"), "{note}");
    let state = common::get(addr, "/dashboard/state").await.json();
    assert_eq!(state["fabric"][0]["note"], note, "{state}");
    served.server.abort();
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_an_exact_tie_the_route_explained_is_the_route_taken() {
    use kvfabric_router::feed::worker_id;
    // Two names whose ids order the other way round from their names: a tie broken by name
    // and one broken by id disagree.
    let (a, b) = (0..)
        .map(|i| (format!("tie-a{i}"), format!("tie-b{i}")))
        .find(|(a, b)| worker_id(a) > worker_id(b))
        .unwrap();
    let discovery: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new());
    let bus: Arc<dyn EventBus> = Arc::new(MemoryBus::new());
    let (sa, wa) = mock_worker(&a, &discovery, &bus).await;
    let (sb, wb) = mock_worker(&b, &discovery, &bus).await;
    let (_routed, addr) = frontend(&discovery, &bus).await;
    let prompt = "nothing of this is cached anywhere";
    let ask = json!({ "model": "mock", "prompt": prompt });
    let route = common::post_json(addr, "/v1/route", &ask).await.json();
    assert!(route["reason"].as_str().unwrap().contains("a tie"), "{route}");
    let body = json!({ "model": "mock", "prompt": prompt, "max_tokens": 2 });
    let r = common::post_json(addr, "/v1/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-kvfabric-worker"), route["worker"].as_str(), "{route}");
    assert_eq!(route["worker"], b, "the lower worker id");
    for (stack, served) in [(sa, wa), (sb, wb)] {
        served.server.abort();
        stack.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frontend_that_starts_after_the_workers_learns_what_they_cached() {
    let discovery: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new());
    let bus: Arc<dyn EventBus> = Arc::new(MemoryBus::new());
    let (stack, served) = mock_worker("w-cache", &discovery, &bus).await;
    let (first, addr) = frontend(&discovery, &bus).await;
    let prompt = "a prompt long enough for a few blocks of sixteen tokens each ".repeat(4);
    let body = json!({ "model": "mock", "prompt": prompt, "max_tokens": 2 });
    assert_eq!(common::post_json(addr, "/v1/completions", &body).await.status, 200);
    let cached = |v: &serde_json::Value| v["workers"][0]["cached_blocks"].as_u64().unwrap_or(0);
    let route = json!({ "model": "mock", "prompt": prompt });
    let mut known = 0;
    for _ in 0..100 {
        known = cached(&common::post_json(addr, "/v1/route", &route).await.json());
        if known >= 10 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(known >= 10, "the first frontend's index: {known} blocks");
    // The frontend goes away (killed) and a new one starts: no event will come for the
    // blocks already stored, so it must ask the worker for a dump.
    first.stop();
    drop(first);
    let (second, addr) = frontend(&discovery, &bus).await;
    let mut rebuilt = 0;
    for _ in 0..100 {
        rebuilt = cached(&common::post_json(addr, "/v1/route", &route).await.json());
        if rebuilt == known {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(rebuilt, known, "the new frontend's index");
    assert!(second.feed_stats().dumps.load(Ordering::Relaxed) >= 1);
    served.server.abort();
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_stack_serves_a_routed_frontend_in_process() {
    let discovery: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new());
    let bus: Arc<dyn EventBus> = Arc::new(MemoryBus::new());
    let (stack, served) = mock_worker_with("w-0", &discovery, &bus, SECRET, true).await;
    assert_eq!(discovery.list(WORKER_KIND).await.unwrap().len(), 1);

    let (routed, addr) = frontend(&discovery, &bus).await;

    let prompt = "a prompt long enough for a few blocks of sixteen tokens each ".repeat(2);
    let body = json!({ "model": "mock", "prompt": prompt, "max_tokens": 4 });
    let r = common::post_json(addr, "/v1/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-kvfabric-worker"), Some("w-0"));
    // Its stored blocks reach the frontend's index as KV events.
    let feed = routed.clone();
    common::wait_until(Duration::from_secs(10), || {
        feed.feed_stats().applied.load(Ordering::Relaxed) >= 5
    });
    assert!(served.metrics.render().contains("kvfabric_prefill_tokens_total"));

    // The dashboard's view: the worker from discovery with its own report (role, host tier).
    let dash = routed.clone();
    common::wait_until(Duration::from_secs(10), || {
        dash.dashboard().workers.first().and_then(|w| w.stats.as_ref()).is_some_and(|s| {
            s.role == "aggregated" && s.tiers[1].capacity == 64 && s.prefill_tokens > 0
        })
    });
    let view = routed.dashboard();
    assert_eq!(view.workers.len(), 1);
    assert_eq!((view.workers[0].name.as_str(), view.workers[0].state), ("w-0", "serving"));
    assert!(view.workers[0].indexed_blocks >= 5, "{view:?}");
    let control = view.control.expect("a routed backend has a control plane");
    assert!(control.discovery.connected && control.bus.connected);
    // A hostile report off the bus (a prefill worker's, with absurd numbers and 100
    // transports of long names) is shown cut to size, and its sums saturate.
    let evil = kvfabric::contract::Message::Load {
        source: "evil".into(),
        load: kvfabric::contract::Load {
            active_blocks: u64::MAX,
            queued_prefill_tokens: 1,
            accepted: Some(u64::MAX),
        },
        stats: Some(Box::new(kvfabric::contract::WorkerStats {
            role: "prefill".into(),
            prefill_tokens: u64::MAX,
            hit_tokens: [u64::MAX; 4],
            transfers: (0..100)
                .map(|i| kvfabric::contract::TransportTotals {
                    transport: format!("{i}{}", "x".repeat(1000)),
                    bytes: u64::MAX,
                    done: 1,
                    failed: 0,
                })
                .collect(),
            ..Default::default()
        })),
    };
    bus.publish(evil.topic(), evil.encode()).await.unwrap();
    let dash = routed.clone();
    common::wait_until(Duration::from_secs(10), || {
        dash.dashboard().workers.iter().any(|w| w.name == "evil")
    });
    let view = routed.dashboard();
    let evil = view.workers.iter().find(|w| w.name == "evil").unwrap();
    assert_eq!(evil.role, "prefill");
    let stats = evil.stats.as_ref().unwrap();
    assert!(stats.transfers.len() <= 5 && stats.transfers.iter().all(|t| t.transport.len() <= 32));
    let state = common::get(addr, "/dashboard/state").await;
    assert_eq!(state.status, 200);
    let state = state.json();
    assert_eq!(state["version"], 1);
    assert_eq!(state["prefill_tokens"], u64::MAX, "saturated: {state}");
    assert_eq!(state["requests"]["ok"], 1);
    let page = common::get(addr, "/dashboard").await;
    assert_eq!(page.status, 200);
    assert!(page.text().contains("/dashboard/app.js"));

    assert_eq!(common::get(addr, "/health").await.status, 200);
    served.registration.revoke().await;
    assert!(discovery.list(WORKER_KIND).await.unwrap().is_empty());
    // No worker: an outage, not a client error — 503 in OpenAI's shape, and /health says so.
    let gone = routed.clone();
    common::wait_until(Duration::from_secs(10), || {
        use kvfabric_serving::backend::Backend;
        Backend::health(&*gone).finish().status == kvfabric::health::Status::NoWorkers
    });
    let r = common::post_json(addr, "/v1/completions", &body).await;
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "service_unavailable");
    let h = common::get(addr, "/health").await;
    assert_eq!((h.status, h.json()["status"].as_str()), (503, Some("no workers")));
    // Out of discovery but still reporting (it finishes what it has): among the departed,
    // draining.
    let view = routed.dashboard();
    assert!(view.workers.iter().all(|w| w.name != "w-0"));
    let dash = routed.clone();
    common::wait_until(Duration::from_secs(10), || {
        dash.dashboard().departed.iter().any(|w| w.name == "w-0" && w.state == "draining")
    });
    served.server.abort();
    stack.shutdown().await;
}

/// When every worker's queue is full, the frontend answers as one engine would: 429 with a
/// `Retry-After` (counted), never a 503 that says no worker could serve.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_worker_overloaded_is_a_429_with_retry_after() {
    let discovery: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new());
    let bus: Arc<dyn EventBus> = Arc::new(MemoryBus::new());
    // One sequence running and one waiting each, 1 s per 100-token prompt: the twelve
    // requests arrive well within one prompt's time, even on a loaded machine.
    let mock = MockConfig { prefill_us_per_token: 10_000.0, ..MockConfig::default() };
    let sched = SchedulerConfig { batch_max: 1, waiting_max: 1, ..SchedulerConfig::default() };
    let mut workers = Vec::new();
    for name in ["ov-0", "ov-1"] {
        let cfg = worker_config(name, SECRET, false, mock, sched.clone());
        workers.push(start_worker(cfg, &discovery, &bus).await);
    }
    let (routed, addr) = frontend(&discovery, &bus).await;
    assert!(routed.wait_for_workers(2, Duration::from_secs(10)).await);
    let tasks: Vec<_> = (0..12)
        .map(|i| {
            let body = json!({ "model": "mock", "prompt": format!("{i:03} {}", "x".repeat(96)),
                "max_tokens": 2 });
            tokio::spawn(async move { common::post_json(addr, "/v1/completions", &body).await })
        })
        .collect();
    let mut refused = 0;
    for t in tasks {
        let r = t.await.unwrap();
        match r.status {
            200 => {}
            429 => {
                refused += 1;
                let after: u64 = r.header("retry-after").expect("Retry-After").parse().unwrap();
                assert!(after >= 1, "Retry-After {after}");
                assert!(r.text().contains("overloaded"), "{}", r.text());
            }
            s => panic!("status {s}: {}", r.text()),
        }
    }
    // Two running and two waiting at most: most of the twelve are refused.
    assert!(refused >= 4, "{refused} refused");
    assert_eq!(routed.stats().overloaded.load(Ordering::Relaxed), refused);
    assert_eq!(routed.stats().no_worker.load(Ordering::Relaxed), 0);
}
