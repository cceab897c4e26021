//! The agent: one per process. It owns regions, knows peers, and posts transfers.
//!
//! The API follows NIXL's shape: register memory, export metadata ([`Agent::metadata`]) and
//! load a peer's ([`Agent::load_peer`]), build a transfer from descriptor lists
//! ([`TransferRequest`]), post it ([`Agent::post`]) and poll or await the
//! [`TransferHandle`]; notifications arrive through [`Agent::next_notification`].
//!
//! Posting is thread-safe and takes no agent-wide lock: it reads the region table and the
//! peer map under read locks long enough to clone `Arc`s, takes an in-flight permit from a
//! semaphore, and spawns the transfer on the agent's tokio runtime. Every transfer has a
//! deadline; a dead or misbehaving peer fails it with a typed [`TransferError`].
//!
//! Just over 1,000 lines because it is the agent's whole public surface (regions, peers,
//! transfers, notifications, metadata) over one shared state; the transports, the session
//! and the memory it drives live in their own modules.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Mutex, RwLock};
use tokio::sync::{mpsc, Semaphore};

use crate::endpoint::{check_remote, check_request, Endpoint, MetadataError, RdmaStatus};
use crate::memory::{
    DeviceMemory, MemoryError, MemoryKind, Region, RegionId, RegionOptions, RegionTable, ShmSeal,
};
use crate::peer::Peer;
use crate::session::admission::{Admission, AdmissionLimits, PortSnapshot, PortStats};
use crate::session::client::Session;
use crate::session::proto::ServerParams;
use crate::session::server::{ServerTimeouts, Services, SessionServer};
use crate::session::SessionConfig;
use crate::transfer::{
    Desc, TransferError, TransferEvent, TransferHandle, TransferOp, TransferRequest,
    TransferShared, TransportKind,
};
use crate::transport::fault::FaultInjector;
use crate::transport::{Job, Transport, Transports};
use crate::wire::WireLimits;

pub use crate::endpoint::{AgentMetadata, ExportedRegion, Notification};
pub use crate::session::{RpcHandler, RpcReply};

/// Limits of an agent, all documented with their units.
#[derive(Debug, Clone)]
pub struct AgentLimits {
    /// Frame and message limits of the wire protocol.
    pub wire: WireLimits,
    /// Most transfers in flight at once; `post` fails with [`TransferError::Busy`] beyond.
    pub transfers_in_flight_max: usize,
    /// Most descriptors in one transfer.
    pub descs_per_transfer_max: usize,
    /// Most regions registered at once.
    pub regions_max: usize,
    /// Most notifications queued before senders wait (then time out).
    pub notifications_queued_max: usize,
    /// Deadline of a transfer that sets none.
    pub transfer_deadline: Duration,
    /// Time allowed to connect to a peer and authenticate (as a client; peers connecting
    /// here have `connections.handshake_timeout`).
    pub handshake_timeout: Duration,
    /// Time a peer may take to send the rest of a frame once its header arrived.
    pub frame_timeout: Duration,
    /// Who gets a connection on the agent's port: pending and admitted caps, per source and
    /// per peer, the server's handshake deadline, and the idle timeout of sessions.
    pub connections: AdmissionLimits,
}

impl Default for AgentLimits {
    fn default() -> Self {
        AgentLimits {
            wire: WireLimits::default(),
            transfers_in_flight_max: 4096,
            // Equal to the wire's per-request limit, so that shm checksum and commit
            // messages always fit in one frame.
            descs_per_transfer_max: 16_384,
            regions_max: 65_536,
            notifications_queued_max: 65_536,
            transfer_deadline: Duration::from_secs(30),
            handshake_timeout: Duration::from_secs(5),
            frame_timeout: Duration::from_secs(30),
            // A peer keeps `tcp_connections_per_peer` stripes (4 by default) and reconnects
            // while an old connection may still be closing.
            connections: AdmissionLimits { per_peer_max: 64, ..AdmissionLimits::default() },
        }
    }
}

/// How to start an agent.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// Unique name among the agents that talk to each other.
    pub name: String,
    /// TCP listen address (`127.0.0.1:0` by default: loopback, any free port).
    pub listen: SocketAddr,
    /// The address peers dial, as its metadata gives it (None: the address bound; see
    /// [`crate::control::advertise`]).
    pub advertise: Option<crate::control::advertise::Advertise>,
    /// The shared secret of the handshake. Required: no secret, no bytes.
    pub secret: crate::secret::Secret,
    /// Mutual TLS with peers (their connections to this agent and this agent's to them),
    /// when the process has certificates and a deployment CA ([`crate::tls`]). Shared memory,
    /// CUDA IPC and RDMA are not wrapped: same host, or a fabric the operator trusts.
    pub tls: Option<Arc<crate::tls::Tls>>,
    /// Offer and use the shm transport with peers on this host.
    pub shm: bool,
    /// Striped TCP connections per peer.
    pub tcp_connections_per_peer: usize,
    /// TCP transfers are cut into pieces of at most this many bytes, spread over the stripes.
    pub tcp_stripe_bytes: u64,
    /// shm and local transfers up to this many bytes that need no message to the peer (no
    /// checksum, no notification) complete inside `post`, on the caller's thread: one memcpy,
    /// no task switch. Larger ones run on the blocking pool.
    pub inline_copy_bytes_max: u64,
    /// Limits.
    pub limits: AgentLimits,
    /// Fault injection for tests: wraps every transport.
    pub faults: Option<Arc<FaultInjector>>,
    /// Use RDMA between hosts when this host has a usable device (None: never). Default: the
    /// first device with an active port; processes set what operators ask for
    /// ([`crate::transport::rdma::RdmaConfig::from_settings`]).
    pub rdma: Option<crate::transport::rdma::RdmaConfig>,
}

impl AgentConfig {
    /// A config with defaults for `name` and `secret`.
    pub fn new(name: impl Into<String>, secret: impl Into<crate::secret::Secret>) -> Self {
        AgentConfig {
            name: name.into(),
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            advertise: None,
            secret: secret.into(),
            tls: None,
            shm: true,
            tcp_connections_per_peer: 4,
            tcp_stripe_bytes: 256 << 10,
            inline_copy_bytes_max: 64 << 20,
            limits: AgentLimits::default(),
            faults: None,
            rdma: Some(crate::transport::rdma::RdmaConfig::default()),
        }
    }
}

/// Why an agent could not start or a peer could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The configuration is unusable.
    #[error("invalid agent config: {0}")]
    Config(String),
    /// Binding the listener failed.
    #[error("binding {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
    /// Not called inside a tokio runtime.
    #[error("an agent must be started inside a tokio runtime")]
    NoRuntime,
    /// Peer metadata is unusable.
    #[error("bad peer metadata: {0}")]
    BadMetadata(String),
    /// A memory error.
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// A CUDA error (no GPU, an allocation or export the driver refused).
    #[error(transparent)]
    Cuda(#[from] crate::cuda::CudaError),
}

impl From<MetadataError> for AgentError {
    fn from(e: MetadataError) -> Self {
        AgentError::BadMetadata(e.0)
    }
}

pub(crate) struct AgentInner {
    config: AgentConfig,
    /// What the transports and the session server see of this agent.
    services: Arc<Services>,
    session: SessionConfig,
    peers: RwLock<HashMap<String, Arc<Peer>>>,
    notify_rx: tokio::sync::Mutex<mpsc::Receiver<Notification>>,
    in_flight: Arc<Semaphore>,
    /// How posted transfers ended, per transport.
    counters: Arc<crate::transfer::TransferCounters>,
    next_id: AtomicU64,
    listen_addr: SocketAddr,
    host_id: String,
    transports: Transports,
    /// Whether RDMA is in use, and why not.
    rdma_status: RdmaStatus,
    /// The RDMA transport (also in `transports`, maybe wrapped for fault injection).
    rdma: Option<Arc<crate::transport::rdma::RdmaTransport>>,
    runtime: tokio::runtime::Handle,
    server: Mutex<Option<SessionServer>>,
    /// Checks the seals of peers' shared-memory files.
    seal: ShmSeal,
    /// The agent port's connection counters.
    port: Arc<PortStats>,
    /// Peers refused because their metadata named shared memory that is not theirs.
    foreign_memory: AtomicU64,
}

impl AgentInner {
    fn endpoint(&self) -> &Arc<Endpoint> {
        &self.services.endpoint
    }

    fn regions(&self) -> &RegionTable {
        self.services.endpoint.regions()
    }
}

impl std::fmt::Debug for AgentInner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("name", &self.config.name)
            .field("addr", &self.listen_addr)
            .finish()
    }
}

/// One per process: owns regions and peers, posts transfers. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Agent {
    pub(crate) inner: Arc<AgentInner>,
}

/// Opens the RDMA transport when configured and possible; says why not (logged once per
/// process, at info: a host without RDMA is normal).
fn open_rdma(
    config: &AgentConfig,
    endpoint: &Arc<Endpoint>,
) -> (Option<Arc<crate::transport::rdma::RdmaTransport>>, RdmaStatus) {
    use crate::transport::rdma::RdmaTransport;
    static LOGGED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    let Some(cfg) = &config.rdma else { return (None, RdmaStatus::Off) };
    match RdmaTransport::open(cfg.clone(), Arc::downgrade(endpoint)) {
        Ok(t) => {
            let i = t.device();
            let status = RdmaStatus::Device {
                device: i.name.clone(),
                port: i.port,
                link_layer: i.link_layer.to_string(),
                gpu: t.gpu_direct().ok().map(|how| how.to_string()),
            };
            (Some(Arc::new(t)), status)
        }
        Err(why) => {
            if !LOGGED.swap(true, Ordering::Relaxed) {
                tracing::info!(reason = %why, "RDMA unavailable: transfers between hosts use TCP");
            } else {
                tracing::debug!(agent = %config.name, reason = %why, "RDMA unavailable: using TCP");
            }
            (None, RdmaStatus::Unavailable { reason: why.0 })
        }
    }
}

/// What peers compare to know they share a host: the kernel's boot id and this process's pid
/// namespace. Shared memory is opened through `/proc/{pid}/fd`, which names the owner only in
/// its own pid namespace, so two containers on one kernel but in separate pid namespaces are
/// different hosts here (they use tcp).
fn host_id() -> String {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| format!("unknown-host-{}", std::process::id()));
    match std::fs::read_link("/proc/self/ns/pid") {
        Ok(ns) => format!("{boot}/{}", ns.display()),
        Err(_) => boot,
    }
}

/// What a transfer holds while it runs. Fields drop in declaration order: the leases on its
/// regions, then its in-flight permit, then the guard that marks it quiesced.
struct Running {
    job: Job,
    permit: tokio::sync::OwnedSemaphorePermit,
    exit: crate::transfer::ExitGuard,
}

impl Agent {
    /// Starts an agent: binds its listener and serves peers on the current tokio runtime.
    pub async fn start(config: AgentConfig) -> Result<Agent, AgentError> {
        if config.name.is_empty() || config.name.len() > config.limits.wire.text_bytes_max as usize
        {
            return Err(AgentError::Config("name must be 1..=4096 bytes".into()));
        }
        if config.secret.is_empty() {
            return Err(AgentError::Config("a shared secret is required".into()));
        }
        if config.tcp_connections_per_peer == 0 || config.tcp_stripe_bytes == 0 {
            return Err(AgentError::Config("tcp stripes and stripe bytes must be >= 1".into()));
        }
        if config.listen.ip().is_unspecified() && config.advertise.is_none() {
            return Err(AgentError::Config(format!(
                "listening on {} needs an address to advertise: peers cannot dial it",
                config.listen
            )));
        }
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| AgentError::NoRuntime)?;
        let listener = tokio::net::TcpListener::bind(config.listen)
            .await
            .map_err(|source| AgentError::Bind { addr: config.listen, source })?;
        let listen_addr = listener
            .local_addr()
            .map_err(|source| AgentError::Bind { addr: config.listen, source })?;
        let (notify_tx, notify_rx) = mpsc::channel(config.limits.notifications_queued_max.max(1));
        let shm_prefix = format!(
            "kvfabric.{}.{}.{}",
            sanitize(&config.name),
            std::process::id(),
            listen_addr.port()
        );
        let endpoint = Arc::new(Endpoint::new(
            config.name.clone(),
            RegionTable::new(
                shm_prefix,
                config.limits.regions_max,
                ShmSeal::new(config.secret.expose()),
                config.name.clone(),
            ),
            notify_tx,
            config.limits.frame_timeout,
        ));
        let (rdma, rdma_status) = open_rdma(&config, &endpoint);
        let services = Arc::new(Services {
            endpoint,
            rpc: RwLock::new(None),
            rdma: rdma.clone().map(|t| t as Arc<dyn crate::session::RdmaAcceptor>),
        });
        let session = SessionConfig {
            name: config.name.clone(),
            secret: config.secret.clone(),
            tls: config.tls.clone(),
            limits: config.limits.wire,
            handshake_timeout: config.limits.handshake_timeout,
            frame_timeout: config.limits.frame_timeout,
            connections: config.tcp_connections_per_peer,
            stripe_bytes: config.tcp_stripe_bytes,
        };
        let port = Arc::new(PortStats::new("agent"));
        let server = SessionServer::spawn(
            listener,
            Arc::downgrade(&services),
            ServerParams {
                name: config.name.clone(),
                secret: config.secret.clone(),
                limits: config.limits.wire,
            },
            ServerTimeouts {
                frame: config.limits.frame_timeout,
                handshake: config.limits.connections.handshake_timeout,
            },
            Admission::new(config.limits.connections.clone(), port.clone()),
            config.tls.clone(),
        );
        let inner = Arc::new(AgentInner {
            services,
            session,
            peers: RwLock::new(HashMap::new()),
            notify_rx: tokio::sync::Mutex::new(notify_rx),
            in_flight: Arc::new(Semaphore::new(config.limits.transfers_in_flight_max)),
            counters: Arc::default(),
            next_id: AtomicU64::new(1),
            listen_addr,
            host_id: host_id(),
            transports: Transports::new(
                config.faults.clone(),
                rdma.clone().map(|t| t as Arc<dyn crate::transport::Transport>),
            ),
            rdma_status,
            rdma,
            runtime,
            server: Mutex::new(Some(server)),
            seal: ShmSeal::new(config.secret.expose()),
            port,
            foreign_memory: AtomicU64::new(0),
            config,
        });
        tracing::debug!(agent = %inner.config.name, addr = %listen_addr, "transfer agent listening");
        Ok(Agent { inner })
    }

    /// The agent's name.
    pub fn name(&self) -> &str {
        &self.inner.config.name
    }

    /// The TCP address it listens on.
    pub fn listen_addr(&self) -> SocketAddr {
        self.inner.listen_addr
    }

    /// The TCP address peers dial (its metadata's): the one advertised, else the one bound.
    pub fn advertised_addr(&self) -> SocketAddr {
        let bound = self.inner.listen_addr;
        self.inner.config.advertise.map_or(bound, |a| a.addr(bound))
    }

    /// Allocates and registers a host region (see [`RegionOptions`]).
    pub fn alloc_region(&self, len: usize, opts: RegionOptions) -> Result<Arc<Region>, AgentError> {
        Ok(self.inner.regions().alloc(len, opts)?)
    }

    /// Allocates `len` bytes on CUDA device `ordinal` (plain `cuMemAlloc`) and registers them
    /// as a region; with `export`, peers may access it, and peers of this host map it through
    /// the CUDA IPC handle published in this agent's metadata.
    #[cfg(feature = "cuda")]
    pub fn alloc_device_region(
        &self,
        ordinal: usize,
        len: usize,
        export: bool,
    ) -> Result<Arc<Region>, AgentError> {
        let device = crate::cuda::probe()
            .map_err(crate::cuda::CudaError::from)
            .and_then(|c| c.device(ordinal))?;
        let buf = device.alloc(len)?;
        let ipc = if export { Some(device.export(&buf)?) } else { None };
        let mem = DeviceMemory {
            addr: buf.ptr(),
            len,
            ordinal: ordinal as u32,
            owner: Some(Box::new(buf)),
            ipc,
        };
        // SAFETY: a fresh allocation of `len` bytes on that device, freed by its owner value
        // only when the region drops; the export is that allocation's.
        Ok(unsafe { self.inner.regions().register_device(mem, export) }?)
    }

    /// Registers GPU memory an engine owns (its KV cache tensors): `len` bytes at device
    /// address `addr`. The driver confirms that it is device memory, names its device, and
    /// checks that the range lies inside one allocation; with `export`, the region carries a
    /// CUDA IPC export of that range for peers on this host.
    ///
    /// # Safety
    /// The memory must stay valid until [`Agent::deregister`] succeeds for the region.
    #[cfg(feature = "cuda")]
    pub unsafe fn register_device(
        &self,
        addr: u64,
        len: usize,
        export: bool,
    ) -> Result<Arc<Region>, AgentError> {
        let cuda = crate::cuda::probe().map_err(crate::cuda::CudaError::from)?;
        let at = cuda.locate(addr, len)?;
        let ipc = if export {
            let device = cuda.device(at.ordinal)?;
            // SAFETY: `locate` found `at.base` to be the live allocation holding the range.
            Some(unsafe { device.export_range(at.base, len as u64, addr - at.base) }?)
        } else {
            None
        };
        let mem = DeviceMemory { addr, len, ordinal: at.ordinal as u32, owner: None, ipc };
        // SAFETY: checked by the driver above; the caller keeps it valid (contract).
        Ok(unsafe { self.inner.regions().register_device(mem, export) }?)
    }

    /// Registers GPU memory without asking the driver: `len` bytes at device address `addr`
    /// on CUDA device `ordinal` of this process, without an IPC export (for callers that
    /// know the memory, and for tests of GPU regions on machines without a GPU).
    ///
    /// # Safety
    /// The memory must be that device's, and stay valid until [`Agent::deregister`]
    /// succeeds for the region.
    pub unsafe fn register_device_unchecked(
        &self,
        addr: u64,
        len: usize,
        ordinal: u32,
        export: bool,
    ) -> Result<Arc<Region>, AgentError> {
        let mem = DeviceMemory { addr, len, ordinal, owner: None, ipc: None };
        // SAFETY: forwarded contract.
        Ok(unsafe { self.inner.regions().register_device(mem, export) }?)
    }

    /// Registers memory the caller owns.
    ///
    /// # Safety
    /// As [`RegionTable::register_external`]: the memory must stay valid until
    /// [`Agent::deregister`] succeeds for it.
    pub unsafe fn register_external(
        &self,
        ptr: std::ptr::NonNull<u8>,
        len: usize,
        export: bool,
    ) -> Result<Arc<Region>, AgentError> {
        // SAFETY: forwarded contract.
        Ok(unsafe { self.inner.regions().register_external(ptr, len, export) }?)
    }

    /// The region with this id.
    pub fn region(&self, id: RegionId) -> Result<Arc<Region>, AgentError> {
        Ok(self.inner.regions().get(id)?)
    }

    /// Removes a region; fails while transfers use it.
    pub fn deregister(&self, id: RegionId) -> Result<(), AgentError> {
        self.inner.regions().deregister(id)?;
        if let Some(rdma) = &self.inner.rdma {
            rdma.forget_region(id);
        }
        Ok(())
    }

    /// Its RDMA transport, when it has one (tests look at its counters).
    #[cfg(test)]
    pub(crate) fn rdma_transport(&self) -> Option<&Arc<crate::transport::rdma::RdmaTransport>> {
        self.inner.rdma.as_ref()
    }

    /// Whether this agent moves bytes over RDMA, on which device, or why not.
    pub fn rdma_status(&self) -> &RdmaStatus {
        &self.inner.rdma_status
    }

    /// Why this agent's RDMA transport stopped working (its completion queue failed), if it
    /// did: transfers between hosts then go over TCP.
    pub fn rdma_failure(&self) -> Option<String> {
        self.inner.rdma.as_ref().and_then(|t| t.failure())
    }

    /// This agent's metadata, for peers to load. Regions registered later are not in it:
    /// export it again after registering (as with NIXL).
    pub fn metadata(&self) -> AgentMetadata {
        let mut transports = vec![TransportKind::Tcp];
        let rdma_failed = self.rdma_failure();
        if self.inner.transports.rdma.is_some() && rdma_failed.is_none() {
            transports.insert(0, TransportKind::Rdma);
        }
        if self.inner.config.shm {
            transports.insert(0, TransportKind::Shm);
        }
        AgentMetadata {
            name: self.inner.config.name.clone(),
            tcp_addr: self.advertised_addr(),
            host_id: self.inner.host_id.clone(),
            pid: std::process::id(),
            regions: self
                .inner
                .regions()
                .all()
                .into_iter()
                .filter(|r| r.is_exported())
                .map(|r| ExportedRegion {
                    id: r.id(),
                    len: r.len() as u64,
                    shm_path: r.shm_path().map(|p| p.display().to_string()),
                    kind: r.kind(),
                    cuda_ipc: r.cuda_ipc().cloned(),
                })
                .collect(),
            transports,
            rdma: match rdma_failed {
                Some(why) => {
                    RdmaStatus::Unavailable { reason: format!("the device failed: {why}") }
                }
                None => self.inner.rdma_status.clone(),
            },
        }
    }

    /// Loads (or reloads) a peer's metadata.
    pub fn load_peer(&self, md: AgentMetadata) -> Result<(), AgentError> {
        if md.name == self.inner.config.name {
            return Err(AgentError::BadMetadata("a peer cannot have this agent's name".into()));
        }
        if md.name.is_empty() {
            return Err(AgentError::BadMetadata("empty peer name".into()));
        }
        let same_host = md.host_id == self.inner.host_id
            && self.inner.config.shm
            && md.transports.contains(&TransportKind::Shm);
        let session = Session::new(md.tcp_addr, &md.name, &self.inner.session);
        let name = md.name.clone();
        let peer = Peer::new(md, session, same_host, &self.inner.seal).inspect_err(|e| {
            if self.inner.foreign_memory.fetch_add(1, Ordering::Relaxed) == 0 {
                tracing::warn!(agent = %self.inner.config.name, peer = %name, error = %e,
                    "refused a peer whose metadata names shared memory that is not its own \
                     (logged once; counted in /metrics)");
            } else {
                tracing::debug!(peer = %name, error = %e, "refused a peer's foreign shared memory");
            }
        })?;
        self.inner.peers.write().insert(name, Arc::new(peer));
        Ok(())
    }

    /// The agent port's connections: refused and closed by cause, pending, admitted.
    pub fn connection_stats(&self) -> PortSnapshot {
        self.inner.port.snapshot()
    }

    /// Peers refused because their metadata named another process's shared memory.
    pub fn foreign_memory_refusals(&self) -> u64 {
        self.inner.foreign_memory.load(Ordering::Relaxed)
    }

    /// Forgets a peer; its connections close when in-flight transfers finish.
    pub fn remove_peer(&self, name: &str) -> bool {
        self.inner.peers.write().remove(name).is_some()
    }

    /// The metadata a loaded peer was loaded with.
    pub fn peer_metadata(&self, name: &str) -> Option<AgentMetadata> {
        self.inner.peers.read().get(name).map(|p| p.metadata().clone())
    }

    /// Names of the loaded peers.
    pub fn peers(&self) -> Vec<String> {
        self.inner.peers.read().keys().cloned().collect()
    }

    /// Checks a request, leases its local regions and chooses its transport: the job, ready.
    fn prepare(&self, req: TransferRequest) -> Result<(Job, Arc<dyn Transport>), TransferError> {
        let inner = &self.inner;
        let limits = &inner.config.limits;
        check_request(&req, limits.descs_per_transfer_max, &limits.wire)?;
        let (leases, pieces) = inner.endpoint().lease_local(&req.local, &req.remote)?;
        let (transport, peer) = self.choose_transport(&req)?;
        if let Some(peer) = &peer {
            check_remote(peer.metadata(), &req.remote)?;
        }
        // GPU memory staged through host memory to another host: the chunks go over RDMA
        // when both agents have it.
        let stage_over_rdma = transport.kind() == TransportKind::Cuda
            && peer.as_ref().is_some_and(|p| !p.same_host() && self.rdma_route(p).is_ok());
        let job = Job {
            id: inner.next_id.fetch_add(1, Ordering::Relaxed),
            op: req.op,
            peer,
            leases,
            pieces,
            checksum: req.checksum,
            notify: req.notify,
            inline_bytes_max: inner.config.inline_copy_bytes_max,
            corrupt_checksums: false,
            stage_over_rdma,
            endpoint: Arc::downgrade(inner.endpoint()),
        };
        Ok((job, transport))
    }

    /// The job `post` would run for `req` (for tests of transports' internals).
    #[cfg(test)]
    pub(crate) fn job_for(&self, req: &TransferRequest) -> Result<Job, TransferError> {
        self.prepare(req.clone()).map(|(job, _)| job)
    }

    /// How the transfers posted here ended, per transport (`/metrics`). Requests refused by
    /// `post` itself (invalid, busy) are not transfers and are not counted.
    pub fn transfer_counts(&self) -> Vec<crate::transfer::TransferCount> {
        self.inner.counters.snapshot()
    }

    /// Its part of `/health`: transfers failed, the CUDA devices, RDMA and whether it broke.
    pub fn health(&self) -> crate::health::TransferHealth {
        crate::health::TransferHealth {
            failed: self.transfer_counts().iter().map(|c| c.failed).sum(),
            cuda: crate::health::CudaHealth::probe(),
            rdma: self.rdma_status().clone(),
            rdma_failure: self.rdma_failure(),
        }
    }

    /// Validates and posts a transfer; it runs on the agent's runtime.
    pub fn post(&self, req: TransferRequest) -> Result<TransferHandle, TransferError> {
        let inner = &self.inner;
        let limits = &inner.config.limits;
        let deadline = req.deadline.unwrap_or(limits.transfer_deadline);
        let (job, transport) = self.prepare(req)?;
        let permit = inner
            .in_flight
            .clone()
            .try_acquire_owned()
            .map_err(|_| TransferError::Busy(limits.transfers_in_flight_max))?;
        let id = job.id;
        let counted = (inner.counters.clone(), transport.kind(), job.bytes());
        let shared = TransferShared::new(deadline, counted);
        if let Some(outcome) = transport.execute_inline(&job) {
            // Completed on this thread (a memcpy transport): no task, no wake-up. What it
            // held is released before the outcome is reported.
            drop(job);
            drop(permit);
            drop(crate::transfer::ExitGuard(shared.clone()));
            shared.apply(TransferEvent::Start);
            shared.apply(match outcome {
                Ok(()) => TransferEvent::Complete,
                Err(e) => TransferEvent::Fail(e),
            });
            return Ok(TransferHandle { id, shared });
        }
        let task_shared = shared.clone();
        // Created outside the task and moved in: dropped even if the task is aborted before
        // its first poll, in field order — the job's leases, then the permit, then the exit
        // guard that marks the transfer quiesced.
        let running = Running { job, permit, exit: crate::transfer::ExitGuard(shared.clone()) };
        // The deadline's timer belongs to the agent's runtime, whoever polls the work.
        let expiry = {
            let _in = inner.runtime.enter();
            tokio::time::sleep(deadline)
        };
        let work = async move {
            task_shared.apply(TransferEvent::Start);
            let outcome = tokio::select! {
                r = transport.execute(&running.job) => Some(r),
                _ = expiry => None,
            };
            let event = match outcome {
                Some(Ok(())) => TransferEvent::Complete,
                Some(Err(e)) => TransferEvent::Fail(e),
                None => TransferEvent::Deadline,
            };
            // Release first, then report: whoever sees the outcome can deregister the
            // regions and post the next transfer at once.
            let Running { job, permit, exit } = running;
            drop(job);
            drop(permit);
            drop(exit);
            task_shared.apply(event);
        };
        // A waiter on the handle moves the work too (see `Drive`): posted and awaited, a
        // transfer completes on the waiter's thread without hand-offs between threads.
        let drive = crate::transfer::Drive::new(work);
        let _ = shared.drive.set(drive.clone());
        let task = inner.runtime.spawn(crate::transfer::TaskDrive(drive));
        *shared.abort.lock() = Some(task.abort_handle());
        // A cancel that raced the spawn finds no abort handle; abort now.
        if shared.state.lock().status().is_terminal() {
            task.abort();
        }
        Ok(TransferHandle { id, shared })
    }

    fn choose_transport(
        &self,
        req: &TransferRequest,
    ) -> Result<(Arc<dyn Transport>, PeerRoute), TransferError> {
        let t = &self.inner.transports;
        if self.touches_gpu_memory(req) {
            return self.cuda_route(req);
        }
        if req.peer == self.inner.config.name {
            return match req.transport {
                None | Some(TransportKind::Local) => Ok((t.local.clone(), None)),
                Some(other) => Err(TransferError::NoTransport {
                    peer: req.peer.clone(),
                    reason: format!("{other} to this agent itself; use local"),
                }),
            };
        }
        let peer = self.peer(&req.peer)?;
        let shm_ok =
            || peer.same_host() && req.remote.iter().all(|d| peer.shm_map(d.region).is_some());
        let rdma = || self.rdma_route(&peer);
        match req.transport {
            Some(TransportKind::Tcp) => Ok((t.tcp.clone(), Some(peer))),
            Some(TransportKind::Rdma) => match rdma() {
                Ok(r) => Ok((r, Some(peer))),
                Err(reason) => Err(TransferError::NoTransport {
                    peer: req.peer.clone(),
                    reason: format!("rdma: {reason}"),
                }),
            },
            Some(TransportKind::Shm) => {
                if shm_ok() {
                    Ok((t.shm.clone(), Some(peer)))
                } else {
                    Err(TransferError::NoTransport {
                        peer: req.peer.clone(),
                        reason: "shm needs the same host and shareable remote regions".into(),
                    })
                }
            }
            Some(TransportKind::Local) => Err(TransferError::NoTransport {
                peer: req.peer.clone(),
                reason: "local is only for this agent itself".into(),
            }),
            Some(TransportKind::Cuda) => Err(TransferError::NoTransport {
                peer: req.peer.clone(),
                reason: "cuda is for GPU memory, and this transfer names none".into(),
            }),
            None if shm_ok() => Ok((t.shm.clone(), Some(peer))),
            None => match rdma() {
                Ok(r) => Ok((r, Some(peer))),
                Err(_) => Ok((t.tcp.clone(), Some(peer))),
            },
        }
    }

    /// The RDMA transport to `peer`, or why there is none: both agents need a device, on the
    /// same kind of link.
    fn rdma_route(&self, peer: &Peer) -> Result<Arc<dyn Transport>, String> {
        let md = peer.metadata();
        let theirs = md.transports.contains(&TransportKind::Rdma);
        let link = |s: &RdmaStatus| match s {
            RdmaStatus::Device { link_layer, .. } => Some(link_layer.clone()),
            _ => None,
        };
        let (ours, peers) = (link(&self.inner.rdma_status), link(&md.rdma));
        if let Some(why) = self.rdma_failure() {
            return Err(format!("this agent's device failed: {why}"));
        }
        if let Some(why) = self.inner.rdma.as_ref().and_then(|t| t.refused_by(&md.name)) {
            return Err(format!("{} refused an RDMA connection: {why}", md.name));
        }
        match (&self.inner.transports.rdma, theirs) {
            (None, _) => Err(format!("this agent has none: {}", self.inner.rdma_status)),
            (Some(_), false) => Err(format!("{} has none: {}", md.name, md.rdma)),
            // InfiniBand and RoCE do not reach each other.
            (Some(_), true) if peers.is_some() && ours != peers => Err(format!(
                "this agent's device is {}, {}'s is {}",
                self.inner.rdma_status, md.name, md.rdma
            )),
            (Some(r), true) => Ok(r.clone()),
        }
    }

    /// GPUDirect RDMA for a request that names GPU memory: the adapters move the bytes to
    /// and from GPU memory on either side, with no copy through host memory. Why not: no
    /// RDMA route, a side whose adapter cannot reach GPU memory, or checksums (computed by
    /// the CPU, which cannot read GPU memory; staging checksums its bounce buffers).
    fn gpu_direct_route(
        &self,
        req: &TransferRequest,
        peer: &Peer,
    ) -> Result<Arc<dyn Transport>, String> {
        let rdma = self.rdma_route(peer)?;
        if req.checksum {
            return Err("checksums of GPU memory are computed on host memory".into());
        }
        let gpu_of = |s: &RdmaStatus| match s {
            RdmaStatus::Device { gpu, .. } => gpu.is_some(),
            _ => false,
        };
        let regions = self.inner.regions();
        let local_gpu = req
            .local
            .iter()
            .any(|d| regions.get(d.region).is_ok_and(|r| r.kind() != MemoryKind::Host));
        if local_gpu && !gpu_of(&self.inner.rdma_status) {
            let why = self.inner.rdma.as_ref().and_then(|t| t.gpu_direct().err()).unwrap_or("");
            return Err(format!("this agent's adapter does not reach GPU memory: {why}"));
        }
        let md = peer.metadata();
        let remote_gpu = req
            .remote
            .iter()
            .any(|d| md.regions.iter().any(|r| r.id == d.region && r.kind != MemoryKind::Host));
        if remote_gpu && !gpu_of(&md.rdma) {
            return Err(format!("{}'s adapter does not reach GPU memory ({})", md.name, md.rdma));
        }
        // A GPU whose memory the adapter cannot register after all (no dma-buf support on
        // that GPU or in the provider): not over RDMA; the default route stages it.
        if let Some(t) = self.inner.rdma.as_ref().filter(|_| local_gpu) {
            let mut last = None;
            for d in &req.local {
                if last.replace(d.region) == Some(d.region) {
                    continue; // a run of descriptors in one region: looked at once
                }
                let Ok(r) = regions.get(d.region) else { continue };
                if r.kind() != MemoryKind::Host {
                    t.reaches(&r).map_err(|why| format!("this agent's adapter: {why}"))?;
                }
            }
        }
        Ok(rdma)
    }

    /// A loaded peer.
    pub(crate) fn peer(&self, name: &str) -> Result<Arc<Peer>, TransferError> {
        self.inner
            .peers
            .read()
            .get(name)
            .cloned()
            .ok_or_else(|| TransferError::UnknownPeer(name.to_string()))
    }

    /// Whether a request names GPU memory, here or at the peer.
    ///
    /// Every `post` asks, so each region is looked up once per run of descriptors naming it
    /// (a descriptor list names few regions), not once per descriptor.
    fn touches_gpu_memory(&self, req: &TransferRequest) -> bool {
        fn regions_of(descs: &[Desc]) -> impl Iterator<Item = RegionId> + '_ {
            descs
                .iter()
                .enumerate()
                .filter(|&(i, d)| i == 0 || descs[i - 1].region != d.region)
                .map(|(_, d)| d.region)
        }
        let regions = self.inner.regions();
        let device = |id| regions.get(id).is_ok_and(|r| r.kind() != MemoryKind::Host);
        if regions_of(&req.local).any(device) {
            return true;
        }
        if req.peer == self.inner.config.name {
            return regions_of(&req.remote).any(device);
        }
        let peers = self.inner.peers.read();
        let Some(peer) = peers.get(&req.peer) else { return false };
        let exported = &peer.metadata().regions;
        regions_of(&req.remote)
            .any(|id| exported.iter().any(|r| r.id == id && r.kind != MemoryKind::Host))
    }

    /// The route of a request that touches GPU memory: the CUDA transport within this agent
    /// and to peers of this host that export their GPU regions through CUDA IPC.
    fn cuda_route(
        &self,
        req: &TransferRequest,
    ) -> Result<(Arc<dyn Transport>, PeerRoute), TransferError> {
        let no = |reason: String| TransferError::NoTransport { peer: req.peer.clone(), reason };
        let other_agent = req.peer != self.inner.config.name;
        if req.transport == Some(TransportKind::Rdma) && other_agent {
            let peer = self.peer(&req.peer)?;
            return match self.gpu_direct_route(req, &peer) {
                Ok(rdma) => Ok((rdma, Some(peer))),
                Err(why) => Err(no(format!("rdma: {why}"))),
            };
        }
        if let Some(k) = req.transport.filter(|&k| k != TransportKind::Cuda) {
            return Err(no(format!("{k} cannot reach GPU memory; use cuda or rdma")));
        }
        // Another host, both adapters reaching GPU memory: GPUDirect RDMA, no staging.
        if other_agent && req.transport.is_none() {
            let peer = self.peer(&req.peer)?;
            if !peer.same_host() {
                if let Ok(rdma) = self.gpu_direct_route(req, &peer) {
                    return Ok((rdma, Some(peer)));
                }
            }
        }
        let cuda = self
            .inner
            .transports
            .cuda
            .clone()
            .ok_or_else(|| no(crate::cuda::CudaUnavailable::NotBuilt.to_string()))?;
        crate::cuda::available().map_err(|why| no(why.to_string()))?;
        if req.peer == self.inner.config.name {
            return Ok((cuda, None));
        }
        let peer = self.peer(&req.peer)?;
        if !peer.same_host() {
            // Local GPU memory to host memory of another host: staged through bounce
            // buffers over TCP. GPU memory of another host: its owner must stage it.
            let remote_host = req.remote.iter().all(|d| {
                peer.metadata()
                    .regions
                    .iter()
                    .any(|r| r.id == d.region && r.kind == MemoryKind::Host)
            });
            if !remote_host {
                let why = self.gpu_direct_route(req, &peer).err().unwrap_or_default();
                return Err(no(format!(
                    "GPU memory of another host is reachable only over GPUDirect RDMA ({why}): \
                     its owner stages it to host memory"
                )));
            }
            return Ok((cuda, Some(peer)));
        }
        let all_ipc = req.remote.iter().all(|d| {
            peer.metadata().regions.iter().any(|r| r.id == d.region && r.cuda_ipc.is_some())
        });
        if !all_ipc {
            return Err(no("a remote region is not GPU memory exported through CUDA IPC".into()));
        }
        Ok((cuda, Some(peer)))
    }

    /// Installs the service that answers peers' RPCs.
    pub fn set_rpc_handler(&self, handler: Arc<dyn RpcHandler>) {
        *self.inner.services.rpc.write() = Some(handler);
    }

    /// Removes the service (peers' RPCs are refused from now on). A handler that holds this
    /// agent must be removed for the agent to be dropped.
    pub fn clear_rpc_handler(&self) {
        *self.inner.services.rpc.write() = None;
    }

    /// Calls a peer's service: sends `body` for `method` and waits for its reply, up to
    /// `deadline`. Fails typed if the peer is unknown, dead, slow or refuses.
    pub async fn call(
        &self,
        peer: &str,
        method: u16,
        body: Vec<u8>,
        deadline: Duration,
    ) -> Result<Vec<u8>, TransferError> {
        let max = self.inner.config.limits.wire.frame_bytes_max as usize;
        if body.len() + 2 > max {
            return Err(TransferError::Invalid(format!(
                "RPC body of {} bytes exceeds the {max}-byte frame limit",
                body.len()
            )));
        }
        let p = self.peer(peer)?;
        tokio::time::timeout(deadline, p.session.call(method, body))
            .await
            .map_err(|_| TransferError::TimedOut(deadline))?
    }

    /// Waits for the next notification from any peer.
    pub async fn next_notification(&self) -> Option<Notification> {
        self.inner.notify_rx.lock().await.recv().await
    }

    /// Takes the notifications queued now, without waiting.
    pub fn try_notifications(&self) -> Vec<Notification> {
        let mut out = Vec::new();
        if let Ok(mut rx) = self.inner.notify_rx.try_lock() {
            while let Ok(n) = rx.try_recv() {
                out.push(n);
            }
        }
        out
    }

    /// The transport a request would use now (for diagnostics and benchmarks).
    pub fn transport_for(&self, req: &TransferRequest) -> Result<TransportKind, TransferError> {
        self.choose_transport(req).map(|(t, _)| t.kind())
    }

    /// Stops accepting connections (in-flight transfers finish or time out). Its shared
    /// regions are memfds: their memory goes with the last region handle and the last peer
    /// mapping, and nothing of them outlives the process, however it exits.
    pub fn shutdown(&self) {
        if let Some(server) = self.inner.server.lock().take() {
            server.stop();
        }
    }
}

impl Drop for AgentInner {
    fn drop(&mut self) {
        if let Some(server) = self.server.get_mut().take() {
            server.stop();
        }
    }
}

/// The peer a transport reaches: None for this agent itself.
type PeerRoute = Option<Arc<Peer>>;

fn sanitize(name: &str) -> String {
    name.chars()
        .map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '_' })
        .take(64)
        .collect()
}

/// A convenience used by tests and benchmarks: the op's direction as a word.
pub fn op_name(op: TransferOp) -> &'static str {
    match op {
        TransferOp::Read => "read",
        TransferOp::Write => "write",
    }
}
