"""Times the published megakernel (HazyResearch/Megakernels, low-latency Llama-1B demo) on a
local Llama-3.2-1B-shaped checkpoint, through the ctypes shim (libmk.so's mk_call).

usage: mkbench.py MODEL_DIR OUT_JSON [prompt lengths...]

For each prompt length P: prefill P random tokens with the demo's torch path, check one decode
step's logits against that torch path, then time with CUDA events (medians over rounds) (a) the
kernel alone (the barrier fill and the launch, as its generator runs them) at positions P.., and
(b) its generator's whole loop (embedding, fill, launch, argmax) for 128 tokens.

MK_LIB names the library (default libmk.so beside this file). With prepare.sh's libmk_t.so (the
demo's timing records on, as %globaltimer), one more step at each P has its instructions'
timestamps summed up by stage and layer (`stage_profile`); MK_PROFILE_ONLY=1 skips (a) and (b),
and MK_DUMP=FILE appends every instruction's timestamps to FILE, a JSON line a step.
"""
import ctypes, json, os, statistics, sys
import torch
from einops import rearrange

D = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(D, "MK"))
from megakernels.llama import LlamaForCausalLM  # noqa: E402
from megakernels.model_types import BatchState, ExtraModelConfig  # noqa: E402
from megakernels.demos.latency.scheduler import LatencyScheduleBuilder  # noqa: E402
from megakernels.scheduler import assign_to_sms, tensorize_instructions  # noqa: E402

ctypes.CDLL("libcuda.so.1", mode=ctypes.RTLD_GLOBAL)  # libmk.so leaves the driver API unlinked
lib = ctypes.CDLL(os.path.join(D, os.environ.get("MK_LIB", "libmk.so")))
lib.mk_call.restype = ctypes.c_int
lib.mk_call.argtypes = [ctypes.c_void_p] * 4


def mk_args(globs):
    k4 = rearrange(globs.k_cache, "l b t h d -> (l b) t h d")
    v4 = rearrange(globs.v_cache, "l b t h d -> (l b) t h d")
    items = [globs.barriers, globs.instructions, globs.timings, globs.qkv_proj_weights,
             globs.attn_ln_weights, globs.o_proj_weights, globs.mlp_ln_weights,
             globs.up_proj_weights, globs.gate_proj_weights, globs.down_proj_weights,
             globs.lm_head_norm_weights.data, globs.lm_head_weights.data, k4, v4,
             globs.rope_cos, globs.rope_sin, globs.hidden_states, globs.post_ln_rope_q,
             globs.attn_out, globs.attn_lse_intermediates, globs.attn_out_intermediates,
             globs.silu_out, globs.logits, None, globs.attn_scale, globs.rms_norm_eps,
             globs.skip_attn_reduction]
    n = len(items)
    ptrs = (ctypes.c_uint64 * n)()
    shapes = (ctypes.c_int * (4 * n))()
    vals = (ctypes.c_double * n)()
    keep = []
    for i, t in enumerate(items):
        if isinstance(t, torch.Tensor):
            assert t.is_contiguous() and t.is_cuda and t.dim() <= 4
            keep.append(t)
            ptrs[i] = t.data_ptr()
            s = [1] * (4 - t.dim()) + list(t.shape)
            for j in range(4):
                shapes[4 * i + j] = s[j]
        elif t is not None:
            vals[i] = float(t)
    return ptrs, shapes, vals, keep, items.index(None)  # (pos_id's index: set per step)


def main():
    model_dir, out_json = sys.argv[1], sys.argv[2]
    plens = [int(x) for x in sys.argv[3:]] or [32, 512]
    torch.cuda.set_device(0)
    dev = torch.device("cuda:0")
    model = LlamaForCausalLM.from_pretrained(
        model_dir, device="cuda:0", dtype=torch.bfloat16,
        extra_config=ExtraModelConfig(interleave_rope=True, max_len_override=4096, max_batch_size=1))
    schedule = LatencyScheduleBuilder.build(model)
    tensorize_instructions(schedule.globs, assign_to_sms("rr", schedule=schedule))
    globs = schedule.globs
    ptrs, shapes, vals, _keep, POS = mk_args(globs)  # (_keep: the tensors, alive while in use)
    stream = torch.cuda.current_stream()
    sp = ctypes.c_void_p(stream.cuda_stream)

    def step(pos):
        globs.barriers.fill_(0)
        vals[POS] = float(pos)
        rc = lib.mk_call(ptrs, shapes, vals, sp)
        if rc != 0:
            raise RuntimeError(f"mk_call: cuda error {rc}")

    res = {"device": torch.cuda.get_device_name(0), "sm": torch.cuda.get_device_properties(0).multi_processor_count}
    g = torch.Generator(device="cpu").manual_seed(0)
    timed = os.environ.get("MK_PROFILE_ONLY") != "1"
    profiled = os.environ.get("MK_LIB", "").endswith("_t.so")  # (prepare.sh's timing build)
    for P in plens:
        ids = torch.randint(0, model.config.vocab_size, (1, P), generator=g).to(dev)
        with torch.inference_mode():
            out = model(BatchState(input_ids=ids, position_ids=torch.arange(P, device=dev)))
            tok = out.output_ids[:, -1:]
            # reference: the torch path's decode step at position P
            bs = BatchState(input_ids=tok, position_ids=torch.tensor([[P]], device=dev), seq_len=P + 1)
            h = model.model(bs).hidden_states
            ref = model.lm_head.lm_head(model.lm_head.input_norm(h)).float().flatten()
            emb = model.model.embed_tokens(BatchState(input_ids=tok)).hidden_states
            globs.hidden_states[:] = emb.reshape(-1)
            step(P)
            torch.cuda.synchronize()
            got = globs.logits.float().flatten()
        rel = ((got - ref).norm() / ref.norm()).item()
        agree = int(got.argmax().item() == ref.argmax().item())
        r = res[f"P{P}"] = {"logits_rel_err": rel, "argmax_agree": agree}
        line = f"mk P={P}: logits rel err {rel:.3e} argmax {agree}"
        if timed:
            # (a) the kernel alone, 128 launches a round at positions P..P+127
            kern = []
            for _ in range(7):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                for i in range(128):
                    step(P + i)
                e1.record()
                torch.cuda.synchronize()
                kern.append(e0.elapsed_time(e1) / 128)
            # (b) the generator's loop: embedding, fill, kernel, argmax, the token stored
            loop = []
            toks = torch.zeros(1, 129, dtype=torch.long, device=dev)
            toks[:, 0] = tok.flatten()
            with torch.inference_mode():
                for _ in range(5):
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                    for i in range(128):
                        hs = model.model.embed_tokens(BatchState(input_ids=toks[:, i:i + 1])).hidden_states
                        globs.hidden_states[:] = hs.reshape(-1)
                        step(P + i)
                        toks[:, i + 1] = torch.argmax(globs.logits, dim=-1)
                    e1.record()
                    torch.cuda.synchronize()
                    loop.append(e0.elapsed_time(e1) / 128)
            # (the first round of each warms up)
            r.update({"kernel_ms_rounds": [round(x, 4) for x in kern[1:]],
                      "kernel_ms_median": round(statistics.median(kern[1:]), 4),
                      "loop_ms_rounds": [round(x, 4) for x in loop[1:]],
                      "loop_ms_median": round(statistics.median(loop[1:]), 4)})
            line += f"; kernel {r['kernel_ms_median']} ms, loop {r['loop_ms_median']} ms a token"
        print(line, flush=True)
        if profiled:
            globs.timings.zero_()
            step(P)
            torch.cuda.synchronize()
            r["stages"] = stage_profile(globs)
    json.dump(res, open(out_json, "w"), indent=1)


STAGES = {1: "qkv", 2: "attention", 4: "o", 5: "upgate", 6: "down", 7: "head"}


def stage_profile(globs):
    """Per stage kind, us (medians over layers 1..L-2): from the previous stage's last
    instruction end to this stage's last end (`path`), and from its first instruction start to
    its last end (`span`); timestamps are %globaltimer ns mod 2^32 (the shim build's record)."""
    ins = globs.instructions.cpu().long()
    tim = globs.timings.cpu().long() & 0xFFFFFFFF
    rec = tim != 0
    base = tim[rec].min()
    t = (tim - base) % (1 << 32)
    starts = torch.cat([t[..., 5:6], t[..., 11:43:2]], dim=-1)
    srec = torch.cat([rec[..., 5:6], rec[..., 11:43:2]], dim=-1)
    first = torch.where(srec, starts, torch.full_like(starts, 1 << 40)).min(-1).values
    last = torch.where(rec, t, torch.zeros_like(t)).max(-1).values
    if os.environ.get("MK_DUMP"):
        # Every instruction with timestamps: [sm, index, opcode, layer, first start, last event,
        # loader start, loader end, storer end], ns from the step's first event (-1: none).
        rows = []
        for sm in range(ins.shape[0]):
            for i in range(ins.shape[1]):
                op = int(ins[sm, i, 0])
                if op == 0 or not bool(rec[sm, i].any()):
                    continue
                ev = [int(t[sm, i, e]) if bool(rec[sm, i, e]) else -1 for e in (5, 6, 10)]
                rows.append([sm, i, op, int(ins[sm, i, 1]), int(first[sm, i]), int(last[sm, i])] + ev)
        with open(os.environ["MK_DUMP"], "a") as f:
            f.write(json.dumps(rows) + "\n")
    ends, begins = {}, {}
    nl = globs.num_hidden_layers
    for sm in range(ins.shape[0]):
        for i in range(ins.shape[1]):
            op = int(ins[sm, i, 0])
            if op not in STAGES or not bool(rec[sm, i].any()):
                continue
            layer = nl if op == 7 else int(ins[sm, i, 1])
            k = (op, layer)
            ends[k] = max(ends.get(k, 0), int(last[sm, i]))
            begins[k] = min(begins.get(k, 1 << 40), int(first[sm, i]))
    order = [1, 2, 4, 5, 6]
    out = {"kernel_span_us": (max(ends.values()) - min(begins.values())) / 1e3}
    for op in order:
        paths, spans = [], []
        for layer in range(1, nl - 1):
            prev = (order[order.index(op) - 1], layer) if op != 1 else (6, layer - 1)
            if (op, layer) in ends and prev in ends:
                paths.append((ends[(op, layer)] - ends[prev]) / 1e3)
                spans.append((ends[(op, layer)] - begins[(op, layer)]) / 1e3)
        out[STAGES[op]] = {"path_us": round(statistics.median(paths), 2), "span_us": round(statistics.median(spans), 2)}
    if (7, nl) in ends:
        out["head"] = {"path_us": round((ends[(7, nl)] - ends[(6, nl - 1)]) / 1e3, 2)}
    layer_us = [(ends[(6, l)] - ends[(6, l - 1)]) / 1e3 for l in range(1, nl) if (6, l) in ends]
    out["layer_us_median"] = round(statistics.median(layer_us), 2)
    print("mk stages:", json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
