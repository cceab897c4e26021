use std::sync::Arc;
use std::time::Duration;

use super::super::device::{Access, Device, OpenOptions, Qp};
use super::super::verbs::{consts, IbvSendWr, IbvSge, IbvWc};

/// Posts one signaled WRITE (with immediate data `imm` if some) of `from`: (address,
/// bytes, local key), to `to`: (remote address, remote key).
fn write(qp: &Qp, wr_id: u64, from: (*mut u8, u32, u32), to: (u64, u32), imm: Option<u32>) {
    let mut sge = IbvSge { addr: from.0 as u64, length: from.1, lkey: from.2 };
    let mut wr = IbvSendWr {
        wr_id,
        sg_list: &mut sge,
        num_sge: 1,
        opcode: if imm.is_some() { consts::WR_RDMA_WRITE_WITH_IMM } else { consts::WR_RDMA_WRITE },
        send_flags: consts::SEND_SIGNALED,
        imm_data: imm.unwrap_or(0).to_be(),
        remote_addr: to.0,
        rkey: to.1,
        ..Default::default()
    };
    // SAFETY: one request, its entry valid for the call, naming registered memory that
    // outlives the test's work.
    unsafe { qp.post(&mut wr) }.map_err(|(e, _)| e).unwrap();
}

/// The completions there are now: (queue pair, id, status, opcode, immediate).
fn completions(cq: &super::super::device::Cq) -> Vec<(u32, u64, u32, u32, u32)> {
    let mut wc = vec![IbvWc::default(); 16];
    let n = cq.poll(&mut wc).unwrap();
    wc[..n]
        .iter()
        .map(|c| (c.qp_num, c.wr_id, c.status, c.opcode, u32::from_be(c.imm_data)))
        .collect()
}

/// The double's device, opened.
fn device() -> Arc<Device> {
    let opts = OpenOptions {
        name: Some(super::DEVICE),
        gid_index: None,
        traffic_class: 0,
        service_level: 0,
    };
    Device::open(opts).unwrap()
}

/// A completion channel whose fd reports an error (a device gone) fails the wait at once
/// instead of reporting "no event" forever (the completion thread would spin on it); an
/// event read by another waiter first is "no event", not a blocked read.
#[tokio::test]
async fn a_broken_completion_channel_fails_the_wait() {
    let _serial = super::serial().await;
    let dev = device();
    let cq = dev.completion_queue(16).unwrap();
    let fd = cq.channel_fd().expect("the double makes channels");
    // Readable with no event queued (as when another waiter read it first).
    let one = 1u64;
    // SAFETY: the channel's eventfd, 8 bytes from a live u64.
    assert_eq!(unsafe { libc::write(fd, (&one as *const u64).cast(), 8) }, 8);
    assert!(!cq.wait(Duration::from_millis(100)).unwrap());
    // A pipe's write end with its read end closed reports POLLERR, as a dead device's fd.
    let mut p = [0; 2];
    // SAFETY: an array of two fds; dup2 replaces the channel's fd with the pipe's write
    // end (the channel closes it when destroyed); the read end is closed.
    unsafe {
        assert_eq!(libc::pipe(p.as_mut_ptr()), 0);
        assert_eq!(libc::dup2(p[1], fd), fd);
        libc::close(p[0]);
        libc::close(p[1]);
    }
    let t = std::time::Instant::now();
    let e = cq.wait(Duration::from_secs(5)).unwrap_err();
    assert_eq!(e.call, super::super::device::CHANNEL_GONE, "{e}");
    assert!(t.elapsed() < Duration::from_secs(1));
}

/// A WRITE with immediate data that finds no receive posted at its peer lands nothing
/// (as a one-packet WRITE answered RNR by the responder: the requester retries it), and
/// what its queue pair holds behind it waits too; a receive posted lets them through in
/// order. A responder that goes to the error state meanwhile fails the waiting WRITE as
/// a retry exhausted.
#[tokio::test]
async fn a_write_with_immediate_lands_nothing_until_a_receive_is_posted() {
    let _serial = super::serial().await;
    let dev = device();
    let cq = Arc::new(dev.completion_queue(64).unwrap());
    let (a, b) = (dev.queue_pair(&cq, 8, 1).unwrap(), dev.queue_pair(&cq, 8, 2).unwrap());
    a.connect(&b.addr()).unwrap();
    b.connect(&a.addr()).unwrap();
    let (qa, qb) = (a.addr().qpn, b.addr().qpn);
    // The sender's bytes, the receiver's slot and a plain destination (raw pointers only,
    // as the adapter writes them).
    let src = super::super::RawBuf::zeroed(64);
    let dst = super::super::RawBuf::zeroed(32);
    // SAFETY: both buffers outlive their registrations (dropped first, declared after).
    let (src_mr, dst_mr) = unsafe {
        (
            dev.register(src.addr(), 64, Access::Local).unwrap(),
            dev.register(dst.addr(), 32, Access::RemoteWrite).unwrap(),
        )
    };
    assert!(src.stage(&[b"one.....two.....three..."]));
    let at = |off: usize| (src.addr().wrapping_add(off), 8, src_mr.lkey());
    let (slot, plain) = (dst.addr() as u64, dst.addr() as u64 + 16);
    let seen = |off: usize| dst.copy_out(off, 8).unwrap();

    b.post_receives(&[100]).unwrap();
    write(&a, 1, at(0), (slot, dst_mr.rkey()), Some(0));
    assert_eq!(seen(0), b"one.....");
    assert_eq!(
        completions(&cq),
        [
            (qb, 100, consts::WC_SUCCESS, consts::WC_RECV_RDMA_WITH_IMM, 0),
            (qa, 1, consts::WC_SUCCESS, 1, 0)
        ]
    );

    // No receive left: the next one into the same slot must not overwrite it, and the
    // plain WRITE posted behind it waits with it.
    write(&a, 2, at(8), (slot, dst_mr.rkey()), Some(1));
    write(&a, 3, at(16), (plain, dst_mr.rkey()), None);
    assert_eq!(seen(0), b"one.....", "a WRITE with immediate landed without a receive");
    assert_eq!(seen(16), [0; 8], "a request passed one waiting on its queue pair");
    assert_eq!(completions(&cq), []);

    b.post_receives(&[101]).unwrap();
    assert_eq!((seen(0), seen(16)), (b"two.....".to_vec(), b"three...".to_vec()));
    assert_eq!(
        completions(&cq),
        [
            (qb, 101, consts::WC_SUCCESS, consts::WC_RECV_RDMA_WITH_IMM, 1),
            (qa, 2, consts::WC_SUCCESS, 1, 0),
            (qa, 3, consts::WC_SUCCESS, 1, 0)
        ]
    );

    // Waiting when the responder fails: nobody answers the retries any more.
    write(&a, 4, at(0), (slot, dst_mr.rkey()), Some(2));
    assert_eq!(completions(&cq), []);
    b.fail().unwrap();
    assert_eq!(completions(&cq), [(qa, 4, consts::WC_RETRY_EXC_ERR, 1, 0)]);
    assert_eq!(seen(0), b"two.....");
}
