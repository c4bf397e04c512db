#!/usr/bin/env bash
# bf16 fidelity on trained weights, in one device call (training included):
#   1. trains MODELS of the GPU family (scripts/train/train.py; models already in $W/gpu from an
#      earlier call on the same machine are kept);
#   2. for each, cuda_parity.py on the trainer's 16 held-out prompts x 32 greedy tokens:
#      bf16: Harrier bf16 vs transformers bf16 (same greedy on >= 14/16) and both against
#            transformers fp32 (Harrier's agreement >= transformers bf16's);
#      fp32: Harrier fp32 vs transformers fp32 (identical tokens, logits within 1e-4).
# Carry .gpu/ (harrier-cuda-tool and llama3/tokenizer.json). MODELS (default the 1B shape, the
# 174M Llama and the Qwen3), STEPS (default 32).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/harrier-fidelity-out}"
W="${W:-/tmp/harrier-train}"
T=.gpu/harrier-cuda-tool
MODELS="${MODELS:-trained-llama-1b trained-llama-174m trained-qwen3-155m}"
export PYTHONUNBUFFERED=1 HARRIER_HOME="$W/home"
mkdir -p "$OUT" "$W"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"

python3 scripts/train/train.py --family gpu --out "$W/gpu" --llama3-tokenizer .gpu/llama3/tokenizer.json \
    --only "$(echo $MODELS | tr ' ' ,)" 2>&1 | tee -a "$OUT/train.log" | grep -vE "step [0-9]+/"
cp "$W/gpu/report.json" "$OUT/report_gpu.json"

status=0
for m in $MODELS; do
    for dt in bfloat16 float32; do
        timeout 240 python3 scripts/gpu/cuda_parity.py --tool "$T" --model "$W/gpu/$m" --work "$W/fid-$dt-$m" \
            --dtype $dt --steps "${STEPS:-32}" --prompts "$W/gpu/heldout_prompts.json" \
            --json "$OUT/fidelity_${dt}_$m.json" 2>>"$OUT/parity.log" >/dev/null || status=1
    done
done
python3 - "$OUT" $MODELS <<'PY'
import json, os, sys
out = sys.argv[1]
print(f"{'model':22s} {'dtype':9s} {'same/HF':>8s} {'ours=fp32':>9s} {'HF=fp32':>8s} {'tok ours~fp32':>13s} {'tok HF~fp32':>11s} {'max rel':>9s} pass")
for m in sys.argv[2:]:
    for dt in ("bfloat16", "float32"):
        p = os.path.join(out, f"fidelity_{dt}_{m}.json")
        if not os.path.exists(p):
            print(f"{m:22s} {dt:9s} (no result; see parity.log)")
            continue
        r = json.load(open(p))
        print(f"{m:22s} {dt:9s} {r['prompts_same_greedy']:>4d}/{r['prompts']:<3d} {r['ours_same_as_hf_fp32']:>9d} "
              f"{r['hf_same_as_hf_fp32']:>8d} {r['tokens_ours_vs_hf_fp32']:>13d} {r['tokens_hf_vs_hf_fp32']:>11d} "
              f"{r['max_rel_err']:>9.2e} {r['pass']}")
PY
exit $status
