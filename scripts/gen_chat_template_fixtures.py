#!/usr/bin/env python3
"""Regenerates frontend/tests/fixtures/chat_templates/expected.json.

Renders every case of cases.json with every template there the way Hugging Face
transformers' apply_chat_template does (jinja2 ImmutableSandboxedEnvironment with
trim_blocks, lstrip_blocks, loopcontrols, raise_exception, strftime_now and its tojson
override). List content parts are joined with newlines first, as the front end does.

    pip install jinja2 && python3 scripts/gen_chat_template_fixtures.py
"""
import json
import os
from datetime import datetime

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "frontend", "tests", "fixtures", "chat_templates")


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(fmt):
    return datetime.now().strftime(fmt)


def flatten(messages):
    out = []
    for m in messages:
        m = dict(m)
        if isinstance(m.get("content"), list):
            m["content"] = "\n".join(p["text"] for p in m["content"])
        out.append(m)
    return out


def main():
    with open(os.path.join(HERE, "cases.json"), encoding="utf-8") as f:
        spec = json.load(f)
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    expected = []
    for tname, tpath in sorted(spec["templates"].items()):
        with open(os.path.join(HERE, tpath), encoding="utf-8") as f:
            template = env.from_string(f.read())
        for case in spec["cases"]:
            ctx = dict(case.get("kwargs", {}))
            ctx.update(spec["special_tokens"])
            ctx.update(messages=flatten(case["messages"]), tools=case.get("tools"),
                       add_generation_prompt=case["add_generation_prompt"])
            entry = {"template": tname, "case": case["name"]}
            try:
                entry["output"] = template.render(**ctx)
            except jinja2.exceptions.TemplateError as e:
                entry["error"] = str(e)
            expected.append(entry)
    with open(os.path.join(HERE, "expected.json"), "w", encoding="utf-8") as f:
        json.dump(expected, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {len(expected)} renderings")


if __name__ == "__main__":
    main()
