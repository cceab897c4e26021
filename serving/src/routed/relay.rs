//! A request's way through the routed backend: routed, sent to a worker (kvfabric's request
//! port, or an engine's OpenAI API), its events relayed; retried on another worker before its
//! first token, moved to another after it when its worker stalls or breaks.

use super::*;

/// An engine behind the OpenAI API, as it registered: its model name, and whether it
/// schedules by `priority`.
#[derive(Clone, Copy)]
struct OpenAiEngine<'a> {
    model: &'a str,
    priority: bool,
}

impl Inner {
    pub(super) async fn drive(
        self: Arc<Self>,
        model: String,
        mut req: GenerateRequest,
        tx: EventTx,
    ) {
        let arrival = tokio::time::Instant::now();
        let deadline = arrival + req.timeout;
        // A slot of the frontend's queue, held until the request ends.
        let _slot = if self.pending.enabled() {
            let workers =
                self.members.read(|m| m.workers.values().filter(|w| w.model == model).count());
            let capacity = self.pending.capacity(workers);
            let admitted = self
                .pending
                .admit(&model, req.class.as_ref(), arrival, deadline, capacity, tx.closed())
                .await;
            match admitted {
                pending::Admitted::Go { permit, waited } => {
                    // The engine orders and expires it from its arrival here, not there.
                    if let Some(c) = req.class.as_mut() {
                        let left =
                            |d: Duration| d.saturating_sub(waited).max(Duration::from_millis(1));
                        c.ttft = c.ttft.map(left);
                        c.expire = c.expire.map(left);
                    }
                    req.timeout = deadline.saturating_duration_since(tokio::time::Instant::now());
                    Some(permit)
                }
                pending::Admitted::Refused(e) => {
                    let _ = tx.send(GenEvent::Error(e));
                    return;
                }
                pending::Admitted::Gone => return,
            }
        } else {
            None
        };
        let mut tried: Vec<WorkerId> = Vec::new();
        let mut last_err: Option<String> = None;
        // While every attempt was refused for a full queue: the refusal that expects to take
        // a retry soonest (the client gets it, 429 with its Retry-After, if none serves).
        let mut overloaded: Option<EngineError> = None;
        let mut only_overloaded = true;
        let (prompt, max_tokens) = (req.prompt.clone(), req.max_tokens);
        let mut wreq = WorkerRequest { model: model.clone(), request: req };
        let mut progress = Progress { ids_known: true, ..Progress::default() };
        let mut migrations = 0u32;
        let mut held = false;
        for attempt in 0..self.cfg.attempts_max.max(1) {
            let rid = self.next_id.fetch_add(1, Ordering::Relaxed);
            let r = &wreq.request;
            // A latency class (one with an ITL target) weighs queue delay over reuse.
            let latency = r.class.as_ref().is_some_and(|c| c.itl.is_some());
            let opts = RouteOptions {
                salt: r.cache_salt.as_deref(),
                reuse: if latency { self.cfg.latency_reuse_weight } else { 1.0 },
            };
            // A model whose every worker left lately (a one-worker pool restarting): wait,
            // within the deadline, for one to join rather than fail.
            let pick = loop {
                match self.members.route_with(&model, rid, &r.prompt, &tried, opts) {
                    Some(p) => break Some(p),
                    None if self
                        .members
                        .vacated_for(&model)
                        .is_some_and(|ago| ago < self.cfg.restart_wait)
                        && tokio::time::Instant::now() + VACATED_POLL < deadline =>
                    {
                        if !std::mem::replace(&mut held, true) {
                            self.stats.held_for_worker.fetch_add(1, Ordering::Relaxed);
                        }
                        tokio::select! {
                            _ = tokio::time::sleep(VACATED_POLL) => {}
                            _ = tx.closed() => return,
                        }
                    }
                    None => break None,
                }
            };
            let Some(pick) = pick else { break };
            let (name, addr, api) = (pick.name, pick.addr, pick.api);
            self.stats.routed.fetch_add(1, Ordering::Relaxed);
            let path = kvfabric_router::Path::ALL.iter().position(|&p| p == pick.path);
            self.stats.paths[path.unwrap_or(0)].fetch_add(1, Ordering::Relaxed);
            // Told where its prefix is, when pulling it beats computing it (a stream moved to
            // another worker is told afresh).
            wreq.request.pull = pick.pull;
            if attempt > 0 {
                self.stats.retries.fetch_add(1, Ordering::Relaxed);
            }
            let target = Target { model: &model, rid, name: &name, addr };
            let outcome = match &api {
                WorkerApi::Kvfabric { .. } => {
                    self.relay(target, &wreq, &tx, deadline, &mut progress).await
                }
                WorkerApi::OpenAi { model: engine_model, priority } => {
                    self.relay_openai(
                        target,
                        OpenAiEngine { model: engine_model, priority: *priority },
                        &wreq.request,
                        &tx,
                        deadline,
                        &mut progress,
                    )
                    .await
                }
            };
            self.members.free(&model, rid);
            match outcome {
                Relay::Finished => return,
                Relay::Retry(why) => {
                    tracing::info!(worker = %name, reason = %why, "retrying on another worker");
                    tried.push(worker_id(&name));
                    last_err = Some(format!("worker {name}: {why}"));
                    only_overloaded = false;
                }
                Relay::Overloaded(e) => {
                    tracing::debug!(worker = %name, reason = %e, "overloaded: trying another worker");
                    tried.push(worker_id(&name));
                    last_err = Some(format!("worker {name}: {e}"));
                    let after = |e: &EngineError| match e {
                        EngineError::Overloaded { retry_after_ms, .. } => {
                            retry_after_ms.unwrap_or(u64::MAX)
                        }
                        _ => u64::MAX,
                    };
                    if overloaded.as_ref().is_none_or(|o| after(&e) < after(o)) {
                        overloaded = Some(e);
                    }
                }
                Relay::Failed(why) => {
                    only_overloaded = false;
                    tried.push(worker_id(&name));
                    let left = max_tokens.saturating_sub(progress.generated.len());
                    let can_move = migrations < self.cfg.migrations_max
                        && progress.ids_known
                        && tokio::time::Instant::now() < deadline;
                    if can_move && left == 0 {
                        let _ = tx.send(GenEvent::Done {
                            reason: crate::engine::FinishReason::Length,
                            completion_tokens: progress.generated.len(),
                            text: String::new(),
                        });
                        return;
                    }
                    if !can_move {
                        self.stats.failed_mid_stream.fetch_add(1, Ordering::Relaxed);
                        let e = EngineError::model(format!(
                            "worker {name} failed after streaming had started: {why}"
                        ));
                        let _ = tx.send(GenEvent::Error(e));
                        return;
                    }
                    // The next worker continues from the prompt and the tokens sent.
                    migrations += 1;
                    self.stats.migrations.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(worker = %name, reason = %why, tokens = progress.generated.len(),
                        "a stream broke after its first token: moving it to another worker");
                    wreq.request.prompt = [&prompt[..], &progress.generated[..]].concat();
                    wreq.request.max_tokens = left;
                    progress.moved = true;
                    progress.counted_before = progress.generated.len();
                    last_err = Some(format!("worker {name}: {why}"));
                }
            }
            let now = tokio::time::Instant::now();
            if now >= deadline {
                let _ = tx
                    .send(GenEvent::Error(EngineError::Deadline { timeout: wreq.request.timeout }));
                return;
            }
            wreq.request.timeout = deadline - now;
        }
        if let Some(e) = overloaded.filter(|_| only_overloaded) {
            // Every worker tried is overloaded: the client is told to come back later (429
            // and Retry-After), as one engine would tell it.
            self.stats.overloaded.fetch_add(1, Ordering::Relaxed);
            let _ = tx.send(GenEvent::Error(e));
            return;
        }
        self.stats.no_worker.fetch_add(1, Ordering::Relaxed);
        let now = Instant::now();
        let mut refused: Vec<String> = self.members.read(|st| {
            st.workers
                .iter()
                .filter(|(_, w)| w.model == model)
                .filter_map(|(n, w)| w.refused_now(now).map(|why| format!("{n} {why}")))
                .collect()
        });
        refused.sort();
        let msg = match last_err {
            Some(e) => format!("no worker could serve {model:?} ({e})"),
            None if !refused.is_empty() => {
                format!("no worker can serve {model:?}: {}", refused.join("; "))
            }
            None => format!("no worker serves {model:?} now"),
        };
        let _ = tx.send(GenEvent::Error(EngineError::Unavailable { message: msg }));
    }

    async fn relay(
        &self,
        t: Target<'_>,
        wreq: &WorkerRequest,
        tx: &EventTx,
        deadline: tokio::time::Instant,
        progress: &mut Progress,
    ) -> Relay {
        let Target { model, rid, name, addr } = t;
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let auth = Auth {
            name: self.cfg.name.clone(),
            secret: self.cfg.secret.clone(),
            tls: self.cfg.tls.clone(),
        };
        let timeout = self.cfg.connect_timeout.min(left);
        let mut conn = match self.pool.request(addr, name, &auth, wreq, timeout).await {
            Ok(c) => c,
            Err(e) if e.is_auth() || e.is_version() => {
                self.refuse(name, &e);
                return Relay::Retry(e.to_string());
            }
            Err(e) => {
                // Refused, or no handshake in time (a frozen process): avoid it too.
                self.penalise(name);
                return Relay::Retry(e.to_string());
            }
        };
        // Whether any event came back on this connection yet.
        let mut answered = false;
        let mut sent_token = false;
        let mut first_token_by =
            (tokio::time::Instant::now() + self.cfg.first_token_timeout).min(deadline);
        // The worker's engine steps as of its last report: past the first-token limit, a
        // worker that still steps (and reports) is working through a long queue, and the
        // request waits on there; one that does not is frozen, and the request moves.
        let mut steps_seen = self.members.steps(name).map(|(_, s)| s);
        let mut waited_long = false;
        let mut paused = false;
        let mut steps_read = tokio::time::Instant::now();
        // `Started` is held until the first token: a request retried elsewhere reports the
        // worker that answered it.
        let mut started: Option<GenEvent> = None;
        let mut stall_by = deadline;
        loop {
            let until = if sent_token { stall_by.min(deadline) } else { first_token_by };
            // Looked at every second: a worker whose lease ran out while it went silent (its
            // host is dead or cut off) sends nothing more; its request moves now rather than
            // at the first-token or stall limit.
            let look = tokio::time::Instant::now() + LOST_CHECK;
            let frame = tokio::select! {
                f = tokio::time::timeout_at(until.min(look), conn.next()) => f,
                // The client went away: closing the connection cancels the worker's work.
                _ = tx.closed() => return Relay::Finished,
            };
            if frame.is_err() && look < until {
                if !self.members.lost(name, LOST_QUIET) {
                    continue;
                }
                self.stats.lost_workers.fetch_add(1, Ordering::Relaxed);
                let why = format!("worker {name} left discovery and went silent");
                return if sent_token { Relay::Failed(why) } else { Relay::Retry(why) };
            }
            // A kept connection that the worker closed before it read the request (it
            // restarted, or closed it idle just then): the same request on a new one.
            if conn.reused && !answered && matches!(frame, Ok(Ok(None) | Err(_))) {
                match self.pool.fresh(addr, name, &auth, wreq, timeout).await {
                    Ok(c) => conn = c,
                    Err(e) => {
                        self.penalise(name);
                        return Relay::Retry(e.to_string());
                    }
                }
                continue;
            }
            answered |= matches!(frame, Ok(Ok(Some(_))));
            let ev = match frame {
                Err(_) if !sent_token && until < deadline => {
                    if self.still_stepping(name, &mut steps_seen) {
                        if !std::mem::replace(&mut waited_long, true) {
                            self.stats.long_first_token_waits.fetch_add(1, Ordering::Relaxed);
                        }
                        first_token_by = (tokio::time::Instant::now()
                            + self.cfg.first_token_timeout)
                            .min(deadline);
                        continue;
                    }
                    self.penalise(name);
                    return Relay::Retry(format!(
                        "no first token within {:?}",
                        self.cfg.first_token_timeout
                    ));
                }
                Err(_) if until < deadline => {
                    // Paused, not stalled: the engine steps on without this stream (it
                    // yielded its batch slot to a more urgent class and waits to resume).
                    if self.still_stepping(name, &mut steps_seen) {
                        if !std::mem::replace(&mut paused, true) {
                            self.stats.paused_streams.fetch_add(1, Ordering::Relaxed);
                        }
                        stall_by = tokio::time::Instant::now() + self.cfg.stall_timeout;
                        continue;
                    }
                    self.penalise(name);
                    self.stats.stalled_streams.fetch_add(1, Ordering::Relaxed);
                    return Relay::Failed(format!("no token for {:?}", self.cfg.stall_timeout));
                }
                Err(_) => {
                    tracing::warn!(worker = %name, first_token = sent_token, "request deadline reached waiting for the worker's next event");
                    let _ = tx.send(GenEvent::Error(EngineError::Deadline {
                        timeout: wreq.request.timeout,
                    }));
                    return Relay::Finished;
                }
                Ok(Ok(Some(ev))) => ev,
                Ok(Ok(None)) => {
                    let why = "the worker closed the connection".to_string();
                    return if sent_token { Relay::Failed(why) } else { Relay::Retry(why) };
                }
                Ok(Err(e)) => {
                    if e.is_version() {
                        self.refuse(name, &e);
                    }
                    return if sent_token {
                        Relay::Failed(e.to_string())
                    } else {
                        Relay::Retry(e.to_string())
                    };
                }
            };
            match ev {
                GenEvent::Accepted { seq } => self.members.accepted(model, rid, seq),
                GenEvent::Started { prompt_tokens, cached, remote_prefill, .. } => {
                    // A stream that moved here has told its client how it started already.
                    if !progress.started_sent {
                        started = Some(GenEvent::Started {
                            prompt_tokens,
                            cached,
                            worker: Some(name.to_string()),
                            remote_prefill,
                        });
                    }
                }
                GenEvent::Token { id, .. } => {
                    stall_by = tokio::time::Instant::now() + self.cfg.stall_timeout;
                    // The engine's steps as of (about) this token: a pause later is told
                    // from a stall by whether it stepped since. Read a few times per stall
                    // limit, not per token (the members' lock).
                    if steps_read.elapsed() >= self.cfg.stall_timeout / 4 {
                        steps_read = tokio::time::Instant::now();
                        steps_seen = self.members.steps(name).map(|(_, s)| s).or(steps_seen);
                    }
                    if !sent_token {
                        sent_token = true;
                        self.members.prefill_done(model, rid);
                        self.members.forgive(name);
                        progress.send_started(tx, started.take());
                    }
                    progress.generated.push(id);
                    if tx.send(ev).is_err() {
                        return Relay::Finished;
                    }
                }
                GenEvent::Done { reason, text, completion_tokens } => {
                    self.pool.give_back(conn);
                    progress.send_started(tx, started.take());
                    // Counted over every worker the stream had.
                    let completion_tokens = progress.counted_before + completion_tokens;
                    let _ = tx.send(GenEvent::Done { reason, completion_tokens, text });
                    return Relay::Finished;
                }
                GenEvent::Cached(c) => match started.as_mut() {
                    Some(GenEvent::Started { cached: sc, .. }) => *sc = c,
                    _ if progress.started_sent && progress.moved => {}
                    _ => {
                        let _ = tx.send(GenEvent::Cached(c));
                    }
                },
                GenEvent::Error(e) => {
                    // The worker is done with the request; the connection is clean.
                    self.pool.give_back(conn);
                    if matches!(e, EngineError::Overloaded { .. }) && !sent_token {
                        return Relay::Overloaded(e);
                    }
                    if matches!(e, EngineError::Stopped) && !sent_token {
                        return Relay::Retry(e.to_string());
                    }
                    progress.send_started(tx, started.take());
                    let _ = tx.send(GenEvent::Error(e));
                    return Relay::Finished;
                }
            }
        }
    }
}

impl Inner {
    /// Whether worker `name` reported, within the last first-token limit, more engine steps
    /// than `seen` (which it then becomes).
    fn still_stepping(&self, name: &str, seen: &mut Option<u64>) -> bool {
        let Some((at, steps)) = self.members.steps(name) else { return false };
        let fresh = at.elapsed() < self.cfg.first_token_timeout;
        let advanced = seen.is_some_and(|s| steps > s);
        *seen = Some(steps);
        fresh && advanced
    }
}

/// How often a request for a model without workers looks for one that joined.
const VACATED_POLL: Duration = Duration::from_millis(100);

/// How often an attempt waiting on a worker looks whether the worker is lost.
const LOST_CHECK: Duration = Duration::from_secs(1);

/// A worker out of discovery that sent no load report for this long is lost (a draining one
/// reports several times a second until it stops).
const LOST_QUIET: Duration = Duration::from_secs(2);

/// The worker a request attempt goes to.
struct Target<'a> {
    model: &'a str,
    rid: u64,
    name: &'a str,
    addr: SocketAddr,
}

impl Inner {
    /// Serves an attempt on an engine behind its OpenAI-compatible API: the prompt goes as
    /// token ids to `/v1/completions`, streamed; the chunks become generation events. The
    /// same rules as for kvfabric's workers: no first token in time, or an error before it,
    /// and the request is retried elsewhere; after it, the request fails. Token ids are those
    /// the engine sends (`token_ids`), else 0: the text is what the client gets.
    async fn relay_openai(
        &self,
        t: Target<'_>,
        engine: OpenAiEngine<'_>,
        req: &GenerateRequest,
        tx: &EventTx,
        deadline: tokio::time::Instant,
        progress: &mut Progress,
    ) -> Relay {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let first_token_by =
            (tokio::time::Instant::now() + self.cfg.first_token_timeout).min(deadline);
        let body = openai::completion_body(engine.model, req, engine.priority);
        let head_within = self.cfg.first_token_timeout.min(left);
        let started = tokio::select! {
            s = openai::start(t.addr, &body, head_within) => s,
            _ = tx.closed() => return Relay::Finished,
        };
        let mut stream = match started {
            Ok(s) => s,
            Err(e) => {
                if matches!(e, openai::OpenAiError::Connect { .. }) {
                    self.penalise(t.name);
                }
                if let openai::OpenAiError::Status { status: 429, .. } = e {
                    let e = EngineError::Overloaded { waiting: 0, retry_after_ms: None };
                    return Relay::Overloaded(e);
                }
                if e.retryable() {
                    return Relay::Retry(e.to_string());
                }
                let _ = tx.send(GenEvent::Error(EngineError::invalid(e.to_string())));
                return Relay::Finished;
            }
        };
        let mut started = (!progress.started_sent).then(|| GenEvent::Started {
            prompt_tokens: req.prompt.len(),
            cached: Default::default(),
            worker: Some(t.name.to_string()),
            remote_prefill: None,
        });
        let (mut sent_token, mut reason, mut chunks) = (false, None, 0usize);
        let mut stall_by = deadline;
        loop {
            let until = if sent_token { stall_by.min(deadline) } else { first_token_by };
            let chunk = tokio::select! {
                c = tokio::time::timeout_at(until, stream.next()) => c,
                _ = tx.closed() => return Relay::Finished,
            };
            let chunk = match chunk {
                Err(_) if !sent_token && until < deadline => {
                    self.penalise(t.name);
                    return Relay::Retry(format!(
                        "no first token within {:?}",
                        self.cfg.first_token_timeout
                    ));
                }
                Err(_) if until < deadline => {
                    self.penalise(t.name);
                    self.stats.stalled_streams.fetch_add(1, Ordering::Relaxed);
                    return Relay::Failed(format!("no token for {:?}", self.cfg.stall_timeout));
                }
                Err(_) => {
                    let _ =
                        tx.send(GenEvent::Error(EngineError::Deadline { timeout: req.timeout }));
                    return Relay::Finished;
                }
                Ok(Err(e)) if sent_token => return Relay::Failed(e.to_string()),
                Ok(Err(e)) => return Relay::Retry(e.to_string()),
                Ok(Ok(c)) => c,
            };
            match chunk {
                Some(openai::Chunk::Text { text, token_ids }) => {
                    stall_by = tokio::time::Instant::now() + self.cfg.stall_timeout;
                    if !sent_token {
                        sent_token = true;
                        self.members.prefill_done(t.model, t.rid);
                        self.members.forgive(t.name);
                        progress.send_started(tx, started.take());
                    }
                    // An engine that does not return token ids: the stream cannot move.
                    progress.ids_known &= !token_ids.is_empty();
                    progress.generated.extend_from_slice(&token_ids);
                    chunks += token_ids.len().max(1);
                    let id = token_ids.last().copied().unwrap_or(0);
                    if tx.send(GenEvent::Token { id, text }).is_err() {
                        return Relay::Finished;
                    }
                }
                Some(openai::Chunk::Finish(r)) => reason = Some(r),
                Some(openai::Chunk::Usage { completion_tokens, cached }) => {
                    // Counted over every worker the stream had.
                    progress.counted = progress.counted_before + completion_tokens;
                    if let Some(c) = cached.filter(|_| !progress.moved) {
                        match started.as_mut() {
                            Some(GenEvent::Started { cached: sc, .. }) => *sc = c,
                            _ => {
                                let _ = tx.send(GenEvent::Cached(c));
                            }
                        }
                    }
                }
                None => {
                    progress.send_started(tx, started.take());
                    let Some(reason) = reason else {
                        let why = "the engine ended the stream without a finish reason".to_string();
                        return if sent_token { Relay::Failed(why) } else { Relay::Retry(why) };
                    };
                    let completion_tokens = progress.counted.max(progress.counted_before + chunks);
                    let _ =
                        tx.send(GenEvent::Done { reason, completion_tokens, text: String::new() });
                    return Relay::Finished;
                }
            }
        }
    }
}

enum Relay {
    Finished,
    /// Nothing was sent: another worker may serve it.
    Retry(String),
    /// Nothing was sent: the worker's queue is full (another worker may serve it; if none
    /// does, the client is told to retry later).
    Overloaded(EngineError),
    Failed(String),
}

/// What the client was sent of a request so far, over every worker that served it.
#[derive(Debug, Default)]
struct Progress {
    /// `Started` was sent (a stream that moves does not start again).
    started_sent: bool,
    /// The stream moved to another worker at least once.
    moved: bool,
    /// The tokens sent, in order.
    generated: Vec<u32>,
    /// Every token's id is known (an OpenAI engine may not return them): the stream can move.
    ids_known: bool,
    /// Completion tokens the engines reported (OpenAI usage), this attempt's included.
    counted: usize,
    /// ... before this attempt.
    counted_before: usize,
}

impl Progress {
    /// Sends `started` if the client has not had one.
    fn send_started(&mut self, tx: &EventTx, started: Option<GenEvent>) {
        if let Some(s) = started.filter(|_| !self.started_sent) {
            let _ = tx.send(s);
        }
        self.started_sent = true;
    }
}
