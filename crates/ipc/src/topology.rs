//! The control-plane topology: which rings exist and who is on each end.
//!
//! Contract: every frontend slot has its own ring pair (admissions and cancels in, outputs and
//! acknowledgements out), so a frontend that dies mid-write can only tear its own ring, which the
//! scheduler resets when it reclaims the slot. Each worker has a launch ring (scheduler to
//! worker) and a completion ring (worker to scheduler). Every ring into the scheduler wakes one
//! shared doorbell, so the scheduler sleeps on all of them at once. Participant slots are
//! partitioned by role: slot 0 is the scheduler, then the workers, then one per frontend, whose
//! index is the frontend's ring-pair index.
//!
//! This module only names things; the slot types are the caller's (`baton-proto`).

use crate::arena::{Arena, RegionError};
use crate::layout::LayoutSpec;
use crate::limits::Limits;
use crate::ring::{RingConsumer, RingProducer};
use bytemuck::Pod;
use std::ops::Range;

/// Name of the participant table region.
pub const PARTICIPANTS: &str = "participants";
/// Name of the doorbell every scheduler-bound ring wakes.
pub const SCHEDULER_DOORBELL: &str = "scheduler.doorbell";

/// Ring from frontend `k` to the scheduler (admissions, cancels).
pub fn frontend_in(k: usize) -> String {
    format!("frontend.{k}.in")
}

/// Ring from the scheduler to frontend `k` (outputs, acknowledgements).
pub fn frontend_out(k: usize) -> String {
    format!("frontend.{k}.out")
}

/// Ring from the scheduler to worker `w` (launch records).
pub fn launch(w: usize) -> String {
    format!("worker.{w}.launch")
}

/// Ring from worker `w` to the scheduler (completions).
pub fn completion(w: usize) -> String {
    format!("worker.{w}.completion")
}

/// Capacity (slots, a power of two) and slot size (bytes) of a ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingShape {
    /// Slots.
    pub capacity: usize,
    /// Bytes per slot.
    pub slot_size: usize,
}

impl RingShape {
    /// `capacity` slots of `T`.
    pub fn of<T: Pod>(capacity: usize) -> RingShape {
        RingShape {
            capacity,
            slot_size: std::mem::size_of::<T>(),
        }
    }
}

/// The shape of a whole control plane.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ControlPlaneSpec {
    /// Frontend slots (ring pairs).
    pub frontends: usize,
    /// Workers (launch/completion ring pairs).
    pub workers: usize,
    /// Participant slots beyond scheduler, workers and frontends (agents, debug readers).
    pub extra_participants: usize,
    /// Each frontend-to-scheduler ring.
    pub frontend_in: RingShape,
    /// Each scheduler-to-frontend ring.
    pub frontend_out: RingShape,
    /// Each launch ring.
    pub launch: RingShape,
    /// Each completion ring.
    pub completion: RingShape,
}

impl ControlPlaneSpec {
    /// The layout: participants, the scheduler doorbell, then per worker a launch and a
    /// completion ring, then per frontend an in and an out ring. Append more regions to the
    /// returned spec if needed; the creator and every attacher must build the same one.
    pub fn layout_spec(&self) -> LayoutSpec {
        let mut spec = LayoutSpec::new()
            .participants(PARTICIPANTS, self.participant_slots())
            .doorbell(SCHEDULER_DOORBELL);
        for w in 0..self.workers {
            spec = spec
                .ring(&launch(w), self.launch.capacity, self.launch.slot_size)
                .ring_waking(
                    &completion(w),
                    self.completion.capacity,
                    self.completion.slot_size,
                    SCHEDULER_DOORBELL,
                );
        }
        for k in 0..self.frontends {
            spec = spec
                .ring_waking(
                    &frontend_in(k),
                    self.frontend_in.capacity,
                    self.frontend_in.slot_size,
                    SCHEDULER_DOORBELL,
                )
                .ring(
                    &frontend_out(k),
                    self.frontend_out.capacity,
                    self.frontend_out.slot_size,
                );
        }
        spec
    }

    /// `limits` with the ring capacity fields filled from this spec.
    pub fn with_ring_capacities(&self, limits: Limits) -> Limits {
        Limits {
            frontend_in_capacity: self.frontend_in.capacity as u64,
            frontend_out_capacity: self.frontend_out.capacity as u64,
            launch_capacity: self.launch.capacity as u64,
            completion_capacity: self.completion.capacity as u64,
            ..limits
        }
    }

    /// Participant slots in all.
    pub fn participant_slots(&self) -> usize {
        1 + self.workers + self.frontends + self.extra_participants
    }

    /// The scheduler's participant slot range (`0..1`).
    pub fn scheduler_slots(&self) -> Range<usize> {
        0..1
    }

    /// The workers' participant slots; worker `w` registers anywhere in it, and its ring pair
    /// is `slot - worker_slots().start`.
    pub fn worker_slots(&self) -> Range<usize> {
        1..1 + self.workers
    }

    /// The frontends' participant slots; a frontend registered in slot `s` uses ring pair
    /// `s - frontend_slots().start`.
    pub fn frontend_slots(&self) -> Range<usize> {
        let start = 1 + self.workers;
        start..start + self.frontends
    }

    /// Participant slots for everything else.
    pub fn extra_slots(&self) -> Range<usize> {
        let start = 1 + self.workers + self.frontends;
        start..start + self.extra_participants
    }

    /// The ring-pair index of the frontend registered in participant slot `slot`.
    pub fn frontend_index(&self, slot: usize) -> Option<usize> {
        self.frontend_slots()
            .contains(&slot)
            .then(|| slot - self.frontend_slots().start)
    }

    /// The ring-pair index of the worker registered in participant slot `slot`.
    pub fn worker_index(&self, slot: usize) -> Option<usize> {
        self.worker_slots()
            .contains(&slot)
            .then(|| slot - self.worker_slots().start)
    }
}

/// A frontend's ends of its ring pair.
#[derive(Debug)]
pub struct FrontendEnds<In: Pod, Out: Pod> {
    /// Admissions and cancels to the scheduler.
    pub to_scheduler: RingProducer<In>,
    /// Outputs and acknowledgements from the scheduler.
    pub from_scheduler: RingConsumer<Out>,
}

impl<In: Pod, Out: Pod> FrontendEnds<In, Out> {
    /// Open frontend `k`'s ends.
    pub fn open(arena: &Arena, k: usize) -> Result<Self, RegionError> {
        Ok(FrontendEnds {
            to_scheduler: arena.producer(&frontend_in(k))?,
            from_scheduler: arena.consumer(&frontend_out(k))?,
        })
    }
}

/// The scheduler's ends of frontend `k`'s ring pair.
#[derive(Debug)]
pub struct SchedulerFrontendEnds<In: Pod, Out: Pod> {
    /// Admissions and cancels from the frontend.
    pub from_frontend: RingConsumer<In>,
    /// Outputs and acknowledgements to the frontend.
    pub to_frontend: RingProducer<Out>,
}

impl<In: Pod, Out: Pod> SchedulerFrontendEnds<In, Out> {
    /// Open the scheduler's ends for frontend `k`.
    pub fn open(arena: &Arena, k: usize) -> Result<Self, RegionError> {
        Ok(SchedulerFrontendEnds {
            from_frontend: arena.consumer(&frontend_in(k))?,
            to_frontend: arena.producer(&frontend_out(k))?,
        })
    }

    /// Reinitialise both rings after the frontend died (drain `from_frontend` first if its
    /// pending messages matter).
    ///
    /// # Safety
    /// The frontend's process must be dead (kernel evidence from
    /// [`crate::ParticipantTable::scan_dead`]) or its ends dropped; see
    /// [`RingConsumer::reset`].
    pub unsafe fn reset(&mut self) {
        // SAFETY: forwarded from the caller.
        unsafe {
            self.from_frontend.reset();
            self.to_frontend.reset();
        }
    }
}

/// A worker's ends of its launch/completion pair.
#[derive(Debug)]
pub struct WorkerEnds<Launch: Pod, Completion: Pod> {
    /// Launch records from the scheduler.
    pub launches: RingConsumer<Launch>,
    /// Completions to the scheduler.
    pub completions: RingProducer<Completion>,
}

impl<Launch: Pod, Completion: Pod> WorkerEnds<Launch, Completion> {
    /// Open worker `w`'s ends.
    pub fn open(arena: &Arena, w: usize) -> Result<Self, RegionError> {
        Ok(WorkerEnds {
            launches: arena.consumer(&launch(w))?,
            completions: arena.producer(&completion(w))?,
        })
    }
}

/// The scheduler's ends of worker `w`'s launch/completion pair.
#[derive(Debug)]
pub struct SchedulerWorkerEnds<Launch: Pod, Completion: Pod> {
    /// Launch records to the worker.
    pub launches: RingProducer<Launch>,
    /// Completions from the worker.
    pub completions: RingConsumer<Completion>,
}

impl<Launch: Pod, Completion: Pod> SchedulerWorkerEnds<Launch, Completion> {
    /// Open the scheduler's ends for worker `w`.
    pub fn open(arena: &Arena, w: usize) -> Result<Self, RegionError> {
        Ok(SchedulerWorkerEnds {
            launches: arena.producer(&launch(w))?,
            completions: arena.consumer(&completion(w))?,
        })
    }

    /// Reinitialise both rings after the worker died.
    ///
    /// # Safety
    /// The worker's process must be dead (kernel evidence) or its ends dropped; see
    /// [`RingConsumer::reset`].
    pub unsafe fn reset(&mut self) {
        // SAFETY: forwarded from the caller.
        unsafe {
            self.launches.reset();
            self.completions.reset();
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::{Role, SlotState};
    use std::time::Duration;

    fn spec() -> ControlPlaneSpec {
        ControlPlaneSpec {
            frontends: 3,
            workers: 1,
            extra_participants: 1,
            frontend_in: RingShape::of::<[u64; 4]>(16),
            frontend_out: RingShape::of::<[u64; 2]>(32),
            launch: RingShape::of::<[u64; 8]>(4),
            completion: RingShape::of::<[u64; 3]>(4),
        }
    }

    #[test]
    fn slot_ranges_partition_the_participant_table() {
        let s = spec();
        assert_eq!(s.participant_slots(), 6);
        assert_eq!(s.scheduler_slots(), 0..1);
        assert_eq!(s.worker_slots(), 1..2);
        assert_eq!(s.frontend_slots(), 2..5);
        assert_eq!(s.extra_slots(), 5..6);
        assert_eq!(s.frontend_index(3), Some(1));
        assert_eq!(s.frontend_index(1), None);
        assert_eq!(s.worker_index(1), Some(0));
    }

    #[test]
    fn one_scheduler_sleep_covers_every_frontend_and_the_completion_ring() {
        let arena = Arena::heap(&spec().layout_spec()).unwrap();
        let bell = arena.doorbell(SCHEDULER_DOORBELL).unwrap();
        let mut sched: Vec<SchedulerFrontendEnds<[u64; 4], [u64; 2]>> = (0..3)
            .map(|k| SchedulerFrontendEnds::open(&arena, k).unwrap())
            .collect();
        let mut sw = SchedulerWorkerEnds::<[u64; 8], [u64; 3]>::open(&arena, 0).unwrap();
        let mut fe = FrontendEnds::<[u64; 4], [u64; 2]>::open(&arena, 2).unwrap();
        let mut we = WorkerEnds::<[u64; 8], [u64; 3]>::open(&arena, 0).unwrap();

        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            fe.to_scheduler.try_push([1, 2, 3, 4]).unwrap();
            std::thread::sleep(Duration::from_millis(20));
            we.completions.try_push([7, 7, 7]).unwrap();
            (fe, we)
        });
        let ready = |s: &Vec<SchedulerFrontendEnds<_, _>>, w: &SchedulerWorkerEnds<_, _>| {
            s.iter().any(|e| e.from_frontend.has_pending()) || w.completions.has_pending()
        };
        assert!(bell.wait_until(Duration::from_secs(20), || ready(&sched, &sw)));
        assert_eq!(sched[2].from_frontend.pop(), Some([1, 2, 3, 4]));
        assert!(bell.wait_until(Duration::from_secs(20), || ready(&sched, &sw)));
        assert_eq!(sw.completions.pop(), Some([7, 7, 7]));
        let (mut fe, _we) = t.join().unwrap();

        sched[2].to_frontend.try_push([5, 6]).unwrap();
        assert_eq!(
            fe.from_scheduler.wait_pop(Duration::from_secs(5)),
            Some([5, 6])
        );
        sw.launches.try_push([0; 8]).unwrap();
    }

    #[test]
    fn a_dead_frontends_slot_and_rings_are_reclaimed_for_the_next_frontend() {
        let s = spec();
        let arena = Arena::heap(&s.layout_spec()).unwrap();
        let table = arena.participants(PARTICIPANTS).unwrap();
        let reg = table
            .register_in(Role::Frontend, s.frontend_slots())
            .unwrap();
        let k = s.frontend_index(reg.slot()).unwrap();
        let mut sched = SchedulerFrontendEnds::<[u64; 4], [u64; 2]>::open(&arena, k).unwrap();
        let mut fe = FrontendEnds::<[u64; 4], [u64; 2]>::open(&arena, k).unwrap();
        fe.to_scheduler.try_push([9; 4]).unwrap();
        // The frontend dies: its ends and its registration vanish without cleanup.
        std::mem::forget(fe);
        reg.abandon();

        let dead = table.scan_dead();
        assert_eq!(dead.len(), 1);
        assert_eq!(s.frontend_index(dead[0].slot), Some(k));
        // SAFETY: the frontend is dead (its lock is released) and its ends are gone.
        unsafe { sched.reset() };
        table.reclaim(dead[0].slot, dead[0].generation).unwrap();

        let reg = table
            .register_in(Role::Frontend, s.frontend_slots())
            .unwrap();
        assert_eq!(reg.slot(), dead[0].slot);
        assert_eq!(reg.generation(), dead[0].generation + 1);
        let mut fe = FrontendEnds::<[u64; 4], [u64; 2]>::open(&arena, k).unwrap();
        assert_eq!(
            sched.from_frontend.pop(),
            None,
            "the dead frontend's message is gone"
        );
        fe.to_scheduler.try_push([1; 4]).unwrap();
        assert_eq!(sched.from_frontend.pop(), Some([1; 4]));
        assert_eq!(table.info(reg.slot()).unwrap().state, SlotState::Live);
    }
}
