#!/usr/bin/env bash
# Device script (issue 16): FP8 skinny steps of 2-8 rows with the fused path's residual adds
# and deferred norms (`HARRIER_FP8_FUSED=1`, the FP8 `_dn` instances of session 32), checked
# and timed against the same with the norm prologues (`HARRIER_DEFERRED_NORM=0`) and against
# the default FP8 plan (no fusions). Carry .gpu-z with scripts/gpu/binab.sh's compressed
# `harrier` and `harrier-cuda-tool`; output in $OUT (check.log, ab2.log).
#   bash scripts/gpu/fp8_fused_check.sh [PRESET ...]   (default llama-3.2-1b llama-3.2-3b)
set -uo pipefail
. scripts/gpu/binab.sh
models=("$@")
[[ ${#models[@]} -eq 0 ]] && models=(llama-3.2-1b llama-3.2-3b)
F="--quantization fp8"
for m in "${models[@]}"; do
    gen "$m"
    # The fused FP8 steps against the unfused FP8 launches (check-fused's bar, as for bf16).
    for v in "HARRIER_FP8_FUSED=1" "HARRIER_FP8_FUSED=1 HARRIER_DEFERRED_NORM=0"; do
        echo "== check-fused $m $v" | tee -a "$OUT/check.log"
        env $v timeout 300 "$NEW" check-fused --model "$W/$m" --batches 2,4,8 $F 2>&1 \
            | grep -E "^\| [0-9]|worst|Error" | tee -a "$OUT/check.log"
    done
    el "check $m"
    for r in 1 2; do
        B "default" "$NEW" "$m" 2,4,8 graph-async $F
        HARRIER_FP8_FUSED=1 B "deferred" "$NEW" "$m" 2,4,8 graph-async $F
        HARRIER_FP8_FUSED=1 HARRIER_DEFERRED_NORM=0 B "prologue" "$NEW" "$m" 2,4,8 graph-async $F
    done
    el "bench $m"
done
