//! From work completions to a transfer's state.
//!
//! Every work request carries a 64-bit id: the transfer's number (32 bits), the queue pair's
//! index in the connection (8 bits) and the request's index in that queue pair's chain (24
//! bits). A completion for request `i` of chain `q` — signaled success, error or flush —
//! means every request up to `i` of that chain is finished (RC queue pairs complete in
//! order; a queue pair in error flushes what it still holds, each with its own completion).
//! A transfer is finished when every request it posted is; its outcome is its first error,
//! and the flushes that follow an error never replace it.

use super::verbs::consts::{WC_SUCCESS, WC_WR_FLUSH_ERR};
use crate::transfer::TransferError;
use crate::wire::ErrorCode;

/// Most queue pairs a work request id can name.
pub const QP_INDEX_MAX: usize = 1 << 8;
/// Most requests in one chain a work request id can name.
pub const WR_INDEX_MAX: usize = 1 << 24;

/// A work request's id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WrId {
    /// The transfer's number.
    pub transfer: u32,
    /// The queue pair's index in its connection.
    pub qp: u8,
    /// The request's index in its chain (24 bits).
    pub index: u32,
}

impl WrId {
    /// Packs into the 64 bits verbs carries.
    pub fn pack(self) -> u64 {
        (u64::from(self.transfer) << 32)
            | (u64::from(self.qp) << 24)
            | u64::from(self.index & 0xff_ffff)
    }

    /// Unpacks.
    pub fn unpack(v: u64) -> WrId {
        WrId { transfer: (v >> 32) as u32, qp: (v >> 24) as u8, index: (v & 0xff_ffff) as u32 }
    }
}

/// `enum ibv_wc_status`, by number.
pub fn status_name(status: u32) -> &'static str {
    const NAMES: [&str; 24] = [
        "success",
        "local length error",
        "local QP operation error",
        "local EE context operation error",
        "local protection error",
        "work request flushed",
        "memory window bind error",
        "bad response",
        "local access error",
        "remote invalid request",
        "remote access error",
        "remote operation error",
        "transport retry counter exceeded",
        "RNR retry counter exceeded",
        "local RDD violation",
        "remote invalid RD request",
        "remote aborted",
        "invalid EE context number",
        "invalid EE context state",
        "fatal error",
        "response timeout",
        "general error",
        "tag matching error",
        "tag matching rendezvous incomplete",
    ];
    NAMES.get(status as usize).copied().unwrap_or("unknown status")
}

/// The transfer error an error completion means.
pub fn status_error(status: u32, vendor_err: u32, peer: &str) -> TransferError {
    let what = status_name(status);
    match status {
        // The peer's adapter refused the access: a key or range it did not register.
        9..=11 | 15 => TransferError::Remote {
            code: ErrorCode::OutOfBounds,
            message: format!("RDMA {what} (vendor error {vendor_err:#x}): the peer's memory registration refused the access"),
        },
        // No answer from the peer's adapter: unreachable, or its queue pair is gone.
        12 | 13 | 16 | 20 => TransferError::Disconnected {
            peer: peer.to_string(),
            reason: format!("RDMA {what} (vendor error {vendor_err:#x})"),
        },
        WC_WR_FLUSH_ERR => TransferError::Disconnected {
            peer: peer.to_string(),
            reason: "RDMA queue pair in error: work flushed".into(),
        },
        _ => TransferError::Protocol(format!("RDMA {what} (status {status}, vendor error {vendor_err:#x})")),
    }
}

/// One transfer's outstanding work on its connection's queue pairs.
#[derive(Debug)]
pub struct Tracker {
    /// Requests of each chain still to be posted or finished: `len` shrinks to `posted` on an
    /// error (the rest is never posted).
    len: Vec<u32>,
    posted: Vec<u32>,
    done: Vec<u32>,
    error: Option<TransferError>,
}

/// What a completion did to a transfer.
#[derive(Debug, PartialEq)]
pub enum Progress {
    /// Work is still outstanding (or still to be posted).
    Pending,
    /// Every posted request is finished: the outcome.
    Finished(Result<(), TransferError>),
}

impl Tracker {
    /// A transfer with chains of these lengths.
    pub fn new(chain_lens: &[u32]) -> Tracker {
        Tracker {
            len: chain_lens.to_vec(),
            posted: vec![0; chain_lens.len()],
            done: vec![0; chain_lens.len()],
            error: None,
        }
    }

    /// How many more requests of chain `q` may be posted now, with at most `depth` of the
    /// chain outstanding (none once the transfer failed).
    pub fn room(&self, q: usize, depth: u32) -> u32 {
        let (Some(&len), Some(&posted), Some(&done)) =
            (self.len.get(q), self.posted.get(q), self.done.get(q))
        else {
            return 0;
        };
        let outstanding = posted - done;
        depth.saturating_sub(outstanding).min(len - posted)
    }

    /// The next request index of chain `q` to post.
    pub fn next_index(&self, q: usize) -> u32 {
        self.posted.get(q).copied().unwrap_or(0)
    }

    /// Requests of chain `q` finished so far.
    pub fn done(&self, q: usize) -> u32 {
        self.done.get(q).copied().unwrap_or(0)
    }

    /// Records that `n` more requests of chain `q` were posted.
    pub fn posted(&mut self, q: usize, n: u32) {
        if let (Some(p), Some(&len)) = (self.posted.get_mut(q), self.len.get(q)) {
            *p = (*p + n).min(len);
        }
    }

    /// Records a failure outside any completion (posting refused, a deadline): nothing more
    /// is posted; what was posted must still finish (or be flushed).
    pub fn fail(&mut self, e: TransferError) {
        self.error.get_or_insert(e);
        self.len.clone_from(&self.posted);
    }

    /// Counts every posted request of chain `q` as finished without a completion: for
    /// requests a provider took as part of a refused chain, whose completions may never come
    /// (they were not signaled). Only after [`Tracker::fail`], with the queue pair failed.
    pub fn abandon(&mut self, q: usize) {
        if let (Some(d), Some(&p)) = (self.done.get_mut(q), self.posted.get(q)) {
            *d = (*d).max(p);
        }
    }

    /// A completion for request `index` of chain `q`.
    pub fn complete(
        &mut self,
        q: usize,
        index: u32,
        status: u32,
        vendor_err: u32,
        peer: &str,
    ) -> Progress {
        let Some(done) = self.done.get_mut(q) else { return self.progress() };
        // Only requests that were posted can complete; a stale or forged id changes nothing.
        if index >= self.posted[q] {
            return self.progress();
        }
        *done = (*done).max(index + 1);
        if status != WC_SUCCESS {
            self.fail(status_error(status, vendor_err, peer));
        }
        self.progress()
    }

    /// Whether every posted request finished and nothing more will be posted.
    pub fn progress(&self) -> Progress {
        let finished = self.len.iter().zip(&self.done).all(|(l, d)| d >= l);
        if !finished {
            return Progress::Pending;
        }
        Progress::Finished(match &self.error {
            None => Ok(()),
            Some(e) => Err(e.clone()),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wr_ids_round_trip() {
        for id in [
            WrId { transfer: 0, qp: 0, index: 0 },
            WrId { transfer: u32::MAX, qp: 255, index: (1 << 24) - 1 },
            WrId { transfer: 7, qp: 3, index: 12_345 },
        ] {
            assert_eq!(WrId::unpack(id.pack()), id);
        }
    }

    #[test]
    fn signaled_completions_finish_their_chains() {
        let mut t = Tracker::new(&[5, 3]);
        assert_eq!(t.room(0, 4), 4, "the depth bounds what is outstanding");
        t.posted(0, 4);
        t.posted(1, 3);
        assert_eq!(t.room(0, 4), 0);
        // Request 2 of chain 0 completes (signaled): 0..=2 are done, room for three more, of
        // which one is left to post.
        assert_eq!(t.complete(0, 2, WC_SUCCESS, 0, "p"), Progress::Pending);
        assert_eq!(t.room(0, 4), 1);
        assert_eq!(t.next_index(0), 4);
        t.posted(0, 1);
        assert_eq!(t.complete(1, 2, WC_SUCCESS, 0, "p"), Progress::Pending);
        assert_eq!(t.complete(0, 4, WC_SUCCESS, 0, "p"), Progress::Finished(Ok(())));
    }

    #[test]
    fn the_first_error_wins_and_flushes_are_waited_for() {
        let mut t = Tracker::new(&[4, 4]);
        t.posted(0, 2);
        t.posted(1, 2);
        let p = t.complete(0, 0, 10, 0x88, "peer-b");
        assert_eq!(p, Progress::Pending, "posted work is still outstanding");
        assert_eq!(t.room(0, 8), 0, "nothing more is posted after an error");
        assert_eq!(t.complete(0, 1, WC_WR_FLUSH_ERR, 0, "peer-b"), Progress::Pending);
        let Progress::Finished(Err(e)) = t.complete(1, 1, WC_WR_FLUSH_ERR, 0, "peer-b") else {
            panic!("finished with the first error");
        };
        assert!(matches!(e, TransferError::Remote { code: ErrorCode::OutOfBounds, .. }), "{e}");
    }

    #[test]
    fn a_dead_peer_and_a_deadline_are_typed() {
        let mut t = Tracker::new(&[2]);
        t.posted(0, 2);
        let Progress::Finished(Err(e)) = t.complete(0, 1, 12, 0, "peer-c") else { panic!() };
        assert!(matches!(&e, TransferError::Disconnected { peer, .. } if peer == "peer-c"), "{e}");
        assert!(e.to_string().contains("retry counter exceeded"), "{e}");

        let mut t = Tracker::new(&[3]);
        t.posted(0, 1);
        t.fail(TransferError::TimedOut(std::time::Duration::from_secs(1)));
        assert_eq!(t.progress(), Progress::Pending, "the posted request must be flushed first");
        assert_eq!(
            t.complete(0, 0, WC_WR_FLUSH_ERR, 0, "p"),
            Progress::Finished(Err(TransferError::TimedOut(std::time::Duration::from_secs(1))))
        );
    }

    #[test]
    fn stale_or_forged_completions_change_nothing() {
        let mut t = Tracker::new(&[2]);
        t.posted(0, 1);
        assert_eq!(t.complete(0, 1, WC_SUCCESS, 0, "p"), Progress::Pending, "not posted yet");
        assert_eq!(t.complete(9, 0, WC_SUCCESS, 0, "p"), Progress::Pending, "no such chain");
        assert_eq!(t.complete(0, 0, WC_SUCCESS, 0, "p"), Progress::Pending);
        t.posted(0, 1);
        assert_eq!(t.complete(0, 1, WC_SUCCESS, 0, "p"), Progress::Finished(Ok(())));
        assert_eq!(status_name(999), "unknown status");
    }
}
