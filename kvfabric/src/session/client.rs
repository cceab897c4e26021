//! The client half: a peer's pool of authenticated connections (stripes), each driving a
//! [`ClientProto`] over a socket, and the control requests every transport may need
//! (commit, checksums) plus RPC.
//!
//! Each connection carries one request at a time. A request whose future is dropped mid-frame
//! drops its connection too, so a half-sent frame is never followed by another; the next
//! request opens a fresh connection.
//!
//! RPCs have connections of their own, apart from the stripes. A call holds its connection
//! until the peer's handler answers, and a handler may itself move bytes back to the caller
//! over the caller's stripes (a fabric node's GET writes into the caller's memory). Two
//! agents calling each other at once, each call on a stripe the other's transfer needed,
//! once waited for each other until the transfer deadline. Requests on stripes are answered
//! by the peer's session server alone (bytes, commits, checksums), never by waiting on other
//! work, so a stripe is always given back soon.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::net::TcpStream;

use crate::tls::{Stream, Tls};
use crate::transfer::TransferError;
use crate::wire::{ErrorCode, Message, WireDesc, WireLimits};

use super::io::{self, RawDst, RawSrc};
use super::proto::{ClientEvent, ClientParams, ClientProto, SessionError};
use super::SessionConfig;

fn disconnected(peer: &str, e: impl std::fmt::Display) -> TransferError {
    TransferError::Disconnected { peer: peer.to_string(), reason: e.to_string() }
}

fn session_error(peer: &str, e: SessionError) -> TransferError {
    match e {
        SessionError::Auth => TransferError::Auth(peer.to_string()),
        SessionError::Closed => disconnected(peer, e),
        other => TransferError::Protocol(other.to_string()),
    }
}

/// A kept connection idle longer than this is closed rather than reused: servers close
/// sessions idle for their idle timeout ([`super::admission::AdmissionLimits::idle_timeout`],
/// 120 s by default), and a request must not race that close.
const IDLE_REUSE_MAX: Duration = Duration::from_secs(60);

/// RPC connections a session opens to its peer at most; a call past them waits for one.
/// With the stripes (4 by default) they stay well inside a server's admitted connections per
/// peer ([`super::admission::AdmissionLimits::per_peer_max`], 64 for an agent's port).
pub(crate) const RPC_CONNECTIONS_MAX: usize = 16;

/// One authenticated connection.
#[derive(Debug)]
struct Conn {
    stream: Stream,
    proto: ClientProto,
    last_used: std::time::Instant,
}

impl Conn {
    /// Whether it can carry the next request: ready, used recently, and not closed by the
    /// server meanwhile (a server sends nothing unasked, so anything readable — its end of
    /// stream above all — means the connection is over).
    fn reusable(&self) -> bool {
        if !self.proto.is_ready() || self.last_used.elapsed() > IDLE_REUSE_MAX {
            return false;
        }
        !self.stream.closed_or_unasked()
    }
}

/// A peer's session: its connection stripes.
#[derive(Debug)]
pub(crate) struct Session {
    addr: SocketAddr,
    params: ClientParams,
    handshake_timeout: Duration,
    frame_timeout: Duration,
    stripe_bytes: u64,
    tls: Option<std::sync::Arc<Tls>>,
    stripes: Vec<tokio::sync::Mutex<Option<Conn>>>,
    next_stripe: AtomicUsize,
    /// RPC connections not in use (see the module's notes).
    rpc_idle: parking_lot::Mutex<Vec<Conn>>,
    /// One per RPC connection in use.
    rpc_permits: tokio::sync::Semaphore,
}

impl Session {
    /// A session with the agent `peer` at `addr`; connections open on first use.
    pub(crate) fn new(addr: SocketAddr, peer: &str, cfg: &SessionConfig) -> Self {
        Session {
            addr,
            params: ClientParams {
                me: cfg.name.clone(),
                peer: peer.to_string(),
                secret: cfg.secret.clone(),
                limits: cfg.limits,
            },
            handshake_timeout: cfg.handshake_timeout,
            frame_timeout: cfg.frame_timeout,
            stripe_bytes: cfg.stripe_bytes,
            tls: cfg.tls.clone(),
            stripes: (0..cfg.connections.max(1)).map(|_| tokio::sync::Mutex::new(None)).collect(),
            next_stripe: AtomicUsize::new(0),
            rpc_idle: parking_lot::Mutex::new(Vec::new()),
            rpc_permits: tokio::sync::Semaphore::new(RPC_CONNECTIONS_MAX),
        }
    }

    /// The peer's name.
    pub(crate) fn peer(&self) -> &str {
        &self.params.peer
    }

    /// Wire limits of this session.
    pub(crate) fn limits(&self) -> &WireLimits {
        &self.params.limits
    }

    /// Bulk transfers are cut into pieces of at most this many bytes.
    pub(crate) fn stripe_bytes(&self) -> u64 {
        self.stripe_bytes
    }

    /// How many connections the session keeps.
    pub(crate) fn stripes(&self) -> usize {
        self.stripes.len()
    }

    /// Reserves `n` consecutive stripe indices (round robin across requests).
    pub(crate) fn next_stripes(&self, n: usize) -> usize {
        self.next_stripe.fetch_add(n, Ordering::Relaxed)
    }

    async fn connect(&self) -> Result<Conn, TransferError> {
        let peer = self.peer();
        let fut = async {
            let tcp = TcpStream::connect(self.addr).await.map_err(|e| disconnected(peer, e))?;
            tcp.set_nodelay(true).map_err(|e| disconnected(peer, e))?;
            let mut stream = crate::tls::connect_peer(
                self.tls.as_deref(),
                tcp,
                self.addr,
                self.handshake_timeout,
            )
            .await
            .map_err(|e| TransferError::Tls { peer: peer.to_string(), reason: e.to_string() })?;
            let mut proto = ClientProto::new(self.params.clone(), io::random_nonce());
            loop {
                let event =
                    read_event(&mut stream, &mut proto, peer, self.handshake_timeout).await?;
                let hello = proto.take_transmit();
                if !hello.is_empty() {
                    io::write_all(&mut stream, &hello, self.handshake_timeout)
                        .await
                        .map_err(|e| disconnected(peer, e))?;
                }
                if event == Some(ClientEvent::Authenticated) {
                    return Ok(Conn { stream, proto, last_used: std::time::Instant::now() });
                }
            }
        };
        tokio::time::timeout(self.handshake_timeout, fut)
            .await
            .map_err(|_| disconnected(peer, "connect and handshake timed out"))?
    }

    /// Stripe `i`'s connection, connected first if needed. Call [`StripeConn::keep`] after a
    /// clean request; a connection dropped otherwise is closed.
    pub(crate) async fn conn(&self, i: usize) -> Result<StripeConn<'_>, TransferError> {
        let mut slot = self.stripes[i % self.stripes.len()].lock().await;
        let conn = match slot.take() {
            Some(c) if c.reusable() => c,
            _ => self.connect().await?,
        };
        Ok(StripeConn { session: self, home: Home::Stripe(slot), conn })
    }

    /// An RPC connection: an idle one still usable, else a new one.
    async fn rpc_conn(&self) -> Result<StripeConn<'_>, TransferError> {
        let permit = self
            .rpc_permits
            .acquire()
            .await
            .map_err(|_| disconnected(self.peer(), "session closed"))?;
        let idle = loop {
            let Some(c) = self.rpc_idle.lock().pop() else { break None };
            if c.reusable() {
                break Some(c);
            }
        };
        let conn = match idle {
            Some(c) => c,
            None => self.connect().await?,
        };
        Ok(StripeConn { session: self, home: Home::Rpc(permit), conn })
    }

    /// Sends a commit (checksums to verify, a notification) on stripe 0 and waits for its
    /// acknowledgement: the owner verifies, then delivers the notification.
    pub(crate) async fn commit(
        &self,
        transfer_id: u64,
        verify: Vec<WireDesc>,
        notify: Option<Vec<u8>>,
    ) -> Result<(), TransferError> {
        let mut c = self.conn(0).await?;
        c.send(&Message::Commit { transfer_id, verify, notify }).await?;
        match c.reply().await? {
            Message::Ack => {
                c.keep();
                Ok(())
            }
            other => Err(TransferError::Protocol(format!("expected ack, got {other:?}"))),
        }
    }

    /// Asks the owner for the checksums of its descriptors (to verify a one-sided READ).
    pub(crate) async fn checksums(&self, descs: Vec<WireDesc>) -> Result<Vec<u64>, TransferError> {
        let mut c = self.conn(0).await?;
        c.send(&Message::Checksums { descs }).await?;
        match c.reply().await? {
            Message::ChecksumList { checksums } => {
                c.keep();
                Ok(checksums)
            }
            other => Err(TransferError::Protocol(format!("expected checksums, got {other:?}"))),
        }
    }

    /// Asks the peer to connect RDMA queue pairs to ours; its queue pairs and region keys.
    pub(crate) async fn rdma_connect(
        &self,
        connect: &crate::wire::rdma::Connect,
    ) -> Result<crate::wire::rdma::Accept, TransferError> {
        let mut c = self.conn(0).await?;
        c.send(&Message::RdmaConnect(connect.clone())).await?;
        match c.reply().await? {
            Message::RdmaAccept(a) => {
                c.keep();
                Ok(a)
            }
            other => {
                Err(TransferError::Protocol(format!("expected an RDMA accept, got {other:?}")))
            }
        }
    }

    /// Calls the peer's RPC service.
    pub(crate) async fn call(&self, method: u16, body: Vec<u8>) -> Result<Vec<u8>, TransferError> {
        let mut c = self.rpc_conn().await?;
        c.send(&Message::Rpc { method, body }).await?;
        match c.reply().await {
            Ok(Message::RpcReply { body }) => {
                c.keep();
                Ok(body)
            }
            // A handler's refusal is a clean answer: the connection stays usable.
            Err(e @ TransferError::Remote { code: ErrorCode::Internal, .. }) => {
                c.keep();
                Err(e)
            }
            Ok(other) => {
                Err(TransferError::Protocol(format!("expected an RPC reply, got {other:?}")))
            }
            Err(e) => Err(e),
        }
    }
}

/// Reads until the state machine yields an event (`None`: the handshake went on and there
/// may be bytes to send). The header of a reply may take as long as the request's deadline;
/// the rest of a frame must follow within `frame_timeout`.
async fn read_event(
    stream: &mut Stream,
    proto: &mut ClientProto,
    peer: &str,
    frame_timeout: Duration,
) -> Result<Option<ClientEvent>, TransferError> {
    let mut started = false;
    loop {
        let mut buf = vec![0u8; proto.need()];
        let timeout = started.then_some(frame_timeout);
        io::read_exact(stream, &mut buf, timeout).await.map_err(|e| disconnected(peer, e))?;
        started = true;
        let (_, event) = proto.recv(&buf).map_err(|e| session_error(peer, e))?;
        if event.is_some() || proto.has_transmit() {
            return Ok(event);
        }
    }
}

/// Where a connection in use goes back to.
enum Home<'s> {
    /// Its stripe, held until then.
    Stripe(tokio::sync::MutexGuard<'s, Option<Conn>>),
    /// The idle RPC connections; the permit is this connection's place among them.
    Rpc(tokio::sync::SemaphorePermit<'s>),
}

/// A connection taken out of its stripe (or the RPC connections) for one request.
pub(crate) struct StripeConn<'s> {
    session: &'s Session,
    home: Home<'s>,
    conn: Conn,
}

impl StripeConn<'_> {
    /// Puts the connection back for the next request (only after a clean exchange).
    pub(crate) fn keep(self) {
        let StripeConn { session, home, mut conn } = self;
        conn.last_used = std::time::Instant::now();
        match home {
            Home::Stripe(mut slot) => *slot = Some(conn),
            Home::Rpc(_permit) => session.rpc_idle.lock().push(conn),
        }
    }

    fn peer(&self) -> &str {
        self.session.peer()
    }

    /// Sends a request frame.
    pub(crate) async fn send(&mut self, msg: &Message) -> Result<(), TransferError> {
        let frame = self.conn.proto.request(msg).map_err(|e| session_error(self.peer(), e))?;
        io::write_all(&mut self.conn.stream, &frame, self.session.frame_timeout)
            .await
            .map_err(|e| disconnected(self.session.peer(), e))
    }

    /// Sends a request frame followed by its payload in one vectored write; I/O errors are
    /// returned raw so the caller can still read the peer's typed refusal.
    ///
    /// # Safety
    /// Every payload buffer must stay valid for reads until the future completes or drops.
    pub(crate) async unsafe fn send_with_payload(
        &mut self,
        msg: &Message,
        payload: &[RawSrc],
    ) -> Result<std::io::Result<()>, TransferError> {
        let frame = self.conn.proto.request(msg).map_err(|e| session_error(self.peer(), e))?;
        let mut bufs = Vec::with_capacity(payload.len() + 1);
        bufs.push(RawSrc(frame.as_ptr(), frame.len()));
        bufs.extend_from_slice(payload);
        // SAFETY: the frame lives in this function; the payload is the caller's contract.
        Ok(unsafe { io::send_all(&mut self.conn.stream, &bufs, self.session.frame_timeout) }.await)
    }

    /// Reads the reply to the request; an `Error` frame becomes [`TransferError::Remote`].
    pub(crate) async fn reply(&mut self) -> Result<Message, TransferError> {
        let peer = self.session.peer();
        let ev = read_event(
            &mut self.conn.stream,
            &mut self.conn.proto,
            peer,
            self.session.frame_timeout,
        )
        .await?;
        match ev {
            Some(ClientEvent::Reply(Message::Error { code, message })) => {
                Err(TransferError::Remote { code, message })
            }
            Some(ClientEvent::Reply(m)) => Ok(m),
            other => Err(TransferError::Protocol(format!("expected a reply, got {other:?}"))),
        }
    }

    /// Receives `len` bytes of the reply's payload straight into `dst`.
    ///
    /// # Safety
    /// `dst..dst+len` must stay valid for writes until the future completes or drops.
    pub(crate) async unsafe fn recv_payload(
        &mut self,
        dst: RawDst,
        len: u64,
    ) -> Result<(), TransferError> {
        if len > self.conn.proto.payload_remaining() {
            return Err(TransferError::Protocol("more payload asked than the reply has".into()));
        }
        // SAFETY: the caller's contract.
        unsafe {
            io::recv_into(&mut self.conn.stream, dst, len as usize, self.session.frame_timeout)
        }
        .await
        .map_err(|e| disconnected(self.session.peer(), e))?;
        self.conn.proto.payload_received(len).map_err(|e| session_error(self.session.peer(), e))
    }
}
