//! `tcp`: any host. Several striped, authenticated connections per peer; large descriptors are
//! cut into stripe-sized chunks spread over the connections, written with vectored I/O
//! straight from the registered region and read straight into the destination region.
//!
//! Each connection carries one request at a time (request → response). A request whose
//! future is dropped mid-frame drops its connection too, so a half-sent frame is never
//! followed by another; the next request opens a fresh connection.
//!
//! The server side ([`TcpServer`]) authenticates every connection before reading anything
//! else, checks every descriptor against the exported bounds of its own regions, leases the
//! regions for the duration of the I/O, and verifies checksums before acknowledging.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Weak;
use std::time::Duration;

use futures_util::future::try_join_all;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::agent::{AgentConfig, AgentInner, AgentMetadata, Notification};
use crate::memory::{Region, RegionId, RegionLease};
use crate::transfer::{TransferError, TransferOp, TransportKind};
use crate::wire::{
    handshake_mac, verify_handshake_mac, ErrorCode, FrameHeader, HandshakeRole, Message, WireDesc,
    WireError, WireLimits, HEADER_BYTES, NONCE_BYTES,
};

use super::{Job, Transport, TransportFuture};

/// Most iovecs handed to one `writev` (the kernel's IOV_MAX is 1024).
const IOV_BATCH: usize = 512;
/// A refused WRITE's payload is drained (so the client reads a typed error) up to this size;
/// past it the connection is closed.
const DRAIN_BYTES_MAX: u64 = 1 << 30;

fn disconnected(peer: &str, e: impl std::fmt::Display) -> TransferError {
    TransferError::Disconnected { peer: peer.to_string(), reason: e.to_string() }
}

fn random_nonce() -> [u8; NONCE_BYTES] {
    let mut n = [0u8; NONCE_BYTES];
    // A nonce from the OS RNG; if the RNG fails, a nonce from the clock and a counter still
    // never repeats within a process (it only needs to be fresh, not secret).
    if getrandom::fill(&mut n).is_err() {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        n[..16].copy_from_slice(&t.to_le_bytes());
        n[16..24].copy_from_slice(&(COUNTER.fetch_add(1, Ordering::Relaxed) as u64).to_le_bytes());
    }
    n
}

/// Reads one frame: header, then body within `timeout`.
async fn read_frame(
    stream: &mut TcpStream,
    limits: &WireLimits,
    timeout: Duration,
) -> Result<(FrameHeader, Message), FrameReadError> {
    let mut header = [0u8; HEADER_BYTES];
    stream.read_exact(&mut header).await.map_err(FrameReadError::Io)?;
    let h = FrameHeader::decode(&header, limits).map_err(FrameReadError::Wire)?;
    let mut body = vec![0u8; h.body_len as usize];
    tokio::time::timeout(timeout, stream.read_exact(&mut body))
        .await
        .map_err(|_| FrameReadError::Timeout)?
        .map_err(FrameReadError::Io)?;
    let msg = Message::decode(h.kind, &body, limits).map_err(FrameReadError::Wire)?;
    Ok((h, msg))
}

#[derive(Debug)]
enum FrameReadError {
    Io(std::io::Error),
    Wire(WireError),
    Timeout,
}

impl std::fmt::Display for FrameReadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameReadError::Io(e) => write!(f, "{e}"),
            FrameReadError::Wire(e) => write!(f, "{e}"),
            FrameReadError::Timeout => f.write_str("frame timed out"),
        }
    }
}

/// Memory to send: an address and a length (a frame header, or a checked range of
/// registered memory kept alive by a lease).
#[derive(Clone, Copy)]
struct RawSrc(*const u8, usize);

// SAFETY: a plain address; every use goes through `send_all`'s contract.
unsafe impl Send for RawSrc {}
// SAFETY: as above; sharing the address grants nothing by itself.
unsafe impl Sync for RawSrc {}

/// Sends every byte of `bufs` with `writev(2)` on raw iovecs — no Rust reference to region
/// memory is formed, so a peer writing the same registered bytes concurrently makes the sent
/// bytes unspecified, never undefined behaviour. Each wait for the socket is bounded by
/// `stall` (an inactivity bound, not a bound on the whole payload).
///
/// # Safety
/// Every buffer must stay valid for reads until the future completes or is dropped.
async unsafe fn send_all(
    stream: &TcpStream,
    bufs: &[RawSrc],
    stall: Duration,
) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let (mut first, mut skip) = (0usize, 0usize);
    while first < bufs.len() {
        tokio::time::timeout(stall, stream.writable()).await.map_err(|_| {
            std::io::Error::new(std::io::ErrorKind::TimedOut, "peer stopped reading")
        })??;
        let fd = stream.as_raw_fd();
        let iov: Vec<libc::iovec> = bufs[first..]
            .iter()
            .take(IOV_BATCH)
            .enumerate()
            .map(|(k, b)| {
                let off = if k == 0 { skip } else { 0 };
                // SAFETY: `off` < b.1 (a fully sent buffer is skipped below), inside the buffer.
                let base = unsafe { b.0.add(off) };
                libc::iovec { iov_base: base as *mut libc::c_void, iov_len: b.1 - off }
            })
            .collect();
        let result = stream.try_io(tokio::io::Interest::WRITABLE, || {
            // SAFETY: the iovecs describe memory valid for reads (the caller's contract).
            let n = unsafe { libc::writev(fd, iov.as_ptr(), iov.len() as i32) };
            if n < 0 {
                Err(std::io::Error::last_os_error())
            } else {
                Ok(n as usize)
            }
        });
        let mut n = match result {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        };
        // Advance past what was sent.
        while n > 0 && first < bufs.len() {
            let left = bufs[first].1 - skip;
            if n >= left {
                n -= left;
                first += 1;
                skip = 0;
            } else {
                skip += n;
                n = 0;
            }
        }
        while first < bufs.len() && bufs[first].1 == 0 {
            first += 1;
        }
    }
    Ok(())
}

/// A destination address in registered memory.
#[derive(Clone, Copy)]
struct RawDst(*mut u8);

// SAFETY: a plain address; every use goes through `recv_into`'s contract.
unsafe impl Send for RawDst {}

/// Receives exactly `len` bytes from the socket straight into `dst` with `recv(2)`, without
/// forming a Rust reference to the destination (other peers may write the same registered
/// memory concurrently; with raw copies that is unspecified bytes, not undefined behaviour).
/// Each wait for data is bounded by `stall`.
///
/// # Safety
/// `dst..dst+len` must stay valid for writes until the future completes or is dropped.
async unsafe fn recv_into(
    stream: &TcpStream,
    dst: RawDst,
    len: usize,
    stall: Duration,
) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let mut done = 0usize;
    while done < len {
        tokio::time::timeout(stall, stream.readable()).await.map_err(|_| {
            std::io::Error::new(std::io::ErrorKind::TimedOut, "peer stopped sending")
        })??;
        let fd = stream.as_raw_fd();
        let result = stream.try_io(tokio::io::Interest::READABLE, || {
            // SAFETY: `dst + done .. dst + len` lies in memory valid for writes (the caller's
            // contract), and recv writes at most `len - done` bytes there.
            let n = unsafe { libc::recv(fd, dst.0.add(done).cast(), len - done, 0) };
            if n < 0 {
                Err(std::io::Error::last_os_error())
            } else {
                Ok(n as usize)
            }
        });
        match result {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Client side.

/// One authenticated connection to a peer.
#[derive(Debug)]
struct Conn {
    stream: TcpStream,
    next_request: u64,
}

/// A peer's connection stripes.
#[derive(Debug)]
pub(crate) struct TcpPeer {
    addr: SocketAddr,
    peer_name: String,
    my_name: String,
    secret: Vec<u8>,
    limits: WireLimits,
    handshake_timeout: Duration,
    frame_timeout: Duration,
    stripe_bytes: u64,
    stripes: Vec<tokio::sync::Mutex<Option<Conn>>>,
    next_stripe: AtomicUsize,
}

impl TcpPeer {
    pub(crate) fn new(md: &AgentMetadata, config: &AgentConfig) -> Self {
        TcpPeer {
            addr: md.tcp_addr,
            peer_name: md.name.clone(),
            my_name: config.name.clone(),
            secret: config.secret.clone(),
            limits: config.limits.wire,
            handshake_timeout: config.limits.handshake_timeout,
            frame_timeout: config.limits.frame_timeout,
            stripe_bytes: config.tcp_stripe_bytes,
            stripes: (0..config.tcp_connections_per_peer)
                .map(|_| tokio::sync::Mutex::new(None))
                .collect(),
            next_stripe: AtomicUsize::new(0),
        }
    }

    async fn connect(&self) -> Result<Conn, TransferError> {
        let peer = &self.peer_name;
        let fut = async {
            let mut stream =
                TcpStream::connect(self.addr).await.map_err(|e| disconnected(peer, e))?;
            stream.set_nodelay(true).map_err(|e| disconnected(peer, e))?;
            let (_, challenge) = read_frame(&mut stream, &self.limits, self.handshake_timeout)
                .await
                .map_err(|e| disconnected(peer, e))?;
            let Message::Challenge { server_name, nonce: nonce_s } = challenge else {
                return Err(TransferError::Protocol("expected a challenge".into()));
            };
            if server_name != *peer {
                return Err(TransferError::Protocol(format!(
                    "connected to {server_name:?}, expected {peer:?}"
                )));
            }
            let nonce_c = random_nonce();
            let mac = handshake_mac(
                &self.secret,
                HandshakeRole::Client,
                &nonce_s,
                &nonce_c,
                &self.my_name,
            );
            let hello = Message::Hello { client_name: self.my_name.clone(), nonce: nonce_c, mac };
            stream.write_all(&hello.encode(0)).await.map_err(|e| disconnected(peer, e))?;
            match read_frame(&mut stream, &self.limits, self.handshake_timeout).await {
                Ok((_, Message::Welcome { mac }))
                    if verify_handshake_mac(
                        &self.secret,
                        HandshakeRole::Server,
                        &nonce_c,
                        &nonce_s,
                        "",
                        &mac,
                    ) =>
                {
                    Ok(Conn { stream, next_request: 1 })
                }
                Ok((_, Message::Welcome { .. })) => Err(TransferError::Auth(peer.clone())),
                Ok((_, Message::Error { code: ErrorCode::Auth, .. })) => {
                    Err(TransferError::Auth(peer.clone()))
                }
                Ok((_, other)) => {
                    Err(TransferError::Protocol(format!("unexpected {other:?} in handshake")))
                }
                // A server that refuses the proof closes the connection after its error frame.
                Err(e) => Err(disconnected(peer, e)),
            }
        };
        tokio::time::timeout(self.handshake_timeout, fut)
            .await
            .map_err(|_| disconnected(peer, "connect and handshake timed out"))?
    }

    /// Stripe `i`'s connection, connected first if needed. Call [`StripeConn::keep`] after a
    /// clean request; a connection dropped otherwise is closed.
    async fn conn(&self, i: usize) -> Result<StripeConn<'_>, TransferError> {
        let mut slot = self.stripes[i % self.stripes.len()].lock().await;
        let conn = match slot.take() {
            Some(c) => c,
            None => self.connect().await?,
        };
        Ok(StripeConn { slot, conn })
    }

    async fn expect_ack(&self, conn: &mut Conn) -> Result<Message, TransferError> {
        match read_frame(&mut conn.stream, &self.limits, self.frame_timeout).await {
            Ok((_, Message::Error { code, message })) => {
                Err(TransferError::Remote { code, message })
            }
            Ok((_, m)) => Ok(m),
            Err(e) => Err(disconnected(&self.peer_name, e)),
        }
    }
}

/// A connection taken out of its stripe for one request.
struct StripeConn<'p> {
    slot: tokio::sync::MutexGuard<'p, Option<Conn>>,
    conn: Conn,
}

impl StripeConn<'_> {
    fn keep(self) {
        let StripeConn { mut slot, conn } = self;
        *slot = Some(conn);
    }
}

/// A piece of a job on one stripe.
#[derive(Debug, Clone)]
struct Chunk<'a> {
    region: &'a Region,
    local_offset: u64,
    remote_region: RegionId,
    remote_offset: u64,
    len: u64,
}

fn chunks(job: &Job, stripe_bytes: u64) -> Vec<Chunk<'_>> {
    let mut out = Vec::with_capacity(job.pieces.len());
    for p in &job.pieces {
        let mut done = 0;
        while done < p.len() {
            let len = (p.len() - done).min(stripe_bytes);
            out.push(Chunk {
                region: job.region(p),
                local_offset: p.local_offset + done,
                remote_region: p.remote.region,
                remote_offset: p.remote.offset + done,
                len,
            });
            done += len;
        }
    }
    out
}

/// Spreads chunks over `stripes` lists, balancing bytes, keeping each list in order.
fn stripe<'a>(chunks: Vec<Chunk<'a>>, stripes: usize) -> Vec<Vec<Chunk<'a>>> {
    let n = stripes.min(chunks.len()).max(1);
    let mut lists: Vec<Vec<Chunk<'a>>> = (0..n).map(|_| Vec::new()).collect();
    let mut bytes = vec![0u64; n];
    for c in chunks {
        let i = (0..n).min_by_key(|&i| (bytes[i], i)).unwrap_or(0);
        bytes[i] += c.len;
        lists[i].push(c);
    }
    lists
}

/// Moves bytes over striped TCP connections.
#[derive(Debug)]
pub struct TcpTransport;

impl TcpTransport {
    async fn run_stripe(
        peer: &TcpPeer,
        job: &Job,
        stripe_index: usize,
        list: Vec<Chunk<'_>>,
    ) -> Result<(), TransferError> {
        let per_request = (peer.limits.descs_per_request_max as usize)
            .min((peer.limits.frame_bytes_max as usize).saturating_sub(64) / 32)
            .max(1);
        for group in list.chunks(per_request) {
            let descs: Vec<WireDesc> = group
                .iter()
                .map(|c| {
                    let checksum = match (job.checksum, job.op) {
                        (true, TransferOp::Write) => {
                            Some(job.sent_checksum(c.region.checksum(c.local_offset, c.len)?))
                        }
                        _ => None,
                    };
                    Ok(WireDesc {
                        region: c.remote_region.0,
                        offset: c.remote_offset,
                        len: c.len,
                        checksum,
                    })
                })
                .collect::<Result<_, TransferError>>()?;
            let mut c = peer.conn(stripe_index).await?;
            match job.op {
                TransferOp::Write => write_request(peer, &mut c.conn, job.id, descs, group).await?,
                TransferOp::Read => read_request(peer, &mut c.conn, job, descs, group).await?,
            }
            c.keep();
        }
        Ok(())
    }
}

async fn write_request(
    peer: &TcpPeer,
    conn: &mut Conn,
    transfer_id: u64,
    descs: Vec<WireDesc>,
    group: &[Chunk<'_>],
) -> Result<(), TransferError> {
    let request_id = conn.next_request;
    conn.next_request += 1;
    let frame = Message::Write { transfer_id, descs }.encode(request_id);
    let mut bufs = Vec::with_capacity(group.len() + 1);
    bufs.push(RawSrc(frame.as_ptr(), frame.len()));
    for c in group {
        bufs.push(RawSrc(c.region.ptr_at(c.local_offset, c.len)?, c.len as usize));
    }
    // SAFETY: the frame lives in this function; the ranges were bounds-checked (ptr_at) in
    // regions the job leases until it ends, which is after this future.
    let sent = unsafe { send_all(&conn.stream, &bufs, peer.frame_timeout) }.await;
    // Even if our write failed, the server may have refused the request with a typed error
    // before closing: read it.
    let reply = peer.expect_ack(conn).await;
    match (sent, reply) {
        (_, Err(e @ TransferError::Remote { .. })) => Err(e),
        (Err(e), _) => Err(disconnected(&peer.peer_name, e)),
        (Ok(()), Ok(Message::Ack)) => Ok(()),
        (Ok(()), Ok(other)) => Err(TransferError::Protocol(format!("expected ack, got {other:?}"))),
        (Ok(()), Err(e)) => Err(e),
    }
}

async fn read_request(
    peer: &TcpPeer,
    conn: &mut Conn,
    job: &Job,
    descs: Vec<WireDesc>,
    group: &[Chunk<'_>],
) -> Result<(), TransferError> {
    let request_id = conn.next_request;
    conn.next_request += 1;
    let frame =
        Message::Read { transfer_id: job.id, descs, checksums: job.checksum }.encode(request_id);
    conn.stream.write_all(&frame).await.map_err(|e| disconnected(&peer.peer_name, e))?;
    let checksums = match peer.expect_ack(conn).await? {
        Message::ReadData { checksums } => checksums,
        other => return Err(TransferError::Protocol(format!("expected read data, got {other:?}"))),
    };
    if job.checksum && checksums.len() != group.len() {
        return Err(TransferError::Protocol("wrong number of checksums".into()));
    }
    for c in group {
        let dst = c.region.ptr_at(c.local_offset, c.len)?;
        // SAFETY: the range was bounds-checked (ptr_at) in a region the job leases, so it
        // stays mapped for the whole read; bytes go in through raw pointers, no reference.
        unsafe { recv_into(&conn.stream, RawDst(dst), c.len as usize, peer.frame_timeout) }
            .await
            .map_err(|e| disconnected(&peer.peer_name, e))?;
    }
    if job.checksum {
        for (i, (c, &expected)) in group.iter().zip(&checksums).enumerate() {
            if job.sent_checksum(c.region.checksum(c.local_offset, c.len)?) != expected {
                return Err(TransferError::Checksum { index: i });
            }
        }
    }
    Ok(())
}

/// Sends a commit (checksums to verify, a notification) on stripe 0 and waits for its ack.
pub(crate) async fn commit(
    peer: &TcpPeer,
    transfer_id: u64,
    verify: Vec<WireDesc>,
    notify: Option<Vec<u8>>,
) -> Result<(), TransferError> {
    let mut c = peer.conn(0).await?;
    let conn = &mut c.conn;
    let request_id = conn.next_request;
    conn.next_request += 1;
    let frame = Message::Commit { transfer_id, verify, notify }.encode(request_id);
    conn.stream.write_all(&frame).await.map_err(|e| disconnected(&peer.peer_name, e))?;
    match peer.expect_ack(conn).await? {
        Message::Ack => {
            c.keep();
            Ok(())
        }
        other => Err(TransferError::Protocol(format!("expected ack, got {other:?}"))),
    }
}

/// Calls the peer's RPC handler.
pub(crate) async fn call(
    peer: &TcpPeer,
    method: u16,
    body: Vec<u8>,
) -> Result<Vec<u8>, TransferError> {
    let stripe = peer.next_stripe.fetch_add(1, Ordering::Relaxed);
    let mut c = peer.conn(stripe).await?;
    let conn = &mut c.conn;
    let request_id = conn.next_request;
    conn.next_request += 1;
    let frame = Message::Rpc { method, body }.encode(request_id);
    conn.stream.write_all(&frame).await.map_err(|e| disconnected(&peer.peer_name, e))?;
    let reply = peer.expect_ack(conn).await;
    match reply {
        Ok(Message::RpcReply { body }) => {
            c.keep();
            Ok(body)
        }
        // A handler's refusal is a clean answer: the connection stays usable. Other
        // refusals (malformed, unavailable) come with the server closing it.
        Err(e @ TransferError::Remote { code: ErrorCode::Internal, .. }) => {
            c.keep();
            Err(e)
        }
        Ok(other) => Err(TransferError::Protocol(format!("expected an RPC reply, got {other:?}"))),
        Err(e) => Err(e),
    }
}

/// Asks the owner for checksums of its descriptors (shm READ verification).
pub(crate) async fn remote_checksums(
    peer: &TcpPeer,
    descs: Vec<WireDesc>,
) -> Result<Vec<u64>, TransferError> {
    let n = descs.len();
    let mut c = peer.conn(0).await?;
    let conn = &mut c.conn;
    let request_id = conn.next_request;
    conn.next_request += 1;
    let frame = Message::Checksums { descs }.encode(request_id);
    conn.stream.write_all(&frame).await.map_err(|e| disconnected(&peer.peer_name, e))?;
    match peer.expect_ack(conn).await? {
        Message::ChecksumList { checksums } if checksums.len() == n => {
            c.keep();
            Ok(checksums)
        }
        other => Err(TransferError::Protocol(format!("expected {n} checksums, got {other:?}"))),
    }
}

impl Transport for TcpTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }

    fn execute<'a>(&'a self, job: &'a Job) -> TransportFuture<'a> {
        Box::pin(async move {
            let peer = &job.peer()?.tcp;
            let lists = stripe(chunks(job, peer.stripe_bytes), peer.stripes.len());
            let first = peer.next_stripe.fetch_add(lists.len(), Ordering::Relaxed);
            try_join_all(
                lists
                    .into_iter()
                    .enumerate()
                    .map(|(i, list)| Self::run_stripe(peer, job, first + i, list)),
            )
            .await?;
            if let Some(n) = &job.notify {
                commit(peer, job.id, Vec::new(), Some(n.clone())).await?;
            }
            Ok(())
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Server side.

/// The accept loop of an agent.
#[derive(Debug)]
pub(crate) struct TcpServer {
    task: tokio::task::JoinHandle<()>,
}

impl TcpServer {
    pub(crate) fn spawn(listener: TcpListener, agent: Weak<AgentInner>) -> Self {
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _addr)) = listener.accept().await else {
                    // Out of file descriptors or similar: back off instead of spinning.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                };
                if agent.strong_count() == 0 {
                    return;
                }
                let agent = agent.clone();
                tokio::spawn(async move {
                    let _ = serve_connection(stream, agent).await;
                });
            }
        });
        TcpServer { task }
    }

    pub(crate) fn stop(self) {
        self.task.abort();
    }
}

/// A validated server-side descriptor.
struct Target {
    lease: RegionLease,
    offset: u64,
    len: u64,
    checksum: Option<u64>,
}

type Refusal = (ErrorCode, String);

/// Checks descriptors against this agent's exported regions.
fn validate(agent: &AgentInner, descs: &[WireDesc]) -> Result<Vec<Target>, Refusal> {
    descs
        .iter()
        .map(|d| {
            let region = agent.regions.get(RegionId(d.region)).map_err(|_| {
                (ErrorCode::UnknownRegion, format!("unknown region {}", RegionId(d.region)))
            })?;
            if !region.is_exported() {
                return Err((
                    ErrorCode::NotExported,
                    format!("region {} is not exported", region.id()),
                ));
            }
            region.check(d.offset, d.len).map_err(|e| (ErrorCode::OutOfBounds, e.to_string()))?;
            Ok(Target {
                lease: RegionLease::new(region),
                offset: d.offset,
                len: d.len,
                checksum: d.checksum,
            })
        })
        .collect()
}

fn verify(targets: &[Target]) -> Result<(), Refusal> {
    for (i, t) in targets.iter().enumerate() {
        if let Some(expected) = t.checksum {
            let actual = t
                .lease
                .region()
                .checksum(t.offset, t.len)
                .map_err(|e| (ErrorCode::Internal, e.to_string()))?;
            if actual != expected {
                return Err((ErrorCode::Checksum, format!("checksum mismatch on descriptor {i}")));
            }
        }
    }
    Ok(())
}

/// Server replies are bounded in time: a client that stops reading cannot pin the task (and
/// the leases it may hold).
const REPLY_TIMEOUT: Duration = Duration::from_secs(30);

async fn send(stream: &mut TcpStream, msg: Message, request_id: u64) -> std::io::Result<()> {
    tokio::time::timeout(REPLY_TIMEOUT, stream.write_all(&msg.encode(request_id)))
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "client stopped reading"))?
}

async fn refuse(
    stream: &mut TcpStream,
    (code, message): Refusal,
    request_id: u64,
) -> std::io::Result<()> {
    send(stream, Message::Error { code, message }, request_id).await
}

async fn serve_connection(mut stream: TcpStream, weak: Weak<AgentInner>) -> std::io::Result<()> {
    let (limits, secret, name, handshake_timeout, frame_timeout) = {
        let agent = weak.upgrade().ok_or(std::io::ErrorKind::NotConnected)?;
        let c = &agent.config;
        (
            c.limits.wire,
            c.secret.clone(),
            c.name.clone(),
            c.limits.handshake_timeout,
            c.limits.frame_timeout,
        )
    };
    stream.set_nodelay(true)?;
    // Handshake: nothing but a Hello, small and on time, is read before authentication.
    let hs_limits = WireLimits { frame_bytes_max: 4 + limits.text_bytes_max + 64, ..limits };
    let nonce_s = random_nonce();
    send(&mut stream, Message::Challenge { server_name: name, nonce: nonce_s }, 0).await?;
    let peer_name = match tokio::time::timeout(
        handshake_timeout,
        read_frame(&mut stream, &hs_limits, handshake_timeout),
    )
    .await
    {
        Ok(Ok((h, Message::Hello { client_name, nonce: nonce_c, mac })))
            if verify_handshake_mac(
                &secret,
                HandshakeRole::Client,
                &nonce_s,
                &nonce_c,
                &client_name,
                &mac,
            ) =>
        {
            let mac = handshake_mac(&secret, HandshakeRole::Server, &nonce_c, &nonce_s, "");
            send(&mut stream, Message::Welcome { mac }, h.request_id).await?;
            client_name
        }
        Ok(Ok((h, _))) => {
            refuse(&mut stream, (ErrorCode::Auth, "authentication failed".into()), h.request_id)
                .await?;
            return Ok(());
        }
        _ => return Ok(()),
    };
    drop(secret);

    loop {
        let (h, msg) = match read_frame(&mut stream, &limits, frame_timeout).await {
            Ok(f) => f,
            Err(FrameReadError::Wire(e)) => {
                let _ = refuse(&mut stream, (ErrorCode::Malformed, e.to_string()), 0).await;
                return Ok(());
            }
            Err(_) => return Ok(()),
        };
        let Some(agent) = weak.upgrade() else {
            let _ = refuse(
                &mut stream,
                (ErrorCode::Unavailable, "agent shut down".into()),
                h.request_id,
            )
            .await;
            return Ok(());
        };
        let id = h.request_id;
        match msg {
            Message::Write { descs, .. } => {
                let total: u64 = descs.iter().fold(0u64, |a, d| a.saturating_add(d.len));
                let targets = match validate(&agent, &descs) {
                    Ok(t) => t,
                    Err(refusal) => {
                        // Drain the payload so that the client reads our typed refusal; the
                        // refused bytes never touch a region.
                        if total > DRAIN_BYTES_MAX {
                            let _ = refuse(&mut stream, refusal, id).await;
                            return Ok(());
                        }
                        let drained = tokio::time::timeout(
                            frame_timeout,
                            tokio::io::copy(&mut (&mut stream).take(total), &mut tokio::io::sink()),
                        )
                        .await;
                        if !matches!(drained, Ok(Ok(n)) if n == total) {
                            return Ok(());
                        }
                        refuse(&mut stream, refusal, id).await?;
                        continue;
                    }
                };
                drop(agent);
                // The deadline is per descriptor (an inactivity bound), not for the whole
                // payload, so that slow links can still move large requests.
                for t in &targets {
                    let Ok(dst) = t.lease.region().ptr_at(t.offset, t.len) else { return Ok(()) };
                    // SAFETY: the range was checked against the exported region, which the
                    // lease keeps registered and mapped for the whole read; bytes go in
                    // through raw pointers, no reference to region memory is formed.
                    if unsafe { recv_into(&stream, RawDst(dst), t.len as usize, frame_timeout) }
                        .await
                        .is_err()
                    {
                        return Ok(());
                    }
                }
                let verdict = verify(&targets);
                // Release the regions before the Ack: once the client has every Ack it may
                // notify (on another stripe), and the receiver may then deregister at once.
                drop(targets);
                match verdict {
                    Ok(()) => send(&mut stream, Message::Ack, id).await?,
                    Err(refusal) => refuse(&mut stream, refusal, id).await?,
                }
            }
            Message::Read { descs, checksums, .. } => {
                let targets = match validate(&agent, &descs) {
                    Ok(t) => t,
                    Err(refusal) => {
                        refuse(&mut stream, refusal, id).await?;
                        continue;
                    }
                };
                drop(agent);
                let sums = if checksums {
                    targets
                        .iter()
                        .map(|t| t.lease.region().checksum(t.offset, t.len).unwrap_or(0))
                        .collect()
                } else {
                    Vec::new()
                };
                let frame = Message::ReadData { checksums: sums }.encode(id);
                let mut bufs = Vec::with_capacity(targets.len() + 1);
                bufs.push(RawSrc(frame.as_ptr(), frame.len()));
                for t in &targets {
                    let Ok(p) = t.lease.region().ptr_at(t.offset, t.len) else { return Ok(()) };
                    bufs.push(RawSrc(p, t.len as usize));
                }
                // SAFETY: the frame lives in this scope; the ranges were checked against
                // exported regions that `targets` keeps leased past this call.
                if unsafe { send_all(&stream, &bufs, frame_timeout) }.await.is_err() {
                    return Ok(());
                }
                drop(bufs);
                drop(targets);
            }
            Message::Commit { transfer_id, verify: descs, notify } => {
                let checked = validate(&agent, &descs).and_then(|t| verify(&t));
                if let Err(refusal) = checked {
                    refuse(&mut stream, refusal, id).await?;
                    continue;
                }
                if let Some(message) = notify {
                    let n = Notification { from: peer_name.clone(), transfer_id, message };
                    let tx = agent.notify_tx.clone();
                    drop(agent);
                    if tokio::time::timeout(frame_timeout, tx.send(n)).await.map(|r| r.is_ok())
                        != Ok(true)
                    {
                        refuse(
                            &mut stream,
                            (ErrorCode::Unavailable, "notification queue full".into()),
                            id,
                        )
                        .await?;
                        continue;
                    }
                }
                send(&mut stream, Message::Ack, id).await?;
            }
            Message::Rpc { method, body } => {
                let handler = agent.rpc_handler.read().clone();
                drop(agent);
                let Some(handler) = handler else {
                    refuse(
                        &mut stream,
                        (ErrorCode::Unavailable, "no service on this agent".into()),
                        id,
                    )
                    .await?;
                    continue;
                };
                match tokio::time::timeout(frame_timeout, handler.handle(&peer_name, method, body))
                    .await
                {
                    Ok(Ok(reply)) => {
                        send(&mut stream, Message::RpcReply { body: reply }, id).await?
                    }
                    Ok(Err(message)) => {
                        refuse(&mut stream, (ErrorCode::Internal, message), id).await?
                    }
                    Err(_) => {
                        refuse(
                            &mut stream,
                            (ErrorCode::Unavailable, "service timed out".into()),
                            id,
                        )
                        .await?
                    }
                }
            }
            Message::Checksums { descs } => match validate(&agent, &descs) {
                Ok(targets) => {
                    let sums = targets
                        .iter()
                        .map(|t| t.lease.region().checksum(t.offset, t.len).unwrap_or(0))
                        .collect();
                    send(&mut stream, Message::ChecksumList { checksums: sums }, id).await?;
                }
                Err(refusal) => refuse(&mut stream, refusal, id).await?,
            },
            other => {
                let text = format!("unexpected request {other:?}");
                let _ = refuse(
                    &mut stream,
                    (ErrorCode::Malformed, text.chars().take(200).collect()),
                    id,
                )
                .await;
                return Ok(());
            }
        }
    }
}
