//! `baton bench sched`: the scheduler's CPU time per step and the control plane's end-to-end
//! step rate, with the null backend (no model computation).

use anyhow::{Context, Result};
use baton_proto::link::{Admission, FrontendLink};
use baton_proto::wire::to_frontend;
use baton_proto::SamplingParams;
use baton_scheduler::daemon::{DaemonConfig, SchedulerDaemon};
use baton_scheduler::{NewRequest, Scheduler, SchedulerConfig};
use baton_worker::daemon::WorkerDaemon;
use baton_worker::{Backend, KvCapacity, NullBackend};
use clap::{Args, Subcommand};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// `baton bench …`
#[derive(Subcommand, Clone, Debug)]
#[allow(clippy::large_enum_variant)] // parsed once per process
pub enum BenchCmd {
    /// Scheduler CPU time per decode step, and end-to-end steps/s through the rings, with the
    /// null backend.
    Sched(SchedArgs),
    /// Decode step time against the HBM floor (weights + KV bytes over measured copy
    /// bandwidth), per batch size, on the CPU reference or CUDA.
    Decode(crate::bench_decode::DecodeArgs),
    /// Online serving benchmark of an OpenAI-compatible server: TTFT, ITL, TPOT, throughput.
    Serve(baton_bench::ServeArgs),
    /// A canned-token OpenAI-compatible server: the ceiling of `bench serve` itself.
    #[command(hide = true)]
    MockServer(baton_bench::MockArgs),
}

/// Flags of `baton bench sched`.
#[derive(Args, Clone, Debug)]
pub struct SchedArgs {
    /// Running sequences to measure at (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "256,1024")]
    pub num_seqs: Vec<usize>,
    /// Decode steps measured per point.
    #[arg(long, default_value_t = 2000)]
    pub steps: usize,
    /// Write the results as JSON here.
    #[arg(long)]
    pub out: Option<std::path::PathBuf>,
}

fn thread_cpu_ns() -> u64 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_THREAD_CPUTIME_ID)
        .map(|t| t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64)
        .unwrap_or(0)
}

fn config(n: usize, steps: usize, inflight: usize) -> SchedulerConfig {
    let max_model_len = 16 + steps + 64;
    SchedulerConfig {
        max_num_seqs: n,
        max_num_batched_tokens: n.max(16 * n),
        block_size: 16,
        num_blocks: n * max_model_len.div_ceil(16),
        max_model_len,
        max_inflight: inflight,
        // Every request has the same prompt: measure the scheduler, not cache hits.
        enable_prefix_caching: false,
        policy: baton_scheduler::SchedulingPolicy::Fcfs,
        kv_window: None,
    }
}

fn request(id: u64, max_tokens: u32) -> NewRequest {
    NewRequest {
        priority: 0,
        id,
        prompt: (0..16).map(|i| 3 + i as u32).collect(),
        max_tokens,
        params: SamplingParams::greedy(),
        eos_ids: vec![2],
        stop_token_ids: vec![],
        ignore_eos: false,
        logit_bias: Vec::new(),
        min_tokens: 0,
        cache_salt: 0,
        guide: None,
        bad_words: Vec::new(),
        lora: 0,
    }
}

/// Scheduler CPU time per decode step with `n` running sequences: `schedule` +
/// `on_completion` + `on_released`, in one thread, the null backend executing in between
/// (its small share is counted too).
fn sched_cpu_per_step(n: usize, steps: usize) -> (f64, f64) {
    let cfg = config(n, steps, 1);
    let mut backend = NullBackend::new(
        KvCapacity {
            num_blocks: cfg.num_blocks,
            block_size: 16,
        },
        32000,
        3,
    );
    let mut s = Scheduler::new_local(cfg, 32000);
    for i in 0..n {
        s.add_request(request(i as u64, (steps + 32) as u32))
            .expect("admitted");
    }
    let mut events = Vec::new();
    // Warm up: prefill everyone.
    for _ in 0..4 {
        let l = s.schedule().expect("launch");
        let c = backend.execute(&l, s.tables().as_ref()).expect("null");
        s.on_completion(&c, &mut events);
        s.on_released(l.seq);
        events.clear();
    }
    assert_eq!(s.stats().running, n);
    // Two clock reads around the whole loop: per-call timers would add a syscall each. The
    // null backend's share (building an empty completion) is included.
    let wall = Instant::now();
    let t0 = thread_cpu_ns();
    for _ in 0..steps {
        let l = s.schedule().expect("launch");
        let c = backend.execute(&l, s.tables().as_ref()).expect("null");
        s.on_completion(&c, &mut events);
        s.on_released(l.seq);
        events.clear();
    }
    let cpu = thread_cpu_ns() - t0;
    let wall = wall.elapsed().as_secs_f64();
    (cpu as f64 / steps as f64 / 1e3, steps as f64 / wall)
}

/// End-to-end decode steps/s with the scheduler daemon, a null worker and a frontend link, each
/// on its own thread over a real segment.
fn rings_steps_per_sec(n: usize, steps: usize) -> Result<(f64, f64)> {
    let instance = format!("bench-{}-{n}", std::process::id());
    let cfg = config(n, steps, 2);
    let mut d = SchedulerDaemon::create(DaemonConfig {
        instance: instance.clone(),
        sched: cfg.clone(),
        vocab_size: 32000,
        frontends: 1,
        model_fingerprint: 0,
        weights_fingerprint: 0,
        tokenizer_fingerprint: 0,
        kv_dtype: baton_proto::plane::KV_DTYPE_UNKNOWN,
        launch_timeout: None,
        trace: None,
        vocabulary: None,
        lora_count: 0,
        lora_fingerprint: 0,
    })?;
    let stop = Arc::new(AtomicBool::new(false));
    let s2 = stop.clone();
    let sched_thread = std::thread::spawn(move || {
        let t0 = thread_cpu_ns();
        d.run(&s2);
        // The daemon (and its segment) is dropped only after the worker stopped: a worker
        // that sees its scheduler's segment gone reports an error.
        (thread_cpu_ns() - t0, d)
    });
    let (segment, limits) = baton_worker::daemon::attach(&instance, Duration::from_secs(5))?;
    let backend = NullBackend::new(
        KvCapacity {
            num_blocks: cfg.num_blocks,
            block_size: 16,
        },
        32000,
        3,
    );
    let mut w = WorkerDaemon::new(segment, limits, backend, 0, Duration::from_secs(5))?;
    let s3 = stop.clone();
    let worker_thread = std::thread::spawn(move || w.run(&s3));
    let mut link = FrontendLink::connect(&instance).context("connecting the bench frontend")?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while link.health().is_err() {
        anyhow::ensure!(Instant::now() < deadline, "worker never attached");
        std::thread::sleep(Duration::from_millis(5));
    }
    let prompt: Vec<u32> = (0..16).map(|i| 3 + i as u32).collect();
    for i in 0..n {
        let a = Admission {
            req: i as u64,
            prompt: &prompt,
            stop_token_ids: &[],
            eos_ids: &[],
            max_tokens: steps as u32,
            params: SamplingParams::greedy(),
            ignore_eos: false,
            logit_bias: &[],
            min_tokens: 0,
            cache_salt: 0,
            constraint: &[],
            guide_after: None,
            priority: 0,
            bad_words: &[],
            lora: 0,
        };
        link.submit(&a, Duration::from_secs(5))?;
    }
    let start_launches = link.stats().launches;
    let t = Instant::now();
    let mut finished = 0;
    let mut out = Vec::new();
    while finished < n {
        anyhow::ensure!(t.elapsed() < Duration::from_secs(600), "bench timed out");
        out.clear();
        if link.poll_batch(&mut out, 4096) == 0 {
            if let Some(m) = link.poll(Duration::from_millis(10)) {
                out.push(m);
            }
        }
        finished += out
            .iter()
            .filter(|m| m.kind == to_frontend::FINISHED)
            .count();
    }
    let secs = t.elapsed().as_secs_f64();
    let launches = link.stats().launches - start_launches;
    stop.store(true, Ordering::Relaxed);
    let (sched_cpu, daemon) = sched_thread.join().expect("scheduler thread");
    worker_thread.join().expect("worker thread")?;
    drop(daemon);
    Ok((
        launches as f64 / secs,
        sched_cpu as f64 / launches.max(1) as f64 / 1e3,
    ))
}

/// This process's command line, shell-quoted where needed.
fn command_line() -> String {
    std::env::args()
        .map(|a| {
            if !a.is_empty()
                && a.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_./:=,@%+".contains(&b))
            {
                a
            } else {
                format!("'{}'", a.replace('\'', "'\\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Runs a `baton bench` subcommand.
///
/// # Errors
/// A failed run.
pub fn run(cmd: BenchCmd) -> Result<()> {
    match cmd {
        BenchCmd::Decode(a) => crate::bench_decode::run(&a),
        BenchCmd::Serve(a) => baton_bench::run_serve(a, command_line()),
        BenchCmd::MockServer(a) => baton_bench::run_mock(a),
        BenchCmd::Sched(a) => {
            let mut rows = Vec::new();
            outln!(
                "{:>8} {:>22} {:>18} {:>22} {:>26}",
                "seqs",
                "sched CPU us/step",
                "steps/s (no IPC)",
                "steps/s (via rings)",
                "daemon CPU us/step (rings)"
            );
            for &n in &a.num_seqs {
                let (cpu_us, local_rate) = sched_cpu_per_step(n, a.steps);
                let (ring_rate, daemon_us) = rings_steps_per_sec(n, a.steps)?;
                outln!(
                    "{n:>8} {cpu_us:>22.1} {local_rate:>18.0} {ring_rate:>22.0} {daemon_us:>26.1}"
                );
                rows.push(serde_json::json!({
                    "num_seqs": n,
                    "steps": a.steps,
                    "sched_cpu_us_per_step": cpu_us,
                    "steps_per_s_in_process": local_rate,
                    "steps_per_s_through_rings": ring_rate,
                    "daemon_cpu_us_per_step": daemon_us,
                }));
            }
            if let Some(p) = a.out {
                std::fs::write(&p, serde_json::to_string_pretty(&rows)?)
                    .with_context(|| format!("writing {}", p.display()))?;
            }
            Ok(())
        }
    }
}
