//! Criterion benchmark of the control plane across two processes: ping-pong round-trip latency
//! (busy-wait) and one-way throughput of 64-byte slots, for the shared-memory ring and, in the
//! same run, for a Unix domain socket.
//!
//! `cargo bench -p baton-ipc --bench ring`. Criterion reports means; the `latency` bench
//! reports percentiles.

#[cfg(not(loom))]
mod common;

#[cfg(not(loom))]
fn main() {
    use criterion::{Criterion, Throughput};
    use std::time::{Duration, Instant};

    common::run_child_if_asked();
    common::pin(0);
    eprintln!("machine: {}", common::machine());

    let mut c = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(20)
        .configure_from_args();

    {
        let mut g = c.benchmark_group("round_trip_64B");
        g.throughput(Throughput::Elements(1));
        let mut ring = common::RingPeer::start("ring_echo");
        g.bench_function("shm_ring_busy_wait", |b| {
            b.iter_custom(|iters| {
                let t0 = Instant::now();
                for _ in 0..iters {
                    ring.round_trip();
                }
                t0.elapsed()
            })
        });
        drop(ring);
        let mut uds = common::UdsPeer::start("uds_echo");
        g.bench_function("unix_socket_blocking", |b| {
            b.iter_custom(|iters| {
                let t0 = Instant::now();
                for _ in 0..iters {
                    uds.round_trip();
                }
                t0.elapsed()
            })
        });
        drop(uds);
        g.finish();
    }

    {
        // Each iteration is one 64-byte message; a run ends when the sink has consumed all.
        let mut g = c.benchmark_group("one_way_64B");
        g.throughput(Throughput::Elements(1));
        let mut ring = common::RingPeer::start("ring_sink");
        g.bench_function("shm_ring_single_push", |b| {
            b.iter_custom(|iters| {
                let t0 = Instant::now();
                ring.send_single(iters);
                t0.elapsed()
            })
        });
        g.bench_function("shm_ring_batch_32", |b| {
            b.iter_custom(|iters| {
                let t0 = Instant::now();
                ring.send_batched(iters, 32);
                t0.elapsed()
            })
        });
        drop(ring);
        let mut uds = common::UdsPeer::start("uds_sink");
        g.bench_function("unix_socket_single_write", |b| {
            b.iter_custom(|iters| {
                let t0 = Instant::now();
                uds.send_single(iters);
                t0.elapsed()
            })
        });
        g.bench_function("unix_socket_batch_32", |b| {
            b.iter_custom(|iters| {
                let t0 = Instant::now();
                uds.send_batched(iters, 32);
                t0.elapsed()
            })
        });
        drop(uds);
        g.finish();
    }

    c.final_summary();
}

#[cfg(loom)]
fn main() {}
