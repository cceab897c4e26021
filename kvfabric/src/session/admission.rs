//! Who gets a connection on an authenticated port (an agent's, a worker's request port), and
//! for how long.
//!
//! A connection is *pending* from accept until its handshake proves the shared secret, then
//! *admitted* under the name it authenticated with. The limits keep strangers from taking what
//! peers need:
//! - pending connections have a budget of their own ([`AdmissionLimits::handshakes_max`]) and
//!   a short deadline. When the budget is full, a new connection does not wait behind silent
//!   ones: it takes the place of the *oldest* pending connection, which is closed (`evicted`)
//!   — but only of one that had [`AdmissionLimits::handshake_grace`] to finish its handshake.
//!   An honest client finishes in a round trip, well within the grace, so a burst of honest
//!   connections is never cut (the budget stretches while all pending ones are young), and
//!   silent strangers give their places to whoever comes next.
//! - one source address may hold at most [`AdmissionLimits::handshakes_per_source_max`]
//!   pending connections past their grace; past it, that source's own oldest is evicted, never
//!   another's.
//! - admitted connections are bounded per authenticated name and in all, and closed after
//!   [`AdmissionLimits::idle_timeout`] without a request.
//! - every connection of every port in the process counts against one file-descriptor budget:
//!   the soft `RLIMIT_NOFILE` less [`FD_RESERVE`], which stays for the control plane (etcd,
//!   NATS), metrics scrapes and files. A port at its limit refuses new connections at once.
//!
//! Every refusal and closing is counted by cause in [`PortStats`] and logged once per cause.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::oneshot;

/// File descriptors kept out of every port's reach: the control plane's connections, metrics
/// scrapes, disk files, the runtime's own.
pub const FD_RESERVE: usize = 256;

/// Connections of every port in this process, together.
static PROCESS_CONNECTIONS: AtomicUsize = AtomicUsize::new(0);

/// The connections that every port of this process may hold together: the soft
/// `RLIMIT_NOFILE` less [`FD_RESERVE`] (at least 64), read once.
pub fn process_connections_max() -> usize {
    static MAX: OnceLock<usize> = OnceLock::new();
    *MAX.get_or_init(|| {
        let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: getrlimit writes one rlimit into the struct we pass; no other memory.
        let rc = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) };
        let soft = if rc == 0 { lim.rlim_cur } else { 1024 };
        let soft = usize::try_from(soft).unwrap_or(usize::MAX);
        soft.saturating_sub(FD_RESERVE).max(64)
    })
}

/// Bounds of an authenticated port.
#[derive(Debug, Clone)]
pub struct AdmissionLimits {
    /// Connections at once, pending and admitted.
    pub connections_max: usize,
    /// Connections still in their handshake at once; a new one past it evicts the oldest.
    pub handshakes_max: usize,
    /// Pending connections of one source address at once; past it, its oldest is evicted.
    pub handshakes_per_source_max: usize,
    /// Admitted connections of one authenticated name at once.
    pub per_peer_max: usize,
    /// Connect-to-authenticated bound.
    pub handshake_timeout: Duration,
    /// A pending connection younger than this is never evicted (an honest handshake takes a
    /// round trip).
    pub handshake_grace: Duration,
    /// An admitted connection without a request for this long is closed.
    pub idle_timeout: Duration,
}

impl Default for AdmissionLimits {
    fn default() -> Self {
        AdmissionLimits {
            connections_max: 4096,
            handshakes_max: 64,
            handshakes_per_source_max: 32,
            per_peer_max: 1024,
            handshake_timeout: Duration::from_secs(3),
            handshake_grace: Duration::from_millis(500),
            idle_timeout: Duration::from_secs(120),
        }
    }
}

/// Why a connection was refused or closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Cause {
    /// The port (or the process's descriptor budget) was full: refused at accept.
    Busy,
    /// Still in its handshake when newer connections needed its place.
    Evicted,
    /// Its handshake failed: a wrong secret, garbage, a timeout.
    Handshake,
    /// Its authenticated name held as many connections as allowed.
    Peer,
    /// Admitted, then silent for the idle timeout.
    Idle,
}

impl Cause {
    /// Every cause, in the order of [`PortSnapshot::closed`].
    pub const ALL: [Cause; 5] =
        [Cause::Busy, Cause::Evicted, Cause::Handshake, Cause::Peer, Cause::Idle];

    /// Its label in `/metrics`.
    pub fn label(self) -> &'static str {
        match self {
            Cause::Busy => "busy",
            Cause::Evicted => "evicted",
            Cause::Handshake => "handshake",
            Cause::Peer => "peer_limit",
            Cause::Idle => "idle",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// A port's counters.
#[derive(Debug)]
pub struct PortStats {
    port: &'static str,
    closed: [AtomicU64; 5],
    logged: [AtomicBool; 5],
    pending: AtomicU64,
    admitted: AtomicU64,
}

/// What a port's counters say now.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct PortSnapshot {
    /// The port: `agent` or `request`.
    pub port: &'static str,
    /// Connections refused or closed, per [`Cause::ALL`].
    pub closed: [u64; 5],
    /// Connections in their handshake now.
    pub pending: u64,
    /// Authenticated connections now.
    pub admitted: u64,
}

impl PortSnapshot {
    /// The count of one cause.
    pub fn count(&self, cause: Cause) -> u64 {
        self.closed[cause.index()]
    }
}

impl PortStats {
    /// Counters of the port named `port` (`agent`, `request`).
    pub fn new(port: &'static str) -> Self {
        PortStats {
            port,
            closed: Default::default(),
            logged: Default::default(),
            pending: AtomicU64::new(0),
            admitted: AtomicU64::new(0),
        }
    }

    /// Counts a refusal or closing; the first of each cause is logged with `detail`.
    pub fn count(&self, cause: Cause, detail: impl std::fmt::Display) {
        self.closed[cause.index()].fetch_add(1, Ordering::Relaxed);
        if !self.logged[cause.index()].swap(true, Ordering::Relaxed) {
            tracing::warn!(port = self.port, cause = cause.label(), %detail,
                "connection refused or closed (logged once per cause; counted in /metrics)");
        } else {
            tracing::debug!(port = self.port, cause = cause.label(), %detail, "connection refused or closed");
        }
    }

    /// The counters now.
    pub fn snapshot(&self) -> PortSnapshot {
        PortSnapshot {
            port: self.port,
            closed: std::array::from_fn(|i| self.closed[i].load(Ordering::Relaxed)),
            pending: self.pending.load(Ordering::Relaxed),
            admitted: self.admitted.load(Ordering::Relaxed),
        }
    }
}

struct Pending {
    source: IpAddr,
    since: std::time::Instant,
    evict: oneshot::Sender<()>,
}

#[derive(Default)]
struct State {
    next: u64,
    /// Pending connections, oldest first.
    pending: BTreeMap<u64, Pending>,
    sources: HashMap<IpAddr, usize>,
    peers: HashMap<String, usize>,
    total: usize,
}

impl State {
    fn evict(&mut self, seq: u64) {
        if let Some(p) = self.pending.remove(&seq) {
            self.forget_source(p.source);
            let _ = p.evict.send(());
        }
    }

    fn forget_source(&mut self, source: IpAddr) {
        if let Some(n) = self.sources.get_mut(&source) {
            *n -= 1;
            if *n == 0 {
                self.sources.remove(&source);
            }
        }
    }
}

struct Inner {
    limits: AdmissionLimits,
    state: Mutex<State>,
    stats: Arc<PortStats>,
}

/// The admission control of one port. Cheap to clone.
#[derive(Clone)]
pub struct Admission {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Admission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admission").field("limits", &self.inner.limits).finish_non_exhaustive()
    }
}

impl Admission {
    /// Admission within `limits`, counted in `stats`.
    pub fn new(limits: AdmissionLimits, stats: Arc<PortStats>) -> Self {
        Admission { inner: Arc::new(Inner { limits, state: Mutex::default(), stats }) }
    }

    /// Its limits.
    pub fn limits(&self) -> &AdmissionLimits {
        &self.inner.limits
    }

    /// Its counters.
    pub fn stats(&self) -> &Arc<PortStats> {
        &self.inner.stats
    }

    /// A connection from `source` was accepted: a pending ticket, or `None` (refused and
    /// counted: close it now).
    pub fn admit(&self, source: IpAddr) -> Option<PreAuth> {
        let limits = &self.inner.limits;
        let now = std::time::Instant::now();
        let mut st = self.inner.state.lock();
        let at_cap = |st: &State| {
            st.total >= limits.connections_max.max(1)
                || PROCESS_CONNECTIONS.load(Ordering::Relaxed) >= process_connections_max()
        };
        // The oldest pending connection (of `source`, or of anyone) past its grace.
        let evictable = |st: &State, of: Option<IpAddr>| {
            st.pending
                .iter()
                .find(|(_, p)| of.is_none_or(|s| p.source == s))
                .filter(|(_, p)| now.duration_since(p.since) >= limits.handshake_grace)
                .map(|(seq, _)| *seq)
        };
        let evict = |st: &mut State, seq: u64| {
            st.evict(seq);
            self.inner
                .stats
                .count(Cause::Evicted, format_args!("a newer connection from {source}"));
        };
        // This source past its budget gives way first: its own oldest, past their grace.
        while st.sources.get(&source).copied().unwrap_or(0)
            >= limits.handshakes_per_source_max.max(1)
        {
            let Some(seq) = evictable(&st, Some(source)) else { break };
            evict(&mut st, seq);
        }
        // Then the budget of handshakes: strangers past their grace are trimmed to it.
        while st.pending.len() >= limits.handshakes_max.max(1) {
            let Some(seq) = evictable(&st, None) else { break };
            evict(&mut st, seq);
        }
        // At the connection cap, one pending connection past its grace makes room (its count
        // goes when its task closes it); with none, the newcomer is refused.
        if at_cap(&st) {
            match evictable(&st, None) {
                Some(seq) => evict(&mut st, seq),
                None => {
                    drop(st);
                    self.inner
                        .stats
                        .count(Cause::Busy, format_args!("from {source}: at the connection limit"));
                    return None;
                }
            }
        }
        let seq = st.next;
        st.next += 1;
        let (tx, rx) = oneshot::channel();
        st.pending.insert(seq, Pending { source, since: now, evict: tx });
        *st.sources.entry(source).or_default() += 1;
        st.total += 1;
        PROCESS_CONNECTIONS.fetch_add(1, Ordering::Relaxed);
        self.inner.stats.pending.fetch_add(1, Ordering::Relaxed);
        Some(PreAuth { inner: self.inner.clone(), seq, evicted: rx, admitted: false })
    }
}

/// A connection in its handshake. Dropped, it gives back its place.
pub struct PreAuth {
    inner: Arc<Inner>,
    seq: u64,
    evicted: oneshot::Receiver<()>,
    admitted: bool,
}

impl std::fmt::Debug for PreAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreAuth").field("seq", &self.seq).finish()
    }
}

impl PreAuth {
    /// Runs `handshake` (which yields the authenticated name) within the handshake timeout,
    /// unless a newer connection evicts this one first; then admits the name within its
    /// per-peer limit. `None`: refused, and counted; close the connection.
    pub async fn authenticate<E: std::fmt::Display>(
        self,
        handshake: impl Future<Output = Result<String, E>>,
    ) -> Option<Admitted> {
        let handshake = async { handshake.await.map(|peer| (peer, ())) };
        self.authenticate_with(handshake).await.map(|(a, ())| a)
    }

    /// [`Self::authenticate`] for a handshake that also yields what it made (the connection,
    /// once TLS wraps it).
    pub async fn authenticate_with<T, E: std::fmt::Display>(
        mut self,
        handshake: impl Future<Output = Result<(String, T), E>>,
    ) -> Option<(Admitted, T)> {
        let timeout = self.inner.limits.handshake_timeout;
        let outcome = tokio::select! {
            // Evicted (its sender fired), or its admission was dropped.
            _ = &mut self.evicted => return None,
            r = tokio::time::timeout(timeout, handshake) => r,
        };
        let (peer, made) = match outcome {
            Ok(Ok(done)) => done,
            Ok(Err(e)) => {
                self.inner.stats.count(Cause::Handshake, e);
                return None;
            }
            Err(_) => {
                self.inner
                    .stats
                    .count(Cause::Handshake, format_args!("no handshake within {timeout:?}"));
                return None;
            }
        };
        let inner = self.inner.clone();
        let mut st = inner.state.lock();
        if !st.pending.contains_key(&self.seq) {
            // Evicted while its handshake finished: the place is gone.
            return None;
        }
        if st.peers.get(&peer).copied().unwrap_or(0) >= inner.limits.per_peer_max.max(1) {
            drop(st);
            inner.stats.count(Cause::Peer, format_args!("{peer:?} holds its limit of connections"));
            return None;
        }
        if let Some(p) = st.pending.remove(&self.seq) {
            st.forget_source(p.source);
        }
        *st.peers.entry(peer.clone()).or_default() += 1;
        drop(st);
        self.admitted = true;
        inner.stats.pending.fetch_sub(1, Ordering::Relaxed);
        inner.stats.admitted.fetch_add(1, Ordering::Relaxed);
        Some((Admitted { inner, peer }, made))
    }
}

impl Drop for PreAuth {
    fn drop(&mut self) {
        if self.admitted {
            return;
        }
        let mut st = self.inner.state.lock();
        if let Some(p) = st.pending.remove(&self.seq) {
            st.forget_source(p.source);
        }
        st.total -= 1;
        drop(st);
        PROCESS_CONNECTIONS.fetch_sub(1, Ordering::Relaxed);
        self.inner.stats.pending.fetch_sub(1, Ordering::Relaxed);
    }
}

/// An authenticated connection's place. Dropped, it gives it back.
pub struct Admitted {
    inner: Arc<Inner>,
    peer: String,
}

impl std::fmt::Debug for Admitted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admitted").field("peer", &self.peer).finish()
    }
}

impl Admitted {
    /// The name it authenticated with.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// How long it may stay without a request.
    pub fn idle_timeout(&self) -> Duration {
        self.inner.limits.idle_timeout
    }

    /// Counts its closing for idleness.
    pub fn idle_closed(&self) {
        self.inner.stats.count(
            Cause::Idle,
            format_args!("{:?} sent nothing for {:?}", self.peer, self.idle_timeout()),
        );
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let mut st = self.inner.state.lock();
        if let Some(n) = st.peers.get_mut(&self.peer) {
            *n -= 1;
            if *n == 0 {
                st.peers.remove(&self.peer);
            }
        }
        st.total -= 1;
        drop(st);
        PROCESS_CONNECTIONS.fetch_sub(1, Ordering::Relaxed);
        self.inner.stats.admitted.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, last])
    }

    fn limits() -> AdmissionLimits {
        AdmissionLimits {
            connections_max: 6,
            handshakes_max: 3,
            handshakes_per_source_max: 2,
            per_peer_max: 2,
            handshake_timeout: Duration::from_secs(5),
            handshake_grace: Duration::ZERO,
            idle_timeout: Duration::from_secs(60),
        }
    }

    async fn ok(name: &str) -> Result<String, std::io::Error> {
        Ok(name.to_string())
    }

    #[tokio::test]
    async fn the_oldest_pending_connection_gives_way_and_admitted_ones_keep_their_place() {
        let stats = Arc::new(PortStats::new("test"));
        let adm = Admission::new(limits(), stats.clone());
        // Three strangers from three addresses fill the pending budget.
        let mut silent: Vec<PreAuth> = (1..=3).map(|i| adm.admit(ip(i)).unwrap()).collect();
        // A peer arrives: the oldest stranger is evicted, and the peer authenticates.
        let peer = adm.admit(ip(9)).unwrap();
        let admitted = peer.authenticate(ok("frontend")).await.expect("admitted");
        assert_eq!(stats.snapshot().count(Cause::Evicted), 1);
        let first = silent.remove(0);
        assert!(first.authenticate(ok("late")).await.is_none(), "evicted: its handshake is void");
        assert_eq!(stats.snapshot().pending, 2);
        assert_eq!(stats.snapshot().admitted, 1);
        drop(admitted);
        drop(silent);
        let s = stats.snapshot();
        assert_eq!((s.pending, s.admitted), (0, 0));
    }

    #[tokio::test]
    async fn one_source_evicts_only_its_own_and_a_full_port_refuses() {
        let stats = Arc::new(PortStats::new("test"));
        let adm = Admission::new(limits(), stats.clone());
        let other = adm.admit(ip(1)).unwrap();
        let a1 = adm.admit(ip(2)).unwrap();
        let a2 = adm.admit(ip(2)).unwrap();
        // Source 2 is at its per-source budget: its own oldest goes, not source 1's.
        let a3 = adm.admit(ip(2)).unwrap();
        assert!(a1.authenticate(ok("x")).await.is_none());
        let p = other.authenticate(ok("p")).await.expect("source 1 kept its place");
        drop((a2, a3));
        // Fill the port with admitted connections: with none pending, a new one is refused.
        let mut held = vec![p];
        for i in 0..5 {
            let name = format!("n{i}");
            held.push(adm.admit(ip(20 + i)).unwrap().authenticate(ok(&name)).await.unwrap());
        }
        assert!(adm.admit(ip(50)).is_none(), "full of admitted connections: refused");
        assert_eq!(stats.snapshot().count(Cause::Busy), 1);
        held.pop();
        assert!(adm.admit(ip(50)).is_some());
    }

    #[tokio::test]
    async fn per_peer_limit_and_failed_handshakes_are_counted() {
        let stats = Arc::new(PortStats::new("test"));
        let adm = Admission::new(limits(), stats.clone());
        let _x = adm.admit(ip(1)).unwrap().authenticate(ok("x")).await.unwrap();
        let _y = adm.admit(ip(1)).unwrap().authenticate(ok("x")).await.unwrap();
        assert!(adm.admit(ip(1)).unwrap().authenticate(ok("x")).await.is_none());
        assert_eq!(stats.snapshot().count(Cause::Peer), 1);
        let bad = adm.admit(ip(1)).unwrap();
        let failed: Result<String, &str> = Err("wrong secret");
        assert!(bad.authenticate(async { failed }).await.is_none());
        assert_eq!(stats.snapshot().count(Cause::Handshake), 1);
    }

    #[tokio::test]
    async fn a_burst_within_the_grace_is_let_in_and_only_the_cap_refuses_it() {
        let stats = Arc::new(PortStats::new("test"));
        let limits = AdmissionLimits { handshake_grace: Duration::from_secs(60), ..limits() };
        let adm = Admission::new(limits, stats.clone());
        // Past the handshake budget (3) and the source's (2): young, so nobody is cut.
        let burst: Vec<PreAuth> = (0..6).map(|_| adm.admit(ip(1)).unwrap()).collect();
        assert_eq!(stats.snapshot().count(Cause::Evicted), 0);
        // At the connection cap (6) with every pending connection young: refused.
        assert!(adm.admit(ip(2)).is_none());
        assert_eq!(stats.snapshot().count(Cause::Busy), 1);
        // Each of the burst still completes its handshake.
        let mut admitted = Vec::new();
        for (i, p) in burst.into_iter().enumerate() {
            let name = format!("frontend-{i}");
            admitted.push(p.authenticate(ok(&name)).await.expect("admitted"));
        }
        assert_eq!(stats.snapshot().admitted, 6);
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_handshake_times_out() {
        let stats = Arc::new(PortStats::new("test"));
        let adm = Admission::new(limits(), stats.clone());
        let p = adm.admit(ip(1)).unwrap();
        let never = std::future::pending::<Result<String, std::io::Error>>();
        assert!(p.authenticate(never).await.is_none());
        assert_eq!(stats.snapshot().count(Cause::Handshake), 1);
        assert_eq!(stats.snapshot().pending, 0);
    }
}
