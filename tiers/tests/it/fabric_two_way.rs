//! Two fabric nodes that are each other's remote tier, loading from each other at the same
//! time: each node's GET handler writes into the other while its own GET call to the other
//! waits for an answer. This is what two vLLM instances with kvfabric connectors do when each
//! loads a prompt the other computed. An RPC that waited for its answer on the connection a
//! transfer needed once deadlocked the pair until the transfer deadline.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvfabric::agent::{Agent, AgentConfig};
use kvfabric::events::NullSink;
use kvfabric::hash::SequenceHash;
use kvfabric::memory::{Region, RegionOptions};
use kvfabric::transfer::TransportKind;
use kvfabric_tiers::fabric::FabricNode;
use kvfabric_tiers::remote::protocol::NodeInfo;
use kvfabric_tiers::remote::RemoteTier;
use kvfabric_tiers::{StoreConfig, TieredStore};

const BLOCK: u64 = 64 << 10;
/// More blocks than the session has stripes: a transfer uses every stripe.
const BLOCKS: u64 = 32;
const DEADLINE: Duration = Duration::from_secs(5);

/// Block `i` of node `node`'s bytes.
fn content(node: u64, i: u64) -> Vec<u8> {
    kvfabric_tiers::synthetic::block(hash(node, i), BLOCK as usize)
}

fn hash(node: u64, i: u64) -> SequenceHash {
    SequenceHash(node << 32 | i)
}

struct Node {
    agent: Agent,
    _node: Arc<FabricNode>,
    remote: RemoteTier,
    landing: Arc<Region>,
}

async fn node(id: u64, shm: bool) -> Node {
    let mut cfg = AgentConfig::new(format!("node{id}"), b"one deployment".to_vec());
    cfg.shm = shm;
    cfg.limits.transfer_deadline = DEADLINE;
    let agent = Agent::start(cfg).await.unwrap();
    let mut scfg = StoreConfig::new(BLOCK, BLOCKS as u32);
    scfg.shared_host = shm;
    let store = TieredStore::open(scfg, &agent, Arc::new(NullSink)).await.unwrap();
    for i in 0..BLOCKS {
        let parent = i.checked_sub(1).map(|p| hash(id, p));
        store.put(hash(id, i), parent, &content(id, i)).await.unwrap();
    }
    let node = FabricNode::serve(agent.clone(), store, DEADLINE);
    let landing = agent
        .alloc_region(
            (BLOCK * BLOCKS) as usize,
            RegionOptions { shared: shm, export: true, ..Default::default() },
        )
        .unwrap();
    let remote = RemoteTier::new(agent.clone(), DEADLINE);
    Node { agent, _node: node, remote, landing }
}

/// Node `me` loads every block of node `of` into its landing region.
async fn load(me: &Node, of: u64) -> Result<Vec<bool>, String> {
    let hashes: Vec<SequenceHash> = (0..BLOCKS).map(|i| hash(of, i)).collect();
    let dst: Vec<_> = (0..BLOCKS).map(|i| (me.landing.id(), i * BLOCK)).collect();
    me.remote.get(&hashes, &dst).await.map_err(|e| e.to_string())
}

async fn both_load_from_each_other(shm: bool) {
    let (a, b) = (node(1, shm).await, node(2, shm).await);
    // Each is the other's remote tier.
    for (me, other) in [(&a, &b), (&b, &a)] {
        let info = NodeInfo { agent: other.agent.metadata(), block_bytes: BLOCK };
        me.remote.add_node(&info).await.unwrap();
    }
    for round in 0..8 {
        // Both calls are in flight before either node's handler starts its transfer.
        let started = Instant::now();
        let (got_a, got_b) = tokio::join!(load(&a, 2), load(&b, 1));
        let took = started.elapsed();
        assert_eq!(
            (got_a, got_b),
            (Ok(vec![true; BLOCKS as usize]), Ok(vec![true; BLOCKS as usize])),
            "shm {shm}, round {round}: both loads served in full after {took:?} \
             (a transfer that waits for the other node's call lasts until the {DEADLINE:?} deadline)"
        );
        for (me, of) in [(&a, 2), (&b, 1)] {
            for i in 0..BLOCKS {
                let mut got = vec![0u8; BLOCK as usize];
                me.landing.read_at(i * BLOCK, &mut got).unwrap();
                assert!(got == content(of, i), "shm {shm}: block {i} of node {of} byte for byte");
            }
            me.landing.fill(0, BLOCK * BLOCKS, 0).unwrap();
        }
    }
    // Each node's GET handler moved the other's 8 loads over the transport under test.
    let want = if shm { TransportKind::Shm } else { TransportKind::Tcp };
    for n in [&a, &b] {
        let used: Vec<_> = n.agent.transfer_counts().into_iter().filter(|c| c.done > 0).collect();
        assert!(
            used.len() == 1 && used[0].transport == want && used[0].done == 8,
            "shm {shm}: transfers by transport {used:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_load_from_each_other_at_once_over_tcp() {
    both_load_from_each_other(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_load_from_each_other_at_once_over_shared_memory() {
    both_load_from_each_other(true).await;
}
