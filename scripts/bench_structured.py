#!/usr/bin/env python3
"""Cost of a structured-output constraint on a running server: tokens/s of greedy requests of
128 tokens with and without a constraint that never completes within them (regex
`[a-z ]{2000}`), one at a time and 16 at once, medians of --rounds (side by side in one run).

    python3 scripts/bench_structured.py --base http://127.0.0.1:8000 [--rounds 5]
"""
import argparse, concurrent.futures as cf, json, statistics, time, urllib.request

def post(base, body):
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)

def batch(base, n, constrained, i):
    body = {"prompt": f"Write some text {i}:", "max_tokens": 128, "temperature": 0, "ignore_eos": True}
    if constrained:
        body["structured_outputs"] = {"regex": "[a-z ]{2000}"}
    t = time.time()
    with cf.ThreadPoolExecutor(n) as ex:
        outs = list(ex.map(lambda k: post(base, dict(body, prompt=body["prompt"] + str(k))), range(n)))
    dt = time.time() - t
    toks = sum(o["usage"]["completion_tokens"] for o in outs)
    return toks / dt

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    batch(a.base, 1, True, -1); batch(a.base, 1, False, -1)  # warm up (compile, caches)
    for n in (1, 16):
        plain, cons = [], []
        for r in range(a.rounds):
            plain.append(batch(a.base, n, False, r)); cons.append(batch(a.base, n, True, r))
        p, c = statistics.median(plain), statistics.median(cons)
        print(f"concurrency {n:2d}: unconstrained {p:8.0f} tok/s, constrained {c:8.0f} tok/s ({c / p:.2f}x)")

if __name__ == "__main__":
    main()
