//! Asynchronous O_DIRECT file I/O with many requests in flight.
//!
//! Two backends behind one API ([`DiskIo::readv`], [`DiskIo::writev`]):
//! - `io_uring`: one thread owns a ring; it takes requests from a channel, keeps up to
//!   `queue_depth` of them in the submission queue at once (batched into one `io_uring_enter`),
//!   and completes them from the completion queue;
//! - `pread`: where io_uring is unavailable (old kernels, seccomp), `queue_depth` threads run
//!   `preadv`/`pwritev`. The fallback is logged and reported by [`DiskIo::backend`].
//!
//! Buffers in flight are owned: each request carries a `keep` value (a region lease, an
//! aligned buffer) that is dropped only after the kernel completed the request, even if the
//! caller's future was dropped.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::mpsc;
use std::sync::Arc;

use parking_lot::Mutex;

/// Which backend to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum IoPreference {
    /// io_uring when the kernel allows it, else pread/pwrite.
    #[default]
    Auto,
    /// pread/pwrite threads only.
    Pread,
}

/// The backend in use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum IoBackend {
    /// io_uring.
    IoUring,
    /// pread/pwrite threads.
    Pread,
}

impl IoBackend {
    /// Its name.
    pub fn name(self) -> &'static str {
        match self {
            IoBackend::IoUring => "io_uring",
            IoBackend::Pread => "pread",
        }
    }
}

/// One buffer of a vectored request: a raw pointer and a length.
#[derive(Debug, Clone, Copy)]
pub struct IoBuf {
    /// Start (aligned for O_DIRECT).
    pub ptr: *mut u8,
    /// Length (a multiple of the alignment).
    pub len: usize,
}

// SAFETY: an IoBuf is an address and a length; it grants no access by itself. Every use goes
// through the unsafe `readv`/`writev` contract, which requires the memory to stay valid.
unsafe impl Send for IoBuf {}
// SAFETY: as above.
unsafe impl Sync for IoBuf {}

struct Request {
    write: bool,
    offset: u64,
    iov: Vec<libc::iovec>,
    _keep: Box<dyn Send>,
    done: tokio::sync::oneshot::Sender<std::io::Result<usize>>,
}

// SAFETY: the iovecs point into memory owned by `_keep` (or by the caller's leases held in
// `_keep`), which travels with the request and outlives the I/O; nothing else reads the raw
// pointers.
unsafe impl Send for Request {}

/// An I/O engine for one file.
#[derive(Debug)]
pub struct DiskIo {
    tx: Mutex<Option<mpsc::Sender<Request>>>,
    backend: IoBackend,
    /// Wakes the io_uring thread when a request is queued (it waits on the ring, where a read
    /// of this eventfd is always pending), so new requests never wait for old completions.
    wake: Option<Arc<std::os::fd::OwnedFd>>,
    _file: Arc<File>,
}

fn eventfd() -> std::io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    // SAFETY: eventfd has no memory-safety preconditions; the result is checked.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor that we own.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
}

fn ring_bell(fd: &std::os::fd::OwnedFd) {
    use std::os::fd::AsRawFd;
    let one = 1u64.to_ne_bytes();
    // SAFETY: writes 8 bytes from a live stack buffer to our eventfd; failure (counter
    // saturated) only means the thread is already due to wake.
    unsafe { libc::write(fd.as_raw_fd(), one.as_ptr().cast(), 8) };
}

impl DiskIo {
    /// Starts an engine over `file` (opened with O_DIRECT) with up to `queue_depth` requests
    /// in flight.
    pub fn new(file: Arc<File>, queue_depth: usize, prefer: IoPreference) -> std::io::Result<Self> {
        let depth = queue_depth.clamp(1, 4096);
        let (tx, rx) = mpsc::channel::<Request>();
        let fd = file.as_raw_fd();
        let ring = match prefer {
            // One entry more than the depth, for the pending eventfd read.
            IoPreference::Auto => {
                match io_uring::IoUring::new((depth + 1).next_power_of_two() as u32) {
                    Ok(r) => Some(r),
                    Err(e) => {
                        tracing::warn!(error = %e, "io_uring unavailable; disk tier falls back to pread/pwrite");
                        None
                    }
                }
            }
            IoPreference::Pread => None,
        };
        let mut wake = None;
        let backend = match ring {
            Some(ring) => {
                let bell = Arc::new(eventfd()?);
                let thread_bell = bell.clone();
                wake = Some(bell);
                // The thread holds the file open until its last request completed.
                let file = file.clone();
                std::thread::Builder::new().name("kvfabric-uring".into()).spawn(move || {
                    uring_loop(ring, fd, rx, depth, thread_bell);
                    drop(file);
                })?;
                IoBackend::IoUring
            }
            None => {
                let rx = Arc::new(Mutex::new(rx));
                for i in 0..depth {
                    let (rx, file) = (rx.clone(), file.clone());
                    std::thread::Builder::new().name(format!("kvfabric-pread-{i}")).spawn(
                        move || {
                            pread_loop(fd, rx);
                            drop(file);
                        },
                    )?;
                }
                IoBackend::Pread
            }
        };
        Ok(DiskIo { tx: Mutex::new(Some(tx)), backend, wake, _file: file })
    }

    /// The backend in use.
    pub fn backend(&self) -> IoBackend {
        self.backend
    }

    /// Queues a request now (before any await) and returns the future of its completion, so
    /// that a caller can overlap it with other work.
    fn submit(
        &self,
        write: bool,
        offset: u64,
        bufs: &[IoBuf],
        keep: Box<dyn Send>,
    ) -> impl std::future::Future<Output = std::io::Result<usize>> + Send + 'static {
        let iov =
            bufs.iter().map(|b| libc::iovec { iov_base: b.ptr.cast(), iov_len: b.len }).collect();
        let (done, rx) = tokio::sync::oneshot::channel();
        let req = Request { write, offset, iov, _keep: keep, done };
        let sent = {
            let tx = self.tx.lock();
            match tx.as_ref() {
                Some(tx) => tx.send(req).is_ok(),
                None => false,
            }
        };
        if let Some(bell) = &self.wake {
            ring_bell(bell);
        }
        async move {
            if !sent {
                return Err(std::io::Error::other("disk I/O engine stopped"));
            }
            rx.await.map_err(|_| std::io::Error::other("disk I/O engine dropped a request"))?
        }
    }

    /// Reads into `bufs` from `offset`; returns bytes read. The request is queued at once.
    ///
    /// # Safety
    /// Every buffer must be valid for writes of its length, aligned for O_DIRECT, and stay
    /// valid until the request completes: `keep` must own it or a lease on it.
    pub unsafe fn readv(
        &self,
        offset: u64,
        bufs: &[IoBuf],
        keep: Box<dyn Send>,
    ) -> impl std::future::Future<Output = std::io::Result<usize>> + Send + 'static {
        self.submit(false, offset, bufs, keep)
    }

    /// Writes `bufs` at `offset`; returns bytes written. The request is queued at once.
    ///
    /// # Safety
    /// As [`DiskIo::readv`], with the buffers valid for reads.
    pub unsafe fn writev(
        &self,
        offset: u64,
        bufs: &[IoBuf],
        keep: Box<dyn Send>,
    ) -> impl std::future::Future<Output = std::io::Result<usize>> + Send + 'static {
        self.submit(true, offset, bufs, keep)
    }

    /// Stops accepting requests; in-flight ones complete.
    pub fn stop(&self) {
        self.tx.lock().take();
        if let Some(bell) = &self.wake {
            ring_bell(bell);
        }
    }
}

impl Drop for DiskIo {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Reports a finished request. Its buffers (and the leases that keep them) are released
/// first: whoever sees the completion may at once reuse or deregister that memory.
fn complete(req: Request, out: std::io::Result<usize>) {
    let Request { done, _keep, iov, .. } = req;
    drop((_keep, iov));
    let _ = done.send(out);
}

/// user_data of the pending eventfd read.
const BELL: u64 = u64::MAX;

fn uring_loop(
    mut ring: io_uring::IoUring,
    fd: i32,
    rx: mpsc::Receiver<Request>,
    depth: usize,
    bell: Arc<std::os::fd::OwnedFd>,
) {
    use io_uring::{opcode, types};
    use std::os::fd::AsRawFd;
    let mut slots: Vec<Option<Request>> = (0..depth).map(|_| None).collect();
    let mut free: Vec<usize> = (0..depth).rev().collect();
    let mut in_flight = 0usize;
    let mut closed = false;
    // The eventfd read lands here; the buffer lives as long as the loop (and the ring).
    let bell_buf: &'static mut [u8; 8] = Box::leak(Box::new([0u8; 8]));
    let mut bell_armed = false;
    let ring_capacity = (depth + 1).next_power_of_two();
    loop {
        // A read of the eventfd is always pending, so that a new request wakes the wait below.
        if !bell_armed {
            let entry = opcode::Read::new(types::Fd(bell.as_raw_fd()), bell_buf.as_mut_ptr(), 8)
                .build()
                .user_data(BELL);
            // SAFETY: `bell_buf` and the eventfd outlive the ring (both owned by this frame
            // and the Arc); the ring was created with room for `depth` requests plus this read,
            // and a failed push is retried next turn.
            if unsafe { ring.submission().push(&entry) }.is_ok() {
                bell_armed = true;
            }
        }
        // Queue every request waiting in the channel, up to the depth.
        while in_flight < depth && !closed && in_flight < ring_capacity - 1 {
            let req = match rx.try_recv() {
                Ok(r) => r,
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => {
                    closed = true;
                    break;
                }
            };
            let Some(i) = free.pop() else { break };
            let entry = if req.write {
                opcode::Writev::new(types::Fd(fd), req.iov.as_ptr(), req.iov.len() as u32)
                    .offset(req.offset)
                    .build()
            } else {
                opcode::Readv::new(types::Fd(fd), req.iov.as_ptr(), req.iov.len() as u32)
                    .offset(req.offset)
                    .build()
            }
            .user_data(i as u64);
            slots[i] = Some(req);
            // SAFETY: the entry's iovec array and buffers live in `slots[i]` (the request owns
            // the iovec Vec and, through `_keep`, the memory) until its completion is reaped
            // below.
            if unsafe { ring.submission().push(&entry) }.is_err() {
                if let Some(req) = slots[i].take() {
                    let _ =
                        req.done.send(Err(std::io::Error::other("io_uring submission queue full")));
                }
                free.push(i);
                break;
            }
            in_flight += 1;
        }
        if closed && in_flight == 0 {
            return;
        }
        match ring.submit_and_wait(1) {
            Ok(_) => {}
            Err(e)
                if e.raw_os_error() == Some(libc::EINTR)
                    || e.raw_os_error() == Some(libc::EBUSY) => {}
            Err(e) => {
                // The ring is unusable: fail everything in flight. The kernel may still DMA
                // into their buffers, so their keep values are leaked, never freed; so is the
                // ring (with the pending eventfd read's buffer).
                for slot in slots.iter_mut() {
                    if let Some(req) = slot.take() {
                        let Request { done, _keep, iov, .. } = req;
                        let _ = done.send(Err(std::io::Error::new(e.kind(), e.to_string())));
                        std::mem::forget(_keep);
                        std::mem::forget(iov);
                    }
                }
                std::mem::forget(ring);
                std::mem::forget(bell);
                return;
            }
        }
        for cqe in ring.completion() {
            if cqe.user_data() == BELL {
                bell_armed = false;
                continue;
            }
            let i = cqe.user_data() as usize;
            if let Some(req) = slots.get_mut(i).and_then(Option::take) {
                let res = cqe.result();
                let out = if res < 0 {
                    Err(std::io::Error::from_raw_os_error(-res))
                } else {
                    Ok(res as usize)
                };
                complete(req, out);
                free.push(i);
                in_flight -= 1;
            }
        }
    }
}

fn pread_loop(fd: i32, rx: Arc<Mutex<mpsc::Receiver<Request>>>) {
    loop {
        let req = match rx.lock().recv() {
            Ok(r) => r,
            Err(_) => return,
        };
        // SAFETY: the iovecs point to memory kept alive by the request (see `Request`), valid
        // for the direction of the call, and `fd` stays open while the engine's file lives.
        let res = unsafe {
            if req.write {
                libc::pwritev(fd, req.iov.as_ptr(), req.iov.len() as i32, req.offset as libc::off_t)
            } else {
                libc::preadv(fd, req.iov.as_ptr(), req.iov.len() as i32, req.offset as libc::off_t)
            }
        };
        let out = if res < 0 { Err(std::io::Error::last_os_error()) } else { Ok(res as usize) };
        complete(req, out);
    }
}

/// A page-aligned heap buffer for O_DIRECT headers and benchmarks.
pub struct AlignedBuf {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AlignedBuf").field("len", &self.len).finish()
    }
}

// SAFETY: an owned allocation with no interior sharing.
unsafe impl Send for AlignedBuf {}
// SAFETY: `&AlignedBuf` only gives shared reads.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed buffer of `len` bytes (rounded up to 4096), 4096-aligned.
    pub fn zeroed(len: usize) -> Self {
        let len = len.div_ceil(4096).max(1) * 4096;
        let layout = std::alloc::Layout::from_size_align(len, 4096)
            .unwrap_or_else(|_| std::alloc::Layout::new::<u8>());
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr =
            std::ptr::NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        AlignedBuf { ptr, len }
    }

    /// Its bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr/len describe our live allocation.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// Its bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: ptr/len describe our live allocation, borrowed mutably through `self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// As an I/O buffer.
    pub fn io_buf(&self) -> IoBuf {
        IoBuf { ptr: self.ptr.as_ptr(), len: self.len }
    }

    /// Length.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never empty.
    pub fn is_empty(&self) -> bool {
        false
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if let Ok(layout) = std::alloc::Layout::from_size_align(self.len, 4096) {
            // SAFETY: allocated in `zeroed` with this exact layout.
            unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) };
        }
    }
}

/// Opens (creating) a file for O_DIRECT I/O.
pub fn open_direct(path: &std::path::Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .custom_flags(libc::O_DIRECT)
        .open(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn round_trip(prefer: IoPreference) {
        let dir = tempfile::tempdir().unwrap();
        let file = Arc::new(open_direct(&dir.path().join("f")).unwrap());
        file.set_len(1 << 20).unwrap();
        let io = DiskIo::new(file, 8, prefer).unwrap();
        if prefer == IoPreference::Pread {
            assert_eq!(io.backend(), IoBackend::Pread);
        }
        let mut bufs = Vec::new();
        for i in 0..16u8 {
            let mut b = AlignedBuf::zeroed(8192);
            b.as_mut_slice().fill(i);
            bufs.push(b);
        }
        let writes = bufs.into_iter().enumerate().map(|(i, b)| {
            let io = &io;
            async move {
                let buf = b.io_buf();
                // SAFETY: `b` is moved into the request as its keep value.
                unsafe { io.writev(i as u64 * 8192, &[buf], Box::new(b)) }.await
            }
        });
        for r in futures_util::future::join_all(writes).await {
            assert_eq!(r.unwrap(), 8192);
        }
        for i in 0..16u8 {
            let out = AlignedBuf::zeroed(8192);
            let buf = out.io_buf();
            let keep = Arc::new(out);
            // SAFETY: `keep` owns the buffer and lives past the await.
            let n = unsafe { io.readv(u64::from(i) * 8192, &[buf], Box::new(keep.clone())) }
                .await
                .unwrap();
            assert_eq!(n, 8192);
            assert!(keep.as_slice().iter().all(|&x| x == i));
        }
    }

    #[tokio::test]
    async fn io_uring_or_fallback_round_trip() {
        round_trip(IoPreference::Auto).await;
    }

    #[tokio::test]
    async fn pread_fallback_round_trip() {
        round_trip(IoPreference::Pread).await;
    }
}
