//! Ordering an engine's batches by their sequence numbers, with replay: a pure state machine
//! (no sockets, no clock) that the subscriber drives.
//!
//! The engine numbers its batches 0, 1, 2… On a (re)connect, and on a gap, the subscriber
//! asks the engine's replay endpoint for every batch from the next one expected; live batches
//! that arrive meanwhile are held (up to a bound) and applied after the replayed ones. The
//! engine answers a replay with what it had published when the request reached it, so a held
//! batch published later may still follow a gap (a batch the live stream missed after that
//! answer): replay is asked again for it, once, then the gap is lost.
//! When replay is unavailable (no endpoint, no answer in time, or the engine no longer holds
//! the batches), the worker's blocks are dropped ([`Action::Reset`]) and rebuilt from the
//! events that follow.
//!
//! A batch numbered below the next one expected is either a duplicate (the live stream and a
//! replay overlap: the same bytes again) or the engine restarted and numbers from 0 again
//! (other bytes). The sequencer keeps a fingerprint (XXH3-64) of the last batches applied to
//! tell them apart: a duplicate is dropped, a restart resets.

use std::collections::{HashMap, VecDeque};

/// What the driver does next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action<P> {
    /// Apply this batch (in this order).
    Apply {
        /// Its sequence number.
        seq: u64,
        /// Its payload.
        payload: P,
    },
    /// Ask the replay endpoint for every batch from `from` on.
    AskReplay {
        /// The first sequence number wanted.
        from: u64,
    },
    /// The events between what was applied and what follows are lost: drop the worker's
    /// blocks before applying what follows.
    Reset {
        /// Why, for the log.
        reason: String,
    },
}

/// The sequencing state of one engine's event stream.
#[derive(Debug)]
pub struct Sequencer<P> {
    /// The next sequence number expected; None before the first batch.
    next: Option<u64>,
    /// A replay was asked from this and has not ended.
    replaying: Option<u64>,
    /// The highest live batch received before that replay was asked: the engine had published
    /// it, so the replay's answer reaches it if the engine still holds the batches.
    covered: Option<u64>,
    /// Live batches received during a replay.
    held: VecDeque<(u64, P)>,
    /// Most live batches held during a replay (older ones are dropped: the replay or a
    /// reset covers them).
    held_max: usize,
    /// The engine has a replay endpoint.
    can_replay: bool,
    /// Fingerprints of the last batches applied, by sequence number.
    recent: HashMap<u64, u64>,
    /// Their order, oldest first.
    recent_order: VecDeque<u64>,
}

/// Batches remembered to tell duplicates from a restart.
const RECENT: usize = 4096;

impl<P: AsRef<[u8]>> Sequencer<P> {
    /// A sequencer; `can_replay` when the engine has a replay endpoint.
    pub fn new(can_replay: bool, held_max: usize) -> Self {
        Sequencer {
            next: None,
            replaying: None,
            covered: None,
            held: VecDeque::new(),
            held_max,
            can_replay,
            recent: HashMap::new(),
            recent_order: VecDeque::new(),
        }
    }

    /// Records and emits an applied batch.
    fn apply(&mut self, seq: u64, payload: P, out: &mut Vec<Action<P>>) {
        let fp = xxhash_rust::xxh3::xxh3_64(payload.as_ref());
        if self.recent.insert(seq, fp).is_none() {
            self.recent_order.push_back(seq);
            if self.recent_order.len() > RECENT {
                if let Some(old) = self.recent_order.pop_front() {
                    self.recent.remove(&old);
                }
            }
        }
        self.next = Some(seq + 1);
        out.push(Action::Apply { seq, payload });
    }

    /// A batch already applied (the same bytes under the same number).
    fn duplicate(&self, seq: u64, payload: &P) -> bool {
        self.recent.get(&seq) == Some(&xxhash_rust::xxh3::xxh3_64(payload.as_ref()))
    }

    fn forget(&mut self) {
        self.recent.clear();
        self.recent_order.clear();
    }

    /// The next sequence number expected.
    pub fn next(&self) -> Option<u64> {
        self.next
    }

    /// True while a replay is outstanding.
    pub fn replaying(&self) -> bool {
        self.replaying.is_some()
    }

    /// The live stream (re)connected: ask for what may have been missed.
    pub fn connected(&mut self, out: &mut Vec<Action<P>>) {
        if self.can_replay && self.replaying.is_none() {
            let from = self.next.unwrap_or(0);
            self.replaying = Some(from);
            self.covered = None; // nothing is held outside a replay
            out.push(Action::AskReplay { from });
        }
    }

    /// A while after a (re)connection: ask again for what may have been published between
    /// the first replay's answer and the moment the engine's socket started sending to the
    /// new subscriber (libzmq attaches it only when the engine next sends, so an engine that
    /// went quiet right then would otherwise hold those batches back until its next one).
    pub fn catch_up(&mut self, out: &mut Vec<Action<P>>) {
        self.connected(out);
    }

    /// A live batch.
    pub fn live(&mut self, seq: u64, payload: P, out: &mut Vec<Action<P>>) {
        if self.replaying.is_some() {
            if self.held.len() >= self.held_max {
                self.held.pop_front();
            }
            self.held.push_back((seq, payload));
            return;
        }
        match self.next {
            Some(n) if seq > n && self.can_replay => {
                self.replaying = Some(n);
                self.covered = Some(seq);
                self.held.push_back((seq, payload));
                out.push(Action::AskReplay { from: n });
            }
            _ => self.in_order(seq, payload, out),
        }
    }

    /// A batch from the replay endpoint.
    pub fn replayed(&mut self, seq: u64, payload: P, out: &mut Vec<Action<P>>) {
        let Some(from) = self.replaying else { return };
        let expected = self.next.unwrap_or(from);
        if seq < expected {
            return;
        }
        if seq > expected {
            out.push(Action::Reset {
                reason: format!("the engine no longer holds batches {expected}..{seq} for replay"),
            });
        }
        self.apply(seq, payload, out);
    }

    /// The replay ended (its end marker arrived): apply what was held, up to a gap that a
    /// new replay may fill.
    pub fn replay_ended(&mut self, out: &mut Vec<Action<P>>) {
        if let Some(from) = self.replaying.take() {
            // Nothing replayed from `from`: the engine had published nothing since, so the
            // next batch must be `from` (a later one is a gap).
            self.next.get_or_insert(from);
            self.flush(true, out);
        }
    }

    /// The replay failed (no answer in time, connection refused): reset if something was
    /// missed, then apply what was held.
    pub fn replay_failed(&mut self, why: &str, out: &mut Vec<Action<P>>) {
        if self.replaying.take().is_none() {
            return;
        }
        let first_held = self.held.front().map(|(s, _)| *s);
        if let (Some(n), Some(s)) = (self.next, first_held) {
            if s > n {
                out.push(Action::Reset {
                    reason: format!("batches {n}..{s} lost and replay failed: {why}"),
                });
                self.next = Some(s);
            }
        }
        self.flush(false, out);
    }

    /// Applies the held batches in order. With `ask_again`, a gap before a batch that the
    /// replay just ended did not cover (the engine published it after answering, and the
    /// live stream missed what came between) starts a new replay, the rest staying held.
    fn flush(&mut self, ask_again: bool, out: &mut Vec<Action<P>>) {
        while let Some((seq, payload)) = self.held.pop_front() {
            if let Some(n) = self.next {
                if ask_again && self.can_replay && seq > n && self.covered.is_none_or(|c| seq > c) {
                    self.held.push_front((seq, payload));
                    // All of these were published before this request: it covers them.
                    self.covered = self.held.iter().map(|(s, _)| *s).max();
                    self.replaying = Some(n);
                    out.push(Action::AskReplay { from: n });
                    return;
                }
            }
            self.in_order(seq, payload, out);
        }
    }

    /// Applies a batch outside a replay: in order, after a gap that cannot be replayed, or
    /// after the engine restarted.
    fn in_order(&mut self, seq: u64, payload: P, out: &mut Vec<Action<P>>) {
        match self.next {
            Some(n) if seq > n => out.push(Action::Reset {
                reason: if self.can_replay {
                    format!("batches {n}..{seq} lost: the engine's replay did not bring them")
                } else {
                    format!("batches {n}..{seq} lost and the engine has no replay endpoint")
                },
            }),
            Some(n) if seq < n => {
                if self.duplicate(seq, &payload) {
                    return;
                }
                self.forget();
                out.push(Action::Reset {
                    reason: format!("sequence went back from {n} to {seq}: the engine restarted"),
                });
            }
            _ => {}
        }
        self.apply(seq, payload, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn applied(a: &[Action<Vec<u8>>]) -> Vec<u64> {
        a.iter()
            .filter_map(|a| if let Action::Apply { seq, .. } = a { Some(*seq) } else { None })
            .collect()
    }
    fn resets(a: &[Action<Vec<u8>>]) -> usize {
        a.iter().filter(|a| matches!(a, Action::Reset { .. })).count()
    }

    #[test]
    fn a_gap_is_replayed_and_live_batches_wait_for_it() {
        let mut s = Sequencer::new(true, 16);
        let mut out = Vec::new();
        s.connected(&mut out);
        assert_eq!(out, [Action::AskReplay { from: 0 }]);
        s.live(2, vec![2], &mut out); // held: the replay is outstanding
        s.replayed(0, vec![0], &mut out);
        s.replayed(1, vec![1], &mut out);
        s.replay_ended(&mut out);
        assert_eq!(applied(&out), [0, 1, 2]);
        out.clear();
        // Batch 3 lost: 4 triggers a replay from 3, which brings 3 and 4 again.
        s.live(4, vec![4], &mut out);
        assert_eq!(out, [Action::AskReplay { from: 3 }]);
        s.live(5, vec![5], &mut out);
        s.replayed(3, vec![3], &mut out);
        s.replayed(4, vec![4], &mut out);
        s.replay_ended(&mut out);
        assert_eq!(applied(&out), [3, 4, 5]);
        assert_eq!(resets(&out), 0);
    }

    #[test]
    fn a_gap_that_cannot_be_replayed_resets_and_goes_on() {
        // The engine's buffer starts after what was missed.
        let mut s = Sequencer::new(true, 16);
        let mut out = Vec::new();
        s.live(0, vec![0], &mut out);
        s.live(1, vec![1], &mut out);
        s.live(9, vec![9], &mut out);
        s.replayed(7, vec![7], &mut out);
        s.replayed(8, vec![8], &mut out);
        s.replayed(9, vec![9], &mut out);
        s.replay_ended(&mut out);
        assert_eq!(applied(&out), [0, 1, 7, 8, 9]);
        assert_eq!(resets(&out), 1);
        // No replay endpoint at all; then a restart (sequence back to 0).
        let mut s = Sequencer::new(false, 16);
        let mut out = Vec::new();
        s.connected(&mut out);
        s.live(3, vec![3], &mut out);
        s.live(5, vec![5], &mut out);
        s.live(0, vec![0], &mut out);
        assert_eq!(applied(&out), [3, 5, 0]);
        assert_eq!(resets(&out), 2);
        // A replay that fails with batches held: reset, then the held ones.
        let mut s = Sequencer::new(true, 16);
        let mut out = Vec::new();
        s.live(0, vec![0], &mut out);
        s.live(3, vec![3], &mut out);
        s.replay_failed("timeout", &mut out);
        assert_eq!(applied(&out), [0, 3]);
        assert_eq!(resets(&out), 1);
    }

    #[test]
    fn a_gap_among_the_batches_held_during_a_replay_is_asked_for_again() {
        // The replay asked on connecting is answered before the engine publishes anything;
        // batches 0 and 2 arrive live while that answer is on its way, batch 1 never does.
        let mut s = Sequencer::new(true, 16);
        let mut out = Vec::new();
        s.connected(&mut out);
        s.live(0, vec![0], &mut out);
        s.live(2, vec![2], &mut out);
        s.replay_ended(&mut out);
        assert_eq!(
            out[1..],
            [Action::Apply { seq: 0, payload: vec![0] }, Action::AskReplay { from: 1 }]
        );
        s.live(3, vec![3], &mut out); // held again
        s.replayed(1, vec![1], &mut out);
        s.replayed(2, vec![2], &mut out);
        s.replay_ended(&mut out);
        assert_eq!(applied(&out), [0, 1, 2, 3]);
        assert_eq!(resets(&out), 0);
        assert_eq!(s.next(), Some(4));
        // The same when the answer brings batch 0, whether the live batch 0 then comes as a
        // duplicate or never (the subscription was not yet active at the engine's socket).
        for live0 in [true, false] {
            let mut s = Sequencer::new(true, 16);
            let mut out = Vec::new();
            s.connected(&mut out);
            s.replayed(0, vec![0], &mut out);
            if live0 {
                s.live(0, vec![0], &mut out);
            }
            s.live(2, vec![2], &mut out);
            s.replay_ended(&mut out);
            assert_eq!(out.last(), Some(&Action::AskReplay { from: 1 }), "{live0}");
            s.replayed(1, vec![1], &mut out);
            s.replayed(2, vec![2], &mut out);
            s.replay_ended(&mut out);
            assert_eq!((applied(&out), resets(&out)), (vec![0, 1, 2], 0), "{live0}");
        }
        // A second replay, asked once batch 2 had arrived, that does not bring batch 1 either:
        // the engine no longer holds it. A reset, not a third replay.
        let mut s = Sequencer::new(true, 16);
        let mut out = Vec::new();
        s.connected(&mut out);
        s.live(2, vec![2], &mut out);
        s.replay_ended(&mut out);
        assert_eq!(out, [Action::AskReplay { from: 0 }, Action::AskReplay { from: 0 }]);
        out.clear();
        s.replay_ended(&mut out);
        assert_eq!((applied(&out), resets(&out)), (vec![2], 1));
        assert!(!s.replaying());
        // Likewise a gap seen live: the replay it asks covers the batch that showed it.
        let mut s = Sequencer::new(true, 16);
        let mut out = Vec::new();
        s.live(0, vec![0], &mut out);
        s.live(2, vec![2], &mut out);
        s.replay_ended(&mut out);
        assert_eq!((applied(&out), resets(&out)), (vec![0, 2], 1));
        assert_eq!(out.iter().filter(|a| matches!(a, Action::AskReplay { .. })).count(), 1);
    }

    #[test]
    fn a_duplicate_is_dropped_and_other_bytes_under_an_old_number_are_a_restart() {
        let mut s = Sequencer::new(true, 16);
        let mut out = Vec::new();
        s.connected(&mut out);
        s.replayed(0, vec![10], &mut out);
        s.replayed(1, vec![11], &mut out);
        s.replay_ended(&mut out);
        // The live stream catches up with what the replay already brought.
        s.live(1, vec![11], &mut out);
        s.live(2, vec![12], &mut out);
        assert_eq!(applied(&out), [0, 1, 2]);
        assert_eq!(resets(&out), 0);
        // A first replay that finds nothing: the next live batch must be 0.
        let mut t = Sequencer::new(true, 16);
        let mut o = Vec::new();
        t.connected(&mut o);
        t.replay_ended(&mut o);
        t.live(2, vec![2], &mut o);
        assert_eq!(o[1], Action::AskReplay { from: 0 });
        // The engine restarted: batch 0 again, with other events.
        s.live(0, vec![99], &mut out);
        assert_eq!(applied(&out), [0, 1, 2, 0]);
        assert_eq!(resets(&out), 1);
        assert_eq!(s.next(), Some(1));
    }
}
