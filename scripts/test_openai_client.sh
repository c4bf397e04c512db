#!/usr/bin/env bash
# The official `openai` Python package against a real `harrier serve` (2 front ends, the
# embedded default model, harrier-cpu). Idempotent set-up: a venv at
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

PORT="$("$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
KEY="sk-harrier-openai-test"
OUT="$(mktemp)"
"$BIN" serve --api-server-count 2 --port "$PORT" --api-key "$KEY" --kv-cache-mib 64 >"$OUT" 2>"$OUT.err" &
SERVER=$!
cleanup() {
    if kill -0 "$SERVER" 2>/dev/null; then
        kill -KILL "$SERVER" 2>/dev/null || true
    fi
    rm -f "$OUT" "$OUT.err"
}
trap cleanup EXIT

for _ in $(seq 1 600); do
    if grep -q "Harrier is serving" "$OUT"; then break; fi
    if ! kill -0 "$SERVER" 2>/dev/null; then
        log "the server exited during start-up:"; cat "$OUT.err" >&2; exit 1
    fi
    sleep 0.5
done
grep -q "Harrier is serving" "$OUT" || { log "the server did not become ready"; tail -20 "$OUT.err" >&2; exit 1; }

status=0
"$VENV/bin/python" scripts/test_openai_client.py --base-url "http://127.0.0.1:$PORT/v1" --api-key "$KEY" || status=$?

kill -TERM "$SERVER"
if ! wait "$SERVER"; then
    log "the server did not exit cleanly on SIGTERM"; tail -20 "$OUT.err" >&2; status=1
fi
exit "$status"
