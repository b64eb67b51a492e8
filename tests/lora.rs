//! LoRA adapters through the processes (vLLM's `--enable-lora --lora-modules`): a request
//! whose `model` names an adapter runs with it through frontend, scheduler and worker, gives
//! what `baton generate --lora` computes in-process, never reuses the base model's cached
//! prefix blocks, and reports the adapter's name; the base model is untouched; processes
//! with different adapter lists refuse to attach; bad adapters stop `serve` at start.

mod support;

use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;
use support::*;

/// A seeded random adapter of stories260K's shape in a fresh temp directory.
fn adapter(tag: &str, seed: u64) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("baton-{}-lora-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let cfg = baton_model::ModelConfig::from_file(&model_dir().join("config.json")).unwrap();
    baton_model::lora::write_dummy_adapter(&dir, &cfg, 4, 8.0, 0.25, seed).expect("adapter");
    dir
}

/// A prompt of more than two KV pages (16 tokens each), so the prefix cache holds blocks of it.
const PROMPT: &str =
    "Once upon a time, there was a little girl named Lily. She loved to play outside \
                      in the park with her friends and her dog";

fn complete(addr: &str, model: &str) -> (String, Value) {
    let (status, v) = http(
        addr,
        "POST",
        "/v1/completions",
        Some(&json!({"model": model, "prompt": PROMPT, "max_tokens": 24, "temperature": 0})),
    );
    assert_eq!(status, 200, "{model}: {v}");
    (v["choices"][0]["text"].as_str().unwrap().to_string(), v)
}

/// `baton generate` (in-process engine) of PROMPT, greedy, 24 tokens, with `extra` flags.
fn generate(extra: &[String]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_baton"))
        .arg("generate")
        .arg("--model")
        .arg(model_dir())
        .args([
            "--prompt",
            PROMPT,
            "--max-tokens",
            "24",
            "--temperature",
            "0",
        ])
        .args(extra)
        .output()
        .expect("run generate");
    assert!(
        out.status.success(),
        "generate failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .trim_end_matches('\n')
        .to_string()
}

fn lora_flags(a: &Path, b: &Path) -> Vec<String> {
    vec![
        "--enable-lora".into(),
        "--lora-modules".into(),
        format!("alpha={}", a.display()),
        format!(r#"{{"name": "beta", "path": "{}"}}"#, b.display()),
    ]
}

#[test]
fn requests_naming_an_adapter_run_with_it_and_the_base_model_is_untouched() {
    let _g = serial();
    let (a, b) = (adapter("a", 1), adapter("b", 2));
    let flags = lora_flags(&a, &b);
    // Expected texts from the in-process engine, one process per adapter.
    let want_base = generate(&[]);
    let with = |name: &str| {
        let mut f = flags.clone();
        f.extend(["--lora".into(), name.into()]);
        generate(&f)
    };
    let (want_a, want_b) = (with("alpha"), with("beta"));
    assert_ne!(want_a, want_base, "the adapter changes nothing");
    assert_ne!(want_a, want_b);

    let (mut serve, addr) = spawn_serve(&model_dir(), &instance("lora"), &flags);
    // The base model first: its prompt blocks enter the prefix cache, and an adapter's
    // request with the same prompt must not reuse them.
    let (base, v) = complete(&addr, "stories260K");
    assert_eq!(base, want_base);
    assert_eq!(v["model"], "stories260K");
    let (alpha, v) = complete(&addr, "alpha");
    assert_eq!(alpha, want_a);
    assert_eq!(v["model"], "alpha");
    let (beta, _) = complete(&addr, "beta");
    assert_eq!(beta, want_b);
    // Again, now from cached blocks of each.
    assert_eq!(complete(&addr, "alpha").0, want_a);
    assert_eq!(complete(&addr, "stories260K").0, want_base);

    // Several adapters in one batch: concurrent requests.
    let threads: Vec<_> = ["alpha", "stories260K", "beta", "alpha", "beta"]
        .into_iter()
        .map(|m| {
            let addr = addr.clone();
            std::thread::spawn(move || (m, complete(&addr, m).0))
        })
        .collect();
    for t in threads {
        let (m, text) = t.join().unwrap();
        let want = match m {
            "alpha" => &want_a,
            "beta" => &want_b,
            _ => &want_base,
        };
        assert_eq!(&text, want, "{m} in a mixed batch");
    }

    // /v1/models lists the adapters with the base model as parent.
    let (status, v) = http(&addr, "GET", "/v1/models", None);
    assert_eq!(status, 200);
    let ids: Vec<&str> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["stories260K", "alpha", "beta"]);
    assert_eq!(v["data"][1]["parent"], "stories260K");
    assert_eq!(v["data"][1]["root"], a.display().to_string());
    let (status, v) = http(&addr, "GET", "/v1/models/beta", None);
    assert_eq!((status, &v["id"]), (200, &json!("beta")));

    // An unknown name is a 404 naming the model.
    let (status, v) = http(
        &addr,
        "POST",
        "/v1/completions",
        Some(&json!({"model": "gamma", "prompt": "x", "max_tokens": 1})),
    );
    assert_eq!(status, 404, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("gamma"));

    serve.signal(nix::sys::signal::Signal::SIGTERM);
    assert!(serve.wait_timeout(Duration::from_secs(20)).is_some());
    for d in [a, b] {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// `baton ARGS`: exit code and stderr, within 60 s.
fn baton_err(args: &[String]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_baton"))
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run baton");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn a_worker_or_frontend_with_other_adapters_refuses_to_attach() {
    let _g = serial();
    let a = adapter("attach", 3);
    let inst = instance("lora-attach");
    let module = format!("alpha={}", a.display());
    let mut sched = scheduler(&inst, &["--enable-lora", "--lora-modules", &module]);
    std::thread::sleep(Duration::from_millis(500));
    let m = model_dir().display().to_string();
    for (who, extra) in [
        ("worker", vec!["--attach-timeout", "20"]),
        ("frontend", vec!["--port", "0"]),
    ] {
        let mut args: Vec<String> = vec![who.into(), "--instance".into(), inst.clone()];
        args.extend(["--model".into(), m.clone()]);
        args.extend(extra.iter().map(|s| s.to_string()));
        let (code, err) = baton_err(&args);
        assert_ne!(code, 0, "{who} attached without the adapters");
        assert!(
            err.contains("--lora-modules are not the scheduler's"),
            "{who}: {err}"
        );
    }
    sched.signal(nix::sys::signal::Signal::SIGTERM);
    assert!(sched.wait_timeout(Duration::from_secs(20)).is_some());

    // A scheduler checks the adapters against its model before it starts.
    let mut cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(a.join("adapter_config.json")).unwrap())
            .unwrap();
    cfg["use_dora"] = json!(true);
    std::fs::write(a.join("adapter_config.json"), cfg.to_string()).unwrap();
    let args: Vec<String> = [
        "scheduler",
        "--instance",
        &inst,
        "--model",
        &m,
        "--enable-lora",
        "--lora-modules",
        &module,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let (code, err) = baton_err(&args);
    assert_ne!(code, 0);
    assert!(err.contains("use_dora"), "{err}");
    let _ = std::fs::remove_dir_all(a);
}

#[test]
fn bad_lora_flags_and_adapters_stop_serve_before_it_starts() {
    let a = adapter("bad", 4);
    let m = model_dir().display().to_string();
    let serve = |extra: &[&str]| {
        let mut v: Vec<String> = vec!["serve".into(), m.clone(), "--port".into(), "0".into()];
        v.extend(extra.iter().map(|s| s.to_string()));
        baton_err(&v)
    };
    let module = format!("alpha={}", a.display());
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["--lora-modules", &module], "needs --enable-lora"),
        (
            vec![
                "--enable-lora",
                "--lora-modules",
                "alpha=/nonexistent/adapter",
            ],
            "/nonexistent/adapter/adapter_config.json",
        ),
        (
            vec![
                "--enable-lora",
                "--lora-modules",
                &module,
                "--max-lora-rank",
                "2",
            ],
            "above --max-lora-rank 2",
        ),
        (
            vec!["--enable-lora", "--lora-modules", "stories260K=/x"],
            "base model's served name",
        ),
        (
            vec!["--enable-lora", "--lora-modules", "noequals"],
            "NAME=PATH",
        ),
        (vec!["--max-lora-rank", "1024"], "from 1 to 512"),
    ];
    for (flags, says) in cases {
        let (code, err) = serve(&flags);
        assert_ne!(code, 0, "{flags:?}");
        assert!(err.contains(says), "{flags:?}: {err}");
        assert!(!err.contains("panicked"), "{flags:?}: {err}");
    }
    let (code, err) = baton_err(&[
        "generate".into(),
        "--model".into(),
        m.clone(),
        "--prompt".into(),
        "x".into(),
        "--lora".into(),
        "alpha".into(),
    ]);
    assert_ne!(code, 0);
    assert!(err.contains("--lora alpha: no such adapter"), "{err}");
    let _ = std::fs::remove_dir_all(a);
}
