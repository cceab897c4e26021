//! A worker assembled in process by the library (no binary, no child process): it serves a
//! routing frontend found through discovery, publishes the KV events that feed the frontend's
//! index, and leaves discovery when revoked.

mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use kvfabric::control::memory::{MemoryBus, MemoryDiscovery};
use kvfabric::control::{Discovery, EventBus};
use kvfabric_serving::disagg::DisaggConfig;
use kvfabric_serving::engine::mock::MockConfig;
use kvfabric_serving::engine::SchedulerConfig;
use kvfabric_serving::http::{router, ServerConfig};
use kvfabric_serving::routed::{RoutedBackend, RoutedConfig};
use kvfabric_serving::worker::{EngineSpec, Role, WorkerConfig, WorkerStack, WORKER_KIND};
use serde_json::json;

const SECRET: &[u8] = b"worker-test-secret";
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_stack_serves_a_routed_frontend_in_process() {
    let discovery: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new());
    let bus: Arc<dyn EventBus> = Arc::new(MemoryBus::new());
    let cfg = WorkerConfig {
        name: "w-0".into(),
        engine: EngineSpec::Mock {
            name: "mock".into(),
            block_tokens: 16,
            model_dir: None,
            config: MockConfig { decode_step_us: 100.0, ..MockConfig::default() },
        },
        scheduler: SchedulerConfig::default(),
        secret: Some(SECRET.to_vec()),
        host_blocks: 64,
        disk: None,
        disk_admit_min_hits: 0,
        remote_tier: true,
    };
    let stack = WorkerStack::start(&cfg, &discovery, bus.clone(), |_, _| {}).await.unwrap();
    let served = stack
        .serve(
            "w-0",
            Role::Aggregated,
            "127.0.0.1:0".parse().unwrap(),
            &discovery,
            &bus,
            4,
            DisaggConfig::default(),
            Duration::from_secs(5),
        )
        .await
        .unwrap();
    assert_eq!(discovery.list(WORKER_KIND).await.unwrap().len(), 1);

    let routed = Arc::new(
        RoutedBackend::start(discovery.clone(), bus.clone(), RoutedConfig::new(SECRET))
            .await
            .unwrap(),
    );
    let app = router(routed.clone(), ServerConfig::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });

    let prompt = "a prompt long enough for a few blocks of sixteen tokens each ".repeat(2);
    let body = json!({ "model": "mock", "prompt": prompt, "max_tokens": 4 });
    let r = common::post_json(addr, "/v1/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-kvfabric-worker"), Some("w-0"));
    // Its stored blocks reach the frontend's index as KV events.
    let feed = routed.clone();
    common::wait_until(Duration::from_secs(10), || {
        feed.feed_stats().applied.load(Ordering::Relaxed) >= 5
    });
    assert!(served.metrics.render().contains("kvfabric_prefill_tokens_total"));

    assert_eq!(common::get(addr, "/health").await.status, 200);
    served.registration.revoke().await;
    assert!(discovery.list(WORKER_KIND).await.unwrap().is_empty());
    // No worker: an outage, not a client error — 503 in OpenAI's shape, and /health says so.
    let gone = routed.clone();
    common::wait_until(Duration::from_secs(10), || {
        use kvfabric_serving::backend::Backend;
        gone.health()["workers"].as_array().is_some_and(|w| w.is_empty())
    });
    let r = common::post_json(addr, "/v1/completions", &body).await;
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "service_unavailable");
    let h = common::get(addr, "/health").await;
    assert_eq!((h.status, h.json()["status"].as_str()), (503, Some("no workers")));
    served.server.abort();
    stack.shutdown().await;
}
