//! Service classes and tenants at the HTTP frontend, over the mock engine in process and
//! real sockets: every spelling of a class reaches the class it names (counted per class in
//! `/metrics`), an unknown class is a 400, a full queue sheds a batch request with 429 and
//! `Retry-After`, a tenant's API key pins its classes and namespaces its cache (a prompt one
//! tenant cached is a miss for another and a hit for itself), and `cache_salt` does the same
//! for clients without tenants.

use crate::common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use common::{metric, parse_response, Response};
use kvfabric::agent::{Agent, AgentConfig};
use kvfabric::events::NullSink;
use kvfabric::layout::{KvDtype, ModelSpec};
use kvfabric_serving::backend::LocalBackend;
use kvfabric_serving::classes::{Classes, Tenant, Tenants};
use kvfabric_serving::engine::mock::{MockConfig, MockEngine};
use kvfabric_serving::engine::{Scheduler, SchedulerConfig};
use kvfabric_serving::http::{router, ServerConfig};
use kvfabric_tiers::{StoreConfig, TieredStore};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

struct Server {
    addr: SocketAddr,
    _agent: Agent,
}

fn classes() -> Classes {
    let specs = ["interactive:ttft=300ms,itl=50ms", "standard:ttft=2s,default", "batch:ttft=30s"]
        .map(String::from);
    Classes::from_specs_and_file(&specs, None).unwrap()
}

async fn serve(mock: MockConfig, sched: SchedulerConfig, tenants: Vec<Tenant>) -> Server {
    let layout = ModelSpec::preset("smollm2-135m")
        .unwrap()
        .with_dtype(KvDtype::F32)
        .block_layout(16)
        .unwrap();
    let engine = MockEngine::new("mock", layout, mock).unwrap();
    let agent = Agent::start(AgentConfig::new("classes-test", b"secret".to_vec())).await.unwrap();
    let store = TieredStore::open(
        StoreConfig::new(layout.bytes_per_block(), 256),
        &agent,
        Arc::new(NullSink),
    )
    .await
    .unwrap();
    let sched =
        Scheduler::start(engine, store.clone(), sched, tokio::runtime::Handle::current()).unwrap();
    let classes = classes();
    let tenants = Tenants::new(tenants, &classes).unwrap();
    let cfg = ServerConfig { classes, tenants, ..ServerConfig::default() };
    let app = router(Arc::new(LocalBackend::new(sched, store)), cfg);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    Server { addr, _agent: agent }
}

/// POSTs `body` to `/v1/completions` with `headers`.
async fn complete(addr: SocketAddr, body: &Value, headers: &[(&str, &str)]) -> Response {
    let body = body.to_string();
    let extra: String = headers.iter().map(|(k, v)| format!("{k}: {v}\r\n")).collect();
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: test\r\nConnection: close\r\nContent-Type: application/json\r\n{extra}Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(req.as_bytes()).await.unwrap();
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(60), s.read_to_end(&mut buf)).await.unwrap().unwrap();
    parse_response(&buf)
}

fn prompt(text: &str, extra: Value) -> Value {
    let mut v = json!({ "model": "mock", "prompt": text, "max_tokens": 4, "temperature": 0 });
    for (k, x) in extra.as_object().unwrap() {
        v[k] = x.clone();
    }
    v
}

async fn metrics(addr: SocketAddr) -> String {
    common::get(addr, "/metrics").await.text()
}

fn answered(text: &str, class: &str) -> f64 {
    metric(text, &format!("kvfabric_class_requests_total{{class=\"{class}\",outcome=\"ok\"}}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_spelling_of_a_class_reaches_it_and_an_unknown_class_is_a_400() {
    let s = serve(MockConfig::zero_delay(), SchedulerConfig::default(), Vec::new()).await;
    type Case<'a> = (Vec<(&'a str, &'a str)>, Value, &'a str);
    let cases: Vec<Case<'_>> = vec![
        (vec![], json!({}), "standard"),
        (vec![("x-kvfabric-class", "batch")], json!({}), "batch"),
        (vec![], json!({"kvfabric": {"class": "interactive"}}), "interactive"),
        (vec![], json!({"service_tier": "priority"}), "interactive"),
        (vec![], json!({"service_tier": "flex"}), "batch"),
        (vec![], json!({"priority": -1}), "interactive"),
        (vec![], json!({"priority": 3}), "batch"),
        (vec![], json!({"nvext": {"agent_hints": {"priority": 2}}}), "interactive"),
        (vec![("x-dynamo-request-priority", "0")], json!({"priority": -1}), "standard"),
    ];
    for (headers, extra, class) in cases {
        let before = answered(&metrics(s.addr).await, class);
        let r = complete(s.addr, &prompt("hello there", extra.clone()), &headers).await;
        assert_eq!(r.status, 200, "{headers:?} {extra}: {}", r.text());
        let after = answered(&metrics(s.addr).await, class);
        assert_eq!(after, before + 1.0, "{headers:?} {extra} did not reach {class}");
    }
    let r = complete(s.addr, &prompt("hi", json!({})), &[("x-kvfabric-class", "gold")]).await;
    assert_eq!(r.status, 400, "{}", r.text());
    let e = &r.json()["error"];
    assert_eq!(e["code"], "unknown_service_class");
    assert!(e["message"].as_str().unwrap().contains("interactive, standard, batch"), "{e}");
    for bad in [
        json!({"service_tier": "turbo"}),
        json!({"priority": "high"}),
        json!({"kvfabric": {"class": 1}}),
    ] {
        let r = complete(s.addr, &prompt("hi", bad.clone()), &[]).await;
        assert_eq!(r.status, 400, "{bad}: {}", r.text());
        assert_eq!(r.json()["error"]["code"], "invalid_service_class", "{bad}");
    }
    let text = metrics(s.addr).await;
    assert!(
        text.contains("kvfabric_class_time_to_first_token_seconds_count{class=\"batch\"} 3"),
        "{text}"
    );
    assert_eq!(metric(&text, "kvfabric_class_slo_total{class=\"batch\",result=\"met\"}"), 3.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_sheds_batch_with_retry_after_and_still_takes_interactive() {
    // One batch slot held by a 2 s decode; room for one waiting request.
    let mock = MockConfig { decode_step_us: 10_000.0, ..MockConfig::zero_delay() };
    let sched = SchedulerConfig { batch_max: 1, waiting_max: 1, ..SchedulerConfig::default() };
    let s = serve(mock, sched, Vec::new()).await;
    let addr = s.addr;
    let long = json!({"max_tokens": 200, "ignore_eos": true});
    let blocker = tokio::spawn(async move {
        complete(addr, &prompt("the blocker", long), &[("x-kvfabric-class", "interactive")]).await
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let waiting = tokio::spawn(async move {
        complete(addr, &prompt("a batch job", json!({})), &[("x-kvfabric-class", "batch")]).await
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    // The queue is full of batch: another batch request is shed at once, told when to retry.
    let r =
        complete(addr, &prompt("another job", json!({})), &[("x-kvfabric-class", "batch")]).await;
    assert_eq!(r.status, 429, "{}", r.text());
    let after: u64 = r.header("retry-after").expect("Retry-After").parse().unwrap();
    assert!(after >= 1, "{after}");
    // An interactive request takes the waiting batch request's place; that one is shed.
    let r =
        complete(addr, &prompt("a chat turn", json!({})), &[("x-kvfabric-class", "interactive")])
            .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let w = waiting.await.unwrap();
    assert_eq!(w.status, 429, "{}", w.text());
    assert!(w.header("retry-after").is_some());
    assert_eq!(blocker.await.unwrap().status, 200);
    let text = metrics(addr).await;
    let shed = "kvfabric_class_requests_total{class=\"batch\",outcome=\"shed\"}";
    assert_eq!(metric(&text, shed), 2.0, "{text}");
    assert_eq!(metric(&text, "kvfabric_class_slo_total{class=\"batch\",result=\"missed\"}"), 2.0);
}

fn cached(r: &Response) -> u64 {
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_key_pins_its_classes_and_its_cache_is_its_own() {
    let tenant = |name: &str, key: &str, classes: &[&str], ns: Option<&str>| Tenant {
        name: name.into(),
        key: key.into(),
        classes: (!classes.is_empty()).then(|| classes.iter().map(|c| c.to_string()).collect()),
        cache_namespace: ns.map(str::to_string),
        store_blocks: None,
        host_blocks: None,
        disk_blocks: None,
    };
    let tenants = vec![
        tenant("acme", "acme-key-0001", &["batch", "standard"], None),
        tenant("beta", "beta-key-0001", &[], None),
        tenant("beta-two", "beta-key-0002", &[], Some("beta")),
        Tenant { store_blocks: Some(8), ..tenant("small", "small-key-001", &[], None) },
    ];
    let s = serve(MockConfig::zero_delay(), SchedulerConfig::default(), tenants).await;
    let auth = |k: &'static str| {
        ("authorization", Box::leak(format!("Bearer {k}").into_boxed_str()) as &str)
    };
    let text = "a long shared document ".repeat(20);
    // No key, or a wrong one: 401.
    assert_eq!(complete(s.addr, &prompt(&text, json!({})), &[]).await.status, 401);
    assert_eq!(
        complete(s.addr, &prompt(&text, json!({})), &[auth("nope-nope-nope")]).await.status,
        401
    );
    // acme may not ask for interactive; it names nothing and gets its first class, batch.
    let r = complete(
        s.addr,
        &prompt(&text, json!({})),
        &[auth("acme-key-0001"), ("x-kvfabric-class", "interactive")],
    )
    .await;
    assert_eq!(r.status, 403, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "service_class_not_allowed");
    let before = answered(&metrics(s.addr).await, "batch");
    assert_eq!(
        cached(&complete(s.addr, &prompt(&text, json!({})), &[auth("acme-key-0001")]).await),
        0
    );
    assert_eq!(answered(&metrics(s.addr).await, "batch"), before + 1.0);
    // beta sends the same prompt: nothing cached for it; acme again: its own blocks.
    assert_eq!(
        cached(&complete(s.addr, &prompt(&text, json!({})), &[auth("beta-key-0001")]).await),
        0
    );
    let hit = cached(&complete(s.addr, &prompt(&text, json!({})), &[auth("acme-key-0001")]).await);
    assert!(hit >= 400, "acme reads its own prompt back: {hit}");
    // beta-two shares beta's namespace (opted in): beta's prompt is a hit for it.
    let shared =
        cached(&complete(s.addr, &prompt(&text, json!({})), &[auth("beta-key-0002")]).await);
    assert_eq!(shared, hit);
    // The scheme is matched without regard to case (RFC 9110), spaces around the key too.
    for scheme in ["bearer", "BEARER  "] {
        let h = format!("{scheme} acme-key-0001");
        let h = ("authorization", Box::leak(h.into_boxed_str()) as &str);
        assert_eq!(cached(&complete(s.addr, &prompt(&text, json!({})), &[h]).await), hit);
    }
    // A client's cache_salt namespaces within a tenant too.
    let salted = prompt(&text, json!({"cache_salt": "s1"}));
    assert_eq!(cached(&complete(s.addr, &salted, &[auth("acme-key-0001")]).await), 0);
    assert_eq!(cached(&complete(s.addr, &salted, &[auth("acme-key-0001")]).await), hit);
    let r =
        complete(s.addr, &prompt(&text, json!({"cache_salt": 7})), &[auth("acme-key-0001")]).await;
    assert_eq!(r.status, 400);
    // "small" may hold 8 blocks of the store: its second long prompt pushes its first out
    // (counted), not acme's.
    let other = "another long document entirely ".repeat(20);
    assert_eq!(
        cached(&complete(s.addr, &prompt(&text, json!({})), &[auth("small-key-001")]).await),
        0
    );
    assert_eq!(
        cached(&complete(s.addr, &prompt(&other, json!({})), &[auth("small-key-001")]).await),
        0
    );
    let removed = || async {
        let m = metrics(s.addr).await;
        m.lines()
            .find_map(|l| l.strip_prefix("kvfabric_engine_tenant_quota_removed_blocks_total "))
            .map_or(0.0, |v| v.trim().parse::<f64>().unwrap())
    };
    let start = std::time::Instant::now();
    while removed().await < 8.0 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "no quota removals: {}",
            removed().await
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        cached(&complete(s.addr, &prompt(&text, json!({})), &[auth("small-key-001")]).await),
        0
    );
    let acme = cached(&complete(s.addr, &prompt(&text, json!({})), &[auth("acme-key-0001")]).await);
    assert_eq!(acme, hit, "acme's blocks stayed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_salt_keeps_clients_apart_without_tenants() {
    let s = serve(MockConfig::zero_delay(), SchedulerConfig::default(), Vec::new()).await;
    let text = "the same system prompt for everyone ".repeat(16);
    let with = |salt: Option<&str>| match salt {
        Some(x) => prompt(&text, json!({ "cache_salt": x })),
        None => prompt(&text, json!({})),
    };
    assert_eq!(cached(&complete(s.addr, &with(Some("alice")), &[]).await), 0);
    assert_eq!(cached(&complete(s.addr, &with(Some("bob")), &[]).await), 0);
    assert_eq!(cached(&complete(s.addr, &with(None), &[]).await), 0);
    assert!(cached(&complete(s.addr, &with(Some("alice")), &[]).await) >= 400);
}
