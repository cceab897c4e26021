//! `kvfabric tier-soak` (hidden, for crash tests): stores synthetic blocks through a small
//! host tier into a disk tier, forever, with write-through and constant eviction, printing
//! `{"stored": N}` every 64 blocks. Kill it with -9 and reopen the directory: no block may be
//! served with wrong bytes.

use std::io::Write;
use std::sync::Arc;

use clap::Args;
use kvfabric::agent::Agent;
use kvfabric::events::NullSink;
use kvfabric::hash::SequenceHash;
use kvfabric_tiers::disk::DiskConfig;
use kvfabric_tiers::{StoreConfig, StoreError, TieredStore};

/// First sequence hash the soak writes; block i has hash `SOAK_BASE + i`.
pub const SOAK_BASE: u64 = 0x50a6_0000_0000;

#[derive(Debug, Args)]
pub struct SoakArgs {
    /// Directory of the disk tier (file `soak.slots`).
    #[arg(long)]
    dir: std::path::PathBuf,
    /// Bytes per block.
    #[arg(long, default_value_t = 65_536)]
    block_bytes: u64,
    /// Host slots.
    #[arg(long, default_value_t = 8)]
    host_blocks: u32,
    /// Disk slots.
    #[arg(long, default_value_t = 128)]
    disk_blocks: u32,
}

pub async fn run(args: SoakArgs) -> anyhow::Result<()> {
    let agent = Agent::start(super::stack::agent_config("soak", b"soak".to_vec())).await?;
    let mut disk = DiskConfig::new(args.dir.join("soak.slots"), args.disk_blocks);
    disk.queue_depth = 8;
    let mut cfg = StoreConfig::new(args.block_bytes, args.host_blocks).with_disk(disk);
    cfg.disk_admit_min_hits = 0;
    cfg.write_through = true;
    cfg.shared_host = false;
    let store = TieredStore::open(cfg, &agent, Arc::new(NullSink)).await?;
    let mut buf = vec![0u8; args.block_bytes as usize];
    for i in 0u64.. {
        let h = SequenceHash(SOAK_BASE + i);
        kvfabric_tiers::synthetic::fill(h, &mut buf);
        loop {
            match store.put(h, i.checked_sub(1).map(|p| SequenceHash(SOAK_BASE + p)), &buf).await {
                // Every host block pinned by in-flight write-through: let them finish, then
                // store this same block.
                Err(StoreError::Full(_)) => {
                    tokio::time::sleep(std::time::Duration::from_micros(100)).await
                }
                other => break other?,
            }
        }
        if i % 64 == 63 {
            let mut out = std::io::stdout().lock();
            writeln!(out, "{{\"stored\": {}}}", i + 1)?;
            out.flush()?;
        }
    }
    Ok(())
}
