//! `baton bench serve`: an online serving benchmark for OpenAI-compatible servers, in the
//! manner of vLLM's `benchmark_serving`.
//!
//! It streams every request through one async HTTP connection pool and measures on the client:
//! time to first token (TTFT), every inter-token gap (ITL), end-to-end latency, output tokens,
//! and errors. Arrivals are Poisson at `--request-rate` (or all at once), optionally capped at
//! `--max-concurrency` requests in flight. Output tokens are counted by re-encoding the
//! generated text with `--tokenizer` when given, else as the number of SSE chunks that carried
//! a token ([`sse::is_token`]); each request asks for `stream_options.include_usage`, and the report counts the
//! requests whose client-side count differs from the server's `usage.completion_tokens`.
//!
//! `baton bench mock-server` ([`mock`]) streams canned tokens as fast as the socket takes
//! them, to show the load generator's own ceiling.

pub mod client;
pub mod dataset;
pub mod mock;
pub mod plot;
pub mod report;
pub mod sse;
pub mod stats;

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use clap::{Args, ValueEnum};
use client::{Http, Outcome, Target};
use rand::{Rng, SeedableRng};
use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Which OpenAI endpoint to load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Endpoint {
    /// `/v1/completions` (`prompt`).
    #[value(name = "/v1/completions")]
    Completions,
    /// `/v1/chat/completions` (one user message).
    #[value(name = "/v1/chat/completions")]
    Chat,
}

impl Endpoint {
    /// The path.
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Completions => "/v1/completions",
            Endpoint::Chat => "/v1/chat/completions",
        }
    }
}

/// Where prompts come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DatasetKind {
    /// Random token ids decoded to text (`--input-len`, `--output-len`, `--range-ratio`).
    Random,
    /// One prompt per line of `--dataset-path`.
    Jsonl,
}

/// How output tokens are counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum CountOutput {
    /// One token per SSE chunk whose first choice has non-empty text, or empty text and a null
    /// finish_reason (a token with no text of its own, such as a special token). Not counted:
    /// the terminal chunk (finish_reason set, empty text), a usage-only chunk, and a chat
    /// chunk that only announces the role. Exact for servers that stream one chunk per token
    /// (vLLM; Baton, except that it sends no chunk for a token whose text is empty, so
    /// such tokens show as usage mismatches).
    Chunks,
    /// Re-encode the generated text with `--tokenizer` (vLLM's benchmark does this); not exact
    /// where detokenize→encode does not round-trip (SentencePiece merges across chunks).
    Tokenizer,
}

/// A request rate: requests/s, or `inf` for all at once.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rate(pub f64);

impl std::str::FromStr for Rate {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s.eq_ignore_ascii_case("inf") {
            return Ok(Rate(f64::INFINITY));
        }
        match s.parse::<f64>() {
            Ok(r) if r > 0.0 && r.is_finite() => Ok(Rate(r)),
            _ => Err(format!(
                "{s:?}: expected a positive number of requests/s or `inf`"
            )),
        }
    }
}

impl std::fmt::Display for Rate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.0.is_infinite() {
            f.write_str("inf")
        } else {
            write!(f, "{}", self.0)
        }
    }
}

/// Flags of `baton bench serve`.
#[derive(Args, Clone, Debug)]
pub struct ServeArgs {
    /// The server, e.g. http://127.0.0.1:8000 (plain HTTP).
    #[arg(long)]
    pub base_url: String,
    /// The endpoint to load.
    #[arg(long, value_enum, default_value = "/v1/completions")]
    pub endpoint: Endpoint,
    /// Model name to request (default: the first of GET /v1/models).
    #[arg(long)]
    pub model: Option<String>,
    /// A Hugging Face model directory whose tokenizer.json draws random prompts and counts
    /// prompt tokens, and output tokens with `--count-output tokenizer` (without it: random
    /// prompts are words of a fixed list, counted as one token each).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// How to count output tokens (the other count, where available, is also checked against
    /// the server's usage and written to the JSON).
    #[arg(long, value_enum, default_value = "chunks")]
    pub count_output: CountOutput,
    /// Where prompts come from.
    #[arg(long, value_enum, default_value = "random")]
    pub dataset: DatasetKind,
    /// The JSONL file for `--dataset jsonl`: per line `{"prompt": TEXT, "max_tokens": N}`
    /// (`max_tokens` optional, else `--output-len`) or a JSON string.
    #[arg(long)]
    pub dataset_path: Option<PathBuf>,
    /// Prompt length of the random dataset, tokens.
    #[arg(long, default_value_t = 128)]
    pub input_len: usize,
    /// `max_tokens` of each request, tokens (random dataset; default for JSONL lines).
    #[arg(long, default_value_t = 64)]
    pub output_len: usize,
    /// Lengths are drawn uniformly from [len·(1−r), len·(1+r)]; 0 ≤ r < 1.
    #[arg(long, default_value_t = 0.0)]
    pub range_ratio: f64,
    /// Requests to send (after the warmup).
    #[arg(long, default_value_t = 1000)]
    pub num_prompts: usize,
    /// Poisson arrival rate, requests/s; `inf` sends all at once.
    #[arg(long, default_value = "inf")]
    pub request_rate: Rate,
    /// Most requests in flight at once (default: no limit).
    #[arg(long)]
    pub max_concurrency: Option<usize>,
    /// Seed of the random dataset and of the arrival times.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Ask the server to ignore EOS (`ignore_eos: true`), so every request makes `max_tokens`.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Sampling temperature sent with each request.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// Requests sent and awaited before the measured run (not counted).
    #[arg(long, default_value_t = 0)]
    pub warmup: usize,
    /// `Authorization: Bearer` key (default: $OPENAI_API_KEY if set).
    #[arg(long)]
    pub api_key: Option<String>,
    /// Give up on a request after this many seconds.
    #[arg(long, default_value_t = 600.0)]
    pub request_timeout: f64,
    /// Threads of the client's async runtime (1 keeps the load generator off the server's
    /// cores as much as possible).
    #[arg(long, default_value_t = 1)]
    pub client_threads: usize,
    /// Write every figure, per-request records and the command line here as JSON.
    #[arg(long)]
    pub result_json: Option<PathBuf>,
    /// Draw TTFT and ITL CDFs and tokens/s over time into this PNG.
    #[arg(long)]
    pub plot: Option<PathBuf>,
}

/// Flags of `baton bench mock-server`.
#[derive(Args, Clone, Debug)]
pub struct MockArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on.
    #[arg(long, default_value_t = 8100)]
    pub port: u16,
    /// Delay between tokens, ms (0: as fast as the client reads).
    #[arg(long, default_value_t = 0.0)]
    pub itl_ms: f64,
    /// Delay before the first token, ms.
    #[arg(long, default_value_t = 0.0)]
    pub ttft_ms: f64,
    /// Threads of the server's async runtime.
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
}

impl ServeArgs {
    /// Checks the flags that clap cannot.
    ///
    /// # Errors
    /// The first bad flag, named.
    pub fn validate(&self) -> Result<()> {
        if self.num_prompts == 0 {
            bail!("--num-prompts must be at least 1");
        }
        if self.max_concurrency == Some(0) {
            bail!("--max-concurrency must be at least 1");
        }
        if !(0.0..1.0).contains(&self.range_ratio) {
            bail!("--range-ratio must be in [0, 1), got {}", self.range_ratio);
        }
        if self.output_len == 0 || self.output_len > u32::MAX as usize {
            bail!("--output-len must be at least 1");
        }
        if self.dataset == DatasetKind::Random && self.input_len == 0 {
            bail!("--input-len must be at least 1");
        }
        if self.dataset == DatasetKind::Jsonl && self.dataset_path.is_none() {
            bail!("--dataset jsonl needs --dataset-path FILE");
        }
        if self.dataset == DatasetKind::Random && self.dataset_path.is_some() {
            bail!("--dataset-path is for --dataset jsonl");
        }
        if !(self.request_timeout > 0.0 && self.request_timeout.is_finite()) {
            bail!("--request-timeout must be a positive number of seconds");
        }
        if self.count_output == CountOutput::Tokenizer && self.tokenizer.is_none() {
            bail!("--count-output tokenizer needs --tokenizer DIR");
        }
        if self.client_threads == 0 {
            bail!("--client-threads must be at least 1");
        }
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            bail!("--temperature must be a non-negative number");
        }
        client::join_url(&self.base_url, self.endpoint.path())?;
        Ok(())
    }

    /// Checks that `--result-json` and `--plot` can be written (see [`check_output_file`]),
    /// so that a bad path fails before the benchmark runs rather than after.
    ///
    /// # Errors
    /// The first output that cannot be written, with its flag and path.
    pub fn check_outputs(&self) -> Result<()> {
        if let Some(p) = &self.result_json {
            check_output_file("--result-json", p)?;
        }
        if let Some(p) = &self.plot {
            check_output_file("--plot", p)?;
        }
        if let (Some(a), Some(b)) = (&self.result_json, &self.plot) {
            if a == b {
                bail!("--result-json and --plot are the same file {}", a.display());
            }
        }
        Ok(())
    }
}

/// Checks that the output file of `flag` can be written, before the benchmark runs: its
/// directory exists and the file opens for writing (a file this creates is removed again; an
/// existing one is left as it was).
///
/// # Errors
/// A missing directory, a path that is a directory, or a file that cannot be opened for
/// writing; the message names the flag and the path.
pub fn check_output_file(flag: &str, path: &std::path::Path) -> Result<()> {
    let shown = path.display();
    if path.as_os_str().is_empty() {
        bail!("{flag}: an empty path");
    }
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => std::path::Path::new("."),
    };
    if !dir.exists() {
        bail!(
            "{flag} {shown}: the directory {} does not exist",
            dir.display()
        );
    }
    if !dir.is_dir() {
        bail!("{flag} {shown}: {} is not a directory", dir.display());
    }
    if path.is_dir() {
        bail!("{flag} {shown}: is a directory, expected a file path");
    }
    let existed = path.exists();
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .with_context(|| format!("{flag} {shown}: cannot be opened for writing"))?;
    if !existed {
        std::fs::remove_file(path)
            .with_context(|| format!("{flag} {shown}: removing the test file"))?;
    }
    Ok(())
}

/// Runs `baton bench serve`: prints the table, writes the JSON and the plot if asked.
///
/// # Errors
/// Bad flags, an output file that cannot be written (checked before the run), an unreachable
/// or non-OpenAI server, a failed warmup, or any failed request (after the report is printed
/// and written).
pub fn run_serve(args: ServeArgs, command_line: String) -> Result<()> {
    args.validate()?;
    args.check_outputs()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.client_threads)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let report = rt.block_on(bench(&args, command_line, progress_bar))?;
    {
        // A closed stdout (`| head`) must not cost the JSON and the plot below, nor panic.
        use std::io::Write as _;
        let _ = std::io::stdout().write_all(report.table().as_bytes());
    }
    if let Some(p) = &args.result_json {
        std::fs::write(p, serde_json::to_vec_pretty(&report)?)
            .with_context(|| format!("writing {}", p.display()))?;
    }
    if let Some(p) = &args.plot {
        let title = format!(
            "{} {} — {} requests, concurrency {}, rate {}",
            args.base_url,
            args.endpoint.path(),
            args.num_prompts,
            args.max_concurrency
                .map_or("unlimited".into(), |c| c.to_string()),
            args.request_rate
        );
        plot::draw(p, &report, &title).with_context(|| format!("writing {}", p.display()))?;
    }
    if report.failed > 0 {
        bail!(
            "{} of {} requests failed; first error: {}",
            report.failed,
            args.num_prompts,
            report.first_error.as_deref().unwrap_or("?")
        );
    }
    Ok(())
}

/// A progress bar on stderr, hidden when stderr is not a terminal.
pub fn progress_bar(n: u64) -> indicatif::ProgressBar {
    if !std::io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let pb = indicatif::ProgressBar::new(n);
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{elapsed_precise} [{bar:40}] {pos}/{len} requests ({per_sec}, eta {eta})",
    ) {
        pb.set_style(style.progress_chars("=> "));
    }
    pb
}

/// Builds the request body for one prompt.
fn request_body(args: &ServeArgs, model: &str, prompt: &dataset::Prompt) -> Bytes {
    let mut v = match args.endpoint {
        Endpoint::Completions => serde_json::json!({"model": model, "prompt": prompt.text}),
        Endpoint::Chat => serde_json::json!({
            "model": model,
            "messages": [{"role": "user", "content": prompt.text}],
        }),
    };
    let o = v.as_object_mut().expect("an object");
    o.insert("max_tokens".into(), prompt.max_tokens.into());
    o.insert("stream".into(), true.into());
    o.insert(
        "stream_options".into(),
        serde_json::json!({"include_usage": true}),
    );
    o.insert("temperature".into(), args.temperature.into());
    if args.ignore_eos {
        o.insert("ignore_eos".into(), true.into());
    }
    Bytes::from(v.to_string())
}

/// Runs the benchmark on the current runtime and returns its report. `bar(n)` makes the
/// progress bar for `n` requests.
///
/// # Errors
/// As [`run_serve`], except that failed requests are in the report, not an error.
pub async fn bench(
    args: &ServeArgs,
    command_line: String,
    bar: impl Fn(u64) -> indicatif::ProgressBar,
) -> Result<report::Report> {
    args.validate()?;
    let tok = match &args.tokenizer {
        Some(d) => Some(dataset::load_tokenizer(d)?),
        None => None,
    };
    let total = args.num_prompts + args.warmup;
    let prompts = match args.dataset {
        DatasetKind::Random => dataset::random(
            tok.as_ref(),
            total,
            args.input_len,
            args.output_len,
            args.range_ratio,
            args.seed,
        )?,
        DatasetKind::Jsonl => dataset::jsonl(
            tok.as_ref(),
            args.dataset_path.as_deref().expect("validated"),
            total,
            args.output_len as u32,
        )?,
    };
    let api_key = args
        .api_key
        .clone()
        .or_else(|| std::env::var("OPENAI_API_KEY").ok());
    let pool = args.max_concurrency.unwrap_or(total).min(4096);
    let http = client::http_client(pool);
    let model = match &args.model {
        Some(m) => m.clone(),
        None => client::list_models(&http, &args.base_url, api_key.as_deref())
            .await?
            .into_iter()
            .next()
            .with_context(|| format!("{}/v1/models lists no model", args.base_url))?,
    };
    let target = Arc::new(Target {
        uri: client::join_url(&args.base_url, args.endpoint.path())?,
        api_key,
        keep_text: tok.is_some(),
        timeout: Duration::from_secs_f64(args.request_timeout),
    });
    let bodies: Vec<(Bytes, u32)> = prompts
        .iter()
        .map(|p| (request_body(args, &model, p), p.max_tokens))
        .collect();
    let (warm, timed) = bodies.split_at(args.warmup);

    if !warm.is_empty() {
        let outs = run_all(
            &http,
            &target,
            warm,
            Rate(f64::INFINITY),
            args.max_concurrency,
            args.seed,
            indicatif::ProgressBar::hidden(),
        )
        .await;
        if let Some(e) = outs.0.iter().find_map(|o| o.error.as_ref()) {
            bail!("a warmup request failed: {e}");
        }
    }

    let pb = bar(timed.len() as u64);
    let (outcomes, duration_s) = run_all(
        &http,
        &target,
        timed,
        args.request_rate,
        args.max_concurrency,
        args.seed,
        pb.clone(),
    )
    .await;
    pb.finish_and_clear();

    let chunks: Vec<u64> = outcomes.iter().map(|o| o.chunks as u64).collect();
    let recount = match &tok {
        Some(t) => {
            let mut v = Vec::with_capacity(outcomes.len());
            for o in &outcomes {
                v.push(t.encode(&o.text, false)?.len() as u64);
            }
            Some(v)
        }
        None => None,
    };
    let (source, output_tokens, other) = match (args.count_output, recount) {
        (CountOutput::Tokenizer, Some(r)) => (report::TokenSource::Tokenizer, r, Some(chunks)),
        (_, r) => (report::TokenSource::SseChunks, chunks, r),
    };
    let prompt_tokens: Vec<u64> = prompts[args.warmup..]
        .iter()
        .map(|p| p.prompt_tokens as u64)
        .collect();
    let config = serde_json::json!({
        "base_url": args.base_url,
        "endpoint": args.endpoint.path(),
        "model": model,
        "tokenizer": args.tokenizer,
        "dataset": format!("{:?}", args.dataset).to_lowercase(),
        "dataset_path": args.dataset_path,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "range_ratio": args.range_ratio,
        "num_prompts": args.num_prompts,
        "request_rate": args.request_rate.to_string(),
        "max_concurrency": args.max_concurrency,
        "seed": args.seed,
        "ignore_eos": args.ignore_eos,
        "temperature": args.temperature,
        "warmup": args.warmup,
        "client_threads": args.client_threads,
        "count_output": format!("{:?}", args.count_output).to_lowercase(),
    });
    Ok(report::build(
        command_line,
        config,
        source,
        &outcomes,
        &output_tokens,
        other.as_deref(),
        &prompt_tokens,
        duration_s,
    ))
}

/// Sends every body (Poisson arrivals at `rate`, at most `max_concurrency` in flight) and
/// returns the outcomes in order and the run's wall time in seconds.
async fn run_all(
    http: &Http,
    target: &Arc<Target>,
    bodies: &[(Bytes, u32)],
    rate: Rate,
    max_concurrency: Option<usize>,
    seed: u64,
    pb: indicatif::ProgressBar,
) -> (Vec<Outcome>, f64) {
    let sem = max_concurrency.map(|c| Arc::new(tokio::sync::Semaphore::new(c)));
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0x9e37_79b9_7f4a_7c15);
    let t0 = Instant::now();
    let mut at = 0f64;
    let mut tasks = Vec::with_capacity(bodies.len());
    for (body, max_tokens) in bodies {
        if rate.0.is_finite() {
            // Exponential gaps: Poisson arrivals.
            let u: f64 = rng.random::<f64>();
            at += -(1.0 - u).ln() / rate.0;
            tokio::time::sleep_until(tokio::time::Instant::from_std(
                t0 + Duration::from_secs_f64(at),
            ))
            .await;
        }
        let permit = match &sem {
            Some(s) => Some(s.clone().acquire_owned().await.expect("never closed")),
            None => None,
        };
        let (http, target, body, max_tokens, pb) = (
            http.clone(),
            target.clone(),
            body.clone(),
            *max_tokens,
            pb.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let o = client::run_one(&http, &target, body, max_tokens, t0).await;
            drop(permit);
            pb.inc(1);
            o
        }));
    }
    let mut outs = Vec::with_capacity(tasks.len());
    for t in tasks {
        outs.push(t.await.unwrap_or_else(|e| Outcome {
            error: Some(format!("the request task failed: {e}")),
            ..Outcome::default()
        }));
    }
    (outs, t0.elapsed().as_secs_f64())
}

/// Runs `baton bench mock-server` until killed.
///
/// # Errors
/// A failed bind.
pub fn run_mock(args: MockArgs) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.threads.max(1))
        .enable_all()
        .build()?;
    rt.block_on(async {
        let addr = format!("{}:{}", args.host, args.port);
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .with_context(|| format!("binding {addr}"))?;
        eprintln!("mock OpenAI server on http://{}", listener.local_addr()?);
        mock::serve(
            listener,
            mock::MockConfig {
                itl: Duration::from_secs_f64(args.itl_ms.max(0.0) / 1e3),
                ttft: Duration::from_secs_f64(args.ttft_ms.max(0.0) / 1e3),
                model: "mock".into(),
            },
        )
        .await?;
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        a: ServeArgs,
    }

    fn args(extra: &[&str]) -> ServeArgs {
        let mut v = vec!["bench", "--base-url", "http://127.0.0.1:1"];
        v.extend_from_slice(extra);
        Cli::try_parse_from(v).expect("flags parse").a
    }

    #[test]
    fn output_paths_are_checked_up_front() {
        let dir = std::env::temp_dir().join(format!("baton-bench-out-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let s = |p: &std::path::Path| p.to_str().unwrap().to_owned();

        // Writable paths pass and leave nothing behind.
        let json = dir.join("r.json");
        let png = dir.join("p.png");
        let a = args(&["--result-json", &s(&json), "--plot", &s(&png)]);
        a.check_outputs().unwrap();
        assert!(!json.exists() && !png.exists());

        // An existing file is kept as it was.
        std::fs::write(&json, "keep").unwrap();
        a.check_outputs().unwrap();
        assert_eq!(std::fs::read_to_string(&json).unwrap(), "keep");

        // A missing directory fails at once, naming the flag and the path.
        let missing = dir.join("no-such-dir").join("r.json");
        let e = format!(
            "{:#}",
            args(&["--result-json", &s(&missing)])
                .check_outputs()
                .unwrap_err()
        );
        assert!(
            e.contains("--result-json") && e.contains(&s(&missing)) && e.contains("does not exist"),
            "{e}"
        );
        let missing_png = dir.join("nope").join("p.png");
        let e = format!(
            "{:#}",
            args(&["--plot", &s(&missing_png)])
                .check_outputs()
                .unwrap_err()
        );
        assert!(e.contains("--plot") && e.contains(&s(&missing_png)), "{e}");

        // A parent that is a file, and a path that is a directory.
        let under_file = json.join("x.png");
        let e = format!(
            "{:#}",
            args(&["--plot", &s(&under_file)])
                .check_outputs()
                .unwrap_err()
        );
        assert!(e.contains("--plot") && e.contains("not a directory"), "{e}");
        let e = format!(
            "{:#}",
            args(&["--result-json", &s(&dir)])
                .check_outputs()
                .unwrap_err()
        );
        assert!(
            e.contains("--result-json") && e.contains("is a directory"),
            "{e}"
        );

        // A bare file name is relative to the current directory.
        check_output_file("--plot", std::path::Path::new("baton-bench-probe.png")).unwrap();
        assert!(!std::path::Path::new("baton-bench-probe.png").exists());

        std::fs::remove_dir_all(&dir).ok();
    }
}
