//! Measuring an engine for capacity planning (`kvfabric profile`): prefill time against
//! prompt length (cold, and with a share of the prompt cached), decode inter-token latency
//! against batch size and context length, and the time to restore a context's KV from each
//! tier. The measurements drive an engine through a [`Probe`]: one in this process
//! ([`LocalProbe`], any [`Backend`]) or, in the binary, any OpenAI-compatible server over HTTP.
//! The result is an [`EngineProfile`] (JSON, versioned), from which [`EngineProfile::planning`]
//! gives the [`kvfabric_planner::sla::Profile`] that `kvfabric plan --sla` and the live planner use.
//!
//! Prompts are random token ids from a range every tokenizer has as ordinary tokens, so each
//! prompt is new to the engine's cache unless it is built to share a cached prefix; token
//! counts are exact (no tokenizer in the loop).

use std::future::Future;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvfabric::agent::{Agent, AgentConfig};
use kvfabric::events::NullSink;
use kvfabric::hash::SequenceHash;
use kvfabric::memory::RegionOptions;
use kvfabric_tiers::disk::DiskConfig;
use kvfabric_tiers::fabric::FabricNode;
use kvfabric_tiers::remote::RemoteTier;
use kvfabric_tiers::{StoreConfig, TieredStore};

use crate::backend::Backend;
use crate::engine::sampling::{SamplingParams, SplitMix64};
use crate::engine::{EngineError, GenEvent, GenerateRequest};
use kvfabric_planner::sla::{Curve, Profile};

/// The version of the profile format this build writes and reads.
pub const PROFILE_VERSION: u32 = 1;

/// Why a measurement failed.
#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    /// The engine refused or failed a request.
    #[error("engine: {0}")]
    Engine(#[from] EngineError),
    /// A request to a server failed.
    #[error("request: {0}")]
    Request(String),
    /// A request produced no token.
    #[error("a request of {prompt} prompt tokens produced no token")]
    NoTokens {
        /// Its prompt length.
        prompt: usize,
    },
    /// The store or transfer engine of a restore measurement failed.
    #[error("restore from {tier}: {message}")]
    Restore {
        /// The tier measured.
        tier: &'static str,
        /// What failed.
        message: String,
    },
    /// A profile file is unusable.
    #[error("profile: {0}")]
    Format(String),
    /// A profile file could not be read.
    #[error("reading the profile: {0}")]
    Read(#[source] std::io::Error),
}

/// One generation's timing.
#[derive(Debug, Clone)]
pub struct Trace {
    /// When it was sent.
    pub start: Instant,
    /// When each token arrived.
    pub tokens: Vec<Instant>,
    /// Prompt tokens the engine found cached.
    pub cached: usize,
}

impl Trace {
    /// Time to the first token.
    pub fn ttft(&self) -> Option<Duration> {
        self.tokens.first().map(|t| *t - self.start)
    }
}

/// Something that generates: an engine in this process, or a server.
pub trait Probe: Sync {
    /// Generates exactly `max_tokens` tokens (ignoring EOS) after `prompt`, greedily.
    fn generate(
        &self,
        prompt: Vec<u32>,
        max_tokens: usize,
    ) -> impl Future<Output = Result<Trace, ProfileError>> + Send;
}

/// A backend in this process.
#[derive(Debug, Clone)]
pub struct LocalProbe {
    backend: Arc<dyn Backend>,
    model: String,
    timeout: Duration,
}

impl LocalProbe {
    /// Probes `model` of `backend`; each request fails after `timeout`.
    pub fn new(backend: Arc<dyn Backend>, model: &str, timeout: Duration) -> Self {
        LocalProbe { backend, model: model.to_string(), timeout }
    }
}

impl Probe for LocalProbe {
    fn generate(
        &self,
        prompt: Vec<u32>,
        max_tokens: usize,
    ) -> impl Future<Output = Result<Trace, ProfileError>> + Send {
        let req = GenerateRequest {
            prompt,
            max_tokens,
            sampling: SamplingParams::default(),
            stop: Vec::new(),
            ignore_eos: true,
            timeout: self.timeout,
            class: None,
            cache_salt: None,
            tenant: None,
            pull: None,
        };
        let prompt_len = req.prompt.len();
        let start = Instant::now();
        let rx = self.backend.submit(&self.model, req);
        async move {
            let mut rx = rx?;
            let mut trace = Trace { start, tokens: Vec::with_capacity(max_tokens), cached: 0 };
            while let Some(ev) = rx.recv().await {
                match ev {
                    GenEvent::Started { cached, .. } => trace.cached = cached.total(),
                    GenEvent::Cached(c) => trace.cached = c.total(),
                    GenEvent::Token { .. } => trace.tokens.push(Instant::now()),
                    GenEvent::Done { .. } => break,
                    GenEvent::Error(e) => return Err(e.into()),
                    // A backend's own submit never numbers requests (only a worker's port).
                    GenEvent::Accepted { .. } => {}
                }
            }
            if trace.tokens.is_empty() {
                return Err(ProfileError::NoTokens { prompt: prompt_len });
            }
            Ok(trace)
        }
    }
}

/// What to measure.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Prompt lengths of the prefill measurements, tokens.
    pub prompts: Vec<usize>,
    /// Shares of the prompt cached in the second set of prefill measurements (0 < h < 1).
    pub cached_shares: Vec<f64>,
    /// Decode batch sizes.
    pub batches: Vec<usize>,
    /// Context lengths (prompt tokens) of the decode measurements.
    pub contexts: Vec<usize>,
    /// Tokens generated per sequence in a decode measurement.
    pub decode_tokens: usize,
    /// Repetitions of each prefill measurement (the median is kept).
    pub reps: usize,
    /// Token ids of the random prompts: `lo..hi`.
    pub token_ids: (u32, u32),
    /// Tokens per KV block (cached prefixes are whole blocks).
    pub block_tokens: usize,
    /// Seed of the prompts.
    pub seed: u64,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            prompts: vec![128, 512, 1024, 2048],
            cached_shares: vec![0.5],
            batches: vec![1, 2, 4, 8],
            contexts: vec![256, 1024],
            decode_tokens: 32,
            reps: 3,
            // Printable byte-level tokens in byte-level BPE vocabularies, ordinary tokens in
            // any vocabulary of 256 or more (no special tokens below 32 in the ones we know
            // of, none at all above).
            token_ids: (40, 250),
            block_tokens: 16,
            seed: 1,
        }
    }
}

/// A prefill measurement.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PrefillPoint {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// The share of the prompt sent to be found cached (0: a cold prefill).
    #[serde(default)]
    pub cached_share: f64,
    /// Of them, found cached (as the engine reported; a server that does not report its
    /// cache hits says 0).
    pub cached_tokens: usize,
    /// Median time to the first token, seconds.
    pub ttft_s: f64,
    /// Repetitions.
    pub reps: usize,
}

/// A decode measurement.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct DecodePoint {
    /// Sequences decoding together.
    pub batch: usize,
    /// Their context length: the prompt and half the --decode-tokens, tokens (a run that had
    /// to generate more to overlap is filed under the same context).
    pub context: usize,
    /// Median inter-token latency while all of them decode, seconds.
    pub itl_s: f64,
    /// Tokens per second of the batch (`batch / itl`).
    pub tokens_per_s: f64,
    /// Inter-token gaps measured.
    pub samples: usize,
}

/// A restore measurement: a context's KV from one tier into memory the engine reads.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RestorePoint {
    /// `host`, `disk` or `fabric`.
    pub tier: String,
    /// Context length, tokens.
    pub context: usize,
    /// Blocks.
    pub blocks: usize,
    /// Bytes.
    pub bytes: u64,
    /// Median seconds.
    pub seconds: f64,
    /// GB/s.
    pub gbps: f64,
}

/// Straight lines through the measurements: the parameters of a linear engine model.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Fit {
    /// Prefill seconds per computed prompt token (the slope of cold TTFT).
    pub prefill_s_per_token: f64,
    /// Fixed seconds of a request (cold TTFT at zero tokens).
    pub prefill_s_fixed: f64,
    /// Fixed seconds of a decode step (ITL at no KV).
    pub decode_step_s: f64,
    /// Decode seconds per token of KV in the batch (ITL's slope in batch × context).
    pub decode_s_per_kv_token: f64,
    /// Seconds a cached prompt token adds to TTFT (restoring it instead of computing it).
    pub restore_s_per_cached_token: f64,
}

/// An engine's measured profile.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct EngineProfile {
    /// [`PROFILE_VERSION`].
    pub version: u32,
    /// What was measured (the engine in this process, or a URL).
    pub source: String,
    /// The model id.
    pub model: String,
    /// When, seconds since the Unix epoch.
    pub created_unix_s: u64,
    /// Tokens per KV block.
    pub block_tokens: usize,
    /// KV bytes per token (0: unknown, for a server whose layout was not given).
    pub kv_bytes_per_token: u64,
    /// Largest decode batch the engine runs.
    pub batch_max: usize,
    /// Prefill measurements.
    pub prefill: Vec<PrefillPoint>,
    /// Decode measurements.
    pub decode: Vec<DecodePoint>,
    /// Restore measurements.
    pub restore: Vec<RestorePoint>,
    /// The linear model through them.
    pub fit: Fit,
}

/// Least squares `y = a + b x`; None with fewer than two distinct `x`.
pub fn linear_fit(points: &[(f64, f64)]) -> Option<(f64, f64)> {
    let n = points.len() as f64;
    if points.len() < 2 {
        return None;
    }
    let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
    let my = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = points.iter().map(|p| (p.0 - mx) * (p.0 - mx)).sum();
    if sxx <= 0.0 {
        return None;
    }
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let b = sxy / sxx;
    Some((my - b * mx, b))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// What a measurement step reports as it goes.
#[derive(Debug, Clone)]
pub enum Step {
    /// The number of requests (or restores) the whole run makes.
    Total(u64),
    /// One done, and what it was.
    Done(String),
}

struct Prompts {
    rng: SplitMix64,
    lo: u32,
    span: u64,
}

impl Prompts {
    fn new(s: &Settings) -> Self {
        let (lo, hi) = s.token_ids;
        Prompts { rng: SplitMix64(s.seed), lo, span: u64::from(hi.saturating_sub(lo).max(1)) }
    }

    fn fresh(&mut self, n: usize) -> Vec<u32> {
        (0..n).map(|_| self.lo + (self.rng.next_u64() % self.span) as u32).collect()
    }
}

/// Measures prefill and decode through `probe`.
pub async fn measure<P: Probe>(
    probe: &P,
    s: &Settings,
    batch_max: usize,
    mut progress: impl FnMut(Step),
) -> Result<(Vec<PrefillPoint>, Vec<DecodePoint>), ProfileError> {
    let reps = s.reps.max(1);
    let batches: Vec<usize> =
        s.batches.iter().copied().filter(|&b| b >= 1 && b <= batch_max.max(1)).collect();
    let total = 1
        + s.prompts.len() * reps * (1 + 2 * s.cached_shares.len())
        + batches.len() * s.contexts.len();
    progress(Step::Total(total as u64));
    let mut prompts = Prompts::new(s);
    // Warm up (first-request costs: connections, lazy allocations).
    probe.generate(prompts.fresh(s.block_tokens.max(8)), 2).await?;
    progress(Step::Done("warm-up".into()));

    let mut prefill = Vec::new();
    for &len in &s.prompts {
        let len = len.max(1);
        let mut cold = Vec::new();
        for _ in 0..reps {
            let t = probe.generate(prompts.fresh(len), 1).await?;
            cold.push(t.ttft().ok_or(ProfileError::NoTokens { prompt: len })?.as_secs_f64());
            progress(Step::Done(format!("prefill {len} tokens")));
        }
        prefill.push(PrefillPoint {
            prompt_tokens: len,
            cached_share: 0.0,
            cached_tokens: 0,
            ttft_s: median(cold),
            reps,
        });
        for &share in &s.cached_shares {
            let bt = s.block_tokens.max(1);
            let shared = ((len as f64 * share.clamp(0.0, 1.0)) as usize / bt * bt).min(len - 1);
            let (mut ttfts, mut cached) = (Vec::new(), Vec::new());
            for _ in 0..reps {
                let first = prompts.fresh(len);
                probe.generate(first.clone(), 1).await?;
                progress(Step::Done(format!("prefill {len} tokens to cache")));
                let mut second = first[..shared].to_vec();
                second.extend(prompts.fresh(len - shared));
                let t = probe.generate(second, 1).await?;
                ttfts.push(t.ttft().ok_or(ProfileError::NoTokens { prompt: len })?.as_secs_f64());
                cached.push(t.cached as f64);
                progress(Step::Done(format!("prefill {len} tokens, {shared} cached")));
            }
            prefill.push(PrefillPoint {
                prompt_tokens: len,
                cached_share: shared as f64 / len as f64,
                cached_tokens: median(cached) as usize,
                ttft_s: median(ttfts),
                reps,
            });
        }
    }

    let mut decode = Vec::new();
    for &ctx in &s.contexts {
        for &b in &batches {
            // All `b` must decode together for a while: when the last one's first token
            // comes after the first one's last (its prefill took that long), the run is
            // repeated with twice the tokens, up to 32× (a busy machine stretches prefills:
            // CI saw 16 sequences of 1,024 tokens not overlap at 8×).
            let mut n = s.decode_tokens.max(4);
            let mut gaps = Vec::new();
            for attempt in 0..6 {
                let runs = (0..b).map(|_| probe.generate(prompts.fresh(ctx.max(1)), n));
                let traces = futures_util::future::try_join_all(runs).await?;
                gaps = steady_gaps(&traces);
                if gaps.len() >= 2 * b || attempt == 5 {
                    break;
                }
                n *= 2;
            }
            let samples = gaps.len();
            let itl = median(gaps);
            if !(itl.is_finite() && itl > 0.0) {
                return Err(ProfileError::Request(format!(
                    "decode at batch {b}, context {ctx}: the {b} sequences never decoded together, even with {n} tokens each (more --decode-tokens?)"
                )));
            }
            decode.push(DecodePoint {
                batch: b,
                // Nominal (the planned tokens), so that the points of one context group.
                context: ctx + s.decode_tokens.max(4) / 2,
                itl_s: itl,
                tokens_per_s: b as f64 / itl,
                samples,
            });
            progress(Step::Done(format!("decode batch {b} at {ctx} tokens")));
        }
    }
    Ok((prefill, decode))
}

/// The inter-token gaps while every trace decodes: from the last first token to the first
/// last token.
fn steady_gaps(traces: &[Trace]) -> Vec<f64> {
    let from = traces.iter().filter_map(|t| t.tokens.first()).max().copied();
    let to = traces.iter().filter_map(|t| t.tokens.last()).min().copied();
    let (Some(from), Some(to)) = (from, to) else { return Vec::new() };
    traces
        .iter()
        .flat_map(|t| t.tokens.windows(2))
        .filter(|w| w[0] >= from && w[1] <= to)
        .map(|w| (w[1] - w[0]).as_secs_f64())
        .collect()
}

/// Measures restoring contexts of `contexts` tokens from host memory, a disk tier (files in
/// `dir`) and a fabric node (another agent in this process, over TCP), in blocks of
/// `block_bytes` holding `block_tokens` tokens: the blocks are stored, then brought into host
/// memory and copied out into a buffer as an engine would read them; median of `reps`.
pub async fn measure_restore(
    block_bytes: u64,
    block_tokens: usize,
    contexts: &[usize],
    tiers: &[&str],
    dir: &Path,
    reps: usize,
    mut progress: impl FnMut(Step),
) -> Result<Vec<RestorePoint>, ProfileError> {
    let reps = reps.max(1);
    progress(Step::Total((contexts.len() * tiers.len() * reps) as u64));
    let err = |tier: &'static str| {
        move |e: &dyn std::fmt::Display| ProfileError::Restore { tier, message: e.to_string() }
    };
    let agent = Agent::start(AgentConfig::new("profile-restore", b"profile".to_vec()))
        .await
        .map_err(|e| err("host")(&e))?;
    let mut out = Vec::new();
    let mut base = 0u64;
    for &ctx in contexts {
        let n = ctx.div_ceil(block_tokens.max(1)).max(1);
        let bytes = n as u64 * block_bytes;
        // Every block lands in its own place, as in an engine's KV memory (touched first, so
        // that no page fault is timed).
        let mut dst = vec![1u8; bytes as usize];
        for &tier in tiers {
            let tier: &'static str = match tier {
                "host" => "host",
                "disk" => "disk",
                "fabric" => "fabric",
                other => {
                    return Err(ProfileError::Format(format!(
                        "unknown tier {other:?} (host, disk, fabric)"
                    )))
                }
            };
            let mut times = Vec::new();
            for _ in 0..reps {
                base += 1 << 32;
                let hashes: Vec<SequenceHash> =
                    (0..n as u64).map(|i| SequenceHash(base + i)).collect();
                let t = match tier {
                    "host" => restore_host(&agent, block_bytes, &hashes, &mut dst).await,
                    "disk" => restore_disk(&agent, block_bytes, &hashes, dir, &mut dst).await,
                    _ => restore_fabric(block_bytes, &hashes).await,
                }
                .map_err(|e| err(tier)(&e))?;
                times.push(t.as_secs_f64());
                progress(Step::Done(format!("restore {ctx} tokens from {tier}")));
            }
            let seconds = median(times);
            out.push(RestorePoint {
                tier: tier.to_string(),
                context: ctx,
                blocks: n,
                bytes,
                seconds,
                gbps: bytes as f64 / seconds.max(1e-12) / 1e9,
            });
        }
    }
    agent.shutdown();
    Ok(out)
}

type AnyError = Box<dyn std::error::Error + Send + Sync>;

async fn fill_store(
    store: &TieredStore,
    hashes: &[SequenceHash],
    bytes: u64,
) -> Result<(), AnyError> {
    let mut buf = vec![0u8; bytes as usize];
    let mut parent = None;
    for &h in hashes {
        kvfabric_tiers::synthetic::fill(h, &mut buf);
        store.put(h, parent, &buf).await?;
        parent = Some(h);
    }
    Ok(())
}

/// Pins the chain and copies every block out, block `i` to `dst[i * block_bytes..]`.
async fn get_and_copy(
    store: &TieredStore,
    hashes: &[SequenceHash],
    dst: &mut [u8],
) -> Result<Duration, AnyError> {
    let t = Instant::now();
    let refs = store.get(hashes).await?;
    if refs.len() != hashes.len() {
        return Err(format!("{} of {} blocks restored", refs.len(), hashes.len()).into());
    }
    for (r, out) in refs.iter().zip(dst.chunks_mut(store.block_bytes() as usize)) {
        r.read(out)?;
    }
    Ok(t.elapsed())
}

async fn restore_host(
    agent: &Agent,
    block_bytes: u64,
    hashes: &[SequenceHash],
    dst: &mut [u8],
) -> Result<Duration, AnyError> {
    let mut cfg = StoreConfig::new(block_bytes, hashes.len() as u32 + 1);
    cfg.shared_host = false;
    let store = TieredStore::open(cfg, agent, Arc::new(NullSink)).await?;
    fill_store(&store, hashes, block_bytes).await?;
    get_and_copy(&store, hashes, dst).await
}

async fn restore_disk(
    agent: &Agent,
    block_bytes: u64,
    hashes: &[SequenceHash],
    dir: &Path,
    dst: &mut [u8],
) -> Result<Duration, AnyError> {
    std::fs::create_dir_all(dir)?;
    let path = dir.join(format!("profile-restore-{}.slots", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let n = hashes.len() as u32;
    let mut disk = DiskConfig::new(&path, n);
    disk.grow_blocks = n;
    let mut cfg = StoreConfig::new(block_bytes, n + 1).with_disk(disk);
    cfg.disk_admit_min_hits = 0;
    cfg.shared_host = false;
    let r = async {
        {
            let store = TieredStore::open(cfg.clone(), agent, Arc::new(NullSink)).await?;
            fill_store(&store, hashes, block_bytes).await?;
            let written = store.offload(hashes).await?;
            if written != hashes.len() {
                return Err(format!("{written} of {} blocks written", hashes.len()).into());
            }
        }
        // A store opened again finds the blocks on disk only.
        let store = TieredStore::open(cfg, agent, Arc::new(NullSink)).await?;
        get_and_copy(&store, hashes, dst).await
    }
    .await;
    let _ = std::fs::remove_file(&path);
    r
}

async fn restore_fabric(block_bytes: u64, hashes: &[SequenceHash]) -> Result<Duration, AnyError> {
    let secret = b"profile-fabric".to_vec();
    let mut node_cfg = AgentConfig::new("profile-fabric-node", secret.clone());
    node_cfg.shm = false;
    let node_agent = Agent::start(node_cfg).await?;
    let mut cfg = StoreConfig::new(block_bytes, hashes.len() as u32 + 1);
    cfg.shared_host = false;
    let node_store = TieredStore::open(cfg, &node_agent, Arc::new(NullSink)).await?;
    fill_store(&node_store, hashes, block_bytes).await?;
    let node = FabricNode::serve(node_agent.clone(), node_store, Duration::from_secs(30));
    let mut client_cfg = AgentConfig::new("profile-fabric-client", secret);
    client_cfg.shm = false; // the network path, as between hosts
    let client = Agent::start(client_cfg).await?;
    let r = async {
        let n = hashes.len();
        let region = client.alloc_region(
            n * block_bytes as usize,
            RegionOptions { export: true, ..Default::default() },
        )?;
        let remote = RemoteTier::new(client.clone(), Duration::from_secs(30));
        remote.add_node(&node.info()).await?;
        let locs: Vec<_> = (0..n as u64).map(|i| (region.id(), i * block_bytes)).collect();
        let t = Instant::now();
        let served = remote.get(hashes, &locs).await?;
        let d = t.elapsed();
        if !served.iter().all(|&s| s) {
            return Err("a block was not served".into());
        }
        Ok(d)
    }
    .await;
    client.shutdown();
    node_agent.shutdown();
    r
}

impl EngineProfile {
    /// Puts measurements together, fitting the linear model.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        source: String,
        model: String,
        block_tokens: usize,
        kv_bytes_per_token: u64,
        batch_max: usize,
        prefill: Vec<PrefillPoint>,
        decode: Vec<DecodePoint>,
        restore: Vec<RestorePoint>,
    ) -> Self {
        let cold: Vec<(f64, f64)> = prefill
            .iter()
            .filter(|p| p.cached_share == 0.0)
            .map(|p| (p.prompt_tokens as f64, p.ttft_s))
            .collect();
        let (prefill_s_fixed, prefill_s_per_token) = linear_fit(&cold).unwrap_or((0.0, 0.0));
        let kv: Vec<(f64, f64)> =
            decode.iter().map(|d| ((d.batch * d.context) as f64, d.itl_s)).collect();
        let (decode_step_s, decode_s_per_kv_token) =
            linear_fit(&kv).or_else(|| kv.first().map(|&(_, y)| (y, 0.0))).unwrap_or((0.0, 0.0));
        let restores: Vec<f64> = prefill
            .iter()
            .filter(|p| p.cached_share > 0.0 && p.cached_tokens > 0)
            .map(|p| {
                let computed = (p.prompt_tokens - p.cached_tokens.min(p.prompt_tokens)) as f64;
                let compute = prefill_s_fixed + prefill_s_per_token * computed;
                ((p.ttft_s - compute) / p.cached_tokens as f64).max(0.0)
            })
            .collect();
        let restore_s_per_cached_token = if restores.is_empty() { 0.0 } else { median(restores) };
        let created_unix_s = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        EngineProfile {
            version: PROFILE_VERSION,
            source,
            model,
            created_unix_s,
            block_tokens,
            kv_bytes_per_token,
            batch_max,
            prefill,
            decode,
            restore,
            fit: Fit {
                prefill_s_per_token,
                prefill_s_fixed,
                decode_step_s,
                decode_s_per_kv_token,
                restore_s_per_cached_token,
            },
        }
    }

    /// Reads a profile file ([`Self::from_json`]); errors do not name the path (callers do).
    pub fn read(path: &Path) -> Result<Self, ProfileError> {
        Self::from_json(&std::fs::read_to_string(path).map_err(ProfileError::Read)?)
    }

    /// Reads a profile, refusing other versions and unusable contents.
    pub fn from_json(text: &str) -> Result<Self, ProfileError> {
        let v: serde_json::Value =
            serde_json::from_str(text).map_err(|e| ProfileError::Format(e.to_string()))?;
        let version = v.get("version").and_then(|v| v.as_u64());
        if version != Some(u64::from(PROFILE_VERSION)) {
            return Err(ProfileError::Format(format!(
                "version {version:?}; this build reads version {PROFILE_VERSION}"
            )));
        }
        let p: EngineProfile =
            serde_json::from_value(v).map_err(|e| ProfileError::Format(e.to_string()))?;
        p.planning()?;
        Ok(p)
    }

    /// The curves planning needs: cold prefill time against computed tokens; ITL against
    /// batch size per context length; the restore cost of a cached token.
    pub fn planning(&self) -> Result<Profile, ProfileError> {
        let bad = |what: &str| ProfileError::Format(format!("{what}: no usable measurement"));
        let ok = |x: f64| x.is_finite() && x >= 0.0;
        let prefill_s = Curve::new(
            self.prefill
                .iter()
                .filter(|p| p.cached_share == 0.0 && ok(p.ttft_s))
                .map(|p| (p.prompt_tokens as f64, p.ttft_s))
                .collect(),
        )
        .ok_or_else(|| bad("prefill"))?;
        let mut contexts: Vec<usize> = self.decode.iter().map(|d| d.context).collect();
        contexts.sort_unstable();
        contexts.dedup();
        let itl_s = contexts
            .iter()
            .filter_map(|&c| {
                let pts = self
                    .decode
                    .iter()
                    .filter(|d| d.context == c && ok(d.itl_s) && d.itl_s > 0.0)
                    .map(|d| (d.batch as f64, d.itl_s))
                    .collect();
                Curve::new(pts).map(|curve| (c as f64, curve))
            })
            .collect::<Vec<_>>();
        if itl_s.is_empty() {
            return Err(bad("decode"));
        }
        if self.batch_max > kvfabric_planner::sla::BATCH_MAX as usize {
            return Err(ProfileError::Format(format!(
                "batch_max {} is above {}",
                self.batch_max,
                kvfabric_planner::sla::BATCH_MAX
            )));
        }
        let restore = self.fit.restore_s_per_cached_token;
        Ok(Profile {
            prefill_s,
            itl_s,
            batch_max: u32::try_from(self.batch_max.max(1))
                .unwrap_or(kvfabric_planner::sla::BATCH_MAX),
            kv_bytes_per_token: self.kv_bytes_per_token,
            restore_s_per_token: if ok(restore) { restore } else { 0.0 },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn straight_lines() {
        let (a, b) = linear_fit(&[(0.0, 1.0), (1.0, 3.0), (2.0, 5.0)]).unwrap();
        assert!((a - 1.0).abs() < 1e-12 && (b - 2.0).abs() < 1e-12);
        assert!(linear_fit(&[(1.0, 1.0), (1.0, 2.0)]).is_none());
        assert!(linear_fit(&[(1.0, 1.0)]).is_none());
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), 2.5);
    }

    #[test]
    fn profiles_of_another_version_or_without_curves_are_refused() {
        let p = EngineProfile::new(
            "test".into(),
            "m".into(),
            16,
            8192,
            8,
            vec![
                PrefillPoint {
                    prompt_tokens: 100,
                    cached_share: 0.0,
                    cached_tokens: 0,
                    ttft_s: 0.005,
                    reps: 1,
                },
                PrefillPoint {
                    prompt_tokens: 200,
                    cached_share: 0.0,
                    cached_tokens: 0,
                    ttft_s: 0.009,
                    reps: 1,
                },
                PrefillPoint {
                    prompt_tokens: 200,
                    cached_share: 0.48,
                    cached_tokens: 96,
                    ttft_s: 0.0058,
                    reps: 1,
                },
            ],
            vec![
                DecodePoint {
                    batch: 1,
                    context: 100,
                    itl_s: 0.01,
                    tokens_per_s: 100.0,
                    samples: 9,
                },
                DecodePoint {
                    batch: 4,
                    context: 100,
                    itl_s: 0.02,
                    tokens_per_s: 200.0,
                    samples: 9,
                },
            ],
            vec![],
        );
        // 4 ms per 100 tokens, 1 ms fixed; 104 computed tokens take 5.16 ms; the 96 cached
        // add 0.64 ms: 6.67 µs each.
        assert!((p.fit.prefill_s_per_token - 40e-6).abs() < 1e-12);
        assert!((p.fit.prefill_s_fixed - 1e-3).abs() < 1e-12);
        assert!((p.fit.restore_s_per_cached_token - 0.64e-3 / 96.0).abs() < 1e-9);
        let text = serde_json::to_string(&p).unwrap();
        assert_eq!(EngineProfile::from_json(&text).unwrap(), p);
        let planning = p.planning().unwrap();
        assert_eq!(planning.itl_s.len(), 1);
        assert_eq!(planning.batch_max, 8);
        let other = text.replace("\"version\":1", "\"version\":2");
        assert!(
            matches!(EngineProfile::from_json(&other), Err(ProfileError::Format(m)) if m.contains("version"))
        );
        let empty = EngineProfile { decode: vec![], ..p.clone() };
        let text = serde_json::to_string(&empty).unwrap();
        assert!(
            matches!(EngineProfile::from_json(&text), Err(ProfileError::Format(m)) if m.contains("decode"))
        );
        assert!(EngineProfile::from_json("{").is_err());
        let huge = EngineProfile { batch_max: 1 << 40, ..p.clone() };
        let text = serde_json::to_string(&huge).unwrap();
        assert!(
            matches!(EngineProfile::from_json(&text), Err(ProfileError::Format(m)) if m.contains("batch_max"))
        );
        // A curve without points in a file is refused when read, not a panic when used.
        let bad = r#"{"prefill_s":{"points":[]},"itl_s":[],"batch_max":1,"kv_bytes_per_token":0}"#;
        assert!(serde_json::from_str::<Profile>(bad).is_err());
    }
}
