//! Bad command-line input gets a clear message and a non-zero exit, never a panic.

mod common;

use std::process::Command;

/// Runs `baton generate --model <test model> <extra…>` (with `--max-tokens 2` unless `extra`
/// sets it); returns (exit code, stderr).
fn generate(extra: &[&str]) -> (Option<i32>, String) {
    let max: &[&str] = if extra.contains(&"--max-tokens") {
        &[]
    } else {
        &["--max-tokens", "2"]
    };
    let out = generate_in(&common::model_dir(), &[max, extra].concat());
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Runs `baton generate --model <model> --prompt <the first golden prompt> <extra…>`.
fn generate_in(model: &std::path::Path, extra: &[&str]) -> std::process::Output {
    generate_cmd(model, extra).output().expect("run baton")
}

/// The command [`generate_in`] runs.
fn generate_cmd(model: &std::path::Path, extra: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_baton"));
    cmd.arg("generate")
        .arg("--model")
        .arg(model)
        .args(["--prompt", &common::goldens()[0].prompt])
        .args(extra);
    cmd
}

#[test]
fn out_of_range_sampling_and_length_flags_are_refused_with_their_name() {
    let cases: &[(&[&str], &str)] = &[
        (&["--temperature", "-1"], "--temperature"),
        (&["--temperature", "inf"], "--temperature"),
        (&["--temperature", "NaN"], "--temperature"),
        (&["--top-p", "-0.5"], "--top-p"),
        (&["--min-p", "-1"], "--min-p"),
        (&["--top-k", "-2"], "--top-k"),
        (&["--presence-penalty", "2.5"], "--presence-penalty"),
        (&["--frequency-penalty", "-3"], "--frequency-penalty"),
        (&["--repetition-penalty", "0"], "--repetition-penalty"),
        (&["--repetition-penalty", "NaN"], "--repetition-penalty"),
        (&["--min-tokens", "17"], "--min-tokens"),
        (&["--max-model-len", "1"], "--max-model-len"),
        (&["--max-model-len", "0"], "--max-model-len"),
        (&["--num-blocks", "1"], "--num-blocks"),
        // A negative number is a value, refused by the option's parser (not "unexpected
        // argument '-1'").
        (&["--seed", "-1"], "--seed"),
        (&["--max-tokens", "-5"], "--max-tokens"),
    ];
    for (flags, name) in cases {
        let (code, err) = generate(flags);
        assert!(
            matches!(code, Some(c) if c != 0 && c != 101),
            "{flags:?}: exit {code:?}: {err}"
        );
        assert!(
            err.contains(name),
            "{flags:?}: message does not name {name}: {err}"
        );
        assert!(!err.contains("panicked"), "{flags:?}: {err}");
    }
}

/// Sizes a typo could ask for: request slots or frontend rings that would make a segment of
/// terabytes (the scheduler sat in its set-up for minutes, past SIGTERM, with gigabytes
/// resident), pages past the u32 ids of the block tables or whose bookkeeping alone exceeds the
/// host's memory (it aborted on the allocation), and negative attach timeouts (taken as 0).
/// Each is refused at start-up with the flag named, leaving no segment.
#[test]
fn sizes_past_the_segment_pool_or_host_and_negative_timeouts_are_refused() {
    let model = common::model_dir();
    let inst = format!("sizes-{}", std::process::id());
    let mut cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["serve", "--max-num-seqs", "65537"],
            "--max-num-seqs 65537 exceeds 65536",
        ),
        (
            vec!["scheduler", "--max-num-seqs", "1000000000"],
            "--max-num-seqs",
        ),
        (
            vec!["generate", "--prompt", "x", "--max-num-seqs", "70000"],
            "--max-num-seqs",
        ),
        (
            vec!["serve", "--num-blocks", "4294967295"],
            "--num-blocks 4294967295 exceeds",
        ),
        (vec!["serve", "--frontends", "0"], "--frontends"),
        (
            vec!["scheduler", "--frontends", "100000"],
            "expected 1 to 1024",
        ),
        (vec!["worker", "--attach-timeout", "-1"], "--attach-timeout"),
        (
            vec!["frontend", "--attach-timeout", "-1"],
            "--attach-timeout",
        ),
    ];
    // 4294967294 pages' bookkeeping is about 160 GiB: refused on any host with less free.
    let pages = "4294967294";
    let need = 4_294_967_294u64 * baton_kv::PagePool::BYTES_PER_PAGE as u64;
    if baton_model::host_memory_available().is_some_and(|a| a < need) {
        cases.push((vec!["scheduler", "--num-blocks", pages], "bookkeeping"));
    }
    for (args, want) in &cases {
        let mut full: Vec<&std::ffi::OsStr> = args.iter().map(|a| os(a)).collect();
        if args[0] != "generate" {
            full.extend([os("--instance"), os(&inst)]);
        }
        if matches!(args[0], "serve" | "frontend") {
            full.extend([os("--port"), os("0")]);
        }
        full.extend([os("--model"), model.as_os_str()]);
        let (code, err) = run_bounded(&full, &format!("{args:?}"));
        assert_fails_with(code, &err, want, args);
        let shm = std::path::Path::new("/dev/shm").join(format!("baton-{inst}"));
        assert!(!shm.exists(), "{args:?} left {}", shm.display());
    }
}

#[test]
fn valid_edge_values_are_accepted() {
    let (code, err) = generate(&["--temperature", "0", "--max-model-len", "8"]);
    assert_eq!(code, Some(0), "{err}");
}

#[test]
fn an_empty_prompts_file_is_named() {
    let f = std::env::temp_dir().join(format!("baton-empty-{}.txt", std::process::id()));
    std::fs::write(&f, "\n\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_baton"))
        .arg("generate")
        .arg("--model")
        .arg(common::model_dir())
        .arg("--prompts-file")
        .arg(&f)
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&f);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("has no prompts"), "{err}");
}

#[test]
fn generation_clipped_at_the_model_length_says_so() {
    let (code, err) = generate(&[
        "--temperature",
        "0",
        "--max-model-len",
        "8",
        "--max-tokens",
        "50",
    ]);
    assert_eq!(code, Some(0), "{err}");
    assert!(err.contains("maximum model length (8 tokens)"), "{err}");
}

/// Runs `baton ARGS` with a bounded wait (a command that starts anyway would run until killed,
/// which fails the test); returns the exit code and stderr.
fn run_bounded(args: &[&std::ffi::OsStr], what: &str) -> (Option<i32>, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_baton"))
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run baton");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let status = loop {
        if let Some(st) = child.try_wait().expect("wait") {
            break st;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what} did not exit");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert!(!err.contains("panicked"), "{what}: {err}");
    (status.code(), err)
}

fn os(s: &str) -> &std::ffi::OsStr {
    std::ffi::OsStr::new(s)
}

/// A clean failure: a non-zero exit that is not a panic (101), with `want` in the message.
fn assert_fails_with(code: Option<i32>, err: &str, want: &str, what: &dyn std::fmt::Debug) {
    assert!(
        matches!(code, Some(c) if c != 0 && c != 101),
        "{what:?}: exit {code:?}: {err}"
    );
    assert!(err.contains(want), "{what:?}: no {want:?} in: {err}");
}

#[test]
fn serve_with_cuda_on_a_machine_without_a_driver_fails_at_once_with_a_hint() {
    if baton_cuda::backend::driver_available() {
        return; // a GPU machine: this check is about machines without one
    }
    let model = common::model_dir();
    let inst = format!("cuda-nodrv-{}", std::process::id());
    let (code, err) = run_bounded(
        &[
            os("serve"),
            os("--device"),
            os("cuda"),
            os("--port"),
            os("0"),
            os("--instance"),
            os(&inst),
            os("--model"),
            model.as_os_str(),
        ],
        "serve --device cuda without a driver",
    );
    assert_fails_with(code, &err, "--device cpu", &"");
}

/// A worker checks what it can before it waits (here up to 10 minutes) for its scheduler: the
/// GPU for `--device cuda`, and the model.
#[test]
fn a_worker_reports_a_missing_driver_or_a_bad_model_before_waiting_for_its_scheduler() {
    let inst = format!("no-sched-{}", std::process::id());
    let model = common::model_dir();
    let worker = |extra: &[&std::ffi::OsStr]| {
        let mut args = vec![
            os("worker"),
            os("--instance"),
            os(&inst),
            os("--attach-timeout"),
            os("600"),
        ];
        args.extend_from_slice(extra);
        run_bounded(&args, "a worker without a scheduler")
    };
    if !baton_cuda::backend::driver_available() {
        let (code, err) = worker(&[os("--device"), os("cuda"), os("--model"), model.as_os_str()]);
        assert_fails_with(code, &err, "--device cpu", &"worker");
    }
    let (code, err) = worker(&[os("--model"), os("/nonexistent/model")]);
    assert_fails_with(code, &err, "/nonexistent/model", &"worker");
    let (code, err) = worker(&[]);
    assert_fails_with(code, &err, "--model", &"worker");
}

/// Every command that runs on CUDA opens the GPU before it loads or generates weights, so on a
/// machine without a driver it fails at once with the hint (an 8B dummy model would otherwise
/// be generated first: 32 GB of host memory).
#[test]
fn cuda_commands_fail_before_loading_weights_without_a_driver() {
    if baton_cuda::backend::driver_available() {
        return;
    }
    let model = common::model_dir();
    let big = r#"{"architectures":["LlamaForCausalLM"],"model_type":"llama","hidden_size":4096,"intermediate_size":14336,"num_hidden_layers":32,"num_attention_heads":32,"num_key_value_heads":8,"vocab_size":128256,"max_position_embeddings":8192}"#;
    let cases: [Vec<&std::ffi::OsStr>; 4] = [
        vec![
            os("bench"),
            os("decode"),
            os("--device"),
            os("cuda"),
            os("--load-format"),
            os("dummy"),
            os("--config"),
            os(big),
            os("--batch"),
            os("1"),
        ],
        vec![
            os("generate"),
            os("--device"),
            os("cuda"),
            os("--prompt"),
            os("hi"),
            os("--model"),
            model.as_os_str(),
        ],
        vec![os("debug"), os("golden"), os("--model"), model.as_os_str()],
        vec![
            os("debug"),
            os("layers"),
            os("--load-format"),
            os("dummy"),
            os("--config"),
            os(big),
        ],
    ];
    for args in cases {
        let (code, err) = run_bounded(&args, "a CUDA command without a driver");
        assert_fails_with(code, &err, "--device cpu", &args);
    }
}

/// `baton serve` refuses a bad instance name, a broken chat template, a busy port, a null
/// worker for real weights and a heartbeat timeout under a second before it starts any child
/// (no segment appears for the instance).
#[test]
fn serve_checks_instance_template_and_port_before_starting_children() {
    let model = common::model_dir();
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = busy.local_addr().unwrap().port().to_string();
    let inst = format!("precheck-{}", std::process::id());
    let cases: [(&[&str], &str); 7] = [
        (&["--instance", "a/b", "--port", "0"], "--instance"),
        // vLLM's two-letter short form.
        (
            &["--instance", &inst, "--port", "0", "-pp", "4"],
            "--pipeline-parallel-size 4: Baton runs a model on one device",
        ),
        // vLLM's parallelism flags: 1 is what Baton does, more is refused.
        (
            &[
                "--instance",
                &inst,
                "--port",
                "0",
                "--tensor-parallel-size",
                "2",
            ],
            "--tensor-parallel-size 2: Baton runs a model on one device",
        ),
        // Under the children's heartbeat period it would kill healthy ones.
        (
            &[
                "--instance",
                &inst,
                "--port",
                "0",
                "--heartbeat-timeout",
                "0.5",
            ],
            "--heartbeat-timeout must be 0 (off) or from 1",
        ),
        // The null worker computes nothing: only for random weights.
        (
            &["--instance", &inst, "--port", "0", "--device", "null"],
            "add --load-format dummy",
        ),
        (
            &[
                "--instance",
                &inst,
                "--port",
                "0",
                "--chat-template",
                "{% for %}",
            ],
            "--chat-template",
        ),
        (&["--instance", &inst, "--port", &port], "cannot listen"),
    ];
    for (flags, want) in cases {
        let mut args = vec![os("serve"), os("--model"), model.as_os_str()];
        args.extend(flags.iter().map(|f| os(f)));
        let (code, err) = run_bounded(&args, "serve with a bad flag");
        assert_fails_with(code, &err, want, &flags);
        assert!(
            !err.contains("baton scheduler"),
            "{flags:?}: a scheduler was started: {err}"
        );
        assert!(!std::path::Path::new(&format!("/dev/shm/baton-{inst}")).exists());
    }
    drop(busy);
    // A --model path that does not exist says so (a relative path from the wrong directory is
    // the usual cause), rather than that it lacks a config.json.
    let (code, err) = run_bounded(
        &[os("serve"), os("--model"), os("no/such/model-dir")],
        "serve with a missing model",
    );
    assert_fails_with(code, &err, "no/such/model-dir: no such directory", &"serve");
    // The first argument is the model too (`vllm serve MODEL`); no model, or both forms, is
    // refused.
    let (code, err) = run_bounded(
        &[os("serve"), os("no/such/model-dir")],
        "serve with a missing positional model",
    );
    assert_fails_with(code, &err, "no/such/model-dir: no such directory", &"serve");
    let (code, err) = run_bounded(
        &[os("serve"), os("--port"), os("0")],
        "serve without a model",
    );
    assert_fails_with(code, &err, "baton serve DIR", &"serve");
    let (code, err) = run_bounded(
        &[
            os("serve"),
            model.as_os_str(),
            os("--model"),
            model.as_os_str(),
        ],
        "serve with two models",
    );
    assert_fails_with(code, &err, "cannot be used with", &"serve");
}

#[test]
fn tool_calling_flags_are_checked_at_startup() {
    let model = common::model_dir();
    let inst = format!("tf-{}", std::process::id());
    let bad: [(&str, &[&str], &str); 4] = [
        (
            "serve",
            &["--enable-auto-tool-choice"],
            "--tool-call-parser",
        ),
        (
            "frontend",
            &["--enable-auto-tool-choice"],
            "--tool-call-parser",
        ),
        (
            "serve",
            &["--tool-call-parser", "granite"],
            "llama3_json, hermes, mistral, pythonic, qwen3_coder, phi4_mini_json",
        ),
        (
            "frontend",
            &["--enable-auto-tool-choice", "--tool-call-parser", "nope"],
            "--tool-call-parser",
        ),
    ];
    for (cmd, flags, want) in bad {
        let mut args = vec![os(cmd), os("--model"), model.as_os_str()];
        args.extend(["--instance", &inst, "--port", "0"].iter().map(|f| os(f)));
        args.extend(flags.iter().map(|f| os(f)));
        let (code, err) = run_bounded(&args, "a bad tool flag");
        assert_fails_with(code, &err, want, &(cmd, flags));
        assert!(
            !err.contains("baton scheduler"),
            "{flags:?}: a scheduler was started: {err}"
        );
    }
    // Valid combinations pass the check: the frontend goes on to look for its scheduler.
    let good: [&[&str]; 2] = [
        &[
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "llama3_json",
        ],
        &["--tool-call-parser", "hermes"],
    ];
    for flags in good {
        let mut args = vec![os("frontend"), os("--model"), model.as_os_str()];
        args.extend(
            [
                "--instance",
                &inst,
                "--port",
                "0",
                "--attach-timeout",
                "0.2",
            ]
            .iter()
            .map(|f| os(f)),
        );
        args.extend(flags.iter().map(|f| os(f)));
        let (code, err) = run_bounded(&args, "frontend with tool flags");
        assert_fails_with(code, &err, "scheduler", &flags);
        assert!(!err.contains("--tool-call-parser"), "{flags:?}: {err}");
    }
}

/// A temporary copy of the test model's JSON files (no weights) under `tag`.
fn json_only_copy(tag: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("baton-cli-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for f in std::fs::read_dir(common::model_dir()).unwrap() {
        let f = f.unwrap().path();
        if f.extension().is_some_and(|e| e == "json") {
            std::fs::copy(&f, dir.join(f.file_name().unwrap())).unwrap();
        }
    }
    dir
}

/// `baton serve --port 0 --instance <inst> --load-format <format> --model <dir>`.
fn serve_args<'a>(
    inst: &'a str,
    format: &'a str,
    dir: &'a std::path::Path,
) -> Vec<&'a std::ffi::OsStr> {
    [
        "serve",
        "--port",
        "0",
        "--instance",
        inst,
        "--load-format",
        format,
        "--model",
    ]
    .into_iter()
    .map(os)
    .chain([dir.as_os_str()])
    .collect()
}

/// vLLM users pass `--load-format safetensors`: it is `auto` for a safetensors checkpoint,
/// and a directory without one is refused naming the flag, by `generate` and by `serve`
/// before any child starts.
#[test]
fn load_format_safetensors_reads_safetensors_and_names_the_flag_without_them() {
    let (code, err) = generate(&["--load-format", "safetensors", "--temperature", "0"]);
    assert_eq!(code, Some(0), "{err}");
    let dir = json_only_copy("no-safetensors");
    let inst = format!("st-{}", std::process::id());
    let cases: [Vec<&std::ffi::OsStr>; 2] = [
        vec![
            os("generate"),
            os("--prompt"),
            os("hi"),
            os("--load-format"),
            os("safetensors"),
            os("--model"),
            dir.as_os_str(),
        ],
        serve_args(&inst, "safetensors", &dir),
    ];
    for args in cases {
        let (code, err) = run_bounded(&args, "--load-format safetensors without safetensors");
        assert_fails_with(code, &err, "--load-format safetensors", &args);
        assert!(err.contains("model.safetensors"), "{err}");
        assert!(
            !err.contains("baton scheduler"),
            "a child was started: {err}"
        );
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// `serve` (with `--generation-config auto`, the default) refuses a malformed
/// generation_config.json before starting any child, naming the file.
#[test]
fn serve_refuses_a_malformed_generation_config_under_auto() {
    let dir = json_only_copy("bad-genconfig");
    std::fs::write(dir.join("generation_config.json"), "{\"eos_token_id\": [2,").unwrap();
    let inst = format!("badgen-{}", std::process::id());
    let args = serve_args(&inst, "dummy", &dir);
    let (code, err) = run_bounded(&args, "serve with a malformed generation config");
    assert_fails_with(code, &err, "generation_config.json", &args);
    assert!(
        err.contains("--generation-config auto"),
        "the flag is named: {err}"
    );
    assert!(
        !err.contains("baton scheduler"),
        "a child was started: {err}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// vLLM's `--tokenizer`: a model directory without tokenizer files is refused naming
/// tokenizer.json, and served with `--tokenizer DIR` the golden prompt gives the golden ids.
#[test]
fn a_model_without_its_tokenizer_generates_with_the_tokenizer_flag() {
    let g = &common::goldens()[0];
    let dir = model_copy("tokenizer-flag");
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        let _ = std::fs::remove_file(dir.join(f));
    }
    let out = generate_in(&dir, &["--max-tokens", "2"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_fails_with(out.status.code(), &err, "tokenizer.json", &"no tokenizer");
    let tok = common::model_dir();
    let tok = tok.to_str().unwrap();
    let flags = [
        "--temperature",
        "0",
        "--max-tokens",
        "64",
        "--tokenizer",
        tok,
    ];
    let (ids, _) = generated(&dir, &flags);
    assert_eq!(ids, g.greedy_ids);
    // A --tokenizer that is no directory of a tokenizer.json is refused by every command
    // before it starts (a scheduler used to start without a tokenizer fingerprint), and so is
    // one with more tokens than the model has logits (another model's).
    let file = dir.join("config.json");
    let llama2 = tok.replace("stories260K", "llama2-tokenizer");
    let inst = format!("tokflag-{}", std::process::id());
    for (cmd, t, want) in [
        ("generate", "/nonexistent/tok", "not a directory"),
        ("serve", "/nonexistent/tok", "not a directory"),
        ("scheduler", file.to_str().unwrap(), "not a directory"),
        ("worker", "/tmp", "no tokenizer.json"),
        ("generate", &llama2[..], "another model's tokenizer"),
        // Before it waits for a scheduler (there is none).
        ("frontend", &llama2[..], "another model's tokenizer"),
    ] {
        let mut args = vec![
            os(cmd),
            os("--model"),
            dir.as_os_str(),
            os("--tokenizer"),
            os(t),
        ];
        match cmd {
            "generate" => args.extend([os("--prompt"), os("a b c")]),
            "serve" | "frontend" => {
                args.extend([os("--port"), os("0"), os("--instance"), os(&inst)])
            }
            _ => args.extend([os("--instance"), os(&inst)]),
        }
        let (code, err) = run_bounded(&args, cmd);
        assert_fails_with(code, &err, want, &(cmd, t));
        assert!(err.contains("--tokenizer"), "{cmd} {t}: {err}");
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// A `--tokenizer` with under half the model's logits (a 512-token tokenizer on a model of
/// 2048) runs, as vLLM does, with a warning that names the flag and both sizes; one of nearly
/// the model's size (stories260K's own) runs without it.
#[test]
fn a_much_smaller_tokenizer_is_warned_about() {
    let dir = json_only_copy("small-tokenizer");
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        let _ = std::fs::remove_file(dir.join(f));
    }
    let cfg = dir.join("config.json");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
    let tok = common::model_dir();
    let tok = tok.to_str().unwrap();
    for (vocab, warned) in [(2048, true), (512, false)] {
        let mut v = v.clone();
        v["vocab_size"] = vocab.into();
        std::fs::write(&cfg, v.to_string()).unwrap();
        let out = generate_in(
            &dir,
            &[
                "--load-format",
                "dummy",
                "--tokenizer",
                tok,
                "--max-tokens",
                "2",
            ],
        );
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{err}");
        let said = err.contains("--tokenizer")
            && err.contains("512 tokens")
            && err.contains(&format!("{vocab} logits"));
        assert_eq!(said, warned, "vocab {vocab}: {err}");
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// vLLM's `--quantization` (`-q`) is accepted when it names the checkpoint's
/// `quantization_config.quant_method` and refused otherwise by generate, serve and worker
/// before they load anything: a method the checkpoint does not use, and any method for an
/// unquantized checkpoint (vLLM would quantize online; Baton does not).
#[test]
fn the_quantization_flag_must_name_the_checkpoints_method() {
    let g = &common::goldens()[0];
    // stories260K's f32 weights under an FP8 config: no tensor is float8, so it loads as is.
    let dir = model_copy("quant-flag");
    let cfg = dir.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
    v["quantization_config"] = serde_json::json!({"quant_method": "fp8"});
    std::fs::write(&cfg, v.to_string()).unwrap();
    for q in ["fp8", "FP8"] {
        let flags = ["--temperature", "0", "--max-tokens", "64", "-q", q];
        let (ids, _) = generated(&dir, &flags);
        assert_eq!(ids, g.greedy_ids);
    }
    let plain = common::model_dir();
    let inst = format!("quantflag-{}", std::process::id());
    for (cmd, model, q, want) in [
        (
            "generate",
            &dir,
            "compressed-tensors",
            "quant_method \"fp8\"",
        ),
        ("serve", &dir, "awq", "quant_method \"fp8\""),
        ("worker", &dir, "gptq", "quant_method \"fp8\""),
        (
            "generate",
            &plain,
            "fp8",
            "online FP8 quantization is not supported",
        ),
        (
            "serve",
            &plain,
            "fp8",
            "online FP8 quantization is not supported",
        ),
        ("worker", &plain, "awq", "not quantized"),
    ] {
        let mut args = vec![
            os(cmd),
            os("--model"),
            model.as_os_str(),
            os("--quantization"),
            os(q),
        ];
        match cmd {
            "generate" => args.extend([os("--prompt"), os("a b c")]),
            "serve" => args.extend([os("--port"), os("0"), os("--instance"), os(&inst)]),
            _ => args.extend([os("--instance"), os(&inst)]),
        }
        let (code, err) = run_bounded(&args, cmd);
        assert_fails_with(code, &err, want, &(cmd, q));
        assert!(err.contains("--quantization"), "{cmd} {q}: {err}");
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// vLLM command-line habits: a flag given twice takes its last value (argparse's rule), and
/// `--dtype` on a CPU run says that it applies to CUDA (the CPU backend computes in f32).
#[test]
fn repeated_flags_take_their_last_value_and_a_cpu_dtype_is_noted() {
    let g = &common::goldens()[0];
    let flags = [
        "--max-tokens",
        "2",
        "--temperature",
        "0",
        "--max-tokens",
        "64",
        "--dtype",
        "bf16",
    ];
    let (ids, _) = generated(&common::model_dir(), &flags);
    assert_eq!(ids, g.greedy_ids);
    let stderr = |flags: &[&str]| {
        let out = generate_in(&common::model_dir(), flags);
        assert_eq!(out.status.code(), Some(0));
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let err = stderr(&flags);
    assert!(
        err.contains("--dtype bf16 applies to --device cuda"),
        "{err}"
    );
    let err = stderr(&["--max-tokens", "2"]);
    assert!(!err.contains("--dtype"), "{err}");
}

/// A temporary copy of the test model, weights included, under `tag`.
fn model_copy(tag: &str) -> std::path::PathBuf {
    let dir = json_only_copy(tag);
    std::fs::copy(
        common::model_dir().join("model.safetensors"),
        dir.join("model.safetensors"),
    )
    .unwrap();
    dir
}

/// stories260K as a Mistral model with a 16-token `sliding_window`: `baton generate` serves
/// all 512 positions, also from a KV pool of 5 pages (what one request holds at once with
/// that window); the greedy output is the golden one while every position fits the window,
/// and then departs from it (the model's own full attention); a `--max-model-len` past the
/// positions is refused.
#[test]
fn a_sliding_window_model_is_served_past_its_window_to_its_positions() {
    let g = &common::goldens()[0];
    let dir = model_copy("sliding");
    let path = dir.join("config.json");
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    c["model_type"] = "mistral".into();
    c["architectures"] = serde_json::json!(["MistralForCausalLM"]);
    c["sliding_window"] = 16.into();
    std::fs::write(&path, c.to_string()).unwrap();
    let (ids, finish) = generated(&dir, &["--temperature", "0", "--max-tokens", "64"]);
    assert_eq!((ids.len(), finish.as_str()), (64, "length"));
    let fits = 16 - g.prompt_ids.len();
    assert_eq!(ids[..fits], g.greedy_ids[..fits]);
    assert_ne!(ids, g.greedy_ids, "the window changed nothing");
    let rest = (512 - g.prompt_ids.len()).to_string();
    // Greedy, every position: the flags then `extra`.
    fn all<'a>(rest: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
        let base = [
            "--temperature",
            "0",
            "--max-model-len",
            "512",
            "--max-tokens",
        ];
        [&base[..], &[rest], extra].concat()
    }
    let (ids, finish) = generated(&dir, &all(&rest, &[]));
    assert_eq!(
        (ids.len(), finish.as_str()),
        (512 - g.prompt_ids.len(), "length")
    );
    // A request holds only its window's pages and a chunk's; with prefix caching and two
    // launches in flight (generate's defaults) its previous chunk's too until registered:
    // max(15, 32) + 32 positions take 4 pages of 16, plus one when they straddle a boundary.
    // In 5 pages (80 tokens) all 512 positions are served, the same ids; 4 pages are refused
    // with the reason.
    let small = |pages| {
        all(
            &rest,
            &["--max-num-batched-tokens", "32", "--num-blocks", pages],
        )
    };
    assert_eq!(generated(&dir, &small("5")).0, ids, "5 pages of 16 keys");
    let args = small("4");
    let out = generate_in(&dir, &args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_fails_with(out.status.code(), &err, "cannot hold the 5 blocks", &args);
    assert!(err.contains("sliding window of 16 keys"), "{err}");
    // It says that pages out of the window come back mid-request.
    let out = generate_in(&dir, &["--temperature", "0", "--max-tokens", "4"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("attends to its last 16 keys"), "{err}");
    let args = ["--temperature", "0", "--max-model-len", "513"];
    let out = generate_in(&dir, &args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_fails_with(out.status.code(), &err, "--max-model-len 513", &args);
    assert!(err.contains("max_position_embeddings 512"), "{err}");
    let _ = std::fs::remove_dir_all(dir);
}

/// A Gemma 3 text model (random weights, stories260K's tokenizer) runs end to end on the CPU:
/// `baton generate --load-format dummy` decodes past its 16-key sliding window on the local
/// and global RoPE layers, the same ids whether the prompt is prefilled at once or in chunks
/// of 3 tokens and on 1 or 2 threads.
#[test]
fn a_gemma3_text_model_generates_the_same_ids_however_it_is_batched() {
    let dir = json_only_copy("gemma3");
    let gemma = r#"{"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 8, "vocab_size": 512,
        "max_position_embeddings": 512, "sliding_window": 16, "sliding_window_pattern": 3,
        "query_pre_attn_scalar": 8, "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": "float32"}"#;
    std::fs::write(dir.join("config.json"), gemma).unwrap();
    let base = [
        "--load-format",
        "dummy",
        "--temperature",
        "0",
        "--ignore-eos",
    ];
    let run = |extra: &[&str]| {
        let args = [&base[..], &["--max-tokens", "40"], extra].concat();
        generated(&dir, &args).0
    };
    let whole = run(&[]);
    assert_eq!(whole.len(), 40);
    assert_eq!(run(&["--max-num-batched-tokens", "3"]), whole);
    assert_eq!(run(&["--cpu-threads", "2"]), whole);
    let _ = std::fs::remove_dir_all(dir);
}

/// stories260K as a Mixtral whose four experts are each a copy of its MLP, under a random
/// router picking two per token: Mixtral renormalizes the two routing weights to sum to 1, so
/// the output is the dense model's up to rounding, and `baton generate` (the mapped,
/// layer-by-layer load of the experts by Mixtral's names, the routing, the weighted sum) gives
/// the golden ids.
#[test]
fn stories260k_as_a_mixtral_of_copies_of_its_mlp_generates_the_goldens() {
    let g = &common::goldens()[0];
    let dir = common::mixtral_copy("mixtral");
    let (ids, _) = generated(&dir, &["--temperature", "0", "--max-tokens", "64"]);
    assert_eq!(ids, g.greedy_ids);
    let _ = std::fs::remove_dir_all(dir);
}

/// stories260K with LongRoPE (original 256 of its 512 positions; short factors of 1 and an
/// attention factor of 1, long factors of 4): `baton generate` says which factors apply, gives
/// the goldens at `--max-model-len 256` and departs from them past it, where the long factors
/// apply to every position (vLLM's choice).
#[test]
fn longrope_factors_follow_the_max_model_len() {
    let g = &common::goldens()[0];
    let dir = model_copy("longrope");
    let path = dir.join("config.json");
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    c["original_max_position_embeddings"] = 256.into();
    c["rope_scaling"] = serde_json::json!({"type": "longrope", "attention_factor": 1.0,
        "short_factor": [1.0, 1.0, 1.0, 1.0], "long_factor": [4.0, 4.0, 4.0, 4.0]});
    std::fs::write(&path, c.to_string()).unwrap();
    for (len, golden, note) in [
        ("256", true, "short factors apply"),
        ("512", false, "long factors apply"),
    ] {
        let args = [
            "--json",
            "--temperature",
            "0",
            "--max-tokens",
            "24",
            "--max-model-len",
            len,
        ];
        let out = generate_in(&dir, &args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{len}: {err}");
        assert!(err.contains(note), "{len}: {err}");
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let ids: Vec<u32> = v["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(
            ids == g.greedy_ids[..24],
            golden,
            "--max-model-len {len}: {ids:?}"
        );
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// `baton generate --json` on `model` with `extra`: the new ids and the finish reason of the
/// first golden prompt; fails the test if it does not exit 0.
fn generated(model: &std::path::Path, extra: &[&str]) -> (Vec<u32>, String) {
    let out = generate_in(model, &[&["--json"][..], extra].concat());
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{extra:?}: {err}");
    let v: serde_json::Value =
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{extra:?}: {e}: {err}"));
    let ids = v["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();
    (ids, v["finish_reason"].as_str().unwrap().to_owned())
}

/// `baton generate --generation-config auto|vllm|DIR`, as `serve`'s: under `auto` (the
/// default) the model's generation_config.json gives the sampling values of the flags not
/// given (a flag given wins), `vllm` ignores them, DIR's file gives them; a malformed file
/// stops `auto` only.
#[test]
fn generate_takes_sampling_defaults_from_the_generation_config_and_a_flag_wins() {
    let g = &common::goldens()[0];
    let dir = model_copy("gen-defaults");
    // Temperature 2: this small model's draws at 1 are often its greedy tokens.
    let hot = r#"{"bos_token_id": 1, "eos_token_id": 2, "temperature": 2, "max_new_tokens": 6}"#;
    std::fs::write(dir.join("generation_config.json"), hot).unwrap();
    // The config's temperature and max_new_tokens.
    let (drawn, _) = generated(&dir, &["--seed", "7"]);
    assert_eq!(drawn.len(), 6, "the generation config's max_new_tokens");
    // A flag given wins: --temperature 0 is the greedy golden, still 6 tokens.
    let (ids, _) = generated(&dir, &["--seed", "7", "--temperature", "0"]);
    assert_eq!(ids, g.greedy_ids[..6], "--temperature 0 wins");
    assert_ne!(drawn, ids, "the config's temperature 2 was used");
    // `vllm`: temperature 1 and 16 tokens, the same draws as flags giving those.
    let (cool, _) = generated(&dir, &["--seed", "7", "--generation-config", "vllm"]);
    assert_eq!(cool.len(), 16, "vllm ignores max_new_tokens");
    assert_ne!(cool[..6], drawn, "vllm ignores the config's temperature");
    let (ids, _) = generated(
        &dir,
        &["--seed", "7", "--temperature", "1", "--max-tokens", "16"],
    );
    assert_eq!(ids, cool, "--temperature 1 and --max-tokens 16 win");
    // DIR: its file, while the model's is malformed (which only `auto` refuses).
    let other = json_only_copy("gen-defaults-dir");
    std::fs::write(other.join("generation_config.json"), hot).unwrap();
    std::fs::write(dir.join("generation_config.json"), "{\"eos_token_id\": [2,").unwrap();
    let (ids, _) = generated(
        &dir,
        &[
            "--seed",
            "7",
            "--generation-config",
            other.to_str().unwrap(),
        ],
    );
    assert_eq!(ids, drawn, "DIR's defaults");
    let (ids, _) = generated(&dir, &["--generation-config", "vllm", "--max-tokens", "3"]);
    assert_eq!(ids.len(), 3);
    let out = generate_in(&dir, &["--max-tokens", "3"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_fails_with(out.status.code(), &err, "generation_config.json", &"auto");
    // A DIR without the file is named.
    let out = generate_in(
        &dir,
        &["--generation-config", dir.join("nope").to_str().unwrap()],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_fails_with(
        out.status.code(),
        &err,
        "nope/generation_config.json",
        &"DIR",
    );
    // An out-of-range default is refused naming the flag and the field, unless the flag is
    // given.
    for (field, value, flag, ok) in [
        ("temperature", "-1", "--temperature", "0"),
        ("top_p", "0", "--top-p", "1"),
        ("min_p", "2", "--min-p", "0"),
        ("repetition_penalty", "0", "--repetition-penalty", "1"),
        ("max_new_tokens", "0", "--max-tokens", "2"),
    ] {
        std::fs::write(
            dir.join("generation_config.json"),
            format!(r#"{{"eos_token_id": 2, "{field}": {value}}}"#),
        )
        .unwrap();
        let two: &[&str] = if flag == "--max-tokens" {
            &[]
        } else {
            &["--max-tokens", "2"]
        };
        let out = generate_in(&dir, two);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_fails_with(out.status.code(), &err, flag, &field);
        assert!(
            err.contains(&format!("generation config's {field}")),
            "{err}"
        );
        let (ids, _) = generated(&dir, &[&[flag, ok][..], two].concat());
        assert_eq!(ids.len(), 2, "{flag} {ok} wins over {field} {value}");
    }
    let _ = std::fs::remove_dir_all(dir);
    let _ = std::fs::remove_dir_all(other);
}

/// The stop ids come from the generation config `--generation-config` names: DIR's
/// `eos_token_id` ends the output, the model directory's file is not read for them.
#[test]
fn generate_takes_the_stop_ids_from_the_generation_config_dir() {
    let g = &common::goldens()[0];
    let dir = model_copy("gen-eos");
    let other = json_only_copy("gen-eos-dir");
    let stop = g.greedy_ids[2];
    std::fs::write(
        other.join("generation_config.json"),
        format!(r#"{{"eos_token_id": [{stop}], "temperature": 0}}"#),
    )
    .unwrap();
    let dir_flag = [
        "--generation-config",
        other.to_str().unwrap(),
        "--max-tokens",
        "10",
    ];
    let (ids, reason) = generated(&dir, &dir_flag);
    let at = g.greedy_ids.iter().position(|&t| t == stop).unwrap();
    assert_eq!(
        (ids.as_slice(), reason.as_str()),
        (&g.greedy_ids[..=at], "stop"),
        "DIR's eos_token_id stops"
    );
    // As vLLM's, the stop token's text is not in the output text.
    let out = generate_in(&dir, &[&["--json"][..], &dir_flag[..]].concat());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let text = v["text"].as_str().unwrap();
    let n = (at + 1).to_string();
    let with_stop = generate_in(&dir, &["--json", "--temperature", "0", "--max-tokens", &n]);
    let v: serde_json::Value = serde_json::from_slice(&with_stop.stdout).unwrap();
    let through_stop = v["text"].as_str().unwrap();
    assert!(
        through_stop.len() > text.len() && through_stop.starts_with(text),
        "{text:?} against {through_stop:?}"
    );
    assert!(g.greedy_text.starts_with(text), "{text:?}");
    // The model's own file (eos 2) does not stop there.
    let (ids, reason) = generated(&dir, &["--temperature", "0", "--max-tokens", "10"]);
    assert_eq!(
        (ids.as_slice(), reason.as_str()),
        (&g.greedy_ids[..10], "length")
    );
    let _ = std::fs::remove_dir_all(dir);
    let _ = std::fs::remove_dir_all(other);
}

/// A checkpoint with a tensor the model does not use, of a dtype the loader does not read, is
/// refused by the scheduler with the workers' unused-tensor error, not as a fingerprint
/// failure hinting at `--load-format dummy`.
#[test]
fn the_scheduler_refuses_an_unused_tensor_of_an_unsupported_dtype_as_unused() {
    let dir = json_only_copy("unused-i32");
    let bytes = std::fs::read(common::model_dir().join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let extra = [0u8; 16];
    let name = "model.layers.0.mlp.gate_proj.qweight";
    let mut views = st.tensors();
    views.push((
        name.to_owned(),
        safetensors::tensor::TensorView::new(safetensors::Dtype::I32, vec![4], &extra).unwrap(),
    ));
    std::fs::write(
        dir.join("model.safetensors"),
        safetensors::serialize(views, None).unwrap(),
    )
    .unwrap();
    let inst = format!("unused-{}", std::process::id());
    let args = [
        os("scheduler"),
        os("--instance"),
        os(&inst),
        os("--model"),
        dir.as_os_str(),
    ];
    let (code, err) = run_bounded(&args, "a scheduler on an unused I32 tensor");
    assert_fails_with(code, &err, name, &args);
    assert!(err.contains("does not use"), "{err}");
    assert!(!err.contains("--load-format dummy"), "{err}");
    let _ = std::fs::remove_dir_all(dir);
}

/// A reader that goes away (`baton generate ... | head -c 5`) ends generate quietly with status
/// 0, as a C tool dies of SIGPIPE; a stdout that cannot be written for another reason
/// (`/dev/full`) is an error naming stdout.
#[test]
fn a_closed_stdout_ends_generate_quietly_and_a_full_one_is_an_error() {
    use std::process::Stdio;
    let mut child = generate_cmd(&common::model_dir(), &["--max-tokens", "8"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run baton");
    // Close the read end before anything is written: the write fails with EPIPE.
    drop(child.stdout.take());
    let out = child.wait_with_output().expect("wait");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(!err.contains("error"), "{err}");
    let full = std::fs::File::options().write(true).open("/dev/full");
    if let Ok(full) = full {
        let out = generate_cmd(&common::model_dir(), &["--max-tokens", "2"])
            .stdout(full)
            .output()
            .expect("run baton");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(err.contains("writing the generations to stdout"), "{err}");
    }
}
