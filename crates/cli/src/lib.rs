//! The `baton` command: the offline engine and the entry points of every process.
//!
//! The offline path runs the same [`baton_scheduler::Scheduler`] and the same
//! [`baton_worker::Backend`] as the daemons, connected by in-process queues instead of rings.

/// `eprintln!` that never panics: when nobody reads stderr any more (`baton serve 2>&1 | head -2`
/// closes the pipe), the line is dropped and the process goes on serving. `eprintln!` panics on
/// EPIPE, which took `baton serve` down with exit 101.
#[macro_export]
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

/// `println!` that never panics, for report lines: a closed stdout (`baton bench decode | head -3`)
/// drops them. Output a caller must not lose goes through `writeln!` and `?` instead.
#[macro_export]
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}

/// The error of a command whose stdout reader went away (`baton generate ... | head -1`):
/// `main` ends quietly with status 0 on it, as a C tool dies of SIGPIPE (Rust ignores SIGPIPE,
/// so the write fails with EPIPE instead).
#[derive(Debug)]
pub struct ClosedStdout;

impl std::fmt::Display for ClosedStdout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("stdout was closed")
    }
}

impl std::error::Error for ClosedStdout {}

pub mod args;
pub mod bench;
pub mod bench_decode;
pub mod cuda_args;
pub mod daemons;
pub mod debug_cmd;
pub mod engine;
pub mod frontend_cmd;
pub mod generate;
pub mod gguf_model;
pub mod serve;
pub mod trace_cmd;
