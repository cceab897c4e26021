//! The third fault round's reproductions that need whole processes (bounded, loopback only):
//! authenticated idle sessions against a node's file descriptors, a second worker under a
//! name already in use, two processes on one data directory.

use crate::common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::Proc;
use kvfabric::control::etcd::EtcdDiscovery;
use kvfabric::control::Discovery;
use kvfabric::session::handshake;
use kvfabric::session::proto::ClientParams;
use kvfabric::testkit::{EtcdServer, NatsServer};
use kvfabric::wire::WireLimits;
use kvfabric_tiers::remote::protocol::{NodeInfo, FABRIC_KIND};

const SECRET: &str = "hostile-test-secret";

/// A `kvfabric fabric` node allowed `nofile` file descriptors, registered in `etcd`.
fn fabric_node(name: &str, etcd: &EtcdServer, nats: &NatsServer, nofile: u32) -> (Proc, NodeInfo) {
    let mut child = Command::new("prlimit")
        .arg(format!("--nofile={nofile}:{nofile}"))
        .arg("--")
        .arg(env!("CARGO_BIN_EXE_kvfabric"))
        .args(["fabric", "--name", name, "--block-tokens", "1", "--host-blocks", "64"])
        .args(["--lease-ttl-s", "2", "--namespace", "hostile"])
        .env("KVFABRIC_SECRET", SECRET)
        .env("KVFABRIC_ETCD", etcd.endpoint())
        .env("KVFABRIC_NATS", nats.url())
        .env_remove("KVFABRIC_MODEL")
        .env_remove("KVFABRIC_CONFIG")
        .stdout(Stdio::piped())
        .spawn()
        .expect("prlimit (util-linux) runs kvfabric");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let v: serde_json::Value = serde_json::from_str(&line)
        .unwrap_or_else(|e| panic!("node {name} did not start ({e}): {line:?}"));
    (Proc(child), serde_json::from_value(v["fabric"].clone()).unwrap())
}

/// Runs `cmd` for at most `limit`: whether it exited successfully (None: it was still running,
/// and was killed), and what it wrote on stderr.
fn run_bounded(mut cmd: Command, limit: Duration) -> (Option<bool>, String) {
    let mut child = cmd
        .env_remove("KVFABRIC_CONFIG")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut stderr, &mut s);
        s
    });
    let until = Instant::now() + limit;
    let exited = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status.success());
        }
        if Instant::now() >= until {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    (exited, reader.join().unwrap())
}

/// Opens a connection to the agent or worker `peer` at `addr` as `me`, authenticated with the
/// secret.
async fn session(
    addr: std::net::SocketAddr,
    peer: &str,
    me: &str,
) -> Option<tokio::net::TcpStream> {
    let mut c = tokio::net::TcpStream::connect(addr).await.ok()?;
    let params = ClientParams {
        me: me.into(),
        peer: peer.into(),
        secret: SECRET.as_bytes().into(),
        limits: WireLimits::default(),
    };
    handshake::client(&mut c, params, handshake::nonce(), Duration::from_secs(2)).await.ok()?;
    Some(c)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_authenticated_sessions_cannot_take_a_nodes_descriptors() {
    let etcd = EtcdServer::start().unwrap();
    let nats = NatsServer::start().unwrap();
    // 384 descriptors: 256 stay for the control plane and files, 128 for connections.
    let (_node, info) = fabric_node("fabric-fd", &etcd, &nats, 384);
    let discovery = EtcdDiscovery::connect(&[etcd.endpoint()], "hostile").await.unwrap();

    // 1,000 authenticated sessions under 1,000 names, held open and idle.
    let mut held = Vec::new();
    let mut unanswered = 0;
    for i in 0..1000 {
        let t = Instant::now();
        match session(info.agent.tcp_addr, "fabric-fd", &format!("idle-{i}")).await {
            Some(c) => held.push(c),
            // Refused at once is the port keeping its bound; no answer at all is a port
            // whose process ran out of descriptors: stop there.
            None if t.elapsed() > Duration::from_secs(1) => {
                unanswered += 1;
                if unanswered == 3 {
                    break;
                }
            }
            None => {}
        }
    }
    assert!(unanswered < 3, "the node stopped answering after {} sessions", held.len());
    assert!(held.len() <= 128, "{} sessions admitted past the descriptor budget", held.len());
    assert!(held.len() >= 64, "only {} admitted", held.len());
    // The node keeps its lease across several TTLs (2 s): its keep-alive still gets a
    // descriptor to reach etcd.
    let until = Instant::now() + Duration::from_secs(6);
    while Instant::now() < until {
        let ids: Vec<String> =
            discovery.list(FABRIC_KIND).await.unwrap().into_iter().map(|i| i.id).collect();
        assert_eq!(ids, ["fabric-fd"], "the node fell out of discovery under the flood");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // The flood ends: the node serves a real client again.
    drop(held);
    let agent =
        kvfabric::Agent::start(kvfabric::AgentConfig::new("client", SECRET.as_bytes().to_vec()))
            .await
            .unwrap();
    let remote = kvfabric_tiers::remote::RemoteTier::new(agent, Duration::from_secs(5));
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match remote.add_node(&info).await {
            Ok(()) => break,
            Err(e) if Instant::now() < deadline => {
                tracing::debug!(error = %e, "the node is still closing the flood's sessions");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("the node does not serve after the flood: {e}"),
        }
    }
    let hash = kvfabric::hash::SequenceHash(7);
    assert_eq!(remote.lookup(&[hash]).await.unwrap(), [false]);
}

fn worker_args(etcd: &str, nats: &str) -> Vec<String> {
    let mut args = common::mock_worker_args("hostile", etcd, nats, SECRET);
    args.extend(["--lease-ttl-s", "2"].map(String::from));
    args
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_worker_under_a_name_in_use_refuses_to_start_and_takes_nothing() {
    let etcd = EtcdServer::start().unwrap();
    let nats = NatsServer::start().unwrap();
    let (e, n) = (etcd.endpoint(), nats.url());
    let (first, line) = common::spawn_worker("w2", &worker_args(&e, &n));
    let discovery = EtcdDiscovery::connect(std::slice::from_ref(&e), "hostile").await.unwrap();
    let addr_of_w2 = || async {
        let list = discovery.list(kvfabric_serving::worker::WORKER_KIND).await.unwrap();
        list.into_iter().find(|i| i.id == "w2").map(|i| i.metadata["addr"].clone())
    };
    assert_eq!(addr_of_w2().await, Some(line["addr"].clone()));

    // The second w2: refused, loudly, within the lease TTL and a second (plus its start).
    let started = Instant::now();
    let (exited, stderr) = tokio::task::spawn_blocking({
        let args: Vec<String> = worker_args(&e, &n);
        move || {
            let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvfabric"));
            cmd.args(["worker", "--name", "w2"]).args(&args);
            run_bounded(cmd, Duration::from_secs(20))
        }
    })
    .await
    .unwrap();
    assert!(exited.is_some_and(|ok| !ok), "the second w2 started: {stderr}");
    assert!(stderr.contains("registered by another live instance"), "{stderr}");
    assert!(started.elapsed() < Duration::from_secs(15), "{:?}", started.elapsed());
    // The first keeps its registration, well past a TTL after the second gave up.
    for _ in 0..6 {
        assert_eq!(addr_of_w2().await, Some(line["addr"].clone()), "w2's entry was taken or lost");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // The first dies (kill -9): a new w2 takes over once its lease has expired.
    drop(first);
    let (_second, line2) = common::spawn_worker("w2", &worker_args(&e, &n));
    assert_eq!(addr_of_w2().await, Some(line2["addr"].clone()));
}

#[test]
fn two_processes_on_one_data_directory_do_not_share_a_disk_tier() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().to_str().unwrap().to_string();
    let args = |extra: &[&str]| -> Vec<String> {
        ["--engine", "mock", "--secret", SECRET, "--disk-blocks", "64", "--data-dir", &data]
            .iter()
            .chain(extra)
            .map(|s| s.to_string())
            .collect()
    };
    let args1 = args(&[]);
    let a: Vec<&str> = args1.iter().map(String::as_str).collect();
    // Each process has its own (embedded) control plane: only the directory is shared.
    let (first, _) = common::spawn_worker("w-disk", &a);
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvfabric"));
    cmd.args(["worker", "--name", "w-disk"]).args(&a);
    let (exited, stderr) = run_bounded(cmd, Duration::from_secs(20));
    assert!(exited.is_some_and(|ok| !ok), "a second process opened the same disk tier: {stderr}");
    let owner = format!("pid {}", first.0.id());
    assert!(stderr.contains("in use by another process") && stderr.contains(&owner), "{stderr}");
    // Another name in the same directory has its own slot file.
    let (_other, _) = common::spawn_worker("w-disk-2", &a);
    // The first dies (kill -9): its lock goes with it, and the next process takes over.
    drop(first);
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvfabric"));
    cmd.args(["worker", "--name", "w-disk"]).args(&a).env_remove("KVFABRIC_CONFIG");
    cmd.env("RUST_LOG", "warn").stderr(Stdio::piped());
    let mut child = cmd.stdout(Stdio::piped()).spawn().unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    assert!(line.contains("\"worker\":\"w-disk\""), "the next process did not start: {line:?}");
    let mut stderr = child.stderr.take().unwrap();
    drop(Proc(child));
    let mut log = String::new();
    std::io::Read::read_to_string(&mut stderr, &mut log).unwrap();
    assert!(log.contains("took over the disk tier of a process that is gone"), "{log}");
}

/// The resident memory of process `pid`, bytes.
fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forty_authenticated_sixteen_mib_frames_do_not_take_the_workers_memory() {
    use tokio::io::AsyncWriteExt;
    let (worker, line) = common::spawn_worker(
        "w-frames",
        &["--engine", "mock", "--secret", SECRET, "--disk-blocks", "0", "--host-blocks", "16"],
    );
    let addr: std::net::SocketAddr = line["addr"].as_str().unwrap().parse().unwrap();
    let pid = worker.0.id();
    let before = rss(pid);
    // 40 peers with the secret each send a 16 MiB frame (not JSON), all at once.
    let frame = 16usize << 20;
    let senders: Vec<_> = (0..40)
        .map(|i| {
            tokio::spawn(async move {
                let mut c = session(addr, "w-frames", &format!("big-{i}")).await?;
                let mut bytes = kvfabric::contract::worker::encode_header(frame).ok()?.to_vec();
                bytes.resize(bytes.len() + frame, b'x');
                c.write_all(&bytes).await.ok()?;
                let mut sink = Vec::new();
                tokio::io::AsyncReadExt::read_to_end(&mut c, &mut sink).await.ok()?;
                Some(())
            })
        })
        .collect();
    let mut peak = before;
    while senders.iter().any(|s| !s.is_finished()) {
        peak = peak.max(rss(pid));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let grew = peak.saturating_sub(before);
    eprintln!("worker RSS {} MiB before, {} MiB at the peak", before >> 20, peak >> 20);
    // 64 MiB of bodies in flight at most (and their parsing), not 40 × 16 MiB.
    assert!(grew < 200 << 20, "RSS grew by {} MiB", grew >> 20);
    // Each was read in its turn and answered (an error frame: it is not JSON), none dropped.
    for s in senders {
        assert!(s.await.unwrap().is_some(), "a frame was not read and answered");
    }
}
