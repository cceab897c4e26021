//! `kvf_op`: an asynchronous operation (a transfer, a store save or load) that C polls or
//! waits on.

use std::ffi::c_char;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvfabric::memory::Region;
use parking_lot::{Condvar, Mutex};

use crate::error::{guard, kvf_result, FfiError};
use crate::ptr::{self, Out};

/// `timeout_ms` of `kvf_op_wait` and `kvf_agent_wait_notification` that waits without end
/// (operations still end at their own deadlines).
pub const KVF_WAIT_FOREVER: u32 = u32::MAX;

#[derive(Debug, Default)]
struct Shared {
    state: Mutex<Option<Result<u64, FfiError>>>,
    done: Condvar,
}

impl Shared {
    fn complete(&self, r: Result<u64, FfiError>) {
        let mut s = self.state.lock();
        if s.is_none() {
            *s = Some(r);
        }
        self.done.notify_all();
    }
}

/// Completes the operation with an error if its task is dropped before finishing (the
/// runtime shut down because the agent was freed).
struct Completer(Arc<Shared>);

impl Drop for Completer {
    fn drop(&mut self) {
        self.0.complete(Err(FfiError::new(
            kvf_result::KVF_TRANSFER,
            "operation abandoned: its agent was freed",
        )));
    }
}

/// An operation in flight or finished. Its memory stays registered (deregistration fails
/// with `KVF_IN_USE`) until the operation is freed.
pub struct kvf_op {
    shared: Arc<Shared>,
    _holds: Vec<Arc<Region>>,
}

impl std::fmt::Debug for kvf_op {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("kvf_op").field("done", &self.shared.state.lock().is_some()).finish()
    }
}

impl kvf_op {
    /// Runs `fut` on `rt`; `holds` keeps regions registered while the op lives.
    pub(crate) fn spawn(
        rt: &tokio::runtime::Handle,
        holds: Vec<Arc<Region>>,
        fut: impl Future<Output = Result<u64, FfiError>> + Send + 'static,
    ) -> kvf_op {
        let shared = Arc::new(Shared::default());
        let completer = Completer(shared.clone());
        let task = rt.spawn(fut);
        rt.spawn(async move {
            let r = match task.await {
                Ok(r) => r,
                Err(e) if e.is_panic() => {
                    Err(FfiError::new(kvf_result::KVF_PANIC, kvf_result::KVF_PANIC.describe()))
                }
                Err(_) => Err(FfiError::new(kvf_result::KVF_TRANSFER, "operation cancelled")),
            };
            completer.0.complete(r);
        });
        kvf_op { shared, _holds: holds }
    }

    /// Waits up to `timeout` (None: without end) for the outcome.
    pub fn wait(&self, timeout: Option<Duration>) -> Option<Result<u64, FfiError>> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut s = self.shared.state.lock();
        loop {
            if let Some(r) = s.as_ref() {
                return Some(r.clone());
            }
            match deadline {
                None => self.shared.done.wait(&mut s),
                Some(d) => {
                    if self.shared.done.wait_until(&mut s, d).timed_out() && s.is_none() {
                        return None;
                    }
                }
            }
        }
    }
}

pub(crate) fn timeout_of(ms: u32) -> Option<Duration> {
    (ms != KVF_WAIT_FOREVER).then(|| Duration::from_millis(u64::from(ms)))
}

/// Waits up to `timeout_ms` (`KVF_WAIT_FOREVER`: no limit) for `op` to finish. On success,
/// `*count_out` (may be NULL) receives its count: bytes for a transfer, blocks stored for a
/// save, blocks loaded for a load. Returns the operation's own error code if it failed, or
/// `KVF_TIMED_OUT` if it is still running. Thread-safe.
///
/// # Safety
/// `op` is a live op; `count_out` is NULL or valid for one write.
#[no_mangle]
pub unsafe extern "C" fn kvf_op_wait(
    op: *const kvf_op,
    timeout_ms: u32,
    count_out: *mut u64,
) -> kvf_result {
    guard(|| {
        // SAFETY: the caller's contract.
        let op = unsafe { ptr::handle(op, "op") }?;
        // NULL means "not wanted".
        let out = if count_out.is_null() {
            None
        } else {
            // SAFETY: the caller's contract.
            Some(unsafe { Out::new(count_out, "count_out") }?)
        };
        match op.wait(timeout_of(timeout_ms)) {
            None => Err(FfiError::new(kvf_result::KVF_TIMED_OUT, "operation still running")),
            Some(Err(e)) => Err(e),
            Some(Ok(n)) => {
                if let Some(out) = out {
                    out.set(n);
                }
                Ok(())
            }
        }
    })
}

/// Writes whether `op` has finished (successfully or not) into `*done_out`. Thread-safe.
///
/// # Safety
/// `op` is a live op; `done_out` is valid for one write.
#[no_mangle]
pub unsafe extern "C" fn kvf_op_poll(op: *const kvf_op, done_out: *mut bool) -> kvf_result {
    guard(|| {
        // SAFETY: the caller's contract.
        let op = unsafe { ptr::handle(op, "op") }?;
        // SAFETY: as above.
        let out = unsafe { Out::new(done_out, "done_out") }?;
        out.set(op.shared.state.lock().is_some());
        Ok(())
    })
}

/// Copies the text of the operation's error (empty while it runs or if it succeeded) into
/// `buf`, NUL-terminated and truncated to fit; its length into `*len_out`. Thread-safe.
///
/// # Safety
/// `op` is a live op; `buf` is valid for `cap` writes; `len_out` for one.
#[no_mangle]
pub unsafe extern "C" fn kvf_op_error(
    op: *const kvf_op,
    buf: *mut c_char,
    cap: usize,
    len_out: *mut usize,
) -> kvf_result {
    guard(|| {
        // SAFETY: the caller's contract.
        let op = unsafe { ptr::handle(op, "op") }?;
        let text = match &*op.shared.state.lock() {
            Some(Err(e)) => e.message.clone(),
            _ => String::new(),
        };
        // SAFETY: the caller's contract.
        unsafe { crate::ptr::write_text(&text, buf, cap, len_out) }
    })
}

/// Frees an op; NULL is allowed. An op still running goes on to its end (or deadline) in the
/// background; its regions stay in use until then.
///
/// # Safety
/// `op` is NULL or a live op, not used again after this call by any thread.
#[no_mangle]
pub unsafe extern "C" fn kvf_op_free(op: *mut kvf_op) {
    // SAFETY: the caller gives the handle back once.
    crate::error::guard_void(|| unsafe { ptr::free(op) })
}
