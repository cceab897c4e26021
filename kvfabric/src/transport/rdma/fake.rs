//! A software RDMA device for this crate's tests: a [`Verbs`] table of Rust functions that
//! behave as libibverbs does for one reliable-connected adapter in this process. The whole
//! transport runs against it unchanged: device and port queries, memory registration with
//! keys and access flags, queue pairs whose state transitions check the attribute masks RC
//! requires, `post_send` through the context's operation table (RDMA WRITE and READ as
//! copies between registered ranges of this process, key and bounds checks, a send queue of
//! bounded depth that takes a chain only in part when full), completions through `poll_cq`,
//! flushes of a queue pair in error, and retries exhausted toward a destroyed queue pair.
//! A WRITE with immediate data needs a receive posted at its peer, as on an adapter: one that
//! finds none lands nothing (a one-packet WRITE answered RNR, retried by the requester with
//! `rnr_retry` 7, that is, until a receive comes) and what its queue pair holds behind it
//! waits with it.
//!
//! What it cannot prove: anything about real adapters and wires. Work completes when it is
//! posted (unless the test holds it or it waits for a receive), so the timing, ordering
//! across queue pairs, PCIe and the adapter's own limits are not exercised;
//! `scripts/rdma-check.sh` is for that.

use std::collections::{HashMap, VecDeque};
use std::ffi::{c_char, c_int, c_void};
use std::sync::OnceLock;

use parking_lot::Mutex;

use super::verbs::{
    consts, IbvAsyncEvent, IbvCompChannel, IbvContext, IbvCq, IbvDeviceAttr, IbvMr, IbvPortAttr,
    IbvQp, IbvQpAttr, IbvQpInitAttr, IbvSendWr, IbvWc, Verbs,
};

/// The double's device name.
pub const DEVICE: &str = "kvfabric-fake0";
const DEVICE_C: &std::ffi::CStr = c"kvfabric-fake0";

#[derive(Debug)]
struct MrRec {
    /// The address work requests and peers use for its first byte (the memory's own for
    /// `reg_mr`, the `iova` of `reg_dmabuf_mr`).
    addr: usize,
    len: usize,
    access: c_int,
    /// Where its first byte is in this process.
    host: usize,
    /// The double's own mapping of a dma-buf (address, bytes), unmapped on deregistration.
    mapping: Option<(usize, usize)>,
}

#[derive(Debug)]
struct QpRec {
    cq: usize,
    state: u32,
    dest: u32,
    depth: u32,
    /// Requests taken, and completed as far as polled (they free the send queue).
    taken: u64,
    freed: u64,
    /// Requests held back (the test holds execution).
    held: Vec<Stalled>,
    /// Receives posted, by id.
    receives: VecDeque<u64>,
    /// Requests stalled in order behind the first, a WRITE with immediate data that found no
    /// receive at the peer (answered RNR: nothing of it landed; it is retried when the peer
    /// posts a receive or goes away): their positions, copies and entries.
    rnr: VecDeque<Stalled>,
}

/// A request taken but not executed: its position, a copy, its entries.
type Stalled = (u64, Box<IbvSendWr>, Vec<super::verbs::IbvSge>);

#[derive(Debug, Default)]
struct State {
    mrs: HashMap<u32, MrRec>,
    qps: HashMap<u32, QpRec>,
    /// Completions per completion queue, each with its queue pair and position.
    cqs: HashMap<usize, VecDeque<(IbvWc, u32, u64)>>,
    /// Completion queues with a channel: the channel, and whether the next completion
    /// raises an event on it (armed).
    notify: HashMap<usize, (usize, bool)>,
    /// Events raised on each channel, not yet read.
    events: HashMap<usize, VecDeque<usize>>,
    next_key: u32,
    next_qpn: u32,
    hold: bool,
    /// Send queues take at most this many requests, whatever they were created with (a
    /// provider that takes a chain only in part).
    sq_limit: Option<u32>,
    /// Completion queues whose polls fail (their device is gone).
    device_lost: std::collections::HashSet<usize>,
}

fn state() -> &'static Mutex<State> {
    static S: OnceLock<Mutex<State>> = OnceLock::new();
    S.get_or_init(|| Mutex::new(State { next_key: 0x100, next_qpn: 0x40, ..Default::default() }))
}

/// Holds posted work (it is taken, not executed) until [`release`]; a queue pair moved to
/// the error state meanwhile flushes what it holds.
pub fn hold() {
    state().lock().hold = true;
}

/// Makes queue pairs created from now on take at most `n` outstanding requests, whatever
/// their creator asked for (None: what it asked).
pub fn limit_send_queues(n: Option<u32>) {
    state().lock().sq_limit = n;
}

/// Makes completion queue `cq` ([`super::device::Cq::raw`]) fail its polls, as a device
/// that went away, until the returned guard is dropped.
pub fn lose_device(cq: usize) -> impl Drop {
    struct Back(usize);
    impl Drop for Back {
        fn drop(&mut self) {
            state().lock().device_lost.remove(&self.0);
        }
    }
    state().lock().device_lost.insert(cq);
    Back(cq)
}

/// Serializes the tests that use the double's global switches (under `cargo test`, tests of
/// one binary share the process).
pub async fn serial() -> tokio::sync::MutexGuard<'static, ()> {
    static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    SERIAL.lock().await
}

/// Executes the held work and stops holding.
pub fn release() {
    let mut st = state().lock();
    st.hold = false;
    let qpns: Vec<u32> = st.qps.keys().copied().collect();
    for qpn in qpns {
        let held = st.qps.get_mut(&qpn).map(|q| std::mem::take(&mut q.held)).unwrap_or_default();
        for (pos, wr, sges) in held {
            execute(&mut st, qpn, pos, wr, sges);
        }
    }
}

/// The double's table.
pub fn verbs() -> &'static Verbs {
    static V: OnceLock<Verbs> = OnceLock::new();
    V.get_or_init(|| Verbs {
        get_device_list,
        free_device_list,
        get_device_name,
        open_device,
        close_device,
        query_device,
        query_port,
        query_gid,
        alloc_pd,
        dealloc_pd,
        reg_mr,
        dereg_mr,
        reg_dmabuf_mr: Some(reg_dmabuf_mr),
        create_cq,
        destroy_cq,
        create_qp,
        modify_qp,
        destroy_qp,
        get_async_event,
        ack_async_event,
        create_comp_channel,
        destroy_comp_channel,
        get_cq_event,
        ack_cq_events,
    })
}

static DEVICE_TOKEN: u8 = 0;

unsafe extern "C" fn get_device_list(n: *mut c_int) -> *mut *mut c_void {
    let list: Box<[*mut c_void; 2]> =
        Box::new([std::ptr::addr_of!(DEVICE_TOKEN) as *mut c_void, std::ptr::null_mut()]);
    // SAFETY: the caller passes a valid out-pointer (verbs' contract).
    unsafe { *n = 1 };
    Box::into_raw(list).cast()
}

unsafe extern "C" fn free_device_list(list: *mut *mut c_void) {
    // SAFETY: the list from get_device_list, freed once.
    drop(unsafe { Box::from_raw(list.cast::<[*mut c_void; 2]>()) });
}

unsafe extern "C" fn get_device_name(_d: *mut c_void) -> *const c_char {
    DEVICE_C.as_ptr()
}

unsafe extern "C" fn open_device(d: *mut c_void) -> *mut IbvContext {
    let mut ops = [std::ptr::null::<c_void>(); 32];
    ops[super::verbs::OPS_POLL_CQ] = poll_cq as *const c_void;
    ops[super::verbs::OPS_POST_SEND] = post_send as *const c_void;
    ops[super::verbs::OPS_POST_RECV] = post_recv as *const c_void;
    ops[super::verbs::OPS_REQ_NOTIFY_CQ] = req_notify_cq as *const c_void;
    // SAFETY: eventfd with valid flags; never written, so polling it finds no event.
    let async_fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    Box::into_raw(Box::new(IbvContext { device: d, ops, cmd_fd: -1, async_fd }))
}

unsafe extern "C" fn close_device(ctx: *mut IbvContext) -> c_int {
    // SAFETY: the context from open_device, closed once.
    let ctx = unsafe { Box::from_raw(ctx) };
    // SAFETY: our eventfd.
    unsafe { libc::close(ctx.async_fd) };
    0
}

unsafe extern "C" fn query_device(_ctx: *mut IbvContext, a: *mut IbvDeviceAttr) -> c_int {
    // SAFETY: the caller's structure.
    let a = unsafe { &mut *a };
    a.max_mr_size = u64::MAX;
    a.max_qp_wr = 64;
    a.max_sge = 4;
    a.max_sge_rd = 4;
    a.max_cqe = 1 << 16;
    a.max_qp_rd_atom = 16;
    a.max_qp_init_rd_atom = 16;
    a.phys_port_cnt = 1;
    0
}

unsafe extern "C" fn query_port(_ctx: *mut IbvContext, _p: u8, pa: *mut IbvPortAttr) -> c_int {
    // SAFETY: the caller's structure.
    let pa = unsafe { &mut *pa };
    pa.state = consts::PORT_ACTIVE;
    pa.active_mtu = 5;
    pa.max_msg_sz = 1 << 31;
    pa.lid = 7;
    pa.gid_tbl_len = 1;
    pa.link_layer = consts::LINK_LAYER_INFINIBAND;
    0
}

unsafe extern "C" fn query_gid(
    _c: *mut IbvContext,
    _p: u8,
    _i: c_int,
    gid: *mut [u8; 16],
) -> c_int {
    // SAFETY: the caller's 16 bytes.
    unsafe { *gid = [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 7] };
    0
}

unsafe extern "C" fn alloc_pd(ctx: *mut IbvContext) -> *mut c_void {
    Box::into_raw(Box::new(ctx)).cast()
}

unsafe extern "C" fn dealloc_pd(pd: *mut c_void) -> c_int {
    // SAFETY: the domain from alloc_pd, freed once.
    drop(unsafe { Box::from_raw(pd.cast::<*mut IbvContext>()) });
    0
}

unsafe extern "C" fn reg_mr(
    pd: *mut c_void,
    addr: *mut c_void,
    len: usize,
    access: c_int,
) -> *mut IbvMr {
    let mut st = state().lock();
    st.next_key += 1;
    let key = st.next_key;
    st.mrs.insert(
        key,
        MrRec { addr: addr as usize, len, access, host: addr as usize, mapping: None },
    );
    Box::into_raw(Box::new(IbvMr {
        context: std::ptr::null_mut(),
        pd,
        addr,
        length: len,
        handle: key,
        lkey: key,
        rkey: key,
    }))
}

/// A dma-buf's registration: the double maps the descriptor (a memfd standing in for GPU
/// memory, see [`GpuMemory`]) as a driver's dma-buf attachment would give the adapter its
/// pages, and addresses the range as `iova`.
unsafe extern "C" fn reg_dmabuf_mr(
    pd: *mut c_void,
    offset: u64,
    len: usize,
    iova: u64,
    fd: c_int,
    access: c_int,
) -> *mut IbvMr {
    let Some(bytes) = (offset as usize).checked_add(len).filter(|_| len > 0) else {
        // SAFETY: errno is thread-local.
        unsafe { *libc::__errno_location() = libc::EINVAL };
        return std::ptr::null_mut();
    };
    // SAFETY: a shared mapping of a descriptor the caller holds open; the kernel checks it
    // (a file shorter than the range faults only where touched, which the bounds forbid).
    let map = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            bytes,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        )
    };
    if map == libc::MAP_FAILED {
        return std::ptr::null_mut();
    }
    let host = map as usize + offset as usize;
    let mut st = state().lock();
    st.next_key += 1;
    let key = st.next_key;
    let rec =
        MrRec { addr: iova as usize, len, access, host, mapping: Some((map as usize, bytes)) };
    st.mrs.insert(key, rec);
    Box::into_raw(Box::new(IbvMr {
        context: std::ptr::null_mut(),
        pd,
        addr: iova as usize as *mut c_void,
        length: len,
        handle: key,
        lkey: key,
        rkey: key,
    }))
}

unsafe extern "C" fn dereg_mr(mr: *mut IbvMr) -> c_int {
    // SAFETY: the registration from reg_mr or reg_dmabuf_mr, freed once.
    let mr = unsafe { Box::from_raw(mr) };
    let rec = state().lock().mrs.remove(&mr.lkey);
    if let Some((addr, bytes)) = rec.and_then(|r| r.mapping) {
        // SAFETY: the double's own mapping, made at registration; no request uses it now
        // (the transport keeps registrations while its work is out).
        unsafe { libc::munmap(addr as *mut c_void, bytes) };
    }
    0
}

/// Memory standing in for a GPU's, for the transport's GPU paths: its device addresses are a
/// range reserved without access, so that any CPU access through them faults; its bytes are
/// a memfd, which [`dmabuf`] exports as the CUDA driver exports GPU memory as a dma-buf, and
/// which the test reads through a mapping of its own.
///
/// What it cannot prove: that CUDA exports GPU memory this way, and that an adapter reads
/// and writes GPU memory through its dma-buf (PCIe peer-to-peer).
#[derive(Debug)]
pub struct GpuMemory {
    /// Its device address.
    pub addr: u64,
    /// Bytes.
    pub len: usize,
    /// The memfd (the registry names it by number while this value lives).
    _fd: std::os::fd::OwnedFd,
    /// The test's view of the bytes.
    view: *mut u8,
}

// SAFETY: the view is a shared mapping owned by the value; tests read it between transfers.
unsafe impl Send for GpuMemory {}
// SAFETY: as above.
unsafe impl Sync for GpuMemory {}

fn gpus() -> &'static Mutex<Vec<(u64, usize, std::os::fd::RawFd)>> {
    static G: OnceLock<Mutex<Vec<(u64, usize, std::os::fd::RawFd)>>> = OnceLock::new();
    G.get_or_init(Mutex::default)
}

impl GpuMemory {
    /// `len` bytes of zeroes.
    pub fn new(len: usize) -> GpuMemory {
        use std::os::fd::{AsRawFd, FromRawFd};
        // SAFETY: a NUL-terminated name; the descriptor is owned below.
        let fd = unsafe { libc::memfd_create(c"kvfabric-fake-gpu".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
        // SAFETY: a fresh descriptor nothing else owns.
        let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
        // SAFETY: our descriptor.
        assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) }, 0);
        let map = |prot, flags, fd| {
            // SAFETY: a new mapping of `len` bytes, owned by the value.
            let p = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, flags, fd, 0) };
            assert_ne!(p, libc::MAP_FAILED, "mmap: {}", std::io::Error::last_os_error());
            p as *mut u8
        };
        let reserved = map(libc::PROT_NONE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1);
        let view = map(libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd.as_raw_fd());
        gpus().lock().push((reserved as u64, len, fd.as_raw_fd()));
        GpuMemory { addr: reserved as u64, len, _fd: fd, view }
    }

    /// Its bytes now.
    pub fn bytes(&self, offset: usize, len: usize) -> Vec<u8> {
        assert!(offset + len <= self.len);
        // SAFETY: inside the view; nothing writes it during the call (tests read it between
        // transfers).
        unsafe { std::slice::from_raw_parts(self.view.add(offset), len) }.to_vec()
    }

    /// Writes `data` at `offset` (as a kernel on the GPU would).
    pub fn write(&self, offset: usize, data: &[u8]) {
        assert!(offset + data.len() <= self.len);
        // SAFETY: inside the view; no transfer runs on it during the call.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.view.add(offset), data.len()) };
    }
}

impl Drop for GpuMemory {
    fn drop(&mut self) {
        gpus().lock().retain(|g| g.0 != self.addr);
        // SAFETY: the value's own mappings, made in `new`.
        unsafe {
            libc::munmap(self.view.cast(), self.len);
            libc::munmap(self.addr as *mut c_void, self.len);
        }
    }
}

/// The dma-buf of fake GPU memory at `addr..addr+len` (what `Cuda::dmabuf` is for real GPU
/// memory): a duplicate of the memfd, and the range's offset into it.
pub fn dmabuf(addr: u64, len: usize) -> Result<crate::cuda::DmaBuf, String> {
    use std::os::fd::FromRawFd;
    let gpus = gpus().lock();
    let (base, _, fd) = gpus
        .iter()
        .find(|(base, size, _)| {
            addr >= *base && addr.checked_add(len as u64).is_some_and(|e| e <= base + *size as u64)
        })
        .copied()
        .ok_or_else(|| format!("{addr:#x}+{len} is not fake GPU memory"))?;
    // SAFETY: a live descriptor of a registered fake GPU (its value unregisters it before
    // closing it, under this lock).
    let dup = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
    if dup < 0 {
        return Err(std::io::Error::last_os_error().to_string());
    }
    // SAFETY: the duplicate is ours.
    let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(dup) };
    Ok(crate::cuda::DmaBuf { fd, offset: addr - base })
}

unsafe extern "C" fn create_cq(
    ctx: *mut IbvContext,
    _cqe: c_int,
    _c: *mut c_void,
    ch: *mut c_void,
    _v: c_int,
) -> *mut IbvCq {
    let cq = Box::into_raw(Box::new(IbvCq { context: ctx }));
    let mut st = state().lock();
    st.cqs.insert(cq as usize, VecDeque::new());
    if !ch.is_null() {
        st.notify.insert(cq as usize, (ch as usize, false));
    }
    cq
}

unsafe extern "C" fn destroy_cq(cq: *mut IbvCq) -> c_int {
    let mut st = state().lock();
    st.notify.remove(&(cq as usize));
    st.cqs.remove(&(cq as usize));
    drop(st);
    // SAFETY: the queue from create_cq, freed once.
    drop(unsafe { Box::from_raw(cq) });
    0
}

/// A completion channel: its fd an eventfd, written once per event raised.
unsafe extern "C" fn create_comp_channel(ctx: *mut IbvContext) -> *mut IbvCompChannel {
    // SAFETY: eventfd with valid flags.
    let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    if fd < 0 {
        return std::ptr::null_mut();
    }
    let ch = Box::into_raw(Box::new(IbvCompChannel { context: ctx, fd, refcnt: 0 }));
    state().lock().events.insert(ch as usize, VecDeque::new());
    ch
}

unsafe extern "C" fn destroy_comp_channel(ch: *mut IbvCompChannel) -> c_int {
    let mut st = state().lock();
    if st.notify.values().any(|(c, _)| *c == ch as usize) {
        return libc::EBUSY; // a queue still uses it
    }
    st.events.remove(&(ch as usize));
    // SAFETY: the channel from create_comp_channel, freed once; its eventfd is ours.
    let ch = unsafe { Box::from_raw(ch) };
    // SAFETY: as above.
    unsafe { libc::close(ch.fd) };
    0
}

unsafe extern "C" fn req_notify_cq(cq: *mut IbvCq, _solicited_only: c_int) -> c_int {
    match state().lock().notify.get_mut(&(cq as usize)) {
        Some((_, armed)) => {
            *armed = true;
            0
        }
        None => libc::EINVAL,
    }
}

/// The next event of `ch` (the caller saw its fd readable); -1 with `EAGAIN` if none.
unsafe extern "C" fn get_cq_event(
    ch: *mut IbvCompChannel,
    cq: *mut *mut IbvCq,
    ctx: *mut *mut c_void,
) -> c_int {
    let mut st = state().lock();
    let Some(next) = st.events.get_mut(&(ch as usize)).and_then(VecDeque::pop_front) else {
        // SAFETY: errno is thread-local.
        unsafe { *libc::__errno_location() = libc::EAGAIN };
        return -1;
    };
    let mut n = 0u64;
    // SAFETY: our eventfd; reading its counter makes it unreadable until the next event
    // (events left in the queue write it again).
    unsafe {
        libc::read((*ch).fd, (&mut n as *mut u64).cast(), 8);
        if !st.events.get(&(ch as usize)).is_none_or(VecDeque::is_empty) {
            let one = 1u64;
            libc::write((*ch).fd, (&one as *const u64).cast(), 8);
        }
        *cq = next as *mut IbvCq;
        *ctx = std::ptr::null_mut();
    }
    0
}

unsafe extern "C" fn ack_cq_events(_cq: *mut IbvCq, _n: std::ffi::c_uint) {}

unsafe extern "C" fn create_qp(pd: *mut c_void, init: *mut IbvQpInitAttr) -> *mut IbvQp {
    // SAFETY: our domain (it holds its context) and the caller's attributes.
    let (ctx, init) = unsafe { (*pd.cast::<*mut IbvContext>(), &*init) };
    if init.qp_type != consts::QPT_RC || init.cap.max_send_wr == 0 || init.cap.max_send_wr > 64 {
        return std::ptr::null_mut();
    }
    let mut st = state().lock();
    st.next_qpn += 1;
    let qpn = st.next_qpn;
    let depth = st.sq_limit.unwrap_or(init.cap.max_send_wr).min(init.cap.max_send_wr);
    let qp = Box::into_raw(Box::new(IbvQp {
        context: ctx,
        qp_context: std::ptr::null_mut(),
        pd,
        send_cq: init.send_cq.cast(),
        recv_cq: init.recv_cq.cast(),
        srq: std::ptr::null_mut(),
        handle: qpn,
        qp_num: qpn,
        state: 0,
        qp_type: consts::QPT_RC,
    }));
    st.qps.insert(
        qpn,
        QpRec {
            cq: init.send_cq as usize,
            state: 0,
            dest: 0,
            depth,
            taken: 0,
            freed: 0,
            held: Vec::new(),
            receives: VecDeque::new(),
            rnr: VecDeque::new(),
        },
    );
    qp
}

unsafe extern "C" fn modify_qp(qp: *mut IbvQp, a: *mut IbvQpAttr, mask: c_int) -> c_int {
    use consts::*;
    // SAFETY: a live queue pair and the caller's attributes.
    let (qpn, a) = unsafe { ((*qp).qp_num, &*a) };
    let mut st = state().lock();
    let Some(rec) = st.qps.get_mut(&qpn) else { return libc::EINVAL };
    // What RC requires for each transition (IB spec, table 91; what providers check).
    let needs = match (rec.state, a.qp_state) {
        (0, QPS_INIT) => QP_STATE | QP_PKEY_INDEX | QP_PORT | QP_ACCESS_FLAGS,
        (QPS_INIT, QPS_RTR) => {
            QP_STATE
                | QP_AV
                | QP_PATH_MTU
                | QP_DEST_QPN
                | QP_RQ_PSN
                | QP_MAX_DEST_RD_ATOMIC
                | QP_MIN_RNR_TIMER
        }
        (QPS_RTR, QPS_RTS) => {
            QP_STATE | QP_TIMEOUT | QP_RETRY_CNT | QP_RNR_RETRY | QP_SQ_PSN | QP_MAX_QP_RD_ATOMIC
        }
        (_, QPS_ERR) => QP_STATE,
        _ => return libc::EINVAL,
    };
    if mask & needs != needs {
        return libc::EINVAL;
    }
    if a.qp_state == QPS_RTR && !(1..=5).contains(&a.path_mtu) {
        return libc::EINVAL;
    }
    if mask & QP_DEST_QPN != 0 {
        rec.dest = a.dest_qp_num;
    }
    rec.state = a.qp_state;
    if a.qp_state == QPS_ERR {
        // Flush what it holds: each request completes with a flush error.
        let mut held = std::mem::take(&mut rec.rnr);
        held.extend(std::mem::take(&mut rec.held));
        let (cq, peer) = (rec.cq, rec.dest);
        for (pos, wr, _) in held {
            push(&mut st, cq, qpn, pos, wr.wr_id, consts::WC_WR_FLUSH_ERR, wr.opcode);
        }
        // A peer retrying toward it (RNR) gets no answer any more.
        retry_stalled(&mut st, peer, qpn);
    }
    0
}

unsafe extern "C" fn destroy_qp(qp: *mut IbvQp) -> c_int {
    // SAFETY: a live queue pair, destroyed once.
    let qpn = unsafe { (*qp).qp_num };
    let mut st = state().lock();
    if let Some(rec) = st.qps.remove(&qpn) {
        // A peer retrying toward it (RNR) gets no answer any more.
        retry_stalled(&mut st, rec.dest, qpn);
    }
    drop(st);
    // SAFETY: as above.
    drop(unsafe { Box::from_raw(qp) });
    0
}

unsafe extern "C" fn get_async_event(_c: *mut IbvContext, _e: *mut IbvAsyncEvent) -> c_int {
    -1
}

unsafe extern "C" fn ack_async_event(_e: *mut IbvAsyncEvent) {}

fn push(st: &mut State, cq: usize, qpn: u32, pos: u64, wr_id: u64, status: u32, opcode: u32) {
    let wc_opcode = if opcode == consts::WR_RDMA_READ { 2 } else { 1 };
    push_wc(st, cq, qpn, pos, wr_id, status, wc_opcode, 0);
}

#[allow(clippy::too_many_arguments)]
fn push_wc(
    st: &mut State,
    cq: usize,
    qpn: u32,
    pos: u64,
    wr_id: u64,
    status: u32,
    opcode: u32,
    imm: u32,
) {
    let mut wc = IbvWc::default();
    wc.wr_id = wr_id;
    wc.status = status;
    wc.opcode = opcode;
    wc.qp_num = qpn;
    wc.imm_data = imm;
    if let Some(q) = st.cqs.get_mut(&cq) {
        q.push_back((wc, qpn, pos));
    }
    // An armed queue raises one event on its channel.
    if let Some((ch, armed)) = st.notify.get_mut(&cq).filter(|(_, armed)| *armed) {
        *armed = false;
        let ch = *ch;
        if let Some(ev) = st.events.get_mut(&ch) {
            ev.push_back(cq);
            // SAFETY: the channel is live while a queue uses it; its eventfd is ours.
            unsafe {
                let one = 1u64;
                libc::write((*(ch as *mut IbvCompChannel)).fd, (&one as *const u64).cast(), 8);
            }
        }
    }
}

/// Where `[addr, addr + len)` of registration `key` lies in this process, if it lies in the
/// registration and `access` is allowed.
fn covered(st: &State, key: u32, addr: u64, len: u64, access: c_int) -> Option<usize> {
    st.mrs
        .get(&key)
        .filter(|m| {
            (m.access & access) == access
                && addr >= m.addr as u64
                && addr.checked_add(len).is_some_and(|end| end <= (m.addr + m.len) as u64)
        })
        .map(|m| m.host + (addr as usize - m.addr))
}

/// Executes one request of queue pair `qpn`: the copy, then its completion (if signaled or
/// failed); a failure moves the queue pair to the error state. A WRITE with immediate data
/// that finds no receive at the peer, and every request behind it, waits (RNR).
fn execute(
    st: &mut State,
    qpn: u32,
    pos: u64,
    wr: Box<IbvSendWr>,
    sges: Vec<super::verbs::IbvSge>,
) {
    let Some(rec) = st.qps.get_mut(&qpn) else { return };
    let (cq, dest, signaled) = (rec.cq, rec.dest, wr.send_flags & consts::SEND_SIGNALED != 0);
    if rec.state == consts::QPS_ERR {
        push(st, cq, qpn, pos, wr.wr_id, consts::WC_WR_FLUSH_ERR, wr.opcode);
        return;
    }
    if !rec.rnr.is_empty() {
        // A queue pair executes in order: behind a request being retried, it waits.
        rec.rnr.push_back((pos, wr, sges));
        return;
    }
    let imm = wr.opcode == consts::WR_RDMA_WRITE_WITH_IMM;
    let answered =
        st.qps.get(&dest).is_some_and(|d| d.state >= consts::QPS_RTR && d.state < consts::QPS_ERR);
    if imm && answered && st.qps.get(&dest).is_some_and(|d| d.receives.is_empty()) {
        // Receiver not ready: the responder answers RNR before executing anything of this
        // (one-packet) WRITE; the requester retries it, and its queue waits behind it.
        if let Some(r) = st.qps.get_mut(&qpn) {
            r.rnr.push_back((pos, wr, sges));
        }
        return;
    }
    let read = wr.opcode == consts::WR_RDMA_READ;
    let total: u64 = sges.iter().map(|e| u64::from(e.length)).sum();
    let local: Option<Vec<usize>> = sges
        .iter()
        .map(|e| {
            let access = if read { consts::ACCESS_LOCAL_WRITE } else { 0 };
            covered(st, e.lkey, e.addr, u64::from(e.length), access)
        })
        .collect();
    let remote_access = if read { consts::ACCESS_REMOTE_READ } else { consts::ACCESS_REMOTE_WRITE };
    let status = if !answered {
        // Nobody answers: the transport retries run out.
        consts::WC_RETRY_EXC_ERR
    } else if local.is_none() {
        4 // local protection error
    } else if let (Some(local), Some(remote)) =
        (&local, covered(st, wr.rkey, wr.remote_addr, total, remote_access))
    {
        let mut at = remote;
        for (e, &l) in sges.iter().zip(local) {
            let (local, n) = (l as *mut u8, e.length as usize);
            let remote = at as *mut u8;
            // SAFETY: both ranges were checked against live registrations of memory mapped
            // in this process just above (the transport keeps them registered while work is
            // out).
            unsafe {
                if read {
                    std::ptr::copy(remote, local, n);
                } else {
                    std::ptr::copy(local, remote, n);
                }
            }
            at += n;
        }
        consts::WC_SUCCESS
    } else {
        consts::WC_REM_ACCESS_ERR
    };
    if status != consts::WC_SUCCESS {
        if let Some(r) = st.qps.get_mut(&qpn) {
            r.state = consts::QPS_ERR;
        }
        push(st, cq, qpn, pos, wr.wr_id, status, wr.opcode);
    } else {
        if imm {
            // The immediate consumes a receive of the destination (there is one: checked).
            if let Some(d) = st.qps.get_mut(&dest) {
                let (recv, dcq) = (d.receives.pop_front().unwrap_or(0), d.cq);
                let imm = wr.imm_data;
                push_wc(st, dcq, dest, 0, recv, status, consts::WC_RECV_RDMA_WITH_IMM, imm);
            }
        }
        if signaled {
            push(st, cq, qpn, pos, wr.wr_id, status, wr.opcode);
        }
    }
}

/// Retries the requests of queue pair `qpn` stalled (RNR) toward `peer`: it posted a
/// receive, or went away.
fn retry_stalled(st: &mut State, qpn: u32, peer: u32) {
    let Some(rec) = st.qps.get_mut(&qpn).filter(|r| r.dest == peer) else { return };
    for (pos, wr, sges) in std::mem::take(&mut rec.rnr) {
        execute(st, qpn, pos, wr, sges);
    }
}

unsafe extern "C" fn post_recv(
    qp: *mut IbvQp,
    wr: *mut super::verbs::IbvRecvWr,
    _bad: *mut *mut super::verbs::IbvRecvWr,
) -> c_int {
    // SAFETY: a live queue pair.
    let qpn = unsafe { (*qp).qp_num };
    let mut st = state().lock();
    let mut cur = wr;
    while !cur.is_null() {
        // SAFETY: the caller's chain of receives.
        let (id, next) = unsafe { ((*cur).wr_id, (*cur).next) };
        match st.qps.get_mut(&qpn) {
            Some(r) if r.receives.len() < 16 => r.receives.push_back(id),
            _ => return libc::ENOMEM,
        }
        cur = next;
    }
    // Its peer's WRITE with immediate data waiting for a receive gets through now.
    if let Some(peer) = st.qps.get(&qpn).map(|r| r.dest) {
        retry_stalled(&mut st, peer, qpn);
    }
    0
}

unsafe extern "C" fn post_send(
    qp: *mut IbvQp,
    wr: *mut IbvSendWr,
    bad: *mut *mut IbvSendWr,
) -> c_int {
    // SAFETY: a live queue pair.
    let qpn = unsafe { (*qp).qp_num };
    let mut st = state().lock();
    let Some(rec) = st.qps.get(&qpn) else { return libc::EINVAL };
    if rec.state != consts::QPS_RTS && rec.state != consts::QPS_ERR {
        // SAFETY: the caller's out-pointer.
        unsafe { *bad = wr };
        return libc::EINVAL;
    }
    let mut cur = wr;
    while !cur.is_null() {
        let rec = st.qps.get_mut(&qpn).expect("looked up above, under the same lock");
        if rec.taken - rec.freed >= u64::from(rec.depth) {
            // The send queue is full: the rest of the chain is not taken.
            // SAFETY: the caller's out-pointer.
            unsafe { *bad = cur };
            return libc::ENOMEM;
        }
        rec.taken += 1;
        let pos = rec.taken;
        // SAFETY: the caller's chain: valid requests whose entries are valid for the call.
        let (copy, sges) = unsafe {
            let w = &*cur;
            let sges = std::slice::from_raw_parts(w.sg_list, w.num_sge.max(0) as usize).to_vec();
            let mut copy = Box::new(IbvSendWr::default());
            copy.wr_id = w.wr_id;
            copy.opcode = w.opcode;
            copy.imm_data = w.imm_data;
            copy.send_flags = w.send_flags;
            copy.remote_addr = w.remote_addr;
            copy.rkey = w.rkey;
            (copy, sges)
        };
        if st.hold && st.qps[&qpn].state != consts::QPS_ERR {
            if let Some(r) = st.qps.get_mut(&qpn) {
                r.held.push((pos, copy, sges));
            }
        } else {
            execute(&mut st, qpn, pos, copy, sges);
        }
        // SAFETY: as above.
        cur = unsafe { (*cur).next };
    }
    0
}

unsafe extern "C" fn poll_cq(cq: *mut IbvCq, n: c_int, wc: *mut IbvWc) -> c_int {
    let mut st = state().lock();
    if st.device_lost.contains(&(cq as usize)) {
        return -libc::EIO;
    }
    let mut got = 0;
    while got < n.max(0) {
        let Some((c, qpn, pos)) = st.cqs.get_mut(&(cq as usize)).and_then(VecDeque::pop_front)
        else {
            break;
        };
        // A completion frees its request's slot and every slot before it.
        if let Some(r) = st.qps.get_mut(&qpn) {
            r.freed = r.freed.max(pos);
        }
        // SAFETY: the caller's array of at least `n` completions.
        unsafe { *wc.add(got as usize) = c };
        got += 1;
    }
    got
}

#[cfg(test)]
mod tests;
