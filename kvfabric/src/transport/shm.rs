//! `shm`: a peer on the same host. The peer's shareable regions are mapped here once; a
//! WRITE is one memcpy into the peer's mapping, a READ one memcpy out of it. Bounds are
//! enforced by the mapping itself, which covers exactly what the owner exported, and checked
//! before every copy.
//!
//! The owner is told over the TCP control connection only when it has to act: a WRITE with
//! checksums or a notification ends with a `Commit` that the owner verifies against its own
//! memory before it delivers the notification; a READ with checksums first asks the owner
//! for the checksums of its bytes, then verifies the copy.

use std::sync::Arc;

use crate::memory::{copy_with_peer, PeerMapping, RegionLease};
use crate::transfer::{TransferError, TransferOp, TransportKind};
use crate::wire::WireDesc;

use super::tcp::{commit, remote_checksums};
use super::{Job, Transport, TransportFuture};

/// Copies larger than this run on the blocking pool so that they do not stall the runtime.
const INLINE_COPY_BYTES: u64 = 1 << 20;

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

fn run_copies(copies: &[Copy], to_peer: bool) -> Result<(), TransferError> {
    for c in copies {
        copy_with_peer(c.local.region(), c.local_offset, &c.map, c.remote_offset, c.len, to_peer)?;
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
                Some(remote_checksums(&peer.tcp, wire(None)).await?)
            } else {
                None
            };
            let total: u64 = copies.iter().map(|c| c.len).sum();
            let copies = if total <= INLINE_COPY_BYTES {
                run_copies(&copies, to_peer)?;
                copies
            } else {
                // The copies own their leases and mappings: a dropped future leaves the
                // blocking copy to finish into memory that stays alive.
                tokio::task::spawn_blocking(move || run_copies(&copies, to_peer).map(|()| copies))
                    .await
                    .map_err(|e| TransferError::Local(format!("copy task failed: {e}")))??
            };
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
                        commit(&peer.tcp, job.id, verify, job.notify.clone()).await?;
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
                        commit(&peer.tcp, job.id, Vec::new(), job.notify.clone()).await?;
                    }
                }
            }
            Ok(())
        })
    }
}
