//! The frontend's readers of model output (tool-call parsers, the reasoning splitter, stop
//! strings) take whatever text a model writes. For any text and any way of cutting it into
//! streamed pieces they must not panic, and a streamed choice must come out as the same
//! content, reasoning and tool calls as the whole text read at once (what a client gets with
//! `stream: true` equals what it gets without).
//!
//! Input: byte 0 picks the tool parser and the stop strings, byte 1 seeds the piece sizes, the
//! rest is the output text (lossy UTF-8).
#![no_main]

use baton_frontend::reasoning::ReasoningParser;
use baton_frontend::stop::StopMatcher;
use baton_frontend::tools::{CallMode, StreamFilter, ToolParser, TOOL_PARSER_NAMES};
use libfuzzer_sys::fuzz_target;

/// `text` cut at char boundaries into pieces of 1..=8 chars, sizes from `seed`.
fn pieces(text: &str, seed: u8) -> Vec<&str> {
    let mut out = Vec::new();
    let (mut rest, mut s) = (text, u32::from(seed) | 1);
    while !rest.is_empty() {
        s = s.wrapping_mul(1_103_515_245).wrapping_add(12_345);
        let n = 1 + (s >> 16) as usize % 8;
        let cut = rest.char_indices().nth(n).map_or(rest.len(), |(i, _)| i);
        out.push(&rest[..cut]);
        rest = &rest[cut..];
    }
    out
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 2 {
        return;
    }
    let (pick, seed) = (data[0], data[1]);
    let text = String::from_utf8_lossy(&data[2..]);
    let parts = pieces(&text, seed);
    let tools = vec![
        serde_json::json!({"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"},
        "days": {"type": "integer"}, "hot": {"type": "boolean"}}}}}),
    ];

    // Tool calls: streamed pieces then finish == the whole text pushed at once.
    let parser: ToolParser = TOOL_PARSER_NAMES[pick as usize % TOOL_PARSER_NAMES.len()]
        .parse()
        .expect("a listed parser name");
    let mode = match pick / 8 % 4 {
        0 => CallMode::Named("get_weather".into()),
        1 => CallMode::Required,
        _ => CallMode::Parser(parser),
    };
    let run = |parts: &[&str]| {
        let mut f = StreamFilter::with_tools(mode.clone(), tools.clone());
        let mut content: String = parts.iter().map(|p| f.push(p)).collect();
        let (rest, calls) = f.finish();
        content.push_str(&rest);
        (content, calls)
    };
    assert_eq!(run(&parts), run(&[&text]), "{mode:?}, pieces {parts:?}");
    let _ = parser.parse_with(&text, &tools);

    // Reasoning: the split of the streamed pieces == the split of the whole text.
    for rp in [ReasoningParser::Qwen3, ReasoningParser::DeepSeekR1] {
        let kwargs = serde_json::Map::new();
        let split = |parts: &[&str]| {
            let mut s = rp.splitter(&kwargs);
            let (mut r, mut c) = (String::new(), String::new());
            for p in parts {
                let o = s.push(p);
                r.push_str(&o.reasoning);
                c.push_str(&o.content);
            }
            let o = s.finish();
            (r + &o.reasoning, c + &o.content)
        };
        assert_eq!(split(&parts), split(&[&text]), "{rp:?}, pieces {parts:?}");
    }

    // Stop strings. Which stop matches depends on where the pieces end (the first piece in
    // which a stop string is complete wins, as in vLLM, which checks after every token), so
    // the streamed result is checked against the text itself: what is released is a prefix of
    // the text; a stop is reported only when the text holds it, and it is found whenever the
    // text holds one.
    let stops: Vec<String> = match pick % 3 {
        0 => vec!["\n\n".into(), "END".into()],
        1 => vec!["aa".into(), "a".into(), "ab".into()],
        _ => vec!["</s>".into(), "é".into(), "<|im_end|>".into()],
    };
    for include in [false, true] {
        let mut m = StopMatcher::new(&stops, include);
        let (mut out, mut matched) = (String::new(), None);
        for p in &parts {
            let o = m.push(p);
            out.push_str(&o.text);
            if o.matched.is_some() {
                matched = o.matched;
                break;
            }
        }
        if matched.is_none() {
            out.push_str(&m.flush());
        }
        assert!(
            text.starts_with(&out),
            "stops {stops:?}, pieces {parts:?}: released {out:?}"
        );
        match &matched {
            Some(s) => {
                // The match starts where the released text ends (or ends there, with
                // `include_stop_str_in_output`).
                let cut = if include {
                    out.clone()
                } else {
                    out.clone() + s
                };
                assert!(
                    text.starts_with(&cut) && cut.ends_with(s.as_str()),
                    "stops {stops:?}, pieces {parts:?}: released {out:?}, matched {s:?}"
                );
            }
            None => {
                assert_eq!(out, text, "stops {stops:?}, pieces {parts:?}");
                assert!(
                    !stops.iter().any(|s| text.contains(s.as_str())),
                    "stops {stops:?}, pieces {parts:?}"
                );
            }
        }
    }
});
