//! A synthetic workload for the simulator: seeded multi-turn conversations over shared system
//! prompts (`kvfabric bench router`), written as a trace ([`TraceRequest`]s) so that one
//! simulator replays production traces and synthetic workloads alike.
//!
//! Each conversation starts with one of `system_prompts` shared prompts, at Poisson arrivals.
//! Each turn's prompt is the conversation so far (its previous prompt and answer) and a new
//! user message; the next turn arrives a think time after the answer would end, taking the
//! answer at `reply_s_per_token`. The workload is open-loop, as a trace is: turns do not wait
//! for the simulated answers.
//!
//! Ids are blocks of content: a full block of the conversation keeps its id in every later
//! turn (shared system prompt blocks share ids across conversations); a partial last block
//! gets a new id each turn (its content changes as the conversation grows). An answer's blocks
//! get ids too, as a trace gives them when the next prompt carries the answer; the simulated
//! worker stores an answer's blocks under hashes of its own, so a next turn finds its
//! previous prompt cached, not the answer (as in a replayed trace).

use std::collections::HashSet;

use kvfabric::rng::SplitMix64;
use kvfabric::units::BlockTokens;

use crate::trace::TraceRequest;

/// The workload.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Conversations {
    /// Conversations.
    pub conversations: usize,
    /// Turns per conversation.
    pub turns: usize,
    /// Distinct system prompts shared by the conversations.
    pub system_prompts: usize,
    /// Tokens of a system prompt.
    pub system_prompt_tokens: u64,
    /// User message tokens, uniform in this range.
    pub user_tokens: (u32, u32),
    /// Output tokens, uniform in this range.
    pub output_tokens: (u32, u32),
    /// New conversations per second (Poisson).
    pub arrival_rate: f64,
    /// Seconds between an answer's end and the next turn.
    pub think_time_s: f64,
    /// Seconds an answer takes per token, for the next turn's arrival.
    pub reply_s_per_token: f64,
    /// Tokens per id.
    pub block_tokens: BlockTokens,
    /// Seed.
    pub seed: u64,
}

impl Default for Conversations {
    fn default() -> Self {
        Conversations {
            conversations: 400,
            turns: 4,
            system_prompts: 8,
            system_prompt_tokens: 1024,
            user_tokens: (64, 256),
            output_tokens: (64, 256),
            arrival_rate: 4.0,
            think_time_s: 2.0,
            reply_s_per_token: 0.02,
            block_tokens: BlockTokens::DEFAULT,
            seed: 42,
        }
    }
}

/// One conversation's state between turns.
struct Conversation {
    /// Ids of the full blocks so far.
    ids: Vec<u64>,
    /// Tokens so far.
    tokens: u64,
    /// Arrival of its next turn, seconds.
    next_s: f64,
    turns_left: usize,
    rng: SplitMix64,
}

impl Conversations {
    /// The workload's requests in arrival order.
    pub fn requests(&self) -> Vec<TraceRequest> {
        let bt = self.block_tokens.as_u64();
        let mut rng = SplitMix64(self.seed);
        // Ids: the system prompts' first, then one counter for every new block.
        let sys_blocks = self.system_prompt_tokens / bt;
        let prompts = self.system_prompts.max(1) as u64;
        let mut next_id = prompts * (sys_blocks + 1);
        let mut fresh = || {
            next_id += 1;
            next_id
        };
        let mut t = 0.0;
        let mut convs: Vec<Conversation> = (0..self.conversations)
            .map(|c| {
                let p = c as u64 % prompts;
                t += -(1.0 - rng.next_f64()).ln() / self.arrival_rate.max(1e-9);
                Conversation {
                    ids: (0..sys_blocks).map(|b| p * (sys_blocks + 1) + b).collect(),
                    tokens: sys_blocks * bt,
                    next_s: t,
                    turns_left: self.turns.max(1),
                    rng: SplitMix64(rng.next_u64() ^ c as u64),
                }
            })
            .collect();
        // A system prompt's partial last block is the same content in every conversation:
        // it becomes the conversation's own from its first user message on, so it is
        // folded into the first message's tokens.
        let sys_tail = self.system_prompt_tokens % bt;
        let mut out = Vec::with_capacity(self.conversations * self.turns.max(1));
        for c in &mut convs {
            let mut first = true;
            while c.turns_left > 0 {
                let user = u64::from(c.rng.range_u32(self.user_tokens.0, self.user_tokens.1))
                    + if first { sys_tail } else { 0 };
                first = false;
                let tokens = c.tokens + user;
                let full = tokens / bt;
                while (c.ids.len() as u64) < full {
                    c.ids.push(fresh());
                }
                let mut hash_ids = c.ids.clone();
                if tokens % bt != 0 {
                    hash_ids.push(fresh());
                }
                let output = c.rng.range_u32(self.output_tokens.0, self.output_tokens.1);
                out.push(TraceRequest {
                    timestamp: (c.next_s * 1e3) as u64,
                    input_length: tokens,
                    output_length: u64::from(output),
                    hash_ids,
                });
                c.tokens = tokens + u64::from(output);
                c.next_s += f64::from(output) * self.reply_s_per_token + self.think_time_s;
                c.turns_left -= 1;
            }
        }
        out.sort_by_key(|r| r.timestamp);
        out
    }
}

/// The workload's floor at `prefill_tokens_per_s`, the same for every router: the median
/// TTFT if every block a request shares with an earlier request were cached where it runs
/// and it never queued: only its leading ids never seen before are prefilled.
pub fn floor_ttft_p50_s(
    requests: &[TraceRequest],
    block_tokens: BlockTokens,
    prefill_tokens_per_s: f64,
) -> f64 {
    let bt = block_tokens.as_u64();
    let mut seen = HashSet::new();
    let mut floors: Vec<f64> = requests
        .iter()
        .map(|r| {
            let known = r.hash_ids.iter().take_while(|id| seen.contains(*id)).count() as u64;
            seen.extend(r.hash_ids.iter().copied());
            let computed = r.input_length - (known * bt).min(r.input_length);
            computed as f64 / prefill_tokens_per_s.max(1e-9)
        })
        .collect();
    floors.sort_by(f64::total_cmp);
    floors.get(floors.len().saturating_sub(1) / 2).copied().unwrap_or(f64::NAN)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn turns_extend_their_conversation_and_share_system_prompts() {
        let w = Conversations { conversations: 16, ..Conversations::default() };
        let reqs = w.requests();
        assert_eq!(reqs.len(), 16 * 4);
        assert!(reqs.windows(2).all(|p| p[0].timestamp <= p[1].timestamp));
        let bt = w.block_tokens.as_u64();
        for r in &reqs {
            assert_eq!(r.hash_ids.len() as u64, r.input_length.div_ceil(bt), "one id per block");
        }
        // Conversations 0 and 8 start with system prompt 0 (ids 0..64); a conversation is
        // known by the id of its first message's first block, which every turn keeps.
        let sys = (w.system_prompt_tokens / bt) as usize;
        let mut zero: std::collections::BTreeMap<u64, Vec<&TraceRequest>> = Default::default();
        for r in reqs.iter().filter(|r| r.hash_ids[0] == 0) {
            zero.entry(r.hash_ids[sys]).or_default().push(r);
        }
        assert_eq!(zero.len(), 2, "two conversations of 16 start with system prompt 0");
        let convs: Vec<&Vec<&TraceRequest>> = zero.values().collect();
        assert_eq!(convs[0][0].hash_ids[..sys], convs[1][0].hash_ids[..sys]);
        for turns in convs {
            assert_eq!(turns.len(), 4, "four turns");
            // A later turn carries its previous prompt's full blocks, its answer and more.
            for p in turns.windows(2) {
                let full = (p[0].input_length / bt) as usize;
                assert_eq!(p[0].hash_ids[..full], p[1].hash_ids[..full]);
                assert!(p[1].input_length > p[0].input_length + p[0].output_length);
            }
        }
    }

    #[test]
    fn the_floor_prefills_only_what_no_earlier_request_had() {
        let r = |ids: &[u64], len| TraceRequest {
            timestamp: 0,
            input_length: len,
            output_length: 1,
            hash_ids: ids.to_vec(),
        };
        // 16 tokens per id, 1 token per second: the first computes 40, the second 8 + 16.
        let reqs = [r(&[1, 2, 3], 40), r(&[1, 2, 4, 5], 56), r(&[1, 2, 3], 40)];
        assert_eq!(floor_ttft_p50_s(&reqs, BlockTokens::of(16), 1.0), 24.0);
        assert_eq!(floor_ttft_p50_s(&reqs[2..], BlockTokens::of(16), 1.0), 40.0);
    }
}
