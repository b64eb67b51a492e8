//! Round-trip latency percentiles across two processes: every ping-pong is timed on its own,
//! for the shared-memory ring (busy-wait, one process per CPU) and for a Unix domain socket
//! (blocking; peer on the other CPU, and peer on the same CPU, where a wake-up needs no
//! cross-CPU interrupt), and p50, p90, p99, p99.9 and max are printed with the machine.
//! Criterion (the `ring` bench) only reports means.
//!
//! `cargo bench -p baton-ipc --bench latency` (`BATON_IPC_ROUND_TRIPS` overrides the count).
//! Each sample includes one `Instant::now()` call (~20-30 ns).

#[cfg(not(loom))]
mod common;

#[cfg(not(loom))]
fn percentiles(name: &str, mut ns: Vec<u64>) -> u64 {
    ns.sort_unstable();
    let at = |q: f64| ns[((ns.len() as f64 * q) as usize).min(ns.len() - 1)];
    let mean = ns.iter().sum::<u64>() as f64 / ns.len() as f64;
    println!(
        "{name:<22} n={:<8} p50={:>6} ns  p90={:>6} ns  p99={:>6} ns  p99.9={:>7} ns  max={:>8} ns  mean={:>8.0} ns",
        ns.len(),
        at(0.50),
        at(0.90),
        at(0.99),
        at(0.999),
        ns[ns.len() - 1],
        mean
    );
    at(0.50)
}

#[cfg(not(loom))]
fn measure(n: usize, mut round_trip: impl FnMut()) -> Vec<u64> {
    use std::time::Instant;
    for _ in 0..n / 10 {
        round_trip(); // warm up
    }
    let mut ns = Vec::with_capacity(n);
    for _ in 0..n {
        let t0 = Instant::now();
        round_trip();
        ns.push(t0.elapsed().as_nanos() as u64);
    }
    ns
}

#[cfg(not(loom))]
fn main() {
    common::run_child_if_asked();
    if std::env::args().any(|a| a == "--list") {
        return; // `cargo bench -- --list` / test discovery: nothing to list
    }
    common::pin(0);
    let n: usize = std::env::var("BATON_IPC_ROUND_TRIPS").map_or(200_000, |v| v.parse().unwrap());
    println!("machine: {}", common::machine());
    println!(
        "64-byte messages, {n} timed round trips each (after {} warm-up)",
        n / 10
    );

    let mut ring = common::RingPeer::start("ring_echo");
    let ring_p50 = percentiles("shm ring (busy-wait)", measure(n, || ring.round_trip()));
    drop(ring);

    let mut uds = common::UdsPeer::start("uds_echo");
    let apart = percentiles("unix socket, 2 CPUs", measure(n / 4, || uds.round_trip()));
    drop(uds);

    let mut uds = common::UdsPeer::start_on("uds_echo", 0);
    let shared = percentiles("unix socket, 1 CPU", measure(n / 4, || uds.round_trip()));
    drop(uds);

    let ratio = |s: u64| s as f64 / ring_p50.max(1) as f64;
    println!(
        "p50 socket/ring: {:.1}x (2 CPUs), {:.1}x (1 CPU); targets: ring p50 <= 1000 ns, >= 10x",
        ratio(apart),
        ratio(shared)
    );
}

#[cfg(loom)]
fn main() {}
