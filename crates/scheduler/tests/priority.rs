//! The scheduling policies (vLLM's `--scheduling-policy fcfs|priority`), deterministically:
//! which waiting request starts next, and which running request is preempted when a running
//! one needs a page. The random lifecycle test in `fenced_reclamation.rs` runs both policies
//! against its invariants (fences, outputs, lengths); these tests pin the orders.

use baton_proto::{Completion, Launch, SamplingParams};
use baton_scheduler::{
    AdmitError, Event, NewRequest, RequestId, Scheduler, SchedulerConfig, SchedulingPolicy,
};

const VOCAB: usize = 64;

fn config(policy: SchedulingPolicy, max_num_seqs: usize, num_blocks: usize) -> SchedulerConfig {
    SchedulerConfig {
        max_num_seqs,
        max_num_batched_tokens: 64,
        block_size: 4,
        num_blocks,
        max_model_len: 32,
        max_inflight: 1,
        enable_prefix_caching: false,
        policy,
        kv_window: None,
    }
}

fn request(id: RequestId, priority: i32, prompt_len: usize, max_tokens: u32) -> NewRequest {
    let prompt = (0..prompt_len)
        .map(|i| 3 + (id as u32 * 7 + i as u32) % 50)
        .collect();
    NewRequest {
        eos_ids: vec![2],
        ignore_eos: true,
        priority,
        ..NewRequest::new(id, prompt, max_tokens, SamplingParams::greedy())
    }
}

/// Runs one launch to completion (every sampling row samples token 9) and its release, and
/// returns the requests that took their first slot in it and the events.
fn step(s: &mut Scheduler) -> (Vec<RequestId>, Vec<Event>) {
    let l: Launch = s.schedule().expect("there is work");
    let started = s.started().to_vec();
    let mut ev = Vec::new();
    s.on_completion(&Completion::sampling(&l, |_| 9), &mut ev);
    s.on_released(l.seq);
    (started, ev)
}

/// The order in which requests 2.. start when one slot frees at a time: request 1 (priority 0)
/// holds the only slot while the others arrive with `priorities`.
fn start_order(policy: SchedulingPolicy, priorities: &[i32]) -> Vec<RequestId> {
    let mut s = Scheduler::new_local(config(policy, 1, 64), VOCAB);
    s.add_request(request(1, 0, 3, 2)).unwrap();
    assert_eq!(step(&mut s).0, vec![1]);
    for (i, &p) in priorities.iter().enumerate() {
        s.add_request(request(2 + i as u64, p, 3, 1)).unwrap();
    }
    let mut order = Vec::new();
    while !s.is_idle() {
        order.extend(step(&mut s).0);
    }
    order
}

#[test]
fn waiting_requests_start_by_priority_then_arrival_under_the_priority_policy() {
    // Requests 2..=6 with priorities 5, -1, 0, -1, 5.
    let p = [5, -1, 0, -1, 5];
    assert_eq!(
        start_order(SchedulingPolicy::Priority, &p),
        vec![3, 5, 4, 2, 6]
    );
    // All equal: arrival order, the same as first come, first served.
    assert_eq!(
        start_order(SchedulingPolicy::Priority, &[0; 5]),
        vec![2, 3, 4, 5, 6]
    );
    assert_eq!(
        start_order(SchedulingPolicy::Fcfs, &[0; 5]),
        vec![2, 3, 4, 5, 6]
    );
}

/// Two requests run; the pool then runs dry and one of them must be preempted. Returns the
/// preempted one (the one without a slot afterwards).
fn preempted(policy: SchedulingPolicy, first: i32, second: i32) -> RequestId {
    // 4 pages of 4 tokens. Each prompt of 7 tokens takes 2 pages; the 9th position (the
    // second output) needs a third page, which only a preemption can free.
    // Request 2 arrives once request 1 runs, so under the priority policy a more urgent
    // request 2 must still be ordered before it among the running.
    let mut s = Scheduler::new_local(config(policy, 2, 4), VOCAB);
    s.add_request(request(1, first, 7, 10)).unwrap();
    assert_eq!(step(&mut s).0, vec![1]);
    s.add_request(request(2, second, 7, 10)).unwrap();
    assert_eq!(step(&mut s).0, vec![2]);
    let before = s.stats().preemptions;
    let mut steps = 0;
    while s.stats().preemptions == before {
        step(&mut s);
        steps += 1;
        assert!(steps < 8, "no preemption happened");
    }
    let waiting: Vec<RequestId> = [1, 2]
        .into_iter()
        .filter(|&id| s.request_lengths(id).is_some_and(|l| l.slot.is_none()))
        .collect();
    assert_eq!(waiting.len(), 1, "exactly one was preempted: {waiting:?}");
    waiting[0]
}

#[test]
fn the_least_urgent_running_request_is_preempted_under_the_priority_policy() {
    // The first admitted is less urgent: it goes, although it arrived first.
    assert_eq!(preempted(SchedulingPolicy::Priority, 1, 0), 1);
    // The second is less urgent.
    assert_eq!(preempted(SchedulingPolicy::Priority, -3, 7), 2);
    // Equal priorities: the later arrival, as first come, first served preempts.
    assert_eq!(preempted(SchedulingPolicy::Priority, 4, 4), 2);
    assert_eq!(preempted(SchedulingPolicy::Fcfs, 0, 0), 2);
}

#[test]
fn a_preempted_request_goes_back_to_its_place_by_priority() {
    // Request 1 (priority 1) is preempted by request 2 (priority 0) needing a page. Requests 3
    // (priority -5) and 4 (priority 1) arrived after request 1. Request 3 overtakes the
    // preempted request 1 (not put back at the front), which resumes no later than request 4
    // (same priority, later arrival).
    let mut s = Scheduler::new_local(config(SchedulingPolicy::Priority, 2, 4), VOCAB);
    s.add_request(request(1, 1, 7, 10)).unwrap();
    s.add_request(request(2, 0, 7, 3)).unwrap();
    assert_eq!(step(&mut s).0, vec![2, 1], "by priority");
    s.add_request(request(3, -5, 3, 1)).unwrap();
    s.add_request(request(4, 1, 3, 1)).unwrap();
    // Per step: the requests that took their first slot, and whether request 1 (re)took one.
    let mut order = Vec::new();
    let mut start_step = std::collections::HashMap::new();
    let mut resume_step = None;
    let mut k = 0;
    while !s.is_idle() {
        let had_slot = s.request_lengths(1).and_then(|l| l.slot).is_some();
        let preemptions = s.stats().preemptions;
        let (started, _) = step(&mut s);
        for &id in &started {
            start_step.insert(id, k);
        }
        order.extend(started);
        let has_slot = s.request_lengths(1).and_then(|l| l.slot).is_some();
        if preemptions > 0 && !had_slot && has_slot && resume_step.is_none() {
            resume_step = Some(k);
        }
        k += 1;
        assert!(k < 20, "drains");
    }
    assert_eq!(s.stats().preemptions, 1, "request 1 was preempted once");
    assert_eq!(order, vec![3, 4], "first starts after the first step");
    let resumed = resume_step.expect("request 1 resumed");
    assert!(
        start_step[&3] < resumed,
        "request 3 started (step {}) before request 1 resumed (step {resumed})",
        start_step[&3]
    );
    assert!(
        resumed <= start_step[&4],
        "request 1 resumed (step {resumed}) no later than request 4 started (step {})",
        start_step[&4]
    );
}

/// vLLM V1's rule: a step that preempts starts no waiting request (the pages it freed are for
/// the running requests' growth). Requests 1 (priority 1) and 2 (priority 0) fill the pool of
/// 4 pages; request 3 (priority -5, one page) arrives and waits. When request 2 needs a third
/// page it preempts request 1, which frees two pages: one is request 2's, and request 3, first
/// in the waiting order and with a free slot, would fit in the other. It starts in the next
/// step, not in the one that preempted.
#[test]
fn a_step_that_preempts_starts_no_waiting_request() {
    let mut s = Scheduler::new_local(config(SchedulingPolicy::Priority, 3, 4), VOCAB);
    s.add_request(request(1, 1, 7, 10)).unwrap();
    s.add_request(request(2, 0, 7, 10)).unwrap();
    assert_eq!(step(&mut s).0, vec![2, 1], "by priority");
    s.add_request(request(3, -5, 3, 1)).unwrap();
    let mut preempting_steps = Vec::new();
    let mut started_at = None;
    for k in 1..20 {
        let preemptions = s.stats().preemptions;
        let (started, _) = step(&mut s);
        if s.stats().preemptions > preemptions {
            preempting_steps.push(k);
            assert!(
                started.is_empty(),
                "step {k} preempted and started {started:?}"
            );
        }
        if started.contains(&3) {
            started_at = Some(k);
            break;
        }
    }
    assert_eq!(
        preempting_steps.len(),
        1,
        "one preemption: {preempting_steps:?}"
    );
    assert_eq!(
        started_at,
        Some(preempting_steps[0] + 1),
        "request 3 starts in the step after the preemption"
    );
    assert!(
        s.request_lengths(1).is_some_and(|l| l.slot.is_none()),
        "request 1 was the one preempted"
    );
}

#[test]
fn a_nonzero_priority_is_refused_under_first_come_first_served() {
    let mut s = Scheduler::new_local(config(SchedulingPolicy::Fcfs, 2, 16), VOCAB);
    assert_eq!(
        s.add_request(request(1, 3, 3, 1)),
        Err(AdmitError::PriorityNotEnabled(3))
    );
    assert_eq!(s.add_request(request(2, 0, 3, 1)), Ok(()));
    let mut s = Scheduler::new_local(config(SchedulingPolicy::Priority, 2, 16), VOCAB);
    assert_eq!(s.add_request(request(1, -3, 3, 1)), Ok(()));
}

#[test]
fn the_policy_flag_parses_as_vllm_spells_it() {
    assert_eq!("fcfs".parse(), Ok(SchedulingPolicy::Fcfs));
    assert_eq!("priority".parse(), Ok(SchedulingPolicy::Priority));
    assert!("lifo".parse::<SchedulingPolicy>().is_err());
    for p in [SchedulingPolicy::Fcfs, SchedulingPolicy::Priority] {
        assert_eq!(p.name().parse(), Ok(p));
    }
}
