//! `shm`: a peer on the same host. The peer's shareable regions are mapped here once; a
//! WRITE is one memcpy into the peer's mapping, a READ one memcpy out of it. Bounds are
//! enforced by the mapping itself, which covers exactly what the owner exported, and checked
//! before every copy.
//!
//! The owner is told through the session only when it has to act: a WRITE with
//! checksums or a notification ends with a `Commit` that the owner verifies against its own
//! memory before it delivers the notification; a READ with checksums first asks the owner
//! for the checksums of its bytes, then verifies the copy.

use std::sync::Arc;

use crate::memory::{copy_with_peer, PeerMapping, RegionLease};
use crate::transfer::{TransferError, TransferOp, TransportKind};

use super::{Job, Transport, TransportFuture};

/// Large copies yield to the runtime after every this many bytes: other tasks keep running,
/// and a dropped (timed-out, cancelled) transfer stops at the next yield — no byte lands
/// after the drop completes.
const COPY_SLICE_BYTES: u64 = 4 << 20;

/// Moves bytes through shared memory.
#[derive(Debug)]
pub struct ShmTransport;

struct Copy {
    local: RegionLease,
    local_offset: u64,
    map: Arc<PeerMapping>,
    remote_offset: u64,
    len: u64,
}

async fn run_copies(copies: &[Copy], to_peer: bool) -> Result<(), TransferError> {
    let mut since_yield = 0u64;
    for c in copies {
        let mut done = 0;
        while done < c.len {
            let n = (c.len - done).min(COPY_SLICE_BYTES);
            copy_with_peer(
                c.local.region(),
                c.local_offset + done,
                &c.map,
                c.remote_offset + done,
                n,
                to_peer,
            )?;
            done += n;
            since_yield += n;
            if since_yield >= COPY_SLICE_BYTES {
                tokio::task::yield_now().await;
                since_yield = 0;
            }
        }
    }
    Ok(())
}

impl Transport for ShmTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Shm
    }

    fn execute_inline(&self, job: &Job) -> Option<Result<(), TransferError>> {
        if job.checksum || job.notify.is_some() || job.bytes() > job.inline_bytes_max {
            return None;
        }
        let peer = job.peer.as_ref()?;
        let to_peer = job.op == TransferOp::Write;
        let mut map: Option<(crate::memory::RegionId, Arc<PeerMapping>)> = None;
        Some(job.pieces.iter().try_for_each(|p| {
            let m = match &map {
                Some((id, m)) if *id == p.remote.region => m,
                _ => {
                    let m = peer.shm_map(p.remote.region).ok_or_else(|| {
                        TransferError::NoTransport {
                            peer: peer.metadata().name.clone(),
                            reason: format!("region {} is not shareable", p.remote.region),
                        }
                    })?;
                    &map.insert((p.remote.region, m)).1
                }
            };
            copy_with_peer(job.region(p), p.local_offset, m, p.remote.offset, p.len(), to_peer)?;
            Ok(())
        }))
    }

    fn execute<'a>(&'a self, job: &'a Job) -> TransportFuture<'a> {
        Box::pin(async move {
            let peer = job.peer()?;
            let mut copies = Vec::with_capacity(job.pieces.len());
            for p in &job.pieces {
                let map =
                    peer.shm_map(p.remote.region).ok_or_else(|| TransferError::NoTransport {
                        peer: peer.metadata().name.clone(),
                        reason: format!("region {} is not shareable", p.remote.region),
                    })?;
                copies.push(Copy {
                    local: job.leases[p.lease as usize].clone(),
                    local_offset: p.local_offset,
                    map,
                    remote_offset: p.remote.offset,
                    len: p.len(),
                });
            }
            let to_peer = job.op == TransferOp::Write;
            let expected = job.one_sided_expected(peer).await?;
            run_copies(&copies, to_peer).await?;
            job.one_sided_finish(peer, expected).await?;
            Ok(())
        })
    }
}
