//! vLLM's `priority` request field over HTTP: refused unless the scheduler runs the priority
//! policy, and then honoured: with one slot, a more urgent request that arrived later is
//! served first.

mod common;

use baton_scheduler::SchedulingPolicy;
use common::*;
use serde_json::json;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_more_urgent_request_is_served_first_under_the_priority_policy() {
    let srv = start(Opts {
        max_num_seqs: Some(1),
        step_delay: Some(Duration::from_millis(3)),
        scheduling_policy: SchedulingPolicy::Priority,
        chat_template: Some(include_str!("../../../scripts/chat-templates/llama2.jinja").into()),
        ..Opts::default()
    })
    .await;
    // Request A holds the only slot (streamed, so its first chunk says it runs).
    let body = json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 100,
                      "ignore_eos": true, "stream": true})
    .to_string();
    let mut a = tokio::net::TcpStream::connect(srv.addr).await.unwrap();
    a.write_all(&request_bytes("POST", "/v1/completions", &[], &body))
        .await
        .unwrap();
    let mut buf = [0u8; 4096];
    let k = tokio::time::timeout(Duration::from_secs(30), a.read(&mut buf))
        .await
        .expect("first chunk")
        .unwrap();
    assert!(String::from_utf8_lossy(&buf[..k]).contains("200"));
    // B (priority 5) then C (priority -1) and D (priority -1, on /v1/responses) queue behind
    // it; each reports when its response is complete.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let addr = srv.addr;
    let mut tasks = Vec::new();
    for (name, path, priority) in [
        ("B", "/v1/completions", 5),
        ("C", "/v1/completions", -1),
        ("D", "/v1/responses", -1),
    ] {
        let tx = tx.clone();
        let body = if path == "/v1/responses" {
            json!({"model": MODEL, "input": "Lily went", "max_output_tokens": 4,
                   "priority": priority})
        } else {
            json!({"model": MODEL, "prompt": "Lily went", "max_tokens": 4,
                   "priority": priority})
        };
        tasks.push(tokio::spawn(async move {
            let r = post(addr, path, &body).await;
            assert_eq!(r.status, 200, "{name}: {}", r.body);
            tx.send(name).unwrap();
        }));
        // Arrival order B, C, D.
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop(tx);
    for t in tasks {
        t.await.unwrap();
    }
    let mut order = Vec::new();
    while let Some(n) = rx.recv().await {
        order.push(n);
    }
    assert_eq!(order, vec!["C", "D", "B"]);
    // An out-of-range priority is a 400 naming the field.
    let r = post(
        srv.addr,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": "x", "max_tokens": 1, "priority": 1u64 << 40}),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.json()["error"]["param"], "priority", "{}", r.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nonzero_priority_is_a_400_under_first_come_first_served() {
    let srv = start(Opts::default()).await;
    for path in ["/v1/completions", "/v1/responses"] {
        let body = if path == "/v1/responses" {
            json!({"model": MODEL, "input": "x", "max_output_tokens": 1, "priority": -2})
        } else {
            json!({"model": MODEL, "prompt": "x", "max_tokens": 1, "priority": -2})
        };
        let r = post(srv.addr, path, &body).await;
        assert_eq!(r.status, 400, "{path}: {}", r.body);
        let e = &r.json()["error"];
        assert_eq!(e["param"], "priority", "{}", r.body);
        assert!(
            e["message"]
                .as_str()
                .is_some_and(|m| m.contains("--scheduling-policy priority")),
            "{}",
            r.body
        );
    }
}
