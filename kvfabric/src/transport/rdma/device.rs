//! Owned verbs objects: an opened device with its protection domain, memory registrations,
//! a completion queue and reliable-connected queue pairs. Each is released when dropped.

use std::ffi::{c_void, CStr};
use std::sync::Arc;

use super::exchange::QpAddr;
use super::verbs::{
    self, consts, IbvCq, IbvMr, IbvQp, IbvQpAttr, IbvQpInitAttr, IbvWc, Unavailable, Verbs,
};

/// Scatter/gather entries per work request at most.
const SGE_MAX: i32 = 8;
/// Receive queue depth of every queue pair (the notification mailbox's slots at most).
pub const RECV_DEPTH: u32 = 16;

/// Why a verbs call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{call}: {reason}")]
pub struct VerbsError {
    /// The call.
    pub call: &'static str,
    /// errno's text.
    pub reason: String,
}

fn errno(call: &'static str) -> VerbsError {
    VerbsError { call, reason: std::io::Error::last_os_error().to_string() }
}

fn rc(call: &'static str, rc: i32) -> Result<(), VerbsError> {
    match rc {
        0 => Ok(()),
        // Verbs calls return an errno, or -1 with errno set.
        n if n > 0 => {
            Err(VerbsError { call, reason: std::io::Error::from_raw_os_error(n).to_string() })
        }
        _ => Err(errno(call)),
    }
}

/// What peers may do to a registration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Nothing: local use only.
    Local,
    /// RDMA WRITE (a mailbox).
    RemoteWrite,
    /// RDMA READ and WRITE (exported regions).
    RemoteReadWrite,
}

impl Access {
    /// The registration's access flags: local writes, and what peers may do.
    fn flags(self) -> i32 {
        let local = consts::ACCESS_LOCAL_WRITE | consts::ACCESS_RELAXED_ORDERING;
        match self {
            Access::Local => local,
            Access::RemoteWrite => local | consts::ACCESS_REMOTE_WRITE,
            Access::RemoteReadWrite => {
                local | consts::ACCESS_REMOTE_READ | consts::ACCESS_REMOTE_WRITE
            }
        }
    }
}

/// What the transport needs to know of the device and port it uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// The device's name (`mlx5_0`).
    pub name: String,
    /// The port (1-based).
    pub port: u8,
    /// InfiniBand or Ethernet (RoCE).
    pub link_layer: &'static str,
    /// The port's LID (InfiniBand).
    pub lid: u16,
    /// GID index used.
    pub gid_index: u8,
    /// That GID.
    pub gid: [u8; 16],
    /// Active MTU, as verbs numbers it (1..=5).
    pub mtu: u8,
    /// Largest message, bytes.
    pub max_msg_bytes: u64,
    /// Entries per work request.
    pub max_sge: u32,
    /// Deepest send queue.
    pub max_qp_wr: u32,
    /// Deepest completion queue.
    pub max_cqe: u32,
    /// Outstanding RDMA READs a queue pair may initiate / answer.
    pub max_rd_atomic: u8,
}

/// An open device with its protection domain.
#[derive(Debug)]
pub struct Device {
    v: &'static Verbs,
    ctx: *mut verbs::IbvContext,
    pd: *mut c_void,
    info: DeviceInfo,
    /// Traffic class (RoCE) and service level of its queue pairs.
    traffic: (u8, u8),
}

// SAFETY: verbs objects may be used from any thread (libibverbs serializes where it must).
unsafe impl Send for Device {}
// SAFETY: as above.
unsafe impl Sync for Device {}

/// The names of the RDMA devices on this host (empty without any; why not where verbs are
/// not installed).
pub fn device_names() -> Result<Vec<String>, Unavailable> {
    let v = verbs::verbs()?;
    let mut n = 0;
    // SAFETY: the library's list, read while it lives and freed right after.
    unsafe {
        let list = (v.get_device_list)(&mut n);
        if list.is_null() {
            return Ok(Vec::new());
        }
        let names = (0..n.max(0) as usize)
            .map(|i| {
                CStr::from_ptr((v.get_device_name)(*list.add(i))).to_string_lossy().into_owned()
            })
            .collect();
        (v.free_device_list)(list);
        Ok(names)
    }
}

/// The verbs that serve the device `name`: the library's, or in this crate's tests the
/// in-process double's for [`super::fake::DEVICE`].
fn verbs_for(name: Option<&str>) -> Result<&'static Verbs, Unavailable> {
    #[cfg(test)]
    if name == Some(super::fake::DEVICE) {
        return Ok(super::fake::verbs());
    }
    let _ = name;
    verbs::verbs()
}

/// Where to find a device and how to address it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpenOptions<'a> {
    /// The device (None: the first with an active port).
    pub name: Option<&'a str>,
    /// The GID index on RoCE ports (None: the first RoCE v2 GID that maps an IPv4 address,
    /// else the first RoCE v2 GID, else the first non-zero one).
    pub gid_index: Option<u8>,
    /// Traffic class of RoCE packets (the DSCP a lossless fabric expects, shifted left 2).
    pub traffic_class: u8,
    /// InfiniBand service level.
    pub service_level: u8,
}

/// A port that can carry traffic.
struct ActivePort {
    port: u8,
    attr: verbs::IbvPortAttr,
    gid_index: u8,
    gid: [u8; 16],
}

/// The first active port of an open context with a usable GID; why not.
///
/// # Safety
/// `ctx` must be an open context.
unsafe fn active_port(
    v: &Verbs,
    ctx: *mut verbs::IbvContext,
    name: &str,
    ports: u8,
    gid_index: Option<u8>,
) -> Result<ActivePort, String> {
    let mut why = format!("{name}: no active port");
    for p in 1..=ports.max(1) {
        let mut pa = verbs::IbvPortAttr::default();
        // SAFETY: an open context (the caller's); the structure is zeroed and the library
        // fills its compatible prefix (what `verbs.h`'s inline wrapper does too).
        if unsafe { (v.query_port)(ctx, p, &mut pa) } != 0 || pa.state != consts::PORT_ACTIVE {
            continue;
        }
        let ethernet = pa.link_layer == consts::LINK_LAYER_ETHERNET;
        let gid_at = |i: u8| -> Option<[u8; 16]> {
            let mut gid = [0u8; 16];
            // SAFETY: an open context and a 16-byte GID buffer.
            let ok = unsafe { (v.query_gid)(ctx, p, i32::from(i), &mut gid) } == 0;
            (ok && gid != [0; 16]).then_some(gid)
        };
        if !ethernet && pa.lid != 0 {
            // InfiniBand with a LID: the GID is only used across subnets.
            let gid_index = gid_index.unwrap_or(0);
            return Ok(ActivePort {
                port: p,
                attr: pa,
                gid_index,
                gid: gid_at(gid_index).unwrap_or([0; 16]),
            });
        }
        let chosen = match gid_index {
            Some(i) => gid_at(i).map(|g| (i, g)),
            None => {
                let table = pa.gid_tbl_len.clamp(0, 256) as usize;
                let roce_v2 = |i: usize| {
                    std::fs::read_to_string(format!(
                        "/sys/class/infiniband/{name}/ports/{p}/gid_attrs/types/{i}"
                    ))
                    .is_ok_and(|t| t.trim().eq_ignore_ascii_case("RoCE v2"))
                };
                let v4_mapped = |g: &[u8; 16]| g[..10] == [0; 10] && g[10..12] == [0xff, 0xff];
                let gids: Vec<(u8, [u8; 16], bool)> = (0..table)
                    .filter_map(|i| gid_at(i as u8).map(|g| (i as u8, g, roce_v2(i))))
                    .collect();
                gids.iter()
                    .find(|(_, g, v2)| *v2 && v4_mapped(g))
                    .or_else(|| gids.iter().find(|(_, _, v2)| *v2))
                    .or_else(|| gids.first())
                    .map(|&(i, g, _)| (i, g))
            }
        };
        match chosen {
            Some((gid_index, gid)) => return Ok(ActivePort { port: p, attr: pa, gid_index, gid }),
            None => why = format!("{name} port {p}: no usable GID (index {gid_index:?})"),
        }
    }
    Err(why)
}

impl Device {
    /// Opens the device `opts` names, or the first with an active port and a usable GID.
    pub fn open(opts: OpenOptions<'_>) -> Result<Arc<Device>, Unavailable> {
        let v = verbs_for(opts.name)?;
        let mut n = 0;
        let mut tried = Vec::new();
        // SAFETY: the list is read while it lives; a chosen device is opened before it is
        // freed (an open context does not need the list); contexts not chosen are closed.
        let found = unsafe {
            let list = (v.get_device_list)(&mut n);
            if list.is_null() || n <= 0 {
                if !list.is_null() {
                    (v.free_device_list)(list);
                }
                return Err(Unavailable(
                    "no RDMA device on this host (ibv_get_device_list found none)".into(),
                ));
            }
            let mut found = None;
            for i in 0..n as usize {
                let d = *list.add(i);
                let dn = CStr::from_ptr((v.get_device_name)(d)).to_string_lossy().into_owned();
                if opts.name.is_some_and(|want| want != dn) {
                    continue;
                }
                let ctx = (v.open_device)(d);
                if ctx.is_null() {
                    tried.push(format!("{dn}: cannot be opened"));
                    continue;
                }
                let mut attr = verbs::IbvDeviceAttr::default();
                if (v.query_device)(ctx, &mut attr) != 0 {
                    tried.push(format!("{dn}: ibv_query_device failed"));
                    (v.close_device)(ctx);
                    continue;
                }
                match active_port(v, ctx, &dn, attr.phys_port_cnt, opts.gid_index) {
                    Ok(port) => {
                        found = Some((ctx, dn, attr, port));
                        break;
                    }
                    Err(why) => {
                        tried.push(why);
                        (v.close_device)(ctx);
                    }
                }
            }
            (v.free_device_list)(list);
            found
        };
        let Some((ctx, dev_name, attr, port)) = found else {
            return Err(Unavailable(match (opts.name, tried.is_empty()) {
                (Some(want), true) => format!("RDMA device {want:?} not found"),
                _ => format!("no usable RDMA device: {}", tried.join("; ")),
            }));
        };
        // SAFETY: the context opened above.
        let pd = unsafe { (v.alloc_pd)(ctx) };
        if pd.is_null() {
            // SAFETY: as above, not used after.
            unsafe { (v.close_device)(ctx) };
            return Err(Unavailable(format!("{dev_name}: ibv_alloc_pd failed")));
        }
        let pa = port.attr;
        let info = DeviceInfo {
            name: dev_name,
            port: port.port,
            link_layer: if pa.link_layer == consts::LINK_LAYER_ETHERNET {
                "ethernet"
            } else {
                "infiniband"
            },
            lid: pa.lid,
            gid_index: port.gid_index,
            gid: port.gid,
            mtu: (pa.active_mtu as u8).clamp(1, 5),
            max_msg_bytes: u64::from(pa.max_msg_sz).max(1),
            // Few entries per request: every send queue slot is sized for the most (704
            // bytes at 30 on ConnectX), and a READ's are bounded by max_sge_rd.
            max_sge: attr.max_sge.min(attr.max_sge_rd).clamp(1, SGE_MAX) as u32,
            max_qp_wr: attr.max_qp_wr.max(1) as u32,
            max_cqe: attr.max_cqe.max(1) as u32,
            max_rd_atomic: attr.max_qp_rd_atom.min(attr.max_qp_init_rd_atom).clamp(1, 255) as u8,
        };
        Ok(Arc::new(Device { v, ctx, pd, info, traffic: (opts.traffic_class, opts.service_level) }))
    }

    /// The next asynchronous event (a queue pair or completion queue in error, a port going
    /// down), waiting at most `timeout`: its name and, for queue pair events, the queue pair
    /// number. Every event read is acknowledged (destroying a queue pair waits for that).
    pub fn async_event(&self, timeout: std::time::Duration) -> Option<(&'static str, Option<u32>)> {
        // SAFETY: our open context's async fd, polled for reading.
        let fd = unsafe { (*self.ctx).async_fd };
        let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd.
        let ready = unsafe { libc::poll(&mut pfd, 1, timeout.as_millis().min(60_000) as i32) };
        if ready <= 0 {
            return None;
        }
        let mut ev = verbs::IbvAsyncEvent::default();
        // SAFETY: the fd is readable, so this does not block; the event is acknowledged once.
        unsafe {
            if (self.v.get_async_event)(self.ctx, &mut ev) != 0 {
                return None;
            }
            let qp = match ev.event_type {
                1..=7 | 16 => (!ev.element.is_null()).then(|| (*(ev.element as *mut IbvQp)).qp_num),
                _ => None,
            };
            (self.v.ack_async_event)(&mut ev);
            Some((verbs::async_event_name(ev.event_type), qp))
        }
    }

    /// What was found.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// Registers `len` bytes at `addr` for local access and what `remote` allows peers
    /// (memory not exported gets no remote access, so a peer that guesses a key still cannot
    /// touch it).
    ///
    /// # Safety
    /// The memory must stay allocated until the registration is dropped.
    pub unsafe fn register(
        self: &Arc<Self>,
        addr: *mut u8,
        len: usize,
        remote: Access,
    ) -> Result<Mr, VerbsError> {
        // SAFETY: the caller keeps the memory; the protection domain is ours.
        let mr = unsafe { (self.v.reg_mr)(self.pd, addr.cast(), len, remote.flags()) };
        if mr.is_null() {
            return Err(errno("ibv_reg_mr"));
        }
        Ok(Mr { dev: self.clone(), mr })
    }

    /// Whether the library can register dma-bufs (rdma-core 34 and later).
    pub fn has_dmabuf(&self) -> bool {
        self.v.reg_dmabuf_mr.is_some()
    }

    /// Registers `len` bytes at `offset` into a dma-buf (GPU memory its driver exported),
    /// addressed as `iova` by work requests and peers. The registration holds its own
    /// reference to the buffer: `fd` may be closed afterwards.
    ///
    /// # Safety
    /// The memory behind the dma-buf must stay allocated until the registration is dropped.
    pub unsafe fn register_dmabuf(
        self: &Arc<Self>,
        fd: std::os::fd::BorrowedFd<'_>,
        offset: u64,
        len: usize,
        iova: u64,
        remote: Access,
    ) -> Result<Mr, VerbsError> {
        use std::os::fd::AsRawFd;
        let Some(reg) = self.v.reg_dmabuf_mr else {
            return Err(VerbsError {
                call: "ibv_reg_dmabuf_mr",
                reason: "this libibverbs predates it (rdma-core 34)".into(),
            });
        };
        // SAFETY: a live descriptor; the caller keeps the memory; the domain is ours.
        let mr = unsafe { reg(self.pd, offset, len, iova, fd.as_raw_fd(), remote.flags()) };
        if mr.is_null() {
            return Err(errno("ibv_reg_dmabuf_mr"));
        }
        Ok(Mr { dev: self.clone(), mr })
    }

    /// A completion queue of `entries`.
    pub fn completion_queue(self: &Arc<Self>, entries: u32) -> Result<Cq, VerbsError> {
        let n = entries.clamp(1, self.info.max_cqe) as i32;
        // A completion channel lets an idle poller sleep until the adapter has news; without
        // one (it could not be made) the queue is only polled.
        // SAFETY: an open context.
        let channel = unsafe { (self.v.create_comp_channel)(self.ctx) };
        if channel.is_null() {
            tracing::warn!(device = %self.info.name, error = %errno("ibv_create_comp_channel"), "RDMA: no completion channel; the completion queue is polled");
        } else {
            // Non-blocking: a read that finds no event (another reader took it) returns
            // EAGAIN instead of blocking the completion thread past its stop flag.
            // SAFETY: the channel's own fd; F_GETFL/F_SETFL take and return plain flags.
            unsafe {
                let fd = (*channel).fd;
                let flags = libc::fcntl(fd, libc::F_GETFL);
                if flags >= 0 {
                    libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK);
                }
            }
        }
        // SAFETY: an open context; the channel is ours (or null).
        let cq =
            unsafe { (self.v.create_cq)(self.ctx, n, std::ptr::null_mut(), channel.cast(), 0) };
        if cq.is_null() {
            let e = errno("ibv_create_cq");
            if !channel.is_null() {
                // SAFETY: ours, with no queue on it.
                unsafe { (self.v.destroy_comp_channel)(channel) };
            }
            return Err(e);
        }
        Ok(Cq { dev: self.clone(), cq, channel })
    }

    /// A reliable-connected queue pair on `cq`, in INIT, with a send queue of `depth` requests
    /// of `max_sge` entries, and a first packet sequence number.
    pub fn queue_pair(
        self: &Arc<Self>,
        cq: &Arc<Cq>,
        depth: u32,
        psn: u32,
    ) -> Result<Qp, VerbsError> {
        let mut init = IbvQpInitAttr {
            qp_context: std::ptr::null_mut(),
            send_cq: cq.cq,
            recv_cq: cq.cq,
            srq: std::ptr::null_mut(),
            cap: verbs::IbvQpCap {
                max_send_wr: depth.clamp(1, self.info.max_qp_wr),
                // Receives for notifications (WRITEs with immediate data) on the first one.
                max_recv_wr: RECV_DEPTH,
                max_send_sge: self.info.max_sge,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            qp_type: consts::QPT_RC,
            sq_sig_all: 0,
        };
        // SAFETY: our protection domain and completion queue, a filled structure.
        let qp = unsafe { (self.v.create_qp)(self.pd, &mut init) };
        if qp.is_null() {
            return Err(errno("ibv_create_qp"));
        }
        let qp = Qp {
            dev: self.clone(),
            _cq: cq.clone(),
            qp,
            psn: psn & 0xff_ffff,
            depth: init.cap.max_send_wr,
        };
        let mut a = IbvQpAttr {
            qp_state: consts::QPS_INIT,
            pkey_index: 0,
            port_num: self.info.port,
            qp_access_flags: (consts::ACCESS_LOCAL_WRITE
                | consts::ACCESS_REMOTE_READ
                | consts::ACCESS_REMOTE_WRITE) as u32,
            ..Default::default()
        };
        qp.modify(
            &mut a,
            consts::QP_STATE | consts::QP_PKEY_INDEX | consts::QP_PORT | consts::QP_ACCESS_FLAGS,
        )?;
        Ok(qp)
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: every registration, queue and queue pair holds an Arc of this device, so
        // none is left; the domain and the context are ours.
        unsafe {
            (self.v.dealloc_pd)(self.pd);
            (self.v.close_device)(self.ctx);
        }
    }
}

/// A memory registration.
#[derive(Debug)]
pub struct Mr {
    dev: Arc<Device>,
    mr: *mut IbvMr,
}

// SAFETY: a registration is plain data once made; deregistration is thread-safe.
unsafe impl Send for Mr {}
// SAFETY: as above.
unsafe impl Sync for Mr {}

impl Mr {
    /// Local key.
    pub fn lkey(&self) -> u32 {
        // SAFETY: a live registration.
        unsafe { (*self.mr).lkey }
    }
    /// Remote key.
    pub fn rkey(&self) -> u32 {
        // SAFETY: a live registration.
        unsafe { (*self.mr).rkey }
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: ours, registered once, deregistered once.
        unsafe { (self.dev.v.dereg_mr)(self.mr) };
    }
}

/// The `call` of [`Cq::wait`]'s error when the device is gone.
pub const CHANNEL_GONE: &str = "ibv_comp_channel";

/// A completion queue.
#[derive(Debug)]
pub struct Cq {
    dev: Arc<Device>,
    cq: *mut IbvCq,
    /// Its completion channel (null: none, the queue is only polled).
    channel: *mut verbs::IbvCompChannel,
}

// SAFETY: polling is thread-safe in libibverbs providers (they lock the queue).
unsafe impl Send for Cq {}
// SAFETY: as above.
unsafe impl Sync for Cq {}

impl Cq {
    /// Up to `wc.len()` completions; how many.
    pub fn poll(&self, wc: &mut [IbvWc]) -> Result<usize, VerbsError> {
        // SAFETY: a live queue.
        let n = unsafe { verbs::poll_cq(self.cq, wc) };
        if n < 0 {
            return Err(VerbsError { call: "ibv_poll_cq", reason: format!("returned {n}") });
        }
        Ok(n as usize)
    }

    /// Whether it has a completion channel to [`Cq::wait`] on.
    pub fn has_channel(&self) -> bool {
        !self.channel.is_null()
    }

    /// The queue's address (the software device's tests name queues by it).
    #[cfg(test)]
    pub(crate) fn raw(&self) -> usize {
        self.cq as usize
    }

    /// The completion channel's fd (tests break it).
    #[cfg(test)]
    pub(crate) fn channel_fd(&self) -> Option<std::os::fd::RawFd> {
        // SAFETY: a live channel.
        (!self.channel.is_null()).then(|| unsafe { (*self.channel).fd })
    }

    /// Asks for an event on the channel at the next completion (once). Completions that came
    /// before the call raise none: poll again after it, before waiting.
    pub fn arm(&self) -> Result<(), VerbsError> {
        // SAFETY: a live queue.
        rc("ibv_req_notify_cq", unsafe { verbs::req_notify_cq(self.cq, false) })
    }

    /// Waits up to `timeout` for the event [`Cq::arm`] asked for; whether it came (it is then
    /// consumed and acknowledged). Without a channel, sleeps `timeout`.
    pub fn wait(&self, timeout: std::time::Duration) -> Result<bool, VerbsError> {
        if self.channel.is_null() {
            std::thread::sleep(timeout);
            return Ok(false);
        }
        // SAFETY: a live channel.
        let fd = unsafe { (*self.channel).fd };
        let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: one valid pollfd for the call.
        let n = unsafe { libc::poll(&mut pfd, 1, ms) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                return Ok(false);
            }
            return Err(VerbsError { call: "poll", reason: e.to_string() });
        }
        if n == 0 {
            return Ok(false);
        }
        if pfd.revents & libc::POLLNVAL != 0 {
            // Our fd is not open (a bug here, not the device): poll would return at once
            // forever.
            return Err(VerbsError {
                call: "poll",
                reason: "completion channel fd not open".into(),
            });
        }
        if pfd.revents & (libc::POLLERR | libc::POLLHUP) != 0 {
            // The kernel closed the event queue: the device was disassociated (removed, or
            // a fatal error). No completion comes any more.
            return Err(VerbsError {
                call: CHANNEL_GONE,
                reason: format!("the device is gone (channel revents {:#x})", pfd.revents),
            });
        }
        if pfd.revents & libc::POLLIN == 0 {
            return Ok(false);
        }
        let (mut cq, mut ctx): (*mut IbvCq, *mut c_void) =
            (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: a live channel, non-blocking; out-parameters on the stack.
        let got = unsafe { (self.dev.v.get_cq_event)(self.channel, &mut cq, &mut ctx) };
        if got != 0 {
            let e = std::io::Error::last_os_error();
            if got < 0 && e.kind() == std::io::ErrorKind::WouldBlock {
                return Ok(false); // read by another waiter first
            }
            let e = if got > 0 { std::io::Error::from_raw_os_error(got) } else { e };
            return Err(VerbsError { call: "ibv_get_cq_event", reason: e.to_string() });
        }
        if !cq.is_null() {
            // Every event is acknowledged before the queue can be destroyed.
            // SAFETY: the queue the event came from (ours: one queue per channel).
            unsafe { (self.dev.v.ack_cq_events)(cq, 1) };
        }
        Ok(true)
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: every queue pair on it holds an Arc of it, so none is left; its events were
        // acknowledged as they were read.
        unsafe { (self.dev.v.destroy_cq)(self.cq) };
        if !self.channel.is_null() {
            // SAFETY: ours, its only queue destroyed just above.
            unsafe { (self.dev.v.destroy_comp_channel)(self.channel) };
        }
    }
}

/// A reliable-connected queue pair.
#[derive(Debug)]
pub struct Qp {
    dev: Arc<Device>,
    _cq: Arc<Cq>,
    qp: *mut IbvQp,
    psn: u32,
    depth: u32,
}

// SAFETY: posting is thread-safe in libibverbs providers (mlx5 locks the send queue unless
// MLX5_SINGLE_THREADED is set, which kvfabric must not run under: transfers post to one queue
// pair from several threads).
unsafe impl Send for Qp {}
// SAFETY: as above.
unsafe impl Sync for Qp {}

impl Qp {
    fn modify(&self, a: &mut IbvQpAttr, mask: i32) -> Result<(), VerbsError> {
        // SAFETY: a live queue pair and a filled attribute structure.
        rc("ibv_modify_qp", unsafe { (self.dev.v.modify_qp)(self.qp, a, mask) })
    }

    /// Its address, for the peer.
    pub fn addr(&self) -> QpAddr {
        let i = &self.dev.info;
        // SAFETY: a live queue pair.
        let qpn = unsafe { (*self.qp).qp_num };
        QpAddr {
            lid: i.lid,
            gid: i.gid,
            qpn,
            psn: self.psn,
            mtu: i.mtu,
            rd_atomic: i.max_rd_atomic,
        }
    }

    /// Its send queue's depth.
    pub fn depth(&self) -> u32 {
        self.depth
    }

    /// Connects it to the peer's queue pair `remote`: INIT → RTR → RTS.
    pub fn connect(&self, remote: &QpAddr) -> Result<(), VerbsError> {
        let i = &self.dev.info;
        let global = i.link_layer == "ethernet" || remote.lid == 0;
        let mut a = IbvQpAttr {
            qp_state: consts::QPS_RTR,
            path_mtu: u32::from(remote.mtu.min(i.mtu)),
            dest_qp_num: remote.qpn,
            rq_psn: remote.psn,
            // READs we answer: what our adapter can.
            max_dest_rd_atomic: i.max_rd_atomic,
            min_rnr_timer: 12,
            ah_attr: verbs::IbvAhAttr {
                grh: verbs::IbvGlobalRoute {
                    dgid: remote.gid,
                    flow_label: 0,
                    sgid_index: i.gid_index,
                    hop_limit: if global { 64 } else { 0 },
                    traffic_class: self.dev.traffic.0,
                },
                dlid: remote.lid,
                sl: self.dev.traffic.1,
                src_path_bits: 0,
                static_rate: 0,
                is_global: u8::from(global),
                port_num: i.port,
            },
            ..Default::default()
        };
        self.modify(
            &mut a,
            consts::QP_STATE
                | consts::QP_AV
                | consts::QP_PATH_MTU
                | consts::QP_DEST_QPN
                | consts::QP_RQ_PSN
                | consts::QP_MAX_DEST_RD_ATOMIC
                | consts::QP_MIN_RNR_TIMER,
        )?;
        let mut a = IbvQpAttr {
            qp_state: consts::QPS_RTS,
            // 4.096 µs × 2^14 ≈ 67 ms per wait (1–4 waits per try by the spec), 7 tries: a
            // dead peer fails work in 0.5–2 s.
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            sq_psn: self.psn,
            // READs we initiate: no more than the peer answers.
            max_rd_atomic: i.max_rd_atomic.min(remote.rd_atomic),
            ..Default::default()
        };
        self.modify(
            &mut a,
            consts::QP_STATE
                | consts::QP_TIMEOUT
                | consts::QP_RETRY_CNT
                | consts::QP_RNR_RETRY
                | consts::QP_SQ_PSN
                | consts::QP_MAX_QP_RD_ATOMIC,
        )
    }

    /// Posts one receive without entries per id (each consumed by a WRITE with immediate
    /// data from the peer).
    pub fn post_receives(&self, ids: &[u64]) -> Result<(), VerbsError> {
        let mut wrs: Vec<verbs::IbvRecvWr> = ids
            .iter()
            .map(|&wr_id| verbs::IbvRecvWr {
                wr_id,
                next: std::ptr::null_mut(),
                sg_list: std::ptr::null_mut(),
                num_sge: 0,
            })
            .collect();
        if wrs.is_empty() {
            return Ok(());
        }
        let base = wrs.as_mut_ptr();
        for k in 1..wrs.len() {
            // SAFETY: k - 1 and k are inside `wrs`, which is not resized after this.
            unsafe { (*base.add(k - 1)).next = base.add(k) };
        }
        // SAFETY: a live queue pair and a linked, null-terminated chain without entries.
        unsafe { verbs::post_recv(self.qp, base) }.map_err(|code| VerbsError {
            call: "ibv_post_recv",
            reason: std::io::Error::from_raw_os_error(code.abs()).to_string(),
        })
    }

    /// Moves it to the error state: its outstanding work is flushed (each request completes
    /// with a flush error) and no byte moves after.
    pub fn fail(&self) -> Result<(), VerbsError> {
        let mut a = IbvQpAttr { qp_state: consts::QPS_ERR, ..Default::default() };
        self.modify(&mut a, consts::QP_STATE)
    }

    /// Posts a chain of work requests.
    ///
    /// # Safety
    /// The chain must be well formed (`next` links end in null; entries valid for the call)
    /// and every byte it names registered, alive and not otherwise written until the
    /// requests complete.
    /// On failure, the error and the first request not posted (those before it were).
    pub unsafe fn post(
        &self,
        first: *mut verbs::IbvSendWr,
    ) -> Result<(), (VerbsError, *mut verbs::IbvSendWr)> {
        // SAFETY: as the caller guarantees.
        match unsafe { verbs::post_send(self.qp, first) } {
            Ok(()) => Ok(()),
            Err((code, bad)) => Err((
                VerbsError {
                    call: "ibv_post_send",
                    reason: std::io::Error::from_raw_os_error(code.abs()).to_string(),
                },
                bad,
            )),
        }
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        // SAFETY: ours; destroyed once. The transport drops a queue pair only once its work
        // completed or was flushed.
        unsafe { (self.dev.v.destroy_qp)(self.qp) };
    }
}
