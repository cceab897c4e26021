//! The transfer engine between agents in one process, over real loopback sockets (tcp), real
//! shared memory (shm) and memcpy (local). Two-process tests, where the peer is another
//! process that can be killed, live in `serving/tests/transfer_processes.rs`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvfabric::agent::{Agent, AgentConfig};
use kvfabric::memory::{MemoryErrorKind, Region, RegionOptions};
use kvfabric::transfer::{
    Desc, TransferError, TransferOp, TransferRequest, TransferStatus, TransportKind,
};
use kvfabric::transport::fault::FaultInjector;
use kvfabric::wire::ErrorCode;
use xxhash_rust::xxh3::xxh3_64;

const SECRET: &[u8] = b"test-secret";

async fn agent(name: &str) -> Agent {
    Agent::start(AgentConfig::new(name, SECRET)).await.unwrap()
}

fn shared() -> RegionOptions {
    RegionOptions { shared: true, export: true, huge_pages: false }
}

fn pattern(r: &Region, seed: u8) {
    let bytes: Vec<u8> = (0..r.len()).map(|i| (i as u64 * 31 + u64::from(seed)) as u8).collect();
    r.write_at(0, &bytes).unwrap();
}

fn bytes(r: &Region, off: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0; len];
    r.read_at(off, &mut v).unwrap();
    v
}

/// Two agents that know each other.
async fn pair() -> (Agent, Agent) {
    let (a, b) = (agent("a").await, agent("b").await);
    (a, b)
}

fn link(a: &Agent, b: &Agent) {
    a.load_peer(b.metadata()).unwrap();
    b.load_peer(a.metadata()).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_and_read_over_every_transport_arrive_intact() {
    let (a, b) = pair().await;
    let src = a.alloc_region(8 << 20, shared()).unwrap();
    let dst = b.alloc_region(8 << 20, shared()).unwrap();
    link(&a, &b);
    for (transport, peer) in [(TransportKind::Tcp, "b"), (TransportKind::Shm, "b")] {
        for checksum in [false, true] {
            pattern(&src, 7);
            dst.fill(0, 8 << 20, 0).unwrap();
            // Odd sizes and offsets, one larger than a TCP stripe (4 MiB).
            let sizes = [1u64, 4095, 65_536, 5 << 20];
            let mut off = 0u64;
            let (mut local, mut remote) = (vec![], vec![]);
            for &s in &sizes {
                local.push(Desc::new(src.id(), off, s));
                remote.push(Desc::new(dst.id(), off + 3, s));
                off += s + 100;
            }
            // WRITE from a into b; and back: READ from b into a fresh part of a.
            for op in [TransferOp::Write, TransferOp::Read] {
                if op == TransferOp::Read {
                    src.fill(0, 8 << 20, 0xee).unwrap();
                }
                let mut req = TransferRequest::new(op, peer, local.clone(), remote.clone())
                    .with_transport(transport);
                req.checksum = checksum;
                a.post(req).unwrap().wait().await.unwrap();
                for (l, r) in local.iter().zip(&remote) {
                    assert_eq!(
                        bytes(&src, l.offset, l.len as usize),
                        bytes(&dst, r.offset, r.len as usize),
                        "{transport} {op:?}"
                    );
                }
            }
        }
    }
    // Local: both sides in agent a.
    let other = a.alloc_region(1 << 20, RegionOptions::default()).unwrap();
    pattern(&other, 3);
    let req = TransferRequest::new(
        TransferOp::Read,
        "a",
        vec![Desc::new(src.id(), 0, 1 << 20)],
        vec![Desc::new(other.id(), 0, 1 << 20)],
    )
    .with_checksum();
    assert_eq!(a.transport_for(&req).unwrap(), TransportKind::Local);
    a.post(req).unwrap().wait().await.unwrap();
    assert_eq!(bytes(&src, 0, 1 << 20), bytes(&other, 0, 1 << 20));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_is_chosen_on_one_host_and_tcp_for_non_shareable_regions() {
    let (a, b) = pair().await;
    let src = a.alloc_region(4096, RegionOptions::default()).unwrap();
    let shm = b.alloc_region(4096, shared()).unwrap();
    let plain = b.alloc_region(4096, RegionOptions { export: true, ..Default::default() }).unwrap();
    link(&a, &b);
    let to = |r: &Region| {
        TransferRequest::new(
            TransferOp::Write,
            "b",
            vec![Desc::new(src.id(), 0, 16)],
            vec![Desc::new(r.id(), 0, 16)],
        )
    };
    assert_eq!(a.transport_for(&to(&shm)).unwrap(), TransportKind::Shm);
    assert_eq!(a.transport_for(&to(&plain)).unwrap(), TransportKind::Tcp);
    assert!(matches!(
        a.transport_for(&to(&plain).with_transport(TransportKind::Shm)),
        Err(TransferError::NoTransport { .. })
    ));
    pattern(&src, 1);
    a.post(to(&plain)).unwrap().wait().await.unwrap();
    assert_eq!(bytes(&plain, 0, 16), bytes(&src, 0, 16));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notification_arrives_after_the_data() {
    let (a, b) = pair().await;
    let src = a.alloc_region(6 << 20, RegionOptions::default()).unwrap();
    let dst = b.alloc_region(6 << 20, shared()).unwrap();
    link(&a, &b);
    for transport in [TransportKind::Tcp, TransportKind::Shm] {
        pattern(&src, transport as u8);
        let expected = xxh3_64(&bytes(&src, 0, 6 << 20));
        let req = TransferRequest::new(
            TransferOp::Write,
            "b",
            vec![Desc::new(src.id(), 0, 6 << 20)],
            vec![Desc::new(dst.id(), 0, 6 << 20)],
        )
        .with_transport(transport)
        .with_notify(format!("done-{transport}"));
        let handle = a.post(req).unwrap();
        // The receiver looks at its memory the moment the notification arrives.
        let n = tokio::time::timeout(Duration::from_secs(10), b.next_notification())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            xxh3_64(&bytes(&dst, 0, 6 << 20)),
            expected,
            "all bytes landed before {transport} notify"
        );
        assert_eq!(n.from, "a");
        assert_eq!(n.message, format!("done-{transport}").into_bytes());
        assert_eq!(n.transfer_id, handle.id());
        handle.wait().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_concurrent_transfers_from_many_tasks() {
    let (a, b) = pair().await;
    let src = a.alloc_region(16 << 20, RegionOptions::default()).unwrap();
    let dst = b.alloc_region(16 << 20, shared()).unwrap();
    link(&a, &b);
    pattern(&src, 9);
    let mut tasks = Vec::new();
    for i in 0..256u64 {
        let a = a.clone();
        let (s, d) = (src.id(), dst.id());
        tasks.push(tokio::spawn(async move {
            let transport = if i % 2 == 0 { TransportKind::Tcp } else { TransportKind::Shm };
            let off = i * 65_536;
            let req = TransferRequest::new(
                TransferOp::Write,
                "b",
                vec![Desc::new(s, off, 65_536)],
                vec![Desc::new(d, off, 65_536)],
            )
            .with_transport(transport)
            .with_checksum();
            a.post(req).unwrap().wait().await
        }));
    }
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    assert_eq!(bytes(&src, 0, 16 << 20), bytes(&dst, 0, 16 << 20));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_secret_is_rejected_and_moves_no_bytes() {
    let a = Agent::start(AgentConfig::new("a", b"wrong".to_vec())).await.unwrap();
    let b = agent("b").await;
    let src = a.alloc_region(4096, RegionOptions::default()).unwrap();
    let dst = b.alloc_region(4096, RegionOptions { export: true, ..Default::default() }).unwrap();
    pattern(&src, 5);
    link(&a, &b);
    for op in [TransferOp::Write, TransferOp::Read] {
        let req = TransferRequest::new(
            op,
            "b",
            vec![Desc::new(src.id(), 0, 4096)],
            vec![Desc::new(dst.id(), 0, 4096)],
        );
        let err = a.post(req).unwrap().wait().await.unwrap_err();
        assert!(matches!(err, TransferError::Auth(_)), "{err}");
    }
    assert!(bytes(&dst, 0, 4096).iter().all(|&x| x == 0), "no byte moved");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_bounds_remote_descriptors_move_no_byte() {
    let (a, b) = pair().await;
    let src = a.alloc_region(1 << 20, RegionOptions::default()).unwrap();
    let dst = b.alloc_region(65_536, RegionOptions { export: true, ..Default::default() }).unwrap();
    let private = b.alloc_region(65_536, RegionOptions::default()).unwrap();
    link(&a, &b);
    pattern(&src, 1);
    dst.fill(0, 65_536, 0xab).unwrap();
    for remote in [
        Desc::new(dst.id(), 65_000, 1000),
        Desc::new(dst.id(), u64::MAX - 10, 100),
        Desc::new(private.id(), 0, 100),
        Desc::new(kvfabric::RegionId(12345), 0, 100),
    ] {
        for op in [TransferOp::Write, TransferOp::Read] {
            // The first descriptor is valid: the whole transfer is refused before any byte.
            let req = TransferRequest::new(
                op,
                "b",
                vec![Desc::new(src.id(), 0, 100), Desc::new(src.id(), 200, remote.len)],
                vec![Desc::new(dst.id(), 0, 100), remote],
            );
            let err = a.post(req).unwrap_err();
            assert!(
                matches!(err, TransferError::RemoteDescriptor { index: 1, .. }),
                "{op:?} {remote:?}: {err}"
            );
        }
    }
    assert!(bytes(&dst, 0, 65_536).iter().all(|&x| x == 0xab));
    // Local descriptors are checked at post time too.
    let bad_local = TransferRequest::new(
        TransferOp::Write,
        "b",
        vec![Desc::new(src.id(), 1 << 20, 1)],
        vec![Desc::new(dst.id(), 0, 1)],
    );
    assert!(matches!(
        a.post(bad_local),
        Err(TransferError::Local { kind: MemoryErrorKind::OutOfBounds, .. })
    ));
}

/// A hostile or confused client whose metadata claims more than the owner exported: the owner
/// refuses on its side, and its memory stays untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_owner_refuses_descriptors_outside_its_exports() {
    let (a, b) = pair().await;
    let src = a.alloc_region(1 << 20, RegionOptions::default()).unwrap();
    let dst = b.alloc_region(65_536, RegionOptions { export: true, ..Default::default() }).unwrap();
    let private = b.alloc_region(65_536, RegionOptions::default()).unwrap();
    private.fill(0, 65_536, 0xcd).unwrap();
    dst.fill(0, 65_536, 0xab).unwrap();
    pattern(&src, 1);
    // Forged metadata: dst claims 1 MiB, and the private region appears as exported.
    let mut forged = b.metadata();
    forged.regions[0].len = 1 << 20;
    forged.regions.push(kvfabric::agent::ExportedRegion {
        id: private.id(),
        len: 65_536,
        shm_path: None,
        kind: Default::default(),
        cuda_ipc: None,
    });
    forged.regions.push(kvfabric::agent::ExportedRegion {
        id: kvfabric::RegionId(12345),
        len: 100,
        shm_path: None,
        kind: Default::default(),
        cuda_ipc: None,
    });
    a.load_peer(forged).unwrap();
    let cases = [
        (Desc::new(dst.id(), 65_000, 1000), ErrorCode::OutOfBounds),
        (Desc::new(dst.id(), 65_536, 1), ErrorCode::OutOfBounds),
        (Desc::new(private.id(), 0, 100), ErrorCode::NotExported),
        (Desc::new(kvfabric::RegionId(12345), 0, 100), ErrorCode::UnknownRegion),
    ];
    for (remote, code) in cases {
        for op in [TransferOp::Write, TransferOp::Read] {
            let req = TransferRequest::new(
                op,
                "b",
                vec![Desc::new(src.id(), 0, remote.len)],
                vec![remote],
            )
            .with_transport(TransportKind::Tcp);
            let err = a.post(req).unwrap().wait().await.unwrap_err();
            assert!(
                matches!(&err, TransferError::Remote { code: c, .. } if *c == code),
                "{op:?} {remote:?}: {err}"
            );
        }
    }
    assert!(bytes(&dst, 0, 65_536).iter().all(|&x| x == 0xab), "owner's memory untouched");
    assert!(bytes(&private, 0, 65_536).iter().all(|&x| x == 0xcd), "unexported memory untouched");
    // The connection still serves good requests after refusals.
    let ok = TransferRequest::new(
        TransferOp::Write,
        "b",
        vec![Desc::new(src.id(), 0, 100)],
        vec![Desc::new(dst.id(), 0, 100)],
    );
    a.post(ok).unwrap().wait().await.unwrap();
    assert_eq!(bytes(&dst, 0, 100), bytes(&src, 0, 100));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupted_checksums_are_caught_by_the_receiver() {
    let faults = FaultInjector::new();
    let mut cfg = AgentConfig::new("a", SECRET);
    cfg.faults = Some(faults.clone());
    let a = Agent::start(cfg).await.unwrap();
    let b = agent("b").await;
    let src = a.alloc_region(1 << 20, RegionOptions::default()).unwrap();
    let dst = b.alloc_region(1 << 20, shared()).unwrap();
    link(&a, &b);
    for transport in [TransportKind::Tcp, TransportKind::Shm] {
        for op in [TransferOp::Write, TransferOp::Read] {
            faults.corrupt_checksums_next(1);
            let req = TransferRequest::new(
                op,
                "b",
                vec![Desc::new(src.id(), 0, 1 << 20)],
                vec![Desc::new(dst.id(), 0, 1 << 20)],
            )
            .with_transport(transport)
            .with_checksum()
            .with_notify("must not arrive");
            let err = a.post(req).unwrap().wait().await.unwrap_err();
            assert!(
                matches!(
                    err,
                    TransferError::Checksum { .. }
                        | TransferError::Remote { code: ErrorCode::Checksum, .. }
                ),
                "{transport} {op:?}: {err}"
            );
        }
    }
    assert!(
        b.try_notifications().is_empty(),
        "no notification for a transfer that failed verification"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deadlines_cancellation_and_the_in_flight_limit() {
    let faults = FaultInjector::new();
    let mut cfg = AgentConfig::new("a", SECRET);
    cfg.faults = Some(faults.clone());
    cfg.limits.transfers_in_flight_max = 2;
    let a = Agent::start(cfg).await.unwrap();
    let b = agent("b").await;
    let src = a.alloc_region(4096, RegionOptions::default()).unwrap();
    let dst = b.alloc_region(4096, shared()).unwrap();
    link(&a, &b);
    let req = || {
        TransferRequest::new(
            TransferOp::Write,
            "b",
            vec![Desc::new(src.id(), 0, 64)],
            vec![Desc::new(dst.id(), 0, 64)],
        )
    };

    faults.hang_next(2);
    let start = Instant::now();
    let timed = a.post(req().with_deadline(Duration::from_millis(200))).unwrap();
    let cancelled = a.post(req().with_deadline(Duration::from_secs(60))).unwrap();
    // Two in flight: a third is refused at once, not queued.
    assert!(matches!(a.post(req()), Err(TransferError::Busy(2))));
    // A region leased by an in-flight transfer cannot be deregistered.
    assert!(a.deregister(src.id()).is_err());
    assert_eq!(timed.wait().await, Err(TransferError::TimedOut(Duration::from_millis(200))));
    assert!(start.elapsed() < Duration::from_secs(5));
    assert_eq!(timed.status(), TransferStatus::TimedOut);
    // A finished transfer released its permit and leases before reporting: the region can be
    // deregistered... (checked below, once the cancelled one is quiet too).
    cancelled.cancel();
    assert_eq!(cancelled.wait().await, Err(TransferError::Cancelled));
    assert_eq!(cancelled.status(), TransferStatus::Cancelled);
    // A cancelled one releases them once its task is gone: quiesced, not a guessed sleep.
    cancelled.quiesced().await;
    a.post(req()).unwrap().wait().await.unwrap();
    faults.fail_next(1);
    assert!(matches!(a.post(req()).unwrap().wait().await, Err(TransferError::Disconnected { .. })));
    // Each end is counted once, on its transport; the request refused as busy is not a
    // transfer.
    let kind = a.transport_for(&req()).unwrap();
    for c in a.transfer_counts() {
        let ends = (c.done, c.failed, c.timed_out, c.cancelled, c.bytes);
        let want = if c.transport == kind { (1, 1, 1, 1, 64) } else { (0, 0, 0, 0, 0) };
        assert_eq!(ends, want, "{}", c.transport);
    }
    drop(src);
    let id = a.metadata().regions.first().map(|r| r.id);
    assert!(id.is_none(), "a was never exporting");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_requests_are_refused_at_post() {
    let (a, b) = pair().await;
    let src = a.alloc_region(4096, RegionOptions::default()).unwrap();
    let dst = b.alloc_region(4096, shared()).unwrap();
    link(&a, &b);
    let d = |len| Desc::new(src.id(), 0, len);
    let r = |len| Desc::new(dst.id(), 0, len);
    for req in [
        TransferRequest::new(TransferOp::Write, "b", vec![], vec![]),
        TransferRequest::new(TransferOp::Write, "b", vec![d(10)], vec![r(10), r(10)]),
        TransferRequest::new(TransferOp::Write, "b", vec![d(10)], vec![r(11)]),
        TransferRequest::new(TransferOp::Write, "b", vec![d(0)], vec![r(0)]),
        TransferRequest::new(TransferOp::Write, "b", vec![d(10)], vec![r(10)])
            .with_notify(vec![0; 1 << 20]),
    ] {
        assert!(matches!(a.post(req), Err(TransferError::Invalid(_))));
    }
    let unknown = TransferRequest::new(TransferOp::Write, "zed", vec![d(10)], vec![r(10)]);
    assert!(matches!(a.post(unknown), Err(TransferError::UnknownPeer(_))));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_listener_fails_fast_with_a_typed_error() {
    let (a, b) = pair().await;
    let src = a.alloc_region(4096, RegionOptions::default()).unwrap();
    let dst = b.alloc_region(4096, RegionOptions { export: true, ..Default::default() }).unwrap();
    link(&a, &b);
    let (s, d) = (src.id(), dst.id());
    let b_addr = b.listen_addr();
    b.shutdown();
    drop(dst);
    drop(b);
    // The listener is closed once a connection is refused.
    let closed = Instant::now();
    while tokio::net::TcpStream::connect(b_addr).await.is_ok() {
        assert!(closed.elapsed() < Duration::from_secs(5), "b still listens");
        tokio::task::yield_now().await;
    }
    let start = Instant::now();
    let req = TransferRequest::new(
        TransferOp::Write,
        "b",
        vec![Desc::new(s, 0, 64)],
        vec![Desc::new(d, 0, 64)],
    );
    let err = a.post(req).unwrap().wait().await.unwrap_err();
    assert!(matches!(err, TransferError::Disconnected { .. }), "{err}");
    assert!(start.elapsed() < Duration::from_secs(6));
}

/// Plain OS threads post at once (no async caller): posting is thread-safe and lock-free
/// enough that all of them make progress, and every byte lands.
#[test]
fn many_os_threads_post_at_once() {
    let rt =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let (a, b) = rt.block_on(pair());
    let src = a.alloc_region(8 << 20, RegionOptions::default()).unwrap();
    let dst = b.alloc_region(8 << 20, shared()).unwrap();
    link(&a, &b);
    pattern(&src, 42);
    std::thread::scope(|s| {
        for t in 0..8u64 {
            let (a, handle) = (a.clone(), rt.handle().clone());
            let (sid, did) = (src.id(), dst.id());
            s.spawn(move || {
                for i in 0..64u64 {
                    let off = (t * 64 + i) * 16_384;
                    let transport =
                        if i % 2 == 0 { TransportKind::Shm } else { TransportKind::Tcp };
                    let req = TransferRequest::new(
                        TransferOp::Write,
                        "b",
                        vec![Desc::new(sid, off, 16_384)],
                        vec![Desc::new(did, off, 16_384)],
                    )
                    .with_transport(transport);
                    let h = a.post(req).unwrap();
                    handle.block_on(h.wait()).unwrap();
                }
            });
        }
    });
    assert_eq!(bytes(&src, 0, 8 << 20), bytes(&dst, 0, 8 << 20));
}

struct Echo;

impl kvfabric::agent::RpcHandler for Echo {
    fn handle<'a>(
        &'a self,
        from: &'a str,
        method: u16,
        body: Vec<u8>,
    ) -> kvfabric::agent::RpcReply<'a> {
        Box::pin(async move {
            match method {
                1 => Ok([from.as_bytes(), b":", &body].concat()),
                _ => Err(format!("no method {method}")),
            }
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rpc_reaches_the_peer_service_with_the_authenticated_name() {
    let (a, b) = pair().await;
    link(&a, &b);
    let d = Duration::from_secs(5);
    let err = a.call("b", 1, b"x".to_vec(), d).await.unwrap_err();
    assert!(matches!(err, TransferError::Remote { code: ErrorCode::Unavailable, .. }), "{err}");
    b.set_rpc_handler(Arc::new(Echo));
    assert_eq!(a.call("b", 1, b"hello".to_vec(), d).await.unwrap(), b"a:hello");
    let err = a.call("b", 9, vec![], d).await.unwrap_err();
    assert!(
        matches!(&err, TransferError::Remote { message, .. } if message.contains("no method 9")),
        "{err}"
    );
    assert_eq!(
        a.call("b", 1, vec![], d).await.unwrap(),
        b"a:",
        "the connection survives a refusal"
    );
    assert!(matches!(a.call("zed", 1, vec![], d).await, Err(TransferError::UnknownPeer(_))));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_sessions_are_closed_and_their_peers_reconnect_unnoticed() {
    use kvfabric::session::admission::Cause;
    let mut cfg = AgentConfig::new("b", SECRET);
    cfg.limits.connections.idle_timeout = Duration::from_millis(300);
    cfg.limits.connections.per_peer_max = 4;
    let b = Agent::start(cfg).await.unwrap();
    let a = agent("a").await;
    let src =
        a.alloc_region(1 << 20, RegionOptions { export: true, ..Default::default() }).unwrap();
    let dst =
        b.alloc_region(1 << 20, RegionOptions { export: true, ..Default::default() }).unwrap();
    link(&a, &b);
    let write = || {
        let d = [Desc::new(src.id(), 0, 1 << 20)];
        let r = [Desc::new(dst.id(), 0, 1 << 20)];
        TransferRequest::new(TransferOp::Write, "b", d.to_vec(), r.to_vec())
            .with_transport(TransportKind::Tcp)
    };
    pattern(&src, 1);
    a.post(write()).unwrap().wait().await.unwrap();
    assert!(b.connection_stats().admitted >= 1);
    // Idle past b's timeout: b closes a's stripes, and counts them.
    tokio::time::sleep(Duration::from_millis(800)).await;
    let s = b.connection_stats();
    assert_eq!(s.admitted, 0, "{s:?}");
    assert!(s.count(Cause::Idle) >= 1, "{s:?}");
    // a's next transfer opens new connections instead of failing on the closed ones.
    pattern(&src, 2);
    a.post(write()).unwrap().wait().await.unwrap();
    assert_eq!(bytes(&src, 0, 1 << 20), bytes(&dst, 0, 1 << 20));
    // a's stripes (4) fit b's per-peer limit: none was refused.
    let s = b.connection_stats();
    assert!(s.admitted <= 4 && s.count(Cause::Peer) == 0, "{s:?}");
}

mod tls {
    //! Mutual TLS between agents: certificates from one in-test CA, naming 127.0.0.1.

    use super::*;
    use kvfabric::testkit::{TestCa, TestCert};
    use kvfabric::tls::{Tls, TlsFiles};

    fn tls(ca: &TestCa, cert: &TestCert) -> Arc<Tls> {
        let files = TlsFiles {
            cert: cert.cert.clone(),
            key: cert.key.clone(),
            ca: Some(ca.ca()),
            client_ca: None,
        };
        Tls::load(files).unwrap()
    }

    /// An agent with TCP as its only transport between the test's agents.
    async fn agent_with(name: &str, tls: Option<Arc<Tls>>) -> Agent {
        let mut cfg = AgentConfig::new(name, SECRET);
        cfg.shm = false;
        cfg.rdma = None;
        cfg.tls = tls;
        Agent::start(cfg).await.unwrap()
    }

    async fn write(
        a: &Agent,
        peer: &str,
        src: &Region,
        dst: &Region,
        len: u64,
    ) -> Result<(), TransferError> {
        let mut req = TransferRequest::new(
            TransferOp::Write,
            peer,
            vec![Desc::new(src.id(), 0, len)],
            vec![Desc::new(dst.id(), 0, len)],
        )
        .with_transport(TransportKind::Tcp);
        req.checksum = true;
        req.deadline = Some(Duration::from_secs(10));
        a.post(req)?.wait().await.map(|_| ())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn mutual_tls_carries_transfers_and_refuses_plaintext_and_strangers_clearly() {
        let ca = TestCa::new("deployment").unwrap();
        let cert = || ca.issue(&["127.0.0.1"]).unwrap();
        let a = agent_with("a", Some(tls(&ca, &cert()))).await;
        let b = agent_with("b", Some(tls(&ca, &cert()))).await;
        let len = 5u64 << 20;
        let src = a.alloc_region(len as usize, shared()).unwrap();
        let dst = b.alloc_region(len as usize, shared()).unwrap();
        link(&a, &b);
        pattern(&src, 3);
        write(&a, "b", &src, &dst, len).await.unwrap();
        assert_eq!(bytes(&src, 0, len as usize), bytes(&dst, 0, len as usize));
        // And a READ back, through TLS the other way.
        dst.fill(0, 1 << 20, 9).unwrap();
        let req = TransferRequest::new(
            TransferOp::Read,
            "b",
            vec![Desc::new(src.id(), 0, 1 << 20)],
            vec![Desc::new(dst.id(), 0, 1 << 20)],
        )
        .with_transport(TransportKind::Tcp);
        a.post(req).unwrap().wait().await.unwrap();
        assert!(bytes(&src, 0, 1 << 20).iter().all(|&x| x == 9));

        // A plaintext peer of b is told that b requires TLS, and counted.
        let refused =
            kvfabric::tls::counters().plaintext_refused.load(std::sync::atomic::Ordering::Relaxed);
        let plain = agent_with("plain", None).await;
        let psrc = plain.alloc_region(4096, shared()).unwrap();
        link(&plain, &b);
        let err = write(&plain, "b", &psrc, &dst, 4096).await.unwrap_err();
        assert!(err.to_string().contains("requires mutual TLS"), "{err}");
        let now =
            kvfabric::tls::counters().plaintext_refused.load(std::sync::atomic::Ordering::Relaxed);
        assert!(now > refused, "the refusal is counted");

        // b dialling the plaintext peer: its TLS handshake fails, saying why.
        link(&b, &plain);
        let bsrc = b.alloc_region(4096, shared()).unwrap();
        let err = write(&b, "plain", &bsrc, &psrc, 4096).await.unwrap_err();
        assert!(matches!(err, TransferError::Tls { .. }), "{err}");
        assert!(err.to_string().contains("does not speak TLS"), "{err}");

        // A peer with a certificate of another CA gets nothing from b, and b none from it.
        let other = TestCa::new("another deployment").unwrap();
        let stranger =
            agent_with("stranger", Some(tls(&other, &other.issue(&["127.0.0.1"]).unwrap()))).await;
        let ssrc = stranger.alloc_region(4096, shared()).unwrap();
        link(&stranger, &b);
        let err = write(&stranger, "b", &ssrc, &dst, 4096).await.unwrap_err();
        assert!(err.to_string().contains("not signed by the CA"), "{err}");
        // A certificate that does not name the address dialled is refused too.
        let misnamed =
            agent_with("misnamed", Some(tls(&ca, &ca.issue(&["10.9.9.9"]).unwrap()))).await;
        let msrc = misnamed.alloc_region(4096, shared()).unwrap();
        link(&a, &misnamed);
        let err = write(&a, "misnamed", &src, &msrc, 4096).await.unwrap_err();
        assert!(err.to_string().contains("does not name the address"), "{err}");
    }

    #[test]
    fn expired_or_mismatched_certificates_are_refused_at_load_and_reload_keeps_the_old_on_error() {
        let ca = TestCa::new("deployment").unwrap();
        let expired = ca.issue_expired(&["127.0.0.1"]).unwrap();
        let files = |c: &TestCert| TlsFiles {
            cert: c.cert.clone(),
            key: c.key.clone(),
            ca: Some(ca.ca()),
            client_ca: None,
        };
        let e = Tls::load(files(&expired)).unwrap_err();
        assert!(e.to_string().contains("expired on"), "{e}");
        let (one, two) = (ca.issue(&["127.0.0.1"]).unwrap(), ca.issue(&["127.0.0.1"]).unwrap());
        let e = Tls::load(TlsFiles { key: two.key.clone(), ..files(&one) }).unwrap_err();
        assert!(
            e.to_string().contains("TLS configuration"),
            "a key that is not the certificate's: {e}"
        );
        let e = Tls::load(TlsFiles { cert: "/nonexistent/cert.pem".into(), ..files(&one) })
            .unwrap_err();
        assert!(e.to_string().contains("/nonexistent/cert.pem"), "{e}");

        // Reload: new files in place are picked up; a broken file keeps the old ones.
        let dir = tempfile::tempdir().unwrap();
        let live = TestCert { cert: dir.path().join("c.pem"), key: dir.path().join("k.pem") };
        std::fs::copy(&one.cert, &live.cert).unwrap();
        std::fs::copy(&one.key, &live.key).unwrap();
        let tls = Tls::load(files(&live)).unwrap();
        let before = tls.not_after();
        let now = std::time::SystemTime::now();
        let later = ca
            .issue_valid(
                &["127.0.0.1"],
                now - Duration::from_secs(60),
                now + Duration::from_secs(1000 * 86_400),
            )
            .unwrap();
        std::fs::copy(&later.cert, &live.cert).unwrap();
        std::fs::copy(&later.key, &live.key).unwrap();
        tls.reload().unwrap();
        assert!(tls.not_after() > before + 86_400, "the reloaded certificate is in use");
        std::fs::write(&live.cert, "not a certificate").unwrap();
        assert!(tls.reload().is_err());
        assert!(tls.not_after() > before + 86_400, "a failed reload keeps the certificate in use");
        assert!(tls.mutual());
    }
}
