#!/usr/bin/env bash
# CUDA backend checks and measurements on the GPU machine, in one device call:
#   parity: bf16 parity against transformers, llama-3.2-1b and qwen3-0.6b shapes (cuda_parity.py);
#   e2e:    `harrier engine-core --device cuda` on a generated model, loaded with streaming
#           requests by `harrier bench serve --engine-endpoint`, then SIGTERM;
#   bench:  harrier-cuda-tool bench: copy bandwidth, bf16 GEMM, decode step time at batch
#           1/8/32/128 pipelined vs sync with the GPU idle gap, prefill 8 x 2048.
# Build here first (see docs/cuda.md):
#   cargo build --release --bin harrier --bin harrier-cuda-tool && mkdir -p .gpu &&
#   cp target/release/harrier target/release/harrier-cuda-tool .gpu/ && strip .gpu/harrier*
# then call the device with carry [".gpu"] and `bash scripts/gpu/cuda_check.sh`.
# STAGES (default "parity e2e bench") selects stages; BENCH_MODELS (default llama-3.2-1b).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/harrier-cuda-out}"
W=/tmp/harrier-cuda-work
STAGES="${STAGES:-parity e2e bench}"
BENCH_MODELS="${BENCH_MODELS:-llama-3.2-1b}"
. scripts/gpu/common.sh

for st in $STAGES; do
    case "$st" in
    parity)
        for m in llama-3.2-1b qwen3-0.6b; do
            gen "$m"
            timeout 240 python3 scripts/gpu/cuda_parity.py --tool "$T" --model "$W/$m" --work "$W/parity-$m" \
                --json "$OUT/parity_$m.json" 2>>"$OUT/parity.log" | cut -c1-600
        done
        ;;
    e2e)
        gen llama-3.2-1b
        timeout 200 "$H" engine-core --device cuda --model "$W/llama-3.2-1b" --max-num-seqs 64 \
            --endpoint "tcp://127.0.0.1:29555" >"$OUT/e2e.log" 2>&1 &
        epid=$!
        for _ in $(seq 60); do
            grep -q "engine core ready" "$OUT/e2e.log" && break
            sleep 1
        done
        grep -E "CUDA engine configured|ready|rror" "$OUT/e2e.log" | cut -c1-600
        timeout 120 "$H" bench serve --engine-endpoint "tcp://127.0.0.1:29555" --num-prompts 64 --input-len 128 \
            --output-len 64 --no-progress --json "$OUT/e2e_bench.json" 2>&1 | tail -15
        kill -TERM "$epid"
        wait "$epid"
        echo "engine-core exit status $?"
        tail -2 "$OUT/e2e.log" | cut -c1-300
        ;;
    bench)
        for m in $BENCH_MODELS; do
            gen "$m"
            timeout 400 "$T" bench --model "$W/$m" --batches 1,8,32,128 --context 512 --steps 64 \
                --json "$OUT/bench_$m.json" 2>&1 | grep -v "^{" | tee -a "$OUT/bench.log"
        done
        ;;
    esac
done
ls -l "$OUT"
