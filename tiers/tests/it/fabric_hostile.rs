//! A fabric node against a peer of its own deployment that lies in its metadata: it names the
//! shared memory of a process of another deployment on the same host (another `kvfabric up`
//! with its own secret) and asks the node to write blocks there.

use std::sync::Arc;
use std::time::Duration;

use kvfabric::agent::{Agent, AgentConfig};
use kvfabric::events::NullSink;
use kvfabric::hash::SequenceHash;
use kvfabric::memory::RegionOptions;
use kvfabric_tiers::fabric::FabricNode;
use kvfabric_tiers::remote::protocol::{method, BlockLoc, Blocks, Hello};
use kvfabric_tiers::{StoreConfig, TieredStore};

const BLOCK: u64 = 8192;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_never_writes_into_the_shared_memory_of_another_deployment() {
    // Deployment B: a process with its own secret and a shared, exported region (its host
    // tier), full of its own bytes.
    let victim = Agent::start(AgentConfig::new("victim", b"secret of b".to_vec())).await.unwrap();
    let region = victim
        .alloc_region(
            4 * BLOCK as usize,
            RegionOptions { shared: true, export: true, ..Default::default() },
        )
        .unwrap();
    region.fill(0, region.len() as u64, 0xAB).unwrap();

    // Deployment A: a fabric node holding one block, and a peer with A's secret.
    let node_agent = Agent::start(AgentConfig::new("node", b"secret of a".to_vec())).await.unwrap();
    let mut cfg = StoreConfig::new(BLOCK, 4);
    cfg.shared_host = false;
    let store = TieredStore::open(cfg, &node_agent, Arc::new(NullSink)).await.unwrap();
    let hash = SequenceHash(42);
    store.put(hash, None, &vec![0x11; BLOCK as usize]).await.unwrap();
    let _node = FabricNode::serve(node_agent.clone(), store, Duration::from_secs(5));
    let attacker = Agent::start(AgentConfig::new("w1", b"secret of a".to_vec())).await.unwrap();
    attacker.load_peer(node_agent.metadata()).unwrap();

    // Its HELLO: its own name and address, B's region (id, length, file).
    let mut forged = attacker.metadata();
    forged.regions = victim.metadata().regions;
    forged.host_id = node_agent.metadata().host_id;
    let hello = json(&Hello { metadata: forged });
    let r = attacker.call("node", method::HELLO, hello, Duration::from_secs(5)).await;
    let err = r.expect_err("the node must refuse metadata naming another deployment's memory");
    assert!(err.to_string().contains("another deployment"), "{err}");
    assert_eq!(node_agent.foreign_memory_refusals(), 1, "counted");

    // And a GET aimed at B's region writes nothing there.
    let get = Blocks {
        blocks: vec![BlockLoc { hash, parent: None, region: region.id(), offset: BLOCK }],
    };
    let r = attacker.call("node", method::GET, json(&get), Duration::from_secs(5)).await;
    assert!(r.is_err(), "no GET into memory the node does not know: {r:?}");
    let mut bytes = vec![0u8; region.len()];
    region.read_at(0, &mut bytes).unwrap();
    assert!(bytes.iter().all(|b| *b == 0xAB), "B's memory is untouched");

    // The same peer announcing its own, honestly sealed region is served as before.
    let own = attacker
        .alloc_region(
            BLOCK as usize,
            RegionOptions { shared: true, export: true, ..Default::default() },
        )
        .unwrap();
    let hello = json(&Hello { metadata: attacker.metadata() });
    attacker.call("node", method::HELLO, hello, Duration::from_secs(5)).await.unwrap();
    let get = Blocks { blocks: vec![BlockLoc { hash, parent: None, region: own.id(), offset: 0 }] };
    attacker.call("node", method::GET, json(&get), Duration::from_secs(5)).await.unwrap();
    let mut got = vec![0u8; BLOCK as usize];
    own.read_at(0, &mut got).unwrap();
    assert!(got.iter().all(|b| *b == 0x11), "the block landed in the peer's own region");
    assert_eq!(
        node_agent.connection_stats().count(kvfabric::session::admission::Cause::Handshake),
        0
    );
}

/// A request body as the node reads it (JSON).
fn json<T: serde::Serialize>(v: &T) -> Vec<u8> {
    serde_json::to_vec(v).unwrap()
}
