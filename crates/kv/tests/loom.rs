//! Loom models of fenced reclamation (DESIGN.md sections 4, 5 and 7): the scheduler and each
//! consumer are threads over the shared structures, running the crate's own reclaim path
//! ([`PagePool`], [`SlotAllocator`], [`Consumers`] and the fence check inside them).
//!
//! The scheduler thread owns the page pool and the slot allocator (they are scheduler-private
//! by design) and reads the consumers' `released` counters. A consumer thread "executes" a
//! launch by reading its block-table row and writing the KV pages it names, then stores
//! `released = s`. Pages and block-table rows are plain cells here, so loom reports a causality
//! violation the moment the scheduler hands one to a new owner (and the new owner writes it)
//! while a launch that referred to it may still touch it. A crash is a thread that stops; the
//! kernel's liveness lock is an atomic flag it drops as it stops.
//!
//! Run with (`scripts/loom.sh` runs it; the preemption bound defaults to 3, override with
//! `LOOM_MAX_PREEMPTIONS`; the models are small enough to explore exhaustively at 6):
//!
//! ```text
//! RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=/tmp/tgt-kv-loom \
//!     cargo test -p baton-kv --release --test loom
//! ```
//!
//! Each model fails when the fence check is removed. `--cfg baton_no_fence` (see
//! `src/fence.rs`) makes `fence::passed` always true, so `PagePool::reclaim` and
//! `SlotAllocator::reclaim` hand back everything retired at once. A failing loom model aborts
//! the test binary, so run the models one at a time to see each fail:
//!
//! ```text
//! RUSTFLAGS="--cfg loom --cfg baton_no_fence" CARGO_TARGET_DIR=/tmp/tgt-kv-loom-nofence \
//!     cargo test -p baton-kv --release --test loom -- --exact NAME
//! ```
//!
//! Each test's comment says how it fails then. The models also check the memory ordering:
//! with `Consumers::release` storing `Relaxed` instead of `Release`, model (1) reports
//! "Causality violation: Concurrent read and write accesses to `UnsafeCell`".
#![cfg(loom)]

use baton_ipc::sync::{AtomicBool, AtomicU64, Ordering, UnsafeCell};
use baton_kv::{Consumers, Fence, LaunchSeq, PagePool, SlotAllocator};
use baton_proto::SlotRef;
use loom::sync::Arc;
use loom::thread;

fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    if b.preemption_bound.is_none() {
        b.preemption_bound = Some(3);
    }
    b.check(f);
}

/// Most block-table entries per slot in these models.
const MAX_BLOCKS: usize = 2;
/// Most consumers in these models; page `p` has one shard per consumer (a tensor-parallel
/// rank writes its own shard of every page).
const SHARDS: usize = 2;

/// What the processes share: the consumers' counters and liveness locks (segment), the KV
/// pages (device memory), the block-table rows (segment) and a completion mailbox (ring slot).
struct Shared {
    consumers: Consumers,
    /// The kernel's liveness lock of each consumer: held while it lives.
    lock_held: Vec<AtomicBool>,
    pages: Vec<[UnsafeCell<LaunchSeq>; SHARDS]>,
    block_rows: Vec<UnsafeCell<[u32; MAX_BLOCKS]>>,
    /// The completion of the last launch that sampled: who it was for and the sampled id.
    completion: UnsafeCell<(SlotRef, u32)>,
    /// Sequence number of the last completion written (Release after the mailbox write).
    completed: AtomicU64,
}

// SAFETY: the cells are shared on purpose: who may touch them when is the protocol under test,
// and loom checks every access against it.
unsafe impl Sync for Shared {}

/// A published launch record: read-only once published (it moves into the consumer thread).
#[derive(Clone, Copy)]
struct LaunchRec {
    seq: LaunchSeq,
    req: SlotRef,
    num_blocks: usize,
    sample: bool,
    /// The first `reads` pages of the row are only read (a cached prefix the launch attends
    /// to); the rest are written.
    reads: usize,
}

impl Shared {
    fn new(consumers: usize, pages: usize, slots: usize) -> Arc<Self> {
        Arc::new(Self {
            consumers: Consumers::new(consumers),
            lock_held: (0..consumers).map(|_| AtomicBool::new(true)).collect(),
            pages: (0..pages)
                .map(|_| std::array::from_fn(|_| UnsafeCell::new(0)))
                .collect(),
            block_rows: (0..slots)
                .map(|_| UnsafeCell::new([u32::MAX; MAX_BLOCKS]))
                .collect(),
            completion: UnsafeCell::new((SlotRef::default(), 0)),
            completed: AtomicU64::new(0),
        })
    }

    /// Scheduler: writes the block-table row of a slot it just allocated.
    fn write_block_row(&self, slot: SlotRef, pages: &[u32]) {
        self.block_rows[slot.slot as usize].with_mut(|row| {
            // SAFETY: checked by loom: no launch that read this row may still be unreleased.
            let row = unsafe { &mut *row };
            row[..pages.len()].copy_from_slice(pages);
        });
    }

    /// Scheduler: the new owner's first launch writes every shard of `pages`. Each shard must
    /// already show the last launch that wrote it: that launch's writes are complete and
    /// visible, not still in flight.
    fn reuse_pages(&self, pages: &[u32], last_writer: LaunchSeq, shards: usize, new: LaunchSeq) {
        for &p in pages {
            for shard in &self.pages[p as usize][..shards] {
                shard.with_mut(|v| {
                    // SAFETY: checked by loom: the page's previous launches are released.
                    let v = unsafe { &mut *v };
                    assert_eq!(
                        *v, last_writer,
                        "page {p} reused before its last launch's writes finished"
                    );
                    *v = new;
                });
            }
        }
    }

    /// Consumer `c`: executes `l` on its shard of every page the launch's block-table entries
    /// name; consumer 0 also writes the completion of a sampling row.
    fn execute(&self, c: usize, l: LaunchRec) {
        let row = self.block_rows[l.req.slot as usize].with(|row| {
            // SAFETY: checked by loom: the scheduler does not rewrite a row a launch refers to
            // while that launch is unreleased.
            unsafe { *row }
        });
        for (i, &p) in row[..l.num_blocks].iter().enumerate() {
            if i < l.reads {
                self.pages[p as usize][c].with(|v| {
                    // SAFETY: checked by loom: nobody writes a page an unreleased launch reads.
                    unsafe { std::ptr::read(v) }
                });
                continue;
            }
            self.pages[p as usize][c].with_mut(|v| {
                // SAFETY: checked by loom: this launch still owns the page's shard `c`.
                unsafe { *v = l.seq };
            });
        }
        if c == 0 && l.sample {
            self.completion.with_mut(|m| {
                // SAFETY: one launch in flight per model; the scheduler reads the mailbox only
                // after `completed` (Acquire) shows it written.
                unsafe { *m = (l.req, 7) };
            });
            self.completed.store(l.seq, Ordering::Release);
        }
    }

    /// Scheduler: the completion of launch `seq`, if it arrived.
    fn poll_completion(&self, seq: LaunchSeq) -> Option<(SlotRef, u32)> {
        (self.completed.load(Ordering::Acquire) >= seq).then(|| {
            self.completion.with(|m| {
                // SAFETY: written before the Release store of `completed` we just observed.
                unsafe { *m }
            })
        })
    }

    /// Scheduler: marks dead every consumer whose liveness lock the kernel dropped.
    fn scan_dead(&self) {
        for (c, lock) in self.lock_held.iter().enumerate() {
            if !lock.load(Ordering::Acquire) {
                self.consumers.mark_dead(c);
            }
        }
    }
}

/// The scheduler's reclaim step: everything retired after a launch every live consumer has
/// released goes back (with no live consumer, nothing can touch a page any more).
fn reclaim(shared: &Shared, pool: &mut PagePool, slots: &mut SlotAllocator) -> usize {
    match shared.consumers.min_released() {
        Some(min) => {
            slots.reclaim(min);
            pool.reclaim(min).len()
        }
        None => {
            slots.reclaim(LaunchSeq::MAX);
            pool.reclaim_all().len()
        }
    }
}

/// Allocates a slot and `n` pages for a new request and writes its block-table row.
fn admit(
    shared: &Shared,
    pool: &mut PagePool,
    slots: &mut SlotAllocator,
    n: usize,
) -> Option<(SlotRef, Vec<u32>)> {
    let mut pages = Vec::new();
    if pool.num_free() < n {
        return None;
    }
    let slot = slots.alloc()?;
    assert!(pool.alloc(n, &mut pages));
    shared.write_block_row(slot, &pages);
    Some((slot, pages))
}

/// (1) A request ends while the worker's launch over its pages is in flight. The pages are
/// never reclaimed before the worker released that launch, and are reclaimed once it has.
///
/// Without the fence check (`--cfg baton_no_fence`, command in the module comment, NAME
/// `pages_retired_with_a_launch_in_flight_are_reclaimed_only_after_its_release`) it fails:
/// "pages reclaimed before the worker released launch 1" (or a causality violation on the page).
#[test]
fn pages_retired_with_a_launch_in_flight_are_reclaimed_only_after_its_release() {
    model(|| {
        let shared = Shared::new(1, 2, 2);
        let mut pool = PagePool::new(2);
        let mut slots = SlotAllocator::new(2);
        let (a, pages) = admit(&shared, &mut pool, &mut slots, 2).unwrap();
        let launch = LaunchRec {
            seq: 1,
            req: a,
            num_blocks: 2,
            sample: false,
            reads: 0,
        };
        let w = shared.clone();
        let worker = thread::spawn(move || {
            w.execute(0, launch);
            w.consumers.release(0, launch.seq);
        });
        // The request ends (stop string) with launch 1 in flight: retire after launch 1.
        pool.retire(&pages, 1);
        slots.retire(a, 1);
        // A new request wants both pages at once.
        reclaim(&shared, &mut pool, &mut slots);
        let early = admit(&shared, &mut pool, &mut slots, 2);
        if let Some((_, got)) = &early {
            assert!(
                shared.consumers.released(0) >= 1,
                "pages reclaimed before the worker released launch 1"
            );
            shared.reuse_pages(got, 1, 1, 2);
        }
        worker.join().unwrap();
        if early.is_none() {
            // Released now: the pages must come back.
            assert_eq!(reclaim(&shared, &mut pool, &mut slots), 2);
            let (_, got) = admit(&shared, &mut pool, &mut slots, 2).expect("pages came back");
            shared.reuse_pages(&got, 1, 1, 2);
        }
        assert_eq!(pool.stats().retired, 0);
    });
}

/// (2) A cancel right after the launch: the launch still runs to its fence, its output is
/// suppressed (never published), and the pages come back only after its release.
///
/// Without the fence check (`--cfg baton_no_fence`, command in the module comment, NAME
/// `a_cancel_right_after_launch_publishes_nothing_and_waits_for_the_fence`) it fails:
/// "page 0 reused before its last launch's writes finished".
#[test]
fn a_cancel_right_after_launch_publishes_nothing_and_waits_for_the_fence() {
    model(|| {
        let shared = Shared::new(1, 1, 2);
        let mut pool = PagePool::new(1);
        let mut slots = SlotAllocator::new(2);
        let (a, pages) = admit(&shared, &mut pool, &mut slots, 1).unwrap();
        // Live requests by slot reference; the scheduler's request table.
        let mut live: Vec<(SlotRef, u64)> = vec![(a, 100)];
        let launch = LaunchRec {
            seq: 1,
            req: a,
            num_blocks: 1,
            sample: true,
            reads: 0,
        };
        let w = shared.clone();
        let worker = thread::spawn(move || {
            w.execute(0, launch);
            w.consumers.release(0, launch.seq);
        });
        // Cancel right away: no new launch includes it; its resources retire after launch 1.
        live.retain(|&(_, id)| id != 100);
        pool.retire(&pages, 1);
        slots.retire(a, 1);
        // The completion, if it arrived: `Some(Some(id))` published to `id`, `Some(None)`
        // suppressed. A row's request is found by its slot reference, checked by generation.
        let deliver = |live: &[(SlotRef, u64)], slots: &SlotAllocator| {
            shared.poll_completion(1).map(|(r, _)| {
                live.iter()
                    .find(|&&(s, _)| s == r && slots.is_current(r))
                    .map(|&(_, id)| id)
            })
        };
        // A second request needs the only page.
        let mut b = None;
        reclaim(&shared, &mut pool, &mut slots);
        if let Some((slot, got)) = admit(&shared, &mut pool, &mut slots, 1) {
            shared.reuse_pages(&got, 1, 1, 2);
            live.push((slot, 200));
            b = Some(slot);
        }
        let mut outcome = deliver(&live, &slots);
        worker.join().unwrap();
        if b.is_none() {
            assert_eq!(reclaim(&shared, &mut pool, &mut slots), 1, "released: back");
            let (slot, got) = admit(&shared, &mut pool, &mut slots, 1).unwrap();
            shared.reuse_pages(&got, 1, 1, 2);
            live.push((slot, 200));
        }
        if outcome.is_none() {
            outcome = deliver(&live, &slots);
        }
        assert_eq!(
            outcome,
            Some(None),
            "the cancelled launch's output is suppressed, never published"
        );
    });
}

/// (3) Two consumers (two tensor-parallel ranks, each writing its shard of every page) release
/// out of step: rank 0 releases launch 1 early, rank 1 runs launch 2 first and releases both at
/// once. A page comes back only once the slower rank released it.
///
/// Without the fence check (`--cfg baton_no_fence`, command in the module comment, NAME
/// `pages_wait_for_the_slowest_of_two_consumers_releasing_out_of_step`) it fails:
/// "page 1 reused before its last launch's writes finished".
#[test]
fn pages_wait_for_the_slowest_of_two_consumers_releasing_out_of_step() {
    model(|| {
        let shared = Shared::new(2, 2, 2);
        let mut pool = PagePool::new(2);
        let mut slots = SlotAllocator::new(2);
        let (a, pa) = admit(&shared, &mut pool, &mut slots, 1).unwrap();
        let (b, pb) = admit(&shared, &mut pool, &mut slots, 1).unwrap();
        let l1 = LaunchRec {
            seq: 1,
            req: a,
            num_blocks: 1,
            sample: false,
            reads: 0,
        };
        let l2 = LaunchRec {
            seq: 2,
            req: b,
            ..l1
        };
        // Both requests end with their launches in flight: A after 1, B after 2.
        let ranks: Vec<_> = [(0usize, [l1, l2]), (1, [l2, l1])]
            .into_iter()
            .map(|(c, order)| {
                let w = shared.clone();
                thread::spawn(move || {
                    // Rank 0 finishes launch 1, releases it, then launch 2. Rank 1 runs
                    // launch 2 first and can release only once both are done.
                    w.execute(c, order[0]);
                    if c == 0 {
                        w.consumers.release(c, 1);
                    }
                    w.execute(c, order[1]);
                    w.consumers.release(c, 2);
                })
            })
            .collect();
        pool.retire(&pa, 1);
        slots.retire(a, 1);
        pool.retire(&pb, 2);
        slots.retire(b, 2);
        // Whatever came back goes to a new owner at once, which writes it.
        let mut held = Vec::new();
        for _ in 0..2 {
            reclaim(&shared, &mut pool, &mut slots);
            let mut got = Vec::new();
            assert!(pool.alloc(pool.num_free(), &mut got));
            for &p in &got {
                let last = if pa.contains(&p) { 1 } else { 2 };
                shared.reuse_pages(&[p], last, 2, 3);
            }
            held.extend(got);
        }
        for r in ranks {
            r.join().unwrap();
        }
        assert_eq!(shared.consumers.min_released(), Some(2));
        reclaim(&shared, &mut pool, &mut slots);
        assert_eq!(
            pool.num_free() + held.len(),
            2,
            "every page back once both ranks released"
        );
    });
}

/// (4) A consumer dies with a launch in flight: it never releases it. It stops holding back
/// reclamation only once the kernel dropped its liveness lock (the scheduler marks it dead on
/// that evidence), and the live consumer's release still counts.
///
/// Without the fence check (`--cfg baton_no_fence`, command in the module comment, NAME
/// `a_consumer_that_dies_with_a_launch_in_flight_stops_counting_only_on_kernel_evidence`) it
/// fails: "reclaimed past a live consumer".
#[test]
fn a_consumer_that_dies_with_a_launch_in_flight_stops_counting_only_on_kernel_evidence() {
    model(|| {
        let shared = Shared::new(2, 1, 2);
        let mut pool = PagePool::new(1);
        let mut slots = SlotAllocator::new(2);
        let (a, pages) = admit(&shared, &mut pool, &mut slots, 1).unwrap();
        let launch = LaunchRec {
            seq: 1,
            req: a,
            num_blocks: 1,
            sample: false,
            reads: 0,
        };
        let w = shared.clone();
        let dier = thread::spawn(move || {
            w.execute(0, launch);
            // Crash before the fence: no release. The kernel drops the liveness lock.
            w.lock_held[0].store(false, Ordering::Release);
        });
        let w = shared.clone();
        let survivor = thread::spawn(move || {
            w.execute(1, launch);
            w.consumers.release(1, launch.seq);
        });
        pool.retire(&pages, 1);
        slots.retire(a, 1);
        shared.scan_dead();
        reclaim(&shared, &mut pool, &mut slots);
        let early = admit(&shared, &mut pool, &mut slots, 1);
        if let Some((_, got)) = &early {
            assert!(
                !shared.consumers.is_alive(0),
                "reclaimed past a live consumer"
            );
            shared.reuse_pages(got, 1, 2, 2);
        }
        dier.join().unwrap();
        survivor.join().unwrap();
        shared.scan_dead();
        assert_eq!(shared.consumers.min_released(), Some(1));
        if early.is_none() {
            assert_eq!(reclaim(&shared, &mut pool, &mut slots), 1);
        }
        assert_eq!(pool.stats().retired, 0);
    });
}

/// (5) A request slot and its block-table row are reused only after the fence, and a
/// reference to the slot's previous owner (a completion that arrives after the reuse, a late
/// retire) is recognised as stale by its generation: the new owner never gets the old owner's
/// token and never loses its slot.
///
/// Without the fence check (`--cfg baton_no_fence`, command in the module comment, NAME
/// `a_reused_slot_waits_for_the_fence_and_stale_references_are_caught_by_generation`) it fails:
/// "Causality violation: Concurrent read and write accesses" (the new owner's block-table row is
/// written while the worker still reads the old one).
#[test]
fn a_reused_slot_waits_for_the_fence_and_stale_references_are_caught_by_generation() {
    model(|| {
        let shared = Shared::new(1, 2, 1);
        let mut pool = PagePool::new(2);
        let mut slots = SlotAllocator::new(1);
        let (a, pages) = admit(&shared, &mut pool, &mut slots, 1).unwrap();
        // The request owning each slot: (reference, request id).
        let mut owner: Option<(SlotRef, u64)> = Some((a, 100));
        let launch = LaunchRec {
            seq: 1,
            req: a,
            num_blocks: 1,
            sample: true,
            reads: 0,
        };
        let w = shared.clone();
        let worker = thread::spawn(move || {
            w.execute(0, launch);
            w.consumers.release(0, launch.seq);
        });
        // A ends (length) with launch 1 in flight.
        owner = owner.filter(|&(_, id)| id != 100);
        pool.retire(&pages, 1);
        slots.retire(a, 1);
        let mut b = None;
        for _ in 0..2 {
            reclaim(&shared, &mut pool, &mut slots);
            if b.is_none() {
                if let Some((slot, _)) = admit(&shared, &mut pool, &mut slots, 1) {
                    assert_ne!(slot.generation, a.generation, "reuse bumps the generation");
                    assert!(!slots.is_current(a));
                    assert!(!slots.retire(a, 1), "a stale retire must not free B's slot");
                    owner = Some((slot, 200));
                    b = Some(slot);
                }
            }
            // The completion of launch 1 may arrive after B took the slot. Its row's request
            // is looked up by slot index; the generation says whether it is still that request.
            if let Some((r, _)) = shared.poll_completion(1) {
                let to = owner.filter(|&(s, _)| s.slot == r.slot && slots.is_current(r));
                assert_eq!(
                    to, None,
                    "A's token must go to nobody (A ended; B is newer)"
                );
            }
        }
        worker.join().unwrap();
        if b.is_none() {
            reclaim(&shared, &mut pool, &mut slots);
            let (slot, _) =
                admit(&shared, &mut pool, &mut slots, 1).expect("slot back after release");
            assert!(!slots.is_current(a) && slots.is_current(slot));
        }
    });
}

/// (6) A prefix-cache hit on a retired page. Request A's launch 1 reads its registered full
/// block (page 0) and writes page 1; A is cancelled with launch 1 in flight, so both pages
/// retire after launch 1. Request B takes page 0 from the cache (the hit revives it: a full
/// block is never written again) and its launch 2 reads it too, then B is cancelled. Page 1
/// may come back after launch 1's release, page 0 only after launch 2's: a request that needs
/// fresh pages never writes page 0 while launch 2 may still read it.
///
/// Without the fence check (NAME
/// `a_cache_hit_revives_a_retired_page_that_then_waits_for_every_launch_reading_it`) it fails:
/// "pages [2, 1] handed out before launch 2 was released". If `PagePool::share` left the
/// revived page under its old retirement, it fails with "pages [1, 0] handed out before launch
/// 2 was released" (page 0 reclaimed at launch 1's release while B's launch reads it).
#[test]
fn a_cache_hit_revives_a_retired_page_that_then_waits_for_every_launch_reading_it() {
    model(|| {
        let shared = Shared::new(1, 3, 3);
        let mut pool = PagePool::new(3);
        let mut slots = SlotAllocator::new(3);
        let (a, pa) = admit(&shared, &mut pool, &mut slots, 2).unwrap();
        // Page 0 holds A's first block, computed and fenced by an earlier launch.
        assert!(pool.register(pa[0], 7));
        let l1 = LaunchRec {
            seq: 1,
            req: a,
            num_blocks: 2,
            sample: false,
            reads: 1,
        };
        // A is cancelled with launch 1 published.
        pool.retire(&pa, 1);
        slots.retire(a, 1);
        // B shares the retired block and takes one fresh page (page 2, never used).
        let p0 = pool.lookup(7).expect("a retired keyed page is a hit");
        assert_eq!(p0, pa[0]);
        pool.share(p0);
        let b = slots.alloc().unwrap();
        let mut pb = vec![p0];
        assert!(pool.alloc(1, &mut pb));
        assert_eq!(pb[1], 2, "the free page, not A's page 1");
        shared.write_block_row(b, &pb);
        let l2 = LaunchRec {
            seq: 2,
            req: b,
            num_blocks: 2,
            sample: false,
            reads: 1,
        };
        let w = shared.clone();
        let worker = thread::spawn(move || {
            for l in [l1, l2] {
                w.execute(0, l);
                w.consumers.release(0, l.seq);
            }
        });
        // B is cancelled with launch 2 published: page 0 retires after the later of 1 and 2.
        pool.retire(&pb, 2);
        slots.retire(b, 2);
        // C wants two fresh pages, and writes them.
        let mut c = None;
        for _ in 0..2 {
            reclaim(&shared, &mut pool, &mut slots);
            if c.is_none() {
                c = admit(&shared, &mut pool, &mut slots, 2);
                if let Some((_, got)) = &c {
                    assert!(
                        shared.consumers.released(0) >= 2,
                        "pages {got:?} handed out before launch 2 was released"
                    );
                    for &p in got {
                        shared.reuse_pages(&[p], [0, 1, 2][p as usize], 1, 3);
                    }
                }
            }
        }
        worker.join().unwrap();
        if c.is_none() {
            // Both launches released: every page comes back, and C gets two.
            reclaim(&shared, &mut pool, &mut slots);
            assert_eq!(pool.stats().retired, 0);
            let (_, got) = admit(&shared, &mut pool, &mut slots, 2).expect("pages came back");
            for &p in &got {
                shared.reuse_pages(&[p], [0, 1, 2][p as usize], 1, 3);
            }
        }
    });
}
