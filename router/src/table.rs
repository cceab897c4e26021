//! A flat hash table keyed by sequence hashes, for the prefix index.
//!
//! Open addressing with linear probing over two parallel arrays: the keys (eight to a cache
//! line, so a probe sequence mostly stays in one line) and the values at the same positions.
//! Deletion shifts the following entries back, so there are no tombstones and lookups stay
//! short however many blocks come and go. The slot of a key is known before the lookup, so a
//! query can prefetch the slots of the blocks it will look up next ([`Table::prefetch`]):
//! a prefix match's lookups are independent, and their cache misses overlap instead of
//! adding up.
//!
//! Keys are mixed with a per-table random seed (a keyed SplitMix64 finalizer), so a worker
//! that chooses its block hashes cannot aim them all at one probe sequence.

/// The mixed hash of a key: uniform, keyed.
#[inline]
pub(crate) fn mix(key: u64, seed: u64) -> u64 {
    let mut z = key ^ seed;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A random seed for a table.
pub(crate) fn random_seed() -> u64 {
    use std::hash::BuildHasher;
    std::collections::hash_map::RandomState::new().hash_one(0x6b76_u64)
}

/// Hints the CPU to bring the cache line holding `p` in (no effect where there is no
/// prefetch instruction). Never dereferences `p`.
#[inline(always)]
fn prefetch<T>(p: &T) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        // SAFETY: a prefetch is a hint and never faults; `p` is a valid reference anyway.
        unsafe { _mm_prefetch::<_MM_HINT_T0>((p as *const T).cast::<i8>()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// A vector of `n` default values whose large middle is backed by transparent huge pages
/// where the kernel allows them: a big index touches a random slot per lookup, and with 4 KiB
/// pages each of those is also a TLB miss and a page walk (itself a cache miss or two).
fn huge_vec<T: Default>(n: usize) -> Vec<T> {
    let mut v: Vec<T> = Vec::with_capacity(n);
    advise_huge_pages(v.as_ptr().cast(), n * std::mem::size_of::<T>());
    v.resize_with(n, T::default);
    v
}

/// Advises the kernel to back the 2 MiB-aligned part of `p..p+len` (not yet touched) with
/// huge pages; a hint, ignored where unsupported or below 4 MiB.
fn advise_huge_pages(p: *const u8, len: usize) {
    const HUGE: usize = 2 << 20;
    if len < 2 * HUGE {
        return;
    }
    let start = (p as usize).next_multiple_of(HUGE);
    let end = (p as usize + len) / HUGE * HUGE;
    #[cfg(target_os = "linux")]
    if end > start {
        // SAFETY: advice on whole pages inside our own live allocation; MADV_HUGEPAGE changes
        // no contents and cannot fail in a way that affects memory safety.
        unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
    }
}

/// Key 0 marks an empty slot; a real key 0 is kept aside in `zero`.
#[derive(Debug)]
pub(crate) struct Table<V> {
    seed: u64,
    keys: Vec<u64>,
    vals: Vec<V>,
    zero: Option<V>,
    len: usize,
}

const MIN_CAPACITY: usize = 16;

impl<V: Default> Table<V> {
    /// An empty table whose keys are mixed with `seed`.
    pub(crate) fn with_seed(seed: u64) -> Self {
        Table { seed, keys: Vec::new(), vals: Vec::new(), zero: None, len: 0 }
    }

    /// Entries.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    fn mask(&self) -> usize {
        self.keys.len().wrapping_sub(1)
    }

    fn home(&self, key: u64) -> usize {
        mix(key, self.seed) as usize & self.mask()
    }

    /// The slot holding `key`, if any (key ≠ 0).
    fn find(&self, key: u64) -> Option<usize> {
        if self.keys.is_empty() {
            return None;
        }
        let mask = self.mask();
        let mut i = self.home(key);
        loop {
            match self.keys[i] {
                0 => return None,
                k if k == key => return Some(i),
                _ => i = (i + 1) & mask,
            }
        }
    }

    /// Brings the lines a lookup of `key` will read into the cache.
    #[inline]
    pub(crate) fn prefetch(&self, key: u64) {
        if self.keys.is_empty() {
            return;
        }
        let i = self.home(key);
        prefetch(&self.keys[i]);
        prefetch(&self.vals[i]);
    }

    /// The value of `key`.
    #[inline]
    pub(crate) fn get(&self, key: u64) -> Option<&V> {
        if key == 0 {
            return self.zero.as_ref();
        }
        self.find(key).map(|i| &self.vals[i])
    }

    /// The value of `key`, mutable.
    pub(crate) fn get_mut(&mut self, key: u64) -> Option<&mut V> {
        if key == 0 {
            return self.zero.as_mut();
        }
        self.find(key).map(|i| &mut self.vals[i])
    }

    /// The value of `key`, inserted as `V::default()` if absent.
    pub(crate) fn entry(&mut self, key: u64) -> &mut V {
        if key == 0 {
            if self.zero.is_none() {
                self.len += 1;
            }
            return self.zero.get_or_insert_with(V::default);
        }
        // Grow at 70% load: probe sequences stay a few slots long.
        if (self.len + 1) * 10 > self.keys.len() * 7 {
            self.grow();
        }
        let mask = self.mask();
        let mut i = self.home(key);
        loop {
            match self.keys[i] {
                0 => {
                    self.keys[i] = key;
                    self.len += 1;
                    return &mut self.vals[i];
                }
                k if k == key => return &mut self.vals[i],
                _ => i = (i + 1) & mask,
            }
        }
    }

    fn grow(&mut self) {
        let capacity = (self.keys.len() * 2).max(MIN_CAPACITY);
        let keys = std::mem::replace(&mut self.keys, huge_vec(capacity));
        let vals = std::mem::replace(&mut self.vals, huge_vec(capacity));
        let mask = self.mask();
        for (k, v) in keys.into_iter().zip(vals) {
            if k != 0 {
                let mut i = self.home(k);
                while self.keys[i] != 0 {
                    i = (i + 1) & mask;
                }
                self.keys[i] = k;
                self.vals[i] = v;
            }
        }
    }

    /// Removes `key`, returning its value.
    pub(crate) fn remove(&mut self, key: u64) -> Option<V> {
        if key == 0 {
            let v = self.zero.take();
            self.len -= usize::from(v.is_some());
            return v;
        }
        let mut hole = self.find(key)?;
        let v = std::mem::take(&mut self.vals[hole]);
        self.keys[hole] = 0;
        self.len -= 1;
        // Backward shift: move each following entry of the run into the hole unless its home
        // lies cyclically in (hole, j], where it must stay to remain reachable.
        let mask = self.mask();
        let mut j = hole;
        loop {
            j = (j + 1) & mask;
            let k = self.keys[j];
            if k == 0 {
                break;
            }
            let home = self.home(k);
            let stays = if hole <= j { hole < home && home <= j } else { hole < home || home <= j };
            if !stays {
                self.keys[hole] = k;
                self.keys[j] = 0;
                self.vals.swap(hole, j);
                hole = j;
            }
        }
        if self.len == 0 {
            // Give the memory back when a shard empties (workers left or cleared).
            self.keys = Vec::new();
            self.vals = Vec::new();
        }
        Some(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    proptest! {
        /// The table behaves as a map under random inserts and removals, with keys from a
        /// small range (long probe runs, wrap-around, key 0) and a fixed seed so that
        /// collisions repeat.
        #[test]
        fn behaves_as_a_map(ops in proptest::collection::vec((any::<bool>(), 0u64..64), 1..400),
                            seed in any::<u64>()) {
            let mut t: Table<u64> = Table::with_seed(seed);
            let mut m: HashMap<u64, u64> = HashMap::new();
            for (n, (insert, k)) in ops.into_iter().enumerate() {
                if insert {
                    *t.entry(k) = n as u64;
                    m.insert(k, n as u64);
                } else {
                    prop_assert_eq!(t.remove(k), m.remove(&k));
                }
                prop_assert_eq!(t.len(), m.len());
                for k in 0..64 {
                    prop_assert_eq!(t.get(k), m.get(&k));
                }
            }
        }
    }
}
