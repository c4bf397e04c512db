#!/usr/bin/env bash
# Soak test (docs/soak.md): streamed requests through `harrier serve --api-server-count 2
# --device cpu` (the embedded harrier-cpu model) with a mix of lengths, 10% clients hanging up
# mid-stream and 5% invalid requests, while the RSS of the launcher, the engine core and both
# front ends is sampled every second. `harrier bench soak` prints a summary and exits non-zero
# when a request was lost or hung, an invalid one was not refused with its 4xx, the KV cache is
# not back to 0 blocks at the end, or (with --rss-tolerance) a process's mean RSS over the last
# quarter of the load is more than the tolerance above its mean over the second quarter.
#
#   scripts/soak.sh                                   # the full run: 50,000 requests
#   scripts/soak.sh --requests 2000 --rss-tolerance off   # the short one CI runs
#
# Options (defaults in brackets):
#   --requests N        requests to send [50000]
#   --concurrency C     requests in flight at most [256]
#   --duration S        send no new request after S seconds [no limit]
#   --rss-tolerance F   allowed RSS growth, a fraction, or `off` [0.05]
#   --input-len N       mean prompt length; lengths spread over ±75% [64]
#   --output-len N      mean output length (exact per request: ignore_eos), ±75% [32]
#   --kv-cache-mib M    the engine's KV cache [256]
#   --model DIR|ID      the model to serve [the embedded harrier-cpu]
#   --out DIR           serve.log, rss.csv, soak.json, soak.txt, rss.png [target/soak]
#   --bin PATH          the harrier binary [$HARRIER_BIN, else a release build]
# Anything after `--` goes to `harrier bench soak` (e.g. -- --seed 3 --request-timeout 60).
set -euo pipefail
cd "$(dirname "$0")/.."

REQUESTS=50000
CONCURRENCY=256
DURATION=
RSS_TOLERANCE=0.05
INPUT_LEN=64
OUTPUT_LEN=32
KV_CACHE_MIB=256
MODEL=
OUT=target/soak
BIN="${HARRIER_BIN:-}"
EXTRA=()
while [ $# -gt 0 ]; do
    case "$1" in
        --requests) REQUESTS="$2"; shift 2 ;;
        --concurrency) CONCURRENCY="$2"; shift 2 ;;
        --duration) DURATION="$2"; shift 2 ;;
        --rss-tolerance) RSS_TOLERANCE="$2"; shift 2 ;;
        --input-len) INPUT_LEN="$2"; shift 2 ;;
        --output-len) OUTPUT_LEN="$2"; shift 2 ;;
        --kv-cache-mib) KV_CACHE_MIB="$2"; shift 2 ;;
        --model) MODEL="$2"; shift 2 ;;
        --out) OUT="$2"; shift 2 ;;
        --bin) BIN="$2"; shift 2 ;;
        --) shift; EXTRA=("$@"); break ;;
        *) echo "soak.sh: unknown option $1 (see the header of $0)" >&2; exit 2 ;;
    esac
done
if [ -z "$BIN" ]; then
    cargo build --release -p harrier-frontend --bin harrier
    BIN=target/release/harrier
fi
mkdir -p "$OUT"

# Port 0: the launcher picks a free port and prints the URL once every front end is ready.
MODEL_ARGS=()
[ -n "$MODEL" ] && MODEL_ARGS=(--model "$MODEL")
"$BIN" serve "${MODEL_ARGS[@]}" --api-server-count 2 --device cpu --port 0 --kv-cache-mib "$KV_CACHE_MIB" \
    >"$OUT/serve.log" 2>&1 &
SERVER=$!
stop_server() {
    if kill -0 "$SERVER" 2>/dev/null; then
        kill -TERM "$SERVER" 2>/dev/null || true
        wait "$SERVER" 2>/dev/null || true
    fi
}
trap stop_server EXIT

URL=
for _ in $(seq 1 600); do
    URL=$(grep -o 'Harrier is serving .* at http://[^ ]*' "$OUT/serve.log" | grep -o 'http://[^ ]*' || true)
    [ -n "$URL" ] && break
    if ! kill -0 "$SERVER" 2>/dev/null; then
        echo "soak.sh: harrier serve exited during start-up:" >&2
        tail -20 "$OUT/serve.log" >&2
        exit 1
    fi
    sleep 0.2
done
[ -n "$URL" ] || { echo "soak.sh: harrier serve not ready after 120 s" >&2; exit 1; }
BASE="${URL%/v1}"
echo "soak.sh: server at $BASE (launcher pid $SERVER); $REQUESTS requests, concurrency $CONCURRENCY"

ARGS=(--base-url "$BASE" --server-pid "$SERVER" --num-prompts "$REQUESTS"
    --max-concurrency "$CONCURRENCY" --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --range-ratio 0.75
    --chat-fraction 0.2 --disconnect-fraction 0.1 --bad-request-fraction 0.05
    --rss-tolerance "$RSS_TOLERANCE" --rss-csv "$OUT/rss.csv" --json "$OUT/soak.json"
    --label soak --no-progress)
[ -n "$DURATION" ] && ARGS+=(--duration "$DURATION")
status=0
"$BIN" bench soak "${ARGS[@]}" "${EXTRA[@]}" | tee "$OUT/soak.txt" || status=$?

# The server must still stop cleanly (drain, exit 0).
kill -TERM "$SERVER"
if ! wait "$SERVER"; then
    echo "soak.sh: harrier serve did not exit cleanly on SIGTERM" >&2
    status=1
fi
trap - EXIT

if command -v gnuplot >/dev/null && [ -s "$OUT/rss.csv" ]; then
    scripts/soak_plot.sh "$OUT/rss.csv" "$OUT/rss.png" || echo "soak.sh: no plot" >&2
fi
exit "$status"
