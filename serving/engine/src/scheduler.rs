//! The continuous batching loop: one engine on its own thread, served from the tiered block
//! store (admission with prefix reuse, decodes and prefill chunks in one step, sampling, stop
//! conditions, storing newly full blocks, cancellation and deadlines).
//!
//! The store is the engine's KV memory: a sequence's cached blocks are pinned store slots
//! that the engine reads in place, and the blocks it computes are written into store slots
//! that become stored blocks once full (committed in place, no copy). Engine memory is the
//! fallback when the store cannot spare a slot.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::stream::{EventRx, EventTx};
use kvfabric::events::TierKind;
use kvfabric::hash::{HashSeed, SequenceHash, TokenBlockHasher};
use kvfabric::queue::{Expiry, Key, Meta, Place, Queue, Running};
use kvfabric_tiers::{StoreError, TieredStore};

use super::{
    CacheHits, Engine, EngineError, FinishReason, GenEvent, GenerateRequest, KvBlock, ModelInfo,
    Next, Sampler, StepInput, TextCodec, TextStream,
};

/// The longest a request waits for the fabric to say which of its blocks it holds.
const REMOTE_LOOKUP_MAX: Duration = Duration::from_secs(1);

/// One run of fabric blocks in this many that computing would beat is fetched anyway, to
/// measure the link again.
const REMOTE_PROBE_EVERY: u64 = 16;

/// Scheduler limits.
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// Sequences decoded together at most.
    pub batch_max: usize,
    /// Requests waiting for a batch slot at most; more are refused as overloaded.
    pub waiting_max: usize,
    /// Prompt tokens computed per step at most (long prompts are chunked).
    pub step_tokens: usize,
    /// Block hashing seed (LoRA / salt).
    pub hash_seed: HashSeed,
    /// Store computed blocks (prompt and generated) in the block store.
    pub store_blocks: bool,
    /// How waiting requests are ordered.
    pub policy: QueuePolicy,
}

/// How an engine orders the requests that wait for a batch slot (the one admission
/// queue's policy, `kvfabric::queue`).
pub use kvfabric::queue::QueuePolicy;

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            batch_max: 16,
            waiting_max: 256,
            step_tokens: 512,
            hash_seed: HashSeed::default(),
            store_blocks: true,
            policy: QueuePolicy::Edf,
        }
    }
}

/// Counters of the scheduler, read by `/metrics`.
#[derive(Debug, Default)]
pub struct SchedulerStats {
    /// Requests waiting for a batch slot.
    pub waiting: AtomicU64,
    /// Requests in the batch.
    pub running: AtomicU64,
    /// Tokens of KV held by the requests in the batch (decode load).
    pub active_tokens: AtomicU64,
    /// Prompt tokens not computed yet, waiting or running (prefill load), as of the engine's
    /// last count (before and after each step).
    pub queued_prefill_tokens: AtomicU64,
    /// Prompt tokens of requests submitted that the engine's loop has not counted in
    /// `queued_prefill_tokens` yet (it takes them in between steps: during a long step they
    /// wait here, and a load report that left them out would tell routers the worker is
    /// idler than it is).
    pub inbox_prompt_tokens: AtomicU64,
    /// Requests accepted (submitted and queued), ever: the number of the latest. Every
    /// request up to it counts in [`SchedulerStats::prefill_load`] read after it.
    pub accepted: AtomicU64,
    /// Prompt tokens admitted.
    pub prompt_tokens: AtomicU64,
    /// Prompt tokens served from host, disk and remote blocks.
    pub cached_tokens: [AtomicU64; 3],
    /// Prompt tokens computed.
    pub prefill_tokens: AtomicU64,
    /// Tokens generated.
    pub generated_tokens: AtomicU64,
    /// Blocks stored into the store.
    pub stored_blocks: AtomicU64,
    /// Blocks held in engine memory because the host tier had no slot to spare (computed
    /// there, or spilled out of the store by a sequence longer than the tier): a host tier
    /// too small for the batch.
    pub engine_memory_blocks: AtomicU64,
    /// Steps run.
    pub steps: AtomicU64,
    /// Prompt tokens computed per second, as measured over steps that ran prompts only (0:
    /// not measured yet): what routers price computing a prefix at.
    pub prefill_tokens_per_s: AtomicU64,
    /// Prompts whose blocks on the fabric (G4) were computed instead: fetching them over the
    /// link, at the rate measured, would have taken longer.
    pub remote_declined: AtomicU64,
    /// Requests cancelled by their client.
    pub cancelled: AtomicU64,
    /// Requests failed by their deadline.
    pub deadline_exceeded: AtomicU64,
    /// The worker is draining (it left discovery and finishes what it has).
    pub draining: std::sync::atomic::AtomicBool,
    /// Per request: from its arrival at the engine to the start of the first step that
    /// computes it (waiting for a batch slot, importing its cached blocks, and the step in
    /// flight when it came, which a new request always waits for).
    pub queue_time: kvfabric_tiers::metrics::Histogram,
    /// Per request: from the start of its first step to its first token (its prompt's
    /// steps, and any steps that ran between them).
    pub prefill_time: kvfabric_tiers::metrics::Histogram,
    /// Requests whose prefill was stopped to give their batch slot to a request of a more
    /// urgent class (they wait again, and resume from the blocks they had stored).
    pub preempted: AtomicU64,
    /// Requests whose decode was paused to give their batch slot to a latency class's
    /// request that would otherwise miss its TTFT target (they wait again, and resume from
    /// their stored blocks: only the last, partial block is computed again).
    pub preempted_decode: AtomicU64,
    /// Of the requests waiting, those preempted (admitted before, waiting to resume): they
    /// count against no bound and are never shed.
    pub resuming: AtomicU64,
    /// Requests refused or dropped from the queue as overloaded (429) so that a more urgent
    /// class's request could wait instead, or because the queue was full.
    pub shed: AtomicU64,
    /// Requests whose class's `expire` passed before they started: answered at once.
    pub expired: AtomicU64,
    /// Blocks removed from the store because their tenant was past its quota.
    pub quota_removed: AtomicU64,
    /// Blocks moved from host memory to disk because their tenant was past its host quota.
    pub quota_demoted: AtomicU64,
    /// The rank of the least urgent request waiting (0 when none waits): a full queue still
    /// takes a request more urgent than it, and drops that one.
    pub least_urgent_waiting: AtomicU64,
    /// How long the engine estimates its queued prompts take to compute, milliseconds (what
    /// a shed request is told to wait before retrying).
    pub drain_estimate_ms: AtomicU64,
    /// What one prompt token costs to compute, nanoseconds, as measured over the last steps
    /// (0 until a step computed a prompt).
    pub prefill_ns_per_token: AtomicU64,
}

impl SchedulerStats {
    /// Prompt tokens the engine has yet to compute: those of its last iteration's count and
    /// those submitted since (what a load report tells routers). A request is in one or the
    /// other (for a moment in both, never in neither): the loop counts it in
    /// `queued_prefill_tokens` before taking it out of the inbox, and this reads the inbox
    /// first.
    pub fn prefill_load(&self) -> u64 {
        let inbox = self.inbox_prompt_tokens.load(Ordering::SeqCst);
        inbox + self.queued_prefill_tokens.load(Ordering::SeqCst)
    }
}

fn bump(a: &AtomicU64, n: u64) {
    a.fetch_add(n, Ordering::Relaxed);
}

mod kv;
mod step;

struct Submission {
    req: GenerateRequest,
    tx: EventTx,
    arrived: Instant,
    /// It was admitted before and preempted (`Started` was sent): what it resumes from.
    resume: Option<Box<Resume>>,
}

/// What a preempted request keeps while it waits to run again: the tokens so far and the
/// state of its sampling and text, so that it goes on exactly where it stopped. Its KV is
/// not kept: the full blocks are in the store (they were stored as they filled), the last,
/// partial one is computed again.
struct Resume {
    /// Prompt then generated tokens.
    tokens: Vec<u32>,
    /// Sequence hashes of their full blocks.
    hashes: Vec<SequenceHash>,
    /// Tokens generated (sent to the client).
    generated: usize,
    sampler: Sampler,
    text: TextStream,
    /// When its first step started.
    first_step: Option<Instant>,
    /// Tokens it computes again if its stored blocks are all still there.
    left: usize,
}

impl Submission {
    fn new(req: GenerateRequest, tx: EventTx) -> Self {
        Submission { req, tx, arrived: Instant::now(), resume: None }
    }

    /// Prompt tokens it would compute (for a resumed request, those past its stored blocks).
    fn prefill_tokens(&self) -> usize {
        self.resume.as_ref().map_or(self.req.prompt.len(), |r| r.left)
    }

    /// What the admission queue knows of it: its class, its key (earliest deadline first:
    /// arrival plus its class's TTFT target, or its timeout), its deadline and its class's
    /// expiry (none once it sent tokens); a preempted request is pinned (never shed).
    fn meta(&self, policy: QueuePolicy) -> Meta<Instant> {
        let mut m = Meta::new(policy, self.req.class.as_ref(), self.arrived, self.req.timeout);
        m.pinned = self.resume.is_some();
        if self.resume.as_ref().is_some_and(|r| r.generated > 0) {
            m.expires = None;
        }
        m
    }
}

/// The handle to a running engine: submit requests, read its model and counters. Cheap to
/// clone; the engine thread ends when the last handle is dropped.
#[derive(Debug, Clone)]
pub struct Scheduler {
    tx: std::sync::mpsc::Sender<Submission>,
    info: Arc<ModelInfo>,
    codec: Arc<TextCodec>,
    stats: Arc<SchedulerStats>,
    waiting_max: usize,
    policy: QueuePolicy,
    /// Why the engine thread died (None while it runs).
    failure: tokio::sync::watch::Receiver<Option<String>>,
    /// How it names a prompt's blocks.
    hasher: TokenBlockHasher,
}

impl std::fmt::Debug for Submission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Submission").field("prompt", &self.req.prompt.len()).finish()
    }
}

impl Scheduler {
    /// The names of `prompt`'s full blocks, as this engine stores them.
    pub fn sequence_hashes(&self, prompt: &[u32]) -> Vec<kvfabric::hash::SequenceHash> {
        self.hasher.sequence_hashes(prompt)
    }

    /// The hasher of a request with `salt` ([`GenerateRequest::cache_salt`]).
    pub fn hasher(&self, salt: Option<&str>) -> TokenBlockHasher {
        salted(self.hasher, salt)
    }

    /// Starts `engine` on its own thread. Store operations run on `runtime`, which must not
    /// be the engine thread's (it is a plain thread).
    pub fn start<E: Engine>(
        engine: E,
        store: TieredStore,
        cfg: SchedulerConfig,
        runtime: tokio::runtime::Handle,
    ) -> Result<Self, EngineError> {
        let info = Arc::new(engine.info().clone());
        let codec = Arc::new(engine.codec().clone());
        if store.block_bytes() != info.layout.bytes_per_block() {
            return Err(EngineError::model(format!(
                "store blocks are {} bytes, the model's are {}",
                store.block_bytes(),
                info.layout.bytes_per_block()
            )));
        }
        let hasher = TokenBlockHasher::new(info.layout.block_tokens, cfg.hash_seed);
        let stats = Arc::new(SchedulerStats::default());
        let (tx, rx) = std::sync::mpsc::channel();
        let waiting_max = cfg.waiting_max;
        let policy = cfg.policy;
        let store_capacity = store.metrics().host_capacity_blocks;
        let lp = Loop {
            engine,
            store,
            runtime,
            hasher,
            cfg,
            rx,
            stats: stats.clone(),
            codec: codec.clone(),
            waiting: Queue::new(policy),
            running: Vec::new(),
            next_id: 1,
            block_bytes: info.layout.bytes_per_block() as usize,
            host_capacity: store_capacity as usize,
            decodes_deferred: false,
            taken_in: 0,
            cost: StepCost::default(),
            latency_jumped: false,
            quotas: Default::default(),
        };
        let (failed, failure) = tokio::sync::watch::channel(None);
        std::thread::Builder::new()
            .name("kvfabric-engine".into())
            .spawn(move || {
                // A panic in the engine (a bug, a driver fault) ends the loop: it is logged
                // with its cause and published, so that the worker leaves service instead of
                // answering `stopped` to everything while it still looks healthy.
                if let Err(panic) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| lp.run())) {
                    let cause = super::panic_message(&*panic);
                    tracing::error!(%cause, "the engine thread panicked: the engine is out of service");
                    let _ = failed.send(Some(format!("the engine thread panicked: {cause}")));
                }
            })
            .map_err(|e| EngineError::model(format!("starting the engine thread: {e}")))?;
        Ok(Scheduler { tx, info, codec, stats, waiting_max, policy, failure, hasher })
    }

    /// Why the engine thread died, if it did: the engine serves nothing more.
    pub fn failure(&self) -> Option<String> {
        self.failure.borrow().clone()
    }

    /// Its part of `/health`: what runs and waits, and why the engine stopped if it did.
    pub fn health(&self) -> kvfabric::health::EngineHealth {
        kvfabric::health::EngineHealth {
            running: self.stats.running.load(Ordering::Relaxed),
            waiting: self.stats.waiting.load(Ordering::Relaxed),
            failure: self.failure(),
        }
    }

    /// Resolves when the engine thread dies, with why (never while it runs).
    pub async fn failed(&self) -> String {
        let mut rx = self.failure.clone();
        let reason = rx.wait_for(|f| f.is_some()).await.map(|f| f.clone().unwrap_or_default());
        match reason {
            Ok(r) => r,
            // The thread ended without a failure and dropped its sender: wait forever.
            Err(_) => std::future::pending().await,
        }
    }

    /// The model.
    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    /// Its tokenizer and chat template.
    pub fn codec(&self) -> &TextCodec {
        &self.codec
    }

    /// The counters.
    pub fn stats(&self) -> &SchedulerStats {
        &self.stats
    }

    /// How it orders waiting requests.
    pub fn policy(&self) -> QueuePolicy {
        self.policy
    }

    /// Checks a request against the model's context, then queues it. Events arrive on the
    /// returned channel; dropping it cancels the generation and frees its KV.
    pub fn submit(&self, req: GenerateRequest) -> Result<EventRx, EngineError> {
        self.submit_numbered(req).map(|(rx, _)| rx)
    }

    /// [`Scheduler::submit`], and the request's number among those accepted: every load
    /// read after [`SchedulerStats::accepted`] reached it counts the request (until it is
    /// done).
    pub fn submit_numbered(&self, req: GenerateRequest) -> Result<(EventRx, u64), EngineError> {
        let ctx = self.info.context_len;
        super::check_prompt(&self.info, &self.codec, &req.prompt)?;
        let needed = req.prompt.len().saturating_add(req.max_tokens);
        if needed > ctx {
            return Err(EngineError::ContextLength {
                limit: ctx,
                needed,
                prompt: req.prompt.len(),
            });
        }
        if req.max_tokens == 0 {
            return Err(EngineError::invalid("max_tokens must be at least 1"));
        }
        if req.timeout.is_zero() || req.timeout > super::REQUEST_TIMEOUT_MAX {
            return Err(EngineError::invalid(format!(
                "timeout {:?} is outside 0..={:?}",
                req.timeout,
                super::REQUEST_TIMEOUT_MAX
            )));
        }
        // Preempted requests waiting to resume take no place in the queue.
        let waiting =
            self.stats
                .waiting
                .load(Ordering::Relaxed)
                .saturating_sub(self.stats.resuming.load(Ordering::Relaxed)) as usize;
        // A full queue still takes a request more urgent than its least urgent one (the loop
        // then drops that one), up to twice its bound.
        let displaces = self.policy == QueuePolicy::Edf
            && u64::from(req.rank()) < self.stats.least_urgent_waiting.load(Ordering::Relaxed);
        if waiting >= self.waiting_max
            && !(displaces && waiting < self.waiting_max.saturating_mul(2))
        {
            bump(&self.stats.shed, 1);
            return Err(EngineError::Overloaded {
                waiting,
                retry_after_ms: Some(self.stats.drain_estimate_ms.load(Ordering::Relaxed)),
            });
        }
        let (tx, rx) = crate::stream::channel();
        let prompt = req.prompt.len() as u64;
        bump(&self.stats.waiting, 1);
        self.stats.inbox_prompt_tokens.fetch_add(prompt, Ordering::SeqCst);
        // Numbered after its tokens are counted: a load read after the number counts them.
        let seq = self.stats.accepted.fetch_add(1, Ordering::SeqCst) + 1;
        self.tx.send(Submission::new(req, tx)).map_err(|_| {
            self.stats.waiting.fetch_sub(1, Ordering::Relaxed);
            self.stats.inbox_prompt_tokens.fetch_sub(prompt, Ordering::SeqCst);
            EngineError::Stopped
        })?;
        Ok((rx, seq))
    }
}

struct Seq {
    id: u64,
    /// How its blocks are named (the worker's seed, salted by the request's cache salt).
    hasher: TokenBlockHasher,
    /// Its ordering deadline ([`Submission::key`]).
    key: Instant,
    /// It was preempted before: `Started` was sent (it is not sent again).
    preempted: bool,
    /// Tokens whose KV is computed before it decodes: its prompt, or for a decode that
    /// resumes, every token but the last (which the next decode step feeds).
    prefill_to: usize,
    req: GenerateRequest,
    tx: EventTx,
    deadline: Instant,
    /// Prompt then generated tokens.
    tokens: Vec<u32>,
    /// Tokens whose KV the engine holds.
    computed: usize,
    /// Sequence hashes of the full blocks so far.
    hashes: Vec<SequenceHash>,
    /// Blocks already in the store (imported, or stored by us).
    stored: usize,
    generated: usize,
    sampler: Sampler,
    text: TextStream,
    /// Storing stopped (store full of pinned blocks).
    store_off: bool,
    /// Tier of each leading prompt block found in the store at admission; they are imported
    /// over the next iterations, a bounded number per iteration.
    import_tiers: Vec<TierKind>,
    /// Blocks imported so far.
    imported: usize,
    /// Where the imported blocks came from.
    hits: CacheHits,
    /// `Started` was sent: the imports are done and the sequence takes part in steps.
    started: bool,
    /// When it reached the engine.
    arrived: Instant,
    /// When its first step started.
    first_step: Option<Instant>,
    /// Blocks being pulled from a peer's store, which follow its cached run: it starts
    /// once they are in (or the pull failed, and it computes them).
    pull: Option<PendingPull>,
}

/// A pull from a peer ([`kvfabric::contract::generate::PullHint`]) under way.
struct PendingPull {
    /// The block index the pulled blocks start at (the end of the cached run).
    at: usize,
    task: tokio::task::JoinHandle<Vec<kvfabric_tiers::BlockRef>>,
}

impl Seq {
    fn prompt_left(&self) -> usize {
        self.prefill_to.saturating_sub(self.computed)
    }
}

struct Loop<E: Engine> {
    engine: E,
    store: TieredStore,
    runtime: tokio::runtime::Handle,
    hasher: TokenBlockHasher,
    cfg: SchedulerConfig,
    rx: std::sync::mpsc::Receiver<Submission>,
    stats: Arc<SchedulerStats>,
    codec: Arc<TextCodec>,
    waiting: Queue<Submission, Instant>,
    running: Vec<Seq>,
    next_id: u64,
    block_bytes: usize,
    host_capacity: usize,
    /// The last step ran prompt chunks without the decodes (engines whose mixed steps do
    /// not amortize): the next runs the decodes.
    decodes_deferred: bool,
    /// Prompt tokens taken in from the inbox since the last load count (they leave
    /// `inbox_prompt_tokens` once `queued_prefill_tokens` counts them).
    taken_in: u64,
    /// Measured step costs: microseconds per prompt token, and of a decode step.
    cost: StepCost,
    /// A latency class's prompt step ran while the decodes were due (they run next).
    latency_jumped: bool,
    /// The blocks each tenant with a store quota used.
    quotas: crate::quota::Ledgers,
}

/// What steps cost, measured (moving averages over the last steps): how many prompt tokens
/// fit beside a latency class's decode within its ITL target.
#[derive(Debug, Clone, Copy, Default)]
struct StepCost {
    prefill_us_per_token: Option<f64>,
    decode_step_us: Option<f64>,
}

impl StepCost {
    const ALPHA: f64 = 0.2;

    fn ewma(v: &mut Option<f64>, x: f64) {
        *v = Some(v.map_or(x, |v| v + Self::ALPHA * (x - v)));
    }

    /// A step of `prompt` prompt tokens and `decodes` decodes took `us`.
    fn observe(&mut self, prompt: usize, decodes: usize, us: f64) {
        match (prompt, decodes) {
            (0, 0) => {}
            (0, _) => Self::ewma(&mut self.decode_step_us, us),
            (p, 0) => Self::ewma(&mut self.prefill_us_per_token, us / p as f64),
            (p, _) => {
                let decode = self.decode_step_us.unwrap_or(0.0);
                Self::ewma(&mut self.prefill_us_per_token, (us - decode).max(0.0) / p as f64);
            }
        }
    }

    /// Prompt tokens a step may carry so that a decode waits at most `itl` for its next
    /// token (a step of prompt chunks then a decode step, or one mixed step): None until
    /// the costs are measured.
    fn prompt_tokens_within(&self, itl: Duration) -> Option<usize> {
        let per_token = self.prefill_us_per_token.filter(|c| *c > 0.0)?;
        let left = itl.as_secs_f64() * 1e6 - self.decode_step_us.unwrap_or(0.0);
        Some((left.max(0.0) / per_token) as usize)
    }
}

/// `hasher` with `salt` folded into its seed.
fn salted(hasher: TokenBlockHasher, salt: Option<&str>) -> TokenBlockHasher {
    match salt.filter(|s| !s.is_empty()) {
        None => hasher,
        Some(salt) => TokenBlockHasher::new(hasher.block_tokens(), hasher.seed().salted(salt)),
    }
}

enum Outcome {
    Continue,
    Finished(FinishReason),
    Failed(EngineError),
    Cancelled,
}

impl<E: Engine> Loop<E> {
    fn run(mut self) {
        loop {
            if self.running.is_empty() && self.waiting.is_empty() {
                match self.rx.recv() {
                    Ok(s) => self.take_in(s),
                    Err(_) => return,
                }
            }
            while let Ok(s) = self.rx.try_recv() {
                self.take_in(s);
            }
            self.admit();
            self.import_some();
            if self.waiting_for_pulls() {
                self.report_load();
                if let Ok(s) = self.rx.recv_timeout(Duration::from_millis(1)) {
                    self.take_in(s);
                }
                continue;
            }
            // Counted before the step too: the KV of what it admitted counts as held while the
            // step runs (the inbox's count already covers their prompts).
            self.report_load();
            if !self.running.is_empty() {
                self.step();
            }
            self.report_load();
        }
    }

    /// A submission reaches the loop's waiting queue (its tokens move from the inbox's count
    /// to the queue's at the next [`Loop::report_load`]).
    fn take_in(&mut self, s: Submission) {
        self.taken_in += s.req.prompt.len() as u64;
        self.enqueue(s, None);
        // Over the bound (a more urgent request came into a full queue): the least urgent
        // goes, told to retry when the queue should have drained. A preempted request is
        // never shed: it was admitted (its stream may have begun), and it counts against no
        // bound.
        for (_, out) in self.waiting.shed_over(self.cfg.waiting_max.max(1)) {
            self.stats.waiting.fetch_sub(1, Ordering::Relaxed);
            bump(&self.stats.shed, 1);
            tracing::debug!(class = ?out.req.class.as_ref().map(|c| &c.name), "a queued request shed for a more urgent one");
            let _ = out.tx.send(GenEvent::Error(EngineError::Overloaded {
                waiting: self.waiting.len(),
                retry_after_ms: Some(self.stats.drain_estimate_ms.load(Ordering::Relaxed)),
            }));
        }
        self.note_least_urgent();
    }

    /// Queues a submission in deadline order (after those of the same deadline), at `key`
    /// when given (a preempted request behind the one it made room for).
    fn enqueue(&mut self, s: Submission, key: Option<Key<Instant>>) {
        let mut meta = s.meta(self.cfg.policy);
        if let Some(k) = key {
            meta.key = k;
        }
        self.waiting.push(meta, s);
    }

    fn note_least_urgent(&self) {
        let rank = self.waiting.least_urgent_rank();
        self.stats.least_urgent_waiting.store(u64::from(rank), Ordering::Relaxed);
    }

    /// Answers at once every waiting request whose class's `expire` or whose own deadline
    /// has passed: none is computed too late to matter.
    fn expire_waiting(&mut self) {
        for (why, meta, w) in self.waiting.expired(Instant::now(), |w| w.tx.is_closed()) {
            self.stats.waiting.fetch_sub(1, Ordering::Relaxed);
            if meta.pinned {
                self.stats.resuming.fetch_sub(1, Ordering::Relaxed);
            }
            let timeout = match why {
                None => {
                    bump(&self.stats.cancelled, 1);
                    continue;
                }
                Some(Expiry::Class) => {
                    bump(&self.stats.expired, 1);
                    w.req.class.as_ref().and_then(|c| c.expire).unwrap_or(w.req.timeout)
                }
                Some(Expiry::Deadline) => {
                    bump(&self.stats.deadline_exceeded, 1);
                    w.req.timeout
                }
            };
            let _ = w.tx.send(GenEvent::Error(EngineError::Deadline { timeout }));
        }
    }

    /// Stops running request `i` and queues it again, behind `behind` at least (the
    /// deadline of the request it makes room for). A prefill resumes from the blocks it
    /// stored; a decode from its stored blocks too, its last, partial block computed again,
    /// and then goes on generating where it stopped (same tokens, same sampler state): its
    /// client sees a pause.
    fn preempt(&mut self, i: usize, behind: Key<Instant>) {
        let s = self.running.remove(i);
        self.engine.remove_sequence(s.id);
        self.stats.running.fetch_sub(1, Ordering::Relaxed);
        bump(&self.stats.waiting, 1);
        bump(&self.stats.resuming, 1);
        let decoding = s.generated > 0;
        if decoding {
            bump(&self.stats.preempted_decode, 1);
        } else {
            bump(&self.stats.preempted, 1);
        }
        tracing::debug!(
            seq = s.id,
            computed = s.computed,
            generated = s.generated,
            "preempted for a more urgent class"
        );
        let bt = self.hasher.block_tokens().as_usize();
        let stored = s.stored.min(s.hashes.len()) * bt;
        let to = if decoding { s.tokens.len() } else { s.prefill_to };
        let resume = Resume {
            left: to.saturating_sub(stored),
            tokens: s.tokens,
            hashes: s.hashes,
            generated: s.generated,
            sampler: s.sampler,
            text: s.text,
            first_step: s.first_step,
        };
        // Right behind the request it made room for: a decode's deadline (its TTFT's) may
        // be long past, and it must not take the slot straight back.
        let behind = behind.0.checked_add(Duration::from_nanos(1)).unwrap_or(behind.0);
        let key = Key(s.key.max(behind));
        let sub =
            Submission { req: s.req, tx: s.tx, arrived: s.arrived, resume: Some(Box::new(resume)) };
        self.enqueue(sub, Some(key));
    }

    /// With a full batch, the first waiting request that may take a running request's
    /// slot, and that running request (the admission queue's [`Queue::preemption`]: a less
    /// urgent prefill, or a less urgent decode when the waiting request would miss its TTFT
    /// target by the measured step costs).
    fn slot_to_take(&self) -> Option<(Place<Instant>, usize)> {
        let running: Vec<Running<Instant>> = self
            .running
            .iter()
            .map(|s| Running {
                rank: s.req.rank(),
                key: Key(s.key),
                generated: s.generated > 0,
                started: s.started,
            })
            .collect();
        self.waiting.preemption(&running, |meta, sub| self.would_miss(meta.key, sub))
    }

    /// Whether `head` would miss its deadline waiting for the batch to free a slot: the
    /// running request with the least work left finishes (its prompt, then every token it
    /// may still generate), then `head`'s prompt is computed, and that must be done within
    /// half of the time it has left (the estimate leaves out the steps of the others' prompt
    /// chunks: it waits only where it surely makes it). Until the costs are measured, it
    /// would.
    fn would_miss(&self, key: Key<Instant>, head: &Submission) -> bool {
        let (Some(decode_us), Some(token_us)) =
            (self.cost.decode_step_us, self.cost.prefill_us_per_token)
        else {
            return true;
        };
        let free_in_us = self
            .running
            .iter()
            .map(|s| {
                let tokens_left = s.req.max_tokens.saturating_sub(s.generated);
                s.prompt_left() as f64 * token_us + tokens_left as f64 * decode_us
            })
            .fold(f64::INFINITY, f64::min);
        let own_us = head.prefill_tokens() as f64 * token_us + decode_us;
        let ready = Duration::from_secs_f64(((free_in_us + own_us) / 1e6).clamp(0.0, 86_400.0));
        let now = Instant::now();
        ready > key.0.saturating_duration_since(now) / 2
    }

    fn report_load(&mut self) {
        // A sequence still importing counts its cached blocks as held, not as prefill work.
        let bt = self.hasher.block_tokens().as_usize();
        let active: usize = self
            .running
            .iter()
            .map(|s| if s.started { s.computed } else { s.import_tiers.len() * bt })
            .sum();
        let queued: usize = self
            .running
            .iter()
            .map(|s| {
                if s.started {
                    s.prompt_left()
                } else {
                    s.prefill_to.saturating_sub(s.import_tiers.len() * bt)
                }
            })
            .sum::<usize>()
            + self.waiting.iter().map(|(_, _, w)| w.prefill_tokens()).sum::<usize>();
        self.stats.active_tokens.store(active as u64, Ordering::Relaxed);
        self.stats.queued_prefill_tokens.store(queued as u64, Ordering::SeqCst);
        let per_token = self.cost.prefill_us_per_token.unwrap_or(0.0);
        self.stats.prefill_ns_per_token.store((per_token * 1e3) as u64, Ordering::Relaxed);
        let drain_ms = (queued as f64 * per_token / 1e3).min(3.6e6) as u64;
        self.stats.drain_estimate_ms.store(drain_ms.max(1000), Ordering::Relaxed);
        let taken = std::mem::take(&mut self.taken_in);
        self.stats.inbox_prompt_tokens.fetch_sub(taken, Ordering::SeqCst);
    }

    fn admit(&mut self) {
        self.expire_waiting();
        while !self.waiting.is_empty() {
            let (meta, sub) = if self.running.len() < self.cfg.batch_max {
                let Some(first) = self.waiting.pop_first() else { break };
                first
            } else {
                // A full batch: the first waiting request (by deadline) that may take the
                // slot of a running one does, and is admitted in its place.
                let Some((w, victim)) = self.slot_to_take() else { break };
                let Some((meta, sub)) = self.waiting.remove(w) else { break };
                self.preempt(victim, meta.key);
                (meta, sub)
            };
            self.stats.waiting.fetch_sub(1, Ordering::Relaxed);
            if meta.pinned {
                self.stats.resuming.fetch_sub(1, Ordering::Relaxed);
            }
            // `submit` bounded the timeout; a deadline past the clock's range is not one.
            let deadline = sub.arrived.checked_add(sub.req.timeout).unwrap_or_else(Instant::now);
            let id = self.next_id;
            self.next_id += 1;
            self.engine.add_sequence(id);
            let hasher = salted(self.hasher, sub.req.cache_salt.as_deref());
            let preempted = sub.resume.is_some();
            let (tokens, hashes, generated, sampler, text, first_step) = match sub.resume {
                Some(r) => (r.tokens, r.hashes, r.generated, r.sampler, r.text, r.first_step),
                None => (
                    sub.req.prompt.clone(),
                    hasher.sequence_hashes(&sub.req.prompt),
                    0,
                    Sampler::new(sub.req.sampling),
                    TextStream::new(sub.req.stop.clone()),
                    None,
                ),
            };
            // A decode that resumes computes every token but the last, which its next
            // decode step feeds.
            let prefill_to = if generated > 0 { tokens.len() - 1 } else { tokens.len() };
            let mut seq = Seq {
                id,
                hasher,
                key: meta.key.0,
                preempted,
                prefill_to,
                sampler,
                text,
                tokens,
                hashes,
                computed: 0,
                stored: 0,
                generated,
                deadline,
                tx: sub.tx,
                req: sub.req,
                store_off: false,
                import_tiers: Vec::new(),
                imported: 0,
                hits: CacheHits::default(),
                started: false,
                arrived: sub.arrived,
                first_step,
                pull: None,
            };
            seq.import_tiers = self.cached_prefix(&seq);
            seq.pull = self.start_pull(&seq);
            tracing::debug!(
                seq = id,
                prompt_tokens = seq.req.prompt.len(),
                cached_blocks = seq.import_tiers.len(),
                max_tokens = seq.req.max_tokens,
                "request admitted"
            );
            if !seq.preempted {
                bump(&self.stats.prompt_tokens, seq.req.prompt.len() as u64);
            }
            bump(&self.stats.running, 1);
            if seq.import_tiers.is_empty() && seq.pull.is_none() {
                self.start(&mut seq);
            }
            self.running.push(seq);
        }
        self.note_least_urgent();
    }
}
