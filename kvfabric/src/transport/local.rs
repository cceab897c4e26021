//! `local`: both sides in this agent; one memcpy per descriptor.

use crate::memory::copy_between;
use crate::transfer::{TransferError, TransferOp, TransportKind};

use super::{Job, Transport, TransportFuture};

/// Copies between two regions of the same agent.
#[derive(Debug)]
pub struct LocalTransport;

impl Transport for LocalTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Local
    }

    fn execute_inline(&self, job: &Job) -> Option<Result<(), TransferError>> {
        if job.notify.is_some() || job.bytes() > job.inline_bytes_max {
            return None;
        }
        Some(copy_all(job))
    }

    fn execute<'a>(&'a self, job: &'a Job) -> TransportFuture<'a> {
        Box::pin(async move {
            // Large jobs (past the inline limit): one piece at a time, yielding between
            // pieces so the runtime keeps serving and a dropped transfer stops there.
            for i in 0..job.pieces.len() {
                copy_piece(job, i)?;
                tokio::task::yield_now().await;
            }
            if let Some(message) = &job.notify {
                job.deliver_here(message).await?;
            }
            Ok(())
        })
    }
}

/// Copies every piece (verifying checksums when asked).
fn copy_all(job: &Job) -> Result<(), TransferError> {
    (0..job.pieces.len()).try_for_each(|i| copy_piece(job, i))
}

/// Copies piece `i` (verifying its checksum when asked).
fn copy_piece(job: &Job, i: usize) -> Result<(), TransferError> {
    let endpoint = job.endpoint()?;
    {
        let p = &job.pieces[i];
        let remote = endpoint.lease_registered(&p.remote)?;
        let (src, src_off, dst, dst_off) = match job.op {
            TransferOp::Write => (job.region(p), p.local_offset, remote.region(), p.remote.offset),
            TransferOp::Read => (remote.region(), p.remote.offset, job.region(p), p.local_offset),
        };
        let expected = if job.checksum {
            Some(job.sent_checksum(src.checksum(src_off, p.len())?))
        } else {
            None
        };
        copy_between(src, src_off, dst, dst_off, p.len())?;
        if let Some(expected) = expected {
            if dst.checksum(dst_off, p.len())? != expected {
                return Err(TransferError::Checksum { index: i });
            }
        }
    }
    Ok(())
}
