#!/usr/bin/env bash
# Parity fixtures for tests/parity.rs, computed by transformers on the GPU machine.
#
# Runs there with the release binary carried in .gpu/ (see ../shared/GPU.md; here:
# `cargo build --release --bin harrier && mkdir -p .gpu && cp target/release/harrier .gpu/ &&
# strip .gpu/harrier`, then call the device with carry [".gpu"] and `bash scripts/gpu/parity.sh`):
#   generates micro, micro-qwen3 and tiny with fixed seeds (the seeds are recorded in the
#   fixtures, which tests/parity.rs regenerates from), runs scripts/gpu/parity_fixtures.py
#   (float32, TF32 off), and writes $OUT/parity_<preset>.json plus a log.
# Then commit $OUT/parity_*.json into tests/fixtures/.
set -euo pipefail
cd "$(dirname "$0")/../.."

HARRIER="${HARRIER:-.gpu/harrier}"
OUT="${OUT:-/tmp/harrier-parity-out}"
PRESETS=("micro:1" "micro-qwen3:2" "tiny:3")

[[ -x "$HARRIER" ]] || { echo "parity.sh: $HARRIER not found (build it and carry .gpu/)" >&2; exit 1; }
mkdir -p "$OUT"
work="$(mktemp -d /tmp/harrier-parity.XXXXXX)"
trap 'rm -rf "$work"' EXIT

models=()
for ps in "${PRESETS[@]}"; do
    preset="${ps%%:*}"
    seed="${ps##*:}"
    "$HARRIER" gen-model --preset "$preset" --seed "$seed" --out "$work/$preset" --no-tokenizer
    models+=("$preset:$seed:$work/$preset")
done

python3 scripts/gpu/parity_fixtures.py --out "$OUT" "${models[@]}" 2>&1 | tee "$OUT/parity.log"
ls -l "$OUT"
