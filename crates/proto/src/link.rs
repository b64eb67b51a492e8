//! The frontend's end of the control plane: register in a frontend slot, push admissions and
//! cancels, pop outputs.
//!
//! Contract: a link owns one frontend ring pair for as long as its registration lives. A
//! request is admitted as one `ADMIT` slot followed by its token slots, pushed contiguously;
//! after a `CANCEL`, the frontend keeps the request's state until the scheduler's `FINISHED`
//! (reason `CANCELLED`, or any other final reason) arrives for it.

use crate::plane::{self, PlaneLimits};
use crate::wire::{self, to_scheduler, ToFrontend, ToScheduler, TOKENS_PER_SLOT};
use crate::SamplingParams;
use baton_ipc::topology::{self, FrontendEnds};
use baton_ipc::{process, ParticipantTable, Registration, Role, Segment, SlotState};
use bytemuck::Zeroable;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// Errors of a [`FrontendLink`].
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    /// Attaching failed (no scheduler, a layout mismatch, ...).
    #[error("attaching to instance {instance}: {err}")]
    Attach {
        /// The instance.
        instance: String,
        /// Why.
        err: baton_ipc::SegmentError,
    },
    /// Opening a region failed.
    #[error(transparent)]
    Region(#[from] baton_ipc::RegionError),
    /// Every frontend slot is taken.
    #[error("no free frontend slot")]
    Register(#[from] baton_ipc::RegisterError),
    /// The admission ring stayed full (the scheduler is not draining it).
    #[error("the scheduler is not accepting requests (admission ring full)")]
    Full,
}

/// A request as the frontend hands it to the scheduler.
#[derive(Clone, Debug)]
pub struct Admission<'a> {
    /// The frontend's id for it, unique among this link's live requests.
    pub req: u64,
    /// Prompt token ids.
    pub prompt: &'a [u32],
    /// Extra stop token ids.
    pub stop_token_ids: &'a [u32],
    /// The model's EOS ids (none of them in `stop_token_ids`): they end the request unless
    /// `ignore_eos`, and `min_tokens` holds them back either way.
    pub eos_ids: &'a [u32],
    /// Most new tokens.
    pub max_tokens: u32,
    /// Sampling parameters (seed set); `logit_bias_len` is set from `logit_bias` on submit.
    pub params: SamplingParams,
    /// OpenAI `logit_bias` as `(token, bias)`, at most [`crate::MAX_LOGIT_BIAS`] entries.
    pub logit_bias: &'a [(u32, f32)],
    /// vLLM's `min_tokens`: no stop id is sampled, and none ends the request, before this many
    /// outputs.
    pub min_tokens: u32,
    /// vLLM's `cache_salt`, hashed (0: none).
    pub cache_salt: u64,
    /// The LoRA adapter (0: the base model; see [`crate::wire::ToScheduler::lora`]).
    pub lora: u32,
    /// `eos_ids` end nothing (vLLM's `ignore_eos`).
    pub ignore_eos: bool,
    /// The structured-output constraint's wire form (`baton_grammar::Constraint::to_wire`);
    /// empty: unconstrained.
    pub constraint: &'a [u8],
    /// The constraint applies only after this token is sampled (the end of the reasoning,
    /// `baton_grammar::Guide::start_after`); `None`: from the first token.
    pub guide_after: Option<u32>,
    /// vLLM's `priority` (see [`crate::wire::ToScheduler::priority`]).
    pub priority: i32,
    /// vLLM's `bad_words` as token sequences, each non-empty; at most
    /// [`wire::MAX_BAD_WORDS_WORDS`] words once packed ([`wire::pack_bad_words`]).
    pub bad_words: &'a [Vec<u32>],
}

/// Scheduler statistics read from the segment.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PlaneStats {
    /// Requests running.
    pub running: u64,
    /// Requests waiting.
    pub waiting: u64,
    /// Pages not free (in use or retired).
    pub pages_used: u64,
    /// Pages retired, waiting for a fence.
    pub pages_retired: u64,
    /// Pages in the pool.
    pub pages_total: u64,
    /// Launches so far.
    pub launches: u64,
    /// Preemptions so far.
    pub preemptions: u64,
    /// Prompt positions looked up in the prefix cache so far.
    pub prefix_cache_queries: u64,
    /// Of those, positions found.
    pub prefix_cache_hits: u64,
}

/// A frontend's registration and ring pair.
pub struct FrontendLink {
    shared: std::sync::Arc<LinkShared>,
    tx: LinkSender,
    rx: LinkReceiver,
}

/// What both halves of a split link share: the mapping, the registration, the limits.
pub struct LinkShared {
    segment: Segment,
    limits: PlaneLimits,
    participants: ParticipantTable,
    me: Registration,
    stats: baton_ipc::AtomicArray<baton_ipc::sync::AtomicU64>,
}

/// The sending half: admissions and cancels.
pub struct LinkSender {
    ring: baton_ipc::RingProducer<ToScheduler>,
    scratch: Vec<ToScheduler>,
}

/// The receiving half: outputs and acknowledgements.
pub struct LinkReceiver {
    ring: baton_ipc::RingConsumer<ToFrontend>,
}

impl FrontendLink {
    /// Attaches to `instance` and registers in a free frontend slot.
    ///
    /// # Errors
    /// No scheduler running, a layout mismatch, no free frontend slot.
    pub fn connect(instance: &str) -> Result<Self, LinkError> {
        let err = |err| LinkError::Attach {
            instance: instance.to_owned(),
            err,
        };
        let limits = PlaneLimits::from_limits(&Segment::peek_limits(instance).map_err(err)?);
        let segment = Segment::attach(instance, &limits.layout_spec()).map_err(err)?;
        let control = limits.control_spec();
        let participants = segment.participants(topology::PARTICIPANTS)?;
        let me = participants.register_in(Role::Frontend, control.frontend_slots())?;
        let k = control
            .frontend_index(me.slot())
            .expect("registered in a frontend slot");
        let ends: FrontendEnds<ToScheduler, ToFrontend> = FrontendEnds::open(&segment, k)?;
        let stats = segment.atomics_u64(plane::STATS)?;
        Ok(Self {
            shared: std::sync::Arc::new(LinkShared {
                segment,
                limits,
                participants,
                me,
                stats,
            }),
            tx: LinkSender {
                ring: ends.to_scheduler,
                scratch: Vec::new(),
            },
            rx: LinkReceiver {
                ring: ends.from_scheduler,
            },
        })
    }

    /// Splits into the shared part and the two halves: a sender used by many threads (behind
    /// a lock) and a receiver owned by one reader thread.
    pub fn split(self) -> (std::sync::Arc<LinkShared>, LinkSender, LinkReceiver) {
        (self.shared, self.tx, self.rx)
    }

    /// The limits the scheduler enforces.
    pub fn limits(&self) -> PlaneLimits {
        self.shared.limits
    }

    /// This frontend's ring-pair index.
    pub fn index(&self) -> usize {
        self.shared.index()
    }

    /// Pushes an admission; see [`LinkSender::submit`].
    ///
    /// # Errors
    /// [`LinkError::Full`] when the ring stays full.
    pub fn submit(&mut self, a: &Admission<'_>, timeout: Duration) -> Result<(), LinkError> {
        self.tx.submit(a, timeout)
    }

    /// Pushes a cancel; see [`LinkSender::cancel`].
    ///
    /// # Errors
    /// [`LinkError::Full`] when the ring stays full.
    pub fn cancel(&mut self, req: u64, timeout: Duration) -> Result<(), LinkError> {
        self.tx.cancel(req, timeout)
    }

    /// Pops one output, waiting up to `timeout`; records a heartbeat.
    pub fn poll(&mut self, timeout: Duration) -> Option<ToFrontend> {
        self.shared.heartbeat();
        self.rx.poll(timeout)
    }

    /// Pops up to `max` outputs without waiting.
    pub fn poll_batch(&mut self, out: &mut Vec<ToFrontend>, max: usize) -> usize {
        self.rx.poll_batch(out, max)
    }

    /// See [`LinkShared::health`].
    ///
    /// # Errors
    /// Why requests cannot be served now.
    pub fn health(&self) -> Result<(), String> {
        self.shared.health()
    }

    /// See [`LinkShared::stats`].
    pub fn stats(&self) -> PlaneStats {
        self.shared.stats()
    }
}

impl LinkSender {
    /// Pushes an admission (one `ADMIT` slot and its token slots), waiting up to `timeout` for
    /// ring space.
    ///
    /// # Errors
    /// [`LinkError::Full`] when the ring stays full.
    pub fn submit(&mut self, a: &Admission<'_>, timeout: Duration) -> Result<(), LinkError> {
        let mut slots = std::mem::take(&mut self.scratch);
        Self::encode_admission(a, &mut slots);
        self.scratch = slots;
        self.push_all(timeout)
    }

    /// The slots of admission `a`, appended to `out` (after clearing it): one `ADMIT` head,
    /// then `TOKENS` slots of the prompt, stop and EOS ids, logit bias, constraint and bad
    /// words. What [`LinkSender::submit`] pushes; [`LinkSender::push_slots`] pushes them later,
    /// from another thread.
    pub fn encode_admission(a: &Admission<'_>, out: &mut Vec<ToScheduler>) {
        out.clear();
        let mut head = ToScheduler::zeroed();
        head.kind = to_scheduler::ADMIT;
        head.req = a.req;
        head.n = (a.stop_token_ids.len() + a.eos_ids.len()) as u32;
        head.eos_len = a.eos_ids.len() as u32;
        head.prompt_len = a.prompt.len() as u32;
        head.max_tokens = a.max_tokens;
        head.flags = if a.ignore_eos {
            wire::FLAG_IGNORE_EOS
        } else {
            0
        };
        if let Some(t) = a.guide_after {
            head.flags |= wire::FLAG_GUIDE_AFTER;
            head.guide_after = t;
        }
        head.params = a.params;
        head.params.logit_bias_len = a.logit_bias.len() as u32;
        head.min_tokens = a.min_tokens;
        head.cache_salt = a.cache_salt;
        head.lora = a.lora;
        head.priority = a.priority;
        head.constraint_len = a.constraint.len() as u32;
        let bad_words = wire::pack_bad_words(a.bad_words);
        head.bad_words_len = bad_words.len() as u32;
        out.push(head);
        let constraint = wire::pack_bytes(a.constraint);
        let bias: Vec<u32> = a
            .logit_bias
            .iter()
            .flat_map(|&(t, b)| [t, b.to_bits()])
            .collect();
        for chunk in a
            .prompt
            .chunks(TOKENS_PER_SLOT)
            .chain(a.stop_token_ids.chunks(TOKENS_PER_SLOT))
            .chain(a.eos_ids.chunks(TOKENS_PER_SLOT))
            .chain(bias.chunks(TOKENS_PER_SLOT))
            .chain(constraint.chunks(TOKENS_PER_SLOT))
            .chain(bad_words.chunks(TOKENS_PER_SLOT))
        {
            let mut m = ToScheduler::zeroed();
            m.kind = to_scheduler::TOKENS;
            m.req = a.req;
            m.n = chunk.len() as u32;
            m.tokens[..chunk.len()].copy_from_slice(chunk);
            out.push(m);
        }
    }

    /// Pushes a cancel for `req`.
    ///
    /// # Errors
    /// [`LinkError::Full`] when the ring stays full.
    pub fn cancel(&mut self, req: u64, timeout: Duration) -> Result<(), LinkError> {
        self.scratch.clear();
        self.scratch.push(Self::cancel_slot(req));
        self.push_all(timeout)
    }

    /// The one slot of a cancel of `req`, for [`LinkSender::push_slots`].
    pub fn cancel_slot(req: u64) -> ToScheduler {
        let mut m = ToScheduler::zeroed();
        m.kind = to_scheduler::CANCEL;
        m.req = req;
        m
    }

    fn push_all(&mut self, timeout: Duration) -> Result<(), LinkError> {
        let slots = std::mem::take(&mut self.scratch);
        let r = self.push_slots(&slots, timeout);
        self.scratch = slots;
        r
    }

    /// Pushes as many of `slots` as the ring has room for now, in order; returns how many.
    pub fn try_push_slots(&mut self, slots: &[ToScheduler]) -> usize {
        self.ring.push_batch(slots)
    }

    /// Pushes encoded slots ([`LinkSender::encode_admission`]) in order, waiting up to
    /// `timeout` for ring space (`Duration::ZERO`: pushes what fits now).
    ///
    /// # Errors
    /// [`LinkError::Full`] when the ring stays full: with nothing pushed when it was full from
    /// the start, else with a torn admission, which the scheduler drops when the next `ADMIT`
    /// arrives.
    pub fn push_slots(
        &mut self,
        slots: &[ToScheduler],
        timeout: Duration,
    ) -> Result<(), LinkError> {
        let deadline = std::time::Instant::now() + timeout;
        let mut sent = 0;
        while sent < slots.len() {
            sent += self.ring.push_batch(&slots[sent..]);
            if sent < slots.len() {
                if std::time::Instant::now() >= deadline {
                    // A partial admission would tear the ring: it is only safe because the
                    // scheduler drops a torn admission when the next ADMIT arrives.
                    return Err(LinkError::Full);
                }
                std::thread::sleep(Duration::from_micros(100));
            }
        }
        Ok(())
    }
}

impl LinkReceiver {
    /// Pops one output, waiting up to `timeout` (spin, yield, then futex sleep).
    pub fn poll(&mut self, timeout: Duration) -> Option<ToFrontend> {
        self.ring.wait_pop(timeout)
    }

    /// Pops up to `max` outputs without waiting.
    pub fn poll_batch(&mut self, out: &mut Vec<ToFrontend>, max: usize) -> usize {
        self.ring.pop_batch(out, max)
    }
}

impl LinkShared {
    /// The limits the scheduler enforces.
    pub fn limits(&self) -> PlaneLimits {
        self.limits
    }

    /// This frontend's ring-pair index.
    pub fn index(&self) -> usize {
        self.limits
            .control_spec()
            .frontend_index(self.me.slot())
            .unwrap_or(0)
    }

    /// Records a heartbeat for this frontend.
    pub fn heartbeat(&self) {
        self.me.heartbeat();
    }

    /// Whether the scheduler that created this segment is alive (kernel evidence, see
    /// `Segment::creator_alive`). Once false it stays false: a restarted scheduler makes a
    /// new segment, and this link must be rebuilt (or its process restarted).
    pub fn scheduler_alive(&self) -> bool {
        self.segment.creator_alive()
    }

    /// `Ok` when the scheduler is alive and a worker is attached; otherwise why not.
    pub fn health(&self) -> Result<(), String> {
        let status = self.segment.status().load(Ordering::Acquire);
        if status & plane::STATUS_SHUTTING_DOWN != 0 {
            return Err("the scheduler is shutting down".into());
        }
        let sched = self.participants.info(0);
        let alive = sched
            .is_some_and(|s| s.state == SlotState::Live && process::is_alive(s.pid, s.start_time));
        if !alive {
            return Err("the scheduler is not running".into());
        }
        if status & plane::STATUS_WORKER_ATTACHED == 0 {
            return Err("no worker is attached".into());
        }
        Ok(())
    }

    /// How long ago the scheduler last turned its step loop: now minus its heartbeat stat
    /// (`CLOCK_MONOTONIC` milliseconds, which every process of the machine shares). A live
    /// scheduler turns at least every 20 ms, idle or not; a long silence means it is stopped
    /// or hung. `None` before its first publication.
    pub fn scheduler_silent_for(&self) -> Option<Duration> {
        let beat = self.stats[plane::STAT_HEARTBEAT_MS].load(Ordering::Relaxed);
        (beat != 0).then(|| Duration::from_millis(process::monotonic_ms().saturating_sub(beat)))
    }

    /// Scheduler statistics.
    pub fn stats(&self) -> PlaneStats {
        let g = |i: usize| self.stats[i].load(Ordering::Relaxed);
        PlaneStats {
            running: g(plane::STAT_RUNNING),
            waiting: g(plane::STAT_WAITING),
            pages_used: g(plane::STAT_PAGES_USED),
            pages_retired: g(plane::STAT_PAGES_RETIRED),
            pages_total: g(plane::STAT_PAGES_TOTAL),
            launches: g(plane::STAT_LAUNCHES),
            preemptions: g(plane::STAT_PREEMPTIONS),
            prefix_cache_queries: g(plane::STAT_PREFIX_QUERIES),
            prefix_cache_hits: g(plane::STAT_PREFIX_HITS),
        }
    }
}
