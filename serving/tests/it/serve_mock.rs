//! The OpenAI-compatible frontend over the mock engine, in process, over real sockets:
//! response shapes (streaming and not), errors and their status codes, a client hanging up
//! mid-stream, overload and deadlines, prefix reuse from host and disk blocks, batching.
//!
//! The mock engine checks every imported block against the chain of blocks before it and
//! derives each token from all tokens before it, so equal outputs with and without cached
//! blocks prove that the store returned exactly the bytes that were stored. What the mock
//! cannot prove: anything about real model numerics (`serve_llama.rs` covers those).
//!
//! Over 1,000 lines because it is the API's contract test: one module per concern would each
//! need the same server, mock engine and client set up; each test stands alone.

use crate::common;

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::{get, metric, metric_sum, post, post_json, streamed_text};
use kvfabric::agent::{Agent, AgentConfig};
use kvfabric::events::NullSink;
use kvfabric::layout::{KvDtype, ModelSpec};
use kvfabric_serving::backend::LocalBackend;
use kvfabric_serving::engine::mock::{MockConfig, MockEngine};
use kvfabric_serving::engine::{Scheduler, SchedulerConfig};
use kvfabric_serving::http::{router, ServerConfig};
use kvfabric_tiers::disk::DiskConfig;
use kvfabric_tiers::{StoreConfig, TieredStore};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

struct Server {
    addr: SocketAddr,
    sched: Scheduler,
    listen: kvfabric_serving::metrics::ListenStats,
    _dir: tempfile::TempDir,
    _agent: Agent,
}

struct Opts {
    mock: MockConfig,
    sched: SchedulerConfig,
    host_blocks: u32,
    disk_blocks: u32,
    server: ServerConfig,
    /// Serve through kvfabric's bounded listener with these limits (None: plain axum).
    listen: Option<kvfabric_serving::http::listen::HttpLimits>,
}

impl Default for Opts {
    fn default() -> Self {
        Opts {
            mock: MockConfig {
                decode_step_us: 1000.0,
                prefill_us_per_token: 5.0,
                ..MockConfig::default()
            },
            sched: SchedulerConfig::default(),
            host_blocks: 64,
            disk_blocks: 0,
            server: ServerConfig::default(),
            listen: None,
        }
    }
}

async fn serve(o: Opts) -> Server {
    let layout = ModelSpec::preset("smollm2-135m")
        .unwrap()
        .with_dtype(KvDtype::F32)
        .block_layout(16)
        .unwrap();
    let engine = MockEngine::new("mock", layout, o.mock).unwrap();
    let agent = Agent::start(AgentConfig::new("serve-test", b"secret".to_vec())).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = StoreConfig::new(layout.bytes_per_block(), o.host_blocks);
    cfg.disk_admit_min_hits = 0;
    if o.disk_blocks > 0 {
        cfg.disk = Some(DiskConfig::new(dir.path().join("kv.slots"), o.disk_blocks));
    }
    let store = TieredStore::open(cfg, &agent, std::sync::Arc::new(NullSink)).await.unwrap();
    let sched = Scheduler::start(engine, store.clone(), o.sched, tokio::runtime::Handle::current())
        .unwrap();
    let stats = o.server.listen.clone();
    let app = router(std::sync::Arc::new(LocalBackend::new(sched.clone(), store)), o.server);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    match o.listen {
        Some(limits) => {
            let forever = std::future::pending::<()>();
            let serving = kvfabric_serving::http::listen::serve(
                listener,
                app,
                limits,
                stats.clone(),
                None,
                forever,
            );
            tokio::spawn(serving);
        }
        None => {
            tokio::spawn(async move { axum::serve(listener, app).await });
        }
    }
    Server { addr, sched, listen: stats, _dir: dir, _agent: agent }
}

impl Server {
    /// Connections open on the bounded listener.
    fn listen_open(&self) -> i64 {
        self.listen.open.get()
    }
}

fn chat(content: &str, extra: serde_json::Value) -> serde_json::Value {
    let mut v = json!({
        "model": "mock", "messages": [{"role": "user", "content": content}],
        "temperature": 0, "max_tokens": 12,
    });
    for (k, x) in extra.as_object().unwrap() {
        v[k] = x.clone();
    }
    v
}

async fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < Duration::from_secs(10), "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_health_and_response_shapes() {
    let s = serve(Opts::default()).await;
    let m = get(s.addr, "/v1/models").await.json();
    assert_eq!(m["object"], "list");
    assert_eq!(m["data"][0]["id"], "mock");
    assert_eq!(get(s.addr, "/v1/models/mock").await.status, 200);
    // The health document, typed: the engine's, the store's and the transfers' parts.
    let h: kvfabric::health::Health =
        serde_json::from_value(get(s.addr, "/health").await.json()).unwrap();
    assert_eq!(h.status, kvfabric::health::Status::Ok, "{h:?}");
    assert_eq!(h.model.as_deref(), Some("mock"));
    assert_eq!(h.engine.as_ref().map(|e| e.failure.is_none()), Some(true), "{h:?}");
    assert_eq!(h.store, Some(Default::default()), "nothing wrong with the store");
    // Failed transfers are counted, and whether this process can use a GPU is said, with
    // the reason when it cannot (on a machine with a GPU and driver: its devices).
    let t = h.transfer.expect("the transfer part");
    assert_eq!(t.failed, 0);
    match t.cuda.available {
        true => assert!(!t.cuda.devices.is_empty(), "{:?}", t.cuda),
        false => assert!(t.cuda.reason.as_deref().unwrap().contains("CUDA"), "{:?}", t.cuda),
    }
    // So is RDMA: the device in use, or why there is none (then transfers between hosts
    // use TCP).
    match &t.rdma {
        kvfabric::endpoint::RdmaStatus::Device { device, .. } => assert!(!device.is_empty()),
        kvfabric::endpoint::RdmaStatus::Unavailable { reason } => assert!(!reason.is_empty()),
        other => panic!("rdma in /health is {other:?}"),
    }

    let whole = post_json(s.addr, "/v1/chat/completions", &chat("Hello there", json!({}))).await;
    assert_eq!(whole.status, 200, "{}", whole.text());
    let w = whole.json();
    assert_eq!(w["object"], "chat.completion");
    assert_eq!(w["choices"][0]["message"]["role"], "assistant");
    assert_eq!(w["choices"][0]["finish_reason"], "length");
    let text = w["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    assert_eq!(text.len(), 12, "one byte per mock token: {text:?}");
    assert_eq!(w["usage"]["completion_tokens"], 12);
    let prompt_tokens = w["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(prompt_tokens > 11, "the chat template wraps the message");

    // Streaming: a role chunk, content chunks, a finish chunk, the usage chunk, [DONE].
    let streamed = post_json(
        s.addr,
        "/v1/chat/completions",
        &chat("Hello there", json!({"stream": true, "stream_options": {"include_usage": true}})),
    )
    .await;
    assert_eq!(streamed.status, 200);
    assert!(streamed.header("content-type").unwrap().starts_with("text/event-stream"));
    let data = streamed.sse();
    assert_eq!(data.last().unwrap(), "[DONE]");
    let (stext, chunks) = streamed_text(&streamed);
    assert_eq!(stext, text, "streamed and whole greedy outputs differ");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(chunks.iter().all(|c| c["object"] == "chat.completion.chunk"));
    let finish = &chunks[chunks.len() - 2];
    assert_eq!(finish["choices"][0]["finish_reason"], "length");
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"].as_array().unwrap().len(), 0);
    assert_eq!(usage["usage"]["completion_tokens"], 12);
    assert_eq!(usage["usage"]["prompt_tokens"], prompt_tokens);

    // Completions, whole and streamed, and a stop string cutting the text.
    let body =
        json!({"model": "mock", "prompt": "Once upon a time", "max_tokens": 20, "temperature": 0});
    let c = post_json(s.addr, "/v1/completions", &body).await.json();
    assert_eq!(c["object"], "text_completion");
    let ctext = c["choices"][0]["text"].as_str().unwrap().to_string();
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let (cstream, _) = streamed_text(&post_json(s.addr, "/v1/completions", &sbody).await);
    assert_eq!(cstream, ctext);
    let stop = &ctext[8..10];
    let first = ctext.find(stop).unwrap();
    let mut stopped = body.clone();
    stopped["stop"] = json!([stop]);
    let c = post_json(s.addr, "/v1/completions", &stopped).await.json();
    assert_eq!(c["choices"][0]["text"], &ctext[..first]);
    assert_eq!(c["choices"][0]["finish_reason"], "stop");
    // Token-id prompts are accepted as they are.
    let ids = post_json(
        s.addr,
        "/v1/completions",
        &json!({"model": "mock", "prompt": [79, 110, 99, 101], "max_tokens": 3, "temperature": 0}),
    )
    .await;
    assert_eq!(ids.json()["usage"]["prompt_tokens"], 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_openai_errors_with_the_right_status() {
    let s = serve(Opts {
        mock: MockConfig { context_len: 256, ..MockConfig::zero_delay() },
        server: ServerConfig {
            body: kvfabric_serving::http::BodyLimits { bytes_max: 64 << 10, ..Default::default() },
            ..ServerConfig::default()
        },
        ..Opts::default()
    })
    .await;
    let cases: Vec<(&str, String, u16, Option<&str>)> = vec![
        ("/v1/chat/completions", "{\"model\": \"mock\", \"messages\": [".into(), 400, None),
        ("/v1/chat/completions", "[1, 2]".into(), 400, None),
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "x"}]}).to_string(), 400, None),
        ("/v1/chat/completions", chat("x", json!({"model": "gpt-9"})).to_string(), 404, Some("model_not_found")),
        ("/v1/chat/completions", chat("x", json!({"n": 2})).to_string(), 400, None),
        ("/v1/chat/completions", chat("x", json!({"temperature": 2.5})).to_string(), 400, None),
        ("/v1/chat/completions", chat("x", json!({"top_p": 0})).to_string(), 400, None),
        ("/v1/chat/completions", chat("x", json!({"max_tokens": 0})).to_string(), 400, None),
        ("/v1/chat/completions", chat("x", json!({"max_tokens": "many"})).to_string(), 400, None),
        ("/v1/chat/completions", chat("x", json!({"stop": ["a", "b", "c", "d", "e"]})).to_string(), 400, None),
        ("/v1/chat/completions", chat("x", json!({"logprobs": true})).to_string(), 400, None),
        ("/v1/chat/completions", json!({"model": "mock", "messages": []}).to_string(), 400, None),
        ("/v1/chat/completions", json!({"model": "mock", "messages": [{"role": "wizard", "content": "x"}]}).to_string(), 400, None),
        ("/v1/chat/completions", json!({"model": "mock", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}).to_string(), 400, None),
        ("/v1/chat/completions", chat(&"long ".repeat(100), json!({})).to_string(), 400, Some("context_length_exceeded")),
        ("/v1/chat/completions", chat("x", json!({"max_tokens": 1000})).to_string(), 400, Some("context_length_exceeded")),
        ("/v1/completions", json!({"model": "mock", "max_tokens": 2}).to_string(), 400, None),
        ("/v1/completions", json!({"model": "mock", "prompt": ""}).to_string(), 400, None),
        ("/v1/completions", json!({"model": "mock", "prompt": [1, 999999]}).to_string(), 400, None),
        ("/v1/completions", json!({"model": "mock", "prompt": ["a", "b"]}).to_string(), 400, None),
        ("/v1/completions", json!({"model": "mock", "prompt": "x".repeat(70 << 10)}).to_string(), 413, None),
        // The routing decision validates as generation does.
        ("/v1/route", json!({"model": "mock", "prompt": ""}).to_string(), 400, None),
        ("/v1/route", json!({"model": "mock", "prompt": []}).to_string(), 400, None),
        ("/v1/route", json!({"model": "mock", "prompt": [1, 999999]}).to_string(), 400, None),
        ("/v1/route", json!({"model": "mock", "prompt": "long ".repeat(100)}).to_string(), 400, Some("context_length_exceeded")),
        ("/v1/route", json!({"model": "mock", "prompt": "x", "track": "yes"}).to_string(), 400, None),
        ("/v1/route", json!({"model": "mock", "prompt": "x", "track": 1}).to_string(), 400, None),
        ("/v1/route", "{\"model\": \"mock\", \"prompt\": ".into(), 400, None),
        ("/v1/route", json!({"model": "gpt-9", "prompt": "x"}).to_string(), 404, Some("model_not_found")),
    ];
    for (path, body, status, code) in cases {
        let r = post(s.addr, path, &body).await;
        let shown: String = body.chars().take(80).collect();
        assert_eq!(r.status, status, "{shown}: {}", r.text());
        let e = r.json();
        let err = &e["error"];
        assert!(err["message"].as_str().is_some_and(|m| !m.is_empty()), "{shown}: {e}");
        assert!(err["type"].is_string(), "{shown}: {e}");
        if let Some(code) = code {
            assert_eq!(err["code"], code, "{shown}");
        }
    }
    let ok = post(
        s.addr,
        "/v1/route",
        &json!({"model": "mock", "prompt": "x", "track": false}).to_string(),
    )
    .await;
    assert_eq!(ok.status, 200, "{}", ok.text());
    // Small points: a text part without text says so; a lone surrogate is named; a body
    // that is not JSON by its Content-Type is refused with 415; a seed of -1 is fine.
    let no_text =
        json!({"model": "mock", "messages": [{"role": "user", "content": [{"type": "text"}]}]});
    let r = post(s.addr, "/v1/chat/completions", &no_text.to_string()).await;
    assert_eq!(r.status, 400);
    assert!(
        r.json()["error"]["message"].as_str().unwrap().contains("needs a \"text\""),
        "{}",
        r.text()
    );
    // A class field that is not an object, stream options that are not one: 400, not
    // ignored. A token id that is not one is named with its position.
    for (path, body, says) in [
        ("/v1/chat/completions", chat("x", json!({"kvfabric": "interactive"})), "kvfabric"),
        ("/v1/chat/completions", chat("x", json!({"nvext": [1]})), "nvext"),
        ("/v1/chat/completions", chat("x", json!({"stream_options": []})), "stream_options"),
        (
            "/v1/chat/completions",
            chat("x", json!({"stream": true, "stream_options": {"include_usage": "yes"}})),
            "include_usage",
        ),
        ("/v1/completions", json!({"model": "mock", "prompt": [1, -5]}), "prompt[1] is -5"),
        ("/v1/completions", json!({"model": "mock", "prompt": [7, 2.5]}), "prompt[1] is 2.5"),
        ("/v1/completions", json!({"model": "mock", "prompt": [[1], [2, -1]]}), "prompt[1][1]"),
        ("/v1/completions", json!({"model": "mock", "prompt": ["a", 3]}), "prompt[1] is 3"),
        ("/v1/route", json!({"model": "mock", "prompt": [1, 4294967296u64]}), "prompt[1]"),
    ] {
        let r = post(s.addr, path, &body.to_string()).await;
        let m = r.json()["error"]["message"].as_str().unwrap_or_default().to_string();
        assert_eq!(r.status, 400, "{body}: {m}");
        assert!(m.contains(says), "{body}: {m}");
    }
    let lone = r#"{"model": "mock", "messages": [{"role": "user", "content": "\ud800"}]}"#;
    let r = post(s.addr, "/v1/chat/completions", lone).await;
    let m = r.json()["error"]["message"].as_str().unwrap().to_string();
    assert_eq!(r.status, 400, "{m}");
    assert!(m.contains("invalid JSON") && m.contains("surrogate"), "{m}");
    let form = "POST /v1/completions HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\
                Content-Type: application/x-www-form-urlencoded\r\nContent-Length: 3\r\n\r\na=b";
    let r = common::raw(s.addr, form.as_bytes()).await;
    assert_eq!(r.status, 415, "{}", r.text());
    let r = post(s.addr, "/v1/chat/completions", &chat("x", json!({"seed": -1})).to_string()).await;
    assert_eq!(r.status, 200, "{}", r.text());

    let r = get(s.addr, "/v1/nope").await;
    assert_eq!((r.status, r.json()["error"]["type"].as_str()), (404, Some("not_found")));
    assert_eq!(get(s.addr, "/v1/chat/completions").await.status, 405);
    assert_eq!(get(s.addr, "/v1/models/gpt-9").await.status, 404);
    // Every refusal is counted; only the request with seed -1 reached the engine.
    let m = get(s.addr, "/metrics").await.text();
    assert!(metric(&m, "kvfabric_requests_total{outcome=\"client_error\"}") >= 20.0);
    assert_eq!(metric(&m, "kvfabric_requests_total{outcome=\"ok\"}"), 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_hangs_up_mid_stream_cancels_its_generation() {
    let s = serve(Opts {
        mock: MockConfig { decode_step_us: 5_000.0, ..MockConfig::zero_delay() },
        ..Opts::default()
    })
    .await;
    // The same conversation once, answered: its blocks are stored for the next.
    let content = "tell me everything you know about caches, ".repeat(12);
    let r =
        post_json(s.addr, "/v1/chat/completions", &chat(&content, json!({"max_tokens": 1}))).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let prompt = r.json()["usage"]["prompt_tokens"].as_u64().unwrap() as f64;
    let body = chat(&content, json!({"stream": true, "max_tokens": 4000})).to_string();
    let mut conn = tokio::net::TcpStream::connect(s.addr).await.unwrap();
    conn.write_all(&common::request_bytes("POST", "/v1/chat/completions", Some(&body)))
        .await
        .unwrap();
    let mut buf = vec![0u8; 4096];
    let mut seen = Vec::new();
    while !String::from_utf8_lossy(&seen).contains("\"content\":\"") || seen.len() < 600 {
        let n = conn.read(&mut buf).await.unwrap();
        assert!(n > 0, "stream ended early");
        seen.extend_from_slice(&buf[..n]);
    }
    assert_eq!(s.sched.stats().running.load(Ordering::Relaxed), 1);
    drop(conn);
    let stats = s.sched.stats();
    wait_until("the engine to drop the sequence", || stats.running.load(Ordering::Relaxed) == 0)
        .await;
    assert_eq!(stats.cancelled.load(Ordering::Relaxed), 1);
    assert!(stats.generated_tokens.load(Ordering::Relaxed) < 4000);
    let m = get(s.addr, "/metrics").await.text();
    assert_eq!(metric(&m, "kvfabric_requests_total{outcome=\"cancelled\"}"), 1.0);
    // Its tokens count like any other request's: prompt tokens and tokens from cache are over
    // the same two requests, and the dashboard shows what /metrics says.
    assert_eq!(metric(&m, "kvfabric_prompt_tokens_total"), 2.0 * prompt);
    let cached = metric_sum(&m, "kvfabric_cached_prompt_tokens_total");
    assert!(cached >= 16.0 && cached < prompt, "the cancelled request reused the blocks: {m}");
    let page = get(s.addr, "/dashboard/state").await.json();
    assert_eq!(page["requests"]["prompt_tokens"].as_f64(), Some(2.0 * prompt), "{page}");
    assert_eq!(page["requests"]["cached_prompt_tokens"].as_f64(), Some(cached), "{page}");
    for (i, tier) in ["device", "host", "disk", "remote"].iter().enumerate() {
        let sample = format!("kvfabric_cached_prompt_tokens_total{{tier=\"{tier}\"}}");
        assert_eq!(page["tiers"][i]["hit_tokens"].as_f64(), Some(metric(&m, &sample)), "{page}");
    }
    // The engine still serves.
    let r = post_json(s.addr, "/v1/chat/completions", &chat("again", json!({}))).await;
    assert_eq!(r.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_answers_429_and_a_late_request_504() {
    let s = serve(Opts {
        mock: MockConfig { decode_step_us: 20_000.0, ..MockConfig::zero_delay() },
        sched: SchedulerConfig { batch_max: 1, waiting_max: 1, ..SchedulerConfig::default() },
        server: ServerConfig {
            request_timeout: Duration::from_millis(1500),
            ..ServerConfig::default()
        },
        ..Opts::default()
    })
    .await;
    let addr = s.addr;
    let long = chat("first", json!({"max_tokens": 1000}));
    let running = tokio::spawn(async move { post_json(addr, "/v1/chat/completions", &long).await });
    let stats = s.sched.stats();
    wait_until("the first request to run", || stats.running.load(Ordering::Relaxed) == 1).await;
    let waiting = chat("second", json!({"max_tokens": 5}));
    let queued =
        tokio::spawn(async move { post_json(addr, "/v1/chat/completions", &waiting).await });
    wait_until("the second request to wait", || stats.waiting.load(Ordering::Relaxed) == 1).await;
    let r = post_json(addr, "/v1/chat/completions", &chat("third", json!({}))).await;
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "rate_limit_exceeded");
    // 1000 tokens at 20 ms each cannot finish within the 1.5 s deadline.
    let started = Instant::now();
    let r = running.await.unwrap();
    assert_eq!(r.status, 504, "{}", r.text());
    assert!(started.elapsed() < Duration::from_secs(5));
    // The queued one then runs and completes.
    let q = queued.await.unwrap();
    assert!(q.status == 200 || q.status == 504, "{}", q.text());
    wait_until("the engine to go idle", || stats.running.load(Ordering::Relaxed) == 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_prompt_reuses_blocks_from_host_and_from_disk() {
    let s = serve(Opts {
        mock: MockConfig::zero_delay(),
        host_blocks: 4,
        disk_blocks: 128,
        ..Opts::default()
    })
    .await;
    // About 150 tokens: 9 full blocks of 16, more than the host tier holds.
    let prompt = "The quick brown fox jumps over the lazy dog. ".repeat(3);
    let body = json!({"model": "mock", "prompt": prompt, "max_tokens": 24, "temperature": 0});
    let cold = post_json(s.addr, "/v1/completions", &body).await.json();
    assert_eq!(cold["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let warm = post_json(s.addr, "/v1/completions", &body).await.json();
    assert_eq!(warm["choices"][0]["text"], cold["choices"][0]["text"]);
    let cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    let prompt_tokens = warm["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(cached, (prompt_tokens - 1) / 16 * 16, "every full prompt block but a last token's");
    let m = get(s.addr, "/metrics").await.text();
    assert!(metric(&m, "kvfabric_kv_hit_tokens_total{tier=\"disk\"}") > 0.0, "{m}");
    assert!(metric(&m, "kvfabric_kv_onboard_bytes_total") > 0.0);
    assert_eq!(metric_sum(&m, "kvfabric_cached_prompt_tokens_total"), cached as f64);
    let from =
        |t: &str| metric(&m, &format!("kvfabric_cached_prompt_tokens_total{{tier=\"{t}\"}}"));
    assert!(from("disk") > 0.0 && from("host") + from("disk") == cached as f64, "{m}");
    // A different prompt sharing the first blocks reuses just those.
    let mut other = body.clone();
    other["prompt"] =
        json!(format!("{}{}", &prompt[..70], "and then something else entirely happens here"));
    let o = post_json(s.addr, "/v1/completions", &other).await.json();
    let c = o["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    assert_eq!(c, 64, "70 shared bytes are 4 full blocks");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_share_steps_and_each_gets_its_own_answer() {
    let s = serve(Opts {
        mock: MockConfig { decode_step_us: 2_000.0, ..MockConfig::zero_delay() },
        ..Opts::default()
    })
    .await;
    let prompts: Vec<String> = (0..8).map(|i| format!("question number {i}")).collect();
    let mut solo = Vec::new();
    for p in &prompts {
        solo.push(
            post_json(s.addr, "/v1/chat/completions", &chat(p, json!({"max_tokens": 30})))
                .await
                .json(),
        );
    }
    let steps_before = s.sched.stats().steps.load(Ordering::Relaxed);
    let tasks: Vec<_> = prompts
        .iter()
        .map(|p| {
            let (addr, body) = (s.addr, chat(p, json!({"max_tokens": 30})));
            tokio::spawn(async move { post_json(addr, "/v1/chat/completions", &body).await.json() })
        })
        .collect();
    for (t, solo) in tasks.into_iter().zip(&solo) {
        let r = t.await.unwrap();
        assert_eq!(r["choices"][0]["message"]["content"], solo["choices"][0]["message"]["content"]);
    }
    let steps = s.sched.stats().steps.load(Ordering::Relaxed) - steps_before;
    // 8 × 30 tokens one by one would take 240 steps.
    assert!(steps < 120, "{steps} steps for 8 concurrent requests: not batched");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_transport_authenticates_refuses_hostile_frames_and_cancels_on_hang_up() {
    use kvfabric::session::admission::Cause;
    use kvfabric::session::handshake;
    use kvfabric::session::proto::ClientParams;
    use kvfabric::wire::WireLimits;
    use kvfabric_serving::engine::{GenEvent, GenerateRequest, SamplingParams};
    use kvfabric_serving::protocol::{
        self, read_frame, Auth, ServeLimits, ServeStats, WorkerRequest,
    };
    let s = serve(Opts {
        mock: MockConfig { decode_step_us: 5_000.0, ..MockConfig::zero_delay() },
        ..Opts::default()
    })
    .await;
    let store = {
        // The worker serves the same scheduler through its own backend.
        let agent = Agent::start(AgentConfig::new("wt", b"s".to_vec())).await.unwrap();
        let st = TieredStore::open(
            StoreConfig::new(s.sched.info().layout.bytes_per_block(), 8),
            &agent,
            std::sync::Arc::new(NullSink),
        )
        .await
        .unwrap();
        (agent, st)
    };
    let backend = std::sync::Arc::new(LocalBackend::new(s.sched.clone(), store.1.clone()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let auth = Auth { name: "w".into(), secret: b"worker-secret".into(), tls: None };
    let mut limits = ServeLimits::default();
    limits.connections.per_peer_max = 4;
    let stats = std::sync::Arc::new(ServeStats::default());
    let _server = protocol::serve(listener, backend, auth.clone(), limits, stats.clone());

    /// An authenticated connection as `me`.
    async fn authed(addr: SocketAddr, me: &str) -> tokio::net::TcpStream {
        let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
        let params = ClientParams {
            me: me.into(),
            peer: "w".into(),
            secret: b"worker-secret".into(),
            limits: WireLimits::default(),
        };
        handshake::client(&mut c, params, handshake::nonce(), Duration::from_secs(5))
            .await
            .unwrap();
        c
    }
    async fn answer(addr: SocketAddr, bytes: &[u8]) -> Option<GenEvent> {
        let mut c = authed(addr, "fuzzer").await;
        c.write_all(bytes).await.unwrap();
        tokio::time::timeout(Duration::from_secs(15), read_frame::<_, GenEvent>(&mut c))
            .await
            .unwrap()
            .unwrap()
    }
    // A frame's header: its body's length, then the protocol version.
    let head = |len: u32, version: u8| {
        let mut h = len.to_le_bytes().to_vec();
        h.push(version);
        h
    };
    // A length far over the limit, then a frame of garbage: each gets an error, no panic.
    let e = answer(addr, &head(u32::MAX, protocol::PROTOCOL)).await;
    assert!(matches!(e, Some(GenEvent::Error(_))), "{e:?}");
    let mut garbage = head(9, protocol::PROTOCOL);
    garbage.extend_from_slice(b"not json!");
    assert!(matches!(answer(addr, &garbage).await, Some(GenEvent::Error(_))));
    // Valid JSON of the wrong shape, and a model the worker does not serve.
    let mut wrong = head(2, protocol::PROTOCOL);
    wrong.extend_from_slice(b"{}");
    assert!(matches!(answer(addr, &wrong).await, Some(GenEvent::Error(_))));
    // A frontend of another protocol version is told so, in words: the unversioned frames of
    // version 1 (length, then JSON), and a version this build does not know.
    let mut v1 = serde_json::to_vec(&serde_json::json!({"model": "mock"})).unwrap();
    v1.splice(0..0, (v1.len() as u32).to_le_bytes());
    let e = answer(addr, &v1).await;
    assert!(
        matches!(&e, Some(GenEvent::Error(err)) if err.to_string().contains(&format!(
            "the peer speaks worker protocol 1 (unversioned frames), this build speaks {}",
            protocol::PROTOCOL
        ))),
        "{e:?}"
    );
    let mut next = head(2, protocol::PROTOCOL + 1);
    next.extend_from_slice(b"{}");
    let e = answer(addr, &next).await;
    assert!(
        matches!(&e, Some(GenEvent::Error(err))
            if err.to_string().contains(&format!("worker protocol {}", protocol::PROTOCOL + 1))),
        "{e:?}"
    );
    let req = |model: &str, max_tokens| WorkerRequest {
        model: model.into(),
        request: GenerateRequest {
            prompt: vec![104, 105],
            max_tokens,
            sampling: SamplingParams::default(),
            stop: vec![],
            ignore_eos: false,
            timeout: Duration::from_secs(30),
            class: None,
            cache_salt: None,
            tenant: None,
            pull: None,
        },
    };
    let connect = |r: WorkerRequest| {
        let auth = auth.clone();
        async move { protocol::connect(addr, "w", &auth, &r, Duration::from_secs(1)).await }
    };
    let mut c = connect(req("gpt-9", 4)).await.unwrap();
    let e: Option<GenEvent> = read_frame(&mut c).await.unwrap();
    assert!(matches!(e, Some(GenEvent::Error(_))), "{e:?}");
    // A deadline past the clock's range is refused, and the engine keeps serving.
    let mut huge = req("mock", 4);
    huge.request.timeout = Duration::from_secs(u64::MAX);
    let mut c = connect(huge).await.unwrap();
    let e: Option<GenEvent> = read_frame(&mut c).await.unwrap();
    assert!(
        matches!(&e, Some(GenEvent::Error(err)) if err.to_string().contains("timeout")),
        "{e:?}"
    );

    // No secret, no frames: a client that skips the handshake, or proves another secret, is
    // cut off before its request is read (and the worker serves on, below).
    let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut frame = serde_json::to_vec(&req("mock", 4)).unwrap();
    frame.splice(0..0, head(frame.len() as u32, protocol::PROTOCOL));
    let _ = c.write_all(&frame).await;
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), c.read_to_end(&mut rest)).await.unwrap();
    assert!(read_frame::<_, GenEvent>(&mut &rest[..]).await.is_err(), "no event frame");
    let wrong = Auth { name: "f".into(), secret: b"guess".into(), tls: None };
    let err = protocol::connect(addr, "w", &wrong, &req("mock", 4), Duration::from_secs(5))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("authentication"), "{err}");
    // The wrong worker name is refused by the client itself.
    let err = protocol::connect(addr, "w2", &auth, &req("mock", 4), Duration::from_secs(5))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("expected \"w2\""), "{err}");
    // The raw frame, the wrong secret, and the client that left on the wrong name.
    let failed = || stats.port.snapshot().count(Cause::Handshake);
    wait_until("three failed handshakes", || failed() == 3).await;

    // One peer holds at most 4 connections; others are not affected.
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(authed(addr, "greedy").await);
    }
    let mut fifth = authed(addr, "greedy").await;
    let mut buf = [0u8; 1];
    let n = tokio::time::timeout(Duration::from_secs(5), fifth.read(&mut buf)).await.unwrap();
    assert!(matches!(n, Ok(0) | Err(_)), "the fifth connection is closed");
    assert_eq!(stats.port.snapshot().count(Cause::Peer), 1);
    drop(held);
    // A silent peer is dropped after the request timeout (10 s) with an error; we don't wait
    // for it here. A valid request streams its number, started, tokens, done.
    // The connection stays open after `done` and carries the next request.
    let mut c = connect(req("mock", 4)).await.unwrap();
    let mut numbers = Vec::new();
    for round in 0..2 {
        if round == 1 {
            protocol::write_frame(&mut c, &req("mock", 4)).await.unwrap();
        }
        let mut kinds = Vec::new();
        while let Some(ev) = read_frame::<_, GenEvent>(&mut c).await.unwrap() {
            let kind = match ev {
                GenEvent::Accepted { seq } => {
                    numbers.push(seq);
                    "accepted"
                }
                GenEvent::Started { .. } => "started",
                GenEvent::Token { .. } => "token",
                GenEvent::Done { .. } => "done",
                GenEvent::Cached(_) => "cached",
                GenEvent::Error(_) => "error",
            };
            kinds.push(kind);
            if kind == "done" {
                break;
            }
        }
        assert_eq!(
            kinds,
            ["accepted", "started", "token", "token", "token", "token", "done"],
            "{round}"
        );
    }
    // Numbered as the engine accepted them, and counted in the scheduler's own tally.
    assert_eq!(numbers[1], numbers[0] + 1, "{numbers:?}");
    assert_eq!(s.sched.stats().accepted.load(Ordering::Relaxed), numbers[1]);
    // The port counts the request out just after it writes `done`: a kept connection is not
    // in flight.
    wait_until("the kept connection to leave flight", || {
        stats.in_flight.load(Ordering::Relaxed) == 0
    })
    .await;
    drop(c);
    // Hanging up mid-generation cancels it.
    let mut c = connect(req("mock", 4000)).await.unwrap();
    for _ in 0..3 {
        read_frame::<_, GenEvent>(&mut c).await.unwrap();
    }
    drop(c);
    let stats = s.sched.stats();
    wait_until("the worker to cancel", || stats.running.load(Ordering::Relaxed) == 0).await;
    assert_eq!(stats.cancelled.load(Ordering::Relaxed), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_engine_fails_health_with_its_reason() {
    let s = serve(Opts {
        mock: MockConfig { panic_at_step: Some(1), ..MockConfig::zero_delay() },
        ..Opts::default()
    })
    .await;
    assert_eq!(get(s.addr, "/health").await.status, 200);
    let r = post_json(s.addr, "/v1/chat/completions", &chat("hello", json!({}))).await;
    assert_ne!(r.status, 200, "{}", r.text());
    let sched = s.sched.clone();
    wait_until("the engine failure to be seen", || sched.failure().is_some()).await;
    let h = get(s.addr, "/health").await;
    assert_eq!(h.status, 503);
    let h = h.json();
    assert_eq!(h["status"], "failed");
    assert!(h["engine"]["failure"].as_str().unwrap().contains("injected fault"), "{h}");
    assert!(h["reasons"][0].as_str().unwrap().starts_with("the engine failed: "), "{h}");
    // Later requests fail fast, typed.
    let r = post_json(s.addr, "/v1/chat/completions", &chat("again", json!({}))).await;
    assert_eq!(r.status, 503, "{}", r.text());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_key_guards_the_api_but_not_health_or_metrics() {
    let s = serve(Opts {
        server: ServerConfig { api_key: Some("sk-test".into()), ..ServerConfig::default() },
        ..Opts::default()
    })
    .await;
    let body = chat("hi", json!({"max_tokens": 2})).to_string();
    let r = post(s.addr, "/v1/chat/completions", &body).await;
    assert_eq!(r.status, 401, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "invalid_api_key");
    assert_eq!(get(s.addr, "/v1/models").await.status, 401);
    let with_key = |key: &str| {
        format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\
             Content-Type: application/json\r\nAuthorization: Bearer {key}\r\n\
             Content-Length: {}\r\n\r\n{body}",
            body.len()
        )
    };
    assert_eq!(common::raw(s.addr, with_key("sk-wrong").as_bytes()).await.status, 401);
    let r = common::raw(s.addr, with_key("sk-test").as_bytes()).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(get(s.addr, "/health").await.status, 200);
    assert_eq!(get(s.addr, "/metrics").await.status, 200);
}

/// Sends `head` and then `body` in pieces of `piece` bytes every `every`, and returns what the
/// server answered (all of it, until it closes) and when its answer began.
async fn slow_request(
    addr: SocketAddr,
    head: String,
    body: Vec<u8>,
    piece: usize,
    every: Duration,
) -> (String, Duration) {
    let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
    c.write_all(head.as_bytes()).await.unwrap();
    let start = Instant::now();
    let (mut rd, mut wr) = c.into_split();
    let writer = tokio::spawn(async move {
        for chunk in body.chunks(piece.max(1)) {
            if wr.write_all(chunk).await.is_err() {
                return;
            }
            tokio::time::sleep(every).await;
        }
        // Then silence, the connection held open.
        tokio::time::sleep(Duration::from_secs(600)).await;
        drop(wr);
    });
    let mut out = Vec::new();
    let mut first = None;
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout(Duration::from_secs(30), rd.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => break,
            Ok(Ok(n)) => {
                first.get_or_insert_with(|| start.elapsed());
                out.extend_from_slice(&buf[..n]);
            }
            Err(_) => panic!("no answer within 30 s: {}", String::from_utf8_lossy(&out)),
        }
    }
    writer.abort();
    (String::from_utf8_lossy(&out).to_string(), first.unwrap_or_else(|| start.elapsed()))
}

fn post_head(path: &str, content_length: u64, extra: &str) -> String {
    format!(
        "POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n\
         Content-Length: {content_length}\r\n{extra}\r\n"
    )
}

/// The fault round's slow bodies: a body that stops, a body that drips, a huge announced body
/// (with and without `Expect: 100-continue`), and a pool full of them while `/health` answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_bodies_that_never_finish_are_timed_out_and_huge_ones_refused_up_front() {
    use kvfabric_serving::http::listen::HttpLimits;
    use kvfabric_serving::http::BodyLimits;
    let s = serve(Opts {
        server: ServerConfig {
            body: BodyLimits { grace: Duration::from_secs(3), ..BodyLimits::default() },
            ..ServerConfig::default()
        },
        listen: Some(HttpLimits {
            connections_max: 8,
            reserve: 4,
            header_read_timeout: Duration::from_secs(2),
            reserve_timeout: Duration::from_secs(1),
            ..HttpLimits::default()
        }),
        ..Opts::default()
    })
    .await;
    let chat_path = "/v1/chat/completions";
    // Announced 4,000 bytes, sent 50, then silence: 408 after the grace, connection closed.
    let (answer, at) =
        slow_request(s.addr, post_head(chat_path, 4000, ""), vec![b' '; 50], 50, Duration::ZERO)
            .await;
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("did not arrive in time"), "{answer}");
    assert!(at < Duration::from_secs(6), "answered after {at:?}");
    // One byte every 300 ms: under the minimum rate once the grace is spent.
    let (answer, at) = slow_request(
        s.addr,
        post_head(chat_path, 100, ""),
        vec![b' '; 100],
        1,
        Duration::from_millis(300),
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(at < Duration::from_secs(6), "a drip held the connection {at:?}");
    // 99,999,999,999 bytes announced, and 50 MB behind `Expect: 100-continue`: 413 at once,
    // never `100 Continue`.
    for (len, extra) in [(99_999_999_999u64, ""), (50_000_000, "Expect: 100-continue\r\n")] {
        let (answer, at) =
            slow_request(s.addr, post_head(chat_path, len, extra), Vec::new(), 1, Duration::ZERO)
                .await;
        assert!(answer.starts_with("HTTP/1.1 413"), "{len}: {answer}");
        assert!(!answer.contains("100 Continue"), "{answer}");
        assert!(at < Duration::from_secs(1), "{at:?}");
    }
    // A small body behind `Expect: 100-continue` is still served.
    let body = chat("hi", json!({"max_tokens": 2})).to_string();
    let (answer, _) = slow_request(
        s.addr,
        post_head(chat_path, body.len() as u64, "Expect: 100-continue\r\nConnection: close\r\n"),
        body.into_bytes(),
        1 << 20,
        Duration::ZERO,
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 100") && answer.contains("HTTP/1.1 200"), "{answer}");

    // (The connections above are all closed first, so that the eight below meet an empty
    // pool.)
    wait_until("earlier connections to close", || s.listen_open() == 0).await;
    // Eight stalled bodies fill the pool. The reserve answers /health and /metrics, and
    // refuses the rest with 503 without reading it.
    let stalled: Vec<_> = (0..8)
        .map(|_| {
            tokio::spawn(slow_request(
                s.addr,
                post_head(chat_path, 4000, ""),
                vec![b' '; 10],
                10,
                Duration::ZERO,
            ))
        })
        .collect();
    wait_until("the pool to fill", || s.listen_open() >= 8).await;
    assert_eq!(get(s.addr, "/health").await.status, 200);
    assert_eq!(get(s.addr, "/metrics").await.status, 200);
    let r = post_json(s.addr, chat_path, &chat("hi", json!({"max_tokens": 2}))).await;
    assert_eq!(r.status, 503, "{}", r.text());
    // They are timed out, and the pool serves chat again.
    for h in stalled {
        let (answer, _) = h.await.unwrap();
        assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    }
    let r = post_json(s.addr, chat_path, &chat("hi", json!({"max_tokens": 2}))).await;
    assert_eq!(r.status, 200, "{}", r.text());
}

/// A server told to stop closes its listener at once (a new connection is refused, so the
/// client or its load balancer goes to another server: before, it sat in the backlog and was
/// reset when the process exited) and finishes the requests it has.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_server_refuses_new_connections_and_finishes_the_ones_it_has() {
    let app = axum::Router::new().route(
        "/slow",
        axum::routing::get(|| async {
            tokio::time::sleep(Duration::from_millis(800)).await;
            "done"
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(kvfabric_serving::http::listen::serve(
        listener,
        app,
        kvfabric_serving::http::listen::HttpLimits::default(),
        ServerConfig::default().listen,
        None,
        async {
            let _ = stop_rx.await;
        },
    ));
    let slow = tokio::spawn(get(addr, "/slow"));
    tokio::time::sleep(Duration::from_millis(200)).await;
    stop_tx.send(()).unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let late = tokio::net::TcpStream::connect(addr).await;
    assert!(late.is_err(), "a connection was taken while the server drained");
    let r = slow.await.unwrap();
    assert_eq!((r.status, r.text().as_str()), (200, "done"));
    server.await.unwrap().unwrap();
}

mod tls {
    //! HTTPS on the API (HTTP/1.1 and HTTP/2 by ALPN, client certificates, reload) and mutual
    //! TLS on a worker's request port, with certificates of an in-test CA.

    use super::*;
    use kvfabric::testkit::{TestCa, TestCert};
    use kvfabric::tls::{Tls, TlsFiles};
    use std::sync::Arc;

    /// A client configuration trusting `ca`, presenting `cert` if given, offering `alpn`.
    fn client(ca: &TestCa, cert: Option<&TestCert>, alpn: &[&[u8]]) -> Arc<rustls::ClientConfig> {
        let mut c = (*kvfabric::tls::client_config(
            &ca.ca(),
            cert.map(|c| (c.cert.as_path(), c.key.as_path())),
        )
        .unwrap())
        .clone();
        c.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Arc::new(c)
    }

    async fn connect(
        addr: SocketAddr,
        config: Arc<rustls::ClientConfig>,
    ) -> std::io::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
        let tcp = tokio::net::TcpStream::connect(addr).await?;
        let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap().to_owned();
        tokio_rustls::TlsConnector::from(config).connect(name, tcp).await
    }

    /// GET `path` over HTTP/1.1 on TLS; the response, or the error on the way.
    async fn get_https(
        addr: SocketAddr,
        config: Arc<rustls::ClientConfig>,
        path: &str,
    ) -> std::io::Result<common::Response> {
        let mut s = connect(addr, config).await?;
        s.write_all(&common::request_bytes("GET", path, None)).await?;
        s.flush().await?;
        let mut buf = Vec::new();
        tokio::time::timeout(Duration::from_secs(30), s.read_to_end(&mut buf)).await??;
        Ok(common::parse_response(&buf))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn https_serves_http1_and_http2_requires_client_certificates_and_reloads() {
        let ca = TestCa::new("api").unwrap();
        let clients = TestCa::new("api clients").unwrap();
        let dir = tempfile::tempdir().unwrap();
        let live = TestCert { cert: dir.path().join("cert.pem"), key: dir.path().join("key.pem") };
        let first = ca.issue(&["127.0.0.1"]).unwrap();
        std::fs::copy(&first.cert, &live.cert).unwrap();
        std::fs::copy(&first.key, &live.key).unwrap();
        let tls = Tls::load(TlsFiles {
            cert: live.cert.clone(),
            key: live.key.clone(),
            ca: None,
            client_ca: Some(clients.ca()),
        })
        .unwrap();
        let s = serve(Opts { listen: Some(Default::default()), ..Opts::default() }).await;
        // The same app behind a TLS listener.
        let layout = s.sched.info().layout;
        let agent = Agent::start(AgentConfig::new("https", b"s".to_vec())).await.unwrap();
        let store = TieredStore::open(
            StoreConfig::new(layout.bytes_per_block(), 8),
            &agent,
            std::sync::Arc::new(NullSink),
        )
        .await
        .unwrap();
        let server = ServerConfig::default();
        let stats = server.listen.clone();
        let app = router(Arc::new(LocalBackend::new(s.sched.clone(), store)), server);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(kvfabric_serving::http::listen::serve(
            listener,
            app,
            Default::default(),
            stats,
            Some(tls.clone()),
            std::future::pending::<()>(),
        ));
        let me = clients.issue(&["client"]).unwrap();

        // HTTP/1.1 with a client certificate.
        let r =
            get_https(addr, client(&ca, Some(&me), &[b"http/1.1"]), "/v1/models").await.unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        assert!(r.text().contains("mock"));
        // HTTP/2, chosen by ALPN: a streamed completion arrives whole.
        let s2 = connect(addr, client(&ca, Some(&me), &[b"h2"])).await.unwrap();
        assert_eq!(s2.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
        let (mut sender, conn) = hyper::client::conn::http2::handshake(
            hyper_util::rt::TokioExecutor::new(),
            hyper_util::rt::TokioIo::new(s2),
        )
        .await
        .unwrap();
        tokio::spawn(conn);
        let body =
            json!({"model": "mock", "prompt": "hello over h2", "max_tokens": 4, "stream": true});
        let req = hyper::Request::post("https://127.0.0.1/v1/completions")
            .header("content-type", "application/json")
            .body(http_body_util::Full::new(bytes::Bytes::from(body.to_string())))
            .unwrap();
        let resp = sender.send_request(req).await.unwrap();
        assert_eq!(resp.version(), hyper::Version::HTTP_2);
        assert_eq!(resp.status(), 200);
        use http_body_util::BodyExt;
        let text = resp.into_body().collect().await.unwrap().to_bytes();
        let text = String::from_utf8_lossy(&text);
        assert!(text.contains("[DONE]"), "{text}");

        // Without a client certificate, or with one of another CA: no answer.
        let r = get_https(addr, client(&ca, None, &[]), "/health").await;
        assert!(r.is_err(), "no client certificate: {r:?}");
        let stranger = ca.issue(&["client"]).unwrap();
        let r = get_https(addr, client(&ca, Some(&stranger), &[]), "/health").await;
        assert!(r.is_err(), "a client certificate of another CA: {r:?}");
        // Plaintext HTTP gets nothing that parses as a response.
        let mut plain = tokio::net::TcpStream::connect(addr).await.unwrap();
        plain.write_all(&common::request_bytes("GET", "/health", None)).await.unwrap();
        let mut buf = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(15), plain.read_to_end(&mut buf)).await;
        assert!(!String::from_utf8_lossy(&buf).contains("HTTP/1.1 200"));

        // Reload: an open connection keeps its certificate, new ones get the new.
        let mut open = connect(addr, client(&ca, Some(&me), &[b"http/1.1"])).await.unwrap();
        let now = std::time::SystemTime::now();
        let second = ca
            .issue_valid(
                &["127.0.0.1"],
                now - Duration::from_secs(60),
                now + Duration::from_secs(900 * 86_400),
            )
            .unwrap();
        std::fs::copy(&second.cert, &live.cert).unwrap();
        std::fs::copy(&second.key, &live.key).unwrap();
        tls.reload().unwrap();
        let fresh = connect(addr, client(&ca, Some(&me), &[b"http/1.1"])).await.unwrap();
        let served = |s: &tokio_rustls::client::TlsStream<tokio::net::TcpStream>| {
            let chain = s.get_ref().1.peer_certificates().unwrap();
            kvfabric::tls::validity(&chain[0]).unwrap().1
        };
        assert_eq!(
            served(&fresh),
            tls.not_after(),
            "a new connection gets the reloaded certificate"
        );
        assert!(served(&open) < served(&fresh), "the open one kept its own");
        open.write_all(&common::request_bytes("GET", "/health", None)).await.unwrap();
        open.flush().await.unwrap();
        let mut buf = Vec::new();
        open.read_to_end(&mut buf).await.unwrap();
        assert_eq!(common::parse_response(&buf).status, 200, "the open connection still serves");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_worker_port_with_mutual_tls_serves_tls_frontends_and_refuses_plaintext() {
        use kvfabric_serving::engine::{GenEvent, GenerateRequest, SamplingParams};
        use kvfabric_serving::protocol::{self, Auth, ServeLimits, ServeStats, WorkerRequest};
        let s = serve(Opts { mock: MockConfig::zero_delay(), ..Opts::default() }).await;
        let agent = Agent::start(AgentConfig::new("wt", b"s".to_vec())).await.unwrap();
        let store = TieredStore::open(
            StoreConfig::new(s.sched.info().layout.bytes_per_block(), 8),
            &agent,
            std::sync::Arc::new(NullSink),
        )
        .await
        .unwrap();
        let ca = TestCa::new("deployment").unwrap();
        let tls = || {
            let c = ca.issue(&["127.0.0.1"]).unwrap();
            Tls::load(TlsFiles { cert: c.cert, key: c.key, ca: Some(ca.ca()), client_ca: None })
                .unwrap()
        };
        let backend = Arc::new(LocalBackend::new(s.sched.clone(), store));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let worker = Auth { name: "w".into(), secret: b"worker-secret".into(), tls: Some(tls()) };
        let stats = Arc::new(ServeStats::default());
        let _server = protocol::serve(listener, backend, worker, ServeLimits::default(), stats);
        let req = WorkerRequest {
            model: "mock".into(),
            request: GenerateRequest {
                prompt: vec![104, 105, 106],
                max_tokens: 3,
                sampling: SamplingParams::default(),
                stop: vec![],
                ignore_eos: true,
                timeout: Duration::from_secs(30),
                class: None,
                cache_salt: None,
                tenant: None,
                pull: None,
            },
        };
        let frontend = Auth { name: "f".into(), secret: b"worker-secret".into(), tls: Some(tls()) };
        let mut conn =
            protocol::connect(addr, "w", &frontend, &req, Duration::from_secs(5)).await.unwrap();
        let mut tokens = 0;
        loop {
            match protocol::read_frame::<_, GenEvent>(&mut conn).await.unwrap() {
                Some(GenEvent::Token { .. }) => tokens += 1,
                Some(GenEvent::Done { .. }) | None => break,
                Some(GenEvent::Error(e)) => panic!("{e}"),
                Some(_) => {}
            }
        }
        assert_eq!(tokens, 3);
        // A plaintext frontend is told the port requires TLS.
        let plain = Auth { tls: None, ..frontend.clone() };
        let err =
            protocol::connect(addr, "w", &plain, &req, Duration::from_secs(5)).await.unwrap_err();
        assert!(err.to_string().contains("requires mutual TLS"), "{err}");
        assert!(err.is_auth(), "a configuration error, not worth a retry: {err}");
    }
}
