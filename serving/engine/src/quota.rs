//! Tenants' quotas of a worker's store: the blocks each tenant's requests used, least
//! recently used first, and where its quota lets them live ([`TenantHint`]): its most
//! recently used `host_blocks` in host memory, the next `disk_blocks` on disk only, and
//! `store_blocks` in all. Past its host quota a tenant's least recently used host blocks move
//! to disk (dropped where the store has no disk); past its disk or store quota they are
//! removed from the store. Never another tenant's.
//!
//! A block counts for a tenant once a request of it retires having used it (computed or
//! read); blocks that the store evicted meanwhile still count until they leave the ledger, so
//! a tenant holds at most its quota and sometimes less. A block that a running request
//! still holds is not moved or removed (it stays until the store evicts it).

use std::collections::{BTreeMap, HashMap};

use kvfabric::contract::generate::TenantHint;
use kvfabric::hash::SequenceHash;

/// Tenants with a ledger at most: a worker serves a configured set of tenants, so more are
/// not expected; past it, a new tenant's blocks are not counted (logged once).
pub const TENANTS_MAX: usize = 4096;

/// Every tenant's ledger.
#[derive(Debug, Default)]
pub struct Ledgers {
    by_tenant: HashMap<String, Ledger>,
    warned: bool,
}

/// What a charge asks of the store.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Charged {
    /// Blocks past the tenant's host quota: out of host memory, onto disk.
    pub demote: Vec<SequenceHash>,
    /// Blocks past its disk or store quota: out of the store.
    pub remove: Vec<SequenceHash>,
}

/// Blocks least recently used first.
#[derive(Debug, Default)]
struct Lru {
    order: BTreeMap<u64, SequenceHash>,
    at: HashMap<SequenceHash, u64>,
}

impl Lru {
    fn len(&self) -> u64 {
        self.order.len() as u64
    }

    fn take(&mut self, h: SequenceHash) -> bool {
        match self.at.remove(&h) {
            Some(k) => {
                self.order.remove(&k);
                true
            }
            None => false,
        }
    }

    fn push(&mut self, h: SequenceHash, k: u64) {
        self.take(h);
        self.order.insert(k, h);
        self.at.insert(h, k);
    }

    fn pop_oldest(&mut self) -> Option<(u64, SequenceHash)> {
        let (k, h) = self.order.pop_first()?;
        self.at.remove(&h);
        Some((k, h))
    }
}

/// One tenant's blocks: those its host quota lets stay in host memory (the most recently
/// used), and the older ones, on disk.
#[derive(Debug, Default)]
struct Ledger {
    hot: Lru,
    cold: Lru,
    next: u64,
}

impl Ledgers {
    /// `tenant`'s request used `hashes` (a sequence's blocks, parents first): they count for
    /// it, most recently used. Returns the blocks now past its quotas (least recently used
    /// first, a sequence's from its end) and what to do with them.
    pub fn charge(&mut self, tenant: &TenantHint, hashes: &[SequenceHash]) -> Charged {
        let (host, disk, store) = (tenant.host_blocks, tenant.disk_blocks, tenant.store_blocks);
        if host.is_none() && disk.is_none() && store.is_none() {
            return Charged::default();
        }
        if !self.by_tenant.contains_key(&tenant.name) && self.by_tenant.len() >= TENANTS_MAX {
            if !std::mem::replace(&mut self.warned, true) {
                tracing::warn!(
                    tenant = %tenant.name,
                    max = TENANTS_MAX,
                    "too many tenants with a store quota: the blocks of further tenants are not counted"
                );
            }
            return Charged::default();
        }
        let l = self.by_tenant.entry(tenant.name.clone()).or_default();
        // A sequence's blocks from its end: a parent counts as used after its children, so
        // the children leave first and what stays is a prefix that a lookup can use (a
        // child without its parent is never found).
        for &h in hashes.iter().rev() {
            l.cold.take(h);
            l.hot.push(h, l.next);
            l.next += 1;
        }
        let mut out = Charged::default();
        while l.hot.len() > host.unwrap_or(u64::MAX) {
            let Some((k, h)) = l.hot.pop_oldest() else { break };
            l.cold.push(h, k);
            out.demote.push(h);
        }
        let total = |l: &Ledger| l.hot.len() + l.cold.len();
        while l.cold.len() > disk.unwrap_or(u64::MAX) || total(l) > store.unwrap_or(u64::MAX) {
            let Some((_, h)) = l.cold.pop_oldest().or_else(|| l.hot.pop_oldest()) else { break };
            // Demoted in this charge and removed at once: only removed.
            out.demote.retain(|&d| d != h);
            out.remove.push(h);
        }
        out
    }

    /// Blocks counted for `tenant`: in host memory, and past its host quota.
    pub fn held(&self, tenant: &str) -> (usize, usize) {
        self.by_tenant.get(tenant).map_or((0, 0), |l| (l.hot.order.len(), l.cold.order.len()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(name: &str, host: Option<u64>, disk: Option<u64>, store: Option<u64>) -> TenantHint {
        TenantHint { name: name.into(), store_blocks: store, host_blocks: host, disk_blocks: disk }
    }

    fn h(i: u64) -> SequenceHash {
        SequenceHash(i)
    }

    #[test]
    fn a_tenant_past_its_store_quota_gives_up_its_own_least_recently_used_blocks() {
        let mut l = Ledgers::default();
        let removed = |c: Charged| {
            assert!(c.demote.is_empty());
            c.remove
        };
        assert!(removed(l.charge(&t("a", None, None, Some(3)), &[h(1), h(2)])).is_empty());
        assert!(removed(l.charge(&t("b", None, None, Some(2)), &[h(10), h(11)])).is_empty());
        // Used again: 1 becomes the most recent, so 2 goes first; of the sequence 1, 3, 4
        // its end (4) is the least recently used.
        let a = t("a", None, None, Some(3));
        assert_eq!(removed(l.charge(&a, &[h(1), h(3), h(4)])), vec![h(2)]);
        assert_eq!(removed(l.charge(&a, &[h(5)])), vec![h(4)]);
        assert_eq!((l.held("a"), l.held("b")), ((3, 0), (2, 0)), "b keeps its blocks");
        let c = l.charge(&t("c", None, None, None), &[h(20); 10]);
        assert_eq!(c, Charged::default(), "no quota, no ledger");
        assert_eq!(l.held("c"), (0, 0));
    }

    /// A sequence's blocks leave from its end: what stays of it is a prefix.
    #[test]
    fn a_sequence_leaves_from_its_end() {
        let mut l = Ledgers::default();
        let a = t("a", Some(2), None, Some(3));
        let c = l.charge(&a, &[h(1), h(2), h(3), h(4)]);
        assert_eq!(c, Charged { demote: vec![h(3)], remove: vec![h(4)] });
        // Another sequence: the first one's end goes before its start, which stays.
        let c = l.charge(&a, &[h(10), h(11)]);
        assert_eq!(c, Charged { demote: vec![h(1)], remove: vec![h(3), h(2)] });
        assert_eq!(l.held("a"), (2, 1));
    }

    /// Host 2, disk 2: the two most recent blocks in host memory, the two before them moved
    /// to disk, older ones removed (a sequence's from its end); a block used again comes back
    /// to the host side (the store reads it into host memory on a hit), the oldest host
    /// block moving down for it.
    #[test]
    fn host_and_disk_quotas_move_blocks_down_then_out() {
        let mut l = Ledgers::default();
        let a = t("a", Some(2), Some(2), None);
        assert_eq!(l.charge(&a, &[h(1), h(2)]), Charged::default());
        assert_eq!(
            l.charge(&a, &[h(3), h(4)]),
            Charged { demote: vec![h(2), h(1)], remove: vec![] }
        );
        assert_eq!(
            l.charge(&a, &[h(5)]),
            Charged { demote: vec![h(4)], remove: vec![h(2)] },
            "past the disk quota the oldest goes"
        );
        assert_eq!(l.held("a"), (2, 2));
        // 1 is used again: back in host memory; 3 moves down; nothing more leaves.
        assert_eq!(l.charge(&a, &[h(1)]), Charged { demote: vec![h(3)], remove: vec![] });
        assert_eq!(l.held("a"), (2, 2));
        // A store quota below host + disk: the disk side shrinks first.
        let tight = t("a", Some(2), Some(2), Some(3));
        assert_eq!(l.charge(&tight, &[]), Charged { demote: vec![], remove: vec![h(4)] });
        // Many at once: demoted and removed in the same charge counts as removed only.
        let c = l.charge(&t("z", Some(1), Some(1), None), &[h(7), h(8), h(9), h(10)]);
        assert_eq!(c, Charged { demote: vec![h(8)], remove: vec![h(10), h(9)] });
    }
}
