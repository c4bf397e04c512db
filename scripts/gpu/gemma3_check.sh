#!/usr/bin/env bash
# Gemma 3 on the GPU machine (issue 15), in one device call:
#   fixtures:  micro-gemma3 (seed 5) through transformers fp32 -> $OUT/parity_micro-gemma3.json
#              for tests/parity.rs (window 32: the prompts of 100 and 200 tokens cross it);
#   parity32:  CUDA fp32 vs transformers fp32 (bar < 1e-4, identical greedy): micro-gemma3, and
#              the gemma-3-1b shape on prompts of 1, 700 and 2,000 tokens (window 512), 16
#              decode steps past them;
#   parity:    the same gemma-3-1b prompts in bf16 (random weights: --rel-bar 2e-2);
#   attention: check-attention, 70 cases (ten at head dim 256, windows up to 600);
#   graphs:    check-graphs on the gemma-3-1b shape (graphs == eager through the scheduler);
#   train:     trains trained-gemma3-150m (scripts/train, Llama 3 tokenizer: carry
#              .gpu/llama3/tokenizer.json) and checks bf16 fidelity on its held-out prompts;
#   bench:     harrier-cuda-tool bench on gemma-3-1b, batches BATCHES, context 512;
#   chunked:   micro-gemma3 fp32 on CUDA with 64-token steps (chunked prefill across the
#              window) vs the CPU;
#   gemmrows:  check-gemm-rows on gemma-3-1b and llama-3.2-1b (does cuBLAS round a row alike
#              at M rows and padded to 48?);
#   hybrid:    window-sized KV for the sliding layers on CUDA: micro-gemma3 in fp32 served by
#              CUDA (own sliding pool) vs the CPU, and CUDA vs CUDA with
#              --disable-hybrid-kv-cache-manager (scripts/gpu/hybrid_check.py: prompts of up to
#              700 tokens, window 32, prefix-cache hits), then check-graphs on gemma-3-1b (the
#              real scheduler with both pools);
#   capacity:  gemma-3-1b bf16, 256 requests of 8,000 tokens in and CAP_OUT (512) out through
#              `harrier bench serve`, with and without window-sized KV
#              (--max-model-len 8704, --gpu-memory-utilization CAP_UTIL (0.4) so that full KV cannot hold them all): the start-up
#              log's KV capacity per attention type and the throughput.
# Build and carry .gpu/ as for cuda_check.sh. STAGES (default: all but train and bench).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/harrier-gemma3-out}"
W=/tmp/harrier-gemma3-work
STAGES="${STAGES:-fixtures parity32 parity attention graphs}"
BATCHES="${BATCHES:-1,8,32,128,256}"
LLAMA3="${LLAMA3:-.gpu/llama3/tokenizer.json}"
. scripts/gpu/common.sh

long_prompts() { # vocab -> $W/long_prompts.json
    python3 -c "
import json, random
r = random.Random(15)
json.dump([[r.randrange($1) for _ in range(n)] for n in (1, 700, 2000)], open('$W/long_prompts.json', 'w'))"
}

serve() { # name port args...: harrier serve of $W/micro-gemma3-f32 in the background
    local name=$1 port=$2; shift 2
    "$H" serve "$W/micro-gemma3-f32" --port "$port" "$@" >"$W/$name.out" 2>"$W/$name.err" &
    echo $! >"$W/$name.pid"
    for _ in $(seq 1 240); do grep -q "Harrier is serving" "$W/$name.out" && return 0; sleep 0.5; done
    echo "$name did not start"; tail -5 "$W/$name.err"
}

micro_f32() { # micro-gemma3 in fp32 with a tokenizer
    "$H" gen-model --preset micro-gemma3 --seed 5 --out "$W/micro-gemma3-f32" --no-tokenizer 2>>"$OUT/gen.log"
    cp .gpu/tokenizer.json "$W/micro-gemma3-f32/" 2>/dev/null ||
        gunzip -c .gpu/llama3-tokenizer.json.gz >"$W/micro-gemma3-f32/tokenizer.json"
}

for st in $STAGES; do
    echo "== $st"
    case "$st" in
    fixtures)
        "$H" gen-model --preset micro-gemma3 --seed 5 --out "$W/micro-gemma3-f32" --no-tokenizer 2>>"$OUT/gen.log"
        timeout 300 python3 scripts/gpu/parity_fixtures.py --out "$OUT" "micro-gemma3:5:$W/micro-gemma3-f32" 2>&1 |
            tail -3
        ;;
    parity32)
        gen micro-gemma3
        timeout 240 python3 scripts/gpu/cuda_parity.py --tool "$T" --model "$W/micro-gemma3" --dtype float32 \
            --work "$W/p32-micro" --json "$OUT/parity32_micro-gemma3.json" 2>>"$OUT/parity.log" | cut -c1-700
        gen gemma-3-1b
        long_prompts 262144
        timeout 400 python3 scripts/gpu/cuda_parity.py --tool "$T" --model "$W/gemma-3-1b" --dtype float32 \
            --prompts "$W/long_prompts.json" --work "$W/p32-1b" --json "$OUT/parity32_gemma-3-1b.json" \
            2>>"$OUT/parity.log" | cut -c1-700
        ;;
    parity)
        gen gemma-3-1b
        long_prompts 262144
        timeout 300 python3 scripts/gpu/cuda_parity.py --tool "$T" --model "$W/gemma-3-1b" --rel-bar 2e-2 \
            --prompts "$W/long_prompts.json" --work "$W/p16-1b" --json "$OUT/parity_gemma-3-1b.json" \
            2>>"$OUT/parity.log" | cut -c1-700
        ;;
    attention)
        timeout 180 "$T" check-attention --cases 70 2>&1 | tail -4 | tee "$OUT/attention.txt"
        ;;
    graphs)
        for m in ${GRAPH_MODELS:-gemma-3-1b}; do
            gen "$m"
            echo "-- $m"
            timeout 300 "$T" check-graphs --model "$W/$m" 2>&1 | grep -E "identical|Error|check-graphs" | tee -a "$OUT/graphs.txt"
        done
        ;;
    train)
        timeout 480 python3 scripts/train/train.py --family gpu --out "$W/train" --llama3-tokenizer "$LLAMA3" \
            --only trained-gemma3-150m 2>&1 | tail -12 | tee "$OUT/train.log"
        timeout 240 python3 scripts/gpu/cuda_parity.py --tool "$T" --model "$W/train/trained-gemma3-150m" \
            --prompts "$W/train/heldout_prompts.json" --work "$W/fid" --json "$OUT/fidelity_gemma3.json" \
            2>>"$OUT/parity.log" | cut -c1-700
        ;;
    hybrid)
        micro_f32
        # Two CUDA servers share the GPU (the utilisation counts what the first took).
        serve cpu 8151 --device cpu
        serve cuda 8152 --device cuda --dtype float32 --gpu-memory-utilization 0.3
        serve cudafull 8153 --device cuda --dtype float32 --gpu-memory-utilization 0.6 --disable-hybrid-kv-cache-manager
        sed 's/\x1b\[[0-9;]*m//g' "$W/cuda.err" | grep -o "sliding_layers_kv_blocks=[0-9]*" | head -1
        echo "-- CUDA hybrid vs CPU hybrid"
        python3 scripts/gpu/hybrid_check.py --base http://127.0.0.1:8152 --reference http://127.0.0.1:8151 2>&1 | tail -2
        echo "-- CUDA hybrid vs CUDA full KV"
        python3 scripts/gpu/hybrid_check.py --base http://127.0.0.1:8152 --reference http://127.0.0.1:8153 2>&1 | tail -2
        kill -TERM $(cat "$W/cpu.pid" "$W/cuda.pid" "$W/cudafull.pid"); wait
        gen gemma-3-1b
        [[ -n "${SKIP_GRAPHS:-}" ]] || timeout 300 "$T" check-graphs --model "$W/gemma-3-1b" 2>&1 | grep -E "identical|Error|check-graphs" | tee "$OUT/graphs_hybrid.txt"
        ;;
    chunked)
        # CUDA with 64-token steps (prompts of up to 700 tokens prefill in chunks that cross
        # the window of 32) against the CPU with whole prompts.
        micro_f32
        serve cpu 8161 --device cpu
        serve cuda 8162 --device cuda --dtype float32 --gpu-memory-utilization 0.3 --max-num-seqs 16 --max-num-batched-tokens 64
        echo "-- CUDA hybrid, 64-token chunks vs CPU"
        python3 scripts/gpu/hybrid_check.py --base http://127.0.0.1:8162 --reference http://127.0.0.1:8161 2>&1 | tail -2
        kill -TERM $(cat "$W/cpu.pid" "$W/cuda.pid"); wait
        ;;
    gemmrows)
        for m in gemma-3-1b llama-3.2-1b; do
            gen "$m"
            echo "-- $m"
            timeout 120 "$T" check-gemm-rows --model "$W/$m" --pad 48 2>&1 | tail -42
        done
        ;;
    capacity)
        gen gemma-3-1b
        for mode in window full; do
            extra=""; [[ $mode == full ]] && extra="--disable-hybrid-kv-cache-manager"
            "$H" engine-core --model "$W/gemma-3-1b" --device cuda --endpoint tcp://127.0.0.1:5611 --max-num-seqs 256 \
                --max-num-batched-tokens 8192 --max-model-len 8704 --gpu-memory-utilization ${CAP_UTIL:-0.4} $extra 2>"$OUT/cap_$mode.err" &
            E=$!
            for _ in $(seq 1 240); do grep -q "engine core ready" "$OUT/cap_$mode.err" && break; sleep 0.5; done
            echo "== capacity, $mode KV"
            grep -o "kv_blocks=[0-9]*\|kv_tokens=[0-9]*\|kv_mib=[0-9]*\|sliding_layers_kv_blocks=[0-9]*\|sliding_layers_kv_mib=[0-9]*" "$OUT/cap_$mode.err" | tr '\n' ' '; echo
            timeout 280 "$H" bench serve --engine-endpoint tcp://127.0.0.1:5611 --num-prompts 256 --input-len 8000 \
                --output-len "${CAP_OUT:-512}" --no-progress --json "$OUT/cap_$mode.json" 2>&1 | grep -iE "throughput|duration|successful|TTFT"
            kill -TERM "$E"; wait "$E"
        done
        ;;
    bench)
        gen gemma-3-1b
        timeout 400 "$T" bench --model "$W/gemma-3-1b" --batches "$BATCHES" --context 512 --steps 64 \
            --json "$OUT/bench_gemma-3-1b.json" 2>&1 | grep -v "^{" | tee -a "$OUT/bench.log"
        ;;
    esac
done
ls -l "$OUT"
