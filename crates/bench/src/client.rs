//! One streamed request, timed on the client: time to first token, every inter-token gap,
//! end-to-end latency, and what the stream said (text, usage, errors).
//!
//! One `hyper` client (a keep-alive connection pool) serves every request. The body is read
//! frame by frame into one [`LineSplitter`] per request; timestamps are taken once per frame
//! (chunks that arrive in the same read share it, which is what the client saw).

use crate::sse::{self, Event, Line, LineSplitter, Usage};
use anyhow::{bail, Context, Result};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::header::{ACCEPT, AUTHORIZATION, CONTENT_TYPE};
use hyper::{Request, Uri};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use std::time::{Duration, Instant};

/// The shared HTTP client: one keep-alive pool for all requests.
pub type Http = Client<HttpConnector, Full<Bytes>>;

/// A client whose pool keeps up to `pool` idle connections per host (set it to the
/// concurrency so connections are reused, not reopened).
pub fn http_client(pool: usize) -> Http {
    let mut c = HttpConnector::new();
    c.set_nodelay(true);
    c.set_connect_timeout(Some(Duration::from_secs(10)));
    Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(pool)
        .pool_idle_timeout(Duration::from_secs(90))
        .build(c)
}

/// Joins a base URL (`http://host:port`, optionally with a path prefix such as `/v1`'s parent)
/// and a path.
///
/// # Errors
/// A URL that is not `http://…` (HTTPS is not supported) or does not parse.
pub fn join_url(base: &str, path: &str) -> Result<Uri> {
    let base = base.trim_end_matches('/');
    if base.starts_with("https://") {
        bail!("--base-url {base}: only plain http:// is supported");
    }
    if !base.starts_with("http://") {
        bail!("--base-url {base}: expected http://HOST:PORT");
    }
    let path = if path.starts_with('/') {
        path.to_owned()
    } else {
        format!("/{path}")
    };
    let url = format!("{base}{path}");
    url.parse::<Uri>()
        .with_context(|| format!("{url} is not a valid URL"))
}

/// Everything measured about one request. Times are seconds.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    /// The stream completed (`[DONE]` after at least one token chunk) without an error event.
    pub ok: bool,
    /// Why it failed.
    pub error: Option<String>,
    /// When the request was sent, seconds since the benchmark started.
    pub start_s: f64,
    /// Time to the first token chunk ([`sse::is_token`]), seconds.
    pub ttft_s: f64,
    /// Gaps between consecutive token chunks, seconds.
    pub itl_s: Vec<f64>,
    /// Send to the end of the stream, seconds.
    pub e2e_s: f64,
    /// Chunks that carried a token ([`sse::is_token`]).
    pub chunks: usize,
    /// The generated text (only kept when asked to, to count tokens with a tokenizer).
    pub text: String,
    /// The server's `usage`, when the stream carried it.
    pub usage: Option<Usage>,
}

/// How to send one request.
#[derive(Debug, Clone)]
pub struct Target {
    /// The endpoint's full URL.
    pub uri: Uri,
    /// `Authorization: Bearer` value, if any.
    pub api_key: Option<String>,
    /// Keep the generated text in [`Outcome::text`].
    pub keep_text: bool,
    /// Give up on a request after this long.
    pub timeout: Duration,
}

/// Sends one streaming request and measures it. `t0` is the benchmark's start;
/// `max_tokens` sizes the gap buffer so that no allocation happens per token.
pub async fn run_one(
    http: &Http,
    target: &Target,
    body: Bytes,
    max_tokens: u32,
    t0: Instant,
) -> Outcome {
    let start = Instant::now();
    let mut out = Outcome {
        start_s: start.duration_since(t0).as_secs_f64(),
        itl_s: Vec::with_capacity(max_tokens as usize),
        ..Outcome::default()
    };
    let deadline = tokio::time::Instant::from_std(start + target.timeout);
    if let Err(e) = stream(http, target, body, start, deadline, &mut out).await {
        out.ok = false;
        out.error = Some(format!("{e:#}"));
    }
    out.e2e_s = start.elapsed().as_secs_f64();
    out
}

async fn stream(
    http: &Http,
    target: &Target,
    body: Bytes,
    start: Instant,
    deadline: tokio::time::Instant,
    out: &mut Outcome,
) -> Result<()> {
    let mut req = Request::post(target.uri.clone())
        .header(CONTENT_TYPE, "application/json")
        .header(ACCEPT, "text/event-stream");
    if let Some(k) = &target.api_key {
        req = req.header(AUTHORIZATION, format!("Bearer {k}"));
    }
    let req = req.body(Full::new(body))?;
    let uri = &target.uri;
    let resp = tokio::time::timeout_at(deadline, http.request(req))
        .await
        .map_err(|_| anyhow::anyhow!("POST {uri}: no response within {:?}", target.timeout))?
        .map_err(|e| anyhow::anyhow!("POST {uri}: {}", error_chain(&e)))?;
    let status = resp.status();
    let ctype = resp
        .headers()
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let mut body = resp.into_body();
    if !status.is_success() {
        let text = read_some(&mut body, deadline).await;
        bail!(
            "POST {uri}: HTTP {status}: {}",
            openai_error(&text).unwrap_or_else(|| sse::excerpt(&text))
        );
    }
    if !ctype.starts_with("text/event-stream") {
        let text = read_some(&mut body, deadline).await;
        bail!(
            "POST {uri}: expected a streamed response (Content-Type: text/event-stream), got \
             Content-Type {ctype:?}: {}; is this an OpenAI-compatible server?",
            sse::excerpt(&text)
        );
    }
    let mut split = LineSplitter::with_capacity(4096);
    let mut last = start;
    loop {
        let frame = tokio::time::timeout_at(deadline, body.frame())
            .await
            .map_err(|_| {
                anyhow::anyhow!("the stream did not finish within {:?}", target.timeout)
            })?;
        let Some(frame) = frame else {
            bail!("the stream ended without `data: [DONE]`");
        };
        let frame =
            frame.map_err(|e| anyhow::anyhow!("reading the stream: {}", error_chain(&e)))?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        let now = Instant::now();
        split.feed(&data).map_err(anyhow::Error::msg)?;
        while let Some(line) = split.next() {
            match line {
                Line::Ignored => {}
                Line::Invalid(l) => bail!(
                    "not an SSE stream: a line reads {:?}; is this an OpenAI-compatible server?",
                    sse::excerpt(l)
                ),
                Line::Data(p) => match sse::parse_event(p).map_err(anyhow::Error::msg)? {
                    Event::Done => {
                        if out.chunks == 0 {
                            bail!("the stream finished without any generated token");
                        }
                        out.ok = true;
                        return Ok(());
                    }
                    Event::Error(m) => bail!("error event in the stream: {m}"),
                    Event::Chunk { text, token, usage } => {
                        if let Some(u) = usage {
                            out.usage = Some(u);
                        }
                        if token {
                            if out.chunks == 0 {
                                out.ttft_s = now.duration_since(start).as_secs_f64();
                            } else {
                                out.itl_s.push(now.duration_since(last).as_secs_f64());
                            }
                            last = now;
                            out.chunks += 1;
                        }
                        if target.keep_text {
                            if let Some(t) = text {
                                out.text.push_str(&t);
                            }
                        }
                    }
                },
            }
        }
    }
}

/// Reads up to 4 KiB of a body (for error messages), giving up at the deadline.
async fn read_some(body: &mut hyper::body::Incoming, deadline: tokio::time::Instant) -> Vec<u8> {
    let mut buf = Vec::new();
    while buf.len() < 4096 {
        match tokio::time::timeout_at(deadline, body.frame()).await {
            Ok(Some(Ok(f))) => {
                if let Ok(d) = f.into_data() {
                    buf.extend_from_slice(&d);
                }
            }
            _ => break,
        }
    }
    buf
}

/// The `error.message` of an OpenAI error body, if it is one.
fn openai_error(body: &[u8]) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    v.get("error").map(sse::error_message)
}

/// An error and its sources, `: `-joined (hyper's top-level messages say little alone).
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(x) = src {
        let m = x.to_string();
        if !s.contains(&m) {
            s.push_str(": ");
            s.push_str(&m);
        }
        src = x.source();
    }
    s
}

/// `GET {base}/v1/models`: the served model ids.
///
/// # Errors
/// No connection, a non-2xx status, or a body that is not an OpenAI model list; each message
/// says which.
pub async fn list_models(http: &Http, base: &str, api_key: Option<&str>) -> Result<Vec<String>> {
    let uri = join_url(base, "/v1/models")?;
    let mut req = Request::get(uri.clone());
    if let Some(k) = api_key {
        req = req.header(AUTHORIZATION, format!("Bearer {k}"));
    }
    let req = req.body(Full::new(Bytes::new()))?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let resp = tokio::time::timeout_at(deadline, http.request(req))
        .await
        .map_err(|_| anyhow::anyhow!("GET {uri}: no response within 30 s"))?
        .map_err(|e| anyhow::anyhow!("GET {uri}: {}", error_chain(&e)))?;
    let status = resp.status();
    let mut body = resp.into_body();
    let text = read_some(&mut body, deadline).await;
    if !status.is_success() {
        // The OpenAI clients' base URL ends in /v1; this one is the server's root (vLLM's
        // `bench serve --base-url`), and the paths add /v1.
        let root = base.trim_end_matches('/');
        let hint = match root.strip_suffix("/v1") {
            Some(r) => format!("; --base-url is the server's root, without /v1: try {r}"),
            None => "; is this an OpenAI-compatible server?".into(),
        };
        bail!(
            "GET {uri}: HTTP {status}: {}{hint}",
            openai_error(&text).unwrap_or_else(|| sse::excerpt(&text))
        );
    }
    let v: serde_json::Value = serde_json::from_slice(&text).map_err(|_| {
        anyhow::anyhow!(
            "GET {uri}: not an OpenAI model list (not JSON): {}; is this an OpenAI-compatible \
             server?",
            sse::excerpt(&text)
        )
    })?;
    let Some(data) = v.get("data").and_then(|d| d.as_array()) else {
        bail!(
            "GET {uri}: not an OpenAI model list (no \"data\" array): {}",
            sse::excerpt(&text)
        );
    };
    Ok(data
        .iter()
        .filter_map(|m| m.get("id").and_then(|i| i.as_str()).map(str::to_owned))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        assert_eq!(
            join_url("http://127.0.0.1:8000/", "/v1/completions")
                .unwrap()
                .to_string(),
            "http://127.0.0.1:8000/v1/completions"
        );
        assert_eq!(
            join_url("http://h:1/api", "v1/models").unwrap().to_string(),
            "http://h:1/api/v1/models"
        );
        assert!(join_url("https://h", "/x").is_err());
        assert!(join_url("localhost:8000", "/x").is_err());
    }
}
