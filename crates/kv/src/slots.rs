//! Request slots: the rows of the token and block tables, reused under the same fenced rule as
//! pages.
//!
//! Contract: a slot whose last launch is `s_last` is reused only once every consumer released
//! `s_last`, and each reuse bumps the slot's generation, so a reference `(slot, generation)`
//! held across a reuse is recognised as stale.

use crate::LaunchSeq;
use baton_proto::SlotRef;
use std::collections::BTreeMap;

/// Allocator of request slots `0..capacity` with generations.
#[derive(Debug)]
pub struct SlotAllocator {
    generation: Vec<u32>,
    free: Vec<u32>,
    retired: BTreeMap<LaunchSeq, Vec<u32>>,
    retired_count: usize,
}

impl SlotAllocator {
    /// `capacity` free slots, all at generation 0.
    pub fn new(capacity: usize) -> Self {
        Self {
            generation: vec![0; capacity],
            free: (0..capacity as u32).rev().collect(),
            retired: BTreeMap::new(),
            retired_count: 0,
        }
    }

    /// Number of slots.
    pub fn capacity(&self) -> usize {
        self.generation.len()
    }

    /// Free slots now.
    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Slots retired but not yet reclaimed.
    pub fn num_retired(&self) -> usize {
        self.retired_count
    }

    /// Takes a free slot and bumps its generation.
    pub fn alloc(&mut self) -> Option<SlotRef> {
        let slot = self.free.pop()?;
        let g = &mut self.generation[slot as usize];
        *g = g.wrapping_add(1);
        Some(SlotRef {
            slot,
            generation: *g,
        })
    }

    /// True when `r` names the slot's current generation.
    pub fn is_current(&self, r: SlotRef) -> bool {
        self.generation.get(r.slot as usize) == Some(&r.generation)
    }

    /// Retires `r` after launch `after` (0: never launched, free at once). A stale `r` is ignored
    /// and reported as `false`.
    pub fn retire(&mut self, r: SlotRef, after: LaunchSeq) -> bool {
        if !self.is_current(r) {
            return false;
        }
        if after == 0 {
            self.free.push(r.slot);
        } else {
            self.retired.entry(after).or_default().push(r.slot);
            self.retired_count += 1;
        }
        true
    }

    /// Frees every retired slot whose last launch is `<= min_released`; returns how many.
    pub fn reclaim(&mut self, min_released: LaunchSeq) -> usize {
        let mut n = 0;
        while let Some(entry) = self.retired.first_entry() {
            if !crate::fence::passed(*entry.key(), min_released) {
                break;
            }
            let slots = entry.remove();
            n += slots.len();
            self.retired_count -= slots.len();
            self.free.extend(slots);
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reused_slot_gets_a_new_generation_and_old_refs_are_stale() {
        let mut s = SlotAllocator::new(1);
        let a = s.alloc().unwrap();
        assert!(s.alloc().is_none());
        assert!(s.retire(a, 3));
        assert_eq!(s.reclaim(2), 0);
        assert!(
            s.alloc().is_none(),
            "slot reused before its launch was released"
        );
        assert_eq!(s.reclaim(3), 1);
        let b = s.alloc().unwrap();
        assert_eq!(a.slot, b.slot);
        assert_ne!(a.generation, b.generation);
        assert!(!s.is_current(a));
        assert!(
            !s.retire(a, 9),
            "a stale reference must not retire the new owner's slot"
        );
    }
}
