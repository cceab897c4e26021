//! Whatever a request holds — from an HTTP client or a peer on the worker port — the
//! scheduler answers with an event or a typed refusal and keeps serving: property tests over
//! every field of `GenerateRequest` (out-of-vocabulary tokens, any `max_tokens`, any sampling
//! floats, any stop strings, any deadline up to `u64::MAX` seconds).

use crate::common;
use std::time::Duration;

use kvfabric::agent::{Agent, AgentConfig};
use kvfabric::events::NullSink;
use kvfabric_engine::mock::{MockConfig, MockEngine};
use kvfabric_engine::{GenEvent, GenerateRequest, SamplingParams, Scheduler, SchedulerConfig};
use kvfabric_tiers::{StoreConfig, TieredStore};
use proptest::prelude::*;

fn request() -> impl Strategy<Value = GenerateRequest> {
    (
        prop::collection::vec(prop_oneof![30 => 0u32..250, 1 => any::<u32>()], 0..40),
        prop_oneof![8 => 1usize..8, 1 => any::<usize>()],
        (any::<f32>(), any::<f32>(), any::<u64>()),
        prop::collection::vec(".{0,6}", 0..3),
        any::<bool>(),
        (prop_oneof![8 => 0u64..60, 1 => any::<u64>()], 0u32..1_000_000_000),
    )
        .prop_map(
            |(prompt, max_tokens, (temperature, top_p, seed), stop, ignore_eos, (s, n))| {
                GenerateRequest {
                    prompt,
                    max_tokens,
                    sampling: SamplingParams { temperature, top_p, seed },
                    stop,
                    ignore_eos,
                    timeout: Duration::new(s, n),
                    class: None,
                    cache_salt: None,
                    tenant: None,
                    pull: None,
                }
            },
        )
}

#[test]
fn no_request_panics_the_scheduler_and_it_serves_on() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (sched, _agent, _store) = rt.block_on(async {
        let layout = common::f32_layout();
        let engine = MockEngine::new("mock", layout, MockConfig::zero_delay()).unwrap();
        let agent = Agent::start(AgentConfig::new("props", b"s".to_vec())).await.unwrap();
        let cfg = StoreConfig::new(layout.bytes_per_block(), 64);
        let store = TieredStore::open(cfg, &agent, std::sync::Arc::new(NullSink)).await.unwrap();
        let sched = Scheduler::start(
            engine,
            store.clone(),
            SchedulerConfig::default(),
            rt.handle().clone(),
        )
        .unwrap();
        (sched, agent, store)
    });
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig::with_cases(256));
    let accepted = std::cell::Cell::new(0);
    runner
        .run(&request(), |req| {
            if let Ok(mut rx) = sched.submit(req) {
                accepted.set(accepted.get() + 1);
                // A few events, then hang up (cancels a long generation).
                rt.block_on(async {
                    for _ in 0..4 {
                        match tokio::time::timeout(Duration::from_secs(10), rx.recv()).await {
                            Ok(Some(GenEvent::Done { .. } | GenEvent::Error(_))) | Ok(None) => {
                                break
                            }
                            Ok(Some(_)) => {}
                            Err(_) => panic!("no event within 10 s"),
                        }
                    }
                });
            }
            Ok(())
        })
        .unwrap();
    assert!(accepted.get() >= 64, "only {} of 256 requests reached the engine", accepted.get());
    // The engine thread is alive: a plain request completes.
    let ok = GenerateRequest {
        ignore_eos: true,
        ..GenerateRequest::new(vec![104, 105], 3, Duration::from_secs(30))
    };
    let mut rx = sched.submit(ok).unwrap();
    let done = rt.block_on(async {
        loop {
            match rx.recv().await {
                Some(GenEvent::Done { completion_tokens, .. }) => break completion_tokens,
                Some(GenEvent::Error(e)) => panic!("{e}"),
                Some(_) => {}
                None => panic!("the scheduler stopped"),
            }
        }
    });
    assert_eq!(done, 3);
}
