//! Every conversion of a raw pointer from C happens here, each with its contract.
//!
//! The C contract (in the header): a handle argument is NULL or a pointer returned by the
//! matching `_new` and not yet freed; an array argument of `n` elements is valid for `n`
//! reads (it may be NULL only when `n` is 0); a string is NUL-terminated; an out-parameter is
//! valid for one write; a caller buffer of `cap` bytes is valid for `cap` writes.

use std::ffi::{c_char, CStr};
use std::ptr::NonNull;

use crate::error::FfiError;

/// A handle argument.
///
/// # Safety
/// `p` is NULL or points to a live `T` created by this library (see the module's contract).
pub(crate) unsafe fn handle<'a, T>(p: *const T, what: &str) -> Result<&'a T, FfiError> {
    // SAFETY: non-null pointers are live handles by the caller's contract.
    unsafe { p.as_ref() }.ok_or_else(|| FfiError::null(what))
}

/// An array argument of `n` elements (NULL is allowed when `n` is 0).
///
/// # Safety
/// `p` is valid for `n` reads of `T` when non-null, and not written during the call.
pub(crate) unsafe fn slice<'a, T>(p: *const T, n: usize, what: &str) -> Result<&'a [T], FfiError> {
    if n == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(FfiError::null(what));
    }
    if !p.is_aligned() {
        return Err(FfiError::invalid(format!("{what} is not aligned")));
    }
    // SAFETY: non-null, aligned, and valid for n reads by the caller's contract.
    Ok(unsafe { std::slice::from_raw_parts(p, n) })
}

/// A NUL-terminated UTF-8 string argument.
///
/// # Safety
/// `p` is NULL or a NUL-terminated string valid for reads during the call.
pub(crate) unsafe fn cstr<'a>(p: *const c_char, what: &str) -> Result<&'a str, FfiError> {
    if p.is_null() {
        return Err(FfiError::null(what));
    }
    // SAFETY: non-null and NUL-terminated by the caller's contract.
    let s = unsafe { CStr::from_ptr(p) };
    s.to_str().map_err(|_| FfiError::invalid(format!("{what} is not UTF-8")))
}

/// An out-parameter, checked for NULL before any work is done, written only on success.
#[derive(Debug)]
pub(crate) struct Out<T>(NonNull<T>);

impl<T> Out<T> {
    /// # Safety
    /// `p` is NULL or valid for one aligned write of `T` until the call returns.
    pub(crate) unsafe fn new(p: *mut T, what: &str) -> Result<Self, FfiError> {
        let p = NonNull::new(p).ok_or_else(|| FfiError::null(what))?;
        if !p.as_ptr().is_aligned() {
            return Err(FfiError::invalid(format!("{what} is not aligned")));
        }
        Ok(Out(p))
    }

    pub(crate) fn set(self, v: T) {
        // SAFETY: non-null, aligned, and valid for one write (contract of `Out::new`); the
        // old value is not dropped (it may be uninitialized C memory).
        unsafe { self.0.as_ptr().write(v) }
    }
}

/// A caller buffer of `cap` elements (NULL is allowed when `cap` is 0).
#[derive(Debug)]
pub(crate) struct OutBuf<T> {
    ptr: *mut T,
    cap: usize,
}

impl<T: Copy> OutBuf<T> {
    /// # Safety
    /// `p` is NULL with `cap` 0, or valid for `cap` writes of `T` until the call returns.
    pub(crate) unsafe fn new(p: *mut T, cap: usize, what: &str) -> Result<Self, FfiError> {
        if cap > 0 && p.is_null() {
            return Err(FfiError::null(what));
        }
        if cap > 0 && !p.is_aligned() {
            return Err(FfiError::invalid(format!("{what} is not aligned")));
        }
        Ok(OutBuf { ptr: p, cap })
    }

    pub(crate) fn cap(&self) -> usize {
        self.cap
    }

    /// Writes `src` at the start; callers check `src.len() <= cap` first.
    pub(crate) fn write(&self, src: &[T]) {
        let n = src.len().min(self.cap);
        if n == 0 {
            return;
        }
        // SAFETY: ptr is valid for cap >= n writes (contract of `OutBuf::new`), and a Rust
        // slice cannot overlap memory the caller lent us as an output.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr, n) }
    }
}

/// Hands a handle to C.
pub(crate) fn into_raw<T>(v: T) -> *mut T {
    Box::into_raw(Box::new(v))
}

/// Takes a handle back from C and drops it; NULL is fine.
///
/// # Safety
/// `p` is NULL or a pointer from [`into_raw`] for the same `T` that was not freed, and no
/// other thread uses it during or after this call.
pub(crate) unsafe fn free<T>(p: *mut T) {
    if !p.is_null() {
        // SAFETY: created by Box::into_raw in `into_raw` and owned by the caller, who gives
        // it back exactly once (contract above).
        drop(unsafe { Box::from_raw(p) });
    }
}

/// Copies `text` into a caller buffer of `cap` bytes as a NUL-terminated string, truncated
/// to fit (at a UTF-8 boundary); returns the bytes written without the NUL.
pub(crate) fn copy_text(text: &str, buf: OutBuf<c_char>) -> usize {
    let cap = buf.cap();
    if cap == 0 {
        return 0;
    }
    let mut n = text.len().min(cap - 1);
    while !text.is_char_boundary(n) {
        n -= 1;
    }
    let mut bytes: Vec<c_char> = text.as_bytes()[..n].iter().map(|&b| b as c_char).collect();
    bytes.push(0);
    buf.write(&bytes);
    n
}

/// Copies `text` to a caller buffer and its length to `len_out` (the `kvf_*_last_error`,
/// `kvf_op_error` and `kvf_result_text` contract).
///
/// # Safety
/// `buf` is valid for `cap` writes (or NULL with `cap` 0); `len_out` for one write.
pub(crate) unsafe fn write_text(
    text: &str,
    buf: *mut c_char,
    cap: usize,
    len_out: *mut usize,
) -> Result<(), FfiError> {
    // SAFETY: forwarded contract.
    let buf = unsafe { OutBuf::new(buf, cap, "buf") }?;
    // SAFETY: forwarded contract.
    let out = unsafe { Out::new(len_out, "len_out") }?;
    out.set(copy_text(text, buf));
    Ok(())
}
