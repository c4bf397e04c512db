#!/usr/bin/env python3
"""Drives a running Harrier server with the official `openai` package (a client nobody here
wrote): models, completions and chat completions, streamed and not.

    python3 scripts/test_openai_client.py --base-url http://127.0.0.1:8000/v1 --api-key KEY

Prints one line per check and closes with 'N passed, M failed'; exits 1 on any failure.
"""
import argparse
import json
import sys
import traceback
import urllib.request

import openai
from openai import OpenAI

RESULTS = []


def check(name):
    def wrap(fn):
        def run(*args):
            try:
                fn(*args)
                RESULTS.append((name, None))
                print(f"ok    {name}")
            except Exception:  # noqa: BLE001 - report every failure and go on
                RESULTS.append((name, traceback.format_exc()))
                print(f"FAIL  {name}\n{traceback.format_exc()}")
        return run
    return wrap


@check("models.list")
def models(client):
    models = client.models.list()
    ids = [m.id for m in models.data]
    assert ids, ids
    assert models.data[0].object == "model"


@check("completions.create (non-stream, n=2, seed)")
def completion(client, model):
    r = client.completions.create(model=model, prompt="Once upon a time", max_tokens=8, n=2, seed=3,
                                  temperature=0.7, extra_body={"ignore_eos": True})
    assert r.object == "text_completion", r
    assert len(r.choices) == 2
    assert all(c.finish_reason == "length" for c in r.choices), r.choices
    assert r.usage.completion_tokens == 16, r.usage
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


@check("completions.create (stream, include_usage) equals non-stream")
def completion_stream(client, model):
    kw = dict(model=model, prompt="The quick brown fox", max_tokens=10, temperature=0.8, seed=42)
    full = client.completions.create(**kw)
    text, finish, usage = "", None, None
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
            assert chunk.choices == []
            continue
        for c in chunk.choices:
            text += c.text
            if c.finish_reason is not None:
                assert finish is None
                finish = c.finish_reason
    assert text == full.choices[0].text, (text, full.choices[0].text)
    assert finish == full.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens


@check("chat.completions.create (non-stream)")
def chat(client, model):
    r = client.chat.completions.create(model=model, max_tokens=6, temperature=0,
                                       messages=[{"role": "system", "content": "Be brief."},
                                                 {"role": "user", "content": "Hello!"}])
    assert r.object == "chat.completion"
    m = r.choices[0].message
    assert m.role == "assistant" and isinstance(m.content, str)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 10


@check("chat.completions.create (stream, stop, logprobs) equals non-stream")
def chat_stream(client, model):
    kw = dict(model=model, max_tokens=12, temperature=0, logprobs=True, top_logprobs=2,
              messages=[{"role": "user", "content": "Count to ten."}])
    full = client.chat.completions.create(**kw)
    assert len(full.choices[0].logprobs.content) == full.usage.completion_tokens
    content, role, finish = "", None, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        assert chunk.object == "chat.completion.chunk"
        for c in chunk.choices:
            role = role or c.delta.role
            content += c.delta.content or ""
            finish = c.finish_reason or finish
    assert role == "assistant"
    assert content == full.choices[0].message.content, (content, full.choices[0].message.content)
    assert finish == full.choices[0].finish_reason
    # A stop string cut from the reply ends the choice early with finish_reason "stop".
    reply = full.choices[0].message.content
    if len(reply) >= 4:
        stop = reply[len(reply) // 2:len(reply) // 2 + 2]
        cut = client.chat.completions.create(stop=[stop], **kw)
        assert cut.choices[0].message.content == reply[:reply.index(stop)]
        assert cut.choices[0].finish_reason == "stop"


def token_id(base_url, api_key, text):
    """The one token id of `text` in the served model's vocabulary (Harrier's /tokenize)."""
    root = base_url.rstrip("/").removesuffix("/v1")
    req = urllib.request.Request(
        root + "/tokenize",
        data=json.dumps({"prompt": text, "add_special_tokens": False}).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {api_key}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        ids = json.load(r)["tokens"]
    assert len(ids) == 1, f"{text!r} is not one token: {ids}"
    return ids[0]


@check("logit_bias steers the tokens")
def logit_bias(client, model, base_url, api_key):
    # +100 on the token "0" makes it the greedy choice at every step.
    zero = str(token_id(base_url, api_key, "0"))
    r = client.completions.create(model=model, prompt="Count:", max_tokens=4, temperature=0,
                                  logit_bias={zero: 100})
    assert r.choices[0].text == "0000", r.choices[0].text
    try:
        client.completions.create(model=model, prompt="x", max_tokens=2, logit_bias={zero: 101})
        raise AssertionError("expected BadRequestError")
    except openai.BadRequestError as e:
        assert e.body["param"] == "logit_bias", e.body


@check("errors map to openai exceptions")
def errors(client, model):
    try:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
        raise AssertionError("expected NotFoundError")
    except openai.NotFoundError as e:
        assert e.status_code == 404
    try:
        client.completions.create(model=model, prompt="x", max_tokens=2, temperature=-1)
        raise AssertionError("expected BadRequestError")
    except openai.BadRequestError as e:
        assert e.status_code == 400
        assert e.body["param"] == "temperature", e.body


@check("wrong API key is rejected")
def auth(base_url, model):
    bad = OpenAI(base_url=base_url, api_key="definitely-wrong", max_retries=0)
    try:
        bad.models.list()
        raise AssertionError("expected AuthenticationError")
    except openai.AuthenticationError as e:
        assert e.status_code == 401


@check("speculative decoding: greedy text equals the reference server's, counts in usage")
def speculative(client, model, reference):
    prompts = ["import os\nimport sys\n\n\ndef main():\n", "class Config:\n    def __init__(self, path):\n",
               "for i in range(10):\n"]
    accepted = 0
    for p in prompts:
        kw = dict(model=model, prompt=p, max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
        want = reference.completions.create(**kw).choices[0].text
        got = client.completions.create(**kw)
        assert got.choices[0].text == want, (got.choices[0].text, want)
        spec = (got.usage.model_extra or {}).get("speculative_decoding")
        assert spec is not None and spec["draft_tokens"] > 0, got.usage
        accepted += spec["accepted_tokens"]
        # Streamed, rounds arrive as chunks of several tokens; the client joins them.
        text = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw)
                       if c.choices)
        assert text == want, (text, want)
    assert accepted > 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--api-key", default="EMPTY")
    ap.add_argument("--reference-base-url",
                    help="a server of the same model without speculative decoding: the one at "
                         "--base-url speculates, and its greedy text must equal this one's")
    args = ap.parse_args()
    print(f"openai {openai.__version__} against {args.base_url}")
    client = OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=120)
    models(client)
    model = client.models.list().data[0].id
    completion(client, model)
    completion_stream(client, model)
    chat(client, model)
    chat_stream(client, model)
    logit_bias(client, model, args.base_url, args.api_key)
    errors(client, model)
    if args.api_key != "EMPTY":
        auth(args.base_url, model)
    if args.reference_base_url:
        reference = OpenAI(base_url=args.reference_base_url, api_key=args.api_key, max_retries=0,
                           timeout=120)
        speculative(client, model, reference)
    failed = sum(1 for _, err in RESULTS if err)
    print(f"{len(RESULTS) - failed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
