//! Chat templates: Hugging Face-style Jinja templates rendered with minijinja.
//!
//! Contract: the environment matches transformers' (`trim_blocks`, `lstrip_blocks`, loop
//! controls, Python string/dict methods through `minijinja-contrib`'s pycompat, and `tojson`
//! as transformers defines it: Python's `json.dumps` with `ensure_ascii=False`, not
//! minijinja's, which escapes `<`, `>`, `&` and `'` for HTML and so would change a tool's
//! description in the prompt), and
//! provides `raise_exception(msg)` and `strftime_now(fmt)`. The context holds `messages`,
//! `add_generation_prompt`, `bos_token`, `eos_token`, `tools` (the request's tools, or none)
//! and any `chat_template_kwargs` (which, as in transformers, win over `bos_token`,
//! `eos_token` and `tools`; `messages` and `add_generation_prompt` are the caller's). A template
//! that raises or fails to render is the client's problem (a 400), never a panic.
//!
//! OpenAI's `developer` role (its name for system instructions in newer clients) reaches a
//! template that never mentions `developer` as `system`, so a Llama template puts the
//! instruction where the model was trained to see it instead of refusing or dropping it; a
//! template that handles `developer` itself gets it unchanged.

use minijinja::value::Kwargs;
use minijinja::{Environment, Error, ErrorKind, Value};
use serde_json::Map;

const NAME: &str = "chat";

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// The source mentions `developer`: pass that role through unchanged.
    knows_developer: bool,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").finish_non_exhaustive()
    }
}

/// `--chat-template` takes a file path or the template itself (as vLLM does): a value with
/// Jinja markup (`{%` or `{{`) is the template text; anything else must name a readable file,
/// so a mistyped path is an error rather than a template that prints the path.
///
/// # Errors
/// The value has no Jinja markup and is not a readable file.
pub fn load_template_arg(arg: &str) -> anyhow::Result<String> {
    if arg.contains("{%") || arg.contains("{{") {
        return Ok(arg.to_owned());
    }
    let path = std::path::Path::new(arg);
    std::fs::read_to_string(path).map_err(|e| {
        anyhow::anyhow!(
            "--chat-template {}: {e} (give a template file, or the template text itself)",
            path.display()
        )
    })
}

/// transformers' `tojson(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`: Python's `json.dumps` with those arguments.
fn tojson(value: &Value, indent: Option<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let bad = |msg: &str| Error::new(ErrorKind::InvalidOperation, format!("tojson: {msg}"));
    let indent = match indent {
        Some(v) => Some(v),
        None => kwargs.get::<Option<Value>>("indent")?,
    };
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.as_str() {
            Some(s) => Some(s.to_owned()),
            None => Some(" ".repeat(
                usize::try_from(v).map_err(|_| bad("indent must be a number or a string"))?,
            )),
        },
    };
    let ensure_ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    let separators = kwargs.get::<Option<Vec<String>>>("separators")?;
    kwargs.assert_all_used()?;
    let (item, key) = match separators {
        None if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        None => (", ".to_owned(), ": ".to_owned()),
        Some(s) => match <[String; 2]>::try_from(s) {
            Ok([i, k]) => (i, k),
            Err(_) => return Err(bad("separators must be a pair of strings")),
        },
    };
    let json = serde_json::to_value(value).map_err(|e| bad(&e.to_string()))?;
    let mut out = String::new();
    let style = PyJson {
        indent: indent.as_deref(),
        item: &item,
        key: &key,
        ensure_ascii,
        sort_keys,
    };
    style.dump(&json, 0, &mut out);
    Ok(Value::from_safe_string(out))
}

/// How Python's `json.dumps` writes a value.
struct PyJson<'a> {
    indent: Option<&'a str>,
    item: &'a str,
    key: &'a str,
    ensure_ascii: bool,
    sort_keys: bool,
}

impl PyJson<'_> {
    fn newline(&self, level: usize, out: &mut String) {
        if let Some(ind) = self.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(ind);
            }
        }
    }

    fn dump(&self, v: &serde_json::Value, level: usize, out: &mut String) {
        use serde_json::Value as J;
        match v {
            J::Null => out.push_str("null"),
            J::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            J::Number(n) => out.push_str(&n.to_string()),
            J::String(s) => self.string(s, out),
            J::Array(items) if items.is_empty() => out.push_str("[]"),
            J::Array(items) => {
                out.push('[');
                for (i, x) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(self.item);
                    }
                    self.newline(level + 1, out);
                    self.dump(x, level + 1, out);
                }
                self.newline(level, out);
                out.push(']');
            }
            J::Object(map) if map.is_empty() => out.push_str("{}"),
            J::Object(map) => {
                let mut entries: Vec<(&String, &serde_json::Value)> = map.iter().collect();
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(b.0));
                }
                out.push('{');
                for (i, (k, x)) in entries.into_iter().enumerate() {
                    if i > 0 {
                        out.push_str(self.item);
                    }
                    self.newline(level + 1, out);
                    self.string(k, out);
                    out.push_str(self.key);
                    self.dump(x, level + 1, out);
                }
                self.newline(level, out);
                out.push('}');
            }
        }
    }

    fn string(&self, s: &str, out: &mut String) {
        py_json_string(s, self.ensure_ascii, out);
    }
}

/// Writes `s` as a JSON string the way Python's `json.dumps` does: `\"`, `\\`, the short
/// escapes (`\n`, `\r`, `\t`, `\b`, `\f`), other control characters as `\u00XX`, and with
/// `ensure_ascii` everything outside space..`~` as UTF-16 `\uXXXX` units.
pub(crate) fn py_json_string(s: &str, ensure_ascii: bool, out: &mut String) {
    use std::fmt::Write as _;
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && (c as u32) > 0x7e) => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{:04x}", u);
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

/// `strftime_now(fmt)` for the common `%d %b %Y`-style formats Llama 3 templates use (UTC).
fn strftime_now(fmt: String) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    strftime(secs, &fmt)
}

fn strftime(secs: u64, fmt: &str) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
    ];
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let month = MONTHS[(m - 1) as usize];
    let weekday = DAYS[(days.rem_euclid(7)) as usize];
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('e') => out.push_str(&format!("{d:>2}")),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&format!("{:02}", y.rem_euclid(100))),
            Some('b') => out.push_str(&month[..3]),
            Some('B') => out.push_str(month),
            Some('a') => out.push_str(&weekday[..3]),
            Some('A') => out.push_str(weekday),
            Some('H') => out.push_str(&format!("{:02}", rem / 3600)),
            Some('M') => out.push_str(&format!("{:02}", rem / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", rem % 60)),
            Some('%') => out.push('%'),
            Some(o) => {
                out.push('%');
                out.push(o);
            }
            None => out.push('%'),
        }
    }
    out
}

impl ChatTemplate {
    /// Compiles `source`.
    ///
    /// # Errors
    /// A syntax error, with minijinja's description.
    pub fn new(source: String) -> Result<Self, String> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| e.to_string())?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        minijinja_contrib::add_to_environment(&mut env);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        let knows_developer = source.contains("developer");
        env.add_template_owned(NAME, source)
            .map_err(|e| format!("invalid chat template: {e:#}"))?;
        Ok(Self {
            env,
            knows_developer,
        })
    }

    /// Renders the prompt for `messages`.
    ///
    /// # Errors
    /// The template raised (`raise_exception`) or failed; the message says why.
    pub fn render(
        &self,
        messages: &[serde_json::Value],
        add_generation_prompt: bool,
        bos_token: &str,
        eos_token: &str,
        kwargs: &Map<String, serde_json::Value>,
    ) -> Result<String, String> {
        let mut ctx = kwargs.clone();
        let mut messages = messages.to_vec();
        if !self.knows_developer {
            for m in &mut messages {
                if let Some(role) = m.get_mut("role").filter(|r| *r == "developer") {
                    *role = "system".into();
                }
            }
        }
        ctx.insert("messages".into(), serde_json::Value::from(messages));
        ctx.insert(
            "add_generation_prompt".into(),
            serde_json::Value::Bool(add_generation_prompt),
        );
        ctx.entry("bos_token").or_insert_with(|| bos_token.into());
        ctx.entry("eos_token").or_insert_with(|| eos_token.into());
        // As transformers' `apply_chat_template`: `tools` is always defined (none without).
        ctx.entry("tools").or_insert(serde_json::Value::Null);
        let ctx = Value::from(minijinja::value::Serde(serde_json::Value::Object(ctx)));
        let tmpl = self.env.get_template(NAME).map_err(|e| e.to_string())?;
        tmpl.render(ctx).map_err(|e| {
            if e.kind() == ErrorKind::InvalidOperation {
                e.detail()
                    .map(str::to_owned)
                    .unwrap_or_else(|| e.to_string())
            } else {
                format!("the chat template failed: {e}")
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const LLAMA2: &str = "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}";

    #[test]
    fn llama2_template_renders_like_transformers() {
        let t = ChatTemplate::new(LLAMA2.into()).unwrap();
        let msgs = vec![
            json!({"role": "system", "content": "Be brief."}),
            json!({"role": "user", "content": "Hi "}),
        ];
        let out = t.render(&msgs, true, "<s>", "</s>", &Map::new()).unwrap();
        assert_eq!(out, "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST]");
    }

    #[test]
    fn developer_role_is_system_unless_the_template_handles_it() {
        let t = ChatTemplate::new(LLAMA2.into()).unwrap();
        let as_system = t
            .render(
                &[
                    json!({"role": "system", "content": "Be brief."}),
                    json!({"role": "user", "content": "Hi"}),
                ],
                true,
                "<s>",
                "</s>",
                &Map::new(),
            )
            .unwrap();
        let msgs = [
            json!({"role": "developer", "content": "Be brief."}),
            json!({"role": "user", "content": "Hi"}),
        ];
        let out = t.render(&msgs, true, "<s>", "</s>", &Map::new()).unwrap();
        assert_eq!(out, as_system);
        let own = ChatTemplate::new(
            "{% for m in messages %}{{ m.role }};{% endfor %}{# developer #}".into(),
        )
        .unwrap();
        let out = own.render(&msgs, true, "", "", &Map::new()).unwrap();
        assert_eq!(out, "developer;user;");
    }

    #[test]
    fn raise_exception_becomes_an_error_message() {
        let t = ChatTemplate::new(LLAMA2.into()).unwrap();
        let msgs = vec![json!({"role": "assistant", "content": "x"})];
        let e = t
            .render(&msgs, true, "<s>", "</s>", &Map::new())
            .unwrap_err();
        assert!(e.contains("Conversation roles must alternate"), "{e}");
    }

    #[test]
    fn loop_controls_and_trim_blocks_work() {
        let src = "{% for m in messages %}\n{% if loop.index0 == 1 %}{% break %}{% endif %}{{ m.content | upper }}\n{% endfor %}{% if add_generation_prompt %}>{% endif %}";
        let t = ChatTemplate::new(src.into()).unwrap();
        let msgs = vec![
            json!({"role": "user", "content": "a"}),
            json!({"role": "user", "content": "b"}),
        ];
        assert_eq!(t.render(&msgs, true, "", "", &Map::new()).unwrap(), "A\n>");
    }

    #[test]
    fn strftime_formats_a_known_date() {
        // 2024-07-23 12:34:56 UTC was a Tuesday.
        assert_eq!(
            strftime(1_721_738_096, "%d %b %Y %A %H:%M:%S"),
            "23 Jul 2024 Tuesday 12:34:56"
        );
    }

    #[test]
    fn tools_are_defined_for_every_template_and_render_like_llama_3_1s() {
        // The constructs Llama 3.1's template uses for tools: `tools is not none`,
        // `tojson(indent=4)`, and a tool call's arguments as an object.
        let src = "{% if tools is not none %}{% for t in tools %}{{ t | tojson(indent=4) }}\n{% endfor %}{% endif %}{% for m in messages %}{% if m.tool_calls %}{{ '{\"name\": \"' + m.tool_calls[0].function.name + '\", \"parameters\": ' }}{{ m.tool_calls[0].function.arguments | tojson }}}{% elif m.role == 'tool' %}[{{ m.content }}]{% else %}{{ m.content }}{% endif %};{% endfor %}";
        let t = ChatTemplate::new(src.into()).unwrap();
        let msgs = [
            json!({"role": "user", "content": "Weather?"}),
            json!({"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "w", "arguments": {"city": "Paris"}}}]}),
            json!({"role": "tool", "content": "sunny"}),
        ];
        let none = t.render(&msgs, true, "", "", &Map::new()).unwrap();
        assert_eq!(
            none,
            "Weather?;{\"name\": \"w\", \"parameters\": {\"city\": \"Paris\"}};[sunny];"
        );
        let mut kw = Map::new();
        kw.insert(
            "tools".into(),
            json!([{"type": "function", "function": {"name": "w"}}]),
        );
        let with = t.render(&msgs, true, "", "", &kw).unwrap();
        assert_eq!(
            with,
            "{\n    \"type\": \"function\",\n    \"function\": {\n        \"name\": \"w\"\n    }\n}\n"
                .to_owned()
                + &none
        );
    }

    #[test]
    fn tojson_writes_what_pythons_json_dumps_writes() {
        let t = ChatTemplate::new(
            "{{ messages[0] | tojson }}|{{ messages[0] | tojson(indent=2) }}|{{ messages[0] | tojson(ensure_ascii=true, separators=[',', ':'], sort_keys=true) }}|{{ [] | tojson(indent=2) }}".into(),
        )
        .unwrap();
        let msgs =
            [json!({"z": "It's <b>&</b> caf\u{e9} \u{1f600}\n", "a": [1, 2.5, null, true, {}]})];
        let out = t.render(&msgs, false, "", "", &Map::new()).unwrap();
        let parts: Vec<&str> = out.split('|').collect();
        // What `json.dumps(x, ensure_ascii=False)` gives: no HTML escapes, unicode kept.
        assert_eq!(
            parts[0],
            "{\"z\": \"It's <b>&</b> caf\u{e9} \u{1f600}\\n\", \"a\": [1, 2.5, null, true, {}]}"
        );
        assert_eq!(
            parts[1],
            "{\n  \"z\": \"It's <b>&</b> caf\u{e9} \u{1f600}\\n\",\n  \"a\": [\n    1,\n    2.5,\n    null,\n    true,\n    {}\n  ]\n}"
        );
        assert_eq!(
            parts[2],
            "{\"a\":[1,2.5,null,true,{}],\"z\":\"It's <b>&</b> caf\\u00e9 \\ud83d\\ude00\\n\"}"
        );
        assert_eq!(parts[3], "[]");
    }

    // The chat template of Qwen/Qwen3-8B (tokenizer_config.json `chat_template`, its final
    // revision; Apache-2.0, Copyright Alibaba Cloud / the Qwen team), in
    // tests/fixtures/qwen3_chat_template.jinja.
    const QWEN3: &str = include_str!("../tests/fixtures/qwen3_chat_template.jinja");

    fn qwen3(msgs: &[serde_json::Value], kwargs: serde_json::Value) -> String {
        let t = ChatTemplate::new(QWEN3.into()).unwrap();
        let kw = kwargs.as_object().cloned().unwrap_or_default();
        t.render(msgs, true, "", "<|im_end|>", &kw).unwrap()
    }

    #[test]
    fn qwen3_template_renders_a_conversation_and_the_thinking_switch() {
        let msgs = [
            json!({"role": "system", "content": "Be brief."}),
            json!({"role": "user", "content": "Hi"}),
        ];
        let on = qwen3(&msgs, json!({}));
        assert_eq!(
            on,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(on, qwen3(&msgs, json!({"enable_thinking": true})));
        let off = qwen3(&msgs, json!({"enable_thinking": false}));
        assert_eq!(off, on.clone() + "<think>\n\n</think>\n\n");
    }

    #[test]
    fn qwen3_template_renders_reasoning_and_a_tool_call_round_trip() {
        let tools = json!([{"type": "function", "function": {"name": "get_weather",
            "description": "The city's weather.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
        let msgs = [
            json!({"role": "user", "content": "Weather in Paris?"}),
            json!({"role": "assistant", "content": "", "reasoning_content": "\nI should call the tool.\n",
                   "tool_calls": [{"id": "call_1", "type": "function",
                       "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}),
            json!({"role": "tool", "tool_call_id": "call_1", "content": "sunny"}),
        ];
        let out = qwen3(&msgs, json!({"tools": tools}));
        let expected = concat!(
            "<|im_start|>system\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n",
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n",
            "{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"The city's weather.\", ",
            "\"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}}}}}\n</tools>\n\n",
            "For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n",
            "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n",
            "<|im_start|>user\nWeather in Paris?<|im_end|>\n",
            "<|im_start|>assistant\n<think>\nI should call the tool.\n</think>\n\n",
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call><|im_end|>\n",
            "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n",
            "<|im_start|>assistant\n",
        );
        assert_eq!(out, expected);
        // Reasoning left in an earlier turn's content is split out of it by the template.
        let msgs = [
            json!({"role": "user", "content": "2+2?"}),
            json!({"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"}),
            json!({"role": "user", "content": "3+3?"}),
        ];
        let out = qwen3(&msgs, json!({}));
        assert_eq!(
            out,
            "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\n3+3?<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn syntax_errors_are_reported_at_load() {
        assert!(ChatTemplate::new("{% for %}".into()).is_err());
    }
}
