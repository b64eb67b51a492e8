//! Byte-level BPE (`tokenizer.ggml.model == "gpt2"`) GGUF tokenizers.
//!
//! No real gpt2-type GGUF or Hugging Face byte-level tokenizer.json is available offline, so:
//! - for each supported `tokenizer.ggml.pre` family, a small byte-level BPE is trained here with
//!   the `tokenizers` trainer inside that family's own tokenizer.json skeleton (normalizer,
//!   pre-tokenizer, post-processor, decoder, as pinned below), given added tokens the way the
//!   real models have them, and turned into GGUF-style metadata as llama.cpp's
//!   `convert_hf_to_gguf.py` writes it (tokens by id, "a b" merges, token types, special ids,
//!   `[PAD{i}]` unused tokens past the vocabulary); the conversion must encode and decode a few
//!   hundred varied texts exactly as the trained tokenizer does, directly and through Baton's
//!   own `Tokenizer`;
//! - the pre-tokenizer, normalizer, decoder and post-processor JSON of each family is pinned
//!   against the text of the models' own tokenizer.json files;
//! - unknown pre-tokenizers and broken metadata are refused, never a panic.

use std::collections::{BTreeMap, HashSet};
use std::str::FromStr;

use baton_model::gguf::GgufValue;
use baton_model::gguf_tokenizer::{tokenizer_files, BPE_PRE_TOKENIZERS};
use baton_model::TokenizerConfig;
use serde_json::{json, Value};
use tokenizers::models::bpe::BpeTrainer;
use tokenizers::models::TrainerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::AddedToken;

use super::{build, i32s, strs};

// The models' own tokenizer.json text, copied key for key (serde_json compares the parsed
// values, so only the order of keys inside an object is free).

/// The `Split` regex of Llama 3's tokenizer.json (meta-llama/Meta-Llama-3-8B and the
/// Llama-3.1/3.2/3.3 models, `pre_tokenizer.pretokenizers[0].pattern.Regex`), as JSON text;
/// llama.cpp `src/llama-vocab.cpp` quotes the same text as the "original regex from
/// tokenizer.json" of `LLAMA_VOCAB_PRE_TYPE_LLAMA3`.
const LLAMA3_REGEX_JSON: &str = r#""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+""#;

/// The `Split` regex of Qwen2/Qwen2.5/Qwen3's tokenizer.json (Qwen/Qwen2.5-0.5B,
/// Qwen/Qwen3-0.6B), as JSON text; llama.cpp quotes it as the "original regex from
/// tokenizer.json" of `LLAMA_VOCAB_PRE_TYPE_QWEN2`, and transformers'
/// `convert_slow_tokenizer.py` `Qwen2Converter` builds the same.
const QWEN2_REGEX_JSON: &str = r#""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+""#;

/// meta-llama/Meta-Llama-3-8B (and Llama-3.1-8B-Instruct, Llama-3.2-1B) tokenizer.json
/// `pre_tokenizer`.
fn llama3_pre_tokenizer() -> String {
    format!(
        r#"{{
    "type": "Sequence",
    "pretokenizers": [
      {{
        "type": "Split",
        "pattern": {{
          "Regex": {LLAMA3_REGEX_JSON}
        }},
        "behavior": "Isolated",
        "invert": false
      }},
      {{
        "type": "ByteLevel",
        "add_prefix_space": false,
        "trim_offsets": true,
        "use_regex": false
      }}
    ]
  }}"#
    )
}

/// Qwen/Qwen2.5-0.5B (and Qwen2-*, Qwen3-*) tokenizer.json `pre_tokenizer`.
fn qwen2_pre_tokenizer() -> String {
    format!(
        r#"{{
    "type": "Sequence",
    "pretokenizers": [
      {{
        "type": "Split",
        "pattern": {{
          "Regex": {QWEN2_REGEX_JSON}
        }},
        "behavior": "Isolated",
        "invert": false
      }},
      {{
        "type": "ByteLevel",
        "add_prefix_space": false,
        "trim_offsets": false,
        "use_regex": false
      }}
    ]
  }}"#
    )
}

/// HuggingFaceTB/SmolLM2-135M (and SmolLM-135M) tokenizer.json `pre_tokenizer`: single digits,
/// then `ByteLevel`'s built-in GPT-2 regex (llama.cpp's `\p{N}` + GPT-2 pair for `smollm`).
const SMOLLM_PRE_TOKENIZER: &str = r#"{
    "type": "Sequence",
    "pretokenizers": [
      {
        "type": "Digits",
        "individual_digits": true
      },
      {
        "type": "ByteLevel",
        "add_prefix_space": false,
        "trim_offsets": true,
        "use_regex": true
      }
    ]
  }"#;

/// openai-community/gpt2 tokenizer.json `pre_tokenizer` (the file predates `use_regex` in the
/// serialization; `tokenizers` reads its absence as `true` and writes it out).
const GPT2_PRE_TOKENIZER: &str =
    r#"{"type":"ByteLevel","add_prefix_space":false,"trim_offsets":true,"use_regex":true}"#;

/// Qwen2.5's tokenizer.json `normalizer`, `post_processor` and `decoder`.
const QWEN2_NORMALIZER: &str = r#"{"type": "NFC"}"#;
const QWEN2_BYTE_LEVEL: &str = r#"{"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}"#;

/// Llama 3's, SmolLM2's and GPT-2's `decoder` (and, with `trim_offsets` false, the `ByteLevel`
/// post-processor).
const DECODER_BYTE_LEVEL: &str =
    r#"{"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true}"#;
const POST_BYTE_LEVEL: &str =
    r#"{"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true}"#;

/// meta-llama/Meta-Llama-3-8B tokenizer.json `post_processor`, `<|begin_of_text|>` = 128000.
const LLAMA3_POST_PROCESSOR: &str = r#"{
    "type": "Sequence",
    "processors": [
      {
        "type": "ByteLevel",
        "add_prefix_space": true,
        "trim_offsets": false,
        "use_regex": true
      },
      {
        "type": "TemplateProcessing",
        "single": [
          {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
          {"Sequence": {"id": "A", "type_id": 0}}
        ],
        "pair": [
          {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
          {"Sequence": {"id": "A", "type_id": 0}},
          {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 1}},
          {"Sequence": {"id": "B", "type_id": 1}}
        ],
        "special_tokens": {
          "<|begin_of_text|>": {
            "id": "<|begin_of_text|>",
            "ids": [128000],
            "tokens": ["<|begin_of_text|>"]
          }
        }
      }
    ]
  }"#;

fn parse(s: &str) -> Value {
    serde_json::from_str(s).expect("pinned JSON parses")
}

/// A family as the tests see it: its `pre` names and the pieces of its tokenizer.json.
struct Family {
    pres: &'static [&'static str],
    normalizer: Value,
    pre_tokenizer: Value,
    decoder: Value,
    /// The post-processor without BOS/EOS.
    post_byte_level: Value,
    ignore_merges: bool,
    /// `continuing_subword_prefix` / `end_of_word_suffix`.
    affix: Value,
    /// (content, special) of the added tokens after the trained vocabulary, the first being
    /// BOS when `bos`.
    added: &'static [(&'static str, bool)],
    bos: bool,
    add_bos_default: bool,
}

fn families() -> Vec<Family> {
    vec![
        Family {
            pres: &["llama-bpe", "llama3", "llama-v3"],
            normalizer: Value::Null,
            pre_tokenizer: parse(&llama3_pre_tokenizer()),
            decoder: parse(DECODER_BYTE_LEVEL),
            post_byte_level: parse(POST_BYTE_LEVEL),
            ignore_merges: true,
            affix: Value::Null,
            added: &[
                ("<|begin_of_text|>", true),
                ("<|end_of_text|>", true),
                ("<|reserved_special_token_0|>", true),
                ("<|start_header_id|>", true),
                ("<|end_header_id|>", true),
                ("<|eot_id|>", true),
                ("<|python_tag|>", true),
            ],
            bos: true,
            add_bos_default: true,
        },
        Family {
            pres: &["qwen2"],
            normalizer: parse(QWEN2_NORMALIZER),
            pre_tokenizer: parse(&qwen2_pre_tokenizer()),
            decoder: parse(QWEN2_BYTE_LEVEL),
            post_byte_level: parse(QWEN2_BYTE_LEVEL),
            ignore_merges: false,
            affix: json!(""),
            // Qwen2.5-0.5B-Instruct's added tokens: `<|...|>` special, `<tool_call>` not.
            added: &[
                ("<|endoftext|>", true),
                ("<|im_start|>", true),
                ("<|im_end|>", true),
                ("<tool_call>", false),
                ("</tool_call>", false),
            ],
            bos: false,
            add_bos_default: false,
        },
        Family {
            pres: &["smollm"],
            normalizer: Value::Null,
            pre_tokenizer: parse(SMOLLM_PRE_TOKENIZER),
            decoder: parse(DECODER_BYTE_LEVEL),
            post_byte_level: parse(POST_BYTE_LEVEL),
            ignore_merges: false,
            affix: Value::Null,
            added: &[
                ("<|endoftext|>", true),
                ("<|im_start|>", true),
                ("<|im_end|>", true),
                ("<repo_name>", true),
            ],
            bos: false,
            add_bos_default: false,
        },
        Family {
            pres: &["gpt-2"],
            normalizer: Value::Null,
            pre_tokenizer: parse(GPT2_PRE_TOKENIZER),
            decoder: parse(DECODER_BYTE_LEVEL),
            post_byte_level: parse(POST_BYTE_LEVEL),
            ignore_merges: false,
            affix: json!(""),
            added: &[("<|endoftext|>", true)],
            bos: false,
            add_bos_default: false,
        },
    ]
}

/// Varied texts: fixed cases (numbers, contractions, whitespace runs, newlines, code, unicode,
/// emoji, special-token strings) plus pseudo-random mixes of them.
fn corpus() -> Vec<String> {
    let fixed = [
        "",
        " ",
        "   ",
        "\n",
        "\n\n\n",
        "\t",
        "\r\n",
        "a",
        "Hello world",
        "Hello, world! How are you today?",
        "The quick brown fox jumps over the lazy dog.",
        "  leading spaces",
        "trailing spaces   ",
        "double  space and   triple    quad",
        "tabs\tand\nnewlines\n\nhere\r\n  indented\n\t\ttabs",
        "1234567",
        "Numbers 12345 and 3.14159, 1,000,000; 42% of 2024-06-01 at 23:59:59",
        "000 0001 99999999999 12 345 6789",
        "I'm sure they'll say it's fine, don't you think? We've seen it. She'd go.",
        "I'M SURE THEY'LL SAY IT'S FINE, DON'T YOU? WE'VE. SHE'D. YOU'RE",
        "rock'n'roll 'quoted' ''double'' 's 't",
        "'Tis the season, 'Twas y'all 'REALLY 'Sure 'DOne 'LLama 'VEry 'Mmm",
        "café naïve résumé Ünïcödé façade Ångström",
        "e\u{301} combining vs é precomposed; A\u{30a}",
        "“quoted” — dashes … ‘single’ «guillemets»",
        "emoji 😀🐱 and 👍🏽 and 🇺🇸 and ❤️ and 👨‍👩‍👧",
        "日本語のテキストとカタカナ ー",
        "中文文本，标点符号。",
        "한국어 텍스트입니다",
        "Привет, мир! Як справи?",
        "مرحبا بالعالم",
        "def f(x):\n    return x ** 2  # comment\n\n\nclass A:\n    pass\n",
        "fn main() {\n    println!(\"{}\", 1 + 2);\n}\n",
        "for (int i = 0; i < n; ++i) { a[i] += b[i] >> 2; }",
        "{\"json\": [1, 2, 3], \"k\": null}",
        "<html><body><p>Hi</p></body></html>",
        "!!!???...,,,;;;:::",
        "$5 & 3¢ @ home #1 ~ ^ | \\ / ` _",
        "\u{0}\u{1}\u{7f}\u{80}\u{ff}",
        "\u{a0}nbsp\u{2009}thin\u{3000}ideographic",
        "a\u{200b}b zero width",
        "<|endoftext|>",
        "text <|endoftext|> in the middle",
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>",
        "<tool_call>{\"name\": \"f\"}</tool_call>",
        "<|endoftext|<|im_start| broken <|eot_id",
        "Ġthe Ċ already byte-level looking",
        "▁metaspace▁looking",
    ];
    let words = [
        "the",
        "The",
        "a",
        "and",
        "of",
        "to",
        "in",
        "is",
        "it",
        "that",
        "for",
        "on",
        "with",
        "as",
        "was",
        "he",
        "she",
        "they",
        "hello",
        "world",
        "Hello",
        "WORLD",
        "token",
        "tokens",
        "tokenizer",
        "byte",
        "level",
        "merge",
        "merges",
        "don't",
        "I'm",
        "we'll",
        "you've",
        "it's",
        "he'd",
        "they're",
        "DON'T",
        "'Tis",
        "'REally",
        "0",
        "7",
        "12",
        "123",
        "1234",
        "12345",
        "3.14",
        "1,000",
        "2024",
        "x1",
        "v2",
        "A1B2",
        "café",
        "über",
        "naïve",
        "中",
        "文",
        "字",
        "日本",
        "😀",
        "🐱",
        "🚀",
        "👍🏽",
        "é",
        "ß",
        "Ω",
        "→",
        "…",
        "—",
        "fn",
        "def",
        "return",
        "self",
        "x",
        "y",
        "i++",
        "==",
        "!=",
        "->",
        "=>",
        "::",
        "()",
        "[]",
        "{}",
        "#",
        "//",
        "/*",
        "*/",
        "\"",
        "'",
        "`",
        "<|endoftext|>",
        "<|im_end|>",
        "<|eot_id|>",
        "<tool_call>",
        "Ġ",
        "Ċ",
    ];
    let seps = [
        " ", " ", " ", " ", "  ", "   ", "\n", "\n\n", "\t", ", ", ". ", "! ", "? ", "; ", ": ",
        "-", "'", "\"", "(", ")", "", " \n ", "\r\n", "    ", "\n    ",
    ];
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = move |n: usize| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % n as u64) as usize
    };
    let mut out: Vec<String> = fixed.iter().map(|s| s.to_string()).collect();
    for _ in 0..300 {
        let mut s = String::new();
        if next(5) == 0 {
            s.push_str(seps[next(seps.len())]);
        }
        for _ in 0..1 + next(16) {
            if next(12) == 0 {
                s.push_str(fixed[next(fixed.len())]);
            } else {
                s.push_str(words[next(words.len())]);
            }
            s.push_str(seps[next(seps.len())]);
        }
        out.push(s);
    }
    out
}

/// The family's tokenizer with a BPE trained on `corpus()` (plus some English), then its added
/// tokens, its post-processor (BOS for Llama 3) and its `ignore_merges`: what a model's own
/// tokenizer.json looks like, in small.
fn reference(f: &Family) -> (tokenizers::Tokenizer, Value) {
    let skeleton = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": f.normalizer,
        "pre_tokenizer": f.pre_tokenizer,
        "post_processor": null,
        "decoder": f.decoder,
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": f.affix,
            "end_of_word_suffix": f.affix,
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": f.ignore_merges,
            "vocab": {},
            "merges": [],
        },
    });
    let mut tok = build(&skeleton);
    let mut trainer: TrainerWrapper = BpeTrainer::builder()
        .vocab_size(1200)
        .min_frequency(2)
        .show_progress(false)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect::<HashSet<char>>())
        .build()
        .into();
    let mut texts = corpus();
    texts.extend(
        [
            "the tokenizer merges the most frequent pairs of bytes into tokens",
            "numbers like 1234567 and 2024 and 3.14159 are split by the pre-tokenizer",
            "Don't worry, they'll see it's fine; we've done this before and I'm sure.",
            "    return self.value  # an indented line of code\n",
        ]
        .iter()
        .flat_map(|s| std::iter::repeat_n(s.to_string(), 20)),
    );
    tok.train(&mut trainer, texts.iter()).expect("trains");
    for &(content, special) in f.added {
        let t = AddedToken::from(content, special).normalized(false);
        if special {
            tok.add_special_tokens(&[t]);
        } else {
            tok.add_tokens(&[t]);
        }
    }
    let mut v: Value = serde_json::from_str(&tok.to_string(false).expect("serializes")).unwrap();
    // The trainer may reset the model's options: put the family's back.
    v["model"]["ignore_merges"] = json!(f.ignore_merges);
    v["model"]["continuing_subword_prefix"] = f.affix.clone();
    v["model"]["end_of_word_suffix"] = f.affix.clone();
    v["post_processor"] = f.post_byte_level.clone();
    if f.bos {
        let (bos, id) = (f.added[0].0, tok.token_to_id(f.added[0].0).unwrap());
        v["post_processor"] = json!({
            "type": "Sequence",
            "processors": [
                f.post_byte_level,
                {
                    "type": "TemplateProcessing",
                    "single": [
                        {"SpecialToken": {"id": bos, "type_id": 0}},
                        {"Sequence": {"id": "A", "type_id": 0}},
                    ],
                    "pair": [
                        {"SpecialToken": {"id": bos, "type_id": 0}},
                        {"Sequence": {"id": "A", "type_id": 0}},
                        {"SpecialToken": {"id": bos, "type_id": 1}},
                        {"Sequence": {"id": "B", "type_id": 1}},
                    ],
                    "special_tokens": {bos: {"id": bos, "ids": [id], "tokens": [bos]}},
                },
            ],
        });
    }
    (build(&v), v)
}

/// Number of `[PAD{i}]` tokens llama.cpp's converter appends up to the model's vocab_size.
const PADS: usize = 3;

/// GGUF metadata as `convert_hf_to_gguf.py` writes it for `reference`: every id's token (added
/// ones in plain text), types (special added → control, other added → user-defined, the rest
/// normal, `[PAD{i}]` unused), merges as "a b", the special ids.
fn gguf_meta(pre: &str, tok: &tokenizers::Tokenizer, json: &Value) -> BTreeMap<String, GgufValue> {
    let n = tok.get_vocab_size(true);
    let added: BTreeMap<u32, bool> = tok
        .get_added_tokens_decoder()
        .into_iter()
        .map(|(id, t)| (id, t.special))
        .collect();
    let mut tokens: Vec<String> = (0..n as u32)
        .map(|id| tok.id_to_token(id).expect("dense ids"))
        .collect();
    let mut types: Vec<i32> = (0..n as u32)
        .map(|id| match added.get(&id) {
            Some(true) => 3,
            Some(false) => 4,
            None => 1,
        })
        .collect();
    for i in 0..PADS {
        tokens.push(format!("[PAD{}]", n + i));
        types.push(5);
    }
    let merges: Vec<String> = json["model"]["merges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| match m {
            Value::String(s) => s.clone(),
            Value::Array(p) => format!("{} {}", p[0].as_str().unwrap(), p[1].as_str().unwrap()),
            _ => panic!("merge {m}"),
        })
        .collect();
    let mut m = BTreeMap::new();
    m.insert("tokenizer.ggml.model".into(), GgufValue::Str("gpt2".into()));
    m.insert("tokenizer.ggml.pre".into(), GgufValue::Str(pre.into()));
    let refs: Vec<&str> = tokens.iter().map(String::as_str).collect();
    m.insert("tokenizer.ggml.tokens".into(), strs(&refs));
    m.insert("tokenizer.ggml.token_type".into(), i32s(&types));
    let refs: Vec<&str> = merges.iter().map(String::as_str).collect();
    m.insert("tokenizer.ggml.merges".into(), strs(&refs));
    let id = |t: &str| GgufValue::U32(tok.token_to_id(t).unwrap());
    m.insert("tokenizer.ggml.bos_token_id".into(), id(first_added(tok)));
    m.insert("tokenizer.ggml.eos_token_id".into(), id(first_added(tok)));
    m.insert(
        "tokenizer.chat_template".into(),
        GgufValue::Str("{% for m in messages %}{{ m.content }}{% endfor %}".into()),
    );
    m
}

fn first_added(tok: &tokenizers::Tokenizer) -> &'static str {
    for name in ["<|begin_of_text|>", "<|endoftext|>"] {
        if tok.token_to_id(name).is_some() {
            return name;
        }
    }
    panic!("no BOS-like token")
}

#[test]
fn trained_byte_level_tokenizers_survive_the_gguf_round_trip() {
    let texts = corpus();
    assert!(texts.len() >= 300);
    for f in families() {
        let (theirs, json) = reference(&f);
        let vocab_len = theirs.get_vocab_size(false);
        assert!(vocab_len > 800, "{} trained tokens", vocab_len);
        for &pre in f.pres {
            let meta = gguf_meta(pre, &theirs, &json);
            let (tj, cj) = tokenizer_files(&meta, Some(2048)).expect("converts");
            // The tokenizer.json parts are the family's own.
            for key in ["normalizer", "pre_tokenizer", "post_processor", "decoder"] {
                assert_eq!(tj[key], json[key], "{pre}: {key}");
            }
            assert_eq!(
                tj["added_tokens"], json["added_tokens"],
                "{pre}: added_tokens"
            );
            for key in [
                "type",
                "dropout",
                "unk_token",
                "continuing_subword_prefix",
                "end_of_word_suffix",
                "fuse_unk",
                "byte_fallback",
                "ignore_merges",
                "merges",
            ] {
                assert_eq!(tj["model"][key], json["model"][key], "{pre}: model.{key}");
            }
            // The vocabulary: the trained one, plus the added and [PAD] tokens under their ids.
            let ours_vocab = tj["model"]["vocab"].as_object().unwrap();
            for (t, id) in json["model"]["vocab"].as_object().unwrap() {
                assert_eq!(ours_vocab.get(t), Some(id), "{pre}: vocab {t:?}");
            }
            assert_eq!(ours_vocab.len(), theirs.get_vocab_size(true) + PADS);

            let ours = build(&tj);
            for text in &texts {
                for special in [true, false] {
                    let a = ours.encode(text.as_str(), special).expect("encode");
                    let b = theirs.encode(text.as_str(), special).expect("encode");
                    assert_eq!(
                        a.get_ids(),
                        b.get_ids(),
                        "{pre}: ids of {text:?} ({special})"
                    );
                    for skip in [true, false] {
                        let da = ours.decode(a.get_ids(), skip).expect("decode");
                        let db = theirs.decode(b.get_ids(), skip).expect("decode");
                        assert_eq!(da, db, "{pre}: decode of {text:?} (skip {skip})");
                    }
                }
                // Byte-level is lossless (up to Qwen's NFC).
                let plain = ours.encode(text.as_str(), false).unwrap();
                let back = ours.decode(plain.get_ids(), false).unwrap();
                if f.normalizer.is_null() {
                    assert_eq!(&back, text, "{pre}: round trip");
                }
            }
            // BOS only where the family adds it (llama.cpp's default for the pre-tokenizer).
            let bos = theirs.token_to_id(first_added(&theirs)).unwrap();
            let hi = ours.encode("hi", true).unwrap();
            assert_eq!(hi.get_ids()[0] == bos, f.add_bos_default, "{pre}: BOS");
            assert_eq!(cj["add_bos_token"], f.add_bos_default, "{pre}");
            assert_eq!(cj["add_eos_token"], false, "{pre}");
            assert_eq!(cj["model_max_length"], 2048, "{pre}");
            assert_eq!(cj["bos_token"], first_added(&theirs), "{pre}");

            baton_tokenizer_agrees(pre, &tj, &cj, &theirs, &texts);
        }
    }
}

/// Baton's `Tokenizer` loads the converted files, encodes as the reference (its
/// `add_bos_token` handling included) and decodes byte-level pieces, whole or cut mid-character.
fn baton_tokenizer_agrees(
    pre: &str,
    tj: &Value,
    cj: &Value,
    theirs: &tokenizers::Tokenizer,
    texts: &[String],
) {
    let dir = super::common::temp_dir("gguf-bpe");
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, tj.to_string()).expect("write");
    let cfg = TokenizerConfig::from_json_str(&cj.to_string(), "tokenizer_config.json")
        .expect("Baton reads the config");
    assert_eq!(cfg.model_max_length, Some(2048));
    assert!(cfg.chat_template.is_some());
    let tok = baton_model::Tokenizer::from_file(&path, cfg).expect("Baton loads it");
    assert_eq!(tok.bos_id(), theirs.token_to_id(first_added(theirs)));
    for text in texts {
        let want = theirs.encode(text.as_str(), true).unwrap();
        let ids = tok.encode(text, true).expect("encode");
        assert_eq!(ids, want.get_ids(), "{pre}: Baton ids of {text:?}");
        assert_eq!(
            tok.decode(&ids, true).unwrap(),
            theirs.decode(want.get_ids(), true).unwrap(),
            "{pre}: Baton decode of {text:?}"
        );
    }
    // A 4-byte character split over byte tokens: the prefix decodes lossily, the whole exactly.
    let ids = tok.encode("x 🦀 y", false).unwrap();
    assert!(ids.len() >= 4, "{pre}: {ids:?}");
    for k in 0..=ids.len() {
        tok.decode(&ids[..k], false)
            .expect("a partial sequence decodes");
    }
    assert_eq!(tok.decode(&ids, false).unwrap(), "x 🦀 y");
    // Pieces are the byte-level strings; decoding one gives its bytes as text.
    let the = tok.encode(" the", false).unwrap();
    assert_eq!(the.len(), 1, "{pre}: \" the\" is one trained token");
    assert_eq!(tok.id_to_piece(the[0]).as_deref(), Some("Ġthe"));
    assert_eq!(tok.decode(&the, false).unwrap(), " the");
}

/// A small byte-level vocabulary: the 256 byte characters, a few merges, specials.
fn small_meta(pre: &str) -> BTreeMap<String, GgufValue> {
    let mut alphabet: Vec<char> = ByteLevel::alphabet().into_iter().collect();
    alphabet.sort_unstable();
    let mut tokens: Vec<String> = alphabet.iter().map(|c| c.to_string()).collect();
    tokens.extend(
        [
            "Ġt",
            "he",
            "Ġthe",
            "<|endoftext|>",
            "<|im_start|>",
            "<tool_call>",
        ]
        .map(String::from),
    );
    let mut types = vec![1; tokens.len()];
    let n = types.len();
    types[n - 3] = 3;
    types[n - 2] = 3;
    types[n - 1] = 4;
    let mut m = BTreeMap::new();
    m.insert("tokenizer.ggml.model".into(), GgufValue::Str("gpt2".into()));
    m.insert("tokenizer.ggml.pre".into(), GgufValue::Str(pre.into()));
    let refs: Vec<&str> = tokens.iter().map(String::as_str).collect();
    m.insert("tokenizer.ggml.tokens".into(), strs(&refs));
    m.insert("tokenizer.ggml.token_type".into(), i32s(&types));
    m.insert(
        "tokenizer.ggml.merges".into(),
        strs(&["Ġ t", "h e", "Ġt he"]),
    );
    m.insert(
        "tokenizer.ggml.bos_token_id".into(),
        GgufValue::U32(n as u32 - 3),
    );
    m.insert(
        "tokenizer.ggml.eos_token_id".into(),
        GgufValue::U32(n as u32 - 3),
    );
    m
}

#[test]
fn each_pre_tokenizer_is_the_models_own() {
    for f in families() {
        for &pre in f.pres {
            let (tj, cj) = tokenizer_files(&small_meta(pre), None).expect("converts");
            assert_eq!(tj["normalizer"], f.normalizer, "{pre}");
            assert_eq!(tj["pre_tokenizer"], f.pre_tokenizer, "{pre}");
            assert_eq!(tj["decoder"], f.decoder, "{pre}");
            assert_eq!(tj["model"]["ignore_merges"], f.ignore_merges, "{pre}");
            assert_eq!(tj["model"]["byte_fallback"], false, "{pre}");
            assert_eq!(tj["model"]["unk_token"], Value::Null, "{pre}");
            assert_eq!(tj["model"]["continuing_subword_prefix"], f.affix, "{pre}");
            assert_eq!(cj["add_bos_token"], f.add_bos_default, "{pre}");
            if !f.add_bos_default {
                assert_eq!(tj["post_processor"], f.post_byte_level, "{pre}");
            }
            build(&tj);
        }
    }
    // The regexes themselves, as the files spell them.
    let (tj, _) = tokenizer_files(&small_meta("llama-bpe"), None).unwrap();
    assert_eq!(
        tj["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"],
        parse(LLAMA3_REGEX_JSON)
    );
    assert_eq!(
        parse(LLAMA3_REGEX_JSON),
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    );
    let (tj, _) = tokenizer_files(&small_meta("qwen2"), None).unwrap();
    assert_eq!(
        tj["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"],
        parse(QWEN2_REGEX_JSON)
    );
    // Every supported name is covered above, and nothing else is supported.
    let covered: Vec<&str> = families().iter().flat_map(|f| f.pres.to_vec()).collect();
    let mut a = covered.clone();
    let mut b = BPE_PRE_TOKENIZERS.to_vec();
    a.sort_unstable();
    b.sort_unstable();
    assert_eq!(a, b);
}

#[test]
fn llama3_post_processor_and_config_are_meta_llamas() {
    // Llama 3's layout: 128000 BPE tokens, then 256 specials, BOS 128000, EOS 128009.
    let mut tokens: Vec<String> = small_meta("llama-bpe")["tokenizer.ggml.tokens"]
        .as_array()
        .unwrap()
        .iter()
        .take(256 + 3)
        .map(|t| t.as_str().unwrap().to_string())
        .collect();
    let mut i = 0;
    while tokens.len() < 128_000 {
        tokens.push(format!("x{i}"));
        i += 1;
    }
    let specials = [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|reserved_special_token_0|>",
        "<|reserved_special_token_1|>",
        "<|finetune_right_pad_id|>",
        "<|reserved_special_token_2|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eom_id|>",
        "<|eot_id|>",
        "<|python_tag|>",
    ];
    tokens.extend(specials.map(String::from));
    let mut types = vec![1; 128_000];
    types.extend([3; 11]);
    let mut m = small_meta("llama-bpe");
    let refs: Vec<&str> = tokens.iter().map(String::as_str).collect();
    m.insert("tokenizer.ggml.tokens".into(), strs(&refs));
    m.insert("tokenizer.ggml.token_type".into(), i32s(&types));
    m.insert(
        "tokenizer.ggml.bos_token_id".into(),
        GgufValue::U32(128_000),
    );
    m.insert(
        "tokenizer.ggml.eos_token_id".into(),
        GgufValue::U32(128_009),
    );
    m.insert(
        "tokenizer.ggml.padding_token_id".into(),
        GgufValue::U32(128_004),
    );
    let (tj, cj) = tokenizer_files(&m, Some(131_072)).expect("converts");
    assert_eq!(tj["post_processor"], parse(LLAMA3_POST_PROCESSOR));
    assert_eq!(tj["added_tokens"].as_array().unwrap().len(), 11);
    assert!(tj["added_tokens"]
        .as_array()
        .unwrap()
        .iter()
        .all(|t| t["special"] == true && t["normalized"] == false));
    assert_eq!(cj["bos_token"], "<|begin_of_text|>");
    assert_eq!(cj["eos_token"], "<|eot_id|>");
    assert_eq!(cj["pad_token"], "<|finetune_right_pad_id|>");
    assert_eq!(cj["add_bos_token"], true);
    assert_eq!(cj["clean_up_tokenization_spaces"], true);
    assert_eq!(cj["tokenizer_class"], "PreTrainedTokenizerFast");
    assert!(cj.get("legacy").is_none());
    let tok = build(&tj);
    let enc = tok
        .encode("<|start_header_id|>user<|end_header_id|> the", true)
        .unwrap();
    assert_eq!(enc.get_ids()[..2], [128_000, 128_006]);
    assert_eq!(enc.get_tokens()[2], "u");
    assert_eq!(enc.get_tokens().last().unwrap(), "Ġthe");

    // add_bos_token false in the metadata wins over llama.cpp's default.
    m.insert(
        "tokenizer.ggml.add_bos_token".into(),
        GgufValue::Bool(false),
    );
    let (tj, cj) = tokenizer_files(&m, None).unwrap();
    assert_eq!(tj["post_processor"], parse(POST_BYTE_LEVEL));
    assert_eq!(cj["add_bos_token"], false);
}

#[test]
fn added_tokens_follow_the_token_types() {
    let mut m = small_meta("qwen2");
    // Padding is a normal token here: not made an added token (it would split words).
    m.insert("tokenizer.ggml.padding_token_id".into(), GgufValue::U32(0));
    m.insert("tokenizer.ggml.add_eos_token".into(), GgufValue::Bool(true));
    let (tj, cj) = tokenizer_files(&m, None).unwrap();
    let added: Vec<(&str, bool)> = tj["added_tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            (
                t["content"].as_str().unwrap(),
                t["special"].as_bool().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        added,
        [
            ("<|endoftext|>", true),
            ("<|im_start|>", true),
            ("<tool_call>", false)
        ]
    );
    assert_eq!(cj["added_tokens_decoder"].as_object().unwrap().len(), 3);
    assert_eq!(cj["pad_token"], "!");
    assert_eq!(cj["tokenizer_class"], "Qwen2Tokenizer");
    assert_eq!(cj["clean_up_tokenization_spaces"], false);
    // EOS appended after the ByteLevel post-processor.
    let tok = build(&tj);
    let enc = tok.encode("the<tool_call>!!", true).unwrap();
    assert_eq!(
        enc.get_tokens(),
        ["t", "he", "<tool_call>", "!", "!", "<|endoftext|>"].map(String::from)
    );
    assert_eq!(tok.decode(enc.get_ids(), true).unwrap(), "the<tool_call>!!");
}

fn assert_refused(meta: &BTreeMap<String, GgufValue>, key: &str, detail: &str) {
    let e = tokenizer_files(meta, None).expect_err("refused");
    assert!(e.contains(&format!("`{key}`")), "{e}");
    assert!(e.contains("--tokenizer DIR"), "{e}");
    assert!(e.contains(detail), "{e}");
}

#[test]
fn unknown_pre_tokenizers_and_bad_merges_are_refused() {
    for pre in [
        "tekken",
        "deepseek-llm",
        "deepseek-r1-qwen",
        "default",
        "starcoder",
        "falcon3",
        "lfm2",
        "",
        "Qwen2",
    ] {
        assert_refused(&small_meta(pre), "tokenizer.ggml.pre", &format!("{pre:?}"));
    }
    let mut m = small_meta("qwen2");
    m.remove("tokenizer.ggml.pre");
    assert_refused(&m, "tokenizer.ggml.pre", "missing");
    m.insert("tokenizer.ggml.pre".into(), GgufValue::U32(2));
    assert_refused(&m, "tokenizer.ggml.pre", "uint32");

    let mut m = small_meta("qwen2");
    m.remove("tokenizer.ggml.merges");
    assert_refused(&m, "tokenizer.ggml.merges", "missing");
    for bad in [
        "h zz",  // right part not a token
        "he",    // no space
        "h e e", // "e e" is not a token
        "e h",   // "eh" is not a token
        "h ",    // empty right part
        " h",    // the space is the first byte: no split after it
        "",      // empty
        "Ġ  t",  // two spaces
        "é e",   // multi-byte, not tokens
    ] {
        m.insert("tokenizer.ggml.merges".into(), strs(&["h e", bad]));
        assert_refused(&m, "tokenizer.ggml.merges", "element 1");
    }
    m.insert("tokenizer.ggml.merges".into(), i32s(&[1]));
    assert_refused(&m, "tokenizer.ggml.merges", "int32");

    // BOS to be added (Llama 3's default) but none given.
    let mut m = small_meta("llama-bpe");
    m.remove("tokenizer.ggml.bos_token_id");
    assert_refused(&m, "tokenizer.ggml.bos_token_id", "add_bos_token");
    m.insert(
        "tokenizer.ggml.add_bos_token".into(),
        GgufValue::Bool(false),
    );
    tokenizer_files(&m, None).expect("no BOS needed");
}

#[test]
fn every_key_removed_or_mistyped_is_an_error_or_a_valid_tokenizer() {
    let base = {
        let mut m = small_meta("llama-bpe");
        m.insert("tokenizer.ggml.padding_token_id".into(), GgufValue::U32(0));
        m.insert("tokenizer.ggml.add_eos_token".into(), GgufValue::Bool(true));
        m.insert("tokenizer.chat_template".into(), GgufValue::Str("x".into()));
        m
    };
    let n = base["tokenizer.ggml.tokens"].as_array().unwrap().len();
    let wrong = [
        GgufValue::U32(3),
        GgufValue::I64(-5),
        GgufValue::F32(f32::NAN),
        GgufValue::Bool(true),
        GgufValue::Str(String::new()),
        GgufValue::Str("qwen2".into()),
        GgufValue::Array(vec![]),
        strs(&vec!["<|endoftext|>"; n]),
        strs(&vec!["Ġ Ġ"; n]),
        strs(&["Ġt he", "Ġ t"]),
        i32s(&vec![3; n]),
        i32s(&vec![4; n]),
    ];
    for key in base.keys() {
        let mut m = base.clone();
        m.remove(key);
        if let Ok((tj, _)) = tokenizer_files(&m, None) {
            build(&tj);
        }
        for w in &wrong {
            m.insert(key.clone(), w.clone());
            if let Ok((tj, _)) = tokenizer_files(&m, None) {
                let tok = build(&tj);
                tok.encode("the <|endoftext|> 123", true).expect("encodes");
            }
        }
    }
}

#[test]
fn merges_keep_their_order_and_repeats_as_given() {
    // Merge ranks come from the list order; a reordered list changes the encoding.
    let mut m = small_meta("gpt-2");
    let mut tokens: Vec<String> = m["tokenizer.ggml.tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap().to_string())
        .collect();
    tokens.extend(["ab", "bc"].map(String::from));
    let refs: Vec<&str> = tokens.iter().map(String::as_str).collect();
    m.insert("tokenizer.ggml.tokens".into(), strs(&refs));
    m.insert(
        "tokenizer.ggml.token_type".into(),
        i32s(&vec![1; tokens.len()]),
    );
    m.insert("tokenizer.ggml.merges".into(), strs(&["a b", "b c"]));
    let (tj, _) = tokenizer_files(&m, None).unwrap();
    assert_eq!(tj["model"]["merges"], json!([["a", "b"], ["b", "c"]]));
    let first = build(&tj).encode("abc", false).unwrap();
    assert_eq!(first.get_tokens(), ["ab", "c"].map(String::from));
    m.insert("tokenizer.ggml.merges".into(), strs(&["b c", "a b"]));
    let (tj, _) = tokenizer_files(&m, None).unwrap();
    let second = build(&tj).encode("abc", false).unwrap();
    assert_eq!(second.get_tokens(), ["a", "bc"].map(String::from));
    // A repeated merge is passed on as listed, so it ranks as in the model's own tokenizer.json
    // with that list (`tokenizers` keeps the last rank; llama.cpp would keep the first).
    m.insert("tokenizer.ggml.merges".into(), strs(&["b c", "a b", "b c"]));
    let (tj, _) = tokenizer_files(&m, None).unwrap();
    assert_eq!(tj["model"]["merges"].as_array().unwrap().len(), 3);
    let third = build(&tj).encode("abc", false).unwrap();
    assert_eq!(third.get_tokens(), ["ab", "c"].map(String::from));
    // A tokenizer.json read back gives the same vocabulary and merges.
    let back = tokenizers::Tokenizer::from_str(&tj.to_string()).unwrap();
    assert_eq!(back.get_vocab_size(false), tokens.len());
}
