//! Doorbells: how an idle reader sleeps without burning a core, and how a writer wakes it
//! without a system call on every message.
//!
//! Contract: a waiter reads the futex word `seq`, raises the `sleeping` flag, issues a `SeqCst`
//! fence, then re-checks its condition before sleeping while `seq` is unchanged; a notifier publishes its data, issues a
//! `SeqCst` fence, then reads `sleeping` and only if it is raised clears it, bumps `seq` and calls
//! `FUTEX_WAKE`. The two fences make this a Dekker handshake: either the notifier sees the flag,
//! or the waiter sees the data, so no wakeup is lost; a writer makes no system call unless a
//! reader sleeps, and only the first writer after the reader fell asleep makes one.
//!
//! The futex is shared (no `FUTEX_PRIVATE_FLAG`): the word lives in a `MAP_SHARED` mapping and
//! the waiter and the notifier are different processes. Under `cfg(loom)` the futex is replaced
//! by a yield loop on the same word, so a lost wakeup shows up as a model that never finishes.

use crate::sync::{fence, AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// A wake-up word in shared memory: `#[repr(C)]`, two `u32` atomics, all zero when idle.
///
/// One doorbell may serve several rings (the scheduler waits on every frontend ring and the
/// completion ring at once): each ring's producer rings the doorbell its layout names.
#[repr(C)]
#[derive(Debug)]
pub struct Doorbell {
    /// The futex word. Bumped by a notifier that saw a sleeper; a sleeper waits while it is
    /// unchanged.
    seq: AtomicU32,
    /// Non-zero while some waiter is (about to be) asleep on `seq`. Raised by waiters, cleared
    /// only by the notifier that wakes them (so with several waiters none is forgotten).
    sleeping: AtomicU32,
}

impl Doorbell {
    /// An idle doorbell (both words zero).
    pub fn new() -> Doorbell {
        Doorbell {
            seq: AtomicU32::new(0),
            sleeping: AtomicU32::new(0),
        }
    }

    /// Wake every waiter, if any is asleep. Call after publishing data with a `Release` store.
    /// Costs one `SeqCst` fence and one load when nobody sleeps; one `FUTEX_WAKE` otherwise.
    #[inline]
    pub fn notify(&self) {
        // Pairs with the fence in `wait_once`: either we see the raised flag, or the waiter's
        // re-check sees the data published before this fence.
        fence(Ordering::SeqCst);
        if self.sleeping.load(Ordering::Relaxed) != 0 {
            self.wake_all();
        }
    }

    #[cold]
    fn wake_all(&self) {
        if self.sleeping.swap(0, Ordering::AcqRel) == 0 {
            return; // another notifier got there first and wakes everyone
        }
        // AcqRel: a waiter that reads the new value with Acquire also sees our published data.
        self.seq.fetch_add(1, Ordering::AcqRel);
        futex::wake_all(&self.seq);
    }

    /// Sleep until `ready()` returns true or `timeout` passes. Returns the last value of
    /// `ready()`. `ready` must only read state that notifiers publish before calling
    /// [`notify`](Self::notify); it may be called several times (wake-ups can be spurious).
    /// `Duration::MAX` (or any timeout that overflows `Instant`) waits without a bound.
    pub fn wait_until(&self, timeout: Duration, mut ready: impl FnMut() -> bool) -> bool {
        let deadline = deadline_after(timeout);
        loop {
            if ready() {
                return true;
            }
            let remaining = match deadline {
                None => None,
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return ready();
                    }
                    Some(left)
                }
            };
            if self.wait_once(remaining, &mut ready) {
                return true;
            }
        }
    }

    /// One registration + re-check + futex sleep. Returns whether `ready()` held afterwards.
    /// The flag is left raised on the way out: clearing it could hide another waiter, and a
    /// stale flag costs one spurious `FUTEX_WAKE` at most.
    fn wait_once(&self, timeout: Option<Duration>, ready: &mut impl FnMut() -> bool) -> bool {
        // Read the futex word *before* raising the flag. A notifier that clears our flag bumps
        // the word after that (its swap reads our Release store, so our read happens-before its
        // bump), so FUTEX_WAIT below sees the change and returns at once. Reading it after the
        // flag would let a late notifier of an earlier round clear the flag and bump the word
        // before our read: we would then sleep on the new value with the flag down, and the
        // next notifier would not wake us (a lost wakeup loom found).
        let seq = self.seq.load(Ordering::Acquire);
        self.sleeping.store(1, Ordering::Release);
        // Pairs with the fence in `notify`.
        fence(Ordering::SeqCst);
        ready() || {
            futex::wait(&self.seq, seq, timeout);
            ready()
        }
    }
}

impl Default for Doorbell {
    fn default() -> Self {
        Doorbell::new()
    }
}

/// `Instant::now() + timeout`, or `None` when that is unrepresentable (wait forever). The clock
/// is not read at all for `Duration::MAX`, which keeps loom models deterministic.
pub(crate) fn deadline_after(timeout: Duration) -> Option<Instant> {
    if timeout == Duration::MAX {
        return None;
    }
    Instant::now().checked_add(timeout)
}

#[cfg(not(loom))]
mod futex {
    use crate::sync::AtomicU32;
    use std::time::Duration;

    /// `FUTEX_WAIT` on a shared word: sleep while `*word == expected`, up to `timeout`.
    /// Returns on a wake, a signal, a timeout, or at once if the word already differs.
    pub(super) fn wait(word: &AtomicU32, expected: u32, timeout: Option<Duration>) {
        let ts = timeout.map(|t| libc::timespec {
            tv_sec: t.as_secs().min(i64::MAX as u64 / 2) as libc::time_t,
            tv_nsec: t.subsec_nanos() as libc::c_long,
        });
        let ts_ptr = ts
            .as_ref()
            .map_or(std::ptr::null(), |t| t as *const libc::timespec);
        // SAFETY: `word.as_ptr()` is a valid, aligned u32 that stays mapped for the call (we hold
        // a reference to it); `ts_ptr` is null or points to a live timespec. FUTEX_WAIT only
        // reads both. The result (0, EAGAIN, EINTR, ETIMEDOUT) needs no handling: every caller
        // re-checks its condition and deadline.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                word.as_ptr(),
                libc::FUTEX_WAIT,
                expected,
                ts_ptr,
                std::ptr::null::<u32>(),
                0u32,
            );
        }
    }

    /// `FUTEX_WAKE` every waiter on `word`, in any process.
    pub(super) fn wake_all(word: &AtomicU32) {
        // SAFETY: `word.as_ptr()` is a valid, aligned u32 in a live mapping. FUTEX_WAKE does not
        // dereference the remaining arguments.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                word.as_ptr(),
                libc::FUTEX_WAKE,
                i32::MAX,
                std::ptr::null::<libc::timespec>(),
                std::ptr::null::<u32>(),
                0u32,
            );
        }
    }
}

#[cfg(loom)]
mod futex {
    use crate::sync::{yield_now, AtomicU32, Ordering};
    use std::time::Duration;

    /// Loom stand-in for `FUTEX_WAIT`: without a timeout, yield until the word changes (so a
    /// lost wakeup is a model that never ends, which loom reports); with one, a single yield
    /// (a spurious wake, which callers must tolerate).
    pub(super) fn wait(word: &AtomicU32, expected: u32, timeout: Option<Duration>) {
        if timeout.is_some() {
            yield_now();
            return;
        }
        while word.load(Ordering::Acquire) == expected {
            yield_now();
        }
    }

    /// Loom stand-in for `FUTEX_WAKE`: the sleeper polls the word, so nothing to do.
    pub(super) fn wake_all(_word: &AtomicU32) {}
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::sync::AtomicBool;
    use std::sync::Arc;

    #[test]
    fn wait_until_returns_false_after_the_timeout_when_nothing_happens() {
        let bell = Doorbell::new();
        let t0 = Instant::now();
        assert!(!bell.wait_until(Duration::from_millis(30), || false));
        let took = t0.elapsed();
        assert!(
            took >= Duration::from_millis(30),
            "returned early: {took:?}"
        );
        assert!(took < Duration::from_secs(2), "overslept: {took:?}");
    }

    #[test]
    fn notify_wakes_a_sleeper_in_another_thread() {
        let bell = Arc::new(Doorbell::new());
        let flag = Arc::new(AtomicBool::new(false));
        let (b2, f2) = (bell.clone(), flag.clone());
        let waiter = std::thread::spawn(move || {
            b2.wait_until(Duration::from_secs(20), || f2.load(Ordering::Acquire))
        });
        // Give the waiter time to reach the futex.
        while bell.sleeping.load(Ordering::Relaxed) == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
        let t0 = Instant::now();
        flag.store(true, Ordering::Release);
        bell.notify();
        assert!(waiter.join().unwrap());
        assert!(t0.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn only_the_first_notify_after_a_sleep_bumps_the_futex_word() {
        let bell = Doorbell::new();
        bell.notify();
        assert_eq!(
            bell.seq.load(Ordering::Relaxed),
            0,
            "nobody sleeps: no wake"
        );
        assert!(!bell.wait_until(Duration::from_millis(1), || false));
        bell.notify();
        bell.notify();
        assert_eq!(bell.seq.load(Ordering::Relaxed), 1);
    }
}
