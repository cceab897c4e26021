//! Real etcd and NATS servers for integration tests of any crate (feature `testkit`).
//!
//! Each server runs as a child process on free loopback ports with a temporary data
//! directory, is waited for until it accepts connections, can be restarted on the same ports
//! and data (to test reconnection), and is killed when dropped. The binaries come from the
//! Debian packages `etcd-server` and `nats-server`, which `scripts/test.sh` installs.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A free loopback port for a server that may be killed and restarted on it, chosen below
/// the kernel's ephemeral range: a port from `bind(":0")` is one the kernel hands out again
/// to any outgoing connection or `bind(":0")` of any process, so while the server is down
/// (a test's outage) another test could take it and the restart would fail. Ports below the
/// range are only ever taken by name. Falls back to an ephemeral port when none is found.
fn free_port() -> std::io::Result<u16> {
    use std::hash::{BuildHasher, Hasher};
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    const FIRST: u16 = 10_000;
    if low > FIRST + 100 {
        let span = u64::from(low - FIRST);
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        let start = h.finish() % span;
        for i in 0..span.min(512) {
            let port = FIRST + ((start + i * 7919) % span) as u16;
            if TcpListener::bind(("127.0.0.1", port)).is_ok() {
                return Ok(port);
            }
        }
    }
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn find(binary: &str) -> std::io::Result<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/usr/bin"), PathBuf::from("/usr/local/bin")])
        .map(|d| d.join(binary))
        .find(|p| p.is_file())
        .ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!("{binary} not found: run scripts/test.sh, which installs etcd-server and nats-server"),
            )
        })
}

fn wait_ready(addr: SocketAddr, child: &mut Child, what: &str) -> std::io::Result<()> {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(30) {
        if let Some(status) = child.try_wait()? {
            return Err(std::io::Error::other(format!("{what} exited at start: {status}")));
        }
        if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Err(std::io::Error::other(format!("{what} not ready on {addr} after 30 s")))
}

/// A server process, killed (SIGKILL) when dropped.
#[derive(Debug, Default)]
struct ServerProcess(Option<Child>);

impl ServerProcess {
    fn kill(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A real etcd server.
#[derive(Debug)]
pub struct EtcdServer {
    child: ServerProcess,
    dir: tempfile::TempDir,
    client_port: u16,
    peer_port: u16,
}

impl EtcdServer {
    /// Starts etcd on free loopback ports.
    pub fn start() -> std::io::Result<Self> {
        let mut s = EtcdServer {
            child: ServerProcess::default(),
            dir: tempfile::tempdir()?,
            client_port: free_port()?,
            peer_port: free_port()?,
        };
        s.spawn()?;
        Ok(s)
    }

    fn spawn(&mut self) -> std::io::Result<()> {
        let client = format!("http://127.0.0.1:{}", self.client_port);
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let mut child = Command::new(find("etcd")?)
            .args(["--name", "kvfabric-test", "--data-dir"])
            .arg(self.dir.path().join("data"))
            .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("kvfabric-test={peer}")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        wait_ready(SocketAddr::from(([127, 0, 0, 1], self.client_port)), &mut child, "etcd")?;
        self.child = ServerProcess(Some(child));
        Ok(())
    }

    /// The client endpoint (`http://127.0.0.1:PORT`).
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    /// Kills the server (SIGKILL).
    pub fn kill(&mut self) {
        self.child.kill();
    }

    /// Kills and starts it again on the same ports and data.
    pub fn restart(&mut self) -> std::io::Result<()> {
        self.kill();
        self.spawn()
    }
}

/// A real NATS server with JetStream.
#[derive(Debug)]
pub struct NatsServer {
    child: ServerProcess,
    dir: tempfile::TempDir,
    port: u16,
    /// Its clients' credentials (nats-server's `--user`/`--pass`, or `--auth` for a token).
    auth: Vec<String>,
}

impl NatsServer {
    /// Starts nats-server with JetStream on a free loopback port.
    pub fn start() -> std::io::Result<Self> {
        Self::start_with(Vec::new())
    }

    /// Starts one that accepts only clients with this user and password.
    pub fn start_with_user(user: &str, password: &str) -> std::io::Result<Self> {
        Self::start_with(vec!["--user".into(), user.into(), "--pass".into(), password.into()])
    }

    /// Starts one that accepts only clients with this token.
    pub fn start_with_token(token: &str) -> std::io::Result<Self> {
        Self::start_with(vec!["--auth".into(), token.into()])
    }

    fn start_with(auth: Vec<String>) -> std::io::Result<Self> {
        let mut s = NatsServer {
            child: ServerProcess::default(),
            dir: tempfile::tempdir()?,
            port: free_port()?,
            auth,
        };
        s.spawn()?;
        Ok(s)
    }

    fn spawn(&mut self) -> std::io::Result<()> {
        let mut child = Command::new(find("nats-server")?)
            .args(["-a", "127.0.0.1", "-p", &self.port.to_string(), "-js", "-sd"])
            .arg(self.dir.path())
            .args(&self.auth)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        wait_ready(SocketAddr::from(([127, 0, 0, 1], self.port)), &mut child, "nats-server")?;
        self.child = ServerProcess(Some(child));
        Ok(())
    }

    /// The client URL (`nats://127.0.0.1:PORT`).
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Kills the server (SIGKILL).
    pub fn kill(&mut self) {
        self.child.kill();
    }

    /// Kills and starts it again on the same port and store directory.
    pub fn restart(&mut self) -> std::io::Result<()> {
        self.kill();
        self.spawn()
    }
}

/// The Python that runs the test suite's engine stand-ins (vLLM- and SGLang-format KV event
/// publishers): `KVFABRIC_TEST_PYTHON`, as `scripts/test.sh` sets it, else the environment
/// `scripts/setup.sh test` creates. Panics with what to do when it cannot import msgspec and
/// zmq.
pub fn engine_python() -> PathBuf {
    test_python("msgspec, zmq")
}

/// The test suite's Python (as [`engine_python`]), checked to import `modules` (a Python
/// import list); panics with what to do when it cannot.
pub fn test_python(modules: &str) -> PathBuf {
    let p = std::env::var_os("KVFABRIC_TEST_PYTHON").map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(std::env::var("HOME").unwrap_or_default())
            .join(".cache/kvfabric/venv/bin/python")
    });
    let ok = Command::new(&p)
        .args(["-c", &format!("import {modules}")])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        ok,
        "{} cannot import {modules}: run scripts/setup.sh test (or set KVFABRIC_TEST_PYTHON)",
        p.display()
    );
    p
}
