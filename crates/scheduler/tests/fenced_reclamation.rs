//! The scheduler core against a simulated worker whose completions and releases arrive late, out
//! of step and interleaved at random (DESIGN.md sections 2 to 5 and 7).
//!
//! The simulated worker executes published launches in order, but the scheduler learns of each
//! completion, and of each of the two consumers' `released` counters (two tensor-parallel
//! ranks), only at random later steps; a release may even be seen before its completion. Between
//! those steps requests arrive, finish (sampled stop tokens, `max_tokens`), are cancelled, are
//! preempted by a small pool, a launch occasionally fails on the worker (its requests abort),
//! and the worker occasionally dies. A shadow model checks, after
//! every step:
//!
//! - no page is reused (named by a launch for a new owner) while a launch that referred to it is
//!   unreleased, and no block-table or token-table entry a launch refers to changes before that
//!   launch is released;
//! - no output is published for a cancelled (or finished) request, and every request's outputs
//!   are exactly its sampled stream, in order, without gaps or repeats across preemptions;
//! - `known_len` is `computed_len` plus the pending tokens: `known_len` agrees with the prompt and
//!   the published tokens, `computed_len` with the completions delivered for the request's
//!   current slot, and the pending positions (known, not covered by those completions) make up
//!   the difference;
//! - `PendingFrom` rows name the sampling row of the same request that precedes them;
//! - every KV position a launch reads was written, into the page the launch names, from the
//!   same token history as the reading request's (so a prefix-cache hit shares only pages whose
//!   whole prefix matches, and a dead worker's cache is not used again); prompts of a few
//!   families share prefixes, so hits are common;
//! - when the worker executes a sampling row of a request with `bad_words`, the slot's token
//!   mask bans exactly the last token of each word whose other tokens end the outputs before
//!   the row's position (so the mask is neither stale nor rewritten while a launch that reads
//!   it is unexecuted), and rows of other requests ask for no mask.
//!
//! At the end of each case everything drains, the pool and the slots are all back, and
//! `check_trace` accepts the scheduler's lifecycle trace.
//!
//! The page check fails when the fence check is removed from the reclaim path:
//!
//! ```text
//! RUSTFLAGS="--cfg baton_no_fence" CARGO_TARGET_DIR=/tmp/tgt-kv-nofence \
//!     cargo test -p baton-scheduler --test fenced_reclamation
//! ```
//!
//! reports, at the first step where a retired page comes back early, for example
//! "64 pages free, but 1 of 64 are referred to by launches after 0 (unreleased)" (and the
//! deterministic test below fails too).

use baton_proto::{
    Completion, Launch, LaunchSeq, PromptLogprob, SamplingParams, SlotRef,
    MAX_PROMPT_LOGPROB_POSITIONS, NOT_PENDING,
};
use baton_scheduler::{
    check_trace, Event, FinishReason, NewRequest, RequestId, Scheduler, SchedulerConfig,
    SchedulingPolicy, Tracer,
};
use proptest::prelude::*;
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::io::Write;
use std::sync::{Arc, Mutex};

const EOS: u32 = 2;
const VOCAB: usize = 64;

/// The token a request's stream samples at output `index`: the simulated worker samples from
/// the seed and the output index alone (as seeded sampling does), so a recompute after
/// preemption samples the same stream.
fn token_for(seed: u64, index: u32, eos_every: u64) -> u32 {
    let mut x = seed
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(u64::from(index).wrapping_mul(0xBF58_476D_1CE4_E5B9));
    x ^= x >> 31;
    x = x.wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^= x >> 29;
    if eos_every > 0 && x % eos_every == 0 {
        EOS
    } else {
        3 + (x % (VOCAB as u64 - 3)) as u32
    }
}

/// One step of the simulation.
#[derive(Clone, Debug)]
enum Op {
    /// A request arrives.
    Admit {
        prompt_len: usize,
        max_tokens: u32,
        ignore_eos: bool,
        /// 0: a prompt of its own; else prompts of the same family share a prefix.
        family: u8,
    },
    /// The client of the `n`-th live request (modulo) disconnects.
    Cancel(usize),
    /// The scheduler prepares and publishes a launch (if it can).
    Schedule,
    /// The worker executes the oldest published launch through its fence.
    Execute,
    /// The oldest completion not yet delivered reaches the scheduler.
    Complete,
    /// Consumer `c` advances its `released` counter to an executed launch (chosen by `pick`).
    Release { c: usize, pick: u8 },
    /// The scheduler reads the counters: `on_released(min)`.
    Poll,
    /// The worker dies (kernel evidence); its device memory is gone.
    WorkerDeath,
    /// The worker reports the oldest executed launch failed instead of its completion.
    FailLaunch,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (1usize..40, 0u32..24, any::<bool>(), 0u8..4).prop_map(|(prompt_len, max_tokens, ignore_eos, family)| Op::Admit { prompt_len, max_tokens, ignore_eos, family }),
        1 => any::<usize>().prop_map(Op::Cancel),
        6 => Just(Op::Schedule),
        5 => Just(Op::Execute),
        5 => Just(Op::Complete),
        5 => (0usize..2, any::<u8>()).prop_map(|(c, pick)| Op::Release { c, pick }),
        4 => Just(Op::Poll),
        // Rare: each about one step in 1800.
        1 => (0u32..60).prop_map(|x| match x {
            0 => Op::WorkerDeath,
            1 => Op::FailLaunch,
            _ => Op::Poll,
        }),
    ]
}

/// A `Write` into a shared buffer, for the trace.
#[derive(Clone, Default)]
struct Buf(Arc<Mutex<Vec<u8>>>);

impl Write for Buf {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// What a published launch referred to, recorded at publication.
struct Published {
    launch: Launch,
    /// Per row: the block-table entries and the input tokens read from the tables.
    blocks: Vec<Vec<u32>>,
    tokens: Vec<Vec<(usize, u32)>>,
    /// Per row: the request's token history up to the row's end (prompt, then its stream).
    history: Vec<Vec<u32>>,
    /// Per row: the request's `bad_words` and prompt length.
    bans: Vec<(Vec<Vec<u32>>, usize)>,
}

/// What the test knows of one request, from the outside.
struct Shadow {
    seed: u64,
    prompt: Vec<u32>,
    prompt_len: usize,
    max_tokens: usize,
    ignore_eos: bool,
    outputs: Vec<u32>,
    cancelled: bool,
    /// A launch that included the request failed: it must end with `Abort`.
    failed: bool,
    finished: Option<FinishReason>,
    /// Asked for prompt log-probabilities (every third request).
    wants_prompt: bool,
    /// Positions of the prompt log-probabilities received, in arrival order.
    prompt_lps: Vec<u32>,
    /// The request's `bad_words`.
    bad_words: Vec<Vec<u32>>,
}

struct Sim {
    sched: Scheduler,
    cfg: SchedulerConfig,
    /// The model's sliding window on every layer, when it has one: a row whose first query is
    /// at `p` reads no position before `p + 1 - w`, and the scheduler releases the pages
    /// wholly before that (`SchedulerConfig::kv_window`).
    window: Option<usize>,
    eos_every: u64,
    trace: Buf,
    next_id: RequestId,
    reqs: BTreeMap<RequestId, Shadow>,
    /// Launches published and not yet executed, oldest first.
    to_execute: VecDeque<LaunchSeq>,
    /// Completions of executed launches not yet delivered, oldest first.
    to_complete: VecDeque<Completion>,
    /// Every launch published since the worker (re)started, by sequence number.
    published: BTreeMap<LaunchSeq, Published>,
    /// Completed launches' rows, for `computed_len`: `(slot, first, end)`.
    completed_rows: Vec<(SlotRef, usize, usize)>,
    /// The last launch the worker executed.
    executed: LaunchSeq,
    /// Each consumer's `released` counter (the truth, which the scheduler reads only at `Poll`).
    released: [LaunchSeq; 2],
    /// The largest value passed to `on_released`, or the last launch at a worker death: every
    /// launch up to it is released as far as the scheduler may know.
    told: LaunchSeq,
    /// Per page: its last writer (slot reference) and the last launch that referred to it.
    pages: HashMap<u32, (SlotRef, LaunchSeq)>,
    /// Per page: the launch that last wrote it and the token history its KV was written from,
    /// up to the last position written into it (KV at a position depends on every token up to
    /// it). Device memory: cleared when the worker dies.
    content: HashMap<u32, (LaunchSeq, Vec<u32>)>,
    events: Vec<Event>,
    /// Events taken so far (tokens, prompt log-probabilities, ends): progress.
    events_seen: u64,
}

impl Sim {
    fn with_window(cfg: SchedulerConfig, eos_every: u64, window: Option<usize>) -> Self {
        let cfg = SchedulerConfig {
            kv_window: window,
            ..cfg
        };
        let mut sched = Scheduler::new_local(cfg.clone(), VOCAB);
        let trace = Buf::default();
        sched.set_tracer(Tracer::new(Box::new(trace.clone())));
        Self {
            sched,
            cfg,
            window,
            eos_every,
            trace,
            next_id: 1,
            reqs: BTreeMap::new(),
            to_execute: VecDeque::new(),
            to_complete: VecDeque::new(),
            published: BTreeMap::new(),
            completed_rows: Vec::new(),
            executed: 0,
            released: [0; 2],
            told: 0,
            pages: HashMap::new(),
            content: HashMap::new(),
            events: Vec::new(),
            events_seen: 0,
        }
    }

    fn live_ids(&self) -> Vec<RequestId> {
        self.reqs
            .iter()
            .filter(|(_, r)| r.finished.is_none())
            .map(|(&id, _)| id)
            .collect()
    }

    fn apply(&mut self, op: &Op) -> Result<(), TestCaseError> {
        match *op {
            Op::Admit {
                prompt_len,
                max_tokens,
                ignore_eos,
                family,
            } => {
                let id = self.next_id;
                self.next_id += 1;
                let prompt: Vec<u32> = (0..prompt_len)
                    .map(|j| {
                        let x = if family == 0 {
                            id as usize * 31
                        } else {
                            usize::from(family) * 7
                        };
                        3 + ((x + j * 17) % (VOCAB - 3)) as u32
                    })
                    .collect();
                let wants_prompt = id.is_multiple_of(3);
                let params = SamplingParams {
                    seed: id,
                    prompt_logprobs: if wants_prompt { 1 + (id % 5) as u32 } else { 0 },
                    ..SamplingParams::greedy()
                };
                // Under the priority policy, three priorities in no relation to arrival, so
                // requests overtake each other and the least urgent running one is preempted.
                let priority = match self.sched.config().policy {
                    SchedulingPolicy::Priority => (id % 3) as i32 - 1,
                    SchedulingPolicy::Fcfs => 0,
                };
                // Every fourth request has one-token bad words (a fixed mask), every fourth
                // longer ones taken from its own stream, so their prefixes match.
                let t = |k| token_for(id, k, self.eos_every);
                let bad_words = match id % 4 {
                    1 => vec![vec![t(3)], vec![5]],
                    2 => vec![vec![t(0), t(1)], vec![t(2), t(3), t(4)], vec![7]],
                    _ => Vec::new(),
                };
                let r = NewRequest {
                    priority,
                    id,
                    prompt,
                    max_tokens,
                    params,
                    eos_ids: vec![EOS],
                    stop_token_ids: Vec::new(),
                    ignore_eos,
                    logit_bias: Vec::new(),
                    min_tokens: 0,
                    cache_salt: 0,
                    guide: None,
                    bad_words,
                    lora: 0,
                };
                let prompt = r.prompt.clone();
                let bad_words = r.bad_words.clone();
                if self.sched.add_request(r).is_ok() {
                    self.reqs.insert(
                        id,
                        Shadow {
                            seed: id,
                            prompt,
                            prompt_len,
                            max_tokens: max_tokens as usize,
                            ignore_eos,
                            outputs: Vec::new(),
                            cancelled: false,
                            failed: false,
                            finished: None,
                            wants_prompt,
                            prompt_lps: Vec::new(),
                            bad_words,
                        },
                    );
                }
            }
            Op::Cancel(n) => {
                let live = self.live_ids();
                if !live.is_empty() {
                    let id = live[n % live.len()];
                    self.reqs.get_mut(&id).unwrap().cancelled = true;
                    self.sched.cancel(id, &mut self.events);
                }
            }
            Op::Schedule => {
                if let Some(l) = self.sched.schedule() {
                    self.publish(l)?;
                }
            }
            Op::Execute => {
                if let Some(seq) = self.to_execute.pop_front() {
                    self.execute(seq)?;
                }
            }
            Op::Complete => {
                if let Some(c) = self.to_complete.pop_front() {
                    for r in &self.published[&c.seq].launch.rows {
                        let first = r.first_pos as usize;
                        self.completed_rows
                            .push((r.req, first, first + r.num_tokens as usize));
                    }
                    prop_assert!(
                        self.sched.on_completion(&c, &mut self.events),
                        "completion {} refused",
                        c.seq
                    );
                }
            }
            Op::FailLaunch => {
                if let Some(c) = self.to_complete.pop_front() {
                    // What the failed launch wrote is garbage (unless a later launch wrote
                    // the page again since).
                    self.content.retain(|_, (writer, _)| *writer != c.seq);
                    let rows: HashSet<SlotRef> = self.published[&c.seq]
                        .launch
                        .rows
                        .iter()
                        .map(|r| r.req)
                        .collect();
                    for id in self.live_ids() {
                        let slot = self.sched.request_lengths(id).and_then(|l| l.slot);
                        if slot.is_some_and(|s| rows.contains(&s)) {
                            self.reqs.get_mut(&id).unwrap().failed = true;
                        }
                    }
                    self.sched.on_failed_launch(c.seq, &mut self.events);
                }
            }
            Op::Release { c, pick } => {
                let from = self.released[c];
                if self.executed > from {
                    // Jump to any executed launch: a consumer may release several at once.
                    let to = from + 1 + u64::from(pick) % (self.executed - from);
                    self.released[c] = to;
                }
            }
            Op::Poll => self.poll(),
            Op::WorkerDeath => {
                self.sched.on_worker_death();
                let last = self.sched.last_launch();
                // The new worker has seen no launch so far: nothing older is pending for it.
                self.to_execute.clear();
                self.to_complete.clear();
                self.published.clear();
                self.executed = last;
                self.released = [last; 2];
                self.told = last;
                self.content.clear();
            }
        }
        self.take_events()?;
        self.check()
    }

    fn poll(&mut self) {
        let min = self.released[0].min(self.released[1]);
        self.told = self.told.max(min);
        self.sched.on_released(min);
    }

    /// Records what launch `l` refers to and checks that no page it names is still referred to
    /// by an unreleased launch of another owner.
    fn publish(&mut self, l: Launch) -> Result<(), TestCaseError> {
        let tables = self.sched.tables().clone();
        prop_assert!(self.sched.stats().inflight <= self.cfg.max_inflight);
        let by_slot: HashMap<SlotRef, RequestId> = self
            .live_ids()
            .into_iter()
            .filter_map(|id| Some((self.sched.request_lengths(id)?.slot?, id)))
            .collect();
        let mut blocks = Vec::new();
        let mut tokens = Vec::new();
        let mut history = Vec::new();
        let mut bans = Vec::new();
        let bs = self.cfg.block_size;
        let scored: usize = l.rows.iter().map(|r| r.scores_prompt().len()).sum();
        prop_assert!(
            scored <= MAX_PROMPT_LOGPROB_POSITIONS,
            "launch {} scores {} prompt positions",
            l.seq,
            scored
        );
        for r in &l.rows {
            let owner = by_slot.get(&r.req).and_then(|id| self.reqs.get(id));
            prop_assert!(
                r.params.prompt_logprobs == 0 || owner.is_some_and(|o| o.wants_prompt),
                "a row of launch {} reports prompt log-probabilities nobody asked for",
                l.seq
            );
        }
        for (i, r) in l.rows.iter().enumerate() {
            let mut b = Vec::new();
            tables.read_blocks(r.req.slot, r.num_blocks as usize, &mut b);
            let first = r.first_pos as usize;
            let end = first + r.num_tokens as usize;
            // With a sliding window the pages wholly before the first query's window are not
            // the row's: it neither reads nor writes them (their entries are stale).
            let from_block = self.reads_from(first) / bs;
            for (bi, &p) in b.iter().enumerate().skip(from_block) {
                // A row writes the positions it computes; it only reads the pages before them
                // (a prefix-cache hit shares such pages with their other holders).
                let writes = first.max(bi * bs) < end.min((bi + 1) * bs);
                match self.pages.get(&p) {
                    Some(&(writer, last)) if writes && writer != r.req => {
                        prop_assert!(
                            self.told >= last,
                            "page {p} reused by launch {} while launch {last} that referred to it is unreleased (released {})",
                            l.seq,
                            self.told
                        );
                    }
                    _ => {}
                }
                let writer = if writes {
                    r.req
                } else {
                    self.pages.get(&p).map_or(r.req, |w| w.0)
                };
                self.pages.insert(p, (writer, l.seq));
            }
            prop_assert!(
                end <= (r.num_blocks as usize) * self.cfg.block_size,
                "row {i} of launch {} has too few blocks",
                l.seq
            );
            let from_table = if r.pending_launch != NOT_PENDING {
                // The first input is the id sampled by the named row, which must be the
                // sampling row of this request that ends at `first`.
                let src = self.published.get(&r.pending_launch);
                let src_row = src.and_then(|p| p.launch.rows.get(r.pending_row as usize));
                prop_assert!(
                    src_row.is_some_and(|s| s.req == r.req
                        && s.sample == 1
                        && (s.first_pos + s.num_tokens) as usize == first),
                    "launch {} row {i} pending from launch {} row {}, which is not this request's previous sampling row",
                    l.seq,
                    r.pending_launch,
                    r.pending_row
                );
                first + 1
            } else {
                first
            };
            let inputs: Vec<(usize, u32)> = (from_table..end)
                .map(|pos| (pos, tables.token(r.req.slot, pos)))
                .collect();
            // The inputs in the table are the request's history: its prompt, then its
            // outputs (also after a preemption or a worker death moved it to another slot).
            let id = by_slot.get(&r.req).copied();
            prop_assert!(
                id.is_some(),
                "launch {} row {i}: no live request holds its slot",
                l.seq
            );
            let shadow = &self.reqs[&id.unwrap()];
            bans.push((shadow.bad_words.clone(), shadow.prompt_len));
            history.push(
                (0..end)
                    .map(|pos| match shadow.prompt.get(pos) {
                        Some(&t) => t,
                        None => token_for(
                            shadow.seed,
                            (pos - shadow.prompt_len) as u32,
                            self.eos_every,
                        ),
                    })
                    .collect::<Vec<u32>>(),
            );
            for &(pos, t) in &inputs {
                let want = if pos < shadow.prompt_len {
                    shadow.prompt.get(pos).copied()
                } else {
                    shadow.outputs.get(pos - shadow.prompt_len).copied()
                };
                prop_assert_eq!(
                    Some(t),
                    want,
                    "launch {} row {} position {}: the token table disagrees with the history",
                    l.seq,
                    i,
                    pos
                );
            }
            tokens.push(inputs);
            blocks.push(b);
        }
        self.to_execute.push_back(l.seq);
        self.published.insert(
            l.seq,
            Published {
                launch: l,
                blocks,
                tokens,
                history,
                bans,
            },
        );
        Ok(())
    }

    /// The worker reads the tables as they are now: they must still hold what the launch
    /// referred to at publication.
    /// The first position a row whose first query is at `first` reads (its window's start).
    fn reads_from(&self, first: usize) -> usize {
        self.window.map_or(0, |w| (first + 1).saturating_sub(w))
    }

    fn execute(&mut self, seq: LaunchSeq) -> Result<(), TestCaseError> {
        prop_assert_eq!(seq, self.executed + 1, "launches execute in order");
        self.executed = seq;
        let p = &self.published[&seq];
        // The KV each row of a live request reads (positions before its first, in its blocks)
        // was written from the same history; then the row writes its own positions. (A row of
        // a request that ended or lost its slot since publication may read anything: its
        // output is suppressed.)
        let bs = self.cfg.block_size;
        let live: HashSet<SlotRef> = self
            .live_ids()
            .into_iter()
            .filter_map(|id| self.sched.request_lengths(id)?.slot)
            .collect();
        for (i, r) in p.launch.rows.iter().enumerate() {
            let (first, end) = (r.first_pos as usize, (r.first_pos + r.num_tokens) as usize);
            let hist = &p.history[i];
            let read_from = self.reads_from(first);
            for (bi, page) in p.blocks[i].iter().enumerate() {
                let read_end = first.min((bi + 1) * bs);
                if read_end > (bi * bs).max(read_from) && live.contains(&r.req) {
                    let have = self.content.get(page);
                    prop_assert!(
                        have.is_some_and(|(_, c)| c.len() >= read_end && c[..read_end] == hist[..read_end]),
                        "launch {} row {} reads positions {}..{} from page {}, which holds KV of {:?}, not of {:?}",
                        seq, i, bi * bs, read_end, page, have, &hist[..read_end]
                    );
                }
                let write_end = end.min((bi + 1) * bs);
                if first.max(bi * bs) < write_end {
                    self.content
                        .insert(*page, (seq, hist[..write_end].to_vec()));
                }
            }
        }
        // The token mask a sampling row reads now bans what its request's outputs before the
        // row's position call for.
        let tables = self.sched.tables().clone();
        let mut mask = Vec::new();
        for (i, r) in p.launch.rows.iter().enumerate() {
            let (words, prompt_len) = &p.bans[i];
            if r.sample == 0 || !live.contains(&r.req) {
                continue;
            }
            prop_assert_eq!(
                r.params.token_mask,
                u32::from(!words.is_empty()),
                "launch {} row {}: token mask flag",
                seq,
                i
            );
            if words.is_empty() {
                continue;
            }
            let end = (r.first_pos + r.num_tokens) as usize;
            let outputs = &p.history[i][*prompt_len..end];
            tables.read_token_mask(r.req.slot, &mut mask);
            for t in 0..VOCAB as u32 {
                let banned = words
                    .iter()
                    .any(|w| w[w.len() - 1] == t && outputs.ends_with(&w[..w.len() - 1]));
                let allowed = mask[t as usize / 32] >> (t % 32) & 1 == 1;
                prop_assert!(
                    allowed != banned,
                    "launch {} row {}: token {} allowed {} after outputs {:?} with bad words {:?}",
                    seq,
                    i,
                    t,
                    allowed,
                    outputs,
                    words
                );
            }
        }
        let sampled = p
            .launch
            .rows
            .iter()
            .enumerate()
            .filter(|(_, r)| r.sample == 1)
            .map(|(i, r)| baton_proto::Sampled {
                row: i as u32,
                req: r.req,
                token: token_for(r.params.seed, r.output_index, self.eos_every),
                logprob: 0.0,
                top: Vec::new(),
            })
            .collect();
        // Prompt log-probabilities as a worker reports them: the token after each scored
        // position, read from the table now; the log-probability encodes the position.
        let mut prompt = Vec::new();
        for (i, r) in p.launch.rows.iter().enumerate() {
            for pos in r.scores_prompt() {
                prompt.push(PromptLogprob {
                    row: i as u32,
                    req: r.req,
                    pos: pos + 1,
                    token: tables.token(r.req.slot, pos as usize + 1),
                    logprob: -(pos as f32 + 1.0),
                    rank: pos + 2,
                    top: vec![(0, -0.5); r.params.prompt_top().unwrap_or(0)],
                });
            }
        }
        self.to_complete.push_back(Completion {
            seq,
            sampled,
            prompt,
        });
        Ok(())
    }

    /// Checks every event the scheduler pushed since the last step.
    fn take_events(&mut self) -> Result<(), TestCaseError> {
        self.events_seen += self.events.len() as u64;
        for e in std::mem::take(&mut self.events) {
            match e {
                Event::PromptLogprob {
                    id,
                    pos,
                    token,
                    logprob,
                    rank,
                    top,
                } => {
                    prop_assert_eq!(rank, pos + 1, "the rank travels with its position");
                    let r = self
                        .reqs
                        .get_mut(&id)
                        .expect("prompt log-probability for an unknown request");
                    prop_assert!(r.wants_prompt, "request {} did not ask for them", id);
                    prop_assert!(r.outputs.is_empty(), "request {} got one after a token", id);
                    prop_assert!(r.finished.is_none());
                    prop_assert_eq!(
                        pos as usize,
                        r.prompt_lps.len() + 1,
                        "request {} positions out of order: {:?}",
                        id,
                        &r.prompt_lps
                    );
                    prop_assert!((pos as usize) < r.prompt_len);
                    prop_assert_eq!(token, r.prompt[pos as usize]);
                    prop_assert_eq!(logprob, -(pos as f32));
                    prop_assert_eq!(top.len(), (id % 5) as usize);
                    r.prompt_lps.push(pos);
                }
                Event::Token { id, token, .. } => {
                    let r = self
                        .reqs
                        .get_mut(&id)
                        .expect("token for an unknown request");
                    prop_assert!(
                        !r.wants_prompt || r.prompt_lps.len() == r.prompt_len - 1,
                        "request {} got its first token after {} of {} prompt log-probabilities",
                        id,
                        r.prompt_lps.len(),
                        r.prompt_len - 1
                    );
                    prop_assert!(!r.cancelled, "output published for cancelled request {id}");
                    prop_assert!(r.finished.is_none(), "output for finished request {id}");
                    let want = token_for(r.seed, r.outputs.len() as u32, self.eos_every);
                    prop_assert_eq!(
                        token,
                        want,
                        "request {} output {} is not its stream's",
                        id,
                        r.outputs.len()
                    );
                    r.outputs.push(token);
                }
                Event::Finished {
                    id,
                    reason,
                    output_tokens,
                    cached_tokens,
                    ..
                } => {
                    let max_model_len = self.cfg.max_model_len;
                    let r = self.reqs.get_mut(&id).expect("unknown request finished");
                    prop_assert!(r.finished.is_none(), "request {id} finished twice");
                    prop_assert_eq!(output_tokens, r.outputs.len());
                    // A request that ran to its end got every prompt log-probability (a
                    // `max_tokens: 0` one too, which ends with its prompt computed).
                    prop_assert!(
                        !r.wants_prompt
                            || !matches!(reason, FinishReason::Length | FinishReason::Stop)
                            || r.prompt_lps.len() == r.prompt_len - 1,
                        "request {} ended {:?} with {} of {} prompt log-probabilities",
                        id,
                        reason,
                        r.prompt_lps.len(),
                        r.prompt_len - 1
                    );
                    // The prompt is computed, not taken from the prefix cache, while its
                    // log-probabilities are owed.
                    prop_assert!(
                        !r.wants_prompt || cached_tokens == 0,
                        "request {} wants prompt log-probabilities but took {} from the cache",
                        id,
                        cached_tokens
                    );
                    // Cached prompt tokens, not recomputed outputs: the last prompt token is
                    // always computed.
                    prop_assert!(
                        cached_tokens < r.prompt_len,
                        "request {} reports {} cached of {} prompt tokens",
                        id,
                        cached_tokens,
                        r.prompt_len
                    );
                    prop_assert!(
                        !r.failed
                            || matches!(reason, FinishReason::Abort | FinishReason::Cancelled),
                        "request {} in a failed launch ended {:?}",
                        id,
                        reason
                    );
                    match reason {
                        FinishReason::Cancelled => prop_assert!(r.cancelled),
                        FinishReason::Stop => {
                            prop_assert!(!r.ignore_eos && r.outputs.last() == Some(&EOS))
                        }
                        FinishReason::Length => prop_assert!(
                            r.outputs.len() == r.max_tokens
                                || r.prompt_len + r.outputs.len() == max_model_len
                        ),
                        FinishReason::Abort => prop_assert!(r.failed, "request {} aborted", id),
                    }
                    r.finished = Some(reason);
                }
            }
        }
        Ok(())
    }

    /// The invariants that hold after every step.
    fn check(&mut self) -> Result<(), TestCaseError> {
        let stats = self.sched.stats();
        let pool = stats.pool;
        prop_assert_eq!(pool.free + pool.in_use + pool.retired, pool.total);
        prop_assert!(stats.inflight <= self.cfg.max_inflight);
        prop_assert!(self.sched.released() <= self.told, "released ran ahead");
        // A page an unreleased launch referred to is held or retired, never free.
        let told = self.told;
        let unreleased = self
            .pages
            .values()
            .filter(|&&(_, last)| last > told)
            .count();
        prop_assert!(
            pool.free + unreleased <= pool.total,
            "{} pages free, but {} of {} are referred to by launches after {} (unreleased)",
            pool.free,
            unreleased,
            pool.total,
            told
        );

        // Entries of unreleased launches never change.
        let tables = self.sched.tables().clone();
        for (seq, p) in self.published.range(told + 1..) {
            for (i, r) in p.launch.rows.iter().enumerate() {
                let mut b = Vec::new();
                tables.read_blocks(r.req.slot, r.num_blocks as usize, &mut b);
                prop_assert_eq!(
                    &b,
                    &p.blocks[i],
                    "block-table entries of launch {} row {} changed before its release",
                    seq,
                    i
                );
                for &(pos, t) in &p.tokens[i] {
                    prop_assert_eq!(
                        tables.token(r.req.slot, pos),
                        t,
                        "token {} of launch {} row {} changed before its release",
                        pos,
                        seq,
                        i
                    );
                }
            }
        }

        // known_len == computed_len + pending, each counted from the outside.
        for (&id, r) in &self.reqs {
            let Some(l) = self.sched.request_lengths(id) else {
                prop_assert!(r.finished.is_some(), "live request {id} unknown");
                continue;
            };
            prop_assert!(r.finished.is_none(), "finished request {id} still live");
            let known = r.prompt_len + r.outputs.len();
            prop_assert_eq!(l.known_len, known, "request {} known_len", id);
            // Positions taken from the prefix cache count as computed.
            let mut covered = vec![false; known];
            let mut computed = l.cached_len;
            for c in covered.iter_mut().take(l.cached_len) {
                *c = true;
            }
            if let Some(slot) = l.slot {
                for &(s, first, end) in &self.completed_rows {
                    if s == slot {
                        computed = computed.max(end);
                        for c in covered.iter_mut().take(end).skip(first) {
                            *c = true;
                        }
                    }
                }
            }
            let pending = covered.iter().filter(|&&c| !c).count();
            prop_assert_eq!(l.computed_len, computed, "request {} computed_len", id);
            prop_assert_eq!(
                known,
                computed + pending,
                "request {}: known_len is not computed_len plus pending",
                id
            );
            prop_assert!(l.computed_len <= l.scheduled_len);
            prop_assert!(l.scheduled_len <= l.known_len + l.sampling);
        }
        Ok(())
    }

    /// Runs the worker and the fences to the end: every request finishes, and everything comes
    /// back. `eager`: the scheduler prepares a launch whenever the in-flight limit allows, as
    /// the daemon does (with two in flight, rows are planned before the previous launch
    /// completes); else one launch at a time.
    fn drain(&mut self, eager: bool) -> Result<(), TestCaseError> {
        // Between two events (a token, a prompt log-probability, an end) the running requests
        // compute at most a prompt each, a few hundred launches at one position per launch;
        // far more steps without one means requests are preempted and restarted without end
        // (a livelock: say a lone request whose pages the pool cannot hold preempting itself).
        let (mut seen, mut quiet) = (self.events_seen, 0u32);
        while !(self.sched.is_idle() && self.to_execute.is_empty() && self.to_complete.is_empty()) {
            quiet = if self.events_seen == seen {
                quiet + 1
            } else {
                0
            };
            seen = self.events_seen;
            if quiet > 20_000 {
                return Err(TestCaseError::fail(format!(
                    "{quiet} steps without an event (preempted without end?): {:?}",
                    self.sched.stats()
                )));
            }
            if eager && self.sched.stats().inflight < self.cfg.max_inflight {
                let before = self.sched.last_launch();
                self.apply(&Op::Schedule)?;
                if self.sched.last_launch() != before {
                    continue;
                }
            }
            if !self.to_complete.is_empty() {
                self.apply(&Op::Complete)?;
            } else if !self.to_execute.is_empty() {
                self.apply(&Op::Execute)?;
            } else if self.told < self.executed {
                self.released = [self.executed; 2];
                self.apply(&Op::Poll)?;
            } else {
                let before = self.sched.last_launch();
                self.apply(&Op::Schedule)?;
                if self.sched.last_launch() == before {
                    return Err(TestCaseError::fail(format!(
                        "stalled with live requests, nothing in flight and everything released: {:?}",
                        self.sched.stats()
                    )));
                }
            }
        }
        for _ in 0..2 {
            self.released = [self.executed; 2];
            self.apply(&Op::Poll)?;
        }
        let s = self.sched.stats();
        prop_assert_eq!(s.pool.free, s.pool.total, "pool not back: {:?}", s);
        prop_assert_eq!(s.slots_retired, 0);
        for (id, r) in &self.reqs {
            prop_assert!(r.finished.is_some(), "request {} never finished", id);
        }
        self.sched.flush_trace();
        let trace = self.trace.0.lock().unwrap().clone();
        if let Err(v) = check_trace(trace.as_slice()) {
            let line = String::from_utf8_lossy(&trace)
                .lines()
                .nth(v.line - 1)
                .unwrap_or_default()
                .to_owned();
            return Err(TestCaseError::fail(format!("trace rejected: {v}\n{line}")));
        }
        Ok(())
    }
}

fn config() -> impl Strategy<Value = (SchedulerConfig, u64, Option<usize>)> {
    (
        1usize..=4,
        1usize..=4,
        0usize..12,
        1usize..=6,
        0u64..12,
        0u8..4,
        any::<bool>(),
        // A sliding window on every layer in half the cases, from one key to past the
        // longest request (which releases nothing).
        prop_oneof![Just(None), (1usize..=70).prop_map(Some)],
        // Chunks from a few positions to most of a request: with a window, the pool a request
        // needs alone grows with them (`SchedulerConfig::request_pages`).
        prop_oneof![Just(48usize), 1usize..=24],
    )
        .prop_map(
            |(
                max_inflight,
                bs_log,
                extra_pages,
                max_num_seqs,
                eos_every,
                caching,
                by_priority,
                window,
                max_num_batched_tokens,
            )| {
                let block_size = 1 << (bs_log - 1);
                let max_model_len = 64;
                let mut cfg = SchedulerConfig {
                    max_num_seqs,
                    max_num_batched_tokens,
                    block_size,
                    num_blocks: 0,
                    max_model_len,
                    max_inflight,
                    enable_prefix_caching: caching != 0,
                    policy: if by_priority {
                        SchedulingPolicy::Priority
                    } else {
                        SchedulingPolicy::Fcfs
                    },
                    kv_window: window,
                };
                // At least what one request can hold at once, so every request runs alone
                // (with a window that is less than its length: a pool too small for the
                // window's pages and a chunk's makes a lone request preempt itself forever,
                // which `drain` catches); little more, so pages are recycled constantly and
                // preemption happens.
                cfg.num_blocks = cfg.max_request_pages() + extra_pages;
                (cfg, eos_every, window)
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 256,
        max_shrink_iters: 2_000,
        ..ProptestConfig::default()
    })]

    /// Random admissions, cancels, launches, late completions, out-of-step releases and worker
    /// deaths: every step keeps pages fenced, cancelled outputs unpublished and the lengths
    /// consistent, and every case drains to a full pool and a clean trace.
    #[test]
    fn pages_stay_fenced_cancels_stay_silent_and_lengths_add_up_under_late_out_of_step_fences(
        (cfg, eos_every, window) in config(),
        ops in proptest::collection::vec(op(), 1..600),
        eager in any::<bool>(),
    ) {
        let mut sim = Sim::with_window(cfg, eos_every, window);
        for op in &ops {
            sim.apply(op)?;
        }
        sim.drain(eager)?;
    }
}

/// The fence rule of DESIGN.md section 3, deterministically: a request that finishes in launch
/// `s` while launch `s+1` including it is in flight retires its pages after `s+1`; the release of
/// `s` alone does not bring them back.
#[test]
fn pages_of_a_request_finished_with_a_later_launch_in_flight_wait_for_that_launch() {
    let cfg = SchedulerConfig {
        max_num_seqs: 2,
        max_num_batched_tokens: 16,
        block_size: 4,
        num_blocks: 4,
        max_model_len: 16,
        max_inflight: 2,
        enable_prefix_caching: false,
        policy: baton_scheduler::SchedulingPolicy::Fcfs,
        kv_window: None,
    };
    let mut s = Scheduler::new_local(cfg, VOCAB);
    s.add_request(NewRequest {
        priority: 0,
        id: 1,
        prompt: vec![3, 4, 5],
        max_tokens: 1,
        params: SamplingParams::greedy(),
        eos_ids: vec![],
        stop_token_ids: vec![],
        ignore_eos: false,
        logit_bias: Vec::new(),
        min_tokens: 0,
        cache_salt: 0,
        guide: None,
        bad_words: Vec::new(),
        lora: 0,
    })
    .unwrap();
    s.add_request(NewRequest {
        priority: 0,
        id: 2,
        prompt: vec![3, 4, 5, 6, 7],
        max_tokens: 8,
        params: SamplingParams::greedy(),
        eos_ids: vec![],
        stop_token_ids: vec![],
        ignore_eos: true,
        logit_bias: Vec::new(),
        min_tokens: 0,
        cache_salt: 0,
        guide: None,
        bad_words: Vec::new(),
        lora: 0,
    })
    .unwrap();
    let l1 = s.schedule().unwrap();
    let l2 = s.schedule().unwrap();
    assert!(
        l2.rows.iter().all(|r| r.pending_launch == l1.seq),
        "launch 2 decodes request 2 from launch 1: {l2:?}"
    );
    let mut ev = Vec::new();
    let sampled = l1
        .rows
        .iter()
        .enumerate()
        .map(|(i, r)| baton_proto::Sampled {
            row: i as u32,
            req: r.req,
            token: 9,
            logprob: 0.0,
            top: vec![],
        })
        .collect();
    s.on_completion(
        &Completion {
            seq: l1.seq,
            sampled,
            prompt: Vec::new(),
        },
        &mut ev,
    );
    // Request 1 finished (max_tokens 1) and was not in launch 2: its page retired after 1.
    assert!(ev
        .iter()
        .any(|e| matches!(e, Event::Finished { id: 1, .. })));
    // Request 2 is cancelled with launch 2 in flight: its pages retire after launch 2.
    s.cancel(2, &mut ev);
    let retired = s.stats().pool.retired;
    assert_eq!(retired, 3, "1 page of request 1, 2 of request 2");
    assert_eq!(
        s.on_released(l1.seq),
        1,
        "only request 1's page is released"
    );
    assert_eq!(s.stats().pool.retired, 2);
    assert_eq!(s.on_released(l2.seq), 2);
    assert_eq!(s.stats().pool.free, 4);
}

#[test]
fn a_completion_that_leaves_out_a_sampling_row_aborts_that_request_and_no_other() {
    let cfg = SchedulerConfig {
        max_num_seqs: 2,
        max_num_batched_tokens: 16,
        block_size: 4,
        num_blocks: 4,
        max_model_len: 16,
        max_inflight: 1,
        enable_prefix_caching: true,
        policy: baton_scheduler::SchedulingPolicy::Fcfs,
        kv_window: None,
    };
    let mut s = Scheduler::new_local(cfg, VOCAB);
    for id in [1, 2] {
        s.add_request(NewRequest {
            priority: 0,
            id,
            prompt: vec![3, 4, 5],
            max_tokens: 4,
            params: SamplingParams::greedy(),
            eos_ids: vec![],
            stop_token_ids: vec![],
            ignore_eos: true,
            logit_bias: Vec::new(),
            min_tokens: 0,
            cache_salt: 0,
            guide: None,
            bad_words: Vec::new(),
            lora: 0,
        })
        .unwrap();
    }
    let l1 = s.schedule().unwrap();
    assert_eq!(l1.rows.len(), 2);
    // The worker answers for row 1 only (a worker bug).
    let mut ev = Vec::new();
    s.on_completion(
        &Completion {
            seq: l1.seq,
            sampled: vec![baton_proto::Sampled {
                row: 1,
                req: l1.rows[1].req,
                token: 9,
                logprob: 0.0,
                top: vec![],
            }],
            prompt: Vec::new(),
        },
        &mut ev,
    );
    // Requests 1 and 2: the one whose token came out is row 1's, the other is left hanging.
    let row1_id = ev
        .iter()
        .find_map(|e| match e {
            Event::Token { id, .. } => Some(*id),
            _ => None,
        })
        .expect("row 1's token was published");
    let id0 = 3 - row1_id;
    assert!(
        ev.iter().any(
            |e| matches!(e, Event::Finished { id, reason: FinishReason::Abort, .. } if *id == id0)
        ),
        "the request whose sample was left out must end, not wait forever: {ev:?}"
    );
    // The other request carries on to its length limit, and everything comes back.
    s.on_released(l1.seq);
    let mut finished_other = false;
    for _ in 0..10 {
        let Some(l) = s.schedule() else { break };
        let mut ev = Vec::new();
        s.on_completion(&Completion::sampling(&l, |_| 9), &mut ev);
        s.on_released(l.seq);
        finished_other |= ev.iter().any(|e| {
            matches!(
                e,
                Event::Finished {
                    reason: FinishReason::Length,
                    ..
                }
            )
        });
    }
    assert!(finished_other, "the other request did not finish");
    assert_eq!(s.stats().pool.free, 4, "{:?}", s.stats());
}
