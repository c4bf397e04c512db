#!/usr/bin/env bash
# End to end on the GPU machine: `harrier serve --device cuda` (engine core + 2 front ends)
# on the llama-3.2-1b shape with the real Llama 3 tokenizer, streaming chat and completion
# requests over HTTP, /health and /metrics, then SIGTERM and a clean exit.
# Carry .gpu/harrier and .gpu/tokenizer.json (the release binary and the tokenizer).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/harrier-serve-out}"; mkdir -p "$OUT"
M=/tmp/harrier-e2e-1b
.gpu/harrier gen-model --preset llama-3.2-1b --out "$M" --tokenizer .gpu/tokenizer.json 2>&1 | tail -1
.gpu/harrier serve --model "$M" --device cuda --api-server-count 2 --port 8123 >"$OUT/serve.out" 2>"$OUT/serve.err" &
PID=$!
for _ in $(seq 1 240); do grep -q "Harrier is serving" "$OUT/serve.out" && break; sleep 0.5; done
cat "$OUT/serve.out"; grep -i "CUDA engine configured" "$OUT/serve.err" | sed 's/\x1b\[[0-9;]*m//g'
echo "== health: $(curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:8123/health)"
echo "== streaming chat"
curl -sN http://127.0.0.1:8123/v1/chat/completions -H 'Content-Type: application/json' -d '{
  "model": "harrier-e2e-1b", "messages": [{"role": "user", "content": "Hello from the GPU!"}],
  "max_tokens": 24, "temperature": 0, "stream": true, "stream_options": {"include_usage": true}}' | tee "$OUT/chat.sse" | tail -4
echo "== completion (non-streaming, seeded, n=2)"
curl -s http://127.0.0.1:8123/v1/completions -H 'Content-Type: application/json' -d '{
  "model": "harrier-e2e-1b", "prompt": "The quick brown fox", "max_tokens": 16, "n": 2, "seed": 7, "temperature": 0.8}' | tee "$OUT/completion.json" | head -c 600; echo
echo "== completion with penalties and logit_bias (sampled on the device; token 1000 forced)"
curl -s http://127.0.0.1:8123/v1/completions -H 'Content-Type: application/json' -d '{
  "model": "harrier-e2e-1b", "prompt": "a a a a a a", "max_tokens": 16, "temperature": 0,
  "frequency_penalty": 1.0, "presence_penalty": 0.5, "repetition_penalty": 1.3,
  "logit_bias": {"1000": 100}}' | tee "$OUT/penalties.json" | head -c 400; echo
echo "== 32 concurrent streams"
CURLS=()
for i in $(seq 1 32); do
  curl -sN http://127.0.0.1:8123/v1/completions -H 'Content-Type: application/json' -d "{\"model\": \"harrier-e2e-1b\", \"prompt\": \"Request $i:\", \"max_tokens\": 32, \"stream\": true}" > "$OUT/s$i.sse" &
  CURLS+=($!)
done
wait "${CURLS[@]}"
done_count=$(grep -l "data: \[DONE\]" "$OUT"/s*.sse | wc -l); echo "streams ending with [DONE]: $done_count/32"
curl -s http://127.0.0.1:8123/metrics | grep -E "^harrier_(requests_total|generation_tokens_total|engine_kv|engine_cuda_graph|engine_eager|request_queue_time_seconds_count)|^vllm:(request_success_total|generation_tokens_total|e2e_request_latency_seconds_count)" | head -16
# The issue 16 measurement through HTTP (128 tokens in, 256 out, one request at a time, graphs
# on): batch-1 decode end to end, the ring's steps plus the engine and front-end path, to set
# beside `harrier-cuda-tool bench`'s ms a step (ITL p50 against it; session 53 added it).
echo "== one request at a time (128 in, 256 out)"
.gpu/harrier bench serve --base-url http://127.0.0.1:8123 --num-prompts 8 --input-len 128 --output-len 256 \
  --max-concurrency 1 --no-progress 2>&1 | grep -E "throughput|TTFT|TPOT|ITL|Error|error"
kill -TERM "$PID"; wait "$PID"; echo "serve exit status: $?"

# The embedded default model (harrier-cpu, trained) on CUDA: greedy text to compare with the
# CPU backend's, and the start-up progress lines (weight loading, kernel compilation).
echo "== the embedded default model on CUDA"
HARRIER_HOME=/tmp/harrier-e2e-home .gpu/harrier serve --device cuda --port 8124 >"$OUT/default.out" 2>"$OUT/default.err" &
PID=$!
for _ in $(seq 1 240); do grep -q "Harrier is serving" "$OUT/default.out" && break; sleep 0.5; done
sed 's/\x1b\[[0-9;]*m//g' "$OUT/default.err" | grep -E "loading|compiling|writing the embedded" | cut -c1-200 | head -6
curl -s http://127.0.0.1:8124/v1/completions -H 'Content-Type: application/json' -d '{
  "prompt": "def fibonacci(n):\n", "max_tokens": 32, "temperature": 0}' | tee "$OUT/default.json" |
  python3 -c "import json,sys; r=json.load(sys.stdin); print(repr(r['choices'][0]['text']))"
kill -TERM "$PID"; wait "$PID"; echo "serve (default model) exit status: $?"
