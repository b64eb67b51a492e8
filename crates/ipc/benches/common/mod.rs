//! Shared parts of the control-plane benchmarks: a 64-byte slot, the peer process (this bench
//! binary re-executed with `BATON_IPC_BENCH_CHILD=<role>`), and the two transports under test:
//! a pair of shared-memory rings and a Unix domain socket.
//!
//! The parent is pinned to CPU 0 and the peer to CPU 1 (when there are two), so two
//! busy-waiting processes each own a core.

#![allow(dead_code)] // each bench binary uses part of it

use baton_ipc::{LayoutSpec, Limits, RingConsumer, RingProducer, Segment};
use bytemuck::{Pod, Zeroable};
use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// One 64-byte message: a sequence number and padding.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct Slot64 {
    pub seq: u64,
    pub pad: [u64; 7],
}

impl Slot64 {
    pub fn new(seq: u64) -> Slot64 {
        Slot64 { seq, pad: [seq; 7] }
    }
}

/// `seq` of the message that ends a peer.
pub const STOP: u64 = u64::MAX;
/// `seq` of the message a sink answers with an acknowledgement.
pub const SYNC: u64 = u64::MAX - 1;

pub const RING_SLOTS: usize = 1024;

/// Busy-wait step: `pause`, plus a `sched_yield` every 4096 steps (per thread) so that a peer
/// that lost its core on an overloaded machine gets it back instead of the two spinning in
/// turn. Never reached while both processes own a core: a round trip takes far fewer steps.
#[inline]
pub fn snooze() {
    thread_local!(static STEPS: std::cell::Cell<u32> = const { std::cell::Cell::new(0) });
    STEPS.with(|c| {
        let n = c.get().wrapping_add(1);
        c.set(n);
        if n % 4096 == 0 {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    });
}

pub fn spec() -> LayoutSpec {
    LayoutSpec::new()
        .ring_of::<Slot64>("ping", RING_SLOTS)
        .ring_of::<Slot64>("pong", RING_SLOTS)
}

/// CPUs online (counted in `/proc/cpuinfo`, not this process's affinity mask, which a pinned
/// parent would pass on to its peer).
pub fn cpus() -> usize {
    std::fs::read_to_string("/proc/cpuinfo")
        .map(|s| s.lines().filter(|l| l.starts_with("processor")).count())
        .unwrap_or(1)
        .max(1)
}

/// Pin the calling process to `cpu` if the machine has more than one.
pub fn pin(cpu: usize) {
    let n = cpus();
    if n < 2 {
        return;
    }
    let mut set = nix::sched::CpuSet::new();
    if set.set(cpu % n).is_ok() {
        let _ = nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set);
    }
}

/// The model name from `/proc/cpuinfo` and the number of CPUs.
pub fn machine() -> String {
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    format!("{model}, {} CPUs", cpus())
}

/// If this process is a bench peer, run its role and exit; otherwise return.
pub fn run_child_if_asked() {
    let Ok(role) = std::env::var("BATON_IPC_BENCH_CHILD") else {
        return;
    };
    let _ = nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL);
    pin(std::env::var("BATON_IPC_BENCH_CPU").map_or(1, |c| c.parse().unwrap()));
    let target = std::env::var("BATON_IPC_BENCH_TARGET").unwrap();
    match role.as_str() {
        "ring_echo" => ring_echo(&target),
        "ring_sink" => ring_sink(&target),
        "uds_echo" => uds_echo(&target),
        "uds_sink" => uds_sink(&target),
        other => panic!("unknown bench role {other}"),
    }
    std::process::exit(0);
}

fn spawn(role: &str, target: &str, cpu: usize) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .env("BATON_IPC_BENCH_CHILD", role)
        .env("BATON_IPC_BENCH_TARGET", target)
        .env("BATON_IPC_BENCH_CPU", cpu.to_string())
        .stdin(Stdio::null())
        .spawn()
        .unwrap()
}

// ---- shared-memory rings ----

fn ring_ends(instance: &str, peer: bool) -> (Segment, RingProducer<Slot64>, RingConsumer<Slot64>) {
    let seg = Segment::attach(instance, &spec()).unwrap();
    let (tx, rx) = if peer {
        ("pong", "ping")
    } else {
        ("ping", "pong")
    };
    let p = seg.producer(tx).unwrap();
    let c = seg.consumer(rx).unwrap();
    (seg, p, c)
}

/// Busy-wait echo: every message comes straight back.
fn ring_echo(instance: &str) {
    let (_seg, mut tx, mut rx) = ring_ends(instance, true);
    loop {
        match rx.pop() {
            Some(m) => {
                if m.seq == STOP {
                    return;
                }
                while tx.try_push(m).is_err() {
                    snooze();
                }
            }
            None => snooze(),
        }
    }
}

/// Busy-wait sink: consume in batches; answer `SYNC` with its own message.
fn ring_sink(instance: &str) {
    let (_seg, mut tx, mut rx) = ring_ends(instance, true);
    let mut buf = Vec::with_capacity(256);
    let mut next = 0u64;
    loop {
        buf.clear();
        if rx.pop_batch(&mut buf, 256) == 0 {
            snooze();
            continue;
        }
        for m in &buf {
            match m.seq {
                STOP => return,
                SYNC => {
                    while tx.try_push(Slot64::new(next)).is_err() {
                        snooze();
                    }
                }
                s => {
                    assert_eq!(s, next, "ring sink: out of order");
                    next += 1;
                }
            }
        }
    }
}

/// The parent's side of a ring pair with a peer process.
pub struct RingPeer {
    pub tx: RingProducer<Slot64>,
    pub rx: RingConsumer<Slot64>,
    child: Child,
    _seg: Segment,
    next: u64,
}

impl RingPeer {
    pub fn start(role: &str) -> RingPeer {
        let instance = format!("ipc-bench-{}-{role}", std::process::id());
        let seg = Segment::create(&instance, &spec(), Limits::default()).unwrap();
        let tx = seg.producer("ping").unwrap();
        let rx = seg.consumer("pong").unwrap();
        let child = spawn(role, &instance, 1);
        let mut peer = RingPeer {
            tx,
            rx,
            child,
            _seg: seg,
            next: 0,
        };
        if role == "ring_echo" {
            peer.round_trip(); // wait until the peer is up
        }
        peer
    }

    /// One ping-pong, busy-waiting for the answer.
    #[inline]
    pub fn round_trip(&mut self) {
        let m = Slot64::new(self.next);
        self.next += 1;
        while self.tx.try_push(m).is_err() {
            snooze();
        }
        loop {
            if let Some(r) = self.rx.pop() {
                debug_assert_eq!(r.seq, m.seq);
                return;
            }
            snooze();
        }
    }

    /// Send `n` messages one push at a time, then wait until the sink has consumed them.
    pub fn send_single(&mut self, n: u64) {
        for _ in 0..n {
            let m = Slot64::new(self.next);
            while self.tx.try_push(m).is_err() {
                snooze();
            }
            self.next += 1;
        }
        self.sync();
    }

    /// Send `n` messages in batches of `batch`, then wait until the sink has consumed them.
    pub fn send_batched(&mut self, n: u64, batch: usize) {
        let mut buf = Vec::with_capacity(batch);
        let mut sent = 0;
        while sent < n {
            buf.clear();
            let k = (n - sent).min(batch as u64);
            buf.extend((0..k).map(|i| Slot64::new(self.next + i)));
            let mut off = 0;
            while off < buf.len() {
                let pushed = self.tx.push_batch(&buf[off..]);
                if pushed == 0 {
                    snooze();
                }
                off += pushed;
            }
            self.next += k;
            sent += k;
        }
        self.sync();
    }

    fn sync(&mut self) {
        while self.tx.try_push(Slot64::new(SYNC)).is_err() {
            snooze();
        }
        loop {
            if let Some(r) = self.rx.pop() {
                assert_eq!(r.seq, self.next, "the sink saw every message");
                return;
            }
            snooze();
        }
    }
}

impl Drop for RingPeer {
    fn drop(&mut self) {
        while self.tx.try_push(Slot64::new(STOP)).is_err() {
            snooze();
        }
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(5) {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// ---- Unix domain socket ----

fn uds_connect(path: &str) -> UnixStream {
    UnixStream::connect(path).unwrap()
}

/// Blocking echo of 64-byte messages.
fn uds_echo(path: &str) {
    let mut s = uds_connect(path);
    let mut buf = [0u8; 64];
    loop {
        if s.read_exact(&mut buf).is_err() {
            return;
        }
        let m: Slot64 = bytemuck::pod_read_unaligned(&buf);
        if m.seq == STOP {
            return;
        }
        s.write_all(&buf).unwrap();
    }
}

/// Blocking sink of 64-byte messages; answers `SYNC` with its count.
fn uds_sink(path: &str) {
    let s = uds_connect(path);
    let mut r = std::io::BufReader::with_capacity(64 * 256, s.try_clone().unwrap());
    let mut w = s;
    let mut buf = [0u8; 64];
    let mut next = 0u64;
    loop {
        if r.read_exact(&mut buf).is_err() {
            return;
        }
        let m: Slot64 = bytemuck::pod_read_unaligned(&buf);
        match m.seq {
            STOP => return,
            SYNC => w.write_all(bytemuck::bytes_of(&Slot64::new(next))).unwrap(),
            s => {
                assert_eq!(s, next, "socket sink: out of order");
                next += 1;
            }
        }
    }
}

/// The parent's side of a Unix stream socket with a peer process.
pub struct UdsPeer {
    stream: UnixStream,
    child: Child,
    path: String,
    next: u64,
}

impl UdsPeer {
    /// A peer on the other CPU (the ring's placement).
    pub fn start(role: &str) -> UdsPeer {
        UdsPeer::start_on(role, 1)
    }

    /// A peer pinned to `cpu` (0 shares the parent's CPU: wake-ups without a cross-CPU IPI).
    pub fn start_on(role: &str, cpu: usize) -> UdsPeer {
        let path = std::env::temp_dir()
            .join(format!(
                "baton-ipc-bench-{}-{role}.sock",
                std::process::id()
            ))
            .display()
            .to_string();
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path).unwrap();
        let child = spawn(role, &path, cpu);
        let (stream, _) = listener.accept().unwrap();
        UdsPeer {
            stream,
            child,
            path,
            next: 0,
        }
    }

    /// One ping-pong: write 64 bytes, block until 64 come back.
    #[inline]
    pub fn round_trip(&mut self) {
        let m = Slot64::new(self.next);
        self.next += 1;
        self.stream.write_all(bytemuck::bytes_of(&m)).unwrap();
        let mut buf = [0u8; 64];
        self.stream.read_exact(&mut buf).unwrap();
    }

    /// Send `n` messages, one `write` each, then wait until the sink has consumed them.
    pub fn send_single(&mut self, n: u64) {
        for _ in 0..n {
            let m = Slot64::new(self.next);
            self.stream.write_all(bytemuck::bytes_of(&m)).unwrap();
            self.next += 1;
        }
        self.sync();
    }

    /// Send `n` messages, `batch` per `write`, then wait until the sink has consumed them.
    pub fn send_batched(&mut self, n: u64, batch: usize) {
        let mut buf: Vec<Slot64> = Vec::with_capacity(batch);
        let mut sent = 0;
        while sent < n {
            buf.clear();
            let k = (n - sent).min(batch as u64);
            buf.extend((0..k).map(|i| Slot64::new(self.next + i)));
            self.stream.write_all(bytemuck::cast_slice(&buf)).unwrap();
            self.next += k;
            sent += k;
        }
        self.sync();
    }

    fn sync(&mut self) {
        self.stream
            .write_all(bytemuck::bytes_of(&Slot64::new(SYNC)))
            .unwrap();
        let mut buf = [0u8; 64];
        self.stream.read_exact(&mut buf).unwrap();
        let r: Slot64 = bytemuck::pod_read_unaligned(&buf);
        assert_eq!(r.seq, self.next, "the sink saw every message");
    }
}

impl Drop for UdsPeer {
    fn drop(&mut self) {
        let _ = self
            .stream
            .write_all(bytemuck::bytes_of(&Slot64::new(STOP)));
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.path);
    }
}
