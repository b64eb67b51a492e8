//! `baton trace check FILE`: accepts the lifecycle trace of a run with late completions and
//! releases and a recycling pool, and rejects each hand-made trace in `tests/traces/`, naming
//! the line that breaks an invariant.
//!
//! Expectations: a clean trace exits 0 with "ok" on stdout; a broken one exits non-zero with
//! "line N" (the first offending line, 1-based) on stderr.

mod common;
use baton_scheduler::Tracer;
use common::delayed::{golden_mix, DelayedEngine, Delays};
use common::*;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn baton_trace_check(path: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_baton"))
        .args(["trace", "check"])
        .arg(path)
        .output()
        .expect("baton runs")
}

fn traces_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/traces")
}

#[test]
fn trace_check_accepts_the_trace_of_a_run_with_late_fences_and_a_recycling_pool() {
    let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("trace_cli_late_fences.jsonl");
    let delays = Delays {
        completion_lag: 3,
        release_lag: 2,
        execute_late: true,
    };
    let mut engine = DelayedEngine::new(config(4, 48, 4), delays);
    engine.set_tracer(Tracer::to_file(&path).expect("trace file"));
    let reqs = golden_mix(&mut engine, 8);
    let out = collect(engine.run(reqs));
    for (i, g) in goldens().iter().enumerate() {
        assert_eq!(out[&(i as u64)].0, g.greedy_ids);
    }
    assert!(engine.sched.stats().preemptions > 0);
    drop(engine); // closes the trace file
    let o = baton_trace_check(&path);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
    );
    assert!(
        o.status.success(),
        "status {:?}\nstdout: {stdout}\nstderr: {stderr}",
        o.status
    );
    assert!(stdout.contains("ok"), "stdout: {stdout}\nstderr: {stderr}");
}

fn rejects_naming_the_line(file: &str, line: usize) {
    let o = baton_trace_check(&traces_dir().join(file));
    let (stdout, stderr) = (
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
    );
    assert!(
        !o.status.success(),
        "{file} accepted\nstdout: {stdout}\nstderr: {stderr}"
    );
    assert!(
        stderr.contains(&format!("line {line}")),
        "{file}: stderr does not name line {line}\nstdout: {stdout}\nstderr: {stderr}"
    );
}

#[test]
fn trace_check_rejects_a_page_reclaimed_before_its_last_launch_is_released() {
    rejects_naming_the_line("page_reused_before_release.jsonl", 11);
}

#[test]
fn trace_check_rejects_an_output_published_after_a_cancel() {
    rejects_naming_the_line("publication_after_cancel.jsonl", 8);
}

#[test]
fn trace_check_rejects_known_len_that_is_not_computed_len_plus_pending() {
    rejects_naming_the_line("known_len_not_computed_plus_pending.jsonl", 6);
}
