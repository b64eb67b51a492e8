//! A byte-level BPE tokenizer of the Qwen2/Qwen3 kind (GPT-2's byte alphabet, Qwen's
//! pre-tokenizer regex, `<|im_start|>`/`<|im_end|>` special tokens, `<think>` as a plain added
//! token, no BOS), built here because the test set has only SentencePiece tokenizers: encoding
//! and decoding, streaming detokenization of characters split over byte tokens, and
//! structured-output masks over its byte tokens.

use baton_frontend::detok::IncrementalDetokenizer;
use baton_grammar::{mask_words, Constraint, Vocabulary};
use baton_model::{Tokenizer, TokenizerConfig};
use serde_json::json;
use std::path::PathBuf;

/// GPT-2's `bytes_to_unicode`: printable Latin-1 bytes stand for themselves, the other bytes
/// for U+0100 onwards in byte order.
fn byte_chars() -> Vec<char> {
    let printable = |b: u32| (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || b >= 0xae;
    let mut next = 256u32;
    (0u32..256)
        .map(|b| {
            if printable(b) {
                char::from_u32(b).unwrap()
            } else {
                next += 1;
                char::from_u32(next - 1).unwrap()
            }
        })
        .collect()
}

/// Qwen2's pre-tokenizer pattern (tokenizer.json of Qwen2.5 and Qwen3).
const QWEN_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

const END_OF_TEXT: u32 = 260;
const IM_START: u32 = 261;
const IM_END: u32 = 262;
const THINK: u32 = 263;

/// Writes tokenizer.json and tokenizer_config.json into a fresh directory: ids 0..256 are the
/// bytes, 256..260 four merges ("he", "ll", "é", "Ġw"), then the added tokens.
fn write_tokenizer(tag: &str) -> PathBuf {
    let chars = byte_chars();
    let piece = |bytes: &[u8]| bytes.iter().map(|&b| chars[b as usize]).collect::<String>();
    let mut vocab = serde_json::Map::new();
    for b in 0..=255u8 {
        vocab.insert(piece(&[b]), json!(b));
    }
    let merges = [
        ("h", "e"),
        ("l", "l"),
        ("\u{c3}", "\u{a9}"),
        ("\u{120}", "w"),
    ];
    for (i, (a, b)) in merges.iter().enumerate() {
        vocab.insert(format!("{a}{b}"), json!(256 + i));
    }
    let added = |id: u32, content: &str, special: bool| {
        json!({"id": id, "content": content, "single_word": false, "lstrip": false,
               "rstrip": false, "normalized": false, "special": special})
    };
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false,
                            "trim_offsets": false, "use_regex": false});
    let tok = json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [
            added(END_OF_TEXT, "<|endoftext|>", true),
            added(IM_START, "<|im_start|>", true),
            added(IM_END, "<|im_end|>", true),
            added(THINK, "<think>", false),
            added(THINK + 1, "</think>", false),
        ],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN_SPLIT}, "behavior": "Isolated",
             "invert": false},
            byte_level,
        ]},
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": "", "end_of_word_suffix": "", "fuse_unk": false,
                  "byte_fallback": false, "ignore_merges": false, "vocab": vocab,
                  "merges": merges.iter().map(|(a, b)| format!("{a} {b}")).collect::<Vec<_>>()},
    });
    let dir = std::env::temp_dir().join(format!("baton-bytelevel-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("tokenizer.json"), tok.to_string()).unwrap();
    // Qwen's tokenizer_config.json: no BOS, EOS <|im_end|>.
    std::fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"add_prefix_space": false, "bos_token": null, "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>", "unk_token": null, "errors": "replace",
            "model_max_length": 131072, "split_special_tokens": false}"#,
    )
    .unwrap();
    dir
}

fn tokenizer(dir: &std::path::Path) -> Tokenizer {
    let tc = TokenizerConfig::from_file(&dir.join("tokenizer_config.json")).unwrap();
    Tokenizer::from_file(&dir.join("tokenizer.json"), tc).unwrap()
}

const TEXTS: [&str; 5] = [
    "hello wé world",
    "世界, 你好! 🎉 ok",
    "line one\n\n  indented\ttab",
    "café's naïve résumé 123",
    "<think>\nweigh it</think>\n\nanswer",
];

#[test]
fn qwen_style_text_round_trips_without_a_bos_and_special_tokens_are_single_ids() {
    let dir = write_tokenizer("round");
    let tok = tokenizer(&dir);
    assert_eq!(tok.bos_id(), None);
    assert_eq!(tok.eos_id(), Some(IM_END));
    for text in TEXTS {
        let ids = tok.encode(text, true).unwrap();
        assert!(ids.iter().all(|&i| i < 265), "{text}: {ids:?}");
        assert_eq!(tok.decode(&ids, false).unwrap(), text);
    }
    // The merges are used: "he", "ll", "é" and " w" are single tokens.
    assert_eq!(
        tok.encode("hello wé", true).unwrap(),
        [256, 257, b'o' as u32, 259, 258]
    );
    let chat = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>";
    let ids = tok.encode(chat, true).unwrap();
    assert_eq!(ids[0], IM_START);
    assert!(ids.contains(&IM_END) && ids.ends_with(&[THINK]), "{ids:?}");
    // skip_special_tokens drops <|im_start|>/<|im_end|> but keeps <think>, as Qwen3 needs
    // for its reasoning parser.
    let shown = tok.decode(&ids, true).unwrap();
    assert_eq!(shown, "user\nhi\nassistant\n<think>");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn streaming_detokenization_holds_split_characters_and_equals_the_whole_decode() {
    let dir = write_tokenizer("stream");
    let tok = tokenizer(&dir);
    let prompt = tok.encode("<|im_start|>assistant\n", true).unwrap();
    for text in TEXTS {
        let ids = tok.encode(text, true).unwrap();
        let mut d = IncrementalDetokenizer::new(&prompt, true);
        let mut out = String::new();
        for &id in &ids {
            let piece = d.push(&tok, id);
            assert!(
                !piece.contains('\u{fffd}'),
                "{text}: half a character sent: {piece:?}"
            );
            out.push_str(&piece);
        }
        out.push_str(&d.finish(&tok));
        assert_eq!(out, text);
    }
    // "世" is three byte tokens: nothing is sent until the third.
    let ids = tok.encode("世", true).unwrap();
    assert_eq!(ids.len(), 3);
    let mut d = IncrementalDetokenizer::new(&prompt, true);
    assert_eq!(d.push(&tok, ids[0]), "");
    assert_eq!(d.push(&tok, ids[1]), "");
    assert_eq!(d.push(&tok, ids[2]), "世");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn structured_output_masks_walk_multibyte_characters_byte_token_by_byte_token() {
    let dir = write_tokenizer("mask");
    let tok = tokenizer(&dir);
    // The model's vocabulary is padded past the tokenizer's, as Qwen's is (151936 > 151669).
    let vocab = 300;
    let v = Vocabulary::from_tokenizer_json(&dir.join("tokenizer.json"), vocab, &[IM_END]).unwrap();
    let mut g = v
        .compile(&Constraint::Choice(vec!["世界".into(), "hello".into()]))
        .unwrap();
    let allowed = |g: &mut baton_grammar::Guide| {
        let mut m = vec![0u32; mask_words(vocab)];
        g.fill_mask(&mut m).unwrap();
        (0..vocab as u32)
            .filter(|&t| m[t as usize / 32] >> (t % 32) & 1 == 1)
            .collect::<Vec<_>>()
    };
    let first = allowed(&mut g);
    // The first byte of "世" (0xE4), "h" and the merged "he"; nothing past the tokenizer.
    for t in [0xE4, b'h' as u32, 256] {
        assert!(first.contains(&t), "{t} not allowed: {first:?}");
    }
    assert!(!first.contains(&(b'x' as u32)) && first.iter().all(|&t| t < 265));
    for id in tok.encode("世界", true).unwrap() {
        assert!(allowed(&mut g).contains(&id), "{id}");
        g.consume(id).unwrap();
    }
    assert!(g.is_finished());
    assert_eq!(allowed(&mut g), [IM_END]);
    std::fs::remove_dir_all(&dir).ok();
}
