//! The trace simulator on hand-made traces, where the right numbers are known, and on the
//! shipped trace's first requests: exact reuse where arithmetic says it, determinism, the
//! limit as a ceiling, kv routing above round-robin, and a shared pool reaching what per-worker
//! caches cannot.

use kvfabric_planner::sim::{simulate, SimConfig, SimResult};
use kvfabric_planner::trace::{TraceReader, TraceRequest};
use kvfabric_router::RoutingMode;

fn req(timestamp: u64, input_length: u64, hash_ids: &[u64]) -> TraceRequest {
    TraceRequest { timestamp, input_length, output_length: 4, hash_ids: hash_ids.to_vec() }
}

fn run(trace: &[TraceRequest], cfg: &SimConfig) -> SimResult {
    simulate(trace.iter().cloned().map(Ok), cfg).unwrap()
}

/// One worker, room for everything, requests far apart (each prefill done before the next
/// arrives): every block seen before is found, so reuse is the limit, token for token.
#[test]
fn one_roomy_worker_reuses_exactly_the_limit() {
    let trace = [
        req(0, 1024, &[1, 2]),
        req(60_000, 1536, &[1, 2, 3]),
        req(120_000, 1040, &[1, 4, 5]),
        req(180_000, 512, &[6]),
        req(240_000, 1536, &[1, 2, 3]),
    ];
    let cfg = SimConfig { workers: 1, tier_blocks: [1 << 20, 0, 0], ..SimConfig::default() };
    let r = run(&trace, &cfg);
    // Reused: 1,2 (1024) + 1 (512) + 1,2,3 (1536), but a prompt held whole still computes its
    // last block (an engine computes at least one token, for its logits).
    assert_eq!(r.limit.reused_tokens, 3072);
    assert_eq!(r.reused_tokens, [3072 - 16, 0, 0, 0]);
    assert_eq!(r.prompt_tokens, 1024 + 1536 + 1040 + 512 + 1536);
    assert_eq!(r.prefill_tokens, r.prompt_tokens - 3072 + 16);
    assert_eq!(r.requests, 5);
    assert_eq!(r.per_worker, [5]);
    // TTFT: the uncached tokens at 20,000 tokens/s (the first request: 1024 tokens).
    let first = 1024.0 / 20_000.0;
    assert!(r.ttft_s.iter().all(|&t| t <= first + 1e-9), "{:?}", r.ttft_s);
}

/// A G1 of two trace blocks: what it evicts goes to G2, and comes back from there.
#[test]
fn what_g1_evicts_is_found_in_g2_and_its_transfer_counted() {
    let trace = [req(0, 1024, &[1, 2]), req(60_000, 1024, &[3, 4]), req(120_000, 1024, &[1, 2])];
    let cfg = SimConfig {
        workers: 1,
        tier_blocks: [64, 1 << 10, 0],
        bytes_per_token: 1000,
        ..SimConfig::default()
    };
    let r = run(&trace, &cfg);
    // The whole prompt but its last block (which is computed).
    assert_eq!(r.reused_tokens, [0, 1008, 0, 0]);
    assert_eq!(r.bytes.onboard_g2, 1008 * 1000);
    // Every block of the first two prompts left G1 for G2 (64 blocks of 16 = 1024 tokens).
    assert_eq!(r.bytes.offload_g2, 2 * 1024 * 1000);
    // Without G2 the third request finds nothing.
    let none = run(&trace, &SimConfig { tier_blocks: [64, 0, 0], ..cfg.clone() });
    assert_eq!(none.reused_tokens, [0; 4]);
}

fn shipped(n: u64) -> Vec<TraceRequest> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../benches/traces/conversation_trace.jsonl");
    TraceReader::open(&path, 512).unwrap().take(n as usize).map(Result::unwrap).collect()
}

#[test]
fn on_real_traffic_kv_beats_round_robin_a_pool_nears_the_limit_and_a_seed_repeats() {
    let trace = shipped(1500);
    let small = SimConfig { tier_blocks: [16_384, 0, 0], ..SimConfig::default() };
    let kv = run(&trace, &small);
    let rr = run(&trace, &SimConfig { mode: RoutingMode::RoundRobin, ..small.clone() });
    let limit = kv.limit.token_ratio();
    assert!(kv.reuse() <= limit + 1e-9 && rr.reuse() <= limit + 1e-9);
    assert!(kv.reuse() > rr.reuse() * 1.5, "kv {} round-robin {}", kv.reuse(), rr.reuse());
    // A pool every worker reads from reaches what per-worker caches of that size cannot.
    let pooled = run(&trace, &SimConfig { g4_blocks: 8 * 16_384 * 4, ..small.clone() });
    assert!(pooled.reuse() > kv.reuse() && pooled.reuse() >= 0.85 * limit, "{}", pooled.reuse());
    assert!(pooled.reused_tokens[3] > 0 && pooled.bytes.write_g4 > 0);
    // Same seed, same numbers (all but the wall-clock time of the index's ingestion).
    let again = run(&trace, &small);
    let simulated =
        |r: &SimResult| serde_json::to_string(&SimResult { ingest_s: 0.0, ..r.clone() }).unwrap();
    assert_eq!(simulated(&again), simulated(&kv), "a replay is deterministic");
}

/// With a measured profile a step takes the profile's time: a lone request's TTFT is the
/// prefill curve at its uncached tokens, its ITL the decode curve at a batch of one; a second
/// request arriving mid-prefill waits for the step in flight and shares the next.
#[test]
fn a_profile_times_the_steps() {
    use kvfabric_planner::sla::{Curve, Profile};
    let profile = Profile {
        prefill_s: Curve::new(vec![(0.0, 0.01), (1000.0, 0.11)]).unwrap(),
        itl_s: vec![(1024.0, Curve::new(vec![(1.0, 0.005), (8.0, 0.012)]).unwrap())],
        batch_max: 8,
        kv_bytes_per_token: 1000,
        restore_s_per_token: 0.0,
    };
    let cfg = SimConfig { workers: 1, profile: Some(profile), ..SimConfig::default() };
    let mut lone = req(0, 500, &[1]);
    lone.output_length = 11;
    let r = run(&[lone.clone()], &cfg);
    assert!((r.ttft_s[0] - 0.06).abs() < 1e-9, "{:?}", r.ttft_s);
    assert!((r.itl_s[0] - 0.005).abs() < 1e-9, "{:?}", r.itl_s);
    assert!((r.e2e_s[0] - (0.06 + 10.0 * 0.005)).abs() < 1e-9, "{:?}", r.e2e_s);
    // A second prompt at 10 ms waits for the first's step (60 ms), then its own (60 ms) with
    // one decode of the first (5 ms): its TTFT is 115 ms from its arrival.
    let mut second = req(10, 500, &[2]);
    second.output_length = 1;
    let r = run(&[lone, second], &cfg);
    assert!((r.ttft_s[2] - 0.115).abs() < 1e-6, "{:?}", r.ttft_s);
}

/// A disaggregated layout: prompts computed on the prefill workers (the cache they hit is
/// theirs), every prompt's KV handed to a decode worker over the KV link, whose first step
/// gives the first token; decode steps never carry a prefill, so every gap is one step.
#[test]
fn a_disaggregated_layout_hands_every_prompt_over_and_decodes_undisturbed() {
    let mut trace = vec![req(0, 1024, &[1, 2]), req(10, 1536, &[1, 2, 3]), req(20, 1024, &[4, 5])];
    for r in &mut trace {
        r.output_length = 5;
    }
    let cfg = SimConfig {
        workers: 2,
        prefill_workers: 1,
        kv_link_gbps: 1.0,
        bytes_per_token: 1000,
        ..SimConfig::default()
    };
    let r = run(&trace, &cfg);
    let prompts = 1024 + 1536 + 1024;
    assert_eq!(r.bytes.handoff, prompts * 1000, "every prompt's KV crosses once");
    // The second prompt found the first's two ids on the (single) prefill worker.
    assert_eq!(r.reused_tokens[0], 1024);
    assert_eq!(r.per_worker[0], 3, "one prefill worker computed every prompt");
    assert_eq!(r.per_worker[1] + r.per_worker[2], 3, "and the decode workers took them");
    // Decode steps of 20 ms, nothing else in them.
    assert!(r.itl_s.iter().all(|&x| (x - 0.02).abs() < 1e-9), "{:?}", r.itl_s);
    // The fastest first token: a whole prompt computed (1024 tokens at 20,000/s), 1 MB over
    // 1 GB/s, then one decode step.
    let first = 1024.0 / 20_000.0 + 1024.0 * 1000.0 / 1e9 + 0.02;
    assert!(r.ttft_s[0] >= first - 1e-9, "{:?}", r.ttft_s);
}

/// Steps that cannot mix (`mixed_steps: false`, as kvfabric's scheduler runs the mock):
/// while a sequence decodes, a new prompt's chunk runs in a step of its own, without the 20 ms
/// of the decodes; mixed, the decodes ride in its step.
#[test]
fn split_steps_give_a_new_prompt_a_step_of_its_own() {
    let mut a = req(0, 16, &[1]);
    a.output_length = 100;
    let mut b = req(500, 2000, &[2, 3, 4, 5]);
    b.output_length = 1;
    let cfg = SimConfig { workers: 1, ..SimConfig::default() };
    let mixed = run(&[a.clone(), b.clone()], &cfg);
    let split = run(&[a, b], &SimConfig { mixed_steps: false, ..cfg });
    // B's TTFT is the largest of the two: the same wait for the step in flight, then its
    // 2000 tokens at 20,000/s, plus a decode step only when mixed.
    let d = mixed.ttft_s[2] - split.ttft_s[2];
    assert!((d - 0.02).abs() < 1e-9, "mixed {:?} split {:?}", mixed.ttft_s, split.ttft_s);
    assert!(split.ttft_s[2] >= 0.1 - 1e-9);
}

/// The synthetic workload of `kvfabric bench router` (multi-turn conversations over shared
/// system prompts): kv routing finds far more of each prompt cached than round-robin and so
/// answers sooner, and no router goes below the workload's floor.
#[test]
fn on_conversations_kv_beats_round_robin_and_stays_above_the_floor() {
    use kvfabric_planner::sim::conversations::{floor_ttft_p50_s, Conversations};
    use kvfabric_planner::trace::Reshape;
    let w = Conversations { conversations: 60, ..Conversations::default() };
    let trace = w.requests();
    let cfg = |mode| SimConfig {
        workers: 4,
        mode,
        block_tokens: w.block_tokens,
        reshape: Reshape::none(w.block_tokens.get()),
        tier_blocks: [4096, 0, 0],
        prefill_tokens_per_s: 5_000.0,
        load_report_s: 0.0,
        ..SimConfig::default()
    };
    let kv = run(&trace, &cfg(RoutingMode::Kv));
    let rr = run(&trace, &cfg(RoutingMode::RoundRobin));
    assert_eq!(kv.requests, 60 * 4);
    let limit = kv.limit.reused_tokens as f64 / kv.prompt_tokens as f64;
    // kv finds nearly all that an infinite cache would; round-robin finds the system
    // prompts everywhere but a conversation's history only where its last turn ran.
    assert!(kv.reuse() >= 0.95 * limit, "kv {} limit {limit}", kv.reuse());
    assert!(rr.reuse() < 0.8 * limit, "rr {} limit {limit}", rr.reuse());
    assert!(kv.ttft_s[0] < rr.ttft_s[0], "kv {:?} rr {:?}", kv.ttft_s, rr.ttft_s);
    let floor = floor_ttft_p50_s(&trace, w.block_tokens, 5_000.0);
    assert!(floor > 0.0 && floor <= kv.ttft_s[0], "floor {floor} kv {:?}", kv.ttft_s);
    assert_eq!(run(&trace, &cfg(RoutingMode::Kv)).ttft_s, kv.ttft_s, "a seed repeats");
}
