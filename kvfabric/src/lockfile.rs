//! One holder at a time, across processes: an exclusive `flock` on `{path}.lock`, with the
//! holder's pid written inside for messages. The kernel drops the lock of a process that
//! dies, so a lock file left by a dead process is taken over at once (and the caller is told
//! whose it was). The lock file is unlinked when the lock is dropped; a process that was
//! waiting on it then locks the file the path names, never an unlinked one.
//!
//! Used by the disk tier (one process per slot file) and by [`crate::control::file`] (one
//! live registration per instance name).

use std::fs::File;
use std::io::{Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

/// Why a lock was not taken.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    /// Another holder has it (this process's included: locks belong to open files).
    #[error("{} is held by process {}", path.display(), pid.map_or("?".to_string(), |p| p.to_string()))]
    Held {
        /// The lock file.
        path: PathBuf,
        /// The holder's pid, as it wrote it.
        pid: Option<u32>,
    },
    /// The lock file could not be opened or locked.
    #[error("lock file {}: {source}", path.display())]
    Io {
        /// The lock file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

/// An exclusive lock, released (and its file unlinked) when dropped or when the process exits.
#[derive(Debug)]
pub struct PidLock {
    _file: File,
    path: PathBuf,
    /// The pid of a dead process whose lock this one took over.
    taken_from: Option<u32>,
}

impl PidLock {
    /// Locks `{path}.lock` for this process, or says who holds it.
    pub fn acquire(path: &Path) -> Result<Self, LockError> {
        let mut name = path.as_os_str().to_owned();
        name.push(".lock");
        let path = PathBuf::from(name);
        let io = |source| LockError::Io { path: path.clone(), source };
        loop {
            let mut file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&path)
                .map_err(io)?;
            // SAFETY: flock on a descriptor we own; no memory is passed.
            let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
            let mut previous = String::new();
            let _ = file.read_to_string(&mut previous);
            let owner = previous.trim().parse::<u32>().ok();
            if rc != 0 {
                let e = std::io::Error::last_os_error();
                if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
                    return Err(LockError::Held { path, pid: owner });
                }
                return Err(io(e));
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
            // The pid is for messages only: a full filesystem does not stop the lock.
            let _ = file.set_len(0).and_then(|()| file.rewind());
            let _ = write!(file, "{}", std::process::id());
            let taken_from = owner.filter(|p| *p != std::process::id());
            return Ok(PidLock { _file: file, path, taken_from });
        }
    }

    /// The pid of the dead process whose lock file this lock took over, if any.
    pub fn taken_from(&self) -> Option<u32> {
        self.taken_from
    }

    /// Whether some process holds `{path}.lock` now. Takes a shared lock for an instant to
    /// find out, so a holder acquiring at that very instant may be refused once: callers that
    /// acquire while others probe retry briefly ([`crate::control::file`] does).
    pub fn is_held(path: &Path) -> bool {
        let mut name = path.as_os_str().to_owned();
        name.push(".lock");
        let Ok(file) = File::open(PathBuf::from(name)) else { return false };
        // SAFETY: flock on a descriptor we own; no memory is passed.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_SH | libc::LOCK_NB) };
        // Ours for an instant when nobody held it; closing the file releases it.
        rc != 0
    }
}

impl Drop for PidLock {
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
        let guarded = dir.path().join("w-1.slots");
        assert!(!PidLock::is_held(&guarded));
        let held = PidLock::acquire(&guarded).unwrap();
        assert!(PidLock::is_held(&guarded));
        // flock locks belong to open file descriptions: a second open in this process is
        // refused just as another process's would be.
        match PidLock::acquire(&guarded) {
            Err(LockError::Held { pid, .. }) => assert_eq!(pid, Some(std::process::id())),
            other => panic!("{other:?}"),
        }
        drop(held);
        assert!(!PidLock::is_held(&guarded));
        // A lock file left by a process that died (no flock held): taken over.
        std::fs::write(dir.path().join("w-1.slots.lock"), "999999999").unwrap();
        let again = PidLock::acquire(&guarded).unwrap();
        assert_eq!(again.taken_from(), Some(999_999_999));
        let owner = std::fs::read_to_string(dir.path().join("w-1.slots.lock")).unwrap();
        assert_eq!(owner, std::process::id().to_string());
    }
}
