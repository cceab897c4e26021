//! Small statistics for benchmarks: percentiles and rates.

use std::time::Duration;

/// Summary of a set of latency samples.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Percentiles {
    /// Samples.
    pub count: usize,
    /// Median, microseconds.
    pub p50_us: f64,
    /// 90th percentile, microseconds.
    pub p90_us: f64,
    /// 99th percentile, microseconds.
    pub p99_us: f64,
    /// Mean, microseconds.
    pub mean_us: f64,
}

/// The `q` quantile (0..=1) of sorted samples, nearest-rank.
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

impl Percentiles {
    /// Summarizes durations.
    pub fn of(samples: &[Duration]) -> Self {
        let mut us: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1e6).collect();
        us.sort_by(f64::total_cmp);
        Percentiles {
            count: us.len(),
            p50_us: quantile(&us, 0.50),
            p90_us: quantile(&us, 0.90),
            p99_us: quantile(&us, 0.99),
            mean_us: if us.is_empty() {
                f64::NAN
            } else {
                us.iter().sum::<f64>() / us.len() as f64
            },
        }
    }
}

/// GB/s (10^9 bytes per second).
pub fn gbps(bytes: u64, elapsed: Duration) -> f64 {
    bytes as f64 / elapsed.as_secs_f64().max(1e-12) / 1e9
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_quantiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(quantile(&v, 0.5), 50.0);
        assert_eq!(quantile(&v, 0.99), 99.0);
        assert_eq!(quantile(&v, 1.0), 100.0);
        assert_eq!(quantile(&v, 0.0), 1.0);
        assert!(quantile(&[], 0.5).is_nan());
        let p = Percentiles::of(&[Duration::from_micros(10), Duration::from_micros(30)]);
        assert_eq!((p.p50_us, p.p99_us, p.mean_us), (10.0, 30.0, 20.0));
        assert!((gbps(2_000_000_000, Duration::from_secs(2)) - 1.0).abs() < 1e-12);
    }
}
