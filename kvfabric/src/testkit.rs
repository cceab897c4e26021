//! Real etcd and NATS servers for integration tests of any crate (feature `testkit`).
//!
//! Each server runs as a child process on free loopback ports with a temporary data
//! directory, is waited for until it accepts connections, can be restarted on the same ports
//! and data (to test reconnection), and is killed when dropped. The binaries come from the
//! Debian packages `etcd-server` and `nats-server`, which `scripts/test.sh` installs.

pub mod http;

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
    /// Its certificate, and the CA of the client certificates it requires (https).
    tls: Option<(TestCert, Option<PathBuf>)>,
}

impl EtcdServer {
    /// Starts etcd on free loopback ports.
    pub fn start() -> std::io::Result<Self> {
        let mut s = EtcdServer {
            child: ServerProcess::default(),
            dir: tempfile::tempdir()?,
            client_port: free_port()?,
            peer_port: free_port()?,
            tls: None,
        };
        s.spawn()?;
        Ok(s)
    }

    /// Starts etcd serving its clients over TLS with `cert`; with `client_ca`, it requires
    /// client certificates signed by that CA (`--client-cert-auth`).
    pub fn start_tls(cert: TestCert, client_ca: Option<PathBuf>) -> std::io::Result<Self> {
        let mut s = EtcdServer {
            child: ServerProcess::default(),
            dir: tempfile::tempdir()?,
            client_port: free_port()?,
            peer_port: free_port()?,
            tls: Some((cert, client_ca)),
        };
        s.spawn()?;
        Ok(s)
    }

    fn spawn(&mut self) -> std::io::Result<()> {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let client = format!("{scheme}://127.0.0.1:{}", self.client_port);
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let mut cmd = Command::new(find("etcd")?);
        cmd.args(["--name", "kvfabric-test", "--data-dir"])
            .arg(self.dir.path().join("data"))
            .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("kvfabric-test={peer}")]);
        if let Some((cert, client_ca)) = &self.tls {
            cmd.arg("--cert-file").arg(&cert.cert).arg("--key-file").arg(&cert.key);
            if let Some(ca) = client_ca {
                cmd.arg("--client-cert-auth").arg("--trusted-ca-file").arg(ca);
            }
        }
        let mut child = cmd.stdout(Stdio::null()).stderr(Stdio::null()).spawn()?;
        wait_ready(SocketAddr::from(([127, 0, 0, 1], self.client_port)), &mut child, "etcd")?;
        self.child = ServerProcess(Some(child));
        Ok(())
    }

    /// The client endpoint (`http://127.0.0.1:PORT`, or https).
    pub fn endpoint(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.client_port)
    }

    /// Turns on etcd's authentication with a `root` user of `password` (as `etcdctl user
    /// add root` and `etcdctl auth enable` do), reaching it with `security`'s TLS.
    #[cfg(feature = "etcd")]
    pub async fn enable_auth(
        &self,
        security: crate::control::etcd::EtcdSecurity,
        password: &str,
    ) -> Result<(), crate::control::ControlError> {
        crate::control::etcd::enable_root_auth(&[self.endpoint()], security, password).await
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
    /// A configuration file (TLS), when it has one.
    config: Option<PathBuf>,
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
            config: None,
        };
        s.spawn()?;
        Ok(s)
    }

    /// Starts one that accepts only clients that sign its nonce with the NKey whose public
    /// key is `public` (`U…`).
    pub fn start_with_nkey(public: &str) -> std::io::Result<Self> {
        Self::start_configured(format!(
            "authorization {{\n  users: [ {{ nkey: {public:?} }} ]\n}}\n"
        ))
    }

    /// Starts one that requires TLS with `cert`, client certificates signed by `client_ca`
    /// (`verify: true`), and the user `user` with `password`.
    pub fn start_tls(
        cert: &TestCert,
        client_ca: &std::path::Path,
        user: &str,
        password: &str,
    ) -> std::io::Result<Self> {
        Self::start_configured(format!(
            "tls {{\n  cert_file: {:?}\n  key_file: {:?}\n  ca_file: {:?}\n  verify: true\n  timeout: 2\n}}\n\
             authorization {{\n  user: {user:?}\n  password: {password:?}\n}}\n",
            cert.cert.display().to_string(),
            cert.key.display().to_string(),
            client_ca.display().to_string(),
        ))
    }

    /// Starts one with this configuration file's text (beside the command line's address,
    /// port and JetStream directory).
    fn start_configured(text: String) -> std::io::Result<Self> {
        let dir = tempfile::tempdir()?;
        let config = dir.path().join("nats.conf");
        std::fs::write(&config, text)?;
        let mut s = NatsServer {
            child: ServerProcess::default(),
            dir,
            port: free_port()?,
            auth: Vec::new(),
            config: Some(config),
        };
        s.spawn()?;
        Ok(s)
    }

    fn spawn(&mut self) -> std::io::Result<()> {
        let mut cmd = Command::new(find("nats-server")?);
        if let Some(config) = &self.config {
            cmd.arg("-c").arg(config);
        }
        let mut child = cmd
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

/// A certificate and its key, as PEM files.
#[derive(Debug, Clone)]
pub struct TestCert {
    /// The certificate (PEM).
    pub cert: PathBuf,
    /// Its private key (PEM, PKCS#8).
    pub key: PathBuf,
}

/// A small certificate authority for tests (rcgen): its certificate in a temporary
/// directory, and leaf certificates it issues there, valid or not.
pub struct TestCa {
    dir: tempfile::TempDir,
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
    ca: PathBuf,
    next: std::sync::atomic::AtomicUsize,
}

impl std::fmt::Debug for TestCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestCa").field("ca", &self.ca).finish()
    }
}

fn rcgen_error(e: rcgen::Error) -> std::io::Error {
    std::io::Error::other(e.to_string())
}

impl TestCa {
    /// A new CA named `name`.
    pub fn new(name: &str) -> std::io::Result<Self> {
        let dir = tempfile::tempdir()?;
        let key = rcgen::KeyPair::generate().map_err(rcgen_error)?;
        let mut params =
            rcgen::CertificateParams::new(Vec::<String>::new()).map_err(rcgen_error)?;
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.distinguished_name.push(rcgen::DnType::CommonName, name);
        params.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::CrlSign,
            rcgen::KeyUsagePurpose::DigitalSignature,
        ];
        let cert = params.self_signed(&key).map_err(rcgen_error)?;
        let ca = dir.path().join("ca.pem");
        std::fs::write(&ca, cert.pem())?;
        let issuer = rcgen::Issuer::new(params, key);
        Ok(TestCa { dir, issuer, ca, next: Default::default() })
    }

    /// The CA's certificate (PEM).
    pub fn ca(&self) -> PathBuf {
        self.ca.clone()
    }

    /// A certificate for `names` (DNS names or IP addresses), for servers and clients alike,
    /// valid from yesterday for a year.
    pub fn issue(&self, names: &[&str]) -> std::io::Result<TestCert> {
        let now = std::time::SystemTime::now();
        self.issue_valid(
            names,
            now - Duration::from_secs(86_400),
            now + Duration::from_secs(365 * 86_400),
        )
    }

    /// A certificate for `names` that expired yesterday.
    pub fn issue_expired(&self, names: &[&str]) -> std::io::Result<TestCert> {
        let now = std::time::SystemTime::now();
        self.issue_valid(
            names,
            now - Duration::from_secs(30 * 86_400),
            now - Duration::from_secs(86_400),
        )
    }

    /// A certificate for `names` valid from `from` to `to`.
    pub fn issue_valid(
        &self,
        names: &[&str],
        from: std::time::SystemTime,
        to: std::time::SystemTime,
    ) -> std::io::Result<TestCert> {
        let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        let mut params = rcgen::CertificateParams::new(names.clone()).map_err(rcgen_error)?;
        // Names in the subject alternative names only, no Common Name (rcgen's default has
        // one): etcd's gateway refuses client certificates that carry one while its
        // authentication is on.
        params.distinguished_name = rcgen::DistinguishedName::new();
        params.not_before = from.into();
        params.not_after = to.into();
        params.extended_key_usages = vec![
            rcgen::ExtendedKeyUsagePurpose::ServerAuth,
            rcgen::ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let key = rcgen::KeyPair::generate().map_err(rcgen_error)?;
        let cert = params.signed_by(&key, &self.issuer).map_err(rcgen_error)?;
        let n = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let out = TestCert {
            cert: self.dir.path().join(format!("cert-{n}.pem")),
            key: self.dir.path().join(format!("key-{n}.pem")),
        };
        std::fs::write(&out.cert, cert.pem())?;
        std::fs::write(&out.key, key.serialize_pem())?;
        Ok(out)
    }
}
