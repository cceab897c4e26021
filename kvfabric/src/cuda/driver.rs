//! The driver half of [`crate::cuda`]: everything that calls into `libcuda`.
//!
//! Contexts are the devices' primary contexts (shared with an engine in the same process that
//! uses the runtime API, as PyTorch does), bound to the calling thread before every raw call.
//!
//! Just over 1,000 lines because it is one unsafe boundary: the driver API's types, the
//! function table loaded at run time and their safe wrappers, kept in one file so that every
//! `unsafe` block of CUDA is read in one place.

use std::ffi::c_void;
use std::sync::{mpsc, Arc, OnceLock};

use cudarc::driver::{result, sys, CudaContext, DriverError};

use super::{CudaError, CudaUnavailable, DeviceExport, DmaBuf, IPC_HANDLE_BYTES, UUID_BYTES};

fn driver(call: &'static str) -> impl FnOnce(DriverError) -> CudaError {
    move |e| CudaError::Driver { call, message: format!("{e:?}") }
}

/// CUDA in this process: its visible devices.
#[derive(Debug)]
pub struct Cuda {
    devices: Vec<Arc<Device>>,
}

/// Looks for the driver library, starts the driver and opens every device, once.
pub(super) fn probe() -> Result<Arc<Cuda>, CudaUnavailable> {
    static CUDA: OnceLock<Result<Arc<Cuda>, CudaUnavailable>> = OnceLock::new();
    CUDA.get_or_init(|| {
        // SAFETY: dlopen of the candidate driver library names, which runs their initialisers;
        // that is what loading the NVIDIA driver means.
        if !unsafe { sys::is_culib_present() } {
            return Err(CudaUnavailable::NoDriver);
        }
        // cudarc resolves each symbol on first use and panics on one the driver lacks (a
        // driver older than the bindings): contained here, reported as a driver failure.
        let opened = std::panic::catch_unwind(open_devices).unwrap_or_else(|panic| {
            let what = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "a driver call panicked".into());
            Err(CudaUnavailable::Driver(what))
        });
        let cuda = opened?;
        tracing::info!(
            devices = cuda.devices.len(),
            names = ?cuda.devices.iter().map(|d| d.name.as_str()).collect::<Vec<_>>(),
            "CUDA available"
        );
        Ok(Arc::new(cuda))
    })
    .clone()
}

fn open_devices() -> Result<Cuda, CudaUnavailable> {
    let count = match CudaContext::device_count() {
        Ok(n) => usize::try_from(n).unwrap_or(0),
        Err(DriverError(sys::CUresult::CUDA_ERROR_NO_DEVICE)) => 0,
        Err(e) => return Err(CudaUnavailable::Driver(format!("{e:?}"))),
    };
    if count == 0 {
        return Err(CudaUnavailable::NoDevice);
    }
    let mut devices = Vec::with_capacity(count);
    for ordinal in 0..count {
        let fail = |e: DriverError| CudaUnavailable::Driver(format!("device {ordinal}: {e:?}"));
        let ctx = CudaContext::new(ordinal).map_err(fail)?;
        let name = ctx.name().map_err(fail)?;
        // c_char is i8 on x86_64 and u8 on aarch64: reinterpret each byte.
        let uuid = ctx.uuid().map_err(fail)?.bytes.map(|b| b as u8);
        devices.push(Arc::new(Device {
            ordinal,
            name,
            uuid,
            ctx,
            waiter: OnceLock::new(),
            kernels: OnceLock::new(),
            events: std::sync::Mutex::default(),
        }));
    }
    Ok(Cuda { devices })
}

impl Cuda {
    /// The visible devices, by ordinal.
    pub fn devices(&self) -> &[Arc<Device>] {
        &self.devices
    }

    /// Device `ordinal`.
    pub fn device(&self, ordinal: usize) -> Result<Arc<Device>, CudaError> {
        self.devices
            .get(ordinal)
            .cloned()
            .ok_or(CudaError::NoSuchDevice { ordinal, count: self.devices.len() })
    }

    /// What the driver knows of device address `addr`: that it is device memory, of which
    /// device, and the allocation around it, which must hold `addr..addr+len`. This is how
    /// an engine's memory registered by address is checked (and how its IPC export finds the
    /// allocation's base).
    pub fn locate(&self, addr: u64, len: usize) -> Result<DevicePointer, CudaError> {
        let any = self.devices.first().ok_or(CudaUnavailable::NoDevice)?;
        any.bind()?;
        let mut memory_type: u32 = 0;
        // SAFETY: a u32 out-parameter for an attribute whose value is a CUmemorytype (u32);
        // the driver validates `addr`.
        unsafe {
            sys::cuPointerGetAttribute(
                (&mut memory_type as *mut u32).cast(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                addr,
            )
        }
        .result()
        .map_err(|_| CudaError::NotDeviceMemory(addr))?;
        if memory_type != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
            return Err(CudaError::NotDeviceMemory(addr));
        }
        let mut ordinal: std::ffi::c_int = -1;
        // SAFETY: a c_int out-parameter for the device-ordinal attribute.
        unsafe {
            sys::cuPointerGetAttribute(
                (&mut ordinal as *mut std::ffi::c_int).cast(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                addr,
            )
        }
        .result()
        .map_err(driver("cuPointerGetAttribute"))?;
        let ordinal = usize::try_from(ordinal).map_err(|_| CudaError::NotDeviceMemory(addr))?;
        let device = self.device(ordinal)?;
        device.bind()?;
        let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
        // SAFETY: out-parameters on the stack; the driver validates `addr`.
        unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, addr) }
            .result()
            .map_err(driver("cuMemGetAddressRange"))?;
        let end = (addr - base).checked_add(len as u64);
        if end.is_none_or(|e| e > size as u64) {
            return Err(CudaError::OutOfBounds {
                offset: addr - base,
                len: len as u64,
                size: size as u64,
            });
        }
        Ok(DevicePointer { ordinal, base, size })
    }

    /// A dma-buf of the device memory at `addr..addr+len`, for an RDMA adapter to register
    /// (GPUDirect RDMA). The allocation around the range is exported whole, its ends rounded
    /// out to host pages as the driver requires; the registration then covers the range
    /// only, at [`DmaBuf::offset`] into it.
    pub fn dmabuf(&self, addr: u64, len: usize) -> Result<DmaBuf, CudaError> {
        let at = self.locate(addr, len)?;
        let device = self.device(at.ordinal)?;
        if !device.dmabuf_supported()? {
            return Err(CudaError::Driver {
                call: "cuMemGetHandleForAddressRange",
                message: format!(
                    "GPU {} ({}) cannot export dma-bufs: its driver or kernel predates them",
                    at.ordinal, device.name
                ),
            });
        }
        device.bind()?;
        // SAFETY: sysconf has no preconditions.
        let page = u64::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) })
            .ok()
            .filter(|p| p.is_power_of_two())
            .unwrap_or(4096);
        let start = at.base & !(page - 1);
        let end = (at.base + at.size as u64).div_ceil(page) * page;
        let mut fd: std::ffi::c_int = -1;
        // SAFETY: a c_int out-parameter for a dma-buf descriptor; the range is the live
        // allocation `locate` found, rounded to pages as the call requires.
        unsafe {
            sys::cuMemGetHandleForAddressRange(
                (&mut fd as *mut std::ffi::c_int).cast(),
                start,
                (end - start) as usize,
                sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                0,
            )
        }
        .result()
        .map_err(driver("cuMemGetHandleForAddressRange"))?;
        if fd < 0 {
            return Err(CudaError::Driver {
                call: "cuMemGetHandleForAddressRange",
                message: format!("returned descriptor {fd}"),
            });
        }
        // SAFETY: a descriptor the driver just opened for us; nothing else owns it.
        let fd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        Ok(DmaBuf { fd, offset: addr - start })
    }

    /// The visible device with this UUID.
    pub fn device_by_uuid(&self, uuid: &[u8; UUID_BYTES]) -> Result<Arc<Device>, CudaError> {
        self.devices
            .iter()
            .find(|d| &d.uuid == uuid)
            .cloned()
            .ok_or_else(|| CudaError::UnknownDevice(super::hex(uuid)))
    }
}

/// A device address as the driver sees it ([`Cuda::locate`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DevicePointer {
    /// The device's ordinal.
    pub ordinal: usize,
    /// The start of the allocation that holds it.
    pub base: u64,
    /// The allocation's size.
    pub size: usize,
}

/// One GPU.
pub struct Device {
    ordinal: usize,
    name: String,
    uuid: [u8; UUID_BYTES],
    ctx: Arc<CudaContext>,
    waiter: OnceLock<Result<mpsc::Sender<Wait>, String>>,
    /// The gather copy, JIT-compiled for this device on first use (or why it could not be).
    kernels: OnceLock<Result<Kernels, String>>,
    /// Completed events without timing, for reuse: creating and destroying one per
    /// transfer costs driver calls on the data path.
    events: std::sync::Mutex<Vec<Raw>>,
}

/// Reusable events kept per device at most.
const EVENTS_KEPT: usize = 256;

/// The gather copy (`copy_table.ptx`), NUL-terminated for `cuModuleLoadData`.
const COPY_TABLE_PTX: &str = concat!(include_str!("copy_table.ptx"), "\0");
/// Threads per CTA of the gather copy.
const COPY_THREADS: u32 = 256;
/// Bytes of one copy that one CTA of the gather copy moves (more CTAs for longer copies).
/// Measured on an H200: 64 KiB shares beat one wave of CTAs with 1 MiB shares (0.82× against
/// 0.77× of one contiguous copy engine copy, 16 copies of 64 MiB).
const COPY_CTA_BYTES: u64 = 64 << 10;
/// Bytes of one entry of a copy table: src, dst, len.
const COPY_ENTRY_BYTES: usize = 24;

/// A device's loaded kernels. The module stays loaded for the process's life, as the
/// device's primary context does.
#[derive(Debug)]
struct Kernels {
    _module: Raw,
    copy_table: Raw,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device").field("ordinal", &self.ordinal).field("name", &self.name).finish()
    }
}

/// An event to wait for and who to tell.
type Wait = (Arc<EventInner>, tokio::sync::oneshot::Sender<Result<(), CudaError>>);

impl Device {
    /// Its ordinal in this process.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Its name (`NVIDIA H200`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its UUID, the same in every process.
    pub fn uuid(&self) -> [u8; UUID_BYTES] {
        self.uuid
    }

    /// Whether the driver can export this device's memory as dma-bufs (for GPUDirect RDMA
    /// without the `nvidia-peermem` module).
    pub fn dmabuf_supported(&self) -> Result<bool, CudaError> {
        let mut v: std::ffi::c_int = 0;
        // SAFETY: a c_int out-parameter for an integer attribute of a valid device.
        unsafe {
            sys::cuDeviceGetAttribute(
                &mut v,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED,
                self.ctx.cu_device(),
            )
        }
        .result()
        .map_err(driver("cuDeviceGetAttribute"))?;
        Ok(v != 0)
    }

    fn bind(&self) -> Result<(), CudaError> {
        self.ctx.bind_to_thread().map_err(driver("cuCtxSetCurrent"))
    }

    /// Allocates `len` bytes of device memory with plain `cuMemAlloc`, so that it can be
    /// exported to other processes. Its contents are undefined.
    pub fn alloc(self: &Arc<Self>, len: usize) -> Result<DeviceBuffer, CudaError> {
        self.bind()?;
        // SAFETY: the context is current; the memory is only ever addressed through the
        // returned buffer, which frees it once.
        let ptr = unsafe { result::malloc_sync(len.max(1)) }.map_err(driver("cuMemAlloc"))?;
        Ok(DeviceBuffer { device: self.clone(), ptr, len })
    }

    /// Allocates `len` bytes of pinned host memory, usable by every context (`PORTABLE`),
    /// zeroed.
    pub fn alloc_pinned(self: &Arc<Self>, len: usize) -> Result<PinnedBuffer, CudaError> {
        self.bind()?;
        // SAFETY: the context is current; the memory is owned by the returned buffer.
        let ptr = unsafe { result::malloc_host(len.max(1), sys::CU_MEMHOSTALLOC_PORTABLE) }
            .map_err(driver("cuMemHostAlloc"))?;
        // SAFETY: a fresh allocation of at least `len` bytes that nobody else sees yet.
        unsafe { std::ptr::write_bytes(ptr.cast::<u8>(), 0, len) };
        Ok(PinnedBuffer { device: self.clone(), ptr: ptr.cast(), len })
    }

    /// A table for [`Stream::copy_table`] of up to `entries` copies: written in page-locked
    /// host memory, copied to device memory (where the kernel's many readers hit the GPU's
    /// caches instead of crossing PCIe) in stream order before the kernel runs.
    pub fn alloc_copy_table(self: &Arc<Self>, entries: usize) -> Result<CopyTable, CudaError> {
        let entries = entries.max(1);
        let len = entries * COPY_ENTRY_BYTES;
        Ok(CopyTable { host: self.alloc_pinned(len)?, device: self.alloc(len)?, entries })
    }

    /// The gather copy's function, loading the module on first use.
    fn copy_kernel(&self) -> Result<sys::CUfunction, CudaError> {
        let loaded = self.kernels.get_or_init(|| {
            self.bind().map_err(|e| e.to_string())?;
            let mut module: sys::CUmodule = std::ptr::null_mut();
            // SAFETY: a NUL-terminated PTX image, JIT-compiled for this context's device.
            unsafe { sys::cuModuleLoadData(&mut module, COPY_TABLE_PTX.as_ptr().cast()) }
                .result()
                .map_err(|e| format!("cuModuleLoadData: {e:?}"))?;
            let mut f: sys::CUfunction = std::ptr::null_mut();
            // SAFETY: the module just loaded; the name is NUL-terminated.
            unsafe { sys::cuModuleGetFunction(&mut f, module, c"kvf_copy_table".as_ptr()) }
                .result()
                .map_err(|e| format!("cuModuleGetFunction: {e:?}"))?;
            tracing::debug!(device = self.ordinal, "CUDA gather copy loaded");
            Ok(Kernels { _module: Raw(module.cast()), copy_table: Raw(f.cast()) })
        });
        match loaded {
            Ok(k) => Ok(k.copy_table.0.cast()),
            Err(e) => Err(CudaError::Driver { call: "cuModuleLoadData", message: e.clone() }),
        }
    }

    /// Page-locks existing host memory (`cuMemHostRegister`, `PORTABLE`) so that copies
    /// to and from it run asynchronously at full speed; undone when the result drops.
    ///
    /// # Safety
    /// `ptr..ptr+len` must be mapped host memory that stays mapped until the registration
    /// is dropped.
    pub unsafe fn register_host(
        self: &Arc<Self>,
        ptr: *mut u8,
        len: usize,
    ) -> Result<HostRegistration, CudaError> {
        self.bind()?;
        // SAFETY: the caller guarantees the range is mapped for the registration's life.
        unsafe {
            sys::cuMemHostRegister_v2(ptr.cast(), len, sys::CU_MEMHOSTREGISTER_PORTABLE)
                .result()
                .map_err(driver("cuMemHostRegister"))?;
        }
        Ok(HostRegistration { device: self.clone(), ptr: ptr as usize })
    }

    /// A new non-blocking stream.
    pub fn stream(self: &Arc<Self>) -> Result<Stream, CudaError> {
        self.bind()?;
        let raw = result::stream::create(result::stream::StreamKind::NonBlocking)
            .map_err(driver("cuStreamCreate"))?;
        Ok(Stream { device: self.clone(), raw: Raw(raw.cast()) })
    }

    /// Whether this device can read and write `other`'s memory directly (NVLink or PCIe
    /// peer-to-peer).
    pub fn can_access_peer(&self, other: &Device) -> Result<bool, CudaError> {
        if self.ordinal == other.ordinal {
            return Ok(true);
        }
        let mut ok = 0;
        // SAFETY: an out-parameter on the stack and two valid device handles.
        unsafe {
            sys::cuDeviceCanAccessPeer(&mut ok, self.ctx.cu_device(), other.ctx.cu_device())
                .result()
                .map_err(driver("cuDeviceCanAccessPeer"))?;
        }
        Ok(ok != 0)
    }

    /// Exports `buf` for other processes of this host.
    pub fn export(&self, buf: &DeviceBuffer) -> Result<DeviceExport, CudaError> {
        // SAFETY: `buf` is a live cuMemAlloc allocation of this device, whole.
        unsafe { self.export_range(buf.ptr, buf.len as u64, 0) }
    }

    /// Exports `len` bytes at `offset` into the allocation that starts at `base` (found with
    /// [`Cuda::locate`]): an engine's memory.
    ///
    /// # Safety
    /// `base` must be the start of a live allocation of this device that holds
    /// `offset..offset+len`.
    pub unsafe fn export_range(
        &self,
        base: u64,
        len: u64,
        offset: u64,
    ) -> Result<DeviceExport, CudaError> {
        self.bind()?;
        // SAFETY: CUipcMemHandle is plain bytes; zeroes are a valid value to overwrite.
        let mut handle: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
        // SAFETY: `base` is a live allocation of this device (the caller's contract).
        unsafe {
            sys::cuIpcGetMemHandle(&mut handle, base)
                .result()
                .map_err(driver("cuIpcGetMemHandle"))?;
        }
        let handle: [u8; IPC_HANDLE_BYTES] = handle.reserved.map(|b| b as u8);
        Ok(DeviceExport { uuid: self.uuid, handle, len, offset })
    }

    /// Maps a buffer another process exported (on this device: see
    /// [`Cuda::device_by_uuid`]).
    pub fn open(self: &Arc<Self>, export: &DeviceExport) -> Result<IpcMapping, CudaError> {
        if export.uuid != self.uuid {
            return Err(CudaError::UnknownDevice(super::hex(&export.uuid)));
        }
        let len = usize::try_from(export.len).map_err(|_| CudaError::BadExport("len"))?;
        self.bind()?;
        // SAFETY: as above; the bytes are the exporter's handle, which the driver validates.
        let mut handle: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
        for (d, s) in handle.reserved.iter_mut().zip(export.handle) {
            *d = s as _;
        }
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: an out-parameter on the stack; the driver checks the handle.
        unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut ptr,
                handle,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
            .result()
            .map_err(driver("cuIpcOpenMemHandle"))?;
        }
        // The handle maps the whole allocation; the export is a range of it.
        Ok(IpcMapping { device: self.clone(), base: ptr, ptr: ptr + export.offset, len })
    }

    /// Queues a wait for `event` on this device's waiting thread (started on first use).
    fn wait(
        &self,
        event: Arc<EventInner>,
    ) -> tokio::sync::oneshot::Receiver<Result<(), CudaError>> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let waiter = self.waiter.get_or_init(|| {
            let (wtx, wrx) = mpsc::channel::<Wait>();
            let ctx = self.ctx.clone();
            std::thread::Builder::new()
                .name(format!("kvfabric-cuda-{}", self.ordinal))
                .spawn(move || {
                    let bound = ctx.bind_to_thread().map_err(driver("cuCtxSetCurrent"));
                    for (event, done) in wrx {
                        let r = match &bound {
                            // SAFETY: the event is alive (the Arc travels with the wait) and
                            // was created in this context.
                            Ok(()) => unsafe { result::event::synchronize(event.raw.0.cast()) }
                                .map_err(driver("cuEventSynchronize")),
                            Err(e) => Err(CudaError::Driver {
                                call: "cuCtxSetCurrent",
                                message: e.to_string(),
                            }),
                        };
                        let _ = done.send(r);
                    }
                })
                .map(|_| wtx)
                .map_err(|e| e.to_string())
        });
        match waiter {
            Ok(w) => {
                if let Err(mpsc::SendError((_, done))) = w.send((event, tx)) {
                    let _ = done.send(Err(CudaError::Driver {
                        call: "wait",
                        message: "the CUDA waiting thread is gone".into(),
                    }));
                }
            }
            Err(e) => {
                let _ = tx.send(Err(CudaError::Driver {
                    call: "wait",
                    message: format!("no CUDA waiting thread: {e}"),
                }));
            }
        }
        rx
    }
}

/// A raw driver handle (stream, event): a pointer the driver accepts from any thread once
/// the owning context is current.
#[derive(Debug, Clone, Copy)]
struct Raw(*mut c_void);
// SAFETY: CUDA driver handles are process-wide; every call through one binds its context
// first, and the owning wrapper frees it once.
unsafe impl Send for Raw {}
// SAFETY: as above; the driver serializes calls on one handle.
unsafe impl Sync for Raw {}

/// Device memory allocated by kvfabric, freed on drop.
#[derive(Debug)]
pub struct DeviceBuffer {
    device: Arc<Device>,
    ptr: sys::CUdeviceptr,
    len: usize,
}

impl DeviceBuffer {
    /// Its device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    /// Its size.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Never empty (at least one byte is allocated).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Its device.
    pub fn device(&self) -> &Arc<Device> {
        &self.device
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // SAFETY: allocated by cuMemAlloc in `Device::alloc`, freed once here. Copies
            // that use it hold the buffer (or a lease on the region that owns it) until done.
            if let Err(e) = unsafe { result::free_sync(self.ptr) } {
                tracing::warn!(error = ?e, "cuMemFree failed");
            }
        }
    }
}

/// Pinned host memory allocated by kvfabric, freed on drop.
#[derive(Debug)]
pub struct PinnedBuffer {
    device: Arc<Device>,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: owned host memory; access goes through `&self`/`&mut self` slices or raw copies
// whose callers guarantee exclusivity.
unsafe impl Send for PinnedBuffer {}
// SAFETY: as above.
unsafe impl Sync for PinnedBuffer {}

impl PinnedBuffer {
    /// Its address.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }
    /// Its size.
    pub fn len(&self) -> usize {
        self.len
    }
    /// True for a zero-length buffer.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Its bytes. Copies queued into it must have completed.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: our live allocation of `len` bytes, zeroed at allocation.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
    /// Its bytes, mutably. Copies queued from or into it must have completed.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, borrowed mutably through `self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // SAFETY: allocated by cuMemHostAlloc, freed once here.
            if let Err(e) = unsafe { result::free_host(self.ptr.cast()) } {
                tracing::warn!(error = ?e, "cuMemFreeHost failed");
            }
        }
    }
}

/// Host memory page-locked by [`Device::register_host`]; unregistered on drop.
#[derive(Debug)]
pub struct HostRegistration {
    device: Arc<Device>,
    ptr: usize,
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // SAFETY: registered in `register_host` with this address, unregistered once.
            let r = unsafe { sys::cuMemHostUnregister(self.ptr as *mut c_void) }.result();
            if let Err(e) = r {
                tracing::warn!(error = ?e, "cuMemHostUnregister failed");
            }
        }
    }
}

/// Another process's device buffer mapped into this one; closed on drop.
#[derive(Debug)]
pub struct IpcMapping {
    device: Arc<Device>,
    base: sys::CUdeviceptr,
    ptr: sys::CUdeviceptr,
    len: usize,
}

impl IpcMapping {
    /// The ordinal of its device in this process.
    pub fn ordinal(&self) -> usize {
        self.device.ordinal
    }
    /// Its device address in this process.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    /// Its size.
    pub fn len(&self) -> usize {
        self.len
    }
    /// True for a zero-length mapping.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // SAFETY: opened by cuIpcOpenMemHandle in `Device::open`, closed once here.
            if let Err(e) = unsafe { sys::cuIpcCloseMemHandle(self.base) }.result() {
                tracing::warn!(error = ?e, "cuIpcCloseMemHandle failed");
            }
        }
    }
}

/// Page-locked host memory that the GPU reads a list of copies from ([`Stream::copy_table`]).
#[derive(Debug)]
pub struct CopyTable {
    host: PinnedBuffer,
    device: DeviceBuffer,
    entries: usize,
}

/// One copy of a batch: addresses in the unified address space (device pointers, or host
/// pointers as numbers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyOp {
    /// Where the bytes go.
    pub dst: u64,
    /// Where they come from.
    pub src: u64,
    /// How many.
    pub len: usize,
}

/// Whether this driver has `cuMemcpyBatchAsync` (CUDA 12.8 and later): looked up once, so
/// that an older driver never reaches cudarc's panic on a missing symbol.
fn batch_memcpy() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        // SAFETY: a symbol lookup in the driver library that `probe` already loaded; the
        // symbol is not called here.
        let has =
            unsafe { sys::culib().get::<unsafe extern "C" fn()>(b"cuMemcpyBatchAsync") }.is_ok();
        tracing::debug!(has, "cuMemcpyBatchAsync");
        has
    })
}

/// A CUDA stream: copies queued on it run in order, asynchronously.
#[derive(Debug)]
pub struct Stream {
    device: Arc<Device>,
    raw: Raw,
}

impl Stream {
    fn cu(&self) -> sys::CUstream {
        self.raw.0.cast()
    }

    /// Its device.
    pub fn device(&self) -> &Arc<Device> {
        &self.device
    }

    /// Queues a copy of `len` bytes from host `src` to device `dst`.
    ///
    /// # Safety
    /// Both ranges must be valid for `len` bytes until an event recorded after this copy has
    /// completed; for an asynchronous copy `src` must be pinned (else the driver stages it
    /// and the call returns once it is staged).
    pub unsafe fn copy_h2d(&self, dst: u64, src: *const u8, len: usize) -> Result<(), CudaError> {
        self.device.bind()?;
        // SAFETY: the caller guarantees both ranges; the stream belongs to this context.
        unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.cast(), len, self.cu()) }
            .result()
            .map_err(driver("cuMemcpyHtoDAsync"))
    }

    /// Queues a copy of `len` bytes from device `src` to host `dst`.
    ///
    /// # Safety
    /// As [`Stream::copy_h2d`], with `dst` writable and unread until the copy completed.
    pub unsafe fn copy_d2h(&self, dst: *mut u8, src: u64, len: usize) -> Result<(), CudaError> {
        self.device.bind()?;
        // SAFETY: as above.
        unsafe { sys::cuMemcpyDtoHAsync_v2(dst.cast(), src, len, self.cu()) }
            .result()
            .map_err(driver("cuMemcpyDtoHAsync"))
    }

    /// Queues a copy of `len` bytes between device addresses (on one device, or between
    /// devices with unified addressing; IPC mappings included).
    ///
    /// # Safety
    /// As [`Stream::copy_h2d`].
    pub unsafe fn copy_d2d(&self, dst: u64, src: u64, len: usize) -> Result<(), CudaError> {
        self.device.bind()?;
        // SAFETY: as above.
        unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, len, self.cu()) }
            .result()
            .map_err(driver("cuMemcpyDtoDAsync"))
    }

    /// Queues every copy of `copies` (host addresses as numbers: unified addressing tells
    /// the driver each side's memory) with one `cuMemcpyBatchAsync` where the driver has it
    /// (CUDA 12.8 and later), else one `cuMemcpyAsync` each. Copies within one call run in
    /// no particular order, so none may read what another writes.
    ///
    /// # Safety
    /// Every range must be valid for its length until an event recorded after this call has
    /// completed; host sources must be pinned for the copies to be asynchronous.
    pub unsafe fn copy_batch(&self, copies: &[CopyOp]) -> Result<(), CudaError> {
        self.device.bind()?;
        if copies.len() > 1 && batch_memcpy() {
            let dsts: Vec<sys::CUdeviceptr> = copies.iter().map(|c| c.dst).collect();
            let srcs: Vec<sys::CUdeviceptr> = copies.iter().map(|c| c.src).collect();
            let sizes: Vec<usize> = copies.iter().map(|c| c.len).collect();
            // SAFETY: plain C data; zero is "no hint" for both locations.
            let mut attrs: sys::CUmemcpyAttributes = unsafe { std::mem::zeroed() };
            attrs.srcAccessOrder = sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
            let mut first = 0usize;
            let mut failed = usize::MAX;
            // SAFETY: three arrays of `copies.len()` entries, one attribute applying from
            // copy 0, our live stream; the ranges are the caller's guarantee. The driver
            // reads the arrays during the call only.
            let r = unsafe {
                sys::cuMemcpyBatchAsync(
                    dsts.as_ptr().cast_mut(),
                    srcs.as_ptr().cast_mut(),
                    sizes.as_ptr().cast_mut(),
                    copies.len(),
                    &mut attrs,
                    &mut first,
                    1,
                    &mut failed,
                    self.cu(),
                )
            };
            match r {
                sys::CUresult::CUDA_SUCCESS => return Ok(()),
                e => {
                    // The copies are idempotent (no copy of a call reads what another
                    // writes), so queuing them again one by one after a partial batch
                    // lands the same bytes; the driver's answer is logged once.
                    static SAID: std::sync::Once = std::sync::Once::new();
                    SAID.call_once(|| {
                        tracing::warn!(error = ?e, failed_copy = failed,
                            "cuMemcpyBatchAsync failed: queuing copies one by one");
                    });
                }
            }
        }
        for c in copies {
            // SAFETY: as above, one copy at a time.
            unsafe { sys::cuMemcpyAsync(c.dst, c.src, c.len, self.cu()) }
                .result()
                .map_err(driver("cuMemcpyAsync"))?;
        }
        Ok(())
    }

    /// Queues device-to-device `copies` (addresses of this stream's device, its IPC mappings
    /// included) as one launch of the gather kernel, which moves scattered blocks at memory
    /// bandwidth where the copy engines pay microseconds per copy. `table` is filled here.
    ///
    /// # Safety
    /// As [`Stream::copy_batch`], every address being device memory of this stream's device;
    /// and `table` must be neither written (by another call) nor dropped until an event
    /// recorded after this call has completed.
    pub unsafe fn copy_table(
        &self,
        table: &mut CopyTable,
        copies: &[CopyOp],
    ) -> Result<(), CudaError> {
        if copies.len() > table.entries {
            return Err(CudaError::Driver {
                call: "copy_table",
                message: format!("{} copies for a table of {}", copies.len(), table.entries),
            });
        }
        let f = self.device.copy_kernel()?;
        self.device.bind()?;
        let words = table.host.ptr.cast::<u64>();
        for (i, c) in copies.iter().enumerate() {
            // SAFETY: entry i lies inside the table (checked above); the allocation is page
            // aligned, so the u64 words are aligned; no kernel reads it (caller's guarantee).
            unsafe {
                words.add(3 * i).write(c.src);
                words.add(3 * i + 1).write(c.dst);
                words.add(3 * i + 2).write(c.len as u64);
            }
        }
        let longest = copies.iter().map(|c| c.len as u64).max().unwrap_or(0);
        let per = longest.div_ceil(COPY_CTA_BYTES).max(1);
        let ctas = per * copies.len() as u64;
        if ctas > i32::MAX as u64 {
            return Err(CudaError::Driver {
                call: "copy_table",
                message: format!("{ctas} blocks exceed the grid"),
            });
        }
        let table_bytes = copies.len() * COPY_ENTRY_BYTES;
        // SAFETY: both table buffers hold `entries` entries; the host side stays unwritten
        // until the caller's event (after this copy) completed.
        unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                table.device.ptr,
                table.host.ptr.cast(),
                table_bytes,
                self.cu(),
            )
        }
        .result()
        .map_err(driver("cuMemcpyHtoDAsync"))?;
        let (mut table_ptr, mut count) = (table.device.ptr, copies.len() as u32);
        let mut per32 = per as u32;
        let mut params: [*mut c_void; 3] = [
            (&mut table_ptr as *mut sys::CUdeviceptr).cast(),
            (&mut count as *mut u32).cast(),
            (&mut per32 as *mut u32).cast(),
        ];
        // SAFETY: the kernel's three parameters (u64, u32, u32) in order, alive for the call
        // (the driver copies them at launch); the grid fits; the table and every range are
        // the caller's guarantee.
        unsafe {
            sys::cuLaunchKernel(
                f,
                ctas as u32,
                1,
                1,
                COPY_THREADS,
                1,
                1,
                0,
                self.cu(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .map_err(driver("cuLaunchKernel"))
    }

    /// Records an event after everything queued so far.
    pub fn record(&self) -> Result<Event, CudaError> {
        self.record_with(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
    }

    /// Records an event that [`Event::since`] can time.
    pub fn record_timed(&self) -> Result<Event, CudaError> {
        self.record_with(sys::CUevent_flags::CU_EVENT_DEFAULT)
    }

    fn record_with(&self, flags: sys::CUevent_flags) -> Result<Event, CudaError> {
        self.device.bind()?;
        let timed = flags != sys::CUevent_flags::CU_EVENT_DISABLE_TIMING;
        let kept =
            if timed { None } else { self.device.events.lock().ok().and_then(|mut e| e.pop()) };
        let raw = match kept {
            Some(r) => r.0.cast(),
            None => result::event::create(flags).map_err(driver("cuEventCreate"))?,
        };
        let inner =
            Arc::new(EventInner { device: self.device.clone(), raw: Raw(raw.cast()), timed });
        // SAFETY: an event of this context (fresh, or kept: recording again overwrites what
        // it captured before) and our stream.
        unsafe { result::event::record(raw, self.cu()) }.map_err(driver("cuEventRecord"))?;
        Ok(Event { inner })
    }

    /// Blocks until everything queued has run (for tests and benchmarks; the data path
    /// awaits events).
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.device.bind()?;
        // SAFETY: our live stream.
        unsafe { result::stream::synchronize(self.cu()) }.map_err(driver("cuStreamSynchronize"))
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // SAFETY: created in `Device::stream`, destroyed once; the driver lets queued
            // work finish first.
            let _ = unsafe { result::stream::destroy(self.cu()) };
        }
    }
}

#[derive(Debug)]
struct EventInner {
    device: Arc<Device>,
    raw: Raw,
    /// Created with timing (not kept for reuse).
    timed: bool,
}

impl Drop for EventInner {
    fn drop(&mut self) {
        if !self.timed {
            if let Ok(mut kept) = self.device.events.lock() {
                if kept.len() < EVENTS_KEPT {
                    kept.push(self.raw);
                    return;
                }
            }
        }
        if self.device.bind().is_ok() {
            // SAFETY: created in `Stream::record`, destroyed once.
            let _ = unsafe { result::event::destroy(self.raw.0.cast()) };
        }
    }
}

/// A point in a stream: done once everything queued before it has run.
#[derive(Debug, Clone)]
pub struct Event {
    inner: Arc<EventInner>,
}

impl Event {
    /// Whether it has completed, without waiting.
    pub fn is_done(&self) -> Result<bool, CudaError> {
        self.inner.device.bind()?;
        // SAFETY: our live event.
        match unsafe { result::event::query(self.inner.raw.0.cast()) } {
            Ok(()) => Ok(true),
            Err(DriverError(sys::CUresult::CUDA_ERROR_NOT_READY)) => Ok(false),
            Err(e) => Err(driver("cuEventQuery")(e)),
        }
    }

    /// As [`Event::done`], but first polls the event for up to `spin`, yielding to the
    /// runtime between polls, before handing it to the device's waiting thread. Copies that
    /// finish within tens of microseconds then complete without two thread wake-ups (the
    /// waiting thread's and the runtime's), which on a virtual machine cost more than the
    /// copy; longer ones cost at most `spin` of polling.
    pub async fn done_polling(&self, spin: std::time::Duration) -> Result<(), CudaError> {
        let start = std::time::Instant::now();
        while start.elapsed() < spin {
            if self.is_done()? {
                return Ok(());
            }
            tokio::task::yield_now().await;
        }
        self.done().await
    }

    /// Completes when the event has; a failed copy before it is the error. Dropping the
    /// future does not stop the copies (the event stays alive until they ran).
    pub async fn done(&self) -> Result<(), CudaError> {
        let rx = self.inner.device.wait(self.inner.clone());
        rx.await.map_err(|_| CudaError::Driver {
            call: "wait",
            message: "the CUDA waiting thread dropped a wait".into(),
        })?
    }

    /// Blocks until it completed.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.inner.device.bind()?;
        // SAFETY: our live event.
        unsafe { result::event::synchronize(self.inner.raw.0.cast()) }
            .map_err(driver("cuEventSynchronize"))
    }

    /// GPU time from `start` to this event (both completed), as the device measured it.
    pub fn since(&self, start: &Event) -> Result<std::time::Duration, CudaError> {
        self.synchronize()?;
        start.synchronize()?;
        // SAFETY: two completed events of one context, created with timing.
        let ms =
            unsafe { result::event::elapsed(start.inner.raw.0.cast(), self.inner.raw.0.cast()) }
                .map_err(driver("cuEventElapsedTime"))?;
        Ok(std::time::Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3))
    }
}
