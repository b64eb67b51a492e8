//! `POST /v1/messages` and `POST /v1/messages/count_tokens`: Anthropic's Messages API over the
//! chat pipeline, as vLLM serves it (`vllm/entrypoints/anthropic`), for clients that speak
//! Anthropic's API (its SDKs, Claude Code with `ANTHROPIC_BASE_URL`).
//!
//! Contract: a request is converted to the equivalent `/v1/chat/completions` request and goes
//! through the same validation, template, admission, engine events, cancellation and metrics.
//! The conversion ([`to_chat_body`]):
//! - `system` (a string or text blocks) becomes a system message first, the text blocks joined
//!   with newlines (a `system` message inside `messages`, which vLLM takes, joins it too);
//!   Claude Code's `x-anthropic-billing-header` block, whose per-request hash would defeat
//!   prefix caching, is dropped, and its `ctx`/`msg` roles are user turns (both as vLLM);
//! - each message's `content` (a string or content blocks): `text` blocks joined with
//!   newlines; an assistant's `thinking` blocks become its `reasoning_content`, its `tool_use`
//!   blocks its `tool_calls` (`input` as the arguments); a user's `tool_result` blocks become
//!   `tool` messages (`tool_use_id`, the result's text), placed before the user's own text, as
//!   vLLM does; `redacted_thinking` and `tool_reference` blocks are dropped; images,
//!   documents and server tool blocks are refused;
//! - a final assistant turn is a prefill: the prompt ends right after its content and the
//!   answer continues it (Anthropic's behaviour; vLLM starts a new turn);
//! - `max_tokens` (required, at least 1), `stop_sequences`, `temperature`, `top_p`, `top_k`,
//!   `stream` and vLLM's `chat_template_kwargs` carry over; `tools` (`{"name",
//!   "description", "input_schema"}`) become function tools and `tool_choice` `auto`, `any`,
//!   `tool` (with `name`) and `none` become `auto`, `required`, a named function and `none`
//!   (`disable_parallel_tool_use` is `parallel_tool_calls: false`); `output_config.format`
//!   (`json_schema`) is a structured output; `thinking` (`enabled`/`disabled`) sets the
//!   template's `enable_thinking` (Qwen3's switch) unless `chat_template_kwargs` does;
//!   `metadata`, `service_tier` and `output_config.effort` are accepted and change nothing. Anthropic's built-in tools
//!   (`bash_*`, `web_search_*`, ...), `mcp_servers` and `container` are refused.
//!
//! The response is a `message`: `content` blocks in order, a `thinking` block (with a
//! `--reasoning-parser`; its `signature` is random, as vLLM's), a `text` block when there is
//! text, then one `tool_use` block per call (`id` of the server's parser's form, `input` the
//! arguments); `stop_reason` is `end_turn`, `max_tokens`, `stop_sequence` (with the matched
//! `stop_sequence`) or `tool_use`; `usage` has `input_tokens` (those not read from the prefix
//! cache), `cache_read_input_tokens`, `cache_creation_input_tokens` (0) and `output_tokens`.
//! Streamed, Anthropic's events: `message_start`, then per block `content_block_start`,
//! `content_block_delta`s (`thinking_delta` then one `signature_delta`, `text_delta`, or one
//! `input_json_delta` with a call's whole arguments: text that may be a tool call is held as
//! on chat) and `content_block_stop`, then `message_delta` (the stop reason and usage) and
//! `message_stop`. An engine error ends a stream with an `error` event.
//!
//! Errors have Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`, the
//! message starting with the field at fault; an output the engine aborted (a structured
//! output's grammar failed) is a 500 `api_error`.

use crate::engine::random_seed;
use crate::openai::{ApiError, StopReason};
use crate::reasoning::{ReasoningSplitter, Split};
use crate::seq::{Delta, Seq};
use crate::server::{collect, delta_event_stream, engine_error, AppState, DeltaEvents};
use crate::tools::{StreamFilter, ToolCall, ToolParser};
use crate::validate::{self, Fields};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

/// `POST /v1/messages`.
pub async fn create(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    match create_inner(st, body).await {
        Ok(r) => r,
        Err(e) => anthropic_error(&ours(e)),
    }
}

/// `POST /v1/messages/count_tokens`: `{"input_tokens": N}`, the prompt the same request to
/// `/v1/messages` would have (no generation).
pub async fn count_tokens(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    match count_inner(st, body).await {
        Ok(r) => r,
        Err(e) => anthropic_error(&ours(e)),
    }
}

/// An error in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`, the
/// type from the status (`invalid_request_error`, `authentication_error`, `not_found_error`,
/// `request_too_large`, `rate_limit_error`, `overloaded_error`, else `api_error`), the
/// message prefixed with the field at fault.
fn anthropic_error(e: &ApiError) -> Response {
    (e.status, Json(anthropic_error_body(e))).into_response()
}

/// The body of [`anthropic_error`].
fn anthropic_error_body(e: &ApiError) -> Value {
    let kind = match e.status.as_u16() {
        400 | 405 | 408 | 422 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        _ => "api_error",
    };
    // The OpenAI body clips long messages; its message is the clipped one.
    let clipped = e.body();
    let message = clipped["error"]["message"].as_str().unwrap_or_default();
    let message = match clipped["error"]["param"].as_str() {
        Some(p) => format!("{p}: {message}"),
        None => message.to_owned(),
    };
    json!({"type": "error", "error": {"type": kind, "message": message}})
}

/// The chat request's field names that differ from the Messages API's, for error messages.
const CHAT_TO_MESSAGES: [(&str, &str); 3] = [
    ("max_completion_tokens", "max_tokens"),
    ("stop", "stop_sequences"),
    ("response_format", "output_config.format"),
];

/// `e` with the chat request's field names ([`CHAT_TO_MESSAGES`]) as the Messages API's.
fn ours(mut e: ApiError) -> ApiError {
    let Some(p) = e.param.clone() else {
        return e;
    };
    for (chat, ours) in CHAT_TO_MESSAGES {
        if p == chat || p.starts_with(&format!("{chat}.")) {
            e.param = Some(format!("{ours}{}", &p[chat.len()..]));
            e.message = e
                .message
                .replace(&format!("'{chat}'"), &format!("'{ours}'"));
        }
    }
    e
}

/// Parses a Messages API body into the equivalent chat request.
fn parse(body: &[u8], st: &AppState, count_only: bool) -> Result<validate::ChatRequest, ApiError> {
    let chat = to_chat_body(body, count_only)?;
    let bytes = serde_json::to_vec(&chat).map_err(|e| ApiError::invalid(None, e.to_string()))?;
    validate::parse_chat(&bytes, &st.engine.limits(), &st.config.sampling_defaults)
}

/// Rewrites the errors of the `/v1/messages` routes that other layers made in OpenAI's shape
/// (a bad API key, a body that is not JSON, a wrong method or content type, a body too large)
/// into Anthropic's.
pub async fn anthropic_error_bodies(
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let anthropic = req.uri().path().starts_with("/v1/messages");
    let res = next.run(req).await;
    let status = res.status();
    if !anthropic || !(status.is_client_error() || status.is_server_error()) {
        return res;
    }
    let (parts, body) = res.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, 1 << 20).await else {
        return (parts.status, "").into_response();
    };
    let v: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    if v["type"] == "error" {
        return Response::from_parts(parts, axum::body::Body::from(bytes));
    }
    let e = ApiError {
        status,
        message: v["error"]["message"].as_str().map_or_else(
            || String::from_utf8_lossy(&bytes).into_owned(),
            str::to_owned,
        ),
        kind: "invalid_request_error",
        param: v["error"]["param"].as_str().map(str::to_owned),
    };
    let mut res = anthropic_error(&e);
    // Keep the other layers' headers (`Allow`, `Connection: close`, CORS).
    for (k, val) in parts.headers.iter() {
        if k != axum::http::header::CONTENT_TYPE && k != axum::http::header::CONTENT_LENGTH {
            res.headers_mut().insert(k.clone(), val.clone());
        }
    }
    res
}

/// Anthropic's built-in tool types (server tools and Anthropic-defined client tools), which
/// this server does not run: their `type` starts with one of these.
const BUILTIN_TOOL_PREFIXES: [&str; 8] = [
    "bash_",
    "code_execution_",
    "computer_",
    "memory_",
    "text_editor_",
    "web_fetch_",
    "web_search_",
    "tool_search_",
];

/// Converts a Messages API body to the equivalent `/v1/chat/completions` body (see the module
/// docs). `count_only` (for `count_tokens`) does not need `max_tokens`.
///
/// # Errors
/// 400 naming the Messages API's field for a body that is not an object, a missing or bad
/// `max_tokens`, `messages` or `system`, a content block this server cannot take, a bad tool
/// or `tool_choice`, and the refused options (`mcp_servers`, `container`).
pub fn to_chat_body(body: &[u8], count_only: bool) -> Result<Value, ApiError> {
    let f = Fields::parse(body)?;
    for name in ["mcp_servers", "container"] {
        if !matches!(f.raw(name), None | Some(Value::Null)) {
            return Err(ApiError::field(
                name,
                format!("'{name}' is not supported by this server (it runs no server tools)."),
            ));
        }
    }
    let mut chat = Map::new();
    if let Some(m) = f.raw("model") {
        chat.insert("model".into(), m.clone());
    }
    match f.raw("max_tokens") {
        // count_tokens takes no max_tokens.
        _ if count_only => {}
        None | Some(Value::Null) => {
            return Err(ApiError::field("max_tokens", "'max_tokens' is required."))
        }
        Some(v) => {
            chat.insert("max_completion_tokens".into(), v.clone());
        }
    }
    let strings = |v: &Value| v.as_array().is_some_and(|a| a.iter().all(Value::is_string));
    if !f
        .raw("stop_sequences")
        .is_none_or(|v| v.is_null() || strings(v))
    {
        return Err(ApiError::field(
            "stop_sequences",
            "'stop_sequences' must be a list of strings.",
        ));
    }
    for (ours, theirs) in [
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("top_k", "top_k"),
        ("stop_sequences", "stop"),
        ("chat_template_kwargs", "chat_template_kwargs"),
    ] {
        if let Some(v) = f.raw(ours).filter(|v| !v.is_null()) {
            chat.insert(theirs.into(), v.clone());
        }
    }
    if !count_only {
        if let Some(v) = f.raw("stream") {
            chat.insert("stream".into(), v.clone());
        }
    }
    for (name, what) in [("metadata", "an object"), ("thinking", "an object")] {
        if !matches!(f.raw(name), None | Some(Value::Null | Value::Object(_))) {
            return Err(ApiError::field(name, format!("'{name}' must be {what}.")));
        }
    }
    // `thinking` switches a hybrid model's thinking (Qwen3's templates read
    // `enable_thinking`; others ignore it), unless `chat_template_kwargs` says otherwise.
    let thinking = match f.raw("thinking").and_then(|t| t.get("type")) {
        None | Some(Value::Null) => None,
        Some(t) if t == "enabled" || t == "adaptive" => Some(true),
        Some(t) if t == "disabled" => Some(false),
        Some(t) => {
            return Err(ApiError::field(
                "thinking",
                format!("'thinking.type' must be \"enabled\" or \"disabled\", got {t}."),
            ))
        }
    };
    if let Some(on) = thinking {
        let kwargs = chat
            .entry("chat_template_kwargs")
            .or_insert_with(|| Value::Object(Map::new()));
        if let Value::Object(k) = kwargs {
            k.entry("enable_thinking").or_insert(Value::Bool(on));
        }
    }
    if let Some(format) = output_format(&f)? {
        chat.insert("response_format".into(), format);
    }
    let mut system = match f.raw("system") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(blocks)) => system_texts(text_blocks(blocks, "system")?),
        Some(_) => {
            return Err(ApiError::field(
                "system",
                "'system' must be a string or a list of text blocks.",
            ))
        }
    };
    let messages = convert_messages(&f, &mut system)?;
    let mut all = Vec::with_capacity(messages.len() + 1);
    if !system.is_empty() {
        all.push(json!({"role": "system", "content": system.join("\n")}));
    }
    all.extend(messages);
    // A final assistant turn (without tool use) is a prefill the answer continues, as in
    // Anthropic's API: the prompt ends right after its content.
    if all
        .last()
        .is_some_and(|m| m["role"] == "assistant" && m.get("tool_calls").is_none())
    {
        chat.insert("continue_final_message".into(), Value::Bool(true));
        chat.insert("add_generation_prompt".into(), Value::Bool(false));
    }
    chat.insert("messages".into(), Value::Array(all));
    if let Some(tools) = convert_tools(&f)? {
        chat.insert("tools".into(), Value::Array(tools));
    }
    convert_tool_choice(&f, &mut chat)?;
    Ok(Value::Object(chat))
}

/// `output_config`: its `format` (`{"type": "json_schema", "schema": {...}}`) as a chat
/// `response_format`; `effort` is accepted and changes nothing.
fn output_format(f: &Fields) -> Result<Option<Value>, ApiError> {
    let config = match f.raw("output_config") {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(o)) => o,
        Some(_) => {
            return Err(ApiError::field(
                "output_config",
                "'output_config' must be an object.",
            ))
        }
    };
    let format = match config.get("format") {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(o)) => o,
        Some(_) => {
            return Err(ApiError::field(
                "output_config.format",
                "'output_config.format' must be an object.",
            ))
        }
    };
    if format.get("type").and_then(Value::as_str) != Some("json_schema") {
        return Err(ApiError::field(
            "output_config.format",
            "'output_config.format' must be {\"type\": \"json_schema\", \"schema\": {...}}.",
        ));
    }
    let Some(schema) = format.get("schema").filter(|s| s.is_object()) else {
        return Err(ApiError::field(
            "output_config.format",
            "'output_config.format' needs a 'schema' object.",
        ));
    };
    Ok(Some(json!({"type": "json_schema",
        "json_schema": {"name": "output", "schema": schema}})))
}

/// The texts of a list of `text` blocks (`system`, a tool result's content), each block
/// `{"type": "text", "text": ...}` (`cache_control` and citations are ignored).
fn text_blocks(blocks: &[Value], at: &str) -> Result<Vec<String>, ApiError> {
    blocks
        .iter()
        .enumerate()
        .map(|(j, b)| {
            match (
                b.get("type").and_then(Value::as_str),
                b.get("text").and_then(Value::as_str),
            ) {
                (Some("text"), Some(t)) => Ok(t.to_owned()),
                (kind, _) => Err(ApiError::invalid(
                    Some(format!("{at}[{j}]")),
                    format!(
                        "Only text blocks ({{\"type\": \"text\", \"text\": ...}}) are supported \
                         here, got {}.",
                        kind.map_or_else(|| "a block without a type".into(), |k| format!("'{k}'"))
                    ),
                )),
            }
        })
        .collect()
}

/// The prefix of the attribution block Claude Code puts in `system`, whose per-request hash
/// would defeat prefix caching (vLLM drops it too).
const BILLING_HEADER: &str = "x-anthropic-billing-header";

/// System text blocks, less Claude Code's attribution block ([`BILLING_HEADER`]).
fn system_texts(texts: Vec<String>) -> Vec<String> {
    texts
        .into_iter()
        .filter(|t| !t.starts_with(BILLING_HEADER))
        .collect()
}

/// Converts `messages` (user and assistant turns; a `system` turn's text joins `system`).
fn convert_messages(f: &Fields, system: &mut Vec<String>) -> Result<Vec<Value>, ApiError> {
    let items = match f.raw("messages") {
        Some(Value::Array(items)) if !items.is_empty() => items,
        Some(Value::Array(_)) => {
            return Err(ApiError::field("messages", "'messages' cannot be empty."))
        }
        None | Some(Value::Null) => {
            return Err(ApiError::field("messages", "'messages' is required."))
        }
        Some(_) => {
            return Err(ApiError::field(
                "messages",
                "'messages' must be a list of messages.",
            ))
        }
    };
    let mut out = Vec::with_capacity(items.len());
    for (i, m) in items.iter().enumerate() {
        let at = |p: &str| Some(format!("messages[{i}]{p}"));
        let obj = m
            .as_object()
            .ok_or_else(|| ApiError::invalid(at(""), "Each message must be an object."))?;
        let role = match obj.get("role").and_then(Value::as_str) {
            Some(r @ ("user" | "assistant" | "system")) => r,
            // Roles recent Claude Code versions send for context turns (vLLM maps them too).
            Some("ctx" | "msg") => "user",
            _ => {
                return Err(ApiError::invalid(
                    at(".role"),
                    "A message's 'role' must be \"user\" or \"assistant\" (\"system\" is \
                     taken into the system prompt).",
                ))
            }
        };
        let blocks = match obj.get("content") {
            Some(Value::String(s)) => {
                if role == "system" {
                    system.push(s.clone());
                } else {
                    out.push(json!({"role": role, "content": s}));
                }
                continue;
            }
            Some(Value::Array(blocks)) => blocks,
            _ => {
                return Err(ApiError::invalid(
                    at(".content"),
                    "A message's 'content' must be a string or a list of content blocks.",
                ))
            }
        };
        if role == "system" {
            system.extend(system_texts(text_blocks(
                blocks,
                &format!("messages[{i}].content"),
            )?));
            continue;
        }
        convert_blocks(i, role, blocks, &mut out)?;
    }
    Ok(out)
}

/// Converts one turn's content blocks, pushing its chat message (and, for a user turn, a
/// `tool` message per `tool_result` first, as vLLM does).
fn convert_blocks(
    i: usize,
    role: &str,
    blocks: &[Value],
    out: &mut Vec<Value>,
) -> Result<(), ApiError> {
    let mut texts = Vec::new();
    let mut thinking = Vec::new();
    let mut calls = Vec::new();
    for (j, b) in blocks.iter().enumerate() {
        let at = |p: &str| Some(format!("messages[{i}].content[{j}]{p}"));
        let kind = b.get("type").and_then(Value::as_str);
        let string = |key: &str| match b.get(key) {
            Some(Value::String(s)) => Ok(s.clone()),
            _ => Err(ApiError::invalid(
                at(&format!(".{key}")),
                format!(
                    "A '{}' block needs a string '{key}'.",
                    kind.unwrap_or_default()
                ),
            )),
        };
        let only = |who: &str| {
            if role == who {
                Ok(())
            } else {
                Err(ApiError::invalid(
                    at(".type"),
                    format!(
                        "'{}' blocks belong in {who} messages.",
                        kind.unwrap_or_default()
                    ),
                ))
            }
        };
        match kind {
            Some("text") => texts.push(string("text")?),
            Some("thinking") => {
                only("assistant")?;
                thinking.push(string("thinking")?);
            }
            Some("redacted_thinking") => only("assistant")?,
            // A reference to a deferred tool (tool search): nothing to render (as vLLM).
            Some("tool_reference") => {}
            Some("tool_use") => {
                only("assistant")?;
                let input = match b.get("input") {
                    Some(v @ Value::Object(_)) => v.clone(),
                    _ => {
                        return Err(ApiError::invalid(
                            at(".input"),
                            "A 'tool_use' block needs an 'input' object.",
                        ))
                    }
                };
                calls.push(json!({"id": string("id")?, "type": "function",
                    "function": {"name": string("name")?, "arguments": input}}));
            }
            Some("tool_result") => {
                only("user")?;
                let content =
                    match b.get("content") {
                        None | Some(Value::Null) => String::new(),
                        Some(Value::String(s)) => s.clone(),
                        Some(Value::Array(parts)) => {
                            // Tool references (tool search) carry no text.
                            let texts: Vec<Value> = parts
                                .iter()
                                .filter(|p| p["type"] != "tool_reference")
                                .cloned()
                                .collect();
                            text_blocks(&texts, &format!("messages[{i}].content[{j}].content"))?
                                .join("\n")
                        }
                        Some(_) => return Err(ApiError::invalid(
                            at(".content"),
                            "A 'tool_result' block's 'content' must be a string or text blocks.",
                        )),
                    };
                out.push(
                    json!({"role": "tool", "tool_call_id": string("tool_use_id")?,
                    "content": content}),
                );
            }
            Some(k) => {
                return Err(ApiError::invalid(
                    at(".type"),
                    format!(
                        "Content blocks of type '{k}' are not supported by this server; it takes \
                         text, thinking, tool_use and tool_result blocks."
                    ),
                ))
            }
            None => {
                return Err(ApiError::invalid(
                    at(".type"),
                    "Each content block needs a string 'type'.",
                ))
            }
        }
    }
    // A user turn of tool results only is those tool messages (vLLM's conversion).
    if role == "user" && texts.is_empty() && out.last().is_some_and(|m| m["role"] == "tool") {
        let results = blocks
            .iter()
            .all(|b| b.get("type").and_then(Value::as_str) == Some("tool_result"));
        if results {
            return Ok(());
        }
    }
    let mut m = json!({"role": role, "content": texts.join("\n")});
    if !thinking.is_empty() {
        m["reasoning_content"] = Value::String(thinking.join("\n"));
    }
    if !calls.is_empty() {
        m["tool_calls"] = Value::Array(calls);
    }
    out.push(m);
    Ok(())
}

/// Converts `tools`: each `{"name", "description"?, "input_schema"}` (`type` absent or
/// `custom`; `cache_control` ignored) to a chat function tool. `None` when absent or empty.
fn convert_tools(f: &Fields) -> Result<Option<Vec<Value>>, ApiError> {
    let items = match f.raw("tools") {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Array(items)) => items,
        Some(_) => return Err(ApiError::field("tools", "'tools' must be a list of tools.")),
    };
    let mut out = Vec::with_capacity(items.len());
    for (i, t) in items.iter().enumerate() {
        let at = |p: &str| Some(format!("tools[{i}]{p}"));
        let obj = t
            .as_object()
            .ok_or_else(|| ApiError::invalid(at(""), "Each tool must be an object."))?;
        match obj.get("type") {
            None | Some(Value::Null) => {}
            Some(Value::String(k)) if k == "custom" => {}
            Some(Value::String(k)) if BUILTIN_TOOL_PREFIXES.iter().any(|p| k.starts_with(p)) => {
                return Err(ApiError::invalid(
                    at(".type"),
                    format!(
                        "Anthropic's built-in tool '{k}' is not supported by this server; \
                         define it as a custom tool with an 'input_schema'."
                    ),
                ))
            }
            Some(k) => {
                return Err(ApiError::invalid(
                    at(".type"),
                    format!("Unknown tool type {k}; this server takes custom tools."),
                ))
            }
        }
        let name = match obj.get("name") {
            Some(Value::String(n)) if !n.is_empty() => n,
            _ => {
                return Err(ApiError::invalid(
                    at(".name"),
                    "A tool needs a non-empty string 'name'.",
                ))
            }
        };
        let mut function = Map::new();
        function.insert("name".into(), Value::String(name.clone()));
        match obj.get("description") {
            None | Some(Value::Null) => {}
            Some(d @ Value::String(_)) => {
                function.insert("description".into(), d.clone());
            }
            Some(_) => {
                return Err(ApiError::invalid(
                    at(".description"),
                    "A tool's 'description' must be a string.",
                ))
            }
        }
        let Some(Value::Object(schema)) = obj.get("input_schema") else {
            return Err(ApiError::invalid(
                at(".input_schema"),
                "A tool needs an 'input_schema' object (a JSON Schema).",
            ));
        };
        let mut schema = schema.clone();
        // vLLM's default: a schema without a type is an object's.
        schema
            .entry("type")
            .or_insert_with(|| Value::String("object".into()));
        function.insert("parameters".into(), Value::Object(schema));
        out.push(json!({"type": "function", "function": function}));
    }
    Ok((!out.is_empty()).then_some(out))
}

/// Converts `tool_choice` (`{"type": "auto" | "any" | "tool" | "none", "name"?,
/// "disable_parallel_tool_use"?}`) into the chat `tool_choice` and `parallel_tool_calls`.
fn convert_tool_choice(f: &Fields, chat: &mut Map<String, Value>) -> Result<(), ApiError> {
    const P: &str = "tool_choice";
    let o = match f.raw(P) {
        None | Some(Value::Null) => return Ok(()),
        Some(Value::Object(o)) => o,
        Some(_) => {
            return Err(ApiError::field(
                P,
                "'tool_choice' must be an object: {\"type\": \"auto\" | \"any\" | \"tool\" | \
                 \"none\"}.",
            ))
        }
    };
    let choice = match o.get("type").and_then(Value::as_str) {
        Some("auto") => json!("auto"),
        Some("any") => json!("required"),
        Some("none") => json!("none"),
        Some("tool") => match o.get("name").and_then(Value::as_str) {
            Some(name) => json!({"type": "function", "function": {"name": name}}),
            None => {
                return Err(ApiError::field(
                    P,
                    "A tool_choice of type 'tool' needs the tool's 'name'.",
                ))
            }
        },
        _ => {
            return Err(ApiError::field(
                P,
                "tool_choice 'type' must be \"auto\", \"any\", \"tool\" or \"none\".",
            ))
        }
    };
    chat.insert(P.into(), choice);
    match o.get("disable_parallel_tool_use") {
        None | Some(Value::Null) => {}
        Some(Value::Bool(b)) => {
            chat.insert("parallel_tool_calls".into(), Value::Bool(!b));
        }
        Some(_) => {
            return Err(ApiError::field(
                P,
                "'tool_choice.disable_parallel_tool_use' must be a boolean.",
            ))
        }
    }
    Ok(())
}

/// Renders and tokenizes a converted request's prompt.
async fn prompt_ids(
    st: &AppState,
    req: &validate::ChatRequest,
    limit: usize,
) -> Result<Vec<u32>, ApiError> {
    let text = st.render_chat(req)?;
    st.encode_prompt(&text, req.add_special_tokens, "messages", limit)
        .await
}

async fn count_inner(st: Arc<AppState>, body: Bytes) -> Result<Response, ApiError> {
    let req = parse(&body, &st, true)?;
    st.check_model(req.model.as_deref())?;
    let ids = prompt_ids(&st, &req, usize::MAX).await?;
    Ok(Json(json!({"input_tokens": ids.len()})).into_response())
}

/// A message id of Anthropic's form: `msg_` and 32 hex digits.
fn message_id() -> String {
    format!("msg_{:016x}{:016x}", random_seed(), random_seed())
}

/// A `thinking` block's `signature`: random (this server signs nothing; clients send it back
/// and it is ignored), as vLLM's.
fn signature() -> String {
    format!("{:016x}{:016x}", random_seed(), random_seed())
}

/// The Messages API `usage`: `input_tokens` are the prompt tokens not read from the prefix
/// cache (Anthropic's accounting: the three input counts add up to the prompt).
fn usage(prompt_tokens: usize, cached: usize, output_tokens: usize) -> Value {
    json!({
        "input_tokens": prompt_tokens - cached.min(prompt_tokens),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached.min(prompt_tokens),
        "output_tokens": output_tokens,
    })
}

/// The `stop_reason` and `stop_sequence` of an output that finished with `finish` (`stop`,
/// `length`) and `stop`, having made calls or not.
fn stop_reason(finish: &str, stop: Option<&StopReason>, calls: bool) -> (&'static str, Value) {
    match (finish, stop) {
        ("length", _) => ("max_tokens", Value::Null),
        (_, _) if calls => ("tool_use", Value::Null),
        (_, Some(StopReason::Text(s))) => ("stop_sequence", Value::String(s.clone())),
        _ => ("end_turn", Value::Null),
    }
}

/// The error of an output the engine aborted (a structured output's grammar failed).
fn aborted() -> ApiError {
    ApiError {
        status: StatusCode::INTERNAL_SERVER_ERROR,
        message: "The engine aborted the generation (for example, a structured output's \
                  grammar exceeded its limits)."
            .into(),
        kind: "internal_server_error",
        param: None,
    }
}

/// A `tool_use` block for `call` (its arguments as `input`), or `None` when its arguments are
/// not a JSON object (a forced call cut short by `max_tokens`), which then goes out as text.
fn tool_use(call: &ToolCall, ids: Option<ToolParser>) -> Option<Value> {
    let input: Value = serde_json::from_str(&call.arguments).ok()?;
    input.is_object().then(|| {
        json!({"type": "tool_use", "id": ids.unwrap_or(ToolParser::Hermes).call_id(random_seed),
               "name": call.name, "input": input})
    })
}

async fn create_inner(st: Arc<AppState>, body: Bytes) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let limits = st.engine.limits();
    let req = parse(&body, &st, false)?;
    let mut gen = req.gen.clone();
    gen.lora = st.check_model(req.model.as_deref())?;
    let mode = st.call_mode(&req.tool_choice, &mut gen)?;
    let reasoning = st.reasoning_parser(&mut gen, &req.template_kwargs);
    let ids = prompt_ids(&st, &req, limits.max_model_len).await?;
    let max = validate::resolve_max_tokens(
        &limits,
        ids.len(),
        gen.max_tokens,
        gen.default_max_tokens,
        "messages",
        "max_tokens",
    )?;
    let prompt_tokens = ids.len();
    let seqs = st.submit_all(&[(ids, max)], &gen, arrived)?;
    let id = message_id();
    let model = st.model_name(gen.lora);
    let ids_form = st.config.tool_call_parser;
    if gen.stream {
        let s = Streamer {
            seq: seqs.into_iter().next(),
            id,
            model,
            prompt_tokens,
            output_tokens: 0,
            splitter: reasoning.map(|r| r.splitter(&req.template_kwargs)),
            filter: mode
                .map(|m| StreamFilter::with_tools(m, req.tools.clone().unwrap_or_default())),
            ids_form,
            block: None,
            index: 0,
            started: false,
            pending: VecDeque::new(),
        };
        return Ok(s.into_response());
    }
    let (outs, output_tokens) = collect(seqs).await?;
    let out = outs.into_iter().next().unwrap_or_default();
    let finish = out.finish.unwrap_or("stop");
    if finish == "abort" {
        return Err(aborted());
    }
    let split = match reasoning {
        Some(r) => r.split(&req.template_kwargs, &out.text),
        None => Split {
            reasoning: String::new(),
            content: out.text,
        },
    };
    let (text, calls) = match &mode {
        None => (split.content, Vec::new()),
        Some(m) => {
            let parsed = m.parse_with(&split.content, req.tools.as_deref().unwrap_or_default());
            (parsed.content.unwrap_or_default(), parsed.calls)
        }
    };
    let mut content = Vec::new();
    if !split.reasoning.is_empty() {
        content.push(json!({"type": "thinking", "thinking": split.reasoning,
                            "signature": signature()}));
    }
    let mut text = text;
    let mut uses = Vec::new();
    for c in &calls {
        match tool_use(c, ids_form) {
            Some(u) => uses.push(u),
            None => text.push_str(&c.arguments),
        }
    }
    if !text.is_empty() {
        content.push(json!({"type": "text", "text": text}));
    }
    let (reason, sequence) = stop_reason(finish, out.stop_reason.as_ref(), !uses.is_empty());
    content.extend(uses);
    Ok(Json(json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(prompt_tokens, out.cached_tokens, output_tokens),
    }))
    .into_response())
}

/// The kind of the open content block of a stream.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Block {
    Thinking,
    Text,
}

/// The streamed message's state: one sequence in, Anthropic's SSE events out.
struct Streamer {
    seq: Option<Seq>,
    id: String,
    model: String,
    prompt_tokens: usize,
    output_tokens: usize,
    /// With a reasoning parser: splits thinking from text.
    splitter: Option<ReasoningSplitter>,
    /// With tools (and `tool_choice` other than `none`): holds text that may be a call.
    filter: Option<StreamFilter>,
    /// The form of tool use ids (the server's `--tool-call-parser`).
    ids_form: Option<ToolParser>,
    /// The open block, if any.
    block: Option<Block>,
    /// The open block's index, or the next block's.
    index: usize,
    /// `message_start` has been sent.
    started: bool,
    /// Events ready to send.
    pending: VecDeque<Bytes>,
}

impl Streamer {
    /// Queues one event: `event: <type>` and its `data`.
    fn push(&mut self, kind: &str, mut data: Value) {
        data["type"] = json!(kind);
        self.pending
            .push_back(Bytes::from(format!("event: {kind}\ndata: {data}\n\n")));
    }

    /// Closes the open block (a thinking block gets its signature first).
    fn close(&mut self) {
        let Some(b) = self.block.take() else {
            return;
        };
        if b == Block::Thinking {
            let delta = json!({"type": "signature_delta", "signature": signature()});
            self.push(
                "content_block_delta",
                json!({"index": self.index, "delta": delta}),
            );
        }
        self.push("content_block_stop", json!({"index": self.index}));
        self.index += 1;
    }

    /// Sends `text` in a block of kind `b` (closing another open block, opening this one).
    fn delta(&mut self, b: Block, text: &str) {
        if text.is_empty() {
            return;
        }
        if self.block != Some(b) {
            self.close();
            let start = match b {
                Block::Thinking => json!({"type": "thinking", "thinking": "", "signature": ""}),
                Block::Text => json!({"type": "text", "text": ""}),
            };
            self.push(
                "content_block_start",
                json!({"index": self.index, "content_block": start}),
            );
            self.block = Some(b);
        }
        let delta = match b {
            Block::Thinking => json!({"type": "thinking_delta", "thinking": text}),
            Block::Text => json!({"type": "text_delta", "text": text}),
        };
        self.push(
            "content_block_delta",
            json!({"index": self.index, "delta": delta}),
        );
    }

    /// The first event, sent with the first delta: by then the prefix-cache count is known, so
    /// its usage splits the input as the last event's does.
    fn prelude(&mut self, cached: usize) {
        let message = json!({
            "id": self.id, "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": null, "stop_sequence": null,
            "usage": usage(self.prompt_tokens, cached, 0),
        });
        self.push("message_start", json!({ "message": message }));
    }

    /// Queues the events of one delta; after the last one, drops the sequence.
    fn on_delta(&mut self, d: Delta) {
        if !self.started {
            self.started = true;
            self.prelude(d.cached_tokens);
        }
        self.output_tokens += d.tokens.len();
        if let Some(msg) = d.error {
            self.seq = None;
            let e = engine_error(msg);
            self.push("error", anthropic_error_body(&e));
            return;
        }
        let split = match self.splitter.as_mut() {
            Some(s) => {
                let mut out = s.push(&d.text);
                if d.finish.is_some() {
                    out.append(s.finish());
                }
                out
            }
            None => Split {
                reasoning: String::new(),
                content: d.text.clone(),
            },
        };
        self.delta(Block::Thinking, &split.reasoning);
        let content = match self.filter.as_mut() {
            Some(f) => f.push(&split.content),
            None => split.content,
        };
        self.delta(Block::Text, &content);
        let Some(finish) = d.finish else {
            return;
        };
        self.seq = None;
        if finish == "abort" {
            self.close();
            self.push("error", anthropic_error_body(&aborted()));
            return;
        }
        let mut uses = Vec::new();
        if let Some(mut f) = self.filter.take() {
            let (rest, calls) = f.finish();
            self.delta(Block::Text, &rest);
            for c in &calls {
                match tool_use(c, self.ids_form) {
                    Some(u) => uses.push((u, c.arguments.clone())),
                    None => self.delta(Block::Text, &c.arguments),
                }
            }
        }
        self.close();
        let made_calls = !uses.is_empty();
        for (mut u, arguments) in uses {
            // The input arrives as one `input_json_delta` (Anthropic's streamed form).
            u["input"] = json!({});
            self.push(
                "content_block_start",
                json!({"index": self.index, "content_block": u}),
            );
            let delta = json!({"type": "input_json_delta", "partial_json": arguments});
            self.push(
                "content_block_delta",
                json!({"index": self.index, "delta": delta}),
            );
            self.push("content_block_stop", json!({"index": self.index}));
            self.index += 1;
        }
        let (reason, sequence) = stop_reason(finish, d.stop_reason.as_ref(), made_calls);
        self.push(
            "message_delta",
            json!({"delta": {"stop_reason": reason, "stop_sequence": sequence},
                   "usage": usage(self.prompt_tokens, d.cached_tokens, self.output_tokens)}),
        );
        self.push("message_stop", json!({}));
    }

    fn into_response(self) -> Response {
        delta_event_stream(self)
    }
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

    fn convert(body: Value) -> Value {
        to_chat_body(body.to_string().as_bytes(), false).expect("converts")
    }

    #[test]
    fn thinking_sets_enable_thinking_unless_the_template_kwargs_do() {
        let base = json!({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]});
        let with = |extra: Value| {
            let mut b = base.clone();
            for (k, v) in extra.as_object().unwrap() {
                b[k] = v.clone();
            }
            convert(b)
        };
        assert!(convert(base.clone()).get("chat_template_kwargs").is_none());
        let off = with(json!({"thinking": {"type": "disabled"}}));
        assert_eq!(
            off["chat_template_kwargs"],
            json!({"enable_thinking": false})
        );
        let on = with(json!({"thinking": {"type": "enabled", "budget_tokens": 1024}}));
        assert_eq!(on["chat_template_kwargs"], json!({"enable_thinking": true}));
        let kept = with(json!({"thinking": {"type": "disabled"},
                               "chat_template_kwargs": {"enable_thinking": true, "x": 1}}));
        assert_eq!(
            kept["chat_template_kwargs"],
            json!({"enable_thinking": true, "x": 1})
        );
        let e = to_chat_body(
            json!({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
                   "thinking": {"type": "sometimes"}})
            .to_string()
            .as_bytes(),
            false,
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("thinking"));
    }
}
