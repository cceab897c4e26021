//! The live side of an engine's KV events: a SUB socket on the engine's PUB endpoint (or
//! bound, for an engine that connects), a DEALER on its replay endpoint, and the
//! [`Sequencer`] between them. Out come the engine's batches in sequence order, and resets
//! where events were lost for good.

use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

use super::sequence::{Action, Sequencer};
use super::zmtp::{tcp_address, Connection, Limits, SocketType, ZmtpError};

/// Where the engine's events come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventsEndpoint {
    /// The engine binds its PUB socket (vLLM: an endpoint with `*`): connect to it.
    Connect(String),
    /// The engine connects its PUB socket (vLLM: `tcp://host:port` without `*`): bind here.
    Bind(String),
}

/// Subscriber settings.
#[derive(Debug, Clone)]
pub struct SubscriberConfig {
    /// The PUB side.
    pub events: EventsEndpoint,
    /// The engine's replay ROUTER (`tcp://host:port`), if it has one.
    pub replay: Option<String>,
    /// The topic (prefix) subscribed to; vLLM's default is empty, `kv` is common.
    pub topic: Vec<u8>,
    /// Bounds on messages.
    pub limits: Limits,
    /// Connecting and the ZMTP handshake give up after this.
    pub handshake_timeout: Duration,
    /// A replay that has not ended within this has failed.
    pub replay_timeout: Duration,
    /// Longest wait between connection attempts.
    pub backoff_max: Duration,
    /// Live batches held during a replay, at most.
    pub held_max: usize,
    /// Publishers connected at once, at most (bound endpoint). A connection past it takes the
    /// place of the quietest one: a publisher that never delivered a message before one that
    /// did, then the one silent the longest; so idle strangers cannot keep the engine out.
    pub connections_max: usize,
    /// After a (re)connection, replay is asked again this often ([`Sequencer::catch_up`])
    /// until the live stream delivers its first batch, at most [`CATCH_UPS`] times.
    pub catch_up: Duration,
}

impl SubscriberConfig {
    /// Defaults for `events`.
    pub fn new(events: EventsEndpoint) -> Self {
        SubscriberConfig {
            events,
            replay: None,
            topic: Vec::new(),
            limits: Limits::default(),
            handshake_timeout: Duration::from_secs(5),
            replay_timeout: Duration::from_secs(10),
            backoff_max: Duration::from_secs(2),
            held_max: 8192,
            connections_max: 4,
            catch_up: Duration::from_secs(1),
        }
    }
}

/// Catch-up replays after a (re)connection, at most (one per `catch_up` interval until the
/// engine's first live batch arrives; an idle engine answers each with the end marker).
pub const CATCH_UPS: u32 = 30;

/// What the subscriber delivers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FeedItem {
    /// A batch, in sequence order.
    Batch {
        /// The engine's sequence number.
        seq: u64,
        /// The msgpack payload.
        payload: Vec<u8>,
    },
    /// Events were lost for good: drop what is known of the engine, rebuild from what follows.
    Reset {
        /// Why.
        reason: String,
    },
    /// The live stream is up.
    Connected {
        /// The publisher's address.
        peer: String,
    },
    /// The live stream went down (it is retried).
    Disconnected {
        /// Why.
        reason: String,
    },
    /// A message that is not `[topic, seq, payload]`.
    Malformed {
        /// What was wrong.
        reason: String,
    },
    /// The replay endpoint could not be asked, or its answer broke off (the gap it was to
    /// fill becomes a reset).
    ReplayFailed {
        /// Why.
        reason: String,
    },
}

/// A running subscriber; dropping it stops it.
#[derive(Debug)]
pub struct Subscriber {
    rx: mpsc::Receiver<FeedItem>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    bound: Option<std::net::SocketAddr>,
}

impl Drop for Subscriber {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

enum Live {
    Up(String),
    Message(Vec<Vec<u8>>),
    Down(String),
}

enum Replayed {
    Batch(u64, Vec<u8>),
    End,
    Failed(String),
}

impl Subscriber {
    /// Starts subscribing (binding first, for a bound endpoint).
    pub async fn start(cfg: SubscriberConfig) -> Result<Subscriber, ZmtpError> {
        let (live_tx, live_rx) = mpsc::channel::<Live>(1024);
        let (tx, rx) = mpsc::channel(1024);
        let mut tasks = Vec::new();
        let mut bound = None;
        match &cfg.events {
            EventsEndpoint::Connect(ep) => {
                let addr = tcp_address(ep).map_err(ZmtpError::Handshake)?;
                tasks.push(tokio::spawn(connect_loop(addr, cfg.clone(), live_tx)));
            }
            EventsEndpoint::Bind(ep) => {
                let addr = tcp_address(ep).map_err(ZmtpError::Handshake)?;
                let listener = TcpListener::bind(&addr).await?;
                bound = Some(listener.local_addr()?);
                tasks.push(tokio::spawn(accept_loop(listener, cfg.clone(), live_tx)));
            }
        }
        tasks.push(tokio::spawn(sequence_loop(cfg, live_rx, tx)));
        Ok(Subscriber { rx, tasks, bound })
    }

    /// The address bound (a bound endpoint).
    pub fn bound(&self) -> Option<std::net::SocketAddr> {
        self.bound
    }

    /// The next item; None once stopped.
    pub async fn recv(&mut self) -> Option<FeedItem> {
        self.rx.recv().await
    }
}

/// What a bound endpoint knows of a connected publisher: when it last delivered a message
/// (or connected), whether it ever did, and how to close it.
struct Slot {
    active: std::time::Instant,
    delivered: bool,
    evict: Option<tokio::sync::oneshot::Sender<()>>,
}

type Slots = std::sync::Arc<parking_lot::Mutex<std::collections::HashMap<u64, Slot>>>;

/// Runs one SUB connection until it fails; `seen` is told of every message.
async fn serve_sub(
    stream: TcpStream,
    peer: String,
    cfg: &SubscriberConfig,
    tx: &mpsc::Sender<Live>,
    seen: &(dyn Fn() + Send + Sync),
) -> String {
    let _ = stream.set_nodelay(true);
    let mut conn =
        match Connection::handshake(stream, SocketType::Sub, cfg.limits, cfg.handshake_timeout)
            .await
        {
            Ok(c) => c,
            Err(e) => return e.to_string(),
        };
    if let Err(e) = conn.subscribe(&cfg.topic).await {
        return e.to_string();
    }
    if tx.send(Live::Up(peer)).await.is_err() {
        return "stopped".into();
    }
    loop {
        match conn.recv().await {
            Ok(m) => {
                seen();
                if tx.send(Live::Message(m)).await.is_err() {
                    return "stopped".into();
                }
            }
            Err(e) => return e.to_string(),
        }
    }
}

async fn connect_loop(addr: String, cfg: SubscriberConfig, tx: mpsc::Sender<Live>) {
    let mut backoff = Duration::from_millis(50);
    loop {
        let why = match tokio::time::timeout(cfg.handshake_timeout, TcpStream::connect(&addr)).await
        {
            Ok(Ok(s)) => {
                backoff = Duration::from_millis(50);
                serve_sub(s, addr.clone(), &cfg, &tx, &|| {}).await
            }
            Ok(Err(e)) => format!("connecting to {addr}: {e}"),
            Err(_) => format!("connecting to {addr}: no answer within {:?}", cfg.handshake_timeout),
        };
        if tx.send(Live::Down(why)).await.is_err() {
            return;
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(cfg.backoff_max);
    }
}

async fn accept_loop(listener: TcpListener, cfg: SubscriberConfig, tx: mpsc::Sender<Live>) {
    let slots: Slots = Default::default();
    let mut next = 0u64;
    loop {
        let Ok((stream, peer)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let (evict_tx, mut evicted) = tokio::sync::oneshot::channel();
        let id = next;
        next += 1;
        {
            let mut s = slots.lock();
            if s.len() >= cfg.connections_max.max(1) {
                // The quietest publisher gives way: never delivered before delivered, then
                // silent the longest.
                let victim = s
                    .iter()
                    .filter(|(_, v)| v.evict.is_some())
                    .min_by_key(|(_, v)| (v.delivered, v.active))
                    .map(|(k, _)| *k);
                match victim.and_then(|k| s.get_mut(&k)).and_then(|v| v.evict.take()) {
                    Some(evict) => {
                        let _ = evict.send(());
                    }
                    None => {
                        drop(stream); // every slot is closing already: refused
                        continue;
                    }
                }
            }
            let now = std::time::Instant::now();
            s.insert(id, Slot { active: now, delivered: false, evict: Some(evict_tx) });
        }
        let (cfg, tx, slots) = (cfg.clone(), tx.clone(), slots.clone());
        tokio::spawn(async move {
            let seen = {
                let slots = slots.clone();
                move || {
                    if let Some(v) = slots.lock().get_mut(&id) {
                        v.active = std::time::Instant::now();
                        v.delivered = true;
                    }
                }
            };
            let why = tokio::select! {
                why = serve_sub(stream, peer.to_string(), &cfg, &tx, &seen) => why,
                Ok(()) = &mut evicted => "closed to make room for a newer publisher (this one was the quietest)".to_string(),
            };
            slots.lock().remove(&id);
            let _ = tx.send(Live::Down(format!("{peer}: {why}"))).await;
        });
    }
}

/// Asks the replay endpoint for every batch from `from` on.
async fn replay(addr: String, from: u64, cfg: SubscriberConfig, tx: mpsc::Sender<Replayed>) {
    let run = async {
        let stream = TcpStream::connect(&addr).await?;
        let _ = stream.set_nodelay(true);
        let mut c =
            Connection::handshake(stream, SocketType::Dealer, cfg.limits, cfg.handshake_timeout)
                .await?;
        c.send(&[b"", &from.to_be_bytes()]).await?;
        loop {
            let m = c.recv().await?;
            // ["", seq, payload] (vLLM, SGLang) or ["", topic, seq, payload] (vLLM 0.32).
            let (seq, payload) = match m.as_slice() {
                [d, s, p] if d.is_empty() => (s, p),
                [d, _topic, s, p] if d.is_empty() => (s, p),
                _ => return Err(ZmtpError::Protocol("a replay message of an unknown shape")),
            };
            let seq: [u8; 8] = seq
                .as_slice()
                .try_into()
                .map_err(|_| ZmtpError::Protocol("a sequence is 8 bytes"))?;
            if seq == [0xff; 8] {
                let _ = tx.send(Replayed::End).await;
                return Ok(());
            }
            if tx.send(Replayed::Batch(u64::from_be_bytes(seq), payload.to_vec())).await.is_err() {
                return Ok(());
            }
        }
    };
    let outcome = tokio::time::timeout(cfg.replay_timeout, run).await;
    let failed = match outcome {
        Ok(Ok(())) => return,
        Ok(Err(e)) => format!("replay from {addr}: {e}"),
        Err(_) => format!("replay from {addr}: not finished within {:?}", cfg.replay_timeout),
    };
    let _ = tx.send(Replayed::Failed(failed)).await;
}

async fn sequence_loop(
    cfg: SubscriberConfig,
    mut live: mpsc::Receiver<Live>,
    tx: mpsc::Sender<FeedItem>,
) {
    let replay_addr = cfg.replay.as_deref().map(tcp_address);
    let replay_addr = match replay_addr {
        Some(Ok(a)) => Some(a),
        Some(Err(e)) => {
            let _ =
                tx.send(FeedItem::ReplayFailed { reason: format!("replay endpoint: {e}") }).await;
            None
        }
        None => None,
    };
    let mut seq: Sequencer<Vec<u8>> = Sequencer::new(replay_addr.is_some(), cfg.held_max);
    let (rtx, mut rrx) = mpsc::channel::<Replayed>(1024);
    let mut actions = Vec::new();
    let mut replay_task: Option<tokio::task::JoinHandle<()>> = None;
    let mut catch_up: Option<tokio::time::Instant> = None;
    // Catch-up replays left before the live stream has delivered anything since the last
    // (re)connection.
    let mut catch_ups_left = 0u32;
    loop {
        let catch_up_at =
            catch_up.unwrap_or_else(|| tokio::time::Instant::now() + Duration::from_secs(3600));
        tokio::select! {
            _ = tokio::time::sleep_until(catch_up_at), if catch_up.is_some() => {
                seq.catch_up(&mut actions);
                catch_ups_left = catch_ups_left.saturating_sub(1);
                catch_up = (catch_ups_left > 0)
                    .then(|| tokio::time::Instant::now() + cfg.catch_up);
            }
            l = live.recv() => match l {
                None => return,
                Some(Live::Up(peer)) => {
                    if tx.send(FeedItem::Connected { peer }).await.is_err() { return; }
                    seq.connected(&mut actions);
                    catch_up = Some(tokio::time::Instant::now() + cfg.catch_up);
                    catch_ups_left = CATCH_UPS;
                }
                Some(Live::Down(reason)) => {
                    if tx.send(FeedItem::Disconnected { reason }).await.is_err() { return; }
                }
                Some(Live::Message(m)) => match m.as_slice() {
                    [_topic, s, p] if s.len() == 8 => {
                        let mut b = [0u8; 8];
                        b.copy_from_slice(s);
                        let p = p.to_vec();
                        // The engine sends to us: no more catch-ups needed.
                        catch_up = None;
                        catch_ups_left = 0;
                        seq.live(u64::from_be_bytes(b), p, &mut actions);
                    }
                    _ => {
                        let reason = format!("a message of {} frames is not [topic, seq, payload]", m.len());
                        if tx.send(FeedItem::Malformed { reason }).await.is_err() { return; }
                    }
                },
            },
            r = rrx.recv() => match r {
                Some(Replayed::Batch(s, p)) => seq.replayed(s, p, &mut actions),
                Some(Replayed::End) => seq.replay_ended(&mut actions),
                Some(Replayed::Failed(why)) => {
                    seq.replay_failed(&why, &mut actions);
                    if tx.send(FeedItem::ReplayFailed { reason: why }).await.is_err() { return; }
                }
                None => return,
            },
        }
        for a in actions.drain(..) {
            let item = match a {
                Action::Apply { seq, payload } => FeedItem::Batch { seq, payload },
                Action::Reset { reason } => FeedItem::Reset { reason },
                Action::AskReplay { from } => {
                    if let Some(addr) = &replay_addr {
                        if let Some(t) = replay_task.take() {
                            t.abort();
                        }
                        replay_task = Some(tokio::spawn(replay(
                            addr.clone(),
                            from,
                            cfg.clone(),
                            rtx.clone(),
                        )));
                    }
                    continue;
                }
            };
            if tx.send(item).await.is_err() {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::zmtp::{fake_message, fake_peer};
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn idle_peers_on_a_bound_endpoint_give_way_to_the_engine() {
        let mut cfg = SubscriberConfig::new(EventsEndpoint::Bind("tcp://127.0.0.1:0".into()));
        cfg.connections_max = 4;
        let mut sub = Subscriber::start(cfg).await.unwrap();
        let addr = sub.bound().unwrap();
        // Four strangers connect as publishers and never publish.
        let mut idle = Vec::new();
        for _ in 0..4 {
            let s = TcpStream::connect(addr).await.unwrap();
            idle.push(tokio::spawn(fake_peer(s, b"PUB", Vec::new())));
        }
        let mut up = 0;
        while up < 4 {
            if let Some(FeedItem::Connected { .. }) = sub.recv().await {
                up += 1;
            }
        }
        // The engine connects and publishes: it takes a stranger's place, and its batch
        // comes through.
        let s = TcpStream::connect(addr).await.unwrap();
        let batch = fake_message(&[b"kv", &0u64.to_be_bytes(), b"payload"]);
        let engine = tokio::spawn(fake_peer(s, b"PUB", batch));
        let got = tokio::time::timeout(Duration::from_secs(10), async {
            let mut evicted = 0;
            loop {
                match sub.recv().await {
                    Some(FeedItem::Batch { seq, payload }) => return (seq, payload, evicted),
                    Some(FeedItem::Disconnected { reason }) if reason.contains("quietest") => {
                        evicted += 1
                    }
                    Some(_) => {}
                    None => panic!("the subscriber stopped"),
                }
            }
        })
        .await
        .expect("the engine's batch within 10 s");
        assert_eq!((got.0, got.1.as_slice(), got.2), (0, &b"payload"[..], 1));
        // A later stranger evicts another stranger, not the engine that delivered.
        let s = TcpStream::connect(addr).await.unwrap();
        let _late = tokio::spawn(fake_peer(s, b"PUB", Vec::new()));
        let s = TcpStream::connect(addr).await.unwrap();
        let second = fake_message(&[b"kv", &1u64.to_be_bytes(), b"more"]);
        let _engine2 = tokio::spawn(fake_peer(s, b"PUB", second));
        let got = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                if let Some(FeedItem::Batch { seq, .. }) = sub.recv().await {
                    return seq;
                }
            }
        })
        .await
        .unwrap();
        assert_eq!(got, 1);
        assert!(!engine.is_finished(), "the engine that delivered was kept");
        for t in idle {
            t.abort();
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_refused_replay_is_reported_as_such_not_as_a_malformed_event() {
        // Nothing listens on port 1 of loopback: the replay is refused.
        let mut cfg = SubscriberConfig::new(EventsEndpoint::Bind("tcp://127.0.0.1:0".into()));
        cfg.replay = Some("tcp://127.0.0.1:1".into());
        cfg.catch_up = Duration::from_millis(50);
        let mut sub = Subscriber::start(cfg).await.unwrap();
        let s = TcpStream::connect(sub.bound().unwrap()).await.unwrap();
        let _engine = tokio::spawn(fake_peer(s, b"PUB", Vec::new()));
        let item = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                match sub.recv().await {
                    Some(i @ (FeedItem::ReplayFailed { .. } | FeedItem::Malformed { .. })) => {
                        return i
                    }
                    Some(_) => {}
                    None => panic!("stopped"),
                }
            }
        })
        .await
        .unwrap();
        assert!(
            matches!(&item, FeedItem::ReplayFailed { reason } if reason.contains("127.0.0.1:1")),
            "{item:?}"
        );
    }
}
