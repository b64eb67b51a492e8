//! `baton serve` as a supervisor (DESIGN.md section 6): `/health` reports a dead worker within a
//! second, the worker is restarted and in-flight requests complete; SIGTERM leaves no child and
//! nothing in /dev/shm; after a SIGKILL of `baton serve` every child exits within 2 s.

mod support;

use nix::sys::signal::Signal;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use support::*;

fn serve(instance: &str, port: u16) -> (Proc, String) {
    serve_with(instance, port, &[])
}

fn serve_with(instance: &str, port: u16, extra: &[&str]) -> (Proc, String) {
    serve_on(instance, port, &model_dir(), extra)
}

fn serve_on(instance: &str, port: u16, dir: &std::path::Path, extra: &[&str]) -> (Proc, String) {
    let (child, mut err) = serve_until_ready(instance, port, dir, extra, &[]);
    std::thread::spawn(move || {
        let mut sink = String::new();
        let _ = err.read_to_string(&mut sink);
    });
    (
        Proc {
            child,
            name: "serve",
        },
        format!("127.0.0.1:{port}"),
    )
}

/// Starts `baton serve` and reads its stderr up to the "ready on" line; the caller owns the
/// rest of the pipe.
fn serve_until_ready(
    instance: &str,
    port: u16,
    dir: &std::path::Path,
    extra: &[&str],
    env: &[(&str, &str)],
) -> (std::process::Child, BufReader<std::process::ChildStderr>) {
    // The model as the first argument, as `vllm serve MODEL` takes it (scripts/openai-check.sh
    // and the README give `--model DIR`).
    let mut child = Command::new(env!("CARGO_BIN_EXE_baton"))
        .arg("serve")
        .arg(dir)
        .args([
            "--instance",
            instance,
            "--port",
            &port.to_string(),
            "--max-num-seqs",
            "32",
        ])
        .args(extra)
        .envs(env.iter().copied())
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
        if err.read_line(&mut line).unwrap_or(0) == 0 {
            panic!("baton serve exited before it was ready");
        }
    }
    (child, err)
}

/// `POST /v1/completions` with `body`: the whole response and its JSON body (`null` when it
/// has none).
fn post_completion(addr: &str, body: &serde_json::Value) -> (String, serde_json::Value) {
    let mut s = TcpStream::connect(addr).unwrap();
    let body = body.to_string();
    write!(s, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len()).unwrap();
    let mut resp = String::new();
    let _ = s.read_to_string(&mut resp);
    let json = resp
        .split("\r\n\r\n")
        .nth(1)
        .and_then(|b| serde_json::from_str(b).ok())
        .unwrap_or_default();
    (resp, json)
}

fn health(addr: &str) -> u16 {
    http_get(addr, "/health").0
}

/// `GET path`: the status (0 when the server cannot be reached) and the whole response.
fn http_get(addr: &str, path: &str) -> (u16, String) {
    let Ok(mut s) = TcpStream::connect(addr) else {
        return (0, String::new());
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    let _ = write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    );
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    let status = out
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, out)
}

/// The value of the unlabelled-but-for-the-model sample `name` on a `/metrics` page.
fn metric(page: &str, name: &str) -> f64 {
    page.lines()
        .find(|l| l.starts_with(&format!("{name}{{")) && !l.contains("le="))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{name} missing from /metrics:\n{page}"))
}

/// Children of `pid` (by /proc/*/stat ppid).
fn children(pid: i32) -> Vec<(i32, String)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(p) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else {
            continue;
        };
        let Some(rest) = stat.rsplit_once(") ").map(|(_, r)| r) else {
            continue;
        };
        let fields: Vec<&str> = rest.split_whitespace().collect();
        if fields.get(1).and_then(|f| f.parse::<i32>().ok()) == Some(pid) && fields[0] != "Z" {
            let cmd = std::fs::read_to_string(format!("/proc/{p}/cmdline"))
                .unwrap_or_default()
                .replace('\0', " ");
            out.push((p, cmd));
        }
    }
    out
}

fn stream_completion(addr: &str, max_tokens: u32) -> (String, bool) {
    let body = serde_json::json!({"prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0, "stream": true, "ignore_eos": true}).to_string();
    let mut s = TcpStream::connect(addr).unwrap();
    write!(s, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len()).unwrap();
    let mut text = String::new();
    for line in BufReader::new(s).lines() {
        let Ok(line) = line else { break };
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            return (text, true);
        }
        let v: serde_json::Value = serde_json::from_str(data).unwrap();
        if let Some(t) = v["choices"][0]["text"].as_str() {
            text.push_str(t);
        }
    }
    (text, false)
}

#[test]
fn a_killed_worker_shows_as_503_is_restarted_and_in_flight_requests_complete() {
    let _serial = serial();
    let inst = instance("serve-worker");
    let (serve, addr) = serve(&inst, 18301);
    assert_eq!(health(&addr), 200);
    // A reference run, then the same request with the worker killed in the middle.
    let (reference, done) = stream_completion(&addr, 400);
    assert!(done);
    // The phase histograms across processes: the scheduler's queue and prefill times came
    // with the first token, and its span lies inside the frontend's time to first token.
    let (_, page) = http_get(&addr, "/metrics");
    for phase in ["queue", "prefill", "decode", "inference"] {
        let count = metric(&page, &format!("vllm:request_{phase}_time_seconds_count"));
        assert_eq!(count, 1.0, "{phase}");
    }
    let sum = |name: &str| metric(&page, &format!("vllm:{name}_sum"));
    let (queue, prefill) = (
        sum("request_queue_time_seconds"),
        sum("request_prefill_time_seconds"),
    );
    let (decode, inference) = (
        sum("request_decode_time_seconds"),
        sum("request_inference_time_seconds"),
    );
    let (ttft, e2e) = (
        sum("time_to_first_token_seconds"),
        sum("e2e_request_latency_seconds"),
    );
    assert!(
        queue + prefill <= ttft + 1e-6,
        "queue {queue} + prefill {prefill} > ttft {ttft}"
    );
    assert!(
        prefill > 0.0 && decode > 0.0,
        "prefill {prefill}, decode {decode}"
    );
    assert!(
        decode <= e2e - ttft + 1e-6,
        "decode {decode}, e2e {e2e}, ttft {ttft}"
    );
    assert!(
        (inference - (prefill + decode)).abs() < 1e-9,
        "{inference} != {prefill} + {decode}"
    );
    let a2 = addr.clone();
    let t = std::thread::spawn(move || stream_completion(&a2, 400));
    std::thread::sleep(Duration::from_millis(30));
    let worker = children(serve.pid())
        .into_iter()
        .find(|(_, c)| c.contains(" worker "))
        .expect("worker child");
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(worker.0), Signal::SIGKILL).unwrap();
    let killed = Instant::now();
    let mut saw_503 = false;
    while killed.elapsed() < Duration::from_secs(1) {
        if health(&addr) == 503 {
            saw_503 = true;
            break;
        }
    }
    assert!(
        saw_503,
        "/health never said 503 within 1 s of the worker's death"
    );
    assert!(
        wait_for(Duration::from_secs(30), || health(&addr) == 200),
        "the worker was not restarted"
    );
    let (text, done) = t.join().unwrap();
    assert!(done, "the in-flight request did not complete");
    assert_eq!(
        text, reference,
        "the in-flight request's greedy output changed across the restart"
    );
}

#[test]
fn sigterm_stops_every_child_and_cleans_dev_shm_and_sigkill_takes_the_children_down() {
    let _serial = serial();
    let inst = instance("serve-stop");
    let key = "s3cret-key-for-this-test";
    let origin = "http://ok.example";
    let (mut serve1, addr) = serve_with(
        &inst,
        18302,
        &[
            "--api-key",
            key,
            "--allowed-origins",
            &format!("[\"{origin}\"]"),
            "--allow-credentials",
        ],
    );
    assert_eq!(health(&addr), 200);
    let kids = children(serve1.pid());
    assert_eq!(kids.len(), 3, "{kids:?}");
    // The key reaches the frontend through its environment, never a command line `ps` shows.
    assert!(kids.iter().all(|(_, cmd)| !cmd.contains(key)), "{kids:?}");
    let models = |auth: &str| {
        let mut s = TcpStream::connect(&addr).unwrap();
        write!(
            s,
            "GET /v1/models HTTP/1.1\r\nHost: x\r\n{auth}Connection: close\r\n\r\n"
        )
        .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out.split_whitespace()
            .nth(1)
            .and_then(|c| c.parse::<u16>().ok())
    };
    assert_eq!(models(""), Some(401));
    assert_eq!(
        models(&format!("Authorization: Bearer {key}\r\n")),
        Some(200)
    );
    // The CORS flags reach the frontend child, and a preflight (no key) is answered.
    let mut s = TcpStream::connect(&addr).unwrap();
    write!(
        s,
        "OPTIONS /v1/models HTTP/1.1\r\nHost: x\r\nOrigin: {origin}\r\n\
         Access-Control-Request-Method: GET\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut pre = String::new();
    s.read_to_string(&mut pre).unwrap();
    let pre = pre.to_ascii_lowercase();
    assert!(pre.starts_with("http/1.1 200"), "{pre}");
    assert!(
        pre.contains(&format!("access-control-allow-origin: {origin}\r\n")),
        "{pre}"
    );
    assert!(
        pre.contains("access-control-allow-credentials: true\r\n"),
        "{pre}"
    );
    serve1.signal(Signal::SIGTERM);
    assert!(
        serve1.wait_timeout(Duration::from_secs(20)).is_some(),
        "baton serve ignored SIGTERM"
    );
    for (pid, cmd) in &kids {
        assert!(
            !std::path::Path::new(&format!("/proc/{pid}")).exists()
                || std::fs::read_to_string(format!("/proc/{pid}/stat"))
                    .is_ok_and(|s| s.contains(") Z ")),
            "child {cmd} survived"
        );
    }
    let leftovers: Vec<_> = std::fs::read_dir("/dev/shm")
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(&inst))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");

    let (mut serve2, addr) = serve(&inst, 18303);
    assert_eq!(health(&addr), 200);
    let kids = children(serve2.pid());
    assert_eq!(kids.len(), 3, "{kids:?}");
    serve2.signal(Signal::SIGKILL);
    serve2.wait_timeout(Duration::from_secs(5));
    let t = Instant::now();
    let alive = |pid: i32| {
        std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| !s.contains(") Z "))
    };
    assert!(
        wait_for(Duration::from_secs(2), || kids
            .iter()
            .all(|(p, _)| !alive(*p))),
        "children outlived baton serve by more than 2 s"
    );
    assert!(t.elapsed() <= Duration::from_secs(2));
    // The scheduler got SIGTERM (its parent-death signal) and removed its segment.
    let shm_left = || {
        std::fs::read_dir("/dev/shm")
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.contains(&inst))
            .collect::<Vec<_>>()
    };
    assert!(
        wait_for(Duration::from_secs(2), || shm_left().is_empty()),
        "a SIGKILLed serve left {:?}",
        shm_left()
    );
    // The next start works and stops cleanly.
    let (mut serve3, addr) = serve(&inst, 18304);
    assert_eq!(health(&addr), 200);
    serve3.signal(Signal::SIGTERM);
    assert!(serve3.wait_timeout(Duration::from_secs(20)).is_some());
    assert!(shm_left().is_empty(), "{:?}", shm_left());
    // A scheduler that cannot stop (SIGSTOP here) is SIGKILLed after 5 s and could not unlink
    // its segment: serve removes it once the scheduler is dead.
    let (mut serve4, addr) = serve(&inst, 18312);
    assert_eq!(health(&addr), 200);
    let sched = children(serve4.pid())
        .into_iter()
        .find(|(_, cmd)| cmd.contains(" scheduler "))
        .expect("a scheduler child");
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(sched.0), Signal::SIGSTOP);
    serve4.signal(Signal::SIGTERM);
    assert!(serve4.wait_timeout(Duration::from_secs(30)).is_some());
    assert!(
        shm_left().is_empty(),
        "serve left {:?} after killing a stopped scheduler",
        shm_left()
    );
}

/// A stopped scheduler (SIGSTOP; a hung one alike) while requests overflow the admission
/// ring: the frontend's HTTP runtime keeps answering (no handler waits for ring space on its
/// threads), `/health` turns 503 once the scheduler's loop has been silent for
/// `SCHEDULER_STALL`, the admissions that found no room within 5 s end with a 503 error body,
/// and once the scheduler runs again `/health` is 200 and every admitted request completes.
#[test]
fn a_stopped_scheduler_leaves_the_frontend_answering_and_health_says_so() {
    let _serial = serial();
    let inst = instance("serve-stall");
    let (_serve, addr) = serve(&inst, 18313);
    let sched = children(_serve.pid())
        .into_iter()
        .find(|(_, cmd)| cmd.contains(" scheduler "))
        .expect("a scheduler child");
    let sched = nix::unistd::Pid::from_raw(sched.0);
    // Resumed however the test ends, so a failed assertion leaves no stopped scheduler.
    struct Resume(nix::unistd::Pid);
    impl Drop for Resume {
        fn drop(&mut self) {
            let _ = nix::sys::signal::kill(self.0, Signal::SIGCONT);
        }
    }
    let _resume = Resume(sched);
    let _ = nix::sys::signal::kill(sched, Signal::SIGSTOP);
    // 48 prompts of 400 ids take 26 slots each: more than the 1024-slot admission ring.
    let prompt: Vec<u32> = (0..400u32).map(|i| 3 + i * 37 % 500).collect();
    let clients: Vec<_> = (0..48)
        .map(|_| {
            let addr = addr.clone();
            let body = serde_json::json!({"prompt": prompt, "max_tokens": 4, "temperature": 0})
                .to_string();
            std::thread::spawn(move || {
                let mut s = TcpStream::connect(&addr).unwrap();
                s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
                write!(s, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len()).unwrap();
                let mut resp = String::new();
                let _ = s.read_to_string(&mut resp);
                resp
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    let (models, _) = http_get(&addr, "/v1/models");
    assert_eq!(
        models, 200,
        "the frontend stopped answering while the ring was full"
    );
    // Clients that give up while their admissions wait (cancels queue behind them), then a
    // probe: it is refused 5 s after its submit, while the scheduler is still stopped; the
    // cancels must not hold it up (each used to wait up to 5 s for room).
    for _ in 0..8 {
        let mut s = TcpStream::connect(&addr).unwrap();
        let body = serde_json::json!({"prompt": prompt, "max_tokens": 4}).to_string();
        write!(s, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len()).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        drop(s);
    }
    let probe_sent = Instant::now();
    let (probe, _) = post_completion(
        &addr,
        &serde_json::json!({"prompt": "The cat", "max_tokens": 4}),
    );
    let probe_took = probe_sent.elapsed();
    assert!(probe.starts_with("HTTP/1.1 503"), "{probe}");
    assert!(
        probe_took < Duration::from_secs(7),
        "the probe took {probe_took:?}"
    );
    assert!(
        wait_for(Duration::from_secs(15), || health(&addr) == 503),
        "/health stayed {} with the scheduler stopped",
        health(&addr)
    );
    let _ = nix::sys::signal::kill(sched, Signal::SIGCONT);
    assert!(
        wait_for(Duration::from_secs(10), || health(&addr) == 200),
        "/health did not come back"
    );
    let (mut ok, mut refused) = (0, 0);
    for c in clients {
        let resp = c.join().unwrap();
        let status = resp.split_whitespace().nth(1).unwrap_or("none").to_owned();
        match status.as_str() {
            "200" => {
                assert!(resp.contains("\"completion_tokens\":4"), "{resp}");
                ok += 1;
            }
            "503" => {
                assert!(resp.contains("not accepting requests"), "{resp}");
                refused += 1;
            }
            _ => panic!("a request ended with {status}: {resp}"),
        }
    }
    assert!(ok >= 1 && refused >= 1, "{ok} completed, {refused} refused");
}

/// DESIGN section 6: a hung child is killed by the supervisor. With `--heartbeat-timeout 2`,
/// a frontend stopped with SIGSTOP is killed and restarted (the server answers again, from a
/// new process), and a stopped scheduler is killed and serve stops with an error, leaving
/// nothing in /dev/shm.
#[test]
fn serve_kills_a_hung_frontend_or_scheduler_by_its_heartbeat() {
    let _serial = serial();
    let inst = instance("serve-hung");
    let (mut srv, addr) = serve_with(&inst, 18314, &["--heartbeat-timeout", "2"]);
    let child = |role: &str| {
        children(srv.pid())
            .into_iter()
            .find(|(_, cmd)| cmd.contains(&format!(" {role} ")))
            .map(|(pid, _)| pid)
    };
    let front = child("frontend").expect("a frontend child");
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(front), Signal::SIGSTOP);
    assert!(
        wait_for(Duration::from_secs(20), || child("frontend")
            .is_some_and(|p| p != front)
            && health(&addr) == 200),
        "the stopped frontend was not replaced"
    );
    let (_, v) = post_completion(
        &addr,
        &serde_json::json!({"prompt": "Once upon a time", "max_tokens": 4}),
    );
    assert_eq!(v["usage"]["completion_tokens"], 4, "{v}");
    let sched = child("scheduler").expect("a scheduler child");
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(sched), Signal::SIGSTOP);
    let st = srv.wait_timeout(Duration::from_secs(30));
    assert!(
        st.is_some_and(|s| !s.success()),
        "serve did not stop with an error after its scheduler hung: {st:?}"
    );
    let left: Vec<_> = std::fs::read_dir("/dev/shm")
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(&inst))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

/// `serve --load-format dummy` serves random weights of the config's shape from a directory
/// without safetensors (benchmarks): the scheduler publishes the dummy seed's fingerprint, so
/// the worker it starts attaches and requests complete. Also with the test model's shapes
/// under Qwen2's and Qwen3's architectures (q/k/v biases; per-head q/k norms): the three
/// processes agree on the config's fingerprint and serve it.
#[test]
fn serve_with_dummy_weights_needs_no_safetensors() {
    let _serial = serial();
    let archs = [
        ("llama", None),
        ("qwen2", Some("Qwen2ForCausalLM")),
        ("qwen3", Some("Qwen3ForCausalLM")),
    ];
    for (name, arch) in archs {
        let inst = instance(&format!("serve-dummy-{name}"));
        let dir = edited_model_dir(&format!("serve-dummy-{name}"), |c| {
            if let Some(arch) = arch {
                c["model_type"] = name.into();
                c["architectures"] = serde_json::json!([arch]);
            }
        });
        // With vLLM flags whose value is what Baton does (a copied `vllm serve` line).
        let vllm = [
            "--trust-remote-code",
            "--tensor-parallel-size",
            "1",
            "--disable-log-requests",
            "--disable-log-stats",
        ];
        let (mut serve, addr) = serve_on(
            &inst,
            18305,
            &dir,
            &[&["--load-format", "dummy", "--seed", "9"][..], &vllm].concat(),
        );
        assert_eq!(health(&addr), 200, "{name}");
        let (_, done) = stream_completion(&addr, 8);
        assert!(done, "{name}: a request on dummy weights did not complete");
        // vLLM serves under the `--model` string, so its clients send that: accepted too;
        // another name is a 404.
        for (model, want) in [(dir.display().to_string(), 200), ("nope".into(), 404)] {
            let body = serde_json::json!({"model": model, "prompt": "a", "max_tokens": 1});
            let (resp, _) = post_completion(&addr, &body);
            assert!(
                resp.starts_with(&format!("HTTP/1.1 {want}")),
                "{name} {model}: {resp}"
            );
        }
        serve.signal(Signal::SIGTERM);
        assert!(
            serve.wait_timeout(Duration::from_secs(20)).is_some(),
            "{name}"
        );
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// `--generation-config vllm` takes no sampling defaults from generation_config.json, so a
/// malformed one must not stop `serve`: the scheduler, the worker and the frontend each
/// ignore it (the scheduler and frontend with a warning) and take the stop ids from
/// config.json. Under `auto` serve refuses it at once (`cli_errors.rs`).
#[test]
fn serve_with_generation_config_vllm_starts_despite_a_malformed_generation_config() {
    let _serial = serial();
    let inst = instance("serve-badgen");
    let dir = edited_model_dir("serve-badgen", |_| {});
    std::fs::write(dir.join("generation_config.json"), "{\"eos_token_id\": [2,").unwrap();
    let (mut serve, addr) = serve_on(
        &inst,
        18306,
        &dir,
        &["--load-format", "dummy", "--generation-config", "vllm"],
    );
    assert_eq!(health(&addr), 200);
    let (_, done) = stream_completion(&addr, 8);
    assert!(done, "a request did not complete");
    serve.signal(Signal::SIGTERM);
    assert!(serve.wait_timeout(Duration::from_secs(20)).is_some());
    let _ = std::fs::remove_dir_all(dir);
}

/// `--generation-config DIR` takes the stop ids from DIR's generation_config.json, as vLLM
/// does: with the golden's 5th greedy token as DIR's only `eos_token_id`, a greedy request
/// stops there. `/v1/models` reports the `--model` path as `root`. Under `ignore_eos`,
/// `min_tokens` still holds both EOS ids back, as vLLM's. A structured output may end with
/// DIR's ids.
#[test]
fn serve_with_generation_config_dir_stops_on_its_eos_ids_and_models_report_the_path() {
    let _serial = serial();
    let inst = instance("serve-gendir");
    let (prompt, greedy) = goldens().remove(0);
    let gen_dir = std::env::temp_dir().join(format!("baton-{inst}-gen"));
    std::fs::create_dir_all(&gen_dir).unwrap();
    let stop = greedy[4];
    assert!(
        !greedy[..4].contains(&stop),
        "the stop id must first appear 5th"
    );
    std::fs::write(
        gen_dir.join("generation_config.json"),
        format!("{{\"eos_token_id\": [{stop}]}}"),
    )
    .unwrap();
    let (mut serve, addr) = serve_with(
        &inst,
        18307,
        &["--generation-config", gen_dir.to_str().unwrap()],
    );
    let body = serde_json::json!({"prompt": prompt, "max_tokens": 20, "temperature": 0,
                                  "return_token_ids": true});
    let (resp, json) = post_completion(&addr, &body);
    let choice = &json["choices"][0];
    assert_eq!(choice["finish_reason"], "stop", "{resp}");
    let ids: Vec<u32> = serde_json::from_value(choice["token_ids"].clone()).unwrap();
    assert_eq!(ids, greedy[..5], "{resp}");
    // As vLLM: DIR's eos id is a stop token id (the stop reason names it), and the
    // tokenizer's EOS still ends a request (with no stop reason).
    assert_eq!(choice["stop_reason"], stop, "{resp}");
    let body = serde_json::json!({"prompt": prompt, "max_tokens": 5, "temperature": 0,
                                  "return_token_ids": true, "logit_bias": {"2": 100}});
    let (resp, json) = post_completion(&addr, &body);
    let choice = &json["choices"][0];
    assert_eq!(choice["finish_reason"], "stop", "{resp}");
    assert_eq!(choice["token_ids"], serde_json::json!([2]), "{resp}");
    assert!(choice["stop_reason"].is_null(), "{resp}");
    // Through the rings, min_tokens holds back both EOS ids even under ignore_eos (vLLM's
    // `_all_stop_token_ids`); after it, EOS ends nothing.
    let body = serde_json::json!({"prompt": prompt, "max_tokens": 6, "temperature": 0,
                                  "return_token_ids": true, "logit_bias": {"2": 100},
                                  "ignore_eos": true, "min_tokens": 3});
    let (resp, json) = post_completion(&addr, &body);
    let choice = &json["choices"][0];
    assert_eq!(choice["finish_reason"], "length", "{resp}");
    let ids: Vec<u32> = serde_json::from_value(choice["token_ids"].clone()).unwrap();
    assert!(
        !ids[..3].contains(&2) && !ids[..3].contains(&stop),
        "{resp}"
    );
    assert_eq!(ids[3..], [2, 2, 2], "{resp}");
    // A structured output ends with DIR's stop ids too (the scheduler compiles guides with
    // them): once the choice is written, the biased id of DIR ends the request.
    let body = serde_json::json!({"prompt": prompt, "max_tokens": 10, "temperature": 0,
                                  "guided_choice": ["Hi"], "logit_bias": {stop.to_string(): 100}});
    let (resp, json) = post_completion(&addr, &body);
    let choice = &json["choices"][0];
    assert_eq!(choice["text"], "Hi", "{resp}");
    assert_eq!(choice["finish_reason"], "stop", "{resp}");
    assert_eq!(choice["stop_reason"], stop, "{resp}");
    let (status, models) = http_get(&addr, "/v1/models");
    assert_eq!(status, 200, "{models}");
    let want = serde_json::json!(model_dir().display().to_string()).to_string();
    assert!(models.contains(&format!("\"root\":{want}")), "{models}");
    serve.signal(Signal::SIGTERM);
    assert!(serve.wait_timeout(Duration::from_secs(20)).is_some());
    let _ = std::fs::remove_dir_all(gen_dir);
}

/// Nobody reading serve's stderr any more (`baton serve 2>&1 | head -2` closes the pipe) must
/// not take serve down: it goes on serving, restarts a killed worker (which it logs), and
/// still stops cleanly on SIGTERM. `eprintln!` used to panic it with exit 101 here, and at
/// `BATON_LOG=info` the frontend and worker, which write their logs straight to that pipe,
/// panicked on their next line (tracing-subscriber's fallback `eprintln!`).
#[test]
fn serve_keeps_serving_when_nobody_reads_its_stderr() {
    let _serial = serial();
    let inst = instance("serve-epipe");
    let (child, err) = serve_until_ready(&inst, 18308, &model_dir(), &[], &[("BATON_LOG", "info")]);
    drop(err);
    let mut serve = Proc {
        child,
        name: "serve",
    };
    let addr = "127.0.0.1:18308".to_string();
    let body = serde_json::json!({"prompt": "Once upon a time", "max_tokens": 8});
    let (resp, _) = post_completion(&addr, &body);
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    let worker = children(serve.pid())
        .into_iter()
        .find(|(_, c)| c.contains(" worker "))
        .expect("worker child");
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(worker.0), Signal::SIGKILL).unwrap();
    assert!(
        wait_for(Duration::from_secs(30), || {
            children(serve.pid())
                .iter()
                .any(|(p, c)| c.contains(" worker ") && *p != worker.0)
                && health(&addr) == 200
        }),
        "the worker was not restarted"
    );
    let (resp, _) = post_completion(&addr, &body);
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    serve.signal(Signal::SIGTERM);
    let status = serve
        .wait_timeout(Duration::from_secs(20))
        .expect("baton serve ignored SIGTERM");
    assert!(status.success(), "baton serve exited with {status:?}");
}

/// A LongRoPE model across the processes: the scheduler, the worker and the frontend each set
/// the factors from the served length (`--max-model-len`), so their config fingerprints agree
/// and serve becomes ready either way. stories260K with short LongRoPE factors of 1 and an
/// attention factor of 1 gives the goldens at `--max-model-len 256` (its
/// `original_max_position_embeddings`); served at the model's 512 positions, the long factors
/// of 4 apply to every position and the output departs from them.
#[test]
fn a_longrope_model_serves_with_the_factors_of_its_max_model_len() {
    let _serial = serial();
    let dir = edited_model_dir("serve-longrope", |c| {
        c["original_max_position_embeddings"] = 256.into();
        c["rope_scaling"] = serde_json::json!({"type": "longrope", "attention_factor": 1.0,
            "short_factor": [1.0, 1.0, 1.0, 1.0], "long_factor": [4.0, 4.0, 4.0, 4.0]});
    });
    std::fs::copy(
        model_dir().join("model.safetensors"),
        dir.join("model.safetensors"),
    )
    .unwrap();
    let (prompt, greedy) = goldens().swap_remove(0);
    let body = serde_json::json!({"prompt": prompt, "max_tokens": 24, "temperature": 0,
        "return_token_ids": true});
    for (extra, port, golden) in [
        (&["--max-model-len", "256"][..], 18309, true),
        (&[][..], 18310, false),
    ] {
        let inst = instance(&format!("serve-longrope-{port}"));
        let (mut serve, addr) = serve_on(&inst, port, &dir, extra);
        let (resp, json) = post_completion(&addr, &body);
        let ids: Vec<u32> = json["choices"][0]["token_ids"]
            .as_array()
            .unwrap_or_else(|| panic!("{extra:?}: {resp}"))
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(ids.len(), 24, "{extra:?}: {resp}");
        assert_eq!(ids == greedy[..24], golden, "{extra:?}: {ids:?}");
        serve.signal(Signal::SIGTERM);
        assert!(serve.wait_timeout(Duration::from_secs(20)).is_some());
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// stories260K as a Mistral with a 16-key sliding window, served from a KV pool of 5 pages of
/// 16 (80 tokens): a request holds only its window's pages and a chunk's, so the scheduler
/// publishes the window in the segment header and the frontend admits a 400-token generation
/// that the pool could never hold whole (without the window it would be a 400 naming the
/// pool), and it runs to its length.
#[test]
fn a_sliding_window_model_serves_requests_longer_than_its_kv_pool() {
    let _serial = serial();
    let dir = edited_model_dir("serve-window", |c| {
        c["model_type"] = "mistral".into();
        c["architectures"] = serde_json::json!(["MistralForCausalLM"]);
        c["sliding_window"] = 16.into();
    });
    std::fs::copy(
        model_dir().join("model.safetensors"),
        dir.join("model.safetensors"),
    )
    .unwrap();
    let inst = instance("serve-window");
    let extra = ["--num-blocks", "5", "--max-num-batched-tokens", "32"];
    let (mut serve, addr) = serve_on(&inst, 18311, &dir, &extra);
    let (prompt, _) = goldens().swap_remove(0);
    let body = serde_json::json!({"prompt": prompt, "max_tokens": 400, "temperature": 0,
        "ignore_eos": true, "return_token_ids": true});
    let (resp, json) = post_completion(&addr, &body);
    let ids = json["choices"][0]["token_ids"]
        .as_array()
        .unwrap_or_else(|| panic!("{resp}"));
    assert_eq!(ids.len(), 400, "{resp}");
    assert_eq!(json["choices"][0]["finish_reason"], "length", "{resp}");
    serve.signal(Signal::SIGTERM);
    assert!(serve.wait_timeout(Duration::from_secs(20)).is_some());
    let _ = std::fs::remove_dir_all(dir);
}

/// vLLM's `--seed` on serve (passed to the frontend): requests that give no `seed` sample the
/// same tokens after a restart with the same seed, and the flag needs no dummy weights.
#[test]
fn serve_seed_makes_unseeded_sampling_repeat_across_restarts() {
    let _serial = serial();
    let bodies = [
        serde_json::json!({"prompt": "Once upon a time", "max_tokens": 24, "temperature": 1.0}),
        serde_json::json!({"prompt": "The cat", "max_tokens": 24, "temperature": 1.0, "n": 2}),
    ];
    let texts = |seed: &str| {
        let inst = instance(&format!("serve-seed-{seed}"));
        let (mut serve, addr) = serve_with(&inst, 18315, &["--seed", seed]);
        let out: Vec<String> = bodies
            .iter()
            .flat_map(|b| {
                let (resp, v) = post_completion(&addr, b);
                assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
                v["choices"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|c| c["text"].as_str().unwrap().to_owned())
                    .collect::<Vec<_>>()
            })
            .collect();
        serve.signal(Signal::SIGTERM);
        assert!(serve.wait_timeout(Duration::from_secs(20)).is_some());
        out
    };
    let a = texts("7");
    assert_eq!(a.len(), 3);
    assert_eq!(a, texts("7"), "the same --seed after a restart");
    assert_ne!(a, texts("8"), "another --seed");
}
