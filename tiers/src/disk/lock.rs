//! One process per slot file: a disk tier holds an exclusive `flock` on `{slots}.lock` for as
//! long as it is open, with its pid written inside. A second process that opens the same slot
//! file is refused, naming the owner's pid, instead of overwriting the first's slots. The
//! kernel drops the lock of a process that dies, so a lock file left by a dead process is
//! taken over at once (and logged with the dead pid).

use std::path::Path;

use kvfabric::lockfile::{LockError, PidLock};

use super::DiskError;

/// How long a tier waits for another tier of its own process on the same file to close.
pub const SAME_PROCESS_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// The lock of a slot file, released when dropped (or when the process exits).
#[derive(Debug)]
pub struct SlotFileLock {
    _lock: PidLock,
}

impl SlotFileLock {
    /// Locks the slot file `slots` for this process.
    pub fn acquire(slots: &Path) -> Result<Self, DiskError> {
        match PidLock::acquire(slots) {
            Ok(lock) => {
                if let Some(pid) = lock.taken_from() {
                    tracing::warn!(slots = %slots.display(), pid,
                        "took over the disk tier of a process that is gone (its lock was stale)");
                }
                Ok(SlotFileLock { _lock: lock })
            }
            Err(LockError::Held { pid, .. }) => {
                Err(DiskError::Locked { path: slots.to_path_buf(), pid })
            }
            Err(LockError::Io { source, .. }) => Err(source.into()),
        }
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
