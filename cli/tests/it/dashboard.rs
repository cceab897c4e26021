//! `/dashboard` in a real browser: Debian's Chromium, headless, driven by Playwright
//! (`tests/browser/dashboard_driver.py`), against `kvfabric frontend`, two `kvfabric
//! worker` processes and a `kvfabric fabric` node over real etcd and NATS. The page loads
//! with no console errors, its numbers match `/metrics`, the fabric node shows with its own
//! tier, a killed worker leaves its workers table within its lease, and the cache map of a
//! prompt sent before shows the worker that served it holding its blocks.
//!
//! Needs `/usr/bin/chromium` and Python with `playwright` (`scripts/setup.sh test` installs
//! both; `KVFABRIC_TEST_PYTHON` names the Python, as `scripts/test.sh` sets it).
//! `KVFABRIC_DASHBOARD_SCREENSHOT=FILE.png` also saves a screenshot of the page.

use crate::common;

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use common::{get, post_json, spawn_worker, Proc};
use kvfabric::testkit::{EtcdServer, NatsServer};
use serde_json::{json, Value};

const SECRET: &str = "dashboard-test-secret";
const LEASE_S: u64 = 3;

/// The Python with Playwright, and Chromium: present, or the test says how to get them.
fn browser_python() -> std::path::PathBuf {
    assert!(
        std::path::Path::new("/usr/bin/chromium").exists(),
        "no /usr/bin/chromium: run scripts/setup.sh test (it installs Debian's chromium)"
    );
    kvfabric::testkit::test_python("playwright.sync_api")
}

/// The page in Chromium, one command at a time; each answer within [`ANSWER_WITHIN`].
struct Browser {
    child: Child,
    stdin: ChildStdin,
    lines: std::sync::mpsc::Receiver<String>,
}

const ANSWER_WITHIN: Duration = Duration::from_secs(60);

impl Browser {
    fn open(base: &str) -> Self {
        let driver = std::path::Path::new(&std::env::var("CARGO_MANIFEST_DIR").unwrap())
            .join("tests/browser/dashboard_driver.py");
        let mut child = Command::new(browser_python())
            .arg(driver)
            .arg(base)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("starting the browser driver");
        let stdin = child.stdin.take().unwrap();
        let stdout: ChildStdout = child.stdout.take().unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        let mut b = Browser { child, stdin, lines };
        let ready = b.read();
        assert_eq!(ready["ready"], true, "{ready}");
        b
    }

    fn read(&mut self) -> Value {
        let line = self
            .lines
            .recv_timeout(ANSWER_WITHIN)
            .unwrap_or_else(|e| panic!("the browser driver did not answer: {e}"));
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("driver said {line:?}: {e}"))
    }

    fn ask(&mut self, cmd: Value) -> Value {
        writeln!(self.stdin, "{cmd}").unwrap();
        let v = self.read();
        assert_eq!(v["errors"], json!([]), "the page logged errors: {v}");
        v
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "{}", json!({"cmd": "quit"}));
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A metric's value in OpenMetrics text (the line `name value`).
fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name} in /metrics"))
}

/// The page's number in a cell (`1,234`).
fn shown(snap: &Value, name: &str) -> f64 {
    let text = snap["metrics"][name].as_str().unwrap_or_else(|| panic!("no {name}: {snap}"));
    text.replace(',', "").parse().unwrap_or_else(|_| panic!("{name} shows {text:?}"))
}

fn names(rows: &Value) -> Vec<String> {
    let mut v: Vec<String> =
        rows.as_array().unwrap().iter().map(|r| r["worker"].as_str().unwrap().into()).collect();
    v.sort();
    v
}

fn worker(name: &str, etcd: &EtcdServer, nats: &NatsServer) -> Proc {
    let mut args = common::mock_worker_args("dash", &etcd.endpoint(), &nats.url(), SECRET);
    let lease = LEASE_S.to_string();
    args.extend(["--lease-ttl-s", &lease, "--mock-decode-us", "2000"].map(String::from));
    spawn_worker(name, &args).0
}

fn fabric_node(name: &str, etcd: &EtcdServer, nats: &NatsServer) -> Proc {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvfabric"));
    cmd.args(["fabric", "--name", name, "--namespace", "dash", "--host-blocks", "64"])
        .args(["--etcd", &etcd.endpoint(), "--nats", &nats.url()])
        .env("KVFABRIC_SECRET", SECRET)
        .env_remove("KVFABRIC_MODEL");
    let (proc, line) = common::spawn_line(&mut cmd);
    assert!(line.contains("\"fabric\""), "fabric node {name} did not start: {line}");
    proc
}

fn frontend(etcd: &EtcdServer, nats: &NatsServer) -> (Proc, SocketAddr) {
    common::spawn_frontend("dash-fe", "dash", SECRET, &etcd.endpoint(), &nats.url())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_shows_the_fabric_in_a_real_browser() {
    let (etcd, nats) = (EtcdServer::start().unwrap(), NatsServer::start().unwrap());
    let (_fe, addr) = frontend(&etcd, &nats);
    let mut a = worker("dash-a", &etcd, &nats);
    let _b = worker("dash-b", &etcd, &nats);
    let _fabric = fabric_node("dash-g4", &etcd, &nats);
    let deadline = Instant::now() + Duration::from_secs(20);
    while get(addr, "/health").await.json()["routing"]["workers"].as_array().map_or(0, Vec::len) < 2
    {
        assert!(Instant::now() < deadline, "the frontend did not see both workers");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // A small load: prompts that share a long prefix, then one remembered prompt.
    let prefix = "the fabric keeps every block of this shared system prompt ".repeat(6);
    for i in 0..10 {
        let body = json!({"model": "mock", "prompt": format!("{prefix} question {i}"),
            "max_tokens": 8, "ignore_eos": true});
        assert_eq!(post_json(addr, "/v1/completions", &body).await.status, 200);
    }
    let remembered = format!("{} a prompt the cache map must find", "kvfabric ".repeat(40));
    let r = post_json(
        addr,
        "/v1/completions",
        &json!({"model": "mock", "prompt": remembered, "max_tokens": 4}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let served_by = r.header("x-kvfabric-worker").expect("the serving worker's header").to_string();
    // The workers' KV events reach the frontend's index through NATS.
    let start = std::time::Instant::now();
    while common::metric(&get(addr, "/metrics").await.text(), "kvfabric_frontend_kv_events_total")
        < 1.0
    {
        assert!(start.elapsed() < Duration::from_secs(20), "no KV event reached the frontend");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let mut page = Browser::open(&format!("http://{addr}"));
    let snap = page.ask(json!({"cmd": "snapshot"}));
    assert_eq!(snap["status"], "ok", "{snap}");
    assert_eq!(names(&snap["workers"]), ["dash-a", "dash-b"], "{snap}");
    for w in snap["workers"].as_array().unwrap() {
        assert_eq!(w["state"], "serving", "{w}");
        assert_eq!(w["role"], "aggregated", "{w}");
    }
    // The fabric node (G4): its own host tier, as it reports it, empty.
    assert_eq!(snap["fabric_shown"], true, "{snap}");
    let g4 = snap["fabric"].as_array().unwrap();
    assert_eq!(g4.len(), 1, "{snap}");
    assert_eq!(g4[0]["node"], "dash-g4", "{snap}");
    assert_eq!(g4[0]["host"], "0/64", "{snap}");
    // Its numbers are those of /metrics (no request in flight now).
    let m = get(addr, "/metrics").await.text();
    assert_eq!(shown(&snap, "ok"), metric(&m, "kvfabric_requests_total{outcome=\"ok\"}"));
    assert_eq!(shown(&snap, "ok"), 11.0);
    assert_eq!(shown(&snap, "prompt_tokens"), metric(&m, "kvfabric_prompt_tokens_total"));
    assert_eq!(
        shown(&snap, "cached_prompt_tokens"),
        common::metric_sum(&m, "kvfabric_cached_prompt_tokens_total")
    );
    assert!(shown(&snap, "cached_prompt_tokens") > 0.0, "the shared prefix was not reused");
    assert_eq!(shown(&snap, "generated_tokens"), metric(&m, "kvfabric_generation_tokens_total"));
    assert_eq!(
        shown(&snap, "ttft_count"),
        metric(&m, "kvfabric_time_to_first_token_seconds_count")
    );
    let requests: f64 = snap["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["requests"].as_str().unwrap().replace(',', "").parse::<f64>().unwrap())
        .sum();
    assert_eq!(requests, 11.0, "{snap}");
    assert!(snap["metrics"]["discovery"].as_str().unwrap().starts_with("etcd: connected"));
    assert!(snap["metrics"]["bus"].as_str().unwrap().starts_with("nats: connected"));
    assert!(shown(&snap, "kv_events") > 0.0, "{snap}");

    // The cache map of the remembered prompt: the worker that served it holds its blocks,
    // and the router would send it there again.
    let map = page.ask(json!({"cmd": "cachemap", "prompt": remembered, "model": "mock"}));
    let rows = map["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2, "{map}");
    let row = rows.iter().find(|r| r["worker"] == served_by.as_str()).expect("its row");
    let cached: u64 = row["cached"].as_str().unwrap().parse().unwrap();
    let host: u64 = row["host"].as_str().unwrap().parse().unwrap();
    assert!(cached >= 20, "the serving worker holds {cached} blocks of it: {map}");
    assert_eq!(host, cached, "its blocks are in the host tier: {map}");
    assert_eq!(row["chosen"], true, "{map}");
    assert!(map["reason"].as_str().unwrap().contains(&served_by), "{map}");
    let other = rows.iter().find(|r| r["worker"] != served_by.as_str()).unwrap();
    assert_eq!(other["chosen"], false, "{map}");

    if let Some(path) = std::env::var_os("KVFABRIC_DASHBOARD_SCREENSHOT") {
        page.ask(json!({"cmd": "screenshot", "path": path.to_string_lossy()}));
    }

    // A worker killed (no drain) leaves the workers table within its lease, and shows as
    // lost among the departed.
    a.0.kill().unwrap();
    let killed = Instant::now();
    let snap = loop {
        let snap = page.ask(json!({"cmd": "snapshot"}));
        if names(&snap["workers"]) == ["dash-b"] {
            break snap;
        }
        assert!(
            killed.elapsed() < Duration::from_secs(LEASE_S + 10),
            "the killed worker is still shown after {:?}: {snap}",
            killed.elapsed()
        );
    };
    println!("the killed worker left the page after {:?} (lease {LEASE_S} s)", killed.elapsed());
    let departed = snap["departed"].as_array().unwrap();
    assert!(departed.iter().any(|d| d["worker"] == "dash-a" && d["state"] == "lost"), "{snap}");
}
