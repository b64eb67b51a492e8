//! Bad command-line input gets a clear message and a non-zero exit, never a panic.

mod common;

use std::process::Command;

/// Runs `baton generate --model <test model> <extra…>`; returns (exit code, stderr).
fn generate(extra: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_baton"))
        .arg("generate")
        .arg("--model")
        .arg(common::model_dir())
        .args(["--prompt", "Once upon a time"])
        .args(if extra.contains(&"--max-tokens") {
            &[][..]
        } else {
            &["--max-tokens", "2"][..]
        })
        .args(extra)
        .output()
        .expect("run baton");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
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

/// `baton serve` refuses a bad instance name, a broken chat template and a busy port before it
/// starts any child (no segment appears for the instance).
#[test]
fn serve_checks_instance_template_and_port_before_starting_children() {
    let model = common::model_dir();
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = busy.local_addr().unwrap().port().to_string();
    let inst = format!("precheck-{}", std::process::id());
    let cases: [(&[&str], &str); 3] = [
        (&["--instance", "a/b", "--port", "0"], "--instance"),
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
            &["--tool-call-parser", "pythonic"],
            "llama3_json, hermes",
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
        vec![
            os("serve"),
            os("--port"),
            os("0"),
            os("--instance"),
            os(&inst),
            os("--load-format"),
            os("safetensors"),
            os("--model"),
            dir.as_os_str(),
        ],
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
    let args = [
        os("serve"),
        os("--port"),
        os("0"),
        os("--instance"),
        os(&inst),
        os("--load-format"),
        os("dummy"),
        os("--model"),
        dir.as_os_str(),
    ];
    let (code, err) = run_bounded(&args, "serve with a malformed generation config");
    assert_fails_with(code, &err, "generation_config.json", &args);
    assert!(
        !err.contains("baton scheduler"),
        "a child was started: {err}"
    );
    let _ = std::fs::remove_dir_all(dir);
}
