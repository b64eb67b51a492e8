//! `baton scheduler`: the scheduler core behind the shared-memory control plane.
//!
//! Contract: the daemon owns the control segment. Each turn of its loop receives (liveness,
//! admissions and cancels, completions, released counters), decides (one or more launches), and
//! publishes (launch records to the worker, outputs to each frontend). A frontend whose death
//! the kernel reports has its requests cancelled and its ring pair reset before its slot is
//! reclaimed; a dead worker's launches are forgotten, its pages invalidated, and its running
//! requests requeued to recompute from their known history.

use crate::phases::PhaseClock;
use crate::request::{FinishReason, NewRequest, RequestId};
use crate::scheduler::{Event, Scheduler, SchedulerConfig};
use crate::trace::Tracer;
use baton_ipc::topology::{self, SchedulerFrontendEnds, SchedulerWorkerEnds};
use baton_ipc::{process, DoorbellRef, ParticipantTable, Registration, Role, Segment};
use baton_proto::plane::{self, PlaneLimits, SharedU32};
use baton_proto::wire::{
    self, completion_kind, reason, to_frontend, to_scheduler, CompletionSlot, LaunchSlot,
    ToFrontend, ToScheduler,
};
use baton_proto::{Completion, SamplingParams};
use bytemuck::Zeroable;
use rustc_hash::FxHashMap as HashMap;
use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often the daemon asks the kernel which participants died.
const LIVENESS_PERIOD: Duration = Duration::from_millis(20);

/// A gap this long between two turns of the step loop means the scheduler itself did not run
/// (stopped, swapped out, paused in a debugger or a VM): the step watchdog does not count the
/// gap against the worker (a turn is microseconds to milliseconds, an idle wait at most
/// [`LIVENESS_PERIOD`]).
const SELF_PAUSE: Duration = Duration::from_secs(1);

/// Everything `baton scheduler` needs.
#[derive(Clone, Debug)]
pub struct DaemonConfig {
    /// Instance name: the segment is `/dev/shm/baton-<instance>`.
    pub instance: String,
    /// Scheduler limits and policy.
    pub sched: SchedulerConfig,
    /// Vocabulary size for validating token ids (`usize::MAX`: unchecked).
    pub vocab_size: usize,
    /// Frontend slots.
    pub frontends: usize,
    /// The model's `ModelConfig::fingerprint`, published for workers and frontends to check
    /// at attach (0: unknown, unchecked).
    pub model_fingerprint: u64,
    /// The weights' fingerprint (`baton_model::weights_fingerprint`), published for workers
    /// to check at attach (0: unknown, unchecked).
    pub weights_fingerprint: u64,
    /// The tokenizer.json's fingerprint (`baton_model::tokenizer_fingerprint`), published for
    /// frontends to check at attach (0: unknown, unchecked).
    pub tokenizer_fingerprint: u64,
    /// The CPU KV cache's dtype the pool was sized for (`baton_proto::plane::KV_DTYPE_*`),
    /// published for CPU workers to follow or check.
    pub kv_dtype: u8,
    /// The step watchdog: when launches are in flight and no completion has arrived for this
    /// long, the worker is taken as hung and killed (SIGKILL), so the usual worker-death path
    /// requeues its requests once the kernel has released its liveness lock; its KV pages are
    /// reused only then. `None` disables it (vLLM's `VLLM_ENGINE_ITERATION_TIMEOUT_S`).
    pub launch_timeout: Option<Duration>,
    /// Lifecycle trace file.
    pub trace: Option<PathBuf>,
    /// The vocabulary structured outputs compile against (from the model's tokenizer.json);
    /// `None`: a request with a constraint is refused.
    pub vocabulary: Option<baton_grammar::Vocabulary>,
    /// LoRA adapters served (`--lora-modules` entries); an admission naming a higher adapter
    /// id is refused.
    pub lora_count: u32,
    /// Their fingerprint (`baton_model::lora::lora_fingerprint`), published for workers and
    /// frontends to check at attach (0: none).
    pub lora_fingerprint: u64,
}

/// Errors that stop the daemon.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// Creating or using the segment failed.
    #[error(transparent)]
    Segment(#[from] baton_ipc::SegmentError),
    /// A region is missing (a layout bug).
    #[error(transparent)]
    Region(#[from] baton_ipc::RegionError),
    /// Registration failed.
    #[error(transparent)]
    Register(#[from] baton_ipc::RegisterError),
    /// The trace file could not be created.
    #[error("creating trace file {path}: {err}")]
    Trace {
        /// The path.
        path: PathBuf,
        /// The error.
        err: std::io::Error,
    },
}

/// Where an engine-wide request id goes back to.
#[derive(Clone, Copy, Debug)]
struct Route {
    frontend: usize,
    generation: u64,
    local: u64,
    /// Phase timestamps: the queue and prefill times go out with the first token (the
    /// frontend's `/metrics` phase histograms).
    clock: PhaseClock,
}

/// An admission whose token slots are still arriving.
struct PendingAdmit {
    head: ToScheduler,
    tokens: Vec<u32>,
}

struct FrontendPort {
    ends: SchedulerFrontendEnds<ToScheduler, ToFrontend>,
    participant_slot: usize,
    outbox: VecDeque<ToFrontend>,
    pending: Option<PendingAdmit>,
}

/// The running daemon's state.
pub struct SchedulerDaemon {
    limits: PlaneLimits,
    vocabulary: Option<baton_grammar::Vocabulary>,
    segment: Segment,
    _me: Registration,
    participants: ParticipantTable,
    stats: baton_ipc::AtomicArray<baton_ipc::sync::AtomicU64>,
    doorbell: DoorbellRef,
    sched: Scheduler<SharedU32>,
    worker: SchedulerWorkerEnds<LaunchSlot, CompletionSlot>,
    worker_attached: Option<(usize, u64)>,
    completion_in: Option<(Completion, usize)>,
    frontends: Vec<FrontendPort>,
    routes: HashMap<RequestId, Route>,
    by_local: HashMap<(usize, u64), RequestId>,
    next_id: RequestId,
    events: Vec<Event>,
    scratch_launch: Vec<LaunchSlot>,
    scratch_in: Vec<ToScheduler>,
    scratch_done: Vec<CompletionSlot>,
    last_liveness: Instant,
    /// When the worker last showed progress (a completion, a release, nothing in flight),
    /// moved later by every pause of the scheduler's own ([`SELF_PAUSE`]).
    last_progress: Instant,
    /// When the step loop last started a turn.
    last_turn: Instant,
    launch_timeout: Option<Duration>,
    /// The hung worker was sent SIGKILL (once per attach).
    watchdog_fired: bool,
}

impl SchedulerDaemon {
    /// Creates the segment (removing a stale one whose creator died) and registers as the
    /// scheduler.
    ///
    /// # Errors
    /// A running instance of the same name, a bad instance name, an unwritable trace file.
    pub fn create(cfg: DaemonConfig) -> Result<Self, DaemonError> {
        let limits = PlaneLimits {
            block_size: cfg.sched.block_size,
            max_model_len: cfg.sched.max_model_len,
            max_num_seqs: cfg.sched.max_num_seqs,
            num_blocks: cfg.sched.num_blocks,
            max_num_batched_tokens: cfg.sched.max_num_batched_tokens,
            vocab_size: if cfg.vocab_size == usize::MAX {
                0
            } else {
                cfg.vocab_size
            },
            frontends: cfg.frontends,
            max_inflight: cfg.sched.max_inflight,
            model_fingerprint: cfg.model_fingerprint,
            weights_fingerprint: cfg.weights_fingerprint,
            tokenizer_fingerprint: cfg.tokenizer_fingerprint,
            priority_scheduling: cfg.sched.policy == crate::SchedulingPolicy::Priority,
            kv_dtype: cfg.kv_dtype,
            // A window past u32::MAX keys would need a longer max_model_len than any table
            // can hold; saturated, frontends would only admit fewer requests.
            kv_window: cfg
                .sched
                .kv_window
                .map_or(0, |w| u32::try_from(w).unwrap_or(u32::MAX)),
            prefix_caching: cfg.sched.enable_prefix_caching,
            lora_count: cfg.lora_count,
            lora_fingerprint: cfg.lora_fingerprint,
        };
        let control = limits.control_spec();
        // Waits out a half-made segment of a predecessor killed while creating it (taken as
        // stale after 2 s) instead of failing: the restart after a SIGKILL must succeed.
        let segment = Segment::create_waiting(
            &cfg.instance,
            &limits.layout_spec(),
            limits.to_limits(),
            Duration::from_secs(5),
        )?;
        let participants = segment.participants(topology::PARTICIPANTS)?;
        let me = participants.register_in(Role::Scheduler, control.scheduler_slots())?;
        let tables = Arc::new(plane::slot_tables(&segment, &limits)?);
        let mut sched = Scheduler::with_tables(cfg.sched.clone(), cfg.vocab_size, tables);
        if let Some(path) = &cfg.trace {
            let t = Tracer::to_file(path).map_err(|err| DaemonError::Trace {
                path: path.clone(),
                err,
            })?;
            sched.set_tracer(t);
        }
        let worker = SchedulerWorkerEnds::open(&segment, 0)?;
        let mut frontends = Vec::with_capacity(cfg.frontends);
        for (k, slot) in control.frontend_slots().enumerate() {
            frontends.push(FrontendPort {
                ends: SchedulerFrontendEnds::open(&segment, k)?,
                participant_slot: slot,
                outbox: VecDeque::new(),
                pending: None,
            });
        }
        let stats = segment.atomics_u64(plane::STATS)?;
        let doorbell = segment.doorbell(topology::SCHEDULER_DOORBELL)?;
        tracing::info!(instance = %cfg.instance, path = segment.path(), "control segment created");
        Ok(Self {
            limits,
            _me: me,
            participants,
            stats,
            doorbell,
            sched,
            worker,
            worker_attached: None,
            completion_in: None,
            frontends,
            routes: HashMap::default(),
            by_local: HashMap::default(),
            next_id: 1,
            events: Vec::new(),
            scratch_launch: Vec::new(),
            scratch_in: Vec::new(),
            scratch_done: Vec::new(),
            last_liveness: Instant::now() - LIVENESS_PERIOD,
            last_progress: Instant::now(),
            last_turn: Instant::now(),
            launch_timeout: cfg.launch_timeout,
            watchdog_fired: false,
            vocabulary: cfg.vocabulary,
            segment,
        })
    }

    /// The published limits.
    pub fn limits(&self) -> PlaneLimits {
        self.limits
    }

    /// Runs until `stop` is set, then fails every live request with `abort` and returns; the
    /// segment is unlinked when the daemon is dropped.
    pub fn run(&mut self, stop: &AtomicBool) {
        while !stop.load(Ordering::Relaxed) {
            let mut progressed = false;
            let now = Instant::now();
            let gap = now.duration_since(self.last_turn);
            if gap >= SELF_PAUSE {
                // The watchdog did not run meanwhile: that time is not the worker's. (Moved,
                // not restarted, so repeated pauses cannot hide a hung worker forever.)
                self.last_progress += gap;
            }
            self.last_turn = now;
            if self.last_liveness.elapsed() >= LIVENESS_PERIOD {
                self.check_liveness();
                self.last_liveness = Instant::now();
            }
            progressed |= self.receive_from_frontends();
            progressed |= self.receive_completions();
            if let Some(min) = self.participants.min_released(Role::Worker) {
                if self.worker_attached.is_some() && min > self.sched.released() {
                    self.sched.on_released(min);
                    progressed = true;
                }
            }
            progressed |= self.publish_launches();
            self.route_events();
            progressed |= self.flush_outboxes();
            self.publish_stats();
            if !progressed {
                self.idle_wait();
            }
        }
        self.shutdown();
    }

    fn idle_wait(&mut self) {
        let fronts = &self.frontends;
        let worker = &self.worker;
        let participants = &self.participants;
        let released = self.sched.released();
        let attached = self.worker_attached.is_some();
        self.doorbell.wait_until(LIVENESS_PERIOD, || {
            worker.completions.has_pending()
                || fronts.iter().any(|f| f.ends.from_frontend.has_pending())
                || (attached
                    && participants
                        .min_released(Role::Worker)
                        .is_some_and(|m| m > released))
        });
    }

    /// The step watchdog (see [`DaemonConfig::launch_timeout`]).
    fn check_progress(&mut self) {
        if self.sched.stats().inflight == 0 || self.worker_attached.is_none() {
            self.last_progress = Instant::now();
            return;
        }
        let Some(limit) = self.launch_timeout else {
            return;
        };
        // Progress the loop has not taken in yet (this check runs first in a turn) counts:
        // a worker that finished its launches while the scheduler was not running is not hung.
        let released = self.sched.released();
        if self.worker.completions.has_pending()
            || self
                .participants
                .min_released(Role::Worker)
                .is_some_and(|m| m > released)
        {
            self.last_progress = Instant::now();
            return;
        }
        if self.watchdog_fired || self.last_progress.elapsed() < limit {
            return;
        }
        let Some((slot, generation)) = self.worker_attached else {
            return;
        };
        let Some(p) = self.participants.snapshot().into_iter().find(|p| {
            p.slot == slot && p.generation == generation && p.state == baton_ipc::SlotState::Live
        }) else {
            return;
        };
        tracing::error!(
            pid = p.pid,
            seconds = limit.as_secs_f64(),
            released = self.sched.released(),
            published = self.sched.last_launch(),
            "worker made no progress on its launches; killing it (its requests are requeued)"
        );
        self.watchdog_fired = true;
        // The pid of the slot's live registration. Only a death in the instant between the
        // snapshot and this call could let the pid be reused (as with any kill by pid); a
        // process that died already is found by the liveness scan below anyway.
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(p.pid as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
    }

    fn check_liveness(&mut self) {
        self.check_progress();
        for dead in self.participants.scan_dead() {
            match dead.role {
                Role::Frontend => {
                    self.frontend_died(dead.slot, dead.generation, dead.pid, dead.exited)
                }
                Role::Worker => {
                    self.worker_died(dead.pid, dead.exited);
                    let _ = self.participants.reclaim(dead.slot, dead.generation);
                }
                _ => {
                    let _ = self.participants.reclaim(dead.slot, dead.generation);
                }
            }
        }
        if self.worker_attached.is_none() {
            let control = self.limits.control_spec();
            let live = self.participants.snapshot().into_iter().find(|p| {
                control.worker_slots().contains(&p.slot) && p.state == baton_ipc::SlotState::Live
            });
            if let Some(p) = live {
                tracing::info!(
                    pid = p.pid,
                    slot = p.slot,
                    generation = p.generation,
                    "worker attached"
                );
                self.worker_attached = Some((p.slot, p.generation));
                self.watchdog_fired = false;
                self.last_progress = Instant::now();
                self.segment
                    .status()
                    .fetch_or(plane::STATUS_WORKER_ATTACHED, Ordering::Release);
            }
        }
    }

    fn frontend_died(&mut self, slot: usize, generation: u64, pid: u32, exited: bool) {
        let Some(k) = self.limits.control_spec().frontend_index(slot) else {
            let _ = self.participants.reclaim(slot, generation);
            return;
        };
        let victims: Vec<RequestId> = self
            .routes
            .iter()
            .filter(|(_, r)| r.frontend == k)
            .map(|(&id, _)| id)
            .collect();
        tracing::info!(
            pid,
            frontend = k,
            exited,
            requests = victims.len(),
            "frontend gone; cancelling its requests"
        );
        let mut acks = Vec::new();
        for id in victims {
            self.sched.cancel(id, &mut acks);
            if let Some(r) = self.routes.remove(&id) {
                self.by_local.remove(&(r.frontend, r.local));
            }
        }
        let port = &mut self.frontends[k];
        port.outbox.clear();
        port.pending = None;
        // SAFETY: the frontend's process is gone (the kernel released its liveness lock, or it
        // left cleanly and dropped its ends), and this thread is the only user of the
        // scheduler's ends; nothing else touches these two rings during the reset.
        unsafe { port.ends.reset() };
        let _ = self.participants.reclaim(slot, generation);
    }

    fn worker_died(&mut self, pid: u32, exited: bool) {
        if exited && self.sched.is_idle() {
            // A clean exit with nothing to requeue (for example `baton serve` shutting down).
            tracing::info!(pid, "worker left");
        } else {
            tracing::warn!(
                pid,
                exited,
                "worker gone; requeueing running requests for recompute"
            );
        }
        self.segment
            .status()
            .fetch_and(!plane::STATUS_WORKER_ATTACHED, Ordering::Release);
        self.worker_attached = None;
        self.sched.on_worker_death();
        self.completion_in = None;
        // SAFETY: the worker's process is gone (kernel evidence) or it dropped its ends; this
        // thread is the only user of the scheduler's ends of both rings.
        unsafe {
            self.worker.launches.reset();
            self.worker.completions.reset();
        }
    }

    fn receive_from_frontends(&mut self) -> bool {
        let mut any = false;
        for k in 0..self.frontends.len() {
            self.scratch_in.clear();
            let n = self.frontends[k]
                .ends
                .from_frontend
                .pop_batch(&mut self.scratch_in, 256);
            if n == 0 {
                continue;
            }
            any = true;
            let generation = self
                .participants
                .info(self.frontends[k].participant_slot)
                .map_or(0, |i| i.generation);
            let slots = std::mem::take(&mut self.scratch_in);
            for msg in &slots {
                self.on_frontend_msg(k, generation, msg);
            }
            self.scratch_in = slots;
        }
        any
    }

    fn on_frontend_msg(&mut self, k: usize, generation: u64, msg: &ToScheduler) {
        match msg.kind {
            to_scheduler::ADMIT => {
                if self.frontends[k].pending.is_some() {
                    let old = self.frontends[k]
                        .pending
                        .take()
                        .map(|p| p.head.req)
                        .unwrap_or(0);
                    self.reply_error(k, old, wire::error::PROTOCOL, 0);
                }
                let want = wire::admit_words(msg);
                self.frontends[k].pending = Some(PendingAdmit {
                    head: *msg,
                    // The claimed size is not trusted for the allocation.
                    tokens: Vec::with_capacity(want.min(1 << 16)),
                });
                if want == 0 {
                    self.finish_admit(k, generation);
                }
            }
            to_scheduler::TOKENS => {
                let Some(p) = &mut self.frontends[k].pending else {
                    self.reply_error(k, msg.req, wire::error::PROTOCOL, 0);
                    return;
                };
                let n = (msg.n as usize).min(wire::TOKENS_PER_SLOT);
                p.tokens.extend_from_slice(&msg.tokens[..n]);
                if p.tokens.len() >= wire::admit_words(&p.head) {
                    self.finish_admit(k, generation);
                }
            }
            to_scheduler::CANCEL => {
                if let Some(&id) = self.by_local.get(&(k, msg.req)) {
                    let mut events = std::mem::take(&mut self.events);
                    self.sched.cancel(id, &mut events);
                    self.events = events;
                } else if self.frontends[k]
                    .pending
                    .as_ref()
                    .is_some_and(|p| p.head.req == msg.req)
                {
                    self.frontends[k].pending = None;
                    self.reply_finished(k, msg.req, reason::CANCELLED, FinishedCounts::default());
                }
            }
            _ => self.reply_error(k, msg.req, wire::error::PROTOCOL, msg.kind),
        }
    }

    fn finish_admit(&mut self, k: usize, generation: u64) {
        let Some(p) = self.frontends[k].pending.take() else {
            return;
        };
        let prompt_len = p.head.prompt_len as usize;
        let mut tokens = p.tokens;
        let bias_len = 2 * p.head.params.logit_bias_len as usize;
        let mut bias_words = tokens.split_off((prompt_len + p.head.n as usize).min(tokens.len()));
        let mut constraint_words = bias_words.split_off(bias_len.min(bias_words.len()));
        let constraint_word_len = (p.head.constraint_len as usize).div_ceil(4);
        let bad_words_words =
            constraint_words.split_off(constraint_word_len.min(constraint_words.len()));
        let Some(bad_words) = wire::unpack_bad_words(&bad_words_words) else {
            tracing::debug!(frontend = k, req = p.head.req, "malformed bad_words");
            self.reply_error(k, p.head.req, wire::error::INVALID, 0);
            return;
        };
        if p.head.lora > self.limits.lora_count {
            tracing::debug!(
                frontend = k,
                req = p.head.req,
                lora = p.head.lora,
                "admission names an adapter this scheduler does not serve"
            );
            self.reply_error(k, p.head.req, wire::error::INVALID, 0);
            return;
        }
        let mut stop_token_ids = tokens.split_off(prompt_len.min(tokens.len()));
        let eos_ids =
            stop_token_ids.split_off(stop_token_ids.len().saturating_sub(p.head.eos_len as usize));
        // The frontend compiled the constraint already; a failure here (no vocabulary, or a
        // frontend of another build) refuses the request like any invalid one.
        let guide = match p.head.constraint_len {
            0 => Ok(None),
            n => {
                let bytes = wire::unpack_bytes(&constraint_words, n as usize);
                match &self.vocabulary {
                    Some(v) => baton_grammar::Constraint::from_wire(&bytes)
                        .and_then(|c| v.compile(&c))
                        .map(Some)
                        .map_err(|e| e.to_string()),
                    None => {
                        self.reply_error(k, p.head.req, wire::error::NO_GRAMMAR_VOCABULARY, 0);
                        return;
                    }
                }
            }
        };
        let guide = match guide {
            // The end of the reasoning, when the frontend's reasoning parser asked for it.
            Ok(g) if p.head.flags & wire::FLAG_GUIDE_AFTER != 0 => {
                g.map(|g| g.start_after(p.head.guide_after))
            }
            Ok(g) => g,
            Err(e) => {
                tracing::debug!(
                    frontend = k,
                    req = p.head.req,
                    "structured output refused: {e}"
                );
                self.reply_error(k, p.head.req, wire::error::INVALID, 0);
                return;
            }
        };
        let logit_bias = bias_words
            .chunks_exact(2)
            .map(|w| (w[0], f32::from_bits(w[1])))
            .collect();
        let id = self.next_id;
        let params: SamplingParams = p.head.params;
        let req = NewRequest {
            priority: p.head.priority,
            id,
            prompt: tokens,
            max_tokens: p.head.max_tokens,
            params,
            eos_ids,
            stop_token_ids,
            ignore_eos: p.head.flags & wire::FLAG_IGNORE_EOS != 0,
            logit_bias,
            min_tokens: p.head.min_tokens,
            cache_salt: p.head.cache_salt,
            guide,
            bad_words,
            lora: p.head.lora,
        };
        match self.sched.add_request(req) {
            Ok(()) => {
                self.next_id += 1;
                self.routes.insert(
                    id,
                    Route {
                        frontend: k,
                        generation,
                        local: p.head.req,
                        clock: PhaseClock::new(Instant::now()),
                    },
                );
                self.by_local.insert((k, p.head.req), id);
            }
            Err(e) => {
                tracing::debug!(frontend = k, req = p.head.req, "admission refused: {e}");
                self.reply_error(k, p.head.req, wire::error::INVALID, 0);
            }
        }
    }

    fn reply_error(&mut self, k: usize, req: u64, code: u32, detail: u32) {
        let mut m = ToFrontend::zeroed();
        m.kind = to_frontend::ERROR;
        m.reason = code;
        m.req = req;
        m.detail = detail;
        self.frontends[k].outbox.push_back(m);
    }

    fn reply_finished(&mut self, k: usize, req: u64, why: u32, tokens: FinishedCounts) {
        let mut m = ToFrontend::zeroed();
        m.kind = to_frontend::FINISHED;
        m.reason = why;
        m.req = req;
        m.prompt_tokens = tokens.prompt as u32;
        m.output_tokens = tokens.output as u32;
        m.detail = tokens.cached as u32;
        self.frontends[k].outbox.push_back(m);
    }

    fn receive_completions(&mut self) -> bool {
        self.scratch_done.clear();
        if self
            .worker
            .completions
            .pop_batch(&mut self.scratch_done, 1024)
            == 0
        {
            return false;
        }
        self.last_progress = Instant::now();
        let slots = std::mem::take(&mut self.scratch_done);
        for s in &slots {
            match s.kind {
                completion_kind::HEADER => {
                    if let Some((c, _)) = self.completion_in.take() {
                        tracing::error!(seq = c.seq, "torn completion; dropping it");
                    }
                    let c = Completion {
                        seq: s.seq,
                        sampled: Vec::with_capacity(s.n as usize),
                        prompt: Vec::new(),
                    };
                    if s.n == 0 {
                        self.accept_completion(c);
                    } else {
                        self.completion_in = Some((c, s.n as usize));
                    }
                }
                completion_kind::SAMPLED | completion_kind::PROMPT => {
                    let done = match &mut self.completion_in {
                        Some((c, want)) if c.seq == s.seq => {
                            if s.kind == completion_kind::SAMPLED {
                                c.sampled.push(wire::decode_sampled(s));
                            } else {
                                c.prompt.push(wire::decode_prompt(s));
                            }
                            c.sampled.len() + c.prompt.len() == *want
                        }
                        _ => {
                            tracing::error!(
                                seq = s.seq,
                                "sampled row outside its completion; dropping it"
                            );
                            false
                        }
                    };
                    if done {
                        if let Some((c, _)) = self.completion_in.take() {
                            self.accept_completion(c);
                        }
                    }
                }
                completion_kind::FAILED => {
                    tracing::error!(
                        seq = s.seq,
                        code = s.n,
                        "worker failed a launch; aborting its requests"
                    );
                    let mut events = std::mem::take(&mut self.events);
                    self.sched.on_failed_launch(s.seq, &mut events);
                    self.events = events;
                }
                k => tracing::error!(kind = k, "unknown completion slot"),
            }
        }
        self.scratch_done = slots;
        true
    }

    fn accept_completion(&mut self, c: Completion) {
        let mut events = std::mem::take(&mut self.events);
        self.sched.on_completion(&c, &mut events);
        self.events = events;
    }

    fn publish_launches(&mut self) -> bool {
        if self.worker_attached.is_none() {
            return false;
        }
        let mut any = false;
        while let Some(l) = self.sched.schedule() {
            if !self.sched.started().is_empty() {
                let now = Instant::now();
                for id in self.sched.started() {
                    if let Some(r) = self.routes.get_mut(id) {
                        r.clock.scheduled(now);
                    }
                }
            }
            self.scratch_launch.clear();
            wire::encode_launch(&l, &mut self.scratch_launch);
            // The ring holds max_inflight launches of max_num_seqs rows, so this never waits
            // long; a full ring means the worker stopped consuming, which liveness will see.
            let mut sent = 0;
            let deadline = Instant::now() + Duration::from_secs(1);
            while sent < self.scratch_launch.len() && Instant::now() < deadline {
                sent += self
                    .worker
                    .launches
                    .push_batch(&self.scratch_launch[sent..]);
                if sent < self.scratch_launch.len() {
                    std::thread::yield_now();
                }
            }
            if sent < self.scratch_launch.len() {
                tracing::error!(
                    seq = l.seq,
                    "launch ring stayed full for 1 s; worker is hung"
                );
            }
            any = true;
        }
        any
    }

    fn route_events(&mut self) {
        let events = std::mem::take(&mut self.events);
        // One clock read for all the events routed now (a token's time is its completion's).
        let mut now = None;
        for e in &events {
            match *e {
                Event::Token {
                    id,
                    token,
                    cached_tokens,
                    logprob,
                    ref top,
                } => {
                    let Some(r) = self.routes.get_mut(&id) else {
                        continue;
                    };
                    let first = r.clock.token(*now.get_or_insert_with(Instant::now));
                    let r = *r;
                    let mut m = ToFrontend::zeroed();
                    m.kind = to_frontend::TOKEN;
                    m.first = wire::encode_first(first);
                    m.req = r.local;
                    m.token = token;
                    m.logprob = logprob;
                    m.detail = cached_tokens as u32;
                    put_top(&mut m, top);
                    self.frontends[r.frontend].outbox.push_back(m);
                }
                Event::PromptLogprob {
                    id,
                    pos,
                    token,
                    logprob,
                    rank,
                    ref top,
                } => {
                    let Some(r) = self.routes.get(&id) else {
                        continue;
                    };
                    let mut m = ToFrontend::zeroed();
                    m.kind = to_frontend::PROMPT_LOGPROB;
                    m.req = r.local;
                    m.token = token;
                    m.logprob = logprob;
                    m.detail = pos;
                    m.output_tokens = rank;
                    put_top(&mut m, top);
                    self.frontends[r.frontend].outbox.push_back(m);
                }
                Event::Finished {
                    id,
                    reason: why,
                    prompt_tokens,
                    output_tokens,
                    cached_tokens,
                } => {
                    let Some(r) = self.routes.remove(&id) else {
                        continue;
                    };
                    self.by_local.remove(&(r.frontend, r.local));
                    let code = match why {
                        FinishReason::Stop => reason::STOP,
                        FinishReason::Length => reason::LENGTH,
                        FinishReason::Abort => reason::ABORT,
                        FinishReason::Cancelled => reason::CANCELLED,
                    };
                    let _ = r.generation;
                    let counts = FinishedCounts {
                        prompt: prompt_tokens,
                        output: output_tokens,
                        cached: cached_tokens,
                    };
                    self.reply_finished(r.frontend, r.local, code, counts);
                }
            }
        }
        let mut events = events;
        events.clear();
        self.events = events;
    }

    fn flush_outboxes(&mut self) -> bool {
        let mut any = false;
        for port in &mut self.frontends {
            while let Some(m) = port.outbox.front() {
                if port.ends.to_frontend.try_push(*m).is_err() {
                    break;
                }
                port.outbox.pop_front();
                any = true;
            }
        }
        any
    }

    fn publish_stats(&self) {
        let s = self.sched.stats();
        let set = |i: usize, v: u64| self.stats[i].store(v, Ordering::Relaxed);
        set(plane::STAT_RUNNING, s.running as u64);
        set(plane::STAT_WAITING, s.waiting as u64);
        set(plane::STAT_PAGES_USED, (s.pool.total - s.pool.free) as u64);
        set(plane::STAT_PAGES_TOTAL, s.pool.total as u64);
        set(plane::STAT_PAGES_RETIRED, s.pool.retired as u64);
        set(plane::STAT_LAUNCHES, s.launches);
        set(plane::STAT_PREEMPTIONS, s.preemptions);
        set(plane::STAT_PREFIX_QUERIES, s.prefix_cache_queries);
        set(plane::STAT_PREFIX_HITS, s.prefix_cache_hits);
        set(plane::STAT_HEARTBEAT_MS, process::monotonic_ms());
        self._me.heartbeat();
    }

    fn shutdown(&mut self) {
        tracing::info!("shutting down: failing live requests");
        self.segment
            .status()
            .fetch_or(plane::STATUS_SHUTTING_DOWN, Ordering::Release);
        let mut events = std::mem::take(&mut self.events);
        self.sched.abort_all(FinishReason::Abort, &mut events);
        // Live requests end with the shutdown error (the frontend answers 503 or ends the
        // stream with an error event, as it does at its own shutdown), not an ordinary "abort"
        // finish a client could take for a complete answer.
        for e in &events {
            if let Event::Finished { id, .. } = *e {
                if let Some(r) = self.routes.remove(&id) {
                    self.by_local.remove(&(r.frontend, r.local));
                    self.reply_error(r.frontend, r.local, wire::error::SHUTDOWN, 0);
                }
            }
        }
        self.events = events;
        self.route_events();
        let deadline = Instant::now() + Duration::from_millis(200);
        while self.frontends.iter().any(|f| !f.outbox.is_empty()) && Instant::now() < deadline {
            self.flush_outboxes();
            std::thread::sleep(Duration::from_millis(1));
        }
        self.sched.flush_trace();
    }

    /// The segment (for tests).
    pub fn segment(&self) -> &Segment {
        &self.segment
    }
}

/// Token counts of a finished request, as the frontend's `usage` reports them.
#[derive(Clone, Copy, Debug, Default)]
struct FinishedCounts {
    prompt: usize,
    output: usize,
    /// Prompt positions taken from the prefix cache.
    cached: usize,
}

/// Copies up to [`baton_proto::MAX_TOP_LOGPROBS`] top entries into `m`.
fn put_top(m: &mut ToFrontend, top: &[(u32, f32)]) {
    let n = top.len().min(baton_proto::MAX_TOP_LOGPROBS);
    m.n_top = n as u32;
    for (i, &(t, lp)) in top[..n].iter().enumerate() {
        m.top_ids[i] = t;
        m.top_logprobs[i] = lp;
    }
}
