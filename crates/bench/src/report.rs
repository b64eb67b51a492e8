//! Figures of a run: throughput, TTFT/TPOT/ITL/E2E summaries, the check of the client's token
//! counts against the server's `usage`, and per-request records; printed as a table and
//! written as JSON.

use crate::client::Outcome;
use crate::stats::Summary;
use serde::Serialize;

/// Where the output token counts of the report come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum TokenSource {
    /// The generated text re-encoded with `--tokenizer` (no special tokens).
    Tokenizer,
    /// One token per SSE chunk that carried a token ([`crate::sse::is_token`]).
    SseChunks,
}

impl TokenSource {
    /// A short name for the table.
    pub fn name(self) -> &'static str {
        match self {
            TokenSource::Tokenizer => "tokenizer",
            TokenSource::SseChunks => "SSE chunks",
        }
    }
}

/// Every figure of a run. Times in ms unless the name says otherwise.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The command line that produced this report.
    pub command_line: String,
    /// The run's settings, as given.
    pub config: serde_json::Value,
    /// How output tokens were counted.
    pub token_source: TokenSource,
    /// First request sent to last request finished, seconds.
    pub duration_s: f64,
    /// Requests that streamed to `[DONE]` without error.
    pub completed: usize,
    /// Requests that failed.
    pub failed: usize,
    /// The first failure's message.
    pub first_error: Option<String>,
    /// Completed requests per second.
    pub request_throughput: f64,
    /// Output tokens of completed requests per second.
    pub output_throughput: f64,
    /// Prompt plus output tokens of completed requests per second.
    pub total_token_throughput: f64,
    /// Prompt tokens of completed requests (the server's `usage` where it sent one, else the
    /// client's count).
    pub total_input_tokens: u64,
    /// Output tokens of completed requests (see `token_source`).
    pub total_output_tokens: u64,
    /// Time to first token.
    pub ttft_ms: Summary,
    /// Time per output token after the first, per request: (e2e − ttft) / (tokens − 1).
    pub tpot_ms: Summary,
    /// Every gap between consecutive token chunks, all requests pooled.
    pub itl_ms: Summary,
    /// End-to-end latency per request.
    pub e2e_ms: Summary,
    /// Completed requests whose stream carried `usage`.
    pub requests_with_usage: usize,
    /// Completed requests whose client-side output token count differs from
    /// `usage.completion_tokens`.
    pub usage_mismatches: usize,
    /// The first mismatch, described.
    pub first_usage_mismatch: Option<String>,
    /// The other way of counting output tokens (`sse-chunks` when `token_source` is
    /// `tokenizer` and vice versa), if it was available.
    pub other_token_source: Option<TokenSource>,
    /// Completed requests with usage whose output count by `other_token_source` differs from
    /// `usage.completion_tokens`.
    pub other_usage_mismatches: Option<usize>,
    /// Per-request records, in dataset order.
    pub requests: Vec<RequestRecord>,
}

/// One request's figures.
#[derive(Debug, Clone, Serialize)]
pub struct RequestRecord {
    /// Sent at, seconds since the run started.
    pub start_s: f64,
    /// Completed without error.
    pub ok: bool,
    /// Time to first token, ms.
    pub ttft_ms: f64,
    /// End-to-end latency, ms.
    pub e2e_ms: f64,
    /// Output tokens as the client counted them (`token_source`).
    pub output_tokens: u64,
    /// Output tokens by `other_token_source`, if available.
    pub other_output_tokens: Option<u64>,
    /// `usage.completion_tokens`, if sent.
    pub usage_completion_tokens: Option<u64>,
    /// Prompt tokens (`usage.prompt_tokens` if sent, else the client's count).
    pub prompt_tokens: u64,
    /// Token chunks ([`crate::sse::is_token`]).
    pub chunks: usize,
    /// Gaps between chunks, ms.
    pub itl_ms: Vec<f64>,
    /// The error, for a failed request.
    pub error: Option<String>,
}

/// Builds the report. `output_tokens[i]` and `prompt_tokens[i]` are the client's counts for
/// request `i` (`other_output[i]`: by the other method, if available); `duration_s` is the
/// wall time of the run.
#[allow(clippy::too_many_arguments)]
pub fn build(
    command_line: String,
    config: serde_json::Value,
    token_source: TokenSource,
    outcomes: &[Outcome],
    output_tokens: &[u64],
    other_output: Option<&[u64]>,
    prompt_tokens: &[u64],
    duration_s: f64,
) -> Report {
    let mut other_mismatches = 0usize;
    let mut ttft = Vec::new();
    let mut tpot = Vec::new();
    let mut itl = Vec::new();
    let mut e2e = Vec::new();
    let (mut completed, mut in_tok, mut out_tok) = (0usize, 0u64, 0u64);
    let (mut with_usage, mut mismatches) = (0usize, 0usize);
    let mut first_mismatch = None;
    let mut first_error = None;
    let mut requests = Vec::with_capacity(outcomes.len());
    for (i, o) in outcomes.iter().enumerate() {
        let out_n = output_tokens[i];
        let in_n = o.usage.map_or(prompt_tokens[i], |u| u.prompt_tokens);
        if o.ok {
            completed += 1;
            in_tok += in_n;
            out_tok += out_n;
            ttft.push(o.ttft_s * 1e3);
            e2e.push(o.e2e_s * 1e3);
            if out_n > 1 {
                tpot.push((o.e2e_s - o.ttft_s) * 1e3 / (out_n - 1) as f64);
            }
            itl.extend(o.itl_s.iter().map(|g| g * 1e3));
            if let Some(u) = o.usage {
                with_usage += 1;
                if other_output.is_some_and(|v| v[i] != u.completion_tokens) {
                    other_mismatches += 1;
                }
                if u.completion_tokens != out_n {
                    mismatches += 1;
                    first_mismatch.get_or_insert_with(|| {
                        format!(
                            "request {i}: client counted {out_n} output tokens, usage.completion_tokens = {}",
                            u.completion_tokens
                        )
                    });
                }
            }
        } else if first_error.is_none() {
            first_error = o.error.clone();
        }
        requests.push(RequestRecord {
            start_s: o.start_s,
            ok: o.ok,
            ttft_ms: o.ttft_s * 1e3,
            e2e_ms: o.e2e_s * 1e3,
            output_tokens: out_n,
            other_output_tokens: other_output.map(|v| v[i]),
            usage_completion_tokens: o.usage.map(|u| u.completion_tokens),
            prompt_tokens: in_n,
            chunks: o.chunks,
            itl_ms: o.itl_s.iter().map(|g| g * 1e3).collect(),
            error: o.error.clone(),
        });
    }
    let d = duration_s.max(1e-9);
    Report {
        command_line,
        config,
        token_source,
        duration_s,
        completed,
        failed: outcomes.len() - completed,
        first_error,
        request_throughput: completed as f64 / d,
        output_throughput: out_tok as f64 / d,
        total_token_throughput: (in_tok + out_tok) as f64 / d,
        total_input_tokens: in_tok,
        total_output_tokens: out_tok,
        ttft_ms: Summary::of(&mut ttft),
        tpot_ms: Summary::of(&mut tpot),
        itl_ms: Summary::of(&mut itl),
        e2e_ms: Summary::of(&mut e2e),
        requests_with_usage: with_usage,
        usage_mismatches: mismatches,
        first_usage_mismatch: first_mismatch,
        other_token_source: other_output.map(|_| match token_source {
            TokenSource::Tokenizer => TokenSource::SseChunks,
            TokenSource::SseChunks => TokenSource::Tokenizer,
        }),
        other_usage_mismatches: other_output.map(|_| other_mismatches),
        requests,
    }
}

impl Report {
    /// The table printed on stdout.
    pub fn table(&self) -> String {
        use std::fmt::Write;
        let mut s = String::new();
        let line = |s: &mut String, k: &str, v: String| {
            let _ = writeln!(s, "{k:<42}{v:>12}");
        };
        let head = |s: &mut String, t: &str| {
            let _ = writeln!(s, "{:-^54}", t);
        };
        let _ = writeln!(s, "{:=^54}", " Serving Benchmark Result ");
        line(&mut s, "Successful requests:", self.completed.to_string());
        line(&mut s, "Failed requests:", self.failed.to_string());
        line(
            &mut s,
            "Benchmark duration (s):",
            format!("{:.2}", self.duration_s),
        );
        line(
            &mut s,
            "Total input tokens:",
            self.total_input_tokens.to_string(),
        );
        line(
            &mut s,
            "Total generated tokens:",
            self.total_output_tokens.to_string(),
        );
        line(
            &mut s,
            "Request throughput (req/s):",
            format!("{:.2}", self.request_throughput),
        );
        line(
            &mut s,
            "Output token throughput (tok/s):",
            format!("{:.2}", self.output_throughput),
        );
        line(
            &mut s,
            "Total token throughput (tok/s):",
            format!("{:.2}", self.total_token_throughput),
        );
        line(
            &mut s,
            "Output tokens counted by:",
            self.token_source.name().into(),
        );
        line(
            &mut s,
            "Usage mismatches (of requests with usage):",
            format!("{}/{}", self.usage_mismatches, self.requests_with_usage),
        );
        if let (Some(src), Some(n)) = (self.other_token_source, self.other_usage_mismatches) {
            line(
                &mut s,
                &format!("  by {}, usage mismatches:", src.name()),
                format!("{}/{}", n, self.requests_with_usage),
            );
        }
        for (title, short, sm) in [
            (" Time to First Token ", "TTFT", &self.ttft_ms),
            (
                " Time per Output Token (excl. 1st token) ",
                "TPOT",
                &self.tpot_ms,
            ),
            (" Inter-token Latency ", "ITL", &self.itl_ms),
            (" End-to-end Latency ", "E2EL", &self.e2e_ms),
        ] {
            head(&mut s, title);
            // No samples (every request failed, or none made two tokens): "n/a", not NaN.
            let ms = |v: f64| {
                if sm.count == 0 || !v.is_finite() {
                    "n/a".to_owned()
                } else {
                    format!("{v:.2}")
                }
            };
            line(&mut s, &format!("Mean {short} (ms):"), ms(sm.mean));
            line(&mut s, &format!("Median {short} (ms):"), ms(sm.median));
            line(&mut s, &format!("P90 {short} (ms):"), ms(sm.p90));
            line(&mut s, &format!("P99 {short} (ms):"), ms(sm.p99));
        }
        let _ = writeln!(s, "{}", "=".repeat(54));
        if let Some(e) = &self.first_error {
            let _ = writeln!(s, "First error: {e}");
        }
        if let Some(m) = &self.first_usage_mismatch {
            let _ = writeln!(s, "First usage mismatch: {m}");
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sse::Usage;

    fn ok(start: f64, ttft: f64, gaps: &[f64], usage: Option<u64>) -> Outcome {
        Outcome {
            ok: true,
            start_s: start,
            ttft_s: ttft,
            itl_s: gaps.to_vec(),
            e2e_s: ttft + gaps.iter().sum::<f64>(),
            chunks: gaps.len() + 1,
            usage: usage.map(|c| Usage {
                prompt_tokens: 4,
                completion_tokens: c,
            }),
            ..Outcome::default()
        }
    }

    #[test]
    fn figures_add_up() {
        let outs = vec![
            ok(0.0, 0.1, &[0.01, 0.03], Some(3)),
            ok(0.0, 0.3, &[0.02, 0.02], Some(4)),
            Outcome {
                error: Some("boom".into()),
                ..Outcome::default()
            },
        ];
        let r = build(
            "x".into(),
            serde_json::Value::Null,
            TokenSource::SseChunks,
            &outs,
            &[3, 3, 0],
            Some(&[3, 4, 0]),
            &[5, 5, 5],
            2.0,
        );
        assert_eq!((r.completed, r.failed), (2, 1));
        assert_eq!(r.first_error.as_deref(), Some("boom"));
        assert_eq!(r.total_output_tokens, 6);
        assert_eq!(r.total_input_tokens, 8, "usage's prompt count wins");
        assert!((r.output_throughput - 3.0).abs() < 1e-12);
        assert!((r.total_token_throughput - 7.0).abs() < 1e-12);
        assert!((r.request_throughput - 1.0).abs() < 1e-12);
        assert!((r.ttft_ms.mean - 200.0).abs() < 1e-9);
        assert_eq!(r.itl_ms.count, 4);
        assert!((r.itl_ms.median - 20.0).abs() < 1e-9);
        // TPOT: (0.04/2, 0.04/2) s
        assert!((r.tpot_ms.mean - 20.0).abs() < 1e-9);
        assert_eq!((r.requests_with_usage, r.usage_mismatches), (2, 1));
        assert!(r
            .first_usage_mismatch
            .as_deref()
            .unwrap()
            .starts_with("request 1"));
        assert_eq!(r.other_usage_mismatches, Some(0));
        assert_eq!(r.other_token_source, Some(TokenSource::Tokenizer));
        let t = r.table();
        assert!(
            t.contains("Failed requests:") && t.contains("P99 ITL (ms):"),
            "{t}"
        );
        let j = serde_json::to_value(&r.requests[2]).unwrap();
        assert_eq!(j["error"], "boom");
    }

    #[test]
    fn all_failed_prints_na_and_writes_nulls() {
        let outs = vec![
            Outcome {
                error: Some("refused".into()),
                ..Outcome::default()
            };
            3
        ];
        let r = build(
            "x".into(),
            serde_json::Value::Null,
            TokenSource::SseChunks,
            &outs,
            &[0, 0, 0],
            None,
            &[5, 5, 5],
            0.5,
        );
        assert_eq!((r.completed, r.failed), (0, 3));
        let t = r.table();
        assert!(!t.contains("NaN") && !t.contains("nan"), "{t}");
        assert!(t.contains("Mean TTFT (ms):") && t.contains("n/a"), "{t}");
        assert_eq!(t.matches("n/a").count(), 16, "{t}");
        // Valid JSON (no NaN literal), empty stats as null.
        let text = serde_json::to_string_pretty(&r).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        for k in ["ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"] {
            assert_eq!(v[k]["count"], 0, "{k}");
            for f in ["mean", "median", "p90", "p99"] {
                assert!(v[k][f].is_null(), "{k}.{f}: {}", v[k][f]);
            }
        }
        assert!(v["request_throughput"].is_number());
    }
}
