//! The transport end to end between two agents of this process, over the software
//! device of [`super::fake`]: what it proves and what it cannot are said there.

use std::sync::Arc;
use std::time::Duration;

use super::{fake, RdmaConfig};
use crate::agent::{Agent, AgentConfig};
use crate::endpoint::RdmaStatus;
use crate::memory::{Region, RegionOptions};
use crate::transfer::{Desc, TransferError, TransferOp, TransferRequest, TransportKind};
use crate::wire::ErrorCode;

async fn agent(name: &str) -> Agent {
    let mut cfg = AgentConfig::new(name, b"double".to_vec());
    cfg.shm = false;
    cfg.rdma = Some(RdmaConfig {
        device: Some(fake::DEVICE.into()),
        wr_bytes_max: 64 << 10,
        ..Default::default()
    });
    Agent::start(cfg).await.unwrap()
}

/// A request to peer `b` of one piece: `local` here, `remote` there.
fn one(op: TransferOp, local: Desc, remote: Desc) -> TransferRequest {
    TransferRequest::new(op, "b", vec![local], vec![remote])
}

/// Agents `a` and `b` linked to each other, with `len` bytes of memory at a and `len`
/// exported at b.
async fn linked(len: usize) -> (Agent, Agent, Arc<Region>, Arc<Region>) {
    let (a, b) = (agent("a").await, agent("b").await);
    let src = a.alloc_region(len, RegionOptions::default()).unwrap();
    let dst = b.alloc_region(len, exported()).unwrap();
    link(&a, &b);
    (a, b, src, dst)
}

fn exported() -> RegionOptions {
    RegionOptions { shared: false, export: true, huge_pages: false }
}

fn pattern(r: &Region, seed: u8) {
    let b: Vec<u8> = (0..r.len()).map(|i| (i as u64 * 131 + u64::from(seed)) as u8).collect();
    r.write_at(0, &b).unwrap();
}

fn bytes(r: &Region, off: u64, len: u64) -> Vec<u8> {
    let mut v = vec![0; len as usize];
    r.read_at(off, &mut v).unwrap();
    v
}

fn link(a: &Agent, b: &Agent) {
    a.load_peer(b.metadata()).unwrap();
    b.load_peer(a.metadata()).unwrap();
}

fn rdma_count(a: &Agent) -> crate::transfer::TransferCount {
    a.transfer_counts().into_iter().find(|c| c.transport == TransportKind::Rdma).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_and_reads_arrive_intact_and_notify_after_the_last_byte() {
    let _serial = fake::serial().await;
    let (a, b) = (agent("a").await, agent("b").await);
    assert!(matches!(a.rdma_status(), RdmaStatus::Device { device, .. } if device == fake::DEVICE));
    let src = a.alloc_region(4 << 20, RegionOptions::default()).unwrap();
    let dst = b.alloc_region(4 << 20, exported()).unwrap();
    link(&a, &b);
    // Odd sizes and offsets; one piece larger than a work request (64 KiB here), pieces
    // contiguous on the remote side only (one request, several entries).
    let pieces = [
        (0u64, 3u64, 1u64),
        (10, 4, 4095),
        (9000, 4099, 5),
        (20_000, 30_000, 300_000),
        (400_000, 330_000, 70_000),
    ];
    let local: Vec<Desc> = pieces.iter().map(|&(l, _, n)| Desc::new(src.id(), l, n)).collect();
    let remote: Vec<Desc> = pieces.iter().map(|&(_, r, n)| Desc::new(dst.id(), r, n)).collect();
    for checksum in [false, true] {
        pattern(&src, 3 + u8::from(checksum));
        dst.fill(0, 4 << 20, 0).unwrap();
        let mut req = TransferRequest::new(TransferOp::Write, "b", local.clone(), remote.clone())
            .with_notify(b"landed".to_vec());
        req.checksum = checksum;
        assert_eq!(a.transport_for(&req).unwrap(), TransportKind::Rdma);
        a.post(req).unwrap().wait().await.unwrap();
        // The notification comes after the last byte: every byte is there when it is.
        let n = tokio::time::timeout(Duration::from_secs(5), b.next_notification())
            .await
            .unwrap()
            .unwrap();
        assert_eq!((n.from.as_str(), n.message.as_slice()), ("a", &b"landed"[..]));
        for (l, r) in local.iter().zip(&remote) {
            assert_eq!(bytes(&src, l.offset, l.len), bytes(&dst, r.offset, r.len));
        }
        src.fill(0, 4 << 20, 0xee).unwrap();
        let mut req = TransferRequest::new(TransferOp::Read, "b", local.clone(), remote.clone());
        req.checksum = checksum;
        a.post(req).unwrap().wait().await.unwrap();
        for (l, r) in local.iter().zip(&remote) {
            assert_eq!(bytes(&src, l.offset, l.len), bytes(&dst, r.offset, r.len));
        }
    }
    assert_eq!(rdma_count(&a).done, 4);
    assert_eq!(rdma_count(&a).failed, 0);
    // Without checksums the WRITE's notification rode a WRITE with immediate data; with
    // them it went with the Commit that the owner verifies.
    assert_eq!(a.rdma_transport().unwrap().notifications().0, 1);
    assert_eq!(b.rdma_transport().unwrap().notifications().1, 1);
}

/// A consumer that does not drain its notification queue (4 deep here) holds no sender
/// back: 40 WRITEs with notifications complete at once, and every notification is there,
/// in order per sender, when the consumer reads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_that_does_not_drain_stalls_no_sender() {
    let _serial = fake::serial().await;
    let a = agent("a").await;
    let mut cfg = AgentConfig::new("b", b"double".to_vec());
    cfg.shm = false;
    cfg.limits.notifications_queued_max = 4;
    cfg.rdma = Some(RdmaConfig { device: Some(fake::DEVICE.into()), ..Default::default() });
    let b = Agent::start(cfg).await.unwrap();
    let src = a.alloc_region(1 << 20, RegionOptions::default()).unwrap();
    let dst = b.alloc_region(1 << 20, exported()).unwrap();
    link(&a, &b);
    for i in 0..40u64 {
        let req = one(
            TransferOp::Write,
            Desc::new(src.id(), i * 64, 64),
            Desc::new(dst.id(), i * 64, 64),
        )
        .with_notify(i.to_le_bytes().to_vec())
        .with_deadline(Duration::from_secs(5));
        a.post(req).unwrap().wait().await.unwrap();
    }
    for i in 0..40u64 {
        let n = tokio::time::timeout(Duration::from_secs(5), b.next_notification())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(n.message, i.to_le_bytes(), "in order");
    }
    assert_eq!(b.rdma_transport().unwrap().notifications().1, 40);
    assert_eq!(b.rdma_transport().unwrap().notifications().2, 0, "none dropped");
}

/// Notifications by WRITE with immediate data: more of them than the mailbox has slots,
/// from concurrent transfers, each after its own bytes, none lost; one too large for a
/// slot goes through the session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notifications_ride_writes_with_immediate_data() {
    let _serial = fake::serial().await;
    let (a, b, src, dst) = linked(1 << 20).await;
    pattern(&src, 11);
    let a = Arc::new(a);
    let mut tasks = Vec::new();
    for i in 0..40u64 {
        let (a, sid, did) = (a.clone(), src.id(), dst.id());
        tasks.push(tokio::spawn(async move {
            let req = one(
                TransferOp::Write,
                Desc::new(sid, i * 4096, 4096),
                Desc::new(did, i * 4096, 4096),
            )
            .with_notify(format!("block {i}").into_bytes());
            a.post(req).unwrap().wait().await
        }));
    }
    let mut seen = Vec::new();
    for _ in 0..40 {
        let n = tokio::time::timeout(Duration::from_secs(5), b.next_notification())
            .await
            .unwrap()
            .unwrap();
        let text = String::from_utf8(n.message).unwrap();
        let i: u64 = text.strip_prefix("block ").unwrap().parse().unwrap();
        // Its bytes were there before it.
        assert_eq!(bytes(&dst, i * 4096, 4096), bytes(&src, i * 4096, 4096), "{text}");
        seen.push(i);
    }
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    seen.sort_unstable();
    assert_eq!(seen, (0..40).collect::<Vec<_>>());
    assert_eq!(a.rdma_transport().unwrap().notifications().0, 40);
    assert_eq!(b.rdma_transport().unwrap().notifications().1, 40);
    // Larger than a slot (4 KiB at this MTU): through the session.
    let big = vec![7u8; 8192];
    let req = one(TransferOp::Write, Desc::new(src.id(), 0, 16), Desc::new(dst.id(), 0, 16))
        .with_notify(big.clone());
    a.post(req).unwrap().wait().await.unwrap();
    let n = b.next_notification().await.unwrap();
    assert_eq!(n.message, big);
    assert_eq!(a.rdma_transport().unwrap().notifications().0, 40);
}

/// Many transfers to one peer at once share its send queues (64 deep here) through
/// credits: none overflows a queue, all arrive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_transfers_share_the_send_queues() {
    let _serial = fake::serial().await;
    let (a, _b, src, dst) = linked(8 << 20).await;
    pattern(&src, 9);
    let a = Arc::new(a);
    // 32 transfers of 128 scattered 2 KiB pieces: 4096 requests over 4 queue pairs.
    let mut tasks = Vec::new();
    for t in 0..32u64 {
        let (a, sid, did) = (a.clone(), src.id(), dst.id());
        tasks.push(tokio::spawn(async move {
            let base = (t * 256) << 10;
            let local: Vec<Desc> =
                (0..128).map(|i| Desc::new(sid, base + i * 2048, 2048)).collect();
            let remote: Vec<Desc> =
                (0..128).map(|i| Desc::new(did, base + (127 - i) * 2048, 2048)).collect();
            a.post(TransferRequest::new(TransferOp::Write, "b", local, remote))
                .unwrap()
                .wait()
                .await
        }));
    }
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    for t in 0..32u64 {
        for i in 0..128u64 {
            let base = (t * 256) << 10;
            assert_eq!(
                bytes(&src, base + i * 2048, 2048),
                bytes(&dst, base + (127 - i) * 2048, 2048)
            );
        }
    }
    assert_eq!(rdma_count(&a).done, 32);
}

/// A key the owner no longer honours (its region deregistered) fails the transfer typed
/// as the owner's refusal; a region exported later is reached through a new connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_key_is_typed_and_new_regions_get_new_keys() {
    let _serial = fake::serial().await;
    let (a, b, src, dst) = linked(1 << 20).await;
    let to = |d: crate::memory::RegionId| {
        one(TransferOp::Write, Desc::new(src.id(), 0, 4096), Desc::new(d, 0, 4096))
    };
    let dst_id = dst.id();
    a.post(to(dst_id)).unwrap().wait().await.unwrap();
    drop(dst);
    b.deregister(dst_id).unwrap();
    let e = a.post(to(dst_id)).unwrap().wait().await.unwrap_err();
    assert!(matches!(e, TransferError::Remote { code: ErrorCode::OutOfBounds, .. }), "{e}");
    // A region exported after the connection: its key comes with a new one.
    let later = b.alloc_region(1 << 20, exported()).unwrap();
    a.load_peer(b.metadata()).unwrap();
    pattern(&src, 1);
    a.post(to(later.id())).unwrap().wait().await.unwrap();
    assert_eq!(bytes(&later, 0, 4096), bytes(&src, 0, 4096));
}

/// A peer whose queue pairs are gone (its agent dropped): retries run out, the transfer
/// fails typed as a disconnection, and nothing hangs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_peer_is_a_typed_disconnection() {
    let _serial = fake::serial().await;
    let a = agent("a").await;
    let src = a.alloc_region(1 << 20, RegionOptions::default()).unwrap();
    let dst_id = {
        let b = agent("b").await;
        let dst = b.alloc_region(1 << 20, exported()).unwrap();
        link(&a, &b);
        let req =
            one(TransferOp::Write, Desc::new(src.id(), 0, 4096), Desc::new(dst.id(), 0, 4096));
        a.post(req).unwrap().wait().await.unwrap();
        b.shutdown();
        dst.id()
    };
    let req = one(TransferOp::Write, Desc::new(src.id(), 0, 4096), Desc::new(dst_id, 0, 4096))
        .with_deadline(Duration::from_secs(5));
    let e = a.post(req).unwrap().wait().await.unwrap_err();
    assert!(matches!(&e, TransferError::Disconnected { peer, .. } if peer == "b"), "{e}");
    assert!(e.to_string().contains("retry counter exceeded"), "{e}");
}

/// A transfer past its deadline with work still outstanding: the connection's queue
/// pairs go to the error state, the work is flushed, not one byte lands afterwards, and
/// the next transfer connects again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_transfer_is_flushed_and_lands_nothing() {
    let _serial = fake::serial().await;
    let (a, _b, src, dst) = linked(1 << 20).await;
    pattern(&src, 5);
    let req =
        || one(TransferOp::Write, Desc::new(src.id(), 0, 1 << 20), Desc::new(dst.id(), 0, 1 << 20));
    // Connect first, so that only the data waits.
    a.post(req().with_transport(TransportKind::Rdma)).unwrap().wait().await.unwrap();
    dst.fill(0, 1 << 20, 0).unwrap();
    fake::hold();
    let e =
        a.post(req().with_deadline(Duration::from_millis(200))).unwrap().wait().await.unwrap_err();
    fake::release();
    assert!(matches!(e, TransferError::TimedOut(_)), "{e}");
    assert!(bytes(&dst, 0, 1 << 20).iter().all(|&x| x == 0), "a byte landed after the deadline");
    a.post(req()).unwrap().wait().await.unwrap();
    assert_eq!(bytes(&dst, 0, 1 << 20), bytes(&src, 0, 1 << 20));
}

/// A provider that takes a chain only in part (its send queue is shallower than it said):
/// the transfer fails typed instead of hanging or counting requests that never ran, and
/// transfers that fit still work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chain_taken_in_part_fails_typed() {
    let _serial = fake::serial().await;
    let (a, _b, src, dst) = linked(4 << 20).await;
    let small = one(TransferOp::Write, Desc::new(src.id(), 0, 4096), Desc::new(dst.id(), 0, 4096));
    // The connection (made by the first transfer) gets queue pairs that say 64 and take 4.
    fake::limit_send_queues(Some(4));
    a.post(small.clone()).unwrap().wait().await.unwrap();
    fake::limit_send_queues(None);
    // 64 scattered pieces: 16 requests per queue pair, more than the 4 it takes.
    let local: Vec<Desc> = (0..64).map(|i| Desc::new(src.id(), i * 8192, 4096)).collect();
    let remote: Vec<Desc> = (0..64).map(|i| Desc::new(dst.id(), i * 8192, 4096)).collect();
    let e = a
        .post(
            TransferRequest::new(TransferOp::Write, "b", local, remote)
                .with_deadline(Duration::from_secs(5)),
        )
        .unwrap()
        .wait()
        .await
        .unwrap_err();
    assert!(matches!(&e, TransferError::Protocol(m) if m.contains("ibv_post_send")), "{e}");
    a.post(small).unwrap().wait().await.unwrap();
}

/// GPUDirect RDMA through dma-bufs, over the software device and its fake GPU memory
/// ([`fake::GpuMemory`]: device addresses the CPU cannot touch, bytes in a memfd that the
/// double's `ibv_reg_dmabuf_mr` maps). Host to GPU, GPU to GPU and GPU to host, at
/// offsets into the allocation (the dma-buf offset), chosen without being asked when the
/// peer is on another host; with checksums, refused typed. A CPU access through a GPU
/// address would fault (the test would crash). What it cannot prove is said at
/// [`fake::GpuMemory`].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_memory_moves_through_dma_bufs_without_touching_the_cpu() {
    let _serial = fake::serial().await;
    let (a, b) = (agent("a").await, agent("b").await);
    for x in [&a, &b] {
        let RdmaStatus::Device { gpu, .. } = x.rdma_status() else { panic!() };
        assert_eq!(gpu.as_deref(), Some("dma-buf"));
        assert!(x.rdma_status().to_string().ends_with("GPU memory through dma-buf"));
    }
    const LEN: usize = 1 << 20;
    let (gpu_a, gpu_b) = (fake::GpuMemory::new(3 * LEN), fake::GpuMemory::new(3 * LEN));
    // Regions start inside their allocations: their dma-buf offsets are not zero.
    let (off_a, off_b) = (LEN + 100, 2 * LEN - 4096);
    // SAFETY: fake GPU memory, alive until the end of the test (after the agents' use).
    let ga =
        unsafe { a.register_device_unchecked(gpu_a.addr + off_a as u64, LEN, 0, false) }.unwrap();
    // SAFETY: as above.
    let gb =
        unsafe { b.register_device_unchecked(gpu_b.addr + off_b as u64, LEN, 0, true) }.unwrap();
    let host_a = a.alloc_region(LEN, RegionOptions::default()).unwrap();
    let host_b = b.alloc_region(LEN, exported()).unwrap();
    pattern(&host_a, 7);
    // b is on another host, as a's peer: the route is chosen, not asked for.
    let mut md = b.metadata();
    md.host_id = "another-host".into();
    a.load_peer(md).unwrap();
    b.load_peer(a.metadata()).unwrap();

    // Host memory to the peer's GPU memory, with a notification after the last byte.
    let (l, r) = (Desc::new(host_a.id(), 4096, 300_000), Desc::new(gb.id(), 5000, 300_000));
    let req = TransferRequest::new(TransferOp::Write, "b", vec![l], vec![r])
        .with_notify(b"in gpu".to_vec());
    assert_eq!(a.transport_for(&req).unwrap(), TransportKind::Rdma);
    a.post(req).unwrap().wait().await.unwrap();
    let n =
        tokio::time::timeout(Duration::from_secs(5), b.next_notification()).await.unwrap().unwrap();
    assert_eq!(n.message, b"in gpu");
    assert_eq!(gpu_b.bytes(off_b + 5000, 300_000), bytes(&host_a, 4096, 300_000));
    assert!(gpu_b.bytes(off_b, 5000).iter().all(|&x| x == 0), "nothing before the range");

    // The peer's GPU memory to ours (both sides' adapters on GPU memory): a READ.
    gpu_b.write(off_b + 600_000, &[0xab; 70_000]);
    let req =
        one(TransferOp::Read, Desc::new(ga.id(), 10, 70_000), Desc::new(gb.id(), 600_000, 70_000));
    assert_eq!(a.transport_for(&req).unwrap(), TransportKind::Rdma);
    a.post(req).unwrap().wait().await.unwrap();
    assert_eq!(gpu_a.bytes(off_a + 10, 70_000), vec![0xab; 70_000]);

    // Our GPU memory to the peer's host memory, asked for by name.
    gpu_a.write(off_a + 200_000, &(0..=255u8).cycle().take(65_536).collect::<Vec<_>>());
    let mut req = one(
        TransferOp::Write,
        Desc::new(ga.id(), 200_000, 65_536),
        Desc::new(host_b.id(), 1, 65_536),
    );
    req.transport = Some(TransportKind::Rdma);
    a.post(req).unwrap().wait().await.unwrap();
    assert_eq!(bytes(&host_b, 1, 65_536), gpu_a.bytes(off_a + 200_000, 65_536));

    // Checksums are computed on host memory: GPUDirect refuses them, typed, and asked by
    // name it says why.
    let mut req =
        one(TransferOp::Write, Desc::new(host_a.id(), 0, 4096), Desc::new(gb.id(), 0, 4096));
    req.checksum = true;
    req.transport = Some(TransportKind::Rdma);
    let e = a.transport_for(&req).unwrap_err();
    assert!(
        matches!(&e, TransferError::NoTransport { reason, .. } if reason.contains("checksums")),
        "{e}"
    );
    assert_eq!(rdma_count(&a).done, 3);
    assert_eq!(rdma_count(&a).failed, 0);
}

/// A peer whose adapter does not reach GPU memory (as its metadata says) is not sent
/// GPU bytes over RDMA: asked by name, the request is refused with the reason. A GPU
/// region whose dma-buf cannot be made is left out of the keys a peer gets: transfers
/// there fail typed, and the owner's other regions still work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_memory_a_side_cannot_reach_is_refused_typed() {
    let _serial = fake::serial().await;
    let (a, b) = (agent("a").await, agent("b").await);
    let gpu_a = fake::GpuMemory::new(1 << 20);
    // SAFETY: fake GPU memory, alive until the end of the test.
    let ga = unsafe { a.register_device_unchecked(gpu_a.addr, 1 << 20, 0, false) }.unwrap();
    let host_b = b.alloc_region(1 << 20, exported()).unwrap();
    let mut md = b.metadata();
    let RdmaStatus::Device { gpu, .. } = &mut md.rdma else { panic!() };
    *gpu = None;
    a.load_peer(md).unwrap();
    b.load_peer(a.metadata()).unwrap();
    // The peer's host memory is reachable: our adapter reads our GPU memory.
    let mut req =
        one(TransferOp::Write, Desc::new(ga.id(), 0, 4096), Desc::new(host_b.id(), 0, 4096));
    req.transport = Some(TransportKind::Rdma);
    a.post(req).unwrap().wait().await.unwrap();

    // GPU memory of b: b's adapter does not reach it, by b's metadata.
    let gpu_b = fake::GpuMemory::new(1 << 20);
    // SAFETY: fake GPU memory, alive until the end of the test.
    let gb = unsafe { b.register_device_unchecked(gpu_b.addr, 1 << 20, 0, true) }.unwrap();
    let mut md = b.metadata();
    let RdmaStatus::Device { gpu, .. } = &mut md.rdma else { panic!() };
    *gpu = None;
    a.load_peer(md).unwrap();
    let mut req = one(TransferOp::Write, Desc::new(ga.id(), 0, 4096), Desc::new(gb.id(), 0, 4096));
    req.transport = Some(TransportKind::Rdma);
    let e = a.transport_for(&req).unwrap_err();
    assert!(
        matches!(&e, TransferError::NoTransport { reason, .. }
                if reason.contains("b's adapter does not reach GPU memory")),
        "{e}"
    );

    // With the true metadata, a GPU region of b whose dma-buf cannot be made (its
    // memory is not the fake GPU's): b leaves it out of the keys, and says so once.
    // SAFETY: never touched: its registration fails before any transfer.
    let bogus = unsafe { b.register_device_unchecked(0x1000, 1 << 20, 0, true) }.unwrap();
    a.load_peer(b.metadata()).unwrap();
    let req = one(TransferOp::Write, Desc::new(ga.id(), 0, 4096), Desc::new(bogus.id(), 0, 4096))
        .with_transport(TransportKind::Rdma);
    let e = a.post(req).unwrap().wait().await.unwrap_err();
    assert!(
        matches!(&e, TransferError::RemoteDescriptor { reason, .. }
                if reason.contains("not exported to this agent over RDMA")),
        "{e}"
    );
    // b's GPU region that does register works on the same connection's next one.
    let req = one(TransferOp::Write, Desc::new(ga.id(), 0, 4096), Desc::new(gb.id(), 0, 4096))
        .with_transport(TransportKind::Rdma);
    a.post(req).unwrap().wait().await.unwrap();
    assert_eq!(gpu_b.bytes(0, 4096), gpu_a.bytes(0, 4096));

    // A GPU region of ours that does not register (a GPU without dma-buf support): not
    // routed over RDMA even to another host, where GPUDirect is the default; the default
    // route then stages it through host memory with CUDA (not built into this test, so
    // the route says that), and asked by name, RDMA says why not.
    // SAFETY: never touched: its registration fails before any transfer.
    let bogus_a = unsafe { a.register_device_unchecked(0x1000, 1 << 20, 0, false) }.unwrap();
    let mut md = b.metadata();
    md.host_id = "another-host".into();
    a.load_peer(md).unwrap();
    let req =
        one(TransferOp::Write, Desc::new(bogus_a.id(), 0, 4096), Desc::new(host_b.id(), 0, 4096));
    let why = |e: TransferError| match e {
        TransferError::NoTransport { reason, .. } => reason,
        e => panic!("{e}"),
    };
    let reason = why(a.transport_for(&req).unwrap_err());
    assert!(!reason.starts_with("rdma"), "{reason}");
    let reason = why(a.transport_for(&req.with_transport(TransportKind::Rdma)).unwrap_err());
    assert!(reason.contains("RDMA registration of region"), "{reason}");
}

/// GPU memory whose adapter path is missing is staged through host memory; between two
/// agents with RDMA the staged chunks go over it (`Job::stage_over_rdma`). Here the
/// staging runs over the RDMA transport with a memcpy for the CUDA copies (as the
/// staging tests do over TCP): every byte both ways through two 64 KiB slots, with and
/// without checksums, and the WRITE's notification after its last chunk. Which transport
/// the agent picks for a staged job needs CUDA, so only hardware shows that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn staged_chunks_travel_over_rdma() {
    use crate::memory::RegionLease;
    use crate::transport::staging::{run, test_stager::Memcpy, Bounce};
    use crate::transport::Transport;
    let _serial = fake::serial().await;
    let (a, b) = (agent("a").await, agent("b").await);
    const LEN: usize = 1 << 20;
    let local = a.alloc_region(LEN, RegionOptions::default()).unwrap();
    let remote = b.alloc_region(LEN, exported()).unwrap();
    let bounce = a.alloc_region(2 << 16, RegionOptions::default()).unwrap();
    let bounce = Bounce { lease: RegionLease::new(bounce), slot_bytes: 1 << 16 };
    link(&a, &b);
    let rdma: Arc<dyn Transport> = a.rdma_transport().unwrap().clone();
    // Pieces of odd sizes, split across chunks.
    let (mut ld, mut rd, mut off) = (Vec::new(), Vec::new(), 0u64);
    while off < LEN as u64 {
        let n = 30_001.min(LEN as u64 - off);
        ld.push(Desc::new(local.id(), off, n));
        rd.push(Desc::new(remote.id(), LEN as u64 - off - n, n));
        off += n;
    }
    for checksum in [false, true] {
        pattern(&local, 21 + u8::from(checksum));
        let mut req = TransferRequest::new(TransferOp::Write, "b", ld.clone(), rd.clone())
            .with_notify(b"staged".to_vec());
        req.checksum = checksum;
        let job = a.job_for(&req).unwrap();
        run(&job, &bounce, &Memcpy::default(), rdma.as_ref()).await.unwrap();
        let n = tokio::time::timeout(Duration::from_secs(5), b.next_notification())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(n.message, b"staged");
        for (l, r) in ld.iter().zip(&rd) {
            assert_eq!(bytes(&local, l.offset, l.len), bytes(&remote, r.offset, r.len));
        }
        let want = bytes(&local, 0, LEN as u64);
        local.fill(0, LEN as u64, 0).unwrap();
        let mut req = TransferRequest::new(TransferOp::Read, "b", ld.clone(), rd.clone());
        req.checksum = checksum;
        let job = a.job_for(&req).unwrap();
        run(&job, &bounce, &Memcpy::default(), rdma.as_ref()).await.unwrap();
        assert!(bytes(&local, 0, LEN as u64) == want, "the READ staged in other bytes");
    }
    // The unchecked WRITE's notification rode a WRITE with immediate data: RDMA moved it.
    assert_eq!(a.rdma_transport().unwrap().notifications().0, 1);
}

/// An idle completion thread sleeps on the queue's completion channel (it would
/// otherwise wake a thousand times a second): the next completion's event wakes it, on
/// both sides (the writer's completion, and the owner's mailbox receive).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_completion_thread_sleeps_until_a_completion_wakes_it() {
    let _serial = fake::serial().await;
    let (a, b, src, dst) = linked(1 << 16).await;
    let write = || {
        one(TransferOp::Write, Desc::new(src.id(), 0, 4096), Desc::new(dst.id(), 0, 4096))
            .with_notify(b"n".to_vec())
    };
    a.post(write()).unwrap().wait().await.unwrap();
    b.next_notification().await.unwrap();
    for round in 0..3 {
        // Idle: both threads go to sleep on their channels.
        tokio::time::sleep(Duration::from_millis(60)).await;
        let (wa, wb) =
            (a.rdma_transport().unwrap().wakeups(), b.rdma_transport().unwrap().wakeups());
        a.post(write()).unwrap().wait().await.unwrap();
        let n = tokio::time::timeout(Duration::from_secs(5), b.next_notification()).await;
        assert!(n.unwrap().is_some());
        // The event is raised as the completion lands; the thread counts it when it reads
        // it (at once if it slept, at its next sleep if it was between two).
        let woke = |x: &Agent, before: u64| x.rdma_transport().unwrap().wakeups() > before;
        let deadline = std::time::Instant::now() + Duration::from_secs(2);
        while !(woke(&a, wa) && woke(&b, wb)) && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        assert!(woke(&a, wa), "round {round}: the writer's completion woke nothing");
        assert!(woke(&b, wb), "round {round}: the owner's receive woke nothing");
    }
}

/// A device that goes away (its completion queue fails) stops the RDMA transport: the
/// agent says why, routes transfers between hosts over TCP from then on, and refuses
/// RDMA asked by name with the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_device_falls_back_to_tcp() {
    let _serial = fake::serial().await;
    let (a, _b, src, dst) = linked(1 << 20).await;
    let write = |seed: u8| {
        pattern(&src, seed);
        one(TransferOp::Write, Desc::new(src.id(), 0, 1 << 20), Desc::new(dst.id(), 0, 1 << 20))
    };
    let req = write(1);
    assert_eq!(a.transport_for(&req).unwrap(), TransportKind::Rdma);
    a.post(req).unwrap().wait().await.unwrap();
    assert_eq!(a.rdma_failure(), None);

    let lost = fake::lose_device(a.rdma_transport().unwrap().cq_raw());
    let why = failure_of(&a).await;
    assert!(why.contains("ibv_poll_cq"), "{why}");
    let req = write(2);
    assert_eq!(a.transport_for(&req).unwrap(), TransportKind::Tcp);
    a.post(req).unwrap().wait().await.unwrap();
    assert_eq!(bytes(&dst, 0, 1 << 20), bytes(&src, 0, 1 << 20));
    let e = a.transport_for(&write(3).with_transport(TransportKind::Rdma)).unwrap_err();
    assert!(
        matches!(&e, TransferError::NoTransport { reason, .. } if reason.contains("device failed")),
        "{e}"
    );
    // Peers loading its metadata again see no RDMA, and why.
    let md = a.metadata();
    assert!(!md.transports.contains(&TransportKind::Rdma));
    assert!(md.rdma.to_string().contains("the device failed"), "{}", md.rdma);
    drop(lost);
}

/// Waits (at most 5 s) for `x`'s completion thread to report its queue failed.
async fn failure_of(x: &Agent) -> String {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while x.rdma_failure().is_none() && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    x.rdma_failure().expect("the failed completion queue is not reported")
}

/// A peer whose device failed refuses RDMA connections; an agent that still holds its
/// old metadata fails the transfer that tried (typed), and sends the next ones over TCP
/// (for [`PEER_RETRY`]).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_whose_device_failed_is_reached_over_tcp() {
    let _serial = fake::serial().await;
    let (a, b) = (agent("a").await, agent("b").await);
    let src = a.alloc_region(1 << 16, RegionOptions::default()).unwrap();
    let dst = b.alloc_region(1 << 16, exported()).unwrap();
    let stale = b.metadata();
    let lost = fake::lose_device(b.rdma_transport().unwrap().cq_raw());
    failure_of(&b).await;
    a.load_peer(stale).unwrap();
    b.load_peer(a.metadata()).unwrap();
    pattern(&src, 5);
    let write =
        || one(TransferOp::Write, Desc::new(src.id(), 0, 1 << 16), Desc::new(dst.id(), 0, 1 << 16));
    assert_eq!(a.transport_for(&write()).unwrap(), TransportKind::Rdma);
    let e = a.post(write()).unwrap().wait().await.unwrap_err();
    assert!(e.to_string().contains("RDMA device failed"), "{e}");
    assert_eq!(a.transport_for(&write()).unwrap(), TransportKind::Tcp);
    a.post(write()).unwrap().wait().await.unwrap();
    assert_eq!(bytes(&dst, 0, 1 << 16), bytes(&src, 0, 1 << 16));
    let e = a.transport_for(&write().with_transport(TransportKind::Rdma)).unwrap_err();
    assert!(e.to_string().contains("b refused an RDMA connection"), "{e}");
    drop(lost);
}
