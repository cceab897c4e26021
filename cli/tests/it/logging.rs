//! The binary logs: `kvfabric up` writes the libraries' `tracing` events to stderr, as JSON
//! lines with `--log-format json`, filtered by `--log-level`; a corrupt block on disk is a
//! warning that names the block.

use crate::common;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};

use kvfabric_tiers::disk::format::{SlotHeader, SlotLayout, MAGIC_BYTES};
use serde_json::{json, Value};

/// `kvfabric ARGS` with stdout and stderr piped, free of the environment's configuration
/// and log level.
fn kvfabric_piped(args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvfabric"));
    cmd.args(args)
        .env_remove("KVFABRIC_CONFIG")
        .env_remove("RUST_LOG")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

/// A `kvfabric up` process whose stderr lines are collected.
struct Up {
    child: Child,
    addr: SocketAddr,
    log: Arc<Mutex<Vec<String>>>,
}

impl Up {
    fn start(data_dir: &Path, level: &str) -> Up {
        let mut child = kvfabric_piped(&["up", "--engine", "mock", "--port", "0"])
            .args(["--name", "logtest"])
            .args(["--host-blocks", "4", "--disk-blocks", "1024", "--mock-decode-us", "100"])
            // Every evicted block goes to disk (by default only reused ones do).
            .args(["--disk-admit-min-hits", "0"])
            .arg("--data-dir")
            .arg(data_dir)
            .args(["--log-format", "json", "--log-level", level])
            .spawn()
            .unwrap();
        let log = Arc::new(Mutex::new(Vec::new()));
        let sink = log.clone();
        let stderr = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                sink.lock().unwrap().push(line);
            }
        });
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let first = lines.next().expect("up printed nothing").unwrap();
        let url = first.split(" at http://").nth(1).expect("the serving line").trim();
        let addr: SocketAddr = url.trim_end_matches("/v1").parse().unwrap();
        std::thread::spawn(move || for _ in lines {});
        Up { child, addr, log }
    }

    /// Stops it with SIGTERM (graceful) and returns its log lines, parsed.
    fn stop(mut self) -> Vec<Value> {
        let term = Command::new("kill").args(["-TERM", &self.child.id().to_string()]).status();
        assert!(term.unwrap().success());
        let status = self.child.wait().unwrap();
        assert!(status.success(), "up exited with {status}");
        // The reader thread sees EOF once the process is gone; give it a moment to drain.
        common::wait_until(std::time::Duration::from_secs(5), || {
            self.log.lock().unwrap().last().is_some_and(|l| l.contains("kvfabric stopped"))
        });
        let lines = self.log.lock().unwrap().clone();
        lines
            .iter()
            .map(|l| {
                serde_json::from_str(l).unwrap_or_else(|e| panic!("not a JSON log line ({e}): {l}"))
            })
            .collect()
    }
}

fn messages(log: &[Value]) -> Vec<String> {
    log.iter().map(|l| l["fields"]["message"].as_str().unwrap_or("").to_string()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_logs_json_lines_and_a_corrupt_disk_block_is_a_warning_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let prompt: String = (0..400).map(|i| format!("w{} ", i % 37)).collect();
    let body = json!({ "model": "mock", "prompt": prompt, "max_tokens": 4 });

    // First run: the prompt's blocks go to the disk tier (4 host blocks, written back).
    let up = Up::start(dir.path(), "debug");
    let r = common::post_json(up.addr, "/v1/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let slots = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|x| x == "slots"))
        .expect("a slot file");
    // Written back in the background: wait until some blocks are on disk.
    let on_disk = |p: &Path| {
        let bytes = std::fs::read(p).unwrap();
        bytes.chunks(4096).filter(|page| page.starts_with(&MAGIC_BYTES)).count()
    };
    common::wait_until(std::time::Duration::from_secs(20), || on_disk(&slots) >= 4);
    let log = up.stop();
    let msgs = messages(&log);
    for expected in [
        "listening: kvfabric is serving",
        "block store: host tier allocated",
        "disk tier open",
        "request admitted",
        "control plane: embedded",
        "kvfabric stopped",
    ] {
        assert!(msgs.iter().any(|m| m.starts_with(expected)), "no {expected:?} line in {msgs:#?}");
    }
    assert!(log.iter().all(|l| l["level"].is_string() && l["target"].is_string()));
    assert!(
        log.iter().any(|l| l["level"] == "DEBUG"
            && l["target"].as_str().unwrap().starts_with("kvfabric_engine")),
        "debug events of the engine are shown at --log-level debug"
    );

    // Corrupt the data of every block on disk (headers intact: found at restart, dropped
    // when read): each header says its block's size, its page says which slot it is.
    {
        use std::os::unix::fs::FileExt;
        let bytes = std::fs::read(&slots).unwrap();
        let f = std::fs::OpenOptions::new().write(true).open(&slots).unwrap();
        let mut corrupted = 0;
        for (i, page) in bytes.chunks(4096).enumerate() {
            let Some(h) = SlotHeader::decode(page) else { continue };
            let layout = SlotLayout::new(h.block_bytes);
            let slot = (0..=i as u32).find(|&s| layout.header_offset(s) == i as u64 * 4096);
            let slot = slot.expect("a header page lies where a slot's header does");
            f.write_at(&[0xa5; 32], layout.data_offset(slot) + 64).unwrap();
            corrupted += 1;
        }
        assert!(corrupted >= 4, "{corrupted} blocks corrupted");
    }

    // Second run, at the default level: the same prompt reads its first block from disk.
    let up = Up::start(dir.path(), "info");
    let r = common::post_json(up.addr, "/v1/completions", &body).await;
    assert_eq!(r.status, 200, "a corrupt cached block is recomputed: {}", r.text());
    // Counted too.
    let m = common::get(up.addr, "/metrics").await.text();
    assert!(common::metric(&m, "kvfabric_kv_disk_corrupt_blocks_total") >= 1.0, "{m}");
    let log = up.stop();
    let corrupt: Vec<&Value> =
        log.iter().filter(|l| l["fields"]["message"] == "corrupt block on disk dropped").collect();
    assert!(!corrupt.is_empty(), "no warning for the corrupt block: {log:#?}");
    for w in corrupt {
        assert_eq!(w["level"], "WARN");
        let hash = w["fields"]["hash"].as_str().expect("the warning names the block's hash");
        assert!(!hash.is_empty());
    }
    assert!(!log.iter().any(|l| l["level"] == "DEBUG"), "--log-level info hides debug events");
}

#[test]
fn a_bad_log_level_is_one_line_and_non_zero() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvfabric"))
        .args(["--log-level", "kvfabric=nonsense[", "plan", "--model", "smollm2-135m"])
        .env_remove("KVFABRIC_CONFIG")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--log-level"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
}

/// `kvfabric frontend --nats ... --log-level trace` with extra arguments: the first stdout
/// line (or None when it exited first), and every line it wrote on stderr.
fn frontend_with_nats(args: &[&str]) -> (Option<String>, String) {
    let mut child =
        kvfabric_piped(&["frontend", "--port", "0", "--secret", "nats-log-test-secret"])
            .args(["--name", "natslog", "--log-level", "trace"])
            .args(args)
            .spawn()
            .unwrap();
    let stderr = child.stderr.take().unwrap();
    let log = std::thread::spawn(move || {
        let mut all = String::new();
        std::io::Read::read_to_string(&mut BufReader::new(stderr), &mut all).unwrap();
        all
    });
    let first = BufReader::new(child.stdout.take().unwrap()).lines().next().and_then(Result::ok);
    let _ = child.kill();
    child.wait().unwrap();
    (first, log.join().unwrap())
}

/// NATS credentials in the URL work against a nats-server that requires them (they once
/// failed with "authorization violation"), and so do a user with a password file and a token
/// file; at `trace` level no password or token reaches the log, where the client library
/// once wrote its connect options. A wrong password fails with the server's reason, and
/// without the password.
#[test]
fn nats_credentials_connect_and_never_reach_the_log() {
    use kvfabric::testkit::NatsServer;
    let password = "pw-9f3c1e77-secret";
    let nats = NatsServer::start_with_user("kvf", password).unwrap();
    let port = nats.url().rsplit(':').next().unwrap().to_string();
    let url = format!("nats://kvf:{password}@127.0.0.1:{port}");
    let (first, log) = frontend_with_nats(&["--nats", &url]);
    assert!(first.is_some_and(|l| l.contains("kvfabric frontend at")), "{log}");
    assert!(log.contains("event bus: NATS") && log.contains("DEBUG"), "{log}");
    assert!(!log.contains(password), "the password is in the log:\n{log}");

    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("nats.password");
    std::fs::write(&file, format!("{password}\n")).unwrap();
    let args = ["--nats", &nats.url(), "--nats-user", "kvf", "--nats-password-file"];
    let (first, log) = frontend_with_nats(&[&args[..], &[file.to_str().unwrap()]].concat());
    assert!(first.is_some(), "{log}");
    assert!(!log.contains(password), "{log}");

    let wrong = format!("nats://kvf:not-{password}@127.0.0.1:{port}");
    let (first, log) = frontend_with_nats(&["--nats", &wrong]);
    assert!(first.is_none(), "connected with a wrong password: {log}");
    assert!(log.contains("authorization violation"), "{log}");
    assert!(!log.contains(password), "{log}");

    let token = "tok-51d0aa93-secret";
    let nats = NatsServer::start_with_token(token).unwrap();
    let file = dir.path().join("nats.token");
    std::fs::write(&file, token).unwrap();
    let args = ["--nats", &nats.url(), "--nats-token-file", file.to_str().unwrap()];
    let (first, log) = frontend_with_nats(&args);
    assert!(first.is_some(), "{log}");
    assert!(!log.contains(token), "{log}");
    let (first, log) = frontend_with_nats(&[
        "--nats",
        &format!("nats://{token}@127.0.0.1:{}", nats.url().rsplit(':').next().unwrap()),
    ]);
    assert!(first.is_some(), "{log}");
    assert!(!log.contains(token), "{log}");
}
