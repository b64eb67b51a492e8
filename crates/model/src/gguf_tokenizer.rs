//! A GGUF file's tokenizer (`tokenizer.ggml.*` metadata) as Hugging Face `tokenizer.json` and
//! `tokenizer_config.json`.
//!
//! Two kinds of tokenizer are converted:
//!
//! - SentencePiece (`tokenizer.ggml.model == "llama"`: Llama 1/2, Mistral v0.1, TinyLlama, ...),
//!   the way Hugging Face transformers converts them (`transformers/integrations/ggml.py`
//!   `GGUFLlamaConverter`, itself a `convert_slow_tokenizer.py` `LlamaConverter`, with the
//!   merges `SentencePieceExtractor` / `generate_merges` derives from the vocabulary and the
//!   scores). The result is the "legacy" Llama-2 layout: a byte-fallback BPE model, normalizer
//!   `Prepend("▁")` + `Replace(" ", "▁")`, no pre-tokenizer, decoder `Replace("▁", " ")` +
//!   `ByteFallback` + `Fuse` + `Strip(1 leading space)`, and a `TemplateProcessing`
//!   post-processor adding BOS/EOS.
//! - byte-level BPE (`tokenizer.ggml.model == "gpt2"`: Llama 3.x, Qwen 2/2.5/3, SmolLM/SmolLM2,
//!   GPT-2), for the pre-tokenizers (`tokenizer.ggml.pre`) whose Hugging Face `tokenizer.json`
//!   layout is pinned here ([`BPE_PRE_TOKENIZERS`]); the vocabulary and merges are taken as they
//!   are (llama.cpp's `convert_hf_to_gguf.py` copies them from the model's `tokenizer.json`),
//!   and the normalizer, pre-tokenizer, post-processor, decoder and BPE options are those of the
//!   family's own `tokenizer.json`, which is what transformers' `GGUFGPTConverter` /
//!   `GGUFQwen2Converter` / Llama-3 branch of `GGUFLlamaConverter` aim at (see `tokenizer_files`).
//!
//! Differences from transformers, each where transformers' GGUF path is broken or lossy:
//! - the merges are ordered as `SentencePieceExtractor` orders them (score, then the lengths
//!   of the two parts, descending), not as `GGUFTokenizerSkeleton` does (score only, which
//!   breaks ties differently from the slow `LlamaTokenizer` conversion);
//! - when every score is the same (llama.cpp's `LlamaHfVocab`, used by `convert_hf_to_gguf.py`
//!   for models shipped with only `tokenizer.json`, writes -1000 for every token), the scores
//!   carry no merge order, and the token id stands in for it (score = -id): SentencePiece
//!   BPE vocabularies list their pieces in merge order;
//! - `bos_token`/`eos_token` in `tokenizer_config.json` are the BOS/EOS pieces (transformers
//!   swaps them and takes EOS's text from the BOS id);
//! - control, unknown and user-defined tokens all become added tokens, as the slow
//!   `LlamaTokenizer` conversion makes them (transformers' GGUF path adds only control ones);
//! - byte-level BPE: transformers gives a Llama 3 GGUF a plain `ByteLevel(use_regex=True)`
//!   pre-tokenizer (GPT-2's regex, not Llama 3's: numbers and contractions split differently)
//!   and `ignore_merges: false`, gives Qwen2 only `<|endoftext|>`, `<|im_start|>` and
//!   `<|im_end|>` as added tokens, and has no SmolLM converter; here each family gets its own
//!   `tokenizer.json` layout and every control/user-defined token is an added token.

use std::collections::{BTreeMap, HashMap, HashSet};

use serde_json::{json, Map, Value};

use crate::gguf::GgufValue;

/// SentencePiece's whitespace symbol (U+2581).
const SPIECE_UNDERLINE: &str = "\u{2581}";

/// `tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`, SentencePiece's piece
/// types) that matter here.
const TYPE_NORMAL: i128 = 1;
const TYPE_UNKNOWN: i128 = 2;
const TYPE_CONTROL: i128 = 3;
const TYPE_USER_DEFINED: i128 = 4;

const KEY_MODEL: &str = "tokenizer.ggml.model";
const KEY_TOKENS: &str = "tokenizer.ggml.tokens";
const KEY_SCORES: &str = "tokenizer.ggml.scores";
const KEY_TYPES: &str = "tokenizer.ggml.token_type";
const KEY_MERGES: &str = "tokenizer.ggml.merges";
const KEY_BOS: &str = "tokenizer.ggml.bos_token_id";
const KEY_EOS: &str = "tokenizer.ggml.eos_token_id";
const KEY_UNK: &str = "tokenizer.ggml.unknown_token_id";
const KEY_PAD: &str = "tokenizer.ggml.padding_token_id";
const KEY_ADD_BOS: &str = "tokenizer.ggml.add_bos_token";
const KEY_ADD_EOS: &str = "tokenizer.ggml.add_eos_token";
const KEY_ADD_SPACE_PREFIX: &str = "tokenizer.ggml.add_space_prefix";
const KEY_CHAT_TEMPLATE: &str = "tokenizer.chat_template";
const KEY_PRE: &str = "tokenizer.ggml.pre";

/// The `tokenizer.ggml.pre` values of byte-level BPE (`tokenizer.ggml.model == "gpt2"`)
/// tokenizers that [`tokenizer_files`] converts: llama.cpp's names (`src/llama-vocab.cpp`,
/// `llama_vocab::impl::load`) for the pre-tokenizers whose Hugging Face `tokenizer.json` layout
/// is known exactly. `llama-bpe` (what `convert_hf_to_gguf.py` writes for Llama 3.x),
/// `llama3` and `llama-v3` are one pre-tokenizer in llama.cpp; `qwen2` is Qwen 2/2.5/3's,
/// `smollm` SmolLM's and SmolLM2's, `gpt-2` GPT-2's. Others (`tekken`, `deepseek-llm`,
/// `falcon3`, `pixtral`, `lfm2`, `deepseek-r1-qwen`, `starcoder`, ...) are refused: their
/// `tokenizer.json` files differ in ways (normalizer, `ignore_merges`, post-processor, the
/// regex itself) that the llama.cpp name does not pin down.
pub const BPE_PRE_TOKENIZERS: &[&str] = &[
    "llama-bpe",
    "llama3",
    "llama-v3",
    "qwen2",
    "smollm",
    "gpt-2",
];

/// Llama 3's pre-tokenizer regex: `tokenizer.json` of meta-llama/Meta-Llama-3-8B and of the
/// Llama 3.1/3.2/3.3 models, the `Split` pattern; llama.cpp keeps the same text as "original
/// regex from tokenizer.json" (`src/llama-vocab.cpp`, `LLAMA_VOCAB_PRE_TYPE_LLAMA3`). The
/// tiktoken `cl100k_base` pattern: digits in runs of at most three.
const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen 2's pre-tokenizer regex: `tokenizer.json` of Qwen/Qwen2-*, Qwen2.5-* and Qwen3-*, the
/// `Split` pattern (also transformers' `convert_slow_tokenizer.py` `Qwen2Converter`); llama.cpp
/// keeps it as "original regex from tokenizer.json" (`LLAMA_VOCAB_PRE_TYPE_QWEN2`). Llama 3's
/// with single digits.
const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The error for a metadata key that cannot be converted: names the key and the way out.
fn refuse(key: &str, problem: impl std::fmt::Display) -> String {
    format!(
        "GGUF metadata `{key}` {problem}; pass `--tokenizer DIR` with the base model's \
         Hugging Face tokenizer (tokenizer.json and tokenizer_config.json)"
    )
}

/// An optional array of `len` elements (when `len` is given), each converted by `elem`.
fn array<'a, T>(
    meta: &'a BTreeMap<String, GgufValue>,
    key: &str,
    len: Option<usize>,
    what: &str,
    elem: impl Fn(&'a GgufValue) -> Option<T>,
) -> Result<Option<Vec<T>>, String> {
    let Some(v) = meta.get(key) else {
        return Ok(None);
    };
    let items = v.as_array().ok_or_else(|| {
        refuse(
            key,
            format!("is a {}, not an array of {what}", v.type_name()),
        )
    })?;
    if let Some(n) = len {
        if items.len() != n {
            return Err(refuse(
                key,
                format!(
                    "has {} elements but `{KEY_TOKENS}` has {n}: the arrays are inconsistent",
                    items.len()
                ),
            ));
        }
    }
    items
        .iter()
        .enumerate()
        .map(|(i, x)| {
            elem(x).ok_or_else(|| {
                refuse(
                    key,
                    format!("element {i} is a {}, not {what}", x.type_name()),
                )
            })
        })
        .collect::<Result<Vec<T>, String>>()
        .map(Some)
}

/// An optional token id, checked against the vocabulary size `n`.
fn token_id(
    meta: &BTreeMap<String, GgufValue>,
    key: &str,
    n: usize,
) -> Result<Option<usize>, String> {
    let Some(v) = meta.get(key) else {
        return Ok(None);
    };
    let id = v.as_int().ok_or_else(|| {
        refuse(
            key,
            format!("is a {}, not an integer token id", v.type_name()),
        )
    })?;
    match usize::try_from(id) {
        Ok(i) if i < n => Ok(Some(i)),
        _ => Err(refuse(
            key,
            format!("is {id}, outside the vocabulary (`{KEY_TOKENS}` has {n} tokens)"),
        )),
    }
}

/// An optional boolean flag.
fn flag(meta: &BTreeMap<String, GgufValue>, key: &str) -> Result<Option<bool>, String> {
    match meta.get(key) {
        None => Ok(None),
        Some(v) => v
            .as_bool()
            .map(Some)
            .ok_or_else(|| refuse(key, format!("is a {}, not a boolean", v.type_name()))),
    }
}

/// The sort key of a score: NaN ranks last, and -0.0 equals 0.0 (as in Python).
fn score_key(s: f64) -> f64 {
    if s.is_nan() {
        f64::NEG_INFINITY
    } else {
        s + 0.0
    }
}

/// The BPE merges of a SentencePiece BPE vocabulary, as transformers' `generate_merges`
/// (`SentencePieceExtractor`) derives them: for every distinct piece (in order of first
/// appearance, with the score of its last appearance), every split into two parts that are
/// both in the vocabulary, ranked by the piece's score, then the left part's length, then the
/// right part's (all descending, lengths in characters), ties kept in vocabulary order.
///
/// `vocab` maps each piece to its last id. When every score is the same, `-id` is used
/// instead (see the module documentation). Each split costs a look-up of the two parts'
/// byte lengths, and of the parts themselves only where both lengths occur in the
/// vocabulary, so the work is about linear in the total length of the pieces (a huge token
/// costs little more than its length). `generate_merges` also sorts each piece's splits by
/// the parts' ids first; that order never survives the global sort (a piece's splits differ
/// in the left part's length), so it is skipped.
fn spm_merges<'a>(
    tokens: &[&'a str],
    scores: &[f64],
    vocab: &HashMap<&'a str, usize>,
) -> Vec<(&'a str, &'a str)> {
    let uninformative = scores
        .windows(2)
        .all(|w| score_key(w[0]) == score_key(w[1]));
    let lengths: HashSet<usize> = vocab.keys().map(|t| t.len()).collect();
    let mut seen: HashSet<&str> = HashSet::with_capacity(tokens.len());
    // (score, left chars, right chars, left, right)
    let mut ranked: Vec<(f64, usize, usize, &'a str, &'a str)> = Vec::new();
    for &piece in tokens {
        if !seen.insert(piece) {
            continue;
        }
        let Some(&last) = vocab.get(piece) else {
            continue;
        };
        let score = if uninformative {
            -(last as f64)
        } else {
            score_key(scores.get(last).copied().unwrap_or(f64::NAN))
        };
        let chars = piece.chars().count();
        for (k, (at, _)) in piece.char_indices().enumerate().skip(1) {
            if !lengths.contains(&at) || !lengths.contains(&(piece.len() - at)) {
                continue;
            }
            let (left, right) = piece.split_at(at);
            if vocab.contains_key(left) && vocab.contains_key(right) {
                ranked.push((score, k, chars - k, left, right));
            }
        }
    }
    // Stable, descending: Python's `sorted(..., reverse=True)` keeps equal keys in order.
    ranked.sort_by(|a, b| b.0.total_cmp(&a.0).then(b.1.cmp(&a.1)).then(b.2.cmp(&a.2)));
    ranked.into_iter().map(|(_, _, _, l, r)| (l, r)).collect()
}

/// The `tokenizers` `TemplateProcessing` JSON adding `bos` before and `eos` after each
/// sequence (transformers' `LlamaTokenizerFast.update_post_processor`).
fn post_processor(bos: Option<(&str, usize)>, eos: Option<(&str, usize)>) -> Value {
    let special = |t: &str, type_id: u32| json!({"SpecialToken": {"id": t, "type_id": type_id}});
    let seq = |s: &str, type_id: u32| json!({"Sequence": {"id": s, "type_id": type_id}});
    let mut single = Vec::new();
    let mut pair = Vec::new();
    for (name, type_id) in [("A", 0u32), ("B", 1)] {
        let out = if name == "A" { &mut single } else { &mut pair };
        if let Some((t, _)) = bos {
            out.push(special(t, type_id));
        }
        out.push(seq(name, type_id));
        if let Some((t, _)) = eos {
            out.push(special(t, type_id));
        }
    }
    let pair: Vec<Value> = single.iter().cloned().chain(pair).collect();
    let mut special_tokens = Map::new();
    for (t, id) in bos.into_iter().chain(eos) {
        special_tokens.insert(t.to_string(), json!({"id": t, "ids": [id], "tokens": [t]}));
    }
    json!({
        "type": "TemplateProcessing",
        "single": single,
        "pair": pair,
        "special_tokens": special_tokens,
    })
}

/// A byte-level BPE family: the `tokenizer.json` layout that goes with a `tokenizer.ggml.pre`
/// value (see [`BPE_PRE_TOKENIZERS`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BpeFamily {
    /// Llama 3.x (meta-llama/Meta-Llama-3-8B, Llama-3.1/3.2/3.3 `tokenizer.json`).
    Llama3,
    /// Qwen 2, 2.5 and 3 (Qwen/Qwen2.5-0.5B, Qwen3-0.6B, ... `tokenizer.json`).
    Qwen2,
    /// SmolLM and SmolLM2 (HuggingFaceTB/SmolLM2-135M `tokenizer.json`, StarCoder's layout).
    SmolLm,
    /// GPT-2 (openai-community/gpt2 `tokenizer.json`).
    Gpt2,
}

/// `{"type": "ByteLevel", ...}` as `tokenizers` serializes it (pre-tokenizer, post-processor
/// and decoder alike).
fn byte_level(add_prefix_space: bool, trim_offsets: bool, use_regex: bool) -> Value {
    json!({
        "type": "ByteLevel",
        "add_prefix_space": add_prefix_space,
        "trim_offsets": trim_offsets,
        "use_regex": use_regex,
    })
}

/// `Sequence[Split(regex, Isolated), ByteLevel(no prefix space, no regex)]`, the pre-tokenizer
/// of the tiktoken-style `tokenizer.json` files.
fn split_then_byte_level(regex: &str, trim_offsets: bool) -> Value {
    json!({
        "type": "Sequence",
        "pretokenizers": [
            {
                "type": "Split",
                "pattern": {"Regex": regex},
                "behavior": "Isolated",
                "invert": false,
            },
            byte_level(false, trim_offsets, false),
        ],
    })
}

impl BpeFamily {
    /// The family of a `tokenizer.ggml.pre` value, `None` for those not converted.
    fn from_pre(pre: &str) -> Option<Self> {
        match pre {
            "llama-bpe" | "llama3" | "llama-v3" => Some(Self::Llama3),
            "qwen2" => Some(Self::Qwen2),
            "smollm" => Some(Self::SmolLm),
            "gpt-2" => Some(Self::Gpt2),
            _ => None,
        }
    }

    /// `normalizer`: Qwen's NFC (`Qwen2Converter`), none for the others.
    fn normalizer(self) -> Value {
        match self {
            Self::Qwen2 => json!({"type": "NFC"}),
            Self::Llama3 | Self::SmolLm | Self::Gpt2 => Value::Null,
        }
    }

    /// `pre_tokenizer`, as in the family's `tokenizer.json`. SmolLM's `Digits` + GPT-2
    /// `ByteLevel` is llama.cpp's `\p{N}` + GPT-2 regex pair (`LLAMA_VOCAB_PRE_TYPE_SMOLLM`);
    /// GPT-2's `ByteLevel(use_regex)` is `tokenizers`' built-in GPT-2 regex.
    fn pre_tokenizer(self) -> Value {
        match self {
            Self::Llama3 => split_then_byte_level(LLAMA3_REGEX, true),
            Self::Qwen2 => split_then_byte_level(QWEN2_REGEX, false),
            Self::SmolLm => json!({
                "type": "Sequence",
                "pretokenizers": [
                    {"type": "Digits", "individual_digits": true},
                    byte_level(false, true, true),
                ],
            }),
            Self::Gpt2 => byte_level(false, true, true),
        }
    }

    /// The `ByteLevel` post-processor (offsets only; no ids change).
    fn post_byte_level(self) -> Value {
        match self {
            Self::Qwen2 => byte_level(false, false, false),
            Self::Llama3 | Self::SmolLm | Self::Gpt2 => byte_level(true, false, true),
        }
    }

    /// `decoder` (every `ByteLevel` decoder decodes alike; the flags are the files').
    fn decoder(self) -> Value {
        match self {
            Self::Qwen2 => byte_level(false, false, false),
            Self::Llama3 | Self::SmolLm | Self::Gpt2 => byte_level(true, true, true),
        }
    }

    /// `model.ignore_merges`: true for Llama 3 (a word that is a token is that token, as
    /// tiktoken does; llama.cpp sets `ignore_merges` for this pre-tokenizer too).
    fn ignore_merges(self) -> bool {
        self == Self::Llama3
    }

    /// `model.continuing_subword_prefix` / `end_of_word_suffix`: `""` in the Qwen and GPT-2
    /// files (written by the slow-tokenizer converters), null in the others. Same behaviour.
    fn affix(self) -> Value {
        match self {
            Self::Qwen2 | Self::Gpt2 => json!(""),
            Self::Llama3 | Self::SmolLm => Value::Null,
        }
    }

    /// `add_bos_token` when `tokenizer.ggml.add_bos_token` is absent: llama.cpp's default,
    /// true for the Llama 3 pre-tokenizer and false for the other BPE ones
    /// (`llama_vocab::impl::load`).
    fn add_bos_default(self) -> bool {
        self == Self::Llama3
    }

    /// `clean_up_tokenization_spaces`: llama.cpp's `clean_spaces` for the pre-tokenizer (true
    /// for BPE, false for `qwen2` and `smollm`), which is also what the models'
    /// `tokenizer_config.json` say.
    fn clean_up_tokenization_spaces(self) -> bool {
        matches!(self, Self::Llama3 | Self::Gpt2)
    }

    /// `tokenizer_class` of the models' `tokenizer_config.json`.
    fn tokenizer_class(self) -> &'static str {
        match self {
            Self::Llama3 => "PreTrainedTokenizerFast",
            Self::Qwen2 => "Qwen2Tokenizer",
            Self::SmolLm | Self::Gpt2 => "GPT2Tokenizer",
        }
    }
}

/// The entry `tokenizers` writes for an added token (`id` first, for tokenizer.json's
/// `added_tokens`; without it for tokenizer_config.json's `added_tokens_decoder`).
fn added_token_json(id: Option<usize>, content: &str, special: bool) -> Value {
    let mut o = Map::new();
    if let Some(id) = id {
        o.insert("id".into(), json!(id));
    }
    o.insert("content".into(), json!(content));
    for key in ["single_word", "lstrip", "rstrip", "normalized"] {
        o.insert(key.into(), json!(false));
    }
    o.insert("special".into(), json!(special));
    Value::Object(o)
}

/// The metadata both kinds of tokenizer read.
struct Common<'a> {
    tokens: Vec<&'a str>,
    types: Option<Vec<i128>>,
    unk: Option<usize>,
    bos: Option<usize>,
    eos: Option<usize>,
    pad: Option<usize>,
    add_bos: Option<bool>,
    add_eos: Option<bool>,
    chat_template: Option<&'a str>,
    /// Each token to its last id, as Python's `{word: i for i, word in enumerate(tokens)}`.
    vocab_ids: HashMap<&'a str, usize>,
}

impl<'a> Common<'a> {
    fn read(meta: &'a BTreeMap<String, GgufValue>) -> Result<Self, String> {
        let tokens: Vec<&str> = array(meta, KEY_TOKENS, None, "strings", GgufValue::as_str)?
            .ok_or_else(|| refuse(KEY_TOKENS, "is missing"))?;
        let n = tokens.len();
        if n == 0 {
            return Err(refuse(KEY_TOKENS, "is empty"));
        }
        let chat_template = match meta.get(KEY_CHAT_TEMPLATE) {
            None => None,
            Some(v) => Some(v.as_str().ok_or_else(|| {
                refuse(
                    KEY_CHAT_TEMPLATE,
                    format!("is a {}, not a string", v.type_name()),
                )
            })?),
        };
        let mut vocab_ids: HashMap<&str, usize> = HashMap::with_capacity(n);
        for (i, &t) in tokens.iter().enumerate() {
            vocab_ids.insert(t, i);
        }
        Ok(Common {
            types: array(meta, KEY_TYPES, Some(n), "integers", GgufValue::as_int)?,
            unk: token_id(meta, KEY_UNK, n)?,
            bos: token_id(meta, KEY_BOS, n)?,
            eos: token_id(meta, KEY_EOS, n)?,
            pad: token_id(meta, KEY_PAD, n)?,
            add_bos: flag(meta, KEY_ADD_BOS)?,
            add_eos: flag(meta, KEY_ADD_EOS)?,
            chat_template,
            vocab_ids,
            tokens,
        })
    }

    /// The resolved `(add_bos, add_eos)`, checked against the BOS/EOS ids.
    fn add_flags(&self, add_bos_default: bool) -> Result<(bool, bool), String> {
        let add_bos = self.add_bos.unwrap_or(add_bos_default);
        let add_eos = self.add_eos.unwrap_or(false);
        if add_bos && self.bos.is_none() {
            return Err(refuse(
                KEY_BOS,
                format!("is missing but `{KEY_ADD_BOS}` is true"),
            ));
        }
        if add_eos && self.eos.is_none() {
            return Err(refuse(
                KEY_EOS,
                format!("is missing but `{KEY_ADD_EOS}` is true"),
            ));
        }
        Ok((add_bos, add_eos))
    }

    /// tokenizer.json's `model.vocab`, in token order (a repeated token keeps its first
    /// position and its last id).
    fn vocab_json(&self) -> Map<String, Value> {
        let mut vocab = Map::new();
        for &t in &self.tokens {
            vocab.insert(t.to_string(), json!(self.vocab_ids[t]));
        }
        vocab
    }

    /// The added tokens by id, `(content, special)`: control and unknown tokens
    /// (`token_type` 3 and 2) special, user-defined ones (4) not, then the unknown, BOS, EOS
    /// and padding tokens special, except (with `skip_normal`) those typed normal (1). Empty
    /// tokens are never added; a repeated token is added under its last id.
    fn added(&self, skip_normal: bool) -> BTreeMap<usize, (&'a str, bool)> {
        let mut added: BTreeMap<usize, (&str, bool)> = BTreeMap::new();
        let mut add = |i: usize, special: bool| {
            let t = self.tokens[i];
            if t.is_empty() {
                return;
            }
            if let Some(&id) = self.vocab_ids.get(t) {
                let e = added.entry(id).or_insert((t, special));
                e.1 |= special;
            }
        };
        let ty = |i: usize| self.types.as_ref().and_then(|v| v.get(i).copied());
        if let Some(types) = &self.types {
            for (i, &ty) in types.iter().enumerate() {
                match ty {
                    TYPE_UNKNOWN | TYPE_CONTROL => add(i, true),
                    TYPE_USER_DEFINED => add(i, false),
                    _ => {}
                }
            }
        }
        for id in [self.unk, self.bos, self.eos, self.pad]
            .into_iter()
            .flatten()
        {
            if !(skip_normal && ty(id) == Some(TYPE_NORMAL)) {
                add(id, true);
            }
        }
        added
    }

    /// tokenizer_config.json's common part: the flags, `added_tokens_decoder`, the special
    /// token strings, the chat template.
    fn config(
        &self,
        added: &BTreeMap<usize, (&str, bool)>,
        add_bos: bool,
        add_eos: bool,
    ) -> Map<String, Value> {
        let mut config = Map::new();
        config.insert("add_bos_token".into(), json!(add_bos));
        config.insert("add_eos_token".into(), json!(add_eos));
        let decoder: Map<String, Value> = added
            .iter()
            .map(|(&id, &(content, special))| {
                (id.to_string(), added_token_json(None, content, special))
            })
            .collect();
        config.insert("added_tokens_decoder".into(), Value::Object(decoder));
        for (key, id) in [
            ("bos_token", self.bos),
            ("eos_token", self.eos),
            ("unk_token", self.unk),
            ("pad_token", self.pad),
        ] {
            if let Some(i) = id {
                config.insert(key.into(), json!(self.tokens[i]));
            }
        }
        if let Some(t) = self.chat_template {
            config.insert("chat_template".into(), json!(t));
        }
        config
    }
}

/// tokenizer.json's `added_tokens`.
fn added_tokens_json(added: &BTreeMap<usize, (&str, bool)>) -> Vec<Value> {
    added
        .iter()
        .map(|(&id, &(content, special))| added_token_json(Some(id), content, special))
        .collect()
}

/// Builds Hugging Face `tokenizer.json` and `tokenizer_config.json` (in that order) from a
/// GGUF file's `tokenizer.*` metadata, for SentencePiece (`tokenizer.ggml.model = "llama"`)
/// and byte-level BPE (`"gpt2"`, with a `tokenizer.ggml.pre` in [`BPE_PRE_TOKENIZERS`])
/// tokenizers.
///
/// SentencePiece, as transformers converts a GGUF llama tokenizer (`integrations/ggml.py`
/// `GGUFLlamaConverter` and `convert_slow_tokenizer.py` `LlamaConverter` /
/// `SentencePieceExtractor`; the deviations are listed in the module documentation):
/// - `tokenizer.json`: a BPE model (`byte_fallback`, `fuse_unk`, `unk_token` from
///   `tokenizer.ggml.unknown_token_id`) whose vocabulary is `tokenizer.ggml.tokens` (a
///   repeated token maps to its last id) and whose merges come from
///   `tokenizer.ggml.merges` when present, else from the tokens and `tokenizer.ggml.scores`;
///   control and unknown tokens (`tokenizer.ggml.token_type` 3 and 2) and the BOS, EOS,
///   unknown and padding tokens as special added tokens, user-defined ones (type 4) as plain
///   added tokens (empty tokens are never added); the legacy Llama normalizer and decoder
///   (without the leading "▁" and its stripping when `tokenizer.ggml.add_space_prefix` is
///   false); a post-processor adding BOS when `tokenizer.ggml.add_bos_token` (default: when
///   there is a BOS id) and EOS when `tokenizer.ggml.add_eos_token` (default false).
/// - `tokenizer_config.json`: `bos_token`, `eos_token`, `unk_token`, `pad_token` (those with
///   ids), `add_bos_token`, `add_eos_token`, `added_tokens_decoder`, `chat_template`
///   (`tokenizer.chat_template`, when present), `model_max_length` (`max_len`, when given),
///   `clean_up_tokenization_spaces: false`, `legacy: true`.
///
/// Byte-level BPE (`"gpt2"`), as the family that `tokenizer.ggml.pre` names has it in its own
/// `tokenizer.json` (meta-llama/Llama-3.x, Qwen/Qwen2.5 and Qwen3, HuggingFaceTB/SmolLM2,
/// openai-community/gpt2; transformers' GGUF converters `GGUFGPTConverter`,
/// `GGUFQwen2Converter` and the Llama-3 branch of `GGUFLlamaConverter` approximate them, see
/// the module documentation), with llama.cpp's defaults (`src/llama-vocab.cpp`) where the
/// metadata is silent:
/// - `tokenizer.json`: a BPE model (no unknown token, no byte fallback, `ignore_merges` for
///   Llama 3 only) whose vocabulary is `tokenizer.ggml.tokens` (already in byte-level form,
///   "Ġthe"; a repeated token maps to its last id) and whose merges are
///   `tokenizer.ggml.merges` in order, each split at its first space after the first byte as
///   llama.cpp splits it and checked to be two vocabulary tokens whose concatenation is one;
///   control and unknown tokens (`tokenizer.ggml.token_type` 3 and 2) special added tokens,
///   user-defined ones (4) plain added tokens, and the BOS, EOS, unknown and padding tokens
///   special unless typed normal (1); the family's normalizer (NFC for Qwen, else none),
///   pre-tokenizer (the `Split` regex + `ByteLevel`, or `ByteLevel`'s own GPT-2 regex), and
///   `ByteLevel` decoder; a post-processor of `ByteLevel` followed, when BOS or EOS is added,
///   by a `TemplateProcessing` adding them (as Llama 3's file has it). BOS is added when
///   `tokenizer.ggml.add_bos_token`, by default for Llama 3 only (llama.cpp); EOS when
///   `tokenizer.ggml.add_eos_token` (default false).
/// - `tokenizer_config.json`: as for SentencePiece, with the family's
///   `clean_up_tokenization_spaces` and `tokenizer_class`, and no `legacy`.
///
/// Control tokens that the model's own file marks as not special but llama.cpp's converter
/// types as control because they look special (Qwen's `<|fim_prefix|>`, `<|repo_name|>`, ...)
/// come out special: the GGUF no longer tells them apart. Encoding is the same either way;
/// only decoding with `skip_special_tokens` drops them.
///
/// # Errors
/// A message naming the metadata key and suggesting `--tokenizer DIR` when
/// `tokenizer.ggml.model` is missing or neither `"llama"` nor `"gpt2"` (WordPiece, Unigram,
/// RWKV, ... are not converted), when a `"gpt2"` tokenizer's `tokenizer.ggml.pre` is missing
/// or not one of [`BPE_PRE_TOKENIZERS`], when `tokenizer.ggml.tokens` is missing or empty,
/// when an array is ill-typed or its length differs from the tokens', when the scores are
/// missing and there are no merges (SentencePiece) or the merges are missing (BPE), when a
/// merge is not two vocabulary tokens whose concatenation is one, when a token id is not an
/// integer inside the vocabulary, when a flag is not a boolean or the chat template not a
/// string, or when BOS/EOS is to be added but has no id.
pub fn tokenizer_files(
    meta: &BTreeMap<String, GgufValue>,
    max_len: Option<usize>,
) -> Result<(Value, Value), String> {
    let model = match meta.get(KEY_MODEL) {
        None => return Err(refuse(KEY_MODEL, "is missing")),
        Some(v) => v
            .as_str()
            .ok_or_else(|| refuse(KEY_MODEL, format!("is a {}, not a string", v.type_name())))?,
    };
    match model {
        "llama" => spm_files(meta, max_len),
        "gpt2" => bpe_files(meta, max_len),
        _ => Err(refuse(
            KEY_MODEL,
            format!(
                "is {model:?}: only SentencePiece (\"llama\") and byte-level BPE (\"gpt2\") \
                 tokenizers can be converted from GGUF metadata"
            ),
        )),
    }
}

/// The SentencePiece (`"llama"`) conversion of [`tokenizer_files`].
fn spm_files(
    meta: &BTreeMap<String, GgufValue>,
    max_len: Option<usize>,
) -> Result<(Value, Value), String> {
    let c = Common::read(meta)?;
    let n = c.tokens.len();
    let scores = array(meta, KEY_SCORES, Some(n), "numbers", GgufValue::as_f64)?;
    let given_merges = array(meta, KEY_MERGES, None, "strings", GgufValue::as_str)?;
    let (add_bos, add_eos) = c.add_flags(c.bos.is_some())?;
    let add_prefix_space = flag(meta, KEY_ADD_SPACE_PREFIX)?.unwrap_or(true);

    let merges: Vec<(&str, &str)> = match &given_merges {
        Some(list) => {
            let mut out = Vec::with_capacity(list.len());
            for (i, m) in list.iter().enumerate() {
                let pair = m.split_once(' ').filter(|(l, r)| {
                    !r.contains(' ')
                        && c.vocab_ids.contains_key(l)
                        && c.vocab_ids.contains_key(r)
                        && c.vocab_ids.contains_key(format!("{l}{r}").as_str())
                });
                match pair {
                    Some(p) => out.push(p),
                    None => {
                        return Err(refuse(
                            KEY_MERGES,
                            format!(
                                "element {i} ({m:?}) is not two tokens separated by a space \
                                 whose concatenation is a token"
                            ),
                        ))
                    }
                }
            }
            out
        }
        None => {
            let scores = scores.as_deref().ok_or_else(|| {
                refuse(KEY_SCORES, format!("is missing (and so is `{KEY_MERGES}`)"))
            })?;
            spm_merges(&c.tokens, scores, &c.vocab_ids)
        }
    };

    let added = c.added(false);
    let mut normalizers = Vec::new();
    if add_prefix_space {
        normalizers.push(json!({"type": "Prepend", "prepend": SPIECE_UNDERLINE}));
    }
    normalizers.push(json!({
        "type": "Replace",
        "pattern": {"String": " "},
        "content": SPIECE_UNDERLINE,
    }));
    let mut decoders = vec![
        json!({"type": "Replace", "pattern": {"String": SPIECE_UNDERLINE}, "content": " "}),
        json!({"type": "ByteFallback"}),
        json!({"type": "Fuse"}),
    ];
    if add_prefix_space {
        decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
    }
    let named = |id: Option<usize>| id.map(|i| (c.tokens[i], i));
    let tokenizer_json = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added_tokens_json(&added),
        "normalizer": {"type": "Sequence", "normalizers": normalizers},
        "pre_tokenizer": null,
        "post_processor": post_processor(
            named(c.bos).filter(|_| add_bos),
            named(c.eos).filter(|_| add_eos),
        ),
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": c.unk.map(|i| c.tokens[i]),
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": true,
            "byte_fallback": true,
            "ignore_merges": false,
            "vocab": c.vocab_json(),
            "merges": merges.iter().map(|(l, r)| json!([l, r])).collect::<Vec<_>>(),
        },
    });

    let mut config = c.config(&added, add_bos, add_eos);
    config.insert("clean_up_tokenization_spaces".into(), json!(false));
    config.insert("legacy".into(), json!(true));
    if let Some(m) = max_len {
        config.insert("model_max_length".into(), json!(m));
    }
    config.insert("tokenizer_class".into(), json!("LlamaTokenizer"));
    Ok((tokenizer_json, sort_config(config)))
}

/// tokenizer_config.json with its keys sorted, as transformers writes it.
fn sort_config(config: Map<String, Value>) -> Value {
    let sorted: BTreeMap<String, Value> = config.into_iter().collect();
    Value::Object(sorted.into_iter().collect())
}

/// The byte-level BPE (`"gpt2"`) conversion of [`tokenizer_files`] (documented there).
fn bpe_files(
    meta: &BTreeMap<String, GgufValue>,
    max_len: Option<usize>,
) -> Result<(Value, Value), String> {
    let family = match meta.get(KEY_PRE) {
        None => {
            return Err(refuse(
                KEY_PRE,
                format!(
                    "is missing (llama.cpp would fall back to a generic pre-tokenizer); the \
                     byte-level BPE pre-tokenizers converted are {}",
                    BPE_PRE_TOKENIZERS.join(", ")
                ),
            ))
        }
        Some(v) => {
            let pre = v
                .as_str()
                .ok_or_else(|| refuse(KEY_PRE, format!("is a {}, not a string", v.type_name())))?;
            BpeFamily::from_pre(pre).ok_or_else(|| {
                refuse(
                    KEY_PRE,
                    format!(
                        "is {pre:?}, a pre-tokenizer whose Hugging Face tokenizer.json layout is \
                         not known here (those converted are {})",
                        BPE_PRE_TOKENIZERS.join(", ")
                    ),
                )
            })?
        }
    };
    let c = Common::read(meta)?;
    let list = array(meta, KEY_MERGES, None, "strings", GgufValue::as_str)?.ok_or_else(|| {
        refuse(
            KEY_MERGES,
            "is missing (a \"gpt2\" tokenizer needs its merges)",
        )
    })?;
    let (add_bos, add_eos) = c.add_flags(family.add_bos_default())?;

    let mut merges = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        // llama.cpp: `word.find(' ', 1)`; a space is one byte, so both halves are `str`s.
        let pair = m
            .bytes()
            .skip(1)
            .position(|b| b == b' ')
            .map(|p| (&m[..p + 1], &m[p + 2..]))
            .filter(|(l, r)| {
                !r.is_empty()
                    && c.vocab_ids.contains_key(l)
                    && c.vocab_ids.contains_key(r)
                    && c.vocab_ids.contains_key(format!("{l}{r}").as_str())
            });
        match pair {
            Some((l, r)) => merges.push(json!([l, r])),
            None => {
                return Err(refuse(
                    KEY_MERGES,
                    format!(
                        "element {i} ({m:?}) is not two tokens separated by a space whose \
                         concatenation is a token"
                    ),
                ))
            }
        }
    }

    let added = c.added(true);
    let named = |id: Option<usize>| id.map(|i| (c.tokens[i], i));
    let post = if add_bos || add_eos {
        json!({
            "type": "Sequence",
            "processors": [
                family.post_byte_level(),
                post_processor(
                    named(c.bos).filter(|_| add_bos),
                    named(c.eos).filter(|_| add_eos),
                ),
            ],
        })
    } else {
        family.post_byte_level()
    };
    let tokenizer_json = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added_tokens_json(&added),
        "normalizer": family.normalizer(),
        "pre_tokenizer": family.pre_tokenizer(),
        "post_processor": post,
        "decoder": family.decoder(),
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": family.affix(),
            "end_of_word_suffix": family.affix(),
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": family.ignore_merges(),
            "vocab": c.vocab_json(),
            "merges": merges,
        },
    });

    let mut config = c.config(&added, add_bos, add_eos);
    config.insert(
        "clean_up_tokenization_spaces".into(),
        json!(family.clean_up_tokenization_spaces()),
    );
    if let Some(m) = max_len {
        config.insert("model_max_length".into(), json!(m));
    }
    config.insert("tokenizer_class".into(), json!(family.tokenizer_class()));
    Ok((tokenizer_json, sort_config(config)))
}
