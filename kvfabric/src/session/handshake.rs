//! The agents' authenticated handshake for other protocols: a service that speaks its own
//! frames after authentication (the frontend ↔ worker protocol) proves the shared secret the
//! same way, with the same state machines ([`ClientProto`], [`ServerProto`]), then leaves the
//! stream to its own protocol. Nothing but the handshake's bytes is read: the first byte of
//! the next protocol stays in the stream.

use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::proto::{
    ClientEvent, ClientParams, ClientProto, ServerEvent, ServerParams, ServerProto, SessionError,
};

/// Why a handshake failed.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    /// The stream failed or closed.
    #[error("connection: {0}")]
    Io(#[from] std::io::Error),
    /// The protocol failed: a wrong secret, a wrong peer, malformed bytes.
    #[error(transparent)]
    Session(#[from] SessionError),
    /// Not done within the handshake timeout.
    #[error("handshake timed out after {0:?}")]
    TimedOut(Duration),
}

/// Proves the secret to the server at the other end of `stream` and checks its proof, within
/// `timeout`; `params.peer` is the name the server must give.
pub async fn client<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    params: ClientParams,
    nonce: [u8; crate::wire::NONCE_BYTES],
    timeout: Duration,
) -> Result<(), HandshakeError> {
    let run = async {
        let mut proto = ClientProto::new(params, nonce);
        loop {
            let mut buf = vec![0u8; proto.need()];
            stream.read_exact(&mut buf).await?;
            let (_, event) = proto.recv(&buf)?;
            let out = proto.take_transmit();
            if !out.is_empty() {
                stream.write_all(&out).await?;
                stream.flush().await?;
            }
            if event == Some(ClientEvent::Authenticated) {
                return Ok(());
            }
        }
    };
    tokio::time::timeout(timeout, run).await.map_err(|_| HandshakeError::TimedOut(timeout))?
}

/// Challenges the client at the other end of `stream` and returns its authenticated name,
/// within `timeout`. A client that fails gets an error frame before the caller closes.
pub async fn server<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    params: ServerParams,
    nonce: [u8; crate::wire::NONCE_BYTES],
    timeout: Duration,
) -> Result<String, HandshakeError> {
    let run = async {
        let mut proto = ServerProto::new(params, nonce);
        stream.write_all(&proto.take_transmit()).await?;
        stream.flush().await?;
        loop {
            let mut buf = vec![0u8; proto.need()];
            stream.read_exact(&mut buf).await?;
            let result = proto.recv(&buf);
            let out = proto.take_transmit();
            if !out.is_empty() {
                stream.write_all(&out).await?;
                stream.flush().await?;
            }
            match result? {
                (_, Some(ServerEvent::Authenticated { peer })) => return Ok(peer),
                (_, Some(ServerEvent::Request { .. })) => {
                    return Err(SessionError::Misuse("a request during the handshake").into())
                }
                (_, None) => {}
            }
        }
    };
    tokio::time::timeout(timeout, run).await.map_err(|_| HandshakeError::TimedOut(timeout))?
}

/// Accepts a peer of a server-speaks-first port (an agent's, a worker's request port): mutual
/// TLS when `tls` requires it, else the connection as it is. A plaintext client that waits
/// for our challenge is told, in this protocol's error frame, that the port requires TLS, so
/// that its error says so too.
pub async fn accept_tls(
    tls: Option<&crate::tls::Tls>,
    tcp: tokio::net::TcpStream,
    from: std::net::SocketAddr,
    timeout: Duration,
) -> Result<crate::tls::Stream, crate::tls::TlsError> {
    match crate::tls::accept_peer(tls, tcp, from, timeout).await {
        Ok(s) => Ok(s),
        Err((e, Some(mut tcp))) => {
            let refusal = crate::wire::Message::Error {
                code: crate::wire::ErrorCode::TlsRequired,
                message: "this port requires mutual TLS: this peer connected without it \
                          (give it --tls-ca, --tls-cert and --tls-key)"
                    .into(),
            };
            let _ = tokio::time::timeout(Duration::from_secs(1), tcp.write_all(&refusal.encode(0)))
                .await;
            Err(e)
        }
        Err((e, None)) => Err(e),
    }
}

/// A fresh nonce for [`client`] and [`server`].
pub fn nonce() -> [u8; crate::wire::NONCE_BYTES] {
    super::io::random_nonce()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::WireLimits;

    fn params(secret: &[u8]) -> (ClientParams, ServerParams) {
        let limits = WireLimits::default();
        (
            ClientParams { me: "frontend".into(), peer: "w".into(), secret: secret.into(), limits },
            ServerParams { name: "w".into(), secret: b"right".into(), limits },
        )
    }

    #[tokio::test]
    async fn the_next_protocol_starts_right_after_the_handshake() {
        let (mut a, mut b) = tokio::io::duplex(1024);
        let (cp, sp) = params(b"right");
        let t = Duration::from_secs(5);
        let srv = tokio::spawn(async move {
            let peer = server(&mut b, sp, nonce(), t).await.unwrap();
            let mut next = [0u8; 5];
            b.read_exact(&mut next).await.unwrap();
            (peer, next)
        });
        client(&mut a, cp, nonce(), t).await.unwrap();
        a.write_all(b"hello").await.unwrap();
        assert_eq!(srv.await.unwrap(), ("frontend".to_string(), *b"hello"));
    }

    #[tokio::test]
    async fn a_wrong_secret_or_silence_fails_typed() {
        let (mut a, mut b) = tokio::io::duplex(1024);
        let (cp, sp) = params(b"wrong");
        let t = Duration::from_secs(5);
        let srv = tokio::spawn(async move { server(&mut b, sp, nonce(), t).await });
        let err = client(&mut a, cp, nonce(), t).await.unwrap_err();
        assert!(matches!(err, HandshakeError::Session(SessionError::Auth)), "{err}");
        let err = srv.await.unwrap().unwrap_err();
        assert!(matches!(err, HandshakeError::Session(SessionError::Auth)), "{err}");
        // A client that says nothing is cut off at the timeout.
        let (_a, mut b) = tokio::io::duplex(1024);
        let (_, sp) = params(b"right");
        let err = server(&mut b, sp, nonce(), Duration::from_millis(50)).await.unwrap_err();
        assert!(matches!(err, HandshakeError::TimedOut(_)), "{err}");
    }
}
