//! What a process knows of a control-plane backend's health: whether it answers, since when
//! it did not, how often the connection came back, failed lease renewals, and events waiting
//! in or dropped from this process's subscriptions. Shared by the backend's client and read
//! by `/metrics` and `/health` ([`crate::health::ControlHealth`]). Loss and recovery are logged here,
//! once each.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

use parking_lot::Mutex;
use tokio::sync::mpsc;

use crate::health::ControlHealth;

/// One backend's health in this process.
#[derive(Debug)]
pub struct BackendHealth {
    backend: &'static str,
    epoch: Instant,
    up: AtomicBool,
    /// Milliseconds after `epoch` of the last successful contact.
    last_ok_ms: AtomicU64,
    /// Why it was last unreachable, while it is.
    down: Mutex<Option<(String, Instant)>>,
    reconnects: AtomicU64,
    lease_renewals_failed: AtomicU64,
    events_dropped: AtomicU64,
    /// The forwarding ends of this process's subscriptions: what they hold is events behind.
    subscriptions: Mutex<Vec<mpsc::Sender<Vec<u8>>>>,
}

impl BackendHealth {
    /// A backend that just answered (its client connected).
    pub fn new(backend: &'static str) -> Self {
        BackendHealth {
            backend,
            epoch: Instant::now(),
            up: AtomicBool::new(true),
            last_ok_ms: AtomicU64::new(0),
            down: Mutex::new(None),
            reconnects: AtomicU64::new(0),
            lease_renewals_failed: AtomicU64::new(0),
            events_dropped: AtomicU64::new(0),
            subscriptions: Mutex::new(Vec::new()),
        }
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// It answered. After an outage: counts a reconnect and logs the recovery once.
    pub fn reached(&self) {
        self.last_ok_ms.fetch_max(self.now_ms(), Ordering::Relaxed);
        if !self.up.swap(true, Ordering::AcqRel) {
            let outage = self.down.lock().take();
            self.reconnects.fetch_add(1, Ordering::Relaxed);
            let secs = outage.map_or(0.0, |(_, since)| since.elapsed().as_secs_f64());
            tracing::info!(
                backend = self.backend,
                outage_s = secs,
                "control plane reachable again"
            );
        }
    }

    /// It could not be reached (`why`). Logs the loss once, with its cause.
    pub fn lost(&self, why: impl std::fmt::Display) {
        let why = why.to_string();
        let mut down = self.down.lock();
        if self.up.swap(false, Ordering::AcqRel) {
            tracing::warn!(backend = self.backend, error = %why,
                "control plane unreachable (logged once until it returns; see /health)");
            *down = Some((why, Instant::now()));
        } else if let Some((reason, _)) = down.as_mut() {
            *reason = why;
        }
    }

    /// A lease could not be renewed.
    pub fn lease_renewal_failed(&self) {
        self.lease_renewals_failed.fetch_add(1, Ordering::Relaxed);
    }

    /// Events were dropped before this process read them (a slow subscriber).
    pub fn events_dropped(&self, n: u64) {
        self.events_dropped.fetch_add(n, Ordering::Relaxed);
    }

    /// Counts what `tx`'s channel holds as events behind, for as long as its receiver lives.
    pub fn track_subscription(&self, tx: &mpsc::Sender<Vec<u8>>) {
        let mut subs = self.subscriptions.lock();
        subs.retain(|s| !s.is_closed());
        subs.push(tx.clone());
    }

    /// Its state now.
    pub fn status(&self) -> ControlHealth {
        let up = self.up.load(Ordering::Acquire);
        let error = (!up).then(|| {
            self.down.lock().as_ref().map_or_else(|| "unreachable".into(), |(r, _)| r.clone())
        });
        let since_ms = self.now_ms().saturating_sub(self.last_ok_ms.load(Ordering::Relaxed));
        let behind = {
            let mut subs = self.subscriptions.lock();
            subs.retain(|s| !s.is_closed());
            subs.iter().map(|s| (s.max_capacity() - s.capacity()) as u64).sum()
        };
        ControlHealth {
            backend: self.backend.into(),
            connected: up,
            error,
            since_contact_s: since_ms as f64 / 1e3,
            reconnects: self.reconnects.load(Ordering::Relaxed),
            lease_renewals_failed: self.lease_renewals_failed.load(Ordering::Relaxed),
            events_behind: behind,
            events_dropped: self.events_dropped.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loss_and_recovery_are_counted_once_each() {
        let h = BackendHealth::new("etcd");
        assert!(h.status().connected);
        h.lost("connection refused");
        h.lost("timed out");
        let s = h.status();
        assert!(!s.connected);
        assert_eq!(s.error.as_deref(), Some("timed out"), "the latest cause");
        assert_eq!(s.reconnects, 0);
        h.reached();
        h.reached();
        let s = h.status();
        assert!(s.connected && s.error.is_none());
        assert_eq!(s.reconnects, 1, "one outage, one reconnect");
        h.lease_renewal_failed();
        h.events_dropped(3);
        let (tx, rx) = mpsc::channel(8);
        h.track_subscription(&tx);
        tx.try_send(vec![1]).unwrap();
        tx.try_send(vec![2]).unwrap();
        let s = h.status();
        assert_eq!((s.lease_renewals_failed, s.events_dropped, s.events_behind), (1, 3, 2));
        drop(rx);
        assert_eq!(h.status().events_behind, 0, "a closed subscription holds nothing");
    }
}
