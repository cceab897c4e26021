//! The few verbs the RDMA transport calls, from `libibverbs.so.1` loaded at run time
//! (`dlopen`): the binary builds without rdma-core and runs on hosts without it.
//!
//! Declared here by hand: the structures are rdma-core's public ABI (`IBVERBS_1.1`, stable
//! since 2006; fields are only ever appended). `ibv_post_send` and `ibv_poll_cq` are inline
//! functions in `verbs.h` that call through the context's operation table; so do we, at the
//! same offsets. A test compiles a C program against the system's `<infiniband/verbs.h>` and
//! checks every size, offset and constant used here against it (skipped, saying so, where
//! the header is not installed; `scripts/setup.sh test` installs it).
//!
//! The only `unsafe` of the RDMA transport lives in this module and in [`super::device`].

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::OnceLock;

/// `union ibv_gid`.
pub type Gid = [u8; 16];

/// `struct ibv_context`: the device pointer, then the operation table.
#[repr(C)]
#[derive(Debug)]
pub struct IbvContext {
    /// `struct ibv_device *`.
    pub device: *mut c_void,
    /// `struct ibv_context_ops`: 32 function pointers, of which `poll_cq` (11) and
    /// `post_send` (25) are called.
    pub ops: [*const c_void; 32],
    /// Command fd (not used).
    pub cmd_fd: c_int,
    /// The fd asynchronous events are read from.
    pub async_fd: c_int,
}

/// `struct ibv_async_event`: the element (a queue pair, completion queue, ... or a port
/// number) and the event's type.
#[repr(C)]
#[derive(Debug)]
pub struct IbvAsyncEvent {
    /// `union { struct ibv_cq *cq; struct ibv_qp *qp; ...; int port_num; }`.
    pub element: *mut c_void,
    /// `enum ibv_event_type`.
    pub event_type: c_uint,
}

impl Default for IbvAsyncEvent {
    fn default() -> Self {
        IbvAsyncEvent { element: std::ptr::null_mut(), event_type: 0 }
    }
}

/// `enum ibv_event_type`, by number.
pub fn async_event_name(t: u32) -> &'static str {
    const NAMES: [&str; 20] = [
        "completion queue error",
        "queue pair fatal error",
        "queue pair request error",
        "queue pair access error",
        "communication established",
        "send queue drained",
        "path migrated",
        "path migration error",
        "device fatal error",
        "port active",
        "port error",
        "LID change",
        "P_Key change",
        "subnet manager change",
        "shared receive queue error",
        "shared receive queue limit",
        "queue pair last WQE reached",
        "client reregister",
        "GID change",
        "work queue fatal error",
    ];
    NAMES.get(t as usize).copied().unwrap_or("unknown event")
}

/// Index of `poll_cq` in `struct ibv_context_ops`.
pub const OPS_POLL_CQ: usize = 11;
/// Index of `req_notify_cq` in `struct ibv_context_ops`.
pub const OPS_REQ_NOTIFY_CQ: usize = 12;
/// Index of `post_send` in `struct ibv_context_ops`.
pub const OPS_POST_SEND: usize = 25;
/// Index of `post_recv` in `struct ibv_context_ops`.
pub const OPS_POST_RECV: usize = 26;

/// `struct ibv_cq` (its first field).
#[repr(C)]
#[derive(Debug)]
pub struct IbvCq {
    /// Its context.
    pub context: *mut IbvContext,
}

/// `struct ibv_comp_channel`: the fd completion events of its queues are read from.
#[repr(C)]
#[derive(Debug)]
pub struct IbvCompChannel {
    /// Its context.
    pub context: *mut IbvContext,
    /// Readable when a completion event is pending.
    pub fd: c_int,
    pub(super) refcnt: c_int,
}

/// `struct ibv_qp` (up to `qp_type`).
#[repr(C)]
#[derive(Debug)]
pub struct IbvQp {
    /// Its context.
    pub context: *mut IbvContext,
    pub(super) qp_context: *mut c_void,
    pub(super) pd: *mut c_void,
    pub(super) send_cq: *mut c_void,
    pub(super) recv_cq: *mut c_void,
    pub(super) srq: *mut c_void,
    pub(super) handle: u32,
    /// Its number.
    pub qp_num: u32,
    pub(super) state: c_uint,
    pub(super) qp_type: c_uint,
}

/// `struct ibv_mr`.
#[repr(C)]
#[derive(Debug)]
pub struct IbvMr {
    pub(super) context: *mut c_void,
    pub(super) pd: *mut c_void,
    /// Start address.
    pub addr: *mut c_void,
    /// Length.
    pub length: usize,
    pub(super) handle: u32,
    /// Local key.
    pub lkey: u32,
    /// Remote key.
    pub rkey: u32,
}

/// `struct ibv_sge`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct IbvSge {
    /// Address.
    pub addr: u64,
    /// Bytes.
    pub length: u32,
    /// Local key.
    pub lkey: u32,
}

/// `struct ibv_send_wr`, with its `wr` union as the `rdma` member and the unions after it
/// as padding (128 bytes in all).
#[repr(C)]
#[derive(Debug)]
pub struct IbvSendWr {
    /// Our id, echoed by the completion.
    pub wr_id: u64,
    /// The next request of the chain, or null.
    pub next: *mut IbvSendWr,
    /// Entries.
    pub sg_list: *mut IbvSge,
    /// Entry count.
    pub num_sge: c_int,
    /// `enum ibv_wr_opcode`.
    pub opcode: c_uint,
    /// `enum ibv_send_flags`.
    pub send_flags: c_uint,
    /// Immediate data (network order).
    pub imm_data: u32,
    /// `wr.rdma.remote_addr`.
    pub remote_addr: u64,
    /// `wr.rdma.rkey`.
    pub rkey: u32,
    pub(super) _wr_rest: [u32; 5],
    pub(super) _qp_type: u32,
    pub(super) _tail: [u64; 6],
}

impl Default for IbvSendWr {
    fn default() -> Self {
        IbvSendWr {
            wr_id: 0,
            next: std::ptr::null_mut(),
            sg_list: std::ptr::null_mut(),
            num_sge: 0,
            opcode: 0,
            send_flags: 0,
            imm_data: 0,
            remote_addr: 0,
            rkey: 0,
            _wr_rest: [0; 5],
            _qp_type: 0,
            _tail: [0; 6],
        }
    }
}

// SAFETY: plain data; the pointers are only dereferenced by the library during a post, on the
// thread that posts.
unsafe impl Send for IbvSendWr {}

/// `struct ibv_recv_wr`.
#[repr(C)]
#[derive(Debug)]
pub struct IbvRecvWr {
    /// Our id, echoed by the completion.
    pub wr_id: u64,
    /// The next request of the chain, or null.
    pub next: *mut IbvRecvWr,
    /// Entries (none: a receive for a WRITE with immediate data, which carries no payload
    /// into the receive queue).
    pub sg_list: *mut IbvSge,
    /// Entry count.
    pub num_sge: c_int,
}

/// `struct ibv_wc`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct IbvWc {
    /// The request's id.
    pub wr_id: u64,
    /// `enum ibv_wc_status`.
    pub status: c_uint,
    /// `enum ibv_wc_opcode`.
    pub opcode: c_uint,
    /// Vendor error.
    pub vendor_err: u32,
    /// Bytes (receives).
    pub byte_len: u32,
    /// Immediate data.
    pub imm_data: u32,
    /// Queue pair number.
    pub qp_num: u32,
    src_qp: u32,
    wc_flags: c_uint,
    pkey_index: u16,
    slid: u16,
    sl: u8,
    dlid_path_bits: u8,
}

/// `struct ibv_qp_cap`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct IbvQpCap {
    /// Send queue depth.
    pub max_send_wr: u32,
    /// Receive queue depth.
    pub max_recv_wr: u32,
    /// Entries per send request.
    pub max_send_sge: u32,
    /// Entries per receive request.
    pub max_recv_sge: u32,
    /// Inline bytes.
    pub max_inline_data: u32,
}

/// `struct ibv_qp_init_attr`.
#[repr(C)]
#[derive(Debug)]
pub struct IbvQpInitAttr {
    /// User context.
    pub qp_context: *mut c_void,
    /// Send completion queue.
    pub send_cq: *mut IbvCq,
    /// Receive completion queue.
    pub recv_cq: *mut IbvCq,
    /// Shared receive queue (none).
    pub srq: *mut c_void,
    /// Capacities (updated by the library).
    pub cap: IbvQpCap,
    /// `enum ibv_qp_type`.
    pub qp_type: c_uint,
    /// Signal every request.
    pub sq_sig_all: c_int,
}

/// `struct ibv_global_route` (8-byte aligned: its GID is a union with two `__be64`).
#[repr(C, align(8))]
#[derive(Debug, Clone, Copy, Default)]
pub struct IbvGlobalRoute {
    /// Destination GID.
    pub dgid: Gid,
    /// Flow label.
    pub flow_label: u32,
    /// Source GID index.
    pub sgid_index: u8,
    /// Hop limit.
    pub hop_limit: u8,
    /// Traffic class.
    pub traffic_class: u8,
}

/// `struct ibv_ah_attr`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct IbvAhAttr {
    /// Global route (RoCE, routed IB).
    pub grh: IbvGlobalRoute,
    /// Destination LID.
    pub dlid: u16,
    /// Service level.
    pub sl: u8,
    /// Source path bits.
    pub src_path_bits: u8,
    /// Static rate.
    pub static_rate: u8,
    /// Whether `grh` is used.
    pub is_global: u8,
    /// Local port.
    pub port_num: u8,
}

/// `struct ibv_qp_attr`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct IbvQpAttr {
    /// Target state.
    pub qp_state: c_uint,
    /// Current state.
    pub cur_qp_state: c_uint,
    /// `enum ibv_mtu`.
    pub path_mtu: c_uint,
    /// Migration state.
    pub path_mig_state: c_uint,
    /// Q_Key (UD).
    pub qkey: u32,
    /// Receive PSN.
    pub rq_psn: u32,
    /// Send PSN.
    pub sq_psn: u32,
    /// Remote queue pair number.
    pub dest_qp_num: u32,
    /// Remote access flags.
    pub qp_access_flags: c_uint,
    /// Capacities.
    pub cap: IbvQpCap,
    /// Address vector.
    pub ah_attr: IbvAhAttr,
    /// Alternate path.
    pub alt_ah_attr: IbvAhAttr,
    /// P_Key index.
    pub pkey_index: u16,
    /// Alternate P_Key index.
    pub alt_pkey_index: u16,
    /// SQD notification.
    pub en_sqd_async_notify: u8,
    /// Draining.
    pub sq_draining: u8,
    /// Outstanding RDMA READs it initiates.
    pub max_rd_atomic: u8,
    /// Outstanding RDMA READs it answers.
    pub max_dest_rd_atomic: u8,
    /// RNR NAK timer.
    pub min_rnr_timer: u8,
    /// Port.
    pub port_num: u8,
    /// Local ACK timeout (4.096 µs × 2^timeout).
    pub timeout: u8,
    /// Transport retries.
    pub retry_cnt: u8,
    /// RNR retries.
    pub rnr_retry: u8,
    /// Alternate port.
    pub alt_port_num: u8,
    /// Alternate timeout.
    pub alt_timeout: u8,
    /// Rate limit.
    pub rate_limit: u32,
}

/// `struct ibv_port_attr`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct IbvPortAttr {
    /// `enum ibv_port_state`.
    pub state: c_uint,
    /// Largest MTU.
    pub max_mtu: c_uint,
    /// Active MTU.
    pub active_mtu: c_uint,
    /// GID table length.
    pub gid_tbl_len: c_int,
    /// Capability flags.
    pub port_cap_flags: u32,
    /// Largest message.
    pub max_msg_sz: u32,
    bad_pkey_cntr: u32,
    qkey_viol_cntr: u32,
    pkey_tbl_len: u16,
    /// LID.
    pub lid: u16,
    sm_lid: u16,
    lmc: u8,
    max_vl_num: u8,
    sm_sl: u8,
    subnet_timeout: u8,
    init_type_reply: u8,
    active_width: u8,
    active_speed: u8,
    phys_state: u8,
    /// `IBV_LINK_LAYER_*`.
    pub link_layer: u8,
    flags: u8,
    port_cap_flags2: u16,
}

/// `struct ibv_device_attr`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct IbvDeviceAttr {
    fw_ver: [c_char; 64],
    node_guid: u64,
    sys_image_guid: u64,
    /// Largest registration.
    pub max_mr_size: u64,
    page_size_cap: u64,
    vendor_id: u32,
    vendor_part_id: u32,
    hw_ver: u32,
    max_qp: c_int,
    /// Deepest queue.
    pub max_qp_wr: c_int,
    device_cap_flags: c_uint,
    /// Entries per request.
    pub max_sge: c_int,
    /// Entries per READ request.
    pub max_sge_rd: c_int,
    max_cq: c_int,
    /// Deepest completion queue.
    pub max_cqe: c_int,
    max_mr: c_int,
    max_pd: c_int,
    /// Outstanding READs a queue pair answers.
    pub max_qp_rd_atom: c_int,
    max_ee_rd_atom: c_int,
    max_res_rd_atom: c_int,
    /// Outstanding READs a queue pair initiates.
    pub max_qp_init_rd_atom: c_int,
    max_ee_init_rd_atom: c_int,
    atomic_cap: c_uint,
    max_ee: c_int,
    max_rdd: c_int,
    max_mw: c_int,
    max_raw_ipv6_qp: c_int,
    max_raw_ethy_qp: c_int,
    max_mcast_grp: c_int,
    max_mcast_qp_attach: c_int,
    max_total_mcast_qp_attach: c_int,
    max_ah: c_int,
    max_fmr: c_int,
    max_map_per_fmr: c_int,
    max_srq: c_int,
    max_srq_wr: c_int,
    max_srq_sge: c_int,
    max_pkeys: u16,
    local_ca_ack_delay: u8,
    /// Ports.
    pub phys_port_cnt: u8,
}

impl Default for IbvDeviceAttr {
    fn default() -> Self {
        // SAFETY: every field is an integer or an array of integers: all-zero is valid.
        unsafe { std::mem::zeroed() }
    }
}

/// Constants of `verbs.h` used here.
pub mod consts {
    /// `IBV_QPT_RC`.
    pub const QPT_RC: u32 = 2;
    /// `IBV_QPS_INIT`.
    pub const QPS_INIT: u32 = 1;
    /// `IBV_QPS_RTR`.
    pub const QPS_RTR: u32 = 2;
    /// `IBV_QPS_RTS`.
    pub const QPS_RTS: u32 = 3;
    /// `IBV_QPS_ERR`.
    pub const QPS_ERR: u32 = 6;
    /// `IBV_QP_STATE`.
    pub const QP_STATE: i32 = 1;
    /// `IBV_QP_ACCESS_FLAGS`.
    pub const QP_ACCESS_FLAGS: i32 = 1 << 3;
    /// `IBV_QP_PKEY_INDEX`.
    pub const QP_PKEY_INDEX: i32 = 1 << 4;
    /// `IBV_QP_PORT`.
    pub const QP_PORT: i32 = 1 << 5;
    /// `IBV_QP_AV`.
    pub const QP_AV: i32 = 1 << 7;
    /// `IBV_QP_PATH_MTU`.
    pub const QP_PATH_MTU: i32 = 1 << 8;
    /// `IBV_QP_TIMEOUT`.
    pub const QP_TIMEOUT: i32 = 1 << 9;
    /// `IBV_QP_RETRY_CNT`.
    pub const QP_RETRY_CNT: i32 = 1 << 10;
    /// `IBV_QP_RNR_RETRY`.
    pub const QP_RNR_RETRY: i32 = 1 << 11;
    /// `IBV_QP_RQ_PSN`.
    pub const QP_RQ_PSN: i32 = 1 << 12;
    /// `IBV_QP_MAX_QP_RD_ATOMIC`.
    pub const QP_MAX_QP_RD_ATOMIC: i32 = 1 << 13;
    /// `IBV_QP_MIN_RNR_TIMER`.
    pub const QP_MIN_RNR_TIMER: i32 = 1 << 15;
    /// `IBV_QP_SQ_PSN`.
    pub const QP_SQ_PSN: i32 = 1 << 16;
    /// `IBV_QP_MAX_DEST_RD_ATOMIC`.
    pub const QP_MAX_DEST_RD_ATOMIC: i32 = 1 << 17;
    /// `IBV_QP_DEST_QPN`.
    pub const QP_DEST_QPN: i32 = 1 << 20;
    /// `IBV_ACCESS_LOCAL_WRITE`.
    pub const ACCESS_LOCAL_WRITE: i32 = 1;
    /// `IBV_ACCESS_REMOTE_WRITE`.
    pub const ACCESS_REMOTE_WRITE: i32 = 1 << 1;
    /// `IBV_ACCESS_REMOTE_READ`.
    pub const ACCESS_REMOTE_READ: i32 = 1 << 2;
    /// `IBV_ACCESS_RELAXED_ORDERING` (optional: ignored by devices without it).
    pub const ACCESS_RELAXED_ORDERING: i32 = 1 << 20;
    /// `IBV_WR_RDMA_WRITE`.
    pub const WR_RDMA_WRITE: u32 = 0;
    /// `IBV_WR_RDMA_WRITE_WITH_IMM`.
    pub const WR_RDMA_WRITE_WITH_IMM: u32 = 1;
    /// `IBV_WR_RDMA_READ`.
    pub const WR_RDMA_READ: u32 = 4;
    /// `IBV_SEND_SIGNALED`.
    pub const SEND_SIGNALED: u32 = 1 << 1;
    /// `IBV_PORT_ACTIVE`.
    pub const PORT_ACTIVE: u32 = 4;
    /// `IBV_LINK_LAYER_INFINIBAND`.
    pub const LINK_LAYER_INFINIBAND: u8 = 1;
    /// `IBV_LINK_LAYER_ETHERNET`.
    pub const LINK_LAYER_ETHERNET: u8 = 2;
    /// `IBV_WC_SUCCESS`.
    pub const WC_SUCCESS: u32 = 0;
    /// `IBV_WC_WR_FLUSH_ERR`.
    pub const WC_WR_FLUSH_ERR: u32 = 5;
    /// `IBV_WC_RETRY_EXC_ERR`.
    pub const WC_RETRY_EXC_ERR: u32 = 12;
    /// `IBV_WC_REM_ACCESS_ERR`.
    pub const WC_REM_ACCESS_ERR: u32 = 10;
    /// `IBV_WC_RECV_RDMA_WITH_IMM`: a receive consumed by a WRITE with immediate data.
    pub const WC_RECV_RDMA_WITH_IMM: u32 = 129;
}

type PollCq = unsafe extern "C" fn(*mut IbvCq, c_int, *mut IbvWc) -> c_int;
type PostSend = unsafe extern "C" fn(*mut IbvQp, *mut IbvSendWr, *mut *mut IbvSendWr) -> c_int;
type PostRecv = unsafe extern "C" fn(*mut IbvQp, *mut IbvRecvWr, *mut *mut IbvRecvWr) -> c_int;

type FnGetDeviceList = unsafe extern "C" fn(*mut c_int) -> *mut *mut c_void;
type FnFreeDeviceList = unsafe extern "C" fn(*mut *mut c_void);
type FnGetDeviceName = unsafe extern "C" fn(*mut c_void) -> *const c_char;
type FnOpenDevice = unsafe extern "C" fn(*mut c_void) -> *mut IbvContext;
type FnCloseDevice = unsafe extern "C" fn(*mut IbvContext) -> c_int;
type FnQueryDevice = unsafe extern "C" fn(*mut IbvContext, *mut IbvDeviceAttr) -> c_int;
type FnQueryPort = unsafe extern "C" fn(*mut IbvContext, u8, *mut IbvPortAttr) -> c_int;
type FnQueryGid = unsafe extern "C" fn(*mut IbvContext, u8, c_int, *mut Gid) -> c_int;
type FnAllocPd = unsafe extern "C" fn(*mut IbvContext) -> *mut c_void;
type FnDeallocPd = unsafe extern "C" fn(*mut c_void) -> c_int;
type FnRegMr = unsafe extern "C" fn(*mut c_void, *mut c_void, usize, c_int) -> *mut IbvMr;
type FnDeregMr = unsafe extern "C" fn(*mut IbvMr) -> c_int;
/// `ibv_reg_dmabuf_mr(pd, offset, length, iova, fd, access)`.
type FnRegDmabufMr = unsafe extern "C" fn(*mut c_void, u64, usize, u64, c_int, c_int) -> *mut IbvMr;
type FnCreateCq =
    unsafe extern "C" fn(*mut IbvContext, c_int, *mut c_void, *mut c_void, c_int) -> *mut IbvCq;
type FnDestroyCq = unsafe extern "C" fn(*mut IbvCq) -> c_int;
type FnCreateQp = unsafe extern "C" fn(*mut c_void, *mut IbvQpInitAttr) -> *mut IbvQp;
type FnModifyQp = unsafe extern "C" fn(*mut IbvQp, *mut IbvQpAttr, c_int) -> c_int;
type FnDestroyQp = unsafe extern "C" fn(*mut IbvQp) -> c_int;
type FnGetAsyncEvent = unsafe extern "C" fn(*mut IbvContext, *mut IbvAsyncEvent) -> c_int;
type FnAckAsyncEvent = unsafe extern "C" fn(*mut IbvAsyncEvent);
type FnCreateCompChannel = unsafe extern "C" fn(*mut IbvContext) -> *mut IbvCompChannel;
type FnDestroyCompChannel = unsafe extern "C" fn(*mut IbvCompChannel) -> c_int;
type FnGetCqEvent =
    unsafe extern "C" fn(*mut IbvCompChannel, *mut *mut IbvCq, *mut *mut c_void) -> c_int;
type FnAckCqEvents = unsafe extern "C" fn(*mut IbvCq, std::ffi::c_uint);
type ReqNotifyCq = unsafe extern "C" fn(*mut IbvCq, c_int) -> c_int;

/// The library's entry points.
#[allow(missing_docs)]
#[derive(Debug)]
pub struct Verbs {
    pub get_device_list: FnGetDeviceList,
    pub free_device_list: FnFreeDeviceList,
    pub get_device_name: FnGetDeviceName,
    pub open_device: FnOpenDevice,
    pub close_device: FnCloseDevice,
    pub query_device: FnQueryDevice,
    pub query_port: FnQueryPort,
    pub query_gid: FnQueryGid,
    pub alloc_pd: FnAllocPd,
    pub dealloc_pd: FnDeallocPd,
    pub reg_mr: FnRegMr,
    pub dereg_mr: FnDeregMr,
    /// Registration of a dma-buf (GPU memory): rdma-core 34 and later; None before.
    pub reg_dmabuf_mr: Option<FnRegDmabufMr>,
    pub create_cq: FnCreateCq,
    pub destroy_cq: FnDestroyCq,
    pub create_qp: FnCreateQp,
    pub modify_qp: FnModifyQp,
    pub destroy_qp: FnDestroyQp,
    pub get_async_event: FnGetAsyncEvent,
    pub ack_async_event: FnAckAsyncEvent,
    pub create_comp_channel: FnCreateCompChannel,
    pub destroy_comp_channel: FnDestroyCompChannel,
    pub get_cq_event: FnGetCqEvent,
    pub ack_cq_events: FnAckCqEvents,
}

/// Why verbs cannot be used on this host.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Unavailable(pub String);

struct Library(*mut c_void);
// SAFETY: a dlopen handle is usable from any thread; it is never closed.
unsafe impl Send for Library {}
// SAFETY: as above.
unsafe impl Sync for Library {}

fn sym(lib: &Library, name: &CStr) -> Option<*mut c_void> {
    // SAFETY: a valid handle and a NUL-terminated name; dlsym only reads them.
    let p = unsafe { libc::dlsym(lib.0, name.as_ptr()) };
    (!p.is_null()).then_some(p)
}

fn load() -> Result<Verbs, Unavailable> {
    // SAFETY: dlopen with a NUL-terminated name; the handle is kept for the process's life
    // (the library's objects outlive every caller).
    let handle =
        unsafe { libc::dlopen(c"libibverbs.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if handle.is_null() {
        return Err(Unavailable(
            "libibverbs.so.1 is not installed (rdma-core's libibverbs1 package)".into(),
        ));
    }
    let lib = Library(handle);
    macro_rules! f {
        ($name:literal, $ty:ty) => {{
            let p = sym(&lib, $name)
                .ok_or_else(|| Unavailable(format!("libibverbs.so.1 lacks {:?}", $name)))?;
            // SAFETY: the symbol is the verbs function of that name, whose C signature is
            // the field's type (its structures are checked against verbs.h by the ABI test).
            unsafe { std::mem::transmute::<*mut c_void, $ty>(p) }
        }};
    }
    Ok(Verbs {
        get_device_list: f!(c"ibv_get_device_list", FnGetDeviceList),
        free_device_list: f!(c"ibv_free_device_list", FnFreeDeviceList),
        get_device_name: f!(c"ibv_get_device_name", FnGetDeviceName),
        open_device: f!(c"ibv_open_device", FnOpenDevice),
        close_device: f!(c"ibv_close_device", FnCloseDevice),
        query_device: f!(c"ibv_query_device", FnQueryDevice),
        query_port: f!(c"ibv_query_port", FnQueryPort),
        query_gid: f!(c"ibv_query_gid", FnQueryGid),
        alloc_pd: f!(c"ibv_alloc_pd", FnAllocPd),
        dealloc_pd: f!(c"ibv_dealloc_pd", FnDeallocPd),
        reg_mr: f!(c"ibv_reg_mr", FnRegMr),
        dereg_mr: f!(c"ibv_dereg_mr", FnDeregMr),
        reg_dmabuf_mr: sym(&lib, c"ibv_reg_dmabuf_mr").map(|p| {
            // SAFETY: the symbol is `ibv_reg_dmabuf_mr`, whose C signature is the type's.
            unsafe { std::mem::transmute::<*mut c_void, FnRegDmabufMr>(p) }
        }),
        create_cq: f!(c"ibv_create_cq", FnCreateCq),
        destroy_cq: f!(c"ibv_destroy_cq", FnDestroyCq),
        create_qp: f!(c"ibv_create_qp", FnCreateQp),
        modify_qp: f!(c"ibv_modify_qp", FnModifyQp),
        destroy_qp: f!(c"ibv_destroy_qp", FnDestroyQp),
        get_async_event: f!(c"ibv_get_async_event", FnGetAsyncEvent),
        ack_async_event: f!(c"ibv_ack_async_event", FnAckAsyncEvent),
        create_comp_channel: f!(c"ibv_create_comp_channel", FnCreateCompChannel),
        destroy_comp_channel: f!(c"ibv_destroy_comp_channel", FnDestroyCompChannel),
        get_cq_event: f!(c"ibv_get_cq_event", FnGetCqEvent),
        ack_cq_events: f!(c"ibv_ack_cq_events", FnAckCqEvents),
    })
}

/// The library, loaded once; why not where it cannot be.
pub fn verbs() -> Result<&'static Verbs, Unavailable> {
    static VERBS: OnceLock<Result<Verbs, Unavailable>> = OnceLock::new();
    VERBS.get_or_init(load).as_ref().map_err(Clone::clone)
}

/// `ibv_poll_cq`: up to `wc.len()` completions of `cq`.
///
/// # Safety
/// `cq` must be a live completion queue of an open context.
pub unsafe fn poll_cq(cq: *mut IbvCq, wc: &mut [IbvWc]) -> c_int {
    // SAFETY: the caller guarantees `cq` is live; its context's operation table holds the
    // provider's poll function at OPS_POLL_CQ (checked against verbs.h by the ABI test).
    unsafe {
        let ctx = (*cq).context;
        let f: PollCq = std::mem::transmute::<*const c_void, PollCq>((*ctx).ops[OPS_POLL_CQ]);
        f(cq, wc.len().min(c_int::MAX as usize) as c_int, wc.as_mut_ptr())
    }
}

/// `ibv_req_notify_cq`: the next completion on `cq` raises an event on its channel (once).
///
/// # Safety
/// `cq` must be a live completion queue of an open context.
pub unsafe fn req_notify_cq(cq: *mut IbvCq, solicited_only: bool) -> c_int {
    // SAFETY: the caller guarantees `cq` is live; its context's operation table holds the
    // provider's function at OPS_REQ_NOTIFY_CQ (checked against verbs.h by the ABI test).
    unsafe {
        let ctx = (*cq).context;
        let f: ReqNotifyCq =
            std::mem::transmute::<*const c_void, ReqNotifyCq>((*ctx).ops[OPS_REQ_NOTIFY_CQ]);
        f(cq, c_int::from(solicited_only))
    }
}

/// `ibv_post_send`: posts the chain starting at `wr`; on failure, the errno and the first
/// request not posted.
///
/// # Safety
/// `qp` must be a live queue pair; the chain's requests and entries must be valid for the
/// call, and the memory they name registered and alive until their completions.
pub unsafe fn post_send(qp: *mut IbvQp, wr: *mut IbvSendWr) -> Result<(), (c_int, *mut IbvSendWr)> {
    let mut bad: *mut IbvSendWr = std::ptr::null_mut();
    // SAFETY: as the caller guarantees; post_send is at OPS_POST_SEND of the context's table.
    let rc = unsafe {
        let ctx = (*qp).context;
        let f: PostSend = std::mem::transmute::<*const c_void, PostSend>((*ctx).ops[OPS_POST_SEND]);
        f(qp, wr, &mut bad)
    };
    if rc == 0 {
        Ok(())
    } else {
        Err((rc, bad))
    }
}

/// `ibv_post_recv`: posts the chain of receives starting at `wr`; the errno on failure.
///
/// # Safety
/// `qp` must be a live queue pair and the chain well formed for the call.
pub unsafe fn post_recv(qp: *mut IbvQp, wr: *mut IbvRecvWr) -> Result<(), c_int> {
    let mut bad: *mut IbvRecvWr = std::ptr::null_mut();
    // SAFETY: as the caller guarantees; post_recv is at OPS_POST_RECV of the context's table.
    let rc = unsafe {
        let ctx = (*qp).context;
        let f: PostRecv = std::mem::transmute::<*const c_void, PostRecv>((*ctx).ops[OPS_POST_RECV]);
        f(qp, wr, &mut bad)
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(rc)
    }
}

#[cfg(test)]
mod tests;
