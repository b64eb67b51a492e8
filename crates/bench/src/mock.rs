//! A minimal OpenAI-compatible server that streams canned tokens, to measure the load
//! generator's own ceiling (and to test it): `GET /v1/models`, `POST /v1/completions` and
//! `POST /v1/chat/completions` with `stream: true`. Each request gets `max_tokens` chunks of
//! the text `" tok"`, then a usage chunk if `stream_options.include_usage`, then `[DONE]`.
//! Prompt tokens are counted as whitespace-separated words.

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, Incoming};
use hyper::header::CONTENT_TYPE;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::net::TcpListener;

/// How the mock behaves.
#[derive(Debug, Clone)]
pub struct MockConfig {
    /// Delay before each token after the first (zero: as fast as the socket takes them).
    pub itl: Duration,
    /// Delay before the first token.
    pub ttft: Duration,
    /// The model id served.
    pub model: String,
}

impl Default for MockConfig {
    fn default() -> Self {
        MockConfig {
            itl: Duration::ZERO,
            ttft: Duration::ZERO,
            model: "mock".into(),
        }
    }
}

/// Serves connections from `listener` until the task is dropped.
///
/// # Errors
/// An `accept` failure.
pub async fn serve(listener: TcpListener, cfg: MockConfig) -> std::io::Result<()> {
    let cfg = Arc::new(cfg);
    loop {
        let (sock, _) = listener.accept().await?;
        sock.set_nodelay(true).ok();
        let cfg = cfg.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req| handle(req, cfg.clone()));
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(sock), svc)
                .await;
        });
    }
}

/// Binds `addr` (port 0 picks one) and serves in a background task; returns the address.
///
/// # Errors
/// A failed bind.
pub async fn spawn(addr: &str, cfg: MockConfig) -> std::io::Result<std::net::SocketAddr> {
    let listener = TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    tokio::spawn(serve(listener, cfg));
    Ok(local)
}

async fn handle(
    req: Request<Incoming>,
    cfg: Arc<MockConfig>,
) -> Result<Response<MockBody>, Infallible> {
    let path = req.uri().path().to_owned();
    let method = req.method().clone();
    let json = |status: StatusCode, v: serde_json::Value| {
        Response::builder()
            .status(status)
            .header(CONTENT_TYPE, "application/json")
            .body(MockBody::full(v.to_string()))
            .expect("static response")
    };
    let err = |status: StatusCode, msg: &str| {
        json(
            status,
            serde_json::json!({"error": {"message": msg, "type": "invalid_request_error"}}),
        )
    };
    let chat = match (&method, path.as_str()) {
        (&Method::GET, "/v1/models") => {
            return Ok(json(
                StatusCode::OK,
                serde_json::json!({"object": "list", "data": [{"id": cfg.model, "object": "model"}]}),
            ))
        }
        (&Method::POST, "/v1/completions") => false,
        (&Method::POST, "/v1/chat/completions") => true,
        _ => return Ok(err(StatusCode::NOT_FOUND, "not found")),
    };
    let Ok(body) = req.into_body().collect().await else {
        return Ok(err(StatusCode::BAD_REQUEST, "unreadable body"));
    };
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(&body.to_bytes()) else {
        return Ok(err(StatusCode::BAD_REQUEST, "body is not JSON"));
    };
    if v.get("stream").and_then(|s| s.as_bool()) != Some(true) {
        return Ok(err(StatusCode::BAD_REQUEST, "the mock only streams"));
    }
    let Some(max_tokens) = v.get("max_tokens").and_then(|m| m.as_u64()) else {
        return Ok(err(StatusCode::BAD_REQUEST, "max_tokens is required"));
    };
    let prompt_tokens = if chat {
        v.get("messages")
            .and_then(|m| m.as_array())
            .map(|ms| {
                ms.iter()
                    .filter_map(|m| m.get("content").and_then(|c| c.as_str()))
                    .map(|c| c.split_whitespace().count())
                    .sum()
            })
            .unwrap_or(0)
    } else {
        v.get("prompt")
            .and_then(|p| p.as_str())
            .map(|p| p.split_whitespace().count())
            .unwrap_or(0)
    };
    let include_usage = v
        .pointer("/stream_options/include_usage")
        .and_then(|b| b.as_bool())
        .unwrap_or(false);
    let usage = include_usage.then(|| {
        let kind = if chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        };
        Bytes::from(format!(
            "data: {{\"id\":\"mock\",\"object\":\"{kind}\",\"created\":0,\"model\":\"{}\",\"choices\":[],\"usage\":{{\"prompt_tokens\":{prompt_tokens},\"completion_tokens\":{max_tokens},\"total_tokens\":{}}}}}\n\n",
            cfg.model,
            prompt_tokens as u64 + max_tokens
        ))
    });
    let token = if chat {
        Bytes::from_static(b"data: {\"id\":\"mock\",\"object\":\"chat.completion.chunk\",\"created\":0,\"model\":\"mock\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\" tok\"},\"finish_reason\":null}]}\n\n")
    } else {
        Bytes::from_static(b"data: {\"id\":\"mock\",\"object\":\"text_completion\",\"created\":0,\"model\":\"mock\",\"choices\":[{\"index\":0,\"text\":\" tok\",\"logprobs\":null,\"finish_reason\":null}]}\n\n")
    };
    let prelude = chat.then(|| Bytes::from_static(b"data: {\"id\":\"mock\",\"object\":\"chat.completion.chunk\",\"created\":0,\"model\":\"mock\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\"},\"finish_reason\":null}]}\n\n"));
    let body = MockBody {
        prelude,
        token,
        left: max_tokens,
        usage,
        done: false,
        first: true,
        ttft: cfg.ttft,
        itl: cfg.itl,
        sleep: None,
        full: None,
    };
    Ok(Response::builder()
        .status(StatusCode::OK)
        .header(CONTENT_TYPE, "text/event-stream")
        .body(body)
        .expect("static response"))
}

/// The mock's response body: a whole JSON body, or the token stream.
struct MockBody {
    prelude: Option<Bytes>,
    token: Bytes,
    left: u64,
    usage: Option<Bytes>,
    done: bool,
    first: bool,
    ttft: Duration,
    itl: Duration,
    sleep: Option<Pin<Box<tokio::time::Sleep>>>,
    full: Option<Bytes>,
}

impl MockBody {
    fn full(s: String) -> MockBody {
        MockBody {
            prelude: None,
            token: Bytes::new(),
            left: 0,
            usage: None,
            done: true,
            first: false,
            ttft: Duration::ZERO,
            itl: Duration::ZERO,
            sleep: None,
            full: Some(Bytes::from(s)),
        }
    }
}

impl Body for MockBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let this = &mut *self;
        if let Some(b) = this.full.take() {
            return Poll::Ready(Some(Ok(Frame::data(b))));
        }
        if let Some(b) = this.prelude.take() {
            return Poll::Ready(Some(Ok(Frame::data(b))));
        }
        if this.left > 0 {
            let delay = if this.first { this.ttft } else { this.itl };
            if !delay.is_zero() {
                let sleep = this
                    .sleep
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(delay)));
                if sleep.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
                this.sleep = None;
            }
            this.first = false;
            this.left -= 1;
            return Poll::Ready(Some(Ok(Frame::data(this.token.clone()))));
        }
        if let Some(u) = this.usage.take() {
            return Poll::Ready(Some(Ok(Frame::data(u))));
        }
        if !this.done {
            this.done = true;
            return Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(
                b"data: [DONE]\n\n",
            )))));
        }
        Poll::Ready(None)
    }

    fn is_end_stream(&self) -> bool {
        self.done && self.full.is_none()
    }
}
