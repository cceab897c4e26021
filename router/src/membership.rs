//! Who a routing frontend can send requests to, and what each of them carries: workers and
//! fabric nodes joining and leaving discovery, their load reports off the bus, the workers
//! avoided (slow, refused, of another protocol version), one routing policy per model, and
//! the choice of a worker for a request.
//!
//! [`Membership`] is the router *service*'s state, model-agnostic: it knows a model by its
//! [`ModelInfo`] and the [`CodecSpec`] its workers registered, never a tokenizer. What a
//! frontend must prepare before a worker may join (loading its tokenizer), check after (a
//! handshake) and forget after it leaves (kept connections) it says through [`Admission`].
//! The frontend (`kvfabric-serving`'s routed backend) sends requests and relays their events;
//! a gateway that embeds this crate needs no model runtime.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvfabric::contract::discovery::{
    CodecSpec, ModelInfo, NodeInfo, Role, WorkerApi, WorkerMetadata, FABRIC_KIND,
};
use kvfabric::contract::{self, Message, WorkerStats};
use kvfabric::control::{ControlError, Discovery, DiscoveryEvent, EventBus, Instance};
use kvfabric::hash::{HashSeed, TokenBlockHasher};
use kvfabric::rng::SplitMix64;
use parking_lot::Mutex;

use crate::feed::{worker_id, FeedStats, IndexFeed};
use crate::{Load, PrefixIndex, Router, RouterConfig, Run, WorkerId};

/// A worker whose handshake failed on the secret is left out of routing this long, then
/// tried again (its operator may have fixed the secret).
pub const REFUSED_RETRY: Duration = Duration::from_secs(30);

/// How long a worker of another protocol version stays out of routing: until it registers
/// again (a re-registration is a new join).
pub const INCOMPATIBLE_FOR: Duration = Duration::from_secs(10 * 365 * 24 * 3600);

/// Departed workers are kept this long for dashboards, and this many at most.
pub const DEPARTED_KEEP: Duration = Duration::from_secs(300);
const DEPARTED_MAX: usize = 64;
/// A draining worker whose reports stopped this long ago has drained.
pub const REPORTS_STOPPED: Duration = Duration::from_secs(2);

/// Reporters kept at most (names come from the bus), and their names' length at most.
const REPORTERS_MAX: usize = 256;
const NAME_MAX: usize = 128;
/// A reporter whose reports stopped this long ago is forgotten.
const REPORTER_KEEP: Duration = Duration::from_secs(10);

/// Fabric nodes kept at most (names come from discovery).
const FABRIC_MAX: usize = 256;

/// How one request is routed ([`Membership::route_with`]).
#[derive(Debug, Clone, Copy)]
pub struct RouteOptions<'a> {
    /// The salt of its blocks' names (its tenant's namespace, its `cache_salt`).
    pub salt: Option<&'a str>,
    /// The weight of cache reuse against queue delay, 0..=1 (1: as configured).
    pub reuse: f64,
}

impl Default for RouteOptions<'_> {
    fn default() -> Self {
        RouteOptions { salt: None, reuse: 1.0 }
    }
}

/// What a membership is told.
#[derive(Debug, Clone)]
pub struct MembershipConfig {
    /// Routing policy settings (the mode among them); `block_tokens` is taken from each model.
    pub router: RouterConfig,
    /// The frontend's name (dump requests go out as coming from it).
    pub name: String,
    /// The discovery kind of the workers it routes to.
    pub kind: String,
    /// How long a worker that did not answer in time is avoided (while others exist).
    pub slow_penalty: Duration,
}

/// What the frontend does around a worker's membership.
pub trait Admission: Send + Sync + 'static {
    /// Before a worker joins: prepares what requests for it need (its tokenizer). An error,
    /// with its reason, leaves the worker out (logged once).
    fn admit(
        &self,
        name: &str,
        md: &WorkerMetadata,
    ) -> impl Future<Output = Result<(), String>> + Send;
    /// A worker that speaks this frontend's protocol joined: check it (a handshake in the
    /// background; a refusal comes back through [`Membership::refuse`]).
    fn joined(&self, name: &str, addr: SocketAddr);
    /// A worker left discovery: forget what was kept for it.
    fn left(&self, name: &str, addr: SocketAddr);
}

/// A worker in discovery, as routing and dashboards know it.
#[derive(Debug, Clone)]
pub struct WorkerEntry {
    /// Its id in routing.
    pub wid: WorkerId,
    /// Its request port.
    pub addr: SocketAddr,
    /// How requests reach it.
    pub api: WorkerApi,
    /// The model it serves.
    pub model: String,
    /// Requests sent to it.
    pub served: u64,
    /// Avoided until then: it did not answer in time (connection, handshake, first token).
    pub penalty_until: Option<Instant>,
    /// Not routed to until then, and why: it refused our secret (or we refused its), so no
    /// request can reach it; tried again after [`REFUSED_RETRY`].
    pub refused: Option<(Instant, String)>,
    /// Its role, as a dashboard names it.
    pub role: &'static str,
    /// Its last load report.
    pub load: Load,
    /// Its last report's statistics.
    pub stats: Option<Box<WorkerStats>>,
    /// When its last report came, and how old it was on arrival (ms).
    pub reported: Option<(Instant, Option<f64>)>,
}

impl WorkerEntry {
    /// Why it cannot be reached now, if it cannot.
    pub fn refused_now(&self, now: Instant) -> Option<&str> {
        self.refused.as_ref().filter(|(t, _)| *t > now).map(|(_, why)| why.as_str())
    }
}

/// A worker that left discovery, kept a few minutes for dashboards.
#[derive(Debug)]
pub struct Departed {
    /// Its instance name.
    pub name: String,
    /// When it left.
    pub left: Instant,
    /// What was known of it, its reports since included.
    pub entry: WorkerEntry,
}

/// A model served by at least one worker.
#[derive(Debug)]
pub struct ModelState {
    /// The model, as its first worker registered it.
    pub info: ModelInfo,
    /// How its prompts are tokenized.
    pub codec: CodecSpec,
    /// Its workers.
    pub workers: usize,
    router: Router,
    hasher: TokenBlockHasher,
}

/// A worker this frontend does not route to but hears report (a prefill worker), for
/// dashboards; forgotten when its reports stop.
#[derive(Debug)]
pub struct Reporter {
    /// Its last load report.
    pub load: Load,
    /// Its last report's statistics.
    pub stats: Box<WorkerStats>,
    /// When it came.
    pub at: Instant,
}

/// A KV fabric node in discovery (`kvfabric fabric`): never routed to. Its KV events fill the
/// index (so they are not "unknown", and the cache map sees what it holds), and its load
/// reports (role `fabric`: tier occupancy, transfers) show on dashboards.
#[derive(Debug)]
pub struct FabricEntry {
    /// Its id in the index.
    pub wid: WorkerId,
    /// Its transfer agent's address.
    pub addr: SocketAddr,
    /// Bytes per block it stores: workers of another block size ignore it.
    pub block_bytes: u64,
    /// Its last report's statistics.
    pub stats: Option<Box<WorkerStats>>,
    /// When its last report came.
    pub reported: Option<Instant>,
}

/// Everything a membership knows, as [`Membership::read`] shows it.
#[derive(Debug, Default)]
pub struct Members {
    /// Workers in discovery, by instance name.
    pub workers: HashMap<String, WorkerEntry>,
    /// Fabric nodes in discovery, by instance name.
    pub fabric: HashMap<String, FabricEntry>,
    /// Workers heard on the bus but not routed to (prefill workers).
    pub reporters: HashMap<String, Reporter>,
    /// Workers that left lately, the latest last.
    pub departed: VecDeque<Departed>,
    /// Models served, by id.
    pub models: HashMap<String, ModelState>,
    /// Models whose last worker left lately (a restart of a one-worker pool): their
    /// description and when, for [`VACATED_KEEP`]. Requests for them wait for a worker.
    pub vacated: HashMap<String, (ModelInfo, CodecSpec, Instant)>,
    by_id: HashMap<WorkerId, String>,
}

/// How long a model whose last worker left is still accepted: its requests wait (within
/// their deadline) for a worker to join, as in a rolling restart of a one-worker pool.
pub const VACATED_KEEP: Duration = Duration::from_secs(60);

/// Models remembered as vacated, at most.
const VACATED_MAX: usize = 64;

/// The worker chosen for a request.
#[derive(Debug, Clone)]
pub struct Pick {
    /// Where its prefix comes from.
    pub path: crate::policy::Path,
    /// The peer to pull the prefix from, when pulling beats computing.
    pub pull: Option<kvfabric::contract::generate::PullHint>,
    /// Its instance name.
    pub name: String,
    /// Its request port.
    pub addr: SocketAddr,
    /// How the request reaches it.
    pub api: WorkerApi,
}

/// Why a worker is left out of routing ([`Membership::refuse`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The handshake failed on the secret: tried again after [`REFUSED_RETRY`].
    Secret,
    /// It speaks another protocol version: out until it registers again.
    Version,
}

/// A worker's name, leading cached run, cost, load and cost terms (prefill blocks, decode
/// load, queued prefill), for explaining a route.
pub type Scored = (String, Run, f64, Load, [f64; 3]);

/// Every worker of a model scored for a prompt ([`Membership::scores`]).
#[derive(Debug)]
pub struct Scores {
    /// The prompt's full blocks.
    pub blocks: usize,
    /// Tokens per block of the model.
    pub block_tokens: kvfabric::units::BlockTokens,
    /// Each worker's score.
    pub workers: Vec<Scored>,
}

#[derive(Debug)]
struct Shared {
    cfg: MembershipConfig,
    bus: Arc<dyn EventBus>,
    index: Arc<PrefixIndex>,
    feed: IndexFeed,
    members: Mutex<Members>,
    rng: Mutex<SplitMix64>,
    epoch: Instant,
}

/// The router service's view of discovery and the bus. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Membership {
    s: Arc<Shared>,
}

impl Membership {
    /// Starts the index's feed of KV events from `bus`; nobody is a member until
    /// [`Membership::follow`].
    pub async fn new(bus: Arc<dyn EventBus>, cfg: MembershipConfig) -> Result<Self, ControlError> {
        let index = Arc::new(PrefixIndex::new());
        let feed = IndexFeed::start(bus.clone(), index.clone(), cfg.name.clone()).await?;
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64);
        Ok(Membership {
            s: Arc::new(Shared {
                cfg,
                bus,
                index,
                feed,
                members: Mutex::new(Members::default()),
                rng: Mutex::new(SplitMix64(seed)),
                epoch: Instant::now(),
            }),
        })
    }

    /// Watches discovery's workers and fabric nodes and the bus's load reports; returns once
    /// the workers and nodes registered now are members, with the task that follows the rest
    /// (it ends when discovery and the bus close; abort it to stop).
    pub async fn follow<A: Admission>(
        &self,
        discovery: Arc<dyn Discovery>,
        admission: A,
    ) -> Result<tokio::task::JoinHandle<()>, ControlError> {
        let mut loads = self.s.bus.subscribe(contract::LOAD).await?;
        let (initial, mut watch) = discovery.watch(&self.s.cfg.kind).await?;
        let (nodes, mut fabric_watch) = discovery.watch(FABRIC_KIND).await?;
        for inst in initial {
            self.arrive(inst, &admission).await;
        }
        for inst in nodes {
            self.join_fabric(inst);
        }
        let this = self.clone();
        Ok(tokio::spawn(async move {
            let (mut load_open, mut watch_open, mut fabric_open) = (true, true, true);
            while load_open || watch_open || fabric_open {
                tokio::select! {
                    biased;
                    d = watch.recv(), if watch_open => match d {
                        Some(DiscoveryEvent::Joined(inst)) => this.arrive(inst, &admission).await,
                        Some(DiscoveryEvent::Left { id, .. }) => {
                            if let Some(addr) = this.leave(&id) {
                                admission.left(&id, addr);
                            }
                        }
                        None => watch_open = false,
                    },
                    d = fabric_watch.recv(), if fabric_open => match d {
                        Some(DiscoveryEvent::Joined(inst)) => this.join_fabric(inst),
                        Some(DiscoveryEvent::Left { id, .. }) => this.leave_fabric(&id),
                        None => fabric_open = false,
                    },
                    m = loads.recv(), if load_open => match m {
                        Some(bytes) => this.on_load(&bytes),
                        None => load_open = false,
                    },
                }
            }
        }))
    }

    /// A worker instance appeared in discovery: admitted, then a member.
    async fn arrive<A: Admission>(&self, inst: Instance, admission: &A) {
        let md: WorkerMetadata = match serde_json::from_value(inst.metadata) {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(worker = %inst.id, error = %e, "ignoring a worker with unreadable metadata");
                return;
            }
        };
        if let Err(why) = admission.admit(&inst.id, &md).await {
            tracing::warn!(worker = %inst.id, reason = %why, "ignoring a worker");
            return;
        }
        let (addr, api) = (md.addr, md.api.clone());
        if self.join(inst.id.clone(), md)
            && matches!(api, WorkerApi::Kvfabric { protocol } if protocol == contract::worker::PROTOCOL)
        {
            admission.joined(&inst.id, addr);
        }
    }

    /// `name` is a worker of `md` from now on (a re-registration replaces what was known,
    /// keeping what dashboards show). A worker of another protocol version is known but never
    /// routed to. True when it joined (metadata with 0 tokens per block does not even
    /// decode: the block size's type refuses it).
    pub fn join(&self, name: String, md: WorkerMetadata) -> bool {
        let bt = md.model.layout.block_tokens;
        let hasher = TokenBlockHasher::new(bt, HashSeed::default());
        let wid = worker_id(&name);
        self.s.index.add_worker(wid);
        self.s.feed.follow(&name);
        let mut st = self.s.members.lock();
        // What a dashboard knows of it (its last report, the requests sent to it) carries
        // over a re-registration or a return.
        let mut before = None;
        if let Some(old) = st.workers.remove(&name) {
            // Re-registered (new address or model): forget the old routing entry.
            if let Some(m) = st.models.get_mut(&old.model) {
                m.router.remove_worker(old.wid);
                m.workers -= 1;
            }
            before = Some(old);
        }
        if let Some(i) = st.departed.iter().position(|d| d.name == name) {
            let gone = st.departed.remove(i).map(|d| d.entry);
            before = before.or(gone);
        }
        st.vacated.remove(&md.model.id);
        let model = st.models.entry(md.model.id.clone()).or_insert_with(|| ModelState {
            info: md.model.clone(),
            codec: md.codec.clone(),
            workers: 0,
            router: Router::new(RouterConfig {
                block_tokens: bt,
                pull: self.s.cfg.router.pull.map(|p| crate::policy::PullPricing {
                    block_bytes: md.model.layout.bytes_per_block(),
                    ..p
                }),
                ..self.s.cfg.router.clone()
            }),
            hasher,
        });
        model.router.add_worker(wid);
        if md.store.as_ref().is_some_and(|s| s.block_bytes == md.model.layout.bytes_per_block()) {
            model.router.pool(wid);
        }
        model.workers += 1;
        tracing::info!(worker = %name, addr = %md.addr, model = %md.model.id, role = ?md.role, "worker joined");
        // A worker of another protocol version could not read our frames: known at join,
        // shown, never routed to.
        let incompatible = match md.api {
            WorkerApi::Kvfabric { protocol: v } if v != contract::worker::PROTOCOL => {
                let why = format!(
                    "speaks worker protocol {v}, this frontend speaks {} (run one release on \
                     frontends and workers)",
                    contract::worker::PROTOCOL
                );
                tracing::warn!(worker = %name, reason = %why, "a worker this frontend cannot talk to joined; left out of routing");
                Some((Instant::now() + INCOMPATIBLE_FOR, why))
            }
            _ => None,
        };
        st.by_id.insert(wid, name.clone());
        let role = match (&md.api, md.role) {
            (WorkerApi::OpenAi { .. }, _) => "engine",
            (_, Role::Aggregated) => "aggregated",
            (_, Role::Prefill) => "prefill",
            (_, Role::Decode) => "decode",
        };
        let entry = WorkerEntry {
            wid,
            addr: md.addr,
            api: md.api,
            model: md.model.id,
            served: before.as_ref().map_or(0, |b| b.served),
            penalty_until: None,
            refused: incompatible,
            role,
            load: before.as_ref().map_or_else(Load::default, |b| b.load),
            stats: before.as_mut().and_then(|b| b.stats.take()),
            reported: before.as_ref().and_then(|b| b.reported),
        };
        st.workers.insert(name, entry);
        true
    }

    /// A fabric node joined discovery: its events go to the index from now on.
    pub fn join_fabric(&self, inst: Instance) {
        let info: NodeInfo = match serde_json::from_value(inst.metadata) {
            Ok(i) if inst.id.len() <= NAME_MAX => i,
            Ok(_) => {
                tracing::warn!(node = %inst.id.chars().take(64).collect::<String>(), "ignoring a fabric node with an overlong name");
                return;
            }
            Err(e) => {
                tracing::warn!(node = %inst.id, error = %e, "ignoring a fabric node whose metadata cannot be read");
                return;
            }
        };
        let wid = worker_id(&inst.id);
        let mut st = self.s.members.lock();
        if st.by_id.contains_key(&wid) {
            tracing::warn!(node = %inst.id, "ignoring a fabric node named as a worker is");
            return;
        }
        if !st.fabric.contains_key(&inst.id) && st.fabric.len() >= FABRIC_MAX {
            tracing::warn!(node = %inst.id, max = FABRIC_MAX, "ignoring a fabric node: too many");
            return;
        }
        self.s.index.add_worker(wid);
        self.s.feed.follow(&inst.id);
        let before = st.fabric.remove(&inst.id);
        tracing::info!(node = %inst.id, addr = %info.agent.tcp_addr, "fabric node joined");
        let (stats, reported) = before.map_or((None, None), |b| (b.stats, b.reported));
        let entry = FabricEntry {
            wid,
            addr: info.agent.tcp_addr,
            block_bytes: info.block_bytes,
            stats,
            reported,
        };
        st.fabric.insert(inst.id, entry);
    }

    /// A fabric node left discovery: its blocks leave the index.
    pub fn leave_fabric(&self, name: &str) {
        let Some(f) = self.s.members.lock().fabric.remove(name) else { return };
        self.s.index.remove_worker(f.wid);
        self.s.feed.unfollow(name);
        tracing::info!(node = %name, "fabric node left");
    }

    /// A worker left discovery: out of routing and the index, kept a while for dashboards.
    /// Its request port, if it was a member.
    pub fn leave(&self, name: &str) -> Option<SocketAddr> {
        let mut st = self.s.members.lock();
        let w = st.workers.remove(name)?;
        tracing::info!(worker = %name, "worker left");
        self.s.feed.unfollow(name);
        let (wid, model, addr) = (w.wid, w.model.clone(), w.addr);
        if st.departed.len() >= DEPARTED_MAX {
            st.departed.pop_front();
        }
        st.departed.push_back(Departed { name: name.to_string(), left: Instant::now(), entry: w });
        st.by_id.remove(&wid);
        self.s.index.remove_worker(wid);
        let gone = match st.models.get_mut(&model) {
            Some(m) => {
                m.router.remove_worker(wid);
                m.workers -= 1;
                m.workers == 0
            }
            None => false,
        };
        if gone {
            if let Some(m) = st.models.remove(&model) {
                let now = Instant::now();
                st.vacated
                    .retain(|_, (_, _, at)| now.saturating_duration_since(*at) < VACATED_KEEP);
                if st.vacated.len() < VACATED_MAX {
                    st.vacated.insert(model, (m.info, m.codec, now));
                }
            }
        }
        Some(addr)
    }

    /// A load report off the bus (`contract::LOAD`): the worker's routing load, and what
    /// dashboards show of it, of a fabric node or of a prefill worker. Anything else is
    /// dropped.
    pub fn on_load(&self, bytes: &[u8]) {
        let Ok(Message::Load { source, load, stats }) = Message::decode(bytes) else { return };
        // A lag beyond an hour is a clock, not the bus: not shown.
        let lag_ms = stats.as_ref().and_then(|s| {
            let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).ok()?;
            Some((now.as_millis() as f64 - s.sent_at_ms as f64).max(0.0))
                .filter(|l| *l <= 3_600_000.0)
        });
        let mut st = self.s.members.lock();
        let st = &mut *st;
        if let Some(f) = st.fabric.get_mut(&source) {
            f.stats = stats.map(bounded);
            f.reported = Some(Instant::now());
            return;
        }
        let entry = match st.workers.get_mut(&source) {
            Some(w) => Some(w),
            // A draining worker keeps reporting after it left discovery.
            None => st.departed.iter_mut().find(|d| d.name == source).map(|d| &mut d.entry),
        };
        let Some(w) = entry else {
            // Prefill workers serve no requests of this frontend, but a dashboard shows them.
            let named = source.len() <= NAME_MAX;
            if let Some(stats) = stats.filter(|s| named && s.role == "prefill").map(bounded) {
                if st.reporters.len() < REPORTERS_MAX || st.reporters.contains_key(&source) {
                    st.reporters.insert(source, Reporter { load, stats, at: Instant::now() });
                }
            }
            return;
        };
        w.load = load;
        w.stats = stats.map(bounded);
        w.reported = Some((Instant::now(), lag_ms));
        if let Some(m) = st.models.get_mut(&w.model).filter(|_| st.by_id.contains_key(&w.wid)) {
            m.router.report_load(w.wid, load);
            if let Some(s) = &w.stats {
                for l in &s.links {
                    m.router.report_link(w.wid, worker_id(&l.peer), l.bytes_per_s as f64);
                }
                if s.prefill_tokens_per_s > 0 {
                    m.router.report_prefill_rate(w.wid, s.prefill_tokens_per_s as f64);
                }
            }
        }
    }

    /// The engine steps worker `name` had run at its last report with statistics, and when
    /// that report came (None before one).
    pub fn steps(&self, name: &str) -> Option<(Instant, u64)> {
        let st = self.s.members.lock();
        let w = st.workers.get(name)?;
        Some((w.reported?.0, w.stats.as_ref()?.steps))
    }

    /// Whether `name` left discovery and has sent no load report for `quiet`: its lease
    /// ran out on a host that is dead or cut off (a draining worker left too, but keeps
    /// reporting until it stops). A worker still in discovery is not lost.
    pub fn lost(&self, name: &str, quiet: Duration) -> bool {
        let st = self.s.members.lock();
        if st.workers.contains_key(name) {
            return false;
        }
        st.departed
            .iter()
            .rev()
            .find(|d| d.name == name)
            .and_then(|d| d.entry.reported)
            .is_none_or(|(at, _)| at.elapsed() >= quiet)
    }

    /// A worker did not answer in time (no connection, no handshake or no first token):
    /// avoided for the configured penalty, while others exist.
    pub fn penalise(&self, name: &str) {
        if let Some(w) = self.s.members.lock().workers.get_mut(name) {
            w.penalty_until = Some(Instant::now() + self.s.cfg.slow_penalty);
        }
    }

    /// No request can reach a worker (`why`): out of routing for [`REFUSED_RETRY`] or
    /// [`INCOMPATIBLE_FOR`]; logged once per worker until it serves again.
    pub fn refuse(&self, name: &str, why: String, refusal: Refusal) {
        let until = Instant::now()
            + match refusal {
                Refusal::Secret => REFUSED_RETRY,
                Refusal::Version => INCOMPATIBLE_FOR,
            };
        if let Some(w) = self.s.members.lock().workers.get_mut(name) {
            if w.refused.is_none() {
                tracing::warn!(worker = %name, reason = %why, "no request can reach a worker; \
                    left out of routing");
            }
            w.refused = Some((until, why));
        }
    }

    /// A worker answered in time: it is no longer avoided.
    pub fn forgive(&self, name: &str) {
        if let Some(w) = self.s.members.lock().workers.get_mut(name) {
            w.penalty_until = None;
            w.refused = None;
        }
    }

    /// Picks a worker of `model` for request `request_id` of `prompt`, avoiding `tried`,
    /// workers that cannot be reached, and slow ones unless no other is left; the request
    /// counts as the worker's load until [`Membership::free`].
    pub fn route(
        &self,
        model: &str,
        request_id: u64,
        prompt: &[u32],
        tried: &[WorkerId],
    ) -> Option<Pick> {
        self.route_with(model, request_id, prompt, tried, RouteOptions::default())
    }

    /// [`Membership::route`] for a request whose blocks are named with `opts.salt` (its
    /// cache namespace), weighing reuse by `opts.reuse`.
    pub fn route_with(
        &self,
        model: &str,
        request_id: u64,
        prompt: &[u32],
        tried: &[WorkerId],
        opts: RouteOptions<'_>,
    ) -> Option<Pick> {
        let draw = self.s.rng.lock().next_f64();
        let now = self.s.epoch.elapsed().as_secs_f64();
        let mut st = self.s.members.lock();
        let st = &mut *st;
        let m = st.models.get_mut(model)?;
        let hashes = match opts.salt.filter(|s| !s.is_empty()) {
            None => m.hasher.sequence_hashes(prompt),
            Some(salt) => kvfabric::hash::TokenBlockHasher::new(
                m.hasher.block_tokens(),
                m.hasher.seed().salted(salt),
            )
            .sequence_hashes(prompt),
        };
        let d = m.router.route_weighted(
            &self.s.index,
            request_id,
            &hashes,
            prompt.len() as u64,
            now,
            draw,
            opts.reuse,
        )?;
        let mut wid = d.worker;
        let clock = Instant::now();
        let entry = |w: &WorkerId| st.by_id.get(w).and_then(|n| st.workers.get(n));
        let penalised =
            |w: &WorkerId| entry(w).and_then(|e| e.penalty_until).is_some_and(|t| t > clock);
        // A worker that refused our secret cannot serve anything: never chosen.
        let refused = |w: &WorkerId| entry(w).is_some_and(|e| e.refused_now(clock).is_some());
        let workers: Vec<WorkerId> = m.router.workers().to_vec();
        let usable = |w: &WorkerId| !tried.contains(w) && !refused(w);
        let fresh = |w: &WorkerId| usable(w) && !penalised(w);
        let avoid_slow = workers.iter().any(fresh);
        if !usable(&wid) || (avoid_slow && penalised(&wid)) {
            m.router.free(request_id);
            wid = if avoid_slow {
                *workers.iter().find(|w| fresh(w))?
            } else {
                *workers.iter().find(|w| usable(w))?
            };
        }
        let pull = d.pull.filter(|_| wid == d.worker).and_then(|p| {
            let from = st.by_id.get(&p.from)?.clone();
            Some(kvfabric::contract::generate::PullHint { from, blocks: p.blocks })
        });
        let path = match (&pull, d.path) {
            (None, crate::policy::Path::Pull) => crate::policy::Path::Compute,
            (_, p) => p,
        };
        let name = st.by_id.get(&wid)?.clone();
        let w = st.workers.get_mut(&name)?;
        w.served += 1;
        Some(Pick { path, pull, name, addr: w.addr, api: w.api.clone() })
    }

    /// The worker accepted the request as its `seq`-th (its load reports count it from the
    /// one that has accepted that many).
    pub fn accepted(&self, model: &str, request_id: u64, seq: u64) {
        if let Some(m) = self.s.members.lock().models.get_mut(model) {
            m.router.accepted(request_id, seq);
        }
    }

    /// The request's prompt is prefilled (its first token came): it weighs as decode load.
    pub fn prefill_done(&self, model: &str, request_id: u64) {
        if let Some(m) = self.s.members.lock().models.get_mut(model) {
            m.router.prefill_done(request_id);
        }
    }

    /// The request is done: it no longer counts as its worker's load.
    pub fn free(&self, model: &str, request_id: u64) {
        if let Some(m) = self.s.members.lock().models.get_mut(model) {
            m.router.free(request_id);
        }
    }

    /// Every worker of `model` scored for `prompt`, as the router weighs them now.
    pub fn scores(&self, model: &str, prompt: &[u32]) -> Option<Scores> {
        let now = self.s.epoch.elapsed().as_secs_f64();
        let st = self.s.members.lock();
        let m = st.models.get(model)?;
        let hashes = m.hasher.sequence_hashes(prompt);
        let workers = m
            .router
            .scores(&self.s.index, &hashes, now)
            .into_iter()
            .filter_map(|(w, run, cost)| {
                let terms = m.router.cost_terms(w, hashes.len(), run);
                st.by_id.get(&w).map(|n| (n.clone(), run, cost, m.router.load(w), terms))
            })
            .collect();
        Some(Scores { blocks: hashes.len(), block_tokens: m.router.config().block_tokens, workers })
    }

    /// Reads what is known; departed workers and silent reporters past their time are
    /// forgotten first.
    pub fn read<R>(&self, f: impl FnOnce(&Members) -> R) -> R {
        let now = Instant::now();
        let mut st = self.s.members.lock();
        st.departed.retain(|d| now.saturating_duration_since(d.left) < DEPARTED_KEEP);
        st.reporters.retain(|_, r| now.saturating_duration_since(r.at) < REPORTER_KEEP);
        f(&st)
    }

    /// The models served now, by id.
    pub fn models(&self) -> Vec<ModelInfo> {
        let st = self.s.members.lock();
        let mut v: Vec<ModelInfo> = st.models.values().map(|m| m.info.clone()).collect();
        v.sort_by(|a, b| a.id.cmp(&b.id));
        v
    }

    /// A model served now, and how its prompts are tokenized.
    pub fn model(&self, id: &str) -> Option<(ModelInfo, CodecSpec)> {
        let st = self.s.members.lock();
        match st.models.get(id) {
            Some(m) => Some((m.info.clone(), m.codec.clone())),
            None => st
                .vacated
                .get(id)
                .filter(|(_, _, at)| at.elapsed() < VACATED_KEEP)
                .map(|(info, codec, _)| (info.clone(), codec.clone())),
        }
    }

    /// Whether `id` has no worker now but had one within [`VACATED_KEEP`]: its requests
    /// wait for one to join.
    pub fn vacated(&self, id: &str) -> bool {
        self.vacated_for(id).is_some()
    }

    /// How long ago the last worker of `id` left, when it has none now (within
    /// [`VACATED_KEEP`]).
    pub fn vacated_for(&self, id: &str) -> Option<Duration> {
        let st = self.s.members.lock();
        if st.models.contains_key(id) {
            return None;
        }
        st.vacated.get(id).map(|(_, _, at)| at.elapsed()).filter(|e| *e < VACATED_KEEP)
    }

    /// The prefix index its feed keeps.
    pub fn index(&self) -> &PrefixIndex {
        &self.s.index
    }

    /// The counters of the index's feed (KV events applied, gaps, dumps).
    pub fn feed_stats(&self) -> &FeedStats {
        self.s.feed.stats()
    }

    /// The routing mode, as `explain` and dashboards name it.
    pub fn mode_name(&self) -> String {
        format!("{:?}", self.s.cfg.router.mode).to_lowercase()
    }
}

/// A report off the bus, cut to what a dashboard shows: a transport per kind, short names.
/// Links a load report may name (the rest are dropped).
const LINKS_PER_REPORT_MAX: usize = 256;

fn bounded(mut s: Box<WorkerStats>) -> Box<WorkerStats> {
    let short = |x: &mut String| {
        if x.len() > 32 {
            *x = x.chars().take(32).collect();
        }
    };
    s.transfers.truncate(kvfabric::transfer::TransportKind::ALL.len());
    s.links.truncate(LINKS_PER_REPORT_MAX);
    s.links.retain(|l| l.peer.len() <= NAME_MAX);
    for t in &mut s.transfers {
        short(&mut t.transport);
    }
    short(&mut s.role);
    s
}
