//! Multi-process tests of the control plane: real processes over a real segment.
//!
//! Each child is this test binary re-executed with `BATON_IPC_CHILD=<role>`, running only the
//! `child_entry` test (re-exec is safe in a multithreaded harness; fork is not). Children get
//! SIGKILL if the test that spawned them dies (parent-death signal), and every test removes its
//! segment and kills its children on the way out, pass or fail.

#![cfg(not(loom))]

use baton_ipc::{process, Limits, RingConsumer, Role, Segment, SlotState};
use bytemuck::{Pod, Zeroable};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
struct Msg {
    seq: u64,
    check: u64,
}

fn msg(seq: u64) -> Msg {
    Msg {
        seq,
        check: seq.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0xdead_beef,
    }
}

const RING: &str = "r";
const TABLE: &str = "participants";

fn spec() -> baton_ipc::LayoutSpec {
    baton_ipc::LayoutSpec::new()
        .participants(TABLE, 4)
        .ring_of::<Msg>(RING, 1024)
}

/// Children of one test and its segment; killed and removed on drop, pass or fail.
struct Harness {
    instance: String,
    children: Vec<Child>,
}

impl Harness {
    fn new(tag: &str) -> Harness {
        static N: AtomicU32 = AtomicU32::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        Harness {
            instance: format!("ipc-mp-{tag}-{}-{n}", std::process::id()),
            children: Vec::new(),
        }
    }

    fn spawn(&mut self, role: &str, env: &[(&str, String)]) -> u32 {
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args(["child_entry", "--exact", "--nocapture", "--test-threads=1"])
            .env("BATON_IPC_CHILD", role)
            .env("BATON_IPC_INSTANCE", &self.instance)
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd.spawn().unwrap();
        let pid = child.id();
        self.children.push(child);
        pid
    }

    /// Wait for child `i` to exit; its exit code (or -signal), or panic after `limit`.
    fn wait(&mut self, i: usize, limit: Duration) -> i32 {
        let t0 = Instant::now();
        loop {
            if let Some(st) = self.children[i].try_wait().unwrap() {
                use std::os::unix::process::ExitStatusExt;
                return st.code().unwrap_or_else(|| -st.signal().unwrap_or(0));
            }
            assert!(
                t0.elapsed() < limit,
                "child {i} still running after {limit:?}"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_file(baton_ipc::segment_path(&self.instance));
    }
}

fn env_u64(name: &str) -> u64 {
    std::env::var(name).map_or(0, |v| v.parse().unwrap())
}

/// Entry point of every child process; a no-op in the parent.
#[test]
fn child_entry() {
    let Ok(role) = std::env::var("BATON_IPC_CHILD") else {
        return;
    };
    nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL).unwrap();
    let instance = std::env::var("BATON_IPC_INSTANCE").unwrap();
    if role == "creator" {
        let _seg = Segment::create(&instance, &spec(), Limits::default()).unwrap();
        loop {
            std::thread::sleep(Duration::from_secs(1)); // until killed
        }
    }
    let seg = Segment::attach(&instance, &spec()).unwrap();
    let code = match role.as_str() {
        "producer" => produce(&seg),
        "consumer" => consume(&seg),
        "idle_consumer" => idle_consume(&seg),
        other => panic!("unknown role {other}"),
    };
    std::process::exit(code);
}

/// Push `COUNT` messages from `START` (forever if `COUNT` is 0), mixing batches of varying size
/// with single bounded-wait pushes.
fn produce(seg: &Segment) -> i32 {
    let me = seg
        .participants(TABLE)
        .unwrap()
        .register(Role::Other(16))
        .unwrap();
    let (start, count) = (env_u64("START"), env_u64("COUNT"));
    let end = if count == 0 { u64::MAX } else { start + count };
    let mut tx = seg.producer::<Msg>(RING).unwrap();
    let mut batch = Vec::with_capacity(64);
    let mut next = start;
    while next < end {
        if next % 7 < 4 {
            let k = (next % 61 + 1).min(end - next);
            batch.clear();
            batch.extend((next..next + k).map(msg));
            let n = tx.push_batch(&batch) as u64;
            if n == 0 {
                // Full: wait (bounded) for the consumer on the first item.
                if tx.push_timeout(batch[0], Duration::from_secs(10)).is_err() {
                    eprintln!("producer: consumer stalled at {next}");
                    return 2;
                }
                next += 1;
            }
            next += n;
        } else {
            if tx.push_timeout(msg(next), Duration::from_secs(10)).is_err() {
                eprintln!("producer: consumer stalled at {next}");
                return 2;
            }
            next += 1;
        }
        if next % 65536 == 0 {
            me.heartbeat();
        }
    }
    0
}

/// Receive `COUNT` messages and check that they are exactly `0..COUNT` in order.
fn consume(seg: &Segment) -> i32 {
    let count = env_u64("COUNT");
    let mut rx = seg.consumer::<Msg>(RING).unwrap();
    let mut out = Vec::with_capacity(256);
    let mut expect = 0;
    while expect < count {
        out.clear();
        if rx.wait_pop_batch(&mut out, 256, Duration::from_secs(10)) == 0 {
            eprintln!("consumer: producer stalled at {expect}");
            return 2;
        }
        for m in &out {
            if *m != msg(expect) {
                eprintln!("consumer: expected {:?}, got {m:?}", msg(expect));
                return 1;
            }
            expect += 1;
        }
    }
    if rx.pop().is_some() {
        eprintln!("consumer: more than {count} messages");
        return 1;
    }
    0
}

/// Register (so the parent knows we are up), then block in `wait_pop` until a message comes.
fn idle_consume(seg: &Segment) -> i32 {
    let mut rx = seg.consumer::<Msg>(RING).unwrap();
    let _me = seg
        .participants(TABLE)
        .unwrap()
        .register(Role::Other(17))
        .unwrap();
    match rx.wait_pop(Duration::MAX) {
        Some(m) if m == msg(42) => 0,
        other => {
            eprintln!("idle consumer: got {other:?}");
            1
        }
    }
}

fn create(h: &Harness) -> Segment {
    Segment::create(&h.instance, &spec(), Limits::default()).unwrap()
}

/// The count for the big exchange: 10 million by default; `BATON_IPC_MESSAGES` overrides.
fn big_count() -> u64 {
    std::env::var("BATON_IPC_MESSAGES").map_or(10_000_000, |v| v.parse().unwrap())
}

#[test]
fn ten_million_messages_cross_processes_without_loss_duplication_or_reordering() {
    let mut h = Harness::new("10m");
    let _seg = create(&h);
    let count = big_count().to_string();
    let t0 = Instant::now();
    h.spawn("consumer", &[("COUNT", count.clone())]);
    h.spawn(
        "producer",
        &[("COUNT", count.clone()), ("START", "0".into())],
    );
    assert_eq!(h.wait(1, Duration::from_secs(600)), 0, "producer failed");
    assert_eq!(h.wait(0, Duration::from_secs(60)), 0, "consumer failed");
    eprintln!("{count} messages across processes in {:?}", t0.elapsed());
}

fn wait_for_registration(table: &baton_ipc::ParticipantTable, role: Role) -> (usize, u64) {
    let t0 = Instant::now();
    loop {
        if let Some(p) = table
            .snapshot()
            .into_iter()
            .find(|p| p.role == role && p.state == SlotState::Live)
        {
            return (p.slot, p.generation);
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "child never registered"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn drain_in_order(rx: &mut RingConsumer<Msg>, expect: &mut u64) {
    while let Some(m) = rx.pop() {
        assert_eq!(m, msg(*expect), "lost, duplicated or reordered");
        *expect += 1;
    }
}

#[test]
fn a_killed_producer_is_seen_dead_within_a_second_and_its_ring_is_reset_and_reused() {
    let mut h = Harness::new("kill");
    let seg = create(&h);
    let table = seg.participants(TABLE).unwrap();
    let mut rx = seg.consumer::<Msg>(RING).unwrap();
    let pid = h.spawn("producer", &[("COUNT", "0".into()), ("START", "0".into())]);
    let (slot, generation) = wait_for_registration(&table, Role::Other(16));
    assert_eq!(table.info(slot).unwrap().pid, pid);

    // Mid-stream: consume a good amount, checking order, then kill the producer.
    let mut expect = 0u64;
    let mut out = Vec::new();
    while expect < 200_000 {
        out.clear();
        assert!(rx.wait_pop_batch(&mut out, 256, Duration::from_secs(10)) > 0);
        for m in &out {
            assert_eq!(*m, msg(expect));
            expect += 1;
        }
    }
    assert!(table.scan_dead().is_empty(), "alive before the kill");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let killed = Instant::now();
    let dead = loop {
        if let Some(d) = table.scan_dead().into_iter().find(|d| d.slot == slot) {
            break d;
        }
        assert!(
            killed.elapsed() < Duration::from_secs(1),
            "death not seen within 1 s"
        );
        std::thread::sleep(Duration::from_millis(1));
    };
    let seen_after = killed.elapsed();
    eprintln!("producer death seen {seen_after:?} after SIGKILL");
    assert_eq!(
        (dead.generation, dead.pid, dead.exited),
        (generation, pid, false)
    );
    assert!(seen_after < Duration::from_secs(1));
    // Reap only now: detection did not depend on it.
    assert_eq!(h.wait(0, Duration::from_secs(10)), -9);

    // Everything the dead producer published is intact and in order; nothing torn shows up.
    drain_in_order(&mut rx, &mut expect);
    assert!(!rx.is_corrupt());

    // The scheduler's recovery: reset the ring, then free the slot.
    // SAFETY: the producer process is dead (kernel evidence above) and reaped.
    unsafe { rx.reset() };
    table.reclaim(slot, generation).unwrap();

    let n = 50_000u64;
    h.spawn(
        "producer",
        &[("COUNT", n.to_string()), ("START", "0".into())],
    );
    let mut expect = 0u64;
    while expect < n {
        out.clear();
        assert!(rx.wait_pop_batch(&mut out, 256, Duration::from_secs(10)) > 0);
        for m in &out {
            assert_eq!(
                *m,
                msg(expect),
                "the reset ring delivers the new stream exactly"
            );
            expect += 1;
        }
    }
    assert_eq!(h.wait(1, Duration::from_secs(30)), 0);
    assert_eq!(rx.pop(), None);
    let info = table.info(slot).unwrap();
    assert_eq!(
        info.generation,
        generation + 1,
        "the reused slot is a generation up"
    );
    assert_eq!(
        info.state,
        SlotState::Exited,
        "the second producer left cleanly"
    );
}

#[test]
fn an_idle_consumer_uses_under_one_percent_cpu_over_ten_seconds() {
    let mut h = Harness::new("idle");
    let seg = create(&h);
    let table = seg.participants(TABLE).unwrap();
    let pid = h.spawn("idle_consumer", &[]);
    wait_for_registration(&table, Role::Other(17));
    // Let it pass its spin and yield phases (microseconds) and fall asleep on the futex.
    std::thread::sleep(Duration::from_millis(300));
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let state = stat[stat.rfind(')').unwrap() + 2..].chars().next().unwrap();
    assert_eq!(state, 'S', "blocked in the kernel, not running: {stat}");

    let before = process::cpu_ticks(pid).unwrap();
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_secs(10));
    let ticks = process::cpu_ticks(pid).unwrap() - before;
    let wall = t0.elapsed();
    let cpu = Duration::from_secs_f64(ticks as f64 / process::clock_ticks_per_second() as f64);
    let share = cpu.as_secs_f64() / wall.as_secs_f64();
    eprintln!(
        "idle consumer: {cpu:?} CPU over {wall:?} ({:.3}%)",
        share * 100.0
    );
    assert!(share < 0.01, "idle consumer used {:.2}% CPU", share * 100.0);

    // It is asleep, not dead: one message wakes it and it exits cleanly.
    let mut tx = seg.producer::<Msg>(RING).unwrap();
    tx.try_push(msg(42)).unwrap();
    assert_eq!(h.wait(0, Duration::from_secs(10)), 0);
}

#[test]
fn a_segment_whose_creator_was_killed_is_replaced_by_the_next_create() {
    let mut h = Harness::new("stale");
    let pid = h.spawn("creator", &[]);
    let t0 = Instant::now();
    let attached = loop {
        match Segment::attach(&h.instance, &spec()) {
            Ok(seg) => break seg,
            Err(_) if t0.elapsed() < Duration::from_secs(30) => {
                std::thread::sleep(Duration::from_millis(5))
            }
            Err(e) => panic!("creator never came up: {e}"),
        }
    };
    assert_eq!(attached.info().creator_pid, pid);
    let e = Segment::create(&h.instance, &spec(), Limits::default()).unwrap_err();
    assert!(
        matches!(e, baton_ipc::SegmentError::Running { pid: p, .. } if p == pid),
        "{e}"
    );
    assert!(
        e.to_string().contains(&format!("is running, pid {pid}")),
        "{e}"
    );

    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    assert_eq!(h.wait(0, Duration::from_secs(10)), -9);
    // Our old mapping does not keep the dead creator "alive": the kernel dropped its lock.
    assert!(matches!(
        Segment::attach(&h.instance, &spec()),
        Err(baton_ipc::SegmentError::CreatorDead { pid: p, .. }) if p == pid
    ));
    let fresh = Segment::create(&h.instance, &spec(), Limits::default()).unwrap();
    assert_eq!(fresh.info().creator_pid, std::process::id());
    drop(attached);
    drop(fresh);
    assert!(
        !baton_ipc::segment_path(&h.instance).exists(),
        "clean shutdown leaves /dev/shm flat"
    );
}
