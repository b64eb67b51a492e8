//! Incremental detokenization (the vLLM / HF `prefix_offset`/`read_offset` method).
//!
//! Contract: each new token decodes a short window of ids twice — `ids[prefix..read]` and
//! `ids[prefix..]` — and emits the new window's text past the old one, only when that text does
//! not end in U+FFFD (an incomplete multi-byte character, e.g. byte-fallback pieces split across
//! tokens). The windows start at the same id, so SentencePiece's leading-space stripping affects
//! both alike. [`IncrementalDetokenizer::finish`] flushes whatever is still held back. The whole
//! output text of a request is, by definition, the concatenation of the pieces this emits, so a
//! streamed and a non-streamed response are equal.
//!
//! For model-like output (vocabulary pieces and characters spelled in byte-fallback tokens) the
//! text equals `decode(prompt + output) - decode(prompt)`. Two cases have no such reference and
//! differ from it: a prompt that ends inside a character the output completes (the completed
//! character is emitted whole), and a byte-fallback run that is invalid UTF-8 as a whole, which
//! `tokenizers` turns into one U+FFFD per byte, even for an ASCII byte already emitted.

use baton_model::Tokenizer;

/// How many prompt ids before the first output the first window starts (vLLM's
/// `INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET`).
const INITIAL_OFFSET: usize = 5;

/// Incremental decoder state of one sequence.
#[derive(Clone, Debug)]
pub struct IncrementalDetokenizer {
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
    skip_special: bool,
}

impl IncrementalDetokenizer {
    /// A decoder whose output continues `prompt` (only its last few ids matter).
    pub fn new(prompt: &[u32], skip_special: bool) -> Self {
        let start = prompt.len().saturating_sub(INITIAL_OFFSET);
        let ids = prompt[start..].to_vec();
        let read_offset = ids.len();
        Self {
            ids,
            prefix_offset: 0,
            read_offset,
            skip_special,
        }
    }

    /// Adds one output token; returns the text it completes (possibly empty).
    pub fn push(&mut self, tok: &Tokenizer, token: u32) -> String {
        self.ids.push(token);
        self.emit(tok, false)
    }

    /// Text still held back (an incomplete character at the end), flushed as decoded.
    pub fn finish(&mut self, tok: &Tokenizer) -> String {
        if self.read_offset >= self.ids.len() {
            return String::new();
        }
        self.emit(tok, true)
    }

    fn emit(&mut self, tok: &Tokenizer, force: bool) -> String {
        let decode = |ids: &[u32]| tok.decode(ids, self.skip_special).unwrap_or_default();
        let prefix_text = decode(&self.ids[self.prefix_offset..self.read_offset]);
        let new_text = decode(&self.ids[self.prefix_offset..]);
        let common = common_prefix_len(&prefix_text, &new_text);
        let out = &new_text[common..];
        if out.is_empty() || (!force && new_text.ends_with('\u{FFFD}')) {
            return String::new();
        }
        // Keep the window short: drop ids before the new prefix offset.
        let out = out.to_owned();
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        if self.prefix_offset > 0 {
            self.ids.drain(..self.prefix_offset);
            self.read_offset -= self.prefix_offset;
            self.prefix_offset = 0;
        }
        out
    }
}

/// Byte length of the longest common prefix of `a` and `b`, on a character boundary.
///
/// Normally `b` starts with `a`; when the prompt ended inside a multi-byte character, `a` ends
/// in U+FFFD that `b` replaces with the completed character, and the text from the first
/// difference on is new.
fn common_prefix_len(a: &str, b: &str) -> usize {
    let mut n = 0;
    for ((i, ca), cb) in a.char_indices().zip(b.chars()) {
        if ca != cb {
            return i;
        }
        n = i + ca.len_utf8();
    }
    n
}

#[cfg(test)]
mod tests {
    use super::common_prefix_len;

    #[test]
    fn common_prefix_stops_at_char_boundary() {
        assert_eq!(common_prefix_len("ab", "abc"), 2);
        assert_eq!(common_prefix_len("\u{FFFD}\u{FFFD}", "😀"), 0);
        assert_eq!(common_prefix_len("x\u{FFFD}", "x😀y"), 1);
        assert_eq!(common_prefix_len("", "a"), 0);
        assert_eq!(common_prefix_len("abc", "ab"), 2);
    }
}
