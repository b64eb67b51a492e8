//! The prompts to send: random token ids decoded to text (like vLLM's random dataset), or one
//! prompt per line of a JSONL file.

use anyhow::{bail, Context, Result};
use baton_model::{Tokenizer, TokenizerConfig};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::path::Path;

/// One request to send.
#[derive(Debug, Clone, PartialEq)]
pub struct Prompt {
    /// The prompt text.
    pub text: String,
    /// Prompt length in tokens as the client counts it (with the tokenizer and its special
    /// tokens when one is given, else whitespace-separated words).
    pub prompt_tokens: usize,
    /// `max_tokens` to ask for.
    pub max_tokens: u32,
}

/// Loads the tokenizer of a Hugging Face model directory (`tokenizer.json`, and
/// `tokenizer_config.json` when present).
///
/// # Errors
/// A missing or unreadable file.
pub fn load_tokenizer(dir: &Path) -> Result<Tokenizer> {
    let cfg_path = dir.join("tokenizer_config.json");
    let cfg = if cfg_path.exists() {
        TokenizerConfig::from_file(&cfg_path)?
    } else {
        TokenizerConfig::default()
    };
    Tokenizer::from_file(&dir.join("tokenizer.json"), cfg)
        .with_context(|| format!("loading the tokenizer of {}", dir.display()))
}

/// Words used for random prompts when no tokenizer is given (about one token each).
const WORDS: &[&str] = &[
    "the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "to", "park", "with", "big", "red",
    "ball", "she", "was", "happy", "day", "sun", "tree", "bird", "sang", "little", "boy", "girl",
    "went", "home", "mom", "said", "play", "friend",
];

/// Counts the tokens of a prompt as the client sees it.
pub fn count_prompt(tok: Option<&Tokenizer>, text: &str) -> Result<usize> {
    Ok(match tok {
        Some(t) => t.encode(text, true)?.len(),
        None => text.split_whitespace().count(),
    })
}

/// A length drawn uniformly from `[len·(1−r), len·(1+r)]` (at least 1).
fn draw_len(rng: &mut StdRng, len: usize, range_ratio: f64) -> usize {
    let lo = ((len as f64) * (1.0 - range_ratio)).round().max(1.0) as usize;
    let hi = ((len as f64) * (1.0 + range_ratio)).round().max(lo as f64) as usize;
    rng.random_range(lo..=hi)
}

/// `n` random prompts: `input_len` token ids (±`range_ratio`) drawn uniformly from the
/// tokenizer's vocabulary (special tokens excluded) and decoded to text, each asking for
/// `output_len` (±`range_ratio`) tokens. Without a tokenizer, words of a small fixed list are
/// drawn instead. The same seed gives the same prompts.
///
/// # Errors
/// A tokenizer that fails to decode.
pub fn random(
    tok: Option<&Tokenizer>,
    n: usize,
    input_len: usize,
    output_len: usize,
    range_ratio: f64,
    seed: u64,
) -> Result<Vec<Prompt>> {
    let mut rng = StdRng::seed_from_u64(seed);
    let allowed: Vec<u32> = match tok {
        Some(t) => {
            let special: std::collections::HashSet<u32> = t
                .inner()
                .get_added_tokens_decoder()
                .keys()
                .copied()
                .collect();
            (0..t.vocab_size() as u32)
                .filter(|id| !special.contains(id))
                .collect()
        }
        None => Vec::new(),
    };
    if tok.is_some() && allowed.is_empty() {
        bail!("the tokenizer has no non-special tokens to draw prompts from");
    }
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let in_len = draw_len(&mut rng, input_len, range_ratio);
        let out_len = draw_len(&mut rng, output_len, range_ratio);
        let text = match tok {
            Some(t) => {
                let ids: Vec<u32> = (0..in_len)
                    .map(|_| allowed[rng.random_range(0..allowed.len())])
                    .collect();
                t.decode(&ids, true)?
            }
            None => (0..in_len)
                .map(|_| WORDS[rng.random_range(0..WORDS.len())])
                .collect::<Vec<_>>()
                .join(" "),
        };
        let prompt_tokens = count_prompt(tok, &text)?;
        out.push(Prompt {
            text,
            prompt_tokens,
            max_tokens: out_len as u32,
        });
    }
    Ok(out)
}

/// `n` prompts from a JSONL file: each line a JSON object with `prompt` (text) and optionally
/// `max_tokens` (else `default_max_tokens`), or a JSON string. Blank lines are skipped; the
/// file is cycled when it has fewer than `n` prompts.
///
/// # Errors
/// An unreadable file, a line that is neither form (with its number), or no prompt at all.
pub fn jsonl(
    tok: Option<&Tokenizer>,
    path: &Path,
    n: usize,
    default_max_tokens: u32,
) -> Result<Vec<Prompt>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the dataset {}", path.display()))?;
    let mut base = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = || format!("{} line {}", path.display(), i + 1);
        let v: serde_json::Value =
            serde_json::from_str(line).with_context(|| format!("{}: not JSON", at()))?;
        let (prompt, max_tokens) = match &v {
            serde_json::Value::String(s) => (s.clone(), default_max_tokens),
            serde_json::Value::Object(o) => {
                let Some(p) = o.get("prompt").and_then(|p| p.as_str()) else {
                    bail!("{}: no string field \"prompt\"", at());
                };
                let m = match o.get("max_tokens") {
                    None | Some(serde_json::Value::Null) => default_max_tokens,
                    Some(m) => match m.as_u64() {
                        Some(m) if m > 0 && m <= u32::MAX as u64 => m as u32,
                        _ => bail!("{}: \"max_tokens\" must be a positive integer", at()),
                    },
                };
                (p.to_owned(), m)
            }
            _ => bail!("{}: expected an object with \"prompt\" or a string", at()),
        };
        let prompt_tokens = count_prompt(tok, &prompt)?;
        base.push(Prompt {
            text: prompt,
            prompt_tokens,
            max_tokens,
        });
    }
    if base.is_empty() {
        bail!("the dataset {} holds no prompt", path.display());
    }
    Ok(base.iter().cycle().take(n).cloned().collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_without_tokenizer_is_seeded_and_in_range() {
        let a = random(None, 50, 10, 20, 0.5, 7).unwrap();
        let b = random(None, 50, 10, 20, 0.5, 7).unwrap();
        let c = random(None, 50, 10, 20, 0.5, 8).unwrap();
        assert_eq!(a, b);
        assert_ne!(a, c);
        for p in &a {
            assert!((5..=15).contains(&p.prompt_tokens), "{}", p.prompt_tokens);
            assert!((10..=30).contains(&p.max_tokens));
        }
        let fixed = random(None, 5, 8, 64, 0.0, 1).unwrap();
        assert!(fixed
            .iter()
            .all(|p| p.prompt_tokens == 8 && p.max_tokens == 64));
    }

    #[test]
    fn jsonl_reads_objects_and_strings_and_cycles() {
        let dir = std::env::temp_dir().join(format!("baton-bench-ds-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("a.jsonl");
        std::fs::write(
            &p,
            "{\"prompt\": \"a b\", \"max_tokens\": 3}\n\n\"c d e\"\n",
        )
        .unwrap();
        let v = jsonl(None, &p, 3, 9).unwrap();
        assert_eq!(v.len(), 3);
        assert_eq!(
            (v[0].text.as_str(), v[0].max_tokens, v[0].prompt_tokens),
            ("a b", 3, 2)
        );
        assert_eq!((v[1].text.as_str(), v[1].max_tokens), ("c d e", 9));
        assert_eq!(v[2], v[0]);
        std::fs::write(&p, "{\"prompt\": \"a\"}\nnot json\n").unwrap();
        let e = format!("{:#}", jsonl(None, &p, 3, 9).unwrap_err());
        assert!(e.contains("line 2"), "{e}");
        std::fs::write(&p, "{\"prompt\": \"a\", \"max_tokens\": 0}\n").unwrap();
        assert!(jsonl(None, &p, 1, 9).is_err());
        let e = format!(
            "{:#}",
            jsonl(None, &dir.join("missing.jsonl"), 1, 9).unwrap_err()
        );
        assert!(e.contains("missing.jsonl"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn random_with_the_test_model_tokenizer() {
        let rel = std::env::var("BATON_TEST_MODEL")
            .unwrap_or_else(|_| "../shared/models/stories260K".into());
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../..")
            .join(rel);
        let dir = dir.as_path();
        if !dir.join("tokenizer.json").exists() {
            eprintln!("skipping: no tokenizer at {}", dir.display());
            return;
        }
        let t = load_tokenizer(dir).unwrap();
        let v = random(Some(&t), 4, 32, 64, 0.0, 0).unwrap();
        assert_eq!(v, random(Some(&t), 4, 32, 64, 0.0, 0).unwrap());
        for p in &v {
            assert!(p.prompt_tokens > 8, "{p:?}");
            assert_eq!(p.max_tokens, 64);
        }
    }
}
