//! The transfer engine across two real processes: this test and a `kvfabric peer` child,
//! over shm and tcp. The peer can be killed -9, fed malformed frames, or offered the wrong
//! secret.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvfabric::agent::{Agent, AgentConfig, AgentMetadata};
use kvfabric::memory::{Region, RegionOptions};
use kvfabric::transfer::{
    Desc, TransferError, TransferOp, TransferRequest, TransferStatus, TransportKind,
};
use kvfabric::wire::{handshake_mac, HandshakeRole, Message, WireLimits, HEADER_BYTES};
use xxhash_rust::xxh3::xxh3_64;

const SECRET: &str = "two-process-secret";
const PEER_BYTES: usize = 64 << 20;

struct PeerProc {
    child: Child,
    stdin: ChildStdin,
    lines: mpsc::Receiver<serde_json::Value>,
    md: AgentMetadata,
}

impl PeerProc {
    fn start() -> PeerProc {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvfabric"))
            .args([
                "peer",
                "--name",
                "peer",
                "--region-bytes",
                &PEER_BYTES.to_string(),
                "--seed",
                "3",
            ])
            .env("KVFABRIC_SECRET", SECRET)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start kvfabric peer");
        let stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel::<serde_json::Value>();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                if let Ok(v) = serde_json::from_str(&line) {
                    if tx.send(v).is_err() {
                        return;
                    }
                }
            }
        });
        let first = lines.recv_timeout(Duration::from_secs(30)).expect("peer metadata");
        let md = serde_json::from_value(first["metadata"].clone()).unwrap();
        PeerProc { child, stdin, lines, md }
    }

    fn next(&self) -> serde_json::Value {
        self.lines.recv_timeout(Duration::from_secs(20)).expect("a line from the peer")
    }

    fn sum(&mut self, off: u64, len: u64) -> u64 {
        writeln!(self.stdin, "sum {off} {len}").unwrap();
        loop {
            let v = self.next();
            if let Some(s) = v.get("sum").filter(|_| v.get("notified").is_none()) {
                return s.as_u64().expect("a sum");
            }
        }
    }

    fn region(&self) -> kvfabric::RegionId {
        self.md.regions[0].id
    }
}

impl Drop for PeerProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn local_agent(secret: &str) -> Agent {
    Agent::start(AgentConfig::new("test", secret.as_bytes().to_vec())).await.unwrap()
}

fn fill(r: &Region, seed: u64) {
    let v: Vec<u8> = (0..r.len() as u64).map(|i| (i.wrapping_mul(seed | 1) >> 3) as u8).collect();
    r.write_at(0, &v).unwrap();
}

fn local_sum(r: &Region, off: u64, len: u64) -> u64 {
    let mut v = vec![0u8; len as usize];
    r.read_at(off, &mut v).unwrap();
    xxh3_64(&v)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_arrive_intact_both_ways_over_shm_and_tcp() {
    let mut peer = PeerProc::start();
    let agent = local_agent(SECRET).await;
    agent.load_peer(peer.md.clone()).unwrap();
    let local = agent.alloc_region(32 << 20, RegionOptions::default()).unwrap();
    for (i, transport) in [TransportKind::Shm, TransportKind::Tcp].into_iter().enumerate() {
        fill(&local, 11 + i as u64);
        // A mix of sizes, 13 MiB in all, at odd offsets on both sides.
        let sizes = [4096u64, 1, 65_536, 1 << 20, 12 << 20];
        let (mut l, mut r) = (vec![], vec![]);
        let mut off = 0;
        for s in sizes {
            l.push(Desc::new(local.id(), off, s));
            r.push(Desc::new(peer.region(), off + 7, s));
            off += s + 512;
        }
        let w = TransferRequest::new(TransferOp::Write, "peer", l.clone(), r.clone())
            .with_transport(transport)
            .with_checksum();
        agent.post(w).unwrap().wait().await.unwrap();
        for (ld, rd) in l.iter().zip(&r) {
            assert_eq!(
                peer.sum(rd.offset, rd.len),
                local_sum(&local, ld.offset, ld.len),
                "{transport} write"
            );
        }
        // READ the peer's untouched pattern from further up its region.
        local.fill(0, 32 << 20, 0).unwrap();
        let r2: Vec<Desc> =
            r.iter().map(|d| Desc::new(d.region, d.offset + (32 << 20), d.len)).collect();
        let rd = TransferRequest::new(TransferOp::Read, "peer", l.clone(), r2.clone())
            .with_transport(transport)
            .with_checksum();
        agent.post(rd).unwrap().wait().await.unwrap();
        for (ld, rd) in l.iter().zip(&r2) {
            assert_eq!(
                local_sum(&local, ld.offset, ld.len),
                peer.sum(rd.offset, rd.len),
                "{transport} read"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notification_arrives_after_the_last_byte() {
    let peer = PeerProc::start();
    let agent = local_agent(SECRET).await;
    agent.load_peer(peer.md.clone()).unwrap();
    let local = agent.alloc_region(16 << 20, RegionOptions::default()).unwrap();
    for (i, transport) in [TransportKind::Shm, TransportKind::Tcp].into_iter().enumerate() {
        fill(&local, 21 + i as u64);
        let off = (i as u64) << 24;
        let w = TransferRequest::new(
            TransferOp::Write,
            "peer",
            vec![Desc::new(local.id(), 0, 16 << 20)],
            vec![Desc::new(peer.region(), off, 16 << 20)],
        )
        .with_transport(transport)
        .with_notify(format!("sum {off} {}", 16 << 20));
        agent.post(w).unwrap().wait().await.unwrap();
        // The peer hashed its memory the moment the notification arrived.
        let v = peer.next();
        assert_eq!(v["notified"], format!("sum {off} {}", 16 << 20));
        assert_eq!(v["from"], "test");
        assert_eq!(v["sum"].as_u64().unwrap(), local_sum(&local, 0, 16 << 20), "{transport}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_concurrent_transfers_to_another_process() {
    let mut peer = PeerProc::start();
    let agent = local_agent(SECRET).await;
    agent.load_peer(peer.md.clone()).unwrap();
    let local = agent.alloc_region(16 << 20, RegionOptions::default()).unwrap();
    fill(&local, 5);
    let mut handles = Vec::new();
    for i in 0..512u64 {
        let transport = if i % 2 == 0 { TransportKind::Tcp } else { TransportKind::Shm };
        let w = TransferRequest::new(
            TransferOp::Write,
            "peer",
            vec![Desc::new(local.id(), i * 32_768, 32_768)],
            vec![Desc::new(peer.region(), i * 32_768, 32_768)],
        )
        .with_transport(transport)
        .with_checksum();
        handles.push(agent.post(w).unwrap());
    }
    for h in handles {
        h.wait().await.unwrap();
    }
    assert_eq!(peer.sum(0, 16 << 20), local_sum(&local, 0, 16 << 20));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_killed_mid_transfer_fails_typed_within_the_deadline() {
    let mut peer = PeerProc::start();
    let agent = local_agent(SECRET).await;
    agent.load_peer(peer.md.clone()).unwrap();
    let local = agent.alloc_region(64 << 20, RegionOptions::default()).unwrap();
    let deadline = Duration::from_secs(10);
    let mut handles = Vec::new();
    for i in 0..16u64 {
        let (op, transport) = match i % 4 {
            0 => (TransferOp::Read, TransportKind::Tcp),
            1 => (TransferOp::Write, TransportKind::Tcp),
            // shm copies finish without the peer; the notification needs it alive.
            2 => (TransferOp::Write, TransportKind::Shm),
            _ => (TransferOp::Read, TransportKind::Shm),
        };
        let req = TransferRequest::new(
            op,
            "peer",
            vec![Desc::new(local.id(), 0, 64 << 20)],
            vec![Desc::new(peer.region(), 0, 64 << 20)],
        )
        .with_transport(transport)
        .with_notify("sum 0 1")
        .with_deadline(deadline);
        handles.push(agent.post(req).unwrap());
    }
    // Every transfer has started moving bytes (some shm copies may be done already) when
    // the peer dies.
    let started = Instant::now();
    while handles.iter().any(|h| h.status() == TransferStatus::Posted) {
        assert!(started.elapsed() < Duration::from_secs(10), "transfers did not start");
        tokio::task::yield_now().await;
    }
    let killed_at = Instant::now();
    peer.child.kill().unwrap(); // SIGKILL
    peer.child.wait().unwrap();
    let mut failed = 0;
    for h in handles {
        match h.wait().await {
            Ok(()) => {}
            Err(TransferError::Disconnected { .. } | TransferError::Remote { .. }) => failed += 1,
            Err(other) => panic!("expected a disconnection, got {other}"),
        }
    }
    assert!(killed_at.elapsed() < deadline, "every transfer ended before its deadline");
    assert!(failed > 0, "the kill interrupted transfers in flight");
    // And a new transfer to the dead peer fails fast, typed.
    let req = TransferRequest::new(
        TransferOp::Write,
        "peer",
        vec![Desc::new(local.id(), 0, 4096)],
        vec![Desc::new(peer.region(), 0, 4096)],
    )
    .with_transport(TransportKind::Tcp);
    let err = agent.post(req).unwrap().wait().await.unwrap_err();
    assert!(matches!(err, TransferError::Disconnected { .. }), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_secret_is_rejected_by_another_process() {
    let mut peer = PeerProc::start();
    let agent = local_agent("not-the-secret").await;
    // Its shared memory does not carry our deployment's seal: not even mapped.
    let err = agent.load_peer(peer.md.clone()).unwrap_err();
    assert!(err.to_string().contains("another deployment"), "{err}");
    // Seen as a peer on another host would be (no shm): its port refuses our proof.
    let mut remote = peer.md.clone();
    remote.host_id = "another host".into();
    agent.load_peer(remote).unwrap();
    let local = agent.alloc_region(4096, RegionOptions::default()).unwrap();
    fill(&local, 1);
    let before = peer.sum(0, 4096);
    for op in [TransferOp::Write, TransferOp::Read] {
        let req = TransferRequest::new(
            op,
            "peer",
            vec![Desc::new(local.id(), 0, 4096)],
            vec![Desc::new(peer.region(), 0, 4096)],
        )
        .with_transport(TransportKind::Tcp);
        let err = agent.post(req).unwrap().wait().await.unwrap_err();
        assert!(matches!(err, TransferError::Auth(_)), "{err}");
    }
    assert_eq!(peer.sum(0, 4096), before, "no byte written");
}

/// Raw frames against a real peer: garbage before and after authentication. The peer answers
/// with an error or closes the connection, never crashes, and keeps serving others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_frames_do_not_hurt_the_peer() {
    let mut peer = PeerProc::start();
    let addr = peer.md.tcp_addr;
    let limits = WireLimits::default();
    let read_frame = |s: &mut TcpStream| -> Option<Message> {
        let mut h = [0u8; HEADER_BYTES];
        s.read_exact(&mut h).ok()?;
        let len = u32::from_le_bytes([h[0], h[1], h[2], h[3]]) as usize;
        let mut body = vec![0u8; len];
        s.read_exact(&mut body).ok()?;
        let mut all = h.to_vec();
        all.extend_from_slice(&body);
        Message::decode_frame(&all, &limits).ok().map(|(_, m)| m)
    };
    let authenticated = |name: &str| -> TcpStream {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let Some(Message::Challenge { nonce: ns, .. }) = read_frame(&mut s) else {
            panic!("challenge")
        };
        let nc = [7u8; 32];
        let mac = handshake_mac(SECRET.as_bytes(), HandshakeRole::Client, &ns, &nc, name);
        s.write_all(&Message::Hello { client_name: name.into(), nonce: nc, mac }.encode(0))
            .unwrap();
        assert!(matches!(read_frame(&mut s), Some(Message::Welcome { .. })));
        s
    };
    let mut garbage: Vec<Vec<u8>> = vec![
        vec![0xff; 64],                                                    // nonsense
        vec![0, 0, 0, 0x7f, 1, 10, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],          // 2 GiB body claimed
        vec![4, 0, 0, 0, 9, 10, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4], // bad version
        vec![0, 0, 0, 0, 1, 200, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],            // unknown kind
    ];
    // A Write whose descriptor count says 2^31 in a 13-byte body.
    let mut w = Message::Write { transfer_id: 1, descs: vec![] }.encode(5);
    w[HEADER_BYTES + 8..HEADER_BYTES + 12].copy_from_slice(&0x8000_0000u32.to_le_bytes());
    garbage.push(w);
    // A Write whose payload never comes (the peer waits, then times out; we close first).
    let mut short = Message::Write {
        transfer_id: 2,
        descs: vec![kvfabric::wire::WireDesc {
            region: peer.region().0,
            offset: 0,
            len: 1 << 20,
            checksum: None,
        }],
    }
    .encode(6);
    short.extend_from_slice(&[1, 2, 3]);
    garbage.push(short);

    for g in &garbage {
        // Before authentication: the peer must not act on it.
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let _ = read_frame(&mut s);
        let _ = s.write_all(g);
        let reply = read_frame(&mut s);
        assert!(matches!(reply, None | Some(Message::Error { .. })), "{reply:?}");
        // After authentication.
        let mut s = authenticated("fuzzer");
        let _ = s.write_all(g);
        drop(s);
    }
    // A truncated frame then EOF, after authentication.
    let mut s = authenticated("fuzzer");
    s.write_all(&Message::Ack.encode(1)[..7]).unwrap();
    drop(s);

    // The peer is alive and serves a normal transfer.
    let agent = local_agent(SECRET).await;
    agent.load_peer(peer.md.clone()).unwrap();
    let local = agent.alloc_region(1 << 20, RegionOptions::default()).unwrap();
    fill(&local, 77);
    let req = TransferRequest::new(
        TransferOp::Write,
        "peer",
        vec![Desc::new(local.id(), 0, 1 << 20)],
        vec![Desc::new(peer.region(), 0, 1 << 20)],
    )
    .with_transport(TransportKind::Tcp)
    .with_checksum();
    agent.post(req).unwrap().wait().await.unwrap();
    assert_eq!(peer.sum(0, 1 << 20), local_sum(&local, 0, 1 << 20));
}
