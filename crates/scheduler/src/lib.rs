//! The scheduler: who runs next, over which pages (DESIGN.md sections 2 to 5).
//!
//! [`Scheduler`] is a state machine with no I/O of its own: the in-process engine and the
//! `baton scheduler` daemon drive it with the same calls, so there is one scheduler, not two.
//! Page and slot reuse follow the fenced rule of `baton-kv`; the policy here asks that mechanism
//! and never touches a free list directly.

pub mod check;
pub mod daemon;
pub mod phases;
pub mod request;
pub mod scheduler;
pub mod trace;

pub use check::{check_trace, TraceSummary, Violation};
pub use phases::PhaseClock;
pub use request::{
    bad_words_empty_allow_list, lora_salt, min_tokens_empties_allow_list, min_tokens_ids, stop_ids,
    FinishReason, NewRequest, RequestId,
};
pub use scheduler::{
    check_admission, sliding_window_kv, AdmitError, Event, Scheduler, SchedulerConfig,
    SchedulerStats, SchedulingPolicy,
};
pub use trace::{Boundary, TraceRecord, Tracer};
