//! The `baton` command: the offline engine and the entry points of every process.
//!
//! The offline path runs the same [`baton_scheduler::Scheduler`] and the same
//! [`baton_worker::Backend`] as the daemons, connected by in-process queues instead of rings.

pub mod args;
pub mod bench;
pub mod bench_decode;
pub mod cuda_args;
pub mod daemons;
pub mod debug_cmd;
pub mod engine;
pub mod frontend_cmd;
pub mod generate;
pub mod serve;
pub mod trace_cmd;
