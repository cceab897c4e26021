//! Staging through bounce buffers: a job whose local memory the network cannot reach directly
//! (GPU memory, to or from another host) moves in chunks through a host region of two slots,
//! and staging one chunk overlaps the network transfer of the other.
//!
//! - WRITE: chunk k is staged out of local memory into slot k % 2 (D2H), then sent from that
//!   slot with the network transport while chunk k + 1 is staged into the other slot. The
//!   notification rides on the last chunk's transfer, so it arrives after the last byte.
//! - READ: chunk k is read from the peer into slot k % 2 while chunk k − 1 is staged from the
//!   other slot into local memory (H2D); the notification is committed after the last chunk
//!   is staged in.
//!
//! Checksums keep their meaning: the network transfer of each chunk checksums the bounce
//! bytes, which are the local bytes (a WRITE stages them before sending; a READ verifies them
//! before staging them in).
//!
//! How bytes move between local memory and a slot is the [`Stager`]'s business (CUDA copies
//! for GPU memory; a memcpy stands in for them in tests, which then prove the chunking, the
//! slot rotation, the ordering and the error paths, not anything about a GPU).

use std::future::Future;

use crate::endpoint::Piece;
use crate::memory::RegionLease;
use crate::transfer::{Desc, TransferError, TransferOp};

use super::{Job, Transport};

/// One part of a piece inside a chunk: `len` bytes at `offset` into piece `piece`, at
/// `slot_offset` in the chunk's slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Part {
    /// The job's piece.
    pub piece: usize,
    /// Offset into the piece.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
    /// Offset in the slot.
    pub slot_offset: u64,
}

/// Cuts `pieces` into chunks of at most `chunk` bytes (pieces split where they must), in order.
pub fn plan(pieces: &[Piece], chunk: u64) -> Vec<Vec<Part>> {
    let chunk = chunk.max(1);
    let mut chunks = Vec::new();
    let mut cur: Vec<Part> = Vec::new();
    let mut used = 0u64;
    for (i, p) in pieces.iter().enumerate() {
        let mut off = 0;
        while off < p.len() {
            let n = (p.len() - off).min(chunk - used);
            cur.push(Part { piece: i, offset: off, len: n, slot_offset: used });
            off += n;
            used += n;
            if used == chunk {
                chunks.push(std::mem::take(&mut cur));
                used = 0;
            }
        }
    }
    if !cur.is_empty() {
        chunks.push(cur);
    }
    chunks
}

/// Moves bytes between a job's local memory and a bounce slot.
pub trait Stager: Sync {
    /// Queues the copy of `part` from local memory into the slot at `slot_ptr`.
    fn stage_out(&self, job: &Job, part: &Part, slot_ptr: *mut u8) -> Result<(), TransferError>;
    /// Queues the copy of `part` from the slot at `slot_ptr` into local memory.
    fn stage_in(&self, job: &Job, part: &Part, slot_ptr: *mut u8) -> Result<(), TransferError>;
    /// Completes when every copy queued so far has.
    fn fence(&self) -> impl Future<Output = Result<(), TransferError>> + Send;
}

/// The bounce region: two slots of `slot_bytes`, host memory the network transport reaches.
#[derive(Debug, Clone)]
pub struct Bounce {
    /// A lease on the region.
    pub lease: RegionLease,
    /// Bytes per slot (the chunk size).
    pub slot_bytes: u64,
}

impl Bounce {
    fn slot_ptr(&self, k: usize) -> Result<*mut u8, TransferError> {
        let off = (k % 2) as u64 * self.slot_bytes;
        Ok(self.lease.region().ptr_at(off, self.slot_bytes)?)
    }

    /// The network job that moves chunk `k` between its slot and the peer.
    fn network_job(&self, job: &Job, k: usize, parts: &[Part], last: bool) -> Job {
        let base = (k % 2) as u64 * self.slot_bytes;
        let pieces = parts
            .iter()
            .map(|p| {
                let r = job.pieces[p.piece].remote;
                Piece {
                    lease: 0,
                    local_offset: base + p.slot_offset,
                    remote: Desc::new(r.region, r.offset + p.offset, p.len),
                }
            })
            .collect();
        Job {
            id: job.id,
            op: job.op,
            peer: job.peer.clone(),
            leases: vec![self.lease.clone()],
            pieces,
            checksum: job.checksum,
            // A WRITE's notification rides on its last chunk; a READ commits its own after
            // the last byte is staged in.
            notify: if last && job.op == TransferOp::Write { job.notify.clone() } else { None },
            inline_bytes_max: 0,
            corrupt_checksums: job.corrupt_checksums,
            stage_over_rdma: false,
            endpoint: job.endpoint.clone(),
        }
    }
}

/// Moves `job` through `bounce` with `stager` and the network transport `net`.
pub async fn run(
    job: &Job,
    bounce: &Bounce,
    stager: &impl Stager,
    net: &dyn Transport,
) -> Result<(), TransferError> {
    let chunks = plan(&job.pieces, bounce.slot_bytes);
    let n = chunks.len();
    let stage = |k: usize, out: bool| {
        let parts = &chunks[k];
        async move {
            {
                // The raw slot pointer is not held across the await.
                let slot = bounce.slot_ptr(k)?;
                for p in parts {
                    if out {
                        stager.stage_out(job, p, slot)?;
                    } else {
                        stager.stage_in(job, p, slot)?;
                    }
                }
            }
            stager.fence().await
        }
    };
    let send = |k: usize| {
        let sub = bounce.network_job(job, k, &chunks[k], k + 1 == n);
        async move { net.execute(&sub).await }
    };
    match job.op {
        TransferOp::Write => {
            // Stage chunk k while chunk k - 1 is on the wire.
            for k in 0..n {
                if k == 0 {
                    stage(0, true).await?;
                } else {
                    let (sent, staged) = tokio::join!(send(k - 1), stage(k, true));
                    sent?;
                    staged?;
                }
            }
            if n > 0 {
                send(n - 1).await?;
            }
        }
        TransferOp::Read => {
            // Read chunk k while chunk k - 1 is staged in.
            for k in 0..n {
                if k == 0 {
                    send(0).await?;
                } else {
                    let (read, staged) = tokio::join!(send(k), stage(k - 1, false));
                    read?;
                    staged?;
                }
            }
            if n > 0 {
                stage(n - 1, false).await?;
            }
            if let Some(message) = &job.notify {
                job.peer()?.session.commit(job.id, Vec::new(), Some(message.clone())).await?;
            }
        }
    }
    Ok(())
}

/// A stager for tests (here and over other network transports).
#[cfg(test)]
pub(crate) mod test_stager {
    use super::{Job, Part, Stager};
    use crate::transfer::TransferError;

    /// Host memory standing in for GPU memory: a memcpy instead of a CUDA copy, counted, and
    /// failing on demand.
    #[derive(Default)]
    pub(crate) struct Memcpy {
        pub(crate) copies: std::sync::atomic::AtomicUsize,
        pub(crate) fail_at: Option<usize>,
    }

    impl Memcpy {
        fn copy(
            &self,
            job: &Job,
            part: &Part,
            slot: *mut u8,
            out: bool,
        ) -> Result<(), TransferError> {
            let n = self.copies.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            if self.fail_at == Some(n) {
                return Err(TransferError::Device("injected staging failure".into()));
            }
            let p = &job.pieces[part.piece];
            let local = job.region(p).ptr_at(p.local_offset + part.offset, part.len)?;
            // SAFETY: both ranges were checked (the region's, and the slot's in `slot_ptr`,
            // which holds `slot_offset + len` bytes); they are distinct regions.
            unsafe {
                let slot = slot.add(part.slot_offset as usize);
                if out {
                    std::ptr::copy_nonoverlapping(local, slot, part.len as usize);
                } else {
                    std::ptr::copy_nonoverlapping(slot, local, part.len as usize);
                }
            }
            Ok(())
        }
    }

    impl Stager for Memcpy {
        fn stage_out(&self, job: &Job, part: &Part, slot: *mut u8) -> Result<(), TransferError> {
            self.copy(job, part, slot, true)
        }
        fn stage_in(&self, job: &Job, part: &Part, slot: *mut u8) -> Result<(), TransferError> {
            self.copy(job, part, slot, false)
        }
        async fn fence(&self) -> Result<(), TransferError> {
            tokio::task::yield_now().await;
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::test_stager::Memcpy;
    use super::*;
    use crate::agent::{Agent, AgentConfig};
    use crate::memory::{RegionId, RegionOptions};
    use crate::transfer::TransferRequest;

    async fn pair() -> (Agent, Agent) {
        let a = Agent::start(AgentConfig::new("stage-a", b"staging".to_vec())).await.unwrap();
        let b = Agent::start(AgentConfig::new("stage-b", b"staging".to_vec())).await.unwrap();
        a.load_peer(b.metadata()).unwrap();
        b.load_peer(a.metadata()).unwrap();
        (a, b)
    }

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len).map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[1] ^ seed).collect()
    }

    /// Through a real TCP peer, in 64 KiB chunks of two slots: descriptors of odd sizes
    /// (split across chunks) land byte for byte both ways, checksums verified by the
    /// receiver, and the notification arrives after the last byte.
    #[tokio::test]
    async fn a_job_staged_through_two_slots_moves_every_byte_both_ways() {
        let (a, b) = pair().await;
        let len = 1 << 20;
        let local = a.alloc_region(len, RegionOptions::default()).unwrap();
        local.write_at(0, &pattern(len, 3)).unwrap();
        let remote =
            b.alloc_region(len, RegionOptions { export: true, ..Default::default() }).unwrap();
        let bounce_region = a.alloc_region(2 << 16, RegionOptions::default()).unwrap();
        let bounce = Bounce { lease: RegionLease::new(bounce_region), slot_bytes: 1 << 16 };
        b.load_peer(a.metadata()).unwrap();
        a.load_peer(b.metadata()).unwrap();
        // Odd sizes: 1000 descriptors of 1000 bytes, then one of the rest.
        let mut ld = Vec::new();
        let mut rd = Vec::new();
        let mut off = 0u64;
        while off < len as u64 {
            let n = 1000.min(len as u64 - off);
            ld.push(Desc::new(local.id(), off, n));
            rd.push(Desc::new(remote.id(), len as u64 - off - n, n)); // reversed placement
            off += n;
        }
        let tcp = crate::transport::tcp::TcpTransport;
        let req = TransferRequest::new(TransferOp::Write, "stage-b", ld.clone(), rd.clone())
            .with_checksum()
            .with_notify(b"all staged".to_vec());
        let job = a.job_for(&req).unwrap();
        let stager = Memcpy::default();
        run(&job, &bounce, &stager, &tcp).await.unwrap();
        assert_eq!(
            stager.copies.load(std::sync::atomic::Ordering::SeqCst),
            plan(&job.pieces, 1 << 16).iter().map(Vec::len).sum::<usize>()
        );
        let n = tokio::time::timeout(std::time::Duration::from_secs(5), b.next_notification())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(n.message, b"all staged");
        let want = pattern(len, 3);
        let mut got = vec![0u8; len];
        remote.read_at(0, &mut got).unwrap();
        for (l, r) in ld.iter().zip(&rd) {
            assert_eq!(
                &got[r.offset as usize..(r.offset + r.len) as usize],
                &want[l.offset as usize..(l.offset + l.len) as usize]
            );
        }
        // And back: READ the peer's bytes into a cleared local region.
        local.fill(0, len as u64, 0).unwrap();
        let req = TransferRequest::new(TransferOp::Read, "stage-b", ld, rd)
            .with_checksum()
            .with_notify(b"read".to_vec());
        let job = a.job_for(&req).unwrap();
        run(&job, &bounce, &Memcpy::default(), &tcp).await.unwrap();
        let mut back = vec![0u8; len];
        local.read_at(0, &mut back).unwrap();
        assert!(back == want, "the READ staged in other bytes");
        let n = tokio::time::timeout(std::time::Duration::from_secs(5), b.next_notification())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(n.message, b"read");
    }

    /// A staging failure in the middle fails the job, typed, and no notification is sent.
    #[tokio::test]
    async fn a_failed_stage_fails_the_job_without_a_notification() {
        let (a, b) = pair().await;
        let len = 1 << 18;
        let local = a.alloc_region(len, RegionOptions::default()).unwrap();
        let remote =
            b.alloc_region(len, RegionOptions { export: true, ..Default::default() }).unwrap();
        a.load_peer(b.metadata()).unwrap();
        let bounce_region = a.alloc_region(2 << 14, RegionOptions::default()).unwrap();
        let bounce = Bounce { lease: RegionLease::new(bounce_region), slot_bytes: 1 << 14 };
        let req = TransferRequest::new(
            TransferOp::Write,
            "stage-b",
            vec![Desc::new(local.id(), 0, len as u64)],
            vec![Desc::new(remote.id(), 0, len as u64)],
        )
        .with_notify(b"never".to_vec());
        let job = a.job_for(&req).unwrap();
        let stager = Memcpy { fail_at: Some(5), ..Default::default() };
        let tcp = crate::transport::tcp::TcpTransport;
        let err = run(&job, &bounce, &stager, &tcp).await.unwrap_err();
        assert!(matches!(err, TransferError::Device(_)), "{err}");
        assert!(b.try_notifications().is_empty());
    }

    fn piece(len: u64) -> Piece {
        Piece { lease: 0, local_offset: 0, remote: Desc::new(RegionId(1), 0, len) }
    }

    #[test]
    fn chunks_cover_every_byte_once_in_order_within_the_slot() {
        for (lens, chunk) in [
            (vec![10, 10, 10], 16),
            (vec![100], 16),
            (vec![1, 2, 3, 4, 5], 5),
            (vec![16, 16], 16),
            (vec![7], 100),
            (vec![], 8),
        ] {
            let pieces: Vec<Piece> = lens.iter().map(|&l| piece(l)).collect();
            let chunks = plan(&pieces, chunk);
            let total: u64 = lens.iter().sum();
            assert_eq!(chunks.len() as u64, total.div_ceil(chunk), "{lens:?} / {chunk}");
            let mut next = vec![0u64; lens.len()];
            let mut last_piece = 0;
            for c in &chunks {
                let mut slot = 0;
                for p in c {
                    assert!(p.len > 0);
                    assert_eq!(p.slot_offset, slot, "parts fill the slot from 0, packed");
                    assert_eq!(p.offset, next[p.piece], "each piece in order, no gap");
                    assert!(p.piece >= last_piece);
                    last_piece = p.piece;
                    next[p.piece] += p.len;
                    slot += p.len;
                }
                assert!(slot <= chunk);
            }
            assert_eq!(next, lens, "every byte once");
        }
    }
}
