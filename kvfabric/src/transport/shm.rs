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
use crate::wire::WireDesc;

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
            let wire = |checksums: Option<&[u64]>| -> Vec<WireDesc> {
                job.pieces
                    .iter()
                    .enumerate()
                    .map(|(i, p)| WireDesc {
                        region: p.remote.region.0,
                        offset: p.remote.offset,
                        len: p.len(),
                        checksum: checksums.map(|c| c[i]),
                    })
                    .collect()
            };
            let to_peer = job.op == TransferOp::Write;
            // For a checksummed READ, the owner hashes its bytes before we copy them.
            let expected = if job.checksum && !to_peer {
                Some(peer.session.checksums(wire(None)).await?)
            } else {
                None
            };
            run_copies(&copies, to_peer).await?;
            match job.op {
                TransferOp::Write => {
                    let verify = if job.checksum {
                        let sums = copies
                            .iter()
                            .map(|c| {
                                Ok(job.sent_checksum(
                                    c.local.region().checksum(c.local_offset, c.len)?,
                                ))
                            })
                            .collect::<Result<Vec<u64>, TransferError>>()?;
                        wire(Some(&sums))
                    } else {
                        Vec::new()
                    };
                    if !verify.is_empty() || job.notify.is_some() {
                        peer.session.commit(job.id, verify, job.notify.clone()).await?;
                    }
                }
                TransferOp::Read => {
                    if let Some(expected) = expected {
                        for (i, (c, &e)) in copies.iter().zip(&expected).enumerate() {
                            if job.sent_checksum(c.local.region().checksum(c.local_offset, c.len)?)
                                != e
                            {
                                return Err(TransferError::Checksum { index: i });
                            }
                        }
                    }
                    if job.notify.is_some() {
                        peer.session.commit(job.id, Vec::new(), job.notify.clone()).await?;
                    }
                }
            }
            Ok(())
        })
    }
}
