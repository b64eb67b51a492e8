#!/usr/bin/env python3
"""Checks a running `baton serve` against the test model's greedy goldens.

Usage: serve-goldens.py PORT MODEL_DIR [COPIES]

Sends every golden prompt of MODEL_DIR/golden.json as token ids to /v1/completions
(temperature 0, max_tokens = the golden's length, return_token_ids), COPIES times each
(default 3), all at once from threads, so the server batches them and the scheduler keeps
launches in flight; then once more one at a time. Every reply's token ids must equal the
golden's greedy ids. Prints one line per request group and exits non-zero on a mismatch.
Standard library only (runs on the GPU machine).
"""
import json
import sys
import threading
import urllib.request


def complete(port, ids, n):
    body = {
        "prompt": ids,
        "max_tokens": n,
        "temperature": 0,
        "return_token_ids": True,
    }
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)["choices"][0]["token_ids"]


def main():
    port, model = sys.argv[1], sys.argv[2]
    copies = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    goldens = json.load(open(f"{model}/golden.json"))["prompts"]
    jobs = [(i, g) for i, g in enumerate(goldens) for _ in range(copies)]
    got = [None] * len(jobs)

    def run(k):
        i, g = jobs[k]
        try:
            got[k] = complete(port, g["prompt_ids"], len(g["greedy_ids"]))
        except Exception as e:  # reported below as a mismatch
            got[k] = f"error: {e}"

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bad = 0
    for (i, g), out in zip(jobs, got):
        if out != g["greedy_ids"]:
            bad += 1
            print(f"golden {i} (concurrent) differs: {out}")
    for i, g in enumerate(goldens):
        out = complete(port, g["prompt_ids"], len(g["greedy_ids"]))
        if out != g["greedy_ids"]:
            bad += 1
            print(f"golden {i} (alone) differs: {out}")
    print(f"{len(jobs) + len(goldens) - bad} of {len(jobs) + len(goldens)} completions match the goldens")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
