//! Killing a frontend mid-request leaks nothing and disturbs no other request (DESIGN.md
//! sections 5 and 6): 8 concurrent streams over two `baton frontend` processes; SIGKILL the one
//! serving 4 of them; the other 4 finish with exactly the tokens they produce alone; the pool
//! returns to full; a new frontend takes the freed slot. Twenty times.

mod support;

use nix::sys::signal::Signal;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use support::*;

fn frontend(instance: &str) -> (Proc, String) {
    frontend_with(instance, &[])
}

fn frontend_with(instance: &str, extra: &[&str]) -> (Proc, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_baton"))
        .args(["frontend", "--instance", instance, "--port", "0", "--model"])
        .arg(model_dir())
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn frontend");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line
        .trim()
        .trim_start_matches("listening on http://")
        .to_owned();
    assert!(!addr.is_empty(), "frontend did not start");
    (
        Proc {
            child,
            name: "frontend",
        },
        addr,
    )
}

fn http(addr: &str, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    write!(s, "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len()).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let code = out
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = out.split("\r\n\r\n").nth(1).unwrap_or("").to_owned();
    (code, body)
}

/// Streams a completion; returns the concatenated text and whether `[DONE]` arrived.
fn stream(addr: &str, prompt: &str, max_tokens: u32, chunks: Arc<AtomicUsize>) -> (String, bool) {
    let body = serde_json::json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": true, "ignore_eos": true}).to_string();
    let Ok(mut s) = TcpStream::connect(addr) else {
        return (String::new(), false);
    };
    let _ = write!(s, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len());
    let mut text = String::new();
    for line in BufReader::new(s).lines() {
        let Ok(line) = line else { return (text, false) };
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            return (text, true);
        }
        let v: serde_json::Value = serde_json::from_str(data).unwrap();
        if let Some(t) = v["choices"][0]["text"].as_str() {
            text.push_str(t);
            chunks.fetch_add(1, Ordering::Relaxed);
        }
    }
    (text, false)
}

fn kv_usage(addr: &str) -> f64 {
    let (_, body) = http(addr, "GET", "/metrics", "");
    body.lines()
        .find(|l| l.starts_with("vllm:kv_cache_usage_perc"))
        .and_then(|l| l.split_whitespace().last())
        .and_then(|v| v.parse().ok())
        .unwrap_or(f64::NAN)
}

#[test]
fn killing_a_frontend_mid_stream_leaks_nothing_and_disturbs_no_other_request() {
    let _serial = serial();
    let inst = instance("fkill");
    let _s = scheduler(&inst, &["--num-blocks", "512", "--frontends", "2"]);
    let _w = worker(&inst);
    let (_b, addr_b) = frontend(&inst);
    assert!(wait_for(Duration::from_secs(20), || http(
        &addr_b, "GET", "/health", ""
    )
    .0 == 200));
    let prompts: Vec<String> = (0..8)
        .map(|i| format!("Once upon a time, story number {i} began with a"))
        .collect();
    let max_tokens = 300;
    // Reference: each survivor alone.
    let reference: Vec<String> = prompts[4..]
        .iter()
        .map(|p| {
            let body = serde_json::json!({"prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true}).to_string();
            let (code, body) = http(&addr_b, "POST", "/v1/completions", &body);
            assert_eq!(code, 200, "{body}");
            let v: serde_json::Value = serde_json::from_str(&body).unwrap();
            v["choices"][0]["text"].as_str().unwrap().to_owned()
        })
        .collect();
    for round in 0..20 {
        // A new frontend takes the slot the previous victim freed (there are only 2).
        let (mut a, addr_a) = frontend(&inst);
        let a_chunks = Arc::new(AtomicUsize::new(0));
        let mut threads = Vec::new();
        for (i, p) in prompts.iter().enumerate() {
            let (addr, chunks) = if i < 4 {
                (addr_a.clone(), a_chunks.clone())
            } else {
                (addr_b.clone(), Arc::new(AtomicUsize::new(0)))
            };
            let p = p.clone();
            threads.push(std::thread::spawn(move || {
                stream(&addr, &p, max_tokens, chunks)
            }));
        }
        let t0 = Instant::now();
        while a_chunks.load(Ordering::Relaxed) < 8 && t0.elapsed() < Duration::from_secs(30) {
            std::thread::sleep(Duration::from_millis(1));
        }
        a.signal(Signal::SIGKILL);
        a.wait_timeout(Duration::from_secs(5));
        let results: Vec<(String, bool)> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        assert!(
            results[..4].iter().any(|(_, done)| !done),
            "round {round}: the kill came after the victims finished"
        );
        for (i, (text, done)) in results[4..].iter().enumerate() {
            assert!(done, "round {round}: survivor {i} did not finish");
            assert_eq!(
                text, &reference[i],
                "round {round}: survivor {i} was disturbed"
            );
        }
        assert!(
            wait_for(Duration::from_secs(10), || kv_usage(&addr_b) == 0.0),
            "round {round}: pool not back to full after the fences (kv usage {})",
            kv_usage(&addr_b)
        );
    }
    // The last freed slot serves a new frontend too.
    let (_c, addr_c) = frontend(&inst);
    assert!(wait_for(Duration::from_secs(10), || http(
        &addr_c, "GET", "/health", ""
    )
    .0 == 200));
    let (code, _) = http(
        &addr_c,
        "POST",
        "/v1/completions",
        r#"{"prompt":"The cat","max_tokens":4}"#,
    );
    assert_eq!(code, 200);
}

/// A scheduler that dies takes its segment's attachers with it: the worker and a standalone
/// frontend exit non-zero (a restarted scheduler makes a new segment they could never reach),
/// so a supervisor restarts them instead of leaving them serving 503s forever.
#[test]
fn worker_and_frontend_exit_when_their_scheduler_dies() {
    let _serial = serial();
    let inst = instance("schedgone");
    let s = scheduler(&inst, &["--num-blocks", "64"]);
    let mut w = worker(&inst);
    let _link = connect(&inst);
    let (mut f, addr) = frontend(&inst);
    assert_eq!(http(&addr, "GET", "/health", "").0, 200);
    s.signal(Signal::SIGKILL);
    let ws = w.wait_timeout(Duration::from_secs(20));
    assert!(
        ws.is_some_and(|st| !st.success()),
        "worker after its scheduler died: {ws:?}"
    );
    let fs = f.wait_timeout(Duration::from_secs(20));
    assert!(
        fs.is_some_and(|st| !st.success()),
        "frontend after its scheduler died: {fs:?}"
    );
    let _ = baton_ipc::Segment::remove_stale(&inst);
}

#[test]
fn without_a_worker_requests_fail_with_503_after_the_worker_timeout_then_run_once_one_attaches() {
    let _serial = serial();
    let inst = instance("noworker");
    let _s = scheduler(&inst, &["--num-blocks", "64"]);
    let (_f, addr) = frontend_with(&inst, &["--worker-timeout", "2"]);
    let body = r#"{"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}"#;
    assert_eq!(http(&addr, "GET", "/health", "").0, 503);
    // Waits for a worker, then fails with an OpenAI error body instead of hanging.
    let t = Instant::now();
    let (code, err) = http(&addr, "POST", "/v1/completions", body);
    assert_eq!(code, 503, "{err}");
    let v: serde_json::Value = serde_json::from_str(&err).expect("JSON error body");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("no worker"),
        "{err}"
    );
    assert!(t.elapsed() < Duration::from_secs(20), "{:?}", t.elapsed());
    // Past the timeout, new requests are refused at once.
    let t = Instant::now();
    assert_eq!(http(&addr, "POST", "/v1/completions", body).0, 503);
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    // A worker attaches: requests run again, and the refused ones left nothing behind.
    let _w = worker(&inst);
    assert!(wait_for(Duration::from_secs(30), || http(
        &addr, "GET", "/health", ""
    )
    .0 == 200));
    let (code, out) = http(&addr, "POST", "/v1/completions", body);
    assert_eq!(code, 200, "{out}");
    assert!(wait_for(Duration::from_secs(10), || kv_usage(&addr) == 0.0));
}

/// A SIGKILLed scheduler takes the instance down: a live stream ends with an error event that
/// says 503 (unavailable: retry elsewhere or later), not 500, and the frontend exits non-zero.
#[test]
fn a_dead_scheduler_ends_live_streams_with_a_503_error_event_and_the_frontend_exits() {
    let _serial = serial();
    let inst = instance("schedkill");
    let s = scheduler(&inst, &["--num-blocks", "64"]);
    let _w = worker(&inst);
    let (mut fe, addr) = frontend(&inst);
    assert!(wait_for(Duration::from_secs(20), || http(
        &addr, "GET", "/health", ""
    )
    .0 == 200));
    let body = serde_json::json!({"prompt": "Once upon a time", "max_tokens": 480,
        "temperature": 0, "stream": true, "ignore_eos": true})
    .to_string();
    let mut conn = TcpStream::connect(&addr).unwrap();
    write!(conn, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len()).unwrap();
    let mut lines = BufReader::new(conn).lines();
    // Wait for the first token, then kill the scheduler mid-stream.
    let first = lines
        .by_ref()
        .map_while(Result::ok)
        .find(|l| l.starts_with("data: "));
    assert!(first.is_some(), "no first chunk");
    s.signal(Signal::SIGKILL);
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    let errors: Vec<&String> = rest.iter().filter(|l| l.contains("\"error\"")).collect();
    assert!(
        errors.iter().any(|l| l.contains("503")),
        "no 503 error event after the scheduler died: {:?}",
        &rest[rest.len().saturating_sub(3)..]
    );
    let st = fe.wait_timeout(Duration::from_secs(20));
    assert!(
        st.is_some_and(|s| !s.success()),
        "the frontend did not exit non-zero: {st:?}"
    );
    // A SIGKILLed scheduler leaves its segment for the next start to reuse; this instance name
    // is never started again.
    let _ = std::fs::remove_file(format!("/dev/shm/baton-{inst}"));
}
