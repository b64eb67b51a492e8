//! `baton trace check`: replays a lifecycle trace and verifies the invariants of DESIGN.md
//! sections 2 to 5, naming the first line that breaks one.
//!
//! The checker keeps its own books from the trace alone (page owners, the last launch that
//! referred to each page, the released value, each request's known and computed lengths) and
//! checks every line against them:
//! - no page is reused while a launch that referred to it is unreleased (a prefix-cache hit
//!   shares a page with its other holders, or takes a reclaimed one; it never takes a retired
//!   page);
//! - no output is published for a cancelled request, and no launch includes it;
//! - `known_len` is `computed_len` plus pending tokens, and both agree with the checker's count.

use crate::trace::{Boundary, TraceRecord};
use baton_proto::LaunchSeq;
use std::collections::{HashMap, HashSet};
use std::io::BufRead;

/// The first violation found.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {message}")]
pub struct Violation {
    /// 1-based line number in the trace.
    pub line: usize,
    /// What is wrong.
    pub message: String,
}

/// What a clean trace contained.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct TraceSummary {
    /// Lines read.
    pub lines: usize,
    /// Distinct requests admitted.
    pub requests: usize,
    /// Launches prepared.
    pub launches: usize,
    /// Pages reclaimed.
    pub reclaimed_pages: usize,
    /// Tokens published.
    pub published: usize,
    /// Cancels.
    pub cancels: usize,
    /// Launches whose set of requests differs from the previous launch's.
    pub membership_changes: usize,
    /// Requests that finished while a later launch including them was already prepared
    /// (their output from that launch must be suppressed).
    pub finished_with_launch_in_flight: usize,
}

#[derive(Debug, Clone)]
enum PageState {
    /// Held by `holders`; `shared` once a prefix-cache hit took it (then holders may retire it
    /// after launches older than another holder's, and the page retires after the latest).
    Owned {
        holders: Vec<u64>,
        last_ref: LaunchSeq,
        shared: bool,
    },
    Retired {
        after: LaunchSeq,
    },
    /// On the free list or in the prefix cache (reclaimed either way).
    Free,
}

#[derive(Default)]
struct Books {
    pages: HashMap<u32, PageState>,
    released: LaunchSeq,
    /// Rows of each launch: (req, epoch, end position).
    launches: HashMap<LaunchSeq, Vec<(u64, u32, usize)>>,
    launch_members: Vec<(LaunchSeq, Vec<u64>)>,
    completed: HashSet<LaunchSeq>,
    known: HashMap<u64, usize>,
    computed: HashMap<u64, usize>,
    epoch: HashMap<u64, u32>,
    last_launch_of: HashMap<u64, LaunchSeq>,
    cancelled: HashSet<u64>,
    summary: TraceSummary,
}

/// Checks a trace read from `r`.
///
/// # Errors
/// The first [`Violation`] (an unreadable or malformed line is one too).
pub fn check_trace(r: impl BufRead) -> Result<TraceSummary, Violation> {
    let mut b = Books::default();
    let mut n = 0;
    for (i, line) in r.lines().enumerate() {
        n = i + 1;
        let fail = |message: String| Violation {
            line: i + 1,
            message,
        };
        let line = line.map_err(|e| fail(format!("unreadable: {e}")))?;
        if line.trim().is_empty() {
            continue;
        }
        let rec: TraceRecord =
            serde_json::from_str(&line).map_err(|e| fail(format!("not a trace record: {e}")))?;
        b.apply(&rec).map_err(fail)?;
    }
    b.summary.lines = n;
    b.summary.launches = b.launches.len();
    let mut prev: Option<&Vec<u64>> = None;
    b.launch_members.sort_by_key(|(s, _)| *s);
    for (_, m) in &b.launch_members {
        if prev.is_some_and(|p| p != m) {
            b.summary.membership_changes += 1;
        }
        prev = Some(m);
    }
    Ok(b.summary)
}

impl Books {
    fn req(rec: &TraceRecord) -> Result<u64, String> {
        rec.req
            .ok_or_else(|| "record has no request id".to_string())
    }

    fn launch(rec: &TraceRecord) -> Result<LaunchSeq, String> {
        rec.launch.ok_or_else(|| "record has no launch".to_string())
    }

    /// Checks the lengths a record states against the checker's own count.
    fn check_lengths(&self, rec: &TraceRecord, req: u64) -> Result<(), String> {
        let (Some(known), Some(computed)) = (rec.known_len, rec.computed_len) else {
            return Ok(());
        };
        if computed > known {
            return Err(format!(
                "request {req}: computed_len {computed} exceeds known_len {known}"
            ));
        }
        if let Some(p) = rec.pending {
            if known != computed + p {
                return Err(format!("request {req}: known_len {known} is not computed_len {computed} plus pending {p}"));
            }
        }
        if let Some(&k) = self.known.get(&req) {
            if k != known {
                return Err(format!("request {req}: known_len {known}, but admission and published tokens make it {k}"));
            }
        }
        if let Some(&c) = self.computed.get(&req) {
            if c != computed {
                return Err(format!(
                    "request {req}: computed_len {computed}, but fenced launches make it {c}"
                ));
            }
        }
        Ok(())
    }

    fn apply(&mut self, rec: &TraceRecord) -> Result<(), String> {
        let Some(boundary) = rec.boundary else {
            return Err("record has no boundary".into());
        };
        match boundary {
            Boundary::Admission => {
                let req = Self::req(rec)?;
                let known = rec.known_len.ok_or("admission without known_len")?;
                self.known.insert(req, known);
                self.computed.insert(req, 0);
                self.summary.requests += 1;
                self.check_lengths(rec, req)?;
            }
            Boundary::BatchPreparation => {
                let req = Self::req(rec)?;
                let s = Self::launch(rec)?;
                if self.cancelled.contains(&req) {
                    return Err(format!(
                        "launch {s} includes request {req} after its cancel"
                    ));
                }
                let (first, n) = rec.positions.ok_or("batch preparation without positions")?;
                for &p in rec.pages.as_deref().unwrap_or_default() {
                    match self.pages.get_mut(&p) {
                        None | Some(PageState::Free) => {
                            self.pages.insert(p, PageState::Owned { holders: vec![req], last_ref: s, shared: false });
                        }
                        Some(PageState::Owned { holders, last_ref, .. }) if holders.contains(&req) => {
                            *last_ref = (*last_ref).max(s);
                        }
                        Some(PageState::Owned { holders, last_ref, .. }) => {
                            return Err(format!(
                                "page {p} referred to by launch {s} for request {req} while requests {holders:?} hold it (last launch {last_ref}) and no cache hit shared it"
                            ))
                        }
                        Some(PageState::Retired { after }) => {
                            return Err(format!(
                                "page {p} reused by launch {s} for request {req} before it was reclaimed (retired after launch {after}, released {})",
                                self.released
                            ))
                        }
                    }
                }
                let epoch = self.epoch.get(&req).copied().unwrap_or(0);
                self.launches
                    .entry(s)
                    .or_default()
                    .push((req, epoch, first + n));
                match self.launch_members.last_mut() {
                    Some((ls, m)) if *ls == s => m.push(req),
                    _ => self.launch_members.push((s, vec![req])),
                }
                self.last_launch_of.insert(req, s);
                self.check_lengths(rec, req)?;
            }
            Boundary::ForwardExecution => {
                let s = Self::launch(rec)?;
                if !self.completed.insert(s) {
                    return Err(format!("launch {s} completed twice"));
                }
                for &(req, epoch, end) in
                    self.launches.get(&s).map(Vec::as_slice).unwrap_or_default()
                {
                    if self.epoch.get(&req).copied().unwrap_or(0) == epoch {
                        if let Some(c) = self.computed.get_mut(&req) {
                            *c = (*c).max(end);
                        }
                    }
                }
            }
            Boundary::Release => {
                let s = Self::launch(rec)?;
                if s < self.released {
                    return Err(format!(
                        "released went backwards: {} then {s}",
                        self.released
                    ));
                }
                self.released = s;
            }
            Boundary::Sampling => {
                let req = Self::req(rec)?;
                if let Some(k) = self.known.get_mut(&req) {
                    *k += 1;
                }
                self.check_lengths(rec, req)?;
            }
            Boundary::Publication => {
                let req = Self::req(rec)?;
                if self.cancelled.contains(&req) {
                    return Err(format!(
                        "output published for request {req} after its cancel"
                    ));
                }
                self.summary.published += 1;
                self.check_lengths(rec, req)?;
            }
            Boundary::Suppressed => {}
            Boundary::Cancel => {
                let req = Self::req(rec)?;
                self.cancelled.insert(req);
                self.summary.cancels += 1;
                self.check_lengths(rec, req)?;
            }
            Boundary::Preempt => {
                let req = Self::req(rec)?;
                *self.epoch.entry(req).or_default() += 1;
                self.computed.insert(req, 0);
                self.check_lengths(rec, req)?;
            }
            Boundary::Finish => {
                let req = Self::req(rec)?;
                self.check_lengths(rec, req)?;
                if let Some(&last) = self.last_launch_of.get(&req) {
                    if !self.completed.contains(&last) {
                        self.summary.finished_with_launch_in_flight += 1;
                    }
                }
            }
            Boundary::Retire => {
                let after = Self::launch(rec)?;
                for &p in rec.pages.as_deref().unwrap_or_default() {
                    match self.pages.get_mut(&p) {
                        Some(PageState::Owned {
                            holders,
                            last_ref,
                            shared,
                        }) => {
                            if let Some(r) = rec.req {
                                let Some(at) = holders.iter().position(|&h| h == r) else {
                                    return Err(format!(
                                        "request {r} retired page {p}, which requests {holders:?} hold"
                                    ));
                                };
                                holders.swap_remove(at);
                            } else {
                                holders.clear();
                            }
                            if !*shared && after < *last_ref {
                                return Err(format!("page {p} retired after launch {after}, but launch {last_ref} refers to it"));
                            }
                            if holders.is_empty() {
                                // The pool retires a shared page after the latest launch of
                                // any holder; a reclaim before that is caught below.
                                let after = after.max(*last_ref);
                                self.pages.insert(p, PageState::Retired { after });
                            }
                        }
                        other => return Err(format!("page {p} retired while {other:?}")),
                    }
                }
            }
            Boundary::Reclaim => {
                let after = Self::launch(rec)?;
                let dead = rec
                    .evidence
                    .as_deref()
                    .is_some_and(|e| e.contains("worker_dead"));
                if !dead && self.released < after {
                    return Err(format!(
                        "pages {:?} reclaimed with launch {after} unreleased (released is {})",
                        rec.pages.as_deref().unwrap_or_default(),
                        self.released
                    ));
                }
                for &p in rec.pages.as_deref().unwrap_or_default() {
                    match self.pages.get(&p).cloned().unwrap_or(PageState::Free) {
                        PageState::Retired { after: a } if a <= after => {
                            self.pages.insert(p, PageState::Free);
                            self.summary.reclaimed_pages += 1;
                        }
                        other => {
                            return Err(format!(
                                "page {p} reclaimed after launch {after} while {other:?}"
                            ))
                        }
                    }
                }
            }
            Boundary::CacheHit => {
                let req = Self::req(rec)?;
                if self.cancelled.contains(&req) {
                    return Err(format!("request {req} took cached pages after its cancel"));
                }
                for &p in rec.pages.as_deref().unwrap_or_default() {
                    match self.pages.get_mut(&p) {
                        None | Some(PageState::Free) => {
                            self.pages.insert(
                                p,
                                PageState::Owned {
                                    holders: vec![req],
                                    last_ref: 0,
                                    shared: true,
                                },
                            );
                        }
                        Some(PageState::Owned {
                            holders, shared, ..
                        }) if !holders.contains(&req) => {
                            holders.push(req);
                            *shared = true;
                        }
                        // A retired page's block is final: the hit adds a reader next to the
                        // unreleased launch, and the page retires after both.
                        Some(&mut PageState::Retired { after }) => {
                            self.pages.insert(
                                p,
                                PageState::Owned {
                                    holders: vec![req],
                                    last_ref: after,
                                    shared: true,
                                },
                            );
                        }
                        Some(other) => {
                            return Err(format!(
                                "request {req} took page {p} from the prefix cache while {other:?}"
                            ))
                        }
                    }
                }
                let computed = rec.computed_len.ok_or("cache hit without computed_len")?;
                self.computed.insert(req, computed);
                self.check_lengths(rec, req)?;
            }
            Boundary::WorkerDeath => {
                // Launches in flight are lost; their rows never count as computed.
                let done = &self.completed;
                self.launches.retain(|s, _| done.contains(s));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(lines: &[&str]) -> Result<TraceSummary, Violation> {
        check_trace(lines.join("\n").as_bytes())
    }

    const ADMIT_A: &str =
        r#"{"boundary":"admission","req":1,"known_len":4,"computed_len":0,"pending":4}"#;
    const PREP_A: &str = r#"{"boundary":"batch_preparation","req":1,"launch":1,"positions":[0,4],"pages":[0],"known_len":4,"computed_len":0,"pending":4}"#;
    const DONE_1: &str = r#"{"boundary":"forward_execution","launch":1}"#;

    #[test]
    fn accepts_a_clean_trace() {
        let s = check(&[
            ADMIT_A,
            PREP_A,
            DONE_1,
            r#"{"boundary":"sampling","req":1,"launch":1,"known_len":5,"computed_len":4,"pending":1}"#,
            r#"{"boundary":"publication","req":1,"launch":1,"known_len":5,"computed_len":4,"pending":1}"#,
            r#"{"boundary":"finish","req":1,"known_len":5,"computed_len":4,"pending":1}"#,
            r#"{"boundary":"retire","req":1,"launch":1,"pages":[0]}"#,
            r#"{"boundary":"release","launch":1}"#,
            r#"{"boundary":"reclaim","launch":1,"pages":[0],"evidence":"min_released=1"}"#,
        ])
        .unwrap();
        assert_eq!(s.reclaimed_pages, 1);
        assert_eq!(s.published, 1);
    }

    #[test]
    fn rejects_a_page_reused_before_its_launch_is_released() {
        let e = check(&[
            ADMIT_A,
            PREP_A,
            r#"{"boundary":"cancel","req":1,"known_len":4,"computed_len":0,"pending":4}"#,
            r#"{"boundary":"retire","req":1,"launch":1,"pages":[0]}"#,
            r#"{"boundary":"reclaim","launch":1,"pages":[0],"evidence":"min_released=0"}"#,
        ])
        .unwrap_err();
        assert_eq!(e.line, 5, "{e}");
        assert!(e.message.contains("unreleased"), "{e}");
    }

    #[test]
    fn rejects_an_output_published_after_cancel() {
        let e = check(&[
            ADMIT_A,
            PREP_A,
            r#"{"boundary":"cancel","req":1,"known_len":4,"computed_len":0,"pending":4}"#,
            DONE_1,
            r#"{"boundary":"publication","req":1,"launch":1,"known_len":4,"computed_len":4,"pending":0}"#,
        ])
        .unwrap_err();
        assert_eq!(e.line, 5, "{e}");
        assert!(e.message.contains("after its cancel"), "{e}");
    }

    #[test]
    fn rejects_known_len_that_is_not_computed_plus_pending() {
        let e = check(&[
            ADMIT_A,
            PREP_A,
            DONE_1,
            r#"{"boundary":"sampling","req":1,"launch":1,"known_len":5,"computed_len":4,"pending":2}"#,
        ])
        .unwrap_err();
        assert_eq!(e.line, 4, "{e}");
        assert!(e.message.contains("pending"), "{e}");
    }

    const ADMIT_B: &str =
        r#"{"boundary":"admission","req":2,"known_len":4,"computed_len":0,"pending":4}"#;
    /// Request 1 computes page 0; request 2 takes it from the cache and launches with it.
    const SHARED: [&str; 6] = [
        ADMIT_A,
        PREP_A,
        DONE_1,
        ADMIT_B,
        r#"{"boundary":"cache_hit","req":2,"pages":[0],"known_len":4,"computed_len":2,"pending":2}"#,
        r#"{"boundary":"batch_preparation","req":2,"launch":2,"positions":[2,2],"pages":[0,1],"known_len":4,"computed_len":2,"pending":2}"#,
    ];

    #[test]
    fn accepts_a_cache_hit_that_shares_a_held_page_and_waits_for_both_holders() {
        let s = check(
            &[
                &SHARED[..],
                &[
                r#"{"boundary":"cancel","req":1,"known_len":4,"computed_len":4,"pending":0}"#,
                r#"{"boundary":"retire","req":1,"launch":1,"pages":[0]}"#,
                r#"{"boundary":"cancel","req":2,"known_len":4,"computed_len":2,"pending":2}"#,
                r#"{"boundary":"retire","req":2,"launch":2,"pages":[1,0]}"#,
                r#"{"boundary":"release","launch":2}"#,
                r#"{"boundary":"reclaim","launch":2,"pages":[1,0],"evidence":"min_released=2"}"#,
                ],
            ]
            .concat(),
        )
        .unwrap();
        assert_eq!(s.reclaimed_pages, 2);
    }

    #[test]
    fn rejects_a_shared_page_reclaimed_before_the_last_holders_launch() {
        let e = check(
            &[
                &SHARED[..],
                &[
                    r#"{"boundary":"cancel","req":2,"known_len":4,"computed_len":2,"pending":2}"#,
                    r#"{"boundary":"retire","req":2,"launch":2,"pages":[1,0]}"#,
                    r#"{"boundary":"cancel","req":1,"known_len":4,"computed_len":4,"pending":0}"#,
                    r#"{"boundary":"retire","req":1,"launch":1,"pages":[0]}"#,
                    r#"{"boundary":"release","launch":1}"#,
                    r#"{"boundary":"reclaim","launch":1,"pages":[0],"evidence":"min_released=1"}"#,
                ],
            ]
            .concat(),
        )
        .unwrap_err();
        assert_eq!(e.line, 12, "{e}");
    }

    /// Request 1 is cancelled with launch 1 unreleased (page 0 retired after 1); request 2
    /// takes page 0 from the cache and launches with it in launch 2.
    const REVIVED: [&str; 7] = [
        ADMIT_A,
        PREP_A,
        DONE_1,
        r#"{"boundary":"cancel","req":1,"known_len":4,"computed_len":4,"pending":0}"#,
        r#"{"boundary":"retire","req":1,"launch":1,"pages":[0]}"#,
        ADMIT_B,
        r#"{"boundary":"cache_hit","req":2,"pages":[0],"known_len":4,"computed_len":2,"pending":2}"#,
    ];

    #[test]
    fn accepts_a_cache_hit_on_a_retired_page_that_then_waits_for_both_launches() {
        let s = check(
            &[
                &REVIVED[..],
                &[
                    r#"{"boundary":"batch_preparation","req":2,"launch":2,"positions":[2,2],"pages":[0,1],"known_len":4,"computed_len":2,"pending":2}"#,
                    r#"{"boundary":"cancel","req":2,"known_len":4,"computed_len":2,"pending":2}"#,
                    r#"{"boundary":"retire","req":2,"launch":2,"pages":[1,0]}"#,
                    r#"{"boundary":"release","launch":2}"#,
                    r#"{"boundary":"reclaim","launch":2,"pages":[1,0],"evidence":"min_released=2"}"#,
                ],
            ]
            .concat(),
        )
        .unwrap();
        assert_eq!(s.reclaimed_pages, 2);
    }

    #[test]
    fn rejects_a_revived_page_reclaimed_at_its_old_retirement() {
        let e = check(
            &[
                &REVIVED[..],
                &[
                    r#"{"boundary":"batch_preparation","req":2,"launch":2,"positions":[2,2],"pages":[0,1],"known_len":4,"computed_len":2,"pending":2}"#,
                    r#"{"boundary":"release","launch":1}"#,
                    r#"{"boundary":"reclaim","launch":1,"pages":[0],"evidence":"min_released=1"}"#,
                ],
            ]
            .concat(),
        )
        .unwrap_err();
        assert_eq!(e.line, 10, "{e}");
    }
}
