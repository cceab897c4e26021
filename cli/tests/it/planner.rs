//! The live planner over real etcd and NATS: `kvfabric frontend --planner` starts local
//! `kvfabric worker` processes (the mock engine) from a profile `kvfabric profile` measured,
//! scales them up under a load one worker cannot serve within the targets, drains them when
//! the load falls, and no request fails across the scale-down. `kvfabric up --planner` does
//! the same with workers in its own process, and with pools of prefill and decode workers
//! (`--planner-layout disaggregated`).

use crate::common;

use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{get, post_json, spawn_server, Proc};
use kvfabric::testkit::{EtcdServer, NatsServer};
use serde_json::json;

const MOCK: &str = "--engine mock --disk-blocks 0 --max-batch 8 --mock-prefill-us 40 \
--mock-decode-us 8000 --mock-decode-kv-us 0.2";

fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

async fn planner_workers(addr: SocketAddr) -> u64 {
    metric(&get(addr, "/metrics").await.text(), "kvfabric_planner_workers").unwrap_or(0.0) as u64
}

/// Requests that succeeded and failed, over every load of a test.
#[derive(Default)]
struct Counts {
    ok: Arc<AtomicU64>,
    failed: Arc<AtomicU64>,
}

/// Closed-loop clients until `stop`; counts successes and failures.
fn load(
    addr: SocketAddr,
    clients: usize,
    stop: Arc<AtomicBool>,
    counts: &Counts,
) -> Vec<tokio::task::JoinHandle<()>> {
    (0..clients)
        .map(|c| {
            let (stop, ok, failed) = (stop.clone(), counts.ok.clone(), counts.failed.clone());
            tokio::spawn(async move {
                let mut i = 0;
                while !stop.load(Ordering::Relaxed) {
                    let prompt = format!("client {c} request {i}: {}", "some words ".repeat(18));
                    let body = json!({"model": "mock", "prompt": prompt, "max_tokens": 24,
                        "ignore_eos": true, "temperature": 0});
                    let r = post_json(addr, "/v1/completions", &body).await;
                    if r.status == 200 {
                        ok.fetch_add(1, Ordering::Relaxed);
                    } else {
                        failed.fetch_add(1, Ordering::Relaxed);
                        eprintln!("request failed: {} {}", r.status, r.text());
                    }
                    i += 1;
                }
            })
        })
        .collect()
}

/// Runs `clients` closed-loop clients until the planner's worker count passes `reached` or
/// `budget` is spent, then `linger` more; returns the most workers seen.
async fn load_until(
    addr: SocketAddr,
    clients: usize,
    counts: &Counts,
    budget: Duration,
    reached: impl Fn(u64) -> bool,
    linger: Duration,
) -> u64 {
    let stop = Arc::new(AtomicBool::new(false));
    let tasks = load(addr, clients, stop.clone(), counts);
    let (start, mut most) = (Instant::now(), 0);
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let workers = planner_workers(addr).await;
        most = most.max(workers);
        if reached(workers) || start.elapsed() > budget {
            break;
        }
    }
    tokio::time::sleep(linger).await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
    most
}

/// 24 clients: one worker (8 sequences a step) queues them, so TTFT p90 is far above 150 ms
/// and the rate above what one worker decodes. Until the planner runs more than `from`.
async fn heavy_load(addr: SocketAddr, counts: &Counts, from: u64) -> u64 {
    load_until(addr, 24, counts, Duration::from_secs(25), |w| w > from, Duration::ZERO).await
}

/// A light load while workers drain back to `to` (none of its requests may fail), and past
/// the drains (a worker stops within a second or so of its last request).
async fn light_load(addr: SocketAddr, counts: &Counts, to: u64) {
    let (budget, linger) = (Duration::from_secs(30), Duration::from_secs(3));
    load_until(addr, 2, counts, budget, |w| w <= to, linger).await;
}

/// Drives `addr` with a heavy load until the planner runs at least two workers, then with a
/// light load until it is back to one. Returns the requests that succeeded and failed, and
/// the most workers seen.
async fn up_then_down(addr: SocketAddr) -> (u64, u64, u64) {
    let counts = Counts::default();
    let most = heavy_load(addr, &counts, 1).await;
    if most >= 2 {
        light_load(addr, &counts, 1).await;
    }
    (counts.ok.load(Ordering::Relaxed), counts.failed.load(Ordering::Relaxed), most)
}

/// Starts `cmd` (a server that prints `... at http://ADDR/v1` first) with the planner
/// settings both tests share, and returns it with its address (its later output drained).
fn serve_planned(mut cmd: Command, profile: &std::path::Path) -> (Proc, SocketAddr, String) {
    cmd.arg("--planner")
        .arg(profile)
        .args(["--planner-min-workers", "1", "--planner-max-workers", "3"])
        .args(["--planner-interval-s", "1", "--planner-ttft-ms", "150", "--planner-itl-ms", "30"])
        .args(["--planner-percentile", "p90", "--planner-scale-down-after", "2"]);
    spawn_server(cmd)
}

/// The mock engine's profile, measured by `kvfabric profile`.
fn measure_the_mock(dir: &std::path::Path) -> std::path::PathBuf {
    let profile = dir.join("mock.json");
    let st = Command::new(env!("CARGO_BIN_EXE_kvfabric"))
        .args(["profile", "--prompts", "64,256", "--batches", "1,4,8", "--contexts", "256"])
        .args(["--decode-tokens", "8", "--reps", "1", "--tiers", "none", "--json", "--out"])
        .arg(&profile)
        .args(MOCK.split_whitespace())
        .env_remove("KVFABRIC_CONFIG")
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(st.success());
    profile
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_planner_scales_workers_up_under_load_and_drains_them_without_losing_requests() {
    let dir = tempfile::tempdir().unwrap();
    let exe = env!("CARGO_BIN_EXE_kvfabric");
    let profile = measure_the_mock(dir.path());
    let (etcd, nats) = (EtcdServer::start().unwrap(), NatsServer::start().unwrap());
    let log = dir.path().join("decisions.jsonl");
    let mut cmd = Command::new(exe);
    cmd.args(["frontend", "--port", "0", "--namespace", "plan", "--secret", "planner-test"])
        .args(["--name", "planner-test-fe"])
        .args(["--etcd", &etcd.endpoint(), "--nats", &nats.url()])
        .args(["--planner-worker-args", &format!("{MOCK} --lease-ttl-s 2")])
        .arg("--planner-log")
        .arg(&log);
    let (frontend, addr, _) = serve_planned(cmd, &profile);
    assert_eq!(planner_workers(addr).await, 1, "the fewest workers start with the frontend");

    let (ok, failed, most) = up_then_down(addr).await;
    assert!(most >= 2, "the planner did not scale up under load (workers: {most})");
    assert_eq!(planner_workers(addr).await, 1, "the planner did not scale back down");
    let metrics = get(addr, "/metrics").await.text();
    assert_eq!(failed, 0, "requests failed across scaling");
    assert!(ok > 50);
    assert_eq!(metric(&metrics, "kvfabric_planner_draining_workers"), Some(0.0), "{metrics}");
    assert!(metrics.contains("kvfabric_planner_decisions_total{action=\"up\"}"), "{metrics}");
    let health = get(addr, "/health").await.json();
    assert_eq!(health["planner"]["workers"], 1, "{health}");
    assert_eq!(health["planner"]["scale_failures"], 0, "{health}");
    // The decision log has a line per interval, with its reasons.
    let decisions: Vec<serde_json::Value> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(decisions.iter().any(|d| d["action"] == "up"));
    assert!(decisions.iter().any(|d| d["action"] == "down"));
    assert!(decisions.iter().all(|d| !d["reasons"].as_array().unwrap().is_empty()));
    // A stopping frontend drains its workers: none is left behind.
    let mut frontend = frontend;
    // SAFETY: the pid of a child this test spawned and has not reaped.
    assert_eq!(unsafe { libc::kill(frontend.0.id() as i32, libc::SIGTERM) }, 0);
    let status = frontend.0.wait().unwrap();
    assert!(status.success(), "{status}");
    let left = Command::new("pgrep").args(["-f", "planner-test-fe-w-"]).output().unwrap();
    assert!(left.stdout.is_empty(), "workers left: {}", String::from_utf8_lossy(&left.stdout));
}

/// `kvfabric up --planner`: the same, with the workers in the process (embedded control
/// plane), from one worker up under load and back to one, no request failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_with_the_planner_scales_its_own_workers() {
    let dir = tempfile::tempdir().unwrap();
    let profile = measure_the_mock(dir.path());
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvfabric"));
    cmd.args(["up", "--port", "0", "--name", "planned"]).args(MOCK.split_whitespace());
    let (up, addr, line) = serve_planned(cmd, &profile);
    assert!(line.contains("1..=3 planned workers"), "{line}");
    assert_eq!(planner_workers(addr).await, 1);
    let (_, failed, most) = up_then_down(addr).await;
    assert!(most >= 2, "up's planner did not scale up under load");
    assert_eq!(planner_workers(addr).await, 1, "up's planner did not scale back down");
    assert_eq!(failed, 0, "requests failed across scaling");
    let mut up = up;
    // SAFETY: the pid of a child this test spawned and has not reaped.
    assert_eq!(unsafe { libc::kill(up.0.id() as i32, libc::SIGTERM) }, 0);
    let exit = up.0.wait().unwrap();
    assert!(exit.success(), "kvfabric up did not stop cleanly on SIGTERM: {exit}");
}

fn pool_workers(text: &str, pool: &str) -> Option<f64> {
    metric(text, &format!("kvfabric_planner_pool_workers{{pool=\"{pool}\",state=\"serving\"}}"))
}

/// `kvfabric up --planner --planner-layout disaggregated`: a pool of prefill workers and one
/// of decode workers, one of each at first; requests go through remote prefill; under load
/// the planner adds workers to a pool, and drains them after, no request failed. Each
/// decision names its pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disaggregated_planner_scales_prefill_and_decode_pools() {
    let dir = tempfile::tempdir().unwrap();
    let profile = measure_the_mock(dir.path());
    let log = dir.path().join("decisions.jsonl");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvfabric"));
    cmd.args(["up", "--port", "0", "--name", "pools"])
        .args(MOCK.split_whitespace())
        .args(["--planner-layout", "disaggregated", "--prefill-threshold", "64"])
        .arg("--planner-log")
        .arg(&log);
    let (up, addr, _) = serve_planned(cmd, &profile);
    let m = get(addr, "/metrics").await.text();
    assert_eq!(pool_workers(&m, "prefill"), Some(1.0), "{m}");
    assert_eq!(pool_workers(&m, "decode"), Some(1.0), "{m}");
    assert_eq!(planner_workers(addr).await, 2);

    let counts = Counts::default();
    let most = heavy_load(addr, &counts, 2).await;
    assert!(most >= 3, "the planner added no worker to either pool under load");
    // The decode workers' reports: prompts went to the prefill workers.
    let s = get(addr, "/dashboard/state").await.json();
    let remote: u64 = s["workers"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|w| w["stats"]["remote_prefills"].as_u64())
        .sum();
    assert!(remote > 0, "no prompt went through a prefill worker: {s}");
    let roles: Vec<&str> =
        s["workers"].as_array().unwrap().iter().filter_map(|w| w["role"].as_str()).collect();
    assert!(roles.contains(&"prefill") && roles.contains(&"decode"), "{roles:?}");
    // A light load while the pools drain back to one worker each. Each pool's drain to one
    // worker is read from the decisions, not from the pools after it: on a starved machine
    // the light load's own TTFTs may be over target, and a pool may rightly grow again.
    light_load(addr, &counts, 2).await;
    assert_eq!(counts.failed.load(Ordering::Relaxed), 0, "requests failed across scaling");
    let decisions: Vec<serde_json::Value> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    for pool in ["prefill", "decode"] {
        assert!(decisions.iter().any(|d| d["pool"] == pool), "no {pool} decision");
        let ups = decisions.iter().filter(|d| d["pool"] == pool && d["action"] == "up").count();
        println!("{pool}: scaled up {ups} times");
        assert!(
            ups == 0
                || decisions
                    .iter()
                    .any(|d| d["pool"] == pool && d["action"] == "down" && d["after"] == 1),
            "the {pool} pool grew and never drained back to one worker: {decisions:#?}"
        );
    }
    assert!(decisions.iter().any(|d| d["action"] == "up"), "no scale-up decision");
    assert!(decisions.iter().any(|d| d["action"] == "down"), "no scale-down decision");
    let mut up = up;
    // SAFETY: the pid of a child this test spawned and has not reaped.
    assert_eq!(unsafe { libc::kill(up.0.id() as i32, libc::SIGTERM) }, 0);
    let exit = up.0.wait().unwrap();
    assert!(exit.success(), "kvfabric up did not stop cleanly on SIGTERM: {exit}");
}
