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
        ("offsetof(struct ibv_send_wr, wr.rdma.remote_addr)", offset_of!(IbvSendWr, remote_addr)),
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
        ("offsetof(struct ibv_qp_init_attr, sq_sig_all)", offset_of!(IbvQpInitAttr, sq_sig_all)),
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
        ("offsetof(struct ibv_qp_attr, qp_access_flags)", offset_of!(IbvQpAttr, qp_access_flags)),
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
        ("offsetof(struct ibv_device_attr, max_mr_size)", offset_of!(IbvDeviceAttr, max_mr_size)),
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
    c.push_str("int (*destroy_channel)(struct ibv_comp_channel *) = ibv_destroy_comp_channel;\n");
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
