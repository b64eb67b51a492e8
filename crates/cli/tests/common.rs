//! Helpers shared by the engine tests: the test model and its golden outputs.
#![allow(dead_code)]

use baton::engine::LocalEngine;
use baton_model::{load_model_dir, Tokenizer};
use baton_proto::SamplingParams;
use baton_scheduler::{Event, FinishReason, NewRequest, SchedulerConfig};
use baton_worker::{Backend, CpuBackend};
use std::collections::HashMap;
use std::path::PathBuf;

/// The model directory: `BATON_TEST_MODEL`, or the shared stories260K.
pub fn model_dir() -> PathBuf {
    std::env::var_os("BATON_TEST_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/models/stories260K")
        })
}

/// One golden prompt.
#[derive(Clone, Debug)]
pub struct Golden {
    pub prompt: String,
    pub prompt_ids: Vec<u32>,
    pub greedy_ids: Vec<u32>,
    pub greedy_text: String,
    pub top5: Vec<(u32, f32)>,
}

/// Reads golden.json.
pub fn goldens() -> Vec<Golden> {
    let text = std::fs::read_to_string(model_dir().join("golden.json")).expect("golden.json");
    let v: serde_json::Value = serde_json::from_str(&text).expect("golden.json parses");
    let ids = |x: &serde_json::Value| {
        x.as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect::<Vec<_>>()
    };
    v["prompts"]
        .as_array()
        .expect("prompts array")
        .iter()
        .map(|p| Golden {
            prompt: p["prompt"].as_str().unwrap().to_owned(),
            prompt_ids: ids(&p["prompt_ids"]),
            greedy_ids: ids(&p["greedy_ids"]),
            greedy_text: p["greedy_text"].as_str().unwrap().to_owned(),
            top5: p["first_step_top5"]
                .as_array()
                .unwrap()
                .iter()
                .map(|e| (e[0].as_u64().unwrap() as u32, e[1].as_f64().unwrap() as f32))
                .collect(),
        })
        .collect()
}

/// A scheduler configuration for tests.
pub fn config(block_size: usize, num_blocks: usize, max_inflight: usize) -> SchedulerConfig {
    SchedulerConfig {
        max_num_seqs: 64,
        max_num_batched_tokens: 256,
        block_size,
        num_blocks,
        max_model_len: 512,
        max_inflight,
        enable_prefix_caching: true,
        policy: baton_scheduler::SchedulingPolicy::Fcfs,
        kv_window: None,
    }
}

/// An engine on the test model.
pub fn engine(cfg: SchedulerConfig) -> (LocalEngine<CpuBackend>, Tokenizer) {
    let loaded = load_model_dir(model_dir()).expect("test model loads");
    let (model, tok) = loaded.into_cpu_model();
    let backend = CpuBackend::new(model, cfg.num_blocks, cfg.block_size);
    (LocalEngine::new(cfg, backend), tok.expect("tokenizer"))
}

/// Seeded sampling with every filter on (temperature 0.9, top-p 0.95, top-k 40, min-p 0.01).
pub fn seeded(seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: 0.9,
        top_p: 0.95,
        top_k: 40,
        min_p: 0.01,
        seed,
        ..SamplingParams::greedy()
    }
}

/// A request that stops on the test model's EOS (2).
pub fn request(id: u64, prompt: Vec<u32>, max_tokens: u32, params: SamplingParams) -> NewRequest {
    NewRequest {
        eos_ids: vec![2],
        ..NewRequest::new(id, prompt, max_tokens, params)
    }
}

/// Runs every request to the end; returns each request's tokens and finish reason.
pub fn run<B: Backend>(
    engine: &mut LocalEngine<B>,
    reqs: Vec<NewRequest>,
) -> HashMap<u64, (Vec<u32>, FinishReason)> {
    for r in reqs {
        engine.add_request(r).expect("admitted");
    }
    let mut events = Vec::new();
    engine.run_until_idle(&mut events).expect("runs");
    collect(events)
}

/// Groups events by request.
pub fn collect(events: Vec<Event>) -> HashMap<u64, (Vec<u32>, FinishReason)> {
    let mut out: HashMap<u64, (Vec<u32>, FinishReason)> = HashMap::new();
    for e in events {
        match e {
            Event::Token { id, token, .. } => out
                .entry(id)
                .or_insert((Vec::new(), FinishReason::Abort))
                .0
                .push(token),
            Event::Finished { id, reason, .. } => {
                let e = out.entry(id).or_insert((Vec::new(), FinishReason::Abort));
                assert_eq!(e.1, FinishReason::Abort, "request {id} finished twice");
                e.1 = reason;
            }
            Event::PromptLogprob { .. } => {}
        }
    }
    out
}

/// Asserts the pool and the slots are all back.
pub fn assert_pool_full<B: Backend>(engine: &LocalEngine<B>) {
    let s = engine.stats();
    assert_eq!(s.pool.free, s.pool.total, "pool not back to full: {s:?}");
    assert_eq!(s.slots_retired, 0, "slots still retired: {s:?}");
    assert_eq!((s.running, s.waiting, s.inflight), (0, 0, 0), "{s:?}");
}

/// Prompts of mixed lengths (token ids), deterministic.
pub fn filler_prompts(n: usize) -> Vec<Vec<u32>> {
    (0..n)
        .map(|i| {
            let len = 1 + (i * 7) % 40;
            let mut p = vec![1u32];
            p.extend((0..len).map(|j| 3 + ((i * 31 + j * 17) % 500) as u32));
            p
        })
        .collect()
}

/// The scheduler and a CPU worker whose reports reach the scheduler late (DESIGN.md sections 3
/// and 4): the scheduler learns completion `s` only once `completion_lag` later launches are
/// published, and release `s` only once `release_lag` later completions were reported (or when
/// nothing else can move). The worker either executes each launch when it is published
/// (`execute_late == false`) or lags behind the scheduler, executing launch `s` just before
/// reporting its completion, reading the token and block tables as they are then.
pub mod delayed {
    use baton_model::load_model_dir;
    use baton_proto::{Completion, Launch, LaunchSeq};
    use baton_scheduler::{Event, NewRequest, Scheduler, SchedulerConfig, Tracer};
    use baton_worker::{Backend, CpuBackend};
    use std::collections::{HashMap, VecDeque};

    /// When the worker's reports reach the scheduler.
    #[derive(Clone, Copy, Debug)]
    pub struct Delays {
        /// Completion `s` is reported once launch `s + completion_lag` is published.
        pub completion_lag: u64,
        /// Release `s` is reported once completion `s + release_lag` was reported.
        pub release_lag: u64,
        /// Execute launch `s` only when its completion is reported, not when it is published.
        pub execute_late: bool,
    }

    /// Counts of one run.
    #[derive(Clone, Copy, Debug, Default)]
    pub struct DelayedStats {
        /// Most launches published and not reported complete at once.
        pub max_unreported: usize,
    }

    /// Scheduler and delayed CPU worker in one thread.
    pub struct DelayedEngine {
        pub sched: Scheduler,
        backend: CpuBackend,
        delays: Delays,
        /// Published, not executed yet (only when `execute_late`).
        unexecuted: VecDeque<Launch>,
        /// Executed (or to execute), completion not reported yet, oldest first.
        unreported: VecDeque<(LaunchSeq, Option<Completion>)>,
        /// Reported complete, release not reported yet.
        unreleased: VecDeque<LaunchSeq>,
        last_completed: LaunchSeq,
        pub stats: DelayedStats,
        /// Cancel request `id` (its client disconnects) once it has this many tokens.
        pub cancel_at: HashMap<u64, usize>,
        tokens: HashMap<u64, usize>,
    }

    impl DelayedEngine {
        /// An engine on the test model.
        pub fn new(cfg: SchedulerConfig, delays: Delays) -> Self {
            let loaded = load_model_dir(super::model_dir()).expect("test model loads");
            Self::on(loaded.into_cpu_model().0, cfg, delays)
        }

        /// An engine on `model`.
        fn on(model: baton_model::CpuModel, cfg: SchedulerConfig, delays: Delays) -> Self {
            let backend = CpuBackend::new(model, cfg.num_blocks, cfg.block_size);
            let sched = Scheduler::new_local(cfg, backend.vocab_size());
            Self {
                sched,
                backend,
                delays,
                unexecuted: VecDeque::new(),
                unreported: VecDeque::new(),
                unreleased: VecDeque::new(),
                last_completed: 0,
                stats: DelayedStats::default(),
                cancel_at: HashMap::new(),
                tokens: HashMap::new(),
            }
        }

        /// An engine on the test model run with a sliding window of `window` keys on every
        /// layer (as a Mistral), whose scheduler releases pages out of the window early only
        /// when `release` ([`SchedulerConfig::kv_window`]).
        pub fn windowed(
            mut cfg: SchedulerConfig,
            delays: Delays,
            window: usize,
            release: bool,
        ) -> Self {
            let mut loaded = load_model_dir(super::model_dir()).expect("test model loads");
            let layers = loaded.config.num_hidden_layers;
            loaded.config.sliding_window = vec![Some(window); layers];
            cfg.kv_window = release.then_some(window);
            Self::on(loaded.into_cpu_model().0, cfg, delays)
        }

        /// Writes the lifecycle trace to `tracer`.
        pub fn set_tracer(&mut self, tracer: Tracer) {
            self.sched.set_tracer(tracer);
        }

        fn execute(&mut self, l: &Launch) -> Completion {
            self.backend
                .execute(l, self.sched.tables().as_ref())
                .expect("launch executes")
        }

        fn report_completion(&mut self, events: &mut Vec<Event>) {
            let (seq, done) = self.unreported.pop_front().expect("a completion to report");
            let c = match done {
                Some(c) => c,
                None => {
                    let l = self.unexecuted.pop_front().expect("unexecuted launch");
                    assert_eq!(l.seq, seq);
                    self.execute(&l)
                }
            };
            let from = events.len();
            assert!(self.sched.on_completion(&c, events), "completion {seq}");
            self.last_completed = seq;
            self.unreleased.push_back(seq);
            for i in from..events.len() {
                if let Event::Token { id, .. } = events[i] {
                    let n = self.tokens.entry(id).or_default();
                    *n += 1;
                    if self.cancel_at.get(&id) == Some(n) {
                        self.sched.cancel(id, events);
                    }
                }
            }
        }

        fn report_release(&mut self, upto: LaunchSeq) {
            while self.unreleased.front().is_some_and(|&s| s <= upto) {
                self.unreleased.pop_front();
            }
            self.sched.on_released(upto);
        }

        /// Admits every request and runs until all have finished; returns the events.
        pub fn run(&mut self, reqs: Vec<NewRequest>) -> Vec<Event> {
            for r in reqs {
                self.sched.add_request(r).expect("admitted");
            }
            let mut events = Vec::new();
            loop {
                let mut moved = false;
                while let Some(l) = self.sched.schedule() {
                    moved = true;
                    if self.delays.execute_late {
                        self.unreported.push_back((l.seq, None));
                        self.unexecuted.push_back(l);
                    } else {
                        let c = self.execute(&l);
                        self.unreported.push_back((l.seq, Some(c)));
                    }
                    self.stats.max_unreported =
                        self.stats.max_unreported.max(self.unreported.len());
                }
                let last = self.sched.last_launch();
                if let Some(&(s, _)) = self.unreported.front() {
                    if s + self.delays.completion_lag <= last {
                        self.report_completion(&mut events);
                        moved = true;
                    }
                }
                if let Some(&s) = self.unreleased.front() {
                    if s + self.delays.release_lag <= self.last_completed {
                        self.report_release(s);
                        moved = true;
                    }
                }
                if moved {
                    continue;
                }
                // Nothing is due and nothing can be published: the oldest report arrives.
                if !self.unreported.is_empty() {
                    self.report_completion(&mut events);
                } else if !self.unreleased.is_empty() {
                    self.report_release(self.last_completed);
                } else if self.sched.is_idle() {
                    break;
                } else {
                    panic!("stalled: {:?}", self.sched.stats());
                }
            }
            self.sched.flush_trace();
            events
        }
    }

    /// The goldens (ids `0..`, 64 greedy tokens) interleaved among `fillers` mixed prompts
    /// (ids `100..`), as in golden.rs.
    pub fn golden_requests(fillers: usize) -> Vec<NewRequest> {
        use baton_proto::SamplingParams;
        let mut reqs = Vec::new();
        for (i, p) in super::filler_prompts(fillers).into_iter().enumerate() {
            reqs.push(super::request(
                100 + i as u64,
                p,
                24 + (i as u32 % 5) * 9,
                SamplingParams::greedy(),
            ));
        }
        for (i, g) in super::goldens().iter().enumerate() {
            let at = (i * 7).min(reqs.len());
            let r = super::request(i as u64, g.prompt_ids.clone(), 64, SamplingParams::greedy());
            reqs.insert(at, r);
        }
        reqs
    }

    /// [`golden_requests`] where a third of the fillers stop on the goldens' most frequent token
    /// (so they finish with later launches in flight) and another third's clients disconnect
    /// after 5 tokens.
    pub fn golden_mix(engine: &mut DelayedEngine, fillers: usize) -> Vec<NewRequest> {
        let mut freq = HashMap::new();
        for t in super::goldens().iter().flat_map(|g| g.greedy_ids.clone()) {
            *freq.entry(t).or_insert(0) += 1;
        }
        let common = freq.into_iter().max_by_key(|&(t, n)| (n, t)).unwrap().0;
        let mut reqs = golden_requests(fillers);
        for r in reqs.iter_mut().filter(|r| r.id >= 100) {
            match r.id % 3 {
                0 => drop(engine.cancel_at.insert(r.id, 5)),
                1 => r.stop_token_ids = vec![common],
                _ => {}
            }
        }
        reqs
    }
}

/// One prompt position's log-probability: `(pos, token, logprob, top, rank)`.
pub type PromptEntry = (u32, u32, f32, Vec<(u32, f32)>, u32);

/// The prompt log-probabilities among `events`, by request, in arrival order.
pub fn prompt_logprobs(events: &[Event]) -> HashMap<u64, Vec<PromptEntry>> {
    let mut out: HashMap<u64, Vec<PromptEntry>> = HashMap::new();
    for e in events {
        if let Event::PromptLogprob {
            id,
            pos,
            token,
            logprob,
            rank,
            top,
        } = e
        {
            out.entry(*id)
                .or_default()
                .push((*pos, *token, *logprob, top.clone(), *rank));
        }
    }
    out
}

/// A temporary copy of the test model as a Mixtral (`MixtralForCausalLM`, 4 experts, top 2)
/// whose experts are each a copy of its MLP, under a fixed pseudo-random router per layer
/// (uniform in [-1, 1)), with its tokenizer and golden.json, under `tag`. Mixtral
/// renormalizes each token's two routing weights to sum to 1, so the model computes the dense
/// model's function up to rounding: the goldens hold for it, through every part of the
/// mixture-of-experts path (the experts loaded by Mixtral's names, routing, grouping, the
/// weighted sum).
pub fn mixtral_copy(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("baton-test-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for f in std::fs::read_dir(model_dir()).unwrap() {
        let f = f.unwrap().path();
        if f.extension().is_some_and(|e| e == "json") {
            std::fs::copy(&f, dir.join(f.file_name().unwrap())).unwrap();
        }
    }
    let path = dir.join("config.json");
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    c["model_type"] = "mixtral".into();
    c["architectures"] = serde_json::json!(["MixtralForCausalLM"]);
    c["num_local_experts"] = 4.into();
    c["num_experts_per_tok"] = 2.into();
    std::fs::write(&path, c.to_string()).unwrap();
    let (experts, hidden) = (4usize, c["hidden_size"].as_u64().unwrap() as usize);
    let layers = c["num_hidden_layers"].as_u64().unwrap() as usize;
    let bytes = std::fs::read(model_dir().join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let routers: Vec<Vec<u8>> = (0..layers)
        .map(|_| {
            (0..experts * hidden)
                .flat_map(|_| {
                    state = state
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    let x = ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0;
                    x.to_le_bytes()
                })
                .collect()
        })
        .collect();
    let mut views = Vec::new();
    for (name, view) in st.tensors() {
        let expert = name.strip_prefix("model.layers.").and_then(|rest| {
            let (layer, part) = rest.split_once('.')?;
            let w = match part {
                "mlp.gate_proj.weight" => "w1",
                "mlp.up_proj.weight" => "w3",
                "mlp.down_proj.weight" => "w2",
                _ => return None,
            };
            Some((layer.to_string(), w))
        });
        match expert {
            None => views.push((name, view)),
            Some((layer, w)) => {
                for e in 0..experts {
                    let n = format!("model.layers.{layer}.block_sparse_moe.experts.{e}.{w}.weight");
                    views.push((n, view.clone()));
                }
            }
        }
    }
    for (i, r) in routers.iter().enumerate() {
        let n = format!("model.layers.{i}.block_sparse_moe.gate.weight");
        let v =
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![experts, hidden], r)
                .unwrap();
        views.push((n, v));
    }
    std::fs::write(
        dir.join("model.safetensors"),
        safetensors::serialize(views, None).unwrap(),
    )
    .unwrap();
    dir
}
