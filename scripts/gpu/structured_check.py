#!/usr/bin/env python3
"""Structured outputs on a running server: constrained requests (greedy and sampled, with and
without logprobs, mixed with unconstrained ones, concurrently) must give valid output; with
--reference, greedy outputs must equal the reference server's (e.g. CUDA fp32 vs CPU).

    python3 scripts/gpu/structured_check.py --base http://127.0.0.1:8124 [--reference URL]
"""
import argparse, concurrent.futures as cf, json, re, sys, time, urllib.request

def post(base, path, body):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
          "age": {"type": "integer", "minimum": 0, "maximum": 120},
          "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}

def cases():
    out = []
    for i, prompt in enumerate(["def main():", "import os", "Person:", "class A:", "# data", "x = "]):
        for t in (0.0, 0.9):
            out.append((f"schema{i}-{t}", {"prompt": prompt, "max_tokens": 120, "temperature": t, "seed": i,
                        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}},
                        lambda s: (lambda v: isinstance(v["name"], str) and 0 <= v["age"] <= 120)(json.loads(s))))
            out.append((f"regex{i}-{t}", {"prompt": prompt, "max_tokens": 20, "temperature": t, "seed": i,
                        "structured_outputs": {"regex": "[A-Z]{2}-[0-9]{3}"}},
                        lambda s: re.fullmatch("[A-Z]{2}-[0-9]{3}", s) is not None))
            out.append((f"choice{i}-{t}", {"prompt": prompt, "max_tokens": 8, "temperature": t, "seed": i, "logprobs": 2,
                        "structured_outputs": {"choice": ["yes", "no", "maybe"]}},
                        lambda s: s in ("yes", "no", "maybe")))
            out.append((f"plain{i}-{t}", {"prompt": prompt, "max_tokens": 24, "temperature": t, "seed": i}, None))
    return out

def run(base):
    with cf.ThreadPoolExecutor(32) as ex:
        futs = {name: ex.submit(post, base, "/v1/completions", body) for name, body, _ in cases()}
        return {k: f.result()["choices"][0]["text"] for k, f in futs.items()}

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True)
    ap.add_argument("--reference")
    a = ap.parse_args()
    t0 = time.time(); got = run(a.base); dt = time.time() - t0
    bad = 0
    for name, _, ok in cases():
        if ok is not None:
            try:
                valid = ok(got[name])
            except Exception:
                valid = False
            if not valid:
                bad += 1; print(f"INVALID {name}: {got[name]!r}")
    print(f"{len(got)} requests in {dt:.1f} s; {bad} invalid constrained outputs")
    same = diff = 0
    if a.reference:
        ref = run(a.reference)
        for name, body, _ in cases():
            if body["temperature"] == 0.0:
                if ref[name] == got[name]: same += 1
                else: diff += 1; print(f"DIFF {name}: {got[name]!r} vs reference {ref[name]!r}")
        print(f"greedy outputs equal to the reference: {same}/{same + diff}")
    sys.exit(1 if bad or diff else 0)

if __name__ == "__main__":
    main()
