//! Request parsing and validation: every bad request becomes an [`ApiError`] (4xx, OpenAI body,
//! the field at fault in `param`) before anything reaches the engine or a stream starts.
//!
//! Contract: bodies are parsed field by field from a JSON object, so a wrong type names its
//! field; unknown fields are ignored (as vLLM and OpenAI do), but fields that ask for something
//! Baton does not implement (beam search, tools outside chat completions) are
//! refused rather than
//! silently ignored. Length limits come from [`EngineLimits`], the values the scheduler enforces.

use crate::engine::EngineLimits;
use crate::openai::ApiError;
use baton_grammar::{Constraint, MAX_CONSTRAINT_BYTES};
use baton_proto::{MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS};
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

/// Most choices one request may ask for.
pub const MAX_N: usize = 128;

/// Most sequences one request may create (prompts times `n`; OpenAI takes up to 2048 prompts
/// in one request), so a small body cannot hold the server with hundreds of thousands of
/// sequences.
pub const MAX_SEQUENCES_PER_REQUEST: usize = 2048;

/// The JSON object of a request body, read field by field.
#[derive(Debug)]
pub struct Fields {
    obj: Map<String, Value>,
}

impl Fields {
    /// Parses `body` as a JSON object.
    ///
    /// # Errors
    /// 400 when the body is not JSON or not an object.
    pub fn parse(body: &[u8]) -> Result<Self, ApiError> {
        let v: Value = serde_json::from_slice(body).map_err(|e| {
            // serde_json's words for a lone UTF-16 surrogate (`"\ud800"`, which Python's
            // parser lets through) name the escape's end, not the fault.
            let why = if e.to_string().contains("hex escape") {
                " (a \\uD800-\\uDFFF escape must be half of a UTF-16 surrogate pair; alone it \
                 is not a Unicode character)"
            } else {
                ""
            };
            ApiError::invalid(
                None,
                format!("The request body is not valid JSON: {e}{why}"),
            )
        })?;
        match v {
            Value::Object(obj) => Ok(Self { obj }),
            _ => Err(ApiError::invalid(
                None,
                "The request body must be a JSON object.",
            )),
        }
    }

    /// The raw value of `name`; `None` when absent or null.
    pub fn raw(&self, name: &str) -> Option<&Value> {
        self.obj.get(name).filter(|v| !v.is_null())
    }

    /// `name` as a `T`; `None` when absent or null.
    ///
    /// # Errors
    /// 400 naming `name` when the value has the wrong type.
    pub fn get<T: DeserializeOwned>(&self, name: &str) -> Result<Option<T>, ApiError> {
        match self.raw(name) {
            None => Ok(None),
            Some(v) => T::deserialize(v)
                .map(Some)
                .map_err(|e| ApiError::field(name, format!("Invalid value for '{name}': {e}."))),
        }
    }

    /// `name` as an integer; `None` when absent or null. As pydantic's lax mode (vLLM's
    /// request models): an integer-valued float such as `2.0` or `-0` is that integer, and
    /// so is a string holding an integer (`"8"`, surrounding whitespace ignored).
    ///
    /// # Errors
    /// 400 naming `name` for anything else (`2.5`, `"2.5"`, `"x"`, past the i64 range).
    fn int(&self, name: &str) -> Result<Option<i64>, ApiError> {
        match self.raw(name) {
            None => Ok(None),
            Some(v) => lax_int(v).map(Some).ok_or_else(|| {
                let what = if is_integral(v) {
                    "an integer within ±9223372036854775807"
                } else {
                    "an integer"
                };
                ApiError::field(
                    name,
                    format!("Invalid value for '{name}': expected {what}, got {v}."),
                )
            }),
        }
    }

    /// `name` as a number; `None` when absent or null. As pydantic's lax mode, a string
    /// holding a finite number (`"0.5"`, `"1e-3"`) is that number.
    ///
    /// # Errors
    /// 400 naming `name` for anything else.
    fn float(&self, name: &str) -> Result<Option<f64>, ApiError> {
        match self.raw(name) {
            None => Ok(None),
            Some(v) => lax_float(v).map(Some).ok_or_else(|| {
                ApiError::field(
                    name,
                    format!("Invalid value for '{name}': expected a number, got {v}."),
                )
            }),
        }
    }

    /// `name` as a boolean; `None` when absent or null. As pydantic's lax mode: `0` and `1`
    /// (`0.0`, `1.0`), and the strings `0`, `off`, `f`, `false`, `n`, `no`, `1`, `on`, `t`,
    /// `true`, `y`, `yes` in any case.
    ///
    /// # Errors
    /// 400 naming `name` for anything else.
    pub fn bool(&self, name: &str) -> Result<Option<bool>, ApiError> {
        match self.raw(name) {
            None => Ok(None),
            Some(v) => lax_bool(v).map(Some).ok_or_else(|| {
                ApiError::field(
                    name,
                    format!("Invalid value for '{name}': expected a boolean, got {v}."),
                )
            }),
        }
    }
}

/// `x` for an error message, as Python writes a float: with an exponent when it is at least
/// 1e16 or below 1e-4 (`1e308`, not its 309 digits), else in plain digits.
fn shown(x: f64) -> String {
    if x != 0.0 && x.is_finite() && !(1e-4..1e16).contains(&x.abs()) {
        format!("{x:e}")
    } else {
        format!("{x}")
    }
}

/// [`json_int`], or a string holding a decimal integer (whitespace around it ignored), as
/// pydantic's lax mode reads an `int` field.
fn lax_int(v: &Value) -> Option<i64> {
    json_int(v).or_else(|| v.as_str()?.trim().parse().ok())
}

/// Whether `v` is a whole number (a JSON number or a numeric string) that [`lax_int`] refuses
/// only for its size (`1e30`, `2**70`): its error says so rather than "expected an integer".
fn is_integral(v: &Value) -> bool {
    lax_float(v).is_some_and(|x| x.fract() == 0.0)
}

/// A JSON number, or a string holding a finite number, as pydantic's lax mode reads a `float`
/// field (the finite check keeps `"nan"` and `"inf"` out of the range checks).
fn lax_float(v: &Value) -> Option<f64> {
    v.as_f64().or_else(|| {
        v.as_str()?
            .trim()
            .parse::<f64>()
            .ok()
            .filter(|x| x.is_finite())
    })
}

/// A JSON boolean, `0`/`1`, or one of pydantic's boolean strings (any case), as pydantic's
/// lax mode reads a `bool` field.
fn lax_bool(v: &Value) -> Option<bool> {
    match v {
        Value::Bool(b) => Some(*b),
        Value::Number(n) => match n.as_f64() {
            Some(0.0) => Some(false),
            Some(1.0) => Some(true),
            _ => None,
        },
        Value::String(s) => match s.to_ascii_lowercase().as_str() {
            "0" | "off" | "f" | "false" | "n" | "no" => Some(false),
            "1" | "on" | "t" | "true" | "y" | "yes" => Some(true),
            _ => None,
        },
        _ => None,
    }
}

/// A JSON number as an integer, as pydantic's lax mode reads an `int` field: an integer, or a
/// float with no fractional part (`2.0`, `-0`, `1e3`) within the i64 range; `None` otherwise.
pub(crate) fn json_int(v: &Value) -> Option<i64> {
    // 2^63 as an f64: the first float past i64::MAX (which is not representable).
    const LIMIT: f64 = 9_223_372_036_854_775_808.0;
    v.as_i64().or_else(|| {
        v.as_f64()
            .filter(|x| x.fract() == 0.0 && *x >= -LIMIT && *x < LIMIT)
            .map(|x| x as i64)
    })
}

/// Sampling values a request gets for the fields it leaves out (or sets to `null`), as vLLM's
/// `--generation-config auto` (its default) takes them from the model's
/// `generation_config.json`: `temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty`,
/// and `max_new_tokens` as `max_tokens` (vLLM's `get_diff_sampling_param`). `None` keeps the
/// OpenAI default (1, 1, off, 0, 1, the rest of the context). A request's own value always
/// wins. Checked at start-up by [`check_sampling_defaults`].
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SamplingDefaults {
    /// Default `temperature`.
    pub temperature: Option<f64>,
    /// Default `top_p`.
    pub top_p: Option<f64>,
    /// Default `top_k` (0 or -1: off).
    pub top_k: Option<i64>,
    /// Default `min_p`.
    pub min_p: Option<f64>,
    /// Default `repetition_penalty`.
    pub repetition_penalty: Option<f64>,
    /// Default `max_tokens` (`max_completion_tokens`, `max_output_tokens`).
    pub max_tokens: Option<u32>,
}

// The values come from JSON, which has no NaN, and are checked at start-up.
impl Eq for SamplingDefaults {}

impl SamplingDefaults {
    /// No defaults: every field keeps the OpenAI default.
    pub const NONE: SamplingDefaults = SamplingDefaults {
        temperature: None,
        top_p: None,
        top_k: None,
        min_p: None,
        repetition_penalty: None,
        max_tokens: None,
    };

    /// The defaults as a JSON object of request fields (what [`check_sampling_defaults`]
    /// parses, and what the frontend logs at start-up).
    pub fn to_json(&self) -> Map<String, Value> {
        let mut m = Map::new();
        let mut put = |k: &str, v: Option<Value>| {
            if let Some(v) = v {
                m.insert(k.to_owned(), v);
            }
        };
        put("temperature", self.temperature.map(Value::from));
        put("top_p", self.top_p.map(Value::from));
        put("top_k", self.top_k.map(Value::from));
        put("min_p", self.min_p.map(Value::from));
        put(
            "repetition_penalty",
            self.repetition_penalty.map(Value::from),
        );
        put("max_tokens", self.max_tokens.map(Value::from));
        m
    }
}

/// Checks `d` as if a request had sent its values.
///
/// # Errors
/// The 400 such a request would get, naming the field.
pub fn check_sampling_defaults(d: &SamplingDefaults) -> Result<(), ApiError> {
    let limits = EngineLimits {
        max_model_len: usize::MAX,
        vocab_size: usize::MAX,
        max_num_seqs: 1,
        priority_scheduling: false,
    };
    parse_gen(
        &Fields { obj: d.to_json() },
        true,
        &limits,
        &SamplingDefaults::NONE,
    )
    .map(|_| ())
}

/// A prompt as the client gave it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PromptInput {
    /// Text to tokenize.
    Text(String),
    /// Token ids.
    Tokens(Vec<u32>),
}

/// Generation options shared by completions and chat.
#[derive(Clone, Debug, PartialEq)]
pub struct GenParams {
    /// Most new tokens; `None`: up to the model's maximum length.
    pub max_tokens: Option<u32>,
    /// The field `max_tokens` came from (`max_tokens` or `max_completion_tokens`), for errors.
    pub max_tokens_param: &'static str,
    /// The generation config's `max_new_tokens` ([`SamplingDefaults::max_tokens`]): when the
    /// request leaves `max_tokens` out, the output stops there or at the end of the context,
    /// whichever comes first (vLLM's `get_max_tokens`).
    pub default_max_tokens: Option<u32>,
    /// Softmax temperature (0: greedy).
    pub temperature: f32,
    /// Nucleus mass in (0, 1].
    pub top_p: f32,
    /// Top-k; `<= 0` disables.
    pub top_k: i32,
    /// Min-p in [0, 1].
    pub min_p: f32,
    /// OpenAI presence penalty in [-2, 2] (0: none).
    pub presence_penalty: f32,
    /// OpenAI frequency penalty in [-2, 2] (0: none).
    pub frequency_penalty: f32,
    /// vLLM repetition penalty, `> 0` (1: none).
    pub repetition_penalty: f32,
    /// OpenAI `logit_bias`, `(token, bias)` ascending by token, biases clamped to
    /// [-100, 100] (vLLM's clamp). With `allowed_only`, exactly the allowed tokens, each with
    /// its bias or 0.
    pub logit_bias: Vec<(u32, f32)>,
    /// vLLM's `allowed_token_ids` was given: only the tokens of `logit_bias` may be sampled.
    pub allowed_only: bool,
    /// vLLM's `min_tokens`: neither stop ids nor stop strings end the sequence before this
    /// many output tokens.
    pub min_tokens: u32,
    /// vLLM's `cache_salt`, hashed to a non-zero u64 (0: none); see [`salt_hash`].
    pub cache_salt: u64,
    /// The LoRA adapter the request's `model` names (0: the base model), set by the handler
    /// from `AppState::check_model`.
    pub lora: u32,
    /// vLLM's `priority` (lower runs earlier; default 0), accepted non-zero only when the
    /// scheduler runs the priority policy ([`EngineLimits::priority_scheduling`]).
    pub priority: i32,
    /// Seed of the first choice (`seed + j` for choice `j`); random when `None`.
    pub seed: Option<u64>,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Extra stop token ids.
    pub stop_token_ids: Vec<u32>,
    /// Keep generating past EOS.
    pub ignore_eos: bool,
    /// Choices per prompt.
    pub n: usize,
    /// `Some(k)`: return each sampled token's log-probability and `k` alternatives.
    pub logprobs: Option<u32>,
    /// `baton_proto::SamplingParams::prompt_logprobs`: 0, or `1 + k` where `k` is the most top
    /// alternatives either asker wants: vLLM's `prompt_logprobs` ([`GenParams::prompt_top`])
    /// and, on `/v1/completions`, `echo` with `logprobs: k` (the echoed prompt's
    /// log-probabilities).
    pub prompt_logprobs: u32,
    /// vLLM's `prompt_logprobs: k` (0..=[`MAX_TOP_LOGPROBS`]; `None` when absent or null): the
    /// response lists, per prompt position, the prompt token and the `k` most likely tokens
    /// with their log-probabilities and ranks. Never set with `stream` (vLLM refuses it).
    pub prompt_top: Option<u32>,
    /// Stream server-sent events.
    pub stream: bool,
    /// Add a usage chunk at the end of the stream.
    pub include_usage: bool,
    /// Also put the choice's usage so far on every chunk (vLLM's
    /// `stream_options.continuous_usage_stats`, honoured with `include_usage`).
    pub continuous_usage: bool,
    /// Keep the matched stop string in the output.
    pub include_stop_str_in_output: bool,
    /// Drop special tokens from the text.
    pub skip_special_tokens: bool,
    /// Structured output (`response_format` or vLLM's `structured_outputs` / `guided_*`), with
    /// the field it came from for errors; compiled by the server against the model's
    /// vocabulary.
    pub constraint: Option<(Constraint, &'static str)>,
    /// The constraint applies only after this token is sampled: the id of `</think>` when a
    /// reasoning parser lets the model reason first (set by the server, never by a request).
    pub guide_after: Option<u32>,
    /// vLLM's `return_token_ids`: responses carry the prompt's token ids and each choice's
    /// generated ids (`prompt_token_ids`, `token_ids`).
    pub return_token_ids: bool,
    /// vLLM's `return_tokens_as_token_ids`: log-probability entries name their tokens as
    /// `token_id:{id}` instead of their text; `None`: the server's
    /// `--return-tokens-as-token-ids` decides.
    pub return_tokens_as_token_ids: Option<bool>,
    /// vLLM's `bad_words`: words never generated, each non-blank, together at most
    /// [`MAX_BAD_WORDS_BYTES`] bytes; the server tokenizes them (`bad_words_token_ids` in
    /// `server.rs`).
    pub bad_words: Vec<String>,
}

/// The most bytes of text all of a request's `bad_words` may have together.
pub const MAX_BAD_WORDS_BYTES: usize = 64 * 1024;

/// Parses vLLM's `bad_words`: a list of non-blank strings (absent or null: none).
fn parse_bad_words(f: &Fields) -> Result<Vec<String>, ApiError> {
    const P: &str = "bad_words";
    let words = f.get::<Vec<String>>(P)?.unwrap_or_default();
    if words.iter().any(|w| w.trim().is_empty()) {
        return Err(ApiError::field(
            P,
            "'bad_words' must not contain a blank word.",
        ));
    }
    let bytes: usize = words.iter().map(String::len).sum();
    if bytes > MAX_BAD_WORDS_BYTES {
        return Err(ApiError::field(
            P,
            format!(
                "'bad_words' may have at most {MAX_BAD_WORDS_BYTES} bytes of text, got {bytes}."
            ),
        ));
    }
    Ok(words)
}

/// vLLM's `bad_words` as token sequences: each word with its leading whitespace removed
/// (`encode` it, without special tokens), then, when the tokenizer starts the word
/// differently after a space but in as many tokens, the word after a space too, so it is
/// banned both at the start of the text and after a space (vLLM's
/// `SamplingParams.update_from_tokenizer`).
///
/// # Errors
/// 400 naming `bad_words` when a word does not tokenize or encodes to no token, a token is
/// outside the model's `vocab_size`, or the sequences take more than
/// [`baton_proto::wire::MAX_BAD_WORDS_WORDS`] words on the wire (one per sequence plus its
/// tokens).
pub fn bad_words_token_ids(
    words: &[String],
    vocab_size: usize,
    encode: impl Fn(&str) -> Result<Vec<u32>, String>,
) -> Result<Vec<Vec<u32>>, ApiError> {
    const P: &str = "bad_words";
    let encode = |text: &str| encode(text).map_err(|e| ApiError::field(P, e));
    let mut out: Vec<Vec<u32>> = Vec::with_capacity(words.len());
    for word in words {
        let bare = word.trim_start();
        let plain = encode(bare)?;
        if plain.is_empty() {
            return Err(ApiError::field(
                P,
                format!("The bad word {word:?} encodes to no token."),
            ));
        }
        let spaced = encode(&format!(" {bare}"))?;
        let new_start = spaced.first() != plain.first() && spaced.len() == plain.len();
        out.push(plain);
        if new_start {
            out.push(spaced);
        }
    }
    if let Some(&id) = out.iter().flatten().find(|&&id| id as usize >= vocab_size) {
        return Err(ApiError::field(
            P,
            format!(
                "A bad word encodes to token id {id}, outside this model's vocabulary of \
                 {vocab_size} tokens."
            ),
        ));
    }
    let wire: usize = out.iter().map(|w| 1 + w.len()).sum();
    if wire > baton_proto::wire::MAX_BAD_WORDS_WORDS {
        return Err(ApiError::field(
            P,
            format!(
                "'bad_words' encode to {} token sequences of {} tokens in all; this server \
                 takes at most {} tokens and sequences together.",
                out.len(),
                wire - out.len(),
                baton_proto::wire::MAX_BAD_WORDS_WORDS
            ),
        ));
    }
    Ok(out)
}

/// Reads the request's structured-output constraint: OpenAI's `response_format`
/// (`json_object`, `json_schema`), vLLM's `structured_outputs` object (`json`, `regex`,
/// `choice`, `grammar`, `json_object`) or its older `guided_json`, `guided_regex`,
/// `guided_choice` and `guided_grammar`. At most one may be given; null or
/// `{"type": "text"}` means none.
///
/// # Errors
/// A malformed value, an unknown kind, or two constraints.
pub fn parse_constraint(f: &Fields) -> Result<Option<(Constraint, &'static str)>, ApiError> {
    let mut found: Vec<(Constraint, &'static str, String)> = Vec::new();
    let string = |name: &'static str, v: &Value| -> Result<String, ApiError> {
        v.as_str()
            .map(str::to_owned)
            .ok_or_else(|| ApiError::field(name, format!("'{name}' must be a string.")))
    };
    let choices = |name: &'static str, v: &Value| -> Result<Constraint, ApiError> {
        let list = v
            .as_array()
            .and_then(|a| a.iter().map(|c| c.as_str().map(str::to_owned)).collect())
            .ok_or_else(|| ApiError::field(name, format!("'{name}' must be a list of strings.")))?;
        Ok(Constraint::Choice(list))
    };
    let schema = |name: &'static str, v: &Value| -> Result<Constraint, ApiError> {
        match v {
            Value::Object(_) | Value::Bool(_) => Ok(Constraint::Json(v.clone())),
            Value::String(s) => serde_json::from_str(s)
                .map(Constraint::Json)
                .map_err(|e| ApiError::field(name, format!("'{name}' is not valid JSON: {e}."))),
            _ => Err(ApiError::field(
                name,
                format!("'{name}' must be a JSON schema (an object, or a string holding one)."),
            )),
        }
    };
    const RF: &str = "response_format";
    match f.raw(RF) {
        None | Some(Value::Null) => {}
        Some(v) => match v.get("type").and_then(Value::as_str) {
            Some("text") => {}
            Some("json_object") => found.push((Constraint::JsonObject, RF, RF.into())),
            Some("json_schema") => {
                let Some(s) = v.get("json_schema").and_then(|j| j.get("schema")) else {
                    return Err(ApiError::field(
                        RF,
                        "response_format of type 'json_schema' needs 'json_schema.schema'.",
                    ));
                };
                found.push((schema(RF, s)?, RF, RF.into()));
            }
            _ => {
                return Err(ApiError::field(
                    RF,
                    "response_format 'type' must be 'text', 'json_object' or 'json_schema'.",
                ))
            }
        },
    }
    for name in [
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
    ] {
        let Some(v) = f.raw(name).filter(|v| !v.is_null()) else {
            continue;
        };
        let c = match name {
            "guided_json" => schema(name, v)?,
            "guided_regex" => Constraint::Regex(string(name, v)?),
            "guided_choice" => choices(name, v)?,
            _ => Constraint::Grammar(string(name, v)?),
        };
        found.push((c, name, name.into()));
    }
    const SO: &str = "structured_outputs";
    if let Some(so) = f.raw(SO).filter(|v| !v.is_null()) {
        let Some(o) = so.as_object() else {
            return Err(ApiError::field(
                SO,
                "'structured_outputs' must be an object.",
            ));
        };
        for (k, v) in o {
            if v.is_null() {
                continue;
            }
            let c = match k.as_str() {
                "json" => schema(SO, v)?,
                "regex" => Constraint::Regex(string(SO, v)?),
                "choice" => choices(SO, v)?,
                "grammar" => Constraint::Grammar(string(SO, v)?),
                "json_object" => match v {
                    Value::Bool(true) => Constraint::JsonObject,
                    Value::Bool(false) => continue,
                    _ => {
                        return Err(ApiError::field(
                            SO,
                            "'structured_outputs.json_object' must be true or false.",
                        ))
                    }
                },
                // Options, read below.
                "disable_any_whitespace"
                | "whitespace_pattern"
                | "backend"
                | "disable_fallback"
                | "disable_additional_properties" => continue,
                _ => {
                    return Err(ApiError::field(
                        SO,
                        format!(
                            "'structured_outputs.{k}' is not supported by this server \
                             (json, regex, choice, grammar and json_object are)."
                        ),
                    ))
                }
            };
            found.push((c, SO, format!("{SO}.{k}")));
        }
    }
    let so = f.raw(SO).and_then(Value::as_object);
    let opt = |k: &str| so.and_then(|o| o.get(k)).filter(|v| !v.is_null());
    // vLLM's backend choice: every backend it names serves the same constraints; this server
    // always uses llguidance.
    for (name, v) in [
        ("structured_outputs", opt("backend")),
        ("guided_decoding_backend", f.raw("guided_decoding_backend")),
    ] {
        let Some(v) = v.filter(|v| !v.is_null()) else {
            continue;
        };
        let known = [
            "auto",
            "guidance",
            "llguidance",
            "xgrammar",
            "outlines",
            "lm-format-enforcer",
        ];
        if !v.as_str().is_some_and(|b| known.contains(&b)) {
            return Err(ApiError::field(
                name,
                format!("Unknown structured-output backend {v}; this server uses llguidance (one of {known:?} is accepted)."),
            ));
        }
    }
    // JSON layout options (vLLM's): free whitespace when `disable_any_whitespace` is false,
    // or whitespace matching a pattern; the default is the compact layout (see baton-grammar).
    let mut layout = Map::new();
    match opt("disable_any_whitespace") {
        None | Some(Value::Bool(true)) => {}
        Some(Value::Bool(false)) => {
            layout.insert("whitespace_flexible".into(), Value::Bool(true));
        }
        Some(_) => {
            return Err(ApiError::field(
                SO,
                "'structured_outputs.disable_any_whitespace' must be a boolean.",
            ))
        }
    }
    for (name, v) in [
        ("structured_outputs", opt("whitespace_pattern")),
        (
            "guided_whitespace_pattern",
            f.raw("guided_whitespace_pattern"),
        ),
    ] {
        match v {
            None | Some(Value::Null) => {}
            Some(Value::String(p)) => {
                layout.insert("whitespace_pattern".into(), Value::String(p.clone()));
            }
            Some(_) => {
                return Err(ApiError::field(
                    name,
                    "The whitespace pattern must be a string.",
                ))
            }
        }
    }
    if !layout.is_empty() {
        for (c, _, _) in &mut found {
            if matches!(c, Constraint::JsonObject) {
                *c = Constraint::Json(serde_json::json!({"type": "object"}));
            }
            if let Constraint::Json(Value::Object(schema)) = c {
                let x = schema
                    .entry("x-guidance")
                    .or_insert_with(|| Value::Object(Map::new()));
                if let Some(x) = x.as_object_mut() {
                    for (k, v) in &layout {
                        x.entry(k.clone()).or_insert_with(|| v.clone());
                    }
                }
            }
        }
    }
    if found.len() > 1 {
        return Err(ApiError::field(
            found[1].1,
            format!(
                "Only one structured-output constraint may be given ('{}' and '{}').",
                found[0].2, found[1].2
            ),
        ));
    }
    let c = found.pop().map(|(c, name, _)| (c, name));
    if let Some((c, name)) = &c {
        if c.to_wire().len() > MAX_CONSTRAINT_BYTES {
            return Err(ApiError::field(
                name,
                format!("The constraint is larger than {MAX_CONSTRAINT_BYTES} bytes."),
            ));
        }
    }
    Ok(c)
}

/// A parsed `/v1/completions` request.
#[derive(Clone, Debug, PartialEq)]
pub struct CompletionRequest {
    /// The `model` field, if given.
    pub model: Option<String>,
    /// One or more prompts.
    pub prompts: Vec<PromptInput>,
    /// Prepend the prompt to the text.
    pub echo: bool,
    /// Let the tokenizer add its special tokens (BOS) to text prompts (default true).
    pub add_special_tokens: bool,
    /// vLLM's `truncate_prompt_tokens`, resolved: keep only the last this many tokens of each
    /// prompt (see [`parse_truncate_prompt_tokens`]).
    pub truncate_prompt_tokens: Option<usize>,
    /// Generation options.
    pub gen: GenParams,
}

impl CompletionRequest {
    /// `Some(k)` for `echo` with `logprobs: k`: the echoed prompt gets log-probabilities with
    /// `k` alternatives in the legacy `logprobs` object.
    pub fn echo_logprobs(&self) -> Option<u32> {
        self.gen.logprobs.filter(|_| self.echo)
    }
}

/// A parsed `/v1/chat/completions` request.
#[derive(Clone, Debug, PartialEq)]
pub struct ChatRequest {
    /// The `model` field, if given.
    pub model: Option<String>,
    /// Messages as the template sees them (`content` flattened to a string).
    pub messages: Vec<Value>,
    /// Render the assistant prefix (default true).
    pub add_generation_prompt: bool,
    /// Leave the final message open, so the model continues it (vLLM's and transformers'
    /// `continue_final_message`): the rendered prompt ends right after its content (a content
    /// empty once trimmed keeps the whole rendering, as transformers does).
    pub continue_final_message: bool,
    /// Let the tokenizer add its special tokens (BOS) to the rendered prompt (default false:
    /// the template writes them).
    pub add_special_tokens: bool,
    /// vLLM's `truncate_prompt_tokens`, resolved: keep only the last this many tokens of the
    /// rendered prompt (see [`parse_truncate_prompt_tokens`]).
    pub truncate_prompt_tokens: Option<usize>,
    /// Extra template variables (`chat_template_kwargs`, less the keys it may set on the
    /// request itself: see `parse_template_kwargs`).
    pub template_kwargs: Map<String, Value>,
    /// vLLM's `include_reasoning` (default true): with a reasoning parser, `false` leaves the
    /// reasoning out of the response.
    pub include_reasoning: bool,
    /// The request's `tools` as given (each `{"type": "function", "function": {...}}`), for
    /// the template's `tools`; `None` when absent or empty.
    pub tools: Option<Vec<Value>>,
    /// `tool_choice`, resolved as vLLM does: `auto` when absent and `tools` are given, else
    /// `none`.
    pub tool_choice: ToolChoice,
    /// vLLM's `echo` on chat: the reply's content starts with the last message's content when
    /// that message has the reply's role (see [`ChatRequest::echo_text`]).
    pub echo: bool,
    /// Generation options.
    pub gen: GenParams,
}

impl ChatRequest {
    /// The role the reply reports, in the non-streamed message and the first streamed delta
    /// (vLLM's `get_chat_request_role`): `assistant` with `add_generation_prompt`, else the
    /// last message's own role (the reply continues that message: `user` when a user message
    /// comes last). `assistant` when there is no last message or it has no string role.
    pub fn reply_role(&self) -> &str {
        let last = self.messages.last().and_then(|m| m["role"].as_str());
        match last {
            Some(role) if !self.add_generation_prompt => role,
            _ => "assistant",
        }
    }

    /// What `echo` puts before each choice's content: the last message's content when the
    /// reply continues that message's role (see [`ChatRequest::reply_role`]), else nothing.
    /// `None` without `echo` or when there is nothing to echo.
    pub fn echo_text(&self) -> Option<String> {
        if !self.echo {
            return None;
        }
        let last = self.messages.last()?;
        let same_role = last["role"] == self.reply_role();
        let text = last["content"].as_str().unwrap_or_default();
        (same_role && !text.is_empty()).then(|| text.to_owned())
    }
}

/// A chat request's `tool_choice`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolChoice {
    /// The model's output is not parsed for tool calls (the tools still reach the template,
    /// vLLM's default).
    None,
    /// The tool call parser decides whether the output is tool calls.
    Auto,
    /// The output is a JSON list of one or more calls of the tools, guided by a schema built
    /// from their parameters (vLLM's; no tool call parser needed).
    Required,
    /// The output is the arguments of this function, guided by its parameters' schema.
    Named(String),
}

/// OpenAI chat fields that ask for a different kind of answer than this server gives (audio,
/// web search results, a legacy function call, another verbosity): a 400 naming the field,
/// so a client never takes plain text for what it asked for. vLLM ignores them with a logged
/// warning. `prediction` (predicted outputs) only hints at latency and is accepted.
fn refuse_unsupported_chat(f: &Fields) -> Result<(), ApiError> {
    let given = |name: &str| f.raw(name).filter(|v| !v.is_null());
    if let Some(m) = given("modalities") {
        let text_only = m
            .as_array()
            .is_some_and(|a| a.iter().all(|x| x.as_str() == Some("text")));
        if !text_only {
            return Err(ApiError::field(
                "modalities",
                "Only the \"text\" output modality is supported by this server.",
            ));
        }
    }
    for (name, what) in [
        ("audio", "Audio output"),
        ("web_search_options", "Web search"),
        ("verbosity", "Output verbosity"),
    ] {
        if given(name).is_some() {
            return Err(ApiError::field(
                name,
                format!("{what} ('{name}') is not supported by this server."),
            ));
        }
    }
    if given("functions").is_some_and(|v| v.as_array().is_none_or(|a| !a.is_empty())) {
        return Err(ApiError::field(
            "functions",
            "The deprecated 'functions' are not supported by this server; send them as \
             'tools' ({\"type\": \"function\", \"function\": {...}}).",
        ));
    }
    if given("function_call").is_some_and(|v| v.as_str() != Some("none")) {
        return Err(ApiError::field(
            "function_call",
            "The deprecated 'function_call' is not supported by this server; use \
             'tool_choice' with 'tools'.",
        ));
    }
    Ok(())
}

fn refuse_unsupported(f: &Fields) -> Result<(), ApiError> {
    if f.bool("use_beam_search")? == Some(true) {
        return Err(ApiError::field(
            "use_beam_search",
            "Beam search is not supported by this server.",
        ));
    }
    if let Some(v) = f.raw("tools") {
        if v.as_array().is_none_or(|a| !a.is_empty()) {
            return Err(ApiError::field(
                "tools",
                "Tool calling is served on /v1/chat/completions and /v1/responses, not here.",
            ));
        }
    }
    // vLLM's extra parameters that would change the output: refused rather than ignored
    // (a client must not get plausible text that silently broke its constraint).
    for name in ["logits_processors", "prompt_embeds", "documents"] {
        if f.raw(name).is_some() {
            return Err(ApiError::field(
                name,
                format!("'{name}' is not supported by this server."),
            ));
        }
    }
    // Served on /v1/chat/completions (`parse_chat` takes it out before calling here); the
    // other endpoints have no chat template (vLLM's completions request has no such field).
    if f.raw("chat_template_kwargs")
        .is_some_and(|v| v.as_object().is_none_or(|o| !o.is_empty()))
    {
        return Err(ApiError::field(
            "chat_template_kwargs",
            "'chat_template_kwargs' is only accepted on /v1/chat/completions by this server.",
        ));
    }
    if f.raw("chat_template").is_some() {
        return Err(ApiError::field(
            "chat_template",
            "A per-request 'chat_template' is not accepted by this server; it uses the one it \
             was started with (--chat-template).",
        ));
    }
    Ok(())
}

/// The most stop strings one request may give (OpenAI takes 4, vLLM any number). Each
/// stop string is looked for in every sequence's output after every token, so the list's
/// size multiplies the frontend's work per token (see [`MAX_STOP_BYTES`]).
pub const MAX_STOP_STRINGS: usize = 1024;

/// The most bytes a request's stop strings may have together.
pub const MAX_STOP_BYTES: usize = 64 * 1024;

/// Parses `stop`: a string or a list of strings, at most [`MAX_STOP_STRINGS`] of them and
/// [`MAX_STOP_BYTES`] bytes together (absent or null: none).
fn parse_stop(f: &Fields) -> Result<Vec<String>, ApiError> {
    let shape = || ApiError::field("stop", "'stop' must be a string or a list of strings.");
    let stops = match f.raw("stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => {
            if items.len() > MAX_STOP_STRINGS {
                return Err(ApiError::field(
                    "stop",
                    format!(
                        "'stop' has {} strings; at most {MAX_STOP_STRINGS} are accepted.",
                        items.len()
                    ),
                ));
            }
            items
                .iter()
                .map(|v| v.as_str().map(str::to_owned).ok_or_else(shape))
                .collect::<Result<_, _>>()?
        }
        Some(_) => return Err(shape()),
    };
    let bytes: usize = stops.iter().map(String::len).sum();
    if bytes > MAX_STOP_BYTES {
        return Err(ApiError::field(
            "stop",
            format!("'stop' has {bytes} bytes of text; at most {MAX_STOP_BYTES} are accepted."),
        ));
    }
    Ok(stops)
}

fn parse_token_ids(v: &Value, param: &str, vocab: usize) -> Result<Vec<u32>, ApiError> {
    let items = v
        .as_array()
        .ok_or_else(|| ApiError::field(param, format!("'{param}' must be a list of token ids.")))?;
    items
        .iter()
        .map(|t| {
            let id = json_int(t).ok_or_else(|| {
                ApiError::field(
                    param,
                    format!("'{param}' must contain integer token ids, got {t}."),
                )
            })?;
            if id < 0 || id as u64 >= vocab as u64 {
                return Err(ApiError::field(
                    param,
                    format!("Token id {id} is out of range for a vocabulary of {vocab}."),
                ));
            }
            Ok(id as u32)
        })
        .collect()
}

/// Parses the options shared by both endpoints. `chat` selects the chat forms of
/// `max_completion_tokens` and `logprobs`/`top_logprobs`.
///
/// # Errors
/// 400 naming the field at fault.
pub fn parse_gen(
    f: &Fields,
    chat: bool,
    limits: &EngineLimits,
    defaults: &SamplingDefaults,
) -> Result<GenParams, ApiError> {
    refuse_unsupported(f)?;
    // Accepted and unused (OpenAI's end-user id), but it must be a string.
    let _user: Option<String> = f.get("user")?;
    let (max_tokens_param, max_tokens) = {
        let (name, v) = match (chat, f.int("max_completion_tokens")?) {
            (true, Some(v)) => ("max_completion_tokens", Some(v)),
            _ => ("max_tokens", f.int("max_tokens")?),
        };
        // 0 only on /v1/completions, where `parse_completion` requires `echo` with it.
        let least = i64::from(chat);
        match v {
            None => (name, None),
            Some(v) if v < least => {
                let with_echo = if chat { "" } else { " (or 0 with 'echo')" };
                return Err(ApiError::field(
                    name,
                    format!("'{name}' must be at least 1{with_echo}, got {v}."),
                ));
            }
            Some(v) => match u32::try_from(v) {
                Ok(v) => (name, Some(v)),
                // No model's context is this long; say the number sent, not a clamped one.
                Err(_) => {
                    return Err(ApiError::field(
                        name,
                        format!("'{name}' must be at most {}, got {v}.", u32::MAX),
                    ))
                }
            },
        }
    };
    let temperature = f
        .float("temperature")?
        .or(defaults.temperature)
        .unwrap_or(1.0);
    // Checked as the f32 the sampler uses too: 1e39 would become +inf, 1 / temperature 0, and
    // every weight exp((x - max) * 0) (NaN for a -inf logit).
    if !(temperature.is_finite() && (temperature as f32).is_finite()) || temperature < 0.0 {
        return Err(ApiError::field(
            "temperature",
            format!(
                "'temperature' must be at least 0 and at most {:e} (f32's largest), got {}.",
                f32::MAX,
                shown(temperature)
            ),
        ));
    }
    let top_p = f.float("top_p")?.or(defaults.top_p).unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::field(
            "top_p",
            format!("'top_p' must be in (0, 1], got {}.", shown(top_p)),
        ));
    }
    let top_k = f.int("top_k")?.or(defaults.top_k).unwrap_or(0);
    if top_k < -1 {
        return Err(ApiError::field(
            "top_k",
            format!("'top_k' must be -1 (disabled), 0 (disabled) or at least 1, got {top_k}."),
        ));
    }
    let min_p = f.float("min_p")?.or(defaults.min_p).unwrap_or(0.0);
    if !(0.0..=1.0).contains(&min_p) {
        return Err(ApiError::field(
            "min_p",
            format!("'min_p' must be in [0, 1], got {}.", shown(min_p)),
        ));
    }
    let penalty = |name: &'static str| -> Result<f32, ApiError> {
        let v = f.float(name)?.unwrap_or(0.0);
        if !(-2.0..=2.0).contains(&v) {
            return Err(ApiError::field(
                name,
                format!("'{name}' must be in [-2, 2], got {}.", shown(v)),
            ));
        }
        Ok(v as f32)
    };
    let presence_penalty = penalty("presence_penalty")?;
    let frequency_penalty = penalty("frequency_penalty")?;
    let repetition_penalty = f
        .float("repetition_penalty")?
        .or(defaults.repetition_penalty)
        .unwrap_or(1.0);
    // Checked as the f32 the sampler uses (1e-300 would become 0, which means "off").
    if !(repetition_penalty as f32 > 0.0 && (repetition_penalty as f32).is_finite()) {
        return Err(ApiError::field(
            "repetition_penalty",
            format!(
                "'repetition_penalty' must be greater than 0, got {}.",
                shown(repetition_penalty)
            ),
        ));
    }
    let min_tokens = match f.int("min_tokens")? {
        None => 0,
        Some(n) if n < 0 => {
            return Err(ApiError::field(
                "min_tokens",
                format!("'min_tokens' must be at least 0, got {n}."),
            ))
        }
        Some(n) => {
            let n = u32::try_from(n).map_err(|_| {
                ApiError::field(
                    "min_tokens",
                    format!("'min_tokens' must be at most {}, got {n}.", u32::MAX),
                )
            })?;
            if let Some(m) = max_tokens.filter(|&m| n > m) {
                return Err(ApiError::field(
                    "min_tokens",
                    format!("'min_tokens' must be at most {max_tokens_param}={m}, got {n}."),
                ));
            }
            n
        }
    };
    let seed = match f.raw("seed") {
        None => None,
        Some(v) => Some(
            v.as_u64()
                .or_else(|| json_int(v).map(|s| s as u64))
                .ok_or_else(|| {
                    ApiError::field("seed", format!("'seed' must be an integer, got {v}."))
                })?,
        ),
    };
    let n = f.int("n")?.unwrap_or(1);
    if n < 1 || n as usize > MAX_N {
        return Err(ApiError::field(
            "n",
            format!("'n' must be between 1 and {MAX_N}, got {n}."),
        ));
    }
    let n = n as usize;
    if let Some(best_of) = f.int("best_of")? {
        if best_of != n as i64 {
            return Err(ApiError::field(
                "best_of",
                "'best_of' other than n is not supported by this server.",
            ));
        }
    }
    let logprobs = if chat {
        let want = f.bool("logprobs")?.unwrap_or(false);
        let top = f.int("top_logprobs")?;
        match top {
            Some(k) if k < 0 || k as usize > MAX_TOP_LOGPROBS => {
                return Err(ApiError::field(
                    "top_logprobs",
                    format!("'top_logprobs' must be between 0 and {MAX_TOP_LOGPROBS}, got {k}."),
                ))
            }
            Some(k) if k > 0 && !want => {
                return Err(ApiError::field(
                    "top_logprobs",
                    "When using 'top_logprobs', 'logprobs' must be set to true.",
                ))
            }
            _ => {}
        }
        want.then_some(top.unwrap_or(0) as u32)
    } else {
        // The legacy API has no `top_logprobs` (its `logprobs` is the count); say so rather
        // than ignore it (`null` is absent).
        if f.raw("top_logprobs").is_some() {
            return Err(ApiError::field(
                "top_logprobs",
                "'top_logprobs' is a chat completions parameter; on /v1/completions, \
                 'logprobs' is the number of top log-probabilities.",
            ));
        }
        match f.raw("logprobs") {
            None => None,
            Some(Value::Bool(_)) => {
                return Err(ApiError::field(
                    "logprobs",
                    "'logprobs' must be an integer (the number of top log-probabilities).",
                ))
            }
            Some(_) => {
                let k = f.int("logprobs")?.unwrap_or(0);
                if k < 0 || k as usize > MAX_TOP_LOGPROBS {
                    return Err(ApiError::field(
                        "logprobs",
                        format!("'logprobs' must be between 0 and {MAX_TOP_LOGPROBS}, got {k}."),
                    ));
                }
                Some(k as u32)
            }
        }
    };
    let stream = f.bool("stream")?.unwrap_or(false);
    let mut continuous_usage = false;
    let include_usage = match f.raw("stream_options") {
        None => false,
        Some(v) => {
            if !stream {
                return Err(ApiError::field(
                    "stream_options",
                    "'stream_options' can only be set when 'stream' is true.",
                ));
            }
            let o = v.as_object().ok_or_else(|| {
                ApiError::field("stream_options", "'stream_options' must be an object.")
            })?;
            continuous_usage = match o.get("continuous_usage_stats") {
                None | Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(_) => {
                    return Err(ApiError::field(
                        "stream_options",
                        "'stream_options.continuous_usage_stats' must be a boolean.",
                    ))
                }
            };
            match o.get("include_usage") {
                None | Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(_) => {
                    return Err(ApiError::field(
                        "stream_options",
                        "'stream_options.include_usage' must be a boolean.",
                    ))
                }
            }
        }
    };
    // vLLM: per-chunk usage only together with the final usage chunk.
    let continuous_usage = continuous_usage && include_usage;
    let prompt_top = parse_prompt_top(f, stream)?;
    let stop_token_ids = match f.raw("stop_token_ids") {
        None => Vec::new(),
        Some(v) => parse_token_ids(v, "stop_token_ids", limits.vocab_size)?,
    };
    let (logit_bias, allowed_only) = parse_bias_and_allowed(f, limits.vocab_size)?;
    let constraint = parse_constraint(f)?;
    if let Some((_, name)) = &constraint {
        let clash = if min_tokens > 0 {
            Some("min_tokens")
        } else if allowed_only {
            Some("allowed_token_ids")
        } else {
            None
        };
        if let Some(other) = clash {
            return Err(ApiError::field(
                name,
                format!("A structured output cannot be combined with '{other}' on this server."),
            ));
        }
    }
    Ok(GenParams {
        max_tokens,
        max_tokens_param,
        default_max_tokens: defaults.max_tokens,
        temperature: temperature as f32,
        top_p: top_p as f32,
        top_k: top_k as i32,
        min_p: min_p as f32,
        presence_penalty,
        frequency_penalty,
        repetition_penalty: repetition_penalty as f32,
        logit_bias,
        allowed_only,
        min_tokens,
        priority: parse_priority(f, limits)?,
        lora: 0,
        cache_salt: match f.get::<String>("cache_salt")? {
            None => 0,
            Some(s) if s.is_empty() => {
                return Err(ApiError::field(
                    "cache_salt",
                    "'cache_salt' must be a non-empty string if provided.",
                ))
            }
            Some(s) => salt_hash(&s),
        },
        seed,
        stop: parse_stop(f)?,
        stop_token_ids,
        ignore_eos: f.bool("ignore_eos")?.unwrap_or(false),
        n,
        logprobs,
        prompt_logprobs: prompt_top.map_or(0, |k| k + 1),
        prompt_top,
        stream,
        include_usage,
        continuous_usage,
        include_stop_str_in_output: f.bool("include_stop_str_in_output")?.unwrap_or(false),
        skip_special_tokens: f.bool("skip_special_tokens")?.unwrap_or(true),
        constraint,
        guide_after: None,
        return_token_ids: f.bool("return_token_ids")?.unwrap_or(false),
        return_tokens_as_token_ids: f.bool("return_tokens_as_token_ids")?,
        bad_words: parse_bad_words(f)?,
    })
}

/// Parses vLLM's `prompt_logprobs` (absent or null: `None`): an integer in
/// 0..=[`MAX_TOP_LOGPROBS`], refused with `stream` as vLLM refuses it.
fn parse_prompt_top(f: &Fields, stream: bool) -> Result<Option<u32>, ApiError> {
    const P: &str = "prompt_logprobs";
    let Some(k) = f.int(P)? else {
        return Ok(None);
    };
    if k < 0 || k as usize > MAX_TOP_LOGPROBS {
        let whole = if k == -1 {
            " (-1, the whole vocabulary, is not supported by this server)"
        } else {
            ""
        };
        return Err(ApiError::field(
            P,
            format!("'{P}' must be between 0 and {MAX_TOP_LOGPROBS}, got {k}{whole}."),
        ));
    }
    if stream {
        return Err(ApiError::field(
            P,
            "'prompt_logprobs' are not available when 'stream' is true.",
        ));
    }
    Ok(Some(k as u32))
}

/// Reads vLLM's `priority`: an integer that fits in an i32, 0 unless the scheduler runs the
/// priority policy (vLLM's message for that case).
///
/// # Errors
/// 400 naming `priority`.
fn parse_priority(f: &Fields, limits: &EngineLimits) -> Result<i32, ApiError> {
    let Some(p) = f.int("priority")? else {
        return Ok(0);
    };
    let p = i32::try_from(p).map_err(|_| {
        ApiError::field(
            "priority",
            format!("'priority' must be between {} and {}.", i32::MIN, i32::MAX),
        )
    })?;
    if p != 0 && !limits.priority_scheduling {
        return Err(ApiError::field(
            "priority",
            format!(
                "Got priority {p} but Priority scheduling is not enabled (start the server with \
                 --scheduling-policy priority)."
            ),
        ));
    }
    Ok(p)
}

/// The 64-bit hash of a `cache_salt` the scheduler mixes into prefix-cache keys: the same in
/// every process of one build (SipHash-1-3 with fixed keys), never 0 (which means no salt).
pub fn salt_hash(salt: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::hash::DefaultHasher::new();
    salt.hash(&mut h);
    h.finish().max(1)
}

/// Parses vLLM's `allowed_token_ids` (absent or null: `None`): a non-empty list of token ids in
/// the vocabulary, at most [`MAX_LOGIT_BIAS`] distinct ones; returned sorted and distinct.
fn parse_allowed_token_ids(f: &Fields, vocab_size: usize) -> Result<Option<Vec<u32>>, ApiError> {
    const P: &str = "allowed_token_ids";
    let v = match f.raw(P) {
        None | Some(Value::Null) => return Ok(None),
        Some(v) => v,
    };
    let mut ids = parse_token_ids(v, P, vocab_size)?;
    ids.sort_unstable();
    ids.dedup();
    if ids.is_empty() {
        return Err(ApiError::field(
            P,
            "'allowed_token_ids' must list at least one token id.",
        ));
    }
    if ids.len() > MAX_LOGIT_BIAS {
        return Err(ApiError::field(
            P,
            format!(
                "'allowed_token_ids' has {} distinct ids; this server accepts at most \
                 {MAX_LOGIT_BIAS}.",
                ids.len()
            ),
        ));
    }
    Ok(Some(ids))
}

/// The request's logit-bias entries and whether they are an allow-list: `logit_bias` alone,
/// or, with `allowed_token_ids`, each allowed token with its `logit_bias` entry or 0 (a bias
/// on a token outside the list is moot: that token cannot be sampled).
fn parse_bias_and_allowed(
    f: &Fields,
    vocab_size: usize,
) -> Result<(Vec<(u32, f32)>, bool), ApiError> {
    let bias = parse_logit_bias(f, vocab_size)?;
    Ok(match parse_allowed_token_ids(f, vocab_size)? {
        None => (bias, false),
        Some(ids) => {
            let of = |t: u32| {
                bias.binary_search_by_key(&t, |e| e.0)
                    .map_or(0.0, |i| bias[i].1)
            };
            (ids.into_iter().map(|t| (t, of(t))).collect(), true)
        }
    })
}

/// Parses `logit_bias`: an object (or null) from token ids, written as decimal strings, to
/// numbers. Biases are clamped to [-100, 100] as vLLM does; ids must be in the vocabulary.
fn parse_logit_bias(f: &Fields, vocab_size: usize) -> Result<Vec<(u32, f32)>, ApiError> {
    let bad = |m: String| ApiError::field("logit_bias", m);
    let obj = match f.raw("logit_bias") {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Object(o)) => o,
        Some(v) => return Err(bad(format!("'logit_bias' must be an object, got {v}."))),
    };
    if obj.len() > MAX_LOGIT_BIAS {
        return Err(bad(format!(
            "'logit_bias' has {} entries; this server accepts at most {MAX_LOGIT_BIAS}.",
            obj.len()
        )));
    }
    let mut out = Vec::with_capacity(obj.len());
    for (k, v) in obj {
        let id: u32 = k.trim().parse().map_err(|_| {
            bad(format!(
                "'logit_bias' keys must be token ids (integers as strings), got {k:?}."
            ))
        })?;
        if id as usize >= vocab_size {
            return Err(bad(format!(
                "'logit_bias' names token {id}, outside the vocabulary of {vocab_size}."
            )));
        }
        let b = v.as_f64().ok_or_else(|| {
            bad(format!(
                "'logit_bias' values must be numbers, got {v} for token {id}."
            ))
        })?;
        out.push((id, b.clamp(-100.0, 100.0) as f32));
    }
    out.sort_by_key(|e| e.0);
    out.dedup_by_key(|e| e.0);
    Ok(out)
}

/// Parses vLLM's `truncate_prompt_tokens` (completions and chat): absent or null is no
/// truncation; `k >= 1` keeps the last `k` prompt tokens (left truncation, after tokenization
/// and, on chat, after the chat template); `-1` truncates to `max_model_len`. As in vLLM, 0 and
/// values below -1 are refused, and so is a `k` past `max_model_len`. Returns the number of
/// tokens to keep.
///
/// # Errors
/// 400 naming `truncate_prompt_tokens`.
pub fn parse_truncate_prompt_tokens(
    f: &Fields,
    limits: &EngineLimits,
) -> Result<Option<usize>, ApiError> {
    const P: &str = "truncate_prompt_tokens";
    let Some(k) = f.int(P)? else {
        return Ok(None);
    };
    let max = limits.max_model_len;
    match k {
        -1 => Ok(Some(max)),
        k if k < 1 => Err(ApiError::field(
            P,
            format!("'{P}' must be an integer >= 1 or -1, got {k}."),
        )),
        k if k as u64 > max as u64 => Err(ApiError::field(
            P,
            format!(
                "{P} value ({k}) is greater than max_model_len ({max}). Please, select a \
                 smaller truncation size."
            ),
        )),
        k => Ok(Some(k as usize)),
    }
}

/// Applies a resolved `truncate_prompt_tokens`: keeps the last `keep` ids of `ids` (all of
/// them when there are no more). Returns whether any were cut.
pub fn truncate_prompt(ids: &mut Vec<u32>, keep: Option<usize>) -> bool {
    match keep {
        Some(k) if ids.len() > k => {
            ids.drain(..ids.len() - k);
            true
        }
        _ => false,
    }
}

/// Parses the `prompt` field of a completions request.
///
/// # Errors
/// 400 when it is missing, an empty list, of the wrong shape, or holds an out-of-range token
/// id. An empty string is accepted here, as vLLM and OpenAI accept it: it is refused later only
/// if it tokenizes to nothing (with `add_special_tokens`, a Llama tokenizer gives it a BOS).
pub fn parse_prompts(f: &Fields, limits: &EngineLimits) -> Result<Vec<PromptInput>, ApiError> {
    let shape = "'prompt' must be a string, a list of strings, a list of token ids or a list of \
                 lists of token ids.";
    let v = f
        .raw("prompt")
        .ok_or_else(|| ApiError::field("prompt", "'prompt' is required."))?;
    let empty = || ApiError::field("prompt", "The prompt cannot be empty.");
    let prompts = match v {
        Value::String(s) => vec![PromptInput::Text(s.clone())],
        Value::Array(items) if items.is_empty() => return Err(empty()),
        Value::Array(items) if items.iter().all(Value::is_string) => items
            .iter()
            .map(|s| PromptInput::Text(s.as_str().unwrap_or_default().to_owned()))
            .collect(),
        Value::Array(items) if items.iter().all(Value::is_number) => {
            vec![PromptInput::Tokens(parse_token_ids(
                v,
                "prompt",
                limits.vocab_size,
            )?)]
        }
        Value::Array(items) if items.iter().all(Value::is_array) => items
            .iter()
            .map(|p| parse_token_ids(p, "prompt", limits.vocab_size).map(PromptInput::Tokens))
            .collect::<Result<_, _>>()?,
        _ => return Err(ApiError::field("prompt", shape)),
    };
    if prompts
        .iter()
        .any(|p| matches!(p, PromptInput::Tokens(t) if t.is_empty()))
    {
        return Err(empty());
    }
    Ok(prompts)
}

/// Parses a `/v1/completions` body.
///
/// # Errors
/// 400 naming the field at fault.
pub fn parse_completion(
    body: &[u8],
    limits: &EngineLimits,
    defaults: &SamplingDefaults,
) -> Result<CompletionRequest, ApiError> {
    let f = Fields::parse(body)?;
    let model = f.get::<String>("model")?;
    let prompts = parse_prompts(&f, limits)?;
    let mut gen = parse_gen(&f, false, limits, defaults)?;
    let seqs = prompts.len().saturating_mul(gen.n);
    if seqs > MAX_SEQUENCES_PER_REQUEST {
        return Err(ApiError::field(
            "prompt",
            format!(
                "{} prompts times n = {} make {seqs} sequences; one request may make at most \
                 {MAX_SEQUENCES_PER_REQUEST}.",
                prompts.len(),
                gen.n
            ),
        ));
    }
    let echo = f.bool("echo")?.unwrap_or(false);
    if gen.max_tokens == Some(0) && !echo {
        return Err(ApiError::field(
            gen.max_tokens_param,
            "'max_tokens' must be at least 1, got 0 (0 is accepted with 'echo', to return the \
             prompt, and its log-probabilities with 'logprobs', without generating).",
        ));
    }
    if echo {
        // The echoed prompt gets log-probabilities too, with as many alternatives as the
        // outputs ('logprobs' is already bounded by MAX_TOP_LOGPROBS); the engine computes
        // as many as the larger of that and 'prompt_logprobs' asks for.
        let echo_lp = gen.logprobs.map_or(0, |k| k + 1);
        gen.prompt_logprobs = gen.prompt_logprobs.max(echo_lp);
    }
    if let Some(s) = f.get::<String>("suffix")? {
        if !s.is_empty() {
            return Err(ApiError::field(
                "suffix",
                "'suffix' is not supported by this server.",
            ));
        }
    }
    Ok(CompletionRequest {
        model,
        prompts,
        echo,
        add_special_tokens: f.bool("add_special_tokens")?.unwrap_or(true),
        truncate_prompt_tokens: parse_truncate_prompt_tokens(&f, limits)?,
        gen,
    })
}

/// Flattens a message's `content` (a string, a list of text parts, or, for an `assistant`
/// message, null or absent) to a string.
fn flatten_content(i: usize, assistant: bool, content: Option<&Value>) -> Result<Value, ApiError> {
    let param = || Some(format!("messages[{i}].content"));
    match content {
        // Only an assistant turn (one that made tool calls) may come without content, as in
        // OpenAI's API.
        None | Some(Value::Null) if assistant => Ok(Value::String(String::new())),
        None | Some(Value::Null) => Err(ApiError::invalid(
            param(),
            "A message needs 'content' (only an assistant message may omit it).",
        )),
        Some(Value::String(s)) => Ok(Value::String(s.clone())),
        Some(Value::Array(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for p in parts {
                let kind = p.get("type").and_then(Value::as_str);
                match (kind, p.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) => texts.push(t.to_owned()),
                    _ => {
                        return Err(ApiError::invalid(
                            param(),
                            "Only text content parts ({\"type\": \"text\", \"text\": ...}) are supported.",
                        ))
                    }
                }
            }
            Ok(Value::String(texts.join("\n")))
        }
        Some(_) => Err(ApiError::invalid(
            param(),
            "A message's content must be a string or a list of content parts.",
        )),
    }
}

/// Parses a `/v1/chat/completions` body.
///
/// # Errors
/// 400 naming the field at fault.
pub fn parse_chat(
    body: &[u8],
    limits: &EngineLimits,
    defaults: &SamplingDefaults,
) -> Result<ChatRequest, ApiError> {
    let f = Fields::parse(body)?;
    refuse_unsupported_chat(&f)?;
    let model = f.get::<String>("model")?;
    let raw = f
        .raw("messages")
        .ok_or_else(|| ApiError::field("messages", "'messages' is required."))?;
    let items = raw
        .as_array()
        .ok_or_else(|| ApiError::field("messages", "'messages' must be a list of messages."))?;
    if items.is_empty() {
        return Err(ApiError::field("messages", "'messages' cannot be empty."));
    }
    let mut messages = Vec::with_capacity(items.len());
    for (i, m) in items.iter().enumerate() {
        let obj = m.as_object().ok_or_else(|| {
            ApiError::invalid(
                Some(format!("messages[{i}]")),
                "Each message must be an object.",
            )
        })?;
        if !obj.get("role").is_some_and(Value::is_string) {
            return Err(ApiError::invalid(
                Some(format!("messages[{i}].role")),
                "Each message needs a string 'role'.",
            ));
        }
        let mut out = obj.clone();
        let assistant = obj.get("role").and_then(Value::as_str) == Some("assistant");
        out.insert(
            "content".into(),
            flatten_content(i, assistant, obj.get("content"))?,
        );
        if assistant {
            normalize_tool_calls(i, &mut out)?;
            // vLLM takes an assistant message's `reasoning` (its current name) and gives it to
            // the template under both names; templates read `reasoning_content`.
            if let Some(r) = obj.get("reasoning").filter(|r| !r.is_null()) {
                out.insert("reasoning_content".into(), r.clone());
            }
        }
        if !matches!(out.get("tool_call_id"), None | Some(Value::String(_))) {
            return Err(ApiError::invalid(
                Some(format!("messages[{i}].tool_call_id")),
                "'tool_call_id' must be a string.",
            ));
        }
        messages.push(Value::Object(out));
    }
    let tools = parse_tools(&f)?;
    let tool_choice = parse_tool_choice(&f, tools.as_deref())?;
    // With a parser every parsed call is returned; `false` limits `required` to one call.
    let parallel_tool_calls = f.bool("parallel_tool_calls")?.unwrap_or(true);
    // `tools` are served here; `parse_gen` refuses them on the other endpoints.
    let mut rest = f.obj.clone();
    rest.remove("tools");
    rest.remove("chat_template_kwargs");
    let mut gen = parse_gen(&Fields { obj: rest }, true, limits, defaults)?;
    guide_tool_choice(
        &mut gen,
        &tool_choice,
        tools.as_deref().unwrap_or_default(),
        parallel_tool_calls,
    )?;
    let (template_kwargs, from_kwargs) = parse_template_kwargs(&f)?;
    let request_continue = f.bool("continue_final_message")?;
    let request_add = f.bool("add_generation_prompt")?;
    let continue_final_message = from_kwargs
        .continue_final_message
        .or(request_continue)
        .unwrap_or(false);
    // True unless the request (or its kwargs) says false, as in vLLM: so
    // `continue_final_message` needs an explicit `add_generation_prompt: false`.
    let add_generation_prompt = from_kwargs
        .add_generation_prompt
        .or(request_add)
        .unwrap_or(true);
    if continue_final_message && add_generation_prompt {
        let message = if request_continue == Some(true) && request_add == Some(true) {
            // vLLM's request validator.
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
        } else {
            // vLLM renders then and the template step refuses the pair.
            "continue_final_message and add_generation_prompt are not compatible: \
             'add_generation_prompt' defaults to true, so send \"add_generation_prompt\": false \
             with \"continue_final_message\": true."
        };
        return Err(ApiError::field("continue_final_message", message));
    }
    Ok(ChatRequest {
        model,
        messages,
        add_generation_prompt,
        continue_final_message,
        add_special_tokens: f.bool("add_special_tokens")?.unwrap_or(false),
        truncate_prompt_tokens: parse_truncate_prompt_tokens(&f, limits)?,
        template_kwargs,
        include_reasoning: f.bool("include_reasoning")?.unwrap_or(true),
        tools,
        tool_choice,
        echo: f.bool("echo")?.unwrap_or(false),
        gen,
    })
}

/// What `chat_template_kwargs` sets on the request itself.
#[derive(Debug, Default)]
struct KwargOverrides {
    add_generation_prompt: Option<bool>,
    continue_final_message: Option<bool>,
}

/// Reads `chat_template_kwargs` (an object; null is none) as vLLM does: its keys become
/// template variables and win over what the server would set (`tools`, `bos_token`, ...), and
/// `add_generation_prompt` and `continue_final_message` there override the request's own
/// fields (they reach transformers' `apply_chat_template` as its arguments in vLLM).
/// `chat_template` and `tokenize` are refused as vLLM refuses them, and so is `messages`,
/// which the server always sets (in vLLM it fails the render).
fn parse_template_kwargs(f: &Fields) -> Result<(Map<String, Value>, KwargOverrides), ApiError> {
    const NAME: &str = "chat_template_kwargs";
    let mut kwargs = match f.raw(NAME) {
        None => return Ok((Map::new(), KwargOverrides::default())),
        Some(Value::Object(o)) => o.clone(),
        Some(v) => {
            return Err(ApiError::field(
                NAME,
                format!("'{NAME}' must be an object of template variables, got {v}."),
            ))
        }
    };
    for key in ["chat_template", "tokenize", "messages", "conversation"] {
        if kwargs.contains_key(key) {
            return Err(ApiError::field(
                NAME,
                format!("Found unexpected chat template kwargs from request: '{key}'."),
            ));
        }
    }
    let mut flag = |key: &str| -> Result<Option<bool>, ApiError> {
        match kwargs.remove(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(b)),
            Some(v) => Err(ApiError::field(
                NAME,
                format!("'{NAME}.{key}' must be a boolean, got {v}."),
            )),
        }
    };
    let overrides = KwargOverrides {
        add_generation_prompt: flag("add_generation_prompt")?,
        continue_final_message: flag("continue_final_message")?,
    };
    Ok((kwargs, overrides))
}

/// Parses `tools`: a list of `{"type": "function", "function": {"name", "description"?,
/// "parameters"?}}` (`type` may be left out, as vLLM defaults it). Absent, null or empty:
/// `None`.
fn parse_tools(f: &Fields) -> Result<Option<Vec<Value>>, ApiError> {
    let Some(raw) = f.raw("tools") else {
        return Ok(None);
    };
    let items = raw
        .as_array()
        .ok_or_else(|| ApiError::field("tools", "'tools' must be a list of tools."))?;
    for (i, t) in items.iter().enumerate() {
        let at = |p: &str| Some(format!("tools[{i}]{p}"));
        let obj = t
            .as_object()
            .ok_or_else(|| ApiError::invalid(at(""), "Each tool must be an object."))?;
        match obj.get("type") {
            None | Some(Value::Null) => {}
            Some(Value::String(k)) if k == "function" => {}
            Some(k) => {
                return Err(ApiError::invalid(
                    at(".type"),
                    format!("Only tools of type \"function\" are supported, got {k}."),
                ))
            }
        }
        let func = obj
            .get("function")
            .and_then(Value::as_object)
            .ok_or_else(|| {
                ApiError::invalid(
                    at(".function"),
                    "A tool needs a 'function' object with a 'name'.",
                )
            })?;
        match func.get("name") {
            Some(Value::String(n)) if !n.is_empty() => {}
            _ => {
                return Err(ApiError::invalid(
                    at(".function.name"),
                    "A tool's function needs a non-empty string 'name'.",
                ))
            }
        }
        if !matches!(
            func.get("description"),
            None | Some(Value::Null | Value::String(_))
        ) {
            return Err(ApiError::invalid(
                at(".function.description"),
                "A function's 'description' must be a string.",
            ));
        }
        if !matches!(
            func.get("parameters"),
            None | Some(Value::Null | Value::Object(_))
        ) {
            return Err(ApiError::invalid(
                at(".function.parameters"),
                "A function's 'parameters' must be a JSON Schema object.",
            ));
        }
    }
    Ok((!items.is_empty()).then(|| items.clone()))
}

/// A `tool_choice` naming the function `name`, which must be among `tools` (the chat form)
/// when there are any (without tools the caller refuses the choice).
///
/// # Errors
/// 400 naming `tool_choice` when `name` is not among the tools.
fn named_tool_choice(name: &str, tools: Option<&[Value]>) -> Result<ToolChoice, ApiError> {
    let known = |tools: &[Value]| {
        tools.iter().any(|t| {
            t.get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                == Some(name)
        })
    };
    match tools {
        Some(tools) if !known(tools) => Err(ApiError::field(
            "tool_choice",
            format!("tool_choice names the function {name:?}, which is not in 'tools'."),
        )),
        _ => Ok(ToolChoice::Named(name.to_owned())),
    }
}

/// Parses `tool_choice` as vLLM does: absent means `auto` with tools and `none` without;
/// `auto`, `required` and a named function need tools, and the named one must be among them.
fn parse_tool_choice(f: &Fields, tools: Option<&[Value]>) -> Result<ToolChoice, ApiError> {
    let has_tools = tools.is_some();
    const P: &str = "tool_choice";
    let choice = match f.raw(P) {
        None => {
            return Ok(if has_tools {
                ToolChoice::Auto
            } else {
                ToolChoice::None
            })
        }
        Some(Value::String(s)) if s == "none" => return Ok(ToolChoice::None),
        Some(Value::String(s)) if s == "auto" => ToolChoice::Auto,
        Some(Value::String(s)) if s == "required" => ToolChoice::Required,
        Some(Value::Object(o)) if o.get("type").and_then(Value::as_str) == Some("function") => {
            let Some(name) = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
            else {
                return Err(ApiError::field(
                    P,
                    "A named tool_choice needs 'function.name'.",
                ));
            };
            named_tool_choice(name, tools)?
        }
        Some(v) => {
            return Err(ApiError::field(
                P,
                format!(
                    "Invalid value for 'tool_choice': {v}; expected \"none\", \"auto\", \
                     \"required\" or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}."
                ),
            ))
        }
    };
    if !has_tools {
        return Err(ApiError::field(
            P,
            "When using `tool_choice`, `tools` must be set.",
        ));
    }
    Ok(choice)
}

/// Most tools `tool_choice` `required` takes: its schema has one `anyOf` branch per tool, and
/// llguidance's parser aborts a generation whose grammar row holds more than 2000 items (a
/// trial's 2000 tools ended `abort`).
pub const MAX_REQUIRED_TOOLS: usize = 1000;

/// Guides `gen`'s output for `tool_choice` `required` or a named function (the schema of
/// [`tool_choice_schema`]; `tools` in the chat form); nothing for `none` and `auto`.
///
/// # Errors
/// 400 naming `tool_choice` when `gen` has another structured-output constraint, `min_tokens`
/// or `allowed_token_ids`, or when two tools define a `$defs` name differently.
fn guide_tool_choice(
    gen: &mut GenParams,
    choice: &ToolChoice,
    tools: &[Value],
    parallel: bool,
) -> Result<(), ApiError> {
    if *choice == ToolChoice::Required && tools.len() > MAX_REQUIRED_TOOLS {
        return Err(ApiError::field(
            "tools",
            format!(
                "tool_choice \"required\" guides the output by one schema branch per tool; \
                 this server takes at most {MAX_REQUIRED_TOOLS} tools there, got {}.",
                tools.len()
            ),
        ));
    }
    let Some(schema) = tool_choice_schema(choice, tools, parallel)? else {
        return Ok(());
    };
    if let Some((_, other)) = &gen.constraint {
        return Err(ApiError::field(
            "tool_choice",
            format!(
                "tool_choice \"required\" or a named function is a structured output; it \
                 cannot be combined with '{other}'."
            ),
        ));
    }
    if gen.min_tokens > 0 || gen.allowed_only {
        return Err(ApiError::field(
            "tool_choice",
            "tool_choice \"required\" or a named function cannot be combined with \
             'min_tokens' or 'allowed_token_ids' on this server.",
        ));
    }
    gen.constraint = Some((Constraint::Json(schema), "tool_choice"));
    Ok(())
}

/// The JSON schema that guides the output for `tool_choice` `required` or a named function
/// (vLLM's): a named function's output is its arguments (its `parameters` schema, any object
/// without one); `required`'s is a non-empty list of `{"name", "parameters"}` objects, one
/// `anyOf` branch per tool, at most one with `parallel_tool_calls: false`; the tools'
/// `$defs` (and `definitions`) move to the list's top level, where their `#/$defs/...`
/// references point (as vLLM does: pydantic puts nested models there). `None` for `none` and
/// `auto`.
///
/// # Errors
/// Two tools that define the same `$defs` name differently.
fn tool_choice_schema(
    choice: &ToolChoice,
    tools: &[Value],
    parallel: bool,
) -> Result<Option<Value>, ApiError> {
    let params = |t: &Value| {
        t.get("function")
            .and_then(|f| f.get("parameters"))
            // No parameters, or an empty schema (vLLM's `if not parameters`): no arguments,
            // `{}` (an object of no properties is closed). An empty schema would allow any
            // JSON value, where a call's arguments are an object.
            .filter(|p| p.as_object().is_some_and(|o| !o.is_empty()))
            .cloned()
            .unwrap_or_else(|| serde_json::json!({"type": "object", "properties": {}}))
    };
    let name = |t: &Value| {
        t.get("function")
            .and_then(|f| f.get("name"))
            .and_then(Value::as_str)
            .map(str::to_owned)
    };
    Ok(match choice {
        ToolChoice::None | ToolChoice::Auto => None,
        ToolChoice::Named(n) => Some(
            tools
                .iter()
                .find(|t| name(t).as_deref() == Some(n.as_str()))
                .map(params)
                .unwrap_or_else(|| serde_json::json!({"type": "object", "properties": {}})),
        ),
        ToolChoice::Required => {
            let mut defs: Map<String, Value> = Map::new();
            let mut legacy: Map<String, Value> = Map::new();
            let mut branches = Vec::new();
            for t in tools {
                let Some(n) = name(t) else { continue };
                let mut p = params(t);
                if let Some(o) = p.as_object_mut() {
                    for (key, into) in [("$defs", &mut defs), ("definitions", &mut legacy)] {
                        let Some(Value::Object(d)) = o.remove(key) else {
                            continue;
                        };
                        for (k, v) in d {
                            match into.get(&k) {
                                Some(old) if *old != v => {
                                    return Err(ApiError::field(
                                        "tool_choice",
                                        format!(
                                            "tool_choice \"required\": two tools define \
                                             '{key}/{k}' differently."
                                        ),
                                    ))
                                }
                                _ => {
                                    into.insert(k, v);
                                }
                            }
                        }
                    }
                }
                branches.push(serde_json::json!({
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "enum": [n]},
                        "parameters": p,
                    },
                    "required": ["name", "parameters"],
                    "additionalProperties": false,
                }));
            }
            let mut schema = serde_json::json!({
                "type": "array",
                "minItems": 1,
                "items": {"anyOf": branches},
            });
            if !parallel {
                schema["maxItems"] = 1.into();
            }
            if !defs.is_empty() {
                schema["$defs"] = Value::Object(defs);
            }
            if !legacy.is_empty() {
                schema["definitions"] = Value::Object(legacy);
            }
            Some(schema)
        }
    })
}

/// An assistant message's `tool_calls` as chat templates expect them (vLLM's and
/// transformers' convention): each `function.arguments` JSON string parsed to its value (an
/// empty or missing one to `{}`); an empty list is dropped.
fn normalize_tool_calls(i: usize, out: &mut Map<String, Value>) -> Result<(), ApiError> {
    let calls = match out.get_mut("tool_calls") {
        None => return Ok(()),
        Some(Value::Null) => {
            out.remove("tool_calls");
            return Ok(());
        }
        Some(Value::Array(a)) if a.is_empty() => {
            out.remove("tool_calls");
            return Ok(());
        }
        Some(Value::Array(a)) => a,
        Some(_) => {
            return Err(ApiError::invalid(
                Some(format!("messages[{i}].tool_calls")),
                "'tool_calls' must be a list of tool calls.",
            ))
        }
    };
    for (j, call) in calls.iter_mut().enumerate() {
        let at = |p: &str| Some(format!("messages[{i}].tool_calls[{j}]{p}"));
        let func = call
            .as_object_mut()
            .and_then(|c| c.get_mut("function"))
            .and_then(Value::as_object_mut)
            .ok_or_else(|| {
                ApiError::invalid(at(".function"), "A tool call needs a 'function' object.")
            })?;
        if !func.get("name").is_some_and(Value::is_string) {
            return Err(ApiError::invalid(
                at(".function.name"),
                "A tool call's function needs a string 'name'.",
            ));
        }
        let args = call_arguments(func.get("arguments"), || at(".function.arguments"))?;
        func.insert("arguments".into(), args);
    }
    Ok(())
}

/// A tool call's `arguments` as chat templates take them: a JSON string parsed to its value
/// (an empty or missing one is `{}`); a value that is not a string is taken as it is.
///
/// # Errors
/// 400 naming `param()` for a string that is not JSON.
fn call_arguments(
    args: Option<&Value>,
    param: impl Fn() -> Option<String>,
) -> Result<Value, ApiError> {
    Ok(match args {
        None | Some(Value::Null) => Value::Object(Map::new()),
        Some(Value::String(s)) if s.trim().is_empty() => Value::Object(Map::new()),
        Some(Value::String(s)) => serde_json::from_str(s).map_err(|e| {
            ApiError::invalid(
                param(),
                format!("A tool call's 'arguments' must be a JSON text: {e}."),
            )
        })?,
        Some(v) => v.clone(),
    })
}

/// A parsed `/v1/responses` body (OpenAI's Responses API, as vLLM serves it without a store):
/// the input items become chat messages rendered by the chat template.
#[derive(Clone, Debug, PartialEq)]
pub struct ResponsesRequest {
    /// The `model` field, if given.
    pub model: Option<String>,
    /// The chat messages: `instructions` (when not empty) as a system message first, then the
    /// input items, each `content` flattened to a string.
    pub messages: Vec<Value>,
    /// `instructions`, echoed in the response.
    pub instructions: Option<String>,
    /// `max_tool_calls`, echoed; it limits calls of OpenAI's built-in tools, which this
    /// server has none of.
    pub max_tool_calls: Option<i64>,
    /// `metadata` (an object of strings), echoed in the response.
    pub metadata: Option<Value>,
    /// `user`, echoed in the response.
    pub user: Option<String>,
    /// `parallel_tool_calls` (default true), echoed; `false` limits `tool_choice`
    /// `required` to one call (as on chat).
    pub parallel_tool_calls: bool,
    /// The function `tools` in the chat form the template takes (`{"type": "function",
    /// "function": {"name", "description"?, "parameters"?}}`, vLLM's conversion); `None`
    /// when absent or empty.
    pub tools: Option<Vec<Value>>,
    /// The `tools` as the response echoes them (OpenAI's `FunctionTool`: `type`, `name`,
    /// `description`, `parameters`, `strict`, null where not given).
    pub tools_echo: Vec<Value>,
    /// `tool_choice`, resolved: `auto` when absent or `auto` with tools, `none` without
    /// tools; `required` and a named function guide the output (`gen.constraint`).
    pub tool_choice: ToolChoice,
    /// `tool_choice` as echoed: `"auto"` when absent, else as given.
    pub tool_choice_echo: Value,
    /// The last input item is a message (or reasoning) item with `status` `in_progress` or
    /// `incomplete`: the output continues it, the prompt ending right after its content
    /// (vLLM's `should_continue_final_message`, Anthropic-style partial completion).
    pub continue_final_message: bool,
    /// `truncation: "auto"` (OpenAI's): an input longer than the context loses its oldest
    /// items (after the system and developer messages) until it fits, rather than being
    /// refused (`"disabled"`, the default).
    pub truncation_auto: bool,
    /// `store` (default true, as OpenAI's): keep the response when the server has a store.
    pub store: bool,
    /// `reasoning` when given without an effort or summary (`null` otherwise), echoed.
    pub reasoning: Option<Value>,
    /// `service_tier` (default `auto`), echoed; it changes nothing here.
    pub service_tier: String,
    /// `text.format` as echoed in the response (`{"type": "text"}` by default); a
    /// `json_object` or `json_schema` format is also `gen.constraint`.
    pub text_format: Value,
    /// `top_logprobs` (0..=[`MAX_TOP_LOGPROBS`]; 0 when absent or null), echoed. It takes
    /// effect only with `include: ["message.output_text.logprobs"]` (vLLM's rule), which
    /// sets `gen.logprobs` to it.
    pub top_logprobs: u32,
    /// Generation options; `max_tokens` is `max_output_tokens` and `n` is 1. `logprobs` is
    /// `Some(top_logprobs)` when `include` asks for the output's log-probabilities.
    pub gen: GenParams,
}

/// The `include` value that asks for the output text's log-probabilities.
pub const INCLUDE_OUTPUT_LOGPROBS: &str = "message.output_text.logprobs";

/// The other `include` values OpenAI's Responses API defines: outputs of tools, images and
/// encrypted reasoning, which this server never produces, so each is refused with a 400
/// naming it.
const RESPONSES_INCLUDE_UNSERVED: [&str; 7] = [
    "code_interpreter_call.outputs",
    "computer_call_output.output.image_url",
    "file_search_call.results",
    "message.input_image.image_url",
    "reasoning.encrypted_content",
    "web_search_call.action.sources",
    "web_search_call.results",
];

/// The Responses API's `include`: absent, `null` or a list of strings. Returns whether it
/// asks for the output's log-probabilities ([`INCLUDE_OUTPUT_LOGPROBS`]).
///
/// # Errors
/// 400 naming `include` for anything but a list of strings, for a value OpenAI defines that
/// this server cannot serve, and for an unknown value (each message names the value).
fn parse_response_include(f: &Fields) -> Result<bool, ApiError> {
    let items = match f.raw("include") {
        None => return Ok(false),
        Some(Value::Array(items)) => items,
        Some(_) => {
            return Err(ApiError::field(
                "include",
                "'include' must be a list of strings.",
            ))
        }
    };
    let mut logprobs = false;
    for v in items {
        match v.as_str() {
            Some(INCLUDE_OUTPUT_LOGPROBS) => logprobs = true,
            Some(s) if RESPONSES_INCLUDE_UNSERVED.contains(&s) => {
                return Err(ApiError::field(
                    "include",
                    format!(
                        "'include' value '{s}' is not supported by this server (it has no built-in \
                         tools, images or encrypted reasoning); only \
                         '{INCLUDE_OUTPUT_LOGPROBS}' is."
                    ),
                ))
            }
            Some(s) => {
                return Err(ApiError::field(
                    "include",
                    format!(
                        "Unknown 'include' value '{s}'; this server supports \
                         '{INCLUDE_OUTPUT_LOGPROBS}'."
                    ),
                ))
            }
            None => {
                return Err(ApiError::field(
                    "include",
                    format!("'include' must be a list of strings, got an item {v}."),
                ))
            }
        }
    }
    Ok(logprobs)
}

/// The Responses API's `top_logprobs`: 0..=[`MAX_TOP_LOGPROBS`] (as OpenAI's and vLLM's
/// sampler limit), 0 when absent or `null`.
///
/// # Errors
/// 400 naming `top_logprobs` for a value out of range or not an integer.
fn parse_response_top_logprobs(f: &Fields) -> Result<u32, ApiError> {
    match f.int("top_logprobs")? {
        None => Ok(0),
        Some(k) if (0..=MAX_TOP_LOGPROBS as i64).contains(&k) => Ok(k as u32),
        Some(k) => Err(ApiError::field(
            "top_logprobs",
            format!("'top_logprobs' must be between 0 and {MAX_TOP_LOGPROBS}, got {k}."),
        )),
    }
}

/// Where a field refused on `/v1/responses` is served: chat only.
const SERVED_ON_CHAT: &str = "/v1/chat/completions";
/// Where a field refused on `/v1/responses` is served: completions and chat.
const SERVED_ON_BOTH: &str = "/v1/completions and /v1/chat/completions";

/// Fields of the other endpoints that `/v1/responses` does not take, refused there rather
/// than silently ignored: each with the endpoints it is served on and what `/v1/responses`
/// does instead.
const RESPONSES_REFUSED: [(&str, &str, &str); 8] = [
    (
        "messages",
        SERVED_ON_CHAT,
        "send 'input' (a string or a list of messages) instead",
    ),
    (
        "max_tokens",
        SERVED_ON_BOTH,
        "send 'max_output_tokens' instead",
    ),
    (
        "max_completion_tokens",
        SERVED_ON_CHAT,
        "send 'max_output_tokens' instead",
    ),
    (
        "prompt_logprobs",
        SERVED_ON_BOTH,
        "/v1/responses returns no prompt log-probabilities",
    ),
    (
        "logprobs",
        SERVED_ON_BOTH,
        "send 'include': [\"message.output_text.logprobs\"] (and 'top_logprobs' for \
         alternatives) instead",
    ),
    (
        "echo",
        SERVED_ON_BOTH,
        "/v1/responses never repeats the input",
    ),
    (
        "return_tokens_as_token_ids",
        SERVED_ON_BOTH,
        "its log-probabilities name tokens by id only under the server's \
         --return-tokens-as-token-ids",
    ),
    (
        "continue_final_message",
        SERVED_ON_CHAT,
        "/v1/responses always starts a new assistant message",
    ),
];

/// Flattens one Responses input item's `content` (a string, or a list of `input_text` or
/// `output_text` parts) to a string; parts are joined with newlines, as chat joins its text
/// parts.
fn flatten_response_content(i: usize, content: Option<&Value>) -> Result<String, ApiError> {
    match content {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (j, p) in parts.iter().enumerate() {
                let kind = p.get("type").and_then(Value::as_str);
                match (kind, p.get("text").and_then(Value::as_str)) {
                    (Some("input_text" | "output_text"), Some(t)) => texts.push(t.to_owned()),
                    (Some(k @ ("input_text" | "output_text")), None) => {
                        return Err(ApiError::invalid(
                            Some(format!("input[{i}].content[{j}].text")),
                            format!("An '{k}' content part needs a string 'text'."),
                        ))
                    }
                    _ => {
                        let what = kind.map_or_else(
                            || "without a type".to_owned(),
                            |k| format!("of type '{k}'"),
                        );
                        return Err(ApiError::invalid(
                            Some(format!("input[{i}].content[{j}]")),
                            format!(
                                "Content parts {what} are not supported by this server; only \
                                 'input_text' and 'output_text' parts are."
                            ),
                        ));
                    }
                }
            }
            Ok(texts.join("\n"))
        }
        None | Some(Value::Null) => Err(ApiError::invalid(
            Some(format!("input[{i}].content")),
            "A message needs 'content'.",
        )),
        Some(_) => Err(ApiError::invalid(
            Some(format!("input[{i}].content")),
            "A message's content must be a string or a list of content parts.",
        )),
    }
}

/// The text of a Responses `reasoning` input item (what `/v1/responses` returns as output 0
/// with `--reasoning-parser`, and what clients send back on the next turn, as vLLM's example
/// client does): its `content` parts' `reasoning_text`, else its `summary` parts'
/// `summary_text`, joined with newlines. `encrypted_content` is refused (this server never
/// issues any), as is a part of another type.
fn response_reasoning_text(
    i: usize,
    obj: &serde_json::Map<String, Value>,
) -> Result<String, ApiError> {
    if !matches!(obj.get("encrypted_content"), None | Some(Value::Null)) {
        return Err(ApiError::invalid(
            Some(format!("input[{i}].encrypted_content")),
            "Encrypted reasoning is not supported by this server (it never returns any).",
        ));
    }
    let mut texts = Vec::new();
    for (field, kind) in [("content", "reasoning_text"), ("summary", "summary_text")] {
        let parts = match obj.get(field) {
            None | Some(Value::Null) => continue,
            Some(Value::Array(parts)) => parts,
            Some(_) => {
                return Err(ApiError::invalid(
                    Some(format!("input[{i}].{field}")),
                    format!("A reasoning item's '{field}' must be a list of '{kind}' parts."),
                ))
            }
        };
        for (j, p) in parts.iter().enumerate() {
            match (p.get("type").and_then(Value::as_str), p.get("text")) {
                (Some(k), Some(Value::String(t))) if k == kind => texts.push(t.clone()),
                _ => {
                    return Err(ApiError::invalid(
                        Some(format!("input[{i}].{field}[{j}]")),
                        format!(
                            "A reasoning item's '{field}' parts must be \
                             {{\"type\": \"{kind}\", \"text\": string}}."
                        ),
                    ))
                }
            }
        }
        if !texts.is_empty() {
            break;
        }
    }
    Ok(texts.join("\n"))
}

/// Parses the Responses API's `tools`: a list of flat function tools, `{"type": "function",
/// "name", "description"?, "parameters"?, "strict"?}` (OpenAI's `FunctionTool`). Returns the
/// tools to echo (every field, null where not given) and their chat form for the template
/// (`{"type": "function", "function": {"name", "description", "parameters"}}`, as vLLM's
/// `convert_tool_responses_to_completions_format`; `None` when there are none). `strict` is
/// echoed only: with `tool_choice` `required` or a named function the arguments follow the
/// schema anyway, with `auto` the model writes them unguided (as in vLLM).
///
/// # Errors
/// 400 naming the field for a tool of another type (OpenAI's built-in tools: web search,
/// file search, MCP, ...), a chat-form tool, or a field of the wrong type.
fn parse_response_tools(f: &Fields) -> Result<(Vec<Value>, Option<Vec<Value>>), ApiError> {
    let items = match f.raw("tools") {
        None | Some(Value::Null) => return Ok((Vec::new(), None)),
        Some(Value::Array(items)) => items,
        Some(_) => return Err(ApiError::field("tools", "'tools' must be a list of tools.")),
    };
    let mut echo = Vec::with_capacity(items.len());
    let mut chat = Vec::with_capacity(items.len());
    for (i, t) in items.iter().enumerate() {
        let at = |p: &str| Some(format!("tools[{i}]{p}"));
        let obj = t
            .as_object()
            .ok_or_else(|| ApiError::invalid(at(""), "Each tool must be an object."))?;
        match obj.get("type").and_then(Value::as_str) {
            Some("function") => {}
            Some(k) => {
                return Err(ApiError::invalid(
                    at(".type"),
                    format!(
                        "Tools of type '{k}' are not supported by this server; only function \
                         tools ({{\"type\": \"function\", \"name\": ...}}) are."
                    ),
                ))
            }
            None => {
                return Err(ApiError::invalid(
                    at(".type"),
                    "Each tool needs a string 'type' (\"function\").",
                ))
            }
        }
        let name = match obj.get("name") {
            Some(Value::String(n)) if !n.is_empty() => n,
            _ if obj.contains_key("function") => {
                return Err(ApiError::invalid(
                    at(".name"),
                    "/v1/responses takes flat function tools, {\"type\": \"function\", \
                     \"name\": ..., \"parameters\": {...}}, not the chat form with a \
                     'function' object.",
                ))
            }
            _ => {
                return Err(ApiError::invalid(
                    at(".name"),
                    "A function tool needs a non-empty string 'name'.",
                ))
            }
        };
        let field = |key: &str, ok: fn(&Value) -> bool, what: &str| match obj.get(key) {
            None | Some(Value::Null) => Ok(Value::Null),
            Some(v) if ok(v) => Ok(v.clone()),
            Some(_) => Err(ApiError::invalid(
                at(&format!(".{key}")),
                format!("A function tool's '{key}' must be {what}."),
            )),
        };
        let description = field("description", Value::is_string, "a string")?;
        let parameters = field("parameters", Value::is_object, "a JSON Schema object")?;
        let strict = field("strict", Value::is_boolean, "a boolean")?;
        let mut function = Map::new();
        function.insert("name".into(), Value::String(name.clone()));
        for (key, v) in [("description", &description), ("parameters", &parameters)] {
            if !v.is_null() {
                function.insert(key.into(), v.clone());
            }
        }
        chat.push(serde_json::json!({"type": "function", "function": function}));
        echo.push(serde_json::json!({"type": "function", "name": name,
            "description": description, "parameters": parameters, "strict": strict}));
    }
    Ok((echo, (!chat.is_empty()).then_some(chat)))
}

/// Parses the Responses API's `tool_choice` (OpenAI's forms): `"none"`, `"auto"` (the
/// default), `"required"`, or `{"type": "function", "name": ...}` naming one of `tools` (the
/// chat form). Returns the resolved choice and the value to echo. `auto` without tools is
/// `none` (nothing to call); `required` and a named function need tools.
///
/// # Errors
/// 400 naming `tool_choice` for another form (`allowed_tools`, built-in tool types), an
/// unknown function name, or `required`/named without tools.
fn parse_response_tool_choice(
    f: &Fields,
    tools: Option<&[Value]>,
) -> Result<(ToolChoice, Value), ApiError> {
    const P: &str = "tool_choice";
    let has_tools = tools.is_some();
    let auto = || {
        if has_tools {
            ToolChoice::Auto
        } else {
            ToolChoice::None
        }
    };
    let raw = match f.raw(P) {
        None | Some(Value::Null) => return Ok((auto(), Value::String("auto".into()))),
        Some(v) => v,
    };
    let choice = match raw {
        Value::String(s) if s == "none" => ToolChoice::None,
        Value::String(s) if s == "auto" => auto(),
        Value::String(s) if s == "required" => ToolChoice::Required,
        Value::Object(o) => match o.get("type").and_then(Value::as_str) {
            Some("function") => {
                let Some(name) = o.get("name").and_then(Value::as_str) else {
                    return Err(ApiError::field(
                        P,
                        "A function tool_choice needs a 'name': {\"type\": \"function\", \
                         \"name\": ...}.",
                    ));
                };
                named_tool_choice(name, tools)?
            }
            Some(k) => {
                return Err(ApiError::field(
                    P,
                    format!(
                        "tool_choice of type '{k}' is not supported by this server; it takes \
                         \"none\", \"auto\", \"required\" or {{\"type\": \"function\", \
                         \"name\": ...}}."
                    ),
                ))
            }
            None => {
                return Err(ApiError::field(
                    P,
                    "A tool_choice object needs a 'type' (\"function\").",
                ))
            }
        },
        v => {
            return Err(ApiError::field(
                P,
                format!(
                    "Invalid value for 'tool_choice': {v}; expected \"none\", \"auto\", \
                     \"required\" or {{\"type\": \"function\", \"name\": ...}}."
                ),
            ))
        }
    };
    if !has_tools && matches!(choice, ToolChoice::Required | ToolChoice::Named(_)) {
        return Err(ApiError::field(
            P,
            "When using `tool_choice`, `tools` must be set.",
        ));
    }
    Ok((choice, raw.clone()))
}

/// A Responses `function_call` input item (a call the model made in an earlier turn, sent
/// back) as a chat tool call: `{"id": call_id, "type": "function", "function": {"name",
/// "arguments"}}`, its `arguments` JSON string parsed to the value templates take.
///
/// # Errors
/// 400 naming the field for a missing or mistyped `call_id`, `name` or `arguments`, or
/// arguments that are not JSON.
fn response_function_call(i: usize, obj: &Map<String, Value>) -> Result<Value, ApiError> {
    let at = |p: &str| Some(format!("input[{i}].{p}"));
    let text = |key: &str| match obj.get(key) {
        Some(Value::String(s)) if !s.is_empty() => Ok(s.clone()),
        _ => Err(ApiError::invalid(
            at(key),
            format!("A function_call item needs a non-empty string '{key}'."),
        )),
    };
    let call_id = text("call_id")?;
    let name = text("name")?;
    let arguments = match obj.get("arguments") {
        Some(a @ Value::String(_)) => call_arguments(Some(a), || at("arguments"))?,
        _ => {
            return Err(ApiError::invalid(
                at("arguments"),
                "A function_call item needs 'arguments', a JSON text.",
            ))
        }
    };
    Ok(serde_json::json!({"id": call_id, "type": "function",
        "function": {"name": name, "arguments": arguments}}))
}

/// A Responses `function_call_output` input item (a function's result) as a chat `tool`
/// message: `{"role": "tool", "tool_call_id": call_id, "content": output}` (vLLM's
/// conversion); an `output` given as a list of `input_text` parts is joined with newlines.
///
/// # Errors
/// 400 naming the field for a missing `call_id` or `output`, or output parts other than text.
fn response_function_output(i: usize, obj: &Map<String, Value>) -> Result<Value, ApiError> {
    let at = |p: &str| Some(format!("input[{i}].{p}"));
    let Some(Value::String(call_id)) = obj.get("call_id") else {
        return Err(ApiError::invalid(
            at("call_id"),
            "A function_call_output item needs a string 'call_id'.",
        ));
    };
    let output = match obj.get("output") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (j, p) in parts.iter().enumerate() {
                match (p.get("type").and_then(Value::as_str), p.get("text")) {
                    (Some("input_text"), Some(Value::String(t))) => texts.push(t.clone()),
                    _ => {
                        return Err(ApiError::invalid(
                            at(&format!("output[{j}]")),
                            "Only text output parts ({\"type\": \"input_text\", \"text\": \
                             ...}) are supported by this server.",
                        ))
                    }
                }
            }
            texts.join("\n")
        }
        _ => {
            return Err(ApiError::invalid(
                at("output"),
                "A function_call_output item needs 'output', a string or a list of \
                 'input_text' parts.",
            ))
        }
    };
    Ok(serde_json::json!({"role": "tool", "tool_call_id": call_id, "content": output}))
}

/// Whether the Responses `input`'s last item is a message or reasoning item with `status`
/// `in_progress` or `incomplete`, which the output continues (vLLM's
/// `should_continue_final_message`).
fn continues_final_item(f: &Fields) -> bool {
    let Some(Value::Array(items)) = f.raw("input") else {
        return false;
    };
    items.last().is_some_and(|item| {
        matches!(
            item.get("type").and_then(Value::as_str),
            None | Some("message" | "reasoning")
        ) && matches!(
            item.get("status").and_then(Value::as_str),
            Some("in_progress" | "incomplete")
        )
    })
}

/// Whether the rendered conversation's final message has text to continue: a message whose
/// content is empty (or a reasoning item, which becomes an assistant message without
/// content) starts a new turn instead, since continuing it would continue whatever the
/// template writes after an empty turn (its end-of-turn token).
fn final_has_text(messages: &[Value]) -> bool {
    messages
        .last()
        .and_then(|m| m["content"].as_str())
        .is_some_and(|c| !c.trim().is_empty())
}

/// Parses the Responses `input`: a string (one user message) or a non-empty list of message
/// items (`{"role", "content"}`, optionally with `"type": "message"`), `reasoning` items,
/// `function_call` items (an assistant's tool call, joined to the assistant message before it
/// as vLLM does) and `function_call_output` items (`tool` messages).
/// A reasoning item becomes the `reasoning_content` of the assistant message that follows it
/// (what chat templates read), or of an assistant message with empty content of its own when
/// no assistant message follows (vLLM's conversion).
fn parse_response_input(f: &Fields) -> Result<Vec<Value>, ApiError> {
    let raw = f
        .raw("input")
        .ok_or_else(|| ApiError::field("input", "'input' is required."))?;
    let items = match raw {
        Value::String(s) => return Ok(vec![serde_json::json!({"role": "user", "content": s})]),
        Value::Array(items) if items.is_empty() => {
            return Err(ApiError::field("input", "'input' cannot be an empty list."))
        }
        Value::Array(items) => items,
        _ => {
            return Err(ApiError::field(
                "input",
                "'input' must be a string or a list of input items.",
            ))
        }
    };
    let mut messages = Vec::with_capacity(items.len());
    // Reasoning waiting for the assistant message that follows it.
    let mut reasoning: Option<String> = None;
    for (i, item) in items.iter().enumerate() {
        let obj = item.as_object().ok_or_else(|| {
            ApiError::invalid(
                Some(format!("input[{i}]")),
                "Each input item must be an object.",
            )
        })?;
        if !matches!(obj.get("status"), None | Some(Value::Null))
            && !matches!(
                obj.get("status").and_then(Value::as_str),
                Some("in_progress" | "completed" | "incomplete")
            )
        {
            return Err(ApiError::invalid(
                Some(format!("input[{i}].status")),
                "An item's 'status' must be \"in_progress\", \"completed\" or \"incomplete\".",
            ));
        }
        match obj.get("type") {
            None | Some(Value::Null) => {}
            Some(Value::String(t)) if t == "message" => {}
            Some(Value::String(t)) if t == "reasoning" => {
                let text = response_reasoning_text(i, obj)?;
                if let Some(prev) = reasoning.replace(text) {
                    messages.push(serde_json::json!(
                        {"role": "assistant", "content": "", "reasoning_content": prev}));
                }
                continue;
            }
            Some(Value::String(t)) if t == "function_call" => {
                let call = response_function_call(i, obj)?;
                // As vLLM: a call joins the assistant message before it (its text or earlier
                // calls), or the reasoning waiting for one.
                match (reasoning.take(), messages.last_mut()) {
                    (Some(r), _) => messages.push(serde_json::json!({"role": "assistant",
                        "content": "", "reasoning_content": r, "tool_calls": [call]})),
                    (None, Some(Value::Object(m)))
                        if m.get("role").and_then(Value::as_str) == Some("assistant") =>
                    {
                        let calls = m
                            .entry("tool_calls")
                            .or_insert_with(|| Value::Array(vec![]));
                        if let Value::Array(calls) = calls {
                            calls.push(call);
                        }
                    }
                    (None, _) => messages.push(serde_json::json!(
                        {"role": "assistant", "content": "", "tool_calls": [call]})),
                }
                continue;
            }
            Some(Value::String(t)) if t == "function_call_output" => {
                let m = response_function_output(i, obj)?;
                if let Some(r) = reasoning.take() {
                    messages.push(serde_json::json!(
                        {"role": "assistant", "content": "", "reasoning_content": r}));
                }
                messages.push(m);
                continue;
            }
            Some(Value::String(t)) if t == "item_reference" => {
                return Err(ApiError::invalid(
                    Some(format!("input[{i}].type")),
                    "Item references are not supported by this server (send the items \
                     themselves).",
                ))
            }
            Some(t) => {
                return Err(ApiError::invalid(
                    Some(format!("input[{i}].type")),
                    format!(
                        "Input items of type {t} are not supported by this server; only \
                         messages, reasoning, function_call and function_call_output are (no \
                         built-in tools, images or files)."
                    ),
                ))
            }
        }
        let role = match obj.get("role").and_then(Value::as_str) {
            Some(r @ ("user" | "assistant" | "system" | "developer")) => r,
            Some(r) => {
                return Err(ApiError::invalid(
                    Some(format!("input[{i}].role")),
                    format!(
                        "Unknown role '{r}': a message's role must be 'user', 'assistant', \
                         'system' or 'developer'."
                    ),
                ))
            }
            None => {
                return Err(ApiError::invalid(
                    Some(format!("input[{i}].role")),
                    "Each input message needs a string 'role'.",
                ))
            }
        };
        let content = flatten_response_content(i, obj.get("content"))?;
        let mut m = serde_json::json!({"role": role, "content": content});
        if let Some(r) = reasoning.take() {
            if role == "assistant" {
                m["reasoning_content"] = Value::String(r);
            } else {
                messages.push(serde_json::json!(
                    {"role": "assistant", "content": "", "reasoning_content": r}));
            }
        }
        messages.push(m);
    }
    if let Some(r) = reasoning {
        messages
            .push(serde_json::json!({"role": "assistant", "content": "", "reasoning_content": r}));
    }
    Ok(messages)
}

/// Refuses the Responses API options Baton does not implement (reasoning effort,
/// `text.verbosity`, background mode, truncation other than auto or disabled, prompt
/// templates, conversations; `previous_response_id` when the server keeps no store, which
/// resolves it before parsing), each a 400 naming its field (`include` values:
/// [`parse_response_include`]).
fn refuse_unsupported_responses(f: &Fields) -> Result<(), ApiError> {
    // (With a response store, `previous_response_id` was resolved before parsing.)
    if f.raw("previous_response_id").is_some() {
        return Err(ApiError::field(
            "previous_response_id",
            "'previous_response_id' needs a response store, which this server runs without \
             (send the whole conversation in 'input', or start the server with \
             --responses-store-mib).",
        ));
    }
    if f.raw("conversation").is_some() {
        return Err(ApiError::field(
            "conversation",
            "Conversations ('conversation') are not supported by this server (send the \
             conversation's items in 'input', or chain responses with \
             'previous_response_id' when the server keeps a response store).",
        ));
    }
    for (name, served, instead) in RESPONSES_REFUSED {
        let given = match f.raw(name) {
            None | Some(Value::Bool(false)) => false,
            Some(_) => true,
        };
        if given {
            return Err(ApiError::field(
                name,
                format!(
                    "'{name}' is not supported on /v1/responses (it is a parameter of \
                     {served}); {instead}."
                ),
            ));
        }
    }
    if !matches!(
        f.raw("add_generation_prompt"),
        None | Some(Value::Null | Value::Bool(true))
    ) {
        return Err(ApiError::field(
            "add_generation_prompt",
            "'add_generation_prompt' is a chat completions parameter; /v1/responses always \
             starts a new assistant message.",
        ));
    }
    // vLLM's Responses API has no such field (its `truncation` is the Responses way).
    if f.raw("truncate_prompt_tokens").is_some() {
        return Err(ApiError::field(
            "truncate_prompt_tokens",
            "'truncate_prompt_tokens' is served on /v1/completions and /v1/chat/completions, \
             not on /v1/responses.",
        ));
    }
    if f.int("n")?.is_some_and(|n| n != 1) {
        return Err(ApiError::field(
            "n",
            "/v1/responses makes one output message; 'n' must be 1.",
        ));
    }
    if f.bool("return_token_ids")? == Some(true) {
        return Err(ApiError::field(
            "return_token_ids",
            "'return_token_ids' is served on /v1/completions and /v1/chat/completions, not on \
             /v1/responses.",
        ));
    }
    if let Some(r) = f.raw("reasoning") {
        let o = r
            .as_object()
            .ok_or_else(|| ApiError::field("reasoning", "'reasoning' must be an object."))?;
        if let Some((k, _)) = o.iter().find(|(_, v)| !v.is_null()) {
            return Err(ApiError::field(
                "reasoning",
                format!("Reasoning options ('reasoning.{k}') are not supported by this server."),
            ));
        }
    }
    if let Some(t) = f.raw("text") {
        let o = t
            .as_object()
            .ok_or_else(|| ApiError::field("text", "'text' must be an object."))?;
        if !matches!(o.get("verbosity"), None | Some(Value::Null)) {
            return Err(ApiError::field(
                "text.verbosity",
                "'text.verbosity' is not supported by this server.",
            ));
        }
    }
    if f.bool("background")? == Some(true) {
        return Err(ApiError::field(
            "background",
            "Background mode is not supported by this server.",
        ));
    }
    match f.raw("truncation") {
        None | Some(Value::Null) => {}
        Some(v) if matches!(v.as_str(), Some("disabled" | "auto")) => {}
        Some(_) => {
            return Err(ApiError::field(
                "truncation",
                "'truncation' must be \"auto\" or \"disabled\".",
            ))
        }
    }
    if f.raw("prompt").is_some() {
        return Err(ApiError::field(
            "prompt",
            "Prompt templates ('prompt') are not supported by this server.",
        ));
    }
    Ok(())
}

/// Parses a `/v1/responses` body. Sampling options are validated as on chat completions (vLLM's
/// extras such as `top_k`, `min_p`, `seed`, `repetition_penalty`, `stop` included);
/// `max_output_tokens` is the output limit.
///
/// # Errors
/// 400 naming the field at fault.
pub fn parse_responses(
    body: &[u8],
    limits: &EngineLimits,
    defaults: &SamplingDefaults,
) -> Result<ResponsesRequest, ApiError> {
    let f = Fields::parse(body)?;
    let model = f.get::<String>("model")?;
    refuse_unsupported_responses(&f)?;
    let instructions = f.get::<String>("instructions")?;
    let mut messages = Vec::new();
    // Empty instructions are no instructions (not an empty system turn).
    if let Some(s) = instructions.as_ref().filter(|s| !s.is_empty()) {
        messages.push(serde_json::json!({"role": "system", "content": s}));
    }
    messages.extend(parse_response_input(&f)?);
    let continue_final_message = continues_final_item(&f) && final_has_text(&messages);
    let max_output_tokens = match f.int("max_output_tokens")? {
        None => None,
        Some(v) if v < 1 => {
            return Err(ApiError::field(
                "max_output_tokens",
                format!("'max_output_tokens' must be at least 1, got {v}."),
            ))
        }
        Some(v) => Some(u32::try_from(v).map_err(|_| {
            ApiError::field(
                "max_output_tokens",
                format!(
                    "This model's maximum context length is {} tokens; 'max_output_tokens' \
                     {v} is more than that.",
                    limits.max_model_len
                ),
            )
        })?),
    };
    // OpenAI's limits: 16 pairs, keys of up to 64 characters, values of up to 512.
    let metadata = match f.raw("metadata") {
        None | Some(Value::Null) => None,
        Some(Value::Object(o))
            if o.len() <= 16
                && o.iter().all(|(k, v)| {
                    k.chars().count() <= 64 && v.as_str().is_some_and(|v| v.chars().count() <= 512)
                }) =>
        {
            Some(Value::Object(o.clone()))
        }
        Some(_) => {
            return Err(ApiError::field(
                "metadata",
                "'metadata' must be an object of at most 16 string values, keys of at most 64 \
                 characters and values of at most 512.",
            ))
        }
    };
    // Accepted and echoed or ignored, but they must have their types.
    let store = f.get::<bool>("store")?.unwrap_or(true);
    let _prompt_cache_key: Option<String> = f.get("prompt_cache_key")?;
    let max_tool_calls = f.int("max_tool_calls")?;
    if let Some(n) = max_tool_calls.filter(|&n| n < 0) {
        return Err(ApiError::field(
            "max_tool_calls",
            format!("'max_tool_calls' must be at least 0, got {n}."),
        ));
    }
    let parallel_tool_calls = f.bool("parallel_tool_calls")?.unwrap_or(true);
    let (tools_echo, tools) = parse_response_tools(&f)?;
    let (tool_choice, tool_choice_echo) = parse_response_tool_choice(&f, tools.as_deref())?;
    let service_tier = f
        .get::<String>("service_tier")?
        .unwrap_or_else(|| "auto".to_owned());
    let reasoning = f.raw("reasoning").cloned();
    let user = f.get::<String>("user")?;
    let include_logprobs = parse_response_include(&f)?;
    let top_logprobs = parse_response_top_logprobs(&f)?;
    // The chat validator on the remaining fields: Responses' own `stream_options` (only
    // `include_obfuscation`, which changes nothing here) and `top_logprobs` (checked above)
    // mean something else there.
    let mut rest = f.obj.clone();
    rest.remove("stream_options");
    rest.remove("top_logprobs");
    // Served here (above); `parse_gen` refuses them on the other endpoints.
    rest.remove("tools");
    let mut gen = parse_gen(&Fields { obj: rest }, true, limits, defaults)?;
    let text_format = parse_text_format(&f)?;
    if let Some(c) = text_format.1 {
        if let Some((_, other)) = &gen.constraint {
            return Err(ApiError::field(
                "text.format",
                format!("Only one structured-output constraint may be given ('text.format' and '{other}')."),
            ));
        }
        if gen.min_tokens > 0 || gen.allowed_only {
            return Err(ApiError::field(
                "text.format",
                "A structured output cannot be combined with 'min_tokens' or 'allowed_token_ids' on this server.",
            ));
        }
        gen.constraint = Some((c, "text.format"));
    }
    guide_tool_choice(
        &mut gen,
        &tool_choice,
        tools.as_deref().unwrap_or_default(),
        parallel_tool_calls,
    )?;
    if include_logprobs && tool_choice != ToolChoice::None {
        return Err(ApiError::field(
            "include",
            format!(
                "'include' value '{INCLUDE_OUTPUT_LOGPROBS}' cannot be combined with function \
                 tools on this server (with 'tool_choice': \"none\" the output is text only)."
            ),
        ));
    }
    gen.max_tokens = max_output_tokens;
    gen.max_tokens_param = "max_output_tokens";
    // vLLM's `is_include_output_logprobs`: `include` asks for them, `top_logprobs` says how
    // many alternatives (alone it asks for nothing).
    gen.logprobs = include_logprobs.then_some(top_logprobs);
    if let Some(m) = max_output_tokens.filter(|&m| gen.min_tokens > m) {
        return Err(ApiError::field(
            "min_tokens",
            format!(
                "'min_tokens' must be at most max_output_tokens={m}, got {}.",
                gen.min_tokens
            ),
        ));
    }
    Ok(ResponsesRequest {
        model,
        messages,
        instructions,
        max_tool_calls,
        metadata,
        user,
        parallel_tool_calls,
        tools,
        tools_echo,
        tool_choice,
        tool_choice_echo,
        continue_final_message,
        truncation_auto: f.raw("truncation").and_then(Value::as_str) == Some("auto"),
        store,
        reasoning,
        service_tier,
        text_format: text_format.0,
        top_logprobs,
        gen,
    })
}

/// The Responses API's `text.format`: `text` (the default), `json_object`, or `json_schema`
/// with its `schema` (and `name`, `strict`, `description`, echoed). Returns the format to echo
/// and the constraint it asks for.
fn parse_text_format(f: &Fields) -> Result<(Value, Option<Constraint>), ApiError> {
    const P: &str = "text.format";
    let fmt = match f.raw("text").and_then(|t| t.get("format")) {
        None | Some(Value::Null) => return Ok((serde_json::json!({"type": "text"}), None)),
        Some(v) => v,
    };
    let c = match fmt.get("type").and_then(Value::as_str) {
        Some("text") => None,
        Some("json_object") => Some(Constraint::JsonObject),
        Some("json_schema") => match fmt.get("schema") {
            Some(s @ (Value::Object(_) | Value::Bool(_))) => Some(Constraint::Json(s.clone())),
            _ => {
                return Err(ApiError::field(
                    P,
                    "text.format of type 'json_schema' needs a 'schema' object.",
                ))
            }
        },
        _ => {
            return Err(ApiError::field(
                P,
                "text.format 'type' must be 'text', 'json_object' or 'json_schema'.",
            ))
        }
    };
    if c.as_ref()
        .is_some_and(|c| c.to_wire().len() > MAX_CONSTRAINT_BYTES)
    {
        return Err(ApiError::field(
            P,
            format!("The constraint is larger than {MAX_CONSTRAINT_BYTES} bytes."),
        ));
    }
    Ok((fmt.clone(), c))
}

/// `/v1/completions` without `max_tokens` generates this many tokens, as OpenAI's API and vLLM
/// do (the chat endpoint instead defaults to the room left in the context).
pub const COMPLETIONS_DEFAULT_MAX_TOKENS: u32 = 16;

/// The number of new tokens a prompt of `prompt_len` may ask for, checked against the model's
/// maximum length. `what` names the prompt field (`prompt` or `messages`). Without a request,
/// `default` (clipped to the room left) or else all the room left.
///
/// # Errors
/// 400 when the prompt is empty or leaves no room (a prompt of exactly the limit is taken
/// with `max_tokens: 0`), or prompt plus `max_tokens` is over the limit.
pub fn resolve_max_tokens(
    limits: &EngineLimits,
    prompt_len: usize,
    requested: Option<u32>,
    default: Option<u32>,
    what: &str,
    max_tokens_param: &str,
) -> Result<u32, ApiError> {
    let max_len = limits.max_model_len;
    if prompt_len == 0 {
        return Err(ApiError::field(what, "The prompt cannot be empty."));
    }
    // A prompt that fills the context may still be scored (`max_tokens: 0` with `echo`, as
    // evaluation harnesses send whole windows): vLLM refuses only prompt plus max_tokens past
    // the limit.
    if prompt_len > max_len || (prompt_len == max_len && requested != Some(0)) {
        return Err(ApiError::field(
            what,
            format!(
                "This model's maximum context length is {max_len} tokens. However, your prompt \
                 has {prompt_len} tokens, which leaves no room for a new token. Please reduce \
                 the length of the prompt."
            ),
        ));
    }
    match requested {
        None => {
            let room = u32::try_from(max_len - prompt_len).unwrap_or(u32::MAX);
            Ok(default.map_or(room, |d| d.min(room)))
        }
        Some(m) if prompt_len as u64 + m as u64 > max_len as u64 => Err(ApiError::field(
            max_tokens_param,
            format!(
                "This model's maximum context length is {max_len} tokens. However, you \
                 requested {} tokens ({prompt_len} in the prompt, {m} in the completion). \
                 Please reduce the length of the prompt or completion.",
                prompt_len as u64 + m as u64
            ),
        )),
        Some(m) => Ok(m),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: EngineLimits = EngineLimits {
        max_model_len: 512,
        vocab_size: 512,
        max_num_seqs: 8,
        priority_scheduling: false,
    };

    /// A tokenizer of the GPT-2 kind for [`bad_words_token_ids`]: a leading space is its own
    /// token (9) before "hello" but part of the first token of "world" (30 instead of 20).
    fn toy_encode(text: &str) -> Result<Vec<u32>, String> {
        match text {
            "hello" => Ok(vec![10, 11]),
            " hello" => Ok(vec![9, 10, 11]),
            "world" => Ok(vec![20, 21]),
            " world" => Ok(vec![30, 21]),
            "big" => Ok(vec![600]),
            " big" => Ok(vec![601]),
            "x" | " x" => Ok(vec![40]),
            _ => Err(format!("cannot encode {text:?}")),
        }
    }

    #[test]
    fn bad_words_take_the_spaced_variant_only_when_it_starts_differently() {
        let ids = |w: &[&str]| {
            let w: Vec<String> = w.iter().map(|s| s.to_string()).collect();
            bad_words_token_ids(&w, 512, toy_encode)
        };
        // The spaced "hello" is longer, and the spaced "x" starts the same: plain only.
        assert_eq!(ids(&["hello"]).unwrap(), [vec![10, 11]]);
        assert_eq!(ids(&["x"]).unwrap(), [vec![40]]);
        // Leading whitespace is dropped first; "world" starts differently after a space.
        assert_eq!(
            ids(&["  world", "hello"]).unwrap(),
            [vec![20, 21], vec![30, 21], vec![10, 11]]
        );
        // Out of the vocabulary, and a word the tokenizer refuses: 400s naming the field.
        let e = ids(&["big"]).unwrap_err();
        assert_eq!(e.status, 400);
        assert_eq!(e.param.as_deref(), Some("bad_words"));
        assert!(e.message.contains("600"), "{}", e.message);
        assert_eq!(ids(&["?"]).unwrap_err().param.as_deref(), Some("bad_words"));
        // Past the wire's limit: 2 words per "x" (its length, then the token).
        let many = vec!["x".to_string(); baton_proto::wire::MAX_BAD_WORDS_WORDS / 2 + 1];
        assert!(bad_words_token_ids(&many, 512, toy_encode).is_err());
        let most = vec!["x".to_string(); baton_proto::wire::MAX_BAD_WORDS_WORDS / 2];
        assert!(bad_words_token_ids(&most, 512, toy_encode).is_ok());
    }

    /// Chat fields asking for audio, web search, a legacy function call or another verbosity
    /// are 400s naming the field; their neutral values, and `prediction`, are accepted.
    #[test]
    fn chat_fields_for_other_kinds_of_answer_are_refused() {
        let parse = |extra: serde_json::Value| {
            let mut body = serde_json::json!({"messages": [{"role": "user", "content": "hi"}]});
            body.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            parse_chat(
                body.to_string().as_bytes(),
                &LIMITS,
                &SamplingDefaults::default(),
            )
        };
        for (extra, param) in [
            (
                serde_json::json!({"modalities": ["text", "audio"]}),
                "modalities",
            ),
            (serde_json::json!({"modalities": "text"}), "modalities"),
            (
                serde_json::json!({"audio": {"voice": "alloy", "format": "wav"}}),
                "audio",
            ),
            (
                serde_json::json!({"web_search_options": {}}),
                "web_search_options",
            ),
            (serde_json::json!({"verbosity": "low"}), "verbosity"),
            (
                serde_json::json!({"functions": [{"name": "f"}]}),
                "functions",
            ),
            (
                serde_json::json!({"function_call": {"name": "f"}}),
                "function_call",
            ),
            (
                serde_json::json!({"function_call": "auto"}),
                "function_call",
            ),
        ] {
            let e = parse(extra.clone()).unwrap_err();
            assert_eq!(
                (e.status.as_u16(), e.param.as_deref()),
                (400, Some(param)),
                "{extra}"
            );
        }
        for ok in [
            serde_json::json!({"modalities": ["text"]}),
            serde_json::json!({"audio": null, "verbosity": null, "web_search_options": null}),
            serde_json::json!({"functions": [], "function_call": "none"}),
            serde_json::json!({"prediction": {"type": "content", "content": "hi"}}),
        ] {
            assert!(parse(ok.clone()).is_ok(), "{ok}");
        }
    }

    #[test]
    fn bad_words_must_be_a_list_of_non_blank_strings() {
        let parse = |v: serde_json::Value| {
            let body = serde_json::json!({ "bad_words": v }).to_string();
            parse_bad_words(&Fields::parse(body.as_bytes()).unwrap())
        };
        assert_eq!(parse(serde_json::json!(["a", " b"])).unwrap(), ["a", " b"]);
        assert!(parse(serde_json::Value::Null).unwrap().is_empty());
        for bad in [
            serde_json::json!(["a", " "]),
            serde_json::json!("a"),
            serde_json::json!([1]),
            serde_json::json!(["x".repeat(MAX_BAD_WORDS_BYTES + 1)]),
        ] {
            let e = parse(bad.clone()).unwrap_err();
            assert_eq!(e.param.as_deref(), Some("bad_words"), "{bad}");
        }
    }

    #[test]
    fn sampling_defaults_fill_left_out_fields_and_are_checked() {
        let d = SamplingDefaults {
            temperature: Some(0.6),
            top_p: Some(0.95),
            top_k: Some(20),
            min_p: Some(0.05),
            repetition_penalty: Some(1.1),
            max_tokens: Some(9),
        };
        let parse = |b: &str, d: &SamplingDefaults| parse_completion(b.as_bytes(), &LIMITS, d);
        let g = parse(r#"{"prompt":"a"}"#, &d).unwrap().gen;
        assert_eq!(
            (
                g.temperature,
                g.top_p,
                g.top_k,
                g.min_p,
                g.repetition_penalty,
            ),
            (0.6, 0.95, 20, 0.05, 1.1)
        );
        // max_new_tokens caps the output where the request sets no max_tokens ...
        assert_eq!((g.max_tokens, g.default_max_tokens), (None, Some(9)));
        assert_eq!(
            resolve_max_tokens(&LIMITS, 10, g.max_tokens, g.default_max_tokens, "p", "m"),
            Ok(9)
        );
        // ... and never makes a request too long: at most the rest of the context.
        assert_eq!(
            resolve_max_tokens(&LIMITS, 510, None, Some(9), "p", "m"),
            Ok(2)
        );
        let g = parse(
            r#"{"prompt":"a","temperature":1,"top_p":1,"top_k":0,"min_p":0,
                "repetition_penalty":1,"max_tokens":3}"#,
            &d,
        )
        .unwrap()
        .gen;
        assert_eq!(
            (
                g.temperature,
                g.top_p,
                g.top_k,
                g.min_p,
                g.repetition_penalty,
                g.max_tokens
            ),
            (1.0, 1.0, 0, 0.0, 1.0, Some(3))
        );
        let g = parse(r#"{"prompt":"a"}"#, &SamplingDefaults::NONE)
            .unwrap()
            .gen;
        assert_eq!((g.temperature, g.top_k, g.max_tokens), (1.0, 0, None));
        assert!(check_sampling_defaults(&d).is_ok());
        for (bad, field) in [
            (
                SamplingDefaults {
                    top_p: Some(0.0),
                    ..d
                },
                "top_p",
            ),
            (
                SamplingDefaults {
                    temperature: Some(-1.0),
                    ..d
                },
                "temperature",
            ),
            (
                SamplingDefaults {
                    max_tokens: Some(0),
                    ..d
                },
                "max_tokens",
            ),
        ] {
            let e = check_sampling_defaults(&bad).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(field), "{}", e.message);
        }
    }

    fn err(body: &str) -> ApiError {
        parse_completion(body.as_bytes(), &LIMITS, &SamplingDefaults::NONE).expect_err(body)
    }

    #[test]
    fn stop_lists_are_bounded_in_count_and_bytes() {
        let body = |stop: serde_json::Value| serde_json::json!({"prompt": "a", "stop": stop});
        let ok = |b: serde_json::Value| {
            parse_completion(b.to_string().as_bytes(), &LIMITS, &SamplingDefaults::NONE)
                .map(|r| r.gen.stop.len())
        };
        assert_eq!(ok(body(serde_json::json!("x"))).unwrap(), 1);
        assert_eq!(
            ok(body(serde_json::json!(vec!["ab"; MAX_STOP_STRINGS]))).unwrap(),
            MAX_STOP_STRINGS
        );
        let many = ok(body(serde_json::json!(vec!["ab"; MAX_STOP_STRINGS + 1]))).unwrap_err();
        assert_eq!(many.param.as_deref(), Some("stop"));
        assert!(many.message.contains("1025 strings"), "{}", many.message);
        let at = "x".repeat(MAX_STOP_BYTES / 2);
        assert_eq!(ok(body(serde_json::json!([at, at]))).unwrap(), 2);
        let long = ok(body(serde_json::json!([at, at, "y"]))).unwrap_err();
        assert_eq!(long.param.as_deref(), Some("stop"));
        assert!(long.message.contains("65537 bytes"), "{}", long.message);
        // One string past the bytes too.
        assert!(ok(body(serde_json::json!("z".repeat(MAX_STOP_BYTES + 1)))).is_err());
    }

    #[test]
    fn floats_in_messages_are_written_as_python_writes_them() {
        let m = |body: &str| err(body).message;
        let hot = m(r#"{"prompt":"a","temperature":1e308}"#);
        assert!(hot.ends_with("got 1e308."), "{hot}");
        let tiny = m(r#"{"prompt":"a","repetition_penalty":1e-300}"#);
        assert!(tiny.ends_with("got 1e-300."), "{tiny}");
        assert!(m(r#"{"prompt":"a","top_p":1.5}"#).ends_with("got 1.5."));
        assert!(m(r#"{"prompt":"a","min_p":-0.25}"#).ends_with("got -0.25."));
        assert!(m(r#"{"prompt":"a","presence_penalty":3e16}"#).ends_with("got 3e16."));
    }

    #[test]
    fn a_lone_surrogate_escape_is_named() {
        let e = err(r#"{"prompt":"a\ud800"}"#);
        assert!(e.message.contains("surrogate pair"), "{}", e.message);
        assert!(!err(r#"{"prompt":"a""#).message.contains("surrogate"));
    }

    #[test]
    fn bad_fields_are_named_in_the_error() {
        assert_eq!(
            err(r#"{"prompt":"a","top_p":0}"#).param.as_deref(),
            Some("top_p")
        );
        assert_eq!(err(r#"{"prompt":"a","n":0}"#).param.as_deref(), Some("n"));
        let many = format!(
            r#"{{"prompt":[{}],"n":2}}"#,
            vec![r#""hi""#; 1025].join(",")
        );
        let e = err(&many);
        assert_eq!(e.param.as_deref(), Some("prompt"));
        assert!(e.message.contains("2050 sequences"), "{}", e.message);
        assert_eq!(
            err(r#"{"prompt":"a","max_tokens":-1}"#).param.as_deref(),
            Some("max_tokens"),
        );
        let huge = err(r#"{"prompt":"a","max_tokens":1000000000000}"#);
        assert_eq!(huge.param.as_deref(), Some("max_tokens"));
        assert!(
            huge.message.contains("got 1000000000000"),
            "{}",
            huge.message
        );
        assert_eq!(
            err(r#"{"prompt":"a","temperature":"hot"}"#)
                .param
                .as_deref(),
            Some("temperature")
        );
        // Finite as f64, +inf as the sampler's f32.
        let hot = err(r#"{"prompt":"a","temperature":1e39}"#);
        assert_eq!(hot.param.as_deref(), Some("temperature"));
        // The bound in a form a reader can check (not 39 digits).
        assert!(
            hot.message.contains("at most 3.4028235e38"),
            "{}",
            hot.message
        );
        assert_eq!(
            err(r#"{"prompt":[1,600]}"#).param.as_deref(),
            Some("prompt")
        );
        assert_eq!(err(r#"{"prompt":[[]]}"#).param.as_deref(), Some("prompt"));
        assert_eq!(
            err(r#"{"prompt":"a","logprobs":21}"#).param.as_deref(),
            Some("logprobs")
        );
        assert_eq!(err("{nope").param, None);
    }

    #[test]
    fn echo_with_logprobs_asks_for_prompt_logprobs_with_as_many_alternatives() {
        let parse =
            |b: &str| parse_completion(b.as_bytes(), &LIMITS, &SamplingDefaults::NONE).unwrap();
        let r = parse(r#"{"prompt":"a","echo":true,"logprobs":0}"#);
        assert_eq!((r.gen.logprobs, r.gen.prompt_logprobs), (Some(0), 1));
        let r = parse(r#"{"prompt":["a","b"],"n":2,"echo":true,"logprobs":5}"#);
        assert_eq!((r.gen.logprobs, r.gen.prompt_logprobs), (Some(5), 6));
        let r = parse(r#"{"prompt":"a","echo":true,"logprobs":20}"#);
        assert_eq!(r.gen.prompt_logprobs, MAX_TOP_LOGPROBS as u32 + 1);
        assert_eq!(
            parse(r#"{"prompt":"a","echo":true}"#).gen.prompt_logprobs,
            0
        );
        assert_eq!(
            parse(r#"{"prompt":"a","logprobs":3}"#).gen.prompt_logprobs,
            0
        );
        assert_eq!(
            err(r#"{"prompt":"a","echo":true,"logprobs":21}"#)
                .param
                .as_deref(),
            Some("logprobs")
        );
    }

    #[test]
    fn prompt_logprobs_ask_the_engine_for_the_most_alternatives_either_field_wants() {
        let parse = |b: &str| {
            parse_completion(b.as_bytes(), &LIMITS, &SamplingDefaults::NONE)
                .unwrap()
                .gen
        };
        let g = parse(r#"{"prompt":"a","prompt_logprobs":2}"#);
        assert_eq!(
            (g.prompt_top, g.prompt_logprobs, g.logprobs),
            (Some(2), 3, None)
        );
        let g = parse(r#"{"prompt":"a","prompt_logprobs":0}"#);
        assert_eq!((g.prompt_top, g.prompt_logprobs), (Some(0), 1));
        let g = parse(r#"{"prompt":"a","prompt_logprobs":null}"#);
        assert_eq!((g.prompt_top, g.prompt_logprobs), (None, 0));
        let g = parse(r#"{"prompt":"a","echo":true,"logprobs":5,"prompt_logprobs":2}"#);
        assert_eq!((g.prompt_top, g.prompt_logprobs), (Some(2), 6));
        let g = parse(r#"{"prompt":"a","echo":true,"logprobs":1,"prompt_logprobs":20}"#);
        assert_eq!((g.prompt_top, g.prompt_logprobs), (Some(20), 21));
        // logprobs without echo scores no prompt.
        let g = parse(r#"{"prompt":"a","logprobs":5,"prompt_logprobs":1}"#);
        assert_eq!(g.prompt_logprobs, 2);
        let chat = |b: &str| parse_chat(b.as_bytes(), &LIMITS, &SamplingDefaults::NONE);
        let msgs = r#""messages":[{"role":"user","content":"a"}]"#;
        let g = chat(&format!(r#"{{{msgs},"prompt_logprobs":4}}"#))
            .unwrap()
            .gen;
        assert_eq!((g.prompt_top, g.prompt_logprobs), (Some(4), 5));
        for bad in [
            r#""prompt_logprobs":-1"#,
            r#""prompt_logprobs":21"#,
            r#""prompt_logprobs":"x""#,
            r#""prompt_logprobs":true"#,
            r#""prompt_logprobs":2,"stream":true"#,
        ] {
            let e = err(&format!(r#"{{"prompt":"a",{bad}}}"#));
            assert_eq!(e.param.as_deref(), Some("prompt_logprobs"), "{bad}");
            let e = chat(&format!("{{{msgs},{bad}}}")).expect_err(bad);
            assert_eq!(e.param.as_deref(), Some("prompt_logprobs"), "{bad}");
        }
    }

    #[test]
    fn prompt_shapes_parse() {
        let p = |b: &str| {
            parse_completion(b.as_bytes(), &LIMITS, &SamplingDefaults::NONE)
                .unwrap()
                .prompts
        };
        assert_eq!(p(r#"{"prompt":"x"}"#), vec![PromptInput::Text("x".into())]);
        assert_eq!(
            p(r#"{"prompt":[1,2]}"#),
            vec![PromptInput::Tokens(vec![1, 2])]
        );
        assert_eq!(
            p(r#"{"prompt":[[1],[2,3]]}"#),
            vec![
                PromptInput::Tokens(vec![1]),
                PromptInput::Tokens(vec![2, 3])
            ]
        );
        assert_eq!(p(r#"{"prompt":["a","b"]}"#).len(), 2);
    }

    #[test]
    fn responses_input_becomes_chat_messages_after_the_instructions() {
        let parse =
            |b: &str| parse_responses(b.as_bytes(), &LIMITS, &SamplingDefaults::NONE).expect(b);
        let r = parse(r#"{"input":"hi","instructions":"Be brief.","max_output_tokens":7}"#);
        assert_eq!(
            r.messages,
            vec![
                serde_json::json!({"role": "system", "content": "Be brief."}),
                serde_json::json!({"role": "user", "content": "hi"}),
            ]
        );
        assert_eq!(
            (r.gen.max_tokens, r.gen.max_tokens_param, r.gen.n),
            (Some(7), "max_output_tokens", 1)
        );
        assert_eq!(
            (&r.tool_choice, &r.tool_choice_echo, r.parallel_tool_calls),
            (&ToolChoice::None, &serde_json::json!("auto"), true)
        );
        let r = parse(
            r#"{"input":[{"type":"message","role":"assistant","content":[
                {"type":"output_text","text":"a"},{"type":"output_text","text":"b"}]},
                {"role":"developer","content":"c"}],
                "stream_options":{"include_obfuscation":false},"top_k":5,"seed":3}"#,
        );
        assert_eq!(
            r.messages,
            vec![
                serde_json::json!({"role": "assistant", "content": "a\nb"}),
                serde_json::json!({"role": "developer", "content": "c"}),
            ]
        );
        assert_eq!(
            (r.gen.top_k, r.gen.seed, r.gen.max_tokens),
            (5, Some(3), None)
        );
        assert!(!r.gen.stream && !r.gen.include_usage);
        let e = parse_responses(
            br#"{"input":[{"role":"user","content":[{"type":"text","text":"x"}]}]}"#,
            &LIMITS,
            &SamplingDefaults::NONE,
        )
        .expect_err("a chat part type");
        assert_eq!(e.param.as_deref(), Some("input[0].content[0]"));
    }

    #[test]
    fn responses_reasoning_items_become_the_next_assistant_messages_reasoning() {
        let parse = |body: &str| {
            parse_responses(body.as_bytes(), &LIMITS, &SamplingDefaults::NONE).map(|r| r.messages)
        };
        // As /v1/responses returns them with --reasoning-parser: reasoning, then the message.
        let m = parse(
            r#"{"input":[{"role":"user","content":"q"},
                {"type":"reasoning","id":"rs_1","summary":[],"encrypted_content":null,
                 "content":[{"type":"reasoning_text","text":"think"}],"status":"completed"},
                {"type":"message","role":"assistant","content":[{"type":"output_text","text":"a"}]},
                {"role":"user","content":"q2"}]}"#,
        )
        .unwrap();
        assert_eq!(
            m,
            vec![
                serde_json::json!({"role": "user", "content": "q"}),
                serde_json::json!({"role": "assistant", "content": "a", "reasoning_content": "think"}),
                serde_json::json!({"role": "user", "content": "q2"}),
            ]
        );
        // A summary when there is no content; no assistant message after it: one of its own.
        let m = parse(
            r#"{"input":[{"role":"user","content":"q"},
                {"type":"reasoning","summary":[{"type":"summary_text","text":"s1"},
                 {"type":"summary_text","text":"s2"}]},
                {"role":"user","content":"q2"},
                {"type":"reasoning","content":[{"type":"reasoning_text","text":"r"}]}]}"#,
        )
        .unwrap();
        assert_eq!(
            m,
            vec![
                serde_json::json!({"role": "user", "content": "q"}),
                serde_json::json!({"role": "assistant", "content": "", "reasoning_content": "s1\ns2"}),
                serde_json::json!({"role": "user", "content": "q2"}),
                serde_json::json!({"role": "assistant", "content": "", "reasoning_content": "r"}),
            ]
        );
        for (body, param) in [
            (
                r#"{"input":[{"type":"reasoning","encrypted_content":"xyz","summary":[]}]}"#,
                "input[0].encrypted_content",
            ),
            (
                r#"{"input":[{"type":"reasoning","content":[{"type":"output_text","text":"x"}]}]}"#,
                "input[0].content[0]",
            ),
            (
                r#"{"input":[{"type":"reasoning","summary":"x"}]}"#,
                "input[0].summary",
            ),
            (
                r#"{"input":[{"role":"user","content":"q"},{"type":"function_call","name":"f"}]}"#,
                "input[1].call_id",
            ),
        ] {
            let e = parse(body).expect_err(body);
            assert_eq!(e.param.as_deref(), Some(param), "{body}");
        }
    }

    #[test]
    fn responses_function_call_items_join_the_assistant_message_before_them() {
        let parse =
            |b: &str| parse_responses(b.as_bytes(), &LIMITS, &SamplingDefaults::NONE).expect(b);
        let call = |id: &str, city: &str| {
            serde_json::json!({"id": id, "type": "function",
                "function": {"name": "w", "arguments": {"city": city}}})
        };
        let r = parse(
            r#"{"input":[{"role":"user","content":"q"},
                {"role":"assistant","content":"Let me see."},
                {"type":"function_call","call_id":"a","name":"w","arguments":"{\"city\": \"P\"}"},
                {"type":"function_call","call_id":"b","name":"w","arguments":"{\"city\": \"R\"}"},
                {"type":"function_call_output","call_id":"a","output":"1"},
                {"type":"function_call","call_id":"c","name":"w","arguments":"{\"city\": \"O\"}"},
                {"type":"reasoning","content":[{"type":"reasoning_text","text":"hm"}]},
                {"type":"function_call","call_id":"d","name":"w","arguments":"{\"city\": \"L\"}"}]}"#,
        );
        assert_eq!(
            r.messages,
            vec![
                serde_json::json!({"role": "user", "content": "q"}),
                serde_json::json!({"role": "assistant", "content": "Let me see.",
                                   "tool_calls": [call("a", "P"), call("b", "R")]}),
                serde_json::json!({"role": "tool", "tool_call_id": "a", "content": "1"}),
                // After a tool message, a call starts a new assistant message; reasoning
                // waiting for one goes with it.
                serde_json::json!({"role": "assistant", "content": "",
                                   "tool_calls": [call("c", "O")]}),
                serde_json::json!({"role": "assistant", "content": "", "reasoning_content": "hm",
                                   "tool_calls": [call("d", "L")]}),
            ]
        );
        // The tools in the chat form, echoed in OpenAI's shape; a named choice resolves.
        let r = parse(
            r#"{"input":"q","tools":[{"type":"function","name":"w","strict":false}],
                "tool_choice":{"type":"function","name":"w"}}"#,
        );
        assert_eq!(
            r.tools,
            Some(vec![
                serde_json::json!({"type": "function", "function": {"name": "w"}})
            ])
        );
        assert_eq!(
            r.tools_echo,
            vec![
                serde_json::json!({"type": "function", "name": "w", "description": null,
                                    "parameters": null, "strict": false})
            ]
        );
        assert_eq!(r.tool_choice, ToolChoice::Named("w".into()));
        assert!(r.gen.constraint.is_some());
        // Tools with tool_choice absent: auto, unguided.
        let r = parse(r#"{"input":"q","tools":[{"type":"function","name":"w"}]}"#);
        assert_eq!(r.tool_choice, ToolChoice::Auto);
        assert!(r.gen.constraint.is_none());
    }

    #[test]
    fn max_tokens_over_the_limit_is_refused() {
        assert!(resolve_max_tokens(&LIMITS, 10, Some(503), None, "prompt", "max_tokens").is_err());
        assert_eq!(
            resolve_max_tokens(&LIMITS, 10, Some(502), None, "prompt", "max_tokens"),
            Ok(502)
        );
        assert_eq!(
            resolve_max_tokens(&LIMITS, 10, None, None, "prompt", "max_tokens"),
            Ok(502)
        );
        assert!(resolve_max_tokens(&LIMITS, 512, None, None, "prompt", "max_tokens").is_err());
        // A default is clipped to the room left, never an error.
        assert_eq!(
            resolve_max_tokens(&LIMITS, 10, None, Some(16), "prompt", "max_tokens"),
            Ok(16)
        );
        assert_eq!(
            resolve_max_tokens(&LIMITS, 500, None, Some(16), "prompt", "max_tokens"),
            Ok(12)
        );
    }

    #[test]
    fn integer_valued_floats_are_integers_and_other_numbers_are_not() {
        let v = |t: &str| serde_json::from_str::<Value>(t).unwrap();
        for (text, want) in [
            ("2", Some(2)),
            ("2.0", Some(2)),
            ("-0", Some(0)),
            ("-0.0", Some(0)),
            ("1e3", Some(1000)),
            ("-7.0", Some(-7)),
            ("2.5", None),
            ("-0.5", None),
            ("9.3e18", None),
            ("-9.3e18", None),
            ("\"2\"", None),
            ("true", None),
        ] {
            assert_eq!(json_int(&v(text)), want, "{text}");
        }
        assert_eq!(json_int(&v("-9.2e18")), Some(-9_200_000_000_000_000_000));
    }

    #[test]
    fn truncate_prompt_tokens_resolve_and_cut_from_the_left() {
        let parse = |b: &str| {
            let f = Fields::parse(b.as_bytes()).unwrap();
            parse_truncate_prompt_tokens(&f, &LIMITS)
        };
        assert_eq!(parse("{}"), Ok(None));
        assert_eq!(parse(r#"{"truncate_prompt_tokens":null}"#), Ok(None));
        assert_eq!(parse(r#"{"truncate_prompt_tokens":3}"#), Ok(Some(3)));
        assert_eq!(parse(r#"{"truncate_prompt_tokens":-1}"#), Ok(Some(512)));
        assert_eq!(parse(r#"{"truncate_prompt_tokens":512}"#), Ok(Some(512)));
        // As pydantic's lax mode, a string holding an integer is that integer.
        assert_eq!(parse(r#"{"truncate_prompt_tokens":" 3 "}"#), Ok(Some(3)));
        for bad in ["0", "-2", "513", "1.5", "\"1.5\"", "\"x\"", "\"\"", "true"] {
            let e = parse(&format!(r#"{{"truncate_prompt_tokens":{bad}}}"#)).unwrap_err();
            assert_eq!(e.param.as_deref(), Some("truncate_prompt_tokens"), "{bad}");
        }
        let mut ids = vec![1, 2, 3, 4, 5];
        assert!(!truncate_prompt(&mut ids, None));
        assert!(!truncate_prompt(&mut ids, Some(5)));
        assert_eq!(ids, [1, 2, 3, 4, 5]);
        assert!(truncate_prompt(&mut ids, Some(2)));
        assert_eq!(ids, [4, 5]);
    }
}
