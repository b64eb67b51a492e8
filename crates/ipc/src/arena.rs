//! Arenas: a block of memory laid out by a [`Layout`], shared by every handle made from it.
//!
//! Contract: an arena's memory (a `MAP_SHARED` mapping of the control segment, or a heap
//! allocation standing in for it in one process and under loom) holds only `#[repr(C)]` plain
//! data and atomics, constructed in place once by the creator and located by layout offsets.
//! Every typed view ([`RingProducer`], [`ParticipantTable`], ...) holds an `Arc` to the arena, so
//! the memory stays mapped for as long as any view exists.

use crate::doorbell::Doorbell;
use crate::layout::{Layout, LayoutError, LayoutSpec, Region, RegionKind};
use crate::participants::{self, ParticipantTable};
use crate::ring::{self, RingConsumer, RingProducer, Side};
use crate::sync::{AtomicU32, AtomicU64, CachePadded, Ordering};
use bytemuck::Pod;
use std::ptr::NonNull;
use std::sync::Arc;

/// Errors from opening a typed view of a region.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegionError {
    /// No region has that name.
    #[error("region {name:?} is not in the layout")]
    NotFound {
        /// The name asked for.
        name: String,
    },
    /// The region exists but holds something else.
    #[error("region {name:?} is a {found}, not a {expected}")]
    WrongKind {
        /// The region.
        name: String,
        /// What the caller asked for.
        expected: &'static str,
        /// What the layout has.
        found: &'static str,
    },
    /// The slot type does not match the ring's slot size (or its alignment does not divide it).
    #[error(
        "ring {name:?} has {slot_size}-byte slots; {type_name} is {type_size} bytes, align {type_align}"
    )]
    SlotType {
        /// The ring.
        name: String,
        /// Bytes per slot in the layout.
        slot_size: usize,
        /// The Rust type asked for.
        type_name: &'static str,
        /// Its size in bytes.
        type_size: usize,
        /// Its alignment in bytes.
        type_align: usize,
    },
    /// The ring's side is already open (in this or another process).
    #[error("ring {name:?}: the {side} end is already open in pid {pid}")]
    Claimed {
        /// The ring.
        name: String,
        /// Which end.
        side: Side,
        /// The process holding it.
        pid: u32,
    },
    /// The in-segment metadata disagrees with the layout.
    #[error("region {name:?} is corrupt: {what}")]
    Corrupt {
        /// The region.
        name: String,
        /// What disagreed.
        what: String,
    },
}

enum Backing {
    /// A heap allocation; liveness locks are simulated with atomics.
    Heap {
        alloc: std::alloc::Layout,
        locks: Box<[AtomicU32]>,
    },
    /// A `MAP_SHARED` mapping of the segment file; liveness locks are OFD locks on `fd`.
    #[cfg(not(loom))]
    Shm { fd: std::os::fd::OwnedFd },
}

pub(crate) struct ArenaInner {
    base: NonNull<u8>,
    len: usize,
    layout: Layout,
    backing: Backing,
}

// SAFETY: the memory is only accessed through atomics, or through slots whose exclusive
// ownership the ring protocol hands between threads with Release/Acquire; the raw base pointer
// itself is never mutated.
unsafe impl Send for ArenaInner {}
// SAFETY: as above.
unsafe impl Sync for ArenaInner {}

impl Drop for ArenaInner {
    fn drop(&mut self) {
        match &self.backing {
            Backing::Heap { alloc, .. } => {
                // SAFETY: allocated in `Arena::heap` with exactly this layout; no view is left
                // (each holds an `Arc` to us). The in-place types have no drop glue (asserted
                // where they are defined), so freeing the bytes is enough.
                unsafe { std::alloc::dealloc(self.base.as_ptr(), *alloc) }
            }
            #[cfg(not(loom))]
            Backing::Shm { .. } => {
                // SAFETY: `base..base+len` is the mapping made in `Arena::from_mapping`; no view
                // is left. Closing `fd` (next) drops this process's OFD locks on it.
                let _ = unsafe { nix::sys::mman::munmap(self.base.cast(), self.len) };
            }
        }
    }
}

impl ArenaInner {
    pub(crate) fn base(&self) -> *mut u8 {
        self.base.as_ptr()
    }

    pub(crate) fn region(&self, name: &str) -> Result<&Region, RegionError> {
        self.layout
            .region(name)
            .ok_or_else(|| RegionError::NotFound {
                name: name.to_owned(),
            })
    }

    /// The doorbell at absolute `offset`, bounds- and alignment-checked.
    pub(crate) fn doorbell_at(
        &self,
        offset: usize,
        ring: &str,
    ) -> Result<NonNull<Doorbell>, RegionError> {
        let end = offset.checked_add(std::mem::size_of::<Doorbell>());
        if end.is_none_or(|e| e > self.len)
            || !offset.is_multiple_of(std::mem::align_of::<Doorbell>())
        {
            return Err(RegionError::Corrupt {
                name: ring.to_owned(),
                what: format!("doorbell offset {offset} is outside the segment"),
            });
        }
        // SAFETY: in bounds (checked above) and non-null (base is non-null). The layout put
        // either a ring header (whose doorbell field is at this offset) or a doorbell region here.
        Ok(unsafe { NonNull::new_unchecked(self.base().add(offset).cast()) })
    }

    /// Try to take liveness lock `index` for the caller's lifetime.
    pub(crate) fn try_lock(self: &Arc<Self>, index: usize) -> Option<LockGuard> {
        match &self.backing {
            Backing::Heap { locks, .. } => {
                let lock = locks.get(index)?;
                lock.compare_exchange(0, 1, Ordering::AcqRel, Ordering::Acquire)
                    .ok()?;
                Some(LockGuard::Sim {
                    arena: self.clone(),
                    index,
                })
            }
            #[cfg(not(loom))]
            Backing::Shm { fd } => {
                use std::os::fd::AsFd;
                // A fresh open file description, so this lock is independent of every other
                // lock this process holds and of the checker's descriptor.
                let own = crate::liveness::reopen(fd.as_fd()).ok()?;
                match crate::liveness::try_lock(own.as_fd(), index) {
                    Ok(true) => Some(LockGuard::Ofd(own)),
                    _ => None,
                }
            }
        }
    }

    /// Whether liveness lock `index` is held by a live holder. Errors count as "held": death is
    /// only ever decided on positive evidence.
    pub(crate) fn lock_held(&self, index: usize) -> bool {
        match &self.backing {
            Backing::Heap { locks, .. } => locks
                .get(index)
                .is_none_or(|l| l.load(Ordering::Acquire) != 0),
            #[cfg(not(loom))]
            Backing::Shm { fd } => {
                use std::os::fd::AsFd;
                crate::liveness::held_by_other(fd.as_fd(), index).unwrap_or(true)
            }
        }
    }

    #[cfg(all(test, not(loom)))]
    pub(crate) fn fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        use std::os::fd::AsFd;
        match &self.backing {
            Backing::Shm { fd } => Some(fd.as_fd()),
            Backing::Heap { .. } => None,
        }
    }
}

/// A held liveness lock. Dropping it releases the lock, exactly as the kernel does when the
/// holding process dies.
pub(crate) enum LockGuard {
    Sim {
        arena: Arc<ArenaInner>,
        index: usize,
    },
    #[cfg(not(loom))]
    Ofd(#[allow(dead_code)] std::os::fd::OwnedFd),
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        match self {
            LockGuard::Sim { arena, index } => match &arena.backing {
                Backing::Heap { locks, .. } => locks[*index].store(0, Ordering::Release),
                #[cfg(not(loom))]
                Backing::Shm { .. } => {}
            },
            #[cfg(not(loom))]
            LockGuard::Ofd(_) => {} // closing the descriptor releases the OFD lock
        }
    }
}

/// Memory laid out by a [`Layout`]: the common core of a [`crate::Segment`] and of a heap
/// stand-in for one. Cheap to clone (an `Arc`); `Send + Sync`.
#[derive(Clone)]
pub struct Arena {
    inner: Arc<ArenaInner>,
}

impl std::fmt::Debug for Arena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Arena")
            .field("len", &self.inner.len)
            .field("layout", &self.inner.layout)
            .finish()
    }
}

impl Arena {
    /// An arena in a zeroed heap allocation, laid out and initialised like a segment, with
    /// simulated liveness locks (a lock is held until its [`crate::Registration`] is dropped or
    /// abandoned). For the in-process path, tests and loom models.
    pub fn heap(spec: &LayoutSpec) -> Result<Arena, LayoutError> {
        let layout = spec.layout()?;
        let alloc = std::alloc::Layout::from_size_align(layout.size(), crate::layout::HEADER_SIZE)
            .map_err(|_| LayoutError::Overflow)?;
        // SAFETY: `alloc` has non-zero size (at least the header page).
        let ptr = unsafe { std::alloc::alloc_zeroed(alloc) };
        let Some(base) = NonNull::new(ptr) else {
            std::alloc::handle_alloc_error(alloc);
        };
        // SAFETY: fresh, zeroed, page-aligned allocation of `layout.size()` bytes, unshared.
        unsafe { init_regions(base.as_ptr(), &layout) };
        let locks = (0..layout.lock_count())
            .map(|_| AtomicU32::new(0))
            .collect();
        Ok(Arena {
            inner: Arc::new(ArenaInner {
                base,
                len: layout.size(),
                layout,
                backing: Backing::Heap { alloc, locks },
            }),
        })
    }

    /// Wrap an existing shared mapping.
    ///
    /// # Safety
    /// `base..base+len` must be a live `MAP_SHARED` mapping of `fd` that this arena now owns
    /// (it is unmapped on drop), `len >= layout.size()`, and the regions must have been
    /// initialised by [`init_regions`] (by this or another process).
    #[cfg(not(loom))]
    pub(crate) unsafe fn from_mapping(
        base: NonNull<u8>,
        len: usize,
        layout: Layout,
        fd: std::os::fd::OwnedFd,
    ) -> Arena {
        Arena {
            inner: Arc::new(ArenaInner {
                base,
                len,
                layout,
                backing: Backing::Shm { fd },
            }),
        }
    }

    pub(crate) fn inner(&self) -> &Arc<ArenaInner> {
        &self.inner
    }

    /// The layout this arena was built from.
    pub fn layout(&self) -> &Layout {
        &self.inner.layout
    }

    /// Open the writing end of ring `name`, whose slots must be exactly `T`-sized.
    /// Fails with [`RegionError::Claimed`] while another producer end is open anywhere.
    pub fn producer<T: Pod>(&self, name: &str) -> Result<RingProducer<T>, RegionError> {
        RingProducer::open(self, name)
    }

    /// Open the reading end of ring `name`, whose slots must be exactly `T`-sized.
    /// Fails with [`RegionError::Claimed`] while another consumer end is open anywhere.
    pub fn consumer<T: Pod>(&self, name: &str) -> Result<RingConsumer<T>, RegionError> {
        RingConsumer::open(self, name)
    }

    /// The standalone doorbell region `name`.
    pub fn doorbell(&self, name: &str) -> Result<DoorbellRef, RegionError> {
        let r = self.inner.region(name)?;
        if r.kind != RegionKind::Doorbell {
            return Err(wrong(name, "doorbell", &r.kind));
        }
        let ptr = self.inner.doorbell_at(r.offset, name)?;
        Ok(DoorbellRef::new(self.inner.clone(), ptr))
    }

    /// The `AtomicU32` array region `name`.
    pub fn atomics_u32(&self, name: &str) -> Result<AtomicArray<AtomicU32>, RegionError> {
        let r = self.inner.region(name)?;
        match r.kind {
            RegionKind::AtomicsU32 { len } => Ok(self.array(r.offset, len)),
            ref k => Err(wrong(name, "atomics_u32", k)),
        }
    }

    /// The `AtomicU64` array region `name`.
    pub fn atomics_u64(&self, name: &str) -> Result<AtomicArray<AtomicU64>, RegionError> {
        let r = self.inner.region(name)?;
        match r.kind {
            RegionKind::AtomicsU64 { len } => Ok(self.array(r.offset, len)),
            ref k => Err(wrong(name, "atomics_u64", k)),
        }
    }

    fn array<A>(&self, offset: usize, len: usize) -> AtomicArray<A> {
        // SAFETY: the layout put `len` elements at `offset` (aligned to REGION_ALIGN), inside
        // the mapping; non-null because base is.
        let ptr = unsafe { NonNull::new_unchecked(self.inner.base().add(offset).cast::<A>()) };
        AtomicArray {
            _arena: self.inner.clone(),
            ptr,
            len,
        }
    }

    /// The participant table region `name`.
    pub fn participants(&self, name: &str) -> Result<ParticipantTable, RegionError> {
        let r = self.inner.region(name)?;
        match r.kind {
            RegionKind::Participants { slots, lock_base } => Ok(ParticipantTable::new(
                self.inner.clone(),
                r.offset,
                slots,
                lock_base,
            )),
            ref k => Err(wrong(name, "participants", k)),
        }
    }
}

fn wrong(name: &str, expected: &'static str, found: &RegionKind) -> RegionError {
    RegionError::WrongKind {
        name: name.to_owned(),
        expected,
        found: found.label(),
    }
}

/// Construct every region of `layout` in place.
///
/// # Safety
/// `base` must point to `layout.size()` writable, zeroed bytes aligned to a page, that no one
/// else accesses during the call.
pub(crate) unsafe fn init_regions(base: *mut u8, layout: &Layout) {
    // Every region below gets `r.size` bytes at `r.offset`, inside `layout.size()`, aligned to
    // REGION_ALIGN and disjoint from the others (Layout's contract); the caller guarantees the
    // bytes are writable and unshared.
    for r in layout.regions() {
        let p = base.wrapping_add(r.offset);
        match r.kind {
            RegionKind::Ring {
                capacity,
                slot_size,
                doorbell_offset,
            } => {
                // SAFETY: a ring region of `region_size(capacity, slot_size)` bytes (above).
                unsafe { ring::init(p, capacity, slot_size, doorbell_offset) }
            }
            RegionKind::Doorbell => {
                // SAFETY: a doorbell region is one aligned `CachePadded<Doorbell>` (above).
                unsafe { std::ptr::write(p.cast(), CachePadded::new(Doorbell::new())) }
            }
            RegionKind::AtomicsU32 { len } => {
                for i in 0..len {
                    // SAFETY: element `i < len` of an aligned array of `len` (above).
                    unsafe { std::ptr::write(p.cast::<AtomicU32>().add(i), AtomicU32::new(0)) }
                }
            }
            RegionKind::AtomicsU64 { len } => {
                for i in 0..len {
                    // SAFETY: element `i < len` of an aligned array of `len` (above).
                    unsafe { std::ptr::write(p.cast::<AtomicU64>().add(i), AtomicU64::new(0)) }
                }
            }
            RegionKind::Participants { slots, .. } => {
                // SAFETY: a participant region of `region_size(slots)` bytes (above).
                unsafe { participants::init(p, slots) }
            }
        }
    }
}

const _: () = assert!(!std::mem::needs_drop::<CachePadded<Doorbell>>());
const _: () = assert!(!std::mem::needs_drop::<AtomicU64>());

/// A handle to a doorbell in an arena (derefs to [`Doorbell`]); keeps the arena alive.
#[derive(Clone)]
pub struct DoorbellRef {
    _arena: Arc<ArenaInner>,
    ptr: NonNull<Doorbell>,
}

// SAFETY: a doorbell is two atomics; the pointer stays valid while `_arena` lives.
unsafe impl Send for DoorbellRef {}
// SAFETY: as above.
unsafe impl Sync for DoorbellRef {}

impl DoorbellRef {
    pub(crate) fn new(arena: Arc<ArenaInner>, ptr: NonNull<Doorbell>) -> DoorbellRef {
        DoorbellRef { _arena: arena, ptr }
    }
}

impl std::ops::Deref for DoorbellRef {
    type Target = Doorbell;
    fn deref(&self) -> &Doorbell {
        // SAFETY: initialised in place at arena creation; mapped while `_arena` lives.
        unsafe { self.ptr.as_ref() }
    }
}

impl std::fmt::Debug for DoorbellRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        (**self).fmt(f)
    }
}

/// A handle to an array of atomics in an arena (derefs to `[A]`); keeps the arena alive.
pub struct AtomicArray<A> {
    _arena: Arc<ArenaInner>,
    ptr: NonNull<A>,
    len: usize,
}

// SAFETY: the elements are atomics (`Sync`); the pointer stays valid while `_arena` lives.
unsafe impl<A: Sync> Send for AtomicArray<A> {}
// SAFETY: as above.
unsafe impl<A: Sync> Sync for AtomicArray<A> {}

impl<A> std::ops::Deref for AtomicArray<A> {
    type Target = [A];
    fn deref(&self) -> &[A] {
        // SAFETY: `len` elements initialised in place at `ptr`, mapped while `_arena` lives,
        // only ever accessed through `&A` (atomics).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<A: std::fmt::Debug> std::fmt::Debug for AtomicArray<A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn atomic_arrays_start_at_zero_and_are_shared_between_handles() {
        let a = Arena::heap(&LayoutSpec::new().atomics_u64("x", 3).atomics_u32("y", 5)).unwrap();
        let x1 = a.atomics_u64("x").unwrap();
        let x2 = a.clone().atomics_u64("x").unwrap();
        assert_eq!(x1.len(), 3);
        assert!(x1.iter().all(|v| v.load(Ordering::Relaxed) == 0));
        x1[2].store(42, Ordering::Relaxed);
        assert_eq!(x2[2].load(Ordering::Relaxed), 42);
        assert_eq!(a.atomics_u32("y").unwrap().len(), 5);
        drop(a);
        assert_eq!(
            x2[2].load(Ordering::Relaxed),
            42,
            "handles keep the arena alive"
        );
    }

    #[test]
    fn asking_for_the_wrong_kind_of_region_names_both_kinds() {
        let a = Arena::heap(&LayoutSpec::new().atomics_u64("x", 1).doorbell("d")).unwrap();
        let e = a.atomics_u32("x").unwrap_err();
        assert_eq!(
            e,
            RegionError::WrongKind {
                name: "x".into(),
                expected: "atomics_u32",
                found: "atomics_u64"
            }
        );
        assert!(e.to_string().contains("atomics_u64"));
        assert!(a.doorbell("x").is_err());
        assert!(a.doorbell("d").is_ok());
        assert!(a.participants("d").is_err());
        assert!(a.consumer::<u64>("d").is_err());
    }
}
