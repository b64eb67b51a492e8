//! `baton worker`: a backend behind the launch and completion rings of a control segment.
//!
//! Contract: the worker executes launches in ring order, and for each one publishes its
//! completion and then advances its `released` counter, both only after the backend returned
//! from the launch (its fence). A launch that fails is reported as failed and released too, so
//! the scheduler aborts its requests instead of waiting forever.
//!
//! A backend that can hold launches in flight ([`Backend::max_in_flight`] > 1: the CUDA
//! worker) gets the next launch submitted while the device still runs the previous one, when
//! the scheduler has already published it: the host's staging of launch n + 1 then overlaps
//! the device's work on launch n, and the device goes from one launch to the next without
//! waiting for the host. Completions are still published, and `released` still advances, in
//! launch order and each only after that launch's fence.

use crate::{Backend, WorkerError};
use baton_ipc::topology::{self, WorkerEnds};
use baton_ipc::{Registration, Role, Segment};
use baton_proto::plane::{self, PlaneLimits, SharedSlotTables};
use baton_proto::wire::{self, completion_kind, CompletionSlot, LaunchAssembler, LaunchSlot};
use bytemuck::Zeroable;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Errors that stop the worker daemon.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// The segment could not be attached.
    #[error("attaching to instance {instance}: {err}")]
    Attach {
        /// The instance.
        instance: String,
        /// Why.
        err: baton_ipc::SegmentError,
    },
    /// A region or ring end could not be opened.
    #[error("opening the worker's rings")]
    Region(#[from] baton_ipc::RegionError),
    /// No worker slot became free in time.
    #[error("registering as worker")]
    Register(#[from] baton_ipc::RegisterError),
    /// Another worker holds the instance's worker slot.
    #[error(
        "another worker (pid {pid}) is attached to instance {instance}: an instance runs one \
         worker (stop it first; a worker that dies is replaced by the next one to attach)"
    )]
    Taken {
        /// The instance.
        instance: String,
        /// The attached worker's pid.
        pid: u32,
    },
    /// The backend does not match the published limits.
    #[error("{0}")]
    Mismatch(String),
    /// The scheduler that created the segment exited; a restarted one makes a new segment,
    /// so this worker must be restarted too.
    #[error("the scheduler of instance {0} exited; restart the worker with it")]
    SchedulerGone(String),
}

/// Attaches to `instance`: reads the published limits, then attaches with the matching layout.
/// Retries for up to `wait` while the segment does not exist yet, is still being created, or is
/// a dead scheduler's leftover that the next scheduler will replace, so a worker may start
/// before its scheduler.
///
/// # Errors
/// No such instance after `wait`, a layout mismatch, a dead creator.
pub fn attach(instance: &str, wait: Duration) -> Result<(Segment, PlaneLimits), DaemonError> {
    let deadline = Instant::now() + wait;
    loop {
        let res = Segment::peek_limits(instance).and_then(|l| {
            let limits = PlaneLimits::from_limits(&l);
            Segment::attach(instance, &limits.layout_spec()).map(|s| (s, limits))
        });
        match res {
            Ok(ok) => return Ok(ok),
            Err(
                baton_ipc::SegmentError::NotFound { .. }
                | baton_ipc::SegmentError::Initializing { .. }
                | baton_ipc::SegmentError::CreatorDead { .. },
            ) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(err) => {
                return Err(DaemonError::Attach {
                    instance: instance.to_owned(),
                    err,
                })
            }
        }
    }
}

/// A worker attached to a control segment.
pub struct WorkerDaemon<B: Backend> {
    segment: Segment,
    me: Registration,
    ends: WorkerEnds<LaunchSlot, CompletionSlot>,
    tables: SharedSlotTables,
    backend: B,
    assembler: LaunchAssembler,
    out: Vec<CompletionSlot>,
    /// Launches submitted to the backend and not yet finished (see [`Backend::submit`]).
    inflight: usize,
}

impl<B: Backend> WorkerDaemon<B> {
    /// Registers in a worker slot of `segment` and opens the worker's rings, retrying for up
    /// to `wait` while the scheduler is still cleaning up after a previous worker.
    /// `weights_fingerprint` identifies the backend's weights (`baton_model::weights_fingerprint`;
    /// 0: unknown, as for the null backend).
    ///
    /// # Errors
    /// A backend whose KV pool, block size, vocabulary, model fingerprint or weights
    /// fingerprint differs from the published limits; no slot or ring became free within
    /// `wait`.
    pub fn new(
        segment: Segment,
        limits: PlaneLimits,
        backend: B,
        weights_fingerprint: u64,
        wait: Duration,
    ) -> Result<Self, DaemonError> {
        let cap = backend.kv_capacity();
        if cap.block_size != limits.block_size || cap.num_blocks < limits.num_blocks {
            return Err(DaemonError::Mismatch(format!(
                "backend KV pool ({} pages of {}) does not cover the scheduler's {} pages of {}",
                cap.num_blocks, cap.block_size, limits.num_blocks, limits.block_size
            )));
        }
        if limits.vocab_size != 0 && limits.vocab_size != backend.vocab_size() {
            return Err(DaemonError::Mismatch(format!(
                "the scheduler validates against a vocabulary of {} but the model has {}",
                limits.vocab_size,
                backend.vocab_size()
            )));
        }
        if limits.max_model_len > backend.max_positions() {
            return Err(DaemonError::Mismatch(format!(
                "the scheduler serves sequences of up to {} positions but this worker's model \
                 computes at most {} (max_position_embeddings); start the scheduler with \
                 --max-model-len {} or less, or both with the same --model",
                limits.max_model_len,
                backend.max_positions(),
                backend.max_positions()
            )));
        }
        let mine = backend.model_fingerprint();
        if limits.model_fingerprint != 0 && mine != 0 && limits.model_fingerprint != mine {
            return Err(DaemonError::Mismatch(format!(
                "this worker's model (config fingerprint {mine:016x}) is not the scheduler's \
                 ({:016x}): layers, widths, heads, vocabulary, RoPE or sliding windows differ; start both with \
                 the same --model",
                limits.model_fingerprint
            )));
        }
        let (theirs, mine) = (limits.weights_fingerprint, weights_fingerprint);
        if theirs != 0 && mine != 0 && theirs != mine {
            return Err(DaemonError::Mismatch(format!(
                "this worker's weights (fingerprint {mine:016x}) are not the scheduler's \
                 ({theirs:016x}): the model has the same shape but another checkpoint, or \
                 another --load-format or --seed; start both with the same --model, \
                 --load-format and --seed"
            )));
        }
        let control = limits.control_spec();
        let participants = segment.participants(topology::PARTICIPANTS)?;
        let deadline = Instant::now() + wait;
        // Since when a live worker has held the slot, while this one retried.
        let mut held_since: Option<(u32, Instant)> = None;
        let me = loop {
            match participants.register_in(Role::Worker, control.worker_slots()) {
                Ok(r) => break r,
                Err(e) => {
                    // A worker that stays alive holds the slot: waiting cannot help. (One that
                    // died, or is dying as a replacement starts, is reclaimed by the scheduler
                    // shortly: wait for that.)
                    let holder = participants.snapshot().into_iter().find(|p| {
                        control.worker_slots().contains(&p.slot)
                            && p.state == baton_ipc::SlotState::Live
                            && baton_ipc::process::is_alive(p.pid, p.start_time)
                    });
                    held_since = holder.map(|p| match held_since {
                        Some((pid, t)) if pid == p.pid => (pid, t),
                        _ => (p.pid, Instant::now()),
                    });
                    if let Some((pid, t)) = held_since {
                        if t.elapsed() >= Duration::from_secs(1) {
                            return Err(DaemonError::Taken {
                                instance: segment.instance().to_owned(),
                                pid,
                            });
                        }
                    }
                    if Instant::now() >= deadline {
                        return Err(e.into());
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        };
        let ends = loop {
            match WorkerEnds::open(&segment, 0) {
                Ok(e) => break e,
                Err(e) if Instant::now() >= deadline => return Err(e.into()),
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        };
        let tables = plane::slot_tables(&segment, &limits)?;
        tracing::info!(
            slot = me.slot(),
            generation = me.generation(),
            backend = backend.name(),
            "worker attached"
        );
        Ok(Self {
            segment,
            me,
            ends,
            tables,
            backend,
            assembler: LaunchAssembler::default(),
            out: Vec::new(),
            inflight: 0,
        })
    }

    /// Executes launches until `stop` is set, then finishes the launches in flight.
    ///
    /// # Errors
    /// [`DaemonError::SchedulerGone`] when the scheduler died (checked while idle).
    pub fn run(&mut self, stop: &AtomicBool) -> Result<(), DaemonError> {
        let depth = self.backend.max_in_flight().max(1);
        let r = self.run_launches(depth, stop);
        self.drain(stop);
        r
    }

    fn run_launches(&mut self, depth: usize, stop: &AtomicBool) -> Result<(), DaemonError> {
        while !stop.load(Ordering::Relaxed) {
            self.me.heartbeat();
            // With launches in flight the device is busy: take what the ring already holds
            // without waiting. With every frame taken, wait for the oldest launch's fence;
            // with room for one more, finish the oldest only once its fence has passed, and
            // meanwhile keep looking at the ring: the scheduler publishes the next launch
            // when it has the completion before the oldest, and submitting it before the
            // oldest's fence is what keeps the device busy.
            let slot = if self.inflight == 0 {
                self.ends.launches.wait_pop(Duration::from_millis(100))
            } else if self.inflight < depth {
                self.ends.launches.pop()
            } else {
                None
            };
            let Some(slot) = slot else {
                if self.inflight >= depth || (self.inflight > 0 && self.backend.oldest_done()) {
                    self.finish_oldest(stop);
                    continue;
                }
                if self.inflight > 0 {
                    std::thread::yield_now();
                    continue;
                }
                if !self.segment.creator_alive() {
                    return Err(DaemonError::SchedulerGone(
                        self.segment.instance().to_owned(),
                    ));
                }
                continue;
            };
            match self.assembler.feed(&slot) {
                Ok(Some(launch)) => self.start(&launch, depth, stop),
                Ok(None) => {}
                Err(e) => tracing::error!("malformed launch ring: {e}"),
            }
        }
        Ok(())
    }

    /// Submits `launch` behind the launches in flight when the backend can overlap it;
    /// otherwise finishes those and executes it to its fence.
    fn start(&mut self, launch: &baton_proto::Launch, depth: usize, stop: &AtomicBool) {
        if depth > 1 {
            match self.backend.submit(launch, &self.tables) {
                Ok(true) => {
                    self.inflight += 1;
                    return;
                }
                Ok(false) => {}
                Err(e) => {
                    // Earlier launches complete first, in order.
                    self.drain(stop);
                    self.publish(launch.seq, Err(e), stop);
                    return;
                }
            }
        }
        self.drain(stop);
        let r = self.backend.execute(launch, &self.tables);
        self.publish(launch.seq, r, stop);
    }

    /// Finishes every launch in flight, oldest first.
    fn drain(&mut self, stop: &AtomicBool) {
        while self.inflight > 0 {
            self.finish_oldest(stop);
        }
    }

    /// Waits for the oldest launch in flight and publishes it.
    fn finish_oldest(&mut self, stop: &AtomicBool) {
        self.inflight = self.inflight.saturating_sub(1);
        match self.backend.finish() {
            Some((seq, r)) => self.publish(seq, r, stop),
            None => tracing::error!("the backend had no launch in flight to finish"),
        }
    }

    /// Publishes the completion (or failure) of launch `seq`, whose fence has passed, then
    /// releases it.
    fn publish(
        &mut self,
        seq: baton_proto::LaunchSeq,
        r: Result<baton_proto::Completion, WorkerError>,
        stop: &AtomicBool,
    ) {
        self.out.clear();
        match r {
            Ok(c) => wire::encode_completion(&c, &mut self.out),
            Err(e) => {
                tracing::error!(seq, "launch failed: {e}");
                let mut f = CompletionSlot::zeroed();
                f.kind = completion_kind::FAILED;
                f.seq = seq;
                f.n = match e {
                    WorkerError::MissingPending { .. } => 1,
                    WorkerError::Forward(_) => 2,
                    WorkerError::Device(_) => 3,
                };
                self.out.push(f);
            }
        }
        // The fence passed (execute returned): publish, then release.
        let mut sent = 0;
        while sent < self.out.len() && !stop.load(Ordering::Relaxed) {
            sent += self.ends.completions.push_batch(&self.out[sent..]);
            if sent < self.out.len() {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
        self.me.set_released(seq);
    }
}
