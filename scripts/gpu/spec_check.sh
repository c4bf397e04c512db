#!/usr/bin/env bash
# Speculative decoding on the CUDA backend, in one device call (harrier-cuda-tool check-spec /
# bench-spec: the real engine loop, speculation against the plain engine):
#   sampler:  check-sampling and check-penalties (the device sampler, refactored into the
#             functions the draft and verification kernels share) on the 1B shape;
#   cpu-pair: check-spec with the committed trained pair (harrier-cpu target, harrier-cpu-draft)
#             on the held-out prompts, K = 1, 4, 7, then bench-spec;
#   random:   check-spec on the random 1B shape with itself as draft (acceptance near 1:
#             the full-acceptance paths), in bf16 and in f32 (HARRIER_SPEC_CHECK_F32=1: bf16
#             near-ties on random weights flip greedy tokens between kernel shapes), then
#             bench-spec (the ceiling of a round: K target-sized draft steps + one verify);
#   serve:    `harrier serve --device cuda` with the committed pair (--speculative-model) and
#             with n-gram lookup (--speculative-method ngram), each against a plain CUDA server: greedy completions (streamed and not) equal, SSE
#             chunks carrying several tokens, usage.speculative_decoding, the vLLM-named
#             metrics;
#   shapes:   bench-spec at batch 1 on random checkpoints (acceptance is meaningless there; the
#             round time is not): 3B target with the 1B shape as draft, 8B with the 1B shape:
#             per-round time and the tokens per round at which each breaks even;
#   ngram:    n-gram lookup (--ngram 1-4) on the committed target with the held-out prompts
#             repeated 3 times: check-spec in f32 and bf16 (f32: greedy equality and the
#             device's lookups against the CPU backend's), then bench-spec (prompts x4);
#   trained:  trains trained-llama-1b and trained-draft-2l-distilled (scripts/train, ~6 min on
#             an H100), then check-spec and bench-spec on them (needs .gpu/llama3/tokenizer.json);
#             TRAINED_NGRAM=1 also benches n-gram lookup on the 1B (prompts x NGRAM_REPEAT).
# SHAPES_FUSED (e.g. "0 default": bench the shapes with the fused decode path off and at its
# default), SHAPES_BATCHES. HARRIER_SPEC_GRAPHS (0, 1, rounds, decode),
# HARRIER_SPEC_CHECK_PREFIX_CACHE=1 and HARRIER_SPEC_CHECK_SIZES=LEN,BLOCKS pass through.
# Build and carry .gpu/ as for cuda_check.sh. STAGES (default "sampler cpu-pair random"),
# BATCHES (default 1,4,16,64), MAX_TOKENS (default 256), CPU_PAIR_KS (default "1 4 7"),
# CPU_PAIR_F32=1 (check the pair in f32, where greedy equality is gated), CPU_PAIR_BENCH=0,
# TRAINED_CHECK=0 (bench only), DISABLE_ABOVE=N (bench-spec --disable-above N too).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/harrier-spec-out}"
W=/tmp/harrier-spec-work
STAGES="${STAGES:-sampler cpu-pair random}"
BATCHES="${BATCHES:-1,4,16,64}"
MAX_TOKENS="${MAX_TOKENS:-256}"
. scripts/gpu/common.sh
status=0
models=engine-core/models
fixture=tests/fixtures/parity_harrier-cpu.json

for st in $STAGES; do
    case "$st" in
    sampler)
        gen llama-3.2-1b
        timeout 200 "$T" check-sampling --model "$W/llama-3.2-1b" 2>&1 | tail -6 | tee "$OUT/sampler.txt" || status=1
        timeout 200 "$T" check-penalties --model "$W/llama-3.2-1b" 2>&1 | tail -6 | tee -a "$OUT/sampler.txt" || status=1
        ;;
    cpu-pair)
        for k in ${CPU_PAIR_KS:-1 4 7}; do
            echo "## K=$k f32=${CPU_PAIR_F32:-0}" | tee -a "$OUT/cpu-pair.txt"
            HARRIER_SPEC_CHECK_F32=${CPU_PAIR_F32:-0} timeout 200 "$T" check-spec --model $models/harrier-cpu --draft $models/harrier-cpu-draft \
                --prompts $fixture --k $k 2>&1 | grep -v INFO | tee -a "$OUT/cpu-pair.txt" || status=1
        done
        [[ "${CPU_PAIR_BENCH:-1}" == 1 ]] && timeout 200 "$T" bench-spec --model $models/harrier-cpu --draft $models/harrier-cpu-draft \
            --prompts $fixture --batches "$BATCHES" --max-tokens "$MAX_TOKENS" 2>&1 | grep -v INFO | tee -a "$OUT/cpu-pair.txt" || status=1
        ;;
    ngram)
        # N-gram lookup on the device: check-spec on the committed target (f32 gates greedy
        # equality and the lookups against the CPU backend's), on prompts repeated 3 times.
        for f32 in ${NGRAM_F32:-1 0}; do
            echo "## ngram 1-4, harrier-cpu, f32=$f32, graphs=${HARRIER_SPEC_GRAPHS:-0}" | tee -a "$OUT/ngram.txt"
            HARRIER_SPEC_CHECK_F32=$f32 timeout 200 "$T" check-spec --model $models/harrier-cpu --ngram 1-4 \
                --prompts $fixture --repeat 3 --k 4 2>&1 | grep -v INFO | tee -a "$OUT/ngram.txt" || status=1
        done
        [[ "${NGRAM_BENCH:-1}" == 1 ]] && { timeout 200 "$T" bench-spec --model $models/harrier-cpu --ngram 1-4 --prompts $fixture \
            --repeat 4 --batches "$BATCHES" --max-tokens "$MAX_TOKENS" 2>&1 | grep -v INFO | tee -a "$OUT/ngram.txt" || status=1; }
        ;;
    random)
        gen llama-3.2-1b
        m="$W/llama-3.2-1b"
        for f32 in ${RANDOM_F32:-1 0}; do
            echo "## target llama-3.2-1b, draft itself, f32=$f32" | tee -a "$OUT/random.txt"
            HARRIER_SPEC_CHECK_F32=$f32 timeout 240 "$T" check-spec --model "$m" --draft "$m" 2>&1 | grep -v INFO | tee -a "$OUT/random.txt" || status=1
        done
        [[ -n "${RANDOM_BENCH:-}" ]] && { timeout 240 "$T" bench-spec --model "$m" --draft "$m" --batches "$BATCHES" \
            --max-tokens "$MAX_TOKENS" 2>&1 | grep -v INFO | tee -a "$OUT/random.txt" || status=1; }
        ;;
    trained)
        TW=/tmp/harrier-train
        mkdir -p .gpu/llama3
        if [[ ! -s .gpu/llama3/tokenizer.json ]]; then
            if [[ -s .gpu/llama3-tokenizer.json ]]; then
                cp .gpu/llama3-tokenizer.json .gpu/llama3/tokenizer.json
            else
                gunzip -c .gpu/llama3-tokenizer.json.gz > .gpu/llama3/tokenizer.json
            fi
        fi
        python3 scripts/train/train.py --family gpu --out "$TW/gpu" --llama3-tokenizer .gpu/llama3/tokenizer.json \
            --only trained-llama-1b,trained-draft-2l-distilled > "$OUT/train.log" 2>&1 || status=1
        tail -5 "$OUT/train.log"
        p="$TW/gpu/heldout_prompts.json"
        [[ -f "$p" ]] || p=""
        [[ "${TRAINED_CHECK:-1}" == 1 ]] && { timeout 240 "$T" check-spec --model "$TW/gpu/trained-llama-1b" --draft "$TW/gpu/trained-draft-2l-distilled" \
            ${p:+--prompts "$p"} 2>&1 | grep -v INFO | tee -a "$OUT/trained.txt" || status=1; }
        [[ "${TRAINED_DRAFT_BENCH:-1}" == 1 ]] && { timeout 300 "$T" bench-spec --model "$TW/gpu/trained-llama-1b" --draft "$TW/gpu/trained-draft-2l-distilled" \
            ${p:+--prompts "$p"} --batches "$BATCHES" --max-tokens "$MAX_TOKENS" ${DISABLE_ABOVE:+--disable-above $DISABLE_ABOVE} 2>&1 | grep -v INFO | tee -a "$OUT/trained.txt" || status=1; }
        if [[ "${TRAINED_NGRAM:-0}" == 1 ]]; then
            echo "## n-gram 1-4 on the trained 1B, prompts repeated ${NGRAM_REPEAT:-3} times" | tee -a "$OUT/trained.txt"
            timeout 300 "$T" bench-spec --model "$TW/gpu/trained-llama-1b" --ngram 1-4 ${p:+--prompts "$p"} --repeat "${NGRAM_REPEAT:-3}" \
                --batches "$BATCHES" --max-tokens "$MAX_TOKENS" ${DISABLE_ABOVE:+--disable-above $DISABLE_ABOVE} 2>&1 | grep -v INFO | tee -a "$OUT/trained.txt" || status=1
        fi
        ;;
    serve)
        prompts=("def fibonacci(n):" "import os" "class Stack:" "The quick brown fox" "for i in range(10):")
        for mode in plain spec ngram; do
            extra=()
            [[ $mode == spec ]] && extra=(--speculative-model $models/harrier-cpu-draft --num-speculative-tokens 4)
            [[ $mode == ngram ]] && extra=(--speculative-method ngram --num-speculative-tokens 4)
            .gpu/harrier serve --device cuda --model $models/harrier-cpu "${extra[@]}" --port 8125 \
                >"$OUT/serve-$mode.out" 2>"$OUT/serve-$mode.err" &
            PID=$!
            for _ in $(seq 1 240); do grep -q "Harrier is serving" "$OUT/serve-$mode.out" && break; sleep 0.5; done
            for i in "${!prompts[@]}"; do
                body=$(python3 -c 'import json,sys; print(json.dumps({"prompt": sys.argv[1], "max_tokens": 48, "temperature": 0}))' "${prompts[$i]}")
                curl -s http://127.0.0.1:8125/v1/completions -H 'Content-Type: application/json' -d "$body" > "$W/$mode-$i.json"
                python3 -c 'import json,sys; print(json.dumps(json.load(open(sys.argv[1]))["choices"][0]["text"]))' "$W/$mode-$i.json" > "$W/$mode-$i.txt"
            done
            body=$(python3 -c 'import json; print(json.dumps({"prompt": "def fibonacci(n):", "max_tokens": 48, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}))')
            curl -sN http://127.0.0.1:8125/v1/completions -H 'Content-Type: application/json' -d "$body" > "$W/$mode-stream.sse"
            [[ $mode != plain ]] && curl -s http://127.0.0.1:8125/metrics | grep -E "^vllm:spec_decode" | head -8 | sed "s/^/$mode /" | tee -a "$OUT/serve.txt"
            kill -TERM "$PID"; wait "$PID"; echo "serve ($mode) exit status: $?" | tee -a "$OUT/serve.txt"
        done
        for mode in spec ngram; do
        same=0
        for i in "${!prompts[@]}"; do cmp -s "$W/plain-$i.txt" "$W/$mode-$i.txt" && same=$((same + 1)); done
        echo "$mode: greedy completions identical with and without speculation: $same/${#prompts[@]}" | tee -a "$OUT/serve.txt"
        python3 - "$W/plain-stream.sse" "$W/$mode-stream.sse" <<'PY' | tee -a "$OUT/serve.txt"
import json, sys
def read(path):
    text, chunks, usage = "", 0, None
    for line in open(path):
        if not line.startswith("data: {"):
            continue
        d = json.loads(line[6:])
        if d.get("choices"):
            text += d["choices"][0]["text"]
            chunks += 1
        if d.get("usage"):
            usage = d["usage"]
    return text, chunks, usage
(pt, pc, pu), (st, sc, su) = read(sys.argv[1]), read(sys.argv[2])
print(f"streamed: plain {pc} chunks, speculative {sc} chunks for {su['completion_tokens'] if su else '?'} tokens; text identical: {pt == st}")
print(f"speculative usage: {json.dumps(su)}")
PY
        done
        ;;
    shapes)
        gen llama-3.2-1b
        for t in llama-3.2-3b llama-3.1-8b; do
            gen $t
            for fused in ${SHAPES_FUSED:-default}; do
                echo "## target $t, draft llama-3.2-1b (random weights), fused decode rows: $fused" | tee -a "$OUT/shapes.txt"
                [[ $fused == default ]] && unset HARRIER_SPEC_CHECK_FUSED || export HARRIER_SPEC_CHECK_FUSED=$fused
                timeout 200 "$T" bench-spec --model "$W/$t" --draft "$W/llama-3.2-1b" --batches "${SHAPES_BATCHES:-1}" --max-tokens "${SHAPES_TOKENS:-128}" 2>&1 | grep -v INFO | tee -a "$OUT/shapes.txt" || status=1
            done
            unset HARRIER_SPEC_CHECK_FUSED
        done
        ;;
    *)
        echo "spec_check.sh: unknown stage $st" >&2
        status=2
        ;;
    esac
done
exit $status
