//! The generation contract: what a frontend asks of an engine (a [`GenerateRequest`]), what
//! the engine answers ([`GenEvent`]s), and why it fails ([`EngineError`]). The engine's
//! scheduler takes and gives these types, and a worker's request port carries them as they
//! are (inside [`super::worker`]'s versioned frames), so a field added here is a change of
//! the wire, made in one place.

use std::time::Duration;

/// Why a request or an engine failed.
#[derive(Debug, Clone, thiserror::Error, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum EngineError {
    /// The request is malformed (bad parameters, untokenizable prompt).
    #[error("{message}")]
    Invalid {
        /// What is wrong.
        message: String,
    },
    /// The prompt (plus the tokens asked for) does not fit the model's context.
    #[error("this model's maximum context length is {limit} tokens; the request needs {needed} ({prompt} in the prompt)")]
    ContextLength {
        /// The model's context.
        limit: usize,
        /// Prompt plus requested completion tokens.
        needed: usize,
        /// Prompt tokens.
        prompt: usize,
    },
    /// Too many requests are waiting (or, for a request of a less urgent class, a more
    /// urgent one needed its place).
    #[error("the engine is overloaded ({waiting} requests waiting); retry later")]
    Overloaded {
        /// Requests waiting.
        waiting: usize,
        /// When a retry may be served, as the engine estimates it (how long its queue takes
        /// to drain), milliseconds: the HTTP answer's `Retry-After`.
        #[serde(default)]
        retry_after_ms: Option<u64>,
    },
    /// The request ran past its deadline.
    #[error("the request ran past its deadline of {timeout:?}")]
    Deadline {
        /// The request's timeout.
        timeout: Duration,
    },
    /// The engine stopped.
    #[error("the engine is not running")]
    Stopped,
    /// The client read its stream too slowly: it fell this many events behind, and the
    /// generation was stopped.
    #[error("the client read its stream too slowly (fell {buffered} events behind); the generation was stopped")]
    SlowReader {
        /// Events it had not read.
        buffered: usize,
    },
    /// No worker can serve the request now.
    #[error("{message}")]
    Unavailable {
        /// Why.
        message: String,
    },
    /// The model could not be loaded or run.
    #[error("{message}")]
    Model {
        /// What failed.
        message: String,
    },
}

impl EngineError {
    /// A bad request.
    pub fn invalid(message: impl Into<String>) -> Self {
        EngineError::Invalid { message: message.into() }
    }

    /// A model or engine failure.
    pub fn model(message: impl Into<String>) -> Self {
        EngineError::Model { message: message.into() }
    }
}

/// The longest deadline a request may ask for: every timeout from a client or a peer is
/// bounded by it before any clock arithmetic.
pub const REQUEST_TIMEOUT_MAX: Duration = Duration::from_secs(24 * 3600);

/// A generation request, tokens in.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct GenerateRequest {
    /// Prompt tokens.
    pub prompt: Vec<u32>,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Sampling.
    pub sampling: SamplingParams,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Keep going past EOS (benchmarks).
    pub ignore_eos: bool,
    /// When the request fails with [`EngineError::Deadline`].
    pub timeout: Duration,
    /// Its service class, as the frontend resolved it (None: no classes, first come first
    /// served).
    #[serde(default)]
    pub class: Option<ClassHint>,
    /// Folded into the hashes of its blocks ([`crate::hash::HashSeed::salted`]): requests
    /// share cached KV only with requests of the same salt (a tenant's namespace, the
    /// client's `cache_salt`).
    #[serde(default)]
    pub cache_salt: Option<String>,
    /// The tenant whose API key sent it, and what it may hold of the worker's store.
    #[serde(default)]
    pub tenant: Option<TenantHint>,
    /// Where a router found the prefix that follows the worker's own cached run: the worker
    /// pulls those blocks from that peer's store instead of computing them (None: compute
    /// what it lacks).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pull: Option<PullHint>,
}

/// A router's advice to pull part of a prompt's prefix from another worker's store.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PullHint {
    /// The worker holding the blocks (its name in discovery, which is its agent's).
    pub from: String,
    /// Blocks of the prompt's leading run it holds (counted from the prompt's start): the
    /// worker pulls those past its own cached run.
    pub blocks: u32,
}

/// What a worker needs to know of a request's tenant.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TenantHint {
    /// The tenant's name.
    pub name: String,
    /// KV blocks its requests may hold in a worker's store (host and disk tiers together);
    /// past it, its own oldest blocks are removed, never another tenant's. None: no quota.
    #[serde(default)]
    pub store_blocks: Option<u64>,
    /// Of them, blocks in host memory: past it, its least recently used host blocks move to
    /// disk (dropped where there is none). None: no quota of its own.
    #[serde(default)]
    pub host_blocks: Option<u64>,
    /// Of them, blocks on disk: past it, its least recently used disk blocks are removed.
    /// None: no quota of its own.
    #[serde(default)]
    pub disk_blocks: Option<u64>,
}

impl GenerateRequest {
    /// A request of `prompt` for `max_tokens` tokens, greedy, within `timeout`, of no class
    /// and no salt.
    pub fn new(prompt: Vec<u32>, max_tokens: usize, timeout: Duration) -> Self {
        GenerateRequest {
            prompt,
            max_tokens,
            sampling: SamplingParams::default(),
            stop: Vec::new(),
            ignore_eos: false,
            timeout,
            class: None,
            cache_salt: None,
            tenant: None,
            pull: None,
        }
    }

    /// The rank of its class (0 the most urgent); a request of no class ranks with the most
    /// urgent.
    pub fn rank(&self) -> u8 {
        self.class.as_ref().map_or(0, |c| c.rank)
    }
}

/// What an engine needs to know of a request's service class: how urgent it is against the
/// others and the latency targets it is scheduled to meet.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ClassHint {
    /// The class's name (in metrics and logs).
    pub name: String,
    /// Its urgency among the classes configured: 0 is the most urgent. A waiting request
    /// displaces (and may preempt the prefill of) requests of a higher rank, never of its
    /// own or a lower one.
    pub rank: u8,
    /// Its priority in vLLM's convention (lower is served first), forwarded to engines that
    /// schedule by it.
    pub priority: i32,
    /// Time to first token it is scheduled to meet: requests are ordered by arrival plus
    /// this (earliest deadline first).
    pub ttft: Option<Duration>,
    /// Gap between tokens it is scheduled to meet: prompt chunks computed while it decodes
    /// are cut so that a step stays within it.
    pub itl: Option<Duration>,
    /// A request not started this long after it arrived is answered at once (expired), not
    /// computed.
    pub expire: Option<Duration>,
    /// The share of a frontend's capacity (0..=1) its requests may hold while requests of
    /// other classes wait in the frontend's queue.
    #[serde(default)]
    pub share: Option<f64>,
}

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// EOS, an end-of-turn token or a stop string.
    Stop,
    /// `max_tokens` or the context length.
    Length,
}

/// Prompt tokens served from the store, per tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CacheHits {
    /// Tokens whose KV the engine still held in its own (device) memory: an engine behind
    /// the OpenAI API reports its prefix-cache hits here.
    #[serde(default)]
    pub device_tokens: usize,
    /// Tokens whose KV came from host memory.
    pub host_tokens: usize,
    /// From disk.
    pub disk_tokens: usize,
    /// From a remote fabric node.
    pub remote_tokens: usize,
    /// Pulled from another worker's store.
    #[serde(default)]
    pub peer_tokens: usize,
}

impl CacheHits {
    /// All cached tokens.
    pub fn total(&self) -> usize {
        self.device_tokens
            + self.host_tokens
            + self.disk_tokens
            + self.remote_tokens
            + self.peer_tokens
    }
}

/// A prompt prefilled by a prefill worker.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RemotePrefill {
    /// The prefill worker.
    pub worker: String,
    /// Blocks it wrote.
    pub blocks: usize,
    /// Prompt tokens in them.
    pub tokens: usize,
    /// Bytes it wrote.
    pub bytes: u64,
    /// From enqueueing the job to the notification, microseconds (queue, compute, transfer).
    pub wait_us: u64,
    /// Its compute time, microseconds.
    pub compute_us: u64,
}

/// What a generation reports, in order: `Started`, `Token`s, then `Done` or `Error` (and on a
/// worker's request port, `Accepted` before them).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GenEvent {
    /// The worker queued the request as the `seq`-th it accepted (sent first, by a worker's
    /// request port only): its load reports count the request from the one whose
    /// [`Load::accepted`](super::Load::accepted) reaches `seq`.
    Accepted {
        /// The request's number at the worker.
        seq: u64,
    },
    /// Admitted: prompt KV reused from the store.
    Started {
        /// Prompt tokens.
        prompt_tokens: usize,
        /// Prompt tokens whose KV came from the store.
        cached: CacheHits,
        /// The worker serving it (set by remote backends).
        #[serde(default)]
        worker: Option<String>,
        /// The prompt's KV was computed by a prefill worker (disaggregated serving).
        #[serde(default)]
        remote_prefill: Option<RemotePrefill>,
    },
    /// A token and the text it completes (may be empty).
    Token {
        /// The token.
        id: u32,
        /// New text.
        text: String,
    },
    /// The end.
    Done {
        /// Why.
        reason: FinishReason,
        /// Tokens generated.
        completion_tokens: usize,
        /// Text held back until the end (a partial stop-string match that never completed).
        text: String,
    },
    /// The prompt's cache hits as the engine counted them, known only at the end (an engine
    /// behind the OpenAI API reports them in its usage); replaces what `Started` said.
    Cached(CacheHits),
    /// The generation failed.
    Error(EngineError),
}

/// How to pick tokens.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SamplingParams {
    /// 0 = greedy (argmax, lowest id on ties).
    pub temperature: f32,
    /// Nucleus: sample among the most likely tokens whose probabilities sum to `top_p`.
    pub top_p: f32,
    /// Seed of the sampler: the same seed, prompt and parameters give the same tokens.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams { temperature: 0.0, top_p: 1.0, seed: 0 }
    }
}
