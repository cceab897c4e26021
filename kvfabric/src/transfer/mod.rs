//! Transfers: READ or WRITE of descriptor lists between a local agent and a peer.
//!
//! Core concepts:
//! - [`Desc`]: `(region, offset, len)`. A transfer pairs `local[i]` with `remote[i]`, equal
//!   lengths.
//! - [`TransferRequest`]: what to move, with whom, an optional notification delivered to the
//!   peer after the last byte, an optional per-descriptor XXH3 checksum that the receiver
//!   verifies, and a deadline.
//! - [`TransferStatus`] and [`TransferState`]: the life of a transfer as a plain state machine
//!   (no clock, no I/O): `Posted → InFlight → Done | Failed | Cancelled | TimedOut`; the
//!   terminal states are absorbing.
//! - [`TransferHandle`]: what `post` returns: poll it, await it, or cancel it.
//! - `drive`: a transfer's work, polled by its task and by a caller waiting on its handle.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use crate::memory::{MemoryError, MemoryErrorKind, RegionId};
use crate::wire::{ErrorCode, WireError};

mod drive;

pub(crate) use drive::{Drive, ExitGuard, TaskDrive};

/// READ (peer → local) or WRITE (local → peer).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TransferOp {
    /// Copy the peer's bytes into local memory.
    Read,
    /// Copy local bytes into the peer's memory.
    Write,
}

/// A range of a region. Its serde form (`{"region": 3, "offset": 0, "len": 4096}`) is how a
/// descriptor crosses a process in a message (a prefill job names its targets so).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Desc {
    /// The region (the local agent's for local descriptors, the peer's for remote ones).
    pub region: RegionId,
    /// Offset in bytes.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

impl Desc {
    /// A descriptor.
    pub fn new(region: RegionId, offset: u64, len: u64) -> Self {
        Desc { region, offset, len }
    }
}

/// The transports, fastest first.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum TransportKind {
    /// Same agent: memcpy.
    Local,
    /// Same host, other process: one copy through shared memory.
    Shm,
    /// Any host: striped TCP connections.
    Tcp,
    /// GPU memory: CUDA copies within this process, CUDA IPC to processes of this host.
    Cuda,
    /// Any host with an RDMA device: one-sided verbs READ/WRITE.
    Rdma,
}

impl TransportKind {
    /// Every transport, in the order of their counters.
    pub const ALL: [TransportKind; 5] = [
        TransportKind::Local,
        TransportKind::Shm,
        TransportKind::Tcp,
        TransportKind::Cuda,
        TransportKind::Rdma,
    ];

    /// Its name.
    pub fn name(self) -> &'static str {
        match self {
            TransportKind::Local => "local",
            TransportKind::Shm => "shm",
            TransportKind::Tcp => "tcp",
            TransportKind::Cuda => "cuda",
            TransportKind::Rdma => "rdma",
        }
    }
}

impl std::fmt::Display for TransportKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A transfer to post.
#[derive(Debug, Clone)]
pub struct TransferRequest {
    /// READ or WRITE.
    pub op: TransferOp,
    /// The peer's agent name (the local agent's own name for a local transfer).
    pub peer: String,
    /// Local descriptors.
    pub local: Vec<Desc>,
    /// Remote descriptors, pairwise equal in length to `local`.
    pub remote: Vec<Desc>,
    /// Delivered to the peer after the last byte landed.
    pub notify: Option<Vec<u8>>,
    /// Checksum every descriptor (XXH3-64), verified by the receiver.
    pub checksum: bool,
    /// Fail with [`TransferError::TimedOut`] past this; the agent's default when None.
    pub deadline: Option<Duration>,
    /// Force a transport instead of the fastest one both sides speak.
    pub transport: Option<TransportKind>,
}

impl TransferRequest {
    /// A request without notification, checksum or deadline override.
    pub fn new(
        op: TransferOp,
        peer: impl Into<String>,
        local: Vec<Desc>,
        remote: Vec<Desc>,
    ) -> Self {
        TransferRequest {
            op,
            peer: peer.into(),
            local,
            remote,
            notify: None,
            checksum: false,
            deadline: None,
            transport: None,
        }
    }

    /// With a notification.
    pub fn with_notify(mut self, message: impl Into<Vec<u8>>) -> Self {
        self.notify = Some(message.into());
        self
    }

    /// With per-descriptor checksums.
    pub fn with_checksum(mut self) -> Self {
        self.checksum = true;
        self
    }

    /// With a deadline.
    pub fn with_deadline(mut self, d: Duration) -> Self {
        self.deadline = Some(d);
        self
    }

    /// Over a given transport.
    pub fn with_transport(mut self, t: TransportKind) -> Self {
        self.transport = Some(t);
        self
    }

    /// Total bytes.
    pub fn bytes(&self) -> u64 {
        self.local.iter().map(|d| d.len).sum()
    }
}

/// Why a transfer failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransferError {
    /// The request itself is malformed (length mismatch, empty, over a limit).
    #[error("invalid transfer: {0}")]
    Invalid(String),
    /// A local region problem (unknown, out of bounds), of the kind the region table said.
    #[error("local memory: {message}")]
    Local {
        /// What kind of region problem.
        kind: MemoryErrorKind,
        /// The region table's text.
        message: String,
    },
    /// A remote descriptor is outside what the peer exported in its metadata (checked before
    /// any byte moves; reload the peer's metadata after it registers new regions).
    #[error("remote descriptor {index}: {reason}")]
    RemoteDescriptor {
        /// Index of the descriptor.
        index: usize,
        /// Why.
        reason: String,
    },
    /// No peer of that name was loaded.
    #[error("unknown peer {0:?}")]
    UnknownPeer(String),
    /// The peer refused the request (bounds, region, checksum, auth...).
    #[error("peer refused ({code:?}): {message}")]
    Remote {
        /// The peer's error code.
        code: ErrorCode,
        /// The peer's text.
        message: String,
    },
    /// Authentication with the peer failed.
    #[error("authentication with {0} failed")]
    Auth(String),
    /// TLS with the peer failed: a certificate not trusted, expired, or naming another
    /// address, or one side running without TLS.
    #[error("TLS with {peer} failed: {reason}")]
    Tls {
        /// The peer.
        peer: String,
        /// Why.
        reason: String,
    },
    /// The connection broke or the peer died.
    #[error("peer {peer} disconnected: {reason}")]
    Disconnected {
        /// The peer.
        peer: String,
        /// What the socket said.
        reason: String,
    },
    /// The peer sent something the protocol does not allow.
    #[error("protocol violation by peer: {0}")]
    Protocol(String),
    /// The bytes received do not match their checksum.
    #[error("checksum mismatch on descriptor {index}")]
    Checksum {
        /// Index of the descriptor.
        index: usize,
    },
    /// The deadline passed.
    #[error("transfer timed out after {0:?}")]
    TimedOut(Duration),
    /// The transfer was cancelled.
    #[error("transfer cancelled")]
    Cancelled,
    /// Too many transfers in flight.
    #[error("too many transfers in flight (limit {0})")]
    Busy(usize),
    /// No transport can reach the peer.
    #[error("no transport reaches {peer}: {reason}")]
    NoTransport {
        /// The peer.
        peer: String,
        /// Why.
        reason: String,
    },
    /// The agent is shutting down.
    #[error("agent is shutting down")]
    Shutdown,
    /// A CUDA copy or mapping failed (the driver's error).
    #[error("GPU copy failed: {0}")]
    Device(String),
}

impl From<MemoryError> for TransferError {
    fn from(e: MemoryError) -> Self {
        TransferError::Local { kind: e.kind(), message: e.to_string() }
    }
}

impl From<WireError> for TransferError {
    fn from(e: WireError) -> Self {
        TransferError::Protocol(e.to_string())
    }
}

/// Where a transfer is in its life.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TransferStatus {
    /// Accepted, not started.
    Posted,
    /// Bytes are moving.
    InFlight,
    /// Every byte landed (and the notification, if any, was delivered).
    Done,
    /// Failed.
    Failed(TransferError),
    /// Cancelled by the caller.
    Cancelled,
    /// The deadline passed.
    TimedOut,
}

impl TransferStatus {
    /// Whether the transfer is over.
    pub fn is_terminal(&self) -> bool {
        !matches!(self, TransferStatus::Posted | TransferStatus::InFlight)
    }
}

/// An event in a transfer's life.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TransferEvent {
    /// The transport started moving bytes.
    Start,
    /// The transport finished.
    Complete,
    /// The transport failed.
    Fail(TransferError),
    /// The caller cancelled.
    Cancel,
    /// The deadline passed.
    Deadline,
}

/// The transfer state machine: pure, so that it can be tested exhaustively.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransferState {
    status: TransferStatus,
}

impl Default for TransferState {
    fn default() -> Self {
        TransferState { status: TransferStatus::Posted }
    }
}

impl TransferState {
    /// The current status.
    pub fn status(&self) -> &TransferStatus {
        &self.status
    }

    /// Applies an event; returns whether it changed the state. Terminal states absorb every
    /// event (a completion racing a cancellation keeps whichever came first).
    pub fn apply(&mut self, event: TransferEvent) -> bool {
        use TransferStatus::*;
        let next = match (&self.status, event) {
            (s, _) if s.is_terminal() => return false,
            (Posted, TransferEvent::Start) => InFlight,
            (InFlight, TransferEvent::Start) => return false,
            (Posted | InFlight, TransferEvent::Complete) => Done,
            (Posted | InFlight, TransferEvent::Fail(e)) => Failed(e),
            (Posted | InFlight, TransferEvent::Cancel) => Cancelled,
            (Posted | InFlight, TransferEvent::Deadline) => TimedOut,
            _ => return false,
        };
        self.status = next;
        true
    }

    /// The outcome as a result, once terminal.
    pub fn result(&self, deadline: Duration) -> Option<Result<(), TransferError>> {
        match &self.status {
            TransferStatus::Done => Some(Ok(())),
            TransferStatus::Failed(e) => Some(Err(e.clone())),
            TransferStatus::Cancelled => Some(Err(TransferError::Cancelled)),
            TransferStatus::TimedOut => Some(Err(TransferError::TimedOut(deadline))),
            TransferStatus::Posted | TransferStatus::InFlight => None,
        }
    }
}

/// Transfers that ended, per transport: how each ended, and the bytes of those that
/// completed. An agent's counters, read by `/metrics`.
#[derive(Debug, Default)]
pub struct TransferCounters {
    /// Per transport (in [`TransportKind::ALL`] order): done, failed, timed out, cancelled.
    ended: [[AtomicU64; 4]; TransportKind::ALL.len()],
    bytes: [AtomicU64; TransportKind::ALL.len()],
}

/// One transport's line of [`TransferCounters`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransferCount {
    /// The transport.
    pub transport: TransportKind,
    /// Transfers completed.
    pub done: u64,
    /// Transfers failed (an error from the transport, the peer or the memory).
    pub failed: u64,
    /// Transfers past their deadline.
    pub timed_out: u64,
    /// Transfers cancelled.
    pub cancelled: u64,
    /// Bytes of the completed transfers.
    pub bytes: u64,
}

impl TransferCounters {
    fn record(&self, transport: TransportKind, status: &TransferStatus, bytes: u64) {
        let t = transport as usize;
        let i = match status {
            TransferStatus::Done => 0,
            TransferStatus::Failed(_) => 1,
            TransferStatus::TimedOut => 2,
            TransferStatus::Cancelled => 3,
            TransferStatus::Posted | TransferStatus::InFlight => return,
        };
        self.ended[t][i].fetch_add(1, Ordering::Relaxed);
        if i == 0 {
            self.bytes[t].fetch_add(bytes, Ordering::Relaxed);
        }
    }

    /// The counts now, one line per transport.
    pub fn snapshot(&self) -> Vec<TransferCount> {
        TransportKind::ALL
            .iter()
            .map(|&transport| {
                let t = transport as usize;
                let n = |i: usize| self.ended[t][i].load(Ordering::Relaxed);
                TransferCount {
                    transport,
                    done: n(0),
                    failed: n(1),
                    timed_out: n(2),
                    cancelled: n(3),
                    bytes: self.bytes[t].load(Ordering::Relaxed),
                }
            })
            .collect()
    }
}

/// Shared between a handle and the task running the transfer.
#[derive(Debug)]
pub(crate) struct TransferShared {
    pub(crate) state: Mutex<TransferState>,
    pub(crate) changed: tokio::sync::Notify,
    pub(crate) deadline: Duration,
    pub(crate) abort: Mutex<Option<tokio::task::AbortHandle>>,
    /// Set when the task running the transfer is gone (finished or aborted): from then on no
    /// byte of it can land anywhere.
    pub(crate) exited: std::sync::atomic::AtomicBool,
    pub(crate) exited_notify: tokio::sync::Notify,
    /// The transfer's work when whoever waits on the handle may move it too ([`Drive`]).
    pub(crate) drive: std::sync::OnceLock<Arc<Drive>>,
    /// Where its end is counted: the agent's counters, its transport, its bytes.
    counted: (Arc<TransferCounters>, TransportKind, u64),
}

impl TransferShared {
    pub(crate) fn new(
        deadline: Duration,
        counted: (Arc<TransferCounters>, TransportKind, u64),
    ) -> Arc<Self> {
        Arc::new(TransferShared {
            state: Mutex::new(TransferState::default()),
            changed: tokio::sync::Notify::new(),
            deadline,
            abort: Mutex::new(None),
            exited: std::sync::atomic::AtomicBool::new(false),
            exited_notify: tokio::sync::Notify::new(),
            drive: std::sync::OnceLock::new(),
            counted,
        })
    }

    pub(crate) fn apply(&self, event: TransferEvent) -> bool {
        let changed = {
            let mut state = self.state.lock();
            let changed = state.apply(event);
            if changed && state.status().is_terminal() {
                let (counters, transport, bytes) = &self.counted;
                counters.record(*transport, state.status(), *bytes);
            }
            changed
        };
        if changed {
            self.changed.notify_waiters();
        }
        changed
    }
}

/// A posted transfer: poll it, await it, or cancel it. Dropping the handle does not cancel
/// the transfer.
#[derive(Debug, Clone)]
pub struct TransferHandle {
    pub(crate) id: u64,
    pub(crate) shared: Arc<TransferShared>,
}

impl TransferHandle {
    /// The transfer's id, unique within its agent.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The current status (non-blocking).
    pub fn status(&self) -> TransferStatus {
        self.shared.state.lock().status().clone()
    }

    /// Waits until the transfer is over, moving it meanwhile where it can ([`Drive`]).
    pub async fn wait(&self) -> Result<(), TransferError> {
        loop {
            let notified = self.shared.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(r) = self.shared.state.lock().result(self.shared.deadline) {
                return r;
            }
            match self.shared.drive.get() {
                Some(drive) => {
                    let drive = drive.clone();
                    tokio::select! {
                        biased;
                        _ = notified.as_mut() => {}
                        _ = drive.help() => {}
                    }
                }
                None => notified.await,
            }
        }
    }

    /// Waits until no byte of this transfer can land any more (its task finished or was
    /// aborted and dropped). Memory a failed or cancelled transfer targeted may be reused
    /// after this returns, not before.
    pub async fn quiesced(&self) {
        loop {
            let notified = self.shared.exited_notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.shared.exited.load(std::sync::atomic::Ordering::Acquire) {
                return;
            }
            notified.await;
        }
    }

    /// Cancels the transfer if it is not over; bytes may have partly landed.
    pub fn cancel(&self) {
        if self.shared.apply(TransferEvent::Cancel) {
            if let Some(abort) = self.shared.abort.lock().take() {
                abort.abort();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn event() -> impl Strategy<Value = TransferEvent> {
        prop_oneof![
            Just(TransferEvent::Start),
            Just(TransferEvent::Complete),
            Just(TransferEvent::Fail(TransferError::Cancelled)),
            Just(TransferEvent::Cancel),
            Just(TransferEvent::Deadline),
        ]
    }

    proptest! {
        /// Terminal states absorb everything; the first terminal event decides the outcome;
        /// a transfer never goes back to Posted.
        #[test]
        fn state_machine_invariants(events in proptest::collection::vec(event(), 0..12)) {
            let mut s = TransferState::default();
            let mut first_terminal: Option<TransferStatus> = None;
            for e in events {
                let before = s.status().clone();
                let changed = s.apply(e);
                if before.is_terminal() {
                    prop_assert!(!changed);
                    prop_assert_eq!(s.status(), &before);
                }
                prop_assert!(before == TransferStatus::Posted || *s.status() != TransferStatus::Posted);
                if s.status().is_terminal() && first_terminal.is_none() {
                    first_terminal = Some(s.status().clone());
                }
                if let Some(t) = &first_terminal {
                    prop_assert_eq!(s.status(), t);
                }
            }
        }
    }

    #[test]
    fn results_of_terminal_states() {
        let d = Duration::from_secs(1);
        let mut s = TransferState::default();
        assert_eq!(s.result(d), None);
        s.apply(TransferEvent::Start);
        assert_eq!(s.status(), &TransferStatus::InFlight);
        s.apply(TransferEvent::Deadline);
        assert_eq!(s.result(d), Some(Err(TransferError::TimedOut(d))));
        s.apply(TransferEvent::Complete);
        assert_eq!(s.result(d), Some(Err(TransferError::TimedOut(d))));
    }

    /// Work that waits for a signal, counting its polls to completion and marking its drop.
    fn signalled_work(
        rx: tokio::sync::oneshot::Receiver<()>,
        done: Arc<std::sync::atomic::AtomicUsize>,
        dropped: Arc<std::sync::atomic::AtomicBool>,
    ) -> impl std::future::Future<Output = ()> + Send + 'static {
        struct Mark(Arc<std::sync::atomic::AtomicBool>);
        impl Drop for Mark {
            fn drop(&mut self) {
                self.0.store(true, std::sync::atomic::Ordering::SeqCst);
            }
        }
        let mark = Mark(dropped);
        async move {
            let _mark = mark;
            let _ = rx.await;
            done.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }

    fn counters() -> (Arc<std::sync::atomic::AtomicUsize>, Arc<std::sync::atomic::AtomicBool>) {
        (Arc::default(), Arc::default())
    }

    #[tokio::test]
    async fn a_waiter_alone_moves_the_work_to_its_end() {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let (done, dropped) = counters();
        let drive = Drive::new(signalled_work(rx, done.clone(), dropped.clone()));
        // No task: only the waiter polls.
        let waiter = {
            let drive = drive.clone();
            tokio::spawn(async move { drive.help().await })
        };
        tokio::task::yield_now().await;
        assert_eq!(done.load(std::sync::atomic::Ordering::SeqCst), 0);
        tx.send(()).unwrap();
        tokio::time::timeout(Duration::from_secs(5), waiter).await.unwrap().unwrap();
        assert_eq!(done.load(std::sync::atomic::Ordering::SeqCst), 1);
        assert!(dropped.load(std::sync::atomic::Ordering::SeqCst), "finished work is dropped");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn task_and_waiter_together_run_the_work_once_and_both_see_its_end() {
        for _ in 0..200 {
            let (tx, rx) = tokio::sync::oneshot::channel();
            let (done, dropped) = counters();
            let drive = Drive::new(signalled_work(rx, done.clone(), dropped.clone()));
            let task = tokio::spawn(TaskDrive(drive.clone()));
            let waiter = {
                let drive = drive.clone();
                tokio::spawn(async move { drive.help().await })
            };
            tokio::task::yield_now().await;
            tx.send(()).unwrap();
            let (mut task, mut waiter) = (task, waiter);
            let both = async { ((&mut task).await.unwrap(), (&mut waiter).await.unwrap()) };
            if tokio::time::timeout(Duration::from_secs(5), both).await.is_err() {
                panic!(
                    "stalled: task finished {}, waiter finished {}, done {}, dropped {}, {}",
                    task.is_finished(),
                    waiter.is_finished(),
                    done.load(std::sync::atomic::Ordering::SeqCst),
                    dropped.load(std::sync::atomic::Ordering::SeqCst),
                    drive.debug_state()
                );
            }
            assert_eq!(done.load(std::sync::atomic::Ordering::SeqCst), 1);
            assert!(dropped.load(std::sync::atomic::Ordering::SeqCst));
        }
    }

    /// A wake-up that reaches the other poller while the work is being polled must not be
    /// lost when that poller finds the work busy: the holder polls again. (Without that, TCP
    /// transfers stalled until a timeout.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_wake_up_that_finds_the_work_busy_is_not_lost() {
        for _ in 0..10 {
            let mut left = 10u32;
            let work = std::future::poll_fn(move |cx| {
                if left == 0 {
                    return std::task::Poll::Ready(());
                }
                left -= 1;
                // Woken from another thread (as I/O is) while still being polled: the
                // woken poller finds the work busy.
                let w = cx.waker().clone();
                std::thread::spawn(move || {
                    std::thread::sleep(Duration::from_micros(300));
                    w.wake();
                });
                std::thread::sleep(Duration::from_millis(2));
                std::task::Poll::Pending
            });
            let drive = Drive::new(work);
            let task = tokio::spawn(TaskDrive(drive.clone()));
            let waiter = {
                let drive = drive.clone();
                tokio::spawn(async move { drive.help().await })
            };
            let both = async { (task.await.unwrap(), waiter.await.unwrap()) };
            tokio::time::timeout(Duration::from_secs(5), both).await.expect("a wake-up was lost");
        }
    }

    #[tokio::test]
    async fn a_waiter_that_gives_up_stalls_nothing_and_a_dropped_task_drops_the_work() {
        // The waiter polls once and leaves; the task alone finishes.
        let (tx, rx) = tokio::sync::oneshot::channel();
        let (done, dropped) = counters();
        let drive = Drive::new(signalled_work(rx, done.clone(), dropped.clone()));
        let once = drive.help();
        assert!(tokio::time::timeout(Duration::from_millis(10), once).await.is_err());
        let task = tokio::spawn(TaskDrive(drive.clone()));
        tx.send(()).unwrap();
        tokio::time::timeout(Duration::from_secs(5), task).await.unwrap().unwrap();
        assert_eq!(done.load(std::sync::atomic::Ordering::SeqCst), 1);
        // A task dropped (aborted) before the end drops the work: what it held goes, and a
        // waiter sees the end.
        let (_tx, rx) = tokio::sync::oneshot::channel::<()>();
        let (done, dropped) = counters();
        let drive = Drive::new(signalled_work(rx, done.clone(), dropped.clone()));
        let task = tokio::spawn(TaskDrive(drive.clone()));
        tokio::task::yield_now().await;
        task.abort();
        let _ = task.await;
        assert!(dropped.load(std::sync::atomic::Ordering::SeqCst), "aborted work not dropped");
        assert_eq!(done.load(std::sync::atomic::Ordering::SeqCst), 0);
        let after = drive.help();
        tokio::time::timeout(Duration::from_secs(5), after).await.unwrap();
    }
}
