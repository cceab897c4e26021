use super::*;
use crate::wire::WireDesc;
use proptest::prelude::*;

const SECRET: &[u8] = b"s3cret";

fn client(secret: &[u8], peer: &str) -> ClientProto {
    let params = ClientParams {
        me: "client".into(),
        peer: peer.into(),
        secret: secret.into(),
        limits: WireLimits::default(),
    };
    ClientProto::new(params, [7; NONCE_BYTES])
}

fn server() -> ServerProto {
    let params = ServerParams {
        name: "server".into(),
        secret: SECRET.into(),
        limits: WireLimits::default(),
    };
    ServerProto::new(params, [9; NONCE_BYTES])
}

/// Feeds `bytes` to the client `step` bytes at a time; returns the events.
fn to_client(
    c: &mut ClientProto,
    mut bytes: &[u8],
    step: usize,
) -> Result<Vec<ClientEvent>, SessionError> {
    let mut events = Vec::new();
    while !bytes.is_empty() {
        let n = step.min(bytes.len()).min(c.need());
        let (used, ev) = c.recv(&bytes[..n])?;
        assert_eq!(used, n, "a reader given at most need() bytes uses them all");
        bytes = &bytes[used..];
        events.extend(ev);
    }
    Ok(events)
}

fn to_server(
    s: &mut ServerProto,
    mut bytes: &[u8],
    step: usize,
) -> Result<Vec<ServerEvent>, SessionError> {
    let mut events = Vec::new();
    while !bytes.is_empty() {
        let n = step.min(bytes.len()).min(s.need());
        let (used, ev) = s.recv(&bytes[..n])?;
        assert_eq!(used, n);
        bytes = &bytes[used..];
        events.extend(ev);
    }
    Ok(events)
}

/// A client and a server through the handshake, `step` bytes at a time.
fn connected(step: usize) -> (ClientProto, ServerProto) {
    let (mut c, mut s) = (client(SECRET, "server"), server());
    assert!(to_client(&mut c, &s.take_transmit(), step).unwrap().is_empty());
    let hello = c.take_transmit();
    let ev = to_server(&mut s, &hello, step).unwrap();
    assert_eq!(ev, vec![ServerEvent::Authenticated { peer: "client".into() }]);
    assert_eq!(s.peer(), Some("client"));
    assert_eq!(
        to_client(&mut c, &s.take_transmit(), step).unwrap(),
        vec![ClientEvent::Authenticated]
    );
    assert!(c.is_ready());
    (c, s)
}

use crate::wire::rdma;

fn qp(i: u32) -> rdma::QpAddr {
    rdma::QpAddr { lid: 1, gid: [i as u8; 16], qpn: i, psn: i, mtu: 5, rd_atomic: 1 }
}

/// RDMA keys go only to an authenticated peer that asked: a connect before the handshake
/// is refused, and neither side accepts an accept it did not ask for.
#[test]
fn rdma_exchange_only_after_authentication_and_only_as_asked() {
    let mut s = server();
    let _challenge = s.take_transmit();
    let connect = Message::RdmaConnect(rdma::Connect { qps: vec![qp(1)] }).encode(1);
    assert!(to_server(&mut s, &connect, 1 << 20).is_err(), "a connect before the hello");

    let (mut c, mut s) = connected(1 << 20);
    let accept =
        Message::RdmaAccept(rdma::Accept { qps: vec![qp(1)], regions: vec![], mailbox: None });
    assert!(c.request(&accept).is_err(), "an accept is not a request");
    assert!(to_server(&mut s, &accept.encode(1), 1 << 20).is_err(), "nor does a server take one");
    // An accept answering an RPC is a protocol violation.
    c.request(&Message::Rpc { method: 1, body: vec![] }).unwrap();
    assert!(to_client(&mut c, &accept.encode(1), 1 << 20).is_err());
}

fn desc(len: u64) -> WireDesc {
    WireDesc { region: 1, offset: 0, len, checksum: None }
}

#[test]
fn handshake_and_every_request_kind_in_memory_at_any_chunking() {
    for step in [1, 3, 16, 17, 1 << 20] {
        let (mut c, mut s) = connected(step);
        let exchanges = [
            (
                Message::Commit { transfer_id: 1, verify: vec![], notify: Some(b"n".to_vec()) },
                Message::Ack,
            ),
            (
                Message::Checksums { descs: vec![desc(4), desc(8)] },
                Message::ChecksumList { checksums: vec![1, 2] },
            ),
            (
                Message::Rpc { method: 3, body: b"ask".to_vec() },
                Message::RpcReply { body: b"answer".to_vec() },
            ),
            (
                Message::Read { transfer_id: 2, descs: vec![desc(0)], checksums: false },
                Message::ReadData { checksums: vec![] },
            ),
            (
                Message::RdmaConnect(rdma::Connect { qps: vec![qp(1), qp(2)] }),
                Message::RdmaAccept(rdma::Accept {
                    qps: vec![qp(3), qp(4)],
                    regions: vec![rdma::RegionKey { region: 1, addr: 4096, len: 8192, rkey: 5 }],
                    mailbox: None,
                }),
            ),
        ];
        for (id, (request, reply)) in exchanges.into_iter().enumerate() {
            let frame = c.request(&request).unwrap();
            assert!(!c.is_ready(), "one request at a time");
            assert!(c.request(&request).is_err());
            let ev = to_server(&mut s, &frame, step).unwrap();
            assert_eq!(ev, vec![ServerEvent::Request { id: id as u64 + 1, message: request }]);
            let frame = s.reply(&reply).unwrap();
            assert_eq!(to_client(&mut c, &frame, step).unwrap(), vec![ClientEvent::Reply(reply)]);
            assert!(c.is_ready());
        }
    }
}

#[test]
fn payloads_are_accounted_on_both_sides() {
    let (mut c, mut s) = connected(1 << 20);
    // A WRITE: the server may answer only after the whole payload was consumed.
    let frame =
        c.request(&Message::Write { transfer_id: 1, descs: vec![desc(10), desc(6)] }).unwrap();
    to_server(&mut s, &frame, 1 << 20).unwrap();
    assert_eq!(s.payload_remaining(), 16);
    assert_eq!(
        s.reply(&Message::Ack),
        Err(SessionError::Misuse("a reply before the payload was consumed"))
    );
    s.payload_received(10).unwrap();
    s.payload_received(6).unwrap();
    let ack = s.reply(&Message::Ack).unwrap();
    assert_eq!(to_client(&mut c, &ack, 1 << 20).unwrap(), vec![ClientEvent::Reply(Message::Ack)]);
    // A READ: frames are refused until the payload was received.
    let frame = c
        .request(&Message::Read { transfer_id: 2, descs: vec![desc(5)], checksums: true })
        .unwrap();
    to_server(&mut s, &frame, 1 << 20).unwrap();
    let data = s.reply(&Message::ReadData { checksums: vec![42] }).unwrap();
    to_client(&mut c, &data, 1 << 20).unwrap();
    assert_eq!(c.payload_remaining(), 5);
    assert!(!c.is_ready());
    c.payload_received(5).unwrap();
    assert!(c.is_ready());
    assert!(c.payload_received(1).is_err(), "no payload is due");
}

#[test]
fn a_refused_write_closes_unless_its_payload_was_drained() {
    let (mut c, mut s) = connected(64);
    let frame = c.request(&Message::Write { transfer_id: 1, descs: vec![desc(100)] }).unwrap();
    to_server(&mut s, &frame, 64).unwrap();
    let err = Message::Error { code: ErrorCode::OutOfBounds, message: "no".into() };
    s.payload_received(100).unwrap();
    s.reply(&err).unwrap();
    assert!(!s.is_closed(), "drained: the connection stays usable");
    let frame = c.request(&Message::Write { transfer_id: 1, descs: vec![desc(100)] });
    assert!(frame.is_err(), "the client still awaits its reply");
    let frame = {
        to_client(
            &mut c,
            &Message::Error { code: ErrorCode::OutOfBounds, message: "no".into() }.encode(1),
            64,
        )
        .unwrap();
        c.request(&Message::Write { transfer_id: 2, descs: vec![desc(100)] }).unwrap()
    };
    to_server(&mut s, &frame, 64).unwrap();
    s.reply(&err).unwrap();
    assert!(s.is_closed(), "refused before its payload: the payload is never read");
    assert_eq!(s.recv(&[0]), Err(SessionError::Closed));
}

#[test]
fn a_wrong_secret_or_a_wrong_server_never_authenticates() {
    // The server refuses a client with another secret, with an Auth error, and closes.
    let (mut c, mut s) = (client(b"other", "server"), server());
    to_client(&mut c, &s.take_transmit(), 64).unwrap();
    assert_eq!(to_server(&mut s, &c.take_transmit(), 64), Err(SessionError::Auth));
    assert!(s.is_closed());
    assert_eq!(to_client(&mut c, &s.take_transmit(), 64), Err(SessionError::Auth));
    assert_eq!(c.recv(&[0]), Err(SessionError::Closed));
    // A client refuses a server that does not prove the secret.
    let (mut c, mut s) = (client(SECRET, "server"), server());
    to_client(&mut c, &s.take_transmit(), 64).unwrap();
    to_server(&mut s, &c.take_transmit(), 64).unwrap();
    let forged = Message::Welcome { mac: [0; 32] }.encode(0);
    assert_eq!(to_client(&mut c, &forged, 64), Err(SessionError::Auth));
    // ... or that is not the agent it dialled.
    let (mut c, mut s) = (client(SECRET, "someone-else"), server());
    let err = to_client(&mut c, &s.take_transmit(), 64).unwrap_err();
    assert!(matches!(err, SessionError::WrongPeer { .. }), "{err}");
    assert!(c.take_transmit().is_empty(), "no proof is sent to the wrong server");
    let _ = s.take_transmit();
}

/// What the server answers to bytes that are not a valid next step: the error frame it
/// queued, decoded.
fn refusal(s: &mut ServerProto) -> ErrorCode {
    let bytes = s.take_transmit();
    match Message::decode_frame(&bytes, &WireLimits::default()) {
        Ok((_, Message::Error { code, .. })) => code,
        other => panic!("expected an error frame, got {other:?}"),
    }
}

#[test]
fn a_hostile_client_is_refused_and_cut_off() {
    let limits = WireLimits::default();
    // Before authentication: a request, a huge Hello, garbage.
    let mut s = server();
    let _ = s.take_transmit();
    let write = Message::Write { transfer_id: 1, descs: vec![desc(8)] }.encode(1);
    assert!(matches!(to_server(&mut s, &write, 64), Err(SessionError::Unexpected { .. })));
    assert_eq!(refusal(&mut s), ErrorCode::Auth);

    let mut s = server();
    let _ = s.take_transmit();
    let mut huge = (handshake_limits(&limits).frame_bytes_max + 1).to_le_bytes().to_vec();
    huge.extend_from_slice(&[1, 2 /* Hello */, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
    // Refused from the header alone: the body is never read.
    assert!(matches!(s.recv(&huge), Err(SessionError::Wire(WireError::TooLarge { .. }))));
    assert_eq!(refusal(&mut s), ErrorCode::Auth);

    let mut s = server();
    let _ = s.take_transmit();
    assert!(matches!(s.recv(&[0xff; 16]), Err(SessionError::Wire(_))));
    assert!(s.is_closed());

    // After authentication.
    let cases: Vec<(Vec<u8>, ErrorCode)> = vec![
        (Message::Ack.encode(1), ErrorCode::Malformed),
        (
            Message::Hello { client_name: "again".into(), nonce: [0; 32], mac: [0; 32] }.encode(1),
            ErrorCode::Malformed,
        ),
        (Message::Rpc { method: 1, body: vec![] }.encode(0), ErrorCode::Malformed),
        (vec![0, 0, 0, 0, 9, 10, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], ErrorCode::Malformed),
    ];
    for (bytes, code) in cases {
        let (_, mut s) = connected(64);
        assert!(to_server(&mut s, &bytes, 64).is_err());
        assert_eq!(refusal(&mut s), code);
        assert!(s.is_closed());
    }

    // Request ids only grow: a replay is refused.
    let (mut c, mut s) = connected(64);
    let frame = c.request(&Message::Rpc { method: 1, body: vec![] }).unwrap();
    to_server(&mut s, &frame, 64).unwrap();
    s.reply(&Message::RpcReply { body: vec![] }).unwrap();
    let err = to_server(&mut s, &frame, 64).unwrap_err();
    assert_eq!(err, SessionError::OutOfSequence { expected: 2, got: 1 });

    // A pipelined request while one is served.
    let (mut c, mut s) = connected(64);
    let frame = c.request(&Message::Rpc { method: 1, body: vec![] }).unwrap();
    to_server(&mut s, &frame, 64).unwrap();
    assert!(to_server(&mut s, &Message::Rpc { method: 1, body: vec![] }.encode(2), 64).is_err());
    assert!(s.is_closed());
}

#[test]
fn a_hostile_server_is_caught_by_the_client() {
    let rpc = Message::Rpc { method: 1, body: vec![] };
    // A reply to another request.
    let (mut c, _s) = connected(64);
    c.request(&rpc).unwrap();
    let err = to_client(&mut c, &Message::RpcReply { body: vec![] }.encode(7), 64).unwrap_err();
    assert_eq!(err, SessionError::OutOfSequence { expected: 1, got: 7 });
    assert!(!c.is_ready());
    // A reply of the wrong kind, or the wrong number of checksums.
    let (mut c, _s) = connected(64);
    c.request(&Message::Read { transfer_id: 1, descs: vec![desc(4)], checksums: false }).unwrap();
    assert!(matches!(
        to_client(&mut c, &Message::Ack.encode(1), 64),
        Err(SessionError::Unexpected { .. })
    ));
    let (mut c, _s) = connected(64);
    c.request(&Message::Checksums { descs: vec![desc(4), desc(4)] }).unwrap();
    let short = Message::ChecksumList { checksums: vec![1] }.encode(1);
    assert!(matches!(to_client(&mut c, &short, 64), Err(SessionError::Unexpected { .. })));
    // A reply nobody asked for.
    let (mut c, _s) = connected(64);
    assert!(matches!(
        to_client(&mut c, &Message::Ack.encode(1), 64),
        Err(SessionError::Unexpected { .. })
    ));
    // A refusal of an unreadable frame comes with id 0 and is still the answer.
    let (mut c, _s) = connected(64);
    c.request(&rpc).unwrap();
    let e = Message::Error { code: ErrorCode::Malformed, message: "bad".into() };
    assert_eq!(to_client(&mut c, &e.encode(0), 64).unwrap(), vec![ClientEvent::Reply(e)]);
    // An error during the handshake.
    let mut c = client(SECRET, "server");
    let e = Message::Error { code: ErrorCode::Unavailable, message: "full".into() };
    assert!(matches!(to_client(&mut c, &e.encode(0), 64), Err(SessionError::Refused { .. })));
}

#[test]
fn a_truncated_frame_waits_for_its_rest() {
    let (mut c, mut s) = connected(64);
    let frame = c.request(&Message::Rpc { method: 1, body: vec![5; 100] }).unwrap();
    let (used, ev) = s.recv(&frame[..HEADER_BYTES + 10]).unwrap();
    assert_eq!((used, ev), (HEADER_BYTES + 10, None));
    assert!(s.in_frame());
    assert_eq!(s.need(), frame.len() - HEADER_BYTES - 10);
    let (_, ev) = s.recv(&frame[HEADER_BYTES + 10..]).unwrap();
    assert!(matches!(ev, Some(ServerEvent::Request { id: 1, .. })));
    // The reader never consumes past its frame: what follows (payload) stays the driver's.
    let (mut c, mut s) = connected(64);
    let mut bytes = c.request(&Message::Write { transfer_id: 1, descs: vec![desc(4)] }).unwrap();
    let frame_len = bytes.len();
    bytes.extend_from_slice(&[1, 2, 3, 4]);
    let (used, ev) = s.recv(&bytes).unwrap();
    assert_eq!(used, frame_len);
    assert!(ev.is_some());
}

proptest! {
    /// Whatever the bytes, before or after authentication: no panic, and once a state
    /// machine failed it stays closed.
    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..2048), step in 1usize..64, authed: bool) {
        let mut s = server();
        let _ = s.take_transmit();
        let mut c = client(SECRET, "server");
        if authed {
            let (c2, s2) = connected(64);
            c = c2;
            s = s2;
            c.request(&Message::Rpc { method: 1, body: vec![] }).unwrap();
        }
        let mut rest = &bytes[..];
        while !rest.is_empty() {
            let n = step.min(rest.len());
            match s.recv(&rest[..n]) {
                Ok((used, _)) => rest = &rest[used.max(1).min(rest.len())..],
                Err(_) => {
                    prop_assert!(s.recv(&[0]).is_err());
                    break;
                }
            }
        }
        let mut rest = &bytes[..];
        while !rest.is_empty() {
            let n = step.min(rest.len());
            match c.recv(&rest[..n]) {
                Ok((used, _)) => rest = &rest[used.max(1).min(rest.len())..],
                Err(_) => {
                    prop_assert_eq!(c.recv(&[0]), Err(SessionError::Closed));
                    break;
                }
            }
        }
    }
}
