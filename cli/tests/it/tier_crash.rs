//! Crash safety of the disk tier: a `kvfabric tier-soak` child offloads blocks as fast as it
//! can and is killed -9 mid-flight; the directory is then reopened here. The rebuilt index
//! must be consistent and no block may be served with bytes other than its own.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvfabric::agent::{Agent, AgentConfig};
use kvfabric::events::{KvEventData, RecordingSink, TierKind};
use kvfabric_tiers::disk::DiskConfig;
use kvfabric_tiers::{StoreConfig, TieredStore};

const BLOCK: u64 = 65_536;
const SOAK_BASE: u64 = 0x50a6_0000_0000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_during_heavy_offload_then_restarted() {
    let dir = tempfile::tempdir().unwrap();
    for round in 0..3 {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvfabric"))
            .args([
                "tier-soak",
                "--block-bytes",
                &BLOCK.to_string(),
                "--disk-blocks",
                "128",
                "--dir",
            ])
            .arg(dir.path())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        // Let it write well past the disk's capacity (slots are being rewritten), then kill.
        let target = 400 + round * 100;
        let start = Instant::now();
        loop {
            let line = lines.next().expect("soak output").unwrap();
            let v: serde_json::Value = serde_json::from_str(&line).unwrap();
            if v["stored"].as_u64().unwrap() >= target {
                break;
            }
            assert!(start.elapsed() < Duration::from_secs(60), "soak too slow");
        }
        child.kill().unwrap(); // SIGKILL, mid-offload
        child.wait().unwrap();

        let agent = Agent::start(AgentConfig::new("check", b"c".to_vec())).await.unwrap();
        let sink = RecordingSink::new();
        let mut cfg = StoreConfig::new(BLOCK, 256)
            .with_disk(DiskConfig::new(dir.path().join("soak.slots"), 128));
        cfg.shared_host = false;
        let store = TieredStore::open(cfg, &agent, sink.clone()).await.unwrap();
        let recovered: Vec<_> = sink
            .take()
            .into_iter()
            .filter_map(|e| match e.data {
                KvEventData::Stored { sequence_hashes, tier: TierKind::Disk, .. } => {
                    Some(sequence_hashes[0])
                }
                _ => None,
            })
            .collect();
        assert!(recovered.len() >= 64, "round {round}: only {} blocks recovered", recovered.len());
        let mut unique = recovered.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), recovered.len(), "no block indexed twice");
        let m = store.metrics();
        assert!(
            m.disk_used_blocks as usize == recovered.len()
                && m.disk_used_blocks <= m.disk_capacity_blocks
        );
        // Every block the index holds is one the soak wrote, and is served with exactly its
        // own bytes — or dropped as corrupt, never served wrong.
        let mut served = 0;
        for h in &recovered {
            assert!(h.0 >= SOAK_BASE && h.0 < SOAK_BASE + 1_000_000, "foreign hash {h}");
            for r in store.get(&[*h]).await.unwrap() {
                assert!(
                    r.to_vec() == kvfabric_tiers::synthetic::block(*h, BLOCK as usize),
                    "block {h} served with wrong bytes"
                );
                served += 1;
            }
        }
        assert_eq!(served as u64 + store.metrics().disk_corrupt_blocks, recovered.len() as u64);
        drop(store);
        let _ = Arc::new(());
    }
}
