//! Service classes in the engine's scheduler: waiting requests are admitted earliest
//! deadline first, a full queue sheds its least urgent request for a more urgent one (with a
//! Retry-After), a more urgent request preempts a less urgent prefill (which resumes from
//! its stored blocks), prompt chunks are cut to what fits in a latency decode's ITL target,
//! a request past its class's `expire` is answered without being computed, and a cache salt
//! keeps requests of different namespaces from reading each other's blocks, in host memory
//! and on disk, and in the fabric for another worker; a tenant past its store quota gives up its own blocks, not another's.
//!
//! The mock engine's steps are recorded (which sequence, from which position, how many
//! tokens, and the first of them), so each test checks the plan that ran. Where a test needs
//! requests to arrive while another runs, that other runs for hundreds of milliseconds.

use crate::common;
use std::sync::atomic::Ordering;

use std::sync::Arc;
use std::time::Duration;

use common::StepLog;
use kvfabric::agent::{Agent, AgentConfig};
use kvfabric::contract::generate::{ClassHint, TenantHint};
use kvfabric::events::NullSink;
use kvfabric_engine::mock::{MockConfig, MockEngine};
use kvfabric_engine::{
    CacheHits, EngineError, EventRx, GenEvent, GenerateRequest, Scheduler, SchedulerConfig,
};
use kvfabric_tiers::{StoreConfig, TieredStore};
use parking_lot::Mutex;

/// One input of a step: (sequence, first position, tokens, the first token).
type Input = (u64, usize, usize, u32);

struct Setup {
    sched: Scheduler,
    steps: Arc<Mutex<Vec<Vec<Input>>>>,
    store: TieredStore,
    _agent: Agent,
    _dir: tempfile::TempDir,
}

async fn setup(mock: MockConfig, cfg: SchedulerConfig, host_blocks: u32, disk: bool) -> Setup {
    let layout = common::f32_layout();
    let agent = Agent::start(AgentConfig::new("classes", b"s".to_vec())).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut scfg = StoreConfig::new(layout.bytes_per_block(), host_blocks);
    if disk {
        scfg.disk_admit_min_hits = 0;
        scfg.disk = Some(kvfabric_tiers::disk::DiskConfig::new(dir.path().join("kv.slots"), 256));
    }
    let store = TieredStore::open(scfg, &agent, Arc::new(NullSink)).await.unwrap();
    let steps = Arc::new(Mutex::new(Vec::new()));
    let engine = StepLog {
        inner: MockEngine::new("mock", layout, mock).unwrap(),
        amortize: false,
        steps: steps.clone(),
        record: |i| (i.seq, i.start, i.tokens.len(), i.tokens[0]),
    };
    let sched =
        Scheduler::start(engine, store.clone(), cfg, tokio::runtime::Handle::current()).unwrap();
    Setup { sched, steps, store, _agent: agent, _dir: dir }
}

fn class(name: &str, rank: u8, ttft_ms: u64) -> ClassHint {
    ClassHint {
        name: name.into(),
        rank,
        priority: i32::from(rank),
        ttft: Some(Duration::from_millis(ttft_ms)),
        itl: None,
        expire: None,
        share: None,
    }
}

fn interactive() -> ClassHint {
    ClassHint { itl: Some(Duration::from_millis(20)), ..class("interactive", 0, 300) }
}

fn batch() -> ClassHint {
    class("batch", 1, 30_000)
}

/// A prompt of `n` tokens that starts with `first` (the step log tells requests apart by it).
fn prompt(first: u32, n: usize) -> Vec<u32> {
    std::iter::once(first).chain((1..n as u32).map(|i| 97 + (i * first) % 26)).collect()
}

fn request(first: u32, n: usize, max_tokens: usize, class: Option<ClassHint>) -> GenerateRequest {
    GenerateRequest {
        ignore_eos: true,
        class,
        ..GenerateRequest::new(prompt(first, n), max_tokens, Duration::from_secs(30))
    }
}

/// The tokens of a generation, its cache hits, or its error.
async fn collect(mut rx: EventRx) -> Result<(Vec<u32>, CacheHits), EngineError> {
    let (mut tokens, mut hits) = (Vec::new(), CacheHits::default());
    while let Some(ev) = rx.recv().await {
        match ev {
            GenEvent::Started { cached, .. } => hits = cached,
            GenEvent::Token { id, .. } => tokens.push(id),
            GenEvent::Done { .. } => return Ok((tokens, hits)),
            GenEvent::Error(e) => return Err(e),
            _ => {}
        }
    }
    Err(EngineError::Stopped)
}

/// Waits for the first token of `rx` (the request decodes from now on).
async fn first_token(rx: &mut EventRx) {
    loop {
        match rx.recv().await.expect("it runs") {
            GenEvent::Token { .. } => return,
            GenEvent::Error(e) => panic!("{e}"),
            _ => {}
        }
    }
}

/// The order in which requests (by their first prompt token) had their first step.
fn first_steps(steps: &[Vec<Input>]) -> Vec<u32> {
    let mut order = Vec::new();
    for s in steps {
        for &(_, start, _, first) in s {
            if start == 0 && !order.contains(&first) {
                order.push(first);
            }
        }
    }
    order
}

async fn until(what: &str, mut f: impl FnMut() -> bool) {
    for _ in 0..2000 {
        if f() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    panic!("timed out waiting for {what}");
}

/// A decode running for about 0.4 s (200 tokens of 2 ms), holding the only batch slot.
fn blocker() -> GenerateRequest {
    request(1, 20, 200, None)
}

fn slow_decode() -> MockConfig {
    MockConfig { decode_step_us: 2_000.0, ..MockConfig::zero_delay() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_requests_are_admitted_earliest_deadline_first() {
    let cfg = SchedulerConfig { batch_max: 1, ..SchedulerConfig::default() };
    let s = setup(slow_decode(), cfg, 256, false).await;
    let mut a = s.sched.submit(blocker()).unwrap();
    first_token(&mut a).await;
    // While the blocker decodes (it cannot be preempted: it produced a token): two batch
    // requests, then an interactive one, then a request of no class (its deadline is its
    // timeout, 30 s).
    let b1 = s.sched.submit(request(2, 40, 2, Some(batch()))).unwrap();
    let b2 = s.sched.submit(request(3, 40, 2, Some(batch()))).unwrap();
    let i = s.sched.submit(request(4, 40, 2, Some(interactive()))).unwrap();
    let n = s.sched.submit(request(5, 40, 2, None)).unwrap();
    for rx in [a, b1, b2, i, n] {
        collect(rx).await.unwrap();
    }
    assert_eq!(first_steps(&s.steps.lock()), [1, 4, 2, 3, 5]);
    assert_eq!(s.sched.stats().preempted.load(Ordering::Relaxed), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_sheds_its_least_urgent_request_for_a_more_urgent_one() {
    let cfg = SchedulerConfig { batch_max: 1, waiting_max: 2, ..SchedulerConfig::default() };
    let s = setup(slow_decode(), cfg, 256, false).await;
    let mut a = s.sched.submit(blocker()).unwrap();
    first_token(&mut a).await;
    let b1 = s.sched.submit(request(2, 40, 2, Some(batch()))).unwrap();
    let b2 = s.sched.submit(request(3, 40, 2, Some(batch()))).unwrap();
    let stats = s.sched.stats();
    until("the loop to queue both", || stats.least_urgent_waiting.load(Ordering::Relaxed) == 1)
        .await;
    // Full: another batch request is refused at once, with when to retry.
    match s.sched.submit(request(6, 40, 2, Some(batch()))) {
        Err(EngineError::Overloaded { waiting: 2, retry_after_ms: Some(ms) }) => {
            assert!(ms >= 1000, "{ms}")
        }
        other => panic!("{other:?}"),
    }
    // An interactive one is taken; the later batch request leaves the queue instead.
    let i = s.sched.submit(request(4, 40, 2, Some(interactive()))).unwrap();
    match collect(b2).await {
        Err(EngineError::Overloaded { retry_after_ms: Some(_), .. }) => {}
        other => panic!("the later batch request was kept: {other:?}"),
    }
    for rx in [a, b1, i] {
        collect(rx).await.unwrap();
    }
    assert_eq!(first_steps(&s.steps.lock()), [1, 4, 2]);
    assert_eq!(stats.shed.load(Ordering::Relaxed), 2);
    assert_eq!(stats.waiting.load(Ordering::Relaxed), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_urgent_request_preempts_a_batch_prefill_which_resumes_from_its_stored_blocks() {
    // A 2,000-token batch prompt in chunks of 64 tokens at 50 µs a token: 32 steps of 3.2 ms.
    let mock = MockConfig { prefill_us_per_token: 50.0, ..MockConfig::zero_delay() };
    let cfg = SchedulerConfig { batch_max: 1, step_tokens: 64, ..SchedulerConfig::default() };
    let s = setup(mock, cfg, 512, false).await;
    let b = s.sched.submit(request(2, 2000, 4, Some(batch()))).unwrap();
    let steps = s.steps.clone();
    until("B's prefill to be under way", || steps.lock().len() >= 4).await;
    let i = s.sched.submit(request(4, 40, 4, Some(interactive()))).unwrap();
    let (b_out, i_out) = tokio::join!(collect(b), collect(i));
    let (b_out, i_out) = (b_out.unwrap().0, i_out.unwrap().0);
    assert_eq!((b_out.len(), i_out.len()), (4, 4));
    let stats = s.sched.stats();
    assert_eq!(stats.preempted.load(Ordering::Relaxed), 1);
    // B stopped, I ran whole, B resumed: from a block it had stored (not from 0).
    let log = s.steps.lock().clone();
    let seqs: Vec<u64> = log.iter().map(|st| st[0].0).collect();
    let (b_first, i_seq) = (seqs[0], log.iter().flatten().find(|x| x.3 == 4).unwrap().0);
    let i_steps: Vec<usize> = (0..log.len()).filter(|&k| seqs[k] == i_seq).collect();
    let before = i_steps[0];
    assert!(before >= 4 && seqs[..before].iter().all(|&q| q == b_first), "{log:?}");
    let resumed = &log[*i_steps.last().unwrap() + 1][0];
    assert_ne!(resumed.0, b_first, "B resumes as a new sequence");
    assert!(resumed.1 >= 16 * 3 && resumed.1 % 16 == 0, "B resumed from {}", resumed.1);
    // And generates what it generates unpreempted.
    let alone = setup(mock, SchedulerConfig::default(), 512, false).await;
    let again = collect(alone.sched.submit(request(2, 2000, 4, Some(batch()))).unwrap()).await;
    assert_eq!(again.unwrap().0, b_out);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_latency_request_pauses_a_batch_decode_which_resumes_token_for_token() {
    // Four batch requests decode 300 tokens each at 2 ms a step (0.6 s), filling the batch.
    let mock = MockConfig { decode_step_us: 2_000.0, ..MockConfig::zero_delay() };
    let cfg = SchedulerConfig { batch_max: 4, ..SchedulerConfig::default() };
    let s = setup(mock, cfg, 512, false).await;
    let mut running = Vec::new();
    for first in 10..14 {
        let rx = s.sched.submit(request(first, 40, 300, Some(batch()))).unwrap();
        running.push(tokio::spawn(collect(rx)));
    }
    let stats = s.sched.stats();
    until("the four to decode", || {
        stats.running.load(Ordering::Relaxed) == 4
            && stats.generated_tokens.load(Ordering::Relaxed) >= 8
    })
    .await;
    // An interactive request (TTFT target 300 ms) cannot wait for one of them to end: it
    // takes the slot of a decode, which pauses.
    let i = s.sched.submit(request(4, 40, 1, Some(interactive()))).unwrap();
    let i_out = collect(i).await.unwrap().0;
    assert_eq!(i_out.len(), 1);
    let mut outs = Vec::new();
    for b in running {
        outs.push(b.await.unwrap());
    }
    assert_eq!(stats.preempted_decode.load(Ordering::Relaxed), 1);
    assert_eq!(stats.preempted.load(Ordering::Relaxed), 0);
    let log = s.steps.lock().clone();
    // The interactive request ran while every batch request still had tokens to go: each
    // of the four ran a step after it.
    let i_step = log.iter().position(|st| st.iter().any(|x| x.3 == 4 && x.1 == 0)).unwrap();
    let after: std::collections::BTreeSet<u64> =
        log[i_step + 1..].iter().flatten().map(|x| x.0).collect();
    let before: std::collections::BTreeSet<u64> =
        log[..i_step].iter().flatten().map(|x| x.0).collect();
    assert_eq!(after.iter().filter(|q| before.contains(q)).count(), 3, "three kept decoding");
    // The paused one resumed as a new sequence from its stored blocks: its first step
    // starts past them (the last, partial block computed again), not at 0.
    let resumed = after.iter().find(|q| !before.contains(q)).unwrap();
    let first = log.iter().flatten().find(|x| x.0 == *resumed).unwrap();
    assert!(first.1 >= 16 * 2 && first.1 % 16 == 0, "resumed from {first:?}");
    // Each batch request generated, token for token, what it generates unpreempted.
    let alone = setup(mock, SchedulerConfig::default(), 512, false).await;
    for (first, out) in (10..14).zip(outs) {
        let out = out.unwrap().0;
        assert_eq!(out.len(), 300);
        let again = collect(alone.sched.submit(request(first, 40, 300, Some(batch()))).unwrap());
        assert_eq!(again.await.unwrap().0, out, "batch request {first}");
    }
}

/// A paused batch request at the head of the queue waits for a free slot; it does not hold
/// back an interactive request behind it, which pauses the other batch decode at once
/// (rather than waiting for the first interactive request to end).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_decode_at_the_head_of_the_queue_does_not_hold_back_a_latency_request() {
    let mock = MockConfig { decode_step_us: 2_000.0, ..MockConfig::zero_delay() };
    let cfg = SchedulerConfig { batch_max: 2, ..SchedulerConfig::default() };
    let s = setup(mock, cfg, 512, false).await;
    let stats = s.sched.stats();
    // Batch requests whose TTFT deadline is long past (as a batch request's is once it
    // decoded a while): paused, one queues right behind the request it made room for.
    let late = class("batch", 1, 1);
    let b: Vec<_> = (20..22)
        .map(|f| {
            let rx = s.sched.submit(request(f, 40, 300, Some(late.clone()))).unwrap();
            tokio::spawn(collect(rx))
        })
        .collect();
    until("both to decode", || stats.generated_tokens.load(Ordering::Relaxed) >= 4).await;
    // The first interactive request decodes 100 tokens (0.2 s): it pauses one batch decode.
    let mut i1 = s.sched.submit(request(4, 40, 100, Some(interactive()))).unwrap();
    first_token(&mut i1).await;
    assert_eq!(stats.preempted_decode.load(Ordering::Relaxed), 1);
    // The second finds the paused one at the head of the queue and the other batch request
    // decoding: it pauses that one too, at once.
    let i2 = s.sched.submit(request(5, 40, 1, Some(interactive()))).unwrap();
    collect(i2).await.unwrap();
    assert_eq!(stats.preempted_decode.load(Ordering::Relaxed), 2);
    collect(i1).await.unwrap();
    for h in b {
        assert_eq!(h.await.unwrap().unwrap().0.len(), 300);
    }
    let log = s.steps.lock().clone();
    let first_of = |t: u32| log.iter().position(|st| st.iter().any(|x| x.3 == t && x.1 == 0));
    let last_of_i1 = {
        let seq = log.iter().flatten().find(|x| x.3 == 4 && x.1 == 0).unwrap().0;
        log.iter().rposition(|st| st.iter().any(|x| x.0 == seq)).unwrap()
    };
    assert!(first_of(5).unwrap() < last_of_i1, "the second waited for the first to end");
}

/// A paused decode waits to resume without taking a place in the queue: with room for one
/// waiting request, the queue still takes a new one while a paused batch request waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_decode_takes_no_place_in_the_queue() {
    let mock = MockConfig { decode_step_us: 2_000.0, ..MockConfig::zero_delay() };
    let cfg = SchedulerConfig { batch_max: 1, waiting_max: 1, ..SchedulerConfig::default() };
    let s = setup(mock, cfg, 512, false).await;
    let stats = s.sched.stats();
    let b = tokio::spawn(collect(s.sched.submit(request(30, 40, 300, Some(batch()))).unwrap()));
    until("it decodes", || stats.generated_tokens.load(Ordering::Relaxed) >= 2).await;
    let mut i = s.sched.submit(request(4, 40, 100, Some(interactive()))).unwrap();
    first_token(&mut i).await;
    assert_eq!(stats.resuming.load(Ordering::Relaxed), 1, "the batch request is paused");
    let next = s.sched.submit(request(31, 40, 2, Some(batch())));
    assert!(next.is_ok(), "refused while only a paused request waits: {next:?}");
    collect(i).await.unwrap();
    collect(next.unwrap()).await.unwrap();
    assert_eq!(b.await.unwrap().unwrap().0.len(), 300);
    assert_eq!(stats.resuming.load(Ordering::Relaxed), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_chunks_are_cut_to_fit_a_latency_decodes_itl_target() {
    // A 512-token chunk costs 51 ms; a decode step 5 ms. The interactive class's ITL target
    // is 20 ms: beside its decode, chunks of at most 150 tokens fit.
    let mock = MockConfig {
        prefill_us_per_token: 100.0,
        decode_step_us: 5_000.0,
        ..MockConfig::zero_delay()
    };
    let cfg = SchedulerConfig { step_tokens: 512, ..SchedulerConfig::default() };
    let s = setup(mock, cfg, 512, false).await;
    let mut i = s.sched.submit(request(4, 40, 20, Some(interactive()))).unwrap();
    first_token(&mut i).await;
    let b = s.sched.submit(request(2, 6000, 2, Some(batch()))).unwrap();
    let (i_out, b_out) = tokio::join!(collect(i), collect(b));
    assert_eq!((i_out.unwrap().0.len(), b_out.unwrap().0.len()), (19, 2));
    let log = s.steps.lock().clone();
    let i_seq = log[0][0].0;
    let last_i = log.iter().rposition(|st| st.iter().any(|x| x.0 == i_seq)).unwrap();
    let b_chunks = |range: std::ops::Range<usize>| -> Vec<usize> {
        log[range].iter().flatten().filter(|x| x.3 != 4 && x.2 > 1).map(|x| x.2).collect()
    };
    let during = b_chunks(0..last_i);
    let after = b_chunks(last_i..log.len());
    assert!(!during.is_empty(), "B's prompt began while I decoded: {log:?}");
    // The first chunk may run before a step was measured; every later one is cut.
    assert!(during[1..].iter().all(|&n| (16..=160).contains(&n)), "{during:?}");
    assert!(after.contains(&512), "whole chunks once I is done: {after:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_past_its_class_expiry_is_answered_without_being_computed() {
    let cfg = SchedulerConfig { batch_max: 1, ..SchedulerConfig::default() };
    let s = setup(slow_decode(), cfg, 256, false).await;
    let mut a = s.sched.submit(blocker()).unwrap();
    first_token(&mut a).await;
    let short = ClassHint { expire: Some(Duration::from_millis(50)), ..batch() };
    let e = s.sched.submit(request(7, 40, 2, Some(short))).unwrap();
    let (a_out, e_out) = tokio::join!(
        async {
            // The blocker is still decoding when the expired request is answered.
            let r = collect(a).await;
            (r, std::time::Instant::now())
        },
        async { (collect(e).await, std::time::Instant::now()) }
    );
    match e_out.0 {
        Err(EngineError::Deadline { timeout }) => assert_eq!(timeout, Duration::from_millis(50)),
        other => panic!("{other:?}"),
    }
    assert!(e_out.1 < a_out.1, "answered while the blocker ran");
    assert_eq!(a_out.0.unwrap().0.len(), 199);
    assert!(!first_steps(&s.steps.lock()).contains(&7), "never computed");
    assert_eq!(s.sched.stats().expired.load(Ordering::Relaxed), 1);
}

async fn hits(s: &Setup, salt: Option<&str>) -> (Vec<u32>, CacheHits) {
    let req = GenerateRequest { cache_salt: salt.map(str::to_string), ..request(9, 321, 4, None) };
    collect(s.sched.submit(req).unwrap()).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_salted_prompt_is_a_miss_for_another_salt_in_host_memory_and_on_disk() {
    // Host memory: 20 full blocks, all kept.
    let s = setup(MockConfig::zero_delay(), SchedulerConfig::default(), 256, false).await;
    let (cold, first) = hits(&s, Some("tenant-a")).await;
    assert_eq!(first.total(), 0);
    let (out, other) = hits(&s, Some("tenant-b")).await;
    assert_eq!((other.total(), &out), (0, &cold), "another salt reads nothing");
    let (_, none) = hits(&s, None).await;
    assert_eq!(none.total(), 0, "nor does no salt");
    let (out, same) = hits(&s, Some("tenant-a")).await;
    assert_eq!((same.host_tokens, &out), (320, &cold), "the same salt reads its own");
    // The block names differ: the hasher of each salt.
    let a = s.sched.hasher(Some("tenant-a")).sequence_hashes(&prompt(9, 321));
    let b = s.sched.hasher(Some("tenant-b")).sequence_hashes(&prompt(9, 321));
    assert!(a.iter().zip(&b).all(|(x, y)| x != y));
    assert_eq!(
        s.sched.hasher(None).sequence_hashes(&prompt(9, 321)),
        s.sched.sequence_hashes(&prompt(9, 321))
    );

    // Disk: 3 host slots, so the 20 blocks live on disk.
    let d = setup(MockConfig::zero_delay(), SchedulerConfig::default(), 3, true).await;
    hits(&d, Some("tenant-a")).await;
    let (_, other) = hits(&d, Some("tenant-b")).await;
    assert_eq!(other.total(), 0, "another salt reads nothing from disk");
    let (_, same) = hits(&d, Some("tenant-a")).await;
    assert_eq!(same.total(), 320);
    assert!(same.disk_tokens > 0, "{same:?}");
    assert!(d.store.metrics().disk_hits > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_latency_class_prefix_stays_in_host_memory_while_batch_prompts_pass_through() {
    // 16 host slots, no disk: what is evicted is gone. Four batch prompts of 10 blocks each
    // pass through after a 3-block prompt; kept if an interactive request used it, gone if a
    // batch request did.
    let s = setup(MockConfig::zero_delay(), SchedulerConfig::default(), 16, false).await;
    let run = |first: u32, n: usize, class: ClassHint| {
        let rx = s.sched.submit(request(first, n, 2, Some(class))).unwrap();
        async move { collect(rx).await.unwrap().1 }
    };
    assert_eq!(run(4, 49, interactive()).await.total(), 0);
    assert_eq!(run(5, 49, batch()).await.total(), 0);
    for k in 0..4 {
        run(10 + k, 161, batch()).await;
    }
    let kept = run(4, 49, interactive()).await;
    assert_eq!(kept.host_tokens, 48, "the interactive prefix stayed: {kept:?}");
    let gone = run(5, 49, batch()).await;
    assert_eq!(gone.total(), 0, "the batch one of the same age was evicted: {gone:?}");
    assert!(s.store.metrics().host_used_blocks <= 16);
}

/// A 65-token prompt (4 full blocks) from `first` of `tenant`, with its quotas (store, host,
/// disk) and its namespace as the salt, as the frontend sends it.
fn tenant_request(
    first: u32,
    tenant: &str,
    store: Option<u64>,
    host: Option<u64>,
    disk: Option<u64>,
) -> GenerateRequest {
    GenerateRequest {
        cache_salt: Some(format!("tenant\0{tenant}")),
        tenant: Some(TenantHint {
            name: tenant.into(),
            store_blocks: store,
            host_blocks: host,
            disk_blocks: disk,
        }),
        ..request(first, 65, 2, None)
    }
}

/// A tenant with a store quota of 6 blocks sends three prompts of 4 blocks each: its least
/// recently used blocks (6 of 12) leave the store, from host memory and from disk, while
/// another tenant's blocks (no quota, stored before them) stay; its latest prompt is still a
/// hit. Without the quota, the same requests find its oldest prompt too (the store had room:
/// the quota, not eviction, removed it). Each tenant's requests carry its namespace as their
/// salt, as the frontend sends them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_past_its_store_quota_gives_up_its_own_blocks_not_anothers() {
    for (disk, quota) in [(false, Some(6)), (true, Some(6)), (false, None), (true, None)] {
        // Without disk, 64 host slots; with disk, 8 (the older blocks live on disk).
        let host = if disk { 8 } else { 64 };
        let s = setup(MockConfig::zero_delay(), SchedulerConfig::default(), host, disk).await;
        let run = |first: u32, tenant: &str, quota: Option<u64>| {
            let rx = s.sched.submit(tenant_request(first, tenant, quota, None, None)).unwrap();
            async move { collect(rx).await.unwrap().1 }
        };
        assert_eq!(run(50, "beta", None).await.total(), 0);
        for first in [60, 61, 62] {
            assert_eq!(run(first, "acme", quota).await.total(), 0);
        }
        // The engine removes them after the request retired, in the background.
        let removed = || s.sched.stats().quota_removed.load(Ordering::Relaxed);
        let case = format!("disk {disk}, quota {quota:?}");
        if quota.is_some() {
            until("6 of 12 blocks removed", || removed() >= 6).await;
        }
        assert_eq!(removed(), if quota.is_some() { 6 } else { 0 }, "{case}: 12 blocks used");
        let beta = run(50, "beta", None).await;
        assert_eq!(beta.total(), 64, "{case}: the other tenant's prompt stayed: {beta:?}");
        let latest = run(62, "acme", quota).await;
        assert_eq!(latest.total(), 64, "{case}: its latest prompt stayed: {latest:?}");
        let oldest = run(60, "acme", quota).await;
        let want = if quota.is_some() { 0 } else { 64 };
        assert_eq!(oldest.total(), want, "{case}: its oldest prompt: {oldest:?}");
        if disk {
            assert!(beta.disk_tokens > 0, "{case}: {beta:?}");
        }
    }
}

/// Quotas per tier: a tenant with 4 host blocks and 4 disk blocks sends three prompts of 4
/// blocks each on a worker with room for all of them in host memory. Its latest prompt stays
/// in host memory, the one before moves to disk (read back from there), the oldest leaves
/// the store; another tenant's prompt, stored first, stays in host memory. Moves and
/// removals are counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_past_its_host_quota_moves_its_blocks_to_disk_and_past_its_disk_quota_out() {
    let s = setup(MockConfig::zero_delay(), SchedulerConfig::default(), 64, true).await;
    let run = |first: u32, tenant: &str, host: Option<u64>, disk: Option<u64>| {
        let rx = s.sched.submit(tenant_request(first, tenant, None, host, disk)).unwrap();
        async move { collect(rx).await.unwrap().1 }
    };
    assert_eq!(run(50, "beta", None, None).await.total(), 0);
    for first in [60, 61, 62] {
        assert_eq!(run(first, "acme", Some(4), Some(4)).await.total(), 0);
    }
    let stats = s.sched.stats();
    let demoted = || stats.quota_demoted.load(Ordering::Relaxed);
    let removed = || stats.quota_removed.load(Ordering::Relaxed);
    until("8 blocks moved to disk and 4 removed", || demoted() >= 8 && removed() >= 4).await;
    assert_eq!((demoted(), removed()), (8, 4), "12 blocks used: 4 stay, 8 go down, 4 of them out");
    let beta = run(50, "beta", None, None).await;
    assert_eq!(
        (beta.host_tokens, beta.disk_tokens),
        (64, 0),
        "the other tenant stayed in host memory"
    );
    // Each read charges the tenant again (the oldest, computed afresh, last).
    let latest = run(62, "acme", Some(4), Some(4)).await;
    assert_eq!((latest.host_tokens, latest.disk_tokens), (64, 0), "its latest prompt: {latest:?}");
    let middle = run(61, "acme", Some(4), Some(4)).await;
    assert_eq!((middle.host_tokens, middle.disk_tokens), (0, 64), "the one before: {middle:?}");
    let oldest = run(60, "acme", Some(4), Some(4)).await;
    assert_eq!(oldest.total(), 0, "its oldest prompt left the store: {oldest:?}");
}

/// What a tenant's quotas keep is a usable prefix: host 4, disk 8, store 10 blocks, twenty
/// distinct prompts of 6 blocks. The tenant ends holding 10 blocks, each with its parent
/// (a sequence's blocks leave from its end, children before parents), and its last prompt
/// is found whole (4 blocks in host memory, 2 on disk); without a disk, its 4 host blocks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_tenants_quota_keeps_is_a_usable_prefix() {
    for disk in [true, false] {
        let s = setup(MockConfig::zero_delay(), SchedulerConfig::default(), 64, disk).await;
        let run = |first: u32| {
            let req = GenerateRequest {
                cache_salt: Some("tenant\0acme".into()),
                tenant: Some(TenantHint {
                    name: "acme".into(),
                    store_blocks: Some(10),
                    host_blocks: Some(4),
                    disk_blocks: Some(8),
                }),
                ..request(first, 97, 2, None)
            };
            let rx = s.sched.submit(req).unwrap();
            async move { collect(rx).await.unwrap().1 }
        };
        for first in 100..120 {
            run(first).await;
        }
        let stats = s.sched.stats();
        let gone = || stats.quota_removed.load(Ordering::Relaxed);
        // 120 blocks used: with a disk 110 leave the store; without, every block past the
        // host quota does (moving it down drops it).
        let want = if disk { 110 } else { 116 };
        until("the quota's removals", || gone() >= want).await;
        let held = s.store.snapshot();
        let hashes: std::collections::HashSet<_> = held.iter().map(|b| b.1).collect();
        assert_eq!(held.len(), if disk { 10 } else { 4 }, "disk {disk}: {held:?}");
        for (tier, hash, parent) in &held {
            assert!(
                parent.is_none_or(|p| hashes.contains(&p)),
                "disk {disk}: block {hash:?} ({tier:?}) is kept without its parent"
            );
        }
        let last = run(119).await;
        let want = if disk { (64, 32) } else { (64, 0) };
        assert_eq!((last.host_tokens, last.disk_tokens), want, "disk {disk}: {last:?}");
    }
}

/// The store's own eviction takes a sequence from its end too: with 8 host slots and no
/// disk, a second prompt of 6 blocks (96 tokens, one token generated: 6 slots) evicts 4 of
/// the first's, its last 4, and the first prompt is still found by its first 2 blocks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_evicts_a_sequence_from_its_end() {
    let s = setup(MockConfig::zero_delay(), SchedulerConfig::default(), 8, false).await;
    let run = |first: u32| {
        let rx = s.sched.submit(request(first, 96, 1, None)).unwrap();
        async move { collect(rx).await.unwrap().1 }
    };
    run(30).await;
    run(31).await;
    let again = run(30).await;
    assert_eq!(again.host_tokens, 32, "{again:?}");
}

/// The fabric (G4): a worker with 8 host slots and no disk spills a salted prompt's blocks to
/// a fabric node; another worker on the same fabric finds them only with the same salt (a
/// remote hit), and nothing under another salt or none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_salted_prompt_in_the_fabric_is_a_miss_for_another_salt_on_another_worker() {
    use kvfabric_tiers::fabric::FabricNode;
    use kvfabric_tiers::remote::RemoteTier;
    let layout = common::f32_layout();
    let bytes = layout.bytes_per_block();
    let node_agent = Agent::start(AgentConfig::new("fabric-a", b"s".to_vec())).await.unwrap();
    let node_store =
        TieredStore::open(StoreConfig::new(bytes, 128), &node_agent, Arc::new(NullSink))
            .await
            .unwrap();
    let node = FabricNode::serve(node_agent.clone(), node_store, Duration::from_secs(10));
    let mut workers = Vec::new();
    for name in ["worker-a", "worker-b"] {
        let agent = Agent::start(AgentConfig::new(name, b"s".to_vec())).await.unwrap();
        let remote = RemoteTier::new(agent.clone(), Duration::from_secs(5));
        remote.add_node(&node.info()).await.unwrap();
        let mut cfg = StoreConfig::new(bytes, 8);
        cfg.remote = Some(remote);
        let store = TieredStore::open(cfg, &agent, Arc::new(NullSink)).await.unwrap();
        let sched = common::mock_scheduler(layout, &store);
        workers.push((sched, store, agent));
    }
    let run = |w: usize, salt: Option<&str>| {
        let req =
            GenerateRequest { cache_salt: salt.map(str::to_string), ..request(9, 321, 4, None) };
        let rx = workers[w].0.submit(req).unwrap();
        async move { collect(rx).await.unwrap() }
    };
    let (cold, first) = run(0, Some("tenant\0a")).await;
    assert_eq!(first.total(), 0);
    assert!(node.store().metrics().stored_blocks >= 8, "worker-a spilled to the fabric");
    let (out, other) = run(1, Some("tenant\0b")).await;
    assert_eq!((other.total(), &out), (0, &cold), "another salt reads nothing from the fabric");
    let (_, none) = run(1, None).await;
    assert_eq!(none.total(), 0, "nor does no salt");
    let (out, same) = run(1, Some("tenant\0a")).await;
    assert!(same.remote_tokens > 0, "the same salt reads its blocks from the fabric: {same:?}");
    assert_eq!(out, cold);
}
