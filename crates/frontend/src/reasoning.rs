//! Reasoning parsers on `/v1/chat/completions` and `/v1/responses`, as vLLM serves them with
//! `--reasoning-parser qwen3|deepseek_r1`: the model's `<think>...</think>` text is returned
//! apart from the answer (`message.reasoning` and `message.reasoning_content` on chat, a
//! `reasoning` output item on Responses).
//!
//! Contract: a choice's output is split by text, never by token ids, so a tag split over
//! several tokens (or several deltas) is found, and streaming gives exactly the split of the
//! whole output: [`ReasoningSplitter::push`] holds back only a possible tag prefix at the end
//! of what it has seen, and [`ReasoningSplitter::finish`] releases it.
//!
//! The split, for both parsers (vLLM's `extract_reasoning`):
//! - the output starts in reasoning (the chat template may have put `<think>` in the prompt);
//! - the first `<think>` before any `</think>` is dropped (text before it stays reasoning;
//!   vLLM drops that text, which never appears in practice);
//! - the first `</think>` ends the reasoning: it is dropped and everything after it is
//!   content, tags included;
//! - an output without `</think>` (cut by `max_tokens`, or a model that did not think) is all
//!   reasoning, content `null`.
//!
//! `qwen3` differs in one case, as vLLM's: with `chat_template_kwargs.enable_thinking: false`
//! (the template then closes an empty `<think></think>` in the prompt), the output is all
//! content. vLLM's non-streamed path would still split at a `</think>` the model wrote anyway;
//! its streamed path, like this one, does not. `deepseek_r1` ignores `enable_thinking`.

use serde_json::{Map, Value};

/// The tag that opens reasoning.
pub const THINK_START: &str = "<think>";
/// The tag that ends reasoning.
pub const THINK_END: &str = "</think>";

/// A `--reasoning-parser` (vLLM's names).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReasoningParser {
    /// `qwen3`: `<think>...</think>`, off when `enable_thinking` is false.
    Qwen3,
    /// `deepseek_r1`: `<think>...</think>`, the opening tag optional (R1's template puts it in
    /// the prompt).
    DeepSeekR1,
}

/// The names `--reasoning-parser` accepts.
pub const REASONING_PARSER_NAMES: [&str; 2] = ["qwen3", "deepseek_r1"];

impl std::str::FromStr for ReasoningParser {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "qwen3" => Ok(Self::Qwen3),
            "deepseek_r1" => Ok(Self::DeepSeekR1),
            _ => Err(format!(
                "unknown reasoning parser {s:?}; this server has: {}",
                REASONING_PARSER_NAMES.join(", ")
            )),
        }
    }
}

impl ReasoningParser {
    /// The parser's flag name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Qwen3 => "qwen3",
            Self::DeepSeekR1 => "deepseek_r1",
        }
    }

    /// Whether a request rendered with `template_kwargs` has no reasoning at all: qwen3 with
    /// `enable_thinking: false`.
    pub fn thinking_off(self, template_kwargs: &Map<String, Value>) -> bool {
        self == Self::Qwen3 && template_kwargs.get("enable_thinking") == Some(&Value::Bool(false))
    }

    /// A splitter for one choice of a request rendered with `template_kwargs`.
    pub fn splitter(self, template_kwargs: &Map<String, Value>) -> ReasoningSplitter {
        let state = if self.thinking_off(template_kwargs) {
            State::Content
        } else {
            State::Start
        };
        ReasoningSplitter {
            state,
            held: String::new(),
        }
    }

    /// Splits a whole output (what [`ReasoningSplitter`] gives streamed).
    pub fn split(self, template_kwargs: &Map<String, Value>, text: &str) -> Split {
        let mut s = self.splitter(template_kwargs);
        let mut out = s.push(text);
        out.append(s.finish());
        out
    }
}

/// Reasoning and content text.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Split {
    /// The reasoning (tags removed).
    pub reasoning: String,
    /// The rest.
    pub content: String,
}

impl Split {
    /// Appends `other`.
    pub fn append(&mut self, other: Split) {
        self.reasoning.push_str(&other.reasoning);
        self.content.push_str(&other.content);
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Reasoning; `<think>` may still come (and is dropped).
    Start,
    /// Reasoning after `<think>`.
    Reasoning,
    /// After `</think>` (or with thinking off): everything is content.
    Content,
}

/// Per-choice streaming state of a reasoning parser.
#[derive(Clone, Debug)]
pub struct ReasoningSplitter {
    state: State,
    /// The end of the text seen so far that may be the start of a tag, not released yet.
    held: String,
}

impl ReasoningSplitter {
    /// Adds `text`; returns what can be released now.
    pub fn push(&mut self, text: &str) -> Split {
        let mut out = Split::default();
        if self.state == State::Content {
            out.content.push_str(&self.held);
            out.content.push_str(text);
            self.held.clear();
            return out;
        }
        let mut buf = std::mem::take(&mut self.held);
        buf.push_str(text);
        let mut rest = buf.as_str();
        loop {
            match self.state {
                State::Content => {
                    out.content.push_str(rest);
                    return out;
                }
                State::Start | State::Reasoning => {
                    let end = rest.find(THINK_END);
                    let start = rest
                        .find(THINK_START)
                        .filter(|_| self.state == State::Start)
                        .filter(|&s| end.is_none_or(|e| s < e));
                    if let Some(s) = start {
                        out.reasoning.push_str(&rest[..s]);
                        rest = &rest[s + THINK_START.len()..];
                        self.state = State::Reasoning;
                        continue;
                    }
                    if let Some(e) = end {
                        out.reasoning.push_str(&rest[..e]);
                        rest = &rest[e + THINK_END.len()..];
                        self.state = State::Content;
                        continue;
                    }
                    let mut keep = partial_suffix(rest, THINK_END);
                    if self.state == State::Start {
                        keep = keep.max(partial_suffix(rest, THINK_START));
                    }
                    let cut = rest.len() - keep;
                    out.reasoning.push_str(&rest[..cut]);
                    self.held = rest[cut..].to_owned();
                    return out;
                }
            }
        }
    }

    /// Whether the text pushed so far is still reasoning (no `</think>` yet, and thinking is
    /// on).
    pub fn in_reasoning(&self) -> bool {
        self.state != State::Content
    }

    /// Ends the choice: releases the held text (a tag prefix that never completed).
    pub fn finish(&mut self) -> Split {
        let held = std::mem::take(&mut self.held);
        match self.state {
            State::Content => Split {
                reasoning: String::new(),
                content: held,
            },
            State::Start | State::Reasoning => Split {
                reasoning: held,
                content: String::new(),
            },
        }
    }
}

/// The length of the longest proper prefix of `pat` (ASCII) that `s` ends with: how much of
/// `s`'s end a streaming parser holds back because `pat` may complete there (also the tool
/// parsers').
pub(crate) fn partial_suffix(s: &str, pat: &str) -> usize {
    (1..pat.len())
        .rev()
        .find(|&k| s.ends_with(&pat[..k]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn kw(v: Value) -> Map<String, Value> {
        v.as_object().cloned().unwrap_or_default()
    }

    fn split(p: ReasoningParser, kwargs: &Map<String, Value>, text: &str) -> (String, String) {
        let s = p.split(kwargs, text);
        (s.reasoning, s.content)
    }

    /// Feeds `text` one character at a time.
    fn by_chars(p: ReasoningParser, kwargs: &Map<String, Value>, text: &str) -> Split {
        let mut s = p.splitter(kwargs);
        let mut out = Split::default();
        let mut buf = [0u8; 4];
        for c in text.chars() {
            out.append(s.push(c.encode_utf8(&mut buf)));
        }
        out.append(s.finish());
        out
    }

    const CASES: [&str; 14] = [
        "<think>\nLet me think.\n</think>\n\nThe answer is 4.",
        "Thinking in the prompt already.</think>Answer",
        "no tags at all: cut by max_tokens",
        "<think>cut inside the reasoning",
        "<think></think>",
        "</think>",
        "",
        "<thi",
        "</thin",
        "a < b and c </ d </think> x <think> y </think> z",
        "<think>a</think>b<think>c</think>",
        "\n<think>é ☕</think>ü",
        "<think>I will call it.</think>\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>",
        "<<think>><</think>>",
    ];

    #[test]
    fn both_tags_split_reasoning_from_content() {
        for p in [ReasoningParser::Qwen3, ReasoningParser::DeepSeekR1] {
            let none = Map::new();
            assert_eq!(
                split(p, &none, CASES[0]),
                ("\nLet me think.\n".into(), "\n\nThe answer is 4.".into())
            );
            // Only `</think>`: the template opened the reasoning in the prompt.
            assert_eq!(
                split(p, &none, CASES[1]),
                ("Thinking in the prompt already.".into(), "Answer".into())
            );
            // Neither, or cut inside: all reasoning.
            assert_eq!(split(p, &none, CASES[2]), (CASES[2].into(), String::new()));
            assert_eq!(
                split(p, &none, CASES[3]),
                ("cut inside the reasoning".into(), String::new())
            );
            // Only the first `</think>` counts; later tags are content.
            assert_eq!(
                split(p, &none, CASES[9]),
                ("a < b and c </ d ".into(), " x <think> y </think> z".into())
            );
            assert_eq!(
                split(p, &none, CASES[10]),
                ("a".into(), "b<think>c</think>".into())
            );
            // A tag prefix that never completes is text.
            assert_eq!(split(p, &none, CASES[7]), ("<thi".into(), String::new()));
            assert_eq!(
                split(p, &none, CASES[13]),
                ("<><".into(), ">".into()),
                "{p:?}"
            );
        }
    }

    #[test]
    fn qwen3_with_thinking_off_is_all_content_and_deepseek_ignores_it() {
        let off = kw(json!({"enable_thinking": false}));
        for text in CASES {
            assert_eq!(
                split(ReasoningParser::Qwen3, &off, text),
                (String::new(), text.to_owned())
            );
        }
        assert_eq!(
            split(ReasoningParser::DeepSeekR1, &off, CASES[0]),
            split(ReasoningParser::DeepSeekR1, &Map::new(), CASES[0])
        );
        // Only `false` turns it off (vLLM: `chat_template_kwargs.get("enable_thinking", True)`).
        let on = kw(json!({"enable_thinking": true}));
        assert_eq!(
            split(ReasoningParser::Qwen3, &on, CASES[2]),
            (CASES[2].into(), String::new())
        );
    }

    #[test]
    fn streaming_one_character_at_a_time_gives_the_whole_split() {
        for p in [ReasoningParser::Qwen3, ReasoningParser::DeepSeekR1] {
            for kwargs in [Map::new(), kw(json!({"enable_thinking": false}))] {
                for text in CASES {
                    let whole = p.split(&kwargs, text);
                    assert_eq!(by_chars(p, &kwargs, text), whole, "{p:?} {text:?}");
                }
            }
        }
    }

    #[test]
    fn streaming_releases_text_as_soon_as_it_cannot_be_a_tag() {
        let mut s = ReasoningParser::Qwen3.splitter(&Map::new());
        assert_eq!(s.push("<th").reasoning, "");
        assert_eq!(s.push("ink>abc</").reasoning, "abc");
        let out = s.push("think>x");
        assert_eq!((out.reasoning.as_str(), out.content.as_str()), ("", "x"));
        assert_eq!(s.push("</").content, "</", "content is never held");
        assert_eq!(s.finish(), Split::default());
        // A held prefix that turns out not to be a tag is released as reasoning.
        let mut s = ReasoningParser::DeepSeekR1.splitter(&Map::new());
        assert_eq!(s.push("a</thi").reasoning, "a");
        assert_eq!(s.push("s").reasoning, "</this");
        assert_eq!(s.push("<").reasoning, "");
        assert_eq!(s.finish().reasoning, "<");
    }

    #[test]
    fn names_round_trip() {
        for n in REASONING_PARSER_NAMES {
            assert_eq!(n.parse::<ReasoningParser>().unwrap().name(), n);
        }
        assert!("granite".parse::<ReasoningParser>().is_err());
    }
}
