#!/usr/bin/env bash
# Device script (issue 16): FP8 skinny steps with the fused path's residual adds and deferred
# norms (the FP8 `_dn` instances; the default since session 33), checked against the unfused
# FP8 launches (check-fused, check-graphs) and timed against the plain FP8 skinny kernels
# (`HARRIER_FP8_FUSED=0`) and against the norm prologues (`HARRIER_DEFERRED_NORM=0`). Carry
# .gpu-z with scripts/gpu/binab.sh's compressed `harrier` and `harrier-cuda-tool`; output in
# $OUT (check.log, ab2.log).
#   bash scripts/gpu/fp8_fused_check.sh [PRESET ...]   (default llama-3.2-1b qwen3-0.6b llama-3.2-3b)
set -uo pipefail
. scripts/gpu/binab.sh
models=("$@")
[[ ${#models[@]} -eq 0 ]] && models=(llama-3.2-1b qwen3-0.6b llama-3.2-3b)
F="--quantization fp8"
BATCHES=1,2,3,4,5,8
for m in "${models[@]}"; do
    gen "$m"
    # The fused FP8 steps against the unfused FP8 launches (check-fused's bar, as for bf16).
    echo "== check-fused $m" | tee -a "$OUT/check.log"
    timeout 300 "$NEW" check-fused --model "$W/$m" --batches $BATCHES $F 2>&1 \
        | grep -E "^\| [0-9]|worst|Error" | tee -a "$OUT/check.log"
    echo "== check-graphs $m" | tee -a "$OUT/check.log"
    timeout 300 "$NEW" check-graphs --model "$W/$m" --fused-max-rows 8 $F 2>&1 | tail -10 \
        | tee -a "$OUT/check.log"
    el "check $m"
    for r in 1 2; do
        B "fused" "$NEW" "$m" $BATCHES graph-async $F
        HARRIER_FP8_FUSED=0 B "plain" "$NEW" "$m" $BATCHES graph-async $F
        HARRIER_DEFERRED_NORM=0 B "prologue" "$NEW" "$m" $BATCHES graph-async $F
    done
    el "bench $m"
done
