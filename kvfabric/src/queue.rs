//! One admission queue: the order in which waiting requests get a slot, for the engine's
//! scheduler (a batch slot) and the frontend's queue (a worker slot) alike. Sans IO, as
//! [`crate::session::proto`] is: no clock, no channel, no lock; time is passed in, and the
//! caller acts on what the queue decides (answers a shed or expired request, preempts a
//! running one).
//!
//! - **Order.** Earliest deadline first: a request's key is its arrival plus its class's TTFT
//!   target, or plus its timeout when it has no class ([`Key::of`]); or first come first
//!   served (the key is the arrival). Equal keys keep their arrival order.
//! - **Bounds.** Per class ([`Queue::class_full`]: the frontend refuses a request of a full
//!   class) or in all ([`Queue::shed_over`]: the engine takes a more urgent request into a
//!   full queue and sheds the least urgent, never a pinned one, a preempted request that was
//!   admitted before).
//! - **Expiry.** [`Queue::expired`]: requests past their deadline, or past their class's
//!   `expire` (a request not started by then is answered, never computed).
//! - **Shares and bursts.** [`Queue::next_for_slot`]: the first request whose class holds less
//!   than its share of the slots while other classes wait; with every slot taken, a burst
//!   slot to the first latency-class request.
//! - **Preemption.** [`Queue::preemption`]: with a full batch, the first waiting request that
//!   may take a running one's slot, and which: a less urgent request's prefill, or, when the
//!   waiting one would miss its TTFT target, a less urgent request's decode.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use crate::contract::generate::ClassHint;

/// How waiting requests are ordered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum QueuePolicy {
    /// Earliest deadline first: arrival plus the class's TTFT target. A more urgent class
    /// displaces a less urgent one from a full queue and preempts its prefill.
    #[default]
    Edf,
    /// First come first served, whatever the class (the comparison for `Edf`): no
    /// displacement, no preemption.
    Fcfs,
}

/// A point in time: the queue works with `std`'s and tokio's instants (the frontend's queue
/// runs on tokio's clock, which tests pause).
pub trait Moment: Copy + Ord + std::fmt::Debug {
    /// `self + d`, None past the clock's range.
    fn plus(self, d: Duration) -> Option<Self>;
}

impl Moment for std::time::Instant {
    fn plus(self, d: Duration) -> Option<Self> {
        self.checked_add(d)
    }
}

impl Moment for tokio::time::Instant {
    fn plus(self, d: Duration) -> Option<Self> {
        self.checked_add(d)
    }
}

/// A request's deadline key (the order it is served in).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Key<I>(pub I);

impl<I: Moment> Key<I> {
    /// The one rule: under [`QueuePolicy::Edf`], arrival plus the class's TTFT target, or
    /// plus `timeout` without one; under [`QueuePolicy::Fcfs`], the arrival. A key past the
    /// clock's range is the arrival.
    pub fn of(
        policy: QueuePolicy,
        arrival: I,
        class: Option<&ClassHint>,
        timeout: Duration,
    ) -> Self {
        let target = match policy {
            QueuePolicy::Edf => class.and_then(|c| c.ttft).unwrap_or(timeout),
            QueuePolicy::Fcfs => Duration::ZERO,
        };
        Key(arrival.plus(target).unwrap_or(arrival))
    }
}

/// What the queue knows of a waiting request.
#[derive(Debug, Clone)]
pub struct Meta<I> {
    /// Its class's name ([`NO_CLASS`] without one), for bounds and shares.
    pub class: String,
    /// Its class's rank: 0 is the most urgent.
    pub rank: u8,
    /// Its place in the order.
    pub key: Key<I>,
    /// Answer by then (None: its deadline is past the clock's range, so it is past).
    pub deadline: Option<I>,
    /// Its class's expiry: not started by then, it is answered, not computed.
    pub expires: Option<I>,
    /// Its class's share of the slots while other classes wait.
    pub share: Option<f64>,
    /// Its class has a TTFT target (it may have a decode yield to it).
    pub has_ttft: bool,
    /// A latency class (an ITL target): it may take a burst slot.
    pub urgent: bool,
    /// Never shed (a preempted request that was admitted before).
    pub pinned: bool,
}

/// The class counted for requests without one.
pub const NO_CLASS: &str = "none";

impl<I: Moment> Meta<I> {
    /// A request of `class` arriving at `arrival`, to be answered within `timeout`.
    pub fn new(
        policy: QueuePolicy,
        class: Option<&ClassHint>,
        arrival: I,
        timeout: Duration,
    ) -> Self {
        let edf = policy == QueuePolicy::Edf;
        Meta {
            class: class.map_or(NO_CLASS, |c| c.name.as_str()).to_string(),
            rank: class.map_or(0, |c| c.rank),
            key: Key::of(policy, arrival, class, timeout),
            deadline: arrival.plus(timeout),
            expires: class.and_then(|c| c.expire).and_then(|e| arrival.plus(e)),
            share: class.and_then(|c| c.share),
            has_ttft: class.is_some_and(|c| c.ttft.is_some()),
            // First come first served is that whatever the class: no burst.
            urgent: edf && class.is_some_and(|c| c.itl.is_some()),
            pinned: false,
        }
    }

    /// Less urgent is greater: its rank, then its key.
    fn urgency(&self) -> (u8, Key<I>) {
        (self.rank, self.key)
    }
}

/// A request's place in the queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Place<I> {
    key: Key<I>,
    seq: u64,
}

/// Why a request left the queue unserved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expiry {
    /// Its own deadline passed.
    Deadline,
    /// Its class's `expire` passed first.
    Class,
}

/// A running request, as [`Queue::preemption`] weighs it.
#[derive(Debug, Clone, Copy)]
pub struct Running<I> {
    /// Its class's rank.
    pub rank: u8,
    /// Its key.
    pub key: Key<I>,
    /// It has produced a token (a decode).
    pub generated: bool,
    /// Its computation started (not still importing its cached blocks).
    pub started: bool,
}

/// The slots a [`Queue::next_for_slot`] fills.
#[derive(Debug, Clone, Copy)]
pub struct Slots<'a> {
    /// Slots.
    pub capacity: usize,
    /// Slots past `capacity` that only latency-class requests may take.
    pub burst: usize,
    /// Slots taken.
    pub in_flight: usize,
    /// Slots taken per class.
    pub held: &'a HashMap<String, usize>,
}

/// Waiting requests of type `T`, in order.
#[derive(Debug)]
pub struct Queue<T, I> {
    policy: QueuePolicy,
    entries: BTreeMap<Place<I>, (Meta<I>, T)>,
    by_class: HashMap<String, usize>,
    pinned: usize,
    seq: u64,
}

impl<T, I: Moment> Queue<T, I> {
    /// An empty queue.
    pub fn new(policy: QueuePolicy) -> Self {
        Queue { policy, entries: BTreeMap::new(), by_class: HashMap::new(), pinned: 0, seq: 0 }
    }

    /// Its policy.
    pub fn policy(&self) -> QueuePolicy {
        self.policy
    }

    /// Requests waiting.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether none waits.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Pinned requests waiting.
    pub fn pinned(&self) -> usize {
        self.pinned
    }

    /// Requests of `class` waiting.
    pub fn waiting_in(&self, class: &str) -> usize {
        self.by_class.get(class).copied().unwrap_or(0)
    }

    /// Requests waiting per class.
    pub fn classes(&self) -> impl Iterator<Item = (&str, usize)> {
        self.by_class.iter().map(|(c, n)| (c.as_str(), *n))
    }

    /// Whether a request of `class` finds its class's queue full at `bound`.
    pub fn class_full(&self, class: &str, bound: usize) -> bool {
        self.waiting_in(class) >= bound
    }

    /// The waiting requests in order.
    pub fn iter(&self) -> impl Iterator<Item = (Place<I>, &Meta<I>, &T)> {
        self.entries.iter().map(|(p, (m, t))| (*p, m, t))
    }

    /// The greatest rank waiting as the policy sees it (first come first served: 0).
    pub fn least_urgent_rank(&self) -> u8 {
        match self.policy {
            QueuePolicy::Edf => self.entries.values().map(|(m, _)| m.rank).max().unwrap_or(0),
            QueuePolicy::Fcfs => 0,
        }
    }

    /// Queues a request behind those of the same key.
    pub fn push(&mut self, meta: Meta<I>, item: T) -> Place<I> {
        self.seq += 1;
        let place = Place { key: meta.key, seq: self.seq };
        *self.by_class.entry(meta.class.clone()).or_default() += 1;
        self.pinned += usize::from(meta.pinned);
        self.entries.insert(place, (meta, item));
        place
    }

    /// Takes a request out.
    pub fn remove(&mut self, place: Place<I>) -> Option<(Meta<I>, T)> {
        let (meta, item) = self.entries.remove(&place)?;
        if let Some(n) = self.by_class.get_mut(&meta.class) {
            *n -= 1;
            if *n == 0 {
                self.by_class.remove(&meta.class);
            }
        }
        self.pinned -= usize::from(meta.pinned);
        Some((meta, item))
    }

    /// Takes the first request out.
    pub fn pop_first(&mut self) -> Option<(Meta<I>, T)> {
        let place = *self.entries.keys().next()?;
        self.remove(place)
    }

    /// Over `bound` unpinned requests: sheds the least urgent unpinned ones (greatest rank,
    /// then latest key) until it is within, and returns them, most urgent of them last.
    pub fn shed_over(&mut self, bound: usize) -> Vec<(Meta<I>, T)> {
        let mut out = Vec::new();
        while self.entries.len() - self.pinned > bound {
            let Some(place) = self
                .entries
                .iter()
                .filter(|(_, (m, _))| !m.pinned)
                .max_by_key(|(p, (m, _))| (m.urgency(), p.seq))
                .map(|(p, _)| *p)
            else {
                break;
            };
            out.extend(self.remove(place));
        }
        out
    }

    /// Takes out every request whose deadline or class expiry is `now` or past, and those
    /// `gone` says went away (with no expiry), in order.
    pub fn expired(
        &mut self,
        now: I,
        mut gone: impl FnMut(&T) -> bool,
    ) -> Vec<(Option<Expiry>, Meta<I>, T)> {
        let due: Vec<(Place<I>, Option<Expiry>)> = self
            .entries
            .iter()
            .filter_map(|(p, (m, t))| {
                let past_deadline = m.deadline.is_none_or(|d| now >= d);
                let past_class = m.expires.is_some_and(|e| now >= e);
                if gone(t) {
                    Some((*p, None))
                } else if past_class && !past_deadline {
                    Some((*p, Some(Expiry::Class)))
                } else if past_deadline {
                    Some((*p, Some(Expiry::Deadline)))
                } else {
                    None
                }
            })
            .collect();
        due.into_iter().filter_map(|(p, why)| self.remove(p).map(|(m, t)| (why, m, t))).collect()
    }

    /// The request a free slot goes to, if one may take it: the first, in order, whose class
    /// holds less than its share of `slots` while requests of other classes wait, else the
    /// first; with every slot taken, a burst slot to the first latency-class request.
    pub fn next_for_slot(&self, slots: &Slots<'_>) -> Option<Place<I>> {
        let full = slots.in_flight >= slots.capacity;
        if full && slots.in_flight >= slots.capacity.saturating_add(slots.burst) {
            return None;
        }
        if full {
            return self.iter().find(|(_, m, _)| m.urgent).map(|(p, _, _)| p);
        }
        let total = self.entries.len();
        let within = |m: &Meta<I>| {
            let others_wait = total > self.waiting_in(&m.class);
            let cap = m.share.map(|s| ((s * slots.capacity as f64).ceil() as usize).max(1));
            let held = slots.held.get(&m.class).copied().unwrap_or(0);
            !others_wait || cap.is_none_or(|c| held < c)
        };
        self.iter().find(|(_, m, _)| within(m)).or_else(|| self.iter().next()).map(|(p, _, _)| p)
    }

    /// With a full batch of `running`, the first waiting request (in order) that may take a
    /// running one's slot, and that running request (its index): the least urgent prefill of
    /// a higher rank and a later key (queued again, it waits behind the request it made room
    /// for); or, under [`QueuePolicy::Edf`] for a request of a class with a TTFT target that
    /// `would_miss` it waiting, the least urgent decode of a higher rank. Not only the
    /// queue's head: a paused batch request at the head waits for a free slot, and must not
    /// hold back the interactive request behind it.
    pub fn preemption(
        &self,
        running: &[Running<I>],
        mut would_miss: impl FnMut(&Meta<I>, &T) -> bool,
    ) -> Option<(Place<I>, usize)> {
        // Only a request more urgent than some running one can take a slot.
        let least_urgent = running.iter().map(|r| r.rank).max()?;
        let least = |pick: &dyn Fn(&Running<I>) -> bool| {
            (0..running.len()).filter(|&i| pick(&running[i])).max_by_key(|&i| {
                let r = &running[i];
                (r.rank, r.key)
            })
        };
        self.iter().find_map(|(place, m, t)| {
            if m.rank >= least_urgent {
                return None;
            }
            let rank = match self.policy {
                QueuePolicy::Edf => m.rank,
                QueuePolicy::Fcfs => 0,
            };
            let prefill = least(&|r| !r.generated && r.rank > rank && r.key > m.key);
            let victim = prefill.or_else(|| {
                if self.policy != QueuePolicy::Edf || !m.has_ttft {
                    return None;
                }
                let decode = least(&|r| r.started && r.generated && r.rank > m.rank)?;
                would_miss(m, t).then_some(decode)
            })?;
            Some((place, victim))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::time::Instant;

    fn class(name: &str, rank: u8, ttft_ms: Option<u64>) -> ClassHint {
        ClassHint {
            name: name.into(),
            rank,
            priority: 0,
            ttft: ttft_ms.map(Duration::from_millis),
            itl: (rank == 0).then(|| Duration::from_millis(50)),
            expire: None,
            share: None,
        }
    }

    /// A request: arrival offset (ms), class (index into three classes or none), timeout (ms).
    fn arb_request() -> impl Strategy<Value = (u64, Option<usize>, u64)> {
        (0u64..10_000, proptest::option::of(0usize..3), 1u64..60_000)
    }

    fn classes() -> [ClassHint; 3] {
        [class("chat", 0, Some(500)), class("batch", 2, Some(30_000)), class("bulk", 1, None)]
    }

    fn meta(t0: Instant, policy: QueuePolicy, r: &(u64, Option<usize>, u64)) -> Meta<Instant> {
        let cs = classes();
        let at = t0 + Duration::from_millis(r.0);
        Meta::new(policy, r.1.map(|i| &cs[i]), at, Duration::from_millis(r.2))
    }

    proptest! {
        /// Requests leave in key order, equal keys in arrival order; under FCFS the key is
        /// the arrival.
        #[test]
        fn requests_leave_in_deadline_order(reqs in proptest::collection::vec(arb_request(), 0..64), fcfs: bool) {
            let policy = if fcfs { QueuePolicy::Fcfs } else { QueuePolicy::Edf };
            let t0 = Instant::now();
            let mut q = Queue::new(policy);
            for (i, r) in reqs.iter().enumerate() {
                q.push(meta(t0, policy, r), i);
            }
            let mut last: Option<(Key<Instant>, usize)> = None;
            while let Some((m, i)) = q.pop_first() {
                if fcfs {
                    prop_assert_eq!(m.key.0, t0 + Duration::from_millis(reqs[i].0));
                }
                if let Some((k, j)) = last {
                    prop_assert!(k < m.key || (k == m.key && j < i), "{:?} then {:?}", (k, j), (m.key, i));
                }
                last = Some((m.key, i));
            }
            prop_assert_eq!(q.len(), 0);
            prop_assert_eq!(q.classes().count(), 0, "the class counts follow");
        }

        /// Shedding keeps the bound, never sheds a pinned request, and sheds only requests
        /// no more urgent than any that stay.
        #[test]
        fn shedding_takes_the_least_urgent_and_spares_the_pinned(
            reqs in proptest::collection::vec((arb_request(), any::<bool>()), 0..64),
            bound in 0usize..16,
        ) {
            let t0 = Instant::now();
            let mut q = Queue::new(QueuePolicy::Edf);
            for (i, (r, pinned)) in reqs.iter().enumerate() {
                let mut m = meta(t0, QueuePolicy::Edf, r);
                m.pinned = *pinned;
                q.push(m, i);
            }
            let pinned = reqs.iter().filter(|(_, p)| *p).count();
            let shed = q.shed_over(bound);
            prop_assert!(q.len() - q.pinned() <= bound);
            prop_assert_eq!(q.pinned(), pinned);
            prop_assert_eq!(shed.len() + q.len(), reqs.len());
            for (m, _) in &shed {
                prop_assert!(!m.pinned);
                for (_, kept, _) in q.iter() {
                    prop_assert!(kept.pinned || kept.urgency() <= m.urgency());
                }
            }
        }

        /// Expiry takes exactly the requests past their deadline or their class's expiry,
        /// and the gone ones, and says which.
        #[test]
        fn expiry_takes_exactly_what_is_due(
            reqs in proptest::collection::vec((arb_request(), proptest::option::of(1u64..20_000), any::<bool>()), 0..64),
            now_ms in 0u64..70_000,
        ) {
            let t0 = Instant::now();
            let now = t0 + Duration::from_millis(now_ms);
            let mut q = Queue::new(QueuePolicy::Edf);
            for (i, (r, expire, gone)) in reqs.iter().enumerate() {
                let mut m = meta(t0, QueuePolicy::Edf, r);
                m.expires = expire.map(|e| t0 + Duration::from_millis(r.0 + e));
                q.push(m, (i, *gone));
            }
            let out = q.expired(now, |&(_, gone)| gone);
            for (why, m, (_, gone)) in &out {
                let past_deadline = m.deadline.is_none_or(|d| now >= d);
                let past_class = m.expires.is_some_and(|e| now >= e);
                match why {
                    None => prop_assert!(*gone),
                    Some(Expiry::Deadline) => prop_assert!(past_deadline && !gone),
                    Some(Expiry::Class) => prop_assert!(past_class && !past_deadline && !gone),
                }
            }
            for (_, m, (_, gone)) in q.iter() {
                prop_assert!(!gone && m.deadline.is_some_and(|d| now < d));
                prop_assert!(m.expires.is_none_or(|e| now < e));
            }
            prop_assert_eq!(out.len() + q.len(), reqs.len());
        }

        /// A free slot goes to the first request within its class's share while others
        /// wait; a full set of slots gives a burst slot only to a latency-class request.
        #[test]
        fn slots_follow_shares_and_bursts(
            reqs in proptest::collection::vec(arb_request(), 1..32),
            shares in proptest::collection::vec(proptest::option::of(0.1f64..1.0), 3),
            capacity in 1usize..8,
            in_flight in 0usize..12,
            held_chat in 0usize..8,
        ) {
            let t0 = Instant::now();
            let mut q = Queue::new(QueuePolicy::Edf);
            for (i, r) in reqs.iter().enumerate() {
                let mut m = meta(t0, QueuePolicy::Edf, r);
                m.share = r.1.and_then(|c| shares[c]);
                q.push(m, i);
            }
            let held: HashMap<String, usize> = [("chat".to_string(), held_chat)].into();
            let slots = Slots { capacity, burst: 1, in_flight, held: &held };
            let got = q.next_for_slot(&slots);
            if in_flight > capacity {
                prop_assert!(got.is_none());
            } else if in_flight >= capacity {
                let first_urgent = q.iter().find(|(_, m, _)| m.urgent).map(|(p, _, _)| p);
                prop_assert_eq!(got, first_urgent);
            } else {
                let p = got.expect("a free slot is given");
                let (_, m, _) = q.iter().find(|(x, _, _)| *x == p).unwrap();
                let others_wait = q.len() > q.waiting_in(&m.class);
                let cap = m.share.map(|s| ((s * capacity as f64).ceil() as usize).max(1));
                let within = !others_wait
                    || cap.is_none_or(|c| held.get(&m.class).copied().unwrap_or(0) < c);
                // Within its share, or no request is (then the first).
                let any_within = q.iter().any(|(_, m, _)| {
                    let ow = q.len() > q.waiting_in(&m.class);
                    let cap = m.share.map(|s| ((s * capacity as f64).ceil() as usize).max(1));
                    !ow || cap.is_none_or(|c| held.get(&m.class).copied().unwrap_or(0) < c)
                });
                prop_assert!(within || (!any_within && Some(p) == q.iter().next().map(|(x, _, _)| x)));
                // Nothing before it in order was within.
                for (x, m2, _) in q.iter().take_while(|(x, _, _)| *x != p) {
                    let ow = q.len() > q.waiting_in(&m2.class);
                    let cap = m2.share.map(|s| ((s * capacity as f64).ceil() as usize).max(1));
                    let w = !ow || cap.is_none_or(|c| held.get(&m2.class).copied().unwrap_or(0) < c);
                    prop_assert!(!w || !within, "{x:?} was within and came first");
                }
            }
        }

        /// Preemption takes a slot only for a more urgent request, from a prefill with a
        /// higher rank and a later key, or (EDF, a class with a TTFT target that would miss
        /// it) from a decode with a higher rank; the victim is the least urgent such.
        #[test]
        fn preemption_only_for_the_more_urgent(
            reqs in proptest::collection::vec(arb_request(), 0..16),
            running in proptest::collection::vec((0u8..3, 0u64..40_000, any::<bool>(), any::<bool>()), 0..8),
            miss: bool,
        ) {
            let t0 = Instant::now();
            let mut q = Queue::new(QueuePolicy::Edf);
            for (i, r) in reqs.iter().enumerate() {
                q.push(meta(t0, QueuePolicy::Edf, r), i);
            }
            let run: Vec<Running<Instant>> = running
                .iter()
                .map(|&(rank, key, generated, started)| Running {
                    rank,
                    key: Key(t0 + Duration::from_millis(key)),
                    generated,
                    started: started || !generated,
                })
                .collect();
            match q.preemption(&run, |_, _| miss) {
                None => {}
                Some((p, v)) => {
                    let (_, m, _) = q.iter().find(|(x, _, _)| *x == p).unwrap();
                    let r = run[v];
                    prop_assert!(r.rank > m.rank, "only a higher rank yields");
                    if r.generated {
                        prop_assert!(miss && m.has_ttft && r.started);
                    } else {
                        prop_assert!(r.key > m.key);
                    }
                    // It is the first waiting request that could take a slot.
                    for (x, m2, _) in q.iter().take_while(|(x, _, _)| *x != p) {
                        let could = run.iter().any(|r| {
                            r.rank > m2.rank
                                && ((!r.generated && r.key > m2.key)
                                    || (miss && m2.has_ttft && r.started && r.generated))
                        });
                        prop_assert!(!could, "{x:?} came first and could have");
                    }
                }
            }
        }
    }

    #[test]
    fn keys_follow_the_one_rule() {
        let t0 = Instant::now();
        let chat = class("chat", 0, Some(500));
        let timeout = Duration::from_secs(30);
        assert_eq!(
            Key::of(QueuePolicy::Edf, t0, Some(&chat), timeout).0,
            t0 + Duration::from_millis(500)
        );
        assert_eq!(Key::of(QueuePolicy::Edf, t0, None, timeout).0, t0 + timeout);
        assert_eq!(Key::of(QueuePolicy::Fcfs, t0, Some(&chat), timeout).0, t0);
        let m = Meta::new(QueuePolicy::Fcfs, Some(&chat), t0, timeout);
        assert!(!m.urgent, "first come first served gives no burst");
    }
}
