#!/usr/bin/env bash
# Cost of structured-output constraints on CUDA: the llama-3.2-1b shape (random weights, the
# Llama 3 tokenizer; a 128k-entry mask per constrained row and step), bf16 with graphs,
# scripts/bench_structured.py (concurrency 1 and 16, constrained vs not, side by side).
# Carry .gpu/harrier and .gpu/tokenizer.json.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/harrier-sb}"; mkdir -p "$OUT"
M=/tmp/harrier-sb-1b
.gpu/harrier gen-model --preset llama-3.2-1b --out "$M" --tokenizer .gpu/tokenizer.json 2>&1 | tail -1
.gpu/harrier serve --model "$M" --device cuda --port 8161 >"$OUT/serve.out" 2>"$OUT/serve.err" &
PID=$!
for _ in $(seq 1 300); do grep -q "Harrier is serving" "$OUT/serve.out" && break; sleep 0.5; done
sed 's/\x1b\[[0-9;]*m//g' "$OUT/serve.err" | grep -E "structured outputs|CUDA engine configured" | cut -c1-220
python3 scripts/bench_structured.py --base http://127.0.0.1:8161 --rounds 5
curl -s http://127.0.0.1:8161/metrics | grep -E "^harrier_engine_(cuda_graph_replays|eager_decode)"
kill -TERM "$PID"; wait "$PID"; echo "exit $?"
