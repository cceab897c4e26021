//! How the scheduler composes steps. On an engine whose mixed steps amortize (real models),
//! a new prompt's chunks run in the same step as the running decodes; on one whose step time
//! is the sum of its parts (the mock's time model), prompt chunks and decodes alternate in
//! steps of their own, and decodes never wait two steps in a row. Recorded through a wrapper
//! that sees every step's inputs; no clock is read.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::StepLog;
use kvfabric::agent::{Agent, AgentConfig};
use kvfabric::events::NullSink;
use kvfabric_engine::mock::{MockConfig, MockEngine};
use kvfabric_engine::{GenEvent, GenerateRequest, Scheduler, SchedulerConfig};
use kvfabric_tiers::{StoreConfig, TieredStore};
use parking_lot::Mutex;

/// One step: per input, (sequence, first position, tokens).
type Step = Vec<(u64, usize, usize)>;

const A_PROMPT: usize = 20;
const B_PROMPT: usize = 200;

fn request(prompt: Vec<u32>, n: usize) -> GenerateRequest {
    GenerateRequest { ignore_eos: true, ..GenerateRequest::new(prompt, n, Duration::from_secs(30)) }
}

async fn collect(mut rx: kvfabric_engine::EventRx) -> Vec<u32> {
    let mut tokens = Vec::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            GenEvent::Token { id, .. } => tokens.push(id),
            GenEvent::Done { .. } => break,
            GenEvent::Error(e) => panic!("{e}"),
            _ => {}
        }
    }
    tokens
}

/// A scheduler over a SmolLM2-layout mock of `mock` whose steps are recorded, composing
/// steps of at most `step_tokens` prompt tokens (and the agent its store lives in).
async fn scheduler(
    mock: MockConfig,
    amortize: bool,
    step_tokens: usize,
) -> (Scheduler, Arc<Mutex<Vec<Step>>>, Agent) {
    let layout = common::f32_layout();
    let agent = Agent::start(AgentConfig::new("plan", b"s".to_vec())).await.unwrap();
    let store = TieredStore::open(
        StoreConfig::new(layout.bytes_per_block(), 256),
        &agent,
        Arc::new(NullSink),
    )
    .await
    .unwrap();
    let steps = Arc::new(Mutex::new(Vec::new()));
    let engine = StepLog {
        inner: MockEngine::new("mock", layout, mock).unwrap(),
        amortize,
        steps: steps.clone(),
        record: |i| (i.seq, i.start, i.tokens.len()),
    };
    let cfg = SchedulerConfig { step_tokens, ..SchedulerConfig::default() };
    let sched = Scheduler::start(engine, store, cfg, tokio::runtime::Handle::current()).unwrap();
    (sched, steps, agent)
}

/// Sequence A decodes 300 tokens; once it has produced 5, B arrives with a 200-token prompt
/// (four chunks of 64). Returns every step, A's id, B's id and both outputs.
async fn run(amortize: bool) -> (Vec<Step>, u64, u64, Vec<u32>, Vec<u32>) {
    // A small decode delay keeps A running while B is admitted (not a timing assertion).
    let mock = MockConfig { decode_step_us: 200.0, ..MockConfig::zero_delay() };
    let (sched, steps, _agent) = scheduler(mock, amortize, 64).await;
    let a_prompt: Vec<u32> = (0..A_PROMPT as u32).map(|i| 97 + i % 26).collect();
    let b_prompt: Vec<u32> = (0..B_PROMPT as u32).map(|i| 97 + (i * 7) % 26).collect();
    let mut a_rx = sched.submit(request(a_prompt, 300)).unwrap();
    let mut a = Vec::new();
    while a.len() < 5 {
        match a_rx.recv().await.expect("A runs") {
            GenEvent::Token { id, .. } => a.push(id),
            GenEvent::Error(e) => panic!("{e}"),
            _ => {}
        }
    }
    let b_rx = sched.submit(request(b_prompt, 8)).unwrap();
    let (rest, b) = tokio::join!(collect(a_rx), collect(b_rx));
    a.extend(rest);
    let steps = steps.lock().clone();
    let a_id = steps[0][0].0;
    let b_id = steps.iter().flatten().map(|x| x.0).find(|&s| s != a_id).expect("B ran");
    (steps, a_id, b_id, a, b)
}

fn has_decode_of(step: &Step, seq: u64, prompt: usize) -> bool {
    step.iter().any(|&(s, start, n)| s == seq && n == 1 && start >= prompt)
}

fn has_prompt_of(step: &Step, seq: u64, prompt: usize) -> bool {
    step.iter().any(|&(s, start, _)| s == seq && start < prompt)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_chunks_and_decodes_alternate_on_an_engine_whose_mixed_steps_do_not_amortize() {
    let (steps, a, b, a_out, b_out) = run(false).await;
    assert_eq!(a_out.len(), 300);
    assert_eq!(b_out.len(), 8);
    let b_prompt_steps: Vec<usize> =
        (0..steps.len()).filter(|&i| has_prompt_of(&steps[i], b, B_PROMPT)).collect();
    assert_eq!(b_prompt_steps.len(), 4, "200 prompt tokens in chunks of 64: {steps:?}");
    for &i in &b_prompt_steps {
        assert!(!has_decode_of(&steps[i], a, A_PROMPT), "step {i} mixed: {:?}", steps[i]);
        // The step after a prompt-only step runs the decode it deferred, alone.
        let next = &steps[i + 1];
        assert!(has_decode_of(next, a, A_PROMPT), "step {} skipped A: {next:?}", i + 1);
        assert!(!has_prompt_of(next, b, B_PROMPT), "step {} mixed: {next:?}", i + 1);
    }
    // A never waits two steps in a row between its first and last decode.
    let a_steps: Vec<usize> =
        (0..steps.len()).filter(|&i| has_decode_of(&steps[i], a, A_PROMPT)).collect();
    for w in a_steps.windows(2) {
        assert!(w[1] - w[0] <= 2, "A waited from step {} to {}", w[0], w[1]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_chunks_ride_with_the_decodes_on_an_engine_whose_mixed_steps_amortize() {
    let (steps, a, b, a_out, b_out) = run(true).await;
    let mixed = steps
        .iter()
        .filter(|s| has_prompt_of(s, b, B_PROMPT) && has_decode_of(s, a, A_PROMPT))
        .count();
    assert_eq!(mixed, 4, "every chunk of B's prompt with a decode of A: {steps:?}");
    // The step plan changes when tokens come, not which: the same outputs either way.
    let (_, _, _, a_split, b_split) = run(false).await;
    assert_eq!(a_out, a_split);
    assert_eq!(b_out, b_split);
}

/// The engine's per-request timing in `/metrics`: two 20-token prompts arrive together on an
/// engine that computes 20 prompt tokens per step at 1 ms a token (and whose mixed steps do
/// not amortize, so a prompt is never split around a decode). One runs first; the other waits
/// for that step (its queue time), then runs its own. Lower bounds only: each bound is a
/// sleep the mock did, so no clock can make it fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_and_prefill_times_split_what_a_request_waited_for_from_its_own_steps() {
    let mock = MockConfig { prefill_us_per_token: 1000.0, ..MockConfig::zero_delay() };
    let (sched, steps, _agent) = scheduler(mock, false, A_PROMPT).await;
    let prompt = |k: u32| (0..A_PROMPT as u32).map(|i| 97 + (i * k) % 26).collect::<Vec<_>>();
    let first = sched.submit(request(prompt(3), 2)).unwrap();
    let second = sched.submit(request(prompt(5), 2)).unwrap();
    let (a, b) = tokio::join!(collect(first), collect(second));
    assert_eq!((a.len(), b.len()), (2, 2));
    let (queue, prefill) =
        (sched.stats().queue_time.snapshot(), sched.stats().prefill_time.snapshot());
    assert_eq!((queue.count, prefill.count), (2, 2));
    let step = A_PROMPT as f64 * 1e-3;
    assert!(queue.sum_s >= step, "one of them waited for the other's step: {queue:?}");
    assert!(prefill.sum_s >= 2.0 * step, "each ran a step of its own: {prefill:?}");
    // Each prompt whole in a step of its own (the steps are recorded, so the bounds above
    // hold for the plan that ran).
    let prompt_steps = steps.lock().iter().filter(|s| s.iter().any(|&(_, _, n)| n > 1)).count();
    assert_eq!(prompt_steps, 2, "{:?}", steps.lock());
}

/// A request submitted while the engine is in a long step waits in the loop's inbox until
/// the step ends; the load a worker reports (what routers balance on) counts its prompt from
/// the moment it was submitted, not from the next iteration. A report that left it out told
/// kv routers a busy worker was idle, and they piled conversations onto it (the trace
/// agreement runs showed it: a third of the requests on one of four workers).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_submitted_during_a_step_counts_in_the_load_at_once() {
    let mock = MockConfig { prefill_us_per_token: 2_000.0, ..MockConfig::zero_delay() };
    let (sched, steps, _agent) = scheduler(mock, true, 512).await;
    let a_rx = sched.submit(request(vec![97; 200], 1)).unwrap();
    // A's 200-token step has started (0.4 s of it to run).
    for _ in 0..200 {
        if !steps.lock().is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(steps.lock().len(), 1, "A's step runs");
    let (b_rx, b_seq) = sched.submit_numbered(request(vec![98; 120], 1)).unwrap();
    assert_eq!(b_seq, 2, "numbered in order of acceptance");
    let stats = sched.stats();
    assert_eq!(stats.accepted.load(std::sync::atomic::Ordering::SeqCst), 2);
    // B counts from its submission through its own step (0.24 s), also while the loop moves
    // it from the inbox to the queue between A's step and B's.
    let mut polls = 0;
    loop {
        let started = steps.lock().len() >= 2;
        let load = stats.prefill_load();
        assert!(load >= 120, "B's prompt counts at once and until its step: {load} ({polls})");
        polls += 1;
        if started {
            break;
        }
        tokio::time::sleep(Duration::from_micros(200)).await;
    }
    let (a, b) = tokio::join!(collect(a_rx), collect(b_rx));
    assert_eq!((a.len(), b.len()), (1, 1));
    assert_eq!(stats.inbox_prompt_tokens.load(std::sync::atomic::Ordering::Relaxed), 0);
}
