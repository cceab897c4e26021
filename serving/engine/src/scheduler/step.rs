//! One engine step: which sequences take part (prompt chunks within the ITL budget, decodes,
//! or both), the engine's call, its outputs sent to the clients, and the step's cost
//! measured for the next decisions.

use super::*;

impl<E: Engine> Loop<E> {
    pub(super) fn step(&mut self) {
        // Decodes first (one token each), then prompt chunks within the token budget. On an
        // engine whose mixed steps cost the sum of their parts, steps alternate instead: the
        // waiting prompt chunks alone, then the decodes alone. Each decode gets its token
        // when the mixed step would have given it, and a new request its first token one
        // decode step sooner.
        let mut budget = self.cfg.step_tokens.max(1);
        // (running index, start, len)
        let mut plan: Vec<(usize, usize, usize)> = Vec::new();
        // A latency class's prompt (its class has an ITL target) runs alone among prompts
        // (below); where steps alternate, its step comes next even when the decodes are due
        // (once: they then wait two steps at most, the second a short one).
        let latency_prompt = self.cfg.policy == QueuePolicy::Edf
            && self.running.iter().any(|s| {
                s.started
                    && s.prompt_left() > 0
                    && s.req.class.as_ref().is_some_and(|c| c.itl.is_some())
            });
        let split = !self.engine.mixed_steps_amortize()
            && self.running.iter().any(|s| s.started && s.prompt_left() > 0)
            && self.running.iter().any(|s| s.started && s.prompt_left() == 0);
        let (decodes, prompts) = match (split, self.decodes_deferred) {
            (false, _) => (true, true),
            (true, true) if latency_prompt && !self.latency_jumped => {
                self.latency_jumped = true;
                (false, true)
            }
            (true, false) => (false, true),
            (true, true) => (true, false),
        };
        self.decodes_deferred = !decodes;
        if decodes {
            self.latency_jumped = false;
        }
        for (i, s) in self.running.iter().enumerate() {
            if decodes && s.started && s.prompt_left() == 0 {
                plan.push((i, s.computed, 1));
                budget = budget.saturating_sub(1);
            }
        }
        // A decode of a class with an ITL target waits for this step's prompt chunks (and,
        // alternating, for the decode step after them): they are cut to what fits in it, a
        // block at least so that prompts still advance.
        let itl = self
            .running
            .iter()
            .filter(|s| s.started && s.prompt_left() == 0)
            .filter_map(|s| s.req.class.as_ref()?.itl)
            .min();
        if let Some(fit) = itl.and_then(|itl| self.cost.prompt_tokens_within(itl)) {
            let floor = self.hasher.block_tokens().as_usize() + plan.len();
            budget = budget.min(fit.max(floor));
        }
        // Prompt chunks earliest deadline first. While a prompt of a more urgent class is
        // computed, less urgent prompts wait: the step stays as short as that prompt needs
        // (its first token is not held up by a batch job's chunk).
        let mut order: Vec<usize> = (0..self.running.len()).collect();
        order.sort_by_key(|&i| self.running[i].key);
        let urgent = self
            .running
            .iter()
            .filter(|s| s.started && s.prompt_left() > 0)
            .map(|s| s.req.rank())
            .min()
            .filter(|_| self.cfg.policy == QueuePolicy::Edf)
            .unwrap_or(u8::MAX);
        let decoded = plan.len();
        for i in order {
            let s = &self.running[i];
            let left = s.prompt_left();
            if prompts && s.started && left > 0 && budget > 0 && s.req.rank() <= urgent {
                let n = left.min(budget);
                plan.push((i, s.computed, n));
                budget -= n;
            }
        }
        if plan.is_empty() {
            return;
        }
        let prompt_tokens: usize = plan[decoded..].iter().map(|p| p.2).sum();
        self.provide_blocks(&plan);
        let inputs: Vec<StepInput<'_>> = plan
            .iter()
            .map(|&(i, start, n)| {
                let s = &self.running[i];
                StepInput {
                    seq: s.id,
                    start,
                    tokens: &s.tokens[start..start + n],
                    logits: start + n == s.tokens.len(),
                }
            })
            .collect();
        let wants: Vec<bool> = inputs.iter().map(|x| x.logits).collect();
        let step_start = Instant::now();
        let result = self.engine.step_next(&inputs);
        drop(inputs);
        self.cost.observe(prompt_tokens, decoded, step_start.elapsed().as_secs_f64() * 1e6);
        if let Some(us) = self.cost.prefill_us_per_token.filter(|us| *us > 0.0) {
            self.stats.prefill_tokens_per_s.store((1e6 / us) as u64, Ordering::Relaxed);
        }
        bump(&self.stats.steps, 1);
        let mut outcomes: Vec<Outcome> =
            (0..self.running.len()).map(|_| Outcome::Continue).collect();
        match result {
            Err(e) => {
                tracing::error!(error = %e, "engine step failed");
                for &(i, _, _) in &plan {
                    outcomes[i] = Outcome::Failed(e.clone());
                }
            }
            Ok(next) => {
                let mut next = next.into_iter();
                for (&(i, _, n), want) in plan.iter().zip(wants) {
                    let s = &mut self.running[i];
                    if s.first_step.is_none() {
                        s.first_step = Some(step_start);
                        // A resumed request counted its queue time when it first ran.
                        if !s.preempted {
                            self.stats.queue_time.observe(step_start - s.arrived);
                        }
                    }
                    if s.prompt_left() > 0 {
                        bump(&self.stats.prefill_tokens, n.min(s.prompt_left()) as u64);
                    }
                    s.computed += n;
                    if !want {
                        continue;
                    }
                    let Some(n) = next.next() else {
                        outcomes[i] = Outcome::Failed(EngineError::model("missing logits"));
                        continue;
                    };
                    outcomes[i] = Self::advance(s, n, &self.codec, self.engine.info().context_len);
                    bump(&self.stats.generated_tokens, 1);
                    if s.generated == 1 {
                        self.stats
                            .prefill_time
                            .observe(s.first_step.map_or(Duration::ZERO, |t| t.elapsed()));
                    }
                }
            }
        }
        self.store_full_blocks();
        let now = Instant::now();
        for (i, s) in self.running.iter().enumerate() {
            if matches!(outcomes[i], Outcome::Continue) {
                if s.tx.is_closed() {
                    outcomes[i] = Outcome::Cancelled;
                } else if now >= s.deadline {
                    outcomes[i] = Outcome::Failed(EngineError::Deadline { timeout: s.req.timeout });
                    bump(&self.stats.deadline_exceeded, 1);
                }
            }
        }
        // Retire finished sequences (in reverse, so indices stay valid).
        for i in (0..self.running.len()).rev() {
            let event = match std::mem::replace(&mut outcomes[i], Outcome::Continue) {
                Outcome::Continue => continue,
                Outcome::Finished(reason) => {
                    let s = &mut self.running[i];
                    GenEvent::Done { reason, completion_tokens: s.generated, text: s.text.flush() }
                }
                Outcome::Failed(e) => GenEvent::Error(e),
                Outcome::Cancelled => {
                    bump(&self.stats.cancelled, 1);
                    GenEvent::Error(EngineError::invalid("cancelled"))
                }
            };
            let s = self.running.swap_remove(i);
            let _ = s.tx.send(event);
            self.engine.remove_sequence(s.id);
            // A latency class's prompt blocks stay in host memory ahead of batch blocks.
            if s.req.class.as_ref().is_some_and(|c| c.itl.is_some()) {
                let full = s.req.prompt.len() / self.hasher.block_tokens().as_usize();
                self.store.keep(&s.hashes[..full.min(s.hashes.len())]);
            }
            // A tenant past its quotas moves its own least recently used blocks out of host
            // memory, and out of the store.
            if let Some(t) = s.req.tenant.as_ref() {
                let used = &s.hashes[..s.stored.min(s.hashes.len())];
                let over = self.quotas.charge(t, used);
                if !over.demote.is_empty() || !over.remove.is_empty() {
                    // In the background: a block on its way to disk is removed once there.
                    let (store, stats) = (self.store.clone(), self.stats.clone());
                    self.runtime.spawn(async move {
                        for h in over.demote {
                            match store.demote(h).await {
                                Ok(kvfabric_tiers::Demoted::ToDisk) => {
                                    bump(&stats.quota_demoted, 1)
                                }
                                Ok(kvfabric_tiers::Demoted::Dropped) => {
                                    bump(&stats.quota_removed, 1)
                                }
                                Ok(kvfabric_tiers::Demoted::NotInHost) => {}
                                Err(e) => {
                                    tracing::debug!(error = %e, "moving a block past its tenant's host quota to disk")
                                }
                            }
                        }
                        for h in over.remove {
                            if store.remove(h).await {
                                bump(&stats.quota_removed, 1);
                            }
                        }
                    });
                }
            }
            self.stats.running.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Samples the next token of `s` and decides whether it goes on.
    pub(super) fn advance(s: &mut Seq, next: Next, codec: &TextCodec, ctx: usize) -> Outcome {
        let tok = match next {
            Next::Token(t) => t,
            Next::Logits(l) => s.sampler.sample(&l),
        };
        s.generated += 1;
        if !s.req.ignore_eos && codec.stop_tokens().contains(&tok) {
            return Outcome::Finished(FinishReason::Stop);
        }
        s.tokens.push(tok);
        let (text, stopped) = s.text.push(codec, tok);
        // A reader that left cancels; one too far behind was told why, and is cancelled too.
        if s.tx.send(GenEvent::Token { id: tok, text }).is_err() {
            return Outcome::Cancelled;
        }
        if stopped {
            return Outcome::Finished(FinishReason::Stop);
        }
        if s.generated >= s.req.max_tokens || s.tokens.len() >= ctx {
            return Outcome::Finished(FinishReason::Length);
        }
        Outcome::Continue
    }
}
