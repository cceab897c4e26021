//! The session layer: authenticated connections between agents, request/response on them,
//! and the server that dispatches requests to the local endpoint.
//!
//! - [`proto`]: the protocol as sans-IO state machines (handshake, request sequencing,
//!   payload accounting), tested without sockets, including hostile and truncated input.
//! - `client`: a peer's pool of connections (stripes) that drives the client state machine,
//!   and the control requests every transport may need: `Commit` (verify checksums, deliver
//!   a notification), `Checksums` (the owner's hashes for a one-sided READ) and RPC.
//! - `server`: the accept loop and dispatch — bulk WRITE/READ with the payload inline on the
//!   connection (the `tcp` transport's wire format), commits, checksums, RPC.
//! - `io`: socket I/O, including the zero-copy payload paths between sockets and regions.
//! - [`handshake`]: the same authenticated handshake for other protocols over any stream (the
//!   frontend ↔ worker protocol).
//!
//! Bulk transports sit beside the session, not inside it (see [`crate::transport`]): `tcp`
//! moves bytes as session requests with inline payload; `shm` copies through shared memory
//! and uses the session only to commit; RDMA and CUDA transports will do the same — move
//! bytes by their own means, then commit through the session.

use std::time::Duration;

use crate::wire::WireLimits;

pub mod admission;
pub(crate) mod client;
pub mod handshake;
pub(crate) mod io;
pub mod proto;
pub(crate) mod server;

/// What an [`RpcHandler`] answers, in time: the reply's bytes, or a refusal's text.
pub type RpcReply<'a> =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<Vec<u8>, String>> + Send + 'a>>;

/// A service on top of an agent (the fabric node, for example): it answers RPCs that
/// authenticated peers send with [`crate::Agent::call`]. Handlers run with the frame timeout
/// as their deadline.
pub trait RpcHandler: Send + Sync {
    /// Answers `method` with `body` from the authenticated peer `from`; an `Err` reaches the
    /// caller as a typed refusal with the text.
    fn handle<'a>(&'a self, from: &'a str, method: u16, body: Vec<u8>) -> RpcReply<'a>;
}

/// What answers a peer's `RdmaConnect`: the RDMA transport, when this agent has a device.
/// Called on the blocking pool (verbs calls and memory registration block).
pub trait RdmaAcceptor: Send + Sync + std::fmt::Debug {
    /// Queue pairs for the peer `from`'s, connected, and the keys of the exported regions;
    /// or why not.
    fn accept(
        &self,
        from: &str,
        connect: &crate::wire::rdma::Connect,
    ) -> Result<crate::wire::rdma::Accept, String>;
}

/// How this agent opens sessions with its peers.
#[derive(Debug, Clone)]
pub(crate) struct SessionConfig {
    /// Our name.
    pub(crate) name: String,
    /// The shared secret.
    pub(crate) secret: crate::secret::Secret,
    /// Mutual TLS with peers, when configured.
    pub(crate) tls: Option<std::sync::Arc<crate::tls::Tls>>,
    /// Wire limits.
    pub(crate) limits: WireLimits,
    /// Connect-to-authenticated bound.
    pub(crate) handshake_timeout: Duration,
    /// Time for the rest of a frame once it started.
    pub(crate) frame_timeout: Duration,
    /// Connections per peer.
    pub(crate) connections: usize,
    /// Bulk pieces are at most this many bytes (the `tcp` transport's stripe size).
    pub(crate) stripe_bytes: u64,
}
