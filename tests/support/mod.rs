//! Helpers for multi-process tests: start the `baton` daemons as child processes, connect a
//! test client to their segment, and collect outputs.
#![allow(dead_code)]

use baton_proto::link::{Admission, FrontendLink};
use baton_proto::wire::{reason, to_frontend};
use baton_proto::SamplingParams;
use serde_json::Value;
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The test model.
pub fn model_dir() -> PathBuf {
    std::env::var_os("BATON_TEST_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/models/stories260K")
        })
}

/// A child process killed (SIGKILL) when dropped.
pub struct Proc {
    pub child: Child,
    pub name: &'static str,
}

impl Proc {
    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    pub fn signal(&self, sig: nix::sys::signal::Signal) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.pid()), sig);
    }

    /// Waits for exit up to `timeout`; returns the status if it exited.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(Some(s)) = self.child.try_wait() {
                return Some(s);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        // SIGTERM first, so a scheduler unlinks its segment; SIGKILL if it does not exit.
        self.signal(nix::sys::signal::Signal::SIGTERM);
        if self.wait_timeout(Duration::from_secs(5)).is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Multi-process tests in one binary run one at a time: each starts several processes, and on a
/// 2-core machine running them all at once only measures the machine's load.
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// A unique instance name for one test.
pub fn instance(name: &str) -> String {
    format!("t{}-{name}", std::process::id())
}

pub fn baton() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_baton"));
    c.stdin(Stdio::null()).stdout(Stdio::null());
    if std::env::var_os("BATON_TEST_LOGS").is_none() {
        c.stderr(Stdio::null());
    }
    c
}

/// Starts `baton scheduler` with `extra` flags.
pub fn scheduler(instance: &str, extra: &[&str]) -> Proc {
    scheduler_on(instance, &model_dir(), extra)
}

/// Starts `baton scheduler --model DIR` with `extra` flags.
pub fn scheduler_on(instance: &str, dir: &std::path::Path, extra: &[&str]) -> Proc {
    let child = baton()
        .args(["scheduler", "--instance", instance, "--model"])
        .arg(dir)
        .args(extra)
        .spawn()
        .expect("spawn scheduler");
    Proc {
        child,
        name: "scheduler",
    }
}

/// Starts `baton worker --device cpu` on the test model.
pub fn worker(instance: &str) -> Proc {
    worker_on(instance, &model_dir(), &[])
}

/// Starts `baton worker --model DIR` with `extra` flags.
pub fn worker_on(instance: &str, dir: &std::path::Path, extra: &[&str]) -> Proc {
    let child = baton()
        .args([
            "worker",
            "--instance",
            instance,
            "--attach-timeout",
            "60",
            "--model",
        ])
        .arg(dir)
        .args(extra)
        .spawn()
        .expect("spawn worker");
    Proc {
        child,
        name: "worker",
    }
}

/// Connects a test frontend once the scheduler is up and a worker attached.
pub fn connect(instance: &str) -> FrontendLink {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut link = loop {
        match FrontendLink::connect(instance) {
            Ok(l) => break l,
            Err(e) if Instant::now() >= deadline => panic!("could not connect to {instance}: {e}"),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    };
    loop {
        match link.health() {
            Ok(()) => return link,
            Err(e) => assert!(
                Instant::now() < deadline,
                "{instance} never became healthy: {e}"
            ),
        }
        link.poll(Duration::from_millis(20));
    }
}

/// One request for [`run`].
#[derive(Clone, Debug)]
pub struct Req {
    pub id: u64,
    pub prompt: Vec<u32>,
    pub max_tokens: u32,
    pub params: SamplingParams,
    pub stop_token_ids: Vec<u32>,
    /// `(token, bias)`; `params.logit_bias_len` is set from it on submit.
    pub logit_bias: Vec<(u32, f32)>,
    /// Hashed `cache_salt` (0: none).
    pub cache_salt: u64,
    /// The structured-output constraint's wire form (empty: none).
    pub constraint: Vec<u8>,
    /// The constraint applies after this token is sampled (the end of the reasoning).
    pub guide_after: Option<u32>,
    /// vLLM's `priority` (0 unless the scheduler runs `--scheduling-policy priority`).
    pub priority: i32,
    /// vLLM's `bad_words` as token sequences (empty: none).
    pub bad_words: Vec<Vec<u32>>,
}

/// What came back for one request.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Out {
    pub tokens: Vec<u32>,
    /// Final reason code (`wire::reason`), or `u32::MAX` for an error.
    pub reason: u32,
    /// The error code (`wire::error`) when the request ended with an error.
    pub error: Option<u32>,
    pub finishes: u32,
    /// Prompt log-probabilities `(pos, token, logprob, top ids then the token's rank)`, in
    /// arrival order.
    pub prompt: Vec<(u32, u32, f32, Vec<u32>)>,
}

/// Submits `reqs`, then collects outputs until every one finished (or `timeout`).
pub fn run(link: &mut FrontendLink, reqs: &[Req], timeout: Duration) -> HashMap<u64, Out> {
    for r in reqs {
        submit(link, r);
    }
    collect(link, reqs.len(), timeout, |_, _| {})
}

/// Submits one request.
pub fn submit(link: &mut FrontendLink, r: &Req) {
    link.submit(
        &Admission {
            req: r.id,
            prompt: &r.prompt,
            stop_token_ids: &r.stop_token_ids,
            eos_ids: &[],
            max_tokens: r.max_tokens,
            params: r.params,
            ignore_eos: false,
            logit_bias: &r.logit_bias,
            min_tokens: 0,
            cache_salt: r.cache_salt,
            constraint: &r.constraint,
            guide_after: r.guide_after,
            priority: r.priority,
            bad_words: &r.bad_words,
            lora: 0,
        },
        Duration::from_secs(5),
    )
    .expect("submit");
}

/// Collects until `n` requests finished; `on_token(total_tokens, link)` runs after each token.
pub fn collect(
    link: &mut FrontendLink,
    n: usize,
    timeout: Duration,
    mut on_token: impl FnMut(usize, &mut FrontendLink),
) -> HashMap<u64, Out> {
    let mut outs: HashMap<u64, Out> = HashMap::new();
    let mut finished = 0;
    let mut tokens = 0;
    let deadline = Instant::now() + timeout;
    while finished < n {
        assert!(
            Instant::now() < deadline,
            "timed out with {finished}/{n} finished"
        );
        let Some(m) = link.poll(Duration::from_millis(50)) else {
            continue;
        };
        let o = outs.entry(m.req).or_default();
        match m.kind {
            to_frontend::TOKEN => {
                assert_eq!(
                    o.finishes, 0,
                    "request {} got a token after finishing",
                    m.req
                );
                o.tokens.push(m.token);
                tokens += 1;
                on_token(tokens, link);
            }
            to_frontend::PROMPT_LOGPROB => {
                assert!(
                    o.tokens.is_empty() && o.finishes == 0,
                    "request {} got a prompt log-probability after its first token",
                    m.req
                );
                let mut top = m.top_ids[..m.n_top as usize].to_vec();
                top.push(m.output_tokens);
                o.prompt.push((m.detail, m.token, m.logprob, top));
            }
            to_frontend::FINISHED => {
                o.finishes += 1;
                o.reason = m.reason;
                finished += 1;
            }
            to_frontend::ERROR => {
                o.finishes += 1;
                o.reason = u32::MAX;
                o.error = Some(m.reason);
                finished += 1;
            }
            k => panic!("unknown output kind {k}"),
        }
    }
    outs
}

/// Golden prompts: (prompt_ids, greedy_ids).
pub fn goldens() -> Vec<(Vec<u32>, Vec<u32>)> {
    let text = std::fs::read_to_string(model_dir().join("golden.json")).expect("golden.json");
    let v: serde_json::Value = serde_json::from_str(&text).expect("golden.json parses");
    let ids = |x: &serde_json::Value| {
        x.as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect::<Vec<_>>()
    };
    v["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (ids(&p["prompt_ids"]), ids(&p["greedy_ids"])))
        .collect()
}

/// Deterministic prompts of mixed lengths.
pub fn mixed_prompts(n: usize, seed: usize) -> Vec<Vec<u32>> {
    (0..n)
        .map(|i| {
            let len = 1 + (i * 13 + seed) % 60;
            let mut p = vec![1u32];
            p.extend((0..len).map(|j| 3 + ((i * 31 + j * 17 + seed * 7) % 500) as u32));
            p
        })
        .collect()
}

/// Reason code to name.
pub fn reason_name(r: u32) -> &'static str {
    match r {
        reason::STOP => "stop",
        reason::LENGTH => "length",
        reason::ABORT => "abort",
        reason::CANCELLED => "cancelled",
        _ => "error",
    }
}

/// Waits until `f()` holds or `timeout` passes; returns whether it held.
pub fn wait_for(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    f()
}

/// Runs `baton ARGS` until it exits or `timeout` passes (then SIGKILL); returns the exit status
/// (`None` when it had to be killed) and what it wrote to stderr.
pub fn baton_to_exit(
    args: &[&std::ffi::OsStr],
    timeout: Duration,
) -> (Option<std::process::ExitStatus>, String) {
    use std::io::Read;
    let child = Command::new(env!("CARGO_BIN_EXE_baton"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn baton");
    let mut p = Proc {
        child,
        name: "baton",
    };
    let status = p.wait_timeout(timeout);
    if status.is_none() {
        let _ = p.child.kill();
        let _ = p.child.wait();
    }
    let mut err = String::new();
    if let Some(mut e) = p.child.stderr.take() {
        let _ = e.read_to_string(&mut err);
    }
    (status, err)
}

/// A copy of the test model's config and tokenizer files in a fresh temporary directory, with
/// `edit` applied to `config.json` (weights are not copied: load it with `--load-format dummy`).
pub fn edited_model_dir(name: &str, edit: impl FnOnce(&mut serde_json::Value)) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("baton-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp model dir");
    let src = model_dir();
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        if src.join(f).exists() {
            std::fs::copy(src.join(f), dir.join(f)).expect("copy tokenizer file");
        }
    }
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    edit(&mut cfg);
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    dir
}

/// Starts `baton serve MODEL` on a free port; returns it with its address once ready.
pub fn spawn_serve(model: &std::path::Path, instance: &str, extra: &[String]) -> (Proc, String) {
    let (p, addr, _) = spawn_serve_ready(model, instance, extra);
    (p, addr)
}

/// [`spawn_serve`], also returning serve's ready line.
pub fn spawn_serve_ready(
    model: &std::path::Path,
    instance: &str,
    extra: &[String],
) -> (Proc, String, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_baton"))
        .arg("serve")
        .arg(model)
        .args(["--instance", instance, "--port", "0"])
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn serve");
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut line = String::new();
    while !line.contains("ready on") {
        line.clear();
        assert!(Instant::now() < deadline, "baton serve never became ready");
        assert!(
            err.read_line(&mut line).unwrap_or(0) > 0,
            "baton serve exited before it was ready"
        );
    }
    let addr = line
        .split("http://")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .expect("address on the ready line")
        .trim_end_matches(',')
        .to_string();
    std::thread::spawn(move || {
        let mut sink = String::new();
        let _ = err.read_to_string(&mut sink);
    });
    (
        Proc {
            child,
            name: "serve",
        },
        addr,
        line,
    )
}

/// `method path` with an optional JSON body: the status and the JSON body (`null` if none).
pub fn http(addr: &str, method: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
    let mut s = TcpStream::connect(addr).unwrap();
    let body = body.map(Value::to_string).unwrap_or_default();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut resp = String::new();
    let _ = s.read_to_string(&mut resp);
    let status = resp
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let json = resp
        .split("\r\n\r\n")
        .nth(1)
        .and_then(|b| serde_json::from_str(b).ok())
        .unwrap_or_default();
    (status, json)
}
