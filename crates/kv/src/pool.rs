//! The page pool: free pages, pages in use, pages retired but not yet reclaimed, and (with
//! prefix caching) reclaimed pages that still hold a reusable prefix block.
//!
//! Every page is in exactly one state:
//! - **free**: on the free list, content meaningless;
//! - **in use**: held by `refs >= 1` requests (more than one only through a prefix-cache hit);
//! - **retired**: its last holder let go; a launch `<= after` may still read or write it;
//! - **cached**: retired and reclaimed, but it holds a full, computed block under a
//!   [`BlockKey`], so a later request with the same prefix may take it (a hit); it sits on an
//!   LRU list and is evicted (its key dropped) when a fresh page is needed and the free list is
//!   empty.
//!
//! Contract: new content only ever goes into a page through `alloc`, which hands out free pages
//! and evicts cached ones, both past their fence; `retire(pages, after)` lets go of one holder's
//! reference, and a page whose last holder let go retires after the latest launch any holder
//! referred to it in; `reclaim(min_released)` moves exactly the retired pages whose `after <=
//! min_released` to the free list (or, keyed, to the cache). So a page cannot receive new content
//! while a launch that referred to it is unreleased. A hit ([`PagePool::lookup`] then
//! [`PagePool::share`]) only adds a reader of content that is already computed and fenced. A
//! retired keyed page can be a hit too: a registered block is full and no launch writes it
//! again (later launches only write positions past `computed_len`), so the hit only adds a
//! reader next to the unreleased launch; the page leaves the retired set, keeps its
//! `last_use`, and retires again after the latest launch of any holder, old or new.
//!
//! The prefix-cache design follows vLLM's automatic prefix caching (hash-chained full blocks, an
//! LRU of unreferenced cached blocks, the tail of a sequence evicted first) and SGLang's
//! RadixAttention in spirit.

use crate::LaunchSeq;
use std::collections::{BTreeMap, HashMap};

/// The identity of a full KV block's content: a hash of every token from position 0 to the end
/// of the block (so it covers the whole prefix, not just the block). See
/// [`crate::prefix::PrefixHasher`].
pub type BlockKey = u128;

/// Page counts at one moment. `free + in_use + retired == total` always holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Pages in the pool.
    pub total: usize,
    /// Pages `alloc` can hand out now: the free list plus cached pages no request holds.
    pub free: usize,
    /// Of `free`, the pages that hold a cached prefix block (evictable).
    pub cached: usize,
    /// Pages held by live requests.
    pub in_use: usize,
    /// Pages retired after a launch that is not yet released by every consumer ("coming back").
    pub retired: usize,
}

/// Pages that went back to the free list (or the cache) in one `reclaim` call, grouped by the
/// launch they were retired after (for the lifecycle trace).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Reclaimed {
    /// `(after, pages)` pairs, in increasing `after`.
    pub groups: Vec<(LaunchSeq, Vec<u32>)>,
}

impl Reclaimed {
    /// Number of pages reclaimed.
    pub fn len(&self) -> usize {
        self.groups.iter().map(|(_, p)| p.len()).sum()
    }

    /// True when nothing was reclaimed.
    pub fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }
}

/// A pool of `total` KV pages, ids `0..total`.
#[derive(Debug)]
pub struct PagePool {
    total: usize,
    free: Vec<u32>,
    /// Retired pages keyed by the last launch that referred to them.
    retired: BTreeMap<LaunchSeq, Vec<u32>>,
    retired_count: usize,
    /// Per page: requests holding it (0 when free, retired or cached).
    refs: Vec<u32>,
    /// Per page: the latest launch any holder referred to it in since it was last handed out
    /// (0 once reclaimed: every such launch is released).
    last_use: Vec<LaunchSeq>,
    /// Per page: its key while it is registered in `index`.
    key: Vec<Option<BlockKey>>,
    /// Per page: its position in `lru` while cached (0: not cached).
    lru_tick: Vec<u64>,
    /// Registered full blocks: key to page. `index[k] == p` iff `key[p] == Some(k)`.
    index: HashMap<BlockKey, u32>,
    /// Cached pages no request holds, oldest first (evicted in this order).
    lru: BTreeMap<u64, u32>,
    tick: u64,
}

impl PagePool {
    /// Bytes of bookkeeping per page: the free-list entry, holder count, last use, prefix
    /// key and LRU tick (the index and LRU maps grow only with cached pages).
    pub const BYTES_PER_PAGE: usize = std::mem::size_of::<u32>() * 2
        + std::mem::size_of::<LaunchSeq>()
        + std::mem::size_of::<Option<BlockKey>>()
        + std::mem::size_of::<u64>();

    /// A pool whose pages `0..total` are all free.
    pub fn new(total: usize) -> Self {
        // Pop from the end, so hand out low ids first (easier to read in traces).
        let free = (0..total as u32).rev().collect();
        Self {
            total,
            free,
            retired: BTreeMap::new(),
            retired_count: 0,
            refs: vec![0; total],
            last_use: vec![0; total],
            key: vec![None; total],
            lru_tick: vec![0; total],
            index: HashMap::new(),
            lru: BTreeMap::new(),
            tick: 0,
        }
    }

    /// Current counts.
    pub fn stats(&self) -> PoolStats {
        let free = self.num_free();
        PoolStats {
            total: self.total,
            free,
            cached: self.lru.len(),
            in_use: self.total - free - self.retired_count,
            retired: self.retired_count,
        }
    }

    /// Pages `alloc` can hand out now (free list plus evictable cached pages).
    pub fn num_free(&self) -> usize {
        self.free.len() + self.lru.len()
    }

    /// Pages retired but not yet reclaimed.
    pub fn num_retired(&self) -> usize {
        self.retired_count
    }

    /// Full blocks registered in the prefix cache (held, retired or cached).
    pub fn num_registered(&self) -> usize {
        self.index.len()
    }

    /// Takes `n` pages for new content, each with one holder: from the free list first, then by
    /// evicting the least recently used cached pages (their keys are dropped). Returns `false`
    /// and takes nothing if fewer than `n` can be had.
    pub fn alloc(&mut self, n: usize, out: &mut Vec<u32>) -> bool {
        if self.num_free() < n {
            return false;
        }
        let from_free = n.min(self.free.len());
        let at = self.free.len() - from_free;
        let start = out.len();
        out.extend(self.free.drain(at..).rev());
        for _ in from_free..n {
            let (_, p) = self.lru.pop_first().expect("counted above");
            self.lru_tick[p as usize] = 0;
            if let Some(k) = self.key[p as usize].take() {
                self.index.remove(&k);
            }
            out.push(p);
        }
        for &p in &out[start..] {
            debug_assert_eq!(self.refs[p as usize], 0);
            self.refs[p as usize] = 1;
        }
        true
    }

    /// Lets go of one holder's reference to each of `pages`, which that holder's launches up to
    /// and including `after` may still touch (`after == 0`: it never launched with them). A page
    /// whose last holder lets go retires after the latest launch any holder referred to it in;
    /// if no launch ever did, it is free (or cached) at once.
    pub fn retire(&mut self, pages: &[u32], after: LaunchSeq) {
        for &p in pages {
            let i = p as usize;
            debug_assert!(self.refs[i] > 0, "page {p} retired with no holder");
            self.refs[i] = self.refs[i].saturating_sub(1);
            self.last_use[i] = self.last_use[i].max(after);
            if self.refs[i] > 0 {
                continue;
            }
            let at = self.last_use[i];
            if at == 0 {
                self.put_back(p);
            } else {
                self.retired.entry(at).or_default().push(p);
                self.retired_count += 1;
            }
        }
    }

    /// A reclaimed (or never-launched) page goes to the cache if it is keyed, else to the free
    /// list.
    fn put_back(&mut self, p: u32) {
        self.last_use[p as usize] = 0;
        if self.key[p as usize].is_some() {
            self.tick += 1;
            self.lru_tick[p as usize] = self.tick;
            self.lru.insert(self.tick, p);
        } else {
            self.free.push(p);
        }
    }

    /// Moves every retired page whose last launch is `<= min_released` back to the free list
    /// (or the cache, when it holds a registered block).
    pub fn reclaim(&mut self, min_released: LaunchSeq) -> Reclaimed {
        let mut out = Reclaimed::default();
        while let Some(entry) = self.retired.first_entry() {
            if !crate::fence::passed(*entry.key(), min_released) {
                break;
            }
            let (after, pages) = entry.remove_entry();
            self.retired_count -= pages.len();
            for &p in &pages {
                self.put_back(p);
            }
            out.groups.push((after, pages));
        }
        out
    }

    /// Reclaims everything retired, without a fence. Only for when no consumer can touch any page
    /// any more (the last worker died, taking its device memory with it).
    pub fn reclaim_all(&mut self) -> Reclaimed {
        self.reclaim(LaunchSeq::MAX)
    }

    /// Pages retired after launches `<= upto`: what a fence at `upto` would bring back.
    pub fn retired_upto(&self, upto: LaunchSeq) -> usize {
        self.retired.range(..=upto).map(|(_, p)| p.len()).sum()
    }

    /// Registers held page `p` as holding the full, computed block `key`. The caller promises
    /// the block's KV is written and fenced and will not change while the page is keyed (a full
    /// block is never written again). Returns `false` (and registers nothing) if another page
    /// already holds `key`, or `p` is already registered.
    pub fn register(&mut self, p: u32, key: BlockKey) -> bool {
        let i = p as usize;
        debug_assert!(self.refs[i] > 0, "page {p} registered while not held");
        if self.key[i].is_some() || self.index.contains_key(&key) {
            return false;
        }
        self.key[i] = Some(key);
        self.index.insert(key, p);
        true
    }

    /// The page holding block `key`, if any: held by a request, retired (its content is final,
    /// see the module docs) or cached. A free page is never keyed.
    pub fn lookup(&self, key: BlockKey) -> Option<u32> {
        self.index.get(&key).copied()
    }

    /// Adds a holder to page `p`, which [`PagePool::lookup`] returned (a prefix-cache hit): a
    /// cached page leaves the LRU list; a retired page leaves the retired set (its `last_use`
    /// stays, so it retires again no earlier than the launch it was waiting for).
    pub fn share(&mut self, p: u32) {
        let i = p as usize;
        let t = std::mem::take(&mut self.lru_tick[i]);
        if t != 0 {
            self.lru.remove(&t);
        } else if self.refs[i] == 0 {
            let at = self.last_use[i];
            let revived = self.retired.get_mut(&at).and_then(|v| {
                let k = v.iter().position(|&q| q == p)?;
                v.swap_remove(k);
                Some(v.is_empty())
            });
            match revived {
                Some(emptied) => {
                    if emptied {
                        self.retired.remove(&at);
                    }
                    self.retired_count -= 1;
                }
                None => debug_assert!(false, "page {p} shared while free"),
            }
        }
        self.refs[i] += 1;
    }

    /// Forgets every registered block (the device memory holding them is gone, or caching was
    /// turned off): cached pages go to the free list, held and retired pages lose their keys.
    pub fn clear_cache(&mut self) {
        for (_, p) in std::mem::take(&mut self.lru) {
            self.lru_tick[p as usize] = 0;
            self.free.push(p);
        }
        for (_, p) in self.index.drain() {
            self.key[p as usize] = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retired_pages_come_back_only_when_min_released_reaches_their_launch() {
        let mut pool = PagePool::new(4);
        let mut a = Vec::new();
        assert!(pool.alloc(3, &mut a));
        pool.retire(&a[..2], 5);
        pool.retire(&a[2..], 7);
        assert_eq!(pool.stats().retired, 3);
        assert!(pool.reclaim(4).is_empty());
        assert_eq!(pool.reclaim(6).len(), 2);
        assert_eq!(pool.num_free(), 3);
        assert_eq!(pool.reclaim(7).len(), 1);
        assert_eq!(
            pool.stats(),
            PoolStats {
                total: 4,
                free: 4,
                cached: 0,
                in_use: 0,
                retired: 0
            }
        );
    }

    #[test]
    fn alloc_takes_nothing_when_not_enough_pages_are_free() {
        let mut pool = PagePool::new(2);
        let mut out = Vec::new();
        assert!(!pool.alloc(3, &mut out));
        assert!(out.is_empty());
        assert_eq!(pool.num_free(), 2);
    }

    #[test]
    fn pages_never_referred_to_by_a_launch_are_free_at_once() {
        let mut pool = PagePool::new(2);
        let mut out = Vec::new();
        assert!(pool.alloc(2, &mut out));
        pool.retire(&out, 0);
        assert_eq!(pool.num_free(), 2);
    }

    #[test]
    fn a_shared_page_retires_after_the_latest_launch_of_any_holder() {
        let mut pool = PagePool::new(2);
        let mut a = Vec::new();
        assert!(pool.alloc(1, &mut a));
        let p = a[0];
        assert!(pool.register(p, 42));
        assert_eq!(pool.lookup(42), Some(p));
        pool.share(p);
        // The second holder referred to it in launch 9, then the first lets go after 5.
        pool.retire(&[p], 9);
        assert_eq!(pool.stats().in_use, 1, "still held by the first");
        pool.retire(&[p], 5);
        assert_eq!(pool.num_retired(), 1);
        assert!(pool.reclaim(8).is_empty(), "launch 9 still refers to it");
        assert_eq!(pool.reclaim(9).len(), 1);
        assert_eq!(pool.lookup(42), Some(p), "reclaimed with its key: cached");
        assert_eq!(pool.stats().cached, 1);
        assert_eq!(pool.stats().free, 2);
    }

    #[test]
    fn cached_pages_are_evicted_oldest_first_and_lose_their_keys() {
        let mut pool = PagePool::new(3);
        let mut a = Vec::new();
        assert!(pool.alloc(3, &mut a));
        for (i, &p) in a.iter().enumerate() {
            assert!(pool.register(p, i as BlockKey + 1));
        }
        // Retire in the order 2, 0, 1: the LRU order.
        pool.retire(&[a[2], a[0], a[1]], 1);
        pool.reclaim(1);
        assert_eq!(pool.stats().cached, 3);
        let mut b = Vec::new();
        assert!(pool.alloc(2, &mut b));
        assert_eq!(b, vec![a[2], a[0]]);
        assert_eq!(pool.lookup(3), None);
        assert_eq!(pool.lookup(1), None);
        assert_eq!(pool.lookup(2), Some(a[1]));
        assert!(
            !pool.register(b[0], 2),
            "key 2 is already held by another page"
        );
        assert!(pool.register(b[0], 7));
    }

    #[test]
    fn a_hit_on_a_cached_page_takes_it_off_the_lru_list() {
        let mut pool = PagePool::new(2);
        let mut a = Vec::new();
        assert!(pool.alloc(1, &mut a));
        assert!(pool.register(a[0], 5));
        pool.retire(&a, 3);
        pool.reclaim(3);
        let p = pool.lookup(5).unwrap();
        pool.share(p);
        assert_eq!(pool.stats().in_use, 1);
        assert_eq!(pool.stats().cached, 0);
        let mut b = Vec::new();
        assert!(!pool.alloc(2, &mut b), "the held page cannot be evicted");
        assert!(pool.alloc(1, &mut b));
        assert_ne!(b[0], p);
        // Given back without a launch: cached again at once.
        pool.retire(&[p], 0);
        assert_eq!(pool.stats().cached, 1);
    }

    #[test]
    fn a_hit_on_a_retired_page_revives_it_until_every_launch_of_every_holder_is_released() {
        let mut pool = PagePool::new(3);
        let mut a = Vec::new();
        assert!(pool.alloc(2, &mut a));
        assert!(pool.register(a[0], 7));
        // Launch 4 (unreleased) still refers to both; the holder lets go.
        pool.retire(&a, 4);
        assert_eq!(pool.num_retired(), 2);
        let p = pool.lookup(7).expect("a retired keyed page is a hit");
        assert_eq!(p, a[0]);
        pool.share(p);
        assert_eq!(pool.num_retired(), 1);
        assert_eq!(pool.stats().in_use, 1);
        // Launch 4's release brings back only the unkeyed page; the revived one is held.
        assert_eq!(pool.reclaim(4).groups, vec![(4, vec![a[1]])]);
        assert_eq!(pool.stats().in_use, 1);
        // The new holder gives it back without launching: it still waits for nothing newer
        // than 4, which is released, so it is retired after 4 and reclaimed at once.
        pool.retire(&[p], 0);
        assert_eq!(pool.num_retired(), 1);
        assert_eq!(pool.reclaim(4).len(), 1);
        assert_eq!(pool.stats().cached, 1);
        // Revived again from retirement after 6; the new holder launches with it in 9.
        pool.share(p);
        pool.retire(&[p], 6);
        pool.share(pool.lookup(7).unwrap());
        pool.retire(&[p], 9);
        assert!(pool.reclaim(8).is_empty(), "launch 9 refers to it");
        assert_eq!(pool.reclaim(9).len(), 1);
        assert_eq!(pool.stats().free, 3);
    }

    #[test]
    fn clearing_the_cache_frees_cached_pages_and_unkeys_the_rest() {
        let mut pool = PagePool::new(2);
        let mut a = Vec::new();
        assert!(pool.alloc(2, &mut a));
        assert!(pool.register(a[0], 1));
        assert!(pool.register(a[1], 2));
        pool.retire(&a[..1], 4);
        pool.reclaim(4);
        pool.clear_cache();
        assert_eq!(pool.lookup(1), None);
        assert_eq!(pool.lookup(2), None);
        assert_eq!(pool.stats().cached, 0);
        pool.retire(&a[1..], 5);
        pool.reclaim(5);
        assert_eq!(pool.stats().cached, 0, "unkeyed: back to the free list");
        assert_eq!(pool.stats().free, 2);
    }
}
