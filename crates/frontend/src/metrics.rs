//! Prometheus metrics with vLLM's names, written as text exposition format by hand.

use crate::engine::EngineStats;
use baton_proto::FirstTokenTimes;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
const ITL_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
    7.5, 10.0, 20.0, 40.0, 80.0,
];
const E2E_BUCKETS: &[f64] = &[
    0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
];

/// Token-count buckets: vLLM's `build_1_2_5_buckets`, up to a million tokens.
const TOKEN_BUCKETS: &[f64] = &[
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1e3, 2e3, 5e3, 1e4, 2e4, 5e4, 1e5, 2e5,
    5e5, 1e6,
];

/// A cumulative histogram.
#[derive(Debug)]
struct Histogram {
    bounds: &'static [f64],
    /// Per-bucket (non-cumulative) counts; the last entry is `+Inf`.
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: vec![0; bounds.len() + 1],
            sum: 0.0,
            count: 0,
        }
    }

    fn observe(&mut self, v: f64) {
        let i = self
            .bounds
            .iter()
            .position(|&b| v <= b)
            .unwrap_or(self.bounds.len());
        self.counts[i] += 1;
        self.sum += v;
        self.count += 1;
    }

    fn write(&self, out: &mut String, name: &str, help: &str, labels: &str) {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} histogram");
        let mut cum = 0;
        for (i, b) in self.bounds.iter().enumerate() {
            cum += self.counts[i];
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{b}\"}} {cum}");
        }
        cum += self.counts[self.bounds.len()];
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {cum}");
        let _ = writeln!(out, "{name}_sum{{{labels}}} {}", self.sum);
        let _ = writeln!(out, "{name}_count{{{labels}}} {}", self.count);
    }
}

#[derive(Debug)]
struct Histograms {
    ttft: Histogram,
    itl: Histogram,
    e2e: Histogram,
    tpot: Histogram,
    prompt: Histogram,
    generation: Histogram,
    queue: Histogram,
    prefill: Histogram,
    decode: Histogram,
    inference: Histogram,
}

/// What a sequence reports when it ends.
#[derive(Clone, Copy, Debug)]
pub struct Finished<'a> {
    /// `stop`, `length` or `abort`.
    pub reason: &'a str,
    /// Seconds from arrival to the end.
    pub e2e: f64,
    /// Seconds from arrival to the first token, if one came.
    pub ttft: Option<f64>,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Output tokens received.
    pub output_tokens: usize,
    /// The scheduler's queue and prefill times (from the first token), if a token came.
    pub first_times: Option<FirstTokenTimes>,
    /// Seconds from the first token to the last, as this frontend received them.
    pub decode: Option<f64>,
}

/// Counters and histograms of one frontend.
#[derive(Debug)]
pub struct Metrics {
    prompt_tokens: AtomicU64,
    generation_tokens: AtomicU64,
    finished: [AtomicU64; 3],
    hist: Mutex<Histograms>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// Names of `vllm:request_success_total`'s `finished_reason` label, in index order.
const FINISHED: [&str; 3] = ["stop", "length", "abort"];

impl Metrics {
    /// Empty metrics.
    pub fn new() -> Self {
        Self {
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            finished: Default::default(),
            hist: Mutex::new(Histograms {
                ttft: Histogram::new(TTFT_BUCKETS),
                itl: Histogram::new(ITL_BUCKETS),
                e2e: Histogram::new(E2E_BUCKETS),
                tpot: Histogram::new(ITL_BUCKETS),
                prompt: Histogram::new(TOKEN_BUCKETS),
                generation: Histogram::new(TOKEN_BUCKETS),
                queue: Histogram::new(E2E_BUCKETS),
                prefill: Histogram::new(E2E_BUCKETS),
                decode: Histogram::new(E2E_BUCKETS),
                inference: Histogram::new(E2E_BUCKETS),
            }),
        }
    }

    fn hist(&self) -> std::sync::MutexGuard<'_, Histograms> {
        self.hist
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A request's prompt was admitted.
    pub fn add_prompt_tokens(&self, n: usize) {
        self.prompt_tokens.fetch_add(n as u64, Ordering::Relaxed);
    }

    /// A token arrived: `since_prev` is the time since the previous token of the same
    /// sequence, or since arrival for the first one (`first == true`).
    pub fn on_token(&self, first: bool, since_prev: f64) {
        self.generation_tokens.fetch_add(1, Ordering::Relaxed);
        let mut h = self.hist();
        if first {
            h.ttft.observe(since_prev);
        } else {
            h.itl.observe(since_prev);
        }
    }

    /// A sequence finished: its reason, latency and token counts. The time per output token
    /// is vLLM's `(e2e - ttft) / (output_tokens - 1)`, for sequences of two or more tokens.
    /// The phase histograms (vLLM v1's queue, prefill, decode and inference times) count
    /// sequences that got a token: queue and prefill as the scheduler measured them, decode
    /// from the first token to the last as received here, inference = prefill + decode.
    pub fn on_finished(&self, f: Finished<'_>) {
        if let Some(i) = FINISHED.iter().position(|r| *r == f.reason) {
            self.finished[i].fetch_add(1, Ordering::Relaxed);
        }
        let mut h = self.hist();
        h.e2e.observe(f.e2e);
        h.prompt.observe(f.prompt_tokens as f64);
        h.generation.observe(f.output_tokens as f64);
        if let Some(t) = f.first_times {
            h.queue.observe(t.queue);
            h.prefill.observe(t.prefill);
            if let Some(d) = f.decode {
                h.decode.observe(d);
                h.inference.observe(t.prefill + d);
            }
        }
        if let (Some(ttft), true) = (f.ttft, f.output_tokens > 1) {
            h.tpot
                .observe((f.e2e - ttft).max(0.0) / (f.output_tokens - 1) as f64);
        }
    }

    /// The `/metrics` page.
    pub fn render(&self, stats: &EngineStats, model: &str) -> String {
        let model = model.replace('\\', "\\\\").replace('"', "\\\"");
        let labels = format!("model_name=\"{model}\"");
        let mut out = String::new();
        let gauge = |out: &mut String, name: &str, help: &str, v: f64| {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} gauge");
            let _ = writeln!(out, "{name}{{{labels}}} {v}");
        };
        gauge(
            &mut out,
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            stats.running as f64,
        );
        gauge(
            &mut out,
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            stats.waiting as f64,
        );
        gauge(
            &mut out,
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            stats.kv_usage,
        );
        let counter = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} counter");
            let _ = writeln!(out, "{name}{{{labels}}} {v}");
        };
        counter(
            &mut out,
            "vllm:prompt_tokens_total",
            "Number of prefill tokens processed.",
            self.prompt_tokens.load(Ordering::Relaxed),
        );
        counter(
            &mut out,
            "vllm:generation_tokens_total",
            "Number of generation tokens processed.",
            self.generation_tokens.load(Ordering::Relaxed),
        );
        // The next three are the scheduler's: they survive a frontend restart.
        counter(
            &mut out,
            "vllm:num_preemptions_total",
            "Cumulative number of preemptions from the engine.",
            stats.preemptions,
        );
        counter(
            &mut out,
            "vllm:prefix_cache_queries_total",
            "Prefix cache queries, in terms of number of queried tokens.",
            stats.prefix_cache_queries,
        );
        counter(
            &mut out,
            "vllm:prefix_cache_hits_total",
            "Prefix cache hits, in terms of number of cached tokens.",
            stats.prefix_cache_hits,
        );
        let _ = writeln!(
            out,
            "# HELP vllm:request_success_total Count of successfully processed requests."
        );
        let _ = writeln!(out, "# TYPE vllm:request_success_total counter");
        for (i, r) in FINISHED.iter().enumerate() {
            let _ = writeln!(
                out,
                "vllm:request_success_total{{{labels},finished_reason=\"{r}\"}} {}",
                self.finished[i].load(Ordering::Relaxed)
            );
        }
        let h = self.hist();
        h.ttft.write(
            &mut out,
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            &labels,
        );
        h.itl.write(
            &mut out,
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            &labels,
        );
        h.e2e.write(
            &mut out,
            "vllm:e2e_request_latency_seconds",
            "Histogram of end to end request latency in seconds.",
            &labels,
        );
        h.tpot.write(
            &mut out,
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            &labels,
        );
        h.prompt.write(
            &mut out,
            "vllm:request_prompt_tokens",
            "Number of prefill tokens processed.",
            &labels,
        );
        h.generation.write(
            &mut out,
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            &labels,
        );
        for (hist, name, help) in [
            (
                &h.queue,
                "vllm:request_queue_time_seconds",
                "Histogram of time spent in WAITING phase for request.",
            ),
            (
                &h.prefill,
                "vllm:request_prefill_time_seconds",
                "Histogram of time spent in PREFILL phase for request.",
            ),
            (
                &h.decode,
                "vllm:request_decode_time_seconds",
                "Histogram of time spent in DECODE phase for request.",
            ),
            (
                &h.inference,
                "vllm:request_inference_time_seconds",
                "Histogram of time spent in RUNNING phase for request.",
            ),
        ] {
            hist.write(&mut out, name, help, &labels);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let m = Metrics::new();
        m.on_token(true, 0.003);
        m.on_token(true, 100.0);
        let page = m.render(&EngineStats::default(), "m");
        assert!(page
            .contains("vllm:time_to_first_token_seconds_bucket{model_name=\"m\",le=\"0.001\"} 0"));
        assert!(page
            .contains("vllm:time_to_first_token_seconds_bucket{model_name=\"m\",le=\"0.005\"} 1"));
        assert!(page
            .contains("vllm:time_to_first_token_seconds_bucket{model_name=\"m\",le=\"+Inf\"} 2"));
        assert!(page.contains("vllm:time_to_first_token_seconds_count{model_name=\"m\"} 2"));
        assert!(page.contains("vllm:generation_tokens_total{model_name=\"m\"} 2"));
    }

    #[test]
    fn finished_requests_feed_token_and_tpot_histograms() {
        let m = Metrics::new();
        let f = |output_tokens, ttft| Finished {
            reason: "length",
            e2e: 1.0,
            ttft,
            prompt_tokens: 7,
            output_tokens,
            first_times: None,
            decode: None,
        };
        m.on_finished(f(11, Some(0.5)));
        m.on_finished(f(1, Some(0.9)));
        m.on_finished(f(0, None));
        let page = m.render(&EngineStats::default(), "m");
        let has = |line: &str| assert!(page.contains(line), "{line} not in\n{page}");
        has("vllm:request_prompt_tokens_bucket{model_name=\"m\",le=\"5\"} 0");
        has("vllm:request_prompt_tokens_bucket{model_name=\"m\",le=\"10\"} 3");
        has("vllm:request_generation_tokens_bucket{model_name=\"m\",le=\"1\"} 2");
        has("vllm:request_generation_tokens_bucket{model_name=\"m\",le=\"20\"} 3");
        // (1.0 - 0.5) / 10 tokens after the first; one-token sequences have no TPOT.
        has("vllm:request_time_per_output_token_seconds_count{model_name=\"m\"} 1");
        has("vllm:request_time_per_output_token_seconds_bucket{model_name=\"m\",le=\"0.05\"} 1");
        has("vllm:request_time_per_output_token_seconds_bucket{model_name=\"m\",le=\"0.025\"} 0");
        has("vllm:request_success_total{model_name=\"m\",finished_reason=\"length\"} 3");
        has("vllm:request_queue_time_seconds_count{model_name=\"m\"} 0");
    }

    #[test]
    fn phase_histograms_take_the_schedulers_first_token_times_and_the_decode_span() {
        let m = Metrics::new();
        let f = |first_times, decode| Finished {
            reason: "stop",
            e2e: 1.0,
            ttft: Some(0.5),
            prompt_tokens: 7,
            output_tokens: 3,
            first_times,
            decode,
        };
        let t = FirstTokenTimes {
            queue: 0.25,
            prefill: 0.125,
        };
        m.on_finished(f(Some(t), Some(0.5)));
        // A sequence without a token has no phases.
        m.on_finished(f(None, None));
        let page = m.render(&EngineStats::default(), "m");
        let has = |line: &str| assert!(page.contains(line), "{line} not in\n{page}");
        has("vllm:request_queue_time_seconds_sum{model_name=\"m\"} 0.25");
        has("vllm:request_queue_time_seconds_count{model_name=\"m\"} 1");
        has("vllm:request_prefill_time_seconds_sum{model_name=\"m\"} 0.125");
        has("vllm:request_decode_time_seconds_sum{model_name=\"m\"} 0.5");
        has("vllm:request_inference_time_seconds_sum{model_name=\"m\"} 0.625");
        has("vllm:request_inference_time_seconds_bucket{model_name=\"m\",le=\"0.5\"} 0");
        has("vllm:request_inference_time_seconds_bucket{model_name=\"m\",le=\"0.8\"} 1");
    }
}
