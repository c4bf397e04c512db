#!/usr/bin/env python3
"""FP8 checkpoints written by compressed-tensors itself (the library llm-compressor saves
with), for tests/fp8_checkpoints: Harrier must read them as the library means them.

Needs torch and compressed-tensors (`pip install torch compressed-tensors safetensors`); not
run in CI (the outputs are committed). Usage:

    harrier gen-model --preset micro --out /tmp/micro --seed 5 --no-tokenizer
    python3 scripts/fp8_fixtures.py /tmp/micro tests/fixtures/fp8

For each strategy (channel, block 32 x 32) it quantizes every projection of the model with
compressed-tensors' own scale rule and compressor, writes the checkpoint (config.json with the
library's quantization_config, model.safetensors), then decompresses each weight with the
library and records, per tensor, the sum and the sum of squares of the dequantized values
(float64) and its first eight values in `expected.json`.
"""
import json
import shutil
import sys
from pathlib import Path

import torch
from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
from compressed_tensors.quantization.utils.helpers import calculate_qparams
from safetensors.torch import load_file, save_file

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def scheme(strategy):
    args = dict(num_bits=8, type="float", strategy=strategy, symmetric=True, dynamic=False)
    if strategy == "block":
        args["block_structure"] = [32, 32]
    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**args))


def scales_of(w, s):
    """The library's scale rule (min/max observer) for weight `w` under scheme `s`."""
    a = s.weights
    if a.strategy == "channel":
        mn, mx = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
    else:
        br, bc = a.block_structure
        n, k = w.shape
        blocks = w.reshape(n // br, br, k // bc, bc)
        mn, mx = blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))
    scale, _ = calculate_qparams(mn, mx, a)
    return scale


def main(src, out_root):
    src, out_root = Path(src), Path(out_root)
    tensors = load_file(src / "model.safetensors")
    for strategy in ("channel", "block"):
        s = scheme(strategy)
        out = out_root / strategy
        out.mkdir(parents=True, exist_ok=True)
        result, expected = {}, {}
        for name, w in tensors.items():
            module = name.removesuffix(".weight")
            if not module.endswith(PROJ):
                result[name] = w
                continue
            state = {"weight": w, "weight_scale": scales_of(w, s)}
            comp = FloatQuantizationCompressor.compress(state, s)
            result[name] = comp["weight"].contiguous()
            result[module + ".weight_scale"] = comp["weight_scale"].contiguous()
            deq = FloatQuantizationCompressor.decompress(comp, s)["weight"].to(torch.float64)
            expected[name] = {
                "sum": deq.sum().item(),
                "sum_sq": (deq * deq).sum().item(),
                "first": deq.flatten()[:8].tolist(),
                "dtype": str(comp["weight"].dtype),
                "scale_shape": list(comp["weight_scale"].shape),
            }
        save_file(result, out / "model.safetensors", metadata={"format": "pt"})
        config = json.loads((src / "config.json").read_text())
        qc = QuantizationConfig(
            config_groups={"group_0": s},
            format="float-quantized",
            quantization_status="compressed",
            ignore=["lm_head"],
        )
        config["quantization_config"] = qc.model_dump(exclude_none=False)
        (out / "config.json").write_text(json.dumps(config, indent=2, default=str))
        if (src / "generation_config.json").exists():
            shutil.copy(src / "generation_config.json", out / "generation_config.json")
        (out / "expected.json").write_text(json.dumps(expected, indent=1))
        print(f"{out}: {len(expected)} FP8 weights")


if __name__ == "__main__":
    main(*sys.argv[1:])
