//! The trace simulator (`kvfabric bench trace`) checked against the real stack: the same
//! slice of the shipped conversation trace replayed online through `kvfabric up` (mock
//! engine, four workers, kv routing, host tiers that must evict) and offline through the
//! simulator, configured alike and timed by a `kvfabric profile` of that very stack. Reuse
//! must agree within 5 percentage points and TTFT p50 within 25%.
//!
//! The slice: the requests of the trace's 100 busiest conversations (by their first two
//! ids), the first 400 of them, timestamps from the first, replayed 100 times faster with each
//! 512-token id as 16 tokens (`--replay-block-tokens 16`) and answers cut at 8 tokens: the
//! trace's own sharing (its limit here is 0.76) in a run of 15 s on two cores.
//!
//! What it cannot show: a disk tier's agreement (the worker keeps a quarter of its host tier
//! free, written back to disk in the background, and disk reads cost the run's own disk; the
//! simulator's G3 is a plain LRU behind its link), and large-scale timing (the stack shares two
//! cores with the replaying client). Its own file, so that no other test shares the cores.
//!
//! Not in CI yet: the two sides do not agree reliably. Over six runs before this session's
//! fix of worker load reports (below) the real reuse varied 0.617–0.657 against the
//! simulator's 0.606 and the real TTFT p50 12.8–17.7 ms against 12.6–12.9 ms: most runs
//! within the bounds, some not. Three runs after it: reuse 0.64–0.66 real against 0.599, TTFT
//! p50 18–19 ms against 11.5–11.9 ms. What these runs found:
//! - a worker's load report left out requests submitted during a long step (they wait in
//!   the engine loop's inbox), so kv routers saw a busy worker as idle and piled
//!   conversations onto it (a 1 ms-per-token run put 83 of 200 requests on one of four
//!   workers); fixed in the scheduler (`SchedulerStats::prefill_load`), tested in
//!   `serving/engine/tests/step_plan.rs`;
//! - the real router replaces what it tracks with each worker's report every 200 ms; the
//!   simulator's router tracks only what it routed. Emulating the reports matched a 30×,
//!   1 ms-per-token slice (reuse 0.622 against 0.625; TTFT p90/p99 within 1–5%; p50 52
//!   against 65–73 ms) but moved this slice's reuse to 0.554, further off, so it is not in
//!   the simulator: the reports' timing (a snapshot after each step, delivered over the bus)
//!   needs modelling as it is.
//!
//! Run it with `cargo test -p kvfabric-cli --test trace_agreement -- --ignored --nocapture`.

mod common;

use std::collections::HashMap;
use std::process::{Command, Output};

use common::spawn_line;
use serde_json::Value;

fn kvfabric(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvfabric"))
        .args(args)
        .env_remove("KVFABRIC_CONFIG")
        .output()
        .expect("run kvfabric")
}

fn json(out: &Output) -> Value {
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("valid JSON on stdout")
}

/// The busiest conversations' first `n` requests, timestamps from the first.
fn busy_slice(dir: &std::path::Path, groups: usize, n: usize) -> std::path::PathBuf {
    let shipped = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../benches/traces/conversation_trace.jsonl");
    let text = std::fs::read_to_string(shipped).unwrap();
    let reqs: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let key = |r: &Value| -> Option<(u64, u64)> {
        let ids = r["hash_ids"].as_array()?;
        Some((ids.first()?.as_u64()?, ids.get(1)?.as_u64()?))
    };
    let mut count: HashMap<(u64, u64), usize> = HashMap::new();
    for r in &reqs {
        if let Some(k) = key(r) {
            *count.entry(k).or_default() += 1;
        }
    }
    let mut busiest: Vec<((u64, u64), usize)> = count.into_iter().collect();
    busiest.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    busiest.truncate(groups);
    let keep: std::collections::HashSet<(u64, u64)> = busiest.into_iter().map(|g| g.0).collect();
    let slice: Vec<&Value> =
        reqs.iter().filter(|r| key(r).is_some_and(|k| keep.contains(&k))).take(n).collect();
    let t0 = slice[0]["timestamp"].as_u64().unwrap();
    let lines: Vec<String> = slice
        .iter()
        .map(|r| {
            let mut r = (*r).clone();
            r["timestamp"] = (r["timestamp"].as_u64().unwrap() - t0).into();
            r.to_string()
        })
        .collect();
    let path = dir.join("busy.jsonl");
    std::fs::write(&path, lines.join("\n")).unwrap();
    path
}

#[test]
#[ignore = "timing-sensitive: on two shared cores the real stack's reuse and TTFT p50 vary from \
            run to run by about as much as the bounds allow; run it alone with --ignored"]
fn the_simulator_agrees_with_the_real_stack_on_a_slice_of_real_traffic() {
    let dir = tempfile::tempdir().unwrap();
    let slice = busy_slice(dir.path(), 100, 400);
    let slice = slice.to_str().unwrap();
    let host_blocks = 512u64;
    let (_up, line) = spawn_line(
        Command::new(env!("CARGO_BIN_EXE_kvfabric"))
            .args(["up", "--engine", "mock", "--port", "0", "--workers", "4"])
            .args(["--host-blocks", &host_blocks.to_string(), "--disk-blocks", "0"])
            .args(["--mock-prefill-us", "200", "--mock-decode-us", "2000"])
            .args(["--mock-decode-kv-us", "0", "--step-tokens", "8192", "--max-batch", "16"])
            .env_remove("KVFABRIC_CONFIG")
            .env("KVFABRIC_MODEL_DIR", std::env::temp_dir()),
    );
    let url = line.split(" at ").nth(1).expect("the URL").trim().to_string();
    let base = url.trim_end_matches("/v1");
    // The engine as the simulator will see it: measured through the same HTTP path.
    let profile = dir.path().join("profile.json");
    let out = kvfabric(&[
        "profile",
        "--url",
        base,
        "--prompts",
        "16,64,256,1024",
        "--batches",
        "1,4,16",
        "--contexts",
        "256,1024",
        "--decode-tokens",
        "16",
        "--tiers",
        "none",
        "--out",
        profile.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let shape = ["--replay-block-tokens", "16", "--output-tokens-max", "8", "--speedup", "100"];
    let online = json(&kvfabric(
        &[
            &["bench", "serve", "--url", &url, "--trace", slice, "--vocab", "256", "--json"][..],
            &shape,
        ]
        .concat(),
    ));
    let g1_tokens = (host_blocks * 16).to_string();
    let offline = json(&kvfabric(
        &[
            &["bench", "trace", slice, "--workers", "4", "--g1-tokens", &g1_tokens][..],
            &["--profile", profile.to_str().unwrap(), "--batch-max", "16", "--split-steps"],
            &["--model", "smollm2-135m", "--json"],
            &shape,
        ]
        .concat(),
    ));
    let sim = &offline["runs"][0];
    assert_eq!(sim["routing"], "kv", "{offline}");
    assert_eq!(online["errors"], 0, "{online}");
    assert_eq!(online["requests"], 400, "{online}");
    // Both count the same prompts and the same limit.
    assert_eq!(online["prompt_tokens"], sim["prompt_tokens"], "{online}\n{sim}");
    assert_eq!(online["limit"], sim["limit"], "{online}\n{sim}");
    let limit =
        sim["limit"]["reused_tokens"].as_f64().unwrap() / sim["limit"]["tokens"].as_f64().unwrap();
    let (real, simulated) = (online["reuse"].as_f64().unwrap(), sim["reuse"].as_f64().unwrap());
    // The host tiers hold a fraction of the slice's blocks: reuse is well above nothing and
    // well below the limit, so agreeing on it says something.
    assert!(real > 0.3 && real < limit - 0.05, "real reuse {real}, limit {limit}");
    assert!((real - simulated).abs() <= 0.05, "reuse: real {real}, simulated {simulated}");
    let real_p50 = online["ttft_ms"][0].as_f64().unwrap() / 1e3;
    let sim_p50 = sim["ttft_s"][0].as_f64().unwrap();
    assert!(
        (sim_p50 - real_p50).abs() <= 0.25 * real_p50,
        "TTFT p50: real {real_p50} s, simulated {sim_p50} s"
    );
    eprintln!(
        "agreement: reuse real {real:.3} simulated {simulated:.3} (limit {limit:.3}); TTFT p50 \
         real {:.1} ms simulated {:.1} ms",
        real_p50 * 1e3,
        sim_p50 * 1e3
    );
}
