//! Discovery in a directory on one host, for processes that share no etcd: an engine's ranks
//! and its KV connector (the C ABI and the Python binding), or tests of several processes.
//!
//! An instance is two files: `{kind}.{id}.json` (its metadata and the registrant's pid) and
//! `{kind}.{id}.lock`, which the registrant holds with an exclusive `flock` for as long as its
//! registration lives ([`crate::lockfile::PidLock`]). The lock is the lease: the kernel
//! releases it when the process exits, however it exits, so a dead process's entry is gone
//! from `list` at once, with no TTL to wait for (the `ttl` of [`Discovery::register`] is not
//! used). Registration is create-only, as with etcd: a name whose lock a live process holds is
//! [`ControlError::Taken`]; a dead process's entry is overwritten. A registration's keep-alive
//! writes its entry again if someone removed it.
//!
//! `list` reads the entries whose lock is held; `watch` polls the directory
//! ([`WATCH_POLL`]). Readers take a shared lock for an instant to see whether an entry's lock
//! is held, so a registrant retries for a moment before it calls a name taken.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::sync::mpsc;

use super::{
    check_name, ControlError, ControlFuture, ControlHealth, Discovery, DiscoveryEvent, Instance,
    Registration,
};
use crate::lockfile::{LockError, PidLock};

/// How often a watch reads the directory.
pub const WATCH_POLL: Duration = Duration::from_millis(200);

/// How often a registration checks that its entry is still there.
const KEEPALIVE: Duration = Duration::from_secs(1);

/// How long a registrant retries a lock held for an instant by a reader.
const READER_GRACE: Duration = Duration::from_millis(200);

/// Largest entry file read (metadata is a few KiB).
const ENTRY_BYTES_MAX: u64 = 1 << 20;

/// Discovery in a directory of this host.
#[derive(Debug, Clone)]
pub struct FileDiscovery {
    dir: PathBuf,
}

/// An entry file.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Entry {
    pid: u32,
    instance: Instance,
}

fn io(what: &str, path: &Path, e: std::io::Error) -> ControlError {
    ControlError::Backend { backend: "file", message: format!("{what} {}: {e}", path.display()) }
}

impl FileDiscovery {
    /// Discovery in `dir`, created (mode 0700) if it does not exist.
    pub fn open(dir: impl Into<PathBuf>) -> Result<Self, ControlError> {
        use std::os::unix::fs::DirBuilderExt;
        let dir = dir.into();
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .map_err(|e| io("creating", &dir, e))?;
        Ok(FileDiscovery { dir })
    }

    /// Discovery in `dir` as it is, for reading (nothing is created: a directory that does
    /// not exist holds no instance).
    pub fn at(dir: impl Into<PathBuf>) -> Self {
        FileDiscovery { dir: dir.into() }
    }

    /// The live instance `kind`/`id`, read now (no runtime needed: the C ABI's
    /// `kvf_discovery_get`).
    pub fn get(&self, kind: &str, id: &str) -> Result<Option<Instance>, ControlError> {
        check_name(kind)?;
        check_name(id)?;
        if !PidLock::is_held(&self.base(kind, id)) {
            return Ok(None);
        }
        Ok(Self::read_entry(&self.entry_path(kind, id))
            .map(|e| e.instance)
            .filter(|i| i.kind == kind && i.id == id))
    }

    fn base(&self, kind: &str, id: &str) -> PathBuf {
        self.dir.join(format!("{kind}.{id}"))
    }

    fn entry_path(&self, kind: &str, id: &str) -> PathBuf {
        self.dir.join(format!("{kind}.{id}.json"))
    }

    /// Writes the entry of `instance` atomically (a temporary file renamed over it).
    fn write_entry(&self, instance: &Instance) -> Result<(), ControlError> {
        let path = self.entry_path(&instance.kind, &instance.id);
        let tmp =
            self.dir.join(format!(".{}.{}.{}.tmp", instance.kind, instance.id, std::process::id()));
        let entry = Entry { pid: std::process::id(), instance: instance.clone() };
        let bytes = serde_json::to_vec(&entry).map_err(|e| ControlError::Malformed {
            what: "file discovery entry",
            message: e.to_string(),
        })?;
        std::fs::write(&tmp, bytes).map_err(|e| io("writing", &tmp, e))?;
        std::fs::rename(&tmp, &path).map_err(|e| io("renaming", &tmp, e))
    }

    /// The entry of `kind`/`id` if its file reads as one.
    fn read_entry(path: &Path) -> Option<Entry> {
        use std::io::Read;
        let mut bytes = Vec::new();
        std::fs::File::open(path).ok()?.take(ENTRY_BYTES_MAX).read_to_end(&mut bytes).ok()?;
        serde_json::from_slice(&bytes).ok()
    }

    /// The live instances of `kind`, by id.
    fn scan(&self, kind: &str) -> Result<HashMap<String, Instance>, ControlError> {
        let mut out = HashMap::new();
        let prefix = format!("{kind}.");
        let dir = std::fs::read_dir(&self.dir).map_err(|e| io("reading", &self.dir, e))?;
        for f in dir.flatten() {
            let name = f.file_name();
            let Some(id) = name
                .to_str()
                .and_then(|n| n.strip_prefix(&prefix))
                .and_then(|n| n.strip_suffix(".json"))
            else {
                continue;
            };
            if let Ok(Some(instance)) = self.get(kind, id) {
                out.insert(id.to_string(), instance);
            }
        }
        Ok(out)
    }

    /// [`Self::scan`] on the blocking pool (it reads files and takes locks).
    async fn scan_blocking(&self, kind: &str) -> Result<HashMap<String, Instance>, ControlError> {
        let (this, kind) = (self.clone(), kind.to_string());
        tokio::task::spawn_blocking(move || this.scan(&kind))
            .await
            .map_err(|_| ControlError::Closed)?
    }

    fn sorted(map: &HashMap<String, Instance>) -> Vec<Instance> {
        let mut v: Vec<Instance> = map.values().cloned().collect();
        v.sort_by(|a, b| a.id.cmp(&b.id));
        v
    }
}

impl Discovery for FileDiscovery {
    fn register(&self, instance: Instance, _ttl: Duration) -> ControlFuture<'_, Registration> {
        Box::pin(async move {
            check_name(&instance.kind)?;
            check_name(&instance.id)?;
            let base = self.base(&instance.kind, &instance.id);
            let started = tokio::time::Instant::now();
            let lock = loop {
                match PidLock::acquire(&base) {
                    Ok(lock) => break lock,
                    Err(LockError::Held { pid, .. }) => {
                        if started.elapsed() >= READER_GRACE {
                            tracing::warn!(kind = %instance.kind, id = %instance.id, ?pid,
                                "already registered by a live process: refusing");
                            return Err(ControlError::Taken {
                                kind: instance.kind.clone(),
                                id: instance.id.clone(),
                            });
                        }
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    Err(LockError::Io { path, source }) => {
                        return Err(io("locking", &path, source))
                    }
                }
            };
            if let Some(pid) = lock.taken_from() {
                tracing::info!(kind = %instance.kind, id = %instance.id, pid,
                    "the earlier registration's process is gone: registered");
            }
            self.write_entry(&instance)?;
            let (revoke_tx, mut revoke_rx) =
                tokio::sync::oneshot::channel::<tokio::sync::oneshot::Sender<()>>();
            let this = self.clone();
            let keepalive = tokio::spawn(async move {
                let _lock = lock;
                let path = this.entry_path(&instance.kind, &instance.id);
                let mut tick = tokio::time::interval(KEEPALIVE);
                loop {
                    tokio::select! {
                        done = &mut revoke_rx => {
                            let _ = std::fs::remove_file(&path);
                            drop(_lock);
                            if let Ok(done) = done {
                                let _ = done.send(());
                            }
                            return;
                        }
                        _ = tick.tick() => {
                            let ours = Self::read_entry(&path)
                                .is_some_and(|e| e.pid == std::process::id() && e.instance == instance);
                            if !ours {
                                if let Err(e) = this.write_entry(&instance) {
                                    tracing::warn!(error = %e, "writing a registration again");
                                }
                            }
                        }
                    }
                }
            });
            Ok(Registration { revoke: Some(revoke_tx), keepalive })
        })
    }

    fn list<'a>(&'a self, kind: &'a str) -> ControlFuture<'a, Vec<Instance>> {
        Box::pin(async move {
            check_name(kind)?;
            Ok(Self::sorted(&self.scan_blocking(kind).await?))
        })
    }

    fn watch<'a>(
        &'a self,
        kind: &'a str,
    ) -> ControlFuture<'a, (Vec<Instance>, mpsc::Receiver<DiscoveryEvent>)> {
        Box::pin(async move {
            check_name(kind)?;
            let mut seen = self.scan_blocking(kind).await?;
            let (tx, rx) = mpsc::channel(super::memory::SUBSCRIBER_BUFFER);
            let (this, kind) = (self.clone(), kind.to_string());
            let now = Self::sorted(&seen);
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(WATCH_POLL);
                loop {
                    tokio::select! {
                        _ = tx.closed() => return,
                        _ = tick.tick() => {}
                    }
                    let Ok(current) = this.scan_blocking(&kind).await else { continue };
                    let mut events = Vec::new();
                    for (id, inst) in &current {
                        if seen.get(id) != Some(inst) {
                            events.push(DiscoveryEvent::Joined(inst.clone()));
                        }
                    }
                    for id in seen.keys().filter(|id| !current.contains_key(*id)) {
                        events.push(DiscoveryEvent::Left { kind: kind.clone(), id: id.clone() });
                    }
                    seen = current;
                    for ev in events {
                        if tx.send(ev).await.is_err() {
                            return;
                        }
                    }
                }
            });
            Ok((now, rx))
        })
    }

    fn status(&self) -> ControlHealth {
        let ok = self.dir.is_dir();
        ControlHealth {
            backend: "file".into(),
            connected: ok,
            error: (!ok).then(|| format!("{} is not a directory", self.dir.display())),
            ..ControlHealth::embedded()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inst(kind: &str, id: &str, v: u32) -> Instance {
        Instance { kind: kind.into(), id: id.into(), metadata: serde_json::json!({ "v": v }) }
    }

    async fn next(rx: &mut mpsc::Receiver<DiscoveryEvent>) -> DiscoveryEvent {
        tokio::time::timeout(Duration::from_secs(5), rx.recv()).await.expect("an event").unwrap()
    }

    /// Joins, leaves by revoke and by a registration dropped (the process's lock released, as
    /// when it dies), create-only names, and another directory's entries unseen. flock locks
    /// belong to open files, so two registrations in one process contend as two processes do;
    /// what this cannot show is a process killed outright (the kernel releasing its locks).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn instances_come_and_go_with_their_registrations_and_names_are_not_shared() {
        let dir = tempfile::tempdir().unwrap();
        let d = FileDiscovery::open(dir.path().join("nodes")).unwrap();
        let ttl = Duration::from_secs(1);
        let (now, mut watch) = d.watch("fabric").await.unwrap();
        assert!(now.is_empty());
        let a = d.register(inst("fabric", "node-a", 1), ttl).await.unwrap();
        assert_eq!(next(&mut watch).await, DiscoveryEvent::Joined(inst("fabric", "node-a", 1)));
        let b = d.register(inst("fabric", "node-b", 2), ttl).await.unwrap();
        assert_eq!(next(&mut watch).await, DiscoveryEvent::Joined(inst("fabric", "node-b", 2)));
        let _w = d.register(inst("worker", "node-a", 3), ttl).await.unwrap();
        let ids: Vec<String> = d.list("fabric").await.unwrap().into_iter().map(|i| i.id).collect();
        assert_eq!(ids, ["node-a", "node-b"]);
        // A second registration of a live name is refused and changes nothing.
        let err = d.register(inst("fabric", "node-a", 9), ttl).await.unwrap_err();
        assert!(matches!(err, ControlError::Taken { .. }), "{err}");
        assert_eq!(d.list("fabric").await.unwrap()[0], inst("fabric", "node-a", 1));
        assert_eq!(d.get("fabric", "node-a").unwrap(), Some(inst("fabric", "node-a", 1)));
        assert_eq!(d.get("fabric", "node-z").unwrap(), None);
        // Dropped without revoking (its lock released, as when a process dies): gone at once,
        // and the name is free again.
        drop(b);
        assert_eq!(
            next(&mut watch).await,
            DiscoveryEvent::Left { kind: "fabric".into(), id: "node-b".into() }
        );
        let b2 = d.register(inst("fabric", "node-b", 4), ttl).await.unwrap();
        assert_eq!(next(&mut watch).await, DiscoveryEvent::Joined(inst("fabric", "node-b", 4)));
        // Revoked: its entry is removed.
        a.revoke().await;
        assert_eq!(
            next(&mut watch).await,
            DiscoveryEvent::Left { kind: "fabric".into(), id: "node-a".into() }
        );
        assert!(!dir.path().join("nodes/fabric.node-a.json").exists());
        // An entry removed by someone else is written again by its keep-alive.
        std::fs::remove_file(dir.path().join("nodes/fabric.node-b.json")).unwrap();
        tokio::time::sleep(KEEPALIVE * 2).await;
        assert_eq!(d.list("fabric").await.unwrap(), vec![inst("fabric", "node-b", 4)]);
        assert_eq!(d.get("fabric", "node-a").unwrap(), None, "revoked");
        // Garbage in the directory is not an instance.
        std::fs::write(dir.path().join("nodes/fabric.x.json"), b"{not json").unwrap();
        std::fs::write(dir.path().join("nodes/fabric.bad name.json"), b"{}").unwrap();
        assert_eq!(d.list("fabric").await.unwrap().len(), 1);
        assert!(d.register(inst("fabric", "bad/id", 1), ttl).await.is_err(), "names are checked");
        let other = FileDiscovery::open(dir.path().join("elsewhere")).unwrap();
        assert!(other.list("fabric").await.unwrap().is_empty());
        b2.revoke().await;
    }
}
