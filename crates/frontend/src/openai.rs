//! OpenAI API shapes: the error body and the response types (requests are parsed field by field
//! in [`crate::validate`], so every bad field is named in the error).

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Serialize;

/// An error answered with an OpenAI-style body:
/// `{"error": {"message", "type", "param", "code"}}`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// Human-readable message.
    pub message: String,
    /// OpenAI error type (`invalid_request_error`, `authentication_error`, ...).
    pub kind: &'static str,
    /// The request field at fault, if any.
    pub param: Option<String>,
}

impl ApiError {
    /// A 400 about `param`.
    pub fn invalid(param: impl Into<Option<String>>, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.into(),
        }
    }

    /// A 400 about the named field.
    pub fn field(param: &str, message: impl Into<String>) -> Self {
        Self::invalid(Some(param.to_owned()), message)
    }

    /// A 404 (unknown model, unknown route).
    pub fn not_found(param: Option<&str>, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            message: message.into(),
            kind: "not_found_error",
            param: param.map(str::to_owned),
        }
    }

    /// A 405: the route exists but not for this HTTP method.
    pub fn method_not_allowed(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::METHOD_NOT_ALLOWED,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
        }
    }

    /// A 401 (missing or wrong API key).
    pub fn unauthorized() -> Self {
        Self {
            status: StatusCode::UNAUTHORIZED,
            message: "Incorrect or missing API key: send 'Authorization: Bearer <key>' (or \
                      'x-api-key: <key>')."
                .into(),
            kind: "authentication_error",
            param: None,
        }
    }

    /// A 503 (engine unavailable).
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: message.into(),
            kind: "service_unavailable",
            param: None,
        }
    }

    /// A 500 (the engine failed the request).
    pub fn internal(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "internal_server_error",
            param: None,
        }
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "message": clipped(&self.message, MAX_ERROR_MESSAGE_BYTES),
                "type": self.kind,
                "param": self.param.as_deref().map(|p| clipped(p, MAX_ERROR_MESSAGE_BYTES)),
                "code": self.status.as_u16(),
            }
        })
    }
}

/// Most bytes of an error body's `message` (and `param`): a message that quotes a huge bad
/// value (a 1 MB `role`) keeps its start and end, not a copy of the request.
pub const MAX_ERROR_MESSAGE_BYTES: usize = 2048;

/// `s`, or when longer than `max` bytes its first and last `max / 2` bytes or fewer (cut at
/// character boundaries) around ` [... N bytes ...] `.
fn clipped(s: &str, max: usize) -> std::borrow::Cow<'_, str> {
    if s.len() <= max {
        return s.into();
    }
    let mut head = max / 2;
    while !s.is_char_boundary(head) {
        head -= 1;
    }
    let mut tail = s.len() - max / 2;
    while !s.is_char_boundary(tail) {
        tail += 1;
    }
    format!(
        "{} [... {} bytes ...] {}",
        &s[..head],
        tail - head,
        &s[tail..]
    )
    .into()
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

/// Token counts of a response.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Usage {
    /// Prompt tokens (each prompt counted once).
    pub prompt_tokens: usize,
    /// Generated tokens, all choices.
    pub completion_tokens: usize,
    /// The sum.
    pub total_tokens: usize,
    /// Details of `prompt_tokens` (OpenAI's field).
    pub prompt_tokens_details: PromptTokensDetails,
}

/// `usage.prompt_tokens_details`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens whose KV came from the prefix cache (each prompt counted once, as in
    /// `prompt_tokens`).
    pub cached_tokens: usize,
}

impl Usage {
    /// Usage from the counts.
    pub fn new(prompt_tokens: usize, completion_tokens: usize, cached_tokens: usize) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            prompt_tokens_details: PromptTokensDetails { cached_tokens },
        }
    }
}

/// Cached prompt tokens of a response whose choices come `n` per prompt, in prompt order: each
/// prompt counts once, with the most any of its choices found in the cache.
pub fn cached_per_prompt(cached_by_choice: &[usize], n: usize) -> usize {
    cached_by_choice
        .chunks(n.max(1))
        .map(|c| c.iter().copied().max().unwrap_or(0))
        .sum()
}

/// Legacy completions log-probabilities of a choice (or of a streamed delta). With `echo`,
/// the prompt's tokens come first; the first prompt token has no log-probability (`null`).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct CompletionLogprobs {
    /// Character offset of each token in the choice's text.
    pub text_offset: Vec<usize>,
    /// Log-probability of each token (`null` for the first prompt token).
    pub token_logprobs: Vec<Option<f32>>,
    /// Each token's text.
    pub tokens: Vec<String>,
    /// The top alternatives per position (`null` for the first prompt token).
    pub top_logprobs: Vec<Option<TopLogprobs>>,
}

impl CompletionLogprobs {
    /// Appends `other`'s entries (the tokens that follow).
    pub fn append(&mut self, other: CompletionLogprobs) {
        self.text_offset.extend(other.text_offset);
        self.token_logprobs.extend(other.token_logprobs);
        self.tokens.extend(other.tokens);
        self.top_logprobs.extend(other.top_logprobs);
    }
}

/// The top alternatives at one position, a JSON object from token text to log-probability in
/// descending probability order (as OpenAI and vLLM return it); a text that two tokens share
/// keeps its more probable entry.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TopLogprobs(Vec<(String, f32)>);

impl TopLogprobs {
    /// From `(text, logprob)` pairs in any order.
    pub fn new(pairs: impl IntoIterator<Item = (String, f32)>) -> Self {
        let mut v: Vec<(String, f32)> = pairs.into_iter().collect();
        v.sort_by(|a, b| b.1.total_cmp(&a.1));
        let mut seen = std::collections::HashSet::new();
        v.retain(|(t, _)| seen.insert(t.clone()));
        Self(v)
    }

    /// The entries, most probable first.
    pub fn entries(&self) -> &[(String, f32)] {
        &self.0
    }
}

impl Serialize for TopLogprobs {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in &self.0 {
            m.serialize_entry(k, v)?;
        }
        m.end()
    }
}

/// One token of vLLM's `prompt_logprobs` at one prompt position.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PromptLogprob {
    /// Its log-probability given the prompt tokens before the position.
    pub logprob: f32,
    /// Its rank in the vocabulary (1: the most likely); for an alternative, its place in the
    /// top list.
    pub rank: u32,
    /// The token's text, as in the other log-probability lists.
    pub decoded_token: String,
}

/// vLLM's `prompt_logprobs` at one prompt position: a JSON object from token id (a decimal
/// string) to its [`PromptLogprob`], the prompt token first, then the top alternatives most
/// likely first; each token appears once.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PromptPosition(pub Vec<(u32, PromptLogprob)>);

impl Serialize for PromptPosition {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(Some(self.0.len()))?;
        for (id, v) in &self.0 {
            m.serialize_entry(&id.to_string(), v)?;
        }
        m.end()
    }
}

/// vLLM's `prompt_logprobs` of a prompt: one entry per prompt token (BOS included), `null`
/// for the first and for any position the engine did not score.
pub type PromptLogprobs = Vec<Option<PromptPosition>>;

/// What ended a choice whose `finish_reason` is `stop`, as vLLM reports it in `stop_reason`:
/// the stop string that matched (a JSON string) or the `stop_token_ids` entry that was
/// generated (a JSON integer). A choice that ended on the model's EOS, on its length or by an
/// abort has none (`null`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum StopReason {
    /// A stop string, as the request gave it.
    Text(String),
    /// A stop token id.
    Token(u32),
}

/// One choice of a `/v1/completions` response.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CompletionChoice {
    /// Choice index (`prompt_index * n + j`).
    pub index: usize,
    /// Generated text (prompt first with `echo`).
    pub text: String,
    /// Log-probabilities, when asked.
    pub logprobs: Option<CompletionLogprobs>,
    /// `stop`, `length` or `abort`; `null` in a streamed chunk that does not end the choice.
    pub finish_reason: Option<String>,
    /// The stop string or stop token id that ended the choice; `null` otherwise, and in every
    /// streamed chunk but the last of the choice (vLLM sends the field in every chunk).
    pub stop_reason: Option<StopReason>,
    /// vLLM's `prompt_logprobs` of the choice's prompt, when the request asked for them (left
    /// out otherwise; never streamed).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs: Option<PromptLogprobs>,
    /// With vLLM's `return_token_ids`: the prompt's token ids (streamed: in the choice's
    /// first chunk only); left out otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u32>>,
    /// With `return_token_ids`: the generated token ids (streamed: this chunk's), stop tokens
    /// included; left out otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

/// A response or streamed chunk of either API, over its choice type `C`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Chunk<C> {
    /// `cmpl-...` or `chatcmpl-...`, the same for every chunk of a response.
    pub id: String,
    /// `text_completion` or `chat.completion.chunk`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// Served model name.
    pub model: String,
    /// Choices (empty in the usage chunk).
    pub choices: Vec<C>,
    /// Token counts (streamed chunks: only the last, with `include_usage`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    /// A streamed chat response's prompt token ids with vLLM's `return_token_ids`, in each
    /// choice's first chunk (left out otherwise, and on completions, which put them in the
    /// choice).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u32>>,
}

/// A `/v1/completions` response or streamed chunk.
pub type CompletionResponse = Chunk<CompletionChoice>;

/// One alternative token of a chat log-probability entry.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ChatTopLogprob {
    /// Token text (`bytes:\xNN` when it is not valid UTF-8 on its own).
    pub token: String,
    /// Log-probability.
    pub logprob: f32,
    /// The token's bytes.
    pub bytes: Vec<u8>,
}

/// One sampled token of a chat log-probability list.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ChatLogprob {
    /// Token text.
    pub token: String,
    /// Log-probability.
    pub logprob: f32,
    /// The token's bytes.
    pub bytes: Vec<u8>,
    /// The most likely alternatives.
    pub top_logprobs: Vec<ChatTopLogprob>,
}

/// Chat log-probabilities of a choice.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ChatLogprobs {
    /// One entry per generated token.
    pub content: Vec<ChatLogprob>,
}

/// The reply message of a chat choice.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ChatMessage {
    /// `assistant`, or with `add_generation_prompt: false` the last message's role (vLLM's;
    /// see [`crate::validate::ChatRequest::reply_role`]).
    pub role: String,
    /// Generated text; `null` when the output was only tool calls (or, with a reasoning
    /// parser, only reasoning).
    pub content: Option<String>,
    /// The reasoning, with `--reasoning-parser` (left out when none): current vLLM's name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<String>,
    /// The same text under the name vLLM used before 0.18 (and DeepSeek's API and Qwen-Agent
    /// read), so older clients keep working (left out when none).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// The tool calls the parser found (left out when none).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCallOut>,
}

/// A function call of the assistant (`message.tool_calls[i]`).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ToolCallOut {
    /// `chatcmpl-tool-<hex>`.
    pub id: String,
    /// `function`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// The function and its arguments.
    pub function: FunctionCall,
}

/// The function of a tool call.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FunctionCall {
    /// The function's name.
    pub name: String,
    /// Its arguments, a JSON text.
    pub arguments: String,
}

/// A tool call in a streamed delta (`delta.tool_calls[i]`): sent whole, once.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ToolCallDelta {
    /// Position of the call in the message's `tool_calls`.
    pub index: usize,
    /// `chatcmpl-tool-<hex>`.
    pub id: String,
    /// `function`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// The function and its whole arguments.
    pub function: FunctionCall,
}

/// One choice of a `/v1/chat/completions` response.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ChatChoice {
    /// Choice index.
    pub index: usize,
    /// The message.
    pub message: ChatMessage,
    /// Log-probabilities, when asked.
    pub logprobs: Option<ChatLogprobs>,
    /// `stop`, `length` or `abort`.
    pub finish_reason: Option<String>,
    /// The stop string or stop token id that ended the choice, else `null`.
    pub stop_reason: Option<StopReason>,
    /// With vLLM's `return_token_ids`: the generated token ids, stop tokens included (left out
    /// otherwise).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

/// A `/v1/chat/completions` response.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ChatResponse {
    /// `chatcmpl-...`.
    pub id: String,
    /// `chat.completion`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// Served model name.
    pub model: String,
    /// Choices.
    pub choices: Vec<ChatChoice>,
    /// Token counts.
    pub usage: Usage,
    /// vLLM's `prompt_logprobs` of the rendered prompt (the choices share it), when the
    /// request asked for them (left out otherwise).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs: Option<PromptLogprobs>,
    /// With vLLM's `return_token_ids`: the rendered prompt's token ids (left out otherwise).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u32>>,
}

/// The delta of a streamed chat chunk.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ChatDelta {
    /// The reply's role in the first chunk of a choice (see [`ChatMessage::role`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    /// New text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    /// New reasoning, with `--reasoning-parser` (see [`ChatMessage::reasoning`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<String>,
    /// The same text under its older name (see [`ChatMessage::reasoning_content`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// Tool calls, each whole, in the delta before the choice's last.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallDelta>>,
}

/// One choice of a streamed chat chunk.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ChatChunkChoice {
    /// Choice index.
    pub index: usize,
    /// What is new.
    pub delta: ChatDelta,
    /// Log-probabilities of the tokens in this chunk, when asked.
    pub logprobs: Option<ChatLogprobs>,
    /// Set in the last chunk of the choice.
    pub finish_reason: Option<String>,
    /// Only in the last chunk of the choice (the one with `finish_reason`), as vLLM sends it:
    /// `Some(None)` is `null` there; `None` leaves the field out of the other chunks.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stop_reason: Option<Option<StopReason>>,
    /// With vLLM's `return_token_ids`: the token ids this chunk's delta came from (left out
    /// otherwise, and from the first chunk, which carries the role).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

/// A streamed `/v1/chat/completions` chunk.
pub type ChatChunk = Chunk<ChatChunkChoice>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_bodies_clip_long_messages_at_character_boundaries() {
        assert_eq!(clipped("short", 8), "short");
        let long = format!("'role' must be a string, got {}.", "é".repeat(3000));
        let e = ApiError::field(&"p".repeat(5000), long.clone());
        let body = e.body();
        let msg = body["error"]["message"].as_str().unwrap();
        assert!(msg.len() < MAX_ERROR_MESSAGE_BYTES + 64, "{}", msg.len());
        assert!(msg.starts_with("'role' must be a string, got éé"), "{msg}");
        assert!(msg.ends_with("éé."), "{msg}");
        assert!(msg.contains(" bytes ...] "), "{msg}");
        assert!(body["error"]["param"].as_str().unwrap().len() < MAX_ERROR_MESSAGE_BYTES + 64);
        // Under the limit nothing changes.
        let e = ApiError::field("n", "'n' must be at least 1, got 0.");
        assert_eq!(
            e.body()["error"]["message"],
            "'n' must be at least 1, got 0."
        );
    }

    #[test]
    fn stop_reason_is_a_string_an_integer_or_null_and_left_out_of_unfinished_chat_chunks() {
        let choice = |stop_reason| ChatChunkChoice {
            index: 0,
            delta: ChatDelta::default(),
            logprobs: None,
            finish_reason: None,
            stop_reason,
            token_ids: None,
        };
        let json = |c: &ChatChunkChoice| serde_json::to_value(c).unwrap();
        assert!(json(&choice(None)).get("stop_reason").is_none());
        assert_eq!(
            json(&choice(Some(None)))["stop_reason"],
            serde_json::Value::Null
        );
        assert_eq!(
            json(&choice(Some(Some(StopReason::Token(13)))))["stop_reason"],
            13
        );
        assert_eq!(
            json(&choice(Some(Some(StopReason::Text("\n\n".into())))))["stop_reason"],
            "\n\n"
        );
    }

    #[test]
    fn prompt_positions_serialize_as_objects_keyed_by_token_id_in_order() {
        let e = |logprob, rank, t: &str| PromptLogprob {
            logprob,
            rank,
            decoded_token: t.into(),
        };
        let p = PromptPosition(vec![(7, e(-2.5, 3, " cat")), (12, e(-0.5, 1, ","))]);
        assert_eq!(
            serde_json::to_string(&p).unwrap(),
            r#"{"7":{"logprob":-2.5,"rank":3,"decoded_token":" cat"},"12":{"logprob":-0.5,"rank":1,"decoded_token":","}}"#
        );
    }

    #[test]
    fn top_logprobs_serialize_most_probable_first_and_keep_a_shared_text_once() {
        let t = TopLogprobs::new([
            ("b".to_owned(), -1.0),
            ("a".to_owned(), -3.5),
            (",".to_owned(), -0.25),
            ("b".to_owned(), -2.0),
        ]);
        assert_eq!(
            serde_json::to_string(&t).unwrap(),
            r#"{",":-0.25,"b":-1.0,"a":-3.5}"#
        );
    }
}
