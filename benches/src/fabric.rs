//! `kvfabric bench fabric`: remote get throughput from a fabric node process over tcp, and —
//! in the same run, over the same connection kind — a plain transfer-engine READ of the same
//! bytes in the same batches out of the node's exported memory, the limit for the fabric
//! protocol (RPC, lookup in the node's store, pinning, its WRITE into our memory).

use crate::Host;
use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::time::{Duration, Instant};

use crate::Context;
use clap::Args;
use kvfabric::agent::Agent;
use kvfabric::hash::SequenceHash;
use kvfabric::memory::RegionOptions;
use kvfabric::transfer::{Desc, TransferOp, TransferRequest, TransportKind};
use kvfabric_planner::stats::{gbps, Percentiles};
use kvfabric_tiers::remote::protocol::NodeInfo;
use kvfabric_tiers::remote::RemoteTier;

#[derive(Debug, Args)]
pub struct FabricArgs {
    /// Model whose 16-token block to move.
    #[arg(long, default_value = "smollm2-135m")]
    model: String,
    /// Blocks stored on the node and fetched per round.
    #[arg(long, default_value_t = 512)]
    blocks: usize,
    /// Blocks per get call.
    #[arg(long, value_delimiter = ',', default_value = "1,16,64")]
    batches: Vec<usize>,
    /// Rounds per measurement.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Print JSON rows.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, serde::Serialize)]
struct Row {
    model: String,
    block_bytes: u64,
    batch: usize,
    get_gbps: f64,
    get_p50_us: f64,
    get_p99_us: f64,
    transfer_tcp_gbps: f64,
    ratio_to_transfer: f64,
}

pub async fn run(args: FabricArgs, host: &Host) -> crate::Result<()> {
    let spec = kvfabric_planner::plan::resolve_model(&args.model)?;
    let block = spec.block_layout(16)?.bytes_per_block();
    let n = args.blocks.max(1);
    let secret = format!("bench-fabric-{}", std::process::id());
    let exe = &host.exe;
    let mut child = std::process::Command::new(exe)
        .args([
            "fabric",
            "--name",
            "bench-fabric",
            "--model",
            &args.model,
            "--host-blocks",
            &(n + 16).to_string(),
        ])
        .env("KVFABRIC_SECRET", &secret)
        .env_remove("KVFABRIC_ETCD")
        .env_remove("KVFABRIC_NATS")
        .stdout(Stdio::piped())
        .spawn()
        .context("starting the fabric node")?;
    let mut line = String::new();
    BufReader::new(child.stdout.take().context("node stdout")?).read_line(&mut line)?;
    let v: serde_json::Value = serde_json::from_str(&line).context("node info")?;
    let info: NodeInfo = serde_json::from_value(v["fabric"].clone())?;

    let mut cfg = host.agent_config("bench-client", secret.into_bytes());
    cfg.shm = false; // measure the network path
    let agent = Agent::start(cfg).await?;
    let region = agent
        .alloc_region(n * block as usize, RegionOptions { export: true, ..Default::default() })?;
    let remote = RemoteTier::new(agent.clone(), Duration::from_secs(30));
    remote.add_node(&info).await?;
    let hashes: Vec<SequenceHash> = (0..n as u64).map(|i| SequenceHash(0xbe9c_0000 + i)).collect();
    let locs: Vec<_> = (0..n as u64).map(|i| (region.id(), i * block)).collect();
    let mut buf = vec![0u8; block as usize];
    for (i, h) in hashes.iter().enumerate() {
        kvfabric_tiers::synthetic::fill(*h, &mut buf);
        region.write_at(i as u64 * block, &buf)?;
    }
    let parents = vec![None; n];
    crate::ensure!(remote.put(&hashes, &parents, &locs).await?.iter().all(|&s| s), "put failed");
    let node_region = info.agent.regions.first().context("node exports no region")?.id;
    let stride = block.div_ceil(4096) * 4096;

    let mut rows = Vec::new();
    for &batch in &args.batches {
        let batch = batch.clamp(1, n);
        let (mut get_lat, mut get_time, mut raw_time) =
            (Vec::new(), Duration::ZERO, Duration::ZERO);
        let mut moved = 0u64;
        for _ in 0..args.rounds.max(1) {
            for chunk in (0..n).collect::<Vec<_>>().chunks(batch) {
                let hs: Vec<_> = chunk.iter().map(|&i| hashes[i]).collect();
                let ls: Vec<_> = chunk.iter().map(|&i| locs[i]).collect();
                let t = Instant::now();
                let served = remote.get(&hs, &ls).await?;
                let d = t.elapsed();
                crate::ensure!(served.iter().all(|&s| s), "a block was not served");
                get_lat.push(d);
                get_time += d;
                moved += chunk.len() as u64 * block;
                // The limit: the same bytes, same batch, a plain READ from the node's memory.
                let local: Vec<Desc> = chunk
                    .iter()
                    .map(|&i| Desc::new(region.id(), i as u64 * block, block))
                    .collect();
                let remote_descs: Vec<Desc> = (0..chunk.len() as u64)
                    .map(|k| Desc::new(node_region, k * stride, block))
                    .collect();
                let req =
                    TransferRequest::new(TransferOp::Read, &info.agent.name, local, remote_descs)
                        .with_transport(TransportKind::Tcp)
                        .with_checksum();
                let t = Instant::now();
                agent.post(req)?.wait().await?;
                raw_time += t.elapsed();
            }
        }
        let p = Percentiles::of(&get_lat);
        let (g, r) = (gbps(moved, get_time), gbps(moved, raw_time));
        rows.push(Row {
            model: args.model.clone(),
            block_bytes: block,
            batch,
            get_gbps: g,
            get_p50_us: p.p50_us,
            get_p99_us: p.p99_us,
            transfer_tcp_gbps: r,
            ratio_to_transfer: g / r,
        });
    }
    let _ = child.kill();
    let _ = child.wait();
    if args.json {
        for r in &rows {
            println!("{}", serde_json::to_string(r)?);
        }
        return Ok(());
    }
    println!(
        "{:>14} {:>9} {:>6} {:>9} {:>10} {:>10} {:>13} {:>6}",
        "model", "block", "batch", "get GB/s", "p50", "p99", "transfer GB/s", "ratio"
    );
    for r in &rows {
        println!(
            "{:>14} {:>7}Ki {:>6} {:>9.2} {:>8.0}µs {:>8.0}µs {:>13.2} {:>5.2}×",
            r.model,
            r.block_bytes >> 10,
            r.batch,
            r.get_gbps,
            r.get_p50_us,
            r.get_p99_us,
            r.transfer_tcp_gbps,
            r.ratio_to_transfer
        );
    }
    println!("limit: a checksummed transfer-engine READ over tcp of the same bytes in the same batches, same run");
    Ok(())
}
