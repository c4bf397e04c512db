#!/usr/bin/env bash
# The fused small-batch decode path (issue 16) on the GPU machine, in one device call:
#   gemv:    check-gemv on the llama-3.2-1b shapes (and GEMV_MODELS): cuBLAS, gemv_bf16 and
#            skinny_gemm side by side at 1-64 rows, and the fused launch the engine makes;
#   fused:   check-fused (fused path vs unfused, same prompts, graphs on) on FUSED_MODELS;
#   graphs:  check-graphs on llama-3.2-1b (graphs == eager through the scheduler) with the fused
#            path on (--fused-max-rows FUSED_ROWS) and with FP8 weights;
#   fp8:     check-fp8 on llama-3.2-1b (FP8 kernels bit-exact / vs cuBLAS, timed; bf16 vs FP8
#            model) and on the trained embedded model (engine-core/models/harrier-cpu);
#   fp8ckpt: harrier quantize llama-3.2-1b, then bench the FP8 checkpoint at batch 1 and 64;
#   fp8trained: trains trained-llama-1b (scripts/train, a few minutes; carry the Llama 3
#            tokenizer as .gpu/llama3-tokenizer.json.gz, which keeps the carry under 64 MiB,
#            or as .gpu/llama3/tokenizer.json) and runs check-fp8's model part on it
#            (the issue's accuracy on a trained checkpoint: greedy agreement, logprob error);
#   parity:  bf16 CUDA vs transformers bf16 on llama-3.2-1b (8 prompts in one batch, the
#            default path; check-fused compares the fused path with the unfused one), --rel-bar 2e-2;
#   fp8gemm: the FP8 tensor-core GEMM route of large FP8 steps (cuBLASLt, per-token activation
#            scales): check-fp8's kernel part at LT_ROWS (bit-exact activation quantization,
#            output vs an f64 reference, timing vs cuBLAS bf16 and dequantize + cuBLAS), then
#            bench bf16 / FP8 with HARRIER_FP8_GEMM=0 / FP8 at FP8_BATCHES side by side, and
#            check-graphs with FP8 weights (its batches past 16 rows take the route);
#   pdl:     programmatic dependent launch on and off (HARRIER_PDL=1/0) side by side: bench
#            graph-async and graph-async-unfused (--fused-max-rows FUSED_ROWS) on BENCH_MODELS
#            at BATCHES, then FP8 at FP8_BATCHES (default 1,16,32,64);
#   profile: per-kernel GPU time (ncu) of batch-1 decode steps, fused and unfused
#            (PROFILE_MODES, default both; NCU_CACHE=none keeps the caches warm between
#            kernels, as in a real step; default all: every kernel starts cold);
#   ab:      side by side, alternating: bench graph-async on BENCH_MODELS at BATCHES under each of
#            AB_SETS (space-separated LABEL:VAR=V,VAR=V entries; default: "old" with this
#            session's kernel switches off, "new" with the defaults; one switch alone, e.g.
#            "off:HARRIER_ROPE_EPILOGUE=0 on:"), AB_ROUNDS times (default 2), bf16 then FP8
#            (BENCH_FP8=0 skips FP8);
#   bench:   harrier-cuda-tool bench, graph-async with and without the fused path side by side,
#            on BENCH_MODELS at BATCHES, context 512; then the same with FP8 weights
#            (BENCH_FP8=0 skips them).
# Build and carry .gpu/ as for cuda_check.sh. STAGES (default: gemv fused graphs fp8); FUSED_ROWS
# (default 16, the engine's) is the fused path's row limit for check-fused and bench (both paths side
# by side).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/harrier-latency-out}"
W=/tmp/harrier-latency-work
STAGES="${STAGES:-gemv fused graphs fp8}"
BATCHES="${BATCHES:-1,4,8,16,64}"
. scripts/gpu/common.sh

# decode_bench LOG MODEL BATCHES ARGS...: harrier-cuda-tool bench of $W/MODEL at BATCHES
# (context 512, 64 steps) with ARGS, its decode and prefill lines appended to LOG. Set
# HARRIER_PDL / HARRIER_FP8_GEMM in the environment of the call to compare.
decode_bench() {
    local log=$1 model=$2 batches=$3
    shift 3
    timeout 400 "$T" bench --model "$W/$model" --batches "$batches" --context 512 --steps 64 "$@" 2>&1 \
        | grep -E "^decode|^prefill|Error" | tee -a "$log"
}

for st in $STAGES; do
    echo "== $st"
    case "$st" in
    gemv)
        for m in ${GEMV_MODELS:-llama-3.2-1b}; do
            gen "$m"
            timeout 200 "$T" check-gemv --model "$W/$m" --rows ${GEMV_ROWS:-1,8,16} ${VARIANTS:+--variants $VARIANTS} --json "$OUT/gemv_$m.json" 2>&1 | tee -a "$OUT/gemv.txt" | grep -v "^|---"
        done
        ;;
    fused)
        for m in ${FUSED_MODELS:-llama-3.2-1b gemma-3-1b qwen3-0.6b}; do
            gen "$m"
            echo "-- $m"
            timeout 200 "$T" check-fused --model "$W/$m" --batches "${FUSED_BATCHES:-1,2,3,8,13,16}" --fused-max-rows "${FUSED_ROWS:-16}" 2>&1 | grep -E "^\||worst|Error" | tee -a "$OUT/fused.txt"
        done
        ;;
    graphs)
        gen llama-3.2-1b
        echo "-- fused path (--fused-max-rows ${FUSED_ROWS:-16})" | tee -a "$OUT/graphs.txt"
        timeout 300 "$T" check-graphs --model "$W/llama-3.2-1b" --fused-max-rows "${FUSED_ROWS:-16}" 2>&1 | grep -E "identical|Error|check-graphs" | tee -a "$OUT/graphs.txt"
        echo "-- FP8 weights" | tee -a "$OUT/graphs.txt"
        timeout 300 "$T" check-graphs --model "$W/llama-3.2-1b" --quantization fp8 2>&1 | grep -E "identical|Error|check-graphs" | tee -a "$OUT/graphs.txt"
        ;;
    fp8)
        gen llama-3.2-1b
        timeout 300 "$T" check-fp8 --model "$W/llama-3.2-1b" --rows "${FP8_ROWS:-1,8,16,64}" --json "$OUT/fp8_llama-3.2-1b.json" 2>&1 | grep -E "^\||worst|Error|bit-exact" | tee -a "$OUT/fp8.txt"
        echo "-- trained harrier-cpu" | tee -a "$OUT/fp8.txt"
        timeout 200 "$T" check-fp8 --model engine-core/models/harrier-cpu --rows 1 --batches 1,8 --steps 48 --json "$OUT/fp8_harrier-cpu.json" 2>&1 | grep -E "^\||Error" | tail -4 | tee -a "$OUT/fp8.txt"
        ;;
    fp8trained)
        TW=/tmp/harrier-train/gpu
        TOK=.gpu/llama3/tokenizer.json
        if [[ ! -f "$TOK" && -f .gpu/llama3-tokenizer.json.gz ]]; then
            TOK="$W/llama3-tokenizer.json"
            gunzip -c .gpu/llama3-tokenizer.json.gz >"$TOK"
        fi
        [[ -f "$TW/trained-llama-1b/config.json" ]] || python3 scripts/train/train.py --family gpu --out "$TW" \
            --llama3-tokenizer "$TOK" --only trained-llama-1b >>"$OUT/train.log" 2>&1
        timeout 300 "$T" check-fp8 --model "$TW/trained-llama-1b" --rows 1 --lt-rows 64 --batches ${FP8_TRAINED_BATCHES:-1,8,32} --steps 64 \
            --json "$OUT/fp8_trained-llama-1b.json" 2>&1 | grep -E "^\||Error" | tail -5 | tee -a "$OUT/fp8.txt"
        ;;
    fp8ckpt)
        gen llama-3.2-1b
        [[ -f "$W/llama-3.2-1b-fp8/config.json" ]] || "$H" quantize --model "$W/llama-3.2-1b" --out "$W/llama-3.2-1b-fp8" 2>&1 | tail -1
        timeout 300 "$T" bench --model "$W/llama-3.2-1b-fp8" --batches 1,64 --context 512 --steps 64 \
            --modes graph-async --prefill-seqs 1 --prefill-len 16 2>&1 | grep -E "^decode|Error" | tee -a "$OUT/bench.log"
        ;;
    parity)
        gen llama-3.2-1b
        timeout 300 python3 scripts/gpu/cuda_parity.py --tool "$T" --model "$W/llama-3.2-1b" --rel-bar 2e-2 \
            --work "$W/p16-1b" --json "$OUT/parity_llama-3.2-1b.json" 2>>"$OUT/parity.log" | cut -c1-700
        ;;
    bench)
        for m in ${BENCH_MODELS:-llama-3.2-1b}; do
            gen "$m"
            decode_bench "$OUT/bench.log" "$m" "$BATCHES" --modes graph-async,graph-async-unfused \
                --prefill-seqs 1 --prefill-len 16 --fused-max-rows "${FUSED_ROWS:-16}" --json "$OUT/bench_$m.json"
            [[ "${BENCH_FP8:-1}" == 1 ]] || continue
            echo "-- $m FP8" | tee -a "$OUT/bench.log"
            decode_bench "$OUT/bench.log" "$m" "$BATCHES" --modes graph-async,graph-async-unfused \
                --prefill-seqs 1 --prefill-len 16 --fused-max-rows "${FUSED_ROWS:-16}" --quantization fp8 \
                --json "$OUT/bench_${m}_fp8.json"
        done
        ;;
    fp8gemm)
        gen llama-3.2-1b
        timeout 300 "$T" check-fp8 --model "$W/llama-3.2-1b" --rows 1,16 --lt-rows "${LT_ROWS:-32,64,256,2048}" \
            --batches 1,32 --steps 32 --json "$OUT/fp8gemm_llama-3.2-1b.json" 2>&1 \
            | grep -E "^\||worst|Error|bit-exact|not available" | tee -a "$OUT/fp8gemm.txt"
        for mode in bf16 dequant fp8gemm; do
            q=()
            [[ $mode == bf16 ]] || q=(--quantization fp8)
            echo "-- llama-3.2-1b $mode" | tee -a "$OUT/fp8gemm.txt"
            HARRIER_FP8_GEMM=$([[ $mode == dequant ]] && echo 0 || echo 1) decode_bench "$OUT/fp8gemm.txt" llama-3.2-1b \
                "${FP8_BATCHES:-1,16,32,64,256}" --modes graph-async --prefill-seqs 8 --prefill-len 2048 "${q[@]}"
        done
        timeout 300 "$T" check-graphs --model "$W/llama-3.2-1b" --quantization fp8 2>&1 | grep -E "identical|Error|check-graphs" | tee -a "$OUT/fp8gemm.txt"
        ;;
    pdl)
        for m in ${BENCH_MODELS:-llama-3.2-1b}; do
            gen "$m"
            for pdl in 0 1; do
                echo "-- $m HARRIER_PDL=$pdl" | tee -a "$OUT/pdl.log"
                HARRIER_PDL=$pdl decode_bench "$OUT/pdl.log" "$m" "$BATCHES" --modes graph-async,graph-async-unfused \
                    --prefill-seqs 1 --prefill-len 16 --fused-max-rows "${FUSED_ROWS:-2}"
            done
        done
        gen llama-3.2-1b
        for pdl in 0 1; do
            echo "-- llama-3.2-1b FP8 HARRIER_PDL=$pdl" | tee -a "$OUT/pdl.log"
            HARRIER_PDL=$pdl decode_bench "$OUT/pdl.log" llama-3.2-1b "${FP8_BATCHES:-1,16,32,64}" --modes graph-async \
                --prefill-seqs 1 --prefill-len 16 --quantization fp8
        done
        ;;
    profile)
        # Per-kernel GPU time (ncu) of graph-replayed decode steps at PROFILE_BATCHES (default
        # 1), fused and unfused: 8 decode steps each (4 warm-up + 4); the bench's bandwidth
        # and GEMM probes and its prefills appear under their own kernel names.
        gen llama-3.2-1b
        for b in ${PROFILE_BATCHES:-1}; do
            for mode in ${PROFILE_MODES:-graph-async graph-async-unfused}; do
                timeout 200 ncu --clock-control none --cache-control "${NCU_CACHE:-all}" --metrics gpu__time_duration.sum --csv \
                    "$T" bench --model "$W/llama-3.2-1b" --batches $b --context 512 --steps 4 --modes $mode \
                    --fused-max-rows "${FUSED_ROWS:-16}" --prefill-seqs 1 --prefill-len 16 >"$OUT/ncu_${b}_$mode.csv" 2>/dev/null
                python3 scripts/gpu/ncu_summary.py "$OUT/ncu_${b}_$mode.csv" 8 "batch $b $mode" | tee -a "$OUT/profile.txt"
            done
        done
        ;;
    ab)
        sets="${AB_SETS:-old:HARRIER_ROPE_EPILOGUE=0,HARRIER_SKINNY_W8=0,HARRIER_ATTN_PREFETCH=0,HARRIER_ATTN_ONE_SPLIT_TILES=0 new:}"
        for m in ${BENCH_MODELS:-llama-3.2-1b}; do
            gen "$m"
            for q in bf16 fp8; do
                [[ $q == fp8 && "${BENCH_FP8:-1}" != 1 ]] && continue
                qa=()
                [[ $q == fp8 ]] && qa=(--quantization fp8)
                for rep in $(seq 1 "${AB_ROUNDS:-2}"); do
                    for set in $sets; do
                        label=${set%%:*}
                        vars=${set#*:}
                        echo "-- $m $q $label (${vars:-defaults}, round $rep)" | tee -a "$OUT/ab.log"
                        (
                            for v in ${vars//,/ }; do export "$v"; done
                            decode_bench "$OUT/ab.log" "$m" "$BATCHES" --modes graph-async --prefill-seqs 1 \
                                --prefill-len 16 "${qa[@]}"
                        )
                    done
                done
            done
        done
        ;;
    esac
done
ls -l "$OUT"
