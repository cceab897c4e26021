//! `kvfabric bench transfer`: READ and WRITE between this process and a peer process (this
//! binary's `peer` command) over shm and tcp, for a matrix of descriptor sizes and batch
//! sizes. In the same run it measures the machine's limits for the same bytes: a
//! single-thread memcpy (the bound for shm) and a plain blocking TCP socket pair on loopback
//! (the bound for tcp), both moving one contiguous buffer per iteration. Transport `cuda`
//! adds H2D, D2H and D2D rows against raw `cuMemcpy*Async` of the same bytes
//! ([`super::cuda`]); without CUDA it says why and runs the other transports.

use crate::Host;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

use crate::Context;
use clap::Args;
use kvfabric::agent::Agent;
use kvfabric::memory::RegionOptions;
use kvfabric::transfer::{Desc, TransferOp, TransferRequest, TransportKind};
use kvfabric_planner::stats::gbps;

use crate::measure::{combos, measure_posts, measure_sync, rand_u64, spawn_peer, Row};
use crate::{parse_size, short_size};

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum TransportArg {
    Shm,
    Tcp,
    /// H2D, D2H and D2D copies on GPU 0 (needs an NVIDIA GPU and driver).
    Cuda,
    /// One-sided verbs READ/WRITE to the peer process (needs an RDMA device).
    Rdma,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum OpArg {
    Read,
    Write,
}

#[derive(Debug, Args)]
pub struct TransferArgs {
    /// Descriptor sizes, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "4K,16K,64K,1M,16M,64M")]
    sizes: Vec<String>,
    /// Descriptors per transfer, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,16,256,1024,4096")]
    batches: Vec<usize>,
    /// Transports.
    #[arg(long, value_delimiter = ',', value_enum, default_value = "shm,tcp")]
    transports: Vec<TransportArg>,
    /// Operations.
    #[arg(long, value_delimiter = ',', value_enum, default_value = "write,read")]
    ops: Vec<OpArg>,
    /// Largest transfer, MiB (combinations above it are skipped); also the region size.
    #[arg(long, default_value_t = 256)]
    max_transfer_mib: u64,
    /// Minimum measuring time per row, milliseconds.
    #[arg(long, default_value_t = 300)]
    min_time_ms: u64,
    /// Checksum every descriptor.
    #[arg(long)]
    checksum: bool,
    /// TCP connections per peer.
    #[arg(long, default_value_t = 4)]
    tcp_stripes: usize,
    /// TCP transfers are cut into pieces of this size, spread over the connections.
    #[arg(long, default_value = "256K")]
    tcp_stripe_bytes: String,
    /// Also measure TCP with mutual TLS (certificates of a throwaway CA, made for this run):
    /// `tcp-tls` rows, against one core's AES-256-GCM rate measured on the same bytes, with
    /// the plain socket's rate beside it.
    #[arg(long)]
    tls: bool,
    /// RDMA rows between GPU memory on both sides (GPUDirect RDMA: GPU 0 here and in the
    /// peer), against the plain verbs loop between two GPU buffers; only `--transports rdma`.
    #[arg(long)]
    gpu: bool,
    /// Print one JSON object per row instead of a table.
    #[arg(long)]
    json: bool,
    /// Also plot GB/s against descriptor size per transport and batch, with each
    /// transport's limit measured in the same run, to this SVG file.
    #[arg(long)]
    plot: Option<std::path::PathBuf>,
}

/// A plain blocking TCP socket pair on loopback: a sink thread reads length-prefixed
/// buffers and acknowledges each with one byte.
struct PlainSocket {
    stream: TcpStream,
}

impl PlainSocket {
    fn start(max_bytes: usize) -> crate::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        std::thread::spawn(move || -> std::io::Result<()> {
            let (mut s, _) = listener.accept()?;
            s.set_nodelay(true)?;
            let mut buf = vec![0u8; max_bytes];
            loop {
                let mut len = [0u8; 8];
                s.read_exact(&mut len)?;
                let n = u64::from_le_bytes(len) as usize;
                s.read_exact(&mut buf[..n.min(max_bytes)])?;
                s.write_all(&[1])?;
            }
        });
        let stream = TcpStream::connect(addr)?;
        stream.set_nodelay(true)?;
        Ok(PlainSocket { stream })
    }

    fn send(&mut self, bytes: &[u8]) -> crate::Result<()> {
        self.stream.write_all(&(bytes.len() as u64).to_le_bytes())?;
        self.stream.write_all(bytes)?;
        let mut ack = [0u8; 1];
        self.stream.read_exact(&mut ack)?;
        Ok(())
    }
}

pub async fn run(args: TransferArgs, host: &Host) -> crate::Result<()> {
    let sizes = args.sizes.iter().map(|s| parse_size(s)).collect::<crate::Result<Vec<u64>>>()?;
    crate::ensure!(args.batches.iter().all(|&b| b >= 1), "--batches must be >= 1");
    let transports: Vec<TransportKind> = args
        .transports
        .iter()
        .filter_map(|t| match t {
            TransportArg::Shm => Some(TransportKind::Shm),
            TransportArg::Tcp => Some(TransportKind::Tcp),
            TransportArg::Rdma => Some(TransportKind::Rdma),
            TransportArg::Cuda => None,
        })
        .collect();
    let with_cuda = args.transports.iter().any(|t| matches!(t, TransportArg::Cuda));
    let ops: Vec<TransferOp> = args
        .ops
        .iter()
        .map(|o| match o {
            OpArg::Read => TransferOp::Read,
            OpArg::Write => TransferOp::Write,
        })
        .collect();
    crate::ensure!(args.max_transfer_mib >= 1, "--max-transfer-mib must be >= 1");
    crate::ensure!(
        !args.gpu || transports == [TransportKind::Rdma] && !with_cuda,
        "--gpu measures GPUDirect RDMA: use it with --transports rdma alone"
    );
    if args.gpu {
        kvfabric::cuda::available().context("bench transfer --gpu")?;
    }
    let region_bytes = (args.max_transfer_mib << 20) as usize;
    let min_time = Duration::from_millis(args.min_time_ms.max(1));

    let mut rows = Vec::new();
    if with_cuda {
        match crate::cuda::rows(host, &sizes, &args.batches, region_bytes, min_time).await {
            Ok(r) => rows.extend(r),
            // Without CUDA, say so; with nothing else to measure, that is the command's error.
            Err(e) if transports.is_empty() => {
                return Err(crate::BenchError::Step {
                    what: "bench transfer --transports cuda".into(),
                    source: Box::new(e),
                })
            }
            Err(e) => eprintln!("bench transfer: skipping the cuda rows: {e:#}"),
        }
    }
    if transports.is_empty() {
        return print_rows(&rows, args.json);
    }

    let secret = format!("{:016x}{:016x}", rand_u64(), rand_u64());
    let device_bytes = region_bytes.to_string();
    let extra: &[&str] = if args.gpu { &["--device-bytes", &device_bytes] } else { &[] };
    let (mut child, peer_md) = spawn_peer(host, &secret, region_bytes, extra).await?;
    let mut cfg = host.agent_config("bench", secret.clone().into_bytes());
    cfg.tcp_connections_per_peer = args.tcp_stripes;
    cfg.tcp_stripe_bytes = parse_size(&args.tcp_stripe_bytes)?;
    let agent = Agent::start(cfg).await?;
    agent.load_peer(peer_md.clone())?;
    // RDMA needs a device on both sides: without one, say why and measure the rest.
    let mut transports = transports;
    let mut rdma_loop = None;
    if transports.contains(&TransportKind::Rdma) {
        let why = if !peer_md.transports.contains(&TransportKind::Rdma) {
            Some(format!("the peer has no RDMA: {}", peer_md.rdma))
        } else if !matches!(agent.rdma_status(), kvfabric::endpoint::RdmaStatus::Device { .. }) {
            Some(agent.rdma_status().to_string())
        } else if args.gpu && !reaches_gpu(agent.rdma_status()) {
            Some(format!("this agent's adapter does not reach GPU memory: {}", agent.rdma_status()))
        } else if args.gpu && !reaches_gpu(&peer_md.rdma) {
            Some(format!("the peer's adapter does not reach GPU memory: {}", peer_md.rdma))
        } else {
            use kvfabric::transport::rdma::raw::PlainLoop;
            let plain = if args.gpu {
                PlainLoop::gpu(&Default::default(), region_bytes, 0)
            } else {
                PlainLoop::new(&Default::default(), region_bytes)
            };
            match plain {
                Ok(l) => {
                    rdma_loop = Some(l);
                    None
                }
                Err(e) => Some(format!("the plain verbs loop: {e}")),
            }
        };
        if let Some(why) = why {
            transports.retain(|&t| t != TransportKind::Rdma);
            crate::ensure!(
                !transports.is_empty() || !rows.is_empty(),
                "bench transfer --transports rdma: {why}"
            );
            eprintln!("bench transfer: skipping the rdma rows: {why}");
        }
    }
    if transports.is_empty() {
        let _ = child.start_kill();
        return print_rows(&rows, args.json);
    }
    let (local, remote_id) = if args.gpu {
        let remote = peer_md.regions.iter().find(|r| r.kind != kvfabric::memory::MemoryKind::Host);
        (
            agent.alloc_device_region(0, region_bytes, false)?,
            remote.context("the peer exported no GPU region")?.id,
        )
    } else {
        let local = agent.alloc_region(region_bytes, RegionOptions::default())?;
        local.fill(0, region_bytes as u64, 0x5a)?;
        (local, peer_md.regions.first().context("peer exported no region")?.id)
    };

    // The machine's limits, measured on the same bytes.
    let src = vec![0x5au8; region_bytes];
    let mut dst = vec![0u8; region_bytes];
    let mut plain = PlainSocket::start(region_bytes)?;
    // With --tls: a second peer and agent, both with mutual TLS, for `tcp-tls` rows.
    let mut tls_pair = None;
    if args.tls && transports.contains(&TransportKind::Tcp) {
        let ca = kvfabric::testkit::TestCa::new("bench transfer").context("a throwaway CA")?;
        let cert = ca.issue(&["127.0.0.1"]).context("a certificate")?;
        let (c, k, a) = (
            cert.cert.display().to_string(),
            cert.key.display().to_string(),
            ca.ca().display().to_string(),
        );
        let tls_args = ["--tls-cert", &c, "--tls-key", &k, "--tls-ca", &a];
        let (child, md) = spawn_peer(host, &secret, region_bytes, &tls_args).await?;
        let mut cfg = host.agent_config("bench-tls", secret.clone());
        cfg.tcp_connections_per_peer = args.tcp_stripes;
        cfg.tcp_stripe_bytes = parse_size(&args.tcp_stripe_bytes)?;
        cfg.shm = false;
        cfg.tls = Some(
            kvfabric::tls::Tls::load(kvfabric::tls::TlsFiles {
                cert: cert.cert.clone(),
                key: cert.key.clone(),
                ca: Some(ca.ca()),
                client_ca: None,
            })
            .map_err(|e| crate::failed!("{e}"))?,
        );
        let tls_agent = Agent::start(cfg).await?;
        tls_agent.load_peer(md.clone())?;
        let local = tls_agent.alloc_region(region_bytes, RegionOptions::default())?;
        local.fill(0, region_bytes as u64, 0x5a)?;
        let remote = md.regions.first().context("the TLS peer exported no region")?.id;
        tls_pair = Some((child, md, tls_agent, local, remote, ca));
    }
    let mut aes = AesGcm::new();

    let combos = combos(&sizes, &args.batches, region_bytes as u64);
    let total_rows = combos.len() * transports.len() * ops.len();
    let mut done = 0usize;
    for &(desc, batch) in &combos {
        let bytes = desc * batch as u64;
        let n = bytes as usize;
        let memcpy_lat = measure_sync(min_time, || {
            dst[..n].copy_from_slice(&src[..n]);
            std::hint::black_box(&dst);
            Ok(())
        })?;
        let memcpy_gbps = gbps(bytes * memcpy_lat.len() as u64, memcpy_lat.iter().sum());
        let aes_gcm_gbps = if tls_pair.is_some() {
            let mut buf = src[..n].to_vec();
            let lat = measure_sync(min_time, || {
                aes.seal(&mut buf);
                Ok(())
            })?;
            gbps(bytes * lat.len() as u64, lat.iter().sum())
        } else {
            f64::NAN
        };
        let sock_lat = measure_sync(min_time, || plain.send(&src[..n]))?;
        let tcp_socket_gbps = gbps(bytes * sock_lat.len() as u64, sock_lat.iter().sum());
        // The plain verbs loop of the same bytes, per op (RDMA rows only).
        let mut verbs_gbps = [f64::NAN; 2];
        if let Some(l) = rdma_loop.as_mut() {
            for (i, read) in [false, true].into_iter().enumerate() {
                let lat = measure_sync(min_time, || {
                    l.run(read, desc, batch).map_err(|e| crate::failed!("{e}"))
                })?;
                verbs_gbps[i] = gbps(bytes * lat.len() as u64, lat.iter().sum());
            }
        }
        let descs: Vec<Desc> =
            (0..batch as u64).map(|i| Desc::new(local.id(), i * desc, desc)).collect();
        let rdescs: Vec<Desc> =
            (0..batch as u64).map(|i| Desc::new(remote_id, i * desc, desc)).collect();
        for &transport in &transports {
            for &op in &ops {
                done += 1;
                eprintln!(
                    "[{done}/{total_rows}] {transport} {} {}×{batch}",
                    kvfabric::agent::op_name(op),
                    short_size(desc)
                );
                let mut req =
                    TransferRequest::new(op, &peer_md.name, descs.clone(), rdescs.clone())
                        .with_transport(transport)
                        .with_deadline(Duration::from_secs(60));
                req.checksum = args.checksum;
                let lat = measure_posts(&agent, &req, min_time).await?;
                let limit = match transport {
                    TransportKind::Tcp => ("tcp_socket", tcp_socket_gbps),
                    TransportKind::Rdma => (
                        if args.gpu { "verbs_loop_gpu" } else { "verbs_loop" },
                        verbs_gbps[usize::from(op == TransferOp::Read)],
                    ),
                    _ => ("memcpy", memcpy_gbps),
                };
                let name = if args.gpu { "rdma-gpu" } else { transport.name() };
                rows.push(Row {
                    memcpy_gbps,
                    tcp_socket_gbps,
                    checksum: args.checksum,
                    ..Row::measured(
                        (name, kvfabric::agent::op_name(op)),
                        (desc, batch),
                        &lat,
                        limit,
                    )
                });
                if let (TransportKind::Tcp, Some((_, md, tls_agent, local, remote, _))) =
                    (transport, &tls_pair)
                {
                    let descs: Vec<Desc> =
                        (0..batch as u64).map(|i| Desc::new(local.id(), i * desc, desc)).collect();
                    let rdescs: Vec<Desc> =
                        (0..batch as u64).map(|i| Desc::new(*remote, i * desc, desc)).collect();
                    let mut req = TransferRequest::new(op, &md.name, descs, rdescs)
                        .with_transport(TransportKind::Tcp)
                        .with_deadline(Duration::from_secs(60));
                    req.checksum = args.checksum;
                    let lat = measure_posts(tls_agent, &req, min_time).await?;
                    rows.push(Row {
                        memcpy_gbps,
                        tcp_socket_gbps,
                        checksum: args.checksum,
                        ..Row::measured(
                            ("tcp-tls", kvfabric::agent::op_name(op)),
                            (desc, batch),
                            &lat,
                            ("aes_gcm_1core", aes_gcm_gbps),
                        )
                    });
                }
            }
        }
    }
    if let Some((mut child, ..)) = tls_pair {
        let _ = child.start_kill();
    }
    let _ = child.start_kill();
    if let Some(path) = &args.plot {
        std::fs::write(path, plot_rows(&rows))
            .with_context(|| format!("writing {}", path.display()))?;
    }
    print_rows(&rows, args.json)
}

/// Whether an agent's RDMA status says its adapter reaches GPU memory.
fn reaches_gpu(status: &kvfabric::endpoint::RdmaStatus) -> bool {
    matches!(status, kvfabric::endpoint::RdmaStatus::Device { gpu: Some(_), .. })
}

/// GB/s against descriptor size, a panel per operation: a line per transport and batch, and
/// each transport's limit (dashed).
pub(super) fn plot_rows(rows: &[Row]) -> String {
    use crate::plot::{distinct, render, Chart, Series};
    let ops = distinct(rows.iter().map(|r| r.op));
    let charts: Vec<Chart> = ops
        .iter()
        .map(|&op| {
            let keys = distinct(rows.iter().filter(|r| r.op == op).map(|r| (r.transport, r.batch)));
            let mut series: Vec<Series> = keys
                .iter()
                .map(|&(t, b)| {
                    let pts = rows
                        .iter()
                        .filter(|r| r.op == op && r.transport == t && r.batch == b)
                        .map(|r| (r.desc_bytes as f64, r.gbps))
                        .collect();
                    Series::line(format!("{t}, batch {b}"), pts)
                })
                .collect();
            for t in distinct(keys.iter().map(|k| k.0)) {
                // One limit per size: the best of the batches' (each row measured its own).
                let mut best = std::collections::BTreeMap::<u64, f64>::new();
                for r in rows.iter().filter(|r| r.op == op && r.transport == t) {
                    let e = best.entry(r.desc_bytes).or_insert(0.0);
                    *e = e.max(r.limit_gbps);
                }
                let pts = best.into_iter().map(|(d, g)| (d as f64, g)).collect();
                series.push(Series { dashed: true, ..Series::line(format!("{t} limit"), pts) });
            }
            Chart {
                title: format!("{op}: throughput by descriptor size"),
                x_label: "descriptor size, bytes".into(),
                y_label: "GB/s".into(),
                x_log2: true,
                x_bytes: true,
                series,
            }
        })
        .collect();
    render(&charts, 2)
}

fn print_rows(rows: &[Row], json: bool) -> crate::Result<()> {
    if json {
        for r in rows {
            println!("{}", serde_json::to_string(r)?);
        }
        return Ok(());
    }
    println!(
        "{:>9} {:>5} {:>6} {:>5} {:>8} {:>8} {:>10} {:>10} {:>10} {:>7}",
        "transport", "op", "desc", "batch", "total", "GB/s", "p50", "p99", "limit GB/s", "ratio"
    );
    for r in rows {
        println!(
            "{:>9} {:>5} {:>6} {:>5} {:>8} {:>8.2} {:>8.1}µs {:>8.1}µs {:>10.2} {:>6.2}×",
            r.transport,
            r.op,
            short_size(r.desc_bytes),
            r.batch,
            short_size(r.bytes),
            r.gbps,
            r.p50_us,
            r.p99_us,
            r.limit_gbps,
            r.ratio_to_limit
        );
    }
    if rows.iter().any(|r| r.transport == "tcp-tls") {
        println!("tcp-tls: mutual TLS (TLS 1.3, AES-256-GCM) against one core's AES-256-GCM sealing of the same bytes in 16 KiB records; the plain socket's GB/s for the same bytes:");
        for r in rows.iter().filter(|r| r.transport == "tcp-tls") {
            let plain = rows.iter().find(|p| {
                p.transport == "tcp"
                    && p.op == r.op
                    && p.desc_bytes == r.desc_bytes
                    && p.batch == r.batch
            });
            println!(
                "  {} {}×{}: tcp-tls {:.2} GB/s = {:.2}× tcp ({:.2}), {:.2}× the plain socket ({:.2}), {:.2}× AES-GCM ({:.2})",
                r.op,
                short_size(r.desc_bytes),
                r.batch,
                r.gbps,
                plain.map_or(f64::NAN, |p| r.gbps / p.gbps),
                plain.map_or(f64::NAN, |p| p.gbps),
                r.gbps / r.tcp_socket_gbps,
                r.tcp_socket_gbps,
                r.ratio_to_limit,
                r.limit_gbps
            );
        }
    }
    println!("limits: shm against single-thread memcpy, tcp against a plain blocking loopback socket, rdma against a plain verbs loop (the same WRITEs or READs posted as one chain between two queue pairs of the device), cuda against one raw cuMemcpy*Async of the same bytes, same run");
    Ok(())
}

/// One core sealing bytes with AES-256-GCM in TLS-sized records (16 KiB, a tag each): the
/// cipher's rate bounds what TLS moves per core.
struct AesGcm {
    key: ring::aead::LessSafeKey,
    counter: u64,
}

impl AesGcm {
    fn new() -> Self {
        let key = ring::aead::UnboundKey::new(&ring::aead::AES_256_GCM, &[7u8; 32])
            .unwrap_or_else(|_| unreachable!("a 32-byte key is valid for AES-256-GCM"));
        AesGcm { key: ring::aead::LessSafeKey::new(key), counter: 0 }
    }

    fn seal(&mut self, buf: &mut [u8]) {
        for record in buf.chunks_mut(16 << 10) {
            self.counter += 1;
            let mut nonce = [0u8; 12];
            nonce[4..].copy_from_slice(&self.counter.to_be_bytes());
            let nonce = ring::aead::Nonce::assume_unique_for_key(nonce);
            let tag = self.key.seal_in_place_separate_tag(nonce, ring::aead::Aad::empty(), record);
            std::hint::black_box(&tag);
        }
    }
}
