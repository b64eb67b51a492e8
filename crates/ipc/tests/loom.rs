//! Loom models of the ring, the doorbell and the participant table (DESIGN.md section 7).
//!
//! Each process is a loom thread over a heap arena built by the same code as a segment; a crash
//! is a thread that stops at a chosen point and whose liveness lock is released, as the kernel
//! would. Run with:
//!
//! ```text
//! RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom \
//!     cargo test -p baton-ipc --release --test loom
//! ```
//!
//! The preemption bound defaults to 3 (override with `LOOM_MAX_PREEMPTIONS`).
#![cfg(loom)]

use baton_ipc::sync::yield_now;
use baton_ipc::{Arena, Full, LayoutSpec, ReclaimError, Role};
use loom::thread;
use std::time::Duration;

fn model(f: impl Fn() + Sync + Send + 'static) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    let mut b = loom::model::Builder::new();
    if b.preemption_bound.is_none() {
        b.preemption_bound = Some(3);
    }
    let runs = Arc::new(AtomicUsize::new(0));
    let counter = runs.clone();
    b.check(move || {
        counter.fetch_add(1, Ordering::Relaxed);
        f();
    });
    eprintln!(
        "explored {} executions (preemption bound {:?})",
        runs.load(Ordering::Relaxed),
        b.preemption_bound
    );
}

fn ring(capacity: usize) -> Arena {
    Arena::heap(&LayoutSpec::new().ring_of::<u64>("r", capacity)).unwrap()
}

#[test]
fn ring_keeps_order_across_wraparound_with_full_and_empty_edges() {
    model(|| {
        let arena = ring(2);
        let mut tx = arena.producer::<u64>("r").unwrap();
        let mut rx = arena.consumer::<u64>("r").unwrap();
        let producer = thread::spawn(move || {
            let mut fulls = 0;
            for v in 1..=3u64 {
                let mut item = v;
                loop {
                    match tx.try_push(item) {
                        Ok(()) => break,
                        Err(Full(back)) => {
                            assert_eq!(back, v, "a full ring hands the item back");
                            item = back;
                            fulls += 1;
                            yield_now();
                        }
                    }
                }
            }
            fulls
        });
        let mut got = Vec::new();
        while got.len() < 3 {
            match rx.pop() {
                Some(v) => got.push(v),
                None => yield_now(),
            }
        }
        assert_eq!(got, vec![1, 2, 3]);
        assert_eq!(rx.pop(), None, "empty after the last item");
        producer.join().unwrap();
    });
}

#[test]
fn batch_push_and_pop_keep_order_and_never_overrun() {
    model(|| {
        let arena = ring(4);
        let mut tx = arena.producer::<u64>("r").unwrap();
        let mut rx = arena.consumer::<u64>("r").unwrap();
        let producer = thread::spawn(move || {
            let items = [10u64, 11, 12, 13, 14, 15];
            let mut sent = 0;
            while sent < items.len() {
                let n = tx.push_batch(&items[sent..]);
                assert!(n <= 4);
                sent += n;
                if n == 0 {
                    yield_now();
                }
            }
        });
        let mut got = Vec::new();
        while got.len() < 6 {
            if rx.pop_batch(&mut got, 3) == 0 {
                yield_now();
            }
        }
        assert_eq!(got, vec![10, 11, 12, 13, 14, 15]);
        producer.join().unwrap();
    });
}

/// A lost wakeup would leave the consumer asleep forever, which loom reports as a model that
/// never finishes.
#[test]
fn a_consumer_asleep_on_the_doorbell_is_always_woken() {
    model(|| {
        let arena = ring(2);
        let mut tx = arena.producer::<u64>("r").unwrap();
        let mut rx = arena.consumer::<u64>("r").unwrap();
        let producer = thread::spawn(move || {
            tx.try_push(7).unwrap();
        });
        assert_eq!(rx.wait_pop(Duration::MAX), Some(7));
        producer.join().unwrap();
    });
}

#[test]
fn a_shared_doorbell_wakes_a_consumer_of_either_ring() {
    model(|| {
        let spec = LayoutSpec::new()
            .doorbell("bell")
            .ring_waking("a", 2, 8, "bell")
            .ring_waking("b", 2, 8, "bell");
        let arena = Arena::heap(&spec).unwrap();
        let bell = arena.doorbell("bell").unwrap();
        let mut ta = arena.producer::<u64>("a").unwrap();
        let mut tb = arena.producer::<u64>("b").unwrap();
        let mut ra = arena.consumer::<u64>("a").unwrap();
        let mut rb = arena.consumer::<u64>("b").unwrap();
        let p1 = thread::spawn(move || ta.try_push(1).unwrap());
        let p2 = thread::spawn(move || tb.try_push(2).unwrap());
        let mut got = Vec::new();
        while got.len() < 2 {
            assert!(bell.wait_until(Duration::MAX, || ra.has_pending() || rb.has_pending()));
            got.extend(ra.pop());
            got.extend(rb.pop());
        }
        got.sort();
        assert_eq!(got, vec![1, 2]);
        p1.join().unwrap();
        p2.join().unwrap();
    });
}

/// A producer dies mid-stream; the consumer learns it from the participant table, resets the
/// ring and reclaims the slot, and a new producer then delivers without interference.
#[test]
fn a_ring_reset_after_its_producers_death_is_reusable() {
    model(|| {
        let spec = LayoutSpec::new()
            .participants("p", 1)
            .ring_of::<u64>("r", 2);
        let arena = Arena::heap(&spec).unwrap();
        let table = arena.participants("p").unwrap();
        let mut rx = arena.consumer::<u64>("r").unwrap();
        let (a2, t2) = (arena.clone(), table.clone());
        let first = thread::spawn(move || {
            let me = t2.register(Role::Frontend).unwrap();
            let mut tx = a2.producer::<u64>("r").unwrap();
            tx.try_push(1).unwrap();
            // Crash: the end is never dropped, the lock is released by the "kernel".
            std::mem::forget(tx);
            me.abandon();
        });
        let dead = loop {
            match table.scan_dead().pop() {
                Some(d) => break d,
                None => yield_now(),
            }
        };
        first.join().unwrap();
        // SAFETY: the producer is dead (its lock is released) and its end is gone.
        unsafe { rx.reset() };
        table.reclaim(dead.slot, dead.generation).unwrap();
        let (a3, t3) = (arena.clone(), table.clone());
        let second = thread::spawn(move || {
            let me = t3.register(Role::Frontend).unwrap();
            assert_eq!(me.generation(), 2);
            let mut tx = a3.producer::<u64>("r").unwrap();
            tx.try_push(2).unwrap();
        });
        assert_eq!(rx.wait_pop(Duration::MAX), Some(2));
        second.join().unwrap();
    });
}

/// A slot whose owner died is reclaimed by a scanner while a new process tries to register in
/// it; a second reclaim with the dead owner's (now stale) generation races with the new
/// registration. The generation must refuse the stale reclaim whatever the interleaving, so the
/// new owner is never freed under it.
#[test]
fn a_stale_generation_never_frees_a_reused_participant_slot() {
    model(|| {
        let arena = Arena::heap(&LayoutSpec::new().participants("p", 1)).unwrap();
        let table = arena.participants("p").unwrap();
        let dead = table.register(Role::Worker).unwrap();
        assert_eq!(dead.generation(), 1);
        dead.abandon();

        let t = table.clone();
        let scanner = thread::spawn(move || {
            let found = t.scan_dead();
            assert_eq!(found.len(), 1);
            assert_eq!((found[0].slot, found[0].generation), (0, 1));
            t.reclaim(0, 1).unwrap();
            // Loom's DPOR only reorders around the last access to an object, so it would not
            // try the registrant between these two calls without an explicit switch point.
            yield_now();
            // The same reference again: refused, whether or not the slot was reused since.
            let again = t.reclaim(0, 1);
            assert!(
                matches!(
                    again,
                    Err(ReclaimError::AlreadyFree { .. } | ReclaimError::Stale { .. })
                ),
                "{again:?}"
            );
        });
        let t = table.clone();
        let registrant = thread::spawn(move || t.register(Role::Worker).ok());
        scanner.join().unwrap();
        let new = registrant.join().unwrap();
        let new = new.unwrap_or_else(|| table.register(Role::Worker).unwrap());
        assert_eq!(new.generation(), 2);
        assert!(
            table.is_current(0, 2),
            "the stale reclaim did not free the new owner"
        );
        assert!(table.scan_dead().is_empty());
    });
}

/// A process dies while another registers and a scanner looks for the dead: the death is
/// reported only after the lock is gone, each registration gets its own generation, and the
/// live registrant is never reported dead or freed.
#[test]
fn registration_racing_with_a_death_gets_a_fresh_generation() {
    model(|| {
        let arena = Arena::heap(&LayoutSpec::new().participants("p", 2)).unwrap();
        let table = arena.participants("p").unwrap();
        let t = table.clone();
        let dier = thread::spawn(move || {
            let me = t.register(Role::Frontend).unwrap();
            let at = (me.slot(), me.generation());
            yield_now();
            me.abandon();
            at
        });
        let t = table.clone();
        let scanner = thread::spawn(move || {
            let found = t.scan_dead();
            for d in &found {
                yield_now();
                t.reclaim(d.slot, d.generation).unwrap();
            }
            found.len()
        });
        let live = table.register(Role::Frontend).unwrap();
        yield_now();
        assert!(table.is_current(live.slot(), live.generation()));
        let (dslot, dgen) = dier.join().unwrap();
        let reclaimed = scanner.join().unwrap();
        assert!(reclaimed <= 1);
        assert!(
            table.is_current(live.slot(), live.generation()),
            "never freed while alive"
        );
        if dslot == live.slot() {
            // The dead owner was found and reclaimed before we registered: we are the slot's
            // next generation.
            assert_eq!((dgen, live.generation(), reclaimed), (1, 2, 1));
            assert!(table.scan_dead().is_empty());
            return;
        }
        assert_eq!((dgen, live.generation()), (1, 1));
        // The death is always found eventually, and the slot then comes back a generation up.
        if reclaimed == 0 {
            let found = table.scan_dead();
            assert_eq!(found.len(), 1);
            assert_eq!((found[0].slot, found[0].generation), (dslot, 1));
            table.reclaim(found[0].slot, found[0].generation).unwrap();
        }
        let next = table.register_in(Role::Frontend, dslot..dslot + 1).unwrap();
        assert_eq!(next.generation(), 2);
        drop(live);
    });
}

/// A process that dies between claiming a slot and going live is declared dead (its lock is
/// gone), and the slot is reclaimed and reused at the next generation.
#[test]
fn a_death_while_registering_is_detected_and_the_slot_reused() {
    model(|| {
        let arena = Arena::heap(&LayoutSpec::new().participants("p", 1)).unwrap();
        let table = arena.participants("p").unwrap();
        let t = table.clone();
        let dier = thread::spawn(move || t.register_then_die_while_registering(Role::Frontend));
        let t = table.clone();
        let scanner = thread::spawn(move || {
            let found = t.scan_dead();
            for d in &found {
                yield_now();
                assert_eq!((d.slot, d.generation), (0, 1));
                t.reclaim(d.slot, d.generation).unwrap();
            }
            found.len()
        });
        assert_eq!(dier.join().unwrap(), Ok((0, 1)));
        if scanner.join().unwrap() == 0 {
            let found = table.scan_dead();
            assert_eq!(found.len(), 1);
            table.reclaim(0, 1).unwrap();
        }
        assert_eq!(table.register(Role::Frontend).unwrap().generation(), 2);
    });
}
