#!/usr/bin/env bash
# The front end's share of the serving cost: the same workload sent straight to the engine
# core over its protocol, through 1 front end, and through 2 front ends (SO_REUSEPORT).
# Prints a markdown table (for docs/benchmarks.md) and leaves the JSON results in $OUT_DIR.
#
#   scripts/bench_frontend.sh                       # harrier-cpu on the CPU, 64 concurrent streams
#   MODEL=/path NUM_PROMPTS=512 CONCURRENCY=64 scripts/bench_frontend.sh
set -euo pipefail
cd "$(dirname "$0")/.."

BIN="${HARRIER_BIN:-target/release/harrier}"
[[ -n "${HARRIER_BIN:-}" ]] || cargo build --release --quiet -p harrier-frontend --bin harrier
MODEL="${MODEL:-}"
NUM_PROMPTS="${NUM_PROMPTS:-256}"
INPUT_LEN="${INPUT_LEN:-128}"
OUTPUT_LEN="${OUTPUT_LEN:-64}"
CONCURRENCY="${CONCURRENCY:-64}"
ENGINE_ARGS="${ENGINE_ARGS:---kv-cache-mib 512}"
OUT_DIR="${OUT_DIR:-$(mktemp -d)}"
mkdir -p "$OUT_DIR"
WORK="$(mktemp -d)"
EP="ipc://$WORK/engine.sock"
PORT="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
# Optional CPU pinning (e.g. ENGINE_CPUS=0-1 FRONTEND_CPUS=2-3 CLIENT_CPUS=4-7) so that the
# parts do not compete for cores and the table shows each one's cost.
pin() { if [[ -n "$1" ]]; then echo "taskset -c $1"; fi; }
ENGINE_PIN="$(pin "${ENGINE_CPUS:-}")"
FRONTEND_PIN="$(pin "${FRONTEND_CPUS:-}")"
CLIENT_PIN="$(pin "${CLIENT_CPUS:-}")"
MODEL_ARGS=()
[[ -n "$MODEL" ]] && MODEL_ARGS=(--model "$MODEL")

PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT

# shellcheck disable=SC2086
$ENGINE_PIN "$BIN" engine-core "${MODEL_ARGS[@]}" --endpoint "$EP" $ENGINE_ARGS 2>"$OUT_DIR/engine.log" &
ENGINE_PID=$!
PIDS+=($!)

ticks() { # pids... -> their user + system CPU time in clock ticks
    local t=0 p f
    for p in "$@"; do
        read -r -a f <"/proc/$p/stat"
        t=$((t + f[13] + f[14]))
    done
    echo "$t"
}

bench() { # label, extra args...
    local label="$1"; shift
    local e0 f0
    e0="$(ticks "$ENGINE_PID")"
    f0="$(ticks "${FRONTS[@]}")"
    run_bench "$label" "$@"
    awk -v e="$(($(ticks "$ENGINE_PID") - e0))" -v f="$(($(ticks "${FRONTS[@]}") - f0))" -v hz="$(getconf CLK_TCK)" \
        'BEGIN { printf "{\"engine_cpu_s\": %.2f, \"frontend_cpu_s\": %.2f}\n", e / hz, f / hz }' >"$OUT_DIR/$label.cpu.json"
}

run_bench() {
    local label="$1"; shift
    $CLIENT_PIN "$BIN" bench serve --num-prompts "$NUM_PROMPTS" --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" \
        --max-concurrency "$CONCURRENCY" --no-progress --label "$label" --json "$OUT_DIR/$label.json" "$@" >&2
}

start_frontends() { # count
    local i
    for ((i = 0; i < $1; i++)); do
        $FRONTEND_PIN "$BIN" frontend "${MODEL_ARGS[@]}" --engine-endpoint "$EP" --port "$PORT" --reuse-port --frontend-index "$i" \
            2>>"$OUT_DIR/frontend.log" &
        FRONTS+=($!)
        PIDS+=($!)
    done
    for _ in $(seq 1 600); do
        curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
        sleep 0.2
    done
    sleep 1 # let every front end finish binding
}

stop_frontends() {
    for p in "${FRONTS[@]}"; do kill -TERM "$p"; wait "$p" || true; done
    FRONTS=()
}

# Wait for the engine, warm up (first touch of the weights and KV pages), then the three runs.
for _ in $(seq 1 300); do [[ -S "$WORK/engine.sock" ]] && break; sleep 0.2; done
# The warm-up is the workload itself at a quarter of the prompts: a short one leaves the
# first measured run paying for first-touch page faults (its TTFT p50 was 3x the others').
$CLIENT_PIN "$BIN" bench serve --engine-endpoint "$EP" --num-prompts "$(((NUM_PROMPTS + 3) / 4))" --input-len "$INPUT_LEN" \
    --output-len "$OUTPUT_LEN" --max-concurrency "$CONCURRENCY" --no-progress >/dev/null
# ROUNDS > 1 repeats the three runs in rotated order (engine, 1, 2 / 1, 2, engine / ...) and
# keeps the round with the median output tok/s per path (the machine may be shared).
ROUNDS="${ROUNDS:-1}"
FRONTS=()
run_path() {
    case "$1" in
        engine) bench "engine-r$2" --engine-endpoint "$EP" ;;
        1) start_frontends 1; bench "1-frontend-r$2" --base-url "http://127.0.0.1:$PORT"; stop_frontends ;;
        2) start_frontends 2; bench "2-frontends-r$2" --base-url "http://127.0.0.1:$PORT"; stop_frontends ;;
    esac
}
ORDER=(engine 1 2)
for ((r = 0; r < ROUNDS; r++)); do
    for ((k = 0; k < 3; k++)); do run_path "${ORDER[$(((k + r) % 3))]}" "$r"; done
done

python3 - "$OUT_DIR" <<'PY'
import json, sys, os
d = sys.argv[1]
import glob, statistics
rows = []
for n in ("engine", "1-frontend", "2-frontends"):
    runs = []
    for f in glob.glob(os.path.join(d, f"{n}-r*.json")):
        if f.endswith(".cpu.json"):
            continue
        r = json.load(open(f))
        r.update(json.load(open(f[:-len(".json")] + ".cpu.json")))
        runs.append(r)
    runs.sort(key=lambda r: r["output_throughput"])
    med = runs[(len(runs) - 1) // 2]
    med["label"] = n + (f" (median of {len(runs)}: " + ", ".join(f"{r['output_throughput']:.0f}" for r in runs) + " tok/s)" if len(runs) > 1 else "")
    rows.append(med)
print(f"{rows[0]['num_prompts']} requests, {rows[0]['input_len']} prompt + {rows[0]['output_len']} output tokens, max concurrency {rows[0]['max_concurrency']}\n")
print("| path | req/s | output tok/s | TTFT p50 / p90 / p99 (ms) | ITL p50 / p90 / p99 (ms) | TPOT mean (ms) | engine CPU s | front-end CPU s (ms/token) | failed |")
print("|---|---:|---:|---|---|---:|---:|---:|---:|")
for r in rows:
    t, i = r["ttft_ms"], r["itl_ms"]
    print(f"| {r['label']} | {r['request_throughput']:.2f} | {r['output_throughput']:.1f} | "
          f"{t['p50']:.0f} / {t['p90']:.0f} / {t['p99']:.0f} | {i['p50']:.1f} / {i['p90']:.1f} / {i['p99']:.1f} | "
          f"{r['tpot_ms']['mean']:.1f} | {r['engine_cpu_s']:.1f} | "
          f"{r['frontend_cpu_s']:.2f} ({1e3 * r['frontend_cpu_s'] / max(1, r['total_output_tokens']):.2f}) | {r['failed']} |")
base = rows[0]["output_throughput"]
for r in rows[1:]:
    print(f"\n{r['label'].split(' ')[0]}: output tok/s {r['output_throughput'] / base:.2f}x the engine alone's", end="")
print()
PY
echo "results: $OUT_DIR" >&2
