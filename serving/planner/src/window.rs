//! What the frontend saw of its load over an interval ([`LoadWindow`]), and where the live
//! planner takes it from ([`LoadSource`]): the serving layer's HTTP metrics are one source.

use std::time::Duration;

/// Latency samples a window keeps of each kind.
pub const WINDOW_SAMPLES_MAX: usize = 100_000;

/// What the frontend saw since the window was last taken ([`LoadSource::take_window`]): the
/// planner's observation of its load.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LoadWindow {
    /// How long it covers.
    pub duration: Duration,
    /// Requests that arrived (submitted to the backend, refused at admission or not).
    pub arrivals: u64,
    /// Requests finished (any outcome but a client error).
    pub requests: u64,
    /// Requests whose token counts are in the sums below.
    pub counted: u64,
    /// Of them, failed (server errors).
    pub errors: u64,
    /// Prompt tokens of the requests finished.
    pub prompt_tokens: u64,
    /// Tokens they generated.
    pub generated_tokens: u64,
    /// Prompt tokens found cached.
    pub cached_tokens: u64,
    /// Times to first token, seconds (at most [`WINDOW_SAMPLES_MAX`], as for ITL); a request
    /// that failed before its first token counts with the time it failed after.
    pub ttft_s: Vec<f64>,
    /// Inter-token latencies, seconds (at most [`WINDOW_SAMPLES_MAX`], a uniform sample of
    /// them all past it).
    pub itl_s: Vec<f64>,
    /// Prompt tokens of each request counted (at most [`WINDOW_SAMPLES_MAX`], as for ITL):
    /// how prompt lengths spread.
    pub prompt_lens: Vec<f64>,
    /// The same per service class, when the frontend has classes (empty otherwise).
    pub classes: Vec<ClassWindow>,
}

/// What the frontend saw of one service class's requests over an interval.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ClassWindow {
    /// The class.
    pub name: String,
    /// Its TTFT target, seconds (None: it has none).
    pub ttft_target_s: Option<f64>,
    /// Its ITL target, seconds.
    pub itl_target_s: Option<f64>,
    /// Requests of it that arrived.
    pub arrivals: u64,
    /// Requests whose token counts are in the sums below.
    pub counted: u64,
    /// Their prompt tokens.
    pub prompt_tokens: u64,
    /// Tokens they generated.
    pub generated_tokens: u64,
    /// Prompt tokens found cached.
    pub cached_tokens: u64,
    /// Its times to first token, seconds (at most [`WINDOW_SAMPLES_MAX`]).
    pub ttft_s: Vec<f64>,
}

/// Where the planner reads its load: each call returns what was seen since the last one.
pub trait LoadSource: Send + Sync + 'static {
    /// The window since the last call (the first: since the source started).
    fn take_window(&self) -> LoadWindow;
}
