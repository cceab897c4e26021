//! Bulk transports behind one trait, chosen per peer, fastest first: `local` (same agent),
//! `shm` (same host, other process), `tcp` (any host). A fault-injecting wrapper serves tests.
//!
//! # Where a transport plugs in
//!
//! A transport moves the bytes of a [`Job`]: a transfer whose shape was checked, whose local
//! descriptors are resolved, bounds-checked and leased ([`crate::endpoint`]), and whose remote
//! descriptors were checked against the peer's metadata (the owner checks them again). It
//! sees three things and nothing else:
//! - the job: its leased local regions and descriptor pairs, READ or WRITE, whether to
//!   checksum, the notification;
//! - the peer ([`Job::peer`]): its metadata and its session — the authenticated control
//!   connection with `commit` (the owner verifies checksums, then delivers the notification)
//!   and `checksums` (the owner's hashes of its bytes, to verify a one-sided READ);
//! - the local [`crate::endpoint::Endpoint`] ([`Job::endpoint`]): regions and notification
//!   queue, for transfers within this agent.
//!
//! The contract of [`Transport::execute`]: every byte lands before the future resolves `Ok`;
//! checksums are verified when asked (by the receiver); the notification is delivered after
//! the last byte (through `commit`, which the owner acknowledges only after verifying);
//! dropping the future stops the transfer — no byte lands after the drop completes (a
//! one-sided transport waits for or cancels its outstanding work before it returns).
//!
//! `cuda` (feature `cuda`) moves every job that touches GPU memory: CUDA copies on streams
//! within this agent, CUDA IPC to peers of this host; the other transports refuse GPU
//! regions (their host accesses fail with `NotHostMemory`). The RDMA transport of the next
//! issue implements this trait the same way: one-sided READ/WRITE work requests on memory
//! registered once per region, completed on the completion queue, committed through the
//! session (or with immediate data). Adding one means: a [`TransportKind`], a field in
//! `Transports`, a rule in the agent's `choose_transport`, and the kind in the metadata the
//! agent publishes.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Weak};

use crate::endpoint::Endpoint;
use crate::memory::{Region, RegionLease};
use crate::peer::Peer;
use crate::transfer::{TransferError, TransferOp, TransportKind};

pub use crate::endpoint::Piece;

#[cfg(feature = "cuda")]
pub mod cuda;
pub mod fault;
pub mod local;
pub mod rdma;
pub mod shm;
pub mod staging;
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
    /// A staged job's chunks travel over RDMA (both agents have a device on the same kind of
    /// link), not TCP. (Read by the CUDA transport only.)
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) stage_over_rdma: bool,
    pub(crate) endpoint: Weak<Endpoint>,
}

impl Job {
    /// The peer of a remote transfer.
    pub fn peer(&self) -> Result<&Arc<Peer>, TransferError> {
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

    /// The remote side of every piece, for the owner; with `checksums` (one per piece).
    fn remote_descs(&self, checksums: Option<&[u64]>) -> Vec<crate::wire::WireDesc> {
        self.pieces
            .iter()
            .enumerate()
            .map(|(i, p)| crate::wire::WireDesc {
                region: p.remote.region.0,
                offset: p.remote.offset,
                len: p.len(),
                checksum: checksums.and_then(|c| c.get(i).copied()),
            })
            .collect()
    }

    /// The checksum to send for the local bytes of every piece.
    fn local_checksums(&self) -> Result<Vec<u64>, TransferError> {
        self.pieces
            .iter()
            .map(|p| Ok(self.sent_checksum(self.region(p).checksum(p.local_offset, p.len())?)))
            .collect()
    }

    /// Before a one-sided transfer (`shm`, `rdma`) moves bytes: for a checksummed READ, the
    /// owner's checksums of its bytes (hashed before we copy them).
    pub(crate) async fn one_sided_expected(
        &self,
        peer: &Peer,
    ) -> Result<Option<Vec<u64>>, TransferError> {
        if self.checksum && self.op == TransferOp::Read {
            Ok(Some(peer.session.checksums(self.remote_descs(None)).await?))
        } else {
            Ok(None)
        }
    }

    /// After a one-sided transfer moved every byte: a WRITE with checksums or a notification
    /// ends with a `Commit` (the owner verifies, then delivers the notification); a READ
    /// checks its bytes against `expected`, then sends its notification.
    pub(crate) async fn one_sided_finish(
        &self,
        peer: &Peer,
        expected: Option<Vec<u64>>,
    ) -> Result<(), TransferError> {
        match self.op {
            TransferOp::Write => {
                let verify = if self.checksum {
                    self.remote_descs(Some(&self.local_checksums()?))
                } else {
                    Vec::new()
                };
                if !verify.is_empty() || self.notify.is_some() {
                    peer.session.commit(self.id, verify, self.notify.clone()).await?;
                }
            }
            TransferOp::Read => {
                if let Some(expected) = expected {
                    let got = self.local_checksums()?;
                    if let Some(i) = (0..got.len()).find(|&i| expected.get(i) != Some(&got[i])) {
                        return Err(TransferError::Checksum { index: i });
                    }
                }
                if self.notify.is_some() {
                    peer.session.commit(self.id, Vec::new(), self.notify.clone()).await?;
                }
            }
        }
        Ok(())
    }

    /// Delivers the notification of a job within this agent to its own queue.
    pub(crate) async fn deliver_here(&self, message: &[u8]) -> Result<(), TransferError> {
        let endpoint = self.endpoint()?;
        let n = crate::endpoint::Notification {
            from: endpoint.name().to_string(),
            transfer_id: self.id,
            message: message.to_vec(),
        };
        endpoint
            .deliver(n)
            .await
            .map_err(|r| TransferError::Remote { code: r.code, message: r.message })
    }

    /// The local endpoint (gone once the agent shut down).
    pub fn endpoint(&self) -> Result<Arc<Endpoint>, TransferError> {
        self.endpoint.upgrade().ok_or(TransferError::Shutdown)
    }
}

#[derive(Debug)]
pub(crate) struct Transports {
    pub(crate) local: Arc<dyn Transport>,
    pub(crate) shm: Arc<dyn Transport>,
    pub(crate) tcp: Arc<dyn Transport>,
    /// GPU memory: within this agent and to peers on this host (feature `cuda`).
    pub(crate) cuda: Option<Arc<dyn Transport>>,
    /// Between hosts with RDMA devices (None: no usable device, or turned off).
    pub(crate) rdma: Option<Arc<dyn Transport>>,
}

impl Transports {
    pub(crate) fn new(
        faults: Option<Arc<fault::FaultInjector>>,
        rdma: Option<Arc<dyn Transport>>,
    ) -> Self {
        let wrap = |t: Arc<dyn Transport>| -> Arc<dyn Transport> {
            match &faults {
                Some(f) => Arc::new(fault::FaultTransport::new(t, f.clone())),
                None => t,
            }
        };
        let tcp = wrap(Arc::new(tcp::TcpTransport));
        let rdma = rdma.map(wrap);
        Transports {
            local: wrap(Arc::new(local::LocalTransport)),
            shm: wrap(Arc::new(shm::ShmTransport)),
            #[cfg(feature = "cuda")]
            cuda: Some(wrap(Arc::new(cuda::CudaTransport::new(tcp.clone(), rdma.clone())))),
            #[cfg(not(feature = "cuda"))]
            cuda: None,
            rdma,
            tcp,
        }
    }
}
