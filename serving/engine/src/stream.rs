//! A generation's events on their way to the client: a bounded channel that never blocks the
//! producer.
//!
//! The scheduler serves every request from one thread, and a relay forwards a worker's events
//! as they come: neither may wait for one slow reader. A request's channel holds at most
//! [`EVENTS_BUFFERED`] unread events; a client that falls that far behind its stream (a
//! streaming client that stops reading but keeps its connection) gets its generation stopped
//! with [`EngineError::SlowReader`] as the last event, and the producer frees the sequence. The
//! last slot is kept for that event (and for every final event), so the client always learns
//! why its stream ended.

use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::mpsc;

use crate::{EngineError, GenEvent};

/// Unread events a request may have before it is stopped.
pub const EVENTS_BUFFERED: usize = 1024;

/// The receiving end: what a backend's `submit` gives the frontend.
pub type EventRx = mpsc::Receiver<GenEvent>;

/// A request's event channel.
pub fn channel() -> (EventTx, EventRx) {
    let (tx, rx) = mpsc::channel(EVENTS_BUFFERED);
    (EventTx { tx, ended: AtomicBool::new(false) }, rx)
}

/// Why an event was not sent: the generation should stop either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unsent {
    /// The reader went away (the client cancelled).
    Closed,
    /// The reader fell [`EVENTS_BUFFERED`] events behind: it was sent
    /// [`EngineError::SlowReader`] instead, as its last event.
    Behind,
}

/// The sending end of a request's events.
#[derive(Debug)]
pub struct EventTx {
    tx: mpsc::Sender<GenEvent>,
    /// A final event was sent: nothing follows it.
    ended: AtomicBool,
}

impl EventTx {
    /// Sends `ev` without waiting. A final event (`done`, `error`) always finds room; any
    /// other is refused once the reader is [`EVENTS_BUFFERED`] events behind, and then the
    /// reader is sent [`EngineError::SlowReader`] and nothing more.
    pub fn send(&self, ev: GenEvent) -> Result<(), Unsent> {
        if self.ended.load(Ordering::Relaxed) {
            return Err(Unsent::Closed);
        }
        let last = matches!(ev, GenEvent::Done { .. } | GenEvent::Error(_));
        if !last && self.tx.capacity() <= 1 {
            self.ended.store(true, Ordering::Relaxed);
            let behind = EngineError::SlowReader { buffered: EVENTS_BUFFERED };
            return match self.tx.try_send(GenEvent::Error(behind)) {
                Ok(()) => Err(Unsent::Behind),
                Err(_) => Err(Unsent::Closed),
            };
        }
        if last {
            self.ended.store(true, Ordering::Relaxed);
        }
        self.tx.try_send(ev).map_err(|_| Unsent::Closed)
    }

    /// Whether the reader went away.
    pub fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }

    /// Resolves when the reader goes away.
    pub async fn closed(&self) {
        self.tx.closed().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::FinishReason;

    fn token(i: u32) -> GenEvent {
        GenEvent::Token { id: i, text: String::new() }
    }

    #[test]
    fn a_reader_that_falls_behind_is_told_so_and_gets_nothing_more() {
        let (tx, mut rx) = channel();
        for i in 0..EVENTS_BUFFERED as u32 - 1 {
            tx.send(token(i)).unwrap();
        }
        assert_eq!(tx.send(token(0)), Err(Unsent::Behind));
        assert_eq!(tx.send(token(1)), Err(Unsent::Closed));
        let done =
            GenEvent::Done { reason: FinishReason::Stop, completion_tokens: 1, text: "".into() };
        assert_eq!(tx.send(done), Err(Unsent::Closed));
        let mut got = Vec::new();
        while let Ok(ev) = rx.try_recv() {
            got.push(ev);
        }
        assert_eq!(got.len(), EVENTS_BUFFERED);
        assert!(matches!(got.last(), Some(GenEvent::Error(EngineError::SlowReader { .. }))));
    }

    #[test]
    fn a_final_event_always_finds_room_and_a_reader_that_left_is_seen() {
        let (tx, mut rx) = channel();
        for i in 0..EVENTS_BUFFERED as u32 - 1 {
            tx.send(token(i)).unwrap();
        }
        tx.send(GenEvent::Error(EngineError::Stopped)).unwrap();
        assert_eq!(tx.send(token(0)), Err(Unsent::Closed));
        assert!(matches!(rx.try_recv(), Ok(GenEvent::Token { id: 0, .. })));
        let (tx, rx) = channel();
        drop(rx);
        assert!(tx.is_closed());
        assert_eq!(tx.send(token(0)), Err(Unsent::Closed));
    }
}
