//! `kvfabric up` with the real model (SmolLM2-135M-Instruct, f32 weights) as its own
//! process, over HTTP: chat and completions, whole and streamed; greedy output is stable; a
//! repeated prompt is served from cached KV blocks (the metrics show it) and answers exactly
//! like the cold run; a working set larger than the host tier spills to disk and comes back.
//! `scripts/test.sh` fetches the model first (`KVFABRIC_TEST_MODEL`).

use crate::common;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Command;

use common::{get, metric, post_json, spawn_server, streamed_text, Proc};
use serde_json::{json, Value};

const MODEL: &str = "SmolLM2-135M-Instruct.Q4_1";

fn model_path() -> PathBuf {
    let path = std::env::var_os("KVFABRIC_TEST_MODEL").map(PathBuf::from).unwrap_or_else(|| {
        let home = std::env::var_os("HOME").expect("HOME is set");
        PathBuf::from(home).join(".cache/kvfabric/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    });
    assert!(path.is_file(), "{} is missing: run scripts/fetch-model.sh", path.display());
    path
}

struct Up {
    _proc: Proc,
    addr: SocketAddr,
    _dir: tempfile::TempDir,
}

fn up(host_blocks: u32) -> Up {
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvfabric"));
    cmd.args(["up", "--port", "0", "--disk-blocks", "256", "--max-batch", "4"])
        // Every evicted block goes to disk (by default only reused ones do).
        .args(["--disk-admit-min-hits", "0"])
        .arg("--host-blocks")
        .arg(host_blocks.to_string())
        .arg("--model")
        .arg(model_path())
        .arg("--data-dir")
        .arg(dir.path());
    let (proc, addr, _) = spawn_server(cmd);
    Up { _proc: proc, addr, _dir: dir }
}

fn chat(messages: Value, max_tokens: u32) -> Value {
    json!({"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0})
}

fn content(v: &Value) -> String {
    v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_else(|| panic!("no content: {v}"))
        .to_string()
}

fn cached(v: &Value) -> u64 {
    v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_real_model_answers_chat_and_completions_whole_and_streamed() {
    let s = up(256);
    let models = get(s.addr, "/v1/models").await.json();
    assert_eq!(models["data"][0]["id"], MODEL);

    let q = chat(json!([{"role": "user", "content": "What is the capital of France?"}]), 16);
    let r = post_json(s.addr, "/v1/chat/completions", &q).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let answer = content(&r.json());
    assert!(answer.contains("Paris"), "{answer:?}");

    let mut streamed = q.clone();
    streamed["stream"] = json!(true);
    let (text, chunks) = streamed_text(&post_json(s.addr, "/v1/chat/completions", &streamed).await);
    assert_eq!(text, answer, "streamed greedy output differs from the whole one");
    assert!(chunks.len() >= 3);

    let c = json!({"model": MODEL, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0});
    let first = post_json(s.addr, "/v1/completions", &c).await.json();
    let text = first["choices"][0]["text"].as_str().unwrap().to_string();
    assert!(text.contains("Paris"), "{text:?}");
    let again = post_json(s.addr, "/v1/completions", &c).await.json();
    assert_eq!(again["choices"][0]["text"], text.as_str(), "greedy output is not stable");

    // Seeded sampling is reproducible too.
    let mut seeded = c.clone();
    seeded["temperature"] = json!(0.9);
    seeded["seed"] = json!(1234);
    seeded["max_tokens"] = json!(12);
    let a = post_json(s.addr, "/v1/completions", &seeded).await.json();
    let b = post_json(s.addr, "/v1/completions", &seeded).await.json();
    assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"]);
}

fn long_conversation(topic: &str) -> Value {
    json!([
        {"role": "system", "content": format!("You are an expert on {topic}. Answer in complete sentences, with concrete facts, dates and names where you know them, and keep a friendly tone.")},
        {"role": "user", "content": format!("I am preparing a short talk for my local library about {topic}. Please give me an overview I can read aloud.")},
    ])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_prompt_is_served_from_cached_blocks_and_answers_like_the_cold_run() {
    let s = up(256);
    let q = chat(long_conversation("the history of Paris"), 40);
    let cold = post_json(s.addr, "/v1/chat/completions", &q).await.json();
    assert_eq!(cached(&cold), 0);
    let prompt_tokens = cold["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(prompt_tokens > 64, "{prompt_tokens}");

    let warm = post_json(s.addr, "/v1/chat/completions", &q).await.json();
    assert_eq!(cached(&warm), (prompt_tokens - 1) / 16 * 16);
    assert_eq!(content(&warm), content(&cold), "cached KV changed the greedy answer");
    let m = get(s.addr, "/metrics").await.text();
    assert_eq!(metric(&m, "kvfabric_kv_hit_tokens_total{tier=\"host\"}"), cached(&warm) as f64);
    assert!(metric(&m, "kvfabric_kv_block_hits_total{tier=\"host\"}") > 0.0);
    assert!(metric(&m, "kvfabric_kv_stored_blocks_total") > 0.0);

    // The next turn of the conversation reuses the blocks of the first (prompt and answer).
    let mut next = long_conversation("the history of Paris");
    next.as_array_mut().unwrap().push(json!({"role": "assistant", "content": content(&cold)}));
    next.as_array_mut()
        .unwrap()
        .push(json!({"role": "user", "content": "Thanks! And what about its museums?"}));
    let turn2 = post_json(s.addr, "/v1/chat/completions", &chat(next, 8)).await.json();
    assert!(cached(&turn2) >= cached(&warm), "{} < {}", cached(&turn2), cached(&warm));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_working_set_larger_than_the_host_tier_spills_to_disk_and_comes_back() {
    // 6 host blocks of 16 tokens: one long prompt alone overflows them.
    let s = up(6);
    let a = chat(long_conversation("the history of Paris"), 12);
    let first = post_json(s.addr, "/v1/chat/completions", &a).await.json();
    for topic in ["volcanoes of Iceland", "the life of honey bees"] {
        let r = post_json(s.addr, "/v1/chat/completions", &chat(long_conversation(topic), 4)).await;
        assert_eq!(r.status, 200);
    }
    let m = get(s.addr, "/metrics").await.text();
    assert!(metric(&m, "kvfabric_kv_blocks{tier=\"disk\"}") > 6.0, "{m}");
    assert!(metric(&m, "kvfabric_kv_offload_bytes_total") > 0.0);

    let back = post_json(s.addr, "/v1/chat/completions", &a).await.json();
    assert!(cached(&back) > 0);
    assert_eq!(content(&back), content(&first), "KV read back from disk changed the answer");
    let m = get(s.addr, "/metrics").await.text();
    assert!(metric(&m, "kvfabric_kv_hit_tokens_total{tier=\"disk\"}") > 0.0, "{m}");
    assert!(metric(&m, "kvfabric_kv_onboard_bytes_total") > 0.0);
}

/// A latency class's request finds the only batch slot held by a batch request decoding: it
/// pauses that decode (counted), runs, and the batch request resumes from its stored blocks,
/// its last partial block computed again as a prompt chunk, and answers, token for token,
/// what it answers alone (greedy, the real model).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_decode_of_the_real_model_answers_as_it_does_alone() {
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvfabric"));
    cmd.args(["up", "--port", "0", "--disk-blocks", "0", "--max-batch", "1"])
        .args(["--class", "interactive:ttft=300ms,itl=50ms", "--class", "batch:ttft=30s,default"])
        .arg("--model")
        .arg(model_path())
        .arg("--data-dir")
        .arg(dir.path());
    let (_proc, addr, _) = spawn_server(cmd);
    let batch = json!({
        "model": MODEL, "max_tokens": 96, "temperature": 0, "ignore_eos": true,
        "messages": long_conversation("the history of Lyon"),
    });
    let alone = post_json(addr, "/v1/chat/completions", &batch).await.json();
    let steps =
        || async { metric(&get(addr, "/metrics").await.text(), "kvfabric_engine_steps_total") };
    let before = steps().await;
    let paused = tokio::spawn(async move { post_json(addr, "/v1/chat/completions", &batch).await });
    // It decodes (a prompt step, then a token a step) when the interactive request comes.
    for _ in 0..2000 {
        if steps().await >= before + 8.0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    let quick = json!({
        "model": MODEL, "max_tokens": 1, "temperature": 0, "kvfabric": {"class": "interactive"},
        "messages": [{"role": "user", "content": "Say hi."}],
    });
    let r = post_json(addr, "/v1/chat/completions", &quick).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let resumed = paused.await.unwrap().json();
    let m = get(addr, "/metrics").await.text();
    assert_eq!(metric(&m, "kvfabric_engine_preempted_total{phase=\"decode\"}"), 1.0);
    assert_eq!(content(&resumed), content(&alone), "the paused decode changed the answer");
    assert_eq!(resumed["usage"]["completion_tokens"], 96);
}
