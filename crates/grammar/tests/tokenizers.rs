//! The vocabulary of real tokenizers: stories260K (SentencePiece with byte fallback, 512 tokens)
//! and the Llama 2 tokenizer (32000 tokens).

use baton_grammar::{mask_words, Constraint, Vocabulary};
use std::path::PathBuf;

fn shared(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/models")
        .join(rel)
}

fn model_dir() -> PathBuf {
    std::env::var_os("BATON_TEST_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| shared("stories260K"))
}

fn allowed(v: &Vocabulary, g: &mut baton_grammar::Guide) -> Vec<u32> {
    let mut m = vec![0u32; mask_words(v.vocab_size())];
    g.fill_mask(&mut m).unwrap();
    (0..v.vocab_size() as u32)
        .filter(|&t| m[t as usize / 32] >> (t % 32) & 1 == 1)
        .collect()
}

#[test]
fn stories_vocabulary_guides_a_digit_regex() {
    let v =
        Vocabulary::from_tokenizer_json(&model_dir().join("tokenizer.json"), 512, &[2]).unwrap();
    let mut g = v.compile(&Constraint::Regex("[0-9]{2}".into())).unwrap();
    let first = allowed(&v, &mut g);
    assert!(!first.is_empty());
    // SentencePiece byte-fallback pieces `<0x30>`..`<0x39>` are ids 3 + 0x30.. and are the
    // digits' bytes; no piece with a letter is allowed.
    for t in &first {
        assert!((3 + 0x30..=3 + 0x39).contains(t) || *t >= 259, "token {t}");
    }
    assert!(first.contains(&(3 + 0x37)));
    g.consume(3 + 0x37).unwrap();
    g.consume(3 + 0x31).unwrap();
    assert_eq!(allowed(&v, &mut g), vec![2]);
}

#[test]
fn llama2_vocabulary_loads_and_rejects_a_mismatched_size() {
    let path = shared("llama2-tokenizer/tokenizer.json");
    let v = Vocabulary::from_tokenizer_json(&path, 32000, &[2]).unwrap();
    let mut g = v.compile(&Constraint::JsonObject).unwrap();
    let first = allowed(&v, &mut g);
    assert!(first.len() > 1 && !first.contains(&2));
    let e = Vocabulary::from_tokenizer_json(&path, 1000, &[2]).unwrap_err();
    assert!(e.to_string().contains("32000 tokens"), "{e}");
    let e = Vocabulary::from_tokenizer_json(&shared("nonexistent.json"), 10, &[2]).unwrap_err();
    assert!(e.to_string().contains("nonexistent.json"), "{e}");
}

/// A refused constraint's message says why, in the client's own terms: the regex parser's
/// reason (on a later line of llguidance's error) is kept, the position in the wrapper grammar
/// a regex is compiled in is dropped (a Lark grammar's own position is kept), and an
/// unsatisfiable or endlessly self-referring constraint is said in words.
#[test]
fn refused_constraints_say_why() {
    let v =
        Vocabulary::from_tokenizer_json(&model_dir().join("tokenizer.json"), 512, &[2]).unwrap();
    let err = |c: Constraint| match v.compile(&c) {
        Ok(_) => panic!("{c:?} compiled"),
        Err(e) => e.to_string(),
    };
    for (re, why) in [
        ("((", "unclosed group"),
        ("(a)\\1", "backreferences are not supported"),
        ("(?=a)a", "look-around"),
    ] {
        let m = err(Constraint::Regex(re.into()));
        assert!(m.contains(why), "{re}: {m}");
        assert!(m.contains("invalid regex"), "{re}: {m}");
        assert!(!m.contains("at 1("), "{re}: {m}");
    }
    let m = err(Constraint::Json(
        serde_json::json!({"type": "string", "pattern": "(("}),
    ));
    assert!(m.contains("unclosed group"), "{m}");
    for c in [
        Constraint::Regex("[^\\s\\S]".into()),
        Constraint::Json(serde_json::json!({
            "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
            "$ref": "#/$defs/a"
        })),
    ] {
        let m = err(c);
        assert!(m.contains("allows no output"), "{m}");
        assert!(!m.contains("NoExtensionBias"), "{m}");
    }
    let m = err(Constraint::Grammar("start: foo(".into()));
    assert!(m.contains("1(12)"), "{m}");
}
