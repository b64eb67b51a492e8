#!/usr/bin/env python3
"""Checks a running Baton server with the official `openai` Python client.

Usage:
    python3 openai_client.py [BASE_URL]

BASE_URL defaults to $BATON_URL, else http://127.0.0.1:8000 (the `/v1` suffix is optional).
The server must serve stories260K (goldens: $BATON_TEST_MODEL/golden.json, default
shared/models/stories260K inside or next to the repository) and have a chat template (for example
`--chat-template` with the Llama-2-style template below). $BATON_API_KEY is sent as the API key
when set. The model name is taken from /v1/models.

Prints one line per check and a closing 'N passed, N failed' line; exits non-zero on a failure.
"""

import json
import math
import os
import sys
import traceback
import urllib.request
from pathlib import Path

import openai

LLAMA2_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{ '<<SYS>>\\n' + message['content'] + '\\n<</SYS>>\\n\\n' }}"
    "{% elif message['role'] == 'user' %}{{ bos_token + '[INST] ' + message['content'].strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'].strip() + ' ' + eos_token }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ ' ' }}{% endif %}"
)


def base_url():
    url = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("BATON_URL", "http://127.0.0.1:8000")
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def goldens():
    if os.environ.get("BATON_TEST_MODEL"):
        d = Path(os.environ["BATON_TEST_MODEL"])
    else:
        root = Path(__file__).resolve().parents[3]  # the repository
        candidates = [root / "shared" / "models" / "stories260K", root.parent / "shared" / "models" / "stories260K"]
        d = next((c for c in candidates if c.is_dir()), candidates[-1])
    return json.loads((d / "golden.json").read_text())["prompts"]


def tokenize(prompt):
    # /tokenize is not under /v1 and not part of the client's API.
    req = urllib.request.Request(base_url().removesuffix("/v1") + "/tokenize",
                                 data=json.dumps({"prompt": prompt}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as resp:
        return json.loads(resp.read())["tokens"]


client = openai.OpenAI(base_url=base_url(), api_key=os.environ.get("BATON_API_KEY", "none"), max_retries=0)
MODEL = client.models.list().data[0].id
CHECKS = []


def check(fn):
    CHECKS.append(fn)
    return fn


def stream_completion_text(**kw):
    text, finish, usage = "", None, None
    for chunk in client.completions.create(stream=True, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.text or ""
            finish = c.finish_reason or finish
    return text, finish, usage


@check
def models_report_max_model_len():
    m = client.models.list().data[0]
    assert m.id == MODEL
    assert (m.model_extra or {}).get("max_model_len", 0) > 0, m


@check
def greedy_goldens_through_completions():
    for g in goldens():
        r = client.completions.create(model=MODEL, prompt=g["prompt"], max_tokens=64, temperature=0)
        assert r.choices[0].text == g["greedy_text"], (r.choices[0].text, g["greedy_text"])
        assert r.choices[0].finish_reason == "length"
        assert r.usage.prompt_tokens == len(g["prompt_ids"])
        assert r.usage.completion_tokens == 64
        text, finish, _ = stream_completion_text(model=MODEL, prompt=g["prompt"], max_tokens=64, temperature=0)
        assert text == g["greedy_text"], text
        assert finish == "length"


@check
def streaming_include_usage():
    text, finish, usage = stream_completion_text(
        model=MODEL, prompt="The cat", max_tokens=8, temperature=0, stream_options={"include_usage": True}
    )
    assert usage is not None and usage.completion_tokens == 8 and usage.prompt_tokens == 4, usage
    r = client.completions.create(model=MODEL, prompt="The cat", max_tokens=8, temperature=0)
    assert text == r.choices[0].text


@check
def stop_strings():
    g = goldens()[0]
    r = client.completions.create(model=MODEL, prompt=g["prompt"], max_tokens=64, temperature=0, stop=["little girl"])
    want = g["greedy_text"][: g["greedy_text"].index("little girl")]
    assert r.choices[0].text == want, r.choices[0].text
    assert r.choices[0].finish_reason == "stop"
    text, finish, _ = stream_completion_text(
        model=MODEL, prompt=g["prompt"], max_tokens=64, temperature=0, stop="little girl"
    )
    assert text == want and finish == "stop", (text, finish)


@check
def n_choices_and_seed():
    r = client.completions.create(model=MODEL, prompt="Lily wanted to", max_tokens=12, temperature=1.0, seed=5, n=2)
    assert [c.index for c in r.choices] == [0, 1]
    again = client.completions.create(model=MODEL, prompt="Lily wanted to", max_tokens=12, temperature=1.0, seed=5, n=2)
    assert [c.text for c in r.choices] == [c.text for c in again.choices], "seeded sampling is deterministic"
    second = client.completions.create(model=MODEL, prompt="Lily wanted to", max_tokens=12, temperature=1.0, seed=6)
    assert second.choices[0].text == r.choices[1].text, "choice 1 uses seed + 1"
    assert r.usage.completion_tokens == 24


@check
def completion_logprobs():
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 5 and len(lp.token_logprobs) == 5 and len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    assert all(x <= 0 for x in lp.token_logprobs)


@check
def echo():
    g = goldens()[1]
    r = client.completions.create(model=MODEL, prompt=g["prompt"], max_tokens=64, temperature=0, echo=True)
    assert r.choices[0].text == g["full_text"]


@check
def echo_logprobs():
    # lm-evaluation-harness's loglikelihood request: the prompt's tokens are scored too.
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=1, temperature=0,
                                  echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    n = r.usage.prompt_tokens + 1
    assert len(lp.tokens) == n and len(lp.token_logprobs) == n and len(lp.text_offset) == n, lp
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None, lp
    assert all(math.isfinite(x) and x <= 0 for x in lp.token_logprobs[1:]), lp.token_logprobs
    assert r.choices[0].text.startswith("Once upon a time")


@check
def vllm_prompt_logprobs():
    # vLLM's prompt_logprobs through extra_body: per prompt token (first null) the token's own
    # entry, keyed by its id, plus the top alternatives, with ranks and decoded text.
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=1, temperature=0,
                                  extra_body={"prompt_logprobs": 1})
    plp = (r.choices[0].model_extra or {}).get("prompt_logprobs")
    ids = tokenize("Once upon a time")
    assert plp is not None and len(plp) == r.usage.prompt_tokens == len(ids), plp
    assert plp[0] is None, plp
    for tok, pos in zip(ids[1:], plp[1:]):
        own = pos[str(tok)]
        assert own["rank"] >= 1 and math.isfinite(own["logprob"]) and own["logprob"] <= 0, pos
        assert isinstance(own["decoded_token"], str), pos
        assert any(e["rank"] == 1 for e in pos.values()) and len(pos) in (1, 2), pos
    msgs = [{"role": "user", "content": "Once upon a time"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, extra_body={"prompt_logprobs": 0})
    plp = (r.model_extra or {}).get("prompt_logprobs")
    assert plp is not None and len(plp) == r.usage.prompt_tokens and plp[0] is None, plp


@check
def chat_completions():
    msgs = [{"role": "system", "content": "Tell a story."}, {"role": "user", "content": "Once upon a time"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0,
                                       logprobs=True, top_logprobs=2)
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content, c
    assert c.finish_reason in ("length", "stop")
    assert len(c.logprobs.content) == r.usage.completion_tokens
    assert len(c.logprobs.content[0].top_logprobs) == 2
    text, usage = "", None
    for chunk in client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0,
                                                stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            text += ch.delta.content or ""
    assert text == c.message.content, (text, c.message.content)
    assert usage.completion_tokens == r.usage.completion_tokens


@check
def chat_n_and_stop():
    msgs = [{"role": "user", "content": "Once upon a time"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=16, temperature=0.8,
                                       seed=1, n=2, stop=["zzzz"])
    assert [c.index for c in r.choices] == [0, 1]


@check
def responses():
    # The Responses API (client.responses): input as a string or as message items, instructions
    # as the system message, the same greedy tokens as the equivalent chat completion.
    user = "Once upon a time"
    r = client.responses.create(model=MODEL, input=user, max_output_tokens=16, temperature=0,
                                metadata={"run": "check"}, store=False)
    assert r.object == "response" and r.id.startswith("resp_"), r
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens", r
    assert r.output[0].type == "message" and r.output[0].role == "assistant", r.output
    assert r.output_text and r.output[0].content[0].text == r.output_text, r.output
    assert r.usage.output_tokens == 16 and r.usage.total_tokens == r.usage.input_tokens + 16, r.usage
    assert r.usage.output_tokens_details.reasoning_tokens == 0, r.usage
    assert r.metadata == {"run": "check"} and r.max_output_tokens == 16, r
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": user}],
                                          max_tokens=16, temperature=0)
    assert r.output_text == chat.choices[0].message.content, (r.output_text, chat.choices[0].message.content)
    assert r.usage.input_tokens == chat.usage.prompt_tokens, (r.usage, chat.usage)
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": user}]}]
    r2 = client.responses.create(model=MODEL, instructions="Tell a story.", input=items,
                                 max_output_tokens=16, temperature=0)
    chat2 = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Tell a story."}, {"role": "user", "content": user}],
        max_tokens=16, temperature=0)
    assert r2.output_text == chat2.choices[0].message.content, (r2.output_text, chat2.choices[0].message.content)
    assert r2.usage.input_tokens == chat2.usage.prompt_tokens and r2.instructions == "Tell a story.", r2
    # Streamed: typed events with increasing sequence numbers, deltas adding up to the text.
    kinds, numbers, deltas, final = [], [], "", None
    for ev in client.responses.create(model=MODEL, input=user, max_output_tokens=16, temperature=0, stream=True):
        kinds.append(ev.type)
        numbers.append(ev.sequence_number)
        if ev.type == "response.output_text.delta":
            deltas += ev.delta
        if ev.type in ("response.completed", "response.incomplete"):
            final = ev.response
    assert numbers == list(range(len(numbers))), numbers
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"], kinds
    assert kinds[-1] == "response.incomplete", kinds
    assert deltas == r.output_text and final.output_text == r.output_text, (deltas, r.output_text)
    # The SDK's stream helper, on a response a stop string completes.
    stop = r.output_text.split()[3]
    with client.responses.stream(model=MODEL, input=user, max_output_tokens=16, temperature=0,
                                 extra_body={"stop": [stop]}) as stream:
        text = "".join(ev.delta for ev in stream if ev.type == "response.output_text.delta")
        done = stream.get_final_response()
    assert done.status == "completed" and done.output_text == text, (done.status, text)
    assert r.output_text.startswith(text) and stop not in text, (text, stop)
    # Log-probabilities (include), as the SDK parses them: chat's, one per output token.
    def field(o, k):
        return o[k] if isinstance(o, dict) else getattr(o, k)

    lp_kw = dict(model=MODEL, input=user, max_output_tokens=8, temperature=0,
                 include=["message.output_text.logprobs"], extra_body={"top_logprobs": 2})
    lp = client.responses.create(**lp_kw)
    entries = field(lp.output[0].content[0], "logprobs")
    assert len(entries) == 8, entries
    assert "".join(field(e, "token") for e in entries) == lp.output_text, (entries, lp.output_text)
    for e in entries:
        top = field(e, "top_logprobs")
        assert len(top) == 2 and field(top[0], "logprob") >= field(top[1], "logprob"), e
        assert abs(field(e, "logprob") - field(top[0], "logprob")) < 1e-5, e
        assert list(field(e, "bytes")) == list(field(e, "token").encode()), e
    chat_lp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": user}],
                                             max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    assert [field(e, "logprob") for e in entries] == [c.logprob for c in chat_lp.choices[0].logprobs.content]
    streamed = []
    for ev in client.responses.create(stream=True, **lp_kw):
        if ev.type == "response.output_text.delta":
            streamed += [field(e, "logprob") for e in field(ev, "logprobs")]
    assert streamed == [field(e, "logprob") for e in entries], streamed
    for kw in [dict(conversation="conv_x"), dict(tool_choice="required"), dict(background=True),
               dict(include=["reasoning.encrypted_content"])]:
        try:
            client.responses.create(model=MODEL, input=user, max_output_tokens=4, **kw)
        except openai.BadRequestError as e:
            body = e.body if isinstance(e.body, dict) else {}
            assert body.get("param") == next(iter(kw)), e.body
        else:
            raise AssertionError(f"{kw} was accepted")


@check
def vllm_extra_body_allowed_token_ids():
    # vLLM's extension through the client's extra_body: only the listed token is sampled.
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4,
                                  temperature=1.0, seed=7, logprobs=1,
                                  extra_body={"allowed_token_ids": [403]})
    toks = r.choices[0].logprobs.tokens
    assert len(toks) == 4 and len(set(toks)) == 1, toks


@check
def vllm_extra_body_return_token_ids():
    # vLLM's return_token_ids: the prompt's ids and the generated ids come back as extra fields
    # the client keeps (model_extra), streamed and not; a stop token is in the ids, not the text.
    g = goldens()[0]
    want = g["greedy_ids"][:11]  # up to and including the first ".", the stop token here
    kw = dict(model=MODEL, prompt=g["prompt"], max_tokens=12, temperature=0,
              extra_body={"return_token_ids": True, "stop_token_ids": [want[-1]]})
    c = client.completions.create(**kw).choices[0]
    assert c.model_extra["prompt_token_ids"] == g["prompt_ids"], c
    assert c.model_extra["token_ids"] == want and not c.text.endswith("."), c
    prompt, ids = [], []
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            prompt.append(c.model_extra.get("prompt_token_ids"))
            ids += c.model_extra.get("token_ids") or []
    assert prompt[0] == g["prompt_ids"] and not any(prompt[1:]) and ids == want, (prompt, ids)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=6, temperature=0,
                                       extra_body={"return_token_ids": True})
    assert r.model_extra["prompt_token_ids"], r
    assert len(r.choices[0].model_extra["token_ids"]) == r.usage.completion_tokens, r


@check
def vllm_extra_body_bad_words():
    # vLLM's bad_words: a word of the greedy continuation ("little", "Lily", ...) is never
    # generated once banned, and the continuation changes.
    g = goldens()[0]
    kw = dict(model=MODEL, prompt=g["prompt"], max_tokens=30, temperature=0)
    plain = client.completions.create(**kw).choices[0].text
    for word in [w for w in plain.replace(".", " ").replace(",", " ").split() if len(w) > 3][:3]:
        seq = tokenize(word)[1:]  # without the BOS /tokenize adds
        c = client.completions.create(extra_body={"return_token_ids": True, "bad_words": [word]},
                                      **kw).choices[0]
        ids = c.model_extra["token_ids"]
        assert not any(ids[i:i + len(seq)] == seq for i in range(len(ids))), (word, seq, ids)
        assert c.text != plain, (word, c.text)


@check
def structured_outputs():
    # OpenAI's typed parse (a strict json_schema response_format from a pydantic model), the
    # Responses API's text.format, and vLLM's extras through extra_body.
    from typing import Literal

    from pydantic import BaseModel

    class Answer(BaseModel):
        done: bool
        colour: Literal["red", "blue", "green"]

    msgs = [{"role": "user", "content": "Once upon a time"}]
    r = client.chat.completions.parse(model=MODEL, messages=msgs, response_format=Answer,
                                      max_tokens=60, temperature=0)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Answer), r
    r = client.responses.parse(model=MODEL, input="Once upon a time", text_format=Answer,
                               max_output_tokens=60, temperature=0)
    assert isinstance(r.output_parsed, Answer), r
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0.8,
                                  seed=3, extra_body={"guided_choice": ["a cat", "a dog"]})
    assert r.choices[0].text in ("a cat", "a dog"), r
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0,
                                  extra_body={"structured_outputs": {"regex": "[0-9]{4}"}})
    assert len(r.choices[0].text) == 4 and r.choices[0].text.isdigit(), r
    try:
        client.completions.create(model=MODEL, prompt="a", max_tokens=4, extra_body={"guided_regex": "("})
    except openai.BadRequestError as e:
        body = e.body if isinstance(e.body, dict) else {}
        assert body.get("param") == "guided_regex", e.body
    else:
        raise AssertionError("a bad regex was accepted")


@check
def bad_requests_raise_bad_request_error():
    for kw in [dict(top_p=0.0), dict(n=0), dict(max_tokens=-1), dict(temperature=-1.0), dict(logprobs=21),
               dict(max_tokens=100000)]:
        args = dict(model=MODEL, prompt="a", max_tokens=4)
        args.update(kw)
        try:
            client.completions.create(**args)
        except openai.BadRequestError as e:
            assert e.status_code == 400
            body = e.body if isinstance(e.body, dict) else {}
            assert body.get("message"), e.body
        else:
            raise AssertionError(f"{kw} was accepted")
    try:
        client.completions.create(model="no-such-model", prompt="a", max_tokens=1)
    except openai.NotFoundError:
        pass
    else:
        raise AssertionError("an unknown model was accepted")


@check
def chat_template_kwargs_through_extra_body():
    # vLLM's chat_template_kwargs: its keys become template variables (a variable the template
    # does not use changes nothing; one it uses, bos_token here, changes the prompt), and a
    # value that is not an object is a 400 naming it.
    msgs = [{"role": "user", "content": "Once upon a time"}]
    def chat(**extra):
        return client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0,
                                              extra_body=extra)
    base = chat()
    off = chat(chat_template_kwargs={"enable_thinking": False})
    assert off.choices[0].message.content == base.choices[0].message.content, (off, base)
    assert off.usage.prompt_tokens == base.usage.prompt_tokens, (off.usage, base.usage)
    no_bos = chat(chat_template_kwargs={"bos_token": ""})
    assert no_bos.usage.prompt_tokens < base.usage.prompt_tokens, (no_bos.usage, base.usage)
    try:
        chat(chat_template_kwargs="enable_thinking=False")
    except openai.BadRequestError as e:
        body = e.body if isinstance(e.body, dict) else {}
        assert body.get("param") == "chat_template_kwargs", e.body
    else:
        raise AssertionError("a non-object chat_template_kwargs was accepted")


@check
def tool_choices():
    # This server runs without --enable-auto-tool-choice: "auto" (the default with tools) is
    # refused as vLLM refuses it; "none" renders the tools and returns plain content;
    # "required" and a named function are structured outputs and need no parser.
    tools = [{"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "enum": ["Paris", "Rome"]}}, "required": ["city"],
            "additionalProperties": False}}}]
    msgs = [{"role": "user", "content": "Once upon a time"}]
    for choice in [{"type": "function", "function": {"name": "get_weather"}}, "required"]:
        r = client.chat.completions.create(model=MODEL, messages=msgs, tools=tools, tool_choice=choice,
                                           parallel_tool_calls=False, max_tokens=120, temperature=0)
        c = r.choices[0]
        # OpenAI's and vLLM's rule: "stop" for a named function, "tool_calls" for required.
        want = "tool_calls" if choice == "required" else "stop"
        assert c.finish_reason == want and len(c.message.tool_calls) == 1, r
        call = c.message.tool_calls[0]
        assert call.function.name == "get_weather", r
        assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome"), r
    for kw, want in [(dict(), "--enable-auto-tool-choice"), (dict(tool_choice="auto"), "--tool-call-parser"),
                     (dict(tool_choice={"type": "function", "function": {"name": "nope"}}), "nope")]:
        try:
            client.chat.completions.create(model=MODEL, messages=msgs, tools=tools, max_tokens=2, **kw)
        except openai.BadRequestError as e:
            assert e.status_code == 400
            body = e.body if isinstance(e.body, dict) else {}
            assert body.get("param") == "tool_choice", e.body
            assert want in body.get("message", ""), e.body
        else:
            raise AssertionError(f"{kw} was accepted")
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=tools, tool_choice="none", max_tokens=4,
                                       temperature=0)
    c = r.choices[0]
    assert c.message.tool_calls is None and c.message.content, r
    assert c.finish_reason == "length", r


@check
def responses_function_tools():
    # Function tools on client.responses: flat tools, a named or required tool_choice guides the
    # output into a function_call item; the SDK sends output items back as input.
    tools = [{"type": "function", "name": "get_weather", "strict": True, "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"], "additionalProperties": False}}]
    user = "Once upon a time"
    for choice in [{"type": "function", "name": "get_weather"}, "required"]:
        r = client.responses.create(model=MODEL, input=user, tools=tools, tool_choice=choice,
                                    parallel_tool_calls=False, max_output_tokens=120, temperature=0)
        assert r.status == "completed", r
        calls = [o for o in r.output if o.type == "function_call"]
        assert len(calls) == 1 and calls[0].name == "get_weather", r
        assert json.loads(calls[0].arguments)["city"] in ("Paris", "Rome"), r
        assert calls[0].call_id and calls[0].id.startswith("fc_"), r
        assert r.tools[0].name == "get_weather" and r.tools[0].strict is True, r
    with client.responses.stream(model=MODEL, input=user, tools=tools, tool_choice="required",
                                 parallel_tool_calls=False, max_output_tokens=120, temperature=0) as s:
        args = "".join(ev.delta for ev in s if ev.type == "response.function_call_arguments.delta")
        final = s.get_final_response()
    streamed = [o for o in final.output if o.type == "function_call"]
    assert len(streamed) == 1 and streamed[0].arguments == args == calls[0].arguments, final
    # The output items go back as input (as the SDK serializes them), then a user turn.
    r2 = client.responses.create(model=MODEL, input=[{"role": "user", "content": user}, *r.output,
                                                     {"role": "user", "content": "Go on."}],
                                 tools=tools, tool_choice="none", max_output_tokens=4, temperature=0)
    assert r2.status == "incomplete" and r2.output[0].type == "message", r2
    # This server's template (llama2) has no tool role: a function_call_output reaches it and
    # is refused there with a 400.
    try:
        client.responses.create(model=MODEL, input=[{"role": "user", "content": user}, *r.output,
                                                    {"type": "function_call_output",
                                                     "call_id": calls[0].call_id, "output": "22 C"}],
                                tools=tools, tool_choice="none", max_output_tokens=4)
    except openai.BadRequestError as e:
        assert "Unknown role: tool" in str(e.body), e.body
    else:
        raise AssertionError("the tool message reached a template without a tool role")
    # Built-in tools are refused, naming the tool.
    try:
        client.responses.create(model=MODEL, input=user, tools=[{"type": "web_search"}], max_output_tokens=4)
    except openai.BadRequestError as e:
        body = e.body if isinstance(e.body, dict) else {}
        assert body.get("param") == "tools[0].type", e.body
    else:
        raise AssertionError("a web_search tool was accepted")


@check
def responses_store():
    # scripts/openai-check.sh starts the server with --responses-store-mib: a stored response
    # can be retrieved, listed, continued by previous_response_id, and deleted.
    first = client.responses.create(model=MODEL, instructions="Tell a story.", input="Once upon a time",
                                    max_output_tokens=8, temperature=0)
    assert first.store is True, first
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text, got
    nxt = client.responses.create(model=MODEL, previous_response_id=first.id, input="And then?",
                                  max_output_tokens=8, temperature=0)
    assert nxt.previous_response_id == first.id, nxt
    whole = client.responses.create(model=MODEL, input=[
        {"role": "user", "content": "Once upon a time"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"}], max_output_tokens=8, temperature=0)
    assert nxt.usage.input_tokens == whole.usage.input_tokens, (nxt.usage, whole.usage)
    assert nxt.output_text == whole.output_text, (nxt, whole)
    items = list(client.responses.input_items.list(nxt.id, order="asc"))
    assert [i.content[0].text for i in items] == ["Once upon a time", first.output_text, "And then?"], items
    assert len({i.id for i in items}) == 3, items
    client.responses.delete(first.id)
    for ask in [lambda: client.responses.retrieve(first.id),
                lambda: client.responses.create(model=MODEL, previous_response_id=first.id, input="x")]:
        try:
            ask()
        except openai.NotFoundError:
            pass
        else:
            raise AssertionError("a deleted response was found")


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
