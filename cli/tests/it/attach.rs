//! Engines that are not kvfabric's behind its router, over real etcd and NATS: two engine
//! processes that speak OpenAI HTTP and publish vLLM-format KV events over ZeroMQ
//! (`serving/attach/tests/engines/fake_engine.py`: a prefix cache with LRU eviction and vLLM's event
//! structs through msgspec and pyzmq; it proves nothing about vLLM's scheduler, attention,
//! real block hashes or timing), each with a `kvfabric attach` process, behind a `kvfabric
//! frontend` process and a `kvfabric router` process. A shared long prefix lands on the engine
//! that holds it and reports cached tokens; the router service explains the decision; an
//! engine killed -9 leaves routing within its attach's health checks.

use crate::common;

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{get, post_json, spawn_line, spawn_server, Proc};
use kvfabric::testkit::{EtcdServer, NatsServer};
use serde_json::{json, Value};

const SECRET: &str = "attach-test-secret";

struct FakeEngine {
    proc: Proc,
    http: String,
    pub_endpoint: String,
    replay: String,
}

fn fake_engine() -> FakeEngine {
    fake_engine_with(&[])
}

fn fake_engine_with(extra: &[&str]) -> FakeEngine {
    let dir = std::path::PathBuf::from(
        std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_else(|| env!("CARGO_MANIFEST_DIR").into()),
    )
    .join("../serving/attach/tests/engines");
    let (proc, line) = spawn_line(
        Command::new(kvfabric::testkit::engine_python())
            .arg(dir.join("fake_engine.py"))
            .args(["--model", "fake", "--block-size", "16", "--capacity", "512"])
            .args(["--prefill-us", "200", "--decode-us", "200"])
            .args(extra)
            .current_dir(&dir),
    );
    let v: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"));
    FakeEngine {
        proc,
        http: v["http"].as_str().unwrap().into(),
        pub_endpoint: v["pub"].as_str().unwrap().into(),
        replay: v["replay"].as_str().unwrap().into(),
    }
}

fn control(etcd: &EtcdServer, nats: &NatsServer) -> Vec<String> {
    ["--namespace", "attach", "--etcd", &etcd.endpoint(), "--nats", &nats.url()]
        .map(String::from)
        .to_vec()
}

fn attach(name: &str, e: &FakeEngine, model_dir: &Path, ctl: &[String]) -> (Proc, SocketAddr) {
    attach_with(name, e, model_dir, ctl, &[])
}

fn attach_with(
    name: &str,
    e: &FakeEngine,
    model_dir: &Path,
    ctl: &[String],
    extra: &[&str],
) -> (Proc, SocketAddr) {
    let (proc, line) = spawn_line(
        Command::new(env!("CARGO_BIN_EXE_kvfabric"))
            .args(["attach", "--name", name, "--engine-url", &e.http, "--engine", "vllm"])
            .args(["--model", "fake", "--block-size", "16", "--model-dir"])
            .arg(model_dir)
            .args(["--kv-events-connect", &e.pub_endpoint, "--kv-replay", &e.replay])
            .args(["--kv-topic", "kv", "--lease-ttl-s", "2", "--poll-ms", "200"])
            .args(["--down-after", "2", "--metrics-listen", "127.0.0.1:0"])
            .args(ctl)
            .args(extra)
            .env_remove("KVFABRIC_CONFIG"),
    );
    let v: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"));
    assert_eq!(v["attached"], name);
    (proc, v["metrics"].as_str().unwrap().parse().unwrap())
}

fn server(cmd: &str, ctl: &[String], extra: &[&str]) -> (Proc, SocketAddr) {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kvfabric"));
    c.args([cmd, "--port", "0"]).args(extra).args(ctl);
    let (proc, addr, _) = spawn_server(c);
    (proc, addr)
}

async fn wait_for(what: &str, limit: Duration, mut f: impl AsyncFnMut() -> bool) {
    let start = Instant::now();
    while !f().await {
        assert!(start.elapsed() < limit, "timed out after {limit:?} waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn workers(addr: SocketAddr) -> Vec<String> {
    let h: kvfabric::health::Health = serde_json::from_value(get(addr, "/health").await.json())
        .expect("/health is the health document");
    let mut v: Vec<String> = h.routing.map(|r| r.workers).unwrap_or_default();
    v.sort();
    v
}

/// A model directory for the stand-in engines (`kvfabric model-dir`), in a temporary
/// directory kept while the first value lives.
fn model_dir() -> (tempfile::TempDir, std::path::PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    let st = Command::new(env!("CARGO_BIN_EXE_kvfabric"))
        .args(["model-dir", "--out"])
        .arg(&dir)
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(st.success());
    (tmp, dir)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attached_engines_are_routed_by_their_own_kv_events() {
    let (etcd, nats) = (EtcdServer::start().unwrap(), NatsServer::start().unwrap());
    let ctl = control(&etcd, &nats);
    let (_model_dir, dir) = model_dir();
    let engines = [fake_engine(), fake_engine()];
    let attached: Vec<(Proc, SocketAddr)> = engines
        .iter()
        .enumerate()
        .map(|(i, e)| attach(&format!("engine-{i}"), e, &dir, &ctl))
        .collect();
    let (_frontend, f) = server("frontend", &ctl, &["--secret", SECRET]);
    let (_router, r) = server("router", &ctl, &[]);
    for addr in [f, r] {
        wait_for("both engines", Duration::from_secs(15), async || workers(addr).await.len() == 2)
            .await;
    }

    let prefix = "Every request of this test starts with the same long system prompt. ".repeat(40);
    let body = |i: usize| json!({"model": "fake", "prompt": format!("{prefix} question {i}"), "max_tokens": 4, "stream": i % 2 == 1});
    let first = post_json(f, "/v1/completions", &body(0)).await;
    assert_eq!(first.status, 200, "{}", first.text());
    let home = first.header("x-kvfabric-worker").unwrap().to_string();
    let text = first.json()["choices"][0]["text"].as_str().unwrap().to_string();
    assert!(text.starts_with(" t"), "the engine's text comes through: {text:?}");

    // The engine's BlockStored events reach both routers' indexes through its attach.
    let explain = json!({"model": "fake", "prompt": format!("{prefix} question 99")});
    wait_for("the prefix's KV events", Duration::from_secs(15), async || {
        let v = post_json(r, "/v1/route", &explain).await.json();
        v["worker"] == home.as_str()
            && v["workers"].as_array().unwrap().iter().any(|w| {
                w["worker"] == home.as_str()
                    && w["cached_blocks_per_tier"]["device"].as_u64() > Some(25)
            })
    })
    .await;
    for i in 1..7 {
        let resp = post_json(f, "/v1/completions", &body(i)).await;
        assert_eq!(resp.status, 200, "{}", resp.text());
        assert_eq!(
            resp.header("x-kvfabric-worker"),
            Some(home.as_str()),
            "request {i} left the cache"
        );
        if i % 2 == 0 {
            let cached =
                resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
            assert!(cached >= 400, "the engine reports its prefix-cache hits: {cached}");
        }
    }
    let m = get(f, "/metrics").await.text();
    assert!(common::metric(&m, "kvfabric_frontend_kv_events_total") > 0.0, "{m}");
    // The router's dashboard: both engines, as attached engines (load reports only).
    assert_eq!(get(r, "/dashboard").await.status, 200);
    let d = get(r, "/dashboard/state").await.json();
    let shown: Vec<(&str, &str)> = d["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| (w["name"].as_str().unwrap(), w["role"].as_str().unwrap()))
        .collect();
    assert_eq!(shown, [("engine-0", "engine"), ("engine-1", "engine")], "{d}");
    assert!(d["control"]["kv_events"].as_u64() > Some(0), "{d}");
    // The sidecar's own counters: batches relayed, blocks held, nothing malformed or skipped.
    let (i, _) = engines.iter().enumerate().find(|(i, _)| format!("engine-{i}") == home).unwrap();
    let am = get(attached[i].1, "/metrics").await.text();
    assert!(common::metric(&am, "kvfabric_attach_event_batches_total") >= 1.0, "{am}");
    assert!(common::metric(&am, "kvfabric_attach_engine_blocks") >= 30.0, "{am}");
    assert_eq!(common::metric(&am, "kvfabric_attach_events_malformed_total"), 0.0, "{am}");
    assert_eq!(common::metric(&am, "kvfabric_attach_registered"), 1.0, "{am}");
    assert_eq!(
        common::metric(&am, "kvfabric_attach_skipped_blocks_total{reason=\"orphan\"}"),
        0.0,
        "{am}"
    );

    // The engine that holds the prefix dies: it leaves routing, the other serves.
    let mut engines = engines;
    let _ = engines[i].proc.0.kill();
    let _ = engines[i].proc.0.wait();
    let other = format!("engine-{}", 1 - i);
    for addr in [f, r] {
        wait_for("the dead engine to leave", Duration::from_secs(10), async || {
            workers(addr).await == vec![other.clone()]
        })
        .await;
    }
    // Its sidecar says so on /health (503) and in /metrics.
    let sidecar = attached[i].1;
    wait_for("the sidecar to see its engine gone", Duration::from_secs(10), async || {
        get(sidecar, "/health").await.status == 503
    })
    .await;
    let h = get(sidecar, "/health").await.json();
    assert_eq!(h["status"], "engine not answering", "{h}");
    assert_eq!(h["attach"]["registered"], false, "{h}");
    assert!(h["attach"]["failed_health_checks"].as_u64() >= Some(2), "{h}");
    let am = get(sidecar, "/metrics").await.text();
    assert_eq!(common::metric(&am, "kvfabric_attach_registered"), 0.0, "{am}");
    assert!(common::metric(&am, "kvfabric_attach_failed_health_checks_total") >= 2.0, "{am}");
    // It forgot the engine's blocks: an engine that comes back is not credited with them.
    assert_eq!(common::metric(&am, "kvfabric_attach_engine_blocks"), 0.0, "{am}");
    // A dead engine's refused sockets are not malformed events.
    assert_eq!(common::metric(&am, "kvfabric_attach_events_malformed_total"), 0.0, "{am}");
    let resp = post_json(f, "/v1/completions", &body(100)).await;
    assert_eq!(resp.status, 200, "{}", resp.text());
    assert_eq!(resp.header("x-kvfabric-worker"), Some(other.as_str()));
}

/// A request's service class reaches an attached engine that schedules by priority (the
/// stand-in, with `--scheduling-policy priority`, as vLLM's flag) as vLLM's `priority`: the
/// frontend's classes are interactive (TTFT 300 ms) and batch (the default), so interactive
/// requests arrive with priority -1 and batch ones with 0. The stand-in counts what it got.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_requests_class_reaches_an_attached_engine_as_its_priority() {
    let (etcd, nats) = (EtcdServer::start().unwrap(), NatsServer::start().unwrap());
    let ctl = control(&etcd, &nats);
    let (_model_dir, dir) = model_dir();
    let engines = [
        fake_engine_with(&["--scheduling-policy", "priority"]),
        fake_engine_with(&["--scheduling-policy", "priority"]),
    ];
    let _attached: Vec<(Proc, SocketAddr)> = engines
        .iter()
        .enumerate()
        .map(|(i, e)| attach_with(&format!("engine-{i}"), e, &dir, &ctl, &["--engine-priority"]))
        .collect();
    let classes =
        ["--class", "interactive:ttft=300ms,itl=50ms", "--class", "batch:ttft=30s,default"];
    let mut args = vec!["--secret", SECRET];
    args.extend(classes);
    let (_frontend, f) = server("frontend", &ctl, &args);
    wait_for("both engines", Duration::from_secs(15), async || workers(f).await.len() == 2).await;
    let body = |i: usize, extra: Value| {
        let mut b = json!({"model": "fake", "prompt": format!("question {i}"), "max_tokens": 2});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    let sends = [
        json!({"kvfabric": {"class": "interactive"}}),
        json!({"service_tier": "priority"}),
        json!({"nvext": {"agent_hints": {"priority": 3}}}),
        json!({"kvfabric": {"class": "batch"}}),
        json!({}),
    ];
    for (i, extra) in sends.iter().enumerate() {
        let r = post_json(f, "/v1/completions", &body(i, extra.clone())).await;
        assert_eq!(r.status, 200, "{extra}: {}", r.text());
    }
    let mut by_priority = std::collections::BTreeMap::new();
    for e in &engines {
        let addr: SocketAddr = e.http.trim_start_matches("http://").parse().unwrap();
        let m = get(addr, "/metrics").await.text();
        for p in ["-1", "0", "1"] {
            let sample = format!("fake:requests_by_priority_total{{priority=\"{p}\"}}");
            let n = m
                .lines()
                .find_map(|l| l.strip_prefix(&sample))
                .map_or(0.0, |v| v.trim().parse::<f64>().unwrap());
            *by_priority.entry(p).or_insert(0.0) += n;
        }
    }
    assert_eq!(by_priority["-1"], 3.0, "{by_priority:?}");
    assert_eq!(by_priority["0"], 2.0, "{by_priority:?}");
    assert_eq!(by_priority["1"], 0.0, "{by_priority:?}");
    // A class the frontend does not have is refused before any engine sees it.
    let r = post_json(f, "/v1/completions", &body(9, json!({"kvfabric": {"class": "gold"}}))).await;
    assert_eq!(r.status, 400, "{}", r.text());
}

/// The frontend's own queue puts classes in front of an engine that does not order by them
/// (the stand-in in its first-come-first-served mode computes every request it gets at
/// once): with `--frontend-queue-depth 1` the engine has one request of this frontend at a
/// time; an interactive request that arrives after three batch ones goes to it first
/// (earliest deadline); a fourth batch request finds its class's queue full (bound 3) and is
/// refused with 429 and `Retry-After`, while the interactive one still queues. `/metrics`
/// counts both per class.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_frontends_queue_sends_an_interactive_request_before_waiting_batch_ones() {
    let (etcd, nats) = (EtcdServer::start().unwrap(), NatsServer::start().unwrap());
    let ctl = control(&etcd, &nats);
    let (_model_dir, dir) = model_dir();
    // 40 ms a token: a request of 12 tokens holds the engine for about half a second.
    let engine = fake_engine_with(&["--decode-us", "40000"]);
    let _attached = attach_with("engine-0", &engine, &dir, &ctl, &[]);
    let mut args = vec!["--secret", SECRET, "--frontend-queue-depth", "1"];
    args.extend(["--frontend-queue-bound", "3"]);
    args.extend(["--class", "interactive:ttft=300ms", "--class", "batch:ttft=30s,default"]);
    let (_frontend, f) = server("frontend", &ctl, &args);
    wait_for("the engine", Duration::from_secs(15), async || workers(f).await.len() == 1).await;
    let done = std::sync::Arc::new(parking_lot::Mutex::new(Vec::new()));
    let send = |name: &'static str, class: &'static str| {
        let done = done.clone();
        tokio::spawn(async move {
            let body = json!({"model": "fake", "prompt": format!("{name} asks"), "max_tokens": 12,
                "kvfabric": {"class": class}});
            let r = post_json(f, "/v1/completions", &body).await;
            done.lock().push(name);
            r
        })
    };
    let first = send("first", "batch");
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut batch = Vec::new();
    for name in ["batch-1", "batch-2", "batch-3"] {
        batch.push(send(name, "batch"));
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    // The batch queue is full: refused at once, with a time to come back.
    let body = json!({"model": "fake", "prompt": "one too many", "max_tokens": 12,
        "kvfabric": {"class": "batch"}});
    let r = post_json(f, "/v1/completions", &body).await;
    assert_eq!(r.status, 429, "{}", r.text());
    let retry = r.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case("retry-after"));
    assert!(retry.is_some_and(|(_, v)| v.parse::<u64>().is_ok_and(|s| s >= 1)), "{:?}", r.headers);
    let interactive = send("interactive", "interactive");
    for t in [first, interactive].into_iter().chain(batch) {
        let r = t.await.unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
    }
    assert_eq!(*done.lock(), ["first", "interactive", "batch-1", "batch-2", "batch-3"]);
    let m = get(f, "/metrics").await.text();
    for sample in [
        "kvfabric_frontend_pending_shed_total{class=\"batch\"} 1",
        "kvfabric_frontend_pending_queued_total{class=\"batch\"} 3",
        "kvfabric_frontend_pending_queued_total{class=\"interactive\"} 1",
        "kvfabric_frontend_pending{class=\"batch\"} 0",
    ] {
        assert!(m.lines().any(|l| l == sample), "no {sample:?} in\n{m}");
    }
}
