//! Peer pulls: one KV pool across workers. A worker reads prefix blocks from another worker's
//! store (its host tier, and its disk tier through it) with the fabric's protocol
//! ([`super::protocol`]: `HELLO`, then `GET` straight into this worker's host slots,
//! checksummed), where a router said those blocks are ([`kvfabric::contract::generate::PullHint`]).
//!
//! [`Peers`] follows the workers in discovery (each registers its store's
//! [`NodeInfo`] in its metadata), pulls from the one named, and measures each link it pulls
//! over: the rates it publishes are what routers price pulls at. A holder that died, was cut
//! off, or evicted the blocks meanwhile makes the pull shorter or empty: the puller computes
//! the rest. Every pull has a deadline.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvfabric::agent::Agent;
use kvfabric::contract::discovery::NodeInfo;
use kvfabric::control::{ControlError, Discovery, DiscoveryEvent, Instance};
use kvfabric::hash::SequenceHash;
use kvfabric::memory::RegionId;
use parking_lot::{Mutex, RwLock};

use super::{RemoteError, RemoteTier};
use crate::metrics::Rate;

/// Why a pull brought fewer blocks than asked for, as metrics name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PullFailure {
    /// The holder is not (or no longer) in discovery, or registers a store of another block
    /// size.
    Unknown,
    /// The holder could not be reached, or failed the call.
    Unreachable,
    /// The pull ran past its deadline (a holder cut off, or a link far slower than priced).
    Timeout,
    /// The holder no longer had (all) the blocks.
    Evicted,
    /// The holder refused: serving it would exceed its share of its link or its reads.
    Busy,
    /// This worker had no host slot free to pull into.
    NoRoom,
}

impl PullFailure {
    /// Every reason, in metrics order.
    pub const ALL: [PullFailure; 6] = [
        PullFailure::Unknown,
        PullFailure::Unreachable,
        PullFailure::Timeout,
        PullFailure::Evicted,
        PullFailure::Busy,
        PullFailure::NoRoom,
    ];

    /// Its label.
    pub fn name(self) -> &'static str {
        match self {
            PullFailure::Unknown => "unknown_peer",
            PullFailure::Unreachable => "unreachable",
            PullFailure::Timeout => "timeout",
            PullFailure::Evicted => "evicted",
            PullFailure::Busy => "busy",
            PullFailure::NoRoom => "no_room",
        }
    }
}

/// Counters of a worker's pulls (as the puller) and of the pulls it served (as the holder).
#[derive(Debug, Default)]
pub struct PeerStats {
    /// Pulls attempted.
    pub pulls: AtomicU64,
    /// Blocks pulled.
    pub pulled_blocks: AtomicU64,
    /// Bytes pulled.
    pub pulled_bytes: AtomicU64,
    /// Pulls that brought fewer blocks than asked, by [`PullFailure::ALL`] order.
    pub failures: [AtomicU64; 6],
    /// `GET`s served to peers.
    pub served: AtomicU64,
    /// Blocks served to peers.
    pub served_blocks: AtomicU64,
    /// Bytes served to peers.
    pub served_bytes: AtomicU64,
    /// `GET`s refused because they would exceed this worker's serving share.
    pub served_busy: AtomicU64,
}

/// A read of [`PeerStats`] and of the links measured.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct PeerSnapshot {
    /// Pulls attempted.
    pub pulls: u64,
    /// Blocks pulled.
    pub pulled_blocks: u64,
    /// Bytes pulled.
    pub pulled_bytes: u64,
    /// Failed pulls per reason (label, count).
    pub failures: Vec<(&'static str, u64)>,
    /// `GET`s served.
    pub served: u64,
    /// Blocks served.
    pub served_blocks: u64,
    /// Bytes served.
    pub served_bytes: u64,
    /// `GET`s refused as over the share.
    pub served_busy: u64,
    /// Per peer pulled from: bytes pulled from it, and the rate measured, bytes per second.
    pub links: Vec<(String, u64, f64)>,
    /// Peers whose stores it knows (from discovery).
    pub known: u64,
}

impl PeerStats {
    pub(crate) fn failed(&self, why: PullFailure) {
        let i = PullFailure::ALL.iter().position(|&f| f == why).unwrap_or(0);
        self.failures[i].fetch_add(1, Ordering::Relaxed);
    }
}

/// A link pulled over: the bytes pulled, and its measured rate.
#[derive(Debug, Clone, Copy, Default)]
struct LinkRate {
    bytes: u64,
    rate: Rate,
}

/// The peers a worker may pull from, and its pulls.
#[derive(Debug, Clone)]
pub struct Peers {
    inner: Arc<PeersInner>,
}

#[derive(Debug)]
struct PeersInner {
    client: RemoteTier,
    block_bytes: u64,
    known: RwLock<HashMap<String, NodeInfo>>,
    links: Mutex<HashMap<String, LinkRate>>,
    stats: Arc<PeerStats>,
}

impl Peers {
    /// Pulls through `agent` (the one the store is opened with), blocks of `block_bytes`,
    /// each call within `deadline` at most.
    pub fn new(agent: Agent, block_bytes: u64, deadline: Duration) -> Self {
        Peers {
            inner: Arc::new(PeersInner {
                client: RemoteTier::new(agent, deadline),
                block_bytes,
                known: RwLock::new(HashMap::new()),
                links: Mutex::new(HashMap::new()),
                stats: Arc::new(PeerStats::default()),
            }),
        }
    }

    /// The counters (shared with the serving side, [`crate::fabric::FabricNode::serve_peers`]).
    pub fn stats(&self) -> &Arc<PeerStats> {
        &self.inner.stats
    }

    /// The longest a pull may take.
    pub fn deadline(&self) -> Duration {
        self.inner.client.deadline()
    }

    /// A peer's store is known (discovery said so, or a test).
    pub fn add(&self, name: &str, info: NodeInfo) {
        if info.block_bytes != self.inner.block_bytes {
            tracing::debug!(
                peer = name,
                theirs = info.block_bytes,
                ours = self.inner.block_bytes,
                "a worker's store has another block size: never pulled from"
            );
            return;
        }
        let changed = self.inner.known.read().get(name) != Some(&info);
        if changed {
            // A new process under the same name: introduce ourselves again before pulling.
            self.inner.client.forget(name);
            self.inner.known.write().insert(name.to_string(), info);
        }
    }

    /// A peer left: never pulled from again.
    pub fn remove(&self, name: &str) {
        if self.inner.known.write().remove(name).is_some() {
            self.inner.client.forget(name);
        }
    }

    /// Names of the peers known.
    pub fn known(&self) -> Vec<String> {
        let mut v: Vec<String> = self.inner.known.read().keys().cloned().collect();
        v.sort();
        v
    }

    /// Pulls `hashes` from `from` into `dst` (this agent's region, an offset per block):
    /// says which were served, and why not all were. At most `deadline`.
    pub async fn pull(
        &self,
        from: &str,
        hashes: &[SequenceHash],
        dst: &[(RegionId, u64)],
        deadline: Duration,
    ) -> (Vec<bool>, Option<PullFailure>) {
        let stats = &self.inner.stats;
        stats.pulls.fetch_add(1, Ordering::Relaxed);
        let Some(info) = self.inner.known.read().get(from).cloned() else {
            stats.failed(PullFailure::Unknown);
            return (vec![false; hashes.len()], Some(PullFailure::Unknown));
        };
        let started = Instant::now();
        let client = &self.inner.client;
        let outcome = match client.ensure_peer(&info.agent) {
            Err(e) => Err(e),
            Ok(()) => client.get_from(from, hashes, dst, deadline).await,
        };
        let (served, why) = match outcome {
            Ok((served, busy)) => {
                let n = served.iter().take_while(|&&s| s).count();
                let why = (n < hashes.len()).then_some(if busy {
                    PullFailure::Busy
                } else {
                    PullFailure::Evicted
                });
                (served, why)
            }
            Err(RemoteError::Node { message, .. }) if message.contains("timed out") => {
                (vec![false; hashes.len()], Some(PullFailure::Timeout))
            }
            Err(_) if started.elapsed() >= deadline => {
                (vec![false; hashes.len()], Some(PullFailure::Timeout))
            }
            Err(e) => {
                tracing::debug!(peer = from, error = %e, "pull failed");
                (vec![false; hashes.len()], Some(PullFailure::Unreachable))
            }
        };
        if let Some(why) = why {
            stats.failed(why);
        }
        let n = served.iter().take_while(|&&s| s).count() as u64;
        let bytes = n * self.inner.block_bytes;
        stats.pulled_blocks.fetch_add(n, Ordering::Relaxed);
        stats.pulled_bytes.fetch_add(bytes, Ordering::Relaxed);
        if n > 0 {
            self.measured(from, bytes, started.elapsed());
        }
        (served, why)
    }

    fn measured(&self, from: &str, bytes: u64, took: Duration) {
        let mut links = self.inner.links.lock();
        let link = links.entry(from.to_string()).or_default();
        link.bytes += bytes;
        if bytes >= Rate::BATCH_BYTES_MIN {
            link.rate.observe(bytes, took);
        }
    }

    /// Reads the counters and the links.
    pub fn snapshot(&self) -> PeerSnapshot {
        let s = &self.inner.stats;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut links: Vec<(String, u64, f64)> = self
            .inner
            .links
            .lock()
            .iter()
            .map(|(n, l)| (n.clone(), l.bytes, l.rate.get().unwrap_or(0.0)))
            .collect();
        links.sort_by(|a, b| a.0.cmp(&b.0));
        PeerSnapshot {
            pulls: get(&s.pulls),
            pulled_blocks: get(&s.pulled_blocks),
            pulled_bytes: get(&s.pulled_bytes),
            failures: PullFailure::ALL
                .iter()
                .zip(&s.failures)
                .map(|(f, c)| (f.name(), get(c)))
                .collect(),
            served: get(&s.served),
            served_blocks: get(&s.served_blocks),
            served_bytes: get(&s.served_bytes),
            served_busy: get(&s.served_busy),
            links,
            known: self.inner.known.read().len() as u64,
        }
    }

    /// Follows the instances of `kind` in `discovery` whose metadata registers a store
    /// (`{"store": NodeInfo}`, as workers do): adds those there now and those that join, drops
    /// those that leave. `own` (this worker) is never added. The task ends when the watch
    /// does; abort it to stop following.
    pub async fn follow(
        &self,
        discovery: &dyn Discovery,
        kind: &str,
        own: String,
    ) -> Result<tokio::task::JoinHandle<()>, ControlError> {
        #[derive(serde::Deserialize)]
        struct WithStore {
            store: Option<NodeInfo>,
        }
        let (now, mut changes) = discovery.watch(kind).await?;
        let this = self.clone();
        let join = move |inst: Instance| {
            if inst.id == own {
                return;
            }
            match serde_json::from_value::<WithStore>(inst.metadata) {
                Ok(WithStore { store: Some(info) }) => this.add(&inst.id, info),
                Ok(WithStore { store: None }) => {}
                Err(e) => {
                    tracing::debug!(peer = %inst.id, error = %e, "a worker's metadata names no store")
                }
            }
        };
        for inst in now {
            join(inst);
        }
        let this = self.clone();
        Ok(tokio::spawn(async move {
            while let Some(change) = changes.recv().await {
                match change {
                    DiscoveryEvent::Joined(inst) => join(inst),
                    DiscoveryEvent::Left { id, .. } => this.remove(&id),
                }
            }
        }))
    }
}
