//! The completion fence as the reclaim path sees it: each consumer's `released` counter, and the
//! check that lets a retired page or slot go back to the free list.
//!
//! Contract (DESIGN.md section 4): a consumer stores `released = s` with `Release` only after its
//! last access to anything launch `s` (or an earlier launch) referred to; the scheduler loads the
//! counters with `Acquire`, so every such access happens before the scheduler hands the page or
//! slot to a new owner. A consumer stops counting only once it is marked dead, and it is marked
//! dead only on kernel evidence of its death, never because it is slow.
//!
//! [`Consumers`] is the counter table of one process (the in-process engine, or a scheduler that
//! runs an offload agent or debug reader as threads); across processes the participant table of
//! `baton-ipc` holds the same counters ([`Workers`]). Both answer the one question of [`Fence`].

use crate::LaunchSeq;
use baton_ipc::sync::{AtomicBool, AtomicU64, CachePadded, Ordering};
use baton_ipc::{ParticipantTable, Role};

// The mutation below must never reach a build that serves: it only exists for the loom models
// (`--cfg loom`) and debug test builds.
#[cfg(all(baton_no_fence, not(any(loom, debug_assertions))))]
compile_error!("`--cfg baton_no_fence` removes the KV fence check; use it only with loom or in debug test builds");

/// The fence check of the reclaim path: something retired after launch `after` may be reused
/// once every live consumer has released `after`, that is once `min_released >= after`.
///
/// Built with `--cfg baton_no_fence` the check is removed (everything retired passes at once).
/// That mutation exists so that the loom models (`tests/loom.rs`) and the scheduler's
/// randomized tests can each be shown to fail without the check.
#[inline]
pub fn passed(after: LaunchSeq, min_released: LaunchSeq) -> bool {
    if cfg!(baton_no_fence) {
        return true;
    }
    after <= min_released
}

/// Anything that knows how far every live consumer has released.
pub trait Fence {
    /// Minimum of `released` over live consumers, or `None` when no consumer is live (then
    /// nothing can touch a page any more, and the caller decides that case explicitly).
    fn min_released(&self) -> Option<LaunchSeq>;
}

/// One consumer's counter and liveness, alone on its cache line(s): consumers write their own
/// counter often, and must not slow each other down.
#[derive(Debug)]
struct Counter {
    released: AtomicU64,
    alive: AtomicBool,
}

/// The `released` counters of a fixed set of consumers `0..len`, all live at `released == 0`
/// when created.
#[derive(Debug)]
pub struct Consumers {
    counters: Box<[CachePadded<Counter>]>,
}

impl Consumers {
    /// `len` live consumers that have released nothing.
    pub fn new(len: usize) -> Self {
        Self {
            counters: (0..len)
                .map(|_| {
                    CachePadded::new(Counter {
                        released: AtomicU64::new(0),
                        alive: AtomicBool::new(true),
                    })
                })
                .collect(),
        }
    }

    /// Number of consumers, live or dead.
    pub fn len(&self) -> usize {
        self.counters.len()
    }

    /// True when there are no consumers at all.
    pub fn is_empty(&self) -> bool {
        self.counters.is_empty()
    }

    /// Consumer `c` is done with every launch `<= seq`. Call it only after the last access of
    /// those launches (for a GPU worker: after the launch's event completed). Never moves back.
    pub fn release(&self, c: usize, seq: LaunchSeq) {
        self.counters[c].released.fetch_max(seq, Ordering::Release);
    }

    /// What consumer `c` has released.
    pub fn released(&self, c: usize) -> LaunchSeq {
        self.counters[c].released.load(Ordering::Acquire)
    }

    /// Consumer `c` is dead, on kernel evidence (its liveness lock was dropped by the kernel):
    /// it stops holding back reclamation. Never call this because a consumer is merely slow.
    pub fn mark_dead(&self, c: usize) {
        self.counters[c].alive.store(false, Ordering::Release);
    }

    /// True until [`mark_dead`](Self::mark_dead).
    pub fn is_alive(&self, c: usize) -> bool {
        self.counters[c].alive.load(Ordering::Acquire)
    }
}

impl Fence for Consumers {
    fn min_released(&self) -> Option<LaunchSeq> {
        // Both loads are Acquire: a counter's value carries the consumer's accesses before it,
        // and a death mark carries the evidence (and so every access the consumer made).
        self.counters
            .iter()
            .filter(|c| c.alive.load(Ordering::Acquire))
            .map(|c| c.released.load(Ordering::Acquire))
            .min()
    }
}

/// The workers registered in a participant table: the consumers the `baton scheduler` daemon
/// waits for. A worker that died keeps counting until the table has the kernel evidence.
#[derive(Clone, Copy)]
pub struct Workers<'a>(pub &'a ParticipantTable);

impl Fence for Workers<'_> {
    fn min_released(&self) -> Option<LaunchSeq> {
        self.0.min_released(Role::Worker)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn min_released_waits_for_the_slowest_live_consumer() {
        let c = Consumers::new(2);
        assert_eq!(c.min_released(), Some(0));
        c.release(0, 5);
        assert_eq!(c.min_released(), Some(0), "consumer 1 has released nothing");
        c.release(1, 3);
        assert_eq!(c.min_released(), Some(3));
        c.release(1, 2);
        assert_eq!(c.released(1), 3, "released never moves back");
    }

    #[test]
    fn a_dead_consumer_stops_holding_back_reclamation_only_once_marked_dead() {
        let c = Consumers::new(2);
        c.release(0, 7);
        assert_eq!(c.min_released(), Some(0));
        c.mark_dead(1);
        assert!(!c.is_alive(1));
        assert_eq!(c.min_released(), Some(7));
        c.mark_dead(0);
        assert_eq!(c.min_released(), None, "no live consumer");
    }

    #[test]
    fn the_fence_check_passes_only_launches_every_consumer_released() {
        assert!(passed(3, 3));
        assert!(passed(2, 3));
        assert!(!passed(4, 3));
    }

    #[test]
    fn workers_of_a_participant_table_count_live_worker_registrations_only() {
        let arena =
            baton_ipc::Arena::heap(&baton_ipc::LayoutSpec::new().participants("p", 3)).unwrap();
        let table = arena.participants("p").unwrap();
        assert_eq!(Workers(&table).min_released(), None);
        let w = table.register(Role::Worker).unwrap();
        let f = table.register(Role::Frontend).unwrap();
        w.set_released(4);
        f.set_released(1);
        assert_eq!(Workers(&table).min_released(), Some(4));
    }
}
