//! The local endpoint and the one place where descriptors are checked.
//!
//! [`Endpoint`] is what transports and the session see of their agent: its name, its regions,
//! its notification queue and its limits — not its peers, its transports or its runtime. A
//! transport that needs more of the agent than this is reaching for something that is not
//! its business.
//!
//! Descriptors are checked here and nowhere else (the region's own bounds check in
//! [`crate::memory`] is the primitive every check ends in):
//! - [`check_request`]: the shape of a transfer at `post` (counts, lengths, notification
//!   size, overlapping READ destinations);
//! - [`Endpoint::lease_local`]: local descriptors against registered regions, leased for the
//!   transfer's life;
//! - [`check_remote`]: remote descriptors against what the peer exported in its metadata —
//!   early, for atomicity and clear errors, not for safety;
//! - [`Endpoint::lease_exported`]: descriptors that arrive from the network, against this
//!   agent's exported regions — the authoritative check, on the side that owns the memory.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::sync::mpsc;

use crate::memory::{MemoryError, MemoryKind, RegionId, RegionLease, RegionTable};
use crate::transfer::{Desc, TransferError, TransferOp, TransferRequest, TransportKind};
use crate::wire::{ErrorCode, WireDesc, WireLimits};

/// A region a peer may access, as published in metadata.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ExportedRegion {
    /// Its id in the owner's table.
    pub id: RegionId,
    /// Its length.
    pub len: u64,
    /// Where a peer on the owner's host opens a shareable region (`/proc/{pid}/fd/{fd}`).
    pub shm_path: Option<String>,
    /// Host or GPU memory (absent in metadata from agents that predate GPU memory: host).
    #[serde(default)]
    pub kind: MemoryKind,
    /// The CUDA IPC export of a GPU region, for peers on the same host.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cuda_ipc: Option<crate::cuda::DeviceExport>,
}

/// What peers need to reach an agent.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct AgentMetadata {
    /// The agent's name.
    pub name: String,
    /// Its TCP address.
    pub tcp_addr: SocketAddr,
    /// The kernel boot id of its host: equal boot ids mean the same host (shm possible).
    pub host_id: String,
    /// Its process id (diagnostics).
    pub pid: u32,
    /// Regions peers may access.
    pub regions: Vec<ExportedRegion>,
    /// Transports it accepts.
    pub transports: Vec<TransportKind>,
    /// Whether it moves bytes over RDMA, or why not (absent in metadata from agents that
    /// predate RDMA: off).
    #[serde(default)]
    pub rdma: RdmaStatus,
}

/// An agent's RDMA: the device it uses, or why it uses none.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "state", rename_all = "lowercase")]
pub enum RdmaStatus {
    /// Not configured.
    #[default]
    Off,
    /// No usable device (why).
    Unavailable {
        /// Why.
        reason: String,
    },
    /// In use.
    Device {
        /// Device name.
        device: String,
        /// Port.
        port: u8,
        /// infiniband or ethernet.
        link_layer: String,
        /// How the device reaches GPU memory (`dma-buf`, `nvidia-peermem`); absent where it
        /// does not (GPU memory then moves between hosts staged through host memory), and in
        /// metadata from agents that predate it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        gpu: Option<String>,
    },
}

impl std::fmt::Display for RdmaStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RdmaStatus::Off => f.write_str("RDMA is turned off"),
            RdmaStatus::Unavailable { reason } => f.write_str(reason),
            RdmaStatus::Device { device, port, link_layer, gpu } => {
                write!(f, "{device} port {port} ({link_layer})")?;
                match gpu {
                    Some(how) => write!(f, ", GPU memory through {how}"),
                    None => Ok(()),
                }
            }
        }
    }
}

impl AgentMetadata {
    /// Serializes to bytes (JSON).
    pub fn to_bytes(&self) -> Vec<u8> {
        // Serializing plain data with string keys cannot fail.
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Parses bytes from [`AgentMetadata::to_bytes`].
    pub fn from_bytes(b: &[u8]) -> Result<Self, MetadataError> {
        serde_json::from_slice(b).map_err(|e| MetadataError(e.to_string()))
    }
}

/// Bytes that are not an agent's metadata.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("bad peer metadata: {0}")]
pub struct MetadataError(pub String);

/// A notification delivered by a peer after its transfer's last byte.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notification {
    /// The authenticated name of the sender.
    pub from: String,
    /// The sender's transfer id.
    pub transfer_id: u64,
    /// The message.
    pub message: Vec<u8>,
}

/// Why this endpoint refuses a peer's request: the code and text of the error frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Refusal {
    pub(crate) code: ErrorCode,
    pub(crate) message: String,
}

impl Refusal {
    pub(crate) fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Refusal { code, message: message.into() }
    }
}

/// One local descriptor paired with its remote descriptor.
#[derive(Debug, Clone, Copy)]
pub struct Piece {
    /// Index of the local region in the job's leases.
    pub lease: u32,
    /// Offset in the local region (checked).
    pub local_offset: u64,
    /// The remote descriptor (checked against the peer's metadata; the owner checks again).
    pub remote: Desc,
}

impl Piece {
    /// Bytes.
    pub fn len(&self) -> u64 {
        self.remote.len
    }

    /// Whether it is empty (never: [`check_request`] refuses empty descriptors).
    pub fn is_empty(&self) -> bool {
        self.remote.len == 0
    }
}

/// A descriptor from the network, checked against an exported region and leased.
pub(crate) struct Target {
    pub(crate) lease: RegionLease,
    pub(crate) offset: u64,
    pub(crate) len: u64,
    pub(crate) checksum: Option<u64>,
}

impl Target {
    /// The XXH3 of the target's bytes now.
    pub(crate) fn sum(&self) -> Result<u64, MemoryError> {
        self.lease.region().checksum(self.offset, self.len)
    }
}

/// Checks every target that carries a checksum against the bytes in memory.
pub(crate) fn verify(targets: &[Target]) -> Result<(), Refusal> {
    for (i, t) in targets.iter().enumerate() {
        if let Some(expected) = t.checksum {
            let actual = t.sum().map_err(|e| Refusal::new(ErrorCode::Internal, e.to_string()))?;
            if actual != expected {
                return Err(Refusal::new(
                    ErrorCode::Checksum,
                    format!("checksum mismatch on descriptor {i}"),
                ));
            }
        }
    }
    Ok(())
}

/// What transports and the session see of their agent.
#[derive(Debug)]
pub struct Endpoint {
    name: String,
    regions: RegionTable,
    notify_tx: mpsc::Sender<Notification>,
    frame_timeout: Duration,
}

impl Endpoint {
    pub(crate) fn new(
        name: String,
        regions: RegionTable,
        notify_tx: mpsc::Sender<Notification>,
        frame_timeout: Duration,
    ) -> Self {
        Endpoint { name, regions, notify_tx, frame_timeout }
    }

    /// The agent's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    pub(crate) fn regions(&self) -> &RegionTable {
        &self.regions
    }

    /// Queues a notification for the application, waiting as long as it takes for room
    /// (RDMA mailboxes: their one delivery task, whose backlog is bounded); false once the
    /// agent is gone.
    pub(crate) async fn deliver_waiting(&self, n: Notification) -> bool {
        self.notify_tx.send(n).await.is_ok()
    }

    /// Queues a notification for the application, waiting at most the frame timeout for
    /// room: a full queue is refused, never an unbounded wait.
    pub(crate) async fn deliver(&self, n: Notification) -> Result<(), Refusal> {
        match tokio::time::timeout(self.frame_timeout, self.notify_tx.send(n)).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) => Err(Refusal::new(ErrorCode::Unavailable, "agent shut down")),
            Err(_) => Err(Refusal::new(ErrorCode::Unavailable, "notification queue full")),
        }
    }

    /// Resolves local descriptors, checks each against its registered region and leases
    /// every region once; pairs them with the remote descriptors.
    pub(crate) fn lease_local(
        &self,
        local: &[Desc],
        remote: &[Desc],
    ) -> Result<(Vec<RegionLease>, Vec<Piece>), TransferError> {
        // Transfers touch few regions: a linear scan beats hashing.
        let mut leases: Vec<RegionLease> = Vec::new();
        let mut pieces = Vec::with_capacity(local.len());
        for (l, r) in local.iter().zip(remote) {
            let index = match leases.iter().rposition(|lease| lease.region().id() == l.region) {
                Some(i) => i,
                None => {
                    leases.push(RegionLease::new(self.regions.get(l.region)?));
                    leases.len() - 1
                }
            };
            leases[index].region().check(l.offset, l.len)?;
            pieces.push(Piece { lease: index as u32, local_offset: l.offset, remote: *r });
        }
        Ok((leases, pieces))
    }

    /// Leases the region of a descriptor on this agent's own side of a local transfer (any
    /// registered region: the caller is this process), checked.
    pub(crate) fn lease_registered(&self, d: &Desc) -> Result<RegionLease, TransferError> {
        let lease = RegionLease::new(self.regions.get(d.region)?);
        lease.region().check(d.offset, d.len)?;
        Ok(lease)
    }

    /// Checks descriptors from a peer against this agent's exported regions and leases them
    /// for the request's I/O. The first bad descriptor refuses the whole request.
    pub(crate) fn lease_exported(&self, descs: &[WireDesc]) -> Result<Vec<Target>, Refusal> {
        descs
            .iter()
            .map(|d| {
                let id = RegionId(d.region);
                let region = self.regions.get(id).map_err(|_| {
                    Refusal::new(ErrorCode::UnknownRegion, format!("unknown region {id}"))
                })?;
                if !region.is_exported() {
                    return Err(Refusal::new(
                        ErrorCode::NotExported,
                        format!("region {id} is not exported"),
                    ));
                }
                // Requests that reach this point move bytes through host memory (TCP
                // payloads, checksums); GPU memory is reached only through CUDA IPC.
                if region.kind() != MemoryKind::Host {
                    return Err(Refusal::new(
                        ErrorCode::NotExported,
                        format!("region {id} is GPU memory: only CUDA IPC reaches it"),
                    ));
                }
                region
                    .check(d.offset, d.len)
                    .map_err(|e| Refusal::new(ErrorCode::OutOfBounds, e.to_string()))?;
                Ok(Target {
                    lease: RegionLease::new(region),
                    offset: d.offset,
                    len: d.len,
                    checksum: d.checksum,
                })
            })
            .collect()
    }
}

/// Checks the shape of a transfer before anything is resolved: equal, non-zero descriptor
/// counts within the limit, equal non-zero lengths per pair, a notification within the wire
/// limit, and no two local destinations of a READ overlapping.
pub(crate) fn check_request(
    req: &TransferRequest,
    descs_max: usize,
    wire: &WireLimits,
) -> Result<(), TransferError> {
    if req.local.is_empty() || req.local.len() != req.remote.len() {
        return Err(TransferError::Invalid(format!(
            "{} local and {} remote descriptors: need equal, non-zero counts",
            req.local.len(),
            req.remote.len()
        )));
    }
    if req.local.len() > descs_max {
        return Err(TransferError::Invalid(format!(
            "{} descriptors exceed the limit of {descs_max}",
            req.local.len(),
        )));
    }
    if let Some((i, _)) = req
        .local
        .iter()
        .zip(&req.remote)
        .enumerate()
        .find(|(_, (l, r))| l.len != r.len || l.len == 0)
    {
        return Err(TransferError::Invalid(format!(
            "descriptor {i}: local and remote lengths must be equal and non-zero"
        )));
    }
    if req.notify.as_ref().is_some_and(|n| n.len() > wire.notify_bytes_max as usize) {
        return Err(TransferError::Invalid(format!(
            "notification exceeds {} bytes",
            wire.notify_bytes_max
        )));
    }
    if req.op == TransferOp::Read && overlapping(&req.local) {
        return Err(TransferError::Invalid(
            "local descriptors of a READ overlap: bytes would land twice in the same memory".into(),
        ));
    }
    Ok(())
}

/// Checks remote descriptors against the regions the peer exported in its metadata, so that
/// a transfer with one bad descriptor moves no byte at all. The owner checks again
/// ([`Endpoint::lease_exported`]): this is for atomicity and early errors, not for safety.
pub(crate) fn check_remote(md: &AgentMetadata, remote: &[Desc]) -> Result<(), TransferError> {
    for (index, d) in remote.iter().enumerate() {
        let region = md.regions.iter().find(|r| r.id == d.region).ok_or_else(|| {
            TransferError::RemoteDescriptor {
                index,
                reason: format!("region {} is not in {}'s metadata", d.region, md.name),
            }
        })?;
        if d.offset.checked_add(d.len).is_none_or(|end| end > region.len) {
            return Err(TransferError::RemoteDescriptor {
                index,
                reason: format!(
                    "range {}+{} is outside region {} of {} bytes",
                    d.offset, d.len, d.region, region.len
                ),
            });
        }
    }
    Ok(())
}

/// Whether two descriptors cover a common byte of one region.
fn overlapping(descs: &[Desc]) -> bool {
    let mut sorted: Vec<(RegionId, u64, u64)> =
        descs.iter().map(|d| (d.region, d.offset, d.offset.saturating_add(d.len))).collect();
    sorted.sort_unstable();
    sorted.windows(2).any(|w| w[0].0 == w[1].0 && w[1].1 < w[0].2)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::RegionOptions;

    fn endpoint() -> Endpoint {
        let (tx, _rx) = mpsc::channel(1);
        Endpoint::new(
            "ep".into(),
            RegionTable::new(
                format!("kvfabric.endpoint-test.{}", std::process::id()),
                16,
                crate::memory::ShmSeal::new(b"test"),
                "test",
            ),
            tx,
            Duration::from_secs(1),
        )
    }

    #[test]
    fn exported_descriptors_are_checked_in_one_place() {
        let ep = endpoint();
        let exported =
            ep.regions().alloc(4096, RegionOptions { export: true, ..Default::default() }).unwrap();
        let private = ep
            .regions()
            .alloc(4096, RegionOptions { export: false, ..Default::default() })
            .unwrap();
        let d = |r: RegionId, offset, len| WireDesc { region: r.0, offset, len, checksum: None };
        assert_eq!(ep.lease_exported(&[d(exported.id(), 0, 4096)]).unwrap().len(), 1);
        let code = |descs: &[WireDesc]| ep.lease_exported(descs).err().map(|r| r.code);
        assert_eq!(code(&[d(exported.id(), 1, 4096)]), Some(ErrorCode::OutOfBounds));
        assert_eq!(code(&[d(exported.id(), u64::MAX, 2)]), Some(ErrorCode::OutOfBounds));
        assert_eq!(code(&[d(private.id(), 0, 1)]), Some(ErrorCode::NotExported));
        assert_eq!(code(&[d(RegionId(u64::MAX), 0, 1)]), Some(ErrorCode::UnknownRegion));
        // One bad descriptor refuses the request, whatever its position.
        assert_eq!(
            code(&[d(exported.id(), 0, 1), d(exported.id(), 4096, 1)]),
            Some(ErrorCode::OutOfBounds)
        );
    }

    #[test]
    fn local_descriptors_lease_each_region_once_and_are_bounded() {
        let ep = endpoint();
        let a = ep.regions().alloc(4096, RegionOptions::default()).unwrap();
        let b = ep.regions().alloc(4096, RegionOptions::default()).unwrap();
        let r = Desc::new(RegionId(9), 0, 16);
        let local =
            [Desc::new(a.id(), 0, 16), Desc::new(b.id(), 16, 16), Desc::new(a.id(), 32, 16)];
        let (leases, pieces) = ep.lease_local(&local, &[r, r, r]).unwrap();
        assert_eq!(leases.len(), 2);
        assert_eq!(pieces.iter().map(|p| p.lease).collect::<Vec<_>>(), vec![0, 1, 0]);
        assert!(ep.lease_local(&[Desc::new(a.id(), 4090, 16)], &[r]).is_err());
        assert!(ep.lease_registered(&Desc::new(b.id(), 0, 4097)).is_err());
    }

    #[test]
    fn remote_descriptors_are_checked_against_metadata() {
        let md = AgentMetadata {
            name: "peer".into(),
            tcp_addr: SocketAddr::from(([127, 0, 0, 1], 1)),
            host_id: "h".into(),
            pid: 1,
            regions: vec![ExportedRegion {
                id: RegionId(3),
                len: 100,
                shm_path: None,
                kind: MemoryKind::Host,
                cuda_ipc: None,
            }],
            transports: vec![TransportKind::Tcp],
            rdma: RdmaStatus::Off,
        };
        assert!(check_remote(&md, &[Desc::new(RegionId(3), 0, 100)]).is_ok());
        for bad in [
            Desc::new(RegionId(3), 1, 100),
            Desc::new(RegionId(3), u64::MAX, 1),
            Desc::new(RegionId(4), 0, 1),
        ] {
            let err = check_remote(&md, &[Desc::new(RegionId(3), 0, 1), bad]).unwrap_err();
            assert!(matches!(err, TransferError::RemoteDescriptor { index: 1, .. }), "{err}");
        }
    }

    #[test]
    fn request_shapes_are_refused_before_anything_is_resolved() {
        let wire = WireLimits::default();
        let d = |off, len| Desc::new(RegionId(1), off, len);
        let req = |op, local: Vec<Desc>, remote: Vec<Desc>| {
            let mut r = TransferRequest::new(op, "p", local, remote);
            r.notify = None;
            r
        };
        let ok = req(TransferOp::Read, vec![d(0, 8), d(8, 8)], vec![d(0, 8), d(8, 8)]);
        assert!(check_request(&ok, 16, &wire).is_ok());
        let bad = [
            req(TransferOp::Write, vec![], vec![]),
            req(TransferOp::Write, vec![d(0, 8)], vec![d(0, 8), d(8, 8)]),
            req(TransferOp::Write, vec![d(0, 8)], vec![d(0, 4)]),
            req(TransferOp::Write, vec![d(0, 0)], vec![d(0, 0)]),
            req(TransferOp::Read, vec![d(0, 8), d(4, 8)], vec![d(0, 8), d(8, 8)]),
            req(TransferOp::Write, vec![d(0, 8); 17], vec![d(0, 8); 17]),
            req(TransferOp::Write, vec![d(0, 8)], vec![d(0, 8)]).with_notify(vec![
                0;
                wire.notify_bytes_max
                    as usize
                    + 1
            ]),
        ];
        for r in &bad {
            assert!(matches!(check_request(r, 16, &wire), Err(TransferError::Invalid(_))), "{r:?}");
        }
        // Overlapping sources of a WRITE are fine: bytes are only read twice.
        let w = req(TransferOp::Write, vec![d(0, 8), d(4, 8)], vec![d(0, 8), d(8, 8)]);
        assert!(check_request(&w, 16, &wire).is_ok());
    }
}
