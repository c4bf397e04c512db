#!/usr/bin/env bash
# CUDA graphs on the GPU machine, in one device call:
#   gemv:      check-gemv: our gemv_bf16 vs cuBLAS on the 1B shapes at 1-8 rows;
#   parity:    bf16 parity against transformers (cuda_parity.py), 1B and 0.6B shapes;
#   parity32:  the same with --dtype float32 on both sides (bar: < 1e-4, identical greedy);
#   penalties: check-penalties: device penalties vs the host sampler, resumed rows included;
#   sampling:  check-sampling: chi-square of the GPU sampler's distributions;
#   attention: check-attention (f64 reference, now with graph padding rows: must read nothing
#              and write zeros);
#   graphs:    check-graphs on the llama-3.2-1b and qwen3-0.6b shapes: greedy tokens with graphs
#              == eager through the real scheduler (batches 1/3/5/8/17/33, churn, oversize);
#   bench:     harrier-cuda-tool bench: decode graphs vs eager x async vs sync at BATCHES,
#              capture time and graph memory, prefill 8 x 2048 (LONG_BATCHES: also 4,096 keys);
#   offline:   1,000 x (1,024 in, 512 out) through the engine core, graphs on and off;
#   profile:   per-kernel GPU time (ncu) of the decode steps at batch 1 and 32.
# Build and carry .gpu/ as for cuda_check.sh. STAGES (default "attention graphs bench"),
# BENCH_MODELS (default llama-3.2-1b), BATCHES (default 1,8,32,128,256).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/harrier-graphs-out}"
W=/tmp/harrier-graphs-work
STAGES="${STAGES:-attention graphs bench}"
BENCH_MODELS="${BENCH_MODELS:-llama-3.2-1b}"
BATCHES="${BATCHES:-1,8,32,128,256}"
. scripts/gpu/common.sh

for st in $STAGES; do
    case "$st" in
    attention)
        timeout 120 "$T" check-attention --cases 48 2>&1 | tail -4 | tee "$OUT/attention.txt"
        ;;
    gemv)
        gen llama-3.2-1b
        timeout 200 "$T" check-gemv --model "$W/llama-3.2-1b" --json "$OUT/gemv.json" 2>&1 | tee "$OUT/gemv.txt"
        ;;
    offline)
        # The offline workload (N prompts of 1,024 random tokens, 512 out, ignore EOS, all at
        # once) through `harrier bench serve --engine-endpoint`, CUDA graphs on and
        # --enforce-eager; OFFLINE_EAGER lists the models that also run eagerly.
        for m in ${OFFLINE_MODELS:-llama-3.2-1b}; do
            gen "$m"
            for mode in graphs eager; do
                extra=""
                if [[ $mode == eager ]]; then
                    [[ " ${OFFLINE_EAGER:-llama-3.2-1b} " == *" $m "* ]] || continue
                    extra="--enforce-eager"
                fi
                "$H" engine-core --model "$W/$m" --device cuda --endpoint tcp://127.0.0.1:5601 \
                    --max-num-seqs 256 --max-num-batched-tokens 8192 $extra 2>"$OUT/offline_${m}_$mode.err" &
                E=$!
                for _ in $(seq 1 240); do grep -q "engine core ready" "$OUT/offline_${m}_$mode.err" && break; sleep 0.5; done
                echo "== offline $m, $mode: ${OFFLINE_N:-1000} x 1024 in, 512 out"
                timeout 400 "$H" bench serve --engine-endpoint tcp://127.0.0.1:5601 --num-prompts "${OFFLINE_N:-1000}" \
                    --input-len 1024 --output-len 512 --no-progress --json "$OUT/offline_${m}_$mode.json" 2>&1 | grep -iE "throughput|duration|successful|TTFT|P50 ITL"
                kill -TERM "$E"
                wait "$E"
                grep -o "cuda_graphs=[0-9]*.*graph_mib=[0-9.\"]*" "$OUT/offline_${m}_$mode.err" | head -1
            done
        done
        ;;
    profile)
        # Per-kernel GPU time of the bench's decode steps (ncu; PROFILE_BATCHES, default 1 and
        # 32; graph replays only: 8 decode steps each, 4 warm-up + 4; the context's prefill
        # and a 16-token prefill are in the log too).
        gen llama-3.2-1b
        for b in ${PROFILE_BATCHES:-1 32}; do
            timeout 300 ncu --clock-control none --metrics gpu__time_duration.sum --csv \
                "$T" bench --model "$W/llama-3.2-1b" --batches $b --context 512 --steps 4 --modes graph-async \
                --prefill-seqs 1 --prefill-len 16 >"$OUT/ncu_$b.csv" 2>/dev/null
            python3 scripts/gpu/ncu_summary.py "$OUT/ncu_$b.csv" 8 "batch $b" | tee "$OUT/ncu_$b.txt"
        done
        ;;
    parity | parity32)
        dt=bfloat16
        [[ $st == parity32 ]] && dt=float32
        for m in llama-3.2-1b qwen3-0.6b; do
            gen "$m"
            timeout 240 python3 scripts/gpu/cuda_parity.py --tool "$T" --model "$W/$m" --work "$W/$st-$m" \
                --dtype $dt --rel-bar 2e-2 --json "$OUT/${st}_$m.json" 2>>"$OUT/parity.log" | cut -c1-420
        done
        ;;
    penalties | sampling)
        gen llama-3.2-1b
        timeout 200 "$T" check-$st --model "$W/llama-3.2-1b" 2>>"$OUT/checks.log" | tee "$OUT/$st.txt"
        ;;
    graphs)
        for m in llama-3.2-1b qwen3-0.6b; do
            gen "$m"
            echo "== check-graphs $m"
            timeout 300 "$T" check-graphs --model "$W/$m" 2>"$OUT/graphs_$m.err" | tee "$OUT/graphs_$m.txt"
            grep -E "CUDA engine configured" "$OUT/graphs_$m.err" | sed 's/\x1b\[[0-9;]*m//g' | cut -c1-700
        done
        ;;
    bench)
        for m in $BENCH_MODELS; do
            gen "$m"
            timeout 500 "$T" bench --model "$W/$m" --batches "$BATCHES" --context 512 --steps 64 \
                --json "$OUT/bench_$m.json" 2>&1 | grep -v "^{" | cut -c1-400 | tee -a "$OUT/bench.log"
            if [[ -n "${LONG_BATCHES:-}" ]]; then # long contexts: split decode attention
                timeout 300 "$T" bench --model "$W/$m" --batches "$LONG_BATCHES" --context 4096 --steps 32 \
                    --prefill-seqs 1 --prefill-len 16 --json "$OUT/bench_long_$m.json" 2>&1 | grep -v "^{" \
                    | grep -v "^prefill" | cut -c1-400 | tee -a "$OUT/bench.log"
            fi
        done
        ;;
    esac
done
ls -l "$OUT"
