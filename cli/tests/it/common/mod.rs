//! Helpers of the binary's tests: `kvfabric::testkit::http` (HTTP client, waits) and
//! `kvfabric worker` processes.

#![allow(dead_code)]

pub use kvfabric::testkit::http::*;

use serde_json::Value;

/// A child process, killed (-9) and reaped when dropped.
#[derive(Debug)]
pub struct Proc(pub std::process::Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `cmd` and returns it with the first line it prints on stdout (its later output is
/// drained, so that it never blocks on a full pipe).
pub fn spawn_line(cmd: &mut std::process::Command) -> (Proc, String) {
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::inherit()).spawn().expect("spawn");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let line = lines.next().expect("printed nothing").unwrap();
    std::thread::spawn(move || for _ in lines {});
    (Proc(child), line)
}

/// Starts `kvfabric worker --name NAME ARGS...` and returns it with the JSON line it prints
/// once it serves.
pub fn spawn_worker<S: AsRef<std::ffi::OsStr>>(name: &str, args: &[S]) -> (Proc, Value) {
    let (proc, line) = spawn_line(
        std::process::Command::new(env!("CARGO_BIN_EXE_kvfabric"))
            .args(["worker", "--name", name])
            .args(args)
            .env_remove("KVFABRIC_CONFIG"),
    );
    let v: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"));
    assert_eq!(v["worker"], name, "{line}");
    (proc, v)
}

/// The arguments of a mock worker in namespace `ns` of the deployment at `etcd` and `nats`
/// with `secret` and no disk tier; a test adds its own.
pub fn mock_worker_args(ns: &str, etcd: &str, nats: &str, secret: &str) -> Vec<String> {
    let args = ["--namespace", ns, "--etcd", etcd, "--nats", nats, "--secret", secret];
    let mock = ["--engine", "mock", "--disk-blocks", "0"];
    args.into_iter().chain(mock).map(String::from).collect()
}

/// Stops process `pid` (SIGSTOP) and waits until every thread of it is stopped. The kernel
/// hands a stop signal to one thread, which then stops the others: on a busy machine that
/// thread may wait for a core while the others run on, and a worker frozen with `kill -STOP`
/// once answered requests sent after `kill` had returned.
pub fn freeze(pid: u32) {
    let sent = std::process::Command::new("kill").args(["-STOP", &pid.to_string()]).status();
    assert!(sent.is_ok_and(|s| s.success()), "kill -STOP {pid}");
    let stopped = |stat: &str| {
        // The state follows the command's name in parentheses (which may hold anything).
        stat.rsplit_once(')')
            .is_none_or(|(_, rest)| rest.trim_start().starts_with(['T', 't', 'Z', 'X']))
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let all = std::fs::read_dir(format!("/proc/{pid}/task")).map(|tasks| {
            tasks.flatten().all(|t| {
                // A thread that is gone is not running.
                std::fs::read_to_string(t.path().join("stat")).map_or(true, |s| stopped(&s))
            })
        });
        if all.unwrap_or(false) {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "process {pid} did not stop in 10 s");
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
}

/// The kvfabric shared regions process `pid` holds: its descriptors that are kvfabric memfds,
/// as `(path peers open, memfd name)`.
pub fn shared_regions(pid: u32) -> Vec<(String, String)> {
    let dir = format!("/proc/{pid}/fd");
    std::fs::read_dir(&dir)
        .map(|d| {
            d.flatten()
                .filter_map(|e| {
                    let target = std::fs::read_link(e.path()).ok()?;
                    let name = target.to_str()?.strip_prefix("/memfd:kvfabric.")?.to_string();
                    Some((e.path().display().to_string(), name))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// What `/dev/shm` holds of kvfabric's (earlier versions put shared regions there).
pub fn dev_shm_files() -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().to_string())
                .filter(|n| n.starts_with("kvfabric."))
                .collect()
        })
        .unwrap_or_default()
}

/// A `kvfabric frontend` process named `name` in `namespace` over the etcd and NATS servers
/// at `etcd` and `nats`, on a free port; its address.
pub fn spawn_frontend(
    name: &str,
    namespace: &str,
    secret: &str,
    etcd: &str,
    nats: &str,
) -> (Proc, std::net::SocketAddr) {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_kvfabric"));
    cmd.args(["frontend", "--port", "0", "--namespace", namespace, "--secret", secret])
        .args(["--name", name, "--etcd", etcd, "--nats", nats]);
    let (proc, addr, _) = spawn_server(cmd);
    (proc, addr)
}

/// Starts `cmd`, a server that prints `kvfabric WHAT at http[s]://ADDR/v1` first, and returns
/// it with its address and that line.
pub fn spawn_server(mut cmd: std::process::Command) -> (Proc, std::net::SocketAddr, String) {
    let (proc, line) = spawn_line(cmd.env_remove("KVFABRIC_CONFIG"));
    let addr = line
        .rsplit_once("at http://")
        .or_else(|| line.rsplit_once("at https://"))
        .and_then(|(_, r)| r.trim().strip_suffix("/v1"))
        .unwrap_or_else(|| panic!("{line}"))
        .parse()
        .unwrap();
    (proc, addr, line)
}
