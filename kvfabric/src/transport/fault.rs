//! A fault-injecting transport for tests: fails, hangs, delays, or corrupts checksums of the
//! next transfers, deterministically.
//!
//! What it cannot prove: faults of real hardware (a NIC dropping packets, a GPU copy erroring
//! mid-stream). It exercises the agent's handling of a transport that fails or never returns,
//! and the receiver's checksum verification.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::transfer::{TransferError, TransportKind};

use super::{Job, Transport, TransportFuture};

/// Shared fault plan; set counters from a test, transfers consume them.
#[derive(Debug, Default)]
pub struct FaultInjector {
    fail_next: AtomicUsize,
    hang_next: AtomicUsize,
    corrupt_next: AtomicUsize,
    delay_us: AtomicU64,
    executed: AtomicU64,
}

fn take(counter: &AtomicUsize) -> bool {
    counter.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1)).is_ok()
}

impl FaultInjector {
    /// No faults yet.
    pub fn new() -> Arc<Self> {
        Arc::new(FaultInjector::default())
    }
    /// The next `n` transfers fail at once with a disconnection.
    pub fn fail_next(&self, n: usize) {
        self.fail_next.store(n, Ordering::Release);
    }
    /// The next `n` transfers never complete (only their deadline ends them).
    pub fn hang_next(&self, n: usize) {
        self.hang_next.store(n, Ordering::Release);
    }
    /// The next `n` transfers send wrong checksums; the receiver must refuse them.
    pub fn corrupt_checksums_next(&self, n: usize) {
        self.corrupt_next.store(n, Ordering::Release);
    }
    /// Every transfer waits this long before starting.
    pub fn set_delay(&self, d: Duration) {
        self.delay_us.store(d.as_micros() as u64, Ordering::Release);
    }
    /// Transfers that went through the injector.
    pub fn executed(&self) -> u64 {
        self.executed.load(Ordering::Acquire)
    }
}

/// Wraps a transport with a [`FaultInjector`].
#[derive(Debug)]
pub struct FaultTransport {
    inner: Arc<dyn Transport>,
    faults: Arc<FaultInjector>,
}

impl FaultTransport {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn Transport>, faults: Arc<FaultInjector>) -> Self {
        FaultTransport { inner, faults }
    }
}

impl Transport for FaultTransport {
    fn kind(&self) -> TransportKind {
        self.inner.kind()
    }

    fn execute<'a>(&'a self, job: &'a Job) -> TransportFuture<'a> {
        Box::pin(async move {
            self.faults.executed.fetch_add(1, Ordering::AcqRel);
            let delay = self.faults.delay_us.load(Ordering::Acquire);
            if delay > 0 {
                tokio::time::sleep(Duration::from_micros(delay)).await;
            }
            if take(&self.faults.hang_next) {
                std::future::pending::<()>().await;
            }
            if take(&self.faults.fail_next) {
                return Err(TransferError::Disconnected {
                    peer: job.peer.as_ref().map_or("self".into(), |p| p.metadata().name.clone()),
                    reason: "injected fault".into(),
                });
            }
            if take(&self.faults.corrupt_next) {
                let mut bad = job.clone();
                bad.corrupt_checksums = true;
                return self.inner.execute(&bad).await;
            }
            self.inner.execute(job).await
        })
    }
}
