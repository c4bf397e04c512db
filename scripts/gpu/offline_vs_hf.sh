#!/usr/bin/env bash
# Offline throughput, side by side on one checkpoint in one call: transformers' continuous
# batching (`generate_batch`, paged|sdpa; the shared baseline script, carried as
# .gpu/hf_baseline.py; run second, limited to HF_TIMEOUT seconds) vs Harrier's CUDA engine core driven by `harrier bench serve
# --engine-endpoint` (token-id prompts, ignore_eos). Carry .gpu/ (harrier, hf_baseline.py).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/harrier-offline-out}"; mkdir -p "$OUT"
N="${N:-256}"; IN="${IN:-512}"; OUTLEN="${OUTLEN:-256}"
M=/tmp/harrier-offline-1b
.gpu/harrier gen-model --preset llama-3.2-1b --out "$M" --no-tokenizer 2>&1 | tail -1
echo "== harrier engine core, CUDA ($N x $IN in, $OUTLEN out, all at once)"
.gpu/harrier engine-core --model "$M" --device cuda --endpoint tcp://127.0.0.1:5599 --max-num-seqs 256 --max-num-batched-tokens 8192 2>"$OUT/engine.err" &
E=$!
for _ in $(seq 1 120); do grep -q "engine core ready" "$OUT/engine.err" && break; sleep 0.5; done
.gpu/harrier bench serve --engine-endpoint tcp://127.0.0.1:5599 --num-prompts "$N" --input-len "$IN" --output-len "$OUTLEN" --no-progress --json "$OUT/harrier.json" 2>&1 | tail -14
kill -TERM "$E"; wait "$E"; echo "engine exit status: $?"
# transformers second, with what is left of the call (HF_TIMEOUT seconds).
echo "== transformers (generate_batch, $N x $IN in, $OUTLEN out)"
PYTHONUNBUFFERED=1 timeout "${HF_TIMEOUT:-420}" python3 .gpu/hf_baseline.py --model-dir "$M" --prompts "$N" --in-len "$IN" --out-len "$OUTLEN" --json "$OUT/hf.json" 2>&1 | tail -12
