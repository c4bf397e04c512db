#!/usr/bin/env bash
# Trains model families on the GPU machine (scripts/train/), in one device call.
#   cpu:       the CPU family (BPE tokenizer, harrier-cpu and harrier-cpu-draft), then its
#              transformers fp32 fixtures on the held-out prompts (parity_fixtures.py), packed
#              into $OUT for committing (engine-core/models/, tests/fixtures/);
#   gpu:       the GPU family (Llama 3 tokenizer: carry .gpu/llama3/tokenizer.json, copied from
#              $HARRIER_HOME/llama3/ after scripts/setup.sh); ONLY=a,b trains a subset;
#   gpu-smoke: the GPU family at 3% of its steps into a scratch folder (times and a path check).
# Models stay in $W (default /tmp/harrier-train) for a following call on the same machine.
# STAGES (default "cpu").
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/harrier-train-out}"
W="${W:-/tmp/harrier-train}"
LLAMA3="${LLAMA3:-.gpu/llama3/tokenizer.json}"
export PYTHONUNBUFFERED=1
mkdir -p "$OUT" "$W"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
status=0

for st in ${STAGES:-cpu}; do
    case "$st" in
    cpu)
        python3 scripts/train/train.py --family cpu --out "$W/cpu" 2>&1 | tee -a "$OUT/train.log" || status=1
        python3 scripts/gpu/parity_fixtures.py --out "$OUT" --prompts "$W/cpu/heldout_prompts.json" \
            "harrier-cpu:-:$W/cpu/harrier-cpu" "harrier-cpu-draft:-:$W/cpu/harrier-cpu-draft" 2>&1 |
            tee -a "$OUT/train.log" || status=1
        for m in harrier-cpu harrier-cpu-draft; do
            tar -C "$W/cpu" --exclude .done -cf "$OUT/$m.tar" "$m" || status=1
        done
        cp "$W/cpu/report.json" "$OUT/report_cpu.json"
        ;;
    gpu)
        python3 scripts/train/train.py --family gpu --out "$W/gpu" --llama3-tokenizer "$LLAMA3" \
            ${ONLY:+--only "$ONLY"} 2>&1 | tee -a "$OUT/train.log" || status=1
        cp "$W/gpu/report.json" "$OUT/report_gpu.json"
        ;;
    gpu-smoke)
        rm -rf "$W/smoke"
        python3 scripts/train/train.py --family gpu --out "$W/smoke" --llama3-tokenizer "$LLAMA3" \
            --steps-scale 0.03 2>&1 | tee -a "$OUT/train.log" || status=1
        cp "$W/smoke/report.json" "$OUT/report_smoke.json"
        rm -rf "$W/smoke"
        ;;
    *)
        echo "train.sh: unknown stage $st" >&2
        status=2
        ;;
    esac
done
ls -l "$OUT"
exit $status
