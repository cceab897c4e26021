//! `cuda`: transfers that touch GPU memory (feature `cuda`).
//!
//! - Within this agent: every piece is one copy (host to host pieces of a mixed job are a
//!   memcpy), pieces contiguous on both sides merged into one, on a stream of the device
//!   they touch: one stream per direction (to the device, to the host, within it, to another
//!   device, staging), so that H2D, D2H and device copies of concurrent jobs overlap. Copies
//!   within one device go to the gather kernel
//!   (`cuda/copy_table.ptx`): one launch moves a whole list of scattered blocks at memory
//!   bandwidth. H2D, D2H and copies between devices go to the copy engines with one
//!   `cuMemcpyBatchAsync` per device (one `cuMemcpyAsync` each on drivers before CUDA
//!   12.8, and for a single copy). The job completes when an event recorded after its last
//!   copy has: polled for up to 1 ms when the job's copies are first in line on their
//!   streams, then (and for jobs queued behind others at once) awaited on the device's
//!   waiting thread.
//!   Pieces of one job run in no particular order.
//! - To a peer on the same host: the peer's GPU regions are mapped once through the CUDA IPC
//!   handle in its metadata (found by GPU UUID, since ordinals differ between processes), and
//!   the copy runs here, one-sided, like `shm` (on the same GPU, a gather launch); a
//!   notification goes through the session's `Commit` after the last byte.
//! - To host memory of a peer on another host: staged through pinned bounce buffers of two
//!   8 MiB slots ([`super::staging`]), D2H of one chunk overlapping the network transfer of
//!   the other (H2D and network reads the other way); checksums, when asked, cover the bounce
//!   bytes. The network is RDMA when both agents have it, else TCP. (Where both adapters
//!   reach GPU memory, the agent routes such a job to GPUDirect RDMA instead: no staging.)
//!
//! Dropping a job's future stops queuing; copies already queued run to completion before the
//! drop returns (the contract: no byte lands after it), and the job's leases are held until
//! then. Checksums of GPU memory within the host are not computed: such a job is refused with
//! a typed error rather than silently unchecked.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::cuda::{self, CopyOp, CopyTable, Cuda, Event, HostRegistration, IpcMapping, Stream};
use crate::memory::{copy_between, MemoryKind, Region, RegionId, RegionLease};
use crate::transfer::{TransferError, TransferOp, TransportKind};

use super::staging::{self, Bounce, Part, Stager};
use super::{Job, Transport, TransportFuture};

/// Bytes of one bounce slot (a bounce buffer holds two).
const STAGE_CHUNK: u64 = 8 << 20;
/// Bounce buffers at most: staged jobs beyond this many wait for one.
const BOUNCE_MAX: usize = 4;
/// Copies per copy table (24 bytes each): a job with more launches the gather kernel again.
const TABLE_ENTRIES: usize = 4096;
/// How long a job polls its completion event before waiting on the device's waiting thread
/// (see [`Event::done_polling`]). On an H200 in a VM, polling learns of a 64 KiB copy
/// 12 µs sooner than the waiting thread: 1 ms covers a gigabyte between GPU buffers or
/// 50 MB over PCIe, and longer jobs pay 1% for the hand-off.
const SPIN: std::time::Duration = std::time::Duration::from_millis(1);

/// Moves bytes to, from and between GPUs.
#[derive(Debug)]
pub struct CudaTransport {
    /// Streams by (device, lane): copies of different directions queue on different
    /// streams, so the copy engines run H2D and D2H (and the gather kernel) side by side.
    streams: Mutex<HashMap<(u32, Lane), Arc<Stream>>>,
    /// Jobs with copies queued, per stream: a job queued behind others does not poll.
    queued: Mutex<HashMap<(u32, Lane), Arc<AtomicUsize>>>,
    /// Peers' GPU regions mapped here: (peer name, peer pid, region) → mapping.
    maps: Mutex<HashMap<(String, u32, RegionId), Arc<IpcMapping>>>,
    /// The transport that carries staged chunks to other hosts, and the one that does when
    /// both agents have RDMA ([`Job::stage_over_rdma`]).
    net: Arc<dyn Transport>,
    rdma: Option<Arc<dyn Transport>>,
    /// Pinned bounce buffers not in use.
    bounces: Mutex<Vec<BounceBuf>>,
    bounce_permits: tokio::sync::Semaphore,
    /// Copy tables of the gather kernel not in use, by device.
    tables: Mutex<Vec<(u32, CopyTable)>>,
}

/// A bounce buffer: a host region of two slots, page-locked for asynchronous copies.
struct BounceBuf {
    bounce: Bounce,
    /// Unregistered after the lease is dropped (fields drop in order).
    _pin: HostRegistration,
}

impl std::fmt::Debug for BounceBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BounceBuf").field("region", &self.bounce.lease.region().id()).finish()
    }
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

impl Loc {
    /// The address in the unified address space.
    fn addr(self) -> u64 {
        match self {
            Loc::Host(p) => p as u64,
            Loc::Device(_, a) => a,
        }
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

/// Copies queued on streams, and what they touch: if the job ends before its copies are
/// known to have run (dropped, or failed after queuing some), the streams it used are
/// synchronized before its leases go, so no byte lands after that.
struct InFlight<'a> {
    streams: Vec<(u32, Arc<Stream>)>,
    /// The queued-jobs counters of those streams, counted down when the job ends.
    queued: Vec<Arc<AtomicUsize>>,
    done: bool,
    _leases: Vec<RegionLease>,
    _maps: Vec<Arc<IpcMapping>>,
    /// Copy tables the GPU reads, back to `pool` once their kernels ran.
    tables: Vec<(u32, CopyTable)>,
    pool: &'a Mutex<Vec<(u32, CopyTable)>>,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if !self.done {
            for (_, s) in &self.streams {
                if let Err(e) = s.synchronize() {
                    tracing::warn!(error = %e, "a CUDA copy of an abandoned transfer failed");
                    // A kernel may still read its table: never reuse or free it.
                    std::mem::forget(std::mem::take(&mut self.tables));
                }
            }
        }
        self.pool.lock().append(&mut self.tables);
        for q in &self.queued {
            q.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// Which of a device's streams a copy queues on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Lane {
    /// Host to device: a copy engine.
    ToDevice,
    /// Device to host: the other copy engine.
    ToHost,
    /// Within the device (its IPC mappings included): the gather kernel.
    Within,
    /// To another device.
    Across,
    /// Chunks of staged jobs (to and from bounce buffers).
    Staged,
}

/// The copies of a job on one stream of a device: one gather launch for `Within` (two
/// copies or more), one `cuMemcpyBatchAsync` otherwise.
struct DeviceWork {
    ordinal: u32,
    lane: Lane,
    ops: Vec<CopyOp>,
}

/// Appends `op`, merged into the last copy when contiguous with it on both sides.
fn push_merged(ops: &mut Vec<CopyOp>, op: CopyOp) {
    match ops.last_mut() {
        Some(last)
            if last.src + last.len as u64 == op.src && last.dst + last.len as u64 == op.dst =>
        {
            last.len += op.len
        }
        _ => ops.push(op),
    }
}

impl CudaTransport {
    /// A CUDA transport whose staged chunks travel over `net`, or `rdma` for jobs that say
    /// so.
    pub fn new(net: Arc<dyn Transport>, rdma: Option<Arc<dyn Transport>>) -> Self {
        CudaTransport {
            streams: Mutex::default(),
            queued: Mutex::default(),
            maps: Mutex::default(),
            net,
            rdma,
            bounces: Mutex::default(),
            bounce_permits: tokio::sync::Semaphore::new(BOUNCE_MAX),
            tables: Mutex::default(),
        }
    }

    /// A free bounce buffer, allocated (and pinned) on first need.
    fn take_bounce(&self, cuda: &Cuda, job: &Job) -> Result<BounceBuf, TransferError> {
        if let Some(b) = self.bounces.lock().pop() {
            return Ok(b);
        }
        let endpoint = job.endpoint()?;
        let region = endpoint.regions().alloc(
            (2 * STAGE_CHUNK) as usize,
            crate::memory::RegionOptions { shared: false, huge_pages: false, export: false },
        )?;
        let ptr = region.ptr_at(0, 2 * STAGE_CHUNK)?;
        let device = cuda.device(0).map_err(cuda_err)?;
        // SAFETY: the region's mapping outlives the registration: the BounceBuf drops its
        // lease (the table keeps the region registered and mapped) before unregistering.
        let pin =
            unsafe { device.register_host(ptr, (2 * STAGE_CHUNK) as usize) }.map_err(cuda_err)?;
        Ok(BounceBuf {
            bounce: Bounce { lease: RegionLease::new(region), slot_bytes: STAGE_CHUNK },
            _pin: pin,
        })
    }

    /// A job between local memory (GPU memory among it) and host memory of a peer on
    /// another host: staged through a bounce buffer.
    async fn run_staged(&self, job: &Job, cuda: &Cuda) -> Result<(), TransferError> {
        let _permit = self.bounce_permits.acquire().await.map_err(|_| TransferError::Shutdown)?;
        let buf = self.take_bounce(cuda, job)?;
        let stager = CudaStager { t: self, cuda, used: Mutex::default(), ever: Mutex::default() };
        let net = match &self.rdma {
            Some(rdma) if job.stage_over_rdma => rdma.as_ref(),
            _ => self.net.as_ref(),
        };
        let r = staging::run(job, &buf.bounce, &stager, net).await;
        drop(stager);
        self.bounces.lock().push(buf);
        r
    }

    /// A free copy table of `ordinal`'s device, allocated on first need.
    fn take_table(&self, cuda: &Cuda, ordinal: u32) -> Result<CopyTable, TransferError> {
        let mut tables = self.tables.lock();
        if let Some(i) = tables.iter().position(|(o, _)| *o == ordinal) {
            return Ok(tables.swap_remove(i).1);
        }
        drop(tables);
        cuda.device(ordinal as usize)
            .and_then(|d| d.alloc_copy_table(TABLE_ENTRIES))
            .map_err(cuda_err)
    }

    fn stream(&self, cuda: &Cuda, ordinal: u32, lane: Lane) -> Result<Arc<Stream>, TransferError> {
        let mut streams = self.streams.lock();
        if let Some(s) = streams.get(&(ordinal, lane)) {
            return Ok(s.clone());
        }
        let s = Arc::new(cuda.device(ordinal as usize).and_then(|d| d.stream()).map_err(cuda_err)?);
        streams.insert((ordinal, lane), s.clone());
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
        let mut maps = self.maps.lock();
        // Mappings of an earlier process of the same name (a restarted peer) are closed
        // once no transfer holds them.
        maps.retain(|(name, pid, _), _| name != &md.name || *pid == md.pid);
        maps.insert(key, m.clone());
        Ok(m)
    }

    /// Queues one copy of a staged job (on the device's staging lane); returns the device
    /// whose stream took it (None for a memcpy).
    fn queue(
        &self,
        cuda: &Cuda,
        src: Loc,
        dst: Loc,
        len: u64,
        host_copy: impl FnOnce() -> Result<(), TransferError>,
    ) -> Result<Option<u32>, TransferError> {
        let ordinal = match (src, dst) {
            (Loc::Host(_), Loc::Host(_)) => {
                host_copy()?;
                return Ok(None);
            }
            (Loc::Device(o, _), _) | (_, Loc::Device(o, _)) => o,
        };
        let op = CopyOp { dst: dst.addr(), src: src.addr(), len: len as usize };
        // SAFETY: both ranges were checked against their regions or mappings, which the
        // job's leases (and the InFlight guard) keep alive until the copy ran.
        unsafe { self.stream(cuda, ordinal, Lane::Staged)?.copy_batch(&[op]) }.map_err(cuda_err)?;
        Ok(Some(ordinal))
    }

    async fn run(&self, job: &Job) -> Result<(), TransferError> {
        let cuda = cuda::probe().map_err(|why| TransferError::NoTransport {
            peer: job.peer.as_ref().map(|p| p.metadata().name.clone()).unwrap_or_default(),
            reason: why.to_string(),
        })?;
        if job.peer.as_ref().is_some_and(|p| !p.same_host()) {
            return self.run_staged(job, &cuda).await;
        }
        if job.checksum {
            return Err(TransferError::Invalid(
                "checksums of GPU memory are not computed: post this transfer without checksum"
                    .into(),
            ));
        }
        let mut guard = InFlight {
            streams: Vec::new(),
            queued: Vec::new(),
            done: false,
            _leases: job.leases.clone(),
            _maps: Vec::new(),
            tables: Vec::new(),
            pool: &self.tables,
        };
        let endpoint = job.endpoint()?;
        // The copies, grouped by the device whose stream takes them; runs of pieces that are
        // contiguous on both sides become one copy.
        let mut work: Vec<DeviceWork> = Vec::new();
        // This job's peer mappings, looked up once per region.
        let mut mapped: Vec<(RegionId, Arc<IpcMapping>)> = Vec::new();
        for p in &job.pieces {
            let local = job.region(p);
            let here = locate(local, p.local_offset, p.len())?;
            let (there, remote_lease) = match &job.peer {
                None => {
                    let lease = endpoint.lease_registered(&p.remote)?;
                    (locate(lease.region(), p.remote.offset, p.len())?, Some(lease))
                }
                Some(_) => {
                    let m = match mapped.iter().find(|(r, _)| *r == p.remote.region) {
                        Some((_, m)) => m.clone(),
                        None => {
                            let m = self.map(&cuda, job, p.remote.region)?;
                            mapped.push((p.remote.region, m.clone()));
                            m
                        }
                    };
                    cuda::check_range(p.remote.offset, p.len(), m.len() as u64)
                        .map_err(|e| TransferError::Invalid(e.to_string()))?;
                    (Loc::Device(m.ordinal() as u32, m.ptr() + p.remote.offset), None)
                }
            };
            let (src, dst) = match job.op {
                TransferOp::Write => (here, there),
                TransferOp::Read => (there, here),
            };
            let (ordinal, lane) = match (src, dst) {
                (Loc::Host(_), Loc::Host(_)) => {
                    let remote = remote_lease.as_ref().ok_or_else(|| {
                        TransferError::Invalid(
                            "host memory of a peer goes through shm or tcp".into(),
                        )
                    })?;
                    let (s, so, d, dof) = match job.op {
                        TransferOp::Write => {
                            (local, p.local_offset, remote.region(), p.remote.offset)
                        }
                        TransferOp::Read => {
                            (remote.region(), p.remote.offset, local, p.local_offset)
                        }
                    };
                    copy_between(s, so, d, dof, p.len())?;
                    continue;
                }
                (Loc::Device(o, _), Loc::Device(d, _)) if o == d => (o, Lane::Within),
                (Loc::Device(o, _), Loc::Device(..)) => (o, Lane::Across),
                (Loc::Device(o, _), Loc::Host(_)) => (o, Lane::ToHost),
                (Loc::Host(_), Loc::Device(o, _)) => (o, Lane::ToDevice),
            };
            let op = CopyOp { dst: dst.addr(), src: src.addr(), len: p.len() as usize };
            let w = match work.iter().position(|w| (w.ordinal, w.lane) == (ordinal, lane)) {
                Some(i) => &mut work[i],
                None => {
                    work.push(DeviceWork { ordinal, lane, ops: Vec::new() });
                    work.last_mut().expect("just pushed")
                }
            };
            push_merged(&mut w.ops, op);
            if let Some(l) = remote_lease {
                guard._leases.push(l);
            }
        }
        guard._maps.extend(mapped.into_iter().map(|(_, m)| m));
        let mut events = Vec::with_capacity(work.len());
        // Polling pays when this job's copies run next; behind other jobs on a stream it
        // would spin for their copies too, so it waits on the device's thread instead.
        let mut first_in_line = true;
        for w in &mut work {
            let stream = self.stream(&cuda, w.ordinal, w.lane)?;
            guard.streams.push((w.ordinal, stream.clone()));
            let queued = self.queued.lock().entry((w.ordinal, w.lane)).or_default().clone();
            first_in_line &= queued.fetch_add(1, Ordering::AcqRel) == 0;
            guard.queued.push(queued);
            // Every range below was checked against its region or mapping, which the job's
            // leases (and the InFlight guard) keep alive until the event below completed; the
            // guard also keeps each copy table until then. The pieces of a job run in no
            // particular order, as with RDMA: pieces that write where another piece of the
            // same job reads or writes get unspecified bytes, as the memory contract says of
            // overlapping transfers.
            let mut engine = Vec::new();
            if w.lane == Lane::Within && w.ops.len() > 1 {
                for chunk in w.ops.chunks(TABLE_ENTRIES) {
                    let mut table = self.take_table(&cuda, w.ordinal)?;
                    // SAFETY: as said above the loop; the table is this job's until its event.
                    match unsafe { stream.copy_table(&mut table, chunk) } {
                        Ok(()) => guard.tables.push((w.ordinal, table)),
                        Err(e) => {
                            // Nothing was queued: the copy engines take these copies.
                            static SAID: std::sync::Once = std::sync::Once::new();
                            SAID.call_once(|| {
                                tracing::warn!(error = %e,
                                    "CUDA gather copy unavailable: device copies go to the copy engines");
                            });
                            self.tables.lock().push((w.ordinal, table));
                            engine.extend_from_slice(chunk);
                        }
                    }
                }
            } else {
                engine = std::mem::take(&mut w.ops);
            }
            if !engine.is_empty() {
                // SAFETY: as said above the loop.
                unsafe { stream.copy_batch(&engine) }.map_err(cuda_err)?;
            }
            events.push(stream.record().map_err(cuda_err)?);
        }
        let spin = if first_in_line { SPIN } else { std::time::Duration::ZERO };
        for e in events {
            e.done_polling(spin).await.map_err(cuda_err)?;
        }
        guard.done = true;
        drop(guard);
        if let Some(message) = &job.notify {
            match &job.peer {
                Some(peer) => {
                    peer.session.commit(job.id, Vec::new(), Some(message.clone())).await?
                }
                None => job.deliver_here(message).await?,
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

/// Stages between local memory and a bounce slot with CUDA copies (a memcpy for host parts).
struct CudaStager<'a> {
    t: &'a CudaTransport,
    cuda: &'a Cuda,
    /// Devices with copies queued since the last fence.
    used: Mutex<Vec<u32>>,
    /// Every device this stager queued copies on: synchronized when it drops, so that a
    /// dropped job's copies have run before the drop returns.
    ever: Mutex<Vec<u32>>,
}

impl CudaStager<'_> {
    fn copy(&self, job: &Job, part: &Part, slot: *mut u8, out: bool) -> Result<(), TransferError> {
        let p = &job.pieces[part.piece];
        let (off, len) = (p.local_offset + part.offset, part.len);
        // SAFETY: `slot` holds `slot_offset + len` bytes (the slot's range was checked by
        // staging, and parts fit in a slot).
        let at = unsafe { slot.add(part.slot_offset as usize) };
        let (src, dst) = match locate(job.region(p), off, len)? {
            local if out => (local, Loc::Host(at)),
            local => (Loc::Host(at), local),
        };
        let host_copy = || {
            let (Loc::Host(s), Loc::Host(d)) = (src, dst) else { unreachable!("host parts") };
            // SAFETY: both ranges were checked (the region's by `locate`, the slot's above)
            // and lie in distinct regions.
            unsafe { std::ptr::copy_nonoverlapping(s, d, len as usize) };
            Ok(())
        };
        if let Some(o) = self.t.queue(self.cuda, src, dst, len, host_copy)? {
            for list in [&self.used, &self.ever] {
                let mut l = list.lock();
                if !l.contains(&o) {
                    l.push(o);
                }
            }
        }
        Ok(())
    }
}

impl Stager for CudaStager<'_> {
    fn stage_out(&self, job: &Job, part: &Part, slot: *mut u8) -> Result<(), TransferError> {
        self.copy(job, part, slot, true)
    }

    fn stage_in(&self, job: &Job, part: &Part, slot: *mut u8) -> Result<(), TransferError> {
        self.copy(job, part, slot, false)
    }

    fn fence(&self) -> impl std::future::Future<Output = Result<(), TransferError>> + Send {
        let used = std::mem::take(&mut *self.used.lock());
        let events: Result<Vec<Event>, TransferError> = used
            .into_iter()
            .map(|o| self.t.stream(self.cuda, o, Lane::Staged)?.record().map_err(cuda_err))
            .collect();
        async move {
            for e in events? {
                e.done_polling(SPIN).await.map_err(cuda_err)?;
            }
            Ok(())
        }
    }
}

impl Drop for CudaStager<'_> {
    fn drop(&mut self) {
        for &o in self.ever.lock().iter() {
            if let Ok(s) = self.t.stream(self.cuda, o, Lane::Staged) {
                let _ = s.synchronize();
            }
        }
    }
}
