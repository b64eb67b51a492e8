//! Tool calling on `/v1/chat/completions`, as vLLM serves it with `--enable-auto-tool-choice
//! --tool-call-parser NAME`: the request's `tools` go to the chat template, and a parser turns
//! the model's text into `tool_calls`.
//!
//! Contract: a parser either finds tool calls in the whole output of a choice or leaves the
//! output as plain content, never half of each. Each call's `arguments` is the JSON the model
//! wrote, re-serialized as Python's `json.dumps(..., ensure_ascii=False)` writes it (what vLLM
//! returns: `", "` and `": "` separators, keys in the model's order, non-ASCII kept).
//!
//! Streaming is simpler than vLLM's argument fragments and gives the same accumulated message:
//! text streams as content until the output may be a tool call (for `llama3_json`, output that
//! starts with `{` or `<|python_tag|>`; for `hermes`, from `<tool_call>` on; for `mistral`,
//! from `[TOOL_CALLS]` on; for `qwen3_coder`, from `<tool_call>` or `<function=` on; for
//! `phi4_mini_json`, from `functools` on), then the rest is held; at the end the held text
//! becomes one `tool_calls` delta or, if it does not parse, is sent as content
//! ([`StreamFilter`]).

use crate::reasoning::partial_suffix;

/// A `--tool-call-parser` (vLLM's names).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolParser {
    /// `llama3_json`: `{"name": ..., "parameters" | "arguments": {...}}`, optionally after
    /// `<|python_tag|>`, several separated by `;`.
    Llama3Json,
    /// `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks.
    Hermes,
    /// `mistral` (vLLM's `MistralToolParser`): after the `[TOOL_CALLS]` token, a JSON list of
    /// `{"name": ..., "arguments": {...}}` objects (Mistral-7B-Instruct-v0.3 and other
    /// tokenizers before v11), or `NAME[ARGS]{...}` / `NAME{...}` after each `[TOOL_CALLS]`
    /// (v11 and later: Mistral-Small-3.2, Magistral, Devstral). Its tool call ids are 9
    /// letters and digits, the form Mistral's chat templates require of the ids sent back.
    Mistral,
    /// `pythonic` (vLLM's `PythonicToolParser`, for Llama 3.2 and Llama 4 with vLLM's
    /// pythonic templates): the whole output is a Python list of calls with keyword
    /// arguments, `[get_weather(city="Paris"), get_time()]`, whose values are Python literals
    /// (strings, numbers, `True`/`False`/`None`, lists, dicts), optionally inside Llama 4's
    /// `<|python_start|>` ... `<|python_end|>`.
    Pythonic,
    /// `qwen3_coder` (vLLM's `Qwen3CoderToolParser`, for Qwen3-Coder and Qwen3.5; vLLM's
    /// `qwen3_xml` reads the same form): XML-like blocks, `<tool_call>\n<function=NAME>\n
    /// <parameter=P>\nVALUE\n</parameter>\n...</function>\n</tool_call>`, whose values are raw
    /// text typed by the tool's `parameters` schema (see `qwen3_coder_value`).
    Qwen3Coder,
    /// `phi4_mini_json` (vLLM's `Phi4MiniJsonToolParser`, for Phi-4-mini-instruct): `functools`
    /// followed by a JSON list of `{"name", "arguments" | "parameters"}` objects.
    Phi4MiniJson,
}

/// The names `--tool-call-parser` accepts.
pub const TOOL_PARSER_NAMES: [&str; 6] = [
    "llama3_json",
    "hermes",
    "mistral",
    "pythonic",
    "qwen3_coder",
    "phi4_mini_json",
];

impl std::str::FromStr for ToolParser {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            // vLLM's `llama4_json` and `llama4_pythonic` read Llama 4's forms, which these
            // parsers read too.
            "llama3_json" | "llama4_json" => Ok(Self::Llama3Json),
            "hermes" => Ok(Self::Hermes),
            "mistral" => Ok(Self::Mistral),
            "pythonic" | "llama4_pythonic" => Ok(Self::Pythonic),
            "qwen3_coder" | "qwen3_xml" => Ok(Self::Qwen3Coder),
            "phi4_mini_json" => Ok(Self::Phi4MiniJson),
            _ => Err(format!(
                "unknown tool call parser {s:?}; this server has: {}",
                TOOL_PARSER_NAMES.join(", ")
            )),
        }
    }
}

impl ToolParser {
    /// The parser's flag name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Llama3Json => "llama3_json",
            Self::Hermes => "hermes",
            Self::Mistral => "mistral",
            Self::Pythonic => "pythonic",
            Self::Qwen3Coder => "qwen3_coder",
            Self::Phi4MiniJson => "phi4_mini_json",
        }
    }

    /// Whether the parser's tag is a special token in the models that use it, so the output it
    /// parses must be detokenized with `skip_special_tokens` off (as vLLM's `hermes` and
    /// `mistral` parsers' `adjust_request` do).
    pub fn keeps_special_tokens(self) -> bool {
        matches!(self, Self::Hermes | Self::Mistral | Self::Qwen3Coder)
    }

    /// A new tool call id of this parser's form: `chatcmpl-tool-` and 32 hex digits, or for
    /// `mistral` 9 letters and digits (vLLM's `MistralToolCall.generate_random_id`; Mistral's
    /// chat templates refuse other ids in the conversation sent back). `random` gives random
    /// 64-bit values.
    pub fn call_id(self, mut random: impl FnMut() -> u64) -> String {
        match self {
            Self::Mistral => {
                const ALNUM: &[u8] =
                    b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
                // 62^9 (1.4e16) of 2^64 values: the modulo bias is below 1e-3.
                let mut x = random();
                (0..9)
                    .map(|_| {
                        let c = ALNUM[(x % 62) as usize] as char;
                        x /= 62;
                        c
                    })
                    .collect()
            }
            Self::Llama3Json
            | Self::Hermes
            | Self::Pythonic
            | Self::Qwen3Coder
            | Self::Phi4MiniJson => {
                format!("chatcmpl-tool-{:016x}{:016x}", random(), random())
            }
        }
    }
}

const PYTHON_TAG: &str = "<|python_tag|>";
const HERMES_START: &str = "<tool_call>";
const HERMES_END: &str = "</tool_call>";
const MISTRAL_TOOL_CALLS: &str = "[TOOL_CALLS]";
const MISTRAL_ARGS: &str = "[ARGS]";
const PYTHON_START: &str = "<|python_start|>";
const PHI4_FUNCTOOLS: &str = "functools";
const QWEN_FUNCTION: &str = "<function=";
const QWEN_FUNCTION_END: &str = "</function>";
const QWEN_PARAMETER: &str = "<parameter=";
const QWEN_PARAMETER_END: &str = "</parameter>";
const PYTHON_END: &str = "<|python_end|>";

/// One parsed tool call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolCall {
    /// The function's name.
    pub name: String,
    /// Its arguments, a JSON text.
    pub arguments: String,
}

/// A choice's output split into content and tool calls.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Parsed {
    /// The text that is not a tool call (`None` when empty).
    pub content: Option<String>,
    /// The calls, in order; empty when the output is plain content.
    pub calls: Vec<ToolCall>,
}

impl Parsed {
    fn plain(text: &str) -> Self {
        Self {
            content: Some(text.to_owned()),
            calls: Vec::new(),
        }
    }
}

impl ToolParser {
    /// Splits a whole output into content and tool calls; output that is not tool calls is all
    /// content. [`ToolParser::parse_with`] without the request's tools.
    pub fn parse(self, text: &str) -> Parsed {
        self.parse_with(text, &[])
    }

    /// Splits a whole output into content and tool calls, given the request's `tools` (the chat
    /// form: `qwen3_coder` types its raw values by their parameters' schemas); output that is
    /// not tool calls is all content.
    pub fn parse_with(self, text: &str, tools: &[serde_json::Value]) -> Parsed {
        let calls = match self {
            Self::Llama3Json => llama3_calls(text).map(|c| (None, c)),
            Self::Hermes => hermes_calls(text),
            Self::Mistral => mistral_calls(text),
            Self::Pythonic => pythonic_calls(text).map(|c| (None, c)),
            Self::Qwen3Coder => qwen3_coder_calls(text, tools),
            Self::Phi4MiniJson => phi4_mini_calls(text),
        };
        match calls {
            Some((content, calls)) if !calls.is_empty() => Parsed {
                content: content.filter(|c: &String| !c.is_empty()),
                calls,
            },
            _ => Parsed::plain(text),
        }
    }
}

/// The call of one parsed object: a string `name` and `arguments` (or, for `llama3_json`,
/// `parameters`).
fn call_of(v: &J, allow_parameters: bool) -> Option<ToolCall> {
    let J::Obj(fields) = v else { return None };
    let get = |k: &str| fields.iter().find(|(n, _)| n == k).map(|(_, v)| v);
    let Some(J::Str(name)) = get("name") else {
        return None;
    };
    let args = get("arguments").or_else(|| get("parameters").filter(|_| allow_parameters))?;
    let mut arguments = String::new();
    args.dump(&mut arguments);
    Some(ToolCall {
        name: name.clone(),
        arguments,
    })
}

fn llama3_calls(text: &str) -> Option<Vec<ToolCall>> {
    let t = text.trim_start();
    let t = t.strip_prefix(PYTHON_TAG).unwrap_or(t);
    let mut p = JsonParser {
        s: t.as_bytes(),
        i: 0,
    };
    let mut calls = Vec::new();
    loop {
        p.ws();
        if p.i == p.s.len() {
            break;
        }
        if p.s[p.i] != b'{' {
            return None;
        }
        calls.push(call_of(&p.value(0)?, true)?);
        p.ws();
        match p.s.get(p.i) {
            None => break,
            Some(b';') => p.i += 1,
            Some(_) => return None,
        }
    }
    Some(calls)
}

/// `(content before the first block, calls)`; a last block without `</tool_call>` counts (as in
/// vLLM), text after the last block is dropped.
fn hermes_calls(text: &str) -> Option<(Option<String>, Vec<ToolCall>)> {
    let first = text.find(HERMES_START)?;
    let mut rest = &text[first..];
    let mut calls = Vec::new();
    while let Some(start) = rest.find(HERMES_START) {
        let body = &rest[start + HERMES_START.len()..];
        let (inner, after) = match body.find(HERMES_END) {
            Some(e) => (&body[..e], &body[e + HERMES_END.len()..]),
            None => (body, ""),
        };
        let mut p = JsonParser {
            s: inner.as_bytes(),
            i: 0,
        };
        p.ws();
        let v = p.value(0)?;
        p.ws();
        if p.i != p.s.len() {
            return None;
        }
        calls.push(call_of(&v, false)?);
        rest = after;
    }
    Some((Some(text[..first].to_owned()), calls))
}

/// `(content before functools, calls)` of a `phi4_mini_json` output: after the first
/// `functools`, a JSON list of `{"name", "arguments" | "parameters"}` objects (text after the
/// list is dropped, as vLLM's pattern ignores it). The list is read as JSON, so arguments
/// holding lists are whole (vLLM's `functools\[(.*?)\]` pattern cuts them at the first `]`).
fn phi4_mini_calls(text: &str) -> Option<(Option<String>, Vec<ToolCall>)> {
    let first = text.find(PHI4_FUNCTOOLS)?;
    let mut p = JsonParser {
        s: &text.as_bytes()[first + PHI4_FUNCTOOLS.len()..],
        i: 0,
    };
    p.ws();
    let J::Arr(items) = p.value(0)? else {
        return None;
    };
    let calls = items
        .iter()
        .map(|v| call_of(v, true))
        .collect::<Option<Vec<_>>>()?;
    Some((Some(text[..first].to_owned()), calls))
}

/// Where a `qwen3_coder` output's calls start: the first `<tool_call>`, or a `<function=`
/// written without one (vLLM reads both).
fn qwen3_coder_start(text: &str) -> Option<usize> {
    match (text.find(HERMES_START), text.find(QWEN_FUNCTION)) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// `(content before the first call, calls)` of a `qwen3_coder` output: each `<function=NAME>`
/// block (inside `<tool_call>` ... `</tool_call>`, whose tags may be missing at the end of
/// the output) with its `<parameter=P>` values; a value ends at its `</parameter>`, else at
/// the next `<parameter=`, `</function>` or the end (vLLM's malformation rules), and loses
/// one leading and one trailing newline. `None` when there is no `<function=` block.
fn qwen3_coder_calls(
    text: &str,
    tools: &[serde_json::Value],
) -> Option<(Option<String>, Vec<ToolCall>)> {
    let first = qwen3_coder_start(text)?;
    let mut calls = Vec::new();
    let mut rest = &text[first..];
    while let Some(f) = rest.find(QWEN_FUNCTION) {
        let after = &rest[f + QWEN_FUNCTION.len()..];
        let (name, body) = after.split_once('>')?;
        let name = name.trim();
        if name.is_empty() || name.contains('<') {
            return None;
        }
        let (body, next) = match body.find(QWEN_FUNCTION_END) {
            Some(e) => (&body[..e], &body[e + QWEN_FUNCTION_END.len()..]),
            None => (body, ""),
        };
        let props = tool_properties(tools, name);
        let mut args: Vec<(String, J)> = Vec::new();
        let mut b = body;
        while let Some(p) = b.find(QWEN_PARAMETER) {
            let after = &b[p + QWEN_PARAMETER.len()..];
            let (pname, value) = after.split_once('>')?;
            let end = [
                value.find(QWEN_PARAMETER_END),
                value.find(QWEN_PARAMETER),
                value.find(QWEN_FUNCTION_END),
            ]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(value.len());
            let raw = &value[..end];
            let raw = raw.strip_prefix('\n').unwrap_or(raw);
            let raw = raw.strip_suffix('\n').unwrap_or(raw);
            let v = qwen3_coder_value(raw, props.and_then(|p| p.get(pname.trim())));
            let pname = pname.trim().to_owned();
            // A parameter given twice keeps its last value (a Python dict's assignment).
            match args.iter_mut().find(|(k, _)| *k == pname) {
                Some(slot) => slot.1 = v,
                None => args.push((pname, v)),
            }
            let consumed = if value[end..].starts_with(QWEN_PARAMETER_END) {
                end + QWEN_PARAMETER_END.len()
            } else {
                end
            };
            b = &value[consumed..];
        }
        let mut arguments = String::new();
        J::Obj(args).dump(&mut arguments);
        calls.push(ToolCall {
            name: name.to_owned(),
            arguments,
        });
        rest = next;
    }
    if calls.is_empty() {
        return None;
    }
    Some((Some(text[..first].to_owned()), calls))
}

/// The `properties` of the `parameters` schema of the tool named `name` in `tools` (the chat
/// form), if any.
fn tool_properties<'a>(
    tools: &'a [serde_json::Value],
    name: &str,
) -> Option<&'a serde_json::Map<String, serde_json::Value>> {
    tools
        .iter()
        .find(|t| t["function"]["name"].as_str() == Some(name))?
        .get("function")?
        .get("parameters")?
        .get("properties")?
        .as_object()
}

/// A `qwen3_coder` parameter's raw text as a value of the type its schema gives (vLLM's
/// `_convert_param_value`): the schema's `type` (or an `anyOf`'s first non-null type; `null`
/// there, or a `null` type, lets `null`/`None` be null). A parameter the tool does not
/// declare, and `string`-like types, stay strings; otherwise `null`/`None` (any case) is null,
/// `int*` types an integer, `number`/`float*` a number (an integral value written as an
/// integer, as vLLM's `int(float(x))`), `boolean` true for `true` in any case and false for
/// anything else, and `object`/`array` and other types a JSON value, else a Python literal
/// (`ast.literal_eval`), else the string. A value that does not read as its type stays a
/// string.
fn qwen3_coder_value(raw: &str, schema: Option<&serde_json::Value>) -> J {
    let text = || J::Str(raw.to_owned());
    let Some(schema) = schema else {
        return text();
    };
    let type_name = |v: &serde_json::Value| match v {
        serde_json::Value::String(t) => Some(t.trim().to_ascii_lowercase()),
        serde_json::Value::Array(ts) => ts
            .iter()
            .filter_map(|t| t.as_str())
            .map(|t| t.trim().to_ascii_lowercase())
            .find(|t| t != "null"),
        _ => None,
    };
    let mut allows_null = false;
    let ty = if let Some(t) = schema.get("type") {
        allows_null = t
            .as_str()
            .is_some_and(|t| t.trim().eq_ignore_ascii_case("null"))
            || t.as_array()
                .is_some_and(|ts| ts.iter().any(|t| t.as_str() == Some("null")));
        type_name(t).unwrap_or_else(|| "string".into())
    } else if let Some(options) = schema.get("anyOf").and_then(|a| a.as_array()) {
        let mut picked = None;
        for o in options {
            match o.get("type").and_then(type_name) {
                _ if o.get("type").and_then(|t| t.as_str()) == Some("null") => allows_null = true,
                Some(t) if picked.is_none() => picked = Some(t),
                _ => {}
            }
        }
        picked.unwrap_or_else(|| "string".into())
    } else {
        "string".into()
    };
    let is_null = raw.eq_ignore_ascii_case("null") || raw.eq_ignore_ascii_case("none");
    if allows_null && is_null {
        return J::Null;
    }
    if ["string", "str", "text", "varchar", "char", "enum"].contains(&ty.as_str()) {
        return text();
    }
    if is_null {
        return J::Null;
    }
    let ints = ["int", "uint", "long", "short", "unsigned"];
    if ints.iter().any(|p| ty.starts_with(p)) {
        return raw
            .trim()
            .parse::<i64>()
            .map_or_else(|_| text(), |n| J::Num(n.to_string()));
    }
    if ty.starts_with("num") || ty.starts_with("float") {
        return match raw.trim().parse::<f64>() {
            Ok(x) if x.is_finite() && x.fract() == 0.0 && x.abs() < 9.0e15 => {
                J::Num(format!("{}", x as i64))
            }
            Ok(x) if x.is_finite() => J::Num(py_float_repr(x)),
            _ => text(),
        };
    }
    if ["boolean", "bool", "binary"].contains(&ty.as_str()) {
        return J::Bool(raw.eq_ignore_ascii_case("true"));
    }
    let mut json = JsonParser {
        s: raw.as_bytes(),
        i: 0,
    };
    json.ws();
    if let Some(v) = json.value(0) {
        json.ws();
        if json.i == json.s.len() {
            return v;
        }
    }
    let mut py = PyParser {
        s: raw.as_bytes(),
        i: 0,
    };
    py.ws();
    if let Some(v) = py.value(0) {
        py.ws();
        if py.i == py.s.len() {
            return v;
        }
    }
    text()
}

/// `(content before the first [TOOL_CALLS], calls)`: after each `[TOOL_CALLS]`, a JSON list of
/// `{"name", "arguments"}` objects, or a function name (optionally followed by `[ARGS]`) and
/// its arguments object (see [`ToolParser::Mistral`]). Anything else there makes the whole
/// output content.
fn mistral_calls(text: &str) -> Option<(Option<String>, Vec<ToolCall>)> {
    let first = text.find(MISTRAL_TOOL_CALLS)?;
    let mut calls = Vec::new();
    for seg in text[first..].split(MISTRAL_TOOL_CALLS).skip(1) {
        let seg = seg.trim();
        if seg.is_empty() {
            continue;
        }
        if seg.starts_with('[') {
            // Text after the list is dropped, as vLLM's fallback pattern (`\[{.*}\]`) finds
            // the list within it.
            let mut p = JsonParser {
                s: seg.as_bytes(),
                i: 0,
            };
            let J::Arr(items) = p.value(0)? else {
                return None;
            };
            for item in &items {
                calls.push(call_of(item, false)?);
            }
        } else {
            let brace = seg.find('{')?;
            let name = seg[..brace].trim();
            let name = name.strip_suffix(MISTRAL_ARGS).unwrap_or(name).trim();
            let valid = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.');
            if name.is_empty() || !name.chars().all(valid) {
                return None;
            }
            let mut p = JsonParser {
                s: &seg.as_bytes()[brace..],
                i: 0,
            };
            let args = p.value(0)?;
            p.ws();
            if p.i != p.s.len() {
                return None;
            }
            let mut arguments = String::new();
            args.dump(&mut arguments);
            calls.push(ToolCall {
                name: name.to_owned(),
                arguments,
            });
        }
    }
    Some((Some(text[..first].to_owned()), calls))
}

/// The calls of a `pythonic` output: the whole text (less Llama 4's `<|python_start|>` and
/// `<|python_end|>`) is a Python list of `name(key=value, ...)` calls whose values are
/// literals, each turned into JSON as vLLM's `_get_parameter_value` and `json.dumps` do.
fn pythonic_calls(text: &str) -> Option<Vec<ToolCall>> {
    let t = text.trim();
    let t = t.strip_prefix(PYTHON_START).unwrap_or(t);
    let t = t.strip_suffix(PYTHON_END).unwrap_or(t).trim();
    let mut p = PyParser {
        s: t.as_bytes(),
        i: 0,
    };
    if !p.eat(b'[') {
        return None;
    }
    let mut calls = Vec::new();
    p.ws();
    if p.eat(b']') {
        return None;
    }
    loop {
        let name = p.ident()?;
        p.ws();
        if !p.eat(b'(') {
            return None;
        }
        let mut args = Vec::new();
        p.ws();
        if !p.eat(b')') {
            loop {
                let key = p.ident()?;
                p.ws();
                if !p.eat(b'=') {
                    return None;
                }
                let v = p.value(0)?;
                args.push((key, v));
                p.ws();
                if p.eat(b')') {
                    break;
                }
                if !p.eat(b',') {
                    return None;
                }
                p.ws();
                // A trailing comma before `)`.
                if p.eat(b')') {
                    break;
                }
            }
        }
        // A keyword given twice is a SyntaxError in Python: not a call.
        if args
            .iter()
            .enumerate()
            .any(|(i, (k, _))| args[..i].iter().any(|(j, _)| j == k))
        {
            return None;
        }
        let mut arguments = String::new();
        J::Obj(args).dump(&mut arguments);
        calls.push(ToolCall { name, arguments });
        p.ws();
        if p.eat(b']') {
            break;
        }
        if !p.eat(b',') {
            return None;
        }
        p.ws();
        if p.eat(b']') {
            break;
        }
    }
    p.ws();
    (p.i == p.s.len()).then_some(calls)
}

/// A parser of the Python literals a `pythonic` call passes (what `ast.literal_eval` reads of
/// them): strings with their escapes, numbers (a leading `-` too), `True`, `False`, `None`,
/// lists and dicts of literals, as [`J`] values.
struct PyParser<'a> {
    s: &'a [u8],
    i: usize,
}

impl PyParser<'_> {
    fn ws(&mut self) {
        while self.s.get(self.i).is_some_and(u8::is_ascii_whitespace) {
            self.i += 1;
        }
    }

    fn eat(&mut self, b: u8) -> bool {
        let hit = self.s.get(self.i) == Some(&b);
        self.i += usize::from(hit);
        hit
    }

    /// A Python identifier of ASCII letters, digits and `_`, not starting with a digit.
    fn ident(&mut self) -> Option<String> {
        self.ws();
        let start = self.i;
        while self
            .s
            .get(self.i)
            .is_some_and(|b| b.is_ascii_alphanumeric() || *b == b'_')
        {
            self.i += 1;
        }
        let id = std::str::from_utf8(&self.s[start..self.i]).ok()?;
        (!id.is_empty() && !id.as_bytes()[0].is_ascii_digit()).then(|| id.to_owned())
    }

    fn value(&mut self, depth: usize) -> Option<J> {
        if depth > MAX_DEPTH {
            return None;
        }
        self.ws();
        match *self.s.get(self.i)? {
            q @ (b'"' | b'\'') => self.string(q).map(J::Str),
            b'[' => {
                self.i += 1;
                let mut items = Vec::new();
                loop {
                    self.ws();
                    if self.eat(b']') {
                        return Some(J::Arr(items));
                    }
                    items.push(self.value(depth + 1)?);
                    self.ws();
                    if !self.eat(b',') {
                        self.ws();
                        return self.eat(b']').then_some(J::Arr(items));
                    }
                }
            }
            b'{' => {
                self.i += 1;
                let mut fields = Vec::new();
                loop {
                    self.ws();
                    if self.eat(b'}') {
                        return Some(J::Obj(fields));
                    }
                    let q = *self.s.get(self.i)?;
                    if q != b'"' && q != b'\'' {
                        return None;
                    }
                    let k = self.string(q)?;
                    self.ws();
                    if !self.eat(b':') {
                        return None;
                    }
                    fields.push((k, self.value(depth + 1)?));
                    self.ws();
                    if !self.eat(b',') {
                        self.ws();
                        return self.eat(b'}').then_some(J::Obj(fields));
                    }
                }
            }
            _ => {
                let start = self.i;
                while self.s.get(self.i).is_some_and(|b| {
                    b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'+' | b'_')
                }) {
                    self.i += 1;
                }
                let word = std::str::from_utf8(&self.s[start..self.i]).ok()?;
                match word {
                    "True" => Some(J::Bool(true)),
                    "False" => Some(J::Bool(false)),
                    "None" => Some(J::Null),
                    _ => {
                        // A Python number (`1_000` too) as JSON writes it; NaN and infinities
                        // are no JSON.
                        let digits = word.replace('_', "");
                        let x: f64 = digits.parse().ok()?;
                        if !x.is_finite() || digits.starts_with('+') {
                            return None;
                        }
                        let int = digits.trim_start_matches('-');
                        if !int.is_empty() && int.bytes().all(|b| b.is_ascii_digit()) {
                            let n: i128 = digits.parse().ok()?;
                            Some(J::Num(n.to_string()))
                        } else {
                            Some(J::Num(py_float_repr(x)))
                        }
                    }
                }
            }
        }
    }

    /// A string in quotes `q`, with Python's escapes.
    fn string(&mut self, q: u8) -> Option<String> {
        self.i += 1;
        let mut out = Vec::new();
        loop {
            let b = *self.s.get(self.i)?;
            self.i += 1;
            if b == q {
                return String::from_utf8(out).ok();
            }
            if b == b'\n' {
                return None;
            }
            if b != b'\\' {
                out.push(b);
                continue;
            }
            let e = *self.s.get(self.i)?;
            self.i += 1;
            let c = match e {
                b'n' => '\n',
                b't' => '\t',
                b'r' => '\r',
                b'0' => '\0',
                b'\\' | b'\'' | b'"' => e as char,
                b'x' | b'u' | b'U' => {
                    let len = match e {
                        b'x' => 2,
                        b'u' => 4,
                        _ => 8,
                    };
                    let hex = std::str::from_utf8(self.s.get(self.i..self.i + len)?).ok()?;
                    self.i += len;
                    char::from_u32(u32::from_str_radix(hex, 16).ok()?)?
                }
                _ => return None,
            };
            let mut buf = [0u8; 4];
            out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
        }
    }
}

/// `repr` of a finite Python float: Rust's shortest round-trip digits (`{:?}`, which switches
/// to exponent notation where Python does), with Python's exponent form (`1e-05`, `1e+16`).
fn py_float_repr(x: f64) -> String {
    let r = format!("{x:?}");
    match r.split_once('e') {
        Some((m, e)) => {
            let (sign, digits) = match e.strip_prefix('-') {
                Some(d) => ('-', d),
                None => ('+', e),
            };
            format!("{m}e{sign}{digits:0>2}")
        }
        None => r,
    }
}

/// How a chat choice's output becomes tool calls.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CallMode {
    /// `tool_choice: "auto"`: the `--tool-call-parser` decides.
    Parser(ToolParser),
    /// `tool_choice` names this function: the whole output (guided by its parameters' schema)
    /// is its arguments.
    Named(String),
    /// `tool_choice: "required"`: the output (guided) is a JSON list of
    /// `{"name", "parameters"}` objects.
    Required,
}

impl CallMode {
    /// The `finish_reason` of a choice whose output `parse` gave `calls`, given the sequence's
    /// own finish, as OpenAI and vLLM give it: `tool_calls` when the parser found calls;
    /// for `required`, `tool_calls` when the output ended normally (`stop`), else the real
    /// reason (a call cut short by `max_tokens` says `length`); for a named function always
    /// the real reason (`stop`: OpenAI's forced named calls finish with `stop`).
    pub fn finish<'a>(&self, has_calls: bool, finish: Option<&'a str>) -> Option<&'a str> {
        match (has_calls, self) {
            (false, _) | (true, Self::Named(_)) => finish,
            (true, Self::Parser(_)) => Some("tool_calls"),
            (true, Self::Required) if finish == Some("stop") => Some("tool_calls"),
            (true, Self::Required) => finish,
        }
    }

    /// Splits a whole output into content and tool calls. A guided output cut short by
    /// `max_tokens` that does not parse: the named function gets it as its arguments anyway (as
    /// vLLM), a `required` list becomes content.
    pub fn parse(&self, text: &str) -> Parsed {
        self.parse_with(text, &[])
    }

    /// [`CallMode::parse`] given the request's `tools` (chat form; see
    /// [`ToolParser::parse_with`]).
    pub fn parse_with(&self, text: &str, tools: &[serde_json::Value]) -> Parsed {
        match self {
            Self::Parser(p) => p.parse_with(text, tools),
            Self::Named(name) => {
                let mut p = JsonParser {
                    s: text.as_bytes(),
                    i: 0,
                };
                p.ws();
                let arguments = match p.value(0) {
                    Some(v)
                        if {
                            p.ws();
                            p.i == p.s.len()
                        } =>
                    {
                        let mut s = String::new();
                        v.dump(&mut s);
                        s
                    }
                    _ => text.to_owned(),
                };
                Parsed {
                    content: None,
                    calls: vec![ToolCall {
                        name: name.clone(),
                        arguments,
                    }],
                }
            }
            Self::Required => required_calls(text).filter(|c| !c.is_empty()).map_or_else(
                || Parsed::plain(text),
                |calls| Parsed {
                    content: None,
                    calls,
                },
            ),
        }
    }
}

/// The calls of a `required` output: a JSON list of `{"name", "parameters"}` objects.
fn required_calls(text: &str) -> Option<Vec<ToolCall>> {
    let mut p = JsonParser {
        s: text.as_bytes(),
        i: 0,
    };
    p.ws();
    let J::Arr(items) = p.value(0)? else {
        return None;
    };
    p.ws();
    if p.i != p.s.len() {
        return None;
    }
    items.iter().map(|v| call_of(v, true)).collect()
}

/// Per-choice streaming state: what text may be sent now, and at the end, the rest and the
/// tool calls.
#[derive(Debug)]
pub struct StreamFilter {
    mode: CallMode,
    /// The whole output so far.
    all: String,
    /// Bytes of `all` already released as content.
    sent: usize,
    /// The output may be a tool call: everything from `sent` on is held to the end.
    holding: bool,
    /// `llama3_json` decided the output is plain text.
    plain: bool,
    /// The request's tools (chat form), for parsers that type values by them.
    tools: Vec<serde_json::Value>,
}

impl StreamFilter {
    /// A filter for one choice. A guided mode (`Named`, `Required`) holds the whole output.
    pub fn new(mode: CallMode) -> Self {
        Self::with_tools(mode, Vec::new())
    }

    /// [`StreamFilter::new`] given the request's `tools` (chat form; see
    /// [`ToolParser::parse_with`]).
    pub fn with_tools(mode: CallMode, tools: Vec<serde_json::Value>) -> Self {
        let holding = !matches!(mode, CallMode::Parser(_));
        Self {
            mode,
            all: String::new(),
            sent: 0,
            holding,
            plain: false,
            tools,
        }
    }

    /// How this choice's output becomes calls.
    pub fn mode(&self) -> &CallMode {
        &self.mode
    }

    /// Adds `text`; returns the content that can be sent now.
    pub fn push(&mut self, text: &str) -> String {
        self.all.push_str(text);
        if self.holding {
            return String::new();
        }
        let CallMode::Parser(parser) = &self.mode else {
            return String::new();
        };
        let upto = match parser {
            ToolParser::Llama3Json | ToolParser::Pythonic if self.plain => self.all.len(),
            ToolParser::Llama3Json | ToolParser::Pythonic => {
                let (open, tag) = if *parser == ToolParser::Pythonic {
                    ('[', PYTHON_START)
                } else {
                    ('{', PYTHON_TAG)
                };
                let t = self.all.trim_start();
                if t.starts_with(open) || t.starts_with(tag) {
                    self.holding = true;
                    return String::new();
                }
                if t.is_empty() || tag.starts_with(t) {
                    return String::new();
                }
                self.plain = true;
                self.all.len()
            }
            ToolParser::Hermes | ToolParser::Mistral | ToolParser::Phi4MiniJson => {
                let tag = match parser {
                    ToolParser::Hermes => HERMES_START,
                    ToolParser::Mistral => MISTRAL_TOOL_CALLS,
                    _ => PHI4_FUNCTOOLS,
                };
                match self.all[self.sent..].find(tag) {
                    Some(p) => {
                        self.holding = true;
                        self.sent + p
                    }
                    None => self.all.len() - partial_suffix(&self.all[self.sent..], tag),
                }
            }
            ToolParser::Qwen3Coder => {
                let unsent = &self.all[self.sent..];
                match qwen3_coder_start(unsent) {
                    Some(p) => {
                        self.holding = true;
                        self.sent + p
                    }
                    None => {
                        let held = partial_suffix(unsent, HERMES_START)
                            .max(partial_suffix(unsent, QWEN_FUNCTION));
                        self.all.len() - held
                    }
                }
            }
        };
        let out = self.all[self.sent..upto].to_owned();
        self.sent = upto;
        out
    }

    /// Ends the choice: the content not sent yet, and the tool calls (empty when the output was
    /// plain text, which is then all content).
    pub fn finish(&mut self) -> (String, Vec<ToolCall>) {
        let parsed = if self.holding {
            self.mode.parse_with(&self.all, &self.tools)
        } else {
            Parsed::plain(&self.all)
        };
        let rest = if parsed.calls.is_empty() {
            self.all[self.sent..].to_owned()
        } else {
            // The content of a tool-call output is what came before the held part, already sent.
            String::new()
        };
        self.sent = self.all.len();
        (rest, parsed.calls)
    }
}

/// A JSON value with object keys in their order and numbers as written.
#[derive(Clone, Debug, PartialEq)]
enum J {
    Null,
    Bool(bool),
    Num(String),
    Str(String),
    Arr(Vec<J>),
    Obj(Vec<(String, J)>),
}

impl J {
    /// Writes the value as Python's `json.dumps(v, ensure_ascii=False)` does.
    fn dump(&self, out: &mut String) {
        match self {
            J::Null => out.push_str("null"),
            J::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            J::Num(n) => out.push_str(n),
            J::Str(s) => dump_str(s, out),
            J::Arr(items) => {
                out.push('[');
                for (i, v) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    v.dump(out);
                }
                out.push(']');
            }
            J::Obj(fields) => {
                out.push('{');
                for (i, (k, v)) in fields.iter().enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    dump_str(k, out);
                    out.push_str(": ");
                    v.dump(out);
                }
                out.push('}');
            }
        }
    }
}

/// Python's `json.dumps(s, ensure_ascii=False)`.
fn dump_str(s: &str, out: &mut String) {
    crate::chat::py_json_string(s, false, out);
}

/// Deepest nesting accepted, so a hostile output cannot exhaust the stack.
const MAX_DEPTH: usize = 128;

/// A strict JSON parser over bytes (the input is UTF-8 text).
struct JsonParser<'a> {
    s: &'a [u8],
    i: usize,
}

impl JsonParser<'_> {
    fn ws(&mut self) {
        while self
            .s
            .get(self.i)
            .is_some_and(|b| matches!(b, b' ' | b'\t' | b'\n' | b'\r'))
        {
            self.i += 1;
        }
    }

    fn eat(&mut self, lit: &str) -> bool {
        if self.s[self.i..].starts_with(lit.as_bytes()) {
            self.i += lit.len();
            true
        } else {
            false
        }
    }

    fn value(&mut self, depth: usize) -> Option<J> {
        if depth > MAX_DEPTH {
            return None;
        }
        self.ws();
        match *self.s.get(self.i)? {
            b'{' => {
                self.i += 1;
                let mut fields = Vec::new();
                self.ws();
                if self.eat("}") {
                    return Some(J::Obj(fields));
                }
                loop {
                    self.ws();
                    let k = self.string()?;
                    self.ws();
                    if !self.eat(":") {
                        return None;
                    }
                    let v = self.value(depth + 1)?;
                    fields.push((k, v));
                    self.ws();
                    if self.eat("}") {
                        return Some(J::Obj(fields));
                    }
                    if !self.eat(",") {
                        return None;
                    }
                }
            }
            b'[' => {
                self.i += 1;
                let mut items = Vec::new();
                self.ws();
                if self.eat("]") {
                    return Some(J::Arr(items));
                }
                loop {
                    items.push(self.value(depth + 1)?);
                    self.ws();
                    if self.eat("]") {
                        return Some(J::Arr(items));
                    }
                    if !self.eat(",") {
                        return None;
                    }
                }
            }
            b'"' => self.string().map(J::Str),
            b't' if self.eat("true") => Some(J::Bool(true)),
            b'f' if self.eat("false") => Some(J::Bool(false)),
            b'n' if self.eat("null") => Some(J::Null),
            b'-' | b'0'..=b'9' => self.number(),
            _ => None,
        }
    }

    fn number(&mut self) -> Option<J> {
        let start = self.i;
        let digits = |p: &mut Self| {
            let s = p.i;
            while p.s.get(p.i).is_some_and(u8::is_ascii_digit) {
                p.i += 1;
            }
            p.i > s
        };
        self.eat("-");
        if !self.eat("0") && !digits(self) {
            return None;
        }
        if self.eat(".") && !digits(self) {
            return None;
        }
        if matches!(self.s.get(self.i), Some(b'e' | b'E')) {
            self.i += 1;
            if matches!(self.s.get(self.i), Some(b'+' | b'-')) {
                self.i += 1;
            }
            if !digits(self) {
                return None;
            }
        }
        let n = std::str::from_utf8(&self.s[start..self.i]).ok()?;
        Some(J::Num(n.to_owned()))
    }

    fn hex4(&mut self) -> Option<u32> {
        let h = self.s.get(self.i..self.i + 4)?;
        let v = u32::from_str_radix(std::str::from_utf8(h).ok()?, 16).ok()?;
        self.i += 4;
        Some(v)
    }

    fn string(&mut self) -> Option<String> {
        if !self.eat("\"") {
            return None;
        }
        let mut out = Vec::new();
        loop {
            let b = *self.s.get(self.i)?;
            self.i += 1;
            match b {
                b'"' => return String::from_utf8(out).ok(),
                b'\\' => {
                    let e = *self.s.get(self.i)?;
                    self.i += 1;
                    let c = match e {
                        b'"' => '"',
                        b'\\' => '\\',
                        b'/' => '/',
                        b'b' => '\u{8}',
                        b'f' => '\u{c}',
                        b'n' => '\n',
                        b'r' => '\r',
                        b't' => '\t',
                        b'u' => {
                            let hi = self.hex4()?;
                            let cp = if (0xD800..0xDC00).contains(&hi) {
                                if !self.eat("\\u") {
                                    return None;
                                }
                                let lo = self.hex4()?;
                                if !(0xDC00..0xE000).contains(&lo) {
                                    return None;
                                }
                                0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00)
                            } else {
                                hi
                            };
                            char::from_u32(cp)?
                        }
                        _ => return None,
                    };
                    let mut buf = [0; 4];
                    out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                }
                b if b < 0x20 => return None,
                b => out.push(b),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guided_modes_turn_whole_outputs_into_calls() {
        let named = CallMode::Named("f".into());
        let p = named.parse("{\"a\":1,\"b\":[true]}");
        assert_eq!(p.content, None);
        assert_eq!(p.calls, vec![call("f", "{\"a\": 1, \"b\": [true]}")]);
        // Cut short: the text is the arguments anyway.
        assert_eq!(named.parse("{\"a\":").calls, vec![call("f", "{\"a\":")]);
        let req = CallMode::Required;
        let p = req.parse("[{\"name\": \"g\", \"parameters\": {\"x\": 2}}, {\"name\": \"f\", \"parameters\": {}}]");
        assert_eq!(p.calls, vec![call("g", "{\"x\": 2}"), call("f", "{}")]);
        for cut in [
            "[{\"name\": \"g\"",
            "[]",
            "{\"name\": \"g\", \"parameters\": {}}",
        ] {
            let p = req.parse(cut);
            assert!(p.calls.is_empty(), "{cut}");
            assert_eq!(p.content.as_deref(), Some(cut));
        }
        let mut f = StreamFilter::new(CallMode::Named("f".into()));
        assert_eq!(f.push("{\"a\""), "");
        assert_eq!(f.push(": 1}"), "");
        assert_eq!(f.finish(), (String::new(), vec![call("f", "{\"a\": 1}")]));
    }

    fn call(name: &str, arguments: &str) -> ToolCall {
        ToolCall {
            name: name.into(),
            arguments: arguments.into(),
        }
    }

    #[test]
    fn llama3_json_parses_one_call_with_parameters_or_arguments() {
        let p = ToolParser::Llama3Json;
        let out = p.parse(r#"{"name": "get_weather", "parameters": {"city":"Paris","days":3}}"#);
        assert_eq!(out.content, None);
        assert_eq!(
            out.calls,
            [call("get_weather", r#"{"city": "Paris", "days": 3}"#)]
        );
        let out = p.parse("<|python_tag|>{\"name\":\"f\",\"arguments\":{}}");
        assert_eq!(out.calls, [call("f", "{}")]);
    }

    #[test]
    fn llama3_json_parses_several_calls_separated_by_semicolons() {
        let out = ToolParser::Llama3Json.parse(
            r#"{"name": "a", "parameters": {"x": [1, 2.5, -3e2]}}; {"name": "b", "parameters": {"y": null, "z": true}}"#,
        );
        assert_eq!(
            out.calls,
            [
                call("a", r#"{"x": [1, 2.5, -3e2]}"#),
                call("b", r#"{"y": null, "z": true}"#)
            ]
        );
    }

    #[test]
    fn llama3_json_falls_back_to_content() {
        for text in [
            "Hello there",
            r#"{"name": "a", "parameters": {"x": 1}"#,
            r#"{"name": "a"}"#,
            r#"{"parameters": {}}"#,
            r#"{"name": "a", "parameters": {}} and more"#,
            r#"Sure: {"name": "a", "parameters": {}}"#,
            "",
        ] {
            let out = ToolParser::Llama3Json.parse(text);
            assert!(out.calls.is_empty(), "{text}");
            assert_eq!(out.content.as_deref(), Some(text));
        }
    }

    #[test]
    fn hermes_parses_blocks_and_keeps_the_text_before_the_first() {
        let p = ToolParser::Hermes;
        let out = p.parse(
            "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>{\"name\":\"t\",\"arguments\":{}}</tool_call>",
        );
        assert_eq!(out.content.as_deref(), Some("Let me check.\n"));
        assert_eq!(
            out.calls,
            [call("get_weather", r#"{"city": "Paris"}"#), call("t", "{}")]
        );
        let out = p.parse("<tool_call>{\"name\":\"t\",\"arguments\":{\"a\":1}}");
        assert_eq!(out.content, None);
        assert_eq!(out.calls, [call("t", r#"{"a": 1}"#)]);
    }

    #[test]
    fn hermes_malformed_json_is_content() {
        for text in [
            "no calls here",
            "<tool_call>{\"name\": \"t\", \"arguments\": {</tool_call>",
            "<tool_call>{\"name\": \"t\"}</tool_call>",
            "ok <tool_call>{\"name\":\"a\",\"arguments\":{}}</tool_call><tool_call>oops</tool_call>",
        ] {
            let out = ToolParser::Hermes.parse(text);
            assert!(out.calls.is_empty(), "{text}");
            assert_eq!(out.content.as_deref(), Some(text));
        }
    }

    #[test]
    fn unicode_and_escapes_in_arguments_come_back_as_python_writes_them() {
        let out = ToolParser::Hermes.parse(
            "<tool_call>{\"name\": \"say\", \"arguments\": {\"text\": \"h\u{e9}llo \\u00e9 \\ud83d\\ude00 \u{65e5}\u{672c} \\\"q\\\" \\/ \\n\"}}</tool_call>",
        );
        assert_eq!(
            out.calls,
            [call(
                "say",
                "{\"text\": \"h\u{e9}llo \u{e9} \u{1f600} \u{65e5}\u{672c} \\\"q\\\" / \\n\"}"
            )]
        );
        let args: serde_json::Value = serde_json::from_str(&out.calls[0].arguments).unwrap();
        assert_eq!(
            args["text"],
            "h\u{e9}llo \u{e9} \u{1f600} \u{65e5}\u{672c} \"q\" / \n"
        );
    }

    /// The weather tool with a parameter of each type `qwen3_coder` converts.
    fn typed_tool() -> serde_json::Value {
        serde_json::json!({"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string"}, "days": {"type": "integer"},
                "metric": {"type": "boolean"}, "opts": {"type": "object"},
                "temp": {"type": "number"}, "whole": {"type": "number"},
                "note": {"type": ["string", "null"]},
                "maybe": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
                "tags": {"type": "array"}, "count": {"type": "integer"}}}}})
    }

    #[test]
    fn phi4_mini_reads_the_functools_list_whole() {
        let out = ToolParser::Phi4MiniJson.parse(
            "functools[{\"name\": \"f\", \"arguments\": {\"xs\": [1, [2]]}}, {\"name\": \"g\", \"parameters\": {\"q\": \"]\"}}] trailing",
        );
        assert_eq!(out.content, None);
        let calls: Vec<(&str, &str)> = out
            .calls
            .iter()
            .map(|c| (c.name.as_str(), c.arguments.as_str()))
            .collect();
        assert_eq!(
            calls,
            [("f", "{\"xs\": [1, [2]]}"), ("g", "{\"q\": \"]\"}")]
        );
        let out = ToolParser::Phi4MiniJson.parse("functools{\"name\": \"f\"}");
        assert!(out.calls.is_empty());
    }

    #[test]
    fn qwen3_coder_types_raw_values_by_the_tools_schema() {
        let p = ToolParser::Qwen3Coder;
        let text = "I'll check.\n<tool_call>\n<function=get_weather>\n\
            <parameter=city>\nSan Francisco\n</parameter>\n\
            <parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n\
            <parameter=opts>\n{\"a\": [1, 2]}\n</parameter>\n<parameter=temp>\n21.50\n</parameter>\n\
            <parameter=whole>\n5.0\n</parameter>\n<parameter=note>\nNone\n</parameter>\n\
            <parameter=maybe>\nnull\n</parameter>\n<parameter=tags>\n['a', \"b\"]\n</parameter>\n\
            <parameter=count>\nmany\n</parameter>\n\
            <parameter=extra>\n42\n</parameter>\n</function>\n</tool_call>";
        let out = p.parse_with(text, &[typed_tool()]);
        assert_eq!(out.content.as_deref(), Some("I'll check.\n"));
        assert_eq!(out.calls.len(), 1, "{out:?}");
        assert_eq!(out.calls[0].name, "get_weather");
        // Each value as its schema types it; an undeclared parameter, and a value that does not
        // read as its type, stay strings (vLLM's `_convert_param_value`).
        assert_eq!(
            out.calls[0].arguments,
            "{\"city\": \"San Francisco\", \"days\": 3, \"metric\": true, \"opts\": {\"a\": [1, 2]}, \
             \"temp\": 21.5, \"whole\": 5, \"note\": null, \"maybe\": null, \"tags\": [\"a\", \"b\"], \
             \"count\": \"many\", \"extra\": \"42\"}"
        );
        // Without the tools every value is a string.
        let out = p.parse(text);
        assert!(
            out.calls[0].arguments.contains("\"days\": \"3\""),
            "{out:?}"
        );
    }

    #[test]
    fn qwen3_coder_reads_several_calls_multiline_values_and_missing_end_tags() {
        let p = ToolParser::Qwen3Coder;
        // A value keeps its inner newlines (one leading and one trailing one go); a missing
        // </parameter> ends at the next parameter; the last call lacks its end tags.
        let text = "<tool_call>\n<function=write>\n<parameter=path>\na.txt\n</parameter>\n\
            <parameter=body>\nline 1\n\nline 3\n\n</parameter>\n</function>\n</tool_call>\n\
            <tool_call>\n<function=read>\n<parameter=path>\nb.txt\n<parameter=n>\n2\n";
        let out = p.parse(text);
        assert_eq!(out.content, None);
        let calls: Vec<(&str, &str)> = out
            .calls
            .iter()
            .map(|c| (c.name.as_str(), c.arguments.as_str()))
            .collect();
        assert_eq!(
            calls,
            [
                (
                    "write",
                    "{\"path\": \"a.txt\", \"body\": \"line 1\\n\\nline 3\\n\"}"
                ),
                ("read", "{\"path\": \"b.txt\", \"n\": \"2\"}"),
            ]
        );
        // Text without a function block is content.
        for plain in [
            "no call here",
            "<tool_call>\nnothing</tool_call>",
            "<function=>x</function>",
        ] {
            let out = p.parse(plain);
            assert!(out.calls.is_empty(), "{plain:?}: {out:?}");
            assert_eq!(out.content.as_deref(), Some(plain));
        }
        // Streamed, typed by the tools as the whole parse.
        let mut f = StreamFilter::with_tools(CallMode::Parser(p), vec![typed_tool()]);
        let mut content = f.push("Ok. <tool_");
        content.push_str(&f.push("call>\n<function=get_weather>\n<parameter=days>\n4\n"));
        content.push_str(&f.push("</parameter>\n</function>\n</tool_call>"));
        let (rest, calls) = f.finish();
        assert_eq!(content + &rest, "Ok. ");
        assert_eq!(calls[0].arguments, "{\"days\": 4}");
    }

    fn stream(p: ToolParser, pieces: &[&str]) -> (String, Vec<ToolCall>) {
        let mut f = StreamFilter::new(CallMode::Parser(p));
        let mut content: String = pieces.iter().map(|t| f.push(t)).collect();
        let (rest, calls) = f.finish();
        content.push_str(&rest);
        (content, calls)
    }

    #[test]
    fn streaming_gives_what_the_whole_output_parses_to() {
        let cases: [(ToolParser, &str); 22] = [
            (ToolParser::Phi4MiniJson, "Sure. functools[{\"name\": \"f\", \"arguments\": {\"a\": [1, 2]}}, {\"name\": \"g\", \"parameters\": {}}]"),
            (ToolParser::Phi4MiniJson, "no functo call"),
            (ToolParser::Phi4MiniJson, "functools[{broken"),
            (ToolParser::Qwen3Coder, "Sure.\n<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>"),
            (ToolParser::Qwen3Coder, "<function=f>\n<parameter=a>\nx\n</parameter>\n</function>"),
            (ToolParser::Qwen3Coder, "a <tool_ca then <functio not"),
            (ToolParser::Qwen3Coder, "x <tool_call>no function here</tool_call>"),
            (ToolParser::Pythonic, "[get_weather(city='Paris'), t()]"),
            (ToolParser::Pythonic, " <|python_start|>[f(a=[1, {'b': None}])]<|python_end|>"),
            (ToolParser::Pythonic, "[not a call"),
            (ToolParser::Mistral, "Sure. [TOOL_CALLS] [{\"name\": \"f\", \"arguments\": {\"a\": 1}}]"),
            (ToolParser::Mistral, "[TOOL_CALLS]f[ARGS]{\"a\": 1}[TOOL_CALLS]g{}"),
            (ToolParser::Mistral, "no [TOOL_CA call"),
            (ToolParser::Mistral, "x [TOOL_CALLS] [{\"name\": broken"),
            (ToolParser::Hermes, "Let me see. <tool_call>{\"name\": \"f\", \"arguments\": {\"a\": 1}}</tool_call>"),
            (ToolParser::Hermes, "a <tool_ca then not"),
            (ToolParser::Hermes, "x <tool_call>{broken</tool_call>"),
            (ToolParser::Hermes, "<tool_call>{\"name\":\"f\",\"arguments\":{}}</tool_call>"),
            (ToolParser::Llama3Json, "<|python_tag|>{\"name\": \"f\", \"parameters\": {}}"),
            (ToolParser::Llama3Json, " {\"name\": \"f\", \"parameters\": {\"q\": \"\u{e9}\"}}; {\"name\": \"g\", \"parameters\": {}}"),
            (ToolParser::Llama3Json, "<|py not a tag"),
            (ToolParser::Llama3Json, "{not json"),
        ];
        for (p, text) in cases {
            let whole = p.parse(text);
            // Every split into pieces of 1..=4 chars.
            for size in 1..=4 {
                let chars: Vec<char> = text.chars().collect();
                let pieces: Vec<String> = chars.chunks(size).map(|c| c.iter().collect()).collect();
                let refs: Vec<&str> = pieces.iter().map(String::as_str).collect();
                let (content, calls) = stream(p, &refs);
                assert_eq!(calls, whole.calls, "{text:?} by {size}");
                assert_eq!(
                    (!content.is_empty()).then_some(content),
                    whole.content,
                    "{text:?} by {size}"
                );
            }
        }
    }

    #[test]
    fn mistral_parses_both_call_formats_and_keeps_the_text_before() {
        let p = ToolParser::Mistral;
        // Before v11: one [TOOL_CALLS] and a JSON list.
        let out = p.parse(
            "Let me look. [TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Z\u{fc}rich\"}}, {\"name\": \"t\", \"arguments\": {}}]",
        );
        assert_eq!(out.content.as_deref(), Some("Let me look. "));
        assert_eq!(
            out.calls,
            [
                call("get_weather", "{\"city\": \"Z\u{fc}rich\"}"),
                call("t", "{}")
            ]
        );
        // v11 and later: NAME[ARGS]{...} (or NAME{...}) after each [TOOL_CALLS].
        let out = p.parse("[TOOL_CALLS]get_weather[ARGS]{\"city\":\"Paris\"}[TOOL_CALLS]t {}");
        assert_eq!(out.content, None);
        assert_eq!(
            out.calls,
            [
                call("get_weather", "{\"city\": \"Paris\"}"),
                call("t", "{}")
            ]
        );
        // Text after a list is dropped (vLLM's fallback finds the list within it).
        let out = p.parse("[TOOL_CALLS] [{\"name\": \"f\", \"arguments\": {}}] and more");
        assert_eq!(out.calls, [call("f", "{}")]);
        // Anything else after the tag is content, whole.
        for text in [
            "[TOOL_CALLS] [{\"name\": \"f\"}]",
            "[TOOL_CALLS]bad name{}",
            "[TOOL_CALLS]f{\"a\": }",
            "[TOOL_CALLS]",
            "no tag at all",
        ] {
            assert_eq!(p.parse(text), Parsed::plain(text), "{text:?}");
        }
    }

    #[test]
    fn pythonic_parses_calls_with_python_literals() {
        let p = ToolParser::Pythonic;
        let out = p.parse(
            "[get_weather(city=\"Z\\u00fcrich\", days=3, hot=True, note=None), \
             f(x=-1.5e-5, y=1_000, l=[1, 'a\\'b'], d={'k': False},), g()]",
        );
        assert_eq!(out.content, None);
        assert_eq!(
            out.calls,
            [
                call(
                    "get_weather",
                    "{\"city\": \"Z\u{fc}rich\", \"days\": 3, \"hot\": true, \"note\": null}"
                ),
                call(
                    "f",
                    "{\"x\": -1.5e-05, \"y\": 1000, \"l\": [1, \"a'b\"], \"d\": {\"k\": false}}"
                ),
                call("g", "{}"),
            ]
        );
        // Llama 4's tags around the list.
        let out = p.parse("<|python_start|>[f(a=1)]<|python_end|>");
        assert_eq!(out.calls, [call("f", "{\"a\": 1}")]);
        // Anything but a list of keyword calls of literals is content, whole.
        for text in [
            "Sure: [f(a=1)]",
            "[f(1)]",
            "[f(a=b)]",
            "[f(a=1)] and more",
            "[f(x=1, x=2)]",
            "[]",
            "[f(a=float('nan'))]",
            "[f(a=inf)]",
            "[1f(a=1)]",
            "[f(a='unterminated)]",
            "plain text",
        ] {
            assert_eq!(p.parse(text), Parsed::plain(text), "{text:?}");
        }
        assert_eq!(py_float_repr(1e16), "1e+16");
        assert_eq!(py_float_repr(1e15), "1000000000000000.0");
        assert_eq!(py_float_repr(0.0001), "0.0001");
        assert_eq!(py_float_repr(2.5e-7), "2.5e-07");
    }

    #[test]
    fn tool_call_ids_have_the_parsers_form() {
        let mut n = 0u64;
        let mut next = || {
            n = n
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            n
        };
        for _ in 0..100 {
            let id = ToolParser::Mistral.call_id(&mut next);
            assert!(
                id.len() == 9 && id.chars().all(|c| c.is_ascii_alphanumeric()),
                "{id}"
            );
            let id = ToolParser::Hermes.call_id(&mut next);
            assert!(
                id.starts_with("chatcmpl-tool-") && id.len() == 14 + 32,
                "{id}"
            );
        }
        assert_ne!(
            ToolParser::Mistral.call_id(&mut next),
            ToolParser::Mistral.call_id(&mut next)
        );
    }

    #[test]
    fn plain_text_streams_without_waiting_for_the_end() {
        let mut f = StreamFilter::new(CallMode::Parser(ToolParser::Llama3Json));
        assert_eq!(f.push("Hel"), "Hel");
        assert_eq!(f.push("lo"), "lo");
        let mut f = StreamFilter::new(CallMode::Parser(ToolParser::Hermes));
        assert_eq!(f.push("Hi <tool"), "Hi ");
        assert_eq!(f.push("box>"), "<toolbox>");
        assert_eq!(f.push(" <tool_call>{"), " ");
        assert_eq!(f.push("}"), "");
    }

    #[test]
    fn parser_names_round_trip_and_bad_ones_are_refused() {
        for n in TOOL_PARSER_NAMES {
            assert_eq!(n.parse::<ToolParser>().unwrap().name(), n);
        }
        assert_eq!("llama4_pythonic".parse(), Ok(ToolParser::Pythonic));
        assert_eq!("llama4_json".parse(), Ok(ToolParser::Llama3Json));
        assert!("granite".parse::<ToolParser>().is_err());
    }
}
