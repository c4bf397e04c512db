#!/usr/bin/env python3
"""Reference fixtures for Harrier's CPU parity test (tests/parity.rs), from transformers.

For each model directory (written by `harrier gen-model`, or a trained model committed to the
repository), loads it with transformers in float32 (CUDA if present, TF32 off; else CPU), and
for 8 prompts of token ids drawn from a seeded RNG (lengths 1, 2, 7, 16, 17, 33, 100, 200), or
the prompts of --prompts (a JSON list of token-id lists, e.g. held-out text from the trainer),
records the greedy continuation of --steps tokens (a manual loop with the KV cache, no
sampling) and, at each step, the top-5 (token id, logit) of the next-token logits. Writes one
JSON per model:

    {"preset", "seed", "prompt_seed", "steps", "config": {...}, "param_checksum": {...},
     "prompts": [{"prompt_ids", "greedy_ids", "top5": [[[id, logit] x 5] per step]}], ...}

Usage: parity_fixtures.py --out DIR [--prompts FILE] PRESET:SEED:MODEL_DIR [...]
(SEED is "-" for a trained model: tests/parity.rs then loads the committed directory instead of
regenerating it.)
"""

import argparse
import json
import os
import random
import sys
import time

import torch
import transformers
from transformers import AutoModelForCausalLM

PROMPT_LENGTHS = [1, 2, 7, 16, 17, 33, 100, 200]


def load(model_dir, device):
    kwargs = dict(attn_implementation="eager", output_loading_info=True)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kwargs)
    except TypeError:  # transformers < 4.56 spells it torch_dtype
        model, info = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32, **kwargs)
    bad = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if bad:
        raise SystemExit(f"{model_dir}: transformers did not load the checkpoint cleanly: {bad}")
    return model.to(device).eval()


def checksum(model):
    s = a = 0.0
    for _, p in model.named_parameters():  # tied weights are listed once
        d = p.detach().double()
        s += d.sum().item()
        a += d.abs().sum().item()
    return {"sum": s, "abs_sum": a}


def config_summary(cfg):
    keys = [
        "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
        "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
        "max_position_embeddings", "tie_word_embeddings", "rope_theta", "rope_scaling",
        "rope_parameters", "layer_types", "sliding_window", "query_pre_attn_scalar", "hidden_activation",
    ]
    out = {k: getattr(cfg, k) for k in keys if getattr(cfg, k, None) is not None}
    out["head_dim"] = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return json.loads(json.dumps(out, default=str))


@torch.no_grad()
def greedy(model, prompt, steps, device):
    out = model(input_ids=torch.tensor([prompt], device=device), use_cache=True)
    past, logits = out.past_key_values, out.logits[0, -1].float()
    ids, top5 = [], []
    for step in range(steps):
        vals, idx = torch.topk(logits, 5)
        top5.append([[int(i), float(v)] for i, v in zip(idx.tolist(), vals.tolist())])
        nxt = int(torch.argmax(logits).item())
        ids.append(nxt)
        if step + 1 < steps:
            out = model(input_ids=torch.tensor([[nxt]], device=device), past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[0, -1].float()
    return ids, top5


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+", help="PRESET:SEED:MODEL_DIR")
    ap.add_argument("--out", required=True, help="folder for parity_<preset>.json")
    ap.add_argument("--prompt-seed", type=int, default=20261122)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prompts", help="JSON list of prompts (token-id lists) instead of random ones")
    args = ap.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    os.makedirs(args.out, exist_ok=True)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, device {device}"
          + (f" ({torch.cuda.get_device_name()})" if device == "cuda" else ""), flush=True)

    for spec in args.models:
        preset, seed, model_dir = spec.split(":", 2)
        t0 = time.time()
        model = load(model_dir, device)
        vocab = model.config.vocab_size
        if args.prompts:
            chosen = json.load(open(args.prompts))
        else:
            rng = random.Random(args.prompt_seed)
            chosen = [[rng.randrange(vocab) for _ in range(n)] for n in PROMPT_LENGTHS]
        prompts = []
        for prompt in chosen:
            ids, top5 = greedy(model, prompt, args.steps, device)
            prompts.append({"prompt_ids": prompt, "greedy_ids": ids, "top5": top5})
        fixture = {
            "preset": preset,
            "seed": None if seed == "-" else int(seed),
            "prompt_seed": None if args.prompts else args.prompt_seed,
            "steps": args.steps,
            "config": config_summary(model.config),
            "param_checksum": checksum(model),
            "reference": {
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                "dtype": "float32",
                "tf32": False,
                "attn_implementation": "eager",
            },
            "prompts": prompts,
        }
        path = os.path.join(args.out, f"parity_{preset}.json")
        with open(path, "w") as f:
            json.dump(fixture, f, separators=(",", ":"))
            f.write("\n")
        distinct = sum(len(set(p["greedy_ids"])) for p in prompts) / len(prompts)
        print(f"{preset:12s} seed {seed}: {len(prompts)} prompts x {args.steps} steps, "
              f"{distinct:.1f} distinct greedy ids per prompt, {time.time() - t0:.1f}s -> {path}", flush=True)
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
