//! The RDMA transport between agents.
//!
//! Without an RDMA device (this project's CI machines: their kernel has no InfiniBand, so
//! neither `rdma_rxe` nor `siw` can run) one test runs: the agent says why it has no RDMA, in
//! its status and its metadata, and moves bytes between hosts over TCP. The others need a
//! device and are ignored here, with that reason; `scripts/rdma-check.sh` runs them on a host
//! that has one (`--run-ignored only`).

use std::time::Duration;

use kvfabric::agent::{Agent, AgentConfig};
use kvfabric::endpoint::RdmaStatus;
use kvfabric::memory::{Region, RegionOptions};
use kvfabric::transfer::{Desc, TransferError, TransferOp, TransferRequest, TransportKind};

const SECRET: &[u8] = b"rdma-secret";

/// An agent that offers no shm: between two of them in one process, the transport is what
/// two hosts would use.
async fn agent(name: &str) -> Agent {
    let mut cfg = AgentConfig::new(name, SECRET);
    cfg.shm = false;
    Agent::start(cfg).await.unwrap()
}

fn exported() -> RegionOptions {
    RegionOptions { shared: false, export: true, huge_pages: false }
}

fn pattern(r: &Region, seed: u8) {
    let bytes: Vec<u8> = (0..r.len()).map(|i| (i as u64 * 131 + u64::from(seed)) as u8).collect();
    r.write_at(0, &bytes).unwrap();
}

fn bytes(r: &Region, off: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0; len];
    r.read_at(off, &mut v).unwrap();
    v
}

fn link(a: &Agent, b: &Agent) {
    a.load_peer(b.metadata()).unwrap();
    b.load_peer(a.metadata()).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_device_the_agent_says_why_and_uses_tcp() {
    if let Ok(devices) = kvfabric::transport::rdma::availability() {
        eprintln!("SKIPPED: this host has RDMA devices ({devices:?}); the ignored tests cover it");
        return;
    }
    let (a, b) = (agent("a").await, agent("b").await);
    let RdmaStatus::Unavailable { reason } = a.rdma_status().clone() else {
        panic!("no device, yet the status is {:?}", a.rdma_status());
    };
    assert!(reason.contains("RDMA") || reason.contains("libibverbs"), "{reason}");
    let md = a.metadata();
    assert_eq!(md.rdma, RdmaStatus::Unavailable { reason: reason.clone() });
    assert!(!md.transports.contains(&TransportKind::Rdma), "{:?}", md.transports);
    // The metadata carries it to peers.
    let back = kvfabric::endpoint::AgentMetadata::from_bytes(&md.to_bytes()).unwrap();
    assert_eq!(back.rdma, md.rdma);

    let src = a.alloc_region(1 << 20, RegionOptions::default()).unwrap();
    let dst = b.alloc_region(1 << 20, exported()).unwrap();
    link(&a, &b);
    let req = whole(TransferOp::Write, &src, &dst);
    assert_eq!(a.transport_for(&req).unwrap(), TransportKind::Tcp);
    let Err(TransferError::NoTransport { reason: why, .. }) =
        a.transport_for(&req.clone().with_transport(TransportKind::Rdma))
    else {
        panic!("asking for rdma without a device must be refused");
    };
    assert!(why.starts_with("rdma: this agent has none") && why.contains(&reason), "{why}");
    pattern(&src, 5);
    a.post(req).unwrap().wait().await.unwrap();
    assert_eq!(bytes(&dst, 0, 1 << 20), bytes(&src, 0, 1 << 20));
    let tcp = a.transfer_counts().into_iter().find(|c| c.transport == TransportKind::Tcp).unwrap();
    assert_eq!((tcp.done, tcp.bytes), (1, 1 << 20));
    let rdma =
        a.transfer_counts().into_iter().find(|c| c.transport == TransportKind::Rdma).unwrap();
    assert_eq!(rdma.done + rdma.failed, 0);

    // An agent with RDMA turned off says so, not a device problem.
    let mut cfg = AgentConfig::new("c", SECRET);
    cfg.rdma = None;
    let c = Agent::start(cfg).await.unwrap();
    assert_eq!(c.metadata().rdma, RdmaStatus::Off);
}

const NEEDS_DEVICE: &str = "needs an RDMA device";

/// Two agents on the device: WRITE and READ, with and without checksums, a notification after
/// the last byte, scattered descriptors and one larger than a work request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: scripts/rdma-check.sh runs it"]
async fn write_and_read_over_rdma_arrive_intact() {
    let (a, b) = (agent("a").await, agent("b").await);
    assert!(
        matches!(a.rdma_status(), RdmaStatus::Device { .. }),
        "{NEEDS_DEVICE}: {}",
        a.rdma_status()
    );
    let src = a.alloc_region(8 << 20, RegionOptions::default()).unwrap();
    let dst = b.alloc_region(8 << 20, exported()).unwrap();
    link(&a, &b);
    let sizes = [1u64, 4095, 65_536, 5 << 20];
    let (mut local, mut remote) = (vec![], vec![]);
    let mut off = 0u64;
    for &s in &sizes {
        local.push(Desc::new(src.id(), off, s));
        remote.push(Desc::new(dst.id(), off + 3, s));
        off += s + 100;
    }
    for checksum in [false, true] {
        pattern(&src, 9);
        dst.fill(0, 8 << 20, 0).unwrap();
        let mut req = TransferRequest::new(TransferOp::Write, "b", local.clone(), remote.clone())
            .with_notify(b"written".to_vec());
        req.checksum = checksum;
        assert_eq!(a.transport_for(&req).unwrap(), TransportKind::Rdma);
        a.post(req).unwrap().wait().await.unwrap();
        let n = tokio::time::timeout(Duration::from_secs(5), b.next_notification())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(n.message, b"written");
        for (l, r) in local.iter().zip(&remote) {
            assert_eq!(
                bytes(&src, l.offset, l.len as usize),
                bytes(&dst, r.offset, r.len as usize)
            );
        }
        src.fill(0, 8 << 20, 0xee).unwrap();
        let mut req = TransferRequest::new(TransferOp::Read, "b", local.clone(), remote.clone());
        req.checksum = checksum;
        a.post(req).unwrap().wait().await.unwrap();
        for (l, r) in local.iter().zip(&remote) {
            assert_eq!(
                bytes(&src, l.offset, l.len as usize),
                bytes(&dst, r.offset, r.len as usize)
            );
        }
    }
    let rdma =
        a.transfer_counts().into_iter().find(|c| c.transport == TransportKind::Rdma).unwrap();
    assert_eq!(rdma.done, 4);
}

/// A peer that is gone (its agent dropped: queue pairs destroyed) fails the transfer with a
/// typed error within the adapter's retry time, and a live peer works again after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: scripts/rdma-check.sh runs it"]
async fn a_dead_peer_fails_rdma_transfers_typed() {
    let a = agent("a").await;
    assert!(
        matches!(a.rdma_status(), RdmaStatus::Device { .. }),
        "{NEEDS_DEVICE}: {}",
        a.rdma_status()
    );
    let src = a.alloc_region(1 << 20, RegionOptions::default()).unwrap();
    let dst_id = {
        let b = agent("b").await;
        let dst = b.alloc_region(1 << 20, exported()).unwrap();
        link(&a, &b);
        let req = whole(TransferOp::Write, &src, &dst);
        assert_eq!(a.transport_for(&req).unwrap(), TransportKind::Rdma);
        a.post(req).unwrap().wait().await.unwrap();
        b.shutdown();
        dst.id()
    };
    // `a` still holds the old connection's queue pairs and keys; b's are gone.
    let req = TransferRequest::new(
        TransferOp::Write,
        "b",
        vec![Desc::new(src.id(), 0, 1 << 20)],
        vec![Desc::new(dst_id, 0, 1 << 20)],
    )
    .with_deadline(Duration::from_secs(10));
    let t0 = std::time::Instant::now();
    let e = a.post(req).unwrap().wait().await.unwrap_err();
    assert!(matches!(e, TransferError::Disconnected { .. } | TransferError::Remote { .. }), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(5), "failed after {:?}", t0.elapsed());
}

/// GPUDirect RDMA on a host whose adapter reaches its GPU: host memory to a GPU region of
/// the peer, that region to a GPU region here, then to host memory of the peer, every hop
/// an RDMA transfer between the adapter and GPU memory; the bytes arrive intact, at offsets
/// and in pieces. Where the host has no GPU or its adapter does not reach GPU memory, it
/// says so and checks nothing more.
#[cfg(feature = "cuda")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device and a GPU it reaches: scripts/rdma-check.sh runs it"]
async fn gpu_memory_over_rdma_arrives_intact() {
    let (a, b) = (agent("a").await, agent("b").await);
    assert!(
        matches!(a.rdma_status(), RdmaStatus::Device { .. }),
        "{NEEDS_DEVICE}: {}",
        a.rdma_status()
    );
    if let Err(why) = kvfabric::cuda::available() {
        eprintln!("SKIPPED: {why}");
        return;
    }
    let RdmaStatus::Device { gpu: Some(how), .. } = a.rdma_status() else {
        eprintln!("SKIPPED: the adapter does not reach GPU memory: {}", a.rdma_status());
        return;
    };
    eprintln!("GPU memory through {how}");
    const LEN: usize = 8 << 20;
    let host_a = a.alloc_region(LEN, RegionOptions::default()).unwrap();
    let gpu_b = b.alloc_device_region(0, LEN, true).unwrap();
    let gpu_a = a.alloc_device_region(0, LEN, false).unwrap();
    let host_b = b.alloc_region(LEN, exported()).unwrap();
    pattern(&host_a, 11);
    link(&a, &b);
    // Pieces of several sizes at different offsets on each side.
    let pieces = [(0u64, 4096u64, 1u64), (100, 9000, 65_536), (70_000, 1 << 20, 5 << 20)];
    let descs = |r: &Region, side: usize| -> Vec<Desc> {
        pieces.iter().map(|p| Desc::new(r.id(), [p.0, p.1][side], p.2)).collect()
    };
    let rdma = |op, local, remote| {
        TransferRequest::new(op, "b", local, remote)
            .with_transport(TransportKind::Rdma)
            .with_deadline(Duration::from_secs(10))
    };
    // host a → GPU b, GPU b → GPU a (a READ), GPU a → host b.
    a.post(rdma(TransferOp::Write, descs(&host_a, 0), descs(&gpu_b, 1)))
        .unwrap()
        .wait()
        .await
        .unwrap();
    a.post(rdma(TransferOp::Read, descs(&gpu_a, 0), descs(&gpu_b, 1)))
        .unwrap()
        .wait()
        .await
        .unwrap();
    a.post(rdma(TransferOp::Write, descs(&gpu_a, 0), descs(&host_b, 1)))
        .unwrap()
        .wait()
        .await
        .unwrap();
    for &(l, r, n) in &pieces {
        assert_eq!(bytes(&host_b, r, n as usize), bytes(&host_a, l, n as usize));
    }
    let rdma =
        a.transfer_counts().into_iter().find(|c| c.transport == TransportKind::Rdma).unwrap();
    assert_eq!((rdma.done, rdma.failed), (3, 0));
}

/// A transfer of all 1 MiB of `local` to or from all of `remote` on peer `b`.
fn whole(op: TransferOp, local: &Region, remote: &Region) -> TransferRequest {
    let desc = |r: &Region| vec![Desc::new(r.id(), 0, 1 << 20)];
    TransferRequest::new(op, "b", desc(local), desc(remote))
}
