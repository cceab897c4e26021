//! The `kvfabric` binary as a user runs it: `plan`, `profile` and `hash`, their JSON, and their errors.

use std::io::Write;
use std::process::{Command, Output, Stdio};

fn kvfabric(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvfabric"))
        .args(args)
        .env_remove("KVFABRIC_MODEL")
        .env_remove("KVFABRIC_BLOCK_TOKENS")
        .env_remove("KVFABRIC_CONFIG")
        .output()
        .expect("run kvfabric")
}

fn stdout_json(out: &Output) -> serde_json::Value {
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("valid JSON on stdout")
}

/// `kvfabric up` with the mock engine and two workers on a free port, its URL, and its
/// stdout (kept open while it runs: a closed pipe would fail its next line).
type Stdout = std::io::Lines<std::io::BufReader<std::process::ChildStdout>>;
fn mock_up() -> (std::process::Child, String, Stdout) {
    use std::io::{BufRead, BufReader};
    let mut up = Command::new(env!("CARGO_BIN_EXE_kvfabric"))
        .args(["up", "--engine", "mock", "--port", "0", "--disk-blocks", "0", "--workers", "2"])
        .args(["--mock-decode-us", "500", "--mock-prefill-us", "1"])
        .env_remove("KVFABRIC_CONFIG")
        // Where scripts/fetch-model.sh caches the model: not a model directory for the mock
        // (the two once shared a variable, and every mock run of a relocated cache failed).
        .env("KVFABRIC_MODEL_DIR", std::env::temp_dir())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(up.stdout.take().unwrap()).lines();
    let first = lines.next().unwrap().unwrap();
    let url = first.split(" at ").nth(1).unwrap().trim().to_string();
    (up, url, lines)
}

/// A failed run: non-zero exit, exactly one line on stderr, no panic.
fn one_line_error(out: &Output) -> String {
    assert!(!out.status.success(), "expected failure, got success");
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(err.trim_end().lines().count(), 1, "one line: {err:?}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(err.starts_with("error"), "{err}");
    err
}

#[test]
fn plan_json_has_the_documented_fields() {
    let v = stdout_json(&kvfabric(&["plan", "--model", "llama-3.1-8b", "--json"]));
    assert_eq!(v["kv_bytes_per_token"], 131_072);
    assert_eq!(v["kv_bytes_per_block"], 131_072 * 16);
    assert_eq!(v["block_tokens"], 16);
    let contexts = v["contexts"].as_array().unwrap();
    assert_eq!(contexts[0]["context_tokens"], 4096);
    assert_eq!(contexts[0]["kv_bytes_per_sequence"], 536_870_912u64);
    assert_eq!(contexts.last().unwrap()["context_tokens"], 131_072, "model maximum");
}

#[test]
fn plan_reads_config_json_and_gguf() {
    let cfg = &std::path::PathBuf::from(
        std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_else(|| env!("CARGO_MANIFEST_DIR").into()),
    )
    .join("../kvfabric/tests/data/deepseek-r1.config.json")
    .to_string_lossy()
    .into_owned();
    let v = stdout_json(&kvfabric(&["plan", "--model", cfg, "--json", "--block-tokens", "64"]));
    assert_eq!(v["kv_bytes_per_token"], 70_272);
    assert_eq!(v["kv_bytes_per_block"], 70_272 * 64);
    assert_eq!(v["attention"], "mla");
    let home = std::env::var("HOME").unwrap();
    let gguf = std::env::var("KVFABRIC_TEST_MODEL")
        .unwrap_or(format!("{home}/.cache/kvfabric/models/SmolLM2-135M-Instruct.Q4_1.gguf"));
    let v = stdout_json(&kvfabric(&["plan", "--model", &gguf, "--json"]));
    assert_eq!(v["kv_bytes_per_token"], 23_040);
    assert_eq!(v["dtype"], "f16");
}

#[test]
fn plan_table_for_humans() {
    let out =
        kvfabric(&["plan", "--model", "qwen3-32b", "--context", "8192", "--link", "pcie5,x=7"]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("KV per token 256.00 KiB (262144 B)"), "{text}");
    assert!(text.contains("move pcie5") && text.contains("move x"), "{text}");
}

#[test]
fn hash_json_matches_the_spec_vectors() {
    let tokens: Vec<String> = (0..18).map(|t| t.to_string()).collect();
    let mut args = vec!["hash", "--block-tokens", "4", "--json"];
    args.extend(tokens.iter().map(String::as_str));
    let v = stdout_json(&kvfabric(&args));
    // docs/hashing.md, vector 1; tokens 16 and 17 form a partial block.
    assert_eq!(
        v["block_hashes"],
        serde_json::json!([
            9143094415614847814u64,
            12124091508212882195u64,
            1088361764653601668u64,
            16024980976528976948u64
        ])
    );
    assert_eq!(
        v["sequence_hashes"],
        serde_json::json!([
            9143094415614847814u64,
            9510318385840434533u64,
            16998148715716822651u64,
            16790386768269814709u64
        ])
    );
}

#[test]
fn hash_reads_stdin_and_salts() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvfabric"))
        .args(["hash", "--block-tokens", "4", "--salt", "tenant-a", "--json"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(b"[0, 1, 2, 3,\n4, 5, 6, 7]\n").unwrap();
    let out = child.wait_with_output().unwrap();
    let v = stdout_json(&out);
    assert_eq!(
        v["sequence_hashes"],
        serde_json::json!([17009624042690211646u64, 18279821067719767880u64])
    );
}

/// Flags that make no sense are refused before anything starts, each naming itself.
#[test]
fn nonsense_serving_flags_are_refused() {
    for (args, flag) in [
        (&["up", "--max-batch", "0"][..], "--max-batch"),
        (&["up", "--step-tokens", "0"], "--step-tokens"),
        (&["up", "--workers", "0"], "--workers"),
        (&["up", "--host-blocks", "0"], "--host-blocks"),
        (&["up", "--block-tokens", "0"], "--block-tokens"),
        (&["up", "--max-connections", "0"], "--max-connections"),
        (&["worker", "--max-batch", "0"], "--max-batch"),
        (&["fabric", "--secret", "s", "--host-blocks", "0"], "--host-blocks"),
        (&["frontend", "--max-connections", "0"], "--max-connections"),
    ] {
        let e = one_line_error(&kvfabric(args));
        assert!(e.contains(flag), "{args:?}: {e}");
    }
    for args in [&["up", "--api-key", ""][..], &["frontend", "--api-key", " "]] {
        let e = one_line_error(&kvfabric(args));
        assert!(e.contains("empty API key would leave the API open"), "{args:?}: {e}");
    }
}

/// The line `kvfabric up` logs at start on how API requests are authenticated.
fn up_authentication(args: &[&str]) -> String {
    use std::io::{BufRead, BufReader};
    let mut up = Command::new(env!("CARGO_BIN_EXE_kvfabric"))
        .args(["up", "--engine", "mock", "--port", "0", "--disk-blocks", "0"])
        .args(args)
        .env_remove("KVFABRIC_CONFIG")
        .env_remove("KVFABRIC_API_KEY")
        .env_remove("RUST_LOG")
        .env("KVFABRIC_MODEL_DIR", std::env::temp_dir())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let lines = BufReader::new(up.stderr.take().unwrap()).lines().map_while(Result::ok);
    let mut found: Vec<String> = Vec::new();
    for line in lines {
        if line.contains("API authentication") {
            found.push(line);
            break;
        }
    }
    up.kill().unwrap();
    up.wait().unwrap();
    assert_eq!(found.len(), 1, "no authentication line: {args:?}");
    found.remove(0)
}

/// A tenants file that configures no key would leave the API open: refused at start, as is
/// a tenant whose `"classes": []` names none. Every start says in one line how requests are
/// authenticated.
#[test]
fn tenants_that_would_open_the_api_are_refused_and_each_start_names_its_authentication() {
    let dir = tempfile::tempdir().unwrap();
    let file = |name: &str, text: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p.to_str().unwrap().to_string()
    };
    let empty = file("empty.json", r#"{"tenants": []}"#);
    let e = one_line_error(&kvfabric(&["up", "--engine", "mock", "--tenants", &empty]));
    assert!(e.contains("configures no tenant") && e.contains("open"), "{e}");
    let none = file(
        "none.json",
        r#"{"tenants": [{"name": "acme", "key": "acme-key-0001", "classes": []}]}"#,
    );
    let classes = ["--class", "interactive:ttft=300ms", "--class", "batch:ttft=30s,default"];
    let mut args = vec!["up", "--engine", "mock", "--tenants", &none];
    args.extend(classes);
    let e = one_line_error(&kvfabric(&args));
    assert!(e.contains("names no class"), "{e}");

    assert!(up_authentication(&[]).contains("API authentication: open"));
    let line = up_authentication(&["--api-key", "server-key-0001"]);
    assert!(line.contains("API authentication: API key"), "{line}");
    assert!(!line.contains("server-key-0001"), "the key is never logged: {line}");
    let two = file(
        "two.json",
        r#"{"tenants": [{"name": "acme", "key": "acme-key-0001", "classes": ["batch"]},
                        {"name": "beta", "key": "beta-key-0001"}]}"#,
    );
    let mut args = vec!["--tenants", two.as_str()];
    args.extend(classes);
    let line = up_authentication(&args);
    assert!(line.contains("API authentication: 2 tenants"), "{line}");
}

#[test]
fn wrong_input_is_one_line_and_non_zero() {
    let e = one_line_error(&kvfabric(&["plan", "--model", "gpt-17"]));
    assert!(e.contains("unknown model preset"), "{e}");
    let e = one_line_error(&kvfabric(&["plan", "--block-tokens", "0"]));
    assert!(e.contains("block_tokens"), "{e}");
    let e = one_line_error(&kvfabric(&["plan", "--gpu-gb", "-4"]));
    assert!(e.contains("--gpu-gb"), "{e}");
    let e = one_line_error(&kvfabric(&["plan", "--context", "abc"]));
    assert!(e.contains("--context"), "{e}");
    let e = one_line_error(&kvfabric(&["plan", "--concurrency", "-3"]));
    assert!(e.contains("--concurrency"), "{e}");
    let e = one_line_error(&kvfabric(&["plan", "--link", "warp9"]));
    assert!(e.contains("unknown link"), "{e}");
    let e = one_line_error(&kvfabric(&["hash", "1", "2", "three"]));
    assert!(e.contains("\"three\""), "{e}");
    let e = one_line_error(&kvfabric(&["hash", "--block-tokens", "0", "1"]));
    assert!(e.contains("--block-tokens"), "{e}");
    let e = one_line_error(&kvfabric(&["plan", "--frobnicate"]));
    assert!(e.contains("--frobnicate"), "{e}");

    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("config.json");
    std::fs::write(&bad, "{\"num_hidden_layers\": 2,").unwrap();
    let e = one_line_error(&kvfabric(&["plan", "--model", bad.to_str().unwrap()]));
    assert!(e.contains("malformed config.json"), "{e}");
    let e = one_line_error(&kvfabric(&["plan", "--model", dir.path().to_str().unwrap(), "--json"]));
    assert!(e.contains("malformed config.json"), "{e}");
    let gguf = dir.path().join("broken.gguf");
    std::fs::write(&gguf, b"GGUF\x03\0\0\0\x01").unwrap();
    let e = one_line_error(&kvfabric(&["plan", "--model", gguf.to_str().unwrap()]));
    assert!(e.contains("truncated"), "{e}");
}

/// Without CUDA, `bench transfer --transports cuda` says why in one line and fails; with other
/// transports beside it, it says so and measures those.
#[test]
fn bench_transfer_says_clearly_when_there_is_no_cuda() {
    let Err(why) = kvfabric::cuda::probe() else {
        eprintln!("this machine has CUDA: the no-CUDA message cannot be checked here");
        return;
    };
    let e = one_line_error(&kvfabric(&["bench", "transfer", "--transports", "cuda"]));
    assert!(e.contains(&why.to_string()), "{e}");
    let e = one_line_error(&kvfabric(&["bench", "tier", "--g1-only"]));
    assert!(e.contains(&why.to_string()), "{e}");
    let out = kvfabric(&[
        "bench",
        "transfer",
        "--transports",
        "cuda,shm",
        "--sizes",
        "64K",
        "--batches",
        "1",
        "--ops",
        "write",
        "--min-time-ms",
        "1",
        "--json",
        "--log-level",
        "error",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("skipping the cuda rows: no CUDA: "), "{err}");
    let rows: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0]["transport"], "shm");
}

#[test]
fn config_file_is_the_lowest_layer() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("kvfabric.toml");
    std::fs::write(&cfg, "model = \"llama-3.1-8b\"\n[plan]\nblock_tokens = 32\n").unwrap();
    let c = cfg.to_str().unwrap();
    let run = |extra: &[&str], env: Option<(&str, &str)>| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvfabric"));
        cmd.args(["plan", "--json", "--config", c]).args(extra);
        cmd.env_remove("KVFABRIC_MODEL")
            .env_remove("KVFABRIC_BLOCK_TOKENS")
            .env_remove("KVFABRIC_CONFIG");
        if let Some((k, v)) = env {
            cmd.env(k, v);
        }
        stdout_json(&cmd.output().unwrap())
    };
    assert_eq!(run(&[], None)["kv_bytes_per_block"], 131_072 * 32, "from the file");
    assert_eq!(
        run(&["--block-tokens", "16"], None)["kv_bytes_per_block"],
        131_072 * 16,
        "a flag wins"
    );
    assert_eq!(
        run(&[], Some(("KVFABRIC_BLOCK_TOKENS", "8")))["kv_bytes_per_block"],
        131_072 * 8,
        "env wins"
    );
    std::fs::write(&cfg, "blok_tokens = 3\n").unwrap();
    let e = one_line_error(&kvfabric(&["plan", "--config", c]));
    assert!(e.contains("unknown key \"blok_tokens\""), "{e}");
    std::fs::write(&cfg, "model = [\n").unwrap();
    let e = one_line_error(&kvfabric(&["plan", "--config", c]));
    assert!(e.contains("config file"), "{e}");
}

#[test]
fn up_refuses_a_missing_or_broken_model_with_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.gguf");
    let out = kvfabric(&["up", "--port", "0", "--model", missing.to_str().unwrap()]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not found") && err.contains("fetch-model.sh"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");

    let junk = dir.path().join("junk.gguf");
    std::fs::write(&junk, b"GGUF\x03\x00\x00\x00 definitely not a model").unwrap();
    let out = kvfabric(&["up", "--port", "0", "--model", junk.to_str().unwrap()]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.starts_with("error: ") && err.contains("junk.gguf"), "{err}");

    let out = kvfabric(&["up", "--engine", "gpt"]);
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn bench_serve_drives_a_mock_server_and_reports_json_rows() {
    let (mut up, url, _stdout) = mock_up();
    let out = kvfabric(&[
        "bench",
        "serve",
        "--url",
        &url,
        "--concurrency",
        "1,3",
        "--requests",
        "6",
        "--turns",
        "2",
        "--input-words",
        "20",
        "--prefix-words",
        "40",
        "--output-tokens",
        "8",
        "--json",
    ]);
    let _ = up.kill();
    let _ = up.wait();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rows: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 2);
    for r in &rows {
        assert_eq!(r["errors"], 0, "{r}");
        assert_eq!(r["requests"], 6);
        assert!(r["output_tokens_per_s"].as_f64().unwrap() > 0.0);
        assert!(r["ttft_ms"][0].as_f64().unwrap() > 0.0);
        // Second turns repeat the first turn's prompt and answer: served from cache.
        assert!(r["cached_prompt_share"].as_f64().unwrap() > 0.2, "{r}");
    }
}

/// A child process, killed and reaped when dropped.
struct Kill(std::process::Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `kvfabric up --engine mock` on a free port with `extra` flags: the process and its
/// `host:port`. Its stdout is drained (a closed pipe would fail its later prints).
struct Up;

impl Up {
    fn start(extra: &[&str], stderr: Stdio) -> (Kill, String) {
        let (kill, addr, _) = Self::start_with_line(extra, stderr);
        (kill, addr)
    }

    /// Also the line it prints when ready.
    fn start_with_line(extra: &[&str], stderr: Stdio) -> (Kill, String, String) {
        use std::io::{BufRead, BufReader};
        let mut up = Command::new(env!("CARGO_BIN_EXE_kvfabric"))
            .args(["up", "--engine", "mock", "--port", "0", "--disk-blocks", "0"])
            .args(extra)
            .env_remove("KVFABRIC_CONFIG")
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(up.stdout.take().unwrap()).lines();
        let first = lines.next().unwrap().unwrap();
        std::thread::spawn(move || lines.for_each(drop));
        let url = first.split(" at ").nth(1).unwrap().trim().to_string();
        let addr = url.trim_start_matches("http://").trim_end_matches("/v1").to_string();
        (Kill(up), addr, first)
    }
}

/// 20,000 idle connections against `kvfabric up`: the listener holds at most its cap (plus a
/// small reserve), closes the rest at once, and `/health` keeps answering; a client that
/// never completes its request head is cut off at the header timeout.
#[test]
fn twenty_thousand_idle_connections_leave_health_answering() {
    use std::io::{BufRead, BufReader, Read};
    use std::net::TcpStream;
    use std::time::{Duration, Instant};
    let (_up, addr) =
        Up::start(&["--max-connections", "256", "--header-timeout-s", "2"], Stdio::null());
    let port = addr.rsplit(':').next().unwrap().to_string();

    // Two helpers hold 10,000 idle connections each (one process may not hold 20,000
    // descriptors here).
    let hold = "import socket,sys,time\n\
                s=[]\n\
                for _ in range(10000):\n\
                \x20   c=socket.socket(); c.connect(('127.0.0.1',int(sys.argv[1]))); s.append(c)\n\
                print(len(s),flush=True)\n\
                time.sleep(120)\n";
    let holders: Vec<Kill> = (0..2)
        .map(|_| {
            Kill(
                Command::new("python3")
                    .args(["-c", hold, &port])
                    .stdout(Stdio::piped())
                    .stderr(Stdio::inherit())
                    .spawn()
                    .unwrap(),
            )
        })
        .collect();
    let t0 = Instant::now();
    let mut held = 0;
    let mut holders = holders;
    for h in &mut holders {
        let mut line = String::new();
        BufReader::new(h.0.stdout.take().unwrap()).read_line(&mut line).unwrap();
        held += line.trim().parse::<usize>().unwrap();
    }
    assert_eq!(held, 20_000);
    eprintln!("20,000 connections open after {:?}", t0.elapsed());

    let get = |path: &str| -> Option<String> {
        let mut s = TcpStream::connect(&addr).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
        use std::io::Write;
        write!(s, "GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").ok()?;
        let mut out = String::new();
        s.read_to_string(&mut out).ok()?;
        out.starts_with("HTTP/1.1 200").then_some(out)
    };
    let start = Instant::now();
    while get("/health").is_none() {
        assert!(start.elapsed() < Duration::from_secs(5), "/health did not answer within 5 s");
        std::thread::sleep(Duration::from_millis(100));
    }

    // A request head that never completes is closed at the header timeout.
    let mut slow = TcpStream::connect(&addr).unwrap();
    slow.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    use std::io::Write;
    slow.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\n").unwrap();
    let start = Instant::now();
    let mut buf = [0u8; 256];
    let n = slow.read(&mut buf);
    assert!(start.elapsed() < Duration::from_secs(8), "slow client held {:?}", start.elapsed());
    assert!(!matches!(n, Ok(k) if k > 0 && buf.starts_with(b"HTTP/1.1 200")), "no answer");

    let metrics = loop {
        if let Some(m) = get("/metrics") {
            break m;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let refused = metrics
        .lines()
        .find_map(|l| l.strip_prefix("kvfabric_http_connections_refused_total "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .unwrap();
    // The cap held: most of the 20,000 were closed at once (the rest timed out in the pool).
    assert!(refused > 5_000.0, "refused {refused}");
    eprintln!("refused {refused}, whole test {:?}", t0.elapsed());
    drop(holders);
}

/// An engine that dies takes `up` out of service: the panic is logged with its cause, the
/// process exits non-zero (for a supervisor to restart it) instead of answering `stopped`
/// forever while its health says ok.
#[test]
fn a_dead_engine_is_logged_and_the_process_exits_non_zero() {
    use std::io::{Read, Write};
    use std::time::{Duration, Instant};
    let (mut up, addr) =
        Up::start(&["--mock-panic-at-step", "2", "--mock-decode-us", "100"], Stdio::piped());
    let body = r#"{"model": "mock", "prompt": "hello there", "max_tokens": 8}"#;
    let mut s = std::net::TcpStream::connect(&addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut answer = String::new();
    let _ = s.read_to_string(&mut answer);
    assert!(!answer.starts_with("HTTP/1.1 200"), "{answer}");
    let start = Instant::now();
    let status = loop {
        if let Some(st) = up.0.try_wait().unwrap() {
            break st;
        }
        assert!(start.elapsed() < Duration::from_secs(20), "up still running");
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    up.0.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    assert!(!status.success(), "{status}");
    assert!(err.contains("the engine thread panicked") && err.contains("injected fault"), "{err}");
}

/// One HTTP/1.1 exchange over a plain socket; the response's body as JSON.
fn post_json(addr: &str, path: &str, body: &serde_json::Value) -> serde_json::Value {
    use std::io::{Read, Write};
    let body = body.to_string();
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(30))).unwrap();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let (_, body) = answer.split_once("\r\n\r\n").unwrap();
    serde_json::from_str(body).unwrap()
}

/// `kvfabric model-dir` writes a model directory from the GGUF's vocabulary; the mock serving
/// it counts tokens with that tokenizer (the real model's count for the same chat, not one per
/// byte), keeps the KV bytes of its config.json (4 layers × 8 KV heads × 64, bf16: 8 KiB per
/// token, 128 KiB per block), and answers with words of the vocabulary.
#[test]
fn the_mock_mirrors_a_model_directory() {
    let model = std::env::var("KVFABRIC_TEST_MODEL").unwrap_or_else(|_| {
        format!(
            "{}/.cache/kvfabric/models/SmolLM2-135M-Instruct.Q4_1.gguf",
            std::env::var("HOME").unwrap()
        )
    });
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("mock-model");
    let out = kvfabric(&["model-dir", "--from", &model, "--out", out_dir.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("8192 B of KV per token"));
    for f in ["tokenizer.json", "tokenizer_config.json", "config.json"] {
        assert!(out_dir.join(f).is_file(), "{f} missing");
    }
    let (_up, addr, ready) = Up::start_with_line(
        &["--model-dir", out_dir.to_str().unwrap(), "--mock-decode-us", "100"],
        Stdio::null(),
    );
    assert!(ready.contains("131072 B blocks"), "{ready}");
    let chat = serde_json::json!({
        "model": "mock", "max_tokens": 12, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
    });
    let r = post_json(&addr, "/v1/chat/completions", &chat);
    // What SmolLM2's tokenizer and template make of this chat (the README's example).
    assert_eq!(r["usage"]["prompt_tokens"], 37, "{r}");
    assert_eq!(r["usage"]["completion_tokens"], 12, "{r}");
    let text = r["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(text.split_whitespace().count() >= 6, "not words of the vocabulary: {text:?}");
    // The same chat again: its blocks come back from the cache, same answer.
    let again = post_json(&addr, "/v1/chat/completions", &chat);
    assert_eq!(again["choices"][0]["message"]["content"], text);
    assert_eq!(again["usage"]["prompt_tokens_details"]["cached_tokens"], 32, "{again}");
}

/// `kvfabric profile` of the mock in process writes a profile and a plot that
/// `kvfabric plan --sla` reads; bad profiles and bad targets are refused with the reason.
#[test]
fn profile_then_plan_with_an_sla() {
    let dir = tempfile::tempdir().unwrap();
    let (json, svg) = (dir.path().join("p.json"), dir.path().join("p.svg"));
    let out = kvfabric(&[
        "profile",
        "--engine",
        "mock",
        "--prompts",
        "64,256",
        "--batches",
        "1,4",
        "--contexts",
        "128",
        "--decode-tokens",
        "8",
        "--reps",
        "1",
        "--tiers",
        "host,disk",
        "--disk-blocks",
        "0",
        "--data-dir",
        dir.path().to_str().unwrap(),
        "--out",
        json.to_str().unwrap(),
        "--plot",
        svg.to_str().unwrap(),
        "--json",
    ]);
    let p = stdout_json(&out);
    assert_eq!(p["version"], 1);
    assert_eq!(p["prefill"].as_array().unwrap().len(), 4, "cold and half cached, two lengths");
    assert_eq!(p["decode"].as_array().unwrap().len(), 2);
    assert_eq!(p["restore"].as_array().unwrap().len(), 2);
    assert_eq!(p["kv_bytes_per_token"], 737_280 / 16, "SmolLM2's KV in f32");
    let plot = std::fs::read_to_string(&svg).unwrap();
    assert!(plot.starts_with("<svg") && plot.contains("Decode: inter-token latency"));
    let plan = stdout_json(&kvfabric(&[
        "plan",
        "--sla",
        "--profile",
        json.to_str().unwrap(),
        "--rate",
        "10",
        "--isl",
        "64..448",
        "--osl",
        "32",
        "--ttft-ms",
        "400",
        "--itl-ms",
        "30",
        "--json",
    ]));
    let workers = plan["workers"].as_u64().unwrap();
    assert!(workers >= 1, "{plan}");
    assert!(["aggregated", "disaggregated"].contains(&plan["layout"].as_str().unwrap()));
    assert!(!plan["plan"]["reasons"].as_array().unwrap().is_empty());
    assert!(!plan["what_changes"].as_array().unwrap().is_empty());
    // Refusals.
    std::fs::write(dir.path().join("bad.json"), r#"{"version": 9}"#).unwrap();
    let bad =
        kvfabric(&["plan", "--sla", "--profile", dir.path().join("bad.json").to_str().unwrap()]);
    assert!(one_line_error(&bad).contains("this build reads version 1"));
    let bad =
        kvfabric(&["plan", "--sla", "--profile", json.to_str().unwrap(), "--percentile", "p100"]);
    assert!(one_line_error(&bad).contains("--percentile"));
    assert_eq!(plan["workload"]["isl"], 256.0, "the range's middle");
    assert_eq!(plan["workload"]["isl_dist"]["kind"], "uniform");
    let bad =
        kvfabric(&["plan", "--sla", "--profile", json.to_str().unwrap(), "--isl", "900..100"]);
    assert!(one_line_error(&bad).contains("LO must be below HI"));
    let bad = kvfabric(&["plan", "--sla"]);
    assert!(!bad.status.success(), "--sla needs --profile");
    // Service classes: each class's load and targets; with classes (served by urgency) the
    // plan names a worker count at which every class's estimate is within its targets, and
    // never more than first come first served needs for the same mix.
    let profile = json.to_str().unwrap();
    let classes = stdout_json(&kvfabric(&[
        "plan",
        "--sla",
        "--profile",
        profile,
        "--class-load",
        "interactive:rate=2,isl=64,osl=16,ttft=200ms,itl=60ms",
        "--class-load",
        "batch:rate=8,isl=64..448,osl=32,ttft=20s",
        "--json",
    ]));
    let (with, fcfs) = (&classes["plan"]["with_classes"], &classes["plan"]["first_come"]);
    let n = with[0].as_u64().unwrap_or_else(|| panic!("{classes}"));
    assert!(fcfs[0].as_u64().is_none_or(|m| m >= n), "{classes}");
    let est = with[1].as_array().unwrap();
    assert_eq!(est[0]["name"], "interactive", "most urgent first: {classes}");
    assert!(est[0]["ttft_s"].as_f64().unwrap() <= 0.2, "{classes}");
    assert!(est[1]["ttft_s"].as_f64().unwrap() <= 20.0, "{classes}");
    // And in prefill and decode pools: each class's TTFT on the prefill workers within its
    // target, a decode pool for the mix.
    let pools = &classes["pools"];
    let est = pools["prefill"][1].as_array().unwrap_or_else(|| panic!("{classes}"));
    assert!(pools["prefill"][0].as_u64().is_some_and(|n| n >= 1), "{classes}");
    assert!(est[0]["ttft_s"].as_f64().unwrap() <= 0.2, "{classes}");
    assert!(pools["decode"].as_u64().is_some_and(|n| n >= 1), "{classes}");
    let bad = kvfabric(&["plan", "--sla", "--profile", profile, "--class-load", "x:rate=1,isl=64"]);
    assert!(one_line_error(&bad).contains("osl is required"), "{bad:?}");
    let bad = kvfabric(&["plan", "--sla", "--profile", profile, "--class-load", "x:speed=1"]);
    assert!(one_line_error(&bad).contains("unknown key"), "{bad:?}");
    // The same profile sizes workers for a trace: the model's plan, then replays; the count
    // it names met the targets and one fewer did not.
    let slice = trace_slice(dir.path(), 300);
    let sized = stdout_json(&kvfabric(&[
        "plan",
        "--trace",
        slice.to_str().unwrap(),
        "--sla",
        "--profile",
        json.to_str().unwrap(),
        "--workers",
        "1",
        "--cache-tokens",
        "262144",
        "--ttft-ms",
        "3000",
        "--itl-ms",
        "100",
        "--percentile",
        "p90",
        "--json",
    ]));
    assert_eq!(sized["requests"], 300, "{sized}");
    let rate = sized["workload"]["rate"].as_f64().unwrap();
    assert!(rate > 1.0 && rate < 10.0, "the slice's own rate: {sized}");
    let replays = sized["replays"].as_array().unwrap();
    let n = sized["workers"].as_u64().expect("a count that meets the targets");
    let of = |w: u64| replays.iter().find(|r| r["workers"] == w);
    assert_eq!(of(n).unwrap()["meets"], true, "{sized}");
    assert!(n == 1 || of(n - 1).is_some_and(|r| r["meets"] == false), "{sized}");
    for r in replays {
        let t = r["ttft_s"].as_f64().unwrap();
        assert_eq!(r["meets"], t <= 3.0 && r["itl_s"].as_f64().unwrap() <= 0.1, "{r}");
    }
}

/// The first `n` lines of the shipped conversation trace, in a file of their own.
fn trace_slice(dir: &std::path::Path, n: usize) -> std::path::PathBuf {
    let shipped = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../benches/traces/conversation_trace.jsonl");
    let text = std::fs::read_to_string(shipped).unwrap();
    let path = dir.join("slice.jsonl");
    let lines: Vec<&str> = text.lines().take(n).collect();
    std::fs::write(&path, lines.join("\n")).unwrap();
    path
}

#[test]
fn bench_trace_and_plan_trace_replay_real_traffic_and_name_a_bad_line() {
    let dir = tempfile::tempdir().unwrap();
    let slice = trace_slice(dir.path(), 400);
    let slice = slice.to_str().unwrap();
    let v = stdout_json(&kvfabric(&[
        "bench",
        "trace",
        slice,
        "--g1-tokens",
        "131072",
        "--g4-tokens",
        "4194304",
        "--plot",
        dir.path().join("trace.svg").to_str().unwrap(),
        "--json",
    ]));
    let svg = std::fs::read_to_string(dir.path().join("trace.svg")).unwrap();
    for title in ["Prompt tokens reused", "TTFT by arrival", "KV moved"] {
        assert!(svg.contains(title), "{title} missing from the plot");
    }
    let runs = v["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2, "kv and round-robin beside it");
    assert_eq!(runs[0]["routing"], "kv");
    assert_eq!(runs[1]["routing"], "roundrobin");
    for r in runs {
        assert_eq!(r["requests"], 400);
        let (reuse, of) = (r["reuse"].as_f64().unwrap(), r["reuse_of_limit"].as_f64().unwrap());
        assert!(reuse > 0.0 && of <= 1.0 + 1e-9, "{r}");
        assert!(r["ttft_s"][0].as_f64().unwrap() >= 0.0);
    }
    let plan = stdout_json(&kvfabric(&[
        "plan",
        "--trace",
        slice,
        "--model",
        "llama-3.1-70b",
        "--workers",
        "4",
        "--cache-tokens",
        "65536,1048576",
        "--plot",
        dir.path().join("plan.svg").to_str().unwrap(),
        "--json",
    ]));
    let svg = std::fs::read_to_string(dir.path().join("plan.svg")).unwrap();
    assert!(svg.contains("Prompt tokens reused against cache size") && svg.contains("limit"));
    assert!(!plan["pooled_curve"].as_array().unwrap().is_empty());
    let points = plan["points"].as_array().unwrap();
    assert_eq!(points.len(), 2);
    let reuse = |i: usize, k: &str| points[i][k].as_f64().unwrap();
    assert!(reuse(1, "local_reuse") >= reuse(0, "local_reuse"));
    assert!(reuse(1, "pooled_reuse") >= reuse(1, "local_round_robin_reuse"));
    assert_eq!(points[1]["pooled_tokens"], 4 * 1048576);
    assert!(plan["pooled_for"][0].as_u64().unwrap() > 0);
    // A malformed line is named, in one line, for both commands.
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(
        &bad,
        "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1]}\n{\"timestamp\": 1, \"input_length\": 10}\n",
    )
    .unwrap();
    let e = one_line_error(&kvfabric(&["bench", "trace", bad.to_str().unwrap()]));
    assert!(e.contains("trace line 2"), "{e}");
    let e = one_line_error(&kvfabric(&["plan", "--trace", bad.to_str().unwrap()]));
    assert!(e.contains("trace line 2"), "{e}");
    // Settings out of range are named before any replay.
    for (flag, value) in [("--load-report-ms", "0.5"), ("--g1-tier", "gpu"), ("--batch-max", "0")] {
        let e = one_line_error(&kvfabric(&["bench", "trace", bad.to_str().unwrap(), flag, value]));
        assert!(e.contains(flag), "{flag} {value}: {e}");
    }
    let e = one_line_error(&kvfabric(&["plan", "--trace", slice, "--block-tokens", "0"]));
    assert!(e.contains("--block-tokens"), "{e}");
    // A prompt longer than the longest accepted (1M tokens by default) is refused with its
    // line, for both commands; --max-prompt-tokens raises the bound.
    let long = dir.path().join("long.jsonl");
    let ids: Vec<String> = (0..4096).map(|i| i.to_string()).collect();
    std::fs::write(
        &long,
        format!(
            "{{\"timestamp\": 0, \"input_length\": 512, \"output_length\": 1, \"hash_ids\": [1]}}\n\
             {{\"timestamp\": 1, \"input_length\": 2097152, \"output_length\": 1, \"hash_ids\": [{}]}}\n",
            ids.join(",")
        ),
    )
    .unwrap();
    let long = long.to_str().unwrap();
    for args in [&["bench", "trace", long][..], &["plan", "--trace", long]] {
        let e = one_line_error(&kvfabric(args));
        assert!(e.contains("trace line 2") && e.contains("--max-prompt-tokens"), "{e}");
    }
    let v = stdout_json(&kvfabric(&[
        "bench",
        "trace",
        long,
        "--max-prompt-tokens",
        "2097152",
        "--workers",
        "1",
        "--json",
    ]));
    assert_eq!(v["runs"][0]["requests"], 2);
}

#[test]
fn bench_serve_replays_a_trace_online_and_the_server_finds_its_shared_prefixes() {
    let dir = tempfile::tempdir().unwrap();
    // 16-token ids: kvfabric's own block size, so every shared id is a shared block.
    let trace = dir.path().join("t.jsonl");
    let reqs = [
        (0, 32, "[1, 2]"),
        (150, 48, "[1, 2, 3]"),
        (300, 64, "[1, 2, 3, 4]"),
        (450, 20, "[5, 6]"),
        (600, 80, "[1, 2, 3, 4, 7]"),
    ];
    let text: Vec<String> = reqs
        .iter()
        .map(|(t, n, ids)| {
            format!("{{\"timestamp\": {t}, \"input_length\": {n}, \"output_length\": 4, \"hash_ids\": {ids}}}")
        })
        .collect();
    std::fs::write(&trace, text.join("\n")).unwrap();
    let (mut up, url, _stdout) = mock_up();
    let out = kvfabric(&[
        "bench",
        "serve",
        "--url",
        &url,
        "--trace",
        trace.to_str().unwrap(),
        "--trace-block-tokens",
        "16",
        "--vocab",
        "256",
        "--json",
    ]);
    let _ = up.kill();
    let _ = up.wait();
    let v = stdout_json(&out);
    assert_eq!(v["requests"], 5, "{v}");
    assert_eq!(v["errors"], 0, "{v}");
    assert_eq!(v["prompt_tokens"], 32 + 48 + 64 + 20 + 80, "{v}");
    // The limit: 2 + 3 + 4 reused ids of 16 tokens.
    assert_eq!(v["limit"]["reused_tokens"], 144, "{v}");
    let cached = v["cached_tokens"].as_u64().unwrap();
    assert!((64..=144).contains(&cached), "the server found the shared prefixes: {v}");
    let tiers: u64 =
        v["cached_per_tier"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).sum();
    assert!(tiers > 0, "kvfabric says where its hits came from: {v}");
}

/// A worker on loopback while the control plane is on another host would register an address
/// that no other host can dial: refused at start, before the control plane is contacted (the
/// endpoints are documentation addresses; nothing is sent to them).
#[test]
fn a_worker_on_loopback_with_a_remote_control_plane_is_refused_at_start() {
    let out = kvfabric(&[
        "worker",
        "--engine",
        "mock",
        "--secret",
        "a-secret",
        "--listen",
        "127.0.0.1:0",
        "--etcd",
        "http://192.0.2.10:2379",
        "--nats",
        "nats://192.0.2.10:4222",
    ]);
    assert!(!out.status.success(), "a worker on loopback started");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("the request port listens on 127.0.0.1:0, which no other host can dial")
            && err.contains("--advertise"),
        "{err}"
    );
}
