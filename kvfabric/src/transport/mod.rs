//! Transports behind one trait, chosen per peer, fastest first: `local` (same agent),
//! `shm` (same host, other process), `tcp` (any host). A fault-injecting wrapper serves tests.
//!
//! A transport executes a [`Job`]: a transfer whose local descriptors are resolved, bounds
//! checked and leased, and whose remote descriptors are still the peer's to check. The trait
//! is shaped so that one-sided transports fit: RDMA (post READ/WRITE work requests on
//! registered memory, complete on the completion queue, notify with immediate data) and CUDA
//! (device regions, copies on streams) implement `execute` the same way.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Weak};

use crate::agent::{AgentInner, Peer};
use crate::memory::{Region, RegionLease};
use crate::transfer::{Desc, TransferError, TransferOp, TransportKind};

pub mod fault;
pub mod local;
pub mod shm;
pub mod tcp;

/// A boxed future of a transport.
pub type TransportFuture<'a> = Pin<Box<dyn Future<Output = Result<(), TransferError>> + Send + 'a>>;

/// One way of moving bytes.
pub trait Transport: Send + Sync + std::fmt::Debug {
    /// Which transport this is.
    fn kind(&self) -> TransportKind;
    /// Moves every byte of `job`, verifies checksums if asked, then delivers the notification.
    /// Dropping the future stops the transfer: no byte lands after the drop completes.
    fn execute<'a>(&'a self, job: &'a Job) -> TransportFuture<'a>;

    /// Completes `job` on the caller's thread when that is the fastest way — a one-sided copy
    /// that needs no message to the peer, up to [`Job::inline_bytes_max`] bytes — and returns
    /// its outcome; None when the job must run asynchronously through [`Transport::execute`].
    fn execute_inline(&self, _job: &Job) -> Option<Result<(), TransferError>> {
        None
    }
}

/// One local descriptor paired with its remote descriptor.
#[derive(Debug, Clone, Copy)]
pub struct Piece {
    /// Index of the local region in [`Job::leases`].
    pub lease: u32,
    /// Offset in the local region (checked).
    pub local_offset: u64,
    /// The remote descriptor (checked by the owner).
    pub remote: Desc,
}

impl Piece {
    /// Bytes.
    pub fn len(&self) -> u64 {
        self.remote.len
    }

    /// Whether it is empty (never, `post` refuses empty descriptors).
    pub fn is_empty(&self) -> bool {
        self.remote.len == 0
    }
}

/// A transfer ready for a transport.
#[derive(Debug, Clone)]
pub struct Job {
    /// The transfer id.
    pub id: u64,
    /// READ or WRITE.
    pub op: TransferOp,
    /// The peer, None for a local transfer.
    pub peer: Option<Arc<Peer>>,
    /// One lease per distinct local region the job touches.
    pub leases: Vec<RegionLease>,
    /// The descriptor pairs.
    pub pieces: Vec<Piece>,
    /// Checksum every descriptor.
    pub checksum: bool,
    /// The notification.
    pub notify: Option<Vec<u8>>,
    /// Jobs up to this many bytes may complete inline in `post` (memcpy transports).
    pub inline_bytes_max: u64,
    /// Fault injection: send checksums that do not match (the receiver must refuse).
    pub(crate) corrupt_checksums: bool,
    pub(crate) agent: Weak<AgentInner>,
}

impl Job {
    pub(crate) fn peer(&self) -> Result<&Arc<Peer>, TransferError> {
        self.peer
            .as_ref()
            .ok_or_else(|| TransferError::Invalid("remote transport without a peer".into()))
    }

    /// The local region of a piece.
    pub fn region(&self, p: &Piece) -> &Region {
        self.leases[p.lease as usize].region()
    }

    /// Total bytes.
    pub fn bytes(&self) -> u64 {
        self.pieces.iter().map(Piece::len).sum()
    }

    /// The checksum to send for bytes whose XXH3 is `sum`.
    pub(crate) fn sent_checksum(&self, sum: u64) -> u64 {
        if self.corrupt_checksums {
            sum ^ 1
        } else {
            sum
        }
    }

    pub(crate) fn agent(&self) -> Result<Arc<AgentInner>, TransferError> {
        self.agent.upgrade().ok_or(TransferError::Shutdown)
    }
}

#[derive(Debug)]
pub(crate) struct Transports {
    pub(crate) local: Arc<dyn Transport>,
    pub(crate) shm: Arc<dyn Transport>,
    pub(crate) tcp: Arc<dyn Transport>,
}

impl Transports {
    pub(crate) fn new(faults: Option<Arc<fault::FaultInjector>>) -> Self {
        let wrap = |t: Arc<dyn Transport>| -> Arc<dyn Transport> {
            match &faults {
                Some(f) => Arc::new(fault::FaultTransport::new(t, f.clone())),
                None => t,
            }
        };
        Transports {
            local: wrap(Arc::new(local::LocalTransport)),
            shm: wrap(Arc::new(shm::ShmTransport)),
            tcp: wrap(Arc::new(tcp::TcpTransport)),
        }
    }
}
