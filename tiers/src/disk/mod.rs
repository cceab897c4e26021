//! G3: the local disk tier. A file of fixed-size slots, written and read with O_DIRECT
//! through [`io::DiskIo`] (io_uring, or pread/pwrite where io_uring is unavailable).
//!
//! - The file grows in chunks with `fallocate` as slots are first used; when the filesystem
//!   is full the tier stops growing ([`DiskError::Full`] for the write that hit it) and from
//!   then on makes room by evicting its own least recently used blocks.
//! - Every slot has a header page with the block's sequence hash, parent and data checksum;
//!   headers lie in groups ahead of their slots' data, so that adjacent slots' data is
//!   contiguous ([`format`]). On open, the index (data checksums included) is rebuilt from the
//!   headers, a group's header pages in one read.
//! - A read fetches the block's bytes alone, one request of exactly the data (the header is
//!   not read again: the index knows the slot's checksum), and verifies the data checksum, so
//!   a torn or corrupt block is dropped and reported as a miss, never served. Reading the
//!   header along with the data, into a separate page, made every read two segments and cost
//!   a fifth of the device's rate on this machine's virtio disk (measured: 2.5 → 2.0 GB/s for
//!   360 KiB blocks at depth 8, same bytes).

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::Arc;

use kvfabric::hash::SequenceHash;
use parking_lot::Mutex;

use crate::policy::PolicyKind;
use crate::pool::{PoolError, SlotPool, SlotState};

pub mod format;
pub mod io;
pub mod lock;

use format::{SlotHeader, SlotLayout, GROUP_SLOTS, HEADER_BYTES};
use io::{AlignedBuf, DiskIo, IoBackend, IoBuf, IoPreference};

/// How to open a disk tier.
#[derive(Debug, Clone)]
pub struct DiskConfig {
    /// The slot file (created if missing).
    pub path: PathBuf,
    /// Most blocks it holds.
    pub capacity_blocks: u32,
    /// Most I/O requests in flight.
    pub queue_depth: usize,
    /// io_uring or pread.
    pub io: IoPreference,
    /// The file grows by this many slots at a time.
    pub grow_blocks: u32,
    /// Eviction policy within the tier.
    pub policy: PolicyKind,
}

impl DiskConfig {
    /// Defaults for a file and a capacity: depth 16, growth by 64 slots, LRU.
    pub fn new(path: impl Into<PathBuf>, capacity_blocks: u32) -> Self {
        DiskConfig {
            path: path.into(),
            capacity_blocks,
            queue_depth: 16,
            io: IoPreference::Auto,
            grow_blocks: 64,
            policy: PolicyKind::Lru,
        }
    }
}

/// Why a disk operation failed.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    /// The filesystem is full (or refuses to grow the file), and no block can be evicted.
    #[error("disk tier full: {0}")]
    Full(String),
    /// An I/O error.
    #[error("disk I/O: {0}")]
    Io(#[from] std::io::Error),
    /// A short read or write.
    #[error("short disk {op}: {got} of {want} bytes")]
    Short {
        /// read or write.
        op: &'static str,
        /// Bytes done.
        got: usize,
        /// Bytes asked.
        want: u64,
    },
    /// Every slot is pinned or being written.
    #[error("disk tier has no evictable block")]
    NoEvictable,
    /// The same block is being written by someone else right now.
    #[error("block is being written to disk by another request")]
    Busy,
    /// Another process has the slot file open: two processes must not share one.
    #[error("disk tier {path} is in use by another process{}: give each process its own --data-dir or name", pid.map(|p| format!(" (pid {p})")).unwrap_or_default())]
    Locked {
        /// The slot file.
        path: PathBuf,
        /// The owner's pid, as its lock file says.
        pid: Option<u32>,
    },
}

/// What a read found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadOutcome {
    /// The block's bytes are in the destination.
    Hit {
        /// Its parent.
        parent: Option<SequenceHash>,
        /// XXH3-64 of its bytes (verified).
        checksum: u64,
    },
    /// Not on disk.
    Miss,
    /// On disk but torn or corrupt: dropped from the tier.
    Corrupt,
}

/// What a write did besides storing the block.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct WriteOutcome {
    /// Whether the block was already on disk (nothing written).
    pub already_present: bool,
    /// Blocks evicted from disk to make room.
    pub evicted: Vec<SequenceHash>,
}

/// Blocks found on open.
#[derive(Debug, Default, Clone)]
pub struct Recovered {
    /// Valid headers, with parents.
    pub blocks: Vec<(SequenceHash, Option<SequenceHash>)>,
    /// Slots whose header was unreadable (torn, foreign, another block size) or a stale
    /// duplicate.
    pub discarded: u32,
    /// The file was written in the first layout (by an earlier kvfabric): none of its blocks
    /// is read, and its slots are rewritten as they are reused.
    pub first_layout: bool,
}

/// A slot to write into, or nothing to write.
enum Reservation {
    Slot { slot: u32, seq: u64, evicted: Vec<SequenceHash> },
    Done(WriteOutcome),
}

#[derive(Debug)]
struct DiskState {
    pool: SlotPool,
    write_seq: u64,
    /// Each slot's data checksum, as written (or as its header said on open); valid for
    /// slots the pool holds a block in.
    checksums: Vec<u64>,
}

/// The disk tier.
#[derive(Debug)]
pub struct DiskTier {
    /// This process's claim on the slot file, held while the tier is open.
    _lock: lock::SlotFileLock,
    file: Arc<File>,
    io: DiskIo,
    block_bytes: u64,
    layout: SlotLayout,
    grow_blocks: u32,
    state: Mutex<DiskState>,
    allocated: tokio::sync::Mutex<u32>,
    /// Reads submitted and not yet completed.
    reads_in_flight: std::sync::atomic::AtomicUsize,
    /// The slot file (for messages).
    path: PathBuf,
    /// Slots configured (the tier may cap itself below on a full filesystem).
    configured_blocks: u32,
}

/// Counts a read in flight until dropped (also when its future is).
struct InFlight<'a>(&'a std::sync::atomic::AtomicUsize);

impl<'a> InFlight<'a> {
    fn new(n: &'a std::sync::atomic::AtomicUsize) -> Self {
        n.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        InFlight(n)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Blocks at least this large are verified off the caller's task when other reads are in
/// flight. The hop to a blocking-pool thread costs 10–20 µs; XXH3 runs at about 20 GB/s on
/// freshly read (uncached) bytes, so below ~1 MiB the hop costs as much as the hash (measured:
/// no gain for 360 KiB blocks, 0.85→0.95 of the plain read rate for 2 MiB blocks at depth 8-32).
const PARALLEL_VERIFY_MIN_BYTES: u64 = 1 << 20;

impl DiskTier {
    /// Opens (or creates) the slot file and rebuilds the index from its headers.
    pub async fn open(
        cfg: &DiskConfig,
        block_bytes: u64,
    ) -> Result<(DiskTier, Recovered), DiskError> {
        if let Some(dir) = cfg.path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        // A tier of this same process that is still closing (its last handles dropping, as
        // in a restart within one process) is waited for a while; another process's refuses.
        let mut waited = std::time::Duration::ZERO;
        let lock = loop {
            match lock::SlotFileLock::acquire(&cfg.path) {
                Err(DiskError::Locked { pid: Some(pid), .. })
                    if pid == std::process::id() && waited < lock::SAME_PROCESS_WAIT =>
                {
                    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                    waited += std::time::Duration::from_millis(20);
                }
                other => break other?,
            }
        };
        let file = Arc::new(io::open_direct(&cfg.path)?);
        let io = DiskIo::new(file.clone(), cfg.queue_depth, cfg.io)?;
        let layout = SlotLayout::new(block_bytes);
        let len = file.metadata()?.len();
        let existing = layout.slots_in(len).min(u64::from(cfg.capacity_blocks)) as u32;
        let tier = DiskTier {
            _lock: lock,
            file,
            io,
            block_bytes,
            layout,
            grow_blocks: cfg.grow_blocks.max(1),
            state: Mutex::new(DiskState {
                pool: SlotPool::new(cfg.capacity_blocks, cfg.policy),
                write_seq: 1,
                checksums: vec![0; cfg.capacity_blocks as usize],
            }),
            allocated: tokio::sync::Mutex::new(existing),
            reads_in_flight: std::sync::atomic::AtomicUsize::new(0),
            path: cfg.path.clone(),
            configured_blocks: cfg.capacity_blocks,
        };
        let recovered = tier.rebuild(existing, cfg.queue_depth.max(1)).await?;
        // Preallocate the first growth step now, so that the first writes do not wait for
        // the filesystem. A filesystem already full caps the tier at what the file holds now,
        // from the start (and says so in `/health`), instead of at the first failed write.
        let first = tier.grow_blocks.min(cfg.capacity_blocks);
        if first > existing && tier.ensure_allocated(first - 1).await.is_err() {
            let allocated = *tier.allocated.lock().await;
            let mut st = tier.state.lock();
            st.pool.retire_free_from(allocated);
            tracing::warn!(path = %cfg.path.display(), usable_slots = st.pool.usable(),
                configured = cfg.capacity_blocks,
                "the disk tier's filesystem is full at start: the tier is capped at what fits");
        }
        Ok((tier, recovered))
    }

    async fn rebuild(&self, slots: u32, depth: usize) -> Result<Recovered, DiskError> {
        let mut headers: Vec<(u32, SlotHeader)> = Vec::new();
        let mut discarded = 0u32;
        let mut first_layout = false;
        // A group's header pages in one read, `depth` groups at a time.
        let groups: Vec<u32> = (0..slots).step_by(GROUP_SLOTS as usize).collect();
        for batch in groups.chunks(depth) {
            let reads = batch.iter().map(|&first| async move {
                let count = (slots - first).min(GROUP_SLOTS as u32);
                let buf = Arc::new(AlignedBuf::zeroed(count as usize * HEADER_BYTES as usize));
                let io_buf = buf.io_buf();
                // SAFETY: `buf` is kept alive by the request's keep value.
                let n = unsafe {
                    self.io.readv(
                        self.layout.header_offset(first),
                        &[io_buf],
                        Box::new(buf.clone()),
                    )
                }
                .await;
                n.map(|n| {
                    // Pages past a short read (a file truncated under us) are not headers.
                    let read = &buf.as_slice()[..n.min(buf.len())];
                    // Slot 0's header lies at offset 0 in both layouts.
                    let old = first == 0 && read.starts_with(&format::FIRST_LAYOUT_MAGIC);
                    let pages: Vec<Option<SlotHeader>> =
                        read.chunks_exact(HEADER_BYTES as usize).map(SlotHeader::decode).collect();
                    (first, count, pages, old)
                })
            });
            for r in futures_util::future::join_all(reads).await {
                let (first, count, pages, old) = r?;
                first_layout |= old;
                discarded += count - pages.len() as u32;
                for (i, page) in pages.into_iter().enumerate() {
                    match page {
                        Some(h) if h.block_bytes == self.block_bytes => {
                            headers.push((first + i as u32, h))
                        }
                        _ => discarded += 1,
                    }
                }
            }
        }
        // The newest copy of a hash wins.
        headers.sort_by_key(|(_, h)| std::cmp::Reverse(h.write_seq));
        let mut st = self.state.lock();
        st.write_seq = headers.first().map_or(1, |(_, h)| h.write_seq + 1);
        for (slot, h) in &headers {
            // Slots past the capacity were not read (`existing` is capped by it).
            if let Some(c) = st.checksums.get_mut(*slot as usize) {
                *c = h.data_checksum;
            }
        }
        let skipped = st.pool.restore(headers.iter().map(|(slot, h)| (*slot, h.hash, h.parent)));
        discarded += skipped.len() as u32;
        let blocks = st.pool.blocks();
        Ok(Recovered { blocks, discarded, first_layout })
    }

    /// The I/O backend in use.
    pub fn backend(&self) -> IoBackend {
        self.io.backend()
    }

    /// Whether the block is on disk and readable now.
    pub fn has(&self, hash: SequenceHash) -> bool {
        self.state.lock().pool.lookup(hash).is_some()
    }

    /// The parent of a block on disk (None if unknown or it has none).
    pub fn blocks_parent(&self, hash: SequenceHash) -> Option<SequenceHash> {
        self.state.lock().pool.parent_of(hash)
    }

    /// Slots configured; [`DiskTier::occupancy`]'s usable count is lower once a full
    /// filesystem capped the tier.
    pub fn configured_blocks(&self) -> u32 {
        self.configured_blocks
    }

    /// (used, usable) slots.
    pub fn occupancy(&self) -> (u32, u32) {
        let st = self.state.lock();
        (st.pool.used(), st.pool.usable())
    }

    /// Blocks evicted from the disk to make room, since the tier opened.
    pub fn evicted(&self) -> u64 {
        self.state.lock().pool.evicted()
    }

    /// Every block on disk with its parent.
    pub fn blocks(&self) -> Vec<(SequenceHash, Option<SequenceHash>)> {
        self.state.lock().pool.blocks()
    }

    /// Bytes one slot buffer must span (the block rounded up to 4 KiB).
    pub fn data_bytes(&self) -> u64 {
        self.layout.data_bytes()
    }

    /// Reserves a slot, evicting the tier's own LRU blocks when full.
    fn reserve(
        &self,
        hash: SequenceHash,
        parent: Option<SequenceHash>,
    ) -> Result<Reservation, DiskError> {
        let mut st = self.state.lock();
        let mut evicted = Vec::new();
        loop {
            match st.pool.reserve(hash, parent) {
                Ok(slot) => {
                    let seq = st.write_seq;
                    st.write_seq += 1;
                    return Ok(Reservation::Slot { slot, seq, evicted });
                }
                Err(PoolError::Present(_)) => {
                    return Ok(Reservation::Done(WriteOutcome { already_present: true, evicted }))
                }
                // Another write of the same block is in flight: not stored yet, and it may
                // still fail; the caller keeps its copy.
                Err(PoolError::BeingWritten) => return Err(DiskError::Busy),
                Err(PoolError::Full) => match st.pool.begin_evict() {
                    Some(v) => {
                        let _ = st.pool.finish_evict(v.slot, true);
                        evicted.push(v.hash);
                    }
                    None => return Err(DiskError::NoEvictable),
                },
                Err(_) => return Err(DiskError::NoEvictable),
            }
        }
    }

    /// Makes sure the file covers `slot`, growing it with fallocate.
    async fn ensure_allocated(&self, slot: u32) -> Result<(), DiskError> {
        let mut allocated = self.allocated.lock().await;
        if slot < *allocated {
            return Ok(());
        }
        let capacity = self.state.lock().pool.capacity();
        let want = (slot + 1).max(allocated.saturating_add(self.grow_blocks)).min(capacity);
        for target in [want, slot + 1] {
            let off = self.layout.file_bytes(*allocated);
            let len = self.layout.file_bytes(target) - off;
            // SAFETY: fallocate on our open file descriptor; no memory is involved.
            let r = unsafe {
                libc::fallocate(self.file.as_raw_fd(), 0, off as libc::off_t, len as libc::off_t)
            };
            if r == 0 {
                *allocated = target;
                return Ok(());
            }
        }
        let err = std::io::Error::last_os_error();
        tracing::warn!(slots = *allocated, error = %err, "disk tier cannot grow; capping it");
        Err(DiskError::Full(format!("growing the slot file past {} slots: {err}", *allocated)))
    }

    /// Writes a block from memory at `src` (at least [`DiskTier::data_bytes`] long, 4 KiB
    /// aligned), with its XXH3-64 `checksum` if the caller knows it (else it is computed here).
    /// The block is readable once this returns Ok.
    ///
    /// # Safety
    /// `src` must stay valid for reads until the write completes: `keep` must own or lease it.
    pub async unsafe fn write(
        &self,
        hash: SequenceHash,
        parent: Option<SequenceHash>,
        src: IoBuf,
        checksum: Option<u64>,
        keep: Box<dyn Send>,
    ) -> Result<WriteOutcome, DiskError> {
        let (slot, seq, evicted) = match self.reserve(hash, parent)? {
            Reservation::Slot { slot, seq, evicted } => (slot, seq, evicted),
            Reservation::Done(done) => return Ok(done),
        };
        let result = async move {
            // Capture the whole IoBuf (Send), not its raw-pointer field.
            let src: IoBuf = src;
            self.ensure_allocated(slot).await?;
            // SAFETY: the caller guarantees `src` is readable for data_bytes >= block_bytes.
            let data = unsafe { std::slice::from_raw_parts(src.ptr, self.block_bytes as usize) };
            let mut header = AlignedBuf::zeroed(HEADER_BYTES as usize);
            let data_checksum = checksum.unwrap_or_else(|| kvfabric::hash::data_checksum(data));
            SlotHeader {
                hash,
                parent,
                block_bytes: self.block_bytes,
                data_checksum,
                write_seq: seq,
            }
            .encode(header.as_mut_slice());
            // Data and header as two requests submitted together: a crash between them leaves
            // a header that does not match the data, and the block is dropped on read, never
            // served.
            let data = [IoBuf { ptr: src.ptr, len: self.data_bytes() as usize }];
            let head = [header.io_buf()];
            // SAFETY: `src` is kept by the caller's keep value, the header by its request.
            let (d, h) = unsafe {
                futures_util::future::join(
                    self.io.writev(self.layout.data_offset(slot), &data, keep),
                    self.io.writev(self.layout.header_offset(slot), &head, Box::new(header)),
                )
            }
            .await;
            let (d, h) = (d?, h?);
            if d as u64 != self.data_bytes() {
                return Err(DiskError::Short { op: "write", got: d, want: self.data_bytes() });
            }
            if h as u64 != HEADER_BYTES {
                return Err(DiskError::Short { op: "write", got: h, want: HEADER_BYTES });
            }
            Ok(data_checksum)
        }
        .await;
        let full = matches!(result, Err(DiskError::Full(_)));
        let allocated = if full { Some(*self.allocated.lock().await) } else { None };
        let mut st = self.state.lock();
        match result {
            Ok(data_checksum) => {
                st.checksums[slot as usize] = data_checksum;
                let _ = st.pool.commit(slot, 0);
                Ok(WriteOutcome { already_present: false, evicted })
            }
            Err(e) => {
                let _ = st.pool.abort(slot);
                if let Some(allocated) = allocated {
                    // The filesystem is full: stop growing; later writes evict instead.
                    let before = st.pool.usable();
                    st.pool.retire_free_from(allocated);
                    let after = st.pool.usable();
                    if after < before {
                        tracing::warn!(
                            path = %self.path.display(),
                            usable_slots = after,
                            "the disk tier's filesystem is full: the tier is capped at what \
                             fits, later blocks evict instead"
                        );
                    }
                }
                Err(e)
            }
        }
    }

    /// Reads a block into `dst` (at least [`DiskTier::data_bytes`] long, 4 KiB aligned),
    /// verifying its checksum; a corrupt block is dropped from the tier.
    ///
    /// The checksum is computed in the caller's task when this is the only read in flight
    /// (no thread hop on the latency path), and on the blocking pool when others are (the
    /// caller's task, which may be driving those reads, keeps submitting and completing them
    /// while this block is hashed, and the hashing spreads over the cores).
    ///
    /// # Safety
    /// `dst` must stay valid for writes until the read completes, and unwritten by anyone
    /// else until `keep` is dropped: `keep` must own or lease it (it is held by the I/O and
    /// by the verification).
    pub async unsafe fn read(
        &self,
        hash: SequenceHash,
        dst: IoBuf,
        keep: Arc<dyn Send + Sync>,
    ) -> Result<ReadOutcome, DiskError> {
        let (slot, parent, expected) = {
            let mut st = self.state.lock();
            let Some(slot) = st.pool.lookup(hash) else { return Ok(ReadOutcome::Miss) };
            let _ = st.pool.pin(slot);
            st.pool.touch(slot);
            (slot, st.pool.parent_of(hash), st.checksums[slot as usize])
        };
        let data = [IoBuf { ptr: dst.ptr, len: self.data_bytes() as usize }];
        let in_flight = InFlight::new(&self.reads_in_flight);
        // SAFETY: `dst` is kept by the caller's keep value.
        let n =
            unsafe { self.io.readv(self.layout.data_offset(slot), &data, Box::new(keep.clone())) }
                .await;
        drop(in_flight);
        let parallel = self.block_bytes >= PARALLEL_VERIFY_MIN_BYTES
            && self.reads_in_flight.load(std::sync::atomic::Ordering::Relaxed) > 0;
        let verdict = match n {
            Ok(n) if n as u64 == self.data_bytes() => {
                let len = self.block_bytes as usize;
                let sum = move || {
                    // Capture the whole IoBuf (Send), not its raw-pointer field.
                    let dst: IoBuf = dst;
                    let _keep = keep;
                    // SAFETY: the read completed into `dst`, valid for data_bytes >= len
                    // bytes and unwritten while `keep` (moved here) lives.
                    kvfabric::hash::data_checksum(unsafe {
                        std::slice::from_raw_parts(dst.ptr, len)
                    })
                };
                let sum = if parallel {
                    // Only a runtime shutting down cancels it: an error, not a verdict on
                    // the block, which stays on disk.
                    tokio::task::spawn_blocking(sum).await.map_err(|e| {
                        DiskError::Io(std::io::Error::other(format!(
                            "checksum verification did not run: {e}"
                        )))
                    })
                } else {
                    Ok(sum())
                };
                match sum {
                    Ok(sum) if sum == expected => {
                        Ok(ReadOutcome::Hit { parent, checksum: expected })
                    }
                    Ok(_) => Ok(ReadOutcome::Corrupt),
                    Err(e) => Err(e),
                }
            }
            // A short read: the file was truncated under us or the slot was never fully
            // written: corrupt.
            Ok(_) => Ok(ReadOutcome::Corrupt),
            Err(e) => Err(DiskError::Io(e)),
        };
        let mut st = self.state.lock();
        let _ = st.pool.unpin(slot);
        if verdict.as_ref().is_ok_and(|v| *v == ReadOutcome::Corrupt) {
            let _ = st.pool.remove(hash);
        }
        verdict
    }

    /// Forgets a block (its slot is reused later).
    ///
    /// Its header is zeroed on disk first (a tombstone), so a restart does not bring it back.
    /// If someone pins it meanwhile it stays indexed until read, when its zeroed header makes
    /// it a miss that is dropped.
    pub async fn remove(&self, hash: SequenceHash) -> bool {
        let slot = {
            let mut st = self.state.lock();
            let Some(slot) = st.pool.lookup(hash) else { return false };
            if st.pool.pin(slot).is_err() {
                return false;
            }
            slot
        };
        let header = AlignedBuf::zeroed(HEADER_BYTES as usize);
        let buf = header.io_buf();
        // SAFETY: the zeroed header buffer is owned by the request.
        let _ =
            unsafe { self.io.writev(self.layout.header_offset(slot), &[buf], Box::new(header)) }
                .await;
        let mut st = self.state.lock();
        let _ = st.pool.unpin(slot);
        st.pool.remove(hash).is_ok()
    }

    /// Forgets every block and empties the file. Returns the blocks that were on disk.
    pub async fn clear(&self) -> Result<Vec<SequenceHash>, DiskError> {
        let mut allocated = self.allocated.lock().await;
        let hashes = self.state.lock().pool.clear();
        self.file.set_len(0)?;
        *allocated = 0;
        Ok(hashes)
    }

    /// The state of a slot (tests).
    pub fn slot_state(&self, slot: u32) -> SlotState {
        self.state.lock().pool.state(slot)
    }

    /// Byte offset of a slot's data in the file (tests that corrupt blocks).
    pub fn data_offset(&self, slot: u32) -> u64 {
        self.layout.data_offset(slot)
    }

    /// Byte offset of a slot's header page in the file (tests that corrupt headers).
    pub fn header_offset(&self, slot: u32) -> u64 {
        self.layout.header_offset(slot)
    }

    /// The slot holding a block (tests).
    pub fn slot_of(&self, hash: SequenceHash) -> Option<u32> {
        self.state.lock().pool.lookup(hash)
    }
}
