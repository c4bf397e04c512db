#!/usr/bin/env bash
# The official `openai` Python package against a real `harrier serve` (2 front ends, the
# embedded default model, harrier-cpu), then against one with speculative decoding (the
# committed draft). Idempotent set-up: a venv at
# $HARRIER_HOME/venv-openai with openai from PyPI.
#
#   scripts/test_openai_client.sh            # builds target/debug/harrier if needed
#   HARRIER_BIN=target/release/harrier scripts/test_openai_client.sh
set -euo pipefail

cd "$(dirname "$0")/.."
HARRIER_HOME="${HARRIER_HOME:-$HOME/.cache/harrier}"
PYTHON="${PYTHON:-python3}"
VENV="$HARRIER_HOME/venv-openai"
OPENAI_SPEC="${OPENAI_SPEC:-openai>=1.40,<4}"

log() { echo "test_openai_client: $*" >&2; }

if [[ ! -x "$VENV/bin/python" ]]; then
    log "creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c 'import openai' 2>/dev/null; then
    log "installing $OPENAI_SPEC from PyPI"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check "$OPENAI_SPEC"
fi

BIN="${HARRIER_BIN:-target/debug/harrier}"
if [[ -z "${HARRIER_BIN:-}" ]]; then
    cargo build --quiet -p harrier-frontend --bin harrier
fi

free_port() { "$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
KEY="sk-harrier-openai-test"
SERVERS=()
OUTS=()
cleanup() {
    for pid in "${SERVERS[@]}"; do
        if kill -0 "$pid" 2>/dev/null; then kill -KILL "$pid" 2>/dev/null || true; fi
    done
    for f in "${OUTS[@]}"; do rm -f "$f" "$f.err"; done
}
trap cleanup EXIT

# start_server PORT ARGS...: starts `harrier serve` in the background, waits until it serves.
start_server() {
    local port="$1"; shift
    local out; out="$(mktemp)"
    OUTS+=("$out")
    "$BIN" serve --port "$port" --api-key "$KEY" --kv-cache-mib 64 "$@" >"$out" 2>"$out.err" &
    local pid=$!
    SERVERS+=("$pid")
    for _ in $(seq 1 600); do
        if grep -q "Harrier is serving" "$out"; then return 0; fi
        if ! kill -0 "$pid" 2>/dev/null; then
            log "the server ($*) exited during start-up:"; cat "$out.err" >&2; exit 1
        fi
        sleep 0.5
    done
    log "the server ($*) did not become ready"; tail -20 "$out.err" >&2; exit 1
}

PORT="$(free_port)"
start_server "$PORT" --api-server-count 2
# The same model with speculative decoding (the committed draft): every check again, plus
# greedy text equal to the first server's.
SPEC_PORT="$(free_port)"
start_server "$SPEC_PORT" --speculative-model engine-core/models/harrier-cpu-draft

status=0
"$VENV/bin/python" scripts/test_openai_client.py --base-url "http://127.0.0.1:$PORT/v1" --api-key "$KEY" || status=$?
"$VENV/bin/python" scripts/test_openai_client.py --base-url "http://127.0.0.1:$SPEC_PORT/v1" --api-key "$KEY" \
    --reference-base-url "http://127.0.0.1:$PORT/v1" || status=$?

for i in "${!SERVERS[@]}"; do
    kill -TERM "${SERVERS[$i]}"
    if ! wait "${SERVERS[$i]}"; then
        log "a server did not exit cleanly on SIGTERM"; tail -20 "${OUTS[$i]}.err" >&2; status=1
    fi
done
exit "$status"
