//! `bench serve` end to end against the in-process mock server, and its failures against
//! servers that are not OpenAI-compatible (no timing assertions).

use baton_bench::{bench, mock, ServeArgs};
use clap::Parser;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    a: ServeArgs,
}

fn args(base: &str, extra: &[&str]) -> ServeArgs {
    let mut v = vec!["bench", "--base-url", base];
    v.extend_from_slice(extra);
    Cli::try_parse_from(v).expect("flags parse").a
}

async fn run(a: &ServeArgs) -> anyhow::Result<baton_bench::report::Report> {
    bench(a, "test".into(), |_| indicatif::ProgressBar::hidden()).await
}

async fn mock_url() -> String {
    let addr = mock::spawn("127.0.0.1:0", mock::MockConfig::default())
        .await
        .unwrap();
    format!("http://{addr}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_against_the_mock_count_every_token() {
    let url = mock_url().await;
    let a = args(
        &url,
        &[
            "--num-prompts",
            "300",
            "--max-concurrency",
            "32",
            "--input-len",
            "12",
            "--output-len",
            "9",
            "--warmup",
            "4",
        ],
    );
    let r = run(&a).await.unwrap();
    assert_eq!((r.completed, r.failed), (300, 0), "{:?}", r.first_error);
    assert_eq!(r.total_output_tokens, 300 * 9);
    assert_eq!(r.total_input_tokens, 300 * 12);
    assert_eq!((r.requests_with_usage, r.usage_mismatches), (300, 0));
    assert_eq!(r.itl_ms.count, 300 * 8);
    assert_eq!(r.ttft_ms.count, 300);
    assert_eq!(r.tpot_ms.count, 300);
    assert!(r.output_throughput > 0.0 && r.duration_s > 0.0);
    assert_eq!(r.config["model"], "mock");
    assert!(r.requests.iter().all(|q| q.ok && q.chunks == 9));
    // The JSON holds every figure of the table.
    let j = serde_json::to_value(&r).unwrap();
    for k in [
        "duration_s",
        "completed",
        "failed",
        "request_throughput",
        "output_throughput",
        "total_token_throughput",
    ] {
        assert!(j[k].is_number(), "{k}");
    }
    for k in ["ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"] {
        for s in ["mean", "median", "p90", "p99"] {
            assert!(j[k][s].is_number(), "{k}.{s}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_jsonl_with_poisson_arrivals() {
    let url = mock_url().await;
    let dir = std::env::temp_dir().join(format!("baton-bench-it-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("prompts.jsonl");
    std::fs::write(
        &p,
        "{\"prompt\": \"one two three\", \"max_tokens\": 5}\n{\"prompt\": \"four\"}\n",
    )
    .unwrap();
    let a = args(
        &url,
        &[
            "--endpoint",
            "/v1/chat/completions",
            "--dataset",
            "jsonl",
            "--dataset-path",
            p.to_str().unwrap(),
            "--output-len",
            "3",
            "--num-prompts",
            "20",
            "--request-rate",
            "2000",
            "--model",
            "mock",
        ],
    );
    let r = run(&a).await.unwrap();
    assert_eq!((r.completed, r.failed), (20, 0), "{:?}", r.first_error);
    assert_eq!(r.total_output_tokens, 10 * 5 + 10 * 3);
    assert_eq!(r.usage_mismatches, 0);
    std::fs::remove_dir_all(&dir).ok();
}

/// A tiny HTTP server answering every request with `status`, `ctype` and `body`, closing the
/// connection after each.
async fn canned_server(status: &'static str, ctype: &'static str, body: &'static str) -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = l.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut buf = vec![0u8; 65536];
                let mut got = Vec::new();
                // Read the request head (and whatever body came with it).
                while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => got.extend_from_slice(&buf[..n]),
                    }
                }
                let resp = format!(
                    "HTTP/1.0 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = s.write_all(resp.as_bytes()).await;
                let _ = s.shutdown().await;
            });
        }
    });
    format!("http://{addr}")
}

const HTML: &str = "<!DOCTYPE HTML>\n<html><head><title>Directory listing for /</title></head><body><h1>Directory listing</h1></body></html>\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_html_server_fails_clearly() {
    let url = canned_server("200 OK", "text/html; charset=utf-8", HTML).await;
    // Model discovery fails first.
    let e = format!(
        "{:#}",
        run(&args(&url, &["--num-prompts", "3"])).await.unwrap_err()
    );
    assert!(
        e.contains("/v1/models") && e.contains("not an OpenAI model list"),
        "{e}"
    );
    // With --model, every request fails with the reason.
    let r = run(&args(&url, &["--num-prompts", "3", "--model", "m"]))
        .await
        .unwrap();
    assert_eq!((r.completed, r.failed), (0, 3));
    let e = r.first_error.unwrap();
    assert!(
        e.contains("text/event-stream") && e.contains("text/html"),
        "{e}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn not_found_and_non_sse_bodies_fail_clearly() {
    let url = canned_server("404 File not found", "text/html", HTML).await;
    let e = format!(
        "{:#}",
        run(&args(&url, &["--num-prompts", "2"])).await.unwrap_err()
    );
    assert!(e.contains("404") && e.contains("OpenAI-compatible"), "{e}");
    // An OpenAI client's base URL (ending in /v1) is named as the likely fault.
    let e = format!(
        "{:#}",
        run(&args(&format!("{url}/v1/"), &["--num-prompts", "2"]))
            .await
            .unwrap_err()
    );
    assert!(
        e.contains("/v1/v1/models") && e.contains(&format!("try {url}")),
        "{e}"
    );
    let r = run(&args(&url, &["--num-prompts", "2", "--model", "m"]))
        .await
        .unwrap();
    assert!(r.first_error.unwrap().contains("HTTP 404"));
    // A warmup failure stops the run.
    let e = format!(
        "{:#}",
        run(&args(
            &url,
            &["--num-prompts", "2", "--model", "m", "--warmup", "1"]
        ))
        .await
        .unwrap_err()
    );
    assert!(e.contains("warmup") && e.contains("404"), "{e}");

    let url = canned_server("200 OK", "text/event-stream", "<html>hi</html>\n").await;
    let r = run(&args(&url, &["--num-prompts", "2", "--model", "m"]))
        .await
        .unwrap();
    assert!(r.first_error.unwrap().contains("not an SSE stream"));

    let url = canned_server(
        "200 OK",
        "text/event-stream",
        "data: {\"choices\":[{\"text\":\"a\"}]}\n\n",
    )
    .await;
    let r = run(&args(&url, &["--num-prompts", "2", "--model", "m"]))
        .await
        .unwrap();
    assert!(r.first_error.unwrap().contains("without `data: [DONE]`"));

    let url = canned_server(
        "200 OK",
        "text/event-stream",
        "data: {\"error\": {\"message\": \"engine died\"}}\n\ndata: [DONE]\n\n",
    )
    .await;
    let r = run(&args(&url, &["--num-prompts", "2", "--model", "m"]))
        .await
        .unwrap();
    assert!(r.first_error.unwrap().contains("engine died"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_refused_and_bad_flags() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    drop(l);
    let e = format!(
        "{:#}",
        run(&args(&url, &["--num-prompts", "2"])).await.unwrap_err()
    );
    assert!(e.to_lowercase().contains("refused"), "{e}");

    let e = format!(
        "{:#}",
        run(&args(&url, &["--num-prompts", "0"])).await.unwrap_err()
    );
    assert!(e.contains("--num-prompts"), "{e}");
    let e = format!(
        "{:#}",
        run(&args(
            &url,
            &[
                "--dataset",
                "jsonl",
                "--dataset-path",
                "/nonexistent/p.jsonl"
            ]
        ))
        .await
        .unwrap_err()
    );
    assert!(e.contains("/nonexistent/p.jsonl"), "{e}");
    let e = format!(
        "{:#}",
        run(&args(&url, &["--dataset", "jsonl"])).await.unwrap_err()
    );
    assert!(e.contains("--dataset-path"), "{e}");
    let e = format!(
        "{:#}",
        run(&args(&url, &["--count-output", "tokenizer"]))
            .await
            .unwrap_err()
    );
    assert!(e.contains("--tokenizer"), "{e}");
    let e = format!("{:#}", run(&args("https://x", &[])).await.unwrap_err());
    assert!(e.contains("http://"), "{e}");
    assert!(Cli::try_parse_from(["b", "--base-url", "http://x", "--request-rate", "-1"]).is_err());
    assert!(Cli::try_parse_from(["b", "--base-url", "http://x", "--endpoint", "/v1/x"]).is_err());
}
