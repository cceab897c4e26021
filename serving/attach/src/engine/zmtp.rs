//! Just enough ZeroMQ (ZMTP 3.0, NULL security) to subscribe to an engine's KV events and to
//! ask its replay endpoint: a SUB socket (connecting, or bound for an engine that connects)
//! and a DEALER socket, over TCP.
//!
//! Written here rather than taken from a crate: the pure-Rust `zeromq` crate reads a frame of
//! whatever length the peer announces (up to the address space) with no bound on a message's
//! size or frame count, and brings its own runtime glue; the `zmq` crate needs libzmq. This is
//! ~300 lines, bounded everywhere (message size, frames per message, greeting and handshake
//! deadline), and reads a frame's body as it arrives.
//!
//! ZMTP 3.0 is announced (not 3.1), so the engine's libzmq takes subscriptions as messages
//! (`0x01` + topic) and sends no heartbeats. NULL security means the stream is not
//! authenticated: engines publish in the clear. Bind only to addresses the engine alone can
//! reach (loopback by default).

use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// A ZMTP failure.
#[derive(Debug, thiserror::Error)]
pub enum ZmtpError {
    /// The socket failed.
    #[error("connection: {0}")]
    Io(#[from] std::io::Error),
    /// The peer does not speak ZMTP 3 with NULL security, or is not the socket type needed.
    #[error("handshake: {0}")]
    Handshake(String),
    /// A message over the limits.
    #[error("message over the limit: {0}")]
    TooLarge(String),
    /// A frame that breaks the protocol.
    #[error("protocol: {0}")]
    Protocol(&'static str),
    /// No handshake in time.
    #[error("no handshake within {0:?}")]
    Timeout(Duration),
}

/// The socket types used here, and their peers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SocketType {
    /// Subscribes to a PUB (or XPUB).
    Sub,
    /// Talks to a ROUTER.
    Dealer,
}

impl SocketType {
    fn name(self) -> &'static [u8] {
        match self {
            SocketType::Sub => b"SUB",
            SocketType::Dealer => b"DEALER",
        }
    }

    fn accepts(self, peer: &[u8]) -> bool {
        match self {
            SocketType::Sub => peer == b"PUB" || peer == b"XPUB",
            SocketType::Dealer => peer == b"ROUTER" || peer == b"DEALER",
        }
    }
}

/// Limits on what a peer may send.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Largest message (all frames).
    pub message_max: usize,
    /// Most frames in one message.
    pub frames_max: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { message_max: 64 << 20, frames_max: 8 }
    }
}

const FLAG_MORE: u8 = 0x01;
const FLAG_LONG: u8 = 0x02;
const FLAG_COMMAND: u8 = 0x04;

fn greeting() -> [u8; 64] {
    let mut g = [0u8; 64];
    g[0] = 0xff;
    g[9] = 0x7f;
    g[10] = 3; // major
    g[11] = 0; // minor: 3.0
    g[12..16].copy_from_slice(b"NULL");
    g
}

/// One ZMTP connection after its handshake.
#[derive(Debug)]
pub struct Connection<S> {
    stream: S,
    limits: Limits,
}

impl<S: AsyncRead + AsyncWrite + Unpin> Connection<S> {
    /// Performs the handshake as `ours` within `timeout`.
    pub async fn handshake(
        stream: S,
        ours: SocketType,
        limits: Limits,
        timeout: Duration,
    ) -> Result<Self, ZmtpError> {
        match tokio::time::timeout(timeout, Self::handshake_inner(stream, ours, limits)).await {
            Ok(r) => r,
            Err(_) => Err(ZmtpError::Timeout(timeout)),
        }
    }

    async fn handshake_inner(
        mut stream: S,
        ours: SocketType,
        limits: Limits,
    ) -> Result<Self, ZmtpError> {
        stream.write_all(&greeting()).await?;
        let mut peer = [0u8; 64];
        stream.read_exact(&mut peer).await?;
        if peer[0] != 0xff || peer[9] & 0x01 == 0 {
            return Err(ZmtpError::Handshake("not a ZMTP peer".into()));
        }
        if peer[10] < 3 {
            return Err(ZmtpError::Handshake(format!("ZMTP {}.x is too old", peer[10])));
        }
        let mech = &peer[12..32];
        if &mech[..4] != b"NULL" || mech[4..].iter().any(|&b| b != 0) {
            let name = String::from_utf8_lossy(mech).trim_end_matches('\0').to_string();
            return Err(ZmtpError::Handshake(format!("security mechanism {name:?} (only NULL)")));
        }
        // READY with our socket type.
        let mut body = Vec::with_capacity(32);
        body.push(5);
        body.extend_from_slice(b"READY");
        let name = ours.name();
        body.push(11);
        body.extend_from_slice(b"Socket-Type");
        body.extend_from_slice(&(name.len() as u32).to_be_bytes());
        body.extend_from_slice(name);
        if ours == SocketType::Dealer {
            body.push(8);
            body.extend_from_slice(b"Identity");
            body.extend_from_slice(&0u32.to_be_bytes());
        }
        let mut conn = Connection { stream, limits };
        conn.write_frame(FLAG_COMMAND, &body).await?;
        conn.stream.flush().await?;
        let (flags, cmd) = conn.read_frame(4096).await?;
        if flags & FLAG_COMMAND == 0 {
            return Err(ZmtpError::Handshake("expected READY, got a message".into()));
        }
        let props = parse_ready(&cmd)?;
        let peer_type = props
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(b"Socket-Type"))
            .map(|(_, v)| *v)
            .ok_or_else(|| ZmtpError::Handshake("READY without Socket-Type".into()))?;
        if !ours.accepts(peer_type) {
            return Err(ZmtpError::Handshake(format!(
                "a {} socket cannot talk to a {} socket",
                String::from_utf8_lossy(ours.name()),
                String::from_utf8_lossy(peer_type)
            )));
        }
        Ok(conn)
    }

    async fn write_frame(&mut self, flags: u8, body: &[u8]) -> Result<(), ZmtpError> {
        if body.len() > 255 {
            self.stream.write_all(&[flags | FLAG_LONG]).await?;
            self.stream.write_all(&(body.len() as u64).to_be_bytes()).await?;
        } else {
            self.stream.write_all(&[flags, body.len() as u8]).await?;
        }
        self.stream.write_all(body).await?;
        Ok(())
    }

    /// Reads one frame of at most `max` bytes; the body is read as it arrives.
    async fn read_frame(&mut self, max: usize) -> Result<(u8, Vec<u8>), ZmtpError> {
        let flags = self.stream.read_u8().await?;
        if flags & !(FLAG_MORE | FLAG_LONG | FLAG_COMMAND) != 0 {
            return Err(ZmtpError::Protocol("reserved frame flags set"));
        }
        let len = if flags & FLAG_LONG != 0 {
            self.stream.read_u64().await?
        } else {
            u64::from(self.stream.read_u8().await?)
        };
        if len > max as u64 {
            return Err(ZmtpError::TooLarge(format!("a frame of {len} bytes (limit {max})")));
        }
        let mut body = Vec::new();
        (&mut self.stream).take(len).read_to_end(&mut body).await?;
        if body.len() as u64 != len {
            return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
        }
        Ok((flags, body))
    }

    /// Sends one message.
    pub async fn send(&mut self, frames: &[&[u8]]) -> Result<(), ZmtpError> {
        for (i, f) in frames.iter().enumerate() {
            let more = if i + 1 < frames.len() { FLAG_MORE } else { 0 };
            self.write_frame(more, f).await?;
        }
        self.stream.flush().await?;
        Ok(())
    }

    /// Subscribes to messages whose first frame starts with `topic` (a SUB socket).
    pub async fn subscribe(&mut self, topic: &[u8]) -> Result<(), ZmtpError> {
        let mut m = Vec::with_capacity(topic.len() + 1);
        m.push(1);
        m.extend_from_slice(topic);
        self.send(&[&m]).await
    }

    /// Receives the next message (commands are skipped), within the limits.
    pub async fn recv(&mut self) -> Result<Vec<Vec<u8>>, ZmtpError> {
        let mut frames = Vec::new();
        let mut total = 0usize;
        loop {
            let (flags, body) = self.read_frame(self.limits.message_max - total).await?;
            if flags & FLAG_COMMAND != 0 {
                if !frames.is_empty() {
                    return Err(ZmtpError::Protocol("a command inside a message"));
                }
                continue; // PING, SUBSCRIBE echoes, ...: nothing to do at 3.0
            }
            total += body.len();
            frames.push(body);
            if flags & FLAG_MORE == 0 {
                return Ok(frames);
            }
            if frames.len() >= self.limits.frames_max {
                return Err(ZmtpError::TooLarge(format!(
                    "more than {} frames in a message",
                    self.limits.frames_max
                )));
            }
        }
    }
}

/// A READY property: its name and value.
type Property<'a> = (&'a [u8], &'a [u8]);

/// The properties of a READY command body.
fn parse_ready(cmd: &[u8]) -> Result<Vec<Property<'_>>, ZmtpError> {
    let bad = || ZmtpError::Handshake("malformed READY".into());
    let (&n, rest) = cmd.split_first().ok_or_else(bad)?;
    let n = usize::from(n);
    if rest.len() < n || &rest[..n] != b"READY" {
        return Err(ZmtpError::Handshake("expected READY".into()));
    }
    let mut p = &rest[n..];
    let mut props = Vec::new();
    while !p.is_empty() {
        let (&kn, r) = p.split_first().ok_or_else(bad)?;
        let kn = usize::from(kn);
        if r.len() < kn + 4 {
            return Err(bad());
        }
        let (k, r) = r.split_at(kn);
        let vn = u32::from_be_bytes([r[0], r[1], r[2], r[3]]) as usize;
        let r = &r[4..];
        if r.len() < vn {
            return Err(bad());
        }
        props.push((k, &r[..vn]));
        p = &r[vn..];
    }
    Ok(props)
}

/// A `tcp://host:port` endpoint's address; `*` stands for every interface.
pub fn tcp_address(endpoint: &str) -> Result<String, String> {
    let rest = endpoint
        .strip_prefix("tcp://")
        .ok_or_else(|| format!("{endpoint:?}: only tcp:// endpoints are supported"))?;
    let (host, port) = rest.rsplit_once(':').ok_or_else(|| format!("{endpoint:?}: no port"))?;
    port.parse::<u16>().map_err(|_| format!("{endpoint:?}: bad port"))?;
    let host = if host == "*" { "0.0.0.0" } else { host };
    Ok(format!("{host}:{port}"))
}

/// A fake peer for tests: the greeting, READY as `kind`, then `then`; then it holds the
/// stream open, reading what comes, until the other side closes.
#[cfg(test)]
pub(super) async fn fake_peer<S: AsyncRead + AsyncWrite + Unpin>(
    mut s: S,
    kind: &[u8],
    then: Vec<u8>,
) {
    if s.write_all(&greeting()).await.is_err() {
        return;
    }
    let mut g = [0u8; 64];
    if s.read_exact(&mut g).await.is_err() {
        return;
    }
    let mut body = vec![5];
    body.extend_from_slice(b"READY");
    body.push(11);
    body.extend_from_slice(b"Socket-Type");
    body.extend_from_slice(&(kind.len() as u32).to_be_bytes());
    body.extend_from_slice(kind);
    let _ = s.write_all(&[FLAG_COMMAND, body.len() as u8]).await;
    let _ = s.write_all(&body).await;
    let _ = s.write_all(&then).await;
    let mut sink = Vec::new();
    let _ = s.read_to_end(&mut sink).await;
}

/// A message's frames on the wire (short frames), for tests.
#[cfg(test)]
pub(super) fn fake_message(frames: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::new();
    for (i, f) in frames.iter().enumerate() {
        let more = if i + 1 < frames.len() { FLAG_MORE } else { 0 };
        out.push(more | FLAG_LONG);
        out.extend_from_slice(&(f.len() as u64).to_be_bytes());
        out.extend_from_slice(f);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake peer: greeting, READY as `kind`, then `then`.
    async fn peer(s: tokio::io::DuplexStream, kind: &[u8], then: Vec<u8>) {
        fake_peer(s, kind, then).await
    }

    #[tokio::test]
    async fn a_sub_reads_multipart_messages_and_skips_commands() {
        let (a, b) = tokio::io::duplex(1 << 16);
        let mut then = vec![FLAG_COMMAND, 5, 4, b'P', b'I', b'N', b'G'];
        then.extend_from_slice(&[FLAG_MORE, 2, b'k', b'v', FLAG_MORE | FLAG_LONG]);
        then.extend_from_slice(&8u64.to_be_bytes());
        then.extend_from_slice(&7u64.to_be_bytes());
        then.extend_from_slice(&[0, 3, 1, 2, 3]);
        tokio::spawn(peer(b, b"PUB", then));
        let mut c =
            Connection::handshake(a, SocketType::Sub, Limits::default(), Duration::from_secs(5))
                .await
                .unwrap();
        let m = c.recv().await.unwrap();
        assert_eq!(m, vec![b"kv".to_vec(), 7u64.to_be_bytes().to_vec(), vec![1, 2, 3]]);
    }

    #[tokio::test]
    async fn wrong_peers_and_oversize_frames_are_refused() {
        let (a, b) = tokio::io::duplex(1 << 16);
        tokio::spawn(peer(b, b"REQ", vec![]));
        let e =
            Connection::handshake(a, SocketType::Sub, Limits::default(), Duration::from_secs(5))
                .await
                .unwrap_err();
        assert!(e.to_string().contains("cannot talk to a REQ"), "{e}");

        let (a, b) = tokio::io::duplex(1 << 16);
        let mut then = vec![FLAG_LONG];
        then.extend_from_slice(&u64::MAX.to_be_bytes());
        tokio::spawn(peer(b, b"PUB", then));
        let limits = Limits { message_max: 1 << 20, frames_max: 4 };
        let mut c = Connection::handshake(a, SocketType::Sub, limits, Duration::from_secs(5))
            .await
            .unwrap();
        assert!(matches!(c.recv().await, Err(ZmtpError::TooLarge(_))));

        // A silent peer: the handshake times out.
        let (a, _b) = tokio::io::duplex(1 << 16);
        let e = Connection::handshake(a, SocketType::Sub, limits, Duration::from_millis(50))
            .await
            .unwrap_err();
        assert!(matches!(e, ZmtpError::Timeout(_)));
        assert_eq!(tcp_address("tcp://*:5557").unwrap(), "0.0.0.0:5557");
        assert!(tcp_address("ipc:///tmp/x").is_err());
    }
}
