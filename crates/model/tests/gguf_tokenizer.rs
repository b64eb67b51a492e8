//! `gguf_tokenizer::tokenizer_files`: the stories260K GGUF's tokenizer metadata converted to
//! tokenizer.json must encode and decode exactly as the reference tokenizer.json that
//! transformers' conversion made from the same SentencePiece model; unconvertible metadata is
//! refused with a message pointing at `--tokenizer DIR`.

mod common;

/// Byte-level BPE (`tokenizer.ggml.model == "gpt2"`) tokenizers.
#[path = "gguf_tokenizer/bpe.rs"]
mod bpe;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::str::FromStr;

use baton_model::gguf::{GgufFile, GgufValue};
use baton_model::gguf_tokenizer::tokenizer_files;
use baton_model::TokenizerConfig;
use common::model_dir;
use serde_json::Value;

/// `BATON_TEST_MODEL_GGUF`, or the stories260K f32 GGUF in /work/shared relative to this crate.
fn gguf_path() -> PathBuf {
    match std::env::var_os("BATON_TEST_MODEL_GGUF") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../../shared/models/stories260K-gguf/stories260K-f32.gguf"),
    }
}

fn gguf_meta() -> BTreeMap<String, GgufValue> {
    GgufFile::open(&gguf_path())
        .expect("stories260K GGUF opens")
        .metadata
}

fn reference_json() -> Value {
    let text = std::fs::read_to_string(model_dir().join("tokenizer.json")).expect("reference");
    serde_json::from_str(&text).expect("reference parses")
}

fn build(v: &Value) -> tokenizers::Tokenizer {
    tokenizers::Tokenizer::from_str(&v.to_string()).expect("tokenizers accepts the JSON")
}

/// A few hundred varied texts: fixed cases plus pseudo-random mixes of story words,
/// punctuation, digits, whitespace runs, accented/CJK/emoji text and special-token strings.
fn corpus() -> Vec<String> {
    let fixed = [
        "",
        " ",
        "  ",
        "\n",
        "\t",
        "a",
        "Once upon a time",
        "Once upon a time, there was a little girl named Lily.",
        "One day, Tim went to the park. He saw a big red ball!\nHe was very happy.",
        "  leading spaces",
        "trailing spaces   ",
        "double  space and   triple",
        "tabs\tand\nnewlines\n\nhere\r\n",
        "Numbers 12345 and 3.14159, 1,000,000; 42%",
        "café naïve résumé Ünïcödé",
        "“quoted” — dashes … ‘single’",
        "emoji 😀🐱 and 中文",
        "日本語のテキスト",
        "Привет, мир!",
        "def f(x):\n    return x ** 2",
        "<s>",
        "</s>",
        "<unk>",
        "<s> is written literally here",
        "text with </s> in the middle",
        "<s></s><unk><s>",
        "a<s>b</s>c",
        "<0x0A> is not a newline",
        "\u{2581}already\u{2581}metaspace",
        "\u{0}\u{1}\u{7f}",
        "{\"json\": [1, 2, 3]}",
        "!!!???...,,,;;;:::",
        "Zoë's \"toy\" (the big one) cost $5 & 3¢ @ home #1",
    ];
    let words = [
        "Once",
        "upon",
        "a",
        "time",
        "there",
        "was",
        "little",
        "girl",
        "boy",
        "named",
        "Lily",
        "Tim",
        "Timmy",
        "Ben",
        "Sue",
        "She",
        "he",
        "they",
        "loved",
        "to",
        "play",
        "with",
        "her",
        "his",
        "ball",
        "dog",
        "cat",
        "sun",
        "park",
        "happy",
        "sad",
        "friend",
        "said",
        "went",
        "saw",
        "big",
        "red",
        "very",
        "the",
        "and",
        "The",
        "end",
        "mom",
        "dad",
        "tree",
        "jump",
        "ran",
        "fast",
        "smiled",
        "xylophone",
        "quizzical",
        "zebra",
        "Mississippi",
        "12",
        "7",
        "2024",
        "3.5",
        "café",
        "über",
        "naïve",
        "中",
        "文",
        "字",
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
        "<s>",
        "</s>",
        "<unk>",
        "<0x41>",
        "▁",
    ];
    let seps = [
        " ", " ", " ", " ", "  ", "   ", "\n", "\n\n", "\t", ", ", ". ", "! ", "? ", "; ", ": ",
        "-", "'", "\"", "(", ")", "", " \n ", "\r\n",
    ];
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move |n: usize| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % n as u64) as usize
    };
    let mut out: Vec<String> = fixed.iter().map(|s| s.to_string()).collect();
    for _ in 0..320 {
        let mut s = String::new();
        if next(5) == 0 {
            s.push_str(seps[next(seps.len())]);
        }
        for _ in 0..1 + next(14) {
            s.push_str(words[next(words.len())]);
            s.push_str(seps[next(seps.len())]);
        }
        out.push(s);
    }
    out
}

#[test]
fn stories260k_gguf_tokenizer_matches_the_reference() {
    let meta = gguf_meta();
    let t0 = std::time::Instant::now();
    let (tok_json, cfg_json) = tokenizer_files(&meta, Some(512)).expect("converts");
    let took = t0.elapsed();
    let reference = reference_json();

    // The parts, then the whole file.
    assert_eq!(
        tok_json["model"]["vocab"], reference["model"]["vocab"],
        "vocab"
    );
    assert_eq!(
        tok_json["model"]["merges"], reference["model"]["merges"],
        "merges"
    );
    for key in [
        "added_tokens",
        "normalizer",
        "pre_tokenizer",
        "post_processor",
        "decoder",
        "model",
    ] {
        assert_eq!(tok_json[key], reference[key], "{key}");
    }
    assert_eq!(tok_json, reference, "tokenizer.json equals the reference");
    eprintln!("converted {} tokens in {took:?}", meta_len(&meta));

    let ours = build(&tok_json);
    let theirs = build(&reference);
    let texts = corpus();
    assert!(texts.len() >= 300);
    for text in &texts {
        let a = ours.encode(text.as_str(), true).expect("encode");
        let b = theirs.encode(text.as_str(), true).expect("encode");
        assert_eq!(a.get_ids(), b.get_ids(), "ids of {text:?}");
        for skip in [true, false] {
            let da = ours.decode(a.get_ids(), skip).expect("decode");
            let db = theirs.decode(b.get_ids(), skip).expect("decode");
            assert_eq!(da, db, "decode (skip_special_tokens={skip}) of {text:?}");
        }
        let plain = ours.encode(text.as_str(), false).expect("encode");
        let plain_ref = theirs.encode(text.as_str(), false).expect("encode");
        assert_eq!(
            plain.get_ids(),
            plain_ref.get_ids(),
            "ids without BOS of {text:?}"
        );
    }
    // Byte fallback and the BOS are really exercised.
    let emoji = ours.encode("🐱", true).expect("encode");
    assert_eq!(emoji.get_ids()[0], 1);
    assert!(emoji.get_tokens().iter().any(|t| t.starts_with("<0x")));

    // tokenizer_config.json: the fields Baton reads, and as the reference's.
    let cfg_ref: Value = serde_json::from_str(
        &std::fs::read_to_string(model_dir().join("tokenizer_config.json")).expect("config"),
    )
    .expect("config parses");
    for key in [
        "add_bos_token",
        "add_eos_token",
        "added_tokens_decoder",
        "bos_token",
        "eos_token",
        "unk_token",
        "clean_up_tokenization_spaces",
        "legacy",
        "model_max_length",
        "tokenizer_class",
    ] {
        assert_eq!(cfg_json[key], cfg_ref[key], "tokenizer_config {key}");
    }
    assert!(cfg_json.get("pad_token").is_none());
    assert!(cfg_json.get("chat_template").is_none());
    let cfg = TokenizerConfig::from_json_str(&cfg_json.to_string(), "tokenizer_config.json")
        .expect("Baton reads the config");
    assert_eq!(cfg.bos_token.as_deref(), Some("<s>"));
    assert_eq!(cfg.eos_token.as_deref(), Some("</s>"));
    assert_eq!(cfg.add_bos_token, Some(true));
    assert_eq!(cfg.model_max_length, Some(512));

    // Through Baton's own tokenizer too, against golden.json's encodings.
    let dir = common::temp_dir("gguf-tokenizer");
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, tok_json.to_string()).expect("write");
    let tok = baton_model::Tokenizer::from_file(&path, cfg).expect("Baton loads it");
    for (text, ids) in common::golden().encode_checks {
        assert_eq!(tok.encode(&text, true).expect("encode"), ids, "{text:?}");
    }
}

fn meta_len(meta: &BTreeMap<String, GgufValue>) -> usize {
    meta["tokenizer.ggml.tokens"]
        .as_array()
        .map_or(0, <[_]>::len)
}

fn strs(v: &[&str]) -> GgufValue {
    GgufValue::Array(v.iter().map(|s| GgufValue::Str(s.to_string())).collect())
}

fn f32s(v: &[f32]) -> GgufValue {
    GgufValue::Array(v.iter().map(|&x| GgufValue::F32(x)).collect())
}

fn i32s(v: &[i32]) -> GgufValue {
    GgufValue::Array(v.iter().map(|&x| GgufValue::I32(x)).collect())
}

/// A small SentencePiece-like vocabulary: <unk>, <s>, </s>, two bytes, then pieces.
fn small_meta() -> BTreeMap<String, GgufValue> {
    let tokens = [
        "<unk>", "<s>", "</s>", "<0x0A>", "<0x20>", "▁", "a", "b", "c", "▁a", "ab", "▁ab", "abc",
        "<tool>", "[UNUSED]",
    ];
    let scores: Vec<f32> = (0..tokens.len()).map(|i| -(i as f32)).collect();
    let types = [2, 3, 3, 6, 6, 1, 1, 1, 1, 1, 1, 1, 1, 4, 5];
    let mut m = BTreeMap::new();
    m.insert(
        "tokenizer.ggml.model".into(),
        GgufValue::Str("llama".into()),
    );
    m.insert("tokenizer.ggml.tokens".into(), strs(&tokens));
    m.insert("tokenizer.ggml.scores".into(), f32s(&scores));
    m.insert("tokenizer.ggml.token_type".into(), i32s(&types));
    m.insert("tokenizer.ggml.unknown_token_id".into(), GgufValue::U32(0));
    m.insert("tokenizer.ggml.bos_token_id".into(), GgufValue::U32(1));
    m.insert("tokenizer.ggml.eos_token_id".into(), GgufValue::U32(2));
    m
}

fn pairs(v: &Value) -> Vec<(String, String)> {
    v["model"]["merges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p[0].as_str().unwrap().to_string(),
                p[1].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

#[test]
fn small_vocabulary_merges_added_tokens_and_flags() {
    let mut meta = small_meta();
    meta.insert("tokenizer.ggml.add_eos_token".into(), GgufValue::Bool(true));
    meta.insert("tokenizer.ggml.padding_token_id".into(), GgufValue::U32(2));
    meta.insert(
        "tokenizer.chat_template".into(),
        GgufValue::Str("{{ messages }}".into()),
    );
    let (tj, cj) = tokenizer_files(&meta, None).expect("converts");
    // Ranked by the produced piece's score (higher first), then longer left part first.
    assert_eq!(
        pairs(&tj),
        [
            ("▁", "a"),
            ("a", "b"),
            ("▁a", "b"),
            ("▁", "ab"),
            ("ab", "c")
        ]
        .map(|(l, r)| (l.to_string(), r.to_string()))
    );
    // Unknown and control tokens special, user-defined not, unused and bytes not added.
    let added: Vec<(u64, &str, bool)> = tj["added_tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            (
                t["id"].as_u64().unwrap(),
                t["content"].as_str().unwrap(),
                t["special"].as_bool().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        added,
        [
            (0, "<unk>", true),
            (1, "<s>", true),
            (2, "</s>", true),
            (13, "<tool>", false)
        ]
    );
    assert_eq!(cj["pad_token"], "</s>");
    assert_eq!(cj["chat_template"], "{{ messages }}");
    assert_eq!(cj["add_eos_token"], true);
    assert!(cj.get("model_max_length").is_none());

    let tok = build(&tj);
    let enc = tok.encode("abc ab\n<tool>", true).unwrap();
    assert_eq!(
        enc.get_tokens(),
        ["<s>", "▁ab", "c", "▁ab", "<0x0A>", "<tool>", "</s>"].map(String::from)
    );
    assert_eq!(tok.decode(enc.get_ids(), true).unwrap(), "abc ab\n<tool>");
    // Not in the vocabulary and no byte piece for it: the unknown token.
    let unk = tok.encode("ä", false).unwrap();
    assert_eq!(unk.get_tokens(), ["▁", "<unk>"].map(String::from));

    // No BOS, no leading "▁".
    meta.insert(
        "tokenizer.ggml.add_bos_token".into(),
        GgufValue::Bool(false),
    );
    meta.insert(
        "tokenizer.ggml.add_eos_token".into(),
        GgufValue::Bool(false),
    );
    meta.insert(
        "tokenizer.ggml.add_space_prefix".into(),
        GgufValue::Bool(false),
    );
    let (tj, cj) = tokenizer_files(&meta, Some(7)).expect("converts");
    assert_eq!(cj["model_max_length"], 7);
    let tok = build(&tj);
    let enc = tok.encode("ab a", true).unwrap();
    assert_eq!(enc.get_tokens(), ["ab", "▁a"].map(String::from));
    assert_eq!(tok.decode(enc.get_ids(), true).unwrap(), "ab a");
}

#[test]
fn equal_scores_rank_merges_by_token_id() {
    // llama.cpp's LlamaHfVocab writes -1000 for every score: the id order stands in.
    let mut meta = small_meta();
    meta.insert("tokenizer.ggml.scores".into(), f32s(&[-1000.0; 15]));
    let (tj, _) = tokenizer_files(&meta, None).expect("converts");
    let (real, _) = tokenizer_files(&small_meta(), None).expect("converts");
    assert_eq!(pairs(&tj), pairs(&real));
}

#[test]
fn duplicate_and_empty_tokens_do_not_break_the_tokenizer() {
    let mut meta = small_meta();
    let tokens = [
        "<unk>", "<s>", "</s>", "<0x0A>", "<0x20>", "▁", "a", "b", "c", "▁a", "ab", "▁a", "", "",
        "<s>",
    ];
    meta.insert("tokenizer.ggml.tokens".into(), strs(&tokens));
    let (tj, _) = tokenizer_files(&meta, None).expect("converts");
    // The last id of a repeated token wins; each merge appears once.
    assert_eq!(tj["model"]["vocab"]["▁a"], 11);
    assert_eq!(tj["model"]["vocab"]["<s>"], 14);
    assert_eq!(tj["model"]["vocab"][""], 13);
    let merges = pairs(&tj);
    let mut dedup = merges.clone();
    dedup.sort();
    dedup.dedup();
    assert_eq!(merges.len(), dedup.len());
    assert!(tj["added_tokens"]
        .as_array()
        .unwrap()
        .iter()
        .all(|t| t["content"] != ""));
    let tok = build(&tj);
    let enc = tok.encode("a ab", true).unwrap();
    assert_eq!(enc.get_tokens(), ["<s>", "▁a", "▁", "ab"].map(String::from));
}

#[test]
fn given_merges_are_used_and_checked() {
    let mut meta = small_meta();
    meta.insert("tokenizer.ggml.merges".into(), strs(&["a b", "▁ ab"]));
    let (tj, _) = tokenizer_files(&meta, None).expect("converts");
    assert_eq!(
        pairs(&tj),
        [("a", "b"), ("▁", "ab")].map(|(l, r)| (l.to_string(), r.to_string()))
    );
    meta.insert("tokenizer.ggml.merges".into(), strs(&["a c"]));
    let e = tokenizer_files(&meta, None).unwrap_err();
    assert!(e.contains("tokenizer.ggml.merges"), "{e}");
}

fn assert_refused(meta: &BTreeMap<String, GgufValue>, key: &str) {
    let e = tokenizer_files(meta, None).expect_err("refused");
    assert!(e.contains(&format!("`{key}`")), "{e}");
    assert!(e.contains("--tokenizer DIR"), "{e}");
}

#[test]
fn unconvertible_metadata_is_refused() {
    let mut m = small_meta();
    // A byte-level BPE tokenizer needs its pre-tokenizer (see the `bpe` module).
    m.insert("tokenizer.ggml.model".into(), GgufValue::Str("gpt2".into()));
    assert_refused(&m, "tokenizer.ggml.pre");
    m.insert("tokenizer.ggml.model".into(), GgufValue::Str("GPT2".into()));
    assert_refused(&m, "tokenizer.ggml.model");
    let e = tokenizer_files(&m, None).unwrap_err();
    assert!(e.contains("\"GPT2\""), "{e}");
    for model in ["bert", "t5", "rwkv", "none"] {
        m.insert("tokenizer.ggml.model".into(), GgufValue::Str(model.into()));
        assert_refused(&m, "tokenizer.ggml.model");
    }
    let mut m = small_meta();
    m.remove("tokenizer.ggml.model");
    assert_refused(&m, "tokenizer.ggml.model");

    let mut m = small_meta();
    m.remove("tokenizer.ggml.tokens");
    assert_refused(&m, "tokenizer.ggml.tokens");
    m.insert("tokenizer.ggml.tokens".into(), strs(&[]));
    assert_refused(&m, "tokenizer.ggml.tokens");
    m.insert("tokenizer.ggml.tokens".into(), i32s(&[1, 2, 3]));
    assert_refused(&m, "tokenizer.ggml.tokens");

    let mut m = small_meta();
    m.insert("tokenizer.ggml.scores".into(), f32s(&[0.0; 14]));
    assert_refused(&m, "tokenizer.ggml.scores");
    m.insert("tokenizer.ggml.scores".into(), strs(&["x"; 15]));
    assert_refused(&m, "tokenizer.ggml.scores");
    m.remove("tokenizer.ggml.scores");
    assert_refused(&m, "tokenizer.ggml.scores");

    let mut m = small_meta();
    m.insert("tokenizer.ggml.token_type".into(), i32s(&[1; 16]));
    assert_refused(&m, "tokenizer.ggml.token_type");
    m.insert("tokenizer.ggml.token_type".into(), GgufValue::U32(1));
    assert_refused(&m, "tokenizer.ggml.token_type");

    for key in [
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.unknown_token_id",
        "tokenizer.ggml.padding_token_id",
    ] {
        let mut m = small_meta();
        m.insert(key.into(), GgufValue::U32(15));
        assert_refused(&m, key);
        m.insert(key.into(), GgufValue::I32(-1));
        assert_refused(&m, key);
        m.insert(key.into(), GgufValue::Str("1".into()));
        assert_refused(&m, key);
    }
    let mut m = small_meta();
    m.insert("tokenizer.ggml.add_bos_token".into(), GgufValue::F32(1.0));
    assert_refused(&m, "tokenizer.ggml.add_bos_token");
    let mut m = small_meta();
    m.remove("tokenizer.ggml.eos_token_id");
    m.insert("tokenizer.ggml.add_eos_token".into(), GgufValue::Bool(true));
    assert_refused(&m, "tokenizer.ggml.eos_token_id");
    let mut m = small_meta();
    m.insert("tokenizer.chat_template".into(), GgufValue::U8(0));
    assert_refused(&m, "tokenizer.chat_template");
}

#[test]
fn every_key_removed_or_mistyped_is_an_error_or_a_valid_tokenizer() {
    // Never a panic, and whatever converts loads in `tokenizers`.
    let base = {
        let mut m = small_meta();
        m.insert("tokenizer.ggml.padding_token_id".into(), GgufValue::U32(0));
        m.insert("tokenizer.ggml.add_bos_token".into(), GgufValue::Bool(true));
        m.insert(
            "tokenizer.ggml.add_eos_token".into(),
            GgufValue::Bool(false),
        );
        m.insert("tokenizer.chat_template".into(), GgufValue::Str("x".into()));
        m
    };
    let wrong = [
        GgufValue::U32(3),
        GgufValue::I64(-5),
        GgufValue::F32(f32::NAN),
        GgufValue::Bool(true),
        GgufValue::Str(String::new()),
        GgufValue::Array(vec![]),
        strs(&["<s>"; 15]),
        f32s(&[f32::NAN; 15]),
        i32s(&[3; 15]),
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
                build(&tj);
            }
        }
    }
}

#[test]
fn conversion_is_fast_for_large_vocabularies_and_huge_tokens() {
    // 32000 distinct pieces over a small alphabet (many valid splits each), plus one
    // 200000-character token: the merge search must stay near-linear.
    let alphabet = ["▁", "a", "b", "c", "d", "e", "f", "g"];
    let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
    tokens.extend(alphabet.iter().map(|s| s.to_string()));
    // Every string of 2 or more symbols, shortest first (bijective base 8).
    let mut k = alphabet.len() + 1;
    while tokens.len() < 31_999 {
        let (mut piece, mut x) = (String::new(), k);
        while x > 0 {
            x -= 1;
            piece.insert_str(0, alphabet[x % alphabet.len()]);
            x /= alphabet.len();
        }
        tokens.push(piece);
        k += 1;
    }
    tokens.push("a".repeat(200_000));
    let n = tokens.len();
    let mut meta = small_meta();
    let refs: Vec<&str> = tokens.iter().map(String::as_str).collect();
    meta.insert("tokenizer.ggml.tokens".into(), strs(&refs));
    let scores: Vec<f32> = (0..n).map(|i| -(i as f32)).collect();
    meta.insert("tokenizer.ggml.scores".into(), f32s(&scores));
    meta.insert("tokenizer.ggml.token_type".into(), i32s(&vec![1; n]));
    let t0 = std::time::Instant::now();
    let (tj, _) = tokenizer_files(&meta, None).expect("converts");
    let took = t0.elapsed();
    eprintln!("conversion took {took:?}");
    assert!(took.as_secs_f64() < 5.0, "took {took:?}");
    assert!(tj["model"]["merges"].as_array().unwrap().len() > 32_000);
    build(&tj);
}
