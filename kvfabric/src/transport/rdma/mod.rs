//! `rdma`: any host with an RDMA device (InfiniBand or RoCE). One-sided RDMA READ and WRITE
//! between registered regions, over reliable-connected queue pairs.
//!
//! - **Verbs** come from `libibverbs.so.1`, loaded at run time ([`verbs`]): the binary builds
//!   and runs without rdma-core; an agent on a host without a usable device says why in its
//!   metadata and its log and uses TCP.
//! - **Connections**: per peer, several queue pairs (striped, like TCP's connections). Their
//!   addresses and the owner's region keys travel over the agent's authenticated session
//!   ([`exchange`]): `RdmaConnect` with the client's queue pairs, `RdmaAccept` with the
//!   owner's and the remote keys of what it exports. A peer without the secret learns no key.
//! - **Memory** is registered once per region, on first use (local) or when a peer connects
//!   (exported), and deregistered when the region is.
//! - **Work**: a job's descriptor pairs become chains of work requests within the device's
//!   limits ([`plan`]), posted with at most the send queue's depth outstanding per queue
//!   pair; one thread per device polls the completion queue for every transfer
//!   ([`completion`]). An error completion, a dead peer (the adapter's retries run out in about
//!   half a second) and a dropped transfer (a deadline, a cancel) fail the transfer typed;
//!   the connection's queue pairs go to the error state, which flushes what they still hold,
//!   and the next transfer connects again.
//! - **Checksums and the notification** go through the session, as for `shm`: after the last
//!   byte, a `Commit` that the owner verifies before it delivers the notification; a
//!   checksummed READ first asks the owner for the checksums of its bytes.
//!
//! What a host without a device cannot prove: that the queue pairs connect and move bytes on
//! real hardware. `scripts/rdma-check.sh` runs the RDMA tests and benchmark rows from
//! prebuilt binaries on a host that has one.

pub mod completion;
pub mod device;
pub mod exchange;
pub mod plan;
pub mod raw;
pub mod verbs;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::endpoint::Endpoint;
use crate::memory::{Region, RegionId};
use crate::peer::Peer;
use crate::transfer::{TransferError, TransferOp, TransportKind};
use crate::wire::WireDesc;

use super::{Job, Transport, TransportFuture};
use completion::{Progress, Tracker, WrId};
use device::{Cq, Device, Mr, Qp};
use exchange::{Accept, Connect, RegionKey};

pub use device::DeviceInfo;
pub use verbs::Unavailable;

/// How the RDMA transport uses its device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RdmaConfig {
    /// The device (`mlx5_0`); None: the first with an active port.
    pub device: Option<String>,
    /// GID index on RoCE ports.
    pub gid_index: u8,
    /// Queue pairs per peer (1..=16).
    pub qps_per_peer: usize,
    /// Bytes per work request at most (work is striped over the queue pairs at this grain).
    pub wr_bytes_max: u64,
    /// Send queue depth per queue pair.
    pub queue_depth: u32,
    /// A completion every this many work requests of a chain (and the last).
    pub signal_every: usize,
}

impl Default for RdmaConfig {
    fn default() -> Self {
        RdmaConfig {
            device: None,
            gid_index: 0,
            qps_per_peer: 4,
            wr_bytes_max: 1 << 20,
            queue_depth: 256,
            signal_every: 16,
        }
    }
}

impl RdmaConfig {
    /// The configuration the environment asks for, as operators set it for every agent of a
    /// process (workers, peers, the C ABI's): `KVFABRIC_RDMA` = `auto` (default: the first
    /// device with an active port), `off`, or a device name (`mlx5_0`);
    /// `KVFABRIC_RDMA_GID_INDEX` = the GID index on RoCE ports (default 0). None: off.
    pub fn from_env() -> Option<RdmaConfig> {
        Self::from_values(
            std::env::var("KVFABRIC_RDMA").ok().as_deref(),
            std::env::var("KVFABRIC_RDMA_GID_INDEX").ok().as_deref(),
        )
    }

    fn from_values(rdma: Option<&str>, gid_index: Option<&str>) -> Option<RdmaConfig> {
        let mut cfg = RdmaConfig::default();
        match rdma.map(str::trim) {
            None | Some("" | "auto") => {}
            Some("off" | "0" | "false" | "no") => return None,
            Some(device) => cfg.device = Some(device.to_string()),
        }
        if let Some(g) = gid_index {
            match g.trim().parse::<u8>() {
                Ok(i) => cfg.gid_index = i,
                Err(_) => {
                    tracing::warn!(value = g, "KVFABRIC_RDMA_GID_INDEX is not 0..=255; using 0")
                }
            }
        }
        Some(cfg)
    }
}

/// A region registered with the device, kept alive while registered.
#[derive(Debug)]
struct Registration {
    mr: Mr,
    base: u64,
    len: u64,
    _region: Arc<Region>,
}

/// The queue pairs to one peer and the keys of what it exports.
#[derive(Debug)]
struct Connection {
    qps: Vec<Qp>,
    keys: HashMap<u64, RegionKey>,
    broken: AtomicBool,
    _budget: QpBudget,
}

/// Queue pairs counted against the completion queue's capacity while they exist.
#[derive(Debug)]
struct QpBudget {
    n: usize,
    open: Arc<std::sync::atomic::AtomicUsize>,
}

impl Drop for QpBudget {
    fn drop(&mut self) {
        self.open.fetch_sub(self.n, Ordering::AcqRel);
    }
}

impl Connection {
    /// Moves every queue pair to the error state: outstanding work is flushed, none lands.
    fn fail(&self) {
        if !self.broken.swap(true, Ordering::AcqRel) {
            for qp in &self.qps {
                if let Err(e) = qp.fail() {
                    tracing::warn!(error = %e, "RDMA: a queue pair would not enter the error state");
                }
            }
        }
    }
}

/// A transfer's outstanding work, shared with the poller.
#[derive(Debug)]
struct InFlight {
    tracker: Mutex<Tracker>,
    wake: tokio::sync::Notify,
    /// For the blocking wait of a dropped transfer.
    done: (std::sync::Mutex<bool>, std::sync::Condvar),
    peer: String,
}

/// State shared with the completion thread.
#[derive(Debug, Default)]
struct Shared {
    inflight: Mutex<HashMap<u32, Arc<InFlight>>>,
    stop: AtomicBool,
    /// Completion-queue failures (the thread stops polling; transfers time out).
    poll_error: Mutex<Option<String>>,
}

/// The RDMA transport of one agent.
#[derive(Debug)]
pub struct RdmaTransport {
    dev: Arc<Device>,
    cq: Arc<Cq>,
    cfg: RdmaConfig,
    endpoint: Weak<Endpoint>,
    registrations: Mutex<HashMap<RegionId, Arc<Registration>>>,
    /// Connections this agent opened, by peer name.
    outgoing: tokio::sync::Mutex<HashMap<String, Arc<Connection>>>,
    /// Connections peers opened to this agent (kept so their queue pairs live).
    incoming: Mutex<HashMap<String, Arc<Connection>>>,
    shared: Arc<Shared>,
    /// Entries of the completion queue (bounds the queue pairs open at once).
    cq_entries: u32,
    qps_open: Arc<std::sync::atomic::AtomicUsize>,
    next_transfer: AtomicU32,
    poller: Option<std::thread::JoinHandle<()>>,
}

impl RdmaTransport {
    /// Opens the device and starts its completion thread; why not when this host has no
    /// usable device.
    pub fn open(cfg: RdmaConfig, endpoint: Weak<Endpoint>) -> Result<RdmaTransport, Unavailable> {
        let mut cfg = cfg;
        let dev = Device::open(cfg.device.as_deref(), cfg.gid_index)?;
        let depth = cfg.queue_depth.clamp(1, dev.info().max_qp_wr);
        cfg.queue_depth = depth;
        // Room for 64 peers' queue pairs (each connection's send queues complete into it).
        let entries = (depth as usize * cfg.qps_per_peer.clamp(1, exchange::QPS_MAX) * 64)
            .min(dev.info().max_cqe as usize) as u32;
        let cq = Arc::new(dev.completion_queue(entries).map_err(|e| Unavailable(e.to_string()))?);
        let shared = Arc::new(Shared::default());
        let poller = {
            let (cq, shared) = (cq.clone(), shared.clone());
            std::thread::Builder::new()
                .name("kvfabric-rdma-cq".into())
                .spawn(move || poll_loop(&cq, &shared))
                .map_err(|e| Unavailable(format!("starting the completion thread: {e}")))?
        };
        tracing::info!(device = %dev.info().name, port = dev.info().port, link_layer = dev.info().link_layer, "RDMA transport ready");
        Ok(RdmaTransport {
            dev,
            cq,
            cfg,
            endpoint,
            registrations: Mutex::new(HashMap::new()),
            outgoing: tokio::sync::Mutex::new(HashMap::new()),
            incoming: Mutex::new(HashMap::new()),
            shared,
            cq_entries: entries,
            qps_open: Arc::default(),
            next_transfer: AtomicU32::new(1),
            poller: Some(poller),
        })
    }

    /// The device in use.
    pub fn device(&self) -> &DeviceInfo {
        self.dev.info()
    }

    /// Forgets a region's registration (it is being deregistered): peers' keys for it stop
    /// working once in-flight transfers holding it end.
    pub fn forget_region(&self, id: RegionId) {
        self.registrations.lock().remove(&id);
    }

    fn registration(&self, region: &Region) -> Result<Arc<Registration>, TransferError> {
        if let Some(r) = self.registrations.lock().get(&region.id()) {
            return Ok(r.clone());
        }
        if region.kind() != crate::memory::MemoryKind::Host {
            return Err(TransferError::NoTransport {
                peer: String::new(),
                reason: "rdma moves host memory; GPU memory through dma-buf is not built yet"
                    .into(),
            });
        }
        let endpoint = self.endpoint.upgrade().ok_or(TransferError::Shutdown)?;
        let arc = endpoint
            .regions()
            .get(region.id())
            .map_err(|e| TransferError::Local { kind: e.kind(), message: e.to_string() })?;
        let len = arc.len() as u64;
        let base = arc
            .ptr_at(0, len)
            .map_err(|e| TransferError::Local { kind: e.kind(), message: e.to_string() })?;
        // SAFETY: the registration keeps the region (and so its memory) alive.
        let mr =
            unsafe { self.dev.register(base, len as usize, arc.is_exported()) }.map_err(|e| {
                TransferError::Protocol(format!("RDMA registration of region {}: {e}", region.id()))
            })?;
        let r = Arc::new(Registration { mr, base: base as u64, len, _region: arc });
        self.registrations.lock().entry(region.id()).or_insert(r.clone());
        Ok(r)
    }

    fn new_qps(&self, n: usize) -> Result<(Vec<Qp>, QpBudget), TransferError> {
        // Every queue pair may have its whole send queue complete (or be flushed) at once:
        // their depths must fit the shared completion queue, or it would overflow.
        let most = (self.cq_entries / self.cfg.queue_depth.max(1)) as usize;
        let open = self.qps_open.fetch_add(n, Ordering::AcqRel);
        let budget = QpBudget { n, open: self.qps_open.clone() };
        if open + n > most {
            return Err(TransferError::NoTransport {
                peer: String::new(),
                reason: format!(
                    "rdma: {open} queue pairs open; {n} more would overflow the completion queue \
                     ({most} at most)"
                ),
            });
        }
        let mut psn = [0u8; 4];
        let _ = getrandom::fill(&mut psn);
        let psn = u32::from_le_bytes(psn);
        (0..n)
            .map(|i| {
                self.dev
                    .queue_pair(&self.cq, self.cfg.queue_depth, psn.wrapping_add(i as u32 * 7919))
                    .map_err(|e| TransferError::Protocol(format!("RDMA queue pair: {e}")))
            })
            .collect::<Result<Vec<_>, _>>()
            .map(|qps| (qps, budget))
    }

    /// The owner's side of a connection: queue pairs for the client's, connected, and the
    /// keys of every exported host region.
    pub fn accept(&self, from: &str, connect: &Connect) -> Result<Accept, String> {
        let (qps, budget) = self.new_qps(connect.qps.len()).map_err(|e| e.to_string())?;
        for (qp, remote) in qps.iter().zip(&connect.qps) {
            qp.connect(remote).map_err(|e| e.to_string())?;
        }
        let endpoint = self.endpoint.upgrade().ok_or("agent shut down")?;
        let mut regions = Vec::new();
        for r in endpoint
            .regions()
            .all()
            .into_iter()
            .filter(|r| r.is_exported() && r.kind() == crate::memory::MemoryKind::Host)
        {
            let reg = self.registration(&r).map_err(|e| e.to_string())?;
            regions.push(RegionKey {
                region: r.id().0,
                addr: reg.base,
                len: reg.len,
                rkey: reg.mr.rkey(),
            });
        }
        let accept = Accept { qps: qps.iter().map(Qp::addr).collect(), regions };
        let conn = Arc::new(Connection {
            qps,
            keys: HashMap::new(),
            broken: AtomicBool::new(false),
            _budget: budget,
        });
        // A peer that connects again (it restarted, or its queue pairs failed) replaces its
        // old queue pairs.
        if let Some(old) = self.incoming.lock().insert(from.to_string(), conn) {
            old.fail();
        }
        Ok(accept)
    }

    async fn connection(&self, peer: &Peer) -> Result<Arc<Connection>, TransferError> {
        let name = &peer.metadata().name;
        let mut conns = self.outgoing.lock().await;
        if let Some(c) = conns.get(name).filter(|c| !c.broken.load(Ordering::Acquire)) {
            return Ok(c.clone());
        }
        let (qps, budget) = self.new_qps(self.cfg.qps_per_peer.clamp(1, exchange::QPS_MAX))?;
        let connect = Connect { qps: qps.iter().map(Qp::addr).collect() };
        let accept = peer.session.rdma_connect(&connect).await?;
        if accept.qps.len() != qps.len() {
            return Err(TransferError::Protocol(format!(
                "RDMA accept with {} queue pairs for our {}",
                accept.qps.len(),
                qps.len()
            )));
        }
        for (qp, remote) in qps.iter().zip(&accept.qps) {
            qp.connect(remote)
                .map_err(|e| TransferError::Protocol(format!("RDMA connect to {name}: {e}")))?;
        }
        let keys = accept.regions.iter().map(|k| (k.region, *k)).collect();
        let c = Arc::new(Connection { qps, keys, broken: AtomicBool::new(false), _budget: budget });
        conns.insert(name.clone(), c.clone());
        Ok(c)
    }

    async fn run(&self, job: &Job) -> Result<(), TransferError> {
        let peer = job.peer()?;
        let mut conn = self.connection(peer).await?;
        // A region the peer registered after we connected: connect again for its key.
        if job.pieces.iter().any(|p| !conn.keys.contains_key(&p.remote.region.0)) {
            conn.fail();
            conn = self.connection(peer).await?;
        }
        let mut segs = Vec::with_capacity(job.pieces.len());
        for (i, p) in job.pieces.iter().enumerate() {
            let region = job.region(p);
            let reg = self.registration(region)?;
            let local = region.ptr_at(p.local_offset, p.len())?;
            let key = conn.keys.get(&p.remote.region.0).ok_or_else(|| {
                TransferError::RemoteDescriptor {
                    index: i,
                    reason: format!(
                        "region {} is not exported to this agent over RDMA",
                        p.remote.region
                    ),
                }
            })?;
            let remote_addr = key.remote_addr(p.remote.offset, p.len()).ok_or_else(|| {
                TransferError::RemoteDescriptor {
                    index: i,
                    reason: "outside the peer's registration".into(),
                }
            })?;
            segs.push(plan::Segment {
                local_addr: local as u64,
                lkey: reg.mr.lkey(),
                remote_addr,
                rkey: key.rkey,
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
        let expected = if job.checksum && job.op == TransferOp::Read {
            Some(peer.session.checksums(wire(None)).await?)
        } else {
            None
        };
        let limits = plan::Limits {
            max_sge: self.dev.info().max_sge,
            wr_bytes_max: self.cfg.wr_bytes_max.min(self.dev.info().max_msg_bytes).max(1),
            qps: conn.qps.len(),
            signal_every: self.cfg.signal_every,
        };
        let chains =
            plan::plan(&segs, &limits).map_err(|e| TransferError::Invalid(e.to_string()))?;
        self.move_bytes(&conn, &peer.metadata().name, job.op, &chains).await?;
        match job.op {
            TransferOp::Write => {
                let verify = if job.checksum {
                    let sums = job
                        .pieces
                        .iter()
                        .map(|p| {
                            Ok(job.sent_checksum(job.region(p).checksum(p.local_offset, p.len())?))
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
                    for (i, (p, &e)) in job.pieces.iter().zip(&expected).enumerate() {
                        if job.sent_checksum(job.region(p).checksum(p.local_offset, p.len())?) != e
                        {
                            return Err(TransferError::Checksum { index: i });
                        }
                    }
                }
                if let Some(n) = &job.notify {
                    peer.session.commit(job.id, Vec::new(), Some(n.clone())).await?;
                }
            }
        }
        Ok(())
    }

    /// Posts the chains and waits for their completions.
    async fn move_bytes(
        &self,
        conn: &Arc<Connection>,
        peer: &str,
        op: TransferOp,
        chains: &[Vec<plan::WorkRequest>],
    ) -> Result<(), TransferError> {
        if chains.iter().any(|c| c.len() >= completion::WR_INDEX_MAX) {
            return Err(TransferError::Invalid(
                "too many RDMA work requests in one transfer".into(),
            ));
        }
        let lens: Vec<u32> = chains.iter().map(|c| c.len() as u32).collect();
        let id = self.next_transfer.fetch_add(1, Ordering::Relaxed);
        let flight = Arc::new(InFlight {
            tracker: Mutex::new(Tracker::new(&lens)),
            wake: tokio::sync::Notify::new(),
            done: (std::sync::Mutex::new(false), std::sync::Condvar::new()),
            peer: peer.to_string(),
        });
        self.shared.inflight.lock().insert(id, flight.clone());
        let guard =
            FlightGuard { shared: &self.shared, id, flight: &flight, conn, finished: false };
        let opcode = match op {
            TransferOp::Write => verbs::consts::WR_RDMA_WRITE,
            TransferOp::Read => verbs::consts::WR_RDMA_READ,
        };
        let mut guard = guard;
        loop {
            for (q, chain) in chains.iter().enumerate() {
                let qp = &conn.qps[q];
                let (start, room) = {
                    let t = flight.tracker.lock();
                    (t.next_index(q), t.room(q, qp.depth()))
                };
                if room == 0 {
                    continue;
                }
                let batch = &chain[start as usize..(start + room) as usize];
                let mut sges: Vec<verbs::IbvSge> =
                    Vec::with_capacity(batch.iter().map(|w| w.sges.len()).sum());
                for w in batch {
                    sges.extend(w.sges.iter().map(|e| verbs::IbvSge {
                        addr: e.addr,
                        length: e.len,
                        lkey: e.lkey,
                    }));
                }
                let mut wrs: Vec<verbs::IbvSendWr> = Vec::with_capacity(batch.len());
                let mut at = 0usize;
                for (k, w) in batch.iter().enumerate() {
                    let wr_id = WrId { transfer: id, qp: q as u8, index: start + k as u32 }.pack();
                    wrs.push(verbs::IbvSendWr {
                        wr_id,
                        sg_list: sges[at..].as_mut_ptr(),
                        num_sge: w.sges.len() as i32,
                        opcode,
                        // The last of a batch is signaled too, so the window always moves.
                        send_flags: if w.signaled || k + 1 == batch.len() {
                            verbs::consts::SEND_SIGNALED
                        } else {
                            0
                        },
                        remote_addr: w.remote_addr,
                        rkey: w.rkey,
                        ..Default::default()
                    });
                    at += w.sges.len();
                }
                for k in 1..wrs.len() {
                    let next: *mut verbs::IbvSendWr = &mut wrs[k];
                    wrs[k - 1].next = next;
                }
                // SAFETY: the chain is linked above and ends in null; its entries (`sges`)
                // outlive the call; the bytes they name lie in registrations held by this
                // transfer's job (leases) and by `self.registrations`, and stay so until
                // every request completed or was flushed (the guard waits for that).
                let posted = unsafe { qp.post(wrs.as_mut_ptr()) };
                let mut t = flight.tracker.lock();
                match posted {
                    Ok(()) => t.posted(q, room),
                    Err(e) => {
                        t.fail(TransferError::Protocol(format!("RDMA post to {peer}: {e}")));
                        drop(t);
                        conn.fail();
                    }
                }
            }
            let notified = flight.wake.notified();
            match flight.tracker.lock().progress() {
                Progress::Finished(outcome) => {
                    guard.finished = true;
                    if outcome.is_err() {
                        conn.fail();
                    }
                    return outcome;
                }
                Progress::Pending => {}
            }
            if let Some(e) = self.shared.poll_error.lock().clone() {
                return Err(TransferError::Protocol(format!("RDMA completion queue: {e}")));
            }
            notified.await;
        }
    }
}

/// Removes a transfer from the poller's table when it ends; a transfer dropped with work
/// outstanding fails its connection's queue pairs (flushing that work) and waits, bounded,
/// for the flush, so that no byte lands in memory the job no longer leases.
struct FlightGuard<'a> {
    shared: &'a Shared,
    id: u32,
    flight: &'a Arc<InFlight>,
    conn: &'a Arc<Connection>,
    finished: bool,
}

impl Drop for FlightGuard<'_> {
    fn drop(&mut self) {
        if !self.finished {
            self.conn.fail();
            let (lock, cv) = &self.flight.done;
            let deadline = Instant::now() + Duration::from_secs(2);
            let mut done = lock.lock().unwrap_or_else(|p| p.into_inner());
            while !*done && !matches!(self.flight.tracker.lock().progress(), Progress::Finished(_))
            {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    tracing::error!(transfer = self.id, peer = %self.flight.peer, "RDMA work not flushed within 2 s of a dropped transfer");
                    break;
                }
                done = cv
                    .wait_timeout(done, left.min(Duration::from_millis(10)))
                    .map(|(g, _)| g)
                    .unwrap_or_else(|p| p.into_inner().0);
            }
        }
        self.shared.inflight.lock().remove(&self.id);
    }
}

fn poll_loop(cq: &Cq, shared: &Shared) {
    let mut wc = vec![verbs::IbvWc::default(); 64];
    let mut idle = 0u32;
    while !shared.stop.load(Ordering::Acquire) {
        let n = match cq.poll(&mut wc) {
            Ok(n) => n,
            Err(e) => {
                tracing::error!(error = %e, "RDMA completion queue failed; RDMA transfers will time out");
                *shared.poll_error.lock() = Some(e.to_string());
                for f in shared.inflight.lock().values() {
                    f.wake.notify_one();
                }
                return;
            }
        };
        if n == 0 {
            // Spin briefly (completions of a busy transfer come every few microseconds),
            // then back off to sleeps of up to 1 ms.
            idle = idle.saturating_add(1);
            if idle > 64 {
                std::thread::sleep(Duration::from_micros(u64::from((idle - 64).min(1000))));
            } else {
                std::hint::spin_loop();
            }
            continue;
        }
        idle = 0;
        let table = shared.inflight.lock();
        for c in &wc[..n] {
            let id = WrId::unpack(c.wr_id);
            let Some(f) = table.get(&id.transfer) else { continue };
            let p = f.tracker.lock().complete(
                usize::from(id.qp),
                id.index,
                c.status,
                c.vendor_err,
                &f.peer,
            );
            if matches!(p, Progress::Finished(_)) {
                let (lock, cv) = &f.done;
                *lock.lock().unwrap_or_else(|p| p.into_inner()) = true;
                cv.notify_all();
            }
            f.wake.notify_one();
        }
    }
}

impl Drop for RdmaTransport {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(t) = self.poller.take() {
            let _ = t.join();
        }
    }
}

impl Transport for RdmaTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Rdma
    }

    fn execute<'a>(&'a self, job: &'a Job) -> TransportFuture<'a> {
        Box::pin(self.run(job))
    }
}

/// Whether this host could use RDMA, and why not: for `/health`, logs and metadata, without
/// opening anything.
pub fn availability() -> Result<Vec<String>, Unavailable> {
    let names = device::device_names()?;
    if names.is_empty() {
        return Err(Unavailable(
            "no RDMA device on this host (ibv_get_device_list found none)".into(),
        ));
    }
    Ok(names)
}

#[cfg(test)]
mod tests {
    use super::exchange::{Connect, QpAddr};
    use crate::agent::{Agent, AgentConfig};
    use crate::transfer::TransferError;
    use crate::wire::ErrorCode;

    #[test]
    fn the_environment_chooses_the_device_or_turns_rdma_off() {
        use super::RdmaConfig;
        assert_eq!(RdmaConfig::from_values(None, None), Some(RdmaConfig::default()));
        assert_eq!(RdmaConfig::from_values(Some("auto"), None), Some(RdmaConfig::default()));
        assert_eq!(RdmaConfig::from_values(Some("off"), Some("3")), None);
        let c = RdmaConfig::from_values(Some("mlx5_1"), Some("3")).unwrap();
        assert_eq!((c.device.as_deref(), c.gid_index), (Some("mlx5_1"), 3));
        assert_eq!(RdmaConfig::from_values(None, Some("x")).unwrap().gid_index, 0);
    }

    /// Over a real session: an agent without a device answers a connect with a typed refusal
    /// (and the session stays usable); the exchange needs the secret like everything else.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_connect_to_an_agent_without_a_device_is_refused_typed() {
        if super::availability().is_ok() {
            eprintln!("SKIPPED: this host has an RDMA device (the hardware tests cover it)");
            return;
        }
        let a = Agent::start(AgentConfig::new("a", b"k".to_vec())).await.unwrap();
        let b = Agent::start(AgentConfig::new("b", b"k".to_vec())).await.unwrap();
        a.load_peer(b.metadata()).unwrap();
        let peer = a.peer("b").unwrap();
        let connect =
            Connect { qps: vec![QpAddr { lid: 1, gid: [0; 16], qpn: 5, psn: 6, mtu: 5 }] };
        let e = peer.session.rdma_connect(&connect).await.unwrap_err();
        assert!(
            matches!(&e, TransferError::Remote { code: ErrorCode::Unavailable, message } if message.contains("no RDMA device")),
            "{e}"
        );
        // The same session still answers.
        assert_eq!(peer.session.checksums(Vec::new()).await.unwrap(), Vec::<u64>::new());

        // Without the secret, no exchange at all.
        let c = Agent::start(AgentConfig::new("c", b"other".to_vec())).await.unwrap();
        c.load_peer(b.metadata()).unwrap();
        let e = c.peer("b").unwrap().session.rdma_connect(&connect).await.unwrap_err();
        assert!(matches!(e, TransferError::Auth(_)), "{e}");
    }
}
