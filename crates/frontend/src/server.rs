//! The HTTP server: routes, handlers, streaming.
//!
//! Contract: every request is parsed and validated completely (model name, prompt, limits) and
//! every engine request is admitted before a response starts, so a bad request always gets a
//! 4xx with an OpenAI error body and never a half-opened stream. After a stream started, an
//! engine error is one `data: {"error": ...}` event followed by `data: [DONE]` (on
//! `/v1/responses`, an `error` and a `response.failed` event: [`crate::responses`]). A client that
//! goes away (streaming or not) drops the response future or body, which drops its sequences,
//! which cancel their engine requests ([`crate::seq`]).

use crate::chat::ChatTemplate;
use crate::cors::CorsConfig;
use crate::detok::IncrementalDetokenizer;
use crate::engine::{random_seed, EngineClient, EngineRequest, GuidedRequest, SubmitError};
use crate::metrics::Metrics;
use crate::openai::{
    ApiError, ChatChoice, ChatChunkChoice, ChatDelta, ChatLogprob, ChatLogprobs, ChatMessage,
    ChatResponse, ChatTopLogprob, CompletionChoice, CompletionLogprobs, CompletionResponse,
    FunctionCall, PromptLogprob, PromptLogprobs, PromptPosition, StopReason, ToolCallDelta,
    ToolCallOut, TopLogprobs, Usage,
};
use crate::reasoning::{ReasoningParser, ReasoningSplitter, Split};
use crate::seq::{Delta, Seq, SeqContext, TokenInfo};
use crate::tools::{CallMode, StreamFilter, ToolCall, ToolParser};
use crate::validate::{self, Fields, GenParams, PromptInput};
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use baton_model::Tokenizer;
use baton_proto::SamplingParams;
use futures::stream::{self, BoxStream, SelectAll, StreamExt};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::TcpListener;

/// Server flags (`baton frontend`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerConfig {
    /// Address to bind.
    pub host: String,
    /// Port to bind (0: any free port).
    pub port: u16,
    /// Require `Authorization: Bearer <key>` on `/v1/*`.
    pub api_key: Option<String>,
    /// The model name clients use (`model` field, `/v1/models`): the first of
    /// `--served-model-name`, the one responses report.
    pub served_model_name: String,
    /// The further names of `--served-model-name` (vLLM takes several): a request may name
    /// the model by any of them, and `/v1/models` lists each after `served_model_name`.
    pub more_served_model_names: Vec<String>,
    /// Other names a request's `model` may give (without `--served-model-name`, the
    /// `--model` argument as typed: vLLM serves under that string, so its clients send it);
    /// `/v1/models` and responses use `served_model_name`.
    pub model_aliases: Vec<String>,
    /// A chat template (the template text; see [`crate::chat::load_template_arg`] for paths)
    /// that overrides the tokenizer's.
    pub chat_template: Option<String>,
    /// How long a client may take to send a request's headers (on a new connection, or
    /// between keep-alive requests) before the connection is closed, and then its body before
    /// it gets a 408, so idle or slow clients cannot hold connections forever (slowloris).
    /// [`DEFAULT_HEADER_READ_TIMEOUT`] unless set.
    pub header_read_timeout: Duration,
    /// CORS: which browser origins may call the API ([`CorsConfig::default`]: any, as vLLM).
    pub cors: CorsConfig,
    /// vLLM's `--enable-auto-tool-choice`: chat requests with `tools` and `tool_choice` `auto`
    /// (the default with tools) have their output parsed for tool calls. Needs
    /// [`ServerConfig::tool_call_parser`].
    pub enable_auto_tool_choice: bool,
    /// vLLM's `--tool-call-parser`: how the model writes tool calls.
    pub tool_call_parser: Option<ToolParser>,
    /// vLLM's `--reasoning-parser`: chat and Responses outputs are split into reasoning and
    /// content ([`crate::reasoning`]).
    pub reasoning_parser: Option<ReasoningParser>,
    /// Defaults for the sampling fields a request leaves out (vLLM's `--generation-config`).
    pub sampling_defaults: crate::validate::SamplingDefaults,
    /// vLLM's `--return-tokens-as-token-ids`: log-probability entries name their tokens as
    /// `token_id:{id}` unless a request's `return_tokens_as_token_ids` says otherwise.
    pub return_tokens_as_token_ids: bool,
    /// vLLM's `--seed`: the seed of the random streams of requests that give no `seed`. The
    /// `k`-th such sequence this server starts (counting every choice of `n`) samples with
    /// seed `splitmix64(seed + k)`, so a server restarted with the same seed and sent the same
    /// requests in the same order samples the same tokens (each stream is the row's own,
    /// whatever its batchmates). `None`: a random seed per sequence.
    pub seed: Option<u64>,
    /// The Responses API store's budget in bytes of JSON ([`crate::store`]); 0 (the default,
    /// as vLLM's) stores nothing.
    pub responses_store_bytes: usize,
    /// vLLM's `--enable-force-include-usage`: streamed completions and chat responses end
    /// with a usage chunk even without `stream_options.include_usage`.
    pub force_include_usage: bool,
    /// vLLM's `--lora-modules`, `(name, path)` in flag order: a request whose `model` is a
    /// name runs with that adapter (id `i + 1`, which the scheduler and worker resolve from
    /// the same list), responses report the name, and `/v1/models` lists each with the base
    /// model as `parent`.
    pub lora_modules: Vec<(String, String)>,
}

impl ServerConfig {
    /// `served_model_name` on 127.0.0.1, any free port, with every other flag at its default:
    /// no API key, extra names, chat template, tool or reasoning parser or sampling defaults,
    /// vLLM's CORS and [`DEFAULT_HEADER_READ_TIMEOUT`].
    pub fn new(served_model_name: impl Into<String>) -> Self {
        Self {
            host: "127.0.0.1".into(),
            port: 0,
            api_key: None,
            served_model_name: served_model_name.into(),
            more_served_model_names: Vec::new(),
            model_aliases: Vec::new(),
            chat_template: None,
            header_read_timeout: DEFAULT_HEADER_READ_TIMEOUT,
            cors: CorsConfig::default(),
            enable_auto_tool_choice: false,
            tool_call_parser: None,
            reasoning_parser: None,
            sampling_defaults: Default::default(),
            return_tokens_as_token_ids: false,
            seed: None,
            responses_store_bytes: 0,
            force_include_usage: false,
            lora_modules: Vec::new(),
        }
    }
}

/// The default [`ServerConfig::header_read_timeout`] (hyper's own default, 30 s).
pub const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// Everything the handlers share.
pub struct AppState {
    /// Flags.
    pub config: ServerConfig,
    /// The model's tokenizer.
    pub tokenizer: Arc<Tokenizer>,
    /// The engine.
    pub engine: Arc<dyn EngineClient>,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// The model's EOS ids (the engine stops on them; the chat template's `eos_token` falls
    /// back to the first one).
    pub eos_ids: Vec<u32>,
    /// The chat template: `--chat-template`, else the tokenizer's, else none.
    pub chat: Option<ChatTemplate>,
    /// The vocabulary structured outputs compile against, or why there is none (a tokenizer
    /// llguidance cannot read).
    vocabulary: Result<baton_grammar::Vocabulary, String>,
    created: u64,
    /// Set to true when a shutdown's grace period is over: live sequences then end their
    /// streams with an error event instead of being cut.
    draining: tokio::sync::watch::Sender<bool>,
    /// Sequences started without a request `seed` ([`ServerConfig::seed`]'s `k`).
    unseeded: std::sync::atomic::AtomicU64,
    /// The longest vocabulary piece in UTF-8 bytes: a prompt longer than `max_model_len`
    /// times this (times a margin for normalization) cannot fit and is refused untokenized.
    max_piece_bytes: usize,
    /// The CORS layer built from `config.cors`.
    cors: tower_http::cors::CorsLayer,
    /// The tokenizer marks `<think>` or `</think>` as special: with a reasoning parser, outputs
    /// are detokenized with `skip_special_tokens` off so the parser sees the tags.
    think_tags_special: bool,
    /// The id of `</think>` when it is one token.
    think_end_id: Option<u32>,
    /// `root` of the `/v1/models` cards: the model's path (see [`AppState::with_model_root`]).
    model_root: String,
    /// The Responses API store, when [`ServerConfig::responses_store_bytes`] is not 0.
    pub(crate) responses_store: Option<crate::store::ResponseStore>,
}

impl std::fmt::Debug for AppState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppState")
            .field("config", &self.config)
            .field("tokenizer", &self.tokenizer)
            .finish_non_exhaustive()
    }
}

pub(crate) fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl AppState {
    /// Builds the state; compiles the chat template and checks the CORS settings and the
    /// served model names (a repeated name is listed once).
    ///
    /// `/v1/models` reports `root` as the first of `config.model_aliases` (the `--model`
    /// argument when no `--served-model-name` is given), else the first served name;
    /// [`AppState::with_model_root`] sets it to the model's path, as vLLM reports it.
    ///
    /// # Errors
    /// The chat template does not compile, a CORS origin, method or header cannot appear in
    /// an HTTP header, auto tool choice is enabled without a tool call parser, or a served
    /// model name is empty.
    pub fn new(
        mut config: ServerConfig,
        tokenizer: Tokenizer,
        engine: Arc<dyn EngineClient>,
        eos_ids: Vec<u32>,
    ) -> anyhow::Result<Self> {
        if config.enable_auto_tool_choice && config.tool_call_parser.is_none() {
            anyhow::bail!(
                "--enable-auto-tool-choice requires --tool-call-parser (one of: {})",
                crate::tools::TOOL_PARSER_NAMES.join(", ")
            );
        }
        if std::iter::once(&config.served_model_name)
            .chain(&config.more_served_model_names)
            .any(|n| n.trim().is_empty())
        {
            anyhow::bail!(
                "--served-model-name: a served model name cannot be empty or blank; give \
                 one or more names, or leave the flag out to serve under the model \
                 directory's name"
            );
        }
        // `--served-model-name a a b`: each name once, in order (after the first).
        let mut seen = vec![config.served_model_name.clone()];
        config.more_served_model_names.retain(|n| {
            let new = !seen.contains(n);
            if new {
                seen.push(n.clone());
            }
            new
        });
        let model_root = config
            .model_aliases
            .first()
            .unwrap_or(&config.served_model_name)
            .clone();
        let source = config
            .chat_template
            .clone()
            .or_else(|| tokenizer.chat_template().map(str::to_owned));
        let chat = source
            .map(ChatTemplate::new)
            .transpose()
            .map_err(anyhow::Error::msg)?;
        let cors = config
            .cors
            .layer()
            .map_err(|e| anyhow::anyhow!("CORS settings: {e}"))?;
        let vocabulary = grammar_vocabulary(&tokenizer, engine.limits().vocab_size, &eos_ids);
        // `</think>` as one token: structured outputs can start after it.
        let think_end_id = tokenizer
            .encode(crate::reasoning::THINK_END, false)
            .ok()
            .filter(|ids| ids.len() == 1)
            .map(|ids| ids[0]);
        let think_tags_special = tokenizer
            .inner()
            .get_added_tokens_decoder()
            .values()
            .any(|t| {
                t.special
                    && (t.content == crate::reasoning::THINK_START
                        || t.content == crate::reasoning::THINK_END)
            });
        if let Err(e) = &vocabulary {
            tracing::warn!("structured outputs are unavailable: {e}");
        }
        let responses_store = (config.responses_store_bytes > 0)
            .then(|| crate::store::ResponseStore::new(config.responses_store_bytes));
        Ok(Self {
            responses_store,
            vocabulary,
            cors,
            config,
            engine,
            metrics: Arc::new(Metrics::new()),
            eos_ids,
            chat,
            created: now_secs(),
            draining: tokio::sync::watch::Sender::new(false),
            unseeded: std::sync::atomic::AtomicU64::new(0),
            max_piece_bytes: tokenizer_max_piece_bytes(&tokenizer),
            think_tags_special,
            think_end_id,
            tokenizer: Arc::new(tokenizer),
            model_root,
        })
    }

    /// The seed of a sequence whose request gave none ([`ServerConfig::seed`]).
    fn unseeded_seed(&self) -> u64 {
        match self.config.seed {
            Some(s) => {
                let k = self
                    .unseeded
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                splitmix64(s.wrapping_add(k))
            }
            None => random_seed(),
        }
    }

    /// Sets the `root` of the `/v1/models` cards to `root`, the model as `--model` gave it
    /// (vLLM reports the model's path there, with `parent` null).
    #[must_use]
    pub fn with_model_root(mut self, root: impl Into<String>) -> Self {
        self.model_root = root.into();
        self
    }

    /// Tokenizes a prompt for a generation request without stalling the async threads: a
    /// text longer than any prompt that fits in `max_model_len` tokens is refused at once
    /// (each token covers at most `max_piece_bytes` bytes of input, with a margin of 4 for
    /// normalizers), and a long one is tokenized on tokio's blocking pool.
    ///
    /// # Errors
    /// 400 naming `field` for a prompt that is too long, fails to tokenize, or encodes to a
    /// token id outside the model's vocabulary.
    /// The most bytes a text of `max_model_len` tokens can have (every token its longest
    /// piece, with room for byte-fallback escapes): a longer text cannot fit.
    pub(crate) fn prompt_byte_bound(&self, max_model_len: usize) -> usize {
        max_model_len
            .saturating_mul(self.max_piece_bytes.max(1))
            .saturating_mul(4)
    }

    pub(crate) async fn encode_prompt(
        &self,
        text: &str,
        add_special: bool,
        field: &str,
        max_model_len: usize,
    ) -> Result<Vec<u32>, ApiError> {
        let bound = self.prompt_byte_bound(max_model_len);
        if text.len() > bound {
            return Err(ApiError::field(
                field,
                format!(
                    "This model's maximum context length is {max_model_len} tokens. However, \
                     your prompt is {} bytes long, more than {max_model_len} tokens can hold. \
                     Please reduce the length of the prompt.",
                    text.len()
                ),
            ));
        }
        let err = |e: baton_model::ModelError| ApiError::field(field, e.to_string());
        let ids = if text.len() <= INLINE_TOKENIZE_BYTES {
            self.tokenizer.encode(text, add_special).map_err(err)?
        } else {
            let (tok, owned) = (Arc::clone(&self.tokenizer), text.to_owned());
            tokio::task::spawn_blocking(move || tok.encode(&owned, add_special))
                .await
                .map_err(|e| ApiError::internal(format!("tokenizing the prompt: {e}")))?
                .map_err(err)?
        };
        // A tokenizer with added tokens past the model's vocabulary (vLLM checks this too).
        let vocab = self.engine.limits().vocab_size;
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(ApiError::field(
                field,
                format!(
                    "Token id {id} is out of vocabulary: the prompt's text encodes to it, and \
                     this model has {vocab} tokens."
                ),
            ));
        }
        Ok(ids)
    }

    /// A request's `model` must name a served model or a LoRA adapter; absent, null or `""`
    /// means the first (vLLM's `_is_model_supported` takes an empty name too). Returns the
    /// adapter id: 0 for the base model, `i + 1` for `config.lora_modules[i]`.
    pub(crate) fn check_model(&self, model: Option<&str>) -> Result<u32, ApiError> {
        match model {
            Some(m)
                if !m.is_empty()
                    && m != self.config.served_model_name
                    && !self.config.more_served_model_names.iter().any(|a| a == m)
                    && !self.config.model_aliases.iter().any(|a| a == m) =>
            {
                match self.config.lora_modules.iter().position(|(n, _)| n == m) {
                    Some(i) => Ok(i as u32 + 1),
                    None => Err(ApiError::not_found(
                        Some("model"),
                        format!("The model `{m}` does not exist."),
                    )),
                }
            }
            _ => Ok(0),
        }
    }

    /// The name responses report for adapter id `lora` ([`AppState::check_model`]): the
    /// adapter's, or the first served name for the base model.
    pub(crate) fn model_name(&self, lora: u32) -> String {
        (lora as usize)
            .checked_sub(1)
            .and_then(|i| self.config.lora_modules.get(i))
            .map_or_else(|| self.config.served_model_name.clone(), |(n, _)| n.clone())
    }

    fn special_token(&self, text: Option<&String>, fallback: Option<u32>) -> String {
        text.cloned()
            .or_else(|| fallback.and_then(|id| self.tokenizer.id_to_piece(id)))
            .unwrap_or_default()
    }

    /// The reasoning parser for a chat or Responses request with `gen` rendered with
    /// `template_kwargs`: the flag's. With structured outputs, as vLLM's: the model reasons
    /// freely and the constraint applies from the token after `</think>`
    /// ([`GenParams::guide_after`]); where that cannot be (`</think>` is not one token, or
    /// qwen3 with thinking off) the constraint applies from the first token and the output is
    /// all content. When the tokenizer marks a think tag as special, `gen` keeps special
    /// tokens in the text, so the parser sees the tags (vLLM finds them by token id).
    pub(crate) fn reasoning_parser(
        &self,
        gen: &mut GenParams,
        template_kwargs: &serde_json::Map<String, Value>,
    ) -> Option<ReasoningParser> {
        let p = self.config.reasoning_parser?;
        if gen.constraint.is_some() {
            match self.think_end_id {
                Some(end) if !p.thinking_off(template_kwargs) => gen.guide_after = Some(end),
                _ => return None,
            }
        }
        if self.think_tags_special {
            gen.skip_special_tokens = false;
        }
        Some(p)
    }

    /// How an output becomes tool calls for a resolved `tool_choice` (chat's and the Responses
    /// API's): none for `none`, the server's parser for `auto`, a guided call for `required`
    /// and a named function. With the `hermes` or `mistral` parser, `gen` keeps special
    /// tokens in the output: `<tool_call>` and `[TOOL_CALLS]` are special tokens in the
    /// models that use them, which the parser must see (as vLLM's parsers' `adjust_request`).
    ///
    /// # Errors
    /// 400 naming `tool_choice` for `auto` when the server has no
    /// `--enable-auto-tool-choice` and `--tool-call-parser` (vLLM's message).
    pub(crate) fn call_mode(
        &self,
        choice: &validate::ToolChoice,
        gen: &mut GenParams,
    ) -> Result<Option<CallMode>, ApiError> {
        let mode = match choice {
            validate::ToolChoice::None => return Ok(None),
            validate::ToolChoice::Required => CallMode::Required,
            validate::ToolChoice::Named(name) => CallMode::Named(name.clone()),
            validate::ToolChoice::Auto => match self.config.tool_call_parser {
                Some(p) if self.config.enable_auto_tool_choice => CallMode::Parser(p),
                _ => {
                    return Err(ApiError::field(
                        "tool_choice",
                        "\"auto\" tool choice requires --enable-auto-tool-choice and \
                         --tool-call-parser to be set",
                    ))
                }
            },
        };
        if let CallMode::Parser(p) = &mode {
            if p.keeps_special_tokens() {
                gen.skip_special_tokens = false;
            }
        }
        Ok(Some(mode))
    }

    /// Renders `req`'s messages with the chat template; with `continue_final_message`, cut
    /// right after the final message's content (as transformers' `apply_chat_template`).
    ///
    /// Where the content ends is found by rendering a second time with a unique sentinel
    /// appended to the final message's content: the content is looked for only before the
    /// sentinel, so a content that also occurs in what the template writes after it (`"s"` in
    /// a closing `</s>`) is still cut at the message. When the template does not reproduce
    /// the sentinel once (it drops or transforms the content), the cut falls back to the last
    /// occurrence of the content in the whole prompt, as transformers' `rindex`.
    pub(crate) fn render_chat(&self, req: &validate::ChatRequest) -> Result<String, ApiError> {
        let mut kwargs = req.template_kwargs.clone();
        if let Some(tools) = &req.tools {
            // A `tools` in `chat_template_kwargs` wins, as in vLLM.
            kwargs
                .entry("tools")
                .or_insert_with(|| Value::Array(tools.clone()));
        }
        self.render_conversation(
            &req.messages,
            req.add_generation_prompt,
            req.continue_final_message,
            &kwargs,
        )
    }

    /// Renders `messages` with the chat template and `kwargs`; with `continue_final_message`,
    /// cut right after the final message's content (see [`AppState::render_chat`]).
    ///
    /// # Errors
    /// 400 when there is no chat template, the template fails, or the final message's content
    /// cannot be found to continue it.
    pub(crate) fn render_conversation(
        &self,
        messages: &[Value],
        add_generation_prompt: bool,
        continue_final_message: bool,
        kwargs: &serde_json::Map<String, Value>,
    ) -> Result<String, ApiError> {
        let text = self.render_messages(messages, add_generation_prompt, kwargs)?;
        if !continue_final_message {
            return Ok(text);
        }
        let last = messages
            .last()
            .and_then(|m| m.get("content"))
            .and_then(Value::as_str)
            .unwrap_or_default();
        // Private-use characters and a random number: no content or template writes it.
        let sentinel = format!(
            "\u{E000}baton-final-{:016x}\u{E001}",
            crate::engine::random_seed()
        );
        let mut marked = messages.to_vec();
        if let Some(m) = marked.last_mut().and_then(Value::as_object_mut) {
            m.insert("content".into(), Value::String(format!("{last}{sentinel}")));
        }
        // A template that fails on the marked content (it checks the content, say) leaves
        // the fallback.
        let marked = self
            .render_messages(&marked, add_generation_prompt, kwargs)
            .ok();
        let end =
            continue_final_end(&text, marked.as_deref(), &sentinel, last).ok_or_else(|| {
                ApiError::field(
                    "continue_final_message",
                    "The final message's content was not found in the rendered prompt, so it \
                 cannot be continued.",
                )
            })?;
        Ok(text[..end].to_owned())
    }

    pub(crate) fn render_messages(
        &self,
        messages: &[Value],
        add_generation_prompt: bool,
        kwargs: &serde_json::Map<String, Value>,
    ) -> Result<String, ApiError> {
        let Some(t) = &self.chat else {
            return Err(ApiError::invalid(
                None,
                "This model has no chat template: use /v1/completions, or start the server with \
                 --chat-template.",
            ));
        };
        let cfg = self.tokenizer.config();
        let bos = self.special_token(cfg.bos_token.as_ref(), self.tokenizer.bos_id());
        let eos = self.special_token(
            cfg.eos_token.as_ref(),
            self.tokenizer.eos_id().or(self.eos_ids.first().copied()),
        );
        t.render(messages, add_generation_prompt, &bos, &eos, kwargs)
            .map_err(|e| ApiError::field("messages", e))
    }

    fn seq_context(&self, gen: &GenParams, arrived: Instant) -> SeqContext {
        SeqContext {
            engine: Arc::clone(&self.engine),
            tokenizer: Arc::clone(&self.tokenizer),
            metrics: Arc::clone(&self.metrics),
            stop: crate::stop::StopMatcher::new(&gen.stop, gen.include_stop_str_in_output),
            stop_reason_ids: {
                let (eos, primary): (&[u32], _) = if gen.ignore_eos {
                    (&[], None)
                } else {
                    (&self.eos_ids, self.tokenizer.eos_id())
                };
                gen.stop_token_ids
                    .iter()
                    .chain(eos)
                    .copied()
                    .filter(|&id| Some(id) != primary)
                    .collect()
            },
            stop_text_ids: if gen.include_stop_str_in_output {
                Vec::new()
            } else {
                let eos: &[u32] = if gen.ignore_eos { &[] } else { &self.eos_ids };
                gen.stop_token_ids.iter().chain(eos).copied().collect()
            },
            skip_special: gen.skip_special_tokens,
            min_tokens: gen.min_tokens,
            prompt_logprobs: gen.prompt_logprobs > 0,
            arrived,
            draining: self.draining.subscribe(),
        }
    }

    /// `min_tokens` against each prompt's effective `max_tokens` (given or defaulted, as vLLM
    /// checks it) and against the stop ids the engine can mask (EOS included unless
    /// `ignore_eos`, duplicates counted once).
    fn check_min_tokens(
        &self,
        prompts: &[(Vec<u32>, u32)],
        gen: &GenParams,
    ) -> Result<(), ApiError> {
        if gen.min_tokens == 0 {
            return Ok(());
        }
        if let Some(&(_, max)) = prompts.iter().find(|(_, max)| gen.min_tokens > *max) {
            return Err(ApiError::field(
                "min_tokens",
                format!(
                    "'min_tokens' must be at most max_tokens={max}, got {}.",
                    gen.min_tokens
                ),
            ));
        }
        // min_tokens holds back the EOS ids even under ignore_eos (vLLM's).
        let stops = baton_scheduler::min_tokens_ids(&gen.stop_token_ids, &self.eos_ids);
        if stops.len() > baton_proto::MAX_MIN_TOKENS_STOP_IDS {
            return Err(ApiError::field(
                "min_tokens",
                format!(
                    "'min_tokens' works with at most {} stop token ids (EOS included), this \
                     request has {}.",
                    baton_proto::MAX_MIN_TOKENS_STOP_IDS,
                    stops.len()
                ),
            ));
        }
        // min_tokens masks the stop ids; if they are every allowed token, nothing is left to
        // sample before min_tokens.
        if gen.allowed_only
            && baton_scheduler::min_tokens_empties_allow_list(&gen.logit_bias, &stops)
        {
            return Err(ApiError::field(
                "allowed_token_ids",
                "Every token in 'allowed_token_ids' is a stop token id (EOS included) that \
                 'min_tokens' holds back, so nothing could be sampled before min_tokens.",
            ));
        }
        Ok(())
    }

    /// vLLM's `bad_words` as token sequences ([`crate::validate::bad_words_token_ids`] over
    /// this model's tokenizer, no special tokens added).
    ///
    /// # Errors
    /// 400 naming `bad_words` (see [`crate::validate::bad_words_token_ids`]).
    fn bad_words_token_ids(&self, gen: &GenParams) -> Result<Vec<Vec<u32>>, ApiError> {
        crate::validate::bad_words_token_ids(
            &gen.bad_words,
            self.engine.limits().vocab_size,
            |text| {
                self.tokenizer
                    .encode(text, false)
                    .map_err(|e| e.to_string())
            },
        )
    }

    /// Compiles the request's structured-output constraint, if any.
    ///
    /// # Errors
    /// 400 naming the constraint's field when it does not compile, or when this model's
    /// tokenizer cannot be used for structured outputs.
    fn compile_constraint(&self, gen: &GenParams) -> Result<Option<GuidedRequest>, ApiError> {
        let Some((c, field)) = &gen.constraint else {
            return Ok(None);
        };
        let v = self.vocabulary.as_ref().map_err(|e| {
            ApiError::field(
                field,
                format!("Structured outputs are unavailable with this model's tokenizer: {e}"),
            )
        })?;
        let guide = v.compile(c).map_err(|e| {
            if *field == "tool_choice" {
                // The schema is built from the tools' parameters: they are at fault.
                ApiError::field(
                    "tools",
                    format!(
                        "A tool's parameters schema is invalid (tool_choice \"required\" or a \
                         named function guides the output by it): {e}"
                    ),
                )
            } else {
                ApiError::field(
                    field,
                    format!("The structured-output constraint is invalid: {e}"),
                )
            }
        })?;
        let guide = match gen.guide_after {
            Some(t) => guide.start_after(t),
            None => guide,
        };
        Ok(Some(GuidedRequest {
            constraint: c.clone(),
            guide,
            after: gen.guide_after,
        }))
    }

    /// Submits `n` engine requests per prompt; choice `p * n + j` is prompt `p`, seed
    /// `seed + j`. Already-admitted requests are cancelled (dropped) if a later one fails.
    pub(crate) fn submit_all(
        &self,
        prompts: &[(Vec<u32>, u32)],
        gen: &GenParams,
        arrived: Instant,
    ) -> Result<Vec<Seq>, ApiError> {
        self.check_min_tokens(prompts, gen)?;
        let guided = self.compile_constraint(gen)?;
        let bad_words = self.bad_words_token_ids(gen)?;
        if gen.allowed_only
            && baton_scheduler::bad_words_empty_allow_list(&gen.logit_bias, &bad_words)
        {
            return Err(ApiError::field(
                "bad_words",
                "Every token in 'allowed_token_ids' is a bad word of one token, so nothing \
                 could be sampled.",
            ));
        }
        let ctx = self.seq_context(gen, arrived);
        let mut seqs = Vec::with_capacity(prompts.len() * gen.n);
        for (p, (ids, max_tokens)) in prompts.iter().enumerate() {
            for j in 0..gen.n {
                let params = SamplingParams {
                    temperature: gen.temperature,
                    top_p: gen.top_p,
                    top_k: gen.top_k,
                    min_p: gen.min_p,
                    seed: gen
                        .seed
                        .map(|s| s.wrapping_add(j as u64))
                        .unwrap_or_else(|| self.unseeded_seed()),
                    top_logprobs: gen.logprobs.unwrap_or(0),
                    want_logprob: u32::from(gen.logprobs.is_some()),
                    presence_penalty: gen.presence_penalty,
                    frequency_penalty: gen.frequency_penalty,
                    repetition_penalty: gen.repetition_penalty,
                    logit_bias_len: gen.logit_bias.len() as u32,
                    allowed_only: u32::from(gen.allowed_only),
                    prompt_logprobs: gen.prompt_logprobs,
                    token_mask: 0,
                    reserved: 0,
                };
                let req = EngineRequest {
                    prompt: ids.clone(),
                    max_tokens: *max_tokens,
                    params,
                    stop_token_ids: gen.stop_token_ids.clone(),
                    ignore_eos: gen.ignore_eos,
                    logit_bias: gen.logit_bias.clone(),
                    min_tokens: gen.min_tokens,
                    cache_salt: gen.cache_salt,
                    guided: guided.clone(),
                    priority: gen.priority,
                    bad_words: bad_words.clone(),
                    lora: gen.lora,
                };
                let (id, rx) = self.engine.submit(req).map_err(|e| match e {
                    SubmitError::Rejected(m) => ApiError::invalid(None, m),
                    SubmitError::Unavailable(m) => ApiError::unavailable(m),
                })?;
                self.metrics.add_prompt_tokens(ids.len());
                seqs.push(Seq::new(&ctx, p * gen.n + j, id, rx, ids));
            }
        }
        Ok(seqs)
    }

    /// True when `gen`'s log-probability entries name tokens by id (vLLM's
    /// `return_tokens_as_token_ids`, else the server's flag).
    pub(crate) fn tokens_as_ids(&self, gen: &GenParams) -> bool {
        gen.return_tokens_as_token_ids
            .unwrap_or(self.config.return_tokens_as_token_ids)
    }

    /// The text of a token for log-probability lists, and its bytes; with `as_id`,
    /// `token_id:{id}` and its bytes (vLLM's `return_tokens_as_token_ids`, for clients that
    /// need the exact ids, such as RL trainers).
    fn token_text(&self, id: u32, as_id: bool) -> (String, Vec<u8>) {
        if as_id {
            let text = format!("token_id:{id}");
            return (text.clone(), text.into_bytes());
        }
        let bytes = match self.tokenizer.id_to_piece(id) {
            Some(p) if p.len() == 6 && p.starts_with("<0x") && p.ends_with('>') => {
                match u8::from_str_radix(&p[3..5], 16) {
                    Ok(b) => vec![b],
                    Err(_) => p.into_bytes(),
                }
            }
            Some(p) if p.contains('\u{2581}') => p.replace('\u{2581}', " ").into_bytes(),
            Some(_) => self
                .tokenizer
                .decode(&[id], false)
                .unwrap_or_default()
                .into_bytes(),
            None => Vec::new(),
        };
        let text = match std::str::from_utf8(&bytes) {
            Ok(s) => s.to_owned(),
            Err(_) => {
                let mut s = String::from("bytes:");
                for b in &bytes {
                    s.push_str(&format!("\\x{b:02x}"));
                }
                s
            }
        };
        (text, bytes)
    }

    /// A scored token's `top_logprobs` entry: its first `k` alternatives and the token itself
    /// (named by id with `as_id`).
    fn top_entry(&self, t: &TokenInfo, k: usize, as_id: bool) -> TopLogprobs {
        TopLogprobs::new(
            t.top
                .iter()
                .take(k)
                .map(|&(id, lp)| (self.token_text(id, as_id).0, reported(lp)))
                .chain(std::iter::once((
                    self.token_text(t.id, as_id).0,
                    reported(t.logprob),
                ))),
        )
    }

    /// `/v1/completions` log-probabilities of generated `tokens`; `offset` is the text
    /// offset of the first (in characters of the tokens' strings, as vLLM counts them), and
    /// advances past them. With `as_id` tokens are named `token_id:{id}`.
    fn completion_logprobs(
        &self,
        tokens: &[TokenInfo],
        offset: &mut usize,
        as_id: bool,
    ) -> CompletionLogprobs {
        let mut out = CompletionLogprobs::default();
        for t in tokens {
            let (text, _) = self.token_text(t.id, as_id);
            out.text_offset.push(*offset);
            *offset += text.chars().count();
            out.token_logprobs.push(Some(reported(t.logprob)));
            out.top_logprobs
                .push(Some(self.top_entry(t, t.top.len(), as_id)));
            out.tokens.push(text);
        }
        out
    }

    /// The log-probabilities of an echoed prompt (OpenAI `echo` with `logprobs`): one entry
    /// per prompt token `ids` (BOS included), with the engine's `scored` entries by position
    /// (see [`Delta::prompt`]); the first token, and any position not reported, gets `null`s.
    /// `text_offset` indexes `echo`, the echoed text: `echo.offsets` for a text prompt, else
    /// (a token-id prompt, echoed as its decoding) the length of the text the tokens before it
    /// decode to (with `skip_special`, as `echo` was made), so a special token like BOS, which
    /// the text does not show, takes no room. With `as_id` the offsets count the
    /// `token_id:{id}` strings the entries name instead, from 0 (vLLM measures `text_offset`
    /// in the reported tokens' strings, so the output's offsets continue from the prompt's).
    /// Each position lists `echo.top` alternatives (the engine may have scored more for
    /// `prompt_logprobs`).
    ///
    /// Returns the entries and the text offset of the first output token: the echoed text's
    /// length, or with `as_id` the total length of the prompt's `token_id:{id}` strings.
    fn prompt_logprobs(
        &self,
        echo: &EchoPrompt,
        scored: &[Option<TokenInfo>],
        as_id: bool,
    ) -> (CompletionLogprobs, usize) {
        let limit = echo.text.chars().count();
        let mut detok = IncrementalDetokenizer::new(&[], echo.skip_special);
        let mut offset = 0;
        let mut out = CompletionLogprobs::default();
        for (pos, &id) in echo.ids.iter().enumerate() {
            let (token, _) = self.token_text(id, as_id);
            match &echo.offsets {
                _ if as_id => {
                    out.text_offset.push(offset);
                    offset += token.chars().count();
                }
                Some(o) => out.text_offset.push(o[pos].min(limit)),
                None => {
                    out.text_offset.push(offset.min(limit));
                    offset += detok.push(&self.tokenizer, id).chars().count();
                }
            }
            let t = scored.get(pos).and_then(Option::as_ref);
            out.token_logprobs.push(t.map(|t| reported(t.logprob)));
            out.top_logprobs
                .push(t.map(|t| self.top_entry(t, echo.top, as_id)));
            out.tokens.push(token);
        }
        (out, if as_id { offset } else { limit })
    }

    /// vLLM's `prompt_logprobs` of prompt `ids` with `k` alternatives per position, from the
    /// engine's `scored` entries by position (see [`Delta::prompt`]): `null` for the first
    /// token and any position not reported. Each position lists the prompt token with its
    /// rank, then the top `k` tokens ranked 1 to `k` by their place in the top list (a prompt
    /// token among them is listed once, ranked by that place, as vLLM does).
    fn vllm_prompt_logprobs(
        &self,
        ids: &[u32],
        scored: &[Option<TokenInfo>],
        k: usize,
    ) -> PromptLogprobs {
        let entry = |id: u32, logprob: f32, rank: u32| {
            let decoded_token = self.token_text(id, false).0;
            (
                id,
                PromptLogprob {
                    logprob: reported(logprob),
                    rank,
                    decoded_token,
                },
            )
        };
        (0..ids.len())
            .map(|pos| {
                let t = scored.get(pos)?.as_ref()?;
                let top = &t.top[..k.min(t.top.len())];
                let rank = match top.iter().position(|&(id, _)| id == t.id) {
                    Some(i) => i as u32 + 1,
                    None => t.rank.unwrap_or(0),
                };
                let mut out = Vec::with_capacity(top.len() + 1);
                out.push(entry(t.id, t.logprob, rank));
                out.extend(
                    top.iter()
                        .enumerate()
                        .filter(|(_, &(id, _))| id != t.id)
                        .map(|(i, &(id, lp))| entry(id, lp, i as u32 + 1)),
                );
                Some(PromptPosition(out))
            })
            .collect()
    }

    /// Chat log-probabilities of generated `tokens` (named `token_id:{id}`, with those
    /// strings' bytes, with `as_id`): each token's text, log-probability (floored by
    /// [`reported`]), bytes and alternatives. Also the entries of the Responses API's
    /// `output_text.logprobs`, which have the same shape ([`crate::responses`]).
    pub(crate) fn chat_logprobs(&self, tokens: &[TokenInfo], as_id: bool) -> ChatLogprobs {
        ChatLogprobs {
            content: tokens
                .iter()
                .map(|t| {
                    let (token, bytes) = self.token_text(t.id, as_id);
                    ChatLogprob {
                        token,
                        logprob: reported(t.logprob),
                        bytes,
                        top_logprobs: t
                            .top
                            .iter()
                            .map(|&(id, logprob)| {
                                let (token, bytes) = self.token_text(id, as_id);
                                ChatTopLogprob {
                                    token,
                                    logprob: reported(logprob),
                                    bytes,
                                }
                            })
                            .collect(),
                    }
                })
                .collect(),
        }
    }
}

/// The routes: `/v1/completions`, `/v1/chat/completions`, `/v1/responses`, `/v1/messages`
/// (and `/v1/messages/count_tokens`), `/v1/models`, `/health`, `/version`, `/metrics`,
/// `/tokenize`, `/detokenize`, and SageMaker's `/ping` (as `/health`) and `/invocations`
/// (chat or completions by the body's shape), as vLLM serves them; `--api-key` guards `/v1/*` (as `Authorization: Bearer KEY`,
/// or `x-api-key: KEY` as Anthropic's clients send it);
/// CORS around them all ([`crate::cors`]).
pub fn router(state: Arc<AppState>) -> Router {
    let cors = state.cors.clone();
    let routes = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/responses", post(crate::responses::create))
        .route(
            "/v1/responses/{id}",
            get(crate::responses::retrieve).delete(crate::responses::delete),
        )
        .route(
            "/v1/responses/{id}/input_items",
            get(crate::responses::input_items),
        )
        .route("/v1/messages", post(crate::messages::create))
        .route(
            "/v1/messages/count_tokens",
            post(crate::messages::count_tokens),
        )
        .route("/v1/models", get(models))
        .route("/v1/models/{*model}", get(model_by_id))
        .route("/health", get(health))
        .route("/ping", get(health).post(health))
        .route("/invocations", post(invocations))
        .route("/version", get(version))
        .route("/metrics", get(metrics))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(middleware::from_fn_with_state(
            Arc::clone(&state),
            body_deadline,
        ))
        .layer(middleware::from_fn(json_content_type))
        .layer(middleware::from_fn(openai_error_bodies))
        .layer(middleware::from_fn_with_state(Arc::clone(&state), auth))
        // Outermost: errors on the Anthropic routes, whoever made them, in Anthropic's shape.
        .layer(middleware::from_fn(crate::messages::anthropic_error_bodies))
        .with_state(state);
    // CORS outermost, so a preflight is answered before the API-key check (browsers send no
    // Authorization header on a preflight) and error responses carry the headers too.
    // tower-http answers every OPTIONS request as a preflight, so one without the preflight
    // headers bypasses it and gets the routes' own answer (a 405), as in vLLM.
    let plain = routes.clone();
    routes
        .layer(cors)
        .layer(middleware::from_fn(move |req: Request, next: Next| {
            let plain = plain.clone();
            async move {
                if req.method() == axum::http::Method::OPTIONS
                    && !crate::cors::is_preflight(req.method(), req.headers())
                {
                    use tower::ServiceExt;
                    return match plain.oneshot(req).await {
                        Ok(res) => res,
                        Err(never) => match never {},
                    };
                }
                next.run(req).await
            }
        }))
}

/// The largest request body accepted, in bytes (64 MiB).
pub const MAX_BODY_BYTES: usize = 64 << 20;

/// Reads the whole request body within [`ServerConfig::header_read_timeout`] (a client that
/// sends its headers and then stalls mid-body would otherwise hold the connection forever):
/// 408 when it does not arrive in time, 413 past [`MAX_BODY_BYTES`], both with OpenAI error
/// bodies and `Connection: close`.
async fn body_deadline(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let (parts, body) = req.into_parts();
    let limit = st.config.header_read_timeout;
    // A declared length over the limit is refused at once, without waiting for the body.
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    let read = match declared {
        Some(n) if n > MAX_BODY_BYTES as u64 => None,
        _ => Some(tokio::time::timeout(limit, axum::body::to_bytes(body, MAX_BODY_BYTES)).await),
    };
    let err = match read {
        None => ApiError {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            message: format!(
                "The request body ({} bytes declared) is larger than {MAX_BODY_BYTES} bytes.",
                declared.unwrap_or_default()
            ),
            kind: "invalid_request_error",
            param: None,
        },
        Some(read) => match read {
            Ok(Ok(bytes)) => {
                return next
                    .run(Request::from_parts(parts, Body::from(bytes)))
                    .await
            }
            Ok(Err(e)) if e.to_string().contains("length limit") => ApiError {
                status: StatusCode::PAYLOAD_TOO_LARGE,
                message: format!("The request body is larger than {MAX_BODY_BYTES} bytes."),
                kind: "invalid_request_error",
                param: None,
            },
            Ok(Err(e)) => ApiError {
                status: StatusCode::BAD_REQUEST,
                message: format!("The request body could not be read: {e}."),
                kind: "invalid_request_error",
                param: None,
            },
            Err(_) => ApiError {
                status: StatusCode::REQUEST_TIMEOUT,
                message: format!(
                    "The request body did not arrive within {:.0} s.",
                    limit.as_secs_f64()
                ),
                kind: "invalid_request_error",
                param: None,
            },
        },
    };
    let mut res = err.into_response();
    res.headers_mut().insert(
        header::CONNECTION,
        header::HeaderValue::from_static("close"),
    );
    res
}

/// Refuses a POST whose `Content-Type` is not JSON with a 400, before reading its body, as
/// vLLM's FastAPI routes do: they parse the body as JSON only when the type is
/// `application/json`, an `application/*+json` type, or absent, and a body left unparsed fails
/// validation. (A form or a file upload must not be taken for a request that happens to parse.)
async fn json_content_type(req: Request, next: Next) -> Response {
    if req.method() == axum::http::Method::POST {
        if let Some(v) = req.headers().get(header::CONTENT_TYPE) {
            let ct = v.to_str().unwrap_or("");
            if !is_json_media_type(ct) {
                let shown: String = ct.chars().take(100).collect();
                return ApiError::invalid(
                    None::<String>,
                    format!(
                        "The request body must be JSON (Content-Type: application/json), not \
                         '{shown}'."
                    ),
                )
                .into_response();
            }
        }
    }
    next.run(req).await
}

/// Whether a `Content-Type` value names JSON: `application/json` or `application/<x>+json`,
/// with any parameters (`; charset=utf-8`), case-insensitively.
fn is_json_media_type(ct: &str) -> bool {
    let essence = ct
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    match essence.strip_prefix("application/") {
        Some(sub) => sub == "json" || (sub.ends_with("+json") && !sub.contains('/')),
        None => false,
    }
}

/// Rewrites error responses that axum's extractors produce as plain text (a body over
/// [`MAX_BODY_BYTES`] is a 413, an unreadable body a 400) into OpenAI error bodies, so every
/// error a client sees has the same shape.
async fn openai_error_bodies(req: Request, next: Next) -> Response {
    let res = next.run(req).await;
    let status = res.status();
    let is_json = res
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json") || v.starts_with("text/event-stream"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return res;
    }
    let text = axum::body::to_bytes(res.into_body(), 64 << 10)
        .await
        .map(|b| String::from_utf8_lossy(&b).trim().to_owned())
        .unwrap_or_default();
    let message = if status == StatusCode::PAYLOAD_TOO_LARGE {
        format!("The request body is larger than {MAX_BODY_BYTES} bytes ({text}).")
    } else if text.is_empty() {
        status.canonical_reason().unwrap_or("error").to_owned()
    } else {
        text
    };
    ApiError {
        status,
        message,
        kind: if status.is_server_error() {
            "internal_server_error"
        } else {
            "invalid_request_error"
        },
        param: None,
    }
    .into_response()
}

async fn auth(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if let Some(key) = &st.config.api_key {
        // `/invocations` generates too, so it is guarded like the `/v1` routes.
        let path = req.uri().path();
        if path.starts_with("/v1") || path == "/invocations" {
            let matches = |got: &str| constant_time_eq(got.trim().as_bytes(), key.as_bytes());
            let bearer = req
                .headers()
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                // The scheme is case-insensitive (RFC 7235).
                .and_then(|v| {
                    v.get(..7)
                        .filter(|s| s.eq_ignore_ascii_case("bearer "))
                        .map(|_| &v[7..])
                })
                .is_some_and(matches);
            // Anthropic's SDKs send the key as `x-api-key`.
            let anthropic = req
                .headers()
                .get("x-api-key")
                .and_then(|v| v.to_str().ok())
                .is_some_and(matches);
            let ok = bearer || anthropic;
            if !ok {
                return ApiError::unauthorized().into_response();
            }
        }
    }
    next.run(req).await
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn method_not_allowed(req: Request) -> Response {
    ApiError::method_not_allowed(format!(
        "Method {} is not allowed for {}.",
        req.method(),
        req.uri().path()
    ))
    .into_response()
}

async fn not_found(req: Request) -> Response {
    ApiError::not_found(
        None,
        format!("No route for {} {}.", req.method(), req.uri().path()),
    )
    .into_response()
}

async fn health(State(st): State<Arc<AppState>>) -> Response {
    match st.engine.health() {
        Ok(()) => StatusCode::OK.into_response(),
        Err(reason) => ApiError::unavailable(reason).into_response(),
    }
}

/// `POST /invocations` (vLLM's, for Amazon SageMaker): the request goes where its body's shape
/// says, a chat completion when it has `messages`, a completion when it has `prompt`.
///
/// # Errors
/// 400 for a body that is not a JSON object or has neither field.
async fn invocations(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    let kind = match serde_json::from_slice::<Value>(&body) {
        Ok(Value::Object(o)) if o.contains_key("messages") => "chat",
        Ok(Value::Object(o)) if o.contains_key("prompt") => "completion",
        Ok(Value::Object(_)) => {
            return ApiError::invalid(
                None,
                "/invocations takes a chat completion request (with 'messages') or a \
                 completion request (with 'prompt').",
            )
            .into_response()
        }
        // The endpoints' own parser words the JSON error.
        _ => "completion",
    };
    if kind == "chat" {
        chat_completions(State(st), body).await
    } else {
        completions(State(st), body).await
    }
}

/// `GET /version` (vLLM's): the server's version.
async fn version() -> Response {
    Json(json!({ "version": env!("CARGO_PKG_VERSION") })).into_response()
}

async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    let page = st
        .metrics
        .render(&st.engine.stats(), &st.config.served_model_name);
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        page,
    )
        .into_response()
}

/// The `/v1/models` entry of served name `name` (`root` is the model, as vLLM reports it:
/// [`AppState::with_model_root`]).
fn model_card(st: &AppState, name: &str) -> Value {
    json!({
        "id": name,
        "object": "model",
        "created": st.created,
        "owned_by": "baton",
        "root": st.model_root,
        "parent": null,
        "max_model_len": st.engine.limits().max_model_len,
    })
}

/// The `/v1/models` entry of LoRA adapter `i` (`config.lora_modules[i]`), as vLLM's: its
/// path as `root`, the base model's first served name as `parent`.
fn lora_card(st: &AppState, i: usize) -> Value {
    let (name, path) = &st.config.lora_modules[i];
    json!({
        "id": name,
        "object": "model",
        "created": st.created,
        "owned_by": "baton",
        "root": path,
        "parent": st.config.served_model_name,
        "max_model_len": st.engine.limits().max_model_len,
    })
}

/// `GET /v1/models`: one entry per served name, as vLLM lists them (not the aliases), then
/// one per LoRA adapter.
async fn models(State(st): State<Arc<AppState>>) -> Response {
    let data: Vec<Value> = std::iter::once(&st.config.served_model_name)
        .chain(&st.config.more_served_model_names)
        .map(|name| model_card(&st, name))
        .chain((0..st.config.lora_modules.len()).map(|i| lora_card(&st, i)))
        .collect();
    Json(json!({"object": "list", "data": data})).into_response()
}

/// `GET /v1/models/{model}` (the `openai` client's `models.retrieve`): the card, or a 404.
async fn model_by_id(
    State(st): State<Arc<AppState>>,
    axum::extract::Path(model): axum::extract::Path<String>,
) -> Response {
    match st.check_model(Some(&model)) {
        Ok(lora @ 1..) => Json(lora_card(&st, lora as usize - 1)).into_response(),
        // A served name has its own card; an alias gets the first name's.
        Ok(_) if st.config.more_served_model_names.contains(&model) => {
            Json(model_card(&st, &model)).into_response()
        }
        Ok(_) => Json(model_card(&st, &st.config.served_model_name)).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn tokenize(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    // Tokenizing may take long (no length limit applies here): keep it off the async threads.
    match tokio::task::spawn_blocking(move || tokenize_blocking(&st, &body)).await {
        Ok(r) => r,
        Err(e) => ApiError::internal(format!("tokenizing: {e}")).into_response(),
    }
}

fn tokenize_blocking(st: &AppState, body: &Bytes) -> Response {
    let run = || -> Result<Value, ApiError> {
        let f = Fields::parse(body)?;
        st.check_model(f.get::<String>("model")?.as_deref())?;
        let ids = if f.raw("messages").is_some() {
            let req =
                validate::parse_chat(body, &st.engine.limits(), &st.config.sampling_defaults)?;
            let text = st.render_chat(&req)?;
            st.tokenizer
                .encode(&text, req.add_special_tokens)
                .map_err(|e| ApiError::field("messages", e.to_string()))?
        } else {
            let text = f
                .get::<String>("prompt")?
                .ok_or_else(|| ApiError::field("prompt", "'prompt' (a string) is required."))?;
            let special = f.bool("add_special_tokens")?.unwrap_or(true);
            st.tokenizer
                .encode(&text, special)
                .map_err(|e| ApiError::field("prompt", e.to_string()))?
        };
        let token_strs = if f.bool("return_token_strs")?.unwrap_or(false) {
            json!(ids
                .iter()
                .map(|&id| st.tokenizer.id_to_piece(id).unwrap_or_default())
                .collect::<Vec<_>>())
        } else {
            Value::Null
        };
        Ok(json!({
            "count": ids.len(),
            "max_model_len": st.engine.limits().max_model_len,
            "tokens": ids,
            "token_strs": token_strs,
        }))
    };
    match run() {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn detokenize(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    let run = || -> Result<Value, ApiError> {
        let f = Fields::parse(&body)?;
        st.check_model(f.get::<String>("model")?.as_deref())?;
        let raw = f
            .raw("tokens")
            .ok_or_else(|| ApiError::field("tokens", "'tokens' is required."))?;
        let vocab = st.engine.limits().vocab_size.max(st.tokenizer.vocab_size());
        let ids: Vec<u32> = raw
            .as_array()
            .ok_or_else(|| ApiError::field("tokens", "'tokens' must be a list of token ids."))?
            .iter()
            .map(|t| match validate::json_int(t) {
                Some(id) if id >= 0 && (id as u64) < vocab as u64 => Ok(id as u32),
                _ => Err(ApiError::field(
                    "tokens",
                    format!("Token id {t} is not in the vocabulary of {vocab}."),
                )),
            })
            .collect::<Result<_, _>>()?;
        let text = st
            .tokenizer
            .decode(&ids, true)
            .map_err(|e| ApiError::field("tokens", e.to_string()))?;
        Ok(json!({ "prompt": text }))
    };
    match run() {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

/// A log-probability as responses report it: at least -9999, as vLLM clamps them, so a token
/// the request's masks ruled out (`-inf`, which JSON cannot carry) is a number, not `null`.
fn reported(logprob: f32) -> f32 {
    logprob.max(-9999.0)
}

/// Where a `continue_final_message` prompt ends in `text` (the template's rendering): right
/// after the final message's content `last` (or, if the template trimmed it, `last` trimmed).
/// `marked` is the same rendering with `sentinel` appended to that content: the template
/// writes the same text up to the content in both, so when `sentinel` occurs once in it, the
/// content is looked for only before that point. Otherwise, or when it is not found there,
/// the last occurrence in the whole `text`. `None` when the content is not found.
///
/// A content that is empty once trimmed keeps the whole `text`, as transformers does
/// (`rindex("")` is the length of the rendering, so its cut keeps it all).
fn continue_final_end(
    text: &str,
    marked: Option<&str>,
    sentinel: &str,
    last: &str,
) -> Option<usize> {
    let trimmed = last.trim();
    if trimmed.is_empty() {
        return Some(text.len());
    }
    let find = |hay: &str| {
        hay.rfind(last)
            .map(|i| i + last.len())
            .or_else(|| hay.rfind(trimmed).map(|i| i + trimmed.len()))
    };
    marked
        .filter(|m| m.matches(sentinel).count() == 1)
        .and_then(|m| m.find(sentinel))
        .and_then(|pos| text.get(..pos))
        .and_then(find)
        .or_else(|| find(text))
}

/// SplitMix64's output function (Steele, Lea and Flood, "Fast splittable pseudorandom number
/// generators", OOPSLA 2014): consecutive inputs give unrelated 64-bit outputs.
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn random_id(prefix: &str) -> String {
    format!("{prefix}-{:016x}{:016x}", random_seed(), random_seed())
}

/// Merges the deltas of all sequences, in arrival order.
fn merge(seqs: Vec<Seq>) -> SelectAll<BoxStream<'static, Delta>> {
    stream::select_all(
        seqs.into_iter().map(|s| {
            stream::unfold(s, |mut s| async move { s.next().await.map(|d| (d, s)) }).boxed()
        }),
    )
}

/// Turns deltas into SSE chunk payloads for one endpoint.
trait Chunker: Send + 'static {
    /// Payloads sent before any delta (echoed prompts, the chat role).
    fn prelude(&mut self) -> Vec<String>;
    /// The payloads of a delta (none when there is nothing to send); `usage` is the choice's
    /// usage so far when `continuous_usage_stats` asked for it.
    fn delta(&mut self, d: &Delta, usage: Option<Usage>) -> Vec<String>;
    /// The usage chunk.
    fn usage(&mut self, usage: Usage) -> String;
}

fn sse_data(payload: &str) -> Bytes {
    Bytes::from(format!("data: {payload}\n\n"))
}

/// The SSE response: prelude, one event per delta with content, the usage chunk if asked, then
/// `data: [DONE]`. An engine error ends the stream after one error event.
///
/// `n` is the number of choices per prompt (`usage` counts each prompt's cached tokens once).
/// With `continuous_usage`, every delta chunk also carries its choice's usage so far (its
/// prompt's tokens and the choice's output tokens), as vLLM's `continuous_usage_stats`.
fn sse_response<C: Chunker>(
    mut chunker: C,
    seqs: Vec<Seq>,
    prompt_tokens: usize,
    n: usize,
    include_usage: bool,
    continuous_usage: bool,
) -> Response {
    enum Phase {
        Running,
        Usage,
        Done,
        End,
    }
    struct S<C> {
        chunker: C,
        merged: SelectAll<BoxStream<'static, Delta>>,
        phase: Phase,
        completion_tokens: usize,
        prompt_tokens: usize,
        /// Per choice, from its last delta.
        cached: Vec<usize>,
        n: usize,
        include_usage: bool,
        /// Per choice: prompt tokens and output tokens so far (continuous usage only).
        per_choice: Option<Vec<(usize, usize)>>,
    }
    let prelude: Vec<Result<Bytes, std::convert::Infallible>> =
        chunker.prelude().iter().map(|p| Ok(sse_data(p))).collect();
    let choices = seqs.len();
    let per_choice =
        continuous_usage.then(|| seqs.iter().map(|s| (s.prompt_tokens(), 0)).collect());
    let state = S {
        chunker,
        merged: merge(seqs),
        phase: Phase::Running,
        completion_tokens: 0,
        prompt_tokens,
        cached: vec![0; choices],
        n,
        include_usage,
        per_choice,
    };
    let body = stream::unfold(state, |mut s| async move {
        loop {
            match s.phase {
                Phase::Running => match s.merged.next().await {
                    Some(d) => {
                        s.completion_tokens += d.tokens.len();
                        if let Some(c) = s.cached.get_mut(d.index) {
                            *c = (*c).max(d.cached_tokens);
                        }
                        if let Some(msg) = &d.error {
                            // Dropping the other sequences cancels them.
                            s.merged = SelectAll::new();
                            s.phase = Phase::Done;
                            let err = engine_error(msg.clone()).body();
                            return Some((Ok(sse_data(&err.to_string())), s));
                        }
                        let usage = s.per_choice.as_mut().and_then(|v| {
                            let (prompt, out) = v.get_mut(d.index)?;
                            *out += d.tokens.len();
                            Some(Usage::new(*prompt, *out, 0))
                        });
                        let payloads = s.chunker.delta(&d, usage);
                        if !payloads.is_empty() {
                            let mut out = Vec::new();
                            for p in &payloads {
                                out.extend_from_slice(&sse_data(p));
                            }
                            return Some((Ok(Bytes::from(out)), s));
                        }
                    }
                    None => {
                        s.phase = if s.include_usage {
                            Phase::Usage
                        } else {
                            Phase::Done
                        }
                    }
                },
                Phase::Usage => {
                    s.phase = Phase::Done;
                    let cached = crate::openai::cached_per_prompt(&s.cached, s.n);
                    let u = Usage::new(s.prompt_tokens, s.completion_tokens, cached);
                    let p = s.chunker.usage(u);
                    return Some((Ok(sse_data(&p)), s));
                }
                Phase::Done => {
                    s.phase = Phase::End;
                    return Some((Ok(Bytes::from_static(b"data: [DONE]\n\n")), s));
                }
                Phase::End => return None,
            }
        }
    });
    event_stream(stream::iter(prelude).chain(body))
}

/// A `200 text/event-stream` response (no caching) streaming `body`'s chunks.
pub(crate) fn event_stream<S>(body: S) -> Response
where
    S: futures::Stream<Item = Result<Bytes, std::convert::Infallible>> + Send + 'static,
{
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(body))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// The state of a one-sequence event stream (`/v1/responses`, `/v1/messages`): it turns the
/// sequence's deltas into queued SSE events.
pub(crate) trait DeltaEvents: Send + 'static {
    /// The sequence, until it ends.
    fn seq(&mut self) -> &mut Option<Seq>;
    /// Events ready to send.
    fn pending(&mut self) -> &mut std::collections::VecDeque<Bytes>;
    /// Queues the events of one delta (dropping the sequence after its last).
    fn on_delta(&mut self, d: Delta);
}

/// The SSE response of `s`: its queued events, then those of each delta, until the sequence
/// ends and nothing is queued. A client that goes away drops the body, which drops the
/// sequence, which cancels its engine request.
pub(crate) fn delta_event_stream<S: DeltaEvents>(s: S) -> Response {
    let body = stream::unfold(s, |mut s| async move {
        loop {
            if let Some(b) = s.pending().pop_front() {
                return Some((Ok::<_, std::convert::Infallible>(b), s));
            }
            let d = match s.seq().as_mut() {
                Some(seq) => seq.next().await,
                None => return None,
            };
            match d {
                Some(d) => s.on_delta(d),
                None => *s.seq() = None,
            }
        }
    });
    event_stream(body)
}

/// Per-choice results of a non-streamed request.
#[derive(Default)]
pub(crate) struct Collected {
    pub(crate) text: String,
    pub(crate) tokens: Vec<TokenInfo>,
    /// See [`Delta::prompt`].
    pub(crate) prompt: Option<Vec<Option<TokenInfo>>>,
    pub(crate) finish: Option<&'static str>,
    pub(crate) stop_reason: Option<StopReason>,
    pub(crate) cached_tokens: usize,
}

/// Runs every sequence to its end. Dropping this future (client gone) drops the sequences,
/// which cancels them.
pub(crate) async fn collect(seqs: Vec<Seq>) -> Result<(Vec<Collected>, usize), ApiError> {
    collect_with(seqs, |_| {}).await
}

/// [`collect`], showing each delta to `watch` first.
pub(crate) async fn collect_with(
    seqs: Vec<Seq>,
    mut watch: impl FnMut(&Delta),
) -> Result<(Vec<Collected>, usize), ApiError> {
    let n = seqs.len();
    let mut out: Vec<Collected> = (0..n).map(|_| Collected::default()).collect();
    let mut merged = merge(seqs);
    let mut completion_tokens = 0;
    while let Some(d) = merged.next().await {
        if let Some(msg) = d.error {
            return Err(engine_error(msg));
        }
        watch(&d);
        completion_tokens += d.tokens.len();
        let c = &mut out[d.index % n];
        c.text.push_str(&d.text);
        c.tokens.extend(d.tokens);
        if d.prompt.is_some() {
            c.prompt = d.prompt;
        }
        if d.finish.is_some() {
            c.finish = d.finish;
            c.stop_reason = d.stop_reason;
            c.cached_tokens = d.cached_tokens;
        }
    }
    Ok((out, completion_tokens))
}

/// What every streamed chunk of one response shares.
struct ChunkHead {
    st: Arc<AppState>,
    id: String,
    object: &'static str,
    created: u64,
    logprobs: bool,
    /// Log-probability entries name tokens by id (vLLM's `return_tokens_as_token_ids`).
    tokens_as_ids: bool,
    /// vLLM's `return_token_ids`.
    token_ids: bool,
    /// The `model` every chunk reports ([`AppState::model_name`]).
    model: String,
}

impl ChunkHead {
    /// One SSE data payload.
    fn chunk<C: serde::Serialize>(&self, choices: Vec<C>, usage: Option<Usage>) -> String {
        self.chunk_with_prompt(choices, usage, None)
    }

    /// One SSE data payload with the chat prompt's token ids (`return_token_ids`).
    fn chunk_with_prompt<C: serde::Serialize>(
        &self,
        choices: Vec<C>,
        usage: Option<Usage>,
        prompt_token_ids: Option<Vec<u32>>,
    ) -> String {
        let r = crate::openai::Chunk {
            id: self.id.clone(),
            object: self.object,
            created: self.created,
            model: self.model.clone(),
            choices,
            usage,
            prompt_token_ids,
        };
        serde_json::to_string(&r).unwrap_or_default()
    }

    /// Whether `d` has nothing to send: no text, no finish, and no token whose logprobs or
    /// ids were asked for.
    fn carries_nothing(&self, d: &Delta) -> bool {
        d.text.is_empty()
            && d.finish.is_none()
            && (!(self.logprobs || self.token_ids) || d.tokens.is_empty())
    }

    /// `d`'s token ids, when the request asked for them.
    fn ids(&self, d: &Delta) -> Option<Vec<u32>> {
        self.token_ids
            .then(|| d.tokens.iter().map(|t| t.id).collect())
    }

    /// The usage chunk.
    fn usage(&self, usage: Usage) -> String {
        self.chunk::<()>(Vec::new(), Some(usage))
    }
}

/// Each of `ids`' character offsets in `text`, which `ids` encode (with or without the
/// tokenizer's added tokens): the tokenizer's own alignment of the text's encoding without
/// added tokens, found as a run of `ids`; tokens before it are at 0, after it at the end.
/// `None` if the encoding fails or is not such a run.
fn text_offsets(tok: &baton_model::Tokenizer, text: &str, ids: &[u32]) -> Option<Vec<usize>> {
    let enc = tok.inner().encode_char_offsets(text, false).ok()?;
    let plain = enc.get_ids();
    let k = (0..=ids.len().checked_sub(plain.len())?).find(|&k| ids[k..].starts_with(plain))?;
    let end = text.chars().count();
    Some(
        (0..ids.len())
            .map(|pos| match pos.checked_sub(k) {
                None => 0,
                Some(j) => enc.get_offsets().get(j).map_or(end, |o| o.0),
            })
            .collect(),
    )
}

/// An echoed prompt whose log-probabilities were asked for.
struct EchoPrompt {
    /// The echoed text.
    text: String,
    /// The prompt's token ids, as admitted.
    ids: Vec<u32>,
    /// Whether `text` leaves special tokens out.
    skip_special: bool,
    /// For a text prompt, each token's character offset in `text`, from the tokenizer's own
    /// alignment (a token the tokenizer added, such as BOS, sits where it was added). The
    /// decoded widths do not always add up to the text: a Llama tokenizer encodes the space
    /// after a special token written in the prompt (`<s> upon`) as two tokens. `None` for a
    /// token-id prompt (echoed as its decoding, so its decoded widths are the offsets), or
    /// when the alignment could not be matched to `ids`.
    offsets: Option<Vec<usize>>,
    /// Alternatives per position (the request's `logprobs`).
    top: usize,
}

struct CompletionChunker {
    head: ChunkHead,
    /// Per choice: the echoed prompt sent in the prelude.
    echo: Vec<Option<String>>,
    /// Per choice: the echoed prompt sent with its log-probabilities, in the chunk of the
    /// choice's first delta (which carries them, [`Delta::prompt`]), as vLLM sends it.
    echo_lp: Vec<Option<Arc<EchoPrompt>>>,
    offsets: Vec<usize>,
    /// Per choice, with `return_token_ids`: the prompt's ids, sent in its first chunk.
    prompt_ids: Vec<Option<Vec<u32>>>,
}

impl Chunker for CompletionChunker {
    fn prelude(&mut self) -> Vec<String> {
        let echo = std::mem::take(&mut self.echo);
        echo.into_iter()
            .enumerate()
            .filter_map(|(i, e)| {
                let e = e?;
                self.offsets[i] = e.chars().count();
                let prompt_token_ids = self.prompt_ids.get_mut(i).and_then(Option::take);
                Some(self.head.chunk(
                    vec![CompletionChoice {
                        index: i,
                        text: e,
                        logprobs: None,
                        finish_reason: None,
                        stop_reason: None,
                        prompt_logprobs: None,
                        token_ids: prompt_token_ids.as_ref().map(|_| Vec::new()),
                        prompt_token_ids,
                    }],
                    None,
                ))
            })
            .collect()
    }

    fn delta(&mut self, d: &Delta, usage: Option<Usage>) -> Vec<String> {
        let echo = self.echo_lp.get_mut(d.index).and_then(Option::take);
        if echo.is_none() && self.head.carries_nothing(d) {
            return Vec::new();
        }
        let mut text = String::new();
        let mut logprobs = None;
        if let Some(e) = echo {
            let scored = d.prompt.as_deref().unwrap_or_default();
            let (lp, end) = self
                .head
                .st
                .prompt_logprobs(&e, scored, self.head.tokens_as_ids);
            logprobs = Some(lp);
            self.offsets[d.index] = end;
            text.push_str(&e.text);
        }
        text.push_str(&d.text);
        if self.head.logprobs {
            let out = self.head.st.completion_logprobs(
                &d.tokens,
                &mut self.offsets[d.index],
                self.head.tokens_as_ids,
            );
            logprobs
                .get_or_insert_with(CompletionLogprobs::default)
                .append(out);
        }
        vec![self.head.chunk(
            vec![CompletionChoice {
                index: d.index,
                text,
                logprobs,
                finish_reason: d.finish.map(str::to_owned),
                stop_reason: d.stop_reason.clone(),
                prompt_logprobs: None,
                prompt_token_ids: self.prompt_ids.get_mut(d.index).and_then(Option::take),
                token_ids: self.head.ids(d),
            }],
            usage,
        )]
    }

    fn usage(&mut self, usage: Usage) -> String {
        self.head.usage(usage)
    }
}

async fn completions(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    match completions_inner(st, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn completions_inner(st: Arc<AppState>, body: Bytes) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let limits = st.engine.limits();
    let mut req = validate::parse_completion(&body, &limits, &st.config.sampling_defaults)?;
    req.gen.lora = st.check_model(req.model.as_deref())?;
    let gen = &req.gen;
    let mut prompts = Vec::with_capacity(req.prompts.len());
    let mut echo_texts = Vec::new();
    // Per prompt, with prompt log-probabilities: what their text offsets are measured on.
    let mut echo_lp = Vec::new();
    // With `truncate_prompt_tokens` a text past what `max_model_len` tokens can hold is
    // tokenized and cut rather than refused (the body limit still bounds it).
    let encode_limit = if req.truncate_prompt_tokens.is_some() {
        usize::MAX
    } else {
        limits.max_model_len
    };
    for p in &req.prompts {
        let mut ids = match p {
            PromptInput::Text(s) => {
                st.encode_prompt(s, req.add_special_tokens, "prompt", encode_limit)
                    .await?
            }
            PromptInput::Tokens(t) => t.clone(),
        };
        // A text prompt cut by `truncate_prompt_tokens` is echoed (and scored) as the ids
        // kept, as a token prompt is.
        let as_tokens = validate::truncate_prompt(&mut ids, req.truncate_prompt_tokens)
            || matches!(p, PromptInput::Tokens(_));
        let text = match p {
            PromptInput::Text(s) if !as_tokens => s.clone(),
            _ if req.echo => st
                .tokenizer
                .decode(&ids, gen.skip_special_tokens)
                .map_err(|e| ApiError::field("prompt", e.to_string()))?,
            _ => String::new(),
        };
        let max = validate::resolve_max_tokens(
            &limits,
            ids.len(),
            gen.max_tokens,
            // OpenAI's 16 for the legacy API, or less by the generation config's default.
            Some(
                gen.default_max_tokens
                    .map_or(validate::COMPLETIONS_DEFAULT_MAX_TOKENS, |d| {
                        d.min(validate::COMPLETIONS_DEFAULT_MAX_TOKENS)
                    }),
            ),
            "prompt",
            gen.max_tokens_param,
        )?;
        if let Some(k) = req.echo_logprobs() {
            let offsets = match p {
                PromptInput::Text(s) if !as_tokens => text_offsets(&st.tokenizer, s, &ids),
                _ => None,
            };
            echo_lp.push(Arc::new(EchoPrompt {
                text: text.clone(),
                ids: ids.clone(),
                offsets,
                top: k as usize,
                // A text prompt is echoed as given: its special tokens are the tokenizer's.
                skip_special: !as_tokens || gen.skip_special_tokens,
            }));
        }
        echo_texts.push(text);
        prompts.push((ids, max));
    }
    let prompt_tokens: usize = prompts.iter().map(|(p, _)| p.len()).sum();
    let seqs = st.submit_all(&prompts, gen, arrived)?;
    let id = random_id("cmpl");
    let created = now_secs();
    let n = gen.n;
    let echo_for = |i: usize| req.echo.then(|| echo_texts[i / n].clone());
    let echo_lp_for = |i: usize| echo_lp.get(i / n).cloned();
    if gen.stream {
        let chunker = CompletionChunker {
            head: ChunkHead {
                st: Arc::clone(&st),
                id,
                object: "text_completion",
                created,
                logprobs: gen.logprobs.is_some(),
                tokens_as_ids: st.tokens_as_ids(gen),
                token_ids: gen.return_token_ids,
                model: st.model_name(gen.lora),
            },
            echo: (0..seqs.len())
                .map(|i| {
                    if echo_lp.is_empty() {
                        echo_for(i)
                    } else {
                        None
                    }
                })
                .collect(),
            echo_lp: (0..seqs.len()).map(echo_lp_for).collect(),
            offsets: vec![0; seqs.len()],
            prompt_ids: (0..seqs.len())
                .map(|i| gen.return_token_ids.then(|| prompts[i / n].0.clone()))
                .collect(),
        };
        return Ok(sse_response(
            chunker,
            seqs,
            prompt_tokens,
            n,
            gen.include_usage || st.config.force_include_usage,
            gen.continuous_usage,
        ));
    }
    let (outs, completion_tokens) = collect(seqs).await?;
    let cached: Vec<usize> = outs.iter().map(|c| c.cached_tokens).collect();
    let cached_tokens = crate::openai::cached_per_prompt(&cached, n);
    let choices = outs
        .into_iter()
        .enumerate()
        .map(|(i, c)| {
            let mut text = echo_for(i).unwrap_or_default();
            let mut offset = text.chars().count();
            text.push_str(&c.text);
            let logprobs = gen.logprobs.is_some().then(|| {
                let as_id = st.tokens_as_ids(gen);
                let mut lp = match echo_lp_for(i) {
                    Some(e) => {
                        let scored = c.prompt.as_deref().unwrap_or_default();
                        let (lp, end) = st.prompt_logprobs(&e, scored, as_id);
                        offset = end;
                        lp
                    }
                    None => CompletionLogprobs::default(),
                };
                lp.append(st.completion_logprobs(&c.tokens, &mut offset, as_id));
                lp
            });
            let prompt_logprobs = gen.prompt_top.map(|k| {
                let scored = c.prompt.as_deref().unwrap_or_default();
                st.vllm_prompt_logprobs(&prompts[i / n].0, scored, k as usize)
            });
            CompletionChoice {
                index: i,
                text,
                logprobs,
                finish_reason: c.finish.map(str::to_owned),
                stop_reason: c.stop_reason,
                prompt_logprobs,
                prompt_token_ids: gen.return_token_ids.then(|| prompts[i / n].0.clone()),
                token_ids: gen
                    .return_token_ids
                    .then(|| c.tokens.iter().map(|t| t.id).collect()),
            }
        })
        .collect();
    Ok(Json(CompletionResponse {
        id,
        object: "text_completion",
        created,
        model: st.model_name(gen.lora),
        choices,
        usage: Some(Usage::new(prompt_tokens, completion_tokens, cached_tokens)),
        prompt_token_ids: None,
    })
    .into_response())
}

struct ChatChunker {
    head: ChunkHead,
    choices: usize,
    /// Per choice, with auto tool choice: holds text that may be a tool call.
    filters: Option<Vec<StreamFilter>>,
    /// Per choice, with a reasoning parser: splits the text before the tool filter sees it.
    reasoning: Option<Vec<ReasoningSplitter>>,
    /// Send the reasoning (vLLM's `include_reasoning`).
    include_reasoning: bool,
    /// With `return_token_ids`: the prompt's ids, sent in each choice's first chunk.
    prompt_ids: Option<Vec<u32>>,
    /// vLLM's `echo` ([`validate::ChatRequest::echo_text`]): sent as each choice's first
    /// content, after the role chunk.
    echo: Option<String>,
    /// The role of each choice's first chunk ([`validate::ChatRequest::reply_role`]).
    role: String,
    /// The form of tool call ids: the server's `--tool-call-parser` ([`tool_calls_out`]).
    call_ids: Option<ToolParser>,
}

/// `Some(text)` when `text` is not empty.
fn non_empty(text: String) -> Option<String> {
    (!text.is_empty()).then_some(text)
}

/// A chat delta's `reasoning` and `reasoning_content` fields, set to `text` unless it is empty.
fn reasoning_delta(text: String) -> ChatDelta {
    let text = non_empty(text);
    ChatDelta {
        reasoning_content: text.clone(),
        reasoning: text,
        ..ChatDelta::default()
    }
}

/// The `tool_calls` of a response message, each with a new id of the form of `ids`, the
/// server's `--tool-call-parser` ([`ToolParser::call_id`]: Mistral's templates need theirs
/// for named and required calls too), or vLLM's default form without one.
fn tool_calls_out(calls: Vec<ToolCall>, ids: Option<ToolParser>) -> Vec<ToolCallOut> {
    let ids = ids.unwrap_or(ToolParser::Hermes);
    calls
        .into_iter()
        .map(|c| ToolCallOut {
            id: ids.call_id(random_seed),
            kind: "function",
            function: FunctionCall {
                name: c.name,
                arguments: c.arguments,
            },
        })
        .collect()
}

impl Chunker for ChatChunker {
    fn prelude(&mut self) -> Vec<String> {
        let chunk = |i: usize, delta: ChatDelta| ChatChunkChoice {
            index: i,
            delta,
            logprobs: None,
            finish_reason: None,
            stop_reason: None,
            token_ids: None,
        };
        let mut out: Vec<String> = (0..self.choices)
            .map(|i| {
                let role = ChatDelta {
                    role: Some(self.role.clone()),
                    content: Some(String::new()),
                    ..ChatDelta::default()
                };
                self.head
                    .chunk_with_prompt(vec![chunk(i, role)], None, self.prompt_ids.clone())
            })
            .collect();
        // vLLM sends the echoed content of every choice after the role chunks.
        if let Some(text) = &self.echo {
            out.extend((0..self.choices).map(|i| {
                let delta = ChatDelta {
                    content: Some(text.clone()),
                    ..ChatDelta::default()
                };
                self.head.chunk(vec![chunk(i, delta)], None)
            }));
        }
        out
    }

    fn delta(&mut self, d: &Delta, usage: Option<Usage>) -> Vec<String> {
        // The reasoning parser first: the tool call parser only sees content.
        let Split { reasoning, content } =
            match self.reasoning.as_mut().and_then(|r| r.get_mut(d.index)) {
                None => Split {
                    reasoning: String::new(),
                    content: d.text.clone(),
                },
                Some(r) => {
                    let mut out = r.push(&d.text);
                    if d.finish.is_some() {
                        out.append(r.finish());
                    }
                    out
                }
            };
        let reasoning = if self.include_reasoning {
            reasoning
        } else {
            String::new()
        };
        let (text, calls, end) = match self.filters.as_mut().and_then(|f| f.get_mut(d.index)) {
            None => (content, Vec::new(), d.finish),
            Some(f) => {
                let mut text = f.push(&content);
                let mut calls = Vec::new();
                if d.finish.is_some() {
                    let (rest, c) = f.finish();
                    text.push_str(&rest);
                    calls = c;
                }
                let end = f.mode().finish(!calls.is_empty(), d.finish);
                (text, calls, end)
            }
        };
        let with_logprobs = self.head.logprobs && !d.tokens.is_empty();
        let with_ids = self.head.token_ids && !d.tokens.is_empty();
        if text.is_empty()
            && reasoning.is_empty()
            && d.finish.is_none()
            && !with_logprobs
            && !with_ids
        {
            return Vec::new();
        }
        let logprobs = self.head.logprobs.then(|| {
            self.head
                .st
                .chat_logprobs(&d.tokens, self.head.tokens_as_ids)
        });
        // The delta's ids go in its first chunk (the tool-call chunks after it get `[]`).
        let mut ids = self.head.ids(d);
        let mut choice = |delta, logprobs, finish: Option<&str>| ChatChunkChoice {
            index: d.index,
            delta,
            logprobs,
            finish_reason: finish.map(str::to_owned),
            stop_reason: finish.map(|_| d.stop_reason.clone()),
            token_ids: ids.take().or_else(|| self.head.token_ids.then(Vec::new)),
        };
        if calls.is_empty() {
            let send_empty = d.finish.is_none() && reasoning.is_empty();
            let delta = ChatDelta {
                content: (!text.is_empty() || send_empty).then_some(text),
                ..reasoning_delta(reasoning)
            };
            return vec![self
                .head
                .chunk(vec![choice(delta, logprobs, d.finish)], usage)];
        }
        // The choice's last delta with tool calls: its remaining content (and the log-probs),
        // the calls whole, then the end.
        let mut out = Vec::new();
        if !text.is_empty() || !reasoning.is_empty() || with_logprobs || with_ids {
            let delta = ChatDelta {
                content: (!text.is_empty() || reasoning.is_empty()).then_some(text),
                ..reasoning_delta(reasoning)
            };
            out.push(self.head.chunk(vec![choice(delta, logprobs, None)], usage));
        }
        let calls = tool_calls_out(calls, self.call_ids)
            .into_iter()
            .enumerate()
            .map(|(index, c)| ToolCallDelta {
                index,
                id: c.id,
                kind: c.kind,
                function: c.function,
            })
            .collect();
        let delta = ChatDelta {
            tool_calls: Some(calls),
            ..ChatDelta::default()
        };
        out.push(self.head.chunk(vec![choice(delta, None, None)], usage));
        out.push(
            self.head
                .chunk(vec![choice(ChatDelta::default(), None, end)], usage),
        );
        out
    }

    fn usage(&mut self, usage: Usage) -> String {
        self.head.usage(usage)
    }
}

async fn chat_completions(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    match chat_inner(st, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn chat_inner(st: Arc<AppState>, body: Bytes) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let limits = st.engine.limits();
    let req = validate::parse_chat(&body, &limits, &st.config.sampling_defaults)?;
    let mut gen = req.gen.clone();
    gen.lora = st.check_model(req.model.as_deref())?;
    let parser = st.call_mode(&req.tool_choice, &mut gen)?;
    let reasoning = st.reasoning_parser(&mut gen, &req.template_kwargs);
    let gen = &gen;
    let text = st.render_chat(&req)?;
    let mut ids = st
        .encode_prompt(
            &text,
            req.add_special_tokens,
            "messages",
            // With `truncate_prompt_tokens` a long prompt is cut rather than refused.
            if req.truncate_prompt_tokens.is_some() {
                usize::MAX
            } else {
                limits.max_model_len
            },
        )
        .await?;
    validate::truncate_prompt(&mut ids, req.truncate_prompt_tokens);
    let max = validate::resolve_max_tokens(
        &limits,
        ids.len(),
        gen.max_tokens,
        gen.default_max_tokens,
        "messages",
        gen.max_tokens_param,
    )?;
    let prompt_tokens = ids.len();
    let prompts = [(ids, max)];
    let seqs = st.submit_all(&prompts, gen, arrived)?;
    let id = random_id("chatcmpl");
    let created = now_secs();
    if gen.stream {
        let chunker = ChatChunker {
            head: ChunkHead {
                st: Arc::clone(&st),
                id,
                object: "chat.completion.chunk",
                created,
                logprobs: gen.logprobs.is_some(),
                tokens_as_ids: st.tokens_as_ids(gen),
                token_ids: gen.return_token_ids,
                model: st.model_name(gen.lora),
            },
            choices: seqs.len(),
            call_ids: st.config.tool_call_parser,
            filters: parser.as_ref().map(|p| {
                (0..seqs.len())
                    .map(|_| {
                        StreamFilter::with_tools(p.clone(), req.tools.clone().unwrap_or_default())
                    })
                    .collect()
            }),
            reasoning: reasoning.map(|r| {
                (0..seqs.len())
                    .map(|_| r.splitter(&req.template_kwargs))
                    .collect()
            }),
            include_reasoning: req.include_reasoning,
            prompt_ids: gen.return_token_ids.then(|| prompts[0].0.clone()),
            echo: req.echo_text(),
            role: req.reply_role().to_owned(),
        };
        let n = seqs.len();
        return Ok(sse_response(
            chunker,
            seqs,
            prompt_tokens,
            n,
            gen.include_usage || st.config.force_include_usage,
            gen.continuous_usage,
        ));
    }
    let (outs, completion_tokens) = collect(seqs).await?;
    // One prompt, `n` choices.
    let cached_tokens = outs.iter().map(|c| c.cached_tokens).max().unwrap_or(0);
    // The choices share the prompt: the first sequence's scores (as vLLM).
    let prompt_logprobs = gen.prompt_top.map(|k| {
        let scored = outs.first().and_then(|c| c.prompt.as_deref());
        st.vllm_prompt_logprobs(&prompts[0].0, scored.unwrap_or_default(), k as usize)
    });
    let reasoning_on = reasoning.is_some();
    let choices = outs
        .into_iter()
        .enumerate()
        .map(|(i, c)| {
            // The reasoning parser first: the tool call parser only sees content.
            let (reasoning, text) = match reasoning {
                None => (None, c.text),
                Some(r) => {
                    let split = r.split(&req.template_kwargs, &c.text);
                    (non_empty(split.reasoning), split.content)
                }
            };
            let (content, calls) = match &parser {
                // With a reasoning parser, no content is `null` (as vLLM).
                None if reasoning_on => (non_empty(text), Vec::new()),
                None => (Some(text), Vec::new()),
                Some(p) => {
                    let parsed = p.parse_with(&text, req.tools.as_deref().unwrap_or_default());
                    let content = parsed.content.filter(|c| !reasoning_on || !c.is_empty());
                    (content, parsed.calls)
                }
            };
            let reasoning = reasoning.filter(|_| req.include_reasoning);
            let finish = match &parser {
                Some(p) => p.finish(!calls.is_empty(), c.finish),
                None => c.finish,
            }
            .map(str::to_owned);
            // vLLM's `echo`: the last message's content before the reply's.
            let content = match req.echo_text() {
                Some(e) => Some(e + content.as_deref().unwrap_or_default()),
                None => content,
            };
            ChatChoice {
                index: i,
                message: ChatMessage {
                    role: req.reply_role().to_owned(),
                    content,
                    reasoning_content: reasoning.clone(),
                    reasoning,
                    tool_calls: tool_calls_out(calls, st.config.tool_call_parser),
                },
                logprobs: gen
                    .logprobs
                    .is_some()
                    .then(|| st.chat_logprobs(&c.tokens, st.tokens_as_ids(gen))),
                finish_reason: finish,
                stop_reason: c.stop_reason,
                token_ids: gen
                    .return_token_ids
                    .then(|| c.tokens.iter().map(|t| t.id).collect()),
            }
        })
        .collect();
    Ok(Json(ChatResponse {
        id,
        object: "chat.completion",
        created,
        model: st.model_name(gen.lora),
        choices,
        usage: Usage::new(prompt_tokens, completion_tokens, cached_tokens),
        prompt_logprobs,
        prompt_token_ids: gen.return_token_ids.then(|| prompts[0].0.clone()),
    })
    .into_response())
}

/// Binds `host:port` (port 0: any free port) and returns the listener and the bound address.
///
/// # Errors
/// The address cannot be bound.
pub async fn bind(host: &str, port: u16) -> anyhow::Result<(TcpListener, SocketAddr)> {
    let listener = TcpListener::bind((host, port))
        .await
        .map_err(|e| anyhow::anyhow!("binding {host}:{port}: {e}"))?;
    let addr = listener.local_addr()?;
    Ok((listener, addr))
}

/// The error for a request the engine ended with `msg`: 503 when the server is shutting down
/// or the engine is unavailable (a load balancer retries elsewhere), else 500.
pub(crate) fn engine_error(msg: String) -> ApiError {
    if msg == crate::seq::SHUTTING_DOWN || msg.starts_with(crate::engine::UNAVAILABLE_PREFIX) {
        ApiError::unavailable(msg)
    } else {
        ApiError::internal(msg)
    }
}

/// Completes on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
}

/// Serves on an already-bound listener until SIGINT or SIGTERM.
///
/// # Errors
/// The chat template does not compile, or the server fails.
pub async fn serve_on(
    listener: TcpListener,
    cfg: ServerConfig,
    tokenizer: Tokenizer,
    engine: Arc<dyn EngineClient>,
    eos_ids: Vec<u32>,
) -> anyhow::Result<()> {
    let state = Arc::new(AppState::new(cfg, tokenizer, engine, eos_ids)?);
    serve_state(listener, state, shutdown_signal()).await
}

/// Prompts up to this many bytes are tokenized on the async thread; longer ones on tokio's
/// blocking pool, so one huge prompt cannot stall every stream.
const INLINE_TOKENIZE_BYTES: usize = 16 << 10;

/// The longest piece of `t`'s vocabulary in UTF-8 bytes.
fn tokenizer_max_piece_bytes(t: &Tokenizer) -> usize {
    t.inner()
        .get_vocab(true)
        .keys()
        .map(String::len)
        .max()
        .unwrap_or(1)
}

/// How long live requests may run on after a shutdown signal before their streams end with an
/// error event (`baton serve` kills a frontend that has not exited 5 s after SIGTERM).
pub const DRAIN_GRACE: Duration = Duration::from_secs(3);

/// Serves `state` on `listener` until `shutdown` completes and the live requests are done:
/// those still running [`DRAIN_GRACE`] after it end with an error ("the server is shutting
/// down").
///
/// # Errors
/// The server fails.
pub async fn serve_state(
    listener: TcpListener,
    state: Arc<AppState>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, model = %state.config.served_model_name, "serving the OpenAI API");
    }
    let draining = state.draining.clone();
    let signal = async move {
        shutdown.await;
        tracing::info!(
            grace_s = DRAIN_GRACE.as_secs_f64(),
            "shutting down: no new connections; live streams get a grace period"
        );
        tokio::spawn(async move {
            tokio::time::sleep(DRAIN_GRACE).await;
            let _ = draining.send(true);
        });
    };
    let header_timeout = state.config.header_read_timeout;
    let app = router(state);
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut signal = std::pin::pin!(signal);
    loop {
        let (tcp, _) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(c) => c,
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!("accepting a connection: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut signal => break,
        };
        // TCP_NODELAY: each SSE event is a small write; with Nagle on, a write waits for the
        // ACK of the previous one and the client's delayed ACK turns that into 40 ms stalls
        // (measured with `baton bench serve`, bench/RESULTS.md).
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::warn!("setting TCP_NODELAY on a connection: {e}");
        }
        let svc = hyper_util::service::TowerToHyperService::new(app.clone());
        let conn = hyper::server::conn::http1::Builder::new()
            .timer(hyper_util::rt::TokioTimer::new())
            .header_read_timeout(header_timeout)
            .serve_connection(hyper_util::rt::TokioIo::new(tcp), svc);
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!("connection: {e}");
            }
        });
    }
    // No new connections; finish the live requests (each connection closes after its current
    // response), the drain grace ending the longest ones.
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

/// Binds `cfg.host:cfg.port` and serves until SIGINT or SIGTERM.
///
/// # Errors
/// The address cannot be bound, the chat template does not compile, or the server fails.
pub async fn serve(
    cfg: ServerConfig,
    tokenizer: Tokenizer,
    engine: Arc<dyn EngineClient>,
    eos_ids: Vec<u32>,
) -> anyhow::Result<()> {
    let (listener, _) = bind(&cfg.host, cfg.port).await?;
    serve_on(listener, cfg, tokenizer, engine, eos_ids).await
}

/// The vocabulary of `tokenizer` for structured outputs over `vocab_size` logits, ending on
/// `eos_ids`.
fn grammar_vocabulary(
    tokenizer: &Tokenizer,
    vocab_size: usize,
    eos_ids: &[u32],
) -> Result<baton_grammar::Vocabulary, String> {
    let text = tokenizer
        .inner()
        .to_string(false)
        .map_err(|e| e.to_string())?;
    let json: Value = serde_json::from_str(&text).map_err(|e| e.to_string())?;
    baton_grammar::Vocabulary::from_tokenizer_value(&json, vocab_size, eos_ids)
}

#[cfg(test)]
mod tests {
    use super::continue_final_end;

    /// Renders `[INST] q [/INST] {content.strip()} </s>` as the Llama-2 template does.
    fn llama2(content: &str) -> String {
        format!("<s>[INST] q [/INST] {} </s>", content.trim())
    }

    #[test]
    fn continue_final_message_is_cut_before_the_sentinel() {
        const S: &str = "\u{E000}x\u{E001}";
        let cut = |content: &str| {
            let text = llama2(content);
            let marked = llama2(&format!("{content}{S}"));
            continue_final_end(&text, Some(&marked), S, content).map(|e| text[..e].to_owned())
        };
        // The last "s" of the rendering is in `</s>`; the message's is before it.
        assert_eq!(cut("s").as_deref(), Some("<s>[INST] q [/INST] s"));
        assert_eq!(cut("INST").as_deref(), Some("<s>[INST] q [/INST] INST"));
        // Where the content is not ambiguous, as the last occurrence (the fallback) cuts.
        for content in ["Once upon", "Once upon ", " Once", "a b"] {
            let text = llama2(content);
            let old = continue_final_end(&text, None, S, content);
            assert!(old.is_some(), "{content:?}");
            assert_eq!(
                cut(content),
                old.map(|e| text[..e].to_owned()),
                "{content:?}"
            );
        }
        // A template that drops the sentinel, or writes it twice: the last occurrence.
        let text = llama2("s");
        let last_s = text.rfind('s').unwrap() + 1;
        assert_eq!(continue_final_end(&text, Some(&text), S, "s"), Some(last_s));
        let twice = format!("{S}{}", llama2(&format!("s{S}")));
        assert_eq!(
            continue_final_end(&text, Some(&twice), S, "s"),
            Some(last_s)
        );
        // Content empty once trimmed keeps the whole rendering (transformers' `rindex("")`);
        // content the rendering does not contain cannot be continued.
        for content in ["", " "] {
            assert_eq!(
                continue_final_end(&text, Some(&text), S, content),
                Some(text.len()),
                "{content:?}"
            );
        }
        assert_eq!(continue_final_end(&text, Some(&text), S, "zebra"), None);
    }
}
