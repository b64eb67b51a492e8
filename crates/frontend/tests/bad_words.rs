//! vLLM's `bad_words` over HTTP with the real engine on stories260K: a word of the greedy
//! continuation, once banned, never appears in the generated token ids (streamed or not), and
//! the continuation changes; malformed lists are 400s naming the field.

mod common;

use common::*;
use serde_json::{json, Value};

/// The generated token ids and text of a greedy completion of "Once upon a time".
async fn greedy(srv: &TestServer, extra: Value) -> (Vec<u64>, String) {
    let mut body = json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 40,
                          "temperature": 0, "return_token_ids": true});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    let r = post(srv.addr, "/v1/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let c = &v["choices"][0];
    let ids = c["token_ids"]
        .as_array()
        .expect("token_ids")
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect();
    (ids, c["text"].as_str().unwrap().to_owned())
}

/// `text`'s token ids without special tokens.
async fn tokenize(srv: &TestServer, text: &str) -> Vec<u64> {
    let t = post(
        srv.addr,
        "/tokenize",
        &json!({"prompt": text, "add_special_tokens": false}),
    )
    .await
    .json();
    t["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

fn contains(ids: &[u64], word: &[u64]) -> bool {
    ids.windows(word.len()).any(|w| w == word)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_banned_word_is_never_generated() {
    let srv = start(Opts::default()).await;
    let (plain_ids, text) = greedy(&srv, json!({})).await;
    // A word of several tokens from the continuation, so the ban needs its prefix.
    let mut chosen = None;
    for w in text.split_whitespace() {
        let w = w.trim_matches(|c: char| !c.is_alphabetic());
        if w.len() < 3 {
            continue;
        }
        let seq = tokenize(&srv, w).await;
        if contains(&plain_ids, &seq) && (chosen.is_none() || seq.len() > 1) {
            let several = seq.len() > 1;
            chosen = Some((w.to_owned(), seq));
            if several {
                break;
            }
        }
    }
    let (word, seq) = chosen.expect("a word of the continuation tokenizes as generated");
    for stream in [false, true] {
        let extra = json!({"bad_words": [word]});
        let (ids, banned_text) = if stream {
            let mut body = json!({"model": MODEL, "prompt": "Once upon a time",
                                  "max_tokens": 40, "temperature": 0, "stream": true,
                                  "bad_words": [word]});
            body["return_token_ids"] = json!(true);
            let r = post(srv.addr, "/v1/completions", &body).await;
            assert_eq!(r.status, 200, "{}", r.body);
            let mut ids = Vec::new();
            for e in r.events() {
                if e == "[DONE]" {
                    continue;
                }
                let v: Value = serde_json::from_str(&e).unwrap();
                if let Some(t) = v["choices"][0]["token_ids"].as_array() {
                    ids.extend(t.iter().map(|t| t.as_u64().unwrap()));
                }
            }
            (ids, stream_text(&r, false).0)
        } else {
            greedy(&srv, extra).await
        };
        assert!(
            !contains(&ids, &seq),
            "stream {stream}: {word:?} ({seq:?}) generated: {banned_text:?}"
        );
        assert_ne!(ids, plain_ids, "stream {stream}: the ban changed nothing");
        // Up to the first place the word would start, the continuation is the same.
        let first = plain_ids.windows(seq.len()).position(|w| w == seq).unwrap();
        assert_eq!(ids[..first], plain_ids[..first], "stream {stream}");
    }
    // An allow-list that a one-token bad word empties is a 400 naming the field.
    let lily = tokenize(&srv, "Lily").await;
    assert_eq!(lily.len(), 1, "{lily:?}");
    let r = post(
        srv.addr,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": "x", "max_tokens": 2, "bad_words": ["Lily"],
                "allowed_token_ids": [lily[0]]}),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.json()["error"]["param"], "bad_words", "{}", r.body);
    // A constraint the bad words block entirely: the guide fails (the request aborts), and
    // the ruled-out token's log-probability is a number (vLLM's -9999 floor), not null.
    let r = post(
        srv.addr,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4,
                "logprobs": 1, "guided_regex": " x\n", "bad_words": ["x\n"]}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let lp = &v["choices"][0]["logprobs"];
    for x in lp["token_logprobs"].as_array().unwrap() {
        assert!(x.as_f64().is_some_and(|x| x >= -9999.0), "{v}");
    }
    for m in lp["top_logprobs"].as_array().unwrap() {
        for x in m.as_object().unwrap().values() {
            assert!(x.is_number(), "{v}");
        }
    }
    // Malformed lists are 400s naming the field.
    for bad in [json!([""]), json!(["  "]), json!("word"), json!([7])] {
        let r = post(
            srv.addr,
            "/v1/completions",
            &json!({"model": MODEL, "prompt": "x", "max_tokens": 1, "bad_words": bad}),
        )
        .await;
        assert_eq!(r.status, 400, "{bad}: {}", r.body);
        assert_eq!(r.json()["error"]["param"], "bad_words", "{bad}: {}", r.body);
    }
}
