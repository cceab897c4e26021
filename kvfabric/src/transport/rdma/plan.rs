//! A transfer's descriptor list as chains of RDMA work requests, one chain per queue pair,
//! within the device's limits.
//!
//! - A work request moves bytes between one contiguous remote range (one rkey) and up to
//!   `max_sge` local ranges (scatter/gather entries), at most `wr_bytes_max` bytes in all.
//! - Pieces whose remote ranges follow each other join one request as more entries; pieces
//!   contiguous on both sides join one entry. A piece longer than a request allows is split.
//! - Requests are spread over the connection's queue pairs, each to the one with the fewest
//!   bytes so far (so a large block is striped), keeping the list's order within each chain.
//! - Within a chain, every `signal_every`-th request and the last are signaled: a signaled
//!   completion also completes the unsignaled requests before it on that queue pair (RC
//!   queue pairs complete in order), so the poster keeps at most the send queue's depth
//!   outstanding while the completion queue sees a fraction of the requests.

/// One descriptor pair in verbs terms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// Local address (inside a registration with `lkey`).
    pub local_addr: u64,
    /// The local registration's key.
    pub lkey: u32,
    /// Remote address (inside the peer's registration with `rkey`).
    pub remote_addr: u64,
    /// The peer's registration's key.
    pub rkey: u32,
    /// Bytes.
    pub len: u64,
}

/// What the device and the connection allow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Scatter/gather entries per work request (`max_send_sge` of the queue pairs).
    pub max_sge: u32,
    /// Bytes per work request (at most the port's `max_msg_sz`; smaller stripes finer).
    pub wr_bytes_max: u64,
    /// Queue pairs of the connection.
    pub qps: usize,
    /// A completion is asked for every this many requests of a chain (and for the last).
    pub signal_every: usize,
}

/// A scatter/gather entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sge {
    /// Local address.
    pub addr: u64,
    /// Bytes.
    pub len: u32,
    /// Local key.
    pub lkey: u32,
}

/// One RDMA READ or WRITE work request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkRequest {
    /// Local entries, in order.
    pub sges: Vec<Sge>,
    /// Start of the remote range.
    pub remote_addr: u64,
    /// Its key.
    pub rkey: u32,
    /// Bytes (the entries' sum).
    pub bytes: u64,
    /// Whether it asks for a completion.
    pub signaled: bool,
    /// Signaled only: the requests its completion completes (itself and the unsignaled ones
    /// before it in the chain).
    pub covers: u32,
    /// A WRITE with this immediate data (a notification), consuming a receive of the peer's.
    pub imm: Option<u32>,
}

/// Why a descriptor list cannot be planned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// A limit of zero.
    #[error("RDMA limits must be positive: {0}")]
    Limits(&'static str),
    /// A range that wraps the address space.
    #[error("descriptor {0} wraps the address space")]
    Wraps(usize),
}

/// The chains, one per queue pair (some may be empty).
pub fn plan(segments: &[Segment], limits: &Limits) -> Result<Vec<Vec<WorkRequest>>, PlanError> {
    if limits.max_sge == 0 {
        return Err(PlanError::Limits("max_sge"));
    }
    if limits.wr_bytes_max == 0 {
        return Err(PlanError::Limits("wr_bytes_max"));
    }
    if limits.qps == 0 {
        return Err(PlanError::Limits("qps"));
    }
    // An entry's length is 32 bits.
    let wr_max = limits.wr_bytes_max;
    let sge_max = wr_max.min(u64::from(u32::MAX));
    let mut wrs: Vec<WorkRequest> = Vec::new();
    for (i, s) in segments.iter().enumerate() {
        if s.local_addr.checked_add(s.len).is_none() || s.remote_addr.checked_add(s.len).is_none() {
            return Err(PlanError::Wraps(i));
        }
        let mut done = 0u64;
        while done < s.len {
            let (local, remote, left) = (s.local_addr + done, s.remote_addr + done, s.len - done);
            let joins = wrs.last_mut().filter(|w| {
                w.rkey == s.rkey && w.remote_addr + w.bytes == remote && w.bytes < wr_max
            });
            if let Some(w) = joins {
                let room = wr_max - w.bytes;
                let entries = w.sges.len();
                let extends = w.sges.last_mut().filter(|e| {
                    e.lkey == s.lkey
                        && e.addr + u64::from(e.len) == local
                        && u64::from(e.len) < sge_max
                });
                let n = match extends {
                    Some(e) => {
                        let n = room.min(sge_max - u64::from(e.len)).min(left);
                        e.len += n as u32;
                        n
                    }
                    None if entries < limits.max_sge as usize => {
                        let n = room.min(sge_max).min(left);
                        w.sges.push(Sge { addr: local, len: n as u32, lkey: s.lkey });
                        n
                    }
                    None => 0,
                };
                if n > 0 {
                    w.bytes += n;
                    done += n;
                    continue;
                }
            }
            let n = left.min(sge_max);
            wrs.push(WorkRequest {
                sges: vec![Sge { addr: local, len: n as u32, lkey: s.lkey }],
                remote_addr: remote,
                rkey: s.rkey,
                bytes: n,
                signaled: false,
                covers: 0,
                imm: None,
            });
            done += n;
        }
    }
    let mut chains: Vec<Vec<WorkRequest>> = (0..limits.qps).map(|_| Vec::new()).collect();
    let mut bytes = vec![0u64; limits.qps];
    for w in wrs {
        let q = (0..limits.qps).min_by_key(|&q| (bytes[q], q)).unwrap_or(0);
        bytes[q] += w.bytes;
        chains[q].push(w);
    }
    let every = limits.signal_every.max(1);
    for chain in &mut chains {
        let mut since = 0u32;
        let n = chain.len();
        for (i, w) in chain.iter_mut().enumerate() {
            since += 1;
            if since as usize >= every || i + 1 == n {
                w.signaled = true;
                w.covers = since;
                since = 0;
            }
        }
    }
    Ok(chains)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn limits(max_sge: u32, wr_bytes_max: u64, qps: usize) -> Limits {
        Limits { max_sge, wr_bytes_max, qps, signal_every: 4 }
    }

    fn seg(local: u64, remote: u64, len: u64) -> Segment {
        Segment { local_addr: local, lkey: 1, remote_addr: remote, rkey: 2, len }
    }

    #[test]
    fn contiguous_pieces_become_one_entry_and_remote_runs_one_request() {
        // Contiguous on both sides: one request, one entry.
        let c = plan(&[seg(0, 1000, 10), seg(10, 1010, 20)], &limits(4, 1 << 20, 1)).unwrap();
        assert_eq!(c[0].len(), 1);
        assert_eq!(c[0][0].sges, vec![Sge { addr: 0, len: 30, lkey: 1 }]);
        // Remote contiguous, local scattered: one request, two entries.
        let c = plan(&[seg(0, 1000, 10), seg(500, 1010, 20)], &limits(4, 1 << 20, 1)).unwrap();
        assert_eq!(c[0].len(), 1);
        assert_eq!(c[0][0].sges.len(), 2);
        assert_eq!((c[0][0].remote_addr, c[0][0].bytes), (1000, 30));
        // Remote scattered: two requests.
        let c = plan(&[seg(0, 1000, 10), seg(10, 5000, 20)], &limits(4, 1 << 20, 1)).unwrap();
        assert_eq!(c[0].len(), 2);
        // Another rkey never joins.
        let mut other = seg(10, 1010, 20);
        other.rkey = 3;
        assert_eq!(plan(&[seg(0, 1000, 10), other], &limits(4, 1 << 20, 1)).unwrap()[0].len(), 2);
    }

    #[test]
    fn limits_split_requests() {
        // Three entries at most: the fourth scattered piece starts a new request.
        let segs: Vec<_> = (0..4).map(|i| seg(i * 100, 1000 + i * 10, 10)).collect();
        let c = plan(&segs, &limits(3, 1 << 20, 1)).unwrap();
        assert_eq!(c[0].iter().map(|w| w.sges.len()).collect::<Vec<_>>(), vec![3, 1]);
        assert_eq!(c[0][1].remote_addr, 1030);
        // A piece longer than a request: split at wr_bytes_max.
        let c = plan(&[seg(0, 0, 10_000)], &limits(3, 4096, 1)).unwrap();
        assert_eq!(c[0].iter().map(|w| w.bytes).collect::<Vec<_>>(), vec![4096, 4096, 1808]);
        // Entries never exceed 32 bits.
        let c = plan(&[seg(0, 0, 5 << 30)], &limits(8, 1 << 40, 1)).unwrap();
        assert!(c[0].iter().flat_map(|w| &w.sges).all(|e| e.len as u64 <= u32::MAX as u64));
        assert_eq!(c[0].iter().map(|w| w.bytes).sum::<u64>(), 5 << 30);
    }

    #[test]
    fn striped_over_queue_pairs_and_signaled() {
        let c = plan(
            &[seg(0, 0, 16 << 20)],
            &Limits { max_sge: 4, wr_bytes_max: 1 << 20, qps: 4, signal_every: 3 },
        )
        .unwrap();
        assert_eq!(c.iter().map(Vec::len).collect::<Vec<_>>(), vec![4, 4, 4, 4]);
        for chain in &c {
            let signaled: Vec<u32> =
                chain.iter().filter(|w| w.signaled).map(|w| w.covers).collect();
            assert_eq!(signaled, vec![3, 1], "every third and the last");
            assert_eq!(signaled.iter().sum::<u32>() as usize, chain.len());
        }
        assert_eq!(plan(&[], &limits(1, 1, 2)).unwrap(), vec![vec![], vec![]]);
    }

    #[test]
    fn bad_limits_and_wrapping_ranges_are_refused() {
        assert_eq!(plan(&[], &limits(0, 1, 1)), Err(PlanError::Limits("max_sge")));
        assert_eq!(plan(&[], &limits(1, 0, 1)), Err(PlanError::Limits("wr_bytes_max")));
        assert_eq!(plan(&[], &limits(1, 1, 0)), Err(PlanError::Limits("qps")));
        assert_eq!(
            plan(&[seg(0, 0, 1), seg(u64::MAX, 0, 2)], &limits(1, 1, 1)),
            Err(PlanError::Wraps(1))
        );
    }

    proptest! {
        /// Every byte is moved exactly once, between the same local and remote addresses as
        /// its descriptor says, and every request respects the limits.
        #[test]
        fn plans_cover_every_byte_within_limits(
            pieces in proptest::collection::vec((0u64..8, 0u64..8, 1u64..5000, 0u32..2), 1..40),
            max_sge in 1u32..5, wr_bytes_max in 1u64..9000, qps in 1usize..5, every in 1usize..6,
        ) {
            // Pieces laid out with gaps or not, so that some join and some do not.
            let (mut l, mut r) = (4096u64, 1 << 20);
            let mut segs = Vec::new();
            for (lg, rg, len, key) in pieces {
                l += lg * 7;
                r += rg * 11;
                segs.push(Segment { local_addr: l, lkey: 1 + key, remote_addr: r, rkey: 9 + key, len });
                l += len;
                r += len;
            }
            let lim = Limits { max_sge, wr_bytes_max, qps, signal_every: every };
            let chains = plan(&segs, &lim).unwrap();
            prop_assert_eq!(chains.len(), qps);
            // Byte maps: remote address → (local address, keys), from the plan and from the segments.
            let mut planned = Vec::new();
            for chain in &chains {
                let mut unsignaled = 0u32;
                for w in chain {
                    prop_assert!(!w.sges.is_empty() && w.sges.len() <= max_sge as usize);
                    prop_assert!(w.bytes <= wr_bytes_max);
                    prop_assert_eq!(w.bytes, w.sges.iter().map(|e| u64::from(e.len)).sum::<u64>());
                    let mut at = w.remote_addr;
                    for e in &w.sges {
                        prop_assert!(e.len > 0);
                        planned.push((at, e.addr, u64::from(e.len), e.lkey, w.rkey));
                        at += u64::from(e.len);
                    }
                    unsignaled += 1;
                    if w.signaled {
                        prop_assert_eq!(w.covers, unsignaled);
                        prop_assert!(w.covers as usize <= every);
                        unsignaled = 0;
                    }
                }
                prop_assert_eq!(unsignaled, 0, "a chain ends with a signaled request");
            }
            let expand = |v: &[(u64, u64, u64, u32, u32)]| {
                let mut bytes: Vec<(u64, u64, u32, u32)> = v.iter()
                    .flat_map(|&(r, l, n, lk, rk)| (0..n).map(move |i| (r + i, l + i, lk, rk)))
                    .collect();
                bytes.sort_unstable();
                bytes
            };
            let want: Vec<_> = segs.iter().map(|s| (s.remote_addr, s.local_addr, s.len, s.lkey, s.rkey)).collect();
            prop_assert_eq!(expand(&planned), expand(&want));
        }
    }
}
