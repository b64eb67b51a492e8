//! GGUF files (llama.cpp's format) as `--model`: `baton generate` and `baton serve` given
//! stories260K converted by llama.cpp's `convert_hf_to_gguf.py` reproduce golden.json (so the
//! config, the tensor names, the un-permuted q/k rows and the converted tokenizer are all
//! right), the served name is the file's, the prepared directory lands in `BATON_CACHE_DIR`,
//! and bad files stop the commands with an error naming the fault.

mod support;

use serde_json::{json, Value};
use std::path::PathBuf;
use std::process::Command;
use support::*;

/// `BATON_TEST_MODEL_GGUF`, or stories260K's GGUF beside the test model.
fn gguf_file() -> PathBuf {
    match std::env::var_os("BATON_TEST_MODEL_GGUF") {
        Some(p) => PathBuf::from(p),
        None => model_dir().join("../stories260K-gguf/stories260K-f32.gguf"),
    }
}

/// A fresh cache directory for one test.
fn cache(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("baton-{}-gguf-cache-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// golden.json's prompts: (prompt, greedy text).
fn golden_texts() -> Vec<(String, String)> {
    let g: Value =
        serde_json::from_str(&std::fs::read_to_string(model_dir().join("golden.json")).unwrap())
            .unwrap();
    g["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["prompt"].as_str().unwrap().to_string(),
                p["greedy_text"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

fn generate(
    model: &std::path::Path,
    cache: &std::path::Path,
    prompt: &str,
) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_baton"))
        .env("BATON_CACHE_DIR", cache)
        .arg("generate")
        .arg("--model")
        .arg(model)
        .args([
            "--prompt",
            prompt,
            "--max-tokens",
            "64",
            "--temperature",
            "0",
        ])
        .output()
        .expect("run generate");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout)
            .trim_end_matches('\n')
            .to_string(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn generate_from_the_gguf_file_reproduces_golden_json_and_prepares_the_cache_once() {
    let c = cache("generate");
    for (prompt, text) in golden_texts() {
        let (ok, out, err) = generate(&gguf_file(), &c, &prompt);
        assert!(ok, "generate failed: {err}");
        assert_eq!(out, text, "prompt {prompt:?}");
    }
    let dirs: Vec<_> = std::fs::read_dir(c.join("gguf"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(
        dirs.len(),
        1,
        "one prepared directory, no leftovers: {dirs:?}"
    );
    let d = &dirs[0];
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        assert!(d.join(f).is_file(), "{f} in {}", d.display());
    }
    assert_eq!(
        std::fs::read_link(d.join("model.gguf")).unwrap(),
        gguf_file().canonicalize().unwrap()
    );
    let cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(d.join("config.json")).unwrap()).unwrap();
    let hf: Value =
        serde_json::from_str(&std::fs::read_to_string(model_dir().join("config.json")).unwrap())
            .unwrap();
    for k in [
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "max_position_embeddings",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ] {
        assert_eq!(cfg[k], hf[k], "config.json `{k}`");
    }
    let _ = std::fs::remove_dir_all(&c);
}

#[test]
fn serve_of_the_gguf_file_answers_golden_json_under_the_files_name() {
    let _g = serial();
    let c = cache("serve");
    std::env::set_var("BATON_CACHE_DIR", &c);
    // 8-bit activations (the CPU default) change only quantized matrices: none here, so
    // golden.json holds either way (this checks that serve hands the negation to a worker
    // that takes it).
    let (mut serve, addr, ready) = spawn_serve_ready(
        &gguf_file(),
        &instance("gguf"),
        &["--no-cpu-int8-activations".to_owned()],
    );
    std::env::remove_var("BATON_CACHE_DIR");
    // The ready line names the file, not the directory prepared from it.
    let given = format!("model {} (", gguf_file().display());
    assert!(ready.contains(&given), "{ready}");
    let name = "stories260K-f32.gguf";
    let (status, models) = http(&addr, "GET", "/v1/models", None);
    assert_eq!(status, 200);
    // One model, as for a directory: named after the file, the --model string as its root.
    assert_eq!(models["data"].as_array().unwrap().len(), 1, "{models}");
    assert_eq!(models["data"][0]["id"], name, "{models}");
    assert_eq!(
        models["data"][0]["root"],
        gguf_file().display().to_string(),
        "{models}"
    );
    for (prompt, text) in golden_texts() {
        let (status, v) = http(
            &addr,
            "POST",
            "/v1/completions",
            Some(&json!({"model": name, "prompt": prompt, "max_tokens": 64, "temperature": 0})),
        );
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["choices"][0]["text"], text.as_str(), "{prompt:?}");
        assert_eq!(v["model"], name);
    }
    // The --model string names the model too, as vLLM's default served name does.
    let (status, v) = http(
        &addr,
        "POST",
        "/v1/completions",
        Some(&json!({"model": gguf_file().display().to_string(), "prompt": "x", "max_tokens": 2})),
    );
    assert_eq!(status, 200, "{v}");
    serve.signal(nix::sys::signal::Signal::SIGTERM);
    assert!(
        serve
            .wait_timeout(std::time::Duration::from_secs(30))
            .is_some(),
        "serve did not stop on SIGTERM"
    );
    let _ = std::fs::remove_dir_all(&c);
}

#[test]
fn bad_gguf_files_stop_the_commands_with_the_fault_named() {
    let c = cache("bad");
    std::fs::create_dir_all(&c).unwrap();
    let bytes = std::fs::read(gguf_file()).unwrap();
    // Truncated in the tensor data.
    let cut = c.join("cut.gguf");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let (ok, _, err) = generate(&cut, &c, "x");
    assert!(!ok);
    assert!(
        err.contains("GGUF") && err.contains("past the end"),
        "{err}"
    );
    // Truncated in the header.
    let head = c.join("head.gguf");
    std::fs::write(&head, &bytes[..100]).unwrap();
    let (ok, _, err) = generate(&head, &c, "x");
    assert!(!ok);
    assert!(err.contains("truncated"), "{err}");
    // Another architecture: the same file with `llama` renamed (same length) to `gemma`.
    let mut other = bytes.clone();
    let at = other
        .windows(5)
        .position(|w| w == b"llama")
        .expect("the architecture string");
    other[at..at + 5].copy_from_slice(b"gemma");
    let arch = c.join("arch.gguf");
    std::fs::write(&arch, &other).unwrap();
    let (ok, _, err) = generate(&arch, &c, "x");
    assert!(!ok);
    assert!(err.contains("architecture `gemma`"), "{err}");
    // A tensor of a ggml type Baton does not dequantize (IQ4_NL, id 20): named.
    let mut iq = bytes.clone();
    let name = b"token_embd.weight";
    let at = iq
        .windows(name.len())
        .position(|w| w == name)
        .expect("the tensor's directory entry")
        + name.len();
    // n_dims (u32), two u64 dims, then the type (u32).
    iq[at + 20..at + 24].copy_from_slice(&20u32.to_le_bytes());
    let iq_file = c.join("iq.gguf");
    std::fs::write(&iq_file, &iq).unwrap();
    let (ok, _, err) = generate(&iq_file, &c, "x");
    assert!(!ok);
    assert!(
        err.contains("IQ4_NL") && err.contains("token_embd.weight"),
        "{err}"
    );
    // A missing *.gguf path and a file that is not GGUF, for generate as for serve.
    let (ok, _, err) = generate(&c.join("missing.gguf"), &c, "x");
    assert!(!ok);
    assert!(err.contains("missing.gguf: no such file"), "{err}");
    let empty = c.join("empty.gguf");
    std::fs::write(&empty, "").unwrap();
    let (ok, _, err) = generate(&empty, &c, "x");
    assert!(!ok);
    assert!(
        err.contains("neither a Hugging Face model directory nor a GGUF file"),
        "{err}"
    );
    // A file that is not GGUF at all.
    let txt = c.join("notes.gguf");
    std::fs::write(&txt, "hello").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_baton"))
        .env("BATON_CACHE_DIR", &c)
        .args(["serve", "--port", "0"])
        .arg(&txt)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("neither a Hugging Face model directory nor a GGUF file"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&c);
}
