//! Structured outputs (guided decoding): a request's output is constrained to a JSON schema, a
//! regular expression, a list of choices or a Lark grammar.
//!
//! The constraint is compiled with [llguidance](https://github.com/guidance-ai/llguidance)
//! (the Earley parser and token-trie mask computation vLLM, SGLang and llama.cpp also use)
//! against the model's vocabulary. Before each sampled token the owner of the request asks its
//! [`Guide`] for a token mask (one bit per vocabulary id), the sampler excludes every token whose
//! bit is clear (its logit becomes `-inf` before the draw and the log-probabilities, as in vLLM,
//! where the grammar bitmask is applied to the logits before the sampler), and the sampled token
//! is fed back with [`Guide::consume`].
//!
//! Who does what (DESIGN.md section 2): the frontend parses the request's `response_format` /
//! `structured_outputs` into a [`Constraint`] and compiles it once to reject a bad one with a
//! 400; the scheduler, which owns the request and sees each sampled token first, compiles it again
//! and writes the mask of every guided sampling row into the slot's row of the token-mask table;
//! the worker applies it.

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::sync::Arc;
use toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};

/// The most bytes a [`Constraint`]'s wire form may take (64 KiB: large JSON schemas fit).
pub const MAX_CONSTRAINT_BYTES: usize = 64 * 1024;

/// Stack for threads that compile constraints or compute masks. llguidance's compiler and
/// Earley parser recurse once per level of a grammar's nesting through references (a `$ref`
/// chain, a chain of Lark rules), which the nesting limits inside one JSON value or regex do not
/// bound: a 300-deep `$ref` chain overflowed a 2 MiB tokio worker's stack (and a stack overflow
/// aborts the process). 256 MiB of address space (touched only as deep as the recursion goes)
/// covers everything a 64 KiB constraint can nest. [`Vocabulary::compile`] runs on such a thread
/// by itself; the threads that own [`Guide`]s (the scheduler's, the in-process engine's) are
/// started with it.
pub const GRAMMAR_STACK_BYTES: usize = 256 << 20;

/// The first line of an llguidance error (its messages go on with a dump of the parser's state
/// and the grammar, which are for llguidance's developers, not for an API error body).
fn first_line(e: impl std::fmt::Display) -> String {
    let s = e.to_string();
    let line = s.lines().next().unwrap_or_default().trim();
    line.strip_suffix(';').unwrap_or(line).to_owned()
}

/// The message of an llguidance error at compile time, for an API error body: its first line,
/// with the reason a regex parser gives on a later line (`error: unclosed group`) appended,
/// and without the position in the wrapper grammar a regex or choice is compiled in (`at
/// 1(8): `, which is not a position in the client's text). llguidance's bare
/// `NoExtensionBias` (nothing can be generated) is said in words.
fn compile_error(e: impl std::fmt::Display, c: &Constraint) -> String {
    let s = e.to_string();
    let mut line = first_line(&s);
    if line == "NoExtensionBias" {
        return "the constraint allows no output: it matches nothing, or its schema refers to \
                itself without end"
            .into();
    }
    if !matches!(c, Constraint::Grammar(_)) {
        if let Some((at, rest)) = line.split_once("): ") {
            let pos = at.strip_prefix("at ").unwrap_or("");
            if pos.split_once('(').is_some_and(|(l, col)| {
                !l.is_empty()
                    && l.bytes().all(|b| b.is_ascii_digit())
                    && !col.is_empty()
                    && col.bytes().all(|b| b.is_ascii_digit())
            }) {
                line = rest.to_owned();
            }
        }
    }
    let reason = s
        .lines()
        .skip(1)
        .find_map(|l| l.trim().strip_prefix("error: "))
        .map(str::trim);
    match reason {
        Some(r) if !line.contains(r) => {
            let head = line.trim_end().trim_end_matches(':');
            format!("{head}: {r}")
        }
        _ => line,
    }
}

/// `u32` words of a token mask for a vocabulary of `vocab_size` ids: bit `t % 32` of word
/// `t / 32` is token `t`.
pub const fn mask_words(vocab_size: usize) -> usize {
    vocab_size.div_ceil(32)
}

/// Errors of grammar loading and compilation.
#[derive(Debug, thiserror::Error)]
pub enum GrammarError {
    /// The tokenizer file could not be read or its vocabulary decoded.
    #[error("tokenizer {path}: {msg}")]
    Tokenizer {
        /// The file.
        path: String,
        /// Why.
        msg: String,
    },
    /// The constraint does not compile (a bad schema, regex or grammar), or is too large.
    #[error("{0}")]
    Invalid(String),
    /// The guide refused a token (the sampled token was not in the mask it gave) or failed.
    #[error("structured output: {0}")]
    Matcher(String),
}

/// What a request's output must match (vLLM's `structured_outputs` / OpenAI's
/// `response_format`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", content = "value", rename_all = "snake_case")]
pub enum Constraint {
    /// A JSON value valid under this JSON schema (`response_format: {type: "json_schema"}`,
    /// vLLM's `guided_json`).
    Json(serde_json::Value),
    /// Any JSON object (`response_format: {type: "json_object"}`).
    JsonObject,
    /// Text matching this regular expression in full (vLLM's `guided_regex`; Rust `regex`
    /// syntax, anchored at both ends).
    Regex(String),
    /// Exactly one of these strings (vLLM's `guided_choice`).
    Choice(Vec<String>),
    /// Text in the language of this Lark grammar (vLLM's `guided_grammar`, llguidance's Lark
    /// dialect: <https://github.com/guidance-ai/llguidance/blob/main/docs/syntax.md>).
    Grammar(String),
}

impl Constraint {
    /// The form that crosses the process boundary (JSON bytes).
    pub fn to_wire(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a constraint serializes")
    }

    /// Parses [`Constraint::to_wire`]'s output.
    ///
    /// # Errors
    /// [`GrammarError::Invalid`] for bytes that are not a wire-form constraint.
    pub fn from_wire(bytes: &[u8]) -> Result<Self, GrammarError> {
        serde_json::from_slice(bytes)
            .map_err(|e| GrammarError::Invalid(format!("malformed constraint: {e}")))
    }

    fn to_grammar(&self) -> Result<TopLevelGrammar, GrammarError> {
        Ok(match self {
            Constraint::Json(schema) => {
                if !schema.is_object() && !schema.is_boolean() {
                    return Err(GrammarError::Invalid(
                        "a JSON schema must be an object".into(),
                    ));
                }
                let mut schema = schema.clone();
                close_objects(&mut schema);
                TopLevelGrammar::from_json_schema(compact(schema))
            }
            Constraint::JsonObject => {
                TopLevelGrammar::from_json_schema(compact(serde_json::json!({"type": "object"})))
            }
            Constraint::Regex(rx) => TopLevelGrammar::from_regex(rx),
            Constraint::Choice(choices) => {
                if choices.is_empty() {
                    return Err(GrammarError::Invalid("the choice list is empty".into()));
                }
                let alts: Vec<String> = choices.iter().map(|c| regex_syntax::escape(c)).collect();
                TopLevelGrammar::from_regex(&format!("(?:{})", alts.join("|")))
            }
            Constraint::Grammar(lark) => TopLevelGrammar::from_lark(lark.clone()),
        })
    }
}

/// Sets `"additionalProperties": false` on every subschema with `properties` or
/// `patternProperties` that leaves it out, so the output has no keys the schema does not name:
/// vLLM's default backend (xgrammar, whose `strict_mode` is on) generates no others, and vLLM
/// rewrites a schema this way for its guidance backend with `disable_additional_properties`
/// (`_walk_json_for_additional_properties`). A schema that sets `additionalProperties` keeps
/// it. Values that are data rather than schemas (`const`, `enum`, `default`, `examples`,
/// llguidance's `x-guidance`) are left alone.
pub fn close_objects(schema: &mut serde_json::Value) {
    match schema {
        serde_json::Value::Object(o) => {
            for (k, v) in o.iter_mut() {
                if !matches!(
                    k.as_str(),
                    "const" | "enum" | "default" | "examples" | "x-guidance"
                ) {
                    close_objects(v);
                }
            }
            if (o.contains_key("properties") || o.contains_key("patternProperties"))
                && !o.contains_key("additionalProperties")
            {
                o.insert(
                    "additionalProperties".into(),
                    serde_json::Value::Bool(false),
                );
            }
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(close_objects),
        _ => {}
    }
}

/// JSON is generated in one canonical layout, `{"a": 1, "b": [2, 3]}` (Python's `json.dumps`
/// separators), unless the schema sets llguidance's own `x-guidance` options. With free
/// whitespace a small model can emit newlines until `max_tokens` (seen with stories260K),
/// which vLLM users avoid with `disable_any_whitespace`; here that is the default.
fn compact(mut schema: serde_json::Value) -> serde_json::Value {
    if let Some(o) = schema.as_object_mut() {
        let x = o
            .entry("x-guidance")
            .or_insert_with(|| serde_json::json!({}));
        // Options the schema sets win; the layout fills in the rest.
        if let Some(x) = x.as_object_mut() {
            for (k, v) in [
                ("whitespace_flexible", serde_json::json!(false)),
                ("item_separator", serde_json::json!(", ")),
                ("key_separator", serde_json::json!(": ")),
            ] {
                x.entry(k).or_insert(v);
            }
        }
    }
    schema
}

/// The model's vocabulary as the grammar compiler sees it: every token's bytes, the EOS ids,
/// and a parser factory shared by every compile. Building it walks the whole vocabulary
/// (tens of milliseconds for 128k tokens); build one per process.
#[derive(Clone)]
pub struct Vocabulary {
    factory: Arc<ParserFactory>,
    vocab_size: usize,
    eos_ids: Arc<[u32]>,
}

impl std::fmt::Debug for Vocabulary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vocabulary")
            .field("vocab_size", &self.vocab_size)
            .finish()
    }
}

impl Vocabulary {
    /// Reads a Hugging Face `tokenizer.json` (byte-level BPE, as Llama 3 and GPT-2, or
    /// SentencePiece with byte fallback, as Llama 2) for a model of `vocab_size` logits, ending a
    /// constrained output on any of `eos_ids` (at least one).
    ///
    /// # Errors
    /// [`GrammarError::Tokenizer`] for an unreadable file, a tokenizer of another kind, more
    /// tokens than `vocab_size`, or no EOS id.
    pub fn from_tokenizer_json(
        path: &Path,
        vocab_size: usize,
        eos_ids: &[u32],
    ) -> Result<Self, GrammarError> {
        let err = |msg: String| GrammarError::Tokenizer {
            path: path.display().to_string(),
            msg,
        };
        let text = std::fs::read(path).map_err(|e| err(e.to_string()))?;
        let json: serde_json::Value =
            serde_json::from_slice(&text).map_err(|e| err(e.to_string()))?;
        Self::from_tokenizer_value(&json, vocab_size, eos_ids).map_err(err)
    }

    /// As [`Vocabulary::from_tokenizer_json`], from the parsed file.
    ///
    /// # Errors
    /// A tokenizer of another kind, more tokens than `vocab_size`, or no EOS id.
    pub fn from_tokenizer_value(
        json: &serde_json::Value,
        vocab_size: usize,
        eos_ids: &[u32],
    ) -> Result<Self, String> {
        // The decoder walks names it does not control (`<0x..>` pieces); a malformed one must
        // be an error, not a panic.
        let words = std::panic::catch_unwind(|| llguidance::token_bytes_from_tokenizer_json(json))
            .map_err(|_| "malformed vocabulary entry".to_owned())?
            .map_err(|e| e.to_string())?;
        Self::from_token_bytes(words, vocab_size, eos_ids)
    }

    /// Builds a vocabulary from each token's bytes (index = token id; special tokens start
    /// with `0xFF`, as llguidance marks them), padded with empty (never allowed) tokens up to
    /// `vocab_size`.
    ///
    /// # Errors
    /// More tokens than `vocab_size`, an EOS id outside it, or none.
    pub fn from_token_bytes(
        mut words: Vec<Vec<u8>>,
        vocab_size: usize,
        eos_ids: &[u32],
    ) -> Result<Self, String> {
        if words.len() > vocab_size {
            return Err(format!(
                "the tokenizer has {} tokens but the model only {vocab_size} logits",
                words.len()
            ));
        }
        let Some(&eos) = eos_ids.first() else {
            return Err("the model has no EOS token id, so a constrained output cannot end".into());
        };
        if let Some(&bad) = eos_ids.iter().find(|&&t| t as usize >= vocab_size) {
            return Err(format!(
                "EOS id {bad} is outside the vocabulary of {vocab_size}"
            ));
        }
        words.resize(vocab_size, Vec::new());
        let info = TokRxInfo::new(vocab_size as u32, eos);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(eos_ids);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        factory.quiet();
        // Errors without the parser's state (which holds the generated text) or the grammar.
        factory.limits_mut().verbose_errors = false;
        Ok(Self {
            factory: Arc::new(factory),
            vocab_size,
            eos_ids: eos_ids.into(),
        })
    }

    /// Logits of the model (the mask covers this many ids).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Compiles `c` into a fresh [`Guide`] at the start of the output.
    ///
    /// # Errors
    /// [`GrammarError::Invalid`] with llguidance's message for a schema, regex or grammar it
    /// rejects (or one that needs a feature it lacks).
    ///
    /// Runs on a thread of its own with [`GRAMMAR_STACK_BYTES`] of stack (a few tens of
    /// microseconds to start), so a deeply nested constraint cannot overflow the caller's.
    pub fn compile(&self, c: &Constraint) -> Result<Guide, GrammarError> {
        std::thread::scope(|s| {
            std::thread::Builder::new()
                .name("baton-grammar".into())
                .stack_size(GRAMMAR_STACK_BYTES)
                .spawn_scoped(s, || self.compile_here(c))
                .map_err(|e| GrammarError::Invalid(format!("no thread to compile on: {e}")))?
                .join()
                .unwrap_or_else(|_| {
                    Err(GrammarError::Invalid(
                        "the constraint compiler failed".into(),
                    ))
                })
        })
    }

    fn compile_here(&self, c: &Constraint) -> Result<Guide, GrammarError> {
        let grammar = c.to_grammar()?;
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| GrammarError::Invalid(compile_error(e, c)))?;
        let mut m = Matcher::new(Ok(parser));
        if let Some(e) = m.get_error() {
            return Err(GrammarError::Invalid(compile_error(e, c)));
        }
        // A grammar that allows nothing at the start (for example, an unsatisfiable schema)
        // is the caller's error, found now rather than as a stuck request.
        let first = m
            .compute_mask()
            .map_err(|e| GrammarError::Invalid(compile_error(e, c)))?;
        if first.is_zero() {
            return Err(GrammarError::Invalid(
                "the constraint allows no output with this model's vocabulary".into(),
            ));
        }
        Ok(Guide {
            m,
            vocab_size: self.vocab_size,
            eos_ids: self.eos_ids.clone(),
            after: None,
        })
    }
}

/// The state of one constrained output: which tokens may come next.
pub struct Guide {
    m: Matcher,
    vocab_size: usize,
    eos_ids: Arc<[u32]>,
    /// Dormant until this token is sampled ([`Guide::start_after`]).
    after: Option<u32>,
}

impl Clone for Guide {
    /// An independent copy at the same point of the output.
    fn clone(&self) -> Self {
        Self {
            m: self.m.deep_clone(),
            vocab_size: self.vocab_size,
            eos_ids: self.eos_ids.clone(),
            after: self.after,
        }
    }
}

impl std::fmt::Debug for Guide {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guide")
            .field("stopped", &self.m.is_stopped())
            .field("after", &self.after)
            .finish()
    }
}

impl Guide {
    /// The same guide, dormant until `token` has been sampled: the constraint then applies
    /// from the next token on (vLLM's structured outputs with a reasoning parser: the model
    /// thinks freely, and the answer after `</think>` is constrained). While dormant,
    /// [`Guide::fill_mask`] allows every token and [`Guide::consume`] only watches for `token`.
    pub fn start_after(mut self, token: u32) -> Self {
        self.after = Some(token);
        self
    }

    /// False while dormant ([`Guide::start_after`]): the row samples unconstrained.
    pub fn is_active(&self) -> bool {
        self.after.is_none()
    }

    /// Writes the mask of tokens allowed next into `out` ([`mask_words`]`(vocab_size)` words,
    /// bit `t % 32` of word `t / 32` set for an allowed token `t`). Once the constraint is
    /// complete only the EOS ids are allowed.
    ///
    /// # Errors
    /// [`GrammarError::Matcher`] when the parser failed (an earlier error, or a limit reached).
    pub fn fill_mask(&mut self, out: &mut [u32]) -> Result<(), GrammarError> {
        if !self.is_active() {
            let n = self.vocab_size.min(out.len() * 32);
            out.fill(0);
            out[..n / 32].fill(u32::MAX);
            if !n.is_multiple_of(32) {
                out[n / 32] = (1u32 << (n % 32)) - 1;
            }
            return Ok(());
        }
        let v = self
            .m
            .compute_mask_or_eos()
            .map_err(|e| GrammarError::Matcher(first_line(e)))?;
        let src = v.as_slice();
        out.fill(0);
        let n = out.len().min(src.len());
        out[..n].copy_from_slice(&src[..n]);
        // Bits past the vocabulary (the last word's tail) stay clear.
        let tail = self.vocab_size % 32;
        if tail != 0 && self.vocab_size / 32 < out.len() {
            out[self.vocab_size / 32] &= (1u32 << tail) - 1;
        }
        Ok(())
    }

    /// Advances past the sampled `token`. Once the constraint is complete (the guide stops by
    /// itself when nothing can follow), an EOS id is accepted and changes nothing.
    ///
    /// # Errors
    /// [`GrammarError::Matcher`] for a token the last mask did not allow.
    pub fn consume(&mut self, token: u32) -> Result<(), GrammarError> {
        if let Some(after) = self.after {
            if token == after {
                self.after = None;
            }
            return Ok(());
        }
        if self.m.is_stopped() && self.eos_ids.contains(&token) && self.m.get_error().is_none() {
            return Ok(());
        }
        self.m
            .consume_token(token)
            .map_err(|e| GrammarError::Matcher(first_line(e)))
    }

    /// True once the constraint is complete and nothing can follow but EOS, or the guide
    /// failed.
    pub fn is_finished(&self) -> bool {
        self.is_active() && self.m.is_stopped()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A byte-level vocabulary: ids 0..256 are the single bytes, then a few words, then EOS.
    fn vocab() -> (Vocabulary, Vec<Vec<u8>>) {
        let mut words: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
        for w in ["yes", "no", "maybe", "{\"", "\":", "true", "false", "12"] {
            words.push(w.as_bytes().to_vec());
        }
        let eos = words.len() as u32;
        words.push(b"\xFF<eos>".to_vec());
        let v = Vocabulary::from_token_bytes(words.clone(), words.len() + 7, &[eos]).unwrap();
        (v, words)
    }

    fn allowed(g: &mut Guide, words: usize) -> Vec<u32> {
        let mut m = vec![0u32; mask_words(words)];
        g.fill_mask(&mut m).unwrap();
        (0..words as u32)
            .filter(|&t| m[t as usize / 32] >> (t % 32) & 1 == 1)
            .collect()
    }

    #[test]
    fn object_schemas_admit_only_their_named_keys_unless_they_say_otherwise() {
        let (v, words) = vocab();
        let n = v.vocab_size();
        // `{"a": 1` so far: a closed object can only end; an open one may go on.
        let after_a = |schema: serde_json::Value| {
            let mut g = v.compile(&Constraint::Json(schema)).unwrap();
            for b in b"{\"a\": 1" {
                g.consume(u32::from(*b)).unwrap();
            }
            allowed(&mut g, n)
        };
        let object = |extra: serde_json::Value| {
            let mut s = serde_json::json!({"type": "object",
                "properties": {"a": {"type": "integer"}}, "required": ["a"]});
            if let Some(o) = extra.as_object() {
                s.as_object_mut().unwrap().extend(o.clone());
            }
            s
        };
        let closed = after_a(object(serde_json::json!({})));
        assert!(closed.contains(&u32::from(b'}')) && !closed.contains(&u32::from(b',')));
        let open = after_a(object(serde_json::json!({"additionalProperties": true})));
        assert!(open.contains(&u32::from(b',')));
        let _ = words;

        // Nested subschemas are closed too; data and explicit settings are not touched.
        let mut s = serde_json::json!({
            "type": "object",
            "properties": {"in": {"properties": {"x": {}}}, "any": {"type": "object"}},
            "$defs": {"d": {"patternProperties": {"^p": {}}}},
            "anyOf": [{"properties": {}}, {"properties": {}, "additionalProperties": {"type": "string"}}],
            "default": {"properties": {}},
            "const": {"properties": 1}
        });
        close_objects(&mut s);
        assert_eq!(s["additionalProperties"], false);
        assert_eq!(s["properties"]["in"]["additionalProperties"], false);
        assert!(s["properties"]["any"].get("additionalProperties").is_none());
        assert_eq!(s["$defs"]["d"]["additionalProperties"], false);
        assert_eq!(s["anyOf"][0]["additionalProperties"], false);
        assert_eq!(s["anyOf"][1]["additionalProperties"]["type"], "string");
        assert!(s["default"].get("additionalProperties").is_none());
        assert!(s["const"].get("additionalProperties").is_none());
    }

    #[test]
    fn a_guide_started_after_a_token_is_free_until_that_token_then_constrains() {
        let (v, words) = vocab();
        let n = v.vocab_size();
        let id = |w: &str| words.iter().position(|x| x == w.as_bytes()).unwrap() as u32;
        let end = id("maybe"); // stands for `</think>`
        let mut g = v
            .compile(&Constraint::Choice(vec!["yes".into()]))
            .unwrap()
            .start_after(end);
        assert!(!g.is_active() && !g.is_finished());
        // Dormant: every token of the model (padding included), any token consumed.
        assert_eq!(allowed(&mut g, n), (0..n as u32).collect::<Vec<_>>());
        for t in [id("no"), u32::from(b'x'), id("true")] {
            g.consume(t).unwrap();
        }
        assert!(!g.is_active());
        g.consume(end).unwrap();
        assert!(g.is_active());
        // Now the constraint, from its start: "no" is refused.
        let first = allowed(&mut g, n);
        assert!(first.contains(&id("yes")) && !first.contains(&id("no")));
        assert!(g.consume(id("no")).is_err());
        // A clone keeps the state.
        let mut g = v
            .compile(&Constraint::Choice(vec!["yes".into()]))
            .unwrap()
            .start_after(end);
        let c = g.clone();
        assert!(!c.is_active());
        g.consume(end).unwrap();
        g.consume(id("yes")).unwrap();
        assert_eq!(allowed(&mut g, n), vec![words.len() as u32 - 1]);
    }

    #[test]
    fn choice_allows_only_prefixes_of_the_choices_then_eos() {
        let (v, words) = vocab();
        let n = v.vocab_size();
        let mut g = v
            .compile(&Constraint::Choice(vec!["yes".into(), "no".into()]))
            .unwrap();
        let first = allowed(&mut g, n);
        let id = |w: &str| words.iter().position(|x| x == w.as_bytes()).unwrap() as u32;
        assert!(first.contains(&id("yes")) && first.contains(&id("no")));
        assert!(first.contains(&u32::from(b'y')) && first.contains(&u32::from(b'n')));
        assert!(!first.contains(&id("maybe")) && !first.contains(&u32::from(b'm')));
        // Nothing past the vocabulary's words (the padding) is allowed.
        assert!(first.iter().all(|&t| (t as usize) < words.len()));
        g.consume(id("no")).unwrap();
        let eos = words.len() as u32 - 1;
        assert_eq!(allowed(&mut g, n), vec![eos]);
        g.consume(eos).unwrap();
        assert!(g.is_finished());
    }

    #[test]
    fn a_refused_token_is_an_error() {
        let (v, _) = vocab();
        let mut g = v.compile(&Constraint::Regex("[0-9]+".into())).unwrap();
        assert!(g.consume(u32::from(b'x')).is_err());
    }

    #[test]
    fn bad_constraints_are_errors_naming_the_problem() {
        let (v, _) = vocab();
        assert!(v.compile(&Constraint::Regex("(".into())).is_err());
        assert!(v.compile(&Constraint::Choice(vec![])).is_err());
        assert!(v
            .compile(&Constraint::Grammar("start: undefined_rule".into()))
            .is_err());
        assert!(v.compile(&Constraint::Json(serde_json::json!(3))).is_err());
        let e = v
            .compile(&Constraint::Json(serde_json::json!({"type": "nosuchtype"})))
            .unwrap_err();
        assert!(matches!(e, GrammarError::Invalid(_)), "{e}");
    }

    #[test]
    fn json_schema_starts_with_an_object() {
        let (v, words) = vocab();
        let schema = serde_json::json!({
            "type": "object",
            "properties": {"ok": {"type": "boolean"}},
            "required": ["ok"],
            "additionalProperties": false
        });
        let mut g = v.compile(&Constraint::Json(schema)).unwrap();
        let first = allowed(&mut g, v.vocab_size());
        assert!(first.contains(&u32::from(b'{')));
        assert!(!first.contains(&u32::from(b'[')) && !first.contains(&u32::from(b'"')));
        let eos = words.len() as u32 - 1;
        assert!(!first.contains(&eos));
    }

    #[test]
    fn wire_form_round_trips() {
        for c in [
            Constraint::Json(serde_json::json!({"type": "string"})),
            Constraint::JsonObject,
            Constraint::Regex("a+".into()),
            Constraint::Choice(vec!["x".into(), "y|z".into()]),
            Constraint::Grammar("start: \"a\"".into()),
        ] {
            assert_eq!(Constraint::from_wire(&c.to_wire()).unwrap(), c);
        }
        assert!(Constraint::from_wire(b"{").is_err());
    }

    #[test]
    fn vocabulary_checks_its_inputs() {
        assert!(Vocabulary::from_token_bytes(vec![b"a".to_vec(); 4], 3, &[0]).is_err());
        assert!(Vocabulary::from_token_bytes(vec![b"a".to_vec(); 4], 4, &[]).is_err());
        assert!(Vocabulary::from_token_bytes(vec![b"a".to_vec(); 4], 4, &[9]).is_err());
    }
}
