//! What the routed backend says about itself: a route explained (`/v1/route`) and the
//! dashboard's view of its workers and fabric nodes.

use super::*;
use kvfabric::units::Blocks;

impl RoutedBackend {
    /// Where a request of `prompt` would go, and why: the chosen worker, and every worker's
    /// leading cached blocks per tier, reported load and cost. With `track`, the request is
    /// routed (it counts as the worker's load until [`RoutedBackend::release`]).
    pub fn explain(&self, model: &str, prompt: &[u32], track: bool) -> Result<Value, EngineError> {
        let unknown =
            || EngineError::Unavailable { message: format!("no worker serves {model:?} now") };
        let Scores { blocks, block_tokens, workers: scores } =
            self.inner.members.scores(model, prompt).ok_or_else(unknown)?;
        let (request_id, chosen) = if track {
            match self.pick(model, prompt) {
                Some((rid, name)) => (Some(rid), Some(name)),
                None => (None, None),
            }
        } else {
            // The router's own choice at temperature 0 ([`kvfabric_router::policy::select`]):
            // the lowest cost, and on a tie the lowest worker id, as a request would go.
            let best = scores.iter().min_by(|a, b| by_choice(a, b)).map(|s| s.0.clone());
            (None, best)
        };
        let chosen = chosen.ok_or_else(unknown)?;
        let workers: Vec<Value> = scores
            .iter()
            .map(|(name, run, cost, load, terms)| {
                let tiers: serde_json::Map<String, Value> = kvfabric::events::TierKind::ALL
                    .iter()
                    .map(|t| (t.name().to_string(), json!(run.per_tier[*t as usize])))
                    .collect();
                json!({
                    "worker": name,
                    "cached_blocks": run.blocks,
                    "cached_tokens": block_tokens.tokens_of(Blocks(u64::from(run.blocks))).0,
                    "cached_blocks_per_tier": tiers,
                    "active_blocks": load.active_blocks,
                    "queued_prefill_tokens": load.queued_prefill_tokens,
                    "cost": cost,
                    "cost_terms": {
                        "prefill_blocks": terms[0],
                        "decode_load": terms[1],
                        "queued_prefill": terms[2],
                    },
                })
            })
            .collect();
        let mode = self.inner.members.mode_name();
        let reason = explain_reason(&mode, &chosen, &scores, blocks, track);
        Ok(json!({
            "model": model,
            "worker": chosen,
            "reason": reason,
            "request_id": request_id,
            "prompt_tokens": prompt.len(),
            "blocks": blocks,
            "block_tokens": block_tokens,
            "mode": mode,
            "workers": workers,
        }))
    }

    /// Its workers, those that left lately, and the control plane, for a dashboard.
    pub fn dashboard(&self) -> crate::dashboard::BackendView {
        use crate::dashboard::{BackendView, ControlView, WorkerView};
        let now = Instant::now();
        let index = self.inner.members.index();
        let view =
            |name: &str, w: &WorkerEntry, state: &'static str, left: Option<Instant>| WorkerView {
                name: name.to_string(),
                model: w.model.clone(),
                role: w.role,
                state,
                addr: Some(w.addr.to_string()),
                requests: w.served,
                load: w.load,
                stats: w.stats.as_deref().cloned(),
                indexed_blocks: index.worker_blocks(w.wid) as u64,
                report_age_s: w
                    .reported
                    .map(|(at, _)| now.saturating_duration_since(at).as_secs_f64()),
                left_s_ago: left.map(|l| now.saturating_duration_since(l).as_secs_f64()),
                note: w
                    .refused_now(now)
                    .map(|why| format!("cannot be reached: {why} (wrong secret?)")),
            };
        let (workers, departed, fabric, bus_lag_ms) = self.inner.members.read(|st| {
            let mut workers: Vec<WorkerView> = st
                .workers
                .iter()
                .map(|(name, w)| {
                    let avoided = w.penalty_until.is_some_and(|t| t > now);
                    let refused = w.refused_now(now).is_some();
                    let draining = w.stats.as_ref().is_some_and(|s| s.draining);
                    let state = match (refused, draining, avoided) {
                        (true, _, _) => "refused",
                        (false, true, _) => "draining",
                        (false, false, true) => "avoided",
                        (false, false, false) => "serving",
                    };
                    view(name, w, state, None)
                })
                .collect();
            workers.extend(st.reporters.iter().map(|(name, r)| WorkerView {
                name: name.clone(),
                role: "prefill",
                state: if r.stats.draining { "draining" } else { "serving" },
                load: r.load,
                stats: Some((*r.stats).clone()),
                report_age_s: Some(now.saturating_duration_since(r.at).as_secs_f64()),
                ..WorkerView::default()
            }));
            workers.sort_by(|a, b| a.name.cmp(&b.name));
            let departed = st
                .departed
                .iter()
                .rev()
                .map(|d| {
                    let w = &d.entry;
                    let reporting = w
                        .reported
                        .is_some_and(|(at, _)| now.saturating_duration_since(at) < REPORTS_STOPPED);
                    // A worker that drains says so, and keeps reporting after it left; one that
                    // was killed or lost its lease left with its reports already stopped.
                    let drains = w.stats.as_ref().is_some_and(|s| s.draining)
                        || w.reported.is_some_and(|(at, _)| at > d.left);
                    let state = match drains {
                        true if reporting => "draining",
                        true => "drained",
                        false => "lost",
                    };
                    // Its blocks left the index with it: `indexed_blocks` reads 0.
                    view(&d.name, w, state, Some(d.left))
                })
                .collect();
            let bus_lag_ms =
                st.workers.values().filter_map(|w| w.reported.and_then(|r| r.1)).reduce(f64::max);
            // The block sizes of the models served: a node of none of them serves no worker.
            let sizes: Vec<u64> =
                st.models.values().map(|m| m.info.layout.bytes_per_block()).collect();
            let mut fabric: Vec<WorkerView> = st
                .fabric
                .iter()
                .map(|(name, f)| WorkerView {
                    name: name.clone(),
                    role: "fabric",
                    state: if sizes.is_empty() || sizes.contains(&f.block_bytes) {
                        "serving"
                    } else {
                        "ignored"
                    },
                    note: (!sizes.is_empty() && !sizes.contains(&f.block_bytes)).then(|| {
                        format!(
                            "stores blocks of {} bytes; the workers' are {}: no worker uses it",
                            f.block_bytes,
                            sizes.iter().map(u64::to_string).collect::<Vec<_>>().join(", ")
                        )
                    }),
                    addr: Some(f.addr.to_string()),
                    stats: f.stats.as_deref().cloned(),
                    indexed_blocks: index.worker_blocks(f.wid) as u64,
                    report_age_s: f
                        .reported
                        .map(|at| now.saturating_duration_since(at).as_secs_f64()),
                    ..WorkerView::default()
                })
                .collect();
            fabric.sort_by(|a, b| a.name.cmp(&b.name));
            (workers, departed, fabric, bus_lag_ms)
        });
        let f = self.inner.members.feed_stats();
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        BackendView {
            workers,
            departed,
            fabric,
            control: Some(ControlView {
                discovery: self.inner.discovery.status(),
                bus: self.inner.bus.status(),
                kv_events: ld(&f.applied),
                kv_event_gaps: ld(&f.gaps),
                kv_dumps: ld(&f.dumps),
                dump_requests: ld(&f.dump_requests),
                kv_events_malformed: ld(&f.malformed),
                kv_events_unknown_worker: ld(&f.unknown),
                bus_lag_ms,
                routing: self.inner.members.mode_name(),
            }),
        }
    }
}

/// Why `chosen` is where a request of `blocks` full blocks goes, in words.
pub(super) fn explain_reason(
    mode: &str,
    chosen: &str,
    scores: &[Scored],
    blocks: usize,
    track: bool,
) -> String {
    let mut by_cost: Vec<&Scored> = scores.iter().collect();
    by_cost.sort_by(|a, b| by_choice(a, b));
    let Some(best) = by_cost.iter().find(|s| s.0 == chosen) else {
        return format!("{mode} routing picked {chosen}");
    };
    let (_, run, cost, _, t) = best;
    let tiers: Vec<String> = kvfabric::events::TierKind::ALL
        .iter()
        .filter(|k| run.per_tier[**k as usize] > 0)
        .map(|k| format!("{} in {}", run.per_tier[*k as usize], k.name()))
        .collect();
    let cached = if tiers.is_empty() { String::new() } else { format!(": {}", tiers.join(", ")) };
    let why = format!(
        "{} of {blocks} blocks cached{cached}; cost {cost:.1} = {:.1} to prefill + {:.1} decode load + {:.1} queued prefill",
        run.blocks, t[0], t[1], t[2]
    );
    let next = by_cost.iter().find(|s| s.0 != chosen);
    match (mode, next) {
        ("kv", Some(n)) if n.2 == *cost && (!track || by_cost.first().is_some_and(|b| b.0 == chosen)) => format!(
            "{chosen}: a tie at the lowest cost with {} ({} blocks cached), broken by worker id as \
             every request's is. {why}",
            n.0, n.1.blocks
        ),
        ("kv", Some(n)) if !track || n.2 >= *cost => format!(
            "{chosen}: the lowest cost. {why}. Next: {} at {:.1} ({} blocks cached)",
            n.0, n.2, n.1.blocks
        ),
        ("kv", None) => format!("{chosen}: the only worker. {why}"),
        ("kv", Some(_)) => format!(
            "{chosen}: cheaper workers were passed over (avoided after not answering in time, or the temperature's draw). {why}"
        ),
        (_, _) if track => format!("{chosen}: {mode} routing does not weigh cached blocks. {why}"),
        (_, _) => format!(
            "{mode} routing does not weigh cached blocks; by cost (kv routing) it would be {chosen}. {why}"
        ),
    }
}

/// The order in which the router chooses at temperature 0: the lowest cost, then the lowest
/// worker id (the XXH3-64 of its name), as [`kvfabric_router::policy::select`] does.
pub(super) fn by_choice(a: &Scored, b: &Scored) -> std::cmp::Ordering {
    a.2.total_cmp(&b.2).then_with(|| worker_id(&a.0).cmp(&worker_id(&b.0)))
}
