//! A peer's shareable region mapped into this process: what the shm transport copies through.
//! Mapped when the peer is loaded (`crate::peer`), below the transports, and only once the
//! memfd's seal proves it is this deployment's and the named agent's ([`ShmSeal`]).

use std::fs::File;
use std::path::Path;
use std::ptr::NonNull;

use super::copy::copy_bytes;
use super::{MemoryError, Region, RegionId, ShmSeal, SEAL_BYTES};

/// A peer's shareable region mapped into this process (shm transport).
pub struct PeerMapping {
    ptr: NonNull<u8>,
    len: usize,
    _map: memmap2::MmapMut,
}

impl std::fmt::Debug for PeerMapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerMapping").field("len", &self.len).finish()
    }
}

// SAFETY: the mapping lives as long as the PeerMapping; access is through raw copies only.
unsafe impl Send for PeerMapping {}
// SAFETY: as above.
unsafe impl Sync for PeerMapping {}

impl PeerMapping {
    /// Maps a peer's shareable region, `len` bytes of region `region`, from `path` (the
    /// peer's `/proc/{pid}/fd/{fd}`), once its seal proves that the agent `owner` of the
    /// deployment `seal` belongs to made it for that region ([`ShmSeal`]). Nothing is mapped
    /// before the seal is checked.
    ///
    /// A path that is not a kvfabric memfd of that region (the peer exited, or the
    /// descriptor now holds something else) is [`MemoryError::Shm`]: the region is only out
    /// of reach. A kvfabric memfd of that region whose seal does not hold is
    /// [`MemoryError::NotSealed`]: the metadata lies.
    pub fn open(
        path: &Path,
        len: usize,
        seal: &ShmSeal,
        owner: &str,
        region: RegionId,
    ) -> Result<Self, MemoryError> {
        use std::os::unix::fs::{FileExt, OpenOptionsExt};
        let err = |source| MemoryError::Shm { path: path.to_path_buf(), source };
        let not_ours = || err(std::io::Error::other("not a kvfabric shared-memory region"));
        // Paths come from peer metadata: only a descriptor of a process, and only one that
        // is a kvfabric memfd of this region — checked before opening (opening some files
        // has effects) and again on what was opened (the descriptor may change between).
        if !is_proc_fd_path(path) {
            return Err(not_ours());
        }
        let expected = |link: std::path::PathBuf| memfd_region_name(link, region);
        if std::fs::read_link(path).ok().and_then(expected).is_none() {
            return Err(not_ours());
        }
        let file: File = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
            .open(path)
            .map_err(err)?;
        let opened = {
            use std::os::fd::AsRawFd;
            std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd()))
        };
        let Some(file_name) = opened.ok().and_then(expected) else {
            return Err(not_ours());
        };
        let file_name = file_name.as_str();
        let meta = file.metadata().map_err(err)?;
        let not_sealed = || MemoryError::NotSealed {
            path: path.to_path_buf(),
            owner: owner.to_string(),
            region,
        };
        // The owner sized it to exactly the region and its seal.
        if len == 0 || !meta.is_file() || meta.len() != len as u64 + SEAL_BYTES as u64 {
            return Err(not_sealed());
        }
        let mut trailer = [0u8; SEAL_BYTES];
        file.read_exact_at(&mut trailer, len as u64).map_err(err)?;
        if !seal.check(&trailer, file_name, owner, region, len as u64) {
            return Err(not_sealed());
        }
        // SAFETY: a shared mapping of a memfd the peer created and never truncates; if the
        // peer dies the pages stay valid while mapped.
        let map = unsafe { memmap2::MmapOptions::new().len(len).map_mut(&file) }.map_err(err)?;
        let ptr = NonNull::new(map.as_ptr() as *mut u8).ok_or(MemoryError::ZeroLength)?;
        Ok(PeerMapping { ptr, len, _map: map })
    }

    /// Pointer to a checked range of the mapping.
    pub fn ptr_at(&self, offset: u64, len: u64) -> Option<*mut u8> {
        let end = offset.checked_add(len)?;
        if end > self.len as u64 {
            return None;
        }
        // SAFETY: offset is within the mapping (checked above).
        Some(unsafe { self.ptr.as_ptr().add(offset as usize) })
    }

    /// Fills this process's page tables for the whole mapping, without touching its bytes
    /// (`MADV_POPULATE_WRITE`), so that copies into it take no page fault: a first write to
    /// each page of a fresh mapping cost 15 ms per 43 MB here, a third of a fabric GET. Safe
    /// while copies run; a hint (an older kernel refuses it, and pages fault in as before).
    pub fn prefault(&self) {
        const STEP: usize = 64 << 20;
        let mut at = 0;
        while at < self.len {
            let n = STEP.min(self.len - at);
            // SAFETY: a page-aligned range (the mapping starts on a page, STEP is a multiple
            // of every page size) within the live mapping; MADV_POPULATE_WRITE only maps
            // pages, it reads and writes no byte.
            let rc = unsafe {
                libc::madvise(self.ptr.as_ptr().add(at).cast(), n, libc::MADV_POPULATE_WRITE)
            };
            if rc != 0 {
                return;
            }
            at += n;
        }
    }

    /// XXH3-64 of a checked range.
    pub fn checksum(&self, offset: u64, len: u64) -> Option<u64> {
        let p = self.ptr_at(offset, len)?;
        // SAFETY: checked range of the live mapping, read only for this call.
        Some(crate::hash::data_checksum(unsafe { std::slice::from_raw_parts(p, len as usize) }))
    }
}

/// Whether `path` is `/proc/{pid}/fd/{fd}`, both numbers plain decimal.
fn is_proc_fd_path(path: &Path) -> bool {
    let Some(s) = path.to_str() else { return false };
    let number = |p: &str| !p.is_empty() && p.len() <= 10 && p.bytes().all(|b| b.is_ascii_digit());
    match s.strip_prefix("/proc/").and_then(|r| r.split_once("/fd/")) {
        Some((pid, fd)) => number(pid) && number(fd),
        None => false,
    }
}

/// The memfd name in `link` (what `/proc/{pid}/fd/{fd}` points at: `/memfd:NAME (deleted)`)
/// when it names a kvfabric region with id `region`.
fn memfd_region_name(link: std::path::PathBuf, region: RegionId) -> Option<String> {
    let link = link.to_str()?;
    let name = link.strip_prefix("/memfd:")?.strip_suffix(" (deleted)")?;
    let suffix = format!(".{}.{}", region.index(), region.generation());
    (name.starts_with("kvfabric.") && name.ends_with(&suffix)).then(|| name.to_string())
}

/// Copies between a local region and a peer mapping: `to_peer` writes into the mapping.
pub fn copy_with_peer(
    local: &Region,
    local_offset: u64,
    peer: &PeerMapping,
    peer_offset: u64,
    len: u64,
    to_peer: bool,
) -> Result<(), MemoryError> {
    let l = local.ptr_at(local_offset, len)?;
    let p = peer.ptr_at(peer_offset, len).ok_or(MemoryError::OutOfBounds {
        id: RegionId(u64::MAX),
        offset: peer_offset,
        len,
        region_len: peer.len as u64,
    })?;
    // SAFETY: both ranges are checked against live mappings; they are different mappings
    // (even when backed by one file they are separate address ranges).
    unsafe {
        if to_peer {
            copy_bytes(l, p, len as usize)
        } else {
            copy_bytes(p, l, len as usize)
        }
    }
    Ok(())
}
