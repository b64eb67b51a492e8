//! The hand-made traces in `tests/traces/` each break one invariant of DESIGN.md sections 2 to
//! 5; `check_trace` must reject each one at the line that breaks it, and for that reason.

use baton_scheduler::check_trace;
use std::path::PathBuf;

fn traces_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/traces")
}

/// `(file, line, words the message must contain)`.
const BROKEN: [(&str, usize, &str); 3] = [
    (
        "page_reused_before_release.jsonl",
        11,
        "reclaimed with launch 2 unreleased",
    ),
    (
        "publication_after_cancel.jsonl",
        8,
        "published for request 1 after its cancel",
    ),
    (
        "known_len_not_computed_plus_pending.jsonl",
        6,
        "is not computed_len 4 plus pending 2",
    ),
];

fn check_file(name: &str) -> Result<baton_scheduler::TraceSummary, baton_scheduler::Violation> {
    let f = std::fs::File::open(traces_dir().join(name)).expect("trace file");
    check_trace(std::io::BufReader::new(f))
}

#[test]
fn a_page_reclaimed_before_every_launch_that_referred_to_it_is_released_is_rejected() {
    let (name, line, words) = BROKEN[0];
    let v = check_file(name).unwrap_err();
    assert_eq!((v.line, v.message.contains(words)), (line, true), "{v}");
}

#[test]
fn an_output_published_after_a_cancel_is_rejected() {
    let (name, line, words) = BROKEN[1];
    let v = check_file(name).unwrap_err();
    assert_eq!((v.line, v.message.contains(words)), (line, true), "{v}");
}

#[test]
fn known_len_that_is_not_computed_len_plus_pending_is_rejected() {
    let (name, line, words) = BROKEN[2];
    let v = check_file(name).unwrap_err();
    assert_eq!((v.line, v.message.contains(words)), (line, true), "{v}");
}

/// Each broken trace breaks only its one invariant: with the offending line repaired (or
/// dropped), the rest of the story is a clean trace. Otherwise a checker that rejected every
/// file at some earlier line for another reason would pass the tests above by accident.
#[test]
fn each_hand_made_trace_is_clean_apart_from_its_one_broken_line() {
    let repairs: [(&str, &str, &str); 3] = [
        // Reclaim only after launch 2 is released.
        (
            BROKEN[0].0,
            r#"{"boundary":"release","launch":1,"evidence":"min_released=1"}"#,
            r#"{"boundary":"release","launch":2,"evidence":"min_released=2"}"#,
        ),
        // The cancelled request's sampled token is suppressed, not published.
        (
            BROKEN[1].0,
            r#"{"boundary":"sampling","req":1,"owner":"scheduler","known_len":4,"computed_len":3,"pending":1,"launch":1,"token":9}"#,
            r#"{"boundary":"suppressed","req":1,"launch":1,"token":9}"#,
        ),
        // One token pending, not two.
        (BROKEN[2].0, r#""pending":2"#, r#""pending":1"#),
    ];
    for (name, from, to) in repairs {
        let text = std::fs::read_to_string(traces_dir().join(name)).unwrap();
        assert!(text.contains(from), "{name}: repair does not apply");
        let mut fixed = text.replacen(from, to, 1);
        if name == BROKEN[1].0 {
            // Drop the publication that followed the (now suppressed) sampling.
            fixed = fixed
                .lines()
                .filter(|l| !l.contains(r#""boundary":"publication""#))
                .map(|l| format!("{l}\n"))
                .collect();
        }
        if let Err(v) = check_trace(fixed.as_bytes()) {
            panic!("{name} repaired is still rejected: {v}");
        }
    }
}

#[test]
fn every_trace_in_tests_traces_has_an_expectation() {
    let mut names: Vec<String> = std::fs::read_dir(traces_dir())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".jsonl"))
        .collect();
    names.sort();
    let mut want: Vec<String> = BROKEN.iter().map(|b| b.0.to_owned()).collect();
    want.sort();
    assert_eq!(names, want);
}
