//! Control-plane traits: discovery of instances under leases, and an event bus with a
//! durable work queue. Three implementations: in-memory ([`memory`], the embedded default for
//! one process), etcd ([`etcd`], feature `etcd`) and NATS ([`nats`], feature `nats`).
//!
//! Keys and subjects: an instance of kind `K` and id `I` in namespace `N` lives at etcd key
//! `/kvfabric/v1/N/K/I` under a lease with keep-alive; topic `T` is NATS subject
//! `kvfabric.N.T`, and work queue `Q` is a JetStream work-queue stream.
//!
//! No home-made consensus or broker: past one process, etcd and NATS do the hard parts.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use tokio::sync::mpsc;

pub mod advertise;
pub mod file;
pub mod health;
pub mod memory;

#[cfg(feature = "etcd")]
pub mod etcd;
#[cfg(feature = "nats")]
pub mod nats;

/// A boxed future of the control plane.
pub type ControlFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, ControlError>> + Send + 'a>>;

/// Why a control-plane operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ControlError {
    /// The backend could not be reached or refused the operation.
    #[error("{backend}: {message}")]
    Backend {
        /// etcd, nats or memory.
        backend: &'static str,
        /// What it said.
        message: String,
    },
    /// A value read from the backend is not what kvfabric wrote.
    #[error("malformed {what}: {message}")]
    Malformed {
        /// What was read.
        what: &'static str,
        /// Why it is malformed.
        message: String,
    },
    /// A name that cannot be used in a key or subject.
    #[error("invalid name {0:?}: use letters, digits, '-' and '_'")]
    InvalidName(String),
    /// The operation did not finish in time.
    #[error("{0} timed out")]
    Timeout(&'static str),
    /// The backend is shut down.
    #[error("control plane closed")]
    Closed,
    /// Another live instance holds this kind and id: its lease was kept alive for as long as
    /// it had left when we asked, so it is not a dead process's leftover.
    #[error("{kind} {id:?} is registered by another live instance (choose another name, or stop that one)")]
    Taken {
        /// The kind.
        kind: String,
        /// The id.
        id: String,
    },
}

/// An instance's key held under another lease than ours.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Held {
    /// The holder's lease.
    pub(crate) lease: i64,
    /// Time its lease has left (a live holder keeps renewing it).
    pub(crate) left: Duration,
}

/// How long past a lease's end a store may take to revoke it (etcd's lessor checks its leases
/// every 500 ms and revokes them in batches; a loaded server is later still).
const EXPIRY_LAG: Duration = Duration::from_secs(5);

/// Registers `kind`/`id` only where no other lease holds it: `try_create` creates the key
/// under a new lease of ours, or says who holds it. A holder is given the time its lease has
/// left, plus a second: a dead process's registration expires meanwhile and is taken over
/// (logged); a live one keeps renewing it, and the claim fails with [`ControlError::Taken`].
/// A lease still held at its end with no time left is a dead holder's that the store has not
/// revoked yet: it is waited for up to [`EXPIRY_LAG`] more. Nobody's registration is ever
/// overwritten.
pub(crate) async fn claim<T, F, Fut>(
    kind: &str,
    id: &str,
    mut try_create: F,
) -> Result<T, ControlError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Result<T, Held>, ControlError>>,
{
    let mut waiting: Option<(i64, tokio::time::Instant)> = None;
    loop {
        match try_create().await? {
            Ok(created) => {
                if let Some((lease, _)) = waiting {
                    tracing::info!(
                        kind,
                        id,
                        holder_lease = lease,
                        "the earlier registration expired (its process is gone): registered"
                    );
                }
                return Ok(created);
            }
            Err(held) => {
                let now = tokio::time::Instant::now();
                let until = match waiting {
                    Some((lease, until)) if lease == held.lease => until,
                    _ => {
                        tracing::warn!(kind, id, holder_lease = held.lease, left = ?held.left,
                            "already registered under another lease: waiting for it to expire \
                             (a dead process's) or refusing (a live one)");
                        let until = now + held.left + Duration::from_secs(1);
                        waiting = Some((held.lease, until));
                        until
                    }
                };
                // A lease at its end, not renewed: its revocation is late, not its holder alive.
                let until = if held.left.is_zero() { until + EXPIRY_LAG } else { until };
                if now >= until {
                    return Err(ControlError::Taken { kind: kind.to_string(), id: id.to_string() });
                }
                tokio::time::sleep(Duration::from_millis(250).min(until - now)).await;
            }
        }
    }
}

/// Checks a namespace, kind, id, topic or queue name.
pub fn check_name(s: &str) -> Result<(), ControlError> {
    if s.is_empty()
        || s.len() > 128
        || !s.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    {
        return Err(ControlError::InvalidName(s.to_string()));
    }
    Ok(())
}

/// A registered instance.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Instance {
    /// Its kind (`worker`, `fabric`, `frontend`).
    pub kind: String,
    /// Its id, unique within the kind.
    pub id: String,
    /// What others need to reach it (agent metadata, model, role), as JSON.
    pub metadata: serde_json::Value,
}

/// A change seen by a watch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DiscoveryEvent {
    /// An instance joined or updated its metadata.
    Joined(Instance),
    /// An instance left: deregistered, or its lease expired.
    Left {
        /// Its kind.
        kind: String,
        /// Its id.
        id: String,
    },
}

/// A registration; keep-alive runs while it lives. Dropping it stops the keep-alive (the
/// lease then expires after its TTL); [`Registration::revoke`] removes it at once.
#[derive(Debug)]
pub struct Registration {
    pub(crate) revoke: Option<tokio::sync::oneshot::Sender<tokio::sync::oneshot::Sender<()>>>,
    pub(crate) keepalive: tokio::task::JoinHandle<()>,
}

impl Registration {
    /// Removes the instance now (graceful shutdown) and waits for the backend to confirm.
    pub async fn revoke(mut self) {
        if let Some(tx) = self.revoke.take() {
            let (done_tx, done_rx) = tokio::sync::oneshot::channel();
            if tx.send(done_tx).is_ok() {
                let _ = tokio::time::timeout(Duration::from_secs(5), done_rx).await;
            }
        }
        self.keepalive.abort();
    }

    /// Whether its keep-alive task still runs (false once the lease was lost for good).
    pub fn is_alive(&self) -> bool {
        !self.keepalive.is_finished()
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.keepalive.abort();
    }
}

/// Whether a control-plane backend is reachable now: the health document's part
/// ([`crate::health::ControlHealth`]), one type for `/health`, `/metrics` and dashboards.
pub use crate::health::ControlHealth;

/// The state of `discovery` and `bus` where they are outside this process (etcd, NATS):
/// embedded backends are always up and left out. What `/health` and the C ABI's store
/// metrics show.
pub fn remote_statuses(discovery: &dyn Discovery, bus: &dyn EventBus) -> Vec<ControlHealth> {
    [discovery.status(), bus.status()].into_iter().filter(ControlHealth::is_remote).collect()
}

/// Instances under leases.
pub trait Discovery: Send + Sync + std::fmt::Debug {
    /// Registers `instance` under a lease of `ttl`, kept alive until the registration is
    /// dropped or revoked. Re-registers by itself if the backend lost it (restart). Never
    /// overwrites another live instance of the same kind and id: it waits for a holder's
    /// lease to run out, and fails with [`ControlError::Taken`] if the holder keeps it.
    fn register(&self, instance: Instance, ttl: Duration) -> ControlFuture<'_, Registration>;
    /// The instances of a kind.
    fn list<'a>(&'a self, kind: &'a str) -> ControlFuture<'a, Vec<Instance>>;
    /// The instances of a kind now, then every change.
    fn watch<'a>(
        &'a self,
        kind: &'a str,
    ) -> ControlFuture<'a, (Vec<Instance>, mpsc::Receiver<DiscoveryEvent>)>;
    /// Whether the backend is reachable now.
    fn status(&self) -> ControlHealth {
        ControlHealth::embedded()
    }
}

/// An item taken from a work queue; acknowledge it, or it is delivered again.
#[derive(Debug)]
pub struct WorkItem {
    /// The payload.
    pub payload: Vec<u8>,
    /// How many times it was delivered (1 the first time).
    pub deliveries: u64,
    pub(crate) acker: Box<dyn Acker>,
}

impl WorkItem {
    /// Acknowledges: it will not be delivered again.
    pub async fn ack(self) -> Result<(), ControlError> {
        self.acker.ack().await
    }
}

pub(crate) trait Acker: Send + Sync + std::fmt::Debug {
    fn ack(self: Box<Self>) -> ControlFuture<'static, ()>;
}

/// Publish/subscribe and a durable work queue.
pub trait EventBus: Send + Sync + std::fmt::Debug {
    /// Publishes to every current subscriber of `topic` (best effort, no persistence).
    fn publish<'a>(&'a self, topic: &'a str, payload: Vec<u8>) -> ControlFuture<'a, ()>;
    /// Subscribes to `topic`.
    fn subscribe<'a>(&'a self, topic: &'a str) -> ControlFuture<'a, mpsc::Receiver<Vec<u8>>>;
    /// Appends to a durable work queue; each item goes to one consumer, at least once.
    fn enqueue<'a>(&'a self, queue: &'a str, payload: Vec<u8>) -> ControlFuture<'a, ()>;
    /// Takes the next item, waiting up to `wait`. An item not acknowledged within `ack_wait`
    /// is delivered again.
    fn dequeue<'a>(
        &'a self,
        queue: &'a str,
        wait: Duration,
        ack_wait: Duration,
    ) -> ControlFuture<'a, Option<WorkItem>>;
    /// A counter of (re)connections to the backend, for publishers that must resynchronize
    /// (re-publish a full dump) after the bus restarted; None for a bus that never
    /// disconnects.
    fn connections(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        None
    }
    /// Whether the backend is reachable now.
    fn status(&self) -> ControlHealth {
        ControlHealth::embedded()
    }
}
