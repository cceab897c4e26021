//! Store metrics: lock-free counters and latency histograms, read as a snapshot. The serving
//! layer renders them for Prometheus; names live in one place there.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds of the latency buckets, seconds.
pub const LATENCY_BUCKETS_S: [f64; 12] =
    [50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 1.0];

/// A latency histogram with fixed buckets.
#[derive(Debug, Default)]
pub struct Histogram {
    buckets: [AtomicU64; LATENCY_BUCKETS_S.len()],
    overflow: AtomicU64,
    count: AtomicU64,
    sum_ns: AtomicU64,
}

/// A histogram's values.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct HistogramSnapshot {
    /// Cumulative counts per bucket of [`LATENCY_BUCKETS_S`].
    pub cumulative: Vec<u64>,
    /// Observations.
    pub count: u64,
    /// Sum, seconds.
    pub sum_s: f64,
}

impl Histogram {
    /// Records one observation.
    pub fn observe(&self, d: Duration) {
        let s = d.as_secs_f64();
        match LATENCY_BUCKETS_S.iter().position(|&b| s <= b) {
            Some(i) => self.buckets[i].fetch_add(1, Ordering::Relaxed),
            None => self.overflow.fetch_add(1, Ordering::Relaxed),
        };
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_ns.fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
    }

    /// Reads it.
    pub fn snapshot(&self) -> HistogramSnapshot {
        let mut acc = 0;
        let cumulative = self
            .buckets
            .iter()
            .map(|b| {
                acc += b.load(Ordering::Relaxed);
                acc
            })
            .collect();
        HistogramSnapshot {
            cumulative,
            count: self.count.load(Ordering::Relaxed),
            sum_s: self.sum_ns.load(Ordering::Relaxed) as f64 / 1e9,
        }
    }
}

/// A transfer rate measured over transfers, bytes per second: an exponentially weighted
/// mean, the newest weighing 0.3.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Rate(Option<f64>);

impl Rate {
    const WEIGHT: f64 = 0.3;

    /// Transfers of many blocks smaller than this say more of their round trip than of the
    /// link's rate: their callers leave them out.
    pub const BATCH_BYTES_MIN: u64 = 1 << 20;

    /// `bytes` moved in `took`.
    pub fn observe(&mut self, bytes: u64, took: Duration) {
        if took.is_zero() {
            return;
        }
        let r = bytes as f64 / took.as_secs_f64();
        self.0 = Some(self.0.map_or(r, |old| Self::WEIGHT * r + (1.0 - Self::WEIGHT) * old));
    }

    /// The rate, None before a transfer large enough to measure it.
    pub fn get(self) -> Option<f64> {
        self.0
    }
}

/// Counters of one tier.
#[derive(Debug, Default)]
pub struct TierCounters {
    /// Blocks found by lookups.
    pub hits: AtomicU64,
    /// Lookups that stopped here (the first block not in any tier is counted once, at the
    /// fastest tier).
    pub misses: AtomicU64,
}

/// Every counter of a store.
#[derive(Debug, Default)]
pub struct StoreMetrics {
    /// Host tier.
    pub host: TierCounters,
    /// Disk tier.
    pub disk: TierCounters,
    /// Blocks written host → disk.
    pub offload_blocks: AtomicU64,
    /// Bytes written host → disk.
    pub offload_bytes: AtomicU64,
    /// Offloads that failed (disk full, I/O error); the block stayed in host memory.
    pub offload_errors: AtomicU64,
    /// Offload latency.
    pub offload_latency: Histogram,
    /// Blocks read disk → host.
    pub onboard_blocks: AtomicU64,
    /// Bytes read disk → host.
    pub onboard_bytes: AtomicU64,
    /// Onboard latency.
    pub onboard_latency: Histogram,
    /// Blocks found corrupt on disk and dropped.
    pub disk_corrupt_blocks: AtomicU64,
    /// When the last corrupt block was found, ms since the Unix epoch (0: never).
    pub disk_corrupt_last_ms: AtomicU64,
    /// Blocks stored.
    pub stored_blocks: AtomicU64,
}

/// Now, in milliseconds since the Unix epoch (0 before it).
pub(crate) fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A snapshot of the store's metrics and occupancy.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct MetricsSnapshot {
    /// G1 (device tier) slots in use; 0 without a device tier.
    pub device_used_blocks: u32,
    /// G1 slots in all; 0 without a device tier.
    pub device_capacity_blocks: u32,
    /// Host slots in use.
    pub host_used_blocks: u32,
    /// Host slots in all.
    pub host_capacity_blocks: u32,
    /// Disk slots in use.
    pub disk_used_blocks: u32,
    /// Disk slots usable (capped when the filesystem filled up).
    pub disk_capacity_blocks: u32,
    /// Host lookup hits.
    pub host_hits: u64,
    /// Host lookup misses.
    pub host_misses: u64,
    /// Disk lookup hits.
    pub disk_hits: u64,
    /// Disk lookup misses.
    pub disk_misses: u64,
    /// Blocks evicted from the host tier (moved down, or dropped when nothing is below).
    pub host_evicted_blocks: u64,
    /// Blocks evicted from the disk tier to make room.
    pub disk_evicted_blocks: u64,
    /// Offloaded blocks.
    pub offload_blocks: u64,
    /// Offloaded bytes.
    pub offload_bytes: u64,
    /// Failed offloads.
    pub offload_errors: u64,
    /// Offload latency.
    pub offload_latency: HistogramSnapshot,
    /// Onboarded blocks.
    pub onboard_blocks: u64,
    /// Onboarded bytes.
    pub onboard_bytes: u64,
    /// Onboard latency.
    pub onboard_latency: HistogramSnapshot,
    /// Corrupt disk blocks dropped.
    pub disk_corrupt_blocks: u64,
    /// Blocks stored.
    pub stored_blocks: u64,
    /// The disk I/O backend (`io_uring`, `pread`, or none).
    pub disk_io_backend: Option<&'static str>,
}

pub(crate) fn get(a: &AtomicU64) -> u64 {
    a.load(Ordering::Relaxed)
}

pub(crate) fn add(a: &AtomicU64, n: u64) {
    a.fetch_add(n, Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let h = Histogram::default();
        h.observe(Duration::from_micros(10));
        h.observe(Duration::from_micros(700));
        h.observe(Duration::from_secs(5));
        let s = h.snapshot();
        assert_eq!(s.count, 3);
        assert_eq!(s.cumulative[0], 1);
        assert_eq!(s.cumulative[4], 2);
        assert_eq!(*s.cumulative.last().unwrap(), 2, "5 s is past the last bucket");
        assert!((s.sum_s - 5.00071).abs() < 1e-9);
    }
}
