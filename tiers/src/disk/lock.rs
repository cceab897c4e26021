//! One process per slot file: a disk tier holds an exclusive `flock` on `{slots}.lock` for as
//! long as it is open, with its pid written inside. A second process that opens the same slot
//! file is refused, naming the owner's pid, instead of overwriting the first's slots. The
//! kernel drops the lock of a process that dies, so a lock file left by a dead process is
//! taken over at once (and logged with the dead pid).

use std::fs::File;
use std::io::{Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use super::DiskError;

/// How long a tier waits for another tier of its own process on the same file to close.
pub const SAME_PROCESS_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// The lock of a slot file, released when dropped (or when the process exits).
#[derive(Debug)]
pub struct SlotFileLock {
    _file: File,
    path: PathBuf,
}

impl SlotFileLock {
    /// Locks the slot file `slots` for this process.
    pub fn acquire(slots: &Path) -> Result<Self, DiskError> {
        let mut name = slots.as_os_str().to_owned();
        name.push(".lock");
        let path = PathBuf::from(name);
        loop {
            let mut file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&path)?;
            // SAFETY: flock on a descriptor we own; no memory is passed.
            let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
            let mut previous = String::new();
            let _ = file.read_to_string(&mut previous);
            let owner = previous.trim().parse::<u32>().ok();
            if rc != 0 {
                let e = std::io::Error::last_os_error();
                if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
                    return Err(DiskError::Locked { path: slots.to_path_buf(), pid: owner });
                }
                return Err(e.into());
            }
            // The holder we waited on may have unlinked the file as it let go: a lock on an
            // unlinked file guards nothing, so lock the file the path names now.
            use std::os::unix::fs::MetadataExt;
            let same = std::fs::metadata(&path).is_ok_and(|m| {
                file.metadata().is_ok_and(|f| f.ino() == m.ino() && f.dev() == m.dev())
            });
            if !same {
                continue;
            }
            if let Some(pid) = owner.filter(|p| *p != std::process::id()) {
                tracing::warn!(slots = %slots.display(), pid,
                    "took over the disk tier of a process that is gone (its lock was stale)");
            }
            // The pid is for messages only: a full filesystem does not stop the lock.
            let _ = file.set_len(0).and_then(|()| file.rewind());
            let _ = write!(file, "{}", std::process::id());
            return Ok(SlotFileLock { _file: file, path });
        }
    }
}

impl Drop for SlotFileLock {
    fn drop(&mut self) {
        // Unlinked while still locked: a process waiting on it opens a new file and locks that.
        let _ = std::fs::remove_file(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_holder_at_a_time_and_a_dead_holder_is_taken_over() {
        let dir = tempfile::tempdir().unwrap();
        let slots = dir.path().join("w-1.slots");
        let held = SlotFileLock::acquire(&slots).unwrap();
        // flock locks belong to open file descriptions: a second open in this process is
        // refused just as another process's would be.
        match SlotFileLock::acquire(&slots) {
            Err(DiskError::Locked { pid, .. }) => assert_eq!(pid, Some(std::process::id())),
            other => panic!("{other:?}"),
        }
        drop(held);
        // A lock file left by a process that died (no flock held): taken over.
        std::fs::write(dir.path().join("w-1.slots.lock"), "999999999").unwrap();
        let _again = SlotFileLock::acquire(&slots).unwrap();
        let owner = std::fs::read_to_string(dir.path().join("w-1.slots.lock")).unwrap();
        assert_eq!(owner, std::process::id().to_string());
    }
}
