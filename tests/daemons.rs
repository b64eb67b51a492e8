//! Multi-process tests of `baton scheduler` and `baton worker` over the shared-memory control
//! plane, driven by a test client in a frontend slot (DESIGN.md sections 1 to 6).

mod support;

use baton_proto::wire::reason;
use baton_proto::SamplingParams;
use nix::sys::signal::Signal;
use std::path::Path;
use std::time::Duration;
use support::*;

const T: Duration = Duration::from_secs(120);

fn greedy_reqs(prompts: &[Vec<u32>], max_tokens: u32) -> Vec<Req> {
    prompts
        .iter()
        .enumerate()
        .map(|(i, p)| Req {
            id: i as u64,
            prompt: p.clone(),
            max_tokens,
            params: SamplingParams::greedy(),
            stop_token_ids: vec![],
            logit_bias: vec![],
            cache_salt: 0,
            constraint: vec![],
            guide_after: None,
            priority: 0,
            bad_words: vec![],
        })
        .collect()
}

fn shm_path(instance: &str) -> std::path::PathBuf {
    Path::new("/dev/shm").join(format!("baton-{instance}"))
}

fn shm_leftovers(instance: &str) -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.contains(instance))
                .collect()
        })
        .unwrap_or_default()
}

fn goldens_match_across_processes(async_flag: &str) {
    let inst = instance(&format!("golden{async_flag}"));
    let _s = scheduler(&inst, &["--num-blocks", "64", async_flag]);
    let _w = worker(&inst);
    let mut link = connect(&inst);
    let g = goldens();
    let prompts: Vec<_> = g.iter().map(|(p, _)| p.clone()).collect();
    let outs = run(&mut link, &greedy_reqs(&prompts, 64), T);
    for (i, (_, want)) in g.iter().enumerate() {
        assert_eq!(
            &outs[&(i as u64)].tokens,
            want,
            "golden {i} differs across processes ({async_flag})"
        );
        assert_eq!(outs[&(i as u64)].reason, reason::LENGTH);
    }
    // Each prompt followed by its first 32 greedy tokens, on the same instance: the full blocks
    // of that history, registered by the first round's decodes, now come from the prefix
    // cache, and the continuation is the rest of the golden.
    let hits = link.stats().prefix_cache_hits;
    let longer: Vec<_> = g
        .iter()
        .map(|(p, want)| [&p[..], &want[..32]].concat())
        .collect();
    let mut again = greedy_reqs(&longer, 32);
    for r in &mut again {
        r.id += 100;
    }
    let outs = run(&mut link, &again, T);
    for (i, (_, want)) in g.iter().enumerate() {
        assert_eq!(
            &outs[&(100 + i as u64)].tokens[..],
            &want[32..],
            "golden {i} differs with its history from the prefix cache ({async_flag})"
        );
    }
    let s = link.stats();
    assert!(s.prefix_cache_hits > hits, "no prefix-cache hit: {s:?}");
    // The same histories under a cache salt: the salt travels in the admission and keeps
    // them off the unsalted blocks; the outputs are unchanged.
    for r in &mut again {
        r.id += 1000;
        r.cache_salt = 7;
    }
    let outs = run(&mut link, &again, T);
    for (i, (_, want)) in g.iter().enumerate() {
        assert_eq!(&outs[&(1100 + i as u64)].tokens[..], &want[32..]);
    }
    assert_eq!(
        link.stats().prefix_cache_hits,
        s.prefix_cache_hits,
        "a salted request hit unsalted blocks"
    );

    // Penalized greedy requests: the worker penalizes from the token table it shares with the
    // scheduler (and, with asynchronous scheduling, the pending id it kept); the result equals
    // the in-process engine's, which `crates/cli/tests/penalties.rs` checks against a dense
    // oracle.
    let mut penalized = greedy_reqs(&prompts, 48);
    for (i, r) in penalized.iter_mut().enumerate() {
        r.id += 200;
        r.params.presence_penalty = [0.8, -2.0, 0.0][i % 3];
        r.params.frequency_penalty = [0.3, -1.0, 0.0][i % 3];
        r.params.repetition_penalty = [1.0, 1.0, 1.4][i % 3];
        // A logit bias travels in the admission, the scheduler writes it into the slot's
        // row of the shared logit-bias table, and the worker reads it there.
        if i % 2 == 0 {
            r.logit_bias = vec![(g[i].1[0], -100.0), (300, 3.0)];
            r.params.logit_bias_len = 2;
        }
        // allowed_token_ids: the same entries, as an allow-list.
        if i % 3 == 1 {
            r.logit_bias = vec![(261, 0.0), (300, 1.0), (403, 0.0), (g[i].1[1], 0.5)];
            r.logit_bias.sort_by_key(|e| e.0);
            r.logit_bias.dedup_by_key(|e| e.0);
            r.params.logit_bias_len = r.logit_bias.len() as u32;
            r.params.allowed_only = 1;
        }
    }
    let outs = run(&mut link, &penalized, T);
    let want = in_process(&penalized);
    for r in &penalized {
        assert_eq!(
            outs[&r.id].tokens, want[&r.id],
            "penalized request {} differs across processes ({async_flag})",
            r.id
        );
        if r.params.allowed_only != 0 {
            assert!(
                outs[&r.id]
                    .tokens
                    .iter()
                    .all(|t| r.logit_bias.iter().any(|e| e.0 == *t)),
                "request {} left its allow-list",
                r.id
            );
        }
    }
    assert!(
        penalized
            .iter()
            .zip(&g)
            .any(|(r, (_, gold))| outs[&r.id].tokens[..] != gold[..48]),
        "the penalties changed no output"
    );

    // Prompt log-probabilities travel worker -> scheduler -> frontend in slots of their own.
    // The longer histories' full blocks are in the prefix cache by now; a request that wants
    // them computes its whole prompt anyway, and gets every position as the in-process engine
    // scores it.
    // Every other one with `max_tokens: 0`: it computes the prompt and ends with no output.
    let mut scored = greedy_reqs(&longer, 4);
    for (i, r) in scored.iter_mut().enumerate() {
        r.id += 300;
        r.params.prompt_logprobs = 1 + 3;
        if i % 2 == 1 {
            r.max_tokens = 0;
        }
    }
    let before = link.stats();
    let outs = run(&mut link, &scored, T);
    let want = in_process_prompt_logprobs(&scored);
    for r in &scored {
        let got = &outs[&r.id].prompt;
        let want = &want[&r.id];
        assert_eq!(got.len(), r.prompt.len() - 1, "request {}", r.id);
        assert_eq!(outs[&r.id].reason, reason::LENGTH, "request {}", r.id);
        assert_eq!(
            outs[&r.id].tokens.len(),
            r.max_tokens as usize,
            "request {}",
            r.id
        );
        assert_eq!(got.len(), want.len(), "request {}", r.id);
        for (k, (g, w)) in got.iter().zip(want).enumerate() {
            assert_eq!(
                (g.0, g.1),
                (k as u32 + 1, r.prompt[k + 1]),
                "request {}",
                r.id
            );
            assert_eq!((g.0, g.1, &g.3), (w.0, w.1, &w.3), "request {}", r.id);
            assert!((g.2 - w.2).abs() < 1e-5, "request {}: {g:?} vs {w:?}", r.id);
        }
    }
    let after = link.stats();
    assert_eq!(
        after.prefix_cache_hits, before.prefix_cache_hits,
        "a request owed prompt log-probabilities took blocks from the prefix cache"
    );
    assert_eq!(
        after.prefix_cache_queries, before.prefix_cache_queries,
        "a request that makes no lookup counted as prefix-cache queries"
    );

    // Structured outputs: the constraint crosses the admission ring as bytes, the scheduler
    // daemon compiles it against the model's tokenizer and writes each row's token mask into
    // the shared table, and the worker applies it. Greedy and seeded-sampled, the tokens equal
    // the in-process engine's, and they are not the unconstrained ones.
    let constraints = [
        baton_grammar::Constraint::Regex("[0-9]{3}-[0-9]{4}".into()),
        baton_grammar::Constraint::Choice(vec!["Lily and Ben".into(), "a big red ball".into()]),
    ];
    let mut guided = greedy_reqs(&prompts, 40);
    let free = in_process(&greedy_reqs(&prompts, 40));
    for (i, r) in guided.iter_mut().enumerate() {
        r.id += 400;
        r.constraint = constraints[i % 2].to_wire();
        r.stop_token_ids = vec![2];
        if i % 3 == 2 {
            r.params.temperature = 0.9;
            r.params.seed = 11 + i as u64;
        }
        // The second (a choice, greedy) after its 4th free token, as after a reasoning's
        // `</think>` (`FLAG_GUIDE_AFTER` on the wire): its first tokens are the free ones.
        if i == 1 {
            r.params = SamplingParams::greedy();
            r.guide_after = Some(free[&(i as u64)][3]);
        }
    }
    let outs = run(&mut link, &guided, T);
    let want = in_process(&guided);
    for (i, r) in guided.iter().enumerate() {
        assert_eq!(
            outs[&r.id].tokens, want[&r.id],
            "guided request {} ({async_flag})",
            r.id
        );
        assert_eq!(outs[&r.id].reason, reason::STOP, "guided request {}", r.id);
        if let Some(t) = r.guide_after {
            // Free (greedy, as unconstrained) up to and including the token that wakes the
            // guide.
            let f = &free[&(i as u64)];
            let p = f.iter().position(|&x| x == t).unwrap();
            assert_eq!(outs[&r.id].tokens[..=p], f[..=p], "guided request {}", r.id);
        }
        assert_ne!(
            outs[&r.id].tokens,
            free[&(i as u64)],
            "guided request {}",
            r.id
        );
    }

    // vLLM's `bad_words` cross the admission ring after the constraint, and the scheduler
    // daemon writes each row's ban into the shared mask table. The first request is guided
    // too, with its guided first token banned: the ban and the guide's mask combine.
    let guided_first = outs[&guided[0].id].tokens[0];
    let mut banned = greedy_reqs(&prompts, 40);
    for (i, r) in banned.iter_mut().enumerate() {
        r.id += 500;
        r.stop_token_ids = vec![2];
        let f = &free[&(i as u64)];
        r.bad_words = vec![vec![f[2], f[3]], vec![f[6]]];
        if i == 0 {
            r.constraint = guided[0].constraint.clone();
            r.bad_words.push(vec![guided_first]);
        }
    }
    let outs = run(&mut link, &banned, T);
    let want = in_process(&banned);
    for (i, r) in banned.iter().enumerate() {
        let got = &outs[&r.id].tokens;
        assert_eq!(got, &want[&r.id], "request {} ({async_flag})", r.id);
        for w in &r.bad_words {
            assert!(
                !got.windows(w.len()).any(|x| x == &w[..]),
                "request {} generated the bad word {w:?}: {got:?}",
                r.id
            );
        }
        assert_ne!(got, &free[&(i as u64)], "request {}", r.id);
    }
    assert!(
        wait_for(Duration::from_secs(5), || link.stats().pages_used == 0),
        "pool not back to full: {:?}",
        link.stats()
    );
}

/// The tokens of `reqs` from the in-process engine on the CPU backend (no EOS ids: over the
/// ring only `stop_token_ids` stop a request).
fn in_process(reqs: &[Req]) -> std::collections::HashMap<u64, Vec<u32>> {
    let mut out: std::collections::HashMap<u64, Vec<u32>> = Default::default();
    for e in in_process_events(reqs) {
        if let baton_scheduler::Event::Token { id, token, .. } = e {
            out.entry(id).or_default().push(token);
        }
    }
    out
}

/// [`in_process`]'s prompt log-probabilities, as `support::Out::prompt` holds them (the rank
/// after the top ids).
#[allow(clippy::type_complexity)]
fn in_process_prompt_logprobs(
    reqs: &[Req],
) -> std::collections::HashMap<u64, Vec<(u32, u32, f32, Vec<u32>)>> {
    let mut out: std::collections::HashMap<u64, Vec<_>> = Default::default();
    for e in in_process_events(reqs) {
        if let baton_scheduler::Event::PromptLogprob {
            id,
            pos,
            token,
            logprob,
            rank,
            top,
        } = e
        {
            let mut ids: Vec<u32> = top.iter().map(|t| t.0).collect();
            ids.push(rank);
            out.entry(id).or_default().push((pos, token, logprob, ids));
        }
    }
    out
}

/// The events of `reqs` on the in-process engine (see [`in_process`]).
fn in_process_events(reqs: &[Req]) -> Vec<baton_scheduler::Event> {
    let cfg = baton_scheduler::SchedulerConfig {
        max_num_seqs: 64,
        max_num_batched_tokens: 256,
        block_size: 16,
        num_blocks: 256,
        max_model_len: 512,
        max_inflight: 2,
        enable_prefix_caching: true,
        policy: baton_scheduler::SchedulingPolicy::Fcfs,
        kv_window: None,
    };
    let (model, _) = baton_model::load_model_dir(model_dir())
        .expect("test model loads")
        .into_cpu_model();
    let backend = baton_worker::CpuBackend::new(model, cfg.num_blocks, cfg.block_size);
    let mut engine = baton::engine::LocalEngine::new(cfg, backend);
    for r in reqs {
        engine
            .add_request(baton_scheduler::NewRequest {
                priority: r.priority,
                id: r.id,
                prompt: r.prompt.clone(),
                max_tokens: r.max_tokens,
                params: r.params,
                eos_ids: Vec::new(),
                stop_token_ids: r.stop_token_ids.clone(),
                ignore_eos: false,
                logit_bias: r.logit_bias.clone(),
                min_tokens: 0,
                cache_salt: 0,
                guide: (!r.constraint.is_empty()).then(|| {
                    let v = baton_grammar::Vocabulary::from_tokenizer_json(
                        &model_dir().join("tokenizer.json"),
                        512,
                        &[2],
                    )
                    .expect("the test model's vocabulary");
                    let g = v
                        .compile(&baton_grammar::Constraint::from_wire(&r.constraint).unwrap())
                        .expect("the constraint compiles");
                    match r.guide_after {
                        Some(t) => g.start_after(t),
                        None => g,
                    }
                }),
                bad_words: r.bad_words.clone(),
                lora: 0,
            })
            .expect("admitted");
    }
    let mut events = Vec::new();
    engine.run_until_idle(&mut events).expect("runs");
    events
}

#[test]
fn goldens_match_across_processes_with_async_scheduling() {
    let _serial = serial();
    goldens_match_across_processes("--async-scheduling");
}

#[test]
fn goldens_match_across_processes_without_async_scheduling() {
    let _serial = serial();
    goldens_match_across_processes("--no-async-scheduling");
}

#[test]
fn trace_of_200_mixed_requests_passes_the_checker() {
    let _serial = serial();
    let inst = instance("trace200");
    let trace = std::env::temp_dir().join(format!("{inst}.trace.jsonl"));
    let mut s = scheduler(
        &inst,
        &[
            "--num-blocks",
            "96",
            "--max-num-seqs",
            "32",
            "--trace",
            trace.to_str().unwrap(),
        ],
    );
    let _w = worker(&inst);
    let mut link = connect(&inst);
    let prompts = mixed_prompts(200, 5);
    let mut reqs = greedy_reqs(&prompts, 24);
    for (i, r) in reqs.iter_mut().enumerate() {
        r.max_tokens = 8 + (i as u32 % 5) * 8;
        if i % 3 == 0 {
            // Frequent tokens as stop ids: these requests end on a stop token, often while
            // their next launch is already in flight.
            r.stop_token_ids = vec![261, 262, 263, 264, 265, 266, 267, 268, 269, 270];
        }
        if i % 4 == 1 {
            r.params = SamplingParams {
                temperature: 0.8,
                top_p: 0.9,
                seed: i as u64,
                ..SamplingParams::greedy()
            };
        }
    }
    let outs = run(&mut link, &reqs, T);
    assert_eq!(outs.len(), 200);
    assert!(outs
        .values()
        .all(|o| o.finishes == 1 && o.reason != u32::MAX));
    assert!(
        outs.values().any(|o| o.reason == reason::STOP),
        "no request stopped on a stop token"
    );
    assert!(
        wait_for(Duration::from_secs(5), || link.stats().pages_used == 0),
        "pool not back to full: {:?}",
        link.stats()
    );
    s.signal(Signal::SIGTERM);
    assert!(
        s.wait_timeout(Duration::from_secs(10)).is_some(),
        "scheduler ignored SIGTERM"
    );
    let f = std::fs::File::open(&trace).expect("trace written");
    let summary = baton_scheduler::check_trace(std::io::BufReader::new(f))
        .unwrap_or_else(|v| panic!("trace violates an invariant: {v}"));
    assert!(summary.membership_changes > 0, "{summary:?}");
    assert!(
        summary.finished_with_launch_in_flight > 0,
        "no request finished while its next launch was in flight: {summary:?}"
    );
    let _ = std::fs::remove_file(&trace);
}

#[test]
fn cancel_right_after_launch_publishes_nothing_after_it_and_reclaims_after_the_fence() {
    let _serial = serial();
    let inst = instance("cancel");
    let trace = std::env::temp_dir().join(format!("{inst}.trace.jsonl"));
    let mut s = scheduler(
        &inst,
        &["--num-blocks", "64", "--trace", trace.to_str().unwrap()],
    );
    let _w = worker(&inst);
    let mut link = connect(&inst);
    let prompt = mixed_prompts(1, 3).remove(0);
    let r = Req {
        id: 42,
        prompt,
        max_tokens: 400,
        params: SamplingParams::greedy(),
        stop_token_ids: vec![],
        logit_bias: vec![],
        cache_salt: 0,
        constraint: vec![],
        guide_after: None,
        priority: 0,
        bad_words: vec![],
    };
    submit(&mut link, &r);
    // Wait until a launch includes it, then cancel at once.
    let launches = link.stats().launches;
    assert!(wait_for(Duration::from_secs(10), || link.stats().launches > launches));
    link.cancel(42, Duration::from_secs(1)).unwrap();
    let outs = collect(&mut link, 1, T, |_, _| {});
    assert_eq!(outs[&42].reason, reason::CANCELLED);
    assert!(outs[&42].tokens.len() < 400);
    assert!(
        wait_for(Duration::from_secs(5), || link.stats().pages_used == 0),
        "pool not back to full: {:?}",
        link.stats()
    );
    s.signal(Signal::SIGTERM);
    assert!(s.wait_timeout(Duration::from_secs(10)).is_some());
    // The trace shows the cancel after a launch that included the request, nothing published
    // after it, and its pages reclaimed only after that launch's release (the checker).
    let text = std::fs::read_to_string(&trace).unwrap();
    baton_scheduler::check_trace(text.as_bytes()).unwrap_or_else(|v| panic!("{v}"));
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let cancel_at = lines
        .iter()
        .position(|l| l["boundary"] == "cancel")
        .expect("cancel in trace");
    let last_launch = lines[..cancel_at]
        .iter()
        .filter(|l| l["boundary"] == "batch_preparation")
        .map(|l| l["launch"].as_u64().unwrap())
        .max()
        .expect("a launch included the request before the cancel");
    assert!(!lines[cancel_at..]
        .iter()
        .any(|l| l["boundary"] == "publication"));
    let retire = lines[cancel_at..]
        .iter()
        .find(|l| l["boundary"] == "retire")
        .expect("pages retired");
    assert_eq!(
        retire["launch"].as_u64(),
        Some(last_launch),
        "pages must be retired after the last launch that referred to them"
    );
    let _ = std::fs::remove_file(&trace);
}

#[test]
fn killing_the_worker_mid_run_loses_nothing_and_greedy_outputs_are_unchanged() {
    let _serial = serial();
    let prompts = mixed_prompts(50, 11);
    let reqs = greedy_reqs(&prompts, 40);
    // Reference: an uninterrupted run.
    let reference = {
        let inst = instance("killref");
        let _s = scheduler(&inst, &["--num-blocks", "256"]);
        let _w = worker(&inst);
        let mut link = connect(&inst);
        run(&mut link, &reqs, T)
    };
    let inst = instance("kill");
    let _s = scheduler(&inst, &["--num-blocks", "256"]);
    let mut w = Some(worker(&inst));
    let mut link = connect(&inst);
    for r in &reqs {
        submit(&mut link, r);
    }
    let mut replacement = None;
    let outs = collect(&mut link, reqs.len(), T, |tokens, _| {
        if tokens == 300 {
            if let Some(mut old) = w.take() {
                old.signal(Signal::SIGKILL);
                old.wait_timeout(Duration::from_secs(5));
                replacement = Some(worker(&inst));
            }
        }
    });
    assert!(replacement.is_some(), "the worker was never killed");
    assert_eq!(outs.len(), 50, "a request was lost");
    for (id, o) in &outs {
        assert_eq!(o.finishes, 1, "request {id} finished {} times", o.finishes);
        assert_eq!(
            o.tokens, reference[id].tokens,
            "request {id} differs from the uninterrupted run"
        );
    }
    assert!(
        wait_for(Duration::from_secs(5), || link.stats().pages_used == 0),
        "pool not back to full: {:?}",
        link.stats()
    );
}

#[test]
fn sigterm_leaves_nothing_in_dev_shm_and_sigkill_leaves_a_restartable_instance() {
    let _serial = serial();
    let inst = instance("restart");
    let mut s = scheduler(&inst, &["--num-blocks", "32"]);
    assert!(wait_for(Duration::from_secs(10), || shm_path(&inst).exists()));
    s.signal(Signal::SIGTERM);
    assert!(s
        .wait_timeout(Duration::from_secs(10))
        .is_some_and(|st| st.success()));
    assert!(
        shm_leftovers(&inst).is_empty(),
        "left behind: {:?}",
        shm_leftovers(&inst)
    );

    let mut s = scheduler(&inst, &["--num-blocks", "32"]);
    assert!(wait_for(Duration::from_secs(10), || shm_path(&inst).exists()));
    s.signal(Signal::SIGKILL);
    s.wait_timeout(Duration::from_secs(5));
    assert!(
        shm_path(&inst).exists(),
        "a SIGKILLed scheduler cannot clean up; the next start must"
    );
    let mut s2 = scheduler(&inst, &["--num-blocks", "32"]);
    let _w = worker(&inst);
    let mut link = connect(&inst);
    let g = goldens();
    let outs = run(&mut link, &greedy_reqs(&[g[0].0.clone()], 8), T);
    assert_eq!(outs[&0].tokens, g[0].1[..8]);
    drop(link);
    s2.signal(Signal::SIGTERM);
    assert!(s2.wait_timeout(Duration::from_secs(10)).is_some());
    assert!(
        shm_leftovers(&inst).is_empty(),
        "left behind: {:?}",
        shm_leftovers(&inst)
    );
}

/// A scheduler stopped by SIGTERM ends every live request with the shutdown error (the frontend
/// turns it into a 503 or an error event), never with an ordinary finish a client could take
/// for a whole answer; requests that completed before keep their normal finish.
#[test]
fn a_scheduler_stopped_by_sigterm_ends_live_requests_with_the_shutdown_error() {
    let _serial = serial();
    let inst = instance("sigterm-live");
    let mut s = scheduler(&inst, &["--num-blocks", "256"]);
    let _w = worker(&inst);
    let mut link = connect(&inst);
    let reqs = greedy_reqs(&mixed_prompts(32, 5), 400);
    for r in &reqs {
        submit(&mut link, r);
    }
    let outs = collect(&mut link, reqs.len(), T, |n, _| {
        if n == 1 {
            s.signal(Signal::SIGTERM);
        }
    });
    let shut = outs
        .values()
        .filter(|o| o.error == Some(baton_proto::wire::error::SHUTDOWN))
        .count();
    assert!(shut > 0, "no request saw the shutdown error");
    for (id, o) in &outs {
        assert!(
            o.error == Some(baton_proto::wire::error::SHUTDOWN) || o.reason == reason::LENGTH,
            "request {id} ended with reason {} / error {:?}",
            o.reason,
            o.error
        );
    }
    assert!(s.wait_timeout(Duration::from_secs(10)).is_some());
}

/// A scheduler SIGKILLed between creating its segment file and publishing the magic leaves a
/// zeroed file with no lock holder; the next scheduler must wait it out (it is taken as stale
/// once 2 s old) and start, not fail as "initialising" and leave the instance unusable. (CI
/// hit this in the restart test above when the kill landed inside the creation.)
#[test]
fn a_scheduler_starts_over_the_half_made_segment_of_one_killed_while_creating_it() {
    let _serial = serial();
    let inst = instance("halfmade");
    std::fs::write(shm_path(&inst), vec![0u8; 8192]).unwrap();
    let mut s = scheduler(&inst, &["--num-blocks", "32"]);
    let _w = worker(&inst);
    let mut link = connect(&inst);
    let g = goldens();
    let outs = run(&mut link, &greedy_reqs(&[g[0].0.clone()], 4), T);
    assert_eq!(outs[&0].tokens, g[0].1[..4]);
    drop(link);
    s.signal(Signal::SIGTERM);
    assert!(s.wait_timeout(Duration::from_secs(10)).is_some());
    assert!(
        shm_leftovers(&inst).is_empty(),
        "left behind: {:?}",
        shm_leftovers(&inst)
    );
}

/// The segment carries the model's config fingerprint, its weights' fingerprint and its
/// tokenizer's: a worker or frontend started on a model of another shape (here one layer
/// fewer, same vocabulary), a worker with other weights of the same shape (dummy weights
/// against the checkpoint, or another dummy seed) or whose model computes fewer positions than
/// the scheduler serves, and a frontend with another tokenizer.json (two token ids swapped),
/// must refuse to attach instead of serving garbage or aborting requests midway, while a worker
/// with the scheduler's weights attaches.
#[test]
fn a_worker_or_frontend_on_another_model_or_other_weights_refuses_to_attach() {
    let _serial = serial();
    let inst = instance("fingerprint");
    let _s = scheduler(&inst, &["--num-blocks", "64"]);
    let other = edited_model_dir("fp-layers", |c| {
        let n = c["num_hidden_layers"].as_u64().unwrap();
        c["num_hidden_layers"] = (n - 1).into();
    });
    // `baton <cmd> --instance <inst> --model <dir>`: must exit non-zero, with `why` in its
    // message.
    let refused = |inst: &str, dir: &std::path::Path, cmd: &str, extra: &[&str], why: &str| {
        let mut args = vec![cmd, "--instance", inst, "--attach-timeout", "30"];
        if cmd == "scheduler" {
            args.truncate(3);
        }
        args.extend_from_slice(extra);
        let mut args: Vec<&std::ffi::OsStr> = args.iter().map(std::ffi::OsStr::new).collect();
        args.extend([std::ffi::OsStr::new("--model"), dir.as_os_str()]);
        let (st, err) = baton_to_exit(&args, Duration::from_secs(60));
        assert!(
            st.is_some_and(|s| !s.success()),
            "{cmd} {extra:?} on {} was not refused ({st:?}): {err}",
            dir.display()
        );
        assert!(err.contains(why), "{cmd} {extra:?}: {err}");
    };
    refused(
        &inst,
        &other,
        "worker",
        &["--load-format", "dummy"],
        "not the scheduler's",
    );
    refused(
        &inst,
        &other,
        "frontend",
        &["--port", "0"],
        "serves another model",
    );
    // Fewer positions than the scheduler's 512: the fingerprint leaves the length out.
    let short = edited_model_dir("fp-positions", |c| {
        c["max_position_embeddings"] = 256.into()
    });
    std::fs::copy(
        model_dir().join("model.safetensors"),
        short.join("model.safetensors"),
    )
    .expect("copy weights");
    refused(&inst, &short, "worker", &[], "max_position_embeddings");
    // The same config with two token ids swapped in tokenizer.json.
    let swapped = edited_model_dir("fp-tokenizer", |_| {});
    let tok = std::fs::read_to_string(swapped.join("tokenizer.json")).unwrap();
    let tok = tok
        .replacen("\"\u{2581}there\": 383", "\"\u{2581}there\": 432", 1)
        .replacen("\",\": 432", "\",\": 383", 1);
    assert!(
        tok.contains("\"\u{2581}there\": 432"),
        "the swap found its tokens"
    );
    std::fs::write(swapped.join("tokenizer.json"), tok).unwrap();
    refused(
        &inst,
        &swapped,
        "frontend",
        &["--port", "0"],
        "another tokenizer.json",
    );
    // The same, given as --tokenizer (vLLM's flag) beside the scheduler's model directory.
    let tok_flag = format!("--tokenizer={}", swapped.display());
    refused(
        &inst,
        &model_dir(),
        "frontend",
        &["--port", "0", &tok_flag],
        "another tokenizer.json",
    );

    // The same shape with other weights: random ones against the scheduler's checkpoint.
    let same = edited_model_dir("fp-same", |_| {});
    let dummy = |seed: &'static str| ["--load-format", "dummy", "--seed", seed];
    refused(&inst, &same, "worker", &dummy("0"), "weights (fingerprint");
    // The null backend samples a fixed token: never in place of the checkpoint's weights,
    // nor as other dummy weights.
    let null = ["--device", "null"];
    refused(
        &inst,
        &same,
        "worker",
        &null,
        "null backend computes nothing",
    );
    let null_dummy = ["--device", "null", "--load-format", "dummy", "--seed", "0"];
    refused(&inst, &same, "worker", &null_dummy, "weights (fingerprint");
    // A scheduler for a directory without safetensors needs to be told the workers' weights.
    let inst2 = instance("fingerprint-dummy");
    refused(
        &inst2,
        &same,
        "scheduler",
        &["--num-blocks", "64"],
        "--load-format dummy",
    );
    // Told dummy seed 7, it refuses seed 8 and takes seed 7.
    let _s2 = scheduler_on(
        &inst2,
        &same,
        &[
            "--num-blocks",
            "64",
            "--load-format",
            "dummy",
            "--seed",
            "7",
        ],
    );
    refused(&inst2, &same, "worker", &dummy("8"), "weights (fingerprint");
    let _w = worker_on(&inst2, &same, &dummy("7"));
    let _link = connect(&inst2);
    // A --seed without --load-format dummy would be ignored: refused.
    let inst3 = instance("fingerprint-seed");
    refused(
        &inst3,
        &same,
        "scheduler",
        &["--num-blocks", "64", "--seed", "3"],
        "needs --load-format dummy",
    );
    refused(
        &inst3,
        &same,
        "worker",
        &["--seed", "3"],
        "needs --load-format dummy",
    );
    // Without --model, a scheduler told dummy seed 4 still publishes that seed's fingerprint.
    let s4 = Proc {
        child: baton()
            .args([
                "scheduler",
                "--instance",
                &inst3,
                "--max-model-len",
                "512",
                "--num-blocks",
                "64",
            ])
            .args(["--load-format", "dummy", "--seed", "4"])
            .spawn()
            .expect("spawn scheduler"),
        name: "scheduler",
    };
    refused(&inst3, &same, "worker", &dummy("5"), "weights (fingerprint");
    let _w4 = worker_on(&inst3, &same, &["--load-format", "dummy", "--seed", "4"]);
    let _link4 = connect(&inst3);
    s4.signal(Signal::SIGTERM);
    for d in [other, same, short, swapped] {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// A worker reads only config.json and the weights (the scheduler and the frontends read the
/// tokenizer and generation_config.json): one whose directory has neither tokenizer.json,
/// tokenizer_config.json nor generation_config.json attaches and gives the goldens.
#[test]
fn a_worker_needs_only_the_weights_and_a_tokenizerless_scheduler_refuses_only_constraints() {
    let _serial = serial();
    let inst = instance("weights-only");
    let _s = scheduler(&inst, &["--num-blocks", "64"]);
    let dir = edited_model_dir("weights-only", |_| {});
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        let _ = std::fs::remove_file(dir.join(f));
    }
    std::fs::copy(
        model_dir().join("model.safetensors"),
        dir.join("model.safetensors"),
    )
    .expect("copy weights");
    let _w = worker_on(&inst, &dir, &[]);
    let mut link = connect(&inst);
    let g = goldens();
    let prompts: Vec<_> = g.iter().map(|(p, _)| p.clone()).collect();
    let outs = run(&mut link, &greedy_reqs(&prompts, 64), T);
    for (i, (_, want)) in g.iter().enumerate() {
        assert_eq!(&outs[&(i as u64)].tokens, want, "golden {i}");
    }

    // A scheduler on that directory has no tokenizer, so no grammar vocabulary: it serves
    // unconstrained requests, and ends a constrained one with `NO_GRAMMAR_VOCABULARY` (which
    // the frontend turns into a message naming `--tokenizer`), not with a generic refusal.
    let inst2 = instance("no-vocabulary");
    let _s2 = scheduler_on(&inst2, &dir, &["--num-blocks", "64"]);
    let _w2 = worker_on(&inst2, &dir, &[]);
    let mut link2 = connect(&inst2);
    let mut reqs = greedy_reqs(&prompts[..1], 64);
    let mut guided = reqs[0].clone();
    guided.id = 1;
    guided.constraint = baton_grammar::Constraint::Regex("[0-9]{3}".into()).to_wire();
    reqs.push(guided);
    let outs = run(&mut link2, &reqs, T);
    assert_eq!(outs[&0].tokens, g[0].1, "the unconstrained request");
    assert_eq!(
        outs[&1].error,
        Some(baton_proto::wire::error::NO_GRAMMAR_VOCABULARY),
        "the constrained request: {:?}",
        outs[&1]
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// The scheduler publishes the CPU KV cache dtype it sized its pool for: a worker given
/// another `--kv-cache-dtype` refuses to attach (it would hold twice or half the memory the
/// scheduler budgeted), naming both; a worker left on `auto` follows it and attaches.
#[test]
fn a_worker_given_another_kv_cache_dtype_than_the_schedulers_refuses_to_attach() {
    let _serial = serial();
    let inst = instance("kv-dtype");
    let _s = scheduler(&inst, &["--num-blocks", "64", "--kv-cache-dtype", "bf16"]);
    let dir = model_dir();
    let flags = [
        "worker",
        "--instance",
        &inst,
        "--attach-timeout",
        "30",
        "--kv-cache-dtype",
        "float32",
        "--model",
    ];
    let mut args: Vec<&std::ffi::OsStr> = flags.iter().map(std::ffi::OsStr::new).collect();
    args.push(dir.as_os_str());
    let (st, err) = baton_to_exit(&args, Duration::from_secs(60));
    assert!(
        st.is_some_and(|s| !s.success()),
        "not refused ({st:?}): {err}"
    );
    assert!(
        err.contains("--kv-cache-dtype float32") && err.contains("for a bfloat16 cache"),
        "{err}"
    );
    let _w = worker_on(&inst, &dir, &[]);
    let _link = connect(&inst);
}

/// A frontend that finds every slot taken says so at once and fails after its attach timeout,
/// naming the flag that sets the slot count.
#[test]
fn a_frontend_with_every_slot_taken_says_why_and_fails_after_its_timeout() {
    let _serial = serial();
    let inst = instance("slotsfull");
    let _s = scheduler(&inst, &["--num-blocks", "64", "--frontends", "1"]);
    let _w = worker(&inst);
    let _link = connect(&inst);
    let model = model_dir();
    let os = |s: &'static str| std::ffi::OsStr::new(s);
    let (st, err) = baton_to_exit(
        &[
            os("frontend"),
            os("--instance"),
            inst.as_ref(),
            os("--model"),
            model.as_os_str(),
            os("--port"),
            os("0"),
            os("--attach-timeout"),
            os("1"),
        ],
        Duration::from_secs(30),
    );
    assert!(st.is_some_and(|s| !s.success()), "{st:?}: {err}");
    assert!(err.contains("every frontend slot"), "{err}");
    assert!(err.contains("--frontends"), "{err}");
    // Without the participant table's internals ("slot in 2..3 for Frontend").
    assert!(!err.contains("participant"), "{err}");
}

/// The step watchdog: a worker that stops making progress (SIGSTOP here; a hung GPU alike)
/// with launches in flight is killed after --launch-timeout, its requests are requeued, and a
/// replacement worker finishes them with the same greedy tokens.
#[test]
fn a_hung_worker_is_killed_by_the_watchdog_and_its_requests_finish_on_the_next() {
    let _serial = serial();
    let g = goldens();
    let reqs = greedy_reqs(&[g[0].0.clone(), g[1].0.clone()], 64);
    let inst = instance("hung");
    let s = scheduler(&inst, &["--num-blocks", "64", "--launch-timeout", "2"]);
    let mut w = Some(worker(&inst));
    let mut link = connect(&inst);
    for r in &reqs {
        submit(&mut link, r);
    }
    let mut replacement = None;
    let mut killed_by = None;
    let outs = collect(&mut link, reqs.len(), T, |tokens, _| {
        if tokens == 10 {
            if let Some(mut old) = w.take() {
                old.signal(Signal::SIGSTOP);
                // Only the watchdog can end a stopped process here. The scheduler is paused
                // now and then meanwhile: its own pauses do not count against the worker, but
                // they must not hide the hang either (they used to restart the count).
                for _ in 0..15 {
                    s.signal(Signal::SIGSTOP);
                    std::thread::sleep(Duration::from_millis(1200));
                    s.signal(Signal::SIGCONT);
                    if let Some(st) = old.wait_timeout(Duration::from_millis(1000)) {
                        killed_by = std::os::unix::process::ExitStatusExt::signal(&st);
                        break;
                    }
                }
                replacement = Some(worker(&inst));
            }
        }
    });
    assert_eq!(killed_by, Some(9), "the stopped worker was not SIGKILLed");
    assert!(replacement.is_some());
    for (i, (_, want)) in g.iter().take(2).enumerate() {
        let o = &outs[&(i as u64)];
        assert_eq!(o.finishes, 1);
        assert_eq!(&o.tokens, want, "request {i} differs after the requeue");
    }
    assert!(
        wait_for(Duration::from_secs(5), || link.stats().pages_used == 0),
        "pool not back to full: {:?}",
        link.stats()
    );
}

/// The watchdog blames only the worker: a scheduler stopped (SIGSTOP here; a debugger, swap
/// or a VM pause alike) for longer than --launch-timeout while its worker finishes the
/// launches in flight must not kill that worker when it runs again. The worker lives on and
/// the requests finish with the golden tokens, never requeued.
#[test]
fn a_paused_scheduler_does_not_kill_its_healthy_worker() {
    let _serial = serial();
    let g = goldens();
    let reqs = greedy_reqs(&[g[0].0.clone(), g[1].0.clone()], 64);
    let inst = instance("paused");
    let s = scheduler(&inst, &["--num-blocks", "64", "--launch-timeout", "1"]);
    let mut w = worker(&inst);
    let mut link = connect(&inst);
    for r in &reqs {
        submit(&mut link, r);
    }
    let mut paused = false;
    let outs = collect(&mut link, reqs.len(), T, |tokens, _| {
        if tokens == 10 && !paused {
            paused = true;
            s.signal(Signal::SIGSTOP);
            std::thread::sleep(Duration::from_millis(2500));
            s.signal(Signal::SIGCONT);
        }
    });
    assert!(paused);
    for (i, (_, want)) in g.iter().take(2).enumerate() {
        let o = &outs[&(i as u64)];
        assert_eq!(o.finishes, 1);
        assert_eq!(&o.tokens, want, "request {i} differs after the pause");
    }
    assert_eq!(
        w.wait_timeout(Duration::from_millis(500)),
        None,
        "the watchdog killed the healthy worker after the scheduler's pause"
    );
    // A second worker on the instance is refused at once, naming the one attached (it used
    // to wait out its attach timeout and then say only that no slot was free).
    let dir = model_dir();
    let flags = [
        "worker",
        "--instance",
        inst.as_str(),
        "--attach-timeout",
        "60",
        "--model",
    ];
    let args: Vec<&std::ffi::OsStr> = flags
        .iter()
        .map(std::ffi::OsStr::new)
        .chain([dir.as_os_str()])
        .collect();
    let (st, err) = baton_to_exit(&args, Duration::from_secs(20));
    assert!(st.is_some_and(|s| !s.success()), "{st:?}: {err}");
    assert!(
        err.contains(&format!("another worker (pid {})", w.pid())),
        "{err}"
    );
}

/// `--scheduling-policy priority` across processes: the priority travels in the admission, the
/// plane says the policy to every frontend, and with one slot the waiting requests start by
/// priority, not by arrival. Under the default policy the scheduler refuses a non-zero
/// priority with an admission error (the frontend refuses it first with a 400).
#[test]
fn waiting_requests_start_by_priority_across_processes_and_fcfs_refuses_a_priority() {
    let inst = instance("priority");
    let _s = scheduler(
        &inst,
        &[
            "--num-blocks",
            "64",
            "--max-num-seqs",
            "1",
            "--scheduling-policy",
            "priority",
        ],
    );
    let _w = worker(&inst);
    let mut link = connect(&inst);
    assert!(link.limits().priority_scheduling);
    let g = goldens();
    let req = |id: u64, max_tokens: u32, priority: i32| {
        let mut r = greedy_reqs(&[g[0].0.clone()], max_tokens).remove(0);
        r.id = id;
        r.priority = priority;
        r
    };
    // Request 1 takes the only slot; 2 to 5 arrive while it runs.
    submit(&mut link, &req(1, 200, 0));
    let deadline = std::time::Instant::now() + T;
    loop {
        assert!(std::time::Instant::now() < deadline, "no first token");
        if link
            .poll(Duration::from_millis(50))
            .is_some_and(|m| m.kind == baton_proto::wire::to_frontend::TOKEN)
        {
            break;
        }
    }
    for (id, p) in [(2, 5), (3, -1), (4, 5), (5, -1)] {
        submit(&mut link, &req(id, 4, p));
    }
    let mut first_tokens = Vec::new();
    let mut finished = 0;
    while finished < 5 {
        assert!(std::time::Instant::now() < deadline, "timed out");
        let Some(m) = link.poll(Duration::from_millis(50)) else {
            continue;
        };
        match m.kind {
            baton_proto::wire::to_frontend::TOKEN => {
                if !first_tokens.contains(&m.req) {
                    first_tokens.push(m.req);
                }
            }
            baton_proto::wire::to_frontend::FINISHED => finished += 1,
            k => panic!("request {} ended with kind {k} ({})", m.req, m.reason),
        }
    }
    assert_eq!(
        first_tokens,
        vec![1, 3, 5, 2, 4],
        "after request 1, by priority"
    );
    drop(link);

    let inst = instance("fcfs");
    let _s = scheduler(&inst, &["--num-blocks", "64"]);
    let _w = worker(&inst);
    let mut link = connect(&inst);
    assert!(!link.limits().priority_scheduling);
    let outs = run(&mut link, &[req(1, 4, 3), req(2, 4, 0)], T);
    assert_eq!(outs[&1].error, Some(baton_proto::wire::error::INVALID));
    assert!(outs[&1].tokens.is_empty());
    assert_eq!(outs[&2].tokens, g[0].1[..4]);
}

/// Counters and fault injection of [`Overlapping`], shared with the test.
#[derive(Default)]
struct OverlapKnobs {
    /// The most launches unfinished at once.
    peak: std::sync::atomic::AtomicUsize,
    /// Submits so far (refused and failed ones included), and those taken while another
    /// launch was in flight.
    submits: std::sync::atomic::AtomicUsize,
    overlapped: std::sync::atomic::AtomicUsize,
    /// Every how many submits one is refused (`Ok(false)`: run it through `execute`); 0: none.
    refuse_every: std::sync::atomic::AtomicUsize,
    /// The number of the submit that fails, and of the finish whose fence fails (0: none).
    fail_submit_at: std::sync::atomic::AtomicUsize,
    finishes: std::sync::atomic::AtomicUsize,
    fail_finish_at: std::sync::atomic::AtomicUsize,
    /// Submits taken in flight (`Ok(true)`).
    accepted: std::sync::atomic::AtomicUsize,
    /// From this submit on (0: never), the first that leaves two launches in flight sets
    /// `stop`, the worker daemon's stop flag.
    stop_at: std::sync::atomic::AtomicUsize,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

/// A CPU backend that keeps launches in flight as the CUDA worker does: [`Backend::submit`]
/// runs a launch (reading the tables then) and gives it a simulated device time, after which
/// [`Backend::oldest_done`] says its fence passed; [`Backend::finish`] waits for that and
/// hands the oldest back. It panics when the worker daemon breaks the contract: more than two
/// unfinished, `execute` with launches unfinished, anything but `finish` after a failed
/// `submit` while earlier launches are unfinished, or a launch whose `released` was published
/// before it was finished (its fence: with a GPU, its pages could be reused under it).
struct Overlapping {
    inner: baton_worker::CpuBackend,
    #[allow(clippy::type_complexity)]
    done: std::collections::VecDeque<(
        baton_proto::LaunchSeq,
        Result<baton_proto::Completion, baton_worker::WorkerError>,
        std::time::Instant,
    )>,
    device_time: Duration,
    knobs: std::sync::Arc<OverlapKnobs>,
    /// Set by a failed submit with launches unfinished: only `finish` may come next.
    must_drain: bool,
    /// The segment's participant table, where the worker publishes `released`.
    participants: baton_ipc::ParticipantTable,
}

impl baton_worker::Backend for Overlapping {
    fn execute(
        &mut self,
        launch: &baton_proto::Launch,
        tables: &dyn baton_worker::TableReader,
    ) -> Result<baton_proto::Completion, baton_worker::WorkerError> {
        assert!(self.done.is_empty(), "execute with launches in flight");
        self.inner.execute(launch, tables)
    }
    fn max_in_flight(&self) -> usize {
        2
    }
    fn submit(
        &mut self,
        launch: &baton_proto::Launch,
        tables: &dyn baton_worker::TableReader,
    ) -> Result<bool, baton_worker::WorkerError> {
        use std::sync::atomic::Ordering::Relaxed;
        assert!(
            !self.must_drain || self.done.is_empty(),
            "submit before the launches ahead of a failed one were finished"
        );
        assert!(self.done.len() < 2, "a third launch in flight");
        let k = &self.knobs;
        let n = 1 + k.submits.fetch_add(1, Relaxed);
        let every = k.refuse_every.load(Relaxed);
        if every > 0 && n.is_multiple_of(every) {
            return Ok(false);
        }
        if n == k.fail_submit_at.load(Relaxed) {
            self.must_drain = true;
            return Err(baton_worker::WorkerError::Forward("injected".into()));
        }
        if !self.done.is_empty() {
            k.overlapped.fetch_add(1, Relaxed);
        }
        let c = self.inner.execute(launch, tables);
        let ready = std::time::Instant::now() + self.device_time;
        self.done.push_back((launch.seq, c, ready));
        k.peak.fetch_max(self.done.len(), Relaxed);
        k.accepted.fetch_add(1, Relaxed);
        let stop_at = k.stop_at.load(Relaxed);
        if stop_at > 0 && n >= stop_at && self.done.len() == 2 {
            k.stop.store(true, Relaxed);
        }
        Ok(true)
    }
    fn oldest_done(&mut self) -> bool {
        self.done
            .front()
            .is_none_or(|d| std::time::Instant::now() >= d.2)
    }
    fn finish(
        &mut self,
    ) -> Option<(
        baton_proto::LaunchSeq,
        Result<baton_proto::Completion, baton_worker::WorkerError>,
    )> {
        use std::sync::atomic::Ordering::Relaxed;
        let (seq, mut r, ready) = self.done.pop_front()?;
        std::thread::sleep(ready.saturating_duration_since(std::time::Instant::now()));
        let released = self
            .participants
            .min_released(baton_ipc::Role::Worker)
            .unwrap_or(0);
        assert!(
            released < seq,
            "launch {seq} was released (released = {released}) before its fence"
        );
        let n = 1 + self.knobs.finishes.fetch_add(1, Relaxed);
        if n == self.knobs.fail_finish_at.load(Relaxed) {
            r = Err(baton_worker::WorkerError::Device(
                "injected fence failure".into(),
            ));
        }
        if self.done.is_empty() {
            self.must_drain = false;
        }
        Some((seq, r))
    }
    fn kv_capacity(&self) -> baton_worker::KvCapacity {
        self.inner.kv_capacity()
    }
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
    fn model_fingerprint(&self) -> u64 {
        self.inner.model_fingerprint()
    }
    fn name(&self) -> &'static str {
        "overlapping cpu"
    }
}

/// A worker daemon whose backend keeps launches in flight (the CUDA worker's pipelining, here
/// on the CPU through [`Overlapping`], 3 ms of simulated device time a launch) behind an
/// asynchronous scheduler:
/// - the outputs match the in-process engine, the worker holds two launches at once, and most
///   launches are submitted while the one before them still runs (the scheduler publishes
///   the next launch only after the completion before the oldest, so a worker that blocked on
///   the oldest's fence as soon as the ring was empty would overlap about every other one);
/// - launches the backend refuses to overlap run through `execute` after the ones ahead;
/// - a launch that fails at submit, or whose fence fails, aborts its requests, after the
///   completion of the launch ahead of it, and later requests run to their goldens;
/// - stopped with two launches in flight, the worker finishes both (releasing each after its
///   fence) before it returns.
#[test]
fn a_worker_with_launches_in_flight_matches_the_in_process_engine() {
    use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
    use std::sync::Arc;
    let _serial = serial();
    let inst = instance("inflight");
    let _s = scheduler(&inst, &["--num-blocks", "128", "--async-scheduling"]);
    let loaded = baton_model::ModelDir::new(model_dir())
        .load_mapped_lenient(baton_model::LoadFormat::Auto)
        .expect("test model");
    let weights = loaded.weights_fingerprint;
    let (model, _) = loaded.into_cpu_model().expect("cpu model");
    let (segment, limits) =
        baton_worker::daemon::attach(&inst, Duration::from_secs(60)).expect("attach");
    let participants = segment
        .participants(baton_ipc::topology::PARTICIPANTS)
        .expect("participant table");
    let stop = Arc::new(AtomicBool::new(false));
    let knobs = Arc::new(OverlapKnobs {
        stop: stop.clone(),
        ..OverlapKnobs::default()
    });
    let backend = Overlapping {
        inner: baton_worker::CpuBackend::new(model, limits.num_blocks, limits.block_size),
        done: Default::default(),
        device_time: Duration::from_millis(3),
        knobs: knobs.clone(),
        must_drain: false,
        participants,
    };
    let mut w =
        baton_worker::daemon::WorkerDaemon::new(segment, limits, backend, weights, T).expect("w");
    let stop2 = stop.clone();
    let worker = std::thread::spawn(move || w.run(&stop2));
    let mut link = connect(&inst);
    let g = goldens();
    let golden_reqs = |id0: u64| {
        let mut r = greedy_reqs(&g.iter().map(|(p, _)| p.clone()).collect::<Vec<_>>(), 48);
        r.iter_mut().for_each(|r| r.id += id0);
        r
    };
    let mut reqs = golden_reqs(0);
    let mut sampled = greedy_reqs(&mixed_prompts(6, 3), 40);
    for (i, r) in sampled.iter_mut().enumerate() {
        r.id = 50 + i as u64;
        r.params = SamplingParams {
            temperature: 0.9,
            top_p: 0.9,
            seed: 7 + i as u64,
            frequency_penalty: 0.4,
            ..SamplingParams::greedy()
        };
    }
    reqs.extend(sampled);
    let outs = run(&mut link, &reqs, T);
    let want = in_process(&reqs);
    for r in &reqs {
        assert_eq!(outs[&r.id].tokens, want[&r.id], "request {}", r.id);
    }
    assert_eq!(knobs.peak.load(Relaxed), 2, "never two launches in flight");
    let (overlapped, submits) = (knobs.overlapped.load(Relaxed), knobs.submits.load(Relaxed));
    assert!(
        overlapped * 10 >= submits * 8,
        "only {overlapped} of {submits} launches were submitted behind a running one"
    );
    // Every 5th submit refused: those run through `execute` once the ones ahead finished.
    knobs.refuse_every.store(5, Relaxed);
    let outs = run(&mut link, &golden_reqs(100), T);
    for (i, (_, want)) in g.iter().enumerate() {
        assert_eq!(
            outs[&(100 + i as u64)].tokens,
            want[..48],
            "golden {i}, refusals"
        );
    }
    knobs.refuse_every.store(0, Relaxed);
    // The 10th submit from here fails, then (next round) the 10th fence, each in the middle
    // of the goldens' decode; the round after each runs clean.
    let faults = [
        (&knobs.fail_submit_at, &knobs.submits),
        (&knobs.fail_finish_at, &knobs.finishes),
    ];
    for (round, (fail_at, count)) in faults.into_iter().enumerate() {
        fail_at.store(count.load(Relaxed) + 10, Relaxed);
        let id0 = 200 + 200 * round as u64;
        let outs = run(&mut link, &golden_reqs(id0), T);
        let mut aborted = 0;
        for (i, (_, want)) in g.iter().enumerate() {
            let o = &outs[&(id0 + i as u64)];
            assert!(want.starts_with(&o.tokens), "golden {i} went wrong: {o:?}");
            aborted += usize::from(o.reason == reason::ABORT);
        }
        assert!(aborted > 0, "the failed launch aborted nothing: {outs:?}");
        let outs = run(&mut link, &golden_reqs(id0 + 100), T);
        for (i, (_, want)) in g.iter().enumerate() {
            let got = &outs[&(id0 + 100 + i as u64)].tokens;
            assert_eq!(got, &want[..48], "golden {i} after the failure");
        }
    }
    // Stop in the middle of the goldens' decode, with two launches in flight.
    knobs
        .stop_at
        .store(knobs.submits.load(Relaxed) + 10, Relaxed);
    for r in &golden_reqs(1000) {
        submit(&mut link, r);
    }
    worker.join().expect("worker thread").expect("worker run");
    assert_eq!(
        knobs.finishes.load(Relaxed),
        knobs.accepted.load(Relaxed),
        "launches were left in flight at the stop"
    );
}
