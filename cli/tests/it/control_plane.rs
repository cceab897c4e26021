//! The control plane as an operator sees it: a frontend's, a worker's and a fabric node's
//! `/health` and `/metrics` while real etcd and NATS servers are stopped and started again,
//! with requests served throughout. Each outage degrades `/health` with its reason (and what still works),
//! moves `kvfabric_control_plane_up` to 0, and both come back when the server does, with the
//! reconnect counted.

use crate::common;

use std::net::SocketAddr;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{get, post_json, spawn_worker, Proc};
use kvfabric::testkit::{EtcdServer, NatsServer};
use serde_json::{json, Value};

const SECRET: &str = "control-plane-test-secret";

fn frontend(etcd: &EtcdServer, nats: &NatsServer) -> (Proc, SocketAddr) {
    common::spawn_frontend("cp-fe", "cp", SECRET, &etcd.endpoint(), &nats.url())
}

/// A mock worker with its metrics port; its address.
fn worker(etcd: &EtcdServer, nats: &NatsServer) -> (Proc, SocketAddr) {
    let mut args = common::mock_worker_args("cp", &etcd.endpoint(), &nats.url(), SECRET);
    // Keep-alives every 2 s, and longer than the outages: the worker stays registered
    // through them, and fails a renewal in each etcd outage.
    let more = ["--mock-decode-us", "200", "--metrics-listen", "127.0.0.1:0", "--lease-ttl-s", "6"];
    args.extend(more.map(String::from));
    let (proc, line) = spawn_worker("cp-w", &args);
    let metrics = line["metrics"].as_str().expect("the metrics address").parse().unwrap();
    (proc, metrics)
}

/// A fabric node with its metrics port; its address.
fn fabric(etcd: &EtcdServer, nats: &NatsServer) -> (Proc, SocketAddr) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvfabric"));
    cmd.args(["fabric", "--name", "cp-g4", "--namespace", "cp", "--host-blocks", "16"])
        .args(["--etcd", &etcd.endpoint(), "--nats", &nats.url()])
        .args(["--metrics-listen", "127.0.0.1:0", "--lease-ttl-s", "6"])
        .env("KVFABRIC_SECRET", SECRET)
        .env_remove("KVFABRIC_MODEL");
    let (proc, line) = common::spawn_line(&mut cmd);
    let v: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"));
    let metrics = v["metrics"].as_str().expect("the metrics address").parse().unwrap();
    (proc, metrics)
}

/// The value of `name{component="c"}` in a `/metrics` text.
fn sample(text: &str, name: &str, component: &str) -> Option<f64> {
    let prefix = format!("{name}{{component=\"{component}\"}} ");
    text.lines().find_map(|l| l.strip_prefix(&prefix)).and_then(|v| v.trim().parse().ok())
}

async fn health(addr: SocketAddr) -> Value {
    let r = get(addr, "/health").await;
    let h = r.json();
    // `ok` and `degraded` serve (200); the frontend says `no workers` (503) until it sees one.
    if h["status"] == "ok" || h["status"] == "degraded" {
        assert_eq!(r.status, 200, "degraded still serves: {h}");
    }
    h
}

async fn wait_until(what: &str, mut f: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !f().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn reasons(h: &Value) -> String {
    h["reasons"].as_array().map(|r| format!("{r:?}")).unwrap_or_default()
}

/// A control-plane server the test stops and starts.
trait Server {
    fn kill(&mut self);
    fn restart(&mut self) -> std::io::Result<()>;
}

impl Server for EtcdServer {
    fn kill(&mut self) {
        EtcdServer::kill(self)
    }
    fn restart(&mut self) -> std::io::Result<()> {
        EtcdServer::restart(self)
    }
}

impl Server for NatsServer {
    fn kill(&mut self) {
        NatsServer::kill(self)
    }
    fn restart(&mut self) -> std::io::Result<()> {
        NatsServer::restart(self)
    }
}

/// One outage of `component` (`server` killed, then started again on its ports and data):
/// both processes degrade with its reason, say it is down in `/metrics`, keep serving, and
/// recover when it is back.
async fn outage(component: &str, server: &mut dyn Server, procs: &[(&str, SocketAddr)]) {
    let fe = procs[0].1;
    let down = Instant::now();
    server.kill();
    for &(who, addr) in procs {
        wait_until(&format!("the {who} to see {component} down"), async || {
            let h = health(addr).await;
            h["status"] == "degraded" && reasons(&h).contains(&format!("{component} unreachable"))
        })
        .await;
        let text = get(addr, "/metrics").await.text();
        assert_eq!(sample(&text, "kvfabric_control_plane_up", component), Some(0.0), "{who}");
        let h = health(addr).await;
        let cp = h["control_plane"].as_array().unwrap();
        let mine = cp.iter().find(|c| c["component"] == component).unwrap();
        assert_eq!(mine["up"], false, "{who}: {h}");
    }
    let what_works = reasons(&health(fe).await);
    let expected =
        if component == "etcd" { "discovery is frozen" } else { "requests are still served" };
    assert!(what_works.contains(expected), "{what_works}");
    // Serving holds: the frontend still routes to the worker it knows.
    let body = json!({"model": "mock", "prompt": format!("during the {component} outage"),
        "max_tokens": 4});
    let r = post_json(fe, "/v1/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    // Down long enough for a keep-alive to fail (every 2 s), shorter than the lease (6 s).
    tokio::time::sleep(Duration::from_millis(3500).saturating_sub(down.elapsed())).await;
    server.restart().unwrap();
    for &(who, addr) in procs {
        wait_until(&format!("the {who} to see {component} back"), async || {
            health(addr).await["status"] == "ok"
        })
        .await;
        let text = get(addr, "/metrics").await.text();
        assert_eq!(sample(&text, "kvfabric_control_plane_up", component), Some(1.0), "{who}");
        let reconnects = sample(&text, "kvfabric_control_plane_reconnects_total", component);
        assert!(reconnects >= Some(1.0), "{who}: {component} reconnects {reconnects:?}");
        let age = sample(&text, "kvfabric_control_plane_contact_age_seconds", component);
        assert!(age.is_some_and(|a| a < 15.0), "{who}: {component} contact age {age:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_and_metrics_follow_an_etcd_and_a_nats_outage() {
    let mut etcd = EtcdServer::start().unwrap();
    let mut nats = NatsServer::start().unwrap();
    let (_fe_proc, fe) = frontend(&etcd, &nats);
    let (_w_proc, w) = worker(&etcd, &nats);
    let (_g4_proc, g4) = fabric(&etcd, &nats);
    let procs = [("frontend", fe), ("worker", w), ("fabric node", g4)];
    wait_until("the frontend to see the worker", async || {
        health(fe).await["routing"]["workers"].as_array().is_some_and(|a| !a.is_empty())
    })
    .await;
    for (_, addr) in procs {
        let h = health(addr).await;
        assert_eq!(h["status"], "ok", "{h}");
        let text = get(addr, "/metrics").await.text();
        for c in ["etcd", "nats"] {
            assert_eq!(sample(&text, "kvfabric_control_plane_up", c), Some(1.0), "{c}: {text}");
            assert_eq!(sample(&text, "kvfabric_control_plane_events_dropped_total", c), Some(0.0));
        }
    }
    outage("etcd", &mut etcd, &procs).await;
    // The worker's keep-alives failed while etcd was away.
    let text = get(w, "/metrics").await.text();
    let failed = sample(&text, "kvfabric_control_plane_lease_renewals_failed_total", "etcd");
    assert!(failed >= Some(1.0), "lease renewals failed: {failed:?}");
    outage("nats", &mut nats, &procs).await;
}

/// A list of NATS servers (as a cluster's clients are given) connects past one that is down,
/// and a work queue on a server that is in no cluster has one replica (JetStream refuses more).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_list_of_nats_servers_connects_past_a_dead_one() {
    use kvfabric::control::nats::NatsBus;
    use kvfabric::control::EventBus;
    let nats = NatsServer::start().unwrap();
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let urls = format!("nats://{dead},{}", nats.url());
    let bus = NatsBus::connect(&urls, "list").await.unwrap();
    assert_eq!(bus.servers(), urls);
    assert_eq!(bus.replicas(), 1);
    bus.enqueue("prefill", b"job".to_vec()).await.unwrap();
    assert_eq!(bus.queue_replicas("prefill").await.unwrap(), Some(1));
    assert_eq!(bus.queue_replicas("absent").await.unwrap(), None);
}

/// An etcd endpoint that takes no connection (a member on a host cut off the network: SYNs
/// go unanswered) costs about a second before the next endpoint answers, not the kernel's two
/// minutes of SYN retries: long enough for a worker's lease to run out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_etcd_member_that_takes_no_connection_is_passed_over_within_a_second() {
    use kvfabric::control::etcd::EtcdDiscovery;
    use kvfabric::control::Discovery;
    let etcd = EtcdServer::start().unwrap();
    // A listener that never accepts, its backlog filled: further connections hang in SYN.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let silent = socket.listen(1).unwrap();
    let at = silent.local_addr().unwrap();
    let mut held = Vec::new();
    for _ in 0..4 {
        let s = tokio::net::TcpSocket::new_v4().unwrap();
        if let Ok(Ok(c)) = tokio::time::timeout(Duration::from_millis(300), s.connect(at)).await {
            held.push(c);
        }
    }
    let probe =
        tokio::time::timeout(Duration::from_millis(500), tokio::net::TcpStream::connect(at)).await;
    assert!(probe.is_err(), "the silent listener still completes connections");
    let endpoints = vec![format!("http://{at}"), etcd.endpoint()];
    let start = std::time::Instant::now();
    let d =
        tokio::time::timeout(Duration::from_secs(20), EtcdDiscovery::connect(&endpoints, "silent"))
            .await
            .expect("connecting past a silent member hung")
            .unwrap();
    let inst = kvfabric::control::Instance {
        kind: "worker".into(),
        id: "w".into(),
        metadata: serde_json::json!({}),
    };
    let _reg = d.register(inst, Duration::from_secs(3)).await.unwrap();
    assert!(start.elapsed() < Duration::from_secs(5), "took {:?}", start.elapsed());
    drop((held, silent));
}
