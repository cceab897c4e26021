//! Disaggregated prefill/decode across processes over real etcd and NATS: with the real model
//! and greedy decoding, a decode worker whose long prompts are prefilled by a prefill worker
//! (over tcp, and over shm) answers token for token like an aggregated worker, below and above
//! the threshold; a prefill worker killed -9 mid-prefill leaves every request completing
//! (local fallback). KV writes are checksummed per block by the transfer engine and verified
//! by the decode worker's agent before it is notified.

use crate::common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{get, post_json, spawn_worker, Proc};
use kvfabric::control::etcd::EtcdDiscovery;
use kvfabric::control::nats::NatsBus;
use kvfabric::control::Discovery as _;
use kvfabric::testkit::{EtcdServer, NatsServer};
use kvfabric_router::{RouterConfig, RoutingMode};
use kvfabric_serving::http::{router, ServerConfig};
use kvfabric_serving::routed::{RoutedBackend, RoutedConfig};
use kvfabric_serving::worker::PREFILL_KIND;
use serde_json::{json, Value};

const SECRET: &str = "disagg-test-secret";

/// A worker process, once registered (its ready line comes after its registration), and its
/// ready line.
fn worker_line(
    name: &str,
    ns: &str,
    etcd: &EtcdServer,
    nats: &NatsServer,
    extra: &[&str],
) -> (Proc, Value) {
    let (etcd, nats) = (etcd.endpoint(), nats.url());
    let args = [
        &["--namespace", ns, "--lease-ttl-s", "2", "--secret", SECRET][..],
        &["--etcd", &etcd, "--nats", &nats, "--disk-blocks", "0"],
        extra,
    ]
    .concat();
    spawn_worker(name, &args)
}

fn worker(name: &str, ns: &str, etcd: &EtcdServer, nats: &NatsServer, extra: &[&str]) -> Proc {
    worker_line(name, ns, etcd, nats, extra).0
}

async fn frontend(ns: &str, etcd: &EtcdServer, nats: &NatsServer) -> SocketAddr {
    let discovery = Arc::new(EtcdDiscovery::connect(&[etcd.endpoint()], ns).await.unwrap());
    let bus = Arc::new(NatsBus::connect(&nats.url(), ns).await.unwrap());
    let cfg = RoutedConfig {
        router: RouterConfig { mode: RoutingMode::Kv, ..RouterConfig::default() },
        ..RoutedConfig::new(SECRET)
    };
    let backend = Arc::new(RoutedBackend::start(discovery, bus, cfg).await.unwrap());
    let app = router(
        backend,
        ServerConfig { request_timeout: Duration::from_secs(120), ..ServerConfig::default() },
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

async fn wait_workers(addr: SocketAddr, n: usize) {
    let start = Instant::now();
    loop {
        let h = get(addr, "/health").await.json();
        if h["routing"]["workers"].as_array().is_some_and(|w| w.len() == n) {
            return;
        }
        assert!(start.elapsed() < Duration::from_secs(30), "workers did not register: {h}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until discovery lists `ids` under `kind` in namespace `ns` (prefill workers register
/// under their own kind, which decode workers list when they start).
async fn registered(etcd: &EtcdServer, ns: &str, kind: &str, ids: &[&str]) {
    let d = EtcdDiscovery::connect(&[etcd.endpoint()], ns).await.unwrap();
    let start = Instant::now();
    loop {
        let listed = d.list(kind).await.unwrap();
        if ids.iter().all(|id| listed.iter().any(|i| i.id == *id)) {
            return;
        }
        assert!(start.elapsed() < Duration::from_secs(30), "{ids:?} not registered as {kind}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until discovery no longer lists `id` under `kind` in namespace `ns` (its lease ran
/// out).
async fn unregistered(etcd: &EtcdServer, ns: &str, kind: &str, id: &str) {
    let d = EtcdDiscovery::connect(&[etcd.endpoint()], ns).await.unwrap();
    let start = Instant::now();
    while d.list(kind).await.unwrap().iter().any(|i| i.id == id) {
        assert!(start.elapsed() < Duration::from_secs(30), "{id} still registered as {kind}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A counter of a worker's `/metrics`.
async fn counter(metrics: SocketAddr, name: &str) -> f64 {
    common::metric(&get(metrics, "/metrics").await.text(), name)
}

fn model_path() -> String {
    std::env::var("KVFABRIC_TEST_MODEL").unwrap_or_else(|_| {
        format!(
            "{}/.cache/kvfabric/models/SmolLM2-135M-Instruct.Q4_1.gguf",
            std::env::var("HOME").unwrap()
        )
    })
}

fn chat(user: &str) -> Value {
    json!({
        "model": "SmolLM2-135M-Instruct.Q4_1", "temperature": 0, "max_tokens": 16,
        "messages": [
            {"role": "system", "content": "You are a patient teacher. Explain things step by step, in plain words, with one short example each time, and never use lists."},
            {"role": "user", "content": user},
        ],
    })
}

fn text(v: &Value) -> String {
    v["choices"][0]["message"]["content"].as_str().unwrap_or_else(|| panic!("{v}")).to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disaggregated_output_equals_aggregated_over_tcp_and_over_shm() {
    let (etcd, nats) = (EtcdServer::start().unwrap(), NatsServer::start().unwrap());
    let model = model_path();
    let llama = ["--model", model.as_str()];
    let _agg = worker("agg", "agg", &etcd, &nats, &llama);
    let mut procs = Vec::new();
    for transport in ["tcp", "shm"] {
        procs.push(worker(
            &format!("p-{transport}"),
            transport,
            &etcd,
            &nats,
            &[&llama[..], &["--role", "prefill"]].concat(),
        ));
    }
    registered(&etcd, "tcp", PREFILL_KIND, &["p-tcp"]).await;
    registered(&etcd, "shm", PREFILL_KIND, &["p-shm"]).await;
    for transport in ["tcp", "shm"] {
        let extra = [
            &llama[..],
            &["--role", "decode", "--prefill-threshold", "64", "--kv-transport", transport],
        ]
        .concat();
        procs.push(worker(&format!("d-{transport}"), transport, &etcd, &nats, &extra));
    }
    let agg = frontend("agg", &etcd, &nats).await;
    let tcp = frontend("tcp", &etcd, &nats).await;
    let shm = frontend("shm", &etcd, &nats).await;
    for f in [agg, tcp, shm] {
        wait_workers(f, 1).await;
    }
    let short = "Why is the sky blue?";
    let long = "I am learning about the water cycle for a school project. Can you tell me how rain forms, starting from the ocean, and what role the sun plays in it? My teacher also asked us to explain why clouds do not fall down, and where snow comes from in winter.";
    for q in [short, long] {
        let want = post_json(agg, "/v1/chat/completions", &chat(q)).await.json();
        for (name, f) in [("tcp", tcp), ("shm", shm)] {
            let got = post_json(f, "/v1/chat/completions", &chat(q)).await;
            assert_eq!(got.status, 200, "{}", got.text());
            let got = got.json();
            assert_eq!(text(&got), text(&want), "{name}: disaggregated answer differs for {q:?}");
            let remote = &got["kvfabric"]["remote_prefill"];
            let prompt = got["usage"]["prompt_tokens"].as_u64().unwrap();
            let cached = got["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
            if q == long {
                // The system prompt's blocks are held from the short question: only the rest
                // is prefilled remotely and sent.
                assert_eq!(remote["worker"], format!("p-{name}"), "{name}: {got}");
                assert_eq!(cached, 32, "{got}");
                let blocks = remote["blocks"].as_u64().unwrap();
                assert_eq!(blocks, (prompt - 1) / 16 - 2, "{got}");
                assert_eq!(remote["bytes"].as_u64().unwrap(), blocks * 737_280);
            } else {
                assert!(remote.is_null(), "{name}: a short prompt went remote: {got}");
            }
        }
    }
    // The same long prompt again: the decode worker holds its blocks now, nothing is sent.
    let again = post_json(tcp, "/v1/chat/completions", &chat(long)).await.json();
    assert!(again["kvfabric"]["remote_prefill"].is_null(), "{again}");
    assert!(again["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap() > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_worker_killed_mid_prefill_leaves_every_request_completing() {
    let (etcd, nats) = (EtcdServer::start().unwrap(), NatsServer::start().unwrap());
    // Slow mock prefill: a 600-token prompt takes 1.2 s on the prefill worker.
    let mock = ["--engine", "mock", "--mock-prefill-us", "2000", "--mock-decode-us", "2000"];
    let prefill_args =
        [&mock[..], &["--role", "prefill", "--metrics-listen", "127.0.0.1:0"]].concat();
    let (prefill, line) = worker_line("p0", "kill", &etcd, &nats, &prefill_args);
    let prefill_metrics: SocketAddr = line["metrics"].as_str().unwrap().parse().unwrap();
    registered(&etcd, "kill", PREFILL_KIND, &["p0"]).await;
    let decode_args = [
        &mock[..],
        &["--role", "decode", "--prefill-threshold", "64", "--prefill-deadline-ms", "4000"],
    ]
    .concat();
    let _decode = worker("d0", "kill", &etcd, &nats, &decode_args);
    let f = frontend("kill", &etcd, &nats).await;
    wait_workers(f, 1).await;

    // One request prefilled remotely while the prefill worker is alive.
    let body = |i: usize| json!({"model": "mock", "prompt": format!("{i:03} {}", "x".repeat(600)), "max_tokens": 8, "temperature": 0});
    let ok = post_json(f, "/v1/completions", &body(999)).await.json();
    assert_eq!(ok["kvfabric"]["remote_prefill"]["worker"], "p0", "{ok}");

    let before = counter(prefill_metrics, "kvfabric_prefill_tokens_total").await;
    let tasks: Vec<_> = (0..4)
        .map(|i| tokio::spawn(async move { post_json(f, "/v1/completions", &body(i)).await }))
        .collect();
    // Mid-prefill: the prefill worker has computed part of the new prompts (4 x 600 tokens
    // take it about 5 s), not all.
    let start = Instant::now();
    while counter(prefill_metrics, "kvfabric_prefill_tokens_total").await <= before {
        assert!(start.elapsed() < Duration::from_secs(20), "the prefill worker never started");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    drop(prefill); // kill -9, mid-prefill
    let start = Instant::now();
    for t in tasks {
        let r = tokio::time::timeout(Duration::from_secs(30), t)
            .await
            .expect("a request hung")
            .unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        let v = r.json();
        assert_eq!(v["usage"]["completion_tokens"], 8);
        assert!(v["kvfabric"]["remote_prefill"].is_null(), "prefilled by a dead worker? {v}");
    }
    assert!(start.elapsed() < Duration::from_secs(20));
    // Later requests do not wait on the dead worker once its lease is gone.
    unregistered(&etcd, "kill", PREFILL_KIND, "p0").await;
    let t = Instant::now();
    let r = post_json(f, "/v1/completions", &body(7)).await;
    assert_eq!(r.status, 200);
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "waited {:?} for a dead prefill worker",
        t.elapsed()
    );
}

/// One prefill worker and one decode worker in this process on the embedded control plane,
/// each a mock engine of its own timing.
struct InProcess {
    decode: kvfabric_serving::disagg::DecodeBackend,
    prefill_stats: Arc<kvfabric_serving::disagg::PrefillStats>,
    faults: Arc<kvfabric::transport::fault::FaultInjector>,
    _keep: Vec<Box<dyn std::any::Any + Send + Sync>>,
}

impl InProcess {
    async fn start(
        prefill: kvfabric_serving::engine::mock::MockConfig,
        decode: kvfabric_serving::engine::mock::MockConfig,
        parallel: usize,
        disagg: kvfabric_serving::disagg::DisaggConfig,
    ) -> Self {
        use kvfabric::agent::{Agent, AgentConfig};
        use kvfabric::control::memory::{MemoryBus, MemoryDiscovery};
        use kvfabric::control::{Discovery, EventBus, Instance};
        use kvfabric::events::NullSink;
        use kvfabric::layout::{KvDtype, ModelSpec};
        use kvfabric::transport::fault::FaultInjector;
        use kvfabric_serving::backend::LocalBackend;
        use kvfabric_serving::disagg::{run_prefill_service, DecodeBackend, PrefillStats};
        use kvfabric_serving::engine::mock::{MockConfig, MockEngine};
        use kvfabric_serving::engine::{Scheduler, SchedulerConfig};
        use kvfabric_serving::worker::{CodecSpec, Role, WorkerMetadata};
        use kvfabric_tiers::{StoreConfig, TieredStore};

        let layout = ModelSpec::preset("smollm2-135m")
            .unwrap()
            .with_dtype(KvDtype::F32)
            .block_layout(16)
            .unwrap();
        let discovery: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new());
        let bus: Arc<dyn EventBus> = Arc::new(MemoryBus::new());
        let rt = tokio::runtime::Handle::current();
        let node = |name: &str, faults: Option<Arc<FaultInjector>>, mock: MockConfig| {
            let (name, rt) = (name.to_string(), rt.clone());
            async move {
                let mut cfg = AgentConfig::new(name, SECRET.as_bytes().to_vec());
                cfg.faults = faults;
                let agent = Agent::start(cfg).await.unwrap();
                let store = TieredStore::open(
                    StoreConfig::new(layout.bytes_per_block(), 1024),
                    &agent,
                    Arc::new(NullSink),
                )
                .await
                .unwrap();
                let engine = MockEngine::new("mock", layout, mock).unwrap();
                let sched = Scheduler::start(engine, store.clone(), SchedulerConfig::default(), rt)
                    .unwrap();
                (agent, store, sched)
            }
        };
        let faults = FaultInjector::new();
        let (pa, ps, psched) = node("prefill-0", Some(faults.clone()), prefill).await;
        let prefill_stats = Arc::new(PrefillStats::default());
        let service = run_prefill_service(
            pa.clone(),
            psched.clone(),
            ps,
            bus.clone(),
            parallel,
            prefill_stats.clone(),
        );
        let md = WorkerMetadata {
            model: psched.info().clone(),
            codec: CodecSpec::Bytes,
            addr: pa.listen_addr(),
            role: Role::Prefill,
            api: Default::default(),
            store: None,
        };
        let reg = discovery
            .register(
                Instance {
                    kind: PREFILL_KIND.into(),
                    id: "prefill-0".into(),
                    metadata: serde_json::to_value(md).unwrap(),
                },
                Duration::from_secs(10),
            )
            .await
            .unwrap();
        let (da, ds, dsched) = node("decode-0", None, decode).await;
        let cfg = RoutedConfig { kind: PREFILL_KIND.into(), ..RoutedConfig::new(SECRET) };
        let router = RoutedBackend::start(discovery.clone(), bus.clone(), cfg).await.unwrap();
        let decode = DecodeBackend::start(
            LocalBackend::new(dsched.clone(), ds.clone()),
            ds,
            da,
            bus.clone(),
            router,
            disagg,
        )
        .await
        .unwrap();
        let keep: Vec<Box<dyn std::any::Any + Send + Sync>> = vec![
            Box::new(AbortOnDrop(service)),
            Box::new(reg),
            Box::new((pa, psched, dsched, discovery, bus)),
        ];
        InProcess { decode, prefill_stats, faults, _keep: keep }
    }

    /// Runs `req` through the decode worker: its remote prefill (None: prefilled locally),
    /// its tokens, and when its first token came.
    async fn run(
        &self,
        req: kvfabric_serving::engine::GenerateRequest,
    ) -> (Option<kvfabric_serving::engine::RemotePrefill>, Vec<u32>, Instant) {
        use kvfabric_serving::backend::Backend;
        use kvfabric_serving::engine::GenEvent;
        let mut rx = self.decode.submit("mock", req).unwrap();
        let (mut remote, mut tokens, mut first) = (None, Vec::new(), None);
        while let Some(ev) = rx.recv().await {
            match ev {
                GenEvent::Started { remote_prefill, .. } => remote = remote_prefill,
                GenEvent::Token { id, .. } => {
                    first.get_or_insert_with(Instant::now);
                    tokens.push(id)
                }
                GenEvent::Done { .. } => break,
                GenEvent::Error(e) => panic!("{e}"),
                GenEvent::Cached(_) | GenEvent::Accepted { .. } => {}
            }
        }
        (remote, tokens, first.expect("a first token"))
    }
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A request of `prompt` (bytes as tokens), `max_tokens` out, in `class`.
fn request(
    prompt: &str,
    max_tokens: usize,
    class: Option<kvfabric::contract::generate::ClassHint>,
) -> kvfabric_serving::engine::GenerateRequest {
    kvfabric_serving::engine::GenerateRequest {
        prompt: prompt.bytes().map(u32::from).collect(),
        max_tokens,
        sampling: Default::default(),
        stop: vec![],
        ignore_eos: false,
        timeout: Duration::from_secs(20),
        class,
        cache_salt: None,
        tenant: None,
        pull: None,
    }
}

/// In one process on the embedded control plane: a prefill worker whose transfers get a
/// corrupted checksum is caught by the decode worker's agent; the decode worker falls back to
/// local prefill and answers exactly as with a clean transfer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupted_kv_write_is_refused_and_the_request_falls_back() {
    use kvfabric_serving::disagg::DisaggConfig;
    use kvfabric_serving::engine::mock::MockConfig;
    let disagg = DisaggConfig {
        threshold_tokens: 64,
        deadline: Duration::from_secs(5),
        ..DisaggConfig::default()
    };
    let zero = MockConfig::zero_delay();
    let pair = InProcess::start(zero, zero, 2, disagg).await;
    // Clean: prefilled remotely, 12 blocks of a 200-token prompt written.
    let (remote, clean, _) = pair.run(request(&format!("A {}", "y".repeat(198)), 6, None)).await;
    let remote = remote.expect("prefilled remotely");
    assert_eq!((remote.worker.as_str(), remote.blocks), ("prefill-0", 12));
    // Corrupted: the decode agent refuses the write; the request is prefilled locally and
    // gives what the clean one gives for the same prompt shape.
    pair.faults.corrupt_checksums_next(1);
    let b = format!("B {}", "y".repeat(198));
    let (remote, corrupted, _) = pair.run(request(&b, 6, None)).await;
    assert!(remote.is_none(), "a corrupted transfer was accepted");
    // The same prompt once more is a plain cache hit of the locally computed blocks.
    let (_, local, _) = pair.run(request(&b, 6, None)).await;
    assert_eq!(corrupted, local);
    assert_eq!(clean.len(), 6);
    assert_eq!(pair.decode.stats().fallbacks.load(std::sync::atomic::Ordering::Relaxed), 1);
}

/// Service classes in a disaggregated layout. The prefill job carries its request's class:
/// an interactive prompt sent after four long batch prompts is computed first on the prefill
/// worker (its engine orders the jobs it holds by deadline), so its first token comes before
/// the batch ones'. And a prompt of a latency class (an ITL target) is prefilled on the
/// decode worker once that is measured to be faster than the prefill pool (counted), while
/// the same prompt of a class without an ITL target still goes to the prefill pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn classes_order_the_prefill_pool_and_a_latency_prompt_prefills_where_it_is_faster() {
    use kvfabric::contract::generate::ClassHint;
    use kvfabric_serving::disagg::DisaggConfig;
    use kvfabric_serving::engine::mock::MockConfig;
    use std::sync::atomic::Ordering::Relaxed;
    let timed = MockConfig {
        prefill_us_per_token: 40.0,
        decode_step_us: 0.0,
        decode_us_per_kv_token: 0.0,
        ..MockConfig::default()
    };
    let disagg = DisaggConfig {
        threshold_tokens: 64,
        deadline: Duration::from_secs(20),
        ..DisaggConfig::default()
    };
    let pair = Arc::new(InProcess::start(timed, timed, 16, disagg).await);
    let class = |name: &str, rank: u8, ttft_ms: u64, itl_ms: Option<u64>| ClassHint {
        name: name.into(),
        rank,
        priority: i32::from(rank),
        ttft: Some(Duration::from_millis(ttft_ms)),
        itl: itl_ms.map(Duration::from_millis),
        expire: None,
        share: None,
    };
    let batch = class("batch", 1, 30_000, None);
    // Four batch prompts of 3000 tokens (120 ms each on the prefill worker), then an
    // interactive one of 300 (12 ms) without an ITL target, so that it goes remote too.
    let mut jobs = Vec::new();
    for i in 0..4 {
        let (pair, c) = (pair.clone(), batch.clone());
        let prompt = format!("batch {i} {}", "b".repeat(3000));
        jobs.push(tokio::spawn(async move { pair.run(request(&prompt, 2, Some(c))).await }));
    }
    tokio::time::sleep(Duration::from_millis(30)).await;
    let interactive = class("interactive", 0, 300, None);
    let (remote, _, first) =
        pair.run(request(&format!("chat {}", "i".repeat(300)), 2, Some(interactive))).await;
    assert!(remote.is_some(), "the interactive prompt went to the prefill pool");
    let mut batch_firsts = Vec::new();
    for j in jobs {
        let (remote, _, t) = j.await.unwrap();
        assert!(remote.is_some(), "a batch prompt went to the prefill pool");
        batch_firsts.push(t);
    }
    let later = batch_firsts.iter().filter(|&&t| t > first).count();
    assert!(later >= 3, "{later} of 4 batch prompts finished after the interactive one");
    assert_eq!(pair.prefill_stats.done.load(Relaxed), 5);

    // A short prompt computed here measures this engine's prompt speed; the prefill pool's
    // is measured by the prompts above. A latency prompt is now faster here: no queue, no
    // transfer.
    pair.run(request("short", 2, None)).await;
    let latency = class("chat", 0, 300, Some(50));
    let prompt = format!("latency {}", "l".repeat(300));
    let (remote, _, _) = pair.run(request(&prompt, 2, Some(latency))).await;
    assert!(remote.is_none(), "a latency prompt went to the prefill pool");
    assert_eq!(pair.decode.stats().latency_local.load(Relaxed), 1);
    let (remote, _, _) = pair
        .run(request(
            &format!("other {}", "o".repeat(300)),
            2,
            Some(class("interactive", 0, 300, None)),
        ))
        .await;
    assert!(remote.is_some(), "a prompt without an ITL target stays with the prefill pool");
}

/// `kvfabric up --prefill-workers 1 --decode-workers 1`: one `/metrics` for the process shows
/// the in-process workers' counters, each labelled with its worker, each family once — a long
/// prompt's remote prefill is visible on the decode worker, its job on the prefill worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_metrics_show_the_in_process_workers_remote_prefill() {
    use std::io::{BufRead, BufReader};
    let mut up = std::process::Command::new(env!("CARGO_BIN_EXE_kvfabric"))
        .args(["up", "--engine", "mock", "--port", "0", "--disk-blocks", "0"])
        .args(["--prefill-workers", "1", "--decode-workers", "1", "--prefill-threshold", "32"])
        .args(["--mock-decode-us", "100", "--mock-prefill-us", "1"])
        .env_remove("KVFABRIC_CONFIG")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(up.stdout.take().unwrap()).lines();
    let _up = Proc(up);
    let first = lines.next().unwrap().unwrap();
    let url = first.split(" at ").nth(1).unwrap().trim().to_string();
    let addr: SocketAddr =
        url.trim_start_matches("http://").trim_end_matches("/v1").parse().unwrap();
    std::thread::spawn(move || lines.for_each(drop));
    // The frontend routes to the decode worker once it is in the index.
    let start = Instant::now();
    while get(addr, "/health").await.json()["routing"]["workers"]
        .as_array()
        .is_none_or(|w| w.is_empty())
    {
        assert!(start.elapsed() < Duration::from_secs(30), "no worker registered");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let prompt = "a long prompt for a prefill worker: ".repeat(8);
    let r = post_json(
        addr,
        "/v1/completions",
        &json!({"model": "mock", "prompt": prompt, "max_tokens": 4}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());

    let text = get(addr, "/metrics").await.text();
    let decode = "worker=\"worker-decode-0\"";
    let prefill = "worker=\"worker-prefill-0\"";
    assert_eq!(
        common::metric(&text, &format!("kvfabric_prefills_total{{{decode},where=\"remote\"}}")),
        1.0,
        "{text}"
    );
    assert!(
        common::metric(&text, &format!("kvfabric_remote_prefill_bytes_total{{{decode}}}")) > 0.0
    );
    assert_eq!(
        common::metric(&text, &format!("kvfabric_prefill_jobs_done_total{{{prefill}}}")),
        1.0
    );
    assert_eq!(common::metric(&text, "kvfabric_requests_total{outcome=\"ok\"}"), 1.0);
    assert!(common::metric(&text, "kvfabric_frontend_routed_total") >= 1.0);
    // Each family is described once, whatever the number of workers showing it.
    let mut types: Vec<&str> = text.lines().filter(|l| l.starts_with("# TYPE ")).collect();
    let n = types.len();
    types.sort();
    types.dedup();
    assert_eq!(types.len(), n, "{text}");
    assert!(text.ends_with("# EOF\n"));

    // A cache salt goes with the job: the prefill worker computes a salted prompt afresh
    // (nothing of the unsalted one, nor of another salt, is a hit there), and the decode
    // worker stores the blocks under the salted names, so the same salt hits them next time.
    let salted = |salt: &str| json!({"model": "mock", "prompt": prompt, "max_tokens": 4, "cache_salt": salt});
    let cached = |r: &common::Response| {
        r.json()["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap()
    };
    let alice = post_json(addr, "/v1/completions", &salted("alice")).await;
    assert_eq!(cached(&alice), 0, "{}", alice.text());
    let again = post_json(addr, "/v1/completions", &salted("alice")).await;
    assert!(cached(&again) > 0, "alice reads her remotely prefilled blocks: {}", again.text());
    let bob = post_json(addr, "/v1/completions", &salted("bob")).await;
    assert_eq!(cached(&bob), 0, "{}", bob.text());
    let text = get(addr, "/metrics").await.text();
    assert_eq!(
        common::metric(&text, &format!("kvfabric_prefills_total{{{decode},where=\"remote\"}}")),
        3.0,
        "the first, alice's and bob's: {text}"
    );
    assert_eq!(
        common::metric(&text, &format!("kvfabric_kv_hit_tokens_total{{{prefill},tier=\"host\"}}")),
        0.0,
        "no salt read another's blocks on the prefill worker"
    );
}
