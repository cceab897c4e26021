//! The planner's scalers for one host, over one pool ([`Workers`]) of two kinds:
//! - [`Processes`] (`kvfabric frontend --planner`): `kvfabric worker` processes of this
//!   binary that join the frontend's discovery and event bus, drained on the way down with
//!   SIGTERM (the worker leaves discovery, finishes its requests, exits);
//! - [`InProcess`] (`kvfabric up --planner`): worker stacks in this process, registered in
//!   its embedded discovery, drained the same way in a task.
//!
//! A Kubernetes scaler would implement the same `kvfabric_planner::live::Scaler` by
//! patching replicas.

use std::process::Stdio;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kvfabric::control::{Discovery, EventBus, Registration};
use kvfabric_planner::live::{ScaleError, ScaleFuture, Scaler};
use kvfabric_serving::protocol::ServeStats;
use kvfabric_serving::worker::{drain, Role, WorkerStack};

use super::stack::EngineOpts;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// How to start a worker.
#[derive(Debug, Clone)]
pub struct WorkerTemplate {
    /// The `kvfabric` binary.
    pub exe: std::path::PathBuf,
    /// Arguments after `worker` (engine options and the like).
    pub args: Vec<String>,
    /// Environment of the workers (the secret, the control plane's endpoints).
    pub env: Vec<(String, String)>,
    /// Worker names are `{prefix}-{n}`.
    pub prefix: String,
    /// A worker that has not said it is ready by then is killed and the start fails.
    pub start_timeout: Duration,
    /// A draining worker that has not exited by then is killed.
    pub drain_timeout: Duration,
}

/// A kind of worker: how one starts, whether it still runs, how it drains.
pub trait Kind: Send + Sync + std::fmt::Debug + 'static {
    /// A running worker.
    type Worker: Send + std::fmt::Debug + 'static;
    /// Worker names are `{prefix}-{n}`.
    fn prefix(&self) -> &str;
    /// Starts worker `name` and waits until it serves.
    fn start(
        &self,
        name: String,
    ) -> impl std::future::Future<Output = Result<Self::Worker, ScaleError>> + Send;
    /// Whether it still runs (it may have died on its own).
    fn alive(w: &mut Self::Worker) -> bool;
    /// Starts its drain; the future ends when it has stopped.
    fn drain(&self, w: Self::Worker) -> Result<DrainFuture, ScaleError>;
}

/// A drain under way.
pub type DrainFuture = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

/// A pool of workers of one kind: the planner's scaler.
#[derive(Debug)]
pub struct Workers<K: Kind> {
    kind: K,
    serving: tokio::sync::Mutex<Vec<K::Worker>>,
    count: AtomicU32,
    draining: Arc<AtomicU32>,
    next: AtomicU32,
    drains: parking_lot::Mutex<Vec<tokio::task::JoinHandle<()>>>,
}

impl<K: Kind> Workers<K> {
    /// No workers yet.
    pub fn new(kind: K) -> Self {
        Workers {
            kind,
            serving: tokio::sync::Mutex::new(Vec::new()),
            count: AtomicU32::new(0),
            draining: Arc::new(AtomicU32::new(0)),
            next: AtomicU32::new(0),
            drains: parking_lot::Mutex::new(Vec::new()),
        }
    }

    fn drain_one(&self, w: K::Worker) -> Result<(), ScaleError> {
        let done = self.kind.drain(w)?;
        self.draining.fetch_add(1, Ordering::Relaxed);
        let draining = self.draining.clone();
        let task = tokio::spawn(async move {
            done.await;
            draining.fetch_sub(1, Ordering::Relaxed);
        });
        let mut drains = self.drains.lock();
        drains.retain(|t| !t.is_finished());
        drains.push(task);
        Ok(())
    }

    /// Drains every worker and waits for them (the frontend is stopping).
    pub async fn shutdown(&self) {
        let _ = self.scale_to(0).await;
        let drains = std::mem::take(&mut *self.drains.lock());
        for t in drains {
            let _ = t.await;
        }
    }
}

impl<K: Kind> Scaler for Workers<K> {
    fn workers(&self) -> u32 {
        self.count.load(Ordering::Relaxed)
    }

    fn draining(&self) -> u32 {
        self.draining.load(Ordering::Relaxed)
    }

    fn scale_to(&self, n: u32) -> ScaleFuture<'_> {
        Box::pin(async move {
            let mut serving = self.serving.lock().await;
            // Workers that died on their own are not serving.
            serving.retain_mut(|w| {
                let alive = K::alive(w);
                if !alive {
                    tracing::warn!(worker = ?w, "planner: worker exited on its own");
                }
                alive
            });
            let mut result = Ok(());
            if serving.len() < n as usize {
                // Concurrently: scaling from 1 to 6 takes one start, not five.
                let starts = (serving.len()..n as usize).map(|_| {
                    let i = self.next.fetch_add(1, Ordering::Relaxed);
                    self.kind.start(format!("{}-{i}", self.kind.prefix()))
                });
                for r in futures_util::future::join_all(starts).await {
                    match r {
                        Ok(w) => serving.push(w),
                        Err(e) => result = Err(e),
                    }
                }
            }
            while serving.len() > n as usize {
                // The newest first: the oldest hold the warmest caches.
                let Some(w) = serving.pop() else { break };
                if let Err(e) = self.drain_one(w) {
                    result = Err(e);
                }
            }
            let now = serving.len() as u32;
            self.count.store(now, Ordering::Relaxed);
            result.map(|()| now)
        })
    }
}

/// A worker process.
#[derive(Debug)]
pub struct Running {
    name: String,
    child: Child,
}

/// Workers as `kvfabric worker` processes.
#[derive(Debug)]
pub struct Processes(pub WorkerTemplate);

impl Kind for Processes {
    type Worker = Running;

    fn prefix(&self) -> &str {
        &self.0.prefix
    }

    fn alive(w: &mut Running) -> bool {
        matches!(w.child.try_wait(), Ok(None))
    }

    async fn start(&self, name: String) -> Result<Running, ScaleError> {
        let t = &self.0;
        let mut cmd = Command::new(&t.exe);
        cmd.arg("worker")
            .args(&t.args)
            .args(["--name", &name])
            .envs(t.env.iter().map(|(k, v)| (k, v)))
            .env("KVFABRIC_DRAIN_TIMEOUT_S", t.drain_timeout.as_secs().to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .kill_on_drop(true);
        // SAFETY: runs in the forked child before exec, where only async-signal-safe calls
        // are allowed: prctl(2) is a plain system call and touches no memory of ours.
        unsafe {
            cmd.pre_exec(|| {
                // If this process dies without draining its workers (SIGKILL, a crash), they
                // get SIGTERM and drain themselves. Tied to the thread that spawns them, a
                // runtime worker thread that lives as long as the runtime.
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child =
            cmd.spawn().map_err(|e| ScaleError::Start(format!("{}: {e}", t.exe.display())))?;
        let Some(stdout) = child.stdout.take() else {
            return Err(ScaleError::Start(format!("{name}: no stdout")));
        };
        let mut lines = BufReader::new(stdout).lines();
        let ready = tokio::time::timeout(t.start_timeout, lines.next_line()).await;
        let line = match ready {
            Ok(Ok(Some(line))) => line,
            Ok(Ok(None)) | Ok(Err(_)) => {
                // Closed stdout (or printed garbage): it is not going to serve. Killed, so
                // that the wait cannot hang.
                let _ = child.kill().await;
                let status = child.wait().await.ok();
                return Err(ScaleError::Start(format!(
                    "{name} closed its stdout before it was ready ({status:?}; its log is on stderr)"
                )));
            }
            Err(_) => {
                let _ = child.kill().await;
                return Err(ScaleError::Start(format!(
                    "{name} not ready within {:?}",
                    t.start_timeout
                )));
            }
        };
        let ok = serde_json::from_str::<serde_json::Value>(&line)
            .ok()
            .is_some_and(|v| v["worker"].as_str() == Some(name.as_str()));
        if !ok {
            let _ = child.kill().await;
            return Err(ScaleError::Start(format!(
                "{name} said {line:?} instead of its ready line"
            )));
        }
        // Keep reading (and dropping) what it prints, so that it never writes to a closed pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        tracing::info!(worker = %name, "planner: worker started");
        Ok(Running { name, child })
    }

    /// SIGTERM; the worker is waited for, and killed past its drain deadline.
    fn drain(&self, mut w: Running) -> Result<DrainFuture, ScaleError> {
        let Some(pid) = w.child.id() else {
            return Ok(Box::pin(async {})); // already exited
        };
        let pid = libc::pid_t::try_from(pid).map_err(|e| ScaleError::Stop(e.to_string()))?;
        // SAFETY: kill(2) with a pid this process spawned and has not yet reaped (the Child
        // still owns it, so the pid cannot have been reused) and a valid signal number.
        let rc = unsafe { libc::kill(pid, libc::SIGTERM) };
        if rc != 0 {
            return Err(ScaleError::Stop(format!(
                "{}: {}",
                w.name,
                std::io::Error::last_os_error()
            )));
        }
        tracing::info!(worker = %w.name, "planner: worker draining");
        let limit = self.0.drain_timeout + Duration::from_secs(10);
        Ok(Box::pin(async move {
            match tokio::time::timeout(limit, w.child.wait()).await {
                Ok(Ok(status)) => {
                    tracing::info!(worker = %w.name, %status, "planner: worker stopped")
                }
                Ok(Err(e)) => {
                    tracing::warn!(worker = %w.name, error = %e, "planner: waiting for a worker")
                }
                Err(_) => {
                    tracing::warn!(worker = %w.name, "planner: worker still running past its drain deadline: killing it");
                    let _ = w.child.kill().await;
                }
            }
        }))
    }
}

/// A worker in this process.
pub struct Local {
    name: String,
    stack: WorkerStack,
    registration: Registration,
    server: tokio::task::JoinHandle<()>,
    stats: Option<Arc<ServeStats>>,
}

impl std::fmt::Debug for Local {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name)
    }
}

/// Workers as engines in this process (`kvfabric up --planner`), in its embedded discovery.
#[derive(Debug)]
pub struct InProcess {
    /// The engine of every worker.
    pub engine: EngineOpts,
    /// Where they register.
    pub discovery: Arc<dyn Discovery>,
    /// Where they publish.
    pub bus: Arc<dyn EventBus>,
    /// Worker names are `{prefix}-{n}`.
    pub prefix: String,
    /// Their role.
    pub role: Role,
    /// How long a draining worker may take to finish its requests.
    pub drain_timeout: Duration,
}

impl Kind for InProcess {
    type Worker = Local;

    fn prefix(&self) -> &str {
        &self.prefix
    }

    fn alive(w: &mut Local) -> bool {
        w.stack.sched.failure().is_none()
    }

    async fn start(&self, name: String) -> Result<Local, ScaleError> {
        let fail = |e: &dyn std::fmt::Display| ScaleError::Start(format!("{name}: {e}"));
        let stack = super::stack::start_stack(
            &self.engine,
            &name,
            &self.discovery,
            self.bus.clone(),
            super::stack::TransferAt::LOOPBACK,
            false,
        )
        .await
        .map_err(|e| fail(&super::one_line(&e)))?;
        let served = stack
            .serve(
                &name,
                self.role,
                std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
                None,
                &self.discovery,
                &self.bus,
                self.engine.max_batch,
                self.engine.disagg(),
                Duration::from_secs(10),
            )
            .await
            .map_err(|e| fail(&e))?;
        tracing::info!(worker = %name, "planner: worker started");
        Ok(Local {
            name,
            stack,
            registration: served.registration,
            server: served.server,
            stats: served.stats,
        })
    }

    fn drain(&self, w: Local) -> Result<DrainFuture, ScaleError> {
        tracing::info!(worker = %w.name, "planner: worker draining");
        let deadline = self.drain_timeout;
        Ok(Box::pin(async move {
            w.stack.sched.stats().draining.store(true, std::sync::atomic::Ordering::Relaxed);
            w.registration.revoke().await;
            let quiet = super::stack::DRAIN_QUIET;
            let drained = drain(w.stats.as_deref(), &w.stack.sched, quiet, deadline).await;
            w.server.abort();
            w.stack.shutdown().await;
            if drained {
                tracing::info!(worker = %w.name, "planner: worker stopped");
            } else {
                tracing::warn!(worker = %w.name, "planner: worker stopped at its drain deadline with requests in flight");
            }
        }))
    }
}
