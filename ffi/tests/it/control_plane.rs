//! The C ABI with real etcd and NATS servers: a serving store registers in discovery and a
//! `remote` store finds it there (and forgets it when it leaves), blocks move between them,
//! and KV events (the store's and the engine's) reach NATS in one id sequence.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvfabric::control::nats::NatsBus;
use kvfabric::control::EventBus;
use kvfabric::testkit::{EtcdServer, NatsServer};
use kvfabric_ffi::{kvf_agent, kvf_config, kvf_segment, kvf_store, KVF_TIER_DEVICE};

const BLOCK: usize = 4096;
const BT: usize = 4;

fn config(pairs: &[(&str, &str)]) -> kvf_config {
    let mut c = kvf_config::default();
    for (k, v) in pairs {
        c.set(k, v).unwrap();
    }
    c
}

/// Registers `buf` with the agent.
///
/// # Safety
/// `buf` stays alive and unmoved until the region is deregistered.
unsafe fn register(agent: &kvf_agent, buf: &mut [u8]) -> kvfabric::memory::RegionId {
    // SAFETY: the caller's contract.
    unsafe {
        agent.agent().register_external(
            std::ptr::NonNull::new(buf.as_mut_ptr()).unwrap(),
            buf.len(),
            false,
        )
    }
    .unwrap()
    .id()
}

/// One segment per block: block `i` at `i * BLOCK` of `region`.
fn block_segment(region: kvfabric::memory::RegionId) -> [kvf_segment; 1] {
    [kvf_segment { region: region.0, offset: 0, block_stride: BLOCK as u64, bytes: BLOCK as u64 }]
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < Duration::from_secs(15), "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn discovery_remote_tier_and_events_over_etcd_and_nats() {
    let etcd = EtcdServer::start().unwrap();
    let mut nats = NatsServer::start().unwrap();
    let (e, n) = (etcd.endpoint(), nats.url());
    let common = [
        ("secret", "ffi-cp"),
        ("etcd", e.as_str()),
        ("nats", n.as_str()),
        ("namespace", "ffi_test"),
        ("block_tokens", "4"),
        ("block_bytes", "4096"),
        ("host_blocks", "32"),
        ("lease_ttl_ms", "2000"),
    ];
    let mut ca = config(&common);
    ca.set("name", "ffi-a").unwrap();
    ca.set("serve", "1").unwrap();
    let mut cb = config(&common);
    cb.set("name", "ffi-b").unwrap();
    cb.set("remote", "1").unwrap();

    // Subscribe to the events before anything is stored.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut events = rt.block_on(async {
        let bus = NatsBus::connect(&n, "ffi_test").await.unwrap();
        let sub = bus.subscribe("kv-events").await.unwrap();
        (Arc::new(bus), sub)
    });

    let agent_a = kvf_agent::new(&ca).unwrap();
    let store_a = kvf_store::new(&agent_a, &ca).unwrap();
    let agent_b = kvf_agent::new(&cb).unwrap();
    let store_b = kvf_store::new(&agent_b, &cb).unwrap();

    // A stores 3 blocks from its memory (one segment per block).
    let tokens: Vec<u32> = (0..(3 * BT + 1) as u32).map(|i| 500 + i * 3).collect();
    let mut src: Vec<u8> = (0..3 * BLOCK).map(|i| (i * 13 % 251) as u8).collect();
    // SAFETY: `src` outlives the registration (deregistered below) and is not moved.
    let rs = unsafe { register(&agent_a, &mut src) };
    let seg = block_segment(rs);
    let op = store_a.save(&tokens, 0, &[0, 1, 2], &seg).unwrap();
    assert_eq!(op.wait(Some(Duration::from_secs(10))).unwrap().unwrap(), 3);
    drop(op);
    // And one block of another prompt, which B never loads.
    let alt: Vec<u32> = (0..BT as u32).map(|i| 90_000 + i).collect();
    let op = store_a.save(&alt, 0, &[2], &seg).unwrap();
    assert_eq!(op.wait(Some(Duration::from_secs(10))).unwrap().unwrap(), 1);
    drop(op);

    // B finds A in discovery and sees A's blocks as remote hits.
    wait_until("B to see A's blocks", || store_b.lookup(&tokens).unwrap().len() == 3);
    assert!(store_b
        .lookup(&tokens)
        .unwrap()
        .iter()
        .all(|t| *t == kvfabric::events::TierKind::Remote));
    let mut dst = vec![0u8; 8 * BLOCK];
    // SAFETY: `dst` outlives the registration (deregistered below) and is not moved.
    let rd = unsafe { register(&agent_b, &mut dst) };
    let dseg = block_segment(rd);
    let op = store_b.load(&tokens, 0, &[7, 5, 3], &dseg).unwrap();
    assert_eq!(op.wait(Some(Duration::from_secs(10))).unwrap().unwrap(), 3);
    drop(op);
    for (k, id) in [7usize, 5, 3].into_iter().enumerate() {
        assert_eq!(&dst[id * BLOCK..(id + 1) * BLOCK], &src[k * BLOCK..(k + 1) * BLOCK]);
    }

    // The engine publishes its own (device) blocks through A: same source, next ids.
    // SAFETY: the handle and the token array are live for the call.
    let r = unsafe {
        kvfabric_ffi::kvf_store_publish_stored(
            &store_a,
            tokens.as_ptr(),
            tokens.len(),
            0,
            2,
            u32::from(KVF_TIER_DEVICE),
        )
    };
    assert_eq!(r, kvfabric_ffi::kvf_result::KVF_OK);
    let mut hashes = vec![0u64; 3];
    let mut n = 0usize;
    // SAFETY: as above; `hashes` holds 3 entries.
    let r = unsafe {
        kvfabric_ffi::kvf_store_hashes(
            &store_a,
            tokens.as_ptr(),
            tokens.len(),
            hashes.as_mut_ptr(),
            3,
            &mut n,
        )
    };
    assert_eq!((r, n), (kvfabric_ffi::kvf_result::KVF_OK, 3));

    // A's events: 3 host Stored (ids 1..3), the alt block (4), the device Stored (5).
    let mut from_a = Vec::new();
    rt.block_on(async {
        while from_a.len() < 5 {
            let msg = tokio::time::timeout(Duration::from_secs(10), events.1.recv())
                .await
                .expect("events arrive")
                .unwrap();
            let v: serde_json::Value = serde_json::from_slice(&msg).unwrap();
            // B's remote tier asks A for a dump when it starts following; only the events
            // carry ids.
            if v["type"] == "kv_event" && v["source"] == "ffi-a" {
                from_a.push(v["event"].clone());
            }
        }
    });
    let ids: Vec<u64> = from_a.iter().map(|e| e["event_id"].as_u64().unwrap()).collect();
    assert_eq!(ids, vec![1, 2, 3, 4, 5], "{from_a:?}");
    for (i, e) in from_a[..3].iter().enumerate() {
        assert_eq!(e["tier"], "host");
        assert_eq!(e["sequence_hashes"][0].as_u64().unwrap(), hashes[i]);
    }
    assert_eq!(from_a[1]["parent"].as_u64().unwrap(), hashes[0]);
    assert_eq!(from_a[4]["tier"], "device");
    assert_eq!(from_a[4]["sequence_hashes"].as_array().unwrap().len(), 2);

    // A leaves (store freed, registration revoked): B no longer finds A's other block, and
    // still holds the blocks it loaded (onboarded into its host tier).
    assert_eq!(store_b.lookup(&alt).unwrap().len(), 1);
    drop(store_a);
    agent_a.agent().deregister(rs).unwrap();
    drop(agent_a);
    wait_until("A's blocks to leave B's view", || store_b.lookup(&alt).unwrap().is_empty());
    assert_eq!(store_b.lookup(&tokens).unwrap(), vec![kvfabric::events::TierKind::Host; 3]);

    // The store's metrics say what it sees of etcd and NATS (as /metrics does for kvfabric's
    // own processes): both up; NATS away, then back with the reconnect counted.
    let cp = |component: &str| {
        let m = store_b.metrics_json();
        let all = m["control_plane"].as_array().unwrap().clone();
        all.into_iter().find(|c| c["component"] == component).unwrap_or_else(|| panic!("{m}"))
    };
    assert_eq!((cp("etcd")["up"].clone(), cp("nats")["up"].clone()), (true.into(), true.into()));
    drop(events);
    nats.kill();
    wait_until("the store to see NATS away", || cp("nats")["up"] == false);
    assert!(cp("nats")["error"].is_string(), "{}", cp("nats"));
    assert_eq!(cp("etcd")["up"], true);
    nats.restart().unwrap();
    wait_until("the store to see NATS back", || cp("nats")["up"] == true);
    assert!(cp("nats")["reconnects"].as_u64() >= Some(1), "{}", cp("nats"));
    drop(store_b);
    agent_b.agent().deregister(rd).unwrap();
}

/// Without etcd, processes of one host find each other in a shared directory
/// (`discovery_dir`): a serving store registers there, a `remote` store finds it and loads
/// its blocks, forgets it when it leaves, and a second store under a live name is refused.
/// (Both agents run in this test process; the directory's lease is a per-file lock, which
/// two handles in one process contend for as two processes would.)
#[test]
fn discovery_in_a_shared_directory_without_etcd() {
    let dir = tempfile::tempdir().unwrap();
    let nodes = dir.path().join("nodes");
    let nodes = nodes.to_str().unwrap();
    let common = [
        ("secret", "ffi-dir"),
        ("discovery_dir", nodes),
        ("block_tokens", "4"),
        ("block_bytes", "4096"),
        ("host_blocks", "32"),
    ];
    let mut ca = config(&common);
    ca.set("name", "dir-a").unwrap();
    ca.set("serve", "1").unwrap();
    let mut cb = config(&common);
    cb.set("name", "dir-b").unwrap();
    cb.set("remote", "1").unwrap();
    let agent_a = kvf_agent::new(&ca).unwrap();
    let store_a = kvf_store::new(&agent_a, &ca).unwrap();
    let agent_b = kvf_agent::new(&cb).unwrap();
    let store_b = kvf_store::new(&agent_b, &cb).unwrap();

    let tokens: Vec<u32> = (0..(2 * BT) as u32).map(|i| 700 + i).collect();
    let mut src: Vec<u8> = (0..2 * BLOCK).map(|i| (i * 7 % 251) as u8).collect();
    // SAFETY: `src` outlives the registration (deregistered below) and is not moved.
    let rs = unsafe { register(&agent_a, &mut src) };
    let seg = block_segment(rs);
    let op = store_a.save(&tokens, 0, &[0, 1], &seg).unwrap();
    assert_eq!(op.wait(Some(Duration::from_secs(10))).unwrap().unwrap(), 2);
    drop(op);
    wait_until("B to find A in the directory", || store_b.lookup(&tokens).unwrap().len() == 2);
    // What A registered there, read without an agent: its node info.
    let found = discovery_get(nodes, "fabric", "dir-a").unwrap();
    let info: serde_json::Value = serde_json::from_slice(&found).unwrap();
    assert_eq!(info["agent"]["name"], "dir-a", "{info}");
    assert_eq!(
        discovery_get(nodes, "fabric", "dir-z"),
        Err(kvfabric_ffi::kvf_result::KVF_NOT_FOUND)
    );
    let mut dst = vec![0u8; 2 * BLOCK];
    // SAFETY: `dst` outlives the registration (deregistered below) and is not moved.
    let rd = unsafe { register(&agent_b, &mut dst) };
    let dseg = block_segment(rd);
    let op = store_b.load(&tokens, 0, &[1, 0], &dseg).unwrap();
    assert_eq!(op.wait(Some(Duration::from_secs(10))).unwrap().unwrap(), 2);
    drop(op);
    assert_eq!(&dst[BLOCK..], &src[..BLOCK]);
    assert_eq!(&dst[..BLOCK], &src[BLOCK..]);

    // Another serving store under A's name, while A lives: refused.
    let agent_c = kvf_agent::new(&ca).unwrap();
    let refused = kvf_store::new(&agent_c, &ca);
    assert!(refused.is_err(), "a second 'dir-a' was registered");
    drop(agent_c);

    // A leaves: B forgets its blocks (the ones B loaded stay in B's host tier).
    let alt: Vec<u32> = (0..BT as u32).map(|i| 80_000 + i).collect();
    let op = store_a.save(&alt, 0, &[0], &seg).unwrap();
    assert_eq!(op.wait(Some(Duration::from_secs(10))).unwrap().unwrap(), 1);
    drop(op);
    wait_until("B to see A's other block", || store_b.lookup(&alt).unwrap().len() == 1);
    drop(store_a);
    agent_a.agent().deregister(rs).unwrap();
    drop(agent_a);
    wait_until("A's blocks to leave B's view", || store_b.lookup(&alt).unwrap().is_empty());
    assert_eq!(
        discovery_get(nodes, "fabric", "dir-a"),
        Err(kvfabric_ffi::kvf_result::KVF_NOT_FOUND)
    );
    drop(store_b);
    agent_b.agent().deregister(rd).unwrap();
}

/// `kvf_discovery_get` through the C ABI: the bytes, or the code.
fn discovery_get(dir: &str, kind: &str, id: &str) -> Result<Vec<u8>, kvfabric_ffi::kvf_result> {
    let c = |s: &str| std::ffi::CString::new(s).unwrap();
    let (dir, kind, id) = (c(dir), c(kind), c(id));
    let mut buf = vec![0u8; 1 << 16];
    let mut n = 0usize;
    // SAFETY: NUL-terminated strings, a buffer of its length, one usize.
    let r = unsafe {
        kvfabric_ffi::kvf_discovery_get(
            dir.as_ptr(),
            kind.as_ptr(),
            id.as_ptr(),
            buf.as_mut_ptr(),
            buf.len(),
            &mut n,
        )
    };
    if r != kvfabric_ffi::kvf_result::KVF_OK {
        return Err(r);
    }
    buf.truncate(n);
    Ok(buf)
}
