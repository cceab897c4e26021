//! `kvf_agent`: a transfer agent with its own runtime, registered memory, peers, transfers
//! with notifications, and (when configured) its connection to etcd and NATS.

use std::ffi::{c_char, c_void};
use std::net::SocketAddr;
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::Duration;

use kvfabric::affinity::CpuSet;
use kvfabric::agent::{Agent, AgentConfig, AgentMetadata, Notification};
use kvfabric::control::etcd::EtcdDiscovery;
use kvfabric::control::file::FileDiscovery;
use kvfabric::control::memory::{MemoryBus, MemoryDiscovery};
use kvfabric::control::nats::NatsBus;
use kvfabric::control::{Discovery, EventBus};
use kvfabric::memory::RegionId;
use kvfabric::transfer::{Desc, TransferOp, TransferRequest};
use kvfabric_tiers::remote::protocol::FABRIC_KIND;
use parking_lot::Mutex;

use crate::config::kvf_config;
use crate::error::{guard, kvf_result, recorded, FfiError, LastError, Recorded};
use crate::op::{kvf_op, timeout_of};
use crate::ptr::{self, Out, OutBuf};

/// Memory kind of `kvf_agent_register`: host memory.
pub const KVF_MEM_HOST: u32 = 0;
/// Memory kind of `kvf_agent_register`: CUDA device memory (needs an NVIDIA driver and GPU).
pub const KVF_MEM_DEVICE: u32 = 1;
/// Transfer direction: copy the peer's bytes into local memory.
pub const KVF_OP_READ: u32 = 0;
/// Transfer direction: copy local bytes into the peer's memory.
pub const KVF_OP_WRITE: u32 = 1;
/// Transfer flag: checksum every descriptor (XXH3-64); the receiver verifies.
pub const KVF_TRANSFER_CHECKSUM: u32 = 1;

/// A range of a registered region (the local agent's for local descriptors, the peer's for
/// remote ones).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct kvf_desc {
    /// Region id from `kvf_agent_register` (or the peer's metadata).
    pub region: u64,
    /// Offset in bytes.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

/// What the agent and its stores share: the runtime and the agent's connections.
#[derive(Debug)]
pub(crate) struct Parts {
    pub(crate) agent: Agent,
    pub(crate) discovery: Arc<dyn Discovery>,
    pub(crate) bus: Arc<dyn EventBus>,
    pub(crate) deadline: Duration,
    pub(crate) lease_ttl: Duration,
    /// A notification that did not fit the caller's buffers, kept for the next call.
    pending: Mutex<Option<Notification>>,
}

/// The runtime and the parts that live on it; dropped in that order's reverse.
#[derive(Debug)]
pub(crate) struct Ctx {
    rt: Option<tokio::runtime::Runtime>,
    parts: Option<Parts>,
}

impl Ctx {
    pub(crate) fn rt(&self) -> &tokio::runtime::Runtime {
        self.rt.as_ref().expect("the runtime lives until the context drops")
    }
}

impl std::ops::Deref for Ctx {
    type Target = Parts;
    fn deref(&self) -> &Parts {
        self.parts.as_ref().expect("the parts live until the context drops")
    }
}

impl Drop for Ctx {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            {
                // Connections and tasks are dropped inside the runtime they belong to.
                let _entered = rt.enter();
                if let Some(parts) = self.parts.take() {
                    parts.agent.shutdown();
                    drop(parts);
                }
            }
            // Waits for the runtime's threads to stop and drop their tasks, so that nothing
            // of this agent outlives `kvf_agent_free` (blocking work gets a bounded wait).
            rt.shutdown_timeout(Duration::from_secs(5));
        }
    }
}

/// An agent. All functions taking a `const kvf_agent *` are thread-safe.
#[derive(Debug)]
pub struct kvf_agent {
    pub(crate) ctx: Arc<Ctx>,
    pub(crate) last_error: LastError,
}

impl Recorded for kvf_agent {
    fn last_error(&self) -> &LastError {
        &self.last_error
    }
}

fn io(e: std::io::Error) -> FfiError {
    FfiError::new(kvf_result::KVF_IO, e.to_string())
}

impl kvf_agent {
    /// Starts an agent from a config (Rust entry point of `kvf_agent_new`).
    pub fn new(cfg: &kvf_config) -> Result<kvf_agent, FfiError> {
        let secret = cfg.str("secret").ok_or_else(|| {
            FfiError::new(kvf_result::KVF_INVALID_CONFIG, "config key \"secret\" is required")
        })?;
        let name = match cfg.str("name") {
            Some(n) => n.to_string(),
            None => {
                let mut r = [0u8; 4];
                getrandom::fill(&mut r)
                    .map_err(|e| FfiError::new(kvf_result::KVF_IO, e.to_string()))?;
                format!("kvf-{}-{:08x}", std::process::id(), u32::from_le_bytes(r))
            }
        };
        init_logging();
        let threads = cfg.num::<u32>("worker_threads", 2).clamp(1, 64) as usize;
        let cpus: CpuSet = cfg.str("cpus").unwrap_or("all").parse().map_err(|e| {
            FfiError::new(kvf_result::KVF_INVALID_CONFIG, format!("config key \"cpus\": {e}"))
        })?;
        let widen_failed = Arc::new(std::sync::Once::new());
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_name("kvfabric-ffi")
            // Every thread of the runtime (workers and the blocking pool) leaves the cores an
            // engine pinned the creating thread to (kvfabric::affinity).
            .on_thread_start(move || {
                if let Err(e) = cpus.apply_to_current_thread() {
                    widen_failed.call_once(|| {
                        tracing::warn!(error = %e, ?cpus, "cannot set the CPUs of kvfabric's threads; they keep the creating thread's");
                    });
                }
            })
            .enable_all()
            .build()
            .map_err(io)?;
        let mut acfg = AgentConfig::new(name, secret.as_bytes().to_vec());
        acfg.listen = cfg.addr("listen", SocketAddr::from(([127, 0, 0, 1], 0)));
        // What peers on other hosts dial: `listen_advertise`, else the listen address, else (on
        // 0.0.0.0) the interface that routes to the control plane; loopback with a remote
        // control plane is refused (kvfabric::control::advertise).
        let reach = {
            use kvfabric::control::advertise::Reach;
            let etcd = cfg.list("etcd");
            let nats: Vec<String> =
                cfg.str("nats").map_or(Vec::new(), |n| n.split(',').map(str::to_string).collect());
            let e = etcd.iter().map(|e| (e.as_str(), 2379));
            Reach::of(e.chain(nats.iter().map(|n| (n.as_str(), 4222))))
        };
        let invalid = |e: kvfabric::control::advertise::AdvertiseError| {
            FfiError::new(kvf_result::KVF_INVALID_CONFIG, e.to_string())
        };
        let given = cfg.str("listen_advertise").map(str::parse).transpose().map_err(invalid)?;
        acfg.advertise = Some(
            kvfabric::control::advertise::Advertise::resolve(
                "the transfer agent",
                acfg.listen,
                given,
                &reach,
            )
            .map_err(invalid)?,
        );
        acfg.shm = cfg.bool("shm", true);
        // The C ABI is a process's entry point: it reads the operator's RDMA settings from
        // the environment, as the binary does (the library never reads it).
        acfg.rdma = kvfabric::transport::rdma::RdmaConfig::from_settings(|k| std::env::var(k).ok());
        let deadline = Duration::from_millis(cfg.num::<u64>("deadline_ms", 30_000).max(1));
        acfg.limits.transfer_deadline = deadline;
        let etcd = cfg.list("etcd");
        let discovery_dir = cfg.str("discovery_dir").map(std::path::PathBuf::from);
        let nats = cfg.str("nats").map(String::from);
        let namespace = cfg.str("namespace").unwrap_or("default").to_string();
        let parts = rt.block_on(async {
            let agent = Agent::start(acfg).await?;
            let discovery: Arc<dyn Discovery> = if !etcd.is_empty() {
                let d = EtcdDiscovery::connect(&etcd, &namespace).await?;
                // The client connects lazily: ask once, so that a wrong endpoint fails here.
                d.list(FABRIC_KIND).await?;
                Arc::new(d)
            } else if let Some(dir) = &discovery_dir {
                // The processes of one host that share a directory find each other there.
                Arc::new(FileDiscovery::open(dir)?)
            } else {
                Arc::new(MemoryDiscovery::new())
            };
            let bus: Arc<dyn EventBus> = match &nats {
                Some(url) => Arc::new(NatsBus::connect(url, &namespace).await?),
                None => Arc::new(MemoryBus::new()),
            };
            Ok::<_, FfiError>(Parts {
                agent,
                discovery,
                bus,
                deadline,
                lease_ttl: Duration::from_millis(cfg.num::<u64>("lease_ttl_ms", 10_000).max(1000)),
                pending: Mutex::new(None),
            })
        });
        let parts = match parts {
            Ok(p) => p,
            Err(e) => {
                rt.shutdown_background();
                return Err(e);
            }
        };
        Ok(kvf_agent {
            ctx: Arc::new(Ctx { rt: Some(rt), parts: Some(parts) }),
            last_error: LastError::default(),
        })
    }

    /// The agent (Rust tests and benchmarks).
    pub fn agent(&self) -> &Agent {
        &self.ctx.agent
    }

    /// Waits for the runtime to run `fut` (for Rust callers).
    pub fn block_on<F: std::future::Future>(&self, fut: F) -> F::Output {
        self.ctx.rt().block_on(fut)
    }
}

/// Copies `bytes` into a caller buffer whole, or fails with `KVF_BUFFER_TOO_SMALL` and the
/// size needed in `*len_out`.
pub(crate) fn copy_bytes(
    bytes: &[u8],
    buf: OutBuf<u8>,
    len_out: Out<usize>,
) -> Result<(), FfiError> {
    len_out.set(bytes.len());
    if bytes.len() > buf.cap() {
        return Err(FfiError::new(
            kvf_result::KVF_BUFFER_TOO_SMALL,
            format!("{} bytes needed, the buffer holds {}", bytes.len(), buf.cap()),
        ));
    }
    buf.write(bytes);
    Ok(())
}

/// Starts an agent (its own threads; no process-wide state) from `config` into
/// `*agent_out`. Reads: name, secret (required), listen, listen_advertise, shm, worker_threads, cpus, etcd,
/// nats, namespace, deadline_ms, lease_ttl_ms, discovery_dir. Discovery is etcd's with `etcd`;
/// else, with `discovery_dir`, a directory that the processes of one host share (an instance
/// is there while its process lives; names are create-only); else in this agent alone.
/// Free it with `kvf_agent_free`.
///
/// # Safety
/// `config` is a live config; `agent_out` is valid for one write.
#[no_mangle]
pub unsafe extern "C" fn kvf_agent_new(
    config: *const kvf_config,
    agent_out: *mut *mut kvf_agent,
) -> kvf_result {
    guard(|| {
        // SAFETY: the caller's contract.
        let cfg = unsafe { ptr::handle(config, "config") }?;
        // SAFETY: as above.
        let out = unsafe { Out::new(agent_out, "agent_out") }?;
        match kvf_agent::new(cfg) {
            Ok(a) => {
                out.set(ptr::into_raw(a));
                Ok(())
            }
            Err(e) => {
                cfg.last_error_set(&e);
                Err(e)
            }
        }
    })
}

/// Stops and frees an agent; NULL is allowed. Stores created on it keep its runtime alive
/// until they are freed too. Operations still running fail with `KVF_TRANSFER`.
///
/// # Safety
/// `agent` is NULL or a live agent, not used again after this call by any thread.
#[no_mangle]
pub unsafe extern "C" fn kvf_agent_free(agent: *mut kvf_agent) {
    // SAFETY: the caller gives the handle back once.
    crate::error::guard_void(|| unsafe { ptr::free(agent) })
}

/// Copies the text of the last failed call on `agent` (NUL-terminated, truncated to fit).
/// With several threads failing at once, it is one of their texts.
///
/// # Safety
/// `agent` is a live agent; `buf` is valid for `cap` writes; `len_out` for one.
#[no_mangle]
pub unsafe extern "C" fn kvf_agent_last_error(
    agent: *const kvf_agent,
    buf: *mut c_char,
    cap: usize,
    len_out: *mut usize,
) -> kvf_result {
    guard(|| {
        // SAFETY: the caller's contract.
        let h = unsafe { ptr::handle(agent, "agent") }?;
        // SAFETY: the caller's contract.
        unsafe { crate::ptr::write_text(&h.last_error.get(), buf, cap, len_out) }
    })
}

/// Copies the agent's metadata (what a peer passes to `kvf_agent_load_peer`: its name,
/// addresses and exported regions; opaque bytes) into `buf`. Export it again after
/// registering new regions. `KVF_BUFFER_TOO_SMALL` writes the size needed to `*len_out`.
///
/// # Safety
/// `agent` is a live agent; `buf` is valid for `cap` writes; `len_out` for one.
#[no_mangle]
pub unsafe extern "C" fn kvf_agent_metadata(
    agent: *const kvf_agent,
    buf: *mut u8,
    cap: usize,
    len_out: *mut usize,
) -> kvf_result {
    // SAFETY: the caller's contract.
    let agent = unsafe { agent.as_ref() };
    recorded(agent, "agent", |a| {
        // SAFETY: as above.
        let buf = unsafe { OutBuf::new(buf, cap, "buf") }?;
        // SAFETY: as above.
        let out = unsafe { Out::new(len_out, "len_out") }?;
        copy_bytes(&a.ctx.agent.metadata().to_bytes(), buf, out)
    })
}

/// Copies the agent's name, NUL-terminated, into `buf` (`KVF_BUFFER_TOO_SMALL`: `*len_out`
/// receives the size needed, NUL included).
///
/// # Safety
/// `agent` is a live agent; `buf` is valid for `cap` writes; `len_out` for one.
#[no_mangle]
pub unsafe extern "C" fn kvf_agent_name(
    agent: *const kvf_agent,
    buf: *mut c_char,
    cap: usize,
    len_out: *mut usize,
) -> kvf_result {
    guard(|| {
        // SAFETY: the caller's contract.
        let a = unsafe { ptr::handle(agent, "agent") }?;
        // SAFETY: as above; c_char and u8 have the same size and alignment.
        let buf = unsafe { OutBuf::new(buf.cast::<u8>(), cap, "buf") }?;
        // SAFETY: as above.
        let out = unsafe { Out::new(len_out, "len_out") }?;
        let mut name = a.ctx.agent.name().as_bytes().to_vec();
        name.push(0);
        copy_bytes(&name, buf, out)
    })
}

/// Loads (or reloads) a peer from the metadata bytes its `kvf_agent_metadata` produced.
/// Malformed metadata: `KVF_INVALID_ARGUMENT`.
///
/// # Safety
/// `agent` is a live agent; `metadata` is valid for `len` reads.
#[no_mangle]
pub unsafe extern "C" fn kvf_agent_load_peer(
    agent: *const kvf_agent,
    metadata: *const u8,
    len: usize,
) -> kvf_result {
    // SAFETY: the caller's contract.
    let agent = unsafe { agent.as_ref() };
    recorded(agent, "agent", |a| {
        // SAFETY: as above.
        let bytes = unsafe { ptr::slice(metadata, len, "metadata") }?;
        let md = AgentMetadata::from_bytes(bytes).map_err(kvfabric::AgentError::from)?;
        Ok(a.ctx.agent.load_peer(md)?)
    })
}

/// Forgets a peer. An unknown name: `KVF_NOT_FOUND`.
///
/// # Safety
/// `agent` is a live agent; `name` is a string.
#[no_mangle]
pub unsafe extern "C" fn kvf_agent_remove_peer(
    agent: *const kvf_agent,
    name: *const c_char,
) -> kvf_result {
    // SAFETY: the caller's contract.
    let agent = unsafe { agent.as_ref() };
    recorded(agent, "agent", |a| {
        // SAFETY: as above.
        let name = unsafe { ptr::cstr(name, "name") }?;
        if a.ctx.agent.remove_peer(name) {
            Ok(())
        } else {
            Err(FfiError::new(kvf_result::KVF_NOT_FOUND, format!("no peer named {name:?}")))
        }
    })
}

/// Registers `len` bytes at `addr` that the caller owns; `*region_out` receives the region
/// id used in descriptors and segments. `exported`: peers may read and write it (it appears
/// in the metadata exported after this call). `kind` is `KVF_MEM_HOST` or `KVF_MEM_DEVICE`:
/// GPU memory (a CUDA device pointer), which the driver checks (device memory, inside one
/// allocation: else `KVF_INVALID_ARGUMENT` or `KVF_OUT_OF_BOUNDS`) and whose device it names;
/// exported GPU memory is published with a CUDA IPC handle for peers on this host. Without
/// CUDA (no driver or no GPU), `KVF_MEM_DEVICE` is `KVF_UNSUPPORTED` and says why.
///
/// # Safety
/// `agent` is a live agent; `addr..addr+len` is valid for reads and writes and stays valid
/// until `kvf_agent_deregister` succeeds for the region; `region_out` is valid for one write.
#[no_mangle]
pub unsafe extern "C" fn kvf_agent_register(
    agent: *const kvf_agent,
    addr: *mut c_void,
    len: usize,
    kind: u32,
    exported: bool,
    region_out: *mut u64,
) -> kvf_result {
    // SAFETY: the caller's contract.
    let agent = unsafe { agent.as_ref() };
    recorded(agent, "agent", |a| {
        // SAFETY: as above.
        let out = unsafe { Out::new(region_out, "region_out") }?;
        match kind {
            KVF_MEM_HOST => {}
            KVF_MEM_DEVICE => {
                if addr.is_null() {
                    return Err(FfiError::null("addr"));
                }
                if let Err(why) = kvfabric::cuda::available() {
                    return Err(FfiError::new(kvf_result::KVF_UNSUPPORTED, why.to_string()));
                }
                // SAFETY: the caller keeps the memory valid until deregistration (contract
                // above); the driver checks that it is device memory inside one allocation.
                let region = unsafe { a.ctx.agent.register_device(addr as u64, len, exported) }?;
                out.set(region.id().0);
                return Ok(());
            }
            k => return Err(FfiError::invalid(format!("unknown memory kind {k}"))),
        }
        let ptr = NonNull::new(addr.cast::<u8>()).ok_or_else(|| FfiError::null("addr"))?;
        // SAFETY: the caller keeps the memory valid until deregistration (contract above).
        let region = unsafe { a.ctx.agent.register_external(ptr, len, exported) }?;
        out.set(region.id().0);
        Ok(())
    })
}

/// Deregisters a region; afterwards nothing in kvfabric touches its memory. Fails with
/// `KVF_IN_USE` while a transfer or an op that was not freed uses it, `KVF_NOT_FOUND` for
/// an unknown id.
///
/// # Safety
/// `agent` is a live agent.
#[no_mangle]
pub unsafe extern "C" fn kvf_agent_deregister(agent: *const kvf_agent, region: u64) -> kvf_result {
    // SAFETY: the caller's contract.
    let agent = unsafe { agent.as_ref() };
    recorded(agent, "agent", |a| Ok(a.ctx.agent.deregister(RegionId(region))?))
}

/// Posts a transfer of `n` descriptor pairs with the peer named `peer`: `KVF_OP_WRITE`
/// copies `local[i]` into the peer's `remote[i]`, `KVF_OP_READ` the reverse. `notify`
/// (`notify_len` bytes, may be NULL when 0) is delivered to the peer after the last byte.
/// `flags`: `KVF_TRANSFER_CHECKSUM`. `timeout_ms`: 0 for the agent's deadline. The op's count
/// is the bytes moved. Descriptors are checked before any byte moves (`KVF_OUT_OF_BOUNDS`,
/// `KVF_NOT_FOUND`, `KVF_INVALID_ARGUMENT`).
///
/// # Safety
/// `agent` is a live agent; `peer` a string; `local` and `remote` valid for `n` reads;
/// `notify` for `notify_len`; `op_out` for one write.
#[no_mangle]
pub unsafe extern "C" fn kvf_agent_transfer(
    agent: *const kvf_agent,
    op: u32,
    peer: *const c_char,
    local: *const kvf_desc,
    remote: *const kvf_desc,
    n: usize,
    notify: *const u8,
    notify_len: usize,
    flags: u32,
    timeout_ms: u32,
    op_out: *mut *mut kvf_op,
) -> kvf_result {
    // SAFETY: the caller's contract.
    let agent = unsafe { agent.as_ref() };
    recorded(agent, "agent", |a| {
        // SAFETY: as above.
        let out = unsafe { Out::new(op_out, "op_out") }?;
        // SAFETY: as above.
        let peer = unsafe { ptr::cstr(peer, "peer") }?;
        // SAFETY: as above.
        let local = unsafe { ptr::slice(local, n, "local") }?;
        // SAFETY: as above.
        let remote = unsafe { ptr::slice(remote, n, "remote") }?;
        // SAFETY: as above.
        let notify = unsafe { ptr::slice(notify, notify_len, "notify") }?;
        let op = match op {
            KVF_OP_READ => TransferOp::Read,
            KVF_OP_WRITE => TransferOp::Write,
            o => return Err(FfiError::invalid(format!("unknown transfer op {o}"))),
        };
        if flags & !KVF_TRANSFER_CHECKSUM != 0 {
            return Err(FfiError::invalid(format!("unknown transfer flags {flags:#x}")));
        }
        let desc = |d: &kvf_desc| Desc::new(RegionId(d.region), d.offset, d.len);
        let mut req = TransferRequest::new(
            op,
            peer,
            local.iter().map(desc).collect(),
            remote.iter().map(desc).collect(),
        );
        if notify_len > 0 {
            req = req.with_notify(notify.to_vec());
        }
        if flags & KVF_TRANSFER_CHECKSUM != 0 {
            req = req.with_checksum();
        }
        if timeout_ms > 0 {
            req = req.with_deadline(Duration::from_millis(u64::from(timeout_ms)));
        }
        let bytes = req.bytes();
        let _entered = a.ctx.rt().enter();
        let handle = a.ctx.agent.post(req)?;
        let op = kvf_op::spawn(a.ctx.rt().handle(), Vec::new(), async move {
            handle.wait().await?;
            Ok(bytes)
        });
        out.set(ptr::into_raw(op));
        Ok(())
    })
}

/// Waits up to `timeout_ms` (`KVF_WAIT_FOREVER`: no limit) for the next notification from a
/// peer: its sender's name (NUL-terminated) into `from`, its message into `msg`, their
/// lengths into `*from_len` (NUL included) and `*msg_len`. `KVF_TIMED_OUT` if none came;
/// `KVF_BUFFER_TOO_SMALL` writes both sizes needed and keeps the notification for the next
/// call. Thread-safe; one notification goes to one caller.
///
/// # Safety
/// `agent` is a live agent; `from` valid for `from_cap` writes, `msg` for `msg_cap`;
/// `from_len` and `msg_len` for one write each.
#[no_mangle]
pub unsafe extern "C" fn kvf_agent_wait_notification(
    agent: *const kvf_agent,
    timeout_ms: u32,
    from: *mut c_char,
    from_cap: usize,
    from_len: *mut usize,
    msg: *mut u8,
    msg_cap: usize,
    msg_len: *mut usize,
) -> kvf_result {
    // SAFETY: the caller's contract.
    let agent = unsafe { agent.as_ref() };
    recorded(agent, "agent", |a| {
        // SAFETY: as above; c_char and u8 have the same size and alignment.
        let from = unsafe { OutBuf::new(from.cast::<u8>(), from_cap, "from") }?;
        // SAFETY: as above.
        let from_len = unsafe { Out::new(from_len, "from_len") }?;
        // SAFETY: as above.
        let msg = unsafe { OutBuf::new(msg, msg_cap, "msg") }?;
        // SAFETY: as above.
        let msg_len = unsafe { Out::new(msg_len, "msg_len") }?;
        let pending = a.ctx.pending.lock().take();
        let n = match pending {
            Some(n) => n,
            None => {
                let agent = &a.ctx.agent;
                let next = async {
                    match timeout_of(timeout_ms) {
                        Some(t) => {
                            tokio::time::timeout(t, agent.next_notification()).await.ok().flatten()
                        }
                        None => agent.next_notification().await,
                    }
                };
                a.ctx.rt().block_on(next).ok_or_else(|| {
                    FfiError::new(kvf_result::KVF_TIMED_OUT, "no notification arrived in time")
                })?
            }
        };
        let mut name = n.from.as_bytes().to_vec();
        name.push(0);
        if name.len() > from.cap() || n.message.len() > msg.cap() {
            from_len.set(name.len());
            msg_len.set(n.message.len());
            let e = FfiError::new(
                kvf_result::KVF_BUFFER_TOO_SMALL,
                format!(
                    "notification needs {} and {} bytes; kept for the next call",
                    name.len(),
                    n.message.len()
                ),
            );
            *a.ctx.pending.lock() = Some(n);
            return Err(e);
        }
        from.write(&name);
        msg.write(&n.message);
        from_len.set(name.len());
        msg_len.set(n.message.len());
        Ok(())
    })
}

/// kvfabric's own log, on the host process's stderr: warnings by default (each cause is logged
/// once when it starts, once when it ends), `KVFABRIC_LOG` to choose (`off`, `debug`,
/// `kvfabric=debug`, any tracing filter). Installed once per process, by the first agent,
/// unless the process already has a tracing subscriber.
fn init_logging() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let filter = std::env::var("KVFABRIC_LOG").unwrap_or_else(|_| "warn".to_string());
        let filter = tracing_subscriber::EnvFilter::try_new(&filter)
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .with_target(true)
            .try_init();
    });
}
