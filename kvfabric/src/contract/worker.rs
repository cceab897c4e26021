//! The request port of a worker: the frames a frontend and a worker exchange after the
//! agents' authenticated handshake.
//!
//! A frame is `u32` little-endian body length, one byte of [`PROTOCOL`] version, then the body:
//! one JSON value, at most [`FRAME_MAX`] bytes. The frontend sends a [`WorkerRequest`]; the
//! worker answers with [`GenEvent`](super::generate::GenEvent) frames (`accepted`, `started`,
//! `token`…, then `done` or `error`), and the connection may then carry the next request.
//!
//! Every frame carries the version, so a peer of another version is named as such
//! ([`FrameHeaderError::Version`]) instead of being misread; a worker also registers the version
//! it speaks ([`WorkerApi::Kvfabric`](super::discovery::WorkerApi)), so a frontend knows before
//! its first request. Version 1 was the unversioned framing (length, then JSON): its body's
//! first byte (`{`) stands where the version is now, and is recognised as version 1.

use super::generate::GenerateRequest;

/// The version of the request port's frames this build speaks. 1: length and JSON, no version
/// byte (before 2026-12). 2: the version byte; the generation types of
/// [`super::generate`]. 3: the worker numbers each request it accepts (`accepted`, first),
/// and its load reports say how many it had accepted. 4: a request's service class and cache
/// salt (a worker of version 3 would ignore the salt and share the KV of tenants that must
/// not share it, so the version changes). 5: a request's tenant and its store quota (a worker
/// of version 4 would let a tenant fill the store past its quota). 6: the tenant's host and
/// disk quotas.
pub const PROTOCOL: u8 = 6;

/// Largest frame body (a 1M-token prompt as JSON fits).
pub const FRAME_MAX: usize = 16 << 20;

/// Bytes before a frame's body.
pub const HEADER_BYTES: usize = 5;

/// What a frontend asks of a worker.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct WorkerRequest {
    /// The model (the worker refuses others).
    pub model: String,
    /// The generation.
    pub request: GenerateRequest,
}

/// Why a frame header was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum FrameHeaderError {
    /// A body over [`FRAME_MAX`].
    #[error("frame of {0} bytes is over the limit of {FRAME_MAX}")]
    TooLarge(usize),
    /// The peer speaks another version of the protocol.
    #[error(
        "the peer speaks worker protocol {theirs}{}, this build speaks {PROTOCOL}: run the same \
         kvfabric release on frontends and workers",
        if *theirs == 1 { " (unversioned frames)" } else { "" }
    )]
    Version {
        /// The peer's version.
        theirs: u8,
    },
}

/// The header of a frame of `len` body bytes.
pub fn encode_header(len: usize) -> Result<[u8; HEADER_BYTES], FrameHeaderError> {
    if len > FRAME_MAX {
        return Err(FrameHeaderError::TooLarge(len));
    }
    let n = (len as u32).to_le_bytes();
    Ok([n[0], n[1], n[2], n[3], PROTOCOL])
}

/// The body length a header announces, bounded by [`FRAME_MAX`], once its version is ours.
pub fn decode_header(h: [u8; HEADER_BYTES]) -> Result<usize, FrameHeaderError> {
    let version = match h[4] {
        // Version 1's body began where the version byte is: a JSON object.
        b'{' => 1,
        v => v,
    };
    if version != PROTOCOL {
        return Err(FrameHeaderError::Version { theirs: version });
    }
    let n = u32::from_le_bytes([h[0], h[1], h[2], h[3]]) as usize;
    if n > FRAME_MAX {
        return Err(FrameHeaderError::TooLarge(n));
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_and_other_versions_are_named() {
        let h = encode_header(1234).unwrap();
        assert_eq!(decode_header(h), Ok(1234));
        assert_eq!(encode_header(FRAME_MAX + 1), Err(FrameHeaderError::TooLarge(FRAME_MAX + 1)));
        let mut big = h;
        big[..4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(decode_header(big), Err(FrameHeaderError::TooLarge(u32::MAX as usize)));
        // A version-1 frame: length, then `{"model":...`.
        let v1 = [10, 0, 0, 0, b'{'];
        let e = decode_header(v1).unwrap_err();
        assert_eq!(e, FrameHeaderError::Version { theirs: 1 });
        let said = e.to_string();
        assert!(said
            .contains(&format!("protocol 1 (unversioned frames), this build speaks {PROTOCOL}")));
        let next = [10, 0, 0, 0, PROTOCOL + 1];
        assert_eq!(decode_header(next), Err(FrameHeaderError::Version { theirs: PROTOCOL + 1 }));
    }
}
