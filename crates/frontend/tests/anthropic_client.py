#!/usr/bin/env python3
"""Checks a running Baton server's `/v1/messages` with the official `anthropic` Python client.

Usage:
    python3 anthropic_client.py [BASE_URL]

BASE_URL defaults to $BATON_URL, else http://127.0.0.1:8000 (without `/v1`: the client adds
it). The server must serve stories260K with a chat template (scripts/openai-check.sh starts one).
$BATON_API_KEY is sent as the API key (`x-api-key`) when set. The model name is taken from
/v1/models.

Prints one line per check and a closing 'N passed, N failed' line; exits non-zero on a failure.
"""

import json
import os
import sys
import traceback
import urllib.request

import anthropic


def base_url():
    url = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("BATON_URL", "http://127.0.0.1:8000")
    return url.rstrip("/").removesuffix("/v1")


def served_model():
    with urllib.request.urlopen(base_url() + "/v1/models") as resp:
        return json.loads(resp.read())["data"][0]["id"]


client = anthropic.Anthropic(base_url=base_url(), api_key=os.environ.get("BATON_API_KEY", "none"), max_retries=0)
MODEL = served_model()
GREEDY = {"temperature": 0}
CHECKS = []


def check(fn):
    CHECKS.append(fn)
    return fn


@check
def messages_streamed_and_not():
    # (This client has no sampling parameters, as Anthropic's current API; vLLM's and Baton's
    # `temperature` goes in the body.)
    kw = dict(model=MODEL, max_tokens=16, extra_body=GREEDY, system="Tell a story.",
              messages=[{"role": "user", "content": "Once upon a time"}])
    m = client.messages.create(**kw)
    assert m.type == "message" and m.role == "assistant" and m.stop_reason == "max_tokens", m
    assert len(m.content) == 1 and m.content[0].type == "text" and m.content[0].text, m
    assert m.usage.output_tokens == 16, m
    with client.messages.stream(**kw) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == m.content[0].text == final.content[0].text, (text, m, final)
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 16, final
    prompt = m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)
    counted = client.messages.count_tokens(model=MODEL, system="Tell a story.",
                                           messages=[{"role": "user", "content": "Once upon a time"}])
    assert counted.input_tokens == prompt, (counted, m.usage)
    # A stop sequence the output reaches.
    word = m.content[0].text.split()[2]
    s = client.messages.create(stop_sequences=[word], **kw)
    assert s.stop_reason == "stop_sequence" and s.stop_sequence == word, s


@check
def forced_tool_use_and_a_round_trip():
    tools = [{"name": "get_weather", "description": "The weather in a city.", "input_schema": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"], "additionalProperties": False}}]
    user = {"role": "user", "content": "Once upon a time"}
    for choice in [{"type": "tool", "name": "get_weather"}, {"type": "any", "disable_parallel_tool_use": True}]:
        m = client.messages.create(model=MODEL, max_tokens=120, extra_body=GREEDY, tools=tools,
                                   tool_choice=choice, messages=[user])
        uses = [b for b in m.content if b.type == "tool_use"]
        assert m.stop_reason == "tool_use" and len(uses) == 1, m
        assert uses[0].name == "get_weather" and uses[0].input["city"] in ("Paris", "Rome"), m
    with client.messages.stream(model=MODEL, max_tokens=120, extra_body=GREEDY, tools=tools,
                                tool_choice={"type": "tool", "name": "get_weather"}, messages=[user]) as s:
        final = s.get_final_message()
    streamed = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and len(streamed) == 1, final
    assert streamed[0].input == uses[0].input, (final, m)
    # The assistant turn goes back as the client sends it, then the tool result; this server's
    # template (llama2) has no tool role, so the tool message is refused there with a 400.
    try:
        client.messages.create(model=MODEL, max_tokens=4, tools=tools, tool_choice={"type": "none"},
                               messages=[user, {"role": "assistant", "content": m.content},
                                         {"role": "user", "content": [{"type": "tool_result",
                                                                       "tool_use_id": uses[0].id,
                                                                       "content": "22 C"}]}])
    except anthropic.BadRequestError as e:
        assert "Unknown role: tool" in str(e), e
    else:
        raise AssertionError("the tool message reached a template without a tool role")


@check
def bad_requests_raise_bad_request_error():
    for kw, field in [(dict(max_tokens=0), "max_tokens"),
                      (dict(max_tokens=4, tools=[{"type": "web_search_20250305", "name": "web_search"}]),
                       "tools[0].type"),
                      (dict(max_tokens=4, extra_body={"temperature": -1}), "temperature")]:
        try:
            client.messages.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], **kw)
        except anthropic.BadRequestError as e:
            assert e.status_code == 400 and e.body["type"] == "error", e.body
            assert e.body["error"]["message"].startswith(field + ": "), e.body
        else:
            raise AssertionError(f"{kw} was accepted")
    try:
        client.messages.create(model="claude-none", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    except anthropic.NotFoundError as e:
        assert e.body["error"]["type"] == "not_found_error", e.body
    else:
        raise AssertionError("an unknown model was accepted")


def main():
    passed = failed = 0
    for fn in CHECKS:
        try:
            fn()
        except Exception:  # noqa: BLE001 - report every failure, keep going
            failed += 1
            print(f"FAIL {fn.__name__}")
            traceback.print_exc()
        else:
            passed += 1
            print(f"ok   {fn.__name__}")
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
