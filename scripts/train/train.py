#!/usr/bin/env python3
"""Trains a Harrier model family deterministically and writes Hugging Face directories.

    python3 scripts/train/train.py --family cpu --out DIR
    python3 scripts/train/train.py --family gpu --out DIR --llama3-tokenizer PATH [--only a,b]

Runs on the GPU machine (torch, transformers and tokenizers as it has them; nothing is
downloaded). For each model of the family (families.py): a fixed seed initialises it, a fixed
seed draws its training windows from the corpus (corpus.py: installed Python source, a held-out
split no step sees), and it trains for a fixed number of steps in bf16 autocast with fp32
master weights. Printed: the loss curve, held-out loss, time; for each (draft, target) pair the
teacher-forced greedy agreement and the tokens per round of greedy speculation with K=4.
Written per model: config.json, generation_config.json, model.safetensors (bf16),
tokenizer.json, tokenizer_config.json (Llama 3.1 chat template); and DIR/report.json,
DIR/heldout_prompts.json (token ids of held-out prompts, for fixtures and fidelity checks).
A model whose DIR/NAME/.done exists is not trained again (its report entry is kept).
"""

import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, Qwen3Config

try:  # transformers 5 names it so; older releases too since 4.50
    from transformers import Gemma3TextConfig
except ImportError:  # pragma: no cover - only families without Gemma can train then
    Gemma3TextConfig = None

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import corpus as corpus_mod  # noqa: E402
import families  # noqa: E402
import tok as tok_mod  # noqa: E402

EVAL_WINDOWS = 64  # held-out windows for the held-out loss (evenly spaced, seq tokens each)
AGREE_WINDOWS = 16  # held-out windows for teacher-forced draft/target agreement
SPEC_PROMPTS, SPEC_PROMPT_LEN, SPEC_GEN, SPEC_K = 16, 64, 128, 4
PROMPT_LENGTHS = [1, 3, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256]  # held-out prompts


def log(msg):
    print(msg, flush=True)


def hf_config(spec, vocab, sp):
    common = dict(
        vocab_size=vocab, hidden_size=spec.hidden, intermediate_size=spec.inter,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim, max_position_embeddings=spec.max_pos, rms_norm_eps=spec.rms_eps,
        tie_word_embeddings=True, rope_parameters=json.loads(json.dumps(spec.rope)), bos_token_id=sp[tok_mod.BOS],
        eos_token_id=[i for i in (sp[tok_mod.EOS_TEXT], sp[tok_mod.EOM], sp[tok_mod.EOT]) if i is not None],
    )
    if spec.arch == "gemma3":
        # Gemma 3 text: 5 sliding layers to 1 full, GELU-tanh, (1 + w) norms, scaled embeddings.
        if Gemma3TextConfig is None:
            raise SystemExit("this transformers has no Gemma3TextConfig")
        layer_types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(spec.layers)]
        return Gemma3TextConfig(**common, sliding_window=spec.window, layer_types=layer_types,
                                query_pre_attn_scalar=spec.head_dim, hidden_activation="gelu_pytorch_tanh")
    cls = {"llama": LlamaConfig, "qwen3": Qwen3Config}[spec.arch]
    return cls(**common)


def lr_at(spec, step):
    if step < spec.warmup:
        return spec.lr * (step + 1) / spec.warmup
    t = (step - spec.warmup) / max(1, spec.steps - spec.warmup)
    return spec.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def eval_windows(stream, seq, count):
    """`count` evenly spaced windows of seq + 1 tokens from a held-out stream."""
    n = (len(stream) - 1) // seq
    starts = np.linspace(0, (n - 1) * seq, min(count, n)).astype(np.int64)
    return torch.from_numpy(np.stack([stream[s:s + seq + 1].astype(np.int64) for s in starts]))


@torch.no_grad()
def heldout_loss(model, windows, bs=8):
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(windows), bs):
        w = windows[i:i + bs].cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=w[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1), reduction="sum")
        total += loss.item()
        count += w[:, 1:].numel()
    model.train()
    return total / count


def train_one(spec, fam, sp, train_stream, held_windows, out_dir, micro_batches=1):
    vocab = fam.vocab
    torch.manual_seed(spec.seed)
    cfg = hf_config(spec, vocab, sp)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")  # float32 master weights
    model.cuda().train()
    nparams = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=spec.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)
    gen = torch.Generator().manual_seed(spec.seed + 1)
    ar = torch.arange(spec.seq + 1)
    n = len(train_stream) - spec.seq - 1
    teacher = None
    if spec.teacher:
        path = os.path.join(os.path.dirname(out_dir), spec.teacher)
        if not os.path.exists(os.path.join(path, ".done")):
            raise SystemExit(f"{spec.name} distils from {spec.teacher}, which is not trained in {path}")
        teacher = load_bf16(path)
        teacher.requires_grad_(False)
    curve, pending = [], []
    every = max(1, spec.steps // 20)
    torch.cuda.synchronize()
    t0 = time.time()
    for step in range(spec.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(spec, step)
        offs = torch.randint(0, n, (spec.batch,), generator=gen)
        batch = train_stream[(offs[:, None] + ar[None, :]).cuda()]
        # Gradient accumulation over micro-batches (same windows, same mean loss; only the
        # order of the fp32 sums changes): the 1B's fp32 logits of a whole batch need ~8 GiB
        # more than an 80 GB H100 has left.
        step_loss = 0.0
        for mb in batch.chunk(micro_batches):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(input_ids=mb[:, :-1]).logits
            if teacher is None:
                loss = F.cross_entropy(logits.float().reshape(-1, vocab), mb[:, 1:].reshape(-1))
            else:
                with torch.no_grad():
                    t_logp = F.log_softmax(teacher(input_ids=mb[:, :-1]).logits.float(), -1).reshape(-1, vocab)
                # Forward KL(teacher || student), per token.
                loss = F.kl_div(F.log_softmax(logits.float(), -1).reshape(-1, vocab), t_logp,
                                log_target=True, reduction="batchmean")
                del t_logp
            del logits
            loss = loss * (mb.shape[0] / batch.shape[0])
            loss.backward()
            step_loss = step_loss + loss.detach()
            del loss
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        pending.append(step_loss)
        if (step + 1) % every == 0 or step + 1 == spec.steps:
            mean = torch.stack(pending).mean().item()  # one sync per report
            pending = []
            curve.append([step + 1, round(mean, 4)])
            log(f"  {spec.name} step {step + 1}/{spec.steps} loss {mean:.3f} lr {lr_at(spec, step):.2e} "
                f"{time.time() - t0:.0f}s")
    torch.cuda.synchronize()
    train_s = time.time() - t0
    held = heldout_loss(model, held_windows)
    del opt, teacher
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.generation_config = GenerationConfig(bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id)
    model.save_pretrained(out_dir)
    del model
    torch.cuda.empty_cache()
    entry = {"name": spec.name, "arch": spec.arch, "params": nparams, "steps": spec.steps,
             "tokens": spec.steps * spec.batch * spec.seq, "batch": spec.batch, "seq": spec.seq, "lr": spec.lr,
             "seed": spec.seed, "teacher": spec.teacher, "train_seconds": round(train_s, 1),
             "final_train_loss": curve[-1][1],
             "heldout_loss": round(held, 4), "curve": curve}
    log(f"{spec.name}: {nparams / 1e6:.1f}M params, {entry['tokens'] / 1e6:.1f}M tokens in {train_s:.0f}s, "
        f"train loss {curve[-1][1]:.3f}, held-out loss {held:.3f}")
    return entry


def load_bf16(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()


@torch.no_grad()
def argmax_along(model, seqs, bs=8):
    """Greedy next-token predictions at every position of each sequence (teacher forced)."""
    outs = []
    for i in range(0, len(seqs), bs):
        outs.append(model(input_ids=seqs[i:i + bs].cuda()).logits.argmax(-1).cpu())
    return torch.cat(outs)


@torch.no_grad()
def greedy_continue(model, prompts, n):
    """Greedy continuations of n tokens (batch of equal-length prompts, KV cache)."""
    out = model(input_ids=prompts.cuda(), use_cache=True)
    past, nxt, gen = out.past_key_values, out.logits[:, -1].argmax(-1), []
    for _ in range(n):
        gen.append(nxt)
        out = model(input_ids=nxt[:, None], past_key_values=past, use_cache=True)
        past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1)
    return torch.stack(gen, 1).cpu()


def spec_rounds(matches, k):
    """Tokens per round of greedy speculation with k drafts, given whether the draft's greedy
    token equals the target's at each generated position (teacher forced on the target's
    tokens, which is the draft's own context while it keeps matching)."""
    i, rounds, n = 0, 0, len(matches)
    while i < n:
        j = 0
        while j < k and i + j < n and matches[i + j]:
            j += 1
        i += j + 1  # accepted drafts plus the target's own token
        rounds += 1
    return n / rounds


def agreement(out, fam, held_stream, seq):
    windows = eval_windows(held_stream, seq, AGREE_WINDOWS)[:, :-1]
    prompts = eval_windows(held_stream, SPEC_PROMPT_LEN, SPEC_PROMPTS)[:, :-1]
    cache, results = {}, []
    for draft, target in fam.pairs:
        if not all(os.path.exists(os.path.join(out, m, ".done")) for m in (draft, target)):
            continue
        if target not in cache:
            m = load_bf16(os.path.join(out, target))
            gen = greedy_continue(m, prompts, SPEC_GEN)
            cache[target] = (argmax_along(m, windows), gen)
            del m
        t_windows, gen = cache[target]
        d = load_bf16(os.path.join(out, draft))
        d_windows = argmax_along(d, windows)
        d_along = argmax_along(d, torch.cat([prompts, gen], 1))[:, SPEC_PROMPT_LEN - 1:-1]
        del d
        torch.cuda.empty_cache()
        tf = (d_windows == t_windows).float().mean().item()
        matches = (d_along == gen)
        per_round = float(np.mean([spec_rounds(row.tolist(), SPEC_K) for row in matches]))
        r = {"draft": draft, "target": target, "teacher_forced_agreement": round(tf, 4),
             "greedy_agreement_on_target_text": round(matches.float().mean().item(), 4),
             f"tokens_per_round_k{SPEC_K}": round(per_round, 3)}
        log(f"pair {draft} -> {target}: agreement {tf:.1%} (teacher forced, held-out), "
            f"{r['greedy_agreement_on_target_text']:.1%} along the target's greedy text, "
            f"{per_round:.2f} tokens per round at K={SPEC_K}")
        results.append(r)
    return results


def heldout_prompts(held_stream):
    """Held-out prompts of PROMPT_LENGTHS tokens, each the start of a different held-out
    document (BOS first) at least that long, spread evenly over the split."""
    bos = int(held_stream[0])
    starts = np.append(np.flatnonzero(held_stream == bos), len(held_stream))
    docs = [(int(a), int(b - a)) for a, b in zip(starts[:-1], starts[1:])]
    prompts, used = [], set()
    for i, n in enumerate(PROMPT_LENGTHS):
        fits = [d for d in docs if d[1] > n and d[0] not in used]
        start = fits[int(i * (len(fits) - 1) / max(1, len(PROMPT_LENGTHS) - 1))][0]
        used.add(start)
        prompts.append(held_stream[start:start + n].astype(int).tolist())
    return prompts


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", required=True, choices=sorted(families.FAMILIES))
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", help="comma-separated model names (default: the whole family)")
    ap.add_argument("--llama3-tokenizer", help="tokenizer.json of Llama 3 (the llama3 families)")
    ap.add_argument("--steps-scale", type=float, default=1.0, help="scale every step count (smoke tests only)")
    ap.add_argument("--micro-batches", type=int, default=0,
                    help="split each step's batch in this many micro-batches (gradient accumulation); "
                         "default: 1, or 4 for the 1B shape on GPUs under 100 GB")
    args = ap.parse_args()

    t_start = time.time()
    fam = families.FAMILIES[args.family]
    os.makedirs(args.out, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = True
    log(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.cuda.get_device_name()}")
    corpus = corpus_mod.load()
    log(corpus.describe())

    tok_path = os.path.join(args.out, "tokenizer.json")
    if fam.tokenizer == "bpe":
        if not os.path.exists(tok_path):
            t = time.time()
            tok_mod.train_bpe(corpus, fam.vocab).save(tok_path)
            log(f"BPE tokenizer: vocabulary {fam.vocab}, trained in {time.time() - t:.1f}s")
    else:
        if not args.llama3_tokenizer:
            raise SystemExit(f"family {fam.name} needs --llama3-tokenizer")
        tok_mod.load(args.llama3_tokenizer).save(tok_path)
    tk = tok_mod.load(tok_path)
    if tk.get_vocab_size() != fam.vocab:
        raise SystemExit(f"tokenizer has {tk.get_vocab_size()} entries, family {fam.name} expects {fam.vocab}")
    sp = tok_mod.special_ids(tk)
    t = time.time()
    train_np = tok_mod.encode_docs(tk, corpus.train)
    held_np = tok_mod.encode_docs(tk, corpus.heldout)
    log(f"tokenized in {time.time() - t:.1f}s: train {len(train_np) / 1e6:.2f}M tokens, "
        f"held-out {len(held_np) / 1e6:.3f}M tokens")
    train_stream = torch.from_numpy(train_np.astype(np.int64)).cuda()

    report_path = os.path.join(args.out, "report.json")
    report = json.load(open(report_path)) if os.path.exists(report_path) else {}
    report.update({"family": fam.name, "corpus": corpus.describe(), "corpus_digest": corpus.digest,
                   "train_tokens": len(train_np), "heldout_tokens": len(held_np),
                   "torch": torch.__version__, "transformers": transformers.__version__,
                   "device": torch.cuda.get_device_name()})
    models = report.setdefault("models", {})
    only = set(args.only.split(",")) if args.only else None
    for spec in fam.models + fam.extras:
        if (only is None and spec in fam.extras) or (only is not None and spec.name not in only):
            continue
        if args.steps_scale != 1.0:
            spec = families.Spec(**{**spec.__dict__, "steps": max(2, int(spec.steps * args.steps_scale)),
                                    "warmup": max(1, int(spec.warmup * args.steps_scale))})
        d = os.path.join(args.out, spec.name)
        if os.path.exists(os.path.join(d, ".done")):
            log(f"{spec.name}: already trained in {d}")
            continue
        held_windows = eval_windows(held_np, spec.seq, EVAL_WINDOWS)
        mb = args.micro_batches or (4 if spec.hidden >= 2048 and
                                     torch.cuda.get_device_properties(0).total_memory < 100 * 2**30 else 1)
        models[spec.name] = train_one(spec, fam, sp, train_stream, held_windows, d, mb)
        tok_mod.write_files(tk, d, spec.max_pos)
        open(os.path.join(d, ".done"), "w").close()
        json.dump(report, open(report_path, "w"), indent=1)
    del train_stream
    torch.cuda.empty_cache()
    report["pairs"] = agreement(args.out, fam, held_np, fam.models[0].seq) or report.get("pairs", [])
    prompts = heldout_prompts(held_np)
    json.dump(prompts, open(os.path.join(args.out, "heldout_prompts.json"), "w"))
    report["total_seconds"] = round(time.time() - t_start, 1)
    json.dump(report, open(report_path, "w"), indent=1)
    log(f"family {fam.name}: done in {report['total_seconds']:.0f}s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
