//! The limit the RDMA transport is measured against: a plain verbs loop, as `ib_write_bw`
//! runs it. Two queue pairs of one device connected to each other, two registered buffers,
//! `batch` RDMA WRITEs (or READs) of `desc` bytes posted as one chain of at most the queue's
//! depth, the last signaled, its completion busy-polled. No planning, no keys exchanged, no
//! transfer state: what the hardware does with the same bytes.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::device::{Cq, Device, Mr, Qp};
use super::verbs::{self, consts, IbvSge, IbvWc};
use super::{RdmaConfig, Unavailable};

/// A loopback pair ready to move bytes.
#[derive(Debug)]
pub struct PlainLoop {
    // Fields drop in this order: queue pairs, registrations, then the buffers they cover.
    qp: Qp,
    _peer: Qp,
    src_mr: Mr,
    dst_mr: Mr,
    cq: Arc<Cq>,
    _dev: Arc<Device>,
    buffers: Buffers,
}

/// The two buffers the loop moves bytes between.
#[derive(Debug)]
enum Buffers {
    Host(Vec<u8>, Vec<u8>),
    #[cfg(feature = "cuda")]
    Gpu(crate::cuda::DeviceBuffer, crate::cuda::DeviceBuffer),
}

impl Buffers {
    /// The addresses work requests use: (src, dst).
    fn addrs(&self) -> (u64, u64) {
        match self {
            Buffers::Host(s, d) => (s.as_ptr() as u64, d.as_ptr() as u64),
            #[cfg(feature = "cuda")]
            Buffers::Gpu(s, d) => (s.ptr(), d.ptr()),
        }
    }

    fn len(&self) -> usize {
        match self {
            Buffers::Host(s, _) => s.len(),
            #[cfg(feature = "cuda")]
            Buffers::Gpu(s, _) => s.len(),
        }
    }
}

/// Two queue pairs of the device connected to each other.
fn connected(cfg: &RdmaConfig) -> Result<(Arc<Device>, Arc<Cq>, Qp, Qp), Unavailable> {
    let dev = Device::open(cfg.open_options())?;
    let err = |e: super::device::VerbsError| Unavailable(e.to_string());
    let cq = Arc::new(dev.completion_queue(4096).map_err(err)?);
    let depth = cfg.queue_depth;
    let qp = dev.queue_pair(&cq, depth, 1).map_err(err)?;
    let peer = dev.queue_pair(&cq, depth, 2).map_err(err)?;
    qp.connect(&peer.addr()).map_err(err)?;
    peer.connect(&qp.addr()).map_err(err)?;
    Ok((dev, cq, qp, peer))
}

impl PlainLoop {
    /// Opens the device and connects two queue pairs over `bytes`-long buffers.
    pub fn new(cfg: &RdmaConfig, bytes: usize) -> Result<PlainLoop, Unavailable> {
        let (dev, cq, qp, peer) = connected(cfg)?;
        let err = |e: super::device::VerbsError| Unavailable(e.to_string());
        let mut src = vec![0x5au8; bytes.max(1)];
        let mut dst = vec![0u8; bytes.max(1)];
        // SAFETY: both buffers move into the struct (a Vec's heap buffer does not move with
        // it), whose fields drop the registrations before the buffers.
        let src_mr = unsafe {
            dev.register(src.as_mut_ptr(), src.len(), super::device::Access::RemoteReadWrite)
        }
        .map_err(err)?;
        // SAFETY: as above.
        let dst_mr = unsafe {
            dev.register(dst.as_mut_ptr(), dst.len(), super::device::Access::RemoteReadWrite)
        }
        .map_err(err)?;
        let buffers = Buffers::Host(src, dst);
        Ok(PlainLoop { qp, _peer: peer, src_mr, dst_mr, cq, _dev: dev, buffers })
    }

    /// The same loop between two buffers of GPU `ordinal`'s memory, registered as the
    /// transport registers GPU regions (GPUDirect RDMA: a dma-buf, or `nvidia-peermem`).
    #[cfg(feature = "cuda")]
    pub fn gpu(cfg: &RdmaConfig, bytes: usize, ordinal: usize) -> Result<PlainLoop, Unavailable> {
        let (dev, cq, qp, peer) = connected(cfg)?;
        let how = super::gpu_direct(&dev).map_err(Unavailable)?;
        let cuda = crate::cuda::probe().map_err(|e| Unavailable(e.to_string()))?;
        let gpu = cuda.device(ordinal).map_err(|e| Unavailable(e.to_string()))?;
        let alloc = || gpu.alloc(bytes.max(1)).map_err(|e| Unavailable(e.to_string()));
        let (src, dst) = (alloc()?, alloc()?);
        let register = |b: &crate::cuda::DeviceBuffer| {
            let dmabuf = || cuda.dmabuf(b.ptr(), b.len()).map_err(|e| e.to_string());
            // SAFETY: the buffers move into the struct, whose fields drop the registrations
            // before the buffers; the dma-buf is the buffer's own.
            unsafe {
                super::register_gpu(
                    &dev,
                    how,
                    dmabuf,
                    b.ptr(),
                    b.len(),
                    super::device::Access::RemoteReadWrite,
                )
            }
            .map_err(Unavailable)
        };
        let (src_mr, dst_mr) = (register(&src)?, register(&dst)?);
        let buffers = Buffers::Gpu(src, dst);
        Ok(PlainLoop { qp, _peer: peer, src_mr, dst_mr, cq, _dev: dev, buffers })
    }

    /// One iteration: `batch` requests of `desc` bytes (WRITE: src → dst; READ: dst → src),
    /// waited for.
    pub fn run(&mut self, read: bool, desc: u64, batch: usize) -> Result<(), Unavailable> {
        let total = desc.saturating_mul(batch as u64);
        if total > self.buffers.len() as u64 || desc > u64::from(u32::MAX) {
            return Err(Unavailable(format!("{batch} × {desc} bytes do not fit the buffers")));
        }
        let depth = self.qp.depth() as usize;
        // Local `src`, remote `dst`: a WRITE moves src → dst, a READ dst → src.
        let (src, dst) = self.buffers.addrs();
        let (local, lkey) = (src, self.src_mr.lkey());
        let (remote, rkey) = (dst, self.dst_mr.rkey());
        let mut at = 0usize;
        while at < batch {
            let n = (batch - at).min(depth);
            let mut sges: Vec<IbvSge> = (0..n)
                .map(|i| IbvSge { addr: local + (at + i) as u64 * desc, length: desc as u32, lkey })
                .collect();
            let sge_base = sges.as_mut_ptr();
            let mut wrs: Vec<verbs::IbvSendWr> = (0..n)
                .map(|i| verbs::IbvSendWr {
                    wr_id: (at + i) as u64,
                    sg_list: sge_base.wrapping_add(i),
                    num_sge: 1,
                    opcode: if read { consts::WR_RDMA_READ } else { consts::WR_RDMA_WRITE },
                    send_flags: if i + 1 == n { consts::SEND_SIGNALED } else { 0 },
                    remote_addr: remote + (at + i) as u64 * desc,
                    rkey,
                    ..Default::default()
                })
                .collect();
            let base = wrs.as_mut_ptr();
            for k in 1..n {
                // SAFETY: k - 1 and k are inside `wrs`, which is not resized after this.
                unsafe { (*base.add(k - 1)).next = base.add(k) };
            }
            // SAFETY: the chain is linked and null-terminated; its entries and the buffers
            // they name live in `self` and are registered; this call waits for the chain's
            // last (signaled) completion before returning, so nothing is in flight after.
            unsafe { self.qp.post(wrs.as_mut_ptr()) }
                .map_err(|(e, _)| Unavailable(e.to_string()))?;
            let mut wc = [IbvWc::default(); 16];
            let deadline = Instant::now() + Duration::from_secs(10);
            'wait: loop {
                let got = self.cq.poll(&mut wc).map_err(|e| Unavailable(e.to_string()))?;
                for c in &wc[..got] {
                    if c.status != consts::WC_SUCCESS {
                        return Err(Unavailable(format!(
                            "plain loop: {}",
                            super::completion::status_name(c.status)
                        )));
                    }
                    if c.wr_id == (at + n - 1) as u64 {
                        break 'wait;
                    }
                }
                if Instant::now() > deadline {
                    return Err(Unavailable("plain loop: no completion within 10 s".into()));
                }
            }
            at += n;
        }
        Ok(())
    }
}
