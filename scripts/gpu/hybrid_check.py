#!/usr/bin/env python3
"""Window-sized KV on a running server: greedy completions of prompts far longer than the
model's sliding window (token ids; lengths 40 to 700, some sharing a 300-token prefix so the
prefix cache serves them) sent concurrently to --base and to --reference, which must answer
identically (e.g. CUDA fp32 with the sliding layers' own pool vs the CPU, or vs the same
server with --disable-hybrid-kv-cache-manager). Prints one JSON line; exits 1 on a mismatch.

    python3 scripts/gpu/hybrid_check.py --base URL --reference URL [--vocab 1024]
"""
import argparse, concurrent.futures as cf, json, random, sys, urllib.request


def post(base, body):
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)["choices"][0]["text"]


def prompts(vocab):
    rng = random.Random(15)
    shared = [rng.randrange(vocab) for _ in range(300)]
    out = [[rng.randrange(vocab) for _ in range(n)] for n in (40, 97, 250, 511, 700)]
    out += [shared + [rng.randrange(vocab) for _ in range(n)] for n in (1, 17, 64, 200)]
    return out


def run(base, ps, tokens):
    with cf.ThreadPoolExecutor(16) as ex:
        futs = [ex.submit(post, base, {"prompt": p, "max_tokens": tokens, "temperature": 0}) for p in ps]
        return [f.result() for f in futs]


ap = argparse.ArgumentParser()
ap.add_argument("--base", required=True)
ap.add_argument("--reference", required=True)
ap.add_argument("--vocab", type=int, default=1024)
ap.add_argument("--tokens", type=int, default=48)
a = ap.parse_args()
ps = prompts(a.vocab)
ours, ref = run(a.base, ps, a.tokens), run(a.reference, ps, a.tokens)
same = sum(x == y for x, y in zip(ours, ref))
first = next((i for i, (x, y) in enumerate(zip(ours, ref)) if x != y), None)
print(json.dumps({"prompts": len(ps), "identical": same, "first_mismatch": first,
                  "lengths": [len(p) for p in ps]}))
sys.exit(0 if same == len(ps) else 1)
