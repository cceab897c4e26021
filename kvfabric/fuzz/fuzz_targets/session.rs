//! Fuzzes the session state machines with a hostile peer: arbitrary bytes, in arbitrary
//! chunks, into a server before and after authentication and into a client awaiting a reply.
//! Never a panic; a state machine that failed stays failed; no step consumes more than it
//! was given.
#![no_main]

use kvfabric::session::proto::{
    ClientEvent, ClientParams, ClientProto, ServerEvent, ServerParams, ServerProto,
};
use kvfabric::wire::{Message, WireLimits};
use libfuzzer_sys::fuzz_target;

const SECRET: &[u8] = b"fuzz";

fn params() -> (ClientParams, ServerParams) {
    let limits = WireLimits::default();
    (
        ClientParams { me: "c".into(), peer: "s".into(), secret: SECRET.into(), limits },
        ServerParams { name: "s".into(), secret: SECRET.into(), limits },
    )
}

/// A client and a server after a real handshake.
fn connected() -> (ClientProto, ServerProto) {
    let (cp, sp) = params();
    let (mut c, mut s) = (ClientProto::new(cp, [1; 32]), ServerProto::new(sp, [2; 32]));
    let challenge = s.take_transmit();
    assert!(c.recv(&challenge).unwrap().1.is_none());
    let hello = c.take_transmit();
    assert!(matches!(s.recv(&hello).unwrap().1, Some(ServerEvent::Authenticated { .. })));
    let welcome = s.take_transmit();
    assert_eq!(c.recv(&welcome).unwrap().1, Some(ClientEvent::Authenticated));
    (c, s)
}

fn feed<E>(
    mut data: &[u8],
    step: usize,
    mut recv: impl FnMut(&[u8]) -> Result<(usize, Option<E>), kvfabric::session::proto::SessionError>,
) {
    let mut failed = false;
    while !data.is_empty() {
        let n = step.min(data.len());
        match recv(&data[..n]) {
            Ok((used, _)) => {
                assert!(!failed, "a failed state machine accepted bytes");
                assert!(used <= n);
                data = &data[used.max(1)..];
            }
            Err(_) => {
                failed = true;
                data = &data[n..];
            }
        }
    }
}

fuzz_target!(|input: &[u8]| {
    let Some((&control, data)) = input.split_first() else { return };
    let step = usize::from(control & 0x3f) + 1;
    match control >> 6 {
        0 => {
            let (_, sp) = params();
            let mut s = ServerProto::new(sp, [2; 32]);
            feed(data, step, |b| s.recv(b));
        }
        1 => {
            let (_, mut s) = connected();
            feed(data, step, |b| s.recv(b));
        }
        2 => {
            let (mut c, _) = connected();
            c.request(&Message::Read { transfer_id: 1, descs: vec![], checksums: true }).unwrap();
            feed(data, step, |b| c.recv(b));
        }
        _ => {
            let (cp, _) = params();
            let mut c = ClientProto::new(cp, [1; 32]);
            feed(data, step, |b| c.recv(b));
        }
    }
});
