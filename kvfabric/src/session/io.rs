//! Socket I/O of the session: frames through the sans-IO state machines, and bulk payload
//! straight between the socket and registered memory (raw `writev(2)`/`recv(2)`, no
//! intermediate buffer, no Rust reference to region memory).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::tls::Stream;
use crate::wire::NONCE_BYTES;

/// Bytes copied through TLS at a time (the plaintext side of a TLS connection needs a buffer:
/// bulk bytes cannot go from registered memory straight to the socket).
const TLS_CHUNK: usize = 256 << 10;

/// Most iovecs handed to one `writev` (the kernel's IOV_MAX is 1024).
const IOV_BATCH: usize = 512;

/// A fresh handshake nonce.
pub(crate) fn random_nonce() -> [u8; NONCE_BYTES] {
    let mut n = [0u8; NONCE_BYTES];
    // A nonce from the OS RNG; if the RNG fails, a nonce from the clock and a counter still
    // never repeats within a process (it only needs to be fresh, not secret).
    if getrandom::fill(&mut n).is_err() {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        n[..16].copy_from_slice(&t.to_le_bytes());
        n[16..24].copy_from_slice(&(COUNTER.fetch_add(1, Ordering::Relaxed) as u64).to_le_bytes());
    }
    n
}

/// Memory to send: an address and a length (a frame header, or a checked range of
/// registered memory kept alive by a lease).
#[derive(Clone, Copy)]
pub(crate) struct RawSrc(pub(crate) *const u8, pub(crate) usize);

// SAFETY: a plain address; every use goes through `send_all`'s contract.
unsafe impl Send for RawSrc {}
// SAFETY: as above; sharing the address grants nothing by itself.
unsafe impl Sync for RawSrc {}

/// Sends every byte of `bufs` with `writev(2)` on raw iovecs — no Rust reference to region
/// memory is formed, so a peer writing the same registered bytes concurrently makes the sent
/// bytes unspecified, never undefined behaviour. Each wait for the socket is bounded by
/// `stall` (an inactivity bound, not a bound on the whole payload).
///
/// # Safety
/// Every buffer must stay valid for reads until the future completes or is dropped.
pub(crate) async unsafe fn send_all(
    stream: &mut Stream,
    bufs: &[RawSrc],
    stall: Duration,
) -> std::io::Result<()> {
    match stream {
        // SAFETY: the caller's contract.
        Stream::Plain(tcp) => unsafe { send_plain(tcp, bufs, stall) }.await,
        // SAFETY: the caller's contract.
        tls => unsafe { send_copied(tls, bufs, stall) }.await,
    }
}

/// [`send_all`] through TLS: the bytes are copied (raw, no reference to region memory) into a
/// buffer that the TLS session encrypts, a chunk at a time.
///
/// # Safety
/// As [`send_all`].
async unsafe fn send_copied(
    stream: &mut Stream,
    bufs: &[RawSrc],
    stall: Duration,
) -> std::io::Result<()> {
    let mut chunk: Vec<u8> = Vec::with_capacity(TLS_CHUNK);
    for b in bufs {
        let mut off = 0usize;
        while off < b.1 {
            let n = (b.1 - off).min(TLS_CHUNK - chunk.len());
            // SAFETY: `b.0 + off .. + n` lies in the buffer (off + n <= b.1), valid for reads
            // (the caller's contract); the destination is spare capacity of `chunk`
            // (len + n <= TLS_CHUNK = its capacity), and the two do not overlap.
            unsafe {
                std::ptr::copy_nonoverlapping(b.0.add(off), chunk.as_mut_ptr().add(chunk.len()), n);
                chunk.set_len(chunk.len() + n);
            }
            off += n;
            if chunk.len() == TLS_CHUNK {
                write_chunk(stream, &chunk, stall).await?;
                chunk.clear();
            }
        }
    }
    if !chunk.is_empty() {
        write_chunk(stream, &chunk, stall).await?;
    }
    tokio::time::timeout(stall, stream.flush())
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "peer stopped reading"))?
}

async fn write_chunk(stream: &mut Stream, bytes: &[u8], stall: Duration) -> std::io::Result<()> {
    tokio::time::timeout(stall, stream.write_all(bytes))
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "peer stopped reading"))?
}

/// [`send_all`] on plain TCP: `writev(2)` straight from the buffers.
///
/// # Safety
/// As [`send_all`].
async unsafe fn send_plain(
    stream: &TcpStream,
    bufs: &[RawSrc],
    stall: Duration,
) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let (mut first, mut skip) = (0usize, 0usize);
    while first < bufs.len() {
        tokio::time::timeout(stall, stream.writable()).await.map_err(|_| {
            std::io::Error::new(std::io::ErrorKind::TimedOut, "peer stopped reading")
        })??;
        let fd = stream.as_raw_fd();
        let iov: Vec<libc::iovec> = bufs[first..]
            .iter()
            .take(IOV_BATCH)
            .enumerate()
            .map(|(k, b)| {
                let off = if k == 0 { skip } else { 0 };
                // SAFETY: `off` < b.1 (a fully sent buffer is skipped below), inside the buffer.
                let base = unsafe { b.0.add(off) };
                libc::iovec { iov_base: base as *mut libc::c_void, iov_len: b.1 - off }
            })
            .collect();
        let result = stream.try_io(tokio::io::Interest::WRITABLE, || {
            // SAFETY: the iovecs describe memory valid for reads (the caller's contract).
            let n = unsafe { libc::writev(fd, iov.as_ptr(), iov.len() as i32) };
            if n < 0 {
                Err(std::io::Error::last_os_error())
            } else {
                Ok(n as usize)
            }
        });
        let mut n = match result {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        };
        // Advance past what was sent.
        while n > 0 && first < bufs.len() {
            let left = bufs[first].1 - skip;
            if n >= left {
                n -= left;
                first += 1;
                skip = 0;
            } else {
                skip += n;
                n = 0;
            }
        }
        while first < bufs.len() && bufs[first].1 == 0 {
            first += 1;
        }
    }
    Ok(())
}

/// A destination address in registered memory.
#[derive(Clone, Copy)]
pub(crate) struct RawDst(pub(crate) *mut u8);

// SAFETY: a plain address; every use goes through `recv_into`'s contract.
unsafe impl Send for RawDst {}

/// Receives exactly `len` bytes from the socket straight into `dst` with `recv(2)`, without
/// forming a Rust reference to the destination (other peers may write the same registered
/// memory concurrently; with raw copies that is unspecified bytes, not undefined behaviour).
/// Each wait for data is bounded by `stall`.
///
/// # Safety
/// `dst..dst+len` must stay valid for writes until the future completes or is dropped.
pub(crate) async unsafe fn recv_into(
    stream: &mut Stream,
    dst: RawDst,
    len: usize,
    stall: Duration,
) -> std::io::Result<()> {
    match stream {
        // SAFETY: the caller's contract.
        Stream::Plain(tcp) => unsafe { recv_plain(tcp, dst, len, stall) }.await,
        tls => {
            let mut chunk = vec![0u8; TLS_CHUNK.min(len)];
            let mut done = 0usize;
            while done < len {
                let n = (len - done).min(chunk.len());
                read_exact(tls, &mut chunk[..n], Some(stall)).await?;
                // SAFETY: `dst + done .. + n` lies in memory valid for writes (done + n <=
                // len, the caller's contract); the source is our own buffer; no reference to
                // the destination is formed.
                unsafe { std::ptr::copy_nonoverlapping(chunk.as_ptr(), dst.0.add(done), n) };
                done += n;
            }
            Ok(())
        }
    }
}

/// [`recv_into`] on plain TCP: `recv(2)` straight into the destination.
///
/// # Safety
/// As [`recv_into`].
async unsafe fn recv_plain(
    stream: &TcpStream,
    dst: RawDst,
    len: usize,
    stall: Duration,
) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let mut done = 0usize;
    while done < len {
        tokio::time::timeout(stall, stream.readable()).await.map_err(|_| {
            std::io::Error::new(std::io::ErrorKind::TimedOut, "peer stopped sending")
        })??;
        let fd = stream.as_raw_fd();
        let result = stream.try_io(tokio::io::Interest::READABLE, || {
            // SAFETY: `dst + done .. dst + len` lies in memory valid for writes (the caller's
            // contract), and recv writes at most `len - done` bytes there.
            let n = unsafe { libc::recv(fd, dst.0.add(done).cast(), len - done, 0) };
            if n < 0 {
                Err(std::io::Error::last_os_error())
            } else {
                Ok(n as usize)
            }
        });
        match result {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Reads exactly `buf.len()` bytes, each wait bounded by `timeout` when one is given.
pub(crate) async fn read_exact(
    stream: &mut Stream,
    buf: &mut [u8],
    timeout: Option<Duration>,
) -> std::io::Result<()> {
    let read = stream.read_exact(buf);
    match timeout {
        None => read.await.map(|_| ()),
        Some(t) => tokio::time::timeout(t, read)
            .await
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "frame timed out"))?
            .map(|_| ()),
    }
}

/// Writes (and flushes, through TLS) all of `bytes` within `timeout`: a peer that stops
/// reading cannot pin the task.
pub(crate) async fn write_all(
    stream: &mut Stream,
    bytes: &[u8],
    timeout: Duration,
) -> std::io::Result<()> {
    tokio::time::timeout(timeout, async {
        stream.write_all(bytes).await?;
        stream.flush().await
    })
    .await
    .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "peer stopped reading"))?
}
