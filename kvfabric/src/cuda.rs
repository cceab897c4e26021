//! CUDA through the driver API: devices, device and pinned host memory, copies on streams
//! with events, and IPC handles that let another process on the host map a device buffer.
//!
//! The driver is reached through `cudarc` with dynamic loading (feature `cuda`): the build
//! needs no CUDA toolkit, and a binary built with the feature runs on machines without a GPU.
//! [`probe`] looks for `libcuda` before any driver call and turns every way of not having CUDA
//! — a build without the feature, no driver library, a driver that fails to start or lacks a
//! symbol, no device — into a typed [`CudaUnavailable`], never a panic; the result is cached
//! for the process.
//!
//! Memory allocated here is exportable: device buffers come from plain `cuMemAlloc` (pool
//! allocations cannot be exported through `cuIpcGetMemHandle`), pinned host buffers from
//! `cuMemHostAlloc` with `PORTABLE` (usable from every context, not write-combined, so the CPU
//! reads them at full speed). Copies are queued on a [`Stream`] and never synchronous; an
//! [`Event`] recorded after them completes as a future through one waiting thread per device
//! (no thread per copy, no polling).
//!
//! What needs no driver lives outside the feature: the errors, and the encoding of an IPC
//! handle and the device it belongs to as they travel in an agent's metadata
//! ([`DeviceExport`]), decoded from hostile input with typed errors.

use std::fmt;

/// Why CUDA cannot be used in this process.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CudaUnavailable {
    /// Built without the `cuda` feature.
    #[error("no CUDA: kvfabric was built without its `cuda` feature")]
    NotBuilt,
    /// No driver library could be loaded.
    #[error("no CUDA: no NVIDIA driver library (libcuda.so) on this machine")]
    NoDriver,
    /// The driver loaded but reports no device.
    #[error("no CUDA: the NVIDIA driver reports no GPU")]
    NoDevice,
    /// The driver loaded but failed to start (a stub library, a driver older than the
    /// bindings, a broken install).
    #[error("no CUDA: the NVIDIA driver failed to start: {0}")]
    Driver(String),
}

/// A failed CUDA operation.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// CUDA is not usable here.
    #[error(transparent)]
    Unavailable(#[from] CudaUnavailable),
    /// A driver call failed.
    #[error("CUDA {call} failed: {message}")]
    Driver {
        /// The driver function.
        call: &'static str,
        /// The driver's name and text for the error.
        message: String,
    },
    /// No device with this ordinal.
    #[error("no CUDA device {ordinal} (this process sees {count})")]
    NoSuchDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// Devices visible.
        count: usize,
    },
    /// No visible device has this UUID (an IPC handle from a GPU this process cannot see).
    #[error("no visible CUDA device has UUID {0}")]
    UnknownDevice(String),
    /// An address that is not device memory.
    #[error("address {0:#x} is not CUDA device memory")]
    NotDeviceMemory(u64),
    /// A malformed IPC export.
    #[error("bad CUDA IPC export: {0}")]
    BadExport(&'static str),
    /// A range outside a buffer.
    #[error("range {offset}+{len} is outside a {size}-byte CUDA buffer")]
    OutOfBounds {
        /// Start.
        offset: u64,
        /// Length.
        len: u64,
        /// The buffer's size.
        size: u64,
    },
}

/// Bytes of a CUDA IPC memory handle (`CUipcMemHandle`).
pub const IPC_HANDLE_BYTES: usize = 64;
/// Bytes of a CUDA device UUID.
pub const UUID_BYTES: usize = 16;

/// A device buffer exported to other processes of the host: which GPU (by UUID, since
/// ordinals differ between processes with different `CUDA_VISIBLE_DEVICES`), the IPC handle
/// of the allocation that holds it, and the buffer's place in that allocation. In metadata it
/// is JSON with lowercase hex strings:
/// `{"uuid": "<32 hex>", "handle": "<128 hex>", "len": N, "offset": N}`.
#[derive(Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "ExportJson", into = "ExportJson")]
pub struct DeviceExport {
    /// The GPU's UUID.
    pub uuid: [u8; UUID_BYTES],
    /// The allocation's `CUipcMemHandle`.
    pub handle: [u8; IPC_HANDLE_BYTES],
    /// Bytes of the exported buffer.
    pub len: u64,
    /// Where the buffer starts in the allocation the handle maps.
    pub offset: u64,
}

impl fmt::Debug for DeviceExport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceExport")
            .field("uuid", &hex(&self.uuid))
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

#[derive(serde::Serialize, serde::Deserialize)]
struct ExportJson {
    uuid: String,
    handle: String,
    len: u64,
    #[serde(default)]
    offset: u64,
}

impl TryFrom<ExportJson> for DeviceExport {
    type Error = CudaError;
    fn try_from(j: ExportJson) -> Result<Self, CudaError> {
        Ok(DeviceExport {
            uuid: unhex(&j.uuid).ok_or(CudaError::BadExport("uuid is not 32 hex digits"))?,
            handle: unhex(&j.handle).ok_or(CudaError::BadExport("handle is not 128 hex digits"))?,
            len: j.len,
            offset: j.offset,
        })
    }
}

impl From<DeviceExport> for ExportJson {
    fn from(e: DeviceExport) -> Self {
        ExportJson { uuid: hex(&e.uuid), handle: hex(&e.handle), len: e.len, offset: e.offset }
    }
}

/// Lowercase hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(DIGITS[usize::from(b >> 4)] as char);
        s.push(DIGITS[usize::from(b & 15)] as char);
    }
    s
}

/// Exactly `N` bytes from `2N` hex digits (either case); None for anything else.
fn unhex<const N: usize>(s: &str) -> Option<[u8; N]> {
    let s = s.as_bytes();
    if s.len() != 2 * N {
        return None;
    }
    let digit = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    let mut out = [0u8; N];
    for (i, o) in out.iter_mut().enumerate() {
        *o = (digit(s[2 * i])? << 4) | digit(s[2 * i + 1])?;
    }
    Some(out)
}

/// Checks `offset..offset+len` against a buffer of `size` bytes (no overflow).
pub fn check_range(offset: u64, len: u64, size: u64) -> Result<(), CudaError> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(CudaError::OutOfBounds { offset, len, size }),
    }
}

/// A range of device memory exported as a dma-buf ([`Cuda::dmabuf`]), for an RDMA adapter to
/// register (GPUDirect RDMA).
#[derive(Debug)]
pub struct DmaBuf {
    /// The dma-buf.
    pub fd: std::os::fd::OwnedFd,
    /// Where the range's first byte lies in it.
    pub offset: u64,
}

#[cfg(feature = "cuda")]
mod driver;
#[cfg(feature = "cuda")]
pub use driver::{
    CopyOp, CopyTable, Cuda, Device, DeviceBuffer, DevicePointer, Event, HostRegistration,
    IpcMapping, PinnedBuffer, Stream,
};

/// CUDA in this process: the devices, or why there are none. Looked up once; never panics.
#[cfg(feature = "cuda")]
pub fn probe() -> Result<std::sync::Arc<Cuda>, CudaUnavailable> {
    driver::probe()
}

/// CUDA in this process: without the `cuda` feature, never.
#[cfg(not(feature = "cuda"))]
pub fn probe() -> Result<std::convert::Infallible, CudaUnavailable> {
    Err(CudaUnavailable::NotBuilt)
}

/// Whether CUDA is usable in this process, or why not.
pub fn available() -> Result<(), CudaUnavailable> {
    probe().map(|_| ())
}

/// The names of the GPUs this process sees, by ordinal, or why it sees none (`/health`).
pub fn device_names() -> Result<Vec<String>, CudaUnavailable> {
    #[cfg(feature = "cuda")]
    return probe().map(|c| c.devices().iter().map(|d| d.name().to_string()).collect());
    #[cfg(not(feature = "cuda"))]
    return probe().map(|never| match never {});
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> DeviceExport {
        let mut handle = [0u8; IPC_HANDLE_BYTES];
        for (i, b) in handle.iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(37) ^ 0xa5;
        }
        DeviceExport { uuid: *b"GPU-0123456789ab", handle, len: 1 << 30, offset: 4096 }
    }

    #[test]
    fn an_export_round_trips_through_json_metadata() {
        let e = sample();
        let json = serde_json::to_string(&e).unwrap();
        assert!(json.contains(&hex(&e.handle)), "{json}");
        assert_eq!(serde_json::from_str::<DeviceExport>(&json).unwrap(), e);
        // Upper-case hex from another implementation is accepted.
        let upper = json.replace(&hex(&e.uuid), &hex(&e.uuid).to_uppercase());
        assert_eq!(serde_json::from_str::<DeviceExport>(&upper).unwrap(), e);
    }

    #[test]
    fn hostile_exports_are_typed_errors() {
        let good = serde_json::to_value(sample()).unwrap();
        let cases: Vec<(&str, serde_json::Value)> = vec![
            ("uuid", serde_json::json!("00")),
            ("uuid", serde_json::json!("zz".repeat(16))),
            ("uuid", serde_json::json!("ab".repeat(17))),
            ("handle", serde_json::json!("ab".repeat(63))),
            ("handle", serde_json::json!(format!("{}é", "a".repeat(126)))),
            ("handle", serde_json::json!(12)),
            ("len", serde_json::json!(-1)),
            ("len", serde_json::json!("big")),
            ("offset", serde_json::json!(-4096)),
        ];
        for (field, value) in cases {
            let mut v = good.clone();
            v[field] = value.clone();
            let r = serde_json::from_value::<DeviceExport>(v);
            assert!(r.is_err(), "{field} = {value} was accepted");
        }
        let mut missing = good.clone();
        missing.as_object_mut().unwrap().remove("handle");
        assert!(serde_json::from_value::<DeviceExport>(missing).is_err());
    }

    #[test]
    fn ranges_are_checked_without_overflow() {
        assert!(check_range(0, 10, 10).is_ok());
        assert!(check_range(10, 0, 10).is_ok());
        assert!(matches!(check_range(5, 6, 10), Err(CudaError::OutOfBounds { .. })));
        assert!(matches!(check_range(u64::MAX, 2, 10), Err(CudaError::OutOfBounds { .. })));
    }

    #[test]
    fn probe_says_why_there_is_no_cuda() {
        // On a machine with a driver and a GPU this is Ok; everywhere else it must be a typed
        // reason that names CUDA, never a panic.
        match probe() {
            Ok(_) => {}
            Err(e) => assert!(e.to_string().starts_with("no CUDA: "), "{e}"),
        }
        #[cfg(not(feature = "cuda"))]
        assert_eq!(probe().err(), Some(CudaUnavailable::NotBuilt));
    }
}
