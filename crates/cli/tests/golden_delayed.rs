//! The stories260K goldens through the scheduler while the worker's completions reach it
//! several launches late and its releases lag its completions, with four launches in flight and
//! a pool so small that pages are recycled constantly (DESIGN.md sections 3 and 4). Around the
//! goldens, fillers stop early with later launches in flight and clients disconnect. The greedy
//! outputs still match golden.json exactly, everything comes back, and `check_trace` accepts
//! the lifecycle trace.

mod common;
use baton_scheduler::{check_trace, Tracer};
use common::delayed::{golden_mix, DelayedEngine, Delays};
use common::*;
use std::io::Write;
use std::sync::{Arc, Mutex};

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

fn goldens_match_with_late_reports(block_size: usize, num_blocks: usize, delays: Delays) {
    let g = goldens();
    let mut engine = DelayedEngine::new(config(block_size, num_blocks, 4), delays);
    let trace = Buf::default();
    engine.set_tracer(Tracer::new(Box::new(trace.clone())));
    let reqs = golden_mix(&mut engine, 20);
    let out = collect(engine.run(reqs));
    for (i, gp) in g.iter().enumerate() {
        assert_eq!(
            out[&(i as u64)].0,
            gp.greedy_ids,
            "golden {:?} differs (block {block_size}, pages {num_blocks}, {delays:?})",
            gp.prompt
        );
    }
    let s = engine.sched.stats();
    assert_eq!(s.pool.free, s.pool.total, "pool not back to full: {s:?}");
    assert_eq!(s.slots_retired, 0, "slots still retired: {s:?}");
    assert!(
        s.preemptions > 0,
        "the small pool was meant to preempt: {s:?}"
    );
    assert_eq!(
        engine.stats.max_unreported, 4,
        "four launches were meant to be in flight at once"
    );
    let trace = trace.0.lock().unwrap().clone();
    let summary = check_trace(trace.as_slice()).expect("the trace passes the checker");
    assert!(
        summary.reclaimed_pages > 5 * num_blocks,
        "pages were meant to be recycled constantly: {summary:?}"
    );
    assert!(summary.cancels > 0, "{summary:?}");
    assert!(
        summary.finished_with_launch_in_flight > 0,
        "some request was meant to finish with a later launch in flight: {summary:?}"
    );
}

/// The worker executes each launch when it is published; the scheduler hears of completion `s`
/// only once launch `s + 3` is published, and of release `s` two completions after that.
#[test]
fn greedy_goldens_match_with_completions_three_launches_late_and_a_recycling_pool() {
    let delays = Delays {
        completion_lag: 3,
        release_lag: 2,
        execute_late: false,
    };
    goldens_match_with_late_reports(4, 48, delays);
    goldens_match_with_late_reports(16, 12, delays);
}

/// The worker lags behind the scheduler: it executes launch `s` only when its completion is
/// reported, three launches later, reading the token and block tables as they are then, so
/// every table entry a launch refers to must still hold its value when the launch runs.
#[test]
fn greedy_goldens_match_with_a_worker_lagging_three_launches_behind_the_scheduler() {
    let delays = Delays {
        completion_lag: 3,
        release_lag: 2,
        execute_late: true,
    };
    goldens_match_with_late_reports(4, 48, delays);
    goldens_match_with_late_reports(16, 12, delays);
}
