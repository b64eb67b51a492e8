//! Chat templates: Hugging Face-style Jinja templates rendered with minijinja.
//!
//! Contract: the environment matches transformers' (`trim_blocks`, `lstrip_blocks`, loop
//! controls, Python string/dict methods through `minijinja-contrib`'s pycompat, `tojson`), and
//! provides `raise_exception(msg)` and `strftime_now(fmt)`. The context holds `messages`,
//! `add_generation_prompt`, `bos_token`, `eos_token`, `tools` (the request's tools, or none)
//! and any `chat_template_kwargs`. A template
//! that raises or fails to render is the client's problem (a 400), never a panic.
//!
//! OpenAI's `developer` role (its name for system instructions in newer clients) reaches a
//! template that never mentions `developer` as `system`, so a Llama template puts the
//! instruction where the model was trained to see it instead of refusing or dropping it; a
//! template that handles `developer` itself gets it unchanged.

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
        ctx.insert("bos_token".into(), bos_token.into());
        ctx.insert("eos_token".into(), eos_token.into());
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
    fn syntax_errors_are_reported_at_load() {
        assert!(ChatTemplate::new("{% for %}".into()).is_err());
    }
}
