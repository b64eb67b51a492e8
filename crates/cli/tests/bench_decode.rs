//! `baton bench decode --device cpu` end to end (small sizes), and `--device cuda` failing
//! cleanly on a machine without a driver.

use std::path::PathBuf;
use std::process::Command;

fn model_dir() -> PathBuf {
    std::env::var_os("BATON_TEST_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/models/stories260K")
        })
}

fn baton() -> Command {
    Command::new(env!("CARGO_BIN_EXE_baton"))
}

#[test]
fn bench_decode_on_cpu_reports_every_batch_and_writes_json() {
    let out = std::env::temp_dir().join(format!("baton-bench-decode-{}.json", std::process::id()));
    let o = baton()
        .args(["bench", "decode", "--device", "cpu", "--model"])
        .arg(model_dir())
        .args([
            "--batch",
            "1,3",
            "--prompt-len",
            "9",
            "--gen-len",
            "4",
            "--block-size",
            "4",
        ])
        .arg("--out")
        .arg(&out)
        .output()
        .expect("runs");
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(stdout.contains("measured/floor"), "{stdout}");
    let j: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    let _ = std::fs::remove_file(&out);
    let points = j["points"].as_array().unwrap();
    assert_eq!(points.len(), 2);
    for (p, b) in points.iter().zip([1, 3]) {
        assert_eq!(p["batch"], b);
        let ms = p["ms_per_step"].as_f64().unwrap();
        let floor = p["floor_ms"].as_f64().unwrap();
        assert!(ms > 0.0 && floor > 0.0, "{p}");
        assert!((p["ratio"].as_f64().unwrap() - ms / floor).abs() < 1e-6 * (ms / floor));
        let tps = p["output_tokens_per_s"].as_f64().unwrap();
        assert!((tps - b as f64 / (ms / 1e3)).abs() < 1e-6 * tps);
    }
    assert!(j["copy_bandwidth_bytes_per_s"].as_f64().unwrap() > 1e8);
    // stories260K in f32: weights read per step = params minus the embedding table, 4 bytes.
    assert!(j["weight_bytes_per_step"].as_f64().unwrap() > 0.0);
}

/// The benchmark makes its own token ids: a model directory of config.json and weights
/// alone (as a GGUF file of random weights prepares, with no tokenizer) is enough.
#[test]
fn bench_decode_needs_no_tokenizer() {
    let dir = std::env::temp_dir().join(format!("baton-bench-notok-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let model = model_dir().canonicalize().expect("the test model");
    for f in ["config.json", "model.safetensors"] {
        std::os::unix::fs::symlink(model.join(f), dir.join(f)).unwrap();
    }
    let o = baton()
        .args(["bench", "decode", "--device", "cpu", "--model"])
        .arg(&dir)
        .args(["--batch", "1", "--prompt-len", "4", "--gen-len", "2"])
        .output()
        .expect("runs");
    let _ = std::fs::remove_dir_all(&dir);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).contains("measured/floor"));
}

#[test]
fn bench_decode_with_a_dummy_config_on_cpu() {
    let cfg = r#"{"architectures":["LlamaForCausalLM"],"model_type":"llama","hidden_size":32,
        "intermediate_size":64,"num_hidden_layers":2,"num_attention_heads":4,
        "num_key_value_heads":2,"vocab_size":50,"max_position_embeddings":64,
        "rope_scaling":{"factor":8.0,"high_freq_factor":4.0,"low_freq_factor":1.0,
        "original_max_position_embeddings":16,"rope_type":"llama3"}}"#;
    let o = baton()
        .args([
            "bench",
            "decode",
            "--device",
            "cpu",
            "--load-format",
            "dummy",
            "--config",
            cfg,
        ])
        .args(["--batch", "2", "--prompt-len", "5", "--gen-len", "3"])
        .output()
        .expect("runs");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

#[test]
fn cuda_without_a_driver_fails_cleanly() {
    // SAFETY-free check: on a machine with a driver this test has nothing to show.
    if std::path::Path::new("/dev/nvidiactl").exists() {
        return;
    }
    for args in [
        vec![
            "generate",
            "--prompt",
            "hi",
            "--device",
            "cuda",
            "--max-tokens",
            "2",
        ],
        vec![
            "bench",
            "decode",
            "--device",
            "cuda",
            "--batch",
            "1",
            "--gen-len",
            "2",
        ],
    ] {
        let o = baton()
            .args(&args)
            .arg("--model")
            .arg(model_dir())
            .output()
            .expect("runs");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{args:?} succeeded without a GPU");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert!(
            err.contains("CUDA") || err.contains("libcuda"),
            "{args:?}: {err}"
        );
    }
}

#[test]
fn a_batch_too_large_for_memory_is_refused_before_allocating() {
    // 10^8 sequences of one 16-token page each need about 1 TB of f32 KV for stories260K.
    let o = baton()
        .args(["bench", "decode", "--device", "cpu", "--batch", "100000000"])
        .args(["--prompt-len", "4", "--gen-len", "2", "--model"])
        .arg(model_dir())
        .output()
        .expect("runs");
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("GiB CPU KV cache"), "{err}");
}

/// Runs a one-step CPU `bench decode` on stories260K with `flags` and asserts that it exits 1
/// with `needs` in its error.
#[track_caller]
fn refused(flags: &[&str], needs: &str) {
    refused_on("cpu", flags, needs);
}

/// [`refused`] on `device`.
#[track_caller]
fn refused_on(device: &str, flags: &[&str], needs: &str) {
    let (code, err) = one_step(device, flags);
    assert_eq!(code, Some(1), "{flags:?}: {err}");
    assert!(err.contains(needs), "{flags:?}: {err}");
}

/// Runs a one-step `bench decode` of stories260K on `device` with `flags`: its exit code and
/// stderr.
fn one_step(device: &str, flags: &[&str]) -> (Option<i32>, String) {
    let o = baton()
        .args(["bench", "decode", "--device", device])
        .args(flags)
        .args([
            "--batch",
            "1",
            "--prompt-len",
            "4",
            "--gen-len",
            "2",
            "--model",
        ])
        .arg(model_dir())
        .output()
        .expect("runs");
    (
        o.status.code(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn cuda_only_flags_are_refused_on_the_cpu() {
    refused(&["--device-time"], "--device-time needs --device cuda");
    refused(&["--breakdown"], "--breakdown needs --device cuda");
    refused(&["--launch-trace"], "--launch-trace needs --device cuda");
}

#[test]
fn the_launch_trace_needs_one_launch_in_flight() {
    // Refused before any device is opened (so on machines without one too).
    refused_on(
        "cuda",
        &["--launch-trace", "--in-flight", "2"],
        "give --in-flight 1",
    );
    refused_on(
        "cuda",
        &["--device-time", "--in-flight", "2"],
        "give --in-flight 1",
    );
    // Its default is 1: the run gets as far as opening the GPU.
    let (code, err) = one_step("cuda", &["--launch-trace"]);
    assert_ne!(code, Some(0), "{err}");
    assert!(!err.contains("--in-flight"), "{err}");
}

/// A CPU backend whose steps come with a synthetic launch trace: two launches, the first
/// taking `10 + k` µs of step `k`.
struct Traced {
    cpu: baton_worker::CpuBackend,
    steps: u64,
}

impl baton::bench_decode::BenchBackend for Traced {
    fn backend(&mut self) -> &mut dyn baton_worker::Backend {
        &mut self.cpu
    }
    fn take_launch_trace(&mut self) -> anyhow::Result<Option<baton_cuda::trace::StepTrace>> {
        use baton_cuda::trace::{StepTrace, TraceSlot};
        let k = self.steps;
        self.steps += 1;
        let mut table = [TraceSlot::EMPTY; 2];
        table[0].fold(1, 0, 1000, 16, 1);
        table[1].fold(2, 0, 1000 + (10 + k) * 1000, 32, 1);
        Ok(Some(StepTrace::from_table(&table, 1)))
    }
}

#[test]
fn timed_steps_keep_their_launch_traces_and_the_warm_up_does_not() {
    use baton::bench_decode::{measure_batch, BenchTables};
    let loaded = baton_model::load_model_dir(model_dir()).expect("test model loads");
    let (model, _) = loaded.into_cpu_model();
    let vocab = model.config().vocab_size;
    let mut t = Traced {
        cpu: baton_worker::CpuBackend::new(model, 8, 16),
        steps: 0,
    };
    let mut seq = 0;
    let timing = measure_batch(
        &mut t,
        &BenchTables::new(vocab, 4),
        &mut seq,
        1,
        8,
        5,
        16,
        64,
        baton_proto::SamplingParams::greedy(),
        1,
        0,
    )
    .unwrap();
    assert_eq!(t.steps, 5, "one trace read per step");
    assert_eq!(timing.traces.len(), 4, "the warm-up's trace is dropped");
    let s = baton_cuda::trace::summarize(
        &timing
            .traces
            .iter()
            .map(baton_cuda::trace::StepTrace::launches)
            .collect::<Vec<_>>(),
        1,
    );
    // Steps 1..=4: the first launch took 11..=14 µs.
    assert_eq!((s.steps, s.skipped), (4, 0));
    assert_eq!(s.positions[0].share_us, Some(12.5));
}

#[test]
fn bad_sampling_flags_are_refused_before_loading() {
    refused(&["--temperature", "-1"], "--temperature -1 must be finite");
    refused(
        &["--temperature", "NaN"],
        "--temperature NaN must be finite",
    );
    refused(&["--top-p", "0"], "--top-p 0 must be in (0, 1]");
    refused(&["--top-p", "1.5"], "--top-p 1.5 must be in (0, 1]");
    refused(&["--top-k", "-2"], "--top-k -2 must be >= -1");
    refused(
        &["--top-p", "0.9"],
        "--top-p and --top-k need --temperature > 0",
    );
    refused(
        &["--top-k", "40"],
        "--top-p and --top-k need --temperature > 0",
    );
    refused(
        &["--temperature", "0.8", "--top-k", "1"],
        "samples greedily",
    );
    refused(&["--temperature", "1e-45"], "samples greedily");
    refused(
        &["--top-logprobs", "21"],
        "--top-logprobs 21 must be at most 20",
    );
}

#[test]
fn a_sampled_cpu_decode_bench_reports_its_sampling() {
    let o = baton()
        .args([
            "bench",
            "decode",
            "--device",
            "cpu",
            "--temperature",
            "0.8",
            "--top-p",
        ])
        .args([
            "0.9",
            "--top-k",
            "40",
            "--top-logprobs",
            "5",
            "--batch",
            "2",
            "--prompt-len",
            "4",
            "--gen-len",
        ])
        .args(["3", "--model"])
        .arg(model_dir())
        .output()
        .expect("runs");
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(
        out.contains("sampled (temperature 0.8, top-p 0.9, top-k 40), 5 top log-probabilities"),
        "{out}"
    );
}
