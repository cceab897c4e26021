//! `tcp`: any host. Bulk bytes travel as session requests with the payload inline: a WRITE
//! frame followed by its bytes, a READ answered by `ReadData` followed by its bytes. Large
//! descriptors are cut into stripe-sized chunks spread over the session's connections,
//! written with vectored I/O straight from the registered region and read straight into the
//! destination region. The owner's side (checking descriptors against its exports, leasing,
//! verifying checksums) is the session server's dispatch.

use futures_util::future::try_join_all;

use crate::memory::{Region, RegionId};
use crate::session::client::{Session, StripeConn};
use crate::session::io::{RawDst, RawSrc};
use crate::transfer::{TransferError, TransferOp, TransportKind};
use crate::wire::{Message, WireDesc};

use super::{Job, Transport, TransportFuture};

/// A piece of a job on one stripe.
#[derive(Debug, Clone)]
struct Chunk<'a> {
    region: &'a Region,
    local_offset: u64,
    remote_region: RegionId,
    remote_offset: u64,
    len: u64,
}

fn chunks(job: &Job, stripe_bytes: u64) -> Vec<Chunk<'_>> {
    let mut out = Vec::with_capacity(job.pieces.len());
    for p in &job.pieces {
        let mut done = 0;
        while done < p.len() {
            let len = (p.len() - done).min(stripe_bytes);
            out.push(Chunk {
                region: job.region(p),
                local_offset: p.local_offset + done,
                remote_region: p.remote.region,
                remote_offset: p.remote.offset + done,
                len,
            });
            done += len;
        }
    }
    out
}

/// Spreads chunks over `stripes` lists, balancing bytes, keeping each list in order.
fn stripe<'a>(chunks: Vec<Chunk<'a>>, stripes: usize) -> Vec<Vec<Chunk<'a>>> {
    let n = stripes.min(chunks.len()).max(1);
    let mut lists: Vec<Vec<Chunk<'a>>> = (0..n).map(|_| Vec::new()).collect();
    let mut bytes = vec![0u64; n];
    for c in chunks {
        let i = (0..n).min_by_key(|&i| (bytes[i], i)).unwrap_or(0);
        bytes[i] += c.len;
        lists[i].push(c);
    }
    lists
}

/// Moves bytes over striped TCP connections.
#[derive(Debug)]
pub struct TcpTransport;

impl TcpTransport {
    async fn run_stripe(
        session: &Session,
        job: &Job,
        stripe_index: usize,
        list: Vec<Chunk<'_>>,
    ) -> Result<(), TransferError> {
        let limits = session.limits();
        let per_request = (limits.descs_per_request_max as usize)
            .min((limits.frame_bytes_max as usize).saturating_sub(64) / 32)
            .max(1);
        for group in list.chunks(per_request) {
            let descs: Vec<WireDesc> = group
                .iter()
                .map(|c| {
                    let checksum = match (job.checksum, job.op) {
                        (true, TransferOp::Write) => {
                            Some(job.sent_checksum(c.region.checksum(c.local_offset, c.len)?))
                        }
                        _ => None,
                    };
                    Ok(WireDesc {
                        region: c.remote_region.0,
                        offset: c.remote_offset,
                        len: c.len,
                        checksum,
                    })
                })
                .collect::<Result<_, TransferError>>()?;
            let mut c = session.conn(stripe_index).await?;
            match job.op {
                TransferOp::Write => write_request(session, &mut c, job.id, descs, group).await?,
                TransferOp::Read => read_request(&mut c, job, descs, group).await?,
            }
            c.keep();
        }
        Ok(())
    }
}

async fn write_request(
    session: &Session,
    c: &mut StripeConn<'_>,
    transfer_id: u64,
    descs: Vec<WireDesc>,
    group: &[Chunk<'_>],
) -> Result<(), TransferError> {
    let payload = group
        .iter()
        .map(|c| Ok(RawSrc(c.region.ptr_at(c.local_offset, c.len)?, c.len as usize)))
        .collect::<Result<Vec<_>, TransferError>>()?;
    // SAFETY: the ranges were bounds-checked (ptr_at) in regions the job leases until it
    // ends, which is after this future.
    let sent =
        unsafe { c.send_with_payload(&Message::Write { transfer_id, descs }, &payload) }.await?;
    // Even if our write failed, the server may have refused the request with a typed error
    // before closing: read it.
    let reply = c.reply().await;
    match (sent, reply) {
        (_, Err(e @ TransferError::Remote { .. })) => Err(e),
        (Err(e), _) => Err(TransferError::Disconnected {
            peer: session.peer().to_string(),
            reason: e.to_string(),
        }),
        (Ok(()), Ok(Message::Ack)) => Ok(()),
        (Ok(()), Ok(other)) => Err(TransferError::Protocol(format!("expected ack, got {other:?}"))),
        (Ok(()), Err(e)) => Err(e),
    }
}

async fn read_request(
    c: &mut StripeConn<'_>,
    job: &Job,
    descs: Vec<WireDesc>,
    group: &[Chunk<'_>],
) -> Result<(), TransferError> {
    c.send(&Message::Read { transfer_id: job.id, descs, checksums: job.checksum }).await?;
    let checksums = match c.reply().await? {
        Message::ReadData { checksums } => checksums,
        other => return Err(TransferError::Protocol(format!("expected read data, got {other:?}"))),
    };
    if job.checksum && checksums.len() != group.len() {
        return Err(TransferError::Protocol("wrong number of checksums".into()));
    }
    for chunk in group {
        let dst = chunk.region.ptr_at(chunk.local_offset, chunk.len)?;
        // SAFETY: the range was bounds-checked (ptr_at) in a region the job leases, so it
        // stays mapped for the whole read; bytes go in through raw pointers, no reference.
        unsafe { c.recv_payload(RawDst(dst), chunk.len) }.await?;
    }
    if job.checksum {
        for (i, (chunk, &expected)) in group.iter().zip(&checksums).enumerate() {
            if job.sent_checksum(chunk.region.checksum(chunk.local_offset, chunk.len)?) != expected
            {
                return Err(TransferError::Checksum { index: i });
            }
        }
    }
    Ok(())
}

impl Transport for TcpTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }

    fn execute<'a>(&'a self, job: &'a Job) -> TransportFuture<'a> {
        Box::pin(async move {
            let session = &job.peer()?.session;
            let lists = stripe(chunks(job, session.stripe_bytes()), session.stripes());
            let first = session.next_stripes(lists.len());
            try_join_all(
                lists
                    .into_iter()
                    .enumerate()
                    .map(|(i, list)| Self::run_stripe(session, job, first + i, list)),
            )
            .await?;
            if let Some(n) = &job.notify {
                session.commit(job.id, Vec::new(), Some(n.clone())).await?;
            }
            Ok(())
        })
    }
}
