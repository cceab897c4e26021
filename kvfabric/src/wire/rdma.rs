//! What two agents exchange over their authenticated session to connect RDMA queue pairs:
//! each queue pair's address (LID, GID, QPN, PSN, MTU) and, from the side that owns memory,
//! the remote key of each region it exports.
//!
//! Both messages travel inside the session's frames (`RdmaConnect` and `RdmaAccept`), after
//! the handshake: a peer without the secret learns no queue pair and no key. Decoding treats
//! the bytes as hostile: every count is bounded before anything is allocated, every number is
//! checked against what verbs accepts (24-bit QPN and PSN, MTU 256…4096, a region that does
//! not wrap the address space), and a malformed body is a [`ExchangeError`], never a panic.
//!
//! ```text
//! Connect: u8 n | n × QpAddr
//! Accept:  u8 n | n × QpAddr | u32 m | m × RegionKey | u8 has_mailbox [| Mailbox]
//! QpAddr:    u16 lid | [u8; 16] gid | u32 qpn | u32 psn | u8 mtu | u8 rd_atomic (28 bytes)
//! RegionKey: u64 region | u64 addr | u64 len | u32 rkey                   (28 bytes)
//! Mailbox:   u64 addr | u32 rkey | u16 slots | u32 slot_bytes              (18 bytes)
//! ```

/// Most queue pairs one connection stripes over.
pub const QPS_MAX: usize = 16;
/// Most region keys in one accept.
pub const REGIONS_MAX: usize = 65_536;
const QP_ADDR_BYTES: usize = 28;
const REGION_KEY_BYTES: usize = 28;

/// The address of one queue pair: what the other side needs to connect its own to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpAddr {
    /// The port's LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// The GID of the port's chosen index (RoCE, or routed InfiniBand).
    pub gid: [u8; 16],
    /// The queue pair number (24 bits).
    pub qpn: u32,
    /// The first packet sequence number it sends (24 bits).
    pub psn: u32,
    /// Its path MTU as verbs numbers it: 1 = 256 … 5 = 4096 bytes.
    pub mtu: u8,
    /// RDMA READs it answers at once (the other side initiates at most this many).
    pub rd_atomic: u8,
}

/// A region the owner lets its peer read and write with one-sided operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionKey {
    /// The region's id in the owner's table (what descriptors name).
    pub region: u64,
    /// The address its memory registration starts at (remote addresses are `addr + offset`).
    pub addr: u64,
    /// Its length.
    pub len: u64,
    /// The remote key of its registration.
    pub rkey: u32,
}

/// Client → server: the client's queue pairs, one per stripe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Connect {
    /// Its queue pairs.
    pub qps: Vec<QpAddr>,
}

/// Server → client: the server's queue pairs (one for each of the client's, in order) and its
/// exported regions' keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Accept {
    /// Its queue pairs.
    pub qps: Vec<QpAddr>,
    /// Its exported regions.
    pub regions: Vec<RegionKey>,
    /// Where notifications carried by a WRITE with immediate data land (None: send them
    /// through the session).
    pub mailbox: Option<Mailbox>,
}

/// The owner's notification mailbox: `slots` slots of `slot_bytes`, written by WRITEs with
/// immediate data on the first queue pair; the immediate names the message's sequence
/// number, whose slot is `seq % slots`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mailbox {
    /// Start of the slots.
    pub addr: u64,
    /// Their registration's remote key.
    pub rkey: u32,
    /// How many.
    pub slots: u16,
    /// Bytes of each (a header of [`MAILBOX_HEADER_BYTES`], then the message).
    pub slot_bytes: u32,
}

/// A mailbox slot's header: the sender's transfer id (u64) and the message's length (u32).
pub const MAILBOX_HEADER_BYTES: usize = 12;
/// Most mailbox slots.
pub const MAILBOX_SLOTS_MAX: u16 = 1024;
/// Largest mailbox slot (one packet at the largest MTU).
pub const MAILBOX_SLOT_BYTES_MAX: u32 = 4096;

/// Why an exchange message was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExchangeError {
    /// Shorter than its fields.
    #[error("RDMA exchange truncated")]
    Truncated,
    /// Longer than its fields.
    #[error("{0} trailing byte(s) after the RDMA exchange")]
    Trailing(usize),
    /// A count over its bound.
    #[error("{what} {value} exceeds the limit of {limit}")]
    TooMany {
        /// What was counted.
        what: &'static str,
        /// The count received.
        value: usize,
        /// The bound.
        limit: usize,
    },
    /// A field with a value verbs does not accept.
    #[error("invalid RDMA exchange field: {0}")]
    Invalid(&'static str),
}

impl QpAddr {
    fn put(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.lid.to_le_bytes());
        out.extend_from_slice(&self.gid);
        out.extend_from_slice(&self.qpn.to_le_bytes());
        out.extend_from_slice(&self.psn.to_le_bytes());
        out.push(self.mtu);
        out.push(self.rd_atomic);
    }

    fn take(c: &mut Cursor<'_>) -> Result<QpAddr, ExchangeError> {
        let lid = u16::from_le_bytes(c.array()?);
        let gid = c.array()?;
        let qpn = u32::from_le_bytes(c.array()?);
        let psn = u32::from_le_bytes(c.array()?);
        let [mtu, rd_atomic] = c.array::<2>()?;
        if qpn >= 1 << 24 {
            return Err(ExchangeError::Invalid("queue pair number over 24 bits"));
        }
        if psn >= 1 << 24 {
            return Err(ExchangeError::Invalid("packet sequence number over 24 bits"));
        }
        if !(1..=5).contains(&mtu) {
            return Err(ExchangeError::Invalid("path MTU (1..=5)"));
        }
        if rd_atomic == 0 {
            return Err(ExchangeError::Invalid("outstanding READs (at least 1)"));
        }
        Ok(QpAddr { lid, gid, qpn, psn, mtu, rd_atomic })
    }
}

impl RegionKey {
    fn put(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.region.to_le_bytes());
        out.extend_from_slice(&self.addr.to_le_bytes());
        out.extend_from_slice(&self.len.to_le_bytes());
        out.extend_from_slice(&self.rkey.to_le_bytes());
    }

    fn take(c: &mut Cursor<'_>) -> Result<RegionKey, ExchangeError> {
        let region = u64::from_le_bytes(c.array()?);
        let addr = u64::from_le_bytes(c.array()?);
        let len = u64::from_le_bytes(c.array()?);
        let rkey = u32::from_le_bytes(c.array()?);
        if len == 0 {
            return Err(ExchangeError::Invalid("empty region"));
        }
        if addr.checked_add(len).is_none() {
            return Err(ExchangeError::Invalid("region wraps the address space"));
        }
        Ok(RegionKey { region, addr, len, rkey })
    }

    /// The remote address of `len` bytes at `offset` in this region; None when they are not
    /// all inside it.
    pub fn remote_addr(&self, offset: u64, len: u64) -> Option<u64> {
        let end = offset.checked_add(len)?;
        (end <= self.len).then(|| self.addr + offset)
    }
}

struct Cursor<'a>(&'a [u8]);

impl Cursor<'_> {
    fn array<const N: usize>(&mut self) -> Result<[u8; N], ExchangeError> {
        if self.0.len() < N {
            return Err(ExchangeError::Truncated);
        }
        let (head, rest) = self.0.split_at(N);
        self.0 = rest;
        let mut a = [0u8; N];
        a.copy_from_slice(head);
        Ok(a)
    }

    fn qps(&mut self) -> Result<Vec<QpAddr>, ExchangeError> {
        let n = usize::from(self.array::<1>()?[0]);
        if n == 0 {
            return Err(ExchangeError::Invalid("no queue pair"));
        }
        if n > QPS_MAX {
            return Err(ExchangeError::TooMany { what: "queue pairs", value: n, limit: QPS_MAX });
        }
        if self.0.len() < n * QP_ADDR_BYTES {
            return Err(ExchangeError::Truncated);
        }
        (0..n).map(|_| QpAddr::take(self)).collect()
    }

    fn end(&self) -> Result<(), ExchangeError> {
        match self.0.len() {
            0 => Ok(()),
            n => Err(ExchangeError::Trailing(n)),
        }
    }
}

fn put_qps(out: &mut Vec<u8>, qps: &[QpAddr]) {
    // Encoders are given at most QPS_MAX (the transport never opens more).
    out.push(qps.len().min(QPS_MAX) as u8);
    for q in qps.iter().take(QPS_MAX) {
        q.put(out);
    }
}

impl Connect {
    /// Encodes the body.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(1 + self.qps.len() * QP_ADDR_BYTES);
        put_qps(&mut out, &self.qps);
        out
    }

    /// Decodes and checks a body.
    pub fn decode(b: &[u8]) -> Result<Connect, ExchangeError> {
        let mut c = Cursor(b);
        let qps = c.qps()?;
        c.end()?;
        Ok(Connect { qps })
    }
}

impl Accept {
    /// Encodes the body.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(
            1 + self.qps.len() * QP_ADDR_BYTES + 4 + self.regions.len() * REGION_KEY_BYTES,
        );
        put_qps(&mut out, &self.qps);
        let regions = &self.regions[..self.regions.len().min(REGIONS_MAX)];
        out.extend_from_slice(&(regions.len() as u32).to_le_bytes());
        for r in regions {
            r.put(&mut out);
        }
        match &self.mailbox {
            None => out.push(0),
            Some(m) => {
                out.push(1);
                out.extend_from_slice(&m.addr.to_le_bytes());
                out.extend_from_slice(&m.rkey.to_le_bytes());
                out.extend_from_slice(&m.slots.to_le_bytes());
                out.extend_from_slice(&m.slot_bytes.to_le_bytes());
            }
        }
        out
    }

    /// Decodes and checks a body.
    pub fn decode(b: &[u8]) -> Result<Accept, ExchangeError> {
        let mut c = Cursor(b);
        let qps = c.qps()?;
        let m = u32::from_le_bytes(c.array()?) as usize;
        if m > REGIONS_MAX {
            return Err(ExchangeError::TooMany { what: "regions", value: m, limit: REGIONS_MAX });
        }
        if c.0.len() < m * REGION_KEY_BYTES {
            return Err(ExchangeError::Truncated);
        }
        let regions = (0..m).map(|_| RegionKey::take(&mut c)).collect::<Result<Vec<_>, _>>()?;
        let mailbox = match c.array::<1>()?[0] {
            0 => None,
            1 => {
                let addr = u64::from_le_bytes(c.array()?);
                let rkey = u32::from_le_bytes(c.array()?);
                let slots = u16::from_le_bytes(c.array()?);
                let slot_bytes = u32::from_le_bytes(c.array()?);
                if !(1..=MAILBOX_SLOTS_MAX).contains(&slots) {
                    return Err(ExchangeError::Invalid("mailbox slots (1..=1024)"));
                }
                if !(MAILBOX_HEADER_BYTES as u32 + 1..=MAILBOX_SLOT_BYTES_MAX).contains(&slot_bytes)
                {
                    return Err(ExchangeError::Invalid("mailbox slot bytes (13..=4096)"));
                }
                if addr.checked_add(u64::from(slots) * u64::from(slot_bytes)).is_none() {
                    return Err(ExchangeError::Invalid("mailbox wraps the address space"));
                }
                Some(Mailbox { addr, rkey, slots, slot_bytes })
            }
            _ => return Err(ExchangeError::Invalid("mailbox flag")),
        };
        c.end()?;
        let mut ids: Vec<u64> = regions.iter().map(|r| r.region).collect();
        ids.sort_unstable();
        if ids.windows(2).any(|w| w[0] == w[1]) {
            return Err(ExchangeError::Invalid("a region listed twice"));
        }
        Ok(Accept { qps, regions, mailbox })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn qp(i: u32) -> QpAddr {
        QpAddr {
            lid: i as u16,
            gid: [i as u8; 16],
            qpn: 0x00ab_cd00 + i,
            psn: i * 7,
            mtu: 5,
            rd_atomic: 16,
        }
    }

    fn accept() -> Accept {
        Accept {
            qps: (0..4).map(qp).collect(),
            regions: vec![
                RegionKey { region: 1, addr: 0x7f00_0000_0000, len: 1 << 30, rkey: 0x1234 },
                RegionKey { region: 9, addr: 0x1000, len: 4096, rkey: 7 },
            ],
            mailbox: Some(Mailbox { addr: 0x9000, rkey: 3, slots: 16, slot_bytes: 4096 }),
        }
    }

    #[test]
    fn round_trip() {
        let c = Connect { qps: (0..QPS_MAX as u32).map(qp).collect() };
        assert_eq!(Connect::decode(&c.encode()).unwrap(), c);
        let a = accept();
        assert_eq!(Accept::decode(&a.encode()).unwrap(), a);
        assert_eq!(Accept::decode(&a.encode()).unwrap().regions[1].rkey, 7);
    }

    #[test]
    fn hostile_fields_are_refused() {
        let bad_qp = |f: &dyn Fn(&mut QpAddr)| {
            let mut q = qp(1);
            f(&mut q);
            Connect::decode(&Connect { qps: vec![q] }.encode())
        };
        assert_eq!(
            bad_qp(&|q| q.qpn = 1 << 24),
            Err(ExchangeError::Invalid("queue pair number over 24 bits"))
        );
        assert_eq!(
            bad_qp(&|q| q.psn = u32::MAX),
            Err(ExchangeError::Invalid("packet sequence number over 24 bits"))
        );
        assert_eq!(bad_qp(&|q| q.mtu = 0), Err(ExchangeError::Invalid("path MTU (1..=5)")));
        assert_eq!(bad_qp(&|q| q.mtu = 6), Err(ExchangeError::Invalid("path MTU (1..=5)")));
        assert_eq!(
            bad_qp(&|q| q.rd_atomic = 0),
            Err(ExchangeError::Invalid("outstanding READs (at least 1)"))
        );
        assert_eq!(Connect::decode(&[0]), Err(ExchangeError::Invalid("no queue pair")));
        assert_eq!(
            Connect::decode(&[17]),
            Err(ExchangeError::TooMany { what: "queue pairs", value: 17, limit: QPS_MAX })
        );
        // A count that promises more than the body holds allocates nothing.
        assert_eq!(Connect::decode(&[3, 0, 0]), Err(ExchangeError::Truncated));
        let mut b = Connect { qps: vec![qp(1)] }.encode();
        b.push(0);
        assert_eq!(Connect::decode(&b), Err(ExchangeError::Trailing(1)));

        let bad_region = |r: RegionKey| {
            Accept::decode(&Accept { qps: vec![qp(0)], regions: vec![r], mailbox: None }.encode())
        };
        assert_eq!(
            bad_region(RegionKey { region: 1, addr: u64::MAX - 10, len: 11, rkey: 1 }),
            Err(ExchangeError::Invalid("region wraps the address space"))
        );
        assert_eq!(
            bad_region(RegionKey { region: 1, addr: 4096, len: 0, rkey: 1 }),
            Err(ExchangeError::Invalid("empty region"))
        );
        let mut twice = accept();
        twice.regions[1].region = 1;
        assert_eq!(
            Accept::decode(&twice.encode()),
            Err(ExchangeError::Invalid("a region listed twice"))
        );
        // u32::MAX regions promised in a few bytes: refused before any allocation.
        let mut huge = Connect { qps: vec![qp(0)] }.encode();
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(
            Accept::decode(&huge),
            Err(ExchangeError::TooMany {
                what: "regions",
                value: u32::MAX as usize,
                limit: REGIONS_MAX
            })
        );
        let mut short = Connect { qps: vec![qp(0)] }.encode();
        short.extend_from_slice(&2u32.to_le_bytes());
        short.extend_from_slice(&[0; 30]);
        assert_eq!(Accept::decode(&short), Err(ExchangeError::Truncated));
        // Mailboxes: bounded slots and sizes, no wrap, a flag of 0 or 1.
        let bad_mailbox = |m: Mailbox| {
            let mut a = accept();
            a.mailbox = Some(m);
            Accept::decode(&a.encode())
        };
        let ok = Mailbox { addr: 0x9000, rkey: 3, slots: 16, slot_bytes: 4096 };
        assert_eq!(
            bad_mailbox(Mailbox { slots: 0, ..ok }),
            Err(ExchangeError::Invalid("mailbox slots (1..=1024)"))
        );
        assert_eq!(
            bad_mailbox(Mailbox { slot_bytes: 12, ..ok }),
            Err(ExchangeError::Invalid("mailbox slot bytes (13..=4096)"))
        );
        assert_eq!(
            bad_mailbox(Mailbox { slot_bytes: 8192, ..ok }),
            Err(ExchangeError::Invalid("mailbox slot bytes (13..=4096)"))
        );
        assert_eq!(
            bad_mailbox(Mailbox { addr: u64::MAX - 100, ..ok }),
            Err(ExchangeError::Invalid("mailbox wraps the address space"))
        );
        let mut flag = accept();
        flag.mailbox = None;
        let mut b = flag.encode();
        *b.last_mut().unwrap() = 2;
        assert_eq!(Accept::decode(&b), Err(ExchangeError::Invalid("mailbox flag")));
    }

    #[test]
    fn remote_addresses_stay_inside_the_region() {
        let r = RegionKey { region: 1, addr: 0x1000, len: 4096, rkey: 1 };
        assert_eq!(r.remote_addr(0, 4096), Some(0x1000));
        assert_eq!(r.remote_addr(4000, 96), Some(0x1000 + 4000));
        assert_eq!(r.remote_addr(4000, 97), None);
        assert_eq!(r.remote_addr(u64::MAX, 2), None);
    }

    proptest! {
        /// Any bytes: an error or a message that encodes back to the same bytes; never a panic.
        #[test]
        fn arbitrary_bytes_never_panic(b in proptest::collection::vec(any::<u8>(), 0..400)) {
            if let Ok(c) = Connect::decode(&b) {
                prop_assert_eq!(c.encode(), b.clone());
            }
            if let Ok(a) = Accept::decode(&b) {
                prop_assert_eq!(a.encode(), b);
            }
        }

        /// Single-byte corruptions of a valid accept are refused or decode to a valid message.
        #[test]
        fn flipped_bytes_never_panic(i in 0usize..200, x in any::<u8>()) {
            let mut b = accept().encode();
            let i = i % b.len();
            b[i] ^= x;
            if let Ok(a) = Accept::decode(&b) {
                prop_assert_eq!(a.encode(), b);
            }
        }
    }
}
