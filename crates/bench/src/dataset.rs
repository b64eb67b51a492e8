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

/// Whether a vocabulary piece is a byte-fallback token (`<0x41>`).
fn is_byte_piece(piece: &str) -> bool {
    piece.len() == 6
        && piece.starts_with("<0x")
        && piece.ends_with('>')
        && piece[3..5].bytes().all(|b| b.is_ascii_hexdigit())
}

/// The ids random prompts are drawn from: ordinary vocabulary pieces, without added and
/// special tokens (BOS, EOS, `<unk>`), byte-fallback pieces (`<0x41>`: alone they decode to
/// broken UTF-8 that re-encodes into several tokens) and pieces that decode to nothing.
fn drawable_ids(t: &Tokenizer) -> Result<Vec<u32>> {
    let special: std::collections::HashSet<u32> = t
        .inner()
        .get_added_tokens_decoder()
        .keys()
        .copied()
        .chain(t.bos_id())
        .chain(t.eos_id())
        .collect();
    let mut ids = Vec::new();
    for id in 0..t.vocab_size() as u32 {
        if special.contains(&id) {
            continue;
        }
        let Some(piece) = t.id_to_piece(id) else {
            continue;
        };
        if is_byte_piece(&piece) || t.decode(&[id], true)?.is_empty() {
            continue;
        }
        ids.push(id);
    }
    Ok(ids)
}

/// Rounds of re-encoding that bring a random prompt to its target length.
const FIT_ROUNDS: usize = 8;

/// A text of about `target` tokens (encoded without special tokens): `target` random ids
/// from `allowed`, decoded; then, while re-encoding the text gives another length (pieces
/// merge or split across boundaries), the re-encoded ids are cut to `target` or topped up
/// with more random ids and decoded again.
fn text_of_len(t: &Tokenizer, rng: &mut StdRng, allowed: &[u32], target: usize) -> Result<String> {
    let mut draw = |n: usize| -> Vec<u32> {
        (0..n)
            .map(|_| allowed[rng.random_range(0..allowed.len())])
            .collect()
    };
    let mut ids = draw(target);
    let mut text = t.decode(&ids, true)?;
    for _ in 0..FIT_ROUNDS {
        let re = t.encode(&text, false)?;
        match re.len().cmp(&target) {
            std::cmp::Ordering::Equal => break,
            std::cmp::Ordering::Greater => ids = re[..target].to_vec(),
            std::cmp::Ordering::Less => {
                let more = draw(target - re.len());
                ids = re;
                ids.extend(more);
            }
        }
        text = t.decode(&ids, true)?;
    }
    Ok(text)
}

/// `n` random prompts of `input_len` tokens (±`range_ratio`), each asking for `output_len`
/// (±`range_ratio`) tokens. With a tokenizer, ids are drawn uniformly from its ordinary
/// vocabulary pieces (no special or byte-fallback tokens), decoded to text, and re-fitted
/// until the text re-encodes to the drawn length (counted as [`count_prompt`] does, special
/// tokens such as BOS included), give or take a few tokens. Without a tokenizer, words of a
/// small fixed list are drawn instead. The same seed gives the same prompts.
///
/// # Errors
/// A tokenizer that fails to encode or decode, or one with no ordinary piece.
pub fn random(
    tok: Option<&Tokenizer>,
    n: usize,
    input_len: usize,
    output_len: usize,
    range_ratio: f64,
    seed: u64,
) -> Result<Vec<Prompt>> {
    let mut rng = StdRng::seed_from_u64(seed);
    let (allowed, specials) = match tok {
        Some(t) => {
            let allowed = drawable_ids(t)?;
            if allowed.is_empty() {
                bail!("the tokenizer has no ordinary tokens to draw prompts from");
            }
            // Tokens the encoder adds around any text (BOS, EOS), counted in the prompt.
            let specials = t
                .encode("a", true)?
                .len()
                .saturating_sub(t.encode("a", false)?.len());
            (allowed, specials)
        }
        None => (Vec::new(), 0),
    };
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let in_len = draw_len(&mut rng, input_len, range_ratio);
        let out_len = draw_len(&mut rng, output_len, range_ratio);
        let text = match tok {
            Some(t) => {
                let body = in_len.saturating_sub(specials).max(1);
                text_of_len(t, &mut rng, &allowed, body)?
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

    fn test_tokenizer() -> Option<Tokenizer> {
        let dir = match std::env::var("BATON_TEST_MODEL") {
            Ok(d) => std::path::PathBuf::from(d),
            Err(_) => {
                Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/models/stories260K")
            }
        };
        if !dir.join("tokenizer.json").exists() {
            eprintln!("skipping: no tokenizer at {}", dir.display());
            return None;
        }
        Some(load_tokenizer(&dir).unwrap())
    }

    #[test]
    fn byte_pieces_are_recognized() {
        assert!(is_byte_piece("<0x41>") && is_byte_piece("<0x0A>"));
        assert!(!is_byte_piece("<s>") && !is_byte_piece("▁the") && !is_byte_piece("<0xZZ>"));
    }

    #[test]
    fn random_with_the_test_model_tokenizer() {
        let Some(t) = test_tokenizer() else { return };
        let allowed = drawable_ids(&t).unwrap();
        for id in &allowed {
            let piece = t.id_to_piece(*id).unwrap();
            assert!(!is_byte_piece(&piece) && !["<s>", "</s>", "<unk>"].contains(&piece.as_str()));
        }
        let v = random(Some(&t), 4, 32, 64, 0.0, 0).unwrap();
        assert_eq!(v, random(Some(&t), 4, 32, 64, 0.0, 0).unwrap());
        for p in &v {
            assert_eq!(p.prompt_tokens, count_prompt(Some(&t), &p.text).unwrap());
            assert!(p.prompt_tokens.abs_diff(32) <= 3, "{p:?}");
            assert_eq!(p.max_tokens, 64);
        }
    }

    #[test]
    fn random_prompts_have_the_asked_token_count() {
        let Some(t) = test_tokenizer() else { return };
        // Fixed length: the mean re-encoded length is within 5% of --input-len.
        let v = random(Some(&t), 64, 128, 16, 0.0, 3).unwrap();
        let lens: Vec<usize> = v
            .iter()
            .map(|p| t.encode(&p.text, true).unwrap().len())
            .collect();
        let mean = lens.iter().sum::<usize>() as f64 / lens.len() as f64;
        assert!(
            (mean - 128.0).abs() <= 0.05 * 128.0,
            "mean {mean}: {lens:?}"
        );
        assert!(lens.iter().all(|&l| l.abs_diff(128) <= 6), "{lens:?}");
        // With --range-ratio 0.25: lengths in [96, 160], give or take a few tokens, and spread.
        let v = random(Some(&t), 64, 128, 16, 0.25, 4).unwrap();
        let lens: Vec<usize> = v
            .iter()
            .map(|p| t.encode(&p.text, true).unwrap().len())
            .collect();
        assert!(lens.iter().all(|&l| (92..=164).contains(&l)), "{lens:?}");
        let mean = lens.iter().sum::<usize>() as f64 / lens.len() as f64;
        assert!(
            (mean - 128.0).abs() <= 0.05 * 128.0,
            "mean {mean}: {lens:?}"
        );
        let (lo, hi) = (lens.iter().min().unwrap(), lens.iter().max().unwrap());
        assert!(*lo < 112 && *hi > 144, "{lo}..{hi}");
        for (p, l) in v.iter().zip(&lens) {
            assert_eq!(p.prompt_tokens, *l);
            assert!((12..=20).contains(&p.max_tokens));
        }
    }
}
