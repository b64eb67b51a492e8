//! `POST /v1/responses`: OpenAI's Responses API over the chat pipeline, as vLLM serves it
//! without a response store.
//!
//! Contract: the input items (and `instructions`, as a system message first) are rendered by
//! the chat template (a `reasoning` item, as this endpoint returns them, becomes the
//! `reasoning_content` of the assistant message that follows it) and go through the same validation, admission, engine events,
//! cancellation and metrics as `/v1/chat/completions`; the output is one assistant message
//! with one `output_text` part. A last input message (or reasoning) item whose `status` is
//! `in_progress` or `incomplete` is continued: the prompt ends right after its content (vLLM's
//! `should_continue_final_message`). A `length` finish makes the response `incomplete` (reason
//! `max_output_tokens`), any other finish `completed`. Nothing is stored: `previous_response_id`
//! is refused and there is no `GET /v1/responses/{id}`.
//!
//! Log-probabilities, as vLLM serves them (its `ResponsesRequest.is_include_output_logprobs`):
//! with `include: ["message.output_text.logprobs"]` the `output_text` part's `logprobs` lists
//! one entry per output token, `{"token", "logprob", "bytes", "top_logprobs": [{"token",
//! "logprob", "bytes"}]}` (OpenAI's `Logprob`), with `top_logprobs` (0..=20, default 0)
//! alternatives each, most likely first; the entries are chat's (`OutputLogprobs`), so a
//! log-probability is at least -9999 and `--return-tokens-as-token-ids` names tokens by id.
//! `top_logprobs` alone asks for nothing (vLLM's rule) but is echoed. Without `include` the
//! `logprobs` lists are empty. Every other `include` value OpenAI defines (tool outputs,
//! images, encrypted reasoning) and any unknown value is a 400 naming it, as are
//! `top_logprobs` outside 0..=20 and chat's `logprobs` field.
//!
//! Streamed, every event is `event: <type>` plus a JSON `data:` line carrying `type` and a
//! `sequence_number` that counts from 0: `response.created`, `response.in_progress`,
//! `response.output_item.added`, `response.content_part.added`, one
//! `response.output_text.delta` per piece of text, `response.output_text.done`,
//! `response.content_part.done`, `response.output_item.done`, then `response.completed` (or
//! `response.incomplete`) with the whole response. There is no `data: [DONE]`. An engine error
//! after the stream started ends it with an `error` event (vLLM's) and a `response.failed`
//! carrying the response with its `error`. With log-probabilities, each
//! `response.output_text.delta` carries the entries of the tokens since the previous one and
//! `response.output_text.done` all of them, both in the text events' shape (OpenAI's
//! `ResponseTextDeltaEvent.logprobs`: `{"token", "logprob", "top_logprobs": [{"token",
//! "logprob"}]}`, no bytes); the content part, the message item and the final response carry
//! the full entries. Tokens whose text has not reached the output when the output ends (the
//! EOS that ended it, a stop string's tokens) come in a last delta with empty text.
//!
//! With `--reasoning-parser` ([`crate::reasoning`]; not for a request with a structured
//! output), the reasoning comes first as a `reasoning` output item, as vLLM's:
//! `{"type": "reasoning", "id": "rs_...", "summary": [], "content": [{"type":
//! "reasoning_text", "text": ...}], "status": ...}`, and the message is output 1. Streamed,
//! the reasoning item opens at the first reasoning text (`response.output_item.added`,
//! `response.content_part.added` with a `reasoning_text` part), sends
//! `response.reasoning_text.delta` events, and closes (`response.reasoning_text.done`,
//! `response.content_part.done`, `response.output_item.done`) before the message item opens;
//! the message item always comes, empty when the output was cut inside the reasoning (the
//! reasoning item says `completed` even then; the response says `incomplete`). The
//! template gets no `chat_template_kwargs` here, so `qwen3` always expects thinking. Only the
//! answer's tokens have log-probabilities (the reasoning item has none): those after the
//! reasoning ended, and a token whose text both ends it and starts the answer; not the
//! reasoning's, nor `<think>`/`</think>` (`OutputSplitter`).
//!
//! Function tools, as vLLM serves them on this endpoint: `tools` are flat function tools
//! (`{"type": "function", "name", "description", "parameters", "strict"}`), converted to the
//! chat form for the template and echoed in the response; `tool_choice` is `none`, `auto`
//! (the default: the output is parsed by the server's `--tool-call-parser`, which needs
//! `--enable-auto-tool-choice`, as on chat), `required` or `{"type": "function", "name"}`
//! (both guided by the tools' schemas, as on chat). Each call becomes a `function_call`
//! output item, `{"type": "function_call", "id": "fc_...", "call_id", "name", "arguments",
//! "status"}`, after the message; the message item is left out when the output was calls
//! only. Input items `function_call` (joined to the assistant message before it, as vLLM)
//! and `function_call_output` (a `tool` message) carry a tool round trip back. Streamed, text
//! that may be a call is held as on chat ([`StreamFilter`]); at the end each call is added
//! (`response.output_item.added` with empty arguments), gets its arguments in one
//! `response.function_call_arguments.delta`, then `response.function_call_arguments.done` and
//! `response.output_item.done`. Output log-probabilities with tools (a `tool_choice` other
//! than `none`) are refused.

use crate::engine::random_seed;
use crate::openai::ApiError;
use crate::reasoning::{ReasoningSplitter, Split};
use crate::seq::{Delta, Seq, TokenInfo};
use crate::server::{
    collect_with, delta_event_stream, engine_error, now_secs, AppState, DeltaEvents,
};
use crate::tools::{StreamFilter, ToolCall, ToolParser};
use crate::validate::{self, GenParams, ResponsesRequest};
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

/// `POST /v1/responses`.
pub async fn create(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    match create_inner(st, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

/// An id of OpenAI's form for Responses objects: `<prefix>_<32 hex digits>`.
fn object_id(prefix: &str) -> String {
    format!("{prefix}_{:016x}{:016x}", random_seed(), random_seed())
}

/// With a response store: resolves `previous_response_id` by putting the stored
/// conversation (its input items and its output) before the request's `input`. Returns the
/// body to parse, the previous response's id, and the conversation's input items to store
/// with this response (`None` without a store, or for a body the parser will refuse).
///
/// # Errors
/// 404 naming `previous_response_id` when no such response is stored; 400 when it is not a
/// string.
fn with_previous(st: &AppState, body: Bytes) -> Result<Resolved, ApiError> {
    let plain = |body, conversation| Resolved {
        body,
        previous: None,
        prefix: 0,
        conversation,
    };
    let Some(store) = st.responses_store.as_ref() else {
        return Ok(plain(body, None));
    };
    let Ok(Value::Object(mut o)) = serde_json::from_slice::<Value>(&body) else {
        return Ok(plain(body, None));
    };
    let own = match o.get("input") {
        Some(Value::String(s)) => vec![json!({"role": "user", "content": s})],
        Some(Value::Array(items)) => items.clone(),
        _ => return Ok(plain(body, None)),
    };
    let prev = match o.remove("previous_response_id") {
        None | Some(Value::Null) => return Ok(plain(body, Some(normalized_items(own)))),
        Some(Value::String(id)) => id,
        Some(_) => {
            return Err(ApiError::field(
                "previous_response_id",
                "'previous_response_id' must be a string.",
            ))
        }
    };
    let stored = store.get(&prev).ok_or_else(|| {
        ApiError::not_found(
            Some("previous_response_id"),
            format!("Previous response with id '{prev}' not found."),
        )
    })?;
    let mut input = stored.input;
    if let Some(output) = stored.response["output"].as_array() {
        input.extend(output.iter().cloned());
    }
    let prefix = input.len();
    input.extend(own);
    o.insert("input".into(), Value::Array(input.clone()));
    let body = serde_json::to_vec(&Value::Object(o))
        .map_err(|e| ApiError::internal(format!("re-encoding the request: {e}")))?;
    Ok(Resolved {
        body: Bytes::from(body),
        previous: Some(prev),
        prefix,
        conversation: Some(normalized_items(input)),
    })
}

/// Input items in the form OpenAI lists them (`GET /v1/responses/{id}/input_items`) and
/// stores them: each with a `type` (`message` for a bare `{"role", "content"}`), an `id` unique
/// in the list (the client's, or a new `msg_`/`rs_`/`fc_`/`fco_`... one), a message's string
/// `content` as one `input_text` part (`output_text` for the assistant's) and a `status`
/// (`completed` unless given). The text each item renders to is unchanged.
fn normalized_items(items: Vec<Value>) -> Vec<Value> {
    let mut seen = std::collections::HashSet::new();
    items
        .into_iter()
        .map(|mut item| {
            let Some(o) = item.as_object_mut() else {
                return item;
            };
            if o.contains_key("role") {
                o.entry("type").or_insert_with(|| json!("message"));
            }
            let kind = o.get("type").and_then(Value::as_str).unwrap_or_default();
            let prefix = match kind {
                "message" => "msg",
                "reasoning" => "rs",
                "function_call" => "fc",
                "function_call_output" => "fco",
                _ => "item",
            };
            if kind == "message" {
                if let Some(Value::String(text)) = o.get("content") {
                    let part = if o.get("role").and_then(Value::as_str) == Some("assistant") {
                        "output_text"
                    } else {
                        "input_text"
                    };
                    let content = json!([{"type": part, "text": text}]);
                    o.insert("content".into(), content);
                }
                o.entry("status").or_insert_with(|| json!("completed"));
            }
            let id = o.get("id").and_then(Value::as_str).map(str::to_owned);
            match id {
                Some(id) if seen.insert(id.clone()) => {}
                _ => {
                    let id = object_id(prefix);
                    seen.insert(id.clone());
                    o.insert("id".into(), Value::String(id));
                }
            }
            item
        })
        .collect()
}

/// `e` with an `input[N]` index counted in the request's own `input` (the stored items
/// spliced before it are `prefix` items).
fn own_index(mut e: ApiError, prefix: usize) -> ApiError {
    let Some(rest) = e.param.as_deref().and_then(|p| p.strip_prefix("input[")) else {
        return e;
    };
    let Some((n, tail)) = rest.split_once(']') else {
        return e;
    };
    if let Some(n) = n.parse::<usize>().ok().and_then(|n| n.checked_sub(prefix)) {
        e.param = Some(format!("input[{n}]{tail}"));
    }
    e
}

/// A request body with `previous_response_id` resolved ([`with_previous`]).
struct Resolved {
    /// The body to parse.
    body: Bytes,
    /// The previous response's id.
    previous: Option<String>,
    /// How many stored items come before the request's own `input`.
    prefix: usize,
    /// The conversation's input items to store with this response.
    conversation: Option<Vec<Value>>,
}

async fn create_inner(st: Arc<AppState>, body: Bytes) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let limits = st.engine.limits();
    let Resolved {
        body,
        previous,
        prefix,
        conversation,
    } = with_previous(&st, body)?;
    let mut req = validate::parse_responses(&body, &limits, &st.config.sampling_defaults)
        .map_err(|e| own_index(e, prefix))?;
    req.gen.lora = st.check_model(req.model.as_deref())?;
    let mut gen = req.gen.clone();
    let mode = st.call_mode(&req.tool_choice, &mut gen)?;
    let mut template_vars = serde_json::Map::new();
    if let Some(tools) = &req.tools {
        template_vars.insert("tools".into(), Value::Array(tools.clone()));
    }
    let ids = input_ids(&st, &req, &template_vars, limits.max_model_len).await?;
    let max = validate::resolve_max_tokens(
        &limits,
        ids.len(),
        req.gen.max_tokens,
        req.gen.default_max_tokens,
        "input",
        req.gen.max_tokens_param,
    )?;
    let input_tokens = ids.len();
    let reasoning = st.reasoning_parser(&mut gen, &serde_json::Map::new());
    let seqs = st.submit_all(&[(ids, max)], &gen, arrived)?;
    let mut shell = Shell::new(&st, &req, max);
    shell.previous_response_id = previous;
    if req.store && st.responses_store.is_some() {
        shell.keep = conversation.map(|input| Keep {
            st: Arc::clone(&st),
            input,
        });
    }
    let no_kwargs = serde_json::Map::new();
    let mut counter = reasoning.map(|r| ReasoningTokens::new(r.splitter(&no_kwargs)));
    let splitter = || OutputSplitter {
        reasoning: reasoning.map(|r| r.splitter(&no_kwargs)),
    };
    let mut logprobs = OutputLogprobs::new(&st, &gen);
    if gen.stream {
        return Ok(stream_response(
            shell,
            seqs,
            input_tokens,
            splitter(),
            counter,
            logprobs,
            mode.map(|m| StreamFilter::with_tools(m, req.tools.clone().unwrap_or_default())),
        ));
    }
    // With log-probabilities, the deltas are split as a stream would be, to tell the
    // answer's tokens from the reasoning's.
    let mut token_splitter = logprobs.is_some().then(splitter);
    let (outs, output_tokens) = collect_with(seqs, |d| {
        if let Some(c) = counter.as_mut() {
            c.push(d);
        }
        if let (Some(s), Some(lp)) = (token_splitter.as_mut(), logprobs.as_mut()) {
            if s.push(d).1 {
                lp.push(&d.tokens);
            }
        }
    })
    .await?;
    let out = outs.into_iter().next().unwrap_or_default();
    let status = status_of(out.finish);
    let reasoning_tokens = counter.map_or(0, |c| c.count);
    let usage = usage(
        input_tokens,
        out.cached_tokens,
        output_tokens,
        reasoning_tokens,
    );
    let split = match reasoning {
        Some(r) => r.split(&no_kwargs, &out.text),
        None => Split {
            reasoning: String::new(),
            content: out.text,
        },
    };
    // The tool call parser sees only the answer, after the reasoning parser.
    let (split, calls) = match &mode {
        None => (split, Vec::new()),
        Some(m) => {
            let parsed = m.parse_with(&split.content, req.tools.as_deref().unwrap_or_default());
            let split = Split {
                reasoning: split.reasoning,
                content: parsed.content.unwrap_or_default(),
            };
            (split, shell.function_calls(parsed.calls))
        }
    };
    let lp = logprobs
        .as_ref()
        .map_or_else(|| json!([]), OutputLogprobs::all);
    let output = shell.output(&split, &lp, status, &calls);
    let mut r = shell.response(status, output, usage, error_of(status));
    shell.keep(&mut r);
    Ok(Json(r).into_response())
}

/// The tokens of the rendered input. With `truncation: "auto"` an input that does not fit
/// the context (with `max_output_tokens`, or at least one output token) loses its oldest
/// items, system and developer messages excepted, as few as make it fit ([`drop_oldest`];
/// found by bisection, so a long history costs a logarithmic number of renderings), keeping
/// at least the last; OpenAI's rule (it drops items from the beginning of the conversation).
///
/// # Errors
/// 400 naming `input` when the template fails or the input does not fit (what is left, under
/// `auto`).
async fn input_ids(
    st: &AppState,
    req: &ResponsesRequest,
    template_vars: &serde_json::Map<String, Value>,
    max_model_len: usize,
) -> Result<Vec<u32>, ApiError> {
    let cont = req.continue_final_message;
    let render = |messages: &[Value]| {
        st.render_conversation(messages, !cont, cont, template_vars)
            .map_err(|mut e| {
                if matches!(
                    e.param.as_deref(),
                    Some("messages" | "continue_final_message")
                ) {
                    e.param = Some("input".into());
                }
                e
            })
    };
    let droppable = req
        .messages
        .iter()
        .filter(|m| !is_system(m))
        .count()
        .saturating_sub(1);
    if !req.truncation_auto || droppable == 0 {
        // As on chat: the template writes the special tokens.
        let text = render(&req.messages)?;
        return st.encode_prompt(&text, false, "input", max_model_len).await;
    }
    let room = req.gen.max_tokens.map_or(1, |m| m.max(1) as usize);
    // The tokens of the input less its `k` oldest items, if they fit.
    let attempt = |k: usize| {
        let messages = drop_oldest(&req.messages, k);
        async move {
            let text = render(&messages)?;
            // A text longer than the context's bytes bound cannot fit: no need to tokenize it.
            if text.len() > st.prompt_byte_bound(max_model_len) {
                return Ok(None);
            }
            let ids = st.encode_prompt(&text, false, "input", usize::MAX).await?;
            Ok::<_, ApiError>((ids.len().saturating_add(room) <= max_model_len).then_some(ids))
        }
    };
    if let Some(ids) = attempt(0).await? {
        return Ok(ids);
    }
    let Some(mut best) = attempt(droppable).await? else {
        // Even the last item alone does not fit: the usual error.
        let text = render(&drop_oldest(&req.messages, droppable))?;
        return st.encode_prompt(&text, false, "input", max_model_len).await;
    };
    // The fewest items to drop: `lo` does not fit, `hi` does.
    let (mut lo, mut hi) = (0, droppable);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        match attempt(mid).await? {
            Some(ids) => {
                hi = mid;
                best = ids;
            }
            None => lo = mid,
        }
    }
    Ok(best)
}

/// Whether `m` is a system or developer message (kept by `truncation: "auto"`).
fn is_system(m: &Value) -> bool {
    matches!(m["role"].as_str(), Some("system" | "developer"))
}

/// `messages` without their `k` oldest messages other than system and developer ones, and
/// without the `tool` messages that then come first (their call is gone); the last message
/// always stays.
fn drop_oldest(messages: &[Value], k: usize) -> Vec<Value> {
    let last = messages.len().saturating_sub(1);
    let mut dropped = 0;
    let mut out = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        if is_system(m) || i == last {
            out.push(m.clone());
            continue;
        }
        let orphan = m["role"] == "tool" && out.iter().all(is_system);
        if dropped < k || (dropped > 0 && orphan) {
            dropped += 1;
            continue;
        }
        out.push(m.clone());
    }
    out
}

/// Splits an output's deltas into reasoning and answer text (with `--reasoning-parser`;
/// without one everything is the answer), and says which deltas' tokens are the answer's
/// (`output_text`'s, for its log-probabilities).
///
/// A delta's tokens are the answer's when the reasoning had ended before them, or when their
/// text released answer text (a token that both ends the reasoning and starts the answer
/// counts as the answer's). The reasoning's tokens, `<think>` and `</think>` included, are
/// not: a reasoning item has no log-probabilities.
struct OutputSplitter {
    /// With a reasoning parser: its splitter.
    reasoning: Option<ReasoningSplitter>,
}

impl OutputSplitter {
    /// Splits `d`'s text (releasing what is held back on the last delta); returns the split
    /// and whether `d`'s tokens are the answer's.
    fn push(&mut self, d: &Delta) -> (Split, bool) {
        let Some(s) = self.reasoning.as_mut() else {
            let split = Split {
                reasoning: String::new(),
                content: d.text.clone(),
            };
            return (split, true);
        };
        let answered = !s.in_reasoning();
        let mut out = s.push(&d.text);
        if d.finish.is_some() {
            out.append(s.finish());
        }
        let answer = answered || !out.content.is_empty();
        (out, answer)
    }
}

/// The output text's log-probabilities, with `include: ["message.output_text.logprobs"]`
/// (`gen.logprobs`): one entry per answer token in OpenAI's Responses `Logprob` shape,
/// `{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}`, built
/// as chat's `logprobs.content` is ([`AppState::chat_logprobs`]: log-probabilities floored at
/// -9999, tokens named `token_id:{id}` under `--return-tokens-as-token-ids`).
///
/// Every answer token has an entry, those whose text is not in the output too (the EOS that
/// ended it, a stop string's tokens), as on chat and in vLLM.
struct OutputLogprobs {
    st: Arc<AppState>,
    as_id: bool,
    /// The entries so far.
    entries: Vec<Value>,
    /// How many of `entries` a `response.output_text.delta` has carried.
    sent: usize,
}

impl OutputLogprobs {
    /// `None` unless `gen` asks for log-probabilities.
    fn new(st: &Arc<AppState>, gen: &GenParams) -> Option<Self> {
        gen.logprobs.map(|_| Self {
            st: Arc::clone(st),
            as_id: st.tokens_as_ids(gen),
            entries: Vec::new(),
            sent: 0,
        })
    }

    /// Adds the entries of answer `tokens`. Each log-probability is written as chat writes
    /// its `f32` (the shortest decimal form, see [`echo_f32`]), so the two endpoints report
    /// the same numbers.
    fn push(&mut self, tokens: &[TokenInfo]) {
        let lp = self.st.chat_logprobs(tokens, self.as_id);
        self.entries.extend(lp.content.iter().map(|e| {
            let top: Vec<Value> = e
                .top_logprobs
                .iter()
                .map(
                    |t| json!({"token": t.token, "logprob": echo_f32(t.logprob), "bytes": t.bytes}),
                )
                .collect();
            json!({"token": e.token, "logprob": echo_f32(e.logprob), "bytes": e.bytes,
                   "top_logprobs": top})
        }));
    }

    /// The entries no `response.output_text.delta` has carried yet, in the events' shape; they
    /// count as carried from now on.
    fn unsent(&mut self) -> Value {
        let out = event_logprobs(&self.entries[self.sent..]);
        self.sent = self.entries.len();
        out
    }

    /// Every entry, as the `output_text` part carries them.
    fn all(&self) -> Value {
        Value::Array(self.entries.clone())
    }
}

/// Log-probability entries in the shape of the text events' `logprobs` (OpenAI's
/// `ResponseTextDeltaEvent` and `ResponseTextDoneEvent`, as vLLM streams them): `{"token",
/// "logprob", "top_logprobs": [{"token", "logprob"}]}`, without the bytes.
fn event_logprobs(entries: &[Value]) -> Value {
    let strip = |v: &Value| {
        let mut v = v.clone();
        if let Some(o) = v.as_object_mut() {
            o.remove("bytes");
        }
        v
    };
    entries
        .iter()
        .map(|e| {
            let mut e = strip(e);
            if let Some(top) = e.get_mut("top_logprobs").and_then(Value::as_array_mut) {
                for t in top.iter_mut() {
                    *t = strip(t);
                }
            }
            e
        })
        .collect()
}

/// The response's status (and its output message's) for a sequence's finish reason.
fn status_of(finish: Option<&str>) -> &'static str {
    match finish {
        Some("length") => "incomplete",
        // The engine gave up on the request (a structured output's grammar failed, or it could
        // no longer fit): not a completed answer.
        Some("abort") => "failed",
        _ => "completed",
    }
}

/// The `error` of a response with `status`.
fn error_of(status: &str) -> Value {
    if status == "failed" {
        json!({"code": "server_error", "message": "The engine aborted the generation (for \
               example, a structured output's grammar exceeded its limits); the output is \
               incomplete."})
    } else {
        Value::Null
    }
}

/// The Responses API `usage` object.
fn usage(
    input_tokens: usize,
    cached_tokens: usize,
    output_tokens: usize,
    reasoning_tokens: usize,
) -> Value {
    json!({
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": input_tokens + output_tokens,
    })
}

/// Counts an output's reasoning tokens (`output_tokens_details.reasoning_tokens`) from its
/// deltas, as vLLM's reasoning parsers count them: the output tokens up to the one that ends
/// the reasoning (`</think>`), the think tags themselves not counted. An output that never
/// ends its reasoning is all reasoning, as its text is (vLLM's `deepseek_r1` counts 0 there).
struct ReasoningTokens {
    splitter: ReasoningSplitter,
    count: usize,
}

impl ReasoningTokens {
    fn new(splitter: ReasoningSplitter) -> Self {
        Self { splitter, count: 0 }
    }

    /// Counts `d`'s tokens if its text is still reasoning (one token per delta: the engine
    /// reports them one by one).
    fn push(&mut self, d: &Delta) {
        if !self.splitter.in_reasoning() {
            return;
        }
        let _ = self.splitter.push(&d.text);
        if self.splitter.in_reasoning() && d.text != crate::reasoning::THINK_START {
            self.count += d.tokens.len();
        }
    }
}

/// An `f32` as the client most likely wrote it (a sampling parameter) or as a serialized
/// `f32` reads (a log-probability): its shortest decimal form (`0.7`, where widening the
/// `f32` would echo `0.699999988079071`).
fn echo_f32(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(f64::from(x))
}

/// Where a finished response is stored: the server (its store) and the conversation's input
/// items to keep with it.
struct Keep {
    st: Arc<AppState>,
    input: Vec<Value>,
}

impl Shell {
    /// Stores the finished response `r`, if this response is to be kept; one larger than the
    /// whole store is not, and then says `"store": false`.
    fn keep(&self, r: &mut Value) {
        let Some(k) = &self.keep else {
            return;
        };
        if let Some(store) = k.st.responses_store.as_ref() {
            let entry = crate::store::StoredResponse {
                input: k.input.clone(),
                response: r.clone(),
            };
            if !store.insert(&self.id, entry) {
                tracing::warn!(
                    "response {} not stored: larger than --responses-store-mib",
                    self.id
                );
                r["store"] = json!(false);
            }
        }
    }
}

/// The stored response `id`, or a 404 (also when the server keeps no store).
fn stored(st: &AppState, id: &str) -> Result<crate::store::StoredResponse, ApiError> {
    let Some(store) = st.responses_store.as_ref() else {
        return Err(ApiError::not_found(
            None,
            "This server does not store responses (start it with --responses-store-mib).",
        ));
    };
    store
        .get(id)
        .ok_or_else(|| ApiError::not_found(None, format!("Response with id '{id}' not found.")))
}

/// `GET /v1/responses/{id}`: a stored response.
pub async fn retrieve(State(st): State<Arc<AppState>>, Path(id): Path<String>) -> Response {
    match stored(&st, &id) {
        Ok(e) => Json(e.response).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `DELETE /v1/responses/{id}`: removes a stored response (OpenAI's answer:
/// `{"id", "object": "response", "deleted": true}`).
pub async fn delete(State(st): State<Arc<AppState>>, Path(id): Path<String>) -> Response {
    match stored(&st, &id) {
        Ok(_) => {
            if let Some(store) = st.responses_store.as_ref() {
                store.delete(&id);
            }
            Json(json!({"id": id, "object": "response", "deleted": true})).into_response()
        }
        Err(e) => e.into_response(),
    }
}

/// The query of `GET /v1/responses/{id}/input_items` (OpenAI's): `order` `asc` or `desc` (the
/// default), `limit` 1..=100 (default 20), `after` an item id to start after.
#[derive(serde::Deserialize)]
pub struct ItemsQuery {
    order: Option<String>,
    limit: Option<i64>,
    after: Option<String>,
}

/// `GET /v1/responses/{id}/input_items`: the stored response's input items, as OpenAI's list
/// (`{"object": "list", "data", "first_id", "last_id", "has_more"}`); items without an id get
/// `item_<index>` (their position in the conversation).
pub async fn input_items(
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
    axum::extract::Query(q): axum::extract::Query<ItemsQuery>,
) -> Response {
    let e = match stored(&st, &id) {
        Ok(e) => e,
        Err(e) => return e.into_response(),
    };
    let limit = match q.limit {
        None => 20,
        Some(n @ 1..=100) => n as usize,
        Some(n) => {
            return ApiError::field("limit", format!("'limit' must be 1 to 100, got {n}."))
                .into_response()
        }
    };
    let mut items: Vec<Value> = e
        .input
        .into_iter()
        .enumerate()
        .map(|(i, mut item)| {
            if let Some(o) = item.as_object_mut() {
                o.entry("type").or_insert_with(|| json!("message"));
                o.entry("id").or_insert_with(|| json!(format!("item_{i}")));
            }
            item
        })
        .collect();
    match q.order.as_deref() {
        None | Some("desc") => items.reverse(),
        Some("asc") => {}
        Some(o) => {
            return ApiError::field("order", format!("'order' must be asc or desc, got {o:?}."))
                .into_response()
        }
    }
    if let Some(after) = &q.after {
        match items.iter().position(|i| i["id"].as_str() == Some(after)) {
            Some(p) => {
                items.drain(..=p);
            }
            None => {
                return ApiError::field("after", format!("No input item with id {after:?}."))
                    .into_response()
            }
        }
    }
    let has_more = items.len() > limit;
    items.truncate(limit);
    Json(json!({
        "object": "list",
        "first_id": items.first().map(|i| i["id"].clone()),
        "last_id": items.last().map(|i| i["id"].clone()),
        "has_more": has_more,
        "data": items,
    }))
    .into_response()
}

/// What every response object of one request shares: its ids and the echoed request fields.
struct Shell {
    /// With a store and `store` (not false): where the finished response is kept.
    keep: Option<Keep>,
    /// `previous_response_id`, echoed.
    previous_response_id: Option<String>,
    id: String,
    msg_id: String,
    rs_id: String,
    created_at: u64,
    model: String,
    instructions: Option<String>,
    max_tool_calls: Option<i64>,
    max_output_tokens: u32,
    temperature: f64,
    top_p: f64,
    metadata: Option<Value>,
    parallel_tool_calls: bool,
    /// The function tools, as echoed.
    tools: Vec<Value>,
    tool_choice: Value,
    /// The form of call ids: the server's `--tool-call-parser` ([`ToolParser::call_id`]).
    call_ids: Option<ToolParser>,
    /// `truncation: "auto"`, echoed.
    truncation_auto: bool,
    reasoning: Option<Value>,
    service_tier: String,
    text_format: Value,
    /// `top_logprobs` as given (0 by default).
    top_logprobs: u32,
    user: Option<String>,
}

impl Shell {
    /// `max_output_tokens` is the effective limit (given, or the room left in the context),
    /// and `temperature` and `top_p` the effective values, as vLLM echoes them.
    fn new(st: &AppState, req: &ResponsesRequest, max_output_tokens: u32) -> Self {
        Self {
            id: object_id("resp"),
            msg_id: object_id("msg"),
            rs_id: object_id("rs"),
            created_at: now_secs(),
            model: st.model_name(req.gen.lora),
            instructions: req.instructions.clone(),
            max_tool_calls: req.max_tool_calls,
            max_output_tokens,
            temperature: echo_f32(req.gen.temperature),
            top_p: echo_f32(req.gen.top_p),
            metadata: req.metadata.clone(),
            parallel_tool_calls: req.parallel_tool_calls,
            tools: req.tools_echo.clone(),
            tool_choice: req.tool_choice_echo.clone(),
            call_ids: st.config.tool_call_parser,
            truncation_auto: req.truncation_auto,
            keep: None,
            previous_response_id: None,
            reasoning: req.reasoning.clone(),
            service_tier: req.service_tier.clone(),
            text_format: req.text_format.clone(),
            top_logprobs: req.top_logprobs,
            user: req.user.clone(),
        }
    }

    /// The `output_text` content part, with its `logprobs` (`[]` when not asked for).
    fn part(text: &str, logprobs: &Value) -> Value {
        json!({"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs})
    }

    /// The output message with `text` and its `logprobs` (no content part while
    /// `in_progress`).
    fn message(&self, text: &str, logprobs: &Value, status: &str) -> Value {
        // A message item is in_progress, completed or incomplete (a failed response's is cut).
        let status = item_status(status);
        let content = if status == "in_progress" {
            Vec::new()
        } else {
            vec![Self::part(text, logprobs)]
        };
        json!({
            "type": "message",
            "id": self.msg_id,
            "status": status,
            "role": "assistant",
            "content": content,
        })
    }

    /// The `reasoning_text` content part.
    fn reasoning_part(text: &str) -> Value {
        json!({"type": "reasoning_text", "text": text})
    }

    /// The reasoning item with `text` (no content part while `in_progress`).
    fn reasoning_item(&self, text: &str, status: &str) -> Value {
        let content = if status == "in_progress" {
            Vec::new()
        } else {
            vec![Self::reasoning_part(text)]
        };
        json!({
            "type": "reasoning",
            "id": self.rs_id,
            "summary": [],
            "content": content,
            "encrypted_content": null,
            "status": status,
        })
    }

    /// The output items of a finished response: the reasoning item (when there was
    /// reasoning), then the message, its text with `logprobs` (left out when the output was
    /// function calls and nothing else, as OpenAI and vLLM), then one `function_call` item per
    /// call.
    fn output(
        &self,
        split: &Split,
        logprobs: &Value,
        status: &str,
        calls: &[FunctionCallItem],
    ) -> Vec<Value> {
        let mut out = Vec::new();
        if !split.reasoning.is_empty() {
            out.push(self.reasoning_item(&split.reasoning, "completed"));
        }
        if calls.is_empty() || !split.content.is_empty() {
            out.push(self.message(&split.content, logprobs, status));
        }
        out.extend(calls.iter().map(|c| c.item(item_status(status))));
        out
    }

    /// The output's tool calls as `function_call` items, each with new ids: `fc_` and 32 hex
    /// digits for the item, and a call id of the server's parser's form (vLLM's: the parser's
    /// tool call id; 9 letters and digits for `mistral`, whose templates check them).
    fn function_calls(&self, calls: Vec<ToolCall>) -> Vec<FunctionCallItem> {
        let ids = self.call_ids.unwrap_or(ToolParser::Hermes);
        calls
            .into_iter()
            .map(|c| FunctionCallItem {
                id: object_id("fc"),
                call_id: ids.call_id(random_seed),
                name: c.name,
                arguments: c.arguments,
            })
            .collect()
    }

    /// The response object.
    fn response(&self, status: &str, output: Vec<Value>, usage: Value, error: Value) -> Value {
        let incomplete = if status == "incomplete" {
            json!({"reason": "max_output_tokens"})
        } else {
            Value::Null
        };
        json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": false,
            "error": error,
            "incomplete_details": incomplete,
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "max_tool_calls": self.max_tool_calls,
            "metadata": self.metadata,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": self.parallel_tool_calls,
            "previous_response_id": self.previous_response_id,
            "reasoning": self.reasoning,
            "service_tier": self.service_tier,
            "store": self.keep.is_some(),
            "temperature": self.temperature,
            "text": {"format": self.text_format},
            "tool_choice": self.tool_choice,
            "tools": self.tools,
            "top_logprobs": self.top_logprobs,
            "top_p": self.top_p,
            "truncation": if self.truncation_auto { "auto" } else { "disabled" },
            "usage": usage,
            "user": self.user,
        })
    }
}

/// A function call in the output (OpenAI's `ResponseFunctionToolCall`).
struct FunctionCallItem {
    /// The item's id, `fc_...`.
    id: String,
    /// The call's id, which the client's `function_call_output` names.
    call_id: String,
    name: String,
    /// The arguments, a JSON text (as the parser writes them: see [`crate::tools`]).
    arguments: String,
}

impl FunctionCallItem {
    /// The `function_call` output item with `status` and `arguments`.
    fn item_with(&self, status: &str, arguments: &str) -> Value {
        json!({
            "type": "function_call",
            "id": self.id,
            "call_id": self.call_id,
            "name": self.name,
            "arguments": arguments,
            "status": status,
        })
    }

    /// The finished `function_call` output item.
    fn item(&self, status: &str) -> Value {
        self.item_with(status, &self.arguments)
    }
}

/// An output item's status in a response with `status`: an item of a cut (or failed)
/// response is `incomplete`.
fn item_status(status: &str) -> &str {
    match status {
        "failed" | "incomplete" => "incomplete",
        s => s,
    }
}

/// The streamed response's state: one sequence in, SSE events out.
struct Streamer {
    shell: Shell,
    seq: Option<Seq>,
    /// The next event's `sequence_number`.
    sequence_number: u64,
    /// The text so far.
    text: String,
    /// Splits the output (with a reasoning parser) and tells the answer's tokens.
    splitter: OutputSplitter,
    /// With `include: ["message.output_text.logprobs"]`: the answer's log-probabilities.
    logprobs: Option<OutputLogprobs>,
    /// The reasoning so far.
    reasoning: String,
    /// The reasoning item is open (added, not done).
    reasoning_open: bool,
    /// The message item has been added.
    message_open: bool,
    input_tokens: usize,
    output_tokens: usize,
    /// With a reasoning parser: counts the reasoning tokens.
    reasoning_tokens: Option<ReasoningTokens>,
    /// With function tools (and `tool_choice` other than `none`): holds the text that may be
    /// a tool call until the output ends.
    filter: Option<StreamFilter>,
    /// The function calls, once the output has ended.
    calls: Vec<FunctionCallItem>,
    /// Events ready to send.
    pending: VecDeque<Bytes>,
}

impl Streamer {
    /// Queues one event: `event: <kind>` and `data` with its `type` and the next
    /// `sequence_number`.
    fn push(&mut self, kind: &str, mut data: Value) {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.sequence_number);
        self.sequence_number += 1;
        self.pending
            .push_back(Bytes::from(format!("event: {kind}\ndata: {data}\n\n")));
    }

    /// The reasoning tokens so far.
    fn reasoning_count(&self) -> usize {
        self.reasoning_tokens.as_ref().map_or(0, |c| c.count)
    }

    /// The message item's output index: after the reasoning item, if there is one.
    fn msg_index(&self) -> usize {
        usize::from(!self.reasoning.is_empty())
    }

    /// Where the text events point.
    fn at(&self) -> Value {
        json!({"item_id": self.shell.msg_id, "output_index": self.msg_index(), "content_index": 0})
    }

    /// Where the reasoning events point.
    fn at_reasoning(&self) -> Value {
        json!({"item_id": self.shell.rs_id, "output_index": 0, "content_index": 0})
    }

    /// The events before any output. Without a reasoning parser or tools the message item
    /// opens at once; with one, it waits for the first content (the reasoning item may come
    /// first, or the output may be function calls only).
    fn prelude(&mut self) {
        let r = self
            .shell
            .response("in_progress", Vec::new(), Value::Null, Value::Null);
        self.push("response.created", json!({ "response": r }));
        self.push("response.in_progress", json!({ "response": r }));
        if self.splitter.reasoning.is_none() && self.filter.is_none() {
            self.open_message();
        }
    }

    /// Adds the message item.
    fn open_message(&mut self) {
        self.close_reasoning();
        if self.message_open {
            return;
        }
        self.message_open = true;
        let item = self.shell.message("", &json!([]), "in_progress");
        self.push(
            "response.output_item.added",
            json!({"output_index": self.msg_index(), "item": item}),
        );
        let mut e = self.at();
        e["part"] = Shell::part("", &json!([]));
        self.push("response.content_part.added", e);
    }

    /// Sends reasoning text (opening the reasoning item first).
    fn reasoning_delta(&mut self, text: &str) {
        if text.is_empty() {
            return;
        }
        if !self.reasoning_open {
            self.reasoning_open = true;
            let item = self.shell.reasoning_item("", "in_progress");
            self.push(
                "response.output_item.added",
                json!({"output_index": 0, "item": item}),
            );
            let mut e = self.at_reasoning();
            e["part"] = Shell::reasoning_part("");
            self.push("response.content_part.added", e);
        }
        self.reasoning.push_str(text);
        let mut e = self.at_reasoning();
        e["delta"] = json!(text);
        self.push("response.reasoning_text.delta", e);
    }

    /// Closes the reasoning item, if open.
    fn close_reasoning(&mut self) {
        if !self.reasoning_open {
            return;
        }
        self.reasoning_open = false;
        let mut e = self.at_reasoning();
        e["text"] = json!(self.reasoning);
        self.push("response.reasoning_text.done", e);
        let mut e = self.at_reasoning();
        e["part"] = Shell::reasoning_part(&self.reasoning);
        self.push("response.content_part.done", e);
        let item = self.shell.reasoning_item(&self.reasoning, "completed");
        self.push(
            "response.output_item.done",
            json!({"output_index": 0, "item": item}),
        );
    }

    /// The answer's log-probabilities so far (`[]` when not asked for).
    fn all_logprobs(&self) -> Value {
        self.logprobs
            .as_ref()
            .map_or_else(|| json!([]), OutputLogprobs::all)
    }

    /// The output items so far, for a response with `status`.
    fn output(&self, status: &str) -> Vec<Value> {
        let split = Split {
            reasoning: self.reasoning.clone(),
            content: self.text.clone(),
        };
        self.shell
            .output(&split, &self.all_logprobs(), status, &self.calls)
    }

    /// Queues a `response.output_text.delta` with `text` (opening the message item first) and
    /// the answer tokens' log-probabilities not sent yet.
    fn text_delta(&mut self, text: &str) {
        if text.is_empty() {
            return;
        }
        self.open_message();
        let mut e = self.at();
        e["delta"] = json!(text);
        // The answer tokens since the last delta event: a token whose text is held back
        // (a possible stop string, an incomplete character) comes with the text.
        e["logprobs"] = self
            .logprobs
            .as_mut()
            .map_or_else(|| json!([]), OutputLogprobs::unsent);
        self.push("response.output_text.delta", e);
        self.text.push_str(text);
    }

    /// Queues the events of the function calls, after the message item: each is added with
    /// empty arguments, gets them in one `response.function_call_arguments.delta`, and is done.
    fn call_events(&mut self, status: &str) {
        let first = self.msg_index() + usize::from(self.message_open);
        let mut events = Vec::with_capacity(4 * self.calls.len());
        for (k, c) in self.calls.iter().enumerate() {
            let index = first + k;
            let at = json!({"item_id": c.id, "output_index": index});
            events.push((
                "response.output_item.added",
                json!({"output_index": index, "item": c.item_with("in_progress", "")}),
            ));
            let mut e = at.clone();
            e["delta"] = json!(c.arguments);
            events.push(("response.function_call_arguments.delta", e));
            let mut e = at;
            e["arguments"] = json!(c.arguments);
            events.push(("response.function_call_arguments.done", e));
            events.push((
                "response.output_item.done",
                json!({"output_index": index, "item": c.item(item_status(status))}),
            ));
        }
        for (kind, data) in events {
            self.push(kind, data);
        }
    }

    /// Queues the events of one delta; after the last one, drops the sequence.
    fn on_delta(&mut self, d: Delta) {
        self.output_tokens += d.tokens.len();
        if let Some(c) = self.reasoning_tokens.as_mut() {
            c.push(&d);
        }
        if let Some(msg) = d.error {
            // Dropping the sequence cancels it (it has ended already when the engine failed).
            self.seq = None;
            let e = engine_error(msg);
            self.push(
                "error",
                json!({"code": "server_error", "message": e.message, "param": null}),
            );
            let usage = usage(
                self.input_tokens,
                d.cached_tokens,
                self.output_tokens,
                self.reasoning_count(),
            );
            let output = self.output("incomplete");
            let error = json!({"code": "server_error", "message": e.message});
            let mut r = self.shell.response("failed", output, usage, error);
            self.shell.keep(&mut r);
            self.push("response.failed", json!({ "response": r }));
            return;
        }
        let (split, answer) = self.splitter.push(&d);
        if let Some(lp) = self.logprobs.as_mut().filter(|_| answer) {
            lp.push(&d.tokens);
        }
        self.reasoning_delta(&split.reasoning);
        // The tool call parser sees only the answer, after the reasoning parser.
        let content = match self.filter.as_mut() {
            Some(f) => f.push(&split.content),
            None => split.content,
        };
        self.text_delta(&content);
        let Some(finish) = d.finish else {
            return;
        };
        self.seq = None;
        if let Some(mut f) = self.filter.take() {
            let (rest, calls) = f.finish();
            self.text_delta(&rest);
            self.calls = self.shell.function_calls(calls);
        }
        let status = status_of(Some(finish));
        // The message item comes unless the output was function calls only; empty when the
        // output was all reasoning.
        if self.calls.is_empty() || self.message_open {
            self.close_message(status);
        } else {
            self.close_reasoning();
        }
        self.call_events(status);
        let usage = usage(
            self.input_tokens,
            d.cached_tokens,
            self.output_tokens,
            self.reasoning_count(),
        );
        let mut r = self
            .shell
            .response(status, self.output(status), usage, error_of(status));
        let kind = match status {
            "incomplete" => "response.incomplete",
            "failed" => "response.failed",
            _ => "response.completed",
        };
        self.shell.keep(&mut r);
        self.push(kind, json!({ "response": r }));
    }

    /// Ends the message item (adding it first if it has not come yet): the answer tokens'
    /// last log-probabilities, the text's done events.
    fn close_message(&mut self, status: &str) {
        self.open_message();
        // Answer tokens whose text never reached the output (the EOS, a stop string's tokens)
        // come in a last delta with no text, so the deltas add up to the done event's list
        // (chat streams them with empty content too).
        let rest = self.logprobs.as_mut().map(OutputLogprobs::unsent);
        if let Some(rest) = rest.filter(|v| v.as_array().is_some_and(|a| !a.is_empty())) {
            let mut e = self.at();
            e["delta"] = json!("");
            e["logprobs"] = rest;
            self.push("response.output_text.delta", e);
        }
        let all = self.all_logprobs();
        let mut e = self.at();
        e["text"] = json!(self.text);
        e["logprobs"] = event_logprobs(all.as_array().map_or(&[], Vec::as_slice));
        self.push("response.output_text.done", e);
        let mut e = self.at();
        e["part"] = Shell::part(&self.text, &all);
        self.push("response.content_part.done", e);
        let item = self.shell.message(&self.text, &all, status);
        self.push(
            "response.output_item.done",
            json!({"output_index": self.msg_index(), "item": item}),
        );
    }
}

/// The SSE response of a streamed request. A client that goes away drops the body, which
/// drops the sequence, which cancels its engine request.
fn stream_response(
    shell: Shell,
    seqs: Vec<Seq>,
    input_tokens: usize,
    splitter: OutputSplitter,
    reasoning_tokens: Option<ReasoningTokens>,
    logprobs: Option<OutputLogprobs>,
    filter: Option<StreamFilter>,
) -> Response {
    let mut s = Streamer {
        shell,
        seq: seqs.into_iter().next(),
        sequence_number: 0,
        text: String::new(),
        splitter,
        logprobs,
        reasoning: String::new(),
        reasoning_open: false,
        message_open: false,
        input_tokens,
        output_tokens: 0,
        reasoning_tokens,
        filter,
        calls: Vec::new(),
        pending: VecDeque::new(),
    };
    s.prelude();
    delta_event_stream(s)
}

impl DeltaEvents for Streamer {
    fn seq(&mut self) -> &mut Option<Seq> {
        &mut self.seq
    }

    fn pending(&mut self) -> &mut VecDeque<Bytes> {
        &mut self.pending
    }

    fn on_delta(&mut self, d: Delta) {
        Streamer::on_delta(self, d);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drop_oldest_keeps_system_messages_the_last_item_and_no_orphan_tool_message() {
        let m = |role: &str, c: &str| json!({"role": role, "content": c});
        let msgs = vec![
            m("system", "s"),
            m("user", "u1"),
            m("assistant", "a1"),
            m("tool", "t1"),
            m("developer", "d"),
            m("user", "u2"),
        ];
        let contents = |k| -> Vec<String> {
            drop_oldest(&msgs, k)
                .iter()
                .map(|m| m["content"].as_str().unwrap().to_owned())
                .collect()
        };
        assert_eq!(contents(0), ["s", "u1", "a1", "t1", "d", "u2"]);
        assert_eq!(contents(1), ["s", "a1", "t1", "d", "u2"]);
        // The tool result left first goes with its call.
        assert_eq!(contents(2), ["s", "d", "u2"]);
        assert_eq!(contents(3), ["s", "d", "u2"]);
        // The last item always stays.
        assert_eq!(contents(9), ["s", "d", "u2"]);
    }
}
