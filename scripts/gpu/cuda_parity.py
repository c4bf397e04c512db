#!/usr/bin/env python3
"""CUDA backend parity against transformers, on the GPU machine.

For a model directory (written by `harrier gen-model`, or trained by scripts/train/): draws 8
prompts (lengths 1, 2, 7, 16, 17, 33, 100, 200; seeded) or takes those of --prompts (a JSON list
of token-id lists, e.g. the trainer's held-out prompts), runs `harrier-cuda-tool parity --dtype D` (all prompts in one batch,
greedy, --steps tokens), then transformers in the same dtype on the same checkpoint:
  - greedy continuation of --steps tokens (manual loop with the KV cache): compared with ours;
  - teacher-forced logits along OUR tokens (one forward over prompt + our tokens): relative
    error ||ours - hf|| / ||hf|| at every step.
bfloat16 (default): the bar is the same greedy tokens as transformers bf16 for 7 of every 8
prompts, and ours agreeing with transformers fp32 (greedy, TF32 off) on at least as many prompts
as transformers bf16 does; --rel-bar adds a bound on the logits' relative error (random-weight
checkpoints: 2e-2). Agreement is also counted in tokens: the length of the common prefix of the
two greedy continuations, summed over prompts.
transformers runs with full-precision bf16 GEMM reductions
(allow_bf16_reduced_precision_reduction = False), as our cuBLAS handle does.
float32: transformers fp32 with TF32 off; the bar is < 1e-4 and identical greedy tokens.
Prints one JSON line and writes it to --json.
Usage: cuda_parity.py --tool PATH --model DIR --work DIR [--dtype bfloat16|float32] [--steps 16]
                      [--prompts FILE] [--rel-bar 2e-2] [--json OUT]
"""
import argparse, json, random, subprocess, sys, os

import numpy as np
import torch
from transformers import AutoModelForCausalLM

LENGTHS = [1, 2, 7, 16, 17, 33, 100, 200]

ap = argparse.ArgumentParser()
ap.add_argument("--tool", required=True)
ap.add_argument("--model", required=True)
ap.add_argument("--work", required=True)
ap.add_argument("--steps", type=int, default=16)
ap.add_argument("--json")
ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
ap.add_argument("--prompts", help="JSON list of prompts (token-id lists) instead of random ones")
ap.add_argument("--rel-bar", type=float, help="bf16: also require max relative logit error below this")
a = ap.parse_args()

os.makedirs(a.work, exist_ok=True)
cfg = json.load(open(os.path.join(a.model, "config.json")))
vocab = cfg["vocab_size"]
if a.prompts:
    prompts = json.load(open(a.prompts))
else:
    rng = random.Random(7)
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in LENGTHS]
pfile = os.path.join(a.work, "prompts.json")
json.dump(prompts, open(pfile, "w"))
r = subprocess.run([a.tool, "parity", "--model", a.model, "--prompts", pfile, "--steps", str(a.steps), "--out", a.work,
                    "--dtype", a.dtype],
                   capture_output=True, text=True)
if r.returncode != 0:
    print(r.stdout, r.stderr, file=sys.stderr)
    raise SystemExit("harrier-cuda-tool parity failed")
ours = json.load(open(os.path.join(a.work, "tokens.json")))["tokens"]
logits = np.fromfile(os.path.join(a.work, "logits.bin"), dtype=np.float32).reshape(len(prompts), a.steps, vocab)

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
fp32 = a.dtype == "float32"
# The fp32 model: the reference in float32 mode, the noise floor in bf16 mode.
m32 = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).to("cuda").eval()
model = m32 if fp32 else AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16).to("cuda").eval()


def hf_greedy(m, p):
    """transformers' greedy continuation of --steps tokens (manual loop with the KV cache)."""
    out = m(input_ids=torch.tensor([p], device="cuda"), use_cache=True)
    past, toks = out.past_key_values, []
    nxt = int(out.logits[0, -1].float().argmax())
    for s in range(a.steps):
        toks.append(nxt)
        if s + 1 == a.steps:
            break
        out = m(input_ids=torch.tensor([[nxt]], device="cuda"), past_key_values=past, use_cache=True)
        past = out.past_key_values
        nxt = int(out.logits[0, -1].float().argmax())
    return toks


def common_prefix(x, y):
    n = 0
    while n < min(len(x), len(y)) and x[n] == y[n]:
        n += 1
    return n


res = []
with torch.no_grad():
    for i, p in enumerate(prompts):
        hf_tok = hf_greedy(model, p)
        hf32_tok = hf_tok if fp32 else hf_greedy(m32, p)
        # Teacher-forced along our tokens.
        full = torch.tensor([p + ours[i][:-1]], device="cuda")
        lg = model(input_ids=full).logits[0, len(p) - 1:].float().cpu().numpy()
        errs = [float(np.linalg.norm(logits[i, s] - lg[s]) / np.linalg.norm(lg[s])) for s in range(a.steps)]
        l32 = m32(input_ids=full).logits[0, len(p) - 1:].float().cpu().numpy()
        rel = lambda x, s: float(np.linalg.norm(x - l32[s]) / np.linalg.norm(l32[s]))
        ours_vs_32 = max(rel(logits[i, s], s) for s in range(a.steps))
        hf16_vs_32 = max(rel(lg[s], s) for s in range(a.steps))
        argmax_agree = sum(int(np.argmax(logits[i, s]) == np.argmax(lg[s])) for s in range(a.steps))
        res.append({"len": len(p), "same_greedy": hf_tok == ours[i], "max_rel_err": max(errs), "first_rel_err": errs[0],
                    "ours_same_as_hf_fp32": ours[i] == hf32_tok, "hf_same_as_hf_fp32": hf_tok == hf32_tok,
                    "ours_prefix_vs_hf": common_prefix(ours[i], hf_tok),
                    "ours_prefix_vs_hf_fp32": common_prefix(ours[i], hf32_tok),
                    "hf_prefix_vs_hf_fp32": common_prefix(hf_tok, hf32_tok),
                    "teacher_forced_argmax_agree": argmax_agree, "ours_vs_fp32": ours_vs_32, "hf_bf16_vs_fp32": hf16_vs_32, "ours": ours[i][:8], "hf": hf_tok[:8]})
total = lambda key: sum(r[key] for r in res)
same, worst = total("same_greedy"), max(r["max_rel_err"] for r in res)
if fp32:
    ok = same == len(res) and worst < 1e-4
else:
    ok = (8 * same >= 7 * len(res) and total("ours_same_as_hf_fp32") >= total("hf_same_as_hf_fp32")
          and (a.rel_bar is None or worst < a.rel_bar))
summary = {
    "model": os.path.basename(a.model.rstrip("/")),
    "dtype": a.dtype,
    "prompts": len(res),
    "steps": a.steps,
    "prompts_same_greedy": same,
    "ours_same_as_hf_fp32": total("ours_same_as_hf_fp32"),
    "hf_same_as_hf_fp32": total("hf_same_as_hf_fp32"),
    "tokens_ours_vs_hf": total("ours_prefix_vs_hf"),
    "tokens_ours_vs_hf_fp32": total("ours_prefix_vs_hf_fp32"),
    "tokens_hf_vs_hf_fp32": total("hf_prefix_vs_hf_fp32"),
    "max_rel_err": worst,
    "max_ours_vs_fp32": max(r["ours_vs_fp32"] for r in res),
    "max_hf_bf16_vs_fp32": max(r["hf_bf16_vs_fp32"] for r in res),
    "pass": ok,
    "per_prompt": res,
}
line = json.dumps(summary)
print(line)
if a.json:
    open(a.json, "w").write(line + "\n")
