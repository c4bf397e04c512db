#!/usr/bin/env bash
# Structured outputs on the GPU machine (issue 14): the embedded harrier-cpu served by the
# CUDA backend in fp32 and bf16 and by the CPU backend; scripts/gpu/structured_check.py checks
# every constrained output (JSON schema, regex, choice; greedy and sampled; some with logprobs,
# which the CUDA backend samples on the host; mixed with unconstrained requests) and that the
# CUDA fp32 greedy outputs equal the CPU's. Carry .gpu/harrier.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/harrier-structured}"; mkdir -p "$OUT"
export HARRIER_HOME=/tmp/harrier-structured-home
start() { # name port args...
  local name=$1 port=$2; shift 2
  .gpu/harrier serve --port "$port" "$@" >"$OUT/$name.out" 2>"$OUT/$name.err" &
  echo $! >"$OUT/$name.pid"
  for _ in $(seq 1 240); do grep -q "Harrier is serving" "$OUT/$name.out" && return 0; sleep 0.5; done
  echo "$name did not start"; tail -5 "$OUT/$name.err"; return 1
}
start cpu 8141 --device cpu
start cuda32 8142 --device cuda --dtype float32
status=0
echo "== CUDA fp32 vs CPU"
python3 scripts/gpu/structured_check.py --base http://127.0.0.1:8142 --reference http://127.0.0.1:8141 || status=1
kill -TERM "$(cat "$OUT/cuda32.pid")"; wait "$(cat "$OUT/cuda32.pid")"
start cuda16 8143 --device cuda
echo "== CUDA bf16 (validity)"
python3 scripts/gpu/structured_check.py --base http://127.0.0.1:8143 || status=1
curl -s http://127.0.0.1:8143/metrics | grep -E "^harrier_engine_(cuda_graph_replays|eager_decode)" 
kill -TERM "$(cat "$OUT/cuda16.pid")" "$(cat "$OUT/cpu.pid")"; wait
echo "== speculative decoding on CUDA is refused at start-up (CPU only so far)"
.gpu/harrier engine-core --device cuda --speculative-method ngram --endpoint ipc:///tmp/h-spec.sock 2>&1 | tail -1 | sed 's/\x1b\[[0-9;]*m//g'
exit $status
