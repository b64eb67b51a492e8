//! Kernel evidence of liveness: open-file-description (OFD) byte-range locks on the segment file.
//!
//! Contract: a live process holds an exclusive OFD lock on one byte of the segment file (byte
//! `LOCK_SPACE + index`, far past the end of the data, so the locks cover no data). The kernel
//! drops it when the last descriptor of that open file description closes, which happens when
//! the process dies, however it dies. A checker asks with `F_OFD_GETLK`, which reports a
//! conflicting lock without ever taking it, so checking can never keep a dead process "alive".
//!
//! OFD locks behave like `flock` (owned by the open file description, not the process, and not
//! dropped by closing some other descriptor of the same file) but lock byte ranges, so one file
//! carries every participant's lock and there are no lock files to clean up: `/dev/shm` holds
//! exactly one file per running instance. Lock descriptors are `O_CLOEXEC`, so an exec'd child
//! does not inherit them; a child that forks without exec does (and keeps the lock alive).

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

/// Byte offset of lock 0 (the creator's). Lock `i` is byte `LOCK_SPACE + i`.
pub(crate) const LOCK_SPACE: i64 = 1 << 40;

fn flock_for(index: usize, ty: libc::c_short) -> libc::flock {
    // SAFETY: `libc::flock` is plain data; all-zero is a valid value (and required: OFD locks
    // need `l_pid == 0`).
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = ty;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    fl.l_start = LOCK_SPACE + index as i64;
    fl.l_len = 1;
    fl
}

/// Take exclusive lock `index` on `fd`'s open file description without blocking.
/// `Ok(false)` if another open file description holds it.
pub(crate) fn try_lock(fd: BorrowedFd<'_>, index: usize) -> io::Result<bool> {
    let fl = flock_for(index, libc::F_WRLCK as libc::c_short);
    // SAFETY: `fd` is a valid open descriptor for the call; `fl` is a valid flock that
    // F_OFD_SETLK only reads.
    let r = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_OFD_SETLK, &fl) };
    if r == 0 {
        return Ok(true);
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EAGAIN) | Some(libc::EACCES) => Ok(false),
        _ => Err(e),
    }
}

/// Whether an open file description other than `fd`'s holds lock `index`. Never takes it.
pub(crate) fn held_by_other(fd: BorrowedFd<'_>, index: usize) -> io::Result<bool> {
    let mut fl = flock_for(index, libc::F_WRLCK as libc::c_short);
    // SAFETY: `fd` is valid for the call; `fl` is a valid flock that F_OFD_GETLK overwrites with
    // the first conflicting lock, or sets `l_type = F_UNLCK` if there is none.
    let r = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_OFD_GETLK, &mut fl) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fl.l_type != libc::F_UNLCK as libc::c_short)
}

/// A new open file description for the same file as `fd` (via `/proc/self/fd`), `O_RDWR |
/// O_CLOEXEC`. Works after the file's name is unlinked.
pub(crate) fn reopen(fd: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    let path = std::ffi::CString::new(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: `path` is a valid NUL-terminated string for the call.
    let raw = unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `raw` is a descriptor we just opened and own exclusively.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    fn tmpfile() -> std::fs::File {
        let path = std::env::temp_dir().join(format!(
            "baton-ipc-lock-test-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        std::fs::remove_file(&path).unwrap();
        f
    }

    #[test]
    fn a_lock_is_visible_to_other_descriptions_and_gone_when_its_descriptor_closes() {
        let f = tmpfile();
        let holder = reopen(f.as_fd()).unwrap();
        let checker = reopen(f.as_fd()).unwrap();
        assert!(!held_by_other(checker.as_fd(), 3).unwrap());
        assert!(try_lock(holder.as_fd(), 3).unwrap());
        assert!(held_by_other(checker.as_fd(), 3).unwrap());
        assert!(!held_by_other(checker.as_fd(), 4).unwrap(), "one byte only");
        assert!(!try_lock(checker.as_fd(), 3).unwrap(), "exclusive");
        // Checking did not take it: still held after many checks.
        for _ in 0..3 {
            assert!(held_by_other(checker.as_fd(), 3).unwrap());
        }
        drop(holder);
        assert!(!held_by_other(checker.as_fd(), 3).unwrap());
        assert!(try_lock(checker.as_fd(), 3).unwrap());
    }
}
