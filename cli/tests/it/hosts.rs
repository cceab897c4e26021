//! Many machines, the small version that runs in CI: three hosts made of Linux namespaces by
//! `scripts/cluster.sh` (their own network, hostname, pids and mounts), a 3-member etcd
//! cluster and a 3-server NATS cluster with JetStream across them, a frontend on the first
//! host and a worker on each of the other two. Under a steady load from this machine's own
//! namespace:
//! - a worker host is cut off the network and healed: no request hangs, no answer differs from
//!   the quiet run's, routing stops sending to it within its lease and uses it again after;
//! - every worker is restarted in turn (drain, stop, start): not one request fails.
//!
//! It needs root (CI runs as root) and fails, rather than skips, when namespaces cannot be
//! made. What it cannot prove: links here have no latency or loss (this kernel has no
//! `netem`), so timeouts fire on silence only.
//!
//! Over 1,000 lines because it is one harness: the namespace hosts, the deployment on them, the
//! load that runs through every fault and the fault matrix share its state; its tests are few
//! and each reads top to bottom.

use crate::common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Hosts made by `scripts/cluster.sh`, torn down when dropped (also after a failure).
struct Cluster {
    env: Vec<(String, String)>,
    dir: PathBuf,
    subnet: String,
}

impl Cluster {
    fn new(hosts: usize) -> Cluster {
        // /proc/self belongs to the effective user.
        let root =
            std::os::unix::fs::MetadataExt::uid(&std::fs::metadata("/proc/self").unwrap()) == 0;
        assert!(root, "this test makes network, pid, UTS and mount namespaces: it needs root (CI runs as root)");
        let id = std::process::id();
        let name = format!("kt{}", id % 10_000);
        let subnet = format!("10.212.{}", id % 250);
        let dir = std::env::temp_dir().join(format!("kvfabric-hosts-test-{id}"));
        let env = vec![
            ("KVF_CLUSTER".to_string(), name),
            ("KVF_SUBNET".to_string(), subnet.clone()),
            ("KVF_DIR".to_string(), dir.display().to_string()),
            ("KVFABRIC_BIN".to_string(), env!("CARGO_BIN_EXE_kvfabric").to_string()),
            // One etcd member and one NATS server on each of the first three hosts.
            ("KVF_NATS_HOSTS".to_string(), "h1 h2 h3".to_string()),
            ("KVF_MODEL".to_string(), "mock".to_string()),
            ("KVF_LEASE_TTL_S".to_string(), "3".to_string()),
        ];
        let c = Cluster { env, dir, subnet };
        c.sh(&["hosts", &hosts.to_string()]);
        std::fs::create_dir_all(c.dir.join("etc")).unwrap();
        std::fs::write(c.dir.join("etc/secret"), "hosts-test-secret-of-the-cluster").unwrap();
        c
    }

    /// Runs `cluster.sh ARGS`; panics with its output if it fails.
    fn sh(&self, args: &[&str]) -> String {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/cluster.sh");
        let out = std::process::Command::new(script)
            .args(args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .output()
            .expect("running scripts/cluster.sh");
        assert!(
            out.status.success(),
            "cluster.sh {args:?} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn addr(&self, host: usize, port: u16) -> SocketAddr {
        format!("{}.{}:{port}", self.subnet, 10 + host).parse().unwrap()
    }

    fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.dir.join("logs").join(format!("{name}.log")))
            .unwrap_or_default()
    }

    /// Three hosts, an etcd member and a NATS server (one cluster each) on every one,
    /// answering.
    async fn with_control_plane() -> Cluster {
        let c = Cluster::new(3);
        for i in ["1", "2", "3"] {
            c.sh(&["start-etcd", i]);
            c.sh(&["start-nats", i]);
        }
        for h in 1..=3 {
            let (etcd, nats) = (c.addr(h, 2379), c.addr(h, 8222));
            wait_for("etcd and NATS answer", Duration::from_secs(30), async || {
                let e = get(etcd, "/health");
                let n = get(nats, "/healthz?js-enabled-only=true");
                matches!(e.await, Ok(r) if r.status == 200)
                    && matches!(n.await, Ok(r) if r.status == 200)
            })
            .await;
        }
        c
    }

    fn start_worker(&self, host: usize) {
        let (h, w) = (format!("h{host}"), format!("w{host}"));
        self.sh(&[
            "start-worker",
            &h,
            &w,
            "aggregated",
            "--engine",
            "mock",
            "--served-model-name",
            "mock",
            "--mock-decode-us",
            "4000",
        ]);
    }
}

impl Cluster {
    /// Cuts the host that `name` runs on off the network for `secs` seconds, then heals it.
    async fn cut_for(&self, name: &str, secs: u64) {
        let host = self.sh(&["host-of", name]).trim().to_string();
        self.sh(&["cut", &host]);
        tokio::time::sleep(Duration::from_secs(secs)).await;
        self.sh(&["heal", &host]);
    }

    /// Kills `name` (-9) and starts it again `secs` seconds later.
    async fn kill_for(&self, name: &str, secs: u64) {
        self.sh(&["stop", name, "KILL"]);
        tokio::time::sleep(Duration::from_secs(secs)).await;
        self.sh(&["restart", name]);
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = self.sh_quiet(&["down"]);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Cluster {
    fn sh_quiet(&self, args: &[&str]) -> std::io::Result<std::process::Output> {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/cluster.sh");
        std::process::Command::new(script)
            .args(args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .output()
    }
}

/// One HTTP exchange within 2 s; never panics (the server may be down or cut off).
async fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> Result<common::Response, String> {
    let req = common::request_bytes(method, path, body);
    let work = async {
        let mut s = tokio::net::TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
        s.write_all(&req).await.map_err(|e| e.to_string())?;
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).await.map_err(|e| e.to_string())?;
        if !buf.windows(4).any(|w| w == b"\r\n\r\n") {
            return Err("no HTTP response".to_string());
        }
        Ok(common::parse_response(&buf))
    };
    tokio::time::timeout(Duration::from_secs(2), work).await.map_err(|_| "timed out".to_string())?
}

async fn get(addr: SocketAddr, path: &str) -> Result<common::Response, String> {
    http(addr, "GET", path, None).await
}

/// What one request came to.
#[derive(Debug, Clone)]
struct Outcome {
    prompt: usize,
    started: Instant,
    took: Duration,
    /// The text and the worker that answered, or why there is no answer.
    result: Result<(String, String), String>,
}

/// A request's deadline, client side: nothing may take longer.
const CLIENT_DEADLINE: Duration = Duration::from_secs(30);

/// POSTs a completion of prompt `i` to `fe`, within [`CLIENT_DEADLINE`]; never panics.
async fn complete(fe: SocketAddr, i: usize) -> Result<(String, String), String> {
    let body = json!({
        "model": "mock",
        "prompt": format!("request {i} of the hosts test: the same words every time, {i}"),
        "max_tokens": 24,
    })
    .to_string();
    let req = common::request_bytes("POST", "/v1/completions", Some(&body));
    let work = async {
        let mut s =
            tokio::net::TcpStream::connect(fe).await.map_err(|e| format!("connect: {e}"))?;
        s.write_all(&req).await.map_err(|e| format!("write: {e}"))?;
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).await.map_err(|e| format!("read: {e}"))?;
        if !buf.windows(4).any(|w| w == b"\r\n\r\n") {
            return Err("no HTTP response".to_string());
        }
        let r = common::parse_response(&buf);
        if r.status != 200 {
            return Err(format!("HTTP {}: {}", r.status, r.text()));
        }
        let v = r.json();
        let text = v["choices"][0]["text"].as_str().ok_or("no text")?.to_string();
        let worker = v["kvfabric"]["worker"].as_str().unwrap_or("?").to_string();
        Ok((text, worker))
    };
    tokio::time::timeout(CLIENT_DEADLINE, work).await.map_err(|_| "client deadline".to_string())?
}

const PROMPTS: usize = 12;

/// `clients` loops of requests until `stop`, every outcome recorded.
fn load(
    fe: SocketAddr,
    clients: usize,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<Vec<Outcome>> {
    tokio::spawn(async move {
        let mut tasks = Vec::new();
        for c in 0..clients {
            let stop = stop.clone();
            tasks.push(tokio::spawn(async move {
                let mut out = Vec::new();
                let mut n = c;
                while !stop.load(Ordering::Relaxed) {
                    let prompt = n % PROMPTS;
                    let started = Instant::now();
                    let result = complete(fe, prompt).await;
                    out.push(Outcome { prompt, started, took: started.elapsed(), result });
                    n += clients;
                }
                out
            }));
        }
        let mut all = Vec::new();
        for t in tasks {
            all.extend(t.await.unwrap());
        }
        all
    })
}

/// Polls `f` every 100 ms until it holds; panics after `limit`.
async fn wait_for(what: &str, limit: Duration, mut f: impl AsyncFnMut() -> bool) {
    let start = Instant::now();
    while !f().await {
        assert!(start.elapsed() < limit, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The frontend's count of requests sent to `worker`.
async fn sent_to(fe: SocketAddr, worker: &str) -> f64 {
    let Ok(m) = get(fe, "/metrics").await else { return 0.0 };
    let m = m.text();
    let sample = format!("kvfabric_frontend_worker_requests_total{{to_worker=\"{worker}\"}}");
    m.lines()
        .find_map(|l| l.strip_prefix(&sample))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

/// Checks every outcome against the quiet run's answers; returns (answered, failed).
fn check(
    phase: &str,
    outcomes: &[Outcome],
    quiet: &HashMap<usize, String>,
) -> (usize, Vec<String>) {
    let mut failed = Vec::new();
    for o in outcomes {
        assert!(o.took <= CLIENT_DEADLINE, "{phase}: a request took {:?}", o.took);
        match &o.result {
            Ok((text, worker)) => assert_eq!(
                text, &quiet[&o.prompt],
                "{phase}: prompt {} answered differently by {worker}",
                o.prompt
            ),
            Err(e) => failed.push(e.clone()),
        }
    }
    (outcomes.len() - failed.len(), failed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_hosts_survive_a_cut_and_a_rolling_restart_of_their_workers() {
    let c = Cluster::with_control_plane().await;
    c.sh(&["start-frontend", "h1", "frontend-1"]);
    c.start_worker(2);
    c.start_worker(3);
    let fe = c.addr(1, 8000);
    wait_for("the frontend sees both workers", Duration::from_secs(60), async || {
        let m = get(fe, "/metrics").await;
        matches!(m, Ok(r) if r.text().contains("to_worker=\"w2\"") && r.text().contains("to_worker=\"w3\""))
    })
    .await;
    // Each registered the address of its own host, never 0.0.0.0 or loopback.
    for h in [2, 3] {
        let line = format!("\"addr\":\"{}\"", c.addr(h, 7100));
        assert!(
            c.log(&format!("w{h}")).contains(&line),
            "w{h} registered: {}",
            c.log(&format!("w{h}"))
        );
    }

    // The quiet run: each prompt's answer.
    let mut quiet = HashMap::new();
    for i in 0..PROMPTS {
        let (text, _) = complete(fe, i).await.expect("a quiet request");
        quiet.insert(i, text);
    }

    // A worker host cut off for 8 s under load, then healed.
    let stop = Arc::new(AtomicBool::new(false));
    let running = load(fe, 4, stop.clone());
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before = sent_to(fe, "w2").await;
    assert!(before > 0.0, "w2 served nothing before the cut");
    let cut = Instant::now();
    c.sh(&["cut", "h2"]);
    tokio::time::sleep(Duration::from_secs(8)).await;
    let during = sent_to(fe, "w2").await;
    c.sh(&["heal", "h2"]);
    let healed = Instant::now();
    wait_for("w2 serves again after the heal", Duration::from_secs(40), async || {
        sent_to(fe, "w2").await > during
    })
    .await;
    let rejoined = healed.elapsed();
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.store(true, Ordering::Relaxed);
    let outcomes = running.await.unwrap();
    let (answered, failed) = check("cut", &outcomes, &quiet);
    // Routing stopped sending to w2: what started 5 s (its lease, 3 s, and a margin) after the
    // cut and before the heal was answered by w3.
    let settled = cut + Duration::from_secs(5);
    for o in outcomes.iter().filter(|o| o.started > settled && o.started < healed) {
        match &o.result {
            Ok((_, w)) => assert_eq!(w, "w3", "a request routed to the cut-off worker"),
            Err(e) => panic!("a request failed after routing had settled: {e}"),
        }
    }
    let last_to_w2 = outcomes
        .iter()
        .filter(|o| o.started > cut && o.started < healed)
        .filter(|o| matches!(&o.result, Ok((_, w)) if w == "w2"))
        .map(|o| o.started.saturating_duration_since(cut))
        .max();
    eprintln!(
        "cut h2 for 8 s: {} requests, {answered} answered, {} failed {:?}; w2 got {} more \
         requests while cut; last answered by w2 {last_to_w2:?} after the cut; w2 used again \
         {rejoined:?} after the heal",
        outcomes.len(),
        failed.len(),
        failed,
        during - before
    );
    // What failed was in flight on w2 when the link went: at most the clients' count.
    assert!(failed.len() <= 4, "{} requests failed: {failed:?}", failed.len());

    // A rolling restart of the workers under load: not one request fails.
    let stop = Arc::new(AtomicBool::new(false));
    let running = load(fe, 4, stop.clone());
    for h in [2, 3] {
        let w = format!("w{h}");
        let before = sent_to(fe, &w).await;
        let t = Instant::now();
        c.sh(&["stop", &w, "TERM", "40"]);
        let stopped = t.elapsed();
        c.start_worker(h);
        wait_for("the restarted worker serves", Duration::from_secs(60), async || {
            sent_to(fe, &w).await > before
        })
        .await;
        eprintln!("{w}: drained and stopped in {stopped:?}, serving again {:?} after", t.elapsed());
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.store(true, Ordering::Relaxed);
    let outcomes = running.await.unwrap();
    let (answered, failed) = check("rolling restart", &outcomes, &quiet);
    eprintln!("rolling restart of w2, w3: {} requests, {answered} answered", outcomes.len());
    assert!(failed.is_empty(), "requests failed in a rolling restart: {failed:?}");
    assert!(answered > 20, "too little load to prove anything: {answered}");
}

/// Sends `prompt` straight to worker `w` on `host` (its request port, the cluster's secret),
/// told to pull it from `pull`: the tokens, the tokens that came from a peer, and how long it
/// took. Never waits past [`CLIENT_DEADLINE`].
async fn ask_worker(
    addr: SocketAddr,
    w: &str,
    prompt: &[u32],
    pull: Option<kvfabric::contract::generate::PullHint>,
) -> Result<(Vec<u32>, usize, Duration), String> {
    use kvfabric_serving::engine::{GenEvent, GenerateRequest};
    use kvfabric_serving::protocol::{self, Auth, WorkerRequest};
    let started = Instant::now();
    let mut request = GenerateRequest::new(prompt.to_vec(), 8, CLIENT_DEADLINE);
    request.ignore_eos = true;
    request.pull = pull;
    let req = WorkerRequest { model: "mock".into(), request };
    let auth = Auth {
        name: "hosts-test".into(),
        secret: b"hosts-test-secret-of-the-cluster".into(),
        tls: None,
    };
    let work = async {
        let mut s = protocol::connect(addr, w, &auth, &req, Duration::from_secs(5))
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let (mut tokens, mut peer) = (Vec::new(), 0);
        loop {
            let ev: Option<GenEvent> =
                protocol::read_frame(&mut s).await.map_err(|e| format!("read: {e}"))?;
            match ev {
                Some(GenEvent::Started { cached, .. }) => peer = cached.peer_tokens,
                Some(GenEvent::Cached(c)) => peer = c.peer_tokens,
                Some(GenEvent::Token { id, .. }) => tokens.push(id),
                Some(GenEvent::Done { .. }) => return Ok((tokens, peer, started.elapsed())),
                Some(GenEvent::Error(e)) => return Err(e.to_string()),
                Some(_) => {}
                None => return Err("the stream ended".into()),
            }
        }
    };
    tokio::time::timeout(CLIENT_DEADLINE, work).await.map_err(|_| "client deadline".to_string())?
}

/// A worker's `/metrics` sample, 0 when absent or unreachable.
async fn worker_metric(c: &Cluster, host: usize, sample: &str) -> f64 {
    let Ok(m) = get(c.addr(host, 9100), "/metrics").await else { return 0.0 };
    common::metric(&m.text(), sample)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_pulled_across_hosts_survives_its_holder_dying_or_cut_off_mid_pull() {
    // One KV pool across hosts: w3 pulls a prompt's prefix from w2's store, over TCP between
    // their hosts, where told to; the answer is token for token w2's. Then the holder is
    // killed (-9), and cut off the network, while a pull of 100 blocks (74 MB over its link
    // shaped to 200 Mbit/s: 3 s) is under way: each request still answers, the same, computed
    // (the kill within a second or so, the cut within the pull's 5 s deadline).
    let c = Cluster::with_control_plane().await;
    c.start_worker(2);
    c.start_worker(3);
    for h in [2, 3] {
        wait_for(
            "the workers serve",
            Duration::from_secs(60),
            async || matches!(get(c.addr(h, 9100), "/health").await, Ok(r) if r.status == 200),
        )
        .await;
    }
    // 1,601 byte tokens: 100 full blocks and one token to compute.
    fn prompt(salt: u32) -> Vec<u32> {
        (0..1601u32).map(|i| 32 + (i * 7 + salt * 13) % 200).collect()
    }
    fn hint(blocks: u32) -> Option<kvfabric::contract::generate::PullHint> {
        Some(kvfabric::contract::generate::PullHint { from: "w2".into(), blocks })
    }
    let w3_metrics = c.addr(3, 9100);
    let failures = |reason: &'static str| async move {
        let sample = format!("kvfabric_peer_pull_failures_total{{reason=\"{reason}\"}}");
        match get(w3_metrics, "/metrics").await {
            Ok(m) => common::metric(&m.text(), &sample),
            Err(_) => 0.0,
        }
    };

    let (w2, w3) = (c.addr(2, 7100), c.addr(3, 7100));
    // w3 learns w2's store from discovery.
    wait_for("w3 knows w2's store", Duration::from_secs(30), async || {
        worker_metric(&c, 3, "kvfabric_peers_known").await >= 1.0
    })
    .await;

    // Pulled whole, the same answer.
    let p1 = prompt(1);
    let (held, _, _) = ask_worker(w2, "w2", &p1, None).await.expect("w2 computes");
    let (tokens, peer, _) = ask_worker(w3, "w3", &p1, hint(100)).await.expect("w3 answers");
    assert_eq!(peer, 100 * 16, "the whole prefix came from w2");
    assert_eq!(tokens, held, "pulled across hosts, the same tokens");
    assert!(worker_metric(&c, 3, "kvfabric_peer_pulled_blocks_total").await >= 100.0);
    assert!(worker_metric(&c, 2, "kvfabric_peer_served_blocks_total").await >= 100.0);

    // The holder killed mid-pull: computed, the same, soon.
    c.sh(&["shape", "h2", "200mbit"]);
    let p2 = prompt(2);
    let (held, _, _) = ask_worker(w2, "w2", &p2, None).await.expect("w2 computes");
    let asked = tokio::spawn(async move { ask_worker(w3, "w3", &prompt(2), hint(100)).await });
    tokio::time::sleep(Duration::from_millis(1000)).await;
    c.sh(&["stop", "w2", "KILL"]);
    let (tokens, peer, took) = asked.await.unwrap().expect("w3 answers with its holder killed");
    assert_eq!(tokens, held, "computed after the holder died, the same tokens");
    assert_eq!(peer, 0, "nothing came from the killed holder");
    assert!(took < Duration::from_secs(5), "a dead holder is noticed at once: {took:?}");
    assert!(failures("unreachable").await >= 1.0);

    // The holder cut off mid-pull: computed within the pull's deadline, the same.
    c.start_worker(2);
    wait_for(
        "w2 serves again",
        Duration::from_secs(60),
        async || matches!(get(c.addr(2, 9100), "/health").await, Ok(r) if r.status == 200),
    )
    .await;
    let p3 = prompt(3);
    let (held, _, _) = ask_worker(w2, "w2", &p3, None).await.expect("w2 computes");
    // w3 knows the new w2 once a pull of one block w2 holds succeeds (a fresh block each try:
    // one that failed is w3's own after).
    let mut probe = 1000;
    wait_for("w3 knows the restarted w2", Duration::from_secs(30), async || {
        probe += 1;
        let one = prompt(probe)[..17].to_vec();
        ask_worker(w2, "w2", &one, None).await.is_ok()
            && matches!(ask_worker(w3, "w3", &one, hint(1)).await, Ok((_, 16, _)))
    })
    .await;
    let timeouts = failures("timeout").await;
    let asked = tokio::spawn(async move { ask_worker(w3, "w3", &prompt(3), hint(100)).await });
    tokio::time::sleep(Duration::from_millis(1000)).await;
    c.sh(&["cut", "h2"]);
    let (tokens, peer, took) = asked.await.unwrap().expect("w3 answers with its holder cut off");
    c.sh(&["heal", "h2"]);
    assert_eq!(tokens, held, "computed after the holder was cut off, the same tokens");
    assert_eq!(peer, 0, "nothing came from the cut-off holder");
    assert!(took < Duration::from_secs(12), "the pull's deadline bounds the wait: {took:?}");
    assert_eq!(failures("timeout").await, timeouts + 1.0);
    eprintln!("pool across hosts: pulled 100 blocks whole; holder killed and cut off mid-pull, answered the same; the cut cost {took:?}");
}

// --- the full fault matrix (outside CI: scripts/cluster-check.sh) ----------------------------

/// A request of the matrix: prompt `i` (one of four shared prefixes of 256 bytes, then its
/// own words: the mock engine's tokens are bytes) through the frontends in turn; a frontend
/// that cannot be reached is skipped as a load balancer would (counted), never one that took
/// the request.
#[derive(Debug, Clone)]
struct Done {
    /// The model (`mock`: the aggregated workers; `mock-pd`: the prefill/decode pair).
    model: &'static str,
    prompt: String,
    started: Instant,
    ended: Instant,
    failovers: usize,
    result: Result<Answer, String>,
}

#[derive(Debug, Clone)]
struct Answer {
    text: String,
    worker: String,
    prompt_tokens: u64,
    cached_tokens: u64,
    /// Of them, found on a fabric node (G4).
    remote_tokens: u64,
}

const MATRIX_PROMPTS: usize = 32;
const MATRIX_DEADLINE: Duration = Duration::from_secs(20);

fn matrix_prompt(i: usize) -> String {
    let prefix = format!("shared prefix number {} of the fault matrix; ", i % 4).repeat(6);
    format!("{prefix}then request {i} asks its own question, number {i}.")
}

async fn matrix_request(
    fes: &[SocketAddr],
    n: usize,
    model: &str,
    prompt: &str,
) -> (usize, Result<Answer, String>) {
    let body = json!({ "model": model, "prompt": prompt, "max_tokens": 16 }).to_string();
    let req = common::request_bytes("POST", "/v1/completions", Some(&body));
    let mut failovers = 0;
    let mut last = String::new();
    for k in 0..fes.len() {
        let fe = fes[(n + k) % fes.len()];
        let conn =
            tokio::time::timeout(Duration::from_secs(2), tokio::net::TcpStream::connect(fe)).await;
        let mut s = match conn {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                failovers += 1;
                last = format!("connect {fe}: {e}");
                continue;
            }
            Err(_) => {
                failovers += 1;
                last = format!("connect {fe}: timed out");
                continue;
            }
        };
        let work = async {
            s.write_all(&req).await.map_err(|e| format!("write: {e}"))?;
            let mut buf = Vec::new();
            s.read_to_end(&mut buf).await.map_err(|e| format!("read: {e}"))?;
            if !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                return Err("connection closed without a response".to_string());
            }
            let r = common::parse_response(&buf);
            if r.status != 200 {
                let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap_or_default();
                let why = v["error"]["type"].as_str().unwrap_or("?").to_string();
                return Err(format!("HTTP {} {why}", r.status));
            }
            let v = r.json();
            Ok(Answer {
                text: v["choices"][0]["text"].as_str().ok_or("no text")?.to_string(),
                worker: v["kvfabric"]["worker"].as_str().unwrap_or("?").to_string(),
                prompt_tokens: v["usage"]["prompt_tokens"].as_u64().unwrap_or(0),
                cached_tokens: v["usage"]["prompt_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .unwrap_or(0),
                remote_tokens: v["kvfabric"]["cached_tokens"]["remote_tokens"]
                    .as_u64()
                    .unwrap_or(0),
            })
        };
        let r = tokio::time::timeout(MATRIX_DEADLINE, work)
            .await
            .unwrap_or_else(|_| Err("client deadline".to_string()));
        return (failovers, r);
    }
    (failovers, Err(last))
}

/// A number no other prompt of this run has.
fn unique() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

fn matrix_load(
    fes: Vec<SocketAddr>,
    clients: usize,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<Vec<Done>> {
    tokio::spawn(async move {
        let fes = Arc::new(fes);
        let mut tasks = Vec::new();
        for c in 0..clients {
            let (stop, fes) = (stop.clone(), fes.clone());
            tasks.push(tokio::spawn(async move {
                let mut out = Vec::new();
                let mut n = c;
                while !stop.load(Ordering::Relaxed) {
                    // The last client sends new prompts (nothing cached) to the prefill/decode
                    // pair: each is prefilled remotely, across hosts.
                    let (model, prompt) = if c == clients - 1 {
                        // New from its first token: nothing of it is cached anywhere.
                        ("mock-pd", format!("unique {} {}", unique(), matrix_prompt(n)))
                    } else {
                        ("mock", matrix_prompt((n * 7) % MATRIX_PROMPTS))
                    };
                    let started = Instant::now();
                    let (failovers, result) = matrix_request(&fes, n, model, &prompt).await;
                    let ended = Instant::now();
                    out.push(Done { model, prompt, started, ended, failovers, result });
                    n += clients;
                }
                out
            }));
        }
        let mut all = Vec::new();
        for t in tasks {
            all.extend(t.await.unwrap());
        }
        all
    })
}

/// The sum of a family's samples on every frontend (0 where absent or unreachable).
async fn frontend_sum(fes: &[SocketAddr], name: &str) -> f64 {
    let mut sum = 0.0;
    for fe in fes {
        let Ok(r) = get(*fe, "/metrics").await else {
            continue;
        };
        for l in r.text().lines() {
            let Some(rest) = l.strip_prefix(name) else { continue };
            if rest.starts_with(' ') || rest.starts_with('{') {
                sum += l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
            }
        }
    }
    sum
}

/// Whether any frontend routes to `worker` now (it is in discovery for them).
async fn routable(fes: &[SocketAddr], worker: &str) -> bool {
    let sample = format!("to_worker=\"{worker}\"");
    for fe in fes {
        if let Ok(r) = get(*fe, "/metrics").await {
            if r.text()
                .lines()
                .any(|l| l.starts_with("kvfabric_frontend_worker_requests") && l.contains(&sample))
            {
                return true;
            }
        }
    }
    false
}

/// One row of the matrix.
#[derive(Debug, Default)]
struct Row {
    scenario: String,
    sent: usize,
    answered: usize,
    client_failovers: usize,
    frontend_retries: f64,
    failed: std::collections::BTreeMap<String, usize>,
    wrong: usize,
    stopped: Option<Duration>,
    back: Option<Duration>,
    reuse_before: f64,
    reuse_after: f64,
    /// Prompt tokens found on the fabric nodes: before, during and after the fault.
    g4: [u64; 3],
}

impl Row {
    fn markdown(&self) -> String {
        let d = |t: Option<Duration>| {
            t.map_or("—".to_string(), |t| format!("{:.1} s", t.as_secs_f64()))
        };
        let failed = if self.failed.is_empty() {
            "0".to_string()
        } else {
            self.failed.iter().map(|(k, v)| format!("{v} {k}")).collect::<Vec<_>>().join("; ")
        };
        format!(
            "| {} | {} | {} | {} / {} | {} | {} | {} | {} | {:.2} → {:.2} | {} / {} / {} |",
            self.scenario,
            self.sent,
            self.answered,
            self.frontend_retries,
            self.client_failovers,
            failed,
            self.wrong,
            d(self.stopped),
            d(self.back),
            self.reuse_before,
            self.reuse_after,
            self.g4[0],
            self.g4[1],
            self.g4[2]
        )
    }
}

/// Reuse (cached prompt tokens over prompt tokens) of the answers of `done`.
fn reuse<'a>(done: impl Iterator<Item = &'a Done>) -> f64 {
    let (mut cached, mut prompt) = (0u64, 0u64);
    for d in done {
        if let Ok(a) = &d.result {
            cached += a.cached_tokens;
            prompt += a.prompt_tokens;
        }
    }
    if prompt == 0 {
        0.0
    } else {
        cached as f64 / prompt as f64
    }
}

/// Prompt tokens of the answers of `done` found on the fabric nodes.
fn g4<'a>(done: impl Iterator<Item = &'a Done>) -> u64 {
    done.filter_map(|d| d.result.as_ref().ok()).map(|a| a.remote_tokens).sum()
}

/// Runs `fault` under load: 4 s of load before, the fault (it returns when it is healed, or
/// at once for a fault that is not healed), `after` of load after. `lost`: the worker the
/// fault takes away, whose leaving and return are timed.
async fn scenario(
    name: &str,
    fes: &[SocketAddr],
    quiet: &mut HashMap<String, String>,
    lost: Option<&str>,
    after: Duration,
    fault: impl AsyncFnOnce() -> (),
) -> Row {
    let retries0 = frontend_sum(fes, "kvfabric_frontend_retries_total").await
        + frontend_sum(fes, "kvfabric_frontend_stream_migrations_total").await;
    let stop = Arc::new(AtomicBool::new(false));
    let running = matrix_load(fes.to_vec(), 6, stop.clone());
    tokio::time::sleep(Duration::from_secs(4)).await;
    let at = Instant::now();
    // Watch the lost worker's place in routing while the fault runs.
    let watch_stop = Arc::new(AtomicBool::new(false));
    let watcher = lost.map(|w| {
        let (w, fes, stop) = (w.to_string(), fes.to_vec(), watch_stop.clone());
        tokio::spawn(async move {
            let mut gone = None;
            while !stop.load(Ordering::Relaxed) {
                if gone.is_none() && !routable(&fes, &w).await {
                    gone = Some(at.elapsed());
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            gone
        })
    });
    fault().await;
    let healed = Instant::now();
    let mut back = None;
    if let Some(w) = lost {
        let limit = Instant::now() + Duration::from_secs(60);
        while Instant::now() < limit {
            if routable(fes, w).await {
                back = Some(healed.elapsed());
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    tokio::time::sleep(after).await;
    watch_stop.store(true, Ordering::Relaxed);
    let stopped = match watcher {
        Some(w) => w.await.unwrap(),
        None => None,
    };
    stop.store(true, Ordering::Relaxed);
    let done = running.await.unwrap();
    let retries = frontend_sum(fes, "kvfabric_frontend_retries_total").await
        + frontend_sum(fes, "kvfabric_frontend_stream_migrations_total").await
        - retries0;
    let mut row = Row {
        scenario: name.to_string(),
        sent: done.len(),
        client_failovers: done.iter().map(|d| d.failovers).sum(),
        frontend_retries: retries,
        stopped,
        back,
        reuse_before: reuse(done.iter().filter(|d| d.ended < at)),
        reuse_after: reuse(done.iter().filter(|d| d.started > healed + Duration::from_secs(3))),
        g4: [
            g4(done.iter().filter(|d| d.ended < at)),
            g4(done.iter().filter(|d| d.started >= at && d.started < healed)),
            g4(done.iter().filter(|d| d.started >= healed)),
        ],
        ..Row::default()
    };
    for d in &done {
        assert!(
            d.ended - d.started <= MATRIX_DEADLINE + Duration::from_secs(5),
            "{name}: a request hung"
        );
        if d.result.is_ok() && !quiet.contains_key(&d.prompt) {
            // What an aggregated worker answers, quietly, after the fault.
            let (_, r) = matrix_request(fes, 0, "mock", &d.prompt).await;
            quiet.insert(d.prompt.clone(), r.expect("a quiet request").text);
        }
        match &d.result {
            Ok(a) if a.text == quiet[&d.prompt] => row.answered += 1,
            Ok(a) => {
                row.wrong += 1;
                eprintln!(
                    "{name}: WRONG answer of {} to {:?} from {}",
                    d.model, d.prompt, a.worker
                );
            }
            Err(e) => {
                eprintln!(
                    "{name}: {} request failed after {:?}, started {:+.1} s from the fault: {e}",
                    d.model,
                    d.ended - d.started,
                    d.started.saturating_duration_since(at).as_secs_f64()
                        - at.saturating_duration_since(d.started).as_secs_f64()
                );
                *row.failed.entry(e.clone()).or_default() += 1
            }
        }
    }
    eprintln!("{}", row.markdown());
    row
}

/// The member id of etcd's leader, and which of `members` (client addresses) it is.
async fn etcd_leader(members: &[SocketAddr]) -> Option<usize> {
    for (k, m) in members.iter().enumerate() {
        let r = http(*m, "POST", "/v3/maintenance/status", Some("{}")).await.ok()?;
        let v: serde_json::Value = serde_json::from_slice(&r.body).ok()?;
        if v["leader"].is_string() && v["leader"] == v["header"]["member_id"] {
            return Some(k);
        }
    }
    None
}

/// Purges a JetStream stream over the NATS protocol (as a crash with a partition may lose
/// acknowledged messages): returns the server's answer.
async fn nats_purge(server: SocketAddr, stream: &str) -> String {
    let mut s = tokio::net::TcpStream::connect(server).await.unwrap();
    let cmd = format!(
        "CONNECT {{\"verbose\":false}}\r\nSUB _INBOX.purge 1\r\nPUB $JS.API.STREAM.PURGE.{stream} _INBOX.purge 2\r\n{{}}\r\nPING\r\n"
    );
    s.write_all(cmd.as_bytes()).await.unwrap();
    let mut buf = vec![0u8; 4096];
    let mut got = String::new();
    let deadline = Instant::now() + Duration::from_secs(3);
    while Instant::now() < deadline && !got.contains("purged") && !got.contains("\"error\"") {
        match tokio::time::timeout(Duration::from_millis(500), s.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => got.push_str(&String::from_utf8_lossy(&buf[..n])),
            _ => {}
        }
    }
    got
}

/// The whole deployment of `cluster.sh up` (16 hosts, the mock engine everywhere) through
/// every fault of the issue, each under load through both frontends. Prints the table that
/// `docs/deploy.md` shows. Outside CI (minutes): `scripts/cluster-check.sh`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the full fault matrix: scripts/cluster-check.sh"]
async fn fault_matrix_of_the_whole_deployment() {
    let mut c = Cluster::new(0);
    c.env.retain(|(k, _)| k != "KVF_NATS_HOSTS");
    // Small host tiers and no disk: the workers' evictions go to the fabric nodes, and hits
    // come back from them (the fabric rows have something to lose).
    c.env.push(("KVF_WORKER_ARGS".into(), "--host-blocks 32 --disk-blocks 0".into()));
    c.sh(&["up"]);
    let ip = |name: &str, port: u16| -> SocketAddr {
        let h = c.sh(&["host-of", name]);
        let n: usize = h.trim().trim_start_matches('h').parse().unwrap();
        c.addr(n, port)
    };
    let fes = vec![ip("frontend-1", 8000), ip("frontend-2", 8000)];
    let etcd: Vec<SocketAddr> = (1..=3).map(|i| ip(&format!("etcd-{i}"), 2379)).collect();
    let nats: Vec<SocketAddr> = (1..=3).map(|i| ip(&format!("nats-{i}"), 4222)).collect();
    for w in ["w1", "w2", "w3", "w4", "d1"] {
        wait_for("every worker routable", Duration::from_secs(60), async || {
            routable(&fes, w).await
        })
        .await;
    }
    let mut quiet = HashMap::new();
    for i in 0..MATRIX_PROMPTS {
        let (_, r) = matrix_request(&fes, i, "mock", &matrix_prompt(i)).await;
        quiet.insert(matrix_prompt(i), r.expect("a quiet request").text);
    }
    // Every answer again, for the cache to hold each prefix; and the prefill/decode pair
    // answers as an aggregated worker does.
    for i in 0..MATRIX_PROMPTS {
        let (_, r) = matrix_request(&fes, i + 1, "mock", &matrix_prompt(i)).await;
        assert_eq!(
            r.expect("a quiet request").text,
            quiet[&matrix_prompt(i)],
            "the mock engine answers the same everywhere"
        );
        let (_, r) = matrix_request(&fes, i + 1, "mock-pd", &matrix_prompt(i)).await;
        let a = r.expect("a quiet request of the pair");
        assert_eq!((a.text.as_str(), a.worker.as_str()), (quiet[&matrix_prompt(i)].as_str(), "d1"));
    }
    let mut rows = Vec::new();
    let secs = Duration::from_secs;

    let leader = etcd_leader(&etcd).await.expect("an etcd leader");
    let leader_name = format!("etcd-{}", leader + 1);
    rows.push(
        scenario(
            "etcd leader killed (-9), restarted 10 s later",
            &fes,
            &mut quiet,
            None,
            secs(6),
            async || c.kill_for(&leader_name, 10).await,
        )
        .await,
    );
    let member = format!("etcd-{}", (leader + 1) % 3 + 1);
    rows.push(
        scenario(
            &format!("etcd member ({member}) cut off 20 s, healed"),
            &fes,
            &mut quiet,
            None,
            secs(6),
            async || c.cut_for(&member, 20).await,
        )
        .await,
    );
    rows.push(
        scenario(
            "NATS server killed (-9), restarted 10 s later",
            &fes,
            &mut quiet,
            None,
            secs(6),
            async || c.kill_for("nats-1", 10).await,
        )
        .await,
    );
    rows.push(
        scenario("NATS server cut off 30 s, healed", &fes, &mut quiet, None, secs(8), async || {
            c.cut_for("nats-2", 30).await
        })
        .await,
    );
    rows.push(
        scenario(
            "worker host (w1) cut off 20 s, healed",
            &fes,
            &mut quiet,
            Some("w1"),
            secs(6),
            async || c.cut_for("w1", 20).await,
        )
        .await,
    );
    let purge = std::cell::RefCell::new(String::new());
    rows.push(
        scenario(
            "prefill worker frozen 6 s, its queued jobs purged (lost)",
            &fes,
            &mut quiet,
            None,
            secs(6),
            async || {
                signal_process(&c, "p1", "STOP");
                tokio::time::sleep(secs(3)).await;
                for n in &nats {
                    let r = nats_purge(*n, "KVFABRIC_default_prefill-p1").await;
                    if r.contains("purged") {
                        *purge.borrow_mut() = r;
                        break;
                    }
                }
                tokio::time::sleep(secs(3)).await;
                signal_process(&c, "p1", "CONT");
            },
        )
        .await,
    );
    eprintln!("purge: {}", purge.borrow().lines().find(|l| l.contains("purged")).unwrap_or("none"));
    rows.push(
        scenario(
            "frontend host (frontend-1) cut off 30 s, healed",
            &fes,
            &mut quiet,
            None,
            secs(6),
            async || c.cut_for("frontend-1", 30).await,
        )
        .await,
    );
    rows.push(
        scenario(
            "fabric node (fabric-1) cut off 20 s, healed",
            &fes,
            &mut quiet,
            None,
            secs(6),
            async || c.cut_for("fabric-1", 20).await,
        )
        .await,
    );
    rows.push(
        scenario(
            "rolling restart of every process, one at a time",
            &fes,
            &mut quiet,
            None,
            secs(6),
            async || {
                for name in [
                    "etcd-1",
                    "etcd-2",
                    "etcd-3",
                    "nats-1",
                    "nats-2",
                    "nats-3",
                    "fabric-1",
                    "fabric-2",
                    "w1",
                    "w2",
                    "w3",
                    "w4",
                    "p1",
                    "d1",
                    "frontend-1",
                    "frontend-2",
                ] {
                    c.sh(&["stop", name, "TERM", "40"]);
                    c.sh(&["restart", name]);
                    ready(&c, name, &fes).await;
                }
            },
        )
        .await,
    );

    let mut table = String::from(
        "| fault (under load, both frontends) | sent | answered | retried (frontends / client failovers) | failed | wrong | out of routing after | routed again after | KV reuse before → after | tokens from fabric nodes before / during / after |\n|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in &rows {
        table.push_str(&r.markdown());
        table.push('\n');
    }
    eprintln!("\n{table}");
    if let Some(out) = std::env::var_os("KVF_MATRIX_OUT") {
        std::fs::write(out, &table).unwrap();
    }
    for r in &rows {
        assert_eq!(r.wrong, 0, "{}: wrong answers", r.scenario);
    }
    let rolling = rows.last().unwrap();
    assert!(rolling.failed.is_empty(), "rolling restart: {:?}", rolling.failed);
}

/// Sends `sig` to the process `name` of the cluster (no wait).
fn signal_process(c: &Cluster, name: &str, sig: &str) {
    let pid = std::fs::read_to_string(c.dir.join("pids").join(name)).unwrap();
    let pid = pid.split_whitespace().next().unwrap();
    let ok = std::process::Command::new("kill").args(["-s", sig, pid]).status().unwrap().success();
    assert!(ok, "kill -s {sig} {name}");
}

/// Waits until the restarted `name` serves again.
async fn ready(c: &Cluster, name: &str, fes: &[SocketAddr]) {
    let h: usize = c.sh(&["host-of", name]).trim().trim_start_matches('h').parse().unwrap();
    let (addr, path) = match name {
        n if n.starts_with("etcd") => (c.addr(h, 2379), "/health"),
        n if n.starts_with("nats") => (c.addr(h, 8222), "/healthz?js-enabled-only=true"),
        n if n.starts_with("frontend") => (c.addr(h, 8000), "/health"),
        _ => (c.addr(h, 9100), "/health"),
    };
    wait_for(
        &format!("{name} answers again"),
        Duration::from_secs(90),
        async || matches!(get(addr, path).await, Ok(r) if r.status == 200),
    )
    .await;
    if name.starts_with('w') || name == "d1" {
        wait_for(&format!("{name} routable again"), Duration::from_secs(30), async || {
            routable(fes, name).await
        })
        .await;
    }
}
