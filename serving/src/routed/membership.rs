//! Who the routed backend can send requests to: workers and fabric nodes joining and leaving
//! discovery, their load reports, and the workers avoided (slow, refused, of another protocol
//! version).

use super::*;

impl Inner {
    /// The routing mode, as `explain` and dashboards name it.
    pub(super) fn mode_name(&self) -> String {
        format!("{:?}", self.cfg.router.mode).to_lowercase()
    }

    pub(super) async fn join(self: &Arc<Self>, inst: Instance) {
        let md: WorkerMetadata = match serde_json::from_value(inst.metadata.clone()) {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(worker = %inst.id, error = %e, "ignoring a worker with unreadable metadata");
                return;
            }
        };
        let cached = self.codecs.lock().get(&md.codec).cloned();
        let codec = match cached {
            Some(c) => c,
            None => {
                let spec = md.codec.clone();
                match tokio::task::spawn_blocking(move || TextCodec::from_spec(&spec)).await {
                    Ok(Ok(c)) => {
                        let c = Arc::new(c);
                        self.codecs.lock().insert(md.codec.clone(), c.clone());
                        c
                    }
                    Ok(Err(e)) => {
                        tracing::warn!(worker = %inst.id, error = %e, "ignoring a worker whose tokenizer cannot be loaded");
                        return;
                    }
                    Err(_) => return,
                }
            }
        };
        let wid = worker_id(&inst.id);
        self.index.add_worker(wid);
        self.feed.follow(&inst.id);
        let mut st = self.state.lock();
        // What a dashboard knows of it (its last report, the requests sent to it) carries
        // over a re-registration or a return.
        let mut before = None;
        if let Some(old) = st.workers.remove(&inst.id) {
            // Re-registered (new address or model): forget the old routing entry.
            if let Some(m) = st.models.get_mut(&old.model) {
                m.router.remove_worker(old.wid);
                m.workers -= 1;
            }
            before = Some(old);
        }
        if let Some(i) = st.departed.iter().position(|d| d.name == inst.id) {
            let gone = st.departed.remove(i).map(|d| d.entry);
            before = before.or(gone);
        }
        let bt = md.model.layout.block_tokens;
        let Ok(hasher) = TokenBlockHasher::new(bt as usize, HashSeed::default()) else {
            tracing::warn!(worker = %inst.id, "ignoring a worker with 0 tokens per block");
            return;
        };
        let model = st.models.entry(md.model.id.clone()).or_insert_with(|| {
            let cfg = RouterConfig { block_tokens: bt, ..self.cfg.router.clone() };
            ModelState {
                entry: ModelEntry { info: md.model.clone(), codec },
                router: Router::new(cfg),
                hasher,
                workers: 0,
            }
        });
        model.router.add_worker(wid);
        model.workers += 1;
        tracing::info!(worker = %inst.id, addr = %md.addr, model = %md.model.id, role = ?md.role, "worker joined");
        // A worker of another protocol version could not read our frames: known at join,
        // shown, never routed to.
        let incompatible = match md.api {
            WorkerApi::Kvfabric { protocol: v } if v != protocol::PROTOCOL => {
                let why = format!(
                    "speaks worker protocol {v}, this frontend speaks {} (run one release on \
                     frontends and workers)",
                    protocol::PROTOCOL
                );
                tracing::warn!(worker = %inst.id, reason = %why, "a worker this frontend cannot talk to joined; left out of routing");
                Some((Instant::now() + INCOMPATIBLE_FOR, why))
            }
            WorkerApi::Kvfabric { .. } => {
                self.probe(inst.id.clone(), md.addr);
                None
            }
            WorkerApi::OpenAi { .. } => None,
        };
        st.by_id.insert(wid, inst.id.clone());
        let role = match (&md.api, md.role) {
            (WorkerApi::OpenAi { .. }, _) => "engine",
            (_, protocol::Role::Aggregated) => "aggregated",
            (_, protocol::Role::Prefill) => "prefill",
            (_, protocol::Role::Decode) => "decode",
        };
        st.workers.insert(
            inst.id,
            WorkerEntry {
                wid,
                addr: md.addr,
                api: md.api,
                model: md.model.id,
                served: before.as_ref().map_or(0, |b| b.served),
                penalty_until: None,
                refused: incompatible,
                role,
                load: before.as_ref().map_or_else(contract::Load::default, |b| b.load),
                stats: before.as_mut().and_then(|b| b.stats.take()),
                reported: before.as_ref().and_then(|b| b.reported),
            },
        );
    }

    /// A fabric node joined discovery: its events go to the index from now on.
    pub(super) fn join_fabric(&self, inst: Instance) {
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
        let mut st = self.state.lock();
        if st.by_id.contains_key(&wid) {
            tracing::warn!(node = %inst.id, "ignoring a fabric node named as a worker is");
            return;
        }
        if !st.fabric.contains_key(&inst.id) && st.fabric.len() >= FABRIC_MAX {
            tracing::warn!(node = %inst.id, max = FABRIC_MAX, "ignoring a fabric node: too many");
            return;
        }
        self.index.add_worker(wid);
        self.feed.follow(&inst.id);
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

    pub(super) fn leave_fabric(&self, name: &str) {
        let Some(f) = self.state.lock().fabric.remove(name) else { return };
        self.index.remove_worker(f.wid);
        self.feed.unfollow(name);
        tracing::info!(node = %name, "fabric node left");
    }

    pub(super) fn leave(&self, name: &str) {
        let mut st = self.state.lock();
        let Some(w) = st.workers.remove(name) else { return };
        tracing::info!(worker = %name, "worker left");
        self.pool.forget(w.addr, name);
        self.feed.unfollow(name);
        let (wid, model) = (w.wid, w.model.clone());
        if st.departed.len() >= DEPARTED_MAX {
            st.departed.pop_front();
        }
        st.departed.push_back(Departed { name: name.to_string(), left: Instant::now(), entry: w });
        st.by_id.remove(&wid);
        self.index.remove_worker(wid);
        let gone = match st.models.get_mut(&model) {
            Some(m) => {
                m.router.remove_worker(wid);
                m.workers -= 1;
                m.workers == 0
            }
            None => false,
        };
        if gone {
            st.models.remove(&model);
        }
    }

    pub(super) fn on_load(&self, bytes: &[u8]) {
        let Ok(Message::Load { source, load, stats }) = Message::decode(bytes) else { return };
        // A lag beyond an hour is a clock, not the bus: not shown.
        let lag_ms = stats.as_ref().and_then(|s| {
            let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).ok()?;
            Some((now.as_millis() as f64 - s.sent_at_ms as f64).max(0.0))
                .filter(|l| *l <= 3_600_000.0)
        });
        let mut st = self.state.lock();
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
        }
    }

    /// A worker did not answer (no connection, no handshake or no first token in time):
    /// avoid it for a while.
    pub(super) fn penalise(&self, name: &str) {
        self.stats.slow_workers.fetch_add(1, Ordering::Relaxed);
        if let Some(w) = self.state.lock().workers.get_mut(name) {
            w.penalty_until = Some(Instant::now() + self.cfg.slow_penalty);
        }
    }

    /// Checks in the background that a worker that joined accepts this frontend's secret.
    pub(super) fn probe(self: &Arc<Self>, name: String, addr: SocketAddr) {
        let this = Arc::downgrade(self);
        let auth = Auth { name: self.cfg.name.clone(), secret: self.cfg.secret.clone() };
        let timeout = self.cfg.connect_timeout;
        tokio::spawn(async move {
            if let Err(e) = protocol::probe(addr, &name, &auth, timeout).await {
                if let Some(this) = this.upgrade().filter(|_| e.is_auth()) {
                    this.refuse(&name, &e);
                }
            }
        });
    }

    /// A worker's handshake failed on the secret, or it answered in another protocol version:
    /// out of routing (for [`REFUSED_RETRY`], or [`INCOMPATIBLE_FOR`]), counted, logged once
    /// per worker until it serves again.
    pub(super) fn refuse(&self, name: &str, e: &protocol::FrameError) {
        let (why, until) = if e.is_version() {
            (e.to_string(), Instant::now() + INCOMPATIBLE_FOR)
        } else {
            self.stats.auth_failures.fetch_add(1, Ordering::Relaxed);
            (format!("refused this frontend's secret ({e})"), Instant::now() + REFUSED_RETRY)
        };
        if let Some(w) = self.state.lock().workers.get_mut(name) {
            if w.refused.is_none() {
                tracing::warn!(worker = %name, reason = %why, "no request can reach a worker; \
                    left out of routing");
            }
            w.refused = Some((until, why));
        }
    }

    /// A worker answered in time: it is no longer avoided.
    pub(super) fn forgive(&self, name: &str) {
        if let Some(w) = self.state.lock().workers.get_mut(name) {
            w.penalty_until = None;
            w.refused = None;
        }
    }
}

/// A report off the bus, cut to what a dashboard shows: a transport per kind, short names.
pub(super) fn bounded(mut s: Box<contract::WorkerStats>) -> Box<contract::WorkerStats> {
    let short = |x: &mut String| {
        if x.len() > 32 {
            *x = x.chars().take(32).collect();
        }
    };
    s.transfers.truncate(kvfabric::transfer::TransportKind::ALL.len());
    for t in &mut s.transfers {
        short(&mut t.transport);
    }
    short(&mut s.role);
    s
}
