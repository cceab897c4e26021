//! The alert rules of `deploy/prometheus/alerts.yml` in a real Prometheus (Debian's
//! `prometheus` package, which `scripts/setup.sh test` installs) scraping a frontend and two
//! mock workers over real etcd and NATS: a worker killed, NATS stopped, then the last worker
//! of the model killed, and each time the alert that Prometheus's own API reports firing.
//! Every metric name the rules and the Grafana dashboard (`deploy/grafana/kvfabric.json`) use
//! is checked against the processes' live `/metrics`.
//!
//! What this cannot show: the rules' `for:` durations (1 to 15 minutes) are cut to one second
//! in the copy Prometheus loads here, so that the test takes seconds; the unit tests of
//! `alerts.test.yml` (`promtool test rules`) check the rules with their real durations, and
//! the rules that need hours of history (the hit rate against its own level).

use crate::common;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{get, post_json, Proc};
use kvfabric::testkit::{EtcdServer, NatsServer};
use serde_json::{json, Value};

const SECRET: &str = "prometheus-test-secret";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A mock worker with its metrics port; its address. With `secret_file`, it reads the
/// secret from that file (`KVFABRIC_SECRET_FILE`, as a container secret), else `--secret`.
fn worker(
    name: &str,
    etcd: &EtcdServer,
    nats: &NatsServer,
    secret_file: Option<&Path>,
) -> (Proc, SocketAddr) {
    let (etcd, nats) = (etcd.endpoint(), nats.url());
    let mut args = vec![
        "--name",
        name,
        "--namespace",
        "prom",
        "--etcd",
        &etcd,
        "--nats",
        &nats,
        "--engine",
        "mock",
        "--disk-blocks",
        "0",
        "--metrics-listen",
        "127.0.0.1:0",
        // A killed worker leaves discovery within seconds.
        "--lease-ttl-s",
        "3",
    ];
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvfabric"));
    cmd.arg("worker").env_remove("KVFABRIC_CONFIG").env_remove("KVFABRIC_SECRET");
    match secret_file {
        Some(f) => {
            cmd.env("KVFABRIC_SECRET_FILE", f);
        }
        None => args.extend(["--secret", SECRET]),
    }
    let (proc, line) = common::spawn_line(cmd.args(&args));
    let v: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"));
    let metrics = v["metrics"].as_str().expect("the metrics address").parse().unwrap();
    (proc, metrics)
}

/// A Prometheus server of its own, on a free loopback port, with a temporary directory.
struct Prometheus {
    _proc: Proc,
    addr: SocketAddr,
    _dir: tempfile::TempDir,
}

impl Prometheus {
    /// Starts Prometheus with `rules` (every `for:` cut to 1 s) scraping each job's targets
    /// every second.
    async fn start(rules: &str, jobs: &[(&str, Vec<SocketAddr>)]) -> Prometheus {
        let bin = ["/usr/bin/prometheus", "/usr/local/bin/prometheus"]
            .into_iter()
            .find(|p| Path::new(p).is_file())
            .expect("prometheus not found: scripts/test.sh installs Debian's prometheus package");
        let dir = tempfile::tempdir().unwrap();
        let quick: String = rules
            .lines()
            .map(|l| match l.trim_start().strip_prefix("for:") {
                Some(_) => format!("{}for: 1s\n", &l[..l.len() - l.trim_start().len()]),
                None => format!("{l}\n"),
            })
            .collect();
        std::fs::write(dir.path().join("alerts.yml"), quick).unwrap();
        let mut config = String::from(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 900ms\n  evaluation_interval: 1s\n\
             rule_files: [alerts.yml]\nscrape_configs:\n",
        );
        for (job, targets) in jobs {
            let targets: Vec<String> = targets.iter().map(|t| format!("\"{t}\"")).collect();
            config += &format!(
                "  - job_name: {job}\n    static_configs:\n      - targets: [{}]\n",
                targets.join(", ")
            );
        }
        std::fs::write(dir.path().join("prometheus.yml"), config).unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let addr: SocketAddr = ([127, 0, 0, 1], port).into();
        let child = Command::new(bin)
            .arg(format!("--config.file={}", dir.path().join("prometheus.yml").display()))
            .arg(format!("--storage.tsdb.path={}", dir.path().join("data").display()))
            .arg(format!("--web.listen-address={addr}"))
            .arg("--log.level=warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start prometheus");
        let p = Prometheus { _proc: Proc(child), addr, _dir: dir };
        wait_until("Prometheus to be ready", async || {
            tokio::net::TcpStream::connect(addr).await.is_ok()
                && get(addr, "/-/ready").await.status == 200
        })
        .await;
        p
    }

    /// The API's `data` of `path`.
    async fn api(&self, path: &str) -> Value {
        let r = get(self.addr, path).await;
        assert_eq!(r.status, 200, "{path}: {}", r.text());
        let v = r.json();
        assert_eq!(v["status"], "success", "{v}");
        v["data"].clone()
    }

    /// The alerts Prometheus reports, as (name, state, labels).
    async fn alerts(&self) -> Vec<(String, String, Value)> {
        let data = self.api("/api/v1/alerts").await;
        data["alerts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| {
                let name = a["labels"]["alertname"].as_str().unwrap_or_default().to_string();
                (name, a["state"].as_str().unwrap_or_default().to_string(), a["labels"].clone())
            })
            .collect()
    }

    /// Waits until `name` fires with every label of `labels`; its labels.
    async fn firing(&self, name: &str, labels: &[(&str, &str)]) -> Value {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let alerts = self.alerts().await;
            if let Some((_, _, l)) = alerts.iter().find(|(n, state, l)| {
                n == name && state == "firing" && labels.iter().all(|(k, v)| l[*k] == *v)
            }) {
                return l.clone();
            }
            assert!(
                Instant::now() < deadline,
                "{name} {labels:?} never fired; alerts now: {alerts:?}"
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
}

async fn wait_until(what: &str, mut f: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !f().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The metric names of a `/metrics` text.
fn names(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_string)
        .collect()
}

/// Every `kvfabric_…` name in `text` (PromQL expressions, or a whole rules file).
fn kvfabric_names(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = text;
    while let Some(i) = rest.find("kvfabric_") {
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'))
            .unwrap_or(tail.len());
        // A name, not the middle of a longer word.
        let before = rest[..i].chars().next_back();
        if !before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') {
            out.insert(tail[..end].to_string());
        }
        rest = &tail[end..];
    }
    out
}

/// Every expression of the Grafana dashboard.
fn dashboard_exprs(dash: &Value) -> Vec<String> {
    dash["panels"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["targets"].as_array().cloned().unwrap_or_default())
        .map(|t| t["expr"].as_str().unwrap().to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_fires_the_alerts_of_a_worker_lost_nats_stopped_and_no_worker_left() {
    let etcd = EtcdServer::start().unwrap();
    let mut nats = NatsServer::start().unwrap();
    // Round robin: requests reach both workers.
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvfabric"));
    cmd.args(["frontend", "--port", "0", "--namespace", "prom", "--secret", SECRET])
        .args(["--name", "prom-fe", "--etcd", &etcd.endpoint(), "--nats", &nats.url()])
        .args(["--router", "round-robin"]);
    let (_fe_proc, fe, _) = common::spawn_server(cmd);
    let (mut w1_proc, w1) = worker("prom-w1", &etcd, &nats, None);
    // The second reads the secret from a file, as from a container secret (with its newline).
    let dir = tempfile::tempdir().unwrap();
    let secret_file = dir.path().join("kvfabric-secret");
    std::fs::write(&secret_file, format!("{SECRET}\n")).unwrap();
    let (mut w2_proc, w2) = worker("prom-w2", &etcd, &nats, Some(&secret_file));
    wait_until("the frontend to see both workers", async || {
        get(fe, "/health").await.json()["routing"]["workers"]
            .as_array()
            .is_some_and(|a| a.len() == 2)
    })
    .await;
    // Requests reach both: the frontend authenticates to each with its secret.
    let mut served = BTreeSet::new();
    for i in 0..12 {
        let body = json!({"model": "mock", "prompt": format!("spread {i} ").repeat(i + 1),
            "max_tokens": 2});
        let r = post_json(fe, "/v1/completions", &body).await;
        assert_eq!(r.status, 200, "{}", r.text());
        served.extend(r.header("x-kvfabric-worker").map(str::to_string));
    }
    assert_eq!(served.len(), 2, "both workers served: {served:?}");
    for i in 0..4 {
        let body = json!({"model": "mock", "prompt": format!("request {i}"), "max_tokens": 4});
        let r = post_json(fe, "/v1/completions", &body).await;
        assert_eq!(r.status, 200, "{}", r.text());
    }

    // Every metric the rules and the dashboard name is one these processes export.
    let rules = std::fs::read_to_string(repo().join("deploy/prometheus/alerts.yml")).unwrap();
    let dash: Value = serde_json::from_str(
        &std::fs::read_to_string(repo().join("deploy/grafana/kvfabric.json")).unwrap(),
    )
    .unwrap();
    let mut live = BTreeSet::new();
    for addr in [fe, w1, w2] {
        live.extend(names(&get(addr, "/metrics").await.text()));
    }
    let mut used = kvfabric_names(&rules);
    // The TLS families exist in processes with certificates: the TLS deployment's test
    // (`distributed.rs`) checks those names against a worker's /metrics.
    used.retain(|n| !n.starts_with("kvfabric_tls_"));
    assert!(used.len() >= 10, "the rules' metrics: {used:?}");
    let missing: Vec<_> = used.difference(&live).collect();
    assert!(missing.is_empty(), "alerts.yml names metrics nothing exports: {missing:?}");
    let exprs = dashboard_exprs(&dash);
    assert!(exprs.len() >= 14, "{exprs:?}");
    for e in &exprs {
        let missing: Vec<_> = kvfabric_names(e).difference(&live).cloned().collect();
        assert!(
            missing.is_empty(),
            "the dashboard's `{e}` names metrics nothing exports: {missing:?}"
        );
    }

    let prom = Prometheus::start(
        &rules,
        &[("kvfabric-frontend", vec![fe]), ("kvfabric-worker", vec![w1, w2])],
    )
    .await;
    wait_until("Prometheus to scrape all three targets", async || {
        let up = prom.api("/api/v1/query?query=up").await;
        let r = up["result"].as_array().unwrap();
        r.len() == 3 && r.iter().all(|s| s["value"][1] == "1")
    })
    .await;
    // The dashboard's expressions are valid PromQL that Prometheus evaluates.
    for e in &exprs {
        let q = e.replace("$__rate_interval", "1m").replace("$job", ".*");
        let path = format!("/api/v1/query?query={}", urlencode(&q));
        prom.api(&path).await;
    }
    // A few evaluations of a healthy deployment: nothing fires.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let quiet = prom.alerts().await;
    assert!(quiet.is_empty(), "a healthy deployment raised alerts: {quiet:?}");

    // A worker killed: its scrapes fail.
    let _ = w2_proc.0.kill();
    let l = prom.firing("KvfabricWorkerDown", &[("instance", &w2.to_string())]).await;
    assert_eq!(l["severity"], "warning", "{l}");
    assert!(
        !prom
            .alerts()
            .await
            .iter()
            .any(|(n, _, l)| n == "KvfabricWorkerDown" && l["instance"] == w1.to_string()),
        "only the killed worker is down"
    );

    // NATS stopped: the frontend and the surviving worker say so.
    nats.kill();
    for (job, addr) in [("kvfabric-frontend", fe), ("kvfabric-worker", w1)] {
        let labels = [("job", job), ("instance", &addr.to_string()), ("component", "nats")];
        prom.firing("KvfabricControlPlaneDown", &labels).await;
    }
    assert!(
        !prom
            .alerts()
            .await
            .iter()
            .any(|(n, _, l)| n == "KvfabricControlPlaneDown" && l["component"] == "etcd"),
        "etcd is up"
    );

    // The model's last worker killed: once its lease lapses, no worker serves the model.
    let _ = w1_proc.0.kill();
    prom.firing("KvfabricNoWorkersForModel", &[("model", "mock"), ("instance", &fe.to_string())])
        .await;
    prom.firing("KvfabricWorkerDown", &[("instance", &w1.to_string())]).await;
}

/// `s` as a URL query value.
fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}
