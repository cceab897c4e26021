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
//!   (exported), and deregistered when the region is. GPU memory too, where the adapter
//!   reaches it ([`GpuDirect`]): through a dma-buf the CUDA driver exports, or through
//!   `nvidia-peermem`; GPU regions are addressed by their device addresses.
//! - **Work**: a job's descriptor pairs become chains of work requests within the device's
//!   limits ([`plan`]). Every queue pair's send queue is shared by the transfers to that peer
//!   through credits: a transfer posts only what the queue has room for and waits for
//!   completions (its own or others') for more. One thread per device polls the completion
//!   queue for every transfer ([`completion`]), spinning while completions come and
//!   sleeping on the queue's completion channel when they stop; another reads the device's asynchronous
//!   events (which must be acknowledged before a queue pair can be destroyed). An error
//!   completion, a dead peer (the adapter's retries run out in 0.5–2 s) and a dropped
//!   transfer (a deadline, a cancel) fail the transfer typed; the connection's queue pairs go
//!   to the error state, which flushes what they still hold, and the next transfer connects
//!   again.
//! - **Notifications** of WRITEs without checksums ride a WRITE with immediate data into the
//!   owner's mailbox after the last byte (the owner copies the slot out, posts its receive
//!   again, and delivers in order from a bounded backlog). **Checksums** (and oversize notifications) go
//!   through the session, as for `shm`: a `Commit` that the owner verifies before it delivers
//!   the notification; a checksummed READ first asks the owner for the checksums of its bytes.
//!
//! What a host without a device cannot prove: that the queue pairs connect and move bytes on
//! real hardware. `scripts/rdma-check.sh` runs the RDMA tests and benchmark rows from
//! prebuilt binaries on a host that has one.
//!
//! Over 1,000 lines (its tests are in `tests.rs` and `double_tests.rs`) because the transport's
//! connection state, posting and completion handling are one state machine over the same
//! queue pairs; its pieces that stand alone (devices, completions, the mailbox, the plan, the
//! poller, raw verbs) are modules of their own.

pub mod completion;
pub mod device;
#[cfg(test)]
mod fake;
mod gpu;
mod mailbox;
pub mod plan;
mod poller;
pub mod raw;
pub mod verbs;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::endpoint::Endpoint;
use crate::memory::{MemoryKind, Region, RegionId};
use crate::peer::Peer;
use crate::transfer::{TransferError, TransferOp, TransportKind};

use super::{Job, Transport, TransportFuture};
pub use crate::wire::rdma as exchange;
use completion::{Progress, Tracker, WrId};
use device::{Access, Cq, Device, Mr, OpenOptions, Qp};
use exchange::{Accept, Connect, Mailbox, RegionKey, MAILBOX_HEADER_BYTES};

pub use device::DeviceInfo;
pub(crate) use gpu::gpu_direct;
pub use gpu::GpuDirect;
use gpu::{peermem_loaded, register_gpu};
use mailbox::*;
use poller::*;
pub use verbs::Unavailable;

/// The names of the settings [`RdmaConfig::from_settings`] reads: the device (or `auto`,
/// `off`), the GID index, the traffic class and the service level.
pub const SETTINGS: [&str; 4] = [
    "KVFABRIC_RDMA",
    "KVFABRIC_RDMA_GID_INDEX",
    "KVFABRIC_RDMA_TRAFFIC_CLASS",
    "KVFABRIC_RDMA_SERVICE_LEVEL",
];

/// How the RDMA transport uses its device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RdmaConfig {
    /// The device (`mlx5_0`); None: the first with an active port.
    pub device: Option<String>,
    /// GID index on RoCE ports; None: the first RoCE v2 GID that maps an IPv4 address.
    pub gid_index: Option<u8>,
    /// Traffic class of RoCE packets (the DSCP of a lossless class, shifted left 2).
    pub traffic_class: u8,
    /// InfiniBand service level.
    pub service_level: u8,
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
            gid_index: None,
            traffic_class: 0,
            service_level: 0,
            qps_per_peer: 4,
            wr_bytes_max: 1 << 20,
            queue_depth: 256,
            signal_every: 16,
        }
    }
}

impl RdmaConfig {
    /// The configuration operators ask for, as they give it to every agent of a process:
    /// `get` looks up the settings by name — [`SETTINGS`]: `KVFABRIC_RDMA` = `auto` (default:
    /// the first device with an active port), `off`, or a device name (`mlx5_0`);
    /// `KVFABRIC_RDMA_GID_INDEX` = the GID index on RoCE ports (default: chosen);
    /// `KVFABRIC_RDMA_TRAFFIC_CLASS` and `KVFABRIC_RDMA_SERVICE_LEVEL` (default 0). None: off.
    /// The library reads no environment: the binary and the C ABI pass
    /// `|k| std::env::var(k).ok()`.
    pub fn from_settings(get: impl Fn(&str) -> Option<String>) -> Option<RdmaConfig> {
        let [rdma, gid, tc, sl] = SETTINGS;
        let mut cfg = Self::from_values(get(rdma).as_deref(), get(gid).as_deref())?;
        for (key, field) in [(tc, &mut cfg.traffic_class), (sl, &mut cfg.service_level)] {
            if let Some(v) = get(key) {
                match v.trim().parse::<u8>() {
                    Ok(x) => *field = x,
                    Err(_) => tracing::warn!(key, value = %v, "not 0..=255; using 0"),
                }
            }
        }
        Some(cfg)
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
                Ok(i) => cfg.gid_index = Some(i),
                Err(_) => {
                    tracing::warn!(
                        value = g,
                        "KVFABRIC_RDMA_GID_INDEX is not 0..=255; choosing one"
                    )
                }
            }
        }
        Some(cfg)
    }

    /// How to open the device.
    pub fn open_options(&self) -> OpenOptions<'_> {
        OpenOptions {
            name: self.device.as_deref(),
            gid_index: self.gid_index,
            traffic_class: self.traffic_class,
            service_level: self.service_level,
        }
    }
}

/// A region registered with the device, kept alive while registered.
///
/// It does not hold the region: [`crate::memory::RegionTable::deregister`] refuses regions
/// that others hold, and the agent forgets the registration right after the region goes (its
/// pages stay pinned by the registration until then, so a late remote write lands in them,
/// never in memory reused for something else).
#[derive(Debug)]
struct Registration {
    mr: Mr,
    base: u64,
    len: u64,
}

/// The queue pairs to one peer and the keys of what it exports.
#[derive(Debug)]
struct Connection {
    qps: Vec<Qp>,
    /// Requests outstanding on each queue pair, every transfer's together.
    outstanding: Vec<AtomicU32>,
    /// Most outstanding per queue pair.
    depth: u32,
    /// Woken when completions free room in a send queue.
    room_freed: tokio::sync::Notify,
    keys: HashMap<u64, RegionKey>,
    broken: AtomicBool,
    /// Outgoing: the peer's notification mailbox, and our staging buffer for it.
    mailbox: Option<(Mailbox, Outbox)>,
    /// Incoming: the id of the inbox our peer's notifications land in.
    inbox: Option<u32>,
    _budget: QpBudget,
}

impl Connection {
    fn new(qps: Vec<Qp>, depth: u32, keys: HashMap<u64, RegionKey>, budget: QpBudget) -> Self {
        let depth = qps.iter().map(Qp::depth).min().unwrap_or(1).min(depth).max(1);
        Connection {
            outstanding: qps.iter().map(|_| AtomicU32::new(0)).collect(),
            qps,
            depth,
            room_freed: tokio::sync::Notify::new(),
            keys,
            broken: AtomicBool::new(false),
            mailbox: None,
            inbox: None,
            _budget: budget,
        }
    }

    /// Takes room for up to `want` requests on queue pair `q`; how many.
    fn take_room(&self, q: usize, want: u32) -> u32 {
        let slot = &self.outstanding[q];
        let mut cur = slot.load(Ordering::Acquire);
        loop {
            let n = want.min(self.depth.saturating_sub(cur));
            if n == 0 {
                return 0;
            }
            match slot.compare_exchange_weak(cur, cur + n, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return n,
                Err(now) => cur = now,
            }
        }
    }

    /// Gives back room for `n` finished requests on queue pair `q`.
    fn give_room(&self, q: usize, n: u32) {
        if n > 0 {
            if let Some(slot) = self.outstanding.get(q) {
                let _ = slot.fetch_update(Ordering::AcqRel, Ordering::Acquire, |c| {
                    Some(c.saturating_sub(n))
                });
            }
            self.room_freed.notify_waiters();
        }
    }

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

/// Completion queue entries reserved for a connection's queue pairs while they exist.
#[derive(Debug)]
struct QpBudget {
    n: usize,
    open: Arc<AtomicUsize>,
}

impl Drop for QpBudget {
    fn drop(&mut self) {
        self.open.fetch_sub(self.n, Ordering::AcqRel);
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
    conn: Arc<Connection>,
}

/// State shared with the completion and event threads.
#[derive(Debug, Default)]
struct Shared {
    inflight: Mutex<HashMap<u32, Arc<InFlight>>>,
    stop: AtomicBool,
    /// Completion-queue failures (the thread stops polling; transfers time out).
    poll_error: Mutex<Option<String>>,
    /// Peers' notification mailboxes on this agent, by id.
    inboxes: Mutex<HashMap<u32, Arc<Inbox>>>,
    /// Where deliveries of notifications run.
    runtime: Option<tokio::runtime::Handle>,
    /// Notifications sent as WRITEs with immediate data, and received so.
    notifications_sent: std::sync::atomic::AtomicU64,
    notifications_received: std::sync::atomic::AtomicU64,
    /// Notifications dropped because the agent's queue was not drained.
    notifications_dropped: std::sync::atomic::AtomicU64,
    /// Sleeps of the completion thread ended by a completion event.
    woken: std::sync::atomic::AtomicU64,
}

/// One peer's outgoing connection, behind its own lock (connecting waits for a round trip;
/// other peers do not wait for it).
type PeerSlot = Arc<tokio::sync::Mutex<Option<Arc<Connection>>>>;

/// The RDMA transport of one agent.
#[derive(Debug)]
pub struct RdmaTransport {
    dev: Arc<Device>,
    cq: Arc<Cq>,
    cfg: RdmaConfig,
    endpoint: Weak<Endpoint>,
    registrations: Mutex<HashMap<RegionId, Arc<Registration>>>,
    /// Connections this agent opened, by peer name.
    outgoing: Mutex<HashMap<String, PeerSlot>>,
    /// Connections peers opened to this agent (kept so their queue pairs live).
    incoming: Mutex<HashMap<String, Arc<Connection>>>,
    shared: Arc<Shared>,
    /// Entries of the completion queue (bounds the queue pairs open at once).
    cq_entries: u32,
    cqes_reserved: Arc<AtomicUsize>,
    next_transfer: AtomicU32,
    next_inbox: AtomicU32,
    threads: Vec<std::thread::JoinHandle<()>>,
    /// How GPU memory reaches the adapter, or why it does not.
    gpu: Result<GpuDirect, String>,
    /// GPU regions whose registration failed: when, and why (logged once each, tried again
    /// after [`REGISTER_RETRY`]; the agent stages them meanwhile, and peers get no key).
    refused: Mutex<HashMap<RegionId, (Instant, String)>>,
    /// Peers that refused a connection: when, and why ([`RdmaTransport::refused_by`]).
    refused_by: Mutex<HashMap<String, (Instant, String)>>,
}

impl RdmaTransport {
    /// Opens the device and starts its completion and event threads; why not when this host
    /// has no usable device.
    pub fn open(cfg: RdmaConfig, endpoint: Weak<Endpoint>) -> Result<RdmaTransport, Unavailable> {
        let mut cfg = cfg;
        let dev = Device::open(cfg.open_options())?;
        let depth = cfg.queue_depth.clamp(1, dev.info().max_qp_wr);
        cfg.queue_depth = depth;
        // Room for 64 peers' queue pairs (each connection's send queues complete into it).
        let entries = (depth as usize * cfg.qps_per_peer.clamp(1, exchange::QPS_MAX) * 64)
            .min(dev.info().max_cqe as usize) as u32;
        let cq = Arc::new(dev.completion_queue(entries).map_err(|e| Unavailable(e.to_string()))?);
        let shared = Arc::new(Shared {
            runtime: tokio::runtime::Handle::try_current().ok(),
            ..Shared::default()
        });
        let spawn = |name: &str, f: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new()
                .name(name.into())
                .spawn(f)
                .map_err(|e| Unavailable(format!("starting {name}: {e}")))
        };
        let poller = {
            let (cq, shared) = (cq.clone(), shared.clone());
            spawn("kvfabric-rdma-cq", Box::new(move || poll_loop(&cq, &shared)))?
        };
        let events = {
            let (dev, shared) = (dev.clone(), shared.clone());
            spawn("kvfabric-rdma-ev", Box::new(move || event_loop(&dev, &shared)))?
        };
        let i = dev.info();
        tracing::info!(device = %i.name, port = i.port, link_layer = i.link_layer, gid_index = i.gid_index, "RDMA transport ready");
        let gpu = gpu_direct(&dev);
        match &gpu {
            Ok(how) => tracing::info!(device = %i.name, through = %how, "RDMA reaches GPU memory"),
            Err(why) => {
                tracing::info!(device = %i.name, reason = %why, "RDMA does not reach GPU memory; it moves between hosts staged through host memory")
            }
        }
        Ok(RdmaTransport {
            dev,
            cq,
            cfg,
            endpoint,
            registrations: Mutex::new(HashMap::new()),
            outgoing: Mutex::new(HashMap::new()),
            incoming: Mutex::new(HashMap::new()),
            shared,
            cq_entries: entries,
            cqes_reserved: Arc::default(),
            next_transfer: AtomicU32::new(1),
            next_inbox: AtomicU32::new(1),
            threads: vec![poller, events],
            gpu,
            refused: Mutex::default(),
            refused_by: Mutex::default(),
        })
    }

    /// The device in use.
    pub fn device(&self) -> &DeviceInfo {
        self.dev.info()
    }

    /// How the adapter reaches GPU memory, or why it does not.
    pub fn gpu_direct(&self) -> Result<GpuDirect, &str> {
        self.gpu.as_ref().copied().map_err(String::as_str)
    }

    /// A dma-buf of GPU memory at `addr..addr+len`: the CUDA driver's, or the software
    /// device's for its fake GPU memory.
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    fn dmabuf_of(&self, addr: u64, len: usize) -> Result<crate::cuda::DmaBuf, String> {
        #[cfg(test)]
        if self.dev.info().name == fake::DEVICE {
            return fake::dmabuf(addr, len);
        }
        let cuda = crate::cuda::probe().map_err(|e| e.to_string())?;
        #[cfg(feature = "cuda")]
        return cuda.dmabuf(addr, len).map_err(|e| e.to_string());
        #[cfg(not(feature = "cuda"))]
        match cuda {}
    }

    /// Whether the nvidia-peermem module is loaded for this device (never for the software
    /// device: its fake GPU memory has no peer-memory client).
    fn peermem_loaded(&self) -> bool {
        #[cfg(test)]
        if self.dev.info().name == fake::DEVICE {
            return false;
        }
        peermem_loaded()
    }

    /// Whether the adapter reaches `region` (registered now if it was not): GPU memory may
    /// not register (a GPU or provider without dma-buf support); the agent stages it then.
    pub(crate) fn reaches(&self, region: &Region) -> Result<(), String> {
        self.registration(region).map(|_| ()).map_err(|e| e.to_string())
    }

    /// Forgets a region's registration (it is being deregistered): peers' keys for it stop
    /// working once in-flight transfers holding it end.
    pub fn forget_region(&self, id: RegionId) {
        self.registrations.lock().remove(&id);
        self.refused.lock().remove(&id);
    }

    fn registration(&self, region: &Region) -> Result<Arc<Registration>, TransferError> {
        if let Some(r) = self.registrations.lock().get(&region.id()) {
            return Ok(r.clone());
        }
        if let Some((at, why)) = self.refused.lock().get(&region.id()) {
            // A failure for want of resources (pinned memory, BAR space) may pass: the
            // region is tried again after a while, not on every transfer.
            if at.elapsed() < REGISTER_RETRY {
                return Err(TransferError::Protocol(why.clone()));
            }
        }
        let endpoint = self.endpoint.upgrade().ok_or(TransferError::Shutdown)?;
        let local = |e: crate::memory::MemoryError| TransferError::Local {
            kind: e.kind(),
            message: e.to_string(),
        };
        let arc = endpoint.regions().get(region.id()).map_err(local)?;
        let len = arc.len() as u64;
        let access = if arc.is_exported() { Access::RemoteReadWrite } else { Access::Local };
        let failed = |e: String| {
            TransferError::Protocol(format!("RDMA registration of region {}: {e}", region.id()))
        };
        let (base, mr) = match arc.kind() {
            MemoryKind::Host => {
                let base = arc.ptr_at(0, len).map_err(local)?;
                // SAFETY: the region's memory stays allocated while it is in the table; the
                // agent drops this registration when the region leaves it (`forget_region`).
                let mr = unsafe { self.dev.register(base, len as usize, access) };
                (base as u64, mr.map_err(|e| failed(e.to_string()))?)
            }
            MemoryKind::Device(_) => {
                let (_, addr) = arc.device_addr(0, len).ok_or_else(|| {
                    TransferError::Invalid(format!("region {} is not GPU memory", region.id()))
                })?;
                let how = self.gpu.as_ref().map_err(|why| TransferError::NoTransport {
                    peer: String::new(),
                    reason: format!("rdma cannot reach GPU memory here: {why}"),
                })?;
                // SAFETY: as for host memory: the region's GPU memory stays allocated until
                // `forget_region`.
                let register = |how| unsafe {
                    register_gpu(
                        &self.dev,
                        how,
                        || self.dmabuf_of(addr, len as usize),
                        addr,
                        len as usize,
                        access,
                    )
                };
                let mr = match register(*how) {
                    // A provider or GPU that takes no dma-buf: nvidia-peermem, if loaded.
                    Err(e) if *how == GpuDirect::DmaBuf && self.peermem_loaded() => {
                        register(GpuDirect::PeerMem)
                            .map_err(|e2| format!("{e}; through nvidia-peermem: {e2}"))
                    }
                    r => r,
                };
                match mr {
                    Ok(mr) => (addr, mr),
                    Err(e) => {
                        let e = failed(e);
                        let again = self
                            .refused
                            .lock()
                            .insert(region.id(), (Instant::now(), e.to_string()));
                        if again.is_none() {
                            tracing::warn!(region = %region.id(), error = %e, "RDMA: GPU region cannot be registered; it is staged through host memory and not exported over RDMA (tried again every {REGISTER_RETRY:?})");
                        }
                        return Err(e);
                    }
                }
            }
        };
        let fresh = Arc::new(Registration { mr, base, len });
        // Two callers may have registered the region at once: the first one in the table is
        // the registration (the other is dropped here, before anyone used its keys).
        self.refused.lock().remove(&region.id());
        let r = self.registrations.lock().entry(region.id()).or_insert(fresh).clone();
        Ok(r)
    }

    /// `n` queue pairs, counted against the completion queue with `receives` more entries
    /// (a mailbox's receives).
    fn new_qps(&self, n: usize, receives: usize) -> Result<(Vec<Qp>, QpBudget), TransferError> {
        // Every queue pair may have its whole send queue complete (or be flushed) at once,
        // and every receive too: together they must fit the shared completion queue, or it
        // would overflow.
        let entries = n * self.cfg.queue_depth.max(1) as usize + receives;
        let open = self.cqes_reserved.fetch_add(entries, Ordering::AcqRel);
        let budget = QpBudget { n: entries, open: self.cqes_reserved.clone() };
        if open + entries > self.cq_entries as usize {
            return Err(TransferError::NoTransport {
                peer: String::new(),
                reason: format!(
                    "rdma: the completion queue ({} entries) has room for {} more, not the {entries} \
                     that {n} more queue pairs need",
                    self.cq_entries,
                    (self.cq_entries as usize).saturating_sub(open)
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
    /// keys of every exported host region. Blocking (verbs calls, memory registration):
    /// the session server runs it on the blocking pool.
    fn accept_connect(&self, from: &str, connect: &Connect) -> Result<Accept, String> {
        if let Some(why) = self.failure() {
            return Err(format!("this agent's RDMA device failed: {why}"));
        }
        let (qps, budget) = self
            .new_qps(connect.qps.len(), usize::from(MAILBOX_SLOTS))
            .map_err(|e| e.to_string())?;
        for (qp, remote) in qps.iter().zip(&connect.qps) {
            qp.connect(remote).map_err(|e| e.to_string())?;
        }
        let endpoint = self.endpoint.upgrade().ok_or("agent shut down")?;
        let mut regions = Vec::new();
        let reachable = |r: &Region| r.kind() == MemoryKind::Host || self.gpu.is_ok();
        for r in endpoint.regions().all().into_iter().filter(|r| r.is_exported() && reachable(r)) {
            let reg = match self.registration(&r) {
                Ok(reg) => reg,
                // The peer learns no key for it: its transfers there fail typed (logged once
                // by `registration`).
                Err(_) if r.kind() != MemoryKind::Host => continue,
                Err(e) => return Err(e.to_string()),
            };
            regions.push(RegionKey {
                region: r.id().0,
                addr: reg.base,
                len: reg.len,
                rkey: reg.mr.rkey(),
            });
        }
        let qp_addrs: Vec<_> = qps.iter().map(Qp::addr).collect();
        let inbox_id = {
            let inboxes = self.shared.inboxes.lock();
            let mut id = self.next_inbox.fetch_add(1, Ordering::Relaxed);
            while inboxes.contains_key(&id) {
                id = self.next_inbox.fetch_add(1, Ordering::Relaxed);
            }
            id
        };
        let mut conn = Connection::new(qps, self.cfg.queue_depth, HashMap::new(), budget);
        conn.inbox = Some(inbox_id);
        let conn = Arc::new(conn);
        // The mailbox for the peer's notifications: slots of one packet at the path MTU, and
        // a task that delivers them in order (none without a runtime: the session carries
        // them then).
        let mailbox = match (&self.shared.runtime, self.endpoint.upgrade()) {
            (Some(rt), Some(endpoint)) => {
                let mtu =
                    connect.qps.first().map_or(1, |q| q.mtu).min(self.dev.info().mtu).clamp(1, 5);
                let slot_bytes = (256u32 << (mtu - 1)).min(exchange::MAILBOX_SLOT_BYTES_MAX);
                let buf = RawBuf::zeroed(usize::from(MAILBOX_SLOTS) * slot_bytes as usize);
                // SAFETY: the buffer lives in the inbox with the registration, which is
                // dropped first.
                let mr = unsafe { self.dev.register(buf.addr(), buf.len, Access::RemoteWrite) }
                    .map_err(|e| e.to_string())?;
                let mailbox = Mailbox {
                    addr: buf.addr() as u64,
                    rkey: mr.rkey(),
                    slots: MAILBOX_SLOTS,
                    slot_bytes,
                };
                let recv_id = WrId { transfer: inbox_id, qp: RECV_QP, index: 0 }.pack();
                conn.qps[0]
                    .post_receives(&[recv_id; MAILBOX_SLOTS as usize])
                    .map_err(|e| e.to_string())?;
                let (tx, mut rx) = tokio::sync::mpsc::channel(INBOX_BACKLOG);
                rt.spawn(async move {
                    while let Some(n) = rx.recv().await {
                        if !endpoint.deliver_waiting(n).await {
                            return;
                        }
                    }
                });
                self.shared.inboxes.lock().insert(
                    inbox_id,
                    Arc::new(Inbox {
                        _mr: mr,
                        buf,
                        id: inbox_id,
                        slot_bytes,
                        peer: from.to_string(),
                        conn: Arc::downgrade(&conn),
                        deliveries: tx,
                    }),
                );
                Some(mailbox)
            }
            _ => None,
        };
        let accept = Accept { qps: qp_addrs, regions, mailbox };
        // A peer that connects again (it restarted, its queue pairs failed, or it needs keys
        // of regions exported since) may still finish work on its old queue pairs: they are
        // kept a grace period, then failed and dropped with their mailbox (outside the lock).
        let old = self.incoming.lock().insert(from.to_string(), conn);
        if let Some(old) = old {
            let shared = self.shared.clone();
            let retire = move || {
                old.fail();
                if let Some(id) = old.inbox {
                    shared.inboxes.lock().remove(&id);
                }
            };
            match &self.shared.runtime {
                Some(rt) => {
                    rt.spawn(async move {
                        tokio::time::sleep(RETIRE_GRACE).await;
                        retire();
                    });
                }
                None => retire(),
            }
        }
        Ok(accept)
    }

    /// Notifications sent and received as WRITEs with immediate data, and received ones
    /// dropped because the agent's queue was not drained.
    pub fn notifications(&self) -> (u64, u64, u64) {
        let n = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed);
        (
            n(&self.shared.notifications_sent),
            n(&self.shared.notifications_received),
            n(&self.shared.notifications_dropped),
        )
    }

    /// Why the transport stopped working (its completion queue failed: a device gone), if
    /// it did. The agent then routes over TCP.
    pub fn failure(&self) -> Option<String> {
        self.shared.poll_error.lock().clone()
    }

    /// Why `peer` refused an RDMA connection, if it did within [`PEER_RETRY`]: the agent
    /// routes to it over TCP meanwhile.
    pub fn refused_by(&self, peer: &str) -> Option<String> {
        let mut refused = self.refused_by.lock();
        match refused.get(peer) {
            Some((at, why)) if at.elapsed() < PEER_RETRY => Some(why.clone()),
            Some(_) => {
                refused.remove(peer);
                None
            }
            None => None,
        }
    }

    /// The completion queue's address (tests make the software device lose it).
    #[cfg(test)]
    pub(crate) fn cq_raw(&self) -> usize {
        self.cq.raw()
    }

    /// Times the completion thread slept until a completion event woke it.
    pub fn wakeups(&self) -> u64 {
        self.shared.woken.load(Ordering::Relaxed)
    }

    /// Sends `job`'s notification as a WRITE with immediate data into the peer's mailbox,
    /// after every byte of the job completed: the completion says it landed, and the peer
    /// delivers it in order.
    async fn notify_by_write(
        &self,
        conn: &Arc<Connection>,
        peer: &str,
        job: &Job,
        message: &[u8],
    ) -> Result<(), TransferError> {
        let Some((mailbox, outbox)) = &conn.mailbox else {
            return Err(TransferError::Invalid("no mailbox".into()));
        };
        let len = MAILBOX_HEADER_BYTES + message.len();
        let mut seq = outbox.seq.lock().await;
        let slot = u64::from(*seq % u32::from(mailbox.slots));
        // The staging buffer is written only here, under the sequence lock, while no request
        // reads it (the previous notification completed before its holder let the lock go).
        let staged = outbox.buf.addr();
        if !outbox.buf.stage(&[
            &job.id.to_le_bytes(),
            &(message.len() as u32).to_le_bytes(),
            message,
        ]) {
            return Err(TransferError::Invalid("notification larger than a mailbox slot".into()));
        }
        let wr = plan::WorkRequest {
            sges: vec![plan::Sge { addr: staged as u64, len: len as u32, lkey: outbox.mr.lkey() }],
            remote_addr: mailbox.addr + slot * u64::from(mailbox.slot_bytes),
            rkey: mailbox.rkey,
            bytes: len as u64,
            signaled: true,
            covers: 1,
            imm: Some(*seq),
        };
        let mut chains: Vec<Vec<plan::WorkRequest>> =
            (0..conn.qps.len()).map(|_| Vec::new()).collect();
        chains[0].push(wr);
        self.move_bytes(conn, peer, TransferOp::Write, &chains).await?;
        *seq = seq.wrapping_add(1);
        self.shared.notifications_sent.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// The connection to `peer`: the one open, or a new one (also when `fresh`: the open one
    /// lacks keys; it is left to the transfers using it, not failed).
    async fn connection(&self, peer: &Peer, fresh: bool) -> Result<Arc<Connection>, TransferError> {
        let name = &peer.metadata().name;
        let slot = self.outgoing.lock().entry(name.clone()).or_default().clone();
        let mut slot = slot.lock().await;
        if let Some(c) = slot.as_ref().filter(|c| !fresh && !c.broken.load(Ordering::Acquire)) {
            return Ok(c.clone());
        }
        let (qps, budget) = self.new_qps(self.cfg.qps_per_peer.clamp(1, exchange::QPS_MAX), 0)?;
        let connect = Connect { qps: qps.iter().map(Qp::addr).collect() };
        let accept = match peer.session.rdma_connect(&connect).await {
            Ok(a) => {
                self.refused_by.lock().remove(name);
                a
            }
            Err(e) => {
                // The agent routes to this peer over TCP for a while (its device may be
                // gone, or it refuses for want of queue pairs).
                tracing::warn!(peer = %name, error = %e, "RDMA: the peer refused a connection; transfers to it go over TCP for {PEER_RETRY:?}");
                self.refused_by.lock().insert(name.clone(), (Instant::now(), e.to_string()));
                return Err(e);
            }
        };
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
        let mut c = Connection::new(qps, self.cfg.queue_depth, keys, budget);
        if let Some(m) = accept.mailbox {
            let buf = RawBuf::zeroed(m.slot_bytes as usize);
            // SAFETY: the buffer lives in the outbox with the registration, dropped first.
            match unsafe { self.dev.register(buf.addr(), buf.len, Access::Local) } {
                Ok(mr) => {
                    c.mailbox = Some((m, Outbox { mr, buf, seq: tokio::sync::Mutex::new(0) }))
                }
                Err(e) => {
                    tracing::warn!(peer = %name, error = %e, "RDMA: no outbox; notifications go through the session")
                }
            }
        }
        let c = Arc::new(c);
        *slot = Some(c.clone());
        Ok(c)
    }

    async fn run(&self, job: &Job) -> Result<(), TransferError> {
        let peer = job.peer()?;
        let mut conn = self.connection(peer, false).await?;
        // A region the peer exported after we connected: a new connection brings its key.
        if job.pieces.iter().any(|p| !conn.keys.contains_key(&p.remote.region.0)) {
            conn = self.connection(peer, true).await?;
        }
        let mut segs = Vec::with_capacity(job.pieces.len());
        for (i, p) in job.pieces.iter().enumerate() {
            let region = job.region(p);
            let reg = self.registration(region)?;
            let local = match region.kind() {
                MemoryKind::Host => region.ptr_at(p.local_offset, p.len())? as u64,
                MemoryKind::Device(_) => {
                    region
                        .device_addr(p.local_offset, p.len())
                        .ok_or_else(|| {
                            TransferError::Invalid(format!(
                                "range outside GPU region {}",
                                region.id()
                            ))
                        })?
                        .1
                }
            };
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
                local_addr: local,
                lkey: reg.mr.lkey(),
                remote_addr,
                rkey: key.rkey,
                len: p.len(),
            });
        }
        let expected = job.one_sided_expected(peer).await?;
        let limits = plan::Limits {
            max_sge: self.dev.info().max_sge,
            wr_bytes_max: self.cfg.wr_bytes_max.min(self.dev.info().max_msg_bytes).max(1),
            qps: conn.qps.len(),
            signal_every: self.cfg.signal_every,
        };
        let chains =
            plan::plan(&segs, &limits).map_err(|e| TransferError::Invalid(e.to_string()))?;
        self.move_bytes(&conn, &peer.metadata().name, job.op, &chains).await?;
        // A WRITE's notification rides a WRITE with immediate data when nothing else needs
        // the session (no checksums for the owner to verify) and it fits a mailbox slot.
        let fits = |m: &Mailbox| {
            job.notify
                .as_ref()
                .is_some_and(|n| MAILBOX_HEADER_BYTES + n.len() <= m.slot_bytes as usize)
        };
        match (&job.notify, &conn.mailbox) {
            (Some(n), Some((m, _))) if job.op == TransferOp::Write && !job.checksum && fits(m) => {
                self.notify_by_write(&conn, &peer.metadata().name, job, n).await
            }
            _ => job.one_sided_finish(peer, expected).await,
        }
    }

    /// Posts the chains as the send queues have room and waits for their completions.
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
            conn: conn.clone(),
        });
        self.shared.inflight.lock().insert(id, flight.clone());
        let mut guard = FlightGuard { shared: &self.shared, id, flight: &flight, finished: false };
        let opcode = match op {
            TransferOp::Write => verbs::consts::WR_RDMA_WRITE,
            TransferOp::Read => verbs::consts::WR_RDMA_READ,
        };
        loop {
            // Armed before looking for room, so that room freed meanwhile wakes us.
            let room_freed = conn.room_freed.notified();
            tokio::pin!(room_freed);
            room_freed.as_mut().enable();
            if let Some(e) = self.shared.poll_error.lock().clone() {
                flight
                    .tracker
                    .lock()
                    .fail(TransferError::Protocol(format!("RDMA completion queue: {e}")));
                conn.fail();
            }
            for (q, chain) in chains.iter().enumerate() {
                // The tracker stays locked across the post: the poller cannot see a
                // completion of requests not yet counted as posted.
                let mut t = flight.tracker.lock();
                let (start, want) = (t.next_index(q), t.room(q, conn.depth));
                if want == 0 {
                    continue;
                }
                let room = conn.take_room(q, want);
                if room == 0 {
                    continue;
                }
                let batch = &chain[start as usize..(start + room) as usize];
                match post_batch(&conn.qps[q], id, q, start, opcode, batch) {
                    Ok(()) => t.posted(q, room),
                    Err((e, posted)) => {
                        t.posted(q, posted);
                        t.fail(TransferError::Protocol(format!("RDMA post to {peer}: {e}")));
                        drop(t);
                        conn.fail();
                        if posted > 0 {
                            // The provider took part of the chain although its queue had room
                            // by its own count. Those requests were not signaled: their
                            // completions may never come. The queue pair is failed (it
                            // processes nothing more); they are not waited for.
                            tracing::error!(
                                peer,
                                taken = posted,
                                "RDMA provider took part of a chain; its queue pairs are failed"
                            );
                            flight.tracker.lock().abandon(q);
                        }
                        conn.give_room(q, room);
                    }
                }
            }
            let notified = flight.wake.notified();
            if let Progress::Finished(outcome) = flight.tracker.lock().progress() {
                guard.finished = true;
                if outcome.is_err() {
                    conn.fail();
                }
                return outcome;
            }
            tokio::select! {
                _ = notified => {}
                _ = room_freed => {}
            }
        }
    }
}

/// Posts `batch` (requests `start..` of chain `q` of transfer `id`) as one linked chain, the
/// last signaled. On failure, the error and how many of the batch were posted.
fn post_batch(
    qp: &Qp,
    id: u32,
    q: usize,
    start: u32,
    opcode: u32,
    batch: &[plan::WorkRequest],
) -> Result<(), (device::VerbsError, u32)> {
    let mut sges: Vec<verbs::IbvSge> = batch
        .iter()
        .flat_map(|w| &w.sges)
        .map(|e| verbs::IbvSge { addr: e.addr, length: e.len, lkey: e.lkey })
        .collect();
    let mut wrs: Vec<verbs::IbvSendWr> = Vec::with_capacity(batch.len());
    let sge_base = sges.as_mut_ptr();
    let mut at = 0usize;
    for (k, w) in batch.iter().enumerate() {
        wrs.push(verbs::IbvSendWr {
            wr_id: WrId { transfer: id, qp: q as u8, index: start + k as u32 }.pack(),
            // `at` stays within `sges` (the entries of the requests before this one).
            sg_list: sge_base.wrapping_add(at),
            num_sge: w.sges.len() as i32,
            opcode: if w.imm.is_some() { verbs::consts::WR_RDMA_WRITE_WITH_IMM } else { opcode },
            imm_data: w.imm.unwrap_or(0).to_be(),
            // The last of a batch is signaled too, so that its room comes back.
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
    let base = wrs.as_mut_ptr();
    for k in 1..wrs.len() {
        // SAFETY: k - 1 and k are inside `wrs`, which is not resized after this.
        unsafe { (*base.add(k - 1)).next = base.add(k) };
    }
    // SAFETY: the chain is linked above and ends in null; its entries (`sges`) outlive the
    // call; the bytes they name lie in registrations held by the transfer's job (its leases)
    // and by the transport, and stay so until every request completed or was flushed (the
    // transfer's guard waits for that).
    unsafe { qp.post(base) }.map_err(|(e, bad)| {
        let posted = if bad.is_null() {
            0
        } else {
            ((bad as usize).saturating_sub(base as usize) / std::mem::size_of::<verbs::IbvSendWr>())
                .min(batch.len()) as u32
        };
        (e, posted)
    })
}

/// Removes a transfer from the poller's table when it ends; a transfer dropped with work
/// outstanding fails its connection's queue pairs (flushing that work) and waits, bounded,
/// for the flush, so that no byte lands in memory the job no longer leases.
struct FlightGuard<'a> {
    shared: &'a Shared,
    id: u32,
    flight: &'a Arc<InFlight>,
    finished: bool,
}

impl Drop for FlightGuard<'_> {
    fn drop(&mut self) {
        if !self.finished {
            self.flight.conn.fail();
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

/// How long a GPU region whose registration failed is staged before it is tried again.
pub const REGISTER_RETRY: Duration = Duration::from_secs(60);

/// How long the agent routes to a peer that refused an RDMA connection over TCP before it
/// tries RDMA again.
pub const PEER_RETRY: Duration = Duration::from_secs(30);

impl Drop for RdmaTransport {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl crate::session::RdmaAcceptor for RdmaTransport {
    fn accept(&self, from: &str, connect: &Connect) -> Result<Accept, String> {
        self.accept_connect(from, connect)
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
mod tests;

#[cfg(test)]
mod double_tests;
