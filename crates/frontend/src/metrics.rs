//! Prometheus metrics with vLLM's names, written as text exposition format by hand.

use crate::engine::EngineStats;
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

    /// A sequence finished after `e2e` seconds with `reason` (`stop`, `length`, `abort`).
    pub fn on_finished(&self, reason: &str, e2e: f64) {
        if let Some(i) = FINISHED.iter().position(|r| *r == reason) {
            self.finished[i].fetch_add(1, Ordering::Relaxed);
        }
        self.hist().e2e.observe(e2e);
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
}
