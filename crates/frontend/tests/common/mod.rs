//! Test harness: a server over the in-process engine on stories260K, and a tiny raw HTTP/1.1
//! client (no client crate to build).

#![allow(dead_code)]

use baton_frontend::{
    AppState, EngineClient, EngineEvent, EngineLimits, EngineRequest, EngineStats,
    LocalEngineClient, ServerConfig, SubmitError,
};
use baton_scheduler::SchedulerConfig;
use baton_worker::{Backend, CpuBackend};
use serde_json::Value;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The stories260K directory: `BATON_TEST_MODEL` or the shared copy.
pub fn model_dir() -> PathBuf {
    std::env::var_os("BATON_TEST_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/models/stories260K")
        })
}

/// The golden prompts.
pub fn goldens() -> Vec<Value> {
    let text = std::fs::read_to_string(model_dir().join("golden.json")).expect("golden.json");
    let v: Value = serde_json::from_str(&text).expect("golden.json parses");
    v["prompts"].as_array().expect("prompts").clone()
}

/// Server options.
#[derive(Clone, Debug, Default)]
pub struct Opts {
    pub api_key: Option<String>,
    pub chat_template: Option<String>,
    pub max_model_len: Option<usize>,
    pub num_blocks: Option<usize>,
    pub max_num_seqs: Option<usize>,
    /// Sleep this long in every engine step, so timing-dependent tests (disconnects) have
    /// margin on a loaded machine.
    pub step_delay: Option<Duration>,
    /// The server's header read timeout (default: the server's default).
    pub header_read_timeout: Option<Duration>,
    /// CORS settings (default: vLLM's, every origin).
    pub cors: Option<baton_frontend::CorsConfig>,
    /// The scheduler's `--scheduling-policy` (default: fcfs).
    pub scheduling_policy: baton_scheduler::SchedulingPolicy,
    /// Sampling defaults (`--generation-config`; default: none).
    pub sampling_defaults: baton_frontend::validate::SamplingDefaults,
    /// Served names after the first ([`MODEL`]), as `--served-model-name stories b c`.
    pub more_served_model_names: Vec<String>,
    /// `--return-tokens-as-token-ids`.
    pub return_tokens_as_token_ids: bool,
    /// [`ServerConfig::responses_store_bytes`] (0: no store).
    pub responses_store_bytes: usize,
    /// [`ServerConfig::force_include_usage`].
    pub force_include_usage: bool,
    /// The `/v1/models` root ([`AppState::with_model_root`]; default: the server's default).
    pub model_root: Option<String>,
}

/// A backend that sleeps before each launch.
struct Slow<B> {
    inner: B,
    delay: Duration,
}

impl<B: Backend> Backend for Slow<B> {
    fn execute(
        &mut self,
        launch: &baton_proto::Launch,
        tables: &dyn baton_worker::TableReader,
    ) -> Result<baton_proto::Completion, baton_worker::WorkerError> {
        std::thread::sleep(self.delay);
        self.inner.execute(launch, tables)
    }
    fn kv_capacity(&self) -> baton_worker::KvCapacity {
        self.inner.kv_capacity()
    }
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
    fn model_fingerprint(&self) -> u64 {
        self.inner.model_fingerprint()
    }
    fn name(&self) -> &'static str {
        "slow"
    }
}

/// A running server.
pub struct TestServer {
    pub addr: SocketAddr,
    pub engine: Arc<LocalEngineClient>,
    pub state: Arc<AppState>,
    pub shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    pub task: Option<tokio::task::JoinHandle<()>>,
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.task.take() {
            t.abort();
        }
    }
}

pub const MODEL: &str = "stories";

pub async fn start(opts: Opts) -> TestServer {
    let loaded = baton_model::load_model_dir(model_dir()).expect("stories260K loads");
    let eos = loaded.eos_token_ids();
    let max_model_len = opts
        .max_model_len
        .unwrap_or(loaded.config.max_position_embeddings);
    let block_size = 16;
    let max_num_seqs = opts.max_num_seqs.unwrap_or(16);
    let cfg = SchedulerConfig {
        max_num_seqs,
        max_num_batched_tokens: 1024,
        block_size,
        num_blocks: opts
            .num_blocks
            .unwrap_or(max_num_seqs * max_model_len.div_ceil(block_size)),
        max_model_len,
        max_inflight: 2,
        enable_prefix_caching: true,
        policy: opts.scheduling_policy,
        kv_window: None,
    };
    let (model, tokenizer) = loaded.into_cpu_model();
    let backend = CpuBackend::new(model, cfg.num_blocks, cfg.block_size);
    let backend: Box<dyn Backend> = match opts.step_delay {
        Some(delay) => Box::new(Slow {
            inner: backend,
            delay,
        }),
        None => Box::new(backend),
    };
    let engine =
        Arc::new(LocalEngineClient::start(cfg, backend, eos.clone()).expect("engine starts"));
    let config = ServerConfig {
        api_key: opts.api_key,
        more_served_model_names: opts.more_served_model_names,
        chat_template: opts.chat_template,
        header_read_timeout: opts
            .header_read_timeout
            .unwrap_or(baton_frontend::DEFAULT_HEADER_READ_TIMEOUT),
        cors: opts.cors.unwrap_or_default(),
        sampling_defaults: opts.sampling_defaults,
        return_tokens_as_token_ids: opts.return_tokens_as_token_ids,
        responses_store_bytes: opts.responses_store_bytes,
        force_include_usage: opts.force_include_usage,
        ..scripted_config()
    };
    let state = AppState::new(config, tokenizer.expect("tokenizer"), engine.clone(), eos)
        .expect("state builds");
    let state = Arc::new(match opts.model_root {
        Some(root) => state.with_model_root(root),
        None => state,
    });
    let (listener, addr) = baton_frontend::bind("127.0.0.1", 0).await.expect("binds");
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let st = state.clone();
    let task = tokio::spawn(async move {
        let _ = baton_frontend::serve_state(listener, st, async {
            let _ = rx.await;
        })
        .await;
    });
    TestServer {
        addr,
        engine,
        state,
        shutdown: Some(tx),
        task: Some(task),
    }
}

/// An engine that answers each request with the events its script makes for it, so a test can
/// give the HTTP layer events the real engine produces only rarely (errors, EOS).
pub struct Scripted<F>(pub F);

impl<F> EngineClient for Scripted<F>
where
    F: Fn(&EngineRequest) -> Vec<EngineEvent> + Send + Sync + 'static,
{
    fn submit(
        &self,
        req: EngineRequest,
    ) -> Result<(u64, tokio::sync::mpsc::UnboundedReceiver<EngineEvent>), SubmitError> {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        for ev in (self.0)(&req) {
            tx.send(ev).expect("the receiver is here");
        }
        Ok((1, rx))
    }
    fn cancel(&self, _: u64) {}
    fn limits(&self) -> EngineLimits {
        EngineLimits {
            max_model_len: 512,
            // The test model's 512 tokens, padded as models pad theirs, so that a tokenizer
            // with added tokens (`tokenizer_with_specials`) still fits.
            vocab_size: 544,
            max_num_seqs: 1,
            priority_scheduling: false,
        }
    }
    fn health(&self) -> Result<(), String> {
        Ok(())
    }
    fn stats(&self) -> EngineStats {
        EngineStats::default()
    }
}

/// The EOS id of stories260K.
pub const EOS: u32 = 2;

/// A server over [`Scripted`]`(script)` with stories260K's tokenizer and EOS; aborting the task
/// stops it.
pub async fn start_scripted<F>(script: F) -> (SocketAddr, tokio::task::JoinHandle<()>)
where
    F: Fn(&EngineRequest) -> Vec<EngineEvent> + Send + Sync + 'static,
{
    start_scripted_with_template(script, None).await
}

/// [`start_scripted`] with a chat template (for the chat and responses endpoints).
pub async fn start_scripted_with_template<F>(
    script: F,
    chat_template: Option<String>,
) -> (SocketAddr, tokio::task::JoinHandle<()>)
where
    F: Fn(&EngineRequest) -> Vec<EngineEvent> + Send + Sync + 'static,
{
    start_scripted_with_tools(script, chat_template, None).await
}

/// [`start_scripted_with_template`] with `--enable-auto-tool-choice --tool-call-parser P` when
/// `tool_parser` is given.
pub async fn start_scripted_with_tools<F>(
    script: F,
    chat_template: Option<String>,
    tool_parser: Option<baton_frontend::tools::ToolParser>,
) -> (SocketAddr, tokio::task::JoinHandle<()>)
where
    F: Fn(&EngineRequest) -> Vec<EngineEvent> + Send + Sync + 'static,
{
    start_scripted_with_parsers(script, chat_template, tool_parser, None).await
}

/// [`start_scripted_with_tools`] with `--reasoning-parser R` when `reasoning_parser` is given.
pub async fn start_scripted_with_parsers<F>(
    script: F,
    chat_template: Option<String>,
    tool_parser: Option<baton_frontend::tools::ToolParser>,
    reasoning_parser: Option<baton_frontend::reasoning::ReasoningParser>,
) -> (SocketAddr, tokio::task::JoinHandle<()>)
where
    F: Fn(&EngineRequest) -> Vec<EngineEvent> + Send + Sync + 'static,
{
    start_scripted_with_tokenizer(
        script,
        chat_template,
        tool_parser,
        reasoning_parser,
        stories_tokenizer(),
    )
    .await
}

/// The tokenizer of stories260K ([`model_dir`]).
pub fn stories_tokenizer() -> baton_model::Tokenizer {
    baton_model::load_model_dir(model_dir())
        .expect("stories260K loads")
        .tokenizer
        .expect("tokenizer")
}

/// [`start_scripted_with_parsers`] with another tokenizer (see [`tokenizer_with_specials`]).
pub async fn start_scripted_with_tokenizer<F>(
    script: F,
    chat_template: Option<String>,
    tool_parser: Option<baton_frontend::tools::ToolParser>,
    reasoning_parser: Option<baton_frontend::reasoning::ReasoningParser>,
    tok: baton_model::Tokenizer,
) -> (SocketAddr, tokio::task::JoinHandle<()>)
where
    F: Fn(&EngineRequest) -> Vec<EngineEvent> + Send + Sync + 'static,
{
    let cfg = ServerConfig {
        chat_template,
        enable_auto_tool_choice: tool_parser.is_some(),
        tool_call_parser: tool_parser,
        reasoning_parser,
        ..scripted_config()
    };
    let state = Arc::new(
        AppState::new(cfg, tok, Arc::new(Scripted(script)), vec![EOS]).expect("state builds"),
    );
    let (listener, addr) = baton_frontend::bind("127.0.0.1", 0).await.expect("binds");
    let task = tokio::spawn(async move {
        let _ = baton_frontend::serve_state(listener, state, std::future::pending()).await;
    });
    (addr, task)
}

/// The flags of a [`start_scripted`] server: served as [`MODEL`] on any free port, no template,
/// parser, key or sampling defaults.
pub fn scripted_config() -> ServerConfig {
    ServerConfig::new(MODEL)
}

/// A raw HTTP response.
#[derive(Debug)]
pub struct Resp {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Resp {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("body is not JSON ({e}): {}", self.body))
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// SSE `data:` payloads, in order.
    pub fn events(&self) -> Vec<String> {
        self.body
            .split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
            .map(str::to_owned)
            .collect()
    }
}

pub fn request_bytes(method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> Vec<u8> {
    let mut r = format!(
        "{method} {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    if !body.is_empty() {
        r.push_str("Content-Type: application/json\r\n");
    }
    for (k, v) in headers {
        r.push_str(&format!("{k}: {v}\r\n"));
    }
    r.push_str("\r\n");
    r.push_str(body);
    r.into_bytes()
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let Some(eol) = b.windows(2).position(|w| w == b"\r\n") else {
            return out;
        };
        let size_line = std::str::from_utf8(&b[..eol]).unwrap_or("0");
        let size = usize::from_str_radix(size_line.split(';').next().unwrap_or("0").trim(), 16)
            .unwrap_or(0);
        if size == 0 {
            return out;
        }
        b = &b[eol + 2..];
        out.extend_from_slice(&b[..size.min(b.len())]);
        b = &b[(size + 2).min(b.len())..];
    }
}

pub fn parse_response(raw: &[u8]) -> Resp {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a complete header");
    let head = std::str::from_utf8(&raw[..split]).expect("ascii head");
    let mut lines = head.split("\r\n");
    let status: u16 = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .expect("status line");
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect();
    let body = &raw[split + 4..];
    let chunked = headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    let body = if chunked {
        dechunk(body)
    } else {
        body.to_vec()
    };
    Resp {
        status,
        headers,
        body: String::from_utf8(body).expect("UTF-8 body"),
    }
}

pub async fn send(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Resp {
    let mut s = TcpStream::connect(addr).await.expect("connects");
    s.write_all(&request_bytes(method, path, headers, body))
        .await
        .expect("writes");
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(120), s.read_to_end(&mut raw))
        .await
        .expect("response within 120 s")
        .expect("reads");
    parse_response(&raw)
}

pub async fn post(addr: SocketAddr, path: &str, body: &Value) -> Resp {
    send(addr, "POST", path, &[], &body.to_string()).await
}

pub async fn get(addr: SocketAddr, path: &str) -> Resp {
    send(addr, "GET", path, &[], "").await
}

/// Concatenated text of a streamed completions or chat response; panics on a bad stream.
pub fn stream_text(r: &Resp, chat: bool) -> (String, Option<String>) {
    assert_eq!(r.status, 200, "{}", r.body);
    let ev = r.events();
    assert_eq!(ev.last().map(String::as_str), Some("[DONE]"), "{}", r.body);
    let mut text = String::new();
    let mut finish = None;
    for e in &ev[..ev.len() - 1] {
        let v: Value = serde_json::from_str(e).expect("chunk is JSON");
        assert!(v.get("error").is_none(), "error event: {e}");
        for c in v["choices"].as_array().expect("choices") {
            let t = if chat {
                c["delta"]["content"].as_str()
            } else {
                c["text"].as_str()
            };
            text.push_str(t.unwrap_or(""));
            if let Some(f) = c["finish_reason"].as_str() {
                finish = Some(f.to_owned());
            }
        }
    }
    (text, finish)
}

/// Waits until the engine has no live request and every page is free.
pub async fn wait_engine_idle(engine: &LocalEngineClient, within: Duration) -> bool {
    let start = Instant::now();
    while start.elapsed() < within {
        let s = engine.scheduler_stats();
        if s.running == 0 && s.waiting == 0 && s.pool.free == s.pool.total && s.inflight == 0 {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    false
}

/// stories260K's tokenizer with `specials` added as special tokens (ids after its vocabulary),
/// for tests of tokens the test model does not have.
pub fn tokenizer_with_specials(specials: &[&str]) -> baton_model::Tokenizer {
    let path = model_dir().join("tokenizer.json");
    let mut v: Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("tokenizer.json")).unwrap();
    let first = v["model"]["vocab"]
        .as_object()
        .expect("a vocab object")
        .len();
    let added = v["added_tokens"].as_array_mut().expect("added_tokens");
    for (i, content) in specials.iter().enumerate() {
        added.push(
            serde_json::json!({"id": first + i, "content": content, "single_word": false,
            "lstrip": false, "rstrip": false, "normalized": false, "special": true}),
        );
    }
    // One directory per call: tests run in parallel, and one removing its directory must not
    // pull the file from under another.
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "baton-tokenizer-{}-{}",
        std::process::id(),
        CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("tokenizer.json");
    std::fs::write(&file, v.to_string()).unwrap();
    let tok = baton_model::Tokenizer::from_file(&file, baton_model::TokenizerConfig::default())
        .expect("the edited tokenizer loads");
    let _ = std::fs::remove_dir_all(&dir);
    tok
}

/// A scripted engine's answer to a request with a `prompt_len`-token prompt: one `Token`
/// event per id in `ids`, each with log-probability `logprob` and no alternatives, then
/// `Finished` with `reason`.
pub fn token_events(
    ids: &[u32],
    logprob: f32,
    prompt_len: usize,
    reason: baton_scheduler::FinishReason,
) -> Vec<EngineEvent> {
    let mut ev: Vec<EngineEvent> = ids
        .iter()
        .map(|&token| EngineEvent::Token {
            token,
            cached_tokens: 0,
            logprob,
            top: vec![],
            first: None,
        })
        .collect();
    ev.push(EngineEvent::Finished {
        reason,
        prompt_tokens: prompt_len,
        output_tokens: ids.len(),
        cached_tokens: 0,
    });
    ev
}
