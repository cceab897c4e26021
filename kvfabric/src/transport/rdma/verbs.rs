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
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    /// Every size, offset and constant this module relies on, as the system's verbs.h has it.
    /// Compiled and run with the C compiler; skipped (saying why) without the header.
    #[test]
    fn layouts_match_the_system_header() {
        let header = std::path::Path::new("/usr/include/infiniband/verbs.h");
        if !header.exists() {
            eprintln!(
                "SKIPPED: {} is not installed (libibverbs-dev); the verbs ABI is unchecked",
                header.display()
            );
            return;
        }
        let ours: Vec<(&str, usize)> = vec![
            ("sizeof(struct ibv_sge)", size_of::<IbvSge>()),
            ("sizeof(struct ibv_send_wr)", size_of::<IbvSendWr>()),
            ("offsetof(struct ibv_send_wr, wr_id)", offset_of!(IbvSendWr, wr_id)),
            ("offsetof(struct ibv_send_wr, next)", offset_of!(IbvSendWr, next)),
            ("offsetof(struct ibv_send_wr, sg_list)", offset_of!(IbvSendWr, sg_list)),
            ("offsetof(struct ibv_send_wr, num_sge)", offset_of!(IbvSendWr, num_sge)),
            ("offsetof(struct ibv_send_wr, opcode)", offset_of!(IbvSendWr, opcode)),
            ("offsetof(struct ibv_send_wr, send_flags)", offset_of!(IbvSendWr, send_flags)),
            ("offsetof(struct ibv_send_wr, imm_data)", offset_of!(IbvSendWr, imm_data)),
            (
                "offsetof(struct ibv_send_wr, wr.rdma.remote_addr)",
                offset_of!(IbvSendWr, remote_addr),
            ),
            ("offsetof(struct ibv_send_wr, wr.rdma.rkey)", offset_of!(IbvSendWr, rkey)),
            ("sizeof(struct ibv_wc)", size_of::<IbvWc>()),
            ("offsetof(struct ibv_wc, status)", offset_of!(IbvWc, status)),
            ("offsetof(struct ibv_wc, opcode)", offset_of!(IbvWc, opcode)),
            ("offsetof(struct ibv_wc, vendor_err)", offset_of!(IbvWc, vendor_err)),
            ("offsetof(struct ibv_wc, byte_len)", offset_of!(IbvWc, byte_len)),
            ("offsetof(struct ibv_wc, imm_data)", offset_of!(IbvWc, imm_data)),
            ("offsetof(struct ibv_wc, qp_num)", offset_of!(IbvWc, qp_num)),
            ("offsetof(struct ibv_context, ops)", offset_of!(IbvContext, ops)),
            (
                "offsetof(struct ibv_context, ops.poll_cq)",
                offset_of!(IbvContext, ops) + OPS_POLL_CQ * 8,
            ),
            (
                "offsetof(struct ibv_context, ops.post_send)",
                offset_of!(IbvContext, ops) + OPS_POST_SEND * 8,
            ),
            (
                "offsetof(struct ibv_context, ops.req_notify_cq)",
                offset_of!(IbvContext, ops) + OPS_REQ_NOTIFY_CQ * 8,
            ),
            ("sizeof(struct ibv_comp_channel)", size_of::<IbvCompChannel>()),
            ("offsetof(struct ibv_comp_channel, fd)", offset_of!(IbvCompChannel, fd)),
            (
                "offsetof(struct ibv_context, ops.post_recv)",
                offset_of!(IbvContext, ops) + OPS_POST_RECV * 8,
            ),
            ("sizeof(struct ibv_recv_wr)", size_of::<IbvRecvWr>()),
            ("offsetof(struct ibv_recv_wr, sg_list)", offset_of!(IbvRecvWr, sg_list)),
            ("offsetof(struct ibv_recv_wr, num_sge)", offset_of!(IbvRecvWr, num_sge)),
            ("IBV_WC_RECV_RDMA_WITH_IMM", consts::WC_RECV_RDMA_WITH_IMM as usize),
            ("offsetof(struct ibv_context, cmd_fd)", offset_of!(IbvContext, cmd_fd)),
            ("offsetof(struct ibv_context, async_fd)", offset_of!(IbvContext, async_fd)),
            ("sizeof(struct ibv_async_event)", size_of::<IbvAsyncEvent>()),
            ("offsetof(struct ibv_async_event, element)", offset_of!(IbvAsyncEvent, element)),
            ("offsetof(struct ibv_async_event, event_type)", offset_of!(IbvAsyncEvent, event_type)),
            ("IBV_EVENT_QP_FATAL", 1),
            ("IBV_EVENT_PATH_MIG_ERR", 7),
            ("IBV_EVENT_DEVICE_FATAL", 8),
            ("IBV_EVENT_QP_LAST_WQE_REACHED", 16),
            ("IBV_EVENT_WQ_FATAL", 19),
            ("offsetof(struct ibv_device_attr, max_sge_rd)", offset_of!(IbvDeviceAttr, max_sge_rd)),
            ("offsetof(struct ibv_cq, context)", offset_of!(IbvCq, context)),
            ("offsetof(struct ibv_qp, context)", offset_of!(IbvQp, context)),
            ("offsetof(struct ibv_qp, qp_num)", offset_of!(IbvQp, qp_num)),
            ("sizeof(struct ibv_mr)", size_of::<IbvMr>()),
            ("offsetof(struct ibv_mr, addr)", offset_of!(IbvMr, addr)),
            ("offsetof(struct ibv_mr, length)", offset_of!(IbvMr, length)),
            ("offsetof(struct ibv_mr, lkey)", offset_of!(IbvMr, lkey)),
            ("offsetof(struct ibv_mr, rkey)", offset_of!(IbvMr, rkey)),
            ("sizeof(struct ibv_qp_cap)", size_of::<IbvQpCap>()),
            ("sizeof(struct ibv_qp_init_attr)", size_of::<IbvQpInitAttr>()),
            ("offsetof(struct ibv_qp_init_attr, cap)", offset_of!(IbvQpInitAttr, cap)),
            ("offsetof(struct ibv_qp_init_attr, qp_type)", offset_of!(IbvQpInitAttr, qp_type)),
            (
                "offsetof(struct ibv_qp_init_attr, sq_sig_all)",
                offset_of!(IbvQpInitAttr, sq_sig_all),
            ),
            ("sizeof(struct ibv_global_route)", size_of::<IbvGlobalRoute>()),
            ("sizeof(struct ibv_ah_attr)", size_of::<IbvAhAttr>()),
            ("offsetof(struct ibv_ah_attr, dlid)", offset_of!(IbvAhAttr, dlid)),
            ("offsetof(struct ibv_ah_attr, is_global)", offset_of!(IbvAhAttr, is_global)),
            ("offsetof(struct ibv_ah_attr, port_num)", offset_of!(IbvAhAttr, port_num)),
            ("sizeof(struct ibv_qp_attr)", size_of::<IbvQpAttr>()),
            ("offsetof(struct ibv_qp_attr, path_mtu)", offset_of!(IbvQpAttr, path_mtu)),
            ("offsetof(struct ibv_qp_attr, rq_psn)", offset_of!(IbvQpAttr, rq_psn)),
            ("offsetof(struct ibv_qp_attr, sq_psn)", offset_of!(IbvQpAttr, sq_psn)),
            ("offsetof(struct ibv_qp_attr, dest_qp_num)", offset_of!(IbvQpAttr, dest_qp_num)),
            (
                "offsetof(struct ibv_qp_attr, qp_access_flags)",
                offset_of!(IbvQpAttr, qp_access_flags),
            ),
            ("offsetof(struct ibv_qp_attr, ah_attr)", offset_of!(IbvQpAttr, ah_attr)),
            ("offsetof(struct ibv_qp_attr, pkey_index)", offset_of!(IbvQpAttr, pkey_index)),
            ("offsetof(struct ibv_qp_attr, max_rd_atomic)", offset_of!(IbvQpAttr, max_rd_atomic)),
            (
                "offsetof(struct ibv_qp_attr, max_dest_rd_atomic)",
                offset_of!(IbvQpAttr, max_dest_rd_atomic),
            ),
            ("offsetof(struct ibv_qp_attr, min_rnr_timer)", offset_of!(IbvQpAttr, min_rnr_timer)),
            ("offsetof(struct ibv_qp_attr, port_num)", offset_of!(IbvQpAttr, port_num)),
            ("offsetof(struct ibv_qp_attr, timeout)", offset_of!(IbvQpAttr, timeout)),
            ("offsetof(struct ibv_qp_attr, retry_cnt)", offset_of!(IbvQpAttr, retry_cnt)),
            ("offsetof(struct ibv_qp_attr, rnr_retry)", offset_of!(IbvQpAttr, rnr_retry)),
            ("offsetof(struct ibv_qp_attr, rate_limit)", offset_of!(IbvQpAttr, rate_limit)),
            ("sizeof(struct ibv_port_attr)", size_of::<IbvPortAttr>()),
            ("offsetof(struct ibv_port_attr, active_mtu)", offset_of!(IbvPortAttr, active_mtu)),
            ("offsetof(struct ibv_port_attr, max_msg_sz)", offset_of!(IbvPortAttr, max_msg_sz)),
            ("offsetof(struct ibv_port_attr, lid)", offset_of!(IbvPortAttr, lid)),
            ("offsetof(struct ibv_port_attr, link_layer)", offset_of!(IbvPortAttr, link_layer)),
            ("sizeof(struct ibv_device_attr)", size_of::<IbvDeviceAttr>()),
            (
                "offsetof(struct ibv_device_attr, max_mr_size)",
                offset_of!(IbvDeviceAttr, max_mr_size),
            ),
            ("offsetof(struct ibv_device_attr, max_qp_wr)", offset_of!(IbvDeviceAttr, max_qp_wr)),
            ("offsetof(struct ibv_device_attr, max_sge)", offset_of!(IbvDeviceAttr, max_sge)),
            ("offsetof(struct ibv_device_attr, max_cqe)", offset_of!(IbvDeviceAttr, max_cqe)),
            (
                "offsetof(struct ibv_device_attr, max_qp_rd_atom)",
                offset_of!(IbvDeviceAttr, max_qp_rd_atom),
            ),
            (
                "offsetof(struct ibv_device_attr, max_qp_init_rd_atom)",
                offset_of!(IbvDeviceAttr, max_qp_init_rd_atom),
            ),
            (
                "offsetof(struct ibv_device_attr, phys_port_cnt)",
                offset_of!(IbvDeviceAttr, phys_port_cnt),
            ),
            ("IBV_QPT_RC", consts::QPT_RC as usize),
            ("IBV_QPS_INIT", consts::QPS_INIT as usize),
            ("IBV_QPS_RTR", consts::QPS_RTR as usize),
            ("IBV_QPS_RTS", consts::QPS_RTS as usize),
            ("IBV_QPS_ERR", consts::QPS_ERR as usize),
            ("IBV_QP_STATE", consts::QP_STATE as usize),
            ("IBV_QP_ACCESS_FLAGS", consts::QP_ACCESS_FLAGS as usize),
            ("IBV_QP_PKEY_INDEX", consts::QP_PKEY_INDEX as usize),
            ("IBV_QP_PORT", consts::QP_PORT as usize),
            ("IBV_QP_AV", consts::QP_AV as usize),
            ("IBV_QP_PATH_MTU", consts::QP_PATH_MTU as usize),
            ("IBV_QP_TIMEOUT", consts::QP_TIMEOUT as usize),
            ("IBV_QP_RETRY_CNT", consts::QP_RETRY_CNT as usize),
            ("IBV_QP_RNR_RETRY", consts::QP_RNR_RETRY as usize),
            ("IBV_QP_RQ_PSN", consts::QP_RQ_PSN as usize),
            ("IBV_QP_MAX_QP_RD_ATOMIC", consts::QP_MAX_QP_RD_ATOMIC as usize),
            ("IBV_QP_MIN_RNR_TIMER", consts::QP_MIN_RNR_TIMER as usize),
            ("IBV_QP_SQ_PSN", consts::QP_SQ_PSN as usize),
            ("IBV_QP_MAX_DEST_RD_ATOMIC", consts::QP_MAX_DEST_RD_ATOMIC as usize),
            ("IBV_QP_DEST_QPN", consts::QP_DEST_QPN as usize),
            ("IBV_ACCESS_LOCAL_WRITE", consts::ACCESS_LOCAL_WRITE as usize),
            ("IBV_ACCESS_REMOTE_WRITE", consts::ACCESS_REMOTE_WRITE as usize),
            ("IBV_ACCESS_REMOTE_READ", consts::ACCESS_REMOTE_READ as usize),
            ("IBV_ACCESS_RELAXED_ORDERING", consts::ACCESS_RELAXED_ORDERING as usize),
            ("IBV_WR_RDMA_WRITE", consts::WR_RDMA_WRITE as usize),
            ("IBV_WR_RDMA_WRITE_WITH_IMM", consts::WR_RDMA_WRITE_WITH_IMM as usize),
            ("IBV_WR_RDMA_READ", consts::WR_RDMA_READ as usize),
            ("IBV_SEND_SIGNALED", consts::SEND_SIGNALED as usize),
            ("IBV_PORT_ACTIVE", consts::PORT_ACTIVE as usize),
            ("IBV_LINK_LAYER_INFINIBAND", consts::LINK_LAYER_INFINIBAND as usize),
            ("IBV_LINK_LAYER_ETHERNET", consts::LINK_LAYER_ETHERNET as usize),
            ("IBV_WC_SUCCESS", consts::WC_SUCCESS as usize),
            ("IBV_WC_WR_FLUSH_ERR", consts::WC_WR_FLUSH_ERR as usize),
            ("IBV_WC_REM_ACCESS_ERR", consts::WC_REM_ACCESS_ERR as usize),
            ("IBV_WC_RETRY_EXC_ERR", consts::WC_RETRY_EXC_ERR as usize),
            ("IBV_WC_REM_INV_REQ_ERR", 9),
            ("IBV_WC_REM_OP_ERR", 11),
            ("IBV_WC_RNR_RETRY_EXC_ERR", 13),
            ("IBV_WC_REM_INV_RD_REQ_ERR", 15),
            ("IBV_WC_REM_ABORT_ERR", 16),
            ("IBV_WC_RESP_TIMEOUT_ERR", 20),
            ("IBV_WC_TM_RNDV_INCOMPLETE", 23),
        ];
        let dir = tempfile::tempdir().unwrap();
        let mut c = String::from("#include <stdio.h>\n#include <stddef.h>\n#include <stdint.h>\n#include <infiniband/verbs.h>\n");
        // Signatures of entry points declared by hand (a mismatch fails the build below).
        c.push_str("struct ibv_mr *(*reg_dmabuf)(struct ibv_pd *, uint64_t, size_t, uint64_t, int, int) = ibv_reg_dmabuf_mr;\n");
        c.push_str("struct ibv_comp_channel *(*create_channel)(struct ibv_context *) = ibv_create_comp_channel;\n");
        c.push_str(
            "int (*destroy_channel)(struct ibv_comp_channel *) = ibv_destroy_comp_channel;\n",
        );
        c.push_str("int (*get_cq_event)(struct ibv_comp_channel *, struct ibv_cq **, void **) = ibv_get_cq_event;\n");
        c.push_str("void (*ack_cq_events)(struct ibv_cq *, unsigned int) = ibv_ack_cq_events;\n");
        c.push_str("int main(void) {\n");
        for (expr, _) in &ours {
            c.push_str(&format!("  printf(\"%s %zu\\n\", \"{expr}\", (size_t)({expr}));\n"));
        }
        c.push_str("  return 0;\n}\n");
        let src = dir.path().join("abi.c");
        let exe = dir.path().join("abi");
        std::fs::write(&src, c).unwrap();
        let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
        let out = match std::process::Command::new(&cc)
            .arg("-Werror=incompatible-pointer-types")
            .arg(&src)
            .arg("-libverbs")
            .arg("-o")
            .arg(&exe)
            .output()
        {
            Ok(out) => out,
            Err(e) => {
                eprintln!("SKIPPED: no C compiler to build the ABI check ({cc}: {e})");
                return;
            }
        };
        assert!(out.status.success(), "{cc}: {}", String::from_utf8_lossy(&out.stderr));
        let out = std::process::Command::new(&exe).output().unwrap();
        let text = String::from_utf8(out.stdout).unwrap();
        let mut checked = 0;
        for ((expr, mine), line) in ours.iter().zip(text.lines()) {
            let (name, theirs) = line.rsplit_once(' ').unwrap();
            assert_eq!(name, *expr);
            assert_eq!(
                theirs.parse::<usize>().unwrap(),
                *mine,
                "{expr}: verbs.h says {theirs}, ours is {mine}"
            );
            checked += 1;
        }
        assert_eq!(checked, ours.len());
    }

    /// The real library where it is installed: loads, and lists the devices (none on a host
    /// without RDMA hardware, which is then the reason given).
    #[test]
    fn the_library_loads_or_says_why() {
        match verbs() {
            Ok(v) => {
                let mut n = 0;
                // SAFETY: the library's own device list, freed right after.
                let list = unsafe { (v.get_device_list)(&mut n) };
                assert!(n >= 0);
                if !list.is_null() {
                    // SAFETY: the list from get_device_list.
                    unsafe { (v.free_device_list)(list) };
                }
                eprintln!("libibverbs.so.1 loaded: {n} device(s)");
            }
            Err(why) => {
                assert!(why.0.contains("libibverbs"), "{why}");
                eprintln!("SKIPPED: {why}");
            }
        }
    }
}
