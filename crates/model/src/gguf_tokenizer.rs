//! A GGUF file's tokenizer (`tokenizer.ggml.*` metadata) as Hugging Face `tokenizer.json` and
//! `tokenizer_config.json`.
//!
//! Only SentencePiece tokenizers (`tokenizer.ggml.model == "llama"`: Llama 1/2, Mistral v0.1,
//! TinyLlama, ...) are converted, the way Hugging Face transformers converts them
//! (`transformers/integrations/ggml.py` `GGUFLlamaConverter`, itself a
//! `convert_slow_tokenizer.py` `LlamaConverter`, with the merges `SentencePieceExtractor` /
//! `generate_merges` derives from the vocabulary and the scores). The result is the "legacy"
//! Llama-2 layout: a byte-fallback BPE model, normalizer `Prepend("▁")` + `Replace(" ", "▁")`,
//! no pre-tokenizer, decoder `Replace("▁", " ")` + `ByteFallback` + `Fuse` + `Strip(1 leading
//! space)`, and a `TemplateProcessing` post-processor adding BOS/EOS.
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
//!   `LlamaTokenizer` conversion makes them (transformers' GGUF path adds only control ones).

use std::collections::{BTreeMap, HashMap, HashSet};

use serde_json::{json, Map, Value};

use crate::gguf::GgufValue;

/// SentencePiece's whitespace symbol (U+2581).
const SPIECE_UNDERLINE: &str = "\u{2581}";

/// `tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`, SentencePiece's piece
/// types) that matter here.
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

/// Builds Hugging Face `tokenizer.json` and `tokenizer_config.json` (in that order) from a
/// GGUF file's `tokenizer.*` metadata, for SentencePiece (`tokenizer.ggml.model = "llama"`)
/// tokenizers, as transformers converts a GGUF llama tokenizer (`integrations/ggml.py`
/// `GGUFLlamaConverter` and `convert_slow_tokenizer.py` `LlamaConverter` /
/// `SentencePieceExtractor`; the deviations are listed in the module documentation).
///
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
/// # Errors
/// A message naming the metadata key and suggesting `--tokenizer DIR` when
/// `tokenizer.ggml.model` is missing or not `"llama"` (GPT-2 style BPE, WordPiece, Unigram,
/// RWKV, ... are not converted), when `tokenizer.ggml.tokens` is missing or empty, when an
/// array is ill-typed or its length differs from the tokens', when the scores are missing
/// and there are no merges, when a merge is not two vocabulary tokens whose concatenation is
/// one, when a token id is not an integer inside the vocabulary, when a flag is not a
/// boolean or the chat template not a string, or when BOS/EOS is to be added but has no id.
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
    if model != "llama" {
        return Err(refuse(
            KEY_MODEL,
            format!(
                "is {model:?}: only SentencePiece tokenizers (\"llama\") can be converted from \
                 GGUF metadata"
            ),
        ));
    }
    let tokens: Vec<&str> = array(meta, KEY_TOKENS, None, "strings", GgufValue::as_str)?
        .ok_or_else(|| refuse(KEY_TOKENS, "is missing"))?;
    let n = tokens.len();
    if n == 0 {
        return Err(refuse(KEY_TOKENS, "is empty"));
    }
    let types = array(meta, KEY_TYPES, Some(n), "integers", GgufValue::as_int)?;
    let scores = array(meta, KEY_SCORES, Some(n), "numbers", GgufValue::as_f64)?;
    let given_merges = array(meta, KEY_MERGES, None, "strings", GgufValue::as_str)?;
    let unk = token_id(meta, KEY_UNK, n)?;
    let bos = token_id(meta, KEY_BOS, n)?;
    let eos = token_id(meta, KEY_EOS, n)?;
    let pad = token_id(meta, KEY_PAD, n)?;
    let add_bos = flag(meta, KEY_ADD_BOS)?.unwrap_or(bos.is_some());
    let add_eos = flag(meta, KEY_ADD_EOS)?.unwrap_or(false);
    let add_prefix_space = flag(meta, KEY_ADD_SPACE_PREFIX)?.unwrap_or(true);
    if add_bos && bos.is_none() {
        return Err(refuse(
            KEY_BOS,
            format!("is missing but `{KEY_ADD_BOS}` is true"),
        ));
    }
    if add_eos && eos.is_none() {
        return Err(refuse(
            KEY_EOS,
            format!("is missing but `{KEY_ADD_EOS}` is true"),
        ));
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

    // The vocabulary; a repeated token keeps its first position and its last id, as Python's
    // `{word: i for i, word in enumerate(tokens)}` does.
    let mut vocab_ids: HashMap<&str, usize> = HashMap::with_capacity(n);
    let mut vocab = Map::new();
    for (i, &t) in tokens.iter().enumerate() {
        vocab_ids.insert(t, i);
        vocab.insert(t.to_string(), json!(i));
    }

    let merges: Vec<(&str, &str)> = match &given_merges {
        Some(list) => {
            let mut out = Vec::with_capacity(list.len());
            for (i, m) in list.iter().enumerate() {
                let pair = m.split_once(' ').filter(|(l, r)| {
                    !r.contains(' ')
                        && vocab_ids.contains_key(l)
                        && vocab_ids.contains_key(r)
                        && vocab_ids.contains_key(format!("{l}{r}").as_str())
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
            spm_merges(&tokens, scores, &vocab_ids)
        }
    };

    // Added tokens by id: (content, special).
    let mut added: BTreeMap<usize, (&str, bool)> = BTreeMap::new();
    let mut add = |i: usize, special: bool| {
        let t = tokens[i];
        if t.is_empty() {
            return;
        }
        if let Some(&id) = vocab_ids.get(t) {
            let e = added.entry(id).or_insert((t, special));
            e.1 |= special;
        }
    };
    if let Some(types) = &types {
        for (i, &ty) in types.iter().enumerate() {
            match ty {
                TYPE_UNKNOWN | TYPE_CONTROL => add(i, true),
                TYPE_USER_DEFINED => add(i, false),
                _ => {}
            }
        }
    }
    for id in [unk, bos, eos, pad].into_iter().flatten() {
        add(id, true);
    }
    // The entry `tokenizers` writes; with `id` first for tokenizer.json's `added_tokens`.
    let added_token = |id: Option<usize>, content: &str, special: bool| {
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
    };
    let added_tokens: Vec<Value> = added
        .iter()
        .map(|(&id, &(content, special))| added_token(Some(id), content, special))
        .collect();

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
    let named = |id: Option<usize>| id.map(|i| (tokens[i], i));
    let tokenizer_json = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added_tokens,
        "normalizer": {"type": "Sequence", "normalizers": normalizers},
        "pre_tokenizer": null,
        "post_processor": post_processor(
            named(bos).filter(|_| add_bos),
            named(eos).filter(|_| add_eos),
        ),
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": unk.map(|i| tokens[i]),
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": true,
            "byte_fallback": true,
            "ignore_merges": false,
            "vocab": vocab,
            "merges": merges.iter().map(|(l, r)| json!([l, r])).collect::<Vec<_>>(),
        },
    });

    let mut config = Map::new();
    config.insert("add_bos_token".into(), json!(add_bos));
    config.insert("add_eos_token".into(), json!(add_eos));
    let decoder: Map<String, Value> = added
        .iter()
        .map(|(&id, &(content, special))| (id.to_string(), added_token(None, content, special)))
        .collect();
    config.insert("added_tokens_decoder".into(), Value::Object(decoder));
    for (key, id) in [
        ("bos_token", bos),
        ("eos_token", eos),
        ("unk_token", unk),
        ("pad_token", pad),
    ] {
        if let Some(i) = id {
            config.insert(key.into(), json!(tokens[i]));
        }
    }
    if let Some(t) = chat_template {
        config.insert("chat_template".into(), json!(t));
    }
    config.insert("clean_up_tokenization_spaces".into(), json!(false));
    config.insert("legacy".into(), json!(true));
    if let Some(m) = max_len {
        config.insert("model_max_length".into(), json!(m));
    }
    config.insert("tokenizer_class".into(), json!("LlamaTokenizer"));
    Ok((tokenizer_json, Value::Object(config)))
}
