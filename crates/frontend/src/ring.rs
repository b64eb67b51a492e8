//! [`RingEngineClient`]: the engine behind the shared-memory control plane (`baton frontend`).
//!
//! Contract: one reader thread owns the receiving half of this frontend's ring pair and routes
//! every output to its request's receiver; one sender thread owns the sending half and pushes
//! the admissions and cancels that `submit` and `cancel` queue for it, in order. Neither call
//! waits for ring space, so a full admission ring (a stalled scheduler) never blocks the HTTP
//! runtime's threads: an admission that finds no room within [`ADMIT_TIMEOUT`] of its submit
//! ends with an "engine unavailable" error (HTTP 503). A request's route lives until its
//! final event (`FINISHED`, including the acknowledgement of a cancel, or `ERROR`), so the
//! frontend keeps its state until the scheduler acknowledges. If the scheduler dies, every
//! live request gets an error event at once and the stream ends. If no worker is attached for
//! longer than the worker timeout, every live request is cancelled at the scheduler and ends
//! with an "engine unavailable" error (HTTP 503), and new requests get a 503 until a worker
//! attaches again; nothing waits forever.

use crate::engine::{
    EngineClient, EngineEvent, EngineLimits, EngineRequest, EngineStats, SubmitError,
    UNAVAILABLE_PREFIX,
};
use baton_proto::link::{Admission, FrontendLink, LinkReceiver, LinkSender, LinkShared};
use baton_proto::wire::{self, reason, to_frontend, ToFrontend, ToScheduler};
use baton_scheduler::FinishReason;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

type Routes = Arc<Mutex<HashMap<u64, UnboundedSender<EngineEvent>>>>;

/// How long an admission may wait for room in the admission ring, from its submit, before it
/// fails with an "engine unavailable" error (HTTP 503).
pub const ADMIT_TIMEOUT: Duration = Duration::from_secs(5);

/// A scheduler whose step loop has not turned for this long makes `/health` answer 503.
pub const SCHEDULER_STALL: Duration = Duration::from_secs(5);

/// What the sender thread pushes, in submit order.
enum Outgoing {
    /// An encoded admission of request `id`, submitted at `at`.
    Admit {
        id: u64,
        slots: Vec<ToScheduler>,
        at: Instant,
    },
    /// A cancel of request `id`.
    Cancel(u64),
}

/// The engine as seen through this frontend's ring pair.
pub struct RingEngineClient {
    shared: Arc<LinkShared>,
    /// The sender thread's queue.
    out: std::sync::mpsc::Sender<Outgoing>,
    routes: Routes,
    next_id: AtomicU64,
    eos_ids: Vec<u32>,
    vocab_size: usize,
    stop: Arc<AtomicBool>,
    dead: Arc<Mutex<Option<String>>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl RingEngineClient {
    /// Wraps a connected link. `eos_ids` are the model's EOS ids (sent after each request's
    /// stop ids; they end nothing under `ignore_eos`); `vocab_size` is the tokenizer's. `worker_timeout`: how long
    /// requests may wait while no worker is attached before they fail with 503 (`None`:
    /// forever).
    pub fn new(
        link: FrontendLink,
        eos_ids: Vec<u32>,
        vocab_size: usize,
        worker_timeout: Option<Duration>,
    ) -> Self {
        let (shared, tx, rx) = link.split();
        let (out, queue) = std::sync::mpsc::channel();
        let routes: Routes = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let dead = Arc::new(Mutex::new(None));
        {
            let routes = routes.clone();
            let stop = stop.clone();
            std::thread::Builder::new()
                .name("baton-ring-sender".into())
                .spawn(move || sender(tx, &queue, &routes, &stop))
                .expect("spawning the ring sender thread");
        }
        {
            let ctx = ReaderCtx {
                shared: shared.clone(),
                out: out.clone(),
                routes: routes.clone(),
                stop: stop.clone(),
                dead: dead.clone(),
                worker_timeout,
            };
            std::thread::Builder::new()
                .name("baton-ring-reader".into())
                .spawn(move || reader(rx, &ctx))
                .expect("spawning the ring reader thread");
        }
        Self {
            shared,
            out,
            routes,
            next_id: AtomicU64::new(1),
            eos_ids,
            vocab_size,
            stop,
            dead,
        }
    }

    /// Whether the scheduler this client is attached to has exited. It never comes back to
    /// this segment (a restarted scheduler makes a new one), so `baton frontend` exits on it.
    pub fn scheduler_exited(&self) -> bool {
        !self.shared.scheduler_alive()
    }

    /// This frontend's ring-pair index.
    pub fn index(&self) -> usize {
        self.shared.index()
    }
}

impl Drop for RingEngineClient {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Pushes what `queue` brings into the admission ring, in order, until `stop` or until every
/// sender of the queue is gone. Waiting for ring space happens here only, and never holds up
/// a deadline: while the front item waits for room, every admission behind it that has not
/// started by [`ADMIT_TIMEOUT`] after its submit is failed on its route (503), and a cancel of
/// an admission still queued takes both out (acknowledged here as the scheduler would).
/// Cancels are never dropped: they go out in order once there is room.
fn sender(
    mut tx: LinkSender,
    queue: &std::sync::mpsc::Receiver<Outgoing>,
    routes: &Mutex<HashMap<u64, UnboundedSender<EngineEvent>>>,
    stop: &AtomicBool,
) {
    let mut pending: VecDeque<Outgoing> = VecDeque::new();
    // Slots of the front admission already in the ring (it must go on from there: an
    // admission is contiguous in the ring).
    let mut sent = 0usize;
    while !stop.load(Ordering::Relaxed) {
        if pending.is_empty() {
            match queue.recv_timeout(Duration::from_millis(50)) {
                Ok(item) => take(item, &mut pending, sent, routes),
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => continue,
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return,
            }
        }
        while let Ok(item) = queue.try_recv() {
            take(item, &mut pending, sent, routes);
        }
        let blocked = loop {
            let Some(front) = pending.front() else {
                break false;
            };
            match front {
                Outgoing::Admit { id, slots, at } => {
                    if sent == 0 && !lock(routes).contains_key(id) {
                        // Failed before it went out (scheduler gone, no worker): nothing to do.
                        pending.pop_front();
                        continue;
                    }
                    if at.elapsed() >= ADMIT_TIMEOUT {
                        // A part already pushed is a torn admission, which the scheduler drops
                        // when the next ADMIT arrives.
                        fail_admission(*id, routes);
                        pending.pop_front();
                        sent = 0;
                        continue;
                    }
                    sent += tx.try_push_slots(&slots[sent..]);
                    if sent < slots.len() {
                        break true;
                    }
                    pending.pop_front();
                    sent = 0;
                }
                Outgoing::Cancel(id) => {
                    if tx.try_push_slots(&[LinkSender::cancel_slot(*id)]) == 0 {
                        break true;
                    }
                    pending.pop_front();
                }
            }
        };
        if blocked {
            // The ring is full: admissions further back that ran out of time fail now.
            let front_started = sent > 0;
            let mut i = usize::from(front_started);
            while i < pending.len() {
                match &pending[i] {
                    Outgoing::Admit { id, at, .. } if at.elapsed() >= ADMIT_TIMEOUT => {
                        fail_admission(*id, routes);
                        pending.remove(i);
                    }
                    _ => i += 1,
                }
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

/// Queues `item` for the sender thread. A cancel of an admission that has not started going
/// out removes it instead: the scheduler never hears of the request, and its route gets the
/// acknowledgement the scheduler would have sent.
fn take(
    item: Outgoing,
    pending: &mut VecDeque<Outgoing>,
    sent: usize,
    routes: &Mutex<HashMap<u64, UnboundedSender<EngineEvent>>>,
) {
    if let Outgoing::Cancel(id) = item {
        let queued = pending
            .iter()
            .position(|o| matches!(o, Outgoing::Admit { id: a, .. } if *a == id));
        if let Some(pos) = queued.filter(|&p| p > 0 || sent == 0) {
            pending.remove(pos);
            if let Some(events) = lock(routes).remove(&id) {
                let _ = events.send(EngineEvent::Finished {
                    reason: FinishReason::Cancelled,
                    prompt_tokens: 0,
                    output_tokens: 0,
                    cached_tokens: 0,
                });
            }
            return;
        }
    }
    pending.push_back(item);
}

/// Ends request `id`, whose admission found no room in the ring in time, with a 503.
fn fail_admission(id: u64, routes: &Mutex<HashMap<u64, UnboundedSender<EngineEvent>>>) {
    tracing::warn!(
        id,
        "admission not delivered: the admission ring stayed full"
    );
    if let Some(events) = lock(routes).remove(&id) {
        let _ = events.send(EngineEvent::Error(format!(
            "{UNAVAILABLE_PREFIX}the scheduler is not accepting requests (its admission ring \
             stayed full for {} s)",
            ADMIT_TIMEOUT.as_secs()
        )));
    }
}

/// What the reader thread shares with the client.
struct ReaderCtx {
    shared: Arc<LinkShared>,
    /// The sender thread's queue (cancels of requests failed here).
    out: std::sync::mpsc::Sender<Outgoing>,
    routes: Routes,
    stop: Arc<AtomicBool>,
    /// Why new requests are refused (503), if they are.
    dead: Arc<Mutex<Option<String>>>,
    worker_timeout: Option<Duration>,
}

fn reader(mut rx: LinkReceiver, c: &ReaderCtx) {
    let mut batch: Vec<ToFrontend> = Vec::with_capacity(1024);
    let mut last_check = Instant::now();
    let mut no_worker_since: Option<Instant> = None;
    while !c.stop.load(Ordering::Relaxed) {
        batch.clear();
        if rx.poll_batch(&mut batch, 1024) == 0 {
            if let Some(m) = rx.poll(Duration::from_millis(50)) {
                batch.push(m);
            }
        }
        if !batch.is_empty() {
            let mut r = lock(&c.routes);
            for m in &batch {
                route(&mut r, m);
            }
        }
        if last_check.elapsed() >= Duration::from_millis(50) {
            last_check = Instant::now();
            c.shared.heartbeat();
            check_health(c, &mut no_worker_since);
        }
    }
}

/// Fails every live request when the scheduler is gone, or when no worker has been attached
/// for longer than the worker timeout (cancelling them at the scheduler, which is alive); sets
/// or clears the reason new requests are refused.
fn check_health(c: &ReaderCtx, no_worker_since: &mut Option<Instant>) {
    let why = match c.shared.health() {
        Ok(()) => {
            *no_worker_since = None;
            *lock(&c.dead) = None;
            return;
        }
        Err(why) => why,
    };
    if why.contains("scheduler") {
        // The scheduler is gone: fail everything now, as unavailable (503): this instance
        // will not serve again (a restarted scheduler makes a new segment), so a client or
        // load balancer should retry elsewhere or after a supervisor restarted it.
        *lock(&c.dead) = Some(why.clone());
        for (_, tx) in lock(&c.routes).drain() {
            let _ = tx.send(EngineEvent::Error(format!("{UNAVAILABLE_PREFIX}{why}")));
        }
        return;
    }
    // No worker attached.
    let since = *no_worker_since.get_or_insert_with(Instant::now);
    let Some(limit) = c.worker_timeout else {
        return;
    };
    if since.elapsed() < limit {
        *lock(&c.dead) = None;
        return;
    }
    let msg = format!(
        "{why} (for {:.0} s; the worker timeout is {:.0} s)",
        since.elapsed().as_secs_f64(),
        limit.as_secs_f64()
    );
    *lock(&c.dead) = Some(msg.clone());
    let failed: Vec<(u64, UnboundedSender<EngineEvent>)> = lock(&c.routes).drain().collect();
    if failed.is_empty() {
        return;
    }
    tracing::warn!(requests = failed.len(), "{msg}: failing the live requests");
    for (id, events) in failed {
        // The scheduler drops the request (its acknowledgement finds no route and is ignored),
        // so nothing of it runs when a worker attaches later.
        let _ = c.out.send(Outgoing::Cancel(id));
        let _ = events.send(EngineEvent::Error(format!("{UNAVAILABLE_PREFIX}{msg}")));
    }
}

fn route(routes: &mut HashMap<u64, UnboundedSender<EngineEvent>>, m: &ToFrontend) {
    match m.kind {
        to_frontend::TOKEN => {
            if let Some(tx) = routes.get(&m.req) {
                let n = (m.n_top as usize).min(baton_proto::MAX_TOP_LOGPROBS);
                let top = (0..n).map(|i| (m.top_ids[i], m.top_logprobs[i])).collect();
                let _ = tx.send(EngineEvent::Token {
                    token: m.token,
                    cached_tokens: m.detail as usize,
                    logprob: m.logprob,
                    top,
                    first: wire::decode_first(m.first),
                });
            }
        }
        to_frontend::PROMPT_LOGPROB => {
            if let Some(tx) = routes.get(&m.req) {
                let n = (m.n_top as usize).min(baton_proto::MAX_TOP_LOGPROBS);
                let top = (0..n).map(|i| (m.top_ids[i], m.top_logprobs[i])).collect();
                let _ = tx.send(EngineEvent::PromptLogprob {
                    pos: m.detail,
                    token: m.token,
                    logprob: m.logprob,
                    rank: m.output_tokens,
                    top,
                });
            }
        }
        to_frontend::FINISHED => {
            if let Some(tx) = routes.remove(&m.req) {
                let reason = match m.reason {
                    reason::STOP => FinishReason::Stop,
                    reason::LENGTH => FinishReason::Length,
                    reason::CANCELLED => FinishReason::Cancelled,
                    _ => FinishReason::Abort,
                };
                let _ = tx.send(EngineEvent::Finished {
                    reason,
                    prompt_tokens: m.prompt_tokens as usize,
                    output_tokens: m.output_tokens as usize,
                    cached_tokens: m.detail as usize,
                });
            }
        }
        to_frontend::ERROR => {
            if let Some(tx) = routes.remove(&m.req) {
                let msg = match m.reason {
                    wire::error::INVALID => {
                        "the scheduler refused the request (it can never fit its limits)"
                    }
                    wire::error::NO_GRAMMAR_VOCABULARY => {
                        "structured outputs are unavailable: the scheduler was started without a \
                         tokenizer.json (give it --tokenizer, or a --model directory holding one)"
                    }
                    wire::error::SHUTDOWN => {
                        let _ = tx.send(EngineEvent::Error(format!(
                            "{UNAVAILABLE_PREFIX}the scheduler is shutting down"
                        )));
                        return;
                    }
                    _ => "protocol error between frontend and scheduler",
                };
                let _ = tx.send(EngineEvent::Error(msg.into()));
            }
        }
        k => tracing::error!(kind = k, "unknown output slot from the scheduler"),
    }
}

impl EngineClient for RingEngineClient {
    fn submit(
        &self,
        req: EngineRequest,
    ) -> Result<(u64, UnboundedReceiver<EngineEvent>), SubmitError> {
        if let Some(why) = lock(&self.dead).clone() {
            // The reader clears the reason at its next health check; a worker that attached
            // since then must not see this request refused.
            if self.shared.health().is_err() {
                return Err(SubmitError::Unavailable(why));
            }
        }
        // The scheduler's stateless checks, here, so a request that can never run is a 400
        // naming the limit rather than an error after admission.
        let l = self.shared.limits();
        let cfg = baton_scheduler::SchedulerConfig {
            max_num_seqs: l.max_num_seqs,
            max_num_batched_tokens: l.max_num_batched_tokens,
            block_size: l.block_size,
            num_blocks: l.num_blocks,
            max_model_len: l.max_model_len,
            max_inflight: l.max_inflight,
            // Admission sizes a windowed request by it (`request_pages`).
            enable_prefix_caching: l.prefix_caching,
            policy: if l.priority_scheduling {
                baton_scheduler::SchedulingPolicy::Priority
            } else {
                baton_scheduler::SchedulingPolicy::Fcfs
            },
            kv_window: (l.kv_window != 0).then_some(l.kv_window as usize),
        };
        // The EOS ids travel after the stop ids: they end the request unless `ignore_eos`,
        // and min_tokens holds them back either way.
        let eos_ids: Vec<u32> = self
            .eos_ids
            .iter()
            .copied()
            .filter(|e| !req.stop_token_ids.contains(e))
            .collect();
        let probe = baton_scheduler::NewRequest {
            priority: req.priority,
            id: 0,
            prompt: req.prompt.clone(),
            max_tokens: req.max_tokens,
            params: req.params,
            eos_ids: eos_ids.clone(),
            stop_token_ids: req.stop_token_ids.clone(),
            ignore_eos: req.ignore_eos,
            logit_bias: req.logit_bias.clone(),
            min_tokens: req.min_tokens,
            cache_salt: req.cache_salt,
            // The scheduler daemon compiles its own guide from the wire form, and validation
            // already refused the combinations `check_admission` would (no copy needed here).
            guide: None,
            bad_words: req.bad_words.clone(),
            lora: req.lora,
        };
        baton_scheduler::check_admission(&cfg, self.limits().vocab_size, &probe)
            .map_err(|e| SubmitError::Rejected(e.to_string()))?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = unbounded_channel();
        lock(&self.routes).insert(id, tx);
        let constraint = req
            .guided
            .as_ref()
            .map(|g| g.constraint.to_wire())
            .unwrap_or_default();
        let a = Admission {
            req: id,
            prompt: &req.prompt,
            stop_token_ids: &req.stop_token_ids,
            eos_ids: &eos_ids,
            max_tokens: req.max_tokens,
            params: req.params,
            ignore_eos: req.ignore_eos,
            logit_bias: &req.logit_bias,
            min_tokens: req.min_tokens,
            cache_salt: req.cache_salt,
            constraint: &constraint,
            guide_after: req.guided.as_ref().and_then(|g| g.after),
            priority: req.priority,
            bad_words: &req.bad_words,
            lora: req.lora,
        };
        let mut slots = Vec::new();
        LinkSender::encode_admission(&a, &mut slots);
        let queued = self.out.send(Outgoing::Admit {
            id,
            slots,
            at: Instant::now(),
        });
        if queued.is_err() {
            lock(&self.routes).remove(&id);
            return Err(SubmitError::Unavailable(
                "the frontend's ring sender has stopped".into(),
            ));
        }
        Ok((id, rx))
    }

    fn cancel(&self, id: u64) {
        if !lock(&self.routes).contains_key(&id) {
            return;
        }
        // Queued behind the admission, so the scheduler sees them in order.
        let _ = self.out.send(Outgoing::Cancel(id));
    }

    fn limits(&self) -> EngineLimits {
        let l = self.shared.limits();
        EngineLimits {
            max_model_len: l.max_model_len,
            vocab_size: if l.vocab_size == 0 {
                self.vocab_size
            } else {
                l.vocab_size.min(self.vocab_size)
            },
            max_num_seqs: l.max_num_seqs,
            priority_scheduling: l.priority_scheduling,
        }
    }

    fn health(&self) -> Result<(), String> {
        self.shared.health()?;
        // Alive but not turning its loop (stopped, hung): nothing is served, so a load
        // balancer should look elsewhere. Live requests are left to finish if it comes back.
        match self.shared.scheduler_silent_for() {
            Some(d) if d >= SCHEDULER_STALL => Err(format!(
                "the scheduler has not run its step loop for {:.0} s (stopped or hung)",
                d.as_secs_f64()
            )),
            _ => Ok(()),
        }
    }

    fn stats(&self) -> EngineStats {
        let s = self.shared.stats();
        EngineStats {
            running: s.running as usize,
            waiting: s.waiting as usize,
            kv_usage: if s.pages_total == 0 {
                0.0
            } else {
                s.pages_used as f64 / s.pages_total as f64
            },
            preemptions: s.preemptions,
            prefix_cache_queries: s.prefix_cache_queries,
            prefix_cache_hits: s.prefix_cache_hits,
        }
    }
}
