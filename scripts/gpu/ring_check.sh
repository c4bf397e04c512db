#!/usr/bin/env bash
# Device script (issue 16): harrier-cuda-tool bench-ring for the Llama 3.2 1B / 3B and 3.1 8B
# shapes, the ring against the engine's skinny launches, with and without the layers' residual
# adds and norms (docs/benchmarks.md, session 17). bench-ring reads only config.json, so the
# model folders are written here (no weights). Carry .gpu/harrier-cuda-tool (or .gpu-z with
# scripts/gpu/binab.sh's compressed copies); output in $OUT/ring.log.
#   bash scripts/gpu/ring_check.sh [1b 3b 8b]
set -uo pipefail
OUT="${OUT:-/tmp/harrier-ring-out}"
W=/tmp/harrier-ring-work
mkdir -p "$OUT" "$W" .gpu
if [[ -f .gpu-z/harrier-cuda-tool.xz && ! -x .gpu/harrier-cuda-tool ]]; then
    xz -dc .gpu-z/harrier-cuda-tool.xz >.gpu/harrier-cuda-tool && chmod +x .gpu/harrier-cuda-tool
fi
export HARRIER_HOME="$W/home"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
config() { # name hidden intermediate heads kv_heads layers head_dim tied
    mkdir -p "$W/$1"
    cat >"$W/$1/config.json" <<JSON
{"architectures":["LlamaForCausalLM"],"model_type":"llama","hidden_size":$2,"intermediate_size":$3,
 "num_attention_heads":$4,"num_key_value_heads":$5,"num_hidden_layers":$6,"head_dim":$7,
 "tie_word_embeddings":$8,"vocab_size":128256,"rms_norm_eps":1e-05,"rope_theta":500000.0,
 "max_position_embeddings":131072,"hidden_act":"silu","torch_dtype":"bfloat16",
 "bos_token_id":128000,"eos_token_id":128001}
JSON
}
config 1b 2048 8192 32 8 16 64 true
config 3b 3072 8192 24 8 28 128 true
config 8b 4096 14336 32 8 32 128 false
models=("$@")
[[ ${#models[@]} -eq 0 ]] && models=(1b 3b 8b)
for m in "${models[@]}"; do
    for mode in "--residual" ""; do
        echo "== $m $mode" | tee -a "$OUT/ring.log"
        timeout 300 .gpu/harrier-cuda-tool bench-ring --model "$W/$m" $mode --rounds 3 2>&1 \
            | grep -vE "^\s+[0-9]+:|^\s+at " | tail -18 | tee -a "$OUT/ring.log"
    done
done
