//! The session protocol as plain state machines, in the manner of quinn-proto: bytes in,
//! bytes and events out, no sockets, no clock. The I/O driver ([`super::client`],
//! [`super::server`]) owns the socket and the timeouts; everything the protocol decides —
//! what a frame is, who may say what when, which reply answers which request — is decided
//! here and tested here without a socket.
//!
//! A connection goes `handshake → ready ⇄ request outstanding`, one request at a time. The
//! client proves the shared secret first (`Challenge → Hello → Welcome`); the server reads
//! nothing but a small `Hello` before that. Bulk payload (a WRITE's bytes after its frame, a
//! READ's bytes after `ReadData`) is not framed: the driver moves it between the socket and
//! registered memory directly, and tells the state machine how many bytes it moved, so that
//! the protocol still knows where the next frame starts.
//!
//! [`FrameReader::need`] tells the driver exactly how many bytes complete the next step: a
//! driver that reads exactly that many never reads payload into a frame buffer.

use crate::wire::{
    handshake_mac, verify_handshake_mac, ErrorCode, FrameHeader, HandshakeRole, Message, WireError,
    WireLimits, HEADER_BYTES, NONCE_BYTES,
};

/// Why a session cannot go on. Every variant ends the connection.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SessionError {
    /// The bytes are not a frame of this protocol.
    #[error(transparent)]
    Wire(#[from] WireError),
    /// The peer did not prove the shared secret, or refused our proof.
    #[error("authentication failed")]
    Auth,
    /// The server is not the agent we meant to reach.
    #[error("connected to {got:?}, expected {expected:?}")]
    WrongPeer {
        /// The name we dialled.
        expected: String,
        /// The name it gave.
        got: String,
    },
    /// A frame that is valid but not allowed now.
    #[error("unexpected {got} while {state}")]
    Unexpected {
        /// Where the connection was.
        state: &'static str,
        /// What arrived.
        got: &'static str,
    },
    /// A reply or request with the wrong id.
    #[error("request id {got} out of sequence (expected {expected})")]
    OutOfSequence {
        /// The id that was due (for requests: the lowest acceptable).
        expected: u64,
        /// The id that came.
        got: u64,
    },
    /// The peer refused during the handshake with an error frame.
    #[error("peer refused the connection ({code:?}): {message}")]
    Refused {
        /// Its code.
        code: ErrorCode,
        /// Its text.
        message: String,
    },
    /// The local side misused the connection (a driver bug, never the peer's doing).
    #[error("session misuse: {0}")]
    Misuse(&'static str),
    /// The connection already failed.
    #[error("the connection is closed")]
    Closed,
}

/// The short name of a message kind, for errors.
pub fn kind_name(m: &Message) -> &'static str {
    match m {
        Message::Challenge { .. } => "Challenge",
        Message::Hello { .. } => "Hello",
        Message::Welcome { .. } => "Welcome",
        Message::Error { .. } => "Error",
        Message::Write { .. } => "Write",
        Message::Read { .. } => "Read",
        Message::ReadData { .. } => "ReadData",
        Message::Commit { .. } => "Commit",
        Message::Checksums { .. } => "Checksums",
        Message::ChecksumList { .. } => "ChecksumList",
        Message::Ack => "Ack",
        Message::Rpc { .. } => "Rpc",
        Message::RpcReply { .. } => "RpcReply",
        Message::RdmaConnect(_) => "RdmaConnect",
        Message::RdmaAccept(_) => "RdmaAccept",
    }
}

/// The limits of the handshake: before authentication nothing larger than a `Hello` (a name
/// of at most `text_bytes_max`, a nonce, a MAC) is read.
pub fn handshake_limits(limits: &WireLimits) -> WireLimits {
    WireLimits {
        frame_bytes_max: (4 + limits.text_bytes_max + 64).min(limits.frame_bytes_max),
        ..*limits
    }
}

/// Assembles frames from bytes.
#[derive(Debug)]
pub struct FrameReader {
    limits: WireLimits,
    header: [u8; HEADER_BYTES],
    header_len: usize,
    parsed: Option<FrameHeader>,
    body: Vec<u8>,
}

impl FrameReader {
    /// A reader that enforces `limits`.
    pub fn new(limits: WireLimits) -> Self {
        FrameReader {
            limits,
            header: [0; HEADER_BYTES],
            header_len: 0,
            parsed: None,
            body: Vec::new(),
        }
    }

    /// Bytes that complete the current step: the rest of the header, or of the body. Never 0.
    pub fn need(&self) -> usize {
        match &self.parsed {
            None => HEADER_BYTES - self.header_len,
            Some(h) => h.body_len as usize - self.body.len(),
        }
    }

    /// Whether part of a frame has arrived (a driver bounds the rest in time).
    pub fn in_frame(&self) -> bool {
        self.header_len > 0
    }

    /// Consumes bytes up to the end of the next frame; returns how many it consumed and the
    /// frame if one completed. A header over the limits fails before its body is read.
    pub fn push(
        &mut self,
        bytes: &[u8],
    ) -> Result<(usize, Option<(FrameHeader, Message)>), WireError> {
        let mut used = 0;
        if self.parsed.is_none() {
            let n = (HEADER_BYTES - self.header_len).min(bytes.len());
            self.header[self.header_len..self.header_len + n].copy_from_slice(&bytes[..n]);
            self.header_len += n;
            used += n;
            if self.header_len < HEADER_BYTES {
                return Ok((used, None));
            }
            let h = FrameHeader::decode(&self.header, &self.limits)?;
            self.body = Vec::with_capacity(h.body_len as usize);
            self.parsed = Some(h);
        }
        let Some(h) = self.parsed else { return Ok((used, None)) };
        let n = (h.body_len as usize - self.body.len()).min(bytes.len() - used);
        self.body.extend_from_slice(&bytes[used..used + n]);
        used += n;
        if self.body.len() < h.body_len as usize {
            return Ok((used, None));
        }
        let msg = Message::decode(h.kind, &self.body, &self.limits);
        self.header_len = 0;
        self.parsed = None;
        self.body = Vec::new();
        Ok((used, Some((h, msg?))))
    }
}

/// What the client must know to open a session.
#[derive(Debug, Clone)]
pub struct ClientParams {
    /// Our name, proved with the secret.
    pub me: String,
    /// The agent we dial: the server must say this name.
    pub peer: String,
    /// The shared secret.
    pub secret: crate::secret::Secret,
    /// Limits of every frame we read.
    pub limits: WireLimits,
}

/// What the client learns from the server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientEvent {
    /// The server proved the secret: requests may be sent.
    Authenticated,
    /// The answer to the outstanding request: its expected reply or an `Error` frame.
    Reply(Message),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    Ack,
    ReadData { payload: u64 },
    ChecksumList { count: usize },
    RpcReply,
    RdmaAccept,
}

#[derive(Debug)]
enum ClientState {
    AwaitChallenge,
    AwaitWelcome {
        nonce_s: [u8; NONCE_BYTES],
    },
    Ready,
    Outstanding {
        id: u64,
        expect: Expect,
    },
    /// A READ's payload is still on the wire.
    Payload {
        remaining: u64,
    },
    Failed,
}

impl ClientState {
    fn name(&self) -> &'static str {
        match self {
            ClientState::AwaitChallenge => "awaiting the challenge",
            ClientState::AwaitWelcome { .. } => "awaiting the welcome",
            ClientState::Ready => "idle",
            ClientState::Outstanding { .. } => "awaiting a reply",
            ClientState::Payload { .. } => "receiving a payload",
            ClientState::Failed => "failed",
        }
    }
}

/// The client side of one connection.
#[derive(Debug)]
pub struct ClientProto {
    params: ClientParams,
    nonce_c: [u8; NONCE_BYTES],
    state: ClientState,
    reader: FrameReader,
    next_request: u64,
    transmit: Vec<u8>,
}

impl ClientProto {
    /// A connection about to read the server's challenge; `nonce_c` must be fresh.
    pub fn new(params: ClientParams, nonce_c: [u8; NONCE_BYTES]) -> Self {
        let reader = FrameReader::new(handshake_limits(&params.limits));
        ClientProto {
            params,
            nonce_c,
            state: ClientState::AwaitChallenge,
            reader,
            next_request: 1,
            transmit: Vec::new(),
        }
    }

    /// Bytes to read before the next step (see [`FrameReader::need`]).
    pub fn need(&self) -> usize {
        self.reader.need()
    }

    /// Whether a request may be sent now: authenticated, nothing outstanding.
    pub fn is_ready(&self) -> bool {
        matches!(self.state, ClientState::Ready)
    }

    /// Whether there are bytes to send.
    pub fn has_transmit(&self) -> bool {
        !self.transmit.is_empty()
    }

    /// Bytes to send now (the `Hello`), emptied by the call.
    pub fn take_transmit(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.transmit)
    }

    fn fail(&mut self, e: SessionError) -> SessionError {
        self.state = ClientState::Failed;
        e
    }

    /// Encodes `msg` as the next request. Only requests (`Write`, `Read`, `Commit`,
    /// `Checksums`, `Rpc`) may be sent, one at a time, after authentication.
    pub fn request(&mut self, msg: &Message) -> Result<Vec<u8>, SessionError> {
        if !self.is_ready() {
            return Err(SessionError::Misuse("a request while the connection is not idle"));
        }
        let expect = match msg {
            Message::Write { .. } | Message::Commit { .. } => Expect::Ack,
            Message::Read { descs, .. } => Expect::ReadData {
                payload: descs.iter().fold(0u64, |a, d| a.saturating_add(d.len)),
            },
            Message::Checksums { descs } => Expect::ChecksumList { count: descs.len() },
            Message::Rpc { .. } => Expect::RpcReply,
            Message::RdmaConnect(_) => Expect::RdmaAccept,
            _ => return Err(SessionError::Misuse("only requests are sent as requests")),
        };
        let id = self.next_request;
        self.next_request += 1;
        self.state = ClientState::Outstanding { id, expect };
        Ok(msg.encode(id))
    }

    /// The driver moved `n` bytes of a READ's payload into memory.
    pub fn payload_received(&mut self, n: u64) -> Result<(), SessionError> {
        match &mut self.state {
            ClientState::Payload { remaining } if n <= *remaining => {
                *remaining -= n;
                if *remaining == 0 {
                    self.state = ClientState::Ready;
                }
                Ok(())
            }
            _ => Err(self.fail(SessionError::Misuse("payload bytes that were not expected"))),
        }
    }

    /// Bytes of a READ's payload still to come.
    pub fn payload_remaining(&self) -> u64 {
        match self.state {
            ClientState::Payload { remaining } => remaining,
            _ => 0,
        }
    }

    /// Consumes bytes from the server; returns how many it used and the event they made.
    /// Call with at most [`ClientProto::need`] bytes to keep payload out of frame buffers.
    pub fn recv(&mut self, bytes: &[u8]) -> Result<(usize, Option<ClientEvent>), SessionError> {
        match self.state {
            ClientState::Failed => return Err(SessionError::Closed),
            ClientState::Payload { .. } => {
                return Err(self.fail(SessionError::Misuse("frame bytes during a payload")))
            }
            _ => {}
        }
        let (used, frame) = match self.reader.push(bytes) {
            Ok(r) => r,
            Err(e) => return Err(self.fail(e.into())),
        };
        let Some((h, msg)) = frame else { return Ok((used, None)) };
        match self.on_frame(h, msg) {
            Ok(ev) => Ok((used, ev)),
            Err(e) => Err(self.fail(e)),
        }
    }

    fn on_frame(
        &mut self,
        h: FrameHeader,
        msg: Message,
    ) -> Result<Option<ClientEvent>, SessionError> {
        let unexpected = |state: &ClientState, m: &Message| SessionError::Unexpected {
            state: state.name(),
            got: kind_name(m),
        };
        match (&self.state, msg) {
            (ClientState::AwaitChallenge, Message::Challenge { server_name, nonce }) => {
                if server_name != self.params.peer {
                    return Err(SessionError::WrongPeer {
                        expected: self.params.peer.clone(),
                        got: server_name,
                    });
                }
                let p = &self.params;
                let mac = handshake_mac(
                    p.secret.expose(),
                    HandshakeRole::Client,
                    &nonce,
                    &self.nonce_c,
                    &p.me,
                );
                let hello = Message::Hello { client_name: p.me.clone(), nonce: self.nonce_c, mac };
                self.transmit.extend_from_slice(&hello.encode(0));
                self.state = ClientState::AwaitWelcome { nonce_s: nonce };
                Ok(None)
            }
            (ClientState::AwaitWelcome { nonce_s }, Message::Welcome { mac }) => {
                let p = &self.params;
                if !verify_handshake_mac(
                    p.secret.expose(),
                    HandshakeRole::Server,
                    &self.nonce_c,
                    nonce_s,
                    "",
                    &mac,
                ) {
                    return Err(SessionError::Auth);
                }
                self.reader = FrameReader::new(self.params.limits);
                self.state = ClientState::Ready;
                Ok(Some(ClientEvent::Authenticated))
            }
            (
                ClientState::AwaitChallenge | ClientState::AwaitWelcome { .. },
                Message::Error { code, message },
            ) => Err(if code == ErrorCode::Auth {
                SessionError::Auth
            } else {
                SessionError::Refused { code, message }
            }),
            (ClientState::Outstanding { id, expect }, msg) => {
                let (id, expect) = (*id, *expect);
                // The server answers an unreadable frame with id 0: still the answer.
                let is_error = matches!(msg, Message::Error { .. });
                if h.request_id != id && !(is_error && h.request_id == 0) {
                    return Err(SessionError::OutOfSequence { expected: id, got: h.request_id });
                }
                let next = match (&msg, expect) {
                    (Message::Error { .. }, _) => ClientState::Ready,
                    (Message::Ack, Expect::Ack)
                    | (Message::RpcReply { .. }, Expect::RpcReply)
                    | (Message::RdmaAccept(_), Expect::RdmaAccept) => ClientState::Ready,
                    (Message::ChecksumList { checksums }, Expect::ChecksumList { count })
                        if checksums.len() == count =>
                    {
                        ClientState::Ready
                    }
                    (Message::ReadData { .. }, Expect::ReadData { payload: 0 }) => {
                        ClientState::Ready
                    }
                    (Message::ReadData { .. }, Expect::ReadData { payload }) => {
                        ClientState::Payload { remaining: payload }
                    }
                    _ => return Err(unexpected(&self.state, &msg)),
                };
                self.state = next;
                Ok(Some(ClientEvent::Reply(msg)))
            }
            (state, msg) => Err(unexpected(state, &msg)),
        }
    }
}

/// What the server must know to accept sessions.
#[derive(Debug, Clone)]
pub struct ServerParams {
    /// Our name, sent in the challenge.
    pub name: String,
    /// The shared secret.
    pub secret: crate::secret::Secret,
    /// Limits of every frame we read after authentication.
    pub limits: WireLimits,
}

/// What the server learns from a client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServerEvent {
    /// The client proved the secret under this name.
    Authenticated {
        /// The authenticated name.
        peer: String,
    },
    /// A request to answer with [`ServerProto::reply`]. A `Write`'s payload follows it on
    /// the wire: the driver consumes it (into memory, or drained) and reports it with
    /// [`ServerProto::payload_received`] before replying.
    Request {
        /// Its id, echoed by the reply.
        id: u64,
        /// The request.
        message: Message,
    },
}

#[derive(Debug)]
enum ServerState {
    AwaitHello,
    Ready,
    /// A request is being served; `payload` of a `Write`'s bytes are still on the wire.
    Serving {
        id: u64,
        payload: u64,
    },
    Closed,
}

impl ServerState {
    fn name(&self) -> &'static str {
        match self {
            ServerState::AwaitHello => "awaiting the hello",
            ServerState::Ready => "idle",
            ServerState::Serving { .. } => "serving a request",
            ServerState::Closed => "closed",
        }
    }
}

/// The server side of one connection.
#[derive(Debug)]
pub struct ServerProto {
    params: ServerParams,
    nonce_s: [u8; NONCE_BYTES],
    state: ServerState,
    reader: FrameReader,
    peer: Option<String>,
    last_request: u64,
    transmit: Vec<u8>,
}

impl ServerProto {
    /// A new connection: its challenge (with the fresh `nonce_s`) is queued to send.
    pub fn new(params: ServerParams, nonce_s: [u8; NONCE_BYTES]) -> Self {
        let challenge = Message::Challenge { server_name: params.name.clone(), nonce: nonce_s };
        let reader = FrameReader::new(handshake_limits(&params.limits));
        ServerProto {
            params,
            nonce_s,
            state: ServerState::AwaitHello,
            reader,
            peer: None,
            last_request: 0,
            transmit: challenge.encode(0),
        }
    }

    /// Bytes to read before the next step.
    pub fn need(&self) -> usize {
        self.reader.need()
    }

    /// Whether part of a frame has arrived.
    pub fn in_frame(&self) -> bool {
        self.reader.in_frame()
    }

    /// The authenticated client, once known.
    pub fn peer(&self) -> Option<&str> {
        self.peer.as_deref()
    }

    /// Whether the connection ended (the driver closes it after sending what is queued).
    pub fn is_closed(&self) -> bool {
        matches!(self.state, ServerState::Closed)
    }

    /// Bytes to send now, emptied by the call.
    pub fn take_transmit(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.transmit)
    }

    /// Refuses with an error frame and closes: nothing more is read from this client.
    fn close_with(&mut self, code: ErrorCode, id: u64, e: SessionError) -> SessionError {
        let text: String = e.to_string().chars().take(200).collect();
        self.transmit.extend_from_slice(&Message::Error { code, message: text }.encode(id));
        self.state = ServerState::Closed;
        e
    }

    /// Consumes bytes from the client; returns how many it used and the event they made.
    /// A violation queues an error frame (see [`ServerProto::take_transmit`]) and closes.
    pub fn recv(&mut self, bytes: &[u8]) -> Result<(usize, Option<ServerEvent>), SessionError> {
        match self.state {
            ServerState::Closed => return Err(SessionError::Closed),
            ServerState::Serving { .. } => {
                self.state = ServerState::Closed;
                return Err(SessionError::Misuse("frame bytes while a request is served"));
            }
            _ => {}
        }
        let (used, frame) = match self.reader.push(bytes) {
            Ok(r) => r,
            Err(e) => {
                let auth = matches!(self.state, ServerState::AwaitHello);
                let code = if auth { ErrorCode::Auth } else { ErrorCode::Malformed };
                return Err(self.close_with(code, 0, e.into()));
            }
        };
        let Some((h, msg)) = frame else { return Ok((used, None)) };
        match (&self.state, msg) {
            (ServerState::AwaitHello, Message::Hello { client_name, nonce, mac }) => {
                let p = &self.params;
                if !verify_handshake_mac(
                    p.secret.expose(),
                    HandshakeRole::Client,
                    &self.nonce_s,
                    &nonce,
                    &client_name,
                    &mac,
                ) {
                    return Err(self.close_with(ErrorCode::Auth, h.request_id, SessionError::Auth));
                }
                let mac = handshake_mac(
                    p.secret.expose(),
                    HandshakeRole::Server,
                    &nonce,
                    &self.nonce_s,
                    "",
                );
                self.transmit.extend_from_slice(&Message::Welcome { mac }.encode(h.request_id));
                self.reader = FrameReader::new(self.params.limits);
                self.peer = Some(client_name.clone());
                self.state = ServerState::Ready;
                Ok((used, Some(ServerEvent::Authenticated { peer: client_name })))
            }
            (ServerState::AwaitHello, other) => {
                let e = SessionError::Unexpected {
                    state: "awaiting the hello",
                    got: kind_name(&other),
                };
                Err(self.close_with(ErrorCode::Auth, h.request_id, e))
            }
            (ServerState::Ready, message) => {
                let payload = match &message {
                    Message::Write { descs, .. } => {
                        descs.iter().fold(0u64, |a, d| a.saturating_add(d.len))
                    }
                    Message::Read { .. }
                    | Message::Commit { .. }
                    | Message::Checksums { .. }
                    | Message::Rpc { .. }
                    | Message::RdmaConnect(_) => 0,
                    other => {
                        let e = SessionError::Unexpected { state: "idle", got: kind_name(other) };
                        return Err(self.close_with(ErrorCode::Malformed, h.request_id, e));
                    }
                };
                // Ids only grow on a connection: a replayed or reordered request is refused.
                if h.request_id <= self.last_request {
                    let e = SessionError::OutOfSequence {
                        expected: self.last_request + 1,
                        got: h.request_id,
                    };
                    return Err(self.close_with(ErrorCode::Malformed, h.request_id, e));
                }
                self.last_request = h.request_id;
                self.state = ServerState::Serving { id: h.request_id, payload };
                Ok((used, Some(ServerEvent::Request { id: h.request_id, message })))
            }
            (state, other) => {
                let e = SessionError::Unexpected { state: state.name(), got: kind_name(&other) };
                Err(self.close_with(ErrorCode::Malformed, h.request_id, e))
            }
        }
    }

    /// Bytes of the current `Write`'s payload still on the wire.
    pub fn payload_remaining(&self) -> u64 {
        match self.state {
            ServerState::Serving { payload, .. } => payload,
            _ => 0,
        }
    }

    /// The driver consumed `n` bytes of the current `Write`'s payload.
    pub fn payload_received(&mut self, n: u64) -> Result<(), SessionError> {
        match &mut self.state {
            ServerState::Serving { payload, .. } if n <= *payload => {
                *payload -= n;
                Ok(())
            }
            _ => {
                self.state = ServerState::Closed;
                Err(SessionError::Misuse("payload bytes that were not expected"))
            }
        }
    }

    /// Encodes the answer to the request being served. A success answers only after the
    /// whole payload was consumed; an `Error` may answer before, and then closes the
    /// connection (the rest of the payload is never read).
    pub fn reply(&mut self, msg: &Message) -> Result<Vec<u8>, SessionError> {
        let ServerState::Serving { id, payload } = self.state else {
            return Err(SessionError::Misuse("a reply with no request"));
        };
        let is_error = matches!(msg, Message::Error { .. });
        if !is_error
            && !matches!(
                msg,
                Message::Ack
                    | Message::ReadData { .. }
                    | Message::ChecksumList { .. }
                    | Message::RpcReply { .. }
                    | Message::RdmaAccept(_)
            )
        {
            return Err(SessionError::Misuse("only replies answer a request"));
        }
        if payload > 0 && !is_error {
            return Err(SessionError::Misuse("a reply before the payload was consumed"));
        }
        self.state = if payload > 0 { ServerState::Closed } else { ServerState::Ready };
        Ok(msg.encode(id))
    }
}

#[cfg(test)]
mod tests;
