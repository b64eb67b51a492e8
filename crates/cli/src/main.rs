//! `baton`: the LLM inference server's command line.

use baton::bench::{self, BenchCmd};
use baton::daemons::{self, SchedulerArgs, WorkerArgs};
use baton::debug_cmd::{self, DebugCmd};
use baton::frontend_cmd::{self, FrontendArgs};
use baton::generate::{self, GenerateArgs};
use baton::serve::{self, ServeArgs};
use baton::trace_cmd::{self, TraceCmd};
use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser)]
// A flag given twice takes its last value, as vLLM's argparse does (copied command lines
// repeat flags).
#[command(
    name = "baton",
    version,
    about = "Baton: an LLM inference server",
    args_override_self = true
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Serve a model over the OpenAI API: scheduler, worker and frontend as child processes.
    Serve(Box<ServeArgs>),
    /// Generate offline from prompts, in one process.
    Generate(GenerateArgs),
    /// The scheduler daemon: creates the control segment and runs continuous batching.
    Scheduler(SchedulerArgs),
    /// The worker daemon: attaches to a scheduler and runs the model.
    Worker(WorkerArgs),
    /// The HTTP frontend (OpenAI API): attaches to a scheduler.
    Frontend(FrontendArgs),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCmd),
    /// Lifecycle traces.
    #[command(subcommand)]
    Trace(TraceCmd),
    /// Device bring-up checks against the CPU reference (used by scripts/gpu-check.sh).
    #[command(subcommand, hide = true)]
    Debug(DebugCmd),
}

/// Every option value may be a negative number (`--seed -1` is then refused by the option's
/// own parser or range check, naming it, instead of clap's "unexpected argument '-1'").
fn allow_negative_values(cmd: clap::Command) -> clap::Command {
    let cmd = cmd.mut_args(|a| {
        if a.get_action().takes_values() {
            a.allow_negative_numbers(true)
        } else {
            a
        }
    });
    let subs: Vec<String> = cmd
        .get_subcommands()
        .map(|s| s.get_name().to_owned())
        .collect();
    subs.into_iter()
        .fold(cmd, |c, name| c.mut_subcommand(name, allow_negative_values))
}

fn parse_cli() -> Cli {
    let args = baton::args::expand_vllm_short_flags(std::env::args_os().collect());
    let matches =
        allow_negative_values(<Cli as clap::CommandFactory>::command()).get_matches_from(args);
    <Cli as clap::FromArgMatches>::from_arg_matches(&matches).unwrap_or_else(|e| e.exit())
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("BATON_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(|| QuietStderr)
        // Colours only on a terminal, so redirected logs stay plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = parse_cli();
    let res = match cli.cmd {
        Cmd::Generate(a) => generate::run(a),
        Cmd::Serve(a) => serve::run(*a),
        Cmd::Trace(c) => trace_cmd::run(c),
        Cmd::Debug(c) => debug_cmd::run(c),
        Cmd::Bench(c) => bench::run(c),
        Cmd::Frontend(a) => frontend_cmd::run(a),
        Cmd::Scheduler(a) => daemons::run_scheduler(a),
        Cmd::Worker(a) => daemons::run_worker(a),
    };
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.is::<baton::ClosedStdout>() => ExitCode::SUCCESS,
        Err(e) => {
            baton::say!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// stderr for log lines, dropping what cannot be written. On a write error tracing-subscriber
/// reports it with `eprintln!`, which panics on a closed pipe (`baton serve 2>&1 | head -2`
/// at `BATON_LOG=info`): a daemon's log line is not worth the daemon.
struct QuietStderr;

impl std::io::Write for QuietStderr {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let _ = std::io::stderr().write_all(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        let _ = std::io::stderr().flush();
        Ok(())
    }
}
