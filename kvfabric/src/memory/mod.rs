//! Memory regions: registered, bounds-checked ranges of memory that transfers read and write.
//!
//! Core concepts:
//! - [`RegionId`]: a handle (slab index + generation), never a pointer. A stale id (its region
//!   deregistered, the slot reused) is refused, not aliased.
//! - [`Region`]: one registered range. Host memory of three kinds: owned (anonymous mmap,
//!   page-aligned, pre-faulted, optionally huge pages), shareable (a memfd that a peer on the same
//!   host maps through `/proc/{pid}/fd`), and external memory the caller owns, registered through an
//!   `unsafe` constructor. GPU memory ([`MemoryKind::Device`]): allocated by kvfabric (an
//!   owner value frees it with the region) or an engine's existing allocation, registered
//!   through an `unsafe` constructor; the CPU never touches it: every host access of a device
//!   region is refused with [`MemoryError::NotHostMemory`], so only CUDA copies reach it.
//!   Registering is O(1) in the region's size: no per-page work beyond what allocation itself
//!   does.
//! - [`RegionLease`]: what an in-flight transfer holds. A region with leases cannot be
//!   deregistered ([`MemoryError::RegionBusy`]), and owned memory stays mapped until the last
//!   lease is gone, so bytes can never land in freed memory.
//! - [`RegionTable`]: the registry, read-mostly (an `RwLock` taken briefly to clone an `Arc`).
//!
//! Regions are treated like DMA memory: the engine copies bytes in and out through raw
//! pointers, and concurrent transfers that overlap in one region see unspecified bytes (as with
//! RDMA or NIXL). All `unsafe` of the data plane's memory access lives in this module and its two parts:
//! [`mapping`] (a peer's shared region mapped here, for the shm transport) and `copy` (the
//! copy that streams large blocks past the caches).

use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::RwLock;

mod copy;
mod mapping;
mod seal;

use copy::copy_bytes;
pub use mapping::{copy_with_peer, PeerMapping};
pub use seal::{ShmSeal, SEAL_BYTES};

/// Why a region operation failed.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    /// A zero-length region was asked for.
    #[error("region length must be at least 1 byte")]
    ZeroLength,
    /// A region at address 0.
    #[error("a region cannot start at address 0")]
    NullAddress,
    /// The kernel refused the allocation.
    #[error("allocating {len} bytes failed: {source}")]
    Alloc {
        /// Bytes asked for.
        len: usize,
        /// The OS error.
        source: std::io::Error,
    },
    /// Huge pages were asked for and none are available.
    #[error("huge pages unavailable for {len} bytes (see /proc/sys/vm/nr_hugepages): {source}")]
    HugePagesUnavailable {
        /// Bytes asked for.
        len: usize,
        /// The OS error.
        source: std::io::Error,
    },
    /// A shared-memory file could not be created or mapped.
    #[error("shared memory {path}: {source}")]
    Shm {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A peer's shared-memory file that does not carry the seal of this deployment for the
    /// peer and region its metadata names: another deployment's file, another agent's, or a
    /// forgery. Nothing of it was mapped.
    #[error(
        "shared memory {path} is not sealed for {owner:?}, region {region}, by this \
         deployment: it belongs to another deployment (a different secret) or another agent"
    )]
    NotSealed {
        /// The file.
        path: PathBuf,
        /// The agent the metadata said owns it.
        owner: String,
        /// The region the metadata said it holds.
        region: RegionId,
    },
    /// No region has this id (never registered, deregistered, or a stale generation).
    #[error("unknown region {0}")]
    UnknownRegion(RegionId),
    /// The region is still held: by in-flight transfers, or by handles not yet dropped.
    #[error("region {id} is still held ({leases} reference(s): in-flight transfers or handles)")]
    RegionBusy {
        /// The region.
        id: RegionId,
        /// References outstanding.
        leases: usize,
    },
    /// A range outside the region.
    #[error("range {offset}+{len} is outside region {id} of {region_len} bytes")]
    OutOfBounds {
        /// The region.
        id: RegionId,
        /// Start of the range.
        offset: u64,
        /// Length of the range.
        len: u64,
        /// Length of the region.
        region_len: u64,
    },
    /// The region table is full.
    #[error("too many regions registered (limit {0})")]
    TooManyRegions(usize),
    /// A host access (a memcpy, a checksum, a view) of GPU memory.
    #[error("region {id} is memory of CUDA device {ordinal}: only CUDA copies reach it")]
    NotHostMemory {
        /// The region.
        id: RegionId,
        /// Its device.
        ordinal: u32,
    },
}

/// What kind of region problem a [`MemoryError`] is: a `Copy` value that travels inside
/// other errors (a transfer's) and that callers map to their own codes (the C ABI's) without
/// reading the message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemoryErrorKind {
    /// [`MemoryError::ZeroLength`] or [`MemoryError::NullAddress`].
    ZeroLength,
    /// [`MemoryError::Alloc`] or [`MemoryError::HugePagesUnavailable`].
    OutOfMemory,
    /// [`MemoryError::Shm`] or [`MemoryError::NotSealed`].
    SharedMemory,
    /// [`MemoryError::UnknownRegion`].
    UnknownRegion,
    /// [`MemoryError::RegionBusy`].
    RegionBusy,
    /// [`MemoryError::OutOfBounds`].
    OutOfBounds,
    /// [`MemoryError::TooManyRegions`].
    TooManyRegions,
    /// [`MemoryError::NotHostMemory`].
    NotHostMemory,
}

impl MemoryError {
    /// Its kind.
    pub fn kind(&self) -> MemoryErrorKind {
        match self {
            MemoryError::ZeroLength | MemoryError::NullAddress => MemoryErrorKind::ZeroLength,
            MemoryError::Alloc { .. } | MemoryError::HugePagesUnavailable { .. } => {
                MemoryErrorKind::OutOfMemory
            }
            MemoryError::Shm { .. } | MemoryError::NotSealed { .. } => {
                MemoryErrorKind::SharedMemory
            }
            MemoryError::UnknownRegion(_) => MemoryErrorKind::UnknownRegion,
            MemoryError::RegionBusy { .. } => MemoryErrorKind::RegionBusy,
            MemoryError::OutOfBounds { .. } => MemoryErrorKind::OutOfBounds,
            MemoryError::TooManyRegions(_) => MemoryErrorKind::TooManyRegions,
            MemoryError::NotHostMemory { .. } => MemoryErrorKind::NotHostMemory,
        }
    }
}

/// A region's handle: slab index in the low 32 bits, generation in the high 32 bits.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(transparent)]
pub struct RegionId(pub u64);

impl RegionId {
    fn new(index: u32, generation: u32) -> Self {
        RegionId(u64::from(generation) << 32 | u64::from(index))
    }

    fn index(self) -> usize {
        (self.0 & 0xffff_ffff) as usize
    }

    fn generation(self) -> u32 {
        (self.0 >> 32) as u32
    }
}

impl std::fmt::Display for RegionId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}#{}", self.index(), self.generation())
    }
}

/// The name of a shareable region's memfd: `{prefix}.{index}.{generation}`, the prefix cut
/// to fit the kernel's limit on memfd names (249 bytes). The name is what the seal covers
/// and what a peer checks against the region id its metadata names.
fn memfd_name(prefix: &str, id: RegionId) -> String {
    let suffix = format!(".{}.{}", id.index(), id.generation());
    let mut cut = prefix.len().min(200);
    while !prefix.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}{suffix}", &prefix[..cut])
}

/// How to allocate an owned region.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RegionOptions {
    /// Back it by a `/dev/shm` file that peers on the same host can map (the shm transport).
    pub shared: bool,
    /// Use 2 MiB huge pages (anonymous memory only); fails if none are reserved.
    pub huge_pages: bool,
    /// Let peers read and write it. A region that is not exported is only a local source or
    /// destination.
    pub export: bool,
}

/// GPU memory to register as a region ([`RegionTable::register_device`]).
pub struct DeviceMemory {
    /// Its device address.
    pub addr: u64,
    /// Bytes.
    pub len: usize,
    /// The CUDA device's ordinal in this process.
    pub ordinal: u32,
    /// What frees the memory when the region drops (a kvfabric allocation); None for an
    /// engine's memory, which the engine frees after deregistering.
    pub owner: Option<Box<dyn std::any::Any + Send + Sync>>,
    /// Its CUDA IPC export, for peers on this host.
    pub ipc: Option<crate::cuda::DeviceExport>,
}

impl std::fmt::Debug for DeviceMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceMemory")
            .field("len", &self.len)
            .field("ordinal", &self.ordinal)
            .field("owned", &self.owner.is_some())
            .finish()
    }
}

/// Where a region's bytes live.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum MemoryKind {
    /// Host memory: the CPU reads and writes it.
    #[default]
    Host,
    /// Memory of the CUDA device with this ordinal in the owning process.
    Device(u32),
}

enum Backing {
    /// Anonymous mmap we own, `mapped` bytes (the length rounded up to the page size).
    Anonymous { mapped: usize },
    /// A memfd and its mapping; `path` is where peers on this host open it
    /// (`/proc/{pid}/fd/{fd}`). The memory goes when the last descriptor and mapping do.
    Shared { path: PathBuf, _file: std::fs::File, _map: memmap2::MmapMut },
    /// Memory the caller owns.
    External,
    /// Memory whose owner value (a CUDA allocation) frees it when the region drops.
    Owned(#[allow(dead_code)] Box<dyn std::any::Any + Send + Sync>),
}

/// One registered memory range.
pub struct Region {
    id: RegionId,
    ptr: NonNull<u8>,
    len: usize,
    backing: Backing,
    kind: MemoryKind,
    /// The CUDA IPC export of a device region that peers on this host may map.
    ipc: Option<crate::cuda::DeviceExport>,
    exported: bool,
    leases: AtomicUsize,
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region")
            .field("id", &self.id)
            .field("len", &self.len)
            .field("kind", &self.kind)
            .field("shared", &self.shm_path())
            .field("exported", &self.exported)
            .field("leases", &self.leases.load(Ordering::Relaxed))
            .finish()
    }
}

// SAFETY: a Region is a pointer and a length into memory that stays mapped for the Region's
// lifetime (owned) or that the caller promised to keep valid until deregistration (external).
// All access goes through raw copies whose races are documented as unspecified bytes, never
// through references shared across threads.
unsafe impl Send for Region {}
// SAFETY: as above; `&Region` only exposes the pointer through raw copies and atomics.
unsafe impl Sync for Region {}

impl Drop for Region {
    fn drop(&mut self) {
        match &self.backing {
            Backing::Anonymous { mapped } => {
                // SAFETY: ptr/mapped are exactly what mmap returned in `alloc_anonymous`, and
                // this is the last reference to the region (Drop), so no transfer can use it.
                unsafe {
                    libc::munmap(self.ptr.as_ptr().cast(), *mapped);
                }
            }
            Backing::External | Backing::Shared { .. } | Backing::Owned(_) => {}
        }
    }
}

impl Region {
    /// Its id.
    pub fn id(&self) -> RegionId {
        self.id
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty (never: regions have at least one byte).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Where its bytes live.
    pub fn kind(&self) -> MemoryKind {
        self.kind
    }

    /// The CUDA IPC export of a device region (for peers on this host).
    pub fn cuda_ipc(&self) -> Option<&crate::cuda::DeviceExport> {
        self.ipc.as_ref()
    }

    /// Whether peers may access it.
    pub fn is_exported(&self) -> bool {
        self.exported
    }

    /// Where a peer on this host opens a shareable region's memory (`/proc/{pid}/fd/{fd}`).
    pub fn shm_path(&self) -> Option<&Path> {
        match &self.backing {
            Backing::Shared { path, .. } => Some(path),
            _ => None,
        }
    }

    /// Leases outstanding.
    pub fn leases(&self) -> usize {
        self.leases.load(Ordering::Acquire)
    }

    /// Checks that `offset..offset+len` lies inside the region.
    pub fn check(&self, offset: u64, len: u64) -> Result<(), MemoryError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len as u64 => Ok(()),
            _ => Err(MemoryError::OutOfBounds {
                id: self.id,
                offset,
                len,
                region_len: self.len as u64,
            }),
        }
    }

    /// Checks that `offset..offset+len` lies inside the region and that the CPU may touch
    /// it (host memory).
    fn check_host(&self, offset: u64, len: u64) -> Result<(), MemoryError> {
        if let MemoryKind::Device(ordinal) = self.kind {
            return Err(MemoryError::NotHostMemory { id: self.id, ordinal });
        }
        self.check(offset, len)
    }

    /// The device address of `offset` in a device region (range checked), with the device's
    /// ordinal: what a CUDA copy takes.
    pub fn device_addr(&self, offset: u64, len: u64) -> Option<(u32, u64)> {
        let MemoryKind::Device(ordinal) = self.kind else { return None };
        self.check(offset, len).ok()?;
        Some((ordinal, self.ptr.as_ptr() as u64 + offset))
    }

    /// Copies `src` into the region at `offset`.
    pub fn write_at(&self, offset: u64, src: &[u8]) -> Result<(), MemoryError> {
        self.check_host(offset, src.len() as u64)?;
        // SAFETY: the range was checked to lie inside the mapping, which is live while `self`
        // is; `src` is a distinct Rust allocation, so the ranges cannot overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.as_ptr(),
                self.ptr.as_ptr().add(offset as usize),
                src.len(),
            );
        }
        Ok(())
    }

    /// Copies bytes of the region at `offset` into `dst`.
    pub fn read_at(&self, offset: u64, dst: &mut [u8]) -> Result<(), MemoryError> {
        self.check_host(offset, dst.len() as u64)?;
        // SAFETY: as in `write_at`, with source and destination swapped.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.as_ptr().add(offset as usize),
                dst.as_mut_ptr(),
                dst.len(),
            );
        }
        Ok(())
    }

    /// Fills `offset..offset+len` with `byte`.
    pub fn fill(&self, offset: u64, len: u64, byte: u8) -> Result<(), MemoryError> {
        self.check_host(offset, len)?;
        // SAFETY: the range was checked to lie inside the live mapping.
        unsafe {
            std::ptr::write_bytes(self.ptr.as_ptr().add(offset as usize), byte, len as usize)
        };
        Ok(())
    }

    /// XXH3-64 of `offset..offset+len`.
    pub fn checksum(&self, offset: u64, len: u64) -> Result<u64, MemoryError> {
        self.check_host(offset, len)?;
        // SAFETY: checked range of the live mapping; the slice lives only for this call and
        // is only read (concurrent writers make the hash unspecified, never unsound to read
        // as bytes).
        let bytes = unsafe { self.slice(offset, len) };
        Ok(crate::hash::data_checksum(bytes))
    }

    /// A short-lived view of `offset..offset+len` (for hashing).
    ///
    /// # Safety
    /// The range must have been checked with [`Region::check`], and the caller must not hold
    /// the slice past the call it was made for.
    unsafe fn slice(&self, offset: u64, len: u64) -> &[u8] {
        // SAFETY: per the caller's contract the range is inside the live mapping.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(offset as usize), len as usize) }
    }

    /// A view of `offset..offset+len`, read in place (an engine's attention over cached KV).
    ///
    /// # Safety
    /// While the slice lives, nothing may write the range: not this process (through
    /// [`Region::write_at`], a transfer, or a [`Region::view_mut`] of it) and not a peer (the
    /// owner of the range, such as the block store with a pinned block, guarantees that no
    /// descriptor naming it is handed out for writing).
    pub unsafe fn view(&self, offset: u64, len: u64) -> Result<&[u8], MemoryError> {
        self.check_host(offset, len)?;
        // SAFETY: the range is inside the live mapping (checked), which outlives `&self`; the
        // caller guarantees that nothing writes it while the view lives.
        Ok(unsafe { self.slice(offset, len) })
    }

    /// A mutable view of `offset..offset+len` (an engine writing the KV it computes straight
    /// into a block store slot).
    ///
    /// # Safety
    /// While the slice lives, nothing else may read or write the range: the caller owns it
    /// exclusively (a reserved store slot, invisible until committed).
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn view_mut(&self, offset: u64, len: u64) -> Result<&mut [u8], MemoryError> {
        self.check_host(offset, len)?;
        // SAFETY: the range is inside the live mapping (checked), which outlives `&self`; the
        // caller guarantees exclusive access to it while the view lives.
        Ok(unsafe {
            std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(offset as usize), len as usize)
        })
    }

    /// Raw host pointer to `offset` (checked), for copies between two regions; refused for
    /// device memory.
    pub fn ptr_at(&self, offset: u64, len: u64) -> Result<*mut u8, MemoryError> {
        self.check_host(offset, len)?;
        // SAFETY: offset is within the mapping (checked above), so the add stays in bounds.
        Ok(unsafe { self.ptr.as_ptr().add(offset as usize) })
    }
}

/// Copies `len` bytes between two (possibly identical) regions, both ranges checked.
pub fn copy_between(
    src: &Region,
    src_offset: u64,
    dst: &Region,
    dst_offset: u64,
    len: u64,
) -> Result<(), MemoryError> {
    let s = src.ptr_at(src_offset, len)?;
    let d = dst.ptr_at(dst_offset, len)?;
    // SAFETY: both ranges were bounds-checked against live mappings; `copy_bytes` is
    // correct even when the two ranges overlap inside one region.
    unsafe { copy_bytes(s, d, len as usize) };
    Ok(())
}

/// A lease on a region held by an in-flight transfer; dropping it releases the region.
#[derive(Debug)]
pub struct RegionLease {
    region: Arc<Region>,
}

impl RegionLease {
    /// Leases `region`.
    pub fn new(region: Arc<Region>) -> Self {
        region.leases.fetch_add(1, Ordering::AcqRel);
        RegionLease { region }
    }

    /// The leased region.
    pub fn region(&self) -> &Region {
        &self.region
    }
}

impl Clone for RegionLease {
    fn clone(&self) -> Self {
        RegionLease::new(self.region.clone())
    }
}

impl Drop for RegionLease {
    fn drop(&mut self) {
        self.region.leases.fetch_sub(1, Ordering::AcqRel);
    }
}

fn page_size() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as usize
    } else {
        4096
    }
}

fn alloc_anonymous(len: usize, huge_pages: bool) -> Result<(NonNull<u8>, usize), MemoryError> {
    let align = if huge_pages { 2 << 20 } else { page_size() };
    let mapped = len.div_ceil(align).saturating_mul(align);
    let mut flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
    if huge_pages {
        flags |= libc::MAP_HUGETLB | libc::MAP_POPULATE;
    }
    // SAFETY: an anonymous private mapping at an address of the kernel's choosing touches no
    // existing memory; the result is checked for MAP_FAILED below.
    let ptr = unsafe {
        libc::mmap(std::ptr::null_mut(), mapped, libc::PROT_READ | libc::PROT_WRITE, flags, -1, 0)
    };
    if ptr == libc::MAP_FAILED {
        let source = std::io::Error::last_os_error();
        return Err(if huge_pages {
            MemoryError::HugePagesUnavailable { len, source }
        } else {
            MemoryError::Alloc { len, source }
        });
    }
    if !huge_pages {
        // Ask for transparent huge pages where the kernel allows them (fewer TLB misses and
        // cheaper page pinning for O_DIRECT and DMA), then pre-fault. Both are hints: failure
        // leaves ordinary pages, faulted on first touch.
        // SAFETY: advising and pre-faulting our own fresh mapping of `mapped` bytes.
        unsafe {
            libc::madvise(ptr, mapped, libc::MADV_HUGEPAGE);
            libc::madvise(ptr, mapped, libc::MADV_POPULATE_WRITE);
        }
    }
    NonNull::new(ptr.cast::<u8>())
        .map(|p| (p, mapped))
        .ok_or(MemoryError::Alloc { len, source: std::io::Error::other("mmap returned null") })
}

/// The registry of an agent's regions.
#[derive(Debug)]
pub struct RegionTable {
    slots: RwLock<Slots>,
    shm_prefix: String,
    regions_max: usize,
    /// Seals the files of shareable regions, for `owner`.
    seal: ShmSeal,
    owner: String,
}

#[derive(Debug, Default)]
struct Slots {
    entries: Vec<Slot>,
    free: Vec<u32>,
}

#[derive(Debug, Default)]
struct Slot {
    generation: u32,
    region: Option<Arc<Region>>,
}

impl RegionTable {
    /// A table whose shared regions are memfds named `{shm_prefix}.{index}.{generation}`,
    /// each sealed with `seal` as the agent `owner`'s.
    pub fn new(
        shm_prefix: impl Into<String>,
        regions_max: usize,
        seal: ShmSeal,
        owner: impl Into<String>,
    ) -> Self {
        RegionTable {
            slots: RwLock::new(Slots::default()),
            shm_prefix: shm_prefix.into(),
            regions_max,
            seal,
            owner: owner.into(),
        }
    }

    fn insert(
        &self,
        make: impl FnOnce(RegionId) -> Result<Region, MemoryError>,
    ) -> Result<Arc<Region>, MemoryError> {
        // Reserve a slot under the lock (off the free list, still without a region, so
        // lookups miss it), build the region — mapping and pre-faulting may take long —
        // without the lock, then install it.
        let id = {
            let mut slots = self.slots.write();
            let index = match slots.free.pop() {
                Some(i) => i,
                None => {
                    if slots.entries.len() >= self.regions_max {
                        return Err(MemoryError::TooManyRegions(self.regions_max));
                    }
                    slots.entries.push(Slot::default());
                    (slots.entries.len() - 1) as u32
                }
            };
            RegionId::new(index, slots.entries[index as usize].generation)
        };
        let made = make(id);
        let mut slots = self.slots.write();
        match made {
            Ok(region) => {
                let region = Arc::new(region);
                slots.entries[id.index()].region = Some(region.clone());
                Ok(region)
            }
            Err(e) => {
                slots.free.push(id.index() as u32);
                Err(e)
            }
        }
    }

    /// Allocates and registers an owned region of `len` bytes.
    pub fn alloc(&self, len: usize, opts: RegionOptions) -> Result<Arc<Region>, MemoryError> {
        if len == 0 {
            return Err(MemoryError::ZeroLength);
        }
        self.insert(|id| {
            if opts.shared {
                // An anonymous shared-memory file (memfd): it has no name in any directory, so
                // nothing outlives this process however it dies (SIGKILL included). Peers on
                // this host open it through `/proc/{pid}/fd/{fd}`, which the kernel lets only
                // processes that may inspect this one (same user, PTRACE_MODE_READ) open.
                let name = memfd_name(&self.shm_prefix, id);
                let shm_err = |source| MemoryError::Shm {
                    path: PathBuf::from(format!("memfd:{name}")),
                    source,
                };
                let c_name = std::ffi::CString::new(name.clone())
                    .map_err(|_| shm_err(std::io::Error::other("a NUL in the region's name")))?;
                // SAFETY: plain syscall with a NUL-terminated name that outlives the call.
                let fd = unsafe { libc::memfd_create(c_name.as_ptr(), libc::MFD_CLOEXEC) };
                if fd < 0 {
                    return Err(shm_err(std::io::Error::last_os_error()));
                }
                // SAFETY: memfd_create just returned this descriptor; nothing else owns it.
                let file = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
                let map = (|| {
                    // The region's bytes, then the seal that tells peers whose memory it is.
                    let file_len = len as u64 + SEAL_BYTES as u64;
                    file.set_len(file_len)?;
                    // Reserve the pages now: a full shared-memory limit is an error here, not
                    // a SIGBUS at the first touch of an unbacked page.
                    // SAFETY: plain syscall on a file descriptor we own; no memory is passed.
                    let rc = unsafe { libc::posix_fallocate(fd, 0, file_len as libc::off_t) };
                    if rc != 0 {
                        return Err(std::io::Error::from_raw_os_error(rc));
                    }
                    let trailer = self.seal.trailer(&name, &self.owner, id, len as u64);
                    std::os::unix::fs::FileExt::write_all_at(&file, &trailer, len as u64)?;
                    // SAFETY: the memfd was just created by us and is sized past `len`; peers
                    // map it but never truncate it.
                    unsafe { memmap2::MmapOptions::new().len(len).populate().map_mut(&file) }
                })()
                .map_err(shm_err)?;
                let ptr = NonNull::new(map.as_ptr() as *mut u8).ok_or(MemoryError::ZeroLength)?;
                let path = PathBuf::from(format!("/proc/{}/fd/{fd}", std::process::id()));
                Ok(Region {
                    id,
                    ptr,
                    len,
                    backing: Backing::Shared { path, _file: file, _map: map },
                    kind: MemoryKind::Host,
                    ipc: None,
                    exported: opts.export,
                    leases: AtomicUsize::new(0),
                })
            } else {
                let (ptr, mapped) = alloc_anonymous(len, opts.huge_pages)?;
                Ok(Region {
                    id,
                    ptr,
                    len,
                    backing: Backing::Anonymous { mapped },
                    kind: MemoryKind::Host,
                    ipc: None,
                    exported: opts.export,
                    leases: AtomicUsize::new(0),
                })
            }
        })
    }

    /// Registers memory the caller owns.
    ///
    /// # Safety
    /// `ptr..ptr+len` must be valid for reads and writes, and stay valid and unmoved until
    /// [`RegionTable::deregister`] returns `Ok` for this region. The caller must not access
    /// those bytes while a transfer on them is in flight except through raw copies.
    pub unsafe fn register_external(
        &self,
        ptr: NonNull<u8>,
        len: usize,
        export: bool,
    ) -> Result<Arc<Region>, MemoryError> {
        if len == 0 {
            return Err(MemoryError::ZeroLength);
        }
        self.insert(|id| {
            Ok(Region {
                id,
                ptr,
                len,
                backing: Backing::External,
                kind: MemoryKind::Host,
                ipc: None,
                exported: export,
                leases: AtomicUsize::new(0),
            })
        })
    }

    /// Registers GPU memory: an engine's allocation (the caller keeps owning it) when
    /// `mem.owner` is None, else an allocation that the owner value frees when the region
    /// drops.
    ///
    /// # Safety
    /// `mem.addr..mem.addr+mem.len` must be memory of CUDA device `mem.ordinal`, valid and
    /// unmoved until the region is deregistered (an engine's allocation) or dropped (with an
    /// owner); `mem.ipc`, if any, must export exactly that memory.
    pub unsafe fn register_device(
        &self,
        mem: DeviceMemory,
        export: bool,
    ) -> Result<Arc<Region>, MemoryError> {
        if mem.len == 0 {
            return Err(MemoryError::ZeroLength);
        }
        let ptr = NonNull::new(mem.addr as *mut u8).ok_or(MemoryError::NullAddress)?;
        self.insert(|id| {
            Ok(Region {
                id,
                ptr,
                len: mem.len,
                backing: mem.owner.map_or(Backing::External, Backing::Owned),
                kind: MemoryKind::Device(mem.ordinal),
                ipc: mem.ipc,
                exported: export,
                leases: AtomicUsize::new(0),
            })
        })
    }

    /// The region with this id.
    pub fn get(&self, id: RegionId) -> Result<Arc<Region>, MemoryError> {
        let slots = self.slots.read();
        slots
            .entries
            .get(id.index())
            .filter(|s| s.generation == id.generation())
            .and_then(|s| s.region.clone())
            .ok_or(MemoryError::UnknownRegion(id))
    }

    /// Removes a region. Fails while anything else holds it — a transfer's lease, or a handle
    /// (`Arc<Region>`) the caller kept: drop those first. On success an external region's
    /// memory is the caller's again: nothing can reach it any more.
    pub fn deregister(&self, id: RegionId) -> Result<(), MemoryError> {
        let mut slots = self.slots.write();
        let slot = slots
            .entries
            .get_mut(id.index())
            .filter(|s| s.generation == id.generation() && s.region.is_some())
            .ok_or(MemoryError::UnknownRegion(id))?;
        // Every copy of the region's Arc (leases, handles returned to callers, in-flight
        // server targets) is made while this table is readable, so under the write lock the
        // count is exact: any other holder may still touch the memory.
        let holders = slot.region.as_ref().map_or(0, |r| Arc::strong_count(r).saturating_sub(1));
        if holders > 0 {
            return Err(MemoryError::RegionBusy { id, leases: holders });
        }
        slot.region = None;
        slot.generation = slot.generation.wrapping_add(1);
        slots.free.push(id.index() as u32);
        Ok(())
    }

    /// Every registered region.
    pub fn all(&self) -> Vec<Arc<Region>> {
        self.slots.read().entries.iter().filter_map(|s| s.region.clone()).collect()
    }
}

#[cfg(test)]
mod tests;
