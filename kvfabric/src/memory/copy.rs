//! The one copy of host bytes every local and shared-memory transfer makes.

/// Copies of at least this many bytes stream past the caches.
const STREAM_MIN: usize = 256 << 10;

/// `memmove`, except that a large copy between disjoint ranges writes with non-temporal
/// stores: KV blocks moved between processes are not read again by the copying core soon, and
/// streaming them skips the read-for-ownership of every destination line (glibc streams only
/// copies larger than most of the last-level cache, far above a descriptor's size, so a
/// transfer copied in 4 MiB slices ran at half of one whole-buffer memcpy).
///
/// # Safety
/// `src` must be valid for reads and `dst` for writes of `len` bytes.
pub(super) unsafe fn copy_bytes(src: *const u8, dst: *mut u8, len: usize) {
    let disjoint = (src as usize).abs_diff(dst as usize) >= len;
    #[cfg(target_arch = "x86_64")]
    if len >= STREAM_MIN && disjoint {
        // SAFETY: forwarded from the caller; the ranges do not overlap.
        unsafe { stream_copy(src, dst, len) };
        return;
    }
    let _ = disjoint;
    // SAFETY: forwarded from the caller; memmove handles any overlap.
    unsafe { std::ptr::copy(src, dst, len) }
}

/// Forward copy with 16-byte non-temporal stores (SSE2, present on every x86_64).
///
/// # Safety
/// As [`copy_bytes`], and the ranges must not overlap.
#[cfg(target_arch = "x86_64")]
unsafe fn stream_copy(src: *const u8, dst: *mut u8, len: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
    // Up to the first 16-byte boundary of the destination, plainly.
    let head = dst.align_offset(16).min(len);
    // SAFETY: `head <= len`: in bounds of both ranges, which do not overlap.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, head) };
    let body = (len - head) / 64 * 64;
    let mut i = head;
    while i < head + body {
        // SAFETY: `i + 64 <= len`: 64 bytes in bounds of both ranges; the destination is
        // 16-byte aligned from `head` on, as `_mm_stream_si128` needs; loads are unaligned.
        unsafe {
            let s = src.add(i) as *const __m128i;
            let d = dst.add(i) as *mut __m128i;
            let (a, b) = (_mm_loadu_si128(s), _mm_loadu_si128(s.add(1)));
            let (c, e) = (_mm_loadu_si128(s.add(2)), _mm_loadu_si128(s.add(3)));
            _mm_stream_si128(d, a);
            _mm_stream_si128(d.add(1), b);
            _mm_stream_si128(d.add(2), c);
            _mm_stream_si128(d.add(3), e);
        }
        i += 64;
    }
    // SAFETY: the rest, `i..len`, in bounds; then order the streaming stores before any
    // later store (the notification that the bytes are there).
    unsafe {
        std::ptr::copy_nonoverlapping(src.add(i), dst.add(i), len - i);
        _mm_sfence();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streaming_copies_equal_memmove_at_every_alignment_and_length() {
        let n = STREAM_MIN * 2 + 333;
        let src: Vec<u8> = (0..n + 64).map(|i| (i * 31 % 251) as u8).collect();
        for (so, dofs, len) in [
            (0, 0, STREAM_MIN),
            (1, 0, STREAM_MIN + 1),
            (3, 7, STREAM_MIN * 2 + 5),
            (15, 9, n - 15),
            (0, 0, 100),
            (5, 3, 64),
        ] {
            let mut dst = vec![0u8; n + 64];
            // SAFETY: both buffers hold `len` bytes past their offsets; they are disjoint.
            unsafe { copy_bytes(src.as_ptr().add(so), dst.as_mut_ptr().add(dofs), len) };
            assert_eq!(&dst[dofs..dofs + len], &src[so..so + len], "{so} {dofs} {len}");
            assert!(
                dst[..dofs].iter().all(|&b| b == 0) && dst[dofs + len..].iter().all(|&b| b == 0)
            );
        }
        // Overlapping ranges (one region) still copy as memmove does.
        let mut buf = src.clone();
        let want: Vec<u8> = src[..n - 100].to_vec();
        // SAFETY: both ranges lie in `buf`; they overlap, which `copy_bytes` allows.
        unsafe { copy_bytes(buf.as_ptr(), buf.as_mut_ptr().add(100), n - 100) };
        assert_eq!(&buf[100..n], &want[..]);
    }
}
