//! Result codes, typed errors and the panic boundary (copying text out to C is [`crate::ptr`]'s).

use std::panic::{catch_unwind, AssertUnwindSafe};

use kvfabric::agent::AgentError;
use kvfabric::control::ControlError;
use kvfabric::memory::{MemoryError, MemoryErrorKind};
use kvfabric::transfer::TransferError;
use kvfabric_tiers::remote::RemoteError;
use kvfabric_tiers::StoreError;
use parking_lot::Mutex;

/// What every kvfabric function returns. Codes live in their own range (7000–7099) so that
/// they never collide with errno values or another library's codes.
#[allow(non_camel_case_types)]
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum kvf_result {
    /// Success: out-parameters were written.
    KVF_OK = 0,
    /// A required pointer argument was NULL.
    KVF_NULL_PARAMETER = 7001,
    /// A bug inside kvfabric panicked; the call was abandoned, the handle stays usable for
    /// `_free`.
    KVF_PANIC = 7002,
    /// An argument is malformed: lengths, counts, flags, peer metadata, UTF-8.
    KVF_INVALID_ARGUMENT = 7003,
    /// A config key is unknown, a value does not parse, or a required key is missing.
    KVF_INVALID_CONFIG = 7004,
    /// An output buffer is too small; the length out-parameter holds the size needed.
    KVF_BUFFER_TOO_SMALL = 7005,
    /// No such region, peer or node.
    KVF_NOT_FOUND = 7006,
    /// A descriptor or block address lies outside its registered region.
    KVF_OUT_OF_BOUNDS = 7007,
    /// The region is still used by an operation that was not freed, or a transfer.
    KVF_IN_USE = 7008,
    /// No room: every block of the tier is pinned, or too many regions are registered.
    KVF_FULL = 7009,
    /// The wait ended before the operation (or a notification) arrived.
    KVF_TIMED_OUT = 7010,
    /// A transfer failed: the peer is unreachable, died, refused, or sent bad bytes.
    KVF_TRANSFER = 7011,
    /// A disk or OS error (the disk tier, shared memory, the listener).
    KVF_IO = 7012,
    /// etcd or NATS could not be reached or refused.
    KVF_CONTROL_PLANE = 7013,
    /// Valid but not supported by this build (device memory without the CUDA backend).
    KVF_UNSUPPORTED = 7014,
}

impl kvf_result {
    pub(crate) fn describe(self) -> &'static str {
        use kvf_result::*;
        match self {
            KVF_OK => "ok",
            KVF_NULL_PARAMETER => "a required pointer argument was NULL",
            KVF_PANIC => "internal error: kvfabric panicked (a bug; please report it)",
            KVF_INVALID_ARGUMENT => "invalid argument",
            KVF_INVALID_CONFIG => "invalid configuration",
            KVF_BUFFER_TOO_SMALL => "output buffer too small",
            KVF_NOT_FOUND => "not found",
            KVF_OUT_OF_BOUNDS => "address out of the registered region",
            KVF_IN_USE => "still in use",
            KVF_FULL => "full",
            KVF_TIMED_OUT => "timed out",
            KVF_TRANSFER => "transfer failed",
            KVF_IO => "I/O error",
            KVF_CONTROL_PLANE => "control plane (etcd/NATS) error",
            KVF_UNSUPPORTED => "not supported by this build",
        }
    }

    pub(crate) fn from_u32(code: u32) -> Option<kvf_result> {
        use kvf_result::*;
        [
            KVF_OK,
            KVF_NULL_PARAMETER,
            KVF_PANIC,
            KVF_INVALID_ARGUMENT,
            KVF_INVALID_CONFIG,
            KVF_BUFFER_TOO_SMALL,
            KVF_NOT_FOUND,
            KVF_OUT_OF_BOUNDS,
            KVF_IN_USE,
            KVF_FULL,
            KVF_TIMED_OUT,
            KVF_TRANSFER,
            KVF_IO,
            KVF_CONTROL_PLANE,
            KVF_UNSUPPORTED,
        ]
        .into_iter()
        .find(|c| *c as u32 == code)
    }
}

/// A failed call: its code and its text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FfiError {
    pub(crate) code: kvf_result,
    pub(crate) message: String,
}

impl FfiError {
    pub(crate) fn new(code: kvf_result, message: impl Into<String>) -> Self {
        FfiError { code, message: message.into() }
    }

    pub(crate) fn null(what: &str) -> Self {
        FfiError::new(kvf_result::KVF_NULL_PARAMETER, format!("{what} is NULL"))
    }

    pub(crate) fn invalid(message: impl Into<String>) -> Self {
        FfiError::new(kvf_result::KVF_INVALID_ARGUMENT, message)
    }
}

impl std::fmt::Display for FfiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// The code of a region problem, wherever it surfaced (a registration, a transfer's local
/// descriptors): one mapping, by kind, never by message text.
fn memory_code(kind: MemoryErrorKind) -> kvf_result {
    use kvf_result::*;
    match kind {
        MemoryErrorKind::ZeroLength | MemoryErrorKind::NotHostMemory => KVF_INVALID_ARGUMENT,
        MemoryErrorKind::UnknownRegion => KVF_NOT_FOUND,
        MemoryErrorKind::RegionBusy => KVF_IN_USE,
        MemoryErrorKind::OutOfBounds => KVF_OUT_OF_BOUNDS,
        MemoryErrorKind::TooManyRegions => KVF_FULL,
        MemoryErrorKind::OutOfMemory | MemoryErrorKind::SharedMemory => KVF_IO,
    }
}

impl From<MemoryError> for FfiError {
    fn from(e: MemoryError) -> Self {
        FfiError::new(memory_code(e.kind()), e.to_string())
    }
}

impl From<AgentError> for FfiError {
    fn from(e: AgentError) -> Self {
        match e {
            AgentError::Memory(m) => m.into(),
            AgentError::Config(m) => FfiError::new(kvf_result::KVF_INVALID_CONFIG, m),
            AgentError::BadMetadata(m) => FfiError::invalid(format!("bad peer metadata: {m}")),
            AgentError::Cuda(c) => {
                use kvfabric::cuda::CudaError;
                let code = match &c {
                    CudaError::Unavailable(_) => kvf_result::KVF_UNSUPPORTED,
                    CudaError::NotDeviceMemory(_) | CudaError::NoSuchDevice { .. } => {
                        kvf_result::KVF_INVALID_ARGUMENT
                    }
                    CudaError::OutOfBounds { .. } => kvf_result::KVF_OUT_OF_BOUNDS,
                    _ => kvf_result::KVF_IO,
                };
                FfiError::new(code, c.to_string())
            }
            other => FfiError::new(kvf_result::KVF_IO, other.to_string()),
        }
    }
}

impl From<TransferError> for FfiError {
    fn from(e: TransferError) -> Self {
        use kvf_result::*;
        let code = match &e {
            TransferError::Invalid(_) => KVF_INVALID_ARGUMENT,
            TransferError::Local { kind, .. } => memory_code(*kind),
            TransferError::RemoteDescriptor { .. } => KVF_OUT_OF_BOUNDS,
            TransferError::UnknownPeer(_) => KVF_NOT_FOUND,
            TransferError::TimedOut(_) => KVF_TIMED_OUT,
            _ => KVF_TRANSFER,
        };
        FfiError::new(code, e.to_string())
    }
}

impl From<StoreError> for FfiError {
    fn from(e: StoreError) -> Self {
        use kvf_result::*;
        match e {
            StoreError::Full(_) => FfiError::new(KVF_FULL, e.to_string()),
            StoreError::Disk(_) => FfiError::new(KVF_IO, e.to_string()),
            StoreError::Memory(m) => m.into(),
            StoreError::Remote(_) => FfiError::new(KVF_TRANSFER, e.to_string()),
            StoreError::Invalid(_) | StoreError::AlreadyStored(_) | StoreError::BeingWritten(_) => {
                FfiError::new(KVF_INVALID_ARGUMENT, e.to_string())
            }
        }
    }
}

impl From<RemoteError> for FfiError {
    fn from(e: RemoteError) -> Self {
        let code = match e {
            RemoteError::NoNode => kvf_result::KVF_NOT_FOUND,
            _ => kvf_result::KVF_TRANSFER,
        };
        FfiError::new(code, e.to_string())
    }
}

impl From<ControlError> for FfiError {
    fn from(e: ControlError) -> Self {
        let code = match e {
            ControlError::InvalidName(_) => kvf_result::KVF_INVALID_CONFIG,
            _ => kvf_result::KVF_CONTROL_PLANE,
        };
        FfiError::new(code, e.to_string())
    }
}

/// The last error of a handle, for `kvf_*_last_error`.
#[derive(Debug, Default)]
pub(crate) struct LastError(Mutex<String>);

impl LastError {
    pub(crate) fn set(&self, e: &FfiError) {
        *self.0.lock() = e.message.clone();
    }

    pub(crate) fn get(&self) -> String {
        self.0.lock().clone()
    }
}

/// Runs `f` behind the panic boundary: a panic becomes a `KVF_PANIC` error.
pub(crate) fn guard_with<T>(f: impl FnOnce() -> Result<T, FfiError>) -> Result<T, FfiError> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| {
        Err(FfiError::new(kvf_result::KVF_PANIC, kvf_result::KVF_PANIC.describe()))
    })
}

/// Runs `f` behind the panic boundary and turns its outcome into a code.
pub(crate) fn guard(f: impl FnOnce() -> Result<(), FfiError>) -> kvf_result {
    code(guard_with(f), None)
}

/// Like [`guard`], recording the error text in `last` (a handle's last error).
pub(crate) fn guard_recording(
    last: Option<&LastError>,
    f: impl FnOnce() -> Result<(), FfiError>,
) -> kvf_result {
    code(guard_with(f), last)
}

/// The code of an outcome, recording an error's text in `last`.
pub(crate) fn code(r: Result<(), FfiError>, last: Option<&LastError>) -> kvf_result {
    match r {
        Ok(()) => kvf_result::KVF_OK,
        Err(e) => {
            if let Some(last) = last {
                last.set(&e);
            }
            e.code
        }
    }
}

/// A handle that keeps the text of its last failed call.
pub(crate) trait Recorded {
    fn last_error(&self) -> &LastError;
}

/// Runs `f` on a handle behind the panic boundary, recording a failure as the handle's last
/// error; no handle (NULL) is `KVF_NULL_PARAMETER`, named `what` in the text.
pub(crate) fn recorded<H: Recorded>(
    h: Option<&H>,
    what: &str,
    f: impl FnOnce(&H) -> Result<(), FfiError>,
) -> kvf_result {
    guard_recording(h.map(Recorded::last_error), || f(h.ok_or_else(|| FfiError::null(what))?))
}

/// Runs a `void` export (the `_free` functions) behind the panic boundary.
pub(crate) fn guard_void(f: impl FnOnce()) {
    let _ = catch_unwind(AssertUnwindSafe(f));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Codes follow the kind of an error, never its text: a reworded message keeps its code.
    #[test]
    fn transfer_errors_keep_the_kind_of_their_memory_error() {
        let cases = [
            (MemoryErrorKind::OutOfBounds, kvf_result::KVF_OUT_OF_BOUNDS),
            (MemoryErrorKind::UnknownRegion, kvf_result::KVF_NOT_FOUND),
            (MemoryErrorKind::RegionBusy, kvf_result::KVF_IN_USE),
            (MemoryErrorKind::TooManyRegions, kvf_result::KVF_FULL),
            (MemoryErrorKind::ZeroLength, kvf_result::KVF_INVALID_ARGUMENT),
            (MemoryErrorKind::OutOfMemory, kvf_result::KVF_IO),
        ];
        for (kind, code) in cases {
            let e = TransferError::Local { kind, message: "any words at all".into() };
            assert_eq!(FfiError::from(e).code, code, "{kind:?}");
        }
        let m = MemoryError::UnknownRegion(kvfabric::RegionId(7));
        let t: TransferError = MemoryError::UnknownRegion(kvfabric::RegionId(7)).into();
        assert_eq!(FfiError::from(m).code, FfiError::from(t).code);
    }
}
