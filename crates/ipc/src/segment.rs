//! The control segment: one shared-memory file per instance, `/dev/shm/baton-<instance>`.
//!
//! Contract: the creator makes the file with `O_CREAT | O_EXCL` and mode 0600, takes the
//! creator liveness lock, sizes and maps it, constructs every region, writes the header, and
//! stores the magic number last (`Release`), so an attacher that sees the magic (`Acquire`) sees
//! a complete segment. Attach checks every header field against what the attacher expects and
//! fails with both values named; it never trusts a size it has not checked against the file.
//! The creator unlinks the file on clean shutdown; a later create that finds a file whose
//! creator lock the kernel has released removes it first, so `/dev/shm` stays flat across
//! crashes. The first 16 bytes (magic, version) keep their meaning in every future version.

use crate::arena::{init_regions, Arena};
use crate::layout::{Layout, LayoutError, LayoutSpec, HEADER_SIZE, LAYOUT_VERSION};
use crate::limits::Limits;
use crate::liveness;
use crate::sync::{AtomicU64, Ordering};
use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::sys::mman::{MapFlags, ProtFlags};
use nix::sys::stat::Mode;
use std::num::NonZeroUsize;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::PathBuf;
use std::ptr::NonNull;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The magic number at offset 0 of every segment: `"BATONSEG"` little-endian.
pub const MAGIC: u64 = u64::from_le_bytes(*b"BATONSEG");

/// Longest instance id, in bytes.
pub const MAX_INSTANCE_LEN: usize = 64;

/// Directory where POSIX shared memory objects appear.
pub const SHM_DIR: &str = "/dev/shm";

/// A file that is not yet initialised is only removed as stale once it is this old, so a
/// creator between `shm_open` and taking its lock is never mistaken for a dead one.
const INIT_GRACE: Duration = Duration::from_secs(2);

/// How long an attacher takes a file without magic and without a live creator as still being
/// initialised: longer than [`INIT_GRACE`], so that a successor creator has time to replace
/// it once it is stale before attachers give up on it.
const ATTACH_GRACE: Duration = Duration::from_secs(5);

/// The segment header at offset 0. `#[repr(C)]`; fits in [`HEADER_SIZE`].
#[repr(C)]
struct SegmentHeader {
    /// [`MAGIC`] once the segment is complete; 0 before. Offset 0 in every version.
    magic: AtomicU64,
    /// [`LAYOUT_VERSION`]. Offset 8 in every version.
    layout_version: u32,
    /// `size_of::<SegmentHeader>()`.
    header_size: u32,
    /// [`Layout::hash`].
    layout_hash: u64,
    /// [`Layout::size`]: bytes of the whole segment.
    size: u64,
    /// Wall-clock creation time, ns since the Unix epoch.
    created_unix_ns: u64,
    creator_pid: u32,
    instance_len: u32,
    /// Creator's `/proc/<pid>/stat` start time.
    creator_start_time: u64,
    instance: [u8; MAX_INSTANCE_LEN],
    limits: Limits,
    /// Free for the scheduler to publish status bits (e.g. "a worker is attached" for /health).
    status: AtomicU64,
    /// Reserved status words.
    status_spare: [AtomicU64; 7],
}

const _: () = assert!(std::mem::size_of::<SegmentHeader>() <= HEADER_SIZE);
const _: () = assert!(std::mem::offset_of!(SegmentHeader, layout_version) == 8);

/// `bytes` in MiB (or GiB from 10 GiB on), for messages.
fn mib(bytes: u64) -> String {
    let m = bytes as f64 / (1u64 << 20) as f64;
    if m >= 10240.0 {
        format!("{:.1} GiB", m / 1024.0)
    } else {
        format!("{m:.1} MiB")
    }
}

/// Errors from creating, attaching or removing a segment. Each names the instance or path and,
/// for a mismatch, the expected and found values.
#[derive(Debug, thiserror::Error)]
pub enum SegmentError {
    /// The instance id is unusable as a file name.
    #[error("instance id {instance:?} is invalid: {reason}")]
    BadInstance {
        /// The id given.
        instance: String,
        /// Why.
        reason: &'static str,
    },
    /// The layout description is invalid.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// The file system holding segments has less room than the segment's size: writing its
    /// tables would end in SIGBUS once tmpfs runs out, so creation is refused up front.
    #[error(
        "instance {instance:?}: the segment needs {} of shared memory but {path}'s file system \
         has {} free; give fewer request slots or a shorter length (--max-num-seqs, \
         --max-model-len, --frontends), or a larger /dev/shm (a container's default is 64 MiB: \
         docker run --shm-size or --ipc=host)",
        mib(*.size), mib(*.available)
    )]
    NoRoom {
        /// The instance.
        instance: String,
        /// The segment file.
        path: String,
        /// Bytes the segment needs.
        size: u64,
        /// Bytes free for this user on its file system.
        available: u64,
    },
    /// Another process created this instance and is still running.
    #[error("instance {instance} is running, pid {pid} (segment {path})")]
    Running {
        /// The instance.
        instance: String,
        /// The creator's pid (0 if its header is not written yet).
        pid: u32,
        /// The segment file.
        path: String,
    },
    /// A creator is still initialising this segment.
    #[error("instance {instance} is being created by another process (segment {path})")]
    Initializing {
        /// The instance.
        instance: String,
        /// The segment file.
        path: String,
    },
    /// No segment exists for this instance.
    #[error(
        "instance {instance} has no segment ({path} does not exist); is the scheduler running?"
    )]
    NotFound {
        /// The instance.
        instance: String,
        /// The path looked for.
        path: String,
    },
    /// The segment exists but its creator is dead (a stale segment).
    #[error("instance {instance} is not running: its creator, pid {pid}, is dead (stale segment {path})")]
    CreatorDead {
        /// The instance.
        instance: String,
        /// The dead creator's pid.
        pid: u32,
        /// The segment file.
        path: String,
    },
    /// The file is smaller than the header, or than the size its header declares.
    #[error("segment {path} is truncated: {found} bytes, expected at least {expected}")]
    Truncated {
        /// The segment file.
        path: String,
        /// Bytes needed.
        expected: u64,
        /// Bytes in the file.
        found: u64,
    },
    /// The file does not start with [`MAGIC`]: not a Baton segment (or garbage).
    #[error("segment {path} has bad magic: expected {expected:#018x}, found {found:#018x} (not a Baton segment)")]
    BadMagic {
        /// The segment file.
        path: String,
        /// [`MAGIC`].
        expected: u64,
        /// What was there.
        found: u64,
    },
    /// The segment was made by another format version.
    #[error("segment {path} layout version mismatch: expected {expected}, found {found}")]
    VersionMismatch {
        /// The segment file.
        path: String,
        /// [`LAYOUT_VERSION`].
        expected: u32,
        /// The header's version.
        found: u32,
    },
    /// The header's own size field disagrees with this build's header.
    #[error("segment {path} header size mismatch: expected {expected}, found {found}")]
    HeaderSizeMismatch {
        /// The segment file.
        path: String,
        /// This build's header size.
        expected: u32,
        /// The header's.
        found: u32,
    },
    /// The segment was laid out from another description (slot sizes, capacities, names).
    #[error("segment {path} layout hash mismatch: expected {expected:#018x}, found {found:#018x}")]
    HashMismatch {
        /// The segment file.
        path: String,
        /// Hash of the attacher's layout.
        expected: u64,
        /// The header's.
        found: u64,
    },
    /// The segment's declared size differs from the attacher's layout.
    #[error("segment {path} size mismatch: expected {expected} bytes, found {found}")]
    SizeMismatch {
        /// The segment file.
        path: String,
        /// Size of the attacher's layout.
        expected: u64,
        /// The header's.
        found: u64,
    },
    /// The header names another instance.
    #[error("segment {path} instance mismatch: expected {expected:?}, found {found:?}")]
    InstanceMismatch {
        /// The segment file.
        path: String,
        /// The instance asked for.
        expected: String,
        /// The header's.
        found: String,
    },
    /// A system call failed.
    #[error("{op} {path}: {source}")]
    Sys {
        /// What was being done.
        op: &'static str,
        /// The segment file.
        path: String,
        /// The error.
        source: std::io::Error,
    },
}

fn sys<'a>(op: &'static str, path: &'a str) -> impl FnOnce(Errno) -> SegmentError + 'a {
    move |e| SegmentError::Sys {
        op,
        path: path.to_owned(),
        source: std::io::Error::from(e),
    }
}

fn sys_io<'a>(op: &'static str, path: &'a str) -> impl FnOnce(std::io::Error) -> SegmentError + 'a {
    move |source| SegmentError::Sys {
        op,
        path: path.to_owned(),
        source,
    }
}

/// Facts from a segment's header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentInfo {
    /// The instance id.
    pub instance: String,
    /// [`LAYOUT_VERSION`] of the creator.
    pub layout_version: u32,
    /// [`Layout::hash`].
    pub layout_hash: u64,
    /// Bytes.
    pub size: u64,
    /// Creation time, ns since the Unix epoch.
    pub created_unix_ns: u64,
    /// The creator's pid.
    pub creator_pid: u32,
    /// The creator's start time (clock ticks since boot).
    pub creator_start_time: u64,
}

/// A mapped control segment. The creator's `Segment` unlinks the file when dropped; views made
/// from it (rings, tables) keep the mapping alive after that. Derefs to [`Arena`].
pub struct Segment {
    arena: Arena,
    instance: String,
    path: String,
    creator: bool,
    /// `(st_dev, st_ino)` of our file, so we never unlink a successor's file by name.
    identity: (u64, u64),
    unlinked: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for Segment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Segment")
            .field("path", &self.path)
            .field("creator", &self.creator)
            .field("info", &self.info())
            .finish()
    }
}

/// `/dev/shm/baton-<instance>`.
pub fn segment_path(instance: &str) -> PathBuf {
    PathBuf::from(SHM_DIR).join(format!("baton-{instance}"))
}

fn shm_name(instance: &str) -> String {
    format!("/baton-{instance}")
}

/// Checks an instance name as [`Segment::create`] does: 1 to 64 bytes of ASCII letters,
/// digits, `-`, `_` and `.`, not starting with `.`.
///
/// # Errors
/// [`SegmentError::BadInstance`] saying which rule the name breaks.
pub fn check_instance(instance: &str) -> Result<(), SegmentError> {
    let bad = |reason| {
        Err(SegmentError::BadInstance {
            instance: instance.to_owned(),
            reason,
        })
    };
    if instance.is_empty() || instance.len() > MAX_INSTANCE_LEN {
        return bad("must be 1 to 64 bytes");
    }
    if instance.starts_with('.') {
        return bad("must not start with '.'");
    }
    if !instance
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
    {
        return bad("only ASCII letters, digits, '-', '_' and '.' are allowed");
    }
    Ok(())
}

fn identity(fd: &OwnedFd, path: &str) -> Result<(u64, u64), SegmentError> {
    let st = nix::sys::stat::fstat(fd.as_raw_fd()).map_err(sys("fstat", path))?;
    Ok((st.st_dev, st.st_ino))
}

/// A segment file opened and its header checked by [`open_checked`].
struct Opened {
    fd: OwnedFd,
    path: String,
    file_size: u64,
    identity: (u64, u64),
    /// A copy of the header as read (only the plain fields are meaningful).
    header: SegmentHeader,
}

/// Opens `instance`'s segment with `flags` and checks the parts of its header that do not
/// depend on a layout: the file is at least a header long, starts with [`MAGIC`], and has this
/// [`LAYOUT_VERSION`] and header size. A file that is too short or has no magic yet while its
/// creator holds the creation lock is [`SegmentError::Initializing`] (the creator is between
/// `shm_open` and publishing the magic), so attachers that retry on it never race a creator.
fn open_checked(instance: &str, flags: OFlag) -> Result<Opened, SegmentError> {
    check_instance(instance)?;
    let path = segment_path(instance).display().to_string();
    let fd = match nix::sys::mman::shm_open(shm_name(instance).as_str(), flags, Mode::empty()) {
        Ok(fd) => fd,
        Err(Errno::ENOENT) => {
            return Err(SegmentError::NotFound {
                instance: instance.to_owned(),
                path,
            })
        }
        Err(e) => return Err(sys("shm_open", &path)(e)),
    };
    let st = nix::sys::stat::fstat(fd.as_raw_fd()).map_err(sys("fstat", &path))?;
    let file_size = st.st_size.max(0) as u64;
    let initializing = |fd: &OwnedFd| liveness::held_by_other(fd.as_fd(), 0).unwrap_or(false);
    if file_size < HEADER_SIZE as u64 {
        if initializing(&fd) {
            return Err(SegmentError::Initializing {
                instance: instance.to_owned(),
                path,
            });
        }
        return Err(SegmentError::Truncated {
            path,
            expected: HEADER_SIZE as u64,
            found: file_size,
        });
    }
    let mut buf = vec![0u8; std::mem::size_of::<SegmentHeader>()];
    nix::sys::uio::pread(&fd, &mut buf, 0).map_err(sys("pread", &path))?;
    // SAFETY: `SegmentHeader` is `#[repr(C)]` plain data and atomics, valid for any bit
    // pattern; `buf` holds exactly one header and `read_unaligned` copes with alignment.
    let header: SegmentHeader = unsafe { std::ptr::read_unaligned(buf.as_ptr().cast()) };
    let magic = header.magic.load(Ordering::Relaxed);
    if magic != MAGIC {
        // No magic yet: a live creator is still initialising, or one died doing it and a
        // successor will replace the file once it is stale (after INIT_GRACE).
        if magic == 0 && (initializing(&fd) || younger_than(&st, ATTACH_GRACE)) {
            return Err(SegmentError::Initializing {
                instance: instance.to_owned(),
                path,
            });
        }
        return Err(SegmentError::BadMagic {
            path,
            expected: MAGIC,
            found: magic,
        });
    }
    if header.layout_version != LAYOUT_VERSION {
        return Err(SegmentError::VersionMismatch {
            path,
            expected: LAYOUT_VERSION,
            found: header.layout_version,
        });
    }
    let header_size = std::mem::size_of::<SegmentHeader>() as u32;
    if header.header_size != header_size {
        return Err(SegmentError::HeaderSizeMismatch {
            path,
            expected: header_size,
            found: header.header_size,
        });
    }
    Ok(Opened {
        fd,
        path,
        file_size,
        identity: (st.st_dev, st.st_ino),
        header,
    })
}

/// An owned `MAP_SHARED` mapping, unmapped on drop unless handed to an [`Arena`].
struct Mapping {
    base: NonNull<u8>,
    len: usize,
}

impl Mapping {
    fn new(fd: &OwnedFd, len: usize, path: &str) -> Result<Mapping, SegmentError> {
        let n = NonZeroUsize::new(len).ok_or_else(|| SegmentError::Truncated {
            path: path.to_owned(),
            expected: HEADER_SIZE as u64,
            found: 0,
        })?;
        // SAFETY: a fresh shared mapping of a file we hold open; no existing Rust reference
        // aliases it. `len` is at most the file size (checked by callers), so no access faults.
        let p = unsafe {
            nix::sys::mman::mmap(
                None,
                n,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_SHARED,
                fd.as_fd(),
                0,
            )
        }
        .map_err(sys("mmap", path))?;
        Ok(Mapping {
            base: p.cast(),
            len,
        })
    }

    fn header(&self) -> &SegmentHeader {
        // SAFETY: the mapping is at least HEADER_SIZE bytes (callers check), page-aligned, and
        // every bit pattern is a valid `SegmentHeader` (integers, byte arrays and atomics).
        unsafe { self.base.cast::<SegmentHeader>().as_ref() }
    }

    fn into_arena(self, layout: Layout, fd: OwnedFd) -> Arena {
        let (base, len) = (self.base, self.len);
        std::mem::forget(self);
        // SAFETY: `base..base+len` is our live MAP_SHARED mapping of `fd`, now owned by the
        // arena; `len >= layout.size()` and the regions were initialised (by us, or by the
        // creator before it published the magic we checked).
        unsafe { Arena::from_mapping(base, len, layout, fd) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: our own mapping, no longer referenced.
        let _ = unsafe { nix::sys::mman::munmap(self.base.cast(), self.len) };
    }
}

/// What an existing segment file turned out to be.
enum Existing {
    /// Gone by the time we looked.
    Vanished,
    /// Its creator holds the creator lock.
    Running { pid: u32 },
    /// Being initialised right now.
    Initializing,
    /// Creator dead; holds the opened file (with our creator lock on it) and its identity.
    Stale { fd: OwnedFd, identity: (u64, u64) },
}

/// True while the file was last modified less than `grace` ago.
fn younger_than(st: &nix::sys::stat::FileStat, grace: Duration) -> bool {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .saturating_sub(Duration::new(st.st_mtime as u64, st.st_mtime_nsec as u32))
        < grace
}

fn inspect(instance: &str, path: &str) -> Result<Existing, SegmentError> {
    let fd =
        match nix::sys::mman::shm_open(shm_name(instance).as_str(), OFlag::O_RDWR, Mode::empty()) {
            Ok(fd) => fd,
            Err(Errno::ENOENT) => return Ok(Existing::Vanished),
            Err(e) => return Err(sys("shm_open", path)(e)),
        };
    let held = liveness::held_by_other(fd.as_fd(), 0).map_err(sys_io("F_OFD_GETLK", path))?;
    let st = nix::sys::stat::fstat(fd.as_raw_fd()).map_err(sys("fstat", path))?;
    let (pid, complete) = if st.st_size as usize >= HEADER_SIZE {
        let m = Mapping::new(&fd, HEADER_SIZE, path)?;
        let h = m.header();
        (h.creator_pid, h.magic.load(Ordering::Acquire) == MAGIC)
    } else {
        (0, false)
    };
    if held {
        return Ok(if complete {
            Existing::Running { pid }
        } else {
            Existing::Initializing
        });
    }
    if !complete && younger_than(&st, INIT_GRACE) {
        return Ok(Existing::Initializing);
    }
    // Take the creator lock ourselves: a concurrent cleaner now sees it held and backs off.
    if !liveness::try_lock(fd.as_fd(), 0).map_err(sys_io("F_OFD_SETLK", path))? {
        return Ok(Existing::Running { pid });
    }
    let identity = (st.st_dev, st.st_ino);
    Ok(Existing::Stale { fd, identity })
}

/// Unlink `path` only if it still names the file `identity`.
fn unlink_if_same(instance: &str, path: &str, identity: (u64, u64)) -> Result<bool, SegmentError> {
    match nix::sys::stat::stat(path) {
        Ok(st) if (st.st_dev, st.st_ino) == identity => {}
        Ok(_) | Err(Errno::ENOENT) => return Ok(false),
        Err(e) => return Err(sys("stat", path)(e)),
    }
    match nix::sys::mman::shm_unlink(shm_name(instance).as_str()) {
        Ok(()) => Ok(true),
        Err(Errno::ENOENT) => Ok(false),
        Err(e) => Err(sys("shm_unlink", path)(e)),
    }
}

impl Segment {
    /// Create the segment for `instance`, laid out by `spec`, publishing `limits`.
    ///
    /// Makes `/dev/shm/baton-<instance>` with `O_CREAT | O_EXCL` and mode 0600. If a segment
    /// exists and its creator is alive, fails with [`SegmentError::Running`]; if its creator is
    /// dead (the kernel released its lock), removes it and creates a fresh one.
    pub fn create(
        instance: &str,
        spec: &LayoutSpec,
        limits: Limits,
    ) -> Result<Segment, SegmentError> {
        check_instance(instance)?;
        let layout = spec.layout()?;
        let path = segment_path(instance).display().to_string();
        let mode = Mode::S_IRUSR | Mode::S_IWUSR;
        for _ in 0..4 {
            let flags = OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_RDWR;
            match nix::sys::mman::shm_open(shm_name(instance).as_str(), flags, mode) {
                Ok(fd) => return Segment::init_new(instance, &path, layout, limits, fd),
                Err(Errno::EEXIST) => {}
                Err(e) => return Err(sys("shm_open", &path)(e)),
            }
            match inspect(instance, &path)? {
                Existing::Vanished => {}
                Existing::Running { pid } => {
                    return Err(SegmentError::Running {
                        instance: instance.to_owned(),
                        pid,
                        path,
                    })
                }
                Existing::Initializing => {
                    return Err(SegmentError::Initializing {
                        instance: instance.to_owned(),
                        path,
                    })
                }
                Existing::Stale { fd, identity } => {
                    unlink_if_same(instance, &path, identity)?;
                    drop(fd);
                }
            }
        }
        Err(SegmentError::Initializing {
            instance: instance.to_owned(),
            path,
        })
    }

    /// [`Segment::create`], retried while it reports [`SegmentError::Initializing`], for up to
    /// `wait`. What a daemon starting an instance wants: a file left by a creator killed
    /// between `shm_open` and publishing its magic is taken as stale only once it is
    /// `INIT_GRACE` (2 s) old, and a live creator finishes initialising in milliseconds (then
    /// this fails with [`SegmentError::Running`]).
    ///
    /// # Errors
    /// As [`Segment::create`]; [`SegmentError::Initializing`] once `wait` has passed.
    pub fn create_waiting(
        instance: &str,
        spec: &LayoutSpec,
        limits: Limits,
        wait: Duration,
    ) -> Result<Segment, SegmentError> {
        let deadline = std::time::Instant::now() + wait;
        loop {
            match Segment::create(instance, spec, limits) {
                Err(SegmentError::Initializing { .. }) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(50));
                }
                r => return r,
            }
        }
    }

    fn init_new(
        instance: &str,
        path: &str,
        layout: Layout,
        limits: Limits,
        fd: OwnedFd,
    ) -> Result<Segment, SegmentError> {
        let identity = identity(&fd, path)?;
        // From here on, any failure removes the half-made file.
        let cleanup = |e: SegmentError| {
            let _ = unlink_if_same(instance, path, identity);
            e
        };
        // The umask may only have narrowed the mode; make it exactly 0600.
        nix::sys::stat::fchmod(fd.as_raw_fd(), Mode::S_IRUSR | Mode::S_IWUSR)
            .map_err(sys("fchmod", path))
            .map_err(cleanup)?;
        if !liveness::try_lock(fd.as_fd(), 0)
            .map_err(sys_io("F_OFD_SETLK", path))
            .map_err(cleanup)?
        {
            return Err(cleanup(SegmentError::Initializing {
                instance: instance.to_owned(),
                path: path.to_owned(),
            }));
        }
        // tmpfs allocates on first touch: a segment larger than the room left would take
        // SIGBUS on a later write instead of failing here.
        if let Ok(st) = nix::sys::statvfs::fstatvfs(&fd) {
            // fsblkcnt_t and c_ulong are u64 here but not on every target.
            #[allow(clippy::unnecessary_cast)]
            let available =
                (st.blocks_available() as u64).saturating_mul(st.fragment_size() as u64);
            if layout.size() as u64 > available {
                return Err(cleanup(SegmentError::NoRoom {
                    instance: instance.to_owned(),
                    path: path.to_owned(),
                    size: layout.size() as u64,
                    available,
                }));
            }
        }
        nix::unistd::ftruncate(&fd, layout.size() as i64)
            .map_err(sys("ftruncate", path))
            .map_err(cleanup)?;
        let map = Mapping::new(&fd, layout.size(), path).map_err(cleanup)?;
        // SAFETY: a fresh mapping of `layout.size()` zero bytes (ftruncate zero-fills),
        // page-aligned; no one else can use it before the magic is published below.
        unsafe { init_regions(map.base.as_ptr(), &layout) };
        let mut name = [0u8; MAX_INSTANCE_LEN];
        name[..instance.len()].copy_from_slice(instance.as_bytes());
        let pid = std::process::id();
        let header = SegmentHeader {
            magic: AtomicU64::new(0),
            layout_version: LAYOUT_VERSION,
            header_size: std::mem::size_of::<SegmentHeader>() as u32,
            layout_hash: layout.hash(),
            size: layout.size() as u64,
            created_unix_ns: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64),
            creator_pid: pid,
            instance_len: instance.len() as u32,
            creator_start_time: crate::process::start_time(pid).unwrap_or(0),
            instance: name,
            limits,
            status: AtomicU64::new(0),
            status_spare: Default::default(),
        };
        // SAFETY: offset 0 of our exclusive, page-aligned mapping; the header fits in the
        // reserved first page (asserted at compile time).
        unsafe { std::ptr::write(map.base.cast::<SegmentHeader>().as_ptr(), header) };
        // Publish: everything written above happens-before any Acquire load that sees MAGIC.
        map.header().magic.store(MAGIC, Ordering::Release);
        Ok(Segment {
            arena: map.into_arena(layout, fd),
            instance: instance.to_owned(),
            path: path.to_owned(),
            creator: true,
            identity,
            unlinked: false.into(),
        })
    }

    /// Attach to the running segment of `instance`, which must have been created from a spec
    /// identical to `spec`. Checks, in order: the file exists, is at least a header long, starts
    /// with [`MAGIC`], has this [`LAYOUT_VERSION`] and header size, is as long as its header
    /// says, has `spec`'s layout hash and size, names `instance`, and its creator is alive.
    pub fn attach(instance: &str, spec: &LayoutSpec) -> Result<Segment, SegmentError> {
        let layout = spec.layout()?;
        let opened = open_checked(instance, OFlag::O_RDWR)?;
        let Opened {
            fd,
            path,
            file_size,
            identity,
            ..
        } = opened;
        let map = Mapping::new(&fd, file_size as usize, &path)?;
        let h = map.header();
        if h.size > file_size {
            return Err(SegmentError::Truncated {
                path,
                expected: h.size,
                found: file_size,
            });
        }
        if h.layout_hash != layout.hash() {
            return Err(SegmentError::HashMismatch {
                path,
                expected: layout.hash(),
                found: h.layout_hash,
            });
        }
        if h.size != layout.size() as u64 {
            return Err(SegmentError::SizeMismatch {
                path,
                expected: layout.size() as u64,
                found: h.size,
            });
        }
        let found = instance_of(h);
        if found != instance {
            return Err(SegmentError::InstanceMismatch {
                path,
                expected: instance.to_owned(),
                found,
            });
        }
        if !liveness::held_by_other(fd.as_fd(), 0).map_err(sys_io("F_OFD_GETLK", &path))? {
            return Err(SegmentError::CreatorDead {
                instance: instance.to_owned(),
                pid: h.creator_pid,
                path,
            });
        }
        Ok(Segment {
            arena: map.into_arena(layout, fd),
            instance: instance.to_owned(),
            path,
            creator: false,
            identity,
            unlinked: false.into(),
        })
    }

    /// Read the limits published in the header of `instance`'s segment without attaching, so
    /// that an attacher can rebuild the creator's layout (whose shape depends on the limits)
    /// before [`Segment::attach`] checks it field by field. Checks the magic, the layout
    /// version and the header size first.
    pub fn peek_limits(instance: &str) -> Result<Limits, SegmentError> {
        Ok(open_checked(instance, OFlag::O_RDONLY)?.header.limits)
    }

    /// Remove the segment of `instance` if its creator is dead. Returns whether a file was
    /// removed. Fails with [`SegmentError::Running`] if the creator is alive.
    pub fn remove_stale(instance: &str) -> Result<bool, SegmentError> {
        check_instance(instance)?;
        let path = segment_path(instance).display().to_string();
        match inspect(instance, &path)? {
            Existing::Vanished => Ok(false),
            Existing::Running { pid } => Err(SegmentError::Running {
                instance: instance.to_owned(),
                pid,
                path,
            }),
            Existing::Initializing => Err(SegmentError::Initializing {
                instance: instance.to_owned(),
                path,
            }),
            Existing::Stale { fd, identity } => {
                let removed = unlink_if_same(instance, &path, identity)?;
                drop(fd);
                Ok(removed)
            }
        }
    }

    fn header(&self) -> &SegmentHeader {
        // SAFETY: the arena maps at least HEADER_SIZE bytes starting with a header we wrote or
        // validated; any bit pattern is a valid `SegmentHeader`.
        unsafe { &*(self.arena.inner().base() as *const SegmentHeader) }
    }

    /// For an attacher: whether the process that created this segment still holds its
    /// creation lock, i.e. is alive (kernel evidence: the OFD lock dies with the process). A
    /// segment whose creator died stays mapped here, but a restarted scheduler makes a new
    /// one, so an attacher that sees `false` must attach again or exit. The creator itself
    /// always gets `true`. One `fcntl` call; an error counts as alive.
    pub fn creator_alive(&self) -> bool {
        self.creator || self.arena.inner().lock_held(0)
    }

    /// The instance id.
    pub fn instance(&self) -> &str {
        &self.instance
    }

    /// `/dev/shm/baton-<instance>`.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// True for the process that created the segment (and will unlink it).
    pub fn is_creator(&self) -> bool {
        self.creator
    }

    /// The limits the creator published.
    pub fn limits(&self) -> Limits {
        self.header().limits
    }

    /// A status word for the scheduler to publish (e.g. bit 0: a worker is attached). Starts 0.
    pub fn status(&self) -> &AtomicU64 {
        &self.header().status
    }

    /// The header's identity fields.
    pub fn info(&self) -> SegmentInfo {
        let h = self.header();
        SegmentInfo {
            instance: instance_of(h),
            layout_version: h.layout_version,
            layout_hash: h.layout_hash,
            size: h.size,
            created_unix_ns: h.created_unix_ns,
            creator_pid: h.creator_pid,
            creator_start_time: h.creator_start_time,
        }
    }

    /// The arena (also reachable through `Deref`).
    pub fn arena(&self) -> &Arena {
        &self.arena
    }

    /// Unlink the segment's name now (idempotent; only if the name still refers to this
    /// segment). Processes that have it mapped keep using it. Done automatically when the
    /// creator's `Segment` is dropped.
    pub fn unlink(&self) -> Result<(), SegmentError> {
        if self
            .unlinked
            .swap(true, std::sync::atomic::Ordering::AcqRel)
        {
            return Ok(());
        }
        unlink_if_same(&self.instance, &self.path, self.identity).map(|_| ())
    }

    #[cfg(test)]
    fn fd_for_test(&self) -> std::os::fd::BorrowedFd<'_> {
        self.arena.inner().fd().expect("a segment is file-backed")
    }
}

fn instance_of(h: &SegmentHeader) -> String {
    let n = (h.instance_len as usize).min(MAX_INSTANCE_LEN);
    String::from_utf8_lossy(&h.instance[..n]).into_owned()
}

impl std::ops::Deref for Segment {
    type Target = Arena;
    fn deref(&self) -> &Arena {
        &self.arena
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        if self.creator {
            let _ = self.unlink();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;
    use std::sync::atomic::AtomicU32 as StdAtomicU32;

    /// A unique instance id per test (pid + counter), removed at the end even on panic.
    struct TestInstance(String);

    impl TestInstance {
        fn new() -> TestInstance {
            static N: StdAtomicU32 = StdAtomicU32::new(0);
            let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            TestInstance(format!("ipc-unit-{}-{n}", std::process::id()))
        }
    }

    impl Drop for TestInstance {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(segment_path(&self.0));
        }
    }

    fn spec() -> LayoutSpec {
        LayoutSpec::new()
            .participants("participants", 4)
            .ring("r", 8, 16)
            .atomics_u64("released", 2)
    }

    fn limits() -> Limits {
        Limits {
            block_size: 16,
            max_model_len: 4096,
            max_num_seqs: 256,
            frontend_in_capacity: 8,
            ..Limits::default()
        }
    }

    /// Sets the segment file's mtime a minute back (past [`INIT_GRACE`]).
    fn age(instance: &str) {
        std::fs::File::options()
            .write(true)
            .open(segment_path(instance))
            .unwrap()
            .set_modified(SystemTime::now() - Duration::from_secs(60))
            .unwrap();
    }

    /// Overwrite bytes of the segment file directly, as a foreign or corrupting writer would.
    fn poke(instance: &str, offset: usize, bytes: &[u8]) {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(segment_path(instance))
            .unwrap();
        f.write_all_at(bytes, offset as u64).unwrap();
    }

    /// A segment larger than the room left on /dev/shm is refused before the file is sized
    /// (tmpfs would SIGBUS on a later write), names both sizes, and leaves no file.
    #[test]
    fn a_segment_past_the_room_on_dev_shm_is_refused_and_leaves_no_file() {
        let id = TestInstance::new();
        let st = nix::sys::statvfs::statvfs("/dev/shm").unwrap();
        #[allow(clippy::unnecessary_cast)]
        let free = st.blocks_available() as u64 * st.fragment_size() as u64;
        let words = (free / 8 + (1 << 20)) as usize;
        let big = spec().atomics_u64("huge", words);
        let err = Segment::create(&id.0, &big, limits()).unwrap_err();
        assert!(matches!(err, SegmentError::NoRoom { .. }), "{err}");
        let msg = err.to_string();
        assert!(
            msg.contains("free") && msg.contains("--max-num-seqs"),
            "{msg}"
        );
        assert!(!segment_path(&id.0).exists());
        // One that fits is created as before.
        drop(Segment::create(&id.0, &spec(), limits()).unwrap());
    }

    #[test]
    fn create_makes_a_0600_file_that_attach_accepts_with_the_same_header() {
        let id = TestInstance::new();
        let seg = Segment::create(&id.0, &spec(), limits()).unwrap();
        let meta = std::fs::metadata(segment_path(&id.0)).unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        assert_eq!(meta.len(), spec().layout().unwrap().size() as u64);
        let other = Segment::attach(&id.0, &spec()).unwrap();
        assert!(seg.is_creator() && !other.is_creator());
        assert_eq!(other.limits(), limits());
        assert_eq!(other.info(), seg.info());
        let info = seg.info();
        assert_eq!(info.instance, id.0);
        assert_eq!(info.creator_pid, std::process::id());
        assert_eq!(info.layout_version, LAYOUT_VERSION);
        assert!(info.created_unix_ns > 0);
        assert_eq!(
            info.creator_start_time,
            crate::process::start_time(std::process::id()).unwrap()
        );
        seg.status().store(1, Ordering::Release);
        assert_eq!(other.status().load(Ordering::Acquire), 1);
    }

    #[test]
    fn rings_and_arrays_are_shared_between_creator_and_attacher() {
        let id = TestInstance::new();
        let seg = Segment::create(&id.0, &spec(), limits()).unwrap();
        let other = Segment::attach(&id.0, &spec()).unwrap();
        let mut p = seg.producer::<[u64; 2]>("r").unwrap();
        let mut c = other.consumer::<[u64; 2]>("r").unwrap();
        p.try_push([1, 2]).unwrap();
        assert_eq!(c.pop(), Some([1, 2]));
        other.atomics_u64("released").unwrap()[1].store(9, Ordering::Relaxed);
        assert_eq!(
            seg.atomics_u64("released").unwrap()[1].load(Ordering::Relaxed),
            9
        );
    }

    #[test]
    fn clean_shutdown_unlinks_the_segment() {
        let id = TestInstance::new();
        let seg = Segment::create(&id.0, &spec(), limits()).unwrap();
        let attached = Segment::attach(&id.0, &spec()).unwrap();
        drop(attached);
        assert!(segment_path(&id.0).exists(), "an attacher does not unlink");
        drop(seg);
        assert!(!segment_path(&id.0).exists());
        assert!(matches!(
            Segment::attach(&id.0, &spec()),
            Err(SegmentError::NotFound { .. })
        ));
    }

    #[test]
    fn a_second_create_of_a_running_instance_names_its_pid() {
        let id = TestInstance::new();
        let _seg = Segment::create(&id.0, &spec(), limits()).unwrap();
        let e = Segment::create(&id.0, &spec(), limits()).unwrap_err();
        assert!(
            matches!(e, SegmentError::Running { pid, .. } if pid == std::process::id()),
            "{e}"
        );
        let msg = e.to_string();
        assert!(
            msg.contains(&format!(
                "instance {} is running, pid {}",
                id.0,
                std::process::id()
            )),
            "{msg}"
        );
    }

    /// Simulate a creator that died: drop the creator lock without unlinking (the kernel drops
    /// the lock of a dead process exactly like this).
    fn die_without_cleanup(seg: Segment) {
        let seg = std::mem::ManuallyDrop::new(seg);
        // SAFETY: reading the arena out of a ManuallyDrop that is never used again.
        let arena = unsafe { std::ptr::read(&seg.arena) };
        drop(arena); // unmaps and closes the fd: the creator lock is released
    }

    #[test]
    fn a_create_that_finds_a_dead_creators_segment_removes_it_and_proceeds() {
        let id = TestInstance::new();
        let seg = Segment::create(&id.0, &spec(), limits()).unwrap();
        let old = identity_of(&id.0);
        die_without_cleanup(seg);
        assert!(segment_path(&id.0).exists());
        assert!(matches!(
            Segment::attach(&id.0, &spec()),
            Err(SegmentError::CreatorDead { pid, .. }) if pid == std::process::id()
        ));
        let seg = Segment::create(&id.0, &spec(), limits()).unwrap();
        assert_ne!(identity_of(&id.0), old, "a fresh file");
        drop(seg);
        assert!(!segment_path(&id.0).exists());
    }

    fn identity_of(instance: &str) -> (u64, u64) {
        let st = nix::sys::stat::stat(&segment_path(instance)).unwrap();
        (st.st_dev, st.st_ino)
    }

    #[test]
    fn remove_stale_removes_only_dead_segments() {
        let id = TestInstance::new();
        let seg = Segment::create(&id.0, &spec(), limits()).unwrap();
        assert!(matches!(
            Segment::remove_stale(&id.0),
            Err(SegmentError::Running { .. })
        ));
        die_without_cleanup(seg);
        assert!(Segment::remove_stale(&id.0).unwrap());
        assert!(!segment_path(&id.0).exists());
        assert!(!Segment::remove_stale(&id.0).unwrap());
    }

    #[test]
    fn attach_to_a_missing_segment_says_so() {
        let id = TestInstance::new();
        let e = Segment::attach(&id.0, &spec()).unwrap_err();
        assert!(matches!(e, SegmentError::NotFound { .. }), "{e}");
    }

    #[test]
    fn attach_with_another_layout_fails_naming_both_hashes() {
        let id = TestInstance::new();
        let _seg = Segment::create(&id.0, &spec(), limits()).unwrap();
        let other = LayoutSpec::new()
            .participants("participants", 4)
            .ring("r", 8, 24) // another slot size
            .atomics_u64("released", 2);
        let e = Segment::attach(&id.0, &other).unwrap_err();
        let (want, have) = (
            other.layout().unwrap().hash(),
            spec().layout().unwrap().hash(),
        );
        assert!(
            matches!(e, SegmentError::HashMismatch { expected, found, .. } if expected == want && found == have),
            "{e}"
        );
        assert!(e.to_string().contains(&format!("{want:#018x}")));
        assert!(e.to_string().contains(&format!("{have:#018x}")));
    }

    #[test]
    fn attach_to_another_layout_version_fails_naming_both_versions() {
        let id = TestInstance::new();
        let _seg = Segment::create(&id.0, &spec(), limits()).unwrap();
        poke(&id.0, 8, &(LAYOUT_VERSION + 1).to_le_bytes());
        let e = Segment::attach(&id.0, &spec()).unwrap_err();
        assert!(
            matches!(e, SegmentError::VersionMismatch { expected, found, .. }
                if expected == LAYOUT_VERSION && found == LAYOUT_VERSION + 1),
            "{e}"
        );
        let both = format!("expected {}, found {}", LAYOUT_VERSION, LAYOUT_VERSION + 1);
        assert!(e.to_string().contains(&both), "{e}");
    }

    #[test]
    fn attach_to_a_segment_of_another_size_fails_naming_both_sizes() {
        let id = TestInstance::new();
        let _seg = Segment::create(&id.0, &spec(), limits()).unwrap();
        let real = spec().layout().unwrap().size() as u64;
        let claimed = real - HEADER_SIZE as u64;
        poke(
            &id.0,
            std::mem::offset_of!(SegmentHeader, size),
            &claimed.to_le_bytes(),
        );
        let e = Segment::attach(&id.0, &spec()).unwrap_err();
        assert!(
            matches!(e, SegmentError::SizeMismatch { expected, found, .. } if expected == real && found == claimed),
            "{e}"
        );
    }

    #[test]
    fn attach_to_a_file_shorter_than_its_header_says_fails_as_truncated() {
        let id = TestInstance::new();
        let seg = Segment::create(&id.0, &spec(), limits()).unwrap();
        let size = seg.info().size;
        nix::unistd::ftruncate(seg.fd_for_test(), (size - 4096) as i64).unwrap();
        let e = Segment::attach(&id.0, &spec()).unwrap_err();
        assert!(
            matches!(e, SegmentError::Truncated { expected, found, .. } if expected == size && found == size - 4096),
            "{e}"
        );
        // Restore the size so the creator's mapping stays valid until it is dropped.
        nix::unistd::ftruncate(seg.fd_for_test(), size as i64).unwrap();
    }

    #[test]
    fn attach_to_a_file_shorter_than_a_header_fails_as_truncated() {
        let id = TestInstance::new();
        std::fs::write(segment_path(&id.0), b"BATONSEG").unwrap();
        let e = Segment::attach(&id.0, &spec()).unwrap_err();
        assert!(
            matches!(e, SegmentError::Truncated { expected, found: 8, .. } if expected == HEADER_SIZE as u64),
            "{e}"
        );
        std::fs::write(segment_path(&id.0), b"").unwrap();
        assert!(matches!(
            Segment::attach(&id.0, &spec()),
            Err(SegmentError::Truncated { found: 0, .. })
        ));
    }

    #[test]
    fn an_attacher_sees_its_creator_die() {
        let id = TestInstance::new();
        let seg = Segment::create(&id.0, &spec(), limits()).unwrap();
        let other = Segment::attach(&id.0, &spec()).unwrap();
        assert!(seg.creator_alive());
        assert!(other.creator_alive());
        drop(seg);
        assert!(!other.creator_alive());
    }

    /// A creator between `shm_open` and `ftruncate` (empty file) or before publishing the magic
    /// holds the creation lock: attachers must see `Initializing` (and retry), not a hard error.
    /// CI once lost a worker to this race (it exited on `Truncated { found: 0 }`).
    #[test]
    fn a_file_whose_creator_holds_the_lock_is_initializing_not_truncated() {
        let id = TestInstance::new();
        std::fs::write(segment_path(&id.0), b"").unwrap();
        let creator = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(segment_path(&id.0))
            .unwrap();
        assert!(liveness::try_lock(creator.as_fd(), 0).unwrap());
        for e in [
            Segment::attach(&id.0, &spec()).unwrap_err(),
            Segment::peek_limits(&id.0).unwrap_err(),
        ] {
            assert!(matches!(e, SegmentError::Initializing { .. }), "{e}");
        }
        // Sized but no magic yet: still initialising.
        creator.set_len(2 * HEADER_SIZE as u64).unwrap();
        for e in [
            Segment::attach(&id.0, &spec()).unwrap_err(),
            Segment::peek_limits(&id.0).unwrap_err(),
        ] {
            assert!(matches!(e, SegmentError::Initializing { .. }), "{e}");
        }
        // The creator died before publishing: initialising while a successor may still
        // replace the file (ATTACH_GRACE), then a hard error, not an endless wait.
        drop(creator);
        assert!(matches!(
            Segment::peek_limits(&id.0),
            Err(SegmentError::Initializing { .. })
        ));
        age(&id.0);
        assert!(matches!(
            Segment::peek_limits(&id.0),
            Err(SegmentError::BadMagic { found: 0, .. })
        ));
    }

    #[test]
    fn attach_to_a_garbage_file_fails_with_bad_magic() {
        let id = TestInstance::new();
        let garbage: Vec<u8> = (0..3 * HEADER_SIZE).map(|i| (i * 7 + 3) as u8).collect();
        std::fs::write(segment_path(&id.0), &garbage).unwrap();
        let e = Segment::attach(&id.0, &spec()).unwrap_err();
        let found = u64::from_le_bytes(garbage[..8].try_into().unwrap());
        assert!(
            matches!(e, SegmentError::BadMagic { expected: MAGIC, found: f, .. } if f == found),
            "{e}"
        );
        // A zero-filled file (a creator that died before publishing) is garbage too, once
        // older than the grace a successor has to replace it.
        std::fs::write(segment_path(&id.0), vec![0u8; 2 * HEADER_SIZE]).unwrap();
        assert!(matches!(
            Segment::attach(&id.0, &spec()),
            Err(SegmentError::Initializing { .. })
        ));
        age(&id.0);
        assert!(matches!(
            Segment::attach(&id.0, &spec()),
            Err(SegmentError::BadMagic { found: 0, .. })
        ));
    }

    #[test]
    fn attach_to_a_segment_naming_another_instance_fails() {
        let id = TestInstance::new();
        let _seg = Segment::create(&id.0, &spec(), limits()).unwrap();
        poke(&id.0, std::mem::offset_of!(SegmentHeader, instance), b"X");
        let e = Segment::attach(&id.0, &spec()).unwrap_err();
        assert!(matches!(e, SegmentError::InstanceMismatch { .. }), "{e}");
    }

    #[test]
    fn an_old_uninitialised_file_without_a_live_creator_is_stale() {
        let id = TestInstance::new();
        std::fs::write(segment_path(&id.0), vec![0u8; 2 * HEADER_SIZE]).unwrap();
        // Too young: could be a creator between shm_open and its lock.
        assert!(matches!(
            Segment::create(&id.0, &spec(), limits()),
            Err(SegmentError::Initializing { .. })
        ));
        age(&id.0);
        let seg = Segment::create(&id.0, &spec(), limits()).unwrap();
        assert_eq!(seg.limits(), limits());
    }

    #[test]
    fn create_waiting_outlasts_a_creator_killed_mid_initialisation() {
        // What a SIGKILL between shm_open and the magic leaves: a zeroed file, no lock holder.
        let id = TestInstance::new();
        std::fs::write(segment_path(&id.0), vec![0u8; 2 * HEADER_SIZE]).unwrap();
        let t0 = std::time::Instant::now();
        let seg =
            Segment::create_waiting(&id.0, &spec(), limits(), Duration::from_secs(10)).unwrap();
        assert_eq!(seg.limits(), limits());
        assert!(t0.elapsed() < Duration::from_secs(5));
        // A live, complete segment is Running at once, not waited on.
        let t0 = std::time::Instant::now();
        let e =
            Segment::create_waiting(&id.0, &spec(), limits(), Duration::from_secs(10)).unwrap_err();
        assert!(matches!(e, SegmentError::Running { .. }), "{e}");
        assert!(t0.elapsed() < Duration::from_secs(1));
        drop(seg);
        // The wait is bounded.
        std::fs::write(segment_path(&id.0), vec![0u8; 2 * HEADER_SIZE]).unwrap();
        assert!(matches!(
            Segment::create_waiting(&id.0, &spec(), limits(), Duration::from_millis(100)),
            Err(SegmentError::Initializing { .. })
        ));
    }

    #[test]
    fn peek_limits_reads_the_published_limits_and_checks_the_header() {
        let id = TestInstance::new();
        assert!(matches!(
            Segment::peek_limits(&id.0),
            Err(SegmentError::NotFound { .. })
        ));
        let seg = Segment::create(&id.0, &spec(), limits()).unwrap();
        assert_eq!(Segment::peek_limits(&id.0).unwrap(), limits());
        poke(&id.0, 8, &(LAYOUT_VERSION + 1).to_le_bytes());
        assert!(matches!(
            Segment::peek_limits(&id.0),
            Err(SegmentError::VersionMismatch { .. })
        ));
        poke(&id.0, 0, b"garbage!");
        assert!(matches!(
            Segment::peek_limits(&id.0),
            Err(SegmentError::BadMagic { .. })
        ));
        drop(seg);
        std::fs::write(segment_path(&id.0), b"short").unwrap();
        assert!(matches!(
            Segment::peek_limits(&id.0),
            Err(SegmentError::Truncated { found: 5, .. })
        ));
    }

    #[test]
    fn bad_instance_ids_are_refused_before_touching_the_filesystem() {
        for bad in ["", "a/b", "..", ".hidden", "sp ace", &"x".repeat(65)] {
            assert!(
                matches!(
                    Segment::create(bad, &spec(), limits()),
                    Err(SegmentError::BadInstance { .. })
                ),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn participants_in_a_segment_use_kernel_locks() {
        let id = TestInstance::new();
        let seg = Segment::create(&id.0, &spec(), limits()).unwrap();
        let other = Segment::attach(&id.0, &spec()).unwrap();
        let table = seg.participants("participants").unwrap();
        let theirs = other.participants("participants").unwrap();
        let r = theirs.register(crate::Role::Frontend).unwrap();
        assert!(table.scan_dead().is_empty());
        let (slot, generation) = (r.slot(), r.generation());
        drop(other);
        assert!(
            table.scan_dead().is_empty(),
            "the registration holds its own lock"
        );
        r.abandon();
        let dead = table.scan_dead();
        assert_eq!(dead.len(), 1);
        assert_eq!((dead[0].slot, dead[0].generation), (slot, generation));
        table.reclaim(slot, generation).unwrap();
    }
}
