//! kvfabric-benches — kvfabric's benchmarks: the end-to-end drivers behind `kvfabric bench`
//! (this library) and criterion micro-benchmarks of the hot paths (`benches/benches/`, run
//! with `cargo bench -p kvfabric-benches`).
//!
//! Every driver measures, in the same run, the machine's own bound for the same work and
//! prints its results as ratios to it, with percentiles, because absolute numbers drift on
//! shared machines:
//!
//! - [`transfer`]: READ and WRITE over shm, tcp (and rdma, cuda where present) against a peer
//!   process, against memcpy and a plain TCP socket (`measure` holds what the transfer
//!   drivers share, `cuda` the GPU copies).
//! - [`tier`]: offload and onboard through the tiered store against plain O_DIRECT I/O.
//! - [`router`]: prefix-index ingestion and query latency, and a routing simulation.
//! - [`fabric`]: remote gets from a fabric node against a plain transfer of the same bytes.
//! - [`engine`]: decode speed of the llama engine and the serving loop against a plain candle
//!   loop.
//! - [`trace`]: a public production trace replayed offline through a simulated deployment
//!   that runs the real router and tier policies, against the trace's limit.
//! - [`serve`]: load on any OpenAI-compatible endpoint (TTFT, ITL, latency, throughput per
//!   concurrency or arrival rate); it reads streams with [`kvfabric_serving::sse`], the
//!   reader the client of engines' APIs uses too.
//!
//! [`plot`] draws every `--plot` as SVG. The command line (`kvfabric bench`) parses arguments
//! and says where the binary is and how agents reach RDMA ([`Host`]); nothing here reads the
//! environment.

use std::path::PathBuf;

use kvfabric::agent::AgentConfig;
use kvfabric::transport::rdma::RdmaConfig;

mod cuda;
pub mod engine;
pub mod fabric;
mod measure;
pub mod plot;
pub mod router;
pub mod serve;
pub mod tier;
pub mod trace;
pub mod transfer;

/// What a benchmark run takes from the program that runs it.
#[derive(Debug, Clone)]
pub struct Host {
    /// The `kvfabric` binary: `bench transfer` starts its peer as `<exe> peer`, `bench fabric`
    /// its node as `<exe> fabric`.
    pub exe: PathBuf,
    /// RDMA settings of the agents a benchmark starts (none: no RDMA transport).
    pub rdma: Option<RdmaConfig>,
    /// The model `bench engine` loads when given none.
    pub model: PathBuf,
}

impl Host {
    /// The configuration of an agent this run starts.
    pub fn agent_config(
        &self,
        name: impl Into<String>,
        secret: impl Into<kvfabric::secret::Secret>,
    ) -> AgentConfig {
        let mut cfg = AgentConfig::new(name, secret);
        cfg.rdma = self.rdma.clone();
        cfg
    }
}

/// Why a benchmark did not run to its end.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// A setting out of range, or a result the run checks came out wrong (a block not
    /// served, a short read).
    #[error("{0}")]
    Failed(String),
    /// A step failed, with its cause.
    #[error("{what}: {source}")]
    Step {
        /// The step.
        what: String,
        /// Its error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// I/O failed (a file, a socket, a child process).
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// The transfer agent failed.
    #[error(transparent)]
    Agent(#[from] kvfabric::agent::AgentError),
    /// A transfer failed.
    #[error(transparent)]
    Transfer(#[from] kvfabric::transfer::TransferError),
    /// A memory region could not be made or registered.
    #[error(transparent)]
    Memory(#[from] kvfabric::memory::MemoryError),
    /// CUDA is not there (no driver, no device).
    #[error(transparent)]
    CudaUnavailable(#[from] kvfabric::cuda::CudaUnavailable),
    /// A CUDA call failed.
    #[error(transparent)]
    Cuda(#[from] kvfabric::cuda::CudaError),
    /// A fabric node's remote tier failed.
    #[error(transparent)]
    Remote(#[from] kvfabric_tiers::remote::RemoteError),
    /// The tiered store failed.
    #[error(transparent)]
    Store(#[from] kvfabric_tiers::StoreError),
    /// A model layout could not be made.
    #[error(transparent)]
    Layout(#[from] kvfabric::layout::LayoutError),
    /// The engine failed.
    #[error(transparent)]
    Engine(#[from] kvfabric_serving::engine::EngineError),
    /// The planner's model refused the profile, the model or a link.
    #[error(transparent)]
    Plan(#[from] kvfabric_planner::plan::PlanError),
    /// A trace could not be read.
    #[error(transparent)]
    Trace(#[from] kvfabric_planner::trace::TraceError),
    /// An HTTP exchange failed.
    #[error(transparent)]
    Http(#[from] hyper::Error),
    /// An HTTP request could not be built.
    #[error(transparent)]
    HttpRequest(#[from] hyper::http::Error),
    /// A task of the benchmark panicked or was cancelled.
    #[error(transparent)]
    Task(#[from] tokio::task::JoinError),
    /// The benchmark's limit on work in flight was closed.
    #[error(transparent)]
    Closed(#[from] tokio::sync::AcquireError),
    /// A result could not be written as JSON.
    #[error(transparent)]
    Json(#[from] serde_json::Error),
}

/// A benchmark's result.
pub type Result<T, E = BenchError> = std::result::Result<T, E>;

/// Names the step that failed.
pub trait Context<T> {
    /// On an error, `what` failed with it as its cause.
    fn context(self, what: impl std::fmt::Display) -> Result<T>;
    /// As [`Context::context`], the step named only when it failed.
    fn with_context<S: std::fmt::Display>(self, what: impl FnOnce() -> S) -> Result<T>;
}

impl<T, E: std::error::Error + Send + Sync + 'static> Context<T> for std::result::Result<T, E> {
    fn context(self, what: impl std::fmt::Display) -> Result<T> {
        self.map_err(|e| BenchError::Step { what: what.to_string(), source: Box::new(e) })
    }

    fn with_context<S: std::fmt::Display>(self, what: impl FnOnce() -> S) -> Result<T> {
        self.map_err(|e| BenchError::Step { what: what().to_string(), source: Box::new(e) })
    }
}

impl<T> Context<T> for Option<T> {
    fn context(self, what: impl std::fmt::Display) -> Result<T> {
        self.ok_or_else(|| BenchError::Failed(what.to_string()))
    }

    fn with_context<S: std::fmt::Display>(self, what: impl FnOnce() -> S) -> Result<T> {
        self.ok_or_else(|| BenchError::Failed(what().to_string()))
    }
}

/// A [`BenchError::Failed`] from a format string.
#[macro_export]
macro_rules! failed {
    ($($arg:tt)*) => {
        $crate::BenchError::Failed(format!($($arg)*))
    };
}

/// Returns a [`BenchError::Failed`].
#[macro_export]
macro_rules! bail {
    ($($arg:tt)*) => {
        return Err($crate::failed!($($arg)*))
    };
}

/// Returns a [`BenchError::Failed`] unless `cond` holds.
#[macro_export]
macro_rules! ensure {
    ($cond:expr, $($arg:tt)*) => {
        let holds: bool = $cond;
        if !holds {
            $crate::bail!($($arg)*);
        }
    };
}

/// Parses sizes such as `4K`, `16KiB`, `1M`, `64MiB`, `4096`.
pub fn parse_size(s: &str) -> Result<u64> {
    let t = s.trim();
    let lower = t.to_ascii_lowercase();
    let (num, mult) = [
        ("kib", 1u64 << 10),
        ("mib", 1 << 20),
        ("gib", 1 << 30),
        ("k", 1 << 10),
        ("m", 1 << 20),
        ("g", 1 << 30),
    ]
    .iter()
    .find_map(|(suf, m)| lower.strip_suffix(suf).map(|n| (n.to_string(), *m)))
    .unwrap_or((lower.clone(), 1));
    let v: u64 =
        num.trim().parse().map_err(|_| failed!("invalid size {t:?} (use e.g. 4K, 16MiB)"))?;
    ensure!(v > 0, "size must be > 0, got {t:?}");
    v.checked_mul(mult).ok_or_else(|| failed!("size {t:?} overflows"))
}

/// Formats a byte size compactly (4K, 16M).
pub fn short_size(b: u64) -> String {
    if b >= 1 << 20 && b % (1 << 20) == 0 {
        format!("{}M", b >> 20)
    } else if b >= 1 << 10 && b % (1 << 10) == 0 {
        format!("{}K", b >> 10)
    } else {
        b.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4K").unwrap(), 4096);
        assert_eq!(parse_size("16KiB").unwrap(), 16384);
        assert_eq!(parse_size("64MiB").unwrap(), 64 << 20);
        assert_eq!(parse_size("100").unwrap(), 100);
        assert!(parse_size("0").is_err() && parse_size("x").is_err() && parse_size("-4K").is_err());
        assert_eq!(short_size(16 << 20), "16M");
        assert_eq!(short_size(4096), "4K");
        assert_eq!(short_size(1000), "1000");
    }
}
