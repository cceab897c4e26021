//! KV fabric nodes as separate `kvfabric fabric` processes over real etcd and NATS, and the
//! same scenario in one process on the embedded control plane: blocks put through one client
//! are found and fetched by another; KV events reach the bus; a node killed -9 leaves
//! discovery within its lease TTL and its blocks become misses without hanging anyone; a
//! wrong secret is rejected.

use crate::common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvfabric::agent::{Agent, AgentConfig};
use kvfabric::contract::{self, Message};
use kvfabric::control::etcd::EtcdDiscovery;
use kvfabric::control::memory::{MemoryBus, MemoryDiscovery};
use kvfabric::control::nats::NatsBus;
use kvfabric::control::{Discovery, DiscoveryEvent, EventBus, Instance};
use kvfabric::events::NullSink;
use kvfabric::hash::SequenceHash;
use kvfabric::memory::{Region, RegionOptions};
use kvfabric::testkit::{EtcdServer, NatsServer};
use kvfabric_tiers::fabric::FabricNode;
use kvfabric_tiers::remote::protocol::{NodeInfo, FABRIC_KIND};
use kvfabric_tiers::remote::RemoteTier;
use kvfabric_tiers::synthetic;
use kvfabric_tiers::{StoreConfig, TieredStore};

const SECRET: &str = "fabric-secret";
/// SmolLM2-135M, one token per block.
const BLOCK: u64 = 23_040;
const N: usize = 64;

fn hashes() -> Vec<SequenceHash> {
    (0..N as u64).map(|i| SequenceHash(0xfab0_0000 + i * 7919)).collect()
}

struct Node(Child);

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_node(name: &str, etcd: &str, nats: &str) -> Node {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvfabric"))
        .args([
            "fabric",
            "--name",
            name,
            "--block-tokens",
            "1",
            "--host-blocks",
            "256",
            "--lease-ttl-s",
            "2",
        ])
        .env("KVFABRIC_SECRET", SECRET)
        .env("KVFABRIC_ETCD", etcd)
        .env("KVFABRIC_NATS", nats)
        .env_remove("KVFABRIC_MODEL")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    assert!(line.contains("\"fabric\""), "node {name} did not start: {line:?}");
    Node(child)
}

async fn client(
    name: &str,
    secret: &str,
    discovery: &dyn Discovery,
) -> (Agent, RemoteTier, Arc<Region>) {
    let agent = Agent::start(AgentConfig::new(name, secret.as_bytes().to_vec())).await.unwrap();
    let region = agent
        .alloc_region(N * BLOCK as usize, RegionOptions { export: true, ..Default::default() })
        .unwrap();
    let remote = RemoteTier::new(agent.clone(), Duration::from_secs(5));
    for inst in discovery.list(FABRIC_KIND).await.unwrap() {
        let info: NodeInfo = serde_json::from_value(inst.metadata).unwrap();
        remote.add_node(&info).await.unwrap();
    }
    (agent, remote, region)
}

fn locs(region: &Region) -> Vec<(kvfabric::RegionId, u64)> {
    (0..N as u64).map(|i| (region.id(), i * BLOCK)).collect()
}

/// Put through one client, find and fetch through another, bytes equal.
async fn put_then_get(discovery: &dyn Discovery) -> (RemoteTier, Arc<Region>) {
    let hs = hashes();
    let (_a, put_client, src) = client("client-a", SECRET, discovery).await;
    assert_eq!(put_client.nodes().len(), 2);
    for (i, h) in hs.iter().enumerate() {
        src.write_at(i as u64 * BLOCK, &synthetic::block(*h, BLOCK as usize)).unwrap();
    }
    let parents: Vec<Option<SequenceHash>> =
        (0..N).map(|i| i.checked_sub(1).map(|p| hs[p])).collect();
    let stored = put_client.put(&hs, &parents, &locs(&src)).await.unwrap();
    assert!(stored.iter().all(|&s| s), "every block stored");
    let (_b, get_client, dst) = client("client-b", SECRET, discovery).await;
    assert!(get_client.lookup(&hs).await.unwrap().iter().all(|&p| p));
    let served = get_client.get(&hs, &locs(&dst)).await.unwrap();
    assert!(served.iter().all(|&s| s));
    for (i, h) in hs.iter().enumerate() {
        let mut got = vec![0u8; BLOCK as usize];
        dst.read_at(i as u64 * BLOCK, &mut got).unwrap();
        assert!(got == synthetic::block(*h, BLOCK as usize), "block {i} bytes");
    }
    // Both nodes took a share (consistent hashing spreads blocks).
    let on_a =
        hs.iter().filter(|h| get_client.node_for(**h).as_deref() == Some("fabric-a")).count();
    assert!(on_a > 0 && on_a < N, "{on_a} of {N} on fabric-a");
    (get_client, dst)
}

/// The frontend's `/dashboard/state` once `cond` holds of it (10 s at most).
async fn dashboard_until(
    fe: std::net::SocketAddr,
    what: &str,
    cond: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let s = common::get(fe, "/dashboard/state").await.json();
        if cond(&s) {
            return s;
        }
        assert!(Instant::now() < deadline, "the dashboard never showed {what}: {s}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fabric_nodes_across_processes_with_etcd_and_nats() {
    let etcd = EtcdServer::start().unwrap();
    let nats = NatsServer::start().unwrap();
    let discovery = EtcdDiscovery::connect(&[etcd.endpoint()], "default").await.unwrap();
    let bus = NatsBus::connect(&nats.url(), "default").await.unwrap();
    let mut events = bus.subscribe("kv-events").await.unwrap();
    let (_, mut watch) = discovery.watch(FABRIC_KIND).await.unwrap();
    let _a = start_node("fabric-a", &etcd.endpoint(), &nats.url());
    let mut b = start_node("fabric-b", &etcd.endpoint(), &nats.url());
    // A frontend of the namespace: its dashboard shows the nodes.
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvfabric"));
    cmd.args(["frontend", "--port", "0", "--secret", SECRET, "--name", "fabric-fe"]).args([
        "--etcd",
        &etcd.endpoint(),
        "--nats",
        &nats.url(),
    ]);
    let (_fe, fe, _) = common::spawn_server(cmd);
    let nodes_shown = |s: &serde_json::Value| -> Vec<String> {
        s["fabric"].as_array().unwrap().iter().map(|n| n["name"].as_str().unwrap().into()).collect()
    };
    dashboard_until(fe, "both nodes shown", |s| nodes_shown(s) == ["fabric-a", "fabric-b"]).await;
    let (get_client, dst) = put_then_get(&discovery).await;

    // The frontend's dashboard: each node's own tiers (its reports) and the blocks its KV
    // events put in the index, none of them taken for a worker's.
    let sum = |s: &serde_json::Value, f: &dyn Fn(&serde_json::Value) -> u64| -> u64 {
        s["fabric"].as_array().unwrap().iter().map(f).sum()
    };
    let s = dashboard_until(fe, "every block on the nodes", |s| {
        sum(s, &|n| n["indexed_blocks"].as_u64().unwrap()) == N as u64
            && sum(s, &|n| n["stats"]["tiers"][1]["used"].as_u64().unwrap_or(0)) == N as u64
    })
    .await;
    for n in s["fabric"].as_array().unwrap() {
        assert_eq!(n["role"], "fabric", "{n}");
        assert_eq!(n["stats"]["tiers"][1]["capacity"], 256, "{n}");
        assert_eq!(n["stats"]["tiers"][2]["capacity"], 0, "no disk tier: {n}");
        let held = n["indexed_blocks"].as_u64().unwrap();
        assert_eq!(n["stats"]["tiers"][1]["used"].as_u64().unwrap(), held, "{n}");
        assert!(held > 0 && held < N as u64, "both took a share: {n}");
        assert!(n["stats"]["transfers"][0]["bytes"].as_u64().unwrap() > 0, "{n}");
    }
    assert_eq!(s["workers"].as_array().unwrap().len(), 0, "{s}");
    assert_eq!(s["control"]["kv_events_unknown_worker"], 0, "{s}");

    // KV events of both nodes reached the bus.
    let mut stored = 0;
    let deadline = Instant::now() + Duration::from_secs(10);
    while stored < N && Instant::now() < deadline {
        if let Ok(Some(m)) = tokio::time::timeout(Duration::from_secs(1), events.recv()).await {
            let v: serde_json::Value = serde_json::from_slice(&m).unwrap();
            if v["event"]["type"] == "stored" && v["event"]["tier"] == "host" {
                stored += 1;
            }
        }
    }
    assert_eq!(stored, N, "one Stored event per block");

    // A wrong secret is rejected by the nodes.
    let bad = Agent::start(AgentConfig::new("intruder", b"nope".to_vec())).await.unwrap();
    let remote = RemoteTier::new(bad, Duration::from_secs(5));
    let info: NodeInfo =
        serde_json::from_value(discovery.list(FABRIC_KIND).await.unwrap()[0].metadata.clone())
            .unwrap();
    let err = remote.add_node(&info).await.unwrap_err().to_string();
    // The node's shared memory is not even mapped (its seal is another deployment's).
    assert!(err.contains("another deployment"), "{err}");
    let mut far = info.clone();
    far.agent.host_id = "another host".into();
    let err = remote.add_node(&far).await.unwrap_err().to_string();
    assert!(err.contains("authentication"), "{err}");

    // fabric-b dies mid-flight: gets fail fast for its blocks (misses), never hang.
    while let Ok(Some(_)) = tokio::time::timeout(Duration::from_millis(100), watch.recv()).await {}
    let _ = b.0.kill();
    let _ = b.0.wait();
    let start = Instant::now();
    let served = get_client.get(&hashes(), &locs(&dst)).await.unwrap();
    assert!(start.elapsed() < Duration::from_secs(6), "no hang: {:?}", start.elapsed());
    let on_b: Vec<bool> =
        hashes().iter().map(|h| get_client.node_for(*h).as_deref() == Some("fabric-b")).collect();
    for (s, b) in served.iter().zip(&on_b) {
        assert_eq!(*s, !b, "blocks of the dead node are misses, the others served");
    }
    // ... and it leaves discovery within its lease TTL (2 s, plus etcd's slack).
    let left = Instant::now();
    loop {
        let ev = tokio::time::timeout(Duration::from_secs(8), watch.recv())
            .await
            .expect("fabric-b leaves")
            .unwrap();
        if ev == (DiscoveryEvent::Left { kind: FABRIC_KIND.into(), id: "fabric-b".into() }) {
            break;
        }
    }
    assert!(left.elapsed() < Duration::from_secs(8));
    get_client.remove_node("fabric-b");
    assert_eq!(get_client.nodes(), vec!["fabric-a".to_string()]);
    dashboard_until(fe, "fabric-b gone", |s| nodes_shown(s) == ["fabric-a"]).await;
    assert!(get_client.get(&hashes(), &locs(&dst)).await.unwrap().iter().any(|&s| s));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fabric_nodes_on_the_embedded_control_plane() {
    let discovery = MemoryDiscovery::new();
    let bus = MemoryBus::new();
    let mut regs = Vec::new();
    let mut agents = Vec::new();
    for name in ["fabric-a", "fabric-b"] {
        let agent = Agent::start(AgentConfig::new(name, SECRET.as_bytes().to_vec())).await.unwrap();
        let store = TieredStore::open(StoreConfig::new(BLOCK, 256), &agent, Arc::new(NullSink))
            .await
            .unwrap();
        let node = FabricNode::serve(agent.clone(), store, Duration::from_secs(10));
        let inst = Instance {
            kind: FABRIC_KIND.into(),
            id: name.into(),
            metadata: serde_json::to_value(node.info()).unwrap(),
        };
        regs.push(discovery.register(inst, Duration::from_millis(500)).await.unwrap());
        agents.push(agent);
    }
    let (get_client, dst) = put_then_get(&discovery).await;
    // fabric-b's agent goes away: its blocks are misses at once, no hang.
    agents[1].shutdown();
    drop(regs.pop());
    let start = Instant::now();
    let served = get_client.get(&hashes(), &locs(&dst)).await.unwrap();
    assert!(start.elapsed() < Duration::from_secs(6));
    assert!(served.iter().any(|&s| s));
    let _ = bus.publish("kv-events", vec![]).await;
}

/// G4 in the tiered store: a host tier of 4 blocks with no disk spills to a fabric node and
/// fetches back, straight into its host slots.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_spills_to_the_fabric_and_reads_back() {
    use kvfabric::events::TierKind;
    let node_agent =
        Agent::start(AgentConfig::new("fabric-a", SECRET.as_bytes().to_vec())).await.unwrap();
    let node_store =
        TieredStore::open(StoreConfig::new(BLOCK, 64), &node_agent, Arc::new(NullSink))
            .await
            .unwrap();
    let node = FabricNode::serve(node_agent.clone(), node_store, Duration::from_secs(10));
    let agent = Agent::start(AgentConfig::new("worker", SECRET.as_bytes().to_vec())).await.unwrap();
    let remote = RemoteTier::new(agent.clone(), Duration::from_secs(5));
    remote.add_node(&node.info()).await.unwrap();
    let mut cfg = StoreConfig::new(BLOCK, 4);
    cfg.remote = Some(remote);
    cfg.disk_admit_min_hits = 0;
    let store = TieredStore::open(cfg, &agent, Arc::new(NullSink)).await.unwrap();
    let hs: Vec<SequenceHash> = hashes().into_iter().take(16).collect();
    for (i, h) in hs.iter().enumerate() {
        let parent = i.checked_sub(1).map(|p| hs[p]);
        store.put(*h, parent, &synthetic::block(*h, BLOCK as usize)).await.unwrap();
    }
    assert_eq!(node.store().metrics().stored_blocks, 12, "12 evictions went to the fabric");
    let tiers = store.lookup_prefix_with_remote(&hs).await;
    assert_eq!(tiers.len(), 16);
    assert!(
        tiers[..12].iter().all(|&t| t == TierKind::Remote)
            && tiers[12..].iter().all(|&t| t == TierKind::Host)
    );
    for h in &hs {
        let got = store.get(&[*h]).await.unwrap();
        assert_eq!(got.len(), 1, "block {h} served");
        assert!(got[0].to_vec() == synthetic::block(*h, BLOCK as usize));
    }

    // A store that only reads the fabric (evict_to_remote false) drops what it evicts.
    let on_node = node.store().metrics().stored_blocks;
    let reader_agent =
        Agent::start(AgentConfig::new("reader", SECRET.as_bytes().to_vec())).await.unwrap();
    let remote = RemoteTier::new(reader_agent.clone(), Duration::from_secs(5));
    remote.add_node(&node.info()).await.unwrap();
    let mut cfg = StoreConfig::new(BLOCK, 4);
    cfg.remote = Some(remote);
    cfg.evict_to_remote = false;
    cfg.host_free_target = 2;
    let reader = TieredStore::open(cfg, &reader_agent, Arc::new(NullSink)).await.unwrap();
    let others: Vec<SequenceHash> = hashes().into_iter().skip(16).take(8).collect();
    for (i, h) in others.iter().enumerate() {
        let parent = i.checked_sub(1).map(|p| others[p]);
        reader.put(*h, parent, &synthetic::block(*h, BLOCK as usize)).await.unwrap();
    }
    let m = reader.metrics();
    assert_eq!((m.host_used_blocks, m.host_evicted_blocks), (4, 4), "evicted on demand: {m:?}");
    assert_eq!(node.store().metrics().stored_blocks, on_node, "the fabric took none of them");
    assert!(reader.lookup_prefix_with_remote(&others).await.is_empty(), "the first is gone");
    // It still reads the fabric.
    assert_eq!(reader.get(&hs[..3]).await.unwrap().len(), 3);
}

/// A NATS restart: the node, not restarted, re-publishes a full dump of its blocks once its
/// connection is back, so that consumers that missed events resynchronize.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_resynchronize_consumers_after_a_nats_restart() {
    let etcd = EtcdServer::start().unwrap();
    let mut nats = NatsServer::start().unwrap();
    let _a = start_node("fabric-a", &etcd.endpoint(), &nats.url());
    let _b = start_node("fabric-b", &etcd.endpoint(), &nats.url());
    let discovery = EtcdDiscovery::connect(&[etcd.endpoint()], "default").await.unwrap();
    put_then_get(&discovery).await;
    nats.restart().unwrap();
    // A consumer that lost its connection asks for dumps (the nodes also publish one on
    // their own reconnection, which a consumer may or may not be back in time to see).
    let bus = NatsBus::connect(&nats.url(), "default").await.unwrap();
    let mut events = bus.subscribe(contract::KV_EVENTS).await.unwrap();
    let mut dumped = std::collections::HashMap::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while dumped.len() < 2 && Instant::now() < deadline {
        for node in ["fabric-a", "fabric-b"] {
            let req = Message::DumpRequest { from: "test".into(), worker: node.into() };
            let _ = bus.publish(req.topic(), req.encode()).await;
        }
        if let Ok(Some(m)) = tokio::time::timeout(Duration::from_millis(500), events.recv()).await {
            if let Message::KvDump { source, blocks, .. } = Message::decode(&m).unwrap() {
                dumped.insert(source, blocks.len());
            }
        }
    }
    assert_eq!(dumped.len(), 2, "both nodes re-published: {dumped:?}");
    assert_eq!(dumped.values().sum::<usize>(), N, "together they hold every block");
}

/// SIGTERM: the node drains, revokes its lease (it leaves discovery at once, well before its
/// TTL), unlinks its shared-memory files and exits cleanly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_leaves_discovery_at_once() {
    let etcd = EtcdServer::start().unwrap();
    let nats = NatsServer::start().unwrap();
    let discovery = EtcdDiscovery::connect(&[etcd.endpoint()], "default").await.unwrap();
    let mut node = Command::new(env!("CARGO_BIN_EXE_kvfabric"))
        .args(["fabric", "--name", "fabric-q", "--block-tokens", "1", "--lease-ttl-s", "30"])
        .env("KVFABRIC_SECRET", SECRET)
        .env("KVFABRIC_ETCD", etcd.endpoint())
        .env("KVFABRIC_NATS", nats.url())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(node.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let (now, mut watch) = discovery.watch(FABRIC_KIND).await.unwrap();
    assert_eq!(now.len(), 1);
    assert!(!common::shared_regions(node.id()).is_empty(), "the node's pool is shared memory");
    let start = Instant::now();
    let status = Command::new("kill").args(["-TERM", &node.id().to_string()]).status().unwrap();
    assert!(status.success());
    let ev = tokio::time::timeout(Duration::from_secs(10), watch.recv()).await.unwrap().unwrap();
    assert_eq!(ev, DiscoveryEvent::Left { kind: FABRIC_KIND.into(), id: "fabric-q".into() });
    assert!(start.elapsed() < Duration::from_secs(10), "long before the 30 s TTL");
    let exit = node.wait().unwrap();
    assert!(exit.success(), "clean exit: {exit}");
    let left: Vec<_> = common::dev_shm_files()
        .into_iter()
        .filter(|f| f.contains(&format!(".{}.", node.id())))
        .collect();
    assert_eq!(left, Vec::<String>::new(), "files left");
}
