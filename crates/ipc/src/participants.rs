//! The participant table: who is attached to the control segment, and who has died.
//!
//! Contract: a slot's state and generation live in one atomic word, so every transition is a
//! single compare-and-swap that also checks the generation: `Free(g) -> Registering(g+1) ->
//! Live(g+1) -> Exited | Dead -> Free(g+1)`. A process takes the slot's liveness lock *before* it
//! claims the slot and holds it for its whole life; the kernel drops the lock when it dies. A
//! slot is declared `Dead` only on that kernel evidence (the lock is free while the slot says
//! `Registering` or `Live`), never on a timeout; hung processes are reported separately, by
//! heartbeat age, for a supervisor to kill. A slot goes back to `Free` only through
//! [`ParticipantTable::reclaim`] with the generation the caller saw, so a stale reference to a
//! slot that was reclaimed and reused is refused instead of freeing the new owner.
//!
//! Each slot also carries `released`: the launch sequence number up to which this participant
//! (a consumer of pages, DESIGN.md section 4) is done. It is only meaningful while `Live`.

use crate::arena::{ArenaInner, LockGuard};
use crate::sync::{fence, AtomicU32, AtomicU64, CachePadded, Ordering};
use std::ops::Range;
use std::ptr::NonNull;
use std::sync::Arc;

/// The life-cycle state of a participant slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum SlotState {
    /// Unowned; can be registered.
    Free = 0,
    /// Claimed by a process that is filling in its identity.
    Registering = 1,
    /// Owned by a running process.
    Live = 2,
    /// Its owner left cleanly; waiting for [`ParticipantTable::reclaim`].
    Exited = 3,
    /// Its owner died (kernel evidence); waiting for [`ParticipantTable::reclaim`].
    Dead = 4,
}

impl SlotState {
    fn from_bits(b: u8) -> Option<SlotState> {
        Some(match b {
            0 => SlotState::Free,
            1 => SlotState::Registering,
            2 => SlotState::Live,
            3 => SlotState::Exited,
            4 => SlotState::Dead,
            _ => return None,
        })
    }
}

/// What a participant does. Stored as a `u32`: 1, 2, 3 for the named roles, anything else as
/// [`Role::Other`] (0 means "no role" in a free slot).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// The scheduler daemon.
    Scheduler,
    /// A GPU worker daemon.
    Worker,
    /// An HTTP frontend.
    Frontend,
    /// Anything else (a KV transfer agent, a debug reader, a test). Use codes >= 16.
    Other(u32),
}

impl Role {
    /// The stored code.
    pub fn to_u32(self) -> u32 {
        match self {
            Role::Scheduler => 1,
            Role::Worker => 2,
            Role::Frontend => 3,
            Role::Other(x) => x,
        }
    }

    /// The role stored as `code`.
    pub fn from_u32(code: u32) -> Role {
        match code {
            1 => Role::Scheduler,
            2 => Role::Worker,
            3 => Role::Frontend,
            x => Role::Other(x),
        }
    }
}

/// One participant slot in shared memory. `#[repr(C)]`, all atomics, one per cache-line pair.
#[repr(C)]
pub(crate) struct Slot {
    /// `generation << 8 | state`.
    word: AtomicU64,
    role: AtomicU32,
    pid: AtomicU32,
    /// `/proc/<pid>/stat` field 22 of the owner.
    start_time: AtomicU64,
    /// `CLOCK_MONOTONIC` milliseconds of the owner's last heartbeat.
    heartbeat_ms: AtomicU64,
    /// Launch sequence number up to which the owner has released pages.
    released: AtomicU64,
}

const _: () = assert!(!std::mem::needs_drop::<CachePadded<Slot>>());

const STATE_BITS: u32 = 8;

fn pack(generation: u64, state: SlotState) -> u64 {
    (generation << STATE_BITS) | state as u64
}

fn unpack(word: u64) -> (u64, Option<SlotState>) {
    (word >> STATE_BITS, SlotState::from_bits(word as u8))
}

/// Bytes of a table of `slots` slots.
pub(crate) fn region_size(slots: usize) -> Option<usize> {
    slots.checked_mul(std::mem::size_of::<CachePadded<Slot>>())
}

/// Construct `slots` free slots (generation 0) in place.
///
/// # Safety
/// `region` must point to `region_size(slots)` writable bytes aligned to 128, unshared.
pub(crate) unsafe fn init(region: *mut u8, slots: usize) {
    let p = region.cast::<CachePadded<Slot>>();
    for i in 0..slots {
        let slot = CachePadded::new(Slot {
            word: AtomicU64::new(pack(0, SlotState::Free)),
            role: AtomicU32::new(0),
            pid: AtomicU32::new(0),
            start_time: AtomicU64::new(0),
            heartbeat_ms: AtomicU64::new(0),
            released: AtomicU64::new(0),
        });
        // SAFETY: slot `i` is inside the region (caller), aligned (CachePadded is 128-aligned
        // and the region is), and unshared.
        unsafe { std::ptr::write(p.add(i), slot) };
    }
}

/// A consistent snapshot of one slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ParticipantInfo {
    /// Slot index.
    pub slot: usize,
    /// Bumped every time the slot is registered.
    pub generation: u64,
    /// Life-cycle state.
    pub state: SlotState,
    /// What the owner does.
    pub role: Role,
    /// Owner's pid.
    pub pid: u32,
    /// Owner's start time (clock ticks since boot, `/proc/<pid>/stat` field 22).
    pub start_time: u64,
    /// Owner's last heartbeat, `CLOCK_MONOTONIC` ms.
    pub heartbeat_ms: u64,
    /// Owner's released launch sequence number.
    pub released: u64,
}

/// A slot whose owner is gone and which awaits [`ParticipantTable::reclaim`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeadParticipant {
    /// Slot index.
    pub slot: usize,
    /// The generation the dead owner had; pass it to `reclaim`.
    pub generation: u64,
    /// What it did.
    pub role: Role,
    /// Its pid.
    pub pid: u32,
    /// True if it left cleanly ([`SlotState::Exited`]), false if it died.
    pub exited: bool,
}

/// Errors from registering.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegisterError {
    /// Every slot in the range is taken (or its previous owner is not reclaimed yet).
    #[error("no free participant slot in {range:?} for {role:?}")]
    Full {
        /// The role asked for.
        role: Role,
        /// The slots searched.
        range: Range<usize>,
    },
    /// The range is empty or past the end of the table.
    #[error("slot range {range:?} is not inside the table of {len} slots")]
    BadRange {
        /// The range given.
        range: Range<usize>,
        /// Slots in the table.
        len: usize,
    },
}

/// Errors from [`ParticipantTable::reclaim`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReclaimError {
    /// The slot is not at the generation the caller named: it was reclaimed (and perhaps
    /// reused) since. The caller's reference is stale.
    #[error(
        "participant slot {slot}: stale generation {expected}, slot is at {found} ({state:?})"
    )]
    Stale {
        /// Slot index.
        slot: usize,
        /// The generation the caller gave.
        expected: u64,
        /// The slot's generation now.
        found: u64,
        /// The slot's state now.
        state: SlotState,
    },
    /// The owner still holds its liveness lock.
    #[error("participant slot {slot} generation {generation} is alive (pid {pid})")]
    Alive {
        /// Slot index.
        slot: usize,
        /// Its generation.
        generation: u64,
        /// The owner's pid.
        pid: u32,
    },
    /// Nothing to reclaim: the slot is already free at that generation.
    #[error("participant slot {slot} is already free")]
    AlreadyFree {
        /// Slot index.
        slot: usize,
    },
    /// No such slot.
    #[error("participant slot {slot} is out of range ({len} slots)")]
    OutOfRange {
        /// Slot index.
        slot: usize,
        /// Slots in the table.
        len: usize,
    },
}

/// A view of a participant table region. Cheap to clone; keeps the arena mapped.
#[derive(Clone)]
pub struct ParticipantTable {
    arena: Arc<ArenaInner>,
    slots: NonNull<CachePadded<Slot>>,
    len: usize,
    lock_base: usize,
}

// SAFETY: slots are atomics only; the pointer stays valid while `arena` lives.
unsafe impl Send for ParticipantTable {}
// SAFETY: as above.
unsafe impl Sync for ParticipantTable {}

impl std::fmt::Debug for ParticipantTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParticipantTable")
            .field("len", &self.len)
            .field("slots", &self.snapshot())
            .finish()
    }
}

impl ParticipantTable {
    pub(crate) fn new(
        arena: Arc<ArenaInner>,
        offset: usize,
        len: usize,
        lock_base: usize,
    ) -> ParticipantTable {
        // SAFETY: the layout put `len` slots at `offset`, inside the mapping; non-null because
        // the base is.
        let slots = unsafe { NonNull::new_unchecked(arena.base().add(offset).cast()) };
        ParticipantTable {
            arena,
            slots,
            len,
            lock_base,
        }
    }

    fn slot(&self, i: usize) -> &Slot {
        assert!(i < self.len);
        // SAFETY: `i < len` slots were initialised in place; mapped while `arena` lives.
        unsafe { &*self.slots.as_ptr().add(i) }
    }

    /// Slots in the table.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True if the table has no slots (never, for a table from a layout).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Register this process in any free slot.
    pub fn register(&self, role: Role) -> Result<Registration, RegisterError> {
        self.register_in(role, 0..self.len)
    }

    /// Register this process in the first free slot of `range` (e.g. the frontend slots of a
    /// control plane). The slot's generation is bumped; its liveness lock is held until the
    /// returned [`Registration`] is dropped (or the process dies).
    pub fn register_in(
        &self,
        role: Role,
        range: Range<usize>,
    ) -> Result<Registration, RegisterError> {
        let (slot, generation, lock) = self.claim(role, range)?;
        self.slot(slot)
            .word
            .store(pack(generation, SlotState::Live), Ordering::Release);
        Ok(Registration {
            table: self.clone(),
            slot,
            generation,
            lock: Some(lock),
        })
    }

    /// Take the lock and the slot, fill in the identity; leaves the slot `Registering`.
    fn claim(
        &self,
        role: Role,
        range: Range<usize>,
    ) -> Result<(usize, u64, LockGuard), RegisterError> {
        if range.start >= range.end || range.end > self.len {
            return Err(RegisterError::BadRange {
                range,
                len: self.len,
            });
        }
        let pid = std::process::id();
        #[cfg(not(loom))]
        let start_time = crate::process::start_time(pid).unwrap_or(0);
        #[cfg(loom)]
        let start_time = 0;
        for i in range.clone() {
            let s = self.slot(i);
            let w = s.word.load(Ordering::Acquire);
            let (gen, state) = unpack(w);
            if state != Some(SlotState::Free) {
                continue;
            }
            // Lock first: whoever sees this slot non-free knows its owner took the lock before.
            let Some(lock) = self.arena.try_lock(self.lock_base + i) else {
                continue;
            };
            let generation = gen + 1;
            if s.word
                .compare_exchange(
                    w,
                    pack(generation, SlotState::Registering),
                    Ordering::AcqRel,
                    Ordering::Relaxed,
                )
                .is_err()
            {
                continue; // drops the lock
            }
            // Seqlock writer: readers that see any field below also see the state change.
            fence(Ordering::Release);
            s.role.store(role.to_u32(), Ordering::Relaxed);
            s.pid.store(pid, Ordering::Relaxed);
            s.start_time.store(start_time, Ordering::Relaxed);
            s.heartbeat_ms
                .store(crate::process::monotonic_ms(), Ordering::Relaxed);
            s.released.store(0, Ordering::Relaxed);
            return Ok((i, generation, lock));
        }
        Err(RegisterError::Full { role, range })
    }

    /// Fault injection: claim a slot, then die while still `Registering` (the lock is released
    /// as the kernel would). Returns the slot and generation. For crash tests and loom models.
    #[doc(hidden)]
    pub fn register_then_die_while_registering(
        &self,
        role: Role,
    ) -> Result<(usize, u64), RegisterError> {
        let (slot, generation, lock) = self.claim(role, 0..self.len)?;
        drop(lock);
        Ok((slot, generation))
    }

    /// A consistent snapshot of slot `slot`, or `None` if out of range.
    pub fn info(&self, slot: usize) -> Option<ParticipantInfo> {
        if slot >= self.len {
            return None;
        }
        let s = self.slot(slot);
        loop {
            let w1 = s.word.load(Ordering::Acquire);
            let info = (
                s.role.load(Ordering::Relaxed),
                s.pid.load(Ordering::Relaxed),
                s.start_time.load(Ordering::Relaxed),
                s.heartbeat_ms.load(Ordering::Relaxed),
                s.released.load(Ordering::Relaxed),
            );
            // Seqlock reader: if a field came from a newer registration, w2 shows it.
            fence(Ordering::Acquire);
            let w2 = s.word.load(Ordering::Relaxed);
            if w1 != w2 {
                crate::sync::spin_loop();
                continue;
            }
            let (generation, state) = unpack(w1);
            return Some(ParticipantInfo {
                slot,
                generation,
                // An unknown state byte can only come from a foreign writer; show it as Dead so
                // that it gets reclaimed rather than trusted.
                state: state.unwrap_or(SlotState::Dead),
                role: Role::from_u32(info.0),
                pid: info.1,
                start_time: info.2,
                heartbeat_ms: info.3,
                released: info.4,
            });
        }
    }

    /// Snapshots of every slot that is not free.
    pub fn snapshot(&self) -> Vec<ParticipantInfo> {
        (0..self.len)
            .filter_map(|i| self.info(i))
            .filter(|p| p.state != SlotState::Free)
            .collect()
    }

    /// Every slot whose owner is gone: slots already `Dead` or `Exited`, plus `Registering` or
    /// `Live` slots whose liveness lock the kernel has released (these are marked `Dead` now).
    /// Each stays in the result until [`reclaim`](Self::reclaim)ed. Never takes a lock.
    pub fn scan_dead(&self) -> Vec<DeadParticipant> {
        let mut dead = Vec::new();
        for i in 0..self.len {
            let s = self.slot(i);
            let w = s.word.load(Ordering::Acquire);
            let (generation, state) = unpack(w);
            let exited = match state {
                Some(SlotState::Free) => continue,
                Some(SlotState::Exited) => true,
                Some(SlotState::Dead) | None => false,
                Some(SlotState::Registering | SlotState::Live) => {
                    // The owner of `generation` took the lock before its claim, which we
                    // observed (Acquire), so a free lock now means it released it: it died.
                    if self.arena.lock_held(self.lock_base + i) {
                        continue;
                    }
                    if s.word
                        .compare_exchange(
                            w,
                            pack(generation, SlotState::Dead),
                            Ordering::AcqRel,
                            Ordering::Relaxed,
                        )
                        .is_err()
                    {
                        continue; // it changed (exited, or was reclaimed): next scan sees it
                    }
                    false
                }
            };
            let info = self.info(i).filter(|p| p.generation == generation);
            dead.push(DeadParticipant {
                slot: i,
                generation,
                role: info.map_or(Role::Other(0), |p| p.role),
                pid: info.map_or(0, |p| p.pid),
                exited,
            });
        }
        dead
    }

    /// `Live` slots whose owner still holds its lock but whose heartbeat is more than
    /// `max_age_ms` older than `now_ms` (use [`crate::process::monotonic_ms`]): hung, not dead.
    /// A supervisor kills them; cleanup then waits for [`scan_dead`](Self::scan_dead).
    pub fn scan_hung(&self, now_ms: u64, max_age_ms: u64) -> Vec<ParticipantInfo> {
        (0..self.len)
            .filter_map(|i| self.info(i))
            .filter(|p| p.state == SlotState::Live)
            .filter(|p| now_ms.saturating_sub(p.heartbeat_ms) > max_age_ms)
            .filter(|p| self.arena.lock_held(self.lock_base + p.slot))
            .collect()
    }

    /// Free slot `slot` if it is still at `generation` and its owner is gone (`Dead`,
    /// `Exited`, or `Live`/`Registering` with its lock released). The caller must have finished
    /// its own cleanup for that owner first (rings reset, requests cancelled): the slot can be
    /// registered again as soon as this returns.
    pub fn reclaim(&self, slot: usize, generation: u64) -> Result<(), ReclaimError> {
        if slot >= self.len {
            return Err(ReclaimError::OutOfRange {
                slot,
                len: self.len,
            });
        }
        let s = self.slot(slot);
        let w = s.word.load(Ordering::Acquire);
        let (found, state) = unpack(w);
        let state = state.unwrap_or(SlotState::Dead);
        if found != generation {
            return Err(ReclaimError::Stale {
                slot,
                expected: generation,
                found,
                state,
            });
        }
        match state {
            SlotState::Free => return Err(ReclaimError::AlreadyFree { slot }),
            SlotState::Registering | SlotState::Live
                if self.arena.lock_held(self.lock_base + slot) =>
            {
                return Err(ReclaimError::Alive {
                    slot,
                    generation,
                    pid: s.pid.load(Ordering::Relaxed),
                });
            }
            _ => {}
        }
        s.word
            .compare_exchange(
                w,
                pack(generation, SlotState::Free),
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .map(|_| ())
            .map_err(|now| {
                let (found, state) = unpack(now);
                ReclaimError::Stale {
                    slot,
                    expected: generation,
                    found,
                    state: state.unwrap_or(SlotState::Dead),
                }
            })
    }

    /// True if `slot` is `Live` at `generation`: a reference taken earlier is still good.
    pub fn is_current(&self, slot: usize, generation: u64) -> bool {
        slot < self.len
            && self.slot(slot).word.load(Ordering::Acquire) == pack(generation, SlotState::Live)
    }

    /// The `released` counter of slot `slot` (any state; only meaningful while `Live`).
    pub fn released(&self, slot: usize) -> Option<&AtomicU64> {
        (slot < self.len).then(|| &self.slot(slot).released)
    }

    /// The minimum `released` over `Live` slots of `role`, or `None` if there are none. A
    /// participant that died keeps counting until [`scan_dead`](Self::scan_dead) has the kernel
    /// evidence, so this never runs ahead of a consumer that might still be working.
    pub fn min_released(&self, role: Role) -> Option<u64> {
        (0..self.len)
            .filter_map(|i| self.info(i))
            .filter(|p| p.state == SlotState::Live && p.role == role)
            .map(|p| p.released)
            .min()
    }
}

/// This process's registration in a participant table. Dropping it leaves cleanly (the slot
/// becomes `Exited` and then the lock is released).
pub struct Registration {
    table: ParticipantTable,
    slot: usize,
    generation: u64,
    lock: Option<LockGuard>,
}

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration")
            .field("slot", &self.slot)
            .field("generation", &self.generation)
            .finish()
    }
}

impl Registration {
    /// The slot index.
    pub fn slot(&self) -> usize {
        self.slot
    }

    /// The slot's generation for this registration.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    fn s(&self) -> &Slot {
        self.table.slot(self.slot)
    }

    /// Record a heartbeat now (`CLOCK_MONOTONIC` ms).
    pub fn heartbeat(&self) {
        self.heartbeat_at(crate::process::monotonic_ms());
    }

    /// Record a heartbeat at `now_ms`.
    pub fn heartbeat_at(&self, now_ms: u64) {
        self.s().heartbeat_ms.store(now_ms, Ordering::Relaxed);
    }

    /// Publish that every launch `<= seq` is finished for this participant (`Release`, and
    /// never moves backwards).
    pub fn set_released(&self, seq: u64) {
        self.s().released.fetch_max(seq, Ordering::Release);
    }

    /// The published `released` value.
    pub fn released(&self) -> u64 {
        self.s().released.load(Ordering::Acquire)
    }

    /// Leave cleanly: the slot becomes `Exited` (to be reclaimed), then the lock is released.
    pub fn leave(self) {
        drop(self);
    }

    /// Release the liveness lock without marking the slot `Exited`: exactly what the kernel does
    /// when the process dies here. For crash tests and loom models.
    pub fn abandon(mut self) {
        self.lock = None;
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Some(lock) = self.lock.take() {
            let _ = self.s().word.compare_exchange(
                pack(self.generation, SlotState::Live),
                pack(self.generation, SlotState::Exited),
                Ordering::AcqRel,
                Ordering::Relaxed,
            );
            drop(lock);
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::{Arena, LayoutSpec};

    fn table(n: usize) -> ParticipantTable {
        Arena::heap(&LayoutSpec::new().participants("p", n))
            .unwrap()
            .participants("p")
            .unwrap()
    }

    #[test]
    fn registration_fills_the_slot_and_bumps_the_generation_on_every_reuse() {
        let t = table(2);
        let r = t.register(Role::Worker).unwrap();
        assert_eq!((r.slot(), r.generation()), (0, 1));
        let info = t.info(0).unwrap();
        assert_eq!(info.state, SlotState::Live);
        assert_eq!(info.role, Role::Worker);
        assert_eq!(info.pid, std::process::id());
        assert_eq!(
            info.start_time,
            crate::process::start_time(std::process::id()).unwrap()
        );
        assert!(t.is_current(0, 1));
        r.leave();
        assert_eq!(t.info(0).unwrap().state, SlotState::Exited);
        assert!(!t.is_current(0, 1));
        let dead = t.scan_dead();
        assert_eq!(dead.len(), 1);
        assert!(dead[0].exited);
        t.reclaim(0, 1).unwrap();
        let r = t.register(Role::Frontend).unwrap();
        assert_eq!((r.slot(), r.generation()), (0, 2));
    }

    #[test]
    fn a_slot_is_declared_dead_only_after_its_lock_is_released() {
        let t = table(3);
        let a = t.register(Role::Frontend).unwrap();
        let b = t.register(Role::Frontend).unwrap();
        assert!(t.scan_dead().is_empty());
        assert!(matches!(
            t.reclaim(a.slot(), a.generation()),
            Err(ReclaimError::Alive { .. })
        ));
        let (slot, generation) = (b.slot(), b.generation());
        b.abandon();
        let dead = t.scan_dead();
        assert_eq!(
            dead,
            vec![DeadParticipant {
                slot,
                generation,
                role: Role::Frontend,
                pid: std::process::id(),
                exited: false
            }]
        );
        assert_eq!(t.info(slot).unwrap().state, SlotState::Dead);
        assert_eq!(t.scan_dead(), dead, "reported until reclaimed");
        t.reclaim(slot, generation).unwrap();
        assert!(t.scan_dead().is_empty());
        drop(a);
    }

    #[test]
    fn a_stale_generation_cannot_reclaim_a_reused_slot() {
        let t = table(1);
        let r = t.register(Role::Worker).unwrap();
        let old = (r.slot(), r.generation());
        r.abandon();
        assert_eq!(t.scan_dead().len(), 1);
        t.reclaim(old.0, old.1).unwrap();
        let new = t.register(Role::Worker).unwrap();
        assert_eq!(new.generation(), old.1 + 1);
        assert_eq!(
            t.reclaim(old.0, old.1),
            Err(ReclaimError::Stale {
                slot: 0,
                expected: 1,
                found: 2,
                state: SlotState::Live
            })
        );
        assert!(t.is_current(0, 2));
        assert!(matches!(
            t.reclaim(5, 1),
            Err(ReclaimError::OutOfRange { .. })
        ));
    }

    #[test]
    fn a_process_that_dies_while_registering_is_detected() {
        let t = table(2);
        let (slot, generation) = t.register_then_die_while_registering(Role::Worker).unwrap();
        assert_eq!(t.info(slot).unwrap().state, SlotState::Registering);
        let dead = t.scan_dead();
        assert_eq!(dead.len(), 1);
        assert_eq!((dead[0].slot, dead[0].generation), (slot, generation));
        t.reclaim(slot, generation).unwrap();
    }

    #[test]
    fn a_full_table_or_range_refuses_registration() {
        let t = table(3);
        let _a = t.register_in(Role::Scheduler, 0..1).unwrap();
        assert!(matches!(
            t.register_in(Role::Scheduler, 0..1),
            Err(RegisterError::Full { .. })
        ));
        let b = t.register_in(Role::Frontend, 1..3).unwrap();
        assert_eq!(b.slot(), 1);
        let _c = t.register(Role::Frontend).unwrap();
        assert!(t.register(Role::Other(99)).is_err());
        assert!(matches!(
            t.register_in(Role::Worker, 2..9),
            Err(RegisterError::BadRange { .. })
        ));
        assert!(matches!(
            t.register_in(Role::Worker, 1..1),
            Err(RegisterError::BadRange { .. })
        ));
    }

    #[test]
    fn hung_participants_are_reported_separately_from_dead_ones() {
        let t = table(3);
        let a = t.register(Role::Worker).unwrap();
        let b = t.register(Role::Frontend).unwrap();
        let c = t.register(Role::Frontend).unwrap();
        a.heartbeat_at(1_000);
        b.heartbeat_at(9_500);
        c.heartbeat_at(1_000);
        let c_slot = c.slot();
        c.abandon();
        let hung = t.scan_hung(10_000, 2_000);
        assert_eq!(hung.len(), 1);
        assert_eq!(hung[0].slot, a.slot());
        assert_eq!(t.scan_dead().len(), 1);
        assert_eq!(t.scan_dead()[0].slot, c_slot);
        drop(b);
    }

    #[test]
    fn min_released_counts_live_consumers_of_a_role_only() {
        let t = table(4);
        assert_eq!(t.min_released(Role::Worker), None);
        let a = t.register(Role::Worker).unwrap();
        let b = t.register(Role::Worker).unwrap();
        let f = t.register(Role::Frontend).unwrap();
        a.set_released(10);
        b.set_released(7);
        b.set_released(5); // never moves back
        f.set_released(1);
        assert_eq!(b.released(), 7);
        assert_eq!(t.min_released(Role::Worker), Some(7));
        b.abandon();
        // Still counted until the death is established by a scan.
        assert_eq!(t.min_released(Role::Worker), Some(7));
        t.scan_dead();
        assert_eq!(t.min_released(Role::Worker), Some(10));
        assert_eq!(t.released(a.slot()).unwrap().load(Ordering::Relaxed), 10);
        drop((a, f));
    }

    #[test]
    fn role_codes_round_trip() {
        for r in [
            Role::Scheduler,
            Role::Worker,
            Role::Frontend,
            Role::Other(77),
        ] {
            assert_eq!(Role::from_u32(r.to_u32()), r);
        }
    }
}
