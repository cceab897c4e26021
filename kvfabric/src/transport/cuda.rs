//! `cuda`: transfers that touch GPU memory (feature `cuda`).
//!
//! - Within this agent: every piece is one CUDA copy (H2D, D2H, D2D; host to host pieces of
//!   a mixed job are a memcpy), queued on the stream of the device it touches, one stream per
//!   device; the job completes when an event recorded after its last copy has.
//! - To a peer on the same host: the peer's GPU regions are mapped once through the CUDA IPC
//!   handle in its metadata (found by GPU UUID, since ordinals differ between processes), and
//!   the copy runs here, one-sided, like `shm`; a notification goes through the session's
//!   `Commit` after the last byte.
//!
//! Dropping a job's future stops queuing; copies already queued run to completion before the
//! drop returns (the contract: no byte lands after it), and the job's leases are held until
//! then. Checksums of GPU memory are not computed: a job that asks for them is refused with a
//! typed error rather than silently unchecked.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::cuda::{self, Cuda, Event, IpcMapping, Stream};
use crate::memory::{copy_between, MemoryKind, Region, RegionId, RegionLease};
use crate::transfer::{TransferError, TransferOp, TransportKind};

use super::{Job, Transport, TransportFuture};

/// Moves bytes to, from and between GPUs.
#[derive(Debug, Default)]
pub struct CudaTransport {
    streams: Mutex<HashMap<u32, Arc<Stream>>>,
    /// Peers' GPU regions mapped here: (peer name, peer pid, region) → mapping.
    maps: Mutex<HashMap<(String, u32, RegionId), Arc<IpcMapping>>>,
}

/// Where one side of a piece is.
#[derive(Clone, Copy)]
enum Loc {
    Host(*mut u8),
    Device(u32, u64),
}

fn cuda_err(e: cuda::CudaError) -> TransferError {
    match e {
        cuda::CudaError::Unavailable(why) => {
            TransferError::NoTransport { peer: String::new(), reason: why.to_string() }
        }
        other => TransferError::Device(other.to_string()),
    }
}

fn locate(r: &Region, offset: u64, len: u64) -> Result<Loc, TransferError> {
    Ok(match r.kind() {
        MemoryKind::Host => Loc::Host(r.ptr_at(offset, len)?),
        MemoryKind::Device(_) => {
            let (ordinal, addr) = r.device_addr(offset, len).ok_or_else(|| {
                TransferError::Invalid(format!("range outside GPU region {}", r.id()))
            })?;
            Loc::Device(ordinal, addr)
        }
    })
}

/// Copies queued on streams, and what they touch: waited for even if the job is dropped.
struct InFlight {
    events: Vec<Event>,
    _leases: Vec<RegionLease>,
    _maps: Vec<Arc<IpcMapping>>,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        for e in &self.events {
            // Completed events return at once; a dropped job waits here for its copies.
            if let Err(e) = e.synchronize() {
                tracing::warn!(error = %e, "a CUDA copy of a dropped transfer failed");
            }
        }
    }
}

impl CudaTransport {
    fn stream(&self, cuda: &Cuda, ordinal: u32) -> Result<Arc<Stream>, TransferError> {
        let mut streams = self.streams.lock();
        if let Some(s) = streams.get(&ordinal) {
            return Ok(s.clone());
        }
        let s = Arc::new(cuda.device(ordinal as usize).and_then(|d| d.stream()).map_err(cuda_err)?);
        streams.insert(ordinal, s.clone());
        Ok(s)
    }

    /// A peer's GPU region mapped here (once).
    fn map(
        &self,
        cuda: &Cuda,
        job: &Job,
        region: RegionId,
    ) -> Result<Arc<IpcMapping>, TransferError> {
        let peer = job.peer()?;
        let md = peer.metadata();
        let key = (md.name.clone(), md.pid, region);
        if let Some(m) = self.maps.lock().get(&key) {
            return Ok(m.clone());
        }
        let no = |reason: String| TransferError::NoTransport { peer: md.name.clone(), reason };
        let export = md
            .regions
            .iter()
            .find(|r| r.id == region)
            .and_then(|r| r.cuda_ipc.clone())
            .ok_or_else(|| no(format!("region {region} has no CUDA IPC export")))?;
        let dev = cuda.device_by_uuid(&export.uuid).map_err(|e| no(e.to_string()))?;
        let m = Arc::new(dev.open(&export).map_err(cuda_err)?);
        self.maps.lock().insert(key, m.clone());
        Ok(m)
    }

    /// Queues one copy; returns the device whose stream took it (None for a memcpy).
    fn queue(
        &self,
        cuda: &Cuda,
        src: Loc,
        dst: Loc,
        len: u64,
        host_copy: impl FnOnce() -> Result<(), TransferError>,
    ) -> Result<Option<u32>, TransferError> {
        let n = len as usize;
        let ordinal = match (src, dst) {
            (Loc::Host(_), Loc::Host(_)) => {
                host_copy()?;
                return Ok(None);
            }
            (Loc::Host(s), Loc::Device(o, d)) => {
                // SAFETY: both ranges were checked against their regions or mappings, which
                // the job's leases (and the InFlight guard) keep alive until the copy ran.
                unsafe { self.stream(cuda, o)?.copy_h2d(d, s, n) }.map_err(cuda_err)?;
                o
            }
            (Loc::Device(o, s), Loc::Host(d)) => {
                // SAFETY: both ranges were checked against their regions or mappings, which
                // the job's leases (and the InFlight guard) keep alive until the copy ran.
                unsafe { self.stream(cuda, o)?.copy_d2h(d, s, n) }.map_err(cuda_err)?;
                o
            }
            (Loc::Device(o, s), Loc::Device(_, d)) => {
                // SAFETY: both ranges were checked against their regions or mappings, which
                // the job's leases (and the InFlight guard) keep alive until the copy ran.
                unsafe { self.stream(cuda, o)?.copy_d2d(d, s, n) }.map_err(cuda_err)?;
                o
            }
        };
        Ok(Some(ordinal))
    }

    async fn run(&self, job: &Job) -> Result<(), TransferError> {
        if job.checksum {
            return Err(TransferError::Invalid(
                "checksums of GPU memory are not computed: post this transfer without checksum"
                    .into(),
            ));
        }
        let cuda = cuda::probe().map_err(|why| TransferError::NoTransport {
            peer: job.peer.as_ref().map(|p| p.metadata().name.clone()).unwrap_or_default(),
            reason: why.to_string(),
        })?;
        let mut guard =
            InFlight { events: Vec::new(), _leases: job.leases.clone(), _maps: Vec::new() };
        let mut used: Vec<u32> = Vec::new();
        let endpoint = job.endpoint()?;
        for p in &job.pieces {
            let local = job.region(p);
            let here = locate(local, p.local_offset, p.len())?;
            let (there, remote_lease) = match &job.peer {
                None => {
                    let lease = endpoint.lease_registered(&p.remote)?;
                    (locate(lease.region(), p.remote.offset, p.len())?, Some(lease))
                }
                Some(_) => {
                    let m = self.map(&cuda, job, p.remote.region)?;
                    cuda::check_range(p.remote.offset, p.len(), m.len() as u64)
                        .map_err(|e| TransferError::Invalid(e.to_string()))?;
                    let loc = Loc::Device(m.ordinal() as u32, m.ptr() + p.remote.offset);
                    guard._maps.push(m);
                    (loc, None)
                }
            };
            let (src, dst) = match job.op {
                TransferOp::Write => (here, there),
                TransferOp::Read => (there, here),
            };
            let host_copy = || -> Result<(), TransferError> {
                let remote = remote_lease.as_ref().ok_or_else(|| {
                    TransferError::Invalid("host memory of a peer goes through shm or tcp".into())
                })?;
                let (s, so, d, dof) = match job.op {
                    TransferOp::Write => (local, p.local_offset, remote.region(), p.remote.offset),
                    TransferOp::Read => (remote.region(), p.remote.offset, local, p.local_offset),
                };
                Ok(copy_between(s, so, d, dof, p.len())?)
            };
            if let Some(o) = self.queue(&cuda, src, dst, p.len(), host_copy)? {
                if !used.contains(&o) {
                    used.push(o);
                }
            }
            if let Some(l) = remote_lease {
                guard._leases.push(l);
            }
        }
        for o in used {
            guard.events.push(self.stream(&cuda, o)?.record().map_err(cuda_err)?);
        }
        for e in guard.events.clone() {
            e.done().await.map_err(cuda_err)?;
        }
        drop(guard);
        if let Some(message) = &job.notify {
            match &job.peer {
                Some(peer) => {
                    peer.session.commit(job.id, Vec::new(), Some(message.clone())).await?
                }
                None => {
                    let n = crate::endpoint::Notification {
                        from: endpoint.name().to_string(),
                        transfer_id: job.id,
                        message: message.clone(),
                    };
                    endpoint
                        .deliver(n)
                        .await
                        .map_err(|r| TransferError::Remote { code: r.code, message: r.message })?;
                }
            }
        }
        Ok(())
    }
}

impl Transport for CudaTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Cuda
    }

    fn execute<'a>(&'a self, job: &'a Job) -> TransportFuture<'a> {
        Box::pin(self.run(job))
    }
}
