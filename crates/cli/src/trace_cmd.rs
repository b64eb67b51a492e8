//! `baton trace check FILE`: verifies a lifecycle trace (see `baton_scheduler::check`).

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use std::path::PathBuf;

/// `baton trace …`
#[derive(Subcommand, Clone, Debug)]
pub enum TraceCmd {
    /// Verify the reclamation and cancellation invariants on a trace; names the first violation.
    Check(CheckArgs),
}

/// Flags of `baton trace check`.
#[derive(Args, Clone, Debug)]
pub struct CheckArgs {
    /// A trace written with `--trace FILE`.
    pub file: PathBuf,
}

/// Runs a `baton trace` subcommand. Exit status: 0 clean, 1 on a violation or unreadable file.
///
/// # Errors
/// An unreadable file or the first violation.
pub fn run(cmd: TraceCmd) -> Result<()> {
    match cmd {
        TraceCmd::Check(a) => {
            let f = std::fs::File::open(&a.file)
                .with_context(|| format!("opening trace {}", a.file.display()))?;
            let s = baton_scheduler::check_trace(std::io::BufReader::new(f))
                .map_err(|v| anyhow::anyhow!("{}: {v}", a.file.display()))?;
            outln!(
                "ok: {} lines, {} requests, {} launches ({} membership changes), {} tokens published, {} cancels, {} pages reclaimed, {} requests finished with a launch in flight",
                s.lines, s.requests, s.launches, s.membership_changes, s.published, s.cancels, s.reclaimed_pages, s.finished_with_launch_in_flight
            );
            Ok(())
        }
    }
}
