//! The page pool: free pages, pages in use, and pages retired but not yet reclaimed.
//!
//! Contract: `alloc` only hands out pages from the free list; `retire(pages, after)` moves pages
//! that some launch `<= after` referred to into the retired set; `reclaim(min_released)` returns
//! to the free list exactly the retired pages whose `after <= min_released`. Nothing else moves a
//! page back, so a page cannot be reused while a launch that referred to it is unreleased.

use crate::LaunchSeq;
use std::collections::BTreeMap;

/// Page counts at one moment. `free + in_use + retired == total` always holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Pages in the pool.
    pub total: usize,
    /// Pages on the free list.
    pub free: usize,
    /// Pages held by live requests.
    pub in_use: usize,
    /// Pages retired after a launch that is not yet released by every consumer ("coming back").
    pub retired: usize,
}

/// Pages that went back to the free list in one `reclaim` call, grouped by the launch they were
/// retired after (for the lifecycle trace).
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
}

impl PagePool {
    /// A pool whose pages `0..total` are all free.
    pub fn new(total: usize) -> Self {
        // Pop from the end, so hand out low ids first (easier to read in traces).
        let free = (0..total as u32).rev().collect();
        Self {
            total,
            free,
            retired: BTreeMap::new(),
            retired_count: 0,
        }
    }

    /// Current counts.
    pub fn stats(&self) -> PoolStats {
        PoolStats {
            total: self.total,
            free: self.free.len(),
            in_use: self.total - self.free.len() - self.retired_count,
            retired: self.retired_count,
        }
    }

    /// Free pages now.
    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Pages retired but not yet reclaimed.
    pub fn num_retired(&self) -> usize {
        self.retired_count
    }

    /// Takes `n` pages from the free list, or `None` (taking nothing) if fewer are free.
    pub fn alloc(&mut self, n: usize, out: &mut Vec<u32>) -> bool {
        if self.free.len() < n {
            return false;
        }
        let at = self.free.len() - n;
        out.extend(self.free.drain(at..).rev());
        true
    }

    /// Retires `pages`, which launches up to and including `after` may still touch.
    /// `after == 0` means no launch ever referred to them: they are free at once.
    pub fn retire(&mut self, pages: &[u32], after: LaunchSeq) {
        if pages.is_empty() {
            return;
        }
        if after == 0 {
            self.free.extend_from_slice(pages);
            return;
        }
        self.retired
            .entry(after)
            .or_default()
            .extend_from_slice(pages);
        self.retired_count += pages.len();
    }

    /// Moves every retired page whose last launch is `<= min_released` back to the free list.
    pub fn reclaim(&mut self, min_released: LaunchSeq) -> Reclaimed {
        let mut out = Reclaimed::default();
        while let Some(entry) = self.retired.first_entry() {
            if !crate::fence::passed(*entry.key(), min_released) {
                break;
            }
            let (after, pages) = entry.remove_entry();
            self.retired_count -= pages.len();
            self.free.extend_from_slice(&pages);
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
}
