//! Server-sent events as OpenAI-compatible servers stream them: an incremental line splitter
//! over one reused buffer, and a zero-copy reading of each `data:` payload.
//!
//! Each `data:` line is taken as one event (OpenAI, vLLM and Baton never split a payload over
//! several `data:` lines). Nothing here allocates per event unless a chunk's text holds a JSON
//! escape (then serde copies that one string).

use serde::de::{IgnoredAny, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer};
use std::borrow::Cow;
use std::marker::PhantomData;

/// Longest line accepted (bytes) before the body is declared not to be SSE.
pub const MAX_LINE: usize = 1 << 20;

/// One line of an SSE stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Line<'a> {
    /// The payload of a `data:` line (one optional leading space and the line ending removed).
    Data(&'a [u8]),
    /// A blank line (event boundary), a `:` comment, or an `event:`/`id:`/`retry:` field.
    Ignored,
    /// A line that is none of the SSE forms: the body is not an event stream.
    Invalid(&'a [u8]),
}

/// Splits a byte stream into SSE lines, keeping one buffer across reads.
#[derive(Debug, Default)]
pub struct LineSplitter {
    buf: Vec<u8>,
    pos: usize,
}

impl LineSplitter {
    /// An empty splitter with `capacity` bytes reserved.
    pub fn with_capacity(capacity: usize) -> Self {
        LineSplitter {
            buf: Vec::with_capacity(capacity),
            pos: 0,
        }
    }

    /// Appends bytes read from the body. Consumed lines are dropped first (a move within the
    /// buffer, no allocation once the buffer has grown to the longest line).
    ///
    /// # Errors
    /// When the unfinished line grows past [`MAX_LINE`] bytes.
    pub fn feed(&mut self, bytes: &[u8]) -> Result<(), String> {
        if self.pos > 0 {
            self.buf.drain(..self.pos);
            self.pos = 0;
        }
        self.buf.extend_from_slice(bytes);
        if self.buf.len() > MAX_LINE && !self.buf.contains(&b'\n') {
            return Err(format!(
                "a line longer than {MAX_LINE} bytes without a newline: not an event stream"
            ));
        }
        Ok(())
    }

    /// The next complete line, if one has arrived.
    #[allow(clippy::should_implement_trait)] // lends from self; not an Iterator
    pub fn next(&mut self) -> Option<Line<'_>> {
        let rest = &self.buf[self.pos..];
        let nl = rest.iter().position(|&b| b == b'\n')?;
        let start = self.pos;
        self.pos += nl + 1;
        let mut line = &self.buf[start..start + nl];
        if let [head @ .., b'\r'] = line {
            line = head;
        }
        Some(classify(line))
    }

    /// Bytes received but not yet ended by a newline.
    pub fn pending(&self) -> &[u8] {
        &self.buf[self.pos..]
    }
}

fn classify(line: &[u8]) -> Line<'_> {
    if line.is_empty() || line[0] == b':' {
        return Line::Ignored;
    }
    if let Some(rest) = line.strip_prefix(b"data:") {
        return Line::Data(rest.strip_prefix(b" ").unwrap_or(rest));
    }
    for field in [&b"event:"[..], b"id:", b"retry:", b"event", b"data", b"id"] {
        if line.starts_with(field) && (field.ends_with(b":") || line.len() == field.len()) {
            return Line::Ignored;
        }
    }
    Line::Invalid(line)
}

/// Token counts of a `usage` object.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
pub struct Usage {
    /// Prompt tokens as the server counted them.
    #[serde(default)]
    pub prompt_tokens: u64,
    /// Generated tokens as the server counted them.
    #[serde(default)]
    pub completion_tokens: u64,
}

/// What one `data:` payload says.
#[derive(Debug, PartialEq)]
pub enum Event<'a> {
    /// `[DONE]`: the stream is complete.
    Done,
    /// A chunk: the first choice's text (`text` of a completion, `delta.content` of a chat
    /// chunk; `None` when the chunk has no choice or no text), whether it stands for one
    /// generated token (see [`is_token`]), and usage if present.
    Chunk {
        /// The generated text in this chunk.
        text: Option<Cow<'a, str>>,
        /// The chunk carries one generated token.
        token: bool,
        /// The `usage` object, if this chunk carries one.
        usage: Option<Usage>,
    },
    /// An `{"error": ...}` event; the message.
    Error(String),
}

#[derive(Deserialize)]
struct RawChunk<'a> {
    #[serde(default, borrow)]
    choices: FirstChoice<'a>,
    #[serde(default)]
    usage: Option<Usage>,
    #[serde(default)]
    error: Option<serde_json::Value>,
    #[serde(default, borrow)]
    object: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct Choice<'a> {
    #[serde(default, borrow)]
    text: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    delta: Option<Delta<'a>>,
    #[serde(default)]
    finish_reason: Option<IgnoredAny>,
}

#[derive(Deserialize)]
struct Delta<'a> {
    #[serde(default, borrow)]
    content: Option<Cow<'a, str>>,
    #[serde(default)]
    role: Option<IgnoredAny>,
}

/// Whether a streamed chunk's first choice stands for one generated token: it has non-empty
/// text, or empty text and a null `finish_reason` (a token whose text is empty, such as a
/// special token, or a token that ends inside a UTF-8 character). Not tokens: a chunk without
/// choices (usage only), the terminal chunk (`finish_reason` set and no text), and a chat
/// chunk that only announces the `role` (Baton and vLLM send `{"role":"assistant",
/// "content":""}` before the first token).
///
/// `has_choice`: the chunk has a first choice; `text`: its text or delta content;
/// `finished`: its `finish_reason` is set; `role`: its delta carries a role.
pub fn is_token(has_choice: bool, text: Option<&str>, finished: bool, role: bool) -> bool {
    let empty = text.is_none_or(str::is_empty);
    has_choice && (!empty || (!finished && !role))
}

/// The first element of `choices`; the others are skipped without allocating.
#[derive(Default)]
struct FirstChoice<'a>(Option<Choice<'a>>);

impl<'de: 'a, 'a> Deserialize<'de> for FirstChoice<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = FirstChoice<'a>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a list of choices")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let first = seq.next_element::<Choice<'a>>()?;
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(FirstChoice(first))
            }
            fn visit_unit<E>(self) -> Result<Self::Value, E> {
                Ok(FirstChoice(None))
            }
        }
        d.deserialize_any(V(PhantomData))
    }
}

/// Reads one `data:` payload.
///
/// # Errors
/// A payload that is not `[DONE]` nor a JSON object of the OpenAI chunk shape; the message
/// quotes its start.
pub fn parse_event(payload: &[u8]) -> Result<Event<'_>, String> {
    let payload = payload.trim_ascii();
    if payload == b"[DONE]" {
        return Ok(Event::Done);
    }
    let raw: RawChunk<'_> = serde_json::from_slice(payload).map_err(|e| {
        format!(
            "an SSE data payload that is not an OpenAI chunk ({e}): {}",
            excerpt(payload)
        )
    })?;
    if let Some(err) = raw.error {
        return Ok(Event::Error(error_message(&err)));
    }
    let has_choices = raw.choices.0.is_some();
    if !has_choices && raw.usage.is_none() && raw.object.is_none() {
        return Err(format!(
            "an SSE data payload with neither choices nor usage: {}",
            excerpt(payload)
        ));
    }
    let (text, token) = match raw.choices.0 {
        None => (None, false),
        Some(c) => {
            let finished = c.finish_reason.is_some();
            let (content, role) = match c.delta {
                Some(d) => (d.content, d.role.is_some()),
                None => (None, false),
            };
            let text = c.text.or(content);
            let token = is_token(true, text.as_deref(), finished, role);
            (text, token)
        }
    };
    Ok(Event::Chunk {
        text,
        token,
        usage: raw.usage,
    })
}

/// The `message` of an OpenAI error object (or the whole value when it has none).
pub fn error_message(err: &serde_json::Value) -> String {
    match err {
        serde_json::Value::String(s) => s.clone(),
        v => v
            .get("message")
            .and_then(|m| m.as_str())
            .map(str::to_owned)
            .unwrap_or_else(|| v.to_string()),
    }
}

/// The first 200 bytes of `bytes`, lossily as text, for error messages.
pub fn excerpt(bytes: &[u8]) -> String {
    let cut = &bytes[..bytes.len().min(200)];
    let mut s = String::from_utf8_lossy(cut).replace('\n', "\\n");
    if bytes.len() > cut.len() {
        s.push('…');
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(split: &mut LineSplitter) -> Vec<String> {
        let mut out = Vec::new();
        while let Some(l) = split.next() {
            out.push(match l {
                Line::Data(d) => format!("D:{}", String::from_utf8_lossy(d)),
                Line::Ignored => "I".into(),
                Line::Invalid(d) => format!("X:{}", String::from_utf8_lossy(d)),
            });
        }
        out
    }

    #[test]
    fn lines_split_across_reads_are_joined() {
        let mut s = LineSplitter::default();
        s.feed(b"data: {\"a\"").unwrap();
        assert!(lines(&mut s).is_empty());
        s.feed(b":1}\r\n\r\nda").unwrap();
        assert_eq!(lines(&mut s), vec!["D:{\"a\":1}", "I"]);
        s.feed(b"ta: [DONE]\n\n").unwrap();
        assert_eq!(lines(&mut s), vec!["D:[DONE]", "I"]);
        assert!(s.pending().is_empty());
    }

    #[test]
    fn comments_and_fields_are_ignored_and_html_is_invalid() {
        let mut s = LineSplitter::default();
        s.feed(b": keep-alive\nevent: message\nid: 3\nretry: 10\ndata:x\n<html>\n")
            .unwrap();
        assert_eq!(lines(&mut s), vec!["I", "I", "I", "I", "D:x", "X:<html>"]);
    }

    #[test]
    fn an_endless_line_is_refused() {
        let mut s = LineSplitter::default();
        let big = vec![b'a'; MAX_LINE + 1];
        assert!(s.feed(&big).is_err());
    }

    #[test]
    fn the_buffer_is_reused() {
        let mut s = LineSplitter::with_capacity(64);
        for _ in 0..1000 {
            s.feed(b"data: {\"choices\":[{\"text\":\"a\"}]}\n\n")
                .unwrap();
            assert_eq!(lines(&mut s).len(), 2);
        }
        assert!(s.buf.capacity() <= 128, "capacity {}", s.buf.capacity());
    }

    #[test]
    fn completion_chat_usage_done_and_error_payloads() {
        let c = parse_event(br#"{"id":"x","object":"text_completion","choices":[{"index":0,"text":" cat","logprobs":null,"finish_reason":null}],"usage":null}"#).unwrap();
        assert_eq!(
            c,
            Event::Chunk {
                text: Some(Cow::Borrowed(" cat")),
                token: true,
                usage: None
            }
        );
        let c = parse_event(br#"{"object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"a\nb"}},{"index":1,"delta":{"content":"zz"}}]}"#).unwrap();
        assert_eq!(
            c,
            Event::Chunk {
                text: Some(Cow::Owned("a\nb".into())),
                token: true,
                usage: None
            }
        );
        let c = parse_event(br#"{"object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant"}}]}"#).unwrap();
        assert_eq!(
            c,
            Event::Chunk {
                text: None,
                token: false,
                usage: None
            }
        );
        let c = parse_event(br#"{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":64,"total_tokens":69}}"#).unwrap();
        assert_eq!(
            c,
            Event::Chunk {
                text: None,
                token: false,
                usage: Some(Usage {
                    prompt_tokens: 5,
                    completion_tokens: 64
                })
            }
        );
        assert_eq!(parse_event(b" [DONE] ").unwrap(), Event::Done);
        assert_eq!(
            parse_event(br#"{"error":{"message":"boom","type":"internal"}}"#).unwrap(),
            Event::Error("boom".into())
        );
        assert_eq!(
            parse_event(br#"{"error":"plain"}"#).unwrap(),
            Event::Error("plain".into())
        );
    }

    fn token(payload: &[u8]) -> bool {
        match parse_event(payload).unwrap() {
            Event::Chunk { token, .. } => token,
            e => panic!("{e:?}"),
        }
    }

    #[test]
    fn an_empty_text_token_counts_and_the_terminal_chunk_does_not() {
        // A special token (`<s>` with ignore_eos) streams as empty text, finish_reason null.
        assert!(token(
            br#"{"object":"text_completion","choices":[{"index":0,"text":"","logprobs":null,"finish_reason":null}]}"#
        ));
        assert!(token(
            br#"{"object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":""},"finish_reason":null}]}"#
        ));
        // The last token may come with the finish reason: it still counts.
        assert!(token(
            br#"{"object":"text_completion","choices":[{"index":0,"text":" end","finish_reason":"length"}]}"#
        ));
        // The terminal chunk: finish_reason set, no text.
        assert!(!token(
            br#"{"object":"text_completion","choices":[{"index":0,"text":"","logprobs":null,"finish_reason":"length"}]}"#
        ));
        assert!(!token(
            br#"{"object":"chat.completion.chunk","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}"#
        ));
        assert!(!token(
            br#"{"object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":""},"finish_reason":"stop"}]}"#
        ));
        // Usage only.
        assert!(!token(
            br#"{"object":"text_completion","choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2}}"#
        ));
    }

    #[test]
    fn a_role_only_chat_chunk_is_not_a_token() {
        // Baton's and vLLM's first chat chunk.
        assert!(!token(
            br#"{"object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}"#
        ));
        assert!(!token(
            br#"{"object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant"},"finish_reason":null}]}"#
        ));
        // A role chunk that also carries text is a token.
        assert!(token(
            br#"{"object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":"Hi"},"finish_reason":null}]}"#
        ));
        // `"role": null` is no role.
        assert!(token(
            br#"{"object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":null,"content":""},"finish_reason":null}]}"#
        ));
    }

    #[test]
    fn non_openai_payloads_are_errors() {
        assert!(parse_event(b"hello").unwrap_err().contains("hello"));
        assert!(parse_event(br#"{"foo":1}"#).is_err());
        assert!(parse_event(br#"[1,2]"#).is_err());
    }

    proptest::proptest! {
        /// However a stream is cut into reads, the same lines come out.
        #[test]
        fn any_split_gives_the_same_lines(cuts in proptest::collection::vec(0usize..200, 0..8)) {
            let body: &[u8] = b"data: {\"choices\":[{\"text\":\"x\"}]}\r\n\r\n: c\ndata: [DONE]\n\n";
            let mut whole = LineSplitter::default();
            whole.feed(body).unwrap();
            let want = lines(&mut whole);
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % (body.len() + 1)).collect();
            cuts.sort_unstable();
            let mut s = LineSplitter::default();
            let mut got = Vec::new();
            let mut prev = 0;
            for c in cuts.into_iter().chain([body.len()]) {
                s.feed(&body[prev..c]).unwrap();
                got.extend(lines(&mut s));
                prev = c;
            }
            proptest::prop_assert_eq!(got, want);
        }
    }
}
