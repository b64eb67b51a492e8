//! Single-producer single-consumer rings of fixed-size plain-data slots, in shared memory.
//!
//! Contract: `tail` (next slot to write) is written only by the producer and `head` (next slot
//! to read) only by the consumer; both only grow, and each lives on its own cache line. A slot
//! `i` with `head <= i < tail` belongs to the consumer, every other slot to the producer. The
//! producer writes a slot, then publishes it with a `Release` store of `tail`; the consumer
//! `Acquire`-loads `tail`, reads, then hands the slot back with a `Release` store of `head`,
//! which the producer `Acquire`-loads before reusing it. Each side keeps a private cached copy of
//! the other's index and reloads it only when the cache says full (or empty).
//!
//! A producer that dies mid-write leaves at worst an unpublished, torn slot in its own ring: it
//! is never visible, and [`RingConsumer::reset`] (or [`RingProducer::reset`]) reinitialises the
//! ring once both sides are quiesced. Only one [`RingProducer`] and one [`RingConsumer`] can exist
//! per ring at a time, across all processes: each end claims its side in the ring header.

use crate::arena::{Arena, ArenaInner, DoorbellRef, RegionError};
use crate::doorbell::{deadline_after, Doorbell};
use crate::layout::{RegionKind, REGION_ALIGN};
use crate::sync::{spin_loop, yield_now, AtomicU64, CachePadded, Ordering, UnsafeCell};
use bytemuck::Pod;
use std::marker::PhantomData;
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Busy-wait polls before yielding. Each is a load plus a `pause` (~40-140 cycles).
const SPIN_ROUNDS: u32 = if cfg!(loom) { 1 } else { 128 };
/// `sched_yield` polls before sleeping.
const YIELD_ROUNDS: u32 = if cfg!(loom) { 0 } else { 16 };
/// Longest sleep between polls of a producer waiting on a full ring.
const MAX_PRODUCER_NAP: Duration = Duration::from_millis(1);

/// The ring header at the start of a ring region. `#[repr(C)]`; indices and the doorbell each
/// on their own cache line.
#[repr(C)]
pub(crate) struct RingHeader {
    /// Next position the producer writes; slot `tail % capacity`. Only grows.
    tail: CachePadded<AtomicU64>,
    /// Next position the consumer reads. Only grows; `tail - head <= capacity`.
    head: CachePadded<AtomicU64>,
    /// The consumer's own doorbell (used unless the layout names a shared one).
    doorbell: CachePadded<Doorbell>,
    meta: CachePadded<RingMeta>,
}

#[repr(C)]
struct RingMeta {
    /// Written once at creation, checked against the layout when an end is opened.
    capacity: u64,
    slot_size: u64,
    doorbell_offset: u64,
    /// Claim token of the live producer end (pid << 32 | serial), or 0.
    producer: AtomicU64,
    /// Claim token of the live consumer end, or 0.
    consumer: AtomicU64,
    /// How many times the ring was reset.
    resets: AtomicU64,
}

/// Offset of a ring's own doorbell from the start of its region.
pub(crate) const OWN_DOORBELL_OFFSET: usize = std::mem::offset_of!(RingHeader, doorbell);

const HEADER_BYTES: usize = align(std::mem::size_of::<RingHeader>());

const fn align(x: usize) -> usize {
    (x + REGION_ALIGN - 1) & !(REGION_ALIGN - 1)
}

// The in-place types must have no drop glue: regions are never dropped, only unmapped.
const _: () = assert!(!std::mem::needs_drop::<RingHeader>());
const _: () = assert!(!std::mem::needs_drop::<UnsafeCell<()>>());

/// Bytes of a ring region: header, then one access guard per slot (zero-sized outside loom),
/// then the slots. `None` on overflow.
pub(crate) fn region_size(capacity: usize, slot_size: usize) -> Option<usize> {
    let guards = capacity.checked_mul(std::mem::size_of::<UnsafeCell<()>>())?;
    let guards = guards.checked_add(REGION_ALIGN - 1)? & !(REGION_ALIGN - 1);
    HEADER_BYTES
        .checked_add(guards)?
        .checked_add(capacity.checked_mul(slot_size)?)
}

fn guards_offset() -> usize {
    HEADER_BYTES
}

fn slots_offset(capacity: usize) -> usize {
    HEADER_BYTES + align(capacity * std::mem::size_of::<UnsafeCell<()>>())
}

/// Construct an empty ring in place.
///
/// # Safety
/// `region` must point to `region_size(capacity, slot_size)` writable bytes, aligned to
/// [`REGION_ALIGN`], that no one else accesses during the call. Slot bytes are left as they are
/// (the segment is zero-filled by `ftruncate`, heap arenas by `alloc_zeroed`).
pub(crate) unsafe fn init(
    region: *mut u8,
    capacity: usize,
    slot_size: usize,
    doorbell_offset: usize,
) {
    let header = RingHeader {
        tail: CachePadded::new(AtomicU64::new(0)),
        head: CachePadded::new(AtomicU64::new(0)),
        doorbell: CachePadded::new(Doorbell::new()),
        meta: CachePadded::new(RingMeta {
            capacity: capacity as u64,
            slot_size: slot_size as u64,
            doorbell_offset: doorbell_offset as u64,
            producer: AtomicU64::new(0),
            consumer: AtomicU64::new(0),
            resets: AtomicU64::new(0),
        }),
    };
    // SAFETY: the caller guarantees the region is writable, aligned and unshared.
    unsafe { std::ptr::write(region.cast::<RingHeader>(), header) };
    let guards = region
        .wrapping_add(guards_offset())
        .cast::<UnsafeCell<()>>();
    for i in 0..capacity {
        // SAFETY: `guards_offset() + capacity * size_of::<UnsafeCell<()>>()` is inside the
        // region by `region_size`. (A no-op outside loom: the guard is zero-sized.)
        #[allow(clippy::zst_offset)]
        let guard = unsafe { guards.add(i) };
        // SAFETY: as above; the guard's bytes are inside the region and unshared.
        unsafe { std::ptr::write(guard, UnsafeCell::new(())) };
    }
}

/// The item handed back by a push to a full ring.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Full<T>(pub T);

impl<T> std::fmt::Debug for Full<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Full(..)")
    }
}

impl<T> std::fmt::Display for Full<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ring is full")
    }
}

impl<T> std::error::Error for Full<T> {}

/// Which end of a ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// The writing end.
    Producer,
    /// The reading end.
    Consumer,
}

impl std::fmt::Display for Side {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Side::Producer => "producer",
            Side::Consumer => "consumer",
        })
    }
}

fn claim_token() -> u64 {
    static SERIAL: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(1);
    let serial = SERIAL.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    ((std::process::id() as u64) << 32) | serial as u64
}

/// What both ends share: the mapping and resolved pointers into it.
struct RingView {
    arena: Arc<ArenaInner>,
    header: NonNull<RingHeader>,
    guards: *const UnsafeCell<()>,
    slots: *mut u8,
    doorbell: NonNull<Doorbell>,
    capacity: u64,
    mask: u64,
    slot_size: usize,
    side: Side,
    token: u64,
    name: Box<str>,
}

impl RingView {
    fn open<T: Pod>(arena: &Arena, name: &str, side: Side) -> Result<RingView, RegionError> {
        let inner = arena.inner();
        let region = inner.region(name)?;
        let RegionKind::Ring {
            capacity,
            slot_size,
            doorbell_offset,
        } = region.kind
        else {
            return Err(RegionError::WrongKind {
                name: name.to_owned(),
                expected: "ring",
                found: region.kind.label(),
            });
        };
        let (size, align) = (std::mem::size_of::<T>(), std::mem::align_of::<T>());
        if size != slot_size || slot_size % align != 0 || align > REGION_ALIGN {
            return Err(RegionError::SlotType {
                name: name.to_owned(),
                slot_size,
                type_name: std::any::type_name::<T>(),
                type_size: size,
                type_align: align,
            });
        }
        let base = inner.base();
        // SAFETY: the layout placed a ring region of `region.size` bytes at `region.offset`,
        // inside the mapping (`Layout::size <= len`, checked at create/attach), and `init`
        // constructed a `RingHeader` there.
        let header =
            unsafe { NonNull::new_unchecked(base.add(region.offset).cast::<RingHeader>()) };
        // SAFETY: as above; the header is initialised and lives as long as `arena`.
        let h = unsafe { header.as_ref() };
        if h.meta.capacity != capacity as u64
            || h.meta.slot_size != slot_size as u64
            || h.meta.doorbell_offset != doorbell_offset as u64
        {
            return Err(RegionError::Corrupt {
                name: name.to_owned(),
                what: format!(
                    "ring header says capacity {} slot {} doorbell @{}, layout says {} {} @{}",
                    h.meta.capacity,
                    h.meta.slot_size,
                    h.meta.doorbell_offset,
                    capacity,
                    slot_size,
                    doorbell_offset
                ),
            });
        }
        let doorbell = inner.doorbell_at(doorbell_offset, name)?;
        let token = claim_token();
        let claim = match side {
            Side::Producer => &h.meta.producer,
            Side::Consumer => &h.meta.consumer,
        };
        if let Err(held) = claim.compare_exchange(0, token, Ordering::AcqRel, Ordering::Acquire) {
            return Err(RegionError::Claimed {
                name: name.to_owned(),
                side,
                pid: (held >> 32) as u32,
            });
        }
        Ok(RingView {
            arena: inner.clone(),
            header,
            guards: base.wrapping_add(region.offset + guards_offset()).cast(),
            slots: base.wrapping_add(region.offset + slots_offset(capacity)),
            doorbell,
            capacity: capacity as u64,
            mask: capacity as u64 - 1,
            slot_size,
            side,
            token,
            name: name.into(),
        })
    }

    #[inline]
    fn header(&self) -> &RingHeader {
        // SAFETY: initialised by `init`, kept mapped by `self.arena`.
        unsafe { self.header.as_ref() }
    }

    #[inline]
    fn doorbell(&self) -> &Doorbell {
        // SAFETY: resolved and bounds-checked by `doorbell_at`, kept mapped by `self.arena`.
        unsafe { self.doorbell.as_ref() }
    }

    /// Write `item` into the slot for position `pos`.
    ///
    /// # Safety
    /// The caller must own that slot under the ring protocol (producer, `pos` not yet published
    /// and `pos - head < capacity`).
    #[inline]
    unsafe fn write<T: Pod>(&self, pos: u64, item: T) {
        let i = (pos & self.mask) as usize;
        // SAFETY: `i < capacity`; guards and slots were laid out for `capacity` entries; slot
        // `i` is `slot_size == size_of::<T>()` bytes at a multiple of `align_of::<T>()` from a
        // REGION_ALIGN-aligned base (checked in `open`). The caller owns the slot, so nothing
        // reads it concurrently (under loom, the guard checks exactly that).
        unsafe {
            self.guard(i)
                .with_mut(|_| std::ptr::write(self.slots.add(i * self.slot_size).cast::<T>(), item))
        }
    }

    /// The access guard of slot `i`: zero-sized outside loom (the offset is a no-op), loom's
    /// tracked cell under it, so loom reports any unsynchronised access to a slot.
    ///
    /// # Safety
    /// `i < capacity`.
    #[inline]
    #[allow(clippy::zst_offset)]
    unsafe fn guard(&self, i: usize) -> &UnsafeCell<()> {
        // SAFETY: `capacity` guards were constructed in place at `guards` (see `init`) and stay
        // mapped while `self.arena` lives.
        unsafe { &*self.guards.add(i) }
    }

    /// Read the slot for position `pos`.
    ///
    /// # Safety
    /// The caller must own that slot under the ring protocol (consumer, `head <= pos < tail`
    /// with `tail` Acquire-loaded).
    #[inline]
    unsafe fn read<T: Pod>(&self, pos: u64) -> T {
        let i = (pos & self.mask) as usize;
        // SAFETY: as in `write`; the slot was published by the producer's Release store of
        // `tail`, which the caller Acquire-loaded, so its bytes are fully written. Any bit
        // pattern is a valid `T` (`Pod`).
        unsafe {
            self.guard(i)
                .with(|_| std::ptr::read(self.slots.add(i * self.slot_size).cast::<T>()))
        }
    }

    /// Reinitialise both indices and free the peer's claim.
    ///
    /// # Safety
    /// See [`RingConsumer::reset`].
    unsafe fn reset(&self) {
        let h = self.header();
        h.tail.store(0, Ordering::Relaxed);
        h.head.store(0, Ordering::Relaxed);
        match self.side {
            Side::Producer => h.meta.consumer.store(0, Ordering::Relaxed),
            Side::Consumer => h.meta.producer.store(0, Ordering::Relaxed),
        }
        // Release: a peer that opens its end after seeing the new claim state sees zeroed indices.
        h.meta.resets.fetch_add(1, Ordering::Release);
    }
}

impl Drop for RingView {
    fn drop(&mut self) {
        let meta = &self.header().meta;
        let claim = match self.side {
            Side::Producer => &meta.producer,
            Side::Consumer => &meta.consumer,
        };
        // Only release our own claim: a reset may have handed the side to someone else.
        let _ = claim.compare_exchange(self.token, 0, Ordering::Release, Ordering::Relaxed);
    }
}

impl std::fmt::Debug for RingView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let h = self.header();
        f.debug_struct("Ring")
            .field("name", &self.name)
            .field("side", &self.side)
            .field("capacity", &self.capacity)
            .field("slot_size", &self.slot_size)
            .field("head", &h.head.load(Ordering::Relaxed))
            .field("tail", &h.tail.load(Ordering::Relaxed))
            .finish()
    }
}

/// The writing end of a ring of `T` slots. At most one exists per ring across all processes.
///
/// Push methods never block unless they say so; [`push_timeout`](Self::push_timeout) waits a
/// bounded time for space (polling with growing naps up to 1 ms, so a stuck consumer costs
/// little CPU).
pub struct RingProducer<T: Pod> {
    view: RingView,
    /// Private copy of the shared `tail` (we are its only writer).
    tail: u64,
    /// Last `head` we loaded; `tail - cached_head` over-estimates the used slots.
    cached_head: u64,
    _slot: PhantomData<fn(T)>,
}

// SAFETY: the producer only touches slots it owns under the ring protocol and atomics; moving it
// to another thread moves that ownership. The mapping is kept alive by an `Arc`.
unsafe impl<T: Pod> Send for RingProducer<T> {}

impl<T: Pod> RingProducer<T> {
    pub(crate) fn open(arena: &Arena, name: &str) -> Result<RingProducer<T>, RegionError> {
        let view = RingView::open::<T>(arena, name, Side::Producer)?;
        let h = view.header();
        let tail = h.tail.load(Ordering::Acquire);
        let cached_head = h.head.load(Ordering::Acquire);
        Ok(RingProducer {
            view,
            tail,
            cached_head,
            _slot: PhantomData,
        })
    }

    /// Free slots, reloading the consumer's `head` only if the cache says fewer than `want`.
    /// A corrupt pair of indices (head ahead of tail) reads as no space.
    #[inline]
    fn free_for(&mut self, want: u64) -> u64 {
        let cap = self.view.capacity;
        let free = cap.saturating_sub(self.tail.wrapping_sub(self.cached_head));
        if free >= want {
            return free;
        }
        self.cached_head = self.view.header().head.load(Ordering::Acquire);
        cap.saturating_sub(self.tail.wrapping_sub(self.cached_head))
    }

    #[inline]
    fn publish(&mut self, new_tail: u64) {
        self.tail = new_tail;
        self.view.header().tail.store(new_tail, Ordering::Release);
        self.view.doorbell().notify();
    }

    /// Append `item`, or hand it back as [`Full`] if the ring has no free slot. Never blocks.
    #[inline]
    pub fn try_push(&mut self, item: T) -> Result<(), Full<T>> {
        if self.free_for(1) == 0 {
            return Err(Full(item));
        }
        // SAFETY: position `tail` is unpublished and `tail - head < capacity` (free >= 1).
        unsafe { self.view.write(self.tail, item) };
        self.publish(self.tail.wrapping_add(1));
        Ok(())
    }

    /// Append as many leading items of `items` as fit, publish them at once (one `Release`
    /// store, one doorbell check), and return how many were appended (0 if full). Never blocks.
    pub fn push_batch(&mut self, items: &[T]) -> usize {
        let n = self.free_for(items.len() as u64).min(items.len() as u64);
        if n == 0 {
            return 0;
        }
        for (k, item) in items[..n as usize].iter().enumerate() {
            // SAFETY: positions tail..tail+n are unpublished and fit (n <= free).
            unsafe { self.view.write(self.tail.wrapping_add(k as u64), *item) };
        }
        self.publish(self.tail.wrapping_add(n));
        n as usize
    }

    /// Append `item`, waiting up to `timeout` for a free slot: spin briefly, yield, then nap
    /// with growing sleeps (at most 1 ms each). Returns [`Full`] with the item if the ring is
    /// still full at the deadline; never waits longer than `timeout` plus one nap.
    pub fn push_timeout(&mut self, item: T, timeout: Duration) -> Result<(), Full<T>> {
        let mut item = match self.try_push(item) {
            Ok(()) => return Ok(()),
            Err(Full(item)) => item,
        };
        let deadline = deadline_after(timeout);
        for round in 0..SPIN_ROUNDS + YIELD_ROUNDS {
            if round < SPIN_ROUNDS {
                spin_loop();
            } else {
                yield_now();
            }
            item = match self.try_push(item) {
                Ok(()) => return Ok(()),
                Err(Full(item)) => item,
            };
        }
        let mut nap = Duration::from_micros(10);
        loop {
            let left = match deadline {
                None => MAX_PRODUCER_NAP,
                Some(d) => d.saturating_duration_since(Instant::now()),
            };
            if left.is_zero() {
                return Err(Full(item));
            }
            nap_for(nap.min(left));
            nap = (nap * 2).min(MAX_PRODUCER_NAP);
            item = match self.try_push(item) {
                Ok(()) => return Ok(()),
                Err(Full(item)) => item,
            };
        }
    }

    /// Slots in use (a fresh load of `head`).
    pub fn len(&self) -> usize {
        let head = self.view.header().head.load(Ordering::Acquire);
        self.tail.wrapping_sub(head).min(self.view.capacity) as usize
    }

    /// True if no slot is in use.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// True if every slot is in use.
    pub fn is_full(&self) -> bool {
        self.len() as u64 == self.view.capacity
    }

    /// Slots in the ring.
    pub fn capacity(&self) -> usize {
        self.view.capacity as usize
    }

    /// Items pushed since the last reset (the producer's `tail`).
    pub fn position(&self) -> u64 {
        self.tail
    }

    /// The ring's region name.
    pub fn name(&self) -> &str {
        &self.view.name
    }

    /// Reinitialise the ring (both indices to 0, pending items discarded) and free the
    /// consumer's claim so a new consumer can open it. Used when the consumer died.
    ///
    /// # Safety
    /// Both sides must be quiesced: the consumer's process is dead (kernel evidence, see
    /// [`crate::participants`]) or its end is dropped, and nothing else touches the ring during
    /// the call. A consumer still reading would race with new pushes on slot memory.
    pub unsafe fn reset(&mut self) {
        // SAFETY: forwarded from the caller.
        unsafe { self.view.reset() };
        self.tail = 0;
        self.cached_head = 0;
    }
}

impl<T: Pod> std::fmt::Debug for RingProducer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.view.fmt(f)
    }
}

/// The reading end of a ring of `T` slots. At most one exists per ring across all processes.
pub struct RingConsumer<T: Pod> {
    view: RingView,
    /// Private copy of the shared `head` (we are its only writer).
    head: u64,
    /// Last `tail` we loaded; `cached_tail - head` under-estimates the pending items.
    cached_tail: u64,
    _slot: PhantomData<fn() -> T>,
}

// SAFETY: the consumer only touches slots it owns under the ring protocol and atomics; moving it
// to another thread moves that ownership. The mapping is kept alive by an `Arc`.
unsafe impl<T: Pod> Send for RingConsumer<T> {}

impl<T: Pod> RingConsumer<T> {
    pub(crate) fn open(arena: &Arena, name: &str) -> Result<RingConsumer<T>, RegionError> {
        let view = RingView::open::<T>(arena, name, Side::Consumer)?;
        let h = view.header();
        let head = h.head.load(Ordering::Acquire);
        let cached_tail = h.tail.load(Ordering::Acquire);
        Ok(RingConsumer {
            view,
            head,
            cached_tail,
            _slot: PhantomData,
        })
    }

    /// Pending items, reloading the producer's `tail` only if the cache says fewer than `want`.
    /// A corrupt pair of indices (more than `capacity` apart) reads as empty.
    #[inline]
    fn available_for(&mut self, want: u64) -> u64 {
        let avail = self.cached_tail.wrapping_sub(self.head);
        if avail >= want && avail <= self.view.capacity {
            return avail;
        }
        self.cached_tail = self.view.header().tail.load(Ordering::Acquire);
        let avail = self.cached_tail.wrapping_sub(self.head);
        if avail > self.view.capacity {
            0
        } else {
            avail
        }
    }

    #[inline]
    fn release(&mut self, new_head: u64) {
        self.head = new_head;
        self.view.header().head.store(new_head, Ordering::Release);
    }

    /// Take the oldest item, or `None` if the ring is empty. Never blocks.
    #[inline]
    pub fn pop(&mut self) -> Option<T> {
        if self.available_for(1) == 0 {
            return None;
        }
        // SAFETY: head < tail (Acquire-loaded into cached_tail), so the slot is published.
        let item = unsafe { self.view.read(self.head) };
        self.release(self.head.wrapping_add(1));
        Some(item)
    }

    /// Append up to `max` items to `out`, oldest first, releasing their slots with one store.
    /// Returns how many were appended. Never blocks.
    pub fn pop_batch(&mut self, out: &mut Vec<T>, max: usize) -> usize {
        let n = self.available_for(max as u64).min(max as u64);
        if n == 0 {
            return 0;
        }
        out.reserve(n as usize);
        for k in 0..n {
            // SAFETY: head + k < tail, so each slot is published.
            out.push(unsafe { self.view.read(self.head.wrapping_add(k)) });
        }
        self.release(self.head.wrapping_add(n));
        n as usize
    }

    /// Fill a prefix of `out` with the oldest items; returns how many. Never blocks.
    pub fn pop_slice(&mut self, out: &mut [T]) -> usize {
        let n = self.available_for(out.len() as u64).min(out.len() as u64);
        for (k, slot) in out[..n as usize].iter_mut().enumerate() {
            // SAFETY: head + k < tail, so each slot is published.
            *slot = unsafe { self.view.read(self.head.wrapping_add(k as u64)) };
        }
        if n > 0 {
            self.release(self.head.wrapping_add(n));
        }
        n as usize
    }

    /// Take the oldest item, waiting up to `timeout` for one: spin briefly, yield, then sleep
    /// on the ring's doorbell (a futex: no CPU while idle). `Duration::MAX` waits forever.
    /// Returns `None` on timeout.
    pub fn wait_pop(&mut self, timeout: Duration) -> Option<T> {
        if let Some(item) = self.pop() {
            return Some(item);
        }
        if self.wait(timeout) {
            self.pop()
        } else {
            None
        }
    }

    /// Like [`pop_batch`](Self::pop_batch), but first waits up to `timeout` for at least one
    /// item as [`wait_pop`](Self::wait_pop) does. Returns how many were appended (0 on timeout).
    pub fn wait_pop_batch(&mut self, out: &mut Vec<T>, max: usize, timeout: Duration) -> usize {
        let n = self.pop_batch(out, max);
        if n > 0 || max == 0 || !self.wait(timeout) {
            return n;
        }
        self.pop_batch(out, max)
    }

    /// Wait until an item is pending or `timeout` passes; true if one is.
    fn wait(&mut self, timeout: Duration) -> bool {
        let deadline = deadline_after(timeout);
        for round in 0..SPIN_ROUNDS + YIELD_ROUNDS {
            if self.available_for(1) > 0 {
                return true;
            }
            if round < SPIN_ROUNDS {
                spin_loop();
            } else {
                yield_now();
            }
        }
        let left = match deadline {
            None => Duration::MAX,
            Some(d) => d.saturating_duration_since(Instant::now()),
        };
        let (header, head, cap) = (self.view.header(), self.head, self.view.capacity);
        let ready = || {
            let avail = header.tail.load(Ordering::Acquire).wrapping_sub(head);
            avail > 0 && avail <= cap
        };
        self.view.doorbell().wait_until(left, ready)
    }

    /// True if an item is pending (a fresh `Acquire` load of `tail`). Use it as the readiness
    /// test when sleeping on a doorbell shared by several rings.
    pub fn has_pending(&self) -> bool {
        let avail = self
            .view
            .header()
            .tail
            .load(Ordering::Acquire)
            .wrapping_sub(self.head);
        avail > 0 && avail <= self.view.capacity
    }

    /// Items pending (a fresh load of `tail`; 0 if the indices are corrupt).
    pub fn len(&self) -> usize {
        let avail = self
            .view
            .header()
            .tail
            .load(Ordering::Acquire)
            .wrapping_sub(self.head);
        if avail > self.view.capacity {
            0
        } else {
            avail as usize
        }
    }

    /// True if nothing is pending.
    pub fn is_empty(&self) -> bool {
        !self.has_pending()
    }

    /// True if the shared indices violate `head <= tail <= head + capacity`, which only a
    /// corrupting writer can cause; such a ring reads as empty until it is reset.
    pub fn is_corrupt(&self) -> bool {
        let tail = self.view.header().tail.load(Ordering::Acquire);
        tail.wrapping_sub(self.head) > self.view.capacity
    }

    /// Slots in the ring.
    pub fn capacity(&self) -> usize {
        self.view.capacity as usize
    }

    /// Items consumed since the last reset (the consumer's `head`).
    pub fn position(&self) -> u64 {
        self.head
    }

    /// The ring's region name.
    pub fn name(&self) -> &str {
        &self.view.name
    }

    /// The doorbell this ring's producer rings, for sleeping on several rings at once:
    /// `bell.wait_until(timeout, || a.has_pending() || b.has_pending())`.
    pub fn doorbell(&self) -> DoorbellRef {
        DoorbellRef::new(self.view.arena.clone(), self.view.doorbell)
    }

    /// Reinitialise the ring (both indices to 0, pending items discarded) and free the
    /// producer's claim so a new producer can open it. The scheduler calls this when it
    /// reclaims a dead frontend's slot; drain first if pending items matter.
    ///
    /// # Safety
    /// Both sides must be quiesced: the producer's process is dead (kernel evidence, see
    /// [`crate::participants`]) or its end is dropped, and nothing else touches the ring during
    /// the call. A producer still writing would race with reads of slot memory.
    pub unsafe fn reset(&mut self) {
        // SAFETY: forwarded from the caller.
        unsafe { self.view.reset() };
        self.head = 0;
        self.cached_tail = 0;
    }
}

impl<T: Pod> std::fmt::Debug for RingConsumer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.view.fmt(f)
    }
}

#[cfg(not(loom))]
fn nap_for(d: Duration) {
    std::thread::sleep(d);
}

#[cfg(loom)]
fn nap_for(_d: Duration) {
    yield_now();
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::{Arena, LayoutSpec};

    #[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, bytemuck::Zeroable)]
    #[repr(C)]
    struct Msg {
        seq: u64,
        check: u64,
    }

    fn msg(seq: u64) -> Msg {
        Msg {
            seq,
            check: !seq.wrapping_mul(0x9e37_79b9_7f4a_7c15),
        }
    }

    fn arena(cap: usize) -> Arena {
        Arena::heap(&LayoutSpec::new().ring_of::<Msg>("r", cap)).unwrap()
    }

    #[test]
    fn items_come_out_in_push_order_across_many_wraparounds() {
        let a = arena(8);
        let mut p = a.producer::<Msg>("r").unwrap();
        let mut c = a.consumer::<Msg>("r").unwrap();
        let mut next = 0;
        for round in 0..1000u64 {
            let k = round % 9;
            for i in 0..k {
                p.try_push(msg(round * 100 + i)).unwrap();
            }
            for i in 0..k {
                assert_eq!(c.pop(), Some(msg(round * 100 + i)));
                next += 1;
            }
            assert_eq!(c.pop(), None);
        }
        assert_eq!(p.position(), next);
        assert_eq!(c.position(), next);
    }

    #[test]
    fn a_full_ring_hands_the_item_back_and_accepts_after_one_pop() {
        let a = arena(4);
        let mut p = a.producer::<Msg>("r").unwrap();
        let mut c = a.consumer::<Msg>("r").unwrap();
        for i in 0..4 {
            p.try_push(msg(i)).unwrap();
        }
        assert!(p.is_full());
        assert_eq!(p.try_push(msg(4)), Err(Full(msg(4))));
        assert_eq!(c.pop(), Some(msg(0)));
        p.try_push(msg(4)).unwrap();
        let mut out = Vec::new();
        assert_eq!(c.pop_batch(&mut out, 10), 4);
        assert_eq!(out, (1..5).map(msg).collect::<Vec<_>>());
        assert_eq!(c.pop(), None);
    }

    #[test]
    fn batches_are_truncated_to_free_space_and_keep_order() {
        let a = arena(8);
        let mut p = a.producer::<Msg>("r").unwrap();
        let mut c = a.consumer::<Msg>("r").unwrap();
        let items: Vec<_> = (0..20).map(msg).collect();
        assert_eq!(p.push_batch(&items[..5]), 5);
        assert_eq!(p.push_batch(&items[5..]), 3, "only 3 free");
        assert_eq!(p.push_batch(&items[8..]), 0);
        let mut buf = [msg(0); 3];
        assert_eq!(c.pop_slice(&mut buf), 3);
        assert_eq!(buf.to_vec(), items[..3].to_vec());
        assert_eq!(p.push_batch(&items[8..]), 3, "wraps around");
        let mut out = Vec::new();
        assert_eq!(c.pop_batch(&mut out, 100), 8);
        assert_eq!(out, items[3..11].to_vec());
        assert_eq!(c.pop_batch(&mut out, 100), 0);
        assert_eq!(c.pop_slice(&mut []), 0);
    }

    #[test]
    fn only_one_producer_and_one_consumer_can_be_open() {
        let a = arena(4);
        let p = a.producer::<Msg>("r").unwrap();
        let c = a.consumer::<Msg>("r").unwrap();
        let pid = std::process::id();
        assert!(matches!(
            a.producer::<Msg>("r"),
            Err(RegionError::Claimed { side: Side::Producer, pid: p2, .. }) if p2 == pid
        ));
        assert!(matches!(
            a.consumer::<Msg>("r"),
            Err(RegionError::Claimed {
                side: Side::Consumer,
                ..
            })
        ));
        drop(p);
        drop(c);
        a.producer::<Msg>("r").unwrap();
        a.consumer::<Msg>("r").unwrap();
    }

    #[test]
    fn a_slot_type_of_the_wrong_size_is_refused() {
        let a = arena(4);
        assert!(matches!(
            a.producer::<[u8; 8]>("r"),
            Err(RegionError::SlotType {
                slot_size: 16,
                type_size: 8,
                ..
            })
        ));
        assert!(matches!(
            a.consumer::<Msg>("missing"),
            Err(RegionError::NotFound { .. })
        ));
    }

    #[test]
    fn reset_discards_pending_items_and_frees_the_dead_side() {
        let a = arena(4);
        let mut p = a.producer::<Msg>("r").unwrap();
        let mut c = a.consumer::<Msg>("r").unwrap();
        p.try_push(msg(1)).unwrap();
        p.try_push(msg(2)).unwrap();
        assert_eq!(c.pop(), Some(msg(1)));
        // The producer "dies": its end is leaked, its claim stays behind.
        std::mem::forget(p);
        assert!(a.producer::<Msg>("r").is_err());
        // SAFETY: the producer end is gone (forgotten) and nothing else touches the ring.
        unsafe { c.reset() };
        assert_eq!(c.pop(), None);
        assert_eq!(c.position(), 0);
        let mut p = a.producer::<Msg>("r").expect("claim freed by reset");
        assert_eq!(p.position(), 0);
        for i in 10..14 {
            p.try_push(msg(i)).unwrap();
        }
        for i in 10..14 {
            assert_eq!(c.pop(), Some(msg(i)));
        }
    }

    #[test]
    fn corrupt_indices_read_as_empty_and_full_instead_of_garbage() {
        let a = arena(4);
        let mut p = a.producer::<Msg>("r").unwrap();
        let mut c = a.consumer::<Msg>("r").unwrap();
        p.view.header().tail.store(1000, Ordering::Release);
        assert!(c.is_corrupt());
        assert_eq!(c.pop(), None);
        assert_eq!(c.len(), 0);
        assert_eq!(c.pop_batch(&mut Vec::new(), 10), 0);
        // A head ahead of tail: the producer finds out when its cached head runs out, and
        // then reports full instead of overwriting unread slots.
        c.view.header().head.store(5000, Ordering::Release);
        p.tail = 0;
        p.cached_head = 0;
        let pushed = (0..10).take_while(|&i| p.try_push(msg(i)).is_ok()).count();
        assert_eq!(pushed, 4, "at most one ring's worth from the stale cache");
        assert_eq!(p.try_push(msg(0)), Err(Full(msg(0))));
    }

    #[test]
    fn push_timeout_gives_up_after_the_bound_on_a_full_ring() {
        let a = arena(2);
        let mut p = a.producer::<Msg>("r").unwrap();
        p.try_push(msg(0)).unwrap();
        p.try_push(msg(1)).unwrap();
        let t0 = Instant::now();
        assert_eq!(
            p.push_timeout(msg(2), Duration::from_millis(50)),
            Err(Full(msg(2)))
        );
        let took = t0.elapsed();
        assert!(took >= Duration::from_millis(50), "{took:?}");
        assert!(took < Duration::from_secs(2), "{took:?}");
    }

    #[test]
    fn push_timeout_succeeds_once_the_consumer_frees_a_slot() {
        let a = arena(2);
        let mut p = a.producer::<Msg>("r").unwrap();
        let mut c = a.consumer::<Msg>("r").unwrap();
        p.try_push(msg(0)).unwrap();
        p.try_push(msg(1)).unwrap();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            c.pop()
        });
        p.push_timeout(msg(2), Duration::from_secs(10)).unwrap();
        assert_eq!(t.join().unwrap(), Some(msg(0)));
    }

    #[test]
    fn wait_pop_times_out_on_an_empty_ring_and_wakes_on_a_push() {
        let a = arena(4);
        let mut p = a.producer::<Msg>("r").unwrap();
        let mut c = a.consumer::<Msg>("r").unwrap();
        let t0 = Instant::now();
        assert_eq!(c.wait_pop(Duration::from_millis(30)), None);
        assert!(t0.elapsed() >= Duration::from_millis(30));
        let t = std::thread::spawn(move || {
            let mut out = Vec::new();
            let n = c.wait_pop_batch(&mut out, 8, Duration::from_secs(20));
            (n, out)
        });
        std::thread::sleep(Duration::from_millis(50));
        p.try_push(msg(7)).unwrap();
        let (n, out) = t.join().unwrap();
        assert_eq!((n, out), (1, vec![msg(7)]));
    }

    #[test]
    fn threads_exchange_many_messages_in_order_without_loss_or_duplication() {
        const N: u64 = 200_000;
        let a = arena(256);
        let mut p = a.producer::<Msg>("r").unwrap();
        let mut c = a.consumer::<Msg>("r").unwrap();
        let t = std::thread::spawn(move || {
            let mut next = 0;
            let mut batch = Vec::with_capacity(32);
            while next < N {
                if next % 3 == 0 {
                    let k = (next % 29 + 1).min(N - next);
                    batch.clear();
                    batch.extend((next..next + k).map(msg));
                    next += p.push_batch(&batch) as u64;
                } else if p.push_timeout(msg(next), Duration::from_secs(30)).is_ok() {
                    next += 1;
                }
            }
        });
        let mut expect = 0;
        let mut out = Vec::new();
        while expect < N {
            out.clear();
            c.wait_pop_batch(&mut out, 64, Duration::from_secs(30));
            for m in &out {
                assert_eq!(*m, msg(expect));
                expect += 1;
            }
        }
        t.join().unwrap();
        assert_eq!(c.pop(), None);
    }
}
