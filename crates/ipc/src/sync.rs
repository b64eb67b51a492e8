//! The atomics facade: every type that lives in shared memory, and every lock-free algorithm
//! over it, takes its atomics, fences, cells and spin hints from this module only.
//!
//! Contract: under `cfg(loom)` the names below are loom's model-checked types, otherwise they
//! are `std`'s (or, for [`UnsafeCell`], a zero-cost wrapper with loom's closure API). Code that
//! imports them from here therefore runs unchanged under the model checker. This module is
//! public and stable: other crates (`baton-kv`'s released counters) import it too.
//!
//! Under loom, `SeqCst` *accesses* are not modelled as sequentially consistent (loom treats
//! them as acquire/release); only `fence(SeqCst)` is. Code that needs store-load ordering
//! (Dekker-style handshakes) must therefore use `fence(Ordering::SeqCst)`, as this crate does.

#[cfg(loom)]
mod imp {
    pub use loom::cell::UnsafeCell;
    pub use loom::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};

    /// A busy-wait hint. Under loom: a yield, so the model checker can run the other threads.
    #[inline]
    pub fn spin_loop() {
        loom::hint::spin_loop();
    }

    /// Give the rest of this time slice to another runnable thread.
    #[inline]
    pub fn yield_now() {
        loom::thread::yield_now();
    }
}

#[cfg(not(loom))]
mod imp {
    pub use super::std_cell::UnsafeCell;
    pub use std::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};

    /// A busy-wait hint (`pause` on x86). Under loom: a yield.
    #[inline]
    pub fn spin_loop() {
        std::hint::spin_loop();
    }

    /// Give the rest of this time slice to another runnable thread (`sched_yield`).
    #[inline]
    pub fn yield_now() {
        std::thread::yield_now();
    }
}

pub use imp::*;

#[cfg(not(loom))]
mod std_cell {
    /// `std::cell::UnsafeCell` with loom's closure-based API (`with`, `with_mut`), so the same
    /// code compiles against both. It has the same size and layout as the `T` it holds.
    #[derive(Debug, Default)]
    #[repr(transparent)]
    pub struct UnsafeCell<T>(std::cell::UnsafeCell<T>);

    impl<T> UnsafeCell<T> {
        /// Wrap `data`.
        #[inline]
        pub const fn new(data: T) -> UnsafeCell<T> {
            UnsafeCell(std::cell::UnsafeCell::new(data))
        }

        /// Run `f` with a shared raw pointer to the contents. The caller of the pointer must
        /// uphold the aliasing rules itself (under loom they are checked).
        #[inline]
        pub fn with<R>(&self, f: impl FnOnce(*const T) -> R) -> R {
            f(self.0.get())
        }

        /// Run `f` with a unique raw pointer to the contents. The caller of the pointer must
        /// uphold the aliasing rules itself (under loom they are checked).
        #[inline]
        pub fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
            f(self.0.get())
        }

        /// Consume the cell and return its contents.
        #[inline]
        pub fn into_inner(self) -> T {
            self.0.into_inner()
        }
    }
}

/// The alignment [`CachePadded`] uses, in bytes: two 64-byte lines, because Intel's adjacent
/// line prefetcher pulls lines in pairs (the same choice as crossbeam on x86-64).
pub const CACHE_LINE: usize = 128;

/// A value alone on its own cache line(s), so that writes to neighbouring values do not
/// invalidate it (no false sharing). `#[repr(C)]`, aligned and padded to [`CACHE_LINE`] bytes.
#[derive(Debug, Default)]
#[repr(C, align(128))]
pub struct CachePadded<T> {
    value: T,
}

impl<T> CachePadded<T> {
    /// Pad `value` to its own cache line(s).
    pub const fn new(value: T) -> CachePadded<T> {
        CachePadded { value }
    }

    /// Consume the padding and return the value.
    pub fn into_inner(self) -> T {
        self.value
    }
}

impl<T> std::ops::Deref for CachePadded<T> {
    type Target = T;
    #[inline]
    fn deref(&self) -> &T {
        &self.value
    }
}

impl<T> std::ops::DerefMut for CachePadded<T> {
    #[inline]
    fn deref_mut(&mut self) -> &mut T {
        &mut self.value
    }
}

const _: () = assert!(std::mem::align_of::<CachePadded<u8>>() == CACHE_LINE);

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn cache_padded_values_never_share_a_line() {
        let pair = [
            CachePadded::new(AtomicU64::new(1)),
            CachePadded::new(AtomicU64::new(2)),
        ];
        let a = &*pair[0] as *const AtomicU64 as usize;
        let b = &*pair[1] as *const AtomicU64 as usize;
        assert!(b - a >= CACHE_LINE);
        assert_eq!(a % CACHE_LINE, 0);
    }

    #[test]
    fn unsafe_cell_has_the_layout_of_its_contents() {
        assert_eq!(std::mem::size_of::<UnsafeCell<u64>>(), 8);
        assert_eq!(std::mem::size_of::<UnsafeCell<()>>(), 0);
        let c = UnsafeCell::new(5u32);
        // SAFETY: `c` is local and not shared; the pointer is valid for the closure's duration.
        c.with_mut(|p| unsafe { *p = 7 });
        // SAFETY: as above, no writer is live.
        assert_eq!(c.with(|p| unsafe { *p }), 7);
    }
}
