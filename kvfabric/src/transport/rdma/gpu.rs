//! GPUDirect RDMA: how this host's adapter reaches GPU memory, and registering it so.

use super::*;

/// How the adapter reaches GPU memory (GPUDirect RDMA).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuDirect {
    /// A dma-buf the CUDA driver exports, registered with `ibv_reg_dmabuf_mr` (Linux 5.12,
    /// rdma-core 34, an open NVIDIA kernel module).
    DmaBuf,
    /// The device address registered with plain `ibv_reg_mr`, which the `nvidia-peermem`
    /// kernel module resolves.
    PeerMem,
}

impl std::fmt::Display for GpuDirect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            GpuDirect::DmaBuf => "dma-buf",
            GpuDirect::PeerMem => "nvidia-peermem",
        })
    }
}

/// Registers GPU memory at device address `addr` the way `how` says, addressed by that
/// address (the iova of a dma-buf's registration), as host memory is by its own.
///
/// # Safety
/// The memory must stay allocated until the registration is dropped; `dmabuf` must export
/// exactly it.
pub(super) unsafe fn register_gpu(
    dev: &Arc<Device>,
    how: GpuDirect,
    dmabuf: impl FnOnce() -> Result<crate::cuda::DmaBuf, String>,
    addr: u64,
    len: usize,
    access: Access,
) -> Result<Mr, String> {
    use std::os::fd::AsFd;
    match how {
        GpuDirect::DmaBuf => {
            let buf = dmabuf()?;
            // SAFETY: the caller keeps the memory; the descriptor is live for the call (the
            // registration holds the buffer after it).
            unsafe { dev.register_dmabuf(buf.fd.as_fd(), buf.offset, len, addr, access) }
        }
        // SAFETY: as above; nvidia-peermem resolves the device address.
        GpuDirect::PeerMem => unsafe { dev.register(addr as *mut u8, len, access) },
    }
    .map_err(|e| e.to_string())
}

/// Whether the nvidia-peermem module is loaded (the adapter then registers GPU memory by its
/// device address).
pub(super) fn peermem_loaded() -> bool {
    std::path::Path::new("/sys/module/nvidia_peermem").exists()
}

/// How this host's adapter can reach GPU memory, or why it cannot: a dma-buf where both the
/// verbs library and a GPU's driver support them, else `nvidia-peermem` where it is loaded.
#[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
pub(crate) fn gpu_direct(dev: &Device) -> Result<GpuDirect, String> {
    #[cfg(test)]
    if dev.info().name == fake::DEVICE {
        return Ok(GpuDirect::DmaBuf);
    }
    let cuda = crate::cuda::probe().map_err(|e| e.to_string())?;
    #[cfg(feature = "cuda")]
    {
        let dmabuf_gpus =
            cuda.devices().iter().filter(|d| d.dmabuf_supported().unwrap_or(false)).count();
        if dev.has_dmabuf() && dmabuf_gpus > 0 {
            return Ok(GpuDirect::DmaBuf);
        }
        if peermem_loaded() {
            return Ok(GpuDirect::PeerMem);
        }
        Err(format!(
            "GPU memory cannot be registered with {}: {}, and the nvidia-peermem module is not \
             loaded",
            dev.info().name,
            if dev.has_dmabuf() {
                "no GPU's driver exports dma-bufs"
            } else {
                "its libibverbs cannot register dma-bufs (rdma-core 34)"
            }
        ))
    }
    #[cfg(not(feature = "cuda"))]
    match cuda {}
}
