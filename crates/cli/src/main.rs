//! `baton`: the LLM inference server's command line.

use baton::daemons::{self, SchedulerArgs, WorkerArgs};
use baton::generate::{self, GenerateArgs};
use baton::trace_cmd::{self, TraceCmd};
use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "baton", version, about = "Baton: an LLM inference server")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Generate offline from prompts, in one process.
    Generate(GenerateArgs),
    /// The scheduler daemon: creates the control segment and runs continuous batching.
    Scheduler(SchedulerArgs),
    /// The worker daemon: attaches to a scheduler and runs the model.
    Worker(WorkerArgs),
    /// Lifecycle traces.
    #[command(subcommand)]
    Trace(TraceCmd),
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("BATON_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let res = match cli.cmd {
        Cmd::Generate(a) => generate::run(a),
        Cmd::Trace(c) => trace_cmd::run(c),
        Cmd::Scheduler(a) => daemons::run_scheduler(a),
        Cmd::Worker(a) => daemons::run_worker(a),
    };
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
