//! The server half: the accept loop, one task per connection driving a [`ServerProto`], and
//! the dispatch of authenticated requests to the endpoint (bulk WRITE/READ into and out of
//! exported regions, commits, checksums) and to the RPC service.
//!
//! Nothing is read before authentication but a small `Hello`, on time; every descriptor is
//! checked by [`Endpoint::lease_exported`] and its regions leased for the I/O; checksums are
//! verified before the acknowledgement.

use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::RwLock;
use tokio::io::AsyncReadExt;
use tokio::net::TcpListener;

use crate::endpoint::{verify, Endpoint, Notification, Refusal};
use crate::wire::{ErrorCode, Message};

use super::admission::Admission;
use super::io::{self, RawDst, RawSrc};
use super::proto::{ServerEvent, ServerParams, ServerProto, SessionError};
use super::RpcHandler;
use crate::tls::{Stream, Tls};

/// A refused WRITE's payload is drained (so the client reads a typed error) up to this size;
/// past it the connection is closed.
const DRAIN_BYTES_MAX: u64 = 1 << 30;
/// Server replies are bounded in time: a client that stops reading cannot pin the task (and
/// the leases it may hold).
const REPLY_TIMEOUT: Duration = Duration::from_secs(30);

/// What a session server serves: the endpoint and, optionally, an RPC service.
pub(crate) struct Services {
    pub(crate) endpoint: Arc<Endpoint>,
    pub(crate) rpc: RwLock<Option<Arc<dyn RpcHandler>>>,
    /// The RDMA transport, which answers peers' `RdmaConnect` (None: no device here).
    pub(crate) rdma: Option<Arc<dyn super::RdmaAcceptor>>,
}

impl std::fmt::Debug for Services {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Services").field("endpoint", &self.endpoint.name()).finish()
    }
}

/// The accept loop of an agent.
#[derive(Debug)]
pub(crate) struct SessionServer {
    task: tokio::task::JoinHandle<()>,
}

/// How connections are served.
#[derive(Debug, Clone)]
pub(crate) struct ServerTimeouts {
    /// Time for the rest of a frame, or a payload's next bytes, once it started.
    pub(crate) frame: Duration,
    /// The bound on TLS's handshake and ours together.
    pub(crate) handshake: Duration,
}

impl SessionServer {
    /// Serves `listener`; who gets in, for how long, is `admission`'s to say.
    pub(crate) fn spawn(
        listener: TcpListener,
        services: Weak<Services>,
        params: ServerParams,
        timeouts: ServerTimeouts,
        admission: Admission,
        tls: Option<Arc<Tls>>,
    ) -> Self {
        let task = tokio::spawn(async move {
            loop {
                let Ok((tcp, from)) = listener.accept().await else {
                    // Out of file descriptors or similar: back off instead of spinning.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                };
                if services.strong_count() == 0 {
                    return;
                }
                let Some(pending) = admission.admit(from.ip()) else { continue };
                let (params, services, timeouts, tls) =
                    (params.clone(), services.clone(), timeouts.clone(), tls.clone());
                tokio::spawn(async move {
                    let _ = tcp.set_nodelay(true);
                    let handshake = async {
                        let stream = super::handshake::accept_tls(
                            tls.as_deref(),
                            tcp,
                            from,
                            timeouts.handshake,
                        )
                        .await
                        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
                        let mut conn = Connection {
                            stream,
                            proto: ServerProto::new(params, io::random_nonce()),
                            services,
                            timeouts,
                        };
                        conn.handshake().await.map(|peer| (peer, conn))
                    };
                    let Some((admitted, conn)) = pending.authenticate_with(handshake).await else {
                        return;
                    };
                    let _ = conn.serve(admitted).await;
                });
            }
        });
        SessionServer { task }
    }

    pub(crate) fn stop(self) {
        self.task.abort();
    }
}

struct Connection {
    stream: Stream,
    proto: ServerProto,
    services: Weak<Services>,
    timeouts: ServerTimeouts,
}

/// Why a connection ends: the socket failed, or the protocol closed it (its error frame, if
/// any, was sent).
type End = std::io::Error;

fn ended(e: SessionError) -> End {
    std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string())
}

impl Connection {
    /// Sends what the state machine queued.
    async fn flush(&mut self) -> Result<(), End> {
        let bytes = self.proto.take_transmit();
        if bytes.is_empty() {
            return Ok(());
        }
        io::write_all(&mut self.stream, &bytes, REPLY_TIMEOUT).await
    }

    /// Reads the next event. Waiting for a frame to start is bounded by `idle` (None: by
    /// the caller, as the handshake is as a whole); the rest of a frame by the frame timeout.
    /// A protocol violation sends the error frame the state machine queued and ends the
    /// connection.
    async fn next_event(&mut self, idle: Option<Duration>) -> Result<ServerEvent, End> {
        loop {
            let mut buf = vec![0u8; self.proto.need()];
            let timeout = if self.proto.in_frame() { Some(self.timeouts.frame) } else { idle };
            io::read_exact(&mut self.stream, &mut buf, timeout).await?;
            match self.proto.recv(&buf) {
                Ok((_, Some(ev))) => {
                    self.flush().await?;
                    return Ok(ev);
                }
                Ok((_, None)) => {}
                Err(e) => {
                    let _ = self.flush().await;
                    return Err(ended(e));
                }
            }
        }
    }

    async fn reply(&mut self, msg: Message) -> Result<(), End> {
        let frame = self.proto.reply(&msg).map_err(ended)?;
        io::write_all(&mut self.stream, &frame, REPLY_TIMEOUT).await?;
        if self.proto.is_closed() {
            return Err(std::io::ErrorKind::ConnectionAborted.into());
        }
        Ok(())
    }

    async fn refuse(&mut self, r: Refusal) -> Result<(), End> {
        self.reply(Message::Error { code: r.code, message: r.message }).await
    }

    /// The challenge, and the client's proof: its authenticated name.
    async fn handshake(&mut self) -> Result<String, End> {
        self.flush().await?; // the challenge
        match self.next_event(None).await? {
            ServerEvent::Authenticated { peer } => Ok(peer),
            _ => Err(ended(SessionError::Misuse("a request before the hello"))),
        }
    }

    async fn serve(mut self, admitted: super::admission::Admitted) -> Result<(), End> {
        let peer = admitted.peer().to_string();
        loop {
            let event = match self.next_event(Some(admitted.idle_timeout())).await {
                Ok(ev) => ev,
                Err(e) if e.kind() == std::io::ErrorKind::TimedOut && !self.proto.in_frame() => {
                    admitted.idle_closed();
                    return Ok(());
                }
                Err(e) => return Err(e),
            };
            let ServerEvent::Request { message, .. } = event else {
                return Err(ended(SessionError::Misuse("a second authentication")));
            };
            let Some(services) = self.services.upgrade() else {
                return self.refuse(Refusal::new(ErrorCode::Unavailable, "agent shut down")).await;
            };
            let endpoint = services.endpoint.clone();
            let rpc = services.rpc.read().clone();
            let rdma = services.rdma.clone();
            drop(services);
            match message {
                Message::Write { descs, .. } => self.write(&endpoint, &descs).await?,
                Message::Read { descs, checksums, .. } => {
                    self.read(&endpoint, &descs, checksums).await?
                }
                Message::Commit { transfer_id, verify: descs, notify } => {
                    let checked = endpoint.lease_exported(&descs).and_then(|t| verify(&t));
                    let delivered = match (checked, notify) {
                        (Err(r), _) => Err(r),
                        (Ok(()), None) => Ok(()),
                        (Ok(()), Some(message)) => {
                            let n = Notification { from: peer.clone(), transfer_id, message };
                            endpoint.deliver(n).await
                        }
                    };
                    match delivered {
                        Ok(()) => self.reply(Message::Ack).await?,
                        Err(r) => self.refuse(r).await?,
                    }
                }
                Message::Checksums { descs } => match endpoint.lease_exported(&descs) {
                    Ok(targets) => {
                        let sums = targets.iter().map(|t| t.sum().unwrap_or(0)).collect();
                        self.reply(Message::ChecksumList { checksums: sums }).await?
                    }
                    Err(r) => self.refuse(r).await?,
                },
                Message::Rpc { method, body } => {
                    drop(endpoint);
                    let Some(handler) = rpc else {
                        let r = Refusal::new(ErrorCode::Unavailable, "no service on this agent");
                        self.refuse(r).await?;
                        continue;
                    };
                    let answer = tokio::time::timeout(
                        self.timeouts.frame,
                        handler.handle(&peer, method, body),
                    )
                    .await;
                    match answer {
                        Ok(Ok(body)) => self.reply(Message::RpcReply { body }).await?,
                        Ok(Err(message)) => {
                            self.refuse(Refusal::new(ErrorCode::Internal, message)).await?
                        }
                        Err(_) => {
                            self.refuse(Refusal::new(ErrorCode::Unavailable, "service timed out"))
                                .await?
                        }
                    }
                }
                Message::RdmaConnect(connect) => {
                    drop(endpoint);
                    let answer = match rdma {
                        // Verbs calls and memory registration block: off the runtime's threads.
                        Some(t) => {
                            let from = peer.clone();
                            tokio::task::spawn_blocking(move || t.accept(&from, &connect))
                                .await
                                .unwrap_or_else(|e| Err(format!("RDMA accept did not run: {e}")))
                        }
                        None => Err("this agent has no RDMA device".to_string()),
                    };
                    match answer {
                        Ok(accept) => self.reply(Message::RdmaAccept(accept)).await?,
                        Err(why) => self.refuse(Refusal::new(ErrorCode::Unavailable, why)).await?,
                    }
                }
                // The state machine lets only requests through.
                _ => return Err(ended(SessionError::Misuse("a non-request was dispatched"))),
            }
        }
    }

    /// A WRITE: the payload follows the frame and goes straight into the checked targets.
    async fn write(
        &mut self,
        endpoint: &Endpoint,
        descs: &[crate::wire::WireDesc],
    ) -> Result<(), End> {
        let total = self.proto.payload_remaining();
        let targets = match endpoint.lease_exported(descs) {
            Ok(t) => t,
            Err(refusal) => {
                // Drain the payload so that the client reads our typed refusal; the refused
                // bytes never touch a region. Too large to drain: refuse and close.
                if total <= DRAIN_BYTES_MAX {
                    let drained = tokio::time::timeout(
                        self.timeouts.frame,
                        tokio::io::copy(
                            &mut (&mut self.stream).take(total),
                            &mut tokio::io::sink(),
                        ),
                    )
                    .await;
                    if !matches!(drained, Ok(Ok(n)) if n == total) {
                        return Err(std::io::ErrorKind::UnexpectedEof.into());
                    }
                    self.proto.payload_received(total).map_err(ended)?;
                }
                return self.refuse(refusal).await;
            }
        };
        // The deadline is per descriptor (an inactivity bound), not for the whole payload,
        // so that slow links can still move large requests.
        for t in &targets {
            let dst = t.lease.region().ptr_at(t.offset, t.len).map_err(std::io::Error::other)?;
            // SAFETY: the range was checked against the exported region, which the lease
            // keeps registered and mapped for the whole read; bytes go in through raw
            // pointers, no reference to region memory is formed.
            unsafe {
                io::recv_into(&mut self.stream, RawDst(dst), t.len as usize, self.timeouts.frame)
            }
            .await?;
            self.proto.payload_received(t.len).map_err(ended)?;
        }
        let verdict = verify(&targets);
        // Release the regions before the Ack: once the client has every Ack it may notify
        // (on another stripe), and the receiver may then deregister at once.
        drop(targets);
        match verdict {
            Ok(()) => self.reply(Message::Ack).await,
            Err(r) => self.refuse(r).await,
        }
    }

    /// A READ: the reply frame and the payload leave in one vectored write, straight from
    /// the checked targets.
    async fn read(
        &mut self,
        endpoint: &Endpoint,
        descs: &[crate::wire::WireDesc],
        checksums: bool,
    ) -> Result<(), End> {
        let targets = match endpoint.lease_exported(descs) {
            Ok(t) => t,
            Err(r) => return self.refuse(r).await,
        };
        let sums = if checksums {
            targets.iter().map(|t| t.sum().unwrap_or(0)).collect()
        } else {
            Vec::new()
        };
        let frame = self.proto.reply(&Message::ReadData { checksums: sums }).map_err(ended)?;
        let mut bufs = Vec::with_capacity(targets.len() + 1);
        bufs.push(RawSrc(frame.as_ptr(), frame.len()));
        for t in &targets {
            let p = t.lease.region().ptr_at(t.offset, t.len).map_err(std::io::Error::other)?;
            bufs.push(RawSrc(p, t.len as usize));
        }
        // SAFETY: the frame lives in this scope; the ranges were checked against exported
        // regions that `targets` keeps leased past this call.
        unsafe { io::send_all(&mut self.stream, &bufs, self.timeouts.frame) }.await?;
        drop(bufs);
        drop(targets);
        Ok(())
    }
}
