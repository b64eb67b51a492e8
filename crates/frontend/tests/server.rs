//! End-to-end tests of the OpenAI frontend over the in-process engine (CPU backend,
//! stories260K).

mod common;

use common::{get, post, send, start, stream_text, wait_engine_idle, Opts, MODEL};
use serde_json::{json, Value};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The Llama-2 template shipped in `scripts/chat-templates` (unknown roles raise).
const LLAMA2_TEMPLATE: &str = include_str!("../../../scripts/chat-templates/llama2.jinja");

fn text_of(v: &Value, i: usize) -> String {
    v["choices"][i]["text"].as_str().expect("text").to_owned()
}

async fn completion(addr: std::net::SocketAddr, body: Value) -> Value {
    let r = post(addr, "/v1/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()
}

async fn completion_stream(
    addr: std::net::SocketAddr,
    mut body: Value,
) -> (String, Option<String>) {
    body["stream"] = json!(true);
    let r = post(addr, "/v1/completions", &body).await;
    stream_text(&r, false)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_goldens_match_through_completions_streamed_and_not() {
    let srv = start(Opts::default()).await;
    for g in common::goldens() {
        let prompt = g["prompt"].as_str().unwrap();
        let want = g["greedy_text"].as_str().unwrap();
        let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 64, "temperature": 0});
        let v = completion(srv.addr, body.clone()).await;
        assert_eq!(text_of(&v, 0), want, "prompt {prompt:?}");
        assert_eq!(v["choices"][0]["finish_reason"], "length");
        assert_eq!(v["object"], "text_completion");
        assert_eq!(v["model"], MODEL);
        let n_prompt = g["prompt_ids"].as_array().unwrap().len();
        assert_eq!(v["usage"]["prompt_tokens"], n_prompt);
        assert_eq!(v["usage"]["completion_tokens"], 64);
        assert_eq!(v["usage"]["total_tokens"], n_prompt + 64);
        let (streamed, finish) = completion_stream(srv.addr, body).await;
        assert_eq!(streamed, want, "streamed, prompt {prompt:?}");
        assert_eq!(finish.as_deref(), Some("length"));
        // The same prompt as token ids gives the same text.
        let ids = g["prompt_ids"].clone();
        let v = completion(
            srv.addr,
            json!({"prompt": ids, "max_tokens": 64, "temperature": 0}),
        )
        .await;
        assert_eq!(text_of(&v, 0), want, "token-id prompt {prompt:?}");
    }
    assert!(wait_engine_idle(&srv.engine, Duration::from_secs(5)).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn penalties_change_greedy_text_the_same_way_streamed_and_not() {
    let srv = start(Opts::default()).await;
    let g = &common::goldens()[0];
    let prompt = g["prompt"].as_str().unwrap();
    let golden = g["greedy_text"].as_str().unwrap();
    for extra in [
        json!({"presence_penalty": 1.5, "frequency_penalty": 0.5}),
        json!({"repetition_penalty": 1.5}),
        json!({"frequency_penalty": -2}),
    ] {
        let body = with_fields(
            &json!({"prompt": prompt, "max_tokens": 64, "temperature": 0}),
            extra.clone(),
        );
        let a = text_of(&completion(srv.addr, body.clone()).await, 0);
        assert_ne!(a, golden, "{extra} changed nothing");
        let b = text_of(&completion(srv.addr, body.clone()).await, 0);
        assert_eq!(a, b, "{extra}: greedy with penalties is not deterministic");
        let (streamed, _) = completion_stream(srv.addr, body).await;
        assert_eq!(streamed, a, "{extra}: streamed text differs");
    }
    assert!(wait_engine_idle(&srv.engine, Duration::from_secs(5)).await);
}

/// Structured outputs: every form vLLM and OpenAI clients send constrains the text, greedy
/// and sampled, streamed and not; bad constraints are 400s naming their field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn structured_outputs_constrain_the_text() {
    let srv = start(Opts {
        chat_template: Some(LLAMA2_TEMPLATE.into()),
        ..Opts::default()
    })
    .await;
    let prompt = common::goldens()[0]["prompt"].as_str().unwrap().to_owned();
    let base = json!({"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0});
    let with = |k: &str, v: Value, extra: Value| {
        let mut b = base.clone();
        b[k] = v;
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    // Unconstrained, this model tells a story: no digits, no braces.
    let free = text_of(&completion(srv.addr, base.clone()).await, 0);
    assert!(
        !free.contains('{') && !free.chars().any(|c| c.is_ascii_digit()),
        "{free}"
    );
    let choices = ["red fox", "blue whale", "green tree"];
    for (k, v) in [
        ("guided_choice", json!(choices)),
        ("structured_outputs", json!({"choice": choices})),
    ] {
        for extra in [
            json!({}),
            json!({"temperature": 1.0, "seed": 7}),
            json!({"n": 2, "temperature": 1.0}),
        ] {
            let r = completion(srv.addr, with(k, v.clone(), extra.clone())).await;
            for c in r["choices"].as_array().unwrap() {
                let t = c["text"].as_str().unwrap();
                assert!(choices.contains(&t), "{k} {extra}: {t:?}");
                assert_eq!(c["finish_reason"], "stop", "{r}");
            }
        }
    }
    for (k, v) in [
        ("guided_regex", json!("[0-9]{3}-[0-9]{2}")),
        ("structured_outputs", json!({"regex": "[0-9]{3}-[0-9]{2}"})),
    ] {
        let r = completion(srv.addr, with(k, v, json!({}))).await;
        let t = text_of(&r, 0);
        let b = t.as_bytes();
        assert!(
            b.len() == 6 && b[3] == b'-' && t.chars().filter(char::is_ascii_digit).count() == 5,
            "{k}: {t:?}"
        );
    }
    // JSON: a schema with a required boolean and a bounded string; long enough to finish.
    let schema = json!({"type": "object", "properties": {
        "done": {"type": "boolean"}, "name": {"type": "string", "maxLength": 8}},
        "required": ["done", "name"], "additionalProperties": false});
    for (k, v) in [
        (
            "response_format",
            json!({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}),
        ),
        ("guided_json", schema.clone()),
        ("guided_json", Value::String(schema.to_string())),
        ("structured_outputs", json!({"json": schema})),
    ] {
        let r = completion(srv.addr, with(k, v, json!({"max_tokens": 200}))).await;
        let t = text_of(&r, 0);
        let parsed: Value = serde_json::from_str(&t).unwrap_or_else(|e| panic!("{k}: {t:?}: {e}"));
        assert!(
            parsed["done"].is_boolean() && parsed["name"].is_string(),
            "{t}"
        );
        assert_eq!(parsed.as_object().unwrap().len(), 2, "{t}");
    }
    let r = completion(
        srv.addr,
        with(
            "response_format",
            json!({"type": "json_object"}),
            json!({"max_tokens": 200}),
        ),
    )
    .await;
    let t = text_of(&r, 0);
    if r["choices"][0]["finish_reason"] == "stop" {
        assert!(
            serde_json::from_str::<Value>(&t).unwrap().is_object(),
            "{t}"
        );
    } else {
        assert!(t.trim_start().starts_with('{'), "{t}");
    }
    // Streamed: the same text as not streamed.
    let body = with("guided_regex", json!("[0-9]{4}"), json!({}));
    let whole = text_of(&completion(srv.addr, body.clone()).await, 0);
    let (streamed, _) = completion_stream(srv.addr, body).await;
    assert_eq!(streamed, whole);
    // Chat completions take response_format too.
    let chat = json!({"model": MODEL, "messages": [{"role": "user", "content": "pick"}],
                      "max_tokens": 10, "temperature": 0,
                      "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": {"enum": ["yes", "no"]}}}});
    let r = post(srv.addr, "/v1/chat/completions", &chat).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let content = r.json()["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(content == "\"yes\"" || content == "\"no\"", "{content}");
    // Bad constraints.
    for (k, v, extra) in [
        ("guided_regex", json!("("), json!({})),
        ("guided_json", json!({"type": "nosuchtype"}), json!({})),
        ("guided_json", json!("{not json"), json!({})),
        ("guided_choice", json!([]), json!({})),
        ("guided_choice", json!("a"), json!({})),
        ("guided_grammar", json!("start: undefined_rule"), json!({})),
        ("structured_outputs", json!({"nosuchkind": 1}), json!({})),
        ("structured_outputs", json!(3), json!({})),
        ("response_format", json!({"type": "json_schema"}), json!({})),
        ("response_format", json!({"type": "yaml"}), json!({})),
        ("guided_regex", json!("a+"), json!({"guided_choice": ["a"]})),
        ("guided_regex", json!("a+"), json!({"min_tokens": 2})),
        (
            "guided_regex",
            json!("a+"),
            json!({"allowed_token_ids": [403]}),
        ),
    ] {
        let r = post(
            srv.addr,
            "/v1/completions",
            &with(k, v.clone(), extra.clone()),
        )
        .await;
        assert_eq!(r.status, 400, "{k}={v} {extra}: {}", r.body);
        let param = r.json()["error"]["param"].as_str().unwrap_or("").to_owned();
        assert!(
            param == k || extra.get(&param).is_some(),
            "{k}={v}: {}",
            r.body
        );
    }
    for (k, v) in [
        ("guided_json", Value::Null),
        ("response_format", json!({"type": "text"})),
    ] {
        let r = post(srv.addr, "/v1/completions", &with(k, v.clone(), json!({}))).await;
        assert_eq!(r.status, 200, "{k}={v}: {}", r.body);
    }
}

/// Constraints that nest through references, that grow past llguidance's limits while
/// generating, and option mistakes: never a crash, a hang or a success that is not one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn structured_outputs_survive_deep_and_overgrown_constraints() {
    let srv = start_chat(Opts::default()).await;
    let base = json!({"model": MODEL, "prompt": "Once", "max_tokens": 8, "temperature": 0});
    let with = |k: &str, v: Value| {
        let mut b = base.clone();
        b[k] = v;
        b
    };
    // A 900-deep $ref chain and a 3000-rule Lark chain (a 2 MiB stack overflowed at 300).
    let n = 900;
    let mut defs = serde_json::Map::new();
    for i in 0..n {
        defs.insert(
            format!("d{i}"),
            json!({"type": "array", "items": {"$ref": format!("#/$defs/d{}", i + 1)}}),
        );
    }
    defs.insert(format!("d{n}"), json!({"type": "integer"}));
    let deep = json!({"$defs": defs, "$ref": "#/$defs/d0"});
    let lark: String = (0..3000)
        .map(|i| format!("r{i}: r{}\n", i + 1))
        .chain(["r3000: \"x\"\nstart: r0\n".to_owned()])
        .collect();
    for body in [
        with("guided_json", deep),
        with("guided_grammar", json!(lark)),
    ] {
        let r = post(srv.addr, "/v1/completions", &body).await;
        assert!(r.status == 200 || r.status == 400, "{}", r.body);
    }
    let r = completion(srv.addr, base.clone()).await;
    assert!(!text_of(&r, 0).is_empty());
    // 500 optional properties, closed (no other keys, the default): generated as any schema.
    let props: serde_json::Map<String, Value> = (0..500)
        .map(|i| (format!("p{i}"), json!({"type": "string"})))
        .collect();
    let closed = json!({"type": "object", "properties": props.clone()});
    let r = completion(srv.addr, with("guided_json", closed)).await;
    assert_eq!(r["choices"][0]["finish_reason"], "length", "{r}");
    assert!(text_of(&r, 0).starts_with("{\"p"), "{r}");
    // Open to other keys too: compiles, then llguidance's row limit stops it after a token or
    // two. The output is cut: `abort` on completions, a failed response.
    let wide = json!({"type": "object", "properties": props, "additionalProperties": true});
    let r = completion(srv.addr, with("guided_json", wide.clone())).await;
    assert_eq!(r["choices"][0]["finish_reason"], "abort", "{r}");
    let body = json!({"model": MODEL, "input": "Once", "max_output_tokens": 8, "temperature": 0,
                      "text": {"format": {"type": "json_schema", "name": "w", "schema": wide}}});
    let v = response(srv.addr, &body).await;
    assert_eq!(v["status"], "failed", "{v}");
    assert_eq!(v["error"]["code"], "server_error", "{v}");
    assert_eq!(v["output"][0]["status"], "incomplete", "{v}");
    // Option mistakes are 400s naming the field; the two keys are named.
    for (k, v) in [
        ("structured_outputs", json!({"regex": false})),
        ("structured_outputs", json!({"grammar": 3})),
        ("structured_outputs", json!({"json_object": "yes"})),
        (
            "structured_outputs",
            json!({"regex": "a", "backend": "nosuch"}),
        ),
        (
            "structured_outputs",
            json!({"regex": "a", "disable_any_whitespace": "no"}),
        ),
        ("guided_decoding_backend", json!("nosuch")),
    ] {
        let r = post(srv.addr, "/v1/completions", &with(k, v.clone())).await;
        assert_eq!(r.status, 400, "{k}={v}: {}", r.body);
        assert_eq!(r.json()["error"]["param"], k, "{}", r.body);
    }
    let r = post(
        srv.addr,
        "/v1/completions",
        &with("structured_outputs", json!({"regex": "a", "choice": ["b"]})),
    )
    .await;
    let m = r.json()["error"]["message"].as_str().unwrap().to_owned();
    assert!(
        m.contains("structured_outputs.regex") && m.contains("structured_outputs.choice"),
        "{m}"
    );
    // llguidance's state dump stays out of error bodies.
    let r = post(
        srv.addr,
        "/v1/completions",
        &with("guided_regex", json!("[^\\s\\S]")),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.body);
    let m = r.json()["error"]["message"].as_str().unwrap().to_owned();
    assert!(!m.contains("<state>") && !m.contains('\n'), "{m}");
    // Accepted backend names and layout options: free whitespace on request.
    let schema = json!({"type": "object", "properties": {"ok": {"type": "boolean"}},
                        "required": ["ok"], "additionalProperties": false});
    for so in [
        json!({"json": schema, "backend": "xgrammar"}),
        json!({"json": schema, "disable_any_whitespace": true}),
        json!({"json": schema, "whitespace_pattern": " ?"}),
    ] {
        let mut b = with("structured_outputs", so.clone());
        b["max_tokens"] = json!(100);
        let t = text_of(&completion(srv.addr, b).await, 0);
        let v: Value = serde_json::from_str(&t).unwrap_or_else(|e| panic!("{so}: {t:?}: {e}"));
        assert!(v["ok"].is_boolean(), "{t}");
    }
}

/// vLLM's `allowed_token_ids`: only the listed tokens are sampled, greedy or not, whatever
/// `logit_bias` says about others; log-probabilities stay the raw ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allowed_token_ids_restrict_sampling_to_the_list() {
    let srv = start(Opts::default()).await;
    let g = &common::goldens()[0];
    let prompt = g["prompt"].as_str().unwrap();
    let first = g["greedy_ids"][0].as_u64().unwrap();
    let want = post(srv.addr, "/detokenize", &json!({"tokens": vec![403; 5]}))
        .await
        .json();
    let want = want["prompt"].as_str().unwrap();
    for extra in [
        json!({"temperature": 0}),
        json!({"temperature": 1.0, "seed": 3}),
        // A bias on a token outside the list is moot; one inside still applies.
        json!({"temperature": 0, "logit_bias": {first.to_string(): 100, "403": 5}}),
    ] {
        let mut body = json!({"prompt": prompt, "max_tokens": 5, "allowed_token_ids": [403]});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let text = text_of(&completion(srv.addr, body.clone()).await, 0);
        // (A decode of the ids alone drops the SentencePiece leading space a continuation keeps.)
        assert_eq!(text.trim_start(), want, "{extra}");
    }
    // Two allowed tokens: the greedy pick among them, and raw log-probabilities (the golden's
    // first token, outside the list, still tops `top_logprobs`).
    let body = json!({"prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 2,
                      "allowed_token_ids": [403, 407]});
    let v = completion(srv.addr, body).await;
    let lp = &v["choices"][0]["logprobs"];
    let top: Vec<f64> = lp["top_logprobs"][0]
        .as_object()
        .unwrap()
        .values()
        .map(|x| x.as_f64().unwrap())
        .collect();
    let chosen = lp["token_logprobs"][0].as_f64().unwrap();
    assert_eq!(
        top.iter().filter(|&&t| t > chosen).count(),
        2,
        "both raw top log-probs should beat the allowed pick: {lp}"
    );
    // min_tokens holds back every allowed token (here EOS, id 2): nothing could be sampled.
    let r = post(
        srv.addr,
        "/v1/completions",
        &json!({"prompt": prompt, "allowed_token_ids": [2], "min_tokens": 3, "max_tokens": 5}),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(
        r.json()["error"]["param"],
        "allowed_token_ids",
        "{}",
        r.body
    );
    // With one allowed token left over, it is fine.
    completion(
        srv.addr,
        json!({"prompt": prompt, "allowed_token_ids": [2, 403], "min_tokens": 3, "max_tokens": 5}),
    )
    .await;
    for (bad, why) in [
        (json!([]), "at least one"),
        (json!([1, 99999]), "out of range"),
        (json!("403"), "list of token ids"),
    ] {
        let r = post(
            srv.addr,
            "/v1/completions",
            &json!({"prompt": prompt, "allowed_token_ids": bad}),
        )
        .await;
        assert_eq!(r.status, 400, "{bad}: {}", r.body);
        let e = r.json();
        assert_eq!(e["error"]["param"], "allowed_token_ids", "{bad}: {e}");
        assert!(
            e["error"]["message"].as_str().unwrap().contains(why),
            "{bad}: {e}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logit_bias_forces_or_bans_tokens() {
    let srv = start(Opts::default()).await;
    let g = &common::goldens()[0];
    let prompt = g["prompt"].as_str().unwrap();
    let golden = g["greedy_text"].as_str().unwrap();
    // +100 on one token makes it the argmax at every step.
    let body = json!({"prompt": prompt, "max_tokens": 6, "temperature": 0,
                      "logit_bias": {"403": 100}});
    let text = text_of(&completion(srv.addr, body.clone()).await, 0);
    let want = post(srv.addr, "/detokenize", &json!({"tokens": vec![403; 6]}))
        .await
        .json();
    // (A decode of the ids alone drops the SentencePiece leading space a continuation keeps.)
    assert_eq!(text.trim_start(), want["prompt"].as_str().unwrap());
    let (streamed, _) = completion_stream(srv.addr, body).await;
    assert_eq!(streamed, text);
    // -100 on the golden's first token changes the continuation.
    let first = g["greedy_ids"][0].as_u64().unwrap().to_string();
    let body = json!({"prompt": prompt, "max_tokens": 16, "temperature": 0,
                      "logit_bias": {first: -100}});
    let text = text_of(&completion(srv.addr, body).await, 0);
    assert!(!golden.starts_with(&text), "{text:?} ignored the ban");
    assert!(wait_engine_idle(&srv.engine, Duration::from_secs(5)).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn min_tokens_defers_stop_strings_and_stop_ids() {
    let srv = start(Opts::default()).await;
    let g = &common::goldens()[0];
    let prompt = g["prompt"].as_str().unwrap();
    let golden = g["greedy_text"].as_str().unwrap();
    let word = "Lily";
    let at = golden.find(word).expect("the golden names Lily");
    let base = json!({"prompt": prompt, "max_tokens": 64, "temperature": 0, "stop": [word]});
    let v = completion(srv.addr, base.clone()).await;
    assert_eq!(text_of(&v, 0), &golden[..at]);
    // With min_tokens past the first match, the stop string is not looked for there.
    let v = completion(srv.addr, with_fields(&base, json!({"min_tokens": 30}))).await;
    let text = text_of(&v, 0);
    assert!(
        text.len() > at + word.len() && golden.starts_with(&text),
        "{text:?}"
    );
    assert!(v["usage"]["completion_tokens"].as_u64().unwrap() > 30);
    let (streamed, _) =
        completion_stream(srv.addr, with_fields(&base, json!({"min_tokens": 30}))).await;
    assert_eq!(streamed, text);
    // A stop token id is masked until min_tokens: the golden's 3rd token id.
    let third = g["greedy_ids"][2].clone();
    let body = json!({"prompt": prompt, "max_tokens": 20, "temperature": 0,
                      "stop_token_ids": [third], "min_tokens": 8});
    let v = completion(srv.addr, body).await;
    assert!(v["usage"]["completion_tokens"].as_u64().unwrap() > 8, "{v}");
    // min_tokens is checked against the effective max_tokens (16 by default on completions),
    // and against the stop ids the engine can mask.
    for body in [
        json!({"prompt": prompt, "min_tokens": 17}),
        json!({"prompt": prompt, "max_tokens": 20, "min_tokens": 1,
               "stop_token_ids": (3..70).collect::<Vec<u32>>()}),
    ] {
        let r = post(srv.addr, "/v1/completions", &body).await;
        assert_eq!(r.status, 400, "{}", r.body);
        assert_eq!(r.json()["error"]["param"], "min_tokens", "{}", r.body);
    }
    let ok = json!({"prompt": prompt, "max_tokens": 20, "min_tokens": 1,
                    "stop_token_ids": [5, 5, 5, 6]});
    assert_eq!(post(srv.addr, "/v1/completions", &ok).await.status, 200);
    assert!(wait_engine_idle(&srv.engine, Duration::from_secs(5)).await);
}

/// A deterministic pseudo-random generator for test inputs.
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn varied_prompts(count: usize) -> Vec<Value> {
    let words = [
        "Once",
        "upon",
        "a",
        "time",
        "cat",
        "dog",
        "café",
        "naïve",
        "😀",
        "🐱",
        "中文",
        "日本語",
        "—",
        "…",
        "“quoted”",
        "\n",
        "  ",
        "Lily",
        "ball",
        "Ünïcödé",
        "🤖",
        "x",
        "12345",
        "!",
    ];
    let mut rng = Lcg(7);
    let mut out = Vec::with_capacity(count);
    for i in 0..count {
        match i % 3 {
            0 | 1 => {
                let n = 1 + rng.below(8) as usize;
                let mut s = String::new();
                for k in 0..n {
                    if k > 0 && rng.below(3) > 0 {
                        s.push(' ');
                    }
                    s.push_str(words[rng.below(words.len() as u64) as usize]);
                }
                out.push(json!(s));
            }
            _ => {
                // Token ids: BOS, some pieces, then (often) the first bytes of a 4-byte
                // character, so the prompt ends inside a multi-byte character.
                let mut ids = vec![1u32];
                for _ in 0..rng.below(6) {
                    ids.push(3 + rng.below(509) as u32);
                }
                match rng.below(3) {
                    0 => ids.extend([410, 243, 162]),
                    1 => ids.extend([243]),
                    _ => ids.extend([231, 187]),
                }
                out.push(json!(ids));
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_text_equals_non_streamed_text_on_200_varied_prompts() {
    let srv = start(Opts::default()).await;
    let prompts = varied_prompts(200);
    let addr = srv.addr;
    let mut tasks = Vec::new();
    for (i, p) in prompts.into_iter().enumerate() {
        // Alternate greedy and hot seeded sampling (which picks byte-fallback pieces often).
        let temperature = if i % 2 == 0 { 0.0 } else { 1.5 };
        let body = json!({"prompt": p, "max_tokens": 16, "temperature": temperature, "seed": i});
        tasks.push(tokio::spawn(async move {
            let v = completion(addr, body.clone()).await;
            let (streamed, finish) = completion_stream(addr, body.clone()).await;
            assert_eq!(streamed, text_of(&v, 0), "prompt {}", body["prompt"]);
            assert_eq!(finish.as_deref(), v["choices"][0]["finish_reason"].as_str());
            !text_of(&v, 0).is_empty()
        }));
        if tasks.len() == 16 {
            for t in tasks.drain(..) {
                t.await.expect("task");
            }
        }
    }
    for t in tasks {
        t.await.expect("task");
    }
    assert!(wait_engine_idle(&srv.engine, Duration::from_secs(5)).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_prompt_ending_inside_a_character_streams_like_non_streamed() {
    let srv = start(Opts::default()).await;
    // GOLDEN.md's emoji row: [1, 410, 243, 162] is "▁" and the first two bytes of "😀".
    for ids in [
        json!([1, 410, 243, 162]),
        json!([1, 410, 243, 162, 155]),
        json!([1, 243]),
    ] {
        for seed in 0..8 {
            let body = json!({"prompt": ids, "max_tokens": 16, "temperature": 1.5, "seed": seed});
            let v = completion(srv.addr, body.clone()).await;
            let (streamed, _) = completion_stream(srv.addr, body).await;
            assert_eq!(streamed, text_of(&v, 0));
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_strings_cut_output_where_they_begin_even_across_tokens() {
    let srv = start(Opts::default()).await;
    let g = &common::goldens()[0];
    let prompt = g["prompt"].as_str().unwrap();
    let full = g["greedy_text"].as_str().unwrap();
    // "little girl" spans the pieces "▁little", "▁g", "ir", "l".
    for (stop, include) in [
        (json!("little girl"), false),
        (json!(["zzz", "Lily. She"]), false),
        (json!("girl named"), true),
    ] {
        let body = json!({"prompt": prompt, "max_tokens": 64, "temperature": 0, "stop": stop,
                          "include_stop_str_in_output": include});
        let v = completion(srv.addr, body.clone()).await;
        let first = match &stop {
            Value::String(s) => s.clone(),
            Value::Array(a) => a[1].as_str().unwrap().to_owned(),
            _ => unreachable!(),
        };
        let at = full
            .find(&first)
            .expect("stop string occurs in the golden text");
        let want = if include {
            &full[..at + first.len()]
        } else {
            &full[..at]
        };
        assert_eq!(text_of(&v, 0), want, "stop {stop}");
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
        assert!(v["usage"]["completion_tokens"].as_u64().unwrap() < 64);
        let (streamed, finish) = completion_stream(srv.addr, body).await;
        assert_eq!(streamed, want, "streamed, stop {stop}");
        assert_eq!(finish.as_deref(), Some("stop"));
    }
    // The stop cancels the engine request: everything comes back.
    assert!(wait_engine_idle(&srv.engine, Duration::from_secs(5)).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_back_text_is_flushed_when_generation_ends_for_another_reason() {
    let srv = start(Opts::default()).await;
    let g = &common::goldens()[0];
    let full = g["greedy_text"].as_str().unwrap();
    assert!(full.ends_with("mom said"));
    // The output ends with "said", the start of the stop string: held back, then flushed.
    let body = json!({"prompt": g["prompt"], "max_tokens": 64, "temperature": 0,
                      "stop": "said nothing"});
    let v = completion(srv.addr, body.clone()).await;
    assert_eq!(text_of(&v, 0), full);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    let (streamed, _) = completion_stream(srv.addr, body).await;
    assert_eq!(streamed, full);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_token_ids_end_generation_with_finish_reason_stop() {
    let srv = start(Opts::default()).await;
    let g = &common::goldens()[0];
    let first = g["greedy_ids"][1].as_u64().unwrap(); // "▁there"
    let body = json!({"prompt": g["prompt"], "max_tokens": 64, "temperature": 0,
                      "stop_token_ids": [first]});
    let v = completion(srv.addr, body.clone()).await;
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["usage"]["completion_tokens"], 2);
    // As in vLLM, the stop token's text is left out unless include_stop_str_in_output.
    assert_eq!(text_of(&v, 0), ",");
    let (streamed, _) = completion_stream(srv.addr, body.clone()).await;
    assert_eq!(streamed, ",");
    let v = completion(
        srv.addr,
        with_fields(&body, json!({"include_stop_str_in_output": true})),
    )
    .await;
    assert_eq!(text_of(&v, 0), ", there");
}

/// `base` with the fields of `extra` set.
fn with_fields(base: &Value, extra: Value) -> Value {
    let mut b = base.clone();
    for (k, v) in extra.as_object().expect("an object") {
        b[k] = v.clone();
    }
    b
}

/// The `stop_reason` of a streamed choice, checked against vLLM's shape: completions chunks
/// all carry the field (`null` until the last), chat chunks only the one with `finish_reason`.
fn streamed_stop_reason(r: &common::Resp, chat: bool) -> Value {
    assert_eq!(r.status, 200, "{}", r.body);
    let mut last = None;
    for e in r.events().iter().filter(|e| e.as_str() != "[DONE]") {
        let v: Value = serde_json::from_str(e).expect("chunk is JSON");
        for c in v["choices"].as_array().expect("choices") {
            let finished = !c["finish_reason"].is_null();
            match (chat, finished) {
                (_, true) => {
                    let sr = c.get("stop_reason").expect("stop_reason in the last chunk");
                    assert!(last.replace(sr.clone()).is_none(), "two last chunks: {e}");
                }
                (true, false) => assert!(c.get("stop_reason").is_none(), "{e}"),
                (false, false) => assert_eq!(c.get("stop_reason"), Some(&Value::Null), "{e}"),
            }
        }
    }
    last.expect("a chunk with finish_reason")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_reason_names_the_stop_string_or_token_id_and_is_null_otherwise() {
    let srv = start(Opts {
        chat_template: Some(LLAMA2_TEMPLATE.into()),
        ..Opts::default()
    })
    .await;
    let g = &common::goldens()[0];
    let tok = g["greedy_ids"][1].as_u64().unwrap(); // "▁there"
    let eos = srv.state.eos_ids[0];
    let base = json!({"prompt": g["prompt"], "max_tokens": 64, "temperature": 0});
    let with = |extra| with_fields(&base, extra);
    let cases = [
        // The stop string that matched, as given, not the first of the list.
        (
            with(json!({"stop": ["zzz", "Lily. She"]})),
            "stop",
            json!("Lily. She"),
        ),
        (
            with(json!({"stop": "girl named", "include_stop_str_in_output": true})),
            "stop",
            json!("girl named"),
        ),
        (
            with(json!({"stop_token_ids": [tok], "stop": "zzz"})),
            "stop",
            json!(tok),
        ),
        (with(json!({"max_tokens": 3})), "length", Value::Null),
        (
            with(json!({"max_tokens": 3, "stop_token_ids": [eos]})),
            "length",
            Value::Null,
        ),
    ];
    for (body, finish, want) in cases {
        let v = completion(srv.addr, body.clone()).await;
        let c = &v["choices"][0];
        assert_eq!(c["finish_reason"], finish, "{body}: {v}");
        assert_eq!(c.get("stop_reason"), Some(&want), "{body}: {v}");
        let mut sb = body.clone();
        sb["stream"] = json!(true);
        let r = post(srv.addr, "/v1/completions", &sb).await;
        assert_eq!(streamed_stop_reason(&r, false), want, "streamed {body}");
    }
    // Chat: the same in the message's choice, and only in the last streamed chunk.
    let chat = json!({"messages": [{"role": "user", "content": "Once upon a time"}],
                      "max_tokens": 24, "temperature": 0});
    let v = post(srv.addr, "/v1/chat/completions", &chat).await.json();
    let text = v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
    assert_eq!(
        v["choices"][0].get("stop_reason"),
        Some(&Value::Null),
        "{v}"
    );
    let word = text
        .split_whitespace()
        .nth(2)
        .expect("three words of output")
        .to_owned();
    for (extra, want) in [
        (json!({}), Value::Null),
        (json!({"stop": [word.clone()]}), json!(word)),
    ] {
        let mut body = with_fields(&chat, extra);
        let v = post(srv.addr, "/v1/chat/completions", &body).await.json();
        assert_eq!(
            v["choices"][0].get("stop_reason"),
            Some(&want),
            "{body}: {v}"
        );
        body["stream"] = json!(true);
        let r = post(srv.addr, "/v1/chat/completions", &body).await;
        assert_eq!(streamed_stop_reason(&r, true), want, "streamed {body}");
    }
}

/// The engine ends a request with `Stop` for an EOS and for a stop token id alike; the frontend
/// tells them apart by the last token, as vLLM reports them: an EOS has no stop reason, even
/// when `stop_token_ids` lists it (vLLM checks EOS first), unless `ignore_eos`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_reason_is_null_for_eos_and_the_id_for_a_stop_token() {
    use baton_frontend::EngineEvent;
    use baton_scheduler::FinishReason;
    use common::EOS;
    // The model generates one token, then the first stop token id asked for, else its EOS.
    let (addr, task) = common::start_scripted(|req| {
        let last = req.stop_token_ids.first().copied().unwrap_or(EOS);
        let token = |token| EngineEvent::Token {
            token,
            cached_tokens: 0,
            logprob: 0.0,
            top: vec![],
            first: None,
        };
        vec![
            token(403),
            token(last),
            EngineEvent::Finished {
                reason: FinishReason::Stop,
                prompt_tokens: req.prompt.len(),
                output_tokens: 2,
                cached_tokens: 0,
            },
        ]
    })
    .await;
    for (extra, want) in [
        (json!({}), Value::Null),
        (json!({"stop_token_ids": [EOS]}), Value::Null),
        (
            json!({"stop_token_ids": [EOS], "ignore_eos": true}),
            json!(EOS),
        ),
        (json!({"stop_token_ids": [13, EOS]}), json!(13)),
    ] {
        let mut body = with_fields(&json!({"prompt": "a", "max_tokens": 8}), extra);
        let v = completion(addr, body.clone()).await;
        let c = &v["choices"][0];
        assert_eq!(c["finish_reason"], "stop", "{body}: {v}");
        assert_eq!(c.get("stop_reason"), Some(&want), "{body}: {v}");
        body["stream"] = json!(true);
        let r = post(addr, "/v1/completions", &body).await;
        assert_eq!(streamed_stop_reason(&r, false), want, "streamed {body}");
    }
    task.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn include_usage_adds_a_final_usage_chunk() {
    let srv = start(Opts {
        chat_template: Some(LLAMA2_TEMPLATE.into()),
        ..Opts::default()
    })
    .await;
    let body = json!({"prompt": "The cat", "max_tokens": 10, "temperature": 0, "stream": true,
                      "stream_options": {"include_usage": true}, "n": 2});
    let r = post(srv.addr, "/v1/completions", &body).await;
    let ev = r.events();
    assert_eq!(ev.last().unwrap(), "[DONE]");
    let usage: Value = serde_json::from_str(&ev[ev.len() - 2]).unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["prompt_tokens"], 4);
    assert_eq!(usage["usage"]["completion_tokens"], 20);
    assert_eq!(usage["usage"]["total_tokens"], 24);
    for e in &ev[..ev.len() - 2] {
        let v: Value = serde_json::from_str(e).unwrap();
        assert!(
            v.get("usage").is_none(),
            "only the last chunk carries usage: {e}"
        );
    }
    // Without include_usage there is no usage chunk.
    let body = json!({"prompt": "The cat", "max_tokens": 4, "stream": true});
    let r = post(srv.addr, "/v1/completions", &body).await;
    assert!(r.events().iter().all(|e| !e.contains("\"usage\"")));
    // continuous_usage_stats: each chunk carries its choice's usage so far, on completions
    // and chat; the final chunk still sums every choice.
    for (path, body) in [
        (
            "/v1/completions",
            json!({"prompt": "The cat", "max_tokens": 10, "temperature": 0, "n": 2}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "The cat"}], "max_tokens": 10,
                   "temperature": 0}),
        ),
    ] {
        let mut body = body;
        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true, "continuous_usage_stats": true});
        let r = post(srv.addr, path, &body).await;
        assert_eq!(r.status, 200, "{}", r.body);
        let ev = r.events();
        let mut last = [0u64; 2];
        let mut seen = 0;
        for e in &ev[..ev.len() - 2] {
            let v: Value = serde_json::from_str(e).unwrap();
            let Some(c) = v["choices"].get(0) else {
                continue;
            };
            if c["delta"]["role"].is_string() {
                continue;
            }
            let i = c["index"].as_u64().unwrap() as usize;
            let u = &v["usage"];
            assert!(u["prompt_tokens"].as_u64().unwrap() > 0, "{e}");
            let done = u["completion_tokens"].as_u64().unwrap();
            assert!(done >= last[i] && done <= 10, "{e}");
            last[i] = done;
            seen += 1;
        }
        assert!(seen > 0 && last.contains(&10), "{path}: {last:?}");
        let total: Value = serde_json::from_str(&ev[ev.len() - 2]).unwrap();
        assert_eq!(
            total["usage"]["completion_tokens"].as_u64(),
            Some(last.iter().sum::<u64>())
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_choices_use_consecutive_seeds_and_are_indexed() {
    let srv = start(Opts::default()).await;
    let body = json!({"prompt": "Lily wanted to", "max_tokens": 12, "temperature": 1.0,
                      "seed": 42, "n": 3});
    let v = completion(srv.addr, body).await;
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        let single = completion(
            srv.addr,
            json!({"prompt": "Lily wanted to", "max_tokens": 12, "temperature": 1.0,
                   "seed": 42 + i}),
        )
        .await;
        assert_eq!(
            c["text"], single["choices"][0]["text"],
            "choice {i} is seed 42+{i}"
        );
    }
    assert_eq!(v["usage"]["completion_tokens"], 36);
    assert_eq!(v["usage"]["prompt_tokens"], 5);
    // Streamed, the choices interleave but each one's text matches.
    let body = json!({"prompt": "Lily wanted to", "max_tokens": 12, "temperature": 1.0,
                      "seed": 42, "n": 3, "stream": true});
    let r = post(srv.addr, "/v1/completions", &body).await;
    let mut texts = vec![String::new(); 3];
    for e in r.events().iter().filter(|e| *e != "[DONE]") {
        let c: Value = serde_json::from_str(e).unwrap();
        for ch in c["choices"].as_array().unwrap() {
            texts[ch["index"].as_u64().unwrap() as usize].push_str(ch["text"].as_str().unwrap());
        }
    }
    for (i, t) in texts.iter().enumerate() {
        assert_eq!(t, choices[i]["text"].as_str().unwrap());
    }
    // Several prompts: choice index = prompt * n + j.
    let v = completion(
        srv.addr,
        json!({"prompt": ["The cat", "Once upon a time"], "n": 2,
                                          "max_tokens": 3, "temperature": 0}),
    )
    .await;
    let texts: Vec<_> = (0..4).map(|i| text_of(&v, i)).collect();
    assert_eq!(texts[0], texts[1]);
    assert_eq!(texts[2], texts[3]);
    assert_ne!(texts[0], texts[2]);
}

/// vLLM's `--generation-config auto`: a request that leaves a sampling field out gets the
/// model's default; one that sets it keeps its own value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generation_config_defaults_fill_only_what_a_request_leaves_out() {
    let plain = start(Opts::default()).await;
    let srv = start(Opts {
        sampling_defaults: baton_frontend::validate::SamplingDefaults {
            temperature: Some(0.0),
            top_k: Some(5),
            max_tokens: Some(7),
            ..Default::default()
        },
        chat_template: Some("{% for m in messages %}{{ m['content'] }}{% endfor %}".into()),
        ..Opts::default()
    })
    .await;
    let prompt = "Once upon a time";
    // Left out: greedy (temperature 0 by default) and 7 tokens, as asked for explicitly from
    // a server without defaults; `null` counts as left out.
    let greedy = completion(
        plain.addr,
        json!({"prompt": prompt, "temperature": 0, "max_tokens": 7, "ignore_eos": true}),
    )
    .await;
    for body in [
        json!({"prompt": prompt, "ignore_eos": true}),
        json!({"prompt": prompt, "ignore_eos": true, "temperature": null, "max_tokens": null}),
    ] {
        let got = completion(srv.addr, body.clone()).await;
        assert_eq!(text_of(&got, 0), text_of(&greedy, 0), "{body}");
        assert_eq!(got["usage"]["completion_tokens"], 7, "{body}");
    }
    // Chat takes them too (max_completion_tokens left out).
    let r = post(
        srv.addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "ignore_eos": true}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["usage"]["completion_tokens"], 7);
    // And the Responses API (max_output_tokens left out).
    let r = post(
        srv.addr,
        "/v1/responses",
        &json!({"input": "hi", "max_output_tokens": null}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["usage"]["output_tokens"], 7, "{}", r.body);
    // Set: the request's own values, including top_k 0 (off), win over the defaults.
    let sampled = json!({"prompt": prompt, "max_tokens": 24, "temperature": 1.2, "top_k": 0,
                         "seed": 11});
    assert_eq!(
        text_of(&completion(srv.addr, sampled.clone()).await, 0),
        text_of(&completion(plain.addr, sampled).await, 0)
    );
    // The top_k default applies to a sampled request that leaves it out.
    let no_k = json!({"prompt": prompt, "max_tokens": 24, "temperature": 1.2, "seed": 11});
    let mut with_k = no_k.clone();
    with_k["top_k"] = json!(5);
    assert_eq!(
        text_of(&completion(srv.addr, no_k).await, 0),
        text_of(&completion(plain.addr, with_k).await, 0)
    );
    // A max_tokens default never makes a request too long for the context: the output
    // stops at its end instead (a 5-token prompt in 8 positions: 3 tokens, not a 400).
    let short = start(Opts {
        sampling_defaults: baton_frontend::validate::SamplingDefaults {
            max_tokens: Some(7),
            ..Default::default()
        },
        max_model_len: Some(8),
        ..Opts::default()
    })
    .await;
    let got = completion(short.addr, json!({"prompt": prompt, "ignore_eos": true})).await;
    assert_eq!(got["usage"]["completion_tokens"], 3, "{got}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seeded_sampling_is_deterministic() {
    let srv = start(Opts::default()).await;
    let body = |seed: u64| {
        json!({"prompt": "Once upon a time", "max_tokens": 24,
                                  "temperature": 1.2, "top_p": 0.95, "top_k": 50, "min_p": 0.01,
                                  "seed": seed})
    };
    let a = completion(srv.addr, body(7)).await;
    let b = completion(srv.addr, body(7)).await;
    assert_eq!(text_of(&a, 0), text_of(&b, 0));
    let differs = [8u64, 9, 10, 11];
    let mut any_diff = false;
    for s in differs {
        any_diff |= text_of(&completion(srv.addr, body(s)).await, 0) != text_of(&a, 0);
    }
    assert!(any_diff, "other seeds give other samples");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprobs_are_reported_per_token_with_top_alternatives() {
    let srv = start(Opts::default()).await;
    let g = &common::goldens()[0];
    let body = json!({"prompt": g["prompt"], "max_tokens": 8, "temperature": 0, "logprobs": 3});
    let v = completion(srv.addr, body.clone()).await;
    let lp = &v["choices"][0]["logprobs"];
    let tokens = lp["tokens"].as_array().unwrap();
    assert_eq!(tokens.len(), 8);
    assert_eq!(tokens[0], ",");
    assert_eq!(tokens[1], " there");
    let joined: String = tokens.iter().map(|t| t.as_str().unwrap()).collect();
    assert_eq!(joined, text_of(&v, 0));
    for (i, t) in lp["token_logprobs"].as_array().unwrap().iter().enumerate() {
        let t = t.as_f64().unwrap();
        assert!(t <= 0.0);
        let top = lp["top_logprobs"][i].as_object().unwrap();
        assert!((3..=4).contains(&top.len()), "{top:?}");
        // Greedy: the sampled token is the most likely one.
        let best = top
            .values()
            .map(|x| x.as_f64().unwrap())
            .fold(f64::MIN, f64::max);
        assert!((best - t).abs() < 1e-5);
    }
    let offsets: Vec<u64> = lp["text_offset"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect();
    assert_eq!(offsets[..3], [0, 1, 7]);
    // Streamed chunks carry the same log-probabilities.
    let mut b = body;
    b["stream"] = json!(true);
    let r = post(srv.addr, "/v1/completions", &b).await;
    let mut streamed = Vec::new();
    for e in r.events().iter().filter(|e| *e != "[DONE]") {
        let c: Value = serde_json::from_str(e).unwrap();
        if let Some(l) = c["choices"][0]["logprobs"]["token_logprobs"].as_array() {
            streamed.extend(l.iter().cloned());
        }
    }
    assert_eq!(streamed, *lp["token_logprobs"].as_array().unwrap());
    // logprobs = 0: the sampled token only.
    let v = completion(
        srv.addr,
        json!({"prompt": "a", "max_tokens": 2, "logprobs": 0}),
    )
    .await;
    assert_eq!(
        v["choices"][0]["logprobs"]["top_logprobs"][0]
            .as_object()
            .unwrap()
            .len(),
        1
    );
    // Without logprobs: null.
    let v = completion(srv.addr, json!({"prompt": "a", "max_tokens": 2})).await;
    assert!(v["choices"][0]["logprobs"].is_null());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_prepends_the_prompt() {
    let srv = start(Opts::default()).await;
    let g = &common::goldens()[2];
    let body = json!({"prompt": g["prompt"], "max_tokens": 64, "temperature": 0, "echo": true});
    let v = completion(srv.addr, body.clone()).await;
    assert_eq!(text_of(&v, 0), g["full_text"].as_str().unwrap());
    let (streamed, _) = completion_stream(srv.addr, body).await;
    assert_eq!(streamed, g["full_text"].as_str().unwrap());
    // Token-id prompts echo their decoded text.
    let v = completion(
        srv.addr,
        json!({"prompt": g["prompt_ids"], "max_tokens": 64,
                                          "temperature": 0, "echo": true}),
    )
    .await;
    assert_eq!(text_of(&v, 0), g["full_text"].as_str().unwrap());
}

/// A `top_logprobs` entry in the order the server wrote it (`serde_json::Value` sorts keys).
#[derive(Debug, PartialEq)]
struct OrderedTop(Vec<(String, f64)>);

impl<'de> serde::Deserialize<'de> for OrderedTop {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = OrderedTop;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a map from token text to log-probability")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut m: A,
            ) -> Result<OrderedTop, A::Error> {
                let mut v = Vec::new();
                while let Some(e) = m.next_entry()? {
                    v.push(e);
                }
                Ok(OrderedTop(v))
            }
        }
        d.deserialize_map(V)
    }
}

/// The legacy completions `logprobs` object.
#[derive(Debug, Default, PartialEq, serde::Deserialize)]
struct Lp {
    tokens: Vec<String>,
    token_logprobs: Vec<Option<f64>>,
    top_logprobs: Vec<Option<OrderedTop>>,
    text_offset: Vec<usize>,
}

#[derive(Debug, serde::Deserialize)]
struct LpChoice {
    index: usize,
    text: String,
    logprobs: Lp,
    finish_reason: Option<String>,
}

#[derive(Debug, serde::Deserialize)]
struct LpBody {
    choices: Vec<LpChoice>,
}

async fn lp_completion(addr: std::net::SocketAddr, body: Value) -> LpBody {
    let r = post(addr, "/v1/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    serde_json::from_str(&r.body).unwrap_or_else(|e| panic!("{e}: {}", r.body))
}

/// A streamed completion's choices, each gathered from its chunks.
async fn lp_completion_stream(addr: std::net::SocketAddr, mut body: Value) -> Vec<LpChoice> {
    body["stream"] = json!(true);
    let r = post(addr, "/v1/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let mut out: Vec<LpChoice> = Vec::new();
    for e in r.events().iter().filter(|e| *e != "[DONE]") {
        let v: LpBody = serde_json::from_str(e).unwrap_or_else(|err| panic!("{err}: {e}"));
        for c in v.choices {
            while out.len() <= c.index {
                out.push(LpChoice {
                    index: out.len(),
                    text: String::new(),
                    logprobs: Lp::default(),
                    finish_reason: None,
                });
            }
            let o = &mut out[c.index];
            o.text.push_str(&c.text);
            o.logprobs.tokens.extend(c.logprobs.tokens);
            o.logprobs.token_logprobs.extend(c.logprobs.token_logprobs);
            o.logprobs.top_logprobs.extend(c.logprobs.top_logprobs);
            o.logprobs.text_offset.extend(c.logprobs.text_offset);
            if c.finish_reason.is_some() {
                o.finish_reason = c.finish_reason;
            }
        }
    }
    out
}

/// Checks an echoed choice's log-probabilities: `n_prompt` prompt tokens (BOS first) then
/// `n_out` outputs, the first entry null, every other scored with at most `k` alternatives
/// plus the token itself, most likely first, and offsets that index the choice's text.
fn check_echo_logprobs(c: &LpChoice, prompt: &str, n_prompt: usize, n_out: usize, k: usize) {
    let lp = &c.logprobs;
    let n = n_prompt + n_out;
    assert!(c.text.starts_with(prompt), "{c:?}");
    assert_eq!(lp.tokens.len(), n, "{lp:?}");
    assert_eq!(lp.token_logprobs.len(), n, "{lp:?}");
    assert_eq!(lp.top_logprobs.len(), n, "{lp:?}");
    assert_eq!(lp.text_offset.len(), n, "{lp:?}");
    assert_eq!(
        lp.token_logprobs[0], None,
        "the first token has no log-probability"
    );
    assert_eq!(lp.top_logprobs[0], None);
    assert_eq!(lp.tokens[0], "<s>", "BOS is listed");
    let prompt_tokens: String = lp.tokens[1..n_prompt].concat();
    assert_eq!(prompt_tokens.trim_start(), prompt);
    let output_tokens: String = lp.tokens[n_prompt..].concat();
    assert_eq!(format!("{prompt}{output_tokens}"), c.text);
    for i in 1..n {
        let x = lp.token_logprobs[i].unwrap_or_else(|| panic!("position {i} unscored: {lp:?}"));
        assert!(x.is_finite() && x <= 0.0, "position {i}: {x}");
        let top = &lp.top_logprobs[i].as_ref().expect("top entries").0;
        assert!(
            (k.max(1)..=k + 1).contains(&top.len()),
            "position {i}: {top:?}"
        );
        assert!(
            top.windows(2).all(|w| w[0].1 >= w[1].1),
            "position {i} not most likely first: {top:?}"
        );
        let own = top
            .iter()
            .find(|(t, _)| *t == lp.tokens[i])
            .unwrap_or_else(|| panic!("position {i}: {:?} not in {top:?}", lp.tokens[i]));
        // Two tokens may share a text; the entry keeps the more likely one.
        assert!(own.1 >= x - 1e-6, "position {i}: {own:?} vs {x}");
        assert!(own.1 - x < 1e-6 || top.len() > 1, "position {i}");
    }
    let chars: Vec<char> = c.text.chars().collect();
    assert_eq!(lp.text_offset[0], 0);
    assert!(lp.text_offset.windows(2).all(|w| w[0] <= w[1]), "{lp:?}");
    for i in 1..n {
        let off = lp.text_offset[i];
        assert!(off <= chars.len(), "offset {off} past the text");
        let rest: String = chars[off..].iter().collect();
        let t = &lp.tokens[i];
        assert!(
            rest.starts_with(t.as_str()) || (off == 0 && rest.starts_with(t.trim_start())),
            "token {i} {t:?} is not at offset {off} of {:?}",
            c.text
        );
    }
}

/// OpenAI `echo` with `logprobs` (what lm-evaluation-harness's loglikelihood tasks send): the
/// log-probabilities cover every prompt token, BOS included, then the outputs; the first
/// token's are null.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_with_logprobs_scores_every_prompt_token() {
    let srv = start(Opts::default()).await;
    for g in common::goldens() {
        let prompt = g["prompt"].as_str().unwrap();
        let n_prompt = g["prompt_ids"].as_array().unwrap().len();
        let body = json!({"prompt": prompt, "max_tokens": 1, "temperature": 0, "echo": true,
                          "logprobs": 2});
        let v = lp_completion(srv.addr, body).await;
        let c = &v.choices[0];
        check_echo_logprobs(c, prompt, n_prompt, 1, 2);
        // Greedy: the output token is the most likely one.
        let out = c.logprobs.token_logprobs[n_prompt].unwrap();
        let best = c.logprobs.top_logprobs[n_prompt].as_ref().unwrap().0[0].1;
        assert!((best - out).abs() < 1e-6, "{c:?}");
        // The same prompt as token ids scores the same.
        let body = json!({"prompt": g["prompt_ids"], "max_tokens": 1, "temperature": 0,
                          "echo": true, "logprobs": 2});
        let t = lp_completion(srv.addr, body).await;
        assert_eq!(
            t.choices[0].logprobs, c.logprobs,
            "token-id prompt {prompt:?}"
        );
        assert_eq!(t.choices[0].text, c.text);
    }
    // logprobs = 0: each prompt position lists the token alone.
    let body = json!({"prompt": "The cat", "max_tokens": 2, "echo": true, "logprobs": 0});
    let v = lp_completion(srv.addr, body).await;
    check_echo_logprobs(&v.choices[0], "The cat", 4, 2, 0);
    // Still bounded like logprobs.
    let body = json!({"prompt": "a", "echo": true, "logprobs": 21});
    let r = post(srv.addr, "/v1/completions", &body).await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.json()["error"]["param"], "logprobs");
    // Without logprobs, echo has none.
    let v = completion(
        srv.addr,
        json!({"prompt": "a", "max_tokens": 1, "echo": true}),
    )
    .await;
    assert!(v["choices"][0]["logprobs"].is_null(), "{v}");
    assert!(wait_engine_idle(&srv.engine, Duration::from_secs(5)).await);
}

/// A prompt position's log-probability is the one the model gave that token when it
/// generated it: greedy outputs of prompt P, scored again as prompt P + outputs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echoed_prompt_logprobs_equal_the_logprobs_the_tokens_were_generated_with() {
    let srv = start(Opts::default()).await;
    for g in common::goldens() {
        let ids: Vec<u64> = g["prompt_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect();
        let body = json!({"prompt": ids, "max_tokens": 8, "temperature": 0, "logprobs": 1});
        let v = completion(srv.addr, body).await;
        let gen: Vec<f64> = v["choices"][0]["logprobs"]["token_logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        assert_eq!(gen.len(), 8);
        let greedy: Vec<u64> = g["greedy_ids"].as_array().unwrap()[..8]
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect();
        let mut ext = ids.clone();
        ext.extend(&greedy);
        let body = json!({"prompt": ext, "max_tokens": 1, "temperature": 0, "echo": true,
                          "logprobs": 1});
        let e = lp_completion(srv.addr, body).await;
        let lp = &e.choices[0].logprobs;
        assert_eq!(lp.token_logprobs.len(), ext.len() + 1);
        for (j, want) in gen.iter().enumerate() {
            let got = lp.token_logprobs[ids.len() + j].unwrap();
            assert!(
                (got - want).abs() < 1e-4,
                "prompt {:?} output {j}: generated with {want}, scored {got}",
                g["prompt"]
            );
        }
    }
}

/// Streamed, the echoed prompt and its log-probabilities come with each choice's first chunk;
/// gathered, they equal the non-streamed response, for several prompts and n > 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_echo_logprobs_equal_the_non_streamed_ones() {
    let srv = start(Opts::default()).await;
    let goldens = common::goldens();
    let prompts = [goldens[0]["prompt"].clone(), goldens[2]["prompt"].clone()];
    let body = json!({"prompt": prompts, "n": 2, "max_tokens": 4, "temperature": 0,
                      "echo": true, "logprobs": 1});
    let v = lp_completion(srv.addr, body.clone()).await;
    assert_eq!(v.choices.len(), 4);
    for c in &v.choices {
        let g = &goldens[if c.index < 2 { 0 } else { 2 }];
        let n_prompt = g["prompt_ids"].as_array().unwrap().len();
        check_echo_logprobs(c, g["prompt"].as_str().unwrap(), n_prompt, 4, 1);
    }
    assert_eq!(v.choices[0].logprobs, v.choices[1].logprobs);
    assert_ne!(v.choices[0].logprobs, v.choices[2].logprobs);
    let streamed = lp_completion_stream(srv.addr, body).await;
    assert_eq!(streamed.len(), 4);
    for (s, c) in streamed.iter().zip(&v.choices) {
        assert_eq!(s.text, c.text, "choice {}", c.index);
        assert_eq!(s.logprobs, c.logprobs, "choice {}", c.index);
        assert_eq!(s.finish_reason, c.finish_reason);
    }
    assert!(wait_engine_idle(&srv.engine, Duration::from_secs(5)).await);
}

/// A text prompt that writes special tokens (`<s>`, `</s>` become ids 1 and 2) echoes them as
/// text, so their `text_offset` slices are that text, while the BOS the tokenizer adds takes
/// no room (the session-12 trial found the offsets drifting after such a token).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_offsets_cover_special_tokens_written_in_the_prompt() {
    let srv = start(Opts::default()).await;
    let prompt = "Once <s> upon</s> a time";
    let body = json!({"prompt": prompt, "max_tokens": 0, "echo": true, "logprobs": 0});
    let v = lp_completion(srv.addr, body).await;
    let c = &v.choices[0];
    assert_eq!(c.text, prompt);
    let chars: Vec<char> = c.text.chars().collect();
    let off = &c.logprobs.text_offset;
    assert_eq!(off[0], 0, "the added BOS");
    let slice = |i: usize| -> String {
        let end = off.get(i + 1).copied().unwrap_or(chars.len());
        chars[off[i]..end].iter().collect()
    };
    let specials: Vec<String> = (1..off.len())
        .filter(|&i| c.logprobs.tokens[i].starts_with('<'))
        .map(slice)
        .collect();
    assert_eq!(specials, ["<s>", "</s>"], "{c:?}");
    let all: String = (0..off.len()).map(slice).collect();
    assert_eq!(all, prompt, "the slices tile the text: {off:?}");
}

/// `max_tokens: 0` with `echo` scores the prompt without generating (what vLLM does, and what
/// some evaluation harnesses send): the text is the prompt, the log-probabilities are the
/// prompt's (equal to those of the same request with one output token), no completion token
/// is counted and the choice ends with `length`, streamed or not. Without `echo` it is a 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_tokens_0_with_echo_scores_the_prompt_alone() {
    let srv = start(Opts::default()).await;
    let g = &common::goldens()[1];
    let prompt = g["prompt"].as_str().unwrap();
    let n_prompt = g["prompt_ids"].as_array().unwrap().len();
    let body = |max: u32| {
        json!({"prompt": prompt, "max_tokens": max, "temperature": 0, "echo": true,
               "logprobs": 2})
    };
    let one = lp_completion(srv.addr, body(1)).await;
    let zero = lp_completion(srv.addr, body(0)).await;
    let c = &zero.choices[0];
    check_echo_logprobs(c, prompt, n_prompt, 0, 2);
    assert_eq!(c.text, prompt);
    assert_eq!(c.finish_reason.as_deref(), Some("length"));
    let full = &one.choices[0].logprobs;
    assert_eq!(c.logprobs.tokens[..], full.tokens[..n_prompt]);
    assert_eq!(
        c.logprobs.token_logprobs[..],
        full.token_logprobs[..n_prompt]
    );
    assert_eq!(c.logprobs.top_logprobs[..], full.top_logprobs[..n_prompt]);
    let v = completion(srv.addr, body(0)).await;
    assert_eq!(v["usage"]["completion_tokens"], 0, "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], n_prompt, "{v}");
    let streamed = lp_completion_stream(srv.addr, body(0)).await;
    assert_eq!(streamed.len(), 1);
    assert_eq!(streamed[0].text, c.text);
    assert_eq!(streamed[0].logprobs, c.logprobs);
    assert_eq!(streamed[0].finish_reason.as_deref(), Some("length"));
    // Echo without logprobs: the prompt alone.
    let v = completion(
        srv.addr,
        json!({"prompt": prompt, "max_tokens": 0, "echo": true}),
    )
    .await;
    assert_eq!(v["choices"][0]["text"], prompt, "{v}");
    let r = post(
        srv.addr,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 0}),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.json()["error"]["param"], "max_tokens");
    assert!(wait_engine_idle(&srv.engine, Duration::from_secs(5)).await);
}

/// A prompt that fills the context is scored with `max_tokens: 0` and `echo` (evaluation
/// harnesses send whole windows so; vLLM refuses only prompt plus `max_tokens` past the
/// limit): every position's log-probability arrives, equal to those of the same prompt less
/// its last token asked for one output token. Asking for a token, or leaving `max_tokens`
/// out, is still a 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_that_fills_the_context_is_scored_with_max_tokens_0() {
    let srv = start(Opts {
        max_model_len: Some(64),
        ..Opts::default()
    })
    .await;
    let ids: Vec<u32> = (0..64u32).map(|i| 3 + (i * 37) % 500).collect();
    let body = |ids: &[u32], max: Option<u32>| {
        let mut b = json!({"prompt": ids, "temperature": 0, "echo": true, "logprobs": 1});
        if let Some(m) = max {
            b["max_tokens"] = json!(m);
        }
        b
    };
    let full = lp_completion(srv.addr, body(&ids, Some(0))).await;
    let c = &full.choices[0];
    assert_eq!(c.logprobs.token_logprobs.len(), 64, "{c:?}");
    assert_eq!(c.finish_reason.as_deref(), Some("length"));
    let less = lp_completion(srv.addr, body(&ids[..63], Some(1))).await;
    assert_eq!(
        c.logprobs.token_logprobs[..63],
        less.choices[0].logprobs.token_logprobs[..63]
    );
    for max in [Some(1), None] {
        let r = post(srv.addr, "/v1/completions", &body(&ids, max)).await;
        assert_eq!(r.status, 400, "{max:?}: {}", r.body);
    }
    assert!(wait_engine_idle(&srv.engine, Duration::from_secs(5)).await);
}

/// A request that ends before every prompt position was scored reports what arrived (null
/// elsewhere) or its error; once every position arrived, the echo is sent before any token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_logprobs_of_a_request_that_ends_early_or_scores_all_first() {
    use baton_frontend::EngineEvent;
    use baton_scheduler::FinishReason;
    let (addr, task) = common::start_scripted(|req| {
        let plp = |pos: u32, logprob: f32| EngineEvent::PromptLogprob {
            pos,
            token: req.prompt.get(pos as usize).copied().unwrap_or(0),
            logprob,
            rank: 1,
            top: vec![],
        };
        let finished = |reason, output_tokens| EngineEvent::Finished {
            reason,
            prompt_tokens: req.prompt.len(),
            output_tokens,
            cached_tokens: 0,
        };
        match req.max_tokens {
            // Aborted after two positions (and stray positions, ignored).
            1 => vec![
                plp(1, -1.0),
                plp(0, -9.0),
                plp(2, -2.0),
                plp(99, -9.0),
                finished(FinishReason::Abort, 0),
            ],
            // The engine fails.
            2 => vec![plp(1, -1.0), EngineEvent::Error("boom".into())],
            // Every position, then one token.
            _ => vec![
                plp(1, -1.0),
                plp(2, -2.0),
                plp(3, -3.0),
                EngineEvent::Token {
                    token: 403,
                    cached_tokens: 0,
                    logprob: -0.5,
                    top: vec![],
                    first: None,
                },
                finished(FinishReason::Length, 1),
            ],
        }
    })
    .await;
    let prompt = json!([1, 403, 407, 261]);
    let body = |max: u32| {
        json!({"prompt": prompt, "max_tokens": max, "echo": true, "logprobs": 0,
               "temperature": 0})
    };
    let v = lp_completion(addr, body(1)).await;
    let c = &v.choices[0];
    assert_eq!(c.finish_reason.as_deref(), Some("abort"));
    assert_eq!(
        c.logprobs.token_logprobs,
        [None, Some(-1.0), Some(-2.0), None]
    );
    assert_eq!(c.logprobs.tokens.len(), 4);
    let s = lp_completion_stream(addr, body(1)).await;
    assert_eq!(s[0].logprobs, c.logprobs);
    assert_eq!(s[0].text, c.text);
    let r = post(addr, "/v1/completions", &body(2)).await;
    assert_eq!(r.status, 500, "{}", r.body);
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("boom"));
    // Complete: the echo chunk comes alone, before the token's.
    let mut b = body(3);
    b["stream"] = json!(true);
    let r = post(addr, "/v1/completions", &b).await;
    let ev = r.events();
    let first: Value = serde_json::from_str(&ev[0]).unwrap();
    assert_eq!(
        first["choices"][0]["logprobs"]["token_logprobs"],
        json!([null, -1.0, -2.0, -3.0]),
        "{}",
        r.body
    );
    let second: Value = serde_json::from_str(&ev[1]).unwrap();
    assert_eq!(
        second["choices"][0]["logprobs"]["token_logprobs"],
        json!([-0.5]),
        "{}",
        r.body
    );
    let v = lp_completion(addr, body(3)).await;
    assert_eq!(
        v.choices[0].logprobs.token_logprobs,
        [None, Some(-1.0), Some(-2.0), Some(-3.0), Some(-0.5)]
    );
    task.abort();
}

/// A JSON object's entries in the order they were sent.
#[derive(Debug, PartialEq)]
struct Ordered<T>(Vec<(String, T)>);

impl<'de, T: serde::Deserialize<'de>> serde::Deserialize<'de> for Ordered<T> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<T>(std::marker::PhantomData<T>);
        impl<'de, T: serde::Deserialize<'de>> serde::de::Visitor<'de> for V<T> {
            type Value = Ordered<T>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut m: A,
            ) -> Result<Ordered<T>, A::Error> {
                let mut v = Vec::new();
                while let Some(e) = m.next_entry()? {
                    v.push(e);
                }
                Ok(Ordered(v))
            }
        }
        d.deserialize_map(V(std::marker::PhantomData))
    }
}

/// One token of vLLM's `prompt_logprobs` at one position.
#[derive(Debug, PartialEq, serde::Deserialize)]
struct PlpEntry {
    logprob: f64,
    rank: u64,
    decoded_token: String,
}

/// vLLM's `prompt_logprobs` list: per position, token id (as a string) to its entry.
type Plp = Vec<Option<Ordered<PlpEntry>>>;

/// The `prompt_logprobs` of a response body, entries in the order sent: choice `i`'s, or with
/// `None` the top-level one (chat).
fn plp_in(body: &str, choice: Option<usize>) -> Plp {
    #[derive(serde::Deserialize)]
    struct C {
        prompt_logprobs: Option<Plp>,
    }
    #[derive(serde::Deserialize)]
    struct B {
        prompt_logprobs: Option<Plp>,
        choices: Vec<C>,
    }
    let mut b: B = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"));
    match choice {
        Some(i) => b.choices.swap_remove(i).prompt_logprobs,
        None => b.prompt_logprobs,
    }
    .unwrap_or_else(|| panic!("no prompt_logprobs: {body}"))
}

/// A 200 from `path`: the JSON and the raw body (whose object entries keep their order).
async fn post_ok(addr: std::net::SocketAddr, path: &str, body: Value) -> (Value, String) {
    let r = post(addr, path, &body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    (r.json(), r.body)
}

fn ids_of(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

/// Checks vLLM's `prompt_logprobs` of prompt `ids` with `k` alternatives: one entry per
/// token, the first null; each position lists the prompt token first with its rank (its place
/// in the top list when it is there), then the top `k` ranked 1 to `k`, the rank-1 entry the
/// most likely, and alternatives at least as likely as a prompt token ranked below them.
fn check_plp(plp: &Plp, ids: &[u64], k: usize) {
    assert_eq!(plp.len(), ids.len(), "{plp:?}");
    assert!(plp[0].is_none(), "the first token has none: {plp:?}");
    for (i, p) in plp.iter().enumerate().skip(1) {
        let p = &p
            .as_ref()
            .unwrap_or_else(|| panic!("position {i} unscored"))
            .0;
        let (own_id, own) = &p[0];
        assert_eq!(*own_id, ids[i].to_string(), "position {i}: {p:?}");
        assert!(own.rank >= 1, "position {i}: {p:?}");
        assert!(own.logprob.is_finite() && own.logprob <= 0.0, "{p:?}");
        let in_top = own.rank as usize <= k;
        assert_eq!(
            p.len(),
            if in_top { k } else { k + 1 },
            "position {i}: {p:?}"
        );
        let mut keys: Vec<&String> = p.iter().map(|e| &e.0).collect();
        keys.sort();
        keys.dedup();
        assert_eq!(keys.len(), p.len(), "a token listed twice at {i}: {p:?}");
        // Ranks 1..=k each once among the top entries (the prompt token's included when in
        // the top).
        let mut ranks: Vec<u64> = p
            .iter()
            .skip(usize::from(!in_top))
            .map(|e| e.1.rank)
            .collect();
        ranks.sort_unstable();
        assert_eq!(
            ranks,
            (1..=k as u64).collect::<Vec<_>>(),
            "position {i}: {p:?}"
        );
        let mut by_rank: Vec<&PlpEntry> = p.iter().map(|e| &e.1).collect();
        by_rank.sort_by_key(|e| e.rank);
        assert!(
            by_rank.windows(2).all(|w| w[0].logprob >= w[1].logprob),
            "position {i}: not most likely first by rank: {p:?}"
        );
        let best = p.iter().map(|e| e.1.logprob).fold(f64::MIN, f64::max);
        assert_eq!(
            by_rank[0].logprob, best,
            "position {i}: rank 1 is the max: {p:?}"
        );
        if !in_top {
            assert!(
                p[1..].iter().all(|e| e.1.logprob >= own.logprob),
                "position {i}: {p:?}"
            );
        }
        // Token ids that parse, with their text.
        for (id, e) in p {
            assert!(id.parse::<u32>().is_ok(), "{id}");
            assert!(!e.decoded_token.is_empty() || id == "0", "{p:?}");
        }
    }
}

/// vLLM's `prompt_logprobs: k` on `/v1/completions`: per choice, one entry per prompt token
/// (BOS included, first null) with the prompt token's log-probability (the one `echo` with
/// `logprobs` reports), its rank, and the top `k`; together with `echo` and `logprobs` the
/// echoed log-probabilities are unchanged; without it the field is left out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_logprobs_list_the_prompt_tokens_with_ranks_and_top_alternatives() {
    let srv = start(Opts::default()).await;
    for g in common::goldens() {
        let prompt = g["prompt"].as_str().unwrap();
        let ids = ids_of(&g["prompt_ids"]);
        let base = json!({"prompt": prompt, "max_tokens": 2, "temperature": 0});
        let echo = lp_completion(
            srv.addr,
            with_fields(&base, json!({"echo": true, "logprobs": 2})),
        )
        .await;
        let elp = &echo.choices[0].logprobs;
        let (v, raw) = post_ok(
            srv.addr,
            "/v1/completions",
            with_fields(&base, json!({"prompt_logprobs": 2, "n": 2})),
        )
        .await;
        let c = &v["choices"][0];
        assert!(c["logprobs"].is_null(), "{v}");
        assert!(!c["text"].as_str().unwrap().starts_with(prompt), "no echo");
        let plp = plp_in(&raw, Some(0));
        check_plp(&plp, &ids, 2);
        assert_eq!(plp, plp_in(&raw, Some(1)), "the choices share the prompt");
        for (i, p) in plp.iter().enumerate().skip(1) {
            let p = &p.as_ref().unwrap().0;
            let want = elp.token_logprobs[i].unwrap();
            assert!(
                (p[0].1.logprob - want).abs() < 1e-6,
                "position {i}: {p:?} vs echo {want}"
            );
            assert_eq!(p[0].1.decoded_token, elp.tokens[i], "position {i}");
            let best = elp.top_logprobs[i].as_ref().unwrap().0[0].1;
            let rank1 = p.iter().find(|e| e.1.rank == 1).unwrap();
            assert!((rank1.1.logprob - best).abs() < 1e-6, "position {i}: {p:?}");
        }
        // Both at once: the echo is as without prompt_logprobs (its own number of
        // alternatives), and prompt_logprobs has its own.
        let (_, raw) = post_ok(
            srv.addr,
            "/v1/completions",
            with_fields(
                &base,
                json!({"echo": true, "logprobs": 2, "prompt_logprobs": 4}),
            ),
        )
        .await;
        let both: LpBody = serde_json::from_str(&raw).unwrap();
        assert_eq!(both.choices[0].logprobs, *elp, "{prompt:?}");
        assert_eq!(both.choices[0].text, echo.choices[0].text);
        let plp4 = plp_in(&raw, Some(0));
        check_plp(&plp4, &ids, 4);
        // No alternatives: the prompt token alone, with the same log-probability and rank.
        let (_, raw) = post_ok(
            srv.addr,
            "/v1/completions",
            with_fields(&base, json!({"prompt_logprobs": 0})),
        )
        .await;
        let plp0 = plp_in(&raw, Some(0));
        check_plp(&plp0, &ids, 0);
        for (i, (p0, p4)) in plp0.iter().zip(&plp4).enumerate().skip(1) {
            let (p0, p4) = (&p0.as_ref().unwrap().0, &p4.as_ref().unwrap().0);
            assert_eq!(p0[0].0, p4[0].0, "position {i}");
            assert!((p0[0].1.logprob - p4[0].1.logprob).abs() < 1e-6);
            if p0[0].1.rank <= 4 {
                assert_eq!(p0[0].1.rank, p4[0].1.rank, "position {i}: {p0:?} {p4:?}");
            }
        }
        assert!(echo.choices[0].finish_reason.is_some());
    }
    // Not asked (or null): no field.
    let v = completion(srv.addr, json!({"prompt": "a", "max_tokens": 1})).await;
    assert!(v["choices"][0].get("prompt_logprobs").is_none(), "{v}");
    let v = completion(
        srv.addr,
        json!({"prompt": "a", "max_tokens": 1, "prompt_logprobs": null}),
    )
    .await;
    assert!(v["choices"][0].get("prompt_logprobs").is_none(), "{v}");
    assert!(wait_engine_idle(&srv.engine, Duration::from_secs(5)).await);
}

/// The rank is the prompt token's rank in the vocabulary: 1 where the token is the model's
/// greedy choice (a prompt extended by its own greedy continuation), and where it is in the
/// top 20, its place there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_logprobs_rank_greedy_tokens_first_and_agree_with_the_top_list() {
    let srv = start(Opts::default()).await;
    let mut below_first = 0;
    for g in common::goldens() {
        let ids = ids_of(&g["prompt_ids"]);
        let mut ext = ids.clone();
        ext.extend(&ids_of(&g["greedy_ids"])[..8]);
        let plp = |k: u32| {
            let body = json!({"prompt": ext, "max_tokens": 1, "prompt_logprobs": k});
            async move { plp_in(&post_ok(srv.addr, "/v1/completions", body).await.1, Some(0)) }
        };
        let (p0, p20) = (plp(0).await, plp(20).await);
        check_plp(&p0, &ext, 0);
        check_plp(&p20, &ext, 20);
        for i in 1..ext.len() {
            let own = &p0[i].as_ref().unwrap().0[0].1;
            let top = &p20[i].as_ref().unwrap().0;
            if i >= ids.len() {
                assert_eq!(own.rank, 1, "greedy token at {i}: {own:?}");
                assert_eq!(top[0].1.rank, 1, "greedy token at {i}: {top:?}");
            }
            if own.rank > 1 {
                below_first += 1;
            }
            // The engine's rank (k = 0) is the token's place in the top 20, or past it.
            if own.rank <= 20 {
                assert_eq!(top.len(), 20, "position {i}: {top:?}");
                assert_eq!(top[0].1.rank, own.rank, "position {i}: {own:?} {top:?}");
            } else {
                assert_eq!(top.len(), 21, "position {i}: {top:?}");
                assert_eq!(top[0].1.rank, own.rank);
            }
        }
    }
    assert!(
        below_first > 0,
        "every prompt token was the most likely one"
    );
}

/// On `/v1/chat/completions`, `prompt_logprobs` is one list at the top level for the rendered
/// prompt (the choices share it), one entry per prompt token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_prompt_logprobs_cover_the_templated_prompt_at_the_top_level() {
    let srv = start(Opts {
        chat_template: Some(LLAMA2_TEMPLATE.into()),
        ..Opts::default()
    })
    .await;
    let messages = json!([{"role": "system", "content": "Tell a story."},
                          {"role": "user", "content": "Once upon a time"}]);
    let body = json!({"messages": messages, "max_tokens": 3, "n": 2, "prompt_logprobs": 1});
    let (v, raw) = post_ok(srv.addr, "/v1/chat/completions", body).await;
    let t = post(srv.addr, "/tokenize", &json!({"messages": messages})).await;
    let ids = ids_of(&t.json()["tokens"]);
    assert_eq!(v["usage"]["prompt_tokens"], ids.len());
    let plp = plp_in(&raw, None);
    check_plp(&plp, &ids, 1);
    assert_eq!(v["choices"].as_array().unwrap().len(), 2);
    assert!(v["choices"][0].get("prompt_logprobs").is_none(), "{v}");
    // Not asked: no field.
    let body = json!({"messages": messages, "max_tokens": 3});
    let v = post(srv.addr, "/v1/chat/completions", &body).await.json();
    assert!(v.get("prompt_logprobs").is_none(), "{v}");
    assert!(wait_engine_idle(&srv.engine, Duration::from_secs(5)).await);
}

/// `prompt_logprobs` outside 0..=20 (vLLM's -1, the whole vocabulary, included), of the
/// wrong type, or with `stream` is a 400 naming it, on both endpoints.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_prompt_logprobs_are_a_400_naming_them() {
    let srv = start(Opts {
        chat_template: Some(LLAMA2_TEMPLATE.into()),
        ..Opts::default()
    })
    .await;
    let bodies = [
        ("/v1/completions", json!({"prompt": "a", "max_tokens": 1})),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "a"}], "max_tokens": 1}),
        ),
    ];
    for (path, base) in &bodies {
        for bad in [
            json!({"prompt_logprobs": -1}),
            json!({"prompt_logprobs": 21}),
            json!({"prompt_logprobs": "x"}),
            json!({"prompt_logprobs": 1.5}),
            json!({"prompt_logprobs": 1, "stream": true}),
            json!({"prompt_logprobs": 0, "stream": true}),
        ] {
            let r = post(srv.addr, path, &with_fields(base, bad.clone())).await;
            assert_eq!(r.status, 400, "{path} {bad}: {}", r.body);
            assert_eq!(r.json()["error"]["param"], "prompt_logprobs", "{}", r.body);
        }
        let r = post(
            srv.addr,
            path,
            &with_fields(base, json!({"prompt_logprobs": 20})),
        )
        .await;
        assert_eq!(r.status, 200, "{path}: {}", r.body);
    }
    let r = post(
        srv.addr,
        "/v1/completions",
        &json!({"prompt": "a", "prompt_logprobs": 1, "stream": true}),
    )
    .await;
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("not available when 'stream' is true"),
        "{}",
        r.body
    );
}

/// Positions the engine did not report (a request that ended early) are null; each position
/// lists the scored token first with its rank (its place in the top list when there), then
/// the first `k` top entries ranked by place, the scored token once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_logprobs_of_a_request_that_ends_early_are_null_where_unscored() {
    use baton_frontend::EngineEvent;
    use baton_scheduler::FinishReason;
    let (addr, task) = common::start_scripted(|req| {
        let plp = |pos: u32, logprob: f32, rank, top: Vec<(u32, f32)>| EngineEvent::PromptLogprob {
            pos,
            token: req.prompt[pos as usize],
            logprob,
            rank,
            top,
        };
        vec![
            plp(1, -0.25, 1, vec![(403, -0.25), (5, -1.5)]),
            plp(2, -2.5, 9, vec![(5, -0.5), (6, -0.75)]),
            EngineEvent::Finished {
                reason: FinishReason::Abort,
                prompt_tokens: req.prompt.len(),
                output_tokens: 0,
                cached_tokens: 0,
            },
        ]
    })
    .await;
    let body =
        |k: u32| json!({"prompt": [1, 403, 407, 261], "max_tokens": 1, "prompt_logprobs": k});
    let (v, raw) = post_ok(addr, "/v1/completions", body(2)).await;
    assert_eq!(v["choices"][0]["finish_reason"], "abort");
    let got: Vec<Option<Vec<(String, f64, u64)>>> = plp_in(&raw, Some(0))
        .into_iter()
        .map(|p| {
            p.map(|p| {
                p.0.into_iter()
                    .map(|(id, e)| (id, e.logprob, e.rank))
                    .collect()
            })
        })
        .collect();
    let e = |id: &str, lp: f64, rank: u64| (id.to_owned(), lp, rank);
    assert_eq!(
        got,
        [
            None,
            Some(vec![e("403", -0.25, 1), e("5", -1.5, 2)]),
            Some(vec![e("407", -2.5, 9), e("5", -0.5, 1), e("6", -0.75, 2)]),
            None,
        ]
    );
    // One alternative: the first of the top list.
    let plp = plp_in(&post_ok(addr, "/v1/completions", body(1)).await.1, Some(0));
    let ids: Vec<Vec<&str>> = plp[1..3]
        .iter()
        .map(|p| p.as_ref().unwrap().0.iter().map(|e| e.0.as_str()).collect())
        .collect();
    assert_eq!(ids, [vec!["403"], vec!["407", "5"]]);
    task.abort();
}

/// An empty string prompt is the BOS alone (vLLM and OpenAI accept it): unconditional
/// generation, the same as `[BOS]` given as token ids.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_string_prompt_generates_from_the_bos_alone() {
    let srv = start(Opts::default()).await;
    let body = |prompt: Value| json!({"prompt": prompt, "max_tokens": 8, "temperature": 0});
    let v = completion(srv.addr, body(json!(""))).await;
    assert_eq!(v["usage"]["prompt_tokens"], 1, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 8, "{v}");
    let bos = completion(srv.addr, body(json!([1]))).await;
    assert_eq!(text_of(&v, 0), text_of(&bos, 0));
    assert!(!text_of(&v, 0).is_empty());
}

/// As vLLM's pydantic request models (lax mode): numbers in strings and boolean words are read
/// as the field's type, so the same request written with strings gives the same output.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn numeric_strings_and_boolean_words_read_as_pydantic_lax_mode_does() {
    let srv = start_chat(Opts::default()).await;
    let g = &common::goldens()[0];
    let prompt = g["prompt"].as_str().unwrap();
    let typed = json!({"prompt": prompt, "max_tokens": 5, "temperature": 0, "logprobs": 1,
                       "echo": false, "stream": false, "return_token_ids": true});
    let lax = json!({"prompt": prompt, "max_tokens": " 5", "temperature": "0.0", "logprobs": "1",
                     "echo": "off", "stream": 0, "return_token_ids": "Yes"});
    let (want, _) = post_ok(srv.addr, "/v1/completions", typed).await;
    let (got, body) = post_ok(srv.addr, "/v1/completions", lax).await;
    assert_eq!(text_of(&got, 0), text_of(&want, 0), "{body}");
    assert_eq!(
        got["choices"][0]["token_ids"],
        want["choices"][0]["token_ids"]
    );
    assert_eq!(
        got["choices"][0]["logprobs"],
        want["choices"][0]["logprobs"]
    );
    assert_eq!(got["usage"]["completion_tokens"], 5, "{body}");
    // Chat too, with a boolean word for `logprobs` and a number string for `top_logprobs`.
    let msgs = json!([{"role": "user", "content": prompt}]);
    let (want, _) = post_ok(
        srv.addr,
        "/v1/chat/completions",
        json!({"messages": msgs, "max_tokens": 3, "temperature": 0, "logprobs": true,
               "top_logprobs": 2}),
    )
    .await;
    let (got, body) = post_ok(
        srv.addr,
        "/v1/chat/completions",
        json!({"messages": msgs, "max_tokens": "3", "temperature": "0", "logprobs": "true",
               "top_logprobs": "2"}),
    )
    .await;
    assert_eq!(
        got["choices"][0]["message"], want["choices"][0]["message"],
        "{body}"
    );
    assert_eq!(
        got["choices"][0]["logprobs"], want["choices"][0]["logprobs"],
        "{body}"
    );
    // What lax mode does not read stays a 400 naming the field.
    for (field, bad) in [
        ("max_tokens", json!("5.5")),
        ("temperature", json!("warm")),
        ("temperature", json!("nan")),
        ("stream", json!("sometimes")),
        ("echo", json!(2)),
    ] {
        let body = with_fields(&json!({"prompt": prompt}), json!({ field: bad }));
        let r = post(srv.addr, "/v1/completions", &body).await;
        assert_eq!(r.status, 400, "{field}={bad}: {}", r.body);
        assert_eq!(r.json()["error"]["param"], field, "{}", r.body);
    }
    // An integer past u32 is named as sent, not clamped.
    let body = json!({"prompt": prompt, "min_tokens": "4294967296"});
    let r = post(srv.addr, "/v1/completions", &body).await;
    assert_eq!(r.status, 400, "{}", r.body);
    let msg = r.json()["error"]["message"].as_str().unwrap().to_owned();
    assert!(msg.contains("got 4294967296"), "{msg}");
    assert!(wait_engine_idle(&srv.engine, Duration::from_secs(5)).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_4xx_with_an_openai_error_body() {
    let srv = start(Opts {
        max_model_len: Some(128),
        ..Opts::default()
    })
    .await;
    let long = "Once upon a time ".repeat(60);
    let cases: Vec<(&str, String, u16, Option<&str>)> = vec![
        ("/v1/completions", "{not json".into(), 400, None),
        ("/v1/completions", "[1,2]".into(), 400, None),
        (
            "/v1/completions",
            json!({"max_tokens": 3}).to_string(),
            400,
            Some("prompt"),
        ),
        (
            // Empty after tokenization ("" alone gets a BOS, as in vLLM).
            "/v1/completions",
            json!({"prompt": "", "add_special_tokens": false}).to_string(),
            400,
            Some("prompt"),
        ),
        (
            "/v1/completions",
            json!({"prompt": []}).to_string(),
            400,
            Some("prompt"),
        ),
        (
            "/v1/completions",
            json!({"prompt": [[]]}).to_string(),
            400,
            Some("prompt"),
        ),
        (
            "/v1/completions",
            json!({"prompt": [1, 99999]}).to_string(),
            400,
            Some("prompt"),
        ),
        (
            "/v1/completions",
            json!({"prompt": [1, -3]}).to_string(),
            400,
            Some("prompt"),
        ),
        (
            "/v1/completions",
            json!({"prompt": 5}).to_string(),
            400,
            Some("prompt"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "n": 0}).to_string(),
            400,
            Some("n"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "n": "two"}).to_string(),
            400,
            Some("n"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "max_tokens": -1}).to_string(),
            400,
            Some("max_tokens"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "max_tokens": 0}).to_string(),
            400,
            Some("max_tokens"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "max_tokens": 1.5}).to_string(),
            400,
            Some("max_tokens"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "logprobs": 1, "top_logprobs": 3}).to_string(),
            400,
            Some("top_logprobs"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "max_tokens": 200}).to_string(),
            400,
            Some("max_tokens"),
        ),
        (
            "/v1/completions",
            json!({"prompt": long, "max_tokens": 1}).to_string(),
            400,
            Some("prompt"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "top_p": 0}).to_string(),
            400,
            Some("top_p"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "top_p": 1.5}).to_string(),
            400,
            Some("top_p"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "temperature": -0.5}).to_string(),
            400,
            Some("temperature"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "temperature": "hot"}).to_string(),
            400,
            Some("temperature"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "top_k": -2}).to_string(),
            400,
            Some("top_k"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "min_p": 2}).to_string(),
            400,
            Some("min_p"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "logprobs": 21}).to_string(),
            400,
            Some("logprobs"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "logprobs": true}).to_string(),
            400,
            Some("logprobs"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "stop": 3}).to_string(),
            400,
            Some("stop"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "stop_token_ids": [100000]}).to_string(),
            400,
            Some("stop_token_ids"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "stream": "sometimes"}).to_string(),
            400,
            Some("stream"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "stream_options": {"include_usage": true}}).to_string(),
            400,
            Some("stream_options"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "presence_penalty": 2.5}).to_string(),
            400,
            Some("presence_penalty"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "frequency_penalty": -3}).to_string(),
            400,
            Some("frequency_penalty"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "repetition_penalty": 0}).to_string(),
            400,
            Some("repetition_penalty"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "repetition_penalty": 1e-300}).to_string(),
            400,
            Some("repetition_penalty"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "repetition_penalty": "high"}).to_string(),
            400,
            Some("repetition_penalty"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "user": 5}).to_string(),
            400,
            Some("user"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "logit_bias": {"abc": 1}}).to_string(),
            400,
            Some("logit_bias"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "logit_bias": {"100000": 1}}).to_string(),
            400,
            Some("logit_bias"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "logit_bias": {"5": "x"}}).to_string(),
            400,
            Some("logit_bias"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "logit_bias": [1, 2]}).to_string(),
            400,
            Some("logit_bias"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "logit_bias": (0..301)
                .map(|i| (i.to_string(), json!(1)))
                .collect::<serde_json::Map<_, _>>()})
            .to_string(),
            400,
            Some("logit_bias"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "seed": "x"}).to_string(),
            400,
            Some("seed"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "model": "gpt-4"}).to_string(),
            404,
            Some("model"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}]}).to_string(),
            400,
            None,
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user"}]}).to_string(),
            400,
            Some("messages[0].content"),
        ),
        ("/v1/nope", "{}".into(), 404, None),
    ];
    for (path, body, status, param) in cases {
        let r = send(srv.addr, "POST", path, &[], &body).await;
        assert_eq!(r.status, status, "{path} {body}: {}", r.body);
        let v = r.json();
        let e = &v["error"];
        assert!(
            e["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{body}: {v}"
        );
        assert!(e["type"].is_string(), "{body}: {v}");
        assert_eq!(e["code"], status, "{body}: {v}");
        assert_eq!(e["param"].as_str(), param, "{body}: {v}");
    }
    // A wrong method gets a 405 with an OpenAI error body, not an empty one.
    let r = get(srv.addr, "/v1/completions").await;
    assert_eq!(r.status, 405, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], 405, "{}", r.body);
    // A stream that cannot start is refused before it starts.
    let r = post(
        srv.addr,
        "/v1/completions",
        &json!({"prompt": "a", "stream": true, "max_tokens": 1000}),
    )
    .await;
    assert_eq!(r.status, 400);
    assert!(r
        .header("content-type")
        .unwrap()
        .starts_with("application/json"));
    // The server still works.
    let v = completion(srv.addr, json!({"prompt": "a", "max_tokens": 2})).await;
    assert_eq!(v["usage"]["completion_tokens"], 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_max_tokens_defaults_to_16_clipped_to_the_room_left() {
    let srv = start(Opts {
        max_model_len: Some(32),
        ..Opts::default()
    })
    .await;
    let v = completion(srv.addr, json!({"prompt": "The cat", "ignore_eos": true})).await;
    assert_eq!(v["usage"]["completion_tokens"], 16);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    let ids: Vec<u32> = (100..125).collect();
    let v = completion(srv.addr, json!({"prompt": ids, "ignore_eos": true})).await;
    assert_eq!(v["usage"]["completion_tokens"], 7);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_max_tokens_defaults_to_the_room_left_in_the_context() {
    let srv = start(Opts {
        max_model_len: Some(48),
        chat_template: Some(LLAMA2_TEMPLATE.into()),
        ..Opts::default()
    })
    .await;
    let body = json!({"messages": [{"role": "user", "content": "Hi"}], "ignore_eos": true});
    let r = post(srv.addr, "/v1/chat/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let used = v["usage"]["prompt_tokens"].as_u64().unwrap()
        + v["usage"]["completion_tokens"].as_u64().unwrap();
    assert_eq!(used, 48, "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_with_a_template_generates_and_streams_the_same_text() {
    let srv = start(Opts {
        chat_template: Some(LLAMA2_TEMPLATE.into()),
        ..Opts::default()
    })
    .await;
    let body = json!({"model": MODEL, "messages": [
        {"role": "system", "content": "Tell a story."},
        {"role": "user", "content": [{"type": "text", "text": "Once upon a time"}]}],
        "max_completion_tokens": 20, "temperature": 0, "logprobs": true, "top_logprobs": 2});
    let r = post(srv.addr, "/v1/chat/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    let msg = &v["choices"][0]["message"];
    assert_eq!(msg["role"], "assistant");
    let text = msg["content"].as_str().unwrap().to_owned();
    assert!(!text.is_empty());
    let lp = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(lp.len(), 20);
    assert_eq!(lp[0]["top_logprobs"].as_array().unwrap().len(), 2);
    assert!(lp[0]["bytes"].is_array());
    // The prompt is the rendered template.
    let t = post(
        srv.addr,
        "/tokenize",
        &json!({"messages": body["messages"]}),
    )
    .await
    .json();
    assert_eq!(v["usage"]["prompt_tokens"], t["count"]);
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    sb["stream_options"] = json!({"include_usage": true});
    let r = post(srv.addr, "/v1/chat/completions", &sb).await;
    let (streamed, finish) = stream_text(&r, true);
    assert_eq!(streamed, text);
    assert_eq!(finish.as_deref(), Some("length"));
    let ev = r.events();
    let first: Value = serde_json::from_str(&ev[0]).unwrap();
    assert_eq!(first["object"], "chat.completion.chunk");
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    let usage: Value = serde_json::from_str(&ev[ev.len() - 2]).unwrap();
    assert_eq!(usage["usage"]["completion_tokens"], 20);
    // raise_exception in the template is a 400 that names the messages.
    let r = post(
        srv.addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "robot", "content": "x"}]}),
    )
    .await;
    assert_eq!(r.status, 400);
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("Unknown role: robot"));
    // top_logprobs without logprobs is refused.
    let r = post(
        srv.addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}),
    )
    .await;
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["param"], "top_logprobs");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_without_any_template_is_a_clear_400() {
    let srv = start(Opts::default()).await;
    let r = post(
        srv.addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    assert_eq!(r.status, 400);
    let m = r.json()["error"]["message"].as_str().unwrap().to_owned();
    assert!(m.contains("chat template"), "{m}");
}

/// Reads from `s` until `n` SSE events arrived.
/// Opens a connection and sends a `/v1/completions` request with `body`, without reading.
async fn post_raw(addr: std::net::SocketAddr, body: &str) -> tokio::net::TcpStream {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(&common::request_bytes("POST", "/v1/completions", &[], body))
        .await
        .unwrap();
    s
}

async fn read_events(s: &mut tokio::net::TcpStream, n: usize) -> String {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    while String::from_utf8_lossy(&buf).matches("data: ").count() < n {
        let k = tokio::time::timeout(Duration::from_secs(30), s.read(&mut chunk))
            .await
            .expect("data within 30 s")
            .expect("reads");
        assert!(
            k > 0,
            "stream ended early: {}",
            String::from_utf8_lossy(&buf)
        );
        buf.extend_from_slice(&chunk[..k]);
    }
    String::from_utf8_lossy(&buf).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_mid_stream_cancels_and_the_pool_returns_to_full() {
    let srv = start(Opts {
        step_delay: Some(Duration::from_millis(3)),
        ..Opts::default()
    })
    .await;
    let total = srv.engine.scheduler_stats().pool.total;
    let body = json!({"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": true,
                      "stream": true, "n": 2})
    .to_string();
    let mut s = post_raw(srv.addr, &body).await;
    let head = read_events(&mut s, 4).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let st = srv.engine.scheduler_stats();
    assert!(
        st.running + st.waiting == 2,
        "both sequences are live: {st:?}"
    );
    assert!(st.pool.free < total, "pages are in use: {st:?}");
    drop(s);
    let at_drop = srv.engine.scheduler_stats().launches;
    assert!(
        wait_engine_idle(&srv.engine, Duration::from_secs(5)).await,
        "cancelled: {:?}",
        srv.engine.scheduler_stats()
    );
    // Stopped soon after the disconnect, far short of 400 steps.
    let launches = srv.engine.scheduler_stats().launches;
    assert!(
        launches < at_drop + 100,
        "{at_drop} launches at the drop, {launches} at the end"
    );
    // Both sequences count as aborted in the metrics.
    let m = get(srv.addr, "/metrics").await.body;
    let aborted = m
        .lines()
        .find(|l| l.starts_with("vllm:request_success_total") && l.contains("\"abort\""))
        .unwrap_or_else(|| panic!("no abort counter in {m}"));
    assert!(aborted.ends_with(" 2"), "{aborted}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_while_waiting_for_a_non_streamed_response_cancels() {
    let srv = start(Opts {
        step_delay: Some(Duration::from_millis(3)),
        ..Opts::default()
    })
    .await;
    let body =
        json!({"prompt": "Once upon a time", "max_tokens": 500, "ignore_eos": true}).to_string();
    let s = post_raw(srv.addr, &body).await;
    // Wait until the request runs, then go away.
    let start = std::time::Instant::now();
    while srv.engine.scheduler_stats().running == 0 {
        assert!(start.elapsed() < Duration::from_secs(10));
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    drop(s);
    let at_drop = srv.engine.scheduler_stats().launches;
    assert!(
        wait_engine_idle(&srv.engine, Duration::from_secs(5)).await,
        "cancelled: {:?}",
        srv.engine.scheduler_stats()
    );
    let launches = srv.engine.scheduler_stats().launches;
    assert!(
        launches < at_drop + 100,
        "{at_drop} launches at the drop, {launches} at the end"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_requests_are_cancelled_on_disconnect_too() {
    // One running slot: the second request waits in the queue when its client leaves.
    let srv = start(Opts {
        max_num_seqs: Some(1),
        step_delay: Some(Duration::from_millis(3)),
        ..Opts::default()
    })
    .await;
    let long = json!({"prompt": "The cat", "max_tokens": 500, "ignore_eos": true, "stream": true});
    let mut a = post_raw(srv.addr, &long.to_string()).await;
    read_events(&mut a, 2).await;
    let b = post_raw(srv.addr, &long.to_string()).await;
    let start = std::time::Instant::now();
    while srv.engine.scheduler_stats().waiting == 0 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "second request never queued"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    drop(b);
    drop(a);
    let at_drop = srv.engine.scheduler_stats().launches;
    assert!(wait_engine_idle(&srv.engine, Duration::from_secs(5)).await);
    // Neither ran to its 500 tokens; the queued one never started.
    let launches = srv.engine.scheduler_stats().launches;
    assert!(
        launches < at_drop + 100,
        "{at_drop} launches at the drop, {launches} at the end"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_models_metrics_tokenize_and_detokenize_answer() {
    let srv = start(Opts {
        max_model_len: Some(256),
        ..Opts::default()
    })
    .await;
    let r = get(srv.addr, "/health").await;
    assert_eq!(r.status, 200);
    let m = get(srv.addr, "/v1/models").await.json();
    assert_eq!(m["object"], "list");
    assert_eq!(m["data"][0]["id"], MODEL);
    assert_eq!(m["data"][0]["max_model_len"], 256);
    // The openai client's models.retrieve.
    let one = get(srv.addr, &format!("/v1/models/{MODEL}")).await;
    assert_eq!(one.status, 200, "{}", one.body);
    assert_eq!(one.json(), m["data"][0]);
    let none = get(srv.addr, "/v1/models/org/other-model").await;
    assert_eq!(none.status, 404, "{}", none.body);
    assert_eq!(none.json()["error"]["param"], "model", "{}", none.body);
    // Generate something so the counters move.
    completion(srv.addr, json!({"prompt": "The cat", "max_tokens": 5})).await;
    let r = get(srv.addr, "/metrics").await;
    assert_eq!(r.status, 200);
    for name in [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
    ] {
        assert!(r.body.contains(name), "{name} missing");
    }
    assert!(
        r.body
            .contains("vllm:prompt_tokens_total{model_name=\"stories\"} 4"),
        "{}",
        r.body
    );
    assert!(r
        .body
        .contains("vllm:generation_tokens_total{model_name=\"stories\"} 5"));
    assert!(r
        .body
        .contains("vllm:time_to_first_token_seconds_count{model_name=\"stories\"} 1"));
    assert!(r
        .body
        .contains("vllm:inter_token_latency_seconds_count{model_name=\"stories\"} 4"));
    // The in-process engine times the phases too.
    for phase in ["queue", "prefill", "decode", "inference"] {
        let line = format!("vllm:request_{phase}_time_seconds_count{{model_name=\"stories\"}} 1");
        assert!(r.body.contains(&line), "{line} missing:\n{}", r.body);
    }
    let t = post(
        srv.addr,
        "/tokenize",
        &json!({"prompt": "Once upon a time"}),
    )
    .await
    .json();
    assert_eq!(t["tokens"], json!([1, 403, 407, 261, 378]));
    assert_eq!(t["count"], 5);
    assert_eq!(t["max_model_len"], 256);
    let t = post(
        srv.addr,
        "/tokenize",
        &json!({"prompt": "Once", "add_special_tokens": false}),
    )
    .await
    .json();
    assert_eq!(t["tokens"], json!([403]));
    let d = post(
        srv.addr,
        "/detokenize",
        &json!({"tokens": [1, 403, 407, 261, 378]}),
    )
    .await
    .json();
    assert_eq!(d["prompt"], "Once upon a time");
    let r = post(srv.addr, "/detokenize", &json!({"tokens": [1, 100000]})).await;
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["param"], "tokens");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_key_is_required_on_v1_routes_only() {
    let srv = start(Opts {
        api_key: Some("sekrit".into()),
        ..Opts::default()
    })
    .await;
    let body = json!({"prompt": "a", "max_tokens": 1}).to_string();
    let r = send(srv.addr, "POST", "/v1/completions", &[], &body).await;
    assert_eq!(r.status, 401);
    assert_eq!(r.json()["error"]["type"], "authentication_error");
    let r = send(
        srv.addr,
        "POST",
        "/v1/completions",
        &[("Authorization", "Bearer nope")],
        &body,
    )
    .await;
    assert_eq!(r.status, 401);
    let r = send(srv.addr, "GET", "/v1/models", &[], "").await;
    assert_eq!(r.status, 401);
    let r = send(
        srv.addr,
        "POST",
        "/v1/completions",
        &[("Authorization", "Bearer sekrit")],
        &body,
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    // The scheme is case-insensitive (RFC 7235).
    let r = send(
        srv.addr,
        "POST",
        "/v1/completions",
        &[("Authorization", "bearer sekrit")],
        &body,
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    // An Anthropic route's 401 has Anthropic's shape.
    let r = post(
        srv.addr,
        "/v1/messages",
        &json!({"max_tokens": 1, "messages": []}),
    )
    .await;
    assert_eq!(r.status, 401, "{}", r.body);
    assert_eq!(
        r.json()["error"]["type"],
        "authentication_error",
        "{}",
        r.body
    );
    assert_eq!(r.json()["type"], "error", "{}", r.body);
    // Anthropic's clients send the key as `x-api-key`.
    for (key, want) in [("sekrit", 200), ("nope", 401)] {
        let r = send(
            srv.addr,
            "POST",
            "/v1/completions",
            &[("x-api-key", key)],
            &body,
        )
        .await;
        assert_eq!(r.status, want, "{}", r.body);
    }
    assert_eq!(get(srv.addr, "/health").await.status, 200);
}

/// The headers of a browser's preflight for a JSON POST with an API key from `origin`.
fn preflight_headers(origin: &str) -> [(&str, &str); 3] {
    [
        ("Origin", origin),
        ("Access-Control-Request-Method", "POST"),
        (
            "Access-Control-Request-Headers",
            "authorization,content-type",
        ),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cors_allows_every_origin_by_default_and_preflights_pass_the_api_key_check() {
    let srv = start(Opts {
        api_key: Some("sekrit".into()),
        chat_template: Some(LLAMA2_TEMPLATE.into()),
        ..Opts::default()
    })
    .await;
    let origin = "http://app.example:3000";
    // A preflight carries no Authorization header: it is answered, not refused with a 401.
    let r = send(
        srv.addr,
        "OPTIONS",
        "/v1/chat/completions",
        &preflight_headers(origin),
        "",
    )
    .await;
    assert!(r.status == 200 || r.status == 204, "{r:?}");
    assert_eq!(r.header("access-control-allow-origin"), Some("*"), "{r:?}");
    let methods = r.header("access-control-allow-methods").unwrap_or("");
    assert!(methods.split(',').any(|m| m.trim() == "POST"), "{r:?}");
    assert_eq!(
        r.header("access-control-allow-headers"),
        Some("authorization,content-type"),
        "{r:?}"
    );
    assert_eq!(r.header("access-control-max-age"), Some("600"), "{r:?}");
    assert_eq!(r.header("access-control-allow-credentials"), None, "{r:?}");
    // The request itself, and the errors too, carry the allow-origin header.
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    let auth = ("Authorization", "Bearer sekrit");
    let r = send(
        srv.addr,
        "POST",
        "/v1/chat/completions",
        &[("Origin", origin), auth],
        &body.to_string(),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("access-control-allow-origin"), Some("*"), "{r:?}");
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    let r = send(
        srv.addr,
        "POST",
        "/v1/chat/completions",
        &[("Origin", origin), auth],
        &sb.to_string(),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("access-control-allow-origin"), Some("*"), "{r:?}");
    let r = send(
        srv.addr,
        "POST",
        "/v1/chat/completions",
        &[("Origin", origin)],
        &body.to_string(),
    )
    .await;
    assert_eq!(r.status, 401, "{}", r.body);
    assert_eq!(r.header("access-control-allow-origin"), Some("*"), "{r:?}");
    // A wrong method is still a 405 with an OpenAI body, and so is an OPTIONS request that is
    // not a preflight (tower-http alone would answer it with an empty 200).
    let r = send(
        srv.addr,
        "GET",
        "/v1/completions",
        &[("Origin", origin), auth],
        "",
    )
    .await;
    assert_eq!(r.status, 405, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], 405, "{}", r.body);
    assert_eq!(r.header("access-control-allow-origin"), Some("*"), "{r:?}");
    let r = send(srv.addr, "OPTIONS", "/v1/completions", &[auth], "").await;
    assert_eq!(r.status, 405, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], 405, "{}", r.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cors_lists_allow_only_their_origins_methods_and_headers() {
    let list = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let srv = start(Opts {
        cors: Some(baton_frontend::CorsConfig {
            allowed_origins: list(&["http://ok.example"]),
            allowed_methods: list(&["POST"]),
            allowed_headers: list(&["authorization"]),
            allow_credentials: true,
        }),
        ..Opts::default()
    })
    .await;
    let r = send(
        srv.addr,
        "OPTIONS",
        "/v1/completions",
        &preflight_headers("http://ok.example"),
        "",
    )
    .await;
    assert!(r.status == 200 || r.status == 204, "{r:?}");
    assert_eq!(
        r.header("access-control-allow-origin"),
        Some("http://ok.example"),
        "{r:?}"
    );
    assert_eq!(r.header("access-control-allow-credentials"), Some("true"));
    assert_eq!(r.header("access-control-allow-methods"), Some("POST"));
    // Content-Type is always allowed, as vLLM does, or no browser could send JSON.
    let headers = r.header("access-control-allow-headers").unwrap_or("");
    for h in ["authorization", "content-type"] {
        assert!(headers.split(',').any(|x| x.trim() == h), "{h}: {r:?}");
    }
    // Another origin gets no allow-origin header, so its browser refuses the response.
    let r = send(
        srv.addr,
        "OPTIONS",
        "/v1/completions",
        &preflight_headers("http://evil.example"),
        "",
    )
    .await;
    assert_eq!(r.header("access-control-allow-origin"), None, "{r:?}");
    let body = json!({"prompt": "a", "max_tokens": 1}).to_string();
    let r = send(
        srv.addr,
        "POST",
        "/v1/completions",
        &[("Origin", "http://evil.example")],
        &body,
    )
    .await;
    assert_eq!(r.header("access-control-allow-origin"), None, "{r:?}");
    let r = send(
        srv.addr,
        "POST",
        "/v1/completions",
        &[("Origin", "http://ok.example")],
        &body,
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        r.header("access-control-allow-origin"),
        Some("http://ok.example")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cors_with_credentials_and_every_origin_echoes_the_origin() {
    // Browsers refuse `*` with credentials; the server must neither send it nor panic.
    let srv = start(Opts {
        cors: Some(baton_frontend::CorsConfig {
            allow_credentials: true,
            ..baton_frontend::CorsConfig::default()
        }),
        ..Opts::default()
    })
    .await;
    let origin = "http://any.example";
    let r = send(
        srv.addr,
        "OPTIONS",
        "/v1/models",
        &preflight_headers(origin),
        "",
    )
    .await;
    assert!(r.status == 200 || r.status == 204, "{r:?}");
    assert_eq!(r.header("access-control-allow-origin"), Some(origin));
    assert_eq!(r.header("access-control-allow-credentials"), Some("true"));
    assert_ne!(r.header("access-control-allow-methods"), Some("*"));
    assert_eq!(
        r.header("access-control-allow-headers"),
        Some("authorization,content-type")
    );
    let r = send(srv.addr, "GET", "/v1/models", &[("Origin", origin)], "").await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("access-control-allow-origin"), Some(origin));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_is_503_once_the_engine_is_gone() {
    use baton_frontend::EngineClient;
    let srv = start(Opts::default()).await;
    assert!(srv.engine.health().is_ok());
    // A client whose engine is gone (no worker attached, scheduler dead).
    struct Dead;
    impl EngineClient for Dead {
        fn submit(
            &self,
            _: baton_frontend::EngineRequest,
        ) -> Result<
            (
                u64,
                tokio::sync::mpsc::UnboundedReceiver<baton_frontend::EngineEvent>,
            ),
            baton_frontend::SubmitError,
        > {
            Err(baton_frontend::SubmitError::Unavailable(
                "no worker attached".into(),
            ))
        }
        fn cancel(&self, _: u64) {}
        fn limits(&self) -> baton_frontend::EngineLimits {
            baton_frontend::EngineLimits {
                max_model_len: 512,
                vocab_size: 512,
                max_num_seqs: 1,
                priority_scheduling: false,
            }
        }
        fn health(&self) -> Result<(), String> {
            Err("no worker attached".into())
        }
        fn stats(&self) -> baton_frontend::EngineStats {
            baton_frontend::EngineStats::default()
        }
    }
    let tok = common::stories_tokenizer();
    let cfg = srv.state.config.clone();
    let state = std::sync::Arc::new(
        baton_frontend::AppState::new(cfg, tok, std::sync::Arc::new(Dead), vec![2]).unwrap(),
    );
    let (listener, addr) = baton_frontend::bind("127.0.0.1", 0).await.unwrap();
    let task = tokio::spawn(baton_frontend::serve_state(
        listener,
        state,
        std::future::pending(),
    ));
    let r = get(addr, "/health").await;
    assert_eq!(r.status, 503);
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("no worker"));
    let r = post(
        addr,
        "/v1/completions",
        &json!({"prompt": "a", "max_tokens": 1}),
    )
    .await;
    assert_eq!(r.status, 503);
    task.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_errors_after_the_stream_started_end_it_with_one_error_event() {
    use baton_frontend::EngineEvent;
    let (addr, task) = common::start_scripted(|_| {
        vec![
            EngineEvent::Token {
                token: 403,
                cached_tokens: 0,
                logprob: 0.0,
                top: vec![],
                first: None,
            },
            EngineEvent::Error("the scheduler is gone".into()),
        ]
    })
    .await;
    let r = post(
        addr,
        "/v1/completions",
        &json!({"prompt": "a", "stream": true, "n": 2}),
    )
    .await;
    assert_eq!(r.status, 200);
    let ev = r.events();
    let errors: Vec<_> = ev.iter().filter(|e| e.contains("\"error\"")).collect();
    assert_eq!(errors.len(), 1, "{ev:?}");
    assert_eq!(ev.last().unwrap(), "[DONE]");
    assert!(ev[ev.len() - 2].contains("the scheduler is gone"));
    let r = post(addr, "/v1/completions", &json!({"prompt": "a"})).await;
    assert_eq!(r.status, 500);
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("scheduler is gone"));
    task.abort();
}

#[test]
fn incremental_detokenizer_matches_full_decode() {
    use baton_frontend::detok::IncrementalDetokenizer;
    let tok = common::stories_tokenizer();
    let check = |prompt: &[u32], out: &[u32]| {
        let mut d = IncrementalDetokenizer::new(prompt, true);
        let mut got = String::new();
        for &t in out {
            got.push_str(&d.push(&tok, t));
        }
        got.push_str(&d.finish(&tok));
        let all: Vec<u32> = prompt.iter().chain(out).copied().collect();
        let full = tok.decode(&all, true).unwrap();
        let head = tok.decode(prompt, true).unwrap();
        match full.strip_prefix(head.as_str()) {
            Some(want) => {
                assert_eq!(got, want, "{prompt:?} + {out:?}");
                true
            }
            // The prompt ends inside a character the output completes: no reference.
            None => false,
        }
    };
    for g in common::goldens() {
        let ids = |k: &str| -> Vec<u32> {
            g[k].as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect()
        };
        assert!(check(&ids("prompt_ids"), &ids("greedy_ids")));
    }
    // Multi-byte characters split across byte-fallback tokens, in the output.
    let emoji = [243u32, 162, 155, 131]; // "😀"
    assert!(check(
        &[1, 291],
        &[410, emoji[0], emoji[1], emoji[2], emoji[3], 294]
    ));
    // Ends inside a character: flushed as U+FFFD at the end.
    assert!(check(&[1, 291], &[emoji[0], emoji[1]]));
    // Model-like outputs: vocabulary pieces mixed with characters spelled as byte-fallback
    // tokens (id 3 + byte). (Arbitrary byte soup is not covered: tokenizers turns every byte of
    // an invalid run into U+FFFD, even an ASCII byte the stream already sent.)
    let chars = ["😀", "é", "中", "—", "🐱", "ï", "\n"];
    let mut rng = Lcg(11);
    let mut checked = 0;
    for _ in 0..300 {
        let prompt: Vec<u32> = std::iter::once(1)
            .chain((0..1 + rng.below(6)).map(|_| 259 + rng.below(253) as u32))
            .collect();
        let mut out = Vec::new();
        for _ in 0..1 + rng.below(20) {
            if rng.below(4) == 0 {
                let c = chars[rng.below(chars.len() as u64) as usize];
                out.extend(c.bytes().map(|b| 3 + u32::from(b)));
            } else {
                out.push(259 + rng.below(253) as u32);
            }
        }
        checked += usize::from(check(&prompt, &out));
    }
    assert!(checked > 200, "only {checked} random cases had a reference");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_lets_streams_run_for_the_grace_period_then_ends_them_with_an_error_event() {
    let mut srv = start(Opts {
        step_delay: Some(Duration::from_millis(40)),
        ..Opts::default()
    })
    .await;
    let body = json!({"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": true,
                      "stream": true})
    .to_string();
    let mut s = post_raw(srv.addr, &body).await;
    let head = read_events(&mut s, 2).await;
    let before = head.matches("data: ").count();
    let t0 = std::time::Instant::now();
    let _ = srv.shutdown.take().unwrap().send(());
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut rest))
        .await
        .expect("the stream ends after the grace period")
        .unwrap();
    let rest = String::from_utf8_lossy(&rest);
    let waited = t0.elapsed();
    // It kept streaming during the grace period, then ended with one error event.
    assert!(
        waited >= baton_frontend::server::DRAIN_GRACE,
        "ended after {waited:?}"
    );
    assert!(
        rest.matches("data: ").count() > before + 10,
        "no tokens during the grace period: {rest}"
    );
    assert_eq!(
        rest.matches("the server is shutting down").count(),
        1,
        "{rest}"
    );
    assert!(rest.contains("\"code\":503"), "{rest}");
    tokio::time::timeout(Duration::from_secs(10), srv.task.take().unwrap())
        .await
        .expect("the server exits once its streams ended")
        .unwrap();
    assert!(
        wait_engine_idle(&srv.engine, Duration::from_secs(5)).await,
        "the request was cancelled in the engine"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_far_over_the_context_is_refused_untokenized_and_huge_bodies_get_an_openai_413() {
    let srv = start(Opts::default()).await;
    // Far more bytes than 512 tokens can cover: refused before tokenizing, naming the field.
    let r = post(
        srv.addr,
        "/v1/completions",
        &json!({"prompt": "a ".repeat(2 << 20), "max_tokens": 1}),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.body);
    let e = &r.json()["error"];
    assert_eq!(e["param"], "prompt");
    assert!(e["message"].as_str().unwrap().contains("bytes long"), "{e}");
    // 17,000 bytes: over the 16 KiB inline limit (tokenized on the blocking pool) and under
    // stories260K's bound (512 tokens x 9-byte pieces x 4): the usual token count error.
    let r = post(
        srv.addr,
        "/v1/completions",
        &json!({"prompt": "a ".repeat(8_500), "max_tokens": 1}),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("your prompt has"), "{}", r.body);
    // Over the body limit, streamed without a declared length (chunked): a 413 with an OpenAI
    // error body once the limit is passed, not axum's plain text.
    let big = format!(
        "{{\"prompt\": \"{}\"}}",
        "a".repeat(baton_frontend::server::MAX_BODY_BYTES)
    );
    let mut req = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\
        Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        .to_vec();
    req.extend_from_slice(format!("{:x}\r\n", big.len()).as_bytes());
    req.extend_from_slice(big.as_bytes());
    req.extend_from_slice(b"\r\n0\r\n\r\n");
    let (mut rd, mut wr) = tokio::net::TcpStream::connect(srv.addr)
        .await
        .unwrap()
        .into_split();
    // The server answers once past the limit and may close before the last bytes are sent.
    let writer = tokio::spawn(async move {
        let _ = wr.write_all(&req).await;
    });
    let mut raw = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(60), rd.read_to_end(&mut raw)).await;
    let _ = writer.await;
    let r = common::parse_response(&raw);
    assert_eq!(r.status, 413, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], 413, "{}", r.body);
    // A declared Content-Length over the limit: the 413 comes at once, without the body (the
    // server would otherwise wait the 30 s body deadline and answer 408).
    let mut s = tokio::net::TcpStream::connect(srv.addr).await.unwrap();
    s.write_all(
        b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n\
          Content-Length: 999999999\r\n\r\n{}",
    )
    .await
    .unwrap();
    let mut head = [0u8; 64];
    let k = tokio::time::timeout(Duration::from_secs(10), s.read(&mut head))
        .await
        .expect("an answer before the body deadline")
        .unwrap();
    let head = String::from_utf8_lossy(&head[..k]).into_owned();
    assert!(head.starts_with("HTTP/1.1 413"), "{head}");
    // The server still answers.
    let v = completion(srv.addr, json!({"prompt": "a", "max_tokens": 2})).await;
    assert_eq!(v["usage"]["completion_tokens"], 2);
}

/// A POST body is read as JSON only under a JSON `Content-Type` (or none), as vLLM's FastAPI
/// routes read it: plain text, a form or a file upload is a 400 with an OpenAI error body,
/// even when its bytes would parse. An empty `model` names the served model, as in vLLM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_of_another_media_type_is_a_400_and_an_empty_model_is_the_served_one() {
    let srv = start(Opts::default()).await;
    let body = r#"{"prompt": "a", "max_tokens": 2, "model": ""}"#;
    let send_as = |ct: Option<&'static str>| async move {
        let head = ct
            .map(|c| format!("Content-Type: {c}\r\n"))
            .unwrap_or_default();
        let req = format!(
            "POST /v1/completions HTTP/1.1\r\nHost: t\r\nConnection: close\r\n{head}\
             Content-Length: {}\r\n\r\n{body}",
            body.len()
        );
        let mut s = tokio::net::TcpStream::connect(srv.addr).await.unwrap();
        s.write_all(req.as_bytes()).await.unwrap();
        let mut raw = Vec::new();
        tokio::time::timeout(Duration::from_secs(60), s.read_to_end(&mut raw))
            .await
            .expect("an answer")
            .unwrap();
        common::parse_response(&raw)
    };
    for ct in [
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/xml",
        "application/jsonp",
        "image/png",
    ] {
        let r = send_as(Some(ct)).await;
        assert_eq!(r.status, 400, "{ct}: {}", r.body);
        let e = r.json();
        assert_eq!(e["error"]["type"], "invalid_request_error", "{ct}: {e}");
        assert!(
            e["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("application/json") && m.contains(ct)),
            "{ct}: {e}"
        );
    }
    for ct in [
        None,
        Some("application/json"),
        Some("Application/JSON; charset=utf-8"),
        Some("application/vnd.api+json"),
    ] {
        let r = send_as(ct).await;
        assert_eq!(r.status, 200, "{ct:?}: {}", r.body);
        assert_eq!(r.json()["usage"]["completion_tokens"], 2, "{ct:?}");
        assert_eq!(r.json()["model"], common::MODEL, "{ct:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_finishes_its_headers_is_disconnected() {
    let srv = start(Opts {
        header_read_timeout: Some(Duration::from_millis(500)),
        ..Opts::default()
    })
    .await;
    // Slowloris: half a request line, then nothing.
    let mut slow = tokio::net::TcpStream::connect(srv.addr).await.unwrap();
    slow.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    let mut buf = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(20), slow.read_to_end(&mut buf)).await;
    assert!(
        read.is_ok(),
        "the server kept a connection without headers open for 20 s"
    );
    // Headers complete, then the body stalls: a 408 and the connection closes.
    let mut stall = tokio::net::TcpStream::connect(srv.addr).await.unwrap();
    stall
        .write_all(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
              Content-Length: 100\r\n\r\n{\"prompt\"",
        )
        .await
        .unwrap();
    let mut resp = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(20), stall.read_to_end(&mut resp)).await;
    assert!(
        read.is_ok(),
        "a stalled body kept the connection open for 20 s"
    );
    let resp = String::from_utf8_lossy(&resp);
    assert!(resp.starts_with("HTTP/1.1 408"), "{resp}");
    assert!(resp.contains("\"error\""), "{resp}");
    // A client that sends its headers in time is served as usual.
    let mut ok = tokio::net::TcpStream::connect(srv.addr).await.unwrap();
    ok.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut resp = String::new();
    ok.read_to_string(&mut resp).await.unwrap();
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
}

/// vLLM's extra parameters that would change the output and that this server does not
/// implement get a 400 naming them, never a 200 that silently ignored them; their no-op values
/// pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn output_changing_vllm_extras_are_refused_not_ignored() {
    let srv = start(Opts::default()).await;
    let base = json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 3});
    let with = |k: &str, v: Value| {
        let mut b = base.clone();
        b[k] = v;
        b
    };
    let refused = [
        ("min_tokens", json!(-1)),
        // Served, but a blank word is refused.
        ("bad_words", json!([" "])),
        // Served, but 0 is refused (vLLM: an integer >= 1 or -1).
        ("truncate_prompt_tokens", json!(0)),
        ("chat_template", json!("{{ messages }}")),
        ("prompt_embeds", json!("AAAA")),
        ("documents", json!([{"text": "x"}])),
        ("chat_template_kwargs", json!({"enable_thinking": false})),
        ("priority", json!(1)),
    ];
    for (k, v) in refused {
        let r = post(srv.addr, "/v1/completions", &with(k, v.clone())).await;
        assert_eq!(r.status, 400, "{k}={v}: {}", r.body);
        assert_eq!(r.json()["error"]["param"], k, "{}", r.body);
    }
    let mut b = with("stream", json!(true));
    b["stream_options"] = json!({"include_usage": true, "continuous_usage_stats": "yes"});
    let r = post(srv.addr, "/v1/completions", &b).await;
    assert_eq!(r.status, 400, "{}", r.body);
    for (k, v) in [
        ("min_tokens", json!(0)),
        ("bad_words", json!([])),
        ("truncate_prompt_tokens", Value::Null),
        ("guided_json", Value::Null),
        ("allowed_token_ids", Value::Null),
        ("chat_template_kwargs", json!({})),
        ("return_token_ids", json!(false)),
        ("priority", json!(0)),
    ] {
        let r = post(srv.addr, "/v1/completions", &with(k, v.clone())).await;
        assert_eq!(r.status, 200, "{k}={v}: {}", r.body);
    }
}

/// `add_special_tokens: false` leaves BOS out of a completions prompt, as `/tokenize` does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn add_special_tokens_false_leaves_bos_out_of_a_completion_prompt() {
    let srv = start(Opts::default()).await;
    let prompt_tokens = |special: bool| {
        let body = json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1,
            "add_special_tokens": special});
        async move {
            let r = post(srv.addr, "/v1/completions", &body).await;
            assert_eq!(r.status, 200, "{}", r.body);
            r.json()["usage"]["prompt_tokens"].as_u64().unwrap()
        }
    };
    let with = prompt_tokens(true).await;
    let without = prompt_tokens(false).await;
    assert_eq!(with, without + 1, "BOS");
    let t = post(
        srv.addr,
        "/tokenize",
        &json!({"prompt": "Once upon a time", "add_special_tokens": false}),
    )
    .await
    .json();
    assert_eq!(t["count"].as_u64(), Some(without));
}

/// `continue_final_message` leaves the last (assistant) message open: the rendered prompt ends
/// right after its content instead of closing it with EOS. As in vLLM it needs
/// `add_generation_prompt: false`: with `add_generation_prompt` true, given or by default, it is
/// a 400 (on `/tokenize` too).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn continue_final_message_leaves_the_last_message_open() {
    let srv = start(Opts {
        chat_template: Some(LLAMA2_TEMPLATE.into()),
        ..Opts::default()
    })
    .await;
    let messages = json!([{"role": "user", "content": "Tell a story."},
        {"role": "assistant", "content": "Once upon"}]);
    let tokens = |extra: Value| {
        let mut body = json!({"messages": messages.clone()});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        async move {
            let r = post(srv.addr, "/tokenize", &body).await;
            assert_eq!(r.status, 200, "{}", r.body);
            r.json()["tokens"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap())
                .collect::<Vec<_>>()
        }
    };
    let closed = tokens(json!({"add_generation_prompt": false})).await;
    let open =
        tokens(json!({"continue_final_message": true, "add_generation_prompt": false})).await;
    assert_eq!(
        closed.last(),
        Some(&2),
        "the template closes the message with EOS"
    );
    assert!(
        closed.starts_with(&open) && open.len() < closed.len(),
        "open {open:?} is not a prefix of closed {closed:?}"
    );
    assert_ne!(open.last(), Some(&2));
    let r = post(
        srv.addr,
        "/v1/chat/completions",
        &json!({"model": MODEL, "messages": messages, "continue_final_message": true,
            "add_generation_prompt": true, "max_tokens": 2}),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.body);
    let e = r.json()["error"].clone();
    assert_eq!(
        e["message"],
        "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
    );
    assert_eq!(e["param"], "continue_final_message");
    // add_generation_prompt defaults to true: continue_final_message alone is refused too
    // (also when it comes from chat_template_kwargs).
    for (path, extra) in [
        (
            "/v1/chat/completions",
            json!({"continue_final_message": true}),
        ),
        ("/tokenize", json!({"continue_final_message": true})),
        (
            "/v1/chat/completions",
            json!({"chat_template_kwargs": {"continue_final_message": true}}),
        ),
    ] {
        let mut body = json!({"model": MODEL, "messages": messages, "max_tokens": 2});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let r = post(srv.addr, path, &body).await;
        assert_eq!(r.status, 400, "{path} {extra}: {}", r.body);
        let e = r.json()["error"].clone();
        assert_eq!(e["param"], "continue_final_message", "{e}");
        assert!(
            e["message"]
                .as_str()
                .unwrap()
                .contains("\"add_generation_prompt\": false"),
            "{e}"
        );
    }
    let r = post(
        srv.addr,
        "/v1/chat/completions",
        &json!({"model": MODEL, "messages": messages, "continue_final_message": true,
            "add_generation_prompt": false, "max_tokens": 2, "temperature": 0}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
}

/// Golden `i`'s prompt ids followed by its greedy continuation.
fn golden_history(i: usize) -> Vec<u64> {
    let g = &common::goldens()[i];
    g["prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .chain(g["greedy_ids"].as_array().unwrap())
        .map(|v| v.as_u64().unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_salt_keeps_prefix_cache_hits_within_the_same_salt() {
    let srv = start(Opts::default()).await;
    let ids = golden_history(1)[..45].to_vec();
    let cached = |salt: Option<&str>| {
        let mut body = json!({"prompt": ids.clone(), "max_tokens": 2, "temperature": 0});
        if let Some(s) = salt {
            body["cache_salt"] = json!(s);
        }
        let addr = srv.addr;
        async move {
            completion(addr, body).await["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap()
        }
    };
    assert_eq!(cached(Some("tenant-a")).await, 0);
    assert_eq!(cached(Some("tenant-a")).await, 32, "same salt: a hit");
    assert_eq!(cached(Some("tenant-b")).await, 0, "another salt: no hit");
    assert_eq!(cached(None).await, 0, "no salt: no hit on salted blocks");
    assert_eq!(cached(None).await, 32);
    assert_eq!(cached(Some("tenant-b")).await, 32);
    for bad in [json!(""), json!(5)] {
        let r = post(
            srv.addr,
            "/v1/completions",
            &json!({"prompt": "a", "cache_salt": bad}),
        )
        .await;
        assert_eq!(r.status, 400, "{}", r.body);
        assert_eq!(r.json()["error"]["param"], "cache_salt");
    }
}

/// A prompt whose first full KV blocks an earlier request computed reports them in
/// `usage.prompt_tokens_details.cached_tokens` (streamed or not), and `/metrics` counts the
/// hits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cached_prompt_tokens_are_reported_in_usage_and_metrics() {
    let srv = start(Opts::default()).await;
    let ids = golden_history(0);
    let first = completion(
        srv.addr,
        json!({"prompt": &ids[..5], "max_tokens": 64, "temperature": 0}),
    )
    .await;
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    // 45 tokens of that history: its first two 16-token blocks are cached.
    let body = json!({"prompt": &ids[..45], "max_tokens": 16, "temperature": 0});
    let second = completion(srv.addr, body.clone()).await;
    assert_eq!(second["usage"]["prompt_tokens"], 45);
    assert_eq!(
        second["usage"]["prompt_tokens_details"]["cached_tokens"],
        32
    );
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let r = post(srv.addr, "/v1/completions", &streamed).await;
    let usage: Value = r
        .events()
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .find(|v| v["usage"].is_object())
        .expect("a usage chunk")["usage"]
        .clone();
    assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 32);
    assert_eq!(stream_text(&r, false).0, text_of(&second, 0));
    let m = get(srv.addr, "/metrics").await.body;
    let hits: u64 = m
        .lines()
        .find(|l| l.starts_with("vllm:prefix_cache_hits_total{"))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .expect("prefix_cache_hits_total");
    assert_eq!(hits, 64, "{m}");
    // A stop string ends the sequence before the engine does: the count still arrives.
    let text = text_of(&second, 0);
    let cut = text.char_indices().nth(text.chars().count() / 2).unwrap().0;
    let stop: String = text[cut..].chars().take(4).collect();
    let v = completion(srv.addr, with_fields(&body, json!({"stop": [stop]}))).await;
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    assert_eq!(
        v["usage"]["prompt_tokens_details"]["cached_tokens"], 32,
        "{v}"
    );
    // Back to back after requests a stop string cut short (their last launch still in flight,
    // their pages retired): the shared blocks are still hits.
    for i in 0..20u64 {
        let mut prompt = ids[..44].to_vec();
        prompt.push(300 + i);
        let body = json!({"prompt": prompt, "max_tokens": 32, "temperature": 0, "stop": [" "]});
        let v = completion(srv.addr, body).await;
        assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
        assert_eq!(
            v["usage"]["prompt_tokens_details"]["cached_tokens"], 32,
            "request {i}: {v}"
        );
    }
}

// ---- /v1/responses ----

/// A server with the Llama-2 chat template (the responses endpoint renders through it).
async fn start_chat(opts: Opts) -> common::TestServer {
    start(Opts {
        chat_template: Some(LLAMA2_TEMPLATE.into()),
        ..opts
    })
    .await
}

async fn response(addr: std::net::SocketAddr, body: &Value) -> Value {
    let r = post(addr, "/v1/responses", body).await;
    assert_eq!(r.status, 200, "{body}: {}", r.body);
    r.json()
}

/// The text of a non-streamed response's one output message.
fn response_text(v: &Value) -> String {
    assert_eq!(v["output"].as_array().map(Vec::len), Some(1), "{v}");
    let content = v["output"][0]["content"].as_array().expect("content");
    assert_eq!(content.len(), 1, "{v}");
    content[0]["text"].as_str().expect("text").to_owned()
}

/// A streamed response's `(event, data)` pairs; panics on anything but `event:` + `data:`
/// pairs.
fn response_events(r: &common::Resp) -> Vec<(String, Value)> {
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    r.body
        .split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| {
            let (ev, data) = e.split_once('\n').unwrap_or_else(|| panic!("{e:?}"));
            let kind = ev
                .strip_prefix("event: ")
                .unwrap_or_else(|| panic!("{e:?}"));
            let data = data
                .strip_prefix("data: ")
                .unwrap_or_else(|| panic!("{e:?}"));
            let data: Value = serde_json::from_str(data).unwrap_or_else(|e| panic!("{e}: {data}"));
            (kind.to_owned(), data)
        })
        .collect()
}

/// Checks a streamed response's event order, types and sequence numbers; returns the
/// concatenated deltas and the final event's response. Every delta's `logprobs` is `[]` (see
/// [`check_response_stream_with`]).
fn check_response_stream(events: &[(String, Value)]) -> (String, Value) {
    check_response_stream_with(events, false)
}

/// [`check_response_stream`]; with `logprobs` the deltas' `logprobs` are not checked (see
/// [`streamed_logprobs`]).
fn check_response_stream_with(events: &[(String, Value)], logprobs: bool) -> (String, Value) {
    let kinds: Vec<&str> = events.iter().map(|(k, _)| k.as_str()).collect();
    for (i, (kind, data)) in events.iter().enumerate() {
        assert_eq!(data["type"], kind.as_str(), "event {i}: {data}");
        assert_eq!(data["sequence_number"], i, "event {i}: {data}");
    }
    let n = kinds.len();
    assert!(n >= 8, "{kinds:?}");
    assert_eq!(
        kinds[..4],
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added"
        ],
        "{kinds:?}"
    );
    assert_eq!(
        kinds[n - 4..n - 1],
        [
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done"
        ],
        "{kinds:?}"
    );
    assert!(
        matches!(kinds[n - 1], "response.completed" | "response.incomplete"),
        "{kinds:?}"
    );
    assert!(
        kinds[4..n - 4]
            .iter()
            .all(|k| *k == "response.output_text.delta"),
        "{kinds:?}"
    );
    let created = &events[0].1["response"];
    assert_eq!(created["status"], "in_progress", "{created}");
    assert_eq!(created["output"], json!([]), "{created}");
    assert_eq!(events[1].1["response"], *created);
    let item = &events[2].1["item"];
    assert_eq!(item["status"], "in_progress", "{item}");
    assert_eq!(events[2].1["output_index"], 0);
    let msg_id = item["id"].as_str().expect("item id").to_owned();
    assert!(msg_id.starts_with("msg_"), "{msg_id}");
    let mut text = String::new();
    for (_, d) in &events[3..n - 1] {
        if d.get("item_id").is_some() {
            assert_eq!(d["item_id"], msg_id.as_str(), "{d}");
            assert_eq!(d["output_index"], 0, "{d}");
            assert_eq!(d["content_index"], 0, "{d}");
        }
    }
    for (_, d) in &events[4..n - 4] {
        if !logprobs {
            assert_eq!(d["logprobs"], json!([]), "{d}");
        }
        let delta = d["delta"].as_str().expect("delta");
        assert!(!delta.is_empty(), "{d}");
        text.push_str(delta);
    }
    assert_eq!(events[n - 4].1["text"], text.as_str());
    assert_eq!(events[n - 3].1["part"]["text"], text.as_str());
    let done_item = &events[n - 2].1["item"];
    assert_eq!(done_item["content"][0]["text"], text.as_str());
    let last = events[n - 1].1["response"].clone();
    assert_eq!(last["id"], created["id"]);
    assert_eq!(last["output"][0], *done_item);
    assert_eq!(
        last["status"],
        if kinds[n - 1] == "response.completed" {
            "completed"
        } else {
            "incomplete"
        }
    );
    (text, last)
}

async fn response_stream(addr: std::net::SocketAddr, body: &Value) -> (String, Value) {
    let mut body = body.clone();
    body["stream"] = json!(true);
    let r = post(addr, "/v1/responses", &body).await;
    assert!(!r.body.contains("[DONE]"), "{}", r.body);
    check_response_stream(&response_events(&r))
}

fn success_count(metrics: &str, reason: &str) -> u64 {
    metrics
        .lines()
        .find(|l| {
            l.starts_with("vllm:request_success_total")
                && l.contains(&format!("finished_reason=\"{reason}\""))
        })
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("no {reason} counter in {metrics}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_text_format_constrains_the_output_and_is_echoed() {
    let srv = start_chat(Opts::default()).await;
    let format = json!({"type": "json_schema", "name": "answer", "strict": true,
                        "schema": {"enum": ["yes", "no"]}});
    let body = json!({"model": MODEL, "input": "Say yes or no.", "max_output_tokens": 10,
                      "temperature": 0, "text": {"format": format}});
    let v = response(srv.addr, &body).await;
    assert_eq!(v["status"], "completed", "{v}");
    let text = response_text(&v);
    assert!(text == "\"yes\"" || text == "\"no\"", "{text}");
    assert_eq!(v["text"]["format"], format);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_have_openai_shape_streamed_and_not() {
    let srv = start_chat(Opts::default()).await;
    let body = json!({"model": MODEL, "input": "Once upon a time", "max_output_tokens": 20,
                      "temperature": 0, "metadata": {"run": "7"}, "user": "u-1", "store": true,
                      "tools": [], "tool_choice": "none", "parallel_tool_calls": false,
                      "text": {"format": {"type": "text"}}, "truncation": "disabled",
                      "include": [], "reasoning": null});
    let v = response(srv.addr, &body).await;
    assert!(v["id"].as_str().unwrap().starts_with("resp_"), "{v}");
    assert_eq!(v["object"], "response");
    assert!(v["created_at"].as_u64().unwrap() > 1_600_000_000, "{v}");
    assert_eq!(v["model"], MODEL);
    // 20 tokens of a greedy story: cut by the limit.
    assert_eq!(v["status"], "incomplete", "{v}");
    assert_eq!(
        v["incomplete_details"],
        json!({"reason": "max_output_tokens"})
    );
    assert_eq!(v["error"], Value::Null);
    let out = &v["output"][0];
    assert_eq!(out["type"], "message");
    assert!(out["id"].as_str().unwrap().starts_with("msg_"), "{v}");
    assert_eq!(out["role"], "assistant");
    assert_eq!(out["status"], "incomplete");
    assert_eq!(out["content"][0]["type"], "output_text");
    assert_eq!(out["content"][0]["annotations"], json!([]));
    let text = response_text(&v);
    assert!(!text.is_empty());
    // The prompt is the rendered template of one user message.
    let t = post(
        srv.addr,
        "/tokenize",
        &json!({"messages": [{"role": "user", "content": "Once upon a time"}]}),
    )
    .await
    .json();
    let u = &v["usage"];
    assert_eq!(u["input_tokens"], t["count"], "{u}");
    assert_eq!(u["output_tokens"], 20, "{u}");
    assert_eq!(
        u["total_tokens"].as_u64(),
        Some(t["count"].as_u64().unwrap() + 20)
    );
    assert!(u["input_tokens_details"]["cached_tokens"].is_u64(), "{u}");
    assert_eq!(u["output_tokens_details"]["reasoning_tokens"], 0);
    // The echoed request.
    assert_eq!(v["metadata"], json!({"run": "7"}));
    assert_eq!(v["user"], "u-1");
    assert_eq!(v["instructions"], Value::Null);
    assert_eq!(v["max_output_tokens"], 20);
    assert_eq!(v["temperature"], 0.0);
    assert_eq!(v["top_p"], 1.0);
    assert_eq!(v["tools"], json!([]));
    assert_eq!(v["tool_choice"], "none");
    assert_eq!(v["parallel_tool_calls"], false);
    assert_eq!(v["text"], json!({"format": {"type": "text"}}));
    assert_eq!(v["previous_response_id"], Value::Null);
    assert_eq!(v["truncation"], "disabled");
    // Streamed: the same text, in order, with the same final response.
    let (streamed, last) = response_stream(srv.addr, &body).await;
    assert_eq!(streamed, text);
    assert_eq!(last["status"], "incomplete");
    assert_eq!(last["incomplete_details"], v["incomplete_details"]);
    assert_eq!(last["usage"]["output_tokens"], 20);
    assert_eq!(last["usage"]["input_tokens"], u["input_tokens"]);
    assert_eq!(last["metadata"], v["metadata"]);
    assert_ne!(last["id"], v["id"]);
    // A stop string ends it early: completed.
    let cut = text.char_indices().nth(text.chars().count() / 2).unwrap().0;
    let stop: String = text[cut..].chars().take(3).collect();
    let stopped = with_fields(&body, json!({"stop": [stop.clone()]}));
    let v = response(srv.addr, &stopped).await;
    assert_eq!(v["status"], "completed", "{v}");
    assert_eq!(v["incomplete_details"], Value::Null, "{v}");
    assert_eq!(v["output"][0]["status"], "completed", "{v}");
    assert!(text.starts_with(&response_text(&v)), "{v}");
    let (streamed, last) = response_stream(srv.addr, &stopped).await;
    assert_eq!(streamed, response_text(&v));
    assert_eq!(last["status"], "completed");
    // Seeded sampling: streamed and not give the same text.
    let seeded = json!({"input": [{"role": "user", "content": "Lily wanted to"}],
                        "max_output_tokens": 24, "temperature": 0.7, "top_p": 0.9,
                        "top_k": 40, "seed": 11});
    let v = response(srv.addr, &seeded).await;
    assert_eq!(
        (v["temperature"].clone(), v["top_p"].clone()),
        (json!(0.7), json!(0.9))
    );
    let (streamed, _) = response_stream(srv.addr, &seeded).await;
    assert_eq!(streamed, response_text(&v));
    // /metrics counts them like chat requests: 3 cut by length, 2 stopped, 1 either way.
    let m = get(srv.addr, "/metrics").await.body;
    let ended = success_count(&m, "length") + success_count(&m, "stop");
    assert_eq!(ended, 6, "{m}");
    assert!(success_count(&m, "length") >= 2, "{m}");
    assert!(success_count(&m, "stop") >= 2, "{m}");
    assert!(wait_engine_idle(&srv.engine, Duration::from_secs(5)).await);
}

/// Greedy text and prompt size of a chat completion and of a responses request.
async fn chat_vs_response(addr: std::net::SocketAddr, messages: Value, resp: Value) {
    let chat = post(
        addr,
        "/v1/chat/completions",
        &json!({"messages": messages, "max_completion_tokens": 24, "temperature": 0}),
    )
    .await;
    assert_eq!(chat.status, 200, "{}", chat.body);
    let chat = chat.json();
    let r = response(
        addr,
        &with_fields(&resp, json!({"max_output_tokens": 24, "temperature": 0})),
    )
    .await;
    assert_eq!(
        r["usage"]["input_tokens"], chat["usage"]["prompt_tokens"],
        "{resp}"
    );
    assert_eq!(
        response_text(&r),
        chat["choices"][0]["message"]["content"].as_str().unwrap(),
        "{resp}"
    );
    assert_eq!(
        r["usage"]["output_tokens"],
        chat["usage"]["completion_tokens"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_input_forms_and_instructions_match_the_equivalent_chat() {
    let srv = start_chat(Opts::default()).await;
    let user = json!([{"role": "user", "content": "Once upon a time"}]);
    // A string is one user message; so is a message item, with either content form.
    chat_vs_response(srv.addr, user.clone(), json!({"input": "Once upon a time"})).await;
    chat_vs_response(srv.addr, user.clone(), json!({"input": user.clone()})).await;
    chat_vs_response(
        srv.addr,
        user.clone(),
        json!({"input": [{"type": "message", "role": "user",
                          "content": [{"type": "input_text", "text": "Once upon a time"}]}]}),
    )
    .await;
    // Several text parts are joined as chat joins them.
    chat_vs_response(
        srv.addr,
        json!([{"role": "user", "content": [{"type": "text", "text": "Once upon"},
                                             {"type": "text", "text": "a time"}]}]),
        json!({"input": [{"role": "user", "content": [{"type": "input_text", "text": "Once upon"},
                                                       {"type": "input_text", "text": "a time"}]}]}),
    )
    .await;
    // instructions are the system message, first.
    let sys_user = json!([{"role": "system", "content": "Tell a story."},
                          {"role": "user", "content": "Once upon a time"}]);
    chat_vs_response(
        srv.addr,
        sys_user.clone(),
        json!({"instructions": "Tell a story.", "input": "Once upon a time"}),
    )
    .await;
    let with = response(
        srv.addr,
        &json!({"instructions": "Tell a story.", "input": "Once upon a time",
                "max_output_tokens": 1}),
    )
    .await;
    assert_eq!(with["instructions"], "Tell a story.");
    let without = response(
        srv.addr,
        &json!({"input": "Once upon a time", "max_output_tokens": 1}),
    )
    .await;
    assert!(
        with["usage"]["input_tokens"].as_u64() > without["usage"]["input_tokens"].as_u64(),
        "{with} {without}"
    );
    // Empty instructions are none (no empty system turn), but are echoed; max_tool_calls is
    // echoed.
    let empty = response(
        srv.addr,
        &json!({"instructions": "", "input": "Once upon a time", "max_output_tokens": 1,
                "max_tool_calls": 3}),
    )
    .await;
    assert_eq!(
        empty["usage"]["input_tokens"], without["usage"]["input_tokens"],
        "{empty} {without}"
    );
    assert_eq!(empty["instructions"], "");
    assert_eq!(empty["max_tool_calls"], 3);
    // A multi-turn history with an assistant output message and a developer message.
    chat_vs_response(
        srv.addr,
        json!([{"role": "developer", "content": "Be kind."},
               {"role": "user", "content": "Hi"},
               {"role": "assistant", "content": "Hello there."},
               {"role": "user", "content": "Tell me about a cat."}]),
        json!({"input": [
            {"role": "developer", "content": "Be kind."},
            {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
             "content": [{"type": "output_text", "text": "Hello there.", "annotations": []}]},
            {"role": "user", "content": "Tell me about a cat."}]}),
    )
    .await;
    assert!(wait_engine_idle(&srv.engine, Duration::from_secs(5)).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_refuse_what_they_do_not_support_with_a_400_naming_it() {
    let srv = start_chat(Opts {
        max_model_len: Some(128),
        ..Opts::default()
    })
    .await;
    let cases: Vec<(Value, &str)> = vec![
        (json!({}), "input"),
        (json!({"input": []}), "input"),
        (json!({"input": 5}), "input"),
        (json!({"input": ["hi"]}), "input[0]"),
        (
            json!({"input": "hi", "previous_response_id": "resp_1"}),
            "previous_response_id",
        ),
        (json!({"input": "hi", "echo": true}), "echo"),
        (
            json!({"input": "hi", "return_token_ids": true}),
            "return_token_ids",
        ),
        (
            json!({"input": "hi", "continue_final_message": true}),
            "continue_final_message",
        ),
        (
            json!({"input": "hi", "add_generation_prompt": false}),
            "add_generation_prompt",
        ),
        (
            json!({"input": "hi", "conversation": "conv_1"}),
            "conversation",
        ),
        // Auto tool choice (the default with tools) needs the server's parser flags.
        (
            json!({"input": "hi", "tools": [{"type": "function", "name": "f"}]}),
            "tool_choice",
        ),
        (
            json!({"input": "hi", "tool_choice": "required"}),
            "tool_choice",
        ),
        (json!({"input": "hi", "tools": {"name": "f"}}), "tools"),
        (
            json!({"input": "hi", "max_tool_calls": -1}),
            "max_tool_calls",
        ),
        (
            json!({"input": "hi", "metadata": {"k": "v".repeat(513)}}),
            "metadata",
        ),
        (
            json!({"input": [{"role": "user", "content": "x", "status": "weird"}]}),
            "input[0].status",
        ),
        (
            json!({"input": "hi", "max_output_tokens": 1_000_000_000_000u64}),
            "max_output_tokens",
        ),
        (
            json!({"input": "hi", "tools": [{"type": "web_search"}]}),
            "tools[0].type",
        ),
        (
            json!({"input": "hi", "tools": [{"name": "f"}]}),
            "tools[0].type",
        ),
        (
            json!({"input": "hi", "tools": [{"type": "function", "function": {"name": "f"}}]}),
            "tools[0].name",
        ),
        (
            json!({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": "x"}]}),
            "tools[0].parameters",
        ),
        (
            json!({"input": "hi", "tools": [{"type": "function", "name": "f", "strict": "yes"}]}),
            "tools[0].strict",
        ),
        (
            json!({"input": "hi", "tools": [{"type": "function", "name": "f"}],
                   "tool_choice": {"type": "function", "name": "g"}}),
            "tool_choice",
        ),
        (
            json!({"input": "hi", "tools": [{"type": "function", "name": "f"}],
                   "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}),
            "tool_choice",
        ),
        (
            json!({"input": "hi", "tools": [{"type": "function", "name": "f"}],
                   "tool_choice": {"type": "function", "function": {"name": "f"}}}),
            "tool_choice",
        ),
        (
            json!({"input": "hi", "tools": [{"type": "function", "name": "f"}],
                   "tool_choice": 3}),
            "tool_choice",
        ),
        (
            json!({"input": "hi", "tools": [{"type": "function", "name": "f"}],
                   "tool_choice": "required", "text": {"format": {"type": "json_object"}}}),
            "tool_choice",
        ),
        (
            json!({"input": "hi", "tools": [{"type": "function", "name": "f"}],
                   "tool_choice": "required", "include": ["message.output_text.logprobs"]}),
            "include",
        ),
        (
            json!({"input": "hi", "tool_choice": {"type": "function", "name": "f"}}),
            "tool_choice",
        ),
        (
            json!({"input": "hi", "reasoning": {"effort": "high"}}),
            "reasoning",
        ),
        (
            json!({"input": "hi", "text": {"format": {"type": "yaml"}}}),
            "text.format",
        ),
        (
            json!({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}),
            "text.format",
        ),
        (
            json!({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                   "schema": {"type": "nosuchtype"}}}}),
            "text.format",
        ),
        (
            json!({"input": "hi", "text": {"format": {"type": "json_object"}},
                   "guided_regex": "a+"}),
            "text.format",
        ),
        (json!({"input": "hi", "background": true}), "background"),
        (json!({"input": "hi", "truncation": "middle"}), "truncation"),
        // Too long for the context even after dropping every item but the last.
        (
            json!({"input": [{"role": "user", "content": "Once upon a time ".repeat(60)}],
                   "truncation": "auto"}),
            "input",
        ),
        (json!({"input": "hi", "prompt": {"id": "pmpt_1"}}), "prompt"),
        (
            json!({"input": "hi", "max_output_tokens": 0}),
            "max_output_tokens",
        ),
        (
            json!({"input": "hi", "max_output_tokens": "x"}),
            "max_output_tokens",
        ),
        (
            json!({"input": "hi", "max_output_tokens": 1000}),
            "max_output_tokens",
        ),
        (json!({"input": "hi", "max_tokens": 5}), "max_tokens"),
        (json!({"input": "hi", "n": 2}), "n"),
        (json!({"input": "hi", "temperature": -1}), "temperature"),
        (json!({"input": "hi", "top_p": 0}), "top_p"),
        (json!({"input": "hi", "metadata": {"k": 1}}), "metadata"),
        (json!({"input": "hi", "instructions": 3}), "instructions"),
        (json!({"input": "hi", "store": "yes"}), "store"),
        (
            json!({"input": "hi", "min_tokens": 9, "max_output_tokens": 4}),
            "min_tokens",
        ),
        (
            json!({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}),
            "input[0].call_id",
        ),
        (
            json!({"input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]}),
            "input[0].name",
        ),
        (
            json!({"input": [{"type": "function_call", "call_id": "c", "name": "f",
                              "arguments": "{bad"}]}),
            "input[0].arguments",
        ),
        (
            json!({"input": [{"type": "function_call", "call_id": "c", "name": "f",
                              "arguments": {"city": "x"}}]}),
            "input[0].arguments",
        ),
        (
            json!({"input": [{"type": "function_call_output", "output": "x"}]}),
            "input[0].call_id",
        ),
        (
            json!({"input": [{"type": "function_call_output", "call_id": "c"}]}),
            "input[0].output",
        ),
        (
            json!({"input": [{"type": "function_call_output", "call_id": "c",
                              "output": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}),
            "input[0].output[0]",
        ),
        (
            json!({"input": [{"type": "item_reference", "id": "msg_1"}]}),
            "input[0].type",
        ),
        (
            json!({"input": [{"type": "input_image", "image_url": "http://x/y.png"}]}),
            "input[0].type",
        ),
        (
            json!({"input": [{"role": "tool", "content": "x"}]}),
            "input[0].role",
        ),
        (json!({"input": [{"content": "x"}]}), "input[0].role"),
        (json!({"input": [{"role": "user"}]}), "input[0].content"),
        (
            json!({"input": [{"role": "user", "content": "a"},
                             {"role": "user", "content": [
                                 {"type": "input_text", "text": "look"},
                                 {"type": "input_image", "image_url": "http://x/y.png"}]}]}),
            "input[1].content[1]",
        ),
        (
            json!({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}),
            "input[0].content[0]",
        ),
        (json!({"input": "Once upon a time ".repeat(60)}), "input"),
    ];
    for (body, param) in cases {
        let r = post(srv.addr, "/v1/responses", &body).await;
        assert_eq!(r.status, 400, "{body}: {}", r.body);
        let e = r.json();
        assert_eq!(e["error"]["param"], param, "{body}: {e}");
        assert_eq!(e["error"]["type"], "invalid_request_error", "{body}: {e}");
        assert!(e["error"]["message"].as_str().unwrap().len() > 10, "{e}");
    }
    let r = post(
        srv.addr,
        "/v1/responses",
        &json!({"model": "other", "input": "hi"}),
    )
    .await;
    assert_eq!(r.status, 404, "{}", r.body);
    assert_eq!(r.json()["error"]["param"], "model");
    // Nothing is stored, so there is nothing to get.
    let r = get(srv.addr, "/v1/responses/resp_0123").await;
    assert_eq!(r.status, 404, "{}", r.body);
    assert!(r.json()["error"].is_object());
    // None of them reached the engine.
    let m = get(srv.addr, "/metrics").await.body;
    assert!(
        m.contains("vllm:prompt_tokens_total{model_name=\"stories\"} 0"),
        "{m}"
    );
    // Without a chat template it is a clear 400 too.
    let plain = start(Opts::default()).await;
    let r = post(plain.addr, "/v1/responses", &json!({"input": "hi"})).await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("chat template"));
}

/// Posts the streamed `body` to `path`, reads `events` events (one containing `marker`) while
/// the request runs, then drops the connection; checks the engine goes idle within a few
/// launches (the request was cancelled, not run to its end).
async fn drop_mid_stream(
    srv: &common::TestServer,
    path: &str,
    body: &Value,
    events: usize,
    marker: &str,
) {
    let mut s = tokio::net::TcpStream::connect(srv.addr).await.unwrap();
    s.write_all(&common::request_bytes("POST", path, &[], &body.to_string()))
        .await
        .unwrap();
    let head = read_events(&mut s, events).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(head.contains(marker), "{head}");
    let st = srv.engine.scheduler_stats();
    assert_eq!(st.running + st.waiting, 1, "live: {st:?}");
    drop(s);
    let at_drop = srv.engine.scheduler_stats().launches;
    assert!(
        wait_engine_idle(&srv.engine, Duration::from_secs(5)).await,
        "cancelled: {:?}",
        srv.engine.scheduler_stats()
    );
    let launches = srv.engine.scheduler_stats().launches;
    assert!(
        launches < at_drop + 100,
        "{at_drop} launches at the drop, {launches} at the end"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_client_disconnect_mid_stream_cancels() {
    let srv = start_chat(Opts {
        step_delay: Some(Duration::from_millis(3)),
        ..Opts::default()
    })
    .await;
    let body = json!({"input": "Once upon a time", "max_output_tokens": 400, "ignore_eos": true,
                      "stream": true});
    // The four opening events and a few deltas.
    drop_mid_stream(
        &srv,
        "/v1/responses",
        &body,
        8,
        "event: response.output_text.delta",
    )
    .await;
    let m = get(srv.addr, "/metrics").await.body;
    assert_eq!(success_count(&m, "abort"), 1, "{m}");
    // Non-streamed: the same on a disconnect while waiting.
    let body = json!({"input": "Once upon a time", "max_output_tokens": 400, "ignore_eos": true})
        .to_string();
    let mut s = tokio::net::TcpStream::connect(srv.addr).await.unwrap();
    s.write_all(&common::request_bytes("POST", "/v1/responses", &[], &body))
        .await
        .unwrap();
    let start = std::time::Instant::now();
    while srv.engine.scheduler_stats().running == 0 {
        assert!(start.elapsed() < Duration::from_secs(10));
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    drop(s);
    let at_drop = srv.engine.scheduler_stats().launches;
    assert!(wait_engine_idle(&srv.engine, Duration::from_secs(5)).await);
    assert!(srv.engine.scheduler_stats().launches < at_drop + 100);
    let m = get(srv.addr, "/metrics").await.body;
    assert_eq!(success_count(&m, "abort"), 2, "{m}");
}

/// A scripted server (the Llama-2 template) whose engine sends two tokens and then fails
/// every request with "the scheduler is gone".
async fn failing_engine_server() -> (std::net::SocketAddr, tokio::task::JoinHandle<()>) {
    use baton_frontend::EngineEvent;
    let token = |t| EngineEvent::Token {
        token: t,
        cached_tokens: 0,
        logprob: 0.0,
        top: vec![],
        first: None,
    };
    common::start_scripted_with_template(
        move |_| {
            vec![
                token(403),
                token(407),
                EngineEvent::Error("the scheduler is gone".into()),
            ]
        },
        Some(LLAMA2_TEMPLATE.into()),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_engine_error_mid_stream_ends_with_error_and_response_failed() {
    use baton_frontend::EngineEvent;
    let token = |t| EngineEvent::Token {
        token: t,
        cached_tokens: 0,
        logprob: 0.0,
        top: vec![],
        first: None,
    };
    let (addr, task) = failing_engine_server().await;
    let r = post(
        addr,
        "/v1/responses",
        &json!({"input": "a", "stream": true}),
    )
    .await;
    assert!(!r.body.contains("[DONE]"), "{}", r.body);
    let ev = response_events(&r);
    let kinds: Vec<&str> = ev.iter().map(|(k, _)| k.as_str()).collect();
    let n = kinds.len();
    assert_eq!(kinds[n - 2..], ["error", "response.failed"], "{kinds:?}");
    assert!(!kinds.contains(&"response.completed"), "{kinds:?}");
    for (i, (kind, d)) in ev.iter().enumerate() {
        assert_eq!(d["sequence_number"], i, "{d}");
        assert_eq!(d["type"], kind.as_str(), "{d}");
    }
    assert!(ev[n - 2].1["message"]
        .as_str()
        .unwrap()
        .contains("scheduler is gone"));
    let failed = &ev[n - 1].1["response"];
    assert_eq!(failed["status"], "failed", "{failed}");
    assert!(failed["error"]["message"]
        .as_str()
        .unwrap()
        .contains("scheduler is gone"));
    let deltas: String = ev
        .iter()
        .filter(|(k, _)| k == "response.output_text.delta")
        .map(|(_, d)| d["delta"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(failed["output"][0]["content"][0]["text"], deltas.as_str());
    assert_eq!(failed["usage"]["output_tokens"], 2);
    // Not streamed: a 500 with an OpenAI error body.
    let r = post(addr, "/v1/responses", &json!({"input": "a"})).await;
    assert_eq!(r.status, 500, "{}", r.body);
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("scheduler is gone"));
    // An EOS finish is "completed".
    task.abort();
    let (addr, task) = common::start_scripted_with_template(
        move |req| {
            vec![
                token(403),
                token(common::EOS),
                EngineEvent::Finished {
                    reason: baton_scheduler::FinishReason::Stop,
                    prompt_tokens: req.prompt.len(),
                    output_tokens: 2,
                    cached_tokens: 0,
                },
            ]
        },
        Some(LLAMA2_TEMPLATE.into()),
    )
    .await;
    let v = response(addr, &json!({"input": "a"})).await;
    assert_eq!(v["status"], "completed", "{v}");
    assert_eq!(v["usage"]["output_tokens"], 2, "{v}");
    let (text, last) = response_stream(addr, &json!({"input": "a"})).await;
    assert_eq!(text, response_text(&v));
    assert_eq!(last["status"], "completed");
    task.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn version_reports_the_crate_version() {
    let srv = start(Opts::default()).await;
    let r = get(srv.addr, "/version").await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json(), json!({"version": env!("CARGO_PKG_VERSION")}));
}

// ---------------------------------------------------------------------------------------------
// Tool calling (`--enable-auto-tool-choice --tool-call-parser ...`).

/// A template that prints the tools, each message with its tool calls (arguments through
/// `tojson` and one field read as an object) and tool call id, so a test can read the prompt.
const TOOLS_TEMPLATE: &str = "{% for t in tools or [] %}TOOL {{ t.function.name }}: {{ t.function.parameters | tojson }}\n{% endfor %}{% for m in messages %}{{ m.role }}: {{ m.content }}{% for c in m.tool_calls or [] %} CALL {{ c.function.name }}({{ c.function.arguments | tojson }}) CITY={{ c.function.arguments.city }}{% endfor %}{% if m.tool_call_id %} [{{ m.tool_call_id }}]{% endif %}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}";

fn weather_tool() -> Value {
    json!({"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}})
}

/// A scripted server whose model writes `text` (its tokens, then a stop), with the given tool
/// call parser (and auto tool choice) or none; the prompts it received are kept. The output
/// text is `" " + text`: stories260K's tokenizer starts a text with a word-boundary piece,
/// which the streaming detokenizer shows as a space.
async fn tool_server(
    text: &str,
    parser: Option<baton_frontend::tools::ToolParser>,
) -> (
    std::net::SocketAddr,
    tokio::task::JoinHandle<()>,
    std::sync::Arc<std::sync::Mutex<Vec<Vec<u32>>>>,
    usize,
) {
    text_server(text, parser, None, baton_scheduler::FinishReason::Stop).await
}

/// [`tool_server`] with a reasoning parser and the finish reason the engine gives.
async fn text_server(
    text: &str,
    parser: Option<baton_frontend::tools::ToolParser>,
    reasoning: Option<baton_frontend::reasoning::ReasoningParser>,
    finish: baton_scheduler::FinishReason,
) -> (
    std::net::SocketAddr,
    tokio::task::JoinHandle<()>,
    std::sync::Arc<std::sync::Mutex<Vec<Vec<u32>>>>,
    usize,
) {
    let tok = common::stories_tokenizer();
    let ids = tok.encode(text, false).unwrap();
    assert_eq!(
        tok.decode(&ids, true).unwrap(),
        text,
        "the test text round-trips"
    );
    let first = tok.id_to_piece(ids[0]).unwrap();
    assert!(first.starts_with('\u{2581}'), "{first}");
    let prompts = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = prompts.clone();
    let n = ids.len();
    let (addr, task) = common::start_scripted_with_parsers(
        move |req| {
            seen.lock().unwrap().push(req.prompt.clone());
            common::token_events(&ids, -0.5, req.prompt.len(), finish)
        },
        Some(TOOLS_TEMPLATE.into()),
        parser,
        reasoning,
    )
    .await;
    (addr, task, prompts, n)
}

/// The messages and finish reasons a streamed chat response accumulates to, as the openai
/// SDK's stream helper builds them: content concatenated (null if none came), tool calls
/// merged by index (arguments concatenated).
fn accumulate_chat_stream(r: &common::Resp) -> Vec<(Value, Value)> {
    assert_eq!(r.status, 200, "{}", r.body);
    let ev = r.events();
    assert_eq!(ev.last().map(String::as_str), Some("[DONE]"));
    let mut out: Vec<(Value, Value)> = Vec::new();
    for e in &ev[..ev.len() - 1] {
        let v: Value = serde_json::from_str(e).unwrap();
        assert!(v.get("error").is_none(), "{e}");
        for c in v["choices"].as_array().unwrap() {
            let i = c["index"].as_u64().unwrap() as usize;
            while out.len() <= i {
                out.push((json!({"role": "assistant", "content": null}), Value::Null));
            }
            let (msg, finish) = &mut out[i];
            let d = &c["delta"];
            for key in ["content", "reasoning", "reasoning_content"] {
                if let Some(t) = d[key].as_str() {
                    let prev = msg[key].as_str().unwrap_or("").to_owned();
                    msg[key] = json!(prev + t);
                }
            }
            for tc in d["tool_calls"].as_array().into_iter().flatten() {
                let calls = msg
                    .as_object_mut()
                    .unwrap()
                    .entry("tool_calls")
                    .or_insert(json!([]));
                let k = tc["index"].as_u64().unwrap() as usize;
                let list = calls.as_array_mut().unwrap();
                while list.len() <= k {
                    list.push(json!({"function": {"arguments": ""}}));
                }
                let slot = &mut list[k];
                for key in ["id", "type"] {
                    if let Some(x) = tc.get(key) {
                        slot[key] = x.clone();
                    }
                }
                if let Some(name) = tc["function"].get("name") {
                    slot["function"]["name"] = name.clone();
                }
                let args = slot["function"]["arguments"].as_str().unwrap().to_owned();
                slot["function"]["arguments"] =
                    json!(args + tc["function"]["arguments"].as_str().unwrap_or(""));
            }
            if !c["finish_reason"].is_null() {
                *finish = c["finish_reason"].clone();
            }
        }
    }
    // An empty streamed content is what a null one accumulates to in the SDK.
    for (m, _) in &mut out {
        if m["content"] == json!("") {
            m["content"] = Value::Null;
        }
    }
    out
}

/// A message with the tool call ids replaced by a placeholder (after checking their form).
fn without_ids(mut m: Value) -> Value {
    let calls = m.get_mut("tool_calls").and_then(Value::as_array_mut);
    for c in calls.into_iter().flatten() {
        let id = c["id"].as_str().unwrap();
        // vLLM's form, or the `mistral` parser's 9 letters and digits.
        let ok = match id.strip_prefix("chatcmpl-tool-") {
            Some(hex) => !hex.is_empty() && hex.chars().all(|c| c.is_ascii_hexdigit()),
            None => id.len() == 9 && id.chars().all(|c| c.is_ascii_alphanumeric()),
        };
        assert!(ok, "{id}");
        c["id"] = json!("ID");
    }
    m
}

/// Posts `body` streamed and not; checks that both give the same messages and finish reasons
/// and returns them (ids replaced).
async fn chat_both_ways(addr: std::net::SocketAddr, body: &Value) -> Vec<(Value, Value)> {
    let r = post(addr, "/v1/chat/completions", body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let whole: Vec<(Value, Value)> = v["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                without_ids(c["message"].clone()),
                c["finish_reason"].clone(),
            )
        })
        .collect();
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    let r = post(addr, "/v1/chat/completions", &sb).await;
    let streamed: Vec<(Value, Value)> = accumulate_chat_stream(&r)
        .into_iter()
        .map(|(m, f)| (without_ids(m), f))
        .collect();
    assert_eq!(streamed, whole, "streamed vs not for {body}");
    whole
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hermes_tool_calls_come_back_as_tool_calls_streamed_and_not() {
    use baton_frontend::tools::ToolParser;
    let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\", \"note\": \"café ☕ \\\"x\\\"\"}}\n</tool_call>";
    let (addr, task, _, n_out) = tool_server(text, Some(ToolParser::Hermes)).await;
    let body = json!({"messages": [{"role": "user", "content": "Weather?"}],
                      "tools": [weather_tool()], "n": 2});
    let r = post(addr, "/v1/chat/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["usage"]["completion_tokens"], 2 * n_out);
    let ids: Vec<&str> = v["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["message"]["tool_calls"][0]["id"].as_str().unwrap())
        .collect();
    assert_ne!(ids[0], ids[1], "each call has its own id");
    let out = chat_both_ways(addr, &body).await;
    assert_eq!(out.len(), 2);
    for (msg, finish) in out {
        assert_eq!(finish, "tool_calls");
        assert_eq!(msg["content"], " Let me check.\n");
        let calls = msg["tool_calls"].as_array().unwrap();
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0]["type"], "function");
        assert_eq!(calls[0]["function"]["name"], "get_weather");
        // The arguments as vLLM writes them (Python's json.dumps, unicode kept).
        assert_eq!(
            calls[0]["function"]["arguments"],
            "{\"city\": \"Zürich\", \"note\": \"café ☕ \\\"x\\\"\"}"
        );
    }
    task.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mistral_tool_calls_come_back_with_ids_mistral_templates_accept() {
    use baton_frontend::tools::ToolParser;
    let text = "Checking. [TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}]";
    let (addr, task, _, _) = tool_server(text, Some(ToolParser::Mistral)).await;
    let body = json!({"messages": [{"role": "user", "content": "Weather?"}],
                      "tools": [weather_tool()], "n": 2});
    let r = post(addr, "/v1/chat/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    for c in r.json()["choices"].as_array().unwrap() {
        // Mistral's chat templates raise on a tool_call_id that is not 9 letters and digits.
        let id = c["message"]["tool_calls"][0]["id"].as_str().unwrap();
        assert!(
            id.len() == 9 && id.chars().all(|c| c.is_ascii_alphanumeric()),
            "{id}"
        );
    }
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    let r = post(addr, "/v1/chat/completions", &sb).await;
    assert!(r.body.contains("\"tool_calls\""), "{}", r.body);
    for (msg, finish) in chat_both_ways(addr, &body).await {
        assert_eq!(finish, "tool_calls");
        assert_eq!(msg["content"], " Checking. ");
        let calls = msg["tool_calls"].as_array().unwrap();
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0]["function"]["name"], "get_weather");
        assert_eq!(calls[0]["function"]["arguments"], "{\"city\": \"Paris\"}");
    }
    task.abort();
}

/// The `(name, arguments)` of a message's `tool_calls`.
fn call_names_and_arguments(msg: &Value) -> Vec<(&str, &str)> {
    msg["tool_calls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["function"]["name"].as_str().unwrap(),
                c["function"]["arguments"].as_str().unwrap(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pythonic_tool_calls_come_back_as_json_arguments() {
    use baton_frontend::tools::ToolParser;
    let text = "[get_weather(city='Paris', days=2), get_time(tz=\"CET\", exact=True)]";
    let (addr, task, _, _) = tool_server(text, Some(ToolParser::Pythonic)).await;
    let body = json!({"messages": [{"role": "user", "content": "Weather?"}],
                      "tools": [weather_tool()]});
    for (msg, finish) in chat_both_ways(addr, &body).await {
        assert_eq!(finish, "tool_calls");
        assert_eq!(msg["content"], Value::Null);
        assert_eq!(
            call_names_and_arguments(&msg),
            [
                ("get_weather", "{\"city\": \"Paris\", \"days\": 2}"),
                ("get_time", "{\"tz\": \"CET\", \"exact\": true}")
            ]
        );
    }
    task.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn llama3_json_tool_calls_come_back_with_null_content() {
    use baton_frontend::tools::ToolParser;
    let text = "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}; {\"name\": \"get_time\", \"parameters\": {\"tz\": \"CET\", \"fmt\": [1, 2.5]}}";
    let (addr, task, _, _) = tool_server(text, Some(ToolParser::Llama3Json)).await;
    let body = json!({"messages": [{"role": "user", "content": "Weather?"}],
                      "tools": [weather_tool()], "tool_choice": "auto",
                      "logprobs": true});
    let out = chat_both_ways(addr, &body).await;
    let (msg, finish) = &out[0];
    assert_eq!(finish, "tool_calls");
    assert_eq!(msg["content"], Value::Null);
    assert_eq!(
        call_names_and_arguments(msg),
        [
            ("get_weather", "{\"city\": \"Paris\"}"),
            ("get_time", "{\"tz\": \"CET\", \"fmt\": [1, 2.5]}")
        ]
    );
    task.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn output_that_is_not_a_tool_call_or_tool_choice_none_is_plain_content() {
    use baton_frontend::tools::ToolParser;
    let hermes_call = "<tool_call>{\"name\": \"get_weather\", \"arguments\": {}}</tool_call>";
    let cases: [(&str, ToolParser, Value); 5] = [
        ("Once upon a time.", ToolParser::Hermes, json!("auto")),
        ("Once upon a time.", ToolParser::Llama3Json, json!("auto")),
        (
            "{\"name\": \"get_weather\"",
            ToolParser::Llama3Json,
            json!("auto"),
        ),
        (
            "Hm <tool_call>{not json}</tool_call>",
            ToolParser::Hermes,
            json!("auto"),
        ),
        (hermes_call, ToolParser::Hermes, json!("none")),
    ];
    for (text, parser, choice) in cases {
        let (addr, task, _, _) = tool_server(text, Some(parser)).await;
        let body = json!({"messages": [{"role": "user", "content": "Weather?"}],
                          "tools": [weather_tool()], "tool_choice": choice});
        let out = chat_both_ways(addr, &body).await;
        assert_eq!(
            out[0],
            (
                json!({"role": "assistant", "content": format!(" {text}")}),
                json!("stop")
            ),
            "{text}"
        );
        task.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tools_and_tool_messages_reach_the_template() {
    // No tool flags: tool_choice "none" still renders the tools (vLLM's default).
    let (addr, task, prompts, _) = tool_server("It is sunny.", None).await;
    let body = json!({
    "tools": [weather_tool()], "tool_choice": "none",
    "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C, sunny"},
    ]});
    let r = post(addr, "/v1/chat/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        r.json()["choices"][0]["message"]["content"],
        " It is sunny."
    );
    let tok = common::stories_tokenizer();
    let prompt = tok.decode(&prompts.lock().unwrap()[0], true).unwrap();
    assert_eq!(
        prompt,
        // (trim_blocks, as transformers: no newline after a block tag; keys in the request's
        // order, as Python's dicts keep them)
        "TOOL get_weather: {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}}, \"required\": [\"city\"]}\n\
         user: Weather in Paris?\
         assistant:  CALL get_weather({\"city\": \"Paris\"}) CITY=Paris\
         tool: 22 C, sunny [call_1]\
         assistant:"
    );
    // Arguments given as an object pass as they are; without tools, `tools` is none.
    let body = json!({"messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "tool_call_id": "c", "content": "cold"}]});
    let r = post(addr, "/v1/chat/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let prompt = tok.decode(&prompts.lock().unwrap()[1], true).unwrap();
    assert!(prompt.starts_with("user: Weather?assistant:"), "{prompt}");
    assert!(prompt.contains("CITY=Oslo"), "{prompt}");
    task.abort();
}

/// `tool_choice` `required` and a named function are structured outputs (no parser flags
/// needed): the real model's output is a call of the named function with arguments valid
/// under its parameters, or a non-empty list of calls of the given tools; streamed, the same
/// calls arrive in one delta.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_choice_required_and_named_guide_the_output_into_calls() {
    let srv = start_chat(Opts::default()).await;
    let city = |names: &[&str]| {
        json!({"type": "object", "properties": {"city": {"type": "string", "enum": names}},
               "required": ["city"], "additionalProperties": false})
    };
    // get_time's parameters reach their enum through `$defs`, as pydantic writes nested models.
    let time_params = json!({"$defs": {"City": {"type": "string", "enum": ["Oslo", "Lima"]}},
                             "type": "object", "properties": {"city": {"$ref": "#/$defs/City"}},
                             "required": ["city"], "additionalProperties": false});
    let tools = json!([
        {"type": "function", "function": {"name": "get_weather", "parameters": city(&["Paris", "Rome"])}},
        {"type": "function", "function": {"name": "get_time", "parameters": time_params}},
    ]);
    let msgs = json!([{"role": "user", "content": "Once upon a time"}]);
    // (With parallel calls, this small model lists calls until max_tokens: the required case
    // asks for one.)
    let cases = [
        (
            json!({"type": "function", "function": {"name": "get_time"}}),
            Some("get_time"),
        ),
        (json!("required"), None),
    ];
    for (choice, named) in cases {
        for temperature in [0.0, 1.0] {
            let body = json!({"model": MODEL, "messages": msgs, "tools": tools,
                              "tool_choice": choice, "max_tokens": 60,
                              "parallel_tool_calls": false,
                              "temperature": temperature, "seed": 5});
            let r = post(srv.addr, "/v1/chat/completions", &body).await;
            assert_eq!(r.status, 200, "{}", r.body);
            let v = r.json();
            let c = &v["choices"][0];
            // OpenAI's and vLLM's: `stop` for a named function, `tool_calls` for required.
            let want = if named.is_some() {
                "stop"
            } else {
                "tool_calls"
            };
            assert_eq!(c["finish_reason"], want, "{v}");
            assert_eq!(c["message"]["content"], Value::Null, "{v}");
            let calls = c["message"]["tool_calls"].as_array().unwrap();
            assert!(!calls.is_empty(), "{v}");
            for call in calls {
                let name = call["function"]["name"].as_str().unwrap();
                let args: Value =
                    serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
                let cities: &[&str] = match name {
                    "get_weather" => &["Paris", "Rome"],
                    "get_time" => &["Oslo", "Lima"],
                    _ => panic!("unknown function {name}: {v}"),
                };
                if let Some(n) = named {
                    assert_eq!(name, n, "{v}");
                }
                assert!(cities.contains(&args["city"].as_str().unwrap()), "{v}");
                assert_eq!(args.as_object().unwrap().len(), 1, "{v}");
            }
            // Streamed: the calls come in one delta, with no content.
            let mut s = body.clone();
            s["stream"] = json!(true);
            let r = post(srv.addr, "/v1/chat/completions", &s).await;
            let mut streamed = Vec::new();
            let mut content = String::new();
            let mut finish = Value::Null;
            for line in r.body.lines().filter_map(|l| l.strip_prefix("data: ")) {
                if line == "[DONE]" {
                    break;
                }
                let ch: Value = serde_json::from_str(line).unwrap();
                let d = &ch["choices"][0];
                content.push_str(d["delta"]["content"].as_str().unwrap_or(""));
                if let Some(t) = d["delta"]["tool_calls"].as_array() {
                    streamed.extend(t.iter().map(|t| t["function"].clone()));
                }
                if !d["finish_reason"].is_null() {
                    finish = d["finish_reason"].clone();
                }
            }
            assert_eq!(content, "", "{}", r.body);
            assert_eq!(finish, want, "{}", r.body);
            let plain: Vec<Value> = calls.iter().map(|c| c["function"].clone()).collect();
            assert_eq!(streamed, plain, "{}", r.body);
        }
    }
    // A function without parameters, and one whose parameters leave additionalProperties out:
    // no keys but those named (vLLM's default backend generates no others).
    let open = json!({"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                      "required": ["city"]});
    let tools2 = json!([
        {"type": "function", "function": {"name": "ping"}},
        {"type": "function", "function": {"name": "get_city", "parameters": open}},
    ]);
    for (name, keys) in [("ping", 0), ("get_city", 1)] {
        let body = json!({"model": MODEL, "messages": msgs, "tools": tools2, "max_tokens": 60,
                          "tool_choice": {"type": "function", "function": {"name": name}}});
        let r = post(srv.addr, "/v1/chat/completions", &body).await;
        let v = r.json();
        let c = &v["choices"][0];
        assert_eq!(c["finish_reason"], "stop", "{v}");
        let args = c["message"]["tool_calls"][0]["function"]["arguments"]
            .as_str()
            .unwrap();
        let args: Value = serde_json::from_str(args).unwrap();
        assert_eq!(args.as_object().unwrap().len(), keys, "{v}");
    }
    // Cut short by max_tokens: a named call keeps its partial arguments but says `length`
    // (as vLLM); a required list that does not parse is content.
    for (choice, calls) in [
        (
            json!({"type": "function", "function": {"name": "get_time"}}),
            true,
        ),
        (json!("required"), false),
    ] {
        let body = json!({"model": MODEL, "messages": msgs, "tools": tools,
                          "tool_choice": choice, "max_tokens": 4, "temperature": 0});
        let r = post(srv.addr, "/v1/chat/completions", &body).await;
        let v = r.json();
        let c = &v["choices"][0];
        assert_eq!(c["finish_reason"], "length", "{v}");
        assert_eq!(c["message"]["tool_calls"].is_array(), calls, "{v}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_requests_this_server_cannot_serve_are_a_400_naming_the_field() {
    use baton_frontend::tools::ToolParser;
    let msgs = json!([{"role": "user", "content": "x"}]);
    let tools = json!([weather_tool()]);
    // Without the flags: auto (the default with tools) is refused with vLLM's message.
    let (addr, task, _, _) = tool_server("x", None).await;
    for extra in [
        json!({"tools": tools}),
        json!({"tools": tools, "tool_choice": "auto"}),
    ] {
        let body = with_fields(&json!({"messages": msgs}), extra);
        let r = post(addr, "/v1/chat/completions", &body).await;
        assert_eq!(r.status, 400, "{body}");
        let e = &r.json()["error"];
        assert_eq!(e["param"], "tool_choice");
        let m = e["message"].as_str().unwrap();
        assert!(
            m.contains("--enable-auto-tool-choice") && m.contains("--tool-call-parser"),
            "{m}"
        );
    }
    task.abort();
    let (addr, task, _, _) = tool_server("x", Some(ToolParser::Hermes)).await;
    let cases: Vec<(Value, &str)> = vec![
        (
            json!({"tools": tools, "tool_choice":
                   {"type": "function", "function": {"name": "no_such_function"}}}),
            "tool_choice",
        ),
        (
            json!({"tools": tools, "tool_choice": {"type": "function", "function": {}}}),
            "tool_choice",
        ),
        (
            json!({"tools": tools, "tool_choice": "required",
                   "response_format": {"type": "json_object"}}),
            "tool_choice",
        ),
        (
            json!({"tools": tools, "tool_choice": "required", "min_tokens": 2}),
            "tool_choice",
        ),
        (json!({"tool_choice": "required"}), "tool_choice"),
        (json!({"tool_choice": "auto"}), "tool_choice"),
        (json!({"tools": tools, "tool_choice": 3}), "tool_choice"),
        // A parameters schema that does not compile is the tools' fault.
        (
            json!({"tool_choice": "required", "tools": [{"type": "function",
                   "function": {"name": "f", "parameters": {"type": "banana"}}}]}),
            "tools",
        ),
        (json!({"tools": {"a": 1}}), "tools"),
        (json!({"tools": [5]}), "tools[0]"),
        (
            json!({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}),
            "tools[0].type",
        ),
        (
            json!({"tools": [{"type": "function"}]}),
            "tools[0].function",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": ""}}]}),
            "tools[0].function.name",
        ),
        (
            json!({"tools": [weather_tool(), {"type": "function", "function": {"description": "d"}}]}),
            "tools[1].function.name",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}),
            "tools[0].function.parameters",
        ),
        (
            json!({"parallel_tool_calls": "maybe"}),
            "parallel_tool_calls",
        ),
    ];
    for (extra, param) in cases {
        let body = with_fields(&json!({"messages": msgs}), extra);
        let r = post(addr, "/v1/chat/completions", &body).await;
        assert_eq!(r.status, 400, "{body}: {}", r.body);
        assert_eq!(r.json()["error"]["param"], param, "{body}");
    }
    let bad_messages: Vec<(Value, &str)> = vec![
        (
            json!([{"role": "user", "content": "x"},
                   {"role": "assistant", "tool_calls": [
                       {"id": "c", "type": "function",
                        "function": {"name": "f", "arguments": "{not json"}}]}]),
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            json!([{"role": "assistant", "tool_calls": "f"}]),
            "messages[0].tool_calls",
        ),
        (
            json!([{"role": "assistant", "tool_calls": [{"id": "c"}]}]),
            "messages[0].tool_calls[0].function",
        ),
        (
            json!([{"role": "tool", "tool_call_id": 7, "content": "x"}]),
            "messages[0].tool_call_id",
        ),
        (
            json!([{"role": "tool", "tool_call_id": "c"}]),
            "messages[0].content",
        ),
    ];
    for (messages, param) in bad_messages {
        let body = json!({"messages": messages});
        let r = post(addr, "/v1/chat/completions", &body).await;
        assert_eq!(r.status, 400, "{body}: {}", r.body);
        assert_eq!(r.json()["error"]["param"], param, "{body}");
    }
    // Completions take no tools; /v1/responses takes them in its flat form only.
    let r = post(
        addr,
        "/v1/completions",
        &json!({"prompt": "x", "tools": tools}),
    )
    .await;
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["param"], "tools");
    let r = post(
        addr,
        "/v1/responses",
        &json!({"input": "x", "tools": tools}),
    )
    .await;
    assert_eq!(r.status, 400);
    let e = r.json();
    assert_eq!(e["error"]["param"], "tools[0].name");
    assert!(
        e["error"]["message"].as_str().unwrap().contains("flat"),
        "{e}"
    );
    task.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hermes_and_mistral_keep_special_tokens_in_the_output_they_parse() {
    for parser in [
        baton_frontend::tools::ToolParser::Hermes,
        baton_frontend::tools::ToolParser::Mistral,
    ] {
        keeps_special_tokens(parser).await;
    }
}

async fn keeps_special_tokens(parser: baton_frontend::tools::ToolParser) {
    use baton_frontend::EngineEvent;
    use baton_scheduler::FinishReason;
    // The model writes a word, then BOS (a special token, as `<tool_call>` is in the models
    // that use hermes), then a stop.
    let (addr, task) = common::start_scripted_with_tools(
        |req| {
            let token = |token| EngineEvent::Token {
                token,
                cached_tokens: 0,
                logprob: 0.0,
                top: vec![],
                first: None,
            };
            vec![
                token(403),
                token(1),
                EngineEvent::Finished {
                    reason: FinishReason::Stop,
                    prompt_tokens: req.prompt.len(),
                    output_tokens: 2,
                    cached_tokens: 0,
                },
            ]
        },
        Some(TOOLS_TEMPLATE.into()),
        Some(parser),
    )
    .await;
    let content = |choice: &str| {
        let body = json!({"messages": [{"role": "user", "content": "x"}],
                          "tools": [weather_tool()], "tool_choice": choice});
        async move {
            let r = post(addr, "/v1/chat/completions", &body).await;
            assert_eq!(r.status, 200, "{}", r.body);
            r.json()["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .to_owned()
        }
    };
    let parsed = content("auto").await;
    let plain = content("none").await;
    assert!(parsed.ends_with("<s>"), "{parser:?}: {parsed:?}");
    assert!(!plain.contains("<s>"), "{plain:?}");
    task.abort();
}

// ---------------------------------------------------------------------------------------------
// Reasoning parsers (`--reasoning-parser qwen3|deepseek_r1`) and `chat_template_kwargs`.

/// Posts a chat request with `extra` fields, streamed and not, to a scripted server whose model
/// writes `text` (the output is `" " + text`, see [`tool_server`]); returns the messages and
/// finish reasons (checked equal both ways) and the non-streamed body.
async fn reasoning_chat(
    text: &str,
    tools: Option<baton_frontend::tools::ToolParser>,
    reasoning: Option<baton_frontend::reasoning::ReasoningParser>,
    finish: baton_scheduler::FinishReason,
    extra: Value,
) -> (Vec<(Value, Value)>, Value) {
    let (addr, task, _, n_out) = text_server(text, tools, reasoning, finish).await;
    let mut body = json!({"messages": [{"role": "user", "content": "2+2?"}], "n": 2});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    let out = chat_both_ways(addr, &body).await;
    let r = post(addr, "/v1/chat/completions", &body).await;
    let v = r.json();
    // The split changes no count.
    assert_eq!(v["usage"]["completion_tokens"], 2 * n_out, "{v}");
    task.abort();
    (out, v)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reasoning_parser_splits_chat_output_streamed_and_not() {
    use baton_frontend::reasoning::ReasoningParser;
    use baton_scheduler::FinishReason;
    for parser in [ReasoningParser::Qwen3, ReasoningParser::DeepSeekR1] {
        // Only `</think>`: the template opened the reasoning in the prompt.
        let (out, _) = reasoning_chat(
            "I add two and two.</think>\n\nIt is 4.",
            None,
            Some(parser),
            FinishReason::Stop,
            json!({}),
        )
        .await;
        assert_eq!(out.len(), 2);
        for (msg, finish) in out {
            assert_eq!(finish, "stop");
            assert_eq!(
                msg,
                json!({"role": "assistant", "content": "\n\nIt is 4.",
                       "reasoning": " I add two and two.",
                       "reasoning_content": " I add two and two."}),
                "{parser:?}"
            );
        }
        // Both tags (each several tokens of this tokenizer, so split over deltas).
        let (out, _) = reasoning_chat(
            "<think>Hmm, 4.</think>Yes: 4.",
            None,
            Some(parser),
            FinishReason::Stop,
            json!({}),
        )
        .await;
        for (msg, _) in out {
            assert_eq!(msg["content"], "Yes: 4.");
            assert_eq!(msg["reasoning"], " Hmm, 4.");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reasoning_cut_by_max_tokens_is_all_reasoning_unless_qwen3_thinking_is_off() {
    use baton_frontend::reasoning::ReasoningParser;
    use baton_scheduler::FinishReason;
    let text = "<think>Let me see, two plus";
    let (out, _) = reasoning_chat(
        text,
        None,
        Some(ReasoningParser::Qwen3),
        FinishReason::Length,
        json!({}),
    )
    .await;
    let (msg, finish) = &out[0];
    assert_eq!(finish, "length");
    assert_eq!(msg["content"], Value::Null, "{msg}");
    assert_eq!(msg["reasoning"], " Let me see, two plus");
    // `enable_thinking: false`: qwen3 takes the output as content; deepseek_r1 ignores it.
    let off = json!({"chat_template_kwargs": {"enable_thinking": false}});
    let (out, _) = reasoning_chat(
        "Four.",
        None,
        Some(ReasoningParser::Qwen3),
        FinishReason::Stop,
        off.clone(),
    )
    .await;
    assert_eq!(out[0].0, json!({"role": "assistant", "content": " Four."}));
    let (out, _) = reasoning_chat(
        "Four.",
        None,
        Some(ReasoningParser::DeepSeekR1),
        FinishReason::Stop,
        off,
    )
    .await;
    assert_eq!(out[0].0["reasoning"], " Four.");
    assert_eq!(out[0].0["content"], Value::Null);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_reasoning_parser_think_tags_stay_in_the_content() {
    use baton_scheduler::FinishReason;
    let text = "<think>Hmm.</think>Yes.";
    let (addr, task, _, _) = text_server(text, None, None, FinishReason::Stop).await;
    let body = json!({"messages": [{"role": "user", "content": "?"}],
                      "chat_template_kwargs": {"enable_thinking": true}});
    let out = chat_both_ways(addr, &body).await;
    assert_eq!(
        out[0].0,
        json!({"role": "assistant", "content": " <think>Hmm.</think>Yes."})
    );
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    let r = post(addr, "/v1/chat/completions", &sb).await;
    assert!(!r.body.contains("reasoning"), "{}", r.body);
    let r = post(addr, "/v1/responses", &json!({"input": "?"})).await;
    let v = r.json();
    assert_eq!(v["output"].as_array().unwrap().len(), 1, "{v}");
    assert_eq!(v["output"][0]["type"], "message");
    task.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reasoning_parser_hands_only_content_to_the_tool_parser() {
    use baton_frontend::reasoning::ReasoningParser;
    use baton_frontend::tools::ToolParser;
    use baton_scheduler::FinishReason;
    // The reasoning mentions a tool call; only the one after `</think>` is parsed.
    let text = "<think>Maybe <tool_call>{\"name\": \"nope\", \"arguments\": {}}</tool_call>?</think>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
    let (out, _) = reasoning_chat(
        text,
        Some(ToolParser::Hermes),
        Some(ReasoningParser::Qwen3),
        FinishReason::Stop,
        json!({"tools": [weather_tool()]}),
    )
    .await;
    for (msg, finish) in out {
        assert_eq!(finish, "tool_calls");
        assert_eq!(
            msg["reasoning"],
            " Maybe <tool_call>{\"name\": \"nope\", \"arguments\": {}}</tool_call>?"
        );
        assert_eq!(msg["content"], "\n");
        let calls = msg["tool_calls"].as_array().unwrap();
        assert_eq!(calls.len(), 1, "{msg}");
        assert_eq!(calls[0]["function"]["name"], "get_weather");
        assert_eq!(calls[0]["function"]["arguments"], "{\"city\": \"Paris\"}");
    }
    // The call in the reasoning alone is no call.
    let (out, _) = reasoning_chat(
        "<tool_call>{\"name\": \"get_weather\", \"arguments\": {}}</tool_call>",
        Some(ToolParser::Hermes),
        Some(ReasoningParser::DeepSeekR1),
        FinishReason::Length,
        json!({"tools": [weather_tool()]}),
    )
    .await;
    assert_eq!(out[0].1, "length");
    assert!(out[0].0.get("tool_calls").is_none(), "{:?}", out[0]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn include_reasoning_false_and_structured_outputs_leave_the_reasoning_out() {
    use baton_frontend::reasoning::ReasoningParser;
    use baton_scheduler::FinishReason;
    let text = "<think>Hmm.</think>Yes.";
    let (out, _) = reasoning_chat(
        text,
        None,
        Some(ReasoningParser::Qwen3),
        FinishReason::Stop,
        json!({"include_reasoning": false}),
    )
    .await;
    assert_eq!(out[0].0, json!({"role": "assistant", "content": "Yes."}));
    // A guided request's output is all content (the constraint applies from the first token).
    let (out, _) = reasoning_chat(
        text,
        None,
        Some(ReasoningParser::Qwen3),
        FinishReason::Stop,
        json!({"structured_outputs": {"regex": ".*"}}),
    )
    .await;
    assert_eq!(
        out[0].0,
        json!({"role": "assistant", "content": " <think>Hmm.</think>Yes."})
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_put_the_reasoning_in_a_reasoning_item_streamed_and_not() {
    use baton_frontend::reasoning::ReasoningParser;
    use baton_scheduler::FinishReason;
    let (addr, task, _, _) = text_server(
        "<think>Hmm, 4.</think>Yes: 4.",
        None,
        Some(ReasoningParser::DeepSeekR1),
        FinishReason::Stop,
    )
    .await;
    let r = post(addr, "/v1/responses", &json!({"input": "2+2?"})).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let output = v["output"].as_array().unwrap().clone();
    assert_eq!(output.len(), 2, "{v}");
    let rs = &output[0];
    assert_eq!(rs["type"], "reasoning");
    assert!(rs["id"].as_str().unwrap().starts_with("rs_"), "{rs}");
    assert_eq!(rs["summary"], json!([]));
    assert_eq!(
        rs["content"],
        json!([{"type": "reasoning_text", "text": " Hmm, 4."}])
    );
    assert_eq!(output[1]["type"], "message");
    assert_eq!(output[1]["content"][0]["text"], "Yes: 4.");
    let r = post(
        addr,
        "/v1/responses",
        &json!({"input": "2+2?", "stream": true}),
    )
    .await;
    let ev = response_events(&r);
    for (i, (kind, d)) in ev.iter().enumerate() {
        assert_eq!(d["sequence_number"], i, "{d}");
        assert_eq!(d["type"], kind.as_str(), "{d}");
    }
    let of = |kind: &str, field: &str| -> String {
        ev.iter()
            .filter(|(k, _)| k == kind)
            .map(|(_, d)| d[field].as_str().unwrap().to_owned())
            .collect()
    };
    assert_eq!(of("response.reasoning_text.delta", "delta"), " Hmm, 4.");
    assert_eq!(of("response.reasoning_text.done", "text"), " Hmm, 4.");
    assert_eq!(of("response.output_text.delta", "delta"), "Yes: 4.");
    let kinds: Vec<&str> = ev.iter().map(|(k, _)| k.as_str()).collect();
    let first_text = kinds
        .iter()
        .position(|k| *k == "response.output_text.delta")
        .unwrap();
    let rs_done = kinds
        .iter()
        .position(|k| *k == "response.reasoning_text.done")
        .unwrap();
    assert!(rs_done < first_text, "{kinds:?}");
    let added: Vec<(Value, Value)> = ev
        .iter()
        .filter(|(k, _)| k == "response.output_item.added")
        .map(|(_, d)| (d["output_index"].clone(), d["item"]["type"].clone()))
        .collect();
    assert_eq!(
        added,
        [(json!(0), json!("reasoning")), (json!(1), json!("message"))]
    );
    let (_, last) = ev.last().unwrap();
    assert_eq!(last["type"], "response.completed");
    let streamed = last["response"]["output"].as_array().unwrap();
    assert_eq!(streamed[0]["content"], rs["content"]);
    assert_eq!(streamed[1]["content"], output[1]["content"]);
    task.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_template_kwargs_reach_the_template_and_bad_ones_are_400s() {
    use baton_scheduler::FinishReason;
    let template = "{% for m in messages %}{{ m.content }};{% endfor %}{% if enable_thinking is false %}OFF;{% endif %}{{ flavour }};{% if bos_token == 'B' %}B{% endif %};{{ tools | length if tools else 'none' }};{% if add_generation_prompt %}GEN{% endif %}";
    let tok = common::stories_tokenizer();
    let prompts = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = prompts.clone();
    let (addr, task) = common::start_scripted_with_template(
        move |req| {
            seen.lock().unwrap().push(req.prompt.clone());
            vec![baton_frontend::EngineEvent::Finished {
                reason: FinishReason::Stop,
                prompt_tokens: req.prompt.len(),
                output_tokens: 0,
                cached_tokens: 0,
            }]
        },
        Some(template.into()),
    )
    .await;
    let chat = |kwargs: Value| {
        json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
               "chat_template_kwargs": kwargs})
    };
    let mut rendered = Vec::new();
    for kwargs in [
        json!({"enable_thinking": false, "flavour": "mint"}),
        json!({"add_generation_prompt": false, "bos_token": "B", "tools": [1, 2]}),
        Value::Null,
    ] {
        let r = post(addr, "/v1/chat/completions", &chat(kwargs)).await;
        assert_eq!(r.status, 200, "{}", r.body);
        let ids = prompts.lock().unwrap().pop().unwrap();
        rendered.push(tok.decode(&ids, false).unwrap());
    }
    assert_eq!(rendered[0].trim_start(), "hi;OFF;mint;;none;GEN");
    // The kwargs win over the request's `add_generation_prompt` and the server's variables.
    assert_eq!(rendered[1].trim_start(), "hi;;B;2;");
    assert_eq!(rendered[2].trim_start(), "hi;;;none;GEN");
    for bad in [
        json!("enable_thinking=false"),
        json!([1]),
        json!({"messages": []}),
        json!({"chat_template": "{{ 1 }}"}),
        json!({"tokenize": true}),
        json!({"add_generation_prompt": "yes"}),
        json!({"add_generation_prompt": true, "continue_final_message": true}),
    ] {
        let r = post(addr, "/v1/chat/completions", &chat(bad.clone())).await;
        assert_eq!(r.status, 400, "{bad}: {}", r.body);
        let param = r.json()["error"]["param"].clone();
        assert!(
            param == "chat_template_kwargs" || param == "continue_final_message",
            "{bad}: {}",
            r.body
        );
    }
    // No template on these endpoints: still refused there.
    let r = post(
        addr,
        "/v1/responses",
        &json!({"input": "hi", "chat_template_kwargs": {"enable_thinking": false}}),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.json()["error"]["param"], "chat_template_kwargs");
    task.abort();
}

/// stories260K's tokenizer with `<think>` and `</think>` added as special tokens, the id of
/// `</think>`, and an output that reasons "Hmm" and answers "Yes" in it:
/// `<think>`, "Hmm", `</think>`, "Yes".
fn think_tokenizer_and_output() -> (baton_model::Tokenizer, u32, Vec<u32>) {
    let tok = common::tokenizer_with_specials(&["<think>", "</think>"]);
    let (open, close) = (
        tok.piece_to_id("<think>").unwrap(),
        tok.piece_to_id("</think>").unwrap(),
    );
    let mut ids = vec![open];
    ids.extend(tok.encode("Hmm", false).unwrap());
    ids.push(close);
    ids.extend(tok.encode("Yes", false).unwrap());
    (tok, close, ids)
}

/// With a reasoning parser and `</think>` one token, a structured-output request lets the
/// model reason first: the engine gets the guide dormant until `</think>` (vLLM's behaviour)
/// and the output is split; qwen3 with thinking off constrains from the first token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn structured_outputs_with_a_reasoning_parser_start_after_the_reasoning() {
    use baton_frontend::reasoning::ReasoningParser;
    use baton_scheduler::FinishReason;
    use std::sync::{Arc, Mutex};
    let (tok, close, ids) = think_tokenizer_and_output();
    // Per engine request: (the guide's `after`, whether the guide is active).
    type Seen = Vec<(Option<u32>, bool)>;
    let seen: Arc<Mutex<Seen>> = Arc::default();
    let record = seen.clone();
    let (addr, task) = common::start_scripted_with_tokenizer(
        move |req| {
            let g = req.guided.as_ref().expect("a guided request");
            record.lock().unwrap().push((g.after, g.guide.is_active()));
            common::token_events(&ids, 0.0, req.prompt.len(), FinishReason::Stop)
        },
        Some(TOOLS_TEMPLATE.into()),
        None,
        Some(ReasoningParser::Qwen3),
        tok,
    )
    .await;
    let body = json!({"messages": [{"role": "user", "content": "?"}],
                      "structured_outputs": {"regex": "[A-Za-z]+"}});
    let (msg, _) = chat_both_ways(addr, &body).await.remove(0);
    assert_eq!(msg["reasoning"].as_str().unwrap().trim(), "Hmm", "{msg}");
    assert_eq!(msg["content"].as_str().unwrap().trim(), "Yes", "{msg}");
    // Streamed and not: the engine got a dormant guide waiting for `</think>`.
    let got = seen.lock().unwrap().clone();
    assert!(
        !got.is_empty() && got.iter().all(|&g| g == (Some(close), false)),
        "{got:?}"
    );
    // Thinking off: the constraint holds from the first token, nothing is split.
    seen.lock().unwrap().clear();
    let mut body = body;
    body["chat_template_kwargs"] = json!({"enable_thinking": false});
    let (msg, _) = chat_both_ways(addr, &body).await.remove(0);
    assert!(msg.get("reasoning").is_none_or(Value::is_null), "{msg}");
    let got = seen.lock().unwrap().clone();
    assert!(
        !got.is_empty() && got.iter().all(|&g| g == (None, true)),
        "{got:?}"
    );
    task.abort();
}

/// `<think>` and `</think>` as special tokens (not so in Qwen3 or DeepSeek-R1, but possible in
/// other models): detokenizing with `skip_special_tokens` would drop them, so with a reasoning
/// parser the output keeps them and the split works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn special_think_tags_are_kept_for_the_reasoning_parser() {
    use baton_frontend::reasoning::ReasoningParser;
    use baton_scheduler::FinishReason;
    let mut out = Vec::new();
    for parser in [Some(ReasoningParser::DeepSeekR1), None] {
        let (tok, _, ids) = think_tokenizer_and_output();
        let (addr, task) = common::start_scripted_with_tokenizer(
            move |req| common::token_events(&ids, 0.0, req.prompt.len(), FinishReason::Stop),
            Some(TOOLS_TEMPLATE.into()),
            None,
            parser,
            tok,
        )
        .await;
        let body = json!({"messages": [{"role": "user", "content": "?"}]});
        out.push(chat_both_ways(addr, &body).await.remove(0).0);
        task.abort();
    }
    let with = &out[0];
    assert_eq!(with["reasoning"].as_str().unwrap().trim(), "Hmm", "{with}");
    assert_eq!(with["content"].as_str().unwrap().trim(), "Yes", "{with}");
    // Without a parser the special tags are skipped as usual.
    let plain = out[1]["content"].as_str().unwrap();
    assert!(!plain.contains("think") && plain.contains("Hmm"), "{plain}");
}

/// The ids `/v1/models` lists, and the whole response.
async fn model_ids(addr: std::net::SocketAddr) -> (Vec<String>, Value) {
    let m = get(addr, "/v1/models").await.json();
    let ids = m["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].as_str().unwrap().to_owned())
        .collect();
    (ids, m)
}

/// `--served-model-name stories b c` (vLLM takes several names): a request may give any of
/// them, responses report the first, and `/v1/models` lists each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_served_model_name_is_accepted_and_listed() {
    let srv = start(Opts {
        more_served_model_names: vec!["b".into(), "org/c".into()],
        ..Opts::default()
    })
    .await;
    let (ids, m) = model_ids(srv.addr).await;
    assert_eq!(ids, [MODEL, "b", "org/c"], "{m}");
    for name in [MODEL, "b", "org/c"] {
        let v = completion(
            srv.addr,
            json!({"model": name, "prompt": "Once", "max_tokens": 2}),
        )
        .await;
        assert_eq!(v["model"], MODEL, "{v}");
        let card = get(srv.addr, &format!("/v1/models/{name}")).await;
        assert_eq!(card.status, 200, "{}", card.body);
        assert_eq!(card.json()["id"], name);
    }
    let r = post(
        srv.addr,
        "/v1/completions",
        &json!({"model": "d", "prompt": "Once", "max_tokens": 2}),
    )
    .await;
    assert_eq!(r.status, 404, "{}", r.body);
}

/// A text prompt whose encoding has a token id past the model's vocabulary (a tokenizer with
/// more added tokens than the model has rows) is a 400 naming the field the text came in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_text_prompt_encoding_outside_the_vocabulary_is_a_400_naming_its_field() {
    // The scripted engine's vocabulary is 544: the 33rd added token onwards is outside it.
    let names: Vec<String> = (0..40).map(|i| format!("<x{i}>")).collect();
    let tok =
        common::tokenizer_with_specials(&names.iter().map(String::as_str).collect::<Vec<_>>());
    let outside = tok.piece_to_id("<x39>").unwrap();
    assert!(outside >= 544, "{outside}");
    let (addr, task) = common::start_scripted_with_tokenizer(
        |req| {
            vec![baton_frontend::EngineEvent::Finished {
                reason: baton_scheduler::FinishReason::Length,
                prompt_tokens: req.prompt.len(),
                output_tokens: 0,
                cached_tokens: 0,
            }]
        },
        Some("{% for m in messages %}{{ m.content }}{% endfor %}".into()),
        None,
        None,
        tok,
    )
    .await;
    let cases = [
        ("/v1/completions", json!({"prompt": "Hi <x39>"}), "prompt"),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Hi <x39>"}]}),
            "messages",
        ),
        ("/v1/responses", json!({"input": "Hi <x39>"}), "input"),
    ];
    for (path, body, param) in cases {
        let r = post(addr, path, &body).await;
        assert_eq!(r.status, 400, "{path}: {}", r.body);
        let e = r.json()["error"].clone();
        assert_eq!(e["param"], param, "{path}: {e}");
        assert!(
            e["message"]
                .as_str()
                .unwrap()
                .contains(&format!("Token id {outside} is out of vocabulary")),
            "{e}"
        );
    }
    // An added token inside the vocabulary is fine.
    let r = post(addr, "/v1/completions", &json!({"prompt": "Hi <x0>"})).await;
    assert_eq!(r.status, 200, "{}", r.body);
    task.abort();
}

/// A scripted server whose engine answers every request with `ids` and records the prompts,
/// over `tok` with the reasoning parser `reasoning`.
async fn ids_server(
    ids: Vec<u32>,
    template: &str,
    reasoning: Option<baton_frontend::reasoning::ReasoningParser>,
    tok: baton_model::Tokenizer,
) -> (
    std::net::SocketAddr,
    tokio::task::JoinHandle<()>,
    std::sync::Arc<std::sync::Mutex<Vec<Vec<u32>>>>,
) {
    let prompts = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = prompts.clone();
    let (addr, task) = common::start_scripted_with_tokenizer(
        move |req| {
            seen.lock().unwrap().push(req.prompt.clone());
            common::token_events(
                &ids,
                0.0,
                req.prompt.len(),
                baton_scheduler::FinishReason::Stop,
            )
        },
        Some(template.into()),
        None,
        reasoning,
        tok,
    )
    .await;
    (addr, task, prompts)
}

/// `/v1/responses` counts the reasoning tokens in `usage.output_tokens_details` (streamed and
/// not), as vLLM's reasoning parsers count them: the output tokens before `</think>`, the think
/// tags not counted; an output that never closes its reasoning is all reasoning.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_count_the_reasoning_tokens() {
    use baton_frontend::reasoning::ReasoningParser;
    let tok = common::tokenizer_with_specials(&["<think>", "</think>"]);
    let (open, close) = (
        tok.piece_to_id("<think>").unwrap(),
        tok.piece_to_id("</think>").unwrap(),
    );
    let thought = tok.encode("Hmm, two and two make four", false).unwrap();
    let answer = tok.encode("It is 4.", false).unwrap();
    assert!(thought.len() > 3 && answer.len() > 1);
    let cat = |parts: &[&[u32]]| parts.concat();
    let cases = [
        // The template opened the reasoning: only `</think>` comes.
        (cat(&[&thought, &[close], &answer]), thought.len()),
        (cat(&[&[open], &thought, &[close], &answer]), thought.len()),
        // Cut inside the reasoning: all reasoning.
        (cat(&[&[open], &thought]), thought.len()),
    ];
    for (ids, want) in cases {
        let total = ids.len();
        let (addr, task, _) = ids_server(
            ids,
            TOOLS_TEMPLATE,
            Some(ReasoningParser::DeepSeekR1),
            common::tokenizer_with_specials(&["<think>", "</think>"]),
        )
        .await;
        let v = response(addr, &json!({"input": "2+2?"})).await;
        let u = &v["usage"];
        assert_eq!(u["output_tokens"], total, "{v}");
        assert_eq!(u["output_tokens_details"]["reasoning_tokens"], want, "{v}");
        let r = post(
            addr,
            "/v1/responses",
            &json!({"input": "2+2?", "stream": true}),
        )
        .await;
        let ev = response_events(&r);
        let (kind, last) = ev.last().unwrap();
        assert_eq!(kind, "response.completed", "{}", r.body);
        let u = &last["response"]["usage"];
        assert_eq!(u["output_tokens"], total, "{last}");
        assert_eq!(
            u["output_tokens_details"]["reasoning_tokens"], want,
            "{last}"
        );
        task.abort();
    }
    // No reasoning parser: no reasoning tokens.
    let (addr, task, _) = ids_server(
        cat(&[&thought, &[close], &answer]),
        TOOLS_TEMPLATE,
        None,
        common::tokenizer_with_specials(&["<think>", "</think>"]),
    )
    .await;
    let v = response(addr, &json!({"input": "2+2?"})).await;
    assert_eq!(v["usage"]["output_tokens_details"]["reasoning_tokens"], 0);
    task.abort();
}

/// An assistant message's `reasoning` (vLLM's current name) reaches the chat template as
/// `reasoning_content`, which templates read, as `reasoning_content` itself does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_assistant_messages_reasoning_reaches_the_template_as_reasoning_content() {
    let load = common::stories_tokenizer;
    let tok = load();
    let template = "{% for m in messages %}{{ m.role }}[{{ m.reasoning_content }}]{{ m.content }};{% endfor %}";
    let (addr, task, prompts) = ids_server(vec![], template, None, load()).await;
    for field in ["reasoning", "reasoning_content"] {
        let body = json!({"messages": [
            {"role": "user", "content": "sum"},
            {"role": "assistant", "content": "four", field: "two and two"},
            {"role": "user", "content": "ok"}], "max_tokens": 1});
        let r = post(addr, "/v1/chat/completions", &body).await;
        assert_eq!(r.status, 200, "{}", r.body);
        let ids = prompts.lock().unwrap().pop().unwrap();
        let text = tok.decode(&ids, true).unwrap();
        assert!(
            text.contains("assistant[two and two]four;"),
            "{field}: {text}"
        );
    }
    task.abort();
}

/// The ids of a choice's `token_ids` (or a chat response's `prompt_token_ids`).
fn id_list(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap_or_else(|| panic!("a list of ids: {v}"))
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect()
}

/// Per choice of a streamed completions or chat response with `return_token_ids`: the
/// prompt ids (which must come once, in the choice's first chunk: top-level on chat) and the
/// concatenated token ids (on every chunk after the chat role chunk).
fn streamed_ids(r: &common::Resp, chat: bool) -> Vec<(Vec<u32>, Vec<u32>)> {
    assert_eq!(r.status, 200, "{}", r.body);
    let mut out: Vec<(Option<Vec<u32>>, Vec<u32>)> = Vec::new();
    for e in r.events() {
        if e == "[DONE]" {
            continue;
        }
        let v: Value = serde_json::from_str(&e).unwrap();
        for c in v["choices"].as_array().unwrap() {
            let i = c["index"].as_u64().unwrap() as usize;
            if out.len() <= i {
                out.resize(i + 1, (None, Vec::new()));
            }
            let prompt = if chat {
                &v["prompt_token_ids"]
            } else {
                &c["prompt_token_ids"]
            };
            let first = chat && c["delta"]["role"] == "assistant";
            if out[i].0.is_none() {
                out[i].0 = Some(id_list(prompt));
            } else {
                assert!(prompt.is_null(), "prompt ids after the first chunk: {e}");
            }
            if first {
                assert!(c.get("token_ids").is_none(), "{e}");
            } else {
                out[i].1.extend(id_list(&c["token_ids"]));
            }
        }
    }
    out.into_iter().map(|(p, t)| (p.unwrap(), t)).collect()
}

/// vLLM's `return_token_ids` on /v1/completions and /v1/chat/completions, streamed and not:
/// the prompt's ids and exactly the generated ids of each choice, the token that completed a
/// stop string and a stop token included (the text leaves them out, the ids do not, as vLLM's
/// `token_ids` keep every generated token).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn return_token_ids_gives_the_prompt_and_the_generated_ids() {
    let srv = start(Opts {
        chat_template: Some(LLAMA2_TEMPLATE.into()),
        ..Opts::default()
    })
    .await;
    let g = &common::goldens()[0];
    let prompt = g["prompt"].as_str().unwrap();
    let prompt_ids = id_list(&g["prompt_ids"]);
    let greedy = id_list(&g["greedy_ids"]);
    let base = json!({"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0,
                      "return_token_ids": true});
    // Greedy, ended by max_tokens, by a stop string (" named" is token 8: its whole text), by
    // a stop token id (the first ".", token 10).
    let dot = greedy[10];
    assert_eq!(greedy.iter().position(|&t| t == dot), Some(10));
    for (extra, want, text) in [
        (json!({}), &greedy[..12], None),
        (
            json!({"stop": ["named"]}),
            &greedy[..9],
            Some(", there was a little girl "),
        ),
        (
            json!({"stop_token_ids": [dot]}),
            &greedy[..11],
            Some(", there was a little girl named Lily"),
        ),
    ] {
        let body = with_fields(&base, extra.clone());
        let v = completion(srv.addr, body.clone()).await;
        let c = &v["choices"][0];
        assert_eq!(id_list(&c["prompt_token_ids"]), prompt_ids, "{extra}");
        assert_eq!(id_list(&c["token_ids"]), want, "{extra}: {v}");
        assert_eq!(v["usage"]["completion_tokens"], want.len());
        if let Some(t) = text {
            assert_eq!(c["text"], t, "{extra}");
        }
        let mut body = body;
        body["stream"] = json!(true);
        let r = post(srv.addr, "/v1/completions", &body).await;
        assert_eq!(
            streamed_ids(&r, false),
            [(prompt_ids.clone(), want.to_vec())],
            "{extra}"
        );
    }
    // n > 1 with echo: each choice has its own ids (seeded sampling, streamed the same).
    let body = with_fields(
        &base,
        json!({"n": 3, "temperature": 1.0, "seed": 7, "echo": true}),
    );
    let v = completion(srv.addr, body.clone()).await;
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    let mut want = Vec::new();
    for c in choices {
        assert_eq!(id_list(&c["prompt_token_ids"]), prompt_ids);
        let ids = id_list(&c["token_ids"]);
        assert!(!ids.is_empty() && ids.len() <= 12, "{c}");
        want.push((prompt_ids.clone(), ids));
    }
    assert!(want[0].1 != want[1].1 || want[1].1 != want[2].1, "{v}");
    let mut streamed = body;
    streamed["stream"] = json!(true);
    let r = post(srv.addr, "/v1/completions", &streamed).await;
    assert_eq!(streamed_ids(&r, false), want);
    // Without the field: no ids.
    let v = completion(
        srv.addr,
        json!({"model": MODEL, "prompt": prompt, "max_tokens": 2}),
    )
    .await;
    assert!(v["choices"][0].get("token_ids").is_none(), "{v}");
    assert!(v["choices"][0].get("prompt_token_ids").is_none(), "{v}");

    // Chat: the prompt ids at the top (the rendered prompt, as /tokenize gives it), the ids on
    // each choice.
    let messages = json!([{"role": "user", "content": "Tell a story."}]);
    let t = post(srv.addr, "/tokenize", &json!({"messages": messages})).await;
    let chat_prompt = id_list(&t.json()["tokens"]);
    let body = json!({"model": MODEL, "messages": messages, "max_tokens": 10, "n": 2,
                      "temperature": 1.0, "seed": 3, "return_token_ids": true});
    let r = post(srv.addr, "/v1/chat/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(id_list(&v["prompt_token_ids"]), chat_prompt);
    let tok = common::stories_tokenizer();
    let mut want = Vec::new();
    for c in v["choices"].as_array().unwrap() {
        let ids = id_list(&c["token_ids"]);
        assert_eq!(
            tok.decode(&ids, true).unwrap().trim(),
            c["message"]["content"].as_str().unwrap().trim(),
            "{c}"
        );
        want.push((chat_prompt.clone(), ids));
    }
    let total: usize = want.iter().map(|w| w.1.len()).sum();
    assert_eq!(v["usage"]["completion_tokens"], total);
    let mut streamed = body;
    streamed["stream"] = json!(true);
    let r = post(srv.addr, "/v1/chat/completions", &streamed).await;
    assert_eq!(streamed_ids(&r, true), want);
}

/// A scripted server (stories260K's tokenizer, the Llama-2 template, `max_model_len` 512)
/// whose model answers "Yes" to every request; the requests the engine received are kept.
async fn recording_server() -> (
    std::net::SocketAddr,
    tokio::task::JoinHandle<()>,
    std::sync::Arc<std::sync::Mutex<Vec<baton_frontend::EngineRequest>>>,
) {
    let tok = common::stories_tokenizer();
    let out = tok.encode("Yes", false).unwrap();
    let prompts = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = prompts.clone();
    let (addr, task) = common::start_scripted_with_template(
        move |req| {
            seen.lock().unwrap().push(req.clone());
            common::token_events(
                &out,
                -0.5,
                req.prompt.len(),
                baton_scheduler::FinishReason::Stop,
            )
        },
        Some(LLAMA2_TEMPLATE.into()),
    )
    .await;
    (addr, task, prompts)
}

/// The prompt the engine got for `body` on `path` (which must succeed), and the response.
async fn engine_prompt(
    addr: std::net::SocketAddr,
    seen: &std::sync::Mutex<Vec<baton_frontend::EngineRequest>>,
    path: &str,
    body: Value,
) -> (Vec<u32>, Value) {
    seen.lock().unwrap().clear();
    let r = post(addr, path, &body).await;
    let shown: String = body.to_string().chars().take(300).collect();
    assert_eq!(r.status, 200, "{shown}: {}", r.body);
    (only_prompt(seen), r.json())
}

/// The prompt of the one request the engine received.
fn only_prompt(seen: &std::sync::Mutex<Vec<baton_frontend::EngineRequest>>) -> Vec<u32> {
    let got = seen.lock().unwrap();
    assert_eq!(got.len(), 1, "{got:?}");
    got[0].prompt.clone()
}

/// vLLM's `truncate_prompt_tokens` on `/v1/completions`: `k` keeps the last `k` prompt tokens
/// (after tokenization, so the BOS goes first), -1 keeps up to `max_model_len`; usage and the
/// echo are of the kept tokens. A prompt too long for the context (or for the untokenized
/// length guard) is cut instead of refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncate_prompt_tokens_keeps_the_last_prompt_tokens_on_completions() {
    let (addr, task, prompts) = recording_server().await;
    let text = "Once upon a time there was a little girl named Lily";
    let base = json!({"model": MODEL, "prompt": text, "max_tokens": 4});
    let (full, v) = engine_prompt(addr, &prompts, "/v1/completions", base.clone()).await;
    assert!(full.len() > 5, "{full:?}");
    assert_eq!(v["usage"]["prompt_tokens"], full.len());
    for k in [1usize, 3, 5] {
        let body = with_fields(&base, json!({"truncate_prompt_tokens": k, "echo": true}));
        let (got, v) = engine_prompt(addr, &prompts, "/v1/completions", body).await;
        assert_eq!(got, full[full.len() - k..], "k = {k}");
        assert_eq!(v["usage"]["prompt_tokens"], k, "{v}");
        // The echo is the kept tokens, not the whole text.
        let tok = common::stories_tokenizer();
        let kept = tok.decode(&got, true).unwrap();
        let echoed = text_of(&v, 0);
        assert!(
            echoed.starts_with(&kept) && !echoed.starts_with(text),
            "k = {k}: {echoed:?} vs {kept:?}"
        );
    }
    // Longer than the prompt, or -1 (max_model_len 512): nothing is cut, the text is echoed.
    for k in [json!(full.len()), json!(400), json!(-1), json!(3.0)] {
        let body = with_fields(&base, json!({"truncate_prompt_tokens": k, "echo": true}));
        let (got, v) = engine_prompt(addr, &prompts, "/v1/completions", body).await;
        if k == json!(3.0) {
            // An integer-valued float is that integer (pydantic's lax mode).
            assert_eq!(got, full[full.len() - 3..]);
            continue;
        }
        assert_eq!(got, full, "k = {k}");
        assert!(text_of(&v, 0).starts_with(text), "{v}");
    }
    // Token prompts: the last k ids; a 600-id prompt (past max_model_len 512) is cut to fit.
    let ids: Vec<u32> = (0..600).map(|i| 3 + (i * 7) % 500).collect();
    let body = json!({"prompt": ids, "max_tokens": 1, "truncate_prompt_tokens": 2});
    let (got, _) = engine_prompt(addr, &prompts, "/v1/completions", body).await;
    assert_eq!(got, ids[598..]);
    let body = json!({"prompt": ids, "max_tokens": 1, "truncate_prompt_tokens": 500});
    let (got, _) = engine_prompt(addr, &prompts, "/v1/completions", body).await;
    assert_eq!(got, ids[100..]);
    let r = post(
        addr,
        "/v1/completions",
        &json!({"prompt": ids, "max_tokens": 1}),
    )
    .await;
    assert_eq!(r.status, 400, "without truncation: {}", r.body);
    // A text far past what 512 tokens can hold is refused untokenized, unless it is cut.
    let long = "the cat sat on the mat. ".repeat(20_000);
    let r = post(
        addr,
        "/v1/completions",
        &json!({"prompt": long, "max_tokens": 1}),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.body);
    let body = json!({"prompt": long, "max_tokens": 1, "truncate_prompt_tokens": 8});
    let (got, _) = engine_prompt(addr, &prompts, "/v1/completions", body).await;
    assert_eq!(got.len(), 8);
    task.abort();
}

/// On `/v1/chat/completions`, `truncate_prompt_tokens` cuts the prompt the chat template
/// rendered (vLLM truncates after the template); `usage.prompt_tokens` counts what is kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncate_prompt_tokens_cuts_the_rendered_chat_prompt() {
    let (addr, task, prompts) = recording_server().await;
    let base = json!({"model": MODEL, "max_tokens": 4,
        "messages": [{"role": "user", "content": "Tell me a story about a cat."}]});
    let (full, v) = engine_prompt(addr, &prompts, "/v1/chat/completions", base.clone()).await;
    assert_eq!(v["usage"]["prompt_tokens"], full.len());
    for stream in [false, true] {
        let body = with_fields(
            &base,
            json!({"truncate_prompt_tokens": 4, "stream": stream,
                   "stream_options": if stream { json!({"include_usage": true}) } else { Value::Null }}),
        );
        prompts.lock().unwrap().clear();
        let r = post(addr, "/v1/chat/completions", &body).await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(only_prompt(&prompts), full[full.len() - 4..]);
        let usage = if stream {
            let ev = r.events();
            serde_json::from_str::<Value>(&ev[ev.len() - 2]).unwrap()["usage"].clone()
        } else {
            r.json()["usage"].clone()
        };
        assert_eq!(usage["prompt_tokens"], 4, "{usage}");
    }
    task.abort();
}

/// Bad `truncate_prompt_tokens` values are 400s naming the field, with vLLM's messages; it is
/// refused on `/v1/responses`, which vLLM does not give it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_truncate_prompt_tokens_are_refused_naming_the_field() {
    let (addr, task, prompts) = recording_server().await;
    for (path, base) in [
        (
            "/v1/completions",
            json!({"prompt": "Once", "max_tokens": 2}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
        ),
    ] {
        for (k, says) in [
            (json!(0), "must be an integer >= 1 or -1, got 0"),
            (json!(-2), "must be an integer >= 1 or -1, got -2"),
            (
                json!(513),
                "truncate_prompt_tokens value (513) is greater than max_model_len (512). \
                 Please, select a smaller truncation size.",
            ),
            (json!(2.5), "expected an integer, got 2.5"),
            (json!("four"), "expected an integer, got \"four\""),
            (
                json!(1e30),
                "expected an integer within ±9223372036854775807",
            ),
            (
                json!("1180591620717411303424"),
                "expected an integer within ±9223372036854775807",
            ),
        ] {
            let r = post(
                addr,
                path,
                &with_fields(&base, json!({"truncate_prompt_tokens": k})),
            )
            .await;
            assert_eq!(r.status, 400, "{path} {k}: {}", r.body);
            let e = r.json()["error"].clone();
            assert_eq!(e["param"], "truncate_prompt_tokens", "{e}");
            assert!(e["message"].as_str().unwrap().contains(says), "{e}");
        }
    }
    assert!(prompts.lock().unwrap().is_empty());
    let r = post(
        addr,
        "/v1/responses",
        &json!({"input": "Hi", "truncate_prompt_tokens": 4}),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.json()["error"]["param"], "truncate_prompt_tokens");
    task.abort();
}

/// Integer fields take an integer-valued float (`2.0`, `-0`, `1e1`) as pydantic's lax mode
/// does in vLLM, with the same range checks; `2.5` is still a 400 naming the field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn integer_fields_accept_integer_valued_floats() {
    let (addr, task, prompts) = recording_server().await;
    let r = send(
        addr,
        "POST",
        "/v1/completions",
        &[],
        r#"{"prompt": [1.0, 20, 3e1], "max_tokens": 2.0, "min_tokens": -0, "n": 1e0,
            "top_k": -1.0, "seed": 7.0, "logprobs": 2.0, "stop_token_ids": [5.0]}"#,
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    {
        let got = prompts.lock().unwrap();
        assert_eq!(got.len(), 1);
        let req = &got[0];
        assert_eq!(req.prompt, [1, 20, 30]);
        assert_eq!((req.max_tokens, req.min_tokens, req.params.seed), (2, 0, 7));
        assert_eq!(req.stop_token_ids, [5]);
        assert_eq!(req.params.top_logprobs, 2);
    }
    prompts.lock().unwrap().clear();
    for (field, bad) in [
        ("max_tokens", "2.5"),
        ("n", "1.5"),
        ("n", "200.0"),
        ("top_k", "-2.0"),
        ("seed", "0.5"),
        ("prompt", "[1.5]"),
        ("max_tokens", "1e300"),
    ] {
        let body = if field == "prompt" {
            format!(r#"{{"prompt": {bad}}}"#)
        } else {
            format!(r#"{{"prompt": "Once", "{field}": {bad}}}"#)
        };
        let r = send(addr, "POST", "/v1/completions", &[], &body).await;
        assert_eq!(r.status, 400, "{body}: {}", r.body);
        assert_eq!(r.json()["error"]["param"], field, "{body}");
    }
    let r = send(
        addr,
        "POST",
        "/v1/chat/completions",
        &[],
        r#"{"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 3.0,
            "top_logprobs": 1.0, "logprobs": true}"#,
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let got = prompts.lock().unwrap();
    assert_eq!(
        (got[0].max_tokens, got[0].params.top_logprobs),
        (3, 1),
        "{got:?}"
    );
    drop(got);
    task.abort();
}

/// `continue_final_message` cuts the prompt right after the final message even when its
/// content also occurs in what the template writes after it: with the Llama-2 template an
/// assistant content `"s"` is followed by `</s>`, whose `s` a search for the last occurrence
/// of the content would cut at. The prompt equals the rendered text up to the content.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn continue_final_message_is_cut_at_the_message_not_at_a_later_occurrence() {
    let (addr, task, prompts) = recording_server().await;
    for (content, want) in [
        ("s", "<s>[INST] Tell a story. [/INST] s"),
        ("Once upon", "<s>[INST] Tell a story. [/INST] Once upon"),
        // The template strips the content and writes a space after it: the content is found
        // whole, so the space stays (as transformers cuts it).
        ("Once upon ", "<s>[INST] Tell a story. [/INST] Once upon "),
        // Leading whitespace is stripped: the content is found trimmed.
        ("  Once", "<s>[INST] Tell a story. [/INST] Once"),
        ("INST", "<s>[INST] Tell a story. [/INST] INST"),
    ] {
        let body = json!({"model": MODEL, "max_tokens": 2, "add_generation_prompt": false,
            "continue_final_message": true,
            "messages": [{"role": "user", "content": "Tell a story."},
                         {"role": "assistant", "content": content}]});
        let (got, _) = engine_prompt(addr, &prompts, "/v1/chat/completions", body).await;
        let plain = json!({"prompt": want, "add_special_tokens": false, "max_tokens": 2});
        let (want_ids, _) = engine_prompt(addr, &prompts, "/v1/completions", plain).await;
        assert_eq!(got, want_ids, "content {content:?}: want {want:?}");
    }
    task.abort();
}

/// `/v1/models` reports the model's path as each card's `root` (vLLM's), `parent` null; a
/// server not told the path reports the first served name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_cards_report_the_model_path_as_root() {
    let path = common::model_dir().display().to_string();
    let srv = start(Opts {
        more_served_model_names: vec!["b".into()],
        model_root: Some(path.clone()),
        ..Opts::default()
    })
    .await;
    let m = get(srv.addr, "/v1/models").await.json();
    let cards = m["data"].as_array().unwrap();
    assert_eq!(cards.len(), 2, "{m}");
    for c in cards {
        assert_eq!(c["root"], path, "{c}");
        assert!(c["parent"].is_null(), "{c}");
    }
    let card = get(srv.addr, "/v1/models/b").await.json();
    assert_eq!(card["root"], path, "{card}");
    let plain = start(Opts::default()).await;
    let m = get(plain.addr, "/v1/models").await.json();
    assert_eq!(m["data"][0]["root"], MODEL, "{m}");
    // Without a path but with the `--model` string as an alias (`baton frontend` without
    // `--served-model-name`): that string.
    let tok = common::stories_tokenizer();
    let cfg = baton_frontend::ServerConfig {
        model_aliases: vec!["../models/stories".into()],
        ..common::scripted_config()
    };
    let engine = std::sync::Arc::new(common::Scripted(|_: &baton_frontend::EngineRequest| {
        Vec::new()
    }));
    let state = baton_frontend::AppState::new(cfg, tok, engine, vec![common::EOS]).unwrap();
    let (listener, addr) = baton_frontend::bind("127.0.0.1", 0).await.unwrap();
    let task = tokio::spawn(async move {
        let _ = baton_frontend::serve_state(
            listener,
            std::sync::Arc::new(state),
            std::future::pending(),
        )
        .await;
    });
    let m = get(addr, "/v1/models").await.json();
    assert_eq!(m["data"][0]["id"], MODEL, "{m}");
    assert_eq!(m["data"][0]["root"], "../models/stories", "{m}");
    task.abort();
}

/// `--served-model-name` with an empty name stops start-up with an error naming the flag; a
/// repeated name is served and listed once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_served_model_names_are_refused_and_repeats_listed_once() {
    let tok = common::stories_tokenizer;
    for (first, more) in [("", vec![]), (MODEL, vec!["b".to_owned(), String::new()])] {
        let cfg = baton_frontend::ServerConfig {
            served_model_name: first.into(),
            more_served_model_names: more.clone(),
            ..common::scripted_config()
        };
        let engine = std::sync::Arc::new(common::Scripted(|_: &baton_frontend::EngineRequest| {
            Vec::new()
        }));
        let e = baton_frontend::AppState::new(cfg, tok(), engine, vec![common::EOS])
            .expect_err("an empty served name is refused");
        let e = e.to_string();
        assert!(
            e.contains("--served-model-name") && e.contains("empty"),
            "{first:?} {more:?}: {e}"
        );
    }
    let srv = start(Opts {
        more_served_model_names: vec!["b".into(), "b".into(), MODEL.into(), "c".into()],
        ..Opts::default()
    })
    .await;
    let (ids, m) = model_ids(srv.addr).await;
    assert_eq!(ids, [MODEL, "b", "c"], "{m}");
}

/// The tokens of a completions choice's log-probabilities and the keys of its top entries.
fn logprob_tokens(c: &Value) -> (Vec<String>, Vec<Vec<String>>) {
    let lp = &c["logprobs"];
    let tokens = lp["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap().to_owned())
        .collect();
    let tops = lp["top_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m.as_object().unwrap().keys().cloned().collect())
        .collect();
    (tokens, tops)
}

/// vLLM's `return_tokens_as_token_ids`: log-probability entries name their tokens
/// `token_id:{id}` (the ids `return_token_ids` gives), on completions and chat, streamed and
/// not; `--return-tokens-as-token-ids` is the default a request overrides; /v1/responses,
/// whose log-probabilities follow the server's flag alone (as vLLM's), refuses it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn return_tokens_as_token_ids_names_logprob_tokens_by_id() {
    let off = start(Opts {
        chat_template: Some(LLAMA2_TEMPLATE.into()),
        ..Opts::default()
    })
    .await;
    let on = start(Opts {
        return_tokens_as_token_ids: true,
        ..Opts::default()
    })
    .await;
    let body = json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8,
                      "temperature": 0, "logprobs": 2, "return_token_ids": true});
    for (srv, field, as_ids) in [
        (&off, json!(true), true),
        (&off, Value::Null, false),
        (&on, Value::Null, true),
        (&on, json!(false), false),
    ] {
        let mut b = body.clone();
        b["return_tokens_as_token_ids"] = field.clone();
        let v = completion(srv.addr, b.clone()).await;
        let c = &v["choices"][0];
        let ids = id_list(&c["token_ids"]);
        let (tokens, tops) = logprob_tokens(c);
        let named: Vec<String> = ids.iter().map(|i| format!("token_id:{i}")).collect();
        if as_ids {
            assert_eq!(tokens, named, "{field}");
            for (t, top) in tokens.iter().zip(&tops) {
                assert!(top.contains(t), "{field}: {top:?}");
                assert!(top.iter().all(|k| k.starts_with("token_id:")), "{top:?}");
            }
        } else {
            assert_eq!(tokens.concat(), text_of(&v, 0), "{field}");
        }
        // Streamed, the same tokens.
        b["stream"] = json!(true);
        let r = post(srv.addr, "/v1/completions", &b).await;
        let mut streamed = Vec::new();
        for e in r.events().iter().filter(|e| *e != "[DONE]") {
            let v: Value = serde_json::from_str(e).unwrap();
            if let Some(c) = v["choices"].get(0).filter(|c| !c["logprobs"].is_null()) {
                streamed.extend(logprob_tokens(c).0);
            }
        }
        assert_eq!(streamed, tokens, "{field} streamed");
    }
    // Chat: each content entry's token and its bytes, and its top entries.
    let chat = json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                      "max_tokens": 6, "temperature": 0, "logprobs": true, "top_logprobs": 2,
                      "return_token_ids": true, "return_tokens_as_token_ids": true});
    let r = post(off.addr, "/v1/chat/completions", &chat).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let ids = id_list(&v["choices"][0]["token_ids"]);
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), ids.len(), "{v}");
    for (e, id) in content.iter().zip(&ids) {
        let name = format!("token_id:{id}");
        assert_eq!(e["token"], name, "{e}");
        assert_eq!(e["bytes"], json!(name.as_bytes()), "{e}");
        for t in e["top_logprobs"].as_array().unwrap() {
            assert!(t["token"].as_str().unwrap().starts_with("token_id:"), "{t}");
        }
    }
    let mut streamed = chat.clone();
    streamed["stream"] = json!(true);
    let r = post(off.addr, "/v1/chat/completions", &streamed).await;
    let mut tokens = Vec::new();
    for e in r.events().iter().filter(|e| *e != "[DONE]") {
        let v: Value = serde_json::from_str(e).unwrap();
        if let Some(c) = v["choices"][0]["logprobs"]["content"].as_array() {
            tokens.extend(c.iter().map(|e| e["token"].as_str().unwrap().to_owned()));
        }
    }
    let named: Vec<String> = ids.iter().map(|i| format!("token_id:{i}")).collect();
    assert_eq!(tokens, named, "chat streamed");
    // Responses: refused when asked for, accepted when off.
    for (value, status) in [(true, 400), (false, 200)] {
        let r = post(
            off.addr,
            "/v1/responses",
            &json!({"model": MODEL, "input": "Hi", "max_output_tokens": 2,
                    "return_tokens_as_token_ids": value}),
        )
        .await;
        assert_eq!(r.status, status, "{}", r.body);
        if status == 400 {
            assert_eq!(r.json()["error"]["param"], "return_tokens_as_token_ids");
        }
    }
}

/// vLLM's `echo` on chat: when the reply continues the last message's role (no generation
/// prompt, as with `continue_final_message`), the reply's content starts with that message's
/// content, streamed (its own chunk after the role chunk) and not; after a user message with
/// the generation prompt there is nothing to echo.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_echo_prepends_the_continued_message() {
    let srv = start(Opts {
        chat_template: Some(LLAMA2_TEMPLATE.into()),
        ..Opts::default()
    })
    .await;
    let partial = "Once upon a time, there was";
    let cont = json!({"model": MODEL, "max_tokens": 6, "temperature": 0,
                      "messages": [{"role": "user", "content": "Tell me a story."},
                                   {"role": "assistant", "content": partial}],
                      "add_generation_prompt": false, "continue_final_message": true});
    let content = |v: &Value| {
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    let reply = |body: &Value| {
        let body = body.clone();
        async move {
            let r = post(srv.addr, "/v1/chat/completions", &body).await;
            assert_eq!(r.status, 200, "{}", r.body);
            r.json()
        }
    };
    let plain = content(&reply(&cont).await);
    assert!(!plain.is_empty());
    let mut echoed = cont.clone();
    echoed["echo"] = json!(true);
    let v = reply(&echoed).await;
    assert_eq!(content(&v), format!("{partial}{plain}"), "{v}");
    // The echo is not generated: the usage counts the reply's tokens only.
    assert_eq!(v["usage"]["completion_tokens"], 6, "{v}");
    echoed["stream"] = json!(true);
    let r = post(srv.addr, "/v1/chat/completions", &echoed).await;
    let (text, _) = stream_text(&r, true);
    assert_eq!(text, format!("{partial}{plain}"));
    // A user message answered with the generation prompt: nothing to echo.
    let ask = json!({"model": MODEL, "max_tokens": 6, "temperature": 0,
                     "messages": [{"role": "user", "content": "Tell me a story."}]});
    let mut ask_echo = ask.clone();
    ask_echo["echo"] = json!(true);
    assert_eq!(
        content(&reply(&ask_echo).await),
        content(&reply(&ask).await)
    );
}

/// The reply's role, as vLLM's `get_chat_request_role`: `assistant` with the generation
/// prompt (the default), else the last message's own role (the reply continues it: `user`
/// after a user message, `system` after a system one), in the non-streamed message and in
/// every choice's first streamed delta.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_reply_role_is_the_last_messages_without_the_generation_prompt() {
    let (addr, task, _) = recording_server().await;
    let user = json!([{"role": "user", "content": "Tell me a story."}]);
    let system = json!([{"role": "user", "content": "Tell me a story."},
                        {"role": "system", "content": "Be brief."}]);
    let assistant = json!([{"role": "user", "content": "Tell me a story."},
                           {"role": "assistant", "content": "Once"}]);
    for (messages, extra, want) in [
        (&user, json!({}), "assistant"),
        (&user, json!({"add_generation_prompt": true}), "assistant"),
        (&user, json!({"add_generation_prompt": false}), "user"),
        (
            &user,
            json!({"chat_template_kwargs": {"add_generation_prompt": false}}),
            "user",
        ),
        (&system, json!({"add_generation_prompt": false}), "system"),
        (&system, json!({}), "assistant"),
        (
            &assistant,
            json!({"add_generation_prompt": false, "continue_final_message": true}),
            "assistant",
        ),
    ] {
        let mut body = json!({"model": MODEL, "messages": messages, "max_tokens": 2, "n": 2});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let r = post(addr, "/v1/chat/completions", &body).await;
        assert_eq!(r.status, 200, "{body}: {}", r.body);
        let v = r.json();
        for c in v["choices"].as_array().unwrap() {
            assert_eq!(c["message"]["role"], want, "{body}: {v}");
        }
        body["stream"] = json!(true);
        let r = post(addr, "/v1/chat/completions", &body).await;
        assert_eq!(r.status, 200, "{body}: {}", r.body);
        let mut roles = std::collections::BTreeMap::new();
        for e in r.events().iter().filter(|e| *e != "[DONE]") {
            let v: Value = serde_json::from_str(e).unwrap();
            for c in v["choices"].as_array().unwrap() {
                if let Some(role) = c["delta"].get("role") {
                    let first = roles.insert(c["index"].as_u64().unwrap(), role.clone());
                    assert_eq!(first, None, "a second role delta: {e}");
                }
            }
        }
        assert_eq!(roles.len(), 2, "{body}: {}", r.body);
        assert!(roles.values().all(|r| *r == want), "{body}: {roles:?}");
    }
    task.abort();
}

/// With `echo`, `logprobs` and `return_tokens_as_token_ids`, `text_offset` counts the
/// `token_id:{id}` strings the entries name, as vLLM's (which measures every offset in the
/// reported tokens' strings): from 0 at the first prompt token, each the sum of the lengths
/// before it, the output's continuing the prompt's, for a text or a token-id prompt, streamed
/// and not. Without `return_tokens_as_token_ids` the prompt's offsets index the echoed text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_logprobs_offsets_count_token_id_strings() {
    let srv = start(Opts::default()).await;
    let tok = common::stories_tokenizer();
    let prompt = "Once upon a time";
    let ids = tok.encode(prompt, true).unwrap();
    let n_prompt = ids.len();
    let cumulative = |tokens: &[String]| {
        let mut at = 0;
        tokens
            .iter()
            .map(|t| {
                let here = at;
                at += t.chars().count();
                here
            })
            .collect::<Vec<usize>>()
    };
    for p in [json!(prompt), json!(ids)] {
        let body = json!({"model": MODEL, "prompt": p, "max_tokens": 4, "temperature": 0,
                          "echo": true, "logprobs": 1, "return_tokens_as_token_ids": true});
        let plain = lp_completion(srv.addr, body.clone()).await.choices;
        let streamed = lp_completion_stream(srv.addr, body.clone()).await;
        for (how, c) in [("plain", &plain[0]), ("streamed", &streamed[0])] {
            let lp = &c.logprobs;
            assert_eq!(lp.tokens.len(), n_prompt + 4, "{p} {how}: {lp:?}");
            assert_eq!(lp.tokens[0], format!("token_id:{}", ids[0]), "{p} {how}");
            assert_eq!(
                lp.text_offset,
                cumulative(&lp.tokens),
                "{p} {how}: {:?}",
                lp.tokens
            );
        }
    }
    // Without it, the prompt's offsets index the echoed text and the output's start at its
    // end (as before).
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0,
                      "echo": true, "logprobs": 1});
    let v = lp_completion(srv.addr, body).await;
    let lp = &v.choices[0].logprobs;
    let chars = prompt.chars().count();
    assert_eq!(lp.text_offset[0], 0, "{lp:?}");
    assert!(
        lp.text_offset[..n_prompt].iter().all(|&o| o < chars),
        "{lp:?}"
    );
    assert_eq!(lp.text_offset[n_prompt], chars, "{lp:?}");
}

/// `/v1/responses` refuses the other endpoints' fields it has no use for with a message that
/// says where each is served: `return_tokens_as_token_ids`, `echo`, `logprobs` and
/// `max_tokens` are parameters of both completions and chat, not "chat completions
/// parameters".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_refusals_say_where_a_field_is_served() {
    let (addr, task, _) = recording_server().await;
    let both = "/v1/completions and /v1/chat/completions";
    for (field, value, served) in [
        ("return_tokens_as_token_ids", json!(true), both),
        ("echo", json!(true), both),
        ("logprobs", json!(true), both),
        ("prompt_logprobs", json!(1), both),
        ("max_tokens", json!(4), both),
        ("max_completion_tokens", json!(4), "/v1/chat/completions"),
        (
            "messages",
            json!([{"role": "user", "content": "Hi"}]),
            "/v1/chat/completions",
        ),
        (
            "continue_final_message",
            json!(true),
            "/v1/chat/completions",
        ),
    ] {
        let mut body = json!({"model": MODEL, "input": "Hi", "max_output_tokens": 2});
        body[field] = value;
        let r = post(addr, "/v1/responses", &body).await;
        assert_eq!(r.status, 400, "{field}: {}", r.body);
        let e = r.json()["error"].clone();
        assert_eq!(e["param"], field, "{e}");
        let message = e["message"].as_str().unwrap();
        assert!(
            message.starts_with(&format!("'{field}' is not supported on /v1/responses")),
            "{e}"
        );
        assert!(
            message.contains(&format!("a parameter of {served})")),
            "{e}"
        );
        assert!(!message.contains("a chat completions parameter"), "{e}");
    }
    task.abort();
}

/// `continue_final_message` with a final message whose content is empty (or blank) continues
/// the whole rendered chat, as transformers' `apply_chat_template` does (its cut at
/// `rindex("")`, the rendering's length, keeps it all): the prompt is the rendering without
/// the generation prompt, on chat and on `/tokenize`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn continue_final_message_with_an_empty_final_message_keeps_the_whole_prompt() {
    let (addr, task, prompts) = recording_server().await;
    for content in ["", "  "] {
        let messages = json!([{"role": "user", "content": "Tell a story."},
                              {"role": "assistant", "content": content}]);
        let closed = json!({"model": MODEL, "max_tokens": 2, "add_generation_prompt": false,
                            "messages": messages});
        let mut open = closed.clone();
        open["continue_final_message"] = json!(true);
        let (want, _) = engine_prompt(addr, &prompts, "/v1/chat/completions", closed).await;
        let (got, _) = engine_prompt(addr, &prompts, "/v1/chat/completions", open).await;
        assert_eq!(got, want, "content {content:?}");
        // The rendering ends with the closed (empty) message: `[/INST]  </s>`.
        let plain = json!({"prompt": "<s>[INST] Tell a story. [/INST]  </s>",
                           "add_special_tokens": false, "max_tokens": 2});
        let (rendered, _) = engine_prompt(addr, &prompts, "/v1/completions", plain).await;
        assert_eq!(got, rendered, "content {content:?}");
        let tokenize = json!({"messages": messages, "add_generation_prompt": false,
                              "continue_final_message": true});
        let r = post(addr, "/tokenize", &tokenize).await;
        assert_eq!(r.status, 200, "{}", r.body);
        let tokens: Vec<u32> = r.json()["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(tokens, want, "content {content:?}");
    }
    task.abort();
}

/// The `include` value that asks `/v1/responses` for the output's log-probabilities.
const OUTPUT_LOGPROBS: &str = "message.output_text.logprobs";

/// The `logprobs` of a non-streamed response's one output message.
fn response_logprobs(v: &Value) -> Vec<Value> {
    let content = &v["output"][0]["content"][0];
    assert_eq!(content["type"], "output_text", "{v}");
    content["logprobs"].as_array().expect("logprobs").clone()
}

/// Checks one Responses log-probability entry: `{"token", "logprob", "bytes",
/// "top_logprobs"}` with `k` alternatives of `{"token", "logprob", "bytes"}`, most likely
/// first, each log-probability in [-9999, 0] and each `bytes` its token's UTF-8. Without
/// `bytes` (the text events' shape, OpenAI's `ResponseTextDeltaEvent.logprobs`) no entry may
/// have bytes.
fn check_logprob_entry(e: &Value, k: usize, bytes: bool) {
    let keys = |v: &Value| -> Vec<String> {
        let mut k: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
        k.sort();
        k
    };
    let want: &[&str] = if bytes {
        &["bytes", "logprob", "token", "top_logprobs"]
    } else {
        &["logprob", "token", "top_logprobs"]
    };
    assert_eq!(keys(e), want, "{e}");
    let check = |v: &Value| {
        let token = v["token"].as_str().expect("token");
        let lp = v["logprob"].as_f64().expect("logprob");
        assert!((-9999.0..=0.0).contains(&lp), "{v}");
        if bytes {
            assert_eq!(v["bytes"], json!(token.as_bytes()), "{v}");
        }
        lp
    };
    let lp = check(e);
    let top = e["top_logprobs"].as_array().expect("top_logprobs");
    assert_eq!(top.len(), k, "{e}");
    let want_top: &[&str] = if bytes {
        &["bytes", "logprob", "token"]
    } else {
        &["logprob", "token"]
    };
    let tops: Vec<f64> = top
        .iter()
        .map(|t| {
            assert_eq!(keys(t), want_top, "{t}");
            check(t)
        })
        .collect();
    assert!(tops.windows(2).all(|w| w[0] >= w[1]), "not sorted: {e}");
    if let Some(best) = tops.first() {
        assert!(lp <= best + 1e-5, "{e}");
    }
}

/// The entries without their bytes (the text events' shape).
fn without_bytes(entries: &[Value]) -> Vec<Value> {
    entries
        .iter()
        .map(|e| {
            let mut e = e.clone();
            e.as_object_mut().unwrap().remove("bytes");
            for t in e["top_logprobs"].as_array_mut().unwrap() {
                t.as_object_mut().unwrap().remove("bytes");
            }
            e
        })
        .collect()
}

/// A streamed response's log-probabilities: the `response.output_text.delta` events' entries
/// concatenated, and the `response.output_text.done` event's. Each delta's entries are
/// checked to name tokens whose strings make up its text, with `k` alternatives each.
fn streamed_logprobs(events: &[(String, Value)], k: usize) -> (Vec<Value>, Vec<Value>) {
    let mut deltas = Vec::new();
    let mut done = None;
    for (kind, d) in events {
        match kind.as_str() {
            "response.output_text.delta" => {
                let entries = d["logprobs"].as_array().expect("delta logprobs");
                for e in entries {
                    check_logprob_entry(e, k, false);
                }
                deltas.extend(entries.iter().cloned());
            }
            "response.output_text.done" => {
                let entries = d["logprobs"].as_array().expect("done logprobs");
                for e in entries {
                    check_logprob_entry(e, k, false);
                }
                done = Some(entries.clone());
            }
            _ => assert!(d.get("logprobs").is_none(), "{kind}: {d}"),
        }
    }
    (deltas, done.expect("a response.output_text.done event"))
}

/// The concatenated token strings of log-probability entries.
fn entry_tokens(entries: &[Value]) -> String {
    entries
        .iter()
        .map(|e| e["token"].as_str().unwrap())
        .collect()
}

/// `/v1/responses` with `include: ["message.output_text.logprobs"]` returns the output text's
/// log-probabilities in OpenAI's shape, streamed and not: one entry per output token whose
/// strings make up the text, `top_logprobs` alternatives each (most likely first; greedy, the
/// sampled token is the first), and the streamed deltas' entries add up to the done event's
/// and the final response's. `top_logprobs` is echoed; without `include` there are none (vLLM's
/// rule, `top_logprobs` alone asks for nothing).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_logprobs_have_openai_shape_streamed_and_not() {
    let srv = start_chat(Opts::default()).await;
    let body = json!({"model": MODEL, "input": "Once upon a time", "max_output_tokens": 12,
                      "temperature": 0, "include": [OUTPUT_LOGPROBS], "top_logprobs": 2});
    let v = response(srv.addr, &body).await;
    assert_eq!(v["status"], "incomplete", "{v}");
    assert_eq!(v["top_logprobs"], 2, "{v}");
    let text = response_text(&v);
    let lp = response_logprobs(&v);
    assert_eq!(lp.len(), 12, "{v}");
    for e in &lp {
        check_logprob_entry(e, 2, true);
        // Greedy: the sampled token is the most likely one.
        assert_eq!(e["token"], e["top_logprobs"][0]["token"], "{e}");
        let (a, b) = (
            e["logprob"].as_f64().unwrap(),
            e["top_logprobs"][0]["logprob"].as_f64().unwrap(),
        );
        assert!((a - b).abs() < 1e-5, "{e}");
    }
    assert_eq!(entry_tokens(&lp), text);
    // Streamed: each delta carries its tokens' entries; together they are the done event's,
    // and the final response has the same list as the non-streamed one.
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    let r = post(srv.addr, "/v1/responses", &sb).await;
    let ev = response_events(&r);
    let (streamed, last) = check_response_stream_with(&ev, true);
    assert_eq!(streamed, text);
    let (deltas, done) = streamed_logprobs(&ev, 2);
    assert_eq!(deltas, without_bytes(&lp));
    assert_eq!(done, deltas);
    for (kind, d) in &ev {
        if kind == "response.output_text.delta" {
            let entries = d["logprobs"].as_array().unwrap();
            assert!(!entries.is_empty(), "{d}");
        }
    }
    let part = ev
        .iter()
        .find(|(k, _)| k == "response.content_part.done")
        .map(|(_, d)| d["part"]["logprobs"].clone())
        .unwrap();
    assert_eq!(part, json!(lp));
    assert_eq!(response_logprobs(&last), lp);
    assert_eq!(last["top_logprobs"], 2);
    // A token with no text of its own (the EOS that ends a structured output) comes in a last
    // delta with empty text: the deltas still add up to the done event's list.
    let format = json!({"type": "json_schema", "name": "x", "schema": {"enum": ["yes"]}});
    let sb = json!({"model": MODEL, "input": "Hi", "max_output_tokens": 10, "temperature": 0,
                    "include": [OUTPUT_LOGPROBS], "stream": true, "text": {"format": format}});
    let ev = response_events(&post(srv.addr, "/v1/responses", &sb).await);
    let (deltas, done) = streamed_logprobs(&ev, 0);
    assert_eq!(
        done.last().map(|e| e["token"].clone()),
        Some(json!("</s>")),
        "{done:?}"
    );
    assert_eq!(deltas, done);
    // include alone: no alternatives.
    let v = response(srv.addr, &with_fields(&body, json!({"top_logprobs": null}))).await;
    assert_eq!(v["top_logprobs"], 0, "{v}");
    let plain = response_logprobs(&v);
    assert_eq!(plain.len(), 12);
    for (e, full) in plain.iter().zip(&lp) {
        check_logprob_entry(e, 0, true);
        assert_eq!(e["token"], full["token"]);
    }
    // Without include: none, streamed or not, even with top_logprobs (echoed).
    for top in [json!(3), Value::Null] {
        let b = json!({"model": MODEL, "input": "Once upon a time", "max_output_tokens": 4,
                       "temperature": 0, "top_logprobs": top});
        let v = response(srv.addr, &b).await;
        assert_eq!(response_logprobs(&v), Vec::<Value>::new(), "{v}");
        assert_eq!(v["top_logprobs"], top.as_u64().unwrap_or(0), "{v}");
        let (_, last) = response_stream(srv.addr, &b).await;
        assert_eq!(response_logprobs(&last), Vec::<Value>::new(), "{last}");
    }
    assert!(wait_engine_idle(&srv.engine, Duration::from_secs(5)).await);
}

/// A response's log-probabilities are the chat endpoint's for the same greedy request on the
/// same engine: the same tokens, log-probabilities, bytes and alternatives; under
/// `--return-tokens-as-token-ids` both name tokens `token_id:{id}`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_logprobs_equal_the_chat_logprobs() {
    for as_ids in [false, true] {
        let srv = start_chat(Opts {
            return_tokens_as_token_ids: as_ids,
            ..Opts::default()
        })
        .await;
        let chat = post(
            srv.addr,
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "Lily wanted to"}],
                    "max_completion_tokens": 10, "temperature": 0, "logprobs": true,
                    "top_logprobs": 3}),
        )
        .await;
        assert_eq!(chat.status, 200, "{}", chat.body);
        let chat = chat.json();
        let want = chat["choices"][0]["logprobs"]["content"]
            .as_array()
            .unwrap()
            .clone();
        assert_eq!(want.len(), 10, "{chat}");
        let body = json!({"input": "Lily wanted to", "max_output_tokens": 10, "temperature": 0,
                          "include": [OUTPUT_LOGPROBS], "top_logprobs": 3});
        let v = response(srv.addr, &body).await;
        let got = response_logprobs(&v);
        assert_eq!(got, want, "as ids: {as_ids}");
        assert_eq!(
            response_text(&v),
            chat["choices"][0]["message"]["content"].as_str().unwrap()
        );
        if as_ids {
            assert!(
                got.iter()
                    .all(|e| e["token"].as_str().unwrap().starts_with("token_id:")),
                "{v}"
            );
        } else {
            assert_eq!(entry_tokens(&got), response_text(&v));
        }
        let mut sb = body.clone();
        sb["stream"] = json!(true);
        let r = post(srv.addr, "/v1/responses", &sb).await;
        let (_, last) = check_response_stream_with(&response_events(&r), true);
        assert_eq!(response_logprobs(&last), want, "as ids: {as_ids} streamed");
    }
}

/// With a reasoning parser only the answer's tokens have log-probabilities: not the reasoning's
/// nor the think tags, streamed and not; an output cut inside its reasoning has none. The
/// scripted engine gives every token its own log-probability (and one alternative), so the
/// entries show which tokens they are; the last one's is `-inf`, reported as -9999.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_logprobs_cover_only_the_answer_with_a_reasoning_parser() {
    use baton_frontend::reasoning::ReasoningParser;
    use baton_frontend::EngineEvent;
    let specials = ["<think>", "</think>"];
    let tok = common::tokenizer_with_specials(&specials);
    let (open, close) = (
        tok.piece_to_id("<think>").unwrap(),
        tok.piece_to_id("</think>").unwrap(),
    );
    let thought = tok.encode("Hmm, two and two make four", false).unwrap();
    let answer = tok.encode("It is 4.", false).unwrap();
    // The last token was masked out (-inf): reported as -9999, as everywhere.
    let lp_of = |i: usize, n: usize| {
        if i + 1 == n {
            f32::NEG_INFINITY
        } else {
            -0.125 * (i as f32 + 1.0)
        }
    };
    for (ids, answered) in [
        ([&[open][..], &thought, &[close], &answer].concat(), true),
        ([&thought[..], &[close], &answer].concat(), true),
        ([&[open][..], &thought].concat(), false),
    ] {
        let events = ids.clone();
        let (addr, task) = common::start_scripted_with_tokenizer(
            move |req| {
                let mut ev: Vec<EngineEvent> = events
                    .iter()
                    .enumerate()
                    .map(|(i, &token)| EngineEvent::Token {
                        token,
                        cached_tokens: 0,
                        logprob: lp_of(i, events.len()),
                        top: vec![(token, lp_of(i, events.len()))],
                        first: None,
                    })
                    .collect();
                ev.push(EngineEvent::Finished {
                    reason: baton_scheduler::FinishReason::Stop,
                    prompt_tokens: req.prompt.len(),
                    output_tokens: events.len(),
                    cached_tokens: 0,
                });
                ev
            },
            Some(TOOLS_TEMPLATE.into()),
            None,
            Some(ReasoningParser::DeepSeekR1),
            common::tokenizer_with_specials(&specials),
        )
        .await;
        let body = json!({"input": "2+2?", "include": [OUTPUT_LOGPROBS], "top_logprobs": 1});
        let v = response(addr, &body).await;
        let output = v["output"].as_array().unwrap();
        assert_eq!(output.len(), 2, "{v}");
        assert!(output[0].get("logprobs").is_none(), "{v}");
        assert!(
            output[0]["content"][0].get("logprobs").is_none(),
            "the reasoning has no log-probabilities: {v}"
        );
        let msg = &output[1]["content"][0];
        let lp = msg["logprobs"].as_array().unwrap().clone();
        // The answer's tokens are the last ones: their own log-probabilities, in order.
        let want: Vec<f64> = if answered {
            (ids.len() - answer.len()..ids.len())
                .map(|i| f64::from(lp_of(i, ids.len()).max(-9999.0)))
                .collect()
        } else {
            Vec::new()
        };
        let got: Vec<f64> = lp.iter().map(|e| e["logprob"].as_f64().unwrap()).collect();
        assert_eq!(got, want, "{v}");
        for e in &lp {
            check_logprob_entry(e, 1, true);
        }
        assert_eq!(entry_tokens(&lp), msg["text"].as_str().unwrap(), "{v}");
        // Streamed: the same entries, on the answer's deltas only.
        let mut sb = body.clone();
        sb["stream"] = json!(true);
        let r = post(addr, "/v1/responses", &sb).await;
        let ev = response_events(&r);
        let (deltas, done) = streamed_logprobs(&ev, 1);
        assert_eq!(deltas, without_bytes(&lp), "{}", r.body);
        assert_eq!(done, deltas);
        let (kind, last) = ev.last().unwrap();
        assert_eq!(kind, "response.completed", "{}", r.body);
        assert_eq!(
            last["response"]["output"][1]["content"][0]["logprobs"],
            json!(lp)
        );
        task.abort();
    }
}

/// `top_logprobs` must be an integer in 0..=20 and `include` a list of values this server
/// serves: out of range, the wrong type, an `include` value OpenAI defines for tools, images
/// or encrypted reasoning, or an unknown one, is a 400 naming the field (and the value).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_logprob_fields_out_of_range_or_unknown_are_400s() {
    let (addr, task, prompts) = recording_server().await;
    let cases: Vec<(Value, &str, &str)> = vec![
        (json!({"top_logprobs": 21}), "top_logprobs", "21"),
        (json!({"top_logprobs": -1}), "top_logprobs", "-1"),
        (json!({"top_logprobs": 2.5}), "top_logprobs", "2.5"),
        (json!({"top_logprobs": "two"}), "top_logprobs", "two"),
        (
            json!({"include": [OUTPUT_LOGPROBS], "top_logprobs": 21}),
            "top_logprobs",
            "21",
        ),
        (
            json!({"include": ["message.output_text.logprob"]}),
            "include",
            "message.output_text.logprob",
        ),
        (
            json!({"include": [OUTPUT_LOGPROBS, "nope"]}),
            "include",
            "nope",
        ),
        (
            json!({"include": ["reasoning.encrypted_content"]}),
            "include",
            "reasoning.encrypted_content",
        ),
        (
            json!({"include": ["file_search_call.results"]}),
            "include",
            "file_search_call.results",
        ),
        (json!({"include": OUTPUT_LOGPROBS}), "include", "list"),
        (json!({"include": [3]}), "include", "3"),
    ];
    for (extra, param, names) in cases {
        let body = with_fields(
            &json!({"model": MODEL, "input": "Hi", "max_output_tokens": 2}),
            extra,
        );
        let r = post(addr, "/v1/responses", &body).await;
        assert_eq!(r.status, 400, "{body}: {}", r.body);
        let e = r.json()["error"].clone();
        assert_eq!(e["param"], param, "{body}: {e}");
        assert_eq!(e["type"], "invalid_request_error", "{e}");
        assert!(
            e["message"].as_str().unwrap().contains(names),
            "{body}: {e}"
        );
    }
    assert!(
        prompts.lock().unwrap().is_empty(),
        "a bad request reached the engine"
    );
    // The edges and `null`s are accepted; only `include` asks the engine for log-probabilities,
    // with `top_logprobs` alternatives.
    for (extra, want) in [
        (json!({"top_logprobs": 20}), None),
        (json!({"top_logprobs": 0, "include": []}), None),
        (json!({"top_logprobs": null, "include": null}), None),
        (json!({"include": [OUTPUT_LOGPROBS]}), Some(0)),
        (
            json!({"include": [OUTPUT_LOGPROBS], "top_logprobs": 20}),
            Some(20),
        ),
        (
            json!({"include": [OUTPUT_LOGPROBS, OUTPUT_LOGPROBS], "top_logprobs": 2.0}),
            Some(2),
        ),
    ] {
        let body = with_fields(
            &json!({"model": MODEL, "input": "Hi", "max_output_tokens": 2}),
            extra,
        );
        let r = post(addr, "/v1/responses", &body).await;
        assert_eq!(r.status, 200, "{body}: {}", r.body);
        let req = prompts
            .lock()
            .unwrap()
            .pop()
            .expect("the request reached the engine");
        let p = req.params;
        assert_eq!(
            want,
            (p.want_logprob != 0).then_some(p.top_logprobs),
            "{body}"
        );
    }
    task.abort();
}

/// vLLM's `--seed` ([`ServerConfig::seed`]): the streams of requests that give no `seed` are
/// fixed by it, so a restarted server sent the same requests samples the same tokens; every
/// sequence still gets its own stream (choices of `n` and successive requests differ); a
/// request's own `seed` wins; without the flag each sequence's seed is random.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_seed_fixes_the_streams_of_requests_without_one() {
    use baton_frontend::{AppState, EngineEvent, ServerConfig};
    use baton_scheduler::FinishReason;
    use std::sync::Arc;
    async fn seeds(seed: Option<u64>, bodies: &[Value]) -> Vec<u64> {
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let log = Arc::clone(&seen);
        let script = move |req: &baton_frontend::EngineRequest| {
            log.lock().unwrap().push(req.params.seed);
            vec![EngineEvent::Finished {
                reason: FinishReason::Length,
                prompt_tokens: req.prompt.len(),
                output_tokens: 0,
                cached_tokens: 0,
            }]
        };
        let cfg = ServerConfig {
            seed,
            ..common::scripted_config()
        };
        let state = Arc::new(
            AppState::new(
                cfg,
                common::stories_tokenizer(),
                Arc::new(common::Scripted(script)),
                vec![common::EOS],
            )
            .unwrap(),
        );
        let (listener, addr) = baton_frontend::bind("127.0.0.1", 0).await.unwrap();
        let task = tokio::spawn(async move {
            let _ = baton_frontend::serve_state(listener, state, std::future::pending()).await;
        });
        for b in bodies {
            let r = post(addr, "/v1/completions", b).await;
            assert_eq!(r.status, 200, "{}", r.body);
        }
        task.abort();
        let out = seen.lock().unwrap().clone();
        out
    }
    let bodies = [
        json!({"prompt": "a", "max_tokens": 1, "temperature": 1.0, "n": 2}),
        json!({"prompt": "b", "max_tokens": 1, "temperature": 1.0}),
        json!({"prompt": "c", "max_tokens": 1, "temperature": 1.0, "seed": 5}),
    ];
    let a = seeds(Some(7), &bodies).await;
    let b = seeds(Some(7), &bodies).await;
    assert_eq!(a.len(), 4);
    assert_eq!(a, b, "a restarted server with the same --seed");
    assert!(a[0] != a[1] && a[1] != a[2] && a[0] != a[2], "{a:?}");
    assert_eq!(a[3], 5, "a request's own seed wins");
    let other = seeds(Some(8), &bodies).await;
    assert_ne!(other[..3], a[..3], "another --seed");
    let (r1, r2) = (seeds(None, &bodies).await, seeds(None, &bodies).await);
    assert_ne!(r1[..3], r2[..3], "without --seed the streams are random");
}

/// The weather tool in the Responses API's flat form.
fn weather_fn() -> Value {
    json!({"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}})
}

/// A streamed response's output items as a client accumulates them from the events (the
/// openai SDK's stream helper): each `output_item.added` at the next index, text, reasoning
/// and argument deltas appended, each `output_item.done` checked against what its deltas
/// accumulated and taking the item's place. Checks event types, sequence numbers and that
/// the last event's response carries exactly these items; returns them and that response.
fn accumulate_response_stream(events: &[(String, Value)]) -> (Vec<Value>, Value) {
    let mut items: Vec<Value> = Vec::new();
    let mut acc: Vec<String> = Vec::new();
    let (last_kind, last) = events.last().expect("events");
    for (i, (kind, d)) in events.iter().enumerate() {
        assert_eq!(d["type"], kind.as_str(), "event {i}: {d}");
        assert_eq!(d["sequence_number"], i, "event {i}: {d}");
        let at = || d["output_index"].as_u64().expect("output_index") as usize;
        match kind.as_str() {
            "response.output_item.added" => {
                assert_eq!(at(), items.len(), "{d}");
                assert_eq!(d["item"]["status"], "in_progress", "{d}");
                items.push(d["item"].clone());
                acc.push(String::new());
            }
            "response.output_text.delta"
            | "response.reasoning_text.delta"
            | "response.function_call_arguments.delta" => {
                let k = at();
                assert_eq!(d["item_id"], items[k]["id"], "{d}");
                acc[k].push_str(d["delta"].as_str().expect("delta"));
            }
            "response.function_call_arguments.done" => {
                let k = at();
                assert_eq!(d["item_id"], items[k]["id"], "{d}");
                assert_eq!(d["arguments"], acc[k].as_str(), "{d}");
            }
            "response.output_item.done" => {
                let k = at();
                let item = &d["item"];
                assert_eq!(item["id"], items[k]["id"], "{d}");
                let whole = match item["type"].as_str() {
                    Some("function_call") => &item["arguments"],
                    _ => &item["content"][0]["text"],
                };
                assert_eq!(*whole, acc[k].as_str(), "{d}");
                items[k] = item.clone();
            }
            _ => {}
        }
    }
    assert!(
        matches!(
            last_kind.as_str(),
            "response.completed" | "response.incomplete"
        ),
        "{last_kind}"
    );
    let response = last["response"].clone();
    assert_eq!(response["output"], json!(items), "{response}");
    (items, response)
}

/// A response's output items with their ids checked and replaced by placeholders: `msg_`,
/// `rs_` and `fc_` item ids, and call ids of vLLM's form or the `mistral` parser's 9 letters
/// and digits.
fn without_item_ids(items: &[Value]) -> Vec<Value> {
    items
        .iter()
        .map(|it| {
            let mut it = it.clone();
            let prefix = match it["type"].as_str() {
                Some("message") => "msg_",
                Some("reasoning") => "rs_",
                Some("function_call") => "fc_",
                _ => panic!("unknown item {it}"),
            };
            let id = it["id"].as_str().expect("id");
            assert!(id.starts_with(prefix), "{it}");
            it["id"] = json!("ID");
            if let Some(call) = it.get("call_id") {
                let call = call.as_str().expect("call_id");
                let ok = match call.strip_prefix("chatcmpl-tool-") {
                    Some(hex) => hex.len() == 32 && hex.chars().all(|c| c.is_ascii_hexdigit()),
                    None => call.len() == 9 && call.chars().all(|c| c.is_ascii_alphanumeric()),
                };
                assert!(ok, "{call}");
                it["call_id"] = json!("CALL");
            }
            it
        })
        .collect()
}

/// Posts a Responses `body` streamed and not; checks that both give the same output items
/// (ids aside) and status; returns the items (ids replaced) and the non-streamed response.
async fn responses_both_ways(addr: std::net::SocketAddr, body: &Value) -> (Vec<Value>, Value) {
    let v = response(addr, body).await;
    let items = without_item_ids(v["output"].as_array().expect("output"));
    let r = post(
        addr,
        "/v1/responses",
        &with_fields(body, json!({"stream": true})),
    )
    .await;
    let (streamed, last) = accumulate_response_stream(&response_events(&r));
    assert_eq!(
        without_item_ids(&streamed),
        items,
        "streamed vs not: {body}"
    );
    assert_eq!(last["status"], v["status"]);
    // (The second run may find its prompt in the prefix cache.)
    for key in ["input_tokens", "output_tokens"] {
        assert_eq!(last["usage"][key], v["usage"][key], "{key}");
    }
    (items, v)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_function_calls_come_back_as_function_call_items_streamed_and_not() {
    use baton_frontend::tools::ToolParser;
    let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\", \"note\": \"café ☕\"}}\n</tool_call>";
    let (addr, task, _, n_out) = tool_server(text, Some(ToolParser::Hermes)).await;
    let body = json!({"input": "Weather?", "tools": [weather_fn()]});
    let (items, v) = responses_both_ways(addr, &body).await;
    assert_eq!(v["status"], "completed", "{v}");
    assert_eq!(v["usage"]["output_tokens"], n_out);
    // The text before the call is a message, the call a function_call item (the arguments
    // as vLLM writes them).
    assert_eq!(
        items,
        vec![
            json!({"type": "message", "id": "ID", "status": "completed", "role": "assistant",
                   "content": [{"type": "output_text", "text": " Let me check.\n",
                                "annotations": [], "logprobs": []}]}),
            json!({"type": "function_call", "id": "ID", "call_id": "CALL",
                   "name": "get_weather",
                   "arguments": "{\"city\": \"Zürich\", \"note\": \"café ☕\"}",
                   "status": "completed"}),
        ]
    );
    // The tools and tool_choice are echoed in OpenAI's shape.
    let mut echo = weather_fn();
    echo["strict"] = Value::Null;
    assert_eq!(v["tools"], json!([echo]));
    assert_eq!(v["tool_choice"], "auto");
    // Each response's call has its own id.
    let again = response(addr, &body).await;
    assert_ne!(again["output"][1]["call_id"], v["output"][1]["call_id"]);
    assert_ne!(again["output"][1]["id"], v["output"][1]["id"]);
    task.abort();

    // Calls only: no message item; several calls in order.
    let text = "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}; {\"name\": \"get_weather\", \"parameters\": {\"city\": \"Rome\"}}";
    let (addr, task, _, _) = tool_server(text, Some(ToolParser::Llama3Json)).await;
    let (items, v) = responses_both_ways(addr, &body).await;
    assert_eq!(v["status"], "completed", "{v}");
    let calls: Vec<(&str, &str)> = items
        .iter()
        .map(|it| {
            assert_eq!(it["type"], "function_call", "{v}");
            (
                it["name"].as_str().unwrap(),
                it["arguments"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        calls,
        [
            ("get_weather", "{\"city\": \"Paris\"}"),
            ("get_weather", "{\"city\": \"Rome\"}")
        ]
    );
    assert_ne!(v["output"][0]["call_id"], v["output"][1]["call_id"]);
    // tool_choice "none": the same output is text.
    let (items, _) =
        responses_both_ways(addr, &with_fields(&body, json!({"tool_choice": "none"}))).await;
    assert_eq!(items.len(), 1);
    assert_eq!(items[0]["content"][0]["text"], format!(" {text}"));
    task.abort();

    // Text that is no call is a message, with tools and a parser.
    let (addr, task, _, _) = tool_server("It is sunny.", Some(ToolParser::Hermes)).await;
    let (items, _) = responses_both_ways(addr, &body).await;
    assert_eq!(items.len(), 1);
    assert_eq!(items[0]["content"][0]["text"], " It is sunny.");
    task.abort();

    // Mistral's call ids (9 letters and digits, which its templates check).
    let text = "[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}]";
    let (addr, task, _, _) = tool_server(text, Some(ToolParser::Mistral)).await;
    let v = response(addr, &body).await;
    let call = v["output"]
        .as_array()
        .unwrap()
        .iter()
        .find(|it| it["type"] == "function_call")
        .unwrap_or_else(|| panic!("{v}"));
    let id = call["call_id"].as_str().unwrap();
    assert!(
        id.len() == 9 && id.chars().all(|c| c.is_ascii_alphanumeric()),
        "{id}"
    );
    task.abort();
}

/// With a reasoning parser, the reasoning item comes first, and only the answer is parsed for
/// calls; a call cut by `max_output_tokens` leaves the response incomplete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_function_calls_follow_the_reasoning_item() {
    use baton_frontend::reasoning::ReasoningParser;
    use baton_frontend::tools::ToolParser;
    use baton_scheduler::FinishReason;
    let text = "<think>Maybe <tool_call>{\"name\": \"nope\", \"arguments\": {}}</tool_call>?</think><tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
    let (addr, task, _, _) = text_server(
        text,
        Some(ToolParser::Hermes),
        Some(ReasoningParser::Qwen3),
        FinishReason::Stop,
    )
    .await;
    let body = json!({"input": "Weather?", "tools": [weather_fn()]});
    let (items, v) = responses_both_ways(addr, &body).await;
    assert_eq!(v["status"], "completed", "{v}");
    let kinds: Vec<&str> = items
        .iter()
        .map(|it| it["type"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, ["reasoning", "function_call"], "{v}");
    assert_eq!(
        items[0]["content"][0]["text"],
        " Maybe <tool_call>{\"name\": \"nope\", \"arguments\": {}}</tool_call>?"
    );
    assert_eq!(items[1]["name"], "get_weather");
    assert_eq!(items[1]["arguments"], "{\"city\": \"Paris\"}");
    task.abort();
    // The engine stopped at the length limit: incomplete, and so is the item.
    let text =
        "<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Lima\"}}</tool_call>";
    let (addr, task, _, _) =
        text_server(text, Some(ToolParser::Hermes), None, FinishReason::Length).await;
    let (items, v) = responses_both_ways(addr, &body).await;
    assert_eq!(v["status"], "incomplete", "{v}");
    assert_eq!(v["incomplete_details"]["reason"], "max_output_tokens");
    let last = items.last().unwrap();
    assert_eq!(
        (&last["type"], &last["status"]),
        (&json!("function_call"), &json!("incomplete")),
        "{v}"
    );
    task.abort();
}

/// `function_call` and `function_call_output` input items render as the equivalent chat
/// conversation's assistant tool calls and tool messages (vLLM's conversion), with the flat
/// tools in the chat form.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_tool_round_trips_render_as_the_equivalent_chat() {
    let (addr, task, prompts, _) = tool_server("It is sunny.", None).await;
    let chat = json!({
    "tools": [weather_tool()], "tool_choice": "none",
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
            {"id": "call_2", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Rome\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "25 C"},
    ]});
    let resp = json!({
    "tools": [weather_fn()], "tool_choice": "none", "instructions": "Be brief.",
    "input": [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
         "arguments": "{\"city\": \"Paris\"}", "status": "completed"},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather",
         "arguments": "{\"city\": \"Rome\"}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "22 C"},
        {"type": "function_call_output", "call_id": "call_2",
         "output": [{"type": "input_text", "text": "25 C"}]},
    ]});
    let r = post(addr, "/v1/chat/completions", &chat).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v = response(addr, &resp).await;
    assert_eq!(v["output"][0]["content"][0]["text"], " It is sunny.");
    let seen = prompts.lock().unwrap().clone();
    assert_eq!(seen.len(), 2);
    let tok = common::stories_tokenizer();
    let prompt = tok.decode(&seen[0], true).unwrap();
    assert!(prompt.starts_with("TOOL get_weather: {"), "{prompt}");
    assert!(
        prompt.contains("CITY=Paris CALL get_weather({\"city\": \"Rome\"}) CITY=Rome"),
        "{prompt}"
    );
    assert!(prompt.contains("tool: 25 C [call_2]"), "{prompt}");
    assert_eq!(seen[1], seen[0], "{}", tok.decode(&seen[1], true).unwrap());
    // A call with no text before it, after reasoning: one assistant message with both.
    let resp = json!({"input": [
        {"role": "user", "content": "Weather?"},
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "Use the tool."}]},
        {"type": "function_call", "call_id": "c", "name": "get_weather", "arguments": ""},
        {"type": "function_call_output", "call_id": "c", "output": "cold"}]});
    response(addr, &resp).await;
    let prompt = tok.decode(&prompts.lock().unwrap()[2], true).unwrap();
    assert_eq!(
        prompt,
        "user: Weather?assistant:  CALL get_weather({}) CITY=tool: cold [c]assistant:"
    );
    task.abort();
}

/// `tool_choice` `required` and a named function guide the real model's output into
/// `function_call` items of the given tools, with arguments valid under their parameters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_tool_choice_required_and_named_guide_the_output() {
    let srv = start_chat(Opts::default()).await;
    let tool = |name: &str, cities: &[&str]| {
        json!({"type": "function", "name": name, "strict": true, "parameters": {
            "type": "object", "properties": {"city": {"type": "string", "enum": cities}},
            "required": ["city"], "additionalProperties": false}})
    };
    let tools = json!([
        tool("get_weather", &["Paris", "Rome"]),
        tool("get_time", &["Oslo", "Lima"])
    ]);
    for (choice, named) in [
        (
            json!({"type": "function", "name": "get_time"}),
            Some("get_time"),
        ),
        (json!("required"), None),
    ] {
        let body = json!({"model": MODEL, "input": "Once upon a time", "tools": tools,
                          "tool_choice": choice, "max_output_tokens": 60,
                          "parallel_tool_calls": false, "temperature": 0});
        let (items, v) = responses_both_ways(srv.addr, &body).await;
        assert_eq!(v["status"], "completed", "{v}");
        assert_eq!(v["tool_choice"], choice);
        assert_eq!(v["tools"][0]["strict"], true);
        assert_eq!(items.len(), 1, "{v}");
        let it = &items[0];
        assert_eq!(it["type"], "function_call", "{v}");
        let name = it["name"].as_str().unwrap();
        if let Some(n) = named {
            assert_eq!(name, n);
        }
        let cities: &[&str] = if name == "get_weather" {
            &["Paris", "Rome"]
        } else {
            &["Oslo", "Lima"]
        };
        let args: Value = serde_json::from_str(it["arguments"].as_str().unwrap()).unwrap();
        assert!(cities.contains(&args["city"].as_str().unwrap()), "{v}");
        assert_eq!(args.as_object().unwrap().len(), 1, "{v}");
    }
    // An empty parameters schema is no parameters (vLLM's rule): the arguments are `{}`, not
    // any JSON value (a trial got a string).
    let body = json!({"model": MODEL, "input": "hi", "temperature": 0, "max_output_tokens": 60,
                      "tools": [{"type": "function", "name": "ping", "parameters": {}}],
                      "tool_choice": {"type": "function", "name": "ping"}});
    let v = response(srv.addr, &body).await;
    assert_eq!(v["output"][0]["arguments"], "{}", "{v}");
}

/// A streamed `/v1/messages` response's content blocks as Anthropic's SDK accumulates them
/// (text, thinking and `input_json_delta` appended; a tool use's input parsed from its JSON),
/// checking the event order (`message_start` first; each block started, its deltas, stopped,
/// at increasing indices; then `message_delta` and `message_stop`); returns the message with
/// its content, `stop_reason`, `stop_sequence` and usage from `message_delta`.
fn accumulate_message_stream(r: &common::Resp) -> Value {
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    let events = response_events(r);
    let kinds: Vec<&str> = events.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(kinds.first(), Some(&"message_start"), "{kinds:?}");
    assert_eq!(
        kinds[kinds.len() - 2..],
        ["message_delta", "message_stop"],
        "{kinds:?}"
    );
    let mut msg = events[0].1["message"].clone();
    assert_eq!(msg["content"], json!([]));
    assert!(msg["stop_reason"].is_null());
    let mut blocks: Vec<Value> = Vec::new();
    let mut json_parts: Vec<String> = Vec::new();
    let mut open: Option<usize> = None;
    for (kind, d) in &events[1..events.len() - 2] {
        assert_eq!(d["type"], kind.as_str(), "{d}");
        let index = d["index"].as_u64().expect("index") as usize;
        match kind.as_str() {
            "content_block_start" => {
                assert_eq!(open, None, "{kinds:?}");
                assert_eq!(index, blocks.len(), "{d}");
                open = Some(index);
                blocks.push(d["content_block"].clone());
                json_parts.push(String::new());
            }
            "content_block_delta" => {
                assert_eq!(open, Some(index), "{d}");
                let b = &mut blocks[index];
                let delta = &d["delta"];
                match delta["type"].as_str() {
                    Some("text_delta") => {
                        let t = b["text"].as_str().unwrap().to_owned();
                        b["text"] = json!(t + delta["text"].as_str().unwrap());
                    }
                    Some("thinking_delta") => {
                        let t = b["thinking"].as_str().unwrap().to_owned();
                        b["thinking"] = json!(t + delta["thinking"].as_str().unwrap());
                    }
                    Some("signature_delta") => b["signature"] = delta["signature"].clone(),
                    Some("input_json_delta") => {
                        json_parts[index].push_str(delta["partial_json"].as_str().unwrap())
                    }
                    _ => panic!("unknown delta {d}"),
                }
            }
            "content_block_stop" => {
                assert_eq!(open, Some(index), "{d}");
                open = None;
                if blocks[index]["type"] == "tool_use" {
                    blocks[index]["input"] = serde_json::from_str(&json_parts[index]).unwrap();
                }
            }
            _ => panic!("unexpected event {kind}: {d}"),
        }
    }
    assert_eq!(open, None);
    let delta = &events[events.len() - 2].1;
    // message_start already splits the input as the end does (the prefix-cache count is known
    // by then).
    for key in ["input_tokens", "cache_read_input_tokens"] {
        assert_eq!(msg["usage"][key], delta["usage"][key], "{key}: {}", r.body);
    }
    msg["content"] = json!(blocks);
    msg["stop_reason"] = delta["delta"]["stop_reason"].clone();
    msg["stop_sequence"] = delta["delta"]["stop_sequence"].clone();
    msg["usage"] = delta["usage"].clone();
    msg
}

/// A message with its ids (`msg_`, tool uses') and thinking signatures checked and replaced.
fn without_message_ids(m: &Value) -> Value {
    let mut m = m.clone();
    let id = m["id"].as_str().expect("id");
    assert!(id.len() == 36 && id.starts_with("msg_"), "{id}");
    m["id"] = json!("ID");
    for b in m["content"].as_array_mut().expect("content") {
        match b["type"].as_str() {
            Some("tool_use") => {
                assert!(!b["id"].as_str().expect("tool use id").is_empty(), "{b}");
                b["id"] = json!("TOOL");
            }
            Some("thinking") => {
                assert_eq!(b["signature"].as_str().expect("signature").len(), 32);
                b["signature"] = json!("SIG");
            }
            _ => {}
        }
    }
    m
}

/// Posts a Messages `body` streamed and not; checks both give the same message (ids aside);
/// returns it (ids replaced).
async fn messages_both_ways(addr: std::net::SocketAddr, body: &Value) -> Value {
    let r = post(addr, "/v1/messages", body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let whole = without_message_ids(&r.json());
    let r = post(
        addr,
        "/v1/messages",
        &with_fields(body, json!({"stream": true})),
    )
    .await;
    // (The second run may find its prompt in the prefix cache: the input counts are compared
    // as their sum.)
    let uncached = |m: &Value| {
        let mut m = m.clone();
        let u = &mut m["usage"];
        let input =
            u["input_tokens"].as_u64().unwrap() + u["cache_read_input_tokens"].as_u64().unwrap();
        u["input_tokens"] = json!(input);
        u["cache_read_input_tokens"] = json!(0);
        m
    };
    let streamed = uncached(&without_message_ids(&accumulate_message_stream(&r)));
    let whole_cmp = uncached(&whole);
    assert_eq!(streamed, whole_cmp, "streamed vs not: {body}");
    whole
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_have_anthropic_shape_and_match_the_equivalent_chat() {
    let srv = start_chat(Opts::default()).await;
    let body = json!({"model": MODEL, "max_tokens": 16, "temperature": 0,
                      "system": [{"type": "text", "text": "Tell a story."}],
                      "messages": [{"role": "user", "content": [
                          {"type": "text", "text": "Once upon a time"}]}]});
    let m = messages_both_ways(srv.addr, &body).await;
    assert_eq!(m["type"], "message", "{m}");
    assert_eq!(m["role"], "assistant");
    assert_eq!(m["model"], MODEL);
    assert_eq!(m["stop_reason"], "max_tokens");
    assert!(m["stop_sequence"].is_null());
    let content = m["content"].as_array().unwrap();
    assert_eq!(content.len(), 1, "{m}");
    assert_eq!(content[0]["type"], "text");
    // The same as the equivalent chat request (greedy).
    let chat = post(
        srv.addr,
        "/v1/chat/completions",
        &json!({"max_tokens": 16, "temperature": 0, "messages": [
            {"role": "system", "content": "Tell a story."},
            {"role": "user", "content": "Once upon a time"}]}),
    )
    .await
    .json();
    assert_eq!(
        content[0]["text"], chat["choices"][0]["message"]["content"],
        "{m}"
    );
    let u = &m["usage"];
    assert_eq!(u["output_tokens"], 16);
    assert_eq!(
        u["input_tokens"].as_u64().unwrap() + u["cache_read_input_tokens"].as_u64().unwrap(),
        chat["usage"]["prompt_tokens"].as_u64().unwrap(),
        "{m}"
    );
    assert_eq!(u["cache_creation_input_tokens"], 0);
    // count_tokens gives the same prompt size without generating.
    let mut count = body.clone();
    count.as_object_mut().unwrap().remove("max_tokens");
    let r = post(srv.addr, "/v1/messages/count_tokens", &count).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        r.json(),
        json!({"input_tokens": chat["usage"]["prompt_tokens"]})
    );
    // A stop sequence the output reaches ends it with `stop_sequence`; an EOS with `end_turn`.
    let text = content[0]["text"].as_str().unwrap();
    let word = text.split_whitespace().nth(2).unwrap().to_owned();
    let stopped = messages_both_ways(
        srv.addr,
        &with_fields(&body, json!({"stop_sequences": ["zzz", word]})),
    )
    .await;
    assert_eq!(stopped["stop_reason"], "stop_sequence", "{stopped}");
    assert_eq!(stopped["stop_sequence"], json!(word));
    let before = &text[..text.find(&word).unwrap()];
    assert_eq!(stopped["content"][0]["text"], before, "{stopped}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_tool_use_and_thinking_blocks_streamed_and_not() {
    use baton_frontend::reasoning::ReasoningParser;
    use baton_frontend::tools::ToolParser;
    use baton_scheduler::FinishReason;
    let tools = json!([{"name": "get_weather", "description": "The weather in a city.",
                        "input_schema": {"type": "object",
                                         "properties": {"city": {"type": "string"}},
                                         "required": ["city"]}}]);
    let text = "<think>Need the tool.</think>Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\"}}\n</tool_call>";
    let (addr, task, _, n_out) = text_server(
        text,
        Some(ToolParser::Hermes),
        Some(ReasoningParser::Qwen3),
        FinishReason::Stop,
    )
    .await;
    let body = json!({"max_tokens": 100, "tools": tools,
                      "messages": [{"role": "user", "content": "Weather?"}]});
    let m = messages_both_ways(addr, &body).await;
    assert_eq!(m["stop_reason"], "tool_use", "{m}");
    assert_eq!(m["usage"]["output_tokens"], n_out);
    assert_eq!(
        m["content"],
        json!([
            {"type": "thinking", "thinking": " Need the tool.", "signature": "SIG"},
            {"type": "text", "text": "Let me check.\n"},
            {"type": "tool_use", "id": "TOOL", "name": "get_weather", "input": {"city": "Zürich"}},
        ])
    );
    // tool_choice none: all text (after the thinking).
    let m = messages_both_ways(
        addr,
        &with_fields(&body, json!({"tool_choice": {"type": "none"}})),
    )
    .await;
    assert_eq!(m["stop_reason"], "end_turn", "{m}");
    assert_eq!(m["content"].as_array().unwrap().len(), 2, "{m}");
    assert!(m["content"][1]["text"]
        .as_str()
        .unwrap()
        .contains("<tool_call>"));
    task.abort();
}

/// A conversation with tool use renders as the equivalent chat conversation: the assistant's
/// `tool_use` as its `tool_calls`, its `thinking` as its reasoning, the user's `tool_result`s
/// as `tool` messages before the user's own text (vLLM's conversion).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_tool_round_trips_render_as_the_equivalent_chat() {
    let (addr, task, prompts, _) = tool_server("It is sunny.", None).await;
    let chat = json!({
    "tools": [weather_tool()], "tool_choice": "none", "max_tokens": 5,
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "t1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
            {"id": "t2", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Rome\"}"}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "22 C"},
        {"role": "tool", "tool_call_id": "t2", "content": "25 C"},
        {"role": "user", "content": "Thanks."},
    ]});
    let msgs = json!({
    "system": "Be brief.", "max_tokens": 5, "tool_choice": {"type": "none"},
    "tools": [{"name": "get_weather", "description": "The weather in a city.",
               "input_schema": {"type": "object",
                                "properties": {"city": {"type": "string"}},
                                "required": ["city"]}}],
    "messages": [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "t2", "name": "get_weather", "input": {"city": "Rome"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": "22 C"},
            {"type": "tool_result", "tool_use_id": "t2",
             "content": [{"type": "text", "text": "25 C"}]},
            {"type": "text", "text": "Thanks."}]},
    ]});
    let r = post(addr, "/v1/chat/completions", &chat).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let r = post(addr, "/v1/messages", &msgs).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let seen = prompts.lock().unwrap().clone();
    let tok = common::stories_tokenizer();
    let prompt = tok.decode(&seen[0], true).unwrap();
    assert!(prompt.contains("tool: 25 C [t2]user: Thanks."), "{prompt}");
    assert_eq!(seen[1], seen[0], "{}", tok.decode(&seen[1], true).unwrap());
    // Claude Code's attribution block (a per-request hash) is dropped from the system prompt,
    // its `ctx` role is a user turn, and tool references render nothing (as vLLM).
    let chat = json!({"max_tokens": 5, "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Context."},
        {"role": "user", "content": "Hi."}]});
    let msgs = json!({"max_tokens": 5,
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2; cch=1a2b;"},
                   {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "ctx", "content": "Context."},
            {"role": "user", "content": [{"type": "tool_reference", "tool_name": "get_weather"},
                                         {"type": "text", "text": "Hi."}]}]});
    assert_eq!(post(addr, "/v1/chat/completions", &chat).await.status, 200);
    let r = post(addr, "/v1/messages", &msgs).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let seen = prompts.lock().unwrap().clone();
    assert_eq!(seen[3], seen[2], "{}", tok.decode(&seen[3], true).unwrap());
    task.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_refusals_have_anthropic_error_shape_naming_the_field() {
    let srv = start_chat(Opts {
        max_model_len: Some(128),
        ..Opts::default()
    })
    .await;
    let user = json!([{"role": "user", "content": "hi"}]);
    let ok = json!({"max_tokens": 4, "messages": user});
    let tool = json!({"name": "f", "input_schema": {"type": "object"}});
    let cases: Vec<(Value, &str)> = vec![
        (json!({"messages": user}), "max_tokens"),
        (with_fields(&ok, json!({"max_tokens": 0})), "max_tokens"),
        (with_fields(&ok, json!({"max_tokens": 1000})), "max_tokens"),
        (with_fields(&ok, json!({"messages": []})), "messages"),
        (with_fields(&ok, json!({"messages": "hi"})), "messages"),
        (
            with_fields(&ok, json!({"messages": [{"role": "tool", "content": "x"}]})),
            "messages[0].role",
        ),
        (
            with_fields(&ok, json!({"messages": [{"role": "user"}]})),
            "messages[0].content",
        ),
        (
            with_fields(
                &ok,
                json!({"messages": [{"role": "user", "content": [
                {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}]}),
            ),
            "messages[0].content[0].type",
        ),
        (
            with_fields(
                &ok,
                json!({"messages": [{"role": "user", "content": [
                {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}),
            ),
            "messages[0].content[0].type",
        ),
        (
            with_fields(
                &ok,
                json!({"messages": [{"role": "assistant", "content": [
                {"type": "tool_use", "id": "t", "name": "f", "input": "x"}]}]}),
            ),
            "messages[0].content[0].input",
        ),
        (
            with_fields(
                &ok,
                json!({"messages": [{"role": "user", "content": [
                {"type": "tool_result", "content": "x"}]}]}),
            ),
            "messages[0].content[0].tool_use_id",
        ),
        (
            with_fields(&ok, json!({"system": [{"type": "image"}]})),
            "system[0]",
        ),
        (with_fields(&ok, json!({"system": 5})), "system"),
        (
            with_fields(&ok, json!({"stop_sequences": "x"})),
            "stop_sequences",
        ),
        (
            with_fields(&ok, json!({"stop_sequences": [1]})),
            "stop_sequences",
        ),
        // Errors found after the conversion name the Messages API's fields.
        (
            with_fields(
                &ok,
                json!({"output_config": {"format": {"type": "json_schema",
                "schema": {"type": "nonsense"}}}}),
            ),
            "output_config.format",
        ),
        (
            with_fields(
                &ok,
                json!({"tool_choice": {"type": "any"}, "tools": (0..1001)
                .map(|i| json!({"name": format!("f{i}"), "input_schema": {"type": "object"}}))
                .collect::<Vec<_>>()}),
            ),
            "tools",
        ),
        (with_fields(&ok, json!({"temperature": -1})), "temperature"),
        (
            with_fields(
                &ok,
                json!({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}),
            ),
            "tools[0].type",
        ),
        (
            with_fields(&ok, json!({"tools": [{"name": "f"}]})),
            "tools[0].input_schema",
        ),
        (
            with_fields(
                &ok,
                json!({"tools": [tool], "tool_choice": {"type": "tool"}}),
            ),
            "tool_choice",
        ),
        (
            with_fields(
                &ok,
                json!({"tools": [tool], "tool_choice": {"type": "tool", "name": "g"}}),
            ),
            "tool_choice",
        ),
        // Auto tool choice (the default with tools) needs the server's parser flags.
        (with_fields(&ok, json!({"tools": [tool]})), "tool_choice"),
        (
            with_fields(&ok, json!({"mcp_servers": [{"url": "http://x"}]})),
            "mcp_servers",
        ),
        (
            with_fields(
                &ok,
                json!({"output_config": {"format": {"type": "json_schema"}}}),
            ),
            "output_config.format",
        ),
        (
            with_fields(
                &ok,
                json!({"output_config": {"format": {"type": "json_schema",
                "schema": {"type": "object"}}}, "tools": [tool], "tool_choice": {"type": "any"}}),
            ),
            "tool_choice",
        ),
    ];
    for (body, param) in cases {
        let r = post(srv.addr, "/v1/messages", &body).await;
        assert_eq!(r.status, 400, "{body}: {}", r.body);
        let e = r.json();
        assert_eq!(e["type"], "error", "{e}");
        assert_eq!(e["error"]["type"], "invalid_request_error", "{body}: {e}");
        let message = e["error"]["message"].as_str().unwrap();
        assert!(
            message.starts_with(&format!("{param}: ")),
            "{body}: {message}"
        );
    }
    let r = post(
        srv.addr,
        "/v1/messages",
        &with_fields(&ok, json!({"model": "claude-x"})),
    )
    .await;
    assert_eq!(r.status, 404, "{}", r.body);
    assert_eq!(r.json()["error"]["type"], "not_found_error");
    // None of them reached the engine.
    let m = get(srv.addr, "/metrics").await.body;
    assert!(
        m.contains("vllm:prompt_tokens_total{model_name=\"stories\"} 0"),
        "{m}"
    );
    // Errors from the other layers have Anthropic's shape too.
    let r = send(srv.addr, "GET", "/v1/messages", &[], "").await;
    assert_eq!(r.status, 405, "{}", r.body);
    assert_eq!(r.json()["type"], "error", "{}", r.body);
    // count_tokens takes no max_tokens.
    let r = post(
        srv.addr,
        "/v1/messages/count_tokens",
        &with_fields(&ok, json!({"max_tokens": 0})),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    // Anthropic's extra fields are accepted.
    let r = post(
        srv.addr,
        "/v1/messages",
        &with_fields(
            &ok,
            json!({"metadata": {"user_id": "u"}, "thinking": {"type": "disabled"},
                                 "service_tier": "auto", "top_k": 5}),
        ),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_client_disconnect_mid_stream_cancels_and_engine_errors_end_with_an_error_event() {
    let srv = start_chat(Opts {
        step_delay: Some(Duration::from_millis(3)),
        ..Opts::default()
    })
    .await;
    let body = json!({"max_tokens": 400, "temperature": 0, "stream": true,
                      "messages": [{"role": "user", "content": "Once upon a time"}]});
    drop_mid_stream(&srv, "/v1/messages", &body, 5, "event: content_block_delta").await;
    let m = get(srv.addr, "/metrics").await.body;
    assert_eq!(success_count(&m, "abort"), 1, "{m}");

    let (addr, task) = failing_engine_server().await;
    let r = post(
        addr,
        "/v1/messages",
        &json!({"max_tokens": 9, "stream": true,
                "messages": [{"role": "user", "content": "a"}]}),
    )
    .await;
    let ev = response_events(&r);
    let (kind, last) = ev.last().unwrap();
    assert_eq!(kind, "error", "{}", r.body);
    assert_eq!(last["type"], "error");
    assert!(
        last["error"]["message"]
            .as_str()
            .unwrap()
            .contains("the scheduler is gone"),
        "{last}"
    );
    assert!(!r.body.contains("message_stop"), "{}", r.body);
    // Not streamed: an error status with Anthropic's body.
    let r = post(
        addr,
        "/v1/messages",
        &json!({"max_tokens": 9, "messages": [{"role": "user", "content": "a"}]}),
    )
    .await;
    assert!(r.status >= 500, "{}", r.body);
    assert_eq!(r.json()["type"], "error", "{}", r.body);
    task.abort();
}

/// `qwen3_coder` calls come back with their raw values typed by the request's tool schema,
/// on chat (streamed and not), on `/v1/responses` and on `/v1/messages`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qwen3_coder_calls_are_typed_by_the_tools_on_every_endpoint() {
    use baton_frontend::tools::ToolParser;
    let text = "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>";
    let (addr, task, _, _) = tool_server(text, Some(ToolParser::Qwen3Coder)).await;
    let params = json!({"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}}});
    let want = "{\"city\": \"San Francisco\", \"days\": 3}";
    let body = json!({"messages": [{"role": "user", "content": "Weather?"}],
                      "tools": [{"type": "function",
                                 "function": {"name": "get_weather", "parameters": params}}]});
    for (msg, finish) in chat_both_ways(addr, &body).await {
        assert_eq!(finish, "tool_calls");
        assert_eq!(msg["content"], " Checking.\n");
        assert_eq!(msg["tool_calls"][0]["function"]["arguments"], want, "{msg}");
    }
    let body = json!({"input": "Weather?", "tools": [{"type": "function",
                      "name": "get_weather", "parameters": params}]});
    let (items, _) = responses_both_ways(addr, &body).await;
    assert_eq!(items[1]["arguments"], want, "{items:?}");
    let body = json!({"max_tokens": 60, "messages": [{"role": "user", "content": "Weather?"}],
                      "tools": [{"name": "get_weather", "input_schema": params}]});
    let m = messages_both_ways(addr, &body).await;
    assert_eq!(
        m["content"][1]["input"],
        json!({"city": "San Francisco", "days": 3})
    );
    task.abort();
}

/// A final assistant turn is continued: on `/v1/messages` always (Anthropic's prefill), on
/// `/v1/responses` when the last item's status is `incomplete` or `in_progress` (vLLM's
/// partial completion); both render as chat's `continue_final_message`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_final_assistant_turn_is_continued_on_messages_and_partial_responses() {
    let (addr, task, prompts, _) = tool_server("It is sunny.", None).await;
    let user = json!({"role": "user", "content": "Weather?"});
    let chat = json!({"max_tokens": 5, "continue_final_message": true,
                      "add_generation_prompt": false,
                      "messages": [user, {"role": "assistant", "content": "The weather:"}]});
    assert_eq!(post(addr, "/v1/chat/completions", &chat).await.status, 200);
    let m = post(
        addr,
        "/v1/messages",
        &json!({"max_tokens": 5, "messages": [user, {"role": "assistant", "content": [
            {"type": "text", "text": "The weather:"}]}]}),
    )
    .await;
    assert_eq!(m.status, 200, "{}", m.body);
    // The answer is the continuation only, as Anthropic's.
    assert_eq!(m.json()["content"][0]["text"], " It is sunny.");
    let partial = json!({"type": "message", "role": "assistant", "status": "incomplete",
                         "content": [{"type": "output_text", "text": "The weather:"}]});
    let v = response(addr, &json!({"input": [user, partial]})).await;
    assert_eq!(v["output"][0]["content"][0]["text"], " It is sunny.");
    // A completed assistant item starts a new turn.
    let mut done = partial.clone();
    done["status"] = json!("completed");
    response(addr, &json!({"input": [user, done]})).await;
    // So does an incomplete one with no text (continuing it would continue the template's
    // end of turn), and an incomplete reasoning item.
    let mut empty = partial.clone();
    empty["content"] = json!([{"type": "output_text", "text": " "}]);
    response(addr, &json!({"input": [user, empty]})).await;
    let reasoning = json!({"type": "reasoning", "status": "in_progress",
                           "content": [{"type": "reasoning_text", "text": "Hmm."}]});
    response(addr, &json!({"input": [user, reasoning]})).await;
    let seen = prompts.lock().unwrap().clone();
    let tok = common::stories_tokenizer();
    let text = |i: usize| tok.decode(&seen[i], true).unwrap();
    assert!(text(0).ends_with("assistant: The weather:"), "{}", text(0));
    assert_eq!(text(1), text(0));
    assert_eq!(text(2), text(0));
    assert!(
        text(3).ends_with("assistant: The weather:assistant:"),
        "{}",
        text(3)
    );
    assert!(text(4).ends_with("assistant:  assistant:"), "{}", text(4));
    assert!(text(5).ends_with("assistant: assistant:"), "{}", text(5));
    task.abort();
}

/// SageMaker's routes, as vLLM serves them: `/ping` is `/health`; `/invocations` answers a
/// chat request (with `messages`) as chat and a completion request (with `prompt`) as
/// completions, and is guarded by the API key like the `/v1` routes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sagemaker_ping_and_invocations_route_by_the_body() {
    let srv = start_chat(Opts {
        api_key: Some("k".into()),
        ..Opts::default()
    })
    .await;
    assert_eq!(get(srv.addr, "/ping").await.status, 200);
    assert_eq!(post(srv.addr, "/ping", &json!({})).await.status, 200);
    let call = |body: Value| {
        let addr = srv.addr;
        async move {
            send(
                addr,
                "POST",
                "/invocations",
                &[("Authorization", "Bearer k")],
                &body.to_string(),
            )
            .await
        }
    };
    let chat = call(json!({"messages": [{"role": "user", "content": "Hi"}],
                           "max_tokens": 3, "temperature": 0}))
    .await;
    assert_eq!(chat.status, 200, "{}", chat.body);
    assert_eq!(chat.json()["object"], "chat.completion");
    let done = call(json!({"prompt": "Once upon", "max_tokens": 3})).await;
    assert_eq!(done.status, 200, "{}", done.body);
    assert_eq!(done.json()["object"], "text_completion");
    let bad = call(json!({"input": "x"})).await;
    assert_eq!(bad.status, 400, "{}", bad.body);
    let bad = call(json!("x")).await;
    assert_eq!(bad.status, 400, "{}", bad.body);
    let r = send(
        srv.addr,
        "POST",
        "/invocations",
        &[],
        &json!({"prompt": "a"}).to_string(),
    )
    .await;
    assert_eq!(r.status, 401, "{}", r.body);
}

/// `truncation: "auto"` drops the oldest input items (keeping the instructions) until the
/// input fits with `max_output_tokens`; an input that fits is untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_truncation_auto_drops_the_oldest_items_until_the_input_fits() {
    let srv = start_chat(Opts {
        max_model_len: Some(128),
        ..Opts::default()
    })
    .await;
    let long = "Once upon a time there was a little dog. ".repeat(3);
    let mut items: Vec<Value> = (0..6)
        .flat_map(|_| {
            [
                json!({"role": "user", "content": long}),
                json!({"role": "assistant", "content": "Yes."}),
            ]
        })
        .collect();
    items.push(json!({"role": "user", "content": "The end?"}));
    let body = json!({"instructions": "Tell a story.", "input": items, "max_output_tokens": 8,
                      "temperature": 0});
    let r = post(srv.addr, "/v1/responses", &body).await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.json()["error"]["param"], "input");
    let v = response(srv.addr, &with_fields(&body, json!({"truncation": "auto"}))).await;
    assert_eq!(v["truncation"], "auto");
    let input = v["usage"]["input_tokens"].as_u64().unwrap();
    assert!(input + 8 <= 128, "{v}");
    // Only whole items went: the kept tail is the same prompt as a request of just that tail.
    let mut kept = None;
    for k in 1..items.len() {
        let tail = json!({"instructions": "Tell a story.", "input": items[items.len() - k..],
                          "max_output_tokens": 8, "temperature": 0});
        let r = post(srv.addr, "/v1/responses", &tail).await;
        if r.status == 200 && r.json()["usage"]["input_tokens"] == input {
            kept = Some(k);
        }
    }
    assert!(kept.is_some(), "no tail of the input gives {input} tokens");
    // An input that fits is untouched.
    let short = json!({"input": "Hi", "max_output_tokens": 8});
    let plain = response(srv.addr, &short).await;
    let auto = response(
        srv.addr,
        &with_fields(&short, json!({"truncation": "auto"})),
    )
    .await;
    assert_eq!(
        plain["usage"]["input_tokens"],
        auto["usage"]["input_tokens"]
    );
    assert_eq!(plain["truncation"], "disabled");
}

/// With a response store (`--responses-store-mib`): a finished response, streamed or not, is
/// kept; `previous_response_id` continues its conversation (its input and output before the
/// new input, without its instructions), `GET` returns it, `input_items` lists its
/// conversation, `DELETE` removes it; `store: false` keeps nothing. Without a store,
/// `previous_response_id` and `GET` are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_store_keeps_responses_for_previous_response_id_get_and_delete() {
    let srv = start_chat(Opts {
        responses_store_bytes: 1 << 20,
        ..Opts::default()
    })
    .await;
    let first = json!({"instructions": "Tell a story.", "input": "Once upon a time",
                       "max_output_tokens": 6, "temperature": 0});
    let v = response(srv.addr, &first).await;
    assert_eq!(v["store"], true, "{v}");
    let id = v["id"].as_str().unwrap().to_owned();
    let got = get(srv.addr, &format!("/v1/responses/{id}")).await;
    assert_eq!(got.status, 200, "{}", got.body);
    assert_eq!(got.json(), v);
    // The next turn by id is the same prompt as the whole conversation sent again.
    let text = v["output"][0]["content"][0]["text"].as_str().unwrap();
    let next = json!({"previous_response_id": id, "input": "And then?", "max_output_tokens": 6,
                      "temperature": 0, "stream": true});
    let r = post(srv.addr, "/v1/responses", &next).await;
    let (_, chained) = check_response_stream(&response_events(&r));
    assert_eq!(chained["previous_response_id"], json!(id));
    let whole = json!({"input": [
        {"role": "user", "content": "Once upon a time"},
        {"role": "assistant", "content": text},
        {"role": "user", "content": "And then?"}], "max_output_tokens": 6, "temperature": 0});
    let again = response(srv.addr, &whole).await;
    assert_eq!(
        chained["usage"]["input_tokens"], again["usage"]["input_tokens"],
        "{chained}"
    );
    assert_eq!(
        chained["output"][0]["content"],
        again["output"][0]["content"]
    );
    // The streamed one was stored too; its conversation is listed newest first.
    let chained_id = chained["id"].as_str().unwrap();
    let items = get(srv.addr, &format!("/v1/responses/{chained_id}/input_items")).await;
    assert_eq!(items.status, 200, "{}", items.body);
    let items = items.json();
    let data = items["data"].as_array().unwrap();
    assert_eq!(data.len(), 3, "{items}");
    // In OpenAI's form: typed content parts, a status, unique ids.
    assert_eq!(
        data[0]["content"],
        json!([{"type": "input_text", "text": "And then?"}])
    );
    assert_eq!(data[1]["content"][0]["type"], "output_text", "{items}");
    assert_eq!(data[2]["content"][0]["text"], "Once upon a time");
    assert_eq!(data[2]["status"], "completed");
    let ids: std::collections::HashSet<&str> =
        data.iter().map(|d| d["id"].as_str().unwrap()).collect();
    assert_eq!(ids.len(), 3, "{items}");
    let asc = get(
        srv.addr,
        &format!("/v1/responses/{chained_id}/input_items?order=asc&limit=1"),
    )
    .await
    .json();
    assert_eq!(asc["data"][0]["content"][0]["text"], "Once upon a time");
    // An error in the new input is indexed in the request's own input, not the spliced one.
    let bad = json!({"previous_response_id": chained_id, "input": [{"type": "bogus"}]});
    let r = post(srv.addr, "/v1/responses", &bad).await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.json()["error"]["param"], "input[0].type");
    // Client ids that repeat become unique (a paginating client would loop on them).
    let dup = json!({"input": [{"id": "a", "role": "user", "content": "x"},
                               {"id": "a", "role": "user", "content": "y"}],
                     "max_output_tokens": 2});
    let v = response(srv.addr, &dup).await;
    let items = get(
        srv.addr,
        &format!("/v1/responses/{}/input_items", v["id"].as_str().unwrap()),
    )
    .await
    .json();
    assert_ne!(items["data"][0]["id"], items["data"][1]["id"], "{items}");
    assert_eq!(asc["has_more"], true);
    // Deleted: gone, and no longer a previous response.
    let d = send(srv.addr, "DELETE", &format!("/v1/responses/{id}"), &[], "").await;
    assert_eq!(d.status, 200, "{}", d.body);
    assert_eq!(
        d.json(),
        json!({"id": id, "object": "response", "deleted": true})
    );
    assert_eq!(
        get(srv.addr, &format!("/v1/responses/{id}")).await.status,
        404
    );
    let r = post(
        srv.addr,
        "/v1/responses",
        &with_fields(&next, json!({"stream": false})),
    )
    .await;
    assert_eq!(r.status, 404, "{}", r.body);
    assert_eq!(r.json()["error"]["param"], "previous_response_id");
    // store: false keeps nothing.
    let v = response(srv.addr, &with_fields(&first, json!({"store": false}))).await;
    assert_eq!(v["store"], false);
    let id = v["id"].as_str().unwrap();
    assert_eq!(
        get(srv.addr, &format!("/v1/responses/{id}")).await.status,
        404
    );
    // Without a store.
    let plain = start_chat(Opts::default()).await;
    let r = post(
        plain.addr,
        "/v1/responses",
        &with_fields(&next, json!({"stream": false})),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("--responses-store-mib"));
    let v = response(plain.addr, &first).await;
    assert_eq!(v["store"], false);
}

/// vLLM's `--enable-force-include-usage`: a streamed completion or chat response ends with a
/// usage chunk though the request did not ask for one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn force_include_usage_adds_the_usage_chunk_to_every_stream() {
    let usage_chunks = |r: &common::Resp| {
        r.events()
            .iter()
            .filter(|e| e.as_str() != "[DONE]")
            .filter(|e| {
                let v: Value = serde_json::from_str(e).unwrap();
                v["usage"].is_object()
            })
            .count()
    };
    let body = json!({"prompt": "Once upon", "max_tokens": 3, "stream": true});
    let plain = start(Opts::default()).await;
    assert_eq!(
        usage_chunks(&post(plain.addr, "/v1/completions", &body).await),
        0
    );
    let forced = start_chat(Opts {
        force_include_usage: true,
        ..Opts::default()
    })
    .await;
    assert_eq!(
        usage_chunks(&post(forced.addr, "/v1/completions", &body).await),
        1
    );
    let chat = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
                      "stream": true});
    assert_eq!(
        usage_chunks(&post(forced.addr, "/v1/chat/completions", &chat).await),
        1
    );
}
