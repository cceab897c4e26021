//! The wire protocol between agents: versioned, length-prefixed binary frames.
//!
//! Every frame starts with a 16-byte header, all integers little-endian:
//!
//! ```text
//! u32 body_len | u8 version (1) | u8 kind | u16 flags (0) | u64 request_id
//! ```
//!
//! then `body_len` bytes of body (the [`Message`]). Bulk data is not part of the body: a
//! `Write` request and a `ReadData` response are followed directly by the bytes of their
//! descriptors, in order, which the receiver reads straight into registered memory — no
//! intermediate buffer.
//!
//! Before anything else, a connection runs an authenticated handshake (see [`handshake_mac`]):
//! the server sends `Challenge{nonce_s}`, the client answers `Hello{name, nonce_c,
//! HMAC(secret, "kvfabric/1 client" ‖ nonce_s ‖ nonce_c ‖ name)}`, the server checks it and
//! answers `Welcome{HMAC(secret, "kvfabric/1 server" ‖ nonce_c ‖ nonce_s)}`, which the client
//! checks. Without the secret a peer gets no data and can send none.
//!
//! Decoding treats input as hostile: every length is checked against [`WireLimits`] before
//! anything is allocated, and malformed input is a [`WireError`], never a panic.

pub mod rdma;

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Protocol version carried in every frame.
pub const WIRE_VERSION: u8 = 1;
/// Bytes of a frame header.
pub const HEADER_BYTES: usize = 16;
/// Bytes of a handshake nonce.
pub const NONCE_BYTES: usize = 32;
/// Bytes of a handshake MAC (HMAC-SHA256).
pub const MAC_BYTES: usize = 32;

/// Limits every decoder enforces; part of the agent's documented configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WireLimits {
    /// Largest frame body accepted, bytes (bulk data not counted).
    pub frame_bytes_max: u32,
    /// Most descriptors in one request.
    pub descs_per_request_max: u32,
    /// Largest notification message, bytes.
    pub notify_bytes_max: u32,
    /// Longest agent name or error text, bytes.
    pub text_bytes_max: u32,
}

impl Default for WireLimits {
    fn default() -> Self {
        WireLimits {
            frame_bytes_max: 1 << 20,
            descs_per_request_max: 16_384,
            notify_bytes_max: 64 << 10,
            text_bytes_max: 4096,
        }
    }
}

/// Why a frame could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// The frame's version is not ours.
    #[error("unsupported protocol version {0} (this build speaks {WIRE_VERSION})")]
    Version(u8),
    /// An unknown frame kind.
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    /// The body is shorter than its fields.
    #[error("frame body truncated")]
    Truncated,
    /// The body is longer than its fields.
    #[error("{0} trailing byte(s) after the frame body")]
    Trailing(usize),
    /// A length over the configured limits.
    #[error("{what} of {value} exceeds the limit of {limit}")]
    TooLarge {
        /// What was too large.
        what: &'static str,
        /// The value received.
        value: u64,
        /// The limit.
        limit: u64,
    },
    /// A string that is not UTF-8.
    #[error("text field is not UTF-8")]
    BadUtf8,
    /// A field with an impossible value.
    #[error("invalid field: {0}")]
    Invalid(&'static str),
    /// The bytes are a TLS ClientHello: the peer uses TLS and this side does not.
    #[error("the peer speaks TLS, and this side runs without it (give both sides --tls-ca, --tls-cert and --tls-key)")]
    Tls,
}

/// Error codes carried in `Error` frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
pub enum ErrorCode {
    /// Authentication failed.
    Auth = 1,
    /// A descriptor names an unknown region.
    UnknownRegion = 2,
    /// A descriptor names a region the owner did not export.
    NotExported = 3,
    /// A descriptor lies outside its region.
    OutOfBounds = 4,
    /// A checksum did not match the bytes received.
    Checksum = 5,
    /// A limit was exceeded.
    TooLarge = 6,
    /// The frame was malformed.
    Malformed = 7,
    /// The owner is shutting down or overloaded.
    Unavailable = 8,
    /// Anything else.
    Internal = 9,
    /// The port requires mutual TLS and the peer connected without it.
    TlsRequired = 10,
}

impl ErrorCode {
    fn from_u16(v: u16) -> Self {
        match v {
            1 => ErrorCode::Auth,
            2 => ErrorCode::UnknownRegion,
            3 => ErrorCode::NotExported,
            4 => ErrorCode::OutOfBounds,
            5 => ErrorCode::Checksum,
            6 => ErrorCode::TooLarge,
            7 => ErrorCode::Malformed,
            8 => ErrorCode::Unavailable,
            10 => ErrorCode::TlsRequired,
            _ => ErrorCode::Internal,
        }
    }
}

/// A descriptor on the wire: a range of the receiver's region, with an optional checksum.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WireDesc {
    /// The owner's region id.
    pub region: u64,
    /// Offset in the region.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
    /// XXH3-64 of the bytes, when the transfer is checksummed.
    pub checksum: Option<u64>,
}

/// Frame kinds.
mod kind {
    pub const CHALLENGE: u8 = 1;
    pub const HELLO: u8 = 2;
    pub const WELCOME: u8 = 3;
    pub const ERROR: u8 = 4;
    pub const WRITE: u8 = 10;
    pub const READ: u8 = 11;
    pub const READ_DATA: u8 = 12;
    pub const COMMIT: u8 = 13;
    pub const CHECKSUMS: u8 = 14;
    pub const CHECKSUM_LIST: u8 = 15;
    pub const ACK: u8 = 16;
    pub const RPC: u8 = 17;
    pub const RPC_REPLY: u8 = 18;
    pub const RDMA_CONNECT: u8 = 19;
    pub const RDMA_ACCEPT: u8 = 20;
}

/// A decoded message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    /// Server → client: the handshake challenge.
    Challenge {
        /// The server's agent name.
        server_name: String,
        /// Server nonce.
        nonce: [u8; NONCE_BYTES],
    },
    /// Client → server: the client's proof.
    Hello {
        /// The client's agent name.
        client_name: String,
        /// Client nonce.
        nonce: [u8; NONCE_BYTES],
        /// HMAC over the challenge.
        mac: [u8; MAC_BYTES],
    },
    /// Server → client: the server's proof.
    Welcome {
        /// HMAC over both nonces.
        mac: [u8; MAC_BYTES],
    },
    /// A typed failure of the request with the frame's request id.
    Error {
        /// What went wrong.
        code: ErrorCode,
        /// Text for humans.
        message: String,
    },
    /// Client → server: bytes for these descriptors follow, in order.
    Write {
        /// The client's transfer id (for logs).
        transfer_id: u64,
        /// Destination descriptors in the server's memory.
        descs: Vec<WireDesc>,
    },
    /// Client → server: send the bytes of these descriptors.
    Read {
        /// The client's transfer id.
        transfer_id: u64,
        /// Source descriptors in the server's memory.
        descs: Vec<WireDesc>,
        /// Whether to send a checksum per descriptor.
        checksums: bool,
    },
    /// Server → client: the bytes of a `Read` follow, in order.
    ReadData {
        /// Per-descriptor checksums when asked for, else empty.
        checksums: Vec<u64>,
    },
    /// Client → server: a transfer's data is complete; verify these checksums against the
    /// owner's memory, then deliver the notification.
    Commit {
        /// The client's transfer id.
        transfer_id: u64,
        /// Descriptors (with checksums) to verify; may be empty.
        verify: Vec<WireDesc>,
        /// The notification to deliver, if any.
        notify: Option<Vec<u8>>,
    },
    /// Client → server: compute checksums of these descriptors (shm READ verification).
    Checksums {
        /// Descriptors in the server's memory.
        descs: Vec<WireDesc>,
    },
    /// Server → client: the checksums asked for.
    ChecksumList {
        /// One per descriptor.
        checksums: Vec<u64>,
    },
    /// Success without data.
    Ack,
    /// Client → server: a call to the server's RPC handler (services on top of the agent,
    /// such as the fabric node's lookup/get/put).
    Rpc {
        /// The service's method number.
        method: u16,
        /// The request, encoded by the service.
        body: Vec<u8>,
    },
    /// Server → client: the handler's answer.
    RpcReply {
        /// The reply, encoded by the service.
        body: Vec<u8>,
    },
    /// Client → server: connect RDMA queue pairs to these
    /// ([`rdma`]).
    RdmaConnect(rdma::Connect),
    /// Server → client: its queue pairs and the keys of its exported regions.
    RdmaAccept(rdma::Accept),
}

/// A decoded frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    /// Body length.
    pub body_len: u32,
    /// Frame kind.
    pub kind: u8,
    /// Correlation id echoed by the response.
    pub request_id: u64,
}

impl FrameHeader {
    /// Decodes and checks a header.
    pub fn decode(b: &[u8; HEADER_BYTES], limits: &WireLimits) -> Result<Self, WireError> {
        let body_len = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        if b[4] != WIRE_VERSION {
            // A TLS record carrying a handshake: 0x16, then version 3.x.
            if b[0] == 0x16 && b[1] == 0x03 && b[2] <= 0x04 {
                return Err(WireError::Tls);
            }
            return Err(WireError::Version(b[4]));
        }
        let kind = b[5];
        if !matches!(kind, 1..=4 | 10..=20) {
            return Err(WireError::UnknownKind(kind));
        }
        if u16::from_le_bytes([b[6], b[7]]) != 0 {
            return Err(WireError::Invalid("flags"));
        }
        if body_len > limits.frame_bytes_max {
            return Err(WireError::TooLarge {
                what: "frame body",
                value: u64::from(body_len),
                limit: u64::from(limits.frame_bytes_max),
            });
        }
        let mut id = [0u8; 8];
        id.copy_from_slice(&b[8..16]);
        Ok(FrameHeader { body_len, kind, request_id: u64::from_le_bytes(id) })
    }
}

struct Cursor<'a> {
    b: &'a [u8],
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        if self.b.len() < n {
            return Err(WireError::Truncated);
        }
        let (head, rest) = self.b.split_at(n);
        self.b = rest;
        Ok(head)
    }
    fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, WireError> {
        let s = self.take(2)?;
        Ok(u16::from_le_bytes([s[0], s[1]]))
    }
    fn u32(&mut self) -> Result<u32, WireError> {
        let s = self.take(4)?;
        Ok(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    }
    fn u64(&mut self) -> Result<u64, WireError> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(a))
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], WireError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    fn bytes(&mut self, what: &'static str, max: u32) -> Result<&'a [u8], WireError> {
        let n = self.u32()?;
        if n > max {
            return Err(WireError::TooLarge { what, value: u64::from(n), limit: u64::from(max) });
        }
        self.take(n as usize)
    }
    fn text(&mut self, limits: &WireLimits) -> Result<String, WireError> {
        let b = self.bytes("text", limits.text_bytes_max)?;
        String::from_utf8(b.to_vec()).map_err(|_| WireError::BadUtf8)
    }
    fn descs(&mut self, limits: &WireLimits) -> Result<Vec<WireDesc>, WireError> {
        let n = self.u32()?;
        if n > limits.descs_per_request_max {
            return Err(WireError::TooLarge {
                what: "descriptor count",
                value: u64::from(n),
                limit: u64::from(limits.descs_per_request_max),
            });
        }
        let with_checksum = match self.u8()? {
            0 => false,
            // Canonical form: an empty list never carries the flag.
            1 if n > 0 => true,
            _ => return Err(WireError::Invalid("checksum flag")),
        };
        let each = if with_checksum { 32 } else { 24 };
        if self.b.len() < n as usize * each {
            return Err(WireError::Truncated);
        }
        let mut out = Vec::with_capacity(n as usize);
        for _ in 0..n {
            let region = self.u64()?;
            let offset = self.u64()?;
            let len = self.u64()?;
            let checksum = if with_checksum { Some(self.u64()?) } else { None };
            out.push(WireDesc { region, offset, len, checksum });
        }
        Ok(out)
    }
    fn u64s(&mut self, limits: &WireLimits) -> Result<Vec<u64>, WireError> {
        let n = self.u32()?;
        if n > limits.descs_per_request_max {
            return Err(WireError::TooLarge {
                what: "checksum count",
                value: u64::from(n),
                limit: u64::from(limits.descs_per_request_max),
            });
        }
        if self.b.len() < n as usize * 8 {
            return Err(WireError::Truncated);
        }
        (0..n).map(|_| self.u64()).collect()
    }
}

fn put_text(out: &mut Vec<u8>, s: &[u8]) {
    out.extend_from_slice(&(s.len() as u32).to_le_bytes());
    out.extend_from_slice(s);
}

fn put_descs(out: &mut Vec<u8>, descs: &[WireDesc]) {
    out.extend_from_slice(&(descs.len() as u32).to_le_bytes());
    let with_checksum = descs.iter().any(|d| d.checksum.is_some());
    out.push(u8::from(with_checksum));
    for d in descs {
        out.extend_from_slice(&d.region.to_le_bytes());
        out.extend_from_slice(&d.offset.to_le_bytes());
        out.extend_from_slice(&d.len.to_le_bytes());
        if with_checksum {
            out.extend_from_slice(&d.checksum.unwrap_or(0).to_le_bytes());
        }
    }
}

fn put_u64s(out: &mut Vec<u8>, v: &[u64]) {
    out.extend_from_slice(&(v.len() as u32).to_le_bytes());
    for x in v {
        out.extend_from_slice(&x.to_le_bytes());
    }
}

impl Message {
    fn kind(&self) -> u8 {
        match self {
            Message::Challenge { .. } => kind::CHALLENGE,
            Message::Hello { .. } => kind::HELLO,
            Message::Welcome { .. } => kind::WELCOME,
            Message::Error { .. } => kind::ERROR,
            Message::Write { .. } => kind::WRITE,
            Message::Read { .. } => kind::READ,
            Message::ReadData { .. } => kind::READ_DATA,
            Message::Commit { .. } => kind::COMMIT,
            Message::Checksums { .. } => kind::CHECKSUMS,
            Message::ChecksumList { .. } => kind::CHECKSUM_LIST,
            Message::Ack => kind::ACK,
            Message::Rpc { .. } => kind::RPC,
            Message::RpcReply { .. } => kind::RPC_REPLY,
            Message::RdmaConnect(_) => kind::RDMA_CONNECT,
            Message::RdmaAccept(_) => kind::RDMA_ACCEPT,
        }
    }

    /// Encodes a whole frame (header and body) for `request_id`.
    pub fn encode(&self, request_id: u64) -> Vec<u8> {
        let mut out = vec![0u8; HEADER_BYTES];
        match self {
            Message::Challenge { server_name, nonce } => {
                put_text(&mut out, server_name.as_bytes());
                out.extend_from_slice(nonce);
            }
            Message::Hello { client_name, nonce, mac } => {
                put_text(&mut out, client_name.as_bytes());
                out.extend_from_slice(nonce);
                out.extend_from_slice(mac);
            }
            Message::Welcome { mac } => out.extend_from_slice(mac),
            Message::Error { code, message } => {
                out.extend_from_slice(&(*code as u16).to_le_bytes());
                put_text(&mut out, message.as_bytes());
            }
            Message::Write { transfer_id, descs } => {
                out.extend_from_slice(&transfer_id.to_le_bytes());
                put_descs(&mut out, descs);
            }
            Message::Read { transfer_id, descs, checksums } => {
                out.extend_from_slice(&transfer_id.to_le_bytes());
                out.push(u8::from(*checksums));
                put_descs(&mut out, descs);
            }
            Message::ReadData { checksums } => put_u64s(&mut out, checksums),
            Message::Commit { transfer_id, verify, notify } => {
                out.extend_from_slice(&transfer_id.to_le_bytes());
                put_descs(&mut out, verify);
                match notify {
                    None => out.push(0),
                    Some(n) => {
                        out.push(1);
                        put_text(&mut out, n);
                    }
                }
            }
            Message::Checksums { descs } => put_descs(&mut out, descs),
            Message::ChecksumList { checksums } => put_u64s(&mut out, checksums),
            Message::Ack => {}
            Message::Rpc { method, body } => {
                out.extend_from_slice(&method.to_le_bytes());
                out.extend_from_slice(body);
            }
            Message::RpcReply { body } => out.extend_from_slice(body),
            Message::RdmaConnect(c) => out.extend_from_slice(&c.encode()),
            Message::RdmaAccept(a) => out.extend_from_slice(&a.encode()),
        }
        let body_len = (out.len() - HEADER_BYTES) as u32;
        out[0..4].copy_from_slice(&body_len.to_le_bytes());
        out[4] = WIRE_VERSION;
        out[5] = self.kind();
        out[8..16].copy_from_slice(&request_id.to_le_bytes());
        out
    }

    /// Decodes a body of the given kind.
    pub fn decode(kind: u8, body: &[u8], limits: &WireLimits) -> Result<Message, WireError> {
        let mut c = Cursor { b: body };
        let msg = match kind {
            kind::CHALLENGE => {
                Message::Challenge { server_name: c.text(limits)?, nonce: c.array()? }
            }
            kind::HELLO => {
                Message::Hello { client_name: c.text(limits)?, nonce: c.array()?, mac: c.array()? }
            }
            kind::WELCOME => Message::Welcome { mac: c.array()? },
            kind::ERROR => {
                Message::Error { code: ErrorCode::from_u16(c.u16()?), message: c.text(limits)? }
            }
            kind::WRITE => Message::Write { transfer_id: c.u64()?, descs: c.descs(limits)? },
            kind::READ => {
                let transfer_id = c.u64()?;
                let checksums = match c.u8()? {
                    0 => false,
                    1 => true,
                    _ => return Err(WireError::Invalid("checksum flag")),
                };
                Message::Read { transfer_id, checksums, descs: c.descs(limits)? }
            }
            kind::READ_DATA => Message::ReadData { checksums: c.u64s(limits)? },
            kind::COMMIT => {
                let transfer_id = c.u64()?;
                let verify = c.descs(limits)?;
                let notify = match c.u8()? {
                    0 => None,
                    1 => Some(c.bytes("notification", limits.notify_bytes_max)?.to_vec()),
                    _ => return Err(WireError::Invalid("notify flag")),
                };
                Message::Commit { transfer_id, verify, notify }
            }
            kind::CHECKSUMS => Message::Checksums { descs: c.descs(limits)? },
            kind::CHECKSUM_LIST => Message::ChecksumList { checksums: c.u64s(limits)? },
            kind::ACK => Message::Ack,
            kind::RPC => {
                let method = c.u16()?;
                let body = c.take(c.b.len())?.to_vec();
                Message::Rpc { method, body }
            }
            kind::RPC_REPLY => Message::RpcReply { body: c.take(c.b.len())?.to_vec() },
            kind::RDMA_CONNECT => {
                let body = c.take(c.b.len())?;
                Message::RdmaConnect(rdma::Connect::decode(body).map_err(exchange_error)?)
            }
            kind::RDMA_ACCEPT => {
                let body = c.take(c.b.len())?;
                Message::RdmaAccept(rdma::Accept::decode(body).map_err(exchange_error)?)
            }
            other => return Err(WireError::UnknownKind(other)),
        };
        if !c.b.is_empty() {
            return Err(WireError::Trailing(c.b.len()));
        }
        Ok(msg)
    }

    /// Decodes one whole frame from a byte slice (header and body, no bulk data): for tests
    /// and fuzzing. Returns the header and the message.
    pub fn decode_frame(
        bytes: &[u8],
        limits: &WireLimits,
    ) -> Result<(FrameHeader, Message), WireError> {
        let header: &[u8; HEADER_BYTES] = bytes
            .get(..HEADER_BYTES)
            .and_then(|h| h.try_into().ok())
            .ok_or(WireError::Truncated)?;
        let h = FrameHeader::decode(header, limits)?;
        let body = bytes.get(HEADER_BYTES..).ok_or(WireError::Truncated)?;
        if body.len() != h.body_len as usize {
            return Err(if body.len() < h.body_len as usize {
                WireError::Truncated
            } else {
                WireError::Trailing(body.len() - h.body_len as usize)
            });
        }
        Ok((h, Message::decode(h.kind, body, limits)?))
    }
}

fn exchange_error(e: rdma::ExchangeError) -> WireError {
    use rdma::ExchangeError as E;
    match e {
        E::Truncated => WireError::Truncated,
        E::Trailing(n) => WireError::Trailing(n),
        E::TooMany { what, value, limit } => {
            WireError::TooLarge { what, value: value as u64, limit: limit as u64 }
        }
        E::Invalid(what) => WireError::Invalid(what),
    }
}

/// Which side of the handshake a MAC proves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandshakeRole {
    /// The client's `Hello`.
    Client,
    /// The server's `Welcome`.
    Server,
}

/// The handshake MAC: `HMAC-SHA256(secret, label ‖ first ‖ second ‖ name)`, where the client
/// proves `(nonce_s, nonce_c, client_name)` and the server proves `(nonce_c, nonce_s, "")`.
pub fn handshake_mac(
    secret: &[u8],
    role: HandshakeRole,
    first: &[u8; NONCE_BYTES],
    second: &[u8; NONCE_BYTES],
    name: &str,
) -> [u8; MAC_BYTES] {
    let label: &[u8] = match role {
        HandshakeRole::Client => b"kvfabric/1 client",
        HandshakeRole::Server => b"kvfabric/1 server",
    };
    // HMAC accepts keys of any length; `new_from_slice` cannot fail for it.
    let mut mac = match <Hmac<Sha256> as Mac>::new_from_slice(secret) {
        Ok(m) => m,
        Err(_) => unreachable!("HMAC takes keys of any length"),
    };
    mac.update(label);
    mac.update(first);
    mac.update(second);
    mac.update(name.as_bytes());
    mac.finalize().into_bytes().into()
}

/// Checks a handshake MAC in constant time.
pub fn verify_handshake_mac(
    secret: &[u8],
    role: HandshakeRole,
    first: &[u8; NONCE_BYTES],
    second: &[u8; NONCE_BYTES],
    name: &str,
    mac: &[u8; MAC_BYTES],
) -> bool {
    let expected = handshake_mac(secret, role, first, second, name);
    // Constant-time comparison.
    expected.iter().zip(mac.iter()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn samples() -> Vec<Message> {
        let d = |ck| WireDesc { region: 3 << 32 | 7, offset: 4096, len: 1 << 20, checksum: ck };
        vec![
            Message::Challenge { server_name: "node-a".into(), nonce: [9; 32] },
            Message::Hello { client_name: "node-b".into(), nonce: [1; 32], mac: [2; 32] },
            Message::Welcome { mac: [3; 32] },
            Message::Error { code: ErrorCode::OutOfBounds, message: "range 1+2 outside".into() },
            Message::Write { transfer_id: 42, descs: vec![d(None), d(None)] },
            Message::Write { transfer_id: 43, descs: vec![d(Some(5)), d(Some(6))] },
            Message::Read { transfer_id: 44, descs: vec![d(None)], checksums: true },
            Message::ReadData { checksums: vec![1, 2, 3] },
            Message::Commit {
                transfer_id: 45,
                verify: vec![d(Some(7))],
                notify: Some(b"done".to_vec()),
            },
            Message::Commit { transfer_id: 46, verify: vec![], notify: None },
            Message::Checksums { descs: vec![d(None)] },
            Message::ChecksumList { checksums: vec![u64::MAX] },
            Message::Ack,
            Message::Rpc { method: 3, body: b"lookup".to_vec() },
            Message::RpcReply { body: vec![] },
        ]
    }

    #[test]
    fn every_message_round_trips() {
        let limits = WireLimits::default();
        for (i, m) in samples().into_iter().enumerate() {
            let bytes = m.encode(i as u64);
            let (h, back) = Message::decode_frame(&bytes, &limits).unwrap();
            assert_eq!(h.request_id, i as u64);
            assert_eq!(back, m);
        }
    }

    #[test]
    fn every_truncation_and_extension_is_an_error() {
        let limits = WireLimits::default();
        for m in samples() {
            let bytes = m.encode(1);
            for cut in 0..bytes.len() {
                assert!(Message::decode_frame(&bytes[..cut], &limits).is_err(), "{m:?} cut {cut}");
            }
            // A body that claims more bytes than its fields use (RPC bodies are opaque: any
            // length is theirs).
            if matches!(m, Message::Rpc { .. } | Message::RpcReply { .. }) {
                continue;
            }
            let mut longer = bytes.clone();
            longer.push(0);
            let body_len = (longer.len() - HEADER_BYTES) as u32;
            longer[..4].copy_from_slice(&body_len.to_le_bytes());
            assert!(matches!(
                Message::decode_frame(&longer, &limits),
                Err(WireError::Trailing(1)) | Err(WireError::Invalid(_))
            ));
        }
    }

    #[test]
    fn limits_are_enforced_before_allocation() {
        let limits = WireLimits { descs_per_request_max: 1, ..WireLimits::default() };
        let m = samples()[4].clone();
        assert!(matches!(
            Message::decode_frame(&m.encode(0), &limits),
            Err(WireError::TooLarge { what: "descriptor count", .. })
        ));
        let mut hdr = Message::Ack.encode(0);
        hdr[..4].copy_from_slice(&u32::MAX.to_le_bytes());
        let h: [u8; 16] = hdr[..16].try_into().unwrap();
        assert!(matches!(
            FrameHeader::decode(&h, &WireLimits::default()),
            Err(WireError::TooLarge { what: "frame body", .. })
        ));
        let mut v = Message::Ack.encode(0);
        v[4] = 2;
        assert!(matches!(Message::decode_frame(&v, &limits), Err(WireError::Version(2))));
        v[4] = 1;
        v[5] = 99;
        assert!(matches!(Message::decode_frame(&v, &limits), Err(WireError::UnknownKind(99))));
    }

    #[test]
    fn handshake_macs_bind_role_nonces_and_name() {
        let (a, b) = ([1u8; 32], [2u8; 32]);
        let mac = handshake_mac(b"secret", HandshakeRole::Client, &a, &b, "x");
        assert!(verify_handshake_mac(b"secret", HandshakeRole::Client, &a, &b, "x", &mac));
        assert!(!verify_handshake_mac(b"secreT", HandshakeRole::Client, &a, &b, "x", &mac));
        assert!(!verify_handshake_mac(b"secret", HandshakeRole::Server, &a, &b, "x", &mac));
        assert!(!verify_handshake_mac(b"secret", HandshakeRole::Client, &b, &a, "x", &mac));
        assert!(!verify_handshake_mac(b"secret", HandshakeRole::Client, &a, &b, "y", &mac));
    }

    proptest! {
        #[test]
        fn arbitrary_frames_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = Message::decode_frame(&bytes, &WireLimits::default());
        }

        #[test]
        fn arbitrary_bodies_never_panic(kind in 0u8..20, body in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = Message::decode(kind, &body, &WireLimits::default());
        }

        #[test]
        fn mutated_valid_frames_never_panic(which in 0usize..15, pos in any::<usize>(), byte in any::<u8>()) {
            let mut bytes = samples()[which].encode(7);
            let i = pos % bytes.len();
            bytes[i] = byte;
            let _ = Message::decode_frame(&bytes, &WireLimits::default());
        }

        #[test]
        fn descriptor_lists_round_trip(
            descs in proptest::collection::vec((any::<u64>(), any::<u64>(), any::<u64>()), 0..64),
            ck in any::<bool>(), id in any::<u64>(),
        ) {
            let descs: Vec<WireDesc> = descs.into_iter().enumerate()
                .map(|(i, (region, offset, len))| WireDesc { region, offset, len, checksum: ck.then_some(i as u64) })
                .collect();
            let m = Message::Write { transfer_id: id, descs };
            let (_, back) = Message::decode_frame(&m.encode(id), &WireLimits::default()).unwrap();
            prop_assert_eq!(back, m);
        }
    }
}
