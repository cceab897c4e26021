//! Tenants' quotas of a worker's store: the blocks each tenant's requests used, least
//! recently used first; past a tenant's quota ([`TenantHint::store_blocks`]) its own least
//! recently used blocks are removed from the store (every tier), never another tenant's.
//!
//! A block counts for a tenant once a request of it retires having used it (computed or
//! read); blocks that the store evicted meanwhile still count until they leave the ledger, so
//! a tenant holds at most its quota and sometimes less. A block that a running request
//! still holds is not removed (it stays until the store evicts it).

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

/// One tenant's blocks, least recently used first.
#[derive(Debug, Default)]
struct Ledger {
    order: BTreeMap<u64, SequenceHash>,
    at: HashMap<SequenceHash, u64>,
    next: u64,
}

impl Ledgers {
    /// `tenant`'s request used `hashes`: they count for it, most recently used. Returns the
    /// blocks past its quota (least recently used first), now out of its ledger, to remove.
    pub fn charge(&mut self, tenant: &TenantHint, hashes: &[SequenceHash]) -> Vec<SequenceHash> {
        let Some(quota) = tenant.store_blocks else { return Vec::new() };
        if !self.by_tenant.contains_key(&tenant.name) && self.by_tenant.len() >= TENANTS_MAX {
            if !std::mem::replace(&mut self.warned, true) {
                tracing::warn!(
                    tenant = %tenant.name,
                    max = TENANTS_MAX,
                    "too many tenants with a store quota: the blocks of further tenants are not counted"
                );
            }
            return Vec::new();
        }
        let l = self.by_tenant.entry(tenant.name.clone()).or_default();
        for &h in hashes {
            if let Some(old) = l.at.insert(h, l.next) {
                l.order.remove(&old);
            }
            l.order.insert(l.next, h);
            l.next += 1;
        }
        let mut over = Vec::new();
        while l.order.len() as u64 > quota {
            let Some((_, h)) = l.order.pop_first() else { break };
            l.at.remove(&h);
            over.push(h);
        }
        over
    }

    /// Blocks counted for `tenant`.
    pub fn held(&self, tenant: &str) -> usize {
        self.by_tenant.get(tenant).map_or(0, |l| l.order.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(name: &str, quota: Option<u64>) -> TenantHint {
        TenantHint { name: name.into(), store_blocks: quota }
    }

    #[test]
    fn a_tenant_past_its_quota_gives_up_its_own_least_recently_used_blocks() {
        let mut l = Ledgers::default();
        let h = |i: u64| SequenceHash(i);
        assert!(l.charge(&t("a", Some(3)), &[h(1), h(2)]).is_empty());
        assert!(l.charge(&t("b", Some(2)), &[h(10), h(11)]).is_empty());
        // Used again: 1 becomes the most recent, so 2 goes first.
        assert_eq!(l.charge(&t("a", Some(3)), &[h(1), h(3), h(4)]), vec![h(2)]);
        assert_eq!(l.charge(&t("a", Some(3)), &[h(5)]), vec![h(1)]);
        assert_eq!((l.held("a"), l.held("b")), (3, 2), "b keeps its blocks");
        assert!(l.charge(&t("c", None), &[h(20); 10]).is_empty(), "no quota, no ledger");
        assert_eq!(l.held("c"), 0);
    }
}
