//! The lifecycle trace: one JSON line per ownership transition (DESIGN.md section 2).
//!
//! Each line names the boundary, the request, the owner after it, `known_len`, `computed_len`,
//! the launch sequence number and the evidence that allowed the transition (for example the
//! `released` value that allowed a reclaim). `baton trace check` replays a trace and verifies the
//! reclamation and cancellation invariants on it.

use crate::request::RequestId;
use baton_proto::LaunchSeq;
use serde::{Deserialize, Serialize};
use std::io::Write;

/// A boundary a request, a launch or a page crosses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Boundary {
    /// The scheduler took the request (owner: scheduler).
    Admission,
    /// A row of launch `launch` was prepared for the request; `pages` are the block-table
    /// entries the launch refers to.
    BatchPreparation,
    /// The worker reported launch `launch` complete (the completion message).
    ForwardExecution,
    /// The worker released launch `launch` (its fence passed); `launch` is the new minimum over
    /// live consumers.
    Release,
    /// A token sampled by launch `launch` reached the scheduler.
    Sampling,
    /// A token was published to the request's frontend.
    Publication,
    /// A sampled token was dropped: the request ended or was preempted before it arrived.
    Suppressed,
    /// The request was cancelled (client, stop string, frontend death).
    Cancel,
    /// The request was preempted; it will recompute from its known history.
    Preempt,
    /// The request ended (`evidence` holds the finish reason).
    Finish,
    /// `pages` were retired after launch `launch`.
    Retire,
    /// `pages` retired after launch `launch` went back to the free list; `evidence` is the
    /// released value that allowed it.
    Reclaim,
    /// A worker died; every page it held is invalid.
    WorkerDeath,
    /// The request took `pages` from the prefix cache as its first block-table entries (shared
    /// with other holders, or reclaimed pages that kept their content); they count as computed
    /// (`computed_len`).
    CacheHit,
}

/// One line of the trace.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TraceRecord {
    /// Which boundary.
    pub boundary: Option<Boundary>,
    /// The request, when the transition concerns one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub req: Option<RequestId>,
    /// Who owns the request (or page) after the transition.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    /// Prompt plus accepted outputs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub known_len: Option<usize>,
    /// Positions whose KV is written and fenced.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub computed_len: Option<usize>,
    /// Known positions not yet computed (`known_len - computed_len` by the scheduler's count).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending: Option<usize>,
    /// The launch concerned.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub launch: Option<LaunchSeq>,
    /// Row positions `[first, first + n)` for batch preparation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub positions: Option<(usize, usize)>,
    /// Pages concerned.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pages: Option<Vec<u32>>,
    /// The sampled or published token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<u32>,
    /// What allowed the transition.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub evidence: Option<String>,
}

impl TraceRecord {
    /// A record for `boundary`.
    pub fn new(boundary: Boundary) -> Self {
        Self {
            boundary: Some(boundary),
            ..Default::default()
        }
    }
}

/// Where the scheduler writes its trace.
pub struct Tracer {
    out: Box<dyn Write + Send>,
}

impl Tracer {
    /// A tracer writing JSON lines to `out`.
    pub fn new(out: Box<dyn Write + Send>) -> Self {
        Self { out }
    }

    /// A buffered tracer writing to a new file at `path`.
    pub fn to_file(path: &std::path::Path) -> std::io::Result<Self> {
        let f = std::fs::File::create(path)?;
        Ok(Self::new(Box::new(std::io::BufWriter::new(f))))
    }

    /// Writes one record. Trace I/O errors are logged once and otherwise ignored: a full disk
    /// must not stop serving.
    pub fn emit(&mut self, rec: &TraceRecord) {
        let mut line = serde_json::to_vec(rec).unwrap_or_default();
        line.push(b'\n');
        if let Err(e) = self.out.write_all(&line) {
            tracing::warn!("trace write failed: {e}");
        }
    }

    /// Flushes buffered lines.
    pub fn flush(&mut self) {
        let _ = self.out.flush();
    }
}

impl Drop for Tracer {
    fn drop(&mut self) {
        self.flush();
    }
}
