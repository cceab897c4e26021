//! Distributed serving over real etcd and NATS servers: `kvfabric worker` processes (the mock
//! engine, and the real model in one test) behind a routing frontend in this process.
//! Requests sharing a long prefix land on the worker that caches it; a worker killed -9
//! under load leaves no request hanging and leaves routing within its lease TTL; a worker
//! added under load starts receiving requests.

use crate::common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{get, post_json, spawn_worker, Proc};
use kvfabric::control::etcd::EtcdDiscovery;
use kvfabric::control::nats::NatsBus;
use kvfabric::testkit::{EtcdServer, NatsServer};
use kvfabric_router::{RouterConfig, RoutingMode};
use kvfabric_serving::http::{router, ServerConfig};
use kvfabric_serving::routed::{RoutedBackend, RoutedConfig};
use serde_json::json;

const SECRET: &str = "distributed-test-secret";

struct Worker {
    _proc: Proc,
    name: String,
}

fn worker(name: &str, etcd: &EtcdServer, nats: &NatsServer, extra: &[&str]) -> Worker {
    let (etcd, nats) = (etcd.endpoint(), nats.url());
    let args = [
        &["--namespace", "dist", "--lease-ttl-s", "2", "--etcd", &etcd, "--nats", &nats][..],
        &["--secret", SECRET],
        extra,
    ]
    .concat();
    Worker { _proc: spawn_worker(name, &args).0, name: name.to_string() }
}

fn mock_worker(name: &str, etcd: &EtcdServer, nats: &NatsServer, decode_us: &str) -> Worker {
    worker(
        name,
        etcd,
        nats,
        &[
            "--engine",
            "mock",
            "--disk-blocks",
            "0",
            "--mock-decode-us",
            decode_us,
            "--mock-prefill-us",
            "5",
        ],
    )
}

struct Frontend {
    addr: SocketAddr,
    backend: Arc<RoutedBackend>,
}

async fn frontend(etcd: &EtcdServer, nats: &NatsServer, mode: RoutingMode) -> Frontend {
    let cfg = RoutedConfig {
        router: RouterConfig { mode, ..RouterConfig::default() },
        connect_timeout: Duration::from_millis(500),
        ..RoutedConfig::new(SECRET)
    };
    frontend_with(etcd, nats, cfg).await
}

async fn frontend_with(etcd: &EtcdServer, nats: &NatsServer, cfg: RoutedConfig) -> Frontend {
    frontend_with_classes(etcd, nats, cfg, &[]).await
}

/// A frontend with these service classes (`--class` specs).
async fn frontend_with_classes(
    etcd: &EtcdServer,
    nats: &NatsServer,
    cfg: RoutedConfig,
    classes: &[&str],
) -> Frontend {
    // The frontend's own log (retries, deadlines) beside the workers': a failure says why.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new("info,async_nats=warn"))
        .with_test_writer()
        .try_init();
    let discovery = Arc::new(EtcdDiscovery::connect(&[etcd.endpoint()], "dist").await.unwrap());
    let bus = Arc::new(NatsBus::connect(&nats.url(), "dist").await.unwrap());
    let backend = Arc::new(RoutedBackend::start(discovery, bus, cfg).await.unwrap());
    let specs: Vec<String> = classes.iter().map(|c| c.to_string()).collect();
    let server = ServerConfig {
        request_timeout: Duration::from_secs(60),
        classes: kvfabric_serving::classes::Classes::from_specs_and_file(&specs, None).unwrap(),
        ..ServerConfig::default()
    };
    let app = router(backend.clone(), server);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    Frontend { addr, backend }
}

async fn wait_for(what: &str, limit: Duration, mut f: impl AsyncFnMut() -> bool) {
    let start = Instant::now();
    while !f().await {
        assert!(start.elapsed() < limit, "timed out after {limit:?} waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until the frontend knows its one worker `name` and has its first load report (its
/// engine steps).
async fn the_only_worker_reports(f: &Frontend, name: &str) {
    wait_for("the worker", Duration::from_secs(10), async || workers_known(f).await.len() == 1)
        .await;
    wait_for("its first load report", Duration::from_secs(10), async || {
        f.backend.worker_steps(name).is_some()
    })
    .await;
}

async fn workers_known(f: &Frontend) -> Vec<String> {
    let h: kvfabric::health::Health = serde_json::from_value(get(f.addr, "/health").await.json())
        .expect("/health is the health document");
    h.routing.map(|r| r.workers).unwrap_or_default()
}

fn completion(prompt: &str, max_tokens: u32) -> serde_json::Value {
    json!({"model": "mock", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_sharing_a_long_prefix_land_on_the_worker_that_caches_it() {
    let (etcd, nats) = (EtcdServer::start().unwrap(), NatsServer::start().unwrap());
    let _w: Vec<Worker> =
        (0..3).map(|i| mock_worker(&format!("w{i}"), &etcd, &nats, "2000")).collect();
    let f = frontend(&etcd, &nats, RoutingMode::Kv).await;
    wait_for("3 workers", Duration::from_secs(10), async || workers_known(&f).await.len() == 3)
        .await;

    let prefix = "A long shared system prompt that many requests start with. ".repeat(8);
    let first =
        post_json(f.addr, "/v1/completions", &completion(&format!("{prefix}question 0"), 4)).await;
    assert_eq!(first.status, 200, "{}", first.text());
    let home = first.header("x-kvfabric-worker").unwrap().to_string();
    // The worker's Stored events reach the frontend's index over NATS.
    let b = f.backend.clone();
    wait_for("the prefix's KV events", Duration::from_secs(10), async || {
        b.feed_stats().applied.load(std::sync::atomic::Ordering::Relaxed) >= 30
    })
    .await;
    for i in 1..6 {
        let r =
            post_json(f.addr, "/v1/completions", &completion(&format!("{prefix}question {i}"), 4))
                .await;
        assert_eq!(r.status, 200);
        assert_eq!(
            r.header("x-kvfabric-worker"),
            Some(home.as_str()),
            "request {i} left the cache"
        );
        let cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
        assert!(cached >= (prefix.len() as u64 / 16) * 16 - 16, "only {cached} tokens cached");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_under_load_hangs_no_request_and_leaves_routing() {
    let (etcd, nats) = (EtcdServer::start().unwrap(), NatsServer::start().unwrap());
    let mut ws: Vec<Worker> =
        (0..3).map(|i| mock_worker(&format!("w{i}"), &etcd, &nats, "4000")).collect();
    let f = frontend(&etcd, &nats, RoutingMode::RoundRobin).await;
    wait_for("3 workers", Duration::from_secs(10), async || workers_known(&f).await.len() == 3)
        .await;

    let addr = f.addr;
    let load: Vec<_> = (0..18)
        .map(|i| {
            tokio::spawn(async move {
                let started = Instant::now();
                let r = post_json(addr, "/v1/completions", &completion(&format!("load {i}"), 150))
                    .await;
                (r, started.elapsed())
            })
        })
        .collect();
    // Under load: every request routed (round-robin: six on each worker), none finished.
    let b = f.backend.clone();
    wait_for("the load to be routed", Duration::from_secs(10), async || {
        b.stats().routed.load(std::sync::atomic::Ordering::Relaxed) >= 18
    })
    .await;
    let victim = ws.remove(1);
    let dead = victim.name.clone();
    drop(victim); // kill -9
                  // Until its lease expires the dead worker is still in discovery: requests routed to it
                  // are retried on another worker before any token was sent, and succeed.
    for i in 0..6 {
        let r = post_json(addr, "/v1/completions", &completion(&format!("during {i}"), 3)).await;
        assert_eq!(r.status, 200, "{}", r.text());
        assert_ne!(r.header("x-kvfabric-worker"), Some(dead.as_str()));
    }
    assert!(f.backend.stats().retries.load(std::sync::atomic::Ordering::Relaxed) >= 1);
    let mut ok = 0;
    for t in load {
        let (r, took) = tokio::time::timeout(Duration::from_secs(30), t)
            .await
            .expect("a request hung")
            .unwrap();
        assert!(took < Duration::from_secs(30));
        match r.status {
            200 => ok += 1,
            // Tokens had been produced by the dead worker: a clear error, not a hang.
            500 => {
                let msg = r.json()["error"]["message"].as_str().unwrap().to_string();
                assert!(
                    msg.contains(&dead) && msg.contains("after streaming had started"),
                    "{msg}"
                );
            }
            s => panic!("unexpected status {s}: {}", r.text()),
        }
    }
    assert!(ok >= 12, "only {ok} of 18 requests completed");
    // Within the lease TTL (2 s) the dead worker leaves discovery and routing.
    wait_for("the dead worker to leave", Duration::from_secs(8), async || {
        !workers_known(&f).await.contains(&dead)
    })
    .await;
    for i in 0..8 {
        let r = post_json(f.addr, "/v1/completions", &completion(&format!("after {i}"), 3)).await;
        assert_eq!(r.status, 200, "{}", r.text());
        assert_ne!(r.header("x-kvfabric-worker"), Some(dead.as_str()));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_added_under_load_starts_receiving_requests() {
    let (etcd, nats) = (EtcdServer::start().unwrap(), NatsServer::start().unwrap());
    let _w0 = mock_worker("w0", &etcd, &nats, "2000");
    let f = frontend(&etcd, &nats, RoutingMode::RoundRobin).await;
    wait_for("the first worker", Duration::from_secs(10), async || {
        workers_known(&f).await.len() == 1
    })
    .await;
    let addr = f.addr;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let served = Arc::new(parking_lot::Mutex::new(Vec::<String>::new()));
    let clients: Vec<_> = (0..4)
        .map(|c| {
            let (stop, served) = (stop.clone(), served.clone());
            tokio::spawn(async move {
                let mut i = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let r =
                        post_json(addr, "/v1/completions", &completion(&format!("c{c} r{i}"), 10))
                            .await;
                    assert_eq!(r.status, 200, "{}", r.text());
                    served.lock().push(r.header("x-kvfabric-worker").unwrap().to_string());
                    i += 1;
                }
            })
        })
        .collect();
    // Under load before the new worker comes.
    let s = served.clone();
    wait_for("the load to run", Duration::from_secs(10), async || s.lock().len() >= 4).await;
    let _w1 = mock_worker("w1", &etcd, &nats, "2000");
    let s = served.clone();
    wait_for("the new worker to serve", Duration::from_secs(15), async || {
        s.lock().iter().any(|w| w == "w1")
    })
    .await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for c in clients {
        c.await.unwrap();
    }
    assert!(served.lock().iter().any(|w| w == "w0"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_real_model_across_two_worker_processes_with_kv_routing() {
    let (etcd, nats) = (EtcdServer::start().unwrap(), NatsServer::start().unwrap());
    let model = std::env::var("KVFABRIC_TEST_MODEL").unwrap_or_else(|_| {
        format!(
            "{}/.cache/kvfabric/models/SmolLM2-135M-Instruct.Q4_1.gguf",
            std::env::var("HOME").unwrap()
        )
    });
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().to_str().unwrap();
    let _ws: Vec<Worker> = (0..2)
        .map(|i| {
            worker(
                &format!("llama{i}"),
                &etcd,
                &nats,
                &["--model", &model, "--data-dir", data, "--disk-blocks", "64"],
            )
        })
        .collect();
    let f = frontend(&etcd, &nats, RoutingMode::Kv).await;
    wait_for("2 workers", Duration::from_secs(20), async || workers_known(&f).await.len() == 2)
        .await;
    let models = get(f.addr, "/v1/models").await.json();
    assert_eq!(models["data"][0]["id"], "SmolLM2-135M-Instruct.Q4_1");
    let q = json!({
        "model": "SmolLM2-135M-Instruct.Q4_1", "temperature": 0, "max_tokens": 12,
        "messages": [
            {"role": "system", "content": "You are a geography teacher who answers briefly and precisely, in one sentence."},
            {"role": "user", "content": "What is the capital of France?"}
        ],
    });
    let a = post_json(f.addr, "/v1/chat/completions", &q).await;
    assert_eq!(a.status, 200, "{}", a.text());
    let home = a.header("x-kvfabric-worker").unwrap().to_string();
    let b = f.backend.clone();
    wait_for("the KV events", Duration::from_secs(10), async || {
        b.feed_stats().applied.load(std::sync::atomic::Ordering::Relaxed) >= 2
    })
    .await;
    let again = post_json(f.addr, "/v1/chat/completions", &q).await;
    assert_eq!(again.header("x-kvfabric-worker"), Some(home.as_str()));
    let (a, again) = (a.json(), again.json());
    assert_eq!(again["choices"][0]["message"]["content"], a["choices"][0]["message"]["content"]);
    assert!(again["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap() >= 32);
    let text = a["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(text.contains("Paris"), "{text:?}");
}

/// Serving workers use the KV fabric as their G4 tier: a worker without a disk tier spills a
/// prompt's blocks to a `kvfabric fabric` node under host pressure; a second worker process,
/// started after the first is gone and which never saw the prompt, serves it from the fabric.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_share_blocks_through_a_fabric_node() {
    use std::io::BufRead;
    let (etcd, nats) = (EtcdServer::start().unwrap(), NatsServer::start().unwrap());
    // The mock engine's blocks: SmolLM2-135M's layout in f32, 16 tokens.
    let mut node = std::process::Command::new(env!("CARGO_BIN_EXE_kvfabric"))
        .args(["fabric", "--name", "fabric-w", "--namespace", "dist", "--dtype", "f32"])
        .args(["--model", "smollm2-135m", "--block-tokens", "16", "--host-blocks", "256"])
        .args(["--etcd", &etcd.endpoint(), "--nats", &nats.url()])
        .env("KVFABRIC_SECRET", SECRET)
        .env_remove("KVFABRIC_CONFIG")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(node.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let node = Proc(node);
    assert!(line.contains("\"fabric\""), "the node did not start: {line:?}");

    let g4_worker = |name: &str| {
        // Every eviction goes to the fabric, however fast the loopback measures.
        let extra = ["--engine", "mock", "--disk-blocks", "0", "--host-blocks", "4"];
        let extra = [&extra[..], &["--fabric-write-min-mbps", "0"]].concat();
        let more = ["--mock-decode-us", "100", "--mock-prefill-us", "5"];
        worker(name, &etcd, &nats, &[&extra[..], &more[..]].concat())
    };
    let f = frontend(&etcd, &nats, RoutingMode::Kv).await;
    let prompt = "Blocks that travel between workers through the fabric. ".repeat(8);

    let a = g4_worker("g4-a");
    wait_for("worker a", Duration::from_secs(10), async || workers_known(&f).await == ["g4-a"])
        .await;
    let r = post_json(f.addr, "/v1/completions", &completion(&prompt, 4)).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    drop(a);
    wait_for("worker a gone", Duration::from_secs(10), async || workers_known(&f).await.is_empty())
        .await;

    let _b = g4_worker("g4-b");
    wait_for("worker b", Duration::from_secs(10), async || workers_known(&f).await == ["g4-b"])
        .await;
    let r = post_json(f.addr, "/v1/completions", &completion(&prompt, 4)).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-kvfabric-worker"), Some("g4-b"));
    let cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    // Worker a kept its last 4 blocks in host memory (lost with it); the rest went to the
    // fabric, which serves the leading run.
    assert!(cached >= 16 * 8, "only {cached} prompt tokens came from the fabric");
    drop(node);
}

/// SIGKILL, the death no cleanup code sees: a worker's host region is a memfd that peers on
/// the host open through its `/proc/{pid}/fd`, so nothing of it is left once the process is
/// gone (a `/dev/shm` file, as earlier versions made, outlived such a death).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_worker_leaves_no_shared_memory() {
    let etcd = EtcdServer::start().unwrap();
    let nats = NatsServer::start().unwrap();
    let w = mock_worker("w-kill", &etcd, &nats, "100");
    let pid = w._proc.0.id();
    let regions = common::shared_regions(pid);
    assert!(!regions.is_empty(), "the worker's host region is shared memory");
    let (path, _) = &regions[0];
    // Reachable as a peer reaches it while the worker lives, and nowhere in /dev/shm.
    let held = std::fs::OpenOptions::new().read(true).write(true).open(path);
    assert!(held.is_ok(), "{path}: {held:?}");
    drop(held);
    let in_dev_shm: Vec<_> =
        common::dev_shm_files().into_iter().filter(|f| f.contains(&format!(".{pid}."))).collect();
    assert_eq!(in_dev_shm, Vec::<String>::new());
    let mut w = w;
    w._proc.0.kill().unwrap();
    w._proc.0.wait().unwrap();
    assert!(std::fs::OpenOptions::new().read(true).open(path).is_err(), "{path} still opens");
    let in_dev_shm: Vec<_> =
        common::dev_shm_files().into_iter().filter(|f| f.contains(&format!(".{pid}."))).collect();
    assert_eq!(in_dev_shm, Vec::<String>::new(), "left behind by a killed worker");
}

/// A worker frozen with SIGSTOP (alive, still registered) under load: requests routed to it
/// get no handshake (or, mid-generation, no first token) in time, are retried on the other
/// worker and complete there; the frozen worker is avoided afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_worker_is_skipped_at_the_first_token_limit() {
    let (etcd, nats) = (EtcdServer::start().unwrap(), NatsServer::start().unwrap());
    let a = mock_worker("fz-a", &etcd, &nats, "500");
    let _b = mock_worker("fz-b", &etcd, &nats, "500");
    let cfg = RoutedConfig {
        router: RouterConfig { mode: RoutingMode::RoundRobin, ..RouterConfig::default() },
        first_token_timeout: Duration::from_secs(1),
        slow_penalty: Duration::from_secs(60),
        ..RoutedConfig::new(SECRET)
    };
    let f = frontend_with(&etcd, &nats, cfg).await;
    wait_for("2 workers", Duration::from_secs(10), async || workers_known(&f).await.len() == 2)
        .await;

    let pid = a._proc.0.id();
    common::freeze(pid);
    let start = Instant::now();
    let tasks: Vec<_> = (0..6)
        .map(|i| {
            let addr = f.addr;
            tokio::spawn(async move {
                let r = post_json(addr, "/v1/completions", &completion(&format!("frozen {i}"), 4))
                    .await;
                (r.status, r.header("x-kvfabric-worker").map(str::to_string), r.text())
            })
        })
        .collect();
    for t in tasks {
        let (status, worker, text) = t.await.unwrap();
        assert_eq!(status, 200, "{text}");
        assert_eq!(worker.as_deref(), Some("fz-b"));
    }
    // Each request waited at most one first-token limit for the frozen worker.
    assert!(start.elapsed() < Duration::from_secs(8), "took {:?}", start.elapsed());
    let skipped = f.backend.stats().slow_workers.load(std::sync::atomic::Ordering::Relaxed);
    assert!(skipped >= 1, "round robin sent a request to the frozen worker: {skipped}");
    // Penalised: the next requests go straight to the live worker.
    let t = Instant::now();
    let r = post_json(f.addr, "/v1/completions", &completion("after", 4)).await;
    assert_eq!((r.status, r.header("x-kvfabric-worker")), (200, Some("fz-b")));
    assert!(t.elapsed() < Duration::from_millis(900), "no wait for the frozen worker");
    let _ = std::process::Command::new("kill").args(["-CONT", &pid.to_string()]).status();
}

/// A worker that accepts a request but produces no first token in time (here: a very slow
/// prefill) is abandoned at the first-token limit; the request completes on another worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_first_token_in_time_retries_elsewhere() {
    let (etcd, nats) = (EtcdServer::start().unwrap(), NatsServer::start().unwrap());
    let slow_args = ["--engine", "mock", "--disk-blocks", "0", "--mock-prefill-us", "500000"];
    let _slow = worker("ft-slow", &etcd, &nats, &slow_args);
    let _fast = mock_worker("ft-fast", &etcd, &nats, "500");
    let cfg = RoutedConfig {
        router: RouterConfig { mode: RoutingMode::RoundRobin, ..RouterConfig::default() },
        first_token_timeout: Duration::from_secs(1),
        ..RoutedConfig::new(SECRET)
    };
    let f = frontend_with(&etcd, &nats, cfg).await;
    wait_for("2 workers", Duration::from_secs(10), async || workers_known(&f).await.len() == 2)
        .await;
    for i in 0..2 {
        let start = Instant::now();
        let r = post_json(f.addr, "/v1/completions", &completion(&format!("slow {i}"), 2)).await;
        assert_eq!((r.status, r.header("x-kvfabric-worker")), (200, Some("ft-fast")));
        assert!(start.elapsed() < Duration::from_secs(3), "took {:?}", start.elapsed());
    }
    let skipped = f.backend.stats().slow_workers.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(skipped, 1, "the slow worker was tried once, then avoided");
}

/// A worker with a long queue is not a frozen one: a request whose first token comes after
/// the first-token limit because requests ahead of it are computed (the worker's engine keeps
/// stepping, its reports say so) waits on there instead of being moved to the back of another
/// worker's queue, and the worker is not penalised.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_queue_is_waited_for_past_the_first_token_limit() {
    let (etcd, nats) = (EtcdServer::start().unwrap(), NatsServer::start().unwrap());
    // One sequence at a time, 2 ms per prompt token: each 400-token prompt takes 0.8 s.
    let args = ["--engine", "mock", "--disk-blocks", "0", "--mock-prefill-us", "2000"];
    let _busy = worker("lq-busy", &etcd, &nats, &[&args[..], &["--max-batch", "1"]].concat());
    let cfg =
        RoutedConfig { first_token_timeout: Duration::from_secs(1), ..RoutedConfig::new(SECRET) };
    let f = frontend_with(&etcd, &nats, cfg).await;
    the_only_worker_reports(&f, "lq-busy").await;
    let start = Instant::now();
    let tasks: Vec<_> = (0..3)
        .map(|i| {
            let addr = f.addr;
            tokio::spawn(async move {
                let prompt = format!("{i} {}", "queued behind the others ".repeat(16));
                let r = post_json(addr, "/v1/completions", &completion(&prompt, 2)).await;
                (r.status, r.header("x-kvfabric-worker").map(str::to_string), r.text())
            })
        })
        .collect();
    for t in tasks {
        let (status, worker, text) = t.await.unwrap();
        assert_eq!((status, worker.as_deref()), (200, Some("lq-busy")), "{text}");
    }
    let stats = f.backend.stats();
    let load = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
    // The last of the three had its first token after two prompts (1.6 s or more).
    assert!(start.elapsed() > Duration::from_millis(1600), "took {:?}", start.elapsed());
    assert!(load(&stats.long_first_token_waits) >= 1, "no request waited past the limit");
    assert_eq!(load(&stats.slow_workers), 0, "a working worker was treated as frozen");
    assert_eq!(load(&stats.retries), 0, "a queued request was moved");
}

/// A stream paused by its engine is not a stalled one: a batch request's decode yields the
/// only batch slot to an interactive request that decodes for longer than the frontend's
/// inter-token limit; the worker's engine keeps stepping (its reports say so), so the
/// frontend waits on (a paused stream, counted) instead of moving the stream, and the client
/// gets the batch answer whole, as it is unpaused (the mock derives each token from all
/// before it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_stream_is_waited_for_past_the_stall_limit() {
    let (etcd, nats) = (EtcdServer::start().unwrap(), NatsServer::start().unwrap());
    // One sequence at a time, 4 ms a decode step.
    let args = ["--engine", "mock", "--disk-blocks", "0", "--max-batch", "1"];
    let _w = worker("ps-w", &etcd, &nats, &[&args[..], &["--mock-decode-us", "4000"]].concat());
    let cfg = RoutedConfig { stall_timeout: Duration::from_secs(1), ..RoutedConfig::new(SECRET) };
    let classes = ["interactive:ttft=300ms,itl=50ms", "batch:ttft=30s,default"];
    let f = frontend_with_classes(&etcd, &nats, cfg, &classes).await;
    the_only_worker_reports(&f, "ps-w").await;
    let ask = |class: &str, prompt: &str, n: u32| {
        let mut body = completion(prompt, n);
        body["kvfabric"] = json!({ "class": class });
        body
    };
    let batch = ask("batch", "a batch job that yields", 400);
    let alone = post_json(f.addr, "/v1/completions", &batch).await;
    assert_eq!(alone.status, 200, "{}", alone.text());
    let addr = f.addr;
    let paused = tokio::spawn(async move { post_json(addr, "/v1/completions", &batch).await });
    // 400 tokens take 1.6 s: well under way, it meets the interactive request, which decodes
    // 400 tokens too (1.6 s, past the 1 s limit) in its slot.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let quick = post_json(f.addr, "/v1/completions", &ask("interactive", "urgent", 400)).await;
    assert_eq!(quick.status, 200, "{}", quick.text());
    let resumed = paused.await.unwrap();
    assert_eq!(resumed.status, 200, "{}", resumed.text());
    let text = |r: &common::Response| r.json()["choices"][0]["text"].as_str().unwrap().to_string();
    assert_eq!(text(&resumed), text(&alone), "the paused stream's answer changed");
    let stats = f.backend.stats();
    let load = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
    assert!(load(&stats.paused_streams) >= 1, "no stream waited past the limit");
    assert_eq!(load(&stats.stalled_streams), 0, "a paused stream was taken for a stalled one");
    assert_eq!(load(&stats.migrations), 0);
}

/// A worker frozen (SIGSTOP) in the middle of a stream: the frontend stops waiting after the
/// inter-token deadline and moves the stream to the other worker, which continues from the
/// prompt and the tokens already sent. The client sees one stream, as long and with the same
/// text as an uninterrupted one (the mock derives each token from all before it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_on_a_frozen_worker_moves_to_another_and_completes() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (etcd, nats) = (EtcdServer::start().unwrap(), NatsServer::start().unwrap());
    let workers =
        [mock_worker("mv-a", &etcd, &nats, "20000"), mock_worker("mv-b", &etcd, &nats, "20000")];
    let cfg = RoutedConfig { stall_timeout: Duration::from_secs(1), ..RoutedConfig::new(SECRET) };
    let f = frontend_with(&etcd, &nats, cfg).await;
    wait_for("2 workers", Duration::from_secs(10), async || workers_known(&f).await.len() == 2)
        .await;
    let prompt = "a stream that outlives its worker";
    let reference = post_json(f.addr, "/v1/completions", &completion(prompt, 60)).await;
    assert_eq!(reference.status, 200, "{}", reference.text());
    let want = reference.json()["choices"][0]["text"].as_str().unwrap().to_string();

    // Streamed: the worker is known from the response head, sent with the first token.
    let mut body = completion(prompt, 60);
    body["stream"] = json!(true);
    let mut c = tokio::net::TcpStream::connect(f.addr).await.unwrap();
    c.write_all(&common::request_bytes("POST", "/v1/completions", Some(&body.to_string())))
        .await
        .unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !got.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = c.read(&mut buf).await.unwrap();
        assert!(n > 0, "closed before the head");
        got.extend_from_slice(&buf[..n]);
    }
    let head = String::from_utf8_lossy(&got).to_string();
    let serving = head
        .lines()
        .find_map(|l| l.strip_prefix("x-kvfabric-worker: "))
        .expect("the worker header")
        .trim()
        .to_string();
    let frozen = workers.iter().find(|w| w.name == serving).unwrap();
    let pid = frozen._proc.0.id();
    tokio::time::sleep(Duration::from_millis(200)).await; // some tokens on the way
    common::freeze(pid);
    let stopped = Instant::now();
    tokio::time::timeout(Duration::from_secs(30), c.read_to_end(&mut got)).await.unwrap().unwrap();
    let took = stopped.elapsed();
    let _ = std::process::Command::new("kill").args(["-CONT", &pid.to_string()]).status();
    let r = common::parse_response(&got);
    let (text, events) = common::streamed_text(&r);
    assert_eq!(text, want, "the moved stream's text");
    assert!(events.iter().all(|e| e.get("error").is_none()), "{events:?}");
    let usage = events.iter().rev().find_map(|e| e.get("usage").filter(|u| !u.is_null()));
    if let Some(u) = usage {
        assert_eq!(u["completion_tokens"], 60, "{u}");
    }
    assert!(took < Duration::from_secs(8), "the stream stalled {took:?}");
    let s = f.backend.stats();
    assert_eq!(s.migrations.load(std::sync::atomic::Ordering::Relaxed), 1);
    assert_eq!(s.stalled_streams.load(std::sync::atomic::Ordering::Relaxed), 1);
}

/// A stream whose worker is cut off (here: frozen, so its lease runs out and its reports
/// stop) moves to another worker once the worker has left discovery and gone silent, long
/// before the stall limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_on_a_worker_that_left_discovery_and_went_silent_moves_before_the_stall_limit() {
    let (etcd, nats) = (EtcdServer::start().unwrap(), NatsServer::start().unwrap());
    let a = mock_worker("lost-a", &etcd, &nats, "100000");
    let cfg = RoutedConfig {
        first_token_timeout: Duration::from_secs(60),
        stall_timeout: Duration::from_secs(60),
        ..RoutedConfig::new(SECRET)
    };
    let f = frontend_with(&etcd, &nats, cfg).await;
    the_only_worker_reports(&f, "lost-a").await;
    let addr = f.addr;
    let start = Instant::now();
    // 0.1 s a token: the stream is in flight on lost-a when it freezes.
    let req = tokio::spawn(async move {
        post_json(addr, "/v1/completions", &completion("a stream that must move", 40)).await
    });
    tokio::time::sleep(Duration::from_millis(800)).await;
    let _b = mock_worker("lost-b", &etcd, &nats, "1000");
    let pid = a._proc.0.id();
    common::freeze(pid);
    let r = req.await.unwrap();
    let _ = std::process::Command::new("kill").args(["-CONT", &pid.to_string()]).status();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["usage"]["completion_tokens"], 40);
    let lost = f.backend.stats().lost_workers.load(std::sync::atomic::Ordering::Relaxed);
    assert!(lost >= 1, "not moved for a lost worker");
    // Its lease (2 s), its silence (2 s), the next look (1 s), the rest on lost-b.
    assert!(start.elapsed() < Duration::from_secs(20), "took {:?}", start.elapsed());
}

/// A model whose only worker restarts (it drains and leaves discovery, then a new one joins):
/// a request in the gap waits for the new worker instead of failing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_for_a_model_whose_only_worker_restarts_waits_for_it() {
    let (etcd, nats) = (EtcdServer::start().unwrap(), NatsServer::start().unwrap());
    let a = mock_worker("restart-a", &etcd, &nats, "1000");
    let f = frontend(&etcd, &nats, RoutingMode::Kv).await;
    the_only_worker_reports(&f, "restart-a").await;
    let r = post_json(f.addr, "/v1/completions", &completion("before", 4)).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let pid = a._proc.0.id().to_string();
    assert!(std::process::Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    wait_for("the worker left", Duration::from_secs(10), async || {
        workers_known(&f).await.is_empty()
    })
    .await;
    let addr = f.addr;
    let req = tokio::spawn(async move {
        post_json(addr, "/v1/completions", &completion("in the gap", 4)).await
    });
    tokio::time::sleep(Duration::from_millis(700)).await;
    let _b = mock_worker("restart-b", &etcd, &nats, "1000");
    let r = req.await.unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-kvfabric-worker"), Some("restart-b"));
    let held = f.backend.stats().held_for_worker.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(held, 1);
    drop(a);
}

/// The whole deployment with TLS on every port: etcd over HTTPS with client certificates and
/// a password, NATS over TLS with client certificates and a password, mutual TLS between the
/// frontend and the worker, HTTPS on the API and the metrics port; every secret from a file.
/// The bytes between the frontend and the worker (recorded by a relay the worker advertises)
/// are TLS records carrying no prompt or answer, and the logs of both processes at `trace`
/// show no secret.
#[test]
fn a_deployment_with_tls_on_every_port_shows_no_prompt_on_the_wire_and_no_secret_in_its_logs() {
    use kvfabric::control::etcd::EtcdSecurity;
    use kvfabric::testkit::TestCa;
    use std::io::{BufRead, BufReader, Read, Write};
    use std::process::{Command, Stdio};
    let rt = tokio::runtime::Runtime::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("deployment").unwrap();
    let cert = ca.issue(&["127.0.0.1", "localhost"]).unwrap();
    let (secret, api_key) = ("shared-secret-5e1f0c9a", "api-key-77d2b0e4");
    let (etcd_pw, nats_pw) = ("etcd-password-3a9c41", "nats-password-b6e2d8");
    let file = |name: &str, text: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, format!("{text}\n")).unwrap();
        p.display().to_string()
    };
    let (secret_file, key_file) = (file("secret", secret), file("api-key", api_key));
    let (etcd_pw_file, nats_pw_file) = (file("etcd-pw", etcd_pw), file("nats-pw", nats_pw));

    let etcd = EtcdServer::start_tls(ca.issue(&["127.0.0.1"]).unwrap(), Some(ca.ca())).unwrap();
    let tls = kvfabric::tls::client_config(&ca.ca(), Some((&cert.cert, &cert.key))).unwrap();
    rt.block_on(etcd.enable_auth(EtcdSecurity { tls: Some(tls), user: None }, etcd_pw)).unwrap();
    let nats =
        NatsServer::start_tls(&ca.issue(&["127.0.0.1"]).unwrap(), &ca.ca(), "kvfabric", nats_pw)
            .unwrap();
    let (ca_path, cert_path, key_path) = (
        ca.ca().display().to_string(),
        cert.cert.display().to_string(),
        cert.key.display().to_string(),
    );
    let control = [
        "--namespace",
        "secured",
        "--etcd",
        &etcd.endpoint(),
        "--etcd-ca",
        &ca_path,
        "--etcd-cert",
        &cert_path,
        "--etcd-key",
        &key_path,
        "--etcd-user",
        "root",
        "--etcd-password-file",
        &etcd_pw_file,
        "--nats",
        &nats.url(),
        "--nats-ca",
        &ca_path,
        "--nats-cert",
        &cert_path,
        "--nats-key",
        &key_path,
        "--nats-user",
        "kvfabric",
        "--nats-password-file",
        &nats_pw_file,
        "--tls-cert",
        &cert_path,
        "--tls-key",
        &key_path,
        "--tls-ca",
        &ca_path,
        "--log-level",
        "trace",
    ];
    let spawn = |args: &[&str], log: &str| {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvfabric"))
            .args(args)
            .args(control)
            .env_remove("KVFABRIC_CONFIG")
            .env_remove("RUST_LOG")
            .env("KVFABRIC_SECRET_FILE", &secret_file)
            .env("KVFABRIC_API_KEY_FILE", &key_file)
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(dir.path().join(log)).unwrap())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let first = lines.next().expect("printed nothing").unwrap();
        std::thread::spawn(move || for _ in lines {});
        (Proc(child), first)
    };

    // A relay the worker advertises as its request port: it records what crosses it.
    let relay = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let relay_addr = relay.local_addr().unwrap();
    let listen = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let seen: Arc<std::sync::Mutex<Vec<Vec<u8>>>> = Arc::default();
    let log = seen.clone();
    std::thread::spawn(move || {
        for client in relay.incoming().flatten() {
            let Ok(server) = std::net::TcpStream::connect(listen) else { continue };
            for (mut from, mut to) in
                [(client.try_clone().unwrap(), server.try_clone().unwrap()), (server, client)]
            {
                let log = log.clone();
                std::thread::spawn(move || {
                    let mut got = Vec::new();
                    let mut buf = [0u8; 16 << 10];
                    while let Ok(n) = from.read(&mut buf) {
                        if n == 0 || to.write_all(&buf[..n]).is_err() {
                            break;
                        }
                        got.extend_from_slice(&buf[..n]);
                    }
                    let _ = to.shutdown(std::net::Shutdown::Write);
                    log.lock().unwrap().push(got);
                });
            }
        }
    });
    let (listen_s, advertise) = (listen.to_string(), relay_addr.to_string());
    let (worker, line) = spawn(
        &[
            "worker",
            "--name",
            "w-tls",
            "--engine",
            "mock",
            "--disk-blocks",
            "0",
            "--listen",
            &listen_s,
            "--advertise",
            &advertise,
            "--metrics-listen",
            "127.0.0.1:0",
        ],
        "worker.log",
    );
    let info: serde_json::Value = serde_json::from_str(&line).unwrap();
    let metrics: SocketAddr = info["metrics"].as_str().unwrap().parse().unwrap();
    let (frontend, line) = spawn(&["frontend", "--port", "0", "--name", "f-tls"], "frontend.log");
    let api: SocketAddr =
        line.rsplit_once("at https://").unwrap().1.trim().trim_end_matches("/v1").parse().unwrap();
    let ca_file = ca.ca();
    let https = |req: Vec<u8>| rt.block_on(common::raw_tls(api, &ca_file, None, &req));
    let auth = |method: &str, path: &str, body: Option<&str>| {
        let req = String::from_utf8(common::request_bytes(method, path, body)).unwrap();
        req.replacen("\r\n", &format!("\r\nAuthorization: Bearer {api_key}\r\n"), 1).into_bytes()
    };
    let start = Instant::now();
    let model = loop {
        let r = https(auth("GET", "/v1/models", None)).unwrap();
        if let Some(id) = r.json()["data"][0]["id"].as_str() {
            break id.to_string();
        }
        assert!(start.elapsed() < Duration::from_secs(30), "the frontend never saw the worker");
        std::thread::sleep(Duration::from_millis(100));
    };
    let marker = "Zanzibar marmalade recipe";
    let body = json!({"model": model, "prompt": format!("{marker}: {marker}."), "max_tokens": 8});
    let r = https(auth("POST", "/v1/completions", Some(&body.to_string()))).unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let answer = r.json()["choices"][0]["text"].as_str().unwrap().to_string();
    assert!(!answer.trim().is_empty());
    // Without the API key: refused, over TLS still.
    let r = https(common::request_bytes("GET", "/v1/models", None)).unwrap();
    assert_eq!(r.status, 401);
    // The worker's metrics port speaks HTTPS, with the certificate's end of validity.
    let m = rt
        .block_on(common::raw_tls(
            metrics,
            &ca_file,
            None,
            &common::request_bytes("GET", "/metrics", None),
        ))
        .unwrap();
    let not_after = common::metric(&m.text(), "kvfabric_tls_cert_not_after_timestamp_seconds");
    let expected = kvfabric::tls::Tls::load(kvfabric::tls::TlsFiles {
        cert: cert.cert.clone(),
        key: cert.key.clone(),
        ca: None,
        client_ca: None,
    })
    .unwrap()
    .not_after();
    assert_eq!(not_after as i64, expected);
    // Every TLS metric the alert rules name is exported.
    let rules = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../deploy/prometheus/alerts.yml"
    ))
    .unwrap();
    let named: std::collections::BTreeSet<&str> = rules
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| w.starts_with("kvfabric_tls_"))
        .collect();
    assert!(named.len() >= 2, "{named:?}");
    for name in named {
        assert!(m.text().contains(&format!("\n{name}")), "{name} is not exported");
    }
    drop(frontend);
    drop(worker);

    // The wire: TLS records both ways, and nothing of the prompt or the answer.
    std::thread::sleep(Duration::from_millis(300));
    let flows = seen.lock().unwrap().clone();
    let bytes: usize = flows.iter().map(Vec::len).sum();
    assert!(bytes > 1000, "the request crossed the relay ({bytes} bytes)");
    for flow in flows.iter().filter(|f| !f.is_empty()) {
        assert_eq!(&flow[..2], &[0x16, 0x03], "a flow that does not start with TLS");
        let text = String::from_utf8_lossy(flow);
        for plain in ["Zanzibar", "marmalade", "\"prompt\"", "\"token\"", answer.trim()] {
            assert!(!text.contains(plain), "{plain:?} crossed the wire in the clear");
        }
    }
    // The logs, at trace: no secret, however it was configured.
    for log in ["worker.log", "frontend.log"] {
        let text = std::fs::read_to_string(dir.path().join(log)).unwrap();
        assert!(text.lines().count() > 20, "{log} holds the run's trace");
        for s in [secret, api_key, etcd_pw, nats_pw] {
            assert!(!text.contains(s), "{log} shows a secret");
        }
    }
}
