//! [`LocalEngineClient`]: the scheduler and a worker backend on a dedicated thread in this
//! process (tests, `baton serve --in-process`).
//!
//! Contract: the same loop as the in-process engine of `baton generate`: drain commands, publish
//! launches up to the in-flight limit, execute the oldest through its fence, accept its
//! completion, report it released, route events to the requests' receivers. When nothing is
//! live the thread blocks on its command channel (no busy spin). A cancelled request's
//! acknowledgement (`Finished { reason: Cancelled }`) is routed like any other event. A request
//! whose receiver was dropped is cancelled by the thread itself.

use crate::engine::{
    EngineClient, EngineEvent, EngineLimits, EngineRequest, EngineStats, SubmitError,
};
use baton_proto::Launch;
use baton_scheduler::{
    check_admission, Event, FinishReason, NewRequest, PhaseClock, Scheduler, SchedulerConfig,
    SchedulerStats,
};
use baton_worker::Backend;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

enum Command {
    Submit {
        req: Box<NewRequest>,
        tx: UnboundedSender<EngineEvent>,
    },
    Cancel(u64),
    Shutdown,
}

struct Shared {
    stats: SchedulerStats,
    /// `Some(reason)` once the engine thread has stopped.
    dead: Option<String>,
}

/// The in-process engine behind the [`EngineClient`] trait.
pub struct LocalEngineClient {
    cmd: Mutex<mpsc::Sender<Command>>,
    shared: Arc<Mutex<Shared>>,
    next_id: AtomicU64,
    cfg: SchedulerConfig,
    vocab_size: usize,
    eos_ids: Vec<u32>,
}

impl std::fmt::Debug for LocalEngineClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalEngineClient")
            .field("cfg", &self.cfg)
            .field("vocab_size", &self.vocab_size)
            .finish()
    }
}

impl LocalEngineClient {
    /// Starts the engine thread over `backend`, whose KV pool must cover `cfg.num_blocks` pages
    /// of `cfg.block_size`. `eos_ids` end generation unless a request sets `ignore_eos`.
    ///
    /// # Errors
    /// The backend's pool does not cover the configuration, or the thread cannot start.
    pub fn start(
        cfg: SchedulerConfig,
        backend: Box<dyn Backend>,
        eos_ids: Vec<u32>,
    ) -> anyhow::Result<Self> {
        let cap = backend.kv_capacity();
        if cap.num_blocks < cfg.num_blocks || cap.block_size != cfg.block_size {
            anyhow::bail!(
                "backend KV pool {cap:?} does not cover the scheduler's {} pages of {}",
                cfg.num_blocks,
                cfg.block_size
            );
        }
        let vocab_size = backend.vocab_size();
        let (tx, rx) = mpsc::channel();
        let sched = Scheduler::new_local(cfg.clone(), vocab_size);
        let shared = Arc::new(Mutex::new(Shared {
            stats: sched.stats(),
            dead: None,
        }));
        let thread_shared = Arc::clone(&shared);
        std::thread::Builder::new()
            .name("baton-engine".into())
            // Structured outputs' masks are computed on this thread (see the constant).
            .stack_size(baton_grammar::GRAMMAR_STACK_BYTES)
            .spawn(move || {
                let reason = match engine_loop(sched, backend, rx, &thread_shared) {
                    Ok(()) => "the engine has shut down".to_owned(),
                    Err(e) => e,
                };
                lock(&thread_shared).dead = Some(reason);
            })?;
        Ok(Self {
            cmd: Mutex::new(tx),
            shared,
            next_id: AtomicU64::new(1),
            cfg,
            vocab_size,
            eos_ids,
        })
    }

    /// Scheduler counts as of the end of the engine thread's last step (page pool included).
    pub fn scheduler_stats(&self) -> SchedulerStats {
        lock(&self.shared).stats
    }

    /// The scheduler configuration.
    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    fn send(&self, c: Command) -> Result<(), SubmitError> {
        lock(&self.cmd).send(c).map_err(|_| {
            SubmitError::Unavailable(
                lock(&self.shared)
                    .dead
                    .clone()
                    .unwrap_or_else(|| "the engine thread is gone".into()),
            )
        })
    }
}

impl Drop for LocalEngineClient {
    fn drop(&mut self) {
        let _ = lock(&self.cmd).send(Command::Shutdown);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl EngineClient for LocalEngineClient {
    fn submit(
        &self,
        req: EngineRequest,
    ) -> Result<(u64, UnboundedReceiver<EngineEvent>), SubmitError> {
        if let Some(reason) = lock(&self.shared).dead.clone() {
            return Err(SubmitError::Unavailable(reason));
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let new = NewRequest {
            priority: req.priority,
            id,
            prompt: req.prompt,
            max_tokens: req.max_tokens,
            params: req.params,
            eos_ids: self.eos_ids.clone(),
            stop_token_ids: req.stop_token_ids,
            ignore_eos: req.ignore_eos,
            logit_bias: req.logit_bias,
            min_tokens: req.min_tokens,
            cache_salt: req.cache_salt,
            guide: req.guided.map(|g| g.guide),
            bad_words: req.bad_words,
            lora: req.lora,
        };
        check_admission(&self.cfg, self.vocab_size, &new)
            .map_err(|e| SubmitError::Rejected(e.to_string()))?;
        let (tx, rx) = unbounded_channel();
        self.send(Command::Submit {
            req: Box::new(new),
            tx,
        })?;
        Ok((id, rx))
    }

    fn cancel(&self, id: u64) {
        let _ = self.send(Command::Cancel(id));
    }

    fn limits(&self) -> EngineLimits {
        EngineLimits {
            max_model_len: self.cfg.max_model_len,
            vocab_size: self.vocab_size,
            max_num_seqs: self.cfg.max_num_seqs,
            priority_scheduling: self.cfg.policy == baton_scheduler::SchedulingPolicy::Priority,
        }
    }

    fn health(&self) -> Result<(), String> {
        match &lock(&self.shared).dead {
            Some(reason) => Err(reason.clone()),
            None => Ok(()),
        }
    }

    fn stats(&self) -> EngineStats {
        let s = lock(&self.shared).stats;
        EngineStats {
            running: s.running,
            waiting: s.waiting,
            kv_usage: if s.pool.total == 0 {
                0.0
            } else {
                1.0 - s.pool.free as f64 / s.pool.total as f64
            },
            preemptions: s.preemptions,
            prefix_cache_queries: s.prefix_cache_queries,
            prefix_cache_hits: s.prefix_cache_hits,
        }
    }
}

/// Per-request senders and phase clocks, by request id.
struct Router {
    senders: HashMap<u64, (UnboundedSender<EngineEvent>, PhaseClock)>,
}

impl Router {
    /// `ids` took their first launch now.
    fn started(&mut self, ids: &[u64]) {
        if ids.is_empty() {
            return;
        }
        let now = Instant::now();
        for id in ids {
            if let Some((_, clock)) = self.senders.get_mut(id) {
                clock.scheduled(now);
            }
        }
    }

    /// Routes `events`; returns ids whose receiver is gone while the request is live.
    fn route(&mut self, events: &mut Vec<Event>, orphans: &mut Vec<u64>) {
        for e in events.drain(..) {
            match e {
                Event::Token {
                    id,
                    token,
                    cached_tokens,
                    logprob,
                    top,
                } => {
                    if let Some((tx, clock)) = self.senders.get_mut(&id) {
                        let first = clock.token(Instant::now());
                        if tx
                            .send(EngineEvent::Token {
                                token,
                                cached_tokens,
                                logprob,
                                top,
                                first,
                            })
                            .is_err()
                        {
                            orphans.push(id);
                        }
                    }
                }
                Event::PromptLogprob {
                    id,
                    pos,
                    token,
                    logprob,
                    rank,
                    top,
                } => {
                    if let Some((tx, _)) = self.senders.get(&id) {
                        let ev = EngineEvent::PromptLogprob {
                            pos,
                            token,
                            logprob,
                            rank,
                            top,
                        };
                        if tx.send(ev).is_err() {
                            orphans.push(id);
                        }
                    }
                }
                Event::Finished {
                    id,
                    reason,
                    prompt_tokens,
                    output_tokens,
                    cached_tokens,
                } => {
                    if let Some((tx, _)) = self.senders.remove(&id) {
                        let _ = tx.send(EngineEvent::Finished {
                            reason,
                            prompt_tokens,
                            output_tokens,
                            cached_tokens,
                        });
                    }
                }
            }
        }
    }

    fn fail_all(&mut self, msg: &str) {
        for (_, (tx, _)) in self.senders.drain() {
            let _ = tx.send(EngineEvent::Error(msg.to_owned()));
        }
    }
}

fn handle(c: Command, sched: &mut Scheduler, router: &mut Router, events: &mut Vec<Event>) -> bool {
    match c {
        Command::Submit { req, tx } => {
            let id = req.id;
            match sched.add_request(*req) {
                Ok(()) => {
                    router
                        .senders
                        .insert(id, (tx, PhaseClock::new(Instant::now())));
                }
                Err(e) => {
                    let _ = tx.send(EngineEvent::Error(e.to_string()));
                }
            }
        }
        Command::Cancel(id) => sched.cancel(id, events),
        Command::Shutdown => return false,
    }
    true
}

fn engine_loop(
    mut sched: Scheduler,
    mut backend: Box<dyn Backend>,
    rx: mpsc::Receiver<Command>,
    shared: &Mutex<Shared>,
) -> Result<(), String> {
    let mut router = Router {
        senders: HashMap::new(),
    };
    let mut published: VecDeque<Launch> = VecDeque::new();
    let mut events = Vec::new();
    let mut orphans = Vec::new();
    loop {
        let idle = sched.is_idle() && published.is_empty();
        if idle {
            // Nothing live: block until a command arrives.
            match rx.recv() {
                Ok(c) => {
                    if !handle(c, &mut sched, &mut router, &mut events) {
                        break;
                    }
                }
                Err(_) => break,
            }
        }
        let mut stop = false;
        while let Ok(c) = rx.try_recv() {
            if !handle(c, &mut sched, &mut router, &mut events) {
                stop = true;
                break;
            }
        }
        if stop {
            break;
        }
        while let Some(l) = sched.schedule() {
            router.started(sched.started());
            published.push_back(l);
        }
        if let Some(launch) = published.pop_front() {
            match backend.execute(&launch, sched.tables().as_ref()) {
                Ok(c) => {
                    sched.on_completion(&c, &mut events);
                    sched.on_released(launch.seq);
                }
                Err(e) => {
                    let msg = format!("the worker failed: {e}");
                    router.route(&mut events, &mut orphans);
                    router.fail_all(&msg);
                    lock(shared).stats = sched.stats();
                    return Err(msg);
                }
            }
        } else if !sched.is_idle() && sched.stats().inflight == 0 {
            // Live requests, nothing publishable and nothing in flight: admission refuses
            // requests that can never fit, so this cannot happen; fail them rather than spin.
            let mut ev = Vec::new();
            sched.abort_all(FinishReason::Abort, &mut ev);
            events.extend(ev);
        }
        router.route(&mut events, &mut orphans);
        for id in orphans.drain(..) {
            sched.cancel(id, &mut events);
        }
        router.route(&mut events, &mut orphans);
        orphans.clear();
        lock(shared).stats = sched.stats();
    }
    let mut ev = Vec::new();
    sched.abort_all(FinishReason::Abort, &mut ev);
    router.route(&mut ev, &mut orphans);
    router.fail_all("the engine has shut down");
    lock(shared).stats = sched.stats();
    Ok(())
}
