//! `kvfabric bench tier`: offload (host → disk) and onboard (disk → host) throughput of the
//! tiered store for block sizes of real models, at queue depths 1 … 32. In the same run, for
//! each row, a plain O_DIRECT sequential write and read of the same bytes, in requests of the
//! same size, at the same depth (io_uring, no headers, no checksums, no index), to and from
//! memory allocated like the host tier's, is the limit. Rows `prefix` read the blocks back as
//! a prompt's prefix is: consecutive blocks per `get`, one `get` at a time, against the same
//! plain reads at that depth.
//!
//! `depth` is the I/O queue depth, the store's (`DiskConfig::queue_depth`) and the plain
//! loop's alike. Callers keep `--outstanding` × depth requests outstanding (default 2), as the
//! serving scheduler does: it asks a prompt chunk's disk blocks (32) of a tier whose queue
//! depth is 16 at once, so the queue stays full while completed blocks are verified. The plain
//! loops keep as many outstanding over a queue of the same depth.

use crate::Host;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::Context;
use clap::Args;
use futures_util::stream::{self, StreamExt};
use kvfabric::agent::Agent;
use kvfabric::events::NullSink;
use kvfabric::hash::SequenceHash;
use kvfabric::layout::ModelSpec;
use kvfabric_planner::stats::{gbps, Percentiles};
use kvfabric_tiers::disk::format::align_up;
use kvfabric_tiers::disk::io::{open_direct, DiskIo, IoBuf, IoPreference};
use kvfabric_tiers::disk::DiskConfig;
use kvfabric_tiers::{StoreConfig, TieredStore};

#[derive(Debug, Args)]
pub struct TierArgs {
    /// Models whose block size to use (16 tokens per block, bf16).
    #[arg(long, value_delimiter = ',', default_value = "smollm2-135m,llama-3.1-8b")]
    models: Vec<String>,
    /// Tokens per block.
    #[arg(long, default_value_t = 16)]
    block_tokens: u32,
    /// I/O queue depths (the store's disk tier and the plain loop's).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16,32")]
    depths: Vec<usize>,
    /// Requests the callers keep outstanding, as a multiple of the depth: the store's
    /// concurrent calls (blocks per `get` in the prefix rows) and the plain loop's requests.
    /// 2 is what the serving scheduler asks of its disk tier (a prompt chunk of 32 blocks at
    /// depth 16); 1 leaves the queue a request short while each completed block is hashed.
    #[arg(long, default_value_t = 2)]
    outstanding: usize,
    /// Bytes moved per measurement, MiB.
    #[arg(long, default_value_t = 128)]
    total_mib: u64,
    /// Repetitions per row: each runs the store and then the plain I/O; the medians of the
    /// rates and of the per-repetition ratios are reported.
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Directory for the files (a real disk, not tmpfs); a temporary one inside it.
    #[arg(long, default_value_os_t = std::env::temp_dir())]
    dir: std::path::PathBuf,
    /// Use pread/pwrite threads instead of io_uring (the fallback).
    #[arg(long)]
    pread: bool,
    /// Print one JSON object per row.
    #[arg(long)]
    json: bool,
    /// Also G1 ↔ G2 rows: a device tier on GPU 0 moving blocks down to host memory (D2H) and
    /// back up (H2D), against raw `cuMemcpy*Async` of the same blocks (needs an NVIDIA GPU).
    #[arg(long)]
    g1: bool,
    /// Only the G1 ↔ G2 rows.
    #[arg(long)]
    g1_only: bool,
    /// Also plot GB/s against queue depth per operation and model, with the plain I/O
    /// limit of the same run (dashed), to this SVG file.
    #[arg(long)]
    plot: Option<std::path::PathBuf>,
}

#[derive(Debug, serde::Serialize)]
struct Row {
    op: &'static str,
    model: String,
    block_bytes: u64,
    depth: usize,
    /// Requests outstanding (store calls, or blocks per `get` in the prefix rows).
    outstanding: usize,
    blocks: u64,
    gbps: f64,
    p50_us: f64,
    p99_us: f64,
    limit_gbps: f64,
    ratio_to_limit: f64,
    /// Each repetition's store rate / plain rate.
    ratio_reps: Vec<f64>,
    /// Onboard only: plain reads that also hash every block with XXH3-64 once read, as the
    /// store must to verify it (the limit for a store that never serves a corrupt block).
    verified_limit_gbps: Option<f64>,
    /// Onboard only: median of store rate / verified plain rate per repetition.
    ratio_to_verified_limit: Option<f64>,
    io_backend: &'static str,
}

/// What a plain run does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Plain {
    Write,
    Read,
    /// Read, then XXH3-64 each request's bytes once they are in (what the store's verification
    /// costs on top of the I/O).
    ReadHash,
}

/// Plain sequential O_DIRECT I/O of `n` requests of `req` bytes at `depth`, `outstanding`
/// of them asked at a time, to and from `memory` (allocated like the store's host tier,
/// request i at offset i × req): GB/s.
#[allow(clippy::too_many_arguments)]
async fn plain(
    path: &std::path::Path,
    op: Plain,
    req: u64,
    n: u64,
    (depth, outstanding): (usize, usize),
    prefer: IoPreference,
    memory: &Arc<kvfabric::memory::Region>,
) -> crate::Result<f64> {
    let write = op == Plain::Write;
    if write {
        // A new file each time, as the store's slot file is (reusing one would rewrite
        // blocks the backing store already holds, which can be much faster than new ones).
        let _ = std::fs::remove_file(path);
    }
    let file = Arc::new(open_direct(path)?);
    if write {
        // Preallocated, as the store's slot file is.
        use std::os::fd::AsRawFd;
        // SAFETY: fallocate on our open descriptor; no memory involved.
        let r = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, (req * n) as libc::off_t) };
        crate::ensure!(r == 0, "fallocate: {}", std::io::Error::last_os_error());
    }
    let io = Arc::new(DiskIo::new(file, depth, prefer)?);
    let start = Instant::now();
    let results: Vec<crate::Result<usize>> = stream::iter(0..n)
        .map(|i| {
            let (io, memory) = (io.clone(), memory.clone());
            async move {
                let ptr = memory.ptr_at(i * req, req)?;
                let b = IoBuf { ptr, len: req as usize };
                let keep = Box::new(kvfabric::memory::RegionLease::new(memory.clone()));
                // SAFETY: the range was bounds-checked and the lease keeps the region alive
                // until the request completes; requests use disjoint ranges.
                let n = unsafe {
                    if write {
                        io.writev(i * req, &[b], keep).await
                    } else {
                        io.readv(i * req, &[b], keep).await
                    }
                }?;
                if op == Plain::ReadHash {
                    std::hint::black_box(memory.checksum(i * req, req)?);
                }
                Ok(n)
            }
        })
        .buffer_unordered(outstanding)
        .collect()
        .await;
    let elapsed = start.elapsed();
    for r in results {
        crate::ensure!(r? as u64 == req, "short plain I/O");
    }
    Ok(gbps(req * n, elapsed))
}

/// A plain read run and a plain read-and-hash run, back to back: GB/s of each.
async fn plain_reads(
    path: &std::path::Path,
    req: u64,
    n: u64,
    depth: (usize, usize),
    prefer: IoPreference,
    memory: &Arc<kvfabric::memory::Region>,
) -> crate::Result<(f64, f64)> {
    let raw = plain(path, Plain::Read, req, n, depth, prefer, memory).await?;
    let hashed = plain(path, Plain::ReadHash, req, n, depth, prefer, memory).await?;
    Ok((raw, hashed))
}

/// Runs on a runtime worker, as the store's callers (the serving engine's tasks) do: calls
/// from the main thread's `block_on` would add a cross-thread wake to every store call and to
/// no plain request.
pub async fn run(args: TierArgs, host: &Host) -> crate::Result<()> {
    tokio::spawn(run_on_worker(args, host.clone())).await?
}

async fn run_on_worker(args: TierArgs, host: Host) -> crate::Result<()> {
    crate::ensure!(
        args.depths.iter().all(|&d| (1..=4096).contains(&d)),
        "--depths must be 1..=4096"
    );
    crate::ensure!((1..=16).contains(&args.outstanding), "--outstanding must be 1..=16");
    if args.g1_only {
        // Before anything else starts (and logs): without CUDA there is nothing to measure.
        kvfabric::cuda::available().map_err(|why| crate::failed!("bench tier --g1-only: {why}"))?;
    }
    let work = tempfile::Builder::new()
        .prefix("kvfabric-bench-tier")
        .tempdir_in(&args.dir)
        .context("creating the work directory")?;
    let agent = Agent::start(host.agent_config("bench-tier", b"bench".to_vec())).await?;
    let prefer = if args.pread { IoPreference::Pread } else { IoPreference::Auto };
    let mut rows = Vec::new();
    if args.g1 || args.g1_only {
        match kvfabric::cuda::available() {
            Ok(()) => rows.extend(g1_rows(&args, &agent).await?),
            Err(why) if args.g1_only => crate::bail!("bench tier --g1-only: {why}"),
            Err(why) => eprintln!("bench tier: skipping the G1 rows: {why}"),
        }
    }
    let disk_models: &[String] = if args.g1_only { &[] } else { &args.models };
    for model in disk_models {
        let spec = ModelSpec::preset(model)?;
        let block_bytes = spec.block_layout(args.block_tokens)?.bytes_per_block();
        let n = ((args.total_mib << 20) / block_bytes).max(8);
        let data = align_up(block_bytes);
        for &depth in &args.depths {
            let ask = depth * args.outstanding;
            eprintln!(
                "{model}: {} KiB blocks × {n}, depth {depth}, {ask} outstanding",
                block_bytes >> 10
            );
            let slots = work.path().join(format!("{model}-{depth}.slots"));
            let mut disk = DiskConfig::new(&slots, n as u32);
            disk.queue_depth = depth;
            disk.io = prefer;
            disk.grow_blocks = n as u32;
            let mut cfg = StoreConfig::new(block_bytes, n as u32).with_disk(disk.clone());
            cfg.disk_admit_min_hits = 0;
            cfg.shared_host = false;
            let hashes: Vec<SequenceHash> = (0..n).map(|i| SequenceHash(0xb10c_0000 + i)).collect();

            let limit_path = work.path().join(format!("{model}-{depth}.plain"));
            let plain_memory = agent.alloc_region(
                (data * n) as usize,
                kvfabric::memory::RegionOptions { shared: false, export: false, huge_pages: false },
            )?;
            // The same kind of bytes as the store's blocks (not zeros, which a thin or
            // compressing backing store could write or read faster).
            {
                let mut buf = vec![0u8; data as usize];
                for (i, &h) in hashes.iter().enumerate() {
                    kvfabric_tiers::synthetic::fill(h, &mut buf);
                    plain_memory.write_at(i as u64 * data, &buf)?;
                }
            }
            let mut backend = "none";
            let (mut off, mut on, mut pre, mut w_lim, mut r_lim, mut v_lim) =
                (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
            let mut lats = (Vec::new(), Vec::new(), Vec::new());
            // Repetitions interleave the store and the plain I/O, so that both see the same
            // machine; the medians are reported.
            let plain_write =
                || plain(&limit_path, Plain::Write, data, n, (depth, ask), prefer, &plain_memory);
            let plain_read =
                || plain_reads(&limit_path, data, n, (depth, ask), prefer, &plain_memory);
            for rep in 0..args.reps.max(1) {
                // Every other repetition runs the plain I/O first: what ran just before (the
                // backing store's own caching and write-back of the other file) then favours
                // neither side.
                let plain_first = rep % 2 == 1;
                if plain_first {
                    w_lim.push(plain_write().await?);
                }
                let _ = std::fs::remove_file(&slots);
                // Offload: every block in host memory first, then host → disk at `depth`.
                let store = TieredStore::open(cfg.clone(), &agent, Arc::new(NullSink)).await?;
                let mut buf = vec![0u8; block_bytes as usize];
                for &h in &hashes {
                    kvfabric_tiers::synthetic::fill(h, &mut buf);
                    store.put(h, None, &buf).await?;
                }
                let (lat, elapsed) = timed(&hashes, ask, |h| {
                    let store = store.clone();
                    async move {
                        let written = store.offload(&[h]).await?;
                        crate::ensure!(written == 1, "block {h} not written");
                        Ok(())
                    }
                })
                .await?;
                backend = store.metrics().disk_io_backend.unwrap_or("none");
                drop(store);
                off.push(gbps(block_bytes * n, elapsed));
                lats.0.extend(lat);
                if !plain_first {
                    w_lim.push(plain_write().await?);
                }
                if plain_first {
                    let (raw, hashed) = plain_read().await?;
                    r_lim.push(raw);
                    v_lim.push(hashed);
                }

                // Onboard: a restarted store rebuilds its index, then disk → host at `depth`.
                let store = TieredStore::open(cfg.clone(), &agent, Arc::new(NullSink)).await?;
                let (lat, elapsed) = timed(&hashes, ask, |h| {
                    let store = store.clone();
                    async move {
                        let got = store.get(&[h]).await?;
                        crate::ensure!(got.len() == 1, "block {h} not onboarded");
                        Ok(())
                    }
                })
                .await?;
                // Spot-check bytes (outside the timing).
                for &h in hashes.iter().step_by(17) {
                    let got = store.get(&[h]).await?;
                    crate::ensure!(
                        got[0].to_vec()
                            == kvfabric_tiers::synthetic::block(h, block_bytes as usize),
                        "block {h} bytes differ"
                    );
                }
                drop(store);
                on.push(gbps(block_bytes * n, elapsed));
                lats.1.extend(lat);

                // Onboard of prefixes: `ask` consecutive blocks per `get`, one `get` at a
                // time (a prompt's cached blocks, as the scheduler asks for them).
                let store = TieredStore::open(cfg.clone(), &agent, Arc::new(NullSink)).await?;
                let start = Instant::now();
                for chunk in hashes.chunks(ask) {
                    let t = Instant::now();
                    let got = store.get(chunk).await?;
                    crate::ensure!(got.len() == chunk.len(), "prefix not onboarded");
                    drop(got);
                    lats.2.push(t.elapsed());
                }
                pre.push(gbps(block_bytes * n, start.elapsed()));
                drop(store);
                if !plain_first {
                    let (raw, hashed) = plain_read().await?;
                    r_lim.push(raw);
                    v_lim.push(hashed);
                }
            }
            rows.push(row(
                "offload",
                model,
                block_bytes,
                (depth, ask),
                n,
                &lats.0,
                &off,
                &w_lim,
                backend,
            ));
            let mut onboard =
                row("onboard", model, block_bytes, (depth, ask), n, &lats.1, &on, &r_lim, backend);
            onboard.verified_limit_gbps = Some(median(&v_lim));
            onboard.ratio_to_verified_limit = Some(median(&paired_ratios(&on, &v_lim)));
            rows.push(onboard);
            let mut prefix =
                row("prefix", model, block_bytes, (depth, ask), n, &lats.2, &pre, &r_lim, backend);
            prefix.verified_limit_gbps = Some(median(&v_lim));
            prefix.ratio_to_verified_limit = Some(median(&paired_ratios(&pre, &v_lim)));
            rows.push(prefix);
            let _ = std::fs::remove_file(&slots);
            let _ = std::fs::remove_file(&limit_path);
            let plain_id = plain_memory.id();
            drop(plain_memory);
            agent.deregister(plain_id)?;
        }
    }
    if let Some(path) = &args.plot {
        std::fs::write(path, plot_rows(&rows))
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if args.json {
        for r in &rows {
            println!("{}", serde_json::to_string(r)?);
        }
        return Ok(());
    }
    println!(
        "{:>8} {:>14} {:>9} {:>5} {:>4} {:>6} {:>7} {:>10} {:>10} {:>10} {:>6} {:>12} {:>8}",
        "op",
        "model",
        "block",
        "depth",
        "out",
        "blocks",
        "GB/s",
        "p50",
        "p99",
        "limit GB/s",
        "ratio",
        "+XXH3 GB/s",
        "ratio"
    );
    for r in &rows {
        println!(
            "{:>8} {:>14} {:>7}Ki {:>5} {:>4} {:>6} {:>7.2} {:>8.0}µs {:>8.0}µs {:>10.2} {:>5.2}× {:>12} {:>8}",
            r.op,
            r.model,
            r.block_bytes >> 10,
            r.depth,
            r.outstanding,
            r.blocks,
            r.gbps,
            r.p50_us,
            r.p99_us,
            r.limit_gbps,
            r.ratio_to_limit,
            r.verified_limit_gbps.map_or("-".into(), |g| format!("{g:.2}")),
            r.ratio_to_verified_limit.map_or("-".into(), |x| format!("{x:.2}×")),
        );
    }
    if rows.iter().any(|r| r.io_backend == "cuda") {
        println!("G1 rows (g1->g2, g2->g1): limit = raw cuMemcpy*Async of the same blocks between GPU memory and pinned host memory, same run");
    }
    println!("limit: plain O_DIRECT sequential I/O of the same bytes, same request size, same queue depth and requests outstanding, same run ({}); ratio: median over repetitions of store rate / plain rate, each pair back to back; +XXH3: plain reads that also hash each block, as the store's verification does", rows.iter().find(|r| r.io_backend != "cuda").map_or("", |r| r.io_backend));
    Ok(())
}

/// GB/s against queue depth, a panel per operation: a line per model (block size) and its
/// plain I/O limit (dashed).
fn plot_rows(rows: &[Row]) -> String {
    use crate::plot::{distinct, render, Chart, Series};
    let ops = distinct(rows.iter().map(|r| r.op));
    let charts: Vec<Chart> = ops
        .iter()
        .map(|&op| {
            let models = distinct(
                rows.iter().filter(|r| r.op == op).map(|r| (r.model.as_str(), r.block_bytes)),
            );
            let mut series = Vec::new();
            for (m, b) in models {
                let of = || rows.iter().filter(move |r| r.op == op && r.model == m);
                let name = format!("{m} ({} KiB)", b >> 10);
                series.push(Series::line(
                    name.clone(),
                    of().map(|r| (r.depth as f64, r.gbps)).collect(),
                ));
                series.push(Series {
                    dashed: true,
                    color_of: Some(series.len() - 1),
                    ..Series::line(
                        format!("{name} limit"),
                        of().map(|r| (r.depth as f64, r.limit_gbps)).collect(),
                    )
                });
            }
            Chart {
                title: format!("{op}: GB/s by queue depth"),
                x_label: "queue depth".into(),
                y_label: "GB/s".into(),
                x_log2: true,
                x_bytes: false,
                series,
            }
        })
        .collect();
    render(&charts, 2)
}

#[allow(clippy::too_many_arguments)]
fn row(
    op: &'static str,
    model: &str,
    block_bytes: u64,
    (depth, outstanding): (usize, usize),
    n: u64,
    lat: &[Duration],
    rates: &[f64],
    limits: &[f64],
    backend: &'static str,
) -> Row {
    let ratios = paired_ratios(rates, limits);
    let p = Percentiles::of(lat);
    Row {
        op,
        model: model.to_string(),
        block_bytes,
        depth,
        outstanding,
        blocks: n,
        gbps: median(rates),
        p50_us: p.p50_us,
        p99_us: p.p99_us,
        limit_gbps: median(limits),
        ratio_to_limit: median(&ratios),
        ratio_reps: ratios,
        verified_limit_gbps: None,
        ratio_to_verified_limit: None,
        io_backend: backend,
    }
}

/// Each repetition's store rate / limit rate. Ratios are taken per repetition (the store and
/// the plain I/O ran back to back, on the same machine state) and then their median is
/// reported: the disk's rate drifts by tens of percent between repetitions on a shared VM, and
/// a ratio of medians would mix states.
fn paired_ratios(rates: &[f64], limits: &[f64]) -> Vec<f64> {
    rates.iter().zip(limits).map(|(r, l)| r / l).collect()
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Runs `f` for every hash with `depth` in flight; per-call latencies and total time.
async fn timed<F, Fut>(
    hashes: &[SequenceHash],
    depth: usize,
    f: F,
) -> crate::Result<(Vec<Duration>, Duration)>
where
    F: Fn(SequenceHash) -> Fut,
    Fut: std::future::Future<Output = crate::Result<()>>,
{
    let start = Instant::now();
    let results: Vec<crate::Result<Duration>> = stream::iter(hashes.iter().copied())
        .map(|h| {
            let fut = f(h);
            async move {
                let t = Instant::now();
                fut.await?;
                Ok(t.elapsed())
            }
        })
        .buffer_unordered(depth)
        .collect()
        .await;
    let elapsed = start.elapsed();
    let lat = results.into_iter().collect::<crate::Result<Vec<_>>>()?;
    Ok((lat, elapsed))
}

/// G1 ↔ G2 rows: per model and depth, a store with a device tier on GPU 0 of `n` blocks and
/// a host tier of `2n`. `g1->g2`: G1 full, `n` new blocks allocated `depth` at a time, each
/// moving a G1 block down (D2H). `g2->g1`: `n` blocks in host memory brought up into free
/// G1 slots with `get_device`, `depth` per call (H2D). Limit: the same blocks copied with raw
/// `cuMemcpy*Async` between a device buffer and pinned host memory, `depth` per synchronize.
async fn g1_rows(args: &TierArgs, agent: &Agent) -> crate::Result<Vec<Row>> {
    use kvfabric_tiers::store::{DeviceSlots, DeviceTierConfig};
    let cuda = kvfabric::cuda::probe()?;
    let dev = cuda.device(0)?;
    let stream = dev.stream()?;
    let mut rows = Vec::new();
    for model in &args.models {
        let spec = ModelSpec::preset(model)?;
        let block_bytes = spec.block_layout(args.block_tokens)?.bytes_per_block();
        let n = ((args.total_mib << 20) / block_bytes).max(8);
        let stride = align_up(block_bytes);
        let raw_dev = dev.alloc((stride * n) as usize)?;
        let raw_host = dev.alloc_pinned((stride * n) as usize)?;
        for &depth in &args.depths {
            eprintln!("{model}: G1 <-> G2, {} KiB blocks × {n}, depth {depth}", block_bytes >> 10);
            let (mut down, mut up, mut d_lim, mut u_lim) =
                (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            let (mut d_lat, mut u_lat) = (Vec::new(), Vec::new());
            for _ in 0..args.reps.max(1) {
                let mut cfg = StoreConfig::new(block_bytes, (2 * n) as u32);
                cfg.shared_host = false;
                cfg.device = Some(DeviceTierConfig {
                    blocks: n as u32,
                    slots: DeviceSlots::Allocate { ordinal: 0 },
                });
                let store = TieredStore::open(cfg, agent, Arc::new(NullSink)).await?;
                let first: Vec<SequenceHash> =
                    (0..n).map(|i| SequenceHash(0x91_0000 + i)).collect();
                let second: Vec<SequenceHash> =
                    (0..n).map(|i| SequenceHash(0x92_0000 + i)).collect();
                for &h in &first {
                    drop(store.allocate_device(h, None).await?.commit());
                }
                let (lat, elapsed) = timed(&second, depth, |h| {
                    let store = store.clone();
                    async move {
                        drop(store.allocate_device(h, None).await?.commit());
                        Ok(())
                    }
                })
                .await?;
                down.push(gbps(block_bytes * n, elapsed));
                d_lat.extend(lat);
                // `first` is in host memory now; G1 holds `second`, which goes, so that the
                // onboarding below measures H2D into free slots (evictions are the row above).
                for &h in &second {
                    store.remove(h).await;
                }
                crate::ensure!(store.device_occupancy().0 == 0, "G1 not emptied");
                // Up again, `depth` per call.
                let start = Instant::now();
                for chunk in first.chunks(depth) {
                    let t = Instant::now();
                    let got = store.get_device(chunk).await?;
                    crate::ensure!(got.len() == chunk.len(), "prefix not brought up to G1");
                    u_lat.push(t.elapsed());
                }
                up.push(gbps(block_bytes * n, start.elapsed()));
                drop(store);
                // The limits, on the same block size and batch.
                for (d2h, out) in [(true, &mut d_lim), (false, &mut u_lim)] {
                    let start = Instant::now();
                    for chunk in (0..n).collect::<Vec<_>>().chunks(depth) {
                        for &i in chunk {
                            let (h, d) = (
                                raw_host.as_ptr().wrapping_add((i * stride) as usize),
                                raw_dev.ptr() + i * stride,
                            );
                            // SAFETY: block i lies inside both buffers (n × stride bytes), which
                            // outlive the synchronize below.
                            unsafe {
                                if d2h {
                                    stream.copy_d2h(h, d, block_bytes as usize)?;
                                } else {
                                    stream.copy_h2d(d, h, block_bytes as usize)?;
                                }
                            }
                        }
                        stream.synchronize()?;
                    }
                    out.push(gbps(block_bytes * n, start.elapsed()));
                }
            }
            rows.push(row(
                "g1->g2",
                model,
                block_bytes,
                (depth, depth),
                n,
                &d_lat,
                &down,
                &d_lim,
                "cuda",
            ));
            rows.push(row(
                "g2->g1",
                model,
                block_bytes,
                (depth, depth),
                n,
                &u_lat,
                &up,
                &u_lim,
                "cuda",
            ));
        }
    }
    Ok(rows)
}
